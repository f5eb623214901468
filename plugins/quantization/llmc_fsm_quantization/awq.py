"""AWQ: activation-aware weight scaling before weight quantization (Lin et al., arXiv 2306.00978, Sec. 3.2).

For each mapping (a smooth layer and the Linears reading its output, :mod:`llmc_fsm_quantization.mappings`;
defaults ``input_layernorm -> q/k/v``, ``v_proj -> o_proj`` without grouped-query attention,
``post_attention_layernorm -> gate/up``, ``up_proj -> down_proj``), with ``x_j`` the mean ``|X_j|`` of input
channel ``j`` over the calibration tokens, the candidate scales for an exponent ``r`` of llm-compressor 0.14's grid
(:func:`awq_grid`, ``n = n_grid``, default 20: ``r`` from 0 to 1 inclusive) are

* ``s_j = x_j ** r`` (the paper's search space, ``duo_scaling: false``), or
* ``s_j = x_j ** r / (w_j ** (1 - r) + 1e-4)`` (``duo_scaling: true``, the default, as llm-compressor and
  AutoAWQ), ``w_j`` the mean over the quantized balance layers' rows of ``|W_ij|`` (a balance layer no modifier
  quantizes, e.g. an ignored router, is left out, as llm-compressor 0.14's) divided by the maximum ``|W|`` of
  the quantization group holding it plus ``1e-6`` (the row for ``channel``, the group for ``group`` and NVFP4's
  ``tensor_group``, the ``h x w`` block for ``block``, the tensor for ``tensor``; float64, as llm-compressor 0.14;
  the candidates then float64 too);

clamped to at least ``1e-4`` and divided by ``sqrt(max s * min s)``. The grid's first candidate is ``r = 0`` without
the weight term, ``s = 1`` (no smoothing); then ``duo_scaling: true`` tries ``r = i / (n - 2)``, ``i = 0 .. n - 2``,
with it (``n`` candidates in all), ``false`` ``r = i / (n - 1)`` without it (``n``), ``"both"`` ``r = i / (m - 1)``,
``m = n // 2``, without then with it (``2 m``): the same candidates, in the same order, as llm-compressor. Each
candidate is scored by the mean squared difference between the block's
float output and its output with every quantized balance layer's weight replaced by ``Q(W diag(s)) diag(s)^-1``
(``Q``: round-to-nearest with the quantizing modifier's scheme and observer), on the layer's calibration
inputs; the block is the innermost module holding the balance layers (``self_attn``, ``o_proj``, ``mlp``,
``down_proj``). No smoothing (``s = 1``, the first candidate) is kept when no candidate beats it, so smoothing never
raises a block's error on the calibration data. The errors are summed window by window in a fixed order, and the
search is a branch and bound over the windows (taken in the order of the unsmoothed block's error per window,
largest first): every candidate's first window is scored, then the candidates are
completed in the order of that score, and one whose partial sum already exceeds the best complete error is dropped
(it cannot be chosen: the sums only grow). The choice (lowest error, the earliest candidate on ties) is the one
scoring every candidate in full gives; on SmolLM2-135M with 32 x 256 calibration tokens it scores about 3/4 of the
grid's windows. A block that is its one balance Linear (``v -> o``, ``up -> down``) is scored instead from the
Gram matrix ``H = X^T X`` of its inputs, accumulated once: the error is ``tr(dW H dW^T)``, ``dW`` the candidate's
quantized weight minus ``W`` (``out * in^2`` per candidate instead of ``N * in * out``; every candidate in full;
where that is cheaper: not for an expert few tokens reach).
``search_n_sample_token`` (opt-in, default off, not the paper's search) scores the other blocks on every ``k``-th
window only. The chosen scales are folded into the smooth layer and the
balance layers (the float model is unchanged); the quantizer then quantizes the smoothed weights. As in
llm-compressor, ``W diag(s)`` is computed in the scales' dtype (float64 for ``duo_scaling`` candidates) and rounded
once to the weight's dtype, in the search and in the fold: with symmetric int4 a group's largest ``|W_ij s_j|`` sits on
the quantizer's rounding tie, so the last bit decides a code.

Clipping (``apply_clip: true``; the paper's v1, Sec. 3.3 and Table 2, as AutoAWQ's ``apply_clip``; llm-compressor 0.14
has no clipping, and its recipes leave ``apply_clip`` out, which means no clipping here too): after a decoder layer's
mappings are smoothed, every Linear of the layer that a modifier of the session quantizes, except the query and key
projections (their outputs meet in the attention scores, which a per-output error does not measure; AutoAWQ skips
them too), gets a per (output row, quantization group) range: for ``i`` in ``0 .. int(clip_max_shrink * clip_n_grid)
- 1`` the weights of the group are clamped to ``[-m_i, m_i]``, ``m_i = (1 - i / clip_n_grid) * max|W_group|``,
quantized (the quantizer's scheme and observer), and scored by the mean over calibration tokens ``x`` of
``(x_group . (Q(clamp(W)) - W)_group) ** 2``; each group keeps its lowest-scoring ``m_i`` (ties: the larger).
The tokens are the layer's smoothed calibration inputs, every ``k``-th with ``k = max(1, N // clip_n_sample_token)``.
The clamped weight is kept only if it lowers the Linear's whole quantized output error
``mean((X (Q(W') - W)^T) ** 2)`` on those tokens against ``Q(W)`` (else the Linear is left as it was), so clipping
never raises it on the calibration data. Unlike smoothing, clipping changes the float model (it is a
quantization choice). Needs a weight quantization per output channel or per group (not per tensor, not
NVFP4/MX/FP8-block scales, not GPTQ's ``actorder: group``), refused before calibration otherwise.
:attr:`AWQModifier.clipping_results` holds, per clipped Linear, ``groups`` / ``groups_clipped``, the mean kept
range ``shrink_mean`` (``m / max|W_group|``), ``error_unclipped`` / ``error`` and ``applied``.

Mixture-of-experts layers with fused experts (transformers 5's ``MixtralExperts``, ``Qwen3MoeExperts``: 3-D
``gate_up_proj`` / ``down_proj``; :mod:`llmc_fsm_quantization.mappings`): ``post_attention_layernorm -> router and
every expert's gate/up rows`` shares one scale; its ``x_j`` is over every token reaching the block, ``w_j`` over the
rows of the quantized ones (the router, not quantized, is not among them), and the error is the block's output, the
router's top-k computed as in the float model (the router reads the unscaled input during the search, and its weight
takes the scale when folded, so the routing is unchanged). Each expert's ``up_proj -> down_proj`` gets its own scale
from the tokens the router sent to it, scored by its ``down_proj`` output on them (as AutoAWQ's per-expert
``up -> down``); an expert with no routed token is left unscaled. llm-compressor 0.14 by default gives every expert
every calibration token instead (``moe_calibrate_all_experts=True``), as ``calibrate_all_experts: true`` does here
(on the AWQModifier, or on the stage's quantizing modifier); without it one warning line says so. The scales are
folded into the fused parameters through the expert matrices' views (they share the storage), and the quantizer
(GPTQ or round-to-nearest per expert matrix) then quantizes the smoothed experts. A shared expert (DeepSeek-V3,
Qwen3-Next) and its gate are balance layers of the same norm mapping, scored on the whole block's output (routed
plus shared), with their own ``up -> down``.
Nemotron-H's experts have no gate (``down(relu2(up x))``, as its shared expert and dense MLP): the norm's scale goes
into the router, the shared expert's and every expert's ``up_proj`` as above, and each ``up -> down`` is searched the
same way (the candidates scale ``down``'s input columns) and folded through squared ReLU, positively homogeneous of
degree 2: ``up``'s rows are divided by ``sqrt(s)`` and ``down``'s columns multiplied by ``s``, exact for the float
model (:attr:`~llmc_fsm_quantization.mappings.ResolvedMapping.degree`; the activation is recognised by its class,
transformers' ``ReLUSquaredActivation``). Refused, before any work: experts no mapping reaches (GPT-OSS, DBRX, gateless
experts of another activation, a block with Nemotron-H's latent projection: the message names why) that a quantizer of
the stage would quantize (experts in the quantizers' ``ignore`` stay dense and the rest of the model is smoothed).

Under ``torch.distributed`` (``torchrun``) each rank runs its share of the calibration windows; the statistics
(``sum|x_j|`` and token counts), every candidate's block error and the clipping scores are summed over the ranks
(:func:`llmc_fsm.toolkit.all_reduce_tensor`) before any choice, so every rank folds the same scales, those of one
process (up to the order of the float64 additions). A fused expert the router sent none of a rank's tokens is
searched and clipped on the other ranks' tokens (that rank takes part with none; refused until session 39).

Two recipe forms (both as llm-compressor reads them): ``AWQModifier`` followed by a ``QuantizationModifier`` (or
``GPTQModifier``) that carries the scheme, in the same stage; or the scheme on ``AWQModifier`` itself
(``scheme`` or ``config_groups``, the older form), which then also quantizes its ``targets`` by round-to-nearest
(as :class:`~llmc_fsm_quantization.QuantizationModifier`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from torch import nn

from llmc_fsm.toolkit import (
    DEFAULT_IGNORE,
    DEFAULT_TARGETS,
    LinearView,
    ModuleResult,
    all_gather_ints,
    all_reduce_tensor,
    compact_names,
    expert_checkpoint_names,
    get_rank,
    is_distributed,
    linear_expert_names,
    matches,
    model_family,
    patterns,
    select_targets,
    weight_views,
)
from llmc_fsm_quantization.mappings import (
    MappingSpec,
    ResolvedMapping,
    architecture,
    fold_scales,
    moe_mapping_problem,
    moe_router,
    parse_mappings,
)
from llmc_fsm_quantization.observers import is_scaled_format
from llmc_fsm_quantization.rtn import QuantizationModifier, rtn_quantize
from llmc_fsm_quantization.schemes import weight_args
from llmc_fsm_quantization.smoothquant import (
    ActivationObserver,
    SmoothingModifier,
    _observe_every_token,
    _observe_routed,
    _scale_stats,
    block_output,
    members,
    suspended_forward_hooks,
)

__all__ = [
    "MIN_N_GRID",
    "NOT_CLIPPED",
    "AWQModifier",
    "awq_candidate_scales",
    "awq_clip_search",
    "awq_grid",
    "awq_weight_mean",
    "clip_problem",
]

logger = logging.getLogger(__name__)

#: (weight args, observer) a balance layer is quantized with, or ``None`` (it stays float).
Quantizer = tuple[QuantizationArgs, str] | None

#: ``model_type`` s whose default AWQ mappings leave ``input_layernorm -> q_proj, k_proj, v_proj`` out, as
#: llm-compressor 0.14's ``_gemma3_mappings`` do: Gemma 3 normalizes the queries and keys after their projections
#: (``q_norm``, ``k_norm``), and smoothing into them measured worse than round-to-nearest (llm-compressor issue 2522;
#: found by a tester comparing the resolved mappings). A recipe's own ``mappings`` may still name them.
LEFT_OUT_LIKE_LLMCOMPRESSOR = frozenset({"gemma3", "gemma3_text"})


def _no_quantizer_message(unquantized: list[ResolvedMapping]) -> str:
    """AWQ's refusal of mappings no modifier of its stage quantizes a balance layer of."""
    return (
        f"AWQModifier: no modifier of this stage quantizes the balance layers of {len(unquantized)} mappings, e.g. "
        f"{', '.join(unquantized[0].balance_names)}: AWQ chooses scales for a weight quantization; put a "
        "QuantizationModifier (or GPTQModifier) with the scheme in the same stage, give AWQModifier a scheme (e.g. "
        "scheme: W4A16), or run the stages fused (oneshot --fuse-stages, fuse_stages=True)"
    )


