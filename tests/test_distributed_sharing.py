"""Ranks that share the compression work (gloo, CPU): each module compressed by exactly one rank, same weights.

Under ``torch.distributed`` a modifier that can share its work (``shares_work_across_ranks``: SparseGPT, Wanda, and
GPTQ with a plain integer scheme) assigns the groups of targets of each decoder layer to ranks, balanced by their sweep
cost (rows x columns²), and broadcasts the new weights. Each test starts 2 or 3 processes (spawn) in a gloo group
through a file rendezvous in ``tmp_path``; each rank writes its weights and what it compressed.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_llama import llama

import llmc_fsm
from llmc_fsm import Session
from llmc_fsm.oneshot_job.settings import default_recipe
from llmc_fsm.pipeline.sequential import run_sequential
from llmc_fsm.testing import run_ranks
from llmc_fsm.toolkit.distributed import assign_to_ranks, rank_work, shard, sweep_cost

RECIPES = {
    "sparsegpt": default_recipe("sparsegpt", 0.5),
    "wanda": default_recipe("wanda", 0.5),
    "gptq": default_recipe("gptq", scheme="W4A16", group_size=32),
}
LAYERS = 2
MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")  # fmt: skip
TARGETS = [f"model.layers.{i}.{m}" for i in range(LAYERS) for m in MODULES]


def windows() -> torch.Tensor:
    return torch.randint(0, 128, (6, 24), generator=torch.Generator().manual_seed(11))


# --------------------------------------------------------------------------- the assignment itself
def test_sweep_cost_is_rows_times_columns_squared():
    assert sweep_cost((128, 64)) == 128 * 64 * 64
    assert sweep_cost(torch.Size([3, 5])) == 75


def test_assignment_is_longest_first_to_the_least_loaded_rank():
    # 9 (unit 1) -> r0, 9 (unit 2) -> r1, 5 (unit 0) -> r0 (loads tie: the lower rank), 1 (unit 3) -> r1 (9 < 14)
    assert assign_to_ranks([5, 9, 9, 1], 2) == [0, 0, 1, 1]
    assert assign_to_ranks([4, 4, 4], 3) == [0, 1, 2]
    assert assign_to_ranks([7], 3) == [0]
    assert assign_to_ranks([], 2) == []
    with pytest.raises(ValueError, match=r"^loads must hold one value per rank \(2\), got 3$"):
        assign_to_ranks([1], 2, [0, 0, 0])
    loads = [5, 0]
    assert assign_to_ranks([3, 2], 2, loads) == [1, 1] and loads == [5, 5]  # carried over: rank 1 catches up
    with pytest.raises(ValueError, match=r"^need world_size >= 1 and costs >= 0, got world_size=0, costs=\[1\]$"):
        assign_to_ranks([1], 0)


# --------------------------------------------------------------------------- ranks
def _worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    info: dict[str, Any] = {}
    for name, recipe in RECIPES.items():
        model = llama(layers=LAYERS)
        session = Session(recipe)
        session.initialize(model=model, calibration_data=windows())
        mine, _ = shard(windows())
        run_sequential(session, calibration_data=mine, batch_size=2, progress=False)
        (modifier,) = session.modifiers
        session.finalize()
        info[name] = {
            "compressed_here": modifier.compressed_here,
            "owners": {n: share[0] for n, share in modifier.work_shares.items()},
            "work": rank_work([modifier]),
            "results": {n: [r.zeros, r.samples, r.rel_output_error] for n, r in modifier.results.items()},
        }
        for n, m in model.named_modules():
            if n in TARGETS:
                tensors[f"{name}/{n}"] = m.weight.detach().clone()
                for q in ("weight_scale", "weight_zero_point"):
                    if hasattr(m, q):
                        tensors[f"{name}/{n}.{q}"] = getattr(m, q).detach().clone()
    model = llama(layers=LAYERS)
    llmc_fsm.oneshot(model=model, recipe=RECIPES["sparsegpt"], dataset=windows(), batch_size=2, progress=False)
    info["execution"] = model.llmc_fsm_report.execution
    info["table"] = model.llmc_fsm_report.format_table()
    return info


def launch(world: int, tmp_path: Path, *, join_s: float = 240.0) -> list[dict[str, Any]]:
    """:func:`_worker` on ``world`` spawned ranks (:func:`llmc_fsm.testing.run_ranks`, collective timeout 90 s)."""
    return run_ranks(_worker, tmp_path, world_size=world, timeout_s=90.0, join_s=join_s)


@pytest.fixture
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_each_module_is_compressed_by_exactly_one_rank_with_the_weights_of_one_process(world, tmp_path, one_thread):
    ranks = launch(world, tmp_path)
    for rank in ranks:
        assert "error" not in rank["meta"], rank["meta"]
    for name, recipe in RECIPES.items():
        results = [rank["meta"]["result"][name] for rank in ranks]
        counted = collections.Counter(n for r in results for n in r["compressed_here"])
        assert sorted(counted) == sorted(TARGETS) and set(counted.values()) == {1}  # each by exactly one rank
        owners = results[0]["owners"]
        assert all(r["owners"] == owners for r in results)  # every rank agrees on who compressed what
        for r, result in enumerate(results):
            assert sorted(result["compressed_here"]) == sorted(n for n, o in owners.items() if o == r)
            if name != "gptq":  # a GPTQ group goes to one rank whole: over 2 layers one rank may get none
                assert result["compressed_here"], f"rank {r} compressed nothing"
            assert result["results"] == results[0]["results"]  # results broadcast with the weights
            work = result["work"]
            assert [w["modules"] for w in work] == [sum(1 for o in owners.values() if o == k) for k in range(world)]
        # the weights: identical on every rank, the masks of one process, values within float rounding of it
        model = llama(layers=LAYERS)
        session = Session(recipe)
        session.initialize(model=model, calibration_data=windows())
        run_sequential(session, batch_size=2, progress=False)
        session.finalize()
        single = {n: m.weight for n, m in model.named_modules() if n in TARGETS}
        for n, w in single.items():
            key = f"{name}/{n}"
            for rank in ranks[1:]:
                assert torch.equal(rank["tensors"][key], ranks[0]["tensors"][key]), f"{key}: ranks differ"
            if name != "gptq":
                assert torch.equal(ranks[0]["tensors"][key] != 0, w != 0), f"{key}: mask differs from one process"
            if name != "gptq":
                torch.testing.assert_close(ranks[0]["tensors"][key], w, rtol=0, atol=1e-5)
            else:  # the ranks' Hessian is summed in another order (~1e-7 relative): a near-tie of the rounding can
                # land one grid step away, in a whole group of 32 when its scale moves (a GPTQ group goes to one
                # rank whole, so its sweep is bitwise the one every rank would compute: the order is the cause)
                differ = ranks[0]["tensors"][key] != w
                assert int(differ.sum()) <= 0.01 * w.numel(), f"{key}: {int(differ.sum())} weights differ"
            if name == "gptq":  # the quantization parameters reach every rank too, as one process has them
                module = model.get_submodule(n)
                for q in ("weight_scale", "weight_zero_point"):
                    for rank in ranks[1:]:
                        assert torch.equal(rank["tensors"][f"{key}.{q}"], ranks[0]["tensors"][f"{key}.{q}"])
                    mine, single_q = ranks[0]["tensors"][f"{key}.{q}"], getattr(module, q)
                    assert int((mine != single_q).sum()) <= max(1, 0.01 * single_q.numel()), f"{key}.{q}"
    execution = ranks[0]["meta"]["result"]["execution"]
    work = execution["compress_per_rank"]
    assert len(work) == world and sum(w["modules"] for w in work) == len(TARGETS)
    assert all(w["modules"] > 0 and w["cost"] > 0 for w in work)
    table = ranks[0]["meta"]["result"]["table"]
    for r, w in enumerate(work):
        assert f"rank {r}: compressed {w['modules']} modules (sweep cost " in table


def _experts_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_families import build

    from llmc_fsm.toolkit import weight_views

    model = build("qwen3_moe")
    recipe = {"s": {"SparseGPTModifier": {"sparsity": 0.5, "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=windows(), batch_size=2, progress=False)
    for i, layer in enumerate(model.model.layers):
        for suffix, view in weight_views(layer.mlp.experts).items():
            tensors[f"{i}.{suffix}"] = view.weight.detach().clone()
    return {"routed": {m.name: m.routed_tokens for m in model.llmc_fsm_report.modules if m.routed_tokens is not None}}


@pytest.mark.distributed
def test_pruned_fused_experts_reach_every_rank(tmp_path, one_thread):
    """Found by a tester: SparseGPT on fused experts under torch.distributed broadcast nothing for an expert matrix
    (a view of the fused parameter holds no parameter of its own), so only its owner pruned it and the ranks failed
    their checksum ("ranks computed different weights ... their arithmetic differs"). Now each expert matrix is
    broadcast from the rank that pruned it: every rank holds the same experts, each matrix 50% zeros."""
    ranks = run_ranks(_experts_worker, tmp_path, world_size=2, timeout_s=90.0, join_s=240.0)
    for rank in ranks:
        assert "error" not in rank["meta"], rank["meta"]
    first, second = ranks[0]["tensors"], ranks[1]["tensors"]
    assert sorted(first) == sorted(second) and len(first) == 4 * 4 * 3
    for key, weight in first.items():
        assert torch.equal(weight, second[key]), key
        assert int((weight == 0).sum()) == weight.numel() // 2, key
    # the report's routed tokens are every rank's (B3, session 30: rank 0's only), as one process counts them
    one: dict[str, torch.Tensor] = {}
    routed = _experts_worker(0, tmp_path, one)["routed"]
    assert len(routed) == 4 * 4 * 3 and sum(routed.values()) > 0
    assert ranks[0]["meta"]["result"]["routed"] == ranks[1]["meta"]["result"]["routed"] == routed


def _static_scales_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("llmc_fsm_quantization").addHandler(Keep())
    for observer in ("minmax", "static_minmax"):
        model = llama(layers=LAYERS)
        inputs = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "observer": observer}
        scheme = {"preset": "FP8", "input_activations": inputs}
        llmc_fsm.oneshot(model=model, recipe={"s": {"QuantizationModifier": {"scheme": scheme, "ignore": ["lm_head"]}}},
                         dataset=windows(), batch_size=2, progress=False)  # fmt: skip
        tensors.update({f"{observer}.{n}": p.detach().clone() for n, p in model.named_parameters()
                        if n.endswith("input_scale")})  # fmt: skip
    return {"warnings": [line for line in lines if "torch.distributed" in line]}


@pytest.mark.distributed
def test_static_input_scales_under_ranks_say_when_they_differ_from_one_process(tmp_path, one_thread):
    """B3's case (session 30): FP8 static input scales with the default observer (minmax, a moving average) came out
    up to 18% apart from one process's on 2 ranks, without a word: each rank's moving average over its own samples,
    averaged over the ranks (as llm-compressor does). Now one line says so and names static_minmax, with which the
    scales equal one process's."""
    ranks = run_ranks(_static_scales_worker, tmp_path, world_size=2, timeout_s=90.0, join_s=240.0)
    for rank in ranks:
        assert "error" not in rank["meta"], rank["meta"]
        assert rank["meta"]["result"]["warnings"] == [
            "QuantizationModifier: under torch.distributed the input ranges of observer minmax are each rank's (a "
            "moving average or the last observation, over that rank's samples), averaged over the ranks as "
            "llm-compressor does: the static input scales differ from one process's; observer: static_minmax gives "
            "one process's exactly"
        ]
    one: dict[str, torch.Tensor] = {}
    assert _static_scales_worker(0, tmp_path, one) == {"warnings": []}
    assert sorted(one) == sorted(ranks[0]["tensors"]) and len(one) == 2 * 7 * LAYERS
    for name, scale in one.items():
        assert torch.equal(ranks[0]["tensors"][name], ranks[1]["tensors"][name]), name
        assert torch.equal(ranks[0]["tensors"][name], scale) == name.startswith("static_minmax."), name


