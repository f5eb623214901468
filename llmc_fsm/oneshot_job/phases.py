"""The phases of :func:`llmc_fsm.oneshot`, in the order they run (each takes the :class:`Run` the others fill).

* :func:`prepare` — output directory, recipe -> sessions, the model's config (a quantized checkpoint refused), text
  files, then the work directory (no model yet; the settings, :class:`~llmc_fsm.oneshot_job.settings.OneshotSettings`,
  were checked when they were built);
* :func:`load` — model and tokenizer;
* :func:`data` — token windows; required state checked; perplexity before; generated calibration data;
* :func:`compress` — per session: initialize, run_sequential (each layer saved to the work directory), finalize;
* :func:`evaluate` — perplexity;
* :func:`save` — report; model, tokenizer, recipe.yaml, report.json written in the work directory, renamed into place.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from llmc_fsm.core.errors import MissingStateError
from llmc_fsm.data.images import (
    PROCESSOR_FILES,
    check_calibration_data,
    copy_processor_files,
    image_batches,
    is_image_dataset,
    is_processor,
    is_vision_language,
    load_error,
    load_processor,
    processor_files,
    read_image_captions,
    text_tokenizer,
)
from llmc_fsm.data.protocol import PerplexityCache, kept_tokenizer_state, perplexity, token_windows
from llmc_fsm.data.rows import TokenRows, is_rows, read_rows, row_batches
from llmc_fsm.models.hf_io import (
    first_line,
    hub_model_unavailable,
    hub_unreachable,
    looks_like_hub_id,
    meta_model,
    remote_code_refusal,
)
from llmc_fsm.models.known import (
    KNOWN_MODELS,
    check_model_name,
    known_model_cached,
    known_model_dir,
    load_model,
)
from llmc_fsm.models.layers import check_calibrates_from_text, find_decoder_layers
from llmc_fsm.oneshot_job.data import (
    DEFAULT_PROMPTS,
    calibration_inputs,
    calibration_overlap,
    check_modifiers,
    check_seq_len,
    describe,
    eval_windows,
    generate_calibration,
    is_tensor,
    read_text,
    torch_dtype_of,
    window_positions,
)
from llmc_fsm.oneshot_job.progress import quiet_progress
from llmc_fsm.oneshot_job.resume import (
    fingerprint,
    layer_progress,
    load_eval_before,
    load_windows,
    save_eval_before,
    save_windows,
)
from llmc_fsm.oneshot_job.settings import (
    DEFAULT_GENERATED,
    OneshotSettings,
    default_recipe,
    generated_recipe,
    multimodal_dense,
)
from llmc_fsm.output.directory import check_output_dir
from llmc_fsm.output.save import quantized_weights_as_compressed, weights_disk_bytes, write_output
from llmc_fsm.output.workdir import WorkDir, ranks_note, recover_previous, work_dir_path
from llmc_fsm.pipeline.device import describe_device, free_device_bytes, onloaded
from llmc_fsm.pipeline.sequential import run_sequential
from llmc_fsm.recipes.building import build_recipe, resolve_recipe
from llmc_fsm.recipes.history import merge_saved_recipe, without_training_stages
from llmc_fsm.recipes.model import Recipe
from llmc_fsm.report.build import build_report
from llmc_fsm.session.session import Session
from llmc_fsm.toolkit.distributed import is_distributed, is_main_process, rank_work, shard
from llmc_fsm.toolkit.packed import format_problem, saved_as
from llmc_fsm.toolkit.targets import OFFLOAD_REFUSAL, compact_names, offloaded_to, refuse_llmcompressor_modules

__all__ = [
    "Run",
    "calibration_windows",
    "compress",
    "data",
    "evaluate",
    "evaluate_before",
    "execution_summary",
    "given_tokenizer",
    "keep_windows",
    "load",
    "model_on_device",
    "prepare",
    "recipe_sessions",
    "run_report",
    "save",
    "token_data",
]

logger = logging.getLogger(__name__)


@attrs.define(kw_only=True, slots=False, eq=False)
class Run:
    """What the phases of :func:`llmc_fsm.oneshot` hand to one another: the frozen ``settings`` they were asked for,
    and the progress they make (nothing here is a copy of a setting)."""

    settings: OneshotSettings
    recipe: Recipe  # the recipe resolved, merged with a saved model's applied stages
    sessions: list[Session]
    needs_data: bool  # a modifier requires calibration data
    model_config: Any = None  # the model's config, read before any weight (None: a known name, or unreadable)
    work: WorkDir | None = None
    model: Any = None  # the model being compressed, once loaded
    tokenizer: Any = None
    cal_text: str | None = None
    cal_images: Any = None  # the image-caption records (llmc_fsm.data.images.ImageCaptions) of an image dataset
    cal_rows: Any = None  # the samples (llmc_fsm.data.rows.CalibrationRows) of a list of texts or a datasets.Dataset
    processor: Any = None  # the model's processor (saved with the output), with image calibration data its inputs
    #: a vision-language model directory whose processor files are copied into the output as they are (its
    #: processor could not be loaded); None: none to copy
    processor_source: Path | None = None
    ev_text: str | None = None
    model_name: str = ""
    windows: Any = None
    cal_source: str = ""
    eval_windows: Any = None
    ppl: dict[str, float | None] = attrs.field(factory=lambda: {"eval_before": None, "eval_after": None})
    ppl_before_reused: str | None = None
    seconds: dict[str, float] = attrs.field(factory=dict)
    t_start: float = attrs.field(factory=time.perf_counter)
    disk_before: int | None = None
    targeted: list[str] = attrs.field(factory=list)
    per_rank: list[int] = attrs.field(factory=list)
    pipelines: list[Any] = attrs.field(factory=list)  # the PipelineResult of each session's sequential pass
    #: the "runs on top of it" lines of the model's history (merge_saved_recipe), said once the checks passed
    history_notes: list[str] = attrs.field(factory=list)

    @property
    def out_path(self) -> Path | None:
        """The output directory (absolute), ``None`` without one or on a rank that does not write."""
        return None if self.work is None else self.work.output

    def add_targeted(self, session: Session) -> None:
        """Add the modules ``session``'s modifiers targeted, once its work is done (before its finalize): their names
        then, after a modifier of the stage renamed others' targets (REAP's dropped experts: found by a tester, the
        report called a kept expert targeted under a former expert's name)."""
        self.targeted.extend(n for m in session.modifiers for n in m.resolved_targets if n not in self.targeted)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall time of the block to ``seconds[phase]``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


