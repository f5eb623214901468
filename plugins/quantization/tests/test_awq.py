"""AWQ: the exponent grid search against an independent float64 one, lower block errors, unchanged float model."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from llmc_fsm_quantization import AWQModifier, QuantizationModifier, rtn_quantize
from llmc_fsm_quantization.awq import awq_candidate_scales, awq_weight_mean
from llmc_fsm_quantization.mappings import default_mappings, fold_scales
from test_smoothquant import DATA, tiny

import llmc_fsm

W4G16 = {"preset": "W4A16_ASYM", "weights": {"group_size": 16}}  # asymmetric: no value on a rounding tie
N_GRID = 20


# --------------------------------------------------------------------------- the reference, float64
def _q_int4_asym_g16(w: torch.Tensor) -> torch.Tensor:
    """Asymmetric int4 in groups of 16 (range widened to hold 0): scale = (max - min) / 15, zero point
    round(-8 - min / scale), q = clamp(round(w / scale) + zero point, -8, 7), w_hat = (q - zero point) * scale.

    The scale is rounded to float32, the dtype the checkpoint stores it in."""
    g = w.reshape(-1, 16)
    lo, hi = g.amin(dim=1, keepdim=True).clamp(max=0), g.amax(dim=1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 15).float().double()
    zp = torch.clamp(torch.round(-8 - lo / scale), -8, 7)
    return ((torch.clamp(torch.round(g / scale) + zp, -8, 7) - zp) * scale).reshape(w.shape)


def _layer0_blocks(model: torch.nn.Module):
    """float64 copy of layer 0 and, per mapping, (balance names, block call, balance input, float output)."""
    layer = copy.deepcopy(model).double().model.layers[0]
    captured: dict[str, tuple] = {}

    def keep(name):
        def hook(module, args, kwargs):
            captured[name] = (args, kwargs)

        return hook

    handles = [
        layer.get_submodule(n).register_forward_pre_hook(keep(n), with_kwargs=True)
        for n in ("self_attn", "self_attn.o_proj", "mlp", "mlp.down_proj")
    ]
    with torch.no_grad():
        hidden = model.model.embed_tokens(DATA).double()
        position_ids = torch.arange(DATA.shape[1])[None]
        rotary = copy.deepcopy(model.model.rotary_emb).double()
        mask = torch.full((32, 32), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary(hidden, position_ids))
    for h in handles:
        h.remove()

    def call(name):
        args, kwargs = captured[name]
        module = layer.get_submodule(name)

        def run():
            out = module(*args, **kwargs)
            return out[0] if isinstance(out, tuple) else out

        return run

    attn_x = captured["self_attn"][1]["hidden_states"]  # the normalized hidden states
    return layer, [
        (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], call("self_attn"), attn_x),
        (["self_attn.o_proj"], call("self_attn.o_proj"), captured["self_attn.o_proj"][0][0]),
        (["mlp.gate_proj", "mlp.up_proj"], call("mlp"), captured["mlp"][0][0]),
        (["mlp.down_proj"], call("mlp.down_proj"), captured["mlp.down_proj"][0][0]),
    ]


def _reference_search(layer, names, run, x, duo: bool) -> tuple[float | None, float, float]:
    """(chosen exponent or None for no smoothing, its error, the unsmoothed error) of the paper's grid search."""
    with torch.no_grad():
        reference = run()
        weights = [layer.get_submodule(n).weight.detach().clone() for n in names]
        x_mean = x.reshape(-1, x.shape[-1]).abs().mean(dim=0)
        w_rows = []
        for w in weights:
            g = w.abs().reshape(-1, 16)
            w_rows.append((g / g.amax(dim=1, keepdim=True)).reshape(w.shape))
        w_mean = torch.cat(w_rows).mean(dim=0)

        def error(s):
            for n, w in zip(names, weights):
                layer.get_submodule(n).weight.copy_(_q_int4_asym_g16(w * s) / s)
            e = float((run() - reference).pow(2).mean())
            for n, w in zip(names, weights):
                layer.get_submodule(n).weight.copy_(w)
            return e

        unsmoothed = error(torch.ones_like(x_mean))
        best = (unsmoothed, None)
        # llm-compressor 0.14's grid after its first candidate (r = 0 without w: s = 1, scored above): duo: r = i / 18,
        # i = 0..18, with w; not duo: r = i / 19, i = 1..19
        ratios = [i / (N_GRID - 2) for i in range(N_GRID - 1)] if duo else [i / (N_GRID - 1) for i in range(1, N_GRID)]
        for r in ratios:
            s = x_mean.pow(r) / (w_mean.pow(1 - r) + 1e-4) if duo else x_mean.pow(r)
            s = s.clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            e = error(s)
            if e < best[0]:
                best = (e, r)
    return best[1], best[0], unsmoothed


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("duo", [True, False])
def test_awq_chooses_the_exponent_of_a_float64_grid_search_and_lowers_each_block_error(duo: bool) -> None:
    model = tiny()
    original = copy.deepcopy(model)
    awq = AWQModifier(duo_scaling=duo)
    llmc_fsm.oneshot(model=model, recipe=[awq, QuantizationModifier(scheme=W4G16)], dataset=DATA, progress=False)
    layer, blocks = _layer0_blocks(original)
    smooth_names = ["input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj"]
    for smooth, (names, run, x) in zip(smooth_names, blocks, strict=True):
        exponent, error, unsmoothed = _reference_search(layer, names, run, x, duo)
        result = awq.smoothing_results[f"model.layers.0.{smooth}"]
        assert result["exponent"] == exponent, smooth
        assert result["error"] == pytest.approx(error, rel=1e-5)
        assert result["error_unsmoothed"] == pytest.approx(unsmoothed, rel=1e-5)
        assert result["duo_scaling"] == (duo if exponent is not None else None)
    for name, result in awq.smoothing_results.items():  # every mapped block of every layer
        assert result["error"] <= result["error_unsmoothed"], name
    for layer_index in (0, 1):  # the outlier channels' blocks gain clearly
        for smooth in ("input_layernorm", "post_attention_layernorm"):
            result = awq.smoothing_results[f"model.layers.{layer_index}.{smooth}"]
            assert result["error"] < 0.8 * result["error_unsmoothed"]


