"""SparseGPT: one-shot pruning with OBS weight reconstruction (Frantar & Alistarh, arXiv 2301.00774).

:func:`sparsegpt_prune` / :func:`sparsegpt_prune_shared` are the algorithm
(Alg. 1: per-block adaptive mask, column-by-column OBS update, lazy batch
updates) as a :class:`~llmc_fsm.toolkit.obs.ColumnRule` on the shared sweep
:func:`llmc_fsm.toolkit.obs.obs_sweep`; :class:`SparseGPTModifier` is the recipe modifier.

Mask selection (:func:`sparsegpt_prune`):

* unstructured: at the start of each block ``[c0, c1)`` the block prunes
  exactly ``num_to_prune(c1 * out, s) - num_to_prune(c0 * out, s)`` of its
  lowest-saliency weights, selected over the whole block (all rows), as in
  Algorithm 1 — rows may differ, which lets the mask follow the Hessian.
  So **the layer has exactly** ``num_to_prune(numel, s)`` **zeros** (the
  same count rule as :func:`magnitude_mask`). An earlier per-row selection
  (exact zeros per row) measured worse: SmolLM2-135M at 50%, perplexity
  80.0 vs 78.1 with this rule (32 x 256 calibration tokens).
* N:M: when the sweep reaches a group of ``M`` columns, each row keeps the
  ``N`` highest-saliency weights of the group (``block_size`` must be a
  multiple of ``M``). Every group has exactly ``M - N`` zeros.

Existing zeros (``preserve_sparsity_mask``, llm-compressor's argument of the same
name, for pruning an already sparse model further): every weight that is zero
before the sweep is in the mask from the start — it is pruned whatever its
saliency, counts toward the target, and is never un-pruned. Like any pruned
weight it is set to zero when the sweep reaches its column and the error of
that is compensated on the later columns (the OBS step of the paper; it may
have received compensation from earlier columns). Without the flag the mask is
chosen afresh: an existing zero is a weight of saliency 0 that the OBS updates
may make non-zero and the selection may keep.

* unstructured: block ``[c0, c1)`` prunes its existing zeros plus the
  lowest-saliency other weights up to the cumulative count
  ``num_to_prune(c1 * out, s)`` — never fewer than its existing zeros, never so
  many that the later blocks' existing zeros would exceed the layer's
  ``num_to_prune(numel, s)``. So the layer again has **exactly**
  ``num_to_prune(numel, s)`` zeros; a weight with more existing zeros than that
  is refused (``ValueError``, as llm-compressor refuses it).
* N:M: a row's group of ``M`` columns prunes its existing zeros first and then
  the lowest-saliency other weights up to ``M - N``: it ends with
  ``max(M - N, existing zeros)`` zeros (a group that already had more than
  ``M - N`` keeps them all, so it is sparser than N:M asks).

Dead inputs (``H_jj == 0``, i.e. the channel was always zero in the
calibration data) get ``H_jj := 1``; they do not affect the layer-wise
error, so they are given the lowest saliency and pruned first. Unlike the
reference code, which zeroes dead columns unconditionally, dead weights
that the count rule keeps keep their original value (they are untouched by
the OBS updates because their Hessian rows are zero), so the returned
weight is zero exactly where the mask is False (plus original zeros).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from llmc_fsm.toolkit import (
    SUB_BLOCK,
    CompressedGroup,
    HessianAccumulator,
    InverseHessianFactor,
    check_dampening_frac,
    compact_names,
    inverse_hessian_cholesky,
    obs_sweep,
    sweep_relative_errors,
)
from llmc_fsm_pruning._calibrated import CalibratedPruningModifier
from llmc_fsm_pruning.masks import (
    MaskStructure,
    check_nm_divisible,
    check_sparsity,
    check_weight,
    nm_keep,
    num_to_prune,
    parse_mask_structure,
    resolve_structure,
)

__all__ = ["SparseGPTModifier", "sparsegpt_prune", "sparsegpt_prune_shared"]


@torch.no_grad()
def sparsegpt_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    *,
    sparsity: float,
    mask_structure: MaskStructure = None,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    max_dampening_retries: int = 3,
    preserve_sparsity_mask: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT one-shot pruning with OBS weight reconstruction.

    Implements Algorithm 1 of SparseGPT (arXiv:2301.00774): columns are
    processed left to right in blocks of ``block_size``; a block's mask is
    chosen adaptively from the current (already updated) weights using the
    OBS saliency ``w_j^2 / U_jj^2`` (Algorithm 1's ``w_c^2 / [H^-1]_cc^2``
    after it replaces ``H^-1`` by its upper Cholesky factor ``U``; ``U_jj^2``
    is the inverse-Hessian diagonal entry of column ``j`` given that columns
    ``< j`` are already fixed). Every pruned weight's error is compensated on
    the not-yet-processed columns of the block, and the
    accumulated block error is applied lazily to all later columns in one
    matrix product. All math is float32 on ``weight``'s device.

    Mask selection and dead inputs: see the module docstring.

    Args:
        weight: ``[out_features, in_features]`` floating tensor (not modified).
        hessian: ``[in_features, in_features]`` symmetric PSD matrix, e.g.
            :attr:`HessianAccumulator.hessian` (not modified; any float dtype;
            moved to ``weight``'s device).
        sparsity: fraction of zeros in ``[0, 1)``; ignored (only range-checked)
            for N:M. ``0`` with unstructured returns an unchanged copy of
            ``weight`` and an all-True mask without touching ``hessian``.
        mask_structure: ``None``/``"unstructured"`` or ``"N:M"`` (N kept of M).
        block_size: columns per block (lazy-update and mask-selection block),
            > 0.
        dampening_frac: ``lambda = dampening_frac * mean(diag H)`` is added to
            the diagonal before inversion (the mean is taken after dead inputs'
            ``H_jj`` is set to 1, as in the reference code); >= 0.
        max_dampening_retries: if the damped ``H`` is not positive definite,
            retry this many times, each time multiplying ``dampening_frac`` by
            10 (one warning when a retry succeeds). 0 disables retrying.
        preserve_sparsity_mask: keep every zero of ``weight`` pruned and count
            it toward ``sparsity`` (see the module docstring); default ``False``
            (the mask is chosen afresh).

    Returns:
        ``(pruned_weight, keep_mask)``: ``pruned_weight`` has ``weight``'s
        shape, dtype and device; ``keep_mask`` is ``torch.bool``, True = keep.

    Raises:
        ValueError: bad arguments/shapes, non-finite ``hessian``, ``in_features``
            or ``block_size`` not divisible by ``M`` for N:M; with
            ``preserve_sparsity_mask`` and unstructured sparsity, a weight that
            already has more zeros than ``num_to_prune(numel, sparsity)``.
        HessianNotPositiveDefiniteError (a ``ValueError``): the damped Hessian
            cannot be Cholesky-factorised after all retries.
    """
    ((pruned, keep),) = sparsegpt_prune_shared(
        [weight],
        hessian,
        sparsity=sparsity,
        mask_structure=mask_structure,
        block_size=block_size,
        dampening_frac=dampening_frac,
        max_dampening_retries=max_dampening_retries,
        preserve_sparsity_mask=preserve_sparsity_mask,
    )
    return pruned, keep


