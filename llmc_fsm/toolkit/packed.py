"""A quantized module's tensors in its checkpoint: which compressed-tensors formats its weights can be written in,
and packed tensors kept for the save.

* :func:`weight_formats` / :func:`format_problem` — the formats a scheme's weights can be saved in (a recipe's
  config group ``format``, ``quantization_format`` of the save), checked before anything is quantized or written.
* :func:`keep_packed` / :func:`kept_packed` — a quantizer that already had compressed-tensors' compressor pack a
  module (NVFP4 / MX / FP8-block weights are packed when they are quantized, so the module holds exactly the values
  its checkpoint reloads to) keeps them with :func:`keep_packed`; the save writes them after :func:`kept_packed`
  checks they still describe the module, instead of rounding the weight again."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmc_fsm.toolkit.views import LinearView, reloads_as_linears

__all__ = [
    "PACKED_ATTR",
    "expert_reload_problem",
    "experts_for_vllm",
    "format_problem",
    "keep_packed",
    "kept_packed",
    "saved_as",
    "scheme_label",
    "weight_formats",
]


#: Attribute of a quantized module holding the tensors its compressor packed when it was quantized
#: (:func:`keep_packed`).
PACKED_ATTR = "packed_for_checkpoint"


def weight_formats(module_type: type, scheme: Any) -> list[str]:
    """The compressed-tensors formats the weights of a ``module_type`` module quantized with ``scheme`` can be saved
    in, the one compressed-tensors infers first (``infer_module_format``, the scheme's own ``format`` left out).

    Integer weights of 1 to 8 bits: also ``pack-quantized`` (several values per int32; compressed-tensors' packer
    packs and unpacks any such weights exactly, whatever the input activations: its ``can_compress`` leaves float
    activations out only when it *infers* a format, and llm-compressor's W4A8-FP8 examples save them packed, the layout
    vLLM's W4A8-FP8 scheme reads), ``int-quantized`` and ``naive-quantized`` (one int8 per value; the two hold the same
    integers and scales), except an ``nn.Embedding``'s: ``int-quantized`` only (transformers 5.25 cannot reload a
    packed embedding). 8-bit float weights (FP8, FP8 block): ``float-quantized`` or ``naive-quantized`` (the same
    tensors: compressed-tensors' float compressor is its naive one; it infers ``naive-quantized`` for weight-only FP8).
    NVFP4 and MX weights, and a fused expert's matrix (a :class:`~llmc_fsm.toolkit.views.LinearView`: transformers'
    experts loader reads packed int weights only): only the inferred format (``nvfp4-pack-quantized``, the MX formats,
    ``pack-quantized``). ``dense`` (weights left unquantized on disk) is not offered.

    Args:
        module_type: the quantized module's class (``nn.Linear``; ``LinearView`` for a fused expert's matrix).
        scheme: its compressed-tensors ``QuantizationScheme``.
    """
    from compressed_tensors.compressors.format import infer_module_format

    bare = scheme.model_copy(update={"format": None})
    if issubclass(module_type, LinearView):  # a fused expert's matrix: transformers' experts loader reads one format
        inferred = infer_module_format(nn.Linear, bare).value  # (FP8: under either name of the one float layout)
        floats = ["float-quantized", "naive-quantized"]
        return list(dict.fromkeys([inferred, *(floats if inferred in floats else [])]))
    if issubclass(module_type, nn.Embedding) and scheme.weights is not None and str(scheme.weights.type) == "int":
        return ["int-quantized"]  # packed, transformers 5.25 cannot reload it ('Embedding' has no 'weight')
    formats = [infer_module_format(module_type, bare).value]
    weights = scheme.weights
    if weights is not None and str(weights.type) == "int":
        if 1 <= weights.num_bits <= 8:
            formats.append("pack-quantized")
        formats += ["int-quantized", "naive-quantized"]
    elif formats[0] in ("float-quantized", "naive-quantized"):  # 8-bit float weights (not NVFP4 / MX)
        formats += ["float-quantized", "naive-quantized"]
    return list(dict.fromkeys(formats))


def saved_as(module: nn.Module) -> type:
    """The class whose formats ``module``'s quantized weights can be saved in (:func:`weight_formats`): its own, but
    ``nn.Linear`` for an expert matrix of experts transformers reloads as one Linear per expert matrix (Llama 4:
    :func:`~llmc_fsm.toolkit.views.reloads_as_linears`; its fused loader's one format does not apply)."""
    if isinstance(module, LinearView) and module.expert is not None and reloads_as_linears(module.source):
        return nn.Linear
    return type(module)


def scheme_label(scheme: Any) -> str | None:
    """A short label of what a compressed-tensors ``QuantizationScheme`` does to a module, for the report: the
    weights' type and bits (``int4``, ``fp8``, ``fp4``), their grouping (``/g64`` per group or NVFP4's tensor-group,
    ``/b128x128`` per block, ``/tensor`` one scale; nothing per channel), `` asym`` for a zero point, then the input
    activations' `` a:<type><bits>`` (`` asym`` for their zero point, until 2026-12-07 left out: a tester's case;
    `` static`` for a calibrated scale) when they are quantized. E.g. W4A16 with
    group 64 ``int4/g64``, W8A8 ``int8 a:int8``, FP8_DYNAMIC ``fp8 a:fp8``, FP8 ``fp8/tensor a:fp8 static``, NVFP4
    ``fp4/g16 a:fp4`` (its input global scale is calibrated, its per-group scales are not), MXFP4A16 ``fp4/g32``
    (until 2026-12-06 the report said ``8b`` for FP8 and INT8 alike: a tester's case). ``None`` when the scheme
    quantizes no weights."""
    weights = getattr(scheme, "weights", None)
    if weights is None:
        return None
    label = _args_label(weights)
    strategy = getattr(weights.strategy, "value", weights.strategy)
    if strategy in ("group", "tensor_group"):
        label += f"/g{weights.group_size}"
    elif strategy == "block":
        label += "/b" + "x".join(str(n) for n in weights.block_structure or ())
    elif strategy == "tensor":
        label += "/tensor"
    if weights.symmetric is False:
        label += " asym"
    inputs = getattr(scheme, "input_activations", None)
    if inputs is not None:
        label += f" a:{_args_label(inputs)}" + (" asym" if inputs.symmetric is False else "")
        label += " static" if inputs.dynamic is False else ""
    return label


def _args_label(args: Any) -> str:
    """``int8`` / ``fp8`` / ``fp4``: a ``QuantizationArgs``' type and bits."""
    kind = getattr(args.type, "value", args.type)
    return f"{'fp' if kind == 'float' else kind}{args.num_bits}"


def format_problem(module_type: type, scheme: Any, fmt: Any) -> str | None:
    """Why the weights of a ``module_type`` module quantized with ``scheme`` cannot be saved in compressed-tensors
    format ``fmt`` (a ``CompressionFormat`` or its value), or ``None`` when they can (:func:`weight_formats`)."""
    fmt = getattr(fmt, "value", fmt)
    formats = weight_formats(module_type, scheme)
    if fmt in formats:
        return None
    weights = scheme.weights
    what = f"{weights.num_bits}-bit {weights.type} weights" if weights is not None else "no weights"
    if issubclass(module_type, LinearView):
        what = f"fused experts' {what} (transformers' experts loader reads no other format)"
    allowed = formats[0] if len(formats) == 1 else f"{', '.join(formats[:-1])} or {formats[-1]}"
    return f"{what} are saved {allowed}, not {fmt}"


def keep_packed(module: nn.Module, fmt: str, packed: dict[str, Any]) -> None:
    """Keep on ``module`` what compressed-tensors' compressor of format ``fmt`` (e.g. ``"nvfp4-pack-quantized"``)
    packed from it (``compress``'s state dict: ``weight_packed``, ``weight_scale``, ...), for the save to write
    instead of compressing the module again (rounding its weight again: NVFP4 / MX / FP8-block weights are packed
    when they are quantized, to give the module the values its checkpoint reloads to). :func:`kept_packed` checks
    that they still describe the module before they are used."""
    setattr(module, PACKED_ATTR, (fmt, packed))


def kept_packed(module: nn.Module, fmt: str, local: dict[str, Any]) -> dict[str, Any] | None:
    """The tensors :func:`keep_packed` kept on ``module`` if they are what compressing it now in format ``fmt``
    would give, else ``None`` (nothing kept, another format, or the module changed since).

    ``local``: the module's own state dict (``weight``, ``weight_scale``, ...). They are current when decompressing
    them gives ``local["weight"]`` bit for bit and the other tensors decompressing gives back (scales, global
    scale) equal ``local``'s (compared in ``local``'s dtype); compressing ``local`` then gives them again (the
    compressor's rounding maps its own decompressed values back to the same codes; a tensor the compressor drops,
    such as a symmetric scheme's zero point, is dropped either way)."""
    kept = getattr(module, PACKED_ATTR, None)
    if kept is None or kept[0] != fmt:
        return None
    from compressed_tensors.compressors import BaseCompressor

    packed = kept[1]
    restored = BaseCompressor.get_value_from_registry(fmt).decompress(packed, module.quantization_scheme)
    if "weight" not in restored or any(local.get(key) is None for key in restored):
        return None
    for key, value in restored.items():
        if value.shape != local[key].shape or not torch.equal(value.to(local[key].dtype), local[key]):
            return None
    return packed


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def _reloads_fp8_experts() -> bool:
    """Whether the installed transformers reloads FP8 expert weights: from 5.25 on its experts loader
    (``CompressedTensorsDequantize``) folds each expert's fp8 ``weight`` with its ``weight_scale`` (per channel or per
    tensor, by broadcasting) into the fused parameters; 5.24 read packed int weights only."""
    from packaging.version import Version  # a dependency of transformers

    return Version(_transformers_version()) >= Version("5.25")


def experts_for_vllm(scheme: Any) -> bool:
    """Whether fused experts quantized with ``scheme`` (a compressed-tensors ``QuantizationScheme``), which
    transformers does not reload into its fused experts (:func:`expert_reload_problem`), are still written per
    expert in the layout vLLM's fused-MoE kernels read: NVFP4 weights (NVFP4, NVFP4A16: each expert matrix its
    ``weight_packed``, ``weight_scale`` and ``weight_global_scale``, one global scale shared by an expert's
    gate and up matrices, as vLLM fuses them), FP8 block weights (FP8_BLOCK: a ``weight_scale`` per block) or
    symmetric int8 weights per channel or tensor with dynamic int8 inputs per token (W8A8 / INT8: each expert
    matrix's int8 ``weight`` and ``weight_scale``, read by vLLM's ``CompressedTensorsW8A8Int8MoEMethod``, its
    ``_is_dynamic_token_w8a8`` scheme), with no output activations. llm-compressor 0.14 writes these schemes per
    expert in the same layout."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationStrategy

    w = scheme.weights
    if w is None or scheme.output_activations is not None:
        return False
    fmt = scheme.format or infer_module_format(nn.Linear, scheme)
    fp8_block = str(w.type) == "float" and w.num_bits == 8 and w.strategy == QuantizationStrategy.BLOCK
    inputs = scheme.input_activations
    int8_token = (
        str(w.type) == "int"
        and w.num_bits == 8
        and w.symmetric
        and w.strategy in (QuantizationStrategy.CHANNEL, QuantizationStrategy.TENSOR)
        and inputs is not None
        and str(inputs.type) == "int"
        and inputs.num_bits == 8
        and inputs.strategy == QuantizationStrategy.TOKEN
        and inputs.dynamic is True
        and fmt == CompressionFormat.int_quantized
    )
    return fmt == CompressionFormat.nvfp4_pack_quantized or fp8_block or int8_token


def expert_reload_problem(scheme: Any) -> str | None:
    """Why the expert matrices of fused experts quantized with ``scheme`` (a compressed-tensors
    ``QuantizationScheme``) would not reload into transformers' fused experts parameters, or ``None``.

    Its experts loader (``CompressedTensorsDequantize``) rebuilds each expert from ``weight_packed``,
    ``weight_scale`` and ``weight_shape`` with the format's compressor (symmetric int ``pack-quantized``, MXFP4 /
    MXFP6; not NVFP4, whose ``weight_global_scale`` it does not read), or, from transformers 5.25 on, from an
    fp8 ``weight`` times its ``weight_scale`` (per channel or per tensor); the reloaded experts run dense, with no
    input quantization. So FP8 experts may have dynamic input activations (nothing of them is in the checkpoint:
    a serving engine quantizes them) or static FP8 ones per tensor (each
    expert's ``input_scale`` is calibrated on its routed tokens and saved under its per-expert name, which vLLM
    reads; transformers' loader has no place for it and leaves it out). MXFP4 experts may have dynamic inputs too
    (the MXFP4 preset: its packed weights reload as MXFP4A16's; vLLM's compressed-tensors MoE loader takes MXFP4
    weights whatever their inputs).
    """
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationStrategy

    w = scheme.weights
    if w is None:
        return "the scheme quantizes no weights"
    if scheme.output_activations is not None:
        return "output activations cannot be quantized on fused experts (transformers runs them dense)"
    inputs = scheme.input_activations
    fmt = scheme.format or infer_module_format(nn.Linear, scheme)
    if fmt == CompressionFormat.nvfp4_pack_quantized:
        return (
            "NVFP4 weights: transformers' experts loader decompresses each expert from weight_packed, weight_scale "
            "and weight_shape alone, without its weight_global_scale, so the experts would reload with wrong values "
            "(MXFP4A16 has no global scale and reloads)"
        )
    if str(w.type) == "float" and w.num_bits == 8 and w.strategy == QuantizationStrategy.BLOCK:
        return (
            "FP8 block weights (FP8_BLOCK): transformers' experts loader multiplies each expert's fp8 weight by its "
            "weight_scale by broadcasting, which a scale per block does not (measured, transformers 5.25: "
            "'RuntimeError: The size of tensor a (32) must match the size of tensor b (2)'); FP8 per channel "
            "(FP8_DYNAMIC) reloads"
        )
    fp8 = (
        str(w.type) == "float"
        and w.num_bits == 8
        and w.symmetric  # the loader multiplies by the scale alone: an FP8 zero point is an unknown key on reload
        and w.strategy in (QuantizationStrategy.CHANNEL, QuantizationStrategy.TENSOR)
        and w.strategy not in (QuantizationStrategy.TENSOR_GROUP, QuantizationStrategy.BLOCK)
        and w.scale_dtype is None
    )
    if fp8:
        if not _reloads_fp8_experts():
            return (
                f"FP8 expert weights reload from transformers 5.25 on (installed: {_transformers_version()}, whose "
                "experts loader reads packed int weights only): upgrade transformers, or use W4A16 / W8A16"
            )
        if (
            inputs is not None
            and inputs.dynamic is False
            and not (
                str(inputs.type) == "float"
                and inputs.num_bits == 8
                and inputs.symmetric
                and inputs.strategy == QuantizationStrategy.TENSOR
            )
        ):
            return (
                "static input activations on fused experts are 8-bit float, symmetric, per tensor only (one "
                "input_scale [1] per expert matrix, as the FP8 preset writes them); use the FP8 preset or FP8_DYNAMIC"
            )
        return None
    if inputs is not None and not (fmt == CompressionFormat.mxfp4_pack_quantized and inputs.dynamic is True):
        return (
            "input activations are quantized on fused experts only with FP8 weights per channel or tensor "
            "(FP8_DYNAMIC) or MXFP4 weights with dynamic inputs (MXFP4): transformers reloads other experts from "
            "packed weight-only formats alone (W4A16, W8A16, MXFP4A16)"
        )
    if fmt in (CompressionFormat.mxfp4_pack_quantized, CompressionFormat.mxfp6_pack_quantized):
        return None  # packed like int weights, decompressed by the loader per expert (tested: MXFP4A16, MXFP6A16)
    if str(w.type) != "int" or not w.symmetric or fmt != CompressionFormat.pack_quantized:
        return (
            "symmetric int weights that compressed-tensors packs (pack-quantized: W4A16, W8A16), MXFP4 / MXFP6 "
            "weights (MXFP4A16, MXFP6A16) or symmetric FP8 weights per channel or tensor (FP8_DYNAMIC) only: "
            "transformers rebuilds a checkpoint's experts from their packed weights, scales and shapes (no zero "
            "point) or from fp8 weights times their scales, no other format"
        )
    return None
