"""How one decoder layer is run by the sequential pipeline (:mod:`llmc_fsm.pipeline.sequential`).

Its inputs are captured and its calls recorded by :mod:`llmc_fsm.pipeline.forward`.

* :func:`compress_layer` — calibrate and compress one layer: every batch runs it
  once with each group of targets compressed before it runs
  (:mod:`llmc_fsm.pipeline.true_sequential`), or, where that does not apply, the plain order:
* :func:`calibrate_layer` — run every batch through a layer for the modifiers'
  hooks, ending each forward at the input of the last hooked submodule when
  nothing after it is observed (:func:`early_exit_module`);
* :func:`propagate` — replace each batch's hidden states by the layer's output.

Calibration runs with activation quantization off, as llm-compressor's sequential pipeline runs it (its
``DisableQuantization`` around calibration and propagation): inside a layer and from one layer to the next, the
calibration inputs are what the model computes with the weights the modifiers have written so far and
full-precision activations — no input, output, query or KV-cache quantization (:func:`activation_quantization_off`).
So a static input scale, a KV-cache scale or a Hessian is observed on full-precision activations. Where every
modifier of the session only rounds weights to their grid (round-to-nearest, which llm-compressor applies when it
saves the model), the next layer's inputs are the layer's output *before* it is compressed (:func:`defers_weights`):
one forward per batch, on the layer as it was loaded, as in llm-compressor.

Everything here runs under the caller's ``torch.no_grad``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from llmc_fsm.core.torch_hooks import global_forward_hooks_installed, hook_count
from llmc_fsm.output.save import quantized_weights_as_compressed
from llmc_fsm.pipeline.forward import Calls, Inputs, StopForward, call_order, layer_output, with_hidden
from llmc_fsm.pipeline.true_sequential import plan_groups, run_grouped
from llmc_fsm.toolkit.calibrated import CalibratedModifier

__all__ = [
    "RestoredLayers",
    "activation_quantization_off",
    "calibrate_layer",
    "compress_layer",
    "defers_weights",
    "early_exit_module",
    "propagate",
]

#: compressed-tensors' switch of a module's fake quantization (its quantized forward, attention and KV cache read it;
#: so does :mod:`llmc_fsm_quantization.kv_cache`); absent means on.
_SWITCH = "quantization_enabled"


@contextlib.contextmanager
def activation_quantization_off(layer: nn.Module) -> Iterator[Callable[[], None]]:
    """Within the block, ``layer``'s modules compute without fake quantization; yields ``off()`` to call again after
    modules were (re)initialised for quantization inside the block (a compressed group).

    Sets compressed-tensors' ``quantization_enabled = False`` on every module of ``layer`` (the layer included), so
    their forwards skip input / output / query / KV-cache quantization and use the weights as stored — which hold
    their grid values once a modifier compressed them.
    Each module's own value (or its absence, which means on) is put back when the block ends.
    """
    before: dict[int, tuple[nn.Module, Any]] = {}

    def off() -> None:
        for module in layer.modules():
            if id(module) not in before:
                before[id(module)] = (module, module.__dict__.get(_SWITCH, _ABSENT))
            module.__dict__[_SWITCH] = False

    off()
    try:
        yield off
    finally:
        for module, value in before.values():
            if value is _ABSENT:
                module.__dict__.pop(_SWITCH, None)
            else:
                module.__dict__[_SWITCH] = value


_ABSENT = object()


def defers_weights(modifiers: Sequence[Any]) -> bool:
    """Whether every one of ``modifiers`` (at least one) declares ``defers_weight_update``: its compression only
    rounds weights to their grid and nothing calibrated later depends on it (round-to-nearest, which llm-compressor
    applies when it saves the model, so that its later layers calibrate on the full-precision weights). Then the
    pipeline computes a layer's output for the next layer before compressing it (:func:`compress_layer`), and a
    resumed run propagates the restored layers' inputs through the layer as loaded."""
    return bool(modifiers) and all(getattr(m, "defers_weight_update", False) is True for m in modifiers)


