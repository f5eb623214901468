"""A copy of the model (``copy.deepcopy``) made while a session runs holds the modifiers' torch hooks: they run on
the copy while the session runs and do nothing after it (found by a tester)."""

from __future__ import annotations

import copy
import io
import pickle

import attrs
import pytest
import torch

from llmc_fsm import Modifier, Session

RUNNING = (
    "the model holds a torch hook of DoublingModifier, a modifier of a session that has not been finalized, and a "
    "hook cannot be pickled: save model.state_dict() (or save_pretrained), or pickle the model after "
    "session.finalize() (or reset()) removed its hooks"
)


@attrs.define(kw_only=True, slots=False, eq=False)
class DoublingModifier(Modifier):
    """Doubles the model's output through a forward hook; records each output sum it saw."""

    required_state = frozenset({"model"})
    seen: list[float] = attrs.field(factory=list, init=False)

    def on_initialize(self, state):
        self.register_hook(state.model, self._double, kind="forward")

    def _double(self, module, args, output):
        self.seen.append(float(output.sum()))
        return output * 2


def _linear() -> torch.nn.Linear:
    layer = torch.nn.Linear(2, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0]]))
        layer.bias.fill_(0.5)
    return layer.requires_grad_(False)


X = torch.tensor([[1.0, 1.0]])  # the layer gives 3.5


def test_a_copy_made_during_a_run_runs_the_running_modifiers_hook_and_refuses_pickling():
    """While the session runs the copy computes what the original does (the hook is shared, as its function was)."""
    model = _linear()
    modifier = DoublingModifier()
    session = Session([modifier])
    session.initialize(model=model)
    copied = copy.deepcopy(model)
    assert copied(X).item() == 7.0 and model(X).item() == 7.0
    assert modifier.seen == [3.5, 3.5]
    with pytest.raises(TypeError) as info:
        pickle.dumps(copied)
    assert str(info.value) == RUNNING
    session.finalize()


@pytest.mark.parametrize("end", ["finalize", "reset"])
def test_a_copy_made_during_a_run_does_nothing_and_pickles_after_the_session_ends(end):
    """After finalize the copy kept running the modifier's hook (3.5 doubled to 7.0, recorded), and pickling the copy
    raised the TypeError above saying the session had not been finalized, with no way out."""
    model = _linear()
    modifier = DoublingModifier()
    session = Session([modifier])
    session.initialize(model=model)
    copied = copy.deepcopy(model)
    getattr(session, end)()
    assert len(copied._forward_hooks) == 1  # still held by the copy, but removed from the model it was put on
    assert copied(X).item() == 3.5 and model(X).item() == 3.5
    assert modifier.seen == []
    assert len(pickle.dumps(copied)) > 0
    buffer = io.BytesIO()
    torch.save(copied, buffer)
    assert buffer.tell() > 0
