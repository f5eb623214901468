"""KV-cache quantization (compressed-tensors' ``kv_cache_scheme``): FP8 key and value scales from calibration.

A quantizing modifier given ``kv_cache_scheme`` (an FP8 ``QuantizationArgs``: ``num_bits: 8, type: float,
symmetric: true, dynamic: false``, strategy ``tensor`` or ``attn_head``) gives every attention module of the
model two parameters, ``k_scale`` and ``v_scale`` (``[1]`` per tensor, ``[num_kv_heads, 1, 1]`` per head, the
dtype the attention computes in, :func:`scale_dtype`), as compressed-tensors' ``initialize_attn_qparams`` allocates
them; the checkpoint holds them as ``<attention>.k_scale`` / ``<attention>.v_scale`` next to ``kv_cache_scheme`` in
``quantization_config``, the names vLLM reads for an FP8 KV cache.

What is observed are the key and value states the attention hands to its cache (``cache.update(k, v, ...)``):
keys after the rotary embedding, ``[batch, num_kv_heads, seq, head_dim]``, as compressed-tensors' own
``QuantizedKVCache`` observes them. A forward pre-hook of the attention (:func:`install`) replaces its cache
argument by a :class:`CacheTap`, which, while the attention's scales are not yet calibrated (NaN), records the
range of each call's k and v (:class:`KVRange`), and afterwards fake-quantizes them with compressed-tensors'
``fake_quantize`` (what its ``forward_quantize`` does for ``k`` / ``v``) before handing them to the real cache
(if any), unless the attention's ``quantization_enabled`` is off. The hook stays on the model: the in-memory model
computes with the FP8 KV cache; the sequential pipeline's calibration forwards turn it off, as llm-compressor
calibrates on full-precision activations (:func:`llmc_fsm.pipeline.layer.activation_quantization_off`). A layer
restored from saved progress (a resumed run) gets its scales from its state dict and quantizes at once.

Attention quantization (llm-compressor's config group targeting the attention with input activations only) also
quantizes the queries after the rotary embedding, ``[batch, heads, seq, head_dim]``, with the same arguments:
:func:`install_query` adds ``q_scale`` (``[1]`` or ``[num_heads, 1, 1]``) and a compressed-tensors query hook that
observes and fake-quantizes them as :class:`CacheTap` does keys and values; the checkpoint holds
``<attention>.q_scale`` next to ``k_scale`` / ``v_scale`` and the config group. The query heads are the config's
``num_attention_heads`` where ``q_proj`` is that many heads wide, or twice (Qwen3-Next's gated ``q_proj``). It needs
an attention implementation compressed-tensors can hook (``sdpa``, flash, flex: not ``eager``, refused before any
work, :func:`hooked_attention_refusal`). An attention's KV cache is quantized with one scheme: a second modifier
giving another is refused (:func:`install`; one-shot's checks refuse it before any work within a stage).

Scale of each observer (per tensor, or per KV head over batch, positions and head dimension), with
``range = max(|min|, |max|)`` and the FP8 (e4m3) maximum 448 (compressed-tensors' ``calculate_qparams``):

* ``static_minmax``: ``max |x|`` over every calibration token / 448;
* ``minmax`` (llm-compressor's default for k and v): each calibration sample's minimum and maximum averaged as
  ``v <- 0.99 v + 0.01 v_sample`` from the first sample's values, then ``range / 448`` (one observation per sample,
  in order, whatever the batch size: llm-compressor observes each call, one sample per call at its default
  ``batch_size`` 1);
* ``memoryless_minmax``: the last sample's range / 448.

The scales are computed in the states' dtype (the model's), as compressed-tensors computes them from the ranges
llm-compressor's observers keep in the observed dtype. Under ``torch.distributed`` each rank keeps every sample's
range, and :func:`gather_over_ranks` folds every rank's in the calibration windows' order before the scales are
computed: one process's scales from the same per-sample ranges.

Limit (compressed-tensors 0.20 with transformers 5.24): transformers' attention names its cache argument
``cache``, and compressed-tensors recognises an attention with KV cache by an argument ``past_key_values``, so
transformers reloads the checkpoint (weights exact) but leaves ``k_scale`` / ``v_scale`` unused ("UNEXPECTED"
keys) and computes attention with full-precision keys and values. :func:`load_kv_cache_scales` gives such a
reloaded model the saved KV-cache quantization back (then its logits are the in-memory model's); setting an
attention's ``quantization_enabled = False`` (compressed-tensors' switch) turns it off in memory.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.modeling.attention import HOOKED_ATTENTION_NAME
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, QuantizationStrategy
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from pydantic import ValidationError
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from llmc_fsm import find_decoder_layers
from llmc_fsm.toolkit import all_gather_ints, all_gather_rows, is_distributed, model_family

__all__ = [
    "CACHE_ARGUMENTS",
    "KV_CACHE_OBSERVERS",
    "KV_CACHE_STRATEGIES",
    "CacheTap",
    "KVRange",
    "attention_modules",
    "describe",
    "gather_over_ranks",
    "hooked_attention_refusal",
    "install",
    "install_query",
    "kv_heads",
    "load_kv_cache_scales",
    "no_kv_attention_reason",
    "query_heads",
    "range_dtype",
    "resolve_kv_cache_scheme",
    "scale_dtype",
    "set_scales",
]

#: The attention's cache argument, by the names transformers has used (5.24: ``cache``).
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")
#: Strategies of a KV-cache scheme: one scale per tensor, or one per key/value head.
KV_CACHE_STRATEGIES = (QuantizationStrategy.TENSOR, QuantizationStrategy.ATTN_HEAD)
#: Observers of the key and value ranges (see the module docstring).
KV_CACHE_OBSERVERS = ("minmax", "static_minmax", "memoryless_minmax")
#: The observer of a KV-cache scheme that names none (llm-compressor's default for k and v).
DEFAULT_KV_OBSERVER = "minmax"
#: Attribute of a calibrated attention module holding its ``QuantizationArgs`` (read when saving the config).
SCHEME_ATTR = "kv_cache_scheme"
#: Attribute of an attention module whose queries are quantized too (attention quantization): the config group's
#: ``QuantizationScheme`` (``input_activations`` only), written as a config group of ``quantization_config``.
ATTENTION_SCHEME_ATTR = "attention_quantization_scheme"
_STATE_ATTR = "_kv_cache_ranges"  # {"k": KVRange, "v": KVRange[, "q": KVRange]} while the scales are being observed
#: Floating dtypes a model computes in (its scales' dtype; ranges are averaged in them, :func:`range_dtype`).
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def resolve_kv_cache_scheme(value: Any) -> QuantizationArgs | None:
    """The ``QuantizationArgs`` of ``kv_cache_scheme`` (a mapping of its fields, or the args), observer filled in.

    Returns:
        ``None`` for ``None``; else a copy whose ``observer`` is the given one or ``minmax``.

    Raises:
        ValueError: invalid fields, or a scheme that is not FP8 (e4m3, symmetric, static) per tensor or per
            head, or an observer not in :data:`KV_CACHE_OBSERVERS`; the message says what to use.
    """
    if value is None:
        return None
    if isinstance(value, QuantizationArgs):
        args = value.model_copy(deep=True)
    elif isinstance(value, Mapping):
        try:
            args = QuantizationArgs.model_validate(dict(value))
        except ValidationError as exc:
            fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"kv_cache_scheme: {fields}") from None
    else:
        msg = f"kv_cache_scheme must be a mapping of QuantizationArgs fields, got {type(value).__name__}"
        raise ValueError(msg)
    fp8 = "{num_bits: 8, type: float, symmetric: true, dynamic: false, strategy: tensor (or attn_head)}"
    if args.num_bits != 8 or str(getattr(args.type, "value", args.type)) != "float":
        msg = (
            f"kv_cache_scheme: only an FP8 KV cache is supported (num_bits 8, type float; vLLM's KV-cache "
            f"format), got num_bits {args.num_bits}, type {getattr(args.type, 'value', args.type)}; use {fp8}"
        )
        raise ValueError(msg)
    if not args.symmetric or args.dynamic is not False:
        msg = f"kv_cache_scheme: the KV-cache scales are static and symmetric (calibrated once); use {fp8}"
        raise ValueError(msg)
    if args.strategy not in KV_CACHE_STRATEGIES:
        strategy = getattr(args.strategy, "value", args.strategy)
        msg = f"kv_cache_scheme: strategy {strategy} is not supported; use tensor (one scale) or attn_head (per head)"
        raise ValueError(msg)
    if args.observer is None:
        args.observer = DEFAULT_KV_OBSERVER
    if args.observer not in KV_CACHE_OBSERVERS:
        msg = (
            f"kv_cache_scheme: observer {args.observer!r} is not supported; use one of {', '.join(KV_CACHE_OBSERVERS)}"
        )
        raise ValueError(msg)
    return args


def _cache_argument(module: nn.Module) -> str | None:
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in CACHE_ARGUMENTS if name in parameters), None)


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of the attention modules with a KV cache: class name containing ``attention``,
    ``k_proj`` and ``v_proj`` children or one fused ``qkv_proj`` (Phi-3), and a cache argument
    (:data:`CACHE_ARGUMENTS`) in ``forward``; inside the model's decoder layers
    (:func:`llmc_fsm.find_decoder_layers`: the language model's) where it has them, so that a vision tower's
    attention whose forward takes a cache argument it never uses (Llama 4's ``Llama4VisionAttention``; found by a
    tester: text calibration never handed it keys and values, and the run failed at its end) is not one. A linear
    attention of a hybrid stack (its layer's ``layer_types`` entry, or its own ``layer_type``, says
    ``linear_attention``: MiniMax's lightning attention, which reads a recurrent state from its cache argument, not
    keys and values) is not one either: it failed on the cache stand-in (found by a tester)."""
    try:
        layers_name, _ = find_decoder_layers(model)
    except ValueError:
        layers_name = ""
    prefix = f"{layers_name}." if layers_name else ""
    config = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    kinds = getattr(text, "layer_types", None)

    def linear(name: str, module: nn.Module) -> bool:
        kind = getattr(module, "layer_type", None)
        index = name[len(prefix) :].split(".", 1)[0] if prefix else ""
        if kind is None and isinstance(kinds, list | tuple) and index.isdigit() and int(index) < len(kinds):
            kind = kinds[int(index)]
        return isinstance(kind, str) and "linear" in kind

    return {
        name: module
        for name, module in model.named_modules()
        if name.startswith(prefix)
        and not linear(name, module)
        and "attention" in type(module).__name__.lower()
        and (
            (
                isinstance(getattr(module, "k_proj", None), nn.Module)
                and isinstance(getattr(module, "v_proj", None), nn.Module)
            )
            or isinstance(getattr(module, "qkv_proj", None), nn.Module)
        )
        and _cache_argument(module) is not None
    }


