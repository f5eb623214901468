"""Wanda: prune by |W| times input-activation norm (Sun et al., arXiv 2306.11695, Section 3).

:func:`wanda_mask` is the algorithm, :class:`InputNormAccumulator` its calibration
statistic and :class:`WandaPruningModifier` the recipe modifier.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from llmc_fsm.toolkit import all_reduce_tensor, is_distributed
from llmc_fsm_pruning._calibrated import CalibratedPruningModifier
from llmc_fsm_pruning.masks import (
    MaskStructure,
    check_mask_args,
    check_nm_divisible,
    nm_keep,
    num_to_prune,
    prune_lowest_per_row,
)

__all__ = ["InputNormAccumulator", "WandaPruningModifier", "wanda_mask"]


class InputNormAccumulator:
    """Running per-input-channel squared L2 norm ``||X_j||_2^2`` for Wanda.

    ``X`` is the ``[n_tokens, in_features]`` matrix of all inputs seen
    (arXiv:2306.11695, Section 3). The sum is kept in float64 (cheap, O(C))
    and returned as float32. Only the relative values across ``j`` matter for
    Wanda's per-row ranking, so using a sum rather than a mean is immaterial.

    Args:
        in_features: ``C``, the size of the input's last dimension.

    Raises:
        ValueError: ``in_features`` is not a positive int.
    """

    def __init__(self, in_features: int) -> None:
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        self.in_features = in_features
        self._num_samples = 0
        self._sq_norm: torch.Tensor | None = None

    @torch.no_grad()
    def add_batch(self, x: torch.Tensor) -> None:
        """Add inputs ``x`` of shape ``[..., in_features]`` (any float dtype).

        Raises:
            ValueError: if the last dimension is not ``in_features``.
        """
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"expected input with last dimension {self.in_features}, got shape {tuple(x.shape)}")
        x = x.detach().reshape(-1, self.in_features)
        if x.shape[0] == 0:
            return
        contribution = x.to(torch.float32).square().sum(dim=0, dtype=torch.float64)
        if self._sq_norm is None:
            self._sq_norm = contribution
        else:
            self._sq_norm += contribution.to(self._sq_norm.device)
        self._num_samples += x.shape[0]

    @property
    def sq_norm(self) -> torch.Tensor:
        """``||X_j||_2^2``, float32 ``[in_features]`` (zeros before any batch)."""
        if self._sq_norm is None:
            return torch.zeros(self.in_features, dtype=torch.float32)
        return self._sq_norm.to(torch.float32)

    @property
    def num_samples(self) -> int:
        """Number of tokens accumulated so far."""
        return self._num_samples

    def reset(self) -> None:
        """Forget all samples."""
        self._num_samples = 0
        self._sq_norm = None

    @torch.no_grad()
    def all_reduce(self) -> None:
        """Sum the norms and token counts of every rank of the ``torch.distributed`` process group, in place.

        One float64 collective; a rank without samples contributes zeros. Every
        rank must call it; without a process group of more than one rank it does nothing.

        Raises:
            DistributedError: the collective failed (another rank stopped or timed out).
        """
        if not is_distributed():
            return
        flat = torch.zeros(self.in_features + 1, dtype=torch.float64)
        if self._sq_norm is not None:
            flat = flat.to(self._sq_norm.device)
            flat[:-1].copy_(self._sq_norm)
        flat[-1] = self._num_samples
        all_reduce_tensor(flat, what="all_reduce (input norms)")
        self._sq_norm = flat[:-1].clone()
        self._num_samples = round(float(flat[-1]))


@torch.no_grad()
def wanda_mask(
    weight: torch.Tensor,
    input_sq_norm: torch.Tensor,
    sparsity: float,
    mask_structure: MaskStructure = None,
) -> torch.Tensor:
    """Wanda keep-mask (arXiv:2306.11695, Section 3).

    Score ``S_ij = |W_ij| * ||X_j||_2`` where ``||X_j||_2^2`` is the squared L2
    norm of input channel ``j`` over all calibration tokens
    (:attr:`InputNormAccumulator.sq_norm` or
    :attr:`llmc_fsm.toolkit.obs.HessianAccumulator.input_sq_norm`; any positive rescaling of it gives
    the same mask). Scores are compared per output row, as in the paper.

    Args:
        weight: ``[out_features, in_features]`` floating tensor.
        input_sq_norm: ``[in_features]`` non-negative squared norms (any float
            dtype; moved to ``weight``'s device).
        sparsity: fraction of zeros in ``[0, 1)``; ignored (only range-checked)
            for N:M.
        mask_structure: ``None``/``"unstructured"``: every row prunes exactly
            ``num_to_prune(in_features, sparsity)`` lowest-score weights.
            ``"N:M"``: every group of ``M`` consecutive weights of a row keeps
            its ``N`` highest scores.

    Returns:
        ``torch.bool`` tensor shaped like ``weight``, True = keep.

    Raises:
        ValueError: bad arguments, ``input_sq_norm`` of the wrong shape or with
            negative / non-finite entries, or ``in_features % M != 0``.
    """
    s, nm = check_mask_args(weight, sparsity, mask_structure)
    in_features = weight.shape[1]
    if input_sq_norm.shape != (in_features,):
        raise ValueError(f"input_sq_norm must have shape ({in_features},), got {tuple(input_sq_norm.shape)}")
    norms = input_sq_norm.detach().to(device=weight.device, dtype=torch.float32)
    if not bool(torch.isfinite(norms).all()) or bool((norms < 0).any()):
        raise ValueError("input_sq_norm must be finite and non-negative")
    score = weight.detach().abs().to(torch.float32) * norms.sqrt().unsqueeze(0)
    if nm is not None:
        check_nm_divisible(in_features, nm)
        return nm_keep(score, nm)
    return prune_lowest_per_row(score, num_to_prune(in_features, s))


@attrs.define(kw_only=True, slots=False, eq=False)
class WandaPruningModifier(CalibratedPruningModifier):
    """Prune Linear weights one-shot with Wanda: score |W_ij| * ||X_j||, lowest scores pruned per output row.

    ``||X_j||`` is the L2 norm of input channel ``j`` over every calibration
    token the target saw. No weight update: pruned weights are set to zero and
    the rest are kept as they are. Arguments: ``sparsity``, ``mask_structure``,
    ``targets``, ``ignore`` (see :class:`~llmc_fsm_pruning.SparseGPTModifier`).

    Requires state ``model`` and ``calibration_data``. Memory: one
    ``in_features`` vector per distinct target input.
    """

    def _new_accumulator(self, module: nn.Module) -> InputNormAccumulator:
        return InputNormAccumulator(module.weight.shape[1])

    def _compress_group(self, modules: list[nn.Module], accumulator: InputNormAccumulator) -> list[torch.Tensor]:
        return [
            module.weight * wanda_mask(module.weight, accumulator.sq_norm, float(self.sparsity), self.mask_structure)
            for module in modules
        ]
