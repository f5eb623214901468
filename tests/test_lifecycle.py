"""Lifecycle behaviour of Session (issue: lifecycle core, behaviours 1-6 and 8)."""

from __future__ import annotations

import asyncio
import copy
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
import transitions

import llmc_fsm
import llmc_fsm.core.lifecycle
from llmc_fsm import (
    EventOrderError,
    LifecycleError,
    MissingStateError,
    Modifier,
    ModifierError,
    Session,
    active_session,
    create_session,
)
from llmc_fsm.core.lifecycle import EVENT_ORDER, STATES, TRANSITIONS, mermaid
from llmc_fsm.integrations.torch import is_step, resume_position, steps_per_epoch

REPO = Path(__file__).resolve().parents[1]


@attrs.define(kw_only=True, slots=False, eq=False)
class Recorder(Modifier):
    """Records every hook call with the state keys it saw."""

    required_state = frozenset({"model", "optimizer", "teacher"})
    events = frozenset({"batch_start", "loss_calculated", "optim_pre_step", "optim_post_step", "batch_end"})
    calls: list = attrs.field(factory=list)

    def on_initialize(self, state):
        self.calls.append(("on_initialize", dict(state)))

    def on_start(self, state, event):
        self.calls.append(("on_start", event.global_step, event.epoch))

    def on_update(self, state, event):
        self.calls.append(("on_update", event.global_step, event.epoch))

    def on_end(self, state, event):
        self.calls.append(("on_end", event.global_step, event.epoch))

    def on_event(self, state, event):
        self.calls.append((event.type, event.global_step, event.epoch))

    def on_finalize(self, state):
        self.calls.append(("on_finalize",))

    def names(self):
        return [c[0] for c in self.calls]


@attrs.define(kw_only=True, slots=False, eq=False)
class NeedsData(Modifier):
    required_state = frozenset({"model", "calibration_data"})
    initialized: int = attrs.field(default=0)

    def on_initialize(self, state):
        self.initialized += 1


@attrs.define(kw_only=True, slots=False, eq=False)
class Hooker(Modifier):
    """Registers a forward hook on the model at initialize."""

    required_state = frozenset({"model"})
    seen: int = 0
    finalized: int = 0

    def on_initialize(self, state):
        self.register_hook(state.model, self._hook)

    def _hook(self, module, args, output):
        self.seen += 1

    def on_finalize(self, state):
        self.finalized += 1


@attrs.define(kw_only=True, slots=False, eq=False)
class Exploding(Modifier):
    fail: bool = True
    attempts: int = 0

    def on_initialize(self, state):
        self.attempts += 1
        if self.fail:
            raise OSError("disk on fire")


# --- 1. the seed flow ---------------------------------------------------------


def _load_model(session):
    session.update_state(model="the-model")


def _build_optimizer(session):
    session.update_state(optimizer="the-optimizer")


def test_state_from_many_places_reaches_every_modifier_once():
    a, b = Recorder(), Recorder()
    session = Session([a, b])
    _load_model(session)
    _build_optimizer(session)
    assert session.lifecycle == "staging"
    assert a.calls == [] and b.calls == []  # modifiers see nothing before initialize
    session.initialize(teacher="the-teacher")
    expected = {"model": "the-model", "optimizer": "the-optimizer", "teacher": "the-teacher"}
    assert a.calls == [("on_initialize", expected)]
    assert b.calls == [("on_initialize", expected)]
    assert session.lifecycle == "initialized"
    assert session.state.model == "the-model"
    assert session.state["teacher"] == "the-teacher"


def test_later_update_state_values_win_and_extras_are_open_ended():
    session = Session()
    session.update_state(model=1, my_custom_thing="x")
    session.update_state(model=2)
    assert session.state.model == 2
    assert session.state.get("my_custom_thing") == "x"
    assert session.state.get("absent", 7) == 7
    with pytest.raises(KeyError, match="state has no key 'absent'"):
        session.state["absent"]


