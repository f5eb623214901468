"""The sequential calibration pipeline: calibrate and compress a model one decoder layer at a time.

Flow (:func:`run_sequential`)::

    capture the inputs of decoder layer 0      (embedding runs once per batch)
    session.calibration_start()
    for each decoder layer:
        run every calibration batch through the layer   (modifier hooks gather statistics;
                                                         each forward ends at the input of
                                                         the last hooked module)
        session.sequential_epoch_end([layer])           (modifiers compress the layer)
        run the batches through the compressed layer    (its outputs feed the next layer)
    session.calibration_end()

Peak memory is the model plus one layer's activations for the calibration
batches (and whatever statistics the modifiers keep for that layer), not the
activations of the whole model. Everything runs under ``torch.no_grad``.

Only the decoder layers are calibrated: the embedding, the final norm and the
head see no calibration pass, so modifiers must not target modules outside
the layers (checked before any work, see :func:`check_targets_in_layers`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

if TYPE_CHECKING:
    from llmc_fsm.session import Session

__all__ = [
    "PipelineResult",
    "calibration_batches",
    "check_targets_in_layers",
    "find_decoder_layers",
    "run_sequential",
]

logger = logging.getLogger(__name__)


class _StopForward(Exception):
    """Raised by the capture hook on layer 0 to end the model's forward early."""


@attrs.define(kw_only=True)
class PipelineResult:
    """What :func:`run_sequential` did.

    Attributes:
        layers_name: qualified name of the decoder-layer list (e.g. ``"model.layers"``).
        num_layers: decoder layers calibrated.
        num_batches: calibration batches per layer.
        num_tokens: calibration tokens (all batches).
        layer_seconds: wall time per layer (calibration + compression + propagation).
        seconds: total wall time of the pipeline.
    """

    layers_name: str
    num_layers: int
    num_batches: int
    num_tokens: int
    layer_seconds: list[float]
    seconds: float


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Return ``(qualified name, ModuleList)`` of the model's decoder layers.

    The decoder layers are the largest ``nn.ModuleList`` whose children all
    have the same class (``model.model.layers`` for Llama-style models); ties go
    to the one found first.

    Raises:
        ValueError: no ``ModuleList`` of same-class blocks exists.
    """
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            kinds = {type(child) for child in module}
            if len(kinds) == 1 and (best is None or len(module) > len(best[1])):
                best = (name, module)
    if best is None:
        msg = (
            f"cannot find the decoder layers of {type(model).__name__}: the sequential pipeline needs an "
            "nn.ModuleList of same-class blocks (e.g. model.model.layers)"
        )
        raise ValueError(msg)
    return best


def calibration_batches(data: Any, *, batch_size: int = 8) -> list[dict[str, Any]]:
    """Turn calibration data into a list of keyword-argument dicts for ``model(**batch)``.

    Accepted ``data``:

    * a ``LongTensor[N, L]`` of token windows: split into batches of ``batch_size`` rows;
    * an iterable of ``LongTensor[B, L]`` (``input_ids`` batches) or of mappings
      (passed to the model as keyword arguments, e.g. ``{"input_ids": ..., "attention_mask": ...}``).

    Raises:
        ValueError: empty data, ``batch_size < 1``, or an unsupported item type.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        msg = f"batch_size must be a positive int, got {batch_size!r}"
        raise ValueError(msg)
    if isinstance(data, torch.Tensor):
        if data.dim() == 1:
            data = data.unsqueeze(0)
        if data.dim() != 2 or data.is_floating_point():
            msg = f"calibration tensor must be integer token ids of shape [N, L], got {data.dtype} {tuple(data.shape)}"
            raise ValueError(msg)
        batches = [{"input_ids": chunk} for chunk in data.split(batch_size)]
    else:
        batches = []
        for item in data:
            if isinstance(item, torch.Tensor):
                batches.append({"input_ids": item if item.dim() == 2 else item.unsqueeze(0)})
            elif isinstance(item, Mapping):
                batches.append(dict(item))
            else:
                msg = f"calibration batches must be LongTensors or dicts of model inputs, got {type(item).__name__}"
                raise ValueError(msg)
    if not batches:
        msg = "calibration data is empty: give at least one batch of token ids"
        raise ValueError(msg)
    return batches


