"""How one decoder layer is run by the sequential pipeline (:mod:`llmc_fsm.pipeline`).

* :func:`capture_layer_inputs` — run the model up to a layer and keep that layer's
  positional and keyword inputs per batch (the forward stops there);
* :func:`calibrate_layer` — run every batch through a layer for the modifiers'
  hooks, ending each forward at the input of the last hooked submodule when
  nothing after it is observed (:func:`early_exit_module`);
* :func:`propagate` — replace each batch's hidden states by the layer's output.

Everything here runs under the caller's ``torch.no_grad``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from llmc_fsm.torch_hooks import global_forward_hooks_installed, hook_count

__all__ = [
    "Inputs",
    "StopForward",
    "calibrate_layer",
    "capture_layer_inputs",
    "early_exit_module",
    "propagate",
]

#: Per calibration batch: the (positional args, keyword args) a decoder layer is called with.
Inputs = list[tuple[tuple[Any, ...], dict[str, Any]]]


class StopForward(Exception):
    """Raised by the capture hook on layer 0 to end the model's forward early."""


def _device_of(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def capture_layer_inputs(model: nn.Module, layer: nn.Module, batches: list[dict[str, Any]]) -> Inputs:
    """Run each batch through the model up to ``layer`` and return its (args, kwargs) per batch.

    Raises:
        RuntimeError: the model's forward returned without calling ``layer``.
    """
    captured: Inputs = []

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
        raise StopForward

    handle = layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    device = _device_of(model)
    try:
        for batch in batches:
            inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            inputs.setdefault("use_cache", False)
            try:
                model(**inputs)
            except StopForward:
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


def _run_layer(layer: nn.Module, inputs: Inputs) -> Iterator[torch.Tensor]:
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
    return hook_count(module, ("forward",) if post_only else ("forward", "forward_pre")) > 0


def early_exit_module(layer: nn.Module, order: Mapping[str, int]) -> nn.Module | None:
    """The module at whose input the calibration pass of ``layer`` may stop, or ``None``.

    That is the hooked submodule called last (by ``order``, the call order of
    an earlier layer of the same class), provided it has only forward
    pre-hooks: nothing after its input is observed. ``None`` (run the whole
    layer) when nothing in the layer is hooked, the layer itself or a module
    with forward hooks is hooked last, a hooked module was never called in the
    recorded forward, or global module hooks are installed.
    """
    if global_forward_hooks_installed():
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
    raise StopForward


def calibrate_layer(layer: nn.Module, inputs: Inputs, order: dict[str, int] | None) -> None:
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
    stop_at = early_exit_module(layer, order) if order is not None else None
    handle = stop_at.register_forward_pre_hook(_raise_stop) if stop_at is not None else None
    try:
        for args, kwargs in inputs[start:]:
            try:
                layer(*args, **kwargs)
            except StopForward:
                continue
    finally:
        if handle is not None:
            handle.remove()


def propagate(layer: nn.Module, inputs: Inputs) -> Inputs:
    """``inputs`` with each batch's hidden states replaced by ``layer``'s output on them."""
    outputs = list(_run_layer(layer, inputs))
    return [((out, *args[1:]), kwargs) for out, (args, kwargs) in zip(outputs, inputs, strict=True)]
