"""Fault injection (issue 10): a modifier raising in each hook kind, after changing a weight in place or not.

Every failure reaches the caller as ModifierError naming the modifier and hook (and the module for torch
hooks); when the hook changed a targeted weight before raising, the error names the parameter, the session
refuses further events and every hook is removed at once.
"""

from __future__ import annotations

import attrs
import pytest
import tiny_llama
import torch
from torch import nn

from llmc_fsm import (
    CheckpointError,
    EventOrderError,
    LifecycleError,
    MissingStateError,
    Modifier,
    ModifierError,
    PluginError,
    Session,
)
from llmc_fsm.core.lifecycle import BATCH_EVENTS

RELOAD = "Model modified by a failed hook; reload it"


def _torch_hooks(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)
        for m in model.modules()
    )


@attrs.define(kw_only=True, slots=False, eq=False)
class Faulty(Modifier):
    """Targets ``model[0]``; in ``fail_in`` it halves that weight (when ``mutate``) and raises."""

    required_state = frozenset({"model"})
    fail_in: str = "on_event"
    mutate: bool = True
    events: frozenset = attrs.field(default=frozenset(), init=True)
    _module: nn.Module | None = attrs.field(default=None, init=False)

    @property
    def resolved_targets(self):
        return {"0": self._module} if self._module is not None else {}

    def _maybe_fail(self, hook: str) -> None:
        if hook == self.fail_in:
            if self.mutate:
                with torch.no_grad():
                    self._module.weight.mul_(0.5)
            raise RuntimeError(f"boom in {hook}")

    def on_initialize(self, state):
        self._module = state.model[0]
        self.register_hook(state.model[1], lambda *a: None)  # an ordinary hook, to see it removed
        kind = self.fail_in.removesuffix(" hook")
        if kind in ("forward_pre", "forward", "full_backward"):
            self.register_hook(self._module, lambda *a: self._maybe_fail(self.fail_in), kind=kind)
        self._maybe_fail("on_initialize")

    def on_start(self, state, event):
        self._maybe_fail("on_start")

    def on_update(self, state, event):
        self._maybe_fail("on_update")

    def on_end(self, state, event):
        self._maybe_fail("on_end")

    def on_event(self, state, event):
        self._maybe_fail("on_event")

    def on_calibration_start(self, state):
        self._maybe_fail("on_calibration_start")

    def on_sequential_epoch_end(self, state, modules):
        self._maybe_fail("on_sequential_epoch_end")

    def on_calibration_end(self, state):
        self._maybe_fail("on_calibration_end")

    def on_finalize(self, state):
        self._maybe_fail("on_finalize")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))


def _batch(session: Session) -> None:
    session.batch_start()
    session.loss_calculated(1.0)
    session.optim_pre_step()
    session.optim_post_step()
    session.batch_end()


# (hook, modifier arguments, what to do after initialize to reach the hook)
CASES = [
    ("on_start", {}, lambda s, m: s.batch_start()),
    ("on_update", {"start": 0, "update": 1}, lambda s, m: (_batch(s), s.batch_start())),
    ("on_end", {"end": 1}, lambda s, m: (_batch(s), s.batch_start())),
    *[("on_event", {"events": frozenset({event})}, (lambda s, m, e=event: _batch(s))) for event in BATCH_EVENTS],
    ("on_calibration_start", {}, lambda s, m: s.calibration_start()),
    ("on_sequential_epoch_end", {}, lambda s, m: (s.calibration_start(), s.sequential_epoch_end([m[0]]))),
    ("on_calibration_end", {}, lambda s, m: (s.calibration_start(), s.calibration_end())),
    ("forward_pre hook", {}, lambda s, m: m(torch.ones(1, 3))),
    ("forward hook", {}, lambda s, m: m(torch.ones(1, 3))),
    ("full_backward hook", {}, lambda s, m: m(torch.ones(1, 3, requires_grad=True)).sum().backward()),
]
IDS = [f"{hook}-{sorted(kw.get('events', ['']))[0]}" if "events" in kw else hook for hook, kw, _ in CASES]


