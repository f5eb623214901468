"""Hook specifications for llmc-fsm plugins, grouped by phase.

A plugin is a module (or object) exposed through the ``llmc_fsm`` entry-point
group that implements some of these hooks with :data:`hookimpl`.
"""

from __future__ import annotations

import pluggy

__all__ = ["hookimpl", "hookspec"]

#: Marker for hook specifications (project name ``llmc_fsm``).
hookspec = pluggy.HookspecMarker("llmc_fsm")
#: Marker for hook implementations in plugins.
hookimpl = pluggy.HookimplMarker("llmc_fsm")


# --- registration phase -------------------------------------------------------


@hookspec
def llmc_fsm_register_modifiers() -> list[type]:
    """Return the :class:`llmc_fsm.Modifier` subclasses this plugin provides.

    Each class is registered under its ``modifier_name()`` (the class name);
    a name already taken by another plugin is reported as a plugin error and
    the later class is not registered.
    """
