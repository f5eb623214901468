"""AWQ on Nemotron-H's mixture-of-experts blocks (issues 23/24): gateless experts ``down(relu2(up x))``.

A tiny random ``NemotronHForCausalLM`` built offline from transformers' ``NemotronHConfig`` (MoE, mamba, attention
and MLP blocks; 4 routed experts, top-2, a shared expert of 32 channels). The MoE block's norm feeds the router, the
shared expert's ``up_proj`` and every expert's ``up_proj`` (one linear scale for all of them); each gateless
``up -> down`` takes the scale through squared ReLU, which is positively homogeneous of degree 2
(``relu2(y / t) = relu2(y) / t ** 2``, ``t > 0``): ``up``'s rows divided by ``sqrt(s)``, ``down``'s columns times ``s``.
References are written here: the float model's logits, an independent float64 grid search of one expert's
``up -> down`` exponent (routing, relu2, int4 written out), the checkpoint reloaded by transformers.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import pytest
import torch
import transformers
from llmc_fsm_quantization import AWQModifier, QuantizationModifier
from llmc_fsm_quantization.mappings import default_mappings, fold_scales, homogeneity_degree
from transformers.activations import ACT2FN, ReLUSquaredActivation

import llmc_fsm

DATA = torch.randint(3, 128, (16, 32), generator=torch.Generator().manual_seed(0))  # 512 calibration tokens
SCHEME = {"preset": "W4A16", "weights": {"group_size": 16}}  # symmetric int4, groups of 16
GROUP, N_GRID = 16, 20
MOE = "model.layers.0."  # the first layer: its calibration inputs are the float model's


def _config(**extra) -> transformers.NemotronHConfig:
    cfg = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "layers_block_type": ["moe", "mamba", "attention", "mlp"],
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "ssm_state_size": 8,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "n_groups": 1,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        # transformers 5.25's NemotronH forward builds a cache whose layer 0 is a placeholder (this model's layer 0
        # is an MoE block, with nothing to cache) and asks it for its length: AttributeError. No cache is needed
        # here (the library's own forwards and perplexity pass use_cache=False).
        "use_cache": False,
        **extra,
    }
    return transformers.NemotronHConfig(**cfg)


def _model(**extra) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(**extra)).eval()


def _outliers() -> torch.nn.Module:
    """The tiny model whose experts' ``up_proj`` rows 3, 17 and 26 are 5x larger: outlier channels of ``down_proj``'s
    input (``relu2``: 25x), so expert 0's best exponent beats the next by 9% (checked below), more than the float32 /
    float64 difference of the errors."""
    model = _model()
    with torch.no_grad():
        model.model.layers[0].mixer.experts.up_proj[:, [3, 17, 26]] *= 5.0
    return model


def _described(mapping) -> str:
    return f"{mapping.smooth_name.removeprefix(MOE)} -> {', '.join(n.removeprefix(MOE) for n in mapping.balance_names)}"


EXPERTS = [f"mixer.experts.{e}" for e in range(4)]
#: layer 0's default mappings (layer 1: mamba, reached by none; 2: attention under GQA, no v -> o; 3: dense MLP)
EXPECTED_MOE = [
    "norm -> mixer.gate, mixer.shared_experts.up_proj, " + ", ".join(f"{x}.up_proj" for x in EXPERTS),
    "mixer.shared_experts.up_proj -> mixer.shared_experts.down_proj",
    *(f"{x}.up_proj -> {x}.down_proj" for x in EXPERTS),
]


# --------------------------------------------------------------------------- the fold
def test_relu2_is_known_homogeneous_of_degree_2_by_its_class_only() -> None:
    """transformers' ``ACT2FN["relu2"]`` (what NemotronHConfig's ``mlp_hidden_act`` builds) is recognised by its
    class and satisfies ``f(y / t) = f(y) / t ** 2`` in float64; a subclass, an instance with its own forward and
    other activations are not recognised."""
    assert _config().mlp_hidden_act == "relu2"
    act = ACT2FN["relu2"]
    assert type(act) is ReLUSquaredActivation and homogeneity_degree(act) == 2
    y = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    for t in (0.25, 0.7, 3.0):
        torch.testing.assert_close(act(y / t), act(y) / t**2, rtol=1e-15, atol=0)

    class Sub(ReLUSquaredActivation):
        pass

    patched = ReLUSquaredActivation()
    patched.forward = lambda y: torch.relu(y).pow(3)
    assert [homogeneity_degree(a) for a in (Sub(), patched, ACT2FN["silu"], ACT2FN["relu"], None)] == [None] * 5


def test_default_mappings_reach_every_expert_and_folding_keeps_the_float_logits() -> None:
    """The default mappings of the MoE layer are exactly ``EXPECTED_MOE`` (the norm's scale into the router, the
    shared expert's and every expert's up rows; degree 1; each gateless up -> down of degree 2), the dense MLP's
    up -> down is one too; folding random scales in [0.5, 2] into every mapping leaves the logits equal (float32
    rounding: 1e-5 on logits ~0.5). Control: the same scales folded linearly (degree 1) into one expert's
    up -> down change them."""
    model = _model()
    with torch.no_grad():
        before = model(DATA).logits
    mappings = default_mappings(model)
    assert [_described(m) for m in mappings if m.smooth_name.startswith(MOE)] == EXPECTED_MOE
    assert [m.degree for m in mappings if m.smooth_name.startswith(MOE)] == [1, 2, 2, 2, 2, 2]
    assert [(m.smooth_name, m.degree) for m in mappings if m.smooth_name.startswith("model.layers.3.")] == [
        ("model.layers.3.norm", 1),
        ("model.layers.3.mixer.up_proj", 2),
    ]
    gen = torch.Generator().manual_seed(1)
    scales = [0.5 + 1.5 * torch.rand(m.channels, generator=gen) for m in mappings]
    linear = _model()
    with torch.no_grad():
        for mapping, s in zip(mappings, scales, strict=True):
            fold_scales(mapping, s)
        after = model(DATA).logits
        assert before.abs().max() > 0.3
        torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
        # control: the expert's up rows divided by s instead of sqrt(s)
        index = next(i for i, m in enumerate(mappings) if m.smooth_name == MOE + "mixer.experts.0.up_proj")
        wrong = attrs.evolve(default_mappings(linear)[index], degree=1)
        fold_scales(wrong, scales[index])
        assert (linear(DATA).logits - before).abs().max() > 1e-3


def test_the_relu2_fold_divides_up_proj_s_bias_by_sqrt_s_too() -> None:
    """With ``mlp_bias: true`` (the shared expert's and the dense MLP's Linears carry biases; random ones here),
    folding random scales into every default mapping leaves the logits equal (1e-5):
    ``relu2((W x + b) / sqrt(s)) = relu2(W x + b) / s``."""
    model = _model(mlp_bias=True)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None and name.endswith("up_proj"):
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=gen))
        before = model(DATA).logits
        mappings = default_mappings(model)
        assert {m.smooth_name for m in mappings if m.degree == 2 and getattr(m.smooth, "bias", None) is not None} == {
            MOE + "mixer.shared_experts.up_proj",
            "model.layers.3.mixer.up_proj",
        }
        for mapping in mappings:
            fold_scales(mapping, 0.5 + 1.5 * torch.rand(mapping.channels, generator=gen))
        torch.testing.assert_close(model(DATA).logits, before, rtol=0, atol=1e-5)


def test_a_gateless_up_to_down_mapping_of_another_activation_has_no_fold() -> None:
    """Nemotron-H built with ``mlp_hidden_act: silu``: the dense MLP's up -> down is left out of the defaults (a
    warning names it) and, given as a recipe mapping, fits no layer and is refused; folding into it is refused."""
    model = _model(mlp_hidden_act="silu", layers_block_type=["attention", "mlp"])
    mappings = default_mappings(model)
    assert [m.smooth_name for m in mappings] == ["model.layers.0.norm", "model.layers.1.norm"]
    from llmc_fsm_quantization.mappings import MappingSpec, resolve_mappings

    with pytest.raises(ValueError) as info:
        resolve_mappings(model, [MappingSpec("re:.*up_proj$", ("re:.*down_proj$",))], owner="AWQModifier")
    assert str(info.value) == (
        "AWQModifier: mapping {'smooth_layer': 're:.*up_proj$', 'balance_layers': ['re:.*down_proj$']} fits none of "
        "the 1 smooth layers it matches in NemotronHForCausalLM (nemotron_h): model.layers.1.mixer.up_proj -> "
        "model.layers.1.mixer.down_proj: without a gate, down(act(up x)) is invariant to a fold only for a positively "
        "homogeneous act (transformers' relu2); correct its patterns or leave it out of the mappings"
    )


def test_the_default_mappings_warn_about_a_gateless_mlp_they_leave_out(caplog) -> None:
    model = _model(mlp_hidden_act="silu", layers_block_type=["attention", "mlp"])
    with caplog.at_level(logging.WARNING):
        default_mappings(model)
    assert [r.getMessage() for r in caplog.records] == [
        "default smoothing mappings: model.layers.1.mixer.up_proj -> down_proj left out: without a gate, "
        "down(SiLUActivation(up x)) is invariant to a fold only for a positively homogeneous act (transformers' "
        "relu2); their down_proj is quantized without smoothing"
    ]


def test_recipe_mappings_in_llm_compressors_form_resolve_to_the_default_mappings_and_degrees() -> None:
    """The MoE mappings written as llm-compressor's recipes write them (patterns, every expert at once) resolve to the
    default mappings of the layer, each up -> down with degree 2 (the recipe path finds the relu2 between them too)."""
    from llmc_fsm_quantization.mappings import parse_mappings, resolve_mappings

    model = _model()
    specs = parse_mappings([
        {"smooth_layer": "re:.*layers\\.0\\.norm$",
         "balance_layers": ["re:.*mixer\\.gate$", "re:.*shared_experts\\.up_proj$", "re:.*experts\\.\\d+\\.up_proj$"]},
        {"smooth_layer": "re:.*up_proj$", "balance_layers": ["re:.*down_proj$"]},
    ])  # fmt: skip
    resolved = resolve_mappings(model, specs, owner="AWQModifier")
    defaults = [m for m in default_mappings(model) if m.smooth_name.endswith(("up_proj", MOE + "norm"))]
    key = sorted((m.smooth_name, m.balance_names, m.degree) for m in defaults)
    assert sorted((m.smooth_name, m.balance_names, m.degree) for m in resolved) == key
    assert {k[0]: k[2] for k in key} == {
        MOE + "norm": 1, **{f"{MOE}mixer.experts.{e}.up_proj": 2 for e in range(4)},
        MOE + "mixer.shared_experts.up_proj": 2, "model.layers.3.mixer.up_proj": 2,
    }  # fmt: skip


# --------------------------------------------------------------------------- the exponent, against float64
def _q_int4_sym_g16(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int4 in groups of 16 columns, in float32 as the weights are: scale ``max|w| / 7.5``,
    ``clamp(round(w / scale), -8, 7) * scale``; returned as float64. (A group's largest entry lands on the tie
    +-7.5, so an ulp of the scales can round it the other way: the model below makes the exponents' margins wider.)"""
    g = w.float().reshape(-1, GROUP)
    scale = g.abs().amax(dim=1, keepdim=True) / 7.5
    return (torch.clamp(torch.round(g / scale), -8, 7) * scale).reshape(w.shape).double()


