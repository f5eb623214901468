"""Random call sequences against a reference transition table (hypothesis stateful testing).

The reference below is written independently of ``llmc_fsm.core.lifecycle``: if the
library's table or its guards change behaviour, these tests disagree with it.
Every invalid call must raise ``LifecycleError`` (or a subclass) and change
nothing observable. At arbitrary points the session is checkpointed (in memory
or on disk) and replaced by a new session with new modifier objects resumed from
it: the resumed session must go on matching the same reference.
"""

from __future__ import annotations

import tempfile

import attrs
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from llmc_fsm import EventOrderError, LifecycleError, MissingStateError, Modifier, ModifierError, Session
from llmc_fsm.session.checkpoint import read_checkpoint

# lifecycle -> call -> next lifecycle (reference; events handled separately)
REFERENCE = {
    "created": {"update_state": "staging", "initialize": "initialized", "reset": "created"},
    "staging": {"update_state": "staging", "initialize": "initialized", "reset": "created"},
    "initialized": {"finalize": "finalized", "reset": "created"},
    "running": {"finalize": "finalized", "reset": "created"},
    "finalized": {"reset": "created"},
}
# position between/inside batches -> event -> next position
REFERENCE_EVENTS = {
    "idle": {"batch_start": "in_batch", "calibration_start": "calibrating"},
    "in_batch": {"loss_calculated": "after_loss", "optim_pre_step": "in_step", "batch_end": "idle"},
    "after_loss": {"optim_pre_step": "in_step", "batch_end": "idle"},
    "in_step": {"optim_post_step": "stepped"},
    "stepped": {"batch_end": "idle"},
    "calibrating": {"sequential_epoch_end": "calibrating", "calibration_end": "idle"},
}
EVENTS = sorted({e for nexts in REFERENCE_EVENTS.values() for e in nexts})