def test_awq_folding_keeps_the_float_model_and_the_quantizer_rounds_the_smoothed_weights() -> None:
    model = tiny()
    original = copy.deepcopy(model)
    awq = AWQModifier()
    llmc_fsm.oneshot(model=model, recipe=[awq, QuantizationModifier(scheme=W4G16)], dataset=DATA, progress=False)
    assert len(awq.smoothing_scales) >= 4
    folded = copy.deepcopy(original)
    for mapping in default_mappings(folded):
        if mapping.smooth_name in awq.smoothing_scales:
            fold_scales(mapping, awq.smoothing_scales[mapping.smooth_name])
    with torch.no_grad():
        assert torch.allclose(folded(DATA).logits, original(DATA).logits, atol=3e-5, rtol=1e-5)
    args = QuantizationModifier(scheme=W4G16).weight_args
    for name, module in folded.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            assert torch.equal(model.get_submodule(name).weight, rtn_quantize(module.weight, args).weight), name
        elif name.endswith("layernorm"):
            assert torch.equal(model.get_submodule(name).weight, module.weight), name


def test_awq_with_the_scheme_on_it_equals_awq_followed_by_a_quantization_modifier(tmp_path) -> None:
    current, older = tiny(), tiny()
    recipe_current = tmp_path / "current.yaml"
    recipe_current.write_text(
        "default_stage:\n  default_modifiers:\n    AWQModifier: {ignore: [lm_head], duo_scaling: true}\n"
        "    QuantizationModifier:\n      ignore: [lm_head]\n      config_groups:\n        group_0:\n"
        "          targets: [Linear]\n          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, "
        "group_size: 16}\n"
    )
    recipe_older = tmp_path / "older.yaml"
    recipe_older.write_text(
        "quant_stage:\n  quant_modifiers:\n    AWQModifier:\n      ignore: [lm_head]\n      config_groups:\n"
        "        group_0:\n          targets: [Linear]\n          weights: {num_bits: 4, type: int, symmetric: true, "
        "strategy: group, group_size: 16}\n"
    )
    llmc_fsm.oneshot(model=current, recipe=str(recipe_current), dataset=DATA, progress=False)
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=older, recipe=str(recipe_older), dataset=DATA, progress=False, output_dir=out)
    a, b = current.state_dict(), older.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert older.model.layers[1].mlp.down_proj.weight_scale.shape == (64, 8)
    report = (out / "report.json").read_text()
    assert '"bits": 4' in report


@pytest.mark.parametrize("rotated", [False, True])
def test_awq_without_a_quantizer_fails_before_any_work_and_changes_nothing(rotated) -> None:
    """Refused by one-shot's checks, before a SpinQuant of the same stage rotates the model (it came at calibration
    start, after the rotation and untying the head: found by a tester)."""
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stage = {"SpinQuantModifier": {"rotations": ["R1", "R2"]}, "AWQModifier": {}} if rotated else {"AWQModifier": {}}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"s": stage}, dataset=DATA, progress=False)
    assert str(info.value) == (
        "AWQModifier: no modifier of this stage quantizes the balance layers of 8 mappings, e.g. "
        "model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj: AWQ "
        "chooses scales for a weight quantization; put a QuantizationModifier (or GPTQModifier) with the scheme in "
        "the same stage, give AWQModifier a scheme (e.g. scheme: W4A16), or run the stages fused (oneshot "
        "--fuse-stages, fuse_stages=True)"
    )
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_awq_arguments_are_checked_at_construction() -> None:
    with pytest.raises(ValueError, match=r"^duo_scaling must be true, false or 'both', got 'yes'$"):
        AWQModifier(duo_scaling="yes")
    with pytest.raises(ValueError, match=r"^n_grid must be a positive int \(grid points of the exponent search\), got 0$"):
        AWQModifier(n_grid=0)
    with pytest.raises(ValueError, match=r"^give scheme or config_groups, not both$"):
        AWQModifier(scheme="W4A16", config_groups={"g": {"weights": {"num_bits": 4}}})


def test_awq_duo_both_searches_both_families_on_its_grid() -> None:
    model = tiny()
    awq = AWQModifier(duo_scaling="both", n_grid=6)  # llm-compressor's grid: r in 0, 0.5, 1 (6 // 2 points)
    llmc_fsm.oneshot(model=model, recipe=[awq, QuantizationModifier(scheme=W4G16)], dataset=DATA, progress=False)
    for result in awq.smoothing_results.values():
        assert (result["exponent"], result["duo_scaling"]) in {(None, None), (0.0, True), (0.5, False), (0.5, True),
                                                               (1.0, False), (1.0, True)}  # fmt: skip


