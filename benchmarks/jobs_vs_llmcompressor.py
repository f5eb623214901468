"""Issue 26's jobs end to end, ours and llmcompressor==0.14.0.1's, each in a fresh process, measured alike.

    python benchmarks/jobs_vs_llmcompressor.py                      # every job, both sides (peer only when quiet)
    python benchmarks/jobs_vs_llmcompressor.py --jobs gptq,gptq-cli --no-peer --eval-windows 0
    python benchmarks/jobs_vs_llmcompressor.py --code /path/to/other/checkout   # ours from another revision
    python benchmarks/jobs_vs_llmcompressor.py --json out.json
    python benchmarks/jobs_vs_llmcompressor.py --jobs gptq-cli --eval-windows 0 --repeat 3   # medians of 3 rounds

Jobs (SmolLM2-135M-Instruct fp32 directory, the ``smollm2-135m`` cache of :mod:`llmc_fsm.models.known`; every
Linear but ``lm_head``; calibrated jobs: 32 x 256 tokens from the tail of ``wiki.test.raw``; output written):

* ``rtn`` — RTN W8A8 (data-free) through ``llmc_fsm.oneshot(...)``, the in-memory path (``low_memory=False``);
  ``rtn-streamed``: the same with ``low_memory=True``; ``rtn-cli``: ``llmc-fsm oneshot --method rtn --scheme W8A8
  --output OUT`` (its ``main()`` called in the fresh process: whatever path the CLI takes by default);
* ``sparsegpt`` — SparseGPT 50% unstructured (the default recipe) through ``llmc_fsm.oneshot`` (in-memory path);
  ``sparsegpt-cli``: ``llmc-fsm oneshot --dataset wiki.test.raw --output OUT``, the command's default path (it
  streams a calibrated job one decoder layer at a time, glibc's free heap given back after each layer);
  ``sparsegpt-cli-lowmem``: the same with ``--low-memory`` (glibc's mmap threshold fixed at 128 KiB: a flatter
  peak, a page fault per page of every large tensor); ``sparsegpt-inmem``: the command with ``--in-memory``;
* ``gptq`` — GPTQ W4A16 group 64 (``actorder: static``) through ``llmc_fsm.oneshot`` (in-memory path);
  ``gptq-cli``, ``gptq-cli-lowmem``, ``gptq-inmem``: ``llmc-fsm oneshot --recipe <the same recipe> --dataset
  wiki.test.raw --output OUT`` as for SparseGPT.

Each side runs in its own fresh process and measures the same things in the same order
(``benchmarks/peer_jobs_llmcompressor.py`` is the peer's; the ``-streamed`` / ``-cli`` variants are ours only and
are compared with the peer's row of their job):

``e2e s``   wall seconds from the process's start (its ``exec``, before the interpreter imported anything, read
            from ``/proc``: ``_measure.process_seconds``) to the checkpoint saved — imports, model load, tokenizer,
            calibration data, compression, save: what a user waits for;
``call s``  the library's one-shot call alone: ours ``oneshot(...)`` / the CLI's ``main()`` (which load the model
            and save it: there is no other way to call them), the peer's ``oneshot(model=...)`` (model loaded
            before it and saved after it by the script, as its documentation shows);
``CPU s``   user + system seconds of the process at that point (``getrusage``; much less sensitive than wall time
            to other jobs on the machine);
``peak RSS`` ``VmHWM`` right after the save;
``RSS imports / loaded``  ``VmRSS`` after the imports (ours: ``llmc_fsm`` and torch; the peer's: llmcompressor,
            transformers, datasets) and, for the peer, after ``from_pretrained`` (ours loads inside the call);
``perplexity``  measured only after all of the above: the saved checkpoint reloaded with ``from_pretrained`` and
            evaluated on ``--eval-windows`` x 256 tokens from the head of the text (our protocol, batch 1; the
            peer script loads the same ``llmc_fsm/data/protocol.py``); ``--eval-windows 0`` skips it.

The 1-minute load average is printed before and after every run. The peer runs only when it is below 1.5
(``--force-peer`` overrides; the row then says why it did not run). Ratios are ours / theirs, same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import loadavg, process_seconds, status_kib  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA = REPO_ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
QUIET = 1.5
GPTQ = {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 64}}, "actorder": "static"}}
RTN = {"quantization_stage": {"QuantizationModifier": {"scheme": "W8A8"}}}
#: job -> how our side runs it: ``recipe`` (None: the default recipe), ``data`` (calibration text), ``path``
#: (``api``: ``llmc_fsm.oneshot`` in memory; ``streamed``: ``low_memory=True``; ``cli``: ``llmc-fsm oneshot``).
JOBS: dict[str, dict[str, Any]] = {
    "rtn": {"recipe": RTN, "data": False, "path": "api"},
    "rtn-streamed": {"recipe": RTN, "data": False, "path": "streamed"},
    "rtn-cli": {"recipe": RTN, "data": False, "path": "cli", "flags": ["--method", "rtn", "--scheme", "W8A8"]},
    "sparsegpt": {"recipe": None, "data": True, "path": "api"},
    "sparsegpt-cli": {"recipe": None, "data": True, "path": "cli", "flags": []},
    "sparsegpt-cli-lowmem": {"recipe": None, "data": True, "path": "cli", "flags": ["--low-memory"]},
    "sparsegpt-inmem": {"recipe": None, "data": True, "path": "cli", "flags": ["--in-memory"]},
    "gptq": {"recipe": {"quantization_stage": GPTQ}, "data": True, "path": "api"},
    "gptq-cli": {"recipe": {"quantization_stage": GPTQ}, "data": True, "path": "cli"},
    "gptq-cli-lowmem": {"recipe": {"quantization_stage": GPTQ}, "data": True, "path": "cli", "extra": ["--low-memory"]},
    "gptq-inmem": {"recipe": {"quantization_stage": GPTQ}, "data": True, "path": "cli", "extra": ["--in-memory"]},
}
DEFAULT_JOBS = "rtn,rtn-cli,sparsegpt,sparsegpt-cli,gptq,gptq-cli"


def peer_job(job: str) -> str:
    """The peer job a job of ours is compared with (``gptq-cli`` -> ``gptq``)."""
    return job.split("-")[0]


def _cli_args(job: dict[str, Any], out: Path, tmp: Path) -> list[str]:
    args = ["oneshot", "--output", str(out), "--no-progress"]
    if job["data"]:
        args += ["--dataset", str(DATA)]
    if "flags" in job:
        return args + job["flags"]
    recipe = tmp / "recipe.json"
    recipe.write_text(json.dumps(job["recipe"]))
    return args + ["--recipe", str(recipe), *job.get("extra", [])]


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Ours, in this fresh process: the job, then (only after its measurements) the perplexity of its output."""
    job = JOBS[args.worker]
    if job["path"] == "cli":
        from llmc_fsm.cli.main import main as cli_main
    else:
        import llmc_fsm
    import torch  # imported by llmc_fsm already

    imports_s = process_seconds()
    rss_imports = status_kib("VmRSS") * 1024
    phases = None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        t0 = time.perf_counter()
        if job["path"] == "cli":
            status = cli_main(_cli_args(job, out, Path(tmp)))
            if status:
                raise SystemExit(f"llmc-fsm oneshot exited with {status}")
        else:
            model = llmc_fsm.oneshot(
                args.model_dir, job["recipe"], dataset=str(DATA) if job["data"] else None,
                num_calibration_samples=32, max_seq_length=256, output_dir=out, progress=False,
                low_memory=job["path"] == "streamed",
            )
            phases = model.llmc_fsm_report.seconds
            del model
        call_s = time.perf_counter() - t0
        e2e_s = process_seconds()
        peak = status_kib("VmHWM") * 1024
        usage = resource.getrusage(resource.RUSAGE_SELF)
        report = json.loads((out / "report.json").read_text())
        size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        ppl = None
        if args.eval_windows:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from llmc_fsm.data.protocol import load_text, perplexity, token_windows

            tokenizer = AutoTokenizer.from_pretrained(out)
            windows = token_windows(tokenizer, load_text(DATA), num_windows=args.eval_windows, seq_len=256)
            ppl = perplexity(AutoModelForCausalLM.from_pretrained(out).eval(), windows, progress=False)
    return {
        "side": "llmc-fsm", "job": args.worker, "path": job["path"], "e2e_s": e2e_s, "imports_s": imports_s,
        "call_s": call_s, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_bytes": peak,
        "rss_after_imports_bytes": rss_imports, "ppl": ppl, "weights_on_disk_bytes": size,
        "phases_s": phases or report.get("seconds"), "torch_threads": torch.get_num_threads(),
    }


