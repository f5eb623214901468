"""Exceptions raised by llmc-fsm.

Every error says what went wrong *and* what to do next. Lifecycle errors carry
the session's lifecycle state, the call that was refused and the calls that are
allowed now, so integrations can branch on them without parsing messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "CheckpointError",
    "EventOrderError",
    "LifecycleError",
    "MissingStateError",
    "ModifierError",
    "PluginError",
    "RecipeError",
]


def _restore(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """An exception of ``cls`` with ``args`` and the attributes ``state``, made without calling ``cls.__init__``."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class _Picklable:
    """Pickles an exception whose ``__init__`` takes keyword-only arguments: pickle's default calls ``cls(*args)``,
    which raised ``TypeError: missing 2 required keyword-only arguments`` on unpickling, so a worker of a process
    pool that raised one broke the pool ("terminated abruptly") and its message was lost (found by a tester)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _restore, (type(self), self.args, dict(self.__dict__))  # type: ignore[attr-defined]


class LifecycleError(_Picklable, RuntimeError):
    """A session call that is not allowed in the session's current lifecycle state.

    Attributes:
        lifecycle: the lifecycle state when the call was refused (``"created"``,
            ``"staging"``, ``"initialized"``, ``"running"`` or ``"finalized"``).
        call: the refused call, e.g. ``"update_state"``.
        allowed: the calls that are allowed in ``lifecycle``, sorted.
    """

    def __init__(self, msg: str, *, lifecycle: str, call: str, allowed: Iterable[str] = ()) -> None:
        super().__init__(msg)
        self.lifecycle = lifecycle
        self.call = call
        self.allowed = tuple(sorted(allowed))


class EventOrderError(LifecycleError):
    """An event fired out of order inside a batch, e.g. ``batch_end`` before ``batch_start``."""


class MissingStateError(LifecycleError):
    """``initialize`` found modifiers whose required state keys were never supplied.

    Attributes:
        missing: modifier name -> the keys it requires that are missing. All
            modifiers are checked before the error is raised, so one error names
            everything that is missing.
        reasons: modifier name -> {key: why it is required} for the keys a modifier requires only for some of its
            arguments (its ``conditional_state``; :meth:`~llmc_fsm.Modifier.required_because`).
    """

    def __init__(
        self,
        msg: str,
        *,
        lifecycle: str,
        missing: Mapping[str, frozenset[str]],
        allowed: Iterable[str] = (),
        reasons: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        super().__init__(msg, lifecycle=lifecycle, call="initialize", allowed=allowed)
        self.missing = dict(missing)
        self.reasons = {label: dict(why) for label, why in (reasons or {}).items()}


class RecipeError(ValueError):
    """A recipe that cannot be parsed or validated.

    The message names the source (file), stage, modifier, argument and, where
    the YAML loader gives it, the line.
    """


class PluginError(_Picklable, RuntimeError):
    """A modifier plugin that could not be loaded or registered.

    Attributes:
        distribution: the distribution (package) that ships the plugin, or ``None``.
        entry_point: the entry point name, or ``None``.
    """

    def __init__(self, msg: str, *, distribution: str | None = None, entry_point: str | None = None) -> None:
        super().__init__(msg)
        self.distribution = distribution
        self.entry_point = entry_point


class ModifierError(_Picklable, RuntimeError):
    """A modifier hook raised; the original exception is chained as ``__cause__``.

    Raised for every hook kind: ``on_initialize``, the schedule and event hooks,
    ``on_finalize``, and torch hooks registered with
    :meth:`~llmc_fsm.Modifier.register_hook` (e.g. a calibration forward
    pre-hook inside the one-shot pipeline).

    The message is :attr:`what` followed by :attr:`advice`; a caller that holds
    the session differently (the one-shot API, a Trainer) replaces the advice
    with :meth:`set_advice` without parsing the text.

    Attributes:
        modifier: the modifier's label (class name, ``#k`` appended when a class
            appears more than once in the recipe).
        hook: the hook that raised, e.g. ``"on_initialize"``, ``"on_event"`` or,
            for a torch hook, ``"forward_pre hook"``.
        module: for a torch hook, the full name of the hooked module (its class
            name when the name cannot be found); otherwise ``None``.
        modified: names of the parameters the failed call changed in place before
            raising (found with the tensors' in-place version counters; see
            ``docs/lifecycle.md``), sorted; empty when none changed. When not
            empty the model is partly modified and the session refuses further
            events until it is reset.
        what: what happened: the hook, what it raised, where, and the
            parameters it changed.
        advice: what the session did and what to do now (``""``: none given).
    """

    def __init__(
        self,
        msg: str,
        *,
        modifier: str,
        hook: str,
        module: str | None = None,
        modified: Iterable[str] = (),
        advice: str = "",
    ) -> None:
        super().__init__(msg)
        self.modifier = modifier
        self.hook = hook
        self.module = module
        self.modified = tuple(sorted(modified))
        self.what = msg
        self.advice = ""
        self.set_advice(advice)

    def set_advice(self, advice: str) -> None:
        """Replace :attr:`advice` (``""``: none) and the message with it, in place (the traceback is kept)."""
        self.advice = advice
        self.args = (f"{self.what} {advice}" if advice else self.what,)


class CheckpointError(_Picklable, ValueError):
    """A session checkpoint that cannot be loaded into this session.

    Raised before anything is changed: the checkpoint was written for another
    recipe (a modifier added or removed, a class or an argument changed, a
    different ``steps_per_epoch``), is not a session checkpoint, or its files
    are missing or damaged.

    Attributes:
        differences: one line per difference between the checkpoint and the
            session (empty for unreadable files).
    """

    def __init__(self, msg: str, *, differences: Iterable[str] = ()) -> None:
        super().__init__(msg)
        self.differences = tuple(differences)
