"""LearningRateModifier: set the optimizer's learning rate by a schedule in epochs.

With ``e`` the epoch of the optimizer step about to run (``global_step /
steps_per_epoch`` at ``optim_pre_step``; ``global_step`` = optimizer steps done),
``e_0 = start`` (0 when omitted), ``e_1 = end`` and ``p = clamp((e - e_0) / (e_1 -
e_0), 0, 1)``, the learning rate of every parameter group is::

    constant:  init_lr
    linear:    init_lr + (final_lr - init_lr) * p
    cosine:    final_lr + (init_lr - final_lr) * (1 + cos(pi * p)) / 2
    step:      init_lr * gamma ** floor((e - e_0) / step_size)

It is written just before each optimizer step (``optim_pre_step``), so it wins
over any ``torch.optim.lr_scheduler`` (or the HF Trainer's scheduler) stepping
after the optimizer. At ``end`` the value at ``end`` is written, and written again
before every later optimizer step until finalize (``events_after_end``): a
scheduler stepping after the optimizer does not take the rate back (it did, found
by a tester: the HF Trainer's linear decay after ``end``). Before ``start`` the
optimizer's own learning rate is untouched. An ended modifier yields to another
``LearningRateModifier`` of the same optimizer that starts at or after its ``end``
(a warmup, then a decay): from that one's start on, the ended one writes nothing
(it wrote its end value over the decay when listed after it, found by a tester).

Two ``LearningRateModifier`` objects of one optimizer whose ranges ``[start, end)`` overlap (``end`` omitted: no
end) are refused at ``initialize``, before any rate is written: the recipe order silently decided which one set the
rate (a cosine decay over ``[0, 3)`` listed after a warmup over ``[0, 0.5)`` wrote over the warmup from step 0; listed
before it, the ended warmup wrote its end value over the decay at every step: found by a tester). Ranges that
follow each other (``[0, 0.5)`` then ``[0.5, 3)``) are taken. When the other one belongs to another live session
(one left running by an error), the refusal says that session holds the optimizer until it is finalized or reset.
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

import attrs

from llmc_fsm import Modifier

if TYPE_CHECKING:
    from llmc_fsm import Event, State

__all__ = ["SCHEDULES", "LearningRateModifier", "scheduled_lr"]

SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine", "step")

#: id(optimizer) -> the LearningRateModifiers initialized on it, in the order they were (an ended one yields to a
#: later one; a new one overlapping one of them is refused); entries are checked against the optimizer itself (an id
#: may be reused once an optimizer is gone)
_ON_OPTIMIZER: dict[int, weakref.WeakKeyDictionary[LearningRateModifier, None]] = {}


def _check_schedule(instance: Any, attribute: Any, value: Any) -> None:
    if value not in SCHEDULES:
        msg = f"unknown schedule {value!r}; use one of {', '.join(SCHEDULES)}"
        raise ValueError(msg)


def _check_schedule_args(schedule: Any, end: float | None, step_size: float | None) -> None:
    """Refuse an unknown schedule, ``linear``/``cosine`` without ``end`` and ``step`` without ``step_size``."""
    _check_schedule(None, None, schedule)
    if schedule in ("linear", "cosine") and end is None:
        msg = f"schedule {schedule!r} needs end (epochs): it runs from start to end"
        raise ValueError(msg)
    if schedule == "step" and step_size is None:
        msg = "schedule 'step' needs step_size (epochs between decays)"
        raise ValueError(msg)


def scheduled_lr(
    schedule: str,
    epoch: float,
    *,
    init_lr: float,
    final_lr: float = 0.0,
    start: float = 0.0,
    end: float | None = None,
    step_size: float | None = None,
    gamma: float = 0.1,
) -> float:
    """The closed form of ``schedule`` at ``epoch`` (see the module docstring).

    Raises:
        ValueError: an unknown ``schedule``, ``step`` without ``step_size``, or ``linear``/``cosine``
            without ``end``.
    """
    _check_schedule_args(schedule, end, step_size)
    if schedule == "constant":
        return init_lr
    if schedule == "step":
        return init_lr * gamma ** math.floor(max(epoch - start, 0.0) / cast(float, step_size) + 1e-9)
    progress = min(max((epoch - start) / (cast(float, end) - start), 0.0), 1.0)
    if schedule == "linear":  # weighted: exactly init_lr at start and final_lr from end (1e-2 + (1e-3 - 1e-2) is not)
        return init_lr * (1.0 - progress) + final_lr * progress
    return final_lr + (init_lr - final_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


def _range_text(start: float, end: float) -> str:
    return f"epochs [{start:g}, {end:g})" if end != math.inf else f"epochs {start:g} onwards (no end)"


def _overlap_message(first: tuple[str, float, float], second: tuple[str, float, float]) -> str:
    """The refusal of two overlapping ranges ``(label, start, end)`` (``end`` ``inf``: no end), ``first`` the one
    named first (the earlier start; the earlier end at the same start; recipe order for the same range)."""
    (e_label, e_start, e_end), (l_label, l_start, l_end) = first, second
    if l_start > e_start:
        fix = f"make one start where the other ends: end {e_label} at {l_label}'s start (end: {l_start:g})"
    elif e_end != l_end:
        fix = f"make one start where the other ends: start {l_label} at {e_label}'s end (start: {e_end:g})"
    else:
        fix = "keep one of them, or split the range so that one starts where the other ends"
    return (
        f"{e_label} ({_range_text(e_start, e_end)}) and {l_label} ({_range_text(l_start, l_end)}) both set the "
        "learning rate of the same optimizer over overlapping epochs, so their order in the recipe would decide "
        f"the rate; {fix}"
    )


def _held_message(label: str, span: tuple[float, float], other: str, other_span: tuple[float, float]) -> str:
    """The refusal of ``label`` (``span``) on an optimizer whose learning rate ``other``, a modifier of another live
    session, sets over an overlapping ``other_span``: no recipe order is at stake there (the advice to reorder or
    split the recipe named a recipe the conflict was not in, found by a tester), that session holds the optimizer."""
    return (
        f"{label} ({_range_text(*span)}) would set the learning rate of an optimizer that {other} of another live "
        f"session already sets ({_range_text(*other_span)}, overlapping): that session holds the optimizer until "
        "it is finalized; call finalize() or reset() on it (one left running by an error, e.g. in a notebook), or "
        "give this session its own optimizer"
    )


def _as_float(value: numbers.Real) -> float:
    """``float(value)``; an int too large for a float (``10**400``) as ``inf``, refused as such."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.inf > _as_float(value) > 0:
        msg = f"{attribute.name} must be a finite number > 0, got {value!r}"  # inf was taken (found by a tester)
        raise ValueError(msg)


