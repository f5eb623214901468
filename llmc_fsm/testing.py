"""Conformance kit for modifier authors: a pytest plugin and :func:`check_modifier`.

One line checks that a modifier obeys the lifecycle contract::

    from llmc_fsm.testing import check_modifier

    def test_my_modifier_obeys_the_contract():
        check_modifier(lambda: MyModifier(sparsity=0.5), lambda: {"model": tiny_model()})

or, with the fixture this plugin provides (installed with llmc-fsm as the
``pytest11`` entry point ``llmc_fsm``; the number of examples follows
``--llmc-fsm-examples``)::

    def test_my_modifier(llmc_fsm_check):
        llmc_fsm_check(MyModifier, lambda: {"model": tiny_model()})

What is checked:

1. **Required state is declared truthfully** (deterministic): ``state_factory()``
   supplies every key in ``required_keys()``; ``initialize`` without any one of
   them raises :class:`~llmc_fsm.MissingStateError` naming it; ``initialize`` with
   *only* the declared keys (``required_state`` + ``optional_state``, then only
   the required ones) succeeds — the modifier needs nothing it did not declare.
2. **Random lifecycles** (hypothesis draws valid and invalid call sequences of
   ``update_state``, ``initialize``, batch events, calibration events,
   ``finalize`` and ``reset`` against a :class:`~llmc_fsm.Session` holding a fresh
   modifier):

   - ``on_initialize`` runs exactly once per successful ``initialize`` and never
     for a refused one; ``on_finalize`` at most once per initialization;
   - a refused call (``LifecycleError``) runs no hook at all;
   - hooks run only inside the session calls that own them (``on_event`` only
     for the events in ``events``, calibration hooks only in their calibration
     call, ``on_start``/``on_update``/``on_end`` only at events, finalize or reset);
   - after ``finalize``/``reset`` (and a refused ``initialize``),
     ``modifier.num_hooks == 0`` and, when the state holds a ``torch.nn.Module``
     as ``model``, the model carries exactly the torch hooks it had before.

3. **Checkpoints** (deterministic): after one training batch, the session's
   ``state_dict()`` (with the modifier's :meth:`~llmc_fsm.Modifier.state_dict`)
   can be written with :func:`~llmc_fsm.checkpoint.write_checkpoint`, read back,
   and loaded into a new session holding a fresh modifier and fresh state.

A modifier hook that raises during a valid lifecycle fails the check too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from llmc_fsm.errors import LifecycleError, MissingStateError, ModifierError
from llmc_fsm.lifecycle import BATCH_EVENTS, CALIBRATION_EVENTS, EVENTS, OPENING_EVENTS
from llmc_fsm.modifier import HOOKS, SCHEDULE_HOOKS, Modifier
from llmc_fsm.session import Session

__all__ = ["ContractViolation", "check_modifier", "llmc_fsm_check"]

DEFAULT_EXAMPLES = 100


def _allowed_hooks() -> dict[str, frozenset[str]]:
    allowed = {
        "update_state": frozenset(),
        "initialize": frozenset({"on_initialize", "on_finalize"}),  # on_finalize: roll-back only
        "finalize": frozenset({"on_end", "on_finalize"}),
        "reset": frozenset({"on_end", "on_finalize"}),
    }
    for event in EVENTS:
        own = frozenset({"on_event"} if event in BATCH_EVENTS else {f"on_{event}"})
        allowed[event] = own | SCHEDULE_HOOKS if event in OPENING_EVENTS else own
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
    model = state.get("model")
    modules = getattr(model, "modules", None)
    if modules is None:
        return None
    total = 0
    for module in modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            total += len(getattr(module, attr, {}) or {})
    return total


def _fail(name: str, msg: str, trace: list[str]) -> None:
    steps = " -> ".join(trace) or "(no calls)"
    raise ContractViolation(f"{name}: {msg}\n  call sequence: {steps}")


def _check_checkpoint(
    factory: Callable[[], Modifier],
    state_factory: Callable[[], Mapping[str, Any]],
    batch_factory: Callable[[], Any] | None,
    loss_factory: Callable[[], Any] | None,
) -> None:
    import tempfile

    from llmc_fsm.checkpoint import read_checkpoint, write_checkpoint

    session, resumed = Session([factory()]), Session([factory()])
    session.initialize(**state_factory())
    session.batch_start(batch_factory() if batch_factory else None)
    session.loss_calculated(loss_factory() if loss_factory else 0.0)
    for event in ("optim_pre_step", "optim_post_step", "batch_end"):
        getattr(session, event)()
    resumed.initialize(**state_factory())
    name = type(session.modifiers[0]).__name__
    try:
        with tempfile.TemporaryDirectory() as tmp:
            write_checkpoint(session.state_dict(), tmp)
            resumed.load_state_dict(read_checkpoint(tmp))
    except (TypeError, ValueError) as exc:
        msg = (
            f"{name}: its state_dict() after one batch could not be written and loaded into a fresh session: "
            f"{type(exc).__name__}: {exc}. Return tensors and JSON values from state_dict() and accept them in "
            "load_state_dict()"
        )
        raise ContractViolation(msg) from exc
    finally:
        session.finalize()
        resumed.finalize()


def _check_declared_state(factory: Callable[[], Modifier], state_factory: Callable[[], Mapping[str, Any]]) -> None:
    probe = factory()
    name = type(probe).__name__
    state = dict(state_factory())
    required = probe.required_keys()
    absent = sorted(k for k in required if state.get(k) is None)
    if absent:
        msg = (
            f"{name}: state_factory() does not supply the required key(s) {absent}; "
            "give check_modifier a state_factory with every key in required_state"
        )
        raise ContractViolation(msg)
    for key in sorted(required):
        session = Session([factory()])
        partial = {k: v for k, v in state.items() if k != key}
        try:
            session.initialize(**partial)
        except MissingStateError as exc:
            if not any(key in keys for keys in exc.missing.values()):
                raise ContractViolation(f"{name}: initialize() without {key!r} did not name it: {exc}") from None
        else:  # pragma: no cover - the session enforces this
            session.finalize()
            raise ContractViolation(f"{name}: initialize() without required key {key!r} did not raise")
    declared = required | frozenset(probe.optional_state)
    for keys, what in ((declared, "required_state + optional_state"), (required, "required_state")):
        session = Session([factory()])
        try:
            session.initialize(**{k: v for k, v in state.items() if k in keys})
        except ModifierError as exc:
            cause = exc.__cause__
            msg = (
                f"{name}: initialize() with only its declared keys ({what}: {sorted(keys)}) failed: "
                f"{type(cause).__name__}: {cause}. Declare every key on_initialize needs in required_state "
                "(or make it optional and handle its absence)."
            )
            raise ContractViolation(msg) from cause
        session.finalize()


class _SequenceRun:
    """One drawn call sequence against a session holding a fresh modifier, checked call by call."""

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


def check_modifier(
    factory: Callable[[], Modifier] | type[Modifier],
    state_factory: Callable[[], Mapping[str, Any]],
    *,
    max_examples: int = DEFAULT_EXAMPLES,
    max_calls: int = 20,
    batch_factory: Callable[[], Any] | None = None,
    loss_factory: Callable[[], Any] | None = None,
    modules_factory: Callable[[Mapping[str, Any]], Any] | None = None,
) -> None:
    """Check that the modifier made by ``factory`` obeys the lifecycle contract (see the module docstring).

    Args:
        factory: returns a fresh modifier (a class with usable defaults works too);
            called once per example, so no state leaks between examples.
        state_factory: returns a fresh ``{key: value}`` state holding at least every
            required key (e.g. a new tiny model each time); called once per example.
        max_examples: hypothesis examples (random lifecycles) to run; default 100.
        max_calls: longest drawn call sequence (composite steps count once).
        batch_factory: the ``batch`` passed to ``batch_start`` (default ``None``).
        loss_factory: the loss passed to ``loss_calculated`` (default ``0.0``).
        modules_factory: ``state -> modules`` for ``sequential_epoch_end`` (default ``()``).

    Raises:
        ContractViolation: a rule was broken; the message names the rule and the
            call sequence (hypothesis shrinks it to a minimal one).
    """
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    _check_declared_state(factory, state_factory)

    # Composite steps are drawn more often, and half the runs start initialized, so that
    # valid lifecycles (which exercise the hooks) are common next to invalid ones.
    weighted = (*OPERATIONS, "batch", "batch", "batch_no_step", "calibration", "calibration")

    @settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(
        ops=st.lists(st.sampled_from(weighted), max_size=max_calls),
        init_args=st.booleans(),
        start_initialized=st.booleans(),
    )
    def random_lifecycles(ops: list[str], init_args: bool, start_initialized: bool) -> None:
        steps = ["initialize_with_all", *ops] if start_initialized else ops
        _SequenceRun(init_args, factory, state_factory, batch_factory, loss_factory, modules_factory).run(steps)

    random_lifecycles()
    _check_checkpoint(factory, state_factory, batch_factory, loss_factory)


# --- pytest plugin ----------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("llmc-fsm", "llmc-fsm modifier conformance")
    group.addoption(
        "--llmc-fsm-examples",
        type=int,
        default=None,
        metavar="N",
        help=f"random lifecycles per llmc_fsm_check() call (default {DEFAULT_EXAMPLES})",
    )


@pytest.fixture
def llmc_fsm_check(request: pytest.FixtureRequest) -> Callable[..., None]:
    """:func:`check_modifier`, with ``max_examples`` taken from ``--llmc-fsm-examples`` when given."""
    examples = request.config.getoption("llmc_fsm_examples", default=None)
    if examples is None:
        return check_modifier
    return functools.partial(check_modifier, max_examples=examples)
