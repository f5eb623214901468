"""AWQ / SmoothQuant on mixture-of-experts models: experts the quantizers ignore, Granite-MoE-Hybrid's shared MLP, the
weight statistic of a mapping with an ignored router, explain's lines (findings of a tester, session 38).

Tiny random models (``tiny_families``; Qwen2-MoE and Granite-MoE-Hybrid configured here). References are written
here: the expert matrices' weight mean computed from the fused parameters, the checkpoint's experts compared with the
float model's, the float function before and after random folds.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from llmc_fsm_quantization import AWQModifier, GPTQModifier, QuantizationModifier, SmoothQuantModifier
from llmc_fsm_quantization import awq as awq_module
from llmc_fsm_quantization.mappings import default_mappings, describe_mappings
from tiny_families import _TEXT, build, logits_before_and_after_random_folds
from transformers import AutoConfig, AutoModelForCausalLM

import llmc_fsm

DATA = torch.randint(3, 128, (8, 32), generator=torch.Generator().manual_seed(0))
SCHEME = {"preset": "W4A16", "weights": {"group_size": 16}}
L0 = "model.layers.0."

GRANITE = {
    "num_local_experts": 4, "num_experts_per_tok": 2, "layer_types": ["mamba", "attention", "mamba", "attention"],
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1, "shared_intermediate_size": 64,
    "mamba_expand": 2,
}  # fmt: skip
QWEN2_MOE = {
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "decoder_sparse_step": 1,
}  # fmt: skip


def _tiny(model_type: str, overrides: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**_TEXT, **overrides})).eval()


def _experts_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if ".mlp.experts." in k}


# --------------------------------------------------------------------------- 1: experts the quantizers ignore
@pytest.mark.parametrize(
    "form",
    ["awq ignore", "awq ignore, experts$", "quantizer ignore"],
)
def test_awq_smooths_gpt_oss_attention_when_its_experts_are_ignored(tmp_path, form: str) -> None:
    """Found by a tester: AWQ refused GPT-OSS ('keeps fused experts ... that no smoothing mapping reaches ... add
    're:.*mlp.experts' to the modifier's ignore') whatever the ignore said, also after following that advice, with
    the scheme on AWQ or on the QuantizationModifier. Now the attention's mappings are smoothed, the experts stay
    dense (bit for bit the float model's) and the checkpoint reloads them."""
    model = build("gpt_oss")
    before = _experts_state(model)
    if form == "quantizer ignore":
        awq = AWQModifier()
        recipe = [awq, QuantizationModifier(scheme=SCHEME, ignore=["lm_head", "re:.*mlp.router$", "re:.*mlp.experts"])]
    else:
        pattern = "re:.*mlp.experts" if form == "awq ignore" else "re:.*\\.experts$"
        awq = AWQModifier(scheme=SCHEME, ignore=["lm_head", "re:.*mlp.router$", pattern])
        recipe = [awq]
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, progress=False, output_dir=tmp_path / "o")
    assert sorted(awq.smoothing_results) == [f"model.layers.{i}.input_layernorm" for i in range(4)]
    assert all(torch.equal(before[k], v) for k, v in _experts_state(model).items())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "o")
    assert all(torch.equal(before[k], v) for k, v in _experts_state(reloaded).items())


def test_the_gpt_oss_experts_refusals_advice_makes_the_run_go_through(tmp_path) -> None:
    """The refusal of experts AWQ would quantize unsmoothed (its own scheme) ends with an ignore pattern to add; with
    it in the modifier's ignore the same recipe runs (found by a tester: it was refused again, in a loop)."""
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=build("gpt_oss"), recipe=[AWQModifier(scheme=SCHEME)], dataset=DATA, progress=False)
    message = str(info.value)
    assert message.startswith(
        "AWQModifier: GptOssForCausalLM (model_type 'gpt_oss') keeps fused experts in model.layers.{0..3}.mlp.experts "
        "that no smoothing mapping reaches (GptOssExperts adds biases to its projections), and no modifier can "
        "quantize them so that they reload: "
    )
    advised = re.search(r"add '([^']+)' to the modifier's ignore", message).group(1)
    assert advised == "re:.*mlp.experts"
    model = build("gpt_oss")
    awq = AWQModifier(scheme=SCHEME, ignore=["lm_head", advised])
    llmc_fsm.oneshot(model=model, recipe=[awq], dataset=DATA, progress=False, output_dir=tmp_path / "o")
    assert len(awq.smoothing_results) == 4


# --------------------------------------------------------------------------- 2: Granite-MoE-Hybrid's shared MLP
def test_granite_hybrid_default_mappings_reach_the_shared_mlp_and_keep_the_float_model() -> None:
    """Found by a tester: the norm mapping post_attention_layernorm -> router + experts left out
    shared_mlp.input_linear, which reads the same norm output, so the fold check refused the default mapping
    (SmoothQuant) and AWQ left the shared MLP unsmoothed. It is now a balance layer of the norm mapping, and
    input_linear's up rows -> output_linear is AWQ's; random scales folded through every default mapping leave the
    logits as they were."""
    model = _tiny("granitemoehybrid", GRANITE)
    mappings = default_mappings(model)
    norm = next(m for m in mappings if m.smooth_name == L0 + "post_attention_layernorm")
    experts = [f"{L0}block_sparse_moe.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj")]
    assert norm.balance_names == (L0 + "block_sparse_moe.router", L0 + "shared_mlp.input_linear", *experts)
    linear = [m for m in mappings if m.smooth_name == L0 + "shared_mlp.input_linear"]
    assert [m.balance_names for m in linear] == [(L0 + "shared_mlp.output_linear",)]
    before, after = logits_before_and_after_random_folds(model, mappings, DATA[:2])
    assert before.abs().max() > 0.05
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)


