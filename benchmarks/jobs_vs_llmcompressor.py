"""Issue 26's three jobs end to end, ours and llmcompressor==0.14.0.1's, each in a fresh process: one command.

    python benchmarks/jobs_vs_llmcompressor.py                      # all jobs, both sides (peer only when quiet)
    python benchmarks/jobs_vs_llmcompressor.py --jobs gptq --no-peer --eval-windows 0
    python benchmarks/jobs_vs_llmcompressor.py --code /path/to/other/checkout   # ours from another revision
    python benchmarks/jobs_vs_llmcompressor.py --json out.json

Jobs (SmolLM2-135M-Instruct fp32 directory, the ``smollm2-135m`` cache of :mod:`llmc_fsm.models.known`):

* ``rtn`` — RTN W8A8 end to end: ``oneshot(dir, QuantizationModifier W8A8, output_dir=...)``: load, quantize,
  save compressed-tensors (no calibration data); ``rtn-streamed``: the same with ``low_memory=True``;
* ``sparsegpt`` — SparseGPT 50% (the default recipe), calibration 32 x 256 tokens from the tail of
  ``wiki.test.raw``, in-memory (default) path, output written;
* ``gptq`` — GPTQ W4A16 group 64 (``actorder: static``), same calibration, default path, output written.

Per run: ``call s`` = the ``oneshot`` call (load + compression + save for ours), ``process s`` = the whole
worker process (imports included), ``CPU s`` = user + system time of the worker (``getrusage``; far less
sensitive to other jobs on the machine than wall time), ``peak RSS`` = ``VmHWM`` right after the call, and the
perplexity of the compressed model on 40 x 256 tokens from the head of the text (``--eval-windows``; measured
after the peak was read). The load average is printed before and after every run. The peer runs only when the
1-minute load average is below 1.5 (``--force-peer`` overrides), through ``benchmarks/_peer.py``
(``peer_quantize_llmcompressor.py`` / ``peer_oneshot_llmcompressor.py``: model loaded with ``from_pretrained``
inside the process, its ``compress_wall_s`` and peak through compression); ratios are ours / theirs, same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

T_START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import loadavg, status_kib  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA = REPO_ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
QUIET = 1.5
GPTQ = {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 64}}, "actorder": "static"}}
JOBS: dict[str, dict[str, Any]] = {
    "rtn": {"recipe": {"quantization_stage": {"QuantizationModifier": {"scheme": "W8A8"}}}, "data": False},
    "rtn-streamed": {"recipe": {"quantization_stage": {"QuantizationModifier": {"scheme": "W8A8"}}}, "data": False,
                     "low_memory": True},
    "sparsegpt": {"recipe": None, "data": True},
    "gptq": {"recipe": {"quantization_stage": GPTQ}, "data": True},
}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Ours, in this fresh process."""
    t_imports = time.perf_counter()
    import torch

    import llmc_fsm
    from llmc_fsm.data.protocol import load_text, perplexity, token_windows

    imports_s = time.perf_counter() - t_imports
    job = JOBS[args.worker]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model = llmc_fsm.oneshot(
            args.model_dir, job["recipe"], dataset=str(DATA) if job["data"] else None,
            num_calibration_samples=32, max_seq_length=256, output_dir=Path(tmp) / "out", progress=False,
            low_memory=job.get("low_memory", False),
        )
        call_s = time.perf_counter() - t0
        peak = status_kib("VmHWM") * 1024
        report = model.llmc_fsm_report
        ppl = None
        if args.eval_windows:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
            windows = token_windows(tokenizer, load_text(DATA), num_windows=args.eval_windows, seq_len=256)
            if job.get("low_memory"):
                model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "out").eval()
            ppl = perplexity(model, windows, progress=False)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "side": "llmc-fsm", "job": args.worker, "call_s": call_s, "imports_s": imports_s,
        "process_s": time.perf_counter() - T_START, "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_bytes": peak, "ppl": ppl, "phases_s": report.seconds, "torch_threads": torch.get_num_threads(),
    }


