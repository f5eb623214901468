"""Where the seconds of a data-free job go: RTN W8A8 end to end on SmolLM2-135M, profiled in a fresh process.

    python benchmarks/rtn_profile.py                    # this checkout
    python benchmarks/rtn_profile.py --code /old/tree   # another revision of llmc_fsm (PYTHONPATH), for before/after
    python benchmarks/rtn_profile.py --low-memory       # the streamed path
    python benchmarks/rtn_profile.py --cli              # llmc-fsm oneshot --method rtn --scheme W8A8 (its default path)

The worker imports torch, transformers and llmc_fsm (timed: ``imports``), then runs, under ``cProfile``,
``llmc_fsm.oneshot(<smollm2-135m fp32 directory>, QuantizationModifier W8A8, output_dir=<tmp>)``: load the
directory, quantize, save compressed-tensors. The table splits the call's time by the cumulative time of the
functions that do each part (a function's callees count in it, so the parts are made disjoint by subtracting the
nested ones: the tokenizer from the model load, the plugin import from the recipe):

    plugins (entry points)  llmc_fsm.core.registry.load_entry_points (importing the quantization plugin, and
                            with it compressed-tensors)
    model load              llmc_fsm.models.known.load_model / llmc_fsm.models.lazy.load_lazy, less the tokenizer
    tokenizer               transformers' AutoTokenizer.from_pretrained
    fingerprint             llmc_fsm.oneshot_job.resume.fingerprint
    work directory          WorkDir.claim / settle / publish
    rounding                CalibratedModifier._compress_all (observers, rounding, compressed-tensors parameters)
    report                  llmc_fsm.report.build.build_report (sparsity of every weight)
    save                    llmc_fsm.output.save.write_output / the streamed shards' writing
    rest                    the call's time not in the rows above (recipe, session, checks)

cProfile adds its own overhead to every Python call (not to the C++ kernels): the split is meant for where the
time goes, the ``call s (no profiler)`` line (a second fresh process) for how long it takes. Print the load
average: on a shared machine the seconds follow the load, the split much less.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import loadavg, process_seconds, status_kib

RECIPE = {"quantization_stage": {"QuantizationModifier": {"scheme": "W8A8"}}}
#: row -> (path suffix, function name) pairs whose cumulative times add up to the row (first match per pair).
PARTS: dict[str, list[tuple[str, str]]] = {
    "plugins (entry points)": [("llmc_fsm/core/registry.py", "load_entry_points")],
    "model load": [("llmc_fsm/models/known.py", "load_model"), ("llmc_fsm/models/lazy.py", "load_lazy")],
    "tokenizer": [("transformers/models/auto/tokenization_auto.py", "from_pretrained")],
    "fingerprint": [("llmc_fsm/oneshot_job/resume.py", "fingerprint")],
    "work directory": [("llmc_fsm/output/workdir.py", "claim"), ("llmc_fsm/output/workdir.py", "settle"),
                       ("llmc_fsm/output/workdir.py", "publish")],
    "rounding": [("llmc_fsm/toolkit/calibrated.py", "_compress_all")],
    "report": [("llmc_fsm/report/build.py", "build_report")],
    "save": [("llmc_fsm/output/save.py", "write_output"), ("llmc_fsm/models/lazy.py", "write"),
             ("llmc_fsm/models/lazy.py", "finish")],
}
#: row -> rows nested inside it (subtracted).
NESTED = {"model load": ["tokenizer"]}


def _cumulative(stats: pstats.Stats, suffix: str, name: str) -> float:
    total = 0.0
    for (path, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if func == name and path.replace(os.sep, "/").endswith(suffix):
            total += ct
    return total


def worker(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import llmc_fsm
    from llmc_fsm.cli.main import main as cli_main
    from llmc_fsm.models.known import known_model_dir

    imports_s = time.perf_counter() - t0
    model_dir = str(known_model_dir("smollm2-135m"))
    profile = cProfile.Profile() if args.profile else None
    with tempfile.TemporaryDirectory() as tmp:
        t1 = time.perf_counter()
        if profile is not None:
            profile.enable()
        if args.cli:
            out = Path(tmp) / "out"
            status = cli_main(["oneshot", "--model", model_dir, "--method", "rtn", "--scheme", "W8A8",
                               "--output", str(out), "--no-progress"])
            if status:
                raise SystemExit(f"llmc-fsm oneshot exited with {status}")
            phases = json.loads((out / "report.json").read_text())["seconds"]
        else:
            model = llmc_fsm.oneshot(model_dir, RECIPE, output_dir=Path(tmp) / "out", progress=False,
                                     low_memory=args.low_memory)
            phases = model.llmc_fsm_report.seconds
        if profile is not None:
            profile.disable()
        call_s = time.perf_counter() - t1
        e2e_s = process_seconds()
    row: dict[str, Any] = {"imports_s": imports_s, "call_s": call_s, "e2e_s": e2e_s,
                           "peak_rss_bytes": status_kib("VmHWM") * 1024, "phases_s": phases}
    if profile is not None:
        stats = pstats.Stats(profile)
        parts = {row_name: sum(_cumulative(stats, s, f) for s, f in pairs) for row_name, pairs in PARTS.items()}
        for outer, inner in NESTED.items():
            parts[outer] -= sum(parts[i] for i in inner)
        parts["rest"] = call_s - sum(parts.values())
        row["parts_s"] = parts
    return row


def _run(code: str | None, *, profile: bool, low_memory: bool, cli: bool) -> dict[str, Any]:
    env = {**os.environ, "TQDM_DISABLE": "1", "LLMC_FSM_PERPLEXITY_CACHE": "off"}
    if code:
        env["PYTHONPATH"] = os.pathsep.join([code, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--worker", *(["--profile"] if profile else []),
           *(["--low-memory"] if low_memory else []), *(["--cli"] if cli else [])]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", help="run llmc_fsm from this checkout (PYTHONPATH)")
    parser.add_argument("--low-memory", action="store_true")
    parser.add_argument("--cli", action="store_true", help="run llmc-fsm oneshot --method rtn --scheme W8A8 instead")
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    load0 = loadavg()
    profiled = _run(args.code, profile=True, low_memory=args.low_memory, cli=args.cli)
    load1 = loadavg()
    plain = _run(args.code, profile=False, low_memory=args.low_memory, cli=args.cli)
    load2 = loadavg()
    lines = [f"RTN W8A8 end to end{' (low_memory)' if args.low_memory else ''}, code: {args.code or 'this checkout'}",
             f"load average: {load0} -> {load1} (profiled) -> {load2} (plain)", "",
             "| part | s (profiled) | share |", "|---|---:|---:|",
             f"| imports (torch, transformers, llmc_fsm; before the call) | {profiled['imports_s']:.2f} | |"]
    total = profiled["call_s"]
    for name, seconds in profiled["parts_s"].items():
        lines.append(f"| {name} | {seconds:.2f} | {seconds / total:.0%} |")
    lines.append(f"| **oneshot call, profiled** | **{total:.2f}** | 100% |")
    lines.append("")
    lines.append(f"no profiler: e2e (process start -> saved) {plain['e2e_s']:.2f} s; call {plain['call_s']:.2f} s; "
                 f"imports {plain['imports_s']:.2f} s; "
                 f"peak RSS {plain['peak_rss_bytes'] / 1e9:.3f} GB; phases {json.dumps(plain['phases_s'])}")
    if args.json:
        Path(args.json).write_text(json.dumps({"profiled": profiled, "plain": plain,
                                               "load": [load0, load1, load2]}, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
