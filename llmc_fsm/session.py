"""The compression session: a guarded lifecycle that gathers state from many places.

Flow (see ``docs/lifecycle.md``)::

    session = Session(recipe)            # recipe parsed and resolved now
    session.update_state(model=model)    # any number of times, from anywhere
    session.update_state(optimizer=opt)
    session.initialize(teacher=teacher)  # checks every modifier's required keys,
                                         # then calls each on_initialize once
    session.batch_start(); ...           # events (the first one: -> running)
    session.finalize()

Stage changes go through the ``transitions`` machine built from
:data:`llmc_fsm.lifecycle.TRANSITIONS`; per-batch events are checked with one
lookup in :data:`llmc_fsm.lifecycle.EVENT_ORDER` and dispatched to the modifiers
resolved for that event at ``initialize``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, NoReturn

from llmc_fsm.errors import EventOrderError, LifecycleError, MissingStateError
from llmc_fsm.lifecycle import CALLS_ALLOWED, EVENT_ORDER, make_machine
from llmc_fsm.modifier import BATCH_EVENTS, Event, Modifier
from llmc_fsm.recipe import Recipe, resolve_recipe
from llmc_fsm.state import State

__all__ = ["ModifierError", "Session", "active_session", "create_session"]

logger = logging.getLogger(__name__)


class ModifierError(RuntimeError):
    """A modifier hook raised; the original exception is chained as ``__cause__``.

    Attributes:
        modifier: the modifier's label (class name, ``#k`` appended when a class
            appears more than once in the recipe).
        hook: the hook that raised, e.g. ``"on_initialize"``.
    """

    def __init__(self, msg: str, *, modifier: str, hook: str) -> None:
        super().__init__(msg)
        self.modifier = modifier
        self.hook = hook


class _Lifecycle:
    """The object ``transitions`` drives; its ``state`` attribute is the lifecycle."""

    state: str


class _Slot:
    """Per-modifier bookkeeping of one session run."""

    __slots__ = ("ended", "label", "modifier", "next_update", "started")

    def __init__(self, modifier: Modifier, label: str) -> None:
        self.modifier = modifier
        self.label = label
        self.started = False
        self.ended = False
        self.next_update: float | None = None

    @property
    def has_schedule_work(self) -> bool:
        m = self.modifier
        return not self.ended and (not self.started or m.end is not None or self.next_update is not None)


def _overrides(modifier: Modifier, hook: str) -> bool:
    return getattr(type(modifier), hook) is not getattr(Modifier, hook)


def _labels(modifiers: list[Modifier]) -> list[str]:
    names = [m.modifier_name() for m in modifiers]
    seen: dict[str, int] = {}
    labels = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if names.count(name) == 1 else f"{name}#{seen[name]}")
    return labels


def _format_calls(calls: frozenset[str]) -> str:
    return ", ".join(f"{c}()" for c in sorted(calls)) or "none"


class Session:
    """A compression session with the lifecycle ``created -> staging -> initialized -> running -> finalized``.

    Args:
        recipe: a recipe file path, YAML/JSON text, a dict, a list of
            :class:`~llmc_fsm.Modifier` objects, a :class:`~llmc_fsm.recipe.Recipe`,
            or ``None`` (no modifiers). Parsed and resolved here, so recipe
            errors surface before any state is gathered.

    Raises:
        RecipeError: the recipe cannot be parsed or a modifier argument is invalid.
    """

    def __init__(self, recipe: Any = None) -> None:
        self._recipe: Recipe = resolve_recipe(recipe)
        self._fsm = _Lifecycle()
        make_machine(self._fsm)
        self._event = Event()
        self._clear_run()

    def _clear_run(self) -> None:
        self._state = State()
        self._position = "closed"
        self._step = 0
        modifiers = self._recipe.modifiers
        self._slots = [_Slot(m, label) for m, label in zip(modifiers, _labels(modifiers), strict=True)]
        self._scheduled: list[_Slot] = []
        self._on_event: dict[str, tuple[Any, ...]] = {event: () for event in BATCH_EVENTS}
        self._active: list[_Slot] = []

    # --- read-only views ------------------------------------------------------
    @property
    def lifecycle(self) -> str:
        """``"created"``, ``"staging"``, ``"initialized"``, ``"running"`` or ``"finalized"``."""
        return self._fsm.state

    @property
    def state(self) -> State:
        """A read-only snapshot of the state gathered so far (see :class:`~llmc_fsm.State`)."""
        return self._state

    @property
    def recipe(self) -> Recipe:
        """The resolved recipe."""
        return self._recipe

    @property
    def modifiers(self) -> list[Modifier]:
        """The recipe's modifiers, in execution order."""
        return [slot.modifier for slot in self._slots]

    @property
    def global_step(self) -> int:
        """Optimizer steps completed (``int``)."""
        return self._step

    @property
    def allowed_calls(self) -> frozenset[str]:
        """The public calls allowed in the current lifecycle state."""
        return CALLS_ALLOWED[self.lifecycle]

    # --- refusals -------------------------------------------------------------
    def _refuse(self, call: str) -> NoReturn:
        lifecycle = self.lifecycle
        allowed = CALLS_ALLOWED[lifecycle]
        if call in ("update_state", "initialize") and lifecycle in ("initialized", "running"):
            why = (
                f"the session is already initialized (lifecycle {lifecycle!r}) and its state is frozen: every "
                "modifier was initialized exactly once with the state it had then, so new state would never reach "
                "them. To start over with new state, call session.reset() (finalizes the modifiers) and then "
                "update_state()/initialize() again, or create a new Session"
            )
        elif call in ("update_state", "initialize") and lifecycle == "finalized":
            why = (
                "the session is finalized and its state is frozen. Call session.reset() to reuse it "
                "(optionally with a new recipe), or create a new Session"
            )
        elif call == "finalize" and lifecycle == "finalized":
            why = "the session is already finalized; finalize() runs once. Call session.reset() to reuse it"
        elif call == "finalize":
            why = f"the session was never initialized (lifecycle {lifecycle!r}); call initialize() first"
        elif lifecycle in ("created", "staging"):
            why = f"the session is not initialized yet (lifecycle {lifecycle!r}); call initialize() first"
        elif lifecycle == "finalized":
            why = "the session is finalized; no events are accepted. Call session.reset() to reuse it"
        else:  # pragma: no cover - every refused call is handled above
            why = f"not allowed in lifecycle {lifecycle!r}"
        msg = f"{call}() refused: {why}. Allowed now: {_format_calls(allowed)}."
        raise LifecycleError(msg, lifecycle=lifecycle, call=call, allowed=allowed) from None

    def _refuse_event(self, event: str) -> NoReturn:
        if self._position == "closed":
            self._refuse(event)
        expected = EVENT_ORDER[self._position]
        where = "between batches" if self._position == "idle" else f"after {self._position}()"
        if self._position == "calibrating":
            where = "during calibration (calibration events never occur inside a batch)"
        msg = (
            f"{event}() out of order: {where} the next event must be one of "
            f"{_format_calls(frozenset(expected))}; a batch is batch_start -> [loss_calculated] -> "
            "[optim_pre_step -> optim_post_step] -> batch_end."
        )
        lifecycle = self.lifecycle
        raise EventOrderError(msg, lifecycle=lifecycle, call=event, allowed=expected) from None

    # --- staging --------------------------------------------------------------
    def update_state(self, **state: Any) -> None:
        """Store state for the modifiers; they see it at :meth:`initialize`.

        May be called any number of times, from different places; later values
        win. Keys are open-ended (see :class:`~llmc_fsm.State`).

        Raises:
            LifecycleError: the session is already initialized, running or finalized.
        """
        if "update_state" not in CALLS_ALLOWED[self.lifecycle]:
            self._refuse("update_state")
        self._state = self._state.merged(state)
        self._fsm.update_state()  # type: ignore[attr-defined]

    def missing_state(self, **extra: Any) -> dict[str, frozenset[str]]:
        """Return modifier label -> required keys not yet supplied (``extra`` counted as supplied)."""
        state = self._state.merged(extra) if extra else self._state
        missing = {}
        for slot in self._slots:
            keys = frozenset(k for k in slot.modifier.required_keys() if k not in state)
            if keys:
                missing[slot.label] = keys
        return missing

    def initialize(self, **state: Any) -> None:
        """Merge ``state`` into the stored state and initialize every modifier exactly once.

        All modifiers' required keys are checked first; if any are missing,
        :class:`MissingStateError` names every modifier and key, nothing is
        initialized, nothing (including ``state``) is stored, and the lifecycle
        is unchanged. If a modifier's ``on_initialize`` raises, the modifiers
        already initialized are rolled back (hooks removed, ``on_finalize``
        called), nothing is stored, and :class:`ModifierError` is raised with
        the original exception chained; a retry is allowed.

        Raises:
            LifecycleError: already initialized / running / finalized.
            MissingStateError: required state keys are missing.
            ModifierError: a modifier's ``on_initialize`` raised.
        """
        lifecycle = self.lifecycle
        if "initialize" not in CALLS_ALLOWED[lifecycle]:
            self._refuse("initialize")
        full = self._state.merged(state)
        missing = self.missing_state(**state)
        if missing:
            raise MissingStateError(
                self._missing_message(missing, lifecycle, passed=frozenset(state)),
                lifecycle=lifecycle,
                missing=missing,
                allowed=CALLS_ALLOWED[lifecycle],
            ) from None
        done: list[_Slot] = []
        for slot in self._slots:
            try:
                slot.modifier.on_initialize(full)
            except BaseException as exc:
                slot.modifier.remove_hooks()
                self._roll_back(done, full)
                if not isinstance(exc, Exception):
                    raise
                msg = (
                    f"{slot.label}.on_initialize() raised {type(exc).__name__}: {exc}. Rolled back: "
                    f"{len(done)} modifier(s) already initialized were finalized and their hooks removed; "
                    f"the session is still {lifecycle!r} and nothing passed to initialize() was stored. "
                    "Fix the cause and call initialize() again with all its arguments."
                )
                raise ModifierError(msg, modifier=slot.label, hook="on_initialize") from exc
            done.append(slot)
        self._state = full
        self._position = "idle"
        self._scheduled = list(self._slots)
        self._fsm.initialize()  # type: ignore[attr-defined]

    def _missing_message(self, missing: dict[str, frozenset[str]], lifecycle: str, passed: frozenset[str]) -> str:
        lines = [
            f"initialize() refused: {len(missing)} modifier(s) are missing required state; "
            "no modifier was initialized and nothing was stored "
            f"(the session is still {lifecycle!r}):"
        ]
        for label, keys in missing.items():
            lines.append(f"  - {label} requires {', '.join(repr(k) for k in sorted(keys))}")
        all_keys = sorted(set().union(*missing.values()))
        example = ", ".join(f"{k}=..." for k in all_keys)
        lines.append(
            f"Supply them where they are created with session.update_state({example}), or pass them to "
            f"session.initialize({example})."
        )
        if passed:
            lines.append(
                f"Pass again what you gave this call ({', '.join(sorted(passed))}): it was not stored."
            )
        if "steps_per_epoch" in all_keys:
            lines.append(
                "steps_per_epoch (optimizer steps per epoch, int) is required because the modifier has a "
                "start/end/update schedule in epochs."
            )
        return "\n".join(lines)

    def _roll_back(self, slots: list[_Slot], state: State) -> None:
        for slot in reversed(slots):
            try:
                slot.modifier.on_finalize(state)
            except Exception:
                logger.exception("%s.on_finalize() raised during roll-back", slot.label)
            finally:
                slot.modifier.remove_hooks()

    # --- events (hot path: no transitions trigger, one dict lookup) ------------
    def _enter(self, event: str, step: int | None = None) -> Event:
        """Check the event order (one lookup), then set the global step (if given) and the shared Event."""
        position = EVENT_ORDER[self._position].get(event)
        if position is None:
            self._refuse_event(event)
        if step is not None:
            self._step = step
        if self._fsm.state == "initialized":
            self._fsm.first_event()  # type: ignore[attr-defined]
        self._position = position
        ev = self._event
        ev.type = event
        ev.global_step = self._step
        spe = self._state.values.get("steps_per_epoch")
        ev.epoch = self._step / spe if spe else None
        return ev

    def _advance_schedule(self, ev: Event) -> None:
        """Fire on_start / on_update / on_end for the modifiers whose epoch has come."""
        state = self._state
        epoch = ev.epoch
        changed = False
        for slot in self._scheduled:
            m = slot.modifier
            if not slot.started:
                if m.start is not None and (epoch is None or epoch < m.start):
                    continue
                slot.started = True
                changed = True
                m.on_start(state, ev)
                if m.update is not None:
                    slot.next_update = (m.start or 0.0) + m.update
            ending = m.end is not None and epoch is not None and epoch >= m.end
            if not ending and slot.next_update is not None and epoch is not None and epoch >= slot.next_update:
                m.on_update(state, ev)
                while slot.next_update <= epoch:
                    slot.next_update += m.update  # type: ignore[operator]
            if ending:
                slot.ended = True
                slot.next_update = None
                changed = True
                m.on_end(state, ev)
        if changed:
            self._rebuild_dispatch()

    def _rebuild_dispatch(self) -> None:
        self._scheduled = [slot for slot in self._slots if slot.has_schedule_work]
        self._active = [slot for slot in self._slots if slot.started and not slot.ended]
        self._on_event = {
            event: tuple(s.modifier.on_event for s in self._active if event in s.modifier.events)
            for event in BATCH_EVENTS
        }

    def batch_start(self, batch: Any = None, global_step: int | None = None) -> None:
        """A training batch begins.

        Args:
            batch: the batch (any type), passed to modifiers as ``event.batch``.
            global_step: optimizer steps completed so far, when the caller counts
                them (e.g. the HF Trainer); otherwise the session counts
                ``optim_post_step`` calls.

        Raises:
            LifecycleError: not initialized, or finalized.
            EventOrderError: a batch is still open.
            ValueError: ``global_step`` is not a non-negative int.
        """
        if global_step is not None and (
            isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0
        ):
            msg = f"global_step must be a non-negative int, got {global_step!r}"
            raise ValueError(msg)
        ev = self._enter("batch_start", global_step)
        ev.batch = batch
        ev.loss = None
        if self._scheduled:
            self._advance_schedule(ev)
        for handler in self._on_event["batch_start"]:
            handler(self._state, ev)

    def loss_calculated(self, loss: Any) -> Any:
        """The batch loss is known; returns the loss, possibly replaced by modifiers (e.g. distillation)."""
        ev = self._enter("loss_calculated")
        ev.loss = loss
        for handler in self._on_event["loss_calculated"]:
            result = handler(self._state, ev)
            if result is not None:
                ev.loss = result
        return ev.loss

    def optim_pre_step(self) -> None:
        """The optimizer is about to step (gradients are final)."""
        ev = self._enter("optim_pre_step")
        for handler in self._on_event["optim_pre_step"]:
            handler(self._state, ev)

    def optim_post_step(self) -> None:
        """The optimizer has stepped; the global step advances by one before modifiers see it."""
        ev = self._enter("optim_post_step", self._step + 1)
        for handler in self._on_event["optim_post_step"]:
            handler(self._state, ev)

    def batch_end(self) -> None:
        """The batch is done (with or without an optimizer step)."""
        ev = self._enter("batch_end")
        for handler in self._on_event["batch_end"]:
            handler(self._state, ev)
        ev.batch = None
        ev.loss = None

    def calibration_start(self) -> None:
        """One-shot calibration begins (modifiers whose start has come are started first)."""
        ev = self._enter("calibration_start")
        if self._scheduled:
            self._advance_schedule(ev)
        for slot in self._active:
            if _overrides(slot.modifier, "on_calibration_start"):
                slot.modifier.on_calibration_start(self._state)

    def sequential_epoch_end(self, modules: Any) -> None:
        """Calibration data has passed through ``modules`` (e.g. one decoder layer): compress them."""
        self._enter("sequential_epoch_end")
        for slot in self._active:
            if _overrides(slot.modifier, "on_sequential_epoch_end"):
                slot.modifier.on_sequential_epoch_end(self._state, modules)

    def calibration_end(self) -> None:
        """One-shot calibration has ended."""
        self._enter("calibration_end")
        for slot in self._active:
            if _overrides(slot.modifier, "on_calibration_end"):
                slot.modifier.on_calibration_end(self._state)

    # --- ending -----------------------------------------------------------------
    def finalize(self) -> None:
        """End every active modifier (``on_end``), finalize all of them, remove their hooks.

        Runs once. Every modifier is finalized and every hook removed even if one
        raises; the session is then ``finalized`` and the first error is raised as
        :class:`ModifierError` with the original chained.

        Raises:
            LifecycleError: not initialized, or already finalized.
            ModifierError: a modifier's ``on_end``/``on_finalize`` raised.
        """
        if "finalize" not in CALLS_ALLOWED[self.lifecycle]:
            self._refuse("finalize")
        errors = self._finalize_modifiers()
        self._position = "closed"
        self._fsm.finalize()  # type: ignore[attr-defined]
        if errors:
            label, hook, exc = errors[0]
            msg = (
                f"{label}.{hook}() raised {type(exc).__name__}: {exc}. All modifiers were still finalized and "
                f"their hooks removed ({len(errors)} error(s) in all; the others are logged)."
            )
            raise ModifierError(msg, modifier=label, hook=hook) from exc

    def _finalize_modifiers(self) -> list[tuple[str, str, Exception]]:
        errors: list[tuple[str, str, Exception]] = []
        ev = self._event
        ev.type = "finalize"
        for slot in self._slots:
            m = slot.modifier
            hook = "on_end"
            try:
                if slot.started and not slot.ended:
                    slot.ended = True
                    m.on_end(self._state, ev)
                hook = "on_finalize"
                m.on_finalize(self._state)
            except Exception as exc:
                if errors:
                    logger.error("%s.%s() raised during finalize: %r", slot.label, hook, exc)
                errors.append((slot.label, hook, exc))
            finally:
                m.remove_hooks()
        self._scheduled = []
        self._active = []
        self._on_event = {event: () for event in BATCH_EVENTS}
        return errors

    def reset(self, recipe: Any = None) -> None:
        """Return to ``created`` from any state, keeping the recipe or taking a new one.

        A new recipe is resolved first; if it is invalid, :class:`RecipeError`
        is raised and the session is left exactly as it was. Live modifiers
        (initialized or running) are finalized and their hooks removed; the
        stored state is dropped.
        """
        new_recipe = resolve_recipe(recipe) if recipe is not None else self._recipe
        if self.lifecycle in ("initialized", "running"):
            for label, hook, exc in self._finalize_modifiers():
                logger.error("%s.%s() raised during reset: %r", label, hook, exc)
        self._recipe = new_recipe
        self._clear_run()
        self._fsm.reset()  # type: ignore[attr-defined]

    def explain(self) -> str:
        """Return the plan as text, touching no model: stages, modifiers in order,
        the events each handles, the state keys each requires and whether they are present."""
        from llmc_fsm.explain import explain

        return explain(self)

    def __repr__(self) -> str:
        names = ", ".join(slot.label for slot in self._slots) or "no modifiers"
        return f"<Session {self.lifecycle} [{names}]>"