def _ours(job: str, model_dir: str, eval_windows: int, code: str | None) -> dict[str, Any]:
    env = {**os.environ, "TQDM_DISABLE": "1", "LLMC_FSM_PERPLEXITY_CACHE": "off", **JOBS[job].get("env", {})}
    if code:
        env["PYTHONPATH"] = os.pathsep.join([code, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--worker", job, "--model-dir", model_dir, "--eval-windows", str(eval_windows)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=True)
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["launch_s"] = time.perf_counter() - t0  # the whole child, perplexity included
    return row


def _peer(job: str, model_dir: str, eval_windows: int) -> dict[str, Any]:
    from _peer import run_peer_script

    row = run_peer_script(Path(__file__).parent / "peer_jobs_llmcompressor.py",
                          ["--job", job, "--model", model_dir, "--data", str(DATA),
                           "--eval-windows", str(eval_windows)])
    return {**row, "side": row.get("side", "llmcompressor"), "job": job}


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _gb(value: Any) -> Any:
    return None if value is None else value / 1e9


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| job | side | e2e s | call s | CPU s | peak RSS GB | RSS imports GB | perplexity | load before -> after |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['job']} | {r['side']} | {r['skipped']} | | | | | | {r['load']} |")
            continue
        lines.append(
            f"| {r['job']} | {r['side']} | {_fmt(r.get('e2e_s'), '.2f')} | {_fmt(r.get('call_s'), '.2f')} | "
            f"{_fmt(r.get('cpu_s'), '.2f')} | {_fmt(_gb(r.get('peak_rss_bytes')), '.3f')} | "
            f"{_fmt(_gb(r.get('rss_after_imports_bytes')), '.3f')} | {_fmt(r.get('ppl'), '.2f')} | {r['load']} |"
        )
    rounds = sorted({r.get("round", 1) for r in rows})
    for n in rounds:
        this = [r for r in rows if r.get("round", 1) == n]
        peers = {r["job"]: r for r in this if not r.get("skipped") and r["side"] != "llmc-fsm"}
        for o in this:
            if o.get("skipped") or o["side"] != "llmc-fsm" or peer_job(o["job"]) not in peers:
                continue
            p = peers[peer_job(o["job"])]
            where = "same run" if len(rounds) == 1 else f"round {n}"
            parts = [f"{o['job']}: ours / llmcompressor ({p['job']}), {where}"]
            for key, label in RATIOS:
                if o.get(key) and p.get(key):
                    parts.append(f"{label} {o[key] / p[key]:.2f}x")
            lines.append("- " + ", ".join(parts))
    if len(rounds) > 1:
        lines.append(medians(rows))
    return "\n".join(lines)


RATIOS = (("e2e_s", "e2e wall"), ("call_s", "call wall"), ("cpu_s", "CPU"), ("peak_rss_bytes", "peak RSS"),
          ("ppl", "perplexity"))


def medians(rows: list[dict[str, Any]]) -> str:
    """Per job and side, the median of each measure over the rounds, and ours / the peer's of those medians.

    With ``--repeat N`` each round runs every job ours then the peer's, so both sides see the machine's drift
    alike; the median of each side is what the run-to-run spread (docs/benchmarks.md: +-12% on the peer's calibrated
    jobs over a day) leaves of a comparison.
    """
    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    by: dict[tuple[str, str], dict[str, float | None]] = {}
    for job, side in dict.fromkeys((r["job"], r["side"]) for r in rows if not r.get("skipped")):
        runs = [r for r in rows if not r.get("skipped") and (r["job"], r["side"]) == (job, side)]
        by[job, side] = {key: median([r[key] for r in runs if r.get(key)]) for key, _ in RATIOS}
        by[job, side]["runs"] = len(runs)
    lines = ["", "Medians over the rounds:", "",
             "| job | side | runs | e2e s | call s | CPU s | peak RSS GB | perplexity |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for (job, side), m in by.items():
        lines.append(f"| {job} | {side} | {m['runs']} | {_fmt(m['e2e_s'], '.2f')} | {_fmt(m['call_s'], '.2f')} | "
                     f"{_fmt(m['cpu_s'], '.2f')} | {_fmt(_gb(m['peak_rss_bytes']), '.3f')} | {_fmt(m['ppl'], '.2f')} |")
    for (job, side), o in by.items():
        p = next((m for (j, s), m in by.items() if j == peer_job(job) and s != "llmc-fsm"), None)
        if side != "llmc-fsm" or p is None:
            continue
        parts = [f"{job}: ours / llmcompressor ({peer_job(job)}), medians"]
        parts += [f"{label} {o[key] / p[key]:.2f}x" for key, label in RATIOS if o.get(key) and p.get(key)]
        lines.append("- " + ", ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default=DEFAULT_JOBS, help=f"comma-separated, of {', '.join(JOBS)}")
    parser.add_argument("--eval-windows", type=int, default=40, help="0: no perplexity (shorter runs)")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--force-peer", action="store_true", help=f"run the peer even at load average >= {QUIET}")
    parser.add_argument("--code", help="run our side from this checkout (PYTHONPATH), e.g. an older revision")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds: each runs every job, ours then the peer's; the table adds each side's medians")
    parser.add_argument("--worker", choices=sorted(JOBS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    jobs = args.jobs.split(",")
    unknown = [j for j in jobs if j not in JOBS]
    if unknown:
        parser.error(f"unknown job(s) {', '.join(unknown)}; choose from {', '.join(JOBS)}")
    from llmc_fsm.models.known import known_model_dir

    model_dir = str(known_model_dir("smollm2-135m"))
    rows: list[dict[str, Any]] = []
    for n in range(1, args.repeat + 1):
        peer_done: set[str] = set()
        for job in jobs:
            load = loadavg()
            row = _ours(job, model_dir, args.eval_windows, args.code)
            rows.append({**row, "load": f"{load} -> {loadavg()}", "round": n})
            print(f"[bench] {job} ours: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
            peer = peer_job(job)
            if args.no_peer or peer in peer_done:
                continue
            peer_done.add(peer)
            load = loadavg()
            if float(load) >= QUIET and not args.force_peer:
                rows.append({"job": peer, "side": "llmcompressor", "load": load, "round": n,
                             "skipped": f"not run: load average {load} >= {QUIET}"})
                continue
            row = _peer(peer, model_dir, args.eval_windows)
            rows.append({**row, "load": f"{load} -> {loadavg()}", "round": n})
            print(f"[bench] {peer} peer: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
