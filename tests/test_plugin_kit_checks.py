"""The conformance kit and sessions given modifier objects check what registration checks (found by a tester)."""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import attrs
import pytest
import torch

from llmc_fsm import Modifier, RecipeError, Session
from llmc_fsm.core.errors import PluginError
from llmc_fsm.core.registry import ModifierRegistry
from llmc_fsm.testing import ContractViolation, check_modifier

EVENTS = "batch_start, loss_calculated, optim_pre_step, optim_post_step, batch_end"
MOD = __name__


def tiny_state() -> dict[str, Any]:
    return {"model": torch.nn.Linear(2, 2)}


@attrs.define(kw_only=True, slots=False, eq=False)
class Typo(Modifier):
    required_state: ClassVar[frozenset[str]] = frozenset({"model"})
    events: ClassVar[frozenset[str]] = frozenset({"batch_begin", "optim_post_step"})
    seen: list[str] = attrs.field(factory=list, init=False)

    def on_event(self, state: Any, event: Any) -> None:
        self.seen.append(event.type)


@attrs.define(kw_only=True, slots=False, eq=False)
class NoEvents(Modifier):
    required_state: ClassVar[frozenset[str]] = frozenset({"model"})

    def on_event(self, state: Any, event: Any) -> None:
        raise AssertionError("never called")


@attrs.define(kw_only=True, slots=False, eq=False)
class Switchable(Modifier):
    """``events`` is an argument: an instance made with ``events=frozenset()`` turns its handler off on purpose."""

    events: frozenset = attrs.field(default=frozenset({"batch_end"}))

    def on_event(self, state: Any, event: Any) -> None:
        raise AssertionError("not with events=frozenset()")


@attrs.define(kw_only=True, slots=False, eq=False)
class Explodes(Modifier):
    required_state: ClassVar[frozenset[str]] = frozenset({"model"})

    def on_initialize(self, state: Any) -> None:
        raise RuntimeError("boom")


@attrs.define(kw_only=True, slots=False, eq=False)
class ReadsTokenizer(Modifier):
    required_state: ClassVar[frozenset[str]] = frozenset({"model"})

    def on_initialize(self, state: Any) -> None:
        state["tokenizer"]


TYPO = f"{MOD}.Typo: events ['batch_begin'] are not batch events; on_event receives {EVENTS}"
UNREACHABLE = (
    f"{MOD}.NoEvents overrides on_event but its events are empty, so on_event is never called; list the batch "
    f"events it handles, e.g. events = frozenset({{'optim_post_step'}}) (from {EVENTS})"
)


def test_registration_refuses_a_misspelt_event():
    with pytest.raises(PluginError) as info:
        ModifierRegistry().register(Typo)
    assert str(info.value) == TYPO


def test_the_kit_refuses_a_modifier_registration_refuses():
    """The kit said Typo conformed (its batch_begin was never delivered)."""
    with pytest.raises(ContractViolation) as info:
        check_modifier(Typo, tiny_state, max_examples=2)
    assert str(info.value) == f"Typo: registration would refuse it: {TYPO}"


def test_a_session_refuses_a_modifier_object_with_a_misspelt_event():
    """Session([Typo()]) ran and delivered optim_post_step only; it is refused as registration refuses the class."""
    with pytest.raises(RecipeError) as info:
        Session([Typo()])
    assert str(info.value) == f"recipe <objects>, stage 'default': {TYPO}"


def test_a_recipe_dict_holding_a_modifier_object_with_a_misspelt_event_is_refused():
    with pytest.raises(RecipeError) as info:
        Session({"stage": [Typo()]})
    assert str(info.value) == f"recipe <dict>, stage 'stage': {TYPO}"


def test_registration_warns_when_on_event_can_never_be_called():
    """NoEvents registered with no word; its on_event was never called."""
    registry = ModifierRegistry()
    with pytest.warns(UserWarning) as record:
        registry.register(NoEvents)
    assert [str(w.message) for w in record] == [UNREACHABLE]
    assert record[0].filename == __file__  # the warning points at the register() call
    assert "NoEvents" in registry


def test_a_session_warns_when_on_event_can_never_be_called():
    with pytest.warns(UserWarning) as record:
        Session([NoEvents()])
    assert [str(w.message) for w in record] == [UNREACHABLE]
    assert record[0].filename == __file__  # the warning points at the Session(...) call


