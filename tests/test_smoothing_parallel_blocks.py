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
import llmc_fsm_quantization.smoothquant
import transformers
from llmc_fsm_quantization.mappings import default_mappings
from llmc_fsm_quantization.smoothquant import FOLD_TOLERANCE, fold_change
from tiny_families import build, logits_before_and_after_random_folds

import llmc_fsm

DATA = torch.randint(3, 120, (4, 16), generator=torch.Generator().manual_seed(0))
SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128}  # fmt: skip


def _model(family: str, **overrides) -> torch.nn.Module:
    if family == "cohere2":
        return build("cohere2")
    extra = {"num_local_experts": 4, "num_experts_per_tok": 2} if family == "minimax" else {}
    if family == "phi3":  # its config's default token ids lie outside a 128-token vocabulary
        extra = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    config = transformers.AutoConfig.for_model(family, **{**SIZES, **overrides}, **extra)
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


PHI3_MAPPINGS = [  # llm-compressor's _phi_mappings, as its recipes write them
    {"smooth_layer": "re:.*input_layernorm$", "balance_layers": ["re:.*qkv_proj$"]},
    {"smooth_layer": "re:.*qkv_proj$", "balance_layers": ["re:.*o_proj$"]},
    {"smooth_layer": "re:.*post_attention_layernorm$", "balance_layers": ["re:.*gate_up_proj$"]},
    {"smooth_layer": "re:.*gate_up_proj$", "balance_layers": ["re:.*down_proj$"]},
]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_phi3s_fused_projections_are_smoothed_as_llmcompressors_phi_mappings(kv_heads, tmp_path, caplog):
    """Phi-3 fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``: their norms smooth them, and, as
    llm-compressor's ``_phi_mappings`` do, ``qkv_proj -> o_proj`` and ``gate_up_proj -> down_proj`` scale the fused
    output's last rows (v, up). ``qkv_proj -> o_proj`` only without grouped-query attention (4 KV heads of 4): with 2,
    ``o_proj`` reads 64 channels and v is 32 rows, so no scale folds there (the defaults leave it out; the recipe's
    mapping is skipped with a warning, as llm-compressor skips a misfit)."""
    model = _model("phi3", num_key_value_heads=kv_heads)
    mappings = default_mappings(model, include_linear=True)
    qkv_o = ["self_attn.qkv_proj -> self_attn.o_proj"] if kv_heads == 4 else []
    assert [_described(m) for m in mappings] == [
        "input_layernorm -> self_attn.qkv_proj", *qkv_o, "post_attention_layernorm -> mlp.gate_up_proj",
        "mlp.gate_up_proj -> mlp.down_proj",
    ] * 2  # fmt: skip
    before, after = logits_before_and_after_random_folds(model, mappings, DATA)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)

    model = _model("phi3", num_key_value_heads=kv_heads)
    scheme = {"preset": "W4A16", "weights": {"group_size": 16}}
    recipe = {"s": {"AWQModifier": {"ignore": ["lm_head"], "mappings": PHI3_MAPPINGS},
                    "QuantizationModifier": {"ignore": ["lm_head"], "scheme": scheme}}}  # fmt: skip
    with caplog.at_level("WARNING", logger="llmc_fsm_quantization.mappings"):
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "out", progress=False)
    skips = [r.getMessage() for r in caplog.records if "skipped at" in r.getMessage()]
    assert skips == ([] if kv_heads == 4 else [  # once a run, though each check and initialize resolve the mappings
        f"AWQModifier: mapping {PHI3_MAPPINGS[1]} skipped at 2 of 2 smooth layers: model.layers.0.self_attn.qkv_proj "
        "has 128 output channels but model.layers.0.self_attn.o_proj reads 64 (a fused projection is smoothed through "
        "its last rows only when they are exactly what the balance layer reads: 3 x its input for qkv_proj, i.e. as "
        "many key/value heads as query heads; 2 x for gate_up_proj)"])  # fmt: skip
    awq = next(m for s in model.llmc_fsm_report.to_dict()["smoothing"].values() for m in [s])
    assert ("model.layers.0.self_attn.qkv_proj" in awq) == (kv_heads == 4)
    assert "model.layers.0.mlp.gate_up_proj" in awq
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(DATA).logits, model(DATA).logits)


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