#: Children of a multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2, ...), whose cache holds a compressed
#: latent and a shared rotary key instead of each head's keys and values.
LATENT_ATTENTION_PROJECTIONS = ("kv_a_proj_with_mqa", "kv_b_proj")


def no_kv_attention_reason(model: nn.Module) -> str:
    """Why ``model`` has no attention module whose KV cache can be quantized (:func:`attention_modules` is empty),
    in one line naming the model and the attention classes it has, and what to do.

    A multi-head latent attention (a child named in :data:`LATENT_ATTENTION_PROJECTIONS`: DeepSeek-V3's
    ``DeepseekV3Attention``) is named as such: its cache holds the compressed latent (``kv_a_proj_with_mqa``'s
    output) and the shared rotary key, not each head's keys and values, and quantizing it is not supported
    (compressed-tensors 0.20 takes a ``kv_b_proj`` attention for a cached one; llm-compressor 0.14 failed on it in a
    tester's run). Found by a tester: the line named neither the model nor its attention class.
    """
    try:
        layers_name, _ = find_decoder_layers(model)
    except ValueError:
        layers_name = ""
    modules = [
        m
        for n, m in model.named_modules()
        if n.startswith(f"{layers_name}." if layers_name else "")
        and "attention" in type(m).__name__.lower()
        and any(isinstance(c, nn.Linear) for c in m.children())
    ]
    classes = ", ".join(dict.fromkeys(type(m).__name__ for m in modules)) or "none found"
    latent = [
        m for m in modules if any(isinstance(getattr(m, c, None), nn.Module) for c in LATENT_ATTENTION_PROJECTIONS)
    ]
    if latent:
        found = ", ".join(c for c in LATENT_ATTENTION_PROJECTIONS if isinstance(getattr(latent[0], c, None), nn.Module))
        return (
            f"{model_family(model)}: its attention ({classes}) is multi-head latent attention (MLA: {found}), whose "
            "cache holds the compressed latent and the shared rotary key, not each head's keys and values: quantizing "
            "an MLA KV cache is not supported (llm-compressor 0.14 fails on it too); leave kv_cache_scheme out (its "
            "projections' weights can still be quantized)"
        )
    return (
        f"{model_family(model)}: no attention module has k_proj and v_proj (or qkv_proj) and a cache argument "
        f"({', '.join(CACHE_ARGUMENTS)}) whose keys and values could be observed; its attention modules: {classes}; "
        "leave kv_cache_scheme out"
    )


