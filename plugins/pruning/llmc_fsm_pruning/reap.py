"""REAPPruningModifier: drop whole experts of mixture-of-experts layers by router-weighted expert activation.

REAP (Router-weighted Expert Activation Pruning, Lasby et al., arXiv 2510.13999, Sec. 3) scores expert ``j`` of a
layer by the mean, over the calibration tokens the router sends to ``j``, of ``g_j(x) * ||f_j(x)||_2``: the router's
gate weight for ``j`` (the coefficient that multiplies the expert's output when the layer combines its top-k
experts) times the L2 norm of the expert's output on that token. The lowest-scoring experts of each layer are
removed: their slices of the fused expert parameters (``gate_up_proj`` / ``down_proj`` ``[experts, ...]`` and any
per-expert bias) and their rows of the router's weight (and bias, and score-correction bias) are cut out, so the
router chooses its top-k among the experts kept and the saved model is smaller and reloads with transformers.

Recipe arguments are llm-compressor's (``REAPPruningModifier``: ``sparsity``, ``ignore``, ``report_path``).
Supported: transformers 5 fused experts of a known layout (``use_experts_implementation``: Mixtral, Qwen3-MoE and
the others with ``gate_up_proj`` / ``down_proj`` 3-D parameters) next to a Linear-like router (``gate`` or
``router``); refused before any work: other expert classes (DBRX, Llama 4, ...), expert-parallel experts,
group-limited routing (DeepSeek-V3's ``n_group > 1``) and ``torch.distributed`` runs.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn import functional as F

from llmc_fsm import Modifier
from llmc_fsm.toolkit import clear_weight_views, fused_experts_reason, is_distributed, is_main_process, weight_views

__all__ = ["MoeBlock", "REAPPruningModifier", "expert_outputs", "find_moe_blocks", "retained_experts"]

logger = logging.getLogger(__name__)

_LAYOUT_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "num_experts")
_ROUTER_ATTRS = ("gate", "router")
#: config keys holding the number of routed experts per layer (the first one present is updated).
_NUM_EXPERTS_KEYS = ("num_local_experts", "num_experts", "moe_num_experts", "n_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "top_k", "moe_top_k")


@attrs.frozen
class MoeBlock:
    """One mixture-of-experts layer REAP prunes.

    Attributes:
        name: the block's full module name (``model.layers.0.mlp``).
        block: the block (``MixtralSparseMoeBlock``...).
        experts: its fused-experts module (``block.experts``).
        router: its router (``block.gate`` or ``block.router``), weight ``[num_experts, hidden]``.
        router_attr: ``"gate"`` or ``"router"``.
    """

    name: str
    block: nn.Module
    experts: nn.Module
    router: nn.Module
    router_attr: str


def _is_fused_experts(module: nn.Module) -> bool:
    return all(hasattr(module, flag) for flag in _LAYOUT_FLAGS)


def _ignored(name: str, ignore: list[str]) -> bool:
    """llm-compressor's REAP ``ignore``: regular expressions searched in the block's name (``re:`` prefix allowed)."""
    return any(re.search(p.removeprefix("re:"), name) for p in ignore)


def find_moe_blocks(model: nn.Module, ignore: list[str] | None = None) -> list[MoeBlock]:
    """The mixture-of-experts blocks of ``model`` REAP can prune, or a ``ValueError`` naming why not.

    A block is a module with an ``experts`` child; its experts must be transformers' fused experts of a known
    layout (the ``use_experts_implementation`` flags, 3-D parameters matching them, not expert-parallel:
    :func:`llmc_fsm.toolkit.fused_experts_reason`) and it must have a ``gate`` / ``router`` child with a 2-D
    weight of ``num_experts`` rows. Blocks whose name matches ``ignore`` (regular expressions, searched) are left out.

    Raises:
        ValueError: a block that does not qualify (naming it, its experts class and why), or no block at all.
    """
    blocks = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, nn.Module) or _ignored(name, ignore or []):
            continue
        cls = type(experts).__name__
        if not _is_fused_experts(experts):
            msg = (
                f"REAPPruningModifier: {name}.experts ({cls}) is not transformers' fused experts of a known layout "
                "(3-D gate_up_proj/down_proj built with use_experts_implementation); expert pruning is implemented "
                f"only for those: ignore the block (ignore: ['{name}']) or use another model"
            )
            raise ValueError(msg)
        reason = fused_experts_reason(experts)
        if reason is not None:
            msg = f"REAPPruningModifier: {name}.experts ({cls}): {reason}; expert pruning is not implemented for it"
            raise ValueError(msg)
        count = experts.num_experts
        found = None
        for attr in _ROUTER_ATTRS:
            router = getattr(module, attr, None)
            weight = getattr(router, "weight", None)
            if isinstance(router, nn.Module) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
                if weight.shape[0] == count:
                    found = MoeBlock(name, module, experts, router, attr)
                    break
        if found is None:
            msg = (
                f"REAPPruningModifier: {name} has no router (gate or router) with a 2-D weight of {count} rows "
                "next to its experts; expert pruning needs the router's rows to drop"
            )
            raise ValueError(msg)
        blocks.append(found)
    if not blocks:
        msg = (
            f"REAPPruningModifier: {type(model).__name__} has no mixture-of-experts block (a module with fused "
            "'experts' and a 'gate'/'router') outside ignore; REAP prunes experts, use another pruning modifier"
        )
        raise ValueError(msg)
    return blocks


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = getattr(config, "get_text_config", None)
    return text() if callable(text) else config


def _routing_args(experts: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """``[hidden [tokens, hidden], top_k_index [tokens, k], top_k_weights [tokens, k]]`` from an experts call."""
    if len(args) >= 3:
        return list(args[:3])
    forward = getattr(type(experts).forward, "__wrapped__", type(experts).forward)
    names = [p for p in inspect.signature(forward).parameters if p != "self"][:3]
    return list(args) + [kwargs[n] for n in names[len(args) :]]


def _linear(experts: nn.Module, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
    w = getattr(experts, name)[e]
    bias = getattr(experts, f"{name}_bias")[e] if experts.has_bias else None
    return F.linear(x, w.T if experts.is_transposed else w, bias)


def expert_outputs(experts: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s output on tokens ``x`` ``[n, hidden]``: ``[n, hidden]``, before the router's gate weight.

    Computed from the fused parameters with the module's own gate (``_apply_gate``: gated experts) or ``act_fn``,
    biases included, in the parameters' dtype.
    """
    if experts.has_gate:
        h = experts._apply_gate(_linear(experts, x, "gate_up_proj", e))
    else:
        h = experts.act_fn(_linear(experts, x, "up_proj", e))
    return _linear(experts, h, "down_proj", e)


