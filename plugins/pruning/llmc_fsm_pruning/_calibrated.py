"""The pruning arguments shared by SparseGPT and Wanda on top of :class:`llmc_fsm.toolkit.CalibratedModifier`.

Hooks, target selection, shared-input statistics and per-layer compression live
in the core base class; this adds ``sparsity``, ``mask_structure`` and the calibration of
weights seen through views (:mod:`llmc_fsm.toolkit.views`): each expert of a fused
mixture-of-experts module (its own Hessian / input norms from the tokens routed to it) and
GPT-2's ``Conv1D``.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import torch
from torch import nn

from llmc_fsm.toolkit import CalibratedModifier, LinearView, all_reduce_tensor, observe_view_inputs
from llmc_fsm_pruning.masks import mask_structure_validator, parse_mask_structure, sparsity_validator

__all__ = ["CalibratedPruningModifier"]

logger = logging.getLogger(__name__)


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        msg = f"{attribute.name} must be true or false, got {value!r}"
        raise ValueError(msg)


@attrs.define(kw_only=True, slots=False, eq=False)
class CalibratedPruningModifier(CalibratedModifier):
    """Base of pruning modifiers that need calibration inputs (not registered itself).

    Args:
        sparsity: fraction of weights set to zero in every target, in ``[0, 1)``
            (default ``0.5``). Ignored for N:M structures, whose pattern fixes it.
        mask_structure: ``"unstructured"`` (default) or ``"N:M"``: keep N weights
            of every M consecutive weights along the input dimension (``"2:4"``).
        calibrate_all_experts: mixture-of-experts layers with fused experts: ``False`` (default) gives each
            expert's matrices the tokens the router sent to that expert; ``True`` sends every calibration token
            through every expert for the statistics only (the layer's output still uses the router's choice, so
            the next layer's inputs are unchanged), so that an expert the router rarely picks is still pruned from
            enough data. Either way :attr:`routed_tokens` counts the routed tokens per expert matrix.
        targets, ignore: see :class:`~llmc_fsm.toolkit.calibrated.CalibratedModifier`. ``"Linear"`` also
            selects each expert matrix of fused experts (``<experts>.<e>.gate_proj`` / ``up_proj`` /
            ``down_proj``; DBRX ``<experts>.mlp.<e>.w1`` / ``v1`` / ``w2``) and each ``Conv1D``; the routers of
            those layers are ignored unless named exactly.

    Attributes:
        routed_tokens: ``{expert matrix name: calibration tokens the router sent to that expert}``, filled when
            the expert is compressed. An expert with none is named in a warning: without
            ``calibrate_all_experts`` it is left as it was (listed in ``skipped``).
    """

    compresses_views = True
    #: SparseGPT and Wanda change only the weights' values: under torch.distributed ranks share the sweeps.
    shares_work_across_ranks = True

    sparsity: float = attrs.field(default=0.5, validator=sparsity_validator)
    mask_structure: str = attrs.field(default="unstructured", validator=mask_structure_validator)
    calibrate_all_experts: bool = attrs.field(default=False, validator=_bool)

    def _clear(self) -> None:
        super()._clear()
        self.routed_tokens: dict[str, int] = {}

    def _check_target(self, name: str, module: nn.Module) -> str | None:
        """The base class's check; with an N:M ``mask_structure`` also that M divides the weight's ``in_features``
        (the groups of M run along the input dimension). Refused here, at :meth:`check_model`, before any
        calibration: the sweep raised it only when the module's layer was compressed, after the layer's other
        modules were pruned, without naming the module (found by a tester). llm-compressor 0.14 runs such a
        recipe and zeroes the trailing partial group whole."""
        problem = super()._check_target(name, module)
        nm = parse_mask_structure(self.mask_structure)
        if problem is not None or nm is None or module.weight.shape[1] % nm[1] == 0:
            return problem
        return (
            f"in_features {module.weight.shape[1]} is not a multiple of M={nm[1]} (mask_structure "
            f"{self.mask_structure!r} keeps {nm[0]} of every {nm[1]} consecutive weights along the input dimension)"
        )

    def on_calibration_start(self, state: Any) -> None:
        super().on_calibration_start(state)
        observe_view_inputs(
            self.register_hook,
            self._targets,
            self.results,
            all_experts=self.calibrate_all_experts,
            owner=type(self).__name__ if self.needs_inputs else None,
        )

    def on_sequential_epoch_end(self, state: Any, modules: Any) -> None:
        super().on_sequential_epoch_end(state, modules)
        self._record_routed()

    def on_calibration_end(self, state: Any) -> None:
        super().on_calibration_end(state)
        self._record_routed()

    def _record_routed(self) -> None:
        """Copy the routed-token counts of the expert matrices compressed (or skipped) since the last call, summed
        over the ranks under ``torch.distributed`` (each rank's view counts its own tokens: the report gave rank 0's
        and its warning named experts other ranks had sent tokens to, which were pruned: a tester's case)."""
        new = [
            (name, view)
            for name, view in self._targets.items()
            if isinstance(view, LinearView)
            and view.expert is not None
            and name not in self.routed_tokens
            and (name in self.results or name in self.skipped)
        ]
        if not new:  # the same on every rank (the results are the ranks' shared ones): no collective
            return
        counts = torch.tensor([view.routed_tokens for _, view in new], dtype=torch.int64)
        all_reduce_tensor(counts, what="all_reduce (routed tokens)")  # every rank: the same names, in one order
        idle = []
        for (name, _), count in zip(new, counts.tolist(), strict=True):
            self.routed_tokens[name] = count
            if count == 0:
                idle.append(name)
        if idle:
            what = (
                "compressed from every token's statistics (calibrate_all_experts)"
                if self.calibrate_all_experts
                else "left as they were; set calibrate_all_experts: true to prune them from every token's statistics"
            )
            logger.warning(
                "%s: the router sent no calibration token to %d expert matrices: %s; %s",
                type(self).__name__,
                len(idle),
                ", ".join(idle),
                what,
            )