def test_smoothquant_w8a8_runs_on_granite_hybrid_with_its_default_mappings(tmp_path) -> None:
    """The tester's recipe (SmoothQuant 0.8 + GPTQ W8A8, experts ignored) was refused by our own fold check on our own
    default mapping; now it runs and smooths the shared MLP's input with the router and experts."""
    model = _tiny("granitemoehybrid", GRANITE)
    sq = SmoothQuantModifier(smoothing_strength=0.8)
    gptq = GPTQModifier(scheme="W8A8", targets=["Linear"], ignore=["lm_head", "re:.*block_sparse_moe.experts"])
    llmc_fsm.oneshot(model=model, recipe=[sq, gptq], dataset=DATA, progress=False, output_dir=tmp_path / "o")
    result = sq.smoothing_results[L0 + "post_attention_layernorm"]
    assert result["balance_layers"][:2] == [L0 + "block_sparse_moe.router", L0 + "shared_mlp.input_linear"]
    assert hasattr(model.model.layers[0].shared_mlp.input_linear, "weight_scale")


# --------------------------------------------------------------------------- 3: the weight mean of an MoE mapping
def _weight_mean_reference(model: torch.nn.Module) -> torch.Tensor:
    """``w_j`` of layer 0's norm mapping from its experts' gate and up rows alone (groups of 16 input columns):
    the mean over those rows of ``|W| / (max |W| of the group + 1e-6)``."""
    fused = model.model.layers[0].mlp.experts.gate_up_proj.detach()  # [experts, 2 * I, hidden]
    rows = fused.reshape(-1, fused.shape[-1]).abs()
    groups = rows.reshape(rows.shape[0], -1, 16)
    normed = (groups / (groups.amax(dim=2, keepdim=True) + 1e-6)).reshape(rows.shape)
    return normed.double().sum(0) / rows.shape[0]


def test_awq_weight_mean_leaves_out_the_ignored_router(monkeypatch) -> None:
    """Found by a tester: w of the post_attention_layernorm -> router + experts mapping counted the rows of the
    router, which the quantizer ignores (4.5e-3 off per channel); llm-compressor 0.14's _compute_layer_means skips
    a balance layer without a quantization scheme. Now w is over the experts' rows alone."""
    model = build("qwen3_moe")
    reference = _weight_mean_reference(copy.deepcopy(model))
    calls = []
    original = awq_module.awq_weight_mean

    def spy(weights, group_sizes):
        result = original(weights, group_sizes)
        calls.append((len(weights), result))
        return result

    monkeypatch.setattr(awq_module, "awq_weight_mean", spy)
    quantizer = QuantizationModifier(scheme=SCHEME, ignore=["lm_head", "re:.*mlp.gate$"])
    llmc_fsm.oneshot(model=model, recipe=[AWQModifier(), quantizer], dataset=DATA, progress=False)
    count, w_mean = calls[1]  # layer 0: input_layernorm -> q, k, v; then post_attention_layernorm
    assert count == 8  # 4 experts' gate and up rows, no router
    torch.testing.assert_close(w_mean, reference, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- 4, 6: explain
def test_describe_mappings_counts_the_shared_expert_apart_from_the_routed_experts() -> None:
    """Found by a tester: Qwen2-MoE's norm mapping was shown as 'gate_proj (5 experts)' for 4 experts and the shared
    expert's gate_proj."""
    lines = describe_mappings(default_mappings(_tiny("qwen2_moe", QWEN2_MOE)))
    assert lines[1] == (
        "post_attention_layernorm -> gate, shared_expert.gate_proj, shared_expert.up_proj, shared_expert_gate, "
        "gate_proj (4 experts), up_proj (4 experts) (4x: model.layers.{0..3}.post_attention_layernorm)"
    )


def test_explain_adds_no_knock_on_refusal_when_a_modifier_of_the_stage_refuses_the_model() -> None:
    """Found by a tester: when the stage's quantizer refused the model (fused experts it cannot write), AWQ's
    explain lines added 'refused by one-shot: AWQModifier: no modifier of this stage quantizes the balance layers
    ...', a knock-on of that refusal (one-shot gives the quantizer's)."""
    model = build("gpt_oss")
    awq, quantizer = AWQModifier(), QuantizationModifier(scheme=SCHEME)
    with pytest.raises(ValueError):
        quantizer.check_model(model)
    assert awq.explain_model(model, [awq, quantizer]) == [
        "mapping input_layernorm -> q_proj, k_proj, v_proj (4x: model.layers.{0..3}.input_layernorm)"
    ]
