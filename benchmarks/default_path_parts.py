"""Where the CLI default path's CPU time goes (issue 26): one job under cProfile with a CPU-time clock, by part.

    OMP_NUM_THREADS=1 python benchmarks/default_path_parts.py --job gptq     # or sparsegpt
    python benchmarks/default_path_parts.py --stats a.prof b.prof           # parts of saved profiles, side by side

The job is ``benchmarks/jobs_vs_llmcompressor.py``'s ``sparsegpt-cli`` / ``gptq-cli`` (``llmc-fsm oneshot --dataset
wiki.test.raw --output OUT`` on SmolLM2-135M, 32 x 256 calibration tokens, no evaluation), run by the CLI's ``main()``
in this process with ``cProfile.Profile(time.process_time)`` from before the first import. It prints the process's
CPU seconds (``getrusage``; with the profiler's own overhead, which weighs most on Python-heavy parts such as
imports), the sha256 of the written ``*.safetensors`` (each file's digest, hashed in name order: one line to compare
before and after a change) and the parts (cumulative CPU seconds of the functions named in ``PARTS``; the layer
forwards are ``compress_layer`` less the modifiers' hooks and compression).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import resource
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
GPTQ = {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 64}}, "actorder": "static"}}
#: part -> the profiled functions (``file:line(name)`` substrings) whose cumulative CPU seconds it sums.
PARTS = {
    "imports (all; inside the parts below)": ["_bootstrap>:1165(_find_and_load)"],
    "plugin discovery (get_registry)": ["registry.py:353(get_registry)"],
    "load (meta model, index, tokenizer)": ["(load_lazy)"],
    "data (tokenize, checks)": ["phases.py:162(token_data)"],
    "outer tensors to shard 1": ["(write_outer)"],
    "capture layer-0 inputs": ["(capture_layer_inputs)"],
    "record_calls (one batch through layer 0)": ["(record_calls)"],
    "Hessian accumulation (add_batch)": ["obs.py:105(add_batch)"],
    "compression (factorise, sweep, results)": ["events.py:283(sequential_epoch_end)"],
    "write layers (measure, format, safetensors)": ["(_write_layer)"],
    "per-layer progress save (resume)": ["resume.py:236(save)"],
    "save + publish": ["streaming.py:387(_save)"],
}


def _cum(stats: dict, patterns: list[str]) -> float:
    return sum(v[3] for (f, line, name), v in stats.items() if any(p in f"{f}:{line}({name})" for p in patterns))


def parts(path: str) -> dict[str, float]:
    """CPU seconds per part of the profile at ``path``."""
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    out = {part: _cum(stats, patterns) for part, patterns in PARTS.items()}
    hooks = _cum(stats, ["calibrated.py:329(hook)"])
    out["layer forwards (compress_layer - hooks - compression)"] = (
        _cum(stats, ["layer.py:91(compress_layer)"]) - hooks - out["compression (factorise, sweep, results)"]
    )
    out["hook overhead (hooks - Hessian)"] = hooks - out["Hessian accumulation (add_batch)"]
    return out


def run(job: str, profile: str) -> dict[str, object]:
    """Run ``job`` profiled; return the CPU seconds and the outputs' digest."""
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    from llmc_fsm.cli.main import main

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        args = ["oneshot", "--output", str(out), "--no-progress", "--dataset", str(DATA)]
        if job == "gptq":
            recipe = Path(tmp) / "recipe.json"
            recipe.write_text(json.dumps({"quantization_stage": GPTQ}))
            args += ["--recipe", str(recipe)]
        status = main(args)
        prof.disable()
        prof.dump_stats(profile)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        digests = "".join(hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.safetensors")))
    return {
        "status": status,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "sha256": hashlib.sha256(digests.encode()).hexdigest(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=["sparsegpt", "gptq"])
    parser.add_argument("--profile", default="default_path.prof", help="where the profile is written")
    parser.add_argument("--stats", nargs="+", help="print the parts of these saved profiles instead of running")
    args = parser.parse_args(argv)
    paths = args.stats or [args.profile]
    if not args.stats:
        if args.job is None:
            parser.error("--job or --stats")
        print(json.dumps(run(args.job, args.profile)))
    table = [parts(p) for p in paths]
    print("| part | " + " | ".join(paths) + " |")
    print("|---|" + "---:|" * len(paths))
    for part in table[0]:
        print(f"| {part} | " + " | ".join(f"{t[part]:.2f}" for t in table) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
