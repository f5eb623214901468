"""The sequential calibration pipeline: calibrate and compress a model one decoder layer at a time.

Flow (:func:`run_sequential`)::

    capture the inputs of decoder layer 0      (embedding runs once per batch)
    record one forward of layer 0              (call order, which modules share an input)
    session.calibration_start()
    restore the layers a checkpoint holds      (resume: their saved compressed state;
                                                the inputs are run through them)
    for each remaining decoder layer:
        run every calibration batch through the layer once (each batch a coroutine);
        at each group of targets (q/k/v, o, gate/up, down) all batches wait:
            session.sequential_epoch_end(group)         (modifiers compress the group)
        session.sequential_epoch_end([layer])           (whatever the forward did not reach)
        checkpoint.save(layer)                          (optional: per-layer progress)
        the outputs feed the next layer

With ``true_sequential=False`` (or a layer whose targets are not all leaves
hooked by pre-hooks) each layer runs the plain order instead: every batch
through the layer for the hooks (ending at the input of the last hooked
module), ``sequential_epoch_end([layer])``, every batch through the compressed
layer.

Peak memory is the model plus one layer's activations for the calibration
batches (and whatever statistics the modifiers keep for that layer), not the
activations of the whole model. Everything runs under ``torch.no_grad``.

Only the decoder layers and the output head (``lm_head``: the model's ``get_output_embeddings()``) are calibrated:
when a modifier targets the head, after the last layer every batch runs the model's own forward from the last
layer's outputs on (final norm, any scaling its forward applies) up to the head's input, which the modifiers'
hooks observe, and ``session.sequential_epoch_end([head])`` compresses it (llm-compressor's pipeline calibrates
``lm_head`` on the final hidden states likewise). No other module outside the layers may be a target that needs
calibration inputs (checked before any work, see :func:`check_targets_in_layers`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

import attrs
import torch
from torch import nn

from llmc_fsm.core.errors import LifecycleError
from llmc_fsm.models.layers import check_calibrates_from_text, find_decoder_layers
from llmc_fsm.output.save import CompressedSavePretrained, is_quantized
from llmc_fsm.pipeline.device import ActivationStore, activation_store, describe_device, onloaded, resolve_device
from llmc_fsm.pipeline.forward import (
    Inputs,
    OutputKind,
    StopForward,
    capture_layer_inputs,
    record_calls_per_class,
    replaying,
)
from llmc_fsm.pipeline.layer import RestoredLayers, _raise_stop, compress_layer
from llmc_fsm.session.session import Session
from llmc_fsm.toolkit.heap import trim_heap
from llmc_fsm.toolkit.views import weight_views

__all__ = [
    "LayerCheckpoint",
    "PipelineResult",
    "activation_bytes",
    "calibration_batches",
    "check_targets_in_layers",
    "check_token_ids",
    "head_target",
    "output_head",
    "run_sequential",
]

logger = logging.getLogger(__name__)


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
        resumed_layers: leading layers restored from a :class:`LayerCheckpoint` instead of calibrated.
        device: the execution device (:func:`llmc_fsm.pipeline.device.describe_device`: device, name, total memory).
        activations: where the hidden states between layers lived
            (:meth:`llmc_fsm.pipeline.device.ActivationStore.report`).
        layer_peak_device_bytes: per calibrated layer, ``torch.cuda.max_memory_allocated`` during it (CUDA only,
            else empty); ``peak_device_bytes``: over the whole pipeline (``None`` on the CPU).
    """

    layers_name: str
    num_layers: int
    num_batches: int
    num_tokens: int
    layer_seconds: list[float]
    seconds: float
    resumed_layers: int = 0
    device: dict[str, Any] = attrs.field(factory=dict)
    activations: dict[str, Any] = attrs.field(factory=dict)
    layer_peak_device_bytes: list[int] = attrs.field(factory=list)
    peak_device_bytes: int | None = None


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


