"""One-shot quantization, ours vs llmcompressor==0.14.0.1: same model files, same windows, same perplexity code.

    python benchmarks/quantize_vs_llmcompressor.py                 # both sides, print the table
    python benchmarks/quantize_vs_llmcompressor.py --write-docs    # ... and update docs/benchmarks.md
    python benchmarks/quantize_vs_llmcompressor.py --no-peer       # ours only

Protocol: SmolLM2-135M-Instruct (the ``smollm2-135m`` cache directory of
:mod:`llmc_fsm.models.known`, loaded on both sides with
``AutoModelForCausalLM.from_pretrained(dir, dtype=float32)``); calibration 32 x
256 tokens from the TAIL of ``wiki.test.raw``, perplexity on 40 x 256 tokens
from its HEAD (``llmc_fsm/data/protocol.py`` on both sides). Runs: GPTQ W4A16 (int4,
group 64, symmetric, actorder static — SmolLM2's width 576 is not a multiple of
128), the same with the ``mse`` weight observer on both sides, and RTN W8A8
(int8 per-channel weights, dynamic per-token int8 activations; data-free on
both sides), each side in a fresh process. "wall" is the compression call
alone; "peak RSS" is ``VmHWM`` right after compression, before any evaluation.
Each side saves its compressed checkpoint, reloads it with transformers and
measures perplexity again. Ours also runs GPTQ W4A16 with ``low_memory=True``
(``oneshot(dir, ..., low_memory=True, output_dir=...)``: the model read from the
same directory one decoder layer at a time, the compressed checkpoint written
inside the timed call; its perplexity from that checkpoint reloaded), and
SparseGPT 2:4 + GPTQ W4A16 with the two stages fused in one layer-by-layer pass
and as two passes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _measure import loadavg, status_kib  # benchmarks/_measure.py, beside this script

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA = REPO_ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
DOCS = REPO_ROOT / "docs" / "benchmarks.md"
SECTION = "## One-shot quantization vs llmcompressor"
GPTQ_W4 = {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 64}}, "actorder": "static"}}
GPTQ_W4_MSE = {"GPTQModifier": {**GPTQ_W4["GPTQModifier"], "observer": "mse"}}
RECIPES: dict[str, dict[str, Any]] = {
    "gptq": {"quantization_stage": GPTQ_W4},
    "gptq-mse": {"quantization_stage": GPTQ_W4_MSE},
    "rtn": {"quantization_stage": {"QuantizationModifier": {"scheme": "W8A8"}}},
    "2:4+gptq": {
        "sparsity_stage": {"SparseGPTModifier": {"mask_structure": "2:4"}},
        "quantization_stage": GPTQ_W4,
    },
}


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Our side, in a fresh process: load, compress (timed), perplexity, save, reload, perplexity."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import llmc_fsm
    from llmc_fsm.data.protocol import load_text, perplexity, token_windows
    from llmc_fsm.output.save import save_model

    if args.low_memory:
        return low_memory_worker(args)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    text = load_text(DATA)
    calib = token_windows(tokenizer, text, num_windows=32, seq_len=256, from_end=True)
    evalw = token_windows(tokenizer, text, num_windows=40, seq_len=256)
    t0 = time.perf_counter()
    llmc_fsm.oneshot(model=model, recipe=RECIPES[args.run], dataset=calib, progress=False,
                     fuse_stages=not args.separate)
    compress_s = time.perf_counter() - t0
    peak = status_kib("VmHWM") * 1024
    result: dict[str, Any] = {"side": "llmc-fsm", "run": args.run, "separate": args.separate,
                              "compress_wall_s": compress_s, "peak_rss_through_compression_bytes": peak}
    result["ppl"] = perplexity(model, evalw, progress=False)
    with tempfile.TemporaryDirectory() as out:
        save_model(model, Path(out))
        result["weights_on_disk_bytes"] = sum(p.stat().st_size for p in Path(out).glob("*.safetensors"))
        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
        result["ppl_reloaded"] = perplexity(reloaded, evalw, progress=False)
    result["torch_threads"] = torch.get_num_threads()
    return result


def low_memory_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Ours with ``low_memory=True``: the model read from the directory one decoder layer at a time and the
    compressed checkpoint written as it goes (inside the timed call); perplexity from that checkpoint reloaded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import llmc_fsm
    from llmc_fsm.data.protocol import load_text, perplexity, token_windows

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    text = load_text(DATA)
    calib = token_windows(tokenizer, text, num_windows=32, seq_len=256, from_end=True)
    evalw = token_windows(tokenizer, text, num_windows=40, seq_len=256)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        t0 = time.perf_counter()
        llmc_fsm.oneshot(args.model_dir, recipe=RECIPES[args.run], dataset=calib, progress=False, low_memory=True,
                         output_dir=out)
        compress_s = time.perf_counter() - t0
        peak = status_kib("VmHWM") * 1024
        disk = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
        ppl = perplexity(reloaded, evalw, progress=False)
    return {"side": "llmc-fsm low_memory", "run": args.run, "separate": False, "compress_wall_s": compress_s,
            "peak_rss_through_compression_bytes": peak, "ppl": ppl, "ppl_reloaded": ppl,
            "weights_on_disk_bytes": disk, "torch_threads": torch.get_num_threads()}


def dense_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmc_fsm.data.protocol import load_text, perplexity, token_windows

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    evalw = token_windows(tokenizer, load_text(DATA), num_windows=40, seq_len=256)
    fp32 = sum(m.weight.numel() * 4 for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head")
    return {"dense_ppl": perplexity(model, evalw, progress=False), "fp32_quantized_weight_bytes": fp32}


def _run_self(extra: list[str], model_dir: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", "--model-dir", model_dir, *extra]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_peer(run: str, model_dir: str) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from _peer import run_peer_script

    method, _, observer = run.partition("-")
    with tempfile.TemporaryDirectory() as out:
        return run_peer_script(Path(__file__).parent / "peer_quantize_llmcompressor.py",
                               ["--model", model_dir, "--data", str(DATA), "--method", method, "--out", out,
                                "--observer", observer or "minmax"])


def render(dense: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        SECTION, "",
        f"Measured {time.strftime('%Y-%m-%d')} by `python benchmarks/quantize_vs_llmcompressor.py` on a 2-core "
        "CPU machine, nothing else running (load average per run in the table), SmolLM2-135M-Instruct fp32, "
        "calibration 32 x 256 tokens (tail of wiki.test.raw), perplexity on 40 x 256 tokens (head), same windows "
        f"and perplexity code on both sides. Dense perplexity {dense['dense_ppl']:.2f}; the quantized Linear "
        f"weights take {dense['fp32_quantized_weight_bytes'] / 1e6:.0f} MB in fp32. `(low_memory)`: ours with "
        "`oneshot(dir, ..., low_memory=True, output_dir=...)`, the model read from the same directory one decoder "
        "layer at a time; its wall includes writing the checkpoint, and its perplexity is the reloaded "
        "checkpoint's.", "",
        "| run | side | wall (s) | peak RSS through compression (GB) | perplexity | reloaded perplexity | "
        "weights on disk (MB) | load average |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["run"] + (" (two passes)" if r.get("separate") else "") + (
            " (low_memory)" if "low_memory" in r["side"] else "")
        lines.append(
            f"| {name} | {r['side']} | {r['compress_wall_s']:.1f} "
            f"| {r['peak_rss_through_compression_bytes'] / 1e9:.2f} "
            f"| {r['ppl']:.2f} | {r['ppl_reloaded']:.2f} | {r['weights_on_disk_bytes'] / 1e6:.0f} | {r['load']} |"
        )
    lines.append("")
    for method, side in (("gptq", "llmc-fsm"), ("gptq", "llmc-fsm low_memory"), ("gptq-mse", "llmc-fsm"),
                         ("rtn", "llmc-fsm")):
        ours = next((r for r in rows if r["run"] == method and r["side"] == side), None)
        peer = next((r for r in rows if r["run"] == method and not r["side"].startswith("llmc-fsm")), None)
        if ours and peer:
            lines.append(
                f"- {method}{' low_memory' if 'low_memory' in side else ''}: wall "
                f"{ours['compress_wall_s'] / peer['compress_wall_s']:.2f}x, peak RSS "
                f"{ours['peak_rss_through_compression_bytes'] / peer['peak_rss_through_compression_bytes']:.2f}x, "
                f"perplexity {ours['ppl']:.2f} vs {peer['ppl']:.2f} (ours / llmcompressor)."
            )
    return "\n".join(lines) + "\n"


def write_docs(section: str, heading: str = SECTION) -> None:
    """Replace the section of docs/benchmarks.md that starts with ``heading`` by ``section`` (or append it)."""
    text = DOCS.read_text(encoding="utf-8") if DOCS.exists() else "# Benchmarks\n"
    start = text.find(heading)
    if start >= 0:
        end = text.find("\n## ", start + len(heading))
        text = text[:start] + section + (text[end + 1 :] if end >= 0 else "")
    else:
        text = text.rstrip() + "\n\n" + section
    DOCS.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dense", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run", choices=list(RECIPES), help=argparse.SUPPRESS)
    parser.add_argument("--separate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--low-memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument(
        "--only", nargs="*", help="run only these: gptq gptq-low-memory gptq-mse rtn fused separate (default: all)"
    )
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(dense_worker(args) if args.dense else worker(args)), flush=True)
        return 0
    from llmc_fsm.models.known import load_model

    model, _ = load_model("smollm2-135m")  # builds the cache directory once
    model_dir = str(model.name_or_path)
    del model
    _log(f"model directory {model_dir}; load average {os.getloadavg()}")
    only = set(args.only or ["gptq", "gptq-low-memory", "gptq-mse", "rtn", "fused", "separate"])
    dense = _run_self(["--dense"], model_dir)
    rows = []
    for run, separate, key in (("gptq", False, "gptq"), ("gptq-mse", False, "gptq-mse"), ("rtn", False, "rtn"),
                               ("2:4+gptq", False, "fused"), ("2:4+gptq", True, "separate")):
        if key in only:
            _log(f"ours: {run}{' (two passes)' if separate else ''}")
            load = loadavg()
            row = _run_self(["--run", run, *(["--separate"] if separate else [])], model_dir)
            rows.append({**row, "load": f"{load} -> {loadavg()}"})
        if key == "gptq" and "gptq-low-memory" in only:
            _log("ours: gptq (low_memory)")
            load = loadavg()
            row = _run_self(["--run", "gptq", "--low-memory"], model_dir)
            rows.append({**row, "load": f"{load} -> {loadavg()}"})
        if key in ("gptq", "gptq-mse", "rtn") and key in only and not args.no_peer:
            _log(f"peer: {key}")
            load = loadavg()
            row = _run_peer(key, model_dir)
            rows.append({**row, "run": key, "load": f"{load} -> {loadavg()}"})
    if args.json:
        Path(args.json).write_text(json.dumps({"dense": dense, "rows": rows}, indent=2))
    section = render(dense, rows)
    print(section)
    if args.write_docs:
        write_docs(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
