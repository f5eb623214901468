"""llm-compressor's two forms without a weight scheme, on the tiny Llama of test_kv_cache (2 layers, hidden 64, 4 heads,
2 KV heads): ``kv_cache_scheme`` alone (KV-cache scales only, weights untouched) and attention quantization (a config
group targeting the attention with input activations only: FP8 query, key and value scales). Scales against the
independent float64 reference of test_kv_cache; the saved config against compressed-tensors' own for such a model;
reload with transformers + ``load_kv_cache_scales``; refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from llmc_fsm_quantization import load_kv_cache_scales
from safetensors import safe_open
from test_kv_cache import KV, _data, _expected_scale, _reference_ranges, logits_with_and_without, resumed_after_layer_0
from tiny_quant_models import tiny_llama

import llmc_fsm


def _attention_recipe(strategy: str, observer: str | None = None) -> dict:
    """llm-compressor's attention quantization (examples/quantization_attention): input activations only."""
    args = {"num_bits": 8, "type": "float", "strategy": strategy, **({"observer": observer} if observer else {})}
    group = {"targets": ["LlamaAttention"], "input_activations": args}
    return {"q": {"QuantizationModifier": {"config_groups": {"attention": group}}}}


def _compressed_tensors_config(config: dict) -> dict:
    """The ``quantization_config`` compressed-tensors 0.20 itself builds for ``config`` applied to the tiny Llama
    (its ``apply_quantization_config`` + ``ModelCompressor.from_pretrained_model``), the fields that describe what
    is quantized. Its attention hooks need an attention with a ``past_key_values`` argument, which transformers
    5.24's has not (it is ``cache``): its check is patched to accept the Llama attention, for this reference only."""
    import compressed_tensors.quantization.lifecycle.apply as apply
    import compressed_tensors.quantization.lifecycle.initialize as initialize
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config

    def cached_attention(module):
        return type(module).__name__ == "LlamaAttention"

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(initialize, "is_cached_attention_module", cached_attention)
        patch.setattr(apply, "is_cached_attention_module", cached_attention)
        model = tiny_llama()
        apply_quantization_config(model, QuantizationConfig.model_validate(config))
        dumped = ModelCompressor.from_pretrained_model(model).quantization_config
    dumped.quantization_status = QuantizationStatus.COMPRESSED
    fields = ("config_groups", "kv_cache_scheme", "format", "ignore", "quantization_status")
    return {k: v for k, v in json.loads(dumped.model_dump_json()).items() if k in fields}


def _saved_config(out) -> dict:
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    fields = ("config_groups", "kv_cache_scheme", "format", "ignore", "quantization_status")
    return {k: v for k, v in config.items() if k in fields}


