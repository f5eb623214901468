"""Quantization schemes: ``compressed-tensors``' own presets and argument types, checked for what we run.

A recipe's ``scheme`` is either a preset name of ``compressed-tensors``
(``W4A16``, ``W8A16``, ``W8A8``, ``FP8_DYNAMIC``, ... — the same names and meaning
as in llm-compressor recipes) or a mapping of
:class:`compressed_tensors.quantization.QuantizationScheme` fields
(``weights``, ``input_activations``; each a mapping of
:class:`~compressed_tensors.quantization.QuantizationArgs` fields such as
``num_bits``, ``type``, ``symmetric``, ``strategy``, ``group_size``). A mapping
may also name a preset under ``preset`` and override its weight arguments, e.g.
``{preset: W4A16, weights: {group_size: 64}}``.

Every refusal is a ``ValueError`` with a one-line message that says why and what
to use instead; pydantic's validation errors are shortened to ``field: reason``.
"""

from __future__ import annotations

import copy
import difflib
import logging
import re
from collections.abc import Mapping
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, QuantizationStrategy
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES, preset_name_to_scheme
from pydantic import ValidationError
from torch import nn

from llmc_fsm.toolkit import format_problem
from llmc_fsm_quantization.observers import (
    IMPORTANCE_OBSERVERS,
    OBSERVERS,
    is_local,
    is_nvfp4,
    is_scaled_format,
    unknown_observer,
)

#: Observers of static (calibrated) per-tensor input scales
#: (see :class:`llmc_fsm_quantization._base.CalibrationStatistics`).
STATIC_INPUT_OBSERVERS = ("minmax", "static_minmax", "memoryless_minmax", "mse", "memoryless_mse")
#: Observers of the range NVFP4's input global scale is taken from (``dynamic: local`` inputs; preset NVFP4's is
#: ``static_minmax``, a scheme without one gets llm-compressor's activation default ``minmax``).
LOCAL_INPUT_OBSERVERS = ("minmax", "static_minmax", "memoryless_minmax")

__all__ = [
    "LOCAL_INPUT_OBSERVERS",
    "STATIC_INPUT_OBSERVERS",
    "is_attention_scheme",
    "preset_names",
    "resolve_config_groups",
    "resolve_scheme",
    "weight_args",
]

logger = logging.getLogger(__name__)

#: Weight strategies the modifiers implement.
_WEIGHT_STRATEGIES = (
    QuantizationStrategy.TENSOR,
    QuantizationStrategy.CHANNEL,
    QuantizationStrategy.GROUP,
    QuantizationStrategy.TENSOR_GROUP,
    QuantizationStrategy.BLOCK,
)


def preset_names(*, supported_only: bool = False) -> list[str]:
    """The preset scheme names ``compressed-tensors`` defines, in its order; with ``supported_only``
    those the modifiers run: every preset but ``UNQUANTIZED`` (compressed-tensors 0.20: 32 of 33; NVFP4, the MX
    formats, FP8 static and FP8_BLOCK included, see docs/quantization.md)."""
    names = list(PRESET_SCHEMES)
    return [n for n in names if _problem(preset_name_to_scheme(n, ["Linear"])) is None] if supported_only else names


def _preset(name: str, targets: list[str]) -> QuantizationScheme:
    if not isinstance(name, str) or name.upper() not in PRESET_SCHEMES:
        runs = sorted(preset_names(supported_only=True))
        close = difflib.get_close_matches(name.upper(), runs, 1, cutoff=0.8) if isinstance(name, str) else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""  # --scheme W4A61 (a newcomer's case)
        msg = f"unknown quantization scheme {name!r}{hint}; presets: {', '.join(runs)}"
        raise ValueError(msg)
    scheme = preset_name_to_scheme(name, targets)
    problem = _problem(scheme)
    if problem is not None:
        presets = ", ".join(sorted(preset_names(supported_only=True)))
        msg = f"preset {name.upper()} is not supported: {problem}. Presets that run: {presets}"
        raise ValueError(msg)
    return scheme