def calibration_windows(run: Run) -> None:
    """The calibration windows: a resumed run's saved ones, the given tensor (its first ``num_calibration_samples``
    rows and ``max_seq_length`` columns when given), the samples of a list of texts or a dataset
    (:class:`~llmc_fsm.data.rows.TokenRows`, batches of samples of different lengths), or the dataset text's tokens.

    None (``[0, seq_len]``) when no modifier needs calibration data: a given dataset is then not used.
    """

    settings = run.settings
    if not run.needs_data:
        run.windows = torch.zeros(0, settings.seq_len, dtype=torch.long)
        unused = "; the dataset given is not used" if settings.dataset is not None else ""
        run.cal_source = f"none (no modifier needs calibration data{unused})"
        return

    saved = load_windows(run.work.path) if run.work is not None and run.work.resumed else None
    if run.cal_images is not None:
        run.windows = image_batches(
            run.processor, run.cal_images, batch_size=settings.batch_size, max_seq_length=settings.seq_len
        )
        run.cal_source = f"{describe(settings.dataset)} (images and text)"
    elif is_tensor(settings.dataset):
        run.windows = settings.dataset[: settings.num_calibration_samples, : settings.max_seq_length].long()
        cut = tuple(run.windows.shape) != tuple(settings.dataset.shape)
        run.cal_source = describe(settings.dataset) + (", its first {} rows x {} tokens" if cut else "").format(
            *run.windows.shape
        )
    elif run.cal_rows is not None:
        rows = run.cal_rows
        run.windows = row_batches(rows, run.tokenizer, seq_len=settings.max_seq_length, batch_size=settings.batch_size)
        lengths = run.windows.lengths()
        span = f"{min(lengths)}-{max(lengths)}" if min(lengths) != max(lengths) else str(lengths[0])
        what = "texts" if isinstance(settings.dataset, list | tuple) else f"rows of {rows.column!r}"
        tokenized = "" if rows.tokenized else " tokenized"
        run.cal_source = f"{rows.source}, {len(lengths)} {what}{tokenized} ({span} tokens)"
    elif run.cal_text is not None:
        run.windows = saved
        if saved is None:
            run.windows = token_windows(
                run.tokenizer,
                run.cal_text,
                num_windows=settings.num_samples,
                seq_len=settings.seq_len,
                from_end=True,
            )
        run.cal_source = describe(settings.dataset)
    elif saved is not None and run.needs_data:
        run.windows = saved
        run.cal_source = _generated_source(settings)


def _generated_source(settings: OneshotSettings) -> str:
    """The report's source of generated calibration: the prompts continued (``generate_calibration`` continues each
    ``ceil(n / prompts)`` times and stops at ``n`` samples: 2 samples use 2 of the 8 prompts)."""
    n, prompts = settings.num_samples, len(DEFAULT_PROMPTS)
    used = min(prompts, math.ceil(n / math.ceil(n / prompts)))
    return f"generated by the model (seed {settings.seed}, {used} prompt{'s' if used != 1 else ''})"


def token_data(run: Run) -> None:
    """Calibration and evaluation windows, after checking the sequence lengths against ``run.model`` (the loaded
    model, or the ``meta``-device one of a streamed run), then the modifiers' checks of it (no forward yet).

    Raises:
        ValueError: a sequence longer than the model's positions, a text too short, a modifier's check_model.
        MissingStateError: a modifier needs state one-shot does not give.
    """
    settings = run.settings
    _check_sequential_targets(run, run.model, say=True)  # again: a config the meta-device build could not take
    _check_lengths(run, run.model)
    with run.timed("data"):
        calibration_windows(run)
        if run.cal_rows is not None and run.needs_data:
            _check_rows_fit(run)
        if run.ev_text is not None:
            run.eval_windows = eval_windows(run.tokenizer, run.ev_text, settings.num_eval_windows, settings.eval_length)
            _warn_overlap(run)
        _check_token_ids(run)
    check_modifiers(run.sessions, run.model, run.windows if run.windows is not None else True)
    say_history(run)
    _say_upcast(run)


def _warn_overlap(run: Run) -> None:
    """One warning line when calibration and evaluation read the same text and it is too short for the calibration
    (its tail) to miss the evaluation windows (its head): the perplexity after compression is then measured partly on
    the tokens the compression was calibrated on (a newcomer's case: a 15k-token file given to both, 13 of 40
    windows shared, 77.70 against 78.12 with disjoint texts, without a word)."""
    if run.cal_text is None or run.cal_text != run.ev_text or not is_tensor(run.windows):
        return
    shared = calibration_overlap(*window_positions(run.tokenizer, run.ev_text, run.eval_windows, run.windows))
    if shared:
        logger.warning(
            "calibration and evaluation read the same text, which is too short to keep them apart: %d of the %d "
            "evaluation tokens were calibrated on, so the perplexity after compression is optimistic; use a longer "
            "text, fewer --num-samples / --eval-windows, or another --eval-text",
            shared,
            run.eval_windows.numel(),
        )


def say_history(run: Run) -> None:
    """Log the model history's "runs on top of it" lines (:attr:`Run.history_notes`) under the history module's
    logger, once: after every check of the model, the data and the modifiers passed (:func:`token_data`)."""
    history = logging.getLogger(merge_saved_recipe.__module__)
    for line in run.history_notes:
        history.warning("%s", line)
    run.history_notes.clear()


def _say_upcast(run: Run) -> None:
    """One line when a half-precision checkpoint (its config's dtype) is loaded in float32 (``dtype``, default
    float32), after every check passed: its dense weights are then saved in float32, twice their bytes (found by a
    README-only newcomer: a bfloat16 MoE model's W4A16 output was 1.9x its input, nothing said)."""
    config = run.model_config
    # transformers 4's torch_dtype read from the instance (transformers 5's property warns it is deprecated)
    stored = getattr(config, "dtype", None) or getattr(config, "__dict__", {}).get("torch_dtype")
    stored = str(stored).removeprefix("torch.") if stored is not None else None
    loaded_here = not isinstance(run.settings.model, nn.Module)  # a given model keeps its own dtype
    if loaded_here and run.settings.dtype == "float32" and stored in ("bfloat16", "float16"):
        logger.warning(
            "the checkpoint's weights are %s (its config.json) and this run loads, compresses and saves them in "
            "float32 (dtype, --dtype: default float32): what stays dense is saved at twice its bytes; give --dtype "
            "auto to keep %s",
            stored,
            stored,
        )


def _check_lengths(run: Run, model: Any) -> None:
    """The sequence lengths the job will feed ``model`` (a model or its config: the calibration windows', unless the
    job is data-free or its samples of different lengths are used whole; the evaluation windows') against its
    positions: before any weight is read (:func:`prepare`, on the config) and again on the loaded model.

    Raises:
        ValueError: a length above the model's ``max_position_embeddings``, naming it (:func:`check_seq_len`).
    """
    settings = run.settings
    # a list of texts or a dataset: max_seq_length only caps its samples, whose own lengths are checked
    # (_check_rows_fit; found by a tester: a cap of 8192 on 173-token samples was refused for a 256-position model)
    if run.needs_data and not is_rows(settings.dataset):
        if is_tensor(settings.dataset) and settings.max_seq_length is None:
            what = "the dataset tensor's length {n} (its columns; max_seq_length, --seq-len, cuts it)"
            check_seq_len(model, int(settings.dataset.shape[1]), what)
        else:
            check_seq_len(model, settings.seq_len, "sequence length {n} (--seq-len / eval)")
    if settings.eval_text is not None:  # named apart: its length need not be the one the caller gave
        if settings.eval_seq_length is not None:
            given = "eval_seq_length"
        elif settings.max_seq_length is not None:
            given = "max_seq_length, --seq-len"
        else:
            given = "the default: set eval_seq_length, or max_seq_length / --seq-len"
        check_seq_len(model, settings.eval_length, f"evaluation window length {{n}} ({given})")


