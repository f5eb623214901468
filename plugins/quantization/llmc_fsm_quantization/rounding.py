"""Quantize-dequantize ("fake quantization") of weights onto an integer grid, in place on one working copy.

compressed-tensors' ``fake_quantize`` computes ``(clamp(round(x / scale + zp), q_min, q_max) - zp) * scale`` with
a new tensor for every step (division, clamp, round, subtraction, product: five tensors of the weight's size). For
integer schemes with tensor, channel or group scales and no global scale, :func:`fake_quantize` here runs the same
operations in the same order on one copy, in place, so the result is bitwise equal to compressed-tensors' (tested
against it over bits, strategies, symmetric and asymmetric zero points, and scale dtypes); every other scheme (FP8,
FP4, MX, block scales, a global scale) is handed to compressed-tensors' ``fake_quantize`` unchanged.
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as _library_fake_quantize
from compressed_tensors.quantization.utils import calculate_range

__all__ = ["fake_quantize", "fp4_positive_zeros"]

_IN_PLACE_STRATEGIES = (QuantizationStrategy.TENSOR, QuantizationStrategy.CHANNEL, QuantizationStrategy.GROUP)


@torch.no_grad()
def fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantizationArgs,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize ``x`` to ``args``' grid and dequantize it: compressed-tensors' ``fake_quantize``, bitwise.

    Args:
        x: ``[rows, cols]`` float weight (not modified).
        scale: ``[1]`` (tensor), ``[rows, 1]`` (channel) or ``[rows, cols // group_size]`` (group) scales.
        zero_point: the zero points, shaped as ``scale`` (any integer or float dtype), or ``None``.
        args: the weight ``QuantizationArgs``.
        global_scale: NVFP4's global scale (handed to compressed-tensors).

    Returns:
        A new tensor of ``x``'s shape: in ``x``'s dtype for group scales, else in ``scale``'s dtype (as
        compressed-tensors).

    Raises:
        ValueError: the columns are not a multiple of the group size (as compressed-tensors).
    """
    if args.type != QuantizationType.INT or args.strategy not in _IN_PLACE_STRATEGIES or global_scale is not None:
        return _library_fake_quantize(x, scale, zero_point, args, global_scale=global_scale)
    q_min, q_max = calculate_range(args, x.device)
    shape, dtype = x.shape, x.dtype
    if args.strategy == QuantizationStrategy.GROUP:
        columns = shape[-1]
        if columns % args.group_size:
            msg = f"tensor column shape must be divisble by the given group_size {args.group_size} but got {columns}"
            raise ValueError(msg)
        while scale.ndim < 2:
            scale = scale.unsqueeze(1)
            zero_point = zero_point.unsqueeze(1) if zero_point is not None else None
        x = x.unflatten(-1, (columns // args.group_size, args.group_size))
        scale = scale.unsqueeze(-1)
        zero_point = zero_point.unsqueeze(-1) if zero_point is not None else None
    out = x / scale
    if zero_point is not None:
        out += zero_point.to(x.dtype)
    out.clamp_(q_min, q_max).round_()
    if out.dtype != scale.dtype:
        out = out.to(scale.dtype)
    if zero_point is not None:
        out.sub_(zero_point.to(scale.dtype))
    out.mul_(scale)
    if args.strategy == QuantizationStrategy.GROUP:  # compressed-tensors returns groups in x's dtype
        return out.reshape(shape).to(dtype)
    return out


#: compressed-tensors' formats that pack two FP4 (E2M1) codes per byte: sign bit 0x8, magnitude index 0x7.
FP4_PACKED_FORMATS = frozenset({"nvfp4-pack-quantized", "mxfp4-pack-quantized"})


def fp4_positive_zeros(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` (uint8, two FP4 E2M1 codes per byte, compressed-tensors' ``pack_fp4_to_uint8``) with every
    negative zero (code ``0x8``) made positive (``0x0``); a new tensor.

    A weight in ``(-scale / 4, 0)`` rounds to FP4 ``-0``. Quantizing it twice (fake quantization, then the
    compressor's rounding, which adds the zero point ``0``: ``-0 + 0 = +0``) wrote ``+0``; rounded once it would be
    ``-0``. Both dequantize to zero; this keeps the checkpoint bytes those of the twice-rounded weight.
    """
    low, high = packed & 0x0F, packed & 0xF0
    low = torch.where(low == 0x08, torch.zeros_like(low), low)
    high = torch.where(high == 0x80, torch.zeros_like(high), high)
    return low | high
