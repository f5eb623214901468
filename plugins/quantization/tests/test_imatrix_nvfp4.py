"""``imatrix_mse`` on NVFP4 weights (llm-compressor 0.14's ``examples/imatrix/llama3_nvfp4_imatrix_example.py``):
round-to-nearest's searched group ranges against an independent float64 search on a tiny bfloat16 Llama."""

from __future__ import annotations

import copy

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from tiny_quant_models import tiny_llama

import llmc_fsm

FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_llama().save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def _reference_ranges(w: torch.Tensor, importance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor 0.14's imatrix search on ``w`` ``[rows, cols]`` bfloat16, groups of 16, the error in float64:
    ``p = 1 - i/20`` (i = 0..19, stop after 5 steps improving no group), scale ``max|p range| / 6`` unrounded to FP8,
    ``q = fp4(w / scale) * scale`` in the weight's dtype (as llm-compressor fake-quantizes the observed weight; FP4
    nearest value by table), error ``sum imp_j |w_j - q(w_j)|^3``, ``imp`` / its mean."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // 16, 16)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    imp = (importance / importance.mean()).reshape(cols // 16, 16)
    x = groups.double()
    best = torch.full(lo.shape, float("inf"), dtype=torch.float64)
    best_lo, best_hi, stale = lo.clone(), hi.clone(), 0
    for i in range(20):
        p = 1 - i / 20
        lo_p, hi_p = lo * p, hi * p
        scale = (torch.maximum(lo_p.abs(), hi_p.abs()) / 6.0).unsqueeze(-1)  # bfloat16, as the weight
        y = (groups / scale).double()  # the weight's dtype: llm-compressor fake-quantizes the observed bfloat16 values
        fp4 = torch.sign(y) * FP4_GRID[(y.abs().unsqueeze(-1) - FP4_GRID).abs().argmin(-1)]
        q = (fp4.to(w.dtype) * scale).double()
        err = ((x - q).abs() ** 3 * imp).sum(-1)
        better = err < best
        best = torch.where(better, err, best)
        best_lo, best_hi = torch.where(better, lo_p, best_lo), torch.where(better, hi_p, best_hi)
        stale = 0 if bool(better.any()) else stale + 1
        if stale >= 5:
            break
    return best_lo, best_hi


def test_imatrix_mse_on_nvfp4_weights_searches_the_group_ranges_weighted_by_importance(bf16_model, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model, original = copy.deepcopy(bf16_model), copy.deepcopy(bf16_model)
    data = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    seen: dict[str, list[torch.Tensor]] = {"down_proj": [], "q_proj": []}
    layer = original.model.layers[0]
    handles = [
        getattr(parent, name).register_forward_pre_hook(lambda m, a, name=name: seen[name].append(a[0].double()))
        for parent, name in ((layer.mlp, "down_proj"), (layer.self_attn, "q_proj"))
    ]
    with torch.no_grad():  # round-to-nearest calibrates every layer on the original weights (llm-compressor's order)
        original(data)
    for handle in handles:
        handle.remove()
    importance = {}  # E[x_j^2] over the calibration tokens
    for name, inputs in seen.items():
        x = torch.cat([s.reshape(-1, s.shape[-1]) for s in inputs])
        importance[name] = (x**2).mean(0)
    recipe = {"q": {"QuantizationModifier": {"scheme": "NVFP4A16", "observer": "imatrix_mse"}}}
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=4, output_dir=out, progress=False)
    down = model.model.layers[0].mlp.down_proj  # fused with nothing: its own global scale
    lo, hi = _reference_ranges(original.model.layers[0].mlp.down_proj.weight.detach(), importance["down_proj"])
    args = QuantizationArgs(
        num_bits=4, type="float", strategy="tensor_group", group_size=16, scale_dtype=torch.float8_e4m3fn
    )
    absmax = torch.maximum(-lo.amin(), hi.amax())
    global_scale = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    scale, _ = calculate_qparams(lo, hi, args, global_scale=global_scale)
    assert torch.equal(down.weight_global_scale.float(), global_scale.float())
    assert torch.equal(down.weight_scale.float(), scale.float())
    plain = calculate_qparams(
        original.model.layers[0].mlp.down_proj.weight.reshape(-1, 16).amin(1).reshape(scale.shape),
        original.model.layers[0].mlp.down_proj.weight.reshape(-1, 16).amax(1).reshape(scale.shape),
        args,
        global_scale=global_scale,
    )[0]
    assert not torch.equal(down.weight_scale.float(), plain.float())  # the search shrank some groups' ranges
    # q/k/v (one input, fused by vLLM): one global scale from the three searched ranges, each its own group scales
    attention = {n: getattr(layer.self_attn, n).weight.detach() for n in ("q_proj", "k_proj", "v_proj")}
    searched = {n: _reference_ranges(w, importance["q_proj"]) for n, w in attention.items()}
    absmax = torch.stack([torch.maximum(-lo.amin(), hi.amax()) for lo, hi in searched.values()]).amax()
    shared = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    for name, (lo, hi) in searched.items():
        module = getattr(model.model.layers[0].self_attn, name)
        assert torch.equal(module.weight_global_scale.float(), shared.float())
        assert torch.equal(module.weight_scale.float(), calculate_qparams(lo, hi, args, global_scale=shared)[0].float())
    y = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(out).eval()(y).logits, model(y).logits)


def test_imatrix_mse_on_nvfp4_weights_with_gptq_is_refused_when_read() -> None:
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(
            model=tiny_llama(),
            recipe={"q": {"GPTQModifier": {"scheme": "NVFP4A16", "observer": "imatrix_mse"}}},
            dataset=torch.randint(0, 128, (2, 16)),
            progress=False,
        )
    assert str(info.value).endswith(
        "observer imatrix_mse on NVFP4 weights is implemented for QuantizationModifier (round-to-nearest) only, not "
        "GPTQModifier; use minmax or nvfp4_expanded_mse"
    )
