"""Issue 27: a failed hook names every parameter it changed in place, and a changed model stops the session.

Each modifier's hooks (session hooks and torch hooks) are guarded by the version counters of every parameter
of the modules in the state: its declared targets read before each hook, the rest at the hook's first torch
call (:class:`llmc_fsm.core.guard.Guard`) — so a modifier without targets, a targeted modifier that writes
outside its targets, and the torch hooks of either are all named.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from llmc_fsm import LifecycleError, Modifier, ModifierError, Session
from llmc_fsm.core.lifecycle import BATCH_EVENTS


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 6, bias=False)


@attrs.define(kw_only=True, slots=False, eq=False)
class Untargeted(Modifier):
    """Declares no targets; in its event hook it scales ``lm_head`` (when ``mutate``) and raises."""

    required_state = frozenset({"model"})
    events: frozenset = attrs.field(default=frozenset({"optim_post_step"}))
    mutate: bool = True

    def on_event(self, state, event):
        if self.mutate:
            with torch.no_grad():
                state.model.lm_head.weight.mul_(2.0)
        raise RuntimeError("boom")


def _model() -> _LM:
    torch.manual_seed(0)
    return _LM()


def _step(session: Session) -> None:
    session.batch_start()
    session.loss_calculated(torch.tensor(1.0))
    session.optim_pre_step()
    session.optim_post_step()
    session.batch_end()


@pytest.mark.parametrize("event", BATCH_EVENTS)
def test_an_untargeted_modifier_that_changed_lm_head_and_failed_is_named_and_the_session_refuses_events(event):
    model = _model()
    before = model.lm_head.weight.detach().clone()
    session = Session([Untargeted(events=frozenset({event}))])
    session.initialize(model=model)
    with pytest.raises(ModifierError) as info:
        _step(session)
    err = info.value
    assert err.modified == ("lm_head.weight",)
    assert str(err) == (
        f"Untargeted.on_event() raised RuntimeError: boom (during {event}()). It had already changed 1 "
        "parameter(s) in place: lm_head.weight. Model modified by a failed hook; reload it (the change is not "
        "undone). The session refuses further events and removed every modifier's hooks."
    )
    assert torch.equal(model.lm_head.weight, before * 2.0)  # the change is what the error says
    assert session.failed == (
        "Untargeted's on_event failed after changing 1 parameter(s) in place (model modified by a failed hook; "
        "reload it): reload the model (or the last checkpoint), then session.reset() or a new Session."
    )
    with pytest.raises(LifecycleError) as refused:
        session.batch_start()
    assert str(refused.value).startswith("batch_start() refused: Untargeted's on_event failed after changing 1")
    assert torch.equal(model.lm_head.weight, before * 2.0)  # the refusal touched nothing
    session.finalize()


def test_an_untargeted_modifier_that_failed_without_changing_anything_leaves_the_session_usable():
    model = _model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    session = Session([Untargeted(mutate=False)])
    session.initialize(model=model)
    with pytest.raises(ModifierError) as info:
        _step(session)
    assert info.value.modified == ()
    assert str(info.value) == (
        "Untargeted.on_event() raised RuntimeError: boom (during optim_post_step()). No in-place change to a parameter "
        "of the model was seen. The event counts as delivered; modifiers after this one did not see it. Continue, or "
        "finalize()/reset() the session."
    )
    assert session.failed is None
    session.batch_end()
    session.batch_start()  # still accepts events
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    session.batch_end()
    session.finalize()


@attrs.define(kw_only=True, slots=False, eq=False)
class Targeted(Modifier):
    """Targets ``body``; its event hook raises after scaling ``body.weight``."""

    required_state = frozenset({"model"})
    events = frozenset({"batch_end"})
    _body: nn.Module | None = attrs.field(default=None, init=False)

    @property
    def resolved_targets(self):
        return {"body": self._body} if self._body is not None else {}

    def on_initialize(self, state):
        self._body = state.model.body

    def on_event(self, state, event):
        with torch.no_grad():
            self._body.weight.mul_(0.5)
        raise RuntimeError("boom")


def test_each_guard_reads_its_targets_eagerly_and_the_rest_of_the_model_at_the_first_torch_call():
    model = _model()
    session = Session([Targeted(), Untargeted(events=frozenset({"loss_calculated"}), mutate=False)])
    session.initialize(model=model)
    targeted, untargeted = (slot.guard for slot in session._schedule.slots)
    assert targeted.target_names == ("body.weight", "body.bias")
    assert targeted.names == ("body.weight", "body.bias", "lm_head.weight")
    assert untargeted.target_names == ()
    assert untargeted.names == ("body.weight", "body.bias", "lm_head.weight")  # the whole model
    assert not targeted.eager and not untargeted.eager  # nothing read before a hook has made a torch call
    session.batch_start()
    with pytest.raises(ModifierError):
        session.loss_calculated(torch.tensor(1.0))
    assert not untargeted.for_hook("loss_calculated").eager  # its hook made no torch call: it stays lazy
    assert torch._C._len_torch_function_stack() == 0  # the lazy mode was popped
    session.optim_pre_step()
    session.optim_post_step()
    with pytest.raises(ModifierError) as info:
        session.batch_end()
    assert info.value.modified == ("body.weight",)
    assert targeted.for_hook("batch_end").eager  # it made a torch call (mul_): every counter is read before it now
    assert not targeted.for_hook("batch_start").eager  # each hook on its own
    assert torch._C._len_torch_function_stack() == 0
    assert session.failed is not None


@attrs.define(kw_only=True, slots=False, eq=False)
class Outside(Modifier):
    """Targets ``body``; at call ``fail_at`` of its ``batch_end`` hook it writes ``lm_head`` (and ``body``), raises."""

    required_state = frozenset({"model"})
    events = frozenset({"batch_end"})
    inside: bool = True
    fail_at: int = 1
    _body: nn.Module | None = attrs.field(default=None, init=False)
    _calls: int = attrs.field(default=0, init=False)

    @property
    def resolved_targets(self):
        return {"body": self._body} if self._body is not None else {}

    def on_initialize(self, state):
        self._body = state.model.body

    def on_event(self, state, event):
        self._calls += 1
        if self._calls < self.fail_at:
            torch.mul(self._body.weight, 1.0)  # a torch call that changes nothing
            return
        with torch.no_grad():
            if self.inside:
                self._body.weight.mul_(0.5)
            state.model.lm_head.weight.view(-1)[0] = 7.0  # through a view: the same counter
        raise RuntimeError("boom")


def _clone(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fail_at", [1, 2], ids=["lazy", "eager"])
def test_a_targeted_modifier_that_changed_a_parameter_outside_its_targets_is_named_and_stops_the_session(fail_at):
    model = _model()
    before = _clone(model)
    session = Session([Outside(fail_at=fail_at)])
    session.initialize(model=model)
    if fail_at == 2:
        _step(session)
        assert session._schedule.slots[0].guard.for_hook("batch_end").eager
    with pytest.raises(ModifierError) as info:
        _step(session)
    err = info.value
    assert err.modified == ("body.weight", "lm_head.weight")
    assert str(err) == (
        "Outside.on_event() raised RuntimeError: boom (during batch_end()). It had already changed 2 parameter(s) "
        "in place: body.weight, lm_head.weight (1 outside its declared targets: lm_head.weight). Model modified "
        "by a failed hook; reload it (the change is not undone). The session refuses further events and removed "
        "every modifier's hooks."
    )
    after = model.state_dict()
    assert torch.equal(after["body.weight"], before["body.weight"] * 0.5)
    expected_head = before["lm_head.weight"].clone()
    expected_head.view(-1)[0] = 7.0
    assert torch.equal(after["lm_head.weight"], expected_head)
    assert torch.equal(after["body.bias"], before["body.bias"])  # nothing else changed
    with pytest.raises(LifecycleError) as refused:
        session.batch_start()
    assert str(refused.value).startswith("batch_start() refused: Outside's on_event failed after changing 2")
    session.finalize()


def test_a_targeted_modifier_that_changed_only_a_parameter_outside_its_targets_is_named():
    model = _model()
    session = Session([Outside(inside=False)])
    session.initialize(model=model)
    with pytest.raises(ModifierError) as info:
        _step(session)
    assert info.value.modified == ("lm_head.weight",)
    assert "in place: lm_head.weight (1 outside its declared targets: lm_head.weight). Model modified" in str(
        info.value
    )
    assert session.failed is not None


@attrs.define(kw_only=True, slots=False, eq=False)
class HookedUntargeted(Modifier):
    """Declares no targets; a forward hook on ``lm_head`` raises, after scaling ``body.weight`` when ``mutate``."""

    required_state = frozenset({"model"})
    mutate: bool = True

    def on_initialize(self, state):
        self.register_hook(state.model.lm_head, self._hook, kind="forward")

    def _hook(self, module, args, output):
        if self.mutate:
            with torch.no_grad():
                self._model.body.weight.add_(1.0)
        raise RuntimeError("hook boom")

    @property
    def _model(self):
        return self._binding.session().state.model


def _forward(model: _LM) -> torch.Tensor:
    return model.lm_head(model.body(torch.ones(1, 4)))


def test_a_torch_hook_of_an_untargeted_modifier_that_changed_a_weight_is_named_and_stops_the_session():
    model = _model()
    before = _clone(model)
    session = Session([HookedUntargeted()])
    session.initialize(model=model)
    with pytest.raises(ModifierError) as info:
        _forward(model)
    err = info.value
    assert (err.modifier, err.hook, err.module, err.modified) == (
        "HookedUntargeted",
        "forward hook",
        "lm_head",
        ("body.weight",),
    )
    assert str(err) == (
        "HookedUntargeted's forward hook on lm_head raised RuntimeError: hook boom (during a forward/backward pass "
        "of the model). It had already changed 1 parameter(s) in place: body.weight. Model modified by a failed "
        "hook; reload it (the change is not undone). The session refuses further events and removed every "
        "modifier's hooks."
    )
    assert torch._C._len_torch_function_stack() == 0
    after = model.state_dict()
    assert torch.equal(after["body.weight"], before["body.weight"] + 1.0)
    assert all(torch.equal(after[k], before[k]) for k in ("body.bias", "lm_head.weight"))  # nothing else
    assert session.modifiers[0].num_hooks == 0 and not model.lm_head._forward_hooks
    with pytest.raises(LifecycleError) as refused:
        session.batch_start()
    assert str(refused.value).startswith(
        "batch_start() refused: HookedUntargeted's forward hook failed after changing 1 parameter(s) in place"
    )
    _forward(model)  # the hook is gone: a forward pass runs
    session.finalize()


def test_a_torch_hook_of_an_untargeted_modifier_that_changed_nothing_stays_registered():
    model = _model()
    before = _clone(model)
    session = Session([HookedUntargeted(mutate=False)])
    session.initialize(model=model)
    with pytest.raises(ModifierError) as info:
        _forward(model)
    assert info.value.modified == ()
    assert str(info.value) == (
        "HookedUntargeted's forward hook on lm_head raised RuntimeError: hook boom (during a forward/backward pass "
        "of the model). No in-place change to a parameter of the model was seen; the hook stays registered."
    )
    assert session.failed is None and session.modifiers[0].num_hooks == 1
    _step(session)  # still accepts events
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    session.finalize()


@attrs.define(kw_only=True, slots=False, eq=False)
class Interrupted(Modifier):
    """Declares no targets; its ``batch_start`` hook raises a ``BaseException`` (as Ctrl-C would)."""

    required_state = frozenset({"model"})
    events = frozenset({"batch_start"})

    def on_event(self, state, event):
        raise KeyboardInterrupt


def test_a_base_exception_in_a_lazily_guarded_hook_leaves_the_torch_function_mode_stack_as_it_was():
    session = Session([Interrupted()])
    session.initialize(model=_model())
    with torch.device("cpu"):  # a torch-function mode of the caller's
        depth = torch._C._len_torch_function_stack()
        with pytest.raises(KeyboardInterrupt):
            session.batch_start()
        assert torch._C._len_torch_function_stack() == depth
    assert torch._C._len_torch_function_stack() == 0


def test_loss_calculated_none_is_refused_and_the_session_is_left_as_it_was():
    model = _model()
    session = Session([Untargeted(events=frozenset({"loss_calculated"}), mutate=False)])
    session.initialize(model=model)
    session.batch_start()
    allowed = session.allowed_calls
    with pytest.raises(ValueError) as info:
        session.loss_calculated(None)
    assert str(info.value) == (
        "loss_calculated(loss) got None: pass the batch's loss (e.g. outputs.loss of a forward pass with labels); "
        "modifiers such as distillation add to it or replace it"
    )
    assert session.allowed_calls == allowed and session.failed is None  # still right after batch_start
    with pytest.raises(ModifierError):  # the real loss reaches the modifier
        session.loss_calculated(torch.tensor(2.0))
    session.optim_pre_step()


@attrs.define(kw_only=True, slots=False, eq=False)
class LeavesAMode(Modifier):
    """Declares no targets; its ``batch_start`` hook pushes a torch-function mode of its own and leaves it there."""

    required_state = frozenset({"model"})
    events = frozenset({"batch_start"})
    mode: Any = None

    def on_event(self, state, event):
        self.mode = _Passing()
        self.mode.__enter__()


class _Passing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_the_guard_takes_only_its_own_mode_off_the_stack_when_a_hook_left_another_one_there():
    session = Session([LeavesAMode()])
    session.initialize(model=_model())
    session.batch_start()
    leaked = session.modifiers[0].mode
    assert torch._C._len_torch_function_stack() == 1
    assert torch._C._get_function_stack_at(0) is leaked  # the guard's own mode is gone, the hook's stays
    leaked.__exit__(None, None, None)
    assert torch._C._len_torch_function_stack() == 0
    session.batch_end()
    session.finalize()


@attrs.define(kw_only=True, slots=False, eq=False)
class CalibrationWriter(Modifier):
    """Declares no targets; its ``on_sequential_epoch_end`` zeroes one row of ``lm_head`` and raises."""

    required_state = frozenset({"model"})

    def on_sequential_epoch_end(self, state, modules):
        with torch.no_grad():
            state.model.lm_head.weight[0].zero_()
        raise ValueError("calibration boom")


def test_a_calibration_hook_without_targets_that_changed_a_weight_is_named():
    model = _model()
    before = _clone(model)
    session = Session([CalibrationWriter()])
    session.initialize(model=model)
    session.calibration_start()
    with pytest.raises(ModifierError) as info:
        session.sequential_epoch_end([model.body])
    assert str(info.value) == (
        "CalibrationWriter.on_sequential_epoch_end() raised ValueError: calibration boom (during "
        "sequential_epoch_end()). It had already changed 1 parameter(s) in place: lm_head.weight. Model modified by "
        "a failed hook; reload it (the change is not undone). The session refuses further events and removed every "
        "modifier's hooks."
    )
    after = model.state_dict()
    expected = before["lm_head.weight"].clone()
    expected[0] = 0.0
    assert torch.equal(after["lm_head.weight"], expected)
    assert all(torch.equal(after[k], before[k]) for k in ("body.weight", "body.bias"))
    with pytest.raises(LifecycleError):
        session.calibration_end()
    session.finalize()


@attrs.define(kw_only=True, slots=False, eq=False)
class HookedTargeted(Modifier):
    """Targets ``body``; a forward pre-hook on ``body`` scales ``lm_head`` (outside its targets) and raises."""

    required_state = frozenset({"model"})
    _body: nn.Module | None = attrs.field(default=None, init=False)
    _head: nn.Module | None = attrs.field(default=None, init=False)

    @property
    def resolved_targets(self):
        return {"body": self._body} if self._body is not None else {}

    def on_initialize(self, state):
        self._body, self._head = state.model.body, state.model.lm_head
        self.register_hook(self._body, self._hook, kind="forward_pre")

    def _hook(self, module, args):
        with torch.no_grad():
            self._head.weight.mul_(3.0)
        raise RuntimeError("pre-hook boom")


def test_a_torch_hook_of_a_targeted_modifier_that_changed_a_weight_outside_its_targets_is_named():
    model = _model()
    before = _clone(model)
    session = Session([HookedTargeted()])
    session.initialize(model=model)
    with pytest.raises(ModifierError) as info:
        _forward(model)
    assert info.value.modified == ("lm_head.weight",)
    assert str(info.value) == (
        "HookedTargeted's forward_pre hook on body raised RuntimeError: pre-hook boom (during a forward/backward "
        "pass of the model). It had already changed 1 parameter(s) in place: lm_head.weight (1 outside its "
        "declared targets: lm_head.weight). Model modified by a failed hook; reload it (the change is not "
        "undone). The session refuses further events and removed every modifier's hooks."
    )
    after = model.state_dict()
    assert torch.equal(after["lm_head.weight"], before["lm_head.weight"] * 3.0)
    assert all(torch.equal(after[k], before[k]) for k in ("body.weight", "body.bias"))
    assert session.failed is not None and not model.body._forward_pre_hooks
    session.finalize()


@attrs.define(kw_only=True, slots=False, eq=False)
class NestedHooked(HookedUntargeted):
    """Declares no targets; its ``batch_start`` hook runs a forward pass, where its own forward hook fails."""

    events = frozenset({"batch_start"})

    def on_event(self, state, event):
        _forward(state.model)


def test_a_torch_hook_failing_inside_an_event_hook_is_named_by_both_guards_and_leaves_no_mode_behind():
    model = _model()
    before = _clone(model)
    session = Session([NestedHooked()])
    session.initialize(model=model)
    with pytest.raises(ModifierError) as info:
        session.batch_start()
    outer, inner = info.value, info.value.__cause__
    assert (outer.hook, outer.modified) == ("on_event", ("body.weight",))
    assert isinstance(inner, ModifierError)
    assert (inner.hook, inner.module, inner.modified) == ("forward hook", "lm_head", ("body.weight",))
    assert torch._C._len_torch_function_stack() == 0
    assert session.failed.startswith("NestedHooked's forward hook failed after changing 1 parameter(s) in place")
    assert torch.equal(model.body.weight, before["body.weight"] + 1.0)
    assert torch.equal(model.lm_head.weight, before["lm_head.weight"])
    session.finalize()


def test_own_forwards_skips_every_registered_hook_and_only_those():
    """Inside ``own_forwards`` (a modifier's own forwards) a hook registered with ``register_hook`` does nothing, a
    hook registered on the module directly still runs, and blocks nest; after them the registered hook runs again."""
    from llmc_fsm.toolkit import own_forwards

    model, seen = _LM(), []
    modifier = Untargeted(mutate=False)
    modifier.register_hook(model.body, lambda m, a: seen.append("registered"), kind="forward_pre")
    model.body.register_forward_pre_hook(lambda m, a: seen.append("direct"))
    x = torch.ones(1, 4)
    with own_forwards():
        with own_forwards():
            model.body(x)
        model.body(x)
    assert seen == ["direct", "direct"]
    model.body(x)
    assert seen == ["direct", "direct", "registered", "direct"]


def test_own_forwards_on_one_thread_leaves_another_threads_hooks_running():
    """B4's case (session 31): one thread inside ``own_forwards`` (AutoRound tuning) made every registered hook of
    another thread's run do nothing: its calibration saw no input and it "succeeded" leaving the weights dense."""
    import threading

    from llmc_fsm.toolkit import own_forwards

    model, seen = _LM(), []
    modifier = Untargeted(mutate=False)
    modifier.register_hook(model.body, lambda m, a: seen.append(threading.current_thread().name), kind="forward_pre")
    entered, release = threading.Event(), threading.Event()

    def tuning() -> None:
        with own_forwards():
            entered.set()
            model.body(torch.ones(1, 4))  # skipped: this thread's own forwards
            release.wait(10)

    tuner = threading.Thread(target=tuning, name="tuner")
    tuner.start()
    assert entered.wait(10)
    model.body(torch.ones(1, 4))  # the main thread: not inside any block
    release.set()
    tuner.join(10)
    assert seen == [threading.current_thread().name]


def test_a_session_dropped_without_finalize_takes_its_hooks_with_it():
    """B4's case (session 31): a notebook cell run again built a new session each time and dropped the last one
    initialized: its calibration hooks stayed on the model (14, 28, 42 after three runs), feeding the dead runs'
    Hessians on every later forward."""
    import gc

    import tiny_llama

    import llmc_fsm

    model = tiny_llama.llama(hidden=64, vocab=128)
    data = torch.randint(0, 128, (2, 8))

    def hooks() -> int:
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    for _ in range(3):
        session = llmc_fsm.Session({"s": {"SparseGPTModifier": {"sparsity": 0.5}}})
        session.initialize(model=model, calibration_data=data)
        session.calibration_start()
        assert hooks() == 14  # this run's: one per target
        del session
        gc.collect()
        assert hooks() == 0
