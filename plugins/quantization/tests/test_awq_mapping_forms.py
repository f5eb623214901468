"""AWQ / SmoothQuant against llm-compressor 0.14's mapping and argument forms (testers' findings, session 32).

One balance regex matching several Linears, llm-compressor's AWQ exponent grid, SmoothQuant's
``calibration_function: null``, and readers of a norm's output times a factor per token (Falcon-H1)."""

from __future__ import annotations

import copy

import pytest
import torch
from llmc_fsm_quantization import AWQModifier, QuantizationModifier, SmoothQuantModifier
from llmc_fsm_quantization import awq as awq_module
from llmc_fsm_quantization.awq import awq_grid
from llmc_fsm_quantization.mappings import default_mappings, fold_scales, parse_mappings, resolve_mappings
from llmc_fsm_quantization.smoothquant import _same_values
from test_smoothquant import DATA, tiny

import llmc_fsm

W4G16 = {"preset": "W4A16_ASYM", "weights": {"group_size": 16}}

ONE_REGEX = [
    {"smooth_layer": "re:.*input_layernorm$", "balance_layers": ["re:.*self_attn\\.(q|k|v)_proj$"]},
    {"smooth_layer": "re:.*post_attention_layernorm$", "balance_layers": ["re:.*mlp\\.(gate|up)_proj$"]},
]
EXPLICIT = [
    {"smooth_layer": "re:.*input_layernorm$", "balance_layers": ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]},
    {"smooth_layer": "re:.*post_attention_layernorm$", "balance_layers": ["re:.*gate_proj$", "re:.*up_proj$"]},
]


def _names(mappings) -> list[tuple[str, tuple[str, ...], str]]:
    return [(m.smooth_name, m.balance_names, m.parent_name) for m in mappings]


# --------------------------------------------------------------------------- one regex, several Linears
def test_one_balance_regex_matching_q_k_v_resolves_to_the_explicit_patterns_mappings() -> None:
    """Found by a tester: ``re:.*self_attn\\.(q|k|v)_proj$`` as the one balance pattern was skipped at every layer
    ("matches 3 Linears"), and refused when every mapping had that form; llm-compressor 0.14 takes every match inside
    the smooth layer's decoder layer. Both recipe forms now resolve to the explicit patterns' mappings."""
    model = tiny()
    explicit = _names(resolve_mappings(model, parse_mappings(EXPLICIT), owner="AWQModifier"))
    assert len(explicit) == 4
    assert explicit[0] == (
        "model.layers.0.input_layernorm",
        tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv"),
        "model.layers.0.self_attn",
    )
    assert _names(resolve_mappings(model, parse_mappings(ONE_REGEX), owner="AWQModifier")) == explicit
    smoothquant_form = [[["re:.*self_attn\\.(q|k|v)_proj$"], "re:.*input_layernorm$"],
                        [["re:.*mlp\\.(gate|up)_proj$"], "re:.*post_attention_layernorm$"]]  # fmt: skip
    assert _names(resolve_mappings(model, parse_mappings(smoothquant_form), owner="SmoothQuantModifier")) == explicit


@pytest.mark.parametrize("modifier", ["AWQModifier", "SmoothQuantModifier"])
def test_one_regex_mappings_smooth_bitwise_as_the_explicit_patterns(modifier: str) -> None:
    """The tester's recipe (rec/awq_onere.yaml): the run with one regex per norm gives the weights, scales and
    report of the explicit three-pattern run bit for bit (before: those mappings were skipped, nothing smoothed)."""
    runs = []
    for mappings in (EXPLICIT, ONE_REGEX):
        model = tiny()
        smoother = AWQModifier(mappings=mappings) if modifier == "AWQModifier" else SmoothQuantModifier(
            mappings=mappings)  # fmt: skip
        recipe = [smoother, QuantizationModifier(scheme=W4G16 if modifier == "AWQModifier" else "W8A8")]
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, progress=False)
        runs.append((model.state_dict(), smoother))
    (a, first), (b, second) = runs
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert list(first.smoothing_scales) == [f"model.layers.{i}.{n}" for i in (0, 1)
                                            for n in ("input_layernorm", "post_attention_layernorm")]  # fmt: skip
    assert list(second.smoothing_scales) == list(first.smoothing_scales)
    assert all(torch.equal(first.smoothing_scales[k], second.smoothing_scales[k]) for k in first.smoothing_scales)
    assert second.smoothing_results == first.smoothing_results


