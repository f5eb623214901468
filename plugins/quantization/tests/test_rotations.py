"""SpinQuantModifier: R1/R2 Hadamard rotations fused into the weights (logits unchanged), refusals, save/reload."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from llmc_fsm_quantization.rotations import SpinQuantModifier, hadamard_matrix

import llmc_fsm
from llmc_fsm.core.errors import RecipeError
from llmc_fsm.recipes.building import resolve_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from tiny_llama import llama

W4G16 = {"preset": "W4A16", "weights": {"group_size": 16}}


def _model(*, tied: bool = True, kv_heads: int = 2, dtype: torch.dtype = torch.float64, seed: int = 0):
    """Tiny Llama with non-trivial norm scales (so folding them matters) and a few outlier residual channels."""
    model = llama(layers=2, hidden=64, heads=4, kv_heads=kv_heads, tied=tied, seed=seed).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g, dtype=torch.float64) + 0.5)
        model.model.embed_tokens.weight[:, :3] *= 20  # outlier channels
    return model


class _State:
    def __init__(self, model):
        self.model = model


def _sylvester(n: int) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix, built here independently: H_2k = [[H, H], [H, -H]]."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.to(torch.float64)


# --------------------------------------------------------------------------- Hadamard matrices
@pytest.mark.parametrize("size", [16, 64, 48, 576])
@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
def test_hadamard_matrices_are_orthogonal_with_entries_plus_minus_one_over_sqrt_n(size: int, kind: str) -> None:
    h = hadamard_matrix(size, transform_type=kind)
    assert h.dtype == torch.float64 and h.shape == (size, size)
    assert torch.allclose(h @ h.T, torch.eye(size, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(h.abs(), torch.full_like(h, 1 / math.sqrt(size)), atol=1e-15)


def test_deterministic_hadamard_of_a_power_of_two_is_sylvester() -> None:
    assert torch.equal(hadamard_matrix(64), _sylvester(64))


def test_random_hadamard_is_the_same_every_run_and_differs_from_the_deterministic_one() -> None:
    a = hadamard_matrix(64, transform_type="random-hadamard")
    assert torch.equal(a, hadamard_matrix(64, transform_type="random-hadamard"))
    assert not torch.equal(a, hadamard_matrix(64))


@pytest.mark.parametrize("size", [6, 130, 260])
def test_a_size_without_known_hadamard_matrix_is_refused(size: int) -> None:
    with pytest.raises(ValueError) as info:
        hadamard_matrix(size)
    assert str(info.value) == (
        f"no Hadamard matrix of order {size} is known (orders K * 2^m with K a multiple of 4 up to 256); "
        "set transform_block_size to a power of two that divides it"
    )


# --------------------------------------------------------------------------- float model unchanged
@pytest.mark.parametrize(
    "args",
    [
        {},
        {"rotations": ["R1"]},
        {"rotations": ["r2"]},
        {"transform_block_size": 16},
        {"transform_type": "random-hadamard"},
        {"transform_type": "random-hadamard", "transform_block_size": 32, "precision": "float32"},
    ],
)
@pytest.mark.parametrize("tied", [True, False])
def test_fused_rotations_leave_the_float_logits_unchanged(args: dict, tied: bool) -> None:
    model = _model(tied=tied)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    before = _logits(model, ids)
    embed_before = model.model.embed_tokens.weight.detach().clone()
    v_before = model.model.layers[0].self_attn.v_proj.weight.detach().clone()
    modifier = SpinQuantModifier(**args)
    modifier.on_initialize(_State(model))
    after = _logits(model, ids)
    # LlamaRMSNorm computes in float32 even in a float64 model: the only rounding left
    assert (after - before).abs().max() <= 1e-5 * before.abs().max()
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings is False
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in model.named_parameters() if "norm" in n)
    r1 = "R1" in modifier.rotations
    assert (model.model.embed_tokens.weight - embed_before).abs().max() > 0.1 if r1 else True
    assert not torch.allclose(model.model.layers[0].self_attn.v_proj.weight, v_before)


def test_rotations_are_the_hadamard_products_computed_independently() -> None:
    model = _model(tied=False)
    layer = model.model.layers[1]
    g_in = layer.input_layernorm.weight.detach().clone()
    g_post = layer.post_attention_layernorm.weight.detach().clone()
    g_final = model.model.norm.weight.detach().clone()
    e, q, v, o = (t.detach().clone() for t in (model.model.embed_tokens.weight, layer.self_attn.q_proj.weight,
                                               layer.self_attn.v_proj.weight, layer.self_attn.o_proj.weight))
    up, down, head = (t.detach().clone() for t in (layer.mlp.up_proj.weight, layer.mlp.down_proj.weight,
                                                    model.lm_head.weight))
    SpinQuantModifier().on_initialize(_State(model))
    r1, r2 = _sylvester(64), _sylvester(16)
    assert torch.allclose(model.model.embed_tokens.weight, e @ r1, atol=1e-12)
    assert torch.allclose(layer.self_attn.q_proj.weight, (q * g_in) @ r1, atol=1e-12)
    assert torch.allclose(layer.mlp.up_proj.weight, (up * g_post) @ r1, atol=1e-12)
    assert torch.allclose(model.lm_head.weight, (head * g_final) @ r1, atol=1e-12)
    assert torch.allclose(layer.mlp.down_proj.weight, r1.T @ down, atol=1e-12)
    # R2 per head (2 key/value heads in v_proj, 4 heads in o_proj), after R1
    v_ref = torch.cat([r2.T @ block for block in ((v * g_in) @ r1).split(16, dim=0)], dim=0)
    o_ref = torch.cat([block @ r2 for block in (r1.T @ o).split(16, dim=1)], dim=1)
    assert torch.allclose(layer.self_attn.v_proj.weight, v_ref, atol=1e-12)
    assert torch.allclose(layer.self_attn.o_proj.weight, o_ref, atol=1e-12)


@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
def test_block_diagonal_r1_equals_the_dense_block_matrix_product(kind: str) -> None:
    # R1 with transform_block_size is applied block by block (never forming the [hidden, hidden] matrix): it must
    # equal the product with the dense block-diagonal matrix of the same blocks, built here with torch.block_diag
    model = _model(tied=False)
    layer = model.model.layers[0]
    g_in = layer.input_layernorm.weight.detach().clone()
    e, k, o = (t.detach().clone() for t in (model.model.embed_tokens.weight, layer.self_attn.k_proj.weight,
                                            layer.self_attn.o_proj.weight))
    SpinQuantModifier(rotations=["R1"], transform_type=kind, transform_block_size=16).on_initialize(_State(model))
    blocks = [hadamard_matrix(16, transform_type=kind)] * 4  # one block repeated, as compressed-tensors builds it
    r1 = torch.block_diag(*blocks)
    assert torch.allclose(model.model.embed_tokens.weight, e @ r1, atol=1e-12)
    assert torch.allclose(layer.self_attn.k_proj.weight, (k * g_in) @ r1, atol=1e-12)
    assert torch.allclose(layer.self_attn.o_proj.weight, r1.T @ o, atol=1e-12)


def test_r1_flattens_outlier_channels_of_the_embedding() -> None:
    model = _model()
    e = model.model.embed_tokens.weight.detach().clone()
    SpinQuantModifier(rotations=["R1"]).on_initialize(_State(model))
    ratio = lambda w: float(w.detach().abs().max() / w.detach().abs().mean())  # noqa: E731
    assert ratio(model.model.embed_tokens.weight) < ratio(e) / 3


# --------------------------------------------------------------------------- refusals (before any change)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"rotations": ["R1", "R2", "R4"]},
            "rotations R4 are not supported: online rotations (R3: queries and keys inside attention; R4: "
            "down_proj's input) must run at inference time, and transformers does not apply compressed-tensors "
            "transforms when it loads a checkpoint, so the saved model would not compute what the compressed one "
            "does; use rotations: [R1, R2] (fused into the weights)",
        ),
        ({"rotations": ["R5"]}, "rotations: unknown R5; SpinQuant's rotations are R1, R2, R3, R4"),
        (
            {"transform_type": "random-matrix"},
            "transform_type random-matrix is not supported: a random matrix is not orthogonal, so R1 would not pass "
            "through the RMSNorms and the float model would change; use hadamard or random-hadamard",
        ),
        ({"randomize": True}, "randomize: True is not supported (a distinct matrix per module); use randomize: false"),
        (
            {"learnable": True},
            "learnable: True is not supported (learned rotations: the rotations here are fixed Hadamard matrices); "
            "use learnable: false",
        ),
        (
            {"transform_config": {"config_groups": {}}},
            "transform_config is not supported (its config_groups are not one per rotation of ['R1', 'R2']); give "
            "rotations, transform_type and transform_block_size instead",
        ),
        ({"precision": "bfloat16"}, "precision must be float64 or float32, got 'bfloat16'"),
    ],
)
def test_unsupported_arguments_are_refused_when_the_recipe_is_read(args: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SpinQuantModifier(**args)
    assert str(info.value) == message


def test_a_block_size_that_does_not_divide_the_hidden_size_is_refused_before_any_change() -> None:
    model = _model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        SpinQuantModifier(transform_block_size=24).on_initialize(_State(model))
    assert str(info.value) == "transform_block_size 24 does not divide hidden_size 64"
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_a_layernorm_model_is_refused_before_any_change() -> None:
    model = _model()
    model.model.layers[1].post_attention_layernorm = torch.nn.LayerNorm(64, dtype=torch.float64, bias=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        SpinQuantModifier().on_initialize(_State(model))
    assert str(info.value) == (
        "SpinQuantModifier: model.layers.1.post_attention_layernorm (LayerNorm) does not compute x / rms(x) * weight, "
        "so its scale cannot be folded into the next linears; only RMSNorm models (Llama-style) are supported"
    )
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_an_extra_parameterised_module_in_a_layer_is_refused() -> None:
    model = _model()
    model.model.layers[0].mlp.extra = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError) as info:
        SpinQuantModifier().check_model(model)
    assert str(info.value) == (
        "SpinQuantModifier cannot rotate LlamaForCausalLM: model.layers.0 has parameterised modules the rotations "
        "would not keep invariant (mlp.extra); only Llama-style layers are supported"
    )


def test_rotating_after_quantization_is_refused() -> None:
    """A later stage's rotation was refused at its initialize, after the quantizing stage had changed the model
    (B4, session 30): refused before any work, in recipe order with fuse_stages too; a model quantized by an earlier
    run is refused by the rotation's own check."""
    model = _model(dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = {"q": {"QuantizationModifier": {"scheme": "W8A8"}}, "r": {"SpinQuantModifier": {}}}
    for fuse in (False, True):
        with pytest.raises(ValueError) as info:
            llmc_fsm.oneshot(model=model, recipe=recipe, progress=False, fuse_stages=fuse)
        assert str(info.value) == (
            "SpinQuantModifier of stage 'r' mixes the weights' channels, which moves the weights QuantizationModifier "
            "of stage 'q' quantizes before it off their grid (e.g. model.layers.0.mlp.down_proj): rotations go before "
            "quantization: put it in the first stage"
        )
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    llmc_fsm.oneshot(model=model, recipe={"q": recipe["q"]}, progress=False)
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"r": recipe["r"]}, progress=False)
    assert "SpinQuantModifier: 14 modules are already quantized (e.g. model.layers.0.self_attn.q_proj); rotations " \
        "go before quantization: put SpinQuantModifier in the first stage" in str(info.value)


