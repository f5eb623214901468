"""One session called from several threads (issue 10): calls are serialized by the session's own lock."""

from __future__ import annotations

import gc
import threading
import time

import attrs
import pytest
import torch
import transitions

from llmc_fsm import EventOrderError, LifecycleError, Modifier, Session
from llmc_fsm.core.lifecycle import BATCH_EVENTS

# Reference event order inside a batch, written independently of llmc_fsm.core.lifecycle.
NEXT = {
    "idle": {"batch_start"},
    "batch_start": {"loss_calculated", "optim_pre_step", "batch_end"},
    "loss_calculated": {"optim_pre_step", "batch_end"},
    "optim_pre_step": {"optim_post_step"},
    "optim_post_step": {"batch_end"},
    "batch_end": {"batch_start"},
}


@attrs.define(kw_only=True, slots=False, eq=False)
class Slow(Modifier):
    """Sleeps inside its hooks so that unserialized calls would overlap."""

    events = frozenset(BATCH_EVENTS)
    initialized: int = attrs.field(default=0, init=False)
    seen: list = attrs.field(factory=list, init=False)

    def on_initialize(self, state):
        time.sleep(0.02)
        self.initialized += 1

    def on_event(self, state, event):
        time.sleep(0.0005)  # another thread's event would slip in here without the lock
        self.seen.append(event.type)


def _run_threads(n: int, target) -> list:
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results[i] = target(i)
        except Exception as exc:  # collected and checked by the test
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_eight_threads_initialize_at_once_exactly_one_runs_the_modifiers():
    mods = [Slow(), Slow()]
    session = Session(mods)
    results = _run_threads(8, lambda i: session.initialize())
    winners = [r for r in results if r is None]
    losers = [r for r in results if r is not None]
    assert len(winners) == 1 and len(losers) == 7
    for exc in losers:
        assert type(exc) is LifecycleError
        assert exc.call == "initialize" and exc.lifecycle == "initialized"
        assert str(exc).startswith("initialize() refused: the session is already initialized")
    assert [m.initialized for m in mods] == [1, 1]
    assert session.lifecycle == "initialized"


def test_events_from_many_threads_are_serialized_and_never_raise_anything_else():
    mod = Slow()
    session = Session([mod])
    session.initialize()
    accepted: list[str] = []
    lock = threading.Lock()

    def hammer(i: int) -> int:
        refused = 0
        for _ in range(30):
            for event in ("batch_start", "optim_pre_step", "optim_post_step", "batch_end"):
                try:
                    getattr(session, event)()
                except EventOrderError:
                    refused += 1
                else:
                    with lock:
                        accepted.append(event)
                time.sleep(0.0001)  # let the others in between events: without it one thread could run its
        return refused  # whole batches while the others wait for the GIL, and "did interleave" failed by chance

    results = _run_threads(4, hammer)
    assert all(isinstance(r, int) for r in results), results  # only EventOrderError was raised
    assert sum(results) > 0  # the threads did interleave
    position = "idle"
    for event in mod.seen:  # every event the modifier saw was in order
        assert event in NEXT[position], (position, event)
        position = event
    assert sorted(mod.seen) == sorted(accepted)
    assert session.global_step == mod.seen.count("optim_post_step")


_STATES = {
    "created": [],
    "staging": ["update_state"],
    "initialized": ["initialize"],
    "running": ["initialize", "batch_start", "batch_end"],
    "in a batch": ["initialize", "batch_start"],
    "calibrating": ["initialize", "calibration_start"],
    "finalized": ["initialize", "finalize"],
}
_ARGS = {
    "update_state": {"extra": 1},
    "loss_calculated": (1.0,),
    "sequential_epoch_end": ([],),
    "load_state_dict": ({},),
}
_CALLS = [
    "update_state",
    "initialize",
    *BATCH_EVENTS,
    "calibration_start",
    "sequential_epoch_end",
    "calibration_end",
    "finalize",
    "state_dict",
    "load_state_dict",
]


def _call(session: Session, name: str):
    args = _ARGS.get(name, ())
    return getattr(session, name)(**args) if isinstance(args, dict) else getattr(session, name)(*args)


@pytest.mark.parametrize("where", list(_STATES))
def test_every_refused_call_is_a_lifecycle_error_that_changes_nothing(where):
    for name in _CALLS:
        session = Session([Slow()])
        for step in _STATES[where]:
            _call(session, step)
        before = (session.lifecycle, session.global_step, session.allowed_calls, len(session.modifiers[0].seen))
        try:
            _call(session, name)
        except transitions.MachineError as exc:  # pragma: no cover - the failure this test looks for
            raise AssertionError(f"{name}() in {where} let a MachineError through: {exc}") from exc
        except LifecycleError as exc:
            assert exc.call == name and exc.lifecycle == before[0], (where, name)
            after = (session.lifecycle, session.global_step, session.allowed_calls, len(session.modifiers[0].seen))
            assert after == before, (where, name)
        except Exception as exc:  # an empty dict is a CheckpointError where loading is allowed
            assert (name, where, type(exc).__name__) == ("load_state_dict", "initialized", "CheckpointError")


# --- one modifier object, two sessions (issue 11 case 12) -------------------------------------------------


@attrs.define(kw_only=True, slots=False, eq=False)
class Holder(Modifier):
    """Keeps the model it was initialized with."""

    required_state = frozenset({"model"})
    model: object = attrs.field(default=None, init=False)

    def on_initialize(self, state):
        self.model = state.model