FP8_RECIPES = {
    "rtn": {"s": {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}}},
    "gptq": {"s": {"GPTQModifier": {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}}},
}


def _fp8_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    work = {}
    for name, recipe in FP8_RECIPES.items():
        model = llama(layers=LAYERS)
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=windows(), batch_size=2, progress=False)
        tensors.update({f"{name}/{n}": t.detach().clone() for n, t in model.state_dict().items()})
        work[name] = [w["modules"] for w in model.llmc_fsm_report.execution.get("compress_per_rank", [])]
    return work


@pytest.mark.distributed
def test_fp8_dynamic_shared_by_two_ranks_equals_one_process_bitwise(tmp_path, one_thread):
    """Found by a tester: FP8_DYNAMIC (RTN or GPTQ) under torch.distributed always failed: the owner broadcast the
    float8 weight_zero_point, which gloo has no type for ("Invalid scalar type"), and the message blamed another rank.
    Now a dtype gloo lacks travels as the bytes of the tensor: the ranks share the work and every tensor, float8 ones
    included, is bit for bit the one-process tensor."""
    ranks = run_ranks(_fp8_worker, tmp_path, world_size=2, timeout_s=90.0, join_s=240.0)
    for rank in ranks:
        assert "error" not in rank["meta"], rank["meta"]
    for name in FP8_RECIPES:  # the work was shared: each rank compressed some of the 14 targets
        work = ranks[0]["meta"]["result"][name]
        assert len(work) == 2 and sum(work) == len(TARGETS) and min(work) > 0, work
    one: dict[str, torch.Tensor] = {}
    _fp8_worker(0, tmp_path, one)
    assert sorted(one) == sorted(ranks[0]["tensors"]) == sorted(ranks[1]["tensors"])
    zero_points = [k for k in one if k.endswith("weight_zero_point")]
    assert len(zero_points) == 2 * len(TARGETS) and {one[k].dtype for k in zero_points} == {torch.float8_e4m3fn}
    for key, tensor in one.items():
        for rank in ranks:
            mine = rank["tensors"][key]
            assert mine.dtype == tensor.dtype and torch.equal(mine.view(torch.uint8), tensor.view(torch.uint8)), key


