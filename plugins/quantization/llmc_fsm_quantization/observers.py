"""Weight observers: the scale and zero point of a weight (or of each of its rows / groups).

``minmax`` takes each group's minimum and maximum; ``mse`` shrinks that range
by a factor ``p`` in ``1, 0.99, ..., 0.81`` (``grid`` = 100 steps, at most 20%
shrink) and keeps, per group, the ``p`` whose fake-quantized values have the
smallest ``sum |x - q(x)|^2.4`` (the search of GPTQ's reference code,
arXiv 2210.17323, and llm-compressor's MSE observer). Scale and zero point
from a range come from ``compressed_tensors.quantization.utils.calculate_qparams``
and the rounding from ``compressed_tensors``' ``fake_quantize``, so the values
match what the checkpoint's compressor computes when it packs the weight.

Shapes (``W`` is ``[rows, cols]``): tensor strategy ``[1]``, channel
``[rows, 1]``, group ``[rows, cols // group_size]``.
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams

__all__ = ["OBSERVERS", "as_row_args", "observe", "quantize_rows", "row_qparams", "storable"]

#: Observer names accepted by the modifiers' ``observer`` argument.
OBSERVERS = ("minmax", "mse")

_MSE_GRID = 100
_MSE_MAX_SHRINK = 0.2
_MSE_NORM = 2.4


def as_row_args(args: QuantizationArgs) -> QuantizationArgs:
    """``args`` with channel strategy: one scale per row of a ``[G, n]`` matrix of groups."""
    return args.model_copy(update={"strategy": QuantizationStrategy.CHANNEL, "group_size": None, "actorder": None})


def _groups(weight: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """``weight`` as ``[G, n]``: one row per scale."""
    rows, cols = weight.shape
    if args.strategy == QuantizationStrategy.TENSOR:
        return weight.reshape(1, -1)
    if args.strategy == QuantizationStrategy.CHANNEL:
        return weight
    if args.strategy == QuantizationStrategy.GROUP:
        return weight.reshape(rows * (cols // args.group_size), args.group_size)
    msg = f"observer: strategy {args.strategy!r} is not supported (tensor, channel, group)"
    raise ValueError(msg)


def quantize_rows(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, row_args: QuantizationArgs
) -> torch.Tensor:
    """Fake-quantize ``x`` ``[G, n]`` with one ``scale``/``zero_point`` ``[G, 1]`` per row (channel ``row_args``)."""
    return fake_quantize(x, scale, zero_point, row_args)


def row_qparams(x: torch.Tensor, row_args: QuantizationArgs, observer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point ``[G, 1]`` of each row of ``x`` ``[G, n]`` (channel ``row_args``) by ``observer``."""
    lo = x.amin(dim=1, keepdim=True)
    hi = x.amax(dim=1, keepdim=True)
    scale, zp = calculate_qparams(lo, hi, row_args)
    if observer == "minmax":
        return scale, zp
    best = torch.full((x.shape[0], 1), float("inf"), dtype=torch.float32, device=x.device)
    for i in range(int(_MSE_MAX_SHRINK * _MSE_GRID) + 1):
        p = 1.0 - i / _MSE_GRID
        s, z = (scale, zp) if i == 0 else calculate_qparams(lo * p, hi * p, row_args)
        err = (quantize_rows(x, s, z, row_args) - x).abs_().pow_(_MSE_NORM).sum(dim=1, keepdim=True)
        better = err < best
        best = torch.where(better, err, best)
        scale = torch.where(better, s, scale)
        zp = torch.where(better, z, zp)
    return scale, zp


def storable(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` (float32) rounded to the values a ``dtype`` parameter holds, still float32.

    compressed-tensors stores ``weight_scale`` in the weight's dtype; a bfloat16 / float16 model whose weights
    were rounded with the float32 scale would reload (from the rounded scale) as a different model.
    """
    if not dtype.is_floating_point or torch.finfo(dtype).bits >= torch.finfo(scale.dtype).bits:
        return scale
    return scale.to(dtype).to(scale.dtype).clamp_min_(torch.finfo(dtype).tiny)


@torch.no_grad()
def observe(
    weight: torch.Tensor, args: QuantizationArgs, observer: str = "minmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of ``weight`` for ``args`` (strategy tensor, channel or group).

    Args:
        weight: ``[rows, cols]`` float tensor (group strategy: ``cols`` divisible by ``group_size``).
        args: the weight's ``QuantizationArgs``.
        observer: ``"minmax"`` or ``"mse"``.

    Returns:
        ``(scale, zero_point)`` shaped ``[1]`` / ``[rows, 1]`` / ``[rows, cols // group_size]``; scale float32
        holding values of ``weight``'s dtype (:func:`storable`), zero point in ``args.zp_dtype`` (symmetric: zeros).

    Raises:
        ValueError: unknown observer or strategy, or ``cols`` not divisible by ``group_size``.
    """
    if observer not in OBSERVERS:
        msg = f"unknown observer {observer!r}; choose one of {', '.join(OBSERVERS)}"
        raise ValueError(msg)
    rows, cols = weight.shape
    if args.strategy == QuantizationStrategy.GROUP and cols % args.group_size:
        msg = f"in_features {cols} is not a multiple of group_size {args.group_size}"
        raise ValueError(msg)
    x = _groups(weight.detach().to(torch.float32), args)
    scale, zp = row_qparams(x, as_row_args(args), observer)
    scale = storable(scale, weight.dtype)
    if args.strategy == QuantizationStrategy.TENSOR:
        return scale.reshape(1), zp.reshape(1)
    if args.strategy == QuantizationStrategy.CHANNEL:
        return scale, zp
    return scale.reshape(rows, cols // args.group_size), zp.reshape(rows, cols // args.group_size)