def test_a_layer_whose_mappings_differ_is_checked_too_and_says_what_was_smoothed_before(tmp_path, monkeypatch):
    """The check runs on the first layer of each class *and set of mappings*: a recipe whose mapping leaves out
    ``v_proj`` on layer 1 only (layer 0's is whole) is refused. In memory every layer is checked before the first
    change (on layer 0's inputs: nothing changes); streamed, layer 1 is read only after layer 0 was smoothed and
    written to the hidden work directory, and the message says so. Before, only the first layer of each class was
    measured and the float logits moved by 55% (a breaker's case)."""
    model = build("llama")
    layer = r"re:.*layers\.{}\.{}$"
    mappings = [
        [[layer.format(0, f"self_attn.{p}_proj") for p in "qkv"], layer.format(0, "input_layernorm")],
        [[layer.format(1, f"self_attn.{p}_proj") for p in "qk"], layer.format(1, "input_layernorm")],
    ]
    recipe = {"s": {"SmoothQuantModifier": {"smoothing_strength": 0.8, "mappings": mappings}}}
    start = "SmoothQuantModifier: folding smoothing scales into model.layers.1.input_layernorm -> "
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, progress=False)
    assert str(err.value).startswith(start) and str(err.value).endswith("Nothing was changed")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    model.save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError) as err:  # the fold check on the meta skeleton, before any weight is read
        llmc_fsm.oneshot(str(tmp_path / "model"), recipe=recipe, dataset=DATA, tokenizer=None, low_memory=True,
                         output_dir=tmp_path / "out", progress=False)  # fmt: skip
    assert str(err.value).startswith(start) and str(err.value).endswith("Nothing was changed")
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(llmc_fsm_quantization.smoothquant, "PROBE_LIMIT", 0)  # no check before: the streamed one
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(str(tmp_path / "model"), recipe=recipe, dataset=DATA, tokenizer=None, low_memory=True,
                         output_dir=tmp_path / "out", progress=False)  # fmt: skip
    assert str(err.value).startswith(start)
    assert str(err.value).endswith(
        "Nothing was changed in this layer (the decoder layers before it were smoothed already: start again from "
        "the original model)"
    )
    assert not (tmp_path / "out").exists()


def test_a_bfloat16_layer_is_measured_in_float32_so_its_own_rounding_is_no_change():
    """A bfloat16 Llama whose residual stream is ten times its layers' updates (embeddings scaled by 10): measured in
    bfloat16, an exact fold changed ``||y' - y|| / ||y - x||`` by up to 0.019 and the run was refused (a breaker's
    case); measured in float32 it is float32 rounding."""
    model = build("llama")
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(10.0)
    model = model.to(torch.bfloat16)
    layer = model.model.layers[0]
    hidden = model.get_input_embeddings()(DATA)
    position = torch.arange(DATA.shape[1]).unsqueeze(0).expand(DATA.shape[0], -1)
    batch = ((hidden,), {"position_embeddings": model.model.rotary_emb(hidden, position)})
    mappings = [m for m in default_mappings(model) if m.smooth_name.startswith("model.layers.0.")]
    weights = {name: p for name, p in layer.named_parameters()}
    saved = {name: p.detach().clone() for name, p in weights.items()}
    assert fold_change(layer, batch, mappings) < 1e-5
    assert all(p is weights[n] and p.dtype == torch.bfloat16 and torch.equal(p, saved[n])
               for n, p in layer.named_parameters())  # fmt: skip  (the same tensors, untouched)
    llmc_fsm.oneshot(model=model, recipe={"s": {"SmoothQuantModifier": {"smoothing_strength": 0.8}},
                     "q": {"QuantizationModifier": {"scheme": "W8A8", "ignore": ["lm_head"]}}}, dataset=DATA,
                     progress=False)  # fmt: skip


def test_ergos_moe_norm_gets_no_wrong_default_mapping_and_smoothing_keeps_the_float_model():
    """Ergo (transformers 5.25): its layer 1 (same class as the dense layer 0) offered
    ``pre_feedforward_layernorm -> shared_experts.up_proj``, which leaves out the router and experts reading that
    norm; the fold check refused it (a breaker's case). Since session 24 a norm feeding routed experts the mappings do
    not resolve gets no mapping (left unsmoothed): SmoothQuant runs, smooths the dense layer and the attention, and
    leaves the float model's logits equal to float rounding."""
    config = transformers.AutoConfig.for_model("ergo", **{**SIZES, "num_key_value_heads": 4}, pad_token_id=0,
                                               bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    smooth = [m.smooth_name for m in default_mappings(model)]
    assert "model.layers.1.pre_feedforward_layernorm" not in smooth
    assert "model.layers.0.pre_feedforward_layernorm" in smooth
    window = DATA[:2]
    with torch.no_grad():
        before = model(window).logits
    llmc_fsm.oneshot(model=model, recipe={"s": {"SmoothQuantModifier": {"smoothing_strength": 0.8}}},
                     dataset=DATA, progress=False)  # fmt: skip
    with torch.no_grad():
        after = model(window).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-4)