def check_targets_in_layers(session: Session, layers: nn.ModuleList, layers_name: str) -> None:
    """Raise before any work if a modifier targets a module the pipeline never calibrates.

    Modifiers that expose ``resolved_targets`` (``{name: module}``, e.g. the
    pruning plugin's) are checked; others are trusted.

    Raises:
        ValueError: naming the modifier, the modules outside the layers and the fix.
    """
    inside = {id(m) for m in layers.modules()}
    for modifier in session.modifiers:
        targets = getattr(modifier, "resolved_targets", None)
        if not isinstance(targets, Mapping):
            continue
        outside = [name for name, module in targets.items() if id(module) not in inside]
        if outside:
            shown = ", ".join(outside[:5]) + (f" and {len(outside) - 5} more" if len(outside) > 5 else "")
            msg = (
                f"{modifier.modifier_name()} targets {shown}, outside the decoder layers ({layers_name}); the "
                "sequential pipeline calibrates only the decoder layers. Add them to the modifier's ignore list."
            )
            raise ValueError(msg)


def _device_of(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _capture_layer_inputs(
    model: nn.Module, layer: nn.Module, batches: list[dict[str, Any]]
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Run each batch through the model up to ``layer`` and return its (args, kwargs) per batch."""
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kwargs = dict(kwargs)
        # No KV cache: the pipeline calls each layer several times on the same inputs.
        for key in ("past_key_values", "past_key_value", "cache"):
            if key in kwargs:
                kwargs[key] = None
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        if not args and "hidden_states" in kwargs:
            args = (kwargs.pop("hidden_states"),)
        captured.append((tuple(args), kwargs))
        raise _StopForward

    handle = layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    device = _device_of(model)
    try:
        for batch in batches:
            inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            inputs.setdefault("use_cache", False)
            try:
                model(**inputs)
            except _StopForward:
                continue
            msg = f"the model's forward never reached its first decoder layer ({type(layer).__name__})"
            raise RuntimeError(msg)
    finally:
        handle.remove()
    return captured


def _first(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list):
        return output[0]
    hidden = getattr(output, "hidden_states", None)
    if isinstance(hidden, torch.Tensor):
        return hidden
    msg = f"cannot read the hidden states from a decoder layer output of type {type(output).__name__}"
    raise TypeError(msg)


def _run_layer(layer: nn.Module, inputs: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> Iterator[torch.Tensor]:
    for args, kwargs in inputs:
        yield _first(layer(*args, **kwargs))


def _record_call_order(layer: nn.Module) -> tuple[dict[str, int], list[Any]]:
    """Hook every submodule of ``layer`` to record ``{relative name: index of its last call}``.

    Returns the (live) record and the handles to remove once one forward has run.
    """
    order: dict[str, int] = {}
    calls = itertools.count()
    handles = []
    for name, sub in layer.named_modules():
        if sub is layer:
            continue

        def record(module: nn.Module, args: Any, _name: str = name) -> None:
            order[_name] = next(calls)

        handles.append(sub.register_forward_pre_hook(record))
    return order, handles


def _has_hooks(module: nn.Module, *, post_only: bool = False) -> bool:
    post = bool(getattr(module, "_forward_hooks", None))
    return post if post_only else post or bool(getattr(module, "_forward_pre_hooks", None))


def _early_exit_module(layer: nn.Module, order: Mapping[str, int]) -> nn.Module | None:
    """The module at whose input the calibration pass of ``layer`` may stop, or ``None``.

    That is the hooked submodule called last (by ``order``, the call order of
    an earlier layer of the same class), provided it has only forward
    pre-hooks: nothing after its input is observed. ``None`` (run the whole
    layer) when nothing in the layer is hooked, the layer itself or a module
    with forward hooks is hooked last, a hooked module was never called in the
    recorded forward, or global module hooks are installed.
    """
    from torch.nn.modules import module as torch_module

    if getattr(torch_module, "_global_forward_hooks", None) or getattr(torch_module, "_global_forward_pre_hooks", None):
        return None
    if _has_hooks(layer, post_only=True):
        return None
    last, last_pos = None, -1
    for name, sub in layer.named_modules():
        if sub is layer or not _has_hooks(sub):
            continue
        pos = order.get(name)
        if pos is None:
            return None
        if pos > last_pos:
            last, last_pos = sub, pos
    if last is None or _has_hooks(last, post_only=True):
        return None
    return last


def _raise_stop(module: nn.Module, args: Any) -> None:
    raise _StopForward


def _calibrate_layer(
    layer: nn.Module, inputs: list[tuple[tuple[Any, ...], dict[str, Any]]], order: dict[str, int] | None
) -> None:
    """Run every batch through ``layer`` for its hooks, stopping early where nothing later is observed.

    ``order`` (``None``: never stop early) is filled on the first forward if
    empty and then reused for the layers that follow.
    """
    start = 0
    if order is not None and not order:
        recorded, handles = _record_call_order(layer)
        try:
            layer(*inputs[0][0], **inputs[0][1])
        finally:
            for handle in handles:
                handle.remove()
        order.update(recorded)
        start = 1
    stop_at = _early_exit_module(layer, order) if order is not None else None
    handle = stop_at.register_forward_pre_hook(_raise_stop) if stop_at is not None else None
    try:
        for args, kwargs in inputs[start:]:
            try:
                layer(*args, **kwargs)
            except _StopForward:
                continue
    finally:
        if handle is not None:
            handle.remove()


def run_sequential(
    session: Session,
    *,
    model: nn.Module | None = None,
    calibration_data: Any = None,
    batch_size: int = 8,
    progress: bool = True,
    early_exit: bool = True,
) -> PipelineResult:
    """Calibrate and compress ``model`` layer by layer through ``session``'s modifiers.

    Fires ``calibration_start()``, one ``sequential_epoch_end([layer])`` per
    decoder layer, and ``calibration_end()``; it does not finalize the session.

    Args:
        session: an initialized session (its modifiers hook the layers at
            ``calibration_start``).
        model: default: the session state's ``model``.
        calibration_data: default: the session state's ``calibration_data``;
            see :func:`calibration_batches` for the accepted forms.
        batch_size: rows per forward pass when the data is a ``[N, L]`` tensor.
        progress: show a tqdm bar over the layers (stderr).
        early_exit: end each calibration forward at the input of the last
            hooked submodule when nothing after it is observed (see
            :func:`_early_exit_module`); for Llama-style layers whose
            ``down_proj`` is hooked by pre-hooks this skips ``down_proj`` and
            the residual, ~1/4 of the calibration pass. Set ``False`` for a
            modifier that observes the layer by other means than torch hooks.

    Returns:
        A :class:`PipelineResult`.

    Raises:
        LifecycleError: the session is not initialized (or finalized).
        ValueError: no decoder layers, empty data, or a modifier targets a module
            outside the decoder layers — all raised before any work.
    """
    from tqdm.auto import tqdm

    from llmc_fsm.errors import LifecycleError

    t_start = time.perf_counter()
    if session.lifecycle not in ("initialized", "running"):
        msg = (
            f"run_sequential() needs an initialized session (lifecycle is {session.lifecycle!r}); "
            "call session.initialize(model=..., calibration_data=...) first"
        )
        raise LifecycleError(msg, lifecycle=session.lifecycle, call="run_sequential", allowed=session.allowed_calls)
    model = model if model is not None else session.state.model
    if model is None:
        msg = "run_sequential() needs a model: pass model= or put it in the session state"
        raise ValueError(msg)
    data = calibration_data if calibration_data is not None else session.state.calibration_data
    if data is None:
        msg = "run_sequential() needs calibration data: pass calibration_data= or put it in the session state"
        raise ValueError(msg)
    batches = calibration_batches(data, batch_size=batch_size)
    layers_name, layers = find_decoder_layers(model)
    check_targets_in_layers(session, layers, layers_name)
    num_tokens = sum(int(b["input_ids"].numel()) for b in batches if isinstance(b.get("input_ids"), torch.Tensor))

    was_training = model.training
    model.eval()
    layer_seconds: list[float] = []
    try:
        with torch.no_grad():
            inputs = _capture_layer_inputs(model, layers[0], batches)
            session.calibration_start()
            # Call order of the submodules, recorded during the first forward of layer 0.
            order: dict[str, int] = {}
            bar = tqdm(
                range(len(layers)), desc="calibrating layers", unit="layer", disable=not progress, leave=False
            )
            for index in bar:
                t0 = time.perf_counter()
                layer = layers[index]
                # 1) calibration pass: the modifiers' hooks see every batch.
                _calibrate_layer(layer, inputs, order if early_exit else None)
                # 2) compress this layer.
                session.sequential_epoch_end([layer])
                # 3) propagate the compressed layer's outputs to the next layer.
                if index + 1 < len(layers):
                    outputs = list(_run_layer(layer, inputs))
                    inputs = [((out, *args[1:]), kwargs) for out, (args, kwargs) in zip(outputs, inputs, strict=True)]
                layer_seconds.append(time.perf_counter() - t0)
            bar.close()
            del inputs
            session.calibration_end()
    finally:
        model.train(was_training)
    result = PipelineResult(
        layers_name=layers_name,
        num_layers=len(layers),
        num_batches=len(batches),
        num_tokens=num_tokens,
        layer_seconds=layer_seconds,
        seconds=time.perf_counter() - t_start,
    )
    logger.info("sequential pipeline: %d layers, %d batches in %.2f s", len(layers), len(batches), result.seconds)
    return result


def iter_modules(modules: Any) -> Iterable[nn.Module]:
    """Yield every module under ``modules`` (a module or an iterable of modules)."""
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    for root in roots:
        yield from root.modules()
