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
from test_expert_quantization import (
    MORE,
    SCHEME,
    _assert_gptq_equal,
    _assert_reloads_as_in_memory,
    _capture,
    _experts_modules,
    _fp8_tensor,
    _reload,
    _routed_input_maxima,
    _saved,
)
from tiny_families import build
from torch.nn import functional as F

import llmc_fsm
from llmc_fsm import Session
from llmc_fsm.pipeline.sequential import run_sequential
from llmc_fsm.toolkit import weight_views

DATA = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
CONFIG_KEY = {
    "mixtral": "num_local_experts",
    "qwen3_moe": "num_experts",
    "gpt_oss": "num_local_experts",
    "deepseek_v3": "n_routed_experts",
    "ernie4_5_moe": "moe_num_experts",
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


def _run(model, data=DATA, **kwargs):
    session = Session([REAPPruningModifier(**kwargs)])
    session.initialize(model=model, calibration_data=data)
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


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "ernie4_5_moe"])
def test_llmcompressor_recipe_prunes_experts_and_the_smaller_model_reloads(tmp_path, family):
    """llm-compressor's recipe spelling; the saved model has 2 experts per layer, reloads with every key and the
    in-memory logits; ``report_path`` lists the kept experts. Ernie 4.5: its score-correction bias ``[1, experts]``
    in ``gate.moe_statics`` is cut too (B2, session 31: the next forward failed on a size mismatch)."""
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


@pytest.mark.parametrize("same_stage", [True, False], ids=["one-stage", "two-stages"])
def test_sparsegpt_prunes_the_kept_experts_in_reap_s_stage_or_after_it(tmp_path, same_stage):
    """SparseGPT selects per-expert views at initialize; in REAP's stage (after it; refused before session 26) it
    follows the experts REAP keeps, in a later stage it selects the kept ones: either way every kept expert matrix is
    50% zeros, the report names each kept matrix once under its new index, and the output reloads."""
    model = build("mixtral")
    sparse = {"SparseGPTModifier": {"sparsity": 0.5, "ignore": IGNORE_ROUTERS}}
    stages = {"a": {"REAPPruningModifier": {"sparsity": 0.5}, **sparse}} if same_stage else {
        "a": {"REAPPruningModifier": {"sparsity": 0.5}}, "b": sparse}  # fmt: skip
    llmc_fsm.oneshot(model=model, recipe=stages, dataset=DATA, output_dir=tmp_path / "b", progress=False)
    names = [m.name for m in model.llmc_fsm_report.modules if ".experts." in m.name]
    assert sorted(names) == sorted(
        f"model.layers.{i}.mlp.experts.{j}.{m}"
        for i in range(4)
        for j in range(2)
        for m in ("gate_proj", "up_proj", "down_proj")
    )
    for layer in model.model.layers:
        for view in weight_views(layer.mlp.experts).values():
            assert int((view.weight == 0).sum()) == view.weight.numel() // 2
    reloaded, loading = type(model).from_pretrained(tmp_path / "b", output_loading_info=True)
    assert (sorted(loading["missing_keys"]), sorted(loading["unexpected_keys"])) == ([], [])
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(DATA[:2]).logits, model(DATA[:2]).logits)


IGNORE_ROUTERS = ["lm_head", "re:.*mlp.gate$"]
GPTQ = {"scheme": SCHEME, "ignore": IGNORE_ROUTERS}


def _in_reap_stage(tmp_path, model, quantizer, data):
    """``oneshot`` of REAP (sparsity 0.5) then ``quantizer`` (``{name: arguments}``) in one stage; the experts kept
    per block (REAP's report)."""
    recipe = {"s": {"REAPPruningModifier": {"sparsity": 0.5, "report_path": str(tmp_path / "kept.json")}, **quantizer}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=tmp_path / "o", progress=False)
    return json.loads((tmp_path / "kept.json").read_text())


