"""The phases of :func:`llmc_fsm.oneshot`, in the order they run (each takes the :class:`Run` the others fill).

* :func:`prepare` — sizes, output and work directory, recipe -> sessions, text files (no model yet);
* :func:`load` — model and tokenizer;
* :func:`data` — token windows; required state checked; perplexity before; generated calibration data;
* :func:`compress` — per session: initialize, run_sequential (each layer saved to the work directory), finalize;
* :func:`evaluate` — perplexity;
* :func:`save` — report; model, tokenizer, recipe.yaml, report.json written in the work directory, renamed into place.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from llmc_fsm.oneshot_data import (
    DEFAULT_PROMPTS,
    calibration_inputs,
    calibration_windows,
    check_dataset_tensor,
    check_modifiers,
    check_seq_len,
    describe,
    eval_windows,
    is_tensor,
    parse_dtype,
    positive_int,
    read_text,
    torch_dtype_of,
)
from llmc_fsm.output import check_output_not_source, weights_disk_bytes
from llmc_fsm.progress_bars import quiet_progress

if TYPE_CHECKING:
    from llmc_fsm.recipe import Recipe
    from llmc_fsm.session import Session
    from llmc_fsm.workdir import WorkDir

__all__ = ["Run", "compress", "data", "evaluate", "load", "positive_int", "prepare", "run_report", "save"]


@attrs.define(kw_only=True, slots=False, eq=False)
class Run:
    """What the phases of :func:`llmc_fsm.oneshot` hand to one another."""

    model: Any
    tokenizer: Any
    dataset: Any
    recipe: Recipe
    sessions: list[Session]
    out_path: Path | None
    num_samples: int
    seq_len: int
    eval_windows_n: int
    eval_len: int
    batch_size: int
    seed: int
    progress: bool
    eval_source: Any
    needs_data: bool
    dtype: str = "float32"
    work: WorkDir | None = None
    cal_text: str | None = None
    ev_text: str | None = None
    model_name: str = ""
    windows: Any = None
    cal_source: str = ""
    eval_windows: Any = None
    ppl: dict[str, float | None] = attrs.field(factory=lambda: {"eval_before": None, "eval_after": None})
    seconds: dict[str, float] = attrs.field(factory=dict)
    t_start: float = attrs.field(factory=time.perf_counter)
    disk_before: int | None = None
    targeted: list[str] = attrs.field(factory=list)
    per_rank: list[int] = attrs.field(factory=list)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall time of the block to ``seconds[phase]``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


# --------------------------------------------------------------------------- prepare
def prepare(model: Any, recipe: Any, dataset: Any, **kw: Any) -> Run:
    """Checks that need no model: sizes, output and work directory, recipe -> sessions, the text files.

    Raises:
        ValueError / RecipeError / FileExistsError / OSError: as :func:`llmc_fsm.oneshot`, before any model work.
    """
    num_samples = positive_int("num_calibration_samples (--num-samples)", kw["num_calibration_samples"])
    seq_len = positive_int("max_seq_length (--seq-len)", kw["max_seq_length"])
    eval_n = positive_int("num_eval_windows (--eval-windows)", kw["num_eval_windows"])
    batch_size = positive_int("batch_size (--batch-size)", kw["batch_size"])
    eval_len = positive_int("eval_seq_length", kw["eval_seq_length"]) if kw["eval_seq_length"] is not None else seq_len
    dtype = parse_dtype(kw["dtype"], model)
    check_output_not_source(kw["output_dir"], model)
    work = _claim_on_rank_0(kw)
    try:
        merged, sessions = _sessions(model, recipe, kw["fuse_stages"])
        check_dataset_tensor(dataset)
        run = Run(
            model=model,
            tokenizer=kw["tokenizer"],
            dataset=dataset,
            recipe=merged,
            sessions=sessions,
            out_path=None if work is None else work.output,
            num_samples=num_samples,
            seq_len=seq_len,
            eval_windows_n=eval_n,
            eval_len=eval_len,
            batch_size=batch_size,
            seed=kw["seed"],
            progress=kw["progress"],
            eval_source=kw["eval_text"],
            dtype=dtype,
            needs_data=any("calibration_data" in m.required_keys() for s in sessions for m in s.modifiers),
            work=work,
        )
        with run.timed("read_data"), quiet_progress(not run.progress):
            if dataset is not None and not is_tensor(dataset):
                run.cal_text = read_text("dataset (--dataset)", dataset)
            if kw["eval_text"] is not None:
                run.ev_text = read_text("eval_text (--eval-text)", kw["eval_text"])
        if work is not None:
            work.settle(_fingerprint(run, kw["fuse_stages"]), resume=kw["resume"])
    except BaseException:
        if work is not None:
            work.release()
        raise
    return run


def _claim_on_rank_0(kw: dict[str, Any]) -> WorkDir | None:
    """:func:`_claim` in one process or on rank 0; other ranks of a torch.distributed group only check the output."""
    from llmc_fsm.distributed import is_distributed, is_main_process
    from llmc_fsm.output import check_output_dir

    if kw["resume"] and kw["output_dir"] is None:
        msg = "resume (--resume) needs output_dir (--output): the progress to resume is kept next to the output"
        raise ValueError(msg)
    if kw["resume"] and is_distributed():
        msg = (
            "resume (--resume) is not supported with several processes (torch.distributed): resume the run in one "
            "process, or start it again without --resume"
        )
        raise ValueError(msg)
    if is_main_process():
        return _claim(kw["output_dir"], kw["overwrite"])
    check_output_dir(kw["output_dir"], kw["overwrite"])  # the same errors on every rank; only rank 0 writes
    return None


def _claim(output_dir: Any, overwrite: bool) -> WorkDir | None:
    """The output directory checked and its work directory created and locked (``None`` without an output)."""
    from llmc_fsm.output import check_output_dir
    from llmc_fsm.workdir import WorkDir, recover_previous

    out_path = check_output_dir(output_dir, overwrite)
    if out_path is not None and recover_previous(out_path):
        out_path = check_output_dir(output_dir, overwrite)  # the restored output is there again
    return None if out_path is None else WorkDir.claim(out_path)


def _sessions(model: Any, recipe: Any, fuse_stages: bool) -> tuple[Recipe, list[Session]]:
    from llmc_fsm.oneshot import GENERATED, generated_recipe
    from llmc_fsm.recipe import Recipe, resolve_recipe
    from llmc_fsm.recipe_history import merge_saved_recipe, without_training_stages
    from llmc_fsm.session import Session

    recipe = generated_recipe() if recipe is None else resolve_recipe(recipe)
    recipe = without_training_stages(recipe)
    merged = merge_saved_recipe(recipe, model, generated=recipe.source == GENERATED)
    fresh = [stage for stage in merged.stages if not stage.applied]
    if not fresh:
        msg = (
            "the recipe has no modifier to run: every stage is already applied"
            + (f" to {model} (see its recipe.yaml)" if isinstance(model, str | os.PathLike) else "")
            + "; give a recipe with a new stage name"
        )
        raise ValueError(msg)
    if fuse_stages or len(fresh) == 1:
        return merged, [Session(merged)]
    return merged, [Session(Recipe([stage], merged.source)) for stage in fresh]


def _fingerprint(run: Run, fuse_stages: bool) -> dict[str, Any]:
    from llmc_fsm.resume import fingerprint

    with run.timed("fingerprint"):
        return fingerprint(
            model=run.model,
            recipe=run.recipe,
            modifiers=[m for s in run.sessions for m in s.modifiers],
            dataset=run.dataset,
            text=run.cal_text,
            num_samples=run.num_samples,
            seq_len=run.seq_len,
            batch_size=run.batch_size,
            fuse_stages=fuse_stages,
            seed=run.seed,
            dtype=run.dtype,
        )


# --------------------------------------------------------------------------- load
def load(run: Run) -> None:
    """The model and tokenizer (an ``nn.Module`` is used as it is).

    Raises:
        ValueError: text must be tokenized but there is no tokenizer; from :func:`llmc_fsm.models.load_model`.
        RuntimeError / OSError: from :func:`llmc_fsm.models.load_model`.
    """
    from torch import nn

    needs_text = run.cal_text is not None or run.ev_text is not None or (run.dataset is None and run.needs_data)
    with run.timed("load"):
        if isinstance(run.tokenizer, str | os.PathLike):  # a tokenizer directory or Hub id, as llm-compressor takes
            from transformers import AutoTokenizer

            run.tokenizer = AutoTokenizer.from_pretrained(os.fspath(run.tokenizer))
        if isinstance(run.model, nn.Module):
            run.model_name = type(run.model).__name__
            if any(p.is_meta for p in run.model.parameters()):
                msg = (
                    "the model's parameters are on the meta device (a low_memory run returns its model so): give "
                    "the directory its output was written to as the model instead (model=DIR, --model DIR)"
                )
                raise ValueError(msg)
            if run.tokenizer is None and needs_text:
                msg = (
                    "an in-memory model needs tokenizer= to tokenize text (or pass dataset as a LongTensor of "
                    "token ids)"
                )
                raise ValueError(msg)
            run.disk_before = sum(p.numel() * p.element_size() for p in run.model.parameters())
            return
        from llmc_fsm.models import load_model

        run.model_name = os.fspath(run.model)
        dtype = "auto" if run.dtype == "auto" else torch_dtype_of(run.dtype)  # auto: from_pretrained's own
        loaded, tokenizer = load_model(run.model, torch_dtype=dtype)
        run.model = loaded
        run.tokenizer = run.tokenizer if run.tokenizer is not None else tokenizer
        if run.tokenizer is None and needs_text:
            msg = (
                f"model {run.model_name!r} has no tokenizer files, so text (--dataset, --eval-text or the default "
                "generated calibration) cannot be tokenized; add the tokenizer files or pass dataset as a LongTensor "
                "of token ids"
            )
            raise ValueError(msg)
        run.disk_before = weights_disk_bytes(Path(run.model_name), loaded)


# --------------------------------------------------------------------------- data
def data(run: Run) -> None:
    """Token windows, the required-state check, perplexity before, generated calibration data."""

    used = [run.eval_len] if run.ev_text is not None else []
    if run.needs_data:  # a data-free recipe tokenizes no calibration text
        used.append(int(run.dataset.shape[1]) if is_tensor(run.dataset) else run.seq_len)
    if used:
        check_seq_len(run.model, max(used))
    with run.timed("data"):
        calibration_windows(run)
        if run.ev_text is not None:
            run.eval_windows = eval_windows(run.tokenizer, run.ev_text, run.eval_windows_n, run.eval_len)
    check_modifiers(run.sessions, run.model, run.windows if run.windows is not None else True)
    _evaluate_before(run)
    if run.windows is None:
        from llmc_fsm.oneshot_data import generate_calibration

        with run.timed("generate_calibration"):
            run.windows = generate_calibration(
                run.model, run.tokenizer, num_samples=run.num_samples, seq_len=run.seq_len, seed=run.seed
            )
        run.cal_source = f"generated by the model (seed {run.seed}, {len(DEFAULT_PROMPTS)} prompts)"
    if run.work is not None and run.windows.shape[0] > 0:
        from llmc_fsm.resume import save_windows

        save_windows(run.work.path, run.windows)


def _evaluate_before(run: Run) -> None:
    """Perplexity before compression; a resumed run reuses the value its first run measured on the same windows."""
    from llmc_fsm.resume import load_eval_before, save_eval_before

    if run.eval_windows is None:
        return
    saved = load_eval_before(run.work.path, run.eval_windows) if run.work is not None and run.work.resumed else None
    if saved is not None:
        run.ppl["eval_before"] = saved
        return
    evaluate(run, "eval_before")
    if run.work is not None:
        save_eval_before(run.work.path, run.eval_windows, run.ppl["eval_before"])


# --------------------------------------------------------------------------- compress
def compress(run: Run) -> None:
    """Each session: initialize, calibrate and compress layer by layer (or data-free), finalize."""
    from llmc_fsm.distributed import shard
    from llmc_fsm.pipeline import run_sequential
    from llmc_fsm.resume import layer_progress

    with run.timed("compress"):
        windows, run.per_rank = shard(run.windows)  # this rank's share under torch.distributed
        for index, session in enumerate(run.sessions):
            session.initialize(model=run.model, calibration_data=run.windows)
            run.targeted.extend(n for m in session.modifiers for n in m.resolved_targets if n not in run.targeted)
            try:
                if calibration_inputs(session, windows).shape[0] > 0:
                    run_sequential(
                        session,
                        model=run.model,
                        calibration_data=windows,
                        batch_size=run.batch_size,
                        progress=run.progress,
                        checkpoint=layer_progress(run.work, index, len(run.sessions), session),
                    )
                else:
                    session.calibration_start()
                    session.calibration_end()
            except BaseException:
                with contextlib.suppress(Exception):
                    session.finalize()
                raise
            session.finalize()


# --------------------------------------------------------------------------- evaluate, save
def evaluate(run: Run, phase: str) -> None:
    """Perplexity on the evaluation windows (nothing without ``eval_text``)."""
    if run.eval_windows is None:
        return
    from llmc_fsm.data import perplexity
    from llmc_fsm.output import quantized_weights_as_compressed

    with run.timed(phase), quantized_weights_as_compressed(run.model):
        run.ppl[phase] = perplexity(run.model, run.eval_windows, progress=run.progress)


def save(run: Run) -> None:
    """Build the report; write model, tokenizer, recipe.yaml and report.json to the output directory."""
    report = run_report(run)
    if run.work is None:
        report.finish(run.t_start)
    else:
        from llmc_fsm.output import write_output

        run.work.staging.mkdir()
        write_output(run.work.staging, run.model, run.tokenizer, run.recipe, report, run.disk_before)
        report.output_dir = str(run.out_path)
        report.finish(run.t_start)
        (run.work.staging / "report.json").write_text(report.to_json() + "\n", encoding="utf-8")
        run.work.publish()
    run.model.llmc_fsm_report = report


def run_report(run: Run, modules: Any = None) -> Any:
    """The :class:`~llmc_fsm.report.OneshotReport` of ``run`` (``modules``: sparsity measured while streaming)."""
    from llmc_fsm.report import build_report

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
            "source": describe(run.eval_source),
            "num_windows": int(run.eval_windows.shape[0]),
            "seq_len": run.eval_len,
        },
        seconds=run.seconds,
        targeted=run.targeted,
        modules=modules,
    )