def test_quip_is_named_as_not_implemented_with_the_reason() -> None:
    with pytest.raises(RecipeError) as info:
        resolve_recipe({"s": {"QuIPModifier": {"rotations": ["v"]}}})
    assert "QuIPModifier is an llm-compressor modifier that llmc-fsm does not implement (QuIP-style Hadamard " \
        "rotations of every Linear's input at run time" in str(info.value)


# --------------------------------------------------------------------------- with quantization, saved and reloaded
def test_llmcompressor_recipe_form_is_read() -> None:
    text = (
        "quant_stage:\n  quantization_modifiers:\n    SpinQuantModifier:\n      rotations: [R1, R2]\n"
        "      transform_type: hadamard\n      transform_block_size: 64\n    QuantizationModifier:\n"
        "      targets: [Linear]\n      scheme: W4A16\n      ignore: [lm_head]\n"
    )
    recipe = resolve_recipe(text)
    modifiers = [m for stage in recipe.stages for m in stage.modifiers]
    assert [type(m).__name__ for m in modifiers] == ["SpinQuantModifier", "QuantizationModifier"]
    assert modifiers[0].rotations == ("R1", "R2") and modifiers[0].transform_block_size == 64


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("quantizer", ["GPTQModifier", "QuantizationModifier"])
def test_rotated_and_quantized_model_reloads_with_equal_logits(tmp_path, staged: bool, quantizer: str) -> None:
    from transformers import AutoModelForCausalLM

    model = _model(dtype=torch.float32)
    rotate = {"SpinQuantModifier": {"rotations": ["R1", "R2"]}}
    quantize = {quantizer: {"scheme": W4G16}}
    recipe = {"rotate": rotate, "quantize": quantize} if staged else {"q": {**rotate, **quantize}}
    out = tmp_path / "out"
    data = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=out, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["quantization_config"]["format"] == "pack-quantized"
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)
    assert torch.equal(reloaded.model.norm.weight, torch.ones(64))


