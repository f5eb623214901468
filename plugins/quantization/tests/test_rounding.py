"""``llmc_fsm_quantization.rounding.fake_quantize``: compressed-tensors' ``fake_quantize``, bitwise, with one
working copy instead of a tensor per step."""

from __future__ import annotations

import itertools

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as library_fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from llmc_fsm_quantization.rounding import fake_quantize

CASES = [
    (bits, strategy, symmetric, scale_dtype)
    for bits, strategy, symmetric, scale_dtype in itertools.product(
        (2, 4, 8), ("tensor", "channel", "group"), (True, False), (torch.float32, torch.bfloat16, torch.float16)
    )
]


def _qparams(w: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    rows = w.shape[0]
    if args.strategy == "tensor":
        lo, hi = w.min().reshape(1), w.max().reshape(1)
    elif args.strategy == "channel":
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:
        g = w.reshape(rows, -1, args.group_size)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
    return calculate_qparams(lo.clamp(max=0), hi.clamp(min=0), args)


@pytest.mark.parametrize(("bits", "strategy", "symmetric", "scale_dtype"), CASES)
def test_equals_compressed_tensors_bitwise(bits, strategy, symmetric, scale_dtype):
    torch.manual_seed(bits * 7 + len(strategy))
    args = QuantizationArgs(
        num_bits=bits, type="int", strategy=strategy, symmetric=symmetric, group_size=32 if strategy == "group" else None
    )
    w = torch.randn(24, 96) * 0.05
    w[0, :7] = 0.0  # exact zeros, and values on the grid's edges
    w[1, 0], w[1, 1] = w.abs().max() * 3, -w.abs().max() * 3
    scale, zero_point = _qparams(w, args)
    scale = scale.to(scale_dtype)
    before = w.clone()
    expected = library_fake_quantize(w, scale, zero_point, args)
    got = fake_quantize(w, scale, zero_point, args)
    assert torch.equal(w, before)  # the input is not modified
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # bitwise, signs of zeros included


def test_other_formats_go_to_compressed_tensors():
    """FP8 (and every non-int format) is compressed-tensors' own arithmetic: the same call, the same result."""
    args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
    torch.manual_seed(0)
    w = torch.randn(8, 64)
    scale, zero_point = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args)
    assert torch.equal(fake_quantize(w, scale, zero_point, args), library_fake_quantize(w, scale, zero_point, args))


def test_group_columns_not_a_multiple_fail_like_compressed_tensors():
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32)
    w = torch.randn(4, 48)
    scale, zero_point = torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int8)
    with pytest.raises(ValueError, match="^tensor column shape must be divisble by the given group_size 32 but got 48$"):
        fake_quantize(w, scale, zero_point, args)


def test_fp4_rounding_equals_compressed_tensors_cast_including_its_ties():
    """Each E2M1 interval's ends (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5), the floats beside them, both signs and the
    clamp, in float32, bfloat16 and float16: the same values and signs of zero as compressed-tensors' cast_to_fp4."""
    from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA

    from llmc_fsm_quantization.rounding import _fp4_nearest

    ends = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0])
    edges = torch.cat([ends, torch.nextafter(ends, ends + 1), torch.nextafter(ends, ends - 1), 8 * torch.rand(4000) - 4])
    values = torch.cat([edges, -edges])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = values.to(dtype)
        got, expected = _fp4_nearest(x), FP4_E2M1_DATA.cast_to_fp4(x.clone())
        assert got.dtype == expected.dtype
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), dtype


@pytest.mark.parametrize("preset", ["NVFP4A16", "NVFP4", "MXFP4A16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_groups_equal_compressed_tensors_bitwise(preset, dtype):
    from llmc_fsm_quantization import resolve_scheme
    from llmc_fsm_quantization.observers import observe_scaled_format

    torch.manual_seed(3)
    args = resolve_scheme(preset, ["Linear"]).weights
    w = torch.randn(32, 128).to(dtype)
    w[0, :16] = 0.0
    scale, zero_point, *global_scale = observe_scaled_format(w, args)
    global_scale = global_scale[0] if global_scale else None
    expected = library_fake_quantize(w, scale, zero_point, args, global_scale=global_scale)
    got = fake_quantize(w, scale, zero_point, args, global_scale=global_scale)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
