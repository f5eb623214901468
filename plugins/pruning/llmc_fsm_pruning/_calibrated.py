"""Shared machinery of the pruning modifiers that learn from calibration inputs (SparseGPT, Wanda).

A :class:`CalibratedPruningModifier`:

* validates its recipe arguments when the recipe is resolved (``sparsity`` in
  ``[0, 1)``, ``mask_structure`` parses, ``targets``/``ignore`` are lists of
  patterns), so a bad recipe fails at ``Session(...)``;
* requires ``model`` and ``calibration_data`` in the session state, so a
  missing dataset is reported by ``initialize`` before any work;
* resolves its targets at ``on_initialize`` (:func:`~llmc_fsm_pruning.targets.resolve_targets`:
  ``targets`` minus ``ignore``, tied weights honoured; targets that match no
  module raise an error naming them and some module names);
* at ``calibration_start`` puts a forward pre-hook (inputs only) on every target that feeds a
  per-target statistics accumulator, created lazily on the first batch;
  modules that receive the very same input tensor (``q/k/v_proj``,
  ``gate/up_proj``) share one accumulator, so their statistics are computed once;
* at ``sequential_epoch_end(modules)`` prunes the targets inside ``modules``
  and frees their accumulators, so at most one decoder layer's statistics are
  alive at a time under the sequential pipeline;
* at ``calibration_end`` prunes every target that has statistics but was not
  inside any ``modules`` passed so far (for integrations that run the whole
  model and fire only ``calibration_start``/``calibration_end``). Targets that
  never saw a calibration input are left dense and listed in :attr:`skipped`.

Subclasses implement :meth:`_new_accumulator` and :meth:`_prune_weight`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import attrs
import torch
from torch import nn

from llmc_fsm import Modifier
from llmc_fsm_pruning.algorithms import parse_mask_structure
from llmc_fsm.targets import DEFAULT_IGNORE, DEFAULT_TARGETS, resolve_targets

__all__ = ["CalibratedPruningModifier", "LayerResult"]

logger = logging.getLogger(__name__)


def _sparsity(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= float(value) < 1.0:
        msg = f"sparsity must be a number in [0, 1) (fraction of weights set to zero), got {value!r}"
        raise ValueError(msg)


def _mask_structure(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    parse_mask_structure(value)  # raises ValueError naming what is accepted


def _patterns(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if value is None:
        return []
    if not isinstance(value, Iterable) or not all(isinstance(v, str) for v in value):
        msg = f"must be a module pattern or a list of them (class name, full name or 're:<regex>'), got {value!r}"
        raise TypeError(msg)
    return list(value)


def _non_empty(instance: Any, attribute: attrs.Attribute, value: list[str]) -> None:
    if not value:
        msg = f"{attribute.name} must name at least one module pattern, e.g. ['Linear']"
        raise ValueError(msg)


@attrs.define(kw_only=True, slots=False, eq=False)
class LayerResult:
    """What pruning one module did (``zeros``/``numel`` measured on the weight after pruning)."""

    zeros: int
    numel: int
    #: pruning time; modules pruned together (shared inputs) split their group's time by weight size.
    seconds: float
    samples: int

    @property
    def sparsity(self) -> float:
        return self.zeros / self.numel if self.numel else 0.0


@attrs.define(kw_only=True, slots=False, eq=False)
class CalibratedPruningModifier(Modifier):
    """Base of pruning modifiers that need calibration inputs (not registered itself).

    Args:
        sparsity: fraction of weights set to zero in every target, in ``[0, 1)``
            (default ``0.5``). Ignored for N:M structures, whose pattern fixes it.
        mask_structure: ``"unstructured"`` (default) or ``"N:M"``: keep N weights
            of every M consecutive weights along the input dimension (``"2:4"``).
        targets: module patterns to prune: class names (``"Linear"``, the
            default), full module names, or ``"re:<regex>"`` matched against
            full names.
        ignore: module patterns never pruned (default ``["lm_head"]``). A module
            whose weight is tied to an ignored one is ignored too.
    """

    required_state = frozenset({"model", "calibration_data"})

    sparsity: float = attrs.field(default=0.5, validator=_sparsity)
    mask_structure: str = attrs.field(default="unstructured", validator=_mask_structure)
    targets: list[str] = attrs.field(
        factory=lambda: list(DEFAULT_TARGETS), converter=_patterns, validator=_non_empty
    )
    ignore: list[str] = attrs.field(factory=lambda: list(DEFAULT_IGNORE), converter=_patterns)

    # ---- runtime (not recipe arguments) ------------------------------------
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._clear()

    def _clear(self) -> None:
        self._targets: dict[str, nn.Module] = {}
        self._names_by_id: dict[int, str] = {}
        self._acc: dict[str, Any] = {}
        self._last_input: torch.Tensor | None = None
        self._last_acc: Any = None
        #: module name -> :class:`LayerResult`, in the order the modules were pruned.
        self.results: dict[str, LayerResult] = {}
        #: targets that never received a calibration input (left dense).
        self.skipped: list[str] = []

    @property
    def resolved_targets(self) -> dict[str, nn.Module]:
        """``{full name: module}`` selected at initialize (empty before)."""
        return dict(self._targets)

    # ---- subclass API ----------------------------------------------------------
    def _new_accumulator(self, module: nn.Module) -> Any:
        raise NotImplementedError

    def _prune_weight(self, module: nn.Module, accumulator: Any) -> torch.Tensor:
        """Return the pruned weight (same shape/dtype) for ``module`` from its statistics."""
        raise NotImplementedError

    def _prune_weights(self, modules: list[nn.Module], accumulator: Any) -> list[torch.Tensor]:
        """Pruned weights of ``modules``, which share ``accumulator`` (they saw the same inputs).

        Default: :meth:`_prune_weight` for each; override to share work across them.
        """
        return [self._prune_weight(module, accumulator) for module in modules]

    # ---- lifecycle -------------------------------------------------------------
    def on_initialize(self, state: Any) -> None:
        self._clear()
        targets = resolve_targets(state.model, self.targets, self.ignore)
        bad = [f"{name} ({type(m).__name__})" for name, m in targets.items() if not _is_prunable(m)]
        if bad:
            msg = (
                f"{type(self).__name__} prunes 2-D weights of Linear-like modules, but targets {self.targets} "
                f"also select {', '.join(bad[:5])}; narrow targets or add them to ignore"
            )
            raise ValueError(msg)
        self._targets = targets
        self._names_by_id = {id(m): name for name, m in targets.items()}

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
            for sub in root.modules():
                name = self._names_by_id.get(id(sub))
                if name is not None and name not in self.results:
                    pending[name] = sub
        self._prune_all(pending)
        self._last_input = None
        self._last_acc = None

    def on_calibration_end(self, state: Any) -> None:
        self._prune_all({name: m for name, m in self._targets.items() if name not in self.results})
        self._last_input = None
        self._last_acc = None
        self._acc.clear()
        self.remove_hooks()

    def on_finalize(self, state: Any) -> None:
        self._acc.clear()
        self._last_input = None
        self._last_acc = None

    # ---- work ------------------------------------------------------------------
    def _prune_all(self, modules: dict[str, nn.Module]) -> None:
        """Prune ``{name: module}``, each group of modules that share an accumulator in one call."""
        groups: dict[int, tuple[Any, list[tuple[str, nn.Module]]]] = {}
        for name, module in modules.items():
            acc = self._acc.pop(name, None)
            if acc is None or acc.num_samples == 0:
                if name not in self.skipped:
                    logger.warning("%s: %s received no calibration input; left dense", type(self).__name__, name)
                    self.skipped.append(name)
                continue
            groups.setdefault(id(acc), (acc, []))[1].append((name, module))
        for acc, members in groups.values():
            t0 = time.perf_counter()
            with torch.no_grad():
                new = self._prune_weights([module for _, module in members], acc)
                for (_, module), weight in zip(members, new, strict=True):
                    module.weight.copy_(weight)
            seconds = time.perf_counter() - t0
            total = sum(module.weight.numel() for _, module in members)
            for name, module in members:
                numel = module.weight.numel()
                self.results[name] = LayerResult(
                    zeros=numel - int(torch.count_nonzero(module.weight)),
                    numel=numel,
                    seconds=seconds * numel / total,
                    samples=acc.num_samples,
                )
                if name in self.skipped:
                    self.skipped.remove(name)


def _is_prunable(module: nn.Module) -> bool:
    """A Linear-like module: a 2-D ``[out, in]`` weight applied to the last dimension of its input."""
    weight = getattr(module, "weight", None)
    in_features = getattr(module, "in_features", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2 and in_features == weight.shape[1]
