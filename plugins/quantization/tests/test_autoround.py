"""AutoRoundModifier (SignRound): lower layer output error than round-to-nearest, refusals, save/reload."""

from __future__ import annotations

import copy
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from llmc_fsm_quantization import resolve_scheme, rtn_quantize
from llmc_fsm_quantization.autoround import AutoRoundModifier, signround_layer

import llmc_fsm
from llmc_fsm.pipeline.forward import capture_layer_inputs, first_output
from llmc_fsm.recipes.building import resolve_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from tiny_llama import LINEARS, llama

W4G16 = {"preset": "W4A16", "weights": {"group_size": 16}}


def _output_mse(layer, weights: dict, inputs, targets) -> float:
    """Mean squared error of ``layer`` with ``weights`` ({relative name: weight}) against ``targets``, float64."""
    layer = copy.deepcopy(layer)
    with torch.no_grad():
        for name, w in weights.items():
            layer.get_submodule(name).weight.copy_(w)
        se = sum(
            float((first_output(layer(*a, **kw)).double() - t.double()).pow(2).sum())
            for (a, kw), t in zip(inputs, targets, strict=True)
        )
    return se / sum(t.numel() for t in targets)


def _full_range_rtn(w: torch.Tensor, args) -> torch.Tensor:
    """Round-to-nearest on AutoRound's grid, computed group by group in float64: symmetric, the side of larger
    magnitude on -2^(b-1) (auto-round's int_sym); asymmetric, compressed-tensors' grid."""
    if not args.symmetric:
        return rtn_quantize(w, args).weight
    rows, cols = w.shape
    size = args.group_size or cols
    half = 2 ** (args.num_bits - 1)
    out = torch.empty_like(w)
    for r in range(rows):
        for g0 in range(0, cols, size):
            group = w[r, g0 : g0 + size].detach().double()
            top, bottom = max(float(group.max()), 0.0), -min(float(group.min()), 0.0)
            scale = bottom / half if top < bottom else -top / half
            scale = scale if abs(scale) >= 1e-5 else (1e-5 if scale >= 0 else -1e-5)
            scale = float(torch.tensor(scale, dtype=torch.float32))  # the stored scale
            q = torch.clamp(torch.round(group / scale), -half, half - 1)
            out[r, g0 : g0 + size] = (q * scale).to(w.dtype)
    return out


W8_CHANNEL = {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}


@pytest.mark.parametrize("scheme", [W4G16, {"preset": "W4A16_ASYM", "weights": {"group_size": 32}}, W8_CHANNEL])
def test_autoround_lowers_each_layers_output_error_against_rtn(scheme) -> None:
    model = llama(layers=3, hidden=64, heads=4, kv_heads=2)
    args = resolve_scheme(scheme, ["Linear"]).weights
    ids = torch.randint(0, 128, (8, 24), generator=torch.Generator().manual_seed(5))
    batches = [{"input_ids": chunk} for chunk in ids.split(4)]
    with torch.no_grad():
        inputs = capture_layer_inputs(model, model.model.layers[0], batches)
    for index, layer in enumerate(model.model.layers):
        with torch.no_grad():
            targets = [first_output(layer(*a, **kw)) for a, kw in inputs]
        linears = {name: layer.get_submodule(name) for name in LINEARS}
        quantized, errors = signround_layer(layer, linears, inputs, targets, args=args, iters=40, batch_size=4)
        rtn = _output_mse(layer, {n: rtn_quantize(m.weight, args).weight for n, m in linears.items()}, inputs, targets)
        own_rtn = _output_mse(layer, {n: _full_range_rtn(m.weight, args) for n, m in linears.items()}, inputs, targets)
        tuned = _output_mse(layer, {n: q.weight for n, q in quantized.items()}, inputs, targets)
        assert tuned < rtn and tuned < own_rtn, (index, tuned, rtn, own_rtn)
        assert errors.kept == "autoround"
        assert errors.rtn == pytest.approx(own_rtn, rel=1e-4) and errors.tuned == pytest.approx(tuned, rel=1e-4)
        for name, q in quantized.items():  # on the grid its scale / zero point define: the packer finds the same
            w = linears[name].weight
            assert q.scale.shape == q.zero_point.shape
            assert torch.equal(fake_quantize(q.weight, q.scale, q.zero_point, args), q.weight)
            assert not torch.equal(q.weight, rtn_quantize(w, args).weight)  # the rounding did change
        with torch.no_grad():
            inputs = [((t, *a[1:]), kw) for t, (a, kw) in zip(targets, inputs, strict=True)]