def kv_heads(module: nn.Module) -> int | None:
    """Number of key/value heads of attention ``module``: ``k_proj``'s output width / ``head_dim``; with a fused
    ``qkv_proj``, its config's ``num_key_value_heads`` when the fused width is ``(heads + 2 * kv heads) * head_dim``
    (``None`` when unknown)."""
    return _heads(module, "k_proj", "num_key_value_heads")


def query_heads(module: nn.Module) -> int | None:
    """Number of query heads of attention ``module``: its config's ``num_attention_heads`` when ``q_proj``'s output
    width is ``heads * head_dim``, or twice that (a gated attention, Qwen3-Next / Qwen3.5: ``q_proj`` gives the
    queries and the output gate; found by a tester: taking the width / ``head_dim`` gave twice the heads and the run
    failed at its end); else ``q_proj``'s width / ``head_dim``; or as :func:`kv_heads` from a fused ``qkv_proj``
    (``None`` when unknown)."""
    return _heads(module, "q_proj", "num_attention_heads")


def _heads(module: nn.Module, projection: str, config_field: str) -> int | None:
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        return None
    fused = getattr(getattr(module, "qkv_proj", None), "out_features", None)
    if getattr(module, projection, None) is None and isinstance(fused, int):
        config = getattr(module, "config", None)
        heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
        if isinstance(heads, int) and isinstance(kv, int) and fused == (heads + 2 * kv) * head_dim:
            return heads if config_field == "num_attention_heads" else kv
        return None
    width = getattr(getattr(module, projection, None), "out_features", None)
    if not isinstance(width, int) or width % head_dim:
        return None
    heads = getattr(getattr(module, "config", None), config_field, None)
    if projection == "q_proj" and isinstance(heads, int) and width in (heads * head_dim, 2 * heads * head_dim):
        return heads  # 2 * heads * head_dim: a gated attention's q_proj (queries and output gate)
    return width // head_dim