def test_the_report_holds_each_mappings_exponent_and_errors(tmp_path) -> None:
    import json

    from llmc_fsm.report.build import OneshotReport

    recipe = {"q": {"AWQModifier": {}, "QuantizationModifier": {"scheme": W4G16}}}
    llmc_fsm.oneshot(model=tiny(), recipe=recipe, dataset=DATA, progress=False, output_dir=tmp_path / "out")
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    smoothing = data["smoothing"]["AWQModifier (q)"]
    assert list(smoothing) == [f"model.layers.{i}.{n}" for i in (0, 1) for n in (
        "input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj")]
    first = smoothing["model.layers.0.input_layernorm"]
    assert first["balance_layers"] == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert set(first) == {
        "balance_layers", "exponent", "duo_scaling", "tokens", "error_unsmoothed", "error", "scale_min", "scale_max",
        "scale_mean",
    }
    assert first["tokens"] == DATA.numel()
    report = OneshotReport.from_dict(data)
    assert report.smoothing == data["smoothing"]
    kept = sum(r["exponent"] is None for r in smoothing.values())
    chosen = [r["exponent"] for r in smoothing.values() if r["exponent"] is not None]
    unsmoothed = sum(r["error_unsmoothed"] for r in smoothing.values()) / 8
    error = sum(r["error"] for r in smoothing.values()) / 8
    assert (
        f"AWQModifier (q): 8 mappings smoothed ({kept} kept unscaled, mean exponent {sum(chosen) / len(chosen):.2f}); "
        f"mean block output error, quantized: {unsmoothed:.3g} unscaled -> {error:.3g}"
    ) in report.format_table().splitlines()


def test_explain_shows_the_mappings_resolved_on_the_model(tmp_path, capsys) -> None:
    from llmc_fsm.cli import main
    from llmc_fsm.session.explain import explain

    session = llmc_fsm.Session({"q": {"AWQModifier": {}, "QuantizationModifier": {"scheme": "W4A16"}}})
    session.update_state(model=tiny(kv_heads=2))  # grouped-query attention: no v_proj -> o_proj
    lines = explain(session).splitlines()
    at = lines.index("       optional:  -")
    assert lines[at + 1 : at + 4] == [
        "       on model:  mapping input_layernorm -> q_proj, k_proj, v_proj (2x: model.layers.{0..1}.input_layernorm)",
        "                  mapping post_attention_layernorm -> gate_proj, up_proj (2x: "
        "model.layers.{0..1}.post_attention_layernorm)",
        "                  mapping up_proj -> down_proj (2x: model.layers.{0..1}.mlp.up_proj)",
    ]
    tiny().save_pretrained(tmp_path / "m")
    (tmp_path / "r.yaml").write_text("s:\n  SmoothQuantModifier: {mappings: [[['re:.*q_proj'], 're:.*ln_1$']]}\n")
    capsys.readouterr()  # save_pretrained's progress bar
    # the plan says where the recipe does not fit, then the command fails with the refusal oneshot would give
    assert main(["explain", str(tmp_path / "r.yaml"), "--model", str(tmp_path / "m")]) == 1
    refusal = (
        "SmoothQuantModifier: mapping {'smooth_layer': 're:.*ln_1$', 'balance_layers': ['re:.*q_proj']} fits no "
        "module of LlamaForCausalLM (llama): the smooth layer pattern 're:.*ln_1$' matches no module"
    )
    captured = capsys.readouterr()
    assert f"       on model:  does not fit this model: {refusal}" in captured.out.splitlines()
    assert captured.err == (
        f"llmc-fsm explain: error: oneshot would refuse this recipe on --model {tmp_path / 'm'}: {refusal}\n"
    )


def test_explain_names_the_mappings_its_stages_quantizer_leaves_dense_as_oneshot_skips_them(caplog) -> None:
    """explain listed every mapping as if smoothed; one-shot then skipped those whose balance layers the
    quantizer's ignore leaves dense (found by a tester): explain now says so, with one-shot's count."""
    from llmc_fsm.session.explain import explain

    w4_g16 = {"preset": "W4A16", "weights": {"group_size": 16}}
    recipe = {"q": {"AWQModifier": {}, "QuantizationModifier": {"scheme": w4_g16, "ignore": ["lm_head", "re:.*mlp.*"]}}}
    session = llmc_fsm.Session(recipe)
    session.update_state(model=tiny(kv_heads=2))
    lines = explain(session).splitlines()
    at = lines.index("                  mapping up_proj -> down_proj (2x: model.layers.{0..1}.mlp.up_proj)")
    assert lines[at + 1] == (
        "                  not smoothed: 4 of 6 mappings, whose balance layers no modifier of this stage quantizes "
        "(e.g. model.layers.0.post_attention_layernorm -> model.layers.0.mlp.gate_proj, model.layers.0.mlp.up_proj)")
    with caplog.at_level(logging.WARNING, logger="llmc_fsm_quantization.awq"):
        llmc_fsm.oneshot(model=tiny(kv_heads=2), recipe=recipe, dataset=DATA, progress=False)
    assert [r.getMessage()[:50] for r in caplog.records if "are not smoothed" in r.getMessage()] == [
        "AWQModifier: 4 of 6 mappings are not smoothed: no "]