def test_autoround_keeps_round_to_nearest_when_tuning_does_not_help() -> None:
    model = llama(layers=1, hidden=64, heads=4, kv_heads=2)
    layer = model.model.layers[0]
    args = resolve_scheme(W4G16, ["Linear"]).weights
    batches = [{"input_ids": torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))}]
    with torch.no_grad():
        inputs = capture_layer_inputs(model, layer, batches)
        targets = [first_output(layer(*a, **kw)) for a, kw in inputs]
    linears = {name: layer.get_submodule(name) for name in LINEARS}
    # a step so large that every offset jumps to the end of its range: worse than round-to-nearest
    quantized, errors = signround_layer(layer, linears, inputs, targets, args=args, iters=1, lr=10.0, batch_size=4)
    assert errors.kept == "rtn" and errors.tuned >= errors.rtn
    for name, q in quantized.items():  # round-to-nearest on AutoRound's own (whole-range) grid
        assert torch.equal(q.weight, _full_range_rtn(linears[name].weight, args))


def test_the_symmetric_grid_puts_the_larger_side_on_minus_two_to_the_bits_minus_one() -> None:
    """auto-round's int_sym, by hand: group [-1.0, 0.5, 0.25, 0.0] has the larger magnitude below zero, so its
    scale is 1/8 and -1.0 is code -8; group [2.0, -0.5, 1.0, 0.3] has it above, so the scale is -2/8 and 2.0 is
    code -8 too; clipping factors scale the side they clip (alpha: the maximum)."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmc_fsm_quantization.autoround import _Tuned

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=4)
    w = torch.tensor([[-1.0, 0.5, 0.25, 0.0, 2.0, -0.5, 1.0, 0.3]])
    tuned = _Tuned(w, args)
    scale, zero_point = tuned.qparams(final=True)
    assert scale.tolist() == [[0.125, -0.25]] and zero_point.tolist() == [[0, 0]]
    assert tuned.quantized(final=True).tolist() == [[-1.0, 0.5, 0.25, 0.0, 2.0, -0.5, 1.0, 0.25]]
    codes = torch.round(w.reshape(2, 4) / scale.reshape(2, 1))
    assert codes.tolist() == [[-8.0, 4.0, 2.0, 0.0], [-8.0, 2.0, -4.0, -1.0]]
    with torch.no_grad():
        tuned.alpha.fill_(0.75)  # the maximum clipped to 1.5 in group 2; group 1's maximum 0.5 < 1.0 stays below
    assert tuned.qparams(final=True)[0].tolist() == [[0.125, -0.1875]]


def test_each_layer_is_tuned_toward_the_float_models_own_output(monkeypatch) -> None:
    """The target of layer k is the float model's hidden states after layer k (its own forward), not the float
    layer on the inputs the quantized layers before it produce; those inputs are what the layer is tuned on."""
    import llmc_fsm_quantization.autoround as autoround

    model = llama(layers=3, hidden=64, heads=4, kv_heads=2)
    data = torch.randint(0, 128, (8, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        hidden = model(data, output_hidden_states=True).hidden_states  # [input of layer 0, ..., after the norm]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = autoround.signround_layer

    def spy(layer, targets, inputs, outputs, **kwargs):
        seen.append((torch.cat([a[0] for a, _ in inputs]), torch.cat(outputs)))
        return real(layer, targets, inputs, outputs, **kwargs)

    monkeypatch.setattr(autoround, "signround_layer", spy)
    recipe = {"q": {"AutoRoundModifier": {"scheme": W4G16, "iters": 4, "batch_size": 4}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=4, progress=False)
    assert len(seen) == 3
    for k, (inputs, targets) in enumerate(seen[:2]):  # the last layer's output is normed in hidden_states
        torch.testing.assert_close(targets, hidden[k + 1], rtol=1e-5, atol=1e-5)
    assert torch.equal(seen[0][0], hidden[0])
    for k, (inputs, _) in enumerate(seen[1:], start=1):  # through quantized layers: not the float model's
        assert not torch.allclose(inputs, hidden[k], rtol=1e-3, atol=1e-3)


def test_past_the_first_layer_the_calibration_pass_stops_at_the_layers_input(monkeypatch) -> None:
    """Past the first layer AutoRound needs only the layer's inputs (its target is the carried float output): the
    pipeline's calibration pass stops at the layer's input, so when layer k >= 1 is tuned only the float model's
    forwards of its batches (its targets) have run it; layer 0 ran whole (the recorded call order on one batch, then
    both calibration batches, whose outputs are its targets). The weights equal those of a run whose calibration passes run whole."""
    import llmc_fsm_quantization.autoround as autoround

    def run(early_exit: bool) -> tuple[dict[int, int], dict[str, torch.Tensor]]:
        model = llama(layers=3, hidden=64, heads=4, kv_heads=2)
        calls: dict[int, int] = {}
        for i, layer in enumerate(model.model.layers):  # counted without a hook (a hook changes what may stop)

            def counted(self, *args, _i=i, **kwargs):
                calls[_i] = calls.get(_i, 0) + 1
                return torch.nn.Linear.forward(self, *args, **kwargs)

            layer.mlp.down_proj.forward = types.MethodType(counted, layer.mlp.down_proj)
        at_tuning: dict[int, int] = {}
        real = autoround.signround_layer

        def spy(layer, targets, inputs, outputs, **kwargs):
            index = next(i for i, m in enumerate(model.model.layers) if m is layer)
            at_tuning[index] = calls.get(index, 0)
            return real(layer, targets, inputs, outputs, **kwargs)

        monkeypatch.setattr(autoround, "signround_layer", spy)
        if not early_exit:  # whole calibration passes, as before the layers' output hooks were removed
            monkeypatch.setattr("llmc_fsm.pipeline.layer.early_exit_module", lambda layer, order: None)
        recipe = {"q": {"AutoRoundModifier": {"scheme": W4G16, "iters": 3, "batch_size": 4}}}
        data = torch.randint(0, 128, (8, 24), generator=torch.Generator().manual_seed(6))
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=4, progress=False)
        monkeypatch.undo()
        return at_tuning, {n: p.detach().clone() for n, p in model.named_parameters()}

    at_tuning, weights = run(early_exit=True)
    assert at_tuning == {0: 1 + 2, 1: 2, 2: 2}  # layer k >= 1: only the float model's forwards of its 2 batches
    whole, whole_weights = run(early_exit=False)
    assert whole == {0: 1 + 2, 1: 2 + 2, 2: 2 + 2}
    for name, value in weights.items():
        assert torch.equal(value, whole_weights[name]), name


def test_autoround_one_shot_saves_and_reloads_with_equal_logits(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model = llama(layers=2, hidden=64, heads=4, kv_heads=2)
    recipe = {"q": {"AutoRoundModifier": {"scheme": W4G16, "iters": 20, "batch_size": 4}}}
    out = tmp_path / "out"
    data = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(2))
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=out, progress=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized"
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)
    report = json.loads((out / "report.json").read_text())["sparsity"]["modules"]
    quantized = {m["name"]: m for m in report if m.get("bits") is not None}
    assert sorted(quantized) == sorted(f"model.layers.{i}.{n}" for i in range(2) for n in LINEARS)
    assert {m["bits"] for m in quantized.values()} == {4} and {m["group_size"] for m in quantized.values()} == {16}


def test_several_processes_are_refused_before_any_work(tmp_path, monkeypatch) -> None:
    """Under torch.distributed AutoRound was refused at calibration start, after the load and the data's
    preparation (found by a tester); one-shot's model checks refuse it now, nothing written (``is_distributed``
    stands in for torchrun here: the refusal is AutoRound's own, whatever the ranks)."""
    import llmc_fsm_quantization.autoround as autoround

    monkeypatch.setattr(autoround, "is_distributed", lambda: True)
    model = llama(layers=2, hidden=64, heads=4, kv_heads=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = []
    monkeypatch.setattr(AutoRoundModifier, "on_initialize", lambda self, state: calls.append("on_initialize"))
    recipe = {"q": {"AutoRoundModifier": {"scheme": W4G16, "iters": 2}}}
    data = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=tmp_path / "out", progress=False)
    assert str(info.value) == autoround.ONE_PROCESS
    assert calls == [] and not (tmp_path / "out").exists()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_autoround_tunes_each_fused_expert_matrix_on_the_layers_output_error() -> None:
    """Fused experts (transformers 5's Qwen3MoeExperts): each expert matrix is a target beside the attention's
    Linears, tuned on the decoder layer's output; the layer's output error with the tuned weights, measured here
    on a copy of the layer whose fused parameters take them through its own views, is below round-to-nearest's on
    AutoRound's grid and equals the one :func:`signround_layer` reports; every tuned matrix is on its grid and some
    differ from round-to-nearest."""
    from llmc_fsm.toolkit import clear_weight_views, weight_views
    from tiny_families import build

    model = build("qwen3_moe")
    layer = model.model.layers[0]
    args = resolve_scheme(W4G16, ["Linear"]).weights
    ids = torch.randint(3, 128, (8, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        inputs = capture_layer_inputs(model, layer, [{"input_ids": chunk} for chunk in ids.split(4)])
        targets = [first_output(layer(*a, **kw)) for a, kw in inputs]
    views = {f"mlp.experts.{s}": v for s, v in weight_views(layer.mlp.experts).items()}
    linears = {f"self_attn.{p}": layer.get_submodule(f"self_attn.{p}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    originals = {n: m.weight.detach().clone() for n, m in {**linears, **views}.items()}
    quantized, errors = signround_layer(layer, {**linears, **views}, inputs, targets, args=args, iters=30, batch_size=4)
    assert all(torch.equal(m.weight, originals[n]) for n, m in {**linears, **views}.items())  # layer not modified

    def output_mse(weights: dict[str, torch.Tensor]) -> float:
        copied = copy.deepcopy(layer)
        clear_weight_views(copied.mlp.experts)
        own = weight_views(copied.mlp.experts)
        with torch.no_grad():
            for name, w in weights.items():
                target = own[name.removeprefix("mlp.experts.")] if name.startswith("mlp.experts.") else None
                (target or copied.get_submodule(name)).weight.copy_(w)
            se = sum(
                float((first_output(copied(*a, **kw)).double() - t.double()).pow(2).sum())
                for (a, kw), t in zip(inputs, targets, strict=True)
            )
        return se / sum(t.numel() for t in targets)

    rtn = output_mse({n: _full_range_rtn(w, args) for n, w in originals.items()})
    tuned = output_mse({n: q.weight for n, q in quantized.items()})
    assert sorted(quantized) == sorted([*linears, *views]) and len(views) == 12  # 4 experts x gate, up, down
    assert tuned < rtn and errors.kept == "autoround"
    assert errors.rtn == pytest.approx(rtn, rel=1e-4) and errors.tuned == pytest.approx(tuned, rel=1e-4)
    for name in views:
        q = quantized[name]
        assert torch.equal(fake_quantize(q.weight, q.scale, q.zero_point, args), q.weight), name
    assert any(not torch.equal(quantized[n].weight, _full_range_rtn(originals[n], args)) for n in views)


def test_autoround_one_shot_on_fused_experts_saves_per_expert_and_reloads(tmp_path) -> None:
    """llm-compressor's examples/autoround/ddp/ddp_qwen3_moe_example.py form (W4A16, router ignored) on a tiny
    Qwen3-MoE: every expert matrix quantized (4 bits, group 16, in the report), saved packed per expert, reloaded by
    transformers with no missing or unexpected key and the in-memory logits."""
    from transformers import AutoModelForCausalLM

    from tiny_families import build

    model = build("qwen3_moe")
    recipe = {"q": {"AutoRoundModifier": {"scheme": W4G16, "iters": 10, "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    out = tmp_path / "out"
    data = torch.randint(3, 128, (8, 16), generator=torch.Generator().manual_seed(2))
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=out, progress=False)
    report = json.loads((out / "report.json").read_text())["sparsity"]["modules"]
    experts = {m["name"]: m for m in report if ".mlp.experts." in m["name"]}
    assert len(experts) == 4 * 4 * 3 and {(m["bits"], m["group_size"]) for m in experts.values()} == {(4, 16)}
    reloaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(data[:2]).logits, model(data[:2]).logits)
        assert torch.equal(reloaded.model.layers[2].mlp.experts.gate_up_proj, model.model.layers[2].mlp.experts.gate_up_proj)


def test_the_report_holds_each_layers_tuning_errors_in_report_json_and_one_line(tmp_path, capsys) -> None:
    """report.json's ``tuning`` is the modifier's ``layer_errors``, every layer, exactly; the table sums it up in one
    line (median and range of the kept weights' output MSE over round-to-nearest's, the layers that kept
    round-to-nearest), which ``llmc-fsm report`` re-prints from report.json."""
    from llmc_fsm.cli import main
    from llmc_fsm.report.build import OneshotReport

    model = llama(layers=3, hidden=64, heads=4, kv_heads=2)
    # a large step (lr 0.5): on this model and data layers 0 and 1 keep round-to-nearest, layer 2 the tuning
    modifier = AutoRoundModifier(scheme=W4G16, iters=10, lr=0.5, batch_size=4)
    data = torch.randint(0, 128, (8, 24), generator=torch.Generator().manual_seed(6))
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, recipe=[modifier], dataset=data, batch_size=4, output_dir=out, progress=False)
    errors = modifier.layer_errors
    assert list(errors) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert [e.kept for e in errors.values()] == ["rtn", "rtn", "autoround"]
    saved = json.loads((out / "report.json").read_text())
    (label,) = saved["tuning"]
    assert label.startswith("AutoRoundModifier")
    assert saved["tuning"] == {
        label: {name: {"rtn_mse": e.rtn, "tuned_mse": e.tuned, "kept": e.kept} for name, e in errors.items()}
    }
    assert model.llmc_fsm_report.to_dict()["tuning"] == saved["tuning"]
    ratio = errors["model.layers.2"].tuned / errors["model.layers.2"].rtn
    assert ratio < 1.0
    line = (
        f"{label}: 3 layers tuned; the tuning kept on 1: model.layers.2; round-to-nearest on the other 2 (tuning did "
        f"not lower their output error); output MSE vs round-to-nearest: median ratio 1.000 ({ratio:.3f}-1.000)"
    )
    table = model.llmc_fsm_report.format_table()
    assert [x for x in table.splitlines() if x.startswith("AutoRoundModifier")] == [line]
    restored = OneshotReport.from_dict(saved)
    assert restored.tuning == saved["tuning"] and restored.to_dict()["tuning"] == saved["tuning"]
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [x for x in printed if x.startswith("AutoRoundModifier")] == [line]
    with pytest.raises(ValueError) as info:  # progress saved for another layer
        modifier.restore_progress_state(model.model.layers[1], modifier.progress_state(model.model.layers[0]))
    assert str(info.value) == (
        "AutoRoundModifier: saved progress names model.layers.0, not this decoder layer (model.layers.1)"
    )


def test_the_tuning_line_when_no_layer_kept_the_tuning() -> None:
    """A newcomer read "the tuning kept on 0, round-to-nearest on 2" oddly: it now says round-to-nearest was kept on
    every layer."""
    from llmc_fsm.report.build import _tuning_line

    rtn = {"rtn_mse": 2.0, "tuned_mse": 2.0, "kept": "rtn"}
    line = _tuning_line("AutoRoundModifier (q)", {"model.layers.0": rtn, "model.layers.1": rtn})
    assert line == (
        "AutoRoundModifier (q): 2 layers tuned; round-to-nearest kept on every layer (tuning did not lower their "
        "output error): model.layers.{0..1}; output MSE vs round-to-nearest: median ratio 1.000 (1.000-1.000)"
    )


def test_the_tuning_line_names_the_smaller_side_and_says_when_nothing_was_tuned() -> None:
    """A newcomer read 29 layer names for the one layer whose tuning was kept, and "30 layers tuned; round-to-nearest
    kept on every layer (tuning did not lower their output error)" for iters: 0, where nothing is tuned."""
    from llmc_fsm.report.build import _tuning_line

    rtn = {"rtn_mse": 2.0, "tuned_mse": 2.0, "kept": "rtn"}
    tuned = {"rtn_mse": 2.0, "tuned_mse": 1.0, "kept": "autoround"}
    results = {f"model.layers.{i}": (tuned if i == 2 else rtn) for i in range(4)}
    assert _tuning_line("AutoRoundModifier (q)", results) == (
        "AutoRoundModifier (q): 4 layers tuned; the tuning kept on 1: model.layers.2; round-to-nearest on the other 3 "
        "(tuning did not lower their output error); output MSE vs round-to-nearest: median ratio 1.000 (0.500-1.000)"
    )
    mode = {f"model.layers.{i}": {"rtn_mse": float(i + 1), "tuned_mse": float(i + 1), "kept": "rtn_mode"} for i in range(3)}
    assert _tuning_line("AutoRoundModifier (q)", mode) == (
        "AutoRoundModifier (q): 3 layers rounded to nearest (iters: 0, no tuning); output MSE vs the float model's "
        "output of each layer: median 2 (1-3)"
    )


def test_iters_zero_reports_round_to_nearest_mode_and_no_hessian_warning(caplog) -> None:
    """iters: 0 records each layer as "rtn_mode"; AutoRound keeps no Hessian (static input scales keep the inputs'
    ranges only), so no "Hessians are rank-deficient" warning is given for few calibration tokens."""
    model = llama(layers=2, hidden=64, heads=4, kv_heads=2)
    recipe = {"q": {"AutoRoundModifier": {"scheme": "FP8", "iters": 0}}}
    data = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))  # 16 tokens < 128 inputs
    with caplog.at_level("WARNING"):
        returned = llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, progress=False)
    assert not [r for r in caplog.records if "rank-deficient" in r.getMessage()]
    tuning = returned.llmc_fsm_report.tuning["AutoRoundModifier (q)"]
    assert {r["kept"] for r in tuning.values()} == {"rtn_mode"} and len(tuning) == 2


def test_llmcompressor_recipe_with_config_groups_is_read() -> None:
    text = (
        "quant_stage:\n  quant_modifiers:\n    AutoRoundModifier:\n      iters: 10\n      ignore: [lm_head]\n"
        "      config_groups:\n        group_0:\n          targets: [Linear]\n          input_activations: null\n"
        "          output_activations: null\n          weights: {num_bits: 4, type: int, symmetric: true, "
        "strategy: group, group_size: 32}\n"
    )
    (modifier,) = [m for stage in resolve_recipe(text).stages for m in stage.modifiers]
    assert isinstance(modifier, AutoRoundModifier)
    assert (modifier.iters, modifier.lr, modifier.batch_size) == (10, None, 8)
    assert modifier.weight_args.group_size == 32 and modifier.weight_args.num_bits == 4


def test_defaults_are_llmcompressors() -> None:
    modifier = AutoRoundModifier()
    assert (modifier.iters, modifier.lr, modifier.batch_size, modifier.enable_torch_compile) == (200, None, 8, True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"observer": "mse"},
            "AutoRoundModifier tunes the weight range itself: observer must be minmax (or its equivalents for "
            "weights, static_minmax and memoryless_minmax), got 'mse'",
        ),
        ({"batch_size": 0}, "batch_size must be a positive int, got 0"),
        ({"lr": -0.1}, "lr must be a finite positive number or null (1 / iters), got -0.1"),
        ({"lr": 10**400}, "lr must be a finite positive number or null (1 / iters), got inf"),  # (a tester's case)
        (
            {"device_ids": ["0", "1"]},
            "device_ids must be a device string such as '0,1' (llm-compressor's device map) or null, got ['0', '1']",
        ),
    ],
)
def test_unsupported_arguments_are_refused_when_the_recipe_is_read(args: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        AutoRoundModifier(**args)
    assert str(info.value) == message


@pytest.mark.parametrize("iters", [5, 0], ids=["tuned", "optimized-rtn"])
def test_low_memory_run_equals_the_in_memory_run(tmp_path, iters) -> None:
    from tiny_llama import build, calibration_text
    from transformers import AutoModelForCausalLM

    directory = build(tmp_path / "model", calibration_text())
    recipe = {"q": {"AutoRoundModifier": {"scheme": W4G16, "iters": iters, "batch_size": 4}}}
    data = torch.randint(0, 100, (8, 32), generator=torch.Generator().manual_seed(4))
    out = tmp_path / "out"
    llmc_fsm.oneshot(str(directory), recipe=recipe, dataset=data, low_memory=True, output_dir=out, progress=False)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, progress=False)
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(5))
    streamed = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(streamed(x).logits, model(x).logits)


