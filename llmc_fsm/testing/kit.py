"""Conformance kit for modifier authors: :func:`check_modifier`.

One line checks that a modifier obeys the lifecycle contract::

    from llmc_fsm.testing import check_modifier

    def test_my_modifier_obeys_the_contract():
        check_modifier(lambda: MyModifier(sparsity=0.5), lambda: {"model": tiny_model()})

or, with the fixture of the pytest plugin :mod:`llmc_fsm.testing.plugin` (installed with llmc-fsm as the
``pytest11`` entry point ``llmc_fsm``; the number of examples follows ``--llmc-fsm-examples``)::

    def test_my_modifier(llmc_fsm_check):
        llmc_fsm_check(MyModifier, lambda: {"model": tiny_model()})

What is checked:

0. **What registration checks** (:func:`~llmc_fsm.core.registry.check_modifier_class`
   on a modifier from ``factory``): an attrs class, a usable ``modifier_name()``, and
   the declarations (``events`` among the batch events, sets of strings...); an
   ``on_event`` that ``events`` leaves unreachable is warned about (``UserWarning``).
1. **Required state is declared truthfully** (deterministic): ``state_factory()``
   supplies every key in ``required_keys()``; ``initialize`` without any one of
   them raises :class:`~llmc_fsm.MissingStateError` naming it; ``initialize`` with
   *only* the declared keys (``required_state`` + ``optional_state``, then only
   the required ones) succeeds — the modifier needs nothing it did not declare
   (when it fails with every key too, the message says that on_initialize raises,
   not that a key is undeclared).
2. **Random lifecycles** (hypothesis draws valid and invalid call sequences of
   ``update_state``, ``initialize``, batch events, calibration events,
   ``finalize`` and ``reset`` against a :class:`~llmc_fsm.Session` holding a fresh
   modifier):

   - ``on_initialize`` runs exactly once per successful ``initialize`` and never
     for a refused one; ``on_finalize`` at most once per initialization;
   - a refused call (``LifecycleError``) runs no hook at all;
   - hooks run only inside the session calls that own them (``on_event`` only
     for the events in ``events``, calibration hooks only in their calibration
     call, ``on_start``/``on_update`` only at events, ``on_end`` at events or finalize, not at reset);
   - after ``finalize``/``reset`` (and a refused ``initialize``),
     ``modifier.num_hooks == 0`` and, when the state holds a ``torch.nn.Module``
     as ``model``, the model carries exactly the torch hooks it had before.

3. **Checkpoints** (deterministic): after one training batch, the session's
   ``state_dict()`` (with the modifier's :meth:`~llmc_fsm.Modifier.state_dict`)
   can be written with :func:`~llmc_fsm.session.checkpoint.write_checkpoint`, read back,
   and loaded into a new session holding a fresh modifier and fresh state.

A modifier hook that raises during a valid lifecycle fails the check too.
"""

from __future__ import annotations

import re
import tempfile
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from llmc_fsm.core.errors import MissingStateError, ModifierError, PluginError
from llmc_fsm.core.lifecycle import BATCH_EVENTS
from llmc_fsm.core.modifier import Modifier
from llmc_fsm.core.registry import check_modifier_class, unreachable_on_event
from llmc_fsm.session.checkpoint import read_checkpoint, write_checkpoint
from llmc_fsm.session.session import Session
from llmc_fsm.testing.lifecycles import OPERATIONS, ContractViolation, SequenceRun

__all__ = ["ContractViolation", "check_modifier"]

#: Random lifecycles per :func:`check_modifier` call when not given (``--llmc-fsm-examples`` gives it for the
#: ``llmc_fsm_check`` fixture).
DEFAULT_EXAMPLES = 100


def _check_checkpoint(
    factory: Callable[[], Modifier],
    state_factory: Callable[[], Mapping[str, Any]],
    batch_factory: Callable[[], Any] | None,
    loss_factory: Callable[[], Any] | None,
) -> None:

    session, resumed = Session([factory()]), Session([factory()])
    session.initialize(**state_factory())
    session.batch_start(batch_factory() if batch_factory else None)
    session.loss_calculated(loss_factory() if loss_factory else 0.0)
    for event in BATCH_EVENTS[BATCH_EVENTS.index("loss_calculated") + 1 :]:  # the rest of the batch, in order
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
            raise _initialize_failed(factory, dict(state_factory()), keys, what, exc.__cause__) from exc.__cause__
        session.finalize()


def _initialize_failed(
    factory: Callable[[], Modifier], state: dict[str, Any], keys: frozenset[str], what: str, cause: BaseException | None
) -> ContractViolation:
    """The violation for an ``initialize()`` with only the declared ``keys`` that raised ``cause``: advice to declare
    keys only when the state's other keys make it succeed (a ``RuntimeError: boom`` was answered with "Declare every
    key on_initialize needs in required_state", found by a tester)."""
    error = type(cause).__name__
    modifier = type(factory()).__name__
    left_out = sorted(set(state) - keys)
    if left_out:
        session = Session([factory()])
        try:
            session.initialize(**state)
        except ModifierError:
            left_out = []  # it fails with every key too: the keys left out are not the cause
        else:
            session.finalize()
    if not left_out:
        return ContractViolation(
            f"{modifier}: initialize() raised {error}: {cause} (with every key state_factory() gives: "
            f"{sorted(state)}); a hook that raises in a valid lifecycle fails the check"
        )
    return ContractViolation(
        f"{modifier}: initialize() with only its declared keys ({what}: {sorted(keys)}) failed: {error}: {cause}, "
        f"and succeeds with the key(s) it left out of state_factory()'s, {left_out}. Declare every key "
        "on_initialize needs in required_state (or make it optional and handle its absence)."
    )


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
        ContractViolation: a rule was broken (registration would refuse the modifier, too); the message names the
            rule and the call sequence (hypothesis shrinks it to a minimal one).
        ValueError: ``max_examples`` is not a positive integer or ``max_calls`` a negative one (hypothesis refused
            them with ``InvalidArgument`` after the deterministic checks had run).
    """
    for name, value, least in (("max_examples", max_examples, 1), ("max_calls", max_calls, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            kind = "a positive integer" if least else "an integer >= 0"
            msg = f"check_modifier: {name} must be {kind}, got {value!r}"
            raise ValueError(msg)
    probe = factory()
    try:  # the checks registration makes (a misspelt event was never delivered, and the kit passed it)
        check_modifier_class(probe)
    except PluginError as exc:
        msg = f"{type(probe).__name__}: registration would refuse it: {exc}"
        raise ContractViolation(msg) from exc
    unreachable = unreachable_on_event(probe)
    with warnings.catch_warnings():
        if unreachable is not None:  # warned once just now; not again for each session the checks below make
            warnings.filterwarnings("ignore", message=re.escape(unreachable), category=UserWarning)
        _check_contract(factory, state_factory, max_examples, max_calls, batch_factory, loss_factory, modules_factory)


def _check_contract(
    factory: Callable[[], Modifier],
    state_factory: Callable[[], Mapping[str, Any]],
    max_examples: int,
    max_calls: int,
    batch_factory: Callable[[], Any] | None,
    loss_factory: Callable[[], Any] | None,
    modules_factory: Callable[[Mapping[str, Any]], Any] | None,
) -> None:
    """Checks 1-3 of the module docstring (:func:`check_modifier` after its registration checks)."""
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
        SequenceRun(init_args, factory, state_factory, batch_factory, loss_factory, modules_factory).run(steps)

    random_lifecycles()
    _check_checkpoint(factory, state_factory, batch_factory, loss_factory)
