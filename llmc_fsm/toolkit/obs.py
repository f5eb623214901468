"""Optimal-brain-surgeon machinery shared by SparseGPT and GPTQ.

Both algorithms minimise the layer-wise reconstruction error ``||W X - W_hat X||^2`` of a ``Linear`` layer column
by column, compensating each column's error on the columns not yet processed through the inverse Hessian of that
error (OBS; Frantar et al., GPTQ arXiv 2210.17323, Section 3 and Alg. 1; Frantar & Alistarh, SparseGPT arXiv
2301.00774, Section 3 and Alg. 1). They differ only in what a column becomes: SparseGPT zeroes the weights its mask
prunes, GPTQ rounds every weight to the quantization grid. This module holds what they share:

* :class:`HessianAccumulator` — ``H = 2/n * sum x x^T`` from calibration inputs;
* :func:`inverse_hessian_cholesky` — dead-input handling, damping
  ``lambda = dampening_frac * mean(diag H)`` with retries, and the upper Cholesky
  factor ``U`` of ``(H + lambda I)^-1``;
* :func:`obs_sweep` — the column sweep with lazy batch updates, parametrised by a
  :class:`ColumnRule` that says what each column becomes; it returns each row's
  error terms, from which :func:`llmc_fsm.toolkit.layer_error.sweep_relative_errors`
  gives the layer's relative output error without another product with ``H``.

Conventions: a weight is ``[out_features, in_features]`` (rows = outputs,
columns = inputs); the sweep works on its transpose ``WT`` (``[in, out]``) so that
a column is a contiguous row. All math is float32.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple, Protocol

import torch

from llmc_fsm.toolkit.distributed import all_reduce_tensor, is_distributed

__all__ = [
    "MAX_DAMPENING_FRAC",
    "ColumnRule",
    "HessianAccumulator",
    "HessianNotPositiveDefiniteError",
    "InverseHessianFactor",
    "MaskRule",
    "check_dampening_frac",
    "inverse_hessian_cholesky",
    "obs_sweep",
]

logger = logging.getLogger(__name__)

#: From this many input features on, only the upper block triangle of X^T X is computed.
_SYMMETRIC_MIN_FEATURES = 512
#: Columns per inner sub-block of the sweep (measured fastest on 2 CPU cores among 8-64).
SUB_BLOCK = 32


class HessianNotPositiveDefiniteError(ValueError):
    """The (damped) Hessian could not be Cholesky-factorised: raised by :func:`inverse_hessian_cholesky` after its
    damping retries (a ``ValueError``: more damping or more / more diverse calibration data fixes it)."""


class InverseHessianFactor(NamedTuple):
    """What :func:`inverse_hessian_cholesky` returns.

    Attributes:
        U: float32 ``[C, C]`` upper triangular, ``U^T U = (H' + damping I)^-1``.
        dead: bool ``[C]``, the inputs with ``H_jj == 0``; ``H'`` is ``H`` with those diagonal entries set to 1.
        damping: the ``lambda`` added to the diagonal (``dampening_frac * mean(diag H')``, after any retries).
    """

    U: torch.Tensor
    dead: torch.Tensor
    damping: float


class HessianAccumulator:
    """Running Hessian ``H = (2 / n) * sum_t x_t^T x_t`` of a Linear layer's inputs.

    ``H`` is the Hessian of the layer-wise reconstruction error
    ``||W X - W_hat X||^2`` (normalised by the token count ``n``) used by
    SparseGPT (arXiv:2301.00774, Section 3) and GPTQ (arXiv:2210.17323,
    Section 3). Every row of every batch counts as one sample (token), so the
    result is independent of how the tokens are split into batches.

    Storage is a float32 ``[in_features, in_features]`` matrix on the device of
    the first batch (or ``device`` if given); updates are
    ``H <- H * n_old / n_new + (2 / n_new) * X^T X`` computed in float32.

    The per-input-channel squared norms needed by Wanda come for free from the
    diagonal, ``||X_j||_2^2 = (n / 2) * H_jj`` (:attr:`input_sq_norm`).

    With ``diagonal_only`` only ``diag(H)`` is kept (float32 ``[in_features]``, ``C`` multiply-adds per token
    instead of ``C^2 / 2``): for a modifier that needs the inputs' mean squares (``imatrix_mse``) but no Hessian
    (round-to-nearest); :attr:`hessian` then raises ``AttributeError`` (``getattr(acc, "hessian", None)`` is
    ``None``).

    Args:
        in_features: ``C``, the size of the input's last dimension.
        device: where to keep ``H``; default: the device of the first batch.
        diagonal_only: keep ``diag(H)`` only.

    Raises:
        ValueError: ``in_features`` is not a positive int.
    """

    def __init__(
        self, in_features: int, device: torch.device | str | None = None, *, diagonal_only: bool = False
    ) -> None:
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        self.in_features = in_features
        self.diagonal_only = bool(diagonal_only)
        self._num_samples = 0
        self._mirrored = True  # False while only the upper block triangle is current
        self._hessian: torch.Tensor | None = None  # [C, C], or [C] (the diagonal) with diagonal_only
        if device is not None:
            self._hessian = torch.zeros(self._shape, dtype=torch.float32, device=device)

    @property
    def _shape(self) -> tuple[int, ...]:
        return (self.in_features,) if self.diagonal_only else (self.in_features, self.in_features)

    @torch.no_grad()
    def add_batch(self, x: torch.Tensor) -> None:
        """Add inputs ``x`` of shape ``[..., in_features]`` (any float dtype).

        All leading dimensions are flattened; each resulting row is one sample.

        Raises:
            ValueError: if the last dimension is not ``in_features``.
        """
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"expected input with last dimension {self.in_features}, got shape {tuple(x.shape)}")
        x = x.detach().reshape(-1, self.in_features)
        tokens = x.shape[0]
        if tokens == 0:
            return
        if self._hessian is None:
            self._hessian = torch.zeros(self._shape, dtype=torch.float32, device=x.device)
        x = x.to(device=self._hessian.device, dtype=torch.float32)
        total = self._num_samples + tokens
        H = self._hessian
        H.mul_(self._num_samples / total)
        cols = self.in_features
        if self.diagonal_only:
            H.add_(x.square().sum(0), alpha=2.0 / total)
        elif cols < _SYMMETRIC_MIN_FEATURES:
            H.addmm_(x.T, x, alpha=2.0 / total)
        else:
            # H is symmetric: compute only the block-upper triangle (6 row blocks:
            # 21/36 of the products; 2048 tokens, 2 cores: 43 -> 26 ms for 1536 inputs,
            # 5.9 -> 3.7 ms for 576; 4 blocks gave 28 / 3.9 ms) and mirror it when read.
            step = -(-cols // 6)
            for a in range(0, cols, step):
                H[a : a + step, a:].addmm_(x[:, a : a + step].T, x[:, a:], alpha=2.0 / total)
            self._mirrored = False
        self._num_samples = total

    @property
    def hessian(self) -> torch.Tensor:
        """``H``, float32 ``[in_features, in_features]`` (zeros before any batch).

        This is the live buffer, not a copy; clone it before modifying.

        Raises:
            AttributeError: the accumulator keeps the diagonal only (``diagonal_only``).
        """
        if self.diagonal_only:
            raise AttributeError("this HessianAccumulator keeps diag(H) only (diagonal_only=True): no hessian")
        if self._hessian is None:
            return torch.zeros(self.in_features, self.in_features, dtype=torch.float32)
        if not self._mirrored:
            H = self._hessian
            H.copy_(torch.triu(H) + torch.triu(H, diagonal=1).T)
            self._mirrored = True
        return self._hessian

    @property
    def diagonal(self) -> torch.Tensor:
        """``diag(H)``, float32 ``[in_features]`` (zeros before any batch); with ``diagonal_only`` the live buffer."""
        if self.diagonal_only:
            return self._hessian if self._hessian is not None else torch.zeros(self.in_features)
        return torch.diagonal(self.hessian)

    @property
    def input_sq_norm(self) -> torch.Tensor:
        """``||X_j||_2^2`` summed over all tokens, float32 ``[in_features]``."""
        return self.diagonal * (self._num_samples / 2.0)

    @property
    def num_samples(self) -> int:
        """Number of tokens (rows after flattening) accumulated so far."""
        return self._num_samples

    def reset(self) -> None:
        """Forget all samples (keeps the allocated buffer)."""
        self._num_samples = 0
        self._mirrored = True
        if self._hessian is not None:
            self._hessian.zero_()

    @torch.no_grad()
    def all_reduce(self) -> None:
        """Combine the statistics of every rank of the ``torch.distributed`` process group, in place.

        ``H_r`` is normalised by its rank's token count ``n_r``, so the sums
        ``sum_r n_r H_r`` and ``n = sum_r n_r`` are reduced (float64, one
        collective) and ``H = (sum_r n_r H_r) / n``: the normalisation of one
        process that saw every token (equal up to float rounding), identical on
        every rank. A rank without samples contributes zeros. Every rank must
        call it; without a process group of more than one rank it does nothing.

        Raises:
            DistributedError: the collective failed (another rank stopped or timed out).
        """

        if not is_distributed():
            return
        H = None if self._hessian is None else self.diagonal if self.diagonal_only else self.hessian
        flat = torch.zeros(math.prod(self._shape) + 1, dtype=torch.float64)
        if H is not None:
            flat = flat.to(H.device)
            flat[:-1].copy_(H.reshape(-1)).mul_(self._num_samples)
        flat[-1] = self._num_samples
        all_reduce_tensor(flat, what="all_reduce (Hessian)")
        total = round(float(flat[-1]))
        if self._hessian is None:
            self._hessian = torch.zeros(self._shape, dtype=torch.float32, device=flat.device)
        if total > 0:
            self._hessian.copy_(flat[:-1].reshape(self._shape).div_(total))
        self._num_samples = total
        self._mirrored = True


def all_finite(x: torch.Tensor) -> bool:
    """No NaN/Inf in ``x``.

    A finite sum in ``x``'s own dtype proves it (a NaN or Inf makes any sum NaN or Inf); only when that sum is not
    finite — a NaN/Inf, or an overflow of finite values — one float64 sum decides (a sum of float32 values cannot
    overflow float64). The first sum is ~15x cheaper than the float64 one (1536 x 1536 float32: 0.4 vs 6.5 ms).
    A parameter that requires grad is read detached (no autograd graph, and no warning from torch).
    """
    x = x.detach()
    if math.isfinite(float(x.sum())):
        return True
    return math.isfinite(float(x.sum(dtype=torch.float64)))


def _lower_triangular_inverse(L: torch.Tensor, leaf: int = 128, out: torch.Tensor | None = None) -> torch.Tensor:
    """``L^-1`` for a lower-triangular ``[n, n]`` ``L``, by 2 x 2 block recursion.

    ``[[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]]``: the work is in
    matrix products, ~2x faster on CPU than a triangular solve against the
    identity for n = 576 ... 1536 (measured: 26 vs 44 ms at n = 1536). Every
    level writes into its block of one output (``out``, zeros above the diagonal;
    made here when ``None``) instead of returning a block to be copied.
    """
    n = L.shape[0]
    if out is None:
        out = torch.zeros_like(L)
    if n <= leaf:
        return out.copy_(torch.linalg.solve_triangular(L, torch.eye(n, dtype=L.dtype, device=L.device), upper=False))
    h = n // 2
    _lower_triangular_inverse(L[:h, :h], leaf, out[:h, :h])
    _lower_triangular_inverse(L[h:, h:], leaf, out[h:, h:])
    torch.mm(out[h:, h:], L[h:, :h] @ out[:h, :h], out=out[h:, :h])
    out[h:, :h].neg_()
    return out


#: The largest ``dampening_frac`` accepted (above ~1e3 the damping outweighs the data; far below float32 overflow).
MAX_DAMPENING_FRAC = 1e6


def check_dampening_frac(value: float, *, positive: bool = False) -> float:
    """``value`` as a float in ``[0, MAX_DAMPENING_FRAC]`` (``> 0`` if ``positive``); ``ValueError`` otherwise."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not (0 < value if positive else 0 <= value) or not value <= MAX_DAMPENING_FRAC:
        raise ValueError(
            f"dampening_frac must be a number in {'(' if positive else '['}0, {MAX_DAMPENING_FRAC:g}], got {value!r} "
            "(relative damping of the Hessian's diagonal: typically 0.01-0.1; above ~1e3 it outweighs the calibration "
            "data)"
        )
    return float(value)


def inverse_hessian_cholesky(
    hessian: torch.Tensor,
    *,
    dampening_frac: float = 0.01,
    max_dampening_retries: int = 3,
    device: torch.device | str | None = None,
    algorithm: str = "OBS",
    modules: str | None = None,
    dampening_used: list[float] | None = None,
) -> InverseHessianFactor:
    """Upper Cholesky factor ``U`` of the damped inverse Hessian, the dead inputs and the damping.

    Dead inputs (``H_jj == 0``: the channel was always zero in the calibration
    data) get ``H_jj := 1`` first (they do not affect the layer-wise error).
    Then ``lambda = dampening_frac * mean(diag H)`` is added to the diagonal and
    ``U`` with ``U^T U = (H + lambda I)^-1`` is computed (GPTQ arXiv 2210.17323,
    Section 4 "Cholesky reformulation"). If the damped matrix is not positive
    definite, ``dampening_frac`` is multiplied by 10 (from 0: set to 1e-4) up to
    ``max_dampening_retries`` times; when a retry succeeds one warning names ``modules``, the configured and the
    used ``dampening_frac``.

    Args:
        hessian: ``[C, C]`` symmetric PSD matrix (not modified; any float dtype).
        dampening_frac: relative damping, finite and ``>= 0``.
        max_dampening_retries: retries with 10x damping; 0 disables retrying.
        device: where to compute (default: ``hessian``'s device).
        algorithm: name used in warnings and errors (``"SparseGPT"``, ``"GPTQ"``).
        modules: the modules whose inputs gave ``hessian`` (e.g. ``model.layers.0.self_attn.{q,k,v}_proj``),
            named in the warning and the error; ``None``: not named.
        dampening_used: when given, the ``dampening_frac`` the factor was computed with (after any retries) is
            appended to it.

    Returns:
        ``(U, dead, damping)`` (:class:`InverseHessianFactor`): ``U`` float32 ``[C, C]`` upper
        triangular; ``dead`` bool ``[C]``; ``damping`` the ``lambda`` used.

    Raises:
        ValueError: ``hessian`` is not square or holds NaN/Inf; bad ``dampening_frac``; ``max_dampening_retries``
            not an int >= 0.
        HessianNotPositiveDefiniteError: still not positive definite after all retries.
    """
    if (
        isinstance(max_dampening_retries, bool)
        or not isinstance(max_dampening_retries, int)
        or max_dampening_retries < 0
    ):
        raise ValueError(f"max_dampening_retries must be an int >= 0, got {max_dampening_retries!r}")
    if not isinstance(hessian, torch.Tensor) or hessian.dim() != 2 or hessian.shape[0] != hessian.shape[1]:
        shape = tuple(hessian.shape) if isinstance(hessian, torch.Tensor) else type(hessian)
        raise ValueError(f"hessian must be a square [C, C] tensor, got {shape}")
    check_dampening_frac(dampening_frac)
    H = hessian.detach().to(device=device or hessian.device, dtype=torch.float32)  # read only, unless dead inputs
    if not all_finite(H):
        raise ValueError("hessian contains NaN or Inf values")
    dead = torch.diagonal(H) == 0
    if bool(dead.any()):
        idx = dead.nonzero().squeeze(1)
        H = H.clone()
        H[idx, idx] = 1.0
    mean_diag = float(torch.diagonal(H).mean())
    if mean_diag <= 0.0:
        mean_diag = 1.0
    frac = float(dampening_frac)
    where = f"{algorithm}: {modules}:" if modules else f"{algorithm}:"
    for attempt in range(max_dampening_retries + 1):
        # With J the index reversal: J H J = L L^T  =>  H = V V^T with V = J L J
        # upper triangular, so U = V^-1 = J L^-1 J is upper with U^T U = H^-1:
        # one Cholesky and one triangular inverse instead of Cholesky + inverse + Cholesky.
        damped = H.flip(0, 1)  # a copy
        damped.diagonal().add_(frac * mean_diag)
        chol, info = torch.linalg.cholesky_ex(damped)
        del damped
        if int(info) == 0:
            inv_chol = _lower_triangular_inverse(chol)
            del chol
            if all_finite(inv_chol):
                if attempt:
                    logger.warning(
                        "%s Hessian not positive definite with dampening_frac=%g; compressed with dampening_frac=%g "
                        "(%d %s)",
                        where,
                        dampening_frac,
                        frac,
                        attempt,
                        "retry" if attempt == 1 else "retries",
                    )
                if dampening_used is not None:
                    dampening_used.append(frac)
                return InverseHessianFactor(inv_chol.flip(0, 1), dead, frac * mean_diag)
            del inv_chol
        if attempt < max_dampening_retries:
            frac = frac * 10.0 if frac > 0 else 1e-4
    retries = f"{max_dampening_retries} {'retry' if max_dampening_retries == 1 else 'retries'}"
    raise HessianNotPositiveDefiniteError(
        f"{where} the Hessian is not positive definite even with dampening_frac={frac:g} "
        f"(started at {dampening_frac:g}, {retries}). Use a larger dampening_frac or more / more diverse calibration "
        "samples."
    )


class ColumnRule(Protocol):
    """What each column becomes in :func:`obs_sweep` (SparseGPT: pruned, GPTQ: quantized).

    Attributes:
        sub_block: columns per inner sub-block; the sweep guarantees that every
            sub-block starts at a multiple of it within each block, so a rule whose
            groups must not straddle sub-blocks (N:M) or must start with every
            earlier column's update applied (GPTQ groups) sets it to a multiple /
            to the group size.
    """

    sub_block: int

    def begin_block(self, c0: int, c1: int, W1: torch.Tensor, d1: torch.Tensor) -> None:
        """A block ``[c0, c1)`` starts; ``W1`` is its ``[c1 - c0, rows]`` slice, ``d1`` its ``U_jj``."""

    def column(self, j: int, W1: torch.Tensor, i: int, out: torch.Tensor) -> torch.Tensor:
        """Write into ``out`` (and return it) the final value of column ``j = c0 + i`` (row ``i`` of ``W1``)."""


class MaskRule(Protocol):
    """A :class:`ColumnRule` whose columns are masked (SparseGPT): column ``j`` ends as ``w_j * keep_j``.

    ``keep_j`` is fixed by the time column ``j`` is reached, so its error is
    ``e_j = w_j * (1 - keep_j) / U_jj`` (one product per column): :func:`obs_sweep` then skips
    :meth:`ColumnRule.column` and masks each block once at its end. Set ``masked = True``.
    """

    sub_block: int
    masked: bool

    def begin_block(self, c0: int, c1: int, W1: torch.Tensor, d1: torch.Tensor) -> None:
        """As :meth:`ColumnRule.begin_block`."""

    def error_factor(self, j: int, W1: torch.Tensor, i: int) -> torch.Tensor:
        """float32 ``[rows]``: ``(1 - keep_j) / U_jj`` for column ``j = c0 + i`` (row ``i`` of ``W1``)."""

    def block_keep(self) -> torch.Tensor:
        """bool ``[c1 - c0, rows]``: the block's mask, complete once its last column's factor was given."""


@torch.no_grad()
def obs_sweep(WT: torch.Tensor, U: torch.Tensor, rule: ColumnRule | MaskRule, *, block_size: int = 128) -> torch.Tensor:
    """Sweep the columns of ``WT`` left to right, in place: OBS error compensation with lazy batch updates.

    For each column ``j`` the rule gives its final value ``q_j``; the error
    ``e_j = (w_j - q_j) / U_jj`` is propagated to the later columns of the
    sub-block at once (``w_k -= U_jk e_j``), to the rest of the block after each
    sub-block, and to all later columns after each block in one matrix product
    (GPTQ Alg. 1 "lazy batch updates"; SparseGPT Alg. 1). Every column ends as
    its ``q_j``.

    Args:
        WT: float32 ``[in_features, rows]``: the transposed weight(s); several
            weights sharing one Hessian may sit side by side (rows concatenated).
        U: float32 ``[in_features, in_features]`` upper Cholesky factor of the
            damped inverse Hessian (:func:`inverse_hessian_cholesky`).
        rule: a :class:`ColumnRule`, or a :class:`MaskRule` (``masked`` true): the same
            sweep with each column's error one product (bitwise the same values as the
            column rule ``w_j * keep_j``, up to the sign of zeros).
        block_size: columns per lazy-update block, > 0.

    Returns:
        float32 ``[rows]``: per row, ``sum_j e_j^2``. Each ``e_j^2`` is the increase of
        that row's error ``(w - w_hat) (H' + lambda I) (w - w_hat)^T`` when column ``j``
        is fixed (the OBS step is exact), so the sum is the row's final error in the
        damped metric (:func:`llmc_fsm.toolkit.layer_error.sweep_relative_errors`).

    Raises:
        ValueError: shapes that do not fit, ``U`` not upper triangular (checked on its first column and last row), or
            a bad ``block_size``.
    """
    cols, rows = WT.shape
    if U.shape != (cols, cols):
        raise ValueError(f"U must have shape ({cols}, {cols}), got {tuple(U.shape)}")
    if cols > 1 and (bool(U[1:, 0].any()) or bool(U[-1, :-1].any())):  # O(cols): the first column, the last row
        msg = (
            "U must be upper triangular (inverse_hessian_cholesky's U); its first column or last row has entries "
            "below the diagonal: a lower factor (torch.linalg.cholesky's default) gives other weights, silently"
        )
        raise ValueError(msg)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    u_diag = torch.diagonal(U)
    sub = max(1, int(rule.sub_block))
    loss = torch.zeros(rows, dtype=torch.float32, device=WT.device)
    masked = bool(getattr(rule, "masked", False))
    column, subtract, multiply = rule.column if not masked else None, torch.sub, torch.mul  # type: ignore[union-attr]
    factor = rule.error_factor if masked else None  # type: ignore[union-attr]
    for c0 in range(0, cols, block_size):
        c1 = min(c0 + block_size, cols)
        width = c1 - c0
        W1 = WT[c0:c1]  # view: updated in place
        d1 = u_diag[c0:c1]
        Hinv1 = U[c0:c1, c0:c1]
        Err1 = torch.empty((width, rows), dtype=torch.float32, device=WT.device)
        rule.begin_block(c0, c1, W1, d1)
        # Row views made once per block: each costs a dispatch when taken per column.
        w_rows, err_rows, hinv_rows = W1.unbind(0), Err1.unbind(0), Hinv1.unbind(0)
        if not masked:
            Q1 = torch.empty((width, rows), dtype=torch.float32, device=WT.device)
            q_rows, inv_d = Q1.unbind(0), d1.reciprocal().tolist()
        for s0 in range(0, width, sub):
            s1 = min(s0 + sub, width)
            for i in range(s0, s1):
                if masked:  # e_j = w_j (1 - keep_j) / U_jj: one product
                    err = multiply(w_rows[i], factor(c0 + i, W1, i), out=err_rows[i])  # type: ignore[misc]
                else:
                    q = column(c0 + i, W1, i, q_rows[i])  # type: ignore[misc]
                    err = subtract(w_rows[i], q, out=err_rows[i]).mul_(inv_d[i])
                if i + 1 < s1:
                    W1[i + 1 : s1].addr_(hinv_rows[i][i + 1 : s1], err, alpha=-1.0)
            if s1 < width:
                W1[s1:].addmm_(Hinv1[s0:s1, s1:].T, Err1[s0:s1], alpha=-1.0)
        if masked:  # each row of W1 holds its column's value when it was reached: masked, its final value
            W1.mul_(rule.block_keep())  # type: ignore[union-attr]
        else:
            W1.copy_(Q1)
        loss.add_(Err1.square().sum(0))
        if c1 < cols:
            WT[c1:].addmm_(U[c0:c1, c1:].T, Err1, alpha=-1.0)
    return loss
