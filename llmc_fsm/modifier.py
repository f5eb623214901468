"""The :class:`Modifier` base class every compression algorithm derives from.

A modifier is an attrs class: its recipe arguments are attrs fields, validated
by attrs validators/converters when the recipe is resolved (so a bad argument
fails when the session is created, before any state is gathered). It declares
the state keys it needs in ``required_state``; the session checks them at
``initialize`` and calls :meth:`Modifier.on_initialize` exactly once.

Hooks (all optional; the session only calls the ones a class overrides):

==============================  ==================================================
``on_initialize(state)``        once, with the complete, frozen state
``on_start(state, event)``      when the schedule reaches ``start``
``on_update(state, event)``     every ``update`` epochs between start and end
``on_end(state, event)``        when the schedule reaches ``end`` (or at finalize)
``on_event(state, event)``      for each batch event in ``events`` while active
``on_calibration_start(state)`` one-shot calibration begins
``on_sequential_epoch_end(state, modules)``  a group of layers has been calibrated
``on_calibration_end(state)``   one-shot calibration ends
``on_finalize(state)``          once, at finalize (or when initialize is rolled back)
==============================  ==================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

if TYPE_CHECKING:
    import torch

    from llmc_fsm.state import State

__all__ = ["BATCH_EVENTS", "Event", "Modifier"]

#: The per-batch events, in the order they occur inside one batch.
BATCH_EVENTS: frozenset[str] = frozenset(
    {"batch_start", "loss_calculated", "optim_pre_step", "optim_post_step", "batch_end"}
)


class Event:
    """What a modifier learns about the current event.

    The session reuses one instance per session and mutates it in place (an
    allocation per event would be measurable); do not keep a reference to it.

    Attributes:
        type: the event name, e.g. ``"optim_post_step"``.
        global_step: optimizer steps completed so far (``int``); during a batch it
            is the index of the optimizer step the batch contributes to.
        epoch: ``global_step / steps_per_epoch`` (``float``), or ``None`` when the
            state has no ``steps_per_epoch``.
        batch: the batch passed to ``batch_start`` (any type), or ``None``.
        loss: the loss passed to ``loss_calculated`` (a scalar tensor), or ``None``.
    """

    __slots__ = ("batch", "epoch", "global_step", "loss", "type")

    def __init__(self) -> None:
        self.type: str = ""
        self.global_step: int = 0
        self.epoch: float | None = None
        self.batch: Any = None
        self.loss: Any = None

    def __repr__(self) -> str:
        return f"Event(type={self.type!r}, global_step={self.global_step}, epoch={self.epoch})"


def _optional_epoch(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"must be a number of epochs or null, got {value!r}"
        raise TypeError(msg)
    return float(value)


def _check_schedule(instance: Modifier, attribute: attrs.Attribute, value: float | None) -> None:
    if value is None:
        return
    if attribute.name == "update" and value <= 0:
        msg = f"update must be > 0 epochs, got {value}"
        raise ValueError(msg)
    if attribute.name == "start" and value < 0:
        msg = f"start must be >= 0 epochs, got {value}"
        raise ValueError(msg)


@attrs.define(kw_only=True, slots=False, eq=False)
class Modifier:
    """Base class for compression modifiers (pruning, quantization, distillation, schedules).

    Subclass it with ``@attrs.define(kw_only=True, slots=False, eq=False)`` and
    declare recipe arguments as attrs fields with validators. Class attributes:

    - ``required_state``: state keys :meth:`on_initialize` needs; ``initialize``
      refuses to run until every modifier's keys are present.
    - ``optional_state``: keys used when present.
    - ``events``: the batch events :meth:`on_event` handles (default: none).
      Declaring them lets the session skip this modifier on every other event.
    - ``runs_after``: names of modifiers this one must follow within an event.

    Recipe fields shared by every modifier (all in epochs, ``float``):

    - ``start``: when :meth:`on_start` fires; ``None`` (default) = at the first event.
    - ``end``: when :meth:`on_end` fires; ``None`` (default) = active until finalize.
    - ``update``: period of :meth:`on_update` between start and end; ``None`` = never.

    A modifier with a numeric ``start``, ``end`` or ``update`` also requires
    ``steps_per_epoch`` (steps are turned into epochs with it).

    Raises (at construction): ``TypeError``/``ValueError`` from attrs validators
    for bad arguments, e.g. ``end`` not after ``start``.
    """

    required_state: ClassVar[frozenset[str]] = frozenset()
    optional_state: ClassVar[frozenset[str]] = frozenset()
    events: ClassVar[frozenset[str]] = frozenset()
    runs_after: ClassVar[frozenset[str]] = frozenset()

    start: float | None = attrs.field(default=None, converter=_optional_epoch, validator=_check_schedule)
    end: float | None = attrs.field(default=None, converter=_optional_epoch, validator=_check_schedule)
    update: float | None = attrs.field(default=None, converter=_optional_epoch, validator=_check_schedule)

    def __attrs_post_init__(self) -> None:
        if self.start is not None and self.end is not None and self.end <= self.start:
            msg = f"end ({self.end}) must be after start ({self.start})"
            raise ValueError(msg)

    # --- declared needs ---------------------------------------------------
    @classmethod
    def modifier_name(cls) -> str:
        """The name recipes use for this class (the class name)."""
        return cls.__name__

    @classmethod
    def description(cls) -> str:
        """First line of the class docstring."""
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    def required_keys(self) -> frozenset[str]:
        """The state keys this instance needs at ``initialize``.

        ``required_state`` plus ``steps_per_epoch`` when the schedule is numeric.
        """
        if self.is_scheduled:
            return self.required_state | {"steps_per_epoch"}
        return self.required_state

    @property
    def is_scheduled(self) -> bool:
        """Whether ``start``, ``end`` or ``update`` is set (needs ``steps_per_epoch``)."""
        return self.start is not None or self.end is not None or self.update is not None

    @property
    def resolved_targets(self) -> dict[str, torch.nn.Module]:
        """``{full module name: module}`` this modifier compresses, selected at initialize.

        The one public way for a modifier to say which modules it touches: the
        one-shot report, the pipeline's target check and the checkpoint code
        read it. Empty before ``initialize`` and for modifiers that touch no
        module (schedules, distillation); subclasses that select modules override it.
        """
        return {}

    # --- torch hooks that finalize always removes ---------------------------
    def register_hook(
        self,
        module: torch.nn.Module,
        hook: Callable[..., Any],
        kind: str = "forward",
        **kwargs: Any,
    ) -> Any:
        """Register a torch hook on ``module`` that the session removes at finalize.

        Args:
            module: the ``torch.nn.Module`` to hook.
            hook: the hook function, with the signature torch expects for ``kind``.
            kind: ``"forward"``, ``"forward_pre"``, ``"full_backward"`` or
                ``"full_backward_pre"`` (``module.register_<kind>_hook``).
            **kwargs: passed on (e.g. ``with_kwargs=True``).

        Returns:
            the torch ``RemovableHandle``.

        Raises:
            ValueError: unknown ``kind``.
        """
        if kind not in {"forward", "forward_pre", "full_backward", "full_backward_pre"}:
            msg = f"unknown hook kind {kind!r}; use forward, forward_pre, full_backward or full_backward_pre"
            raise ValueError(msg)
        handle = getattr(module, f"register_{kind}_hook")(hook, **kwargs)
        self.__dict__.setdefault("_llmc_fsm_hooks", []).append(handle)
        return handle

    def remove_hooks(self) -> int:
        """Remove every hook registered with :meth:`register_hook`; return how many."""
        handles = self.__dict__.pop("_llmc_fsm_hooks", [])
        for handle in handles:
            handle.remove()
        return len(handles)

    @property
    def num_hooks(self) -> int:
        """Number of live hooks registered with :meth:`register_hook`."""
        return len(self.__dict__.get("_llmc_fsm_hooks", ()))

    # --- lifecycle hooks (no-ops; override what you need) -------------------
    def on_initialize(self, state: State) -> None:
        """Prepare with the complete state; raise if something is unusable."""

    def on_start(self, state: State, event: Event) -> None:
        """Begin the modifier's active period."""

    def on_update(self, state: State, event: Event) -> None:
        """Periodic update while active (every ``update`` epochs)."""

    def on_end(self, state: State, event: Event) -> None:
        """End the active period (at ``end``, or at finalize when ``end`` is omitted)."""

    def on_event(self, state: State, event: Event) -> Any:
        """Handle a batch event listed in ``events``; for ``loss_calculated`` a
        returned tensor replaces the loss."""

    def on_calibration_start(self, state: State) -> None:
        """One-shot calibration begins: attach observers/hooks."""

    def on_sequential_epoch_end(self, state: State, modules: Any) -> None:
        """Calibration data has passed through ``modules``: compress them now."""

    def on_calibration_end(self, state: State) -> None:
        """One-shot calibration has ended."""

    def on_finalize(self, state: State) -> None:
        """Leave the model in its final form; release everything."""
