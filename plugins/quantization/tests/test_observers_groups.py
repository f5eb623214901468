"""Observers by name (each honoured or refused), several config groups in one modifier, the lm_head default.

Observer references are written here in float64 from the definitions in ``llmc_fsm_quantization.observers``
(llm-compressor 0.14's weight observers); the group tests run ``llmc_fsm.oneshot`` on a 2-layer random Llama
(hidden 64), save, reload with transformers and compare logits with the in-memory model's.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import yaml
from llmc_fsm_quantization import GPTQModifier, QuantizationModifier, gptq_quantize, resolve_scheme, rtn_quantize
from llmc_fsm_quantization.observers import OBSERVERS, importance_from_hessian, observe
from tiny_quant_models import tiny_llama

import llmc_fsm
from llmc_fsm import RecipeError
from llmc_fsm.toolkit.obs import HessianAccumulator

CHOICES = "minmax, static_minmax, memoryless_minmax, mse, memoryless_mse, imatrix_mse, nvfp4_expanded_mse"


def _args(spec: object):
    return resolve_scheme(spec, ["Linear"]).weights


def _data(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(seed))


def _search_reference(w, imp, *, grid, max_shrink, norm, patience, qmin=-8, qmax=7):
    """Symmetric int range search in float64, one scale per row of ``w`` ``[G, n]``: the row's max |w| shrunk by
    ``p = 1 - i / grid``; error ``sum imp * |w - q|^norm``; stop after ``patience`` steps that improve no row."""
    w = w.double()
    imp = torch.ones_like(w) if imp is None else imp.double().expand_as(w)
    amax = torch.maximum(w.amin(dim=1).abs(), w.amax(dim=1).abs())
    best = torch.full((w.shape[0],), float("inf"), dtype=torch.float64)
    scale = torch.zeros(w.shape[0], dtype=torch.float64)
    stale = 0
    for i in range(int(max_shrink * grid)):  # p down to 1 - (steps - 1) / grid: llm-compressor's grid
        s = amax * (1 - i / grid) / ((qmax - qmin) / 2)
        q = torch.clamp(torch.round(w / s[:, None]), qmin, qmax) * s[:, None]
        err = (imp * (w - q).abs() ** norm).sum(dim=1)
        better = err < best
        best = torch.where(better, err, best)
        scale = torch.where(better, s, scale)
        stale = 0 if bool(better.any()) else stale + 1
        if patience is not None and stale >= patience:
            break
    return scale


# --------------------------------------------------------------------------- every observer name
def test_the_minmax_and_mse_families_equal_their_definitions_on_a_weight() -> None:
    # llm-compressor observes a weight once: minmax / static_minmax / memoryless_minmax all take its extremes,
    # mse / memoryless_mse both search the range (grid 100, at most 20% shrink, |error|^2.4)
    torch.manual_seed(3)
    w = torch.randn(6, 32)
    args = _args({"preset": "W4A16", "weights": {"group_size": 8}})
    groups = w.reshape(-1, 8)
    minmax = (groups.double().abs().amax(dim=1) / 7.5).reshape(6, 4)
    mse = _search_reference(groups, None, grid=100, max_shrink=0.2, norm=2.4, patience=None).reshape(6, 4)
    for name in ("minmax", "static_minmax", "memoryless_minmax"):
        assert torch.allclose(observe(w, args, name)[0].double(), minmax, rtol=1e-6, atol=0), name
    for name in ("mse", "memoryless_mse"):
        assert torch.allclose(observe(w, args, name)[0].double(), mse, rtol=1e-6, atol=0), name
    assert not torch.allclose(minmax, mse)  # the search did shrink some ranges


def test_imatrix_mse_scale_equals_a_float64_importance_weighted_search() -> None:
    torch.manual_seed(4)
    w = torch.randn(6, 32)
    x = torch.randn(256, 32) * torch.linspace(0.05, 3.0, 32)  # inputs of very different magnitudes per column
    acc = HessianAccumulator(32)
    acc.add_batch(x)
    imp = importance_from_hessian(acc.hessian)
    mean_sq = (x.double() ** 2).mean(dim=0)
    assert torch.allclose(imp.double(), mean_sq / mean_sq.mean(), rtol=1e-5)  # E[x^2] / its mean
    args = _args({"preset": "W4A16", "weights": {"group_size": 8}})
    scale, _ = observe(w, args, "imatrix_mse", importance=imp)
    groups = w.reshape(-1, 8)
    group_imp = (mean_sq / mean_sq.mean()).expand(6, 32).reshape(-1, 8)
    expected = _search_reference(groups, group_imp, grid=20, max_shrink=0.95, norm=3.0, patience=5).reshape(6, 4)
    assert torch.allclose(scale.double(), expected, rtol=1e-6, atol=0)
    unweighted = _search_reference(groups, None, grid=20, max_shrink=0.95, norm=3.0, patience=5).reshape(6, 4)
    assert not torch.allclose(expected, unweighted)  # the importance changed some groups' ranges
    assert not torch.equal(scale, observe(w, args, "minmax")[0])


def test_imatrix_mse_without_calibration_statistics_is_refused() -> None:
    args = _args("W8A8")
    with pytest.raises(ValueError) as info:
        rtn_quantize(torch.randn(4, 16), args, "imatrix_mse")
    assert str(info.value) == (
        "observer imatrix_mse weights the error by the calibration inputs' importance: it needs calibration data"
    )
    assert "calibration_data" in QuantizationModifier(scheme="W8A8", observer="imatrix_mse").required_keys()
    assert "calibration_data" not in QuantizationModifier(scheme="W8A8").required_keys()


def test_gptq_imatrix_mse_takes_the_importance_from_its_hessian() -> None:
    torch.manual_seed(5)
    w = torch.randn(8, 32)
    x = torch.randn(512, 32) * torch.linspace(0.05, 3.0, 32)
    acc = HessianAccumulator(32)
    acc.add_batch(x)
    args = _args({"weights": {"num_bits": 4, "strategy": "channel"}})  # scales from the weight, before the sweep
    (q,) = gptq_quantize([w], acc.hessian, args=args, observer="imatrix_mse", actorder="static")
    mean_sq = (x.double() ** 2).mean(dim=0)
    expected = _search_reference(w, mean_sq / mean_sq.mean(), grid=20, max_shrink=0.95, norm=3.0, patience=5,
                                 )
    assert torch.allclose(q.scale.double().squeeze(1), expected, rtol=1e-6, atol=0)
    (plain,) = gptq_quantize([w], acc.hessian, args=args, observer="minmax", actorder="static")
    assert not torch.equal(q.scale, plain.scale)


def test_rtn_imatrix_mse_uses_the_calibration_inputs_of_each_module() -> None:
    model = tiny_llama()
    layer = model.model.layers[0].self_attn
    seen: list[torch.Tensor] = []
    handle = layer.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().reshape(-1, 64)))
    data = _data()
    with torch.no_grad():
        model(data)
    handle.remove()
    original = layer.q_proj.weight.detach().clone()
    recipe = {"q": {"QuantizationModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 64}},
                                             "observer": "imatrix_mse", "ignore": ["lm_head"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=8, progress=False)
    x = torch.cat(seen).double()  # the first layer's inputs do not depend on the quantization
    mean_sq = (x**2).mean(dim=0)
    args = _args({"preset": "W4A16", "weights": {"group_size": 64}})
    group_imp = (mean_sq / mean_sq.mean()).expand(64, 64)
    expected_scale = _search_reference(original, group_imp, grid=20, max_shrink=0.95, norm=3.0, patience=5)
    assert torch.allclose(layer.q_proj.weight_scale.double().squeeze(1), expected_scale, rtol=1e-5, atol=0)
    assert layer.q_proj.quantization_scheme.weights.observer == "imatrix_mse"
    minmax = rtn_quantize(original, args, "minmax")
    assert not torch.equal(layer.q_proj.weight, minmax.weight)


@pytest.mark.parametrize(
    ("where", "recipe_args", "message"),
    [
        ("modifier", {"observer": "percentile"},
         f"argument 'observer': unknown observer 'percentile'; choose one of {CHOICES}"),
        ("modifier, a near miss", {"observer": "minmaxx"},
         f"argument 'observer': unknown observer 'minmaxx'; choose one of {CHOICES}. Did you mean 'minmax'?"),
        ("config group weights", {"config_groups": {"g": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "strategy": "group", "group_size": 16, "observer": "fouroversix"}}}},
         "argument 'config_groups': config_groups entry 'g': weights: unknown observer 'fouroversix'; "
         f"choose one of {CHOICES}"),
        ("scheme weights", {"scheme": {"preset": "W4A16", "weights": {"observer": "mse_plus"}}},
         f": weights: unknown observer 'mse_plus'; choose one of {CHOICES}"),
        ("input activations", {"scheme": {"preset": "W8A8", "input_activations": {"observer": "imatrix_mse"}}},
         ": input_activations: observer imatrix_mse weighs weight errors by input importance; "
         "it is for weights only"),
        ("observer kwargs", {"scheme": {"preset": "W4A16", "weights": {"observer": "mse",
                                                                     "observer_kwargs": {"maxshrink": 0.5}}}},
         ": weights: observer_kwargs {'maxshrink': 0.5} are not supported (each observer runs with "
         "llm-compressor's defaults, see docs/quantization.md); remove them"),
    ],
)
def test_an_observer_we_do_not_have_is_refused_when_the_recipe_is_read(where, recipe_args, message) -> None:
    for name in ("GPTQModifier", "QuantizationModifier"):
        with pytest.raises(RecipeError) as info:
            llmc_fsm.Session({"q": {name: recipe_args}})
        sep = "" if message.startswith(":") else ", "  # a problem inside a scheme is not pinned to one argument
        assert str(info.value) == f"recipe <dict>, stage 'q', modifier {name}{sep}{message}", where


def test_observer_inside_config_groups_weights_is_honoured_and_saved(tmp_path) -> None:
    data = _data()
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}
    grouped = {"q": {"GPTQModifier": {"ignore": ["lm_head"], "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {**weights, "observer": "mse"}}}}}}
    native = {"q": {"GPTQModifier": {"ignore": ["lm_head"], "scheme": {"weights": weights}, "observer": "mse"}}}
    minmax = {"q": {"GPTQModifier": {"ignore": ["lm_head"], "scheme": {"weights": weights}}}}
    out = tmp_path / "out"
    a = llmc_fsm.oneshot(model=tiny_llama(), recipe=grouped, dataset=data, output_dir=out, progress=False)
    b = llmc_fsm.oneshot(model=tiny_llama(), recipe=native, dataset=data, progress=False)
    c = llmc_fsm.oneshot(model=tiny_llama(), recipe=minmax, dataset=data, progress=False)
    wa, wb, wc = (m.model.layers[1].mlp.down_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)  # it used to be replaced by minmax
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert [g["weights"]["observer"] for g in config["config_groups"].values()] == ["mse"]
    saved = yaml.safe_load((out / "recipe.yaml").read_text())["q"]["modifiers"][0]["GPTQModifier"]
    assert saved["observer"] == "mse" and saved["scheme"] is None  # config_groups carries the scheme


# --------------------------------------------------------------------------- several config groups
GROUPS = {
    "attention": {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                               "strategy": "channel"}},
    "mlp": {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                   "strategy": "group", "group_size": 16}},
}


@pytest.mark.parametrize("modifier", ["GPTQModifier", "QuantizationModifier"])
def test_several_config_groups_quantize_each_its_targets_and_reload(tmp_path, modifier) -> None:
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    out = tmp_path / "out"
    recipe = {"q": {modifier: {"ignore": ["lm_head"], "config_groups": GROUPS}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=_data(), output_dir=out, progress=False)
    bits = {m["name"]: (m["bits"], m.get("group_size"))
            for m in json.loads((out / "report.json").read_text())["sparsity"]["modules"] if "bits" in m}
    assert len(bits) == 14
    for name, value in bits.items():
        assert value == ((8, None) if "self_attn" in name else (4, 16)), name
    k = model.model.layers[1].self_attn.k_proj
    assert k.weight_scale.shape == (k.weight.shape[0], 1)
    assert all(torch.unique(k.weight[r]).numel() <= 256 for r in range(k.weight.shape[0]))
    down = model.model.layers[1].mlp.down_proj
    assert down.weight_scale.shape == (64, 128 // 16)
    assert max(torch.unique(g).numel() for g in down.weight.detach().reshape(64, -1, 16).reshape(-1, 16)) <= 16
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert sorted((g["weights"]["num_bits"], len(g["targets"])) for g in config["config_groups"].values()) == [
        (4, 1), (8, 1)]  # each group's own targets, as the recipe gives them (its module names before)
    x = torch.randint(0, 128, (2, 24))
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)
    saved = yaml.safe_load((out / "recipe.yaml").read_text())["q"]["modifiers"][0][modifier]
    assert saved["config_groups"] == GROUPS and saved["targets"] == ["re:.*self_attn.*", "re:.*mlp.*"]
    from llmc_fsm.recipes.building import resolve_recipe

    read_back = resolve_recipe((out / "recipe.yaml").read_text()).stages[0].modifiers[0]
    assert read_back.quantization_schemes == llmc_fsm.Session(recipe).recipe.modifiers[0].quantization_schemes


def _compressed_tensors_group_of(model, groups: dict) -> dict[str, str]:
    """The reference: ``{Linear name: group}`` as compressed-tensors 0.20's ``apply_quantization_config`` picks it
    (its own ``match_targets``, the first of which names the scheme; a target in two groups: the last group's)."""
    from compressed_tensors.utils.match import match_targets

    target_group = {}
    for group, spec in groups.items():
        for target in spec["targets"]:
            target_group[target] = group
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            matched = match_targets(name, module, list(target_group))
            if matched:
                found[name] = target_group[matched[0]]
    return found


ORDER = "compressed-tensors' order (an exact name, then re: patterns in string order, then class names)"
W8_CHANNEL = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
W4_G16 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}
OVERRIDE = {"int4": {"targets": ["Linear"], "weights": W4_G16},
            "exact": {"targets": ["model.layers.1.mlp.down_proj"], "weights": W8_CHANNEL},
            "q_int8": {"targets": ["re:.*q_proj$"], "weights": W8_CHANNEL}}


