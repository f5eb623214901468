"""Session 40 fixes (quantization plugin): GPTQ FP8-block column rounding, SmoothQuant's saved mappings form,
explain --model and the smoothing fold check. Each test names what a tester found before the fix."""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from compressed_tensors.quantization import QuantizationArgs
from llmc_fsm_quantization import AWQMapping, SmoothQuantModifier
from llmc_fsm_quantization.gptq import gptq_quantize
from tiny_families import batches, build

import llmc_fsm
from llmc_fsm.cli import main
from llmc_fsm.recipes.building import resolve_recipe


def test_gptq_fp8_block_compensates_the_error_of_the_column_rounded_to_bfloat16():
    """Found by a tester: GPTQ with FP8_BLOCK on a bfloat16 model compensated each column's unrounded quantized value,
    so 27% of the FP8 codes differed from llm-compressor 0.14's (which stores and compensates the value rounded to the
    weight's dtype, as for the per-tensor FP8 formats). Here columns 0 and 1 are coupled by ``H = [[1, .5], [.5, 1]]``
    (damping 0): column 1 becomes ``w1 + 0.5 (w0 - q0)``. The block's scale is ``bf16(2.0625 / 448)``
    = 0.004608154296875; ``q0 = 448 * scale = 2.064453125`` is stored as bfloat16 2.0625, so the error compensated is
    0 and ``w1 / scale = -7.682`` gives the FP8 code -7.5 (``-7.5 * scale`` in bfloat16: -0.03466796875). Before: the
    unrounded q0 left ``-0.036376953125 / scale = -7.894``, the code -8."""
    weight = torch.tensor([[2.0625, -0.035400390625, 1.0]], dtype=torch.bfloat16)
    hessian = torch.eye(3)
    hessian[0, 1] = hessian[1, 0] = 0.5
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[1, 3])
    (q,) = gptq_quantize([weight], hessian, args=args, dampening_frac=0.0, actorder=None)
    assert q.scale.tolist() == [[0.004608154296875]]
    assert q.weight.tolist() == [[2.0625, -0.03466796875, 1.03125]]


def test_smoothquant_mappings_are_saved_in_smoothquants_form_from_either_form():
    """Found by a tester: SmoothQuantModifier's ``mappings`` were saved to recipe.yaml in AWQ's dict form, which
    llm-compressor 0.14's SmoothQuantModifier refuses (pydantic ``list_type``: "Input should be a valid list"). They
    are now held and saved as ``[[balance patterns...], smooth pattern]``, given in either form, and read back."""
    saved = [[["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"], "re:.*input_layernorm$"],
             [["re:.*gate_proj$"], "re:.*post_attention_layernorm$"]]  # fmt: skip
    given = [
        saved,
        [{"smooth_layer": "re:.*input_layernorm$", "balance_layers": ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]},
         {"smooth_layer": "re:.*post_attention_layernorm$", "balance_layers": "re:.*gate_proj$"}],
        [AWQMapping("re:.*input_layernorm$", ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]),
         AWQMapping("re:.*post_attention_layernorm$", ["re:.*gate_proj$"])],
    ]  # fmt: skip
    for mappings in given:
        modifier = SmoothQuantModifier(smoothing_strength=0.8, mappings=mappings)
        assert modifier.mappings == saved
        (stage,) = resolve_recipe([modifier]).to_dict().values()
        assert stage["modifiers"][0]["SmoothQuantModifier"]["mappings"] == saved
        text = yaml.safe_dump(resolve_recipe([modifier]).to_dict())
        (again,) = resolve_recipe(text).to_dict().values()
        assert again["modifiers"][0]["SmoothQuantModifier"]["mappings"] == saved


GEMMA2_RECIPE = """quant_stage:
  quant_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.8
      mappings:
      - - ['re:.*q_proj', 're:.*k_proj', 're:.*v_proj']
        - re:.*input_layernorm
      - - ['re:.*gate_proj', 're:.*up_proj']
        - re:.*post_attention_layernorm
    GPTQModifier:
      ignore: [lm_head]
      actorder: null
      config_groups:
        group_0:
          weights: {num_bits: 8, type: int, symmetric: true, strategy: channel}
          input_activations: {num_bits: 8, symmetric: false, dynamic: true, strategy: token, type: int}
          targets: [Linear]
"""

