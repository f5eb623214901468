"""Bit-packed boolean masks: a pruning mask stored in an eighth of a ``uint8`` tensor (checkpoints, resume); the N:M
structure a weight's zeros follow (:func:`fewest_zeros`, :func:`follows_structure`: a saved ``sparsity_config``)."""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["SPARSE_FROM", "fewest_zeros", "follows_structure", "pack_mask", "unpack_mask", "zeros_structure"]

#: Zeros from which a weight counts as sparse (5%): its N:M groups are measured (:func:`fewest_zeros`), and a saved
#: ``sparsity_config`` lists it.
SPARSE_FROM = 0.05


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


def fewest_zeros(weight: torch.Tensor, zeros: int) -> dict[int, int]:
    """For a ``[out, in]`` weight with ``zeros`` exact zeros, at least :data:`SPARSE_FROM` of it: ``{M: the fewest
    exact zeros in any group of M consecutive inputs of a row}`` for M = 4, 8, 16, 32 dividing ``in``; else ``{}``.

    The weight follows N:M sparsity (at least N zeros in every group of M, llm-compressor's
    ``tensor_follows_mask_structure``) when that count is at least N (:func:`follows_structure`).
    """
    if weight.dim() != 2 or zeros < SPARSE_FROM * weight.numel():
        return {}
    rows, cols = weight.shape
    zero = (weight == 0).view(torch.uint8)  # one [out, in] temporary for the three widths
    widths = [m for m in (4, 8, 16, 32) if cols % m == 0]
    return {m: int(zero.reshape(rows, cols // m, m).sum(dim=2, dtype=torch.int32).min()) for m in widths}


def _n_m(structure: str) -> tuple[int, int] | None:
    """``(N, M)`` of ``"N:M"``, else ``None``."""
    n, _, m = structure.partition(":")
    return (int(n), int(m)) if n.isdigit() and m.isdigit() else None


def follows_structure(fewest: dict[int, int], structure: str) -> bool:
    """Whether a weight whose :func:`fewest_zeros` are ``fewest`` follows ``structure`` (``"N:M"``: at least N zeros in
    every M); ``False`` for a structure that was not measured (another M) or is not ``N:M``."""
    nm = _n_m(structure)
    return nm is not None and nm[1] in fewest and fewest[nm[1]] >= nm[0]


def zeros_structure(kept: str) -> str | None:
    """The ``"N:M"`` of N zeros in every M (compressed-tensors' and vLLM's reading) of a pruning ``mask_structure``
    read as N *kept* of every M (NVIDIA's, the first-party pruners'): ``"1:4"`` -> ``"3:4"``; ``None`` when not
    ``N:M``."""
    nm = _n_m(kept)
    return None if nm is None else f"{nm[1] - nm[0]}:{nm[1]}"