@pytest.mark.parametrize("modifier", ["GPTQModifier", "QuantizationModifier"])
def test_overlapping_config_groups_give_each_module_its_most_specific_target_as_compressed_tensors(
        tmp_path, modifier, caplog) -> None:
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    expected = _compressed_tensors_group_of(model, OVERRIDE)
    assert sorted(n for n, g in expected.items() if g != "int4") == [
        "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.q_proj"]
    out = tmp_path / "out"
    recipe = {"q": {modifier: {"ignore": ["lm_head"], "config_groups": OVERRIDE}}}
    with caplog.at_level(logging.INFO, logger="llmc_fsm_quantization"):
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=_data(), output_dir=out, progress=False)
    bits = {m["name"]: (m["bits"], m.get("group_size"))
            for m in json.loads((out / "report.json").read_text())["sparsity"]["modules"] if "bits" in m}
    assert bits == {name: (8, None) if group != "int4" else (4, 16) for name, group in expected.items()}
    lines = [r.getMessage() for r in caplog.records if "config groups" in r.getMessage()]  # in module order, once
    assert lines == [
        f"{modifier}: config groups 'q_int8' and 'int4' both select model.layers.{{0..1}}.self_attn.q_proj: they take "
        "'q_int8', whose target 're:.*q_proj$' comes first in " + ORDER,
        f"{modifier}: config groups 'exact' and 'int4' both select model.layers.1.mlp.down_proj: they take 'exact', "
        "whose target 'model.layers.1.mlp.down_proj' comes first in " + ORDER,
    ]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    saved = {target: g["weights"]["num_bits"] for g in config["config_groups"].values() for target in g["targets"]}
    assert saved == {name: 8 if group != "int4" else 4 for name, group in expected.items()}  # exact names: no overlap
    x = torch.randint(0, 128, (2, 24))
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)


