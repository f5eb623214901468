"""Bit-packed boolean masks: a pruning mask stored in an eighth of a ``uint8`` tensor (checkpoints, resume)."""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["pack_mask", "unpack_mask"]


def pack_mask(keep: torch.Tensor) -> torch.Tensor:
    """Bit-pack a bool mask: ``uint8`` tensor of ``ceil(numel / 8)`` bytes (row-major, most significant bit first).

    Args:
        keep: a mask of any shape and device (converted to ``bool``: nonzero is ``True``).

    Returns:
        A 1-D CPU ``uint8`` tensor; the shape is not stored (give it to :func:`unpack_mask`).
    """

    bits = keep.detach().to(device="cpu", dtype=torch.bool).reshape(-1).numpy()
    return torch.from_numpy(np.packbits(bits))


def unpack_mask(packed: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: a CPU ``bool`` tensor of ``shape``.

    Raises:
        ValueError: ``packed`` is not ``uint8`` or has the wrong number of bytes for ``shape``.
    """

    numel = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.numel() != (numel + 7) // 8:
        msg = (
            f"a packed mask for shape {tuple(shape)} has {(numel + 7) // 8} uint8 bytes; got "
            f"{packed.numel()} {packed.dtype} elements"
        )
        raise ValueError(msg)
    bits = np.unpackbits(packed.detach().cpu().numpy(), count=numel)
    return torch.from_numpy(bits.astype(bool)).reshape(tuple(shape))