def test_explain_takes_a_known_model_name_as_oneshot_does(tmp_path, capsys, monkeypatch) -> None:
    # `--model smollm2-135m` used to fail with "no config.json there"; it reads the known model's cached directory
    from llmc_fsm.cli import main

    tiny(kv_heads=2).save_pretrained(tmp_path / "cached")
    asked = []
    monkeypatch.setattr("llmc_fsm.cli.plugins.known_model_dir", lambda name: asked.append(name) or tmp_path / "cached")
    monkeypatch.chdir(tmp_path)  # no directory called smollm2-135m here
    scheme = "{preset: W4A16, weights: {group_size: 16}}"  # the preset's 128 divides no width of this model
    (tmp_path / "r.yaml").write_text(f"q:\n  AWQModifier: {{}}\n  QuantizationModifier: {{scheme: {scheme}}}\n")
    assert main(["explain", "r.yaml", "--model", "smollm2-135m"]) == 0
    assert asked == ["smollm2-135m"]
    out = capsys.readouterr().out
    assert "mapping input_layernorm -> q_proj, k_proj, v_proj (2x: model.layers.{0..1}.input_layernorm)" in out
    assert main(["explain", "r.yaml", "--model", "no-such-model"]) == 1
    assert capsys.readouterr().err == (
        "llmc-fsm explain: error: --model no-such-model: no config.json there; give a Hugging Face model directory or "
        "a known model name (smollm2-135m)\n"
    )


def test_awq_then_gptq_in_one_stage_quantizes_the_smoothed_layer_with_its_smoothed_hessian() -> None:
    from llmc_fsm_quantization import GPTQModifier, gptq_quantize

    from llmc_fsm.toolkit.obs import HessianAccumulator

    model = tiny()
    original = copy.deepcopy(model)
    awq, gptq = AWQModifier(), GPTQModifier(scheme=W4G16, block_size=16)
    llmc_fsm.oneshot(model=model, recipe=[awq, gptq], dataset=DATA, progress=False)
    s = awq.smoothing_scales["model.layers.0.input_layernorm"]
    assert awq.smoothing_results["model.layers.0.input_layernorm"]["exponent"] is not None
    x = []
    attn = original.model.layers[0].self_attn
    handle = attn.q_proj.register_forward_pre_hook(lambda m, a: x.append(a[0].detach()))
    with torch.no_grad():
        original(DATA)
    handle.remove()
    acc = HessianAccumulator(64)
    acc.add_batch((torch.cat(x).reshape(-1, 64) / s).float())  # s: float64, the fold rounds once to float32
    s_vo = awq.smoothing_scales["model.layers.0.self_attn.v_proj"][:, None]  # v_proj's rows: the v -> o mapping
    with torch.no_grad():
        expected = gptq_quantize(
            [(attn.q_proj.weight * s).float(), (attn.k_proj.weight * s).float(),
             (attn.v_proj.weight * s / s_vo).float()], acc.hessian,
            args=gptq.weight_args, block_size=16,
        )
    got = model.model.layers[0].self_attn
    for module, q in zip((got.q_proj, got.k_proj, got.v_proj), expected, strict=True):
        assert torch.allclose(module.weight, q.weight, atol=1e-5, rtol=0)


@pytest.mark.parametrize("awq", [{}, {"apply_clip": True}], ids=["smoothing", "smoothing and clipping"])
def test_awq_under_low_memory_writes_the_in_memory_checkpoint(tmp_path, awq) -> None:
    import glob

    from safetensors.torch import load_file

    tiny().save_pretrained(tmp_path / "model")
    recipe = {"q": {"AWQModifier": awq, "QuantizationModifier": {"scheme": W4G16}}}
    for out, low in (("in_memory", False), ("streamed", True)):
        llmc_fsm.oneshot(
            model=str(tmp_path / "model"), recipe=recipe, dataset=DATA, output_dir=tmp_path / out, progress=False,
            low_memory=low,
        )

    def tensors(out: str) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        for file in sorted(glob.glob(str(tmp_path / out / "*.safetensors"))):
            found.update(load_file(file))
        return found

    a, b = tensors("in_memory"), tensors("streamed")
    assert a.keys() == b.keys()
    assert "model.layers.0.input_layernorm.weight" in a
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