def test_explain_shows_the_modules_of_each_config_group_and_which_group_took_the_shared_ones() -> None:
    recipe = {"q": {"GPTQModifier": {"ignore": ["lm_head"], "config_groups": OVERRIDE}}}
    modifier = llmc_fsm.Session(recipe).recipe.modifiers[0]
    assert modifier.explain_model(tiny_llama()) == [
        "config group 'int4' (int4/g16): 11 modules, model.layers.{0..1}.self_attn.k_proj, "
        "model.layers.{0..1}.self_attn.v_proj, model.layers.{0..1}.self_attn.o_proj, "
        "model.layers.{0..1}.mlp.gate_proj, model.layers.{0..1}.mlp.up_proj, model.layers.0.mlp.down_proj",
        "config group 'exact' (int8): 1 modules, model.layers.1.mlp.down_proj",
        "config group 'q_int8' (int8): 2 modules, model.layers.{0..1}.self_attn.q_proj",
        "config groups 'q_int8' and 'int4' both select model.layers.{0..1}.self_attn.q_proj: they take 'q_int8', whose "
        "target 're:.*q_proj$' comes first in " + ORDER,
        "config groups 'exact' and 'int4' both select model.layers.1.mlp.down_proj: they take 'exact', whose target "
        "'model.layers.1.mlp.down_proj' comes first in " + ORDER,
    ]
    one_group = llmc_fsm.Session({"q": {"GPTQModifier": {"scheme": "W8A16"}}}).recipe.modifiers[0]
    assert one_group.explain_model(tiny_llama()) == []


