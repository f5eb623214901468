"""New formats through compressed-tensors' own compressors: static input scales (FP8, INT8), on a 2-layer random
Llama (hidden 64): the grid of the dequantized weights, scales against a hand computation, save -> reload with
transformers giving the in-memory model's logits exactly."""

from __future__ import annotations

import json

import pytest
import torch

import llmc_fsm

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def _tiny(layers: int = 2, hidden: int = 64) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


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
    model = _tiny()
    data = _data()
    batches = _first_layer_inputs(model, data, batch_size=2)
    q = model.model.layers[0].self_attn.q_proj
    original = q.weight.detach().clone()
    out = tmp_path / "out"
    recipe = {"q": {modifier: {"scheme": scheme, "ignore": ["lm_head"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=2, output_dir=out, progress=False)
    assert q.quantization_scheme.input_activations.observer == observer
    # the hand computation, float64: each batch's min and max over all its input values
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