# --------------------------------------------------------------------------- the branch and bound
def test_the_pruned_grid_search_scores_and_chooses_as_scoring_every_candidate_in_full() -> None:
    """``_BlockError.search`` on ``up -> down`` of a random block with outlier input channels: every candidate it
    completes has the float64 reference error of ``mean((X Q(W diag(s)) diag(s)^-1)^T - X W^T)^2)`` (the reference
    quantizer written here), the lowest of them is the reference's lowest, some candidates are dropped early, and the
    weights are put back."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmc_fsm_quantization.awq import _BlockError, awq_candidate_scales
    from llmc_fsm_quantization.mappings import ResolvedMapping

    gen = torch.Generator().manual_seed(3)
    up, down = torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        down.weight.copy_(torch.randn(16, 64, generator=gen))
    x = torch.randn(4, 8, 64, generator=gen) * (1 + 30 * (torch.arange(64) % 13 == 0))  # 4 windows of 8 tokens
    batches = [x[:2], x[2:]]
    mapping = ResolvedMapping("up", up, ("down",), (down,), "down", down)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16)
    refs = [torch.nn.functional.linear(b, down.weight) for b in batches]
    evaluate = _BlockError(mapping, [(args, "minmax")], [((b,), {}) for b in batches], refs)
    assert len(evaluate.chunks) == 4  # one per window
    x_mean = x.abs().reshape(-1, 64).mean(dim=0)
    candidates = [None, *(awq_candidate_scales(x_mean, None, i / N_GRID) for i in range(N_GRID))]
    w0 = down.weight.detach().clone()
    errors = evaluate.search(candidates)
    evaluate.restore()
    assert torch.equal(down.weight, w0)

    xd, wd = x.reshape(-1, 64).double(), w0.double()
    reference = []
    for s in candidates:
        s = torch.ones(64, dtype=torch.float64) if s is None else s.double()
        w_hat = _q_int4_asym_g16((wd * s).float().double()) / s
        reference.append(float((xd @ (w_hat - wd).T).pow(2).mean()))
    completed = [i for i, e in enumerate(errors) if e is not None]
    assert 0 in completed and len(completed) < len(candidates)
    for i in completed:
        assert errors[i] == pytest.approx(reference[i], rel=1e-4)
    best = min(range(len(reference)), key=lambda i: (reference[i], i))
    second = sorted(reference)[1]
    assert second > reference[best] * 1.001  # the float32 / float64 difference cannot swap them
    assert min(completed, key=lambda i: (errors[i], i)) == best


def test_a_mapping_whose_balance_layers_are_not_quantized_is_not_smoothed_and_named(caplog) -> None:
    """As llm-compressor 0.14 (its GLM-4.7 example ignores layers 0-2 in the quantizer): the mappings of layers the
    quantizer leaves dense are skipped with a warning, the others smoothed; found by the recipe corpus."""
    import logging

    model = tiny()
    norm0 = model.model.layers[0].input_layernorm.weight.detach().clone()
    norm1 = model.model.layers[1].input_layernorm.weight.detach().clone()
    recipe = {"s": {"AWQModifier": {}, "QuantizationModifier": {
        "scheme": {"preset": "W4A16", "weights": {"group_size": 16}},
        "ignore": ["lm_head", "re:.*layers\\.0\\..*"]}}}
    with caplog.at_level(logging.WARNING):
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, progress=False)
    assert "AWQModifier: 4 of 8 mappings are not smoothed: no modifier of this stage quantizes their balance layers " \
           "(e.g. model.layers.0.input_layernorm, balance layers model.layers.0.self_attn.q_proj, " \
           "model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj)" in caplog.text
    assert torch.equal(model.model.layers[0].input_layernorm.weight, norm0)
    assert not torch.equal(model.model.layers[1].input_layernorm.weight, norm1)
    assert not hasattr(model.model.layers[0].self_attn.q_proj, "weight_scale")


@pytest.mark.parametrize(("dtype", "tokens"), [(torch.float64, 96), (torch.float32, 96), (torch.float64, 40)])
def test_the_gram_error_of_a_linear_block_equals_the_direct_forward_and_chooses_the_same_exponent(dtype, tokens):
    """``_GramError`` (``tr(dW H dW^T)``, ``H = X^T X``) on ``up -> down`` of a random block with outlier input
    channels: every candidate's error equals the direct ``mean((X Q(W diag(s)) diag(s)^-1)^T - X W^T)^2)`` computed
    here in float64 (``Q(W diag(s)) diag(s)^-1``: the search's own candidate weights; float64 model: to 1e-9,
    float32: 1e-4), the chosen exponent is the direct one's (the margin to the second best is checked to exceed that
    tolerance), and ``_BlockError`` (the block's forward, all candidates in full) chooses the same.
    40 tokens < 64 inputs: a singular ``H`` (the eigendecomposition's factor)."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmc_fsm_quantization.awq import _BlockError, _GramError, awq_candidate_scales
    from llmc_fsm_quantization.mappings import ResolvedMapping

    gen = torch.Generator().manual_seed(5)
    up, down = torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 16, bias=True)
    with torch.no_grad():
        down.weight.copy_(torch.randn(16, 64, generator=gen))
    up, down = up.to(dtype), down.to(dtype)
    x = (torch.randn(tokens, 64, generator=gen) * (1 + 30 * (torch.arange(64) % 13 == 0))).to(dtype)
    batches = [x[: tokens // 2].reshape(1, -1, 64), x[tokens // 2 :].reshape(1, -1, 64)]
    mapping = ResolvedMapping("up", up, ("down",), (down,), "down", down)
    assert _GramError.serves(mapping)
    # N in^2 + in^3 + 21 out in^2 against 21 N in out: 2031616 < 2064384 with 96 tokens, 1802240 > 860160 with 40
    assert _GramError.cheaper(mapping, [((b,), {}) for b in batches], 21) is (tokens == 96)
    assert not _GramError.serves(ResolvedMapping("n", up, ("up", "down"), (up, down), "blk", torch.nn.Sequential()))
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16)
    inputs = [((b,), {}) for b in batches]
    x_mean = x.abs().mean(dim=0).float()
    candidates = [None, *(awq_candidate_scales(x_mean, None, i / N_GRID) for i in range(N_GRID))]
    w0 = down.weight.detach().clone()
    gram = _GramError(mapping, (args, "minmax"), inputs)
    errors = gram.search(candidates)
    assert torch.equal(down.weight, w0)

    xd, wd = x.double(), w0.double()
    reference = []
    for s in candidates:  # the candidate weights the search quantizes, the error computed directly in float64
        w_hat = _BlockError._quantized(w0, (args, "minmax"), s).double()
        reference.append(float((xd @ (w_hat - wd).T).pow(2).mean()))
    rel = 1e-9 if dtype == torch.float64 else 1e-4
    assert errors == pytest.approx(reference, rel=rel)
    best = min(range(len(reference)), key=lambda i: (reference[i], i))
    assert sorted(reference)[1] > reference[best] * (1 + 10 * rel)
    assert min(range(len(errors)), key=lambda i: (errors[i], i)) == best

    refs = [down(b) for b in batches]
    direct = _BlockError(mapping, [(args, "minmax")], inputs, [r.detach() for r in refs])
    with torch.no_grad():
        full = []
        for s in candidates:
            direct._set(s)
            full.append(sum(direct._chunk(k) for k in range(len(direct.chunks))) / direct.count)
    direct.restore()
    assert full == pytest.approx(errors, rel=1e-4)  # _BlockError takes the output difference in float32
    assert min(range(len(full)), key=lambda i: (full[i], i)) == best


def test_search_n_sample_token_is_opt_in_and_scores_every_kth_window() -> None:
    """The opt-in shortcut: off by default; ``_BlockError`` with ``sample_tokens=16`` on 8 windows of 8 tokens keeps
    windows 0 and 4 (``k = 64 // 16``), and its unsmoothed error is the float64 mean over those two windows; through
    ``oneshot`` the mlp mappings' errors are over a quarter of the tokens (``DATA``: 8 windows of 32, sample 64)."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmc_fsm_quantization.awq import _BlockError
    from llmc_fsm_quantization.mappings import ResolvedMapping

    with pytest.raises(
        ValueError, match=r"^search_n_sample_token must be null \(every token\) or a positive int, got 0$"
    ):
        AWQModifier(search_n_sample_token=0)
    assert AWQModifier().search_n_sample_token is None

    gen = torch.Generator().manual_seed(7)
    up, down = torch.nn.Linear(32, 48, bias=False), torch.nn.Linear(48, 16, bias=False)
    block = torch.nn.Sequential(up, torch.nn.ReLU(), down)
    x = torch.randn(8, 8, 32, generator=gen)
    ref = block(x).detach()
    mapping = ResolvedMapping("norm", torch.nn.Identity(), ("0",), (up,), "blk", block)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16)
    evaluate = _BlockError(mapping, [(args, "minmax")], [((x,), {})], [ref], sample_tokens=16)
    assert [torch.equal(r, ref[i : i + 1]) for i, (_, _, r) in zip((0, 4), evaluate.chunks, strict=True)] == [True] * 2
    (error,) = evaluate.search([None])
    evaluate.restore()
    with torch.no_grad():
        w_hat = rtn_quantize(up.weight.detach(), args).weight.double()
        xs = x[[0, 4]].double()
        out = torch.relu(xs @ w_hat.T) @ down.weight.double().T
    assert error == pytest.approx(float((out - ref[[0, 4]].double()).pow(2).mean()), rel=1e-5)

    model = tiny()
    awq = AWQModifier(search_n_sample_token=64)
    llmc_fsm.oneshot(model=model, recipe=[awq, QuantizationModifier(scheme=W4G16)], dataset=DATA, progress=False)
    full = AWQModifier()
    llmc_fsm.oneshot(model=tiny(), recipe=[full, QuantizationModifier(scheme=W4G16)], dataset=DATA, progress=False)
    for name in ("model.layers.0.post_attention_layernorm", "model.layers.0.input_layernorm"):
        assert awq.smoothing_results[name]["error_unsmoothed"] != full.smoothing_results[name]["error_unsmoothed"]
    up_down = "model.layers.0.mlp.up_proj"  # a Linear block: every token (its Gram matrix)
    assert awq.smoothing_results[up_down]["error_unsmoothed"] == full.smoothing_results[up_down]["error_unsmoothed"]


def test_the_older_forms_quantizer_speaks_as_awq():
    """AWQ with a scheme quantizes through a QuantizationModifier of its own: its refusals named that modifier,
    which the recipe did not hold ('AWQModifier: QuantizationModifier cannot compress ...'; testers' cases)."""
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=tiny(), recipe={"q": {"AWQModifier": {"scheme": "W4A16", "ignore": ["lm_head"]}}},
                         dataset=DATA, progress=False)  # fmt: skip
    assert str(info.value).startswith("AWQModifier (quantizing with its scheme) cannot compress ")
    assert "QuantizationModifier" not in str(info.value)


# --------------------------------------------------------------------------- llm-compressor's float64 arithmetic
def _weight_mean_reference(weights: list[torch.Tensor], group: int) -> list[float]:
    """llm-compressor 0.14's w_j written out: per element |w| / (max|w| of its group + 1e-6), the quotient in float32
    (the weight's dtype), summed exactly (math.fsum) over the rows of every weight, divided by the row count."""
    sums = [[] for _ in range(weights[0].shape[1])]
    rows = 0
    for w in weights:
        for row in w.tolist():
            for start in range(0, len(row), group):
                part = [abs(v) for v in row[start : start + group]]
                peak = torch.tensor(max(part), dtype=torch.float32) + 1e-6  # float32 addition, as a float32 tensor
                for j, v in enumerate(part):
                    sums[start + j].append(float(torch.tensor(v, dtype=torch.float32) / peak))
            rows += 1
    return [math.fsum(column) / rows for column in sums]


def test_awq_weight_mean_is_llm_compressors_float64_mean_with_1e6_added_to_each_groups_maximum() -> None:
    """Found by a tester: w_j divided by the group's max|W| clamped at 1e-30 (not max + 1e-6) and was averaged in
    float32, so with symmetric int4 the candidates' last bits, and then codes and the chosen exponent, differed from
    llm-compressor 0.14's (layer 0 of a tiny Llama: exponent 0.33 vs 0.22)."""
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(3, 8, generator=g) * 1e-2, torch.randn(2, 8, generator=g)]
    weights[1][0, :4] = torch.tensor([0.0, 0.0, 0.0, 0.0])  # an all-zero group: 0 / 1e-6
    got = awq_weight_mean(weights, [4, 4])
    assert got.dtype == torch.float64
    assert got.tolist() == _weight_mean_reference(weights, 4)
    whole_rows = awq_weight_mean(weights, [None, None])  # per output channel: the whole row is the group
    assert whole_rows.tolist() == _weight_mean_reference(weights, 8)
    peak = weights[0].abs().max() + 1e-6  # the whole tensor as one group
    expected = [math.fsum(float(v) for v in (weights[0][:, j].abs() / peak).tolist()) / 3 for j in range(8)]
    assert awq_weight_mean(weights[:1], [0]).tolist() == expected
    with pytest.raises(ValueError) as err:
        awq_weight_mean([], [])
    assert str(err.value) == "awq_weight_mean needs at least one weight (a mapping has one balance layer or more)"


def test_awq_duo_candidates_are_float64_as_llm_compressors() -> None:
    """Found by a tester: the duo_scaling candidates were computed in float32; llm-compressor 0.14 divides its
    float32 x ** r by the float64 (w ** (1 - r) + 1e-4), so its scales (and the weights scaled by them before being
    rounded to float32) are float64. A non-finite candidate value is 1, as there."""
    x_mean = torch.tensor([0.5, 2.0, 3.25, 0.01], dtype=torch.float32)
    w_mean = torch.tensor([0.3, 0.7, 0.45, 0.9], dtype=torch.float64)
    for ratio in (0.0, 0.2777777777777778, 1.0):
        got = awq_candidate_scales(x_mean, w_mean, ratio)
        assert got.dtype == torch.float64
        xr = x_mean.pow(ratio).tolist()  # float32 x ** r, as llm-compressor
        raw = [max(x / (w ** (1 - ratio) + 1e-4), 1e-4) for x, w in zip(xr, w_mean.tolist(), strict=True)]
        norm = math.sqrt(max(raw) * min(raw))
        assert got.tolist() == pytest.approx([v / norm for v in raw], rel=1e-15, abs=0)
    plain = awq_candidate_scales(x_mean, None, 0.5)
    assert plain.dtype == torch.float32
    assert awq_candidate_scales(torch.tensor([float("nan"), 1.0]), None, 0.5).tolist() == [1.0, 1.0]


def test_awq_symmetric_int4_chooses_and_folds_with_the_float64_scales_of_llm_compressor() -> None:
    """Found by a tester: with symmetric int4 (a group's largest |W_ij s_j| on a rounding tie of the quantizer) and
    duo_scaling, the chosen exponent and about 10% of layer 0's codes differed from llm-compressor 0.14's: the
    candidates, their application to the weights and the final fold were float32 there, float64 in llm-compressor.

    Reference: layer 0's q/k/v search written out with llm-compressor's arithmetic (x_j float32; w_j and the
    candidates float64; W s in float64 rounded once to float32; the plugin's round-to-nearest as a black box), and
    the fold W s (float64, rounded once) quantized by it (q and k: v_proj's rows also take the v -> o scales)."""
    scheme = {"preset": "W4A16", "weights": {"group_size": 32}}  # symmetric, groups of 32 (the tester's case)
    model = tiny()
    original = copy.deepcopy(model)
    awq = AWQModifier()
    llmc_fsm.oneshot(model=model, recipe=[awq, QuantizationModifier(scheme=scheme)], dataset=DATA, progress=False)
    args = QuantizationModifier(scheme=scheme).weight_args
    attn = original.model.layers[0].self_attn
    captured = {}
    handle = attn.register_forward_pre_hook(lambda m, a, k: captured.update(a=a, k=k), with_kwargs=True)
    with torch.no_grad():
        original(DATA, use_cache=False)  # no cache: each call below attends to its own keys only
    handle.remove()
    x = captured["k"]["hidden_states"].reshape(-1, 64)  # the one calibration batch (8 windows of 32 tokens)
    x_mean = (x.abs().sum(dim=0, dtype=torch.float64) / x.shape[0]).float()
    names = ("q_proj", "k_proj", "v_proj")
    weights = [getattr(attn, n).weight.detach().clone() for n in names]
    w_mean = torch.tensor(_weight_mean_reference(weights, 32), dtype=torch.float64)
    with torch.no_grad():
        reference = attn(*captured["a"], **captured["k"])[0]

        def error(s: torch.Tensor | None) -> float:
            for n, w in zip(names, weights, strict=True):
                q = rtn_quantize(w if s is None else (w.double() * s).float(), args).weight
                getattr(attn, n).weight.copy_(q if s is None else (q.double() / s).float())
            return float((attn(*captured["a"], **captured["k"])[0] - reference).pow(2).sum(dtype=torch.float64))

        best = (error(None), None, None)
        for i in range(N_GRID - 1):
            r = i / (N_GRID - 2)
            xr = x_mean.pow(r).double()
            s = (xr / (w_mean.pow(1 - r) + 1e-4)).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            e = error(s)
            if e < best[0]:
                best = (e, r, s)
    result = awq.smoothing_results["model.layers.0.input_layernorm"]
    assert result["exponent"] == best[1]
    s = best[2]
    for n, w in zip(names[:2], weights[:2], strict=True):
        expected = rtn_quantize((w.double() * s).float(), args).weight
        assert torch.equal(getattr(model.model.layers[0].self_attn, n).weight, expected), n


@pytest.mark.parametrize("apply_clip", [False, True])
def test_awq_searches_and_clips_each_balance_layer_on_its_own_config_groups_grid(apply_clip) -> None:
    """With an int8 per-channel override group beside int4 g16, the scale search (and ``apply_clip``) took the first
    group's int4 grid for every balance layer, so the overridden q_proj / down_proj were smoothed (and clipped) for a
    quantizer they are not stored with (found by a tester; llm-compressor takes each balance layer's own scheme)."""
    int4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    awq = AWQModifier(ignore=["lm_head"], apply_clip=apply_clip)
    groups = {"int4": {"targets": ["Linear"], "weights": int4},
              "int8": {"targets": ["re:.*q_proj$", "model.layers.1.mlp.down_proj"], "weights": int8}}
    model = tiny()
    seen: dict[str, tuple] = {}
    original = awq._find_quantizers

    def recorded():
        found = original()
        names = {id(m): n for n, m in model.named_modules()}
        seen.update({names[i]: (q[0].num_bits, q[0].strategy) for i, q in found.items() if q is not None})
        return found

    awq._find_quantizers = recorded
    llmc_fsm.oneshot(model=model, recipe=[awq, QuantizationModifier(ignore=["lm_head"], config_groups=groups)],
                     dataset=DATA, progress=False)
    stored = {n: (m.quantization_scheme.weights.num_bits, m.quantization_scheme.weights.strategy)
              for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    assert seen and all(seen[n] == stored[n] for n in seen)  # each searched on the grid it is stored with
    assert seen["model.layers.1.mlp.down_proj"] == (8, "channel")
    assert seen["model.layers.0.mlp.down_proj"] == (4, "group")
    if apply_clip:
        clipped = {n: (q[0].num_bits, q[0].strategy) for n, (_, q) in awq._clip_targets.items()}
        assert clipped["model.layers.1.mlp.down_proj"] == (8, "channel")
        assert all(clipped[n] == stored[n] for n in clipped)



def test_awq_in_a_stage_after_one_quantizing_its_mlp_is_refused_with_smoothing_advice() -> None:
    """The refusal told an AWQ recipe to "prune first" (a tester's case); it now names smoothing and the fix, which
    runs: AWQ's ignore leaves the MLP, quantized by the earlier stage, out."""
    w4_g16 = {"preset": "W4A16", "weights": {"group_size": 16}}
    mlp = {"QuantizationModifier": {"targets": ["re:.*mlp.*"], "scheme": w4_g16}}
    recipe = {"mlp_stage": mlp, "attn_stage": {"AWQModifier": {},
                                               "GPTQModifier": {"targets": ["re:.*self_attn.*"], "scheme": w4_g16}}}
    model = tiny(kv_heads=2)
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, progress=False)
    assert str(info.value) == (
        "AWQModifier of stage 'attn_stage' would smooth 6 modules that QuantizationModifier of stage 'mlp_stage' "
        "quantizes before it, e.g. model.layers.0.mlp.down_proj; smoothing a quantized weight moves it off its grid: "
        "put the smoothing modifier in or before that quantizer's stage, or leave those modules out of it (its "
        "ignore, e.g. 're:.*mlp.*', or mappings naming only the others)")
    recipe["attn_stage"]["AWQModifier"] = {"ignore": ["lm_head", "re:.*mlp.*"]}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, progress=False)
    assert model.model.layers[1].mlp.down_proj.quantization_scheme.weights.group_size == 16


