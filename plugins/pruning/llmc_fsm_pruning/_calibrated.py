"""The pruning arguments shared by SparseGPT and Wanda on top of :class:`llmc_fsm.toolkit.calibrated.CalibratedModifier`.

Hooks, target selection, shared-input statistics and per-layer compression live
in the core base class; this adds ``sparsity`` and ``mask_structure``.
"""

from __future__ import annotations

import attrs

from llmc_fsm.toolkit import CalibratedModifier
from llmc_fsm_pruning.masks import mask_structure_validator, sparsity_validator

__all__ = ["CalibratedPruningModifier"]


@attrs.define(kw_only=True, slots=False, eq=False)
class CalibratedPruningModifier(CalibratedModifier):
    """Base of pruning modifiers that need calibration inputs (not registered itself).

    Args:
        sparsity: fraction of weights set to zero in every target, in ``[0, 1)``
            (default ``0.5``). Ignored for N:M structures, whose pattern fixes it.
        mask_structure: ``"unstructured"`` (default) or ``"N:M"``: keep N weights
            of every M consecutive weights along the input dimension (``"2:4"``).
        targets, ignore: see :class:`~llmc_fsm.toolkit.calibrated.CalibratedModifier`.
    """

    #: SparseGPT and Wanda change only the weights' values: under torch.distributed ranks share the sweeps.
    shares_work_across_ranks = True

    sparsity: float = attrs.field(default=0.5, validator=sparsity_validator)
    mask_structure: str = attrs.field(default="unstructured", validator=mask_structure_validator)
