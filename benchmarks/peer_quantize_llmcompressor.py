"""Peer benchmark: llmcompressor GPTQ W4A16 / RTN W8A8 of SmolLM2-135M on CPU, saved compressed and reloaded.

Runs INSIDE the peer venv (see ``benchmarks/_peer.py``), never in ours::

    python benchmarks/_peer.py benchmarks/peer_quantize_llmcompressor.py \\
        --model ~/.cache/llmc_fsm/models/smollm2-135m --data ../shared/data/wikitext-2-raw/wiki.test.raw \\
        --method gptq --group-size 64 --out /tmp/peer-gptq

Same protocol as ``benchmarks/quantize_vs_llmcompressor.py``'s own side: windows
and perplexity from our ``llmc_fsm/data/protocol.py`` (loaded by file path), the model
loaded with ``AutoModelForCausalLM.from_pretrained(dir, dtype=float32)``.
Prints ONE JSON object as the last stdout line: compression wall time, peak RSS
through compression (``VmHWM`` before any evaluation), perplexity in memory and
after reloading the saved checkpoint with transformers, and the weights' size on disk.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from _measure import status_kib  # benchmarks/_measure.py, beside this script

REPO_ROOT = Path(__file__).resolve().parent.parent


def _load_data_module():
    path = REPO_ROOT / "llmc_fsm" / "data" / "protocol.py"
    spec = importlib.util.spec_from_file_location("_llmc_fsm_data", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _recipe(method: str, group_size: int, observer: str):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if method == "gptq":
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
                   "actorder": "static", "observer": observer}
        return GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"])
    return QuantizationModifier(scheme="W8A8", targets=["Linear"], ignore=["lm_head"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--method", choices=["gptq", "rtn"], required=True)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--observer", default="minmax", help="GPTQ weight observer: minmax (default) or mse")
    parser.add_argument("--calib-windows", type=int, default=32)
    parser.add_argument("--eval-windows", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    data = _load_data_module()
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    text = data.load_text(args.data)
    calib = data.token_windows(tokenizer, text, num_windows=args.calib_windows, seq_len=args.seq_len, from_end=True)
    evalw = data.token_windows(tokenizer, text, num_windows=args.eval_windows, seq_len=args.seq_len)
    dataset = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    kwargs = {"dataset": dataset, "num_calibration_samples": args.calib_windows, "max_seq_length": args.seq_len,
              "shuffle_calibration_samples": False} if args.method == "gptq" else {}
    t0 = time.perf_counter()
    recipe = _recipe(args.method, args.group_size, args.observer)
    model = oneshot(model=model, tokenizer=tokenizer, recipe=recipe, **kwargs)
    compress_s = time.perf_counter() - t0
    peak = status_kib("VmHWM") * 1024
    ppl = data.perplexity(model, evalw, progress=False)
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    size = sum(p.stat().st_size for p in Path(args.out).glob("*.safetensors"))
    del model
    reloaded = AutoModelForCausalLM.from_pretrained(args.out).eval()
    ppl_reloaded = data.perplexity(reloaded, evalw, progress=False)
    print(json.dumps({
        "side": "llmcompressor " + __import__("llmcompressor").__version__,
        "method": args.method,
        "observer": args.observer,
        "compress_wall_s": compress_s,
        "peak_rss_through_compression_bytes": peak,
        "ppl": ppl,
        "ppl_reloaded": ppl_reloaded,
        "weights_on_disk_bytes": size,
        "torch_threads": torch.get_num_threads(),
    }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
