"""Input and KV-cache range observation: one observation per calibration sample, scales in the observed dtype.

llm-compressor 0.14 observes each forward call, and its ``oneshot`` makes one call per sample (``batch_size`` 1, its
default); compressed-tensors computes the scales from the observer's range in the observed dtype. The expected
values here are written out by hand (or computed in float64 in the test), never by the code under test.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme
from llmc_fsm_quantization import kv_cache
from llmc_fsm_quantization._base import CalibrationStatistics, _input_global_scale, _input_qparams


def _rows() -> torch.Tensor:
    """Four samples of 2 tokens x 2 features, each sample's minimum and maximum chosen by hand."""
    return torch.tensor([
        [[1.0, -2.0], [0.5, 3.0]],     # sample 0: min -2, max 3
        [[-8.0, 0.0], [1.0, 2.0]],     # sample 1: min -8, max 2
        [[0.25, 0.5], [-1.0, 10.0]],   # sample 2: min -1, max 10
        [[4.0, -0.5], [0.0, 1.0]],     # sample 3: min -0.5, max 4
    ])


def test_the_ranges_are_observed_per_sample_whatever_the_batch_split() -> None:
    x = _rows()
    # moving average, constant 0.01, from the first sample's values, by hand, each product and sum rounded to the
    # inputs' float32 as llm-compressor 0.14's lerp computes it (this test pinned a float64 average before session 37)
    def lerp32(values: list[float]) -> float:
        v = torch.tensor(values[0], dtype=torch.float32)
        for value in values[1:]:
            v = v * (1.0 - 0.01) + torch.tensor(value, dtype=torch.float32) * 0.01
        return v.item()

    lo, hi = lerp32([-2.0, -8.0, -1.0, -0.5]), lerp32([3.0, 2.0, 10.0, 4.0])
    expected = {"static_minmax": [-8.0, 10.0], "minmax": [lo, hi], "memoryless_minmax": [-0.5, 4.0]}
    for split in ([x], [x[:2], x[2:]], [x[:1], x[1:2], x[2:3], x[3:]]):
        stats = CalibrationStatistics(2)
        for batch in split:
            stats.add_batch(batch)
        got = {name: value.tolist() for name, value in stats.ranges.items()}
        assert got == expected, len(split)
    # a 2-D input (an expert's routed tokens) is one observation
    flat = CalibrationStatistics(2)
    flat.add_batch(x.reshape(-1, 2))
    assert flat.ranges["minmax"].tolist() == [-8.0, 10.0]


def test_statistics_without_the_hessian_keep_the_same_ranges_and_count_and_refuse_the_hessian() -> None:
    x = _rows()
    full, ranges_only = CalibrationStatistics(2), CalibrationStatistics(2, keep_hessian=False)
    for stats in (full, ranges_only):
        stats.add_batch(x[:3])
        stats.add_batch(x[3:])
    assert {k: v.tolist() for k, v in ranges_only.ranges.items()} == {k: v.tolist() for k, v in full.ranges.items()}
    assert ranges_only.num_samples == full.num_samples == 8
    # sum of squares per feature over the 8 tokens, times 2 / 8, by hand
    assert full.diagonal.tolist() == pytest.approx([(1 + 0.25 + 64 + 1 + 0.0625 + 1 + 16 + 0) / 4,
                                                    (4 + 9 + 0 + 4 + 0.25 + 100 + 0.25 + 1) / 4])
    for attribute in ("hessian", "diagonal"):
        with pytest.raises(AttributeError, match=r"keep the input ranges only \(keep_hessian=False\)"):
            getattr(ranges_only, attribute)
    with pytest.raises(ValueError, match=r"expected input with last dimension 2, got shape \(4, 3\)"):
        ranges_only.add_batch(torch.zeros(4, 3))


