"""KV-cache quantization (``kv_cache_scheme``, FP8 per tensor and per head) on a 2-layer random Llama (hidden 64,
4 heads, 2 KV heads): the scales against an independent float64 computation of the post-RoPE keys and the values
over the calibration tokens; the checkpoint's layout and config; reload with transformers; refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from llmc_fsm_quantization import load_kv_cache_scales
from safetensors import safe_open
from tiny_quant_models import tiny_llama

import llmc_fsm

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
KV = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}


def _data() -> torch.Tensor:
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding of ``x`` ``[batch, heads, seq, dim]`` in float64 (rotate-half form)."""
    dim, seq = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _reference_ranges(propagated, original, data, batch_size):
    """Per layer and batch of ``batch_size``: (keys, values, queries) ``[batch, heads, seq, head_dim]`` float64 (keys
    and queries after the rotary embedding), from inputs
    each layer's k_proj / v_proj receive in ``propagated`` with every fake quantization off (what the calibration of
    that layer saw: llm-compressor's calibration, activations in full precision) and the *original* projection
    weights (the calibration ran before the layer was quantized)."""
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(propagated.model.layers))}
    handles = [
        layer.self_attn.k_proj.register_forward_pre_hook(lambda m, a, i=i: inputs[i].append(a[0].double()))
        for i, layer in enumerate(propagated.model.layers)
    ]
    for module in propagated.modules():
        module.quantization_enabled = False  # compressed-tensors' switch: no input, weight or KV-cache quantization
    with torch.no_grad():
        for b in range(0, data.shape[0], batch_size):
            propagated(data[b : b + batch_size], use_cache=False)
    for module in propagated.modules():
        del module.quantization_enabled
    for h in handles:
        h.remove()
    theta = float(original.config.rope_parameters["rope_theta"])
    out = {}
    for i, layer in enumerate(original.model.layers):
        a = layer.self_attn
        wq, wk, wv = a.q_proj.weight.double(), a.k_proj.weight.double(), a.v_proj.weight.double()
        per_batch = []
        for x in inputs[i]:
            shape = (*x.shape[:-1], -1, a.head_dim)
            k = _rope((x @ wk.T).view(shape).transpose(1, 2), theta)
            v = (x @ wv.T).view(shape).transpose(1, 2)
            q = _rope((x @ wq.T).view(shape).transpose(1, 2), theta)
            per_batch.append((k, v, q))
        out[i] = per_batch
    return out


def _expected_scale(states: list[torch.Tensor], observer: str, per_head: bool) -> torch.Tensor:
    """max(|min|, |max|) / 448 by observer, per tensor ``[1]`` or per head ``[heads, 1, 1]``."""

    def lo_hi(x):
        if per_head:
            return x.amin(dim=(0, 2, 3)).reshape(-1, 1, 1), x.amax(dim=(0, 2, 3)).reshape(-1, 1, 1)
        return x.amin().reshape(1), x.amax().reshape(1)

    calls = [lo_hi(x) for x in states]
    if observer == "static_minmax":
        lo = torch.stack([c[0] for c in calls]).amin(0)
        hi = torch.stack([c[1] for c in calls]).amax(0)
    else:  # minmax: moving average with constant 0.01, from the first observation's values
        lo, hi = calls[0]
        for c in calls[1:]:
            lo, hi = 0.99 * lo + 0.01 * c[0], 0.99 * hi + 0.01 * c[1]
    return torch.maximum(lo.clamp(max=0).abs(), hi.clamp(min=0)) / FP8_MAX


def logits_with_and_without(model, x):
    """(logits of ``model`` on ``x``, logits with every attention's ``quantization_enabled`` off)."""
    with torch.no_grad():
        quantized = model(x).logits
        for layer in model.model.layers:
            layer.self_attn.quantization_enabled = False
        off = model(x).logits
        for layer in model.model.layers:
            del layer.self_attn.quantization_enabled
    return quantized, off


