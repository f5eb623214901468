"""What GPTQ and round-to-nearest share: scheme arguments, checks before calibration, qparams on the module.

After a target is quantized it carries, as ``compressed-tensors`` defines them,
``quantization_scheme``, ``quantization_status`` (frozen), the parameters
``weight_scale`` / ``weight_zero_point`` (and ``weight_g_idx`` for group
activation order), and a forward that fake-quantizes dynamic input activations
(W8A8, FP8_DYNAMIC). Its ``weight`` holds the dequantized values, so the
in-memory model computes what the saved checkpoint computes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from compressed_tensors.quantization import (
    ActivationOrdering,
    QuantizationArgs,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
)
from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization
from torch import nn

from llmc_fsm.toolkit.calibrated import CalibratedModifier, CompressedGroup
from llmc_fsm_quantization.observers import OBSERVERS
from llmc_fsm_quantization.schemes import resolve_scheme, weight_args

__all__ = ["QuantizedWeight", "QuantizingModifier", "attach_qparams"]


@attrs.define(kw_only=True)
class QuantizedWeight:
    """A quantized weight: dequantized values and the parameters that reproduce them.

    Attributes:
        weight: ``[out, in]`` dequantized weight (the input weight's dtype).
        scale: ``[1]`` (tensor), ``[out, 1]`` (channel) or ``[out, in // group_size]`` (group), float.
        zero_point: same shape as ``scale``, the scheme's ``zp_dtype`` (zeros when symmetric).
        g_idx: ``[in]`` int32 group of each input column (GPTQ ``actorder="group"``), else ``None``.
        rel_output_error: ``||W X - W_hat X|| / ||W X||`` on the calibration inputs when the algorithm
            computed it (GPTQ), else ``None``.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    g_idx: torch.Tensor | None = None
    rel_output_error: float | None = None


@torch.no_grad()
def attach_qparams(module: nn.Module, scheme: QuantizationScheme, quantized: QuantizedWeight) -> None:
    """Make ``module`` a frozen compressed-tensors quantized module holding ``quantized``'s parameters.

    Raises:
        ValueError: a parameter's shape differs from what compressed-tensors allocates for ``scheme``.
    """
    initialize_module_for_quantization(module, scheme, force_zero_point=True)
    for name, value in (
        ("weight_scale", quantized.scale),
        ("weight_zero_point", quantized.zero_point),
        ("weight_g_idx", quantized.g_idx),
    ):
        if value is None:
            continue
        param = getattr(module, name)
        if param.shape != value.shape:
            msg = f"{name}: compressed-tensors expects shape {tuple(param.shape)}, got {tuple(value.shape)}"
            raise ValueError(msg)
        param.data.copy_(value.to(param.dtype))
    module.weight.data.copy_(quantized.weight)
    module.quantization_status = QuantizationStatus.FROZEN


def _observer(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in OBSERVERS:
        msg = f"unknown observer {value!r}; choose one of {', '.join(OBSERVERS)}"
        raise ValueError(msg)


def _canonical_scheme(scheme: Any) -> Any:
    """A ``QuantizationArgs`` scheme as the mapping ``{"weights": args}`` it means, so that the saved recipe.yaml
    writes ``scheme: {weights: {...}}``, which reads back (the bare arguments' fields would read as a preset
    mapping with unknown keys); a preset name in its canonical case (``w4a16`` -> ``W4A16``, as compressed-tensors
    reads it); anything else unchanged."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    if isinstance(scheme, str) and scheme.upper() in PRESET_SCHEMES:
        return scheme.upper()
    if (
        isinstance(scheme, Mapping)
        and isinstance(scheme.get("preset"), str)
        and scheme["preset"].upper() in PRESET_SCHEMES
    ):
        return {**scheme, "preset": scheme["preset"].upper()}
    return {"weights": scheme} if isinstance(scheme, QuantizationArgs) else scheme


@attrs.define(kw_only=True, slots=False, eq=False)
class QuantizingModifier(CalibratedModifier):
    """Base of the quantization modifiers (not registered itself).

    Args:
        scheme: a ``compressed-tensors`` preset name (``W4A16``, ``W8A16``,
            ``W8A8``, ``FP8_DYNAMIC``, ...) or a mapping of scheme fields (see
            :mod:`llmc_fsm_quantization.schemes`), or a compressed-tensors
            ``QuantizationScheme`` / ``QuantizationArgs`` (the latter kept as
            ``{"weights": args}``). Bits, symmetry, strategy and group size come
            from it. Default ``W4A16``.
        observer: how a weight's range is chosen: ``minmax`` (default) or ``mse``.
        targets, ignore: see :class:`~llmc_fsm.toolkit.calibrated.CalibratedModifier`
            (defaults ``[Linear]`` and ``[lm_head]``).

    Raises (at construction): ``ValueError`` for an unknown preset (listing the
    presets), invalid scheme fields, or an unsupported scheme.
    """

    scheme: Any = attrs.field(default="W4A16", converter=_canonical_scheme)
    observer: str = attrs.field(default="minmax", validator=_observer)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._scheme = resolve_scheme(self.scheme, self.targets)
        actorder = getattr(self, "actorder", None)
        w = self._scheme.weights
        if actorder is not None and w is not None and w.strategy == QuantizationStrategy.GROUP:
            w.actorder = ActivationOrdering(actorder)

    @property
    def quantization_scheme(self) -> QuantizationScheme:
        """The resolved ``compressed_tensors`` scheme (a copy)."""
        return self._scheme.model_copy(deep=True)

    @property
    def weight_args(self) -> QuantizationArgs:
        """The scheme's weight ``QuantizationArgs``."""
        return weight_args(self._scheme)

    def compressed_call_inputs(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``(args, kwargs)`` of a call that began before ``module`` was quantized, with its input quantized as
        compressed-tensors' quantized forward does (``None``: not this modifier's module, or no input quantization).

        In the pipeline's grouped order a group's head is compressed while its call is under way, and that call
        goes on with the forward it began with (:func:`llmc_fsm.pipeline.true_sequential.run_grouped`); without this, its
        output for the next group / layer missed the input quantization (W8A8, FP8_DYNAMIC), and a resumed run,
        which propagates through fully quantized layers, differed from an uninterrupted one.
        """
        scheme = getattr(module, "quantization_scheme", None)
        if id(module) not in self._names_by_id or scheme is None or scheme.input_activations is None or not args:
            return None
        from compressed_tensors.quantization.lifecycle.forward import forward_quantize

        return (forward_quantize(module, args[0], "input", scheme.input_activations), *args[1:]), kwargs

    # ---- checks before any calibration work ------------------------------------------
    quantized_model_hint = "quantize the original full-precision model instead"
    zeros_are_sparsity = False  # int4 rounds small weights to exact zeros: not pruning

    def _fix_hint(self, targets: dict[str, nn.Module], problems: dict[str, list[str]]) -> str:
        """Suggest the largest power-of-two group size that divides every target's input width."""
        args = self.weight_args
        if args.strategy != QuantizationStrategy.GROUP or not all("group_size" in r for r in problems):
            return super()._fix_hint(targets, problems)
        width = math.gcd(*(int(m.weight.shape[1]) for m in targets.values()))
        group = min(width & -width, int(args.group_size))
        name = self.scheme if isinstance(self.scheme, str) else dict(self.scheme).get("preset")
        if name:
            scheme = f"{{preset: {name}, weights: {{group_size: {group}}}}}"
        else:  # every field: a mapping's weights without num_bits would mean 8 bits
            sym = str(bool(args.symmetric)).lower()
            scheme = (
                f"{{weights: {{num_bits: {args.num_bits}, type: {getattr(args.type, 'value', args.type)}, symmetric: "
                f"{sym}, strategy: group, group_size: {group}}}}}; in an llm-compressor recipe, group_size: {group} in "
                "config_groups' weights"
            )
        fix = (
            f"Use a group size that divides every target's input width, e.g. {group} (CLI: --group-size {group}; "
            f"recipe: scheme: {scheme}), or add these modules to ignore."
            if group >= 16
            else "Add these modules to ignore or use a channel-wise scheme (e.g. W8A16)."
        )
        return fix

    def check_model(self, model: nn.Module) -> dict[str, nn.Module]:
        """:meth:`CalibratedModifier.check_model`, and a refusal of mixture-of-experts models whose experts are
        fused 3-D weights (transformers 5's ``MixtralExperts``, ``Qwen2MoeExperts``, ...).

        Raises:
            ValueError: as the base class; or such experts: they are not ``Linear`` modules, so they would stay
                unquantized, and transformers does not reload the compressed-tensors checkpoint of such a model
                (it fuses the experts on load and finds none; measured with transformers 5.24 on Mixtral).
        """
        targets = super().check_model(model)
        experts = [
            (name, type(module).__name__, pname, tuple(p.shape))
            for name, module in model.named_modules()
            if "expert" in type(module).__name__.lower()
            for pname, p in module.named_parameters(recurse=False)
            if p.dim() >= 3
        ]
        if experts:
            name, cls, pname, shape = experts[0]
            modules = len({e[0] for e in experts})
            msg = (
                f"{type(self).__name__}: the model's mixture-of-experts weights are fused 3-D tensors in {modules} "
                f"modules (e.g. {name} ({cls}): {pname} {list(shape)}), which llmc-fsm does not quantize (it "
                "quantizes Linear layers), and transformers does not reload a compressed-tensors checkpoint of "
                "such a model: mixture-of-experts models are not supported for quantization"
            )
            raise ValueError(msg)
        return targets

    def _check_target(self, name: str, module: nn.Module) -> str | None:
        problem = super()._check_target(name, module)
        if problem is not None:
            return problem
        args = self.weight_args
        if args.strategy == QuantizationStrategy.GROUP and module.weight.shape[1] % args.group_size:
            return f"in_features {module.weight.shape[1]} is not a multiple of group_size {args.group_size}"
        return None

    # ---- work -----------------------------------------------------------------------
    def _quantize(self, modules: list[nn.Module], accumulator: Any) -> list[QuantizedWeight]:
        raise NotImplementedError

    def _compress_group(self, modules: list[nn.Module], accumulator: Any) -> list[torch.Tensor] | CompressedGroup:
        quantized = self._quantize(modules, accumulator)
        for module, q in zip(modules, quantized, strict=True):
            attach_qparams(module, self.quantization_scheme, q)
        weights = [module.weight for module in modules]  # attach_qparams wrote q.weight there: no second copy
        if self.measures_output_error:
            return CompressedGroup(weights, [q.rel_output_error for q in quantized])
        return weights

    def _result_extras(self, module: nn.Module) -> dict[str, Any]:
        args = self.weight_args
        return {
            "bits": int(args.num_bits),
            "group_size": int(args.group_size) if args.strategy == QuantizationStrategy.GROUP else None,
        }
