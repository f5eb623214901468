"""``SparseGPTModifier``: one-shot pruning with OBS weight reconstruction (arXiv 2301.00774)."""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn

from llmc_fsm_pruning._calibrated import CalibratedPruningModifier
from llmc_fsm_pruning.algorithms import HessianAccumulator, sparsegpt_prune_shared

__all__ = ["SparseGPTModifier"]


def _positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        msg = f"{attribute.name} must be a positive int, got {value!r}"
        raise ValueError(msg)


def _positive_number(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < float(value) < float("inf"):
        msg = f"{attribute.name} must be a finite number > 0, got {value!r}"
        raise ValueError(msg)


@attrs.define(kw_only=True, slots=False, eq=False)
class SparseGPTModifier(CalibratedPruningModifier):
    """Prune Linear weights one-shot with SparseGPT: Hessian from calibration inputs, block-wise OBS updates.

    For each target, ``H = 2/n * sum x x^T`` is accumulated from its calibration
    inputs; the damped inverse Hessian drives a left-to-right sweep over the
    columns in blocks of ``block_size``, choosing the mask adaptively per block
    and compensating every pruned weight on the columns not yet processed.

    Args (besides ``sparsity``, ``mask_structure``, ``targets``, ``ignore``):
        block_size: columns per block of the sweep (default 128, as in the paper);
            must be a multiple of M for N:M structures.
        dampening_frac: ``dampening_frac * mean(diag H)`` is added to the diagonal
            of ``H`` before inversion (default 0.01, as in the paper); > 0.

    Requires state ``model`` and ``calibration_data``. Memory: one
    ``in_features x in_features`` float32 Hessian per distinct target input,
    only for the decoder layer being calibrated under the sequential pipeline.
    """

    block_size: int = attrs.field(default=128, validator=_positive_int)
    dampening_frac: float = attrs.field(default=0.01, validator=_positive_number)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        from llmc_fsm_pruning.algorithms import parse_mask_structure

        nm = parse_mask_structure(self.mask_structure)
        if nm is not None and self.block_size % nm[1] != 0:
            msg = (
                f"block_size ({self.block_size}) must be a multiple of M={nm[1]} "
                f"for mask_structure {self.mask_structure!r}"
            )
            raise ValueError(msg)

    def _new_accumulator(self, module: nn.Module) -> HessianAccumulator:
        return HessianAccumulator(module.weight.shape[1])

    def _prune_weight(self, module: nn.Module, accumulator: HessianAccumulator) -> torch.Tensor:
        return self._prune_weights([module], accumulator)[0]

    def _prune_weights(self, modules: list[nn.Module], accumulator: HessianAccumulator) -> list[torch.Tensor]:
        # Targets that saw the same inputs (q/k/v, gate/up) share one Hessian factorisation and one sweep.
        results = sparsegpt_prune_shared(
            [module.weight for module in modules],
            accumulator.hessian,
            sparsity=float(self.sparsity),
            mask_structure=self.mask_structure,
            block_size=self.block_size,
            dampening_frac=float(self.dampening_frac),
        )
        return [pruned for pruned, _keep in results]