@pytest.mark.parametrize("modifier", ["QuantizationModifier", "GPTQModifier"])
@pytest.mark.parametrize(
    ("strategy", "observer"), [("tensor", "static_minmax"), ("attn_head", "static_minmax"), ("attn_head", None)]
)
def test_kv_scales_are_the_range_of_the_keys_and_values_over_the_calibration_tokens(
    tmp_path, modifier, strategy, observer
) -> None:
    model, data = tiny_llama(), _data()
    original = copy.deepcopy(model)
    kv = {**KV, "strategy": strategy, **({"observer": observer} if observer else {})}
    recipe = {"q": {modifier: {"scheme": "W8A8", "kv_cache_scheme": kv}}}
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=2, output_dir=out, progress=False)
    used = observer or "minmax"  # llm-compressor's default observer of k and v
    # one observation per calibration sample (llm-compressor's, at its batch_size 1), whatever the batch size; the
    # layers before calibrate on full-precision activations: round-to-nearest's on the original weights (it rounds
    # them when the model is saved, in llm-compressor), GPTQ's on the weights it updated (with quantization off, the
    # compressed model's frozen weights hold exactly those)
    propagated = original if modifier == "QuantizationModifier" else model
    reference = _reference_ranges(propagated, original, data, batch_size=1)
    heads = model.config.num_key_value_heads
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        for base, index in (("k", 0), ("v", 1)):
            expected = _expected_scale([kv_pair[index] for kv_pair in reference[i]], used, strategy == "attn_head")
            got = getattr(a, f"{base}_scale")
            assert got.shape == ((heads, 1, 1) if strategy == "attn_head" else (1,))
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)
    if strategy == "attn_head":  # per head means per head: the two KV heads' key ranges differ here
        assert not torch.equal(model.model.layers[0].self_attn.k_scale[0], model.model.layers[0].self_attn.k_scale[1])
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"] == {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": strategy,
        "group_size": None,
        "observer": used,
    }
    with safe_open(str(out / "model.safetensors"), "pt") as fh:  # vLLM's names: <attention>.k_scale / .v_scale
        for i, layer in enumerate(model.model.layers):
            for base in ("k", "v"):
                saved = fh.get_tensor(f"model.layers.{i}.self_attn.{base}_scale")
                assert torch.equal(saved, getattr(layer.self_attn, f"{base}_scale").data)


def test_the_in_memory_model_quantizes_its_kv_cache_and_a_transformers_reload_gets_it_back(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model, data = tiny_llama(), _data()
    recipe = {"q": {"QuantizationModifier": {"scheme": "W8A8", "kv_cache_scheme": KV}}}
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=2, output_dir=out, progress=False)
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    quantized_kv, full_kv = logits_with_and_without(model, x)
    with torch.no_grad():
        # transformers 5.24 + compressed-tensors 0.20 load the weights but not the KV scales (see kv_cache's docs)
        assert not hasattr(reloaded.model.layers[0].self_attn, "k_scale")
        assert torch.equal(reloaded(x).logits, full_kv)
        assert not torch.equal(full_kv, quantized_kv)  # the FP8 KV cache changes the logits
        assert load_kv_cache_scales(reloaded, out) == 2
        assert torch.equal(reloaded(x).logits, quantized_kv)
        # generation with transformers' own cache: the quantized keys and values go into it
        generated = model.generate(x[:1, :8], max_new_tokens=4, do_sample=False)
        assert torch.equal(reloaded.generate(x[:1, :8], max_new_tokens=4, do_sample=False), generated)


