"""llmc-fsm: compress LLMs through a session with an explicit, guarded lifecycle.

Public API, with :mod:`llmc_fsm.toolkit` (for modifier authors) and :mod:`llmc_fsm.testing` (for their tests);
everything else is private and may change.
"""

from llmc_fsm.core.errors import (
    CheckpointError,
    EventOrderError,
    LifecycleError,
    MissingStateError,
    ModifierError,
    PluginError,
    RecipeError,
)
from llmc_fsm.core.hookspecs import hookimpl, hookspec
from llmc_fsm.core.modifier import Event, Modifier
from llmc_fsm.core.state import State
from llmc_fsm.core.version import __version__ as __version__
from llmc_fsm.models.layers import find_decoder_layers
from llmc_fsm.oneshot_job.api import oneshot
from llmc_fsm.oneshot_job.model_free import model_free_ptq
from llmc_fsm.pipeline.forward import first_output
from llmc_fsm.recipes.model import Recipe, Stage
from llmc_fsm.session.session import Session, active_session, create_session

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
    "find_decoder_layers",
    "first_output",
    "hookimpl",
    "hookspec",
    "model_free_ptq",
    "oneshot",
]
