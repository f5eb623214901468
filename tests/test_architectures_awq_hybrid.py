"""AWQ's default smoothing mappings on hybrid stacks, Jamba and Nemotron-H (issue 24), and on Gemma 3, whose
defaults follow llm-compressor's.

Tiny random models from ``tiny_families`` (offline configs). A mapping is right when folding any positive scales
into it leaves the float model's function unchanged (``fold_scales``, AWQ paper Sec. 3.2): checked with random
scales on every default mapping, the logits compared with the model's before; a control shows that a gateless MLP's
``up_proj -> down_proj`` folded linearly (as under a gate) does change them: the defaults fold it through relu2.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from llmc_fsm_quantization import AWQModifier, GPTQModifier
from llmc_fsm_quantization.mappings import default_mappings, unsmoothed_mixers
from tiny_families import build, config, logits_before_and_after_random_folds

import llmc_fsm
from llmc_fsm import find_decoder_layers

DATA = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
SCHEME = {"preset": "W4A16", "weights": {"group_size": 16}}


def _nemotron_h_dense() -> torch.nn.Module:
    """Nemotron-H with mamba, attention and MLP blocks and no mixture-of-experts block (its MoE blocks:
    plugins/quantization/tests/test_awq_nemotron_h.py)."""
    cfg = config("nemotron_h", layers_block_type=["mamba", "attention", "mlp", "mlp"])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


MODELS = {"jamba": lambda: build("jamba"), "nemotron_h_dense": _nemotron_h_dense}
#: the default mappings (smooth layer -> balance layers, layer 0..3), as the module graph gives them
EXPECTED = {
    "jamba": [
        "model.layers.0.pre_ff_layernorm -> feed_forward.gate_proj, feed_forward.up_proj",
        "model.layers.0.feed_forward.up_proj -> feed_forward.down_proj",
        "model.layers.1.input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj",
        "model.layers.1.pre_ff_layernorm -> feed_forward.router, "
        + ", ".join(f"feed_forward.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj")),
        *(f"model.layers.1.feed_forward.experts.{e}.up_proj -> feed_forward.experts.{e}.down_proj" for e in range(4)),
        "model.layers.2.pre_ff_layernorm -> feed_forward.gate_proj, feed_forward.up_proj",
        "model.layers.2.feed_forward.up_proj -> feed_forward.down_proj",
        "model.layers.3.input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj",
        "model.layers.3.pre_ff_layernorm -> feed_forward.router, "
        + ", ".join(f"feed_forward.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj")),
        *(f"model.layers.3.feed_forward.experts.{e}.up_proj -> feed_forward.experts.{e}.down_proj" for e in range(4)),
    ],
    "nemotron_h_dense": [
        "model.layers.1.norm -> mixer.q_proj, mixer.k_proj, mixer.v_proj",
        "model.layers.2.norm -> mixer.up_proj",
        "model.layers.2.mixer.up_proj -> mixer.down_proj",
        "model.layers.3.norm -> mixer.up_proj",
        "model.layers.3.mixer.up_proj -> mixer.down_proj",
    ],
}
UNSMOOTHED = {"jamba": ["model.layers.0.mamba", "model.layers.2.mamba"], "nemotron_h_dense": ["model.layers.0.mixer"]}


def _described(mapping) -> str:
    layer = ".".join(mapping.smooth_name.split(".")[:3]) + "."
    return f"{mapping.smooth_name} -> {', '.join(n.removeprefix(layer) for n in mapping.balance_names)}"


@pytest.mark.parametrize("family", ["jamba", "nemotron_h_dense"])
def test_default_mappings_of_hybrid_layers_keep_the_float_model(family):
    """Every default mapping, folded with random scales in [0.5, 2], leaves the logits equal (float32 rounding:
    atol 1e-5 on logits of size ~0.1-1); the mamba mixers are reached by none and named."""
    model = MODELS[family]()
    mappings = default_mappings(model)
    assert [_described(m) for m in mappings] == EXPECTED[family]
    assert list(unsmoothed_mixers(model, mappings)) == UNSMOOTHED[family]
    before, after = logits_before_and_after_random_folds(model, mappings, DATA)
    assert before.abs().max() > 0.05
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)


def test_a_gateless_mlp_up_to_down_mapping_would_change_the_model():
    """Control: why a gateless up_proj -> down_proj is not folded as under a gate. Nemotron-H's MLP computes
    down(relu2(up(x))); up's rows divided by s (not sqrt(s), the default's degree-2 fold) change the logits."""
    model = _nemotron_h_dense()
    with torch.no_grad():
        before = model(DATA).logits
        mlp = model.model.layers[2].mixer
        s = 0.5 + 1.5 * torch.rand(mlp.up_proj.out_features, generator=torch.Generator().manual_seed(1))
        mlp.up_proj.weight.div_(s[:, None])
        mlp.down_proj.weight.mul_(s[None, :])
        assert (model(DATA).logits - before).abs().max() > 1e-2


def _reload(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    return model.eval()


@pytest.mark.parametrize("family", ["jamba", "nemotron_h_dense"])
def test_awq_gptq_on_hybrid_stacks_runs_names_the_mamba_mixers_and_reloads(tmp_path, family, caplog):
    """AWQ + GPTQ W4A16 g16 (Jamba: ``mamba.dt_proj`` ignored, in_features 8 < group 16): the mappings above are
    smoothed (every expert's gate/up included), the mamba mixers are quantized unsmoothed and named in the log, and
    the output reloads with no missing or unexpected key and the in-memory model's logits."""
    model = MODELS[family]()
    source = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "model")  # from a directory: the checks run on the meta model first
    ignore = ["lm_head", "re:.*mamba\\.dt_proj$"] if family == "jamba" else ["lm_head"]
    awq = AWQModifier(ignore=ignore)
    with caplog.at_level(logging.WARNING):
        model = llmc_fsm.oneshot(
            model=str(tmp_path / "model"), recipe=[awq, GPTQModifier(scheme=SCHEME, ignore=ignore)], dataset=DATA,
            output_dir=tmp_path / "o", progress=False,
        )  # fmt: skip
    names = "model.layers.{0,2}.mamba" if family == "jamba" else "model.layers.0.mixer"
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("default smoothing mappings")]
    # once (from a directory it was logged twice: the meta model's check, then the loaded model's)
    assert [w.split(" (")[0] for w in warned] == [f"default smoothing mappings: no mapping reaches {names}"]
    assert set(awq.smoothing_results) == {e.split(" -> ")[0] for e in EXPECTED[family]}
    if family == "jamba":  # every expert matrix quantized (changed)
        for key in (
            "model.layers.1.feed_forward.experts.gate_up_proj",
            "model.layers.1.feed_forward.experts.down_proj",
        ):
            assert all(not torch.equal(model.state_dict()[key][e], source[key][e]) for e in range(4))
    reloaded = _reload(tmp_path / "o")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(DATA).logits, model(DATA).logits, rtol=0, atol=1e-5)