def retained_experts(scores: torch.Tensor, num_drop: int) -> list[int]:
    """Indices of the experts kept (ascending) when the ``num_drop`` lowest ``scores`` ``[experts]`` are dropped.

    Ties drop the lower index first (a stable sort).
    """
    order = torch.argsort(scores, stable=True)
    drop = set(order[:num_drop].tolist())
    return [i for i in range(scores.numel()) if i not in drop]


def _slice_rows(module: nn.Module, name: str, keep: torch.Tensor, count: int) -> None:
    """Replace ``module.<name>`` (a parameter or buffer with ``count`` leading rows, or ``[1, count]``: Ernie 4.5's
    ``moe_statics.e_score_correction_bias``) by its rows (columns) ``keep``."""
    value = getattr(module, name, None)
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return
    if value.dim() == 2 and value.shape == (1, count) and count != 1:
        rows = value.detach()[:, keep.to(value.device)].clone()
    elif value.shape[0] == count:
        rows = value.detach()[keep.to(value.device)].clone()
    else:
        return
    if isinstance(value, nn.Parameter):
        setattr(module, name, nn.Parameter(rows, requires_grad=value.requires_grad))
    else:
        setattr(module, name, rows)


def _set_count(module: nn.Module, count: int) -> None:
    for key in ("num_experts", "n_routed_experts", "out_features"):
        if isinstance(getattr(module, key, None), int) and not isinstance(getattr(module, key), bool):
            setattr(module, key, count)


