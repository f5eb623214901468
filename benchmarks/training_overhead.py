"""Per-step overhead of ConstantPruningModifier beside llmcompressor (a benchmark, not a test).

Workload (the same on both sides, mirroring
``benchmarks/peer_lifecycle_llmcompressor.py``): 8 ``Linear(64, 64)`` with ReLU
between them, 50% of each weight zeroed by magnitude, SGD, one
ConstantPruningModifier over all Linear layers. A training step is forward on a
[32, 64] batch, MSE, backward, ``opt.step()``, ``zero_grad``; an evented step also
sends the 5 session events (batch_start, loss_calculated, optim_pre_step,
optim_post_step, batch_end). Plain and evented steps are interleaved;
``overhead_us_per_step = median(evented) - median(plain)``, ``events_only_us`` =
median time of the five calls (lifecycle + the mask re-application, one fused
``torch._foreach_mul_`` at optim_post_step).

Ours runs in this process; the peer (``llmcompressor==0.14.0.1``) runs
``benchmarks/peer_lifecycle_llmcompressor.py`` in its own venv through
``benchmarks/_peer.py``, in the same invocation. Target: ours <= 0.5x theirs.

    python benchmarks/training_overhead.py [--steps 2000] [--warmup 200] [--threads 1] [--no-peer] [--json]

Results are recorded in docs/benchmarks.md ("Training: ConstantPruning per-step overhead").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from llmc_fsm import Session

HERE = Path(__file__).resolve().parent
PEER_SCRIPT = HERE / "peer_lifecycle_llmcompressor.py"


def _model(seed: int = 0) -> nn.Module:
    """8 Linear(64, 64) with ReLU between them, 50% of each weight zeroed by magnitude (as the peer script)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(8):
        layers.append(nn.Linear(64, 64))
        if i < 7:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                thresh = m.weight.abs().flatten().kthvalue(m.weight.numel() // 2).values
                m.weight[m.weight.abs() <= thresh] = 0.0
    return model


def time_ours(steps: int, warmup: int, with_modifier: bool = True) -> dict[str, float]:
    """Interleaved plain / evented training steps (forward [32, 64], MSE, backward, SGD step), as the peer.

    Returns medians in µs: ``overhead_us_per_step`` = evented - plain, ``events_only_us`` = the five calls.
    """
    from llmc_fsm_pruning.constant import ConstantPruningModifier

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    loss_fn = nn.MSELoss()
    session = Session([ConstantPruningModifier()] if with_modifier else None)
    session.initialize(model=model, optimizer=opt, steps_per_epoch=steps + warmup)
    bs, lc, pre, post, be = (
        session.batch_start,
        session.loss_calculated,
        session.optim_pre_step,
        session.optim_post_step,
        session.batch_end,
    )
    perf = time.perf_counter_ns

    def plain_step() -> int:
        t0 = perf()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return perf() - t0

    def evented_step() -> tuple[int, int]:
        ev = 0
        t0 = perf()
        a = perf()
        bs(x)
        ev += perf() - a
        loss = loss_fn(model(x), y)
        a = perf()
        loss = lc(loss)
        ev += perf() - a
        loss.backward()
        a = perf()
        pre()
        ev += perf() - a
        opt.step()
        a = perf()
        post()
        ev += perf() - a
        opt.zero_grad(set_to_none=True)
        a = perf()
        be()
        ev += perf() - a
        return perf() - t0, ev

    evented_step()  # the first batch_start takes the masks from the zeros (before any plain step moves them)
    for _ in range(warmup):
        plain_step()
        evented_step()
    plain, evented, events_only = [], [], []
    for _ in range(steps):
        plain.append(plain_step())
        total, ev = evented_step()
        evented.append(total)
        events_only.append(ev)
    zeros = min(float((m.weight == 0).float().mean()) for m in model.modules() if isinstance(m, nn.Linear))
    session.finalize()
    med_plain = statistics.median(plain) / 1000
    med_evented = statistics.median(evented) / 1000
    return {
        "plain_step_us": med_plain,
        "evented_step_us": med_evented,
        "overhead_us_per_step": med_evented - med_plain,
        "events_only_us": statistics.median(events_only) / 1000,
        "min_linear_sparsity_after": zeros,
    }


def time_peer(steps: int, warmup: int, threads: int) -> dict:
    sys.path.insert(0, str(HERE))
    from _peer import run_peer_script

    args = ["--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads)]
    return run_peer_script(PEER_SCRIPT, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="measured steps of each kind")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--no-peer", action="store_true", help="skip llmcompressor")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    out: dict = {
        "workload": "ConstantPruningModifier over 8 Linear(64,64), 5 events/step",
        "torch": torch.__version__,
        "threads": args.threads,
        "ours": time_ours(args.steps, args.warmup),
        "ours_no_modifier": time_ours(args.steps, args.warmup, with_modifier=False),
    }
    if not args.no_peer:
        peer = time_peer(args.steps, args.warmup, args.threads)
        out["peer"] = peer
        for key in ("overhead_us_per_step", "events_only_us"):
            out[f"ratio_{key}"] = out["ours"][key] / peer[key] if peer.get(key) else None
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
