"""``ClippedRTNModifier``: round-to-nearest with a per-channel clipping search, as a calibrated modifier.

Everything llmc-fsm-specific comes from the public API: :class:`llmc_fsm.toolkit.CalibratedModifier` (targets,
calibration hooks, compression per decoder layer, results, resume, ``low_memory``, ``torchrun``) and
:class:`llmc_fsm.toolkit.HessianAccumulator` (the statistic). The algorithm is :mod:`llmc_fsm_clip_rtn.clipping`.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn

from llmc_fsm.toolkit import CalibratedModifier, HessianAccumulator
from llmc_fsm_clip_rtn.clipping import clip_ratios, search_clip_ratios

__all__ = ["ClippedRTNModifier"]


def _int_in(low: int, high: int) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{attribute.name} must be an int from {low} to {high}, got {value!r}")

    return check


def _ratio(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"{attribute.name} must be a number in (0, 1], got {value!r}")


@attrs.define(kw_only=True, slots=False, eq=False)
class ClippedRTNModifier(CalibratedModifier):
    """Round-to-nearest on a symmetric per-channel int grid, each channel's range clipped to minimise output error.

    Linear weights are rounded to a symmetric per-output-channel integer grid (no GPTQ update). For each output
    channel the clipping ratio is chosen among ``steps`` ratios from 1.0 down to ``min_ratio`` by
    ``(w - w_hat) H (w - w_hat)^T`` with ``H`` the Hessian of the calibration inputs
    (:func:`llmc_fsm_clip_rtn.clipping.search_clip_ratios`); ratio 1.0 (plain RTN) is a candidate, so no channel's
    output error is worse than plain RTN's. The weights keep their dtype and hold the dequantized values
    (``scale * integer``, at most ``2^bits`` distinct values per channel); nothing is written in a compressed format.

    Args:
        bits: integer bits, 2 to 8 (default 4).
        steps: candidate ratios, >= 1 (default 11: 1.0, 0.95, ..., 0.5); 1 is plain RTN.
        min_ratio: the smallest ratio tried, in ``(0, 1]`` (default 0.5).
        targets, ignore: module patterns (see :class:`llmc_fsm.toolkit.CalibratedModifier`).

    Requires state ``model`` and ``calibration_data``. Recipe::

        quant_stage:
          ClippedRTNModifier: {bits: 4, steps: 11, min_ratio: 0.5, ignore: [lm_head]}

    Raises (at construction): ``ValueError`` for an argument out of range.
    """

    bits: int = attrs.field(default=4, validator=_int_in(2, 8))
    steps: int = attrs.field(default=11, validator=_int_in(1, 1000))
    min_ratio: float = attrs.field(default=0.5, validator=_ratio)

    #: Rounding to zero is not pruning: the report counts only the zeros that were there before.
    zeros_are_sparsity = False

    def _new_accumulator(self, module: nn.Module) -> HessianAccumulator:
        return HessianAccumulator(module.weight.shape[1])

    def _compress_group(self, modules: list[nn.Module], accumulator: HessianAccumulator) -> list[torch.Tensor]:
        # modules saw the same inputs (q/k/v, gate/up): one Hessian for all of them
        hessian = accumulator.hessian
        ratios = clip_ratios(self.steps, float(self.min_ratio))
        return [
            search_clip_ratios(m.weight, hessian, bits=self.bits, ratios=ratios).weight.to(m.weight.dtype)
            for m in modules
        ]

    def _result_extras(self, module: nn.Module) -> dict[str, Any]:
        return {"bits": self.bits, "group_size": None}