def test_a_bare_gptq_modifier_takes_the_kv_cache_scheme_of_the_quantization_modifier() -> None:
    model, data = tiny_llama(), _data()
    recipe = {"q": {"QuantizationModifier": {"scheme": "W8A8", "kv_cache_scheme": KV}, "GPTQModifier": {}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=2, progress=False)
    assert torch.isfinite(model.model.layers[1].self_attn.v_scale).all()


@pytest.mark.parametrize(
    ("modifier", "args", "message"),
    [
        (
            "GPTQModifier",
            {"scheme": "W8A8", "kv_cache_scheme": {**KV, "type": "int"}},
            "kv_cache_scheme: only an FP8 KV cache is supported (num_bits 8, type float; vLLM's KV-cache format), "
            "got num_bits 8, type int; use {num_bits: 8, type: float, symmetric: true, dynamic: false, strategy: "
            "tensor (or attn_head)}",
        ),
        (
            "GPTQModifier",
            {"scheme": "W8A8", "kv_cache_scheme": {**KV, "strategy": "channel"}},
            "kv_cache_scheme: strategy channel is not supported; use tensor (one scale) or attn_head (per head)",
        ),
        (
            "GPTQModifier",
            {"scheme": "W8A8", "kv_cache_scheme": {**KV, "dynamic": True}},
            "kv_cache_scheme: the KV-cache scales are static and symmetric (calibrated once); use {num_bits: 8, type: "
            "float, symmetric: true, dynamic: false, strategy: tensor (or attn_head)}",
        ),
        (
            "QuantizationModifier",
            {"scheme": "W8A8", "kv_cache_scheme": {**KV, "observer": "mse"}},
            "kv_cache_scheme: observer 'mse' is not supported; use one of minmax, static_minmax, memoryless_minmax",
        ),
        (
            "AutoRoundModifier",
            {"scheme": "W8A8", "kv_cache_scheme": KV},
            "kv_cache_scheme is not implemented for AutoRoundModifier; use GPTQModifier or QuantizationModifier",
        ),
    ],
)
def test_unsupported_kv_cache_schemes_are_refused_before_any_work(modifier, args, message) -> None:
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"q": {modifier: args}}, dataset=_data(), progress=False)
    assert message in str(info.value)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert not any(n.endswith("_scale") for n, _ in model.named_parameters())


def test_kv_cache_quantization_needs_calibration_data_even_for_round_to_nearest() -> None:
    from llmc_fsm_quantization import QuantizationModifier

    assert "calibration_data" in QuantizationModifier(scheme="W8A8", kv_cache_scheme=KV).required_keys()
    assert "calibration_data" not in QuantizationModifier(scheme="W8A8").required_keys()


def resumed_after_layer_0(tmp_path, monkeypatch, recipe):
    """(uninterrupted model, model of a run stopped after layer 0 was saved and resumed) for ``recipe`` on a 3-layer
    tiny Llama; asserts their state dicts are equal bitwise."""
    from llmc_fsm.oneshot_job.resume import LayerProgress

    kw = {"recipe": recipe, "dataset": _data(), "batch_size": 2, "progress": False}
    ref = llmc_fsm.oneshot(model=tiny_llama(3), **kw)
    original = LayerProgress.save

    def save(self, index, module):  # stop the run after layer 0 is saved
        original(self, index, module)
        if index == 0:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(LayerProgress, "save", save)
        with pytest.raises(KeyboardInterrupt):
            llmc_fsm.oneshot(model=tiny_llama(3), output_dir=tmp_path / "o", **kw)
    out = llmc_fsm.oneshot(model=tiny_llama(3), output_dir=tmp_path / "o", resume=True, **kw)
    ref_state, out_state = ref.state_dict(), out.state_dict()
    assert ref_state.keys() == out_state.keys()
    assert [k for k in ref_state if not torch.equal(ref_state[k], out_state[k])] == []
    return ref, out


def test_an_interrupted_run_resumes_with_the_kv_scales_bitwise(tmp_path, monkeypatch) -> None:
    recipe = {"q": {"GPTQModifier": {"scheme": "W8A8", "kv_cache_scheme": {**KV, "strategy": "attn_head"}}}}
    _, out = resumed_after_layer_0(tmp_path, monkeypatch, recipe)
    assert "model.layers.2.self_attn.k_scale" in out.state_dict()


def test_kv_cache_quantization_with_low_memory_is_refused_before_any_work(tmp_path) -> None:
    source = tmp_path / "model"
    tiny_llama().save_pretrained(source)
    before = sorted(p.name for p in source.iterdir())
    recipe = {"q": {"GPTQModifier": {"scheme": "W8A8", "kv_cache_scheme": KV}}}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(
            model=str(source),
            recipe=recipe,
            dataset=_data(),
            output_dir=tmp_path / "out",
            low_memory=True,
            progress=False,
        )
    assert str(info.value) == (
        "low_memory (--low-memory) cannot run this job: GPTQModifier: kv_cache_scheme observes the attention's keys "
        "and values in the whole model's forward; run without low_memory"
    )
    assert sorted(p.name for p in source.iterdir()) == before
    assert not (tmp_path / "out").exists()


