"""Forward primitives of the sequential pipeline: a decoder layer's captured inputs, its recorded calls, its output.

* :func:`capture_layer_inputs` — run the model's forward over its decoder layers (none computing anything) and keep
  per batch the positional and keyword inputs the model gives each layer (:class:`LayerKwargs`);
* :func:`record_calls` / :func:`call_order` — one forward of a layer, recording which submodules are called in which
  order and on which input (before the modifiers hook it);
* :func:`first_output` / :func:`with_hidden` — the hidden states a layer returns, and inputs carrying new ones.
"""

from __future__ import annotations

import contextlib
import inspect
import typing
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from llmc_fsm.pipeline.device import OffloadedInputs, onloaded
from llmc_fsm.toolkit.targets import model_family

__all__ = [
    "Calls",
    "Inputs",
    "LayerKwargs",
    "OutputKind",
    "StopForward",
    "call_order",
    "capture_layer_inputs",
    "first_output",
    "inputs_of",
    "layer_output",
    "record_calls",
    "record_calls_per_class",
    "replaying",
    "with_hidden",
]

#: Per calibration batch: the (positional args, keyword args) a decoder layer is called with.
Inputs = list[tuple[tuple[Any, ...], dict[str, Any]]]

#: A recorded forward of a decoder layer (:func:`record_calls`): per submodule call, in order,
#: ``(name relative to the layer, input number)``; equal numbers mean the same input tensor.
Calls = list[tuple[str, int]]


class StopForward(Exception):
    """Raised by the capture hook on layer 0 to end the model's forward early."""


#: Keyword arguments holding a KV / state cache: the pipeline calls each layer several times on the same inputs.
_CACHE_KEYS = ("past_key_values", "past_key_value", "cache", "cache_params", "layer_past")


class LayerKwargs(dict):
    """One batch's keyword inputs of one decoder layer, knowing those the model gives every later layer.

    A plain ``dict`` to the layer (``layer(*args, **kwargs)``). :func:`with_hidden` builds the next layer's
    inputs from it: the next layer's own keyword (and extra positional) arguments as the model's forward
    passed them in the capture (:func:`capture_layer_inputs`): its attention mask (sliding-window or full),
    its rotary embeddings (local or global rope), its cache arguments.

    Attributes:
        index: the position of this layer in ``per_layer``.
        per_layer: per decoder layer (from the captured one on), ``(positional args after the hidden states,
            keyword args)``; the tensors are shared between layers wherever the model shares them.
    """

    __slots__ = ("index", "per_layer")

    def __init__(self, per_layer: list[tuple[tuple[Any, ...], dict[str, Any]]], index: int) -> None:
        super().__init__(per_layer[index][1])
        self.per_layer = per_layer
        self.index = index

    def at(self, index: int) -> tuple[tuple[Any, ...], LayerKwargs]:
        """``(extra positional args, keyword args)`` of layer ``index`` (counted like :attr:`per_layer`)."""
        return self.per_layer[index][0], LayerKwargs(self.per_layer, index)