@pytest.mark.parametrize(("hook", "kwargs", "reach"), CASES, ids=IDS)
def test_a_hook_that_changed_a_weight_and_raised_is_named_and_stops_the_session(hook, kwargs, reach):
    model = _model()
    mod = Faulty(fail_in=hook, **kwargs)
    session = Session([mod])
    session.initialize(model=model, steps_per_epoch=1)
    weight = model[0].weight.detach().clone()
    with pytest.raises(ModifierError) as info:
        reach(session, model)
    err = info.value
    assert err.modifier == "Faulty"
    assert err.hook == hook
    assert err.modified == ("0.weight",)
    assert isinstance(err.__cause__, RuntimeError) and str(err.__cause__) == f"boom in {hook}"
    msg = str(err)
    assert "It had already changed 1 parameter(s) in place: 0.weight." in msg and RELOAD in msg
    if hook.endswith(" hook"):
        assert err.module == "0"
        assert msg.startswith(f"Faulty's {hook} on 0 raised RuntimeError: boom in {hook}")
    else:
        assert err.module is None
        assert msg.startswith(f"Faulty.{hook}() raised RuntimeError: boom in {hook} (during ")
    assert torch.equal(model[0].weight, weight * 0.5)  # what the model holds: the change, not undone
    assert session.failed is not None and "reload it" in session.failed
    assert mod.num_hooks == 0 and _torch_hooks(model) == 0  # removed at once
    with pytest.raises(LifecycleError) as refused:
        session.batch_start()
    assert "model modified by a failed hook; reload it" in str(refused.value)
    assert refused.value.allowed == ("finalize", "reset")
    with pytest.raises(LifecycleError, match="reload it"):
        session.state_dict()
    session.finalize()  # releases (on_end is skipped: the model is not the recipe's any more)
    assert session.lifecycle == "finalized"
    session.reset()
    assert session.failed is None and session.allowed_calls == frozenset({"update_state", "initialize", "reset"})


@pytest.mark.parametrize(("hook", "kwargs", "reach"), CASES, ids=IDS)
def test_a_hook_that_raised_without_changing_weights_leaves_the_session_usable(hook, kwargs, reach):
    model = _model()
    mod = Faulty(fail_in=hook, mutate=False, **kwargs)
    session = Session([mod])
    session.initialize(model=model, steps_per_epoch=1)
    hooks = _torch_hooks(model)
    with pytest.raises(ModifierError) as info:
        reach(session, model)
    assert info.value.modified == ()
    assert RELOAD not in str(info.value)
    assert session.failed is None
    assert mod.num_hooks == _torch_hooks(model) == hooks  # nothing removed
    session.finalize()
    assert _torch_hooks(model) == 0


@pytest.mark.parametrize("hook", ["on_end", "on_finalize"])
def test_a_hook_failing_at_finalize_names_the_parameter_and_still_finalizes(hook):
    model = _model()
    session = Session([Faulty(fail_in=hook)])
    session.initialize(model=model)
    session.batch_start()
    session.batch_end()
    with pytest.raises(ModifierError) as info:
        session.finalize()
    assert info.value.hook == hook and info.value.modified == ("0.weight",)
    assert str(info.value).endswith("All modifiers were still finalized and their hooks removed.")
    assert session.lifecycle == "finalized" and _torch_hooks(model) == 0


def test_a_rolled_back_initialize_that_changed_weights_names_them_and_refuses_a_retry():
    model = _model()

    @attrs.define(kw_only=True, slots=False, eq=False)
    class PrunesAtInitialize(Modifier):
        required_state = frozenset({"model"})

        def on_initialize(self, state):
            with torch.no_grad():
                state.model[1].weight.zero_()

    first, second = PrunesAtInitialize(), Faulty(fail_in="on_initialize", mutate=False)
    session = Session([first, second])
    session.update_state(model=model)
    with pytest.raises(ModifierError) as info:
        session.initialize()
    err = info.value
    assert err.modifier == "Faulty" and err.hook == "on_initialize" and err.modified == ("1.weight",)
    assert "Rolled back: 1 modifier(s) already initialized were finalized" in str(err)
    assert "Fix the cause and call initialize() again" not in str(err)
    # The roll-back finalizes modifiers and removes hooks; it cannot undo in-place writes: the model keeps them.
    assert torch.count_nonzero(model[1].weight) == 0 and _torch_hooks(model) == 0
    assert session.lifecycle == "staging"
    with pytest.raises(LifecycleError, match=r"initialize\(\) refused: initialize\(\) changed 1 parameter\(s\)"):
        session.initialize()
    session.reset()  # after a reset, a freshly loaded model is accepted
    second.fail_in = "nothing"
    session.initialize(model=_model())
    assert session.lifecycle == "initialized"