def test_device_ids_is_accepted_with_a_warning_that_it_is_not_used(caplog) -> None:
    """llm-compressor's examples/autoround/quantization_wNa16/qwen3_example.py gives device_ids '0,1,2,3'."""
    with caplog.at_level("WARNING", logger="llmc_fsm_quantization.autoround"):
        modifier = AutoRoundModifier(device_ids="0,1,2,3")
    assert modifier.device_ids == "0,1,2,3"
    assert [r.getMessage() for r in caplog.records] == [
        "AutoRoundModifier: device_ids '0,1,2,3' is not used: each decoder layer is tuned on the device it is on (the "
        "result is the same; only llm-compressor's spreading of a layer over several GPUs is not done)"
    ]


def test_fused_with_gptq_its_own_forwards_are_not_taken_for_gptqs_hessians(monkeypatch) -> None:
    """AutoRound on the attention and GPTQ on the MLP in one pass (fused stages): AutoRound's tuning forwards of the
    layer (with candidate weights) and of the float layer must not reach GPTQ's hooks (``own_forwards``): each of
    GPTQ's Hessians sums exactly the 8 x 32 calibration tokens (before the fix: 1280 on layer 1)."""
    import collections

    from llmc_fsm.toolkit import HessianAccumulator

    rows: collections.Counter = collections.Counter()
    alive: list = []  # each accumulator kept, so that a freed one's id is not reused by the next (a flaky count)
    add_batch = HessianAccumulator.add_batch

    def counting(self, x, *args, **kwargs):
        if id(self) not in rows:
            alive.append(self)
        rows[id(self)] += x.reshape(-1, x.shape[-1]).shape[0]
        return add_batch(self, x, *args, **kwargs)

    monkeypatch.setattr(HessianAccumulator, "add_batch", counting)
    scheme = {"preset": "W4A16", "weights": {"group_size": 32}}
    recipe = {
        "a": {"AutoRoundModifier": {"scheme": scheme, "iters": 2, "targets": [r"re:.*self_attn.*_proj$"]}},
        "b": {"GPTQModifier": {"scheme": scheme, "targets": [r"re:.*mlp.*_proj$"]}},
    }
    torch.manual_seed(0)
    model = llama(layers=2, hidden=64, heads=4, kv_heads=2)
    data = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
    returned = llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=2, fuse_stages=True, progress=False)
    assert sorted(rows.values()) == [256] * 4  # per layer: gate/up (one input), down
    assert list(returned.llmc_fsm_report.tuning["AutoRoundModifier (a)"]) == ["model.layers.0", "model.layers.1"]