def test_a_rotation_after_an_earlier_stages_pruning_is_refused_before_any_work() -> None:
    """B2's case (session 30): 2:4 pruning, then SpinQuant and GPTQ in a later stage, saved a dense model (the
    rotation fills every zero) while recipe.yaml marked the pruning applied. Refused before any work, naming both;
    in one stage the rotation runs at initialize, before the pruning, and the 2:4 zeros stay."""
    data = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    prune = {"SparseGPTModifier": {"sparsity": 0.5, "mask_structure": "2:4", "targets": [r"re:.*mlp\..*_proj$"]}}
    gptq = {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 32}}, "ignore": ["lm_head"]}}
    model = llama(hidden=64, vocab=128)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"prune": prune, "quantize": {"SpinQuantModifier": {}, **gptq}},
                         dataset=data, progress=False)  # fmt: skip
    assert str(info.value) == (
        "SpinQuantModifier of stage 'quantize' mixes the weights' channels, which fills the zeros SparseGPTModifier "
        "of stage 'prune' prunes before it (e.g. in model.layers.0.mlp.down_proj): put the pruning after it (a stage "
        "after the rotation, before or with the quantization), or leave one of them out"
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError) as info:  # fused: the stages keep their order (B4: the rotation ran first)
        llmc_fsm.oneshot(model=model, recipe={"prune": prune, "quantize": {"SpinQuantModifier": {}, **gptq}},
                         dataset=data, progress=False, fuse_stages=True)  # fmt: skip
    assert str(info.value).startswith("SpinQuantModifier of stage 'quantize' mixes the weights' channels")
    # pruned by an earlier run (or an applied stage, or elsewhere): the rotation's own check reads the zeros (B4)
    llmc_fsm.oneshot(model=model, recipe={"prune": prune}, dataset=data, progress=False)
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"quantize": {"SpinQuantModifier": {}, **gptq}}, dataset=data,
                         progress=False)  # fmt: skip
    assert str(info.value) == (
        "SpinQuantModifier: model.layers.0.mlp.gate_proj holds 50% zeros (pruned); the rotation mixes its channels "
        "and fills them: rotate the dense model first (a SpinQuant stage), then prune"
    )
    model = llama(hidden=64, vocab=128)  # one stage, the pruning listed first: rotated, then pruned
    embedding = model.model.embed_tokens.weight.detach().clone()
    llmc_fsm.oneshot(model=model, recipe={"s": {**prune, "SpinQuantModifier": {}}}, dataset=data, progress=False)
    assert not torch.equal(model.model.embed_tokens.weight, embedding)  # R1 rotated it
    for name in ("gate_proj", "up_proj", "down_proj"):
        weight = model.model.layers[0].mlp.get_submodule(name).weight
        assert int((weight.reshape(-1, 4) == 0).sum(dim=1).min()) == 2


def test_a_nan_weight_the_rotation_changes_is_refused_before_any_work() -> None:
    """B4's case (session 30): the up-front NaN/Inf check did not read what SpinQuant rotates (its check_model gives
    a plan, not modules): a NaN in down_proj was rotated into 64 NaN, and the run saved. Refused before any work."""
    model = llama(hidden=64, vocab=128)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"s": {"SpinQuantModifier": {}}}, progress=False)
    assert str(info.value) == (
        "SpinQuantModifier of stage 's': the weights of model.layers.1.mlp.down_proj hold NaN or Inf values, so they "
        "cannot be compressed: the checkpoint (or an earlier change to the model) is broken there"
    )
    after = model.state_dict()
    assert all(torch.equal(v.nan_to_num(), after[k].nan_to_num()) for k, v in before.items())
    assert set(SpinQuantModifier().modules_changed(model)) >= {"model.embed_tokens", "lm_head", "model.norm",
                                                              "model.layers.0.input_layernorm"}  # fmt: skip
