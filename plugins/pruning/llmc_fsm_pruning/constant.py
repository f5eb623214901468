"""ConstantPruningModifier: keep the weights that are zero now at zero while training.

The masks are taken when the modifier starts (``on_start``: the first batch, or
``start`` epochs in): a targeted weight with ``|w| <= 1e-8`` (:data:`PRUNED_AT_MOST`,
llm-compressor's threshold, so both hold the same weights) counts as pruned. The masks
are re-applied after every optimizer step (``optim_post_step``) and at ``end``, so
after any number of optimizer steps the zero weights are exactly the weights pruned
at start, whatever the optimizer (momentum and weight decay included). With ``end``
omitted the masks hold until ``finalize``.

The helpers :class:`MaskSet` and :func:`weight_sparsity` are shared with
:mod:`llmc_fsm_pruning.magnitude`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from llmc_fsm import Modifier
from llmc_fsm.toolkit import DEFAULT_IGNORE, DEFAULT_TARGETS, pack_mask, patterns, resolve_targets, unpack_mask

if TYPE_CHECKING:
    from llmc_fsm import Event, State

__all__ = [
    "PRUNED_AT_MOST",
    "ConstantPruningModifier",
    "MaskSet",
    "kept_weights",
    "load_masks_state",
    "masks_state",
    "weight_sparsity",
]

logger = logging.getLogger(__name__)

#: A targeted weight with ``|w|`` at most this when ConstantPruningModifier starts counts as pruned (held at 0), as
#: in llm-compressor 0.14, which keeps ``|w| > 1e-8`` (ours kept ``w != 0``: a weight of 1e-9 was held at 0 by one
#: and not by the other, found by a tester).
PRUNED_AT_MOST = 1e-8


def kept_weights(weight: torch.Tensor) -> torch.Tensor:
    """The bool keep-mask ConstantPruningModifier takes of ``weight`` (same shape and device): ``|w| > 1e-8``
    (:data:`PRUNED_AT_MOST`) compared in the weight's own dtype, as llm-compressor does (for bfloat16 the value
    nearest 1e-8 is then not kept). One-byte dtypes (float8, int8) are compared as ``w != 0``: the same set, as
    none has a value strictly between 0 and 1e-8, and torch has no ``>`` for float8 on the CPU."""
    if weight.element_size() == 1:
        return weight != 0
    return weight.abs() > PRUNED_AT_MOST


def weight_sparsity(weights: Mapping[str, torch.Tensor]) -> tuple[float, dict[str, float]]:
    """``(overall fraction of exact zeros, {module name: fraction})`` of ``weights``, measured on the tensors.

    (The one-shot report measures every Linear of a model: :func:`llmc_fsm.report.build.measure_sparsity`.)
    """
    per_module: dict[str, float] = {}
    zeros = total = 0
    with torch.no_grad():
        for name, weight in weights.items():
            z = weight.numel() - int(torch.count_nonzero(weight))
            n = weight.numel()
            per_module[name] = z / n if n else 0.0
            zeros += z
            total += n
    return (zeros / total if total else 0.0), per_module


class MaskSet:
    """Keep-masks for a list of weights, re-applied with one fused ``torch._foreach_mul_`` call.

    Masks are stored as 0/1 tensors in the weight's dtype (a ``bool`` mask would
    need a dtype promotion per call, ~6x slower); that costs one weight-sized
    tensor per targeted weight. Each mask lives on its weight's device and follows
    it: a weight moved or cast after the masks were taken (``model.to(...)``, which
    keeps the ``Parameter`` objects between the CPU and CUDA) gets its mask
    moved/cast at the next :meth:`apply`.
    """

    __slots__ = ("masks", "names", "weights")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.weights: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []

    def set(self, name: str, weight: torch.Tensor, keep: torch.Tensor) -> None:
        """Set (or replace) the keep-mask of ``weight`` (``keep``: bool, True = keep)."""
        mask = keep.to(device=weight.device, dtype=weight.dtype)
        if name in self.names:
            self.masks[self.names.index(name)] = mask
        else:
            self.names.append(name)
            self.weights.append(weight)
            self.masks.append(mask)

    def keep(self, name: str) -> torch.Tensor:
        """The current bool keep-mask of ``name``, on its weight's device."""
        i = self.names.index(name)
        return (self.masks[i] != 0).to(self.weights[i].device)

    def follow(self) -> None:
        """Move (cast) every mask to its weight's current device (dtype); nothing is copied for the others."""
        for i, (weight, mask) in enumerate(zip(self.weights, self.masks, strict=True)):
            if mask.device != weight.device or mask.dtype != weight.dtype:
                self.masks[i] = mask.to(device=weight.device, dtype=weight.dtype)

    def apply(self) -> None:
        """Zero every masked-out weight (in place, outside autograd), each mask on its weight's device."""
        if self.weights:
            self.follow()
            with torch.no_grad():
                torch._foreach_mul_(self.weights, self.masks)

    def clear(self) -> None:
        self.names.clear()
        self.weights.clear()
        self.masks.clear()

    def packed(self) -> dict[str, torch.Tensor]:
        """``{name: bit-packed keep-mask}`` for a checkpoint
        (:func:`llmc_fsm.toolkit.masks.pack_mask`: 1 bit/weight)."""
        return {name: pack_mask(mask != 0) for name, mask in zip(self.names, self.masks, strict=True)}

    def load_packed(self, packed: Mapping[str, torch.Tensor], modules: Mapping[str, torch.nn.Module]) -> None:
        """Replace every mask by ``packed`` (from :meth:`packed`) for the weights of ``modules``.

        Raises:
            ValueError: a mask for a module not in ``modules``, or of the wrong size
                (checked for all before anything changes).
        """
        unknown = sorted(set(packed) - set(modules))
        if unknown:
            msg = f"masks for modules this modifier does not target: {unknown}"
            raise ValueError(msg)
        keeps = {}
        for name, bits in packed.items():
            try:
                keeps[name] = unpack_mask(bits, modules[name].weight.shape)
            except ValueError as exc:
                msg = f"mask of {name}: {exc}"
                raise ValueError(msg) from None
        self.clear()
        for name, keep in keeps.items():
            self.set(name, modules[name].weight, keep)

    def __len__(self) -> int:
        return len(self.weights)


