"""Per-output-channel symmetric integer rounding with a clipping-ratio search on the layer's output error.

Plain round-to-nearest (RTN) with a symmetric per-channel grid gives row ``i`` of a weight ``W`` (``[out, in]``) the
scale ``s_i = max_j |W_ij| / q_max`` with ``q_max = 2^(bits-1) - 1``, and rounds
``W_hat_ij = s_i * clamp(round(W_ij / s_i), -2^(bits-1), q_max)``. One large weight stretches the whole row's grid;
clipping the range to a fraction ``r`` of it (``s_i = r * max_j |W_ij| / q_max``) rounds the other weights more
finely at the price of saturating the large ones. Which ``r`` is best depends on the inputs: the search here picks,
per row, the ratio among ``ratios`` that minimises that row's contribution to the layer's output error on the
calibration inputs,

    e_i(r) = (w_i - w_hat_i(r)) H (w_i - w_hat_i(r))^T,   H = 2/n X^T X,

which is ``(2/n) ||(w_i - w_hat_i) X||^2`` for the ``n`` calibration tokens ``X`` (``[n, in]``): the rows are
independent, so minimising each ``e_i`` minimises ``||W X - W_hat X||_F``. No weight is updated to compensate for
another's rounding (that is GPTQ); the result is a plain RTN grid with a searched range.

The grid search over clipping ratios is the weight-clipping step of AWQ (Lin et al., arXiv 2306.00978; its public
code tries ratios from 1.0 down to 0.5 on sampled tokens); here the output error comes from the Hessian the
calibration already accumulates, so every calibration token counts and no forward is re-run. Written for the
llmc-fsm documentation as an example of the public toolkit, not as a tuned algorithm.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["ClipSearch", "clip_ratios", "quantize_rows", "search_clip_ratios"]


def clip_ratios(steps: int, min_ratio: float) -> torch.Tensor:
    """The candidate clipping ratios: ``steps`` values from 1.0 down to ``min_ratio``, evenly spaced, float64.

    ``r_k = 1 - (1 - min_ratio) * k / (steps - 1)`` for ``k = 0 .. steps - 1`` (``steps = 1``: only 1.0, plain RTN).

    Raises:
        ValueError: ``steps`` is not an int >= 1, or ``min_ratio`` is not in ``(0, 1]``.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if isinstance(min_ratio, bool) or not isinstance(min_ratio, int | float) or not 0 < min_ratio <= 1:
        raise ValueError(f"min_ratio must be a number in (0, 1], got {min_ratio!r}")
    if steps == 1:
        return torch.ones(1, dtype=torch.float64)
    k = torch.arange(steps, dtype=torch.float64)
    return 1.0 - (1.0 - float(min_ratio)) * k / (steps - 1)


def quantize_rows(weight: torch.Tensor, ratio: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round each row of ``weight`` to its symmetric ``bits``-bit grid clipped at ``ratio`` of the row's range.

    Args:
        weight: ``[out, in]`` float tensor (not modified).
        ratio: ``[out]`` (or a scalar) clipping ratio per row, in ``(0, 1]``.
        bits: 2 to 8.

    Returns:
        ``(w_hat, scale)``, float64: ``w_hat`` ``[out, in]`` with
        ``w_hat_ij = scale_i * clamp(round(w_ij / scale_i), -2^(bits-1), 2^(bits-1) - 1)``, and ``scale`` ``[out]``
        ``= ratio_i * max_j |w_ij| / (2^(bits-1) - 1)`` (1.0 for an all-zero row, which stays zero). Each row takes
        at most ``2^bits`` distinct values. ``round`` is round-half-to-even (``torch.round``).
    """
    w = weight.detach().to(torch.float64)
    q_max = 2 ** (bits - 1) - 1
    absmax = w.abs().amax(dim=1)
    scale = torch.as_tensor(ratio, dtype=torch.float64, device=w.device).expand_as(absmax) * absmax / q_max
    scale = torch.where(absmax > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(w / scale[:, None]), -q_max - 1, q_max)
    return q * scale[:, None], scale


class ClipSearch(NamedTuple):
    """What :func:`search_clip_ratios` returns.

    Attributes:
        weight: ``[out, in]`` rounded weight, float64.
        ratio: ``[out]`` chosen clipping ratio per row, float64.
        index: ``[out]`` int64 index of ``ratio`` in the candidates.
        row_error: ``[out]`` float64 ``e_i`` of the chosen ratio (see the module docs).
        rtn_row_error: ``[out]`` float64 ``e_i`` of ratio 1.0 (plain RTN).
    """

    weight: torch.Tensor
    ratio: torch.Tensor
    index: torch.Tensor
    row_error: torch.Tensor
    rtn_row_error: torch.Tensor


@torch.no_grad()
def search_clip_ratios(weight: torch.Tensor, hessian: torch.Tensor, *, bits: int, ratios: torch.Tensor) -> ClipSearch:
    """Per row of ``weight``, the clipping ratio among ``ratios`` with the least output error, and the rounded row.

    Every candidate is tried on every row (float64): ``e_i(r) = d_i H d_i^T`` with ``d_i = w_i - w_hat_i(r)``
    (:func:`quantize_rows`). The first candidate wins ties, so list 1.0 first (:func:`clip_ratios` does) to keep
    plain RTN unless clipping is strictly better. Cost: ``len(ratios)`` products ``[out, in] x [in, in]``.

    Args:
        weight: ``[out, in]`` float tensor (not modified).
        hessian: ``[in, in]`` symmetric positive semi-definite, ``2/n X^T X`` of the layer's inputs (any float dtype;
            e.g. ``llmc_fsm.toolkit.HessianAccumulator.hessian``).
        bits: 2 to 8.
        ratios: ``[k]`` candidate ratios in ``(0, 1]``, ``k >= 1``; must contain 1.0 so the result is never worse
            than plain RTN.

    Raises:
        ValueError: shapes that do not fit, ``bits`` outside 2..8, or ratios outside ``(0, 1]`` / without 1.0.
    """
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        msg = f"weight [out, in] and hessian [in, in] do not fit: {tuple(weight.shape)}, {tuple(hessian.shape)}"
        raise ValueError(msg)
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an int from 2 to 8, got {bits!r}")
    candidates = [float(r) for r in torch.as_tensor(ratios, dtype=torch.float64).reshape(-1)]
    if not candidates or not all(0 < r <= 1 for r in candidates) or 1.0 not in candidates:
        raise ValueError(f"ratios must be numbers in (0, 1] including 1.0, got {candidates}")
    w = weight.detach().to(torch.float64)
    H = hessian.detach().to(device=w.device, dtype=torch.float64)
    rows = w.shape[0]
    best_error = torch.full((rows,), math.inf, dtype=torch.float64, device=w.device)
    best_index = torch.zeros(rows, dtype=torch.int64, device=w.device)
    best_weight = torch.zeros_like(w)
    rtn_error = None
    for k, r in enumerate(candidates):
        w_hat, _ = quantize_rows(w, torch.tensor(r, dtype=torch.float64), bits)
        d = w - w_hat
        error = ((d @ H) * d).sum(dim=1)
        if r == 1.0 and rtn_error is None:
            rtn_error = error
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_index = torch.where(better, torch.full_like(best_index, k), best_index)
        best_weight[better] = w_hat[better]
    chosen = torch.tensor(candidates, dtype=torch.float64, device=w.device)[best_index]
    return ClipSearch(best_weight, chosen, best_index, best_error, rtn_error)
