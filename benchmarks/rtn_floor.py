"""Round-to-nearest W8A8: the least work any tool can do, against llmcompressor==0.14.0.1 in the same run.

    python benchmarks/rtn_floor.py              # 3 rounds, print the table
    python benchmarks/rtn_floor.py --rounds 5

Issue 9 asks of RTN W8A8 on SmolLM2-135M both wall <= 0.5x and peak RSS <= 0.8x
of llm-compressor's. This script measures two lower bounds, each in a fresh
process set up exactly as ``quantize_vs_llmcompressor.py``'s workers (the same
imports, model files loaded with ``from_pretrained(dir, dtype=float32)``,
tokenizer, calibration and evaluation windows), timing only the work below:

- ``floor: scales only`` -- per output channel ``max |w| / 127`` of every Linear
  but ``lm_head`` (the weight scales of W8A8, nothing rounded). This is all
  llm-compressor does in its ``oneshot`` for RTN: it rounds later, in every
  forward and when saving, so the fp32 weights stay resident.
- ``floor: int8 codes`` -- the same scales plus ``round(w / s)`` clamped to int8
  into new tensors, the fp32 weights left untouched;
- ``floor: int8 codes, fp32 pages dropped`` -- the same, then each fp32 weight's
  pages of the memory-mapped file dropped from the process
  (``madvise(MADV_DONTNEED)``): the least a tool must do that keeps the
  quantized model as codes and no fp32 copy, the only way below the fp32 model's
  resident size.

and, in the same rounds, ``llmc_fsm.oneshot`` RTN W8A8 as the comparison
benchmark runs it and llm-compressor's ``oneshot``. Rows are medians over the
rounds; ratios are against llm-compressor's median of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import loadavg, status_kib
from quantize_vs_llmcompressor import DATA, _run_peer, _run_self

FLOORS = ("scales", "codes", "codes-drop")
FLOOR_NAMES = {"scales": "floor: scales only", "codes": "floor: int8 codes",
               "codes-drop": "floor: int8 codes, fp32 pages dropped"}
MADV_DONTNEED = 4  # <sys/mman.h>


def _drop_pages(tensor: Any) -> None:
    """Drop this process's resident pages that lie wholly inside ``tensor``'s memory (``madvise(MADV_DONTNEED)``);
    the weights here are pages of the memory-mapped checkpoint, read again from the file if touched."""
    import ctypes
    import mmap

    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first and ctypes.CDLL(None, use_errno=True).madvise(
            ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED):
        raise OSError(ctypes.get_errno(), "madvise failed")


def floor_worker(kind: str, model_dir: str) -> dict[str, Any]:
    """One lower bound in this process: set up as the comparison's workers, time ``kind``'s work only."""
    import compressed_tensors.quantization  # noqa: F401  (imported by both tools before they quantize)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import llmc_fsm  # noqa: F401
    from llmc_fsm.data.protocol import load_text, token_windows

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = load_text(DATA)
    token_windows(tokenizer, text, num_windows=32, seq_len=256, from_end=True)
    token_windows(tokenizer, text, num_windows=40, seq_len=256)
    weights = [m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    before = status_kib("VmRSS") * 1024
    kept = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for w in weights:
            scale = w.abs().amax(dim=1, keepdim=True) / 127
            kept.append(torch.round(w / scale).clamp_(-128, 127).to(torch.int8) if kind != "scales" else scale)
            if kind == "codes-drop":
                _drop_pages(w)
    wall = time.perf_counter() - t0
    return {"side": FLOOR_NAMES[kind], "compress_wall_s": wall,
            "peak_rss_through_compression_bytes": status_kib("VmHWM") * 1024, "rss_before_bytes": before}


def _run_floor(kind: str, model_dir: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--floor", kind, "--model-dir", model_dir]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True,
                          env={**os.environ, "TQDM_DISABLE": "1"})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def render(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the medians per side, with ratios against llm-compressor's medians."""
    sides: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        sides.setdefault(row["side"], []).append(row)
    peer = next(v for k, v in sides.items() if k.startswith("llmcompressor"))
    peer_wall = statistics.median(r["compress_wall_s"] for r in peer)
    peer_rss = statistics.median(r["peak_rss_through_compression_bytes"] for r in peer)
    lines = ["| side | wall (s), median [min-max] | wall / llmcompressor | peak RSS (GB), median [min-max] "
             "| peak RSS / llmcompressor |", "|---|---|---|---|---|"]
    for side, runs in sides.items():
        walls = [r["compress_wall_s"] for r in runs]
        peaks = [r["peak_rss_through_compression_bytes"] / 1e9 for r in runs]
        wall, peak = statistics.median(walls), statistics.median(peaks)
        lines.append(f"| {side} | {wall:.3f} [{min(walls):.3f}-{max(walls):.3f}] | {wall / peer_wall:.2f} "
                     f"| {peak:.2f} [{min(peaks):.2f}-{max(peaks):.2f}] | {peak * 1e9 / peer_rss:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--floor", choices=FLOORS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    if args.floor:
        print(json.dumps(floor_worker(args.floor, args.model_dir)), flush=True)
        return 0
    from llmc_fsm.models.known import load_model

    model, _ = load_model("smollm2-135m")  # builds the cache directory once
    model_dir = str(model.name_or_path)
    del model
    rows = []
    for i in range(args.rounds):
        print(f"[bench] round {i + 1}/{args.rounds}, load average {loadavg()}", file=sys.stderr, flush=True)
        rows.append(_run_peer("rtn", model_dir))
        rows.append(_run_self(["--run", "rtn"], model_dir))
        rows.extend(_run_floor(kind, model_dir) for kind in FLOORS)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