# --------------------------------------------------------------------------- llm-compressor's grid
def test_awq_grid_is_llmcompressors_candidate_list() -> None:
    """Found by a tester: the grid was ``i / n`` for ``i < n`` per family (ratio 1 never tried, ``both`` 2n + 1
    candidates); llm-compressor 0.14's ``_get_grid_search_params`` is written out here for small grids."""
    assert awq_grid(True, 4) == [(0.0, False), (0.0, True), (0.5, True), (1.0, True)]
    assert awq_grid(False, 4) == [(0.0, False), (1 / 3, False), (2 / 3, False), (1.0, False)]
    assert awq_grid("both", 4) == [(0.0, False), (0.0, True), (1.0, False), (1.0, True)]
    assert awq_grid("both", 7) == [(0.0, False), (0.0, True), (0.5, False), (0.5, True), (1.0, False), (1.0, True)]
    assert [len(awq_grid(duo, 20)) for duo in (True, False, "both")] == [20, 20, 20]
    assert awq_grid(True, 20)[1:] == [(i / 18, True) for i in range(19)]
    with pytest.raises(ValueError) as info:
        AWQModifier(duo_scaling="both", n_grid=3)
    assert str(info.value) == (
        "n_grid must be at least 4 with duo_scaling 'both' (the exponent grid runs from 0 to 1 in steps of "
        "1/(n_grid - 2) as in llm-compressor, for 'both' 1/(n_grid // 2 - 1)), got 3"
    )
    with pytest.raises(ValueError) as info:
        AWQModifier(duo_scaling=False, n_grid=1)
    assert str(info.value) == (
        "n_grid must be at least 2 with duo_scaling False (the exponent grid runs from 0 to 1 in steps of "
        "1/(n_grid - 1) as in llm-compressor, for 'both' 1/(n_grid // 2 - 1)), got 1"
    )


@pytest.mark.parametrize(("duo", "n_grid", "count"), [(True, 6, 6), (False, 6, 6), ("both", 7, 6)])
def test_awq_scores_llmcompressors_candidates_for_each_mapping(monkeypatch, duo, n_grid: int, count: int) -> None:
    """Each mapping's search scores exactly llm-compressor's candidates: ``n_grid`` for true and false, ``2 (n_grid
    // 2)`` for both, the first one no smoothing (before: ``n_grid + 1`` and ``2 n_grid + 1``), and the chosen
    exponent is one of its ratios."""
    seen: list[int] = []
    for cls in (awq_module._BlockError, awq_module._GramError):
        original = cls.search

        def search(self, candidates, _original=original):
            seen.append(len(candidates))
            assert candidates[0] is None
            return _original(self, candidates)

        monkeypatch.setattr(cls, "search", search)
    awq = AWQModifier(duo_scaling=duo, n_grid=n_grid)
    llmc_fsm.oneshot(model=tiny(), recipe=[awq, QuantizationModifier(scheme=W4G16)], dataset=DATA, progress=False)
    assert seen == [count] * 8
    ratios = {(r, d) for r, d in awq_grid(duo, n_grid)[1:]}
    assert all((r["exponent"], r["duo_scaling"]) in ratios | {(None, None)} for r in awq.smoothing_results.values())


# --------------------------------------------------------------------------- calibration_function
def test_smoothquant_takes_calibration_function_null_and_refuses_a_value() -> None:
    """Found by a tester: llm-compressor declares ``calibration_function: Callable | None = None``, and its null was
    refused as an unknown argument; null now runs, a value is refused in one line (a recipe cannot carry one)."""
    recipe = "s:\n  SmoothQuantModifier: {calibration_function: null, num_calibration_steps: null}\n"
    model = tiny()
    llmc_fsm.oneshot(model=model, recipe=recipe + "  QuantizationModifier: {scheme: W8A8}\n", dataset=DATA,
                     progress=False)  # fmt: skip
    assert model.model.layers[0].self_attn.q_proj.quantization_scheme is not None
    with pytest.raises(ValueError) as info:
        SmoothQuantModifier(calibration_function=len)
    assert str(info.value) == (
        "calibration_function must be null, got <built-in function len>: a recipe cannot carry a callable, and "
        "smoothing runs the decoder layers' own forward; leave it out"
    )


# --------------------------------------------------------------------------- readers times a factor (Falcon-H1)
def test_a_reader_of_the_norm_output_times_a_factor_per_token_reads_the_norm() -> None:
    """Found by a tester: the check that a balance layer reads its norm's output took tensor identity only, so
    Falcon-H1's ``q_proj`` (reading ``input_layernorm``'s output times ``attention_in_multiplier``) was refused even
    with function-keeping mappings. A factor per token (a multiplier, a padding mask) commutes with per-channel
    scales; another input does not."""
    y = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    assert _same_values(y, y)
    assert _same_values(y.view(2, 1, 5, 8), y)
    assert _same_values(y * 0.7, y)
    assert _same_values(y * 1.3 * mask[:, :, None], y)
    assert _same_values((y.bfloat16() * 0.7).float(), y)
    assert not _same_values(y + 0.1 * torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1)), y)
    assert not _same_values(y * torch.linspace(0.5, 2.0, 8), y)  # a factor per channel does not commute with s
    assert not _same_values(y[..., :4], y)


