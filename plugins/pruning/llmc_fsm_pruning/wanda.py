"""``WandaPruningModifier``: prune by |W| times input-activation norm (arXiv 2306.11695)."""

from __future__ import annotations

import attrs
import torch
from torch import nn

from llmc_fsm_pruning._calibrated import CalibratedPruningModifier
from llmc_fsm_pruning.algorithms import InputNormAccumulator, wanda_mask

__all__ = ["WandaPruningModifier"]


@attrs.define(kw_only=True, slots=False, eq=False)
class WandaPruningModifier(CalibratedPruningModifier):
    """Prune Linear weights one-shot with Wanda: score |W_ij| * ||X_j||, lowest scores pruned per output row.

    ``||X_j||`` is the L2 norm of input channel ``j`` over every calibration
    token the target saw. No weight update: pruned weights are set to zero and
    the rest are kept as they are. Arguments: ``sparsity``, ``mask_structure``,
    ``targets``, ``ignore`` (see :class:`SparseGPTModifier`).

    Requires state ``model`` and ``calibration_data``. Memory: one
    ``in_features`` vector per distinct target input.
    """

    def _new_accumulator(self, module: nn.Module) -> InputNormAccumulator:
        return InputNormAccumulator(module.weight.shape[1])

    def _prune_weight(self, module: nn.Module, accumulator: InputNormAccumulator) -> torch.Tensor:
        keep = wanda_mask(module.weight, accumulator.sq_norm, float(self.sparsity), self.mask_structure)
        return module.weight * keep