#: The schedules that move from ``init_lr`` to ``final_lr``: ``init_lr`` 0 is a warmup from 0 there (as the HF
#: Trainer's warmup); with ``constant`` and ``step`` it would set the rate to 0 for every step.
FROM_ZERO: tuple[str, ...] = ("linear", "cosine")


def _init_lr(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """``init_lr``: a finite number > 0; 0 too with a schedule of :data:`FROM_ZERO` (refused before, found by a
    tester: a warmup from 0)."""
    if instance.schedule in FROM_ZERO and not isinstance(value, bool) and value == 0:
        return
    _positive(instance, attribute, value)


def _non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.inf > _as_float(value) >= 0:
        msg = f"{attribute.name} must be a finite number >= 0, got {value!r}"
        raise ValueError(msg)


def _opt_float(value: Any) -> Any:
    """Numbers -> float; numeric strings too (YAML 1.1 reads ``1e-4`` as the string "1e-4")."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return _as_float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else value


@attrs.define(kw_only=True, slots=False, eq=False)
class LearningRateModifier(Modifier):
    """Set the learning rate of every optimizer parameter group by a schedule between ``start`` and ``end`` epochs.

    Recipe arguments:

    - ``schedule``: ``"constant"`` (default), ``"linear"``, ``"cosine"`` or ``"step"``.
    - ``init_lr`` (> 0, required): the learning rate at ``start``; 0 is taken with ``linear`` and ``cosine`` (a
      warmup from 0 to ``final_lr``, which must then be > 0).
    - ``final_lr`` (>= 0, default 0): the learning rate at ``end`` (linear, cosine).
    - ``start`` (epochs, default: the first batch = epoch 0 for the formula), ``end``
      (epochs; required for linear and cosine; default for constant/step: until finalize).
    - ``step_size`` (epochs, > 0; required for step), ``gamma`` (default 0.1): the
      step schedule multiplies the rate by ``gamma`` every ``step_size`` epochs.

    Requires state ``optimizer``, and ``steps_per_epoch`` (the schedule is in epochs) unless the schedule is
    ``constant`` with no ``start``/``end``/``update`` (:meth:`required_keys`). From ``end`` until finalize
    the value at ``end`` is written before every optimizer step, unless another ``LearningRateModifier`` of the
    same optimizer starting at or after ``end`` has started (then it sets the rate). Two of one optimizer whose ranges
    ``[start, end)`` overlap are refused at ``initialize`` (:meth:`on_initialize`). :attr:`last_lr` is the value
    this modifier wrote last (the rate of the last optimizer step while it sets the rate).

    Raises:
        ValueError: an unknown schedule, a learning rate, ``step_size`` or ``gamma`` out of range (``init_lr`` 0
            with ``constant``/``step``, or with ``final_lr`` 0), ``linear``/``cosine`` without ``end``, ``step``
            without ``step_size``, or ``end`` not after ``start``.
    """

    required_state = frozenset({"optimizer", "steps_per_epoch"})
    optional_state = frozenset({"steps_per_epoch"})  # read when given; not required by a constant rate (required_keys)
    conditional_state: ClassVar[Mapping[str, str]] = {
        "steps_per_epoch": "unless the schedule is constant with no start/end/update"
    }
    events = frozenset({"optim_pre_step"})
    events_after_end = frozenset({"optim_pre_step"})  # the value at end kept until finalize, over any scheduler

    schedule: str = attrs.field(default="constant", validator=_check_schedule)
    init_lr: float = attrs.field(converter=_opt_float, validator=_init_lr)
    final_lr: float = attrs.field(default=0.0, converter=_opt_float, validator=_non_negative)
    step_size: float | None = attrs.field(default=None, converter=_opt_float, validator=_positive)
    gamma: float = attrs.field(default=0.1, converter=_opt_float, validator=_positive)

    last_lr: float | None = attrs.field(default=None, init=False)
    _optimizer: Any = attrs.field(default=None, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        _check_schedule_args(self.schedule, self.end, self.step_size)
        if self.init_lr == 0 and self.final_lr == 0:
            msg = (
                f"init_lr and final_lr are both 0: schedule {self.schedule!r} would set the learning rate to 0 at "
                "every step; give final_lr > 0 (a warmup from 0 to final_lr)"
            )
            raise ValueError(msg)

    def required_keys(self) -> frozenset[str]:
        """``optimizer``, and ``steps_per_epoch`` unless the schedule is ``constant`` with no ``start``/``end``/
        ``update`` (the same rate at every step needs no epoch; it was required, with a message naming a schedule in
        epochs the modifier did not have: found by a tester)."""
        if self.schedule == "constant" and not self.is_scheduled:
            return frozenset({"optimizer"})
        return frozenset(self.required_state)

    def lr_at(self, epoch: float) -> float:
        """The learning rate this modifier sets for the optimizer step at ``epoch``."""
        return scheduled_lr(
            self.schedule,
            epoch,
            init_lr=self.init_lr,
            final_lr=self.final_lr,
            start=self.start or 0.0,
            end=self.end,
            step_size=self.step_size,
            gamma=self.gamma,
        )

    def _yielded(self, epoch: float) -> bool:
        """Whether, ended, this modifier leaves the rate to another of its optimizer that started at or after its
        ``end`` (a warmup followed by a decay, whatever their order in the recipe)."""
        if self.end is None or epoch < self.end:
            return False
        peers = _ON_OPTIMIZER.get(id(self._optimizer), ())
        return any(
            other is not self and other._optimizer is self._optimizer and self.end <= (other.start or 0.0) <= epoch
            for other in peers
        )

    def _range(self) -> tuple[float, float]:
        """``[start, end)`` in epochs: ``start`` omitted is 0, ``end`` omitted ``inf``."""
        return (self.start or 0.0, math.inf if self.end is None else self.end)

    def _label(self, session: Any) -> str:
        """This modifier's label in its session (``LearningRateModifier#2``), ``of another session`` added when
        that is not ``session``."""
        binding = self._binding
        if binding is None:
            return self.modifier_name()
        return binding.label if binding.session() is session else f"{binding.label} of another session"

    def _check_overlap(self, optimizer: Any) -> None:
        """Refuse a range that overlaps the range of a modifier already initialized on ``optimizer``.

        Raises:
            ValueError: naming both modifiers, both ranges and what to do.
        """
        binding = self._binding
        session = binding.session() if binding is not None else None
        start, end = self._range()
        for other in _ON_OPTIMIZER.get(id(optimizer), {}):
            if other is self or other._optimizer is not optimizer:
                continue
            o_start, o_end = other._range()
            if not (start < o_end and o_start < end):
                continue
            o_binding = other._binding
            if o_binding is not None and session is not None and o_binding.session() is not session:
                raise ValueError(_held_message(self._label(session), (start, end), o_binding.label, (o_start, o_end)))
            mine, theirs = (self._label(session), start, end), (other._label(session), o_start, o_end)
            first, second = (mine, theirs) if (start, end) < (o_start, o_end) else (theirs, mine)
            raise ValueError(_overlap_message(first, second))

    def _set(self, epoch: float) -> None:
        lr = self.lr_at(epoch)
        for group in self._optimizer.param_groups:
            group["lr"] = lr
        self.last_lr = lr

    def on_initialize(self, state: State) -> None:
        """Hold the optimizer whose learning rate the schedule sets; nothing is held when it raises.

        Raises:
            TypeError: state ``optimizer`` has no ``param_groups``.
            ValueError: another ``LearningRateModifier`` initialized on the same optimizer (an earlier one of the
                recipe, or one of another live session) has a range ``[start, end)`` overlapping this one's.
        """
        optimizer = state.optimizer
        if not hasattr(optimizer, "param_groups"):
            msg = f"state 'optimizer' must be a torch.optim.Optimizer (with param_groups), got {type(optimizer)!r}"
            raise TypeError(msg)
        self._check_overlap(optimizer)
        self._optimizer = optimizer
        self.last_lr = None  # a read-out of this run only (a reused object kept the last run's, found by a tester)
        _ON_OPTIMIZER.setdefault(id(optimizer), weakref.WeakKeyDictionary())[self] = None

    def on_start(self, state: State, event: Event) -> None:
        self._set(event.epoch or 0.0)

    def on_event(self, state: State, event: Event) -> None:
        epoch = cast(float, event.epoch)  # steps_per_epoch is required
        if self.end is not None and epoch >= self.end:
            if not self._yielded(epoch):
                self._set(self.end)  # after end: the value at end
            return
        self._set(epoch)

    def on_end(self, state: State, event: Event) -> None:
        if self.end is not None and event.type != "finalize" and not self._yielded(event.epoch or 0.0):
            self._set(self.end)

    def on_finalize(self, state: State) -> None:
        peers = _ON_OPTIMIZER.get(id(self._optimizer))
        if peers is not None:
            peers.pop(self, None)
            if not peers:
                del _ON_OPTIMIZER[id(self._optimizer)]
        self._optimizer = None

    def state_dict(self) -> dict[str, Any]:
        """The schedule position: the rate written last (``last_lr``; every later rate is a closed form of the step)."""
        return {"last_lr": self.last_lr}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` after ``on_initialize`` (the optimizer's own rates come with its state dict).

        Raises:
            ValueError: ``last_lr`` is not a number or ``None``.
        """
        last = state.get("last_lr")
        if last is not None and (isinstance(last, bool) or not isinstance(last, numbers.Real)):
            msg = f"last_lr must be a number or None, got {last!r}"
            raise ValueError(msg)
        self.last_lr = None if last is None else float(last)
