"""Session checkpoint size and save/load time on SmolLM2-135M with 50% masks (a benchmark, not a test).

Every decoder-layer Linear of SmolLM2-135M (lm_head, tied to the embeddings, is
ignored) is pruned to 50% by magnitude; a session holding those masks
(ConstantPruningModifier) runs one training step, then ``session.save(dir)``
and ``Session.load(dir, recipe, model=...)`` are timed (best of ``--repeats``)
and the files measured against the fp32 bytes of the masked weights (target:
masks <= 1/16 of them).

    python benchmarks/checkpoint_size.py [--repeats 3] [--json]

Results are recorded in docs/benchmarks.md ("Session checkpoints").
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from llmc_fsm_pruning.constant import ConstantPruningModifier
from llmc_fsm_pruning.magnitude import MagnitudePruningModifier

from llmc_fsm import Session
from llmc_fsm.models.known import load_model


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, _ = load_model("smollm2-135m")
    prune = Session([MagnitudePruningModifier(sparsity=0.5)])
    prune.initialize(model=model)
    prune.calibration_start()
    prune.calibration_end()
    prune.finalize()

    def recipe() -> list:
        return [ConstantPruningModifier()]

    session = Session(recipe())
    session.initialize(model=model)
    session.batch_start()
    session.batch_end()
    weights = session.modifiers[0].resolved_targets
    weight_bytes = sum(m.weight.numel() * 4 for m in weights.values())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "session"
        save_s = _best(lambda: session.save(path), args.repeats)
        files = {p.name: p.stat().st_size for p in path.iterdir()}

        def load() -> None:
            Session.load(path, recipe(), model=model).reset()

        load_s = _best(load, args.repeats)
    tensor_bytes = sum(size for name, size in files.items() if name.endswith(".safetensors"))
    result = {
        "masked_modules": len(weights),
        "fp32_weight_bytes": weight_bytes,
        "tensor_file_bytes": tensor_bytes,
        "json_bytes": files["session.json"],
        "ratio": tensor_bytes / weight_bytes,
        "save_s": save_s,
        "load_s": load_s,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{len(weights)} masked Linear weights, {weight_bytes / 2**20:.1f} MiB in fp32")
    print(
        f"tensor file {tensor_bytes / 2**20:.2f} MiB = 1/{weight_bytes / tensor_bytes:.1f} of them; "
        f"session.json {files['session.json'] / 1024:.1f} KiB"
    )
    print(f"save {save_s * 1000:.0f} ms, load (initialize + load_state_dict) {load_s * 1000:.0f} ms")


if __name__ == "__main__":
    main()