def _refusal(groups: dict) -> str:
    import llmc_fsm_quantization.gptq as gptq_module

    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls: list[int] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gptq_module, "gptq_quantize", lambda *a, **k: calls.append(1))
        with pytest.raises(ValueError) as info:
            llmc_fsm.oneshot(model=model, recipe={"q": {"GPTQModifier": {"config_groups": groups}}}, dataset=_data(),
                             progress=False)
    assert calls == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return str(info.value)


def test_a_config_group_the_others_leave_with_no_module_is_refused_before_any_work() -> None:
    # "re:.*mlp.*" sorts before "re:.*up_proj": compressed-tensors gives the up_proj to 'mlp', 'projections' runs unused
    groups = {**GROUPS, "projections": {"targets": ["re:.*up_proj"], "weights": {"num_bits": 8}}}
    assert set(_compressed_tensors_group_of(tiny_llama(), groups).values()) == {"attention", "mlp"}
    assert _refusal(groups) == (
        "GPTQModifier: config group 'projections' quantizes no module: each module its targets ['re:.*up_proj'] "
        "select goes to config group 'mlp', whose target comes first in " + ORDER[:-1] + "; a parameter name, a "
        "container or __ALL__ does not count), and llm-compressor would run with the group unused: remove the group "
        "or change the targets"
    )
    # a parameter's name: compressed-tensors does not match it, so 'Linear' takes the q_proj (a tester's case)
    by_parameter = {"int4": {"targets": ["Linear"], "weights": W4_G16},
                    "q": {"targets": ["re:.*q_proj.weight"], "weights": W8_CHANNEL}}
    assert set(_compressed_tensors_group_of(tiny_llama(), by_parameter).values()) == {"int4"}
    assert _refusal(by_parameter).startswith(
        "GPTQModifier: config group 'q' quantizes no module: each module its targets ['re:.*q_proj.weight'] select "
        "goes to config group 'int4', whose target comes first")


