"""``llmc-fsm report OUT [--plot FILE.png]``: re-print a saved one-shot report and draw it."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from llmc_fsm.output.workdir import progress_summary, work_dir_path
from llmc_fsm.report.build import OneshotReport
from llmc_fsm.report.plot import check_plot_path, check_plottable, plot_report

__all__ = ["add_cli", "read_report"]


def read_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``report.json`` from an output directory of ``llmc-fsm oneshot --output`` (or the file itself).

    Returns:
        The report as a dict (``OneshotReport.to_dict()`` format), checked to
        rebuild into a :class:`~llmc_fsm.report.build.OneshotReport`.

    Raises:
        FileNotFoundError: ``path`` does not exist (when a run writing it was interrupted, the message says how far
            it got and the command that finishes it), or the directory has no ``report.json``.
        ValueError: the file is not UTF-8 JSON (one not named ``report.json``: "neither an output directory ... nor
            its report.json"), or not a one-shot report: keys missing, or a module's field that
            oneshot cannot have written (``layer`` neither an int >= 0 nor null, ``zeros`` outside ``0..numel``, a
            ``sparsity`` other than ``zeros / numel``, ``bits`` / ``group_size`` not positive ints, a negative
            ``rel_output_error``); the message names the file, the module and the field.
    """
    given = Path(path).expanduser()
    if not given.exists():
        interrupted = _interrupted_run(given)
        msg = interrupted or f"{given} does not exist; pass the output directory of `llmc-fsm oneshot --output DIR`"
        raise FileNotFoundError(msg)
    file = given / "report.json" if given.is_dir() else given
    if not file.is_file():
        msg = f"{file} not found: {given} is not an output directory of `llmc-fsm oneshot --output DIR`"
        raise FileNotFoundError(msg)
    named = file.name == "report.json"  # another file (a text file) is no report at all: said so (found by a tester)
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        if not named:
            raise ValueError(_not_a_report(file, f"not UTF-8: byte offset {err.start}")) from None
        msg = f"{file}: not UTF-8 (byte offset {err.start}); is it a report.json written by llmc-fsm oneshot?"
        raise ValueError(msg) from None
    except json.JSONDecodeError as err:
        where = f"{err.msg} at line {err.lineno}, column {err.colno}"
        msg = f"{file}: invalid JSON ({where})" if named else _not_a_report(file, f"not JSON: {where}")
        raise ValueError(msg) from None
    try:
        detail = _module_problem(data["sparsity"]["modules"])
        if detail is None:
            OneshotReport.from_dict(data).format_table()
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        detail = f"missing {err}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
    if detail is not None:
        msg = f"{file}: not a one-shot report written by llmc-fsm oneshot ({detail})"
        raise ValueError(msg)
    return data


def _not_a_report(file: Path, what: str) -> str:
    """The refusal of a file not named ``report.json`` that is not JSON (``what``: why)."""
    return (
        f"{file} is neither an output directory of `llmc-fsm oneshot --output DIR` nor its report.json ({what}); "
        "pass that directory"
    )


def _interrupted_run(output: Path) -> str | None:
    """What to say of an output directory that does not exist while its work directory (``.NAME.work`` beside it,
    :func:`~llmc_fsm.output.workdir.work_dir_path`) does: the run that writes it was interrupted (or still runs),
    how far it got (:func:`~llmc_fsm.output.workdir.progress_summary`) and the command that finishes it (its
    ``owner.json``'s, with ``--resume``); ``None`` when there is no work directory. It said only "OUT does not
    exist" (found by a tester)."""
    work = work_dir_path(output)
    if not work.is_dir():
        return None
    summary = progress_summary(work / "progress") or "no decoder layer saved yet"
    try:
        owner = json.loads((work / "owner.json").read_text(encoding="utf-8"))
        command, cwd = owner["command"], owner.get("cwd")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        command, cwd = None, None
    how = "the same command with --resume (resume=True)"
    cli = isinstance(command, list) and all(isinstance(c, str) for c in command) and command[1:2] == ["oneshot"]
    if cli and Path(command[0]).name == "llmc-fsm":  # the command line that started it (a script: as it was run)
        how = f"`{shlex.join(['llmc-fsm', *command[1:], *(['--resume'] if '--resume' not in command else [])])}`"
        if isinstance(cwd, str) and cwd != os.getcwd():  # its relative paths are the started one's (a tester's case)
            how += f" run from {cwd!r}"
    return (
        f"{output} does not exist yet: the run writing it was interrupted (or is still running), its progress kept "
        f"in {str(work)!r} ({summary}); finish it with {how}, then run `llmc-fsm report {output}` again"
    )