def _moe_input(model: torch.nn.Module) -> torch.Tensor:
    """The float model's input of layer 0's MoE block on ``DATA`` (its norm's output), ``[tokens, 64]`` float64."""
    seen = []
    handle = model.model.layers[0].mixer.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    with torch.no_grad():
        model(DATA)
    handle.remove()
    return torch.cat(seen).reshape(-1, 64).double()  # float32 values, exactly


def _reference_expert_search(model: torch.nn.Module, expert: int) -> tuple[int, list[float], Any]:
    """The routed tokens of ``expert``, the errors of no smoothing and of exponents ``0, 1/18, ..., 18/18``
    (``duo_scaling``; llm-compressor 0.14's grid for n_grid 20) for its up -> down, in float64, and ``error(scales)``:
    the router's sigmoid scores, top-2 (one group, no correction bias), ``h = relu2(x up^T)`` on the routed tokens,
    ``x_j = mean|h_j|``, ``w_j`` the mean of ``|W_ij| / max|W|`` of its group over down's rows,
    ``s = x ** r / (w ** (1 - r) + 1e-4)`` clamped to 1e-4 and divided by ``sqrt(max s min s)``; error
    ``mean((h (Q(W diag s) / s - W)^T) ** 2)``."""
    block = model.model.layers[0].mixer
    x = _moe_input(model)
    # the router computes in float32 (NemotronHTopkRouter), as here: in float64 a near tie could break otherwise
    scores = torch.sigmoid(torch.nn.functional.linear(x.float(), block.gate.weight.detach().float()))
    routed = (scores.topk(2, dim=-1).indices == expert).any(dim=-1)
    h = torch.relu(x[routed] @ block.experts.up_proj[expert].detach().double().T) ** 2
    w = block.experts.down_proj[expert].detach().double()  # [64, 32]
    g = w.abs().reshape(-1, GROUP)
    w_mean = (g / g.amax(dim=1, keepdim=True)).reshape(w.shape).mean(dim=0)
    x_mean = h.abs().mean(dim=0)

    def error(s: torch.Tensor | None) -> float:
        q = _q_int4_sym_g16(w) if s is None else _q_int4_sym_g16(w * s) / s
        return float((h @ (q - w).T).pow(2).mean())

    def candidate(r: float) -> torch.Tensor:
        s = (x_mean**r / (w_mean ** (1 - r) + 1e-4)).clamp_min(1e-4)
        return s / (s.max() * s.min()).sqrt()

    return int(routed.sum()), [error(None), *(error(candidate(i / (N_GRID - 2))) for i in range(N_GRID - 1))], error


