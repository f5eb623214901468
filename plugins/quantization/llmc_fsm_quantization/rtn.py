"""Round-to-nearest quantization: ``QuantizationModifier`` (no weight update, observers only)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import ClassVar

import attrs
import torch
from compressed_tensors.quantization import QuantizationArgs
from torch import nn

from llmc_fsm.toolkit import HessianAccumulator, compact_names
from llmc_fsm_quantization._base import QuantizedWeight, QuantizingModifier
from llmc_fsm_quantization.observers import (
    IMPORTANCE_OBSERVERS,
    imatrix_nvfp4_ranges,
    importance_from_diagonal,
    is_nvfp4,
    is_scaled_format,
    observe,
    observe_scaled_format,
    ranges_global_scale,
    storable,
)
from llmc_fsm_quantization.rounding import fake_quantize

logger = logging.getLogger(__name__)

__all__ = ["QuantizationModifier", "rtn_quantize"]


@torch.no_grad()
def rtn_quantize(
    weight: torch.Tensor,
    args: QuantizationArgs,
    observer: str = "minmax",
    *,
    importance: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    rounded: bool = True,
    ranges: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> QuantizedWeight:
    """Round every weight to the nearest point of its group's grid.

    ``scale``/``zero_point`` from ``observer`` (:func:`~llmc_fsm_quantization.observers.observe`; NVFP4, MX
    and FP8-block weights: :func:`~llmc_fsm_quantization.observers.observe_scaled_format`, with NVFP4's global scale),
    then ``q = clamp(round(w / scale) + zero_point, q_min, q_max)`` and
    ``w_hat = (q - zero_point) * scale`` (``compressed_tensors``' ``fake_quantize``).

    Args:
        weight: ``[out, in]`` float tensor (not modified).
        args: the weight ``QuantizationArgs``.
        observer: one of :data:`~llmc_fsm_quantization.observers.OBSERVERS`.
        importance: ``[in]`` per-input-column importance for ``imatrix_mse``
            (:func:`~llmc_fsm_quantization.observers.importance_from_diagonal`).
        global_scale: NVFP4 only: ``[1]`` float32 global scale to use instead of the weight's own (one shared by
            the modules a serving engine fuses: :func:`~llmc_fsm_quantization.observers.fused_global_scale`).
        rounded: ``False``: an NVFP4, MX or FP8-block weight is returned unrounded (its scales computed), for
            :func:`~llmc_fsm_quantization._base.attach_qparams` to round it once, with the checkpoint's compressor
            (the values are the same: the compressor rounds the original weight as ``fake_quantize`` does).
        ranges: NVFP4 with ``imatrix_mse``: the searched group ranges
            (:func:`~llmc_fsm_quantization.observers.imatrix_nvfp4_ranges`; computed from ``importance`` when not
            given).

    Raises:
        ValueError: as :func:`~llmc_fsm_quantization.observers.observe`.
    """
    w = weight.detach().to(torch.float32)
    if is_scaled_format(args):  # NVFP4, MX, FP8 block: compressed-tensors' own scales
        if observer in IMPORTANCE_OBSERVERS and ranges is None:
            if importance is None:
                raise ValueError("imatrix_mse weights the error by the calibration inputs' importance: it needs them")
            ranges = imatrix_nvfp4_ranges(weight, args, importance)
        scale, zp, global_scale = observe_scaled_format(
            weight, args, observer, global_scale=global_scale, ranges=ranges
        )
        if args.scale_dtype is None:
            scale = storable(scale, weight.dtype)
        q = weight.detach()
        if rounded:
            q = fake_quantize(w, scale, zp, args, global_scale=global_scale).to(weight.dtype)
        return QuantizedWeight(weight=q, scale=scale, zero_point=zp, global_scale=global_scale)
    # the scale as a parameter of weight's dtype holds it
    scale, zp = observe(weight.detach(), args, observer, importance=importance)
    return QuantizedWeight(weight=fake_quantize(w, scale, zp, args).to(weight.dtype), scale=scale, zero_point=zp)


@attrs.define(kw_only=True, slots=False, eq=False)
class QuantizationModifier(QuantizingModifier):
    """Quantize Linear weights by round-to-nearest; activations per the scheme (static: scales from calibration_data).

    With weight-only or dynamic-activation schemes it needs no calibration data (static activation scales,
    ``imatrix_mse`` and a ``kv_cache_scheme`` do: below): every target is quantized at ``calibration_end``
    (SmolLM2-135M W8A8: ~1.5 s on 2 CPU cores). One-shot runs no calibration pass
    for a stage whose modifiers are all data-free, even when a dataset is given.
    Only when it shares a pass with a modifier that needs data (the same stage,
    or ``fuse_stages=True``) do calibration inputs reach it: it then quantizes
    each decoder layer as the pass reaches it and reports the relative output
    error on those inputs. Arguments: ``scheme`` or ``config_groups``, ``observer``,
    ``targets``, ``ignore`` (see :class:`~llmc_fsm_quantization._base.QuantizingModifier`).

    Requires state ``model``; also ``calibration_data`` when a weight observer is
    ``imatrix_mse``, which weights each input column by its mean square on the
    calibration tokens, when input activations are static (``dynamic: false``,
    e.g. preset ``FP8``: one scale per tensor from the range of the calibration
    inputs), or with a ``kv_cache_scheme`` (key and value scales from the calibration
    tokens); a target that receives no calibration input is then left as it was
    and listed as skipped.
    """

    required_state = frozenset({"model"})
    optional_state = frozenset({"calibration_data"})
    conditional_state: ClassVar[Mapping[str, str]] = {
        "calibration_data": "when an observer needs the inputs' importance (imatrix_mse), input activations have "
        "static scales, or a kv_cache_scheme is given"
    }
    needs_inputs = False
    supports_kv_cache = True
    imatrix_on_nvfp4 = True
    compresses_views = True  # each expert matrix of fused experts (QuantizingModifier._check_views)
    defers_weight_update = True  # later layers calibrate on the full-precision weights, as in llm-compressor

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # imatrix_mse or static input scales: no target is quantized without its inputs' statistics
        self.needs_inputs = self.needs_importance or self.calibrated_inputs or self.kv_cache_args is not None

    def required_keys(self) -> frozenset[str]:
        """``model``; and ``calibration_data`` when a weight observer needs the inputs' importance (``imatrix_mse``),
        input activations have static (calibrated) scales, or a ``kv_cache_scheme`` is given."""
        keys = super().required_keys()
        return keys | {"calibration_data"} if self.needs_inputs else keys

    def _needs_statistics(self, name: str) -> bool:
        """Whether target ``name``'s own quantization needs its inputs: an ``imatrix_mse`` weight observer, or input
        activations with a calibrated scale (static, or NVFP4's input global scale)."""
        scheme = self.scheme_of(name)
        inputs = scheme.input_activations
        return (scheme.weights is not None and scheme.weights.observer in IMPORTANCE_OBSERVERS) or (
            inputs is not None and (not inputs.dynamic or inputs.dynamic == "local")
        )

    def _compress_all(self, modules: dict[str, nn.Module], *, trim: bool = False, reduced: bool = False) -> None:
        """:meth:`QuantizingModifier._compress_all`; a Linear the calibration forward did not reach (e.g. Jamba's
        ``mamba.dt_proj``, which its mixer reads as ``dt_proj.weight @ x`` before the model is quantized), whose scheme
        needs no input statistics (weights and dynamic inputs: the calibration runs for a KV cache or another
        group's static scales), is quantized by round-to-nearest without them, as a data-free run quantizes it (and
        llm-compressor, which rounds the weights at the end of calibration), named in a warning line per layer. A
        target whose scheme needs its inputs is left as it was (warned, in :attr:`skipped`)."""
        if self.needs_inputs:
            unreached = {
                name: module
                for name, module in modules.items()
                if not isinstance(module, nn.Embedding)
                and getattr(module, "expert", None) is None
                and getattr(self._acc.get(name), "num_samples", 0) == 0
                and not self._needs_statistics(name)
            }
            if unreached:
                logger.warning(
                    "%s: %s received no calibration input; its scheme needs none: quantized by round-to-nearest "
                    "without it",
                    type(self).__name__,
                    compact_names(list(unreached)),
                )
                for name in unreached:
                    self._acc.pop(name, None)
                self._compress_members(None, list(unreached.items()))
                modules = {name: module for name, module in modules.items() if name not in unreached}
        super()._compress_all(modules, trim=trim, reduced=reduced)

    def _quantize(
        self, modules: list[nn.Module], accumulator: HessianAccumulator | None, args: QuantizationArgs
    ) -> list[QuantizedWeight]:
        importance = None
        if args.observer in IMPORTANCE_OBSERVERS and accumulator is not None:
            importance = importance_from_diagonal(accumulator.diagonal)
        if importance is not None and is_nvfp4(args):  # the searched ranges give the (shared) global scales
            ranges = [imatrix_nvfp4_ranges(m.weight, args, importance) for m in modules]
            scales = self._ranges_global_scales(modules, ranges)
            return [
                rtn_quantize(m.weight, args, args.observer, global_scale=g, rounded=False, ranges=r)
                for m, g, r in zip(modules, scales, ranges, strict=True)
            ]
        return [
            rtn_quantize(m.weight, args, args.observer, importance=importance, global_scale=g, rounded=False)
            for m, g in zip(modules, self.global_scales(modules), strict=True)
        ]

    def _ranges_global_scales(
        self, modules: list[nn.Module], ranges: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """NVFP4 ``imatrix_mse``: each module's global scale from the searched ranges
        (:func:`~llmc_fsm_quantization.observers.ranges_global_scale`), one shared by the modules vLLM fuses (as
        llm-compressor 0.14 takes it from the fused observers' statistics). Fused modules share their inputs, so
        they arrive in one call; a fused sibling outside it is not searched again (its share is then from this
        call's members only)."""
        names = [self._names_by_id.get(id(m), "") for m in modules]
        by_name = dict(zip(names, ranges, strict=True))
        out = []
        for name, r in zip(names, ranges, strict=True):
            members = [by_name[n] for n in self._fused.get(name, (name,)) if n in by_name]
            out.append(ranges_global_scale(members or [r]))
        return out