def test_a_kv_cache_only_checkpoint_is_not_pruned_further(tmp_path) -> None:
    # its k/v scales are not loaded by transformers: pruning it again would save a kv_cache_scheme without scales
    source = tmp_path / "model"
    tiny_llama().save_pretrained(source)
    first = tmp_path / "kv"
    llmc_fsm.oneshot(model=str(source), recipe={"q": {"QuantizationModifier": {"kv_cache_scheme": KV}}},
                     dataset=_data(), output_dir=first, progress=False)
    before = {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(first), recipe={"p": {"MagnitudePruningModifier": {"sparsity": 0.5}}},
                         output_dir=tmp_path / "pruned", progress=False)
    assert str(info.value) == (
        "MagnitudePruningModifier: the model is already quantized (its config carries a quantization_config "
        "(quant_method 'compressed-tensors') with a kv_cache_scheme and no weight scheme: its KV-cache scales, which "
        "transformers does not load, would be lost; put the kv_cache_scheme in the recipe that compresses the "
        "full-precision model); compress the original full-precision model instead"
    )
    assert not (tmp_path / "pruned").exists()
    assert {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()} == before


def test_a_fused_qkv_projection_phi3_gets_kv_scales_per_head_and_reloads(tmp_path) -> None:
    """Phi-3 computes q, k and v with one ``qkv_proj`` (rows: 4 query heads, then 2 key heads, then 2 value heads of
    16): its attention is found, its KV heads read from its config, and the per-head scales equal the float64 range of
    the keys (after the rotary embedding) and values its ``qkv_proj`` rows give. Before, a fused projection was
    refused ("no attention module with k_proj, v_proj")."""
    import transformers

    config = transformers.AutoConfig.for_model(
        "phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    original, data = copy.deepcopy(model), _data()
    inputs: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    handles = [
        layer.self_attn.qkv_proj.register_forward_pre_hook(lambda m, a, i=i: inputs[i].append(a[0].double()))
        for i, layer in enumerate(original.model.layers)
    ]
    with torch.no_grad():
        original(data, use_cache=False)  # round-to-nearest calibrates every layer on the original weights
    for h in handles:
        h.remove()
    kv = {**KV, "strategy": "attn_head", "observer": "static_minmax"}
    recipe = {"q": {"QuantizationModifier": {"scheme": "W8A8", "ignore": ["lm_head"], "kv_cache_scheme": kv}}}
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=out, progress=False)
    theta = float(config.rope_parameters["rope_theta"])
    for i, layer in enumerate(original.model.layers):
        w = layer.self_attn.qkv_proj.weight.double()
        x = inputs[i][0]
        shape = (*x.shape[:-1], -1, 16)
        k = _rope((x @ w[64:96].T).view(shape).transpose(1, 2), theta)
        v = (x @ w[96:128].T).view(shape).transpose(1, 2)
        attention = model.model.layers[i].self_attn
        torch.testing.assert_close(attention.k_scale.double(), _expected_scale([k], "static_minmax", True), rtol=1e-5, atol=0)
        torch.testing.assert_close(attention.v_scale.double(), _expected_scale([v], "static_minmax", True), rtol=1e-5, atol=0)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    load_kv_cache_scales(reloaded, out)
    with torch.no_grad():
        assert torch.equal(reloaded(data).logits, model(data).logits)


def test_linear_attention_layers_of_a_hybrid_stack_take_no_kv_scales(tmp_path) -> None:
    """MiniMax's lightning attention reads a recurrent state from its cache argument: the KV-cache stand-in was put
    there too and the run failed with "AttributeError: get_linear_cache" (B2, session 31). Its full-attention layers
    get scales; its linear ones none (the experts are quantized too: they do not reload dense)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    from tiny_families import build

    from llmc_fsm_quantization.kv_cache import attention_modules

    model = build("minimax")
    assert sorted(attention_modules(model)) == ["model.layers.1.self_attn", "model.layers.3.self_attn"]
    quantize = {"scheme": "W8A8", "ignore": ["lm_head", "re:.*gate$"], "kv_cache_scheme": KV}
    recipe = {"q": {"QuantizationModifier": quantize}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=torch.randint(3, 128, (4, 16)), progress=False)
    scales = {n for n, _ in model.named_parameters() if n.endswith(("k_scale", "v_scale"))}
    assert scales == {f"model.layers.{i}.self_attn.{k}_scale" for i in (1, 3) for k in "kv"}