def output_head(model: nn.Module) -> nn.Module | None:
    """``model``'s output head (``get_output_embeddings()``, e.g. ``lm_head``) when it is an ``nn.Linear``, else
    ``None``: the one module outside the decoder layers the sequential pipeline calibrates, when targeted."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Linear) else None


def check_targets_in_layers(
    session: Session,
    layers: nn.ModuleList,
    layers_name: str,
    *,
    streamed: bool = False,
    head: nn.Module | None = None,
) -> None:
    """Raise before any work if a modifier targets a module the pipeline never calibrates.

    Modifiers that expose ``resolved_targets`` (``{name: module}``, e.g. the
    pruning plugin's) are checked; others are trusted. A target the modifier compresses without calibration inputs
    (its ``targets_without_inputs``, e.g. a quantizer's ``nn.Embedding``) may lie outside the layers, and so may the
    output ``head`` (:func:`output_head`; calibrated after the last layer), except in the streamed pipeline
    (``streamed``), which writes the tensors outside the layers before it compresses anything. Other calibrated
    modules outside the layers are refused, also those the model's forward runs between the embedding and the first
    layer or after the last (OPT-350m's ``model.decoder.project_in`` / ``project_out``), which llm-compressor 0.14
    calibrates in its first / last traced subgraph.

    Raises:
        ValueError: ``"<Modifier> targets <names>, outside the decoder layers (<layers name>); the sequential
            pipeline calibrates only the decoder layers and the output head. <fix>"`` (the same sentence in memory
            and streamed; the fix: add them to the modifier's ignore list, or, streamed, run in memory when that
            calibrates them).
    """
    for modifier in session.modifiers:
        targets = getattr(modifier, "resolved_targets", None)
        if isinstance(targets, Mapping):
            check_modifier_targets_in_layers(modifier, targets, layers, layers_name, streamed=streamed, head=head)


def layer_members(layers: nn.ModuleList) -> set[int]:
    """The ``id`` of every module inside ``layers`` and of every :class:`~llmc_fsm.toolkit.LinearView` of one (fused
    experts' matrices, Conv1D): what a target must be to be calibrated with the decoder layers."""
    return {id(v) for m in layers.modules() for v in (m, *weight_views(m).values())}


def check_modifier_targets_in_layers(
    modifier: Any,
    targets: Mapping[str, nn.Module],
    layers: nn.ModuleList,
    layers_name: str,
    *,
    streamed: bool = False,
    head: nn.Module | None = None,
) -> None:
    """:func:`check_targets_in_layers` for one modifier and its ``targets`` (``{name: module}``: its
    ``resolved_targets``, or what its ``check_model`` returns, as ``llmc-fsm explain --model`` checks them before
    any session is initialized). In memory a data-free modifier (``needs_inputs`` false) compresses every target at
    calibration end, wherever it lies.

    Raises:
        ValueError: naming the modifier, the modules outside the layers and the fix.
    """
    inside = layer_members(layers)
    if head is not None and not streamed:
        inside.add(id(head))
    if streamed:
        free: Any = frozenset()
    elif not getattr(modifier, "needs_inputs", True):
        free = set(targets)
    else:
        free = _inputless(modifier, targets)
    outside = [name for name, module in targets.items() if id(module) not in inside and name not in free]
    if outside:
        shown = ", ".join(outside[:5]) + (f" and {len(outside) - 5} more" if len(outside) > 5 else "")
        fix = "Add them to the modifier's ignore list."
        in_memory = set(_inputless(modifier, targets))
        in_memory |= {name for name, module in targets.items() if head is not None and module is head}
        if streamed and set(outside) <= in_memory:
            fix = (
                "The streamed path (low_memory; the command's default when the job allows it) writes the tensors "
                "outside the layers before compressing any: run in memory (--in-memory; Python: low_memory="
                "False), or add them to the modifier's ignore list."
            )
        # one sentence in memory and streamed, with or without a Linear head (until 2026-12-07 the streamed one and
        # a model without such a head left out the output head, which the in-memory pipeline calibrates)
        msg = (
            f"{modifier.modifier_name()} targets {shown}, outside the decoder layers ({layers_name}); the "
            f"sequential pipeline calibrates only the decoder layers and the output head. {fix}"
        )
        raise ValueError(msg)


def _inputless(modifier: Any, targets: Mapping[str, nn.Module]) -> frozenset[str]:
    """The names among ``targets`` that ``modifier`` compresses without calibration inputs: its
    ``inputless_targets(targets)`` (so before initialize too, on what its ``check_model`` returns: explain refused a
    quantized ``nn.Embedding`` that oneshot runs, found by a tester), else its ``targets_without_inputs``."""
    inputless = getattr(modifier, "inputless_targets", None)
    if callable(inputless):
        return frozenset(inputless(targets))
    return frozenset(getattr(modifier, "targets_without_inputs", frozenset()))


def head_target(modifier: Any, targets: Mapping[str, nn.Module], head: nn.Module | None) -> str | None:
    """The name under which ``modifier``'s ``targets`` hold ``head`` as a module it calibrates (not among its
    ``targets_without_inputs``), or ``None``."""
    free = getattr(modifier, "targets_without_inputs", frozenset())
    return next((n for n, m in targets.items() if head is not None and m is head and n not in free), None)


def head_targeted(session: Session, head: nn.Module | None) -> bool:
    """Whether a modifier of ``session`` targets ``head`` (among its ``resolved_targets``) as a module it
    calibrates (:func:`head_target`)."""
    return any(
        isinstance(targets := getattr(m, "resolved_targets", None), Mapping) and head_target(m, targets, head)
        for m in session.modifiers
    )


class LayerCheckpoint(Protocol):
    """Per-layer progress that :func:`run_sequential` can save and resume from
    (see :mod:`llmc_fsm.oneshot_job.resume`)."""

    def layers_done(self, num_layers: int) -> int:
        """How many leading decoder layers are already compressed and saved (0 for a fresh run)."""

    def restore(self, index: int, layer: nn.Module) -> None:
        """Put the saved compressed state of decoder layer ``index`` into ``layer``."""

    def save(self, index: int, layer: nn.Module) -> None:
        """Save decoder layer ``index`` right after the modifiers compressed it."""


def run_sequential(
    session: Session,
    *,
    model: nn.Module | None = None,
    calibration_data: Any = None,
    batch_size: int = 8,
    progress: bool = True,
    early_exit: bool = True,
    true_sequential: bool = True,
    checkpoint: LayerCheckpoint | None = None,
    device: torch.device | str | None = None,
    activation_budget: int | None = None,
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
            :func:`llmc_fsm.pipeline.layer.early_exit_module`); for Llama-style layers whose
            ``down_proj`` is hooked by pre-hooks this skips ``down_proj`` and
            the residual, ~1/4 of the calibration pass. Set ``False`` for a
            modifier that observes the layer by other means than torch hooks.
        true_sequential: one forward per layer, each group of targets
            compressed before any batch runs it (:mod:`llmc_fsm.pipeline.true_sequential`);
            ``False``: the plain order (llm-compressor's). Only for sessions of
            ``CalibratedModifier`` s whose targets are leaves hooked by pre-hooks (else plain).
        checkpoint: per-layer progress (:class:`LayerCheckpoint`): each layer is
            saved right after it is compressed; the first
            ``checkpoint.layers_done()`` layers are restored (after
            ``calibration_start``) instead of calibrated, and the calibration
            inputs are recomputed through them, so the run continues exactly
            where the saved one stopped.
        device: the execution device (``torch.device`` or a string :func:`llmc_fsm.pipeline.device.resolve_device`
            accepts; ``None``: where the model's first parameter is). The model's weights stay where they are: the
            embeddings and the other modules outside the decoder layers are onloaded for the capture of layer 0's
            inputs, each decoder layer for its calibration forwards, statistics, compression and propagation, and
            each goes back afterwards (:func:`llmc_fsm.pipeline.device.onloaded`).
        activation_budget: bytes the hidden states between layers (a layer's inputs and outputs) may take on the
            device; beyond it they live in CPU memory and move per batch. ``None``: half the device's free memory
            (no limit on the CPU). Results are bit-identical either way.

    Returns:
        A :class:`PipelineResult`. A model it quantized (compressed-tensors schemes on its modules) gets
        :class:`~llmc_fsm.output.save.CompressedSavePretrained` as its ``save_pretrained``, so that
        ``model.save_pretrained(dir)`` writes it compressed (transformers' own would write it dense).

    Raises:
        LifecycleError: the session is not initialized (or finalized).
        ValueError: no decoder layers, empty data, token ids outside the model's input embedding
            (:func:`check_token_ids`), or a modifier targets a module outside the decoder layers — all raised before
            any work (no event reaches the session).
    """
    t_start = time.perf_counter()
    model, batches = _check_inputs(session, model, calibration_data, batch_size)
    execution = _execution_device(model, device)
    if activation_budget is not None and (
        isinstance(activation_budget, bool) or not isinstance(activation_budget, int) or activation_budget < 0
    ):
        msg = f"activation_budget must be a number of bytes >= 0 or None, got {activation_budget!r}"
        raise ValueError(msg)
    check_calibrates_from_text(model)
    layers_name, layers = find_decoder_layers(model)
    head = output_head(model)
    check_targets_in_layers(session, layers, layers_name, head=head)
    check_token_ids(model, [b["input_ids"] for b in batches if isinstance(b.get("input_ids"), torch.Tensor)])
    was_training = model.training
    model.eval()
    cuda = execution.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(execution)
    runner = _LayerRunner(
        device=execution,
        store=activation_store(execution, activation_bytes(model, batches), activation_budget),
    )
    try:
        with torch.no_grad():
            resumed, layer_seconds = _run_layers(
                session,
                model,
                layers,
                batches,
                runner,
                progress=progress,
                early_exit=early_exit,
                true_sequential=true_sequential,
                checkpoint=checkpoint,
                head=_Head(head, layers_name) if head_targeted(session, head) else None,
            )
    finally:
        model.train(was_training)
    result = PipelineResult(
        layers_name=layers_name,
        num_layers=len(layers),
        num_batches=len(batches),
        num_tokens=sum(int(b["input_ids"].numel()) for b in batches if isinstance(b.get("input_ids"), torch.Tensor)),
        layer_seconds=layer_seconds,
        seconds=time.perf_counter() - t_start,
        resumed_layers=resumed,
        device=describe_device(execution),
        activations=runner.store.report(),
        layer_peak_device_bytes=runner.layer_peaks,
        peak_device_bytes=int(torch.cuda.max_memory_allocated(execution)) if cuda else None,
    )
    logger.info("sequential pipeline: %d layers, %d batches in %.2f s", len(layers), len(batches), result.seconds)
    if is_quantized(model):  # model.save_pretrained(dir) writes it compressed (oneshot's own output aside)
        CompressedSavePretrained.attach(model, session.recipe)
    return result


def _check_inputs(
    session: Session, model: nn.Module | None, data: Any, batch_size: int
) -> tuple[nn.Module, list[dict[str, Any]]]:
    """The model and the calibration batches :func:`run_sequential` works on, checked before any work."""

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
    data = data if data is not None else session.state.calibration_data
    if data is None:
        msg = "run_sequential() needs calibration data: pass calibration_data= or put it in the session state"
        raise ValueError(msg)
    return model, calibration_batches(data, batch_size=batch_size)


def check_token_ids(model: nn.Module, token_ids: list[torch.Tensor]) -> None:
    """Refuse calibration token ids outside ``[0, rows)`` of ``model``'s input embedding (``get_input_embeddings()``;
    nothing is checked for a model without one, or one without ``num_embeddings``), before any forward.
    ``token_ids``: integer tensors of any shape (``input_ids`` batches).

    Found by a tester: :func:`run_sequential` failed in the embedding's forward with torch's bare ``IndexError``
    (ids of another tokenizer, ``-100`` padding marks), where ``oneshot`` said what was wrong.

    Raises:
        ValueError: ``"calibration token ids must lie in [0, <rows>) (the rows of the model's input embedding), got
            ids from <low> to <high>: ..."``; every tensor empty (``[0, L]``, ``[N, 0]``): the data holds no token.
    """
    if token_ids and all(t.numel() == 0 for t in token_ids):  # found by a tester: failed inside transformers
        shapes = ", ".join(str(tuple(t.shape)) for t in token_ids[:3])
        msg = f"the calibration data holds no token (input_ids of shape {shapes}): give at least one window of tokens"
        raise ValueError(msg)
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a module without one: its forward says what it takes
        return
    rows = getattr(embedding, "num_embeddings", None)
    ids = [t for t in token_ids if t.numel() and not t.is_floating_point() and t.device.type != "meta"]
    if not isinstance(rows, int) or not ids:
        return
    low, high = min(int(t.min()) for t in ids), max(int(t.max()) for t in ids)
    if 0 <= low and high < rows:
        return
    msg = (
        f"calibration token ids must lie in [0, {rows}) (the rows of the model's input embedding), got ids "
        f"from {low} to {high}: were they made by this model's tokenizer (no -100 or other padding marks)?"
    )
    raise ValueError(msg)


def _execution_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    """``device`` resolved, or (``None``) the device of the model's first parameter (the CPU without one)."""
    if device is not None:
        return resolve_device(device) if not isinstance(device, torch.device) or device.type == "cuda" else device
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def activation_bytes(model: nn.Module, batches: list[dict[str, Any]]) -> int:
    """Bytes of one decoder layer's hidden states over ``batches`` (dicts with ``input_ids`` ``LongTensor[B, L]``):
    tokens x ``config.hidden_size`` x the size of the model's floating dtype (0 when the model has no ``hidden_size``
    in its config: counted as fitting). What :func:`llmc_fsm.pipeline.device.activation_store` weighs against the
    activation budget, here and in :mod:`llmc_fsm.pipeline.streaming`."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if not isinstance(hidden, int):
        return 0
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    tokens = sum(int(b["input_ids"].numel()) for b in batches if isinstance(b.get("input_ids"), torch.Tensor))
    return tokens * hidden * torch.empty(0, dtype=dtype).element_size()


@attrs.define(kw_only=True, eq=False)
class _LayerRunner:
    """The execution device, the activation store and the per-layer peak device memory of one pipeline run."""

    device: torch.device
    store: ActivationStore
    layer_peaks: list[int] = attrs.field(factory=list)

    def onload(self, module: nn.Module, *, skip: Any = ()) -> Any:
        """:func:`llmc_fsm.pipeline.device.onloaded` on this run's device."""
        return onloaded(module, self.device, skip=skip)


def _run_layers(
    session: Session,
    model: nn.Module,
    layers: nn.ModuleList,
    batches: list[dict[str, Any]],
    runner: _LayerRunner,
    *,
    progress: bool,
    early_exit: bool,
    true_sequential: bool,
    checkpoint: LayerCheckpoint | None,
    head: _Head | None = None,
) -> tuple[int, list[float]]:
    """The calibration proper (under ``no_grad``): returns (layers restored, wall time per calibrated layer); with
    ``head``, the output head is calibrated and compressed after the last layer (:meth:`_Head.calibrate`)."""
    from tqdm.auto import tqdm

    # compress_layer decides which modifiers take the grouped order; the calls are recorded either way
    store = runner.store
    with runner.onload(model, skip=[layers]):  # embeddings, rotary tables (the layers' forwards are stubbed)
        inputs = store.wrap(capture_layer_inputs(model, layers[0], batches, device=runner.device, keep=store.keep))
    # which submodules are called in which order, on which inputs: before the modifiers hook anything
    wanted = (early_exit or true_sequential) and len(inputs) > 0
    calls = record_calls_per_class(layers, inputs[0], device=runner.device) if wanted else {}
    if head is not None and inputs:  # before any hook: one forward of the last layer tells its output's form
        head.probe(layers[-1], inputs[0], runner)
    session.calibration_start()
    start, inputs = _resume(layers, inputs, checkpoint, runner, session.modifiers, head=head is not None)
    layer_seconds: list[float] = []
    bar = tqdm(
        range(start, len(layers)),
        initial=start,
        total=len(layers),
        desc="calibrating layers",
        unit="layer",
        disable=not progress,
        leave=False,
    )
    for index in bar:
        t0 = time.perf_counter()
        layer = layers[index]
        last = index + 1 == len(layers)
        cuda = runner.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(runner.device)
        with runner.onload(layer):  # calibration forwards, statistics, compression, propagation on the device
            outputs = compress_layer(
                layer,
                inputs,
                session.sequential_epoch_end,
                calls=calls.get(type(layer)),
                true_sequential=true_sequential,
                early_exit=early_exit,
                need_outputs=not last or head is not None,
                modifiers=session.modifiers,
            )
        if cuda:
            runner.layer_peaks.append(int(torch.cuda.max_memory_allocated(runner.device)))
        if checkpoint is not None:
            checkpoint.save(index, layer)  # from where the weights live
        inputs = store.hold(outputs) if outputs is not None else []
        trim_heap()  # the forwards' freed activations go back to the system
        layer_seconds.append(time.perf_counter() - t0)
    bar.close()
    if head is not None and inputs:
        head.calibrate(session, model, layers, batches, inputs, runner)
    del inputs
    session.calibration_end()
    return start, layer_seconds


@attrs.define(eq=False)
class _Head:
    """The output head a modifier targets (:func:`head_targeted`), calibrated after the last decoder layer."""

    module: nn.Module
    layers_name: str
    as_tuple: bool = False

    def probe(self, layer: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]], runner: _LayerRunner) -> None:
        """Whether ``layer`` (the last decoder layer) returns a tuple: its forward on the first batch's inputs of
        layer 0 with its own other arguments (the captured ones, :class:`~llmc_fsm.pipeline.forward.LayerKwargs`),
        before anything is hooked."""
        args, kwargs = inputs
        at = getattr(kwargs, "at", None)
        if at is not None:
            rest, kwargs = at(len(kwargs.per_layer) - 1)
            args = (args[0], *rest)
        kind = OutputKind()
        handle = layer.register_forward_hook(kind)
        try:
            with runner.onload(layer):
                layer(*args, **kwargs)
        finally:
            handle.remove()
        self.as_tuple = bool(kind.as_tuple)

    def calibrate(
        self,
        session: Session,
        model: nn.Module,
        layers: nn.ModuleList,
        batches: list[dict[str, Any]],
        states: Inputs,
        runner: _LayerRunner,
    ) -> None:
        """Every batch through the model's own forward from ``states`` (the last layer's outputs) to the head's
        input, where the modifiers' pre-hooks observe it and the forward stops (a pre-hook registered after theirs);
        then ``session.sequential_epoch_end([head])``.

        Raises:
            RuntimeError: the model's forward returned without calling its head.
        """
        logger.info("sequential pipeline: calibrating the output head on the last layer's outputs")
        stop = self.module.register_forward_pre_hook(_raise_stop)
        try:
            with replaying(model, self.layers_name, layers, states, self.as_tuple), runner.onload(model, skip=[layers]):
                for batch in batches:
                    inputs = {k: (v.to(runner.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
                    inputs.setdefault("use_cache", False)
                    try:
                        model(**inputs)
                    except StopForward:
                        continue
                    msg = f"the forward of {type(model).__name__} returned without calling its output head"
                    raise RuntimeError(msg)
        finally:
            stop.remove()
        with runner.onload(self.module):
            session.sequential_epoch_end([self.module])


def _resume(
    layers: nn.ModuleList,
    inputs: Inputs,
    checkpoint: LayerCheckpoint | None,
    runner: _LayerRunner,
    modifiers: list[Any],
    *,
    head: bool = False,
) -> tuple[int, Inputs]:
    """Restore the layers ``checkpoint`` holds and run the calibration inputs through them (each onloaded), as the
    interrupted run computed them (:class:`llmc_fsm.pipeline.layer.RestoredLayers`); the modifiers that follow the
    float model get its inputs to the first layer compressed now. With every layer restored the inputs go through
    them only when the output ``head`` is still to be calibrated on the last layer's outputs."""
    start = checkpoint.layers_done(len(layers)) if checkpoint is not None else 0
    resuming = 0 < start < len(layers) or (head and start == len(layers) > 0)
    restored = RestoredLayers(modifiers, inputs, resuming=resuming)
    for index in range(start):
        restored.through(
            layers[index],
            lambda index=index: checkpoint.restore(index, layers[index]),  # type: ignore[union-attr]
            onload=runner.onload,
            hold=runner.store.hold,
        )
    restored.hand_over()
    inputs = restored.inputs
    if start:
        logger.info("resumed: %d of %d decoder layers restored from saved progress", start, len(layers))
    return start, inputs