def _check_token_ids(run: Run) -> None:
    """Calibration and evaluation token ids that the model's input embedding has no row for: refused before any
    forward, which would fail with an ``IndexError`` in the embedding (a tester's case: a tokenizer of a larger
    vocabulary than the model's, beside it in its directory or given).

    Raises:
        ValueError: ids below 0 or at least the embedding's row count, naming both and where the ids came from.
    """
    windows = run.windows
    given = [batch["input_ids"] for batch in windows] if isinstance(windows, TokenRows) else []
    if is_tensor(windows):
        given = [windows]
    tokenized = run.cal_text is not None or (run.cal_rows is not None and not run.cal_rows.tokenized)
    made = [] if run.eval_windows is None or not is_tensor(run.eval_windows) else [run.eval_windows]
    if windows is None and run.needs_data and run.settings.dataset is None and run.tokenizer is not None:
        with kept_tokenizer_state(run.tokenizer):  # the prompts the default calibration is generated from
            made += [torch.tensor(run.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in DEFAULT_PROMPTS]
    try:
        embedding = run.model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a module without one: its forward says what it takes
        return
    rows = getattr(embedding, "num_embeddings", None)
    if not isinstance(rows, int):
        return
    for ids, by_tokenizer in ((given, tokenized), (made, True)):
        ids = [t for t in ids if t.numel()]
        if not ids:
            continue
        low, high = min(int(t.min()) for t in ids), max(int(t.max()) for t in ids)
        if 0 <= low and high < rows:
            continue
        if by_tokenizer:
            msg = (
                f"the tokenizer gives token ids up to {high}, but the model's input embedding has {rows} rows: it "
                "is not this model's tokenizer (its vocabulary is larger); give the model's own (tokenizer=, or its "
                "files in the model directory)"
            )
        else:
            msg = (
                f"calibration token ids must lie in [0, {rows}) (the rows of the model's input embedding), got ids "
                f"from {low} to {high}: were they made by this model's tokenizer (no -100 or other padding marks)?"
            )
        raise ValueError(msg)


def _check_rows_fit(run: Run) -> None:
    """Samples of a list of texts or a dataset (after the ``max_seq_length`` cut, if any) that are longer than the
    model's ``max_position_embeddings``: refused before any forward.

    Raises:
        ValueError: naming the first such sample, its length and the limit.
    """
    limit = getattr(getattr(run.model, "config", None), "max_position_embeddings", None)
    lengths = run.windows.lengths()
    too_long = next((i for i, n in enumerate(lengths) if isinstance(limit, int) and n > limit), None)
    if too_long is not None:
        msg = (
            f"calibration sample {too_long} of the dataset has {lengths[too_long]} tokens, above the model's "
            f"max_position_embeddings ({limit}): pass max_seq_length (--seq-len) of at most {limit} to cut the samples"
        )
        raise ValueError(msg)


# --------------------------------------------------------------------------- prepare
def prepare(settings: OneshotSettings) -> Run:
    """What needs no model and was not checked by :class:`OneshotSettings` itself, every check first: the output
    directory checked, the recipe resolved into sessions, the model's config read (a quantized checkpoint refused,
    :func:`_check_on_meta`), the text files read, the kind of calibration data checked; only then is the work
    directory created (:meth:`~llmc_fsm.output.workdir.WorkDir.claim`) and settled with the resume fingerprint, so a
    call that fails a check leaves the disk as it was.

    Raises:
        ValueError / RecipeError / FileExistsError / OSError: as :func:`llmc_fsm.oneshot`, before any model work.
    """
    _check_output(settings)
    notes: list[str] = []
    merged, sessions = recipe_sessions(settings.model, settings.recipe, settings.fuse_stages, notes)
    _check_paths_outside_output(settings, sessions)
    run = Run(
        settings=settings,
        recipe=merged,
        sessions=sessions,
        needs_data=any(s.requires("calibration_data") for s in sessions),
        model_config=_model_config(settings.model),
        history_notes=notes,
    )
    if isinstance(settings.model, str) and settings.model in KNOWN_MODELS and not known_model_cached(settings.model):
        # the first run converts the known model's GGUF into the cache (~20 s), before the checks on its config
        with run.timed("convert"), quiet_progress(not settings.progress):
            known_model_dir(settings.model)
    _check_on_meta(run)
    _check_quantization_format(run)
    with run.timed("read_data"), quiet_progress(not settings.progress):
        if is_image_dataset(settings.dataset):
            used = settings.num_samples if run.needs_data else 0  # a data-free recipe reads none
            run.cal_images = read_image_captions(settings.dataset, used)
        elif is_rows(settings.dataset):
            if run.needs_data:  # a data-free recipe reads none
                longest = settings.shuffle_calibration_samples is False  # llm-compressor's order
                run.cal_rows = read_rows(
                    settings.dataset, settings.num_calibration_samples, settings.max_seq_length, longest=longest
                )
        elif settings.dataset is not None and not is_tensor(settings.dataset):
            run.cal_text = read_text("dataset (--dataset)", settings.dataset)
        if settings.eval_text is not None:
            run.ev_text = read_text("eval_text (--eval-text)", settings.eval_text)
    if settings.shuffle_calibration_samples is False and run.needs_data and not is_rows(settings.dataset):
        logger.warning(
            "shuffle_calibration_samples=False orders the samples of a datasets.Dataset or a list of texts (as "
            "llm-compressor orders a dataset); the calibration windows of this dataset are taken in their order"
        )
    if isinstance(settings.model, str | os.PathLike):  # an unknown name or a file: one line, before the device line
        check_model_name(settings.model)
        local = Path(settings.model).expanduser().is_dir()  # models/newarch: a directory, not the Hub ID it looks like
        if run.model_config is None and not local and looks_like_hub_id(os.fspath(settings.model)):  # why, if known
            missing = hub_model_unavailable(os.fspath(settings.model))
            if missing is not None:  # the known names too, as for an unknown plain name (a newcomer's case)
                raise RuntimeError(f"{missing}; known model names: {', '.join(sorted(KNOWN_MODELS))}")
    _check_data_kind(run)
    config = run.model_config if run.model_config is not None else _cached_known_config(settings.model)
    if config is not None:  # --seq-len above the model's positions: one line, before the device line and any weight
        _check_lengths(run, config)
    run.work = _claim_on_rank_0(settings)
    if run.work is not None:
        try:
            run.work.settle(_fingerprint(run), resume=settings.resume)
        except BaseException:
            run.work.release()
            raise
    return run


def _check_quantization_format(run: Run) -> None:
    """``quantization_format`` against the recipe, before any work: every weight scheme of its quantizing modifiers
    (their ``quantization_schemes``; AWQ's older form, its own scheme, has them too) must allow it
    (:func:`~llmc_fsm.toolkit.packed.format_problem`), and there must be one. Each quantized module is checked
    again, with its own class, when it is saved.

    Raises:
        ValueError: the recipe quantizes no weights, or a scheme that cannot be saved in the format (named).
    """
    fmt = run.settings.quantization_format
    if fmt is None:
        return
    schemes = {
        f"{type(modifier).__name__} {group}": scheme
        for session in run.sessions
        for modifier in session.modifiers
        for group, scheme in (getattr(modifier, "quantization_schemes", None) or {}).items()
        if scheme.weights is not None
    }
    if not schemes:
        msg = (
            f"quantization_format (--quantization-format) {fmt!r} is the format quantized weights are saved in, and "
            "the recipe quantizes no weights: leave it out"
        )
        raise ValueError(msg)
    problems = [f"{name}: {p}" for name, s in schemes.items() if (p := format_problem(nn.Linear, s, fmt)) is not None]
    if problems:
        msg = f"quantization_format (--quantization-format) {fmt!r} does not fit the recipe: {'; '.join(problems)}"
        raise ValueError(msg)


def _model_config(model: Any) -> Any:
    """The model's config, read once before any weight (:func:`_refuse_quantized` and :func:`_check_data_kind` use
    it): an ``nn.Module``'s own, a model directory's ``config.json`` (``AutoConfig``), a Hub ID's
    (:func:`_hub_config`); ``None`` for a known name or a config that cannot be read (loading then reports why)."""
    if isinstance(model, nn.Module):
        return getattr(model, "config", None)
    directory = Path(model).expanduser()
    if not (directory / "config.json").is_file():
        return _hub_config(os.fspath(model))
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(os.fspath(directory), trust_remote_code=False)
    except (OSError, ValueError) as err:  # loading the model reports it, as before
        if (refusal := remote_code_refusal(os.fspath(model), err)) is not None:
            raise ValueError(refusal) from None
        return None


def _check_on_meta(run: Run) -> None:
    """Before any weight is read: the modifiers' checks of the model
    (:func:`~llmc_fsm.oneshot_job.data.check_modifiers`: group sizes against the targets' widths, targets that
    match nothing, a checkpoint that is already quantized, ...) run on the model its config describes, built on the
    ``meta`` device (:func:`~llmc_fsm.models.hf_io.meta_model`; no weight read), after
    :func:`_check_runs_on_text` (an encoder-decoder model calibrated or evaluated), so such a refusal comes
    before the load, with the message the loaded model would get. A model directory, a Hub ID whose config could
    be read, and a known name whose converted directory is cached are checked here; a config the model classes
    cannot build, and an ``nn.Module`` (nothing to load), are checked after loading, as before. A check that fails
    on the ``meta`` model with anything but a refusal (``ValueError``, ``MissingStateError``) is left for the loaded
    model.

    Raises:
        ValueError: an ``nn.Module`` holding a module of llm-compressor's (its ``load_context``'s per-expert Linears:
            :func:`~llmc_fsm.toolkit.targets.refuse_llmcompressor_modules`), first.
        UnsupportedArchitectureError: (a ``ValueError``) an encoder-decoder model (Whisper, T5...) the job would
            calibrate or evaluate on token ids.
        ValueError: one line, the first modifier check that fails, e.g. ``"<modifier>: the model is already
            quantized (...); <what to do>"`` or a group size that divides no target's width.
        MissingStateError: as :func:`~llmc_fsm.oneshot_job.data.check_modifiers`.
    """
    if isinstance(run.settings.model, nn.Module):  # the modifiers check it after loading; the format here (pure)
        refuse_llmcompressor_modules(run.settings.model)  # llm-compressor's load_context experts: no reloadable save
        _check_runs_on_text(run, run.settings.model)  # first, as for a directory (its advice would lead there)
        _check_sequential_targets(run, run.settings.model)
        _check_format_of_targets(run, run.settings.model)
        return
    config = run.model_config if run.model_config is not None else _cached_known_config(run.settings.model)
    if config is None:
        return
    try:  # in the dtype the load takes (--dtype): the NVFP4 / MX checks read it
        skeleton = meta_model(config, torch_dtype_of(run.settings.dtype, config))
    except Exception as err:  # any config transformers cannot build: loading reports it, as before
        logger.debug("the model of this config cannot be built on meta (%s): checked after loading", err)
        return
    _check_runs_on_text(run, skeleton)  # an encoder-decoder model: refused as the loaded one would be
    _check_sequential_targets(run, skeleton)
    try:
        check_modifiers(run.sessions, skeleton, True)
        _check_format_of_targets(run, skeleton)
    except (ValueError, MissingStateError):  # a refusal, before any weight is read
        raise
    except Exception as err:  # a check that needs real weights: it runs again on the loaded model
        logger.debug("a modifier check failed on the meta-device model (%r): checked after loading", err)


def _check_sequential_targets(run: Run, model: Any, *, say: bool = False) -> None:
    """llm-compressor's ``sequential_targets`` (class names of its unit of sequential calibration) against the classes
    of ``model``'s decoder layers, which llmc-fsm calibrates one at a time: the same set is taken (``say``: one
    warning line, from the check on the loaded model), any other refused (llm-compressor would calibrate another
    unit: attention and MLP blocks apart, a vision tower's layers...).

    Raises:
        ValueError: other class names (named, with the decoder layers' classes).
    """
    names = run.settings.sequential_targets
    if names is None:
        return
    layers_name, layers = find_decoder_layers(model)
    classes = sorted({type(layer).__name__ for layer in layers})
    if sorted(set(names)) != classes:
        msg = (
            f"sequential_targets={list(names)!r} (llm-compressor's unit of sequential calibration): llmc-fsm "
            f"calibrates the model's decoder layers ({layers_name}: {', '.join(classes)}) one at a time and no other "
            "unit; "
            f"pass sequential_targets={classes!r} or leave it out"
        )
        raise ValueError(msg)
    if say:
        logger.warning(
            "sequential_targets=%r taken: the decoder layers (%s) are what llmc-fsm calibrates one at a time%s",
            list(names),
            layers_name,
            "" if run.needs_data else " (this recipe calibrates nothing)",
        )


def _check_runs_on_text(run: Run, model: Any) -> None:
    """An encoder-decoder model (Whisper) is refused only where the job runs it on token ids: a recipe that needs
    calibration data, or a perplexity evaluation; a data-free job quantizes its encoder's and decoder's Linears.

    Raises:
        UnsupportedArchitectureError: as :func:`~llmc_fsm.models.layers.check_calibrates_from_text`.
    """
    if run.needs_data:
        check_calibrates_from_text(model)
    elif run.settings.eval_text is not None:
        check_calibrates_from_text(model, evaluates=True)


def _check_format_of_targets(run: Run, model: Any) -> None:
    """``quantization_format`` (else a recipe config group's ``format``) against every target of the quantizing
    modifiers (those with ``scheme_of``), by its own class: a fused expert's matrix and an ``nn.Embedding`` allow
    fewer formats than a Linear (:func:`~llmc_fsm.toolkit.packed.weight_formats`). ``model``: the ``meta``-device
    skeleton, or the in-memory model.

    Raises:
        ValueError: targets that cannot be saved in the format (named, with the formats they allow).
    """
    given = run.settings.quantization_format
    modifiers = [m for session in run.sessions for m in session.modifiers]
    named = [s.format for m in modifiers for s in (getattr(m, "quantization_schemes", None) or {}).values()]
    if given is None and not any(named):  # no format asked for: the default suits every target
        return
    problems: dict[str, list[str]] = {}
    for modifier in modifiers:
        scheme_of = getattr(modifier, "scheme_of", None)
        if scheme_of is None:
            continue
        for name, module in modifier.check_model(model).items():
            scheme = scheme_of(name)
            fmt = given or getattr(scheme.format, "value", scheme.format)  # else the recipe's config group's format
            problem = None if fmt is None else format_problem(saved_as(module), scheme, fmt)
            if problem is not None:
                problems.setdefault(problem if given else f"format {fmt}: {problem}", []).append(name)
    if problems:
        parts = "; ".join(
            f"{compact_names(names[:3])}{f' ... ({len(names)} targets)' if len(names) > 3 else ''}: {problem}"
            for problem, names in problems.items()
        )
        if given:
            msg = f"quantization_format (--quantization-format) {given!r} does not fit the recipe: {parts}"
        else:
            msg = f"a config group's format does not fit its targets: {parts}"
        raise ValueError(msg)


def _cached_known_config(model: Any) -> Any:
    """The config of a known model name (:data:`~llmc_fsm.models.known.KNOWN_MODELS`) whose converted directory is
    in the cache already; ``None`` otherwise (the first run converts it, then checks the loaded model)."""
    if not isinstance(model, str) or model not in KNOWN_MODELS:
        return None
    directory = known_model_dir(model)
    return _model_config(directory) if (directory / "config.json").is_file() else None


def _check_data_kind(run: Run) -> None:
    """Before the weights are read: the kind of calibration data the model takes
    (:func:`llmc_fsm.data.images.check_calibration_data`: images for Mllama, images or text for LLaVA and Gemma 3,
    text for the others), from the config (:func:`_model_config`) of an in-memory model, a model directory or a Hub
    ID (its ``config.json`` read from the Hugging Face cache, or fetched when the Hub can be reached; not checked
    otherwise: loading then reports what fails); a known name is a text model. Image data needs a local model
    directory (its processor is loaded here, before the weights) or a loaded model, and one process.

    Raises:
        ValueError: one line, naming the model and what to give (or why its processor cannot be loaded).
    """
    settings, images = run.settings, run.cal_images is not None
    if not run.needs_data:
        return
    if images and is_distributed():
        msg = "image calibration data runs in one process (torch.distributed is not supported with it)"
        raise ValueError(msg)
    if run.cal_rows is not None and is_distributed():
        msg = (
            "calibration data given as a list of texts or a datasets.Dataset runs in one process (torch.distributed "
            "is not supported with it, whatever its samples' lengths); pass a LongTensor [N, L] of token ids to "
            "split it between the ranks"
        )
        raise ValueError(msg)
    model, config = settings.model, run.model_config
    if isinstance(model, nn.Module):
        check_calibration_data(model, images=images, source=settings.dataset)
        return
    if (Path(model).expanduser() / "config.json").is_file():
        if config is None:  # loading the model reports it, as before
            return
        check_calibration_data(config, images=images, source=settings.dataset)
        if images:  # before the weights: a processor that cannot be loaded stops the job here
            run.processor = load_processor(settings.tokenizer, Path(model).expanduser())
        return
    if images:
        msg = (
            f"image calibration data ({describe(settings.dataset)}) needs a local model directory or a loaded "
            f"model (model=, --model); {os.fspath(model)!r} is a known text model or a Hub ID"
        )
        raise ValueError(msg)
    if config is not None:
        check_calibration_data(config, images=False, source=settings.dataset)


def _hub_config(key: str) -> Any:
    """The config of the Hub model ID ``key`` without its weights: from the Hugging Face cache, else fetched when
    ``HF_HUB_OFFLINE`` is off and the Hub can be reached (:func:`llmc_fsm.models.hf_io.hub_unreachable`, 3 s at
    most); ``None`` for a known name, a path, or a config that cannot be had (loading then reports why)."""

    if key in KNOWN_MODELS or Path(key).expanduser().exists() or not looks_like_hub_id(key):
        return None
    from huggingface_hub import constants, try_to_load_from_cache
    from transformers import AutoConfig

    cached = isinstance(try_to_load_from_cache(key, "config.json"), str)
    if not cached and (constants.HF_HUB_OFFLINE or hub_unreachable(constants.ENDPOINT) is not None):
        return None
    try:
        only = {"local_files_only": True} if cached else {}
        return AutoConfig.from_pretrained(key, trust_remote_code=False, **only)
    except (OSError, ValueError) as err:
        if (refusal := remote_code_refusal(key, err)) is not None:
            raise ValueError(refusal) from None
        return None


def _check_output(settings: OneshotSettings) -> None:
    """The output directory (:func:`~llmc_fsm.output.directory.check_output_dir`, on every rank) and ``resume``
    checked, nothing created.

    Raises:
        ValueError: ``resume`` with several processes; as :func:`~llmc_fsm.output.directory.check_output_dir`.
        FileExistsError / NotADirectoryError / PermissionError: as
            :func:`~llmc_fsm.output.directory.check_output_dir`.
    """
    if settings.resume and is_distributed():
        work = work_dir_path(Path(settings.output_dir).expanduser().resolve())  # resume needs output_dir
        msg = (  # "start it again without --resume" alone was refused for the progress left (found by a tester)
            "resume (--resume) is not supported with several processes (torch.distributed): resume the run in one "
            f"process (without torchrun), or remove {str(work)!r} and start it again without --resume"
        )
        raise ValueError(msg)
    check_output_dir(settings.output_dir, settings.overwrite)  # the same errors on every rank; only rank 0 writes


def _check_paths_outside_output(settings: OneshotSettings, sessions: list[Session]) -> None:
    """Refuse files of the run inside the output directory, which the run writes elsewhere and moves into place when
    it finishes, replacing that directory: a modifier's own report file (a ``report_path`` argument: REAP's), and,
    where ``overwrite`` lets the run replace an existing output, the recipe, dataset and evaluation text files
    (found by testers: each was silently deleted).

    Raises:
        ValueError: naming the file, the output directory and what to do.
    """
    if settings.output_dir is None:
        return
    out = Path(settings.output_dir).resolve()

    def inside(path: Any) -> bool:
        return isinstance(path, str | os.PathLike) and out in Path(path).resolve().parents

    for session in sessions:
        for modifier in session.modifiers:
            path = getattr(modifier, "report_path", None)
            if inside(path):
                msg = (
                    f"{modifier.modifier_name()}: report_path {str(path)!r} is inside the output directory "
                    f"{str(settings.output_dir)!r}, which the run writes elsewhere and moves into place when it "
                    "finishes, replacing what is there; give a report_path outside it (REAP's kept experts are in "
                    "the output's report.json too: expert_pruning)"
                )
                raise ValueError(msg)
    inputs = {"recipe": settings.recipe, "dataset": settings.dataset, "eval_text": settings.eval_text}
    for what, path in inputs.items():
        if out.exists() and _is_file(path) and inside(path):
            msg = (
                f"the {what} file {str(path)!r} is inside the output directory {str(settings.output_dir)!r}, which "
                "overwrite (--overwrite) replaces when the run finishes, deleting it: move it out of that directory "
                "first"
            )
            raise ValueError(msg)


def _is_file(value: Any) -> bool:
    """Whether ``value`` names an existing file (a recipe given as YAML text, a tensor, a list: no)."""
    if not isinstance(value, str | os.PathLike) or "\n" in str(value):
        return False
    try:
        return Path(value).is_file()
    except OSError:  # e.g. a name too long to be a path
        return False


def _claim_on_rank_0(settings: OneshotSettings) -> WorkDir | None:
    """:func:`_claim` in one process or on rank 0 (``None`` on the other ranks of a torch.distributed group)."""

    return _claim(settings.output_dir, settings.overwrite) if is_main_process() else None


def _claim(output_dir: Any, overwrite: bool) -> WorkDir | None:
    """The output directory checked and its work directory created and locked (``None`` without an output)."""

    out_path = check_output_dir(output_dir, overwrite)
    if out_path is not None and recover_previous(out_path):
        out_path = check_output_dir(output_dir, overwrite)  # the restored output is there again
    return None if out_path is None else WorkDir.claim(out_path)


def _default_recipe(model: Any) -> Recipe:
    """The default recipe (SparseGPT 50%); on a multimodal model (by its directory or Hub id, or loaded), with the
    Linears outside its language model's decoder layers left dense, as the CLI's generated recipes leave them
    (:func:`~llmc_fsm.oneshot_job.settings.multimodal_dense`), with one log line."""
    dense = multimodal_dense(model)
    if not dense:
        return generated_recipe()
    logger.warning(
        "the default recipe leaves the Linears outside the language model's decoder layers dense (ignore %s), as "
        "llm-compressor's multimodal examples do; give a recipe to choose otherwise",
        ", ".join(dense),
    )
    return build_recipe(default_recipe(dense=dense), DEFAULT_GENERATED)


def recipe_sessions(model: Any, recipe: Any, fuse_stages: bool, notes: list[str]) -> tuple[Recipe, list[Session]]:
    """The recipe resolved and merged with the model's history (its "runs on top of it" lines into ``notes``), and
    its sessions (one per stage not yet applied; one for all with ``fuse_stages``). ``llmc-fsm explain --model``
    takes the same, so that it refuses and names stages as one-shot does.

    Raises:
        ValueError: the recipe has no modifier to run (empty, or every stage already applied).
    """
    given = recipe
    recipe = _default_recipe(model) if recipe is None else resolve_recipe(recipe)
    if not recipe.stages:  # an empty list of modifiers (a Session takes it; one-shot has nothing to run)
        msg = (
            f"the recipe has no modifier to run: {given!r} is empty; give at least one modifier, or leave recipe out "
            "(None) for the default recipe (SparseGPT 50%; on the command line, that of --method)"
        )
        raise ValueError(msg)
    recipe = without_training_stages(recipe)
    merged = merge_saved_recipe(recipe, model, notes=notes)
    fresh = [stage for stage in merged.stages if not stage.applied]
    if not fresh and recipe.stages and all(stage.applied for stage in recipe.stages):
        msg = (
            "the recipe has no modifier to run: it marks every stage 'applied: true' (a recipe.yaml saved by a run "
            "records the stages it applied); to run them again, set 'applied: false' on each stage (or remove the "
            "line)"
        )
        raise ValueError(msg)
    if not fresh:
        msg = (
            "the recipe has no modifier to run: every stage is already applied"
            + (f" to {model} (see its recipe.yaml)" if isinstance(model, str | os.PathLike) else "")
            + " with the same settings; nothing to do (change a setting or the method to compress further)"
        )
        raise ValueError(msg)
    if fuse_stages or len(fresh) == 1:
        return merged, [Session(merged)]
    return merged, [Session(Recipe([stage], merged.source)) for stage in fresh]


def _fingerprint(run: Run) -> dict[str, Any]:
    """The resume fingerprint of ``run`` (:func:`~llmc_fsm.oneshot_job.resume.fingerprint`), with ``dtype`` ``auto``
    recorded as the dtype the model's config names (what the load takes then): a resume with ``dtype="auto"`` of a
    ``float32`` run of a float32 checkpoint was refused as ``dtype 'float32' -> 'auto'`` (found by a tester)."""

    with run.timed("fingerprint"):
        items = fingerprint(
            run.settings,
            recipe=run.recipe,
            modifiers=[m for s in run.sessions for m in s.modifiers],
            text=_data_digest(run),
            hash_files=run.needs_data,  # a data-free job keeps no per-layer progress: no 0.5 GB read to hash
        )
    config = run.model_config if run.model_config is not None else _cached_known_config(run.settings.model)
    # transformers 4's torch_dtype read from the instance: transformers 5's property warns "`torch_dtype` is
    # deprecated!" (an in-memory model without a dtype in its config, with output_dir: found by a tester)
    named = getattr(config, "dtype", None) or getattr(config, "__dict__", {}).get("torch_dtype")
    loaded_here = not isinstance(run.settings.model, nn.Module)  # a given model keeps its own dtype
    if run.settings.dtype == "auto" and loaded_here and named is not None:  # none named: the load decides
        items["pipeline"]["dtype"] = str(named).removeprefix("torch.")
    return items


def _data_digest(run: Run) -> str | None:
    """What the resume fingerprint hashes of the calibration data read: the text, or a digest of the images or of
    the samples of a list of texts / dataset (``None``: a tensor, hashed there, or generated data)."""
    if run.cal_images is not None:
        return f"images {run.cal_images.digest()}"
    if run.cal_rows is not None:
        return f"rows {run.cal_rows.digest()}"
    return run.cal_text


# --------------------------------------------------------------------------- load
def given_tokenizer(settings: OneshotSettings) -> Any:
    """The ``tokenizer`` setting, loaded with ``AutoTokenizer.from_pretrained`` when it is a directory or Hub id
    (as llm-compressor takes it); a processor's own tokenizer when it is a processor object (llm-compressor's
    ``processor=``: :func:`~llmc_fsm.data.images.text_tokenizer`; the processor itself is saved with the output);
    ``None`` when none was given."""
    if isinstance(settings.tokenizer, str | os.PathLike):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(os.fspath(settings.tokenizer), trust_remote_code=False)
        except ValueError as err:  # one that is its repository's own code: one line (it was transformers' text)
            refusal = remote_code_refusal(os.fspath(settings.tokenizer), err, what="the tokenizer")
            if refusal is None:
                raise
            raise ValueError(refusal) from None
    return text_tokenizer(settings.tokenizer)


def _name_or_path(model: Any) -> str | None:
    """The directory or Hub id an in-memory transformers model was loaded from (its ``name_or_path``, else its
    config's ``_name_or_path``); ``None`` when it has none."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return name if isinstance(name, str) and name else None


def _tokenizer_of(model: Any) -> Any:
    """The tokenizer of an in-memory transformers model, as llm-compressor's ``oneshot`` finds it: from the model's
    ``name_or_path`` (the directory or Hub id it was loaded from; a Hub id only from the local Hugging Face cache),
    said in a log line; ``None`` where there is none."""
    name = _name_or_path(model)
    if name is None:
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True, trust_remote_code=False)
    except OSError:  # none there (or a Hub id not in the local cache)
        return None
    except ValueError as err:
        refusal = remote_code_refusal(name, err, what="the tokenizer of")
        if refusal is None:  # there but broken (a corrupt tokenizer.json): its own error, as llm-compressor's
            msg = f"{name}: the tokenizer files could not be loaded ({first_line(err)})"
            raise ValueError(msg) from err
        logger.warning("%s: it is not loaded", refusal)  # its repository's own code (it said "no tokenizer files")
        return None
    logger.info("tokenizer: loaded from the model's name_or_path %r (none given)", name)
    return tokenizer


def load(run: Run) -> None:
    """The model and tokenizer (an ``nn.Module`` is used as it is).

    Raises:
        ValueError: text must be tokenized but there is no tokenizer; from :func:`llmc_fsm.models.known.load_model`.
        RuntimeError / OSError: from :func:`llmc_fsm.models.known.load_model`.
    """
    settings = run.settings
    needs_text = _needs_text(run)
    with run.timed("load"):
        run.tokenizer = given_tokenizer(settings)
        if run.processor is None and is_processor(settings.tokenizer):  # saved with the output, as llm-compressor
            run.processor = settings.tokenizer
        if isinstance(settings.model, nn.Module):
            run.model = settings.model
            _check_runs_on_text(run, run.model)
            _load_processor(run)
            run.model_name = type(run.model).__name__
            offloaded = offloaded_to(run.model)
            if offloaded is not None:
                raise ValueError(OFFLOAD_REFUSAL.format(where=offloaded))
            if any(p.is_meta for p in run.model.parameters()):
                msg = (
                    "the model's parameters are on the meta device (accelerate's device_map offloading, or a "
                    "low_memory run's returned model): give the directory it was loaded from or written to as the "
                    "model instead, with low_memory=True to bound the memory (model=DIR; --model DIR --low-memory)"
                )
                raise ValueError(msg)
            if run.tokenizer is None and needs_text:
                run.tokenizer = _tokenizer_of(run.model)
            if run.tokenizer is None and needs_text:
                msg = (
                    "an in-memory model needs tokenizer= to tokenize text (or pass dataset as a LongTensor of "
                    "token ids); its name_or_path has no tokenizer llmc-fsm can load (no tokenizer files here, or "
                    "one that is its repository's own code)"
                )
                raise ValueError(msg)
            _keep_processor(run)
            run.disk_before = sum(p.numel() * p.element_size() for p in run.model.parameters())
            return

        run.model_name = os.fspath(settings.model)
        dtype = "auto" if settings.dtype == "auto" else torch_dtype_of(settings.dtype)  # auto: from_pretrained's own
        loaded, tokenizer = load_model(settings.model, torch_dtype=dtype)  # a vision-language model with its tower
        run.model = loaded
        _check_runs_on_text(run, run.model)
        _load_processor(run)
        _keep_processor(run)
        run.tokenizer = run.tokenizer if run.tokenizer is not None else tokenizer
        refuse_without_tokenizer(run)
        run.disk_before = weights_disk_bytes(Path(run.model_name), loaded)


def _needs_text(run: Run) -> bool:
    """Whether the job tokenizes text: calibration text or rows of text, evaluation text, or the default generated
    calibration."""
    texts = run.cal_text is not None or (run.cal_rows is not None and not run.cal_rows.tokenized)
    return texts or run.ev_text is not None or (run.settings.dataset is None and run.needs_data)


def refuse_without_tokenizer(run: Run) -> None:
    """Raise when the job tokenizes text (:func:`_needs_text`) and the model has no tokenizer (``run.tokenizer``).

    Raises:
        ValueError: ``model ... has no tokenizer llmc-fsm can load ...``.
    """
    if run.tokenizer is None and _needs_text(run):
        msg = (
            f"model {run.model_name!r} has no tokenizer llmc-fsm can load (no tokenizer files, or one that is its "
            "repository's own code), so text (--dataset, --eval-text or the default "
            "generated calibration) cannot be tokenized; add the tokenizer files to its directory (from Python "
            "also: tokenizer=..., or dataset= a LongTensor of token ids)"
        )
        raise ValueError(msg)


def _load_processor(run: Run) -> None:
    """With image calibration data that a modifier uses: the model's processor in ``run.processor`` (a model
    directory's was loaded by :func:`_check_data_kind`) and the processor's tokenizer in ``run.tokenizer`` (unless
    one was given)."""
    if run.cal_images is None or not run.needs_data:
        return
    check_calibration_data(run.model, images=True, source=run.settings.dataset)  # a config AutoConfig did not read
    if not hasattr(run.processor, "image_processor"):  # none yet, or a given processor of no images
        run.processor = load_processor(run.settings.tokenizer, run.settings.model)
    if run.tokenizer is None or run.tokenizer is run.processor:
        run.tokenizer = run.processor.tokenizer


def _keep_processor(run: Run) -> None:
    """The processor of a vision-language or audio model, so that the output directory gets its files
    (``preprocessor_config.json``, ``processor_config.json``, ``chat_template.json``...) next to the tokenizer's and
    reloads with ``AutoProcessor``, whatever the data: ``AutoProcessor`` of the model directory, or of an in-memory
    model's ``processor=``/``tokenizer=`` directory or else its ``name_or_path`` (as llm-compressor finds it; not
    when a tokenizer object was given, which is saved as it is), in ``run.processor``. A model counts when it is a
    vision-language one or its directory holds a ``preprocessor_config.json``/``processor_config.json`` (Whisper's
    and Qwen2-Audio's feature extractors: their processors were left out, found by a tester). A processor that
    cannot be loaded (e.g. one that needs torchvision: Qwen2-VL, Pixtral) has its files copied from the directory as
    they are (``run.processor_source``; a warning names them). An in-memory vision-language model whose source is
    no local directory nor a Hub id in the local cache: a warning that the output has no processor files. Nothing
    without an output directory (or on a rank that does not write)."""

    model = run.settings.model
    given = run.settings.tokenizer
    in_memory = isinstance(model, nn.Module)
    if run.processor is not None or run.work is None:
        return
    if in_memory and given is not None and not isinstance(given, str | os.PathLike):
        return  # a tokenizer object: saved as it is (llm-compressor saves the object it is given)
    if in_memory:  # a processor= directory given as text: llm-compressor loads AutoProcessor from it (a tester's case)
        where = os.fspath(given) if given is not None else _name_or_path(model)
    else:
        where = os.fspath(model)
    vision = is_vision_language(getattr(run.model, "config", None))
    directory = Path(where).expanduser() if where is not None else None
    if directory is None or not directory.is_dir():
        if in_memory and vision:
            _processor_from_cache(run, where)
        return
    found = processor_files(directory)
    extracts = any((directory / name).is_file() for name in ("preprocessor_config.json", "processor_config.json"))
    if not found or not (vision or extracts):  # the source has none, or a text model's chat template alone
        return
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(os.fspath(directory), trust_remote_code=False)
    except (ImportError, OSError, ValueError, TypeError, AttributeError) as err:
        run.processor_source = directory
        logger.warning(
            "%s: its processor could not be loaded (%s); its files are copied into the output as they are, each "
            "unless the tokenizer's save writes one of the same name: %s",
            directory,
            load_error(err),
            ", ".join(found),
        )
        return
    if not is_processor(processor):  # AutoProcessor gave a tokenizer or a feature extractor: the files as they are
        run.processor_source = directory
        return
    run.processor = processor
    if in_memory:
        logger.info("processor: loaded from %r (AutoProcessor), saved with the output", where)


def _processor_from_cache(run: Run, name: str | None) -> None:
    """The processor of an in-memory vision-language model whose ``name_or_path`` (``name``) is not a local
    directory: ``AutoProcessor`` of a Hub id in the local Hugging Face cache, else a warning that the output has no
    processor files and how to add them."""
    processor = None
    if name is not None and looks_like_hub_id(name):
        from transformers import AutoProcessor

        with contextlib.suppress(ImportError, OSError, ValueError, TypeError, AttributeError):
            processor = AutoProcessor.from_pretrained(name, local_files_only=True, trust_remote_code=False)
    if hasattr(processor, "image_processor"):
        run.processor = processor
        logger.info("processor: loaded from the model's name_or_path %r (local cache), saved with the output", name)
        return
    where = f"its name_or_path {name!r} is no local directory holding them" if name else "it has no name_or_path"
    logger.warning(
        "the in-memory vision-language model's processor files (%s...) are not saved with the output: %s; pass "
        "processor=AutoProcessor.from_pretrained(<the model's directory>) (or tokenizer=) to save them",
        ", ".join(PROCESSOR_FILES[:2]),
        where,
    )


# --------------------------------------------------------------------------- data
def data(run: Run) -> None:
    """Token windows, the required-state check, perplexity before, generated calibration data."""

    settings = run.settings
    token_data(run)
    evaluate_before(run)
    if run.windows is None:
        with run.timed("generate_calibration"), model_on_device(run):
            run.windows = generate_calibration(
                run.model,
                run.tokenizer,
                num_samples=settings.num_samples,
                seq_len=settings.seq_len,
                seed=settings.seed,
                progress=settings.progress,
            )
        run.cal_source = _generated_source(settings)
    keep_windows(run)


def keep_windows(run: Run) -> None:
    """Save the calibration windows in the work directory for a resumed run (nothing without one or without
    calibration data)."""
    if run.work is not None and is_tensor(run.windows) and run.windows.shape[0] > 0:
        save_windows(run.work.path, run.windows)


def evaluate_before(run: Run, measure: Callable[[], float] | None = None) -> None:
    """Perplexity before compression (nothing without evaluation windows): a resumed run reuses the value its first
    run measured on the same windows, and a model directory or known model whose files, dtype and windows were
    measured before reads it from the :class:`~llmc_fsm.data.protocol.PerplexityCache` (the report says
    ``reused: measured <time>``); otherwise ``measure()`` (default: :func:`evaluate` on the in-memory model; the
    streamed path passes its own) is timed as ``eval_before`` and its value cached.
    """

    if run.eval_windows is None:
        return
    saved = load_eval_before(run.work.path, run.eval_windows) if run.work is not None and run.work.resumed else None
    if saved is not None:  # with the interrupted run's note (the dense-perplexity cache's): its report, unchanged
        run.ppl["eval_before"], run.ppl_before_reused = saved
        return
    cache = PerplexityCache.default()
    key = _dense_cache_key(run, cache)
    hit = cache.get(key)
    if hit is not None:
        run.ppl["eval_before"], run.ppl_before_reused = hit["ppl"], f"reused: measured {hit['measured']}"
    else:
        if measure is None:
            evaluate(run, "eval_before")
        else:
            with run.timed("eval_before"):
                run.ppl["eval_before"] = measure()
        cache.put(key, run.ppl["eval_before"], model=run.model_name, dtype=run.settings.dtype)
    if run.work is not None:
        save_eval_before(run.work.path, run.eval_windows, run.ppl["eval_before"], run.ppl_before_reused)


def _dense_cache_key(run: Run, cache: PerplexityCache) -> str | None:
    """The :class:`~llmc_fsm.data.protocol.PerplexityCache` key of the model's files (``None``: an ``nn.Module``)."""
    if run.model_name == type(run.model).__name__:
        return None
    directory = known_model_dir(run.model_name) if run.model_name in KNOWN_MODELS else run.model_name
    return cache.key(directory, run.settings.dtype, run.eval_windows)


# --------------------------------------------------------------------------- compress
def compress(run: Run) -> None:
    """Each session: initialize, calibrate and compress layer by layer (or data-free), finalize."""

    with run.timed("compress"):
        windows, run.per_rank = shard(run.windows)  # this rank's share under torch.distributed
        for index, session in enumerate(run.sessions):
            session.initialize(model=run.model, calibration_data=run.windows)
            try:
                if calibration_inputs(session, windows).shape[0] > 0:
                    result = run_sequential(
                        session,
                        model=run.model,
                        calibration_data=windows,
                        batch_size=run.settings.batch_size,
                        progress=run.settings.progress,
                        checkpoint=layer_progress(run.work, index, len(run.sessions), session),
                        device=run.settings.execution_device,
                        activation_budget=run.settings.activation_budget_bytes,
                    )
                    run.pipelines.append(result)
                else:
                    session.calibration_start()
                    session.calibration_end()
            except BaseException:
                with contextlib.suppress(Exception):
                    session.finalize()
                raise
            run.add_targeted(session)
            session.finalize()


# --------------------------------------------------------------------------- evaluate, save
def evaluate(run: Run, phase: str) -> None:
    """Perplexity on the evaluation windows (nothing without ``eval_text``)."""
    if run.eval_windows is None:
        return

    with run.timed(phase), quantized_weights_as_compressed(run.model), model_on_device(run):
        run.ppl[phase] = perplexity(run.model, run.eval_windows, progress=run.settings.progress)


@contextlib.contextmanager
def model_on_device(run: Run) -> Iterator[None]:
    """The whole model on the execution device inside the block when its weights fit in 90% of the device's free
    memory (perplexity, generated calibration data); otherwise it runs where its weights are, and a warning says so.
    On the CPU: nothing moves."""
    device = run.settings.execution_device
    free = free_device_bytes(device)
    size = sum(p.numel() * p.element_size() for p in run.model.parameters())
    if free is None or size <= 0.9 * free:
        with onloaded(run.model, device):
            yield
        return
    logger.warning(
        "the model's weights (%.2f GiB) do not fit in 90%% of %s's free memory (%.2f GiB): perplexity and generated "
        "calibration data run where the weights are",
        size / 2**30,
        device,
        free / 2**30,
    )
    yield


def save(run: Run) -> None:
    """Build the report; write model, tokenizer, recipe.yaml and report.json to the output directory."""
    report = run_report(run)
    if run.work is None:
        report.finish(run.t_start)
    else:
        run.work.staging.mkdir()
        tokenizer = run.processor if run.processor is not None else run.tokenizer  # a processor writes both
        write_output(
            run.work.staging,
            run.model,
            tokenizer,
            run.recipe,
            report,
            run.disk_before,
            run.settings.quantization_format,
        )
        if run.processor_source is not None:  # the ones the save wrote (the tokenizer's) are kept
            copied = copy_processor_files(run.processor_source, run.work.staging)
            logger.info("processor files copied from %s as they are: %s", run.processor_source, ", ".join(copied))
        report.output_dir = str(run.out_path)
        report.finish(run.t_start)
        (run.work.staging / "report.json").write_text(report.to_json() + "\n", encoding="utf-8")
        run.work.publish()
    run.model.llmc_fsm_report = report


def run_report(run: Run, modules: Any = None) -> Any:
    """The :class:`~llmc_fsm.report.build.OneshotReport` of ``run`` (``modules``: sparsity measured while streaming)."""

    return build_report(
        model=run.model,
        model_name=run.model_name,
        recipe=run.recipe,
        modifiers=[m for session in run.sessions for m in session.modifiers],
        calibration={
            "source": run.cal_source,
            "num_samples": int(run.windows.shape[0]),
            "seq_len": int(run.windows.shape[1]),
            "num_tokens": int(run.windows.numel()),
            **({"per_rank": run.per_rank} if len(run.per_rank) > 1 else {}),
        },
        ppl_before=run.ppl["eval_before"],
        ppl_after=run.ppl["eval_after"],
        eval=None
        if run.eval_windows is None
        else {
            "source": describe(run.settings.eval_text),
            "num_windows": int(run.eval_windows.shape[0]),
            "seq_len": run.settings.eval_length,
            **({"before": run.ppl_before_reused} if run.ppl_before_reused else {}),
        },
        seconds=run.seconds,
        targeted=run.targeted,
        modules=modules,
        execution=execution_summary(run),
    )


def execution_summary(run: Run) -> dict[str, Any]:
    """Where the job computed, for the report: the device (name, total memory), the torch threads (and, for a run
    that continued an interrupted one, the threads that one used: the last bits depend on them), where the
    activations between layers lived, wall time per calibrated layer (summed over the sessions), peak device memory
    (overall and per layer, CUDA only) and, when ranks shared the work, each rank's share
    (:func:`llmc_fsm.toolkit.distributed.rank_work`)."""
    device = run.settings.execution_device
    summary: dict[str, Any] = {"device": describe_device(device), "threads": torch.get_num_threads()}
    if run.work is not None and run.work.resumed:  # the bits depend on the threads of each part (a newcomer's case)
        summary["resumed"] = {"threads": run.work.resumed_threads}
        ranks = ranks_note(run.work.resumed_ranks)  # a torchrun run's layers beside this process's (a tester's case)
        if ranks is not None:
            summary["resumed"].update(calibrated_on=run.work.resumed_ranks, ranks=ranks)
    if run.pipelines:
        last = run.pipelines[-1]
        summary["activations"] = last.activations
        summary["layer_seconds"] = [sum(v) for v in zip(*(p.layer_seconds for p in run.pipelines), strict=False)]
        peaks = [p.peak_device_bytes for p in run.pipelines if p.peak_device_bytes is not None]
        if peaks:
            summary["peak_device_bytes"] = max(peaks)
            summary["layer_peak_device_bytes"] = [
                max(v) for v in zip(*(p.layer_peak_device_bytes for p in run.pipelines), strict=False)
            ]
    work = rank_work([m for session in run.sessions for m in session.modifiers])
    if work:
        summary["compress_per_rank"] = work
    return summary
