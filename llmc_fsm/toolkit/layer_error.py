"""The relative output error of a compressed Linear layer on its calibration inputs.

``||W X - W_hat X||_F / ||W X||_F``, the number the per-layer report shows for
every target whose modifier keeps a Hessian ``H = 2/n X X^T`` (SparseGPT, GPTQ).
Because ``||A X||_F^2 = (n/2) tr(A H A^T)``, both norms come from ``H`` alone:

* :func:`relative_output_error` — from ``H`` directly: two products with ``H``
  (``2 * out * in^2`` multiply-adds each);
* :func:`sweep_relative_errors` — from what an OBS sweep already computed
  (:func:`llmc_fsm.toolkit.obs.obs_sweep`): the numerator is the sum of the sweep's
  error terms, exact for the damped Hessian (GPTQ arXiv 2210.17323, Section 3:
  each column's step adds ``(w_j - q_j)^2 / [H_F^-1]_jj`` to the error), and the
  denominator is one triangular solve with the factor ``U``. Measured on
  SmolLM2-135M (GPTQ W4A16, 2 CPU cores): the same values to ~1e-7 relative,
  0.6 s for the whole model instead of 1.7 s.
"""

from __future__ import annotations

import torch

from llmc_fsm.toolkit.obs import InverseHessianFactor

__all__ = ["relative_output_error", "sweep_relative_errors"]


@torch.no_grad()
def relative_output_error(old: torch.Tensor, new: torch.Tensor, hessian: torch.Tensor) -> float:
    """``||W X - W_hat X||_F / ||W X||_F`` on the inputs ``X`` whose Hessian is ``H = 2/n X X^T``.

    Computed from ``H`` alone: ``||A X||_F^2 = (n/2) tr(A H A^T)``, and ``n/2``
    cancels in the ratio. ``old``/``new`` are ``[out, in]``; ``hessian`` ``[in, in]``
    (any float dtypes, on one device; computed in float32). ``||W X - W_hat X||`` is
    the layer-wise objective of GPTQ (arXiv 2210.17323, Section 3) and SparseGPT
    (arXiv 2301.00774, Section 3).

    Returns:
        The ratio, a float ``>= 0`` (unitless); 0.0 when ``||W X||`` is 0.

    Raises:
        RuntimeError: shapes that do not fit (from the matrix products).
    """
    H = hessian.to(torch.float32)
    W = old.to(torch.float32)
    D = W - new.to(torch.float32)
    num = float(((D @ H) * D).sum())
    den = float(((W @ H) * W).sum())
    return _ratio(num, den)


@torch.no_grad()
def sweep_relative_errors(
    original: torch.Tensor,
    final: torch.Tensor,
    factor: InverseHessianFactor,
    row_errors: torch.Tensor,
    rows: list[int],
    hessian: torch.Tensor | None = None,
) -> list[float]:
    """:func:`relative_output_error` of each weight of one OBS sweep, from the sweep's own terms.

    With ``H'`` the Hessian whose dead diagonal entries were set to 1 and
    ``lambda`` the damping (``factor``), for a row ``w`` and its change ``d``:
    ``d H d^T = sum_j e_j^2 - lambda ||d||^2 - ||d_dead||^2`` (the sweep's terms,
    ``row_errors``) and ``w H w^T = ||w U^-1||^2 - lambda ||w||^2 - ||w_dead||^2``.

    Args:
        original: float32 ``[in, R]``: the transposed weights before the sweep, side by side,
            columns in the order the sweep ran (the order of ``factor``).
        final: float32 ``[in, R]``: the same after the sweep.
        factor: the :func:`llmc_fsm.toolkit.obs.inverse_hessian_cholesky` result the sweep used.
        row_errors: float32 ``[R]``, what :func:`llmc_fsm.toolkit.obs.obs_sweep` returned.
        rows: the output rows of each weight (they sum to ``R``).
        hessian: ``[in, in]``, the undamped Hessian in the same column order. When the damping terms are
            nearly all of the sweep's (``dampening_frac`` of ~1e3 and more), the differences above lose their
            float32 digits; a weight whose difference is under 1e-3 of its damping terms is then measured with
            :func:`relative_output_error` on ``hessian`` instead (without it, its value may be off, down to 0).

    Returns:
        One error per weight (0.0 where ``||W X||`` is 0).

    Raises:
        ValueError: shapes that do not fit.
    """
    if original.shape != final.shape or original.dim() != 2 or row_errors.shape != (original.shape[1],):
        msg = f"original {tuple(original.shape)}, final {tuple(final.shape)} and row_errors "
        raise ValueError(msg + f"{tuple(row_errors.shape)} do not fit ([in, R], [in, R], [R])")
    if sum(rows) != original.shape[1]:
        raise ValueError(f"rows {rows} do not add up to the {original.shape[1]} columns of original")
    U, dead, damping = factor
    energy = torch.linalg.solve_triangular(U, original.T, upper=True, left=False).square().sum(1)  # W U^-1
    den_terms = _diagonal_terms(original, dead, damping)
    den = energy - den_terms
    change = original - final
    num_terms = _diagonal_terms(change, dead, damping)
    num = row_errors - num_terms
    out, r0 = [], 0
    for r in rows:
        part = slice(r0, r0 + r)
        n, d = float(num[part].sum()), float(den[part].sum())
        if hessian is not None and (
            n < _RELIABLE * float(num_terms[part].sum()) or d < _RELIABLE * float(den_terms[part].sum())
        ):
            out.append(relative_output_error(original[:, part].T, final[:, part].T, hessian))
        else:
            out.append(_ratio(n, d))
        r0 += r
    return out


#: A difference of the sweep's terms under this fraction of its damping terms has lost its float32 digits.
_RELIABLE = 1e-3


def _diagonal_terms(AT: torch.Tensor, dead: torch.Tensor, damping: float) -> torch.Tensor:
    """Per column of ``AT`` (``[in, R]``): ``damping * ||a||^2 + ||a_dead||^2``."""
    terms = AT.square().sum(0).mul_(damping)
    if bool(dead.any()):
        terms += AT[dead].square().sum(0)
    return terms


def _ratio(num: float, den: float) -> float:
    return (max(num, 0.0) / den) ** 0.5 if den > 0 else 0.0