def range_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype observed ranges of states (or inputs) of ``dtype`` are kept and averaged in: a floating dtype
    (bfloat16, float16, float32, float64) its own, as llm-compressor 0.14's observers keep them (its ``lerp`` rounds
    each product and the sum to it; found by testers: kept in float64, the scales of a bfloat16 model differed from
    llm-compressor's by a bfloat16 step or two, and those of a float32 model by a float32 step, on bit-identical
    inputs); any other dtype float64."""
    return dtype if dtype in _FLOAT_DTYPES else torch.float64


class KVRange:
    """Minimum and maximum of key (or value) states ``[batch, heads, seq, head_dim]`` over the calibration samples.

    One observation is one sample (a row of the batch), taken in order, so the ranges do not depend on how the
    samples are batched (llm-compressor 0.14 observes each forward call, one sample per call at its default
    ``batch_size`` 1). ``ranges[observer]``: ``[2, *shape]`` (minimum, maximum) on the CPU in
    :func:`range_dtype` of the states' dtype (a floating dtype: theirs), ``shape`` ``[1]``
    per tensor or ``[heads, 1, 1]`` per head, kept for every observer of :data:`KV_CACHE_OBSERVERS` (see the module
    docstring); ``minmax``'s moving average is computed in that dtype as llm-compressor's ``lerp`` computes it,
    ``v * (1 - c) + v_sample * c``; ``dtype``: the states' dtype, in which :func:`set_scales` computes the scales.
    """

    AVERAGING_CONSTANT = 0.01

    def __init__(self, per_head: bool) -> None:
        self.per_head = per_head
        self.ranges: dict[str, torch.Tensor] = {}
        self.calls = 0
        self.dtype = torch.float32
        #: under ``torch.distributed``, each sample's ``[2, *shape]`` range, in order (what :meth:`gather_over_ranks`
        #: folds again)
        self.samples: list[torch.Tensor] = []

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        """Record one call's states ``x`` ``[batch, heads, seq, head_dim]``, sample by sample."""
        if x.numel() == 0:
            return
        x = x.detach()
        self.dtype = x.dtype
        if self.per_head:  # [batch, heads, 1, 1]
            lo, hi = x.amin(dim=(2, 3), keepdim=True), x.amax(dim=(2, 3), keepdim=True)
        else:  # [batch, 1]
            lo, hi = x.flatten(1).amin(dim=1, keepdim=True), x.flatten(1).amax(dim=1, keepdim=True)
        calls = torch.stack([lo, hi], dim=1).to(device="cpu", dtype=range_dtype(x.dtype))  # [batch, 2, *shape]
        self.calls += 1
        keep = is_distributed()
        for call in calls:
            if keep:
                self.samples.append(call)
            self._observe(call)

    def _observe(self, call: torch.Tensor) -> None:
        """Fold one sample's range ``[2, *shape]`` into every observer's."""
        if not self.ranges:
            self.ranges = {"static_minmax": call.clone(), "minmax": call.clone(), "memoryless_minmax": call}
            return
        extremes = self.ranges["static_minmax"]
        call = call.to(extremes.dtype)
        extremes[0] = torch.minimum(extremes[0], call[0])
        extremes[1] = torch.maximum(extremes[1], call[1])
        c = self.AVERAGING_CONSTANT  # llm-compressor's lerp, in the observed dtype
        self.ranges["minmax"] = (self.ranges["minmax"] * (1.0 - c)) + (call * c)
        self.ranges["memoryless_minmax"] = call

    @torch.no_grad()
    def gather_over_ranks(self, shape: tuple[int, ...]) -> None:
        """Under ``torch.distributed``, every rank's samples in the calibration windows' order (each rank holds a
        contiguous slice of them), folded again from the first: every observer's range (``minmax``'s moving
        average and ``memoryless_minmax``'s last sample included) is then what one process that saw every window
        computes from the same per-sample ranges. A collective: every rank calls it for the same attention and
        state, ``shape`` the scale's (``[1]`` or ``[heads, 1, 1]``). Without a process group: nothing.

        Raises:
            DistributedError: the collective failed (another rank stopped).
        """
        if not is_distributed():
            return
        code = _FLOAT_DTYPES.index(self.dtype) if self.samples else -1
        dtypes = all_gather_ints([code], what="all_gather (KV dtype)")
        seen = {d[0] for d in dtypes} - {-1}
        if not seen:
            return
        self.dtype = _FLOAT_DTYPES[min(seen)]  # every rank runs the same model: one dtype
        mine = torch.stack(self.samples).double() if self.samples else torch.zeros((0, 2, *shape), dtype=torch.float64)
        every = all_gather_rows(mine, what="all_gather (KV ranges)").to(range_dtype(self.dtype))
        self.ranges, self.samples, self.calls = {}, [], every.shape[0]
        for call in every:
            self._observe(call)