def _quantizes_weights(modifier: Any) -> bool:
    """Whether ``modifier`` quantizes weights (it has ``weight_args``; a pruner, a KV-cache scheme alone: not)."""
    try:
        modifier.weight_args  # noqa: B018 (raises for a modifier that quantizes no weights)
    except (AttributeError, ValueError):
        return False
    return True


def _ignored_experts(model: nn.Module, name: str, experts: nn.Module, ignore: Sequence[str]) -> bool:
    """Whether ``ignore`` patterns leave the fused experts module ``name`` of ``model`` out: they match it, a module
    around it (not the model itself), or every one of its expert matrices (``<name>.<e>.<matrix>`` views)."""
    around = [name, *(".".join(name.split(".")[:i]) for i in range(name.count("."), 0, -1))]
    if any(matches(n, model.get_submodule(n), p) for n in around for p in ignore):
        return True
    views = weight_views(experts)
    return bool(views) and all(any(matches(f"{name}.{s}", v, p) for p in ignore) for s, v in views.items())


def _quantized_experts(experts: dict[str, nn.Module], quantized: set[str]) -> dict[str, nn.Module]:
    """Those of ``experts`` (``{name: fused experts module}``) that ``quantized`` (module names a quantizer
    selected) holds, or one of whose expert matrices (views ``<name>.<e>.<matrix>``) it holds."""
    return {n: m for n, m in experts.items() if n in quantized or any(f"{n}.{s}" in quantized for s in weight_views(m))}


def awq_weight_mean(weights: list[torch.Tensor], group_sizes: list[int | tuple[int, int] | None]) -> torch.Tensor:
    """``w_j``: mean over all rows of ``|W_ij| / (max |W| + 1e-6)``, the maximum over the quantization group holding
    ``W_ij``, as llm-compressor 0.14's ``_compute_layer_means``: the quotient in the weight's dtype, the rows summed
    in float64 per weight, the weights' sums added and divided by the total row count.

    Args:
        weights: the balance layers' ``[out_k, C]`` weights.
        group_sizes: per weight, its quantization group: ``None`` one group per row (``channel``), ``0`` the whole
            tensor (``tensor``), an int ``g`` every ``g`` consecutive values of the flattened weight (``group``,
            ``tensor_group``), a pair ``(h, w)`` each ``h x w`` block (``block``; a partial block at the bottom or
            right edge is its own group, as the quantizer's scales, where llm-compressor 0.14 raises).

    Returns:
        ``[C]`` float64.

    Raises:
        ValueError: no weight.
    """
    total: torch.Tensor | None = None
    rows = 0
    for w, g in zip(weights, group_sizes, strict=True):
        a = w.detach().abs()
        if isinstance(g, tuple):
            maxima = _block_maxima(a, g)
        else:
            chunk = a.numel() if g == 0 else a.shape[1] if g is None else g
            grouped = a.reshape(-1, chunk)
            maxima = grouped.amax(dim=1, keepdim=True).expand_as(grouped).reshape(a.shape)
        part = (a / (maxima + 1e-6)).sum(0, dtype=torch.float64)
        total = part if total is None else total + part
        rows += a.shape[0]
    if total is None:
        raise ValueError("awq_weight_mean needs at least one weight (a mapping has one balance layer or more)")
    return total / rows


