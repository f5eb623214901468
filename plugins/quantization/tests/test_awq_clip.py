"""AWQ's clipping search (``apply_clip``) against an independent float64 one; lower quantized output errors."""

from __future__ import annotations

import copy

import pytest
import torch
from llmc_fsm_quantization import AWQModifier, QuantizationModifier, rtn_quantize
from llmc_fsm_quantization.mappings import default_mappings, fold_scales
from test_awq import W4G16
from test_smoothquant import DATA, tiny

import llmc_fsm

CLIPPED = ["self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
N_SAMPLE = 64  # of the 256 calibration tokens: every 4th


def _q(w: torch.Tensor) -> torch.Tensor:
    """The plugin's round-to-nearest with W4G16 (asymmetric int4, groups of 16) on float32 ``w``, as float64.

    Used as a black box (test_awq checks it against a float64 one): clamping a group to ``[-m, m]`` puts its
    extremes on zero-point rounding ties (``-8 + m / (2m / 15) = -0.5``), which only the quantizer's own float32
    arithmetic resolves the same way."""
    return rtn_quantize(w.float(), QuantizationModifier(scheme=W4G16).weight_args).weight.double()


def _reference_clip(w: torch.Tensor, x: torch.Tensor, n_grid: int = 20, max_shrink: float = 0.5):
    """The paper's v1 clipping search, scored in float64: per (row, group of 16) the range m_i = (1 - i/n_grid)
    max|w| (float32, the weight's dtype) minimising mean_tokens (x_g . (Q(clamp(w, -m_i, m_i)) - w)_g)^2, the first
    (largest) on ties; returns the clamped float32 weight and the chosen i per group."""
    rows, cols = w.shape
    wg = w.reshape(rows, cols // 16, 16)
    xg = x.reshape(-1, cols // 16, 16)
    org = wg.abs().amax(dim=-1, keepdim=True)
    best = torch.full((rows, cols // 16), float("inf"), dtype=torch.float64)
    index = torch.zeros((rows, cols // 16), dtype=torch.int64)
    chosen = wg.clone()
    for i in range(int(max_shrink * n_grid)):
        m = org * (1 - i / n_grid)
        clamped = torch.clamp(wg, -m, m)
        delta = (_q(clamped.reshape(rows, cols)) - w.double()).reshape(rows, cols // 16, 16)
        err = torch.zeros((rows, cols // 16), dtype=torch.float64)
        for t in range(xg.shape[0]):  # one token at a time, no einsum
            err += (delta * xg[t][None]).sum(dim=-1).pow(2)
        err /= xg.shape[0]
        better = err < best
        best[better], index[better] = err[better], i
        chosen[better] = clamped[better]
    return chosen.reshape(rows, cols), index


def _out_error(w: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> float:
    return float((x @ (q - w).T).pow(2).mean())


def _smoothed_layer0_inputs(original: torch.nn.Module, scales: dict[str, torch.Tensor]):
    """The smoothed float model (AWQ's scales folded) and every 4th calibration input of each layer-0 Linear."""
    smoothed = copy.deepcopy(original)
    for mapping in default_mappings(smoothed):
        if mapping.smooth_name in scales:
            fold_scales(mapping, scales[mapping.smooth_name])
    layer = smoothed.model.layers[0]
    seen: dict[str, torch.Tensor] = {}
    handles = [
        layer.get_submodule(n).register_forward_pre_hook(
            lambda module, args, n=n: seen.__setitem__(n, args[0].reshape(-1, args[0].shape[-1]))
        )
        for n in CLIPPED
    ]
    with torch.no_grad():
        smoothed(DATA)
    for h in handles:
        h.remove()
    return smoothed, {n: x[::4].double() for n, x in seen.items()}


def test_clipping_chooses_the_ranges_of_a_float64_search_and_lowers_each_linears_quantized_error() -> None:
    model = tiny()
    original = copy.deepcopy(model)
    awq = AWQModifier(apply_clip=True, clip_n_sample_token=N_SAMPLE)
    llmc_fsm.oneshot(model=model, recipe=[awq, QuantizationModifier(scheme=W4G16)], dataset=DATA, progress=False)
    smoothed, inputs = _smoothed_layer0_inputs(original, awq.smoothing_scales)
    assert sorted(awq.clipping_results) == sorted(f"model.layers.{i}.{n}" for i in (0, 1) for n in CLIPPED)
    for name in CLIPPED:  # layer 0: its smoothed weights and inputs are known exactly
        w = smoothed.model.layers[0].get_submodule(name).weight.detach()
        x = inputs[name]
        clipped, index = _reference_clip(w, x)
        unclipped_error = _out_error(w.double(), _q(w), x)
        clipped_error = _out_error(w.double(), _q(clipped), x)
        result = awq.clipping_results[f"model.layers.0.{name}"]
        assert result["tokens"] == 64
        assert result["groups"] == index.numel()
        assert result["groups_clipped"] == int((index > 0).sum()), name
        assert result["shrink_mean"] == pytest.approx(float((1 - index.double() / 20).mean()), abs=1e-12)
        assert result["error_unclipped"] == pytest.approx(unclipped_error, rel=1e-4)
        assert result["applied"] is (clipped_error < unclipped_error)
        assert result["error"] == pytest.approx(clipped_error, rel=1e-4)
        assert clipped_error < 0.95 * unclipped_error, name  # clipping lowers the quantized output error
        quantized = model.model.layers[0].get_submodule(name).weight.detach().double()
        assert torch.equal(quantized, _q(clipped)), name  # the quantizer rounded the clipped weights
    for name, result in awq.clipping_results.items():  # every clipped Linear of every layer
        assert result["applied"] and result["error"] < result["error_unclipped"], name


def test_clipping_is_off_by_default_and_leaves_the_queries_and_keys() -> None:
    plain, clipped = tiny(), tiny()
    awq_plain, awq_clip = AWQModifier(), AWQModifier(apply_clip=True)
    llmc_fsm.oneshot(model=plain, recipe=[awq_plain, QuantizationModifier(scheme=W4G16)], dataset=DATA, progress=False)
    llmc_fsm.oneshot(model=clipped, recipe=[awq_clip, QuantizationModifier(scheme=W4G16)], dataset=DATA, progress=False)
    assert awq_plain.clipping_results == {}
    layer0 = [n for n in awq_plain.smoothing_results if n.startswith("model.layers.0.")]
    assert len(layer0) == 4
    for name in layer0:  # clipping comes after the smoothing search (layer 1's inputs differ: layer 0 was clipped)
        assert awq_plain.smoothing_results[name] == awq_clip.smoothing_results[name]
    for name in ("self_attn.q_proj", "self_attn.k_proj"):
        assert {f"model.layers.{i}.{name}" for i in (0, 1)}.isdisjoint(awq_clip.clipping_results)
        full = f"model.layers.0.{name}"
        assert torch.equal(plain.get_submodule(full).weight, clipped.get_submodule(full).weight)
    assert not torch.equal(plain.model.layers[0].mlp.down_proj.weight, clipped.model.layers[0].mlp.down_proj.weight)


def test_clipping_with_a_per_tensor_scheme_is_refused_before_calibration_and_changes_nothing() -> None:
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = [
        AWQModifier(apply_clip=True),
        QuantizationModifier(scheme={"weights": {"num_bits": 8, "strategy": "tensor"}}),
    ]
    with pytest.raises(llmc_fsm.ModifierError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, progress=False)
    assert info.value.hook == "on_calibration_start"
    assert str(info.value.__cause__) == (
        "AWQModifier: apply_clip searches one clipping range per output row and quantization group, but "
        "QuantizationModifier quantizes model.layers.0.self_attn.v_proj with int 8-bit tensor weights: the tensor "
        "strategy shares one scale beyond one output row and group; use a group or channel weight scheme, or leave "
        "apply_clip out"
    )
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_clipping_arguments_are_checked_at_construction() -> None:
    with pytest.raises(ValueError, match=r"^apply_clip must be true or false, got 'yes'$"):
        AWQModifier(apply_clip="yes")
    with pytest.raises(ValueError, match=r"^clip_n_grid must be a positive int, got 0$"):
        AWQModifier(clip_n_grid=0)
    with pytest.raises(ValueError, match=r"^clip_n_sample_token must be a positive int, got 1.5$"):
        AWQModifier(clip_n_sample_token=1.5)
    with pytest.raises(ValueError, match=r"^clip_max_shrink must be a number in \(0, 1\) .*got 1$"):
        AWQModifier(clip_max_shrink=1)


def test_the_report_holds_the_clipping_results_and_sums_them_up(tmp_path) -> None:
    model = tiny()
    awq = AWQModifier(apply_clip=True)
    llmc_fsm.oneshot(model=model, recipe=[awq, QuantizationModifier(scheme=W4G16)], dataset=DATA, progress=False)
    report = model.llmc_fsm_report
    assert report.to_dict()["smoothing"]["AWQModifier (default) clipping"] == awq.clipping_results
    values = list(awq.clipping_results.values())
    unclipped = sum(r["error_unclipped"] for r in values) / 10
    error = sum(r["error"] for r in values) / 10
    assert (
        "AWQModifier (default) clipping: 10 of 10 Linears clipped; mean output error, quantized: "
        f"{unclipped:.3g} unclipped -> {error:.3g}"
    ) in report.format_table()
