"""NVFP4 global scales shared by the modules vLLM fuses (q/k/v, gate/up), and NVFP4 / MX weights rounded once
(packed when quantized, that packing saved), on a 2-layer random Llama (hidden 64) in bfloat16."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from test_formats import FP4_VALUES, _bf16, bf16_dir  # noqa: F401 (bf16_dir: the tiny Llama's fixture)

import llmc_fsm
from llmc_fsm.toolkit.packed import PACKED_ATTR, kept_packed
from llmc_fsm.output.save import compressed_state_dict
from llmc_fsm_quantization import QuantizationModifier
from llmc_fsm_quantization.rounding import fp4_positive_zeros

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
ALONE = ("o_proj", "down_proj")


def _parent(model, layer: int, name: str) -> str:
    return f"model.layers.{layer}.{'self_attn' if name in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}"


def _global_scale_f64(weights: list[torch.Tensor]) -> float:
    """compressed-tensors' NVFP4 global scale: FP8 E4M3 max (448) x FP4 E2M1 max (6) / max |W| over the weights,
    computed in the weights' dtype (bfloat16) as compressed-tensors computes it there: torch divides the number
    2688 by a bfloat16 tensor as 2688 times its reciprocal rounded to bfloat16, the product rounded to bfloat16."""
    reciprocal = torch.tensor(1.0 / max(float(w.double().abs().max()) for w in weights), dtype=torch.float64)
    return float((448.0 * 6.0 * reciprocal.to(torch.bfloat16).double()).to(torch.bfloat16))


@pytest.mark.parametrize("modifier", ["QuantizationModifier", "GPTQModifier"])
def test_fused_modules_share_one_global_scale_in_memory_and_in_the_checkpoint(tmp_path, bf16_dir, modifier) -> None:
    from transformers import AutoModelForCausalLM

    model = _bf16(bf16_dir)
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    out = tmp_path / "out"
    recipe = {"q": {modifier: {"scheme": "NVFP4A16", "ignore": ["lm_head"]}}}
    data = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=out, progress=False)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "nvfp4-pack-quantized"
    shared_differs_from_own = 0
    with safe_open(str(out / "model.safetensors"), "pt") as saved:
        for layer in range(2):
            for names in [*FUSED, *((n,) for n in ALONE)]:
                full = [f"{_parent(model, layer, n)}.{n}" for n in names]
                expected = _global_scale_f64([originals[f] for f in full])
                for f in full:
                    in_file = saved.get_tensor(f"{f}.weight_global_scale")
                    module = model.get_submodule(f)
                    assert in_file.dtype == torch.float32 and in_file.shape == (1,)
                    assert torch.equal(in_file, module.weight_global_scale.data)
                    assert float(in_file) == expected, f
                    own = _global_scale_f64([originals[f]])
                    shared_differs_from_own += abs(own - expected) > expected * 1e-3
                    # group scales: fp8(global x bf16(max|w_g| / 6)) (GPTQ: the same, from the original weight)
                    amax = originals[f].double().reshape(originals[f].shape[0], -1, 16).abs().amax(dim=2)
                    third = (amax / 6.0).to(torch.bfloat16).double()
                    group = (expected * third).float().to(torch.float8_e4m3fn)
                    assert torch.equal(saved.get_tensor(f"{f}.weight_scale").float(), group.float()), f
                    assert torch.equal(module.weight_scale.data.float(), group.float()), f
                    values = module.weight.detach().float().reshape(-1, 16)
                    assert max(torch.unique(g).numel() for g in values) <= FP4_VALUES
    assert shared_differs_from_own > 0  # the fused sets' own ranges differ: sharing changed some global scale
    x = torch.randint(0, 128, (2, 24))
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)


def test_a_fused_set_quantized_only_in_part_is_refused_before_any_work(bf16_dir) -> None:
    model = _bf16(bf16_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    modifier = QuantizationModifier(scheme="NVFP4A16", ignore=["lm_head", "re:.*layers\\.1\\.self_attn\\.k_proj$"])
    with pytest.raises(ValueError) as info:
        modifier.check_model(model)
    assert str(info.value) == (
        "QuantizationModifier: vLLM loads each of these sets of modules as one fused layer with one NVFP4 global "
        "scale, and only some of each are quantized with NVFP4 here: model.layers.1.self_attn.{q_proj,k_proj,v_proj} "
        "(k_proj not); quantize all modules of a set with NVFP4 (tensor_group) or none (as "
        "llm-compressor, which refuses this too)"
    )
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not any(hasattr(m, "quantization_scheme") for m in model.modules())


@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16"])
def test_the_save_writes_the_tensors_packed_when_quantized_and_packs_anew_a_changed_module(bf16_dir, scheme) -> None:
    model = _bf16(bf16_dir)
    llmc_fsm.oneshot(model=model, recipe={"q": {"QuantizationModifier": {"scheme": scheme, "ignore": ["lm_head"]}}},
                     progress=False)
    quantized = [m for m in model.modules() if hasattr(m, "quantization_scheme")]
    assert len(quantized) == 14 and all(hasattr(m, PACKED_ATTR) for m in quantized)
    kept = compressed_state_dict(model)
    for m in quantized:  # compress every module anew: the same tensors
        delattr(m, PACKED_ATTR)
    anew = compressed_state_dict(model)
    assert kept.keys() == anew.keys()
    assert all(kept[k].dtype == anew[k].dtype and torch.equal(kept[k], anew[k]) for k in kept)
    # a module whose weight changed after it was packed: its kept tensors are not used
    llmc_fsm.oneshot(model=(fresh := _bf16(bf16_dir)),
                     recipe={"q": {"QuantizationModifier": {"scheme": scheme, "ignore": ["lm_head"]}}}, progress=False)
    down = fresh.model.layers[0].mlp.down_proj
    fmt = down.quantization_scheme.format or ("nvfp4-pack-quantized" if scheme == "NVFP4A16" else "mxfp4-pack-quantized")
    fmt = getattr(fmt, "value", fmt)
    local = {k: v for k, v in down.state_dict().items()}
    assert kept_packed(down, fmt, local) is getattr(down, PACKED_ATTR)[1]
    with torch.no_grad():
        down.weight[0, 0] = -down.weight[0, 0] + 1.0
    assert kept_packed(down, fmt, {k: v for k, v in down.state_dict().items()}) is None
    assert kept_packed(down, "float-quantized", local) is None


def test_fp4_negative_zero_codes_become_positive_zeros() -> None:
    # low nibble first: 0x8 is -0, 0x0 +0, 0x9 -0.5, 0x7 +6
    packed = torch.tensor([[0x88, 0x08, 0x80, 0x98, 0x89, 0x7F, 0x00]], dtype=torch.uint8)
    assert fp4_positive_zeros(packed).tolist() == [[0x00, 0x00, 0x00, 0x90, 0x09, 0x7F, 0x00]]