_ACTIVE: ContextVar[Session | None] = ContextVar("llmc_fsm_active_session", default=None)


@contextlib.contextmanager
def create_session(recipe: Any = None) -> Iterator[Session]:
    """Create a :class:`Session` and make it the active one for this thread / asyncio task.

    Use as ``with create_session(recipe) as session: ...``. On exit the previous
    active session (usually none) is restored, and a session left initialized or
    running is finalized so no hook outlives the block (if the block raised,
    its exception propagates and finalize errors are only logged).
    """
    session = Session(recipe)
    token = _ACTIVE.set(session)
    ok = False
    try:
        yield session
        ok = True
    finally:
        _ACTIVE.reset(token)
        if session.lifecycle in ("initialized", "running"):
            if ok:
                session.finalize()
            else:
                try:
                    session.finalize()
                except Exception:
                    logger.exception("finalize() failed while leaving create_session() after an error")


def active_session() -> Session:
    """Return the session made active by the innermost ``create_session`` in this context.

    Sessions are held in a ``contextvars.ContextVar``: each thread and each
    asyncio task sees only its own.

    Raises:
        LifecycleError: no session is active here.
    """
    session = _ACTIVE.get()
    if session is None:
        msg = (
            "no active session in this thread/task: wrap the code in "
            "`with llmc_fsm.create_session(recipe) as session:` or pass a Session explicitly."
        )
        raise LifecycleError(msg, lifecycle="none", call="active_session")
    return session