def test_a_modifier_bound_to_a_live_session_is_refused_by_another():
    holder = Holder()
    first, second = Session([holder]), Session([holder])
    model_a, model_b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    first.initialize(model=model_a)
    with pytest.raises(LifecycleError) as info:
        second.initialize(model=model_b)
    msg = str(info.value)
    assert msg.startswith(
        "initialize() refused: modifier Holder (this object, or a copy of it: a copy shares its run state) is bound "
        "to another live session <Session initialized [Holder]>; initializing it here would undo that session's work"
    )
    assert "Finalize or reset that session first, or give this session its own modifier objects" in msg
    assert holder.model is model_a and second.lifecycle == "created"
    first.finalize()
    second.initialize(model=model_b)  # free again
    assert holder.model is model_b


@pytest.mark.parametrize("how", ["copy", "deepcopy"])
def test_a_copy_of_a_bound_modifier_is_refused_while_its_original_is_bound(how):
    """A copy holds the original's run state (a shallow copy its very masks and hook list; a deep copy hook handles
    that remove the original's hooks): run in a second session it cleared the first one's masks (measured by a
    tester when copies were taken as unbound for a while on 2026-12-06). Refused, with a message that says so, while
    the original is bound; free once the original's session is reset (found by a tester: the copy stayed refused
    after a reset that re-initialized that session with other modifiers), refused again when the original is bound
    again."""
    import copy

    holder = Holder()
    first = Session([holder])
    first.initialize(model=torch.nn.Linear(1, 1))
    twin = {"copy": copy.copy, "deepcopy": copy.deepcopy}[how](holder)
    refusal = r"modifier Holder \(this object, or a copy of it: a copy shares its run state\) is bound"
    with pytest.raises(LifecycleError, match=refusal):
        Session([twin]).initialize(model=torch.nn.Linear(1, 1))
    first.reset(recipe=[holder])
    first.initialize(model=torch.nn.Linear(1, 1))  # the original bound again
    with pytest.raises(LifecycleError, match=refusal):
        Session([twin]).initialize(model=torch.nn.Linear(1, 1))
    first.reset(recipe=[Holder()])
    first.initialize(model=torch.nn.Linear(1, 1))  # live again, with another modifier: the original is free
    second = Session([twin])
    second.initialize(model=torch.nn.Linear(1, 1))
    second.finalize()
    first.finalize()


@attrs.define(kw_only=True, slots=False, eq=False)
class Hooker(Modifier):
    """Registers one forward hook on the model at initialize."""

    required_state = frozenset({"model"})

    def on_initialize(self, state):
        self.register_hook(state.model, lambda module, args, output: None, kind="forward")


def test_two_copies_run_in_two_sessions_remove_only_their_own_hooks():
    """Shallow copies share their original's hook list: two copies run in two sessions after the original's reset,
    and the second session's finalize removed the first one's hooks (found by a tester). Each bound modifier now
    starts its own list; a copy taken while its original was bound pickles once that session is finalized (it was
    refused: "bound to a live session")."""
    import copy
    import pickle

    original = Hooker()
    first = Session([original])
    first.initialize(model=torch.nn.Linear(1, 1))
    one, two = copy.copy(original), copy.copy(original)
    first.reset()
    assert isinstance(pickle.loads(pickle.dumps(one)), Hooker)  # the original's session is not live any more
    model_a, model_b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    session_a, session_b = Session([one]), Session([two])
    session_a.initialize(model=model_a)
    session_b.initialize(model=model_b)
    session_b.finalize()
    assert (len(model_a._forward_hooks), len(model_b._forward_hooks), one.num_hooks, two.num_hooks) == (1, 0, 1, 0)
    session_a.finalize()
    assert len(model_a._forward_hooks) == 0


def test_hooks_registered_before_initialize_are_still_removed_at_finalize():
    """Giving each bound modifier its own hook list must keep the live handles (a tester's case: binding dropped
    them, and a hook registered before initialize stayed on the model after finalize)."""
    model = torch.nn.Linear(1, 1)
    modifier = Hooker()
    modifier.register_hook(model, lambda module, args, output: None, kind="forward")
    session = Session([modifier])
    session.initialize(model=model)
    assert (len(model._forward_hooks), modifier.num_hooks) == (2, 2)
    session.finalize()
    assert (len(model._forward_hooks), modifier.num_hooks) == (0, 0)


def test_pickling_a_bound_modifier_is_refused_in_one_line_and_an_unbound_one_pickles():
    import pickle

    holder = Holder()
    session = Session([holder])
    session.initialize(model=torch.nn.Linear(1, 1))
    with pytest.raises(TypeError) as info:
        pickle.dumps(holder)
    assert str(info.value) == (
        "modifier Holder is bound to a live session: it cannot be pickled while its run holds hooks and state; "
        "pickle it before initialize, or after the session's finalize() or reset()"
    )
    session.reset()
    assert isinstance(pickle.loads(pickle.dumps(holder)), Holder)


def test_a_dropped_session_releases_its_modifiers():
    holder = Holder()
    first = Session([holder])
    first.initialize(model=torch.nn.Linear(1, 1))
    del first
    gc.collect()
    Session([holder]).initialize(model=torch.nn.Linear(1, 1))


def test_two_sessions_initializing_one_modifier_at_once_one_wins():
    holder = Holder()
    sessions = [Session([holder]), Session([holder])]
    results = _run_threads(2, lambda i: sessions[i].initialize(model=torch.nn.Linear(1, 1)))
    assert sorted(type(r).__name__ for r in results) == ["LifecycleError", "NoneType"]
    assert sorted(s.lifecycle for s in sessions) == ["created", "initialized"]


def test_the_same_object_twice_in_one_recipe_is_refused():
    holder = Holder()
    session = Session([holder, holder])
    with pytest.raises(LifecycleError, match=r"^initialize\(\) refused: Holder#2 is the same object as Holder#1"):
        session.initialize(model=torch.nn.Linear(1, 1))
    assert holder.model is None and session.lifecycle == "created"
