"""Exceptions raised by llmc-fsm.

Every error says what went wrong *and* what to do next. Lifecycle errors carry
the session's lifecycle state, the call that was refused and the calls that are
allowed now, so integrations can branch on them without parsing messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = [
    "EventOrderError",
    "LifecycleError",
    "MissingStateError",
    "PluginError",
    "RecipeError",
]


class LifecycleError(RuntimeError):
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
    """

    def __init__(
        self,
        msg: str,
        *,
        lifecycle: str,
        missing: Mapping[str, frozenset[str]],
        allowed: Iterable[str] = (),
    ) -> None:
        super().__init__(msg, lifecycle=lifecycle, call="initialize", allowed=allowed)
        self.missing = dict(missing)


class RecipeError(ValueError):
    """A recipe that cannot be parsed or validated.

    The message names the source (file), stage, modifier, argument and, where
    the YAML loader gives it, the line.
    """


class PluginError(RuntimeError):
    """A modifier plugin that could not be loaded or registered.

    Attributes:
        distribution: the distribution (package) that ships the plugin, or ``None``.
        entry_point: the entry point name, or ``None``.
    """

    def __init__(self, msg: str, *, distribution: str | None = None, entry_point: str | None = None) -> None:
        super().__init__(msg)
        self.distribution = distribution
        self.entry_point = entry_point