def _ours(job: str, model_dir: str, eval_windows: int, code: str | None) -> dict[str, Any]:
    env = {**os.environ, "TQDM_DISABLE": "1", "LLMC_FSM_PERPLEXITY_CACHE": "off"}
    if code:
        env["PYTHONPATH"] = os.pathsep.join([code, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--worker", job, "--model-dir", model_dir, "--eval-windows", str(eval_windows)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=True)
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["launch_s"] = time.perf_counter() - t0
    return row


def _peer(job: str, model_dir: str, eval_windows: int) -> dict[str, Any]:
    from _peer import run_peer_script

    here = Path(__file__).parent
    with tempfile.TemporaryDirectory() as out:
        if job == "sparsegpt":
            row = run_peer_script(here / "peer_oneshot_llmcompressor.py",
                                  ["--model", model_dir, "--data", str(DATA), "--skip-dense",
                                   "--eval-windows", str(max(eval_windows, 1))])
        else:
            row = run_peer_script(here / "peer_quantize_llmcompressor.py",
                                  ["--model", model_dir, "--data", str(DATA), "--method", job.split("-")[0],
                                   "--out", out, "--eval-windows", str(max(eval_windows, 1))])
    return {"side": row.get("side", "llmcompressor"), "job": job, "call_s": row.get("compress_wall_s"),
            "peak_rss_bytes": row.get("peak_rss_through_compression_bytes") or row.get("peak_rss_bytes"),
            "ppl": row.get("ppl") or row.get("pruned_ppl"), "raw": row}


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| job | side | call s | process s | CPU s | peak RSS GB | perplexity | load before -> after |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['job']} | {r['side']} | {r['skipped']} | | | | | {r['load']} |")
            continue
        rss = None if r.get("peak_rss_bytes") is None else r["peak_rss_bytes"] / 1e9
        lines.append(
            f"| {r['job']} | {r['side']} | {_fmt(r.get('call_s'), '.2f')} | {_fmt(r.get('process_s'), '.2f')} | "
            f"{_fmt(r.get('cpu_s'), '.2f')} | {_fmt(rss, '.3f')} | {_fmt(r.get('ppl'), '.2f')} | {r['load']} |"
        )
    by_job: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if not r.get("skipped"):
            by_job.setdefault(r["job"], {})["ours" if r["side"] == "llmc-fsm" else "peer"] = r
    for job, sides in by_job.items():
        if "ours" in sides and "peer" in sides:
            o, p = sides["ours"], sides["peer"]
            parts = [f"{job}: ours / llmcompressor, same run"]
            for key, label in (("call_s", "wall"), ("peak_rss_bytes", "peak RSS"), ("ppl", "perplexity")):
                if o.get(key) and p.get(key):
                    parts.append(f"{label} {o[key] / p[key]:.2f}x")
            lines.append("- " + ", ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default="rtn,rtn-streamed,sparsegpt,gptq")
    parser.add_argument("--eval-windows", type=int, default=40, help="0: no perplexity (shorter runs)")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--force-peer", action="store_true", help=f"run the peer even at load average >= {QUIET}")
    parser.add_argument("--code", help="run our side from this checkout (PYTHONPATH), e.g. an older revision")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--worker", choices=sorted(JOBS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    from llmc_fsm.models.known import known_model_dir

    model_dir = str(known_model_dir("smollm2-135m"))
    rows: list[dict[str, Any]] = []
    for job in args.jobs.split(","):
        load = loadavg()
        row = _ours(job, model_dir, args.eval_windows, args.code)
        rows.append({**row, "load": f"{load} -> {loadavg()}"})
        print(f"[bench] {job} ours: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
        if args.no_peer or job == "rtn-streamed":
            continue
        load = loadavg()
        if float(load) >= QUIET and not args.force_peer:
            rows.append({"job": job, "side": "llmcompressor", "load": load,
                         "skipped": f"not run: load average {load} >= {QUIET}"})
            continue
        row = _peer(job, model_dir, args.eval_windows)
        rows.append({**row, "load": f"{load} -> {loadavg()}"})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