def resolve_scheme(scheme: Any, targets: list[str]) -> QuantizationScheme:
    """A ``QuantizationScheme`` for ``scheme`` (preset name or mapping), checked for what the modifiers run.

    Args:
        scheme: a preset name (case-insensitive), a ``QuantizationScheme``, a
            ``QuantizationArgs`` (the weights' arguments of a weight-only scheme), or
            a mapping of the scheme's fields, optionally with ``preset: NAME`` whose
            weight / input-activation arguments the mapping's entries update.
        targets: the modifier's targets (stored in the scheme, as compressed-tensors
            expects; they replace the targets of a given ``QuantizationScheme``).

    Raises:
        ValueError: unknown preset (the message lists the presets), invalid
            fields (pydantic's ``field: reason``, one line), no weight quantization,
            dynamic weights or a weight strategy other than tensor/channel/group,
            int weights or input activations of fewer than 2 bits, float weights
            other than 8 bits or float input activations other than 4, 6 or 8, a
            format compressed-tensors lacks (its ``NotImplementedError``), or static
            (calibrated) input activations, which need activation observers this
            version does not have.
    """
    if isinstance(scheme, QuantizationScheme):
        if list(scheme.targets) != list(targets):  # silently replaced, they quantized other modules than meant
            msg = (
                f"the QuantizationScheme's targets {list(scheme.targets)} differ from the modifier's targets "
                f"{list(targets)}, which choose the modules: give them as the modifier's targets (targets: [...])"
            )
            raise ValueError(msg)
        resolved = scheme.model_copy(deep=True)
    elif isinstance(scheme, QuantizationArgs):
        resolved = QuantizationScheme(targets=list(targets), weights=scheme.model_copy(deep=True))
    elif isinstance(scheme, str):
        resolved = _preset(scheme, targets)
    elif isinstance(scheme, Mapping):
        fields = copy.deepcopy(dict(scheme))  # pydantic keeps given QuantizationArgs objects: never share them
        _check_static_weights(fields.get("weights"))
        preset = fields.pop("preset", None)
        base = _preset(preset, targets) if preset is not None else None
        if base is not None:
            _check_group_override(preset, base, fields.get("weights"))
        try:
            if base is not None:
                data = base.model_dump()
                for key in ("weights", "input_activations", "output_activations"):
                    if isinstance(fields.get(key), dict) and data.get(key) is not None:
                        fields[key] = {**data[key], **fields[key]}
                fields = {**data, **fields}
            fields["targets"] = list(targets)
            _check_float_bits(fields)
            resolved = QuantizationScheme.model_validate(fields)
        except ValidationError as err:
            raise ValueError(f"invalid quantization scheme {scheme!r}: {_reason(err)}") from None
        except NotImplementedError as err:  # compressed-tensors' refusal of a format it lacks
            raise ValueError(f"invalid quantization scheme {scheme!r}: {err}") from None
    else:
        msg = f"scheme must be a preset name ({', '.join(preset_names()[:6])}, ...) or a mapping, got {scheme!r}"
        raise ValueError(msg)
    _check_supported(resolved)
    acts = resolved.input_activations
    if acts is not None and acts.num_bits <= 4 and acts.type == "int":
        logger.warning(
            "scheme %s quantizes activations to %d-bit integers, which without rotations (QuaRot, SpinQuant) or "
            "calibrated clipping scales (neither is applied here) usually ruins the model's perplexity; W4A16 or "
            "W8A8 keep it",
            scheme if isinstance(scheme, str) else "given",
            acts.num_bits,
        )
    return resolved


_ENUM_REPR = re.compile(r"<\w+\.\w+: '([^']*)'>")  # <QuantizationStrategy.TOKEN: 'token'> -> token


def _reason(err: ValidationError) -> str:
    """pydantic's errors as ``field: reason; ...`` (without its input values and documentation links)."""
    parts = []
    for error in err.errors():
        field = ".".join(str(part) for part in error["loc"])
        reason = _ENUM_REPR.sub(r"\1", error["msg"].removeprefix("Value error, ").rstrip("."))
        parts.append(f"{field}: {reason}" if field else reason)
    return "; ".join(parts)


