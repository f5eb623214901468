"""Shared setup for the sparse fine-tuning examples (not a public API).

- the dense teacher: SmolLM2-135M (``llmc_fsm.models.known.load_model``);
- the 50%-sparse student: ``--pruned DIR`` (the output of ``llmc-fsm oneshot
  --output DIR``), else ``llmc_fsm.oneshot`` when it is available, else pruned
  here with a one-shot ``MagnitudePruningModifier`` through a Session;
- tinyshakespeare token windows and which layers are trainable.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from pathlib import Path

import torch

from llmc_fsm import Session
from llmc_fsm.data.protocol import load_text, token_windows
from llmc_fsm.models.known import load_model

MODEL = "smollm2-135m"


def default_data() -> Path:
    root = os.environ.get("LLMC_FSM_DATA")
    base = Path(root) if root else Path(__file__).resolve().parents[2] / "shared" / "data"
    return base / "tinyshakespeare" / "input.txt"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--pruned", type=Path, help="output dir of `llmc-fsm oneshot --output DIR` (50%% sparse)")
    p.add_argument("--data", type=Path, default=default_data(), help="training text (tinyshakespeare)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (one epoch over the windows)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--train-layers", type=int, default=2, help="train the last N decoder layers (0 = all)")
    p.add_argument("--lr", type=float, default=1e-4, help="initial learning rate (cosine to lr/10)")
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--alpha", type=float, default=0.5, help="weight of the distillation term")
    p.add_argument("--sparsity", type=float, default=0.5, help="in-process pruning when --pruned is not given")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    return p


def load_models(args: argparse.Namespace):
    """Return (student, teacher, tokenizer); the student is 50% sparse."""
    t0 = time.perf_counter()
    teacher, tokenizer = load_model(MODEL)
    if args.pruned is not None:
        student, _ = load_model(args.pruned)
        how = f"loaded from {args.pruned}"
    else:
        student = copy.deepcopy(teacher)
        how = prune_in_process(student, args.sparsity, tokenizer)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    print(f"student: {how} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return student, teacher, tokenizer


def prune_in_process(model: torch.nn.Module, sparsity: float, tokenizer=None) -> str:
    """One-shot magnitude pruning of every Linear but lm_head: ``llmc_fsm.oneshot`` if present, else a Session."""
    from llmc_fsm_pruning.magnitude import MagnitudePruningModifier

    try:
        from llmc_fsm.oneshot_job.api import oneshot
    except ImportError:
        oneshot = None
    if oneshot is not None:  # magnitude needs no calibration statistics: 1 tiny window
        modifier = MagnitudePruningModifier(sparsity=sparsity)
        calib = torch.zeros(1, 8, dtype=torch.long)
        oneshot(model, [modifier], calib, tokenizer=tokenizer, num_calibration_samples=1, progress=False)
        return f"pruned by llmc_fsm.oneshot + MagnitudePruningModifier(sparsity={sparsity}), measured " + (
            f"{modifier.measured_sparsity:.4f}"
        )
    session = Session([MagnitudePruningModifier(sparsity=sparsity)])
    session.initialize(model=model)
    session.calibration_start()
    session.calibration_end()
    session.finalize()
    measured = session.modifiers[0].measured_sparsity
    return f"pruned in-process by MagnitudePruningModifier(sparsity={sparsity}), measured {measured:.4f}"


def train_windows(tokenizer, args: argparse.Namespace) -> torch.Tensor:
    n = args.steps * args.batch_size * args.grad_accum
    text = load_text(args.data)[: n * args.seq_len * 16]  # ~4 chars/token: tokenize only what is needed
    return token_windows(tokenizer, text, num_windows=n, seq_len=args.seq_len)


def freeze_all_but_last(model: torch.nn.Module, n_layers: int) -> list[torch.nn.Parameter]:
    """Freeze everything except the last ``n_layers`` decoder layers (0 = train all but embeddings)."""
    for p in model.parameters():
        p.requires_grad_(False)
    layers = model.model.layers
    chosen = layers if n_layers <= 0 else layers[-n_layers:]
    params = [p for layer in chosen for p in layer.parameters()]
    for p in params:
        p.requires_grad_(True)
    return params


def linear_sparsity(model: torch.nn.Module) -> float:
    """Measured fraction of zeros over the decoder's Linear weights (lm_head/embeddings excluded)."""
    zeros = total = 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            zeros += m.weight.numel() - int(torch.count_nonzero(m.weight))
            total += m.weight.numel()
    return zeros / total
