"""llmc-fsm: compress LLMs through a session with an explicit, guarded lifecycle.

Public API, with :mod:`llmc_fsm.toolkit` (for modifier authors) and :mod:`llmc_fsm.testing` (for their tests);
everything else is private and may change.

The names below are imported on first use (:pep:`562`), not by ``import llmc_fsm``: the pytest plugin
``llmc_fsm.testing`` (entry point ``pytest11``, loaded by pytest in every project of the environment) is a module of
this package, and importing torch and the rest at every pytest start made any broken dependency of llmc-fsm break
unrelated test suites (found by a tester). ``from llmc_fsm import Session`` and ``llmc_fsm.Session`` work as before;
so does a subpackage reached as an attribute (``llmc_fsm.core``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from llmc_fsm.core.version import __version__ as __version__

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs
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
    from llmc_fsm.models.layers import find_decoder_layers
    from llmc_fsm.oneshot_job.api import oneshot
    from llmc_fsm.oneshot_job.model_free import model_free_ptq
    from llmc_fsm.pipeline.forward import first_output
    from llmc_fsm.recipes.llmcompressor import plugin_getattr
    from llmc_fsm.recipes.model import Recipe, Stage
    from llmc_fsm.session.session import Session, active_session, create_session

#: Public name -> the module that defines it (imported on first use).
_EXPORTS = {
    "CheckpointError": "llmc_fsm.core.errors",
    "EventOrderError": "llmc_fsm.core.errors",
    "LifecycleError": "llmc_fsm.core.errors",
    "MissingStateError": "llmc_fsm.core.errors",
    "ModifierError": "llmc_fsm.core.errors",
    "PluginError": "llmc_fsm.core.errors",
    "RecipeError": "llmc_fsm.core.errors",
    "hookimpl": "llmc_fsm.core.hookspecs",
    "hookspec": "llmc_fsm.core.hookspecs",
    "Event": "llmc_fsm.core.modifier",
    "Modifier": "llmc_fsm.core.modifier",
    "State": "llmc_fsm.core.state",
    "find_decoder_layers": "llmc_fsm.models.layers",
    "oneshot": "llmc_fsm.oneshot_job.api",
    "model_free_ptq": "llmc_fsm.oneshot_job.model_free",
    "first_output": "llmc_fsm.pipeline.forward",
    "plugin_getattr": "llmc_fsm.recipes.llmcompressor",
    "Recipe": "llmc_fsm.recipes.model",
    "Stage": "llmc_fsm.recipes.model",
    "Session": "llmc_fsm.session.session",
    "active_session": "llmc_fsm.session.session",
    "create_session": "llmc_fsm.session.session",
}

__all__ = [  # the keys of _EXPORTS (a literal list, for linters and type checkers)
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
    "plugin_getattr",
]


def __getattr__(name: str) -> Any:
    """A public name, imported on first use; a subpackage (``llmc_fsm.core``), imported.

    Raises:
        AttributeError: ``name`` is neither a public name nor a subpackage of llmc_fsm.
    """
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # the next access is a plain attribute
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    msg = f"module {__name__!r} has no attribute {name!r}"
    raise AttributeError(msg)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
