"""Random lifecycles for the conformance kit (:mod:`llmc_fsm.testing`): one drawn call sequence, checked call by call.

:class:`SequenceRun` makes the session calls hypothesis draws (from :data:`OPERATIONS`; composite steps expand
to several calls) against a session holding a fresh modifier, records which session call ran each of the modifier's
hooks, and raises :class:`ContractViolation` when a rule of the lifecycle contract is broken.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from llmc_fsm.core.errors import LifecycleError, ModifierError
from llmc_fsm.core.lifecycle import BATCH_EVENTS, CALIBRATION_EVENTS, ENDING_EVENTS, EVENTS, OPENING_EVENTS
from llmc_fsm.core.modifier import HOOKS, SCHEDULE_HOOKS, Modifier
from llmc_fsm.core.torch_hooks import hook_count
from llmc_fsm.session.session import Session

__all__ = ["ALLOWED_HOOKS", "OPERATIONS", "ContractViolation", "SequenceRun"]


def _allowed_hooks() -> dict[str, frozenset[str]]:
    allowed = {
        "update_state": frozenset(),
        "initialize": frozenset({"on_initialize", "on_finalize"}),  # on_finalize: roll-back only
        "finalize": frozenset({"on_end", "on_finalize"}),
        "reset": frozenset({"on_finalize"}),  # no on_end: a reset run is not ended (2026-12-06)
    }
    for event in EVENTS:
        own = frozenset({"on_event"} if event in BATCH_EVENTS else {f"on_{event}"})
        allowed[event] = own | SCHEDULE_HOOKS if event in OPENING_EVENTS else own
        if event in ENDING_EVENTS:
            allowed[event] |= {"on_end"}
    return allowed


#: Session call -> the hooks allowed to run inside it (derived from the lifecycle's event lists).
ALLOWED_HOOKS: dict[str, frozenset[str]] = _allowed_hooks()

#: Operations hypothesis draws from; composite ones make valid runs likely.
OPERATIONS: tuple[str, ...] = (
    *("update_state_some", "update_state_all", "initialize", "initialize_with_all", "batch", "batch_no_step"),
    *BATCH_EVENTS,
    "calibration",
    *CALIBRATION_EVENTS,
    *("finalize", "reset"),
)

_COMPOSITE: dict[str, tuple[str, ...]] = {
    "batch": BATCH_EVENTS,
    "batch_no_step": tuple(e for e in BATCH_EVENTS if not e.startswith("optim_")),
    # calibration_start, sequential_epoch_end twice, calibration_end
    "calibration": (CALIBRATION_EVENTS[0], CALIBRATION_EVENTS[1], *CALIBRATION_EVENTS[1:]),
}


class ContractViolation(AssertionError):
    """A modifier broke the lifecycle contract; the message says which rule and how."""


class _Recorder:
    """Wraps a modifier's hooks (on the instance) to record which session call ran them."""

    def __init__(self, modifier: Modifier) -> None:
        self.modifier = modifier
        self.current: str | None = None
        self.calls: list[tuple[str, str | None, str | None]] = []
        for hook in HOOKS:
            setattr(modifier, hook, self._wrap(hook, getattr(modifier, hook)))

    def _wrap(self, hook: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            event = args[1] if hook == "on_event" and len(args) > 1 else None
            self.calls.append((hook, self.current, getattr(event, "type", None)))
            return original(*args, **kwargs)

        return wrapper

    def since(self, mark: int) -> list[tuple[str, str | None, str | None]]:
        return self.calls[mark:]


def _torch_hook_count(state: Mapping[str, Any]) -> int | None:
    """torch hooks on every module of ``state["model"]``; ``None`` when the state holds no module."""
    modules = getattr(state.get("model"), "modules", None)
    return None if modules is None else sum(hook_count(module) for module in modules())


def _fail(name: str, msg: str, trace: list[str]) -> None:
    steps = " -> ".join(trace) or "(no calls)"
    raise ContractViolation(f"{name}: {msg}\n  call sequence: {steps}")


class SequenceRun:
    """One drawn call sequence against a session holding a fresh modifier, checked call by call.

    :meth:`run` (and :meth:`call`, :meth:`fail`) raise :class:`ContractViolation` naming the broken rule and the
    calls made so far.
    """

    def __init__(
        self,
        init_args: bool,
        factory: Callable[[], Modifier],
        state_factory: Callable[[], Mapping[str, Any]],
        batch_factory: Callable[[], Any] | None,
        loss_factory: Callable[[], Any] | None,
        modules_factory: Callable[[Mapping[str, Any]], Any] | None,
    ) -> None:
        self.state = dict(state_factory())
        self.modifier = factory()
        self.name = type(self.modifier).__name__
        self.recorder = _Recorder(self.modifier)
        self.session = Session([self.modifier])
        self.hooks_before = _torch_hook_count(self.state)
        keys = sorted(self.state)
        self.some = {k: self.state[k] for k in keys[: len(keys) // 2]}
        self.init_args = init_args
        self.batch_factory, self.loss_factory, self.modules_factory = batch_factory, loss_factory, modules_factory
        self.inits = self.finals = 0
        self.trace: list[str] = []

    def fail(self, msg: str) -> None:
        _fail(self.name, msg, self.trace)

    def run(self, ops: list[str]) -> None:
        for op in ops:
            for step in _COMPOSITE.get(op, (op,)):
                self.call(step)
        if self.session.lifecycle in ("initialized", "running"):
            self.call("finalize")

    def call(self, op: str) -> None:
        """Make one session call, then check the hooks it ran and what it left behind."""
        self.trace.append(op)
        mark = len(self.recorder.calls)
        was_live = self.session.lifecycle in ("initialized", "running")
        if not self.invoke(op, mark, was_live):
            return
        session_call = "update_state" if op.startswith("update_state") else op.removesuffix("_with_all")
        self.check_hooks(session_call, mark)
        self.check_counts(session_call, mark, was_live)

    def invoke(self, op: str, mark: int, was_live: bool) -> bool:
        """Run ``op``; return whether it was accepted (a refusal is checked here and ends the call)."""
        session, state = self.session, self.state
        self.recorder.current = op
        try:
            if op == "update_state_some":
                session.update_state(**self.some)
            elif op == "update_state_all":
                session.update_state(**state)
            elif op in ("initialize", "initialize_with_all"):
                session.initialize(**(state if op == "initialize_with_all" or self.init_args else {}))
            elif op == "batch_start":
                session.batch_start(self.batch_factory() if self.batch_factory else None)
            elif op == "loss_calculated":
                session.loss_calculated(self.loss_factory() if self.loss_factory else 0.0)
            elif op == "sequential_epoch_end":
                session.sequential_epoch_end(self.modules_factory(state) if self.modules_factory else ())
            else:
                getattr(session, op)()
        except LifecycleError as exc:
            ran = self.recorder.since(mark)
            if ran:
                self.fail(f"{op}() was refused ({type(exc).__name__}) but ran hook(s) {[h for h, *_ in ran]}")
            if op.startswith("initialize") and not was_live and self.modifier.num_hooks:
                self.fail(f"a refused initialize() left {self.modifier.num_hooks} hook(s) registered")
            return False
        except ModifierError as exc:
            cause = exc.__cause__
            self.fail(f"{exc.hook}() raised during a valid {op}(): {type(cause).__name__}: {cause}")
        finally:
            self.recorder.current = None
        return True

    def check_hooks(self, session_call: str, mark: int) -> None:
        """Only the hooks that belong to ``session_call`` ran (``on_event`` only for declared events)."""
        allowed = ALLOWED_HOOKS[session_call]
        events = self.modifier.events
        for hook, _, event in self.recorder.since(mark):
            if hook not in allowed or (hook == "on_finalize" and session_call == "initialize"):
                self.fail(f"{hook}() ran during {session_call}(); allowed there: {sorted(allowed) or 'none'}")
            if hook == "on_event" and (event != session_call or event not in events):
                self.fail(
                    f"on_event() ran for {event!r} during {session_call}(); it may only run for the events it "
                    f"declares in `events` ({sorted(events)})"
                )

    def check_counts(self, session_call: str, mark: int, was_live: bool) -> None:
        """``on_initialize`` once per initialize, ``on_finalize`` once per finalize/reset, no hook left after."""
        ran = [h for h, *_ in self.recorder.since(mark)]
        self.inits += ran.count("on_initialize")
        self.finals += ran.count("on_finalize")
        if session_call == "initialize" and self.inits != 1:
            self.fail(f"on_initialize() ran {self.inits} time(s) for one successful initialize()")
        if session_call not in ("finalize", "reset"):
            return
        if was_live and self.finals != 1:
            self.fail(f"on_finalize() ran {self.finals} time(s) at {session_call}(); expected once")
        if self.modifier.num_hooks:
            self.fail(f"{self.modifier.num_hooks} hook(s) still registered after {session_call}()")
        now = _torch_hook_count(self.state)
        if now != self.hooks_before:
            self.fail(
                f"the model carries {now} torch hook(s) after {session_call}(), {self.hooks_before} before "
                "initialize(): register hooks with Modifier.register_hook() so the session removes them"
            )
        self.inits = self.finals = 0