def test_a_calibration_hook_failing_inside_the_pipeline_is_a_modifier_error_naming_the_module():
    pytest.importorskip("transformers")
    from llmc_fsm.pipeline.sequential import run_sequential

    model = tiny_llama.llama(vocab=32, hidden=16, heads=2, kv_heads=2, positions=16, tied=False)
    target = "model.layers.1.mlp.up_proj"

    @attrs.define(kw_only=True, slots=False, eq=False)
    class Observer(Modifier):
        required_state = frozenset({"model", "calibration_data"})
        _modules: dict = attrs.field(factory=dict, init=False)

        @property
        def resolved_targets(self):
            return dict(self._modules)

        def on_initialize(self, state):
            self._modules = {target: state.model.get_submodule(target)}

        def on_calibration_start(self, state):
            module = self._modules[target]

            def pre_hook(mod, args):
                with torch.no_grad():
                    mod.weight.add_(1.0)
                raise ValueError("statistics overflow")

            self.register_hook(module, pre_hook, kind="forward_pre")

    session = Session([Observer()])
    data = torch.randint(0, 32, (2, 8))
    session.initialize(model=model, calibration_data=data)
    with pytest.raises(ModifierError) as info:
        run_sequential(session, progress=False)
    err = info.value
    assert (err.modifier, err.hook, err.module, err.modified) == (
        "Observer",
        "forward_pre hook",
        target,
        (f"{target}.weight",),
    )
    assert isinstance(err.__cause__, ValueError)
    assert _torch_hooks(model) == 0 and session.failed is not None
    with pytest.raises(LifecycleError, match="reload it"):
        session.calibration_end()


# ------------------------------------------------------------------ a breaker's cases (2026-12-06)
@attrs.define(kw_only=True, slots=False, eq=False)
class Recorder(Modifier):
    """Records its hooks; ``act(session, hook)`` runs inside the hooks named in ``act_in``."""

    required_state = frozenset({"model"})
    events: frozenset = attrs.field(default=frozenset(BATCH_EVENTS), init=True)
    act_in: tuple = ()
    act: object = None
    end_raises: bool = False
    calls: list = attrs.field(factory=list, init=False)

    def _hook(self, name, state):
        self.calls.append(name)
        if name in self.act_in:
            self.act(name)

    def on_initialize(self, state):
        self._hook("on_initialize", state)

    def on_event(self, state, event):
        self._hook(event.type, state)

    def on_start(self, state, event):
        self._hook("on_start", state)

    def on_update(self, state, event):
        self._hook("on_update", state)

    def on_end(self, state, event):
        self._hook("on_end", state)
        if self.end_raises:
            raise RuntimeError("on_end failed")

    def on_finalize(self, state):
        self._hook("on_finalize", state)


def test_an_update_due_at_a_float_sum_fires_at_its_step_not_one_later():
    """``update: 0.1`` with 10 steps per epoch: the updates fall at epochs 0.1, 0.2, ... 0.9, each at its own step
    (before, the points were a running sum: 0.1 + 0.1 + 0.1 > 3 / 10, and the update of epoch 0.3 never fired); the
    end (epoch 1.0) at the batch_end of the tenth batch, whose step reached it."""
    rec = Recorder(start=0.0, end=1.0, update=0.1, events=frozenset())
    session = Session([rec])
    session.initialize(model=nn.Sequential(nn.Linear(2, 2)), steps_per_epoch=10)
    fired = []
    for _ in range(12):
        before = len(rec.calls)
        session.batch_start()
        for event in BATCH_EVENTS[1:]:
            getattr(session, event)(*([1.0] if event == "loss_calculated" else []))
        fired.append([c for c in rec.calls[before:] if c != "batch_start"])
    assert fired == [["on_start"]] + [["on_update"]] * 8 + [["on_update", "on_end"], [], []]


