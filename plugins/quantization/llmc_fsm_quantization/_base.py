"""What GPTQ and round-to-nearest share: scheme arguments, checks before calibration, qparams on the module.

After a target is quantized it carries, as ``compressed-tensors`` defines them,
``quantization_scheme``, ``quantization_status`` (frozen), the parameters
``weight_scale`` / ``weight_zero_point`` (and ``weight_g_idx`` for group
activation order), and a forward that fake-quantizes dynamic input activations
(W8A8, FP8_DYNAMIC). Its ``weight`` holds the dequantized values, so the
in-memory model computes what the saved checkpoint computes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
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
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as _library_fake_quantize
from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization
from compressed_tensors.utils.match import is_narrow_match
from torch import nn

from llmc_fsm import find_decoder_layers
from llmc_fsm.toolkit import (
    DEFAULT_IGNORE,
    DEFAULT_TARGETS,
    CalibratedModifier,
    CompressedGroup,
    HessianAccumulator,
    LinearView,
    all_reduce_tensor,
    compact_names,
    expert_checkpoint_names,
    expert_reload_problem,
    experts_for_vllm,
    is_distributed,
    is_linear_like,
    keep_packed,
    linear_expert_names,
    match_precedence,
    model_family,
    observe_view_inputs,
    patterns,
    private_pages,
    quantize_expert_inputs,
    release_file_pages,
    reloads_as_linears,
    scheme_label,
    select_targets,
    tied_head,
    untie_head,
    weight_views,
    weights_shared_across_layers,
)
from llmc_fsm_quantization import kv_cache
from llmc_fsm_quantization.observers import (
    FUSED_SIBLINGS,
    IMPORTANCE_OBSERVERS,
    INPUT_MSE_OBSERVERS,
    NVFP4_OBSERVERS,
    check_observer,
    check_scaled_observer,
    fused_global_scale,
    input_range_mse,
    is_local,
    is_nvfp4,
    is_scaled_format,
)
from llmc_fsm_quantization.rounding import FP4_PACKED_FORMATS, fp4_positive_zeros
from llmc_fsm_quantization.schemes import (
    LOCAL_INPUT_OBSERVERS,
    STATIC_INPUT_OBSERVERS,
    is_attention_scheme,
    resolve_config_groups,
    resolve_scheme,
    weight_args,
)

__all__ = ["DEFAULT_SCHEME", "CalibrationStatistics", "QuantizedWeight", "QuantizingModifier", "attach_qparams"]


#: How compressed-tensors orders the targets of config groups that match one module (in messages).
_ORDER = "compressed-tensors' order (an exact name, then re: patterns in string order, then class names)"


def _named_directly(name: str, module: nn.Module, patterns: list[str]) -> list[str]:
    """:func:`~llmc_fsm.toolkit.match_precedence` for a selected module; a peft LoRA layer's ``base_layer`` answers
    to the name of the layer around it (``...q_proj``), as before the adapters and after merging them."""
    return match_precedence(name.removesuffix(".base_layer"), module, patterns)


logger = logging.getLogger(__name__)

#: The scheme of a modifier given neither ``scheme`` nor ``config_groups``.
DEFAULT_SCHEME = "W4A16"
#: The input-activation observer of a static scheme that names none (llm-compressor's default for activations).
ACTIVATION_OBSERVER = "minmax"
#: The weight observer of a scheme that names none (compressed-tensors leaves it ``None``; llm-compressor then
#: observes weights by their minimum and maximum).
DEFAULT_OBSERVER = "minmax"


def _block_scales_broadcast(scheme: QuantizationScheme, shapes: Sequence[Sequence[int]]) -> bool:
    """Whether ``scheme`` is FP8 block weights whose ``weight_scale`` broadcasts against every expert matrix of
    ``shapes`` (``[out, in]`` each): one block (or one per value) along each dimension, e.g. a 128x128 expert with
    128x128 blocks. transformers' experts loader multiplies each expert's fp8 weight by its scale by broadcasting,
    so it reloads those (measured by a tester: a tiny MoE's 128x128 experts reload), and no others."""
    w = scheme.weights
    if w is None or w.strategy != QuantizationStrategy.BLOCK or not w.block_structure or not shapes:
        return False
    block = [int(b) for b in w.block_structure]
    return all(math.ceil(d / b) in (1, d) for shape in shapes for d, b in zip(shape, block, strict=True))


def _as_per_tensor(scheme: QuantizationScheme) -> QuantizationScheme:
    """``scheme`` with its block weights per tensor: what a matrix of one block is quantized as."""
    weights = scheme.weights.model_copy(update={"strategy": QuantizationStrategy.TENSOR, "block_structure": None})
    return scheme.model_copy(update={"weights": weights})


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
        input_scale / input_zero_point: ``[1]`` static (calibrated) per-tensor input-activation scale and zero
            point (``input_activations`` with ``dynamic: false``), else ``None``.
        global_scale: ``[1]`` float32 NVFP4 global scale (``weight_global_scale``), else ``None``.
        input_global_scale: ``[1]`` float32 NVFP4 input global scale (``input_global_scale``: ``448 * 6 / max|x|``
            over the calibration inputs, under which the per-group input scales are computed at run time;
            ``input_activations`` with ``dynamic: local``), else ``None``.
        dampening_frac: the relative damping the Hessian was factorised with (GPTQ: the configured one, or larger
            after retries when the damped Hessian was not positive definite), else ``None``.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    g_idx: torch.Tensor | None = None
    rel_output_error: float | None = None
    input_scale: torch.Tensor | None = None
    input_zero_point: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    input_global_scale: torch.Tensor | None = None
    dampening_frac: float | None = None


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
        ("weight_global_scale", quantized.global_scale),
        ("input_scale", quantized.input_scale),
        ("input_zero_point", quantized.input_zero_point),
        ("input_global_scale", quantized.input_global_scale),
    ):
        if value is None:
            continue
        param = getattr(module, name)
        if param.shape != value.shape:
            msg = f"{name}: compressed-tensors expects shape {tuple(param.shape)}, got {tuple(value.shape)}"
            raise ValueError(msg)
        param.data.copy_(value.to(param.dtype))
        torch.autograd.graph.increment_version(param)  # a write through .data: the session's guard reads versions
    _take_weight(module.weight, quantized.weight)
    module.quantization_status = QuantizationStatus.FROZEN
    if is_scaled_format(scheme.weights):
        _as_reloaded(module, scheme)
        quantized.weight = module.weight.data


def mark_quantized(model: nn.Module) -> None:
    """Set ``config._is_quantized`` on ``model`` and each of its sub-models, as transformers does for a model it
    loads quantized (``HfQuantizer.preprocess_model``; not saved with the config), so that the in-memory model takes
    the forward path the reloaded one takes. Jamba's and FalconMamba's mixers call ``dt_proj`` as a module only
    when it is set (``dt_proj.weight @ x`` otherwise, which skips its input quantization): measured, Jamba FP8_DYNAMIC
    reloaded with logits 0.0079 apart from the in-memory model before, equal after."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_json_string"):  # a transformers config
            config._is_quantized = True


def _take_weight(weight: nn.Parameter, new: torch.Tensor) -> None:
    """Make ``weight`` hold ``new``'s values: by taking ``new``'s storage when ``new`` is a whole, contiguous tensor
    of the same shape, dtype and device and the old storage is not private memory yet (no copy, and no write into
    a memory-mapped checkpoint's pages, each of which would be copied on write; the replaced pages are then unmapped,
    :func:`llmc_fsm.toolkit.release_file_pages`), else by copying into it (a weight
    an earlier modifier wrote in place, e.g. rotated or smoothed: replacing it would keep both copies resident,
    :func:`llmc_fsm.toolkit.private_pages`)."""
    whole = new.is_contiguous() and new.untyped_storage().nbytes() == new.numel() * new.element_size()
    same = new.shape == weight.shape and new.dtype == weight.dtype and new.device == weight.device
    if whole and same and not private_pages(weight):
        old, weight.data = weight.data, new
        release_file_pages(old)  # the checkpoint's pages of the replaced weight: unmapped, not kept resident
    else:
        weight.data.copy_(new)
    # Neither write moves the parameter's version counter, which the session's guard reads to tell whether a failed
    # hook changed the model (it said "No parameter of the model was changed" after a GPTQ layer failed midway).
    torch.autograd.graph.increment_version(weight)


def _as_reloaded(module: nn.Module, scheme: QuantizationScheme) -> None:
    """NVFP4 / MX / FP8-block: ``module.weight`` becomes what its checkpoint decompresses to.

    compressed-tensors' compressor packs the weight (``compress``: the one rounding of a round-to-nearest weight,
    which may come unrounded, see :func:`~llmc_fsm_quantization.rtn.rtn_quantize`) and transformers dequantizes it
    on load with the same compressor's ``decompress``, in that format's own arithmetic (NVFP4 and MX: bfloat16, so
    ``q * scale / global_scale`` is rounded there); the module is given exactly those values, so the in-memory
    model computes what the reloaded one does, and marked ``decompressed`` (its forward no longer re-quantizes
    the weight, as for a reloaded module). The packed tensors are kept on the module for the save
    (:func:`llmc_fsm.toolkit.keep_packed`), which then does not round the weight again.
    """
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.utils.module import get_direct_state_dict

    fmt = scheme.format or infer_module_format(type(module), scheme)
    fmt = getattr(fmt, "value", fmt)
    state = {k: v.detach() for k, v in get_direct_state_dict(module).items() if v is not None}
    packed, weight = _packed_and_reloaded(state, scheme, fmt)
    _take_weight(module.weight, weight.to(module.weight.dtype))
    module.quantization_status = QuantizationStatus.DECOMPRESSED
    keep_packed(module, fmt, packed)


def _packed_and_reloaded(
    state: dict[str, torch.Tensor], scheme: QuantizationScheme, fmt: str
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """What compressed-tensors' compressor of format ``fmt`` packs ``state`` (``weight`` and its scales) to, and
    the weight it decompresses that to. ``state`` is not changed: the weight as it is (compress does not write into
    it), its small tensors copied (packed may hold them)."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(fmt)
    packed = compressor.compress({k: v if k == "weight" else v.clone() for k, v in state.items()}, scheme)
    if fmt in FP4_PACKED_FORMATS:  # zeros as the twice-rounded weight had them
        packed["weight_packed"] = fp4_positive_zeros(packed["weight_packed"])
    return packed, compressor.decompress(packed, scheme)["weight"]


