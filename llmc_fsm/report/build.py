"""The one-shot report: measured sparsity per layer, perplexity before/after, wall time, memory.

Sparsity is *measured* on the weights after compression (exact zeros), not
taken from what the modifiers intended.
"""

from __future__ import annotations

import json
import re
import resource
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from llmc_fsm.models.layers import find_decoder_layers
from llmc_fsm.toolkit.masks import fewest_zeros, follows_structure
from llmc_fsm.toolkit.packed import scheme_label
from llmc_fsm.toolkit.targets import compact_names
from llmc_fsm.toolkit.views import weight_views

__all__ = ["ModuleSparsity", "OneshotReport", "build_report", "max_rss_bytes", "measure_sparsity"]


def max_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


@attrs.define(kw_only=True)
class ModuleSparsity:
    """Zeros of one module's weight, and how it was quantized.

    ``layer`` is the decoder layer index, or ``None`` outside the layers. For
    quantized modules ``bits`` and ``group_size`` (``None`` for channel/tensor
    strategies) are set; ``rel_output_error`` is ``||W X - W_hat X|| / ||W X||``
    on the calibration inputs, for modifiers that keep a Hessian (SparseGPT,
    GPTQ, RTN with calibration data), else ``None``: the last modifier's that
    compressed it, with ``W`` the weight it received. ``rel_output_errors``
    lists ``("Modifier (stage)", error or None)`` of every modifier that
    compressed it, in the order they ran, when there were several (2:4 pruning,
    then GPTQ); the errors do not add up. ``routed_tokens``: for one expert's matrix of fused
    mixture-of-experts weights, the calibration tokens the router sent to that expert (``None`` otherwise);
    ``all_tokens``: the modifier that counted them had ``calibrate_all_experts`` set, so the matrix was calibrated
    on every calibration token whatever the router chose (``report.json``: ``calibrate_all_experts: true``).
    ``dampening_frac``: the Hessian damping a GPTQ/SparseGPT modifier used for the module where it is not the
    configured one (its Hessian was not positive definite with that, so it retried with 10x more; ``None``
    otherwise).
    ``fewest_zeros``: :func:`~llmc_fsm.toolkit.masks.fewest_zeros` of the weight when it was measured (the N:M
    structures its zeros follow; empty below 5% zeros); not written to ``report.json``. ``quantized``: the label of a
    quantized module's scheme (:func:`~llmc_fsm.toolkit.packed.scheme_label`: ``int4/g64``, ``fp8 a:fp8``), the
    report's ``quantized`` column. ``pruned``: a pruning modifier of this run (or of the earlier run whose report an
    in-memory model carries) changed the weight: its zeros are pruned ones (``sparsity_config.global_sparsity``,
    :func:`llmc_fsm.output.save.model_sparsity`); not written to ``report.json``.
    """

    name: str
    layer: int | None
    zeros: int
    numel: int
    bits: int | None = None
    group_size: int | None = None
    quantized: str | None = None
    rel_output_error: float | None = None
    rel_output_errors: list[tuple[str, float | None]] = attrs.Factory(list)
    routed_tokens: int | None = None
    all_tokens: bool = False
    dampening_frac: float | None = None
    fewest_zeros: dict[int, int] = attrs.Factory(dict)
    pruned: bool = False

    @property
    def sparsity(self) -> float:
        return self.zeros / self.numel if self.numel else 0.0

    def follows(self, structure: str) -> bool:
        """Whether the weight, as measured, follows ``structure`` (``"N:M"``; :func:`follows_structure`)."""
        return follows_structure(self.fewest_zeros, structure)


def measure_sparsity(model: nn.Module, layers: nn.ModuleList | None = None) -> list[ModuleSparsity]:
    """The exact zeros of every ``nn.Linear`` weight of ``model`` (tied weights counted once), in module order.

    Weights seen through a :class:`~llmc_fsm.toolkit.views.LinearView` count too: each expert matrix of fused
    mixture-of-experts weights (``<experts>.<e>.gate_proj`` ...) and each ``Conv1D`` (under its own name); and a
    quantized ``nn.Embedding`` (one that carries a compressed-tensors ``quantization_scheme``).
    ``layers``: the decoder layers, to record each module's layer index (``None`` outside them).
    """
    layer_of: dict[int, int] = {}
    if layers is not None:
        for index, layer in enumerate(layers):
            for sub in layer.modules():
                layer_of[id(sub)] = index
    seen: set[int] = set()
    out = []
    for name, module in model.named_modules():
        for suffix, view in weight_views(module).items():  # fused experts, Conv1D
            w = view.weight
            full = f"{name}.{suffix}" if suffix and name else (suffix or name)
            zeros = w.numel() - int(torch.count_nonzero(w))
            out.append(
                ModuleSparsity(
                    name=full, layer=layer_of.get(id(module)), zeros=zeros, numel=w.numel(),
                    fewest_zeros=fewest_zeros(w, zeros),
                )
            )  # fmt: skip
        quantized_embedding = isinstance(module, nn.Embedding) and hasattr(module, "quantization_scheme")
        if not (isinstance(module, nn.Linear) or quantized_embedding) or id(module.weight) in seen:
            continue
        seen.add(id(module.weight))
        w = module.weight
        zeros = w.numel() - int(torch.count_nonzero(w))  # no [numel] temporary, unlike (w == 0).sum()
        out.append(
            ModuleSparsity(
                name=name, layer=layer_of.get(id(module)), zeros=zeros, numel=w.numel(),
                fewest_zeros=fewest_zeros(w, zeros),
            )
        )  # fmt: skip
    return out


