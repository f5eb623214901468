"""GPU one-shot: llmc-fsm against llm-compressor 0.14 on a synthetic Llama of Llama-3.2-1B's shape.

One prepared command runs everything on one GPU (the peer in its own venv, see ``benchmarks/_peer.py``)::

    python benchmarks/gpu_oneshot.py --out /tmp/gpu_oneshot.json [--wheels DIR]

What it does, in this order:

1. writes, once, a ``LlamaForCausalLM`` of Llama-3.2-1B's shape (16 layers, width 2048, MLP 8192, 32 heads, 8 KV
   heads, vocabulary 128256, tied embeddings) with random bfloat16 weights (seed 0) to ``--model-dir``, and
   128 x 2048 calibration token ids (seed 1) plus 4 x 2048 held-out ids next to it (safetensors);
2. per method — GPTQ W4A16 group 128 and SparseGPT 50% unstructured, every Linear but ``lm_head`` — runs ours
   (``llmc_fsm.oneshot(..., device="cuda", dtype="bfloat16")``) and llm-compressor's ``oneshot`` (sequential
   pipeline, the model loaded on the CPU and onloaded by llm-compressor) on the same windows, each in a fresh
   process;
3. each side measures: wall time of the compression call, peak device memory (``torch.cuda.max_memory_allocated``),
   and the layer output error: per decoder layer, ``||h' - h|| / ||h||`` between the compressed and the dense
   model's hidden states on the held-out windows (the same code on both sides: this file);
4. prints one JSON object (and writes it to ``--out``): both sides' numbers, the ratios against the targets (wall
   <= 0.5x and peak device memory <= 1.0x of llm-compressor's) and ours' time per layer (flat in depth: last
   quarter / first quarter of the layers).

``--wheels DIR`` installs the peer venv from wheels carried with the script (``pip --no-index --find-links DIR``:
no network on the GPU machine). ``--dry-run`` checks the arguments and runs our side only, on a tiny shape (2
layers, width 64) on ``--device`` (default ``cpu``) — what CI can run; it measures nothing worth recording.

Not run on a GPU yet: no GPU was at hand when it was written (see docs/benchmarks.md).
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

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Llama-3.2-1B's shape (its config.json, rope scaling left out: random weights, 2048-token windows).
LLAMA_3_2_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
#: The ``--dry-run`` shape.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
METHODS = ("gptq", "sparsegpt")
#: Targets of the issue (25): ours / llm-compressor.
TARGETS = {"wall": 0.5, "peak_device_memory": 1.0}


def _log(msg: str) -> None:
    print(f"[gpu-oneshot] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None, help="where the synthetic model is written once (default: tmp)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--num-samples", type=int, default=128, help="calibration windows (default 128)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per window (default 2048)")
    parser.add_argument("--batch-size", type=int, default=8, help="our calibration windows per forward")
    parser.add_argument("--device", default="cuda", help="our device (default cuda; --dry-run: cpu)")
    parser.add_argument("--wheels", default=None, help="install the peer venv from wheels in this directory")
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    parser.add_argument("--dry-run", action="store_true", help="tiny shape, our side only, on --device (cpu)")
    # internal: one side of one method in a fresh process
    parser.add_argument("--side", choices=("ours", "peer"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=METHODS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("num_samples", "seq_len", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive int, got {getattr(args, name)}")
    if args.dry_run and args.device == "cuda" and not torch.cuda.is_available():
        args.device = "cpu"
    return args


# --------------------------------------------------------------------------- the synthetic model and data
def write_model(directory: Path, shape: dict[str, Any], *, num_samples: int, seq_len: int) -> Path:
    """The synthetic model (random bf16 weights, seed 0) and its token windows in ``directory`` (kept if present)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    done = directory / "windows.safetensors"
    if done.is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**shape, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    generator = torch.Generator().manual_seed(1)
    vocab = shape["vocab_size"]
    windows = {
        "calibration": torch.randint(0, vocab, (num_samples, seq_len), generator=generator),
        "held_out": torch.randint(0, vocab, (4, seq_len), generator=generator),
    }
    save_file(windows, str(done))
    _log(f"wrote the synthetic model and windows to {directory}")
    return directory