def test_gptq_in_reap_s_stage_quantizes_each_kept_expert_from_the_tokens_routed_to_it_before_the_drop(tmp_path):
    """llm-compressor's examples/reap_expert_pruning/qwen38_example.py form (REAP, then a quantizer, in one stage;
    refused before session 26): each layer calibrates once with its 4 experts; layer 0 keeps the experts REAP alone
    keeps on the same inputs; kept expert j (formerly ``kept[j]``) is the float64 GPTQ of its original matrices with
    the Hessian of the tokens the unpruned router sent to it, reported under its new name with that token count, and
    no result is left under a dropped or former name; the checkpoint reloads with 2 experts per layer, the experts
    and the logits equal to the in-memory model's."""
    model = build("mixtral")
    alone = _run(copy.deepcopy(model), data=MORE, sparsity=0.5)
    experts = _experts_modules(model)
    originals = {n: (m.gate_up_proj.detach().clone(), m.down_proj.detach().clone()) for n, m in experts.items()}
    captures = {n: _capture(m) for n, m in experts.items()}
    kept = _in_reap_stage(tmp_path, model, {"GPTQModifier": {"scheme": SCHEME, "ignore": IGNORE_ROUTERS}}, MORE)
    for _, handles in captures.values():
        for handle in handles:
            handle.remove()
    assert kept["model.layers.0.mlp"] == alone.retained["model.layers.0.mlp"]
    assert model.config.num_local_experts == 2
    report = model.llmc_fsm_report
    assert {b: r["kept"] for b, r in report.expert_pruning["REAPPruningModifier (s)"].items()} == kept
    assert (
        "REAPPruningModifier (s): dropped 2 of 4 experts in each of 4 mixture-of-experts blocks (the experts kept, "
        "their scores and routed tokens per block: report.json expert_pruning)"
    ) in report.format_table()
    saved = json.loads((tmp_path / "o" / "report.json").read_text())["expert_pruning"]["REAPPruningModifier (s)"]
    assert saved["model.layers.0.mlp"]["kept"] == kept["model.layers.0.mlp"]
    assert saved["model.layers.0.mlp"]["routed_tokens"] == alone.expert_tokens["model.layers.0.mlp"]
    by_name = {m.name: m for m in model.llmc_fsm_report.modules}
    inter = model.config.intermediate_size
    for name, module in experts.items():
        calls = captures[name][0]
        assert calls and all(gu.shape[0] == 4 for _, _, gu in calls)  # calibrated before the drop
        gate_up, down = originals[name]
        keep = kept[name.removesuffix(".experts")]
        assert module.num_experts == 2 and len(keep) == 2
        views = weight_views(module)
        for j, e in enumerate(keep):
            xs = [x[(index == e).any(-1)].double() for x, index, _ in calls]
            hs = [F.silu(x @ gate_up[e, :inter].double().T) * (x @ gate_up[e, inter:].double().T) for x in xs]
            h_in, h_down = sum(x.T @ x for x in xs), sum(h.T @ h for h in hs)
            tokens = sum(x.shape[0] for x in xs)
            _assert_gptq_equal(views[f"{j}.gate_proj"].weight, gate_up[e, :inter], h_in, f"{name}.{j}.gate_proj")
            _assert_gptq_equal(views[f"{j}.up_proj"].weight, gate_up[e, inter:], h_in, f"{name}.{j}.up_proj")
            _assert_gptq_equal(views[f"{j}.down_proj"].weight, down[e], h_down, f"{name}.{j}.down_proj")
            for matrix in ("gate_proj", "up_proj", "down_proj"):
                entry = by_name[f"{name}.{j}.{matrix}"]
                assert (entry.bits, entry.routed_tokens) == (4, tokens) and tokens > 0
    assert sorted(n for n in by_name if ".experts." in n) == sorted(
        f"{name}.{j}.{matrix}" for name in experts for j in range(2) for matrix in ("gate_proj", "up_proj", "down_proj")
    )
    _assert_reloads_as_in_memory(tmp_path / "o", "mixtral", model, experts)


