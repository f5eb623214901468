"""Mask structures, the count rule shared by every pruning algorithm, and the magnitude mask.

Conventions used throughout the pruning plugin
-----------------------------------------------
* ``weight`` is a 2-D ``Linear`` weight of shape ``[out_features, in_features]``
  (rows = outputs, columns = inputs), any floating dtype, any device.
* Every mask is a ``torch.bool`` tensor shaped like ``weight`` where
  **True means "keep"** and False means "pruned (set to zero)".
* ``sparsity`` is the requested fraction of *zeros*, a real number in ``[0, 1)``.
* ``mask_structure`` is ``None`` / ``"unstructured"`` or an ``"N:M"`` string
  (or an ``(N, M)`` tuple), see :func:`parse_mask_structure`. With an N:M
  structure the pattern alone fixes the sparsity at ``(M - N) / M``;
  ``sparsity`` is then only range-checked and otherwise ignored.

Count rule (shared by all algorithms)
-------------------------------------
For a selection group of ``n`` weights the number of pruned weights is

    ``k = num_to_prune(n, sparsity) = floor(sparsity * n + 1/2)``

i.e. ``sparsity * n`` rounded to the nearest integer, halves rounded up
(a ``1e-9`` slack absorbs float representation error such as
``0.29 * 100 == 28.999999999999996``). The *selection group* is

* magnitude, unstructured: the whole matrix (``n = out * in``);
* Wanda, unstructured: each output row (``n = in``) - every row has exactly
  ``k`` zeros;
* SparseGPT, unstructured: each column block ``[c0, c1)`` over all rows - the
  block prunes exactly ``num_to_prune(c1 * out, s) - num_to_prune(c0 * out, s)``
  weights (rows may differ), so the whole matrix has
  ``num_to_prune(out * in, s)`` zeros;
* every algorithm with N:M: each group of ``M`` consecutive input columns of
  each row keeps exactly ``N`` weights (prunes ``M - N``).
"""

from __future__ import annotations

import logging
import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

import attrs
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "MaskStructure",
    "check_mask_args",
    "check_nm_divisible",
    "check_sparsity",
    "check_weight",
    "magnitude_mask",
    "mask_structure_validator",
    "nm_keep",
    "num_to_prune",
    "parse_mask_structure",
    "prune_lowest_per_row",
    "resolve_structure",
    "sparsity_validator",
]

#: What the ``mask_structure`` arguments accept.
MaskStructure = str | tuple[int, int] | None

_MASK_STRUCTURE_HELP = (
    "expected 'unstructured' (alias '0:0') or 'N:M' with integers 0 < N < M, "
    "meaning N nonzero weights are kept in every group of M consecutive "
    "weights along the input dimension (e.g. '2:4' = 50% sparsity)"
)
_NM_RE = re.compile(r"\s*(\d+)\s*:\s*(\d+)\s*")


# --------------------------------------------------------------------------- #
# Argument helpers
# --------------------------------------------------------------------------- #
def parse_mask_structure(s: str) -> tuple[int, int] | None:
    """Parse a mask-structure string.

    Convention (NVIDIA's): ``"N:M"`` means **N nonzero (kept) weights out of
    every M** consecutive weights along the input dimension (dim 1 of a
    ``[out, in]`` weight), i.e. ``M - N`` zeros per group. ``"2:4"`` is 50%
    sparsity, ``"4:8"`` too, ``"1:4"`` is 75%. Note that the SparseGPT
    reference code's ``prunen`` counts *pruned* weights instead; the two agree
    for 2:4 and 4:8 only.

    Args:
        s: ``"unstructured"`` (case-insensitive; ``"0:0"`` is accepted as an
            alias, as used by llm-compressor recipes) or ``"N:M"`` with
            integers ``0 < N < M``. Surrounding whitespace is ignored.

    Returns:
        ``None`` for unstructured, else ``(N, M)``.

    Raises:
        ValueError: for anything else; the message lists what is accepted.
    """
    if not isinstance(s, str):
        hint = ""
        if isinstance(s, int) and not isinstance(s, bool) and s >= 60 and 0 < s // 60 < s % 60:
            # YAML 1.1 reads an unquoted 2:4 as the base-60 number 124 (a newcomer copying a recipe was puzzled)
            hint = (
                f' (YAML read an unquoted {s // 60}:{s % 60} as the base-60 number {s}: quote it, "{s // 60}:{s % 60}")'
            )
        raise ValueError(f"invalid mask_structure {s!r}{hint}: {_MASK_STRUCTURE_HELP}")
    text = s.strip().lower()
    if text == "unstructured":
        return None
    match = _NM_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"invalid mask_structure {s!r}: {_MASK_STRUCTURE_HELP}")
    n, m = int(match.group(1)), int(match.group(2))
    if n == 0 and m == 0:
        return None
    if not 0 < n < m:
        raise ValueError(f"invalid mask_structure {s!r}: {_MASK_STRUCTURE_HELP}")
    return n, m


