"""Base class of modifiers that compress weights from calibration statistics (SparseGPT, Wanda, GPTQ, RTN).

:class:`CalibratedModifier` holds what these modifiers share:

* :meth:`CalibratedModifier.check_model` (also run at ``initialize``) selects its targets and checks each
  one, reporting every problem before any calibration work;
* at ``calibration_start`` it puts a forward pre-hook on every target that feeds
  the target's inputs to a statistics accumulator
  (:meth:`CalibratedModifier._new_accumulator`); targets called one after the
  other on the *same* input tensor (``q/k/v``, ``gate/up``) share one
  accumulator, and are compressed together;
* at ``sequential_epoch_end(modules)`` it compresses the targets inside
  ``modules`` (:meth:`CalibratedModifier._compress_group`) and frees their
  accumulators, so at most one decoder layer's statistics are alive at a time
  under the sequential pipeline;
* at ``calibration_end`` it compresses every target not compressed yet. Targets
  that never saw a calibration input are compressed only if the modifier needs
  no data (:attr:`CalibratedModifier.needs_inputs` false), else left as they are
  and listed in :attr:`CalibratedModifier.skipped`.

After compressing, it records a :class:`ModuleResult` per target (zeros measured
on the new weight, and, when the accumulator holds a Hessian, the relative output
error on the calibration inputs).

Under ``torch.distributed`` (a process group with more than one rank, see
:mod:`llmc_fsm.toolkit.distributed`) each rank calibrates on its own share of the data;
before a group of targets is compressed the accumulators are summed over the
ranks (their ``all_reduce()``), so every rank compresses from the statistics of
all the data. A modifier whose compression changes nothing but the weights' values
(:attr:`CalibratedModifier.shares_work_across_ranks`, e.g. SparseGPT, Wanda) then
**shares the work**: the groups of targets of a layer are assigned to ranks,
balanced by their sweep cost (rows x columns², :func:`llmc_fsm.toolkit.distributed.assign_to_ranks`),
each rank compresses its share and the new weights (and results) are broadcast
from their owner; any other modifier compresses every group on every rank. Either
way the new weights are then compared across ranks by per-module checksums.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import nn

from llmc_fsm.core.modifier import Modifier
from llmc_fsm.toolkit.distributed import (
    DistributedError,
    all_gather_ints,
    assign_to_ranks,
    broadcast_tensor,
    broadcast_values,
    check_same_values,
    get_rank,
    get_world_size,
    is_distributed,
    reduce_statistics,
    sweep_cost,
)
from llmc_fsm.toolkit.heap import trim_heap
from llmc_fsm.toolkit.layer_error import relative_output_error
from llmc_fsm.toolkit.obs import all_finite
from llmc_fsm.toolkit.targets import (
    DEFAULT_IGNORE,
    DEFAULT_TARGETS,
    check_not_quantized,
    compact_names,
    is_linear_like,
    resolve_targets,
)
from llmc_fsm.toolkit.views import LinearView, weight_views

__all__ = ["CalibratedModifier", "CompressedGroup", "ModuleResult"]

logger = logging.getLogger(__name__)

#: A data-free compression gives the freed heap back after this many bytes of weights (``_compress_all``).
TRIM_EVERY_BYTES = 32 * 1024 * 1024


def patterns(value: Any) -> list[str]:
    """attrs converter: one module pattern or a list of them -> ``list[str]`` (a set sorted).

    Raises:
        TypeError: anything else; ``None`` too (``ignore=None`` meant ``[]`` to the pruners, pruning lm_head, and the
            default to the quantizers; llm-compressor refuses it: a tester's case).
    """
    if isinstance(value, str):
        return [value]
    if value is None:
        msg = (
            "must be a module pattern or a list of them, got None: leave the argument out for the modifier's default "
            "(ignore=[] ignores nothing; targets must name a module)"
        )
        raise TypeError(msg)
    if isinstance(value, set | frozenset) and all(isinstance(v, str) for v in value):
        return sorted(value)  # one order in every process (a set's follows the string hash seed: a tester's case)
    # a generator is read once, here; a mapping is refused (its keys were taken: targets: {Linear: 1}, a tester's case)
    items = list(value) if isinstance(value, Iterable) and not isinstance(value, Mapping) else None
    if items is None or not all(isinstance(v, str) for v in items):
        msg = f"must be a module pattern or a list of them (class name, full name or 're:<regex>'), got {value!r}"
        raise TypeError(msg)
    return items


def _non_empty(instance: Any, attribute: attrs.Attribute, value: list[str]) -> None:
    if not value:
        msg = f"{attribute.name} must name at least one module pattern, e.g. ['Linear']"
        raise ValueError(msg)


@attrs.define(kw_only=True, slots=False, eq=False)
class ModuleResult:
    """What compressing one module did.

    Attributes:
        zeros / numel: exact zeros of the weight after compression, and its size. For a
            quantizer (``zeros_are_sparsity = False``) only the zeros that were already
            there before (pruned weights, which quantization keeps): values rounded to
            zero are not sparsity.
        seconds: compression time (modules compressed together split their group's time by weight size).
        samples: calibration tokens the module saw (0 for data-free compression).
        rel_output_error: ``||W X - W_hat X|| / ||W X||`` on the calibration inputs, or ``None``
            when the statistics hold no Hessian (Wanda, data-free RTN).
        bits / group_size: weight bits and group size for quantized modules, else ``None``.
        label: the report's label of a quantized module's scheme (:func:`~llmc_fsm.toolkit.packed.scheme_label`:
            ``int4/g64``, ``fp8 a:fp8``), else ``None`` (the report then labels it by ``bits`` and ``group_size``).
    """

    zeros: int
    numel: int
    seconds: float
    samples: int
    rel_output_error: float | None = None
    bits: int | None = None
    group_size: int | None = None
    label: str | None = None

    @property
    def sparsity(self) -> float:
        """``zeros / numel`` (a fraction in ``[0, 1]``; 0.0 for an empty weight)."""
        return self.zeros / self.numel if self.numel else 0.0


@attrs.frozen
class CompressedGroup:
    """What :meth:`CalibratedModifier._compress_group` returns when the algorithm measured each new
    weight's ``||W X - W_hat X|| / ||W X||`` itself (e.g. GPTQ from its sweep: :mod:`llmc_fsm.toolkit.layer_error`).

    Attributes:
        weights: one new ``[out, in]`` weight per module, in the order of the modules given (any float dtype).
        rel_output_errors: one relative output error per module (a float ``>= 0``), same order; the class that
            returns it sets ``measures_output_error = True``.
    """

    weights: list[torch.Tensor]
    rel_output_errors: list[float]


@attrs.define(kw_only=True, slots=False, eq=False)
class CalibratedModifier(Modifier):
    """Base of modifiers that compress Linear weights from calibration statistics (not registered itself).

    Args:
        targets: module patterns to compress: class names (``"Linear"``, the
            default), full module names, or ``"re:<regex>"`` matched against
            full names.
        ignore: module patterns never compressed (default ``["lm_head"]``). A
            module whose weight is tied to an ignored one is ignored too.

    Subclasses implement :meth:`_new_accumulator` and :meth:`_compress_group` (see ``docs/plugins.md``,
    "Writing a calibrated modifier", for the lifecycle and every override point).

    Raises (at construction): ``TypeError`` for a pattern that is not a string (or a list of them), ``ValueError``
    for empty ``targets``.
    """

    required_state = frozenset({"model", "calibration_data"})
    #: Whether targets need calibration inputs; ``False`` compresses unseen targets at ``calibration_end``.
    needs_inputs = True
    #: Whether zeros the compression creates are sparsity (pruning); a quantizer sets ``False``.
    zeros_are_sparsity = True
    #: Whether :meth:`_compress_group` returns a :class:`CompressedGroup` (no copy of the old weights is kept).
    measures_output_error = False
    #: Whether targets include the Linear views of fused experts and Conv1D (:mod:`llmc_fsm.toolkit.views`; the
    #: subclass then feeds their inputs, see :func:`~llmc_fsm.toolkit.views.observe_inputs`); ``False`` refuses them.
    compresses_views = False
    #: Whether :meth:`_compress_group` changes nothing but the values of the modules' weights (no new parameters,
    #: buffers or attributes, no state kept on the modifier): then under ``torch.distributed`` each group of
    #: targets is compressed by one rank and its new weights are broadcast (the sweeps are split between ranks).
    shares_work_across_ranks = False
    #: When ranks share the work: whether the modules of one group (sharing a Hessian: q/k/v, gate/up) may go to
    #: different ranks, each sweeping its own (``False``: a group goes to one rank whole, as one process sweeps it,
    #: so the new weights are bitwise those of the replicated computation; the ranks then run in parallel only when
    #: several groups are handed over at once, i.e. the plain pipeline order).
    splits_groups_across_ranks = True
    #: Whether the compression only rounds the weights to their grid, so that the layers after a compressed one may
    #: calibrate on its weights as they were (round-to-nearest, which llm-compressor applies when it saves the
    #: model): when every modifier of a session says so, the pipeline computes each layer's output before the
    #: layer is compressed (:func:`llmc_fsm.pipeline.layer.defers_weights`). ``False``: later layers calibrate on
    #: the compressed weights (GPTQ, SparseGPT: the weights they updated).
    defers_weight_update = False

    #: Whether a target may be the output head tied to the input embedding: the modifier unties it before
    #: compressing it (:func:`llmc_fsm.toolkit.targets.untie_head`, quantizers, as llm-compressor's); ``False``:
    #: such a target is refused (compressing it would change the embedding too).
    unties_head = False

    def streaming_refusal(self) -> str | None:
        """Why this modifier cannot run on layers streamed from the checkpoint one at a time (``low_memory``, the
        CLI's default path), or ``None`` when it can. :func:`llmc_fsm.pipeline.streaming.check_streamable` refuses
        the streamed path with this reason (the CLI's default then runs in memory). Override it for work that needs
        the whole model at once (e.g. observing every attention's keys and values through the model's forward)."""
        return None

    targets: list[str] = attrs.field(factory=lambda: list(DEFAULT_TARGETS), converter=patterns, validator=_non_empty)
    ignore: list[str] = attrs.field(factory=lambda: list(DEFAULT_IGNORE), converter=patterns)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._clear()
        self._target_warnings: set[str] = set()  # given once: one-shot checks the targets before initialize too

    def _clear(self) -> None:
        self._targets: dict[str, nn.Module] = {}
        self._names_by_id: dict[int, str] = {}
        #: target -> the other modules holding its weight tensor (weights several decoder layers share, e.g. Zamba's
        #: shared transformer block, held by each hybrid layer's own modules): calibrated as the target only
        self._also_named: dict[str, list[str]] = {}
        self._acc: dict[str, Any] = {}
        self._last_input: torch.Tensor | None = None
        self._last_acc: Any = None
        #: module name -> :class:`ModuleResult`, in the order the modules were compressed.
        self.results: dict[str, ModuleResult] = {}
        #: targets that never received a calibration input (left as they were).
        self.skipped: list[str] = []
        #: targets this process compressed itself, in order (under shared work, only its share).
        self.compressed_here: list[str] = []
        #: when ranks share the work: module name -> (rank that compressed it, sweep cost, seconds).
        self.work_shares: dict[str, tuple[int, int, float]] = {}
        #: when ranks share the work: the targets compressed on every rank anyway (:meth:`_shares_module`), in order.
        self.compressed_on_every_rank: list[str] = []
        self._rank_loads: list[int] = []

    @property
    def resolved_targets(self) -> dict[str, nn.Module]:
        """``{full name: module}`` selected at initialize (empty before)."""
        return dict(self._targets)

    @property
    def targets_without_inputs(self) -> frozenset[str]:
        """Names of targets compressed without calibration inputs, at ``calibration_end``: :meth:`inputless_targets`
        of the targets selected at initialize. The in-memory sequential pipeline accepts them outside the decoder
        layers (:func:`llmc_fsm.pipeline.sequential.check_targets_in_layers`)."""
        return self.inputless_targets(self._targets)

    def inputless_targets(self, targets: Mapping[str, nn.Module]) -> frozenset[str]:
        """The names among ``targets`` (``{name: module}``: the targets selected at initialize, or what
        :meth:`check_model` returns before it, as ``llmc-fsm explain --model`` checks them) that this modifier
        compresses without calibration inputs (none here; a quantizer's ``nn.Embedding``)."""
        return frozenset()

    # ---- subclass API ----------------------------------------------------------
    def _new_accumulator(self, module: nn.Module) -> Any:
        """A fresh statistics accumulator for ``module`` (``add_batch(x)``, ``num_samples``, ``in_features``).

        To run under ``torch.distributed`` it also needs ``all_reduce()``: sum its
        statistics over the ranks in place (see :mod:`llmc_fsm.toolkit.distributed`).
        """
        raise NotImplementedError

    def _selectable(self, module: nn.Module) -> bool:
        """Whether ``targets`` may select ``module`` (default: :func:`~llmc_fsm.toolkit.targets.is_linear_like`)."""
        return is_linear_like(module)

    def _check_target(self, name: str, module: nn.Module) -> str | None:
        """Why ``module`` cannot be compressed (one line, without its name), or ``None``.

        Default: it must be Linear-like. Modules with the same reason are reported together.
        """
        if not is_linear_like(module):
            return f"no 2-D Linear weight ({type(module).__name__})"
        return None

    def _compress_group(self, modules: list[nn.Module], accumulator: Any) -> list[torch.Tensor] | CompressedGroup:
        """New weights for ``modules``, which saw the same inputs (``accumulator`` is ``None`` when data-free)."""
        raise NotImplementedError

    def _result_extras(self, module: nn.Module) -> dict[str, Any]:
        """Extra :class:`ModuleResult` fields for ``module`` (e.g. ``bits``)."""
        return {}

    def _prepare_to_receive(self, modules: list[tuple[str, nn.Module]]) -> None:
        """When ranks share the work (:attr:`shares_work_across_ranks`): on a rank that does not compress
        ``modules`` (``(name, module)``), give them the parameters and buffers :meth:`_compress_group` creates on
        the rank that does (shapes and dtypes; the values are then broadcast). Default: nothing (only the
        weights change)."""

    def _after_receive(self, modules: list[tuple[str, nn.Module]]) -> None:
        """When ranks share the work: on a rank that did not compress ``modules``, what is left to do once their
        tensors hold the compressing rank's values. Default: nothing."""

    #: What to do when :meth:`check_model` finds an already quantized model.
    quantized_model_hint = (
        "compress the original full-precision model: prune first, then quantize (a sparsity stage before the "
        "quantization stage in one recipe)"
    )

    def _fix_hint(self, targets: dict[str, nn.Module], problems: dict[str, list[str]]) -> str:
        """What to do about ``problems`` (reason -> module names), one sentence; empty when every target has a
        problem (leaving them all out would compress nothing: the reasons say what to change)."""
        if sum(len(names) for names in problems.values()) == len(targets):
            return ""
        return "Narrow targets or add these modules to ignore."

    # ---- checks ----------------------------------------------------------------
    def check_model(self, model: nn.Module) -> dict[str, nn.Module]:
        """The targets this modifier would compress in ``model``, after every check that needs no data.

        Pure: reads module names, classes and weight shapes only (works on a
        ``meta``-device model), changes nothing. :meth:`on_initialize` runs it;
        one-shot runs it for every modifier before measuring anything.

        Returns:
            ``{full name: module}`` of the selected targets.

        Raises:
            ValueError: targets/ignore select nothing usable (see
                :func:`~llmc_fsm.toolkit.targets.resolve_targets`), or some targets cannot be
                compressed — every such module named, grouped by reason, with what to do.
        """
        check_not_quantized(model, type(self).__name__, self.quantized_model_hint)
        targets = resolve_targets(
            model,
            self.targets,
            self.ignore,
            warned=self._target_warnings,
            supported=self._selectable,
            views=self.compresses_views,
            untie_head=self.unties_head,
            ignore_given=None if not hasattr(self, "_ignore_defaulted") else not self._ignore_defaulted,
        )
        quantized = [name for name, module in targets.items() if hasattr(module, "quantization_scheme")]
        if quantized:  # an earlier stage of this run quantized them; other modules may still be compressed
            msg = (
                f"{type(self).__name__}: {len(quantized)} of its targets are already quantized, e.g. {quantized[0]}; "
                f"{self.quantized_model_hint}"
            )
            raise ValueError(msg)
        problems: dict[str, list[str]] = {}
        for name, module in targets.items():
            reason = self._check_target(name, module)
            if reason is not None:
                problems.setdefault(reason, []).append(name)
        if problems:
            count = sum(len(names) for names in problems.values())
            shown = "; ".join(f"{reason}: {compact_names(names)}" for reason, names in problems.items())
            msg = f"{type(self).__name__} cannot compress {count} of its {len(targets)} targets — {shown}." + (
                f" {hint}" if (hint := self._fix_hint(targets, problems)) else ""
            )
            raise ValueError(msg)
        return targets

    # ---- lifecycle -------------------------------------------------------------
    def on_initialize(self, state: Any) -> None:
        self._clear()
        targets = self.check_model(state.model)
        self._targets = targets
        self._names_by_id = {id(m): name for name, m in targets.items()}
        by_weight = {id(getattr(m, "weight", None)): name for name, m in targets.items()}
        for name, module in state.model.named_modules():
            first = by_weight.get(id(getattr(module, "weight", None)))
            if first is not None and name != first:
                self._also_named.setdefault(first, []).append(name)

    def on_calibration_start(self, state: Any) -> None:
        for name, module in self._targets.items():
            if name not in self.results:
                self.register_hook(module, self._make_hook(name), kind="forward_pre")

    def _make_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if name in self.results or not args:
                return
            x = args[0]
            acc = self._acc.get(name)
            if x is self._last_input:
                # Same input tensor as the module called just before (q/k/v, gate/up):
                # share its statistics instead of computing them again.
                if acc is None and self._last_acc is not None and self._last_acc.in_features == x.shape[-1]:
                    self._acc[name] = self._last_acc
                    return
                if acc is self._last_acc:
                    return
            if acc is None:
                acc = self._acc[name] = self._new_accumulator(module)
            with torch.no_grad():
                acc.add_batch(x)
            self._last_input = x
            self._last_acc = acc

        return hook

    def on_sequential_epoch_end(self, state: Any, modules: Any) -> None:
        roots = [modules] if isinstance(modules, nn.Module) else list(modules)
        pending = {}
        for root in roots:
            for module in root.modules():
                for sub in (module, *weight_views(module).values()):  # views: fused experts, Conv1D
                    name = self._names_by_id.get(id(sub))
                    if name is not None and name not in self.results:
                        pending[name] = sub
        self._compress_all(pending)
        self._last_input = None
        self._last_acc = None

    #: Whether :meth:`follow_expert_drop` keeps this modifier's state right when a modifier before it in the same
    #: stage (REAP) drops experts of a fused experts module whose views it targets; ``False``: such a stage is
    #: refused before any work (e.g. AutoRound, whose per-layer state holds more than the base class's).
    follows_expert_drop = True

    def follow_expert_drop(self, model: nn.Module, name: str, kept: list[int]) -> dict[str, str | None]:
        """Follow the fused experts module ``name`` of ``model`` now holding only the experts ``kept`` (their
        former indices in their new order: former expert ``kept[j]`` is expert ``j``), dropped at a layer's end by a
        modifier before this one in the same stage (``REAPPruningModifier``), before this one compresses the layer.

        The targets that were views of dropped experts are forgotten with their statistics; those of kept experts
        are renamed to their new index (``experts.5.down_proj`` -> ``experts.2.down_proj``) and take the rebuilt
        views (:func:`~llmc_fsm.toolkit.views.weight_views`), their statistics and routed-token counts carried
        over, so the layer is compressed as if the experts kept had been the only ones while it calibrated (what
        llm-compressor does: its scheme and observers sit on the expert modules, which are renumbered). A subclass
        with more per-target state extends it (calls it and applies the returned renames).

        Returns:
            ``{former target name: new name, or None for a dropped expert's}``.

        Raises:
            ValueError: a view of this module was compressed already (the other modifier must come first).
        """
        experts = model.get_submodule(name)
        prefix = name + "."
        renames: dict[str, str | None] = {}
        for target, module in self._targets.items():
            if isinstance(module, LinearView) and module.expert is not None and module.source is experts:
                parts = target.removeprefix(prefix).split(".")
                index = parts.index(str(module.expert))
                if module.expert in kept:
                    parts[index] = str(kept.index(module.expert))
                    renames[target] = prefix + ".".join(parts)
                else:
                    renames[target] = None
        done = [target for target in renames if target in self.results]
        if done:
            msg = (
                f"{type(self).__name__}: {done[0]} was compressed before the experts of {name} were dropped; the "
                "modifier dropping experts must come before it in the stage"
            )
            raise ValueError(msg)
        views = weight_views(experts)
        targets: dict[str, nn.Module] = {}
        for target, module in self._targets.items():
            new = renames.get(target, target)
            if new is None:
                continue
            if target in renames:
                view = views[new.removeprefix(prefix)]
                view.routed_tokens = module.routed_tokens
                self.register_hook(view, self._make_hook(new), kind="forward_pre")
                module = view
            targets[new] = module
        self._targets = targets
        self._names_by_id = {id(m): n for n, m in targets.items()}
        self._acc = {renames.get(n, n): acc for n, acc in self._acc.items() if renames.get(n, n) is not None}
        self._last_input = None
        self._last_acc = None
        return renames

    def on_calibration_end(self, state: Any) -> None:
        self._compress_all({name: m for name, m in self._targets.items() if name not in self.results}, trim=True)
        self._last_input = None
        self._last_acc = None
        self._acc.clear()
        self.remove_hooks()

    def on_finalize(self, state: Any) -> None:
        self._acc.clear()
        self._last_input = None
        self._last_acc = None

    # ---- work ------------------------------------------------------------------
    def _says_idle_expert(self, module: nn.Module) -> bool:
        """Whether ``module``, left as it was for want of calibration input, is a fused expert's matrix (a
        :class:`~llmc_fsm.toolkit.views.LinearView` with an ``expert``) that the modifier names in its own line per
        decoder layer: one that keeps ``routed_tokens`` (``{expert matrix name: routed tokens}``, the pruning
        modifiers' summary "the router sent no calibration token to N expert matrices"). The line per matrix is then
        left out: SparseGPT on an 8-expert model said each idle matrix twice, 64 lines for 4 layers (found by a
        tester)."""
        expert = isinstance(module, LinearView) and module.expert is not None
        return expert and isinstance(getattr(self, "routed_tokens", None), dict)

    def _sum_over_ranks(self, modules: Mapping[str, nn.Module]) -> None:
        """Under ``torch.distributed``, sum the accumulators of ``modules`` over the ranks, in place
        (:func:`llmc_fsm.toolkit.distributed.reduce_statistics`: a rank that saw no input for a module the others
        saw gets an empty accumulator first); one process: nothing. Every rank calls it with the same names. A
        subclass that reads the statistics before :meth:`_compress_all` (which targets received inputs at all) calls
        it first and then ``_compress_all(..., reduced=True)``, so that they are summed once.

        Raises:
            DistributedError: ranks disagree on which targets share statistics, or a collective failed.
        """
        if is_distributed():
            reduce_statistics(self._acc, dict(modules), self._new_accumulator, owner=type(self).__name__)

    def _shares_module(self, module: nn.Module) -> bool:
        """When :attr:`shares_work_across_ranks`: whether ``module`` may be compressed by one rank and its tensors
        broadcast to the others; a group holding a module that may not is compressed on every rank. Default: all."""
        return True

    def _compress_all(self, modules: dict[str, nn.Module], *, trim: bool = False, reduced: bool = False) -> None:
        """Compress ``{name: module}``, each group of modules that share an accumulator in one call.

        ``trim``: give the freed heap back to the system (:func:`llmc_fsm.toolkit.heap.trim_heap`) after
        every 32 MiB of compressed weights: a data-free run (RTN) compresses every target in this
        one call, outside the layer-by-layer pipeline that trims after each layer. Without it
        glibc kept up to ~0.3 GB of freed temporaries on SmolLM2 W8A8 RTN, depending on the run
        (peak 0.92 or 1.25-1.36 GB); with it, 0.92 GB in every run.

        Under ``torch.distributed`` the accumulators are first summed over the
        ranks (:meth:`_sum_over_ranks`; not again with ``reduced``: the caller did) and the new weights are then
        compared across ranks (:func:`llmc_fsm.toolkit.distributed.check_same_values`). Every rank
        calls this with the same ``modules`` (the same layer), so the collectives match. With
        :attr:`shares_work_across_ranks` the groups whose modules all may be shared (:meth:`_shares_module`) are
        split between the ranks; the others are compressed on every rank.

        Raises:
            DistributedError: a collective failed, or the ranks computed different weights.
        """
        distributed = is_distributed()
        if not reduced:
            self._sum_over_ranks(modules)
        groups: dict[int, tuple[Any, list[tuple[str, nn.Module]]]] = {}
        for name, module in modules.items():
            acc = self._acc.pop(name, None)
            if acc is None or acc.num_samples == 0:
                if self.needs_inputs:
                    if name not in self.skipped and not self._says_idle_expert(module):
                        shared = self._also_named.get(name)
                        where = (
                            f" (its weight is also {compact_names(shared)}'s: a weight several decoder layers "
                            "share is calibrated where the first of its modules runs only)"
                            if shared
                            else ""
                        )
                        logger.warning(
                            "%s: %s received no calibration input%s; left as it was", type(self).__name__, name, where
                        )
                    if name not in self.skipped:
                        self.skipped.append(name)
                    continue
                acc = None
            key = id(acc) if acc is not None else id(module)
            groups.setdefault(key, (acc, []))[1].append((name, module))
        broken = nonfinite_weights({name: m for _, members in groups.values() for name, m in members})
        if broken:  # before any of them changes (those left as they were are not read): round-to-nearest wrote NaN
            msg = (  # scales silently, GPTQ compressed the module and failed one group later (found by a tester)
                f"{type(self).__name__}: the weights of {compact_names(broken)} hold NaN or Inf values, so they "
                "cannot be compressed: the checkpoint (or an earlier change to the model) is broken there"
            )
            raise ValueError(msg)
        if any(acc is self._last_acc for acc, _ in groups.values()):
            self._last_input = None  # the last batch's input and statistics are not needed past their group
            self._last_acc = None
        if distributed and self.shares_work_across_ranks:
            shared = {key: group for key, group in groups.items() if all(self._shares_module(m) for _, m in group[1])}
            self._compress_shared(shared)
            groups = {key: group for key, group in groups.items() if key not in shared}
            self.compressed_on_every_rank.extend(name for _, members in groups.values() for name, _ in members)
        since_trim = 0
        for key in list(groups):
            acc, members = groups.pop(key)
            self._compress_members(acc, members)
            del acc  # the group's Hessian goes as soon as its weights are compressed
            if trim:
                since_trim += sum(module.weight.numel() * module.weight.element_size() for _, module in members)
                if since_trim >= TRIM_EVERY_BYTES:
                    trim_heap()
                    since_trim = 0
        if distributed:
            compressed = [name for name in modules if name in self.results]
            with torch.no_grad():
                sums = {
                    name: (float(w.sum(dtype=torch.float64)), float(w.abs().sum(dtype=torch.float64)))
                    for name, w in ((name, modules[name].weight) for name in compressed)
                }
            check_same_values(sums, what="weights")

    def _compress_shared(self, groups: dict[int, tuple[Any, list[tuple[str, nn.Module]]]]) -> None:
        """Each module compressed by the rank :func:`~llmc_fsm.toolkit.distributed.assign_to_ranks` gives it, then its
        new weight and result broadcast from that rank.

        The unit of work is a module, not a group: the true-sequential pipeline hands over one group at a time
        (q/k/v, then o, then gate/up, then down), so ranks split a group's modules — each rank factors the
        group's shared Hessian and sweeps its own modules (a module's sweep and mask depend only on its own rows
        and the Hessian) — and the loads carry over from group to group, balancing the ranks over the run. Every
        rank holds the same groups in the same order (the reduced statistics), so all compute the same owners.
        """
        world, rank = get_world_size(), get_rank()
        if len(self._rank_loads) != world:
            self._rank_loads = [0] * world
        order = [(acc, name, module) for acc, members in groups.values() for name, module in members]
        if self.splits_groups_across_ranks:
            owners = assign_to_ranks([sweep_cost(m.weight.shape) for _, _, m in order], world, self._rank_loads)
        else:
            costs = [sum(sweep_cost(m.weight.shape) for _, m in members) for _, members in groups.values()]
            per_group = assign_to_ranks(costs, world, self._rank_loads)
            owners = [owner for owner, (_, members) in zip(per_group, groups.values(), strict=True) for _ in members]
        for acc, members in groups.values():
            mine = [(name, module) for name, module in members if owners[_index(order, name)] == rank]
            if mine:
                self._compress_members(acc, mine)
        for (_, name, module), owner in zip(order, owners, strict=True):
            if owner != rank:
                self._prepare_to_receive([(name, module)])
            tensors = _module_tensors(module)
            layout = _digest_layout(tensors)
            table = all_gather_ints([layout], what=f"all_gather (tensors of {name})")
            if any(row[0] != table[owner][0] for row in table):
                msg = (
                    f"{type(self).__name__}: after compressing {name} the ranks hold different parameters and buffers "
                    "in it (names, shapes or dtypes): the modifier's _prepare_to_receive does not create what its "
                    "_compress_group does"
                )
                raise DistributedError(msg)
            with torch.no_grad():
                for key, tensor in tensors:
                    broadcast_tensor(tensor, src=owner, what=f"broadcast ({name}.{key})")
            if owner != rank:
                self._after_receive([(name, module)])
            result = self.results.get(name) if owner == rank else None
            numbers = (
                [
                    result.zeros,
                    result.seconds,
                    result.samples,
                    math.nan if result.rel_output_error is None else result.rel_output_error,
                ]
                if result is not None
                else [0.0, 0.0, 0.0, 0.0]
            )
            zeros, seconds, samples, error = broadcast_values(numbers, src=owner, what=f"broadcast (result of {name})")
            if owner != rank:
                self.results[name] = ModuleResult(
                    zeros=int(zeros),
                    numel=module.weight.numel(),
                    seconds=seconds,
                    samples=int(samples),
                    rel_output_error=None if math.isnan(error) else error,
                    **self._result_extras(module),
                )
                if name in self.skipped:
                    self.skipped.remove(name)
            self.work_shares[name] = (owner, sweep_cost(module.weight.shape), seconds)

    def _compress_members(self, acc: Any, members: list[tuple[str, nn.Module]]) -> None:
        t0 = time.perf_counter()
        hessian = getattr(acc, "hessian", None) if acc is not None else None
        if hessian is not None and not all_finite(hessian):  # before any of these modules changes
            msg = (
                f"{type(self).__name__}: the calibration inputs of {compact_names(n for n, _ in members)} hold NaN or "
                "Inf values (their Hessian is not finite), so they cannot be compressed: the activations overflowed "
                "before them (a float16 model: load it in float32, --dtype float32 or model.float() for a model in "
                "memory) or a weight before them holds NaN or Inf"
            )
            raise ValueError(msg)
        copy = hessian is not None and not self.measures_output_error
        with torch.no_grad():
            olds = [module.weight.detach().clone() if copy else None for _, module in members]
            were_zero = [None if self.zeros_are_sparsity else _zero_mask_if_any(module.weight) for _, module in members]
            new = self._compress_group([module for _, module in members], acc)
            weights, errors = (
                (new.weights, new.rel_output_errors) if isinstance(new, CompressedGroup) else (new, [None] * len(new))
            )
            _check_returned(type(self).__name__, members, weights)
            for (_, module), weight in zip(members, weights, strict=True):
                if weight is not module.weight:  # a modifier that wrote the weight in place returns it
                    module.weight.copy_(weight)
        seconds = time.perf_counter() - t0
        total = sum(module.weight.numel() for _, module in members)
        for (name, module), old, zero, error in zip(members, olds, were_zero, errors, strict=True):
            numel = module.weight.numel()
            self.results[name] = ModuleResult(
                zeros=numel - int(torch.count_nonzero(module.weight))
                if self.zeros_are_sparsity
                else (0 if zero is None else int(torch.count_nonzero(zero & (module.weight == 0)))),
                numel=numel,
                seconds=seconds * numel / total,
                samples=acc.num_samples if acc is not None else 0,
                rel_output_error=relative_output_error(old, module.weight, hessian) if old is not None else error,
                **self._result_extras(module),
            )
            if name in self.skipped:
                self.skipped.remove(name)
            self.compressed_here.append(name)
        scales = [  # static input scales from overflowed activations (a float16 model): written silently before
            f"{name}.{param}"
            for name, module in members
            for param, tensor in module.named_parameters(recurse=False)
            if param != "weight" and tensor.is_floating_point() and not _finite_weight(tensor)
        ]
        if scales:
            msg = (
                f"{type(self).__name__}: {compact_names(scales)} came out NaN or Inf: the calibration inputs "
                "overflowed before them (a float16 model: load it in float32, --dtype float32 or model.float() for a "
                "model in memory) or hold NaN"
            )
            raise ValueError(msg)


def _check_returned(owner: str, members: list[tuple[str, nn.Module]], weights: Any) -> None:
    """Refuse what ``_compress_group`` returned for ``members`` unless it is one finite tensor of each module's weight
    shape, before any is copied: a row ``[1, in]`` or a scalar was broadcast into every row by ``copy_`` and saved
    (exit 0), a NaN surfaced one group later as that group's "calibration inputs hold NaN" (found by a tester).

    Raises:
        ValueError: naming the modifier, the module, the shape returned and the weight's.
    """
    if len(weights) != len(members):
        msg = f"{owner}._compress_group returned {len(weights)} weights for {len(members)} modules; none was changed"
        raise ValueError(msg)
    for (name, module), weight in zip(members, weights, strict=True):
        if weight is module.weight:
            continue
        if not isinstance(weight, torch.Tensor) or weight.shape != module.weight.shape:
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            msg = (
                f"{owner}._compress_group returned {got} for {name}, whose weight is {tuple(module.weight.shape)}: "
                "it must return one tensor of each module's weight shape; none of them was changed"
            )
            raise ValueError(msg)
        if not _finite_weight(weight):
            msg = f"{owner}._compress_group returned NaN or Inf values for {name}; none of them was changed"
            raise ValueError(msg)


def nonfinite_weights(modules: dict[str, nn.Module]) -> list[str]:
    """The names of ``modules`` whose ``weight`` holds a NaN or an Inf, in ``modules``' order (a modifier refuses
    them before it changes anything: compressed, they give NaN scales or fail mid-sweep).

    Args:
        modules: ``{name: module}``, each with a ``weight`` tensor (any dtype and device; ``meta``, integer dtypes:
            nothing to read, taken as finite; fp8 read in float32).

    Returns:
        The names, ``[]`` when every weight is finite.
    """
    return [name for name, module in modules.items() if not _finite_weight(module.weight)]


def _finite_weight(weight: torch.Tensor) -> bool:
    """No NaN/Inf in ``weight``; ``True`` for one on ``meta`` (nothing to read) or of an integer dtype, and an fp8 one
    is read in float32 (no sum kernel for it on the CPU)."""
    if weight.is_meta or not weight.is_floating_point():
        return True
    return all_finite(weight.float() if weight.element_size() == 1 else weight)


def _module_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and buffers (its own and its submodules'), by name, as the tensors to broadcast into;
    a :class:`~llmc_fsm.toolkit.views.LinearView` (no parameter of its own): its matrix, a view of the fused
    parameter (found by a tester: pruning fused experts under torch.distributed broadcast nothing for them, and the
    ranks' weights differed)."""
    if isinstance(module, LinearView):
        return [("weight", module.weight)]
    found = [(n, p.data) for n, p in module.named_parameters()] + list(module.named_buffers())
    return sorted(found, key=lambda item: item[0])


def _digest_layout(tensors: list[tuple[str, torch.Tensor]]) -> int:
    """A signed 64-bit digest of the tensors' names, shapes and dtypes."""
    text = repr([(n, tuple(t.shape), str(t.dtype)) for n, t in tensors]).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big", signed=True)


def _index(order: list[tuple[Any, str, nn.Module]], name: str) -> int:
    return next(i for i, (_, n, _) in enumerate(order) if n == name)


def _zero_mask_if_any(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight == 0`` (bool, the weight's shape) when the weight holds an exact zero, else ``None`` (no mask made)."""
    return (weight == 0) if int(torch.count_nonzero(weight)) < weight.numel() else None
