"""Peak memory of one-shot SparseGPT against model depth: streamed (``low_memory=True``) and in memory.

    python benchmarks/memory_scaling.py                 # 8, 16, 32 layers, both paths; print the table
    python benchmarks/memory_scaling.py --write-docs    # ... and update docs/benchmarks.md and the plot

Checkpoints: synthetic ``LlamaForCausalLM`` of SmolLM2-135M's width (hidden 576,
intermediate 1536, 9 attention heads, 3 key/value heads, vocabulary 49152, tied
embeddings) with 8, 16 and 32 decoder layers, random weights (seed 0), fp32,
written once with ``save_pretrained`` to ``$LLMC_FSM_BENCH_CACHE`` (default
``/tmp/llmc-fsm-memory-scaling``) and reused.

Each measurement runs in a fresh process: imports (torch, transformers,
llmc_fsm and its plugins) and the model class built once on the ``meta``
device (the model code and config machinery, no weights), then the baseline
(``VmRSS`` of ``/proc/self/status``), then ``llmc_fsm.oneshot(<dir>, SparseGPT 50%,
16 x 128 random token windows, output_dir=<tmp>, low_memory=...)`` with no
evaluation. The peak resident set (``VmHWM``) is read per phase — reset with
``/proc/self/clear_refs`` when the run starts and ends writing what lies
outside the decoder layers (streamed: the embedding/head shard, written first;
in memory: ``save_model``, last) — so the peak through loading and the decoder
layers is reported apart from the one-off copy of the embedding and head.
"Above baseline" is ``VmHWM - baseline``: the memory the job itself needed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _measure import loadavg  # benchmarks/_measure.py, beside this script

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = REPO_ROOT / "docs" / "benchmarks.md"
PLOT = REPO_ROOT / "docs" / "memory_scaling.png"
SECTION = "## Memory against model depth (low_memory)"
DEPTHS = (8, 16, 32)
WIDTH = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
}
RECIPE = {"sparsity_stage": {"SparseGPTModifier": {"sparsity": 0.5}}}


def _log(msg: str) -> None:
    print(f"[memory] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    return Path(os.environ.get("LLMC_FSM_BENCH_CACHE", "/tmp/llmc-fsm-memory-scaling"))


def _status_mib(*fields: str) -> dict[str, float]:
    """``/proc/self/status`` memory fields in MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            out[key] = int(value.split()[0]) / 1024
    return out


