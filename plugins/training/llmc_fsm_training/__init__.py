"""llmc-fsm training plugin: output distillation and learning-rate schedules.

Registers :class:`OutputDistillationModifier` and :class:`LearningRateModifier`
through the ``llmc_fsm`` entry-point group, like any third-party plugin.
"""

from __future__ import annotations

import llmc_fsm
from llmc_fsm_training.distillation import OutputDistillationModifier, distillation_kl
from llmc_fsm_training.learning_rate import LearningRateModifier, scheduled_lr

__all__ = [
    "LearningRateModifier",
    "OutputDistillationModifier",
    "distillation_kl",
    "llmc_fsm_register_modifiers",
    "scheduled_lr",
]

__version__ = "0.1.0"


@llmc_fsm.hookimpl
def llmc_fsm_register_modifiers() -> list[type]:
    """Register the training modifiers."""
    return [OutputDistillationModifier, LearningRateModifier]


__getattr__ = llmc_fsm.plugin_getattr(__name__)