@attrs.define(kw_only=True)
class OneshotReport:
    """What :func:`llmc_fsm.oneshot` did; ``to_dict()`` is what ``report.json`` holds.

    Attributes:
        model: model name or path (or the class name for an in-memory model).
        recipe: the recipe as a dict (stages marked applied).
        calibration: ``{"source", "num_samples", "seq_len", "num_tokens"}``, and ``"per_rank"``
            (windows calibrated by each rank) under ``torch.distributed``.
        modules: measured sparsity of every Linear weight.
        ppl_before / ppl_after: perplexity on the evaluation windows (``None`` without eval text).
        eval: ``{"source", "num_windows", "seq_len"}`` or ``None``.
        seconds: wall time per phase (``load``, ``data``, ``eval_before``, ``compress``, ``eval_after``,
            ``save``, ``total``).
        max_rss_bytes: peak resident memory of the process at the end.
        output_dir: where the model was written, or ``None``.
    """

    model: str
    recipe: dict[str, Any]
    calibration: dict[str, Any]
    modules: list[ModuleSparsity]
    ppl_before: float | None = None
    ppl_after: float | None = None
    eval: dict[str, Any] | None = None
    seconds: dict[str, float] = attrs.field(factory=dict)
    max_rss_bytes: int = 0
    output_dir: str | None = None
    targeted: list[str] = attrs.field(factory=list)
    disk: dict[str, int | None] | None = None
    #: modifier label -> smooth layer -> what a smoothing modifier (SmoothQuant, AWQ) folded there (its
    #: ``smoothing_results``: scale statistics; AWQ's chosen exponent and block errors); with AWQ's ``apply_clip``
    #: also ``"<label> clipping"`` -> Linear -> its ``clipping_results``. Empty: none ran.
    smoothing: dict[str, dict[str, dict[str, Any]]] = attrs.field(factory=dict)
    #: where the job computed (:func:`llmc_fsm.oneshot_job.phases.execution_summary`): ``device`` (name, total
    #: memory), ``activations`` (mode ``device`` or ``cpu-offloaded``), peak device memory, per-rank work.
    execution: dict[str, Any] | None = None
    #: modifier label -> attention module -> its calibrated FP8 scales (``k_scale``, ``v_scale``, with attention
    #: quantization ``q_scale``; each a list of floats: one per tensor, one per key/value head per head), from a
    #: quantizing modifier's ``kv_cache_results``. Empty: no KV cache scheme ran.
    kv_cache: dict[str, dict[str, dict[str, list[float]]]] = attrs.field(factory=dict)
    #: modifier label -> decoder layer -> what a tuning modifier (AutoRound) measured there (its ``tuning_results``):
    #: ``rtn_mse`` and ``tuned_mse``, the mean squared error of the layer's output against the float model's with
    #: round-to-nearest and with the tuned rounding, and ``kept`` (``"autoround"`` or ``"rtn"``; with ``iters: 0``
    #: ``"rtn_mode"`` or ``"opt_rtn_mode"`` and both errors ``None``: nothing tuned, nothing measured). Empty: none ran.
    tuning: dict[str, dict[str, dict[str, Any]]] = attrs.field(factory=dict)
    #: modifier label -> mixture-of-experts block -> what an expert-pruning modifier (REAP) did there (its
    #: ``expert_pruning_results``): ``kept`` (the former indices of the experts kept, in their new order), ``scores``
    #: and ``routed_tokens`` (per former expert). Empty: none ran.
    expert_pruning: dict[str, dict[str, dict[str, Any]]] = attrs.field(factory=dict)

    def finish(self, t_start: float) -> None:
        """Set the total wall time (since ``t_start``, a ``time.perf_counter()`` value) and the peak RSS."""
        self.seconds["total"] = time.perf_counter() - t_start
        self.max_rss_bytes = max_rss_bytes()

    # --- aggregates ------------------------------------------------------------
    def _targeted(self) -> list[ModuleSparsity]:
        names = set(self.targeted)
        return [m for m in self.modules if m.name in names]

    @property
    def total_sparsity(self) -> float:
        """Zeros / weights over all targeted modules."""
        mods = self._targeted()
        numel = sum(m.numel for m in mods)
        return sum(m.zeros for m in mods) / numel if numel else 0.0

    def layer_sparsity(self) -> list[tuple[int, float, int]]:
        """``(layer index, sparsity, numel)`` of the targeted Linear weights in each decoder layer."""
        agg: dict[int, list[int]] = {}
        for m in self._targeted():
            if m.layer is not None:
                z, n = agg.setdefault(m.layer, [0, 0])
                agg[m.layer] = [z + m.zeros, n + m.numel]
        return [(i, z / n if n else 0.0, n) for i, (z, n) in sorted(agg.items())]

    def layer_quantization(self) -> dict[int, tuple[str, float | None]]:
        """``{layer index: (bits/group label, relative output error or None)}`` of quantized targeted modules: the
        mean of the modules' errors weighted by their numbers of weights (as ``llmc-fsm report --plot`` draws it).
        The label ends in ``*`` when targeted weights of the layer were left unquantized (:meth:`_unquantized`)."""
        agg: dict[int, list[ModuleSparsity]] = {}
        for m in self._targeted():
            if m.layer is not None:
                agg.setdefault(m.layer, []).append(m)
        return {i: _bits_label(mods) for i, mods in agg.items() if any(m.bits is not None for m in mods)}

    def _unquantized(self) -> list[ModuleSparsity]:
        """Targeted modules left unquantized in decoder layers where other targeted modules were quantized (e.g. a
        Linear no calibration input reached, left as it was; a module one modifier prunes and the quantizer
        ignores)."""
        targeted = self._targeted()
        quantized_layers = {m.layer for m in targeted if m.layer is not None and m.bits is not None}
        return [m for m in targeted if m.layer in quantized_layers and m.bits is None]

    def _unquantized_note(self) -> list[str]:
        """The ``*`` line under the table (:meth:`layer_quantization`)."""
        left = self._unquantized()
        if not left:
            return []
        return [
            f"*: weights of the layer a modifier targeted, left unquantized (not quantized by the recipe, or no "
            f"calibration input reached them): {len(left)} modules, "
            f"{sum(m.numel for m in left):,} weights ({compact_names(m.name for m in left)})"
        ]

    def _rows(self) -> list[list[ModuleSparsity]]:
        """The targeted modules of each row of the table: per decoder layer, then per block outside the layers."""
        layers: dict[int, list[ModuleSparsity]] = {}
        for m in self._targeted():
            if m.layer is not None:
                layers.setdefault(m.layer, []).append(m)
        outside = _outside_blocks([m for m in self._targeted() if m.layer is None])
        return [*(layers[i] for i in sorted(layers)), *outside.values()]

    def shown_errors(self) -> set[str]:
        """The names of the modules whose relative output errors the table's ``rel. output error`` column and
        ``llmc-fsm report --plot``'s error panel show (one definition for both: per row, the measured modules, of the
        quantized ones where some are quantized). Until 2026-12-07 the panel also drew the pruning error of a module
        the quantizer ignored, under a title naming the quantization, its layer mean 0.0857 against the table's
        0.0573 (found by a tester)."""
        return {m.name for mods in self._rows() for m in _shown_errors(mods)}

    def _stacked_errors_note(self) -> list[str]:
        """A line under the table when modules were compressed by several error-measuring modifiers: what the error
        column shows, and the measured modules it leaves out (only pruned, in a layer whose others were quantized)."""
        stacked = [m for m in self._targeted() if len(m.rel_output_errors) > 1]
        if not stacked:
            return []
        shown = self.shown_errors()
        left = [m for m in self._targeted() if m.rel_output_error is not None and m.name not in shown]
        mean = sum(m.rel_output_error or 0.0 for m in left) / len(left) if left else 0.0
        left_out = (
            f"; left out of the column and the plot: {len(left)} modules not quantized "
            f"({compact_names(m.name for m in left)}, mean error {mean:.4f})"
            if left
            else ""
        )
        return [
            f"rel. output error: the last modifier's, against the weights it received, of the quantized modules where "
            f"a row has some (as the plot's error panel); {len(stacked)} modules were compressed by several "
            f"modifiers, whose errors do not add up (mean per module: {_mean_by_modifier(stacked)}; report.json: "
            f"rel_output_errors){left_out}"
        ]

    def _routed_tokens_note(self) -> list[str]:
        """A line on the calibration tokens routed to each expert (fused experts pruned per expert), if any."""
        routed = [m for m in self._targeted() if m.routed_tokens is not None]
        if not routed:
            return []
        counts = [m.routed_tokens for m in routed]
        idle = [m.name for m in routed if m.routed_tokens == 0]
        none = f"; no routed token: {compact_names(idle)}" if idle else "; every expert got tokens"
        every = [m.name for m in routed if m.routed_tokens == 0 and m.all_tokens]
        rounded = [m.name for m in routed if m.routed_tokens == 0 and m.bits is not None and not m.all_tokens]
        kept = [m.name for m in routed if m.routed_tokens == 0 and m.bits is None and not m.all_tokens]
        fates = [
            (every, "calibrated on every token (calibrate_all_experts)"),
            (rounded, "quantized by round-to-nearest (no calibration input)"),  # GPTQ without a Hessian
            (kept, "left as they were (no calibration input)"),  # SparseGPT/Wanda: not pruned (found by a tester)
        ]
        fates = [(names, fate) for names, fate in fates if names]
        if len(fates) == 1:
            none += f", {fates[0][1]}"
        elif fates:
            none += "; " + ", ".join(f"{compact_names(names)} {fate}" for names, fate in fates)
        return [
            f"experts: {len(routed)} expert matrices, {min(counts)}-{max(counts)} routed calibration tokens each"
            f"{none} (report.json: routed_tokens)"
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "recipe": self.recipe,
            "calibration": self.calibration,
            "eval": self.eval,
            "perplexity": {"before": self.ppl_before, "after": self.ppl_after},
            "sparsity": {
                "total_targeted": self.total_sparsity,
                "layers": [{"layer": i, "sparsity": s, "numel": n} for i, s, n in self.layer_sparsity()],
                "modules": [
                    {
                        "name": m.name,
                        "layer": m.layer,
                        "zeros": m.zeros,
                        "numel": m.numel,
                        "sparsity": m.sparsity,
                        "targeted": m.name in set(self.targeted),
                        **_quant_fields(m),
                    }
                    for m in self.modules
                ],
            },
            **({"smoothing": self.smoothing} if self.smoothing else {}),
            **({"execution": self.execution} if self.execution else {}),
            **({"kv_cache": self.kv_cache} if self.kv_cache else {}),
            **({"tuning": self.tuning} if self.tuning else {}),
            **({"expert_pruning": self.expert_pruning} if self.expert_pruning else {}),
            "disk": self.disk,
            "seconds": self.seconds,
            "max_rss_bytes": self.max_rss_bytes,
            "output_dir": self.output_dir,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OneshotReport:
        """The report that :meth:`to_dict` returned ``data`` for (e.g. a loaded ``report.json``).

        Raises:
            KeyError / TypeError: ``data`` lacks ``model`` or ``sparsity.modules``, or they have the wrong shape.
        """
        entries = data["sparsity"]["modules"]
        ppl = data.get("perplexity") or {}
        return cls(
            model=data["model"],
            recipe=data.get("recipe") or {},
            calibration=data.get("calibration") or {},
            modules=[
                ModuleSparsity(
                    name=m["name"],
                    layer=m["layer"],
                    zeros=m["zeros"],
                    numel=m["numel"],
                    bits=m.get("bits"),
                    group_size=m.get("group_size"),
                    quantized=m.get("quantized"),
                    rel_output_error=m.get("rel_output_error"),
                    rel_output_errors=[(e["modifier"], e["rel_output_error"]) for e in m.get("rel_output_errors", [])],
                    routed_tokens=m.get("routed_tokens"),
                    all_tokens=bool(m.get("calibrate_all_experts")),
                    dampening_frac=m.get("dampening_frac"),
                )
                for m in entries
            ],
            disk=data.get("disk"),
            ppl_before=ppl.get("before"),
            ppl_after=ppl.get("after"),
            eval=data.get("eval"),
            seconds=data.get("seconds") or {},
            max_rss_bytes=data.get("max_rss_bytes", 0),
            output_dir=data.get("output_dir"),
            targeted=[m["name"] for m in entries if m.get("targeted")],
            smoothing=data.get("smoothing") or {},
            execution=data.get("execution"),
            kv_cache=data.get("kv_cache") or {},
            tuning=data.get("tuning") or {},
            expert_pruning=data.get("expert_pruning") or {},
        )

    def format_table(self) -> str:
        """The human-readable report the CLI prints."""
        lines = [f"model: {self.model}"]
        cal = self.calibration
        split = cal.get("per_rank")
        if cal.get("num_samples"):
            samples, length, tokens = cal.get("num_samples"), cal.get("seq_len"), cal.get("num_tokens")
            # rows of different lengths (texts, image-caption batches padded to their longest row): the count
            # leaves padding out, while padded positions are calibration rows too (as llm-compressor calibrates them)
            uneven = isinstance(tokens, int) and isinstance(samples, int) and isinstance(length, int)
            uneven = uneven and tokens != samples * length
            lines.append(
                (
                    f"calibration: {samples} samples of up to {length} tokens ({tokens:,} tokens, padding not counted) "
                    if uneven
                    else f"calibration: {samples} x {length} tokens "
                )
                + (f"{source}" if str(source := cal.get("source")).startswith("generated ") else f"from {source}")
                + (f" (split over {len(split)} ranks: {' + '.join(map(str, split))})" if split else "")
            )
        else:
            lines.append(f"calibration: {cal.get('source')}")
        rows = self.layer_sparsity()
        quant = self.layer_quantization()
        outside = [m for m in self._targeted() if m.layer is None]
        bits_columns = bool(quant) or any(m.bits is not None for m in outside)
        blocks = _outside_blocks(outside)
        named = _named_layers(self._targeted()) if any(re.search(r"\.\d+$", b) for b in blocks) else {}
        width = max([7, *(len(name) for name in blocks), *(len(name) for name in named.values())])
        labels = {name: _bits_label(mods) for name, mods in blocks.items()}
        q = max([9, *(len(label) for label, _ in [*quant.values(), *labels.values()])])  # the quantized column
        total_numel = sum(m.numel for m in self._targeted())
        w = max(10, len(f"{total_numel:,}"))  # the weights column, as wide as the total (found by a tester)
        if rows:
            lines.append("")
            extra = f"  {'quantized':>{q}}  {'rel. output error':>16}" if bits_columns else ""
            lines.append(f"{'layer':>{width}}  {'weights':>{w}}  {'sparsity':>8}{extra}")
            for i, s, n in rows:
                label, err = quant.get(i, ("-", None))
                extra = f"  {label:>{q}}  {'-' if err is None else f'{err:.4f}':>16}" if bits_columns else ""
                lines.append(f"{named.get(i, i):>{width}}  {n:>{w},}  {s:>8.2%}{extra}")
        for name, mods in blocks.items():  # lm_head, a quantized embedding, an encoder's layers
            label, err = labels[name]
            numel, zeros = sum(m.numel for m in mods), sum(m.zeros for m in mods)
            extra = f"  {label:>{q}}  {'-' if err is None else f'{err:.4f}':>16}" if bits_columns else ""
            lines.append(f"{name:>{width}}  {numel:>{w},}  {zeros / numel if numel else 0.0:>8.2%}{extra}")
        lines.append(f"{'total':>{width}}  {total_numel:>{w},}  {self.total_sparsity:>8.2%}   (targeted weights)")
        if bits_columns:
            lines.append(
                "(a quantized weight's sparsity counts the zeros it held before quantization; "
                "values that round to zero are not counted)"
            )
        # the notes after the total row, not between the rows and it (found by a tester)
        lines.extend(self._unquantized_note())
        lines.extend(self._stacked_errors_note())
        lines.extend(self._routed_tokens_note())
        lines.extend(_smoothing_line(label, results) for label, results in self.smoothing.items())
        lines.extend(_kv_cache_line(label, scales) for label, scales in self.kv_cache.items())
        lines.extend(_tuning_line(label, results) for label, results in self.tuning.items())
        lines.extend(_expert_pruning_line(label, blocks) for label, blocks in self.expert_pruning.items())
        untouched = [m for m in self.modules if m.name not in set(self.targeted)]
        if len(untouched) > 8:  # e.g. ignored fused experts: one line per expert matrix would flood the table
            numel, zeros = sum(m.numel for m in untouched), sum(m.zeros for m in untouched)
            share = zeros / numel if numel else 0.0
            lines.append(
                f"not targeted: {len(untouched)} modules, {numel:,} weights, sparsity {share:.2%}: "
                + compact_names(m.name for m in untouched)
            )
        for m in untouched if len(untouched) <= 8 else []:
            lines.append(f"not targeted: {m.name} ({m.numel:,} weights, sparsity {m.sparsity:.2%})")
        lines.append("")
        if self.eval is not None:
            ev = self.eval
            lines.append(
                f"perplexity on {ev['num_windows']} x {ev['seq_len']} tokens of {ev['source']}: "
                f"before {self.ppl_before:.3f}  after {self.ppl_after:.3f}"
                + (f"  (before: {ev['before']})" if ev.get("before") else "")
            )
        else:
            lines.append("perplexity: not measured (pass --eval-text FILE)")
        if self.disk and self.disk.get("after_bytes"):
            before, after = self.disk.get("before_bytes"), self.disk["after_bytes"]
            ratio = f" ({after / before:.2f}x)" if before else ""
            shown = f"{before / 1e6:.1f} MB -> " if before else ""
            lines.append(f"weights on disk: {shown}{after / 1e6:.1f} MB{ratio}")
        secs = self.seconds
        parts = [f"{k} {v:.1f} s" for k, v in secs.items() if k != "total"]
        lines.append(f"wall time: {secs.get('total', 0.0):.1f} s ({', '.join(parts)})")
        lines.append(f"max RSS: {self.max_rss_bytes / 2**30:.2f} GiB")
        lines.extend(_execution_lines(self.execution))
        if self.output_dir:
            out = Path(self.output_dir)
            untokenized = out.is_dir() and not any(
                (out / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
            )
            written = "model, recipe.yaml, report.json" if untokenized else "model, tokenizer, recipe.yaml, report.json"
            lines.append(f"output: {self.output_dir} ({written})")
        return "\n".join(lines)


def _execution_lines(execution: dict[str, Any] | None) -> list[str]:
    """The report's lines on where the job computed (device, activations, peak device memory, per-rank work)."""
    if not execution or "device" not in execution:
        return []
    info = execution["device"]
    total = info.get("total_memory_bytes")
    line = f"device: {info['device']} ({info['name']}" + (f", {total / 2**30:.1f} GiB)" if total else ")")
    acts = execution.get("activations")
    if acts:
        where = "on the device" if acts.get("mode") == "device" else "in CPU memory, moved to the device per batch"
        line += f"; activations between layers {where} ({acts.get('activation_bytes', 0) / 2**20:.1f} MiB)"
    if execution.get("peak_device_bytes") is not None:
        line += f"; peak device memory {execution['peak_device_bytes'] / 2**30:.2f} GiB"
    lines = [line]
    resumed = execution.get("resumed")
    if resumed is not None:
        before = resumed.get("threads")
        used = (
            f"it used {before} torch thread(s), this run {execution.get('threads')}"
            if before
            else "its threads unknown"
        )
        ranks = f"; {resumed['ranks']}" if resumed.get("ranks") else ""
        lines.append(f"resumed: continued an interrupted run's saved progress ({used}){ranks}")
    per_rank = execution.get("compress_per_rank") or []
    for rank, work in enumerate(per_rank):
        lines.append(
            f"rank {rank}: compressed {work['modules']} modules (sweep cost {work['cost']:.3g} = rows x columns^2, "
            f"{work['seconds']:.1f} s)"
        )
    if per_rank and per_rank[0].get("every_rank"):
        lines.append(
            f"every rank: compressed {per_rank[0]['every_rank']} more modules itself (fused experts' matrices, whose "
            "quantization parameters are not broadcast)"
        )
    return lines


def _pruned_by(modifier: Any) -> list[str]:
    """The modules a pruning modifier changed: the per-module ``results`` of a calibrated one whose zeros are sparsity
    (SparseGPT, Wanda; a quantizer's are not), the ``module_sparsity`` read-out of another (magnitude, constant);
    ``[]`` for any other modifier."""
    names = list(getattr(modifier, "module_sparsity", None) or {})
    if getattr(modifier, "zeros_are_sparsity", False):
        names += list(getattr(modifier, "results", None) or {})
    return names


def _bits_of_earlier_runs(model: nn.Module, by_name: dict[str, ModuleSparsity]) -> None:
    """Bits, group size and label of modules quantized before this run (an in-memory model given to oneshot again),
    from the compressed-tensors scheme they carry; and their zeros as sparsity only where they were pruned: the
    earlier run's count (its report, ``model.llmc_fsm_report``: the zeros each held before it was quantized), else
    (quantized elsewhere) the measured zeros only when they follow an N:M structure of at least half zeros (2:4, 8:16,
    ...), which values rounded to zero do not (unstructured pruning cannot be told from rounding there: not counted).
    Until 2026-12-06 every rounded zero counted, in the report and the saved ``global_sparsity`` (a tester's case)."""
    earlier = getattr(model, "llmc_fsm_report", None)
    counted = {m.name: m.zeros for m in getattr(earlier, "modules", [])}
    for before in getattr(earlier, "modules", []):  # fused experts' matrices too (views, not modules: B4's case)
        entry = by_name.get(before.name)
        if entry is not None and getattr(before, "pruned", False):
            entry.pruned = True
        if entry is not None and entry.bits is None and before.bits is not None:
            entry.zeros, entry.bits, entry.group_size = before.zeros, before.bits, before.group_size
            entry.quantized = before.quantized
    for name, module in model.named_modules():
        entry, scheme = by_name.get(name), getattr(module, "quantization_scheme", None)
        weights = getattr(scheme, "weights", None)
        if entry is None or entry.bits is not None or weights is None:
            continue
        if name in counted:
            entry.zeros = counted[name]
        elif not any(2 * fewest >= m for m, fewest in entry.fewest_zeros.items()):  # not N:M with N >= M/2:
            entry.zeros = 0  # not pruned as far as can be told (unstructured pruning is not told from rounding)
        entry.bits = int(weights.num_bits)
        strategy = getattr(weights.strategy, "value", weights.strategy)  # an enum, or its str value
        entry.group_size = int(weights.group_size) if strategy in ("group", "tensor_group") else None
        entry.quantized = scheme_label(scheme)


def _smoothing_line(label: str, results: dict[str, dict[str, Any]]) -> str:
    """One line summing up a smoothing modifier's ``smoothing_results`` (see :attr:`OneshotReport.smoothing`)."""
    values = list(results.values())
    if values and all("error_unclipped" in r for r in values):  # AWQ's clipping: per Linear
        applied = [r for r in values if r["applied"]]
        unclipped = sum(r["error_unclipped"] for r in values) / len(values)
        error = sum(r["error"] for r in values) / len(values)
        return (
            f"{label}: {len(applied)} of {len(values)} Linears clipped; mean output error, quantized: "
            f"{unclipped:.3g} unclipped -> {error:.3g}"
        )
    text = f"{label}: {len(values)} mappings smoothed"
    if values and all("error" in r for r in values):  # AWQ: exponents and the quantized block errors
        chosen = [r["exponent"] for r in values if r.get("exponent") is not None]
        unsmoothed = sum(r["error_unsmoothed"] for r in values) / len(values)
        error = sum(r["error"] for r in values) / len(values)
        mean = f", mean exponent {sum(chosen) / len(chosen):.2f}" if chosen else ""
        return (
            f"{text} ({len(values) - len(chosen)} kept unscaled{mean}); mean block output error, quantized: "
            f"{unsmoothed:.3g} unscaled -> {error:.3g}"
        )
    if values and all("act_max_after" in r for r in values):  # SmoothQuant: the largest activation, before/after
        before = max(r["act_max_before"] for r in values)
        after = max(r["act_max_after"] for r in values)
        low, high = min(r["scale_min"] for r in values), max(r["scale_max"] for r in values)
        return f"{text}; scales {low:.3g} to {high:.3g}; largest input max |x| {before:.3g} -> {after:.3g}"
    return text


def _kv_cache_line(label: str, scales: dict[str, dict[str, list[float]]]) -> str:
    """One line summing up a modifier's calibrated KV-cache (and query) scales (see :attr:`OneshotReport.kv_cache`)."""
    kinds = [k for k in ("q_scale", "k_scale", "v_scale") if any(k in v for v in scales.values())]
    ranges = []
    for kind in kinds:
        values = [x for v in scales.values() for x in v.get(kind, [])]
        ranges.append(f"{kind} {min(values):.3g} to {max(values):.3g}")
    return f"{label}: FP8 scales calibrated on {len(scales)} attention modules: {'; '.join(ranges)}"


def _bits_label(mods: list[ModuleSparsity]) -> tuple[str, float | None]:
    """The report's ``quantized`` label of targeted modules shown in one row (a decoder layer, an outside block):
    their bits/group sizes (``-`` if none is quantized), ending in ``*`` when some are quantized and some not; and
    their relative output error, the mean of the measured ones weighted by their numbers of weights (of the quantized
    ones where some are: a pruned module's error is not a quantizer's)."""
    labels = sorted({_label(m) for m in mods if m.bits is not None})
    partial = bool(labels) and any(m.bits is None for m in mods)
    measured = _shown_errors(mods)
    size = sum(m.numel for m in measured)
    error = sum(m.numel * m.rel_output_error for m in measured) / size if size else None
    return (",".join(labels) + ("*" if partial else "") or "-"), error


def _shown_errors(mods: list[ModuleSparsity]) -> list[ModuleSparsity]:
    """The modules of one row (a decoder layer, an outside block) whose relative output errors the row shows, in the
    table and in ``--plot``'s error panel: the measured ones, of the quantized ones where some are quantized (a module
    only pruned, which the quantizer ignored, measured the pruning's error, not the quantizer's)."""
    quantized = any(m.bits is not None for m in mods)
    return [m for m in mods if m.rel_output_error is not None and (m.bits is not None or not quantized)]


def _label(m: ModuleSparsity) -> str:
    """A quantized module's label: its scheme's (:attr:`ModuleSparsity.quantized`), else (a report written before
    2026-12-06, a quantizer that gives no label) ``<bits>b`` and ``/g<group size>``."""
    return m.quantized or f"{m.bits}b" + (f"/g{m.group_size}" if m.group_size else "")


def _named_layers(modules: list[ModuleSparsity]) -> dict[int, str]:
    """``{decoder layer index: its full name}`` (``model.decoder.layers.3``), for a report whose rows outside the
    decoder layers are numbered blocks too (Whisper's encoder layers): both kinds of row then read alike. The name
    ends at the first ``.<index>`` of a module's name (T5's ``decoder.block.0``; until 2026-12-07 the last, so its
    row read ``decoder.block.0.layer.0``, found by a tester)."""
    named: dict[int, str] = {}
    for m in modules:
        # the shortest prefix: the layer list's name and the index (T5's decoder.block.0, not decoder.block.0.layer.0)
        found = re.match(rf"(.*?\.{m.layer})\.", m.name) if m.layer is not None else None
        if found is not None:
            named.setdefault(m.layer, found.group(1))
    return named


def _outside_blocks(modules: list[ModuleSparsity]) -> dict[str, list[ModuleSparsity]]:
    """The report's rows for targeted modules outside the decoder layers: one per numbered block they sit in, named
    by the first all-digit part of their names (Whisper's ``model.encoder.layers.3`` for its six Linears, T5's
    ``encoder.block.0`` for the Linears of its ``.layer.0`` and ``.layer.1``: until 2026-12-07 the last number
    made a row of each sub-layer, found by a tester), one per module elsewhere (``lm_head``), in order.
    A block's label ends in ``*`` when some of its targeted weights were left unquantized."""
    blocks: dict[str, list[ModuleSparsity]] = {}
    for m in modules:
        found = re.match(r"(.*?\.\d+)\.", m.name)  # the first number: T5's encoder.block.0 holds .layer.0 and .1
        blocks.setdefault(found.group(1) if found else m.name, []).append(m)
    return blocks


def _expert_pruning_line(label: str, blocks: dict[str, dict[str, Any]]) -> str:
    """One line summing up an expert-pruning modifier's results (see :attr:`OneshotReport.expert_pruning`)."""
    shapes = sorted({(len(b["scores"]) - len(b["kept"]), len(b["scores"])) for b in blocks.values()})
    dropped = ", ".join(f"{d} of {n}" for d, n in shapes)
    return (
        f"{label}: dropped {dropped} experts in each of {len(blocks)} mixture-of-experts blocks "
        "(the experts kept, their scores and routed tokens per block: report.json expert_pruning)"
    )


def _tuning_line(label: str, results: dict[str, dict[str, Any]]) -> str:
    """One line summing up a tuning modifier's ``tuning_results`` (see :attr:`OneshotReport.tuning`): per layer the
    ratio of the kept weights' output MSE to round-to-nearest's (``tuned_mse / rtn_mse`` where the tuning was kept,
    1 where round-to-nearest was), its median and range, and the layers of the smaller side (tuning kept, or
    round-to-nearest kept). Layers rounded to nearest without tuning (``kept`` ``"rtn_mode"``: AutoRound's
    ``iters: 0``) are counted apart, with their output MSE where it was measured (``None`` from AutoRound, which runs
    no forward of its own then); so are layers rounded with auto-round's optimized round-to-nearest
    (``"opt_rtn_mode"``), with the ratio of their output MSE to plain round-to-nearest's where measured."""
    searched = {name: r for name, r in results.items() if r["kept"] == "opt_rtn_mode"}
    if searched and len(searched) == len(results):
        line = (
            f"{label}: {len(results)} layers rounded to nearest with each group's range searched on the calibration "
            "inputs' mean squares (iters: 0, auto-round's optimized round-to-nearest, no tuning)"
        )
        if any(r["rtn_mse"] is None or r["tuned_mse"] is None for r in searched.values()):
            return line
        ratios = [r["tuned_mse"] / r["rtn_mse"] if r["rtn_mse"] else 1.0 for r in searched.values()]
        return (
            f"{line}; output MSE vs plain round-to-nearest: median ratio {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f})"
        )
    mode = {name: r for name, r in results.items() if r["kept"] == "rtn_mode"}
    if mode and len(mode) == len(results):
        line = f"{label}: {len(results)} layers rounded to nearest (iters: 0, no tuning)"
        errors = [r["rtn_mse"] for r in mode.values()]
        if any(e is None for e in errors):
            return line
        return (
            f"{line}; output MSE vs the float model's output of each layer: median {statistics.median(errors):.3g} "
            f"({min(errors):.3g}-{max(errors):.3g})"
        )
    ratios = [r["tuned_mse"] / r["rtn_mse"] if r["kept"] == "autoround" else 1.0 for r in results.values()]
    rtn = [name for name, r in results.items() if r["kept"] != "autoround"]
    tuned = [name for name, r in results.items() if r["kept"] == "autoround"]
    if not rtn:
        kept = "the tuning kept on every layer"
    elif not tuned:  # (a newcomer read "the tuning kept on 0" oddly)
        kept = f"round-to-nearest kept on every layer (tuning did not lower their output error): {compact_names(rtn)}"
    elif len(tuned) < len(rtn):  # the smaller side named (a newcomer read 29 names for the one layer tuned)
        kept = (
            f"the tuning kept on {len(tuned)}: {compact_names(tuned)}; round-to-nearest on the other {len(rtn)} "
            "(tuning did not lower their output error)"
        )
    else:
        kept = (
            f"the tuning kept on {len(tuned)}, round-to-nearest on {len(rtn)} (tuning did not lower its "
            f"output error): {compact_names(rtn)}"
        )
    return (
        f"{label}: {len(results)} layers tuned; {kept}; output MSE vs round-to-nearest: median ratio "
        f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
    )


def _mean_by_modifier(modules: list[ModuleSparsity]) -> str:
    by: dict[str, list[float | None]] = {}
    for m in modules:
        for name, error in m.rel_output_errors:
            by.setdefault(name, []).append(error)
    return ", ".join(
        f"{name} not measured" if None in v else f"{name} {sum(v) / len(v):.4f}"  # type: ignore[arg-type]
        for name, v in by.items()
    )


def _quant_fields(m: ModuleSparsity) -> dict[str, Any]:
    fields = {
        key: value
        for key, value in (
            ("bits", m.bits),
            ("group_size", m.group_size),
            ("quantized", m.quantized),
            ("rel_output_error", m.rel_output_error),
            ("routed_tokens", m.routed_tokens),
            ("dampening_frac", m.dampening_frac),
        )
        if value is not None
    }
    if m.all_tokens:
        fields["calibrate_all_experts"] = True
    if len(m.rel_output_errors) > 1:  # every modifier that compressed it, in order (error None: not measured)
        fields["rel_output_errors"] = [{"modifier": n, "rel_output_error": e} for n, e in m.rel_output_errors]
    return fields


def build_report(
    *,
    model: nn.Module,
    model_name: str,
    recipe: Any,
    modifiers: Iterable[Any],
    calibration: dict[str, Any],
    ppl_before: float | None,
    ppl_after: float | None,
    eval: dict[str, Any] | None,
    seconds: dict[str, float],
    targeted: list[str],
    modules: list[ModuleSparsity] | None = None,
    execution: dict[str, Any] | None = None,
) -> OneshotReport:
    """The one-shot report of ``model`` after compression by ``modifiers``.

    Sparsity is measured on the weights (or given as ``modules``, measured while the
    weights were in memory: :mod:`llmc_fsm.pipeline.streaming`); quantization fields and output errors
    come from the modifiers' per-module results (``results`` of
    :class:`llmc_fsm.toolkit.calibrated.CalibratedModifier`); the targeted modules from
    ``targeted`` (the modifiers' :attr:`~llmc_fsm.Modifier.resolved_targets`, gathered after initialize).
    """

    if modules is None:
        try:
            _, layers = find_decoder_layers(model)
        except ValueError:
            layers = None
        modules = measure_sparsity(model, layers)
    by_name = {m.name: m for m in modules}
    stage_of = {id(m): stage.name for stage in getattr(recipe, "stages", []) for m in stage.modifiers}
    smoothing: dict[str, dict[str, dict[str, Any]]] = {}
    kv_scales: dict[str, dict[str, dict[str, list[float]]]] = {}
    tuning: dict[str, dict[str, dict[str, Any]]] = {}
    expert_pruning: dict[str, dict[str, dict[str, Any]]] = {}
    for modifier in modifiers:
        label = type(modifier).__name__ + (f" ({stage_of[id(modifier)]})" if id(modifier) in stage_of else "")
        if getattr(modifier, "smoothing_results", None):
            smoothing[label] = dict(modifier.smoothing_results)
        if getattr(modifier, "clipping_results", None):  # AWQ's apply_clip: per Linear
            smoothing[f"{label} clipping"] = dict(modifier.clipping_results)
        if getattr(modifier, "kv_cache_results", None):
            kv_scales[label] = dict(modifier.kv_cache_results)
        if getattr(modifier, "tuning_results", None):  # AutoRound: per decoder layer
            tuning[label] = dict(modifier.tuning_results)
        if getattr(modifier, "expert_pruning_results", None):  # REAP: per mixture-of-experts block
            expert_pruning[label] = dict(modifier.expert_pruning_results)
        for name in _pruned_by(modifier):
            if name in by_name:
                by_name[name].pruned = True
        for name, result in (getattr(modifier, "results", None) or {}).items():
            entry = by_name.get(name)
            if entry is None:
                continue
            if getattr(result, "bits", None) is not None:  # zeros: the pruned ones only (see ModuleResult)
                entry.bits, entry.group_size, entry.zeros = result.bits, result.group_size, result.zeros
                entry.quantized = getattr(result, "label", None)
            # the last modifier's error, against the weights it received (None: it measured none)
            entry.rel_output_error = getattr(result, "rel_output_error", None)
            entry.rel_output_errors.append((label, entry.rel_output_error))
        for name, count in (getattr(modifier, "routed_tokens", None) or {}).items():  # fused experts' matrices
            if name in by_name:
                by_name[name].routed_tokens = count
                by_name[name].all_tokens = bool(getattr(modifier, "calibrate_all_experts", False))
        for name, used in (getattr(modifier, "dampening_results", None) or {}).items():  # retried damping
            if name in by_name:
                by_name[name].dampening_frac = used
    _bits_of_earlier_runs(model, by_name)
    return OneshotReport(
        model=model_name,
        recipe=recipe.to_dict(applied=True),
        calibration=calibration,
        modules=modules,
        ppl_before=ppl_before,
        ppl_after=ppl_after,
        eval=eval,
        seconds=seconds,
        targeted=targeted,
        smoothing=smoothing,
        execution=execution,
        kv_cache=kv_scales,
        tuning=tuning,
        expert_pruning=expert_pruning,
    )