class RestoredLayers:
    """The calibration inputs a resumed run carries through the decoder layers it restores from saved progress, as
    the interrupted run computed them, and the float model's inputs for the modifiers that follow it.

    Through each restored layer (:meth:`through`): when every modifier defers its weight update
    (:func:`defers_weights`), the inputs go through the layer as loaded, before it is restored (the interrupted run
    propagated each layer's output before compressing it); otherwise through the restored layer. Modifiers with
    ``resume_float_inputs(inputs)`` carry the float model's hidden states from layer to layer (AutoRound's targets,
    each layer's float output): for them the float inputs also go through each layer as loaded, and
    :meth:`hand_over` gives them the first compressed layer's (the restored layers' own inputs when deferred: the
    same values).

    Args:
        modifiers: the session's modifiers.
        inputs: the first decoder layer's calibration inputs, per batch ``(args, kwargs)``.
        resuming: some but not all layers are restored (nothing needs propagating when every layer is).
    """

    def __init__(self, modifiers: Sequence[Any], inputs: Inputs, *, resuming: bool) -> None:
        self.deferred = defers_weights(modifiers)
        self.followers = [m for m in modifiers if callable(getattr(m, "resume_float_inputs", None))]
        self.resuming = resuming
        self.inputs = inputs
        self.floats: Inputs | None = inputs if self.followers and resuming and not self.deferred else None

    def through(
        self,
        layer: nn.Module,
        restore: Callable[[], None],
        *,
        onload: Callable[[nn.Module], contextlib.AbstractContextManager[Any]],
        hold: Callable[[Inputs], Inputs],
        need_outputs: bool = True,
    ) -> None:
        """Restore ``layer`` (``restore()``: its saved compressed state into it) and, while resuming and
        ``need_outputs``, replace :attr:`inputs` (and :attr:`floats`) by its outputs, each forward inside
        ``onload(layer)`` (where the layer computes) and each result kept by ``hold`` (where activations live)."""
        propagating = self.resuming and need_outputs
        if propagating and (self.deferred or self.floats is not None):
            with onload(layer):  # the layer as loaded: the float model's
                if self.deferred:
                    self.inputs = hold(propagate(layer, self.inputs, calibration=True))
                else:
                    self.floats = hold(propagate(layer, self.floats, calibration=True))  # type: ignore[arg-type]
        restore()
        if propagating and not self.deferred:
            with onload(layer):
                self.inputs = hold(propagate(layer, self.inputs, calibration=True))

    def hand_over(self) -> None:
        """Give each float-following modifier the float model's inputs of the first layer to compress."""
        if self.resuming:
            for modifier in self.followers:
                modifier.resume_float_inputs(self.inputs if self.deferred else self.floats)


def _has_hooks(module: nn.Module, *, post_only: bool = False) -> bool:
    return hook_count(module, ("forward",) if post_only else ("forward", "forward_pre")) > 0


