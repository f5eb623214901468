"""What reports, configs and refusals say about mixture-of-experts models (session 35 testers' findings).

Tiny random models from ``tiny_families`` (transformers 5 configs, offline). References are read from the saved
files (safetensors keys, config.json) or written out by hand.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from tiny_families import build
from tiny_llama import calibration_text, compress_on_every_path, word_tokenizer

import llmc_fsm
from llmc_fsm.report.build import OneshotReport

DATA = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
W4 = {"preset": "W4A16", "weights": {"group_size": 16}}


def _keys(directory) -> list[str]:
    keys = []
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys += list(f.keys())
    return keys


def _never_route_expert_3(model) -> None:
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            with torch.no_grad():
                gate.e_score_correction_bias[3] = -1e4


def test_never_routed_experts_calibrated_on_every_token_are_not_reported_as_rounded_to_nearest(tmp_path):
    """Found by a tester: with calibrate_all_experts: true the table said the experts the router never picked were
    "quantized by round-to-nearest (no calibration input)", although GPTQ had calibrated them on every token. The
    line keeps the router's split and says they were calibrated on every token; report.json says so per matrix and
    reads back to the same line."""
    model = build("deepseek_v3")
    _never_route_expert_3(model)
    recipe = {"s": {"GPTQModifier": {"scheme": W4, "calibrate_all_experts": True}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    report = model.llmc_fsm_report
    idle = [f"model.layers.{i}.mlp.experts.3.{p}" for i in (1, 2, 3) for p in ("gate_proj", "up_proj", "down_proj")]
    by_name = {m.name: m for m in report.modules}
    assert [(by_name[n].routed_tokens, by_name[n].all_tokens, by_name[n].bits) for n in idle] == [(0, True, 4)] * 9
    routed = [m for m in report.modules if m.routed_tokens is not None]
    counts = [m.routed_tokens for m in routed]
    line = next(x for x in report.format_table().splitlines() if x.startswith("experts: "))
    assert line == (
        f"experts: 36 expert matrices, 0-{max(counts)} routed calibration tokens each; no routed token: "
        "model.layers.{1..3}.mlp.experts.3.gate_proj, model.layers.{1..3}.mlp.experts.3.up_proj, "
        "model.layers.{1..3}.mlp.experts.3.down_proj, calibrated on every token (calibrate_all_experts) "
        "(report.json: routed_tokens)"
    )
    saved = json.loads((tmp_path / "o" / "report.json").read_text())
    entries = {m["name"]: m for m in saved["sparsity"]["modules"]}
    assert all(entries[m.name].get("calibrate_all_experts") is True for m in routed)
    assert OneshotReport.from_dict(saved).format_table() == report.format_table()


def test_never_routed_experts_without_calibrate_all_experts_are_still_reported_as_rounded_to_nearest(tmp_path):
    """The other side of the line above: without calibrate_all_experts GPTQ has no Hessian for them, and the table
    says they were rounded to nearest; report.json has no calibrate_all_experts key."""
    model = build("deepseek_v3")
    _never_route_expert_3(model)
    llmc_fsm.oneshot(
        model=model, recipe={"s": {"GPTQModifier": {"scheme": W4}}}, dataset=DATA, output_dir=tmp_path / "o",
        progress=False,
    )  # fmt: skip
    line = next(x for x in model.llmc_fsm_report.format_table().splitlines() if x.startswith("experts: "))
    assert line.endswith(
        "; no routed token: model.layers.{1..3}.mlp.experts.3.gate_proj, model.layers.{1..3}.mlp.experts.3.up_proj, "
        "model.layers.{1..3}.mlp.experts.3.down_proj, quantized by round-to-nearest (no calibration input) "
        "(report.json: routed_tokens)"
    )
    saved = json.loads((tmp_path / "o" / "report.json").read_text())
    assert not any("calibrate_all_experts" in m for m in saved["sparsity"]["modules"])


def test_never_routed_experts_sparsegpt_leaves_dense_are_said_to_be_left_as_they_were(tmp_path):
    """SparseGPT leaves an expert no token reached unpruned; the table's line named them and said nothing of what
    became of them, where GPTQ's says "round-to-nearest" (found by a tester): it now says they were left as they
    were."""
    model = build("deepseek_v3")
    _never_route_expert_3(model)
    before = model.model.layers[1].mlp.experts.gate_up_proj.detach().clone()
    llmc_fsm.oneshot(model=model, recipe={"s": {"SparseGPTModifier": {"sparsity": 0.5}}}, dataset=DATA,
                     progress=False)  # fmt: skip
    assert torch.equal(model.model.layers[1].mlp.experts.gate_up_proj[3], before[3])
    line = next(x for x in model.llmc_fsm_report.format_table().splitlines() if x.startswith("experts: "))
    assert line.endswith(
        "; no routed token: model.layers.{1..3}.mlp.experts.3.gate_proj, model.layers.{1..3}.mlp.experts.3.up_proj, "
        "model.layers.{1..3}.mlp.experts.3.down_proj, left as they were (no calibration input) "
        "(report.json: routed_tokens)"
    )


def test_streamed_perplexity_of_a_checkpoint_that_sets_output_router_logits(tmp_path, monkeypatch):
    """Found by a tester: a MoE checkpoint whose config.json has "output_router_logits": true (fine-tuned ones ship
    it) failed with a raw IndexError in transformers' load_balancing_loss_func on the streamed path and with
    low_memory when eval_text was given (the replayed decoder layers record no router logits); in memory it ran.
    Every path now gives the in-memory perplexities, and the saved config keeps the user's value."""
    monkeypatch.setenv("LLMC_FSM_PERPLEXITY_CACHE", "off")
    text = calibration_text()
    (tmp_path / "cal.txt").write_text(text, encoding="utf-8")
    tokenizer = word_tokenizer(text)
    build("qwen3_moe", output_router_logits=True).save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    recipe = {"s": {"GPTQModifier": {"scheme": W4, "ignore": ["lm_head"]}}}
    runs = compress_on_every_path(tmp_path, recipe, tokenizer)
    memory = runs["memory"][2]
    assert memory["before"] is not None and memory["after"] is not None
    assert runs["streamed"][2] == memory and runs["low_memory"][2] == memory
    for path in runs:
        config = json.loads((tmp_path / path / "config.json").read_text())
        assert config["output_router_logits"] is True, path


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_pruned_fused_experts_are_sparsity_targets_under_their_checkpoint_names(tmp_path, family):
    """Found by a tester: a MoE pruned 2:4 then quantized W4A16 wrote every expert matrix per expert, exact 2:4,
    but the sparsity_config's targets listed the attention modules only. Now they list every pruned matrix under
    the per-expert name its packed tensors are written under (Mixtral: block_sparse_moe.experts.<e>.w1/w2/w3)."""
    model = build(family)
    recipe = {
        "prune": {"SparseGPTModifier": {"sparsity": 0.5, "mask_structure": "2:4", "ignore": ["lm_head"]}},
        "quant": {"GPTQModifier": {"scheme": W4}},
    }
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    packed = sorted(k.removesuffix(".weight_packed") for k in _keys(tmp_path / "o") if k.endswith(".weight_packed"))
    experts = [k for k in packed if ".experts." in k]
    assert len(experts) == 4 * 4 * 3  # 4 layers x 4 experts x 3 matrices, all written per expert
    if family == "mixtral":
        assert {k.rsplit(".", 1)[1] for k in experts} == {"w1", "w2", "w3"}
    sparsity = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]["sparsity_config"]
    assert sparsity["sparsity_structure"] == "2:4"
    assert sparsity["targets"] == packed  # attention and experts; routers and lm_head neither pruned nor packed
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o", output_loading_info=True)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])