def masks_state(modifier: Any) -> dict[str, Any]:
    """Checkpoint state of a modifier holding ``_masks`` (a :class:`MaskSet`) and measured sparsity."""
    return {
        "masks": modifier._masks.packed(),
        "measured_sparsity": modifier.measured_sparsity,
        "module_sparsity": dict(modifier.module_sparsity),
    }


def load_masks_state(modifier: Any, state: Mapping[str, Any]) -> None:
    """Restore :func:`masks_state` into ``modifier`` (after initialize: masks for its ``resolved_targets``) and apply
    the masks to the weights at once: the first step after a resume computes on masked weights also when the model's
    own checkpoint left the pruned weights out (a peft adapter checkpoint holds no base weights: the resumed run
    differed from the uninterrupted one, found by a tester); on weights saved with the masks, nothing changes.

    Raises:
        ValueError: a mask for a module the modifier does not target, or of the wrong size.
    """
    modifier._masks.load_packed(state.get("masks", {}), modifier.resolved_targets)
    modifier._masks.apply()
    modifier.measured_sparsity = state.get("measured_sparsity")
    modifier.module_sparsity = dict(state.get("module_sparsity", {}))


@attrs.define(kw_only=True, slots=False, eq=False)
class ConstantPruningModifier(Modifier):
    """Hold the current zeros of the targeted weights at zero: masks re-applied after every optimizer step.

    Recipe arguments:

    - ``targets``: module patterns to hold (class name such as ``"Linear"``, full
      module name, or ``"re:<regex>"``); default ``["Linear"]``.
    - ``ignore``: module patterns to leave alone; default ``["lm_head"]`` (a weight
      tied to an ignored module is left alone too).
    - ``start`` / ``end`` (epochs): masks are taken at ``start`` (default: the
      first batch) and held until ``end`` (default: until finalize). A weight with
      ``|w| <= 1e-8`` (:data:`PRUNED_AT_MOST`) at start counts as pruned, as in
      llm-compressor: it is set to exactly 0 by the first optimizer step (or ``end``).

    Requires state ``model``. After it ends, :attr:`measured_sparsity` and
    :attr:`module_sparsity` (``{module name: fraction}``) report the zeros measured on the weights.
    """

    required_state = frozenset({"model"})
    events = frozenset({"optim_post_step"})
    #: It keeps existing zeros and makes no new ones beyond weights of |w| <= 1e-8 (set to 0, a value on every
    #: quantization grid): one-shot does not refuse it after a quantizing modifier.
    adds_zeros = False

    targets: list[str] = attrs.field(factory=lambda: list(DEFAULT_TARGETS), converter=patterns)
    ignore: list[str] = attrs.field(factory=lambda: list(DEFAULT_IGNORE), converter=patterns)

    measured_sparsity: float | None = attrs.field(default=None, init=False)
    module_sparsity: dict[str, float] = attrs.field(factory=dict, init=False)
    _modules: dict[str, torch.nn.Module] = attrs.field(factory=dict, init=False, repr=False)
    _masks: MaskSet = attrs.field(factory=MaskSet, init=False, repr=False)

    @property
    def resolved_targets(self) -> dict[str, torch.nn.Module]:
        """``{full name: module}`` selected at initialize (empty before)."""
        return dict(self._modules)

    def on_initialize(self, state: State) -> None:
        self._modules = resolve_targets(state.model, self.targets, self.ignore, views=True)
        self.measured_sparsity, self.module_sparsity = None, {}  # read-outs of this run only (a reused object)

    def on_start(self, state: State, event: Event) -> None:
        self._masks.clear()
        with torch.no_grad():
            for name, module in self._modules.items():
                self._masks.set(name, module.weight, kept_weights(module.weight))
        overall, _ = weight_sparsity(dict(zip(self._masks.names, self._masks.masks, strict=True)))  # held zeros
        logger.info("ConstantPruningModifier: holding %d weights at sparsity %.4f", len(self._masks), overall)

    def on_event(self, state: State, event: Event) -> None:
        self._masks.apply()

    def on_end(self, state: State, event: Event) -> None:
        self._masks.apply()
        self.measured_sparsity, self.module_sparsity = weight_sparsity({n: m.weight for n, m in self._modules.items()})
        logger.info("ConstantPruningModifier: measured sparsity %.4f at end", self.measured_sparsity)
        self._masks.clear()

    def on_finalize(self, state: State) -> None:
        self._masks.clear()
        self._modules = {}

    def state_dict(self) -> dict[str, Any]:
        """The held masks (bit-packed, ``{module name: uint8}``) and the sparsity measured at end."""
        return masks_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` after ``on_initialize``.

        Raises:
            ValueError: a mask for a module this modifier does not target, or of the wrong size.
        """
        load_masks_state(self, state)
