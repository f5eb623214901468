"""One-shot compression in memory bounded by one decoder layer (``oneshot(low_memory=True)``, ``--low-memory``).

The model is built on the ``meta`` device and read from its safetensors
checkpoint one part at a time (:mod:`llmc_fsm.models.lazy`). :func:`compress_streaming`
is the sequential pipeline (:mod:`llmc_fsm.pipeline.sequential`) with the weights streamed::

    write the tensors outside the decoder layers to shard 1      (read once, unchanged)
    capture the inputs of decoder layer 0                        (embedding rows read on demand)
    session.calibration_start()
    for each layer i the per-layer progress holds (resume):
        read layer i, load its saved compressed state,           (as the in-memory pipeline's resume)
        run the inputs through it, write it to shard i + 2
    for each remaining decoder layer i:
        read layer i from the checkpoint
        calibrate and compress it, its outputs feed layer i + 1   (the same helper and events as
                                                                  the in-memory pipeline:
                                                                  pipeline_layer.compress_layer)
        save its progress (optional), write it to shard i + 2,
        then put it back on meta
    session.calibration_end()

so the output equals, bit for bit, what the in-memory pipeline saves for the
same recipe and data. Perplexity streams the same way
(:func:`streamed_states` and :func:`tail_perplexity`): every evaluation
window's hidden states go through the layers one layer at a time, then the
model's own forward finishes them (final norm, head, loss), with the decoder
layers replaced by a module that returns those states.

Peak memory: the Python process and libraries, one decoder layer's weights
and the modifiers' statistics for it, the calibration activations (and the
evaluation hidden states, when measured; on the execution device while a
layer's inputs and outputs fit in the activation budget, else in CPU memory and
moved to the device one batch at a time, as in the in-memory pipeline:
:func:`llmc_fsm.pipeline.device.activation_store`) — and, once, the tensors outside the
layers while they are copied to the output or evaluated (the embedding and
head; memory-mapped, so only what is read is resident). Only modifiers that
compress layer by layer at ``sequential_epoch_end`` can run this way
(:class:`~llmc_fsm.toolkit.calibrated.CalibratedModifier`: SparseGPT, Wanda, GPTQ, RTN).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import attrs
import torch
from torch import nn

from llmc_fsm.data.protocol import logits_are_projection, perplexity
from llmc_fsm.models.lazy import LazyModel, ShardWriter
from llmc_fsm.output.save import compressed_state_dict, quantized_modules, quantized_views
from llmc_fsm.pipeline.device import ActivationStore, activation_store, onloaded
from llmc_fsm.pipeline.forward import (
    Calls,
    Inputs,
    OutputKind,
    capture_layer_inputs,
    inputs_of,
    record_calls,
    replaying,
)
from llmc_fsm.pipeline.layer import RestoredLayers, compress_layer, propagate
from llmc_fsm.pipeline.sequential import (
    LayerCheckpoint,
    activation_bytes,
    calibration_batches,
    check_targets_in_layers,
    output_head,
)
from llmc_fsm.report.build import ModuleSparsity, measure_sparsity
from llmc_fsm.session.session import Session
from llmc_fsm.toolkit.calibrated import CalibratedModifier
from llmc_fsm.toolkit.heap import trim_heap
from llmc_fsm.toolkit.views import weight_views

__all__ = [
    "StreamedCompression",
    "check_streamable",
    "compress_streaming",
    "streamed_states",
    "tail_perplexity",
    "write_outer",
]

logger = logging.getLogger(__name__)


@attrs.define(kw_only=True)
class StreamedCompression:
    """What :func:`compress_streaming` did.

    Attributes:
        modules: measured zeros of every Linear weight, in the model's module order
            (what :func:`llmc_fsm.report.build.measure_sparsity` gives for the in-memory model).
        eval_states: the evaluation windows' hidden states after the last compressed layer
            (``None`` without evaluation windows).
        activations: where the hidden states between layers lived
            (:meth:`llmc_fsm.pipeline.device.ActivationStore.report`: mode ``device`` or ``cpu-offloaded``, bytes,
            budget, batches moved), as the in-memory pipeline reports it.
    """

    modules: list[ModuleSparsity]
    eval_states: Inputs | None = None
    activations: dict[str, Any] = attrs.field(factory=dict)


def check_streamable(session: Session) -> None:
    """Raise before any work if a modifier of ``session`` cannot compress one decoder layer at a time.

    Raises:
        ValueError: naming the modifiers that act on the whole model (e.g. magnitude pruning at its start), or the
            first one whose ``streaming_refusal()`` gives a reason
            (:meth:`~llmc_fsm.toolkit.calibrated.CalibratedModifier.streaming_refusal`; any modifier may have one).
    """

    whole = [  # a prepare_layer method works on one layer at a time too (smoothing, see compress_layer)
        m.modifier_name()
        for m in session.modifiers
        if not isinstance(m, CalibratedModifier)
        and not callable(getattr(m, "prepare_layer", None))
        and not callable(getattr(m, "streaming_refusal", None))
    ]
    if whole:
        msg = (
            "low_memory (--low-memory) cannot run this job: it compresses one decoder layer at a time, but "
            f"{', '.join(whole)} acts on the whole model at once; use a layer-wise method (sparsegpt, wanda, gptq, "
            "rtn) or run without low_memory"
        )
        raise ValueError(msg)
    for m in session.modifiers:
        refusal = getattr(m, "streaming_refusal", None)
        reason = refusal() if callable(refusal) else None
        if reason is not None:
            msg = (
                f"low_memory (--low-memory) cannot run this job: {m.modifier_name()}: {reason}; run without low_memory"
            )
            raise ValueError(msg)


def _window_batches(windows: torch.Tensor) -> list[dict[str, Any]]:
    """One batch per window, as :func:`llmc_fsm.data.protocol.perplexity` runs them (``batch_size=1``)."""
    return [{"input_ids": windows[i : i + 1].long()} for i in range(windows.shape[0])]


def _bar(total: int, desc: str, progress: bool, start: int = 0) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        range(start, total), initial=start, total=total, desc=desc, unit="layer", disable=not progress, leave=False
    )


def streamed_states(
    lazy: LazyModel,
    windows: torch.Tensor,
    *,
    progress: bool = False,
    device: torch.device | None = None,
    activation_budget: int | None = None,
) -> tuple[Inputs, bool]:
    """Run every window (``LongTensor[N, L]``) through the decoder layers, reading one layer at a time.

    ``device``: where each part computes, onloaded while it runs (:func:`llmc_fsm.pipeline.device.onloaded`;
    ``None``: the CPU, where the parts are read). ``activation_budget``: bytes the windows' hidden states (a
    layer's inputs and outputs) may take on the device, beyond which they wait in CPU memory
    (:func:`llmc_fsm.pipeline.device.activation_store`; ``None``: half the device's free memory, no limit on the
    CPU).

    Returns:
        ``(states, as_tuple)``: per window the inputs the layer after the last
        would get (hidden states ``[1, L, hidden]`` first), and whether the
        layers return tuples — what :func:`tail_perplexity` needs.
    """
    kind = OutputKind()
    device = torch.device("cpu") if device is None else device
    batches = _window_batches(windows)
    store = activation_store(device, activation_bytes(lazy.model, batches), activation_budget)
    with torch.no_grad():
        with lazy.materialized(lazy.outer_names()), onloaded(lazy.model, device, skip=[lazy.layers]):
            states = store.wrap(
                capture_layer_inputs(lazy.model, lazy.layers[0], batches, device=device, keep=store.keep)
            )
        for index in _bar(len(lazy.layers), "evaluating layers", progress):
            layer = lazy.layers[index]
            with lazy.materialized(lazy.layer_names(index), layer), onloaded(layer, device):
                handle = layer.register_forward_hook(kind)
                try:
                    states = store.hold(propagate(layer, states))
                finally:
                    handle.remove()
    return states, bool(kind.as_tuple)


def tail_perplexity(
    lazy: LazyModel,
    windows: torch.Tensor,
    states: Inputs,
    as_tuple: bool,
    *,
    progress: bool = False,
    device: torch.device | None = None,
) -> float:
    """Perplexity of ``windows`` whose hidden states after the last decoder layer are ``states``.

    The model's own forward (and :func:`llmc_fsm.data.protocol.perplexity`'s loss) runs
    with the tensors outside the layers read once and the decoder layers
    replaced by the precomputed states, so the value is what the in-memory
    model gives. ``device``: where the parts outside the layers compute (where ``states`` are; ``None``: the CPU).
    """

    device = torch.device("cpu") if device is None else device
    with lazy.materialized(lazy.outer_names()):
        with replaying(lazy.model, lazy.layers_name, lazy.layers, states[:1], as_tuple):
            with onloaded(lazy.model, device, skip=[lazy.layers]):
                projection = logits_are_projection(lazy.model, windows[:1])
        # logits changed after the head (Gemma 2, Cohere, Granite): perplexity() runs its first batch twice, and each
        # call takes the next state (the second took the next window's; the last window found none: a StopIteration
        # traceback on the CLI's default path, found by a tester)
        feed = states if projection else itertools.chain(states[:1], states)
        with replaying(lazy.model, lazy.layers_name, lazy.layers, feed, as_tuple):
            with onloaded(lazy.model, device, skip=[lazy.layers]):
                return perplexity(lazy.model, windows, progress=progress)


def _outer_modules(lazy: LazyModel) -> Iterator[tuple[str, nn.Module]]:
    """The largest submodules that neither are nor hold the decoder layers (embedding, final norm, head...)."""
    parts = lazy.layers_name.split(".")
    holders = {".".join(parts[:k]) for k in range(len(parts))}  # "" and every ancestor of the layer list
    for name, module in lazy.model.named_modules():
        parent = name.rpartition(".")[0]
        if name and name not in holders and name != lazy.layers_name and parent in holders:
            yield name, module


def _module_order(lazy: LazyModel) -> dict[str, int]:
    """Rank of each module name, an expert matrix's view (``experts.0.gate_proj``) right after its experts module."""
    names = [n for name, m in lazy.model.named_modules() for n in (name, *(f"{name}.{s}" for s in weight_views(m)))]
    return {name: i for i, name in enumerate(names)}


