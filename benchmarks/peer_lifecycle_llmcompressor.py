"""Peer benchmark: llmcompressor per-training-step lifecycle overhead on CPU.

Runs INSIDE the peer venv (see ``benchmarks/_peer.py``)::

    python benchmarks/_peer.py benchmarks/peer_lifecycle_llmcompressor.py

Setup: a model of 8 ``nn.Linear(64, 64)`` (ReLU between them), 50% of each
weight zeroed by magnitude, an SGD optimizer, and an llmcompressor session
(``llmcompressor.core.active_session().initialize``) with one
``ConstantPruningModifier(targets=["Linear"], start=0)`` -- it keeps the zeros
at zero by re-applying its masks at ``optim_post_step``.  ``attach_optim_callbacks``
is off so the optimizer is not wrapped: the five events are sent explicitly via
``llmcompressor.core.LifecycleCallbacks``.

A training step = forward on a [32, 64] batch, MSE loss, backward, ``opt.step()``,
``opt.zero_grad()``.  "With events" the same step also sends, in order,
``batch_start``, ``loss_calculated``, ``optim_pre_step``, ``optim_post_step``,
``batch_end``.  Plain and evented steps are interleaved (so drift hits both);
the reported overhead is ``median(evented) - median(plain)`` in microseconds
(``_p10``: same with 10th percentiles, less sensitive to a busy machine).
``events_only_us`` is the median time of just the five calls timed directly
inside evented steps (``per_event_us``: each call's median); on a loaded machine
it is the most stable of these numbers.  ``--inactive`` (start=None) measures
the bookkeeping alone: the modifier never starts, so no masks are applied.
llmcompressor's loguru handlers are removed so console logging costs nothing.

Prints ONE JSON object as the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000, help="measured steps of each kind")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 = least noise)")
    parser.add_argument(
        "--start",
        type=float,
        default=0.0,
        help="modifier start epoch (default 0: active, re-applies masks every optim_post_step)",
    )
    parser.add_argument(
        "--inactive", dest="start", action="store_const", const=None, help="start=None: modifier never starts"
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from llmcompressor.core import LifecycleCallbacks as cb
    from llmcompressor.core import active_session
    from llmcompressor.modifiers.pruning import ConstantPruningModifier
    from loguru import logger

    logger.remove()  # keep llmcompressor's per-event debug logging out of the timing

    layers: list[torch.nn.Module] = []
    for i in range(8):
        layers.append(torch.nn.Linear(64, 64))
        if i < 7:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                thresh = m.weight.abs().flatten().kthvalue(m.weight.numel() // 2).values
                m.weight[m.weight.abs() <= thresh] = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64)
    y = torch.randn(32, 64)
    loss_fn = torch.nn.MSELoss()

    session = active_session()
    session.initialize(
        recipe=[ConstantPruningModifier(targets=["Linear"], start=args.start)],
        model=model,
        optimizer=opt,
        attach_optim_callbacks=False,
        start=0,
        steps_per_epoch=args.steps + args.warmup,
    )

    perf = time.perf_counter_ns
    step_index = 0
    names = ("batch_start", "loss_calculated", "optim_pre_step", "optim_post_step", "batch_end")

    def plain_step() -> int:
        t0 = perf()
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return perf() - t0

    def evented_step(per_event: list[int]) -> tuple[int, int]:
        nonlocal step_index
        t0 = perf()
        a = perf()
        cb.batch_start(batch_data=x, global_step=step_index)
        b = perf()
        out = model(x)
        loss = loss_fn(out, y)
        c = perf()
        cb.loss_calculated(loss=loss)
        d = perf()
        loss.backward()
        e = perf()
        cb.optim_pre_step()
        f = perf()
        opt.step()
        g = perf()
        cb.optim_post_step()
        h = perf()
        opt.zero_grad(set_to_none=True)
        i = perf()
        cb.batch_end()
        j = perf()
        step_index += 1
        per_event[:] = [b - a, d - c, f - e, h - g, j - i]
        return j - t0, sum(per_event)

    scratch: list[int] = [0] * 5
    for _ in range(args.warmup):
        plain_step()
        evented_step(scratch)
    plain: list[int] = []
    evented: list[int] = []
    events_only: list[int] = []
    per_event: dict[str, list[int]] = {n: [] for n in names}
    for _ in range(args.steps):
        plain.append(plain_step())
        total, ev = evented_step(scratch)
        evented.append(total)
        events_only.append(ev)
        for n, v in zip(names, scratch, strict=True):
            per_event[n].append(v)

    # sanity: the modifier kept the pruned weights at zero through SGD updates
    zeros = [float((m.weight == 0).float().mean()) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    session.finalize()

    def us(values: list[int], q: float = 0.5) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000

    result = {
        "peer": "llmcompressor",
        "llmcompressor_version": __import__("llmcompressor").__version__,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "modifier_active": args.start is not None,
        "steps": args.steps,
        "plain_step_us": us(plain),
        "evented_step_us": us(evented),
        "overhead_us_per_step": us(evented) - us(plain),
        "overhead_us_per_step_p10": us(evented, 0.1) - us(plain, 0.1),
        "events_only_us": us(events_only),
        "events_only_us_p10": us(events_only, 0.1),
        "per_event_us": {n: us(v) for n, v in per_event.items()},
        "min_linear_sparsity_after": min(zeros),
        "loadavg_1min": os.getloadavg()[0],
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
