"""Peer benchmark: one llm-compressor recipe (YAML text) run by llmcompressor's ``oneshot`` on SmolLM2-135M, CPU.

Runs INSIDE the peer venv (see ``benchmarks/_peer.py``), never in ours; ``benchmarks/recipes_vs_llmcompressor.py``
calls it once per job, in a fresh process::

    python benchmarks/_peer.py benchmarks/peer_recipe_llmcompressor.py --model DIR --data wiki.test.raw \\
        --recipe-file recipe.yaml --with-data --out /tmp/peer-out

Same protocol as ours (``llmc_fsm/data/protocol.py``, loaded by file path): the model loaded with
``AutoModelForCausalLM.from_pretrained(dir, dtype=...)`` (on a machine without an accelerator, one no-op shim:
:func:`_cpu_shims`), calibration windows from the tail of the text (passed to
``oneshot`` only with ``--with-data``: a data-free recipe is run as llm-compressor's examples run it, without a
dataset), evaluation windows from the head. Prints ONE JSON object as the last stdout line: the ``oneshot`` call's
wall time, the process's wall and CPU time, peak RSS (``VmHWM``) right after the call, perplexity in memory and
after saving compressed and reloading with transformers — or ``error`` / ``reload_error``: the first line of the
exception, when the call or the reload failed (the script then still exits 0 so the caller reads the row).
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from _measure import for_eval, status_kib  # noqa: E402  (benchmarks/_measure.py, beside this script)
from peer_quantize_llmcompressor import _load_data_module  # noqa: E402


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def _cpu_shims() -> list[str]:
    """Make llmcompressor 0.14 run on a machine without an accelerator; returns what was changed (for the row).

    Its ``AWQModifier`` pins the cached layer inputs (``IntermediatesCache.pin_memory``, a host-to-device transfer
    optimisation), and ``Tensor.pin_memory`` raises ``RuntimeError: Cannot access accelerator device when none is
    available`` on a CPU-only torch. Pinning changes no value, so it is skipped there.
    """
    if torch.accelerator.is_available():
        return []
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    return ["IntermediatesCache.pin_memory skipped (no accelerator)"]


def run(args: argparse.Namespace) -> dict:
    import llmcompressor
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = _load_data_module()
    row: dict = {"side": "llmcompressor " + llmcompressor.__version__, "cpu_shims": _cpu_shims()}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    text = data.load_text(args.data)
    kwargs = {}
    if args.with_data:
        calib = data.token_windows(tokenizer, text, num_windows=args.calib_samples, seq_len=args.seq_len,
                                   from_end=True)
        kwargs = {"dataset": Dataset.from_dict({"input_ids": calib.tolist(),
                                                "attention_mask": torch.ones_like(calib).tolist()}),
                  "num_calibration_samples": args.calib_samples, "max_seq_length": args.seq_len,
                  "shuffle_calibration_samples": False}
    recipe = Path(args.recipe_file).read_text(encoding="utf-8")
    t0 = time.perf_counter()
    try:
        model = oneshot(model=model, tokenizer=tokenizer, recipe=recipe, **kwargs)
    except Exception as exc:  # the row says why (the traceback goes to stderr); the next job still runs
        traceback.print_exc()
        row["error"] = _first_line(exc)
        return row
    row["call_s"] = time.perf_counter() - t0
    row["call_end_s"] = time.perf_counter() - T_START
    row["peak_rss_bytes"] = status_kib("VmHWM") * 1024
    evalw = data.token_windows(tokenizer, text, num_windows=args.eval_windows, seq_len=args.seq_len) \
        if args.eval_windows else None
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in model.parameters() if t.is_floating_point()})
    if len(dtypes) > 1:
        row["param_dtypes"] = dtypes  # e.g. AutoRound's tuned layers in bfloat16 on a float32 model
    evaluated = for_eval(model)
    if evalw is not None:
        row["ppl"] = data.perplexity(evaluated, evalw, progress=False)
    probe = torch.tensor(kwargs["dataset"]["input_ids"][:1]) if kwargs else \
        data.token_windows(tokenizer, text, num_windows=1, seq_len=args.seq_len, from_end=True)
    with torch.no_grad():
        logits = evaluated(probe).logits
    try:
        t_save = time.perf_counter()
        model.save_pretrained(args.out, save_compressed=True)
        row["save_s"] = time.perf_counter() - t_save
        tokenizer.save_pretrained(args.out)
        row["weights_on_disk_bytes"] = sum(p.stat().st_size for p in Path(args.out).glob("*.safetensors"))
        del model, evaluated
        reloaded = AutoModelForCausalLM.from_pretrained(args.out).eval()
        with torch.no_grad():
            row["reload_max_abs_logit_diff"] = float((reloaded(probe).logits - logits).abs().max())
        if evalw is not None and args.dtype == "float32":
            row["ppl_reloaded"] = data.perplexity(reloaded, evalw, progress=False)
    except Exception as exc:  # reported in the row
        row["reload_error"] = _first_line(exc)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--recipe-file", required=True)
    parser.add_argument("--with-data", action="store_true", help="pass the calibration windows to oneshot")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--eval-windows", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    row = run(args)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    row.update({"process_s": time.perf_counter() - T_START, "cpu_s": usage.ru_utime + usage.ru_stime,
                "torch_threads": torch.get_num_threads()})
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
