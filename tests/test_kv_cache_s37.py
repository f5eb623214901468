"""KV-cache and static-input scales, session 37 (found by a tester): the reloaded NVFP4 checkpoint's KV scales in
the model's float dtype; float32 moving averages in float32, as llm-compressor 0.14's ``lerp``; the refusal of
multi-head latent attention (DeepSeek-V3) naming its class. References are computed here by hand."""

from __future__ import annotations

import pytest
import torch
from llmc_fsm_quantization import kv_cache, load_kv_cache_scales
from llmc_fsm_quantization._base import CalibrationStatistics
from tiny_families import build
from tiny_llama import llama

import llmc_fsm

KV = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
C = 0.01


def _data() -> torch.Tensor:
    return torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("scheme", ["NVFP4A16", "NVFP4"])
def test_a_reloaded_nvfp4_bfloat16_checkpoint_with_an_fp8_kv_cache_gives_the_in_memory_logits(tmp_path, scheme):
    """Found by a tester: the reloaded compressed-tensors model's attention holds no floating weight before its
    first forward (``weight_packed`` uint8, ``weight_scale`` fp8, ``weight_global_scale`` float32), and the KV
    scales took the dtype of its first parameter, float32: the keys and values became float32 and the bfloat16
    forward failed ("Expected query, key, and value to have the same dtype")."""
    from transformers import AutoModelForCausalLM

    llama(layers=2).save_pretrained(tmp_path / "src")  # loaded in bfloat16 as transformers loads it (its rotary
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16).eval()  # inv_freq float32)
    recipe = {"q": {"QuantizationModifier": {"scheme": scheme, "ignore": ["lm_head"], "kv_cache_scheme": KV}}}
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=_data(), output_dir=out, progress=False)
    x = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x).logits
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    assert load_kv_cache_scales(reloaded, out) == 2
    for i, layer in enumerate(reloaded.model.layers):
        for base in ("k", "v"):
            got = getattr(layer.self_attn, f"{base}_scale")
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, getattr(model.model.layers[i].self_attn, f"{base}_scale"))
    with torch.no_grad():
        logits = reloaded(x).logits
    assert logits.dtype == torch.bfloat16
    assert torch.equal(logits, expected)


def _samples() -> torch.Tensor:
    """12 float32 samples of 3 tokens x 8 features whose ranges vary from sample to sample."""
    g = torch.Generator().manual_seed(3)
    return torch.randn(12, 3, 8, generator=g) * torch.linspace(0.5, 3.0, 12)[:, None, None]