#: Gated DeltaNet layers (linear attention) and the projections their input norm feeds (the models' own names)
LINEAR_ATTENTION = {
    "qwen3_next": ("model.layers", ["in_proj_qkvz", "in_proj_ba"]),
    "qwen3_5_moe": ("model.layers", ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]),
    "qwen3_5_vlm": ("model.language_model.layers", ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]),
}


@pytest.mark.parametrize("family", sorted(LINEAR_ATTENTION))
def test_linear_attention_layers_get_llm_compressors_hybrid_mapping_and_keep_the_float_model(family):
    """Qwen3-Next's and Qwen3.5's linear-attention layers: their input norm -> every ``linear_attn.in_proj_*``
    (llm-compressor's dynamic hybrid-attention mappings; before, these layers were left unsmoothed, warned); the
    full-attention layer keeps ``input_layernorm -> q/k/v``; no mixer is left unreached; random folds into every
    default mapping leave the logits equal."""
    model = build(family)
    layers, projections = LINEAR_ATTENTION[family]
    mappings = default_mappings(model)
    described = {m.smooth_name: m.balance_names for m in mappings}
    kinds = model.config.get_text_config().layer_types
    assert set(kinds) == {"linear_attention", "full_attention"}
    for i, kind in enumerate(kinds):
        prefix = f"{layers}.{i}."
        if kind == "linear_attention":
            assert described[prefix + "input_layernorm"] == tuple(prefix + "linear_attn." + p for p in projections)
        else:
            assert described[prefix + "input_layernorm"] == tuple(prefix + f"self_attn.{p}_proj" for p in "qkv")
    assert list(unsmoothed_mixers(model, mappings)) == []
    before, after = logits_before_and_after_random_folds(model, mappings, DATA)
    assert before.abs().max() > 0.05
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)


