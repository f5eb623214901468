"""``llmc-fsm report OUT [--plot FILE.png]``: re-print a saved one-shot report and draw it."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from llmc_fsm.report.build import OneshotReport
from llmc_fsm.report.plot import check_plot_path, plot_report

__all__ = ["add_cli", "read_report"]


def read_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``report.json`` from an output directory of ``llmc-fsm oneshot --output`` (or the file itself).

    Returns:
        The report as a dict (``OneshotReport.to_dict()`` format), checked to
        rebuild into a :class:`~llmc_fsm.report.build.OneshotReport`.

    Raises:
        FileNotFoundError: ``path`` does not exist, or the directory has no ``report.json``.
        ValueError: the file is not UTF-8 JSON, or not a one-shot report: keys missing, or a module's field that
            oneshot cannot have written (``layer`` neither an int >= 0 nor null, ``zeros`` outside ``0..numel``, a
            ``sparsity`` other than ``zeros / numel``, ``bits`` / ``group_size`` not positive ints, a negative
            ``rel_output_error``); the message names the file, the module and the field.
    """
    given = Path(path).expanduser()
    if not given.exists():
        msg = f"{given} does not exist; pass the output directory of `llmc-fsm oneshot --output DIR`"
        raise FileNotFoundError(msg)
    file = given / "report.json" if given.is_dir() else given
    if not file.is_file():
        msg = f"{file} not found: {given} is not an output directory of `llmc-fsm oneshot --output DIR`"
        raise FileNotFoundError(msg)
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        msg = f"{file}: not UTF-8 (byte offset {err.start}); is it a report.json written by llmc-fsm oneshot?"
        raise ValueError(msg) from None
    except json.JSONDecodeError as err:
        msg = f"{file}: invalid JSON ({err.msg} at line {err.lineno}, column {err.colno})"
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
    print(OneshotReport.from_dict(data).format_table())
    if plot_path is not None:
        print(f"plot: {plot_report(data, plot_path)}")
    sys.stdout.flush()
    return 0
