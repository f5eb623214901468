"""Per-event cost of the session lifecycle (a benchmark, not a test).

Measures, on this machine, the cost of one event and of a full 5-event training
step (batch_start, loss_calculated, optim_pre_step, optim_post_step, batch_end)
with 0, 1, 4 and 16 no-op modifiers that handle every batch event, the cost
of one ``transitions`` trigger for scale, and what the session's own lock adds
to each event: a method whose body runs under ``with self._lock:`` (an
uncontended ``threading.RLock``, as in every session call) against the same
method without it. Target (lifecycle issue): <= 3 µs per event per no-op
modifier plus a small fixed cost.

The failure guard (``llmc_fsm.core.guard``, issue 27) is timed with a model in
the state: a module with SmolLM2-135M's 272 parameters (same names and count,
width 8: the guard's cost is per parameter, not per weight; ``--smollm2`` loads
the real model instead). Per event and modifier, over the same model with no
modifier: a no-op modifier without targets (its hooks make no torch call, so the
rest of the model is read lazily), the same with every counter read before each
hook (``eager``: what the guard did before the lazy read, and what a modifier
whose hooks make torch calls pays), and a no-op modifier targeting one decoder
layer's seven Linears (its targets read before each hook, the rest lazily),
against reading only its targets (the guard before issue 27).

    python benchmarks/lifecycle_overhead.py [--steps 20000] [--json] [--no-peer] [--smollm2]

It then runs ``benchmarks/training_overhead.py``: the per-step overhead of one
ConstantPruningModifier over 8 ``Linear(64, 64)`` beside ``llmcompressor==0.14.0.1``
running the same workload in the same invocation (``--no-peer`` skips the peer,
``--only-events`` skips this part).

Results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import attrs
import torch
from torch import nn

from llmc_fsm import Modifier, Session
from llmc_fsm.core.guard import Guard, watched_parameters
from llmc_fsm.core.lifecycle import make_machine
from llmc_fsm.models.known import load_model


@attrs.define(kw_only=True, slots=False, eq=False)
class NoOp(Modifier):
    """Handles every batch event and does nothing."""

    events = frozenset({"batch_start", "loss_calculated", "optim_pre_step", "optim_post_step", "batch_end"})

    def on_event(self, state, event):
        return None


@attrs.define(kw_only=True, slots=False, eq=False)
class TargetedNoOp(NoOp):
    """Targets decoder layer 0's seven Linears; handles every batch event and does nothing."""

    _targets: dict = attrs.field(factory=dict, init=False)

    @property
    def resolved_targets(self):
        return self._targets

    def on_initialize(self, state):
        layer = state.model.model.layers[0]
        self._targets = {
            f"model.layers.0.{name}": module for name, module in layer.named_modules() if isinstance(module, nn.Linear)
        }


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.self_attn = nn.ModuleDict(
            {n: nn.Linear(width, width, bias=False) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        )
        self.mlp = nn.ModuleDict(
            {n: nn.Linear(width, width, bias=False) for n in ("gate_proj", "up_proj", "down_proj")}
        )
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(width))
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = nn.Parameter(torch.ones(width))


class SmolShaped(nn.Module):
    """SmolLM2-135M's 272 parameters (30 decoder layers, tied ``lm_head``) at width 8: same names, same count."""

    def __init__(self, width: int = 8, layers: int = 30) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(16, width)
        self.model.layers = nn.ModuleList(_Layer(width) for _ in range(layers))
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(torch.ones(width))
        self.lm_head = nn.Linear(width, 16, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


def _only_targets(session: Session) -> None:
    """Guard each modifier with its targets alone (the guard before issue 27 for modifiers with targets)."""
    for slot in session._schedule.slots:
        slot.guard = Guard(watched_parameters(slot.modifier.resolved_targets))


def _eager(session: Session) -> None:
    """Read every counter before each hook (the guard before issue 27 for modifiers without targets)."""
    for slot in session._schedule.slots:
        for event in NoOp.events:
            slot.guard.for_hook(event).eager = True


def time_guarded(model: nn.Module, steps: int, repeats: int = 5) -> dict[str, float]:
    """Median µs per event that one no-op modifier adds over the same session without it, ``model`` in the state."""

    def run(modifiers, adjust=None) -> float:
        results = []
        for _ in range(repeats):
            session = Session(modifiers())
            session.initialize(model=model, steps_per_epoch=1000)
            if adjust is not None:
                adjust(session)
            bs, lc, pre, post, be = (
                session.batch_start,
                session.loss_calculated,
                session.optim_pre_step,
                session.optim_post_step,
                session.batch_end,
            )
            t0 = time.perf_counter()
            for _ in range(steps):
                bs()
                lc(1.0)
                pre()
                post()
                be()
            results.append((time.perf_counter() - t0) / steps * 1e6 / 5)
            session.finalize()
        return statistics.median(results)

    fixed = run(list)
    return {
        "parameters": len(dict.fromkeys(model.parameters())),
        "fixed_event_us": fixed,
        "untargeted_lazy_us": run(lambda: [NoOp()]) - fixed,
        "untargeted_eager_us": run(lambda: [NoOp()], _eager) - fixed,
        "targeted_lazy_us": run(lambda: [TargetedNoOp()]) - fixed,
        "targeted_only_targets_us": run(lambda: [TargetedNoOp()], _only_targets) - fixed,
    }


def _session(n: int) -> Session:
    session = Session([NoOp() for _ in range(n)])
    session.initialize(steps_per_epoch=1000)
    return session


def time_steps(n_modifiers: int, steps: int, repeats: int = 5) -> float:
    """Median µs for one full 5-event step."""
    results = []
    for _ in range(repeats):
        session = _session(n_modifiers)
        bs, lc, pre, post, be = (
            session.batch_start,
            session.loss_calculated,
            session.optim_pre_step,
            session.optim_post_step,
            session.batch_end,
        )
        t0 = time.perf_counter()
        for _ in range(steps):
            bs()
            lc(1.0)
            pre()
            post()
            be()
        results.append((time.perf_counter() - t0) / steps * 1e6)
        session.finalize()
    return statistics.median(results)


class _Locked:
    def __init__(self) -> None:
        self._lock = threading.RLock()

    def locked(self) -> int:
        with self._lock:
            return 1

    def plain(self) -> int:
        return 1


def time_lock(iterations: int = 200000, repeats: int = 5) -> float:
    """µs a ``with self._lock:`` (uncontended RLock) adds to a method call: best of ``repeats``."""
    obj = _Locked()
    best = {}
    for name in ("locked", "plain"):
        call = getattr(obj, name)
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iterations):
                call()
            runs.append((time.perf_counter() - t0) / iterations * 1e6)
        best[name] = min(runs)
    return best["locked"] - best["plain"]


