"""GPTQ: one-shot weight quantization with OBS error compensation (Frantar et al., arXiv 2210.17323).

:func:`gptq_quantize` is Alg. 1 of the paper — columns quantized left to right
(optionally in activation order), each column's rounding error compensated on
the columns not yet quantized through the Cholesky factor of the damped inverse
Hessian, with lazy batch updates — as a column rule on the sweep the core shares
with SparseGPT (:func:`llmc_fsm.toolkit.obs.obs_sweep`). :class:`GPTQModifier` is the
recipe modifier.

Scales and zero points of :func:`gptq_quantize` (``observer`` over the group's values):

* tensor / channel strategy: from the original weight, before the sweep;
* group strategy, ``actorder`` ``None`` or ``"static"``: from the original weight's groups, before the sweep
  (llm-compressor 0.14 observes the whole weight before its loop; with ``"static"`` the columns are then swept in
  activation order). Until session 31 ``None`` took them as the paper's reference code does, from the current
  (already compensated) weights when the sweep reached the group's first column: a recipe with ``actorder: null``
  gave other scales than llm-compressor's (found by a tester: 25% of q_proj's groups equal);
* group strategy, ``actorder="group"``: from the current weights when the sweep reaches the group's first column
  (groups are formed in activation order, so no group exists before the sweep).

``actorder`` (activation order, descending ``diag H``; columns of equal ``H_jj`` in the order of
``torch.argsort``'s default, non-stable sort, as llm-compressor 0.14 orders them): ``"static"`` sweeps
in that order but keeps groups contiguous in the original order (each column
keeps the group, scale and zero point of its original position: no
``g_idx``); ``"group"`` forms groups in that order and returns ``g_idx``
(original column -> group). Dead inputs (``H_jj = 0``) are quantized like
the others; they receive no compensation (the reference code zeroes them).

:class:`GPTQModifier` refuses ``actorder: group`` (measured in
``tests/test_actorder_group.py``): compressed-tensors 0.20 removed it — its
``QuantizationArgs`` raises ``actorder='group' has been removed``, it registers no
``weight_g_idx`` even when the value is forced in, and a ``config.json`` naming it
does not load in transformers 5.24 — while a ``weight_g_idx`` tensor in the
checkpoint is an unexpected key that transformers drops (the reloaded model
ignores the grouping). llm-compressor 0.14 accepts the value in a recipe but its
GPTQ then stops (``Invalid activation ordering ActivationOrdering.GROUP. Only
'weight' and 'static' are supported for GPTQ.``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from compressed_tensors.quantization.utils import calculate_range
from torch import nn

from llmc_fsm.toolkit import (
    SUB_BLOCK,
    HessianAccumulator,
    check_dampening_frac,
    compact_names,
    inverse_hessian_cholesky,
    obs_sweep,
    sweep_relative_errors,
)
from llmc_fsm_quantization._base import QuantizedWeight, QuantizingModifier, actorder_value
from llmc_fsm_quantization.observers import (
    IMPORTANCE_OBSERVERS,
    as_row_args,
    importance_from_hessian,
    is_scaled_format,
    observe,
    observe_scaled_format,
    qparam_dtype,
    quantize_rows,
    row_qparams,
    storable,
)
from llmc_fsm_quantization.rtn import QuantizationModifier, rtn_quantize

__all__ = ["ACTORDERS", "GPTQModifier", "gptq_quantize"]

logger = logging.getLogger(__name__)

#: Values of ``actorder``: ``None`` (natural column order), ``"static"``, ``"group"``.
ACTORDERS = (None, "static", "group")


def _check_args(cols: int, args: QuantizationArgs, block_size: int, actorder: str | None) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if actorder not in ACTORDERS:
        raise ValueError(f"actorder must be one of static, group or null, got {actorder!r}")
    if args.strategy == QuantizationStrategy.GROUP:
        gs = args.group_size
        if cols % gs:
            raise ValueError(f"in_features {cols} is not a multiple of group_size {gs}")
        if block_size % gs and gs % block_size:
            raise ValueError(f"block_size ({block_size}) and group_size ({gs}) must divide one another")


def _check_inputs(
    weights: list[torch.Tensor], hessian: torch.Tensor, args: QuantizationArgs, block_size: int, actorder: str | None
) -> None:
    if not weights or any(not isinstance(w, torch.Tensor) or w.dim() != 2 for w in weights):
        raise ValueError("weights must be a non-empty list of 2-D [out, in] tensors")
    cols = weights[0].shape[1]
    if any(w.shape[1] != cols for w in weights):
        raise ValueError(
            f"weights sharing a Hessian need the same in_features, got {[tuple(w.shape) for w in weights]}"
        )
    if hessian.shape != (cols, cols):
        raise ValueError(f"hessian must have shape ({cols}, {cols}), got {tuple(hessian.shape)}")
    _check_args(cols, args, block_size, actorder)


@torch.no_grad()
def gptq_quantize(
    weights: Sequence[torch.Tensor],
    hessian: torch.Tensor,
    *,
    args: QuantizationArgs,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    actorder: str | None = "static",
    observer: str = "minmax",
    max_dampening_retries: int = 3,
    global_scales: Sequence[torch.Tensor | None] | None = None,
    modules: str | None = None,
) -> list[QuantizedWeight]:
    """Quantize weights that see the same inputs (one Hessian) with GPTQ.

    Columns are processed in blocks of ``block_size`` (lazy batch updates); for
    each column ``j`` the quantized value ``q_j`` replaces ``w_j`` and the error
    ``(w_j - q_j) / U_jj`` is subtracted from the later columns through row ``j``
    of ``U``, the upper Cholesky factor of ``(H + lambda I)^-1``,
    ``lambda = dampening_frac * mean(diag H)`` (Alg. 1). Zeros of the input
    weights stay exactly zero (a pruned — e.g. 2:4 — weight keeps its pattern):
    their quantized value is 0 and the error of forcing them there is
    compensated like any other.

    Scales, zero points, ``actorder`` and dead inputs: see the module docstring.

    Args:
        weights: ``[out_i, in_features]`` float tensors on one device (not modified).
        hessian: ``[in_features, in_features]``, e.g. :attr:`llmc_fsm.toolkit.obs.HessianAccumulator.hessian`.
        args: the weight ``QuantizationArgs`` (strategy tensor, channel or group).
        block_size: columns per lazy-update block (default 128); for group
            strategy it and ``group_size`` must divide one another.
        dampening_frac: relative damping (default 0.01), >= 0.
        actorder: ``"static"`` (default), ``"group"`` or ``None``.
        observer: one of :data:`~llmc_fsm_quantization.observers.OBSERVERS` (default ``"minmax"``);
            ``imatrix_mse`` takes its importance, ``E[x_j^2]``, from the Hessian's diagonal.
        max_dampening_retries: retries with 10x damping when ``H`` is not positive definite (from 0: 1e-4); a
            warning names ``modules`` and the ``dampening_frac`` used, which each result's ``dampening_frac`` holds.
        global_scales: NVFP4 only: per weight a ``[1]`` global scale to use instead of its own, or ``None``
            (:meth:`~llmc_fsm_quantization._base.QuantizingModifier.global_scales`).
        modules: the names of the weights' modules, for the warning (e.g. ``model.layers.0.mlp.{gate,up}_proj``).

    Returns:
        One :class:`QuantizedWeight` per weight: the dequantized weight (input
        dtype), ``scale`` / ``zero_point`` (``[1]``, ``[out, 1]`` or
        ``[out, in // group_size]``), ``g_idx`` (``[in]`` int32, only for
        ``actorder="group"``), the relative output error on the Hessian's inputs
        (from the sweep's own terms: :func:`llmc_fsm.toolkit.layer_error.sweep_relative_errors`) and the
        ``dampening_frac`` used.

    Raises:
        ValueError: bad shapes or arguments, ``in_features`` not divisible by ``group_size``.
        HessianNotPositiveDefiniteError: the damped Hessian cannot be factorised after all retries.
    """
    weights = list(weights)
    _check_inputs(weights, hessian, args, block_size, actorder)
    device = weights[0].device
    group = args.strategy == QuantizationStrategy.GROUP
    perm = None
    if actorder is not None:
        # llm-compressor 0.14's call (apply_activation_ordering): torch's default sort, not a stable one, so columns
        # of equal diag(H) (duplicated inputs) take its order; until session 38 a stable sort ordered them otherwise
        perm = torch.argsort(torch.diagonal(hessian).to(device=device, dtype=torch.float32), descending=True)
        hessian = hessian.to(device)[perm.unsqueeze(1), perm]  # one gather (rows and columns permuted)
    importance = None
    if observer in IMPORTANCE_OBSERVERS:  # E[x^2] per input column, in the sweep's (permuted) order
        importance = importance_from_hessian(hessian).to(device)
    used: list[float] = []  # the dampening_frac the factor was computed with
    factor = inverse_hessian_cholesky(
        hessian,
        dampening_frac=dampening_frac,
        max_dampening_retries=max_dampening_retries,
        device=device,
        algorithm="GPTQ",
        modules=modules,
        dampening_used=used,
    )
    originals = [w.detach().to(torch.float32) for w in weights]
    upfront = not group or actorder != "group" or is_scaled_format(args)
    static_perm = perm if actorder == "static" else None
    rule = _QuantRule(
        args,
        originals,
        static_perm,
        observer,
        upfront,
        block_size,
        storage_dtype=weights[0].dtype,
        importance=importance,
        perm=perm,
        global_scales=global_scales,
    )
    WT = torch.cat([w.T for w in originals], dim=1)
    if perm is not None:
        WT = WT[perm].contiguous()
    rule.bind(WT)
    original = WT.clone()
    row_errors = obs_sweep(WT, factor.U, rule, block_size=block_size)
    errors = sweep_relative_errors(original, WT, factor, row_errors, [w.shape[0] for w in weights], hessian.to(device))
    del original
    if perm is not None:
        WT = WT[torch.argsort(perm)]
    results = rule.results(WT, weights, perm if (group and actorder == "group") else None, errors)
    for q in results:
        q.dampening_frac = used[0]
    return results


class _QuantRule:
    """GPTQ's column rule: round the column to the grid of its row's (group's) scale and zero point."""

    def __init__(
        self,
        args: QuantizationArgs,
        originals: list[torch.Tensor],
        static_perm: torch.Tensor | None,
        observer: str,
        upfront: bool,
        block_size: int,
        *,
        storage_dtype: torch.dtype = torch.float32,
        importance: torch.Tensor | None = None,
        perm: torch.Tensor | None = None,
        global_scales: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        self.args = args
        self.importance = importance  # [cols] in sweep order (imatrix_mse), else None
        self.storage_dtype = storage_dtype  # the scales are computed in it (and hold what a parameter of it holds)
        self.scaled = is_scaled_format(args)  # NVFP4 / MX / FP8 block: compressed-tensors' scales, from the start
        self.row_args = as_row_args(args)
        if self.scaled:  # each column is rounded with its rows' effective scales (NVFP4: scale / global scale)
            self.row_args = self.row_args.model_copy(update={"scale_dtype": None, "block_structure": None})
        self.observer = observer
        self.upfront = upfront
        self.rows = sum(w.shape[0] for w in originals)
        cols = originals[0].shape[1]
        self.gs = args.group_size if args.strategy == QuantizationStrategy.GROUP else cols
        if args.strategy == QuantizationStrategy.TENSOR_GROUP:
            self.gs = args.group_size
        elif args.strategy == QuantizationStrategy.BLOCK:
            self.gs = int(args.block_structure[1])
        # Groups formed during the sweep start a sub-block (gs <= block_size) or a block (gs > block_size), so
        # their scale is taken with every earlier column's compensation applied.
        self.sub_block = self.gs if (not upfront and self.gs <= block_size) else SUB_BLOCK
        self.scales: list[torch.Tensor] = []
        self.zps: list[torch.Tensor] = []
        if self.scaled:
            self._scaled_upfront(args, originals, observer, global_scales or [None] * len(originals))
        elif upfront:
            original_order = None  # the importance of the original columns (observe sees unpermuted weights)
            if importance is not None:
                original_order = importance if perm is None else importance[torch.argsort(perm)]
            # observed in the weights' dtype: scales and zero points computed in it, as compressed-tensors does
            per = [observe(w.to(storage_dtype), args, observer, importance=original_order) for w in originals]
            self.scales = [
                s.expand(w.shape[0], -1) if s.numel() == 1 else s for (s, _), w in zip(per, originals, strict=True)
            ]
            self.zps = [
                z.expand(w.shape[0], -1) if z.numel() == 1 else z for (_, z), w in zip(per, originals, strict=True)
            ]
            self._per_weight = per
            self.scale = torch.cat(self.scales, dim=0)
            self.zp = torch.cat(self.zps, dim=0)
        else:
            ng = cols // self.gs
            self.scale = torch.empty((self.rows, ng), dtype=torch.float32, device=originals[0].device)
            self.zp = torch.empty((self.rows, ng), dtype=args.zp_dtype or torch.float32, device=originals[0].device)
        # Column j of the sweep uses group column `group_of[j]` of scale / zero point.
        group_of = torch.arange(cols) // self.gs
        if static_perm is not None:
            group_of = group_of[static_perm.cpu()]
        self.group_of = group_of.tolist()
        self.maskT: torch.Tensor | None = None
        self.WT: torch.Tensor | None = None
        # Integer grids: the column is rounded in place with compressed-tensors' own formula
        # (x / s + z, clamp, round, (q - z) * s), one group's scale/zero point as contiguous rows.
        self.int_grid = str(args.type) == "int"
        # A bfloat16 / float16 weight's quantized column is rounded to its dtype (compressed-tensors multiplies by a
        # scale of that dtype, and the weight is stored in it): the error compensated is that of the stored value.
        # So for every int / FP8 strategy, FP8 block included (its block scales are of the weight's dtype); not for
        # NVFP4 / MX, whose columns llm-compressor 0.14 compensates unrounded (rounding them breaks the match).
        narrow = qparam_dtype(storage_dtype)
        rounded = not self.scaled or args.strategy == QuantizationStrategy.BLOCK
        self.round_to = narrow if (rounded and narrow != torch.float32) else None
        self.zero_free = self.int_grid and bool(args.symmetric)  # zero points are 0: the + z and - z are skipped
        self.q_min, self.q_max = (float(v) for v in calculate_range(self.row_args, torch.device("cpu")))
        self.scaleT = self.scale.T.contiguous()
        self.zT = self.zp.T.to(torch.float32).contiguous()
        # One view per group made once (updated in place when a group's scale is taken during the sweep).
        self.scale_rows, self.z_rows = self.scaleT.unbind(0), self.zT.unbind(0)

    def _scaled_upfront(
        self, args: QuantizationArgs, originals: list[torch.Tensor], observer: str, global_scales: Sequence[Any]
    ) -> None:
        """NVFP4 / MX / FP8-block scales of every weight, from the original weights, before the sweep: the stored
        ``(scale, zero point, global scale)`` per weight, and per row and column group the effective scale the
        columns are rounded with (NVFP4: ``scale / global``; block: the block's scale for each of its rows)."""
        self._per_weight_scaled = [
            (s if args.scale_dtype is not None else storable(s, self.storage_dtype), z, g)
            for s, z, g in (
                observe_scaled_format(w.to(self.storage_dtype), args, observer, global_scale=g)  # the weight's dtype
                for w, g in zip(originals, global_scales, strict=True)
            )
        ]
        effective, zps = [], []
        for (s, z, g), w in zip(self._per_weight_scaled, originals, strict=True):
            if args.strategy == QuantizationStrategy.BLOCK:  # each row its block's scale (a partial last block too)
                rows_per_block, rows = int(args.block_structure[0]), w.shape[0]
                s, z = (
                    s.repeat_interleave(rows_per_block, dim=0)[:rows],
                    z.repeat_interleave(rows_per_block, dim=0)[:rows],
                )
            effective.append(s / g if g is not None else s)
            zps.append(z.to(torch.float32))
        self.scale = torch.cat(effective, dim=0)
        self.zp = torch.cat(zps, dim=0)

    def bind(self, WT: torch.Tensor) -> None:
        self.WT = WT
        keep = WT != 0
        self.maskT = None if bool(keep.all()) else keep

    def begin_block(self, c0: int, c1: int, W1: torch.Tensor, d1: torch.Tensor) -> None:
        return None

    def column(self, j: int, W1: torch.Tensor, i: int, out: torch.Tensor) -> torch.Tensor:
        g = self.group_of[j]
        if not self.upfront and j % self.gs == 0:
            x = self.WT[j : j + self.gs].T  # type: ignore[index]  # [rows, gs], every earlier column's update applied
            imp = None if self.importance is None else self.importance[j : j + self.gs].unsqueeze(0)
            s, z = row_qparams(x, self.row_args, self.observer, imp, dtype=qparam_dtype(self.storage_dtype))
            self.scale[:, g : g + 1] = s
            self.zp[:, g : g + 1] = z.to(self.zp.dtype)
            self.scaleT[g] = s.squeeze(1)
            self.zT[g] = self.zp[:, g].to(torch.float32)
        if self.int_grid:
            scale, zp = self.scale_rows[g], self.z_rows[g]
            if self.zero_free:
                torch.div(W1[i], scale, out=out).clamp_(self.q_min, self.q_max).round_().mul_(scale)
            else:
                torch.div(W1[i], scale, out=out).add_(zp).clamp_(self.q_min, self.q_max).round_().sub_(zp).mul_(scale)
        else:
            q = quantize_rows(W1[i].unsqueeze(1), self.scale[:, g : g + 1], self.zp[:, g : g + 1], self.row_args)
            out.copy_(q.squeeze(1))
        if self.round_to is not None:
            out.copy_(out.to(self.round_to))
        if self.maskT is not None:
            out.mul_(self.maskT[j])
        return out

    def results(
        self, WT: torch.Tensor, weights: list[torch.Tensor], g_perm: torch.Tensor | None, errors: list[float]
    ) -> list[QuantizedWeight]:
        out = []
        r0 = 0
        g_idx = None
        if g_perm is not None:
            g_idx = torch.empty(WT.shape[0], dtype=torch.int32, device=WT.device)
            g_idx[g_perm] = (torch.arange(WT.shape[0], device=WT.device) // self.gs).to(torch.int32)
        for k, w in enumerate(weights):
            r1 = r0 + w.shape[0]
            global_scale = None
            if self.scaled:
                scale, zp, global_scale = self._per_weight_scaled[k]
            elif self.upfront and self._per_weight[k][0].numel() == 1:  # tensor strategy
                scale, zp = self._per_weight[k]
            else:
                scale, zp = self.scale[r0:r1].clone(), self.zp[r0:r1].clone()
            out.append(
                QuantizedWeight(
                    weight=WT[:, r0:r1].T.contiguous().to(w.dtype),
                    scale=scale,
                    zero_point=zp,
                    g_idx=g_idx,
                    rel_output_error=errors[k],
                    global_scale=global_scale,
                )
            )
            r0 = r1
        return out


def _positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        msg = f"{attribute.name} must be a positive int, got {value!r}"
        raise ValueError(msg)


def _dampening(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_dampening_frac(value)


#: Why ``actorder: group`` is refused (see the module docstring).
_ACTORDER_GROUP_REFUSAL = (
    "actorder: group needs a per-column group index (g_idx) in the checkpoint, which compressed-tensors 0.20 has "
    "removed (its QuantizationArgs refuses actorder 'group' and no weight_g_idx is saved or applied on reload; "
    "llm-compressor 0.14's GPTQ refuses it too); use static (the default, alias weight: columns in activation "
    "order, each keeping the group of its original position) or null"
)


def _actorder(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value == "group":
        raise ValueError(_ACTORDER_GROUP_REFUSAL)
    if value not in ACTORDERS:
        msg = f"actorder must be one of static (alias weight) or null, got {value!r}"
        raise ValueError(msg)


@attrs.define(kw_only=True, slots=False, eq=False)
class GPTQModifier(QuantizingModifier):
    """Quantize Linear weights one-shot with GPTQ: Hessian from calibration inputs, OBS error compensation.

    Args (besides ``scheme``, ``targets``, ``ignore``, ``observer``):
        block_size: columns per lazy-update block (default 128).
        dampening_frac: ``dampening_frac * mean(diag H)`` added to the Hessian's
            diagonal (default 0.01, as in the paper); >= 0.
        actorder: activation order — ``"static"`` (default; compressed-tensors'
            alias ``"weight"`` is accepted) or ``null``; see :func:`gptq_quantize`.
            ``"group"`` (alias ``"dynamic"``) is refused:
            compressed-tensors 0.20 removed it, so its per-column group index has no
            place in the checkpoint.

    Requires state ``model`` and ``calibration_data``. Memory: one
    ``in_features x in_features`` float32 Hessian per distinct target input of
    the decoder layer being calibrated.

    Raises:
        ValueError: a bad argument, or ``block_size`` and the scheme's ``group_size`` that do not divide one another.
    """

    block_size: int = attrs.field(default=128, validator=_positive_int)
    dampening_frac: float = attrs.field(default=0.01, validator=_dampening)
    actorder: str | None = attrs.field(default="static", converter=actorder_value, validator=_actorder)

    supports_kv_cache = True
    measures_output_error = True  # from the sweep (llmc_fsm.toolkit.layer_error.sweep_relative_errors)
    compresses_views = True  # each expert matrix of fused experts (QuantizingModifier._check_views)

    def _clear(self) -> None:
        super()._clear()
        #: module name -> the ``dampening_frac`` its Hessian was factorised with, for the modules whose damped
        #: Hessian was not positive definite with the configured ``dampening_frac`` (retried with 10x damping; a
        #: warning names them). Empty: every module used the configured value.
        self.dampening_results: dict[str, float] = {}

    def _resolve(self) -> None:
        super()._resolve()
        for args in (scheme.weights for scheme in self._groups.values()):
            if (
                args is not None
                and args.strategy == QuantizationStrategy.GROUP
                and self.block_size % args.group_size
                and (args.group_size % self.block_size)
            ):
                fit = next(g for g in (64, 32, 16, 8, 4, 2, 1) if self.block_size % g == 0)
                msg = (
                    f"group_size {args.group_size} and GPTQ's block_size {self.block_size} (columns per lazy update) "
                    f"must divide one another: use a group size that divides {self.block_size} and every targeted "
                    f"layer's input width (e.g. CLI: --group-size {fit}; recipe: group_size: {fit}), or, only if "
                    f"every targeted layer's input width is a multiple of {args.group_size}, a block_size that is a "
                    f"multiple of it (CLI: --block-size {args.group_size}; recipe: block_size: {args.group_size})"
                )
                raise ValueError(msg)

    def take_stage_config(self, earlier: list[Any], stage: str) -> list[Any]:
        """llm-compressor's idiom: a GPTQModifier without any quantization config (no ``scheme``,
        ``config_groups``, ``observer`` or ``kv_cache_scheme``; ``targets`` absent or ``[Linear]``, ``ignore``
        absent or ``[]``: llm-compressor's ``has_config`` rule, which its own saved recipe.yaml relies on) after a
        ``QuantizationModifier`` of the same stage runs GPTQ with that modifier's config, which then does not run by
        itself.

        Args:
            earlier: the stage's modifiers before this one, in recipe order.
            stage: the stage's name (for the log line).

        Returns:
            ``earlier`` without the ``QuantizationModifier`` whose config this modifier took (its ``scheme`` or
            ``config_groups``, ``targets``, ``ignore``, ``observer`` and ``kv_cache_scheme``); ``earlier``
            unchanged when this modifier has a config of its own or the stage has not exactly one such
            ``QuantizationModifier`` (then both run, and one-shot refuses a module the two would quantize).

        Raises:
            ValueError: the taken config does not suit GPTQ (e.g. its group size and ``block_size``); or several
                ``QuantizationModifier`` configs before it (llm-compressor runs GPTQ with all of them; one
                GPTQModifier here holds one config).
        """
        sources = [m for m in earlier if type(m) is QuantizationModifier and not m._bare]
        if self._bare and len(sources) > 1:
            msg = (
                f"GPTQModifier has no quantization config of its own and stage {stage!r} has {len(sources)} "
                "QuantizationModifiers before it: llm-compressor runs GPTQ with all their configs, llmc-fsm's "
                "GPTQModifier takes one: put their schemes in one QuantizationModifier's config_groups (one group "
                "each), or give the GPTQModifier those config_groups"
            )
            raise ValueError(msg)
        if not self._bare or len(sources) != 1:
            return earlier
        (source,) = sources
        self.scheme, self.config_groups = source.scheme, copy.deepcopy(source.config_groups)
        self.targets, self.ignore, self.observer = list(source.targets), list(source.ignore), source.observer
        self.kv_cache_scheme = copy.deepcopy(source.kv_cache_scheme)
        self._ignore_defaulted, self._bare = source._ignore_defaulted, False
        self._resolve()
        logger.info(
            "stage %r: GPTQModifier has no quantization config of its own and takes the QuantizationModifier's before "
            "it (as llm-compressor does): GPTQ quantizes with that config, and the QuantizationModifier does not run "
            "by itself",
            stage,
        )
        return [m for m in earlier if m is not source]

    def _quantize(
        self, modules: list[nn.Module], accumulator: HessianAccumulator | None, args: QuantizationArgs
    ) -> list[QuantizedWeight]:
        if accumulator is None:  # an expert the router sent no token: no Hessian (QuantizingModifier._compress_all)
            scales = self.global_scales(modules)
            pairs = zip(modules, scales, strict=True)
            return [rtn_quantize(m.weight, args, args.observer, global_scale=g) for m, g in pairs]
        names = [self._names_by_id.get(id(m), "") for m in modules]
        results = gptq_quantize(
            [m.weight for m in modules],
            accumulator.hessian,
            args=args,
            block_size=self.block_size,
            dampening_frac=float(self.dampening_frac),
            actorder=self.actorder,
            observer=args.observer,
            global_scales=self.global_scales(modules),
            modules=compact_names(names),
        )
        for name, q in zip(names, results, strict=True):
            if q.dampening_frac != float(self.dampening_frac):
                self.dampening_results[name] = q.dampening_frac
        return results