def _device_of(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _no_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call without KV cache and with the hidden states as first positional argument."""
    kwargs = dict(kwargs)
    for key in _CACHE_KEYS:
        if key in kwargs:
            kwargs[key] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    if not args and "hidden_states" in kwargs:
        args = (kwargs.pop("hidden_states"),)
    return tuple(args), kwargs


def _layer_list(model: nn.Module, layer: nn.Module) -> list[nn.Module]:
    """``layer`` and the layers after it in the ``nn.ModuleList`` that holds it (``[layer]`` when none does)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for index, child in enumerate(module):
                if child is layer:
                    return list(module)[index:]
    return [layer]


def capture_layer_inputs(
    model: nn.Module,
    layer: nn.Module,
    batches: list[dict[str, Any]],
    *,
    device: torch.device | None = None,
    keep: Any = None,
) -> Inputs:
    """Run each batch through the model up to ``layer`` and return its (args, kwargs) per batch.

    ``device``: where the batches' tensors are put (default: that of the model's first parameter); ``keep``: called
    on each batch's hidden states as they are captured, returning where they wait for the layer (e.g.
    :meth:`llmc_fsm.pipeline.device.ActivationStore.keep`, a copy in CPU memory); default: as they are.

    The inputs of every later decoder layer (those after ``layer`` in the ``nn.ModuleList`` holding it) are
    captured in the same forward: each layer's ``forward`` is replaced, for the capture, by one that records
    its arguments and returns its hidden states unchanged, with as many other outputs as the layer returns
    (:func:`_extra_outputs`; no layer computes anything, so the layers may be on the ``meta`` device), and the
    forward ends at the last layer. The keyword arguments returned are
    :class:`LayerKwargs`: :func:`with_hidden` gives each next layer the arguments the model's own forward
    gives it (sliding-window or full attention mask, local or global rope, its cache arguments), not layer
    0's. Any KV cache argument is ``None`` and ``use_cache`` is ``False``.

    Raises:
        RuntimeError: the model's forward returned without calling ``layer``, or skipped or repeated a later
            layer (e.g. Mllama's cross-attention layers without images), or its config loops over the layers
            (Dory's ``n_recurrent_loops``): the pipeline cannot give such a layer its inputs; raised before any work.
    """
    loops = getattr(getattr(model, "config", None), "n_recurrent_loops", 1)
    if isinstance(loops, int) and loops > 1:  # the capture ends at the last layer: a loop through it goes unseen
        msg = (
            f"the forward of {model_family(model)} runs its recurrent decoder layers {loops} times (n_recurrent_loops "
            "in its config); the sequential pipeline gives each layer the inputs of one call (until 2026-12-06 a loop "
            "through the last layer was calibrated on the first pass only: a tester's case)"
        )
        raise RuntimeError(msg)
    layers = _layer_list(model, layer)
    captured: Inputs = []
    device = _device_of(model) if device is None else device
    saved = [module.__dict__.get("forward") for module in layers]
    calls: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = []

    def stub(position: int) -> Any:
        extras = _extra_outputs(layers[position])
        passed = _UNANNOTATED_OUTPUTS.get(type(layers[position]).__name__)

        def forward(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = _no_cache(args, kwargs)
            if calls[position] is not None:
                msg = f"the forward of {model_family(model)} calls decoder layer {position} twice"
                raise RuntimeError(msg)
            calls[position] = (args, kwargs)
            if position + 1 == len(layers):
                raise StopForward
            if passed is not None:  # what the layer itself returns after its hidden states, computed or not
                return (args[0], *(None if key is None else kwargs.get(key) for key in passed))
            return (args[0], *(_NotComputed(position, i + 1) for i in range(extras))) if extras else args[0]

        return forward

    # Hooks on the layers see only what they saw before: layer 0's pre-hooks its real inputs; the later layers'
    # hooks and layer 0's forward hooks nothing (the stubs' calls are no forward of the layer).
    hook_dicts = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
    pre_dicts = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")
    saved_hooks = [
        {key: module.__dict__[key] for key in hook_dicts + (pre_dicts if position else ()) if key in module.__dict__}
        for position, module in enumerate(layers)
    ]
    try:
        for position, module in enumerate(layers):
            for key in saved_hooks[position]:
                setattr(module, key, OrderedDict())
            module.forward = stub(position)
        for batch in batches:
            calls[:] = [None] * len(layers)
            inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            inputs.setdefault("use_cache", False)
            try:
                model(**inputs)
            except StopForward:
                pass
            else:
                if calls[0] is None:
                    msg = f"the model's forward never reached its first decoder layer ({type(layer).__name__})"
                    raise RuntimeError(msg)
            skipped = [i for i, call in enumerate(calls) if call is None]
            if skipped:
                msg = (
                    f"the forward of {model_family(model)} skips decoder layers {skipped} (counted from the first "
                    "captured) on these calibration inputs; the sequential pipeline cannot calibrate a layer the "
                    "model does not run (e.g. cross-attention layers without their image inputs)"
                )
                raise RuntimeError(msg)
            _check_carried(model, calls)  # type: ignore[arg-type]
            per_layer = [(args[1:], kwargs) for args, kwargs in calls]  # type: ignore[misc]
            first_args = calls[0][0]  # type: ignore[index]
            hidden = first_args[0] if keep is None else keep(first_args[0])
            captured.append(((hidden, *per_layer[0][0]), LayerKwargs(per_layer, 0)))
    finally:
        for module, forward, hooks in zip(layers, saved, saved_hooks, strict=True):
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
            for key, value in hooks.items():
                setattr(module, key, value)
    return captured


class _NotComputed:
    """What a capture stub returns for a decoder layer's outputs after its hidden states (it computes nothing)."""

    __slots__ = ("index", "layer")

    def __init__(self, layer: int, index: int) -> None:
        self.layer, self.index = layer, index


#: Decoder layer classes whose forward returns a tuple with no return annotation saying so: class name -> per output
#: after the hidden states, what the capture stub returns for it: the keyword argument of that name as the layer was
#: given it, or ``None``. RWKV's ``RwkvBlock`` returns ``(hidden, state, attentions)``, which ``RwkvModel.forward``
#: unpacks: its ``state`` is the recurrent state it was given, updated in place (``None`` without ``use_cache``, as
#: the pipeline calls it: each block then starts from a zero state, as from an empty cache), its ``attentions`` is
#: ``None`` unless asked for (a bare tensor crashed the capture with an error that depended on the batch size,
#: "not enough values to unpack", "too many values to unpack"; found by a tester).
_UNANNOTATED_OUTPUTS: dict[str, tuple[str | None, ...]] = {"RwkvBlock": ("state", None)}


def _extra_outputs(layer: nn.Module) -> int:
    """How many outputs ``layer``'s forward returns after its hidden states: for a class of
    :data:`_UNANNOTATED_OUTPUTS`, its count; else by its return annotation: a ``tuple[...]`` of ``n`` items gives
    ``n - 1`` (Bamba's ``(hidden_states, attn_weights)``, GLM-5's ``(hidden_states, topk_indices)``: the model unpacks
    them, so the stub must return as many); anything else 0."""
    known = _UNANNOTATED_OUTPUTS.get(type(layer).__name__)
    if known is not None:
        return len(known)
    forward = type(layer).forward
    try:
        annotation = typing.get_type_hints(forward).get("return")
    except Exception:  # an annotation that does not resolve: read as written
        annotation = inspect.signature(forward).return_annotation
    if typing.get_origin(annotation) is tuple:
        items = typing.get_args(annotation)
        return len(items) - 1 if items and items[-1] is not Ellipsis else 0
    return 0


def _check_carried(model: nn.Module, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
    """Refuse a model whose forward passes a decoder layer another output than the hidden states of a layer that is
    not the one just before it: the pipeline carries a layer's other outputs (GLM-5's ``topk_indices``, given to
    the next layer as ``prev_topk_indices``) to the next layer only (:func:`with_hidden`); the capture left a
    :class:`_NotComputed` where each is passed. (The hidden states the capture gives a later layer are not used:
    the pipeline computes them.)

    Raises:
        NotImplementedError: one line naming the family, the layer and the argument; before any work.
    """
    for position, (args, kwargs) in enumerate(calls):
        for key, value in [*enumerate(args[1:], 1), *kwargs.items()]:
            if isinstance(value, _NotComputed) and value.layer != position - 1:
                msg = (
                    f"the forward of {model_family(model)} passes decoder layer {position} (counted from the first "
                    f"captured) output {value.index} of layer {value.layer} as its argument {key!r}; the sequential "
                    "pipeline carries a layer's other outputs to the next layer only: not supported"
                )
                raise NotImplementedError(msg)


def _carried(rest: tuple[Any, ...], kwargs: LayerKwargs, output: Any) -> tuple[tuple[Any, ...], LayerKwargs]:
    """The next layer's arguments with each :class:`_NotComputed` the capture left (an output of this layer after
    its hidden states that the model's forward passes on, e.g. GLM-5's ``topk_indices``) replaced by that output of
    ``output``, this layer's return value on the batch.

    Raises:
        TypeError: ``output`` is not a tuple (or list) holding that output.
    """

    def value(item: Any) -> Any:
        if not isinstance(item, _NotComputed):
            return item
        if not isinstance(output, tuple | list) or len(output) <= item.index:
            msg = f"decoder layer {item.layer} returned no output {item.index}, which the next layer is given"
            raise TypeError(msg)
        return output[item.index]

    if not any(isinstance(v, _NotComputed) for v in (*rest, *kwargs.values())):
        return rest, kwargs
    kwargs = LayerKwargs(kwargs.per_layer, kwargs.index)  # a fresh dict: the captured arguments stay as they were
    kwargs.update({key: value(item) for key, item in kwargs.items()})
    return tuple(value(item) for item in rest), kwargs


def layer_output(output: Any, kwargs: Any) -> Any:
    """What of a decoder layer's return value ``output`` (on one batch whose keyword arguments are ``kwargs``) the
    next layer needs: the whole tuple where the model's forward passes the next layer one of its other outputs
    (:func:`_carried`), else the hidden states alone (:func:`first_output`), so that no other output (e.g. attention
    weights) is held for every batch."""
    if isinstance(kwargs, LayerKwargs) and kwargs.index + 1 < len(kwargs.per_layer):
        rest, following = kwargs.per_layer[kwargs.index + 1]
        if any(isinstance(v, _NotComputed) for v in (*rest, *following.values())):
            return output
    return first_output(output)


def first_output(output: Any) -> torch.Tensor:
    """The hidden states in a decoder layer's output: the tensor itself, else the first item of a tuple (or list),
    looked into the same way (``((t,), cache)`` gives ``t``), else its ``.hidden_states`` tensor.

    The callers run the next layer on it or compare it as a tensor; a nested tuple's first item was returned as it
    was, a tuple, though the annotation promised a tensor (found by a tester).

    Returns:
        The hidden states tensor, as the layer returned it (same object, dtype and device).

    Raises:
        TypeError: none of these holds a tensor (an empty tuple, ``None``...), naming the type found.
    """
    found = output
    while isinstance(found, tuple | list) and found:
        found = found[0]
    if isinstance(found, torch.Tensor):
        return found
    hidden = getattr(found, "hidden_states", None)
    if isinstance(hidden, torch.Tensor):
        return hidden
    inner = f" (its first item: {type(found).__name__})" if found is not output else ""
    msg = f"cannot read the hidden states from a decoder layer output of type {type(output).__name__}{inner}"
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


def with_hidden(inputs: Inputs, outputs: list[Any]) -> Inputs:
    """The next decoder layer's inputs: each batch's hidden states (first positional argument) replaced by those of
    ``outputs``, the layer's return values on the batches (:func:`first_output` of each: a tensor, or a tuple).

    Where the keyword arguments are :class:`LayerKwargs` (captured per layer by :func:`capture_layer_inputs`),
    the other arguments are the next layer's own, with this layer's other outputs where the model's forward passes
    them on (:func:`_carried`); otherwise they are kept as they are.
    """
    result: Inputs = []
    held = inputs.raw() if isinstance(inputs, OffloadedInputs) else inputs  # no batch moved just to be replaced
    for out, (args, kwargs) in zip(outputs, held, strict=True):
        hidden = first_output(out)
        if isinstance(kwargs, LayerKwargs) and kwargs.index + 1 < len(kwargs.per_layer):
            rest, kwargs = _carried(*kwargs.at(kwargs.index + 1), out)
            result.append(((hidden, *rest), kwargs))
        else:
            result.append(((hidden, *args[1:]), kwargs))
    return result


def inputs_of(inputs: Inputs, offset: int) -> Inputs:
    """The inputs of the decoder layer ``offset`` layers after the one ``inputs`` are for (same hidden states).

    Only with :class:`LayerKwargs` (:func:`capture_layer_inputs`); otherwise ``inputs`` unchanged.
    """
    result: Inputs = []
    for args, kwargs in inputs:
        if isinstance(kwargs, LayerKwargs) and offset:
            rest, kwargs = kwargs.at(kwargs.index + offset)
            result.append(((args[0], *rest), kwargs))
        else:
            result.append((args, kwargs))
    return result


def record_calls_per_class(
    layers: nn.ModuleList, first: tuple[tuple[Any, ...], dict[str, Any]], *, device: torch.device | None = None
) -> dict[type, Calls]:
    """:func:`record_calls` of the first layer of each class in ``layers`` (hybrid stacks mix classes).

    ``first`` is one batch's inputs of ``layers[0]``; each layer runs on its own captured arguments, onloaded to
    ``device`` for the call (:func:`llmc_fsm.pipeline.device.onloaded`; ``None``: where it is).
    """
    result: dict[type, Calls] = {}
    for index, layer in enumerate(layers):
        if type(layer) not in result:
            ((args, kwargs),) = inputs_of([first], index)
            with onloaded(layer, device) if device is not None else contextlib.nullcontext():
                result[type(layer)] = record_calls(layer, args, kwargs)
    return result


class OutputKind:
    """A forward hook recording whether a decoder layer returns a tuple (or a tensor): its first forward tells.

    Raises (from the hook):
        TypeError: the layer returns neither.
    """

    def __init__(self) -> None:
        self.as_tuple: bool | None = None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.as_tuple is None:
            self.as_tuple = isinstance(output, tuple | list)
            if not self.as_tuple and not isinstance(output, torch.Tensor):
                msg = f"cannot stream {type(module).__name__}: it returns {type(output).__name__}, not a tensor/tuple"
                raise TypeError(msg)


class _Replay(nn.Module):
    """Stands in for one decoder layer: returns the next precomputed hidden state at each call (the last layer's
    stand-in) or its input (the others'), and reads any attribute it lacks from the layer it stands for (a model's
    forward may read e.g. ``block_type`` or ``attention_type`` off its layers to pick a mask). The layer is not a
    submodule: its weights are neither moved nor counted."""

    def __init__(self, layer: nn.Module, states: Iterator[torch.Tensor] | None, as_tuple: bool) -> None:
        super().__init__()
        object.__setattr__(self, "_layer", layer)
        self._states = states
        self._as_tuple = as_tuple
        #: ``None`` for each output after the hidden states the layer's annotation names (the model's forward
        #: unpacks them: GLM-5's ``(hidden_states, topk_indices)``; no stand-in after it reads them), where the layer
        #: did return a tuple: an annotation may promise one that the layer does not return (transformers 5.25's
        #: ``Llama4TextDecoderLayer`` returns its hidden states alone; found by a tester: the streamed evaluation
        #: handed the final norm a tuple)
        self._extras = (None,) * _extra_outputs(layer) if as_tuple else ()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_layer"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = next(self._states) if self._states is not None else (args[0] if args else kwargs["hidden_states"])
        return (hidden, *self._extras) if self._as_tuple else hidden


@contextlib.contextmanager
def replaying(
    model: nn.Module, layers_name: str, layers: nn.ModuleList, states: Iterable[Any], as_tuple: bool
) -> Iterator[None]:
    """Within the block, ``model``'s decoder layers (``layers``, the module list at ``layers_name``) are stand-ins
    (:class:`_Replay`): the last returns, at its n-th call, the hidden states of the n-th item of ``states`` (a
    sequence or an iterable: the inputs of the layer after the last, ``(args, kwargs)`` per batch, hidden states
    first), as a 1-tuple when ``as_tuple`` (the
    layers' own output form, :class:`OutputKind`), the others return their input: the model's own forward then runs
    what follows the layers (final norm, head) on the states. The layers are put back on exit."""
    parent_name, _, attr = layers_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    hidden = (args[0] for args, _ in states)  # one batch at a time (activations held off the device move per batch)
    last = len(layers) - 1
    stand_ins = [_Replay(layer, hidden if i == last else None, as_tuple) for i, layer in enumerate(layers)]
    setattr(parent, attr, nn.ModuleList(stand_ins))
    try:
        yield
    finally:
        setattr(parent, attr, layers)
