"""Pictures of a one-shot report: per-layer sparsity and, when present, per-layer relative output error.

matplotlib is an optional extra (``pip install 'llmc-fsm[plot]'``) imported only
when a picture is drawn; figures are built with ``matplotlib.figure.Figure``
directly, so no pyplot state or GUI backend is involved.
"""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llmc_fsm.report.build import OneshotReport

__all__ = [
    "QUANT_KEYS",
    "check_plot_path",
    "check_plottable",
    "error_panel_title",
    "outside_layers_line",
    "plot_report",
    "quantization_summary",
]

#: Per-module keys of a report's ``sparsity.modules`` entries that carry quantization results.
QUANT_KEYS = ("bits", "group_size", "rel_output_error")

_INSTALL_HINT = "install it with `pip install 'llmc-fsm[plot]'` (or `pip install 'matplotlib>=3.7'`)"


def _matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        msg = f"drawing a plot needs matplotlib, which is not installed; {_INSTALL_HINT}"
        raise RuntimeError(msg) from None
    return matplotlib, Figure


def check_plot_path(path: str | os.PathLike[str]) -> Path:
    """Check, before any work, that a picture can be written to ``path``.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        RuntimeError: matplotlib is not installed (the message says how to install it).
        ValueError: the suffix is not an image format matplotlib writes (the message lists them).
        FileNotFoundError: the parent directory does not exist.
    """
    _, figure_cls = _matplotlib()
    out = Path(path).expanduser()
    formats = figure_cls().canvas.get_supported_filetypes()
    suffix = out.suffix.lower().lstrip(".")
    if suffix not in formats:
        msg = f"cannot draw {out}: the file name must end in an image format ({', '.join(sorted(formats))})"
        raise ValueError(msg)
    if not out.parent.is_dir():
        msg = f"cannot draw {out}: the directory {out.parent} does not exist"
        raise FileNotFoundError(msg)
    return out


def _suffix(entry: Mapping[str, Any]) -> str:
    """``self_attn.q_proj`` for ``model.layers.3.self_attn.q_proj`` (the part after the layer index); the expert
    matrices of a mixture-of-experts block as one kind, ``mlp.experts.*.gate_proj`` (one legend entry for all the
    experts, not one per expert: found by a README-only newcomer, the legend ran off the figure)."""
    return re.sub(r"\.experts\.\d+\.", ".experts.*.", entry["name"].split(f".{entry['layer']}.", 1)[-1])