def test_one_target_in_two_config_groups_and_modules_named_only_through_containers_are_refused() -> None:
    twice = {"a": {"targets": ["re:.*proj"], "weights": W4_G16}, "b": {"targets": ["re:.*proj"], "weights": W8_CHANNEL}}
    with pytest.raises(RecipeError) as info:  # when the recipe is read
        llmc_fsm.Session({"q": {"GPTQModifier": {"config_groups": twice}}})
    assert str(info.value).endswith(
        "argument 'config_groups': config_groups entries 'a' and 'b' both give target 're:.*proj'; a module is "
        "quantized with one scheme (llm-compressor takes the last entry's): keep the target in one entry")
    once = {"a": {"targets": ["re:.*proj", "re:.*proj"], "weights": W4_G16}}  # twice in one entry: harmless
    modifier = llmc_fsm.Session({"q": {"GPTQModifier": {"config_groups": once}}}).recipe.modifiers[0]
    schemes = modifier.quantization_schemes
    assert list(schemes) == ["a"] and schemes["a"].weights.num_bits == 4
    containers = {"mlp": {"targets": ["LlamaMLP"], "weights": W4_G16},
                  "layer0": {"targets": ["re:model.layers.0$"], "weights": W8_CHANNEL}}
    assert _refusal(containers) == (
        "GPTQModifier: module model.layers.0.mlp.gate_proj is selected by config groups 'mlp', 'layer0' only through "
        "parameter names or containers their targets name, which compressed-tensors does not match: a module is "
        "quantized with one scheme: name it (or its class) in one group's targets"
    )


def test_several_presets_in_a_scheme_map_are_config_groups_in_compressed_tensors_order(tmp_path) -> None:
    """llm-compressor's ``scheme: {W8A8: [re:.*q_proj$], FP8_DYNAMIC: [Linear]}`` builds group_0, group_1; it was
    refused with advice ("split into modifiers") that led to another refusal (found by a tester)."""
    recipe = ("q:\n  QuantizationModifier: {scheme: {W8A8: ['re:.*q_proj$'], FP8_DYNAMIC: [Linear]}, "
              "ignore: [lm_head]}\n")
    modifier = llmc_fsm.Session(recipe).recipe.modifiers[0]
    assert {k: (v.weights.type, v.targets) for k, v in modifier.quantization_schemes.items()} == {
        "group_0": ("int", ["re:.*q_proj$"]), "group_1": ("float", ["Linear"])}
    model = tiny_llama()
    llmc_fsm.oneshot(model=model, recipe=recipe, output_dir=tmp_path / "out", progress=False)
    kinds = {n: m.quantization_scheme.weights.type for n, m in model.named_modules() if hasattr(m, "weight_scale")}
    assert kinds == {n: "int" if n.endswith("q_proj") else "float" for n in _compressed_tensors_group_of(
        model, {"a": {"targets": ["re:.*q_proj$"]}, "b": {"targets": ["Linear"]}})}