def _lerp(samples: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's min / max averaged from the first as ``v * (1 - c) + v_sample * c``, every step in ``dtype``."""
    lo, hi = samples[0].min().to(dtype), samples[0].max().to(dtype)
    for s in samples[1:]:
        lo = lo * (1.0 - C) + s.min().to(dtype) * C
        hi = hi * (1.0 - C) + s.max().to(dtype) * C
    return lo, hi


def test_float32_input_ranges_are_averaged_in_float32_as_llm_compressor_lerps_them() -> None:
    """Found by a tester: a float32 model's ranges were averaged in float64, so its static ``input_scale`` (and every
    KV scale) was one float32 step from llm-compressor 0.14's, which lerps in the observed dtype (layer 0
    ``q_proj.input_scale`` 0.025771377608 against 0.025771381333 on bit-identical inputs)."""
    x = _samples()
    lo, hi = _lerp(x, torch.float32)
    wide_lo, wide_hi = _lerp(x.double(), torch.float64)
    assert (lo.item(), hi.item()) != (wide_lo.float().item(), wide_hi.float().item())  # the data tells them apart
    for split in ([x], [x[:5], x[5:]]):
        stats = CalibrationStatistics(8, keep_hessian=False)
        for batch in split:
            stats.add_batch(batch)
        assert stats.ranges["minmax"].dtype == torch.float32
        assert stats.ranges["minmax"].tolist() == [lo.item(), hi.item()]


@pytest.mark.parametrize("per_head", [False, True])
def test_float32_kv_ranges_are_averaged_in_float32_as_llm_compressor_lerps_them(per_head) -> None:
    """As the input ranges (found by a tester: every float32 KV scale was a float32 step from llm-compressor's)."""
    g = torch.Generator().manual_seed(5)
    states = torch.randn(12, 2, 4, 8, generator=g) * torch.linspace(0.5, 3.0, 12)[:, None, None, None]
    r = kv_cache.KVRange(per_head=per_head)
    r.add(states[:7])
    r.add(states[7:])
    assert r.ranges["minmax"].dtype == torch.float32
    if per_head:
        for h in range(2):
            lo, hi = _lerp(states[:, h], torch.float32)
            assert r.ranges["minmax"][:, h].flatten().tolist() == [lo.item(), hi.item()]
    else:
        lo, hi = _lerp(states, torch.float32)
        assert r.ranges["minmax"].flatten().tolist() == [lo.item(), hi.item()]
        wide_lo, wide_hi = _lerp(states.double(), torch.float64)
        assert (lo.item(), hi.item()) != (wide_lo.float().item(), wide_hi.float().item())


def test_fp8_static_input_scale_of_a_float32_model_is_the_float32_lerp_of_its_inputs_ranges() -> None:
    """End to end (found by a tester on layer 0's ``q_proj.input_scale``): the scale is ``max(|lo|, |hi|) / 448`` of
    the float32 moving average of each calibration sample's input range, computed here from the inputs captured on a
    copy of the original model, one sample per forward as llm-compressor calls it."""
    model, reference, data = llama(layers=1), llama(layers=1), _data()
    inputs: list[torch.Tensor] = []
    reference.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
    with torch.no_grad():
        for row in data:
            reference(row[None])
    lo, hi = _lerp(torch.stack([i[0] for i in inputs]), torch.float32)
    expected = torch.maximum(-lo.clamp(max=0), hi.clamp(min=0)) / 448.0
    recipe = {"q": {"QuantizationModifier": {"scheme": "FP8", "ignore": ["lm_head"], "input_observer": "minmax"}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=2, progress=False)
    got = model.model.layers[0].self_attn.q_proj.input_scale
    assert got.dtype == torch.float32
    assert got.tolist() == [expected.item()]


def test_kv_cache_scheme_on_deepseek_v3_names_its_latent_attention() -> None:
    """Found by a tester: the refusal on DeepSeek-V3 (multi-head latent attention: ``kv_a_proj_with_mqa`` /
    ``kv_b_proj``, no ``k_proj`` / ``v_proj``) named neither the model nor its attention class."""
    model = build("deepseek_v3")
    assert kv_cache.attention_modules(model) == {}
    assert kv_cache.no_kv_attention_reason(model) == (
        "DeepseekV3ForCausalLM (model_type 'deepseek_v3'): its attention (DeepseekV3Attention) is multi-head latent "
        "attention (MLA: kv_a_proj_with_mqa, kv_b_proj), whose cache holds the compressed latent and the shared "
        "rotary key, not each head's keys and values: quantizing an MLA KV cache is not supported (llm-compressor "
        "0.14 fails on it too); leave kv_cache_scheme out (its projections' weights can still be quantized)"
    )
    before = {n: p.clone() for n, p in model.named_parameters()}
    recipe = {"q": {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"], "kv_cache_scheme": KV}}}
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=_data(), progress=False)
    assert str(err.value) == "QuantizationModifier: kv_cache_scheme: " + kv_cache.no_kv_attention_reason(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_kv_cache_scheme_without_a_kv_attention_names_the_attention_classes_found() -> None:
    """A model whose attention has no ``k_proj`` / ``v_proj`` and is not MLA: the line names its attention class."""
    model = llama(layers=1)
    attention = model.model.layers[0].self_attn
    attention.key, attention.value = attention.k_proj, attention.v_proj
    del attention.k_proj, attention.v_proj
    assert kv_cache.no_kv_attention_reason(model) == (
        "LlamaForCausalLM (model_type 'llama'): no attention module has k_proj and v_proj (or qkv_proj) and a cache "
        "argument (cache, past_key_values, past_key_value) whose keys and values could be observed; its attention "
        "modules: LlamaAttention; leave kv_cache_scheme out"
    )