class CacheTap:
    """Stands for an attention's cache argument: ``update(k, v, ...)`` observes or fake-quantizes ``k`` and ``v``
    (see the module docstring), then returns the real cache's ``update`` (or ``(k, v)`` without a cache). Other
    attributes are the real cache's."""

    def __init__(self, attention: nn.Module, cache: Any) -> None:
        self._attention = attention
        self._cache = cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        attention = self._attention
        ranges = attention.__dict__.get(_STATE_ATTR)
        if not calibrated(attention):
            if ranges is not None:
                ranges["k"].add(key_states)
                ranges["v"].add(value_states)
        elif getattr(attention, "quantization_enabled", True):  # compressed-tensors' switch, honoured too
            args_ = getattr(attention, SCHEME_ATTR)
            key_states = fake_quantize(key_states, attention.k_scale, None, args_)
            value_states = fake_quantize(value_states, attention.v_scale, None, args_)
        if self._cache is not None:
            return self._cache.update(key_states, value_states, *args, **kwargs)
        return key_states, value_states

    def __getattr__(self, name: str) -> Any:
        cache = self.__dict__.get("_cache")
        if cache is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(cache, name)


def calibrated(attention: nn.Module) -> bool:
    """Whether ``attention``'s ``k_scale`` and ``v_scale`` hold calibrated values (not NaN)."""
    k, v = getattr(attention, "k_scale", None), getattr(attention, "v_scale", None)
    q = getattr(attention, "q_scale", None)
    return (
        k is not None
        and v is not None
        and bool(torch.isfinite(k).all())
        and bool(torch.isfinite(v).all())
        and (q is None or bool(torch.isfinite(q).all()))
    )


def _swap_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """Forward pre-hook of a KV-quantized attention: its cache argument becomes a :class:`CacheTap`."""
    name = next((n for n in CACHE_ARGUMENTS if n in kwargs), None)  # as the caller named it (maybe an old alias)
    if name is None:
        name = _cache_argument(module)
        position = list(inspect.signature(module.forward).parameters).index(name)
        if position < len(args):  # given by position
            if not isinstance(args[position], CacheTap):
                args = (*args[:position], CacheTap(module, args[position]), *args[position + 1 :])
            return args, kwargs
    if not isinstance(kwargs.get(name), CacheTap):
        kwargs[name] = CacheTap(module, kwargs.get(name))
    return args, kwargs


