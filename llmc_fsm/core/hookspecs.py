"""Hook specifications for llmc-fsm plugins, grouped by phase.

A plugin is a module (or any object) exposed through the ``llmc_fsm``
entry-point group. It implements some of the hooks below, each marked with
:data:`hookimpl`::

    from llmc_fsm import hookimpl

    @hookimpl
    def llmc_fsm_register_modifiers():
        return [MyPruningModifier]

pluggy checks every hook implementation against its specification when the
plugin is registered: an implementation that asks for an argument the
specification does not offer, or that implements a hook that does not exist,
is reported as a :class:`llmc_fsm.PluginError` naming the distribution and the
entry point, and the other plugins still load.
"""

from __future__ import annotations

import pluggy

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec"]

#: The pluggy project name; also the entry-point group plugins are found in.
PROJECT_NAME = "llmc_fsm"

#: Marker for hook specifications (project name ``llmc_fsm``).
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marker for hook implementations in plugins.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --- registration phase -------------------------------------------------------
# Called once per plugin, when the modifier registry loads the plugin (the first
# time a recipe names a modifier, or ``llmc-fsm modifiers`` runs).


@hookspec
def llmc_fsm_register_modifiers() -> list[type]:
    """Return the :class:`llmc_fsm.Modifier` subclasses this plugin provides.

    Return a list (or tuple) of classes, not instances. Each class is registered
    under its ``modifier_name()`` (the class name by default). A name already
    taken by another plugin is reported as a plugin error naming both
    distributions; that class is not registered, the plugin's other classes are.
    """
