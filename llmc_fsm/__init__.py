"""llmc-fsm: compress LLMs through a session with an explicit, guarded lifecycle.

Public API; everything else is private and may change.
"""

from llmc_fsm.errors import (
    CheckpointError,
    EventOrderError,
    LifecycleError,
    MissingStateError,
    ModifierError,
    PluginError,
    RecipeError,
)
from llmc_fsm.hookspecs import hookimpl, hookspec
from llmc_fsm.modifier import Event, Modifier
from llmc_fsm.oneshot import oneshot
from llmc_fsm.recipe import Recipe, Stage
from llmc_fsm.session import Session, active_session, create_session
from llmc_fsm.state import State

__all__ = [
    "CheckpointError",
    "Event",
    "EventOrderError",
    "LifecycleError",
    "MissingStateError",
    "Modifier",
    "ModifierError",
    "PluginError",
    "Recipe",
    "RecipeError",
    "Session",
    "Stage",
    "State",
    "active_session",
    "create_session",
    "hookimpl",
    "hookspec",
    "oneshot",
]


__version__ = "0.1.0"