def test_match_precedence_orders_exact_names_then_patterns_then_classes_as_compressed_tensors() -> None:
    from compressed_tensors.utils.match import match_targets

    from llmc_fsm.toolkit import match_precedence

    model = tiny_llama()
    down = model.model.layers[0].mlp.down_proj
    name = "model.layers.0.mlp.down_proj"
    given = ["Linear", "re:.*proj", "re:.*down_proj", "__ALL__", f"{name}.weight", name, "re:.*mlp$", "LlamaMLP",
             "re:.*down_proj.weight"]
    assert match_precedence(name, down, given) == [name, "re:.*down_proj", "re:.*proj", "Linear"]
    assert match_precedence(name, down, given) == match_targets(name, down, given)  # the reference
    late = "transformer.h.0.mlp.down_proj"  # an exact name that sorts after "re:" still comes first
    assert match_precedence(late, down, ["re:.*down_proj", "Linear", late]) == [late, "re:.*down_proj", "Linear"]
    mlp = model.model.layers[0].mlp
    assert match_precedence("model.layers.0.mlp", mlp, given) == ["re:.*mlp$", "LlamaMLP"]


@pytest.mark.parametrize(("targets", "reached", "probe"), [
    (["LlamaMLP"],
     "model.layers.{0..1}.mlp.gate_proj, model.layers.{0..1}.mlp.up_proj, model.layers.{0..1}.mlp.down_proj", "mlp"),
    (["re:.*q_proj.weight"], "model.layers.{0..1}.self_attn.q_proj", "self_attn"),
])
def test_targets_compressed_tensors_would_not_match_quantize_here_with_one_warning(targets, reached, probe,
                                                                                  caplog) -> None:
    """A container or a parameter's name selects modules here (as for pruning), while llm-compressor 0.14 quantizes
    nothing with it (compressed-tensors matches the module itself): one warning says so (found by a tester)."""
    model = tiny_llama()
    with caplog.at_level(logging.WARNING, logger="llmc_fsm_quantization"):
        llmc_fsm.oneshot(model=model, recipe={"q": {"QuantizationModifier": {
            "config_groups": {"g": {"targets": targets, "weights": W8_CHANNEL}}}}}, progress=False)
    assert [r.getMessage() for r in caplog.records if "quantized here" in r.getMessage()] == [
        f"QuantizationModifier: {reached} are quantized here, selected only through a parameter name, a container or "
        "__ALL__ among the targets; compressed-tensors matches a quantization target against the module itself (its "
        "name, an re: pattern on its name, or its class), so llm-compressor 0.14 leaves them dense: to run the recipe "
        "alike in both, target the modules themselves (e.g. 'Linear' or 're:.*mlp\\..*_proj$')"]
    quantized = {n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    leaves = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"] if probe == "mlp" else ["self_attn.q_proj"]
    assert quantized == {f"model.layers.{i}.{n}" for i in range(2) for n in leaves}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmc_fsm_quantization"):
        llmc_fsm.oneshot(model=tiny_llama(), recipe={"q": {"QuantizationModifier": {
            "config_groups": {"g": {"targets": ["Linear"], "weights": W8_CHANNEL}}}}}, progress=False)
    assert not [r for r in caplog.records if "quantized here" in r.getMessage()]


def test_scheme_and_config_groups_together_are_refused() -> None:
    with pytest.raises(RecipeError) as info:
        llmc_fsm.Session({"q": {"GPTQModifier": {"scheme": "W8A8", "config_groups": GROUPS}}})
    assert str(info.value).endswith("argument 'scheme': give either scheme or config_groups, not both (as in "
                                    "llm-compressor)")
    with pytest.raises(RecipeError) as info:
        llmc_fsm.Session({"q": {"GPTQModifier": {"config_groups": {"g": {"weights": {"num_bits": 8}}}}}})
    assert str(info.value).endswith("argument 'config_groups': config_groups entry 'g' needs targets: a list of "
                                    "module patterns (e.g. [Linear]), got None")


def test_two_quantizing_modifiers_over_disjoint_modules_in_one_stage_run_and_reload(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    recipe = {"q": {"GPTQModifier": {"scheme": "W8A8", "targets": ["re:.*self_attn.*"]},
                    "QuantizationModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}},
                                             "targets": ["re:.*mlp.*"]}}}
    model = tiny_llama()
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=_data(), output_dir=out, progress=False)
    bits = {m["name"]: m["bits"] for m in json.loads((out / "report.json").read_text())["sparsity"]["modules"]
            if "bits" in m}
    assert bits["model.layers.1.self_attn.k_proj"] == 8 and bits["model.layers.1.mlp.down_proj"] == 4
    x = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        assert torch.equal(model(x).logits, AutoModelForCausalLM.from_pretrained(out).eval()(x).logits)