def resolve_config_groups(config_groups: Any) -> dict[str, QuantizationScheme]:
    """``{group name: QuantizationScheme}`` of llm-compressor's ``config_groups``, each checked by
    :func:`resolve_scheme` with its own targets.

    Args:
        config_groups: ``{name: {targets: [...], <scheme fields>}}`` (a value may also be a
            ``QuantizationScheme``); the scheme fields are those :func:`resolve_scheme` reads
            (``weights``, ``input_activations``, ``preset``, ...).

    Raises:
        ValueError: not a non-empty mapping, a group without targets, a group :func:`resolve_scheme`
            refuses (the message starts ``config_groups entry 'NAME': ``), or one target string in two groups.
    """
    if not isinstance(config_groups, Mapping) or not config_groups:
        msg = f"config_groups must map group names to schemes with targets, got {config_groups!r}"
        raise ValueError(msg)
    groups: dict[str, QuantizationScheme] = {}
    owner: dict[str, str] = {}  # target -> the entry giving it
    for name, group in config_groups.items():
        if isinstance(group, QuantizationScheme):
            fields: Any = group
            targets = list(group.targets)
        elif isinstance(group, Mapping):
            targets = group.get("targets")
            targets = [targets] if isinstance(targets, str) else targets
            fields = {k: v for k, v in group.items() if k != "targets"}
        else:
            raise ValueError(f"config_groups entry {name!r} must be a mapping of scheme fields, got {group!r}")
        if not targets or not isinstance(targets, list | tuple) or not all(isinstance(t, str) for t in targets):
            msg = (
                f"config_groups entry {name!r} needs targets: a list of module patterns (e.g. [Linear]), "
                f"got {targets!r}"
            )
            raise ValueError(msg)
        try:
            groups[str(name)] = resolve_scheme(fields, list(targets))
        except ValueError as err:
            raise ValueError(f"config_groups entry {name!r}: {err}") from None
        for target in targets:
            if owner.get(target, name) != name:  # the same target twice in one entry is harmless
                msg = (
                    f"config_groups entries {owner[target]!r} and {name!r} both give target {target!r}; a module is "
                    "quantized with one scheme (llm-compressor takes the last entry's): keep the target in one entry"
                )
                raise ValueError(msg)
            owner[target] = str(name)
    return groups


def _check_observers(scheme: QuantizationScheme) -> str | None:
    """Why an observer named in ``scheme`` cannot run (unknown, importance for activations, kwargs), or ``None``."""
    for role in ("weights", "input_activations", "output_activations"):
        args = getattr(scheme, role)
        if args is None:
            continue
        if args.observer is not None and args.observer not in OBSERVERS:
            return f"{role}: {unknown_observer(args.observer)}"
        if role != "weights" and args.observer in IMPORTANCE_OBSERVERS:
            return f"{role}: observer {args.observer} weighs weight errors by input importance; it is for weights only"
        if args.observer_kwargs:
            return (
                f"{role}: observer_kwargs {dict(args.observer_kwargs)!r} are not supported (each observer runs "
                "with llm-compressor's defaults, see docs/quantization.md); remove them"
            )
    return None


def _static_only(what: str) -> str:
    return (
        f"{what}: weights are quantized statically here (once, from the weights themselves), so dynamic weights "
        "and strategy 'token' (a per-token scale, for activations) are not supported; use strategy channel, "
        "group or tensor and leave dynamic out"
    )


def _check_static_weights(weights: Any) -> None:
    """Refuse dynamic or per-token weights before pydantic does (its two messages send users to each other)."""
    if not isinstance(weights, Mapping):
        return
    dynamic = getattr(weights.get("dynamic"), "value", weights.get("dynamic"))
    strategy = getattr(weights.get("strategy"), "value", weights.get("strategy"))
    if dynamic is True or (isinstance(dynamic, str) and dynamic.lower() in ("true", "local")):
        raise ValueError(_static_only(f"weights with dynamic: {str(dynamic).lower()}"))
    if isinstance(strategy, str) and strategy.lower() == "token":
        raise ValueError(_static_only("weights with strategy: token"))


def _bits(n: Any) -> str:
    return f"{n} bit" if n == 1 else f"{n} bits"


def _float_weights(bits: Any) -> str:
    return (
        f"float weights of {_bits(bits)} cannot be saved (fp8, or fp4 / fp6 with the scales of NVFP4 or the MX "
        "formats: presets NVFP4A16, MXFP4A16, MXFP6A16, or in config_groups NVFP4's strategy: tensor_group, "
        "group_size: 16, scale_dtype: float8_e4m3fn and MX's strategy: group, group_size: 32, scale_dtype: uint8); "
        "use num_bits: 8 or type: int"
    )