def install(attention: nn.Module, args: QuantizationArgs, *, dtype: torch.dtype | None = None) -> None:
    """Prepare ``attention`` for KV-cache quantization with ``args`` (:func:`resolve_kv_cache_scheme`).

    Registers ``k_scale`` / ``v_scale`` (NaN: not calibrated; of ``dtype``, by default :func:`scale_dtype` of
    ``attention``) and the permanent forward pre-hook (once), and starts recording the ranges of its keys and values.
    A module already calibrated keeps its scales.

    Raises:
        ValueError: per-head scales for an attention whose number of key/value heads is unknown; or ``attention``
            holds a KV-cache scheme already (an earlier run's on the same model object) that differs from ``args``
            (the later one was dropped without a word, or failed on the scales' shape at its end; found by testers).
    """
    held = getattr(attention, SCHEME_ATTR, None)
    if held is not None and describe(held) != describe(args):
        msg = (
            f"{type(attention).__name__}: its KV cache is quantized already with {describe(held)}, and another "
            f"modifier gives {describe(args)}: an attention's KV cache is quantized once; the model holds KV-cache "
            "scales already (from an earlier run on this model object, or load_kv_cache_scales; two modifiers of one "
            "recipe are refused before any work): start again from the original model, or give the same scheme"
        )
        raise ValueError(msg)
    if held is None:
        shape = _scale_shape(attention, args, kv_heads, "KV")
        dtype = scale_dtype(attention) if dtype is None else dtype
        for base in ("k", "v"):
            _register_scale(attention, base, shape, dtype)
        setattr(attention, SCHEME_ATTR, args.model_copy(deep=True))
        attention.register_forward_pre_hook(_swap_cache, with_kwargs=True)
    _start_recording(attention, args)


def describe(args: QuantizationArgs) -> str:
    """``{strategy: tensor, observer: minmax}``: the fields of a resolved KV-cache scheme that can differ (the
    others are fixed by :func:`resolve_kv_cache_scheme`), for messages and comparisons."""
    strategy = getattr(args.strategy, "value", args.strategy)
    return f"{{strategy: {strategy}, observer: {args.observer}}}"


def _scale_shape(attention: nn.Module, args: QuantizationArgs, heads_of: Any, what: str) -> tuple[int, ...]:
    """``[1]`` per tensor, ``[heads, 1, 1]`` per head (``heads_of(attention)``).

    Raises:
        ValueError: per-head scales and ``heads_of`` gives ``None`` (no ``head_dim``).
    """
    if args.strategy != QuantizationStrategy.ATTN_HEAD:
        return (1,)
    heads = heads_of(attention)
    if heads is None:
        msg = f"{type(attention).__name__}: per-head {what} scales need its head_dim; use strategy: tensor"
        raise ValueError(msg)
    return (heads, 1, 1)


def scale_dtype(attention: nn.Module, layer: nn.Module | None = None) -> torch.dtype:
    """The dtype ``attention`` computes in, which its ``k_scale`` / ``v_scale`` (and ``q_scale``) take, as
    compressed-tensors' ``initialize_attn_qparams`` gives them: that of its floating weights (a parameter named
    ``weight``: its projections' or norms', never a scale); with none (a compressed-tensors checkpoint reloaded by
    transformers holds ``weight_packed`` uint8, ``weight_scale`` FP8 and ``weight_global_scale`` float32 until its
    first forward), that of ``layer``'s (its decoder layer's norms), else its config's ``dtype``, else float32.

    Found by a tester: the scales took the dtype of the attention's first parameter, on a reloaded NVFP4 checkpoint
    a float32 global scale, and the keys and values then fake-quantized into float32 broke a bfloat16 forward
    ("Expected query, key, and value to have the same dtype").
    """
    for module in (attention, layer):
        found = None if module is None else _weights_dtype(module)
        if found is not None:
            return found
    configured = getattr(getattr(attention, "config", None), "dtype", None)
    if isinstance(configured, str):
        configured = getattr(torch, configured, None)
    return configured if configured in _FLOAT_DTYPES else torch.float32


def _weights_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype of ``module``'s first floating parameter named ``weight`` (at any depth), or ``None``."""
    weights = (p for name, p in module.named_parameters() if name.rsplit(".", 1)[-1] == "weight")
    return next((p.dtype for p in weights if p.dtype in _FLOAT_DTYPES), None)


