"""Peer benchmark: llmcompressor SparseGPT one-shot pruning of SmolLM2-135M on CPU.

Runs INSIDE the peer venv (see ``benchmarks/_peer.py``), never in ours::

    python benchmarks/_peer.py benchmarks/peer_oneshot_llmcompressor.py \\
        --model ~/.cache/llmc_fsm/models/smollm2-135m \\
        --data ../shared/data/wikitext-2-raw/wiki.test.raw

Protocol (identical to ours, because the windows and the perplexity come from
our own ``llmc_fsm/data/protocol.py``, loaded by file path so the rest of our package
and its dependencies are not needed here):

* calibration: ``--calib-windows`` x ``--seq-len`` tokens from the TAIL of the text;
* evaluation: ``--eval-windows`` x ``--seq-len`` tokens from the HEAD;
* dense perplexity, then ``oneshot(SparseGPTModifier(...))`` timed on its own,
  then pruned perplexity.

Prints progress on stderr and ONE JSON object as the last stdout line:
dense/pruned perplexity, compression wall time (s), max RSS (KiB, Linux
``ru_maxrss``) after loading, after compression and at the end, and the
measured sparsity of the decoder Linear layers and of lm_head / embeddings
(they are one tensor when tied).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def _load_data_module():
    path = REPO_ROOT / "llmc_fsm" / "data" / "protocol.py"
    spec = importlib.util.spec_from_file_location("_llmc_fsm_data", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _log(msg: str) -> None:
    print(f"[peer-oneshot] {msg}", file=sys.stderr, flush=True)


def _sparsity(weight: torch.Tensor) -> float:
    return 1.0 - int(torch.count_nonzero(weight)) / weight.numel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF-layout model directory (from llmc_fsm load_model cache)")
    parser.add_argument("--data", required=True, help="text file (wiki.test.raw)")
    parser.add_argument("--calib-windows", type=int, default=32)
    parser.add_argument("--eval-windows", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--mask-structure", default="unstructured", help='"unstructured" or N:M such as "2:4"')
    parser.add_argument("--ignore", nargs="*", default=["lm_head"], help="module names SparseGPT must skip")
    parser.add_argument("--eval-batch-size", type=int, default=4)
    parser.add_argument("--skip-dense", action="store_true", help="do not measure the dense perplexity")
    args = parser.parse_args(argv)

    mask_structure = "0:0" if args.mask_structure == "unstructured" else args.mask_structure

    data = _load_data_module()
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.pruning import SparseGPTModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    _log(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s")
    tied = model.lm_head.weight is model.model.embed_tokens.weight

    text = data.load_text(args.data)
    calib = data.token_windows(tokenizer, text, num_windows=args.calib_windows, seq_len=args.seq_len, from_end=True)
    evalw = data.token_windows(tokenizer, text, num_windows=args.eval_windows, seq_len=args.seq_len)
    rss_loaded = _maxrss_kib()

    dense_ppl = None
    dense_eval_s = None
    if not args.skip_dense:
        t0 = time.perf_counter()
        dense_ppl = data.perplexity(model, evalw, batch_size=args.eval_batch_size, progress=False)
        dense_eval_s = time.perf_counter() - t0
        _log(f"dense perplexity {dense_ppl:.4f} ({dense_eval_s:.1f} s)")
    rss_before = _maxrss_kib()

    calib_ds = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    recipe = SparseGPTModifier(
        sparsity=args.sparsity,
        mask_structure=mask_structure,
        targets=["Linear"],
        ignore=list(args.ignore),
    )
    _log(f"oneshot SparseGPT sparsity={args.sparsity} mask={mask_structure} ignore={args.ignore}")
    t0 = time.perf_counter()
    model = oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=calib_ds,
        recipe=recipe,
        num_calibration_samples=args.calib_windows,
        max_seq_length=args.seq_len,
        shuffle_calibration_samples=False,
    )
    compress_s = time.perf_counter() - t0
    rss_compress = _maxrss_kib()
    _log(f"oneshot took {compress_s:.1f} s; max RSS {rss_compress / 1024:.0f} MiB")

    t0 = time.perf_counter()
    pruned_ppl = data.perplexity(model, evalw, batch_size=args.eval_batch_size, progress=False)
    pruned_eval_s = time.perf_counter() - t0
    _log(f"pruned perplexity {pruned_ppl:.4f} ({pruned_eval_s:.1f} s)")

    layer_zeros = 0
    layer_total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            layer_zeros += module.weight.numel() - int(torch.count_nonzero(module.weight))
            layer_total += module.weight.numel()

    result = {
        "peer": "llmcompressor",
        "llmcompressor_version": __import__("llmcompressor").__version__,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "model": str(args.model),
        "tied_embeddings_before": tied,
        "sparsity_target": args.sparsity,
        "mask_structure": args.mask_structure,
        "ignore": list(args.ignore),
        "calib_windows": args.calib_windows,
        "eval_windows": args.eval_windows,
        "seq_len": args.seq_len,
        "dense_ppl": dense_ppl,
        "pruned_ppl": pruned_ppl,
        "compress_wall_s": compress_s,
        "dense_eval_s": dense_eval_s,
        "pruned_eval_s": pruned_eval_s,
        "max_rss_kib_after_load": rss_loaded,
        "max_rss_kib_before_compress": rss_before,
        "max_rss_kib_after_compress": rss_compress,
        "max_rss_kib": _maxrss_kib(),
        "decoder_linear_sparsity": layer_zeros / layer_total if layer_total else None,
        "lm_head_sparsity": _sparsity(model.lm_head.weight),
        "embed_tokens_sparsity": _sparsity(model.model.embed_tokens.weight),
        "tied_embeddings_after": model.lm_head.weight is model.model.embed_tokens.weight,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