def _check_float_bits(fields: Mapping[str, Any]) -> None:
    """Refuse float weights other than 8 bits and float activations other than 4, 6 or 8 bits before pydantic
    (compressed-tensors raises ``NotImplementedError: Only num_bits in (8) are supported`` for most of them)."""
    for role in ("weights", "input_activations"):
        args = fields.get(role)
        if not isinstance(args, Mapping):
            continue
        kind = getattr(args.get("type"), "value", args.get("type"))
        bits = args.get("num_bits", 8)
        if not isinstance(kind, str) or kind.lower() != "float" or isinstance(bits, bool) or not isinstance(bits, int):
            continue
        if role == "weights" and bits != 8 and (bits not in (4, 6) or args.get("scale_dtype") is None):
            raise ValueError(_float_weights(bits))
        if bits not in (4, 6, 8):
            msg = (
                f"float {role} of {_bits(bits)} are not supported (compressed-tensors' float formats have 4, 6 or "
                "8 bits); use num_bits: 8 (as in preset FP8_DYNAMIC) or type: int"
            )
            raise ValueError(msg)


def _check_group_override(preset: str, base: QuantizationScheme, weights: Any) -> None:
    """Refuse ``group_size`` on a preset whose weights are not group-wise (pydantic's own message is cryptic)."""
    if not isinstance(weights, dict) or weights.get("group_size") is None or "strategy" in weights:
        return
    strategy = base.weights.strategy if base.weights is not None else None
    if strategy == QuantizationStrategy.GROUP:
        return
    size = weights["group_size"]
    if strategy == QuantizationStrategy.TENSOR_GROUP:  # NVFP4: the format fixes the group (fp4 needs its scales)
        fixed = base.weights.group_size
        if size == fixed:
            return
        msg = (
            f"preset {preset} quantizes weights in NVFP4's groups of {fixed} values (fixed by the format: fp4 "
            f"values under float8 group scales and a per-tensor global scale), so group_size {size} cannot be set; "
            f"leave it out, or for weights in groups of {size} use an int preset: W4A16 (int4 weights, activations "
            f"not quantized) with weights: {{group_size: {size}}}"
        )
        raise ValueError(msg)
    per = getattr(strategy, "value", strategy)
    msg = (
        f"preset {preset} quantizes weights per {per}, so group_size (--group-size) does not apply; leave it out, "
        f"use a group-wise preset such as W4A16 or W8A16, or set weights: "
        f"{{strategy: group, group_size: {size}}}"
    )
    raise ValueError(msg)


def _check_supported(scheme: QuantizationScheme) -> None:
    problem = _problem(scheme)
    if problem is not None:
        raise ValueError(problem)


