"""Smoothing under torch.distributed (2 ranks, gloo, CPU): every rank folds the scales of one process.

Each rank runs its half of the calibration windows; SmoothQuant's max |x| per channel (reduced by maximum) gives
the one-process scales exactly, AWQ's mean |x|, block errors and clipping scores (summed in float64) the same
choices. 2 spawned processes join a gloo group through a file rendezvous in ``tmp_path`` and write their results
(tensors as safetensors, the rest as JSON metadata): :func:`llmc_fsm.testing.run_ranks`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from llmc_fsm_quantization import AWQModifier, QuantizationModifier, SmoothQuantModifier
from test_smoothquant import tiny

import llmc_fsm
from llmc_fsm.testing import run_ranks

WORLD = 2
W4G16 = {"preset": "W4A16_ASYM", "weights": {"group_size": 16}}
RECIPES: dict[str, Any] = {
    "smoothquant": lambda: [SmoothQuantModifier(smoothing_strength=0.8), QuantizationModifier(scheme="W8A8")],
    "awq": lambda: [AWQModifier(apply_clip=True, clip_n_sample_token=50), QuantizationModifier(scheme=W4G16)],
}


def windows() -> torch.Tensor:
    return torch.randint(0, 128, (6, 32), generator=torch.Generator().manual_seed(3))  # 3 + 3 windows


def _run(name: str) -> tuple[torch.nn.Module, dict[str, Any], dict[str, Any]]:
    """The model, its report and the smoothing modifier's clipping results after the one-shot run of ``name``."""
    model, recipe = tiny(), RECIPES[name]()
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=windows(), batch_size=2, progress=False, threads=1)
    return model, model.llmc_fsm_report.to_dict(), getattr(recipe[0], "clipping_results", {})


def _worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in RECIPES:
        model, report, clipping = _run(name)
        for key, value in model.state_dict().items():
            tensors[f"{name}/{key}"] = value.detach().clone()
        out[name] = {
            "smoothing": report["smoothing"],
            "per_rank": report["calibration"]["per_rank"],
            "clipping": clipping,
        }
    return out


def _launch(tmp_path: Path, join_s: float = 240.0) -> list[dict[str, Any]]:
    return run_ranks(_worker, tmp_path, world_size=WORLD, timeout_s=60.0, join_s=join_s)