@attrs.define(kw_only=True, slots=False, eq=False)
class Probe(Modifier):
    """Needs model and optimizer; hooks the model; can be told to fail in on_initialize."""

    required_state = frozenset({"model", "optimizer"})
    events = frozenset({"batch_start", "loss_calculated", "optim_pre_step", "optim_post_step", "batch_end"})
    fail_next_initialize: bool = attrs.field(default=False, init=False)
    initialized: int = attrs.field(default=0, init=False)
    finalized: int = attrs.field(default=0, init=False)
    events_seen: int = attrs.field(default=0, init=False)
    acc: torch.Tensor = attrs.field(factory=lambda: torch.zeros(2), init=False)

    def on_initialize(self, state):
        self.register_hook(state.model, lambda *a: None)
        if self.fail_next_initialize:
            raise ValueError("probe failure")
        self.initialized += 1

    def on_event(self, state, event):
        self.events_seen += 1
        self.acc += torch.tensor([1.0, 0.5])

    def on_finalize(self, state):
        self.finalized += 1

    def state_dict(self):
        return {"counts": [self.initialized, self.finalized, self.events_seen], "acc": self.acc.clone()}

    def load_state_dict(self, state):
        self.initialized, self.finalized, self.events_seen = state["counts"]
        self.acc = state["acc"].clone()


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Linear(1, 1)
        self.probes = [Probe(), Probe()]
        self.session = Session(self.probes)
        self.lifecycle = "created"
        self.position = None
        self.state: dict = {}
        self.step = 0
        self.counts = [[0, 0], [0, 0]]  # reference (on_initialize successes, on_finalize calls) per probe

    # --- helpers ---------------------------------------------------------------
    def observe(self):
        s = self.session
        return (
            s.lifecycle,
            dict(s.state.values),
            s.global_step,
            tuple((p.initialized, p.finalized, p.events_seen, p.num_hooks) for p in self.probes),
            len(self.model._forward_hooks),
        )

    def refused(self, call, fn, error=LifecycleError):
        before = self.observe()
        try:
            fn()
        except error as exc:
            assert exc.lifecycle == before[0]
            assert exc.call == call
            assert isinstance(exc, LifecycleError)
        else:
            raise AssertionError(f"{call}() in {self.lifecycle!r} (position {self.position}) should have raised")
        assert self.observe() == before, f"refused {call}() changed the session"

    def event_args(self, event):
        return {"loss_calculated": ("loss",), "sequential_epoch_end": (["layer"],)}.get(event, ())

    # --- rules ------------------------------------------------------------------
    @rule(key=st.sampled_from(["model", "optimizer", "teacher", "extra"]), none=st.booleans())
    def update_state(self, key, none):
        value = None if none and key != "model" else (self.model if key == "model" else key.upper())
        call = lambda: self.session.update_state(**{key: value})  # noqa: E731
        if "update_state" in REFERENCE[self.lifecycle]:
            call()
            self.state[key] = value
            self.lifecycle = REFERENCE[self.lifecycle]["update_state"]
        else:
            self.refused("update_state", call)

    @rule(pass_optimizer=st.booleans(), fail=st.booleans())
    def initialize(self, pass_optimizer, fail):
        kwargs = {"optimizer": "OPT"} if pass_optimizer else {}
        self.probes[1].fail_next_initialize = fail
        call = lambda: self.session.initialize(**kwargs)  # noqa: E731
        if "initialize" not in REFERENCE[self.lifecycle]:
            self.refused("initialize", call)
            return
        merged = {**self.state, **kwargs}
        missing = {k for k in ("model", "optimizer") if merged.get(k) is None}
        if missing:
            self.refused("initialize", call, MissingStateError)
        elif fail:
            before = self.observe()
            try:
                call()
            except ModifierError as exc:
                assert isinstance(exc.__cause__, ValueError)
            else:
                raise AssertionError("a failing on_initialize must raise ModifierError")
            after = self.observe()
            # the first probe was initialized then rolled back (finalized); nothing else changed
            assert after[0] == before[0] and after[1] == before[1] and after[4] == 0
            assert after[3][0][1] == before[3][0][1] + 1
            self.counts[0][0] += 1
            self.counts[0][1] += 1
        else:
            call()
            self.state = merged
            self.lifecycle = "initialized"
            self.position = "idle"
            self.step = 0
            for c in self.counts:
                c[0] += 1
        self.probes[1].fail_next_initialize = False

    @rule(event=st.sampled_from(EVENTS))
    def event(self, event):
        call = lambda: getattr(self.session, event)(*self.event_args(event))  # noqa: E731
        if self.lifecycle not in ("initialized", "running"):
            self.refused(event, call)
            return
        nxt = REFERENCE_EVENTS[self.position].get(event)
        if nxt is None:
            self.refused(event, call, EventOrderError)
            return
        call()
        self.position = nxt
        self.lifecycle = "running"
        if event == "optim_post_step":
            self.step += 1

    @rule()
    def finalize(self):
        if "finalize" not in REFERENCE[self.lifecycle]:
            self.refused("finalize", self.session.finalize)
            return
        self.session.finalize()
        for c in self.counts:
            c[1] += 1
        self.lifecycle = "finalized"
        self.position = None

    @rule(new_recipe=st.booleans())
    def reset(self, new_recipe):
        if self.lifecycle in ("initialized", "running"):
            for c in self.counts:
                c[1] += 1
        if new_recipe:
            self.counts = [[0, 0], [0, 0]]
            self.probes = [Probe(), Probe()]
            self.session.reset(self.probes)
        else:
            self.session.reset()
        self.lifecycle = "created"
        self.position = None
        self.state = {}
        self.step = 0

    @rule(on_disk=st.booleans())
    def save_and_resume(self, on_disk):
        """Checkpoint, drop the session, resume a new one (new modifier objects) from the checkpoint."""
        if self.lifecycle not in ("initialized", "running") or self.position != "idle":
            self.refused("state_dict", self.session.state_dict)
            return
        saved = self.session.state_dict()
        if on_disk:
            with tempfile.TemporaryDirectory() as tmp:
                self.session.save(tmp)
                saved = read_checkpoint(tmp)
        self.session.reset()  # the interrupted process: its hooks go away with it
        probes = [Probe(), Probe()]
        session = Session(probes)
        session.update_state(**self.state)
        session.initialize()
        session.load_state_dict(saved)
        self.session, self.probes = session, probes

    # --- invariants -----------------------------------------------------------------
    @invariant()
    def matches_reference(self):
        s = self.session
        assert s.lifecycle == self.lifecycle
        assert dict(s.state.values) == self.state
        assert s.global_step == self.step
        live = self.lifecycle in ("initialized", "running")
        for p, (initialized, finalized) in zip(self.probes, self.counts, strict=True):
            assert p.num_hooks == (1 if live else 0)
            assert (p.initialized, p.finalized) == (initialized, finalized)
            assert p.acc.tolist() == [p.events_seen, p.events_seen * 0.5]
        assert len(self.model._forward_hooks) == (2 if live else 0)


TestLifecycle = LifecycleMachine.TestCase
TestLifecycle.settings = settings(
    max_examples=1100,  # >= 1000 generated examples per run (the issue asks for 1000)
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
