"""Session 38 findings (a tester's): llm-compressor's saved AutoRound recipes, random-hadamard blocks, wording."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from compressed_tensors.transform import apply_transform_config
from llmc_fsm_quantization.autoround import AutoRoundModifier
from llmc_fsm_quantization.rotations import SpinQuantModifier
from safetensors.torch import load_file

import llmc_fsm

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import tiny_families
from tiny_llama import llama

# llm-compressor 0.14's recipe.yaml, saved by its oneshot with AutoRoundModifier (W4A16 g16, iters 10) on a tiny Llama
# (the tester's peer_ar/recipe.yaml, verbatim).
LC_AUTOROUND_RECIPE = """\
quant_stage:
  quant_modifiers:
    AutoRoundModifier:
      config_groups:
        group_0:
          targets: [Linear]
          weights:
            num_bits: 4
            type: int
            symmetric: true
            group_size: 16
            strategy: group
            block_structure: null
            dynamic: false
            actorder: null
            scale_dtype: null
            zp_dtype: null
            observer: memoryless_minmax
            observer_kwargs: {}
          input_activations: null
          output_activations: null
          format: null
      targets: [Linear]
      ignore: [lm_head]
      bypass_divisibility_checks: false
      requires_calibration_data: true
      iters: 10
      enable_torch_compile: true
      batch_size: 4
      disable_opt_rtn: false
"""

# The same, saved after SpinQuantModifier (R1 + R2, hadamard) then AutoRoundModifier (the tester's peer_sqar).
LC_SPINQUANT_AUTOROUND_RECIPE = """\
quant_stage:
  quant_modifiers:
    SpinQuantModifier:
      requires_calibration_data: false
      rotations: [R1, R2]
      transform_type: hadamard
      randomize: false
      learnable: false
      precision: torch.float64
      transform_config:
        config_groups:
          R1:
            type: hadamard
            apply:
            - targets: ['re:.*embed_tokens$', 're:.*o_proj$', 're:.*down_proj$']
              location: weight_output
              inverse: false
              ignore: []
            - targets: ['re:.*q_proj$', 're:.*k_proj$', 're:.*v_proj$', 're:.*up_proj$', 're:.*gate_proj$',
                lm_head]
              location: weight_input
              inverse: true
              ignore: []
            randomize: false
            requires_grad: false
            head_dim: null
            precision: torch.float64
          R2:
            type: hadamard
            apply:
            - targets: ['re:.*v_proj$']
              location: weight_output
              inverse: false
              ignore: []
            - targets: ['re:.*o_proj$']
              location: weight_input
              inverse: true
              ignore: []
            randomize: false
            requires_grad: false
            head_dim: 16
            precision: torch.float64
