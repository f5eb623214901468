"""AutoRoundModifier on float grids (FP8, FP8 block, NVFP4, MX), with quantized inputs, several config groups, and
auto-round's ``iters: 0`` round-to-nearest mode."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from llmc_fsm_quantization import resolve_scheme, rtn_quantize
from llmc_fsm_quantization.autoround import AutoRoundModifier, input_quantizer, signround_layer

import llmc_fsm
from llmc_fsm.pipeline.forward import capture_layer_inputs, first_output

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from tiny_llama import LINEARS, llama

FP8_CHANNEL = {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}
FP8_BLOCK_16 = {"preset": "FP8_BLOCK", "weights": {"block_structure": [16, 16]}, "input_activations": {"group_size": 16}}
FP4_VALUES = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 3-layer tiny Llama saved once: loaded in bfloat16 for NVFP4 / MX (their checkpoints decompress to
    bfloat16), so that the in-memory and the reloaded model compute in one dtype."""
    path = tmp_path_factory.mktemp("tiny") / "model"
    llama(layers=3, hidden=64, heads=4, kv_heads=2).save_pretrained(path)
    return path


def _load(path, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _layers_with_inputs(model):
    """Each decoder layer with its float inputs and outputs, on 8 x 24 random tokens in batches of 4."""
    ids = torch.randint(0, 128, (8, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        inputs = capture_layer_inputs(model, model.model.layers[0], [{"input_ids": c} for c in ids.split(4)])
    for layer in model.model.layers:
        with torch.no_grad():
            targets = [first_output(layer(*a, **kw)) for a, kw in inputs]
        yield layer, inputs, targets
        inputs = [((t, *a[1:]), kw) for t, (a, kw) in zip(targets, inputs, strict=True)]


def _output_mse(layer, weights: dict, inputs, targets, quantize_input=None) -> float:
    """Mean squared error (float64) of a copy of ``layer`` holding ``weights`` against ``targets``; every Linear's
    input passed through ``quantize_input`` when given."""
    layer = copy.deepcopy(layer)
    handles = []
    with torch.no_grad():
        for name, w in weights.items():
            module = layer.get_submodule(name)
            module.weight.copy_(w)
            if quantize_input is not None:
                handles.append(module.register_forward_pre_hook(lambda m, a: (quantize_input(a[0]), *a[1:])))
        se = sum(
            float((first_output(layer(*a, **kw)).double() - t.double()).pow(2).sum())
            for (a, kw), t in zip(inputs, targets, strict=True)
        )
    return se / sum(t.numel() for t in targets)


def _per_token_fp8(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 per token by hand: scale ``max|x| / 448`` per row (in x's dtype), values cast to float8 and back."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 448.0
    return ((x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * scale).to(x.dtype)


@pytest.mark.parametrize(
    ("scheme", "dtype"),
    [
        (FP8_CHANNEL, torch.float32),
        (FP8_BLOCK_16, torch.float32),
        ("NVFP4A16", torch.bfloat16),
        ("MXFP4A16", torch.bfloat16),
    ],
    ids=["fp8-channel", "fp8-block", "nvfp4a16", "mxfp4a16"],
)
def test_float_grids_lower_each_layers_output_error_and_stay_on_the_format_grid(model_dir, scheme, dtype) -> None:
    """Tuned weights (100 steps) give each layer a lower output error than round-to-nearest with compressed-tensors'
    scales (which is what V = 0, alpha = beta = 1 gives, bitwise); the error reported equals the one measured on a
    copy of the layer holding the returned weights; every weight is on the grid its returned scales define."""
    resolved = resolve_scheme(scheme, ["Linear"])
    args = resolved.weights
    for layer, inputs, targets in _layers_with_inputs(_load(model_dir, dtype)):
        linears = {name: layer.get_submodule(name) for name in LINEARS}
        schemes = {name: resolved for name in linears}
        quantized, errors = signround_layer(
            layer, linears, inputs, targets, args=args, iters=100, batch_size=4, schemes=schemes
        )
        rtn = {n: rtn_quantize(m.weight, args).weight for n, m in linears.items()}
        zero_steps, _ = signround_layer(layer, linears, inputs, targets, args=args, iters=0, schemes=schemes)
        for name, q in zero_steps.items():
            assert torch.equal(q.weight, rtn[name]), name
        assert errors.rtn == pytest.approx(_output_mse(layer, rtn, inputs, targets), rel=1e-6)
        tuned = _output_mse(layer, {n: q.weight for n, q in quantized.items()}, inputs, targets)
        assert errors.kept == "autoround" and tuned < errors.rtn
        assert errors.tuned == pytest.approx(tuned, rel=1e-6)
        for name, q in quantized.items():
            again = fake_quantize(q.weight.float(), q.scale, q.zero_point, args, global_scale=q.global_scale)
            assert torch.equal(again.to(q.weight.dtype), q.weight), name
            assert not torch.equal(q.weight, rtn[name]), name


def test_fp4_codes_and_nvfp4_global_scale_by_hand(model_dir) -> None:
    """NVFP4: the global scale is 448 * 6 / max|W| (bfloat16 quotient), each group's scale is FP8 and every code
    ``W_hat * global / scale`` is one of the 15 FP4 E2M1 values."""
    model = _load(model_dir)
    layer, inputs, targets = next(_layers_with_inputs(model))
    resolved = resolve_scheme("NVFP4A16", ["Linear"])
    linears = {"mlp.down_proj": layer.mlp.down_proj}
    quantized, _ = signround_layer(layer, linears, inputs, targets, args=resolved.weights, iters=20, batch_size=4)
    q = quantized["mlp.down_proj"]
    w = layer.mlp.down_proj.weight.detach()
    reciprocal = torch.tensor(1.0 / float(w.abs().max()), dtype=torch.float64).bfloat16().double()
    assert float(q.global_scale) == float((448.0 * 6.0 * reciprocal).bfloat16())
    assert torch.equal(q.scale.to(torch.float8_e4m3fn).float(), q.scale)
    # the codes up to the bfloat16 rounding of the dequantized weight (q * scale / global, 8 significant bits)
    codes = (q.weight.float().reshape(w.shape[0], -1, 16) * q.global_scale / q.scale.unsqueeze(-1)).abs().flatten()
    grid = torch.tensor(sorted(FP4_VALUES))
    nearest = grid[(codes.unsqueeze(1) - grid).abs().argmin(dim=1)]
    assert torch.all((codes - nearest).abs() <= nearest * 2**-8), (codes - nearest).abs().max()


def test_dynamic_inputs_are_quantized_while_tuning_as_the_quantized_model_quantizes_them(model_dir) -> None:
    """FP8_DYNAMIC: the round-to-nearest error reported is the layer's error with every Linear's input quantized
    per token to FP8 (by hand here), not the one with float inputs."""
    model = _load(model_dir, torch.float32)
    layer, inputs, targets = next(_layers_with_inputs(model))
    resolved = resolve_scheme("FP8_DYNAMIC", ["Linear"])
    linears = {name: layer.get_submodule(name) for name in LINEARS}
    quantizers = {name: input_quantizer(resolved.input_activations) for name in linears}
    _, errors = signround_layer(
        layer, linears, inputs, targets, args=resolved.weights, iters=0, input_quantizers=quantizers
    )
    rtn = {n: rtn_quantize(m.weight, resolved.weights).weight for n, m in linears.items()}
    with_inputs = _output_mse(layer, rtn, inputs, targets, quantize_input=_per_token_fp8)
    assert errors.rtn == pytest.approx(with_inputs, rel=1e-6)
    assert errors.rtn != pytest.approx(_output_mse(layer, rtn, inputs, targets), rel=1e-3)


def _oneshot_reload(model, recipe: dict, out) -> dict:
    data = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(2))
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=out, progress=False)
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    reloaded = _load(out, model.dtype)
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)
    return json.loads((out / "report.json").read_text())


@pytest.mark.parametrize(
    ("scheme", "dtype", "keys"),
    [
        ("FP8_DYNAMIC", torch.float32, {"weight", "weight_scale"}),
        ("FP8", torch.float32, {"weight", "weight_scale", "input_scale"}),
        (FP8_BLOCK_16, torch.float32, {"weight", "weight_scale"}),
        ("NVFP4", torch.bfloat16, {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"}),
        ("MXFP4", torch.bfloat16, {"weight_packed", "weight_scale"}),
        ("MXFP8", torch.bfloat16, {"weight", "weight_scale"}),
    ],
    ids=["fp8-dynamic", "fp8-static", "fp8-block", "nvfp4", "mxfp4", "mxfp8"],
)
def test_one_shot_float_schemes_save_and_reload_with_equal_logits(tmp_path, model_dir, scheme, dtype, keys) -> None:
    from safetensors import safe_open

    model = _load(model_dir, dtype)
    recipe = {"q": {"AutoRoundModifier": {"scheme": scheme, "iters": 10, "batch_size": 4, "ignore": ["lm_head"]}}}
    report = _oneshot_reload(model, recipe, tmp_path / "out")
    assert set(report["tuning"]["AutoRoundModifier (q)"]) == {f"model.layers.{i}" for i in range(3)}
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        stored = {k.rsplit(".", 1)[1] for k in f.keys() if k.startswith("model.layers.0.mlp.down_proj.")}
    assert keys <= stored, stored


def test_static_input_scales_are_the_calibration_inputs_range_and_equal_round_to_nearests_on_the_first_layer(
    model_dir,
) -> None:
    """FP8 with iters: 0 is compressed-tensors' round-to-nearest: every weight equals QuantizationModifier's; the
    first layer's static input scales (observed on the same float inputs) equal its too, max|x| / 448 of the
    calibration tokens (later layers' inputs come through the quantized layers before them, as for GPTQ)."""
    data = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(2))
    ours = _load(model_dir, torch.float32)
    recipe = {"q": {"AutoRoundModifier": {"scheme": "FP8", "iters": 0, "ignore": ["lm_head"]}}}
    llmc_fsm.oneshot(model=ours, recipe=recipe, dataset=data, batch_size=1, progress=False)
    rtn = _load(model_dir, torch.float32)
    recipe = {"q": {"QuantizationModifier": {"scheme": "FP8", "ignore": ["lm_head"]}}}
    llmc_fsm.oneshot(model=rtn, recipe=recipe, dataset=data, batch_size=1, progress=False)
    for i in range(3):
        for name in LINEARS:
            a, b = ours.model.layers[i].get_submodule(name), rtn.model.layers[i].get_submodule(name)
            assert torch.equal(a.weight, b.weight) and torch.equal(a.weight_scale, b.weight_scale), (i, name)
            if i == 0:
                assert torch.equal(a.input_scale, b.input_scale), name
    static = AutoRoundModifier(scheme={"preset": "FP8", "input_activations": {"observer": "static_minmax"}}, iters=0)
    model = _load(model_dir, torch.float32)
    llmc_fsm.oneshot(model=model, recipe=[static], dataset=data, batch_size=1, progress=False)
    float_model = _load(model_dir, torch.float32)  # the first layer's inputs are the float model's
    first: dict[str, float] = {}
    for name in LINEARS:
        float_model.model.layers[0].get_submodule(name).register_forward_pre_hook(
            lambda m, a, _n=name: first.__setitem__(_n, max(first.get(_n, 0.0), float(a[0].abs().max())))
        )
    with torch.no_grad():
        float_model(data)
    for name in LINEARS:
        expected = torch.tensor(first[name], dtype=torch.float32) / 448.0
        assert torch.equal(model.model.layers[0].get_submodule(name).input_scale.reshape(()), expected), name


def test_two_config_groups_are_tuned_together_each_on_its_grid(tmp_path, model_dir) -> None:
    """llm-compressor's qwen3_example_mixed_w2a16_w4a16 (group size 32 here, for 64 inputs): W2A16 attention and
    W4A16 MLP in one AutoRoundModifier; each weight group takes at most 4 and 16 codes; the reload is equal."""
    model = _load(model_dir, torch.float32)
    groups = {
        "attention": {"targets": [r"re:.*self_attn\.(q|k|v|o)_proj$"], "preset": "W2A16", "weights": {"group_size": 32}},
        "mlp": {"targets": [r"re:.*mlp\.(gate|up|down)_proj$"], "preset": "W4A16", "weights": {"group_size": 32}},
    }
    recipe = {"q": {"AutoRoundModifier": {"config_groups": groups, "iters": 10, "batch_size": 4}}}
    report = _oneshot_reload(model, recipe, tmp_path / "out")
    bits = {m["name"].split(".", 3)[3]: m["bits"] for m in report["sparsity"]["modules"] if m.get("bits")}
    assert bits == {n: 2 if "self_attn" in n else 4 for n in LINEARS}
    for name in LINEARS:
        module = model.model.layers[1].get_submodule(name)
        codes = torch.round(module.weight.reshape(module.weight.shape[0], -1, 32) / module.weight_scale.unsqueeze(-1))
        distinct = max(len(set(row.tolist())) for row in codes.reshape(-1, 32))
        assert distinct <= (4 if "self_attn" in name else 16), name


def test_negative_iters_are_refused_when_the_recipe_is_read() -> None:
    with pytest.raises(ValueError) as info:
        AutoRoundModifier(iters=-1)
    assert str(info.value) == "iters must be an int >= 0 (0: auto-round's round-to-nearest mode), got -1"


def test_iters_zero_searches_the_ranges_only_where_auto_round_does() -> None:
    """auto-round 0.15.1's optimized round-to-nearest: symmetric integers, NVFP4 and MX; not FP8 nor asymmetric
    integers, and not with disable_opt_rtn or iters >= 1."""
    searched = {
        name: AutoRoundModifier(**args).optimized_rtn
        for name, args in {
            "W4A16": {"scheme": "W4A16", "iters": 0},
            "NVFP4A16": {"scheme": "NVFP4A16", "iters": 0},
            "MXFP4A16": {"scheme": "MXFP4A16", "iters": 0},
            "FP8": {"scheme": "FP8", "iters": 0},
            "W4A16_ASYM": {"scheme": "W4A16_ASYM", "iters": 0},
            "disabled": {"scheme": "W4A16", "iters": 0, "disable_opt_rtn": True},
            "tuned": {"scheme": "W4A16", "iters": 1},
        }.items()
    }
    assert searched == {
        "W4A16": True, "NVFP4A16": True, "MXFP4A16": True, "FP8": False, "W4A16_ASYM": False, "disabled": False,
        "tuned": False,
    }


def test_static_input_scales_on_tuned_fused_experts_are_their_routed_tokens_ranges() -> None:
    """Refused before session 25 (AutoRound observed no expert's inputs): with ``iters: 1`` every expert matrix gets
    a static FP8 input scale, and layer 0's (whose inputs are the embeddings, whatever the tuning) equal those of
    ``iters: 0`` (checked by hand there: the largest routed |input| / 448,
    ``test_fp8_static_calibrates_each_expert_s_input_scale_on_its_routed_tokens_and_saves_it``)."""
    from tiny_families import build

    from llmc_fsm.toolkit import weight_views

    data = torch.randint(3, 128, (8, 16), generator=torch.Generator().manual_seed(2))
    scales = {}
    for iters in (0, 1):
        model = build("qwen3_moe")
        args = {"scheme": "FP8", "iters": iters, "ignore": ["lm_head", "re:.*mlp.gate$"]}
        recipe = {"q": {"AutoRoundModifier": args}}
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, progress=False)
        scales[iters] = {
            f"{i}.{s}": v.quantized_params["input_scale"]
            for i, layer in enumerate(model.model.layers)
            for s, v in weight_views(layer.mlp.experts).items()
        }
    assert len(scales[1]) == 4 * 4 * 3 and all(float(v) > 0 for v in scales[1].values())
    assert all(torch.equal(scales[1][k], scales[0][k]) for k in scales[0] if k.startswith("0."))


def test_with_static_input_scales_each_layer_is_tuned_on_the_outputs_of_the_tuned_layers_before_it(model_dir) -> None:
    """Hooking the targets (for their input ranges) must not change the pipeline's order: the inputs of layer 2
    when it is calibrated are the outputs of tuned layers 0 and 1 (activation quantization off, as the pipeline
    propagates), not of layer 1's untuned weights (the grouped order compresses layer by group; the tuning does the
    whole layer at once)."""
    from llmc_fsm.pipeline.layer import activation_quantization_off

    model = _load(model_dir, torch.float32)
    data = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(2))
    seen: list[torch.Tensor] = []
    handle = model.model.layers[2].register_forward_pre_hook(
        lambda m, a, kw: seen.append((a[0] if a else kw["hidden_states"]).detach().clone()), with_kwargs=True
    )
    recipe = {"q": {"AutoRoundModifier": {"scheme": "FP8", "iters": 5, "batch_size": 4, "ignore": ["lm_head"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=4, progress=False)
    handle.remove()
    expected: list[torch.Tensor] = []
    model.model.layers[2].register_forward_pre_hook(
        lambda m, a, kw: expected.append((a[0] if a else kw["hidden_states"]).detach().clone()), with_kwargs=True
    )
    with activation_quantization_off(model.model.layers[0]), activation_quantization_off(model.model.layers[1]):
        with torch.no_grad():
            for chunk in data.split(4):
                model(chunk)
    calibration = seen[:2]  # layer 2's first calls: its calibration pass (then its float outputs and its tuning)
    assert len(expected) == 2 and all(torch.equal(a, b) for a, b in zip(calibration, expected, strict=True))