def _register_scale(attention: nn.Module, base: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A NaN (not calibrated) ``<base>_scale`` parameter of ``shape`` and ``dtype``, on the attention's device."""
    scale = torch.full(shape, math.nan, dtype=dtype, device=next(attention.parameters()).device)
    attention.register_parameter(f"{base}_scale", nn.Parameter(scale, requires_grad=False))


def _start_recording(attention: nn.Module, args: QuantizationArgs) -> None:
    if not calibrated(attention):
        per_head = args.strategy == QuantizationStrategy.ATTN_HEAD
        bases = ("q", "k", "v") if getattr(attention, "q_scale", None) is not None else ("k", "v")
        attention.__dict__[_STATE_ATTR] = {base: KVRange(per_head) for base in bases}


def hooked_attention_refusal(model: nn.Module) -> str | None:
    """Why attention quantization (:func:`install_query`) cannot run on ``model``, or ``None`` when it can.

    compressed-tensors' hooked attention (``ct_hooked_attention``) calls the model's original attention
    implementation (its config's ``_attn_implementation``) by name through transformers' ``ALL_ATTENTION_FUNCTIONS``,
    which holds ``sdpa`` and the flash / flex ones but not ``eager``: on an eager model (Gemma2 under transformers
    5.25, which refuses ``sdpa`` for it; GPT-OSS by default) the first calibration forward failed with a bare
    ``KeyError: 'eager'`` after the modules were hooked (found by a tester). The KV cache alone
    (``kv_cache_scheme``) needs no hooked attention and works on such a model.

    Returns:
        One line naming the model, its attention implementation, why, and what to do; ``None`` when the
        implementation is hooked already or is one ``ALL_ATTENTION_FUNCTIONS`` holds.
    """
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation == HOOKED_ATTENTION_NAME or implementation in ALL_ATTENTION_FUNCTIONS:
        return None
    return (
        f"{model_family(model)}: attention quantization needs the model's attention implementation in transformers' "
        f"ALL_ATTENTION_FUNCTIONS, and it is {implementation!r}, which is not there (compressed-tensors' hooked "
        "attention calls the original implementation through it: the calibration forward would fail with KeyError "
        f"{implementation!r}); load the model with attn_implementation='sdpa' where its family allows it "
        "(from_pretrained(..., attn_implementation='sdpa'), then pass the model), or quantize the KV cache alone "
        "(kv_cache_scheme), which works with it"
    )


def install_query(model: nn.Module, attention: nn.Module, scheme: QuantizationScheme) -> None:
    """Quantize ``attention``'s queries too (attention quantization): FP8 ``q_scale`` from calibration.

    Call after :func:`install` with ``scheme.input_activations``. Registers ``q_scale`` (NaN: not calibrated;
    ``[1]`` per tensor, ``[num_heads, 1, 1]`` per head) and, through compressed-tensors' hooked attention
    (``initialize_hooked_attention``: the model's attention implementation becomes ``ct_hooked_attention``, which
    calls the original one) a query hook (``register_query_hook``: the queries after the rotary embedding, ``[batch,
    heads, seq, head_dim]``) that records their range while the scales are not calibrated, and afterwards
    fake-quantizes them with ``q_scale`` unless the attention's ``quantization_enabled`` is off. ``scheme`` (targets
    as given) is kept on the module for the saved config.

    Raises:
        ValueError: per-head scales for an attention whose number of query heads is unknown.
    """
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.modeling.attention import initialize_hooked_attention, register_query_hook

    args = getattr(attention, SCHEME_ATTR)
    if getattr(attention, "q_scale", None) is None:
        shape = _scale_shape(attention, args, query_heads, "query")
        _register_scale(attention, "q", shape, attention.k_scale.dtype)  # the dtype install gave the KV scales
        saved = scheme.model_copy(deep=True)
        saved.format = CompressionFormat.dense  # what compressed-tensors writes for it (no weight to compress)
        setattr(attention, ATTENTION_SCHEME_ATTR, saved)
        initialize_hooked_attention(model, attention)
        register_query_hook(attention, _query_hook)
    _start_recording(attention, args)


def _query_hook(attention: nn.Module, query: torch.Tensor) -> torch.Tensor | None:
    """compressed-tensors' query hook: record the post-RoPE queries' range, or fake-quantize them (see
    :func:`install_query`)."""
    if not calibrated(attention):
        ranges = attention.__dict__.get(_STATE_ATTR)
        if ranges is not None and "q" in ranges:
            ranges["q"].add(query)
        return None
    if not getattr(attention, "quantization_enabled", True):
        return None
    return fake_quantize(query, attention.q_scale, None, getattr(attention, SCHEME_ATTR))


def nonfinite_states(attention: nn.Module) -> list[str]:
    """Which of ``attention``'s recorded states (``"k"``, ``"v"``, ``"q"``) reached NaN or Inf on the calibration
    tokens (their scales would be NaN); ``[]`` when none did or nothing is recorded."""
    ranges = attention.__dict__.get(_STATE_ATTR) or {}
    return [
        base for base, state in ranges.items() if any(not bool(torch.isfinite(r).all()) for r in state.ranges.values())
    ]


def gather_over_ranks(attention: nn.Module) -> None:
    """Under ``torch.distributed``, make ``attention``'s recorded ranges every rank's
    (:meth:`KVRange.gather_over_ranks`), before :func:`nonfinite_states` and :func:`set_scales` (which then decide
    alike on every rank). A collective: every rank calls it for the same attention modules in the same order.
    Nothing when it is calibrated, not recording, or without a process group.

    Raises:
        DistributedError: the collective failed (another rank stopped).
    """
    ranges = attention.__dict__.get(_STATE_ATTR)
    if not is_distributed() or calibrated(attention) or ranges is None:
        return
    for base, state in ranges.items():
        state.gather_over_ranks(tuple(getattr(attention, f"{base}_scale").shape))


def set_scales(attention: nn.Module) -> bool:
    """Compute ``attention``'s ``k_scale`` / ``v_scale`` (and ``q_scale``, :func:`install_query`) from the recorded
    ranges and stop recording (under ``torch.distributed``, after :func:`gather_over_ranks`).

    Returns:
        ``True`` when the scales are calibrated (now or before); ``False`` when no key/value (or query) states were
        seen (recording goes on).
    """
    if calibrated(attention):
        attention.__dict__.pop(_STATE_ATTR, None)
        return True
    ranges = attention.__dict__.get(_STATE_ATTR)
    if ranges is None or not all(r.calls for r in ranges.values()):
        return False
    del attention.__dict__[_STATE_ATTR]
    args = getattr(attention, SCHEME_ATTR)
    for base in ranges:
        lo, hi = ranges[base].ranges[args.observer].to(ranges[base].dtype)  # in the states' dtype, as observed
        scale, _ = calculate_qparams(lo, hi, args)
        param = getattr(attention, f"{base}_scale")
        param.data.copy_(scale.reshape(param.shape).to(param.dtype))
    return True


def load_kv_cache_scales(model: nn.Module, directory: str | Path) -> int:
    """Give ``model``, loaded by transformers from ``directory``, the KV-cache quantization its checkpoint holds.

    Reads ``quantization_config.kv_cache_scheme`` of ``directory/config.json`` and the ``<attention>.k_scale`` /
    ``<attention>.v_scale`` tensors of its ``*.safetensors`` files, and sets them on the attention modules of
    ``model`` (:func:`install`), which then fake-quantize their keys and values as the model that was saved did.
    A config group quantizing the attention's input activations only (attention quantization) also gives the
    attention modules it targets their ``<attention>.q_scale`` (:func:`install_query`); the KV cache is then
    quantized on those modules only.

    Returns:
        The number of attention modules given scales (0 when the checkpoint has no ``kv_cache_scheme``).

    Raises:
        ValueError: an attention module of ``model`` has no scales in the checkpoint, or a scale's shape differs; or
            (attention quantization) the model's attention implementation cannot be hooked
            (:func:`hooked_attention_refusal`: an ``eager`` model). The model is then left as it was.
    """
    from compressed_tensors.utils.match import is_match
    from safetensors import safe_open

    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("quantization_config") or {}
    args = resolve_kv_cache_scheme(config.get("kv_cache_scheme"))
    if args is None:
        return 0
    scales: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as fh:
            keys = [key for key in fh.keys() if key.endswith((".q_scale", ".k_scale", ".v_scale"))]
            scales.update({key: fh.get_tensor(key) for key in keys})
    groups = [
        QuantizationScheme.model_validate(group)
        for group in (config.get("config_groups") or {}).values()
        if group.get("weights") is None and group.get("input_activations") is not None
    ]
    attention = attention_modules(model)
    if groups:
        attention = {n: m for n, m in attention.items() if is_match(n, m, groups[0].targets, config.get("ignore"))}
        refusal = hooked_attention_refusal(model) if attention else None
        if refusal is not None:
            raise ValueError(f"{directory}: {refusal}")
    bases = ("q", "k", "v") if groups else ("k", "v")
    for name, module in attention.items():  # every shape first: a refused checkpoint leaves the model as it was
        for base in bases:
            value = scales.get(f"{name}.{base}_scale")
            heads_of, what = (query_heads, "query") if base == "q" else (kv_heads, "KV")
            try:
                shape = _scale_shape(module, args, heads_of, what)
            except ValueError as exc:
                raise ValueError(f"{directory}: {name}: {exc}") from None
            if value is None or tuple(value.shape) != shape:
                got = "none" if value is None else list(value.shape)
                msg = f"{directory}: {name}.{base}_scale: expected shape {list(shape)}, the checkpoint has {got}"
                raise ValueError(msg)
    for name, module in attention.items():
        layer = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else None
        install(module, args, dtype=scale_dtype(module, layer))
        if groups:
            install_query(model, module, groups[0])
        for base in bases:
            param = getattr(module, f"{base}_scale")
            param.data.copy_(scales[f"{name}.{base}_scale"].to(param.dtype))
        module.__dict__.pop(_STATE_ATTR, None)
    return len(attention)
