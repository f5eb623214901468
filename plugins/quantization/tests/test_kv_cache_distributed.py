"""KV-cache and attention quantization under torch.distributed (2 ranks, gloo, CPU): every rank's per-sample key,
value and query ranges are gathered in the calibration windows' order and folded again, so each observer's scales
(``minmax``'s moving average and ``memoryless_minmax``'s last sample included) are one process's, bit for bit.
Until session 39 a ``kv_cache_scheme`` was refused under several processes. Batch size 1 on both sides: each
window's states are then computed by the same products whatever the split. :func:`llmc_fsm.testing.run_ranks`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_kv_cache import KV
from tiny_quant_models import tiny_llama

import llmc_fsm
from llmc_fsm.testing import run_ranks

WORLD = 2


def _recipes() -> dict[str, dict[str, Any]]:
    """The KV-cache scheme with each observer and strategy; attention quantization (queries too) per head."""
    recipes = {}
    for observer in ("minmax", "static_minmax", "memoryless_minmax"):
        for strategy in ("tensor", "attn_head"):
            kv = {**KV, "strategy": strategy, "observer": observer}
            recipes[f"kv-{observer}-{strategy}"] = {"q": {"QuantizationModifier": {"kv_cache_scheme": kv}}}
    query = {"num_bits": 8, "type": "float", "strategy": "attn_head"}
    group = {"targets": ["LlamaAttention"], "input_activations": query}
    recipes["attention-attn_head"] = {"q": {"QuantizationModifier": {"config_groups": {"attention": group}}}}
    return recipes


def windows() -> torch.Tensor:
    return torch.randint(0, 128, (7, 16), generator=torch.Generator().manual_seed(5))  # 4 + 3 windows


def _scales(name: str) -> dict[str, torch.Tensor]:
    model = tiny_llama()
    llmc_fsm.oneshot(model=model, recipe=_recipes()[name], dataset=windows(), batch_size=1, progress=False, threads=1)
    scales = ("q_scale", "k_scale", "v_scale")
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.endswith(scales)}


def _worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    for name in _recipes():
        for key, value in _scales(name).items():
            tensors[f"{name}/{key}"] = value
    return {}


@pytest.mark.distributed
def test_kv_and_query_scales_on_two_ranks_are_one_process_scales_bitwise(tmp_path, monkeypatch) -> None:
    """Found open since session 37 (a "left" item): each rank saw only its windows; now every observer's scales on
    each rank equal one process's bit for bit (the moving average replays the samples in one process's order)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ranks = run_ranks(_worker, tmp_path, world_size=WORLD, timeout_s=60.0, join_s=300.0)
    for rank in ranks:
        assert "error" not in rank["meta"], rank["meta"]
    r0, r1 = ranks[0]["tensors"], ranks[1]["tensors"]
    assert r0.keys() == r1.keys()
    assert [k for k in r0 if not torch.equal(r0[k], r1[k])] == []
    for name in _recipes():
        single = _scales(name)
        bases = ("q", "k", "v") if name.startswith("attention") else ("k", "v")
        assert sorted(single) == sorted(f"model.layers.{i}.self_attn.{b}_scale" for i in (0, 1) for b in bases)
        assert all(torch.isfinite(v).all() for v in single.values())
        assert [k for k in single if not torch.equal(r0[f"{name}/{k}"], single[k])] == [], name