@pytest.mark.distributed
def test_smoothquant_and_awq_on_two_ranks_fold_the_scales_of_one_process(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ranks = _launch(tmp_path)
    for rank in ranks:
        assert "error" not in rank["meta"], rank["meta"]
    r0, r1 = ranks[0]["tensors"], ranks[1]["tensors"]
    assert r0.keys() == r1.keys()
    assert [k for k in r0 if not torch.equal(r0[k], r1[k])] == []  # every rank holds the same model
    for name in RECIPES:
        result = ranks[0]["meta"]["result"][name]
        assert result["per_rank"] == [3, 3]
        assert result["smoothing"] == ranks[1]["meta"]["result"][name]["smoothing"]
        assert result["clipping"] == ranks[1]["meta"]["result"][name]["clipping"]
        single, report, clipping = _run(name)
        expected = report["smoothing"]
        label = next(k for k in expected if not k.endswith(" clipping"))  # AWQ's clipping: compared below
        assert sorted(result["smoothing"][label]) == sorted(expected[label])
        for smooth, values in expected[label].items():
            got = result["smoothing"][label][smooth]
            if name == "smoothquant":  # maxima: exactly the one-process values
                assert got == values, smooth
            else:  # the same exponent; errors up to the order of the float64 sums
                assert got["exponent"] == values["exponent"] and got["duo_scaling"] == values["duo_scaling"], smooth
                assert got["error"] == pytest.approx(values["error"], rel=1e-6)
                assert got["error_unsmoothed"] == pytest.approx(values["error_unsmoothed"], rel=1e-6)
        assert sorted(result["clipping"]) == sorted(clipping)
        for linear, values in clipping.items():  # 192 tokens, every 3rd: 64 of them, split 32 + 32 over the ranks
            got = result["clipping"][linear]
            assert got["tokens"] == values["tokens"] == 64
            assert (got["groups_clipped"], got["shrink_mean"], got["applied"]) == (
                values["groups_clipped"],
                values["shrink_mean"],
                values["applied"],
            ), linear
            assert got["error"] == pytest.approx(values["error"], rel=1e-6)
        for key, value in single.state_dict().items():
            if name == "smoothquant":
                assert torch.equal(r0[f"{name}/{key}"], value), key
            else:
                torch.testing.assert_close(r0[f"{name}/{key}"], value, rtol=1e-5, atol=1e-6, msg=key)


# --------------------------------------------------------------------------- fused experts
def tiny_moe() -> torch.nn.Module:
    """A 2-layer random Qwen3-MoE (transformers' fused ``Qwen3MoeExperts``), 8 experts, one per token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=1, decoder_sparse_step=1, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def moe_windows() -> torch.Tensor:
    return torch.randint(0, 128, (2, 4), generator=torch.Generator().manual_seed(3))  # one window of 4 tokens a rank


def _moe_run() -> tuple[torch.nn.Module, AWQModifier]:
    model, ignore = tiny_moe(), ["lm_head", "re:.*mlp.gate$"]
    scheme = {"preset": "W4A16", "weights": {"group_size": 16}}
    awq = AWQModifier(ignore=ignore, apply_clip=True, clip_n_sample_token=2)  # every 4th token (8 in a layer)
    recipe = [awq, QuantizationModifier(scheme=scheme, ignore=ignore)]
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=moe_windows(), batch_size=1, progress=False, threads=1)
    return model, recipe[0]


def _moe_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    model, awq = _moe_run()
    tensors.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    return {"smoothing": awq.smoothing_results, "clipping": awq.clipping_results}


@pytest.mark.distributed
def test_awq_smooths_fused_experts_on_two_ranks_as_one_process_with_experts_one_rank_never_routes(
    tmp_path, monkeypatch
) -> None:
    """AWQ on fused experts under torch.distributed was refused until session 39 ("a rank may see no token routed to
    an expert that another rank sees"). With 8 experts, one per token and one 4-token window per rank, the ranks route
    to different experts; a rank without an expert's tokens now takes part in its search and clipping with none, and
    the model, scales and results equal one process's at the per-rank batch size (1) bit for bit. Clipping samples
    every 4th token each expert receives, counted from its own tokens on the lower ranks (a re-tester found each
    expert's count started at the layer's: rank 1 clipped on other tokens than one process)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = tiny_moe()
    routed = []
    router = model.model.layers[0].mlp.gate  # its output: logits, scores, expert indices [tokens, top_k]
    handle = router.register_forward_hook(lambda m, a, out: routed.append(set(out[2].flatten().tolist())))
    with torch.no_grad():
        for window in moe_windows():  # layer 0's router (float, before any smoothing) on each rank's window
            model(window[None])
    handle.remove()
    assert routed == [{1, 6}, {1, 4, 6}]  # expert 4 gets rank 1's tokens only; experts 0, 2, 3, 5 and 7 none
    ranks = run_ranks(_moe_worker, tmp_path, world_size=WORLD, timeout_s=60.0, join_s=300.0)
    for rank in ranks:
        assert "error" not in rank["meta"], rank["meta"]
    r0, r1 = ranks[0]["tensors"], ranks[1]["tensors"]
    single, awq = _moe_run()
    expected = single.state_dict()
    assert r0.keys() == r1.keys() == expected.keys()
    assert [k for k in r0 if not torch.equal(r0[k], r1[k])] == []
    assert [k for k in expected if not torch.equal(r0[k], expected[k])] == []
    experts = [k for k in awq.smoothing_results if ".experts." in k]
    assert experts and any(awq.smoothing_results[k]["exponent"] is not None for k in experts)
    assert ranks[0]["meta"]["result"]["smoothing"] == awq.smoothing_results
    clipping = ranks[0]["meta"]["result"]["clipping"]
    assert sorted(clipping) == sorted(awq.clipping_results) and any(".experts." in k for k in clipping)
    for name, values in awq.clipping_results.items():  # the errors: float64 sums over the ranks, in another order
        got = clipping[name]
        assert {k: v for k, v in got.items() if not k.startswith("error")} == {
            k: v for k, v in values.items() if not k.startswith("error")}, name  # fmt: skip
        assert got["error"] == pytest.approx(values["error"], rel=1e-6)
        assert got["error_unclipped"] == pytest.approx(values["error_unclipped"], rel=1e-6)