def test_awq_smooths_qwen3_5s_linear_attention_and_the_output_reloads(tmp_path):
    """AWQ + W4A16 g16 on the tiny Qwen3.5 (its checkpoints' class, Qwen3_5ForConditionalGeneration; llm-compressor's
    Qwen3.8 GPTQ + AWQ example's ignore): every linear-attention layer's norm -> in_proj_* mapping is smoothed and
    lowers its block's error, and the reload's logits equal the in-memory model's."""
    model = build("qwen3_5_vlm").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "model")
    ignore = ["re:model.visual.*", "re:.*lm_head", "re:.*embed_tokens$", "re:.*linear_attn\\.in_proj_a$",
              "re:.*linear_attn\\.in_proj_b$"]  # fmt: skip
    awq = AWQModifier(ignore=ignore)
    model = llmc_fsm.oneshot(
        model=str(tmp_path / "model"), dtype="bfloat16", recipe=[awq, GPTQModifier(scheme=SCHEME, ignore=ignore)],
        dataset=DATA, output_dir=tmp_path / "o", progress=False,
    )  # fmt: skip
    for i in range(3):
        result = awq.smoothing_results[f"model.language_model.layers.{i}.input_layernorm"]
        assert result["error"] <= result["error_unsmoothed"]
    reloaded = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "o", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=DATA).logits, model(input_ids=DATA).logits)


#: a layer's default mappings (smooth layer -> balance layers, relative to the layer) on families a tester compared
#: with llm-compressor 0.14's registry: AFMoE's and MuseGlimmer's attention output gate ``self_attn.gate_proj`` was
#: taken for the MLP's gate (their norm -> MLP mapping changed the model), GLM-5's indexer read the norms' outputs
#: unbalanced, AFMoE's and Llama-4's MoE norms were mapped to their shared expert alone and Cohere2-MoE's parallel
#: norm to q/k/v alone (their router and experts read it too: not resolved, so not smoothed, in session 24); since
#: session 25 the whole block is: Llama 4's experts have views, AFMoE's nested router (mlp.router.gate) is found,
#: and Cohere2-MoE's one norm maps to q/k/v, the router and every expert's gate / up
GATED = {
    "afmoe": (1, [  # its router Linear is mlp.router.gate, inside a router module (resolved since session 25)
        "input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.gate_proj",
        "pre_mlp_layernorm -> mlp.router.gate, mlp.shared_experts.gate_proj, mlp.shared_experts.up_proj, "
        + ", ".join(f"mlp.experts.{e}.{m}" for e in range(4) for m in ("gate_proj", "up_proj")),
        "mlp.shared_experts.up_proj -> mlp.shared_experts.down_proj",
        *(f"mlp.experts.{e}.up_proj -> mlp.experts.{e}.down_proj" for e in range(4)),
    ]),
    "muse_glimmer": (1, [
        "input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.gate_proj",
        "pre_feedforward_layernorm -> mlp.gate_proj, mlp.up_proj",
        "mlp.up_proj -> mlp.down_proj",
    ]),
    "llama4": (1, [  # its MoE norm feeds the router, the shared expert and Llama4TextExperts (views since session 25)
        "input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj",
        "post_attention_layernorm -> feed_forward.router, feed_forward.shared_expert.gate_proj, "
        "feed_forward.shared_expert.up_proj, "
        + ", ".join(f"feed_forward.experts.{e}.{m}" for e in range(4) for m in ("gate_proj", "up_proj")),
        "feed_forward.shared_expert.up_proj -> feed_forward.shared_expert.down_proj",
        *(f"feed_forward.experts.{e}.up_proj -> feed_forward.experts.{e}.down_proj" for e in range(4)),
    ]),
    "cohere2_moe": (1, [  # a parallel block: its one norm feeds attention, router and experts (since session 25)
        "input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, mlp.gate, "
        + ", ".join(f"mlp.experts.{e}.{m}" for e in range(4) for m in ("gate_proj", "up_proj")),
        *(f"mlp.experts.{e}.up_proj -> mlp.experts.{e}.down_proj" for e in range(4)),
    ]),
    "glm_moe_dsa": (0, [
        "input_layernorm -> self_attn.q_a_proj, self_attn.kv_a_proj_with_mqa, self_attn.indexer.wk, "
        "self_attn.indexer.weights_proj",
        "self_attn.q_a_layernorm -> self_attn.q_b_proj, self_attn.indexer.wq_b",
        "self_attn.kv_a_layernorm -> self_attn.kv_b_proj",
        "post_attention_layernorm -> mlp.gate_proj, mlp.up_proj",
        "mlp.up_proj -> mlp.down_proj",
    ]),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(GATED))