class CalibrationStatistics(HessianAccumulator):
    """:class:`~llmc_fsm.toolkit.obs.HessianAccumulator` of a target's inputs, plus their range for static input scales.

    One observation is one calibration sample (a row of the batch ``[batch, seq, in_features]``; a 2-D input is one
    observation: an expert matrix is given one sample's routed tokens at a time, see
    :meth:`QuantizingModifier._observe_views`), taken in order, so the ranges do not depend on how the samples are
    batched: llm-compressor 0.14 observes each forward call, and its ``oneshot`` calls the model once per
    sample (``batch_size`` 1, its default). Each observation gives the minimum and maximum over its input values
    (per tensor), kept three ways, one per activation observer of llm-compressor 0.14:

    * ``static_minmax``: the smallest minimum and largest maximum of all observations;
    * ``minmax``: a moving average, the first observation's values then ``v <- (1 - c) v + c v_obs`` with
      ``c = 0.01`` (llm-compressor's ``averaging_constant``);
    * ``memoryless_minmax``: the last observation's values.

    Given ``mse_args`` (the input ``QuantizationArgs`` of a scheme whose input observer is ``mse`` or
    ``memoryless_mse``), each observation's range is also searched
    (:func:`~llmc_fsm_quantization.observers.input_range_mse`) and kept as ``mse`` (the same moving average) and
    ``memoryless_mse`` (the last observation's).

    Given ``group_size`` (NVFP4's ``dynamic: local`` inputs), each range is kept per group of ``group_size``
    consecutive input features (``[2, in_features // group_size]``), as llm-compressor's observers keep them for
    such inputs; :func:`_input_global_scale` takes the largest magnitude over the groups.

    The ranges are kept on the CPU in :func:`~llmc_fsm_quantization.kv_cache.range_dtype` of the inputs' dtype:
    bfloat16 / float16 / float32 inputs' own, as llm-compressor's observers keep them, the moving averages computed
    as its ``lerp`` computes them, ``v * (1 - c) + v_obs * c``, each product and the sum rounded to that dtype (they
    were kept in float64: on a bfloat16 model the static input scales differed from llm-compressor's by a bfloat16
    step or two in every layer, and on a float32 model by a float32 step, found by testers). The scales are computed
    from them in the inputs' dtype (:attr:`dtype`; :func:`_input_qparams`, :func:`_input_global_scale`), as
    compressed-tensors computes them.

    Under ``torch.distributed`` :meth:`all_reduce` takes the extremes over the ranks for the first and the
    mean over the ranks for the others (as llm-compressor does), in float64, rounded back to :attr:`dtype`.

    With ``keep_hessian=False`` only the ranges and the token count are kept: no Hessian nor its diagonal (a
    modifier that neither measures its output error nor weights its observer by the inputs reads neither; the
    diagonal alone is a pass over every input, ~0.7 s of an FP8-static SmolLM2-135M run on 2 cores);
    :attr:`hessian` and :attr:`diagonal` then raise ``AttributeError``.
    """

    AVERAGING_CONSTANT = 0.01

    def __init__(
        self,
        in_features: int,
        device: torch.device | str | None = None,
        mse_args: QuantizationArgs | None = None,
        group_size: int | None = None,
        *,
        diagonal_only: bool = False,
        keep_hessian: bool = True,
    ) -> None:
        super().__init__(in_features, device, diagonal_only=diagonal_only)
        self.keep_hessian = bool(keep_hessian)
        self.ranges: dict[str, torch.Tensor] = {}  # observer -> [min, max] (or [2, groups]), kv_cache.range_dtype
        self.mse_args = mse_args
        self.group_size = group_size
        #: dtype of the observed inputs (the scales are computed in it); float32 until an input is seen.
        self.dtype = torch.float32

    @property
    def hessian(self) -> torch.Tensor:
        """:attr:`HessianAccumulator.hessian`; ``AttributeError`` with ``keep_hessian=False``."""
        if not self.keep_hessian:
            raise AttributeError("these CalibrationStatistics keep the input ranges only (keep_hessian=False)")
        return super().hessian

    @property
    def diagonal(self) -> torch.Tensor:
        """:attr:`HessianAccumulator.diagonal`; ``AttributeError`` with ``keep_hessian=False``."""
        if not self.keep_hessian:
            raise AttributeError("these CalibrationStatistics keep the input ranges only (keep_hessian=False)")
        return super().diagonal

    @torch.no_grad()
    def add_batch(self, x: torch.Tensor) -> None:
        if self.keep_hessian:
            super().add_batch(x)
        elif x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"expected input with last dimension {self.in_features}, got shape {tuple(x.shape)}")
        else:
            self._num_samples += x.numel() // self.in_features
        if x.numel() == 0:
            return
        self.dtype = x.dtype
        x = x.detach()
        per_sample = x.reshape(x.shape[0] if x.dim() > 2 else 1, -1, self.in_features)  # [samples, tokens, in]
        if self.group_size is None:
            low, high = per_sample.amin(dim=(1, 2)), per_sample.amax(dim=(1, 2))
        else:  # [samples, groups]
            grouped = per_sample.unflatten(-1, (-1, self.group_size))
            low, high = grouped.amin(dim=(1, 3)), grouped.amax(dim=(1, 3))
        kept = kv_cache.range_dtype(x.dtype)
        calls = torch.stack([low, high], dim=1).to(device="cpu", dtype=kept)  # [samples, 2, (groups)]
        for i, call in enumerate(calls):
            searched = input_range_mse(per_sample[i], self.mse_args) if self.mse_args is not None else None
            self._observe(call, None if searched is None else searched.to(kept))

    def _observe(self, call: torch.Tensor, searched: torch.Tensor | None) -> None:
        """Combine one observation's ``[min, max]`` (and its searched range) into :attr:`ranges`."""
        if not self.ranges:
            self.ranges = {"static_minmax": call.clone(), "minmax": call.clone(), "memoryless_minmax": call}
            if searched is not None:
                self.ranges.update(mse=searched.clone(), memoryless_mse=searched)
            return
        extremes = self.ranges["static_minmax"]
        call = call.to(extremes.dtype)
        extremes[0] = torch.minimum(extremes[0], call[0])
        extremes[1] = torch.maximum(extremes[1], call[1])
        self.ranges["minmax"] = _moving_average(self.ranges["minmax"], call, self.AVERAGING_CONSTANT)
        self.ranges["memoryless_minmax"] = call
        if searched is not None:
            searched = searched.to(extremes.dtype)
            self.ranges["mse"] = _moving_average(self.ranges["mse"], searched, self.AVERAGING_CONSTANT)
            self.ranges["memoryless_mse"] = searched

    def all_reduce(self) -> None:
        """:meth:`HessianAccumulator.all_reduce`, then the ranges: extremes by max / min, the others averaged
        over the ranks that saw inputs (a rank without any takes part with neutral values); reduced in float64 and
        rounded back to the ranges' dtype (the extremes exactly; the means once, where llm-compressor averages in
        the observed dtype)."""
        super().all_reduce()
        if not is_distributed():
            return
        what = "all_reduce (input ranges)"
        shape = (2,) if self.group_size is None else (2, self.in_features // self.group_size)
        sign = torch.tensor([-1.0, 1.0], dtype=torch.float64).reshape(2, *([1] * (len(shape) - 1)))
        extremes = self.ranges.get("static_minmax")
        flipped = torch.full(shape, float("-inf"), dtype=torch.float64)
        if extremes is not None:
            flipped = extremes.double() * sign
        all_reduce_tensor(flipped, op="max", what=what)
        averaged = {}
        for name in ("minmax", "memoryless_minmax", *(("mse", "memoryless_mse") if self.mse_args is not None else ())):
            value = self.ranges.get(name)
            flat = torch.zeros(math.prod(shape) + 1, dtype=torch.float64)
            if value is not None:
                flat[:-1], flat[-1] = value.flatten(), 1.0
            all_reduce_tensor(flat, op="sum", what=what)
            averaged[name] = (flat[:-1] / flat[-1]).reshape(shape)
        reduced = {"static_minmax": flipped * sign, **averaged}
        self.ranges = {name: value.to(kv_cache.range_dtype(self.dtype)) for name, value in reduced.items()}


def _moving_average(value: torch.Tensor, call: torch.Tensor, constant: float) -> torch.Tensor:
    """``value * (1 - c) + call * c`` in ``value``'s dtype, each product and the sum rounded to it (llm-compressor
    0.14's ``lerp`` with its ``averaging_constant`` ``c``), a new tensor."""
    return (value * (1.0 - constant)) + (call * constant)


def _input_qparams(scheme: QuantizationScheme, stats: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Static per-tensor input scale and zero point ``[1]`` from ``stats`` (:class:`CalibrationStatistics`),
    computed in the inputs' dtype (``stats.dtype``)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.input_activations
    lo, hi = stats.ranges[args.observer or ACTIVATION_OBSERVER].to(stats.dtype)
    return calculate_qparams(lo.reshape(1), hi.reshape(1), args)


def _input_global_scale(scheme: QuantizationScheme, stats: Any) -> torch.Tensor:
    """NVFP4's input global scale ``[1]`` float32 from ``stats`` (:class:`CalibrationStatistics` kept per group):
    compressed-tensors' ``generate_gparam`` of the largest magnitude over the groups' ranges of the scheme's input
    observer, ``448 * 6 / max|x|`` (as llm-compressor 0.14's observers give it), divided in the inputs' dtype
    (``stats.dtype``: for bfloat16 inputs the bfloat16 quotient, as ``generate_gparam`` divides the bfloat16 range
    llm-compressor's observer hands it) and returned as float32."""
    from compressed_tensors.quantization.utils import generate_gparam

    lo, hi = stats.ranges[scheme.input_activations.observer or ACTIVATION_OBSERVER].to(stats.dtype)
    absmax = torch.maximum(-lo.min(), hi.max()).reshape(1)
    return generate_gparam(-absmax, absmax).to(torch.float32)


def _observer(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        check_observer(value)


def _input_observer(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value not in STATIC_INPUT_OBSERVERS:
        choices = ", ".join(STATIC_INPUT_OBSERVERS)
        msg = f"input_observer {value!r} is not an observer of static input scales; use one of {choices}"
        raise ValueError(msg)


def _prefixes(name: str) -> list[str]:
    """``"a.b.c"`` -> ``["a.b.c", "a.b", "a"]`` (``[]`` for ``""``)."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _no_statistics(module: nn.Module, args: tuple[Any, ...]) -> None:
    """The forward pre-hook of an ``nn.Embedding`` target: nothing to collect (see
    :meth:`QuantizingModifier._make_hook`)."""
    return None


def _observed_whole(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    """A forward hook that does nothing: the pipeline then runs the hooked layer to its end (see
    :meth:`QuantizingModifier.on_calibration_start`)."""
    return None


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        msg = f"{attribute.name} must be true or false, got {value!r}"
        raise ValueError(msg)


#: Why a ``Conv1D`` target (GPT-2) is refused by the quantizers.
CONV1D_REFUSAL = (
    "a quantized Conv1D cannot be saved so that it reloads (compressed-tensors 0.20 refuses to initialize a Conv1D "
    "for quantization and transformers' loader skips it, so its weights would reload unquantized): add them to "
    "ignore to quantize the other modules; the pruning modifiers prune Conv1D"
)


def _fused_experts(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of ``model``'s fused experts modules (Linear views per expert, not a Conv1D's one view)."""
    return {n: m for n, m in model.named_modules() if weight_views(m) and next(iter(weight_views(m))) != ""}


def dense_experts_not_reloaded(model: nn.Module, fused: dict[str, nn.Module]) -> list[str]:
    """The fused experts of ``fused`` (``{name: module}``, left dense by this run) that transformers would not
    reload from a compressed-tensors checkpoint: those of a family whose checkpoint holds them per expert (its
    conversion mapping, :func:`~llmc_fsm.toolkit.expert_checkpoint_names`; Mixtral, Qwen3-MoE ...), which transformers
    rebuilds through compressed-tensors' dequantization, finding no quantized tensor. Not: experts an earlier run on
    the same in-memory model quantized (:func:`_quantized_earlier`), those transformers reloads as Linear modules
    (Llama 4), and those of a family whose checkpoint keeps them fused (GPT-OSS, DBRX, Qwen3-VL-MoE: reloaded as
    they are, measured by a tester on tiny models with the rest quantized)."""
    left = []
    for name, module in fused.items():
        if _quantized_earlier(module) or reloads_as_linears(module):
            continue
        try:
            expert_checkpoint_names(model, name, module)
        except ValueError:  # kept fused in the checkpoint: reloaded dense as it is
            continue
        left.append(name)
    return left


def _quantized_earlier(experts: nn.Module) -> bool:
    """Whether every expert matrix of fused ``experts`` carries a ``quantization_scheme``: quantized in memory by an
    earlier one-shot run on the same model, whose scheme the saved checkpoint keeps for them."""
    return all(getattr(view, "quantization_scheme", None) is not None for view in weight_views(experts).values())


#: Weight strategies whose saved ``actorder`` records GPTQ's column order (llm-compressor 0.14 writes it for these).
_ACTORDER_RECORDED = frozenset(
    {
        QuantizationStrategy.GROUP,
        QuantizationStrategy.TENSOR_GROUP,
        QuantizationStrategy.CHANNEL,
        QuantizationStrategy.TENSOR,
        QuantizationStrategy.BLOCK,
    }
)


#: compressed-tensors' other names for the same orders (``ActivationOrdering``: ``weight`` is ``static``,
#: ``dynamic`` is ``group``), so llm-compressor recipes that use them mean the same here.
_ACTORDER_ALIASES = {"weight": "static", "dynamic": "group"}


def actorder_value(value: Any) -> Any:
    """``value`` (a string or an ``ActivationOrdering`` member) by its one name here: ``"static"``, ``"group"``."""
    value = getattr(value, "value", value)
    return _ACTORDER_ALIASES.get(value, value) if isinstance(value, str) else value


def _static_inputs(scheme: QuantizationScheme) -> bool:
    """Whether ``scheme`` quantizes input activations with a calibrated (static, ``dynamic: false``) scale."""
    return scheme.input_activations is not None and scheme.input_activations.dynamic is False


def _expert_activations_note(
    scheme: QuantizationScheme, *, all_experts: bool = False, as_linears: bool = False
) -> str | None:
    """The warning of a run whose fused experts' scheme quantizes input activations, or ``None``.

    Fused experts are not Linear modules, so compressed-tensors puts no input quantization on them: in memory they
    run with quantized weights and unquantized inputs; the saved config asks the engine that serves the checkpoint
    (vLLM) to quantize their inputs (dynamic: per token; static: with each expert's calibrated ``input_scale``,
    saved per expert), as llm-compressor's checkpoints of the same recipe do. transformers reloads them so too, its
    experts loader having no place for the static scales (unexpected keys) -- except experts it reloads as one
    Linear module per expert matrix (``as_linears``: Llama 4), which compressed-tensors quantizes like any Linear,
    inputs included: those compute so in memory too (:func:`~llmc_fsm.toolkit.quantize_expert_inputs`), and no
    warning is given.
    """
    inputs = scheme.input_activations
    if inputs is None:
        return None
    if as_linears:  # computed in memory as the reloaded Linears compute them (toolkit.quantize_expert_inputs)
        return None
    if inputs.dynamic is False:
        tokens = "every calibration token (calibrate_all_experts)" if all_experts else "the tokens routed to it"
        how = (
            f"per tensor, static: each expert's input_scale is calibrated on {tokens} and saved, and transformers "
            "reports those as unexpected keys on reload"
        )
    else:
        how = _dynamic_inputs(inputs)
    return (
        f"the fused experts' input activations ({how}) are not quantized in memory nor "
        "when transformers reloads the checkpoint (fused experts are not Linear modules; transformers runs them "
        "dense): their weights are, and the saved config asks the serving engine (vLLM) to quantize their inputs; "
        "a perplexity llmc-fsm measures does not include that"
    )


def _dynamic_inputs(inputs: Any) -> str:
    """How dynamic input activations ``inputs`` are quantized, for the experts' warning: per token or group, or,
    NVFP4's (``dynamic: local``), per group under each expert matrix's calibrated ``input_global_scale``."""
    if is_local(inputs):
        return f"per {inputs.strategy}, dynamic under each expert matrix's calibrated input_global_scale, saved"
    return f"per {inputs.strategy}, dynamic"


#: the end of a refusal of a scheme on fused experts: what runs besides the schemes transformers reloads
_FOR_VLLM = " (NVFP4, NVFP4A16 and FP8_BLOCK experts are written per expert for vLLM instead)"


@torch.no_grad()
def _attach_view_qparams(view: LinearView, scheme: QuantizationScheme, quantized: QuantizedWeight) -> None:
    """Write ``quantized.weight`` into the fused parameter through ``view`` and keep its quantization on the view.

    The view (not a registered module) then carries ``quantization_scheme``, ``quantization_status`` (frozen) and
    ``quantized_params`` (``weight_scale`` in the weight's dtype, ``weight_zero_point`` in the scheme's zero-point
    dtype), which :func:`llmc_fsm.output.save.compressed_state_dict` packs with compressed-tensors' compressor.
    """
    args = scheme.weights
    scale = quantized.scale.detach().to(view.weight.dtype).clone()
    zero_point = quantized.zero_point.detach().to(args.zp_dtype or torch.int8).clone()
    if scale.dtype != quantized.scale.dtype and not is_scaled_format(args) and quantized.g_idx is None:
        # the values its checkpoint decompresses to, ``(q - zero_point) * scale`` with the scale as saved (a
        # Linear's forward fake-quantizes with it so): re-rounding onto that grid gives each q back (the scales
        # differ by less than 2**-8 relative), the product is the saved scale's (measured: int8 per channel from a
        # float32 scale was off by one bf16 ulp on some entries, and the reloaded model differed)
        weight = _library_fake_quantize(quantized.weight, scale, zero_point, args)
        quantized.weight = weight.to(view.weight.dtype)
    view.weight.copy_(quantized.weight)
    view.quantization_scheme = scheme
    view.quantization_status = QuantizationStatus.FROZEN
    view.quantized_params = {"weight_scale": scale, "weight_zero_point": zero_point}
    if quantized.input_scale is not None:  # static FP8 inputs: [1] in the weight's dtype, as a Linear's input_scale
        view.quantized_params["input_scale"] = quantized.input_scale.detach().to(view.weight.dtype).clone()
    for key in ("weight_global_scale", "input_global_scale"):  # NVFP4: [1] float32 each, as a Linear's
        value = quantized.global_scale if key == "weight_global_scale" else quantized.input_global_scale
        if value is not None:
            view.quantized_params[key] = value.detach().to(torch.float32).clone()
    if is_scaled_format(args):  # MX: the values its checkpoint decompresses to, as a module's (_as_reloaded)
        _view_as_reloaded(view, scheme)
        quantized.weight = view.weight.detach()


def _view_as_reloaded(view: LinearView, scheme: QuantizationScheme) -> None:
    """:func:`_as_reloaded` for an expert matrix: its view's weight becomes what compressed-tensors' compressor
    decompresses its packed tensors to, which is what transformers' experts loader fuses on reload (it calls the
    same compressor per expert); the packed tensors are kept on the view for the save (:func:`keep_packed`).
    Measured on a bfloat16 tiny Qwen3-MoE, MXFP4A16: without it the reloaded experts were up to 0.015 apart from
    the in-memory ones (the fake-quantized values are not rounded in bfloat16 as the decompression is)."""
    from compressed_tensors.compressors.format import infer_module_format

    fmt = (scheme.format or infer_module_format(nn.Linear, scheme)).value
    packed, weight = _packed_and_reloaded({"weight": view.weight.detach(), **view.quantized_params}, scheme, fmt)
    view.weight.copy_(weight.to(view.weight.dtype))
    keep_packed(view, fmt, packed)


#: ``model_type`` -> why transformers does not reload the family's checkpoint with integer-quantized weights
#: (pack- or int-quantized), measured on tiny models with transformers 5.25 and compressed-tensors 0.20
#: (2026-12-06): its conversion mapping concatenates the q/k/v convolution weights, and with integer weights no
#: source tensor reaches it. Float (FP8) checkpoints of the same families reload.
INT_WEIGHTS_DO_NOT_RELOAD: dict[str, str] = {
    family: "its conversion of the q/k/v conv1d weights finds none: 'Concatenate on tensors destined for "
    f"{where}.conv1d.weight. Ckpt contains: 0'"
    for family, where in (("kimi_linear", "self_attn"), ("olmo_hybrid", "linear_attn"))
}


class _DefaultIgnore(list):
    """The ``ignore`` a recipe did not give (``[lm_head]``): a list that remembers it was defaulted."""


def _ignore(value: Any) -> list[str]:
    """attrs converter of ``ignore``: the default (not given) stays the marked ``[lm_head]``; anything else as
    :func:`~llmc_fsm.toolkit.patterns` reads it (``None`` refused, as llm-compressor and the other modifiers refuse
    it: it meant the default here, ``[]`` to the pruners; session 29's left item)."""
    return value if isinstance(value, _DefaultIgnore) else patterns(value)


def _canonical_scheme(scheme: Any) -> Any:
    """A ``QuantizationArgs`` scheme as the mapping ``{"weights": args}`` it means, so that the saved recipe.yaml
    writes ``scheme: {weights: {...}}``, which reads back (the bare arguments' fields would read as a preset
    mapping with unknown keys); a preset name in its canonical case (``w4a16`` -> ``W4A16``, as compressed-tensors
    reads it); anything else unchanged."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    if scheme is None:
        return None
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
            from it. Default ``W4A16`` when ``config_groups`` is not given either.
        config_groups: llm-compressor's ``{group name: {targets: [...], weights: {...},
            input_activations: {...}}}``: each group quantizes its targets with its
            scheme (non-uniform quantization). Either this or ``scheme``, not both. The
            modifier's ``targets`` become the groups' targets together; a module two
            groups select is refused, naming both groups.
        observer: how a weight's range is chosen, for every group:
            ``minmax``, ``static_minmax``, ``memoryless_minmax``, ``mse``,
            ``memoryless_mse`` or ``imatrix_mse`` (see
            :mod:`llmc_fsm_quantization.observers`; ``imatrix_mse`` needs calibration
            data). Default: each scheme's own ``weights.observer``, else ``minmax``; when
            every group uses the same one it is recorded here (and in the saved recipe).
        input_observer: the observer of static input scales, for every group with static
            input activations: ``minmax`` (moving average), ``static_minmax`` or
            ``memoryless_minmax`` (see :class:`CalibrationStatistics`). Default: each
            scheme's own, else ``minmax``. Refused when no group has static input activations.
        kv_cache_scheme: llm-compressor's / compressed-tensors' KV-cache scheme: a mapping of FP8
            ``QuantizationArgs`` fields (``{num_bits: 8, type: float, symmetric: true, dynamic: false,
            strategy: tensor}``, or ``strategy: attn_head`` for one scale per key/value head; ``observer``
            ``minmax`` (default), ``static_minmax`` or ``memoryless_minmax``). Every attention module of
            the model gets ``k_scale`` / ``v_scale`` calibrated from the keys and values of the calibration
            tokens, and its keys and values are fake-quantized from then on (see
            :mod:`llmc_fsm_quantization.kv_cache`). Needs calibration data; only the modifiers with
            :attr:`supports_kv_cache` (GPTQ, round-to-nearest) take it. Given without ``scheme`` and
            ``config_groups`` (:attr:`kv_only`), only the KV-cache scales are calibrated and no weight is touched,
            as in llm-compressor.
        calibrate_all_experts: mixture-of-experts layers with fused experts (transformers 5's ``MixtralExperts``
            ...): ``False`` (default) gives each expert matrix (``<experts>.<e>.gate_proj`` / ``up_proj`` /
            ``down_proj``, views of the fused parameters: :mod:`llmc_fsm.toolkit.views`) the tokens the router sent
            to that expert, so each has its own Hessian (GPTQ); ``True`` sends every calibration token through every
            expert for the statistics only (the layer's output keeps the router's choice). An expert matrix that got
            no token is quantized by round-to-nearest (named in a warning and in
            :attr:`round_to_nearest_fallback`). :attr:`routed_tokens` counts the routed tokens per expert matrix.
            The quantized values are written into the fused parameters; saved per expert, packed, under the names
            transformers 5 reads back (it reloads them dequantized into the fused parameters).
        targets, ignore: see :class:`~llmc_fsm.toolkit.calibrated.CalibratedModifier`
            (defaults ``[Linear]`` and ``[lm_head]``; llm-compressor's default ``ignore``
            is empty, so a recipe without ``ignore`` keeps ``lm_head`` dense here, which
            is logged, and the saved recipe records ``ignore: [lm_head]``).

    Raises (at construction): ``ValueError`` for an unknown preset (listing the
    presets), invalid scheme fields, an unsupported scheme, an unknown observer
    (anywhere: here or inside a scheme), ``scheme`` together with ``config_groups``,
    or ``targets`` that differ from the config groups' targets.
    """

    unties_head = True  # a head tied to the embedding is untied before it is quantized (_untie_head)

    scheme: Any = attrs.field(default=None, converter=_canonical_scheme)
    config_groups: Any = attrs.field(default=None)
    observer: str | None = attrs.field(default=None, validator=_observer)
    input_observer: str | None = attrs.field(default=None, validator=_input_observer)
    ignore: list[str] = attrs.field(factory=lambda: _DefaultIgnore(DEFAULT_IGNORE), converter=_ignore)
    kv_cache_scheme: Any = attrs.field(default=None)
    calibrate_all_experts: bool = attrs.field(default=False, validator=_bool)

    #: Whether this modifier calibrates a ``kv_cache_scheme`` (its lifecycle is this class's).
    supports_kv_cache = False
    #: Whether this modifier runs ``imatrix_mse`` on NVFP4 weights (round-to-nearest's searched ranges).
    imatrix_on_nvfp4 = False

    def __attrs_post_init__(self) -> None:
        self._ignore_defaulted = isinstance(self.ignore, _DefaultIgnore)
        self._lines_logged = False  # the lines of the first check_model that passed are logged once
        self._precedence_lines: list[str] = []  # config groups overlapping: which took what (_memberships)
        self._indirect_line: str | None = None  # targets compressed-tensors would not match (_indirect_targets)
        self._experts_warned = False  # the fused experts' input-activation warning given (once per modifier)
        #: set by one-shot when a recipe has several quantizing modifiers: whether the model's fused experts are left
        #: dense is then checked for the whole recipe (another modifier may quantize them), and
        #: :attr:`dense_experts_refusal` holds this modifier's refusal instead of raising it.
        self.experts_checked_by_run = False
        self.dense_experts_refusal: str | None = None
        self.ignore = list(self.ignore)
        self._kv_attention: dict[str, nn.Module] = {}  # attention name -> module (kv_cache_scheme)
        #: no quantization config at all (llm-compressor's "has_config" false): a GPTQModifier so written takes the
        #: config of a QuantizationModifier before it in its stage (:meth:`GPTQModifier.take_stage_config`)
        self._bare = (
            self.scheme is None
            and self.config_groups is None
            and self.observer is None
            and list(self.targets) == list(DEFAULT_TARGETS)
            and (self._ignore_defaulted or list(self.ignore) == [])  # llm-compressor's default, its saved recipe's
            and self.kv_cache_scheme is None
        )
        super().__attrs_post_init__()
        self._resolve()

    def _resolve(self) -> None:
        """Resolve ``scheme`` / ``config_groups`` and the observers into :attr:`quantization_schemes`.

        Raises:
            ValueError: see the class docs.
        """
        self._kv_args = kv_cache.resolve_kv_cache_scheme(self.kv_cache_scheme)
        if self._kv_args is not None:
            if not self.supports_kv_cache:
                name = type(self).__name__
                msg = f"kv_cache_scheme is not implemented for {name}; use GPTQModifier or QuantizationModifier"
                raise ValueError(msg)
            fields = ("num_bits", "type", "symmetric", "strategy", "dynamic", "observer")
            values = {f: getattr(self._kv_args, f) for f in fields}
            self.kv_cache_scheme = {f: getattr(v, "value", v) for f, v in values.items()}  # what recipe.yaml records
        kv_alone = self._kv_args is not None and self.scheme is None and self.config_groups is None
        if kv_alone:
            groups: dict[str, QuantizationScheme] = {}
        elif self.config_groups is not None:
            if self.scheme is not None:
                msg = "give either scheme or config_groups, not both (as in llm-compressor)"
                raise ValueError(msg)
            groups = resolve_config_groups(self.config_groups)
            union = list(dict.fromkeys(t for scheme in groups.values() for t in scheme.targets))
            weights = [t for s in groups.values() if not is_attention_scheme(s) for t in s.targets]
            weights = list(dict.fromkeys(weights))
            if list(self.targets) not in (union, weights, list(DEFAULT_TARGETS)):
                msg = (
                    f"the modifier's targets {list(self.targets)} differ from its config_groups' targets {union}: "
                    "leave targets out (each config group names its own)"
                )
                raise ValueError(msg)
            self.targets = weights or union
        else:
            if self.scheme is None:
                self.scheme = DEFAULT_SCHEME
            groups = {"group_0": resolve_scheme(self.scheme, self.targets)}
        groups = self._split_attention(groups)
        #: No weight scheme (``kv_cache_scheme`` alone, or attention quantization alone): as in llm-compressor, only
        #: the KV-cache (and query) scales are calibrated; no weight is touched (no targets, no config group).
        self.kv_only = not groups
        actorder = getattr(self, "actorder", None)
        static = [s.input_activations for s in groups.values() if s.input_activations is not None]
        static = [a for a in static if not a.dynamic or is_local(a)]
        if self.input_observer is not None and not static:
            msg = (
                "input_observer applies to static input activations (dynamic: false) or NVFP4's (dynamic: local), "
                "and no config group has them"
            )
            raise ValueError(msg)
        for a in static:
            if self.input_observer is not None:
                a.observer = self.input_observer
            elif a.observer is None:
                a.observer = ACTIVATION_OBSERVER  # recorded in the saved config: what was used
            if is_local(a) and a.observer not in LOCAL_INPUT_OBSERVERS:
                msg = (
                    f"input observer {a.observer} is not supported for NVFP4's input global scale; use one of "
                    f"{', '.join(LOCAL_INPUT_OBSERVERS)}"
                )
                raise ValueError(msg)
        written_observers = {s.weights.observer for s in groups.values() if s.weights is not None} - {None}
        for scheme in groups.values():
            w = scheme.weights
            if w is None:
                continue
            if self.observer is not None:
                w.observer = self.observer
            elif w.observer is None:
                w.observer = DEFAULT_OBSERVER
            written = getattr(w.actorder, "value", w.actorder)  # in the scheme / config group itself
            if hasattr(self, "actorder") and written is not None and actorder_value(written) != actorder:
                msg = (  # llm-compressor 0.14's GPTQModifier refuses this too (its resolve_actorder)
                    f"actorder is {actorder or 'null'} on the modifier and {written} in the scheme's weights: give it "
                    "in one place (leave actorder off the modifier, or remove it from the scheme / config groups)"
                )
                raise ValueError(msg)
            if actorder is not None and w.strategy in _ACTORDER_RECORDED:  # the order GPTQ sweeps in, recorded
                w.actorder = ActivationOrdering(actorder)
        for group, scheme in groups.items():
            w = scheme.weights
            if w is not None and w.observer in NVFP4_OBSERVERS and not is_nvfp4(w):
                where = f"config group {group!r}" if self.config_groups is not None else "the scheme"
                msg = f"observer {w.observer} is for NVFP4 weights (tensor_group, 4-bit float), and {where} is not"
                raise ValueError(msg)
            if w is not None and is_scaled_format(w):
                check_scaled_observer(w.observer, w)  # refused when read, before any calibration
                if w.observer in IMPORTANCE_OBSERVERS and not self.imatrix_on_nvfp4:
                    msg = (
                        f"observer imatrix_mse on NVFP4 weights is implemented for QuantizationModifier (round-to-"
                        f"nearest) only, not {type(self).__name__}; use minmax or nvfp4_expanded_mse"
                    )
                    raise ValueError(msg)
        observers = {s.weights.observer for s in groups.values() if s.weights is not None}
        #: the observer was written in the scheme's weights, not on the modifier (explain: derived_arguments)
        self._observer_from_scheme = self.observer is None and len(observers) == 1 and observers == written_observers
        if self.observer is None and len(observers) == 1:
            (self.observer,) = observers
        self._groups: dict[str, QuantizationScheme] = groups
        self._group_of: dict[str, str] = {}

    def _split_attention(self, groups: dict[str, QuantizationScheme]) -> dict[str, QuantizationScheme]:
        """``groups`` without the attention-quantization group (input activations only), which sets
        :attr:`attention_scheme` and the KV-cache arguments (llm-compressor's attention quantization quantizes the
        queries, keys and values of the attention modules it targets with the same FP8 arguments).

        Raises:
            ValueError: several such groups, one together with ``kv_cache_scheme``, arguments that are not an FP8 KV
                scheme (:func:`llmc_fsm_quantization.kv_cache.resolve_kv_cache_scheme`), or a modifier without
                :attr:`supports_kv_cache`.
        """
        #: The attention-quantization config group's scheme (``None`` without one).
        self.attention_scheme: QuantizationScheme | None = None
        attention = {name: scheme for name, scheme in groups.items() if is_attention_scheme(scheme)}
        if not attention:
            return groups
        where = f"config_groups entry {next(iter(attention))!r}" if self.config_groups is not None else "scheme"
        if len(attention) > 1:
            msg = f"config_groups {', '.join(map(repr, attention))} each quantize attention: give one such group"
            raise ValueError(msg)
        if self._kv_args is not None:
            msg = (
                f"{where} quantizes the attention (queries, keys and values), which quantizes the KV cache with the "
                "same arguments: leave kv_cache_scheme out"
            )
            raise ValueError(msg)
        if not self.supports_kv_cache:
            msg = (
                f"attention quantization ({where}) is not implemented for {type(self).__name__}; use GPTQModifier or "
                "QuantizationModifier"
            )
            raise ValueError(msg)
        scheme = next(iter(attention.values())).model_copy(deep=True)
        try:
            args = kv_cache.resolve_kv_cache_scheme(scheme.input_activations)
        except ValueError as exc:
            reason = str(exc).removeprefix("kv_cache_scheme: ")  # its arguments are a KV-cache scheme's
            raise ValueError(f"{where}: attention quantization: {reason}") from None
        scheme.input_activations = args
        self.attention_scheme, self._kv_args = scheme, args
        return {name: s for name, s in groups.items() if name not in attention}

    @property
    def quantization_scheme(self) -> QuantizationScheme:
        """The resolved ``compressed_tensors`` scheme (a copy); with several config groups, the first group's
        (:attr:`quantization_schemes` has them all)."""
        return self._first_group().model_copy(deep=True)

    def _first_group(self) -> QuantizationScheme:
        if not self._groups:
            msg = f"{type(self).__name__}: kv_cache_scheme alone quantizes no weights: there is no weight scheme"
            raise ValueError(msg)
        return next(iter(self._groups.values()))

    @property
    def quantization_schemes(self) -> dict[str, QuantizationScheme]:
        """``{config group name: resolved scheme}`` (copies); ``{"group_0": scheme}`` for a ``scheme``."""
        return {name: scheme.model_copy(deep=True) for name, scheme in self._groups.items()}

    @property
    def weight_args(self) -> QuantizationArgs:
        """The (first config group's) scheme's weight ``QuantizationArgs``."""
        return weight_args(self._first_group())

    def _group(self, name: str) -> str:
        return self._group_of.get(name, next(iter(self._groups)))

    def scheme_of(self, name: str) -> QuantizationScheme:
        """The scheme of target ``name`` (after :meth:`check_model`): its config group's."""
        return self._groups[self._group(name)]

    @property
    def derived_arguments(self) -> dict[str, str]:
        """``{argument: what set it}`` for arguments the recipe did not give that this modifier set from others:
        ``targets`` from ``config_groups``, ``observer`` from the scheme's weights (``explain`` marks them so rather
        than "(default)")."""
        derived = {}
        if self.config_groups is not None and list(self.targets) != list(DEFAULT_TARGETS):
            derived["targets"] = "config_groups"
        if self._observer_from_scheme:
            derived["observer"] = "the scheme's weights"
        return derived

    @property
    def unused_arguments(self) -> dict[str, str]:
        """``{argument: why}`` for arguments that do nothing in this modifier as written (``explain`` says so): with
        ``kv_cache_scheme`` (or attention quantization) alone no weight is quantized, so ``targets`` and ``ignore``
        select nothing (it printed the default ``targets`` and the lm_head note as for a weight scheme)."""
        if not self.kv_only:
            return {}
        why = "no weight scheme: only the KV-cache (and query) scales are calibrated"
        return {"targets": why, "ignore": why}

    @property
    def calibrated_inputs(self) -> bool:
        """Whether some group's input activations take a calibrated scale: static (``dynamic: false``) or NVFP4's
        input global scale (``dynamic: local``)."""
        return any(
            s.input_activations is not None and (not s.input_activations.dynamic or is_local(s.input_activations))
            for s in self._groups.values()
        )

    def _new_accumulator(self, module: nn.Module) -> HessianAccumulator:
        """The Hessian of the target's inputs (only its diagonal unless the modifier measures its output error
        from it, as GPTQ: round-to-nearest needs the inputs' mean squares for ``imatrix_mse`` at most, and a full
        Hessian would cost ``in^2 / 2`` multiply-adds per token); with calibrated input scales also their ranges
        (:class:`CalibrationStatistics`, per group of 16 for NVFP4's inputs; without the Hessian or its diagonal
        when neither is read)."""
        diagonal_only = not self.measures_output_error
        if self.calibrated_inputs:
            inputs = self._groups[self._group(self._names_by_id.get(id(module), ""))].input_activations
            searched = inputs is not None and not inputs.dynamic and inputs.observer in INPUT_MSE_OBSERVERS
            return CalibrationStatistics(
                module.weight.shape[1],
                mse_args=inputs if searched else None,
                group_size=int(inputs.group_size) if is_local(inputs) else None,
                diagonal_only=diagonal_only,
                keep_hessian=self.measures_output_error or self.needs_importance,
            )
        return HessianAccumulator(module.weight.shape[1], diagonal_only=diagonal_only)

    @property
    def needs_importance(self) -> bool:
        """Whether some group's weight observer weights the error by the calibration inputs (``imatrix_mse``)."""
        return any(s.weights is not None and s.weights.observer in IMPORTANCE_OBSERVERS for s in self._groups.values())

    def streaming_refusal(self) -> str | None:
        """A KV-cache scheme or attention quantization observes keys and values (and queries) through the model's
        own attention forward, which streamed layers do not give; an ``Embedding`` target is quantized at
        calibration end, after the streamed path wrote the tensors outside the layers: those jobs run in memory.
        (An embedding selected by name or ``re:`` is refused once the targets are known,
        :func:`llmc_fsm.pipeline.sequential.check_targets_in_layers`.)"""
        if self._kv_args is not None:
            what = "attention quantization" if self.attention_scheme is not None else "kv_cache_scheme"
            return f"{what} observes the attention's keys and values in the whole model's forward"
        if any("Embedding" in (s.targets or ()) for s in self._groups.values()):
            return (
                "an Embedding target is quantized when the calibration ends, after the streamed path wrote the "
                "tensors outside the decoder layers"
            )
        return None

    @property
    def kv_cache_results(self) -> dict[str, dict[str, list[float]]]:
        """``{attention name: {"k_scale": [...], "v_scale": [...]}}`` (and ``"q_scale"`` with attention
        quantization): the calibrated FP8 scales as floats (one per tensor, or one per key/value head), for the
        report. Empty before calibration or without ``kv_cache_scheme``."""
        results: dict[str, dict[str, list[float]]] = {}
        for name, module in self._kv_attention.items():
            found = {
                kind: getattr(module, kind).detach().float().flatten().tolist()
                for kind in ("q_scale", "k_scale", "v_scale")
                if isinstance(getattr(module, kind, None), torch.Tensor) and not getattr(module, kind).is_meta
            }
            if found and not any(math.isnan(x) for v in found.values() for x in v):
                results[name] = found
        return results

    @property
    def kv_cache_args(self) -> QuantizationArgs | None:
        """The resolved ``kv_cache_scheme`` (``None`` without one)."""
        return self._kv_args

    # ---- checks before any calibration work ------------------------------------------
    quantized_model_hint = "quantize the original full-precision model instead"
    zeros_are_sparsity = False  # int4 rounds small weights to exact zeros: not pruning

    def _fix_hint(self, targets: dict[str, nn.Module], problems: dict[str, list[str]]) -> str:
        """Suggest the largest power-of-two group size that divides every target's input width."""
        first = next(name for names in problems.values() for name in names)
        args = weight_args(self.scheme_of(first))
        if args.strategy != QuantizationStrategy.GROUP or not all("group_size" in r for r in problems):
            return super()._fix_hint(targets, problems)
        if is_scaled_format(args):  # MX: groups of 32 by the format's definition, no other size to suggest
            return "The format's groups are 32 values wide by definition: add these modules to ignore."
        width = math.gcd(*(int(m.weight.shape[1]) for m in targets.values()))
        group = width & -width  # the largest power of two dividing every width, halved down to the size asked for
        while group > int(args.group_size):  # (a refused 48 on width 64 was suggested back: found by a tester)
            group //= 2
        name = self.scheme if isinstance(self.scheme, str) else None
        if isinstance(self.scheme, Mapping):
            name = self.scheme.get("preset")
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
            else "Add these modules to ignore or use a channel-wise scheme (e.g. W8A8, FP8_DYNAMIC, or weights with "
            "strategy: channel)."
        )
        return fix

    def check_model(self, model: nn.Module) -> dict[str, nn.Module]:
        """:meth:`CalibratedModifier.check_model`, and the checks of fused experts and Conv1D (:meth:`_check_views`).

        Raises:
            ValueError: as the base class; as :meth:`_check_views`; or,
                with several config groups, a group that selects nothing, or a module two groups select (both
                groups and the module named).
        """
        self.dense_experts_refusal = None
        if self.kv_only:  # KV-cache scales only: no weight target
            self._group_of, self._expert_names, self._fused = {}, {}, {}
            dense = dense_experts_not_reloaded(model, _fused_experts(model))
            if dense:
                what = "kv_cache_scheme" if self.attention_scheme is None else "attention quantization"
                msg = (
                    f"{type(self).__name__}: {model_family(model)}: {what} alone leaves the fused experts "
                    f"{compact_names(dense)} dense, and transformers does not reload dense fused experts from a "
                    "compressed-tensors checkpoint (it decompresses them and finds no quantized tensor: 'We "
                    "encountered some issues during automatic conversion of the weights', measured on Mixtral, "
                    "Qwen3-MoE, PhiMoE, Qwen3-Next and Jamba with transformers 5.25): quantize the experts too (a "
                    "weight scheme for them in the same recipe), or leave the KV cache in float"
                )
                raise ValueError(msg)
            self._kv_attention = self._check_kv_cache(model)
            return {}
        self._check_weights_not_on_attention(model)
        self._group_of, self._precedence_lines = self._memberships(model)
        try:
            targets = super().check_model(model)
        except ValueError:  # a scheme the model's fused experts cannot take is the refusal to give first (no fix of
            refusal = self._experts_scheme_refusal(model)  # the other one, e.g. a dtype, would make the recipe run)
            if refusal is not None:
                raise ValueError(refusal) from None
            raise
        self._indirect_line = self._indirect_targets(targets)
        self._expert_names = self._check_views(model, targets)  # refuses what fused experts cannot take first
        self._check_not_shared(model, targets)
        self._check_int_reload(model)
        self._fused = self._fused_siblings(model, targets)
        if self._kv_args is not None:
            self._kv_attention = self._check_kv_cache(model)
        if not self._lines_logged:  # once the checks passed: no line before a refusal
            self._lines_logged = True
            for line in self._precedence_lines:
                logger.info(line)
            if self._indirect_line is not None:
                logger.warning(self._indirect_line)
            if self._ignore_defaulted:
                self._warn_default_ignore(model)
        return targets

    def _indirect_targets(self, targets: Mapping[str, nn.Module]) -> str | None:
        """The warning for ``targets`` (selected modules) that no target of their config group names itself: they
        were reached through a parameter's name (``re:.*q_proj.weight``), a container (``LlamaMLP``) or
        ``__ALL__``, which :func:`~llmc_fsm.toolkit.select_targets` follows (llm-compressor's pruning modifiers do
        too) but compressed-tensors does not match for quantization, so llm-compressor 0.14 leaves them dense
        (found by a tester); ``None`` when every module is named directly."""
        indirect = [
            name
            for name, module in targets.items()
            if not _named_directly(name, module, list(self.scheme_of(name).targets))
        ]
        if not indirect:
            return None
        return (
            f"{type(self).__name__}: {compact_names(indirect)} are quantized here, selected only through a parameter "
            "name, a container or __ALL__ among the targets; compressed-tensors matches a quantization target against "
            "the module itself (its name, an re: pattern on its name, or its class), so llm-compressor 0.14 leaves "
            "them dense: to run the recipe alike in both, target the modules themselves (e.g. 'Linear' or "
            "'re:.*mlp\\..*_proj$')"
        )

    def _check_int_reload(self, model: nn.Module) -> None:
        """Refuse integer weights on a family whose integer-quantized checkpoint transformers does not reload
        (:data:`INT_WEIGHTS_DO_NOT_RELOAD`; found by a tester: the run wrote it and exited 0).

        Raises:
            ValueError: naming the family, why, and what reloads.
        """
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        why = INT_WEIGHTS_DO_NOT_RELOAD.get(model_type)
        kinds = {getattr(s.weights.type, "value", s.weights.type) for s in self._groups.values() if s.weights}
        if why is not None and "int" in kinds:
            from transformers import __version__ as transformers_version  # optional third-party: transformers

            msg = (
                f"{type(self).__name__}: {model_family(model)}: transformers {transformers_version} does not reload "
                f"this family's checkpoint with integer-quantized weights ({why}); use a float scheme (FP8, "
                "FP8_DYNAMIC), whose checkpoint reloads, or prune only"
            )
            raise ValueError(msg)

    def _check_not_shared(self, model: nn.Module, targets: dict[str, nn.Module]) -> None:
        """Refuse targets whose weights several decoder layers share (Zamba's shared transformer block, held by each
        hybrid layer's own modules): the checkpoint holds them quantized under one layer's names and dense under the
        others', which transformers does not reload ("Linear has no attribute 'weight'"; llm-compressor 0.14's
        checkpoint fails the same way: a tester's case).

        Raises:
            ValueError: naming the modules, the family and the fix.
        """
        try:
            layers_name, layers = find_decoder_layers(model)
        except ValueError:  # no decoder layers found: nothing they could share
            return
        shared = {
            f"{layers_name}.{name.rsplit('.', 1)[0]}"
            for names in weights_shared_across_layers(layers)
            for name in names
            if name.endswith(".weight")
        }
        hit = [name for name in targets if name in shared]
        if hit:
            msg = (
                f"{type(self).__name__}: {model_family(model)}: {compact_names(hit)} hold weights that several decoder "
                "layers share, which transformers does not reload quantized (the checkpoint writes them under one "
                "layer's names): add them to ignore (e.g. 're:.*shared_transformer.*')"
            )
            raise ValueError(msg)

    def _warn_default_ignore(self, model: nn.Module) -> None:
        """One line on the ``ignore`` a recipe did not give: ``[lm_head]`` keeps the output head dense where it is
        named ``lm_head``; a head of another name (Whisper's ``proj_out``) is a target like any Linear, and the line
        says so instead of claiming a dense head. No line when the targets do not reach the head (only attention
        projections, say): llm-compressor's empty default leaves it dense too (found by a tester)."""
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
        if name is not None and not self._targets_reach(model, name):
            return
        if name is None or name.rsplit(".", 1)[-1] == "lm_head":
            logger.warning(
                "%s: no ignore given: lm_head is kept dense (ignore: [lm_head]; llm-compressor's default ignore is "
                "empty, which quantizes lm_head too: give ignore: [] for that)",
                type(self).__name__,
            )
            return
        logger.warning(
            "%s: no ignore given: the default ignore [lm_head] names no module of %s, so its output head %s is "
            "quantized like any target (as llm-compressor's empty default does); give ignore: [%s] to keep it dense",
            type(self).__name__,
            model_family(model),
            name,
            name,
        )

    def _targets_reach(self, model: nn.Module, name: str) -> bool:
        """Whether this modifier's targets select the module ``name`` with an empty ``ignore`` (a selection the
        model refuses, e.g. a tied head, counts as reaching it)."""
        try:
            selection = select_targets(
                model,
                self.targets,
                (),
                supported=self._selectable,
                views=self.compresses_views,
                untie_head=self.unties_head,
            )
        except ValueError:
            return True
        return name in selection.selected

    def _fused_siblings(self, model: nn.Module, targets: dict[str, nn.Module]) -> dict[str, tuple[str, ...]]:
        """``{target name: names of the modules it is fused with, itself included}`` for every NVFP4 target that
        vLLM loads fused with siblings (:data:`~llmc_fsm_quantization.observers.FUSED_SIBLINGS`: ``q/k/v_proj``,
        ``gate/up_proj``, ... of one parent): they get one global scale (:meth:`global_scales`). The names are
        the parent's attributes that are not ``None``; a parent lacking one of a set's names fuses nothing.

        Raises:
            ValueError: a fused set with an NVFP4 target and a sibling that is not a target of this modifier with
                NVFP4 weights (ignored, not selected, or another scheme): its one global scale could not be shared
                (llm-compressor 0.14 refuses this too, with an assertion). All such sets named.
        """
        fused: dict[str, tuple[str, ...]] = self._fused_expert_siblings(targets)
        problems: dict[str, None] = {}
        for name, module in targets.items():
            if not self._nvfp4(name) or name in fused or isinstance(module, LinearView):  # an expert matrix: above
                continue
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            for siblings in FUSED_SIBLINGS:
                if attribute not in siblings or not all(hasattr(parent, s) for s in siblings):
                    continue
                prefix = f"{parent_name}." if parent_name else ""
                present = [s for s in siblings if getattr(parent, s) is not None]
                members = tuple(prefix + s for s in present)
                others = [s for s in present if prefix + s not in targets or not self._nvfp4(prefix + s)]
                if others:
                    problems[f"{prefix}{{{','.join(present)}}} ({', '.join(others)} not)"] = None
                else:
                    fused.update(dict.fromkeys(members, members))
        if problems:
            msg = (
                f"{type(self).__name__}: vLLM loads each of these sets of modules as one fused layer with one NVFP4 "
                f"global scale, and only some of each are quantized with NVFP4 here: {'; '.join(problems)}; quantize "
                "all modules of a set with NVFP4 (tensor_group) or none (as llm-compressor, which refuses this too)"
            )
            raise ValueError(msg)
        return fused

    def _fused_expert_siblings(self, targets: dict[str, nn.Module]) -> dict[str, tuple[str, ...]]:
        """:meth:`_fused_siblings` of the NVFP4 expert matrices (views of fused experts): those of one expert whose
        checkpoint names (:meth:`_check_views`) are one of :data:`FUSED_SIBLINGS`' sets under one parent, e.g.
        ``experts.3.gate_proj`` and ``experts.3.up_proj`` (Mixtral's ``experts.3.w1`` / ``w3``), which vLLM loads as
        one ``w13`` matrix with one global scale (llm-compressor 0.14 shares it the same way). Every matrix of an
        experts module is a target here (:meth:`_check_views` refuses fewer)."""
        by_parent: dict[str, dict[str, str]] = {}
        for name, module in targets.items():
            if isinstance(module, LinearView) and name in self._expert_names and self._nvfp4(name):
                parent, _, attribute = self._expert_names[name].rpartition(".")
                by_parent.setdefault(parent, {})[attribute] = name
        fused: dict[str, tuple[str, ...]] = {}
        for attributes in by_parent.values():
            for siblings in FUSED_SIBLINGS:
                if all(s in attributes for s in siblings):
                    members = tuple(attributes[s] for s in siblings)
                    fused.update(dict.fromkeys(members, members))
        return fused

    def _nvfp4(self, name: str) -> bool:
        """Whether target ``name``'s scheme quantizes its weight with NVFP4 (tensor_group, 4-bit float)."""
        weights = self.scheme_of(name).weights
        return weights is not None and is_nvfp4(weights)

    def global_scales(self, modules: list[nn.Module]) -> list[torch.Tensor | None]:
        """The NVFP4 global scale ``[1]`` float32 of each of ``modules`` (targets): the one shared with the
        modules it is fused with (:meth:`_fused_siblings`), from all their weights as they are when the first of
        them is quantized (:func:`~llmc_fsm_quantization.observers.fused_global_scale`, as llm-compressor 0.14's
        fused weight observers); ``None`` for a module fused with none (its own global scale)."""
        scales: list[torch.Tensor | None] = []
        for module in modules:
            members = self._fused.get(self._names_by_id.get(id(module), ""))
            if members is None:
                scales.append(None)
                continue
            if members not in self._shared_global_scales:
                weights = [self._targets[m].weight for m in members]
                self._shared_global_scales[members] = fused_global_scale(weights)
            scales.append(self._shared_global_scales[members])
        return scales

    def _check_views(self, model: nn.Module, targets: dict[str, nn.Module]) -> dict[str, str]:
        """Checks of the targets that are Linear views (:mod:`llmc_fsm.toolkit.views`), before any work.

        Fused experts are quantized per expert matrix and saved in compressed-tensors' per-expert layout under the
        checkpoint names transformers 5 reads back (:func:`~llmc_fsm.toolkit.views.expert_checkpoint_names`); on
        reload, transformers decompresses each expert's weight and fuses them again (its
        ``CompressedTensorsDequantize``: packed int weights, scales and shapes; from 5.25 on also fp8 weights times
        their scales). Hence what is refused.

        Returns:
            ``{expert view name: checkpoint module name}`` of every expert matrix targeted.

        Raises:
            ValueError: one line naming the family and why, for: a ``Conv1D`` target (see
                :data:`CONV1D_REFUSAL`); fused experts of a family whose checkpoint keeps them fused (GPT-OSS, DBRX;
                not Llama 4, whose experts transformers reloads as Linear modules: any scheme, saved per expert under
                :func:`~llmc_fsm.toolkit.linear_expert_names`, its dense matrices too);
                fused experts left dense (not quantized by this run nor an earlier one on the same in-memory model)
                while other modules are quantized (transformers 5.24 then drops them on
                reload), or only some matrices of an experts module targeted; an experts scheme transformers does
                not reload into them (:func:`~llmc_fsm.toolkit.expert_reload_problem`: they take weight-only
                symmetric int packed by compressed-tensors, ``pack-quantized``, any group size; MXFP4 / MXFP6
                weight-only; FP8 weights per
                channel or tensor with no, dynamic or static FP8 per-tensor input activations) and vLLM does not
                read per expert either (NVFP4 and FP8 block experts are written per expert for vLLM, with one warning
                line: :func:`~llmc_fsm.toolkit.experts_for_vllm`), or expert matrices in config groups of different
                schemes.
        """
        name = type(self).__name__
        family = model_family(model)
        views = {n: m for n, m in targets.items() if isinstance(m, LinearView)}
        conv1d = [n for n, v in views.items() if v.expert is None]
        if conv1d:
            msg = f"{name}: {family} keeps {compact_names(conv1d)} as transformers Conv1D: {CONV1D_REFUSAL}"
            raise ValueError(msg)
        module_names = {id(m): n for n, m in model.named_modules()}
        sources: dict[str, nn.Module] = {}
        for view in views.values():
            sources.setdefault(module_names[id(view.source)], view.source)
        fused = _fused_experts(model)
        dense = dense_experts_not_reloaded(model, {n: m for n, m in fused.items() if n not in sources})
        # Llama 4's: transformers reloads them as one Linear per expert matrix, so its fused loader's limits do not
        # apply: their dense matrices are saved per expert (output.save.dense_linear_experts)
        linears = any(reloads_as_linears(m) for m in fused.values())
        if not sources:
            if dense and not linears:  # experts not quantized: the quantized checkpoint would not reload them
                fix = (
                    "quantize them too (target them, in this modifier or another of the recipe; leave them out of "
                    "ignore)"
                    if self.compresses_views
                    else f"{name} does not quantize fused experts (GPTQModifier, QuantizationModifier do, per expert)"
                )
                why = (
                    "transformers does not reload dense fused experts from a compressed-tensors checkpoint (its "
                    "experts loader decompresses quantized weights only: the experts missing in 5.24, 'torch.cat(): "
                    "expected a non-empty list of Tensors' in 5.25; measured on Mixtral)"
                )
                msg = f"{name}: {family}: the fused experts {compact_names(dense)} are not quantized, and {why}: {fix}"
                self.dense_experts_refusal = msg
                if not self.experts_checked_by_run:
                    raise ValueError(msg)
            return {}
        partial = [
            f"{n}.{s}" for n, m in sources.items() for s in weight_views(m) if f"{n}.{s}" not in views
        ]  # fmt: skip
        if (dense or partial) and not linears:  # Llama 4's dense expert matrices are written per expert, as Linears
            left = compact_names(dense or partial)
            why = (
                "transformers' experts loader rebuilds a layer's fused experts from packed weights only (measured on "
                "5.24: the dense ones were missing)"
            )
            msg = (
                f"{name}: {family}: {left} would stay dense while other expert matrices are quantized; {why}: "
                "quantize every expert matrix (no ignore pattern inside the experts) or none of the model"
            )
            raise ValueError(msg)
        scheme = self._experts_scheme(views)
        if scheme is None and not linears:  # Llama 4's: one config group per scheme, by name (output.save)
            groups = sorted({self._group(n) for n in views})
            msg = (
                f"{name}: {family}: the fused experts' matrices are in several config groups ({', '.join(groups)}): "
                "transformers reloads every expert of the model with one group's scheme; put all expert matrices in "
                "one config group"
            )
            raise ValueError(msg)
        scheme = scheme or self.scheme_of(next(iter(views)))
        names: dict[str, str] = {}
        as_linears: list[str] = []  # experts transformers reloads as one Linear per expert matrix (Llama 4)
        for source_name, source in sources.items():
            try:
                per_expert = expert_checkpoint_names(model, source_name, source)
            except ValueError as exc:
                reason = str(exc)
                try:
                    per_expert = linear_expert_names(model, source_name, source)
                except ValueError as mismatch:
                    reason, per_expert = str(mismatch), None
                if per_expert is None:
                    msg = f"{name}: {family}: fused experts {source_name} cannot be quantized: {reason}"
                    raise ValueError(msg) from None
                as_linears.append(source_name)
            names.update({f"{source_name}.{s}": n for s, n in per_expert.items()})
        problem = None if as_linears else expert_reload_problem(scheme)
        if problem is not None and _block_scales_broadcast(scheme, [v.weight.shape for v in views.values()]):
            problem = expert_reload_problem(_as_per_tensor(scheme))  # one block per matrix: its scale is per tensor
        if problem is not None and not experts_for_vllm(scheme):
            msg = f"{name}: {family}: fused experts {compact_names(list(sources))}: {problem}{_FOR_VLLM}"
            raise ValueError(msg)
        note = _expert_activations_note(scheme, all_experts=self.calibrate_all_experts, as_linears=bool(as_linears))
        if problem is not None:  # written per expert as vLLM reads them, and said so
            from transformers import __version__ as transformers_version  # optional third-party: transformers

            vllm = (
                f"their expert matrices are quantized and saved per expert, in the layout vLLM reads; transformers "
                f"{transformers_version} will not reload this checkpoint into its fused experts: {problem}"
            )
            note = vllm if note is None else f"{vllm}; {note}"
        if note is not None and not self._experts_warned:  # once: oneshot's and explain's checks, or initialize
            self._experts_warned = True
            logger.warning("%s: %s: fused experts %s: %s", name, family, compact_names(list(sources)), note)
        return names

    def _experts_scheme(self, views: Mapping[str, nn.Module]) -> QuantizationScheme | None:
        """The one scheme of the expert matrices ``views`` (names of targets): their config group's, or ``None`` when
        they fall in several groups of different schemes (transformers reloads every expert with one scheme)."""
        schemes = {self._group(n): self._groups[self._group(n)] for n in views}
        if len({s.model_dump_json(exclude={"targets"}) for s in schemes.values()}) > 1:
            return None
        return next(iter(schemes.values()))

    def _experts_scheme_refusal(self, model: nn.Module) -> str | None:
        """:meth:`_check_views`' refusal of the scheme for ``model``'s fused experts (all of them), if it has any and
        their config group's scheme is one they cannot take; else ``None`` (also when the experts fall in several
        groups: :meth:`_check_views` says so)."""
        fused = _fused_experts(model)
        if not fused:
            return None
        views = {f"{n}.{s}": v for n, m in fused.items() for s, v in weight_views(m).items()}
        in_groups = {n: v for n, v in views.items() if len(self._groups) == 1 or n in self._group_of}
        scheme = self._experts_scheme(in_groups) if in_groups else None
        if scheme is None:
            return None
        if any(reloads_as_linears(m) for m in fused.values()):
            return None
        problem = expert_reload_problem(scheme)
        if problem is None or experts_for_vllm(scheme):
            return None
        family = model_family(model)
        return f"{type(self).__name__}: {family}: fused experts {compact_names(list(fused))}: {problem}{_FOR_VLLM}"

    def _check_kv_cache(self, model: nn.Module) -> dict[str, nn.Module]:
        """The attention modules whose KV cache ``kv_cache_scheme`` quantizes.

        Raises:
            ValueError: no attention module with a cache argument
                (:func:`llmc_fsm_quantization.kv_cache.attention_modules`; the line names the model and its attention
                classes: :func:`llmc_fsm_quantization.kv_cache.no_kv_attention_reason`),
                per-head scales and an attention whose number of key/value (or query) heads is unknown, attention
                quantization on a model whose attention implementation compressed-tensors cannot hook
                (:func:`llmc_fsm_quantization.kv_cache.hooked_attention_refusal`: ``eager``), or a
                ``torch.distributed`` run (the key and value ranges are not combined over ranks). (``low_memory`` is
                refused before, see :meth:`streaming_refusal`.)
        """
        name = type(self).__name__
        attention = kv_cache.attention_modules(model)
        if self.attention_scheme is not None:  # attention quantization: the modules its config group targets
            attention = self._attention_targets(model, attention)
            refusal = kv_cache.hooked_attention_refusal(model)
            if refusal is not None:
                raise ValueError(f"{name}: {refusal}")
        if not attention:
            raise ValueError(f"{name}: kv_cache_scheme: {kv_cache.no_kv_attention_reason(model)}")
        if self._kv_args.strategy == QuantizationStrategy.ATTN_HEAD:
            unknown = [n for n, m in attention.items() if kv_cache.kv_heads(m) is None]
            if unknown:
                msg = (
                    f"{name}: kv_cache_scheme strategy attn_head: the number of key/value heads of {unknown[0]} is "
                    "unknown (no head_dim dividing k_proj's width, or a fused qkv_proj that does not fit its config); "
                    "use strategy: tensor"
                )
                raise ValueError(msg)
            unknown = [n for n, m in attention.items() if kv_cache.query_heads(m) is None]
            if self.attention_scheme is not None and unknown:
                msg = (
                    f"{name}: attention quantization strategy attn_head: the number of query heads of {unknown[0]} "
                    "is unknown (no head_dim dividing q_proj's width, or a fused qkv_proj that does not fit its "
                    "config); use strategy: tensor"
                )
                raise ValueError(msg)
        return attention

    def _attention_targets(self, model: nn.Module, attention: dict[str, nn.Module]) -> dict[str, nn.Module]:
        """The attention modules (of ``attention``) the attention-quantization group targets.

        Raises:
            ValueError: its targets select a module that is not an attention with ``k_proj``, ``v_proj`` and a cache
                argument, or none at all.
        """
        from compressed_tensors.utils.match import match_named_modules

        targets = list(self.attention_scheme.targets)
        selected = dict(match_named_modules(model, targets, self.ignore))
        others = [n for n in selected if n not in attention]
        if others or not selected:
            found = f"selects {compact_names(others)}, which" if others else "selects no module, and"
            msg = (
                f"{type(self).__name__}: attention quantization targets {targets} {found} is not an attention module "
                f"with k_proj, v_proj and a cache argument ({', '.join(kv_cache.CACHE_ARGUMENTS)}); target the "
                f"attention class, e.g. {next((type(m).__name__ for m in attention.values()), 'LlamaAttention')}"
            )
            raise ValueError(msg)
        return selected

    def check_stage(self, model: nn.Module, selected: list[tuple[Any, dict[str, Any]]]) -> None:
        """One-shot's check of a stage before any work (after every modifier's :meth:`check_model`): refuse two
        modifiers of the stage that quantize the KV cache of one attention module with different schemes
        (:meth:`check_recipe`, the modifiers named by class). ``selected``: ``(modifier, modules its check_model
        selected)`` for each modifier of the stage, in recipe order.

        Raises:
            ValueError: as :meth:`check_recipe`.
        """
        modifiers = [modifier for modifier, _ in selected]
        names = [type(m).__name__ for m in modifiers]
        labels = [n if names.count(n) == 1 else f"{n} (modifier {i + 1} of its stage)" for i, n in enumerate(names)]
        self.check_recipe(model, list(zip(labels, modifiers, strict=True)))

    def check_recipe(self, model: nn.Module, modifiers: list[tuple[str, Any]]) -> None:
        """Refuse, before any work, two modifiers that quantize the KV cache of one attention module with different
        schemes (``kv_cache_scheme`` or attention quantization, their strategy or observer). Found by a tester:
        different strategies failed on the scales' shape after the work, a different observer (or a later stage's
        scheme) was dropped without a word while the saved recipe said it was applied. The same scheme given twice
        is accepted (the first calibrates the scales, the second keeps them). ``modifiers``: ``(label, modifier)``
        in recipe order, each checked already (:meth:`check_model`); those without a KV-cache scheme are skipped.

        Raises:
            ValueError: naming both modifiers, an attention module and both schemes.
        """
        seen: dict[str, tuple[str, str]] = {}  # attention module -> (label, its scheme) of the first modifier
        for label, modifier in modifiers:
            args = getattr(modifier, "kv_cache_args", None)
            if args is None or not isinstance(getattr(modifier, "_kv_attention", None), dict):
                continue
            attention = getattr(modifier, "attention_scheme", None) is not None
            scheme = f"{'attention quantization' if attention else 'kv_cache_scheme'} {kv_cache.describe(args)}"
            clash = next((n for n in modifier._kv_attention if n in seen and seen[n][1] != scheme), None)
            if clash is not None:
                first, held = seen[clash]
                fix = "give the scheme in one of them (or the same in both)"
                if held.startswith("attention") != attention:  # the same arguments may differ only in this
                    fix = (
                        "attention quantization quantizes the attention's keys and values too: leave kv_cache_scheme "
                        "out of the recipe"
                    )
                msg = (
                    f"{first} and {label} both quantize the KV cache of {clash}, with {held} and {scheme}: an "
                    f"attention's KV cache is quantized once; {fix}"
                )
                raise ValueError(msg)
            for name in modifier._kv_attention:
                seen.setdefault(name, (label, scheme))

    # ---- fused experts: each expert matrix from its routed tokens --------------------------
    def _clear(self) -> None:
        super()._clear()
        self._tied_model: nn.Module | None = None
        self._expert_names: dict[str, str] = {}
        self._fused: dict[str, tuple[str, ...]] = {}
        #: ``{fused set: its NVFP4 global scale}``, computed when the first of the set is quantized.
        self._shared_global_scales: dict[tuple[str, ...], torch.Tensor] = {}
        #: ``{expert matrix name: calibration tokens the router sent to that expert}``, filled when it is quantized.
        self.routed_tokens: dict[str, int] = {}
        #: expert matrices the router sent no calibration token, quantized by round-to-nearest (no Hessian / no
        #: input statistics), in order.
        self.round_to_nearest_fallback: list[str] = []

    @property
    def _experts_from_data(self) -> bool:
        """Whether the expert matrices' quantization depends on their calibration inputs: GPTQ's Hessians, an
        importance (imatrix, optimized round-to-nearest), calibrated input scales (not: weight-only round-to-nearest,
        whose data only calibrates a KV cache)."""
        return type(self).needs_inputs or self.needs_importance or self.calibrated_inputs

    def _observe_views(self, model: nn.Module) -> None:
        """Feed every targeted expert matrix its inputs (:func:`~llmc_fsm.toolkit.views.observe_view_inputs`); with
        calibrated input scales one observation per calibration sample (the experts module sees the batch's tokens
        flattened), so that the ranges do not depend on the batch size, as a Linear's do not."""
        observe_view_inputs(
            self.register_hook,
            self._targets,
            self.results,
            all_experts=self.calibrate_all_experts,
            model=model if self.calibrated_inputs else None,
            owner=type(self).__name__ if self._experts_from_data else None,
        )

    def follow_expert_drop(self, model: nn.Module, name: str, kept: list[int]) -> dict[str, str | None]:
        """:meth:`CalibratedModifier.follow_expert_drop`; the renamed expert matrices keep their config group and
        NVFP4 fused siblings, and take the checkpoint names of their new index (read again from the pruned module:
        :func:`~llmc_fsm.toolkit.expert_checkpoint_names`)."""
        renames = super().follow_expert_drop(model, name, kept)

        def kept_names(names: Mapping[str, Any]) -> dict[str, Any]:
            return {renames.get(n, n): v for n, v in names.items() if renames.get(n, n) is not None}

        self._group_of = kept_names(self._group_of)
        self._fused = {n: tuple(renames.get(m, m) for m in members) for n, members in kept_names(self._fused).items()}
        if any(n in renames for n in self._expert_names):
            experts = model.get_submodule(name)
            if reloads_as_linears(experts):  # Llama 4's (transformers reloads them as one Linear per matrix)
                per_expert = linear_expert_names(model, name, experts) or {}
            else:
                per_expert = expert_checkpoint_names(model, name, experts)
            self._expert_names = {n: c for n, c in self._expert_names.items() if not n.startswith(name + ".")}
            self._expert_names.update({f"{name}.{s}": c for s, c in per_expert.items()})
        return renames

    def _record_routed(self) -> None:
        """Copy the routed-token counts of the expert matrices quantized since the last call, summed over the ranks
        under ``torch.distributed`` (each rank's view counts the tokens of its own share of the data)."""
        new = [
            (name, view)
            for name, view in self._targets.items()
            if isinstance(view, LinearView)
            and view.expert is not None
            and name in self.results
            and name not in self.routed_tokens
            and (self.needs_inputs or self.results[name].samples)  # data-free RTN: no routing to count
        ]
        if not new:  # the same on every rank (the results are computed from the summed statistics): no collective
            return
        counts = torch.tensor([view.routed_tokens for _, view in new], dtype=torch.int64)
        all_reduce_tensor(counts, what="all_reduce (routed tokens)")  # every rank: the same names, in one order
        self.routed_tokens.update(zip((name for name, _ in new), counts.tolist(), strict=True))

    def _compress_all(self, modules: dict[str, nn.Module], *, trim: bool = False, reduced: bool = False) -> None:
        """:meth:`CalibratedModifier._compress_all`; an expert matrix that received no calibration input (the router
        sent its expert no token on any rank, without ``calibrate_all_experts``) is quantized by round-to-nearest with
        the scheme's observer (``minmax`` for ``imatrix_mse``): a layer's experts are reloaded from packed weights
        only, so none is left dense; a static input scale it takes from its calibrated siblings
        (:meth:`_idle_input_scales`).
        Named in a warning and in :attr:`round_to_nearest_fallback`. An ``nn.Embedding`` target is quantized without
        inputs (:attr:`targets_without_inputs`). A targeted head tied to the embedding is untied first
        (:meth:`_untie_head`)."""
        self._untie_head()
        if not reduced:  # which experts received tokens is read from the statistics of every rank
            self._sum_over_ranks(modules)
        idle: dict[str, nn.Module] = {}
        if self.needs_inputs:
            embeddings = [(n, m) for n, m in modules.items() if isinstance(m, nn.Embedding)]
            idle = {
                name: module
                for name, module in modules.items()
                if isinstance(module, LinearView)
                and module.expert is not None
                and getattr(self._acc.get(name), "num_samples", 0) == 0
            }
            if idle:
                logger.warning(
                    "%s: the router sent no calibration token to %d expert matrices: %s; quantized by round-to-"
                    "nearest (no input statistics; set calibrate_all_experts: true to calibrate them on every token)%s",
                    type(self).__name__,
                    len(idle),
                    compact_names(list(idle)),
                    "; their static input scale: the largest of the same projection's calibrated experts"
                    if any(_static_inputs(self.scheme_of(name)) for name in idle)
                    else "; their NVFP4 input global scale: the smallest of the same projection's calibrated experts"
                    if any(is_local(self.scheme_of(name).input_activations) for name in idle)
                    else "",
                )
            for members in (embeddings, list(idle.items())):  # quantized without inputs
                if members:
                    for name, _ in members:
                        self._acc.pop(name, None)
                    self._compress_members(None, members)
            self.round_to_nearest_fallback.extend(idle)
            done = {name for name, _ in embeddings} | set(idle)
            if is_distributed() and self.shares_work_across_ranks:
                self.compressed_on_every_rank.extend(name for name in modules if name in done)
            modules = {name: module for name, module in modules.items() if name not in done}
        super()._compress_all(modules, trim=trim, reduced=True)
        self._idle_input_scales(idle)
        sources = {id(m.source): m.source for m in [*modules.values(), *idle.values()] if isinstance(m, LinearView)}
        for source in sources.values():  # Llama 4: compute as transformers' reloaded Linear experts do
            quantize_expert_inputs(source)

    def _idle_input_scales(self, idle: dict[str, LinearView]) -> None:
        """Input scales of expert matrices the router sent no calibration token: a static ``input_scale`` is the
        largest of its experts module's calibrated matrices of the same projection (``gate_proj``, ``up_proj`` or
        ``down_proj``), the value vLLM applies to every expert of the layer anyway (it keeps one input scale per
        fused projection, the maximum over the experts); an NVFP4 ``input_global_scale`` (``448 * 6 / max|x|``) is
        the smallest of theirs, the same largest input range (found by a tester: it raised AttributeError).

        Raises:
            ValueError: no matrix of that projection in the experts module has a calibrated scale.
        """
        for name, view in idle.items():
            scheme = self.scheme_of(name)
            if _static_inputs(scheme):
                key, pick = "input_scale", torch.amax
            elif is_local(scheme.input_activations):
                key, pick = "input_global_scale", torch.amin
            else:
                continue
            kind = name.rsplit(".", 1)[1]
            scales = [
                sibling.quantized_params[key]
                for suffix, sibling in weight_views(view.source).items()
                if suffix.rsplit(".", 1)[1] == kind and key in getattr(sibling, "quantized_params", {})
            ]
            if not scales:
                what = "static input scale" if key == "input_scale" else "NVFP4 input global scale"
                msg = (
                    f"{type(self).__name__}: no expert of {name.rsplit('.', 2)[0]} received a calibration token, so "
                    f"no {what} of {kind} can be calibrated; give more calibration data or set "
                    "calibrate_all_experts: true"
                )
                raise ValueError(msg)
            view.quantized_params[key] = pick(torch.stack(scales), dim=0)
            if is_scaled_format(scheme.weights):  # packed when quantized (NVFP4): packed again with the scale
                _view_as_reloaded(view, scheme)

    # ---- KV cache: calibrated alongside the weights ---------------------------------------
    def on_initialize(self, state: Any) -> None:
        self._kv_attention = {}
        super().on_initialize(state)
        head = tied_head(state.model)
        #: the model whose tied head is a target: untied before anything is compressed (:meth:`_untie_head`)
        self._tied_model = state.model if head is not None and any(m is head for m in self._targets.values()) else None

    def _untie_head(self) -> None:
        """Untie the targeted output head from the input embedding (:func:`llmc_fsm.toolkit.targets.untie_head`), once,
        before its first hook or compression: the embedding keeps its weight, the head gets a copy to quantize, and
        the saved config says ``tie_word_embeddings: false`` (llm-compressor's quantizers do the same)."""
        model, self._tied_model = self._tied_model, None
        if model is not None and untie_head(model):
            both = any(m is model.get_input_embeddings() for m in self._targets.values())
            logger.warning(  # shown by the command: the checkpoint then holds the head apart from the embedding
                "%s: the head %s is tied to the input embedding: untied (its own copy of the weight; config "
                "tie_word_embeddings false) so that %s (as llm-compressor)",
                type(self).__name__,
                compact_names([n for n, m in self._targets.items() if m is model.get_output_embeddings()]),
                "each of them is quantized on its own" if both else "quantizing it leaves the embedding as it is",
            )

    def on_finalize(self, state: Any) -> None:
        """:meth:`CalibratedModifier.on_finalize`; a model with quantized modules is then marked quantized as
        transformers marks one it loads quantized (:func:`mark_quantized`)."""
        super().on_finalize(state)
        if self.results:
            mark_quantized(state.model)

    def on_calibration_start(self, state: Any) -> None:
        """Untie a targeted head (:meth:`_untie_head`). Hook the targets (:class:`CalibratedModifier`); with
        ``kv_cache_scheme`` also prepare every attention
        module (:func:`llmc_fsm_quantization.kv_cache.install`) and give each of its ancestors a forward hook that
        does nothing, so that the pipeline runs each layer whole (no early exit before the attention's cache
        update; its plain order: calibrate, compress, then propagate with the KV quantization off). Fused
        experts targeted: a forward pre-hook on each experts module feeds every expert matrix its routed tokens
        (:func:`~llmc_fsm.toolkit.views.observe_inputs`; every token with ``calibrate_all_experts``)."""
        self._untie_head()
        super().on_calibration_start(state)
        self._observe_views(state.model)
        self._warn_averaged_ranges()
        if self._kv_args is None:
            return
        names = dict.fromkeys(n.rpartition(".")[0] for n in self._kv_attention)
        ancestors = {p for n in names for p in _prefixes(n)}
        for name, module in state.model.named_modules():
            if name in ancestors:
                self.register_hook(module, _observed_whole, kind="forward")
        for module in self._kv_attention.values():
            kv_cache.install(module, self._kv_args)
            if self.attention_scheme is not None:
                kv_cache.install_query(state.model, module, self.attention_scheme)

    def _warn_averaged_ranges(self) -> None:
        """Under ``torch.distributed``, one line when a calibrated input scale comes from an observer whose value
        depends on the order of the observations (``minmax``'s and ``mse``'s moving averages, the ``memoryless_``
        ones' last): each rank keeps its own and :meth:`CalibrationStatistics.all_reduce` takes their mean, as
        llm-compressor does, so the scales differ from one process's (a tester measured up to 18% on a tiny Llama's
        FP8 static input scales); ``static_minmax`` gives one process's exactly."""
        if not is_distributed():
            return
        observers = sorted(
            {
                scheme.input_activations.observer or ACTIVATION_OBSERVER
                for scheme in self._groups.values()
                if scheme.input_activations is not None
                and getattr(scheme.input_activations.dynamic, "value", scheme.input_activations.dynamic)
                in (False, "local")
            }
            - {"static_minmax"}
        )
        if observers:
            logger.warning(
                "%s: under torch.distributed the input ranges of observer %s are each rank's (a moving average or "
                "the last observation, over that rank's samples), averaged over the ranks as llm-compressor does: the "
                "static input scales differ from one process's; observer: static_minmax gives one process's exactly",
                type(self).__name__,
                " / ".join(observers),
            )

    def on_sequential_epoch_end(self, state: Any, modules: Any) -> None:
        super().on_sequential_epoch_end(state, modules)
        self._record_routed()
        if self._kv_args is None:
            return
        roots = [modules] if isinstance(modules, nn.Module) else list(modules)
        inside = {id(sub) for root in roots for sub in root.modules()}
        self._set_kv_scales({n: m for n, m in self._kv_attention.items() if id(m) in inside}, final=False)

    def on_calibration_end(self, state: Any) -> None:
        super().on_calibration_end(state)
        self._record_routed()
        if self._kv_args is not None:
            self._set_kv_scales(self._kv_attention, final=True)
            per = "per key/value head" if self._kv_args.strategy == QuantizationStrategy.ATTN_HEAD else "per tensor"
            logger.info(
                "%s: calibrated FP8 %s (%s, observer %s) of %d attention modules%s",
                type(self).__name__,
                "q_scale / k_scale / v_scale" if self.attention_scheme is not None else "k_scale / v_scale",
                per,
                self._kv_args.observer,
                len(self._kv_attention),
                "; no weight scheme: no weight quantized" if self.kv_only else "",
            )

    def _set_kv_scales(self, attention: dict[str, nn.Module], *, final: bool) -> None:
        """Calibrate ``attention``'s KV scales from what they observed (those that observed nothing wait, unless
        ``final``).

        Raises:
            ValueError: an attention's keys, values (or queries) reached NaN or Inf on the calibration tokens (its
                scales would be NaN); (``final``) an attention never handed keys and values to its cache argument on
                the calibration tokens, so its scales cannot be observed.
        """
        for module in attention.values():  # under torch.distributed: every rank's samples, in the windows' order
            kv_cache.gather_over_ranks(module)
        broken = {name: bases for name, m in attention.items() if (bases := kv_cache.nonfinite_states(m))}
        if broken:
            states = {"k": "keys", "v": "values", "q": "queries"}
            what = " and ".join(states[b] for b in states if any(b in bases for bases in broken.values()))
            msg = (
                f"{type(self).__name__}: kv_cache_scheme: the {what} of {compact_names(list(broken))} hold NaN or Inf "
                "values on the calibration tokens, so their KV scales cannot be calibrated: the checkpoint (or an "
                "earlier change to the model) is broken there or before (a k_proj / v_proj weight, or an earlier "
                "layer)"
            )
            raise ValueError(msg)
        missing = [name for name, module in attention.items() if not kv_cache.set_scales(module)]
        if missing and final:
            msg = (
                f"{type(self).__name__}: kv_cache_scheme: {compact_names(missing)} never handed keys and values to "
                "its cache argument (cache.update) on the calibration tokens; its KV scales cannot be calibrated"
            )
            raise ValueError(msg)

    def _check_weights_not_on_attention(self, model: nn.Module) -> None:
        """Refuse a config group with weights whose target names an attention module itself and none of its
        children (its class, e.g. ``LlamaAttention``, or ``re:.*self_attn$``: compressed-tensors' ``is_narrow_match``,
        by which it applies a scheme to the attention module): compressed-tensors 0.20 refuses weight quantization on
        an attention module (llm-compressor 0.14 fails so), and selecting its Linear children instead quantized
        q/k/v/o_proj with the group's scheme without a word (found by a tester). ``re:.*self_attn.*`` matches the
        projections too: a Linear target as in llm-compressor. A group of input activations only on attention modules
        is attention quantization (:meth:`_split_attention`).

        Raises:
            ValueError: naming the group, the pattern, the module and the two ways to write it.
        """
        attention = kv_cache.attention_modules(model)
        for group, scheme in self._groups.items():
            if scheme.weights is None:
                continue
            for pattern in scheme.targets:
                hit = next((n for n, m in attention.items() if is_narrow_match(model, pattern, n, m)), None)
                if hit is not None:
                    where = f"config group {group!r}" if self.config_groups is not None else "the scheme"
                    msg = (
                        f"{type(self).__name__}: {where} targets {pattern!r}, which names the attention module {hit} "
                        "itself, with weights: compressed-tensors (and llm-compressor 0.14) cannot apply weight "
                        "quantization to an attention module; target its projections (e.g. "
                        "'re:.*self_attn.(q|k|v|o)_proj$'), or give the group input_activations only (attention "
                        "quantization: queries, keys and values)"
                    )
                    raise ValueError(msg)

    def _memberships(self, model: nn.Module) -> tuple[dict[str, str], list[str]]:
        """``{module name: config group}`` of every module a group selects (``{}`` with one group), and the lines
        that say which group took the modules several select (pure).

        A module that several groups select takes the group of its first matching target in compressed-tensors'
        order, as its ``apply_quantization_config`` gives it (:func:`~llmc_fsm.toolkit.match_precedence`: an
        exact name, then ``re:`` patterns in string order, then class names; a parameter name, a container or
        ``__ALL__`` does not count), so "``Linear`` at int4 plus ``re:.*q_proj$`` at int8" quantizes the ``q_proj``
        at int8, as in llm-compressor; one line per pair of groups and winning target says which took what
        (:meth:`check_model` logs them once).

        Raises:
            ValueError: a group selects nothing, or nothing once the other groups took their modules
                (llm-compressor runs such a recipe with the group unused); or two groups select a module only through
                parameter names or containers (compressed-tensors would quantize it with neither).
        """
        if len(self._groups) == 1:
            return {}, []
        selecting: dict[str, list[str]] = {}
        modules: dict[str, nn.Module] = {}
        for group, scheme in self._groups.items():
            try:
                selected = select_targets(
                    model, scheme.targets, self.ignore, supported=self._selectable, views=self.compresses_views
                ).selected
            except ValueError as exc:
                raise ValueError(f"{type(self).__name__}: config group {group!r}: {exc}") from None
            for name, module in selected.items():
                selecting.setdefault(name, []).append(group)
                modules[name] = module
        owner: dict[str, str] = {}
        taken: dict[tuple[str, str], dict[str, list[str]]] = {}  # (winner, loser) -> {winning target: names}
        for name, groups in selecting.items():
            if len(groups) == 1:
                owner[name] = groups[0]
                continue
            patterns = [t for g in groups for t in self._groups[g].targets]
            ranked = [
                (t, g)
                for t in _named_directly(name, modules[name], patterns)
                for g in groups
                if t in self._groups[g].targets
            ]
            owner[name] = self._most_specific(name, groups, ranked)
            for group in groups:
                if group != owner[name]:
                    taken.setdefault((owner[name], group), {}).setdefault(ranked[0][0], []).append(name)
        empty = [group for group in self._groups if group not in owner.values()]
        if empty:
            group = empty[0]
            winners = sorted({w for (w, loser) in taken if loser == group})
            msg = (
                f"{type(self).__name__}: config group {group!r} quantizes no module: each module its targets "
                f"{list(self._groups[group].targets)} select goes to config group {', '.join(map(repr, winners))}, "
                f"whose target comes first in {_ORDER[:-1]}; a parameter name, a container or __ALL__ does not "
                "count), and llm-compressor would run with the group unused: remove the group or change the targets"
            )
            raise ValueError(msg)
        lines = [
            f"{type(self).__name__}: config groups {winner!r} and {loser!r} both select {compact_names(names)}: "
            f"they take {winner!r}, whose target {target!r} comes first in {_ORDER}"
            for (winner, loser), by_target in taken.items()
            for target, names in by_target.items()
        ]
        return owner, lines

    def _most_specific(self, name: str, groups: list[str], ranked: list[tuple[str, str]]) -> str:
        """The group of ``ranked``'s first target (``[(target, group)]`` in compressed-tensors' order) for module
        ``name``, which ``groups`` select.

        Raises:
            ValueError: no target names the module itself.
        """
        kind = type(self).__name__
        if not ranked:
            msg = (
                f"{kind}: module {name} is selected by config groups {', '.join(map(repr, groups))} only through "
                "parameter names or containers their targets name, which compressed-tensors does not match: a module "
                "is quantized with one scheme: name it (or its class) in one group's targets"
            )
            raise ValueError(msg)
        return ranked[0][1]  # one target string is in one group only (resolve_config_groups)

    def explain_model(self, model: nn.Module, stage: Sequence[Any] = ()) -> list[str]:
        """With several config groups, the modules each takes in ``model`` and which group took the modules several
        select (``llmc-fsm explain --model``; :meth:`_memberships`; ``stage`` unused); ``[]`` with one group. Pure.

        Raises:
            ValueError: as :meth:`_memberships`.
        """
        if len(self._groups) < 2:
            return []
        owner, lines = self._memberships(model)
        found = []
        for group, scheme in self._groups.items():
            names = [name for name, g in owner.items() if g == group]
            found.append(
                f"config group {group!r} ({scheme_label(scheme)}): {len(names)} modules, {compact_names(names)}"
            )
        return found + [line.split(": ", 1)[1] for line in lines]

    def _selectable(self, module: nn.Module) -> bool:
        """Linear-like modules, and ``nn.Embedding`` (weight-only round-to-nearest; see :meth:`_embedding_problem`)."""
        return is_linear_like(module) or isinstance(module, nn.Embedding)

    def _embedding_problem(self, name: str) -> str | None:
        """Why the ``nn.Embedding`` target ``name`` cannot be quantized by this modifier, or ``None``.

        An embedding's weight ``[vocab, hidden]`` is quantized data-free by round-to-nearest, weight only, with an
        int scheme (saved ``int-quantized``: transformers 5.24 cannot reload a packed embedding, see
        :func:`llmc_fsm.output.compressed.unpacked_embeddings`) or FP8 per channel / tensor; its inputs are token
        ids, so nothing that needs calibration inputs applies to it. In a modifier that calibrates its other
        targets it is quantized at ``calibration_end`` (:meth:`_compress_all`), so the decoder layers calibrate on
        the float embedding's output; GPTQ then rounds it to nearest too, as llm-compressor's GPTQ leaves an
        Embedding to its observer (the Hessian of one-hot inputs is diagonal: GPTQ's error feedback would have
        nothing to act on).
        """
        scheme = self.scheme_of(name)
        args = weight_args(scheme)
        if scheme.input_activations is not None or scheme.output_activations is not None:
            return "an Embedding's inputs are token ids: quantize its weight only (e.g. W8A16, W4A16)"
        kind = str(getattr(args.type, "value", args.type))
        if is_scaled_format(args) or not (kind == "int" or (kind == "float" and args.num_bits == 8)):
            return "an Embedding is quantized with int weights or FP8 per channel / tensor only (not NVFP4, MX, block)"
        return None

    def inputless_targets(self, targets: Mapping[str, nn.Module]) -> frozenset[str]:
        """The ``nn.Embedding`` targets: quantized data-free at ``calibration_end`` (:meth:`_embedding_problem`)."""
        return frozenset(n for n, m in targets.items() if isinstance(m, nn.Embedding))

    def _make_hook(self, name: str) -> Any:
        """:meth:`CalibratedModifier._make_hook`; an ``nn.Embedding`` target (its inputs are token ids) collects
        nothing and is quantized data-free."""
        if isinstance(self._targets.get(name), nn.Embedding):
            return _no_statistics
        return super()._make_hook(name)

    def _check_target(self, name: str, module: nn.Module) -> str | None:
        if isinstance(module, nn.Embedding):
            problem = self._embedding_problem(name)
        else:
            problem = super()._check_target(name, module)
        if problem is not None:
            return problem
        args = weight_args(self.scheme_of(name))
        a = self.scheme_of(name).input_activations
        if (
            a is not None
            and a.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP)
            and (module.weight.shape[1] % a.group_size)
        ):
            width = module.weight.shape[1]
            return f"in_features {width} is not a multiple of the input activations' group_size {a.group_size}"
        if is_scaled_format(args) and args.scale_dtype is not None and module.weight.dtype != torch.bfloat16:
            return (
                f"{module.weight.dtype} weight: NVFP4 / MX checkpoints decompress to bfloat16 on load (compressed-"
                "tensors 0.20), and transformers then cannot run the reloaded model (bfloat16 weights against "
                f"{module.weight.dtype} inputs); load the model in bfloat16 (CLI: --dtype bfloat16; "
                "oneshot(MODEL_DIR, dtype='bfloat16'); a model you loaded: model.to(torch.bfloat16))"
            )
        if args.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP) and (
            module.weight.shape[1] % args.group_size
        ):
            return f"in_features {module.weight.shape[1]} is not a multiple of group_size {args.group_size}"
        return None

    # ---- work -----------------------------------------------------------------------
    def _quantize(self, modules: list[nn.Module], accumulator: Any, args: QuantizationArgs) -> list[QuantizedWeight]:
        """Quantized weights of ``modules`` (one config group's, sharing ``accumulator``) for weight ``args``."""
        raise NotImplementedError

    def _compress_group(self, modules: list[nn.Module], accumulator: Any) -> list[torch.Tensor] | CompressedGroup:
        by_group: dict[str, list[int]] = {}
        for i, module in enumerate(modules):
            by_group.setdefault(self._group(self._names_by_id.get(id(module), "")), []).append(i)
        quantized: list[QuantizedWeight | None] = [None] * len(modules)
        for group, members in by_group.items():
            scheme = self._groups[group]
            args = scheme.weights
            if accumulator is None and args.observer in IMPORTANCE_OBSERVERS:  # an expert without routed tokens
                args = args.model_copy(update={"observer": DEFAULT_OBSERVER})
            results = self._quantize([modules[i] for i in members], accumulator, args)
            if args is not scheme.weights and all(isinstance(modules[i], nn.Embedding) for i in members):
                logger.warning(
                    "%s: %s: %s weights the error by the calibration inputs' importance, which an Embedding's "
                    "token-id inputs do not give: rounded with %s (so recorded in the saved config)",
                    type(self).__name__,
                    compact_names([self._names_by_id.get(id(modules[i]), "") for i in members]),
                    scheme.weights.observer,
                    args.observer,
                )
                scheme = scheme.model_copy(update={"weights": args})  # the observer used, as the config records it
            for i, q in zip(members, results, strict=True):
                if _static_inputs(scheme):
                    if accumulator is not None:  # else an expert without routed tokens: see _compress_all
                        q.input_scale, q.input_zero_point = _input_qparams(scheme, accumulator)
                elif is_local(scheme.input_activations) and accumulator is not None:  # else: see _compress_all
                    q.input_global_scale = _input_global_scale(scheme, accumulator)
                quantized[i] = q
                if isinstance(modules[i], LinearView):
                    _attach_view_qparams(modules[i], scheme.model_copy(deep=True), q)
                    modules[i].checkpoint_name = self._expert_names[self._names_by_id[id(modules[i])]]
                else:
                    attach_qparams(modules[i], scheme.model_copy(deep=True), q)
        weights = [module.weight for module in modules]  # attach_qparams wrote q.weight there: no second copy
        if self.measures_output_error:
            return CompressedGroup(weights, [q.rel_output_error for q in quantized])
        return weights

    #: GPTQ's joint sweep of a group (q/k/v) is not split: a sweep of fewer rows rounds differently, and rounding to
    #: the grid turns that into a whole step on some weights.
    splits_groups_across_ranks = False

    @property
    def shares_work_across_ranks(self) -> bool:  # type: ignore[override]
        """Under torch.distributed ranks share the sweeps when every scheme's compression only attaches its
        parameters (no NVFP4 / MX / FP8-block reload, no calibrated static input scale)."""
        return all(
            not is_scaled_format(s.weights) and (s.input_activations is None or s.input_activations.dynamic)
            for s in self._groups.values()
            if s.weights is not None
        )

    def _shares_module(self, module: nn.Module) -> bool:
        """A fused expert's matrix (a :class:`~llmc_fsm.toolkit.views.LinearView`) is quantized on every rank: its
        quantization parameters live on the view, which no broadcast of module tensors reaches."""
        return not isinstance(module, LinearView)

    def _prepare_to_receive(self, modules: list[tuple[str, nn.Module]]) -> None:
        for name, module in modules:  # the parameters attach_qparams fills on the compressing rank
            initialize_module_for_quantization(
                module, self._groups[self._group(name)].model_copy(deep=True), force_zero_point=True
            )

    def _after_receive(self, modules: list[tuple[str, nn.Module]]) -> None:
        for _, module in modules:
            module.quantization_status = QuantizationStatus.FROZEN

    def _result_extras(self, module: nn.Module) -> dict[str, Any]:
        scheme = self.scheme_of(self._names_by_id.get(id(module), ""))
        args = weight_args(scheme)
        return {
            "label": scheme_label(scheme),
            "bits": int(args.num_bits),
            "group_size": (
                int(args.group_size)
                if args.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP)
                else None
            ),
        }