def resolve_structure(mask_structure: MaskStructure) -> tuple[int, int] | None:
    """``None`` (unstructured) or ``(N, M)`` for a ``mask_structure`` string, ``(N, M)`` tuple or ``None``.

    Raises:
        ValueError: anything else; the message lists what is accepted.
    """
    if mask_structure is None:
        return None
    if isinstance(mask_structure, str):
        return parse_mask_structure(mask_structure)
    if (
        isinstance(mask_structure, tuple)
        and len(mask_structure) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in mask_structure)
        and 0 < mask_structure[0] < mask_structure[1]
    ):
        return mask_structure
    raise ValueError(f"invalid mask_structure {mask_structure!r}: {_MASK_STRUCTURE_HELP}")


def check_sparsity(sparsity: float) -> float:
    """``sparsity`` as a float, checked to be a real number in ``[0, 1)``.

    Raises:
        ValueError: a bool, a non-number, NaN or a value outside ``[0, 1)``.
    """
    if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real):
        raise ValueError(f"sparsity must be a real number in [0, 1), got {sparsity!r}")
    value = float(sparsity)
    if not 0.0 <= value < 1.0:  # also rejects NaN
        raise ValueError(f"sparsity must be a real number in [0, 1), got {sparsity!r}")
    return value


def check_weight(weight: torch.Tensor) -> None:
    """Check that ``weight`` is a 2-D floating-point ``[out_features, in_features]`` tensor.

    Raises:
        ValueError: not a tensor, not 2-D, or not floating point.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight)
        raise ValueError(f"weight must be a 2-D [out_features, in_features] tensor, got {shape}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be a floating-point tensor, got dtype {weight.dtype}")


def check_nm_divisible(in_features: int, nm: tuple[int, int]) -> None:
    """Check that the ``M`` of an N:M structure divides ``in_features``.

    Raises:
        ValueError: it does not.
    """
    n, m = nm
    if in_features % m != 0:
        raise ValueError(f"{n}:{m} sparsity needs in_features divisible by {m}, got in_features={in_features}")


def sparsity_validator(instance: Any, attribute: Any, value: Any) -> None:
    """attrs validator of a modifier's sparsity argument (``sparsity``, ``init_sparsity``, ...).

    Raises:
        ValueError: a bool, a non-number, NaN or a value outside ``[0, 1)``; the message names the argument. A
            list or mapping (llm-compressor's per-layer form) is refused saying so, with what to write instead.
    """
    if isinstance(value, list | tuple | Mapping):
        msg = (
            f"{attribute.name} {value!r}: llm-compressor's per-layer form (a list matched to the targets, or a "
            f"mapping) is not supported here; give one number in [0, 1) per modifier, and for several sparsities "
            f"one modifier per sparsity with the layers it prunes as its targets (a stage in list form may hold the "
            f"same modifier several times: - {type(instance).__name__}: {{{attribute.name}: 0.3, targets: [...]}})"
        )
        raise ValueError(msg)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) < 1.0:
        msg = f"{attribute.name} must be a number in [0, 1) (fraction of weights set to zero), got {value!r}"
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value) in range(10, 100):
            msg += f" (a percentage? {float(value):g}% is {float(value) / 100:g})"
        raise ValueError(msg)


def mask_structure_validator(instance: Any, attribute: Any, value: Any) -> None:
    """attrs validator of a modifier's ``mask_structure`` argument (:func:`parse_mask_structure`).

    An ``N:M`` other than half of ``M`` kept is taken with a warning line: llm-compressor 0.14's pruners read ``N`` as
    the weights *pruned* of every ``M`` (its ``"3:4"`` leaves 75% zeros, ours 25%); the two agree for ``2:4``,
    ``4:8``, ``8:16``.

    Raises:
        ValueError: not ``"unstructured"`` or ``"N:M"``; the message lists what is accepted.
    """
    nm = parse_mask_structure(value)
    sparsity = getattr(instance, "sparsity", None)
    default = attrs.fields_dict(type(instance)).get("sparsity") if attrs.has(type(instance)) else None
    # only where sparsity has a number as its default (SparseGPT, Wanda): magnitude pruning (default None) refuses a
    # sparsity the structure contradicts itself, and the warning before its refusal was untrue (a tester's case)
    given = isinstance(sparsity, float) and default is not None and isinstance(default.default, float)
    given = given and sparsity != default.default
    if nm is not None and given and not math.isclose(sparsity, (nm[1] - nm[0]) / nm[1]):
        logger.warning(  # on both sides (llm-compressor's pruners too): a recipe's number that does nothing
            "%s: sparsity %s is not used: mask_structure %r fixes the sparsity (%.0f%% of each group of %d)",
            type(instance).__name__, sparsity, value, 100 * (nm[1] - nm[0]) / nm[1], nm[1],
        )  # fmt: skip
    if nm is not None and 2 * nm[0] != nm[1]:
        n, m = nm
        logger.warning(
            "%s: mask_structure %r keeps %d of every %d weights (NVIDIA's N:M: %.0f%% sparsity); llm-compressor 0.14 "
            "prunes %d of every %d for the same text (its '%d:%d' is this '%d:%d')",
            type(instance).__name__, value, n, m, 100 * (m - n) / m, n, m, n, m, m - n, m,
        )  # fmt: skip


def check_mask_args(
    weight: torch.Tensor, sparsity: float, mask_structure: MaskStructure
) -> tuple[float, tuple[int, int] | None]:
    """Check a mask function's arguments; return ``(sparsity, (N, M) or None)``.

    Raises:
        ValueError: a weight that is not a 2-D float tensor, ``sparsity`` outside ``[0, 1)``, or a bad
            ``mask_structure``.
    """
    check_weight(weight)
    return check_sparsity(sparsity), resolve_structure(mask_structure)


def num_to_prune(numel: int, sparsity: float) -> int:
    """Number of weights to prune in a selection group of ``numel`` weights.

    ``floor(sparsity * numel + 1/2)`` (round half up) with a ``1e-9`` slack for
    float error, clamped to ``[0, numel]``. This is the single count rule used
    by :func:`magnitude_mask`, :func:`wanda_mask` and :func:`sparsegpt_prune`
    (see the module docstring for the selection group of each).

    Raises:
        ValueError: if ``sparsity`` is not in ``[0, 1)`` or ``numel < 0``.
    """
    s = check_sparsity(sparsity)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    k = math.floor(s * numel + 0.5 + 1e-9)
    return max(0, min(int(numel), k))


def prune_lowest_per_row(score: torch.Tensor, k: int) -> torch.Tensor:
    """Bool keep-mask pruning exactly the ``k`` lowest scores of every row."""
    keep = torch.ones(score.shape, dtype=torch.bool, device=score.device)
    if k > 0:
        idx = torch.topk(score, k, dim=1, largest=False, sorted=False).indices
        keep.scatter_(1, idx, False)
    return keep


def nm_keep(score: torch.Tensor, nm: tuple[int, int]) -> torch.Tensor:
    """Bool keep-mask keeping the ``N`` highest scores of every group of ``M`` columns."""
    n, m = nm
    rows, cols = score.shape
    grouped = score.reshape(rows, cols // m, m)
    idx = torch.topk(grouped, n, dim=2, largest=True, sorted=False).indices
    keep = torch.zeros(grouped.shape, dtype=torch.bool, device=score.device)
    keep.scatter_(2, idx, True)
    return keep.reshape(rows, cols)


@torch.no_grad()
def magnitude_mask(weight: torch.Tensor, sparsity: float, mask_structure: MaskStructure = None) -> torch.Tensor:
    """Keep-mask that prunes the smallest-magnitude weights.

    Args:
        weight: ``[out_features, in_features]`` floating tensor.
        sparsity: fraction of zeros in ``[0, 1)``; ignored (only range-checked)
            when ``mask_structure`` is N:M.
        mask_structure: ``None``/``"unstructured"``: exactly
            ``num_to_prune(weight.numel(), sparsity)`` weights with the smallest
            ``|w|`` over the whole matrix are pruned (ties broken arbitrarily but
            the count is exact). ``"N:M"``: in every group of ``M`` consecutive
            weights along dim 1 the ``N`` largest ``|w|`` are kept.

    Returns:
        ``torch.bool`` tensor shaped like ``weight``, True = keep.

    Raises:
        ValueError: bad ``sparsity``/``mask_structure``/``weight`` shape, or
            ``in_features`` not divisible by ``M`` for N:M.
    """
    s, nm = check_mask_args(weight, sparsity, mask_structure)
    score = weight.detach().abs().to(torch.float32)
    if nm is not None:
        check_nm_divisible(weight.shape[1], nm)
        return nm_keep(score, nm)
    k = num_to_prune(weight.numel(), s)
    keep = torch.ones(weight.numel(), dtype=torch.bool, device=weight.device)
    if k > 0:
        idx = torch.topk(score.reshape(-1), k, largest=False, sorted=False).indices
        keep[idx] = False
    return keep.reshape(weight.shape)
