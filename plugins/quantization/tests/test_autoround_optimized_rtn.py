"""AutoRoundModifier with ``iters: 0`` and ``disable_opt_rtn: false`` (llm-compressor's default): auto-round's
optimized round-to-nearest, each group's range searched on the error weighted by its inputs' mean squares."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from llmc_fsm_quantization import resolve_scheme
from llmc_fsm_quantization.autoround import _Tuned, importance_without_zeros, optimized_rtn_multipliers

import llmc_fsm

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from tiny_llama import LINEARS, llama


def _reference_int_search(w: torch.Tensor, importance: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """auto-round's ``opt_rtn_int_sym`` written from its description, in float64: per group of ``group`` columns,
    ``g`` its value of largest magnitude, try the inverse scales ``-(n - step * i) / g`` (``n = 2^(bits-1)``; ``i``
    from 0, then -100..-1, 1..100, ``step = 0.0075 n``; 2 bits: -90..90, ``step = 0.01``), codes
    ``clamp(round(w * inverse), -n, n - 1)``, and keep the first scale with the lowest ``sum imp (q s - w)^2``.
    Returns the scales ``[rows, cols // group]``."""
    rows, cols = w.shape
    wg = w.double().reshape(rows, cols // group, group)
    imp = importance.double().expand(rows, cols).reshape(rows, cols // group, group)
    n = 2 ** (bits - 1)
    g = torch.gather(wg, -1, wg.abs().argmax(dim=-1, keepdim=True))
    step, reach = (0.01, 90) if bits == 2 else (0.0075 * n, 100)
    best_loss = best_scale = None
    for i in [0, *range(-reach, 0), *range(1, reach + 1)]:
        inverse = -(n - step * i) / g
        scale = 1 / inverse
        q = torch.clamp(torch.round(wg * inverse), -n, n - 1)
        loss = ((q * scale - wg) ** 2 * imp).sum(dim=-1, keepdim=True)
        if best_loss is None:
            best_loss, best_scale = loss, scale
            continue
        better = loss < best_loss
        best_loss, best_scale = torch.where(better, loss, best_loss), torch.where(better, scale, best_scale)
    return best_scale.squeeze(-1)


def _codes(weight: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    rows, cols = weight.shape
    return torch.round(weight.double().reshape(rows, cols // group, group) / scale.double().unsqueeze(-1))


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (2, 16), (8, 64)], ids=["w4-g32", "w2-g16", "w8-channel"])
def test_the_integer_search_equals_a_float64_reference(bits: int, group: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(16, 64, generator=gen)
    w[0, 3], w[0, 9] = -4.0, 4.0  # a tie of the largest magnitude, the negative first: it maps to -2^(bits-1)
    w[1, 3], w[1, 9] = 4.0, -4.0
    importance = torch.exp(torch.randn(64, generator=gen))  # positive, uneven across columns
    strategy = {"strategy": "channel"} if group == 64 else {"strategy": "group", "group_size": group}
    args = resolve_scheme({"weights": {"num_bits": bits, "type": "int", "symmetric": True, **strategy}}, ["Linear"]).weights
    tuned = _Tuned(w, args)
    plain = tuned.result().scale.reshape(16, -1)
    tuned.search_range_(importance, optimized_rtn_multipliers(args))
    result = tuned.result()
    scale = result.scale.reshape(16, -1)
    expected = _reference_int_search(w, importance, bits, group)
    torch.testing.assert_close(scale.double(), expected, rtol=1e-6, atol=0)
    assert torch.equal(_codes(result.weight, scale, group), _codes(result.weight, expected, group))
    n = 2 ** (bits - 1)
    assert torch.equal(_codes(w, scale, group).clamp(-n, n - 1), _codes(result.weight, scale, group))
    assert (scale != plain).float().mean() > 0.5  # the search moved most groups off round-to-nearest's range


def test_zero_importance_is_filled_as_auto_round_fills_it() -> None:
    """More than half of a group's inputs zero: ``|w| + sqrt(sum w^2 / 32)`` (``|w|`` for 2 or 3 bits); fewer: the
    zeros take the mean of the group's other values; a group without zeros is left as it is."""
    importance = torch.tensor([[[0.0, 2.0, 4.0, 0.0], [0.0, 0.0, 0.0, 5.0], [1.0, 2.0, 3.0, 4.0]]])
    w = torch.tensor([[[1.0, 1.0, 1.0, 1.0], [1.0, -2.0, 2.0, 4.0], [9.0, 9.0, 9.0, 9.0]]])
    filled = importance_without_zeros(importance, w, 4)
    spread = (25.0 / 32) ** 0.5
    expected = torch.tensor([[[3.0, 2.0, 4.0, 3.0], [1 + spread, 2 + spread, 2 + spread, 4 + spread], [1, 2, 3, 4]]])
    torch.testing.assert_close(filled, expected, rtol=0, atol=1e-6)
    assert torch.equal(importance_without_zeros(importance, w, 2)[0, 1], torch.tensor([1.0, 2.0, 2.0, 4.0]))
    no_zeros = importance[:, 2:]
    assert importance_without_zeros(no_zeros, w[:, 2:], 4) is no_zeros


@pytest.mark.parametrize("preset", ["NVFP4A16", "MXFP4A16"])
def test_float_formats_keep_per_group_the_first_candidate_with_the_lowest_weighted_error(preset: str) -> None:
    """NVFP4 (0.50-1.51 of each group's maximum) and MX (its power-of-two scale one step down or up): each group's
    chosen multiplier gives the lowest importance-weighted error among the candidates, each measured on a fresh
    quantizer with that range."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    importance = torch.exp(torch.randn(64, generator=gen))
    args = resolve_scheme(preset, ["Linear"]).weights
    candidates = optimized_rtn_multipliers(args)
    tuned = _Tuned(w, args)
    tuned.search_range_(importance, candidates)
    chosen = tuned.alpha.detach().clone()
    group = int(args.group_size)
    imp = importance.expand(8, 64).reshape(8, 64 // group, group)

    def error(multiplier: float) -> torch.Tensor:
        fresh = _Tuned(w, args)
        with torch.no_grad():
            fresh.alpha.fill_(multiplier)
            fresh.beta.fill_(multiplier)
        q = fresh.quantized(final=True).reshape(8, 64 // group, group)
        return ((q - w.float().reshape(8, 64 // group, group)) ** 2 * imp).sum(dim=-1)

    errors = torch.stack([error(m) for m in candidates])  # [candidates, rows, groups]
    first_best = torch.tensor(candidates)[errors.argmin(dim=0)]  # argmin returns the first minimum
    assert torch.equal(chosen, first_best)
    assert bool((chosen != 1.0).any())


@pytest.fixture()
def tiny():
    torch.manual_seed(0)
    return llama(layers=2, hidden=64, heads=4, kv_heads=2)


def test_each_targets_importance_is_its_calibration_inputs_mean_square(tiny) -> None:
    """Layer 0 (the float model's inputs): every target's scales equal the float64 reference search weighted by the
    mean square of its inputs, per column, over the calibration tokens."""
    float_model = copy.deepcopy(tiny)
    data = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in LINEARS}
    layer = float_model.model.layers[0]
    for name in LINEARS:
        layer.get_submodule(name).register_forward_pre_hook(lambda m, a, _n=name: seen[_n].append(a[0].detach()))
    with torch.no_grad():
        float_model(data)
    recipe = {"q": {"AutoRoundModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 32}}, "iters": 0,
                                          "ignore": ["lm_head"]}}}
    returned = llmc_fsm.oneshot(model=tiny, recipe=recipe, dataset=data, batch_size=4, progress=False)
    for name in LINEARS:
        x = torch.cat(seen[name]).reshape(-1, seen[name][0].shape[-1]).double()
        w = layer.get_submodule(name).weight.detach()
        expected = _reference_int_search(w, x.pow(2).mean(dim=0), 4, 32)
        module = tiny.model.layers[0].get_submodule(name)
        torch.testing.assert_close(module.weight_scale.double(), expected, rtol=1e-6, atol=0, msg=name)
    tuning = returned.llmc_fsm_report.tuning["AutoRoundModifier (q)"]
    assert {r["kept"] for r in tuning.values()} == {"opt_rtn_mode"} and len(tuning) == 2


def test_llmcompressors_iters_zero_recipe_runs_saves_and_reloads_with_equal_logits(tmp_path, tiny) -> None:
    from transformers import AutoModelForCausalLM

    text = (
        "quant_stage:\n  quant_modifiers:\n    AutoRoundModifier:\n      targets: Linear\n      ignore: [lm_head]\n"
        "      iters: 0\n      config_groups:\n        group_0:\n          targets: [Linear]\n"
        "          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}\n"
    )
    data = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(2))
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=tiny, recipe=text, dataset=data, output_dir=out, progress=False)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(tiny(x).logits, reloaded(x).logits)
    report = json.loads((out / "report.json").read_text())
    assert {r["kept"] for r in report["tuning"]["AutoRoundModifier (quant_stage)"].values()} == {"opt_rtn_mode"}
    assert (out / "recipe.yaml").read_text().count("disable_opt_rtn: false") == 1


def test_fused_experts_are_searched_on_their_inputs_mean_squares(tmp_path) -> None:
    """With calibrate_all_experts every token reaches every expert, so each expert's gate_proj and up_proj are
    searched on the mean square of the experts module's inputs: their scales equal the float64 reference's; the
    checkpoint reloads with the in-memory logits."""
    from tiny_families import build
    from transformers import AutoModelForCausalLM

    from llmc_fsm.toolkit import weight_views

    model = build("qwen3_moe")
    seen: list[torch.Tensor] = []
    experts = model.model.layers[0].mlp.experts
    handle = experts.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().reshape(-1, a[0].shape[-1])))
    data = torch.randint(3, 128, (8, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        copy.deepcopy(model)(data)  # the float model: layer 0's experts see the float inputs in the pipeline too
    handle.remove()
    floats = {name: view.weight.detach().clone() for name, view in weight_views(experts).items()}
    recipe = {"q": {"AutoRoundModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}, "iters": 0,
                                          "calibrate_all_experts": True, "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=tmp_path / "o", progress=False)
    x = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(x).logits, AutoModelForCausalLM.from_pretrained(tmp_path / "o")(x).logits)
    importance = torch.cat(seen).double().pow(2).mean(dim=0)
    views = weight_views(model.model.layers[0].mlp.experts)
    for name in ("0.gate_proj", "0.up_proj", "3.gate_proj", "3.up_proj"):
        expected = _reference_int_search(floats[name], importance, 4, 16)
        torch.testing.assert_close(views[name].quantized_params["weight_scale"].double(), expected, rtol=1e-6, atol=0,
                                   msg=name)


def test_the_report_line_says_what_iters_zero_did() -> None:
    """With iters: 0 nothing is tuned and AutoRound measures no error (None); a saved progress of errors measured
    is still summed up."""
    from llmc_fsm.report.build import _tuning_line

    unmeasured = {f"model.layers.{i}": {"rtn_mse": None, "tuned_mse": None, "kept": "opt_rtn_mode"} for i in range(3)}
    assert _tuning_line("AutoRoundModifier (q)", unmeasured) == (
        "AutoRoundModifier (q): 3 layers rounded to nearest with each group's range searched on the calibration "
        "inputs' mean squares (iters: 0, auto-round's optimized round-to-nearest, no tuning)"
    )
    plain = {name: dict(r, kept="rtn_mode") for name, r in unmeasured.items()}
    assert _tuning_line("AutoRoundModifier (q)", plain) == (
        "AutoRoundModifier (q): 3 layers rounded to nearest (iters: 0, no tuning)"
    )
    measured = {f"model.layers.{i}": {"rtn_mse": 2.0, "tuned_mse": 2.0 - i / 2, "kept": "opt_rtn_mode"} for i in range(3)}
    assert _tuning_line("AutoRoundModifier (q)", measured).endswith(
        "(iters: 0, auto-round's optimized round-to-nearest, no tuning); output MSE vs plain round-to-nearest: median "
        "ratio 0.750 (0.500-1.000)"
    )


@pytest.mark.parametrize("disable_opt_rtn", [False, True])
def test_iters_zero_runs_no_forward_of_its_own_and_keeps_no_input(tiny, monkeypatch, disable_opt_rtn) -> None:
    """Nothing is tuned, so AutoRound runs no forward of its own (the layer with quantized weights, or the float
    layer for the next layer's targets) and keeps no layer input: no error is measured, and the report says so."""
    from llmc_fsm_quantization.autoround import AutoRoundModifier

    own = []
    real = torch.func.functional_call
    monkeypatch.setattr(torch.func, "functional_call", lambda *a, **kw: own.append(1) or real(*a, **kw))
    monkeypatch.setattr(AutoRoundModifier, "_float_outputs", lambda *a: own.append(2))
    captured = []
    monkeypatch.setattr(AutoRoundModifier, "_capture_input", lambda self, key: captured.append(key))
    recipe = {"q": {"AutoRoundModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 32}}, "iters": 0,
                                          "disable_opt_rtn": disable_opt_rtn, "ignore": ["lm_head"]}}}
    data = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
    returned = llmc_fsm.oneshot(model=tiny, recipe=recipe, dataset=data, batch_size=4, progress=False)
    assert own == [] and captured == []
    tuning = returned.llmc_fsm_report.tuning["AutoRoundModifier (q)"]
    kept = "rtn_mode" if disable_opt_rtn else "opt_rtn_mode"
    assert tuning == {f"model.layers.{i}": {"rtn_mse": None, "tuned_mse": None, "kept": kept} for i in range(2)}
    assert sum(1 for m in returned.llmc_fsm_report.modules if m.bits == 4) == 2 * len(LINEARS)
