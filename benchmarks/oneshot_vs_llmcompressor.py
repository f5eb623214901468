"""One-shot SparseGPT, ours vs llmcompressor==0.14.0.1, same model, same data, one run.

    python benchmarks/oneshot_vs_llmcompressor.py                 # ours + peer + variants, print table
    python benchmarks/oneshot_vs_llmcompressor.py --write-docs    # ... and update docs/benchmarks.md
    python benchmarks/oneshot_vs_llmcompressor.py --no-peer       # ours only

Protocol (both sides use ``llmc_fsm/data/protocol.py``): SmolLM2-135M-Instruct (the
``smollm2-135m`` cache of :mod:`llmc_fsm.models.known`), calibration = 32 windows x
256 tokens from the TAIL of ``wiki.test.raw``, evaluation = 40 windows x 256
tokens from its HEAD; SparseGPT 50% unstructured, every Linear except
``lm_head``. Each side runs in its own fresh process (ours in this venv, the
peer in its own venv created by ``benchmarks/_peer.py``), so memory is per
process. "wall" is the compression call alone (``oneshot(...)``), excluding
model loading and perplexity evaluation, on both sides.

Memory protocol (the same on both sides): the fp32 model directory is loaded
with ``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)``; the
process's peak resident set (``VmHWM`` of ``/proc/self/status`` = Linux
``ru_maxrss``) is read right after the compression call — the peak through
load + compression — and again after the pruned perplexity (batch 1 on both
sides): the peak with evaluation. The dense perplexity is measured in separate
processes, so that it does not enter the compression peak. Ours also runs with
``low_memory=True`` (model read from the directory one decoder layer at a time,
output written as it goes, then loaded with ``from_pretrained`` for the
perplexity), and checks that its weights equal the in-memory run's bit for bit.

Variants (ours only, each in a fresh process): dense, magnitude, Wanda,
SparseGPT, and SparseGPT 2:4 perplexities side by side.
"""

from __future__ import annotations

import argparse
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

from _measure import loadavg, status_kib  # benchmarks/_measure.py, beside this script

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA = REPO_ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
DOCS = REPO_ROOT / "docs" / "benchmarks.md"
SECTION = "## One-shot pruning vs llmcompressor"

