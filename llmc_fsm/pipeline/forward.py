"""Forward primitives of the sequential pipeline: a decoder layer's captured inputs, its recorded calls, its output.

* :func:`capture_layer_inputs` — run the model up to a layer and keep that layer's positional and keyword inputs per
  batch (the forward stops there);
* :func:`record_calls` / :func:`call_order` — one forward of a layer, recording which submodules are called in which
  order and on which input (before the modifiers hook it);
* :func:`first_output` / :func:`with_hidden` — the hidden states a layer returns, and inputs carrying new ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "Calls",
    "Inputs",
    "StopForward",
    "call_order",
    "capture_layer_inputs",
    "first_output",
    "record_calls",
    "with_hidden",
]

#: Per calibration batch: the (positional args, keyword args) a decoder layer is called with.
Inputs = list[tuple[tuple[Any, ...], dict[str, Any]]]

#: A recorded forward of a decoder layer (:func:`record_calls`): per submodule call, in order,
#: ``(name relative to the layer, input number)``; equal numbers mean the same input tensor.
Calls = list[tuple[str, int]]


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


def first_output(output: Any) -> torch.Tensor:
    """The hidden states in a decoder layer's output (a tensor, a tuple's first item or ``.hidden_states``).

    Raises:
        TypeError: none of these.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list):
        return output[0]
    hidden = getattr(output, "hidden_states", None)
    if isinstance(hidden, torch.Tensor):
        return hidden
    msg = f"cannot read the hidden states from a decoder layer output of type {type(output).__name__}"
    raise TypeError(msg)


def record_calls(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Calls:
    """Run ``layer`` once on ``(args, kwargs)`` and return its submodules' calls in order.

    Each call is ``(name relative to layer, input number)``: calls with the
    same number got the same first input tensor (``q/k/v_proj``). Run it
    before the modifiers hook the layer, so that no statistics are gathered.
    """
    calls: Calls = []
    sources: list[Any] = []

    def number(x: Any) -> int:
        for i, seen in enumerate(sources):
            if seen is x:
                return i
        sources.append(x)
        return len(sources) - 1

    handles = []
    for name, sub in layer.named_modules():
        if sub is layer:
            continue

        def record(module: nn.Module, call_args: tuple[Any, ...], _name: str = name) -> None:
            calls.append((_name, number(call_args[0]) if call_args else -1 - len(calls)))

        handles.append(sub.register_forward_pre_hook(record))
    try:
        layer(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def call_order(calls: Calls) -> dict[str, int]:
    """``{relative name: position of its last call}`` from :func:`record_calls`."""
    return {name: position for position, (name, _) in enumerate(calls)}


def with_hidden(inputs: Inputs, hidden: list[torch.Tensor]) -> Inputs:
    """``inputs`` with each batch's hidden states (first positional argument) replaced by ``hidden``."""
    return [((out, *args[1:]), kwargs) for out, (args, kwargs) in zip(hidden, inputs, strict=True)]