GEMMA2_REFUSAL = (
    "SmoothQuantModifier: folding smoothing scales into model.layers.0.post_attention_layernorm -> "
    "model.layers.0.mlp.gate_proj, model.layers.0.mlp.up_proj (relative change {}) changes what Gemma2DecoderLayer "
    "computes: the smooth layer's output is also read by something that is not one of its balance layers (a parallel "
    "MLP, the residual); give mappings whose balance layers are every module reading it, or leave that layer out of "
    "the mappings. Nothing was changed"
)


def test_explain_with_a_model_refuses_a_smoothquant_mapping_whose_fold_oneshot_refuses(tmp_path, capsys):
    """Found by a tester: ``llmc-fsm explain RECIPE --model DIR`` approved (exit 0) llm-compressor's
    tests/e2e/recipes/INT8/recipe_w8a8_dynamic_asym.yaml on a Gemma 2 directory, whose mapping
    ``post_attention_layernorm -> gate_proj, up_proj`` one-shot then refused by its fold check (Gemma 2's MLP reads
    ``pre_feedforward_layernorm``; ``post_attention_layernorm``'s output is added to the residual). Explain now runs
    that check on a CPU copy of decoder layer 0 with deterministic random weights and gives one-shot's refusal (the
    relative change is that of the stand-in weights); the default mappings pass."""
    build("gemma2").save_pretrained(tmp_path / "gemma2")
    (tmp_path / "r.yaml").write_text(GEMMA2_RECIPE)
    capsys.readouterr()
    assert main(["explain", str(tmp_path / "r.yaml"), "--model", str(tmp_path / "gemma2")]) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    prefix = f"llmc-fsm explain: error: oneshot would refuse this recipe on --model {tmp_path / 'gemma2'}: "
    assert err == prefix + GEMMA2_REFUSAL.format("0.58")
    with pytest.raises(ValueError) as info:  # one-shot's own refusal, on the real weights and calibration inputs
        llmc_fsm.oneshot(model=build("gemma2"), recipe=GEMMA2_RECIPE, dataset=batches()[0]["input_ids"], progress=False)
    assert re.sub(r"relative change [0-9.e-]+\)", "relative change X)", str(info.value)) == GEMMA2_REFUSAL.format("X")
    (tmp_path / "default.yaml").write_text("s:\n  SmoothQuantModifier: {smoothing_strength: 0.8}\n")
    assert main(["explain", str(tmp_path / "default.yaml"), "--model", str(tmp_path / "gemma2")]) == 0
    assert "fold check: passes on decoder layer 0 (Gemma2DecoderLayer) with deterministic random weights and inputs " \
        "(one-shot checks it again on the calibration inputs)" in capsys.readouterr().out


def test_explain_says_the_fold_probe_cannot_build_a_familys_layer_inputs_not_a_bare_exception(tmp_path, capsys):
    """Found by a re-tester: on Bamba explain printed ``fold check: not run here (ValueError: not enough values to
    unpack (expected 2, got 1))``, read as a crash of the tool; the line now says the probe cannot build that
    family's layer inputs on stand-in weights (the check then runs in one-shot, as before)."""
    build("bamba").config.save_pretrained(tmp_path / "bamba")
    (tmp_path / "default.yaml").write_text("s:\n  SmoothQuantModifier: {smoothing_strength: 0.8}\n")
    main(["explain", str(tmp_path / "default.yaml"), "--model", str(tmp_path / "bamba")])
    lines = [line.strip() for line in capsys.readouterr().out.splitlines() if "fold check:" in line]
    assert lines == [
        "fold check: not run here (the probe cannot build this family's layer inputs on stand-in weights: its forward "
        "stopped with ValueError: not enough values to unpack (expected 2, got 1)): it runs in one-shot, on the first "
        "decoder layer of each class with the calibration inputs"
    ]
    build("bloom").config.save_pretrained(tmp_path / "bloom")  # another exception class, the same wording
    main(["explain", str(tmp_path / "default.yaml"), "--model", str(tmp_path / "bloom")])
    (line,) = [line.strip() for line in capsys.readouterr().out.splitlines() if "fold check:" in line]
    assert line.startswith("fold check: not run here (the probe cannot build this family's layer inputs on stand-in "
                           "weights: its forward stopped with RuntimeError: ")  # fmt: skip