@torch.no_grad()
def sparsegpt_prune_shared(
    weights: Sequence[torch.Tensor],
    hessian: torch.Tensor,
    *,
    sparsity: float,
    mask_structure: MaskStructure = None,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    max_dampening_retries: int = 3,
    errors: list[float] | None = None,
    preserve_sparsity_mask: bool = False,
    modules: str | None = None,
    dampening_used: list[float] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`sparsegpt_prune` for several weights that see the same inputs (one Hessian).

    For example the ``q/k/v`` projections of an attention block, or
    ``gate/up`` of a gated MLP. The damped inverse Hessian is factorised once
    and the column sweep runs once over the weights' stacked rows; each
    weight's mask is still selected over its own rows only (the block's prune
    count is each weight's own), so every result equals pruning that weight
    alone with :func:`sparsegpt_prune` up to float rounding.

    Args:
        weights: ``[out_i, in_features]`` floating tensors on one device
            (not modified), all with the same ``in_features``.
        hessian, sparsity, mask_structure, block_size, dampening_frac,
            max_dampening_retries, preserve_sparsity_mask: as for :func:`sparsegpt_prune`
            (each weight's existing zeros and counts are its own).
        errors: if a list, each weight's relative output error ``||W X - W_hat X|| / ||W X||``
            on the Hessian's inputs is appended to it, from the sweep's own terms
            (:func:`llmc_fsm.toolkit.layer_error.sweep_relative_errors`; 0.0 when nothing is pruned).
        modules: the names of the weights' modules, named in the warning when the damped Hessian needed retries
            (e.g. ``model.layers.0.self_attn.{q,k,v}_proj``).
        dampening_used: if a list, the ``dampening_frac`` the Hessian was factorised with (larger than
            ``dampening_frac`` after retries; ``dampening_frac`` when nothing is pruned) is appended to it.

    Returns:
        ``[(pruned_weight, keep_mask), ...]`` in the order of ``weights``.

    Raises:
        ValueError: as :func:`sparsegpt_prune`, or no weights / different
            ``in_features`` or devices.
        HessianNotPositiveDefiniteError: as :func:`sparsegpt_prune`.
    """
    weights = list(weights)
    s, nm = _check_inputs(weights, hessian, sparsity, mask_structure, block_size)
    fixed = _existing_zeros(weights, s, nm) if _check_flag(preserve_sparsity_mask) else None
    if nm is None and s == 0.0:
        check_dampening_frac(dampening_frac)
        if errors is not None:
            errors += [0.0] * len(weights)
        if dampening_used is not None:
            dampening_used.append(float(dampening_frac))
        return [(w.detach().clone(), torch.ones_like(w, dtype=torch.bool)) for w in weights]
    device = weights[0].device

    U, dead, damping = inverse_hessian_cholesky(
        hessian,
        dampening_frac=dampening_frac,
        max_dampening_retries=max_dampening_retries,
        device=device,
        algorithm="SparseGPT",
        modules=modules,
        dampening_used=dampening_used,
    )
    # Work on the transpose ([in, out]: column j of W = contiguous row j of WT); the
    # weights' rows sit side by side, segment (r0, r1) of WT's columns is one weight.
    WT = torch.cat([w.detach().to(torch.float32).T for w in weights], dim=1)
    bounds = []
    for w in weights:
        r0 = bounds[-1][1] if bounds else 0
        bounds.append((r0, r0 + w.shape[0]))
    rule = _PruneRule(sparsity=s, nm=nm, bounds=bounds, dead=dead, rows=WT.shape[1], fixed=fixed)
    original = WT.clone() if errors is not None else None
    row_errors = obs_sweep(WT, U, rule, block_size=block_size)
    if errors is not None:
        factor = InverseHessianFactor(U, dead, damping)
        errors += sweep_relative_errors(
            original, WT, factor, row_errors, [w.shape[0] for w in weights], hessian.to(device)
        )
    return [
        (WT[:, r0:r1].T.contiguous().to(w.dtype), rule.keepT[:, r0:r1].T.contiguous())
        for w, (r0, r1) in zip(weights, bounds, strict=True)
    ]


def _check_flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"preserve_sparsity_mask must be true or false, got {value!r}")
    return value


def _existing_zeros(weights: list[torch.Tensor], sparsity: float, nm: tuple[int, int] | None) -> torch.Tensor | None:
    """``[in, sum(out_i)]`` bool: the weights' zeros, transposed and side by side (``None`` when there are none).

    Raises:
        ValueError: unstructured, and a weight has more zeros than ``num_to_prune(numel, sparsity)``.
    """
    zeros = [w.detach() == 0 for w in weights]
    if nm is None:
        for i, (w, z) in enumerate(zip(weights, zeros, strict=True)):
            count, target = int(z.sum()), num_to_prune(w.numel(), sparsity)
            if count > target:
                which = f"weight {i} " if len(weights) > 1 else "the weight "
                raise ValueError(
                    f"preserve_sparsity_mask: {which}{list(w.shape)} already has {count} zeros, more than the "
                    f"{target} that sparsity {sparsity} prunes, and every existing zero stays pruned; give a higher "
                    f"sparsity (the weight's is {count / w.numel():.4g}) or preserve_sparsity_mask: false (the mask "
                    "is then chosen afresh)"
                )
    if not any(bool(z.any()) for z in zeros):
        return None
    return torch.cat([z.T for z in zeros], dim=1)


def _check_inputs(
    weights: list[torch.Tensor], hessian: Any, sparsity: float, mask_structure: MaskStructure, block_size: Any
) -> tuple[float, tuple[int, int] | None]:
    """Validate :func:`sparsegpt_prune_shared`'s arguments; return ``(sparsity, (N, M) or None)``."""
    if not weights:
        raise ValueError("weights must hold at least one 2-D weight")
    for w in weights:
        check_weight(w)
    s = check_sparsity(sparsity)
    nm = resolve_structure(mask_structure)
    cols = weights[0].shape[1]
    device = weights[0].device
    if any(w.shape[1] != cols or w.device != device for w in weights):
        shapes = [(tuple(w.shape), str(w.device)) for w in weights]
        raise ValueError(f"weights sharing a Hessian need the same in_features and device, got {shapes}")
    if not isinstance(hessian, torch.Tensor) or hessian.shape != (cols, cols):
        shape = tuple(hessian.shape) if isinstance(hessian, torch.Tensor) else type(hessian)
        raise ValueError(f"hessian must have shape ({cols}, {cols}) for this weight, got {shape}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if nm is not None:
        check_nm_divisible(cols, nm)
        if block_size % nm[1] != 0:
            raise ValueError(
                f"block_size must be a multiple of M={nm[1]} for {nm[0]}:{nm[1]} sparsity, got block_size={block_size}"
            )
    return s, nm


class _PruneRule:
    """SparseGPT's column rule: a column keeps the weights its mask keeps and zeroes the others.

    Mask selection (saliency ``w_j^2 / U_jj^2``; dead inputs get -1, pruned first;
    preserved existing zeros (``fixed``) -inf, always pruned): unstructured, at each
    block start over the whole block and each weight's own rows; N:M, at each group
    of ``M`` columns, per row. A :class:`llmc_fsm.toolkit.obs.MaskRule`: each column's
    error is ``w_j * (1 - keep_j) / U_jj``.
    """

    masked = True

    def __init__(
        self,
        *,
        sparsity: float,
        nm: tuple[int, int] | None,
        bounds: list[tuple[int, int]],
        dead: torch.Tensor,
        rows: int,
        fixed: torch.Tensor | None = None,
    ) -> None:
        self.sparsity = sparsity
        self.nm = nm
        self.bounds = bounds
        self.dead = dead
        self.fixed = fixed  # [in, rows] bool: existing zeros kept pruned (preserve_sparsity_mask), or None
        cols = dead.shape[0]
        # Unstructured with existing zeros: per weight, existing zeros in columns < c (index c) and weights pruned.
        self._fixed_cum: list[list[int]] = []
        self._pruned = [0] * len(bounds)
        if fixed is not None and nm is None:
            for r0, r1 in bounds:
                per_column = fixed[:, r0:r1].sum(dim=1).cpu()
                self._fixed_cum.append([0, *per_column.cumsum(0).tolist()])
        self._total = [num_to_prune(cols * (r1 - r0), sparsity) for r0, r1 in bounds]
        self.keepT = torch.ones((dead.shape[0], rows), dtype=torch.bool, device=dead.device)
        # A sub-block is a multiple of M for N:M, so a group never straddles two sub-blocks.
        self.sub_block = SUB_BLOCK if nm is None else nm[1] * max(1, SUB_BLOCK // nm[1])
        self._c0 = 0
        self._d1: torch.Tensor | None = None
        self._keep1 = self.keepT[0:0]

    def begin_block(self, c0: int, c1: int, W1: torch.Tensor, d1: torch.Tensor) -> None:
        self._c0 = c0
        self._d1 = d1.unsqueeze(1)
        self._inv_d1 = d1.reciprocal().unsqueeze(1)
        self._keep1 = self.keepT[c0:c1]
        self._factor1 = torch.empty(W1.shape, dtype=torch.float32, device=W1.device)
        self._factor_rows = self._factor1.unbind(0)
        if self.nm is not None:
            return
        score = (W1.square() / self._d1.square()).masked_fill_(self.dead[c0:c1].unsqueeze(1), -1.0)
        width = c1 - c0
        for index, (r0, r1) in enumerate(self.bounds):
            n = r1 - r0
            if self.fixed is None:
                k_block = num_to_prune(c1 * n, self.sparsity) - num_to_prune(c0 * n, self.sparsity)
            else:
                k_block = self._preserving_count(index, c0, c1)
            if not k_block:
                continue
            seg = torch.ones((width, n), dtype=torch.bool, device=W1.device)
            flat = score[:, r0:r1].reshape(-1)
            if self.fixed is not None:
                flat = flat.masked_fill(self.fixed[c0:c1, r0:r1].reshape(-1), float("-inf"))
            seg.view(-1)[torch.topk(flat, k_block, largest=False, sorted=False).indices] = False
            self._keep1[:, r0:r1] = seg
        torch.logical_not(self._keep1, out=self._factor1).mul_(self._inv_d1)  # (1 - keep) / U_jj

    def _preserving_count(self, index: int, c0: int, c1: int) -> int:
        """Weights block ``[c0, c1)`` prunes in weight ``index`` when its existing zeros stay pruned: the
        cumulative count ``num_to_prune(c1 * out)`` less those pruned so far, at least the block's existing zeros
        and at most what leaves room for the later blocks' (see the module docstring)."""
        cum = self._fixed_cum[index]
        in_block, after = cum[c1] - cum[c0], cum[-1] - cum[c1]
        done = self._pruned[index]
        n = self.bounds[index][1] - self.bounds[index][0]
        k = min(max(num_to_prune(c1 * n, self.sparsity) - done, in_block), self._total[index] - done - after)
        self._pruned[index] = done + k
        return k

    def error_factor(self, j: int, W1: torch.Tensor, i: int) -> torch.Tensor:
        if self.nm is not None and i % self.nm[1] == 0:  # the group's mask, from its columns as they are now
            grp = slice(i, i + self.nm[1])
            d = self._d1[grp]  # type: ignore[index]
            score = (W1[grp].square() / d.square()).masked_fill_(self.dead[j : j + self.nm[1]].unsqueeze(1), -1.0)
            if self.fixed is None:
                self._keep1[grp] = nm_keep(score.T, self.nm).T
            else:  # existing zeros first (all of them, even more than M - N), then the lowest saliencies
                fixed = self.fixed[j : j + self.nm[1]]
                self._keep1[grp] = nm_keep(score.masked_fill_(fixed, float("-inf")).T, self.nm).T & ~fixed
            torch.logical_not(self._keep1[grp], out=self._factor1[grp]).mul_(self._inv_d1[grp])
        return self._factor_rows[i]

    def block_keep(self) -> torch.Tensor:
        return self._keep1


def _positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        msg = f"{attribute.name} must be a positive int, got {value!r}"
        raise ValueError(msg)


def _dampening(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_dampening_frac(value)


def _flag(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        msg = f"{attribute.name} must be true or false, got {value!r}"
        raise ValueError(msg)


@attrs.define(kw_only=True, slots=False, eq=False)
class SparseGPTModifier(CalibratedPruningModifier):
    """Prune Linear weights one-shot with SparseGPT: Hessian from calibration inputs, block-wise OBS updates.

    For each target, ``H = 2/n * sum x x^T`` is accumulated from its calibration
    inputs; the damped inverse Hessian drives a left-to-right sweep over the
    columns in blocks of ``block_size``, choosing the mask adaptively per block
    and compensating every pruned weight on the columns not yet processed.

    Args (besides ``sparsity``, ``mask_structure``, ``targets``, ``ignore``):
        block_size: columns per block of the sweep (default 128, as in the paper);
            must be a multiple of M for N:M structures.
        dampening_frac: ``dampening_frac * mean(diag H)`` is added to the diagonal
            of ``H`` before inversion (default 0.01, as in the paper); in ``[0, 1e6]`` (``0``: no damping; a
            Hessian that is then not positive definite is retried with 1e-4, then 10x, as GPTQ's is —
            llm-compressor accepts 0 too; until session 38 it was refused here).
        preserve_sparsity_mask: ``True`` keeps every weight that is already zero
            pruned and counts it toward ``sparsity`` (llm-compressor's argument,
            for pruning a sparse model further, e.g. a 2:4 model to 75%); default
            ``False``: the mask is chosen afresh. See the module docstring.

    Requires state ``model`` and ``calibration_data``. Memory: one
    ``in_features x in_features`` float32 Hessian per distinct target input,
    only for the decoder layer being calibrated under the sequential pipeline.

    Raises:
        ValueError: a bad argument, or a ``block_size`` that is not a multiple of M for N:M; at
            :meth:`check_model`, with ``preserve_sparsity_mask`` and unstructured sparsity, targets that already
            have more zeros than ``sparsity`` prunes (all of them named, before any calibration).
    """

    block_size: int = attrs.field(default=128, validator=_positive_int)
    dampening_frac: float = attrs.field(default=0.01, validator=_dampening)
    preserve_sparsity_mask: bool = attrs.field(default=False, validator=_flag)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        nm = parse_mask_structure(self.mask_structure)
        if nm is not None and self.block_size % nm[1] != 0:
            msg = (
                f"block_size ({self.block_size}) must be a multiple of M={nm[1]} "
                f"for mask_structure {self.mask_structure!r}"
            )
            raise ValueError(msg)

    def _new_accumulator(self, module: nn.Module) -> HessianAccumulator:
        return HessianAccumulator(module.weight.shape[1])

    def _check_target(self, name: str, module: nn.Module) -> str | None:
        """The base class's check; with ``preserve_sparsity_mask`` and unstructured sparsity also that the weight
        has no more zeros than ``sparsity`` prunes (a weight on the ``meta`` device, streamed by ``low_memory``,
        is checked when its layer is compressed: :func:`sparsegpt_prune_shared` refuses it then)."""
        problem = super()._check_target(name, module)
        if problem is not None or not self.preserve_sparsity_mask or parse_mask_structure(self.mask_structure):
            return problem
        weight = module.weight
        if weight.is_meta or int((weight == 0).sum()) <= num_to_prune(weight.numel(), float(self.sparsity)):
            return None
        return (
            f"already more zeros than sparsity {self.sparsity} prunes, and preserve_sparsity_mask keeps every "
            "existing zero pruned (give a higher sparsity, or preserve_sparsity_mask: false to choose the mask "
            "afresh)"
        )

    measures_output_error = True  # from the sweep (llmc_fsm.toolkit.layer_error.sweep_relative_errors)

    def _clear(self) -> None:
        super()._clear()
        #: module name -> the ``dampening_frac`` its Hessian was factorised with, for the modules whose damped
        #: Hessian was not positive definite with the configured ``dampening_frac`` (retried with 10x damping; a
        #: warning names them). Empty: every module used the configured value.
        self.dampening_results: dict[str, float] = {}

    def _compress_group(self, modules: list[nn.Module], accumulator: HessianAccumulator) -> CompressedGroup:
        # Targets that saw the same inputs (q/k/v, gate/up) share one Hessian factorisation and one sweep.
        errors: list[float] = []
        used: list[float] = []
        names = [self._names_by_id.get(id(module), "") for module in modules]
        results = sparsegpt_prune_shared(
            [module.weight for module in modules],
            accumulator.hessian,
            sparsity=float(self.sparsity),
            mask_structure=self.mask_structure,
            block_size=self.block_size,
            dampening_frac=float(self.dampening_frac),
            errors=errors,
            preserve_sparsity_mask=self.preserve_sparsity_mask,
            modules=compact_names(names),
            dampening_used=used,
        )
        if used[0] != float(self.dampening_frac):
            self.dampening_results.update(dict.fromkeys(names, used[0]))
        return CompressedGroup([pruned for pruned, _keep in results], errors)
