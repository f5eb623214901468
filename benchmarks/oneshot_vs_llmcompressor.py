"""One-shot SparseGPT, ours vs llmcompressor==0.14.0.1, same model, same data, one run.

    python benchmarks/oneshot_vs_llmcompressor.py                 # ours + peer + variants, print table
    python benchmarks/oneshot_vs_llmcompressor.py --write-docs    # ... and update docs/benchmarks.md
    python benchmarks/oneshot_vs_llmcompressor.py --no-peer       # ours only

Protocol (both sides use ``llmc_fsm/data.py``): SmolLM2-135M-Instruct (the
``smollm2-135m`` cache of :mod:`llmc_fsm.models`), calibration = 32 windows x
256 tokens from the TAIL of ``wiki.test.raw``, evaluation = 40 windows x 256
tokens from its HEAD; SparseGPT 50% unstructured, every Linear except
``lm_head``. Each side runs in its own fresh process (ours in this venv, the
peer in its own venv created by ``benchmarks/_peer.py``), so max RSS is per
process. "wall" is the compression call alone (``oneshot(...)``), excluding
model loading and perplexity evaluation, on both sides.

Variants (ours only, each in a fresh process): dense, magnitude, Wanda,
SparseGPT, and SparseGPT 2:4 perplexities side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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
def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import llmc_fsm
    from llmc_fsm.data import load_text, perplexity, token_windows
    from llmc_fsm.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2-135m")
    text = load_text(args.data)
    calib = token_windows(tokenizer, text, num_windows=args.calib_windows, seq_len=args.seq_len, from_end=True)
    evalw = token_windows(tokenizer, text, num_windows=args.eval_windows, seq_len=args.seq_len)
    dense_ppl = None if args.skip_dense else perplexity(model, evalw, progress=False)
    modifiers = json.loads(args.recipe)
    compress_s = None
    if modifiers is not None:
        for spec in modifiers.values():
            spec.setdefault("ignore", ["lm_head"])
        t0 = time.perf_counter()
        llmc_fsm.oneshot(
            model=model,
            tokenizer=tokenizer,
            recipe={"bench": modifiers},
            dataset=calib,
            batch_size=args.batch_size,
            progress=False,
        )
        compress_s = time.perf_counter() - t0
    rss_compress = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    pruned_ppl = perplexity(model, evalw, progress=False)
    zeros = total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            zeros += module.weight.numel() - int(torch.count_nonzero(module.weight))
            total += module.weight.numel()
    return {
        "side": "llmc-fsm",
        "torch_threads": torch.get_num_threads(),
        "dense_ppl": dense_ppl,
        "pruned_ppl": pruned_ppl,
        "compress_wall_s": compress_s,
        "max_rss_kib_after_compress": rss_compress,
        "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "decoder_linear_sparsity": zeros / total,
        "lm_head_sparsity": 1.0 - int(torch.count_nonzero(model.lm_head.weight)) / model.lm_head.weight.numel(),
        "tied_embeddings_after": model.lm_head.weight is model.model.embed_tokens.weight,
    }


def run_ours(recipe: dict[str, Any] | None, args: argparse.Namespace, *, skip_dense: bool = False) -> dict[str, Any]:
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--worker", "--recipe", json.dumps(recipe),
        "--data", str(args.data), "--calib-windows", str(args.calib_windows), "--eval-windows",
        str(args.eval_windows), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if skip_dense:
        cmd.append("--skip-dense")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=False)
    if proc.returncode != 0:
        msg = f"our worker failed ({proc.returncode}): {proc.stdout[-2000:]}"
        raise RuntimeError(msg)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_peer(args: argparse.Namespace, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _peer import run_peer_script

    from llmc_fsm.models import cache_root

    model_dir = cache_root() / "models" / "smollm2-135m"
    if not model_dir.is_dir():
        from llmc_fsm.models import load_model

        load_model("smollm2-135m")
    return run_peer_script(
        Path(__file__).resolve().parent / "peer_oneshot_llmcompressor.py",
        ["--model", str(model_dir), "--data", str(args.data), "--calib-windows", str(args.calib_windows),
         "--eval-windows", str(args.eval_windows), "--seq-len", str(args.seq_len), *extra],
    )


# --------------------------------------------------------------------------- report
def _gb(kib: float) -> float:
    return kib * 1024 / 1e9


def render(
    ours: dict[str, Any], peer: dict[str, Any] | None, variants: dict[str, float], args: argparse.Namespace
) -> str:
    lines = [
        SECTION,
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()} with {os.cpu_count()} CPU cores "
        f"(torch threads: {ours['torch_threads']}), `python benchmarks/oneshot_vs_llmcompressor.py --write-docs`. "
        f"SmolLM2-135M-Instruct, SparseGPT 50% unstructured, every Linear except `lm_head`; calibration "
        f"{args.calib_windows} x {args.seq_len} tokens from the tail of `wiki.test.raw`, evaluation "
        f"{args.eval_windows} x {args.seq_len} tokens from its head (same windows and perplexity code on both "
        "sides). Wall = the `oneshot(...)` call alone; max RSS = peak of each side's own process.",
        "",
        "| | llmc-fsm | llmcompressor 0.14.0.1 | ratio (ours / theirs) | target |",
        "|---|---|---|---|---|",
    ]
    if peer is not None:
        wall_r = ours["compress_wall_s"] / peer["compress_wall_s"]
        rss_r = ours["max_rss_kib"] / peer["max_rss_kib"]
        ppl_r = ours["pruned_ppl"] / peer["pruned_ppl"]
        lines += [
            f"| wall (s) | {ours['compress_wall_s']:.1f} | {peer['compress_wall_s']:.1f} | {wall_r:.2f} | <= 0.5 |",
            f"| max RSS (GB) | {_gb(ours['max_rss_kib']):.2f} | {_gb(peer['max_rss_kib']):.2f} | {rss_r:.2f} "
            "| <= 0.8 |",
            f"| perplexity dense | {ours['dense_ppl']:.2f} | {peer['dense_ppl']:.2f} | | |",
            f"| perplexity pruned | {ours['pruned_ppl']:.2f} | {peer['pruned_ppl']:.2f} | {ppl_r:.3f} | <= 1 |",
            f"| decoder Linear sparsity | {ours['decoder_linear_sparsity']:.4f} | "
            f"{peer['decoder_linear_sparsity']:.4f} | | |",
            f"| lm_head / tied embedding sparsity | {ours['lm_head_sparsity']:.4f} | {peer['lm_head_sparsity']:.4f} "
            "| | untouched (ignored) |",
        ]
        if peer.get("fair_pruned_ppl") is not None:
            fair_r = ours["pruned_ppl"] / peer["fair_pruned_ppl"]
            lines += [
                f"| perplexity pruned, peer with `ignore: ['re:.*lm_head']` (its lm_head sparsity "
                f"{peer['fair_lm_head_sparsity']:.4f}) | {ours['pruned_ppl']:.2f} | {peer['fair_pruned_ppl']:.2f} "
                f"| {fair_r:.3f} | like-for-like |",
            ]
            lines += [
                "",
                "llmcompressor 0.14 prunes the tied `lm_head` (and so `embed_tokens`) although `ignore` names "
                "`lm_head` — its target name for the head does not match the plain string. The same-config row "
                "above is what a user of either tool gets from the same recipe; the last row gives the peer a regex "
                "ignore so that both leave the head dense (a second peer run, perplexity only).",
            ]
    else:
        lines += [
            f"| wall (s) | {ours['compress_wall_s']:.1f} | not run | | |",
            f"| max RSS (GB) | {_gb(ours['max_rss_kib']):.2f} | not run | | |",
            f"| perplexity pruned | {ours['pruned_ppl']:.2f} | not run | | |",
        ]
    lines += [
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


def write_docs(section: str) -> None:
    text = DOCS.read_text(encoding="utf-8") if DOCS.exists() else "# Benchmarks\n"
    if SECTION in text:
        start = text.index(SECTION)
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + (text[nxt + 1 :] if nxt != -1 else "")
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
    p.add_argument("--no-variants", action="store_true", help="skip the dense/magnitude/Wanda/2:4 runs")
    p.add_argument("--write-docs", action="store_true", help=f"update the section in {DOCS.relative_to(REPO_ROOT)}")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0

    _log("ours: SparseGPT 50%")
    ours = run_ours(VARIANTS["SparseGPT 50%"], args)
    _log(f"ours: {json.dumps(ours)}")
    peer = None
    if args.peer_json is not None:
        peer = json.loads(args.peer_json.read_text().strip().splitlines()[-1])
    elif not args.no_peer:
        _log("peer: llmcompressor SparseGPT 50% (own venv)")
        peer = run_peer(args)
        _log(f"peer: {json.dumps(peer)}")
        if not args.no_fair_peer:
            # llmcompressor 0.14 prunes the tied lm_head although ignore names "lm_head";
            # a regex ignore leaves it dense, for a like-for-like perplexity.
            _log("peer: llmcompressor SparseGPT 50% with ignore ['re:.*lm_head'] (perplexity only)")
            fair = run_peer(args, ("--ignore", "re:.*lm_head", "--skip-dense"))
            peer["fair_pruned_ppl"] = fair["pruned_ppl"]
            peer["fair_lm_head_sparsity"] = fair["lm_head_sparsity"]
            _log(f"peer (fair): {json.dumps(fair)}")
    variants: dict[str, float] = {"dense": ours["dense_ppl"]}
    if not args.no_variants:
        for name, recipe in VARIANTS.items():
            if recipe is None:
                continue
            if name == "SparseGPT 50%":
                variants[name] = ours["pruned_ppl"]
                continue
            _log(f"ours: {name}")
            variants[name] = run_ours(recipe, args, skip_dense=True)["pruned_ppl"]
    else:
        variants["SparseGPT 50%"] = ours["pruned_ppl"]
    section = render(ours, peer, variants, args)
    print(section)
    if args.write_docs:
        write_docs(section)
        _log(f"updated {DOCS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