@pytest.fixture(scope="module")
def awq_run(tmp_path_factory):
    """AWQ + W4A16 (g16) on the tiny model: the model before, after, the modifier and the output directory."""
    model = _outliers()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reference = _outliers()
    awq = AWQModifier()
    out = tmp_path_factory.mktemp("nemotron_h") / "o"
    recipe = [awq, QuantizationModifier(scheme=SCHEME)]
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=out, progress=False)
    return reference, before, model, awq, out


def test_an_experts_up_to_down_exponent_is_a_float64_grid_search_s(awq_run) -> None:
    """Each expert's chosen exponent is the float64 search's where its best error beats the next by more than 2%
    (expert 2, on llm-compressor's grid), and within 2% of the best error elsewhere (float32 scales move a few int4
    codes: 1.3% of expert 0's error at one exponent); its recorded errors are the reference's at the modifier's own
    scales; every expert's routed-token count is the float router's."""
    reference, _, _, awq, _ = awq_run
    for expert in range(4):
        _, errors, error = _reference_expert_search(reference, expert)
        ranked = sorted(range(len(errors)), key=lambda i: errors[i])
        name = f"{MOE}mixer.experts.{expert}.up_proj"
        result = awq.smoothing_results[name]
        assert ranked[0] != 0
        if errors[ranked[1]] > 1.02 * errors[ranked[0]]:
            assert result["exponent"] == (ranked[0] - 1) / (N_GRID - 2), expert
        assert result["error"] <= 1.02 * errors[ranked[0]], expert
        assert result["error"] == pytest.approx(error(awq.smoothing_scales[name].double()), rel=1e-5)
        assert result["error_unsmoothed"] == pytest.approx(errors[0], rel=1e-5)
    assert [awq.smoothing_results[f"{MOE}mixer.experts.{e}.up_proj"]["exponent"] for e in (1, 2, 3)] == [
        2 / 18, 4 / 18, 4 / 18]  # the float64 search's (margins 1.8%, 2.8%, 1.8%)
    tokens = _reference_expert_search(reference, 0)[0]
    routed = [tokens] + [_reference_expert_search(reference, e)[0] for e in (1, 2, 3)]
    assert [awq.smoothing_results[f"{MOE}mixer.experts.{e}.up_proj"]["tokens"] for e in range(4)] == routed
    assert sum(routed) == 2 * DATA.numel()


