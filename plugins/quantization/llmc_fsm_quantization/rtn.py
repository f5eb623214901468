"""Round-to-nearest quantization: ``QuantizationModifier`` (no weight update, observers only)."""

from __future__ import annotations

import attrs
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from torch import nn

from llmc_fsm.toolkit import HessianAccumulator
from llmc_fsm_quantization._base import QuantizedWeight, QuantizingModifier
from llmc_fsm_quantization.observers import observe

__all__ = ["QuantizationModifier", "rtn_quantize"]


@torch.no_grad()
def rtn_quantize(weight: torch.Tensor, args: QuantizationArgs, observer: str = "minmax") -> QuantizedWeight:
    """Round every weight to the nearest point of its group's grid.

    ``scale``/``zero_point`` from ``observer`` (:func:`~llmc_fsm_quantization.observers.observe`),
    then ``q = clamp(round(w / scale) + zero_point, q_min, q_max)`` and
    ``w_hat = (q - zero_point) * scale`` (``compressed_tensors``' ``fake_quantize``).

    Args:
        weight: ``[out, in]`` float tensor (not modified).
        args: the weight ``QuantizationArgs``.
        observer: ``"minmax"`` or ``"mse"``.

    Raises:
        ValueError: as :func:`~llmc_fsm_quantization.observers.observe`.
    """
    w = weight.detach().to(torch.float32)
    scale, zp = observe(weight.detach(), args, observer)  # the scale as a parameter of weight's dtype holds it
    return QuantizedWeight(weight=fake_quantize(w, scale, zp, args).to(weight.dtype), scale=scale, zero_point=zp)


@attrs.define(kw_only=True, slots=False, eq=False)
class QuantizationModifier(QuantizingModifier):
    """Quantize Linear weights by round-to-nearest with an observer; activations per the scheme (dynamic).

    Needs no calibration data: every target is quantized at ``calibration_end``
    (SmolLM2-135M W8A8: ~1.5 s on 2 CPU cores). One-shot runs no calibration pass
    for a stage whose modifiers are all data-free, even when a dataset is given.
    Only when it shares a pass with a modifier that needs data (the same stage,
    or ``fuse_stages=True``) do calibration inputs reach it: it then quantizes
    each decoder layer as the pass reaches it and reports the relative output
    error on those inputs. Arguments: ``scheme``, ``observer``, ``targets``,
    ``ignore`` (see :class:`~llmc_fsm_quantization.GPTQModifier`).

    Requires state ``model``.
    """

    required_state = frozenset({"model"})
    optional_state = frozenset({"calibration_data"})
    needs_inputs = False

    def _new_accumulator(self, module: nn.Module) -> HessianAccumulator:
        return HessianAccumulator(module.weight.shape[1])

    def _quantize(self, modules: list[nn.Module], accumulator: object) -> list[QuantizedWeight]:
        return [rtn_quantize(m.weight, self.weight_args, self.observer) for m in modules]