@pytest.mark.parametrize(("observer", "kept"), [("minmax", None), ("imatrix_mse", "diagonal")])
def test_static_input_statistics_keep_the_diagonal_only_for_an_importance_weighted_observer(observer, kept) -> None:
    from llmc_fsm_quantization import QuantizationModifier

    scheme = {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                          "observer": observer},
              "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                    "strategy": "tensor"}}
    modifier = QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], **scheme}})
    linear = torch.nn.Linear(4, 3)
    modifier._names_by_id = {id(linear): "linear"}
    stats = modifier._new_accumulator(linear)
    stats.add_batch(torch.ones(1, 2, 4))
    assert isinstance(stats, CalibrationStatistics) and stats.ranges["static_minmax"].tolist() == [1.0, 1.0]
    if kept is None:
        assert getattr(stats, "diagonal", None) is None and getattr(stats, "hessian", None) is None
    else:
        assert stats.diagonal.tolist() == [2.0] * 4 and getattr(stats, "hessian", None) is None


def test_a_static_fp8_input_scale_is_the_moving_average_of_the_samples_over_448() -> None:
    stats = CalibrationStatistics(2)
    stats.add_batch(_rows())  # one batch of four samples
    scheme = preset_name_to_scheme("FP8", ["Linear"])
    scheme.input_activations.observer = "minmax"
    hi = ((3.0 * 0.99 + 2.0 * 0.01) * 0.99 + 10.0 * 0.01) * 0.99 + 4.0 * 0.01  # 3.1196 > |lo|
    scale, _ = _input_qparams(scheme, stats)
    assert float(scale) == pytest.approx(hi / 448.0, rel=1e-7)
    scheme.input_activations.observer = "static_minmax"
    scale, _ = _input_qparams(scheme, stats)
    assert float(scale) == pytest.approx(10.0 / 448.0, rel=1e-7)


def test_the_nvfp4_input_global_scale_is_divided_in_the_inputs_dtype() -> None:
    """bfloat16 inputs of largest magnitude 1.2734375: 2688 / 1.2734375 = 2110.82 in float32, and 2112 (the nearest
    bfloat16, whose spacing is 16 between 2048 and 4096) when divided in bfloat16, as compressed-tensors'
    ``generate_gparam`` divides the bfloat16 range llm-compressor's observer hands it."""
    scheme: QuantizationScheme = preset_name_to_scheme("NVFP4", ["Linear"])
    x = torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    x[0, 0, 3], x[0, 1, 7] = 1.2734375, -0.5
    stats = CalibrationStatistics(16, group_size=16)
    stats.add_batch(x)
    assert stats.dtype == torch.bfloat16
    got = _input_global_scale(scheme, stats)
    assert got.dtype == torch.float32 and got.tolist() == [2112.0]
    stats32 = CalibrationStatistics(16, group_size=16)
    stats32.add_batch(x.float())
    assert _input_global_scale(scheme, stats32).tolist() == [pytest.approx(2688 / 1.2734375, rel=1e-7)]


@pytest.mark.parametrize("per_head", [False, True])
def test_kv_ranges_are_observed_per_sample_whatever_the_batch_split(per_head) -> None:
    states = torch.randn(4, 2, 3, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    dims = (1, 2, 3) if not per_head else (2, 3)
    mins = [s.amin(dim=tuple(d - 1 for d in dims)) for s in states]  # per sample: [] or [heads]
    maxs = [s.amax(dim=tuple(d - 1 for d in dims)) for s in states]
    lo, hi = mins[0], maxs[0]
    for a, b in zip(mins[1:], maxs[1:], strict=True):
        lo, hi = 0.99 * lo + 0.01 * a, 0.99 * hi + 0.01 * b
    shape = (-1, 1, 1) if per_head else (1,)
    for split in ([states], [states[:2], states[2:]], list(states.split(1))):
        r = kv_cache.KVRange(per_head)
        for batch in split:
            r.add(batch)
        torch.testing.assert_close(r.ranges["minmax"], torch.stack([lo.reshape(shape), hi.reshape(shape)]),
                                   rtol=1e-15, atol=0)
        torch.testing.assert_close(r.ranges["memoryless_minmax"],
                                   torch.stack([mins[-1].reshape(shape), maxs[-1].reshape(shape)]), rtol=0, atol=0)
        assert r.calls == len(split)
