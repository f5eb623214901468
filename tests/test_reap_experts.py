"""REAPPruningModifier: whole experts dropped from fused mixture-of-experts layers (issue 24, arXiv 2510.13999).

Tiny random Mixtral and Qwen3-MoE (4 experts, top-2) from ``tiny_families``. The reference scores are computed here
in float64 from each layer's inputs (captured from a model pruned by hand up to that layer), routed with the model's
own router, each expert's output computed from its weights sliced by hand.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from llmc_fsm_pruning import REAPPruningModifier
from tiny_families import build
from torch.nn import functional as F

import llmc_fsm
from llmc_fsm import Session
from llmc_fsm.pipeline.sequential import run_sequential

DATA = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
CONFIG_KEY = {
    "mixtral": "num_local_experts",
    "qwen3_moe": "num_experts",
    "gpt_oss": "num_local_experts",
    "deepseek_v3": "n_routed_experts",
}


def _blocks(model):
    return [layer.mlp for layer in model.model.layers]


def _expert_output64(experts, e, x):
    """Expert ``e`` on ``x``: ``down @ (silu(gate x) * up x)``, float64, weights sliced from the fused tensors."""
    inter = experts.down_proj.shape[2]
    gate_up, down = experts.gate_up_proj[e].double(), experts.down_proj[e].double()
    x = x.double()
    return (F.silu(x @ gate_up[:inter].T) * (x @ gate_up[inter:].T)) @ down.T


def _experts_input(model, index):
    """The hidden states ``[tokens, hidden]`` that block ``index``'s experts receive on ``DATA``."""
    seen = []
    handle = _blocks(model)[index].experts.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(DATA)
    handle.remove()
    return torch.cat(seen)


@torch.no_grad()
def _reference_scores(block, hidden):
    """(mean over routed tokens of gate weight x ||expert output||, routed token counts), float64."""
    _, weights, index = block.gate(hidden)  # the model's own router
    scores, counts = [], []
    for e in range(block.experts.num_experts):
        token, slot = torch.where(index == e)
        norms = torch.linalg.vector_norm(_expert_output64(block.experts, e, hidden[token]), dim=-1)
        counts.append(token.numel())
        scores.append(float((weights[token, slot].double() * norms).sum()) / max(token.numel(), 1))
    return scores, counts


def _prune_by_hand(block, keep):
    keep = torch.tensor(keep)
    experts = block.experts
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[keep].clone())
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach()[keep].clone())
    block.gate.weight = torch.nn.Parameter(block.gate.weight.detach()[keep].clone())
    experts.num_experts = block.gate.num_experts = len(keep)


def _run(model, **kwargs):
    session = Session([REAPPruningModifier(**kwargs)])
    session.initialize(model=model, calibration_data=DATA)
    run_sequential(session, batch_size=4, progress=False)
    modifier = session.modifiers[0]
    session.finalize()
    return modifier


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_scores_equal_a_float64_reference_layer_by_layer_and_the_lowest_experts_are_dropped(family):
    """Each layer's scores are computed on the outputs of the layers before it, already pruned (sequential)."""
    original = build(family)
    model = copy.deepcopy(original)
    modifier = _run(model, sparsity=0.5)
    reference_model = copy.deepcopy(original)
    for i, block in enumerate(_blocks(reference_model)):
        name = f"model.layers.{i}.mlp"
        scores, counts = _reference_scores(block, _experts_input(reference_model, i))
        assert modifier.expert_tokens[name] == counts
        assert sum(counts) == DATA.numel() * 2  # top-2: every token reaches two experts
        torch.testing.assert_close(torch.tensor(modifier.scores[name]), torch.tensor(scores), rtol=1e-5, atol=0)
        keep = sorted(sorted(range(4), key=lambda e: scores[e])[2:])
        assert modifier.retained[name] == keep
        kept = _blocks(model)[i]
        assert torch.equal(kept.experts.gate_up_proj, block.experts.gate_up_proj[keep])
        assert torch.equal(kept.experts.down_proj, block.experts.down_proj[keep])
        assert torch.equal(kept.gate.weight, block.gate.weight[keep])
        assert kept.experts.num_experts == kept.gate.num_experts == 2
        _prune_by_hand(block, keep)  # the next layer's inputs come from this pruned layer
    assert getattr(model.config, CONFIG_KEY[family]) == 2
    with torch.no_grad():
        assert torch.equal(model(DATA).logits, reference_model(DATA).logits)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_llmcompressor_recipe_prunes_experts_and_the_smaller_model_reloads(tmp_path, family):
    """llm-compressor's recipe spelling; the saved model has 2 experts per layer, reloads with every key and the
    in-memory logits; ``report_path`` lists the kept experts."""
    recipe = f"""
prune_stage:
  run_type: oneshot
  pruning_modifiers:
    REAPPruningModifier:
      sparsity: 0.5
      ignore: []
      report_path: {tmp_path / "reap" / "kept.json"}
"""
    model = build(family)
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    kept = json.loads((tmp_path / "reap" / "kept.json").read_text())
    blocks = [n for n, m in build(family).named_modules() if hasattr(m, "experts")]
    assert sorted(kept) == blocks and len(blocks) == (3 if family == "deepseek_v3" else 4)  # V3: layer 0 dense
    assert all(len(v) == 2 and v == sorted(v) for v in kept.values())
    reloaded, info = type(model).from_pretrained(tmp_path / "o", output_loading_info=True)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    assert getattr(reloaded.config, CONFIG_KEY[family]) == 2
    assert reloaded.model.layers[-1].mlp.experts.gate_up_proj.shape[0] == 2
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(DATA[:2]).logits, model(DATA[:2]).logits)


