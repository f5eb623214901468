"""Peer side of ``benchmarks/jobs_vs_llmcompressor.py``: one of issue 26's jobs with llmcompressor 0.14, end to end.

Runs INSIDE the peer venv (see ``benchmarks/_peer.py``), never in ours, one job per fresh process::

    python benchmarks/_peer.py benchmarks/peer_jobs_llmcompressor.py --job gptq \\
        --model ~/.cache/llmc_fsm/models/smollm2-135m --data ../shared/data/wikitext-2-raw/wiki.test.raw \\
        --out /tmp/peer-gptq

What a user of llm-compressor writes for the job, in this order, measured as our side is measured
(``benchmarks/jobs_vs_llmcompressor.py``, worker):

1. imports (``llmcompressor``, ``transformers``, ``datasets``);
2. ``AutoModelForCausalLM.from_pretrained(dir, dtype=float32)`` and its tokenizer;
3. calibrated jobs: ``--calib-windows`` x ``--seq-len`` tokens from the tail of the text, tokenized with our
   ``llmc_fsm/data/protocol.py`` (loaded by file path), as a ``datasets.Dataset``;
4. ``oneshot(model=..., recipe=..., ...)`` — timed alone: ``call_s``;
5. ``model.save_pretrained(out, save_compressed=True)`` and ``tokenizer.save_pretrained(out)``;
6. right then: ``e2e_s`` = wall seconds from the process's start (``/proc``, before the interpreter imported
   anything; :func:`_measure.process_seconds`) and ``peak_rss_bytes`` = ``VmHWM``;
7. only after that, with ``--eval-windows`` > 0: the saved checkpoint reloaded with ``from_pretrained`` and its
   perplexity on the head of the text (our protocol's ``perplexity``, batch 1).

Jobs: ``rtn`` (``QuantizationModifier(scheme="W8A8")``, no data), ``sparsegpt`` (``SparseGPTModifier`` 50%
unstructured), ``gptq`` (``GPTQModifier`` W4A16 group 64, ``actorder="static"``, minmax observer), every Linear but
``lm_head``. Prints ONE JSON object as the last stdout line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

from _measure import process_seconds, status_kib  # benchmarks/_measure.py, beside this script

REPO_ROOT = Path(__file__).resolve().parent.parent
JOBS = ("rtn", "sparsegpt", "gptq")


def _load_data_module():
    path = REPO_ROOT / "llmc_fsm" / "data" / "protocol.py"
    spec = importlib.util.spec_from_file_location("_llmc_fsm_data", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _recipe(job: str, group_size: int):
    if job == "sparsegpt":
        from llmcompressor.modifiers.pruning import SparseGPTModifier

        return SparseGPTModifier(sparsity=0.5, mask_structure="0:0", targets=["Linear"], ignore=["lm_head"])
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if job == "gptq":
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
                   "actorder": "static", "observer": "minmax"}
        return GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"])
    return QuantizationModifier(scheme="W8A8", targets=["Linear"], ignore=["lm_head"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=JOBS, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", help="output directory (default: a temporary one, removed at the end)")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--calib-windows", type=int, default=32)
    parser.add_argument("--eval-windows", type=int, default=40, help="0: no perplexity")
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args(argv)

    import torch

    data = _load_data_module()
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    imports_s = process_seconds()
    rss_imports = status_kib("VmRSS") * 1024
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or Path(tmp) / "out")
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        rss_loaded = status_kib("VmRSS") * 1024
        kwargs = {}
        text = data.load_text(args.data) if args.job != "rtn" or args.eval_windows else None
        if args.job != "rtn":
            calib = data.token_windows(tokenizer, text, num_windows=args.calib_windows, seq_len=args.seq_len,
                                       from_end=True)
            dataset = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
            kwargs = {"dataset": dataset, "num_calibration_samples": args.calib_windows,
                      "max_seq_length": args.seq_len, "shuffle_calibration_samples": False}
        t0 = time.perf_counter()
        model = oneshot(model=model, tokenizer=tokenizer, recipe=_recipe(args.job, args.group_size), **kwargs)
        call_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        model.save_pretrained(out, save_compressed=True)
        tokenizer.save_pretrained(out)
        save_s = time.perf_counter() - t1
        e2e_s = process_seconds()
        peak = status_kib("VmHWM") * 1024
        usage = resource.getrusage(resource.RUSAGE_SELF)
        size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        del model
        ppl = None
        if args.eval_windows:
            evalw = data.token_windows(tokenizer, text, num_windows=args.eval_windows, seq_len=args.seq_len)
            reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
            ppl = data.perplexity(reloaded, evalw, progress=False)
    print(json.dumps({
        "side": "llmcompressor " + __import__("llmcompressor").__version__,
        "job": args.job,
        "e2e_s": e2e_s,
        "imports_s": imports_s,
        "call_s": call_s,
        "save_s": save_s,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_bytes": peak,
        "rss_after_imports_bytes": rss_imports,
        "rss_after_load_bytes": rss_loaded,
        "ppl": ppl,
        "weights_on_disk_bytes": size,
        "torch_threads": torch.get_num_threads(),
    }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