def test_explain_refuses_an_awq_stage_whose_quantizer_is_in_another_stage_as_oneshot_does(tmp_path, capsys) -> None:
    """AWQ in one stage, its quantizer in the next: one-shot refuses the AWQ stage before any work, while explain
    --model checked the whole recipe as one session and said its checks pass (found by a tester). Both refuse now,
    and the plan says so on AWQ's line."""
    from llmc_fsm.cli.main import main
    from llmc_fsm.session.explain import explain

    w4_g16 = {"preset": "W4A16", "weights": {"group_size": 16}}
    recipe = {"smooth": {"AWQModifier": {}}, "quantize": {"QuantizationModifier": {"scheme": w4_g16}}}
    with pytest.raises(ValueError) as oneshot_refusal:
        llmc_fsm.oneshot(model=tiny(kv_heads=2), recipe=recipe, dataset=DATA, progress=False)
    session = llmc_fsm.Session(recipe)
    session.update_state(model=tiny(kv_heads=2))
    assert f"                  refused by one-shot: {oneshot_refusal.value}" in explain(session).splitlines()
    tiny(kv_heads=2).save_pretrained(tmp_path / "m")
    (tmp_path / "r.yaml").write_text(
        "smooth:\n  AWQModifier: {}\nquantize:\n"
        "  QuantizationModifier: {scheme: {preset: W4A16, weights: {group_size: 16}}}\n")
    capsys.readouterr()
    assert main(["explain", str(tmp_path / "r.yaml"), "--model", str(tmp_path / "m")]) == 1
    assert capsys.readouterr().err == (
        f"llmc-fsm explain: error: oneshot would refuse this recipe on --model {tmp_path / 'm'}: "
        f"{oneshot_refusal.value}\n")
    # fused, one-shot runs it (AWQ finds the next stage's quantizer): explain --fuse-stages says its checks pass
    llmc_fsm.oneshot(model=tiny(kv_heads=2), recipe=recipe, dataset=DATA, progress=False, fuse_stages=True)
    assert main(["explain", str(tmp_path / "r.yaml"), "--model", str(tmp_path / "m"), "--fuse-stages"]) == 0
    assert f"oneshot's checks of --model {tmp_path / 'm'} pass" in capsys.readouterr().out