VARIANTS: dict[str, dict[str, Any] | None] = {
    "dense": None,
    "magnitude 50%": {"MagnitudePruningModifier": {"sparsity": 0.5}},
    "Wanda 50%": {"WandaPruningModifier": {"sparsity": 0.5}},
    "SparseGPT 50%": {"SparseGPTModifier": {"sparsity": 0.5}},
    "SparseGPT 2:4": {"SparseGPTModifier": {"mask_structure": "2:4"}},
}


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- worker (our side)
def _state_sha256(model: Any) -> str:
    """sha256 over the state dict (names and raw bytes, sorted by name): equal iff the weights are bitwise equal."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import llmc_fsm
    from llmc_fsm.data.protocol import load_text, perplexity, token_windows
    from llmc_fsm.models.known import known_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = known_model_dir("smollm2-135m")
    peak = {"imports_rss": status_kib("VmRSS")}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = load_text(args.data)
    calib = token_windows(tokenizer, text, num_windows=args.calib_windows, seq_len=args.seq_len, from_end=True)
    evalw = token_windows(tokenizer, text, num_windows=args.eval_windows, seq_len=args.seq_len)
    modifiers = json.loads(args.recipe)
    for spec in (modifiers or {}).values():
        spec.setdefault("ignore", ["lm_head"])
    dense_ppl = compress_s = None
    if args.low_memory:
        out = Path(tempfile.mkdtemp(prefix="llmc-fsm-bench-")) / "out"
        t0 = time.perf_counter()
        llmc_fsm.oneshot(str(model_dir), {"bench": modifiers}, calib, output_dir=out, batch_size=args.batch_size,
                         progress=False, low_memory=True)
        compress_s = time.perf_counter() - t0
        peak["compress"] = status_kib()
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        shutil.rmtree(out.parent)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # as the peer loads it
        peak["load"] = status_kib()
        dense_ppl = None if args.skip_dense else perplexity(model, evalw, progress=False)
        if modifiers is not None:
            t0 = time.perf_counter()
            llmc_fsm.oneshot(model=model, tokenizer=tokenizer, recipe={"bench": modifiers}, dataset=calib,
                             batch_size=args.batch_size, progress=False)
            compress_s = time.perf_counter() - t0
        peak["compress"] = status_kib()
    pruned_ppl = perplexity(model, evalw, progress=False)
    peak["eval"] = status_kib()
    zeros = total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            zeros += module.weight.numel() - int(torch.count_nonzero(module.weight))
            total += module.weight.numel()
    return {
        "side": "llmc-fsm" + (" low_memory" if args.low_memory else ""),
        "torch_threads": torch.get_num_threads(),
        "dense_ppl": dense_ppl,
        "pruned_ppl": pruned_ppl,
        "compress_wall_s": compress_s,
        "peak_kib": peak,
        "max_rss_kib_after_compress": peak["compress"],
        "max_rss_kib": peak["eval"],
        "weights_sha256": _state_sha256(model),
        "decoder_linear_sparsity": zeros / total,
        "lm_head_sparsity": 1.0 - int(torch.count_nonzero(model.lm_head.weight)) / model.lm_head.weight.numel(),
        "tied_embeddings_after": model.lm_head.weight is model.model.embed_tokens.weight,
    }


def run_ours(
    recipe: dict[str, Any] | None, args: argparse.Namespace, *, skip_dense: bool = False, low_memory: bool = False
) -> dict[str, Any]:
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--worker", "--recipe", json.dumps(recipe),
        "--data", str(args.data), "--calib-windows", str(args.calib_windows), "--eval-windows",
        str(args.eval_windows), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if skip_dense:
        cmd.append("--skip-dense")
    if low_memory:
        cmd.append("--low-memory")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    before = loadavg()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=False)
    if proc.returncode != 0:
        msg = f"our worker failed ({proc.returncode}): {proc.stdout[-2000:]}"
        raise RuntimeError(msg)
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "load": f"{before} -> {loadavg()}"}


def run_peer(args: argparse.Namespace, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _peer import run_peer_script

    from llmc_fsm.models.known import known_model_dir

    model_dir = known_model_dir("smollm2-135m")  # the directory our side loads too
    before = loadavg()
    result = run_peer_script(
        Path(__file__).resolve().parent / "peer_oneshot_llmcompressor.py",
        ["--model", str(model_dir), "--data", str(args.data), "--calib-windows", str(args.calib_windows),
         "--eval-windows", str(args.eval_windows), "--seq-len", str(args.seq_len), "--eval-batch-size", "1",
         *extra],
    )
    return {**result, "load": f"{before} -> {loadavg()}"}


# --------------------------------------------------------------------------- report
def _gb(kib: float) -> float:
    return kib * 1024 / 1e9


def _ratio(a: float | None, b: float | None, fmt: str = ".2f") -> str:
    return format(a / b, fmt) if a is not None and b else ""


def render(
    ours: dict[str, Any],
    low: dict[str, Any] | None,
    peer: dict[str, Any] | None,
    variants: dict[str, float],
    args: argparse.Namespace,
    load: str,
) -> str:
    lines = [
        SECTION,
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()} with {os.cpu_count()} CPU cores "
        f"(torch threads: {ours['torch_threads']}; load average {load}; the machine is shared: memory is robust to "
        "load, times are not — see the load row), `python benchmarks/oneshot_vs_llmcompressor.py --write-docs`. "
        f"SmolLM2-135M-Instruct, SparseGPT 50% unstructured, every Linear except `lm_head`; calibration "
        f"{args.calib_windows} x {args.seq_len} tokens from the tail of `wiki.test.raw`, evaluation "
        f"{args.eval_windows} x {args.seq_len} tokens from its head (same windows and perplexity code on both "
        "sides, batch 1). Both sides load the fp32 directory with `AutoModelForCausalLM.from_pretrained(dir, "
        "dtype=torch.float32)`, each in its own fresh process. Wall = the `oneshot(...)` call alone. Peak RSS = the "
        "process's `VmHWM` (= `ru_maxrss`), read right after the compression call (load + compression) and at the "
        "end (with the pruned perplexity); the dense perplexity runs in separate processes. `low_memory` = ours "
        "with `oneshot(dir, ..., low_memory=True, output_dir=...)` (one decoder layer read at a time, the output "
        "written as it goes; its perplexity from the output reloaded with `from_pretrained`).",
        "",
        "| | llmc-fsm | llmc-fsm low_memory | llmcompressor 0.14.0.1 | ours / theirs | low_memory / theirs "
        "| target |",
        "|---|---|---|---|---|---|---|",
        *_table_rows(ours, low, peer or {}, variants),
    ]
    if (peer or {}).get("fair_pruned_ppl") is not None:
        lines += [
            "",
            "llmcompressor 0.14 prunes the tied `lm_head` (and so `embed_tokens`) although `ignore` names "
            "`lm_head` — its target name for the head does not match the plain string. The same-config row "
            "above is what a user of either tool gets from the same recipe; the last row gives the peer a regex "
            "ignore so that both leave the head dense (a second peer run, which also gives its dense perplexity).",
        ]
    lines += [
        "",
        f"Our process after its imports (torch, transformers, llmc_fsm): {_gb(ours['peak_kib']['imports_rss']):.2f} "
        f"GB; after `from_pretrained`: {_gb(ours['peak_kib']['load']):.2f} GB. Earlier revisions of this table "
        "compared each process's maximum at its end, which mixed in the evaluation with different batches (4 windows "
        "on the peer's side, 1 on ours: 4 x 50 MB of logits against 50 MB); the peak right after the compression call "
        "is the comparable figure.",
        "",
        "The lm_head/embedding sparsity of the dense checkpoint is not 0: the Q4_1 GGUF the weights come from "
        "already holds exact zeros.",
        "",
        "Perplexity by method (ours, same calibration and evaluation windows):",
        "",
        "| method | perplexity |",
        "|---|---|",
    ]
    lines += [f"| {name} | {ppl:.2f} |" for name, ppl in variants.items()]
    return "\n".join(lines) + "\n"


def _table_rows(
    ours: dict[str, Any], low: dict[str, Any] | None, theirs: dict[str, Any], variants: dict[str, float]
) -> list[str]:
    """The comparison table: one column per run (ours in memory, ours low_memory, the peer) and their ratios."""
    mine = low or {}

    def row(label: str, key: str, fmt: str, scale: Any = None, target: str = "") -> str:
        vals = [d.get(key) for d in (ours, mine, theirs)]
        shown = [("" if v is None else format(scale(v) if scale else v, fmt)) for v in vals]
        return (
            f"| {label} | {shown[0] or '-'} | {shown[1] or '-'} | {shown[2] or 'not run'} "
            f"| {_ratio(vals[0], vals[2])} | {_ratio(vals[1], vals[2])} | {target} |"
        )

    rows = [
        row("wall (s)", "compress_wall_s", ".1f", target="<= 0.5"),
        f"| load average at start -> end of the run | {ours.get('load', '')} | {mine.get('load', '')} "
        f"| {theirs.get('load', '')} | | | |",
        row("peak RSS, load + compression (GB)", "max_rss_kib_after_compress", ".2f", _gb, "<= 0.8"),
        row("peak RSS, with evaluation (GB)", "max_rss_kib", ".2f", _gb),
        f"| perplexity dense | {variants['dense']:.2f} | | "
        f"{'-' if theirs.get('dense_ppl') is None else format(theirs['dense_ppl'], '.2f')} | | | |",
        row("perplexity pruned", "pruned_ppl", ".2f", target="<= 1"),
        row("decoder Linear sparsity", "decoder_linear_sparsity", ".4f"),
        row("lm_head / tied embedding sparsity", "lm_head_sparsity", ".4f", target="untouched (ignored)"),
    ]
    if low is not None:
        same = "yes" if low["weights_sha256"] == ours["weights_sha256"] else "NO"
        rows.append(f"| weights bitwise equal to the in-memory run | | {same} | | | | equal |")
    if theirs.get("fair_pruned_ppl") is not None:
        rows.append(
            f"| perplexity pruned, peer with `ignore: ['re:.*lm_head']` (its lm_head sparsity "
            f"{theirs['fair_lm_head_sparsity']:.4f}) | {ours['pruned_ppl']:.2f} | | {theirs['fair_pruned_ppl']:.2f} "
            f"| {ours['pruned_ppl'] / theirs['fair_pruned_ppl']:.3f} | | like-for-like |"
        )
    return rows


def write_docs(section: str) -> None:
    text = DOCS.read_text(encoding="utf-8") if DOCS.exists() else "# Benchmarks\n"
    if SECTION in text:
        start = text.index(SECTION)
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + ("\n" + text[nxt + 1 :] if nxt != -1 else "")  # blank line kept
    else:
        text = text.rstrip("\n") + "\n\n" + section
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    DOCS.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--recipe", default="null", help=argparse.SUPPRESS)
    p.add_argument("--skip-dense", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--calib-windows", type=int, default=32)
    p.add_argument("--eval-windows", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="our calibration batch size")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--no-peer", action="store_true", help="skip llmcompressor")
    p.add_argument("--peer-json", type=Path, help="reuse a peer result (the JSON line the peer script printed)")
    p.add_argument("--no-fair-peer", action="store_true", help="skip the peer run with a regex lm_head ignore")
    p.add_argument("--no-variants", action="store_true", help="skip the magnitude/Wanda/2:4 runs")
    p.add_argument("--no-low-memory", action="store_true", help="skip our low_memory=True run")
    p.add_argument("--low-memory", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--write-docs", action="store_true", help=f"update the section in {DOCS.relative_to(REPO_ROOT)}")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0

    load = loadavg()
    _log(f"load average {load}")
    _log("ours: SparseGPT 50% (in memory)")
    ours = run_ours(VARIANTS["SparseGPT 50%"], args, skip_dense=True)
    _log(f"ours: {json.dumps(ours)}")
    low = None
    if not args.no_low_memory:
        _log("ours: SparseGPT 50% (low_memory)")
        low = run_ours(VARIANTS["SparseGPT 50%"], args, skip_dense=True, low_memory=True)
        _log(f"ours (low_memory): {json.dumps(low)}")
    peer = None
    if args.peer_json is not None:
        peer = json.loads(args.peer_json.read_text().strip().splitlines()[-1])
    elif not args.no_peer:
        _log("peer: llmcompressor SparseGPT 50% (own venv)")
        peer = run_peer(args, ("--skip-dense",))
        _log(f"peer: {json.dumps(peer)}")
        if not args.no_fair_peer:
            # llmcompressor 0.14 prunes the tied lm_head although ignore names "lm_head";
            # a regex ignore leaves it dense, for a like-for-like perplexity (and its dense perplexity).
            _log("peer: llmcompressor SparseGPT 50% with ignore ['re:.*lm_head'] (perplexity only)")
            fair = run_peer(args, ("--ignore", "re:.*lm_head"))
            peer["dense_ppl"] = fair["dense_ppl"]
            peer["fair_pruned_ppl"] = fair["pruned_ppl"]
            peer["fair_lm_head_sparsity"] = fair["lm_head_sparsity"]
            _log(f"peer (fair): {json.dumps(fair)}")
    _log("ours: dense perplexity")
    variants: dict[str, float] = {"dense": run_ours(None, args)["dense_ppl"]}
    for name, recipe in VARIANTS.items():
        if recipe is None:
            continue
        if name == "SparseGPT 50%":
            variants[name] = ours["pruned_ppl"]
        elif not args.no_variants:
            _log(f"ours: {name}")
            variants[name] = run_ours(recipe, args, skip_dense=True)["pruned_ppl"]
    load = f"{load} before the runs, {loadavg()} after"
    section = render(ours, low, peer, variants, args, load)
    print(section)
    if args.write_docs:
        write_docs(section)
        _log(f"updated {DOCS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
