"""SpinQuant's saved transform_config: llm-compressor 0.14's, and not applied again when the checkpoint reloads."""

from __future__ import annotations

import json

import pytest
import torch
from llmc_fsm_quantization import QuantizationModifier
from llmc_fsm_quantization.rotations import SpinQuantModifier
from tiny_quant_models import tiny_llama

import llmc_fsm

R1_APPLY = [
    {"targets": ["re:.*embed_tokens$", "re:.*o_proj$", "re:.*down_proj$"], "location": "weight_output",
     "inverse": False, "ignore": []},
    {"targets": ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$", "re:.*up_proj$", "re:.*gate_proj$", "lm_head"],
     "location": "weight_input", "inverse": True, "ignore": []},
]
R2_APPLY = [
    {"targets": ["re:.*v_proj$"], "location": "weight_output", "inverse": False, "ignore": []},
    {"targets": ["re:.*o_proj$"], "location": "weight_input", "inverse": True, "ignore": []},
]


def _group(apply: list, head_dim: int | None, kind: str = "hadamard") -> dict:
    return {"type": kind, "apply": apply, "randomize": False, "requires_grad": False, "head_dim": head_dim,
            "precision": "torch.float64"}


@pytest.mark.parametrize(
    ("spin", "expected"),
    [
        ({"rotations": ["R1", "R2"], "transform_block_size": 32},
         {"R1": _group(R1_APPLY, 32), "R2": _group(R2_APPLY, 16)}),
        ({"rotations": ["R1"], "transform_type": "random-hadamard"}, {"R1": _group(R1_APPLY, None, "random-hadamard")}),
    ],
)
def test_a_rotated_quantized_checkpoint_records_llm_compressors_transform_config_and_reloads_equal(
    tmp_path, spin: dict, expected: dict
) -> None:
    """Found by a tester: a SpinQuant + W4A16 checkpoint had no quantization_config.transform_config, which
    llm-compressor 0.14 writes (R1 on embed_tokens / o_proj / down_proj outputs and the inverse on q / k / v / up /
    gate / lm_head inputs, head_dim the block size; R2 on v_proj / o_proj, head_dim the model's). Its locations are
    all weight_*: transformers does not apply them on reload, so the logits equal the in-memory model's."""
    from transformers import AutoModelForCausalLM

    model = tiny_llama(hidden=64)  # 4 heads of 16
    w4g16 = {"preset": "W4A16", "weights": {"group_size": 16}}
    recipe = [SpinQuantModifier(**spin), QuantizationModifier(scheme=w4g16)]
    data = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=out, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["transform_config"] == {"config_groups": expected}
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)


def test_a_rotated_model_with_kv_cache_scales_only_records_the_transform_config_too(tmp_path) -> None:
    """Found on the way to the tester's case: a rotation with only KV-cache scales calibrated (no weight scheme)
    saves through another branch of the writer (compressed-tensors' config of a KV-only model), which did not
    take the rotation's transform_config from the model."""
    model = tiny_llama(hidden=64)
    kv = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}
    recipe = [SpinQuantModifier(rotations=["R2"]), QuantizationModifier(kv_cache_scheme=kv)]
    data = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=tmp_path / "out", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["transform_config"] == {"config_groups": {"R2": _group(R2_APPLY, 16)}}