def write_outer(lazy: LazyModel, writer: ShardWriter) -> list[ModuleSparsity]:
    """Copy the tensors outside the decoder layers (unchanged, in the model's dtype) to shard 1.

    Returns:
        The measured zeros of the Linear modules among them (e.g. an untied ``lm_head``).
    """
    names = lazy.outer_names()
    measured = []
    with lazy.materialized(names):
        writer.write(1, _saved_names(lazy, {name: lazy.tensor(name).detach() for name in names}))
        for prefix, module in _outer_modules(lazy):
            measured += [
                attrs.evolve(m, name=f"{prefix}.{m.name}" if m.name else prefix) for m in measure_sparsity(module)
            ]
    return measured


def _saved_names(lazy: LazyModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` as ``save_pretrained`` writes them: transformers' ``revert_weight_conversion`` (fused experts back
    to the checkpoint's per-expert keys, renamed keys back); a tensor a conversion built (a slice of a fused one) is
    copied to own its memory, the others are written as they are."""
    from transformers.core_model_loading import revert_weight_conversion

    given = {id(t) for t in tensors.values()}
    saved = revert_weight_conversion(lazy.model, tensors)
    return {k: v if id(v) in given else v.contiguous().clone() for k, v in saved.items()}


def _layer_output(
    lazy: LazyModel, layer: nn.Module, prefix: str, quantization_format: str | None
) -> dict[str, torch.Tensor]:
    """The tensors to write for a compressed layer (compressed-tensors format when quantized)."""

    if quantized_modules(layer) or quantized_views(layer):  # a layer whose only quantized weights are experts' too
        return compressed_state_dict(layer, prefix, quantization_format=quantization_format, root=lazy.model)
    return {prefix + key: value for key, value in layer.state_dict().items()}


def compress_streaming(
    session: Session,
    lazy: LazyModel,
    windows: torch.Tensor,
    writer: ShardWriter,
    *,
    batch_size: int = 8,
    eval_windows: torch.Tensor | None = None,
    progress: bool = True,
    device: torch.device | None = None,
    activation_budget: int | None = None,
    checkpoint: LayerCheckpoint | None = None,
    quantization_format: str | None = None,
) -> StreamedCompression:
    """Calibrate, compress and write ``lazy``'s model one decoder layer at a time through ``session``.

    Fires ``calibration_start()``, one ``sequential_epoch_end([layer])`` per
    decoder layer and ``calibration_end()`` (not ``finalize``), as
    :func:`llmc_fsm.pipeline.sequential.run_sequential` does, and writes shard 1 (the
    tensors outside the layers) and shard ``i + 2`` (layer ``i``, compressed)
    with ``writer``. ``writer.finish()`` is left to the caller.

    Args:
        session: initialized with ``model=lazy.model``.
        lazy: the model and its checkpoint (:func:`llmc_fsm.models.lazy.load_lazy`).
        windows: calibration ``LongTensor[N, L]``; ``N = 0`` for modifiers that need no data.
        writer: a :class:`~llmc_fsm.models.lazy.ShardWriter` with ``num_shards = len(lazy.layers) + 1``.
        batch_size: calibration windows per forward pass.
        eval_windows: ``LongTensor[M, L']`` to carry through the compressed layers for the perplexity after
            (:attr:`StreamedCompression.eval_states`).
        progress: a tqdm bar over the layers.
        device: the execution device (``None``: the CPU): the parts outside the layers are onloaded for the
            capture, each decoder layer, once read from the checkpoint, for its calibration, compression and
            propagation; it is written from CPU memory (:func:`llmc_fsm.pipeline.device.onloaded`).
        activation_budget: bytes the hidden states between layers (a layer's inputs and outputs, calibration
            batches and evaluation windows together) may take on the device; beyond it they live in CPU memory
            and move to the device one batch at a time (:func:`llmc_fsm.pipeline.device.activation_store`).
            ``None``: half the device's free memory (no limit on the CPU). Results are bit-identical either way;
            :attr:`StreamedCompression.activations` says which ran.
        checkpoint: per-layer progress (:class:`llmc_fsm.pipeline.sequential.LayerCheckpoint`, the in-memory
            pipeline's: :class:`llmc_fsm.oneshot_job.resume.LayerProgress`): each layer is saved right after it is
            compressed, before it is written; the first ``checkpoint.layers_done()`` layers are read, restored
            (after ``calibration_start``), run on the calibration inputs and evaluation windows, and written, instead
            of calibrated — so a resumed run writes what an uninterrupted one writes, bit for bit.
        quantization_format: the compressed-tensors format of every quantized weight written
            (:func:`llmc_fsm.output.save.choose_formats`); ``None``: each its recipe's or the default.

    Raises:
        ValueError: a modifier acts on the whole model (:func:`check_streamable`), targets a module outside
            the decoder layers, or ``activation_budget`` is not a number of bytes >= 0 — before any work.
    """
    if activation_budget is not None and (
        isinstance(activation_budget, bool) or not isinstance(activation_budget, int) or activation_budget < 0
    ):
        msg = f"activation_budget must be a number of bytes >= 0 or None, got {activation_budget!r}"
        raise ValueError(msg)
    check_streamable(session)
    check_targets_in_layers(session, lazy.layers, lazy.layers_name, streamed=True, head=output_head(lazy.model))
    batches = calibration_batches(windows, batch_size=batch_size) if windows.shape[0] else []
    eval_batches = _window_batches(eval_windows) if eval_windows is not None else []
    device = torch.device("cpu") if device is None else device
    store = activation_store(device, activation_bytes(lazy.model, batches + eval_batches), activation_budget)
    result = StreamedCompression(modules=write_outer(lazy, writer))  # first: nothing else is held yet
    with torch.no_grad():
        with lazy.materialized(lazy.outer_names()), onloaded(lazy.model, device, skip=[lazy.layers]):
            inputs = store.wrap(
                capture_layer_inputs(lazy.model, lazy.layers[0], batches, device=device, keep=store.keep)
            )
            if eval_windows is not None:
                result.eval_states = store.wrap(
                    capture_layer_inputs(lazy.model, lazy.layers[0], eval_batches, device=device, keep=store.keep)
                )
        calls: dict[type, Calls] = {}
        if inputs:  # which submodules are called in which order, on which inputs: before any hook
            calls = _calls_per_class(lazy, inputs[0], device)
        session.calibration_start()
        start = 0
        if checkpoint is not None:
            start = checkpoint.layers_done(len(lazy.layers))
            restored = RestoredLayers(session.modifiers, inputs, resuming=0 < start < len(lazy.layers))
            for index in range(start):
                _restore_layer(checkpoint, lazy, writer, index, restored, result, device, store, quantization_format)
            restored.hand_over()
            inputs = restored.inputs
        if start:
            logger.info("resumed: %d of %d decoder layers restored from saved progress", start, len(lazy.layers))
        for index in _bar(len(lazy.layers), "compressing layers", progress, start):
            inputs = _compress_layer(
                session, lazy, writer, index, inputs, calls, result, device, store, checkpoint, quantization_format
            )
            trim_heap()  # the layer's freed weights and activations go back to the system
        del inputs
        session.calibration_end()
    result.activations = store.report()
    rank = _module_order(lazy)
    result.modules.sort(key=lambda m: rank[m.name])
    return result


def _calls_per_class(
    lazy: LazyModel, first: tuple[tuple[Any, ...], dict[str, Any]], device: torch.device
) -> dict[type, Calls]:
    """:func:`~llmc_fsm.pipeline.forward.record_calls` of the first layer of each class (each read from the
    checkpoint for the call, on its own captured arguments), as the in-memory pipeline records them
    (:func:`~llmc_fsm.pipeline.forward.record_calls_per_class`): until 2026-12-06 the first layer's were given to
    every layer, so a hybrid stack's layers of another class (OLMo-Hybrid's full-attention layer) were compressed in
    another order than in memory, with other weights (a tester's case)."""
    calls: dict[type, Calls] = {}
    for index, layer in enumerate(lazy.layers):
        if type(layer) not in calls:
            ((args, kwargs),) = inputs_of([first], index)
            with lazy.materialized(lazy.layer_names(index), layer), onloaded(layer, device):
                calls[type(layer)] = record_calls(layer, args, kwargs)
    return calls


def _compress_layer(
    session: Session,
    lazy: LazyModel,
    writer: ShardWriter,
    index: int,
    inputs: Inputs,
    calls: dict[type, Calls],
    result: StreamedCompression,
    device: torch.device,
    store: ActivationStore,
    checkpoint: LayerCheckpoint | None,
    quantization_format: str | None,
) -> Inputs:
    """Read, calibrate, compress, save (``checkpoint``), measure and write decoder layer ``index``; return the next
    layer's inputs."""
    layer = lazy.layers[index]
    with lazy.materialized(lazy.layer_names(index), layer):
        need_outputs = index + 1 < len(lazy.layers)
        with onloaded(layer, device):  # read into CPU memory, computed on the device, written from CPU memory
            outputs = compress_layer(
                layer,
                inputs,
                session.sequential_epoch_end,
                calls=calls.get(type(layer)),
                true_sequential=True,
                early_exit=True,
                need_outputs=need_outputs,
                modifiers=session.modifiers,
            )
            if result.eval_states is not None:
                result.eval_states = store.hold(propagate(layer, result.eval_states))
        if checkpoint is not None:
            checkpoint.save(index, layer)  # from CPU memory, as the in-memory pipeline saves it
        _write_layer(lazy, writer, index, result, quantization_format)
    return store.hold(outputs) if outputs is not None else []


def _restore_layer(
    checkpoint: LayerCheckpoint,
    lazy: LazyModel,
    writer: ShardWriter,
    index: int,
    restored: RestoredLayers,
    result: StreamedCompression,
    device: torch.device,
    store: ActivationStore,
    quantization_format: str | None,
) -> None:
    """Read decoder layer ``index``, load its saved compressed state, carry the calibration inputs through it (as
    the interrupted run did: :class:`~llmc_fsm.pipeline.layer.RestoredLayers`) and the evaluation windows, measure
    and write it."""
    layer = lazy.layers[index]
    with lazy.materialized(lazy.layer_names(index), layer):
        restored.through(
            layer,
            lambda: checkpoint.restore(index, layer),
            onload=lambda module: onloaded(module, device),
            hold=store.hold,
            need_outputs=index + 1 < len(lazy.layers) and bool(restored.inputs),
        )
        if result.eval_states is not None:
            with onloaded(layer, device):
                result.eval_states = store.hold(propagate(layer, result.eval_states))
        _write_layer(lazy, writer, index, result, quantization_format)


def _write_layer(
    lazy: LazyModel, writer: ShardWriter, index: int, result: StreamedCompression, quantization_format: str | None
) -> None:
    """Measure the zeros of decoder layer ``index`` (read) into ``result`` and write it to shard ``index + 2``."""
    layer = lazy.layers[index]
    prefix = f"{lazy.layers_name}.{index}."
    result.modules += [attrs.evolve(m, name=prefix + m.name, layer=index) for m in measure_sparsity(layer) if m.name]
    writer.write(index + 2, _saved_names(lazy, _layer_output(lazy, layer, prefix, quantization_format)))
