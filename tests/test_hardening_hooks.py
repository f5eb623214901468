"""Issue 27: a modifier without declared targets that changes a weight and fails is named, and stops the session.

The session guards the hooks of a modifier that declares no targets with the version counters of every
parameter of the model it holds (a modifier with targets keeps watching only its targets).
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch import nn

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
        "Untargeted.on_event() raised RuntimeError: boom (during optim_post_step()). No parameter of the model was "
        "changed. The event counts as delivered; modifiers after this one did not see it. Continue, or "
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


def test_a_targeted_modifier_still_watches_only_its_targets():
    model = _model()
    session = Session([Targeted(), Untargeted(events=frozenset({"loss_calculated"}), mutate=False)])
    session.initialize(model=model)
    slots = session._schedule.slots
    assert slots[0].watched[0] == ("body.weight", "body.bias")  # per-event cost unchanged for targeted ones
    assert slots[1].watched[0] == ("body.weight", "body.bias", "lm_head.weight")  # the whole model
    session.batch_start()
    with pytest.raises(ModifierError):
        session.loss_calculated(torch.tensor(1.0))
    session.optim_pre_step()
    session.optim_post_step()
    with pytest.raises(ModifierError) as info:
        session.batch_end()
    assert info.value.modified == ("body.weight",)
    assert session.failed is not None


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