def test_fused_experts_refusal_names_no_packing_for_fp8_and_its_advice_works(tmp_path):
    """Found by a tester (Qwen3-VL-MoE, llm-compressor's FP8_DYNAMIC example): the refusal of experts transformers
    keeps fused in the checkpoint said "packed" for FP8 weights, named transformers 5.24 only, and gave no way on.
    It now speaks of quantized weights and says to add the experts to ignore; doing so runs and reloads."""
    model = build("gpt_oss")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(
            model=model, recipe={"s": {"QuantizationModifier": args}}, dataset=DATA, output_dir=tmp_path / "a",
            progress=False,
        )  # fmt: skip
    assert str(info.value) == (
        "QuantizationModifier: GptOssForCausalLM (model_type 'gpt_oss'): fused experts model.layers.0.mlp.experts "
        "cannot be quantized: transformers saves model.layers.0.mlp.experts.gate_up_proj, "
        "model.layers.0.mlp.experts.down_proj fused in the checkpoint (its conversion mapping has no per-expert key "
        "for them) and reads compressed-tensors quantized weights into fused experts only through such a per-expert "
        "mapping: quantized per expert they reload as unexpected keys with model.layers.0.mlp.experts.gate_up_proj "
        "missing (randomly initialised; measured on transformers 5.24, and on 5.25 with llm-compressor 0.14's "
        "Qwen3-VL-MoE checkpoints: packed int4, NVFP4, and FP8 weights with their scales), packed under the fused "
        "name as unexpected model.layers.0.mlp.experts.gate_up_proj.weight_packed ... keys (5.24), so no quantized "
        "experts can be written that it reloads; to quantize the rest of the model, add 're:.*mlp.experts' to the "
        "modifier's ignore (the experts are then saved dense, as they are, and reload)"
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    args["ignore"] = ["lm_head", "re:.*mlp.experts"]
    llmc_fsm.oneshot(
        model=model, recipe={"s": {"QuantizationModifier": args}}, dataset=DATA, output_dir=tmp_path / "b",
        progress=False,
    )  # fmt: skip
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.weight"], q_proj)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b", output_loading_info=True)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(DATA[:2]).logits, model(DATA[:2]).logits)


