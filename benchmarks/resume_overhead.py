"""Cost of one-shot resume (issue 10) on the main job: what keeping per-layer progress adds, and what a resume costs.

Runs ``llmc-fsm oneshot`` (SmolLM2-135M, SparseGPT 50%, 32 x 256 calibration tokens from the tail of
wikitext-2 test; ``--eval`` adds the 40 x 256 perplexity windows of the README's main job) three times, each in
a fresh process with the same thread count:

1. uninterrupted, with the work-directory steps timed (fingerprint, claim, each layer's save, windows, publish);
2. the same command killed (SIGKILL) right after decoder layer ``--kill-after`` was saved;
3. the same command with ``--resume``: restore + recompute time, total wall time,

and checks that 3's weights equal 1's bit for bit. Prints one JSON line.

    python benchmarks/resume_overhead.py --out /tmp/resume-bench [--eval] [--kill-after 14] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("LLMC_FSM_DATA", ROOT.parent / "shared" / "data")) / "wikitext-2-raw" / "wiki.test.raw"

#: Child process: time the work-directory steps (written as JSON to $TIMINGS), optionally SIGKILL after a layer.
CHILD = """
import json, os, signal, sys, time
import llmc_fsm.oneshot_job.resume as resume, llmc_fsm.output.workdir as workdir, llmc_fsm.oneshot_job.phases as phases
spent = {}
def timed(owner, name, key, after=None):
    original = getattr(owner, name)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
            if after is not None:
                after(*args)
    setattr(owner, name, wrapper)
kill = int(os.environ.get("KILL_AFTER", "-1"))
def maybe_kill(self, index, layer):
    if index == kill:
        os.kill(os.getpid(), signal.SIGKILL)
timed(resume.LayerProgress, "save", "layer_saves", maybe_kill)
timed(resume.LayerProgress, "restore", "layer_restores")
timed(resume, "save_windows", "windows")
timed(phases, "_fingerprint", "fingerprint")
timed(workdir.WorkDir, "claim", "claim")
timed(workdir.WorkDir, "settle", "settle")
timed(workdir.WorkDir, "publish", "publish")
from llmc_fsm.cli import main
t0 = time.perf_counter()
rc = main(sys.argv[1:])
spent["wall"] = time.perf_counter() - t0
json.dump(spent, open(os.environ["TIMINGS"], "w"))
sys.exit(rc)
"""


def run(args: list[str], timings: Path, kill_after: int | None = None) -> tuple[int, dict, float]:
    env = {**os.environ, "TIMINGS": str(timings)}
    if kill_after is not None:
        env["KILL_AFTER"] = str(kill_after)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    spent = json.loads(timings.read_text()) if timings.exists() and proc.returncode == 0 else {}
    if proc.returncode not in (0, -9):
        sys.exit(f"run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.returncode, spent, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="an empty scratch directory")
    parser.add_argument("--eval", action="store_true", help="also measure perplexity before/after (the README job)")
    parser.add_argument("--kill-after", type=int, default=14)
    parser.add_argument("--threads", type=int, default=2)
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    base = ["oneshot", "--dataset", str(DATA), "--no-progress", "--threads", str(opts.threads)]
    if opts.eval:
        base += ["--eval-text", str(DATA)]
    from safetensors.torch import load_file

    _, full, _ = run([*base, "--output", str(opts.out / "full")], opts.out / "full.json")
    rc, _, killed_wall = run([*base, "--output", str(opts.out / "resumed")], opts.out / "k.json", opts.kill_after)
    assert rc == -9, rc
    _, resumed, _ = run([*base, "--output", str(opts.out / "resumed"), "--resume"], opts.out / "resumed.json")
    a = load_file(str(opts.out / "full" / "model.safetensors"))
    b = load_file(str(opts.out / "resumed" / "model.safetensors"))
    keeping = sum(full.get(k, 0.0) for k in ("layer_saves", "windows", "fingerprint", "claim", "settle", "publish"))
    print(json.dumps({
        "eval": opts.eval,
        "threads": opts.threads,
        "full_wall_s": round(full["wall"], 2),
        "progress_cost_s": {k: round(v, 3) for k, v in full.items() if k != "wall"},
        "progress_cost_fraction": round(keeping / full["wall"], 4),
        "killed_after_layer": opts.kill_after,
        "killed_run_wall_s": round(killed_wall, 2),
        "resumed_wall_s": round(resumed["wall"], 2),
        "resume_restore_s": round(resumed.get("layer_restores", 0.0), 3),
        "bitwise_equal": sorted(a) == sorted(b) and all(bool((a[k] == b[k]).all()) for k in a),
    }))


if __name__ == "__main__":
    main()