def _block_maxima(a: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per value of ``a`` (``[R, C]``, non-negative), the maximum of its ``h x w`` block (``block``), the blocks
    tiling ``a`` from its top left corner, the last row / column of blocks partial where ``h`` / ``w`` does not
    divide ``R`` / ``C``. Returns ``[R, C]`` in ``a``'s dtype."""
    h, w = block
    rows, cols = a.shape
    n_r, n_c = -(-rows // h), -(-cols // w)
    padded = nn.functional.pad(a, (0, n_c * w - cols, 0, n_r * h - rows))  # zeros never raise a max of |W|
    maxima = padded.reshape(n_r, h, n_c, w).amax(dim=(1, 3))
    return maxima.repeat_interleave(h, dim=0).repeat_interleave(w, dim=1)[:rows, :cols]


def awq_candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratio: float) -> torch.Tensor:
    """One candidate of the grid, in llm-compressor 0.14's dtypes: ``x ** r`` (``w_mean`` ``None``) or
    ``x ** r / (w ** (1 - r) + 1e-4)``, clamped to ``>= 1e-4``, divided by ``sqrt(max * min)``, a value that is
    not finite then set to 1.

    Args:
        x_mean: ``[C]`` float32 mean ``|x_j|`` (``x ** r`` is computed in float32, as llm-compressor).
        w_mean: ``[C]`` float64 :func:`awq_weight_mean`, or ``None``.
        ratio: the exponent ``r`` in ``[0, 1]``.

    Returns:
        ``[C]``: float64 with ``w_mean`` (the float32 ``x ** r`` promoted by the float64 weight term), ``x_mean``'s
        dtype without. The weights are scaled by these values before being rounded to their dtype, as llm-compressor
        (in the search and in the fold): with symmetric int4 a group's largest ``|W_ij s_j|`` sits on a rounding tie
        of the quantizer, so the last bit of a scale can change a code.
    """
    s = x_mean.pow(ratio)
    if w_mean is not None:
        s = s / (w_mean.pow(1.0 - ratio) + 1e-4)
    s = s.clamp_min(1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


#: smallest ``n_grid`` per ``duo_scaling`` (:func:`awq_grid`): llm-compressor 0.14's grid divides by ``n - 1``,
#: ``n - 2`` and ``n // 2 - 1``.
MIN_N_GRID = {False: 2, True: 3, "both": 4}


def awq_grid(duo_scaling: bool | str, n_grid: int) -> list[tuple[float, bool]]:
    """The exponent grid of the AWQ search: ``(ratio, duo)`` per candidate, in order, as llm-compressor 0.14's
    ``AWQModifier._get_grid_search_params``.

    * ``False``: ``(i / (n - 1), False)`` for ``i`` in ``0 .. n - 1`` (``n`` candidates, ratios 0 to 1);
    * ``True``: ``(0, False)`` (no smoothing: ``x ** 0 = 1``), then ``(i / (n - 2), True)`` for ``i`` in
      ``0 .. n - 2`` (``n`` candidates);
    * ``"both"``: ``m = n // 2``; for ``i`` in ``0 .. m - 1``: ``(i / (m - 1), False)``, ``(i / (m - 1), True)``
      (``2 m`` candidates).

    The first candidate is ``(0.0, False)``, scales all 1, in every case.

    Raises:
        ValueError: ``n_grid`` below :data:`MIN_N_GRID` for ``duo_scaling`` (llm-compressor divides by zero there).
    """
    least = MIN_N_GRID[duo_scaling]
    if n_grid < least:
        msg = (
            f"n_grid must be at least {least} with duo_scaling {duo_scaling!r} (the exponent grid runs from 0 to 1 in "
            f"steps of 1/(n_grid - {1 if duo_scaling is False else 2}) as in llm-compressor, for 'both' 1/(n_grid // 2 "
            f"- 1)), got {n_grid}"
        )
        raise ValueError(msg)
    if duo_scaling == "both":
        half = n_grid // 2
        return [(i / (half - 1), duo) for i in range(half) for duo in (False, True)]
    if duo_scaling is False:
        return [(i / (n_grid - 1), False) for i in range(n_grid)]
    return [(0.0, False)] + [(i / (n_grid - 2), True) for i in range(n_grid - 1)]


#: leaf names of the projections the clipping search leaves alone (queries and keys, fused ones included).
NOT_CLIPPED = ("q_proj", "k_proj", "query", "key", "qkv_proj", "Wqkv", "query_key_value")


def _clip_group_size(args: QuantizationArgs, cols: int) -> int:
    if args.strategy == QuantizationStrategy.GROUP:
        return int(args.group_size)
    return cols


def clip_problem(args: QuantizationArgs) -> str | None:
    """Why the clipping search cannot serve weights quantized with ``args`` (``None``: it can)."""
    strategy = getattr(args.strategy, "value", args.strategy)
    if is_scaled_format(args):
        return f"{_format(args)} scales are shared beyond one output row and group"
    if strategy not in ("group", "channel"):
        return f"the {strategy} strategy shares one scale beyond one output row and group"
    if getattr(args.actorder, "value", args.actorder) == "group":
        return "actorder: group reorders the columns of each group"
    return None


def _format(args: QuantizationArgs) -> str:
    return (
        f"{getattr(args.type, 'value', args.type)} {args.num_bits}-bit {getattr(args.strategy, 'value', args.strategy)}"
    )


@torch.no_grad()
def awq_clip_search(
    weight: torch.Tensor,
    inputs: torch.Tensor,
    args: QuantizationArgs,
    observer: str = "minmax",
    *,
    n_grid: int = 20,
    max_shrink: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's clipping search for one Linear (arXiv 2306.00978 v1, Sec. 3.3; see the module docstring).

    Args:
        weight: ``[out, in]`` float weight (not modified).
        inputs: ``[tokens, in]`` calibration inputs of the Linear.
        args: the weight's ``QuantizationArgs`` (group or channel strategy, :func:`clip_problem` ``None``).
        observer: the quantizer's observer.
        n_grid / max_shrink: candidates ``m_i = (1 - i / n_grid) * max|W_group|`` for ``i < int(max_shrink * n_grid)``.

    Returns:
        ``(max_val, index)``: ``[out, groups]`` float32 chosen range ``m`` and int64 chosen ``i``.

    Under ``torch.distributed`` a collective: every rank passes its own calibration tokens and the scores are summed
    over the ranks (float64), so every rank chooses the same ranges, those of one process holding all the tokens.
    """
    w = weight.detach().to(torch.float32)
    rows, cols = w.shape
    g = _clip_group_size(args, cols)
    groups = cols // g
    wg = w.reshape(rows, groups, g)
    xg = inputs.detach().to(torch.float32).reshape(-1, groups, g)
    org_max = wg.abs().amax(dim=-1)
    tokens = float(
        all_reduce_tensor(torch.tensor([float(xg.shape[0])], dtype=torch.float64), what="all_reduce (AWQ clip)")
    )
    best_err = torch.full((rows, groups), float("inf"), dtype=torch.float64)
    best_idx = torch.zeros((rows, groups), dtype=torch.int64)
    for i in range(max(1, int(max_shrink * n_grid))):
        m = (org_max * (1.0 - i / n_grid))[..., None]
        clamped = torch.maximum(torch.minimum(wg, m), -m).reshape(rows, cols).to(weight.dtype)
        q = rtn_quantize(clamped, args, observer).weight.to(torch.float32).reshape(rows, groups, g)
        err = torch.einsum("rgc,ngc->rgn", q - wg, xg).pow(2).sum(dim=-1, dtype=torch.float64)
        err = all_reduce_tensor(err, what="all_reduce (AWQ clip)") / max(tokens, 1.0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_idx = torch.where(better, torch.full_like(best_idx, i), best_idx)
    return org_max * (1.0 - best_idx.to(torch.float32) / n_grid), best_idx


def _clamp_groups(weight: torch.Tensor, max_val: torch.Tensor, group_size: int) -> torch.Tensor:
    """``weight`` with each (row, group) clamped to ``[-max_val, max_val]``, in its dtype."""
    rows, cols = weight.shape
    wg = weight.detach().to(torch.float32).reshape(rows, cols // group_size, group_size)
    m = max_val[..., None]
    return torch.maximum(torch.minimum(wg, m), -m).reshape(rows, cols).to(weight.dtype)


def _output_error(weight: torch.Tensor, quantized: torch.Tensor, inputs: torch.Tensor) -> float:
    """``mean((X (Q - W)^T) ** 2)`` over tokens (every rank's) and output rows (float64 sum)."""
    delta = quantized.to(torch.float32) - weight.to(torch.float32)
    out = inputs.to(torch.float32) @ delta.T
    sums = torch.tensor([float(out.pow(2).sum(dtype=torch.float64)), float(out.numel())], dtype=torch.float64)
    all_reduce_tensor(sums, what="all_reduce (AWQ clip error)")
    return float(sums[0]) / max(float(sums[1]), 1.0)


def _duo(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in (True, False, "both"):
        raise ValueError(f"duo_scaling must be true, false or 'both', got {value!r}")


def _grid(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"n_grid must be a positive int (grid points of the exponent search), got {value!r}")


def _clip_grid(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


def _sample(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{attribute.name} must be null (every token) or a positive int, got {value!r}")


def _shrink(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < float(value) < 1.0:
        msg = (
            f"clip_max_shrink must be a number in (0, 1) (the largest fraction a group's range is shrunk), "
            f"got {value!r}"
        )
        raise ValueError(msg)


def _flag(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be true or false, got {value!r}")


def _optional_flag(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be true, false or null, got {value!r}")


def _device_name(value: Any) -> Any:
    """attrs converter: a ``torch.device`` (llm-compressor's declared type of ``offload_device``) as its name, which a
    recipe can hold (it was refused when the recipe was saved; a fuzzing tester's case); others as given."""
    return str(value) if isinstance(value, torch.device) else value


def _offload(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not re.fullmatch(r"cpu|meta|cuda(:\d+)?", str(value)):
        raise ValueError(f"offload_device must be null, 'cpu' or 'cuda' ('cuda:N'), got {value!r}")


def _config_groups(value: Any) -> tuple[dict[str, Any], list[str] | None]:
    if not isinstance(value, Mapping) or len(value) != 1:
        count = len(value) if isinstance(value, Mapping) else type(value).__name__
        msg = f"config_groups: exactly one config group is supported (one scheme per modifier), got {count}"
        raise ValueError(msg)
    ((_, group),) = value.items()
    if not isinstance(group, Mapping):
        raise ValueError(f"config_groups: a config group must be a mapping of scheme fields, got {group!r}")
    targets = group.get("targets")
    return {k: v for k, v in group.items() if k != "targets"}, (
        [targets] if isinstance(targets, str) else list(targets) if targets is not None else None
    )


@contextlib.contextmanager
def _as_awq() -> Iterator[None]:
    """Errors and log lines of the quantizer AWQ runs for its ``scheme`` (the older form) said as AWQ's: they named
    ``QuantizationModifier``, a modifier the recipe did not hold (found by testers; the log lines, e.g. the fused
    experts' warning, in B5's case). The lines are rewritten by a filter on this package's and llmc_fsm's loggers,
    for records of this thread, while the block runs."""
    rewrite = _AsAWQ()
    loggers = [
        each
        for name, each in logging.Logger.manager.loggerDict.items()
        if isinstance(each, logging.Logger) and name.startswith(("llmc_fsm.", "llmc_fsm_quantization"))
    ]
    for each in loggers:
        each.addFilter(rewrite)
    try:
        yield
    except ValueError as exc:
        text = str(exc)
        if not text.startswith(_INNER):
            raise
        raise ValueError(_AWQ + text[len(_INNER) :]) from exc
    finally:
        for each in loggers:
            each.removeFilter(rewrite)


_INNER = "QuantizationModifier"
_AWQ = "AWQModifier (quantizing with its scheme)"


class _AsAWQ(logging.Filter):
    """A log record of the thread that made it beginning with ``QuantizationModifier`` said as AWQ's."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread == self.thread:
            text = record.getMessage()
            if text.startswith(_INNER):
                record.msg, record.args = _AWQ + text[len(_INNER) :], None
        return True


@attrs.define(kw_only=True, slots=False, eq=False)
class AWQModifier(SmoothingModifier):
    """AWQ: scale weight channels by activation statistics before weight quantization (arXiv 2306.00978).

    Args:
        mappings: llm-compressor's ``mappings`` (either form), held as :class:`~llmc_fsm_quantization.AWQMapping`
            objects as llm-compressor holds them (``.mappings[0].smooth_layer``; a recipe.yaml holds their AWQ
            form); default ``None``: derived from the model (see :mod:`llmc_fsm_quantization.mappings`).
        duo_scaling: ``true`` (default), ``false`` or ``"both"`` (see the module docstring).
        n_grid: exponent grid points (default 20; :func:`awq_grid`, as llm-compressor); at least
            :data:`MIN_N_GRID` of ``duo_scaling`` (2, 3, 4), else ``ValueError`` here.
        ignore: module patterns not quantized (with a scheme); a mapping whose smooth layer or every balance layer
            is ignored is not smoothed, an ignored balance layer of another mapping (a router) absorbs the scale in
            its float weights (:func:`~llmc_fsm_quantization.mappings.resolve_mappings`); default ``["lm_head"]``.
        scheme / config_groups: the older form: AWQ quantizes ``targets`` itself by round-to-nearest with this
            scheme (``config_groups``: one group, llm-compressor's form; its ``targets`` become ``targets``).
            Without them a quantizing modifier of the same stage must quantize the balance layers.
        targets: modules quantized with ``scheme`` (default ``["Linear"]``); without ``scheme`` / ``config_groups``
            only the default is taken (``ValueError`` otherwise: the quantizing modifier's ``targets`` choose the
            quantized modules, ``mappings`` the smoothed layers).
        observer: weight observer of ``scheme`` (``minmax`` or ``mse``); without ``scheme`` / ``config_groups``
            only ``minmax`` (``ValueError`` otherwise: the quantizing modifier's observer is used).
        offload_device: llm-compressor's memory placement; accepted and not used (one layer's inputs are kept).
        apply_clip: also search and apply AWQ's weight clipping (default ``false``; see the module docstring).
        clip_n_grid / clip_max_shrink: the clipping grid (defaults 20 and 0.5: ranges 1, 0.95, ..., 0.55 of the
            group's ``max|W|``).
        clip_n_sample_token: about how many calibration tokens the clipping search uses per Linear (default 512).
        search_n_sample_token: opt-in shortcut, not the paper's search: about how many calibration tokens the
            exponent search of a mapping scored by a block forward (``self_attn``, ``mlp``) uses: every ``k``-th
            window, ``k = max(1, N // search_n_sample_token)``, ``N`` this process's tokens; its errors are then
            means over those windows. Default ``null``: every token (the exact grid search). Linear blocks
            (``v -> o``, ``up -> down``) always use every token (their Gram matrix, see the module docstring).
        calibrate_all_experts: fused mixture-of-experts layers: ``true`` sends every calibration token through
            every expert for the statistics, the scale search and the clipping of the expert mappings (``up ->
            down``), as llm-compressor 0.14's default ``moe_calibrate_all_experts=True``; ``false``: each expert's
            routed tokens (one warning line says how that differs); left out (``null``): the value a quantizing
            modifier of the session sets (``calibrate_all_experts: true`` on the ``QuantizationModifier``), else
            ``false``. The layer's output always follows the router.

    Requires state ``model`` and ``calibration_data``; runs in the sequential pipeline. :attr:`smoothing_results`:
    per smooth layer ``exponent`` (``None``: no smoothing won), ``duo_scaling``, ``tokens`` (the calibration tokens
    the statistics came from: every token, or an expert's routed ones; ``0``: the router sent that expert none, it is
    left unscaled and its errors are ``0.0``), ``error_unsmoothed`` and ``error`` (mean squared block output error,
    quantized, without and with the chosen scales) and the scales' ``scale_min/max/mean``; :attr:`clipping_results`
    (with ``apply_clip``): see the module docstring.
    """

    include_linear_mappings = True
    skip_incompatible_mappings = True

    mappings: list[MappingSpec] | None = attrs.field(default=None, converter=parse_mappings)
    duo_scaling: Any = attrs.field(default=True, validator=_duo)
    n_grid: int = attrs.field(default=20, validator=_grid)
    ignore: list[str] = attrs.field(factory=lambda: list(DEFAULT_IGNORE), converter=patterns)
    scheme: Any = attrs.field(
        default=None, metadata={"default_means": "the quantizing modifier in the same stage carries the scheme"}
    )
    config_groups: Any = None
    targets: list[str] = attrs.field(factory=lambda: list(DEFAULT_TARGETS), converter=patterns)
    observer: str = "minmax"
    offload_device: Any = attrs.field(default=None, converter=_device_name, validator=_offload)
    apply_clip: bool = attrs.field(default=False, validator=_flag)
    clip_n_grid: int = attrs.field(default=20, validator=_clip_grid)
    clip_max_shrink: float = attrs.field(default=0.5, validator=_shrink)
    clip_n_sample_token: int = attrs.field(default=512, validator=_clip_grid)
    search_n_sample_token: int | None = attrs.field(default=None, validator=_sample)
    calibrate_all_experts: bool | None = attrs.field(default=None, validator=_optional_flag)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._quantizer: QuantizationModifier | None = None
        self._all_experts = False  # calibrate_all_experts as resolved at calibration start
        #: smooth layers of the mappings left unsmoothed because nothing quantizes their balance layers
        self.unsmoothed: list[str] = []
        awq_grid(self.duo_scaling, self.n_grid)  # n_grid too small for the grid of duo_scaling: refused here
        if self.scheme is not None and self.config_groups is not None:
            raise ValueError("give scheme or config_groups, not both")
        scheme, targets = self.scheme, self.targets
        if self.config_groups is not None:
            scheme, group_targets = _config_groups(self.config_groups)
            if group_targets is not None:
                targets = group_targets
        if scheme is None:  # llm-compressor 0.14's AWQModifier has neither field (found by a tester: both were unused)
            if self.targets != list(DEFAULT_TARGETS):
                msg = (
                    f"targets {self.targets!r} would select nothing: AWQModifier without scheme or config_groups "
                    "quantizes nothing itself (llm-compressor's AWQModifier has no targets); put targets on the "
                    "QuantizationModifier that carries the scheme, and give mappings to restrict which layers are "
                    "smoothed"
                )
                raise ValueError(msg)
            if self.observer != "minmax":
                msg = (
                    f"observer {self.observer!r} would be unused: AWQModifier without scheme or config_groups "
                    "quantizes with the QuantizationModifier's observer (llm-compressor's AWQModifier has no "
                    "observer); put observer on that modifier"
                )
                raise ValueError(msg)
        else:
            with _as_awq():  # its argument errors too (they named QuantizationModifier: B5's case)
                self._quantizer = QuantizationModifier(
                    scheme=scheme,
                    targets=targets,
                    ignore=self.ignore,
                    observer=self.observer,
                    calibrate_all_experts=bool(self.calibrate_all_experts),
                )
        self._quantizers: dict[int, Quantizer] = {}
        #: Linear name -> (module, quantizer) the clipping search serves (with ``apply_clip``, after calibration_start).
        self._clip_targets: dict[str, tuple[nn.Module, tuple[QuantizationArgs, str]]] = {}
        #: Linear name -> what the clipping search chose there (see the module docstring).
        self.clipping_results: dict[str, dict[str, Any]] = {}

    # ---- the older form: AWQ quantizes too --------------------------------------
    @property
    def quantization_scheme(self) -> Any:
        """The scheme AWQ quantizes with (older form); ``AttributeError`` when a separate modifier quantizes."""
        if self._quantizer is None:
            raise AttributeError("AWQModifier without scheme does not quantize")
        return self._quantizer.quantization_scheme

    @property
    def quantization_schemes(self) -> dict[str, Any]:
        """``{config group name: compressed-tensors QuantizationScheme}`` AWQ quantizes with (the older form: its
        quantizer's, copies); empty when a separate modifier quantizes. One-shot's ``quantization_format`` check reads
        it (found by a tester: the older form was refused as "the recipe quantizes no weights")."""
        return {} if self._quantizer is None else self._quantizer.quantization_schemes

    @property
    def weight_args(self) -> QuantizationArgs:
        if self._quantizer is None:
            raise AttributeError("AWQModifier without scheme does not quantize")
        return self._quantizer.weight_args

    @property
    def results(self) -> dict[str, Any]:
        """The quantized modules' results (older form), else empty."""
        return self._quantizer.results if self._quantizer is not None else {}

    @property
    def skipped(self) -> list[str]:
        return self._quantizer.skipped if self._quantizer is not None else []

    @property
    def resolved_targets(self) -> dict[str, nn.Module]:
        targets = super().resolved_targets
        if self._quantizer is not None:
            targets.update(self._quantizer.resolved_targets)
        targets.update((name, module) for name, (module, _) in self._clip_targets.items())
        return targets

    def resolve(self, model: nn.Module) -> list[ResolvedMapping]:
        """:meth:`SmoothingModifier.resolve`; with the default mappings on Gemma 3 (:data:`LEFT_OUT_LIKE_LLMCOMPRESSOR`)
        without ``input_layernorm -> q_proj, k_proj, v_proj``, as llm-compressor 0.14 (one log line says so).

        Raises:
            ValueError: as :meth:`SmoothingModifier.resolve`.
        """
        mappings = super().resolve(model)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if self.mappings is not None or model_type not in LEFT_OUT_LIKE_LLMCOMPRESSOR:
            return mappings
        kept = [m for m in mappings if m.smooth_name.rsplit(".", 1)[-1] != "input_layernorm"]
        left = [m.smooth_name for m in mappings if m.smooth_name.rsplit(".", 1)[-1] == "input_layernorm"]
        if left and model_type not in self._warned:
            self._warned.add(model_type)
            logger.warning(
                "AWQModifier: %s: the default mappings leave %s -> q_proj, k_proj, v_proj out, as llm-compressor "
                "0.14's: smoothing into the queries and keys, which Gemma 3 normalizes after projecting them, measured "
                "worse than round-to-nearest (llm-compressor issue 2522); give mappings to smooth them",
                architecture(model),
                compact_names(left),
            )
        return kept

    def check_model(self, model: nn.Module) -> dict[str, nn.Module]:
        """:meth:`SmoothingModifier.check_model` (and the older form's quantizer's); in the older form (AWQ
        quantizes), fused mixture-of-experts weights no mapping reaches that its quantizer would quantize are refused
        (the newer form's are refused by :meth:`check_stage`, which knows the stage's quantizers).

        Raises:
            ValueError: as the base classes; or (older form) the model keeps fused experts (transformers 5's experts
                classes, DBRX) that no resolved mapping smooths and that ``ignore`` does not leave out
                (:func:`~llmc_fsm_quantization.mappings.moe_mapping_problem` says why the default mappings leave
                them out: GPT-OSS's biased, clamped gate, DBRX's layout, gateless experts whose activation is not
                relu2, a block module that is neither an expert, the router, a shared expert nor its gate), so they
                would be quantized unsmoothed.
        """
        _, left = self._experts_outside_mappings(model)
        if left and self._quantizer is not None:  # the older form: its quantizer's selection (AWQ's ignore)
            left = _quantized_experts(left, self._quantizer_selection(model))
            if left:
                raise ValueError(self._experts_refusal(model, left))
        targets = super().check_model(model)
        if self._quantizer is not None:
            with _as_awq():
                targets.update(self._quantizer.check_model(model))
        return targets

    def _unreached_experts(self, model: nn.Module, fused: dict[str, nn.Module]) -> dict[str, nn.Module]:
        """Those of ``fused`` (fused experts modules) some of whose expert matrices no resolved mapping reaches."""
        if not fused:
            return {}
        try:
            reached = {id(b) for mapping in self.resolve(model) for b in mapping.balances}
        except ValueError:  # no default mapping fits at all: the experts are named first
            if self.mappings is not None:  # a recipe mapping that does not fit: its own message
                raise
            reached = set()
        return {n: m for n, m in fused.items() if not all(id(v) in reached for v in weight_views(m).values())}

    def _experts_outside_mappings(self, model: nn.Module) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
        """``({name: fused experts module}, those of them no mapping reaches that AWQ's ``ignore`` does not leave
        out)``: ignored by the module's name, a module's around it, or every expert matrix's (found by a tester:
        experts in ``ignore``, as the refusal advised, were refused again)."""
        fused = {n: m for n, m in model.named_modules() if weight_views(m) and "" not in weight_views(m)}
        left = self._unreached_experts(model, fused)
        return fused, {n: m for n, m in left.items() if not _ignored_experts(model, n, m, self.ignore)}

    def _quantizer_selection(self, model: nn.Module) -> set[str]:
        """The names the older form's quantizer selects in ``model`` (its targets and AWQ's ``ignore``; pure);
        targets that select nothing usable: every name (its own check refuses them)."""
        quantizer = self._quantizer
        try:
            selection = select_targets(
                model,
                quantizer.targets,
                quantizer.ignore,
                supported=quantizer._selectable,
                views=quantizer.compresses_views,
            )
        except ValueError:
            return {name for name, _ in model.named_modules()} | {
                f"{name}.{suffix}" for name, module in model.named_modules() for suffix in weight_views(module)
            }
        return set(selection.selected)

    def _experts_refusal(self, model: nn.Module, left: dict[str, nn.Module]) -> str:
        """Why fused experts ``left`` (no mapping reaches them) cannot be run through AWQ, and what to do."""
        family = model_family(model)
        name = next(iter(left))
        block, _, leaf = name.rpartition(".")
        parent = model.get_submodule(block)
        why = moe_mapping_problem(parent, leaf, moe_router(parent, leaf)) or (
            "the default mappings smooth a block read from post_attention_layernorm; recipe mappings must "
            "list every expert matrix, e.g. post_attention_layernorm -> 're:.*mlp.gate$', "
            "'re:.*mlp.experts.*.gate_proj$', 're:.*mlp.experts.*.up_proj$' and 're:.*up_proj$' -> "
            "'re:.*down_proj$'"
        )
        try:  # can another quantizer take them (GPT-OSS, DBRX: no layout transformers reloads)?
            if linear_expert_names(model, name, left[name]) is None:  # Llama 4: reloaded as Linears
                expert_checkpoint_names(model, name, left[name])
            advice = (
                "so they would be quantized unsmoothed: use GPTQModifier or QuantizationModifier, which "
                "quantize each expert matrix"
            )
        except ValueError as exc:
            advice = f"and no modifier can quantize them so that they reload: {exc}"
        return (
            f"AWQModifier: {family} keeps fused experts in {compact_names(left)} that no smoothing mapping "
            f"reaches ({why}), {advice}"
        )

    def _stage_refusal(self, model: nn.Module, selected: list[tuple[Any, Any]]) -> str | None:
        """Newer form: why one-shot refuses AWQ in a stage whose modifiers' ``check_model`` selected ``selected``
        (:meth:`check_stage`), else ``None``: fused experts no mapping reaches that a quantizer of the stage
        quantizes (or, no quantizer in the stage, that are not ignored); then a stage none of whose modifiers
        quantizes a balance layer of AWQ's mappings."""
        if self._quantizer is not None:
            return None
        quantizers = [
            (modifier, targets)
            for modifier, targets in selected
            if modifier is not self and isinstance(targets, dict) and _quantizes_weights(modifier)
        ]
        _, left = self._experts_outside_mappings(model)
        if left:
            hit = _quantized_experts(left, {name for _, targets in quantizers for name in targets})
            if hit or not quantizers:
                return self._experts_refusal(model, hit or left)
        mappings, unquantized = self._left_unquantized(model, selected)
        if mappings and len(unquantized) == len(mappings):
            return _no_quantizer_message(mappings)
        return None

    # ---- lifecycle ----------------------------------------------------------
    def explain_model(self, model: nn.Module, stage: Sequence[Any] = ()) -> list[str]:
        """:meth:`SmoothingModifier.explain_model`, and a line naming the mappings one-shot will not smooth because
        no quantizing modifier of ``stage`` (AWQ's stage's modifiers) quantizes a balance layer of theirs (the
        quantizer's ``ignore``): explain listed them as if smoothed (found by a tester); where one-shot refuses the
        stage (:meth:`check_stage`), the line says why. Nothing of the stage when one of its modifiers refuses the
        model (explain shows that refusal, which one-shot gives first: a "refused by one-shot" line on AWQ was its
        knock-on, found by a tester). Pure (the stage's modifiers' ``check_model``).

        Raises:
            ValueError: as :meth:`resolve`.
        """
        lines = super().explain_model(model, stage)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if self.mappings is None and model_type in LEFT_OUT_LIKE_LLMCOMPRESSOR:
            lines.append("left out: input_layernorm -> q_proj, k_proj, v_proj (Gemma 3's default, as llm-compressor's)")
        if self._quantizer is not None or not stage:
            return lines
        selected = []
        for modifier in stage:
            try:
                selected.append((modifier, modifier.check_model(model) if modifier is not self else {}))
            except ValueError:  # a modifier that does not fit: explain's checks say so, and one-shot stops there
                return lines
        refusal = self._stage_refusal(model, selected)
        if refusal is not None:  # what check_stage refuses (explain printed the mappings as smoothed)
            lines.append(f"refused by one-shot: {refusal}")
            return lines
        mappings, left = self._left_unquantized(model, selected)
        if left:
            lines.append(
                f"not smoothed: {len(left)} of {len(mappings)} mappings, whose balance layers no modifier of this "
                f"stage quantizes (e.g. {left[0].smooth_name} -> {', '.join(left[0].balance_names)})"
            )
        return lines

    def check_stage(self, model: nn.Module, selected: list[tuple[Any, dict[str, Any]]]) -> None:
        """Before any work (one-shot's checks): in the newer form (a quantizing modifier of the stage carries the
        scheme), refuse fused experts no mapping reaches that a quantizer of the stage quantizes (with no quantizer
        in the stage: that ``ignore`` does not leave out), and a stage none of whose modifiers quantizes a balance
        layer of AWQ's mappings, as :meth:`on_calibration_start` does; there it came after a SpinQuant of the same
        stage had rotated the caller's model (found by a tester). Experts the quantizers' ``ignore`` leaves dense
        are not refused: AWQ smooths the rest (found by a tester: they were refused whatever the ignore, in a loop
        with the refusal's own advice).

        Args:
            selected: ``(modifier, {name: module} its check_model selected)`` for each modifier of the stage.

        Raises:
            ValueError: as :meth:`on_calibration_start`; or fused experts no mapping reaches are quantized (the
                message as :meth:`check_model`'s); or, first, the fold check of a meta model
                (:meth:`SmoothingModifier.check_stage`).
        """
        super().check_stage(model, selected)
        refusal = self._stage_refusal(model, selected)
        if refusal is not None:
            raise ValueError(refusal)

    def _left_unquantized(
        self, model: nn.Module, selected: list[tuple[Any, Any]]
    ) -> tuple[list[ResolvedMapping], list[ResolvedMapping]]:
        """AWQ's mappings in ``model``, and those none of whose balance layers a weight quantizer of ``selected``
        (``(modifier, what its check_model selected)`` of AWQ's stage) quantizes."""
        quantized: set[str] = set()
        for modifier, targets in selected:
            if modifier is not self and isinstance(targets, dict) and _quantizes_weights(modifier):
                quantized.update(targets)
        mappings = self.resolve(model)
        return mappings, [m for m in mappings if not any(name in quantized for name in m.balance_names)]

    def on_initialize(self, state: Any) -> None:
        super().on_initialize(state)
        if self._quantizer is not None:
            with _as_awq():
                self._quantizer.on_initialize(state)

    def on_calibration_start(self, state: Any) -> None:
        """Find, per balance layer, the quantizer's arguments. A mapping none of whose balance layers is quantized
        (e.g. a quantizer's ``ignore`` leaves a layer dense) is not smoothed, as llm-compressor 0.14 skips it: its
        smooth layers are named in a warning and in :attr:`unsmoothed`. Before any work.

        Raises:
            ValueError: no balance layer of any mapping is quantized by a modifier of this stage; or fused experts
                no mapping reaches are quantized by one (as :meth:`check_stage`).
        """
        super().on_calibration_start(state)
        self._quantizers = self._find_quantizers()
        _, experts = self._experts_outside_mappings(state.model) if self._quantizer is None else (None, {})
        hit = {n: m for n, m in experts.items() if any(id(v) in self._quantizers for v in weight_views(m).values())}
        if hit or (experts and not self._quantizers):  # as check_stage (the session API has no one-shot checks)
            raise ValueError(self._experts_refusal(state.model, hit or experts))
        unquantized = [m for m in self._mappings if all(self._quantizers.get(id(b)) is None for b in m.balances)]
        if unquantized and len(unquantized) < len(self._mappings):
            self.unsmoothed = [m.smooth_name for m in unquantized]
            logger.warning(
                "AWQModifier: %d of %d mappings are not smoothed: no modifier of this stage quantizes their balance "
                "layers (e.g. %s, balance layers %s), so smoothing them would change nothing the quantizer sees",
                len(unquantized),
                len(self._mappings),
                unquantized[0].smooth_name,
                ", ".join(unquantized[0].balance_names),
            )
            kept = {id(m) for m in unquantized}
            self._mappings = [m for m in self._mappings if id(m) not in kept]
            unquantized = []
        if unquantized:
            raise ValueError(_no_quantizer_message(unquantized))
        self._all_experts = self._experts_take_every_token()
        if not self._all_experts:
            self._warn_routed_experts()
        self._clip_targets = self._find_clip_targets() if self.apply_clip else {}
        self.clipping_results = {}
        if self._quantizer is not None:
            with _as_awq():
                self._quantizer.on_calibration_start(state)

    def _experts_take_every_token(self) -> bool:
        """``calibrate_all_experts`` as given; left out (``None``): ``true`` when a quantizing modifier of the session
        sets it (the recipe's ``QuantizationModifier`` / ``GPTQModifier``, as docs/oneshot.md advises for
        llm-compressor's ``moe_calibrate_all_experts``), else ``false``."""
        if self.calibrate_all_experts is not None:
            return self.calibrate_all_experts
        binding = self._binding
        session = binding.session() if binding is not None else None
        others = [m for m in session.modifiers if m is not self] if session is not None else []
        return any(getattr(m, "calibrate_all_experts", False) is True for m in others)

    def _warn_routed_experts(self) -> None:
        """One line when a mapping's balance layer is an expert matrix (a fused expert's ``up -> down``): its
        statistics and its search come from the tokens the router sent that expert, where llm-compressor 0.14 by
        default sends every token through every expert (``moe_calibrate_all_experts=True``); the line names
        ``calibrate_all_experts``, which does the same here."""
        routed = [
            m.smooth_name for m in self._mappings if isinstance(m.reader, LinearView) and m.reader.expert is not None
        ]
        if routed:
            logger.warning(
                "AWQModifier: the scales of %d expert mappings (e.g. %s) are searched on the tokens the router sent "
                "each expert; llm-compressor 0.14 gives every expert every calibration token by default "
                "(moe_calibrate_all_experts=True), so these scales differ from its: set calibrate_all_experts: true "
                "on the AWQModifier (or on the stage's quantizing modifier) to calibrate as it does",
                len(routed),
                routed[0],
            )

    def _module_quantizers(self) -> Iterator[tuple[Any, str, nn.Module, tuple[QuantizationArgs, str]]]:
        """``(modifier, name, module, (weight args, observer))`` of every module a quantizing modifier of the session
        (or AWQ's own quantizer) targets, with the weight args of the module's own config group (``scheme_of``):
        the scale and clipping searches took the first group's for every module, so an int8 override of an int4
        recipe was searched (and clipped) on the int4 grid (found by a tester; llm-compressor takes each balance
        layer's own scheme)."""
        others: list[Any] = [self._quantizer] if self._quantizer is not None else []
        binding = self._binding
        session = binding.session() if binding is not None else None
        if session is not None:
            others += [m for m in session.modifiers if m is not self]
        for modifier in others:
            try:
                first = modifier.weight_args
            except (AttributeError, ValueError):  # not a weight quantizer (a pruner; a KV-cache scheme alone)
                continue
            observer = getattr(modifier, "observer", "minmax")
            scheme_of = getattr(modifier, "scheme_of", None)
            for name, module in modifier.resolved_targets.items():
                args = weight_args(scheme_of(name)) if scheme_of is not None else first
                yield modifier, name, module, (args, observer)

    def _find_quantizers(self) -> dict[int, Quantizer]:
        found: dict[int, Quantizer] = {}
        for _, _, module, quantizer in self._module_quantizers():
            found.setdefault(id(module), quantizer)
        return found

    def _find_clip_targets(self) -> dict[str, tuple[nn.Module, tuple[QuantizationArgs, str]]]:
        """The Linears the clipping search serves (quantized by a modifier of the session, not queries/keys), each
        with its own group's weight args.

        Raises:
            ValueError: one is quantized in a form the search cannot serve (:func:`clip_problem`).
        """
        found: dict[str, tuple[nn.Module, tuple[QuantizationArgs, str]]] = {}
        for modifier, name, module, quantizer in self._module_quantizers():
            if name in found or name.rsplit(".", 1)[-1] in NOT_CLIPPED or not hasattr(module, "weight"):
                continue
            problem = clip_problem(quantizer[0])
            if problem is not None:
                msg = (
                    f"AWQModifier: apply_clip searches one clipping range per output row and quantization group, "
                    f"but {modifier.modifier_name()} quantizes {name} with {_format(quantizer[0])} weights: "
                    f"{problem}; use a group or channel weight scheme, or leave apply_clip out"
                )
                raise ValueError(msg)
            found[name] = (module, quantizer)
        return found

    def on_sequential_epoch_end(self, state: Any, modules: Any) -> None:
        if self._quantizer is not None:
            with _as_awq():
                self._quantizer.on_sequential_epoch_end(state, modules)

    def progress_state(self, layer: nn.Module) -> dict[str, Any]:
        """:meth:`SmoothingModifier.progress_state`, with the :attr:`clipping_results` of the layer's Linears and,
        in the older form, the results of the layer's modules quantized by AWQ's own round-to-nearest."""
        out = super().progress_state(layer)
        inside = members(layer)
        out["clipping"] = {
            n: self.clipping_results[n]
            for n, (m, _) in self._clip_targets.items()
            if id(m) in inside and n in self.clipping_results
        }
        if self._quantizer is not None:
            names = [n for n, m in self._quantizer.resolved_targets.items() if id(m) in inside]
            out["quantized"] = {
                "results": {n: attrs.asdict(self._quantizer.results[n]) for n in names if n in self._quantizer.results},
                "skipped": [n for n in names if n in self._quantizer.skipped],
            }
        return out

    def restore_progress_state(self, layer: nn.Module, state: dict[str, Any]) -> None:
        super().restore_progress_state(layer, state)
        self.clipping_results.update(state.get("clipping", {}))
        quantized = state.get("quantized")
        if self._quantizer is not None and quantized is not None:
            self._quantizer.results.update({n: ModuleResult(**f) for n, f in quantized["results"].items()})
            self._quantizer.skipped.extend(n for n in quantized["skipped"] if n not in self._quantizer.skipped)

    def on_calibration_end(self, state: Any) -> None:
        if self._quantizer is not None:
            with _as_awq():
                self._quantizer.on_calibration_end(state)
        super().on_calibration_end(state)

    def on_finalize(self, state: Any) -> None:
        if self._quantizer is not None:
            with _as_awq():
                self._quantizer.on_finalize(state)
            self._quantizer.remove_hooks()
        super().on_finalize(state)

    # ---- the search ---------------------------------------------------------
    def _smooth_layer_mappings(
        self, layer: nn.Module, inputs: list[tuple[tuple[Any, ...], dict[str, Any]]], todo: list[ResolvedMapping]
    ) -> None:
        observer = ActivationObserver(todo, keep=True, all_experts=self._all_experts)
        observer.run(layer, inputs)
        observer.all_reduce()
        observer.check(type(self).__name__)
        with suspended_forward_hooks(layer):
            for mapping in todo:
                self._smooth_mapping(mapping, observer)
        observer.parent_inputs.clear()
        observer.parent_outputs.clear()
        if self._clip_targets:
            self._clip_layer(layer, inputs)

    # ---- clipping -------------------------------------------------------------
    def _clip_layer(self, layer: nn.Module, inputs: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        """Search and apply the clipping ranges of the clip targets inside ``layer`` (already smoothed)."""
        inside = members(layer)
        targets = {n: t for n, t in self._clip_targets.items() if id(t[0]) in inside and n not in self.clipping_results}
        if not targets:
            return
        modules = {n: m for n, (m, _) in targets.items()}
        captured = _capture_inputs(layer, inputs, modules, self.clip_n_sample_token, all_experts=self._all_experts)
        # under torch.distributed: clipped where any rank's tokens reached it (a rank without takes part with none)
        reached = torch.tensor([name in captured for name in targets], dtype=torch.int64)
        all_reduce_tensor(reached, op="max", what="all_reduce (AWQ clip targets)")
        with suspended_forward_hooks(layer):
            for (name, (module, (args, observer))), anywhere in zip(targets.items(), reached.tolist(), strict=True):
                if not anywhere:
                    continue  # no calibration input reached it in this layer's forward: left as it is
                x = captured.get(name)
                if x is None:
                    x = torch.zeros((0, module.weight.shape[1]), dtype=module.weight.dtype)
                self._clip_module(name, module, x, args, observer)

    @torch.no_grad()
    def _clip_module(
        self, name: str, module: nn.Module, x: torch.Tensor, args: QuantizationArgs, observer: str
    ) -> None:
        weight = module.weight
        max_val, index = awq_clip_search(
            weight, x, args, observer, n_grid=self.clip_n_grid, max_shrink=self.clip_max_shrink
        )
        clipped = _clamp_groups(weight, max_val, _clip_group_size(args, weight.shape[1]))
        unclipped_error = _output_error(weight, rtn_quantize(weight, args, observer).weight, x)
        error = _output_error(weight, rtn_quantize(clipped, args, observer).weight, x)
        applied = error < unclipped_error
        if applied:
            weight.copy_(clipped)
        self.clipping_results[name] = {
            "groups": int(index.numel()),
            "groups_clipped": int((index > 0).sum()),
            "shrink_mean": float((1.0 - index.to(torch.float64) / self.clip_n_grid).mean()),
            "tokens": int(
                all_reduce_tensor(torch.tensor([x.shape[0]], dtype=torch.int64), what="all_reduce (AWQ clip)")
            ),
            "error_unclipped": unclipped_error,
            "error": error if applied else unclipped_error,
            "applied": applied,
        }

    def _smooth_mapping(self, mapping: ResolvedMapping, observer: ActivationObserver) -> None:
        name = mapping.smooth_name
        if name not in observer.tokens:  # an expert the router sent no calibration token: nothing to search from
            self.smoothing_results[name] = {
                "balance_layers": list(mapping.balance_names),
                "exponent": None,
                "duo_scaling": None,
                "error_unsmoothed": 0.0,  # a mean over no token
                "error": 0.0,
                "tokens": 0,
                "scale_min": 1.0,
                "scale_max": 1.0,
                "scale_mean": 1.0,
            }
            return
        quantizers = [self._quantizers.get(id(b)) for b in mapping.balances]
        # float32 as llm-compressor's (there summed in float32 batch by batch, in its calibration order; here the
        # float64 sum, the same for any batching and over ranks, rounded once)
        x_mean = (observer.abs_sum[name] / observer.tokens[name]).to(torch.float32)
        # the quantized balance layers' weights only, as llm-compressor 0.14's _compute_layer_means skips a layer
        # without a quantization scheme (an ignored router absorbs the scales but is not in w: found by a tester)
        weighed = [(b, q) for b, q in zip(mapping.balances, quantizers, strict=True) if q is not None]
        weighed = weighed or list(zip(mapping.balances, quantizers, strict=True))
        w_mean = awq_weight_mean([b.weight for b, _ in weighed], [_group_size(q) for _, q in weighed])
        # llm-compressor's grid; its first candidate, (0.0, False), is s = 1: scored as no smoothing (None)
        grid = awq_grid(self.duo_scaling, self.n_grid)[1:]
        evaluate: _BlockError | _GramError
        inputs = observer.parent_inputs.get(name, [])  # none on a rank whose tokens did not reach this expert
        if (
            _GramError.serves(mapping)
            and quantizers[0] is not None
            and _GramError.cheaper(mapping, inputs, len(grid) + 1)
        ):
            evaluate = _GramError(mapping, quantizers[0], inputs)
        else:
            evaluate = _BlockError(
                mapping,
                quantizers,
                inputs,
                observer.parent_outputs.get(name, []),
                sample_tokens=self.search_n_sample_token,
            )
        try:
            errors = evaluate.search(
                [None, *(awq_candidate_scales(x_mean, w_mean if duo else None, ratio) for ratio, duo in grid)]
            )
        finally:
            evaluate.restore()
        unsmoothed = errors[0]
        best: tuple[float, float | None, bool | None, torch.Tensor | None] = (unsmoothed, None, None, None)
        for position, (ratio, duo) in enumerate(grid, start=1):
            error = errors[position]
            if error is not None and error < best[0]:
                best = (error, ratio, duo, awq_candidate_scales(x_mean, w_mean if duo else None, ratio))
        error, ratio, duo, scales = best
        if scales is not None:
            fold_scales(mapping, scales)
            self.smoothing_scales[name] = scales
        stats = _scale_stats(scales) if scales is not None else {"scale_min": 1.0, "scale_max": 1.0, "scale_mean": 1.0}
        self.smoothing_results[name] = {
            "balance_layers": list(mapping.balance_names),
            "exponent": ratio,
            "duo_scaling": duo,
            "tokens": observer.tokens[name],
            "error_unsmoothed": unsmoothed,
            "error": error,
            **stats,
        }


def _capture_inputs(
    layer: nn.Module,
    inputs: list[tuple[tuple[Any, ...], dict[str, Any]]],
    modules: dict[str, nn.Module],
    n_sample_token: int,
    *,
    all_experts: bool = False,
) -> dict[str, torch.Tensor]:
    """Every ``k``-th calibration token's input of each of ``modules`` (``[tokens, in]`` float32), ``k = max(1,
    N // n_sample_token)``, ``N`` the layer's calibration tokens (every rank's, counted in the order of one process:
    each rank keeps its share of the same tokens); one forward of ``layer`` with only these hooks. Each module counts
    the tokens it receives (an expert: those routed to it) from where its own tokens on the lower ranks end: under
    ``torch.distributed`` with ``k > 1`` one more forward counts them first (found by a tester: every module started
    at the layer's count, so an expert on rank 1 sampled other tokens than one process)."""
    local = 0
    for args, kwargs in inputs:
        hidden = args[0] if args else kwargs["hidden_states"]
        local += hidden.numel() // hidden.shape[-1]
    counts = [c for (c,) in all_gather_ints([local], what="all_gather (AWQ clip tokens)")]  # [local] in one process
    step = max(1, sum(counts) // n_sample_token)
    sources = {id(m.source): m.source for m in modules.values() if isinstance(m, LinearView) and m.expert is not None}
    observe = _observe_every_token if all_experts else _observe_routed

    def run(hook_for: Callable[[str], Any]) -> None:
        with suspended_forward_hooks(layer):
            handles = [module.register_forward_pre_hook(hook_for(name)) for name, module in modules.items()]
            handles += [s.register_forward_pre_hook(observe, with_kwargs=True) for s in sources.values()]
            try:
                for args, kwargs in inputs:
                    layer(*args, **kwargs)
            finally:
                for handle in handles:
                    handle.remove()

    names = list(modules)
    seen: dict[str, int] = dict.fromkeys(names, 0)
    if is_distributed() and step > 1:  # where each module's tokens start in one process's order
        rows: dict[str, int] = dict.fromkeys(names, 0)

        def counter(name: str) -> Any:
            def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
                rows[name] += args[0].numel() // args[0].shape[-1]

            return hook

        run(counter)
        below = all_gather_ints([rows[n] for n in names], what="all_gather (AWQ clip tokens)")[: get_rank()]
        seen = {n: sum(r[i] for r in below) for i, n in enumerate(names)}
    kept: dict[str, list[torch.Tensor]] = {}

    def sampler(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            flat = args[0].detach().reshape(-1, args[0].shape[-1])
            offset = seen[name]
            first = (-offset) % step
            kept.setdefault(name, []).append(flat[first::step].to(torch.float32))
            seen[name] = offset + flat.shape[0]

        return hook

    run(sampler)
    return {name: torch.cat(parts) for name, parts in kept.items()}


def _group_size(quantizer: Quantizer) -> int | tuple[int, int] | None:
    """The quantization group of ``quantizer``'s weights in :func:`awq_weight_mean`'s terms (``None``: per row,
    also for an unquantized balance layer)."""
    if quantizer is None:
        return None
    args = quantizer[0]
    if args.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
        return int(args.group_size)
    if args.strategy == QuantizationStrategy.BLOCK:
        height, width = args.block_structure
        return (int(height), int(width))
    return 0 if args.strategy == QuantizationStrategy.TENSOR else None


def _split_windows(
    parent: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], ref: torch.Tensor
) -> list[tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]]:
    """One cached batch of a block's inputs and float output, cut into chunks the block computes independently.

    A batch of windows ``[B, T, C]`` gives one chunk per window: every tensor argument whose first dimension is ``B``
    (and has at least 2 dimensions: masks, position ids, rotary tables) is cut along it, the others (broadcast
    tensors, flags) are passed whole. The ``[N, C]`` tokens of a Linear or an expert matrix's view give chunks of
    :data:`_CHUNK_ROWS` rows. Anything else (an argument of another type, such as a cache) stays one chunk.
    """
    hidden = args[0] if args else kwargs.get("hidden_states")
    whole = [(args, kwargs, ref)]
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or ref.shape[0] != hidden.shape[0]:
        return whole
    rows = hidden.shape[0]
    if hidden.dim() == 2:
        if not isinstance(parent, LinearView | nn.Linear) or kwargs:
            return whole
        return [((hidden[i : i + _CHUNK_ROWS],), {}, ref[i : i + _CHUNK_ROWS]) for i in range(0, rows, _CHUNK_ROWS)]
    if rows == 1 or not all(_cuttable(v) for v in (*args, *kwargs.values())):
        return whole

    def cut(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor):
            return value[i : i + 1] if value.dim() >= 2 and value.shape[0] == rows else value
        if isinstance(value, tuple | list):
            return type(value)(cut(v, i) for v in value)
        return value

    return [
        (tuple(cut(a, i) for a in args), {k: cut(v, i) for k, v in kwargs.items()}, ref[i : i + 1]) for i in range(rows)
    ]


#: bytes of quantized candidate weights the grid search keeps between its first pass over the candidates and the rest.
_KEPT_BYTES = 32 * 2**20

#: rows (tokens) per chunk of a Linear's ``[N, C]`` inputs in the error evaluation.
_CHUNK_ROWS = 256


def _cuttable(value: Any) -> bool:
    if isinstance(value, tuple | list):
        return all(_cuttable(v) for v in value)
    return value is None or isinstance(value, torch.Tensor | bool | int | float | str)


class _BlockError:
    """Mean squared difference between a mapping's block output on the cached inputs and the float output,
    with the quantized balance layers' weights replaced by ``Q(W diag(s)) diag(s)^-1`` (``s`` ``None``: ``Q(W)``).

    The cached batches are evaluated in chunks (one calibration window each, :func:`_split_windows`), for every
    candidate in the same order (that of the first candidate's errors per chunk, largest first), and a candidate's
    error is the float64 sum of its chunks' squared differences in that order divided by
    the element count. :meth:`search` scores a grid of candidates by branch and bound: the sum is non-decreasing chunk
    by chunk, so a candidate whose partial sum already exceeds the best complete one's cannot be chosen and is not
    evaluated further. The choice (lowest error, the earliest candidate on ties) is the one a full evaluation of every
    candidate gives.
    """

    def __init__(
        self,
        mapping: ResolvedMapping,
        quantizers: list[Quantizer],
        inputs: list[tuple[tuple[Any, ...], dict[str, Any]]],
        outputs: list[torch.Tensor],
        *,
        sample_tokens: int | None = None,
    ) -> None:
        """``sample_tokens``: keep every ``k``-th chunk, ``k = max(1, N // sample_tokens)`` (``N``: the cached
        tokens; ``None``: every chunk)."""
        self.mapping = mapping
        self.quantizers = quantizers
        self.chunks = [
            chunk
            for (args, kwargs), ref in zip(inputs, outputs, strict=True)
            for chunk in _split_windows(mapping.parent, args, kwargs, ref)
        ]
        if sample_tokens is not None:
            tokens = sum(ref.numel() // max(ref.shape[-1], 1) for _, _, ref in self.chunks)
            self.chunks = self.chunks[:: max(1, tokens // sample_tokens)]
        self.count = sum(ref.numel() for _, _, ref in self.chunks)
        self.originals = [b.weight.detach().clone() for b in mapping.balances]
        self._kept: dict[int, list[torch.Tensor | None]] = {}
        self._kept_bytes = 0

    @torch.no_grad()
    def _set(self, scales: torch.Tensor | None, *, keep: int | None = None) -> None:
        """Put candidate ``scales``' quantized weights into the balance layers; ``keep``: remember them under this
        key while :data:`_KEPT_BYTES` allows (a candidate set again is then copied, not quantized again)."""
        kept = self._kept.get(keep) if keep is not None else None
        if kept is None:
            kept = [self._quantized(w, q, scales) for w, q in zip(self.originals, self.quantizers, strict=True)]
            size = sum(t.numel() * t.element_size() for t in kept if t is not None)
            if keep is not None and self._kept_bytes + size <= _KEPT_BYTES:
                self._kept[keep] = kept
                self._kept_bytes += size
        for balance, w in zip(self.mapping.balances, kept, strict=True):
            if w is not None:
                balance.weight.copy_(w)

    @staticmethod
    def _quantized(w: torch.Tensor, quantizer: Quantizer, scales: torch.Tensor | None) -> torch.Tensor | None:
        """``Q(W diag(s)) diag(s)^-1`` in ``w``'s dtype (``s`` ``None``: ``Q(W)``; no quantizer: ``None``)."""
        if quantizer is None:
            return None
        args, observer = quantizer
        if scales is None:
            return rtn_quantize(w, args, observer).weight
        wf = w.to(torch.float32)
        s = scales.to(wf.device)[None, :]
        q = rtn_quantize((wf * s).to(w.dtype), args, observer).weight.to(torch.float32)
        return (q / s).to(w.dtype)

    @torch.no_grad()
    def _chunk(self, k: int) -> float:
        args, kwargs, ref = self.chunks[k]
        out = block_output(self.mapping.parent, args, kwargs)
        return float((out.to(torch.float32) - ref.to(torch.float32)).pow_(2).sum(dtype=torch.float64))

    @torch.no_grad()
    def restore(self) -> None:
        """Put the balance layers' original weights back."""
        for balance, w in zip(self.mapping.balances, self.originals, strict=True):
            balance.weight.copy_(w)

    def search(self, candidates: list[torch.Tensor | None]) -> list[float | None]:
        """Errors of ``candidates`` (scales, or ``None`` for no smoothing), ``None`` where pruned (see the class).

        The first candidate is always evaluated in full. Under ``torch.distributed`` every candidate is evaluated in
        full and its sums are added over the ranks (every rank then chooses the same). The balance layers hold the
        last candidate's weights afterwards: call :meth:`restore`.
        """
        n = len(self.chunks)
        errors: list[float | None] = [None] * len(candidates)
        if is_distributed():
            for i, scales in enumerate(candidates):
                self._set(scales)
                total = sum((self._chunk(k) for k in range(n)), 0.0)
                sums = torch.tensor([total, float(self.count)], dtype=torch.float64)
                sums = all_reduce_tensor(sums, what="all_reduce (AWQ error)")
                errors[i] = float(sums[0]) / max(float(sums[1]), 1.0)
            return errors
        count = max(float(self.count), 1.0)
        partial = [0.0] * len(candidates)
        done = [0] * len(candidates)
        self._set(candidates[0])
        first = [self._chunk(k) for k in range(n)]
        # every candidate's windows in the order of the first candidate's errors, largest first: the partial sums
        # then reach a losing candidate's bound sooner
        order = sorted(range(n), key=lambda k: (-first[k], k))
        for k in order:
            partial[0] += first[k]
        done[0] = n
        errors[0] = partial[0] / count
        best = (errors[0], 0)

        def beaten(i: int) -> bool:
            e = partial[i] / count
            return e > best[0] or (e == best[0] and i > best[1])

        # every other candidate's first chunk, then the candidates in the order of that partial error
        current = 0
        for i in range(1, len(candidates)):
            if n:
                self._set(candidates[i], keep=i)
                current = i
                partial[i] = self._chunk(order[0])
                done[i] = 1
        for i in sorted(range(1, len(candidates)), key=lambda j: (partial[j], j)):
            if beaten(i):
                continue
            if current != i:
                self._set(candidates[i], keep=i)
                current = i
            while done[i] < n and not beaten(i):
                partial[i] += self._chunk(order[done[i]])
                done[i] += 1
            if done[i] == n:
                errors[i] = partial[i] / count
                if (errors[i], i) < best:
                    best = (errors[i], i)
        return errors


class _GramError:
    """The block error of a mapping whose block is its one balance Linear (``v -> o``, ``up -> down``, an expert's
    ``up -> down``), from the Gram matrix of its inputs instead of a forward per candidate.

    With ``X`` the ``[N, in]`` calibration inputs and ``dW = Q(W diag(s)) diag(s)^-1 - W`` (``[out, in]``), the
    block's output error is ``sum((X dW^T) ** 2) = tr(dW H dW^T)``, ``H = X^T X`` (the bias cancels). ``H`` is
    accumulated once (products in float32, float64 for a float64 model, per cached batch; summed in float64, and
    over the ranks under ``torch.distributed``) and factored once as ``H = L L^T`` (float64 Cholesky; where ``H`` is
    singular, ``L = V diag(sqrt(max(e, 0)))`` from its eigendecomposition); each candidate then costs
    ``sum((dW L) ** 2)`` (products in that dtype, float64 sum): ``out * in^2`` multiply-adds instead of
    ``N * in * out``, every candidate scored in full (no pruning). Divided by ``N * out`` as :class:`_BlockError`'s
    errors; equal to the forward's up to float rounding (the forward's rounding of the output to the model's dtype,
    bfloat16 say, is not in it). Taken where it costs fewer multiply-adds than the forwards (:meth:`cheaper`).
    """

    def __init__(
        self, mapping: ResolvedMapping, quantizer: Quantizer, inputs: list[tuple[tuple[Any, ...], dict[str, Any]]]
    ) -> None:
        self.weight = mapping.balances[0].weight.detach()
        self.quantizer = quantizer
        #: the products' dtype: float32, float64 for a float64 model
        self.dtype = torch.float64 if self.weight.dtype == torch.float64 else torch.float32
        cols = self.weight.shape[1]
        gram = torch.zeros(cols, cols, dtype=torch.float64, device=self.weight.device)
        tokens = 0
        for args, kwargs in inputs:
            x = (args[0] if args else kwargs["input"]).detach().reshape(-1, cols).to(self.dtype)
            gram += (x.T @ x).to(torch.float64)
            tokens += x.shape[0]
        gram = all_reduce_tensor(gram, what="all_reduce (AWQ Gram matrix)")
        sums = all_reduce_tensor(torch.tensor([float(tokens)], dtype=torch.float64), what="all_reduce (AWQ Gram)")
        self.count = max(float(sums[0]) * self.weight.shape[0], 1.0)
        factor, info = torch.linalg.cholesky_ex(gram)
        if int(info) != 0:  # singular (fewer tokens than inputs, a dead channel): H = V diag(e) V^T, e >= 0
            values, vectors = torch.linalg.eigh(gram)
            factor = vectors * values.clamp_min(0.0).sqrt()[None, :]
        self.factor = factor.to(self.dtype)

    @staticmethod
    def serves(mapping: ResolvedMapping) -> bool:
        """Whether the mapping's block is its single balance layer, a Linear (or an expert matrix's view)."""
        return (
            len(mapping.balances) == 1
            and mapping.parent is mapping.balances[0]
            and isinstance(mapping.parent, nn.Linear | LinearView)
        )

    @staticmethod
    def cheaper(
        mapping: ResolvedMapping, inputs: list[tuple[tuple[Any, ...], dict[str, Any]]], candidates: int
    ) -> bool:
        """Whether the Gram path costs fewer multiply-adds than forwards of every candidate over the tokens:
        ``N in^2 + in^3 + c out in^2 < c N in out`` (``N`` the tokens, summed over the ranks under
        ``torch.distributed`` so every rank takes the same path; ``c`` the candidates). False for an expert few
        tokens reach (``N`` about ``in`` or below)."""
        out, cols = mapping.balances[0].weight.shape
        local = sum((a[0] if a else k["input"]).numel() // cols for a, k in inputs)
        tokens = float(all_reduce_tensor(torch.tensor([float(local)], dtype=torch.float64), what="all_reduce (AWQ)"))
        return tokens * cols**2 + cols**3 + candidates * out * cols**2 < candidates * tokens * cols * out

    @torch.no_grad()
    def error(self, scales: torch.Tensor | None) -> float:
        """``tr(dW H dW^T) / (N * out)`` for candidate ``scales`` (``None``: no smoothing)."""
        quantized = _BlockError._quantized(self.weight, self.quantizer, scales)
        delta = quantized.to(self.dtype) - self.weight.to(self.dtype)
        return float((delta @ self.factor).pow_(2).sum(dtype=torch.float64)) / self.count

    def search(self, candidates: list[torch.Tensor | None]) -> list[float | None]:
        """Every candidate's error (none pruned; the balance layer's weight is not touched)."""
        return [self.error(scales) for scales in candidates]

    def restore(self) -> None:
        """Nothing to put back (the interface of :class:`_BlockError`)."""