@pytest.mark.parametrize(
    ("family", "kwargs", "message"),
    [
        (
            "mixtral",
            {"sparsity": 0.75},
            "REAPPruningModifier: sparsity=0.75 keeps 1 of 4 experts, fewer than the router's top-k=2; "
            "lower the sparsity",
        ),
        (
            "mixtral",
            {"sparsity": 0.2},
            "REAPPruningModifier: sparsity=0.2 drops 0 of 4 experts; raise the sparsity",
        ),
        (
            "mixtral",
            {"sparsity": 0.5, "ignore": [r"layers\.0\."]},
            "REAPPruningModifier: ignore leaves model.layers.0.mlp whole while the other blocks drop experts; the "
            "config's one num_local_experts cannot describe both and transformers would not reload the model; "
            "remove them from ignore",
        ),
        (
            "llama",
            {"sparsity": 0.5},
            "REAPPruningModifier: LlamaForCausalLM has no mixture-of-experts block (a module with fused 'experts' "
            "and a 'gate'/'router') outside ignore; REAP prunes experts, use another pruning modifier",
        ),
        (
            "dbrx",
            {"sparsity": 0.5},
            "REAPPruningModifier: transformer.blocks.0.ffn.experts (DbrxExperts) is not transformers' fused experts "
            "of a known layout (3-D gate_up_proj/down_proj built with use_experts_implementation); expert pruning "
            "is implemented only for those: ignore the block (ignore: ['transformer.blocks.0.ffn']) or use another "
            "model",
        ),
    ],
    ids=["below-top-k", "drops-none", "ignore-some-blocks", "no-experts", "dbrx"],
)
def test_unsupported_input_is_refused_before_any_work(tmp_path, family, kwargs, message):
    model = build(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(
            model=model, recipe={"s": {"REAPPruningModifier": kwargs}}, dataset=DATA, output_dir=tmp_path / "o",
            progress=False,
        )  # fmt: skip
    assert str(info.value) == message
    after = model.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert model.config.to_dict() == config
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_expert_parallel_experts_are_refused():
    model = build("mixtral")
    model.model.layers[1].mlp.experts._is_expert_parallel = True
    with pytest.raises(ValueError) as info:
        REAPPruningModifier(sparsity=0.5).check_model(model)
    assert str(info.value) == (
        "REAPPruningModifier: model.layers.1.mlp.experts (MixtralExperts): expert-parallel experts (each rank holds "
        "a share of the experts); expert pruning is not implemented for it"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sparsity": 1.0}, "sparsity must be a fraction of experts in (0, 1), got 1.0"),
        ({"sparsity": 0}, "sparsity must be a fraction of experts in (0, 1), got 0"),
        ({"sparsity": True}, "sparsity must be a fraction of experts in (0, 1), got True"),
        ({"sparsity": 0.5, "report_path": "kept.txt"}, "report_path must be a path ending with .json, got 'kept.txt'"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError) as info:
        REAPPruningModifier(**kwargs)
    assert str(info.value) == message


@torch.no_grad()
def test_gpt_oss_scores_use_its_transposed_biased_experts_and_its_router_bias_is_cut():
    """GPT-OSS layer 0 (inputs: the original model's): experts stored ``[E, in, out]`` with biases, gate/up rows
    interleaved, its own clamped gate; the router has a bias, cut with its weight rows."""
    original = build("gpt_oss")
    model = copy.deepcopy(original)
    modifier = _run(model, sparsity=0.5)
    block = original.model.layers[0].mlp
    experts = block.experts
    hidden = _experts_input(original, 0).reshape(-1, 64)
    _, weights, index = block.router(hidden)
    scores = []
    for e in range(4):
        token, slot = torch.where(index == e)
        x = hidden[token].double()
        gate_up, bias = experts.gate_up_proj[e].double(), experts.gate_up_proj_bias[e].double()
        gate = (x @ gate_up[:, 0::2] + bias[0::2]).clamp(max=experts.limit)
        up = (x @ gate_up[:, 1::2] + bias[1::2]).clamp(-experts.limit, experts.limit)
        inner = (up + 1) * gate * torch.sigmoid(gate * experts.alpha)
        out = inner @ experts.down_proj[e].double() + experts.down_proj_bias[e].double()
        norms = torch.linalg.vector_norm(out, dim=-1)
        scores.append(float((weights[token, slot].double() * norms).sum()) / max(token.numel(), 1))
    torch.testing.assert_close(
        torch.tensor(modifier.scores["model.layers.0.mlp"]), torch.tensor(scores), rtol=1e-5, atol=0
    )
    keep = sorted(sorted(range(4), key=lambda e: scores[e])[2:])
    assert modifier.retained["model.layers.0.mlp"] == keep
    pruned = model.model.layers[0].mlp
    assert torch.equal(pruned.router.weight, block.router.weight[keep])
    assert torch.equal(pruned.router.bias, block.router.bias[keep])
    assert torch.equal(pruned.experts.gate_up_proj_bias, experts.gate_up_proj_bias[keep])
    assert torch.equal(pruned.experts.down_proj_bias, experts.down_proj_bias[keep])


def test_another_modifier_on_the_experts_in_the_same_stage_is_refused_and_a_later_stage_works(tmp_path):
    """SparseGPT selects per-expert views at initialize: in REAP's stage it is refused before any weight changes;
    in a later stage it prunes the 2 experts kept, and the output reloads."""
    model = build("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    same = {"a": {"REAPPruningModifier": {"sparsity": 0.5}, "SparseGPTModifier": {"sparsity": 0.5}}}
    with pytest.raises(llmc_fsm.ModifierError) as info:
        llmc_fsm.oneshot(model=model, recipe=same, dataset=DATA, output_dir=tmp_path / "a", progress=False)
    assert (
        "REAPPruningModifier: SparseGPTModifier in the same stage targets 48 modules of the MoE blocks whose experts "
        "REAP drops (e.g. model.layers.0.mlp.experts.0.down_proj); put REAPPruningModifier in its own stage before it"
    ) in str(info.value)
    after = model.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
    staged = {"a": {"REAPPruningModifier": {"sparsity": 0.5}}, "b": {"SparseGPTModifier": {"sparsity": 0.5}}}
    model = build("mixtral")
    llmc_fsm.oneshot(model=model, recipe=staged, dataset=DATA, output_dir=tmp_path / "b", progress=False)
    experts = model.model.layers[0].mlp.experts
    assert (
        experts.gate_up_proj.shape[0] == 2
        and int((experts.gate_up_proj == 0).sum()) == experts.gate_up_proj.numel() // 2
    )
    reloaded, loading = type(model).from_pretrained(tmp_path / "b", output_loading_info=True)
    assert (sorted(loading["missing_keys"]), sorted(loading["unexpected_keys"])) == ([], [])
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(DATA[:2]).logits, model(DATA[:2]).logits)