""" + LC_AUTOROUND_RECIPE.split("  quant_modifiers:\n", 1)[1]


def _run(recipe: str, out: Path) -> dict[str, torch.Tensor]:
    model = llama(layers=2, hidden=64, heads=4, kv_heads=2)
    data = torch.randint(3, 128, (8, 32), generator=torch.Generator().manual_seed(2))
    llmc_fsm.oneshot(model, recipe, data, output_dir=str(out), progress=False, batch_size=8)
    return load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("recipe", [LC_AUTOROUND_RECIPE, LC_SPINQUANT_AUTOROUND_RECIPE], ids=["ar", "spinquant_ar"])
def test_llmcompressors_saved_autoround_recipe_runs_as_the_same_recipe_with_minmax(recipe: str, tmp_path: Path) -> None:
    """Before, llm-compressor 0.14's own saved AutoRound recipe.yaml was refused ("observer must be minmax, got
    'memoryless_minmax'"; found by a tester): it writes memoryless_minmax into each config group's weights. A weight
    is observed once, so it is minmax's range: the checkpoint equals the minmax recipe's bit for bit."""
    assert recipe.count("observer: memoryless_minmax") == 1
    ours = _run(recipe, tmp_path / "lc")
    reference = _run(recipe.replace("observer: memoryless_minmax", "observer: minmax"), tmp_path / "minmax")
    assert sorted(ours) == sorted(reference)
    assert [k for k in ours if not torch.equal(ours[k], reference[k])] == []
    assert any(k.endswith("weight_packed") for k in ours)


def test_a_range_searching_observer_is_still_refused_with_the_equivalents_named() -> None:
    """The refusal names the observers now accepted (before: "observer must be minmax", though the equivalent
    memoryless_minmax is accepted now)."""
    with pytest.raises(ValueError) as info:
        AutoRoundModifier(observer="mse")
    assert str(info.value) == (
        "AutoRoundModifier tunes the weight range itself: observer must be minmax (or its equivalents for weights, "
        "static_minmax and memoryless_minmax), got 'mse'"
    )
    assert AutoRoundModifier(observer="static_minmax").observer == "static_minmax"


def test_random_hadamard_blocks_are_the_ones_the_saved_transform_config_describes() -> None:
    """Before, transform_block_size with random-hadamard drew new random signs for every block of R1, while
    compressed-tensors (llm-compressor) builds one random block and repeats it, and the saved transform_config
    (random-hadamard, head_dim 16) describes that: 30 of 39 tensors differed from llm-compressor's by ~0.1 (found by a
    tester). Reference: the transform_config the modifier attaches (the one saved), applied to the original model by
    compressed-tensors' own apply_transform_config (norm scales 1 and an untied head, so no folding is needed)."""
    model = llama(layers=2, hidden=64, heads=4, kv_heads=2, tied=False).to(torch.float64)
    assert all(bool((p == 1).all()) for n, p in model.named_parameters() if "norm" in n)
    original = copy.deepcopy(model)
    modifier = SpinQuantModifier(transform_type="random-hadamard", transform_block_size=16)
    modifier.on_initialize(type("State", (), {"model": model})())
    config = model.transform_config
    assert (config.config_groups["R1"].type, config.config_groups["R1"].head_dim) == ("random-hadamard", 16)
    apply_transform_config(original, config)
    ours, reference = dict(model.named_parameters()), dict(original.named_parameters())
    differ = {n: float((ours[n] - reference[n]).detach().abs().max()) for n in ours}
    assert [n for n, d in differ.items() if d > 1e-12] == []
    assert len(differ) == 21  # embedding, head, final norm, 2 x (7 Linears + 2 norms)


@pytest.mark.parametrize(
    ("family", "arch", "experts"), [("qwen3_moe", "Qwen3MoeForCausalLM", "mlp.experts"),
                                    ("mixtral", "MixtralForCausalLM", "mlp.experts")]
)
def test_a_mixture_of_experts_model_is_refused_as_such(family: str, arch: str, experts: str) -> None:
    """Before, the refusal read "model.layers.0 has no mlp.gate_proj, mlp.up_proj, mlp.down_proj" (found by a
    tester): it now says the layer is a mixture-of-experts one, naming its experts module."""
    model = tiny_families.build(family)
    with pytest.raises(ValueError) as info:
        SpinQuantModifier().check_model(model)
    assert str(info.value) == (
        f"SpinQuantModifier cannot rotate {arch}: model.layers.0 is a mixture-of-experts layer "
        f"(model.layers.0.{experts}), which the rotations do not support (only dense Llama-style MLPs: "
        "mlp.gate_proj, mlp.up_proj, mlp.down_proj); quantize this model without SpinQuantModifier"
    )


def _head_dim_18() -> torch.nn.Module:
    return tiny_families.build("llama", head_dim=18, hidden_size=72)


@pytest.mark.parametrize(
    ("args", "way_out"),
    [
        ({}, "rotations: [R1]"),
        ({"rotations": ["R2"], "transform_block_size": 18}, "rotations: [R1] with transform_block_size: 8"),
    ],
)
def test_a_head_dim_with_no_hadamard_matrix_is_refused_with_a_way_out_that_works(args: dict, way_out: str) -> None:
    """Before, head_dim 18 was refused for R2 with no way out (found by a tester); the refusal now says how to rotate
    the residual stream alone, and that R1 runs on the same model with its logits unchanged."""
    model = _head_dim_18()
    with pytest.raises(ValueError) as info:
        SpinQuantModifier(**args).check_model(model)
    assert str(info.value) == (
        "SpinQuantModifier: no Hadamard matrix of order head_dim 18 (R2) is known (orders K * 2^m with K a multiple "
        f"of 4 up to 256); use {way_out} to rotate the residual stream only"
    )
    block = 8 if "transform_block_size" in args else None
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = model(input_ids=ids).logits.double()
    rotated = SpinQuantModifier(rotations=["R1"], transform_block_size=block)
    rotated.on_initialize(type("State", (), {"model": model})())
    with torch.no_grad():
        after = model(input_ids=ids).logits.double()
    assert rotated.summary["r1_block_size"] == (block or 72)
    assert float((after - before).abs().max()) < 1e-4 * float(before.abs().max())