def _problem(scheme: QuantizationScheme) -> str | None:
    """Why the modifiers cannot run ``scheme``, or ``None``."""
    problem = _check_observers(scheme)
    if problem is not None:
        return problem
    w = scheme.weights
    if is_attention_scheme(scheme):  # attention quantization: checked by the modifier (FP8 q/k/v scales)
        return None
    if w is None:
        return "the scheme quantizes no weights; weight-only (W4A16, W8A16) and dynamic (W8A8, FP8_DYNAMIC) ones work"
    strategy = getattr(w.strategy, "value", w.strategy)
    if w.dynamic or w.strategy == QuantizationStrategy.TOKEN:
        dynamic = str(getattr(w.dynamic, "value", w.dynamic)).lower()
        return _static_only(f"weights with dynamic: {dynamic}, strategy: {strategy}")
    if w.strategy not in _WEIGHT_STRATEGIES:
        return f"weight strategy {strategy!r} is not supported; use tensor, channel, group, tensor_group or block"
    if w.scale_dtype is not None and not is_scaled_format(w):
        return (
            f"weights with scale_dtype {w.scale_dtype} are supported only as compressed-tensors' MX formats "
            "(float, group_size 32, scale_dtype uint8) and NVFP4 (tensor_group, scale_dtype float8_e4m3fn)"
        )
    if w.strategy == QuantizationStrategy.TENSOR_GROUP and (w.type != "float" or w.num_bits != 4):
        return "tensor_group weights are NVFP4's: float, 4 bits (preset NVFP4A16)"
    for role in ("weights", "input_activations"):
        args = getattr(scheme, role)
        if args is not None and args.type == "int" and args.num_bits < 2:
            return _too_few_bits(role, args.num_bits)
    if w.type == "float" and w.num_bits != 8 and not (w.scale_dtype is not None and is_scaled_format(w)):
        return _float_weights(w.num_bits)  # compressed-tensors packs fp4/fp6 only as NVFP4 and MX
    if w.type == "float" and w.num_bits in (4, 6) and not w.symmetric:
        return (
            f"asymmetric FP{w.num_bits} weights (symmetric: false) are not supported: compressed-tensors quantizes "
            "NVFP4 and MX symmetric only ('Asymmetric Quantization is not supported for FP4 and FP6'); use "
            "symmetric: true"
        )
    if w.scale_dtype == torch.uint8 and w.strategy == QuantizationStrategy.GROUP and w.group_size != 32:
        return (
            f"MX weights (scale_dtype uint8) with group_size {w.group_size}: an MX format's groups are 32 values wide "
            "(OCP Microscaling); keep group_size 32, or use NVFP4A16 (groups of 16)"
        )
    a = scheme.input_activations
    if a is not None and is_local(a):
        if not (is_nvfp4(a) and a.group_size == 16 and is_nvfp4(w)):
            return (
                "input_activations with dynamic: local (per-group input scales under a calibrated global scale) are "
                "supported as NVFP4's (preset NVFP4: float, 4 bits, tensor_group, group_size 16, with NVFP4 weights); "
                "use preset NVFP4, NVFP4A16 (weights only) or FP8 / FP8_DYNAMIC activations"
            )
        if a.observer is not None and a.observer not in LOCAL_INPUT_OBSERVERS:
            return (
                f"input_activations: observer {a.observer} is not supported for NVFP4's input global scale; use one "
                f"of {', '.join(LOCAL_INPUT_OBSERVERS)}"
            )
    if a is not None and not a.dynamic:
        if a.strategy != QuantizationStrategy.TENSOR:
            per = getattr(a.strategy, "value", a.strategy)
            return (
                f"static input_activations (dynamic: false) per {per} are not supported: static input scales are "
                "per tensor (strategy: tensor, as in preset FP8); or use dynamic activations (W8A8, FP8_DYNAMIC)"
            )
        if a.observer is not None and a.observer not in STATIC_INPUT_OBSERVERS:
            return (
                f"input_activations: observer {a.observer} is not supported for static input scales; use one of "
                f"{', '.join(STATIC_INPUT_OBSERVERS)}"
            )
    if scheme.output_activations is not None and not scheme.output_activations.dynamic:
        return "static output_activations (dynamic: false) are not supported: output activations are not quantized"
    if scheme.output_activations is not None:
        return "output activation quantization is not supported"
    if scheme.format is not None and (problem := format_problem(nn.Linear, scheme, scheme.format)) is not None:
        return f"format {getattr(scheme.format, 'value', scheme.format)}: {problem}"
    return None


def _too_few_bits(role: str, bits: int) -> str:
    if bits < 1:
        return f"{role} with num_bits {bits}: an integer grid needs at least 2 bits; use num_bits 2 to 8"
    hint = "e.g. preset W2A16" if role == "weights" else "dynamic activations are usually 8 bits, as in preset W8A8"
    return (
        f"int {role} of 1 bit are not supported: symmetric ones round (nearly) every value to 0 (the grid is "
        "{-1, 0} times a scale of 2 max|x|) and asymmetric ones keep only 0 and each group's extreme (the range "
        f"always contains 0), which loses about as much as setting them all to 0; use num_bits 2 or more ({hint})"
    )


def is_attention_scheme(scheme: QuantizationScheme) -> bool:
    """Whether ``scheme`` quantizes input activations only: llm-compressor's attention quantization (a config group
    targeting attention modules: their queries, keys and values; see
    :func:`llmc_fsm_quantization.kv_cache.install_query`)."""
    return scheme.weights is None and scheme.input_activations is not None and scheme.output_activations is None


def weight_args(scheme: QuantizationScheme) -> QuantizationArgs:
    """The scheme's weight arguments.

    Raises:
        ValueError: the scheme quantizes no weights (:func:`resolve_scheme` refuses those).
    """
    if scheme.weights is None:
        msg = "the scheme quantizes no weights"
        raise ValueError(msg)
    return scheme.weights
