"""The moving average of observed ranges (observer ``minmax``) in the observed dtype, as llm-compressor 0.14's
observers keep it: its ``lerp(start, end, c) = start * (1 - c) + end * c`` on tensors of the observed dtype, one
observation per sample. The references are written out here in the inputs' dtype (bfloat16, float32), step by
step."""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams
from llmc_fsm_quantization import kv_cache
from llmc_fsm_quantization._base import CalibrationStatistics

C = 0.01


def _samples(dtype: torch.dtype) -> torch.Tensor:
    """12 samples of 3 tokens x 8 features, ranges varying from sample to sample."""
    g = torch.Generator().manual_seed(3)
    return (torch.randn(12, 3, 8, generator=g) * torch.linspace(0.5, 3.0, 12)[:, None, None]).to(dtype)


def _hand_average(samples: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's min / max, averaged from the first one as ``v * (1 - c) + v_sample * c`` in ``dtype``."""
    lo, hi = samples[0].min().to(dtype), samples[0].max().to(dtype)
    for s in samples[1:]:
        lo = lo * (1.0 - C) + s.min().to(dtype) * C
        hi = hi * (1.0 - C) + s.max().to(dtype) * C
    return lo, hi


def test_input_ranges_of_a_bfloat16_model_are_averaged_in_bfloat16_as_llm_compressor_does() -> None:
    """Found by a tester: the average was kept in float64, so a bfloat16 model's FP8 static input scales were a
    bfloat16 step or two from llm-compressor's (0.0089111 against 0.0088501 on a tiny Llama's q_proj)."""
    x = _samples(torch.bfloat16)
    lo, hi = _hand_average(x, torch.bfloat16)
    wide_lo, wide_hi = _hand_average(x, torch.float64)
    assert (lo.item(), hi.item()) != (wide_lo.to(torch.bfloat16).item(), wide_hi.to(torch.bfloat16).item())
    for split in ([x], [x[:5], x[5:]]):
        stats = CalibrationStatistics(8, keep_hessian=False)
        for batch in split:
            stats.add_batch(batch)
        assert stats.ranges["minmax"].dtype == torch.bfloat16
        assert stats.ranges["minmax"].tolist() == [lo.item(), hi.item()]
        assert stats.ranges["static_minmax"].tolist() == [x.min().item(), x.max().item()]
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=False, strategy="tensor")
    scale, _ = calculate_qparams(lo.reshape(1), hi.reshape(1), args)
    assert scale.dtype == torch.bfloat16
    assert scale.item() == (torch.maximum(-lo, hi) / 448).item()


def test_input_ranges_of_a_float32_model_are_averaged_in_float32_as_llm_compressor_does() -> None:
    """Found by a tester (session 37): averaged in float64, a float32 model's static input scales were a float32
    step from llm-compressor 0.14's, which lerps in float32 (this test pinned float64 before)."""
    x = _samples(torch.float32)
    lo, hi = _hand_average(x, torch.float32)
    stats = CalibrationStatistics(8, keep_hessian=False)
    stats.add_batch(x)
    assert stats.ranges["minmax"].dtype == torch.float32
    assert stats.ranges["minmax"].tolist() == [lo.item(), hi.item()]


def test_kv_ranges_of_a_bfloat16_model_are_averaged_in_bfloat16_per_tensor_and_per_head() -> None:
    """As the input ranges (found by a tester on a bfloat16 model's v_scale)."""
    g = torch.Generator().manual_seed(5)
    states = (torch.randn(12, 2, 4, 8, generator=g) * torch.linspace(0.5, 3.0, 12)[:, None, None, None]).bfloat16()
    tensor, head = kv_cache.KVRange(per_head=False), kv_cache.KVRange(per_head=True)
    for r in (tensor, head):
        r.add(states[:7])
        r.add(states[7:])
    lo, hi = _hand_average(states, torch.bfloat16)
    assert tensor.ranges["minmax"].dtype == torch.bfloat16
    assert tensor.ranges["minmax"].flatten().tolist() == [lo.item(), hi.item()]
    for h in range(2):
        lo, hi = _hand_average(states[:, h], torch.bfloat16)
        assert head.ranges["minmax"][:, h].flatten().tolist() == [lo.item(), hi.item()]