def _scale_checks(model, original, data, observer, per_head, bases):
    """Every layer's ``<base>_scale`` against the float64 reference (the calibration ran on the original weights)."""
    reference = _reference_ranges(original, original, data, batch_size=1)
    index = {"k": 0, "v": 1, "q": 2}
    for i, layer in enumerate(model.model.layers):
        for base in bases:
            expected = _expected_scale([states[index[base]] for states in reference[i]], observer, per_head)
            torch.testing.assert_close(getattr(layer.self_attn, f"{base}_scale").double(), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_kv_cache_scheme_alone_calibrates_the_kv_scales_and_touches_no_weight(tmp_path, strategy) -> None:
    from transformers import AutoModelForCausalLM

    model, data = tiny_llama(), _data()
    original = copy.deepcopy(model)
    kv = {**KV, "strategy": strategy}
    out = tmp_path / "out"
    recipe = {"q": {"QuantizationModifier": {"kv_cache_scheme": kv}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=2, output_dir=out, progress=False)
    state, before = model.state_dict(), original.state_dict()
    scales = sorted(k for k in state if k not in before)
    assert scales == [f"model.layers.{i}.self_attn.{b}_scale" for i in (0, 1) for b in ("k", "v")]
    assert [k for k in before if not torch.equal(state[k], before[k])] == []  # weights bitwise unchanged
    _scale_checks(model, original, data, "minmax", strategy == "attn_head", ("k", "v"))
    # the checkpoint: the weights as they were, the scales under vLLM's names, compressed-tensors' config of a
    # KV-only model (no config group, dense format), recording the observer used
    expected = _compressed_tensors_config({"config_groups": {}, "kv_cache_scheme": kv})
    expected["kv_cache_scheme"]["observer"] = "minmax"
    assert _saved_config(out) == expected
    assert expected["config_groups"] == {} and expected["format"] == "dense"
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert sorted(fh.keys()) == sorted([*before, *scales])
        assert all(torch.equal(fh.get_tensor(k), state[k]) for k in fh.keys())
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    reloaded_state = reloaded.state_dict()
    assert reloaded_state.keys() == before.keys()
    assert all(torch.equal(reloaded_state[k], before[k]) for k in before)  # the weights reload exactly
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    quantized, off = logits_with_and_without(model, x)
    with torch.no_grad():
        assert torch.equal(off, original(x).logits)
        assert not torch.equal(quantized, off)
        assert torch.equal(reloaded(x).logits, off)  # transformers 5.24 ignores the KV scales
        assert load_kv_cache_scales(reloaded, out) == 2
        assert torch.equal(reloaded(x).logits, quantized)


@pytest.mark.parametrize(("strategy", "observer"), [("tensor", "static_minmax"), ("attn_head", None)])
def test_attention_quantization_calibrates_query_key_and_value_scales(tmp_path, strategy, observer) -> None:
    from transformers import AutoModelForCausalLM

    model, data = tiny_llama(), _data()
    original = copy.deepcopy(model)
    out = tmp_path / "out"
    recipe = _attention_recipe(strategy, observer)
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=2, output_dir=out, progress=False)
    used = observer or "minmax"
    per_head = strategy == "attn_head"
    state, before = model.state_dict(), original.state_dict()
    assert [k for k in before if not torch.equal(state[k], before[k])] == []
    a = model.model.layers[0].self_attn
    assert a.q_scale.shape == ((4, 1, 1) if per_head else (1,)) and a.k_scale.shape == ((2, 1, 1) if per_head else (1,))
    _scale_checks(model, original, data, used, per_head, ("q", "k", "v"))
    # compressed-tensors' config for the same recipe: the attention group and the KV cache with its arguments
    args = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    group = {"targets": ["LlamaAttention"], "input_activations": args}
    expected = _compressed_tensors_config({"config_groups": {"group_0": group}})
    expected["kv_cache_scheme"]["observer"] = used
    expected["config_groups"]["group_0"]["input_activations"]["observer"] = used
    assert _saved_config(out) == expected
    with safe_open(str(out / "model.safetensors"), "pt") as fh:  # the names vLLM reads
        for i in (0, 1):
            for base in ("q", "k", "v"):
                key = f"model.layers.{i}.self_attn.{base}_scale"
                assert torch.equal(fh.get_tensor(key), state[key])
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    quantized, off = logits_with_and_without(model, x)
    # the queries are quantized too: the same k/v scales without q quantization (kv_cache_scheme alone) differ
    kv_only = tiny_llama()
    kv = {**KV, "strategy": strategy, "observer": used}
    llmc_fsm.oneshot(
        model=kv_only,
        recipe={"q": {"QuantizationModifier": {"kv_cache_scheme": kv}}},
        dataset=data,
        batch_size=2,
        progress=False,
    )
    assert torch.equal(kv_only.model.layers[1].self_attn.v_scale, model.model.layers[1].self_attn.v_scale)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(off, original(x).logits)
        assert not torch.equal(quantized, off)
        assert not torch.equal(quantized, kv_only(x).logits)
        assert torch.equal(reloaded(x).logits, off)  # transformers 5.24 ignores q/k/v scales (see docs)
        assert load_kv_cache_scales(reloaded, out) == 2
        assert torch.equal(reloaded(x).logits, quantized)
        generated = model.generate(x[:1, :8], max_new_tokens=4, do_sample=False)
        assert torch.equal(reloaded.generate(x[:1, :8], max_new_tokens=4, do_sample=False), generated)


_INT = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False, "strategy": "tensor"}


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        (
            {"config_groups": {"attention": {"targets": ["LlamaAttention"], "input_activations": _INT}}},
            "config_groups entry 'attention': attention quantization: only an FP8 KV cache is supported (num_bits 8, "
            "type float; vLLM's KV-cache format), got num_bits 8, type int; use {num_bits: 8, type: float, "
            "symmetric: true, dynamic: false, strategy: tensor (or attn_head)}",
        ),
        (
            {
                "config_groups": {"attention": {"targets": ["LlamaAttention"], "input_activations": KV}},
                "kv_cache_scheme": KV,
            },
            "config_groups entry 'attention' quantizes the attention (queries, keys and values), which quantizes "
            "the KV cache with the same arguments: leave kv_cache_scheme out",
        ),
        (
            {"config_groups": {"attention": {"targets": ["re:.*q_proj$"], "input_activations": KV}}},
            "QuantizationModifier: attention quantization targets ['re:.*q_proj$'] selects "
            "model.layers.{0..1}.self_attn.q_proj, which is not an attention module with k_proj, v_proj and a "
            "cache argument (cache, past_key_values, past_key_value); target the attention class, e.g. "
            "LlamaAttention",
        ),
    ],
)
def test_unsupported_attention_quantization_is_refused_before_any_work(recipe, message) -> None:
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"q": {"QuantizationModifier": recipe}}, dataset=_data(), progress=False)
    assert message in str(info.value)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_attention_quantization_with_a_weight_group_reloads_with_the_in_memory_logits(tmp_path) -> None:
    # GPTQ on the Linear weights and attention quantization in one modifier: two config groups in the checkpoint
    from transformers import AutoModelForCausalLM

    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}
    recipe = _attention_recipe("tensor")
    recipe = {
        "q": {
            "GPTQModifier": {
                "config_groups": {
                    "w": {"targets": ["Linear"], "weights": weights},
                    **recipe["q"]["QuantizationModifier"]["config_groups"],
                }
            }
        }
    }
    model, out = tiny_llama(), tmp_path / "out"
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=_data(), batch_size=2, output_dir=out, progress=False)
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert [(g["targets"], g["weights"] is None, g["format"]) for g in groups.values()] == [
        (["Linear"], False, "pack-quantized"),
        (["LlamaAttention"], True, "dense"),
    ]
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert load_kv_cache_scales(reloaded, out) == 2
        assert torch.equal(reloaded(x).logits, model(x).logits)