def test_the_kit_warns_once_when_on_event_can_never_be_called():
    """The kit passed NoEvents with no warning."""
    with pytest.warns(UserWarning) as record:
        check_modifier(NoEvents, tiny_state, max_examples=5)
    assert [str(w.message) for w in record] == [UNREACHABLE]


def test_events_turned_off_on_an_instance_are_not_warned_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ModifierRegistry().register(Switchable)
        session = Session([Switchable(events=frozenset())])
    session.initialize(model=torch.nn.Linear(2, 2))
    session.batch_start()
    session.batch_end()
    session.finalize()


def test_an_events_argument_with_a_misspelt_event_is_refused():
    with pytest.raises(RecipeError) as info:
        Session([Switchable(events=frozenset({"batch_begin"}))])
    assert str(info.value) == (
        f"recipe <objects>, stage 'default': {MOD}.Switchable: events ['batch_begin'] are not batch events; "
        f"on_event receives {EVENTS}"
    )


def test_the_kit_does_not_advise_declaring_keys_for_an_unrelated_error():
    """on_initialize raising RuntimeError('boom') was answered "Declare every key on_initialize needs in
    required_state"."""
    with pytest.raises(ContractViolation) as info:
        check_modifier(Explodes, lambda: {"model": torch.nn.Linear(2, 2), "extra": 1}, max_examples=2)
    assert str(info.value) == (
        "Explodes: initialize() raised RuntimeError: boom (with every key state_factory() gives: ['extra', "
        "'model']); a hook that raises in a valid lifecycle fails the check"
    )


def test_the_kit_advises_declaring_a_key_when_leaving_it_out_is_the_cause():
    with pytest.raises(ContractViolation) as info:
        check_modifier(ReadsTokenizer, lambda: {"model": torch.nn.Linear(2, 2), "tokenizer": "tok"}, max_examples=2)
    assert str(info.value) == (
        "ReadsTokenizer: initialize() with only its declared keys (required_state + optional_state: ['model']) "
        "failed: KeyError: \"state has no key 'tokenizer' (present: model); supply it with update_state(tokenizer="
        "...)\", and succeeds with the key(s) it left out of state_factory()'s, ['tokenizer']. Declare every key "
        "on_initialize needs in required_state (or make it optional and handle its absence)."
    )


@attrs.define(kw_only=True, slots=False, eq=False)
class Handles(Modifier):
    events: ClassVar[frozenset[str]] = frozenset({"batch_end"})

    def on_event(self, state: Any, event: Any) -> None:
        raise AssertionError("turned off in the subclass")


@attrs.define(kw_only=True, slots=False, eq=False)
class HandlerOff(Handles):
    """Turns the inherited handler off on purpose: it does not override on_event itself."""

    events: ClassVar[frozenset[str]] = frozenset()


class NotDecorated(Handles):
    """A subclass without its own attrs decorator, given to a session directly (a tester's working code)."""

    def on_start(self, state: Any, event: Any) -> None:
        self.started = True


def test_a_subclass_turning_an_inherited_handler_off_is_not_warned_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Session([HandlerOff()])
        ModifierRegistry().register(HandlerOff)


def test_an_undecorated_subclass_object_runs_in_a_session_while_registration_refuses_its_class():
    """Session([obj]) refused an undecorated subclass that ran before the checks were shared with registration (a
    tester's regression); registering it, a plugin author's contract, still requires the decorator."""
    modifier = NotDecorated()
    session = Session([modifier])
    session.initialize(model=torch.nn.Linear(2, 2))
    session.batch_start()
    assert modifier.started
    with pytest.raises(PluginError) as info:
        ModifierRegistry().register(NotDecorated)
    assert f"{MOD}.NotDecorated is not an attrs class" in str(info.value)


def test_events_given_as_a_tuple_are_refused_with_an_event_as_the_example():
    @attrs.define(kw_only=True, slots=False, eq=False)
    class Tupled(Modifier):
        events: ClassVar[Any] = ("batch_start", "batch_end")

        def on_event(self, state: Any, event: Any) -> None:
            raise AssertionError("refused before")

    with pytest.raises(RecipeError) as info:
        Session([Tupled()])
    assert str(info.value).endswith(
        "Tupled: events must be a set of strings (e.g. frozenset({'batch_start'})), got ('batch_start', 'batch_end')")
