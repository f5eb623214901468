"""The ``nvfp4_expanded_mse`` observer on a bfloat16 2-layer random Llama (hidden 64): its group scales against an
independent float64 NVFP4 search, how it differs from minmax, save -> reload, and its refusal off NVFP4."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_quant_models import tiny_llama

import llmc_fsm

FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A tiny random Llama saved once, loaded in bfloat16 (NVFP4 checkpoints decompress to bfloat16)."""
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_llama().save_pretrained(path)
    return path


def _tiny_bf16(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def _nvfp4_error(w: torch.Tensor, fp8_scale: torch.Tensor, global_scale: float) -> torch.Tensor:
    """sum |w - q(w)|^2.4 per 16-value group, float64: q = the nearest FP4 (e2m1) value times the group's effective
    scale fp8_scale / global_scale (w ``[rows, groups, 16]``, fp8_scale ``[rows, groups]``)."""
    eff = (fp8_scale / global_scale).unsqueeze(-1)
    x = (w / eff).abs()
    nearest = FP4_GRID[(x.unsqueeze(-1) - FP4_GRID).abs().argmin(-1)]
    q = torch.sign(w) * nearest * eff
    return ((w - q).abs() ** 2.4).sum(-1)


def _reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(best fp8 group scales, their errors, global scale) of the search p = 1.8 (1 - i / 200), i = 0..111; the
    fp8 group scale of a range r is fp8(global * p * max|w_g| / 6), global = bf16(448 * 6 / max|W|)."""
    w = w.double().reshape(w.shape[0], -1, 16)
    reciprocal = (1.0 / w.abs().max()).to(torch.bfloat16).double()  # 2688 / bfloat16 max: times its bf16 reciprocal
    global_scale = float((448.0 * 6.0 * reciprocal).to(torch.bfloat16))
    amax = w.abs().amax(-1)
    best_err = torch.full(amax.shape, float("inf"), dtype=torch.float64)
    best = torch.zeros_like(amax)
    for i in range(int((1 - 0.8 / 1.8) * 200)):  # i = 0 .. 110: llm-compressor's grid
        p = 1.8 * (1 - i / 200)
        s = (global_scale * (amax * p).float() / 6.0).clamp(max=448).to(torch.float8_e4m3fn).double()
        err = _nvfp4_error(w, s, global_scale)
        better = err < best_err
        best_err, best = torch.where(better, err, best_err), torch.where(better, s, best)
    return best, best_err, global_scale


@pytest.mark.parametrize("modifier", ["QuantizationModifier", "GPTQModifier"])
def test_nvfp4_expanded_mse_takes_the_range_with_the_smallest_nvfp4_error(tmp_path, bf16_dir, modifier) -> None:
    from transformers import AutoModelForCausalLM

    base = _tiny_bf16(bf16_dir)
    data = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    models = {}
    for observer in ("minmax", "nvfp4_expanded_mse"):
        model = copy.deepcopy(base)
        recipe = {"q": {modifier: {"scheme": "NVFP4A16", "observer": observer}}}
        out = tmp_path / observer
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=4, output_dir=out, progress=False)
        models[observer] = model
        x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(AutoModelForCausalLM.from_pretrained(out).eval()(x).logits, model(x).logits)
    original = base.model.layers[0].mlp.down_proj.weight.detach()  # not fused: its own global scale
    mine = models["nvfp4_expanded_mse"].model.layers[0].mlp.down_proj
    minmax = models["minmax"].model.layers[0].mlp.down_proj
    assert mine.quantization_scheme.weights.observer == "nvfp4_expanded_mse"
    best, best_err, global_scale = _reference(original)
    assert float(mine.weight_global_scale) == pytest.approx(global_scale, rel=1e-6)  # the unexpanded range's
    got = mine.weight_scale.double()
    groups = original.double().reshape(original.shape[0], -1, 16)
    got_err = _nvfp4_error(groups, got, float(mine.weight_global_scale))
    # the chosen scale is the reference's best, or (float32 arithmetic vs float64) one with the same error
    assert torch.allclose(got_err, best_err, rtol=1e-5, atol=1e-12)
    assert (got == best).double().mean() >= 0.99
    # where it should differ from minmax: groups whose best range is wider or narrower than the observed one
    minmax_err = _nvfp4_error(groups, minmax.weight_scale.double(), global_scale)
    assert bool((got_err <= minmax_err * (1 + 1e-6)).all())  # never worse than minmax's range here
    wider = got > minmax.weight_scale.double()
    assert 0 < int(wider.sum()) and bool((best_err[wider] < minmax_err[wider]).all())
    if modifier == "QuantizationModifier":
        assert not torch.equal(mine.weight, minmax.weight)


def test_nvfp4_expanded_mse_off_nvfp4_is_refused_when_the_recipe_is_read(bf16_dir) -> None:
    model = _tiny_bf16(bf16_dir)
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"q": {"QuantizationModifier": {
            "scheme": {"preset": "W4A16", "weights": {"group_size": 32}}, "observer": "nvfp4_expanded_mse"}}},
            progress=False)
    assert "observer nvfp4_expanded_mse is for NVFP4 weights (tensor_group, 4-bit float), and the scheme is not" in (
        str(info.value))
    assert not hasattr(model.model.layers[0].mlp.up_proj, "quantization_scheme")


@pytest.mark.parametrize(("scheme", "observer", "fmt"), [("NVFP4A16", "mse", "NVFP4 (tensor_group)"),
                                                          ("MXFP4A16", "imatrix_mse", "MX (power-of-two scales)")])
def test_a_range_searching_observer_on_scaled_formats_is_refused_before_calibration(
    bf16_dir, monkeypatch, scheme, observer, fmt
) -> None:
    """Found by llm-compressor's recipe corpus (examples/imatrix/llama3_nvfp4_imatrix_example.py): the observer was
    refused only when the first layer was compressed; now when the recipe is read, before any forward."""
    from llmc_fsm.pipeline import sequential

    model = _tiny_bf16(bf16_dir)
    calls = []
    monkeypatch.setattr(sequential, "capture_layer_inputs", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"q": {"QuantizationModifier": {
            "targets": ["Linear"], "ignore": ["lm_head"], "scheme": scheme, "observer": observer}}},
            dataset=torch.arange(3, 35).reshape(2, 16), progress=False)
    assert f"observer {observer} is not implemented for {fmt} weights; use minmax (or static_minmax / " \
           "memoryless_minmax, the same for a weight)" in str(info.value)
    assert calls == []
    assert not hasattr(model.model.layers[0].mlp.up_proj, "quantization_scheme")