def _falcon_h1() -> torch.nn.Module:
    """A tiny Falcon-H1 (2 layers, hidden 64) whose multipliers are not 1, as in its real checkpoints."""
    import transformers

    config = transformers.AutoConfig.for_model(
        "falcon_h1", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, mamba_d_state=8, mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128,
        attention_in_multiplier=0.7, ssm_in_multiplier=1.3,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_falcon_h1_default_mappings_take_the_mamba_in_proj_and_keep_the_float_model() -> None:
    """Falcon-H1's attention and mamba mixer read ``input_layernorm`` side by side: its default mapping holds
    ``mamba.in_proj`` beside ``q/k/v`` (before: q/k/v only, which changes the model; the run was refused inside layer
    0, advising mappings that the reader check then refused too), so random folds keep the logits."""
    model = _falcon_h1()
    mappings = default_mappings(model)
    assert _names(mappings)[:2] == [
        ("model.layers.0.input_layernorm", (*(f"model.layers.0.self_attn.{p}_proj" for p in "qkv"),
                                            "model.layers.0.mamba.in_proj"), "model.layers.0"),
        ("model.layers.0.pre_ff_layernorm", ("model.layers.0.feed_forward.gate_proj",
                                             "model.layers.0.feed_forward.up_proj"), "model.layers.0.feed_forward"),
    ]  # fmt: skip
    data = DATA[:2, :16]
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        before = model(data).logits
        for mapping in mappings:
            fold_scales(mapping, 0.5 + 1.5 * torch.rand(mapping.channels, generator=generator))
        torch.testing.assert_close(model(data).logits, before, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mappings", [None, "tester"])
def test_awq_and_smoothquant_run_on_falcon_h1_and_keep_its_float_function(mappings) -> None:
    """AWQ + W4 and SmoothQuant run on Falcon-H1 with non-trivial multipliers, with the default mappings and with the
    tester's recipe mappings (recipes/fh1_awq_map.yaml); SmoothQuant leaves the float logits unchanged, AWQ's errors
    are no worse than unsmoothed."""
    given = None if mappings is None else [
        {"smooth_layer": "re:.*input_layernorm$", "balance_layers": [
            "re:.*self_attn.q_proj$", "re:.*self_attn.k_proj$", "re:.*self_attn.v_proj$", "re:.*mamba.in_proj$"]},
        {"smooth_layer": "re:.*pre_ff_layernorm$",
         "balance_layers": ["re:.*feed_forward.gate_proj$", "re:.*feed_forward.up_proj$"]},
    ]  # fmt: skip
    data = DATA[:4, :16]
    original = _falcon_h1()
    model = copy.deepcopy(original)
    smoothquant = SmoothQuantModifier(mappings=given)
    llmc_fsm.oneshot(model=model, recipe=[smoothquant], dataset=data, progress=False)
    assert "model.layers.1.input_layernorm" in smoothquant.smoothing_scales
    with torch.no_grad():
        torch.testing.assert_close(model(data).logits, original(data).logits, rtol=0, atol=1e-5)
    awq = AWQModifier(mappings=given, n_grid=4)
    quantizer = QuantizationModifier(scheme=W4G16, ignore=["lm_head"])
    llmc_fsm.oneshot(model=copy.deepcopy(original), recipe=[awq, quantizer], dataset=data, progress=False)
    assert "model.layers.0.mamba.in_proj" in awq.smoothing_results["model.layers.0.input_layernorm"]["balance_layers"]
    assert all(r["error"] <= r["error_unsmoothed"] for r in awq.smoothing_results.values())


class _Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = torch.nn.Linear(8, 16, bias=False)
        self.down_proj = torch.nn.Linear(16, 8, bias=False)


class _ListMoe(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList([_Expert() for _ in range(3)])


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.post_attention_layernorm = torch.nn.RMSNorm(8)
        self.mlp = _ListMoe()


def test_balance_layers_in_a_list_of_expert_mlps_take_the_block_holding_the_list_as_parent() -> None:
    """One balance pattern matching every expert of a ModuleList of expert MLPs (accepted now, as llm-compressor
    takes them): the block AWQ runs is the module holding the list (a ModuleList has no forward; llm-compressor's
    lowest common ancestor avoids it too), not the list."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([_Layer() for _ in range(4)])
    spec = [{"smooth_layer": "re:.*post_attention_layernorm$", "balance_layers": ["re:.*experts.*up_proj$"]}]
    found = resolve_mappings(model, parse_mappings(spec), owner="AWQModifier")
    assert _names(found) == [
        (f"model.layers.{i}.post_attention_layernorm",
         tuple(f"model.layers.{i}.mlp.experts.{e}.up_proj" for e in range(3)), f"model.layers.{i}.mlp")
        for i in range(4)
    ]  # fmt: skip
    assert all(m.parent is model.model.layers[i].mlp for i, m in enumerate(found))


# --------------------------------------------------------------------------- llm-compressor's AWQMapping objects
def test_awq_mapping_objects_as_llmcompressor_scripts_build_them_smooth_as_the_dict_form(tmp_path) -> None:
    """Found by a tester translating llm-compressor's examples: ``mappings=[AWQMapping(smooth, [balances])]`` (its
    dataclass, or ours under that name) was refused as "cannot read"; both now give the dict form's weights, scales
    and saved recipe bit for bit."""
    import dataclasses

    from llmc_fsm_quantization import AWQMapping

    @dataclasses.dataclass
    class TheirMapping:  # the fields of llm-compressor 0.14's AWQMapping (llmcompressor.modifiers.awq.mappings)
        smooth_layer: str
        balance_layers: list[str]
        activation_hook_target: str | None = None

    forms = {
        "dict": EXPLICIT,
        "ours": [AWQMapping(m["smooth_layer"], m["balance_layers"]) for m in EXPLICIT],
        "theirs": [TheirMapping(m["smooth_layer"], m["balance_layers"]) for m in EXPLICIT],
    }
    runs = {}
    for form, mappings in forms.items():
        model = tiny()
        smoother = AWQModifier(mappings=mappings)
        llmc_fsm.oneshot(model=model, recipe=[smoother, QuantizationModifier(scheme=W4G16)], dataset=DATA,
                         progress=False, output_dir=str(tmp_path / form))  # fmt: skip
        runs[form] = (model.state_dict(), smoother.smoothing_scales, (tmp_path / form / "recipe.yaml").read_text())
    weights, scales, recipe = runs["dict"]
    assert len(scales) == 4
    for form in ("ours", "theirs"):
        other_weights, other_scales, other_recipe = runs[form]
        assert [k for k in weights if not torch.equal(weights[k], other_weights[k])] == []
        assert list(other_scales) == list(scales)
        assert all(torch.equal(scales[k], other_scales[k]) for k in scales)
        assert other_recipe == recipe


def test_awq_mapping_refuses_what_it_cannot_smooth_with_one_line() -> None:
    """Building a mapping checks it as the recipe forms are checked: a hook target (parallel blocks), no balance
    pattern, a smooth layer that is not a pattern; another library's object with a hook target likewise."""
    import dataclasses

    from llmc_fsm_quantization import AWQMapping

    with pytest.raises(ValueError) as err:
        AWQMapping("re:.*input_layernorm$", ["re:.*q_proj$"], activation_hook_target="mlp")
    assert str(err.value) == (
        "activation_hook_target, for parallel attention/MLP blocks, is not supported: leave it out "
        "(got activation_hook_target='mlp' for smooth layer 're:.*input_layernorm$')")  # fmt: skip
    with pytest.raises(ValueError) as err:
        AWQMapping("re:.*input_layernorm$", [])
    assert str(err.value) == (
        "balance_layers: []: give a non-empty list of module names, class names or re:<regex> patterns")
    with pytest.raises(ValueError) as err:
        AWQMapping(None, ["re:.*q_proj$"])
    assert str(err.value) == "smooth_layer: None: give a module name, class name or re:<regex> pattern"
    assert AWQMapping("re:.*up_proj$", "re:.*down_proj$").balance_layers == ("re:.*down_proj$",)

    @dataclasses.dataclass
    class TheirMapping:
        smooth_layer: str
        balance_layers: list[str]
        activation_hook_target: str | None = None

    with pytest.raises(ValueError) as err:
        parse_mappings([TheirMapping("re:.*input_layernorm$", ["re:.*q_proj$"], "self_attn")])
    assert str(err.value) == (
        "mappings: {'smooth_layer': 're:.*input_layernorm$', 'balance_layers': ['re:.*q_proj$'], "
        "'activation_hook_target': 'self_attn'}: only smooth_layer and balance_layers are read "
        "(activation_hook_target, for parallel attention/MLP blocks, is not supported: leave it out)")  # fmt: skip
