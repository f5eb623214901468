"""The compressed-tensors format quantized weights are saved in: a recipe's config-group ``format``, and
``quantization_format`` (llm-compressor's ``save_pretrained`` argument; ``oneshot`` / ``--quantization-format``).

Asymmetric int weights are saved ``int-quantized`` by default (transformers 5.25 reloads them; vLLM has no kernel for
weight-only ``int-quantized``). ``pack-quantized`` writes them as llm-compressor does (vLLM's layout: int4 values and
zero points packed eight to an int32). Before these tests, ``save_pretrained(quantization_format=...)`` was passed on
to transformers and ignored, and a recipe's ``format: pack-quantized`` was replaced by ``int-quantized``, silently.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import llmc_fsm
from llmc_fsm.cli import main

Q = "model.layers.0.self_attn.q_proj"
ASYM = {"group_size": 32, "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group"}


def _recipe(fmt=None, weights=ASYM):
    group = {"targets": ["Linear"], "weights": dict(weights)}
    if fmt is not None:
        group["format"] = fmt
    return {"quant": {"QuantizationModifier": {"config_groups": {"group_0": group}, "ignore": ["lm_head"]}}}


def _tensors(directory):
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _format(directory):
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    return config["format"], config["config_groups"]["group_0"]["format"]


def _run(model_dir, recipe, **kw):
    return llmc_fsm.oneshot(str(model_dir), recipe=recipe, progress=False, **kw)


def test_default_saves_asymmetric_int_weights_int_quantized_and_says_vllm_does_not_serve_them(
    tiny_model_dir, tmp_path, caplog
):
    model_dir, _ = tiny_model_dir
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.output.save"):
        model = _run(model_dir, _recipe(), output_dir=tmp_path / "out")
    assert _format(tmp_path / "out") == ("int-quantized", "int-quantized")
    saved = _tensors(tmp_path / "out")
    assert saved[f"{Q}.weight"].dtype == torch.int8 and f"{Q}.weight_packed" not in saved
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "28 modules with asymmetric int weights (e.g. model.layers.0.self_attn.q_proj) are saved int-quantized (one "
        "int8 per value): transformers reloads them, vLLM has no kernel for weight-only int-quantized weights. For "
        "vLLM save them pack-quantized, as llm-compressor does: quantization_format='pack-quantized' "
        "(--quantization-format; transformers 5.25 cannot reload that, its compressed-tensors loader allocates "
        "unpacked zero points)"
    ]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_pack_quantized_writes_llmcompressors_layout_from_save_pretrained_oneshot_and_a_recipe(
    tiny_model_dir, tmp_path, caplog
):
    model_dir, _ = tiny_model_dir
    model = _run(model_dir, _recipe())
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.output.save"):
        model.save_pretrained(tmp_path / "saved", quantization_format="pack-quantized")
    assert _format(tmp_path / "saved") == ("pack-quantized", "pack-quantized")
    saved = _tensors(tmp_path / "saved")
    q_proj = model.get_submodule(Q)
    zero_point = q_proj.weight_zero_point.detach()  # [out, groups], int8, asymmetric int4
    assert saved[f"{Q}.weight_zero_point"].shape == (q_proj.out_features // 8, q_proj.in_features // 32)
    assert torch.equal(saved[f"{Q}.weight_zero_point"], pack_to_int32(zero_point, 4, packed_dim=0))
    codes = torch.clamp(
        torch.round(q_proj.weight.detach() / q_proj.weight_scale.repeat_interleave(32, 1))
        + zero_point.repeat_interleave(32, 1),
        -8,
        7,
    ).to(torch.int8)  # the stored weight is on the grid: its int4 codes, packed as compressed-tensors packs them
    assert torch.equal(saved[f"{Q}.weight_packed"], pack_to_int32(codes, 4))
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "28 modules with asymmetric int weights (e.g. model.layers.0.self_attn.q_proj) are saved pack-quantized as "
        "asked: vLLM serves them, transformers 5.25 cannot reload them (its compressed-tensors loader allocates "
        "unpacked zero points: size mismatch); int-quantized (the default) reloads in transformers"
    ]

    _run(model_dir, _recipe(), output_dir=tmp_path / "oneshot", quantization_format="pack-quantized")
    _run(model_dir, _recipe("pack-quantized"), output_dir=tmp_path / "recipe")
    for other in ("oneshot", "recipe"):
        assert _format(tmp_path / other) == ("pack-quantized", "pack-quantized")
        tensors = _tensors(tmp_path / other)
        assert sorted(tensors) == sorted(saved) and all(torch.equal(tensors[k], saved[k]) for k in saved)

    model.save_pretrained(tmp_path / "again")  # the format asked for once is not kept for the next save
    assert _format(tmp_path / "again") == ("int-quantized", "int-quantized")
    model.save_pretrained(tmp_path / "positional", "pack-quantized")  # llm-compressor's order: the format second
    assert _format(tmp_path / "positional") == ("pack-quantized", "pack-quantized")


def test_streamed_run_writes_the_format_asked_for_as_in_memory(tiny_model_dir, tmp_path, caplog):
    model_dir, text = tiny_model_dir
    kw = {"dataset": str(text), "num_calibration_samples": 4, "max_seq_length": 16}
    gptq = {"quant": {"GPTQModifier": {"config_groups": {"g": {"targets": ["Linear"], "weights": ASYM}}}}}
    _run(model_dir, gptq, output_dir=tmp_path / "mem", quantization_format="pack-quantized", **kw)
    in_memory = [r.getMessage() for r in caplog.records if r.name == "llmc_fsm.output.save"]
    caplog.clear()
    _run(model_dir, gptq, output_dir=tmp_path / "low", quantization_format="pack-quantized", low_memory=True, **kw)
    streamed = [r.getMessage() for r in caplog.records if r.name == "llmc_fsm.output.save"]
    assert len(in_memory) == 1 and streamed == in_memory  # one line for the model, not one per decoder layer
    mem, low = _tensors(tmp_path / "mem"), _tensors(tmp_path / "low")
    assert f"{Q}.weight_packed" in low and sorted(mem) == sorted(low)
    assert all(torch.equal(mem[k], low[k]) for k in mem)
    assert json.loads((tmp_path / "low" / "config.json").read_text())["quantization_config"]["format"] == (
        "pack-quantized"
    )


def test_cli_flag_writes_the_format(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(_recipe()), encoding="utf-8")
    argv = ["oneshot", "--model", str(model_dir), "--recipe", str(recipe), "--no-progress"]
    assert main([*argv, "--output", str(tmp_path / "out"), "--quantization-format", "pack-quantized"]) == 0
    assert _format(tmp_path / "out") == ("pack-quantized", "pack-quantized")


def test_a_format_the_weights_do_not_allow_is_refused_before_anything_is_written(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir
    with pytest.raises(llmc_fsm.RecipeError) as err:
        llmc_fsm.Session(_recipe("float-quantized"))
    assert str(err.value).endswith(
        "config_groups entry 'group_0': format float-quantized: 4-bit int weights are saved pack-quantized, "
        "int-quantized or naive-quantized, not float-quantized"
    )

    model = _run(model_dir, _recipe())
    with pytest.raises(ValueError) as err:
        model.save_pretrained(tmp_path / "saved", quantization_format="float-quantized")
    assert str(err.value) == (
        "quantized weights cannot be saved in the compressed-tensors format asked for ("
        "model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj ...: "
        "4-bit int weights are saved pack-quantized, int-quantized or naive-quantized, not float-quantized); give a "
        "format their weights allow, or none (the default)"
    )
    with pytest.raises(ValueError, match=r"^quantization_format 'dense': llmc-fsm saves quantized weights only "):
        model.save_pretrained(tmp_path / "saved", quantization_format="dense")
    with pytest.raises(ValueError, match=r"^quantization_format must be one of compressed-tensors' formats "):
        model.save_pretrained(tmp_path / "saved", quantization_format="packed")
    assert not (tmp_path / "saved").exists()

    pruned = _run(model_dir, {"prune": {"MagnitudePruningModifier": {"sparsity": 0.5}}})
    with pytest.raises(ValueError) as err:
        pruned.save_pretrained(tmp_path / "saved", quantization_format="pack-quantized")
    assert str(err.value) == (
        "quantization_format 'pack-quantized' is the format quantized weights are saved in, and the model has no "
        "quantized weights: leave it out"
    )
    assert not (tmp_path / "saved").exists()


def test_oneshot_refuses_a_format_that_does_not_fit_the_recipe_before_any_work(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir
    out = tmp_path / "out"
    with pytest.raises(ValueError) as err:
        _run(model_dir, {"q": {"QuantizationModifier": {"scheme": "FP8_DYNAMIC"}}}, output_dir=out,
             quantization_format="pack-quantized")  # fmt: skip
    assert str(err.value) == (
        "quantization_format (--quantization-format) 'pack-quantized' does not fit the recipe: "
        "model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj ... "
        "(28 targets): 8-bit float weights are saved float-quantized or naive-quantized, not pack-quantized"
    )
    with pytest.raises(ValueError) as err:
        _run(model_dir, {"p": {"MagnitudePruningModifier": {"sparsity": 0.5}}}, output_dir=out,
             quantization_format="int-quantized")  # fmt: skip
    assert str(err.value) == (
        "quantization_format (--quantization-format) 'int-quantized' is the format quantized weights are saved in, "
        "and the recipe quantizes no weights: leave it out"
    )
    with pytest.raises(ValueError) as err:
        _run(model_dir, _recipe(), quantization_format="pack-quantized")
    assert str(err.value).startswith(
        "quantization_format (--quantization-format) is the format of the checkpoint written to output_dir (--output)"
    )
    assert not out.exists()


def test_fused_experts_are_saved_in_the_one_format_transformers_reads_them_in(tmp_path):
    from tiny_families import build

    build("qwen3_moe").save_pretrained(tmp_path / "moe")
    int4 = {"group_size": 16, "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    recipe = {"q": {"QuantizationModifier": {"config_groups": {"g": {"targets": ["Linear"], "weights": int4}},
                                             "ignore": ["lm_head", "re:.*mlp.gate$"]}}}  # fmt: skip
    with pytest.raises(ValueError) as err:
        _run(tmp_path / "moe", recipe, output_dir=tmp_path / "out", quantization_format="int-quantized")
    assert str(err.value).startswith(
        "quantization_format (--quantization-format) 'int-quantized' does not fit the recipe: "
        "model.layers.0.mlp.experts.0.gate_proj, model.layers.0.mlp.experts.0.up_proj, "
        "model.layers.0.mlp.experts.0.down_proj ... ("
    )
    assert str(err.value).endswith(
        "fused experts' 4-bit int weights (transformers' experts loader reads no other format) are saved "
        "pack-quantized, not int-quantized"
    )
    assert not (tmp_path / "out").exists()
    model = build("qwen3_moe")  # an in-memory model: refused before any work too, its weights untouched
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"^quantization_format \(--quantization-format\) 'int-quantized' does not "):
        llmc_fsm.oneshot(model=model, recipe=recipe, output_dir=tmp_path / "out", quantization_format="int-quantized",
                         progress=False)  # fmt: skip
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not (tmp_path / "out").exists()


def test_resuming_without_the_format_asked_for_is_refused():
    from llmc_fsm.output.workdir import fingerprint_changes

    given = {"seed": 0, "output": {"quantization_format": "pack-quantized"}}
    assert fingerprint_changes(given, {"seed": 0}) == ["output ({'quantization_format': 'pack-quantized'} -> None)"]
    assert fingerprint_changes({"seed": 0}, given) == ["output (None -> {'quantization_format': 'pack-quantized'})"]
    assert fingerprint_changes(given, dict(given)) == []


def test_a_quantized_embedding_is_saved_int_quantized_only(tmp_path):
    """transformers 5.25 cannot reload a packed embedding ('Embedding' object has no attribute 'weight'), and nothing
    else reads one: ``pack-quantized`` for an Embedding target is refused before any work, asked for by
    ``quantization_format`` or by the config group's ``format`` (a breaker's case: it was written with a warning)."""
    from tiny_families import VOCAB, build

    data = torch.randint(3, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}
    group = {"targets": ["Linear", "Embedding"], "weights": int8}
    recipe = {"q": {"GPTQModifier": {"config_groups": {"g": group}, "ignore": ["lm_head"]}}}
    model = build("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=tmp_path / "out",
                         quantization_format="pack-quantized", progress=False)  # fmt: skip
    assert str(err.value) == (
        "quantization_format (--quantization-format) 'pack-quantized' does not fit the recipe: model.embed_tokens: "
        "8-bit int weights are saved int-quantized, not pack-quantized"
    )
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    group["format"] = "pack-quantized"
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=tmp_path / "out", progress=False)
    assert str(err.value) == (
        "a config group's format does not fit its targets: model.embed_tokens: format pack-quantized: 8-bit int "
        "weights are saved int-quantized, not pack-quantized"
    )
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not (tmp_path / "out").exists()


W4AFP8 = {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
          "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                "dynamic": True}}  # fmt: skip  (compressed-tensors' W4AFP8 preset, group size 32)


def test_int_weights_with_float_activations_are_saved_packed_when_asked_as_llmcompressors_w4a8_fp8_examples(
    tiny_model_dir, tmp_path, caplog
):
    """llm-compressor's ``quantization_w4a8_fp8`` and ``awq/w4a8_fp8`` examples save W4A8-FP8 ``pack-quantized`` "for
    vLLM compatibility" (vLLM's W4A8-FP8 scheme reads ``weight_packed``). compressed-tensors *infers*
    ``int-quantized`` for int weights with float activations; it packs them exactly. A breaker found the packed format
    refused as if the packer could not take them."""
    model_dir, _ = tiny_model_dir
    group = {"targets": ["Linear"], **W4AFP8}
    recipe = {"q": {"QuantizationModifier": {"config_groups": {"group_0": group}, "ignore": ["lm_head"]}}}
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.output.save"):
        model = _run(model_dir, recipe, output_dir=tmp_path / "default")
    assert _format(tmp_path / "default") == ("int-quantized", "int-quantized")
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "28 modules with int4 weights and float input activations (e.g. model.layers.0.self_attn.q_proj, W4A8-FP8) "
        "are saved int-quantized (one int8 per value, compressed-tensors' inferred format): transformers reloads "
        "them, vLLM's W4A8-FP8 scheme reads packed weights. For vLLM save them pack-quantized, as llm-compressor's "
        "W4A8-FP8 examples do: quantization_format='pack-quantized' (--quantization-format; transformers reloads "
        "that too)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.output.save"):
        model.save_pretrained(tmp_path / "packed", quantization_format="pack-quantized")
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert _format(tmp_path / "packed") == ("pack-quantized", "pack-quantized")
    q_proj = model.get_submodule(Q)
    codes = torch.round(q_proj.weight.detach() / q_proj.weight_scale.repeat_interleave(32, 1)).clamp(-8, 7)
    assert torch.equal(_tensors(tmp_path / "packed")[f"{Q}.weight_packed"], pack_to_int32(codes.to(torch.int8), 4))
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        expected = model(ids).logits
        for name in ("default", "packed"):
            assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / name)(ids).logits, expected)


def test_fp8_weights_are_saved_float_quantized_or_naive_quantized_the_same_tensors(tiny_model_dir, tmp_path):
    """compressed-tensors infers ``naive-quantized`` for weight-only FP8 (llm-compressor's
    ``recipe_fp8_weight_only_channel.yaml``) and ``float-quantized`` with activations; its float compressor is its
    naive one, so either name writes the same tensors. A breaker found ``float-quantized`` refused for weight-only FP8
    and ``naive-quantized`` refused as an unknown format."""
    model_dir, _ = tiny_model_dir
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
    model = _run(model_dir, _recipe(weights=fp8))
    for fmt in ("naive-quantized", "float-quantized"):
        model.save_pretrained(tmp_path / fmt, quantization_format=fmt)
        assert _format(tmp_path / fmt) == (fmt, fmt)
    model.save_pretrained(tmp_path / "default")
    assert _format(tmp_path / "default") == ("naive-quantized", "naive-quantized")
    naive, floated = _tensors(tmp_path / "naive-quantized"), _tensors(tmp_path / "float-quantized")
    assert sorted(naive) == sorted(floated) and all(torch.equal(naive[k], floated[k]) for k in naive)
    assert naive[f"{Q}.weight"].dtype == torch.float8_e4m3fn
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        expected = model(ids).logits
        for fmt in ("naive-quantized", "float-quantized"):
            assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / fmt)(ids).logits, expected)
    with pytest.raises(ValueError) as err:
        model.save_pretrained(tmp_path / "int", quantization_format="int-quantized")
    assert str(err.value) == (
        "quantized weights cannot be saved in the compressed-tensors format asked for ("
        "model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj ...: "
        "8-bit float weights are saved naive-quantized or float-quantized, not int-quantized); give a format their "
        "weights allow, or none (the default)"
    )
    assert not (tmp_path / "int").exists()


def test_fused_fp8_experts_may_be_saved_under_either_name_of_the_float_layout():
    """A breaker relabelled a weight-only FP8 Qwen3-MoE checkpoint from naive- to float-quantized: it reloads with
    the same logits (one layout, two names), yet float-quantized was refused for the fused experts."""
    from compressed_tensors.quantization import QuantizationScheme

    from llmc_fsm.toolkit import format_problem
    from llmc_fsm.toolkit.views import LinearView

    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
    scheme = QuantizationScheme(targets=["Linear"], weights=fp8)
    assert [format_problem(LinearView, scheme, f) for f in ("naive-quantized", "float-quantized")] == [None, None]
    assert format_problem(LinearView, scheme, "pack-quantized") == (
        "fused experts' 8-bit float weights (transformers' experts loader reads no other format) are saved "
        "naive-quantized or float-quantized, not pack-quantized"
    )
