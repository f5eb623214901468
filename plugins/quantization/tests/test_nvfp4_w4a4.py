"""NVFP4 (W4A4): NVFP4 weights and fp4 input activations with ``dynamic: local`` — per-group input scales computed
at run time under an input global scale calibrated here (llm-compressor's preset ``NVFP4``; issue 22)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_formats import _bf16, bf16_dir  # noqa: F401 (bf16_dir: the tiny Llama's fixture)

import llmc_fsm

CALIB = torch.randint(3, 60, (4, 32), generator=torch.Generator().manual_seed(0))


def _run(model, scheme, out, **extra) -> None:
    recipe = {"q": {"QuantizationModifier": {"scheme": scheme, "ignore": ["lm_head"], "targets": ["Linear"], **extra}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=CALIB, output_dir=out, progress=False)


def test_nvfp4_input_global_scale_is_calibrated_applied_and_reloads(bf16_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model = _bf16(bf16_dir)
    # layer 0's q/k/v read the input norm of the embeddings, which no quantization before them changes
    reference = copy.deepcopy(model)
    seen = []
    hook = reference.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        reference(CALIB)
    hook.remove()
    absmax = max(float(x.double().abs().max()) for x in seen)
    # generate_gparam divides in the inputs' dtype (bfloat16): the float64 quotient rounded to bfloat16
    expected = torch.tensor([448.0 * 6.0 / absmax], dtype=torch.float64).to(torch.bfloat16).to(torch.float32)
    assert not torch.equal(expected, torch.tensor([448.0 * 6.0 / absmax], dtype=torch.float32))  # a float32 division

    _run(model, "NVFP4", tmp_path / "w4a4")
    attn = model.model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        got = getattr(attn, name).input_global_scale.detach()
        assert torch.equal(got, expected), name
    assert torch.equal(attn.q_proj.input_global_scale, attn.k_proj.input_global_scale)
    down = model.model.layers[0].mlp.down_proj.input_global_scale
    assert not torch.equal(down, attn.q_proj.input_global_scale)  # its own inputs' range

    weights_only = _bf16(bf16_dir)
    _run(weights_only, "NVFP4A16", tmp_path / "w4a16")
    with torch.no_grad():
        logits, logits_a16 = model(CALIB[:2]).logits, weights_only(CALIB[:2]).logits
    assert not torch.equal(logits, logits_a16)  # the inputs are quantized too

    config = json.loads((tmp_path / "w4a4" / "config.json").read_text())["quantization_config"]
    inputs = config["config_groups"]["group_0"]["input_activations"]
    assert (inputs["dynamic"], inputs["strategy"], inputs["group_size"], inputs["num_bits"]) == (
        "local", "tensor_group", 16, 4)
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "w4a4", output_loading_info=True)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    assert torch.equal(reloaded.model.layers[0].self_attn.q_proj.input_global_scale, attn.q_proj.input_global_scale)
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(CALIB[:2]).logits, logits)


@pytest.mark.parametrize(
    ("scheme", "message"),
    [
        ({"config_groups": {"g": {"targets": ["Linear"],
                                  "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                              "group_size": 16, "symmetric": True, "dynamic": False,
                                              "scale_dtype": "torch.float8_e4m3fn"},
                                  "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                        "group_size": 16, "symmetric": True, "dynamic": "local",
                                                        "observer": "mse",
                                                        "scale_dtype": "torch.float8_e4m3fn"}}}},
         "input_activations: observer mse is not supported for NVFP4's input global scale; use one of minmax, "
         "static_minmax, memoryless_minmax"),
        ({"config_groups": {"g": {"targets": ["Linear"],
                                  "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
                                  "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                        "group_size": 16, "symmetric": True, "dynamic": "local",
                                                        "scale_dtype": "torch.float8_e4m3fn"}}}},
         "input_activations with dynamic: local (per-group input scales under a calibrated global scale) are "
         "supported as NVFP4's"),
    ],
)
def test_local_inputs_other_than_nvfp4_s_are_refused_when_read(bf16_dir, tmp_path, scheme, message) -> None:
    model = _bf16(bf16_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = {"q": {"QuantizationModifier": {"ignore": ["lm_head"], **scheme}}}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=CALIB, output_dir=tmp_path / "o", progress=False)
    assert message in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not (tmp_path / "o").exists()
