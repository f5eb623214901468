"""llmc-fsm pruning plugin: SparseGPT, Wanda, magnitude and constant pruning modifiers.

Installed as its own distribution (``llmc-fsm-pruning``) and discovered by
llmc-fsm through the ``llmc_fsm`` entry-point group, exactly like a
third-party plugin. Recipe names: ``SparseGPTModifier``,
``WandaPruningModifier``, ``MagnitudePruningModifier``,
``ConstantPruningModifier``, ``REAPPruningModifier`` (drops whole experts). The algorithms are plain tensor functions:
:func:`sparsegpt_prune`, :func:`wanda_mask`, :func:`magnitude_mask`.
"""

from __future__ import annotations

import llmc_fsm
from llmc_fsm_pruning.constant import ConstantPruningModifier
from llmc_fsm_pruning.magnitude import MagnitudePruningModifier
from llmc_fsm_pruning.masks import magnitude_mask, num_to_prune, parse_mask_structure
from llmc_fsm_pruning.reap import REAPPruningModifier
from llmc_fsm_pruning.sparsegpt import SparseGPTModifier, sparsegpt_prune, sparsegpt_prune_shared
from llmc_fsm_pruning.wanda import InputNormAccumulator, WandaPruningModifier, wanda_mask

__all__ = [
    "ConstantPruningModifier",
    "InputNormAccumulator",
    "MagnitudePruningModifier",
    "REAPPruningModifier",
    "SparseGPTModifier",
    "WandaPruningModifier",
    "llmc_fsm_register_modifiers",
    "magnitude_mask",
    "num_to_prune",
    "parse_mask_structure",
    "sparsegpt_prune",
    "sparsegpt_prune_shared",
    "wanda_mask",
]


@llmc_fsm.hookimpl
def llmc_fsm_register_modifiers() -> list[type[llmc_fsm.Modifier]]:
    """Register the pruning modifiers."""
    return [
        SparseGPTModifier,
        WandaPruningModifier,
        MagnitudePruningModifier,
        ConstantPruningModifier,
        REAPPruningModifier,
    ]


__getattr__ = llmc_fsm.plugin_getattr(__name__)