# --------------------------------------------------------------------------- defaults that differ
def test_a_recipe_without_ignore_keeps_lm_head_dense_says_so_and_records_it(tmp_path, caplog) -> None:
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="llmc_fsm_quantization._base"):
        llmc_fsm.oneshot(model=tiny_llama(), recipe={"q": {"QuantizationModifier": {"scheme": "W8A8"}}}, output_dir=out,
                         progress=False)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "llmc_fsm_quantization._base"]
    assert lines and {level for level, _ in lines} == {"WARNING"}  # shown without any logging set up
    assert {text for _, text in lines} == {
        "QuantizationModifier: no ignore given: lm_head is kept dense (ignore: [lm_head]; llm-compressor's default "
        "ignore is empty, which quantizes lm_head too: give ignore: [] for that)"
    }
    saved = yaml.safe_load((out / "recipe.yaml").read_text())["q"]["modifiers"][0]["QuantizationModifier"]
    assert saved["ignore"] == ["lm_head"]
    report = json.loads((out / "report.json").read_text())["sparsity"]["modules"]
    assert "lm_head" not in {m["name"] for m in report if "bits" in m}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llmc_fsm_quantization._base"):
        QuantizationModifier(scheme="W8A8", ignore=[])
    assert not [r for r in caplog.records if r.name == "llmc_fsm_quantization._base"]



def test_no_ignore_line_when_the_targets_cannot_reach_the_head(caplog) -> None:
    """Targets of attention projections only, no ignore: the line said llm-compressor's empty default quantizes
    lm_head and advised ignore: [], which would change nothing (llm-compressor's multiple-modifiers example; found by
    a tester)."""
    recipe = {"q": {"QuantizationModifier": {"scheme": "W8A8", "targets": [r"re:.*self_attn\.(k|q|o|v)_proj$"]}}}
    with caplog.at_level(logging.INFO, logger="llmc_fsm_quantization._base"):
        llmc_fsm.oneshot(model=tiny_llama(), recipe=recipe, progress=False)
    assert [r.getMessage() for r in caplog.records if "no ignore given" in r.getMessage()] == []

def test_every_observer_name_constructs_both_modifiers() -> None:
    for name in OBSERVERS:
        scheme = "NVFP4A16" if name == "nvfp4_expanded_mse" else None  # an NVFP4 observer needs NVFP4 weights
        assert GPTQModifier(observer=name, scheme=scheme).quantization_scheme.weights.observer == name
        assert QuantizationModifier(observer=name, scheme=scheme).observer == name


# --------------------------------------------------------------------------- llm-compressor idioms
IDIOM = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 16, observer: mse}
    GPTQModifier:
      block_size: 32
      dampening_frac: 0.02