def test_static_input_scales_in_reap_s_stage_follow_each_kept_expert_to_its_new_index(tmp_path):
    """QuantizationModifier FP8 (static per-tensor input scales) after REAP in one stage, Qwen3-MoE: kept expert j
    holds its former expert's matrices rounded to FP8 by hand and the input scale of the tokens routed to that
    former expert (largest |input| / 448), saved under expert j's checkpoint name; the reload reports exactly those
    input scales as unexpected (transformers runs fused experts dense), experts and logits equal."""
    model = build("qwen3_moe")
    experts = _experts_modules(model)
    originals = {f"{n}.{s}": v.weight.detach().clone() for n, m in experts.items() for s, v in weight_views(m).items()}
    captured = {name: _routed_input_maxima(module) for name, module in experts.items()}
    kept = _in_reap_stage(tmp_path, model, {"QuantizationModifier": {"scheme": "FP8", "ignore": IGNORE_ROUTERS}}, DATA)
    for _, handles in captured.values():
        for handle in handles:
            handle.remove()
    unexpected = []
    for name, module in experts.items():
        maxima = captured[name][0]
        keep = kept[name.removesuffix(".experts")]
        for j, e in enumerate(keep):
            for matrix in ("gate_proj", "up_proj", "down_proj"):
                view = weight_views(module)[f"{j}.{matrix}"]
                want, scale = _fp8_tensor(originals[f"{name}.{e}.{matrix}"])
                assert torch.equal(view.weight, want) and torch.equal(view.quantized_params["weight_scale"], scale)
                got = view.quantized_params["input_scale"]
                assert torch.equal(got, torch.tensor([maxima[f"{e}.{matrix}"]]) / 448.0), f"{name}.{j}.{matrix}"
                assert view.checkpoint_name == f"{name}.{j}.{matrix}"
                unexpected.append(f"{view.checkpoint_name}.input_scale")
    reloaded, info = _reload(tmp_path / "o", "qwen3_moe")
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], sorted(unexpected))
    assert reloaded.config.num_experts == 2
    with torch.no_grad():
        assert torch.equal(reloaded(DATA[:2]).logits, model(DATA[:2]).logits)


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (
            {"s": {"GPTQModifier": GPTQ, "REAPPruningModifier": {"sparsity": 0.5}}},
            "REAPPruningModifier of stage 's' would compress 48 modules that GPTQModifier of stage 's' quantizes "
            "before it, e.g. model.layers.0.mlp.experts.0.down_proj; prune first, then quantize: put the sparsity "
            "stage (or modifier) before the quantization one in the recipe",
        ),
        (  # found by a tester: the experts were written dense under a quantized config, exit 0
            {"a": {"GPTQModifier": GPTQ}, "b": {"REAPPruningModifier": {"sparsity": 0.5}}},
            "REAPPruningModifier of stage 'b' would compress 48 modules that GPTQModifier of stage 'a' quantizes "
            "before it, e.g. model.layers.0.mlp.experts.0.down_proj; prune first, then quantize: put the sparsity "
            "stage (or modifier) before the quantization one in the recipe",
        ),
        (
            {"s": {"SparseGPTModifier": {"sparsity": 0.5, "ignore": IGNORE_ROUTERS},
                   "REAPPruningModifier": {"sparsity": 0.5}}},
            "REAPPruningModifier: SparseGPTModifier comes before it in the same stage and targets 48 modules of the "
            "MoE blocks whose experts REAP drops (e.g. model.layers.0.mlp.experts.0.down_proj); put "
            "REAPPruningModifier before SparseGPTModifier (REAP drops a layer's experts at its end, before the layer "
            "is compressed)",
        ),
        (
            {"s": {"REAPPruningModifier": {"sparsity": 0.5},
                   "AutoRoundModifier": {"scheme": SCHEME, "iters": 0, "ignore": IGNORE_ROUTERS}}},
            "REAPPruningModifier: AutoRoundModifier in the same stage targets 48 modules of the MoE blocks whose "
            "experts REAP drops (e.g. model.layers.0.mlp.experts.0.down_proj) and cannot follow the experts' "
            "renumbering; put REAPPruningModifier in its own stage before it",
        ),
    ],
    ids=["quantizer-first", "quantizer-stage-first", "sparsegpt-first", "autoround"],
)
def test_what_cannot_follow_the_dropped_experts_is_refused_before_any_work(tmp_path, stages, message):
    """One line before any work (one-shot's checks; they ran at calibration start before, after earlier stages and
    with the Python API's advice); the weights as they were, nothing on disk."""
    model = build("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=stages, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    assert str(info.value) == message
    after = model.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert not (tmp_path / "o").exists()


def test_a_session_driven_by_hand_refuses_a_modifier_before_reap_at_calibration_start():
    """Without one-shot's checks, the session checks the same at calibration start, before any weight changes."""
    from llmc_fsm_pruning import SparseGPTModifier

    model = build("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    session = Session([SparseGPTModifier(sparsity=0.5, ignore=IGNORE_ROUTERS), REAPPruningModifier(sparsity=0.5)])
    session.initialize(model=model, calibration_data=DATA)
    with pytest.raises(llmc_fsm.ModifierError) as info:
        session.calibration_start()
    assert "REAPPruningModifier: SparseGPTModifier comes before it in the same stage" in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_reap_and_gptq_in_one_stage_write_the_same_checkpoint_from_memory_and_a_directory_and_refuse_low_memory(
    tmp_path,
):
    """From a model directory (the command's default path: REAP does not stream, so it runs in memory) the job writes
    the checkpoint of the in-memory run tensor for tensor (2 experts per layer, packed), its expert count and
    perplexity; ``low_memory`` is refused before any work, saying why (it was said to act "on the whole model")."""
    from tiny_llama import calibration_text, compress_on_every_path, word_tokenizer

    text = calibration_text()
    (tmp_path / "cal.txt").write_text(text)
    tokenizer = word_tokenizer(text)
    build("qwen3_moe").save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    recipe = {"s": {"REAPPruningModifier": {"sparsity": 0.5},
                    "GPTQModifier": {"scheme": SCHEME, "ignore": IGNORE_ROUTERS}}}  # fmt: skip
    runs = compress_on_every_path(tmp_path, recipe, tokenizer, paths=("memory", "streamed"))
    memory, streamed = runs["memory"][1], runs["streamed"][1]
    assert sum(".mlp.experts." in k and k.endswith("weight_packed") for k in memory) == 4 * 2 * 3
    assert sorted(streamed) == sorted(memory) and all(torch.equal(streamed[k], v) for k, v in memory.items())
    assert runs["streamed"][2] == runs["memory"][2]
    for path in ("memory", "streamed"):
        assert json.loads((tmp_path / path / "config.json").read_text())["num_local_experts"] == 2
    with pytest.raises(ValueError) as info:
        compress_on_every_path(tmp_path, recipe, tokenizer, paths=("low_memory",))
    assert str(info.value) == (
        "low_memory (--low-memory) cannot run this job: REAPPruningModifier: it drops experts, which changes the "
        "shapes of the experts' parameters and the config's expert count; the layer-by-layer writer keeps the "
        "checkpoint's shapes (not implemented); run without low_memory"
    )
    assert not (tmp_path / "low_memory").exists()


def test_a_report_path_inside_the_output_directory_is_refused_before_any_work(tmp_path):
    """Found by a tester: REAP wrote its report into the output directory, which the run then replaced with the
    output it wrote elsewhere: the file was gone, nothing said. Now refused before any work, nothing on disk."""
    model = build("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = tmp_path / "o"
    recipe = {"s": {"REAPPruningModifier": {"sparsity": 0.5, "report_path": str(out / "reap.json")}}}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=out, progress=False)
    assert str(info.value) == (
        f"REAPPruningModifier: report_path {str(out / 'reap.json')!r} is inside the output directory {str(out)!r}, "
        "which the run writes elsewhere and moves into place when it finishes, replacing what is there; give a "
        "report_path outside it (REAP's kept experts are in the output's report.json too: expert_pruning)"
    )
    assert not out.exists() and sorted(tmp_path.iterdir()) == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_torch_distributed_is_refused_before_an_earlier_stage_runs(tmp_path, monkeypatch):
    """Found by a tester (2 gloo ranks): REAP refused torch.distributed at its initialize, after an earlier stage had
    pruned the attention in memory. Now refused by its checks, before any work (REAP told it runs under
    torch.distributed: the refusal does not depend on the ranks)."""
    from llmc_fsm_pruning import reap as reap_module

    monkeypatch.setattr(reap_module, "is_distributed", lambda: True)
    model = build("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stages = {"a": {"SparseGPTModifier": {"sparsity": 0.5, "targets": ["re:.*self_attn.*"]}},
              "b": {"REAPPruningModifier": {"sparsity": 0.5}}}  # fmt: skip
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=stages, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    assert str(info.value) == (
        "REAPPruningModifier: torch.distributed runs are not implemented (scores are not reduced); run on one process"
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "o").exists()


def test_reap_in_the_stage_leaves_the_dense_layers_compressed_as_without_it(tmp_path):
    """Found by a tester: REAP in a stage made every layer take the pipeline's plain order, dense ones included
    (DeepSeek-V3's first layer: GPTQ's weights changed with REAP added). Now a layer holding no MoE block keeps the
    grouped order: its GPTQ weights equal those of GPTQ alone, bit for bit."""
    alone, with_reap = build("deepseek_v3"), build("deepseek_v3")
    assert not hasattr(alone.model.layers[0].mlp, "experts")  # the dense first layer
    llmc_fsm.oneshot(model=alone, recipe={"s": {"GPTQModifier": GPTQ}}, dataset=MORE, output_dir=tmp_path / "a",
                     progress=False)  # fmt: skip
    stage = {"s": {"REAPPruningModifier": {"sparsity": 0.5}, "GPTQModifier": GPTQ}}
    llmc_fsm.oneshot(model=with_reap, recipe=stage, dataset=MORE, output_dir=tmp_path / "b", progress=False)
    dense = {k: v for k, v in alone.model.layers[0].state_dict().items() if k.endswith("weight")}
    again = with_reap.model.layers[0].state_dict()
    assert len(dense) >= 6 and all(torch.equal(again[k], v) for k, v in dense.items())


def test_the_report_calls_targeted_what_the_follower_compressed_under_its_new_name(tmp_path):
    """Found by a tester: with a follower targeting some experts only (SparseGPT on experts 0 and 1), the report
    listed its targets under the names they had before the drop, so a kept expert it never touched was "targeted"
    (0% sparse, dragging the targeted sparsity down). The targeted expert matrices are now exactly the 50% sparse
    ones, under their new names."""
    model = build("mixtral")
    sparse = {"sparsity": 0.5, "targets": [r"re:.*experts\.[01]\.(gate|up|down)_proj$"]}
    kept = _in_reap_stage(tmp_path, model, {"SparseGPTModifier": sparse}, DATA)
    report = model.llmc_fsm_report
    targeted = {n for n in report.targeted if ".experts." in n}
    sparse_now = {m.name for m in report.modules if ".experts." in m.name and m.zeros * 2 == m.numel}
    assert targeted == sparse_now and targeted
    assert any(keep != [0, 1] for keep in kept.values())  # some kept expert moved to index 0 or 1: the case here
    assert report.total_sparsity == pytest.approx(0.5)


def test_low_memory_names_reap_first_in_a_recipe_of_several_stages(tmp_path):
    """Found by a tester: with two stages, low_memory first asked for fuse_stages, then (with it) refused REAP; the
    modifier no flag makes stream is now said first, before any work."""
    build("mixtral").save_pretrained(tmp_path / "src")
    stages = {"a": {"SparseGPTModifier": {"sparsity": 0.5, "targets": ["re:.*self_attn.*"]}},
              "b": {"REAPPruningModifier": {"sparsity": 0.5}}}  # fmt: skip
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(tmp_path / "src"), recipe=stages, dataset=DATA, output_dir=tmp_path / "o",
                         low_memory=True, progress=False)  # fmt: skip
    assert str(info.value).startswith(
        "low_memory (--low-memory) cannot run this job: REAPPruningModifier: it drops experts"
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "follower",
    [{"GPTQModifier": GPTQ}, {"QuantizationModifier": {"scheme": "FP8", "ignore": IGNORE_ROUTERS}}, {}],
    ids=["gptq", "fp8-static", "alone"],
)
def test_a_run_killed_after_two_layers_resumes_them_pruned_and_writes_the_same_checkpoint(
    tmp_path, monkeypatch, follower
):
    """REAP (alone or with a follower in its stage) keeps per-layer progress (it kept none: a resumed run started
    again from the first layer): a run killed after layer 1 is saved restores layers 0 and 1 with their experts
    dropped as the interrupted run dropped them (the followers' targets renamed the same way) and writes the
    uninterrupted run's checkpoint tensor for tensor, with the same experts kept per block."""
    from llmc_fsm.oneshot_job.resume import LayerProgress

    recipe = {"s": {"REAPPruningModifier": {"sparsity": 0.5}, **follower}}
    kw = {"recipe": recipe, "dataset": MORE, "progress": False}
    ref = llmc_fsm.oneshot(model=build("mixtral"), output_dir=tmp_path / "ref", **kw)
    original_save, original_restore = LayerProgress.save, LayerProgress.restore
    restored = []

    def save(self, index, module):
        original_save(self, index, module)
        if index == 1:
            raise KeyboardInterrupt

    def restore(self, index, module):
        restored.append(index)
        original_restore(self, index, module)

    with monkeypatch.context() as m:
        m.setattr(LayerProgress, "save", save)
        with pytest.raises(KeyboardInterrupt):
            llmc_fsm.oneshot(model=build("mixtral"), output_dir=tmp_path / "o", **kw)
    monkeypatch.setattr(LayerProgress, "restore", restore)
    out = llmc_fsm.oneshot(model=build("mixtral"), output_dir=tmp_path / "o", resume=True, **kw)
    assert restored == [0, 1]
    a, b = _saved(tmp_path / "ref"), _saved(tmp_path / "o")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert out.llmc_fsm_report.expert_pruning == ref.llmc_fsm_report.expert_pruning
    assert out.config.num_local_experts == 2
    names = {m.name for m in out.llmc_fsm_report.modules if m.bits is not None or m.zeros}
    assert names == {m.name for m in ref.llmc_fsm_report.modules if m.bits is not None or m.zeros}


def test_overwrite_refuses_to_replace_an_output_directory_holding_the_run_s_own_input_files(tmp_path, capsys):
    """Found by a README-only newcomer: with --overwrite, a recipe and a dataset file kept inside the output
    directory were deleted when the run replaced that directory (exit 0, nothing said). Refused before any work,
    each file named; the files and the earlier output stay."""
    from llmc_fsm.cli import main
    from tiny_llama import calibration_text

    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("an earlier output")
    recipe, data = out / "recipe.yaml", out / "data.txt"
    recipe.write_text("s:\n  modifiers:\n    - REAPPruningModifier: {sparsity: 0.5}\n")
    data.write_text(calibration_text())
    build("mixtral").save_pretrained(tmp_path / "src")
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(tmp_path / "src"), recipe=str(recipe), dataset=str(tmp_path / "src" / "none"),
                         output_dir=out, overwrite=True, progress=False)  # fmt: skip
    assert str(info.value) == (
        f"the recipe file {str(recipe)!r} is inside the output directory {str(out)!r}, which overwrite (--overwrite) "
        "replaces when the run finishes, deleting it: move it out of that directory first"
    )
    outside = tmp_path / "recipe.yaml"
    outside.write_text(recipe.read_text())
    args = ["oneshot", "--model", str(tmp_path / "src"), "--recipe", str(outside), "--dataset", str(data),
            "--output", str(out), "--overwrite", "--no-progress"]  # fmt: skip
    assert main(args) == 1
    assert capsys.readouterr().err.strip().endswith(
        f"the dataset file {str(data)!r} is inside the output directory {str(out)!r}, which overwrite (--overwrite) "
        "replaces when the run finishes, deleting it: move it out of that directory first"
    )
    assert sorted(p.name for p in out.iterdir()) == ["data.txt", "keep.txt", "recipe.yaml"]
