"""llmc-fsm pruning plugin: SparseGPT, Wanda, magnitude and constant pruning modifiers.

Installed as its own distribution (``llmc-fsm-pruning``) and discovered by
llmc-fsm through the ``llmc_fsm`` entry-point group, exactly like a
third-party plugin. Recipe names: ``SparseGPTModifier``,
``WandaPruningModifier``, ``MagnitudePruningModifier``,
``ConstantPruningModifier``.
"""

from __future__ import annotations

import llmc_fsm
from llmc_fsm_pruning.constant import ConstantPruningModifier
from llmc_fsm_pruning.magnitude import MagnitudePruningModifier
from llmc_fsm_pruning.sparsegpt import SparseGPTModifier
from llmc_fsm_pruning.wanda import WandaPruningModifier

__all__ = [
    "ConstantPruningModifier",
    "MagnitudePruningModifier",
    "SparseGPTModifier",
    "WandaPruningModifier",
    "llmc_fsm_register_modifiers",
]


@llmc_fsm.hookimpl
def llmc_fsm_register_modifiers() -> list[type[llmc_fsm.Modifier]]:
    """Register the pruning modifiers."""
    return [SparseGPTModifier, WandaPruningModifier, MagnitudePruningModifier, ConstantPruningModifier]