# --------------------------------------------------------------------------- checkpoints
def checkpoint(layers: int) -> Path:
    """The synthetic checkpoint with ``layers`` decoder layers, written on first use (atomically)."""
    target = cache_dir() / f"llama-{layers}l"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    _log(f"writing the {layers}-layer checkpoint to {target} (once)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **WIDTH)).eval().save_pretrained(tmp)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def weight_bytes(directory: Path) -> int:
    """fp32 bytes of the checkpoint's tensors (tied weights stored once)."""
    from safetensors import safe_open

    total = 0
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shape = handle.get_slice(key).get_shape()
                count = 1
                for size in shape:
                    count *= size
                total += 4 * count
    return total


# --------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> dict[str, Any]:
    import llmc_fsm_pruning  # noqa: F401  (imported before the baseline, as oneshot would)
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    import llmc_fsm
    from llmc_fsm.oneshot_job.streaming import run_streaming  # noqa: F401

    torch.set_num_threads(args.threads)
    with init_empty_weights():  # the model code and its config machinery, no weights
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    generator = torch.Generator().manual_seed(0)
    windows = torch.randint(0, WIDTH["vocab_size"], (args.samples, args.seq_len), generator=generator)
    phases = _phase_peaks(args.low_memory)
    baseline = _status_mib("VmRSS")["VmRSS"]
    out = Path(tempfile.mkdtemp(prefix="llmc-fsm-memory-")) / "out"
    t0 = time.perf_counter()
    try:
        llmc_fsm.oneshot(
            str(args.model), RECIPE, windows, output_dir=out, batch_size=args.batch_size, progress=False,
            low_memory=args.low_memory,
        )
        seconds = time.perf_counter() - t0
        phases["rest"] = _status_mib("VmHWM")["VmHWM"]
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    return {
        "baseline_mib": baseline,
        "phases_mib": phases,
        "peak_mib": max(phases.values()),
        "seconds": seconds,
        "threads": torch.get_num_threads(),
    }


def _reset_peak() -> None:
    """Reset ``VmHWM`` to the current ``VmRSS`` (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def _phase_peaks(low_memory: bool) -> dict[str, float]:
    """Split the run's peak in three: before, during, and after writing what lies outside the decoder layers.

    Streamed, :func:`llmc_fsm.pipeline.streaming.write_outer` runs first (the embedding and head
    read once), then the decoder layers; in memory, :func:`llmc_fsm.output.save.save_model` runs
    last, after loading and compressing. ``VmHWM`` is read and reset when that function is
    entered and when it returns; the caller adds the peak of the rest ("rest").
    """
    import llmc_fsm.output.save
    import llmc_fsm.pipeline.streaming

    module, name = (llmc_fsm.pipeline.streaming, "write_outer") if low_memory else (llmc_fsm.output.save, "save_model")
    original = getattr(module, name)
    peaks: dict[str, float] = {}

    def marked(*a: Any, **kw: Any) -> Any:
        peaks["before"] = _status_mib("VmHWM")["VmHWM"]
        _reset_peak()
        try:
            return original(*a, **kw)
        finally:
            peaks[name] = _status_mib("VmHWM")["VmHWM"]
            _reset_peak()

    setattr(module, name, marked)
    return peaks


def measure(layers: int, low_memory: bool, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(checkpoint(layers)),
           "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
           "--threads", str(args.threads)]
    if low_memory:
        cmd.append("--low-memory")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=False)
    if proc.returncode != 0:
        msg = f"worker failed ({proc.returncode}) for {layers} layers, low_memory={low_memory}"
        raise RuntimeError(msg)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- report
def render(rows: list[dict[str, Any]], args: argparse.Namespace, load: str) -> str:
    layer_mib = _layer_mib()
    lines = [
        SECTION,
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()} with {os.cpu_count()} CPU cores (torch threads: "
        f"{args.threads}; load average {load}; the machine is shared: memory is robust to load, times are not), "
        "`python benchmarks/memory_scaling.py --write-docs`. "
        "Synthetic Llama checkpoints of SmolLM2-135M's width (hidden 576, intermediate 1536, 9/3 heads, vocabulary "
        "49152, tied embeddings; random weights, fp32, one `model.safetensors`), SparseGPT 50% on every decoder "
        f"Linear, calibration {args.samples} x {args.seq_len} random tokens, batch {args.batch_size}, output "
        "written, no evaluation. Each run is a fresh process; baseline = `VmRSS` after the imports and the model "
        "class built on `meta`; peaks = `VmHWM` per phase (reset through `/proc/self/clear_refs`): through loading "
        "and the decoder layers, and while the tensors outside the layers are written (streamed: the "
        "embedding/head shard, first; in memory: `save_model`, last). One decoder layer's fp32 weights: "
        f"{layer_mib:.1f} MiB.",
        "",
        "| layers | fp32 weights (MiB) | path | baseline (MiB) | peak above baseline, load + decoder layers (MiB) "
        "| peak above baseline, writing outside the layers (MiB) | whole run (MiB) | whole run / weights | wall (s) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['layers']} | {row['weights_mib']:.0f} | {'low_memory' if row['low_memory'] else 'in memory'} "
            f"| {row['baseline_mib']:.0f} | {_layers_peak(row):.1f} | {_outside_peak(row):.1f} "
            f"| {_above(row):.1f} | {_above(row) / row['weights_mib']:.3f} | {row['seconds']:.1f} |"
        )
    streamed = [r for r in rows if r["low_memory"]]
    if len(streamed) > 1:
        steps = ", ".join(
            f"{a['layers']} -> {b['layers']}: {_layers_peak(b) - _layers_peak(a):+.1f} MiB"
            for a, b in itertools.pairwise(streamed)
        )
        last = streamed[-1]
        lines += [
            "",
            f"Streamed, the peak through the decoder layers changes by {steps} when the depth doubles (target: at "
            f"most one decoder layer's working set; its fp32 weights alone are {layer_mib:.1f} MiB). The whole-run "
            f"peak is set once, by the copy of the embedding/head ({WIDTH['vocab_size']} x {WIDTH['hidden_size']} "
            f"fp32 = {WIDTH['vocab_size'] * WIDTH['hidden_size'] * 4 / 2**20:.0f} MiB, memory-mapped); for "
            f"{last['layers']} layers it is {_above(last) / last['weights_mib']:.3f} x the fp32 weights "
            "(target <= 0.3).",
        ]
    lines += ["", "![peak memory against depth](memory_scaling.png)", ""]
    return "\n".join(lines) + "\n"


def _above(row: dict[str, Any]) -> float:
    return row["peak_mib"] - row["baseline_mib"]


def _layers_peak(row: dict[str, Any]) -> float:
    phases = row["phases_mib"]
    return (phases["rest"] if row["low_memory"] else phases["before"]) - row["baseline_mib"]


def _outside_peak(row: dict[str, Any]) -> float:
    return row["phases_mib"]["write_outer" if row["low_memory"] else "save_model"] - row["baseline_mib"]


def _layer_mib() -> float:
    h, i = WIDTH["hidden_size"], WIDTH["intermediate_size"]
    kv = h * WIDTH["num_key_value_heads"] // WIDTH["num_attention_heads"]
    return 4 * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) / 2**20


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for low_memory, label, marker in ((False, "in memory", "s"), (True, "low_memory (streamed)", "o")):
        pts = [r for r in rows if r["low_memory"] == low_memory]
        ax.plot([r["layers"] for r in pts], [_above(r) for r in pts], marker=marker, label=f"{label}, whole run")
        if low_memory:
            ax.plot([r["layers"] for r in pts], [_layers_peak(r) for r in pts], marker=marker, linestyle="--",
                    label=f"{label}, through the layers")
    weights = sorted({(r["layers"], r["weights_mib"]) for r in rows})
    ax.plot([w[0] for w in weights], [w[1] for w in weights], linestyle="--", color="grey", label="fp32 weights")
    ax.plot([w[0] for w in weights], [0.3 * w[1] for w in weights], linestyle=":", color="grey", label="0.3 x weights")
    ax.set_xlabel("decoder layers (SmolLM2 width)")
    ax.set_ylabel("peak RSS above baseline (MiB)")
    ax.set_xticks(list(DEPTHS))
    ax.set_ylim(0, 1.6 * max(_above(r) for r in rows))  # room for the legend above the lines
    ax.set_title("One-shot SparseGPT 50%: peak memory against depth")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_docs(section: str) -> None:
    text = DOCS.read_text(encoding="utf-8")
    if SECTION in text:
        start = text.index(SECTION)
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + ("\n" + text[nxt + 1 :] if nxt != -1 else "")  # blank line kept
    else:
        text = text.rstrip("\n") + "\n\n" + section
    DOCS.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--low-memory", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--samples", type=int, default=16, help="calibration windows (default 16)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window (default 128)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS))
    p.add_argument("--no-in-memory", action="store_true", help="measure the streamed path only")
    p.add_argument("--write-docs", action="store_true", help=f"update {DOCS.relative_to(REPO_ROOT)} and the plot")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    load = loadavg()
    _log(f"load average {load}")
    rows = []
    for layers in args.depths:
        weights = weight_bytes(checkpoint(layers)) / 2**20
        for low_memory in (True, False) if not args.no_in_memory else (True,):
            _log(f"{layers} layers, low_memory={low_memory}")
            row = {"layers": layers, "weights_mib": weights, "low_memory": low_memory}
            row.update(measure(layers, low_memory, args))
            _log(json.dumps(row))
            rows.append(row)
    load = f"{load} before the runs, {loadavg()} after"
    section = render(rows, args, load)
    print(section)
    if args.write_docs:
        write_docs(section)
        plot(rows, PLOT)
        _log(f"updated {DOCS} and {PLOT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
