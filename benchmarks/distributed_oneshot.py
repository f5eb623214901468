"""One process vs N ranks (torchrun, gloo): SparseGPT 50% on SmolLM2-135M — wall time, per-rank max RSS, agreement.

Runs the real CLI with the same arguments, every process with one torch thread
(``OMP_NUM_THREADS=1``, ``--threads 1``), one launch after the other:

* ``1 process``:  ``python -m llmc_fsm oneshot --dataset D --output OUT ...`` (``--batch-size 8``)
* ``N ranks``:    ``torchrun --standalone --nproc-per-node N -m llmc_fsm oneshot ...`` (same flags)
* ``control`` (``--control``): one process again with ``--batch-size 16`` — the same tokens and
  the same algorithm, only the order in which the Hessian sums are rounded differs. It shows how
  much of the difference between the first two runs float summation order alone produces.

Each process records its wall time (worker start to exit), its compress phase
(from its own report), its CPU time (user + system) and ``ru_maxrss``; the driver adds the end-to-end wall time
of each launch and the load average before and after. Then it compares the
saved ``model.safetensors``: per decoder layer, the fraction of weights whose
keep/prune decision differs from the one-process run, the first layer that
differs, the largest weight difference, and (``--eval-windows``, default 40) the
perplexity of each output on 256-token windows from the head of the dataset.

The script exits 1 unless the N-rank output has exactly the one-process
sparsity and its mask disagreement is no larger than the control's (when run)
— the ranks themselves compare their weights after every layer and stop on any
difference, so a finished N-rank run has identical weights on every rank.

    python benchmarks/distributed_oneshot.py [--nproc 2] [--control] [--eval-windows 40] [--json]

Results are recorded in docs/benchmarks.md ("Several processes").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
DEFAULT_DATA = HERE.parent.parent.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


def worker(stats_dir: str, argv: list[str]) -> int:
    """One process (a rank under torchrun): run the CLI, then write its times and max RSS."""
    t0 = time.perf_counter()
    import llmc_fsm.cli.oneshot as cli_oneshot
    from llmc_fsm.cli import main as cli_main

    reports = []
    run_oneshot = cli_oneshot.run_oneshot

    def keep_report(*args, **kwargs):
        model = run_oneshot(*args, **kwargs)
        reports.append(model.llmc_fsm_report)
        return model

    cli_oneshot.run_oneshot = keep_report  # the CLI prints the report on rank 0 only; every rank keeps its own here
    rc = cli_main(argv)
    rank = int(os.environ.get("RANK", "0"))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    stats = {
        "rank": rank,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "exit_status": rc,
        "wall_s": time.perf_counter() - t0,
        "phases_s": dict(reports[0].seconds) if reports else {},
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "max_rss_bytes": usage.ru_maxrss * 1024,
    }
    Path(stats_dir, f"rank{rank}.json").write_text(json.dumps(stats) + "\n", encoding="utf-8")
    return rc


def _load() -> list[str]:
    with open("/proc/loadavg", encoding="ascii") as fh:
        return fh.read().split()[:3]


def _launch(cmd: list[str], stats_dir: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = _load()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        msg = f"{' '.join(cmd[:6])} ... exited with {proc.returncode}"
        raise SystemExit(msg)
    ranks = [json.loads(p.read_text()) for p in sorted(stats_dir.glob("rank*.json"))]
    return {"wall_s": wall, "load_before": before, "load_after": _load(), "ranks": ranks, "stdout": proc.stdout}


def _agreement(reference: Path, other: Path) -> dict:
    """Per decoder layer: fraction of pruned-weight decisions that differ; first layer that differs; max |dw|."""
    from safetensors.torch import load_file

    a = load_file(str(reference / "model.safetensors"))
    b = load_file(str(other / "model.safetensors"))
    if set(a) != set(b):
        msg = f"the outputs hold different tensors: {sorted(set(a) ^ set(b))[:5]}"
        raise SystemExit(msg)
    per_layer: dict[int, list[int]] = {}
    for key in a:
        match = re.match(r"model\.layers\.(\d+)\..*proj\.weight$", key)
        if match is None:
            continue
        differ = int(((a[key] == 0) != (b[key] == 0)).sum())
        counts = per_layer.setdefault(int(match.group(1)), [0, 0])
        counts[0] += differ
        counts[1] += a[key].numel()
    layers = sorted(per_layer)
    fractions = [per_layer[i][0] / per_layer[i][1] for i in layers]
    differing = [i for i in layers if per_layer[i][0]]
    zeros = [sum(int((t[k] == 0).sum()) for k in t if k.endswith("proj.weight")) for t in (a, b)]
    return {
        "first_layer_differing": differing[0] if differing else None,
        "mask_differences_layer0": per_layer[layers[0]][0],
        "mask_disagreement_overall": sum(c[0] for c in per_layer.values()) / sum(c[1] for c in per_layer.values()),
        "mask_disagreement_max_layer": max(fractions),
        "max_abs_weight_diff": max(float((a[k].float() - b[k].float()).abs().max()) for k in a),
        "same_zero_count": zeros[0] == zeros[1],
    }


def _perplexity(output: Path, dataset: str, windows: int) -> float:
    import torch

    from llmc_fsm.data.protocol import perplexity, token_windows
    from llmc_fsm.models.known import load_model

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    model, tokenizer = load_model(str(output))
    text = Path(dataset).read_text(encoding="utf-8")
    return perplexity(model, token_windows(tokenizer, text, num_windows=windows, seq_len=256), progress=False)


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:  # internal: python THIS --worker STATS_DIR -- CLI ARGS...
        stats_dir, rest = sys.argv[2], sys.argv[3:]
        sys.exit(worker(stats_dir, rest[1:] if rest[:1] == ["--"] else rest))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dataset", default=str(DEFAULT_DATA))
    parser.add_argument("--control", action="store_true", help="also one process with --batch-size 16")
    parser.add_argument("--eval-windows", type=int, default=40, help="perplexity windows per output (0: none)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cli = ["oneshot", "--dataset", args.dataset, "--threads", "1", "--no-progress"]
    launches = [
        ("1 process", [sys.executable, str(HERE)], ["--batch-size", "8"]),
        (f"{args.nproc} ranks", ["torchrun", "--standalone", f"--nproc-per-node={args.nproc}", str(HERE)],
         ["--batch-size", "8"]),
    ]
    if args.control:
        launches.append(("control", [sys.executable, str(HERE)], ["--batch-size", "16"]))
    with tempfile.TemporaryDirectory(prefix="llmc-fsm-dist-") as tmp:
        root = Path(tmp)
        runs: dict[str, dict] = {}
        for i, (name, launcher, extra) in enumerate(launches):
            stats, out = root / f"stats-{i}", root / f"out-{i}"
            stats.mkdir()
            runs[name] = _launch([*launcher, "--worker", str(stats), "--", *cli, *extra, "--output", str(out)], stats)
            runs[name]["output"] = out
        reference = runs["1 process"]["output"]
        compared = {name: _agreement(reference, r["output"]) for name, r in runs.items() if name != "1 process"}
        ppl = {name: _perplexity(r["output"], args.dataset, args.eval_windows) for name, r in runs.items()} if (
            args.eval_windows
        ) else {}
    result = {
        "runs": {
            name: {k: r[k] for k in ("wall_s", "load_before", "load_after", "ranks")} for name, r in runs.items()
        },
        "compared_with_1_process": compared,
        "perplexity": ppl,
        "report_calibration_line": next(
            (line for line in runs[launches[1][0]]["stdout"].splitlines() if line.startswith("calibration:")), None
        ),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{'run':>10}  {'launch s':>8}  {'rank':>4}  {'wall s':>6}  {'compress s':>10}  {'CPU s':>6}  "
              f"{'max RSS GB':>10}  load")
        for name, r in runs.items():
            for st in r["ranks"]:
                print(
                    f"{name:>10}  {r['wall_s']:>8.1f}  {st['rank']:>4}  {st['wall_s']:>6.1f}  "
                    f"{st['phases_s'].get('compress', float('nan')):>10.1f}  {st['cpu_s']:>6.1f}  "
                    f"{st['max_rss_bytes'] / 1e9:>10.3f}  "
                    f"{'/'.join(r['load_before'][:1] + r['load_after'][:1])}"
                )
        print(json.dumps({"compared_with_1_process": compared, "perplexity": ppl}, indent=2))
        print(result["report_calibration_line"])
    multi = compared[launches[1][0]]
    ok = multi["same_zero_count"] and (
        "control" not in compared
        or multi["mask_disagreement_overall"] <= compared["control"]["mask_disagreement_overall"] * 1.5 + 1e-6
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