# --------------------------------------------------------------------------- the checkpoint
def test_awq_w4a16_quantizes_every_expert_and_the_checkpoint_reloads(awq_run) -> None:
    """Every default mapping was searched; every expert matrix (and the shared expert's) changed and holds at most 16
    values per group of 16 (int4); the checkpoint reloads with no missing, unexpected or mismatched key and the
    in-memory model's logits."""
    _, before, model, awq, out = awq_run
    assert set(awq.smoothing_results) == {m.smooth_name for m in default_mappings(_model())}
    state = model.state_dict()
    experts = MOE + "mixer.experts."
    for key in (experts + "up_proj", experts + "down_proj"):
        for e in range(4):
            w = state[key][e]
            assert not torch.equal(w, before[key][e]), (key, e)
            assert max(len(torch.unique(g)) for g in w.reshape(-1, GROUP)) <= 16, (key, e)
    for leaf in ("up_proj", "down_proj"):
        key = f"{MOE}mixer.shared_experts.{leaf}.weight"
        assert not torch.equal(state[key], before[key])
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(DATA).logits, model(DATA).logits, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- refusals
REFUSED = {
    "silu_experts": (
        {"mlp_hidden_act": "silu"},
        "NemotronHExperts has no gate rows and its act_fn SiLUActivation is not transformers' ReLUSquaredActivation "
        "(relu2): down(act(up x)) has no exact fold of an up -> down scale",
    ),
    "latent": (
        {"moe_latent_size": 16},
        "the block also holds fc1_latent_proj, fc2_latent_proj: neither its router, its experts, a shared expert "
        "(gate_proj, up_proj, down_proj Linears; or up_proj, down_proj without a gate) nor a shared expert's "
        "1-output gate Linear (e.g. Nemotron-H's latent projection fc1_latent_proj between the block's input and its "
        "experts), so the scale of the block's input cannot be folded",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_nemotron_h_experts_without_an_exact_fold_are_refused_before_any_work(tmp_path, case: str) -> None:
    """Experts whose act is not relu2 (no exact up -> down fold) and a block with a latent projection (its
    ``fc1_latent_proj`` reads the norm, the experts read it): refused before any work, one line naming the family."""
    extra, message = REFUSED[case]
    model = _model(**extra)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(
            model=model, recipe=[AWQModifier(), QuantizationModifier(scheme=SCHEME)], dataset=DATA,
            output_dir=tmp_path / "o", progress=False,
        )  # fmt: skip
    assert str(info.value) == (
        "AWQModifier: NemotronHForCausalLM (model_type 'nemotron_h') keeps fused experts in model.layers.0.mixer."
        f"experts that no smoothing mapping reaches ({message}), so they would be quantized unsmoothed: use "
        "GPTQModifier or QuantizationModifier, which quantize each expert matrix"
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "o").exists()