def test_state_snapshot_is_read_only():
    session = Session()
    session.update_state(model=1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        session.state.values = {}
    with pytest.raises(TypeError):
        session.state.values["model"] = 2


# --- 2. missing state ----------------------------------------------------------


def test_missing_state_names_every_modifier_and_key_and_initializes_nothing():
    rec, data = Recorder(), NeedsData()
    session = Session([rec, data])
    session.update_state(model="m")
    with pytest.raises(MissingStateError) as info:
        session.initialize()
    err = info.value
    expected = {"Recorder": frozenset({"optimizer", "teacher"}), "NeedsData": frozenset({"calibration_data"})}
    assert err.missing == expected
    msg = str(err)
    for fragment in (
        "Recorder requires 'optimizer', 'teacher'",
        "NeedsData requires 'calibration_data'",
        "session.update_state(calibration_data=..., optimizer=..., teacher=...)",
        "session.initialize(calibration_data=..., optimizer=..., teacher=...)",
    ):
        assert fragment in msg
    assert err.lifecycle == "staging" and err.call == "initialize"
    assert session.lifecycle == "staging"
    assert rec.calls == [] and data.initialized == 0
    session.update_state(optimizer="o", calibration_data=[1])
    session.initialize(teacher="t")
    assert rec.names() == ["on_initialize"] and data.initialized == 1


def test_missing_state_names_a_staged_key_that_looks_like_a_misspelling_of_a_missing_one():
    """``update_state(optimiser=...)`` is stored (the state is open-ended); the error for the missing ``optimizer``
    now points at it (found by a tester: nothing did)."""
    session = Session([NeedsData()])
    session.update_state(calibration_dta=[1], model="m")
    with pytest.raises(MissingStateError) as info:
        session.initialize()
    assert str(info.value).splitlines()[1:3] == [
        "  - NeedsData requires 'calibration_data'",
        "'calibration_dta' was given: a misspelling of 'calibration_data'?",
    ]


def test_missing_state_does_not_store_initialize_arguments():
    session = Session([NeedsData()])
    with pytest.raises(MissingStateError, match="Pass again what you gave this call \\(model\\)"):
        session.initialize(model="m")
    assert "model" not in session.state
    assert session.lifecycle == "created"


def test_none_counts_as_missing():
    session = Session([NeedsData()])
    session.update_state(model="m", calibration_data=None)
    with pytest.raises(MissingStateError) as info:
        session.initialize()
    assert info.value.missing == {"NeedsData": frozenset({"calibration_data"})}


def test_schedule_in_epochs_requires_steps_per_epoch():
    session = Session([Recorder(start=1)])
    with pytest.raises(MissingStateError) as info:
        session.initialize(model=1, optimizer=1, teacher=1)
    assert info.value.missing == {"Recorder": frozenset({"steps_per_epoch"})}
    assert "start/end/update schedule in epochs" in str(info.value)


# --- 3. frozen after initialize ----------------------------------------------------


@pytest.mark.parametrize("call", ["update_state", "initialize"])
@pytest.mark.parametrize("advance", ["initialized", "running", "finalized"])
def test_update_or_initialize_after_initialize_is_refused_truthfully(call, advance):
    rec = Recorder()
    session = Session([rec])
    session.initialize(model=1, optimizer=2, teacher=3)
    if advance in ("running", "finalized"):
        session.batch_start()
        session.batch_end()
    if advance == "finalized":
        session.finalize()
    before = list(rec.calls)
    with pytest.raises(LifecycleError) as info:
        getattr(session, call)(model=99)
    err = info.value
    assert type(err) is LifecycleError
    assert err.lifecycle == advance and err.call == call
    expected = ("reset",) if advance == "finalized" else ("batch_start", "calibration_start", "finalize", "reset")
    assert err.allowed == expected
    msg = str(err)
    assert f"{call}() refused" in msg
    assert "frozen" in msg
    if advance == "finalized":
        assert "is finalized" in msg
    else:
        assert "already initialized" in msg
    assert "reset()" in msg and "new Session" in msg
    # never advises a call that would have no effect now
    assert f"call {call}(" not in msg and f"call session.{call}(" not in msg
    assert session.state.model == 1
    assert rec.calls == before
    assert session.lifecycle == advance


# --- 4. failure in on_initialize rolls back --------------------------------------------


def test_failing_on_initialize_rolls_back_and_retry_works():
    model = torch.nn.Linear(2, 2)
    hooker, bomb, rec = Hooker(), Exploding(), Recorder()
    session = Session([hooker, bomb, rec])
    session.update_state(model=model, optimizer=1)
    with pytest.raises(ModifierError) as info:
        session.initialize(teacher=3)
    err = info.value
    assert isinstance(err.__cause__, OSError) and str(err.__cause__) == "disk on fire"
    assert err.modifier == "Exploding" and err.hook == "on_initialize"
    assert "Rolled back: 1 modifier(s) already initialized" in str(err)
    assert session.lifecycle == "staging"
    assert hooker.num_hooks == 0 and hooker.finalized == 1
    assert len(model._forward_hooks) == 0
    assert rec.calls == []  # never reached
    assert "teacher" not in session.state
    bomb.fail = False
    session.initialize(teacher=3)
    assert session.lifecycle == "initialized"
    assert bomb.attempts == 2 and rec.names() == ["on_initialize"]
    assert hooker.num_hooks == 1
    model(torch.zeros(1, 2))
    assert hooker.seen == 1


# --- 5. events -------------------------------------------------------------------


@pytest.mark.parametrize("event", ["batch_start", "calibration_start", "batch_end", "optim_pre_step"])
def test_events_before_initialize_raise(event):
    session = Session([Recorder()])
    session.update_state(model=1)
    with pytest.raises(LifecycleError, match=rf"{event}\(\) refused: the session is not initialized yet") as info:
        getattr(session, event)()
    assert type(info.value) is LifecycleError
    assert session.lifecycle == "staging"


def test_events_after_finalize_raise():
    session = Session()
    session.initialize()
    session.finalize()
    with pytest.raises(LifecycleError, match=r"batch_start\(\) refused: the session is finalized"):
        session.batch_start()


BAD_ORDERS = [
    (["batch_end"], "between batches"),
    (["batch_start", "batch_start"], "after batch_start()"),
    (["batch_start", "optim_post_step"], "after batch_start()"),
    (["batch_start", "optim_pre_step", "batch_end"], "after optim_pre_step()"),
    (["batch_start", "calibration_start"], "after batch_start()"),
    (["calibration_start", "batch_start"], "during calibration"),
    (["batch_start", "loss_calculated", "loss_calculated"], "after loss_calculated()"),
]


@pytest.mark.parametrize(("calls", "where"), BAD_ORDERS)
def test_event_order_is_validated(calls, where):
    rec = Recorder()
    session = Session([rec])
    session.initialize(model=1, optimizer=1, teacher=1)
    *ok, bad = calls
    for name in ok:
        getattr(session, name)(*(["loss"] if name == "loss_calculated" else []))
    before = list(rec.calls)
    with pytest.raises(EventOrderError, match=rf"{bad}\(\) out of order: {where}") as info:
        getattr(session, bad)(*(["loss"] if bad == "loss_calculated" else []))
    assert rec.calls == before
    assert info.value.allowed == tuple(sorted(session.allowed_calls))  # finalize, reset too (they were left out)
    assert {"finalize", "reset"} <= set(info.value.allowed)
    # the message names the lifecycle and every call allowed, finalize() and reset() too (a fuzzing tester's case)
    assert str(info.value).endswith(
        f"Lifecycle {session.lifecycle!r}; allowed now: {', '.join(f'{c}()' for c in sorted(session.allowed_calls))}."
    )
    assert "finalize(), " in str(info.value) and "reset()" in str(info.value)


def test_gradient_accumulation_batches_without_optimizer_step_are_valid_and_step_counts_optimizer_steps():
    rec = Recorder()
    session = Session([rec])
    session.initialize(model=1, optimizer=1, teacher=1, steps_per_epoch=2)
    assert session.lifecycle == "initialized"
    for i in range(8):  # accumulate 4 batches per optimizer step
        session.batch_start()
        assert session.lifecycle == "running"
        session.loss_calculated(i)
        if i % 4 == 3:
            session.optim_pre_step()
            session.optim_post_step()
        session.batch_end()
    assert session.global_step == 2
    post = [c for c in rec.calls if c[0] == "optim_post_step"]
    assert post == [("optim_post_step", 1, 0.5), ("optim_post_step", 2, 1.0)]
    starts = [c for c in rec.calls if c[0] == "batch_start"]
    assert [c[1] for c in starts] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_schedule_fires_on_start_update_end_at_the_right_steps():
    rec = Recorder(start=0.5, end=2.0, update=0.5)
    session = Session([rec])
    session.initialize(model=1, optimizer=1, teacher=1, steps_per_epoch=4)
    for _ in range(12):
        session.batch_start()
        session.optim_pre_step()
        session.optim_post_step()
        session.batch_end()
    schedule = [c for c in rec.calls if c[0] in ("on_start", "on_update", "on_end")]
    assert schedule == [
        ("on_start", 2, 0.5),
        ("on_update", 4, 1.0),
        ("on_update", 6, 1.5),
        ("on_end", 8, 2.0),
    ]
    # batch events reach the modifier only while active: steps 2..7
    active_steps = sorted({c[1] for c in rec.calls if c[0] == "batch_start"})
    assert active_steps == [2, 3, 4, 5, 6, 7]
    session.finalize()
    assert rec.names()[-1] == "on_finalize"
    assert rec.names().count("on_end") == 1


def test_end_omitted_ends_at_finalize():
    rec = Recorder()
    session = Session([rec])
    session.initialize(model=1, optimizer=1, teacher=1)
    session.batch_start()
    session.batch_end()
    session.finalize()
    assert rec.names()[-2:] == ["on_end", "on_finalize"]
    assert rec.calls[-2] == ("on_end", 0, None)


def test_global_step_from_caller_overrides_count():
    rec = Recorder()
    session = Session([rec])
    session.initialize(model=1, optimizer=1, teacher=1, steps_per_epoch=10)
    session.batch_start(global_step=25)
    assert rec.calls[-1] == ("batch_start", 25, 2.5)
    session.batch_end()
    with pytest.raises(ValueError, match="global_step must be a non-negative int"):
        session.batch_start(global_step=-1)
    assert session.global_step == 25
    import numpy as np

    session.batch_start(global_step=np.int64(30))  # a step counter kept in an array (refused before)
    assert rec.calls[-1] == ("batch_start", 30, 3.0) and type(session.global_step) is int
    session.batch_end()


def test_loss_calculated_returns_the_loss_replaced_by_modifiers():
    @attrs.define(kw_only=True, slots=False, eq=False)
    class Doubler(Modifier):
        events = frozenset({"loss_calculated"})

        def on_event(self, state, event):
            return event.loss * 2

    session = Session([Doubler(), Doubler()])
    session.initialize()
    session.batch_start()
    assert session.loss_calculated(3) == 12


def test_calibration_events_reach_modifiers():
    @attrs.define(kw_only=True, slots=False, eq=False)
    class Calib(Modifier):
        seen: list = attrs.field(factory=list)

        def on_calibration_start(self, state):
            self.seen.append("start")

        def on_sequential_epoch_end(self, state, modules):
            self.seen.append(modules)

        def on_calibration_end(self, state):
            self.seen.append("end")

    m = Calib()
    session = Session([m])
    session.initialize()
    session.calibration_start()
    session.sequential_epoch_end(["layer0"])
    session.sequential_epoch_end(["layer1"])
    session.calibration_end()
    assert m.seen == ["start", ["layer0"], ["layer1"], "end"]


# --- 6. finalize and reset ------------------------------------------------------------


def test_finalize_once_removes_every_hook():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    hookers = [Hooker(), Hooker()]
    session = Session(hookers)
    session.initialize(model=model)
    assert len(model._forward_hooks) == 2
    session.finalize()
    assert len(model._forward_hooks) == 0
    assert [h.finalized for h in hookers] == [1, 1]
    with pytest.raises(LifecycleError, match=r"finalize\(\) refused: the session is already finalized"):
        session.finalize()
    assert [h.finalized for h in hookers] == [1, 1]


def test_finalize_before_initialize_is_refused():
    session = Session()
    with pytest.raises(LifecycleError, match=r"finalize\(\) refused: the session was never initialized"):
        session.finalize()


def test_finalize_failure_still_finalizes_everyone():
    @attrs.define(kw_only=True, slots=False, eq=False)
    class BadFinal(Hooker):
        def on_finalize(self, state):
            raise RuntimeError("nope")

    model = torch.nn.Linear(2, 2)
    bad, good = BadFinal(), Hooker()
    session = Session([bad, good])
    session.initialize(model=model)
    with pytest.raises(ModifierError, match=r"BadFinal.on_finalize\(\) raised RuntimeError: nope") as info:
        session.finalize()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert good.finalized == 1 and len(model._forward_hooks) == 0
    assert session.lifecycle == "finalized"


@pytest.mark.parametrize("where", ["created", "staging", "initialized", "running", "finalized"])
def test_reset_from_any_state(where):
    model = torch.nn.Linear(2, 2)
    hooker = Hooker()
    session = Session([hooker])
    if where != "created":
        session.update_state(model=model)
    if where in ("initialized", "running", "finalized"):
        session.initialize()
    if where in ("running", "finalized"):
        session.batch_start()
        session.batch_end()
    if where == "finalized":
        session.finalize()
    assert session.lifecycle == where
    session.reset()
    assert session.lifecycle == "created"
    assert len(model._forward_hooks) == 0
    assert hooker.finalized == (1 if where in ("initialized", "running", "finalized") else 0)
    assert len(session.state) == 0
    session.initialize(model=model)
    assert session.lifecycle == "initialized"


def test_reset_with_bad_recipe_changes_nothing():
    session = Session([NeedsData()])
    session.update_state(model=1)
    with pytest.raises(llmc_fsm.RecipeError):
        session.reset(recipe=42)
    assert session.lifecycle == "staging"
    assert session.state.model == 1


# --- contexts ------------------------------------------------------------------------


def test_active_session_is_per_context_and_finalized_on_exit():
    with pytest.raises(LifecycleError, match="no active session"):
        active_session()
    model = torch.nn.Linear(2, 2)
    with create_session([Hooker()]) as outer:
        assert active_session() is outer
        with create_session() as inner:
            assert active_session() is inner
        assert active_session() is outer
        outer.initialize(model=model)
    assert outer.lifecycle == "finalized"
    assert len(model._forward_hooks) == 0
    with pytest.raises(LifecycleError):
        active_session()


def test_sessions_do_not_leak_between_threads_and_tasks():
    seen = {}
    together = threading.Barrier(4, timeout=30)  # every thread's session is active at the same time

    def worker(name):
        with create_session() as session:
            session.update_state(model=name)
            together.wait()
            seen[name] = active_session().state.model
            together.wait()

    threads = [threading.Thread(target=worker, args=(f"t{i}",)) for i in range(4)]
    with create_session() as main:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert active_session() is main
    assert seen == {f"t{i}": f"t{i}" for i in range(4)}

    async def task(name):
        with create_session() as session:
            session.update_state(model=name)
            await asyncio.sleep(0)
            return active_session().state.model

    async def run_all():
        return await asyncio.gather(*(task(f"a{i}") for i in range(4)))

    assert asyncio.run(run_all()) == [f"a{i}" for i in range(4)]


# --- 8. the table is data; the diagram is generated from it ---------------------------------


def test_transition_table_names_only_real_states():
    for row in TRANSITIONS:
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        assert set(sources) <= set(STATES), row
        assert row["dest"] in STATES, row
    assert {row["trigger"] for row in TRANSITIONS} == {"update_state", "initialize", "first_event", "finalize", "reset"}
    for position, nexts in EVENT_ORDER.items():
        assert set(nexts.values()) <= set(EVENT_ORDER), position


def test_transitions_machine_has_no_back_doors():
    session = Session()
    fsm = session._fsm
    assert not any(name.startswith("to_") for name in dir(fsm))
    with pytest.raises(transitions.MachineError):
        fsm.finalize()  # the raw trigger also refuses: created -> finalize is not in the table


def test_docs_diagram_matches_table_and_cli():
    generated = mermaid()
    doc = (REPO / "docs" / "lifecycle.md").read_text(encoding="utf-8")
    assert generated in doc, "docs/lifecycle.md is out of date: run `llmc-fsm lifecycle --mermaid` and paste it"
    out = subprocess.run(
        [sys.executable, "-m", "llmc_fsm.cli.main", "lifecycle", "--mermaid"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == generated
    for row in TRANSITIONS:
        assert f": {row['trigger']}" in generated


# --- what `llmc-fsm lifecycle` and allowed_calls list is what the session accepts (issue 11 case 14) ------

_PATHS = {
    "created": [],
    "staging": ["update_state"],
    "initialized": ["initialize"],
    "running, between batches": ["initialize", "batch_start", "batch_end"],
    "after batch_start": ["initialize", "batch_start"],
    "after loss_calculated": ["initialize", "batch_start", "loss_calculated"],
    "after optim_pre_step": ["initialize", "batch_start", "optim_pre_step"],
    "after optim_post_step": ["initialize", "batch_start", "optim_pre_step", "optim_post_step"],
    "during calibration": ["initialize", "calibration_start"],
    "finalized": ["initialize", "finalize"],
}
_EVENT_ARGS = {"loss_calculated": (1.0,), "sequential_epoch_end": ([],)}


def _at(path: list[str]) -> Session:
    session = Session()
    for call in path:
        getattr(session, call)(*_EVENT_ARGS.get(call, ()))
    return session


@pytest.mark.parametrize("where", list(_PATHS))
def test_allowed_calls_are_exactly_the_events_the_session_accepts(where):
    listed = _at(_PATHS[where]).allowed_calls
    accepted = set()
    for event in llmc_fsm.core.lifecycle.EVENTS:
        session = _at(_PATHS[where])
        try:
            getattr(session, event)(*_EVENT_ARGS.get(event, ()))
        except LifecycleError:
            continue
        accepted.add(event)
    assert accepted == set(listed) & set(llmc_fsm.core.lifecycle.EVENTS)


def test_docs_and_cli_list_the_allowed_calls_per_state_and_position():
    out = subprocess.run(
        [sys.executable, "-m", "llmc_fsm.cli.main", "lifecycle"], capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines()[2] == "initialized  allows: batch_start, calibration_start, finalize, reset"
    assert "              after optim_pre_step(): optim_post_step" in out.splitlines()
    doc = (REPO / "docs" / "lifecycle.md").read_text(encoding="utf-8")
    assert f"```text\n{out}```" in doc, "docs/lifecycle.md is out of date: paste `llmc-fsm lifecycle`"


@pytest.mark.parametrize("copy_it", [pickle.dumps, copy.copy, copy.deepcopy], ids=["pickle", "copy", "deepcopy"])
def test_a_session_refuses_pickle_and_copy_and_names_what_to_use(copy_it):
    session = Session([Recorder()])
    session.update_state(model=torch.nn.Linear(2, 2))
    with pytest.raises(LifecycleError) as info:
        copy_it(session)
    assert str(info.value) == (
        "a Session cannot be pickled or copied (it holds a lock, the modifiers' torch hooks and weak references bound "
        "to this run); save its progress with session.state_dict() or session.save(path) and resume it with "
        "load_state_dict() / Session.load(path, recipe, model=...)"
    )
    assert (info.value.lifecycle, info.value.call) == ("staging", "pickle")
    assert info.value.allowed == tuple(sorted(session.allowed_calls))
    assert session.lifecycle == "staging"  # nothing changed


def test_a_steps_per_epoch_that_is_not_a_positive_int_is_refused_and_nothing_is_stored():
    """A fuzzing tester's cases: steps_per_epoch="10" was stored, and the first event then raised a TypeError after
    the session had moved to 'running'; 0 (an empty loader's length) turned every schedule off without a word."""
    model = torch.nn.Linear(2, 2)
    for bad, extra in (("10", ""), (0, " (an empty training loader?)"), (-1, ""), (2.5, ""), (True, "")):
        message = (
            f"steps_per_epoch must be a positive int (optimizer steps per epoch), got {bad!r}{extra}; e.g. "
            "llmc_fsm.integrations.torch.steps_per_epoch(train_loader, gradient_accumulation_steps), "
            "ceil(len(train_loader) / gradient_accumulation_steps)"
        )
        session = Session([Recorder(start=0)])
        with pytest.raises(ValueError) as info:
            session.update_state(steps_per_epoch=bad)
        assert str(info.value) == message
        with pytest.raises(ValueError) as info:
            session.initialize(model=model, optimizer=object(), teacher=model, steps_per_epoch=bad)
        assert str(info.value) == message
        assert (session.lifecycle, dict(session.state)) == ("created", {})
    for good in (3, np.int64(3), torch.tensor(3)):  # stored as the Python int (a tester's case: a numpy int made
        recorder = Recorder(start=0)  # the epochs numpy floats, which a checkpoint could not write)
        session = Session([recorder])
        session.initialize(model=model, optimizer=object(), teacher=model, steps_per_epoch=good)
        assert type(session.state["steps_per_epoch"]) is int
        session.batch_start()
        assert session.lifecycle == "running" and type(recorder.calls[-1][2]) is float
    assert steps_per_epoch(np.int64(10), 2) == 5 and resume_position(Session([Recorder()]), np.int64(4)) == (0, 0)
    for empty in ([], 0, -3):
        with pytest.raises(ValueError, match=r"batches per epoch: give a training loader with at least one batch"):
            steps_per_epoch(empty, 2)
    for bad in (0, "2", 2.5):  # the helpers' own argument
        with pytest.raises(ValueError, match=rf"^gradient_accumulation_steps must be an int >= 1, got {bad!r}$"):
            steps_per_epoch([1, 2, 3], bad)
        with pytest.raises(ValueError, match=rf"^gradient_accumulation_steps must be an int >= 1, got {bad!r}$"):
            is_step(0, 3, bad)


@pytest.mark.parametrize(("call", "args"), [
    ("batch_start", {"global_step": -1}), ("batch_start", {"global_step": "x"}), ("loss_calculated", {"loss": None}),
])  # fmt: skip
def test_an_event_with_a_bad_argument_before_initialize_is_refused_for_the_lifecycle(call, args):
    """On a created or staged session these raised ValueError for the argument, where the docs promise a
    LifecycleError for every call the table does not allow (found by a tester)."""
    session = Session([Recorder()])
    for step in ("created", "staging"):
        with pytest.raises(LifecycleError) as info:
            getattr(session, call)(**args)
        assert (info.value.lifecycle, info.value.call) == (step, call)
        assert not isinstance(info.value, EventOrderError)
        session.update_state(model=1)
    assert session.lifecycle == "staging"