def _quantized_experts_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_families import build

    from llmc_fsm.toolkit import weight_views

    scheme = {"preset": "W4A16", "weights": {"group_size": 32}}
    recipe = {"s": {"GPTQModifier": {"scheme": scheme, "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    out: dict[str, Any] = {}
    for data, dataset in {"6x24": windows(), "2x3": windows()[:2, :3]}.items():
        model = build("qwen3_moe")
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=dataset, batch_size=2, progress=False)
        for i, layer in enumerate(model.model.layers):
            for suffix, view in weight_views(layer.mlp.experts).items():
                tensors[f"{data}/{i}.{suffix}"] = view.weight.detach().clone()
                for key, value in view.quantized_params.items():
                    tensors[f"{data}/{i}.{suffix}.{key}"] = value.detach().clone()
        report = model.llmc_fsm_report
        out[data] = {
            "routed": {m.name: m.routed_tokens for m in report.modules if m.routed_tokens is not None},
            "every_rank": [w.get("every_rank") for w in report.execution.get("compress_per_rank", [])],
        }
    return out


@pytest.mark.distributed
def test_gptq_on_fused_experts_under_two_ranks_equals_one_process(tmp_path, one_thread):
    """GPTQ on fused experts (Qwen3-MoE) under torch.distributed was refused ("quantizing fused experts under
    torch.distributed is not implemented"). Now each rank sums the experts' Hessians and routed-token counts over the
    ranks before it decides which experts got no token (those are rounded to nearest), and quantizes every expert
    matrix itself (their quantization parameters live on views no broadcast reaches): the weights and parameters
    equal one process's bitwise (each GPTQ sweep sees the same summed Hessian), and the report counts every rank's
    routed tokens."""
    ranks = run_ranks(_quantized_experts_worker, tmp_path, world_size=2, timeout_s=90.0, join_s=300.0)
    for rank in ranks:
        assert "error" not in rank["meta"], rank["meta"]
    one: dict[str, torch.Tensor] = {}
    single = _quantized_experts_worker(0, tmp_path, one)
    first, second = ranks[0]["tensors"], ranks[1]["tensors"]
    assert sorted(first) == sorted(second) == sorted(one)
    assert len(one) == 2 * 4 * 4 * 3 * 3  # 2 datasets, 4 layers, 4 experts, 3 matrices: weight, scale, zero point
    for key, value in one.items():
        assert torch.equal(first[key], second[key]), key
        assert torch.equal(first[key], value), key
    for data in ("6x24", "2x3"):
        mine = [rank["meta"]["result"][data] for rank in ranks]
        assert mine[0]["routed"] == mine[1]["routed"] == single[data]["routed"]
        assert mine[0]["every_rank"] == mine[1]["every_rank"] == [4 * 4 * 3, 4 * 4 * 3]  # the expert matrices
        assert single[data]["every_rank"] == []  # one process: no ranks
    assert min(single["6x24"]["routed"].values()) > 0
    idle = [name for name, count in single["2x3"]["routed"].items() if count == 0]
    assert idle, "the short data leaves some expert without a token: rounded to nearest on every rank"