def _by_kind(entries: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Entries inside decoder layers grouped by module kind, in order of first appearance."""
    kinds: dict[str, list[Mapping[str, Any]]] = {}
    for e in entries:
        if e.get("layer") is not None:
            kinds.setdefault(_suffix(e), []).append(e)
    return kinds


def _kind_markers(ax: Any, kinds: dict[str, list[Mapping[str, Any]]], colors: dict[str, str], key: str) -> None:
    """One marker per module, in its kind's colour, spread a little around its layer so kinds stay visible."""
    width = 0.6 / max(len(colors), 1)
    for kind, group in kinds.items():
        offset = (list(colors).index(kind) - (len(colors) - 1) / 2) * width
        xs = [e["layer"] + offset for e in group]
        ax.plot(xs, [e[key] for e in group], ".", ms=5, color=colors[kind], label=kind)


def _legend_outside(ax: Any) -> None:
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _names_axis(ax: Any, entries: Sequence[Mapping[str, Any]], key: str) -> None:
    """Fallback without decoder layers: one bar per module."""
    ax.bar(range(len(entries)), [e[key] for e in entries], color="0.6")
    ax.set_xticks(range(len(entries)), [e["name"] for e in entries], rotation=60, ha="right", fontsize=7)
    ax.set_xlabel("module")


def _sparsity_panel(
    ax: Any, report: OneshotReport, entries: Sequence[Mapping[str, Any]], colors: dict[str, str]
) -> None:
    rows = report.layer_sparsity()
    targeted = [e for e in entries if e.get("targeted")]
    if rows:
        ax.bar([i for i, _, _ in rows], [s for _, s, _ in rows], color="0.85", label="layer (all targeted)")
        _kind_markers(ax, _by_kind(targeted), colors, "sparsity")
        ax.set_xlabel("decoder layer")
        ax.locator_params(axis="x", integer=True)
        outside = outside_layers_line([e for e in targeted if e["layer"] is None])
        if outside:
            ax.text(0.01, 0.02, outside, transform=ax.transAxes, fontsize=8)
        _legend_outside(ax)
    else:  # no decoder layers (e.g. an nn.Sequential)
        _names_axis(ax, targeted, "sparsity")
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter("{x:.0%}")
    ax.set_ylabel("sparsity (exact zeros)")
    ax.grid(axis="y", alpha=0.3)
    title = f"{report.model}: sparsity of targeted weights (total {report.total_sparsity:.2%})"
    quantized = quantization_summary(entries)
    if quantized:
        title += f"; {quantized}"
        if report.total_sparsity < 0.05 and not any(e.get("rel_output_error") is not None for e in entries):
            ax.text(
                0.5,
                0.55,
                f"nothing pruned: the model is {quantized}\n(no relative output error was measured)",
                transform=ax.transAxes,
                ha="center",
                va="center",
                fontsize=10,
            )
    ax.set_title(_wrapped(title), fontsize=10)


def outside_layers_line(entries: Sequence[Mapping[str, Any]], width: int = 140) -> str:
    """The sparsity panel's line for targeted ``entries`` outside the decoder layers, at most ``width`` characters
    (the panel's width at its font size): ``outside the layers: lm_head 50.0%``; the modules of one numbered stack
    as one item, ``model.vision_tower.encoder.layers.* (24 modules) 0.0%`` (zeros over weights), and the items
    that do not fit as ``and N more``. ``""`` without entries. A LLaVA report listed its 26 vision modules one by
    one: the line ran off the picture, and matplotlib's layout gave up and cut the legend off (found by a tester).
    """
    stacks: dict[str, list[Mapping[str, Any]]] = {}
    for e in entries:
        found = re.match(r"(.*?)\.\d+\.", e["name"])
        stacks.setdefault(f"{found.group(1)}.*" if found else e["name"], []).append(e)
    items = []
    for name, group in stacks.items():
        numel = sum(int(e["numel"]) for e in group)
        share = sum(int(e["zeros"]) for e in group) / numel if numel else 0.0
        items.append(f"{name} {share:.1%}" if len(group) == 1 else f"{name} ({len(group)} modules) {share:.1%}")
    if not items:
        return ""
    line = "outside the layers: " + items[0]
    for i, item in enumerate(items[1:], 1):
        rest = len(items) - i - 1
        more = f", and {rest} more" if rest else ""
        if len(f"{line}, {item}{more}") > width:
            return f"{line}, and {len(items) - i} more"
        line += f", {item}"
    return line


def quantization_summary(entries: Sequence[Mapping[str, Any]]) -> str:
    """``"quantized: 8 bits on 14 modules"`` (bits and group sizes of the entries that carry ``bits``, then
    ``asym`` when their labels say so: ``"quantized: 4 bits, group size 64, asym on 14 modules"``; where only some
    have a group size, how many: ``"quantized: 4/8 bits on 28 modules, group size 32 on 12 of them"``), or ``""``."""
    quantized = [e for e in entries if e.get("bits") is not None]
    if not quantized:
        return ""
    bits = "/".join(sorted({str(e["bits"]) for e in quantized}))
    grouped = [e for e in quantized if e.get("group_size") is not None]
    groups = "/".join(sorted({str(e["group_size"]) for e in grouped}))
    if grouped and len(grouped) < len(quantized):  # a mixed recipe: say which have a group size (found by a tester)
        return (
            f"quantized: {bits} bits{_asym(quantized)} on {len(quantized)} modules, group size {groups} on "
            f"{len(grouped)} of them"
        )
    group = f", group size {groups}" if grouped else ""
    return f"quantized: {bits} bits{group}{_asym(quantized)} on {len(quantized)} modules"


def _asym(quantized: Sequence[Mapping[str, Any]]) -> str:
    """``", asym"`` when the quantized entries' labels (their ``quantized``, the report's column: ``int4/g64 asym``)
    say every one's weights have a zero point, ``", k asym"`` when k of them do, else ``""``: the titles said "4
    bits, group size 64" of an AWQ W4A16_ASYM output that the table calls ``int4/g64 asym`` (found by a tester). The
    label's activation part (from `` a:``) is not read: the bits and group sizes are the weights'."""
    asym = sum("asym" in str(e.get("quantized") or "").split(" a:")[0].split() for e in quantized)
    if not asym:
        return ""
    return ", asym" if asym == len(quantized) else f", {asym} asym"


def _wrapped(title: str, width: int = 100) -> str:
    """``title`` broken into lines of at most ``width`` characters (a line of the 11-inch figure holds ~130)."""
    return textwrap.fill(title, width=width, break_long_words=False, break_on_hyphens=False)


def _error_panel(ax: Any, entries: Sequence[Mapping[str, Any]], colors: dict[str, str]) -> None:
    quant = [e for e in entries if e.get("rel_output_error") is not None]
    kinds = _by_kind(quant)
    if kinds:
        by_layer: dict[int, list[float]] = {}
        for group in kinds.values():
            for e in group:
                size = float(e.get("numel") or 1)
                total = by_layer.setdefault(e["layer"], [0.0, 0.0])
                total[0] += size * float(e["rel_output_error"])
                total[1] += size
        layers = sorted(by_layer)
        ax.plot(layers, [by_layer[i][0] / by_layer[i][1] for i in layers], "-", color="0.3", label="layer mean")
        _kind_markers(ax, kinds, colors, "rel_output_error")
        ax.set_xlabel("decoder layer")
        ax.locator_params(axis="x", integer=True)
        _legend_outside(ax)
    else:
        _names_axis(ax, quant, "rel_output_error")
    ax.set_ylabel("relative output error")
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(_wrapped(error_panel_title(quant)), fontsize=10)


def error_panel_title(entries: Sequence[Mapping[str, Any]]) -> str:
    """The error panel's title: what made the error (pruning, quantization or both) and the bits / group sizes
    (and ``asym``, as :func:`quantization_summary`)."""
    quant = [e for e in entries if e.get("rel_output_error") is not None]
    quantized = [e for e in quant if e.get("bits") is not None]
    settings = []
    for key in ("bits", "group_size"):
        having = [e for e in quant if e.get(key) is not None]
        values = sorted({str(e[key]) for e in having})
        if values:  # a group size only some of the quantized modules have: on how many (a mixed recipe)
            partial = key == "group_size" and len(having) < len(quantized)
            some = f" on {len(having)} of {len(quantized)}" if partial else ""
            settings.append(f"{key} {'/'.join(values)}{some}")
    detail = f" ({', '.join(settings)}{_asym(quantized)})" if settings else ""
    what = "pruning" if not quantized else "quantization"
    numel = sum(int(e.get("numel") or 0) for e in quantized)
    if any(len(e.get("rel_output_errors") or ()) > 1 for e in quant):  # several modifiers: the last one's error
        what = "the last step (quantization, after pruning)" if quantized else "the last pruning step"
        return (
            f"{what}: relative output error ||W X - Ŵ X|| / ||W X|| per module against the weights it received"
            f"{detail}; line: mean weighted by size"
        )
    if numel and sum(int(e.get("zeros") or 0) for e in quantized) / numel >= 0.05:  # pruned (a dense model has a few)
        what = "pruning + quantization"
    return f"{what}: relative output error ||W X - Ŵ X|| / ||W X|| per module{detail}; line: mean weighted by size"


def check_plottable(data: Mapping[str, Any]) -> None:
    """Refuse a report (a ``report.json`` dict) with nothing to draw: no targeted module (a run that calibrated only
    the KV cache's scales, say), whose weights the plot's panels show per layer. ``llmc-fsm report --plot`` calls it
    before printing the report: it printed the report and then failed "nothing to plot" (found by a tester).

    Raises:
        ValueError: naming what the run did instead, and that the report prints without ``--plot``.
        KeyError / TypeError: ``data`` is not a report dict.
    """
    if any(e.get("targeted") for e in data["sparsity"]["modules"]):
        return
    kv = " (it calibrated only the KV cache's scales)" if data.get("kv_cache") else ""
    msg = (
        f"nothing to plot: the run targeted no weight{kv}, and the plot draws the targeted weights' sparsity and "
        "output error per decoder layer; print the report without --plot"
    )
    raise ValueError(msg)


def plot_report(data: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Draw the per-layer sparsity of a one-shot report, and its relative output error when it has one.

    Args:
        data: the report as a dict (``OneshotReport.to_dict()``, i.e. a loaded
            ``report.json``).  Panel 1: sparsity of the targeted weights per
            decoder layer (bars) and per module kind (markers).  Panel 2, only
            when some entry of ``data["sparsity"]["modules"]`` has
            ``rel_output_error`` (with optional ``bits`` / ``group_size``): that
            error per module and its weight-count-weighted mean per layer, of the
            modules whose errors the table's column shows
            (:meth:`~llmc_fsm.report.build.OneshotReport.shown_errors`: in a layer
            with quantized modules, only theirs).
        path: the image file; the format follows its suffix (``.png``, ``.pdf``, ``.svg``, ...).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        RuntimeError: matplotlib is not installed.
        ValueError: unknown image suffix, or no targeted module to draw (:func:`check_plottable`).
        FileNotFoundError: the parent directory of ``path`` does not exist.
        KeyError / TypeError: ``data`` is not a report dict.
    """
    out = check_plot_path(path)
    _, figure_cls = _matplotlib()
    report = OneshotReport.from_dict(dict(data))
    entries = data["sparsity"]["modules"]
    check_plottable(data)
    shown = report.shown_errors()  # the errors the table's column shows, per layer
    errors = [e for e in entries if e["name"] in shown and e.get("rel_output_error") is not None]
    has_error = bool(errors)
    fig = figure_cls(figsize=(11, 7.5 if has_error else 4.2), layout="constrained")
    axes = fig.subplots(2 if has_error else 1, 1, squeeze=False, sharex=True)[:, 0]
    kinds = _by_kind([e for e in entries if e.get("targeted") or e.get("rel_output_error") is not None])
    colors = {kind: f"C{i % 10}" for i, kind in enumerate(kinds)}  # one colour per module kind in both panels
    _sparsity_panel(axes[0], report, entries, colors)
    if has_error:
        _error_panel(axes[1], errors, colors)
        axes[0].tick_params(labelbottom=True)  # sharex hides the upper panel's layer numbers
    fig.savefig(out, dpi=120)
    return out
