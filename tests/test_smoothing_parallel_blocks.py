"""Smoothing where a norm's output is read by more than its mapping's balance layers.

Parallel decoder layers (Cohere, Cohere2, Phi) feed one ``input_layernorm`` to attention and MLP alike; MiniMax uses
the normed hidden states as its residual. Before this file, the default mapping ``input_layernorm -> q/k/v`` was
folded there too and silently changed the float model (a breaker measured the logits move by 9-58% of their range
with SmoothQuant 0.8 alone). Now the parallel layers' norm mapping takes the MLP's input Linears as balance layers
too (llm-compressor's Cohere mappings), and a fold that changes what a layer computes is refused before anything
changes (``fold_change``, measured on the first layer of each class).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from llmc_fsm_quantization.mappings import default_mappings
from llmc_fsm_quantization.smoothquant import FOLD_TOLERANCE, fold_change
from tiny_families import build, logits_before_and_after_random_folds

import llmc_fsm

DATA = torch.randint(3, 120, (4, 16), generator=torch.Generator().manual_seed(0))
SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128}  # fmt: skip


def _model(family: str) -> torch.nn.Module:
    if family == "cohere2":
        return build("cohere2")
    extra = {"num_local_experts": 4, "num_experts_per_tok": 2} if family == "minimax" else {}
    if family == "phi3":  # its config's default token ids lie outside a 128-token vocabulary
        extra = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    config = transformers.AutoConfig.for_model(family, **SIZES, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms that are not all ones, so a scale folded into them shows
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _described(mapping) -> str:
    layer = ".".join(mapping.smooth_name.split(".")[:3]) + "."
    balances = ", ".join(n.removeprefix(layer) for n in mapping.balance_names)
    return f"{mapping.smooth_name.removeprefix(layer)} -> {balances}"


QKV = "input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj"


@pytest.mark.parametrize(
    ("family", "norm_mapping"),
    [
        ("cohere", f"{QKV}, mlp.gate_proj, mlp.up_proj"),
        ("cohere2", f"{QKV}, mlp.gate_proj, mlp.up_proj"),
        ("phi", f"{QKV}, mlp.fc1"),
    ],
)
def test_a_parallel_layers_norm_mapping_takes_the_mlp_inputs_and_keeps_the_float_model(family, norm_mapping):
    model = _model(family)
    mappings = default_mappings(model)
    norms = [_described(m) for m in mappings if m.smooth_name.endswith("input_layernorm")]
    assert norms == [norm_mapping] * model.config.num_hidden_layers
    before, after = logits_before_and_after_random_folds(model, mappings, DATA)
    assert before.abs().max() > 0.05
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)

    model = _model(family)  # the modifier itself: SmoothQuant alone leaves the logits (float32 rounding)
    llmc_fsm.oneshot(model=model, recipe={"s": {"SmoothQuantModifier": {"smoothing_strength": 0.8}}}, dataset=DATA,
                     progress=False)  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(model(DATA).logits, before, rtol=0, atol=1e-5)


def test_phi3s_fused_projections_are_smoothed_from_their_norms():
    """Phi-3 fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``: the two norm mappings of
    llm-compressor's ``_phi_mappings`` (its ``qkv_proj -> o_proj`` and ``gate_up_proj -> down_proj`` scale only the
    v / up rows of a fused output, which is not done here: not default mappings)."""
    model = _model("phi3")
    mappings = default_mappings(model, include_linear=True)
    assert [_described(m) for m in mappings] == [
        "input_layernorm -> self_attn.qkv_proj", "post_attention_layernorm -> mlp.gate_up_proj"
    ] * 2  # fmt: skip
    before, after = logits_before_and_after_random_folds(model, mappings, DATA)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)


def test_fold_change_is_float_rounding_for_an_exact_fold_and_large_for_a_norm_read_elsewhere():
    model = _model("cohere")
    layer = model.model.layers[0]
    hidden = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    position = torch.arange(16).unsqueeze(0).expand(2, -1)
    batch = ((hidden,), {"position_embeddings": model.model.rotary_emb(hidden, position)})
    mapping = next(m for m in default_mappings(model) if m.smooth_name == "model.layers.0.input_layernorm")
    weights = {name: p.detach().clone() for name, p in layer.named_parameters()}
    assert fold_change(layer, batch, [mapping]) < 1e-5
    attention_only = type(mapping)(
        smooth_name=mapping.smooth_name, smooth=mapping.smooth, balance_names=mapping.balance_names[:3],
        balances=mapping.balances[:3], parent_name="model.layers.0.self_attn", parent=layer.self_attn,
    )  # fmt: skip  (the mapping before this change: q/k/v only, the parallel MLP's input left out)
    assert fold_change(layer, batch, [attention_only]) > 10 * FOLD_TOLERANCE
    assert all(torch.equal(p, weights[name]) for name, p in layer.named_parameters())  # put back bit for bit


def test_a_norm_whose_output_is_the_residual_is_refused_before_anything_changes():
    model = _model("minimax")
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(model=model, recipe={"s": {"SmoothQuantModifier": {"smoothing_strength": 0.8}}},
                         dataset=DATA, progress=False)  # fmt: skip
    message = str(err.value)
    assert message.startswith(
        "SmoothQuantModifier: folding smoothing scales into model.layers.0.input_layernorm -> "
        "model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj "
        "(relative change "
    )
    assert message.endswith(
        "changes what MiniMaxDecoderLayer computes: the smooth layer's output is also read by something that is not "
        "one of its balance layers (a parallel MLP, the residual); give mappings whose balance layers are every "
        "module reading it, or leave that layer out of the mappings. Nothing was changed"
    )
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())


def test_awq_on_a_parallel_layer_runs_and_reloads(tmp_path):
    model = _model("cohere")
    scheme = {"preset": "W4A16", "weights": {"group_size": 16}}
    recipe = {"s": {"AWQModifier": {"ignore": ["lm_head"]},
                    "QuantizationModifier": {"ignore": ["lm_head"], "scheme": scheme}}}  # fmt: skip
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "out", progress=False)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(DATA).logits, model(DATA).logits)