def time_trigger(iterations: int = 20000) -> float:
    """µs for one transitions trigger (update_state: staging -> staging)."""

    class Model:
        pass

    model = Model()
    make_machine(model)
    model.update_state()
    t0 = time.perf_counter()
    for _ in range(iterations):
        model.update_state()
    return (time.perf_counter() - t0) / iterations * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    parser.add_argument("--no-peer", action="store_true", help="ConstantPruning part: skip llmcompressor")
    parser.add_argument("--only-events", action="store_true", help="skip the ConstantPruning part")
    parser.add_argument("--smollm2", action="store_true", help="guard part: load the real SmolLM2-135M")
    parser.add_argument("--guard-steps", type=int, default=2000, help="guard part: steps per run")
    args = parser.parse_args()

    step_us = {n: time_steps(n, args.steps) for n in (0, 1, 4, 16)}
    lock_us = time_lock()
    trigger_us = time_trigger()
    fixed = step_us[0] / 5
    per_mod = {n: (step_us[n] - step_us[0]) / 5 / n for n in (1, 4, 16)}
    result = {
        "step_us": step_us,
        "event_us": {n: v / 5 for n, v in step_us.items()},
        "fixed_event_us": fixed,
        "per_event_per_modifier_us": per_mod,
        "transitions_trigger_us": trigger_us,
        "lock_us_per_event": lock_us,
    }
    if args.smollm2:
        guard_model, _ = load_model("smollm2-135m")
    else:
        guard_model = SmolShaped()
    guard = time_guarded(guard_model, args.guard_steps)
    result["guard"] = {"model": "smollm2-135m" if args.smollm2 else "SmolShaped (272 parameters)", **guard}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'modifiers':>9} | {'µs / 5-event step':>17} | {'µs / event':>10} | {'µs / event / modifier':>21}")
    for n, us in step_us.items():
        extra = f"{per_mod[n]:21.2f}" if n else f"{'(fixed cost)':>21}"
        print(f"{n:9d} | {us:17.2f} | {us / 5:10.2f} | {extra}")
    print(f"one transitions trigger: {trigger_us:.2f} µs (events do not go through triggers)")
    print(f"the session lock adds {lock_us:.2f} µs to each event (uncontended RLock, in the fixed cost above)")
    worst = max(per_mod.values())
    print(f"target <= 3 µs per event per no-op modifier: {'met' if worst <= 3 else 'MISSED'} (worst {worst:.2f} µs)")
    print()
    print(f"failure guard, {result['guard']['model']}, {guard['parameters']} parameters in the state")
    print(f"  fixed cost per event (no modifier): {guard['fixed_event_us']:.2f} µs")
    print("  µs per event added by one no-op modifier:")
    print(f"    without targets, rest read lazily (now):          {guard['untargeted_lazy_us']:8.2f}")
    print(f"    without targets, every counter before each hook:  {guard['untargeted_eager_us']:8.2f}")
    print(f"    7 targeted Linears, rest read lazily (now):       {guard['targeted_lazy_us']:8.2f}")
    print(f"    7 targeted Linears, targets only (before):        {guard['targeted_only_targets_us']:8.2f}")
    if not args.only_events:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from training_overhead import main as training_main

        print()
        training_main([*(["--no-peer"] if args.no_peer else []), *(["--json"] if args.json else [])])


if __name__ == "__main__":
    main()