def test_on_end_raising_at_finalize_still_finalizes_that_modifier():
    """The error says "All modifiers were still finalized": the failing modifier's own on_finalize runs too (before,
    it shared one try with on_end and was skipped)."""
    failing, other = Recorder(end_raises=True), Recorder()
    session = Session([failing, other])
    session.initialize(model=nn.Sequential(nn.Linear(2, 2)))
    session.batch_start()
    with pytest.raises(ModifierError) as info:
        session.finalize()
    assert str(info.value) == ("Recorder#1.on_end() raised RuntimeError: on_end failed (during finalize()). All "
                               "modifiers were still finalized and their hooks removed.")  # fmt: skip
    assert failing.calls[-2:] == ["on_end", "on_finalize"] and other.calls[-2:] == ["on_end", "on_finalize"]
    assert session.lifecycle == "finalized"


@pytest.mark.parametrize("inside", ["batch_start", "on_end", "on_initialize"])
@pytest.mark.parametrize("call", ["finalize", "reset", "batch_end", "update_state", "state_dict"])
def test_a_hook_calling_its_own_session_is_refused_and_the_event_reaches_the_others_in_order(inside, call):
    """Before, a hook's ``finalize()`` ran every ``on_finalize`` while the event was still being dispatched (the next
    modifier then saw ``finalize`` as its ``batch_start``), a hook's ``batch_end()`` made later modifiers see
    ``batch_end`` twice, and ``finalize()`` from ``on_end`` finalized every modifier twice."""
    session = Session()
    errors = []

    def act(hook):
        try:
            getattr(session, call)(**({"x": 1} if call == "update_state" else {}))
        except LifecycleError as exc:
            errors.append(str(exc))

    first, second = Recorder(act_in=(inside,), act=act), Recorder()
    session.reset([first, second])
    session.initialize(model=nn.Sequential(nn.Linear(2, 2)))
    session.batch_start()
    session.finalize()
    during = {"batch_start": "batch_start()", "on_end": "finalize()", "on_initialize": "initialize()"}[inside]
    assert errors == [
        f"{call}() refused: called from a modifier's hook while the session runs {during}; a hook must not drive its "
        f"own session (the other modifiers would see the events out of order): make the call from your code after "
        f"{during} returns. Nothing was changed."
    ]
    expected = ["on_initialize", "on_start", "batch_start", "on_end", "on_finalize"]
    assert first.calls == expected and second.calls == expected


def test_a_modifier_whose_resolved_targets_or_state_dict_has_the_wrong_type_is_named() -> None:
    """B4's cases (session 31): ``resolved_targets`` giving ``{name: weight}`` (or a list, or None) raised a raw
    AttributeError after every on_initialize had run, leaving their hooks on the model (one more set per retry); a
    ``state_dict()`` returning None saved, and the checkpoint was then refused as "damaged"."""
    @attrs.define(kw_only=True, slots=False, eq=False)
    class Odd(Modifier):
        targets_value: object = None
        state_value: object = None

        @property
        def resolved_targets(self):
            return self.targets_value

        def on_initialize(self, state) -> None:
            self.register_hook(state.model, lambda m, a: None, kind="forward_pre")

        def state_dict(self):
            return self.state_value

    model = torch.nn.Linear(4, 4)
    for value, shown in ((None, "NoneType"), ([model], "list"), ({"w": model.weight}, "a mapping of other values")):
        session = Session([Odd(targets_value=value)])
        with pytest.raises(ValueError) as info:
            session.initialize(model=model)
        assert str(info.value) == (
            "Odd.resolved_targets must be a mapping of module names to nn.Module (the modules it changes, {} for "
            f"none), got {shown}. Rolled back: the session is still 'created'"
        )
        assert not model._forward_pre_hooks and session.lifecycle == "created"
    session = Session([Odd(targets_value={"": model})])
    session.initialize(model=model)
    with pytest.raises(TypeError, match=r"^Odd.state_dict\(\) returned NoneType, not a dict \(a missing return\?\)"):
        session.state_dict()
    session.finalize()