def test_gated_attention_and_indexer_families_get_mappings_that_keep_the_float_model(family):
    model = build(family)
    index, expected = GATED[family]
    _, layers = find_decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers[index]) + "."
    mappings = default_mappings(model)
    got = [
        f"{m.smooth_name.removeprefix(prefix)} -> {', '.join(n.removeprefix(prefix) for n in m.balance_names)}"
        for m in mappings
        if m.smooth_name.startswith(prefix)
    ]
    assert got == expected
    before, after = logits_before_and_after_random_folds(model, mappings, DATA)
    assert before.abs().max() > 0.05
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma3", "gemma3_vlm"])
def test_awq_default_mappings_leave_gemma3s_input_norm_to_qkv_out_as_llm_compressor(family, caplog) -> None:
    """llm-compressor 0.14's ``_gemma3_mappings`` leave ``input_layernorm -> q/k/v`` out (Gemma 3 normalizes queries
    and keys after projecting them; its issue 2522); ours smoothed it, silently (found by a tester comparing the
    resolved mappings). Gemma 2 keeps it, as there; a recipe's own mappings still name it."""
    model = build(family)
    with caplog.at_level(logging.WARNING, logger="llmc_fsm_quantization.awq"):
        kinds = {m.smooth_name.rsplit(".", 1)[-1] for m in AWQModifier().resolve(model)}
    assert kinds == {"pre_feedforward_layernorm", "up_proj"}
    assert [r.getMessage().split(":")[1] for r in caplog.records if "issue 2522" in r.getMessage()] == [
        f" {type(model).__name__} ({model.config.model_type})"]
    qkv = ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]
    given = [{"smooth_layer": "re:.*input_layernorm$", "balance_layers": qkv}]
    assert {m.smooth_name.rsplit(".", 1)[-1] for m in AWQModifier(mappings=given).resolve(model)} == {"input_layernorm"}
    assert AWQModifier().explain_model(model)[-1] == (
        "left out: input_layernorm -> q_proj, k_proj, v_proj (Gemma 3's default, as llm-compressor's)")
    gemma2 = {m.smooth_name.rsplit(".", 1)[-1] for m in AWQModifier().resolve(build("gemma2"))}
    assert gemma2 == {"input_layernorm", "pre_feedforward_layernorm", "up_proj"}