def early_exit_module(layer: nn.Module, order: Mapping[str, int]) -> nn.Module | None:
    """The module at whose input the calibration pass of ``layer`` may stop, or ``None``.

    That is the hooked submodule called last (by ``order``, the call order of
    an earlier layer of the same class), provided it has only forward
    pre-hooks: nothing after its input is observed; or ``layer`` itself when
    only its own forward pre-hooks are registered (AutoRound past the first
    layer: the layer's inputs are all it captures). ``None`` (run the whole
    layer) when nothing in the layer is hooked, the layer itself has forward
    hooks, a module with forward hooks is hooked last, a hooked module was
    never called in the recorded forward, or global module hooks are installed.
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
    if last is None:  # only the layer's own pre-hooks observe anything: its input
        return layer if _has_hooks(layer) else None
    if _has_hooks(last, post_only=True):
        return None
    return last


def _raise_stop(module: nn.Module, args: Any) -> None:
    raise StopForward


def calibrate_layer(layer: nn.Module, inputs: Inputs, order: Mapping[str, int] | None) -> None:
    """Run every batch through ``layer`` for its hooks, stopping early where nothing later is observed.

    ``order`` (:func:`call_order`; ``None``: never stop early) is the call
    order of a layer of the same class.
    """
    stop_at = early_exit_module(layer, order) if order is not None else None
    handle = stop_at.register_forward_pre_hook(_raise_stop) if stop_at is not None else None
    try:
        for args, kwargs in inputs:
            try:
                layer(*args, **kwargs)
            except StopForward:
                continue
    finally:
        if handle is not None:
            handle.remove()


def _takes_grouped(modifier: Any, layer: nn.Module) -> bool:
    """Whether ``modifier`` calibrates correctly in the grouped order in ``layer``: a :class:`CalibratedModifier`, a
    smoothing modifier, which has no hook in the layer's calibration forwards (``prepare_layer`` runs its own pass
    first), or one whose ``takes_grouped_order(layer)`` says so (REAP, in a layer without experts it drops)."""
    takes = getattr(modifier, "takes_grouped_order", None)
    return (
        isinstance(modifier, CalibratedModifier)
        or callable(getattr(modifier, "prepare_layer", None))
        or (callable(takes) and takes(layer) is True)
    )


def compress_layer(
    layer: nn.Module,
    inputs: Inputs,
    compress: Callable[[list[nn.Module]], None],
    *,
    calls: Calls | None,
    true_sequential: bool,
    early_exit: bool,
    need_outputs: bool,
    modifiers: Sequence[Any] = (),
) -> Inputs | None:
    """Calibrate and compress ``layer`` on ``inputs``; return the next layer's inputs (``None`` if not needed).

    First, each of ``modifiers`` that has a ``prepare_layer(layer, inputs)`` method runs it (smoothing: it folds
    scales into the layer from its own pass over ``inputs``, its hooks only). Then, with activation quantization off
    throughout (:func:`activation_quantization_off`), one of three orders:

    * ``true_sequential``, every one of ``modifiers`` a :class:`~llmc_fsm.toolkit.calibrated.CalibratedModifier`
      (grouped calibration calls a group's later members' pre-hooks early, which only those ignore) or a smoothing
      modifier (``prepare_layer``: its hooks act in its own pass only), and a layer
      :func:`llmc_fsm.pipeline.true_sequential.plan_groups` accepts (by ``calls``):
      every batch runs the layer once and each group of targets is compressed (``compress(group)``) before any batch
      runs it, the batches running a compressed group with the weights it now holds;
    * ``modifiers`` all defer their weight update (:func:`defers_weights`) and ``need_outputs``: every batch runs
      the whole layer for the hooks, the layer is compressed, and the outputs of that forward (the layer as it was
      loaded) are the next layer's inputs;
    * otherwise the plain order: every batch runs the layer for the hooks (stopping early by ``calls`` if
      ``early_exit``), the layer is compressed, and (if ``need_outputs``) every batch runs the compressed layer.

    Either way ``compress([layer])`` is called once at the end (it compresses whatever targets the forward did not
    reach).
    """
    for modifier in modifiers:  # smoothing (SmoothQuant, AWQ) changes the layer before anything calibrates it
        prepare = getattr(modifier, "prepare_layer", None)
        if prepare is not None and inputs:
            prepare(layer, inputs)
    deferred = defers_weights(modifiers)
    grouped = true_sequential and all(_takes_grouped(m, layer) for m in modifiers)
    with activation_quantization_off(layer) as off:
        groups = plan_groups(layer, calls) if grouped and inputs and not deferred else None
        if groups is not None:

            def compress_group(group: list[nn.Module]) -> None:
                compress(group)
                off()  # a module initialised for quantization by compress computes without it here too

            hidden = run_grouped(layer, inputs, groups, compress_group)
            compress([layer])
            return with_hidden(inputs, hidden) if need_outputs else None
        if deferred and need_outputs and inputs:  # the layer's output before compression: one forward per batch
            hidden = [layer_output(layer(*args, **kwargs), kwargs) for args, kwargs in inputs]
            compress([layer])
            return with_hidden(inputs, hidden)
        if inputs:
            calibrate_layer(layer, inputs, call_order(calls) if early_exit and calls is not None else None)
        compress([layer])
        off()
        return propagate(layer, inputs) if need_outputs and inputs else None


def propagate(layer: nn.Module, inputs: Inputs, *, calibration: bool = False) -> Inputs:
    """``inputs`` with each batch's hidden states replaced by the compressed ``layer``'s output on them.

    Its quantized weights already hold their grid values and are not re-quantized
    (:func:`llmc_fsm.output.save.quantized_weights_as_compressed`; same outputs bitwise). ``calibration``: the
    inputs are calibration inputs, computed with activation quantization off (:func:`activation_quantization_off`);
    else (evaluation windows) the layer computes as the quantized model does.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(quantized_weights_as_compressed(layer))
        if calibration:
            stack.enter_context(activation_quantization_off(layer))
        return with_hidden(inputs, [layer_output(layer(*args, **kwargs), kwargs) for args, kwargs in inputs])