def load_windows(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "windows.safetensors"))


@torch.no_grad()
def hidden_states(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """Every decoder layer's output hidden states on ``ids`` (float32, on the CPU), one window at a time."""
    per_layer: list[list[torch.Tensor]] = []
    for row in ids:
        out = model(input_ids=row.unsqueeze(0).to(device), output_hidden_states=True, use_cache=False)
        for i, h in enumerate(out.hidden_states[1:]):
            if len(per_layer) <= i:
                per_layer.append([])
            per_layer[i].append(h.float().cpu())
    return [torch.cat(hs) for hs in per_layer]


def layer_output_errors(dense: list[torch.Tensor], compressed: list[torch.Tensor]) -> list[float]:
    """Per decoder layer ``||h' - h|| / ||h||`` (float64 norms)."""
    return [float((c.double() - d.double()).norm() / d.double().norm()) for d, c in zip(dense, compressed, strict=True)]


def _reference_states(directory: Path, device: torch.device) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to(device).eval()
    states = hidden_states(model, load_windows(directory)["held_out"], device)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return states


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


# --------------------------------------------------------------------------- one side of one method
def run_ours(directory: Path, method: str, args: argparse.Namespace) -> dict[str, Any]:
    import llmc_fsm
    from llmc_fsm.oneshot_job.settings import default_recipe
    from llmc_fsm.output.save import quantized_weights_as_compressed

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    reference = _reference_states(directory, device)
    windows = load_windows(directory)["calibration"]
    group = 32 if args.dry_run else 128  # the tiny shape's width 64 takes no group of 128
    recipe = default_recipe("gptq", scheme="W4A16", group_size=group) if method == "gptq" else default_recipe()
    _reset_peak(device)
    t0 = time.perf_counter()
    model = llmc_fsm.oneshot(
        model=str(directory),
        recipe=recipe,
        dataset=windows,
        dtype="bfloat16",
        device=str(device),
        batch_size=args.batch_size,
        progress=False,
    )
    wall = time.perf_counter() - t0
    peak = _peak(device)
    report = model.llmc_fsm_report
    execution = report.execution or {}
    with quantized_weights_as_compressed(model):
        model.to(device)
        errors = layer_output_errors(reference, hidden_states(model, load_windows(directory)["held_out"], device))
    seconds = execution.get("layer_seconds") or []
    quarter = max(1, len(seconds) // 4)
    return {
        "side": "ours",
        "method": method,
        "group_size": group if method == "gptq" else None,
        "wall_s": wall,
        "compress_s": report.seconds.get("compress"),
        "peak_device_bytes": peak,
        "pipeline_peak_device_bytes": execution.get("peak_device_bytes"),
        "layer_peak_device_bytes": execution.get("layer_peak_device_bytes"),
        "layer_seconds": seconds,
        "layer_time_last_over_first_quarter": (sum(seconds[-quarter:]) / sum(seconds[:quarter]))
        if seconds and sum(seconds[:quarter])
        else None,
        "activations": execution.get("activations"),
        "device": execution.get("device"),
        "layer_output_errors": errors,
        "mean_layer_output_error": sum(errors) / len(errors),
    }


def run_peer(directory: Path, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """Inside the peer venv: llm-compressor's oneshot on the same windows (its sequential pipeline onloads layers)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda", torch.cuda.current_device())
    reference = _reference_states(directory, device)
    windows = load_windows(directory)["calibration"]
    if method == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
    else:
        from llmcompressor.modifiers.pruning import SparseGPTModifier

        recipe = SparseGPTModifier(sparsity=0.5, mask_structure="0:0", targets=["Linear"], ignore=["lm_head"])
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    dataset = Dataset.from_dict({"input_ids": windows.tolist(), "attention_mask": torch.ones_like(windows).tolist()})
    _reset_peak(device)
    t0 = time.perf_counter()
    model = oneshot(
        model=model,
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=int(windows.shape[0]),
        max_seq_length=int(windows.shape[1]),
        shuffle_calibration_samples=False,
        pipeline="sequential",
    )
    wall = time.perf_counter() - t0
    peak = _peak(device)
    model.to(device)
    errors = layer_output_errors(reference, hidden_states(model, load_windows(directory)["held_out"], device))
    return {
        "side": "peer",
        "method": method,
        "llmcompressor_version": __import__("llmcompressor").__version__,
        "wall_s": wall,
        "peak_device_bytes": peak,
        "layer_output_errors": errors,
        "mean_layer_output_error": sum(errors) / len(errors),
    }


# --------------------------------------------------------------------------- the driver
def _run_side(side: str, directory: Path, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """One side of one method in a fresh process (ours: this interpreter; peer: the peer venv's)."""
    flags = ["--side", side, "--method", method, "--model-dir", str(directory), "--device", args.device,
             "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]  # fmt: skip
    if args.dry_run:
        flags.append("--dry-run")
    if side == "peer":
        sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
        from _peer import run_peer_script

        return run_peer_script(Path(__file__), flags, timeout=3600)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, __file__, *flags], stdout=subprocess.PIPE, text=True, env=env, check=False, timeout=3600
    )
    if proc.returncode != 0:
        msg = f"{side} {method} exited with {proc.returncode}; stdout tail:\n{proc.stdout[-2000:]}"
        raise RuntimeError(msg)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    wall = ours["wall_s"] / peer["wall_s"]
    memory = ours["peak_device_bytes"] / peer["peak_device_bytes"] if peer.get("peak_device_bytes") else None
    return {
        "wall_ours_over_peer": wall,
        "wall_target_met": wall <= TARGETS["wall"],
        "peak_device_memory_ours_over_peer": memory,
        "peak_device_memory_target_met": memory is not None and memory <= TARGETS["peak_device_memory"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side is not None:
        runner = run_ours if args.side == "ours" else run_peer
        print(json.dumps(runner(Path(args.model_dir), args.method, args)), flush=True)
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_oneshot: needs a CUDA device (torch sees none); use --dry-run on the CPU", file=sys.stderr)
        return 2
    if args.wheels:  # the peer venv from carried wheels: no index on the GPU machine
        os.environ["PIP_NO_INDEX"] = "1"
        os.environ["PIP_FIND_LINKS"] = str(Path(args.wheels).resolve())
    shape = TINY if args.dry_run else LLAMA_3_2_1B
    if args.dry_run:
        args.num_samples, args.seq_len, args.batch_size = min(args.num_samples, 4), min(args.seq_len, 32), 2
    directory = Path(args.model_dir or tempfile.mkdtemp(prefix="gpu-oneshot-"))
    t0 = time.perf_counter()
    write_model(directory, shape, num_samples=args.num_samples, seq_len=args.seq_len)
    result: dict[str, Any] = {
        "shape": "tiny (dry run)" if args.dry_run else "Llama-3.2-1B (random bf16 weights)",
        "calibration": f"{args.num_samples} x {args.seq_len} tokens",
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "methods": {},
    }
    for method in args.methods:
        ours = _run_side("ours", directory, method, args)
        entry: dict[str, Any] = {"ours": ours}
        _log(f"ours {method}: {ours['wall_s']:.1f} s, mean layer output error {ours['mean_layer_output_error']:.4g}")
        if not args.dry_run:
            peer = _run_side("peer", directory, method, args)
            entry["peer"] = peer
            entry["ratios"] = _ratios(ours, peer)
        result["methods"][method] = entry
    result["total_s"] = time.perf_counter() - t0
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