def test_an_interrupted_attention_quantization_run_resumes_bitwise(tmp_path, monkeypatch) -> None:
    ref, out = resumed_after_layer_0(tmp_path, monkeypatch, _attention_recipe("attn_head"))
    assert "model.layers.2.self_attn.q_scale" in out.state_dict()
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(out(x).logits, ref(x).logits)


def test_a_group_with_weights_on_the_attention_class_is_refused_before_any_work() -> None:
    """B3's case (session 31): ``targets: [LlamaAttention]`` with FP8 weights and static inputs ran as Linear
    quantization of q/k/v/o_proj without a word (no q/k/v scales); llm-compressor 0.14 refuses it."""
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    group = {"targets": ["LlamaAttention"], "weights": {**fp8, "strategy": "channel"},
             "input_activations": {**fp8, "strategy": "tensor", "dynamic": False}}  # fmt: skip
    recipe = {"s": {"QuantizationModifier": {"ignore": ["lm_head"], "config_groups": {"attention": group}}}}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=torch.randint(0, 128, (4, 16)), progress=False)
    assert str(info.value) == (
        "QuantizationModifier: config group 'attention' targets 'LlamaAttention', which names the attention module "
        "model.layers.0.self_attn itself, with weights: compressed-tensors (and llm-compressor 0.14) cannot apply "
        "weight quantization to an attention module; target its projections (e.g. 're:.*self_attn.(q|k|v|o)_proj$'), "
        "or give the group input_activations only (attention quantization: queries, keys and values)"
    )
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