"""


def test_a_bare_gptq_modifier_takes_the_quantization_modifiers_config_of_its_stage(tmp_path, caplog) -> None:
    from llmc_fsm.recipes.building import resolve_recipe

    with caplog.at_level(logging.INFO, logger="llmc_fsm_quantization.gptq"):
        recipe = resolve_recipe(IDIOM)
    (mod,) = recipe.modifiers  # the QuantizationModifier is not run by itself
    assert type(mod) is GPTQModifier and (mod.block_size, mod.dampening_frac) == (32, 0.02)
    assert [r.getMessage() for r in caplog.records if r.name == "llmc_fsm_quantization.gptq"] == [
        "stage 'quant_stage': GPTQModifier has no quantization config of its own and takes the QuantizationModifier's "
        "before it (as llm-compressor does): GPTQ quantizes with that config, and the QuantizationModifier does not "
        "run by itself"
    ]
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}
    native = {"q": {"GPTQModifier": {"ignore": ["lm_head"], "scheme": {"weights": weights}, "observer": "mse",
                                     "block_size": 32, "dampening_frac": 0.02}}}
    out = tmp_path / "out"
    theirs = llmc_fsm.oneshot(model=tiny_llama(), recipe=IDIOM, dataset=_data(), output_dir=out, progress=False)
    ours = llmc_fsm.oneshot(model=tiny_llama(), recipe=native, dataset=_data(), progress=False)
    for (name, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    report = json.loads((out / "report.json").read_text())["sparsity"]["modules"]
    assert all(m["rel_output_error"] > 0 for m in report if "bits" in m)  # GPTQ's, measured on the calibration
    saved = yaml.safe_load((out / "recipe.yaml").read_text())["quant_stage"]["modifiers"]
    assert [next(iter(m)) for m in saved] == ["GPTQModifier"]


def test_a_gptq_modifier_with_its_own_config_still_meets_the_quantization_modifier_as_a_second_quantizer() -> None:
    recipe = IDIOM.replace("      block_size: 32\n", "      block_size: 32\n      scheme: W8A8\n")
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=tiny_llama(), recipe=recipe, dataset=_data(), progress=False)
    assert str(info.value).startswith("GPTQModifier of stage 'quant_stage' and QuantizationModifier of stage "
                                      "'quant_stage' both quantize 14 modules")


def test_llm_compressors_saved_bare_gptq_with_linear_and_empty_ignore_takes_the_config_and_two_configs_are_refused():
    """B3's cases (session 31): llm-compressor's own saved recipe.yaml writes the bare GPTQModifier with
    ``targets: [Linear]`` and ``ignore: []`` (its ``has_config`` counts those as no config); it was read as a second
    quantizer and refused. Two QuantizationModifiers before a bare GPTQModifier (llm-compressor runs GPTQ with both
    configs) were refused as two quantizers of the same modules; now with the real cause and the fix."""
    from llmc_fsm.recipes.building import resolve_recipe

    saved = IDIOM.replace("      block_size: 32\n", "      block_size: 32\n      targets: [Linear]\n      ignore: []\n")
    (mod,) = resolve_recipe(saved).modifiers
    assert type(mod) is GPTQModifier and mod.ignore == ["lm_head"] and mod.observer == "mse"
    two = """
s:
  a_modifiers:
    QuantizationModifier: {scheme: W8A16, targets: ["re:.*self_attn.*"]}
  b_modifiers:
    QuantizationModifier: {scheme: W4A16, targets: ["re:.*mlp.*"]}
  c_modifiers:
    GPTQModifier: {block_size: 128}
"""
    with pytest.raises(llmc_fsm.RecipeError) as info:
        resolve_recipe(two)
    assert str(info.value).endswith(
        "GPTQModifier has no quantization config of its own and stage 's' has 2 QuantizationModifiers before it: "
        "llm-compressor runs GPTQ with all their configs, llmc-fsm's GPTQModifier takes one: put their schemes in one "
        "QuantizationModifier's config_groups (one group each), or give the GPTQModifier those config_groups"
    )


def test_the_mse_search_stops_at_llm_compressors_last_step():
    """``mse`` tries ``p = 1, 0.99, ..., 0.81`` (``int(0.2 * 100)`` = 20 steps) as llm-compressor 0.14 and the GPTQ
    reference code do; it tried 0.80 too, and heavy-tailed rows took it (B3, session 31: 470 of SmolLM2's 576
    down_proj rows). Rows whose error falls all the way take the last step, 0.81."""
    from llmc_fsm_quantization.observers import as_row_args, row_qparams

    torch.manual_seed(0)
    w = torch.randn(64, 4096)  # Gaussian rows: 4-bit's best clip (~2.9 sigma) is below 0.81 of their max (~3.9)
    args = as_row_args(_args({"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}}))
    scale, _ = row_qparams(w, args, "mse")
    ratio = (scale.squeeze(1).double() * 7.5 / w.abs().amax(dim=1).double()).numpy()
    steps = [round(1 - i / 100, 2) for i in range(20)]
    assert set(ratio.round(4)) == {0.81} and 0.81 in steps and 0.8 not in steps
