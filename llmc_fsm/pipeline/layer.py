"""How one decoder layer is run by the sequential pipeline (:mod:`llmc_fsm.pipeline.sequential`).

Its inputs are captured and its calls recorded by :mod:`llmc_fsm.pipeline.forward`.

* :func:`compress_layer` — calibrate and compress one layer: every batch runs it
  once with each group of targets compressed before it runs
  (:mod:`llmc_fsm.pipeline.true_sequential`), or, where that does not apply, the plain order:
* :func:`calibrate_layer` — run every batch through a layer for the modifiers'
  hooks, ending each forward at the input of the last hooked submodule when
  nothing after it is observed (:func:`early_exit_module`);
* :func:`propagate` — replace each batch's hidden states by the layer's output.

Everything here runs under the caller's ``torch.no_grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from llmc_fsm.core.torch_hooks import global_forward_hooks_installed, hook_count
from llmc_fsm.output.save import quantized_weights_as_compressed, weights_on_grid
from llmc_fsm.pipeline.forward import Calls, Inputs, StopForward, call_order, first_output, with_hidden
from llmc_fsm.pipeline.true_sequential import plan_groups, run_grouped

__all__ = [
    "calibrate_layer",
    "compress_layer",
    "early_exit_module",
    "propagate",
]


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

    With ``true_sequential`` and a layer :func:`llmc_fsm.pipeline.true_sequential.plan_groups`
    accepts (by ``calls``), every batch runs the
    layer once and each group of targets is compressed (``compress(group)``)
    before any batch runs it. Otherwise the plain order: every batch runs the
    layer for the hooks (stopping early by ``calls`` if ``early_exit``), the layer is
    compressed, and (if ``need_outputs``) every batch runs the compressed layer.
    Either way ``compress([layer])`` is called once at the end (it compresses
    whatever targets the forward did not reach). First, each of ``modifiers`` that has a
    ``prepare_layer(layer, inputs)`` method runs it (smoothing: it folds scales into the layer from its own pass
    over ``inputs``, its hooks only). In the grouped order, the
    batches run a compressed group's quantized modules without re-quantizing
    their weights (:func:`llmc_fsm.output.save.weights_on_grid`), and a group's head, paused inside its own call
    while its group was compressed, gets its inputs from ``modifiers``' ``compressed_call_inputs`` (a
    quantizer's input quantization), so that every module runs as its compressed forward would.
    """
    for modifier in modifiers:  # smoothing (SmoothQuant, AWQ) changes the layer before anything calibrates it
        prepare = getattr(modifier, "prepare_layer", None)
        if prepare is not None and inputs:
            prepare(layer, inputs)
    groups = plan_groups(layer, calls) if true_sequential and inputs else None
    if groups is not None:
        with weights_on_grid() as mark:  # the batches then run compressed groups without re-quantizing them

            def compress_group(group: list[nn.Module]) -> None:
                compress(group)
                mark(group)

            hidden = run_grouped(layer, inputs, groups, compress_group, _resumed_call(list(modifiers)))
        compress([layer])
        return with_hidden(inputs, hidden) if need_outputs else None
    if inputs:
        calibrate_layer(layer, inputs, call_order(calls) if early_exit and calls is not None else None)
    compress([layer])
    return propagate(layer, inputs) if need_outputs and inputs else None


def propagate(layer: nn.Module, inputs: Inputs) -> Inputs:
    """``inputs`` with each batch's hidden states replaced by the compressed ``layer``'s output on them.

    Its quantized weights already hold their grid values and are not re-quantized
    (:func:`llmc_fsm.output.save.quantized_weights_as_compressed`; same outputs bitwise).
    """
    with quantized_weights_as_compressed(layer):
        return with_hidden(inputs, [first_output(layer(*args, **kwargs)) for args, kwargs in inputs])


def _resumed_call(modifiers: list[Any]) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any]:
    """The first ``compressed_call_inputs(module, args, kwargs)`` result of ``modifiers`` that is not ``None``."""

    def call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        for modifier in modifiers:
            adjust = getattr(modifier, "compressed_call_inputs", None)
            result = adjust(module, args, kwargs) if adjust is not None else None
            if result is not None:
                return result
        return None

    return call
