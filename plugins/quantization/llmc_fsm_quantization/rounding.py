"""Quantize-dequantize ("fake quantization") of weights onto an integer grid, in place on one working copy.

compressed-tensors' ``fake_quantize`` computes ``(clamp(round(x / scale + zp), q_min, q_max) - zp) * scale`` with
a new tensor for every step (division, clamp, round, subtraction, product: five tensors of the weight's size). For
integer schemes with tensor, channel or group scales and no global scale, :func:`fake_quantize` here runs the same
operations in the same order on one copy, in place, so the result is bitwise equal to compressed-tensors' (tested
against it over bits, strategies, symmetric and asymmetric zero points, and scale dtypes); every other scheme (FP8,
MX, block scales, a global scale) is handed to compressed-tensors' ``fake_quantize`` unchanged, except FP4 (NVFP4,
MXFP4) on the CPU: compressed-tensors' CPU rounding to E2M1 is eight masked assignments over the tensor (~11 ms
for a 576 x 1536 weight, most of a search's time), done here in a few elementwise operations with the same
result, bitwise (tested against it).
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
    if _fp4_groups(args) and x.device.type == "cpu":
        return _fp4_fake_quantize(x, scale, zero_point, args, global_scale)
    if args.type != QuantizationType.INT or args.strategy not in _IN_PLACE_STRATEGIES or global_scale is not None:
        return _library_fake_quantize(x, scale, zero_point, args, global_scale=global_scale)
    q_min, q_max = calculate_range(args, x.device)
    shape, dtype = x.shape, x.dtype
    if args.strategy == QuantizationStrategy.GROUP:
        x, scale, zero_point = _as_groups(x, scale, zero_point, args.group_size)
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


def _as_groups(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x`` ``[..., cols]`` as ``[..., cols // group_size, group_size]``, and the scale and zero point ``[rows,
    groups]`` (or fewer dimensions) broadcast to it, as compressed-tensors' ``_process_group`` shapes them.

    Raises:
        ValueError: ``cols`` is not a multiple of ``group_size`` (compressed-tensors' message).
    """
    columns = x.shape[-1]
    if columns % group_size:
        msg = f"tensor column shape must be divisble by the given group_size {group_size} but got {columns}"
        raise ValueError(msg)
    while scale.ndim < 2:
        scale = scale.unsqueeze(1)
        zero_point = zero_point.unsqueeze(1) if zero_point is not None else None
    x = x.unflatten(-1, (columns // group_size, group_size))
    return x, scale.unsqueeze(-1), zero_point.unsqueeze(-1) if zero_point is not None else None


def _fp4_groups(args: QuantizationArgs) -> bool:
    """FP4 (E2M1) weights with group scales: NVFP4 (``tensor_group``), MXFP4 (``group``)."""
    return (
        args.type == QuantizationType.FLOAT
        and args.num_bits == 4
        and args.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP)
    )


def _fp4_nearest(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``cast_to_fp4`` (its CPU path: eight masked assignments over the tensor) in a few
    elementwise operations: the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6) of each entry, with ``x``'s sign, in
    ``x``'s dtype. E2M1 is spaced 0.5 below 2, 1 up to 4 and 2 above, so ``round(|x| / step) * step`` with that
    step, rounding half to even, breaks every tie as compressed-tensors' intervals do (0.25 -> 0, 0.75 -> 1,
    1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), and the divisions by powers of two are exact."""
    magnitude = x.abs()
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0)).to(x.dtype)
    return magnitude.div_(step).round_().mul_(step).clamp_(max=6.0) * torch.sign(x)


def _fp4_fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantizationArgs,
    global_scale: torch.Tensor | None,
) -> torch.Tensor:
    """compressed-tensors' ``fake_quantize`` of FP4 group weights (``_process_group``, ``_quantize_dequantize``), the
    same operations in the same dtypes, with :func:`_fp4_nearest` for its ``cast_to_fp4``."""
    q_min, q_max = calculate_range(args, x.device)
    output_dtype = x.dtype
    x, scale, zero_point = _as_groups(x, scale, zero_point, args.group_size)
    if global_scale is not None:
        scale = scale / global_scale
    scaled = x / scale
    if zero_point is not None:
        scaled += zero_point.to(x.dtype)
    dequant = _fp4_nearest(torch.clamp(scaled, q_min, q_max)).to(scaled.dtype).to(scale.dtype)
    if zero_point is not None:
        dequant = dequant - zero_point.to(scale.dtype)
    return (dequant * scale).flatten(start_dim=-2).to(output_dtype)


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
