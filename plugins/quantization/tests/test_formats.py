"""New formats through compressed-tensors' own compressors: static input scales (FP8, INT8), on a 2-layer random
Llama (hidden 64): the grid of the dequantized weights, scales against a hand computation, save -> reload with
transformers giving the in-memory model's logits exactly."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_quant_models import tiny_llama

import llmc_fsm

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def _data(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(seed))


def _first_layer_inputs(model: torch.nn.Module, data: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """q_proj's input of the first decoder layer, one tensor per calibration batch (it does not depend on the
    quantization of any layer)."""
    seen: list[torch.Tensor] = []
    q = model.model.layers[0].self_attn.q_proj
    handle = q.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    with torch.no_grad():
        for i in range(0, data.shape[0], batch_size):
            model(data[i : i + batch_size])
    handle.remove()
    return seen


def _reload_equal(model: torch.nn.Module, out) -> None:
    from transformers import AutoModelForCausalLM

    x = torch.randint(0, 128, (2, 24))
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)


STATIC_INT8 = {"preset": "W8A8", "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                      "strategy": "tensor", "dynamic": False}}


@pytest.mark.parametrize("modifier", ["QuantizationModifier", "GPTQModifier"])
@pytest.mark.parametrize(("scheme", "observer", "fmt"), [
    ("FP8", "static_minmax", "float-quantized"),
    (STATIC_INT8, "minmax", "int-quantized"),
    ({**STATIC_INT8, "input_activations": {**STATIC_INT8["input_activations"], "observer": "memoryless_minmax"}},
     "memoryless_minmax", "int-quantized"),
])
def test_static_input_scales_are_observed_on_the_calibration_inputs_and_reload(
    tmp_path, modifier, scheme, observer, fmt
) -> None:
    model = tiny_llama()
    data = _data()
    batches = _first_layer_inputs(model, data, batch_size=1)  # one observation per sample, whatever the batch size
    q = model.model.layers[0].self_attn.q_proj
    original = q.weight.detach().clone()
    out = tmp_path / "out"
    recipe = {"q": {modifier: {"scheme": scheme, "ignore": ["lm_head"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=2, output_dir=out, progress=False)
    assert q.quantization_scheme.input_activations.observer == observer
    # the hand computation, float64: each sample's min and max over all its input values
    calls = [(float(x.double().min()), float(x.double().max())) for x in batches]
    if observer == "static_minmax":
        lo, hi = min(c[0] for c in calls), max(c[1] for c in calls)
    elif observer == "memoryless_minmax":
        lo, hi = calls[-1]
    else:  # minmax: moving average, averaging constant 0.01
        lo, hi = calls[0]
        for c in calls[1:]:
            lo, hi = 0.99 * lo + 0.01 * c[0], 0.99 * hi + 0.01 * c[1]
    grid = FP8_MAX if fmt == "float-quantized" else 127.5  # symmetric int8: max|x| / ((127 - (-128)) / 2)
    expected = max(abs(min(lo, 0.0)), abs(max(hi, 0.0))) / grid
    assert float(q.input_scale) == pytest.approx(expected, rel=1e-6)
    if fmt == "float-quantized":  # FP8 weights: one scale per tensor, at most 256 fp8 values
        assert float(q.weight_scale) == pytest.approx(float(original.abs().max()) / FP8_MAX, rel=1e-6) or (
            modifier == "GPTQModifier")
        assert torch.unique(q.weight).numel() <= 256
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == fmt
    (group,) = config["config_groups"].values()
    assert group["input_activations"]["dynamic"] is False
    _reload_equal(model, out)


def _inputs_max(model: torch.nn.Module, data: torch.Tensor, *, quantization: bool) -> dict[str, float]:
    """max |x| over the calibration tokens of each decoder-layer Linear's input; ``quantization=False``: with every
    fake quantization of ``model`` off (compressed-tensors' ``quantization_enabled``)."""
    seen: dict[str, float] = {}
    handles = [
        module.register_forward_pre_hook(
            lambda m, a, name=name: seen.__setitem__(name, max(seen.get(name, 0.0), float(a[0].abs().max())))
        )
        for name, module in model.model.layers.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    for module in model.modules():
        module.quantization_enabled = quantization
    with torch.no_grad():
        model(data)
    for module in model.modules():
        del module.quantization_enabled
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("modifier", ["QuantizationModifier", "GPTQModifier"])
def test_every_static_input_scale_is_observed_on_full_precision_activations_as_llm_compressor_does(modifier) -> None:
    """llm-compressor calibrates under ``DisableQuantization``: every layer's inputs are computed without input
    quantization, on the weights as the modifiers left them so far (round-to-nearest rounds them when it saves, so
    its later layers see the original weights; GPTQ's updated weights are in place)."""
    import copy

    model, data = tiny_llama(), _data()
    original = copy.deepcopy(model)
    recipe = {"q": {modifier: {"scheme": "FP8", "ignore": ["lm_head"]}}}  # FP8: static_minmax input scales
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=2, progress=False)
    expected = _inputs_max(original if modifier == "QuantizationModifier" else model, data, quantization=False)
    assert len(expected) == 14  # 2 layers x 7 Linear
    got = {name: float(m.input_scale) for name, m in model.model.layers.named_modules() if name in expected}
    assert got == pytest.approx({name: value / FP8_MAX for name, value in expected.items()}, rel=1e-6)
    # not what the quantized model's layers receive (their inputs with input and weight quantization on)
    quantized = _inputs_max(model, data, quantization=True)
    assert got != pytest.approx({name: value / FP8_MAX for name, value in quantized.items()}, rel=1e-6)


def test_static_input_scales_need_calibration_data_even_for_round_to_nearest() -> None:
    from llmc_fsm_quantization import QuantizationModifier

    assert "calibration_data" in QuantizationModifier(scheme="FP8").required_keys()
    assert QuantizationModifier(scheme="FP8").needs_inputs


def test_static_input_scales_per_group_are_refused_with_what_to_use() -> None:
    scheme = {**STATIC_INT8, "input_activations": {**STATIC_INT8["input_activations"], "strategy": "group",
                                                   "group_size": 16}}
    with pytest.raises(llmc_fsm.RecipeError) as info:
        llmc_fsm.Session({"q": {"QuantizationModifier": {"scheme": scheme}}})
    assert str(info.value).endswith(
        "static input_activations (dynamic: false) per group are not supported: static input scales are per "
        "tensor (strategy: tensor, as in preset FP8); or use dynamic activations (W8A8, FP8_DYNAMIC)"
    )


# --------------------------------------------------------------------------- NVFP4, MX, FP8 block (round-to-nearest)
FP4_VALUES = 15  # e2m1: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """The tiny Llama saved once, to be loaded in bfloat16 (NVFP4 / MX checkpoints decompress to bfloat16)."""
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_llama().save_pretrained(path)
    return path


def _bf16(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def _rtn(model, scheme, out) -> dict:
    recipe = {"q": {"QuantizationModifier": {"scheme": scheme, "ignore": ["lm_head"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, output_dir=out, progress=False)
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_nvfp4a16_global_and_group_scales_equal_a_hand_computation_and_reload(tmp_path, bf16_dir) -> None:
    model = _bf16(bf16_dir)
    down = model.model.layers[1].mlp.down_proj
    original = down.weight.detach().float().clone()
    config = _rtn(model, "NVFP4A16", tmp_path / "out")
    assert config["format"] == "nvfp4-pack-quantized"
    # global scale: 448 * 6 / max|W|; group scales: fp8(global * max|w_g| / 6), 16 inputs a group; the quotients
    # in the weight's dtype (bfloat16), as compressed-tensors computes them from a bfloat16 weight's range (torch
    # divides the number 2688 by a bfloat16 tensor as 2688 times its bfloat16 reciprocal, rounded to bfloat16)
    reciprocal = torch.tensor(1.0 / float(original.abs().max()), dtype=torch.float64).bfloat16().double()
    global_scale = float((448.0 * 6.0 * reciprocal).bfloat16())
    assert float(down.weight_global_scale) == global_scale
    amax = original.double().reshape(64, -1, 16).abs().amax(dim=2)
    expected = (global_scale * (amax / 6.0).bfloat16().double()).float().to(torch.float8_e4m3fn).float()
    assert torch.equal(down.weight_scale.float(), expected)
    groups = down.weight.detach().float().reshape(64, -1, 16)
    assert max(torch.unique(g).numel() for g in groups.reshape(-1, 16)) <= FP4_VALUES
    # every value is an fp4 value times its group's effective scale (rounded to bfloat16 on decompression)
    effective = (down.weight_scale.float() / down.weight_global_scale.float()).unsqueeze(-1)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    steps = (groups / effective).abs()
    assert torch.allclose(steps, grid[(steps.unsqueeze(-1) - grid).abs().argmin(-1)], rtol=1e-2, atol=1e-2)
    _reload_equal(model, tmp_path / "out")


def _mx_scale(amax: torch.Tensor, offset: int) -> torch.Tensor:
    """OCP MX shared scale: 2 ** (exponent of max|w_g| rounded to 1 mantissa bit - the element's max exponent)."""
    e = torch.floor(torch.log2(amax))
    e = torch.where(amax / 2**e >= 1.75, e + 1, e)  # 1.75 and above round up to 2 with one mantissa bit
    return 2.0 ** (e - offset)


@pytest.mark.parametrize(("preset", "fmt", "values", "offset"), [
    ("MXFP4A16", "mxfp4-pack-quantized", FP4_VALUES, 2),
    ("MXFP8A16", "mxfp8-quantized", 255, 8),
    ("MXFP4", "mxfp4-pack-quantized", FP4_VALUES, 2),
])
def test_mx_power_of_two_scales_equal_a_hand_computation_and_reload(tmp_path, bf16_dir, preset, fmt, values,
                                                                     offset) -> None:
    model = _bf16(bf16_dir)
    up = model.model.layers[0].mlp.up_proj
    original = up.weight.detach().float().clone()
    config = _rtn(model, preset, tmp_path / "out")
    assert config["format"] == fmt
    amax = original.reshape(128, -1, 32).abs().amax(dim=2)
    assert torch.equal(up.weight_scale.float(), _mx_scale(amax, offset))
    groups = up.weight.detach().float().reshape(-1, 32)
    assert max(torch.unique(g).numel() for g in groups) <= values
    _reload_equal(model, tmp_path / "out")


def test_fp8_block_scales_equal_a_hand_computation_and_reload_in_float32(tmp_path) -> None:
    model = tiny_llama()
    down = model.model.layers[1].mlp.down_proj
    original = down.weight.detach().clone()
    scheme = {"preset": "FP8_BLOCK", "weights": {"block_structure": [32, 32]}, "input_activations": {"group_size": 32}}
    config = _rtn(model, scheme, tmp_path / "out")
    assert config["format"] == "float-quantized"
    amax = original.reshape(2, 32, 4, 32).abs().amax(dim=(1, 3))
    assert torch.allclose(down.weight_scale, amax / FP8_MAX, rtol=1e-6, atol=0)
    blocks = down.weight.detach().reshape(2, 32, 4, 32).permute(0, 2, 1, 3).reshape(8, -1)
    assert max(torch.unique(b).numel() for b in blocks) <= 256
    _reload_equal(model, tmp_path / "out")


@pytest.mark.parametrize("modifier", ["QuantizationModifier", "GPTQModifier"])
def test_fp8_blocks_that_do_not_divide_the_rows_take_the_scale_of_their_rows(tmp_path, modifier) -> None:
    """A weight whose rows are not a whole number of blocks (DeepSeek's kv_a_proj_with_mqa: 576 rows in blocks of
    128): its last block is partial, its scale the max |w| of its rows / 448, as llm-compressor's (ceil) — it was
    refused. down_proj [64, 128] in blocks of [48, 32]: 2 x 4 scales, the second row of blocks 16 rows high."""
    model = tiny_llama()
    down = model.model.layers[1].mlp.down_proj
    original = down.weight.detach().clone()
    scheme = {"preset": "FP8_BLOCK", "weights": {"block_structure": [48, 32]}, "input_activations": {"group_size": 32}}
    recipe = {"q": {modifier: {"scheme": scheme, "ignore": ["lm_head"]}}}
    calibrated = modifier == "GPTQModifier"
    data = {"dataset": torch.randint(0, 128, (4, 16)), "max_seq_length": 16} if calibrated else {}
    llmc_fsm.oneshot(model=model, recipe=recipe, output_dir=tmp_path / "out", progress=False, **data)
    assert down.weight_scale.shape == (2, 4)
    if not calibrated:  # GPTQ's scales are the same; its weights move within the blocks
        amax = torch.stack([original[:48].reshape(48, 4, 32).abs().amax(dim=(0, 2)),
                            original[48:].reshape(16, 4, 32).abs().amax(dim=(0, 2))])  # fmt: skip
        assert torch.allclose(down.weight_scale, amax / FP8_MAX, rtol=1e-6, atol=0)
    _reload_equal(model, tmp_path / "out")


def test_nvfp4_and_mx_on_a_float32_model_are_refused_before_any_work() -> None:
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"q": {"QuantizationModifier": {"scheme": "NVFP4A16"}}}, progress=False)
    assert str(info.value) == (  # every target fails: no "add these modules to ignore" advice
        "QuantizationModifier cannot compress 14 of its 14 targets — torch.float32 weight: NVFP4 / MX checkpoints "
        "decompress to bfloat16 on load (compressed-tensors 0.20), and transformers then cannot run the reloaded "
        "model (bfloat16 weights against torch.float32 inputs); load the model in bfloat16 (CLI: --dtype bfloat16; "
        "oneshot(MODEL_DIR, dtype='bfloat16'); a model you loaded: model.to(torch.bfloat16)): "
        "model.layers.{0..1}.self_attn.q_proj, model.layers.{0..1}.self_attn.k_proj, "
        "model.layers.{0..1}.self_attn.v_proj, model.layers.{0..1}.self_attn.o_proj, "
        "model.layers.{0..1}.mlp.gate_proj, model.layers.{0..1}.mlp.up_proj, model.layers.{0..1}.mlp.down_proj."
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --------------------------------------------------------------------------- the same formats with GPTQ
def _correlated_inputs(n: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, cols, generator=g) @ torch.randn(cols, cols, generator=g) + 0.5


@pytest.mark.parametrize("scheme", [
    "NVFP4A16", "MXFP4A16", "MXFP8A16", {"preset": "FP8_BLOCK", "weights": {"block_structure": [16, 16]}},
])
def test_gptq_keeps_the_format_grid_with_rtns_scales_and_a_lower_output_error(scheme) -> None:
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from llmc_fsm_quantization import gptq_quantize, resolve_scheme, rtn_quantize
    from llmc_fsm_quantization.observers import observe_scaled_format

    from llmc_fsm.toolkit.obs import HessianAccumulator

    args = resolve_scheme(scheme, ["Linear"]).weights
    torch.manual_seed(6)
    w = torch.randn(32, 64)
    x = _correlated_inputs(512, 64)
    acc = HessianAccumulator(64)
    acc.add_batch(x)
    (q,) = gptq_quantize([w], acc.hessian, args=args, actorder="static", block_size=32)
    scale, _, global_scale = observe_scaled_format(w, args)  # taken from the original weight, before the sweep
    assert torch.equal(q.scale, scale)
    assert (q.global_scale is None) == (global_scale is None)
    if global_scale is not None:
        assert torch.equal(q.global_scale, global_scale)
    # every value is on the format's grid: rounding it again with the stored scales changes nothing
    again = fake_quantize(q.weight, q.scale, q.zero_point, args, global_scale=q.global_scale)
    assert torch.allclose(again, q.weight, rtol=1e-6, atol=0)

    def error(w_hat: torch.Tensor) -> float:
        return float((x @ (w - w_hat).T).norm() / (x @ w.T).norm())

    rtn = rtn_quantize(w, args).weight
    assert error(q.weight) < 0.9 * error(rtn)
    assert q.rel_output_error == pytest.approx(error(q.weight), rel=1e-3)


def test_gptq_nvfp4a16_reloads_with_equal_logits(tmp_path, bf16_dir) -> None:
    model = _bf16(bf16_dir)
    out = tmp_path / "out"
    recipe = {"q": {"GPTQModifier": {"scheme": "NVFP4A16", "ignore": ["lm_head"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=_data(), output_dir=out, progress=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "nvfp4-pack-quantized"
    report = json.loads((out / "report.json").read_text())["sparsity"]["modules"]
    assert all(0 < m["rel_output_error"] < 0.3 for m in report if "bits" in m)
    assert {(m["bits"], m["group_size"]) for m in report if "bits" in m} == {(4, 16)}
    down = model.model.layers[1].mlp.down_proj
    assert max(torch.unique(g).numel() for g in down.weight.detach().float().reshape(-1, 16)) <= FP4_VALUES
    _reload_equal(model, out)


def test_llm_compressors_input_observer_forms_are_honoured() -> None:
    from llmc_fsm.recipes.building import resolve_recipe

    text = ("s:\n  q_modifiers:\n    QuantizationModifier: {scheme: FP8, "
            "observer: {weights: mse, input: memoryless_minmax}}\n")
    (mod,) = resolve_recipe(text).modifiers
    scheme = mod.quantization_scheme
    assert (scheme.weights.observer, scheme.input_activations.observer) == ("mse", "memoryless_minmax")
    (mod,) = resolve_recipe("s:\n  QuantizationModifier: {scheme: FP8, input_observer: minmax}\n").modifiers
    assert mod.quantization_scheme.input_activations.observer == "minmax"  # the preset's static_minmax replaced
    with pytest.raises(llmc_fsm.RecipeError) as info:
        resolve_recipe("s:\n  QuantizationModifier: {scheme: FP8, input_observer: imatrix_mse}\n")
    assert str(info.value).endswith("argument 'input_observer': input_observer 'imatrix_mse' is not an observer of "
                                    "static input scales; use one of minmax, static_minmax, memoryless_minmax, mse, "
                                    "memoryless_mse")


# --------------------------------------------------------------------------- input ranges under torch.distributed
def _ranges_rank(rank: int, tmp: str, queue) -> None:
    import torch.distributed as dist
    from llmc_fsm_quantization._base import CalibrationStatistics

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    stats = CalibrationStatistics(8)
    x = torch.randn(6, 5, 8, generator=torch.Generator().manual_seed(11))
    for batch in (x[:2], x[2:4]) if rank == 0 else (x[4:],):
        stats.add_batch(batch)
    empty = CalibrationStatistics(8)  # a rank without inputs takes part with neutral values
    other = CalibrationStatistics(8)
    if rank == 0:
        other.add_batch(x[:3])
    stats.all_reduce()
    (other if rank == 0 else empty).all_reduce()
    queue.put((rank, {k: v.tolist() for k, v in stats.ranges.items()},
               {k: v.tolist() for k, v in (other if rank == 0 else empty).ranges.items()}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_input_ranges_are_combined_over_ranks(tmp_path) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ranges_rank, args=(r, str(tmp_path), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {r: (a, b) for r, a, b in (queue.get(timeout=300) for _ in procs)}
    for p in procs:
        p.join(60)
    x = torch.randn(6, 5, 8, generator=torch.Generator().manual_seed(11))
    # one observation per sample (row): rank 0 saw rows 0-3 (in two batches), rank 1 rows 4-5
    calls = {0: [(x[r].min(), x[r].max()) for r in range(4)], 1: [(x[r].min(), x[r].max()) for r in (4, 5)]}

    def moving(cs):  # on each rank in the inputs' float32, as llm-compressor 0.14's lerp (float64 before session 37)
        lo, hi = cs[0]
        for c in cs[1:]:
            lo, hi = lo * (1.0 - 0.01) + c[0] * 0.01, hi * (1.0 - 0.01) + c[1] * 0.01
        return lo, hi

    def mean(a, b):  # over the ranks in float64, rounded back to float32
        return float(((a.double() + b.double()) / 2).float())

    expected = {
        "static_minmax": [float(x.min()), float(x.max())],
        "minmax": [mean(moving(calls[0])[i], moving(calls[1])[i]) for i in range(2)],
        "memoryless_minmax": [mean(calls[0][-1][i], calls[1][-1][i]) for i in range(2)],
    }
    for rank in (0, 1):
        got = results[rank][0]
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=1e-12), (rank, name)
    third = {"static_minmax": [float(x[:3].min()), float(x[:3].max())],
             "minmax": [float(v) for v in moving([(x[r].min(), x[r].max()) for r in range(3)])],
             "memoryless_minmax": [float(x[2].min()), float(x[2].max())]}
    for rank in (0, 1):  # only rank 0 saw inputs: its values, not halved by the empty rank
        assert results[rank][1] == {k: pytest.approx(v, rel=1e-12) for k, v in third.items()}


# --------------------------------------------------------------------------- activation mse observers
def _reference_mse_range(x: torch.Tensor, bits: int = 8) -> tuple[float, float]:
    """llm-compressor 0.14's activation ``mse`` search on one batch, in float64, for symmetric int ``bits``: the
    range ``p * [min, max]``, ``p = 1 - i / 100`` for ``i = 0 .. 19``, of the smallest ``sum |x - q(x)|^2.4``; the
    first such ``p``; stop after 5 steps without a smaller error."""
    v = x.double().reshape(-1)
    lo, hi = float(v.min()), float(v.max())
    q_min, q_max = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    best, best_p, still = float("inf"), 1.0, 0
    for i in range(20):
        p = 1 - i / 100
        scale = max(abs(min(lo * p, 0.0)), abs(max(hi * p, 0.0))) / ((q_max - q_min) / 2)
        q = torch.clamp(v / scale, q_min, q_max).round() * scale
        err = float((q - v).abs().pow(2.4).sum())
        if err < best:
            best, best_p, still = err, p, 0
        else:
            still += 1
            if still >= 5:
                break
    return lo * best_p, hi * best_p


def test_input_range_mse_equals_a_float64_search() -> None:
    from compressed_tensors.quantization import QuantizationArgs

    from llmc_fsm_quantization.observers import input_range_mse

    args = QuantizationArgs(**STATIC_INT8["input_activations"])
    gen = torch.Generator().manual_seed(0)
    chosen = set()
    for outliers in (0, 1, 3, 12):
        x = torch.randn(4, 32, 64, generator=gen)
        x.view(-1)[:outliers] = torch.tensor([40.0, -35.0, 30.0] * 4)[:outliers]
        lo, hi = input_range_mse(x, args).tolist()
        ref_lo, ref_hi = _reference_mse_range(x)
        assert lo == pytest.approx(ref_lo, rel=1e-6) and hi == pytest.approx(ref_hi, rel=1e-6)
        chosen.add(round(hi / float(x.max()), 2))
    assert len(chosen) > 1  # the search does not always keep the full range


@pytest.mark.parametrize("observer", ["mse", "memoryless_mse"])
def test_an_mse_input_observer_is_honoured_end_to_end(tmp_path, observer) -> None:
    """Static int8 input scales with llm-compressor's activation ``mse`` observers: q_proj's input scale equals the
    float64 search of each calibration sample, averaged (``mse``: moving average, constant 0.01) or the last one
    (``memoryless_mse``); the saved config says which observer; the reload gives the in-memory logits."""
    model = tiny_llama()
    data = _data()
    with torch.no_grad():  # an outlier channel in the first layer's input, as LLM activations have
        model.model.layers[0].input_layernorm.weight[5] = 60.0
    batches = _first_layer_inputs(model, data, batch_size=1)  # one observation per sample
    q = model.model.layers[0].self_attn.q_proj
    scheme = {**STATIC_INT8, "input_activations": {**STATIC_INT8["input_activations"], "observer": observer}}
    out = tmp_path / "out"
    recipe = {"q": {"QuantizationModifier": {"scheme": scheme, "ignore": ["lm_head"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=2, output_dir=out, progress=False)

    def scale(calls: list[tuple[float, float]]) -> float:
        lo, hi = calls[-1] if observer == "memoryless_mse" else calls[0]
        if observer == "mse":
            for c in calls[1:]:
                lo, hi = 0.99 * lo + 0.01 * c[0], 0.99 * hi + 0.01 * c[1]
        return max(abs(min(lo, 0.0)), abs(max(hi, 0.0))) / 127.5

    assert float(q.input_scale) == pytest.approx(scale([_reference_mse_range(x) for x in batches]), rel=1e-5)
    unsearched = scale([(float(x.double().min()), float(x.double().max())) for x in batches])
    # the search shrank some sample's range (so the saved scale, equal to the searched ranges above, is not minmax's)
    assert any(_reference_mse_range(x)[1] < float(x.double().max()) * 0.995 for x in batches)
    if observer == "mse":  # its moving average keeps 93% of the first sample's range, which the search shrank
        assert float(q.input_scale) < unsearched * (1 - 1e-5)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = config["config_groups"].values()
    assert group["input_activations"]["observer"] == observer
    _reload_equal(model, out)
