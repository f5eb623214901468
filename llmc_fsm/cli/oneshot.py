"""``llmc-fsm oneshot``: compress a model in one shot and print the report (see :func:`llmc_fsm.oneshot`).

The command never uses the compressed model in memory, so a job, data-free (RTN and the other data-free schemes) or
calibrated (SparseGPT, GPTQ, ...), takes the streamed path (``low_memory``: one decoder layer read, compressed and
written at a time; same output tensors, shards of one layer each) whenever the job allows it, and says so in one line
on stderr (:func:`llmc_fsm.oneshot_job.streaming.stream_by_default`); a calibrated job keeps per-layer progress for
``--resume`` on either path (the same files); ``--in-memory`` loads the whole model for any job.

The flags are generated from the fields of :class:`~llmc_fsm.oneshot_job.settings.OneshotSettings` and
:class:`~llmc_fsm.oneshot_job.settings.RecipeFlags` (their metadata: flag, help, type), and the parsed flags
become one :class:`~llmc_fsm.oneshot_job.settings.OneshotSettings`
(:func:`~llmc_fsm.oneshot_job.settings.settings_from_flags`), checked before any model work.

SIGTERM (a CI cancel, ``timeout``, a scheduler) is handled like Ctrl-C: the run
unwinds, the partial output is removed (saved layers are kept for ``--resume``),
one line says so, and the exit status is 143 (130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any

from llmc_fsm.oneshot_job.api import run_oneshot
from llmc_fsm.oneshot_job.settings import (
    DEFAULT_MODEL,
    FlagConflictError,
    OneshotSettings,
    RecipeFlags,
    add_flags,
    settings_from_flags,
)
from llmc_fsm.toolkit.distributed import interrupt_line_to_print, is_main_process, note_interrupt


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that the run unwinds exactly like Ctrl-C."""


def interrupted(command: str, exc: KeyboardInterrupt) -> int:
    """Print ``llmc-fsm COMMAND: interrupted (Ctrl-C | SIGTERM); <what was kept, or nothing written>`` and return the
    exit status (130, or 143 for SIGTERM), for a command run under :func:`signals_as_interrupt`. Under torchrun an
    interrupt that reached rank 0 too (Ctrl-C reaches every rank) is said once, by rank 0 (the one that writes: rank 1
    said "nothing written" beside rank 0's "progress kept", found by a tester); one that reached only another rank
    (a scheduler's or the OOM killer's SIGTERM) is said by that rank, prefixed ``rank N: `` (it said nothing, and
    rank 0 blamed "another rank (see its error)", found by a tester), after waiting up to
    :data:`~llmc_fsm.toolkit.distributed.ERROR_WAIT_S` seconds for rank 0's note
    (:func:`~llmc_fsm.toolkit.distributed.interrupt_line_to_print`)."""
    what = "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"
    notes = getattr(exc, "__notes__", None)
    kept = notes[-1] if notes else "nothing written"
    line = interrupt_line_to_print(f"llmc-fsm {command}: interrupted ({what}); {kept}")
    if line is not None:
        print(line, file=sys.stderr)
    return 143 if isinstance(exc, Terminated) else 130


@contextlib.contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """Inside the block, SIGTERM raises :class:`Terminated` and Ctrl-C (SIGINT) ``KeyboardInterrupt``, once: the
    first of them swallows both from then on, until the process ends, so that a second Ctrl-C or SIGTERM cannot cut
    the clean-up (the progress kept, the line that says so) or print a traceback at exit (a breaker's double
    Ctrl-C 0-10 ms apart left progress behind a "nothing written" line, or a traceback from an atexit callback).
    Without an interrupt, the previous handlers are restored.

    The later signals go to a Python handler that does nothing, not to ``SIG_IGN``: a signal already received but
    not yet handled when its handler became ``SIG_IGN`` makes CPython raise ``OSError: Signal 15 ignored due to race
    condition`` (torchrun sends SIGINT then SIGTERM at once: that traceback stood beside the "progress kept" line,
    found by a tester)."""

    interrupted: list[int] = []

    def swallow(signum: int, frame: Any) -> None:
        """A signal after the first: nothing to do (the run is already unwinding)."""

    def handler(signum: int, frame: Any) -> None:
        interrupted.append(signum)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, swallow)
        note_interrupt()  # rank 0 under torchrun: at once, so that the others know before its clean-up is done
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

    try:
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        if not interrupted:  # no interrupt: as before the block
            for sig, before in previous.items():
                signal.signal(sig, before)


def add_cli(sub: Any) -> None:
    """Add the ``oneshot`` subcommand to the ``llmc-fsm`` parser: one flag per field of
    :class:`~llmc_fsm.oneshot_job.settings.OneshotSettings` that has one, the recipe flags
    (:class:`~llmc_fsm.oneshot_job.settings.RecipeFlags`) right after ``--recipe``."""
    p = sub.add_parser(
        "oneshot",
        help="compress a model in one shot and report sparsity and perplexity",
        description=(
            "Compress a model in one shot, calibrating one decoder layer at a time. With no flags: "
            f"{DEFAULT_MODEL} (SmolLM2-135M-Instruct), SparseGPT 50% unstructured on every Linear except lm_head, "
            "calibration text generated by the model itself."
        ),
    )
    add_flags(p, OneshotSettings, after={"recipe": lambda parser: add_flags(parser, RecipeFlags)})
    p.add_argument(
        "--in-memory",
        action="store_true",
        help="load the whole model in memory; by default a job, data-free or calibrated, streams one decoder layer "
        "at a time when it can (as --low-memory, which instead refuses a job that cannot stream), keeping each "
        "finished layer of a calibrated job for --resume either way",
    )
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    if args.in_memory and args.low_memory:  # a usage error: one line, exit status 2, as argparse's own
        msg = "--in-memory and --low-memory contradict each other: pass one of them (or neither: stream when possible)"
        args._commands[args.command].error(msg)
    try:
        settings = settings_from_flags(args)  # every check that needs no model, the generated recipe built
    except FlagConflictError as exc:  # flags that do not go together: a usage error, as argparse's own
        args._commands[args.command].error(str(exc))
    try:
        with signals_as_interrupt():
            model = run_oneshot(settings, stream_when_possible=not args.in_memory)
    except KeyboardInterrupt as exc:
        return interrupted("oneshot", exc)
    except OSError as exc:
        notes = getattr(exc, "__notes__", None)
        if not notes or getattr(args, "verbose", False):
            raise
        print(f"llmc-fsm oneshot: error: {exc}; {notes[-1]}", file=sys.stderr)
        return 1
    if is_main_process():  # under torchrun: the report once, from rank 0
        print(model.llmc_fsm_report.format_table())
        sys.stdout.flush()
    return 0