def _check_sparsity(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value < 1.0:
        msg = f"sparsity must be a fraction of experts in (0, 1), got {value!r}"
        raise ValueError(msg)


def _check_report_path(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value.endswith(".json")):
        msg = f"report_path must be a path ending with .json, got {value!r}"
        raise ValueError(msg)


def _ignore_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        msg = f"ignore must be a list of regular expressions, got {value!r}"
        raise TypeError(msg)
    return list(value)


def _refuse_distributed() -> None:
    if is_distributed():
        msg = (
            "REAPPruningModifier: torch.distributed runs are not implemented (scores are not reduced); "
            "run on one process"
        )
        raise ValueError(msg)


@attrs.define(kw_only=True, slots=False, eq=False)
class REAPPruningModifier(Modifier):
    """Drop the lowest-REAP-scoring experts of every mixture-of-experts layer (arXiv 2510.13999).

    Score of expert ``j`` (float64): ``S_j = sum_x g_j(x) * ||f_j(x)||_2 / n_j`` over the ``n_j`` calibration
    tokens the router sends to ``j`` (``g_j``: its top-k gate weight as the experts module receives it; ``f_j``:
    its output ``[hidden]``); an expert no token reaches scores 0. Per layer, ``int(num_experts * sparsity)``
    experts with the lowest scores are dropped (ties: lower index first), each layer when the sequential pipeline
    finishes it (so the next layers calibrate on the pruned layer's outputs); the model config's expert count
    (``num_local_experts`` / ``num_experts`` / ...) is updated once every layer is pruned.

    Recipe arguments (llm-compressor's):

    - ``sparsity``: fraction of experts dropped per layer, in ``(0, 1)``; must drop at least one and keep at least
      the router's top-k.
    - ``ignore``: regular expressions searched in the MoE block names (``model.layers.0.mlp``; a ``re:`` prefix is
      allowed); matching blocks are left whole. Default: none. Leaving whole a block of the same size as the pruned
      ones is refused (the config holds one expert count: the model would not reload).
    - ``report_path``: a ``.json`` file written at finalize: ``{block name: [kept expert indices]}``.

    Requires state ``model`` and ``calibration_data``. After calibration: :attr:`scores` (``{block: [S_j]}``),
    :attr:`expert_tokens` (``{block: [n_j]}``), :attr:`retained` (``{block: [kept original indices]}``).

    Raises (``check_model`` / ``initialize``, before any work): ``ValueError`` for a model without supported
    fused experts (naming the block and why), group-limited routing, a sparsity dropping no expert or keeping
    fewer than top-k, no config key for the expert count, or a ``torch.distributed`` run; at ``calibration_start``,
    before any weight changes: another modifier of the same stage targeting modules of the blocks that cannot follow
    the experts' renumbering, or that comes before REAP (put REAP in its own stage before it, or first).

    In one stage with a calibrated modifier after it (``GPTQModifier``, ``QuantizationModifier``, SparseGPT, Wanda:
    llm-compressor's ``examples/reap_expert_pruning/qwen38_example.py`` quantizes in REAP's stage), each layer
    calibrates once with all its experts: REAP's scores and the other modifier's statistics come from that same
    forward (the experts' inputs routed by the unpruned router). At the layer's end REAP drops its experts first, the
    other modifier renumbers its targets and statistics to the experts kept
    (:meth:`llmc_fsm.toolkit.CalibratedModifier.follow_expert_drop`) and compresses them, and the next layer
    calibrates on the pruned and compressed layer's output, as llm-compressor's sequential pipeline does for GPTQ.
    (Round-to-nearest: llm-compressor rounds the weights only when it saves, so its next layers calibrate on the
    pruned layer's full-precision weights; here on its rounded ones, as for any modifier that changes the layer's
    structure: REAP's pruning must reach the next layer's inputs.)
    """

    required_state = frozenset({"model", "calibration_data"})

    sparsity: float = attrs.field(validator=_check_sparsity)
    ignore: list[str] = attrs.field(factory=list, converter=_ignore_list)
    report_path: str | None = attrs.field(default=None, validator=_check_report_path)

    scores: dict[str, list[float]] = attrs.field(factory=dict, init=False)
    expert_tokens: dict[str, list[int]] = attrs.field(factory=dict, init=False)
    retained: dict[str, list[int]] = attrs.field(factory=dict, init=False)
    _blocks: list[MoeBlock] = attrs.field(factory=list, init=False, repr=False)
    _sums: dict[str, torch.Tensor] = attrs.field(factory=dict, init=False, repr=False)
    _counts: dict[str, torch.Tensor] = attrs.field(factory=dict, init=False, repr=False)
    _num_experts: int = attrs.field(default=0, init=False, repr=False)
    _num_drop: int = attrs.field(default=0, init=False, repr=False)
    _config_key: str | None = attrs.field(default=None, init=False, repr=False)
    _model: Any = attrs.field(default=None, init=False, repr=False)
    _followers: list[Any] = attrs.field(factory=list, init=False, repr=False)

    @property
    def resolved_targets(self) -> dict[str, nn.Module]:
        """``{name: module}``: the experts modules and routers of the blocks to prune (empty before initialize)."""
        out: dict[str, nn.Module] = {}
        for b in self._blocks:
            out[f"{b.name}.experts"] = b.experts
            out[f"{b.name}.{b.router_attr}"] = b.router
        return out

    @property
    def expert_pruning_results(self) -> dict[str, dict[str, Any]]:
        """``{block: {"kept": former indices of the experts kept, in their new order, "scores": [S_j], "routed_tokens":
        [n_j]}}`` per pruned block (the one-shot report's ``expert_pruning``)."""
        return {
            name: {"kept": kept, "scores": self.scores[name], "routed_tokens": self.expert_tokens[name]}
            for name, kept in self.retained.items()
        }

    def _plan(self, model: nn.Module) -> tuple[list[MoeBlock], int, int, str]:
        """Blocks, experts per block, experts to drop, config key; ``ValueError`` naming what is not supported."""
        blocks = find_moe_blocks(model, self.ignore)
        counts = {b.experts.num_experts for b in blocks}
        if len(counts) != 1:
            msg = f"REAPPruningModifier: the MoE blocks have different expert counts {sorted(counts)}; not supported"
            raise ValueError(msg)
        (count,) = counts
        config = _text_config(model)
        n_group = getattr(config, "n_group", None)
        if isinstance(n_group, int) and n_group > 1:
            msg = (
                f"REAPPruningModifier: group-limited routing (n_group={n_group}) is not implemented; "
                "expert pruning is refused for this model"
            )
            raise ValueError(msg)
        key = next((k for k in _NUM_EXPERTS_KEYS if getattr(config, k, None) == count), None)
        if key is None:
            msg = (
                f"REAPPruningModifier: the model config has no expert count ({', '.join(_NUM_EXPERTS_KEYS)}) equal to "
                f"the {count} experts per block; the pruned model would not reload"
            )
            raise ValueError(msg)
        left = [
            n
            for n, m in model.named_modules()
            if _ignored(n, self.ignore) and getattr(getattr(m, "experts", None), "num_experts", None) == count
        ]
        if left:
            msg = (
                f"REAPPruningModifier: ignore leaves {', '.join(left)} whole while the other blocks drop experts; "
                f"the config's one {key} cannot describe both and transformers would not reload the model; "
                "remove them from ignore"
            )
            raise ValueError(msg)
        num_drop = int(count * self.sparsity)
        if num_drop == 0:
            msg = f"REAPPruningModifier: sparsity={self.sparsity} drops 0 of {count} experts; raise the sparsity"
            raise ValueError(msg)
        top_k = next(
            (v for v in (getattr(b.router, "top_k", None) for b in blocks) if isinstance(v, int)),
            next((getattr(config, k) for k in _TOP_K_KEYS if isinstance(getattr(config, k, None), int)), None),
        )
        if top_k is None:
            msg = "REAPPruningModifier: the router's top-k (router.top_k or config num_experts_per_tok) is not known"
            raise ValueError(msg)
        if count - num_drop < top_k:
            msg = (
                f"REAPPruningModifier: sparsity={self.sparsity} keeps {count - num_drop} of {count} experts, fewer "
                f"than the router's top-k={top_k}; lower the sparsity"
            )
            raise ValueError(msg)
        return blocks, count, num_drop, key

    def streaming_refusal(self) -> str:
        """Why REAP does not run on layers streamed from the checkpoint (``low_memory``; the command's default path
        then runs in memory)."""
        return (
            "it drops experts, which changes the shapes of the experts' parameters and the config's expert count; "
            "the layer-by-layer writer keeps the checkpoint's shapes (not implemented)"
        )

    def check_model(self, model: nn.Module) -> dict[str, nn.Module]:
        """Refuse, before any work, a model or run REAP cannot prune (:meth:`_plan`; ``torch.distributed``).

        Returns:
            ``{name: view}`` of every expert matrix of the blocks it prunes (:func:`~llmc_fsm.toolkit.weight_views`):
            one-shot refuses, before any work, a recipe that quantizes them before REAP (an earlier stage, or earlier
            in its stage: prune first, then quantize).

        Raises:
            ValueError: as :meth:`_plan`, a ``torch.distributed`` run.
        """
        _refuse_distributed()
        blocks, *_ = self._plan(model)
        return {f"{b.name}.experts.{s}": view for b in blocks for s, view in weight_views(b.experts).items()}

    def on_initialize(self, state: Any) -> None:
        _refuse_distributed()
        self._blocks, self._num_experts, self._num_drop, self._config_key = self._plan(state.model)
        self._model = state.model
        logger.info(
            "REAPPruningModifier: %d MoE blocks, dropping %d of %d experts each",
            len(self._blocks),
            self._num_drop,
            self._num_experts,
        )

    def check_stage(self, model: nn.Module, selected: list[tuple[Any, dict[str, Any]]]) -> None:
        """Refuse, before any work, a modifier of REAP's stage that cannot follow the experts it drops in ``model``
        (:meth:`_check_stage`). ``selected``: ``(modifier, modules its check_model selected)`` for each modifier of
        the stage, in recipe order (one-shot passes what its checks computed; ``explain --model`` too); a session
        checks the same at ``calibration_start``.

        Raises:
            ValueError: as :meth:`_check_stage`.
        """
        blocks, *_ = self._plan(model)
        targets = {id(modifier): modules for modifier, modules in selected}
        self._check_stage([modifier for modifier, _ in selected], blocks, lambda other: targets[id(other)])

    def _check_stage(self, modifiers: list[Any], blocks: list[MoeBlock], targets_of: Any) -> list[Any]:
        """The other ``modifiers`` of REAP's stage that target modules of the ``blocks`` REAP prunes (their targets
        by ``targets_of(modifier)``), checked; returns them.

        They selected their targets (per-expert views among them) before any expert is dropped. A calibrated
        modifier after REAP that follows dropped experts (``follows_expert_drop``: GPTQ, round-to-nearest,
        SparseGPT, Wanda) is told at each layer's end which experts were kept and renumbers its targets and
        statistics (llm-compressor's REAP example quantizes in REAP's stage); any other, or one before REAP, is
        refused, before any weight changes. (No modifier can target a router of the blocks REAP prunes: transformers
        5's routers are not Linear-like.)

        Raises:
            ValueError: naming the modifier, what it targets and what to do.
        """
        owned = {id(m) for b in blocks for m in b.block.modules()}
        before, followers = True, []
        for other in modifiers:
            if other is self:
                before = False
                continue
            hit = sorted(
                name
                for name, module in targets_of(other).items()
                if id(module) in owned or id(getattr(module, "source", None)) in owned
            )
            if not hit:
                continue
            follows = getattr(other, "follows_expert_drop", False) is True and callable(
                getattr(other, "follow_expert_drop", None)
            )
            if not follows:
                msg = (
                    f"REAPPruningModifier: {other.modifier_name()} in the same stage targets {len(hit)} modules of "
                    f"the MoE blocks whose experts REAP drops (e.g. {hit[0]}) and cannot follow the experts' "
                    "renumbering; put REAPPruningModifier in its own stage before it"
                )
                raise ValueError(msg)
            if before:
                msg = (
                    f"REAPPruningModifier: {other.modifier_name()} comes before it in the same stage and targets "
                    f"{len(hit)} modules of the MoE blocks whose experts REAP drops (e.g. {hit[0]}); put "
                    f"REAPPruningModifier before {other.modifier_name()} (REAP drops a layer's experts at its end, "
                    "before the layer is compressed)"
                )
                raise ValueError(msg)
            followers.append(other)
        return followers

    def takes_grouped_order(self, layer: nn.Module) -> bool:
        """Whether the pipeline may run ``layer`` in its grouped order (one forward, each group of targets compressed
        before the batches run it): in a layer holding no block REAP prunes (its hooks and its pruning are in the
        MoE layers only), so adding REAP to a stage does not change how its dense layers are compressed (found by a
        tester: DeepSeek-V3's dense first layer took the plain order)."""
        inside = {id(m) for m in layer.modules()}
        return not any(id(b.block) in inside for b in self._blocks)

    def on_calibration_start(self, state: Any) -> None:
        binding = self._binding
        session = binding.session() if binding is not None else None
        modifiers = session.modifiers if session is not None else [self]
        self._followers = self._check_stage(modifiers, self._blocks, lambda other: other.resolved_targets)
        self._sums, self._counts = {}, {}
        for b in self._blocks:
            if b.name in self.retained:
                continue
            self._sums[b.name] = torch.zeros(self._num_experts, dtype=torch.float64)
            self._counts[b.name] = torch.zeros(self._num_experts, dtype=torch.int64)
            self.register_hook(
                b.experts, lambda m, a, k, n=b.name: self._observe(n, m, a, k), kind="forward_pre", with_kwargs=True
            )

    @torch.no_grad()
    def _observe(self, name: str, experts: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if name not in self._sums:  # pruned already (the pipeline runs the pruned layer for the next inputs)
            return
        hidden, index, weights = _routing_args(experts, args, kwargs)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        index = index.reshape(hidden.shape[0], -1)
        weights = weights.reshape(hidden.shape[0], -1)
        for e in range(self._num_experts):
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            norms = torch.linalg.vector_norm(expert_outputs(experts, e, hidden[token]).double(), dim=-1)
            self._sums[name][e] += (weights[token, slot].double() * norms).sum().cpu()
            self._counts[name][e] += token.numel()

    def on_sequential_epoch_end(self, state: Any, modules: Any) -> None:
        inside = {id(m) for module in modules for m in module.modules()}
        for b in self._blocks:
            if b.name in self._sums and id(b.block) in inside and int(self._counts[b.name].sum()) > 0:
                self._prune(b)

    def on_calibration_end(self, state: Any) -> None:
        self.remove_hooks()
        unseen = [b.name for b in self._blocks if b.name in self._sums and int(self._counts[b.name].sum()) == 0]
        if unseen:
            msg = (
                f"REAPPruningModifier: no calibration token reached {', '.join(unseen)}; their experts cannot be "
                "scored (run the sequential pipeline over the whole model)"
            )
            raise ValueError(msg)
        for b in self._blocks:
            if b.name in self._sums:
                self._prune(b)
        config = _text_config(self._model)
        if self._config_key is not None and len(self.retained) == len(self._blocks):
            setattr(config, self._config_key, self._num_experts - self._num_drop)

    def _prune(self, b: MoeBlock) -> None:
        sums, counts = self._sums.pop(b.name), self._counts.pop(b.name)
        scores = sums / counts.clamp(min=1).double()
        keep_list = retained_experts(scores, self._num_drop)
        self._drop(b, keep_list, scores.tolist(), counts.tolist())
        logger.info("REAPPruningModifier: %s keeps experts %s (scores %s)", b.name, keep_list, scores.tolist())

    def _drop(self, b: MoeBlock, keep_list: list[int], scores: list[float], counts: list[int]) -> None:
        """Cut block ``b`` down to the experts ``keep_list`` (former indices, in order) and tell the followers."""
        keep = torch.tensor(keep_list, dtype=torch.long)
        count = self._num_experts
        with torch.no_grad():
            for pname in [n for n, _ in b.experts.named_parameters(recurse=False)] + [
                n for n, _ in b.experts.named_buffers(recurse=False)
            ]:
                _slice_rows(b.experts, pname, keep, count)
            for pname in ("weight", "bias", "e_score_correction_bias"):
                _slice_rows(b.router, pname, keep, count)
            experts = {id(m) for m in b.experts.modules()}
            for sub in b.block.modules():  # the block's own, or a statistics module's (Ernie 4.5's moe_statics)
                if sub is not b.router and id(sub) not in experts:
                    _slice_rows(sub, "e_score_correction_bias", keep, count)
        for module in (b.experts, b.router, b.block):
            _set_count(module, len(keep_list))
        clear_weight_views(b.experts)
        for other in self._followers:
            other.follow_expert_drop(self._model, f"{b.name}.experts", keep_list)
        self.scores[b.name] = scores
        self.expert_tokens[b.name] = counts
        self.retained[b.name] = keep_list

    # ---- resume (llmc_fsm.oneshot_job.resume) -----------------------------------------------------------------------
    def progress_state(self, layer: nn.Module) -> dict[str, Any]:
        """What REAP did in ``layer`` (JSON, saved with the layer's progress): per pruned block its ``kept`` experts
        (former indices, in order), ``scores`` and ``routed_tokens``."""
        inside = {id(m) for m in layer.modules()}
        return {
            b.name: {
                "kept": self.retained[b.name],
                "scores": self.scores[b.name],
                "routed_tokens": self.expert_tokens[b.name],
            }
            for b in self._blocks
            if id(b.block) in inside and b.name in self.retained
        }

    def restore_layer_structure(self, layer: nn.Module, state: dict[str, Any]) -> None:
        """Before a resumed run loads ``layer``'s saved tensors: drop the experts the interrupted run dropped
        (``state`` from :meth:`progress_state`), so the layer has the saved shapes, and tell the followers (their
        targets renamed as in the interrupted run); the block's scores are not computed again."""
        for b in self._blocks:
            if b.name in state:
                self._sums.pop(b.name, None)
                self._counts.pop(b.name, None)
                saved = state[b.name]
                self._drop(b, list(saved["kept"]), list(saved["scores"]), list(saved["routed_tokens"]))

    def restore_progress_state(self, layer: nn.Module, state: dict[str, Any]) -> None:
        """After the layer's tensors are loaded: nothing left (:meth:`restore_layer_structure` restored it all)."""

    def on_finalize(self, state: Any) -> None:
        self.remove_hooks()
        self._sums, self._counts = {}, {}
        if self.report_path is not None and self.retained and is_main_process():
            path = Path(self.report_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.retained, indent=2))