def test_table_says_padding_is_not_counted_when_calibration_rows_differ_in_length():
    """Found by a tester: 6 image-caption samples in batches padded to their longest row (13 tokens), 63 tokens
    besides the padding, were reported as "6 x 13 tokens", as if every row were 13 tokens of text; rows of one
    length keep the N x L line."""
    source = "captions/ (images and text)"
    uneven = {"source": source, "num_samples": 6, "seq_len": 13, "num_tokens": 63}
    even = {"source": "wiki.txt", "num_samples": 8, "seq_len": 32, "num_tokens": 256}
    lines = [OneshotReport(model="m", recipe={}, calibration=c, modules=[]).format_table().splitlines()[1]
             for c in (uneven, even)]  # fmt: skip
    assert lines == [
        "calibration: 6 samples of up to 13 tokens (63 tokens, padding not counted) from captions/ (images and text)",
        "calibration: 8 x 32 tokens from wiki.txt",
    ]


def test_granite_moe_refusal_gives_the_ignore_advice_that_works(tmp_path):
    """Granite-MoE's refusal (experts saved in a layout of transformers' own) ended without a way out, unlike the
    GPT-OSS one (found by a tester): it now gives the same ignore advice, and following it runs and reloads."""
    config = transformers.GraniteMoeConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                           num_experts_per_tok=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GraniteMoeForCausalLM(config).eval()
    data = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    args = {"scheme": W4, "ignore": ["lm_head"]}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"s": {"QuantizationModifier": args}}, dataset=data,
                         output_dir=tmp_path / "a", progress=False)  # fmt: skip
    assert str(info.value).endswith(
        "so no quantized experts can be written that it reloads; to quantize the rest of the model, add "
        "'re:.*block_sparse_moe.experts' to the modifier's ignore (the experts are then saved dense, as they are, "
        "and reload)")
    args["ignore"] = ["lm_head", "re:.*block_sparse_moe.experts"]
    llmc_fsm.oneshot(model=model, recipe={"s": {"QuantizationModifier": args}}, dataset=data,
                     output_dir=tmp_path / "b", progress=False)  # fmt: skip
    reloaded, loading = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b", output_loading_info=True)
    assert (sorted(loading["missing_keys"]), sorted(loading["unexpected_keys"])) == ([], [])
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(data).logits, model(data).logits)