@attrs.define(kw_only=True, slots=False, eq=False)
class Interrupted(Faulty):
    """``Faulty`` raising ``KeyboardInterrupt`` (Ctrl-C mid-hook, e.g. during an in-place rotation) instead."""

    def _maybe_fail(self, hook: str) -> None:
        if hook == self.fail_in:
            if self.mutate:
                with torch.no_grad():
                    self._module.weight.mul_(2.0)
            raise KeyboardInterrupt


def test_an_interrupt_after_a_hook_changed_the_model_leaves_the_session_refusing_and_propagates_as_it_is() -> None:
    """B4's case (session 31): a hook that doubled a weight and was then interrupted left the session accepting
    the next call, which doubled it again (x4); with an Exception the session refuses until reset()."""
    model = _model()
    session = Session([Interrupted(fail_in="on_initialize")])
    with pytest.raises(KeyboardInterrupt):
        session.initialize(model=model)
    with pytest.raises(LifecycleError, match=r"model modified by an interrupted hook; reload it"):
        session.initialize(model=model)
    session = Session([Interrupted(fail_in="on_calibration_start")])
    session.initialize(model=_model())
    with pytest.raises(KeyboardInterrupt):
        session.calibration_start()
    with pytest.raises(LifecycleError, match=r"failed after changing 1 parameter\(s\) in place"):
        session.calibration_end()
    session = Session([Interrupted(fail_in="on_calibration_start", mutate=False)])
    session.initialize(model=_model())
    with pytest.raises(KeyboardInterrupt):
        session.calibration_start()
    session.calibration_end()  # nothing changed: the session goes on
    session.finalize()


def test_the_error_carries_what_happened_and_the_advice_apart():
    """The one-shot API and the Trainer replace the session's advice with their own; they parsed the message for it
    (a message changed in one place broke the other silently). The parts are attributes; set_advice replaces one."""
    model = _model()
    session = Session([Faulty(fail_in="on_event", mutate=False, events=frozenset({"batch_start"}))])
    session.initialize(model=model)
    with pytest.raises(ModifierError) as info:
        session.batch_start()
    error = info.value
    assert error.what == "Faulty.on_event() raised RuntimeError: boom in on_event (during batch_start())."
    assert error.advice.startswith("No in-place change to a parameter of the model was seen.")
    assert str(error) == f"{error.what} {error.advice}"
    error.set_advice("Do this.")
    assert (str(error), error.advice, error.args) == (f"{error.what} Do this.", "Do this.", (f"{error.what} Do this.",))
    error.set_advice("")
    assert str(error) == error.what


def _finalize_a_fresh_session():
    Session([]).finalize()


@pytest.mark.parametrize("error", [
    LifecycleError("m", lifecycle="created", call="finalize", allowed=["reset", "initialize"]),
    EventOrderError("m", lifecycle="running", call="batch_end", allowed=["batch_start"]),
    MissingStateError("m", lifecycle="staging", missing={"A": frozenset({"x"})}),
    ModifierError("m", modifier="A", hook="on_event", module="0", modified=["0.weight"], advice="Do this."),
    CheckpointError("m", differences=["a", "b"]),
    PluginError("m", distribution="d", entry_point="e"),
], ids=lambda e: type(e).__name__)  # fmt: skip
def test_the_errors_survive_pickling_with_their_attributes(error):
    """Unpickling called cls(*args) and raised "missing 2 required keyword-only arguments": a process pool's worker
    that raised one broke the pool ("terminated abruptly") and its message was lost (found by a tester)."""
    import pickle

    back = pickle.loads(pickle.dumps(error))
    assert (type(back), str(back), back.args, vars(back)) == (type(error), str(error), error.args, vars(error))


def test_a_lifecycle_error_in_a_process_pool_reaches_the_caller():
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        with pytest.raises(LifecycleError) as info:
            pool.submit(_finalize_a_fresh_session).result(timeout=120)
    assert info.value.call == "finalize" and info.value.lifecycle == "created"
