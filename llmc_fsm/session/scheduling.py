"""Scheduling bookkeeping of one session run (used by :class:`~llmc_fsm.Session`).

For every modifier a :class:`Slot` records whether it has started or ended and
when its next ``on_update`` is due. :class:`Schedule` advances them at the
opening events (``batch_start``, ``calibration_start``), ends the ones whose
``end`` the step count has reached at ``batch_end`` too, and keeps, per event,
the tuple of modifiers that handle it — rebuilt only when a modifier starts or
ends, so dispatching an event is one dictionary lookup and a loop.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from llmc_fsm.core.guard import Guard, module_parameters, watched_parameters, without
from llmc_fsm.core.lifecycle import BATCH_EVENTS, CALIBRATION_EVENTS, EVENTS
from llmc_fsm.core.modifier import Modifier, _Binding, modifier_labels, overrides

__all__ = ["Schedule", "Slot", "calibrates_only", "handles"]

#: Serializes binding modifiers to sessions (two sessions initializing one modifier object at once).
_BINDING_LOCK = threading.Lock()
_LIVE = ("initialized", "running")
#: Epochs: a schedule point (start, end, start + k * update) within this of the session's epoch is reached. The
#: epoch is step / steps_per_epoch and the points are sums of recipe floats: 3 / 10 < 0.1 + 0.2 in binary floats,
#: and without it the update due at epoch 0.3 of a 10-step epoch (update 0.1) would not fire: the next step's
#: would, one update fewer.
EPOCH_TOLERANCE = 1e-9


class Slot:
    """Per-modifier bookkeeping of one session run.

    Attributes:
        modifier: the modifier.
        label: its label in the session (see :func:`~llmc_fsm.core.modifier.modifier_labels`).
        started, ended: whether ``on_start`` / ``on_end`` has fired.
        next_update: the epoch of the next ``on_update``, or ``None``.
        guard: the version counters that guard its hooks (:class:`~llmc_fsm.core.guard.Guard`).
    """

    __slots__ = ("ended", "guard", "label", "modifier", "next_update", "started")

    def __init__(self, modifier: Modifier, label: str) -> None:
        self.modifier = modifier
        self.label = label
        self.started = False
        self.ended = False
        self.next_update: float | None = None
        self.guard = Guard()

    @property
    def has_schedule_work(self) -> bool:
        """Whether a later opening event may still start, update or end it."""
        m = self.modifier
        return not self.ended and (not self.started or m.end is not None or self.next_update is not None)

    @property
    def calibrates_only(self) -> bool:
        """Whether its modifier acts on calibration events only (:func:`calibrates_only`)."""
        return calibrates_only(self.modifier)

    def handles(self, event: str) -> bool:
        """Whether its modifier has a hook for ``event`` (:func:`handles`)."""
        return handles(self.modifier, event)


def handles(modifier: Modifier, event: str) -> bool:
    """Whether ``modifier`` has a hook for ``event`` (``on_event`` + ``events``, or ``on_<calibration event>``)."""
    if event in BATCH_EVENTS:
        return event in modifier.events
    return overrides(modifier, f"on_{event}")


def calibrates_only(modifier: Modifier) -> bool:
    """Whether ``modifier`` acts on calibration events and on nothing a training loop sends (no batch event, no
    ``on_start`` / ``on_update`` / ``on_end``): GPTQ, round-to-nearest, SparseGPT, AWQ."""
    return (
        any(handles(modifier, e) for e in CALIBRATION_EVENTS)
        and not any(handles(modifier, e) for e in BATCH_EVENTS)
        and not any(overrides(modifier, hook) for hook in ("on_start", "on_update", "on_end"))
    )


def _release(bound: list[tuple[weakref.ref, _Binding]]) -> None:
    """A session garbage-collected while its modifiers were bound to it (dropped without ``finalize()`` or
    ``reset()``, e.g. a notebook cell run again): remove the hooks those modifiers still hold on the model and
    their binding. Each re-run added a set of hooks that went on feeding the dead run's statistics on every forward
    (found by a tester). A modifier bound since to another session is left alone. Takes no lock: it runs inside the
    garbage collector, at any point of any thread."""
    for ref, binding in bound:
        modifier = ref()
        if modifier is not None and modifier.__dict__.get("_llmc_fsm_binding") is binding:
            modifier.remove_hooks()
            modifier.__dict__.pop("_llmc_fsm_binding", None)


class Schedule:
    """The slots of a recipe's modifiers and the per-event dispatch tables derived from them.

    Attributes:
        slots: one :class:`Slot` per modifier, in execution order.
        pending: slots the next opening event may start, update or end.
        handlers: event -> the active slots that handle it, in execution order (an ended slot too, for the events
            of its modifier's ``events_after_end``).
        dispatch: batch event -> ``(slot, bound on_event, its guard for that event)`` of those slots
            (the hot path unpacks one tuple per modifier).
    """

    def __init__(self, modifiers: list[Modifier]) -> None:
        self.slots = [Slot(m, label) for m, label in zip(modifiers, modifier_labels(modifiers), strict=True)]
        self.pending: list[Slot] = []
        self.handlers: dict[str, tuple[Slot, ...]] = {}
        self.dispatch: dict[str, tuple[tuple[Slot, Callable[..., Any], Guard], ...]] = {}
        self.clear()

    def begin(self) -> None:
        """Arm the schedule (at ``initialize``): every slot is pending."""
        self.pending = list(self.slots)

    def clear(self) -> None:
        """Nothing pending, nothing dispatched (at ``finalize``/``reset``)."""
        self.pending = []
        self.handlers = {event: () for event in EVENTS}
        self.dispatch = {event: () for event in BATCH_EVENTS}

    def rebuild(self) -> None:
        """Recompute ``pending`` and ``handlers`` from the slots."""
        self.pending = [slot for slot in self.slots if slot.has_schedule_work]
        self.handlers = {
            event: tuple(
                s
                for s in self.slots
                if s.started and (not s.ended or event in s.modifier.events_after_end) and s.handles(event)
            )
            for event in EVENTS
        }
        self.dispatch = {
            event: tuple((s, s.modifier.on_event, s.guard.for_hook(event)) for s in self.handlers[event])
            for event in BATCH_EVENTS
        }

    def advance(self, epoch: float | None, call: Callable[[Slot, str], Any], *, ends_only: bool = False) -> None:
        """Fire ``on_start`` / ``on_update`` / ``on_end`` (through ``call(slot, hook)``) for the slots due at ``epoch``.

        With ``ends_only`` (at ``batch_end``, after the optimizer step that reached it: an evaluation or checkpoint
        taken at that step then holds the end; found by a tester) only ``on_end`` of the started slots whose ``end``
        ``epoch`` has reached; a slot not started yet waits for the next opening event, as do updates. The
        bookkeeping of a slot is updated before its hook runs, and the dispatch tables are rebuilt even when a hook
        raises.
        """
        changed = False
        try:
            for slot in self.pending:
                m = slot.modifier
                if not slot.started:
                    if ends_only or (m.start is not None and (epoch is None or epoch < m.start - EPOCH_TOLERANCE)):
                        continue
                    slot.started = changed = True
                    if m.update is not None:
                        slot.next_update = (m.start or 0.0) + m.update
                    call(slot, "on_start")
                ending = m.end is not None and epoch is not None and epoch >= m.end - EPOCH_TOLERANCE
                due = None if ending or ends_only else slot.next_update
                if due is not None and epoch is not None and epoch >= due - EPOCH_TOLERANCE:
                    # the first point start + k * update after epoch, by multiplication: a running sum drifts
                    base, every = m.start or 0.0, m.update
                    slot.next_update = base + (math.floor((epoch - base) / every + EPOCH_TOLERANCE) + 1) * every
                    call(slot, "on_update")
                if ending:
                    slot.ended = changed = True
                    slot.next_update = None
                    call(slot, "on_end")
        finally:
            if changed:
                self.rebuild()

    # --- which live session a modifier object belongs to ---------------------------
    def bind(self, owner: Any) -> str | None:
        """Bind every modifier to the session ``owner``; return why not (nothing bound) or ``None``.

        Refused: a modifier object listed twice, or bound to another live session
        (initializing it again would undo that session's work).
        """
        with _BINDING_LOCK:
            seen: dict[int, str] = {}
            for slot in self.slots:
                m = slot.modifier
                if id(m) in seen:
                    return (
                        f"{slot.label} is the same object as {seen[id(m)]} in this recipe; each recipe entry "
                        "needs its own modifier object (one object holds one run's state)."
                    )
                seen[id(m)] = slot.label
                binding = m._binding
                other = binding.origin_session() if binding is not None else None  # a copy: its original's
                if other is not None and other is not owner and other.lifecycle in _LIVE:
                    return (
                        f"modifier {slot.label} (this object, or a copy of it: a copy shares its run state) is bound "
                        f"to another live session {other!r}; initializing it here would undo that session's work "
                        "(its targets, masks, schedule and hooks). Finalize or reset that session first, or give "
                        "this session its own modifier objects (e.g. build the recipe again)."
                    )
            bound = []
            for slot in self.slots:
                binding = _Binding(owner, slot.label, slot.modifier)
                slot.modifier.__dict__["_llmc_fsm_binding"] = binding
                bound.append((weakref.ref(slot.modifier), binding))
                # its own hook list from here (the live handles kept, for finalize to remove): a copy made by a
                # __getstate__ of its own may share its original's list, and two copies run in two sessions removed
                # each other's hooks at finalize (found by a tester)
                hooks = slot.modifier.__dict__.get("_llmc_fsm_hooks")
                if hooks is not None:
                    slot.modifier.__dict__["_llmc_fsm_hooks"] = list(hooks)
            weakref.finalize(owner, _release, bound)
        return None

    def watch(self, state: Mapping[str, Any]) -> None:
        """After ``on_initialize``: build each modifier's :class:`~llmc_fsm.core.guard.Guard`.

        Its targeted parameters are read before each hook; every other parameter of the modules in ``state``
        lazily (see :mod:`llmc_fsm.core.guard`). The modifier's torch hooks use the same guard.

        Raises:
            ValueError: a modifier's ``resolved_targets`` is not a mapping of names to ``nn.Module`` (a raw
                ``AttributeError`` deep in the guard before: found by a tester); nothing is built.
        """
        for slot in self.slots:
            targets = slot.modifier.resolved_targets
            if not isinstance(targets, Mapping) or not all(
                isinstance(k, str) and callable(getattr(v, "named_parameters", None)) for k, v in targets.items()
            ):
                shown = type(targets).__name__ if not isinstance(targets, Mapping) else "a mapping of other values"
                msg = (
                    f"{slot.label}.resolved_targets must be a mapping of module names to nn.Module (the modules it "
                    f"changes, {{}} for none), got {shown}"
                )
                raise ValueError(msg)
        whole = module_parameters(state)
        for slot in self.slots:
            targets = watched_parameters(slot.modifier.resolved_targets)
            slot.guard = Guard(targets, without(whole, targets))
            binding = slot.modifier._binding
            if binding is not None:
                binding.guard = slot.guard

    def unbind(self, owner: Any) -> None:
        """Release the modifiers bound to ``owner``."""
        with _BINDING_LOCK:
            for slot in self.slots:
                binding = slot.modifier._binding
                if binding is not None and binding.session() is owner:
                    del slot.modifier.__dict__["_llmc_fsm_binding"]

    # --- checkpoints --------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, Any]]:
        """``{label: {"started", "ended", "next_update"}}`` (JSON values)."""
        return {
            slot.label: {"started": slot.started, "ended": slot.ended, "next_update": slot.next_update}
            for slot in self.slots
        }

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        """Restore :meth:`state_dict` (labels already checked against the recipe) and rebuild the dispatch."""
        for slot in self.slots:
            saved = state[slot.label]
            slot.started = bool(saved["started"])
            slot.ended = bool(saved["ended"])
            slot.next_update = None if saved["next_update"] is None else float(saved["next_update"])
        self.rebuild()

    def progress(self, stages: list[tuple[str, list[Modifier]]]) -> dict[str, str]:
        """Stage name -> ``"pending"`` (no modifier started), ``"done"`` (all ended) or ``"active"``."""
        by_id = {id(slot.modifier): slot for slot in self.slots}
        result = {}
        for name, modifiers in stages:
            slots = [by_id[id(m)] for m in modifiers if id(m) in by_id]
            if slots and all(s.ended for s in slots):
                result[name] = "done"
            elif any(s.started for s in slots):
                result[name] = "active"
            else:
                result[name] = "pending"
        return result