def _module_problem(entries: list[dict[str, Any]]) -> str | None:
    """The first field of ``sparsity.modules`` that oneshot cannot have written, as ``sparsity.modules[i] 'name':
    what`` (``None`` when every one can be): a hand-edited ``layer: "x"`` was printed as a row "x" and made
    ``--plot`` fail with a TypeError, ``zeros`` above ``numel`` printed a sparsity of 200% (found by a tester)."""
    for i, entry in enumerate(entries):
        problem = _entry_problem(entry)
        if problem is not None:
            return f"sparsity.modules[{i}] {entry.get('name')!r}: {problem}"
    return None


def _entry_problem(entry: dict[str, Any]) -> str | None:
    """What is wrong with one ``sparsity.modules`` entry, or ``None``."""

    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    name, layer, zeros, numel = entry["name"], entry["layer"], entry["zeros"], entry["numel"]
    if not isinstance(name, str):
        return f"name {name!r} is not a module name (a string)"
    if layer is not None and not count(layer):
        return f"layer {layer!r} is neither a decoder layer index (an int >= 0) nor null"
    if not (count(zeros) and count(numel) and zeros <= numel):
        return f"zeros {zeros!r} and numel {numel!r} are not ints with 0 <= zeros <= numel"
    sparsity = entry.get("sparsity", zeros / numel if numel else 0.0)
    if not number(sparsity) or not math.isclose(sparsity, zeros / numel if numel else 0.0, abs_tol=1e-12):
        return f"sparsity {sparsity!r} is not zeros / numel"
    for key in ("bits", "group_size"):
        value = entry.get(key)
        if value is not None and not (count(value) and value > 0):
            return f"{key} {value!r} is neither a positive int nor null"
    error = entry.get("rel_output_error")
    if error is not None and (not number(error) or not math.isfinite(error) or error < 0):  # NaN passed < 0
        return f"rel_output_error {error!r} is neither a finite number >= 0 nor null"
    return None


_HELP = "re-print a saved one-shot report (OUT/report.json); --plot draws per-layer sparsity"
_DESCRIPTION = (
    "Re-print the report of an `llmc-fsm oneshot --output OUT` run from OUT/report.json. With --plot, also "
    "draw the sparsity of the targeted weights per decoder layer (and the per-layer quantization error "
    "when the report has one) with matplotlib (pip install 'llmc-fsm[plot]')."
)


def add_cli(sub: Any) -> None:
    """Add the ``report`` subcommand to the ``llmc-fsm`` parser."""
    p = sub.add_parser("report", help=_HELP, description=_DESCRIPTION)
    p.add_argument("output", metavar="OUT", help="output directory of `llmc-fsm oneshot --output` (or its report.json)")
    p.add_argument(
        "--plot", metavar="FILE.png", help="write the picture to this file (format from the suffix: png, pdf, svg, ...)"
    )
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    plot_path = None
    if args.plot is not None:  # fail before printing anything when the picture cannot be drawn
        plot_path = check_plot_path(args.plot)
    data = read_report(args.output)
    if plot_path is not None:  # a report with nothing to draw: refused before printing too
        check_plottable(data)
    print(OneshotReport.from_dict(data).format_table())
    work = work_dir_path(Path(args.output).expanduser())
    if Path(args.output).expanduser().is_dir() and work.is_dir():  # a re-run into it (--overwrite) was interrupted
        summary = progress_summary(work / "progress") or "no decoder layer saved yet"
        print(
            f"note: this is the report of the finished run in {args.output}; a later run writing it was interrupted "
            f"(or is still running), its progress kept in {str(work)!r} ({summary})",
            file=sys.stderr,
        )
    if plot_path is not None:
        print(f"plot: {plot_report(data, plot_path)}")
    sys.stdout.flush()
    return 0
