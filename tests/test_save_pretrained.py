"""``model.save_pretrained`` of a model ``oneshot`` returned (llmc_fsm.output.save.CompressedSavePretrained).

llm-compressor's scripts end with ``model.save_pretrained(SAVE_DIR, save_compressed=True)``; transformers' own method
wrote the quantized weights dense with their scales beside them and no ``quantization_config`` (the reload then ran
without activation quantization). These tests fail on that code: they compare with what ``output_dir`` writes.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import llmc_fsm

W8A8 = {"quant": {"QuantizationModifier": {"scheme": "W8A8", "targets": ["Linear"], "ignore": ["lm_head"]}}}
PRUNE = {"prune": {"MagnitudePruningModifier": {"sparsity": 0.5}}}


def _tensors(directory):
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _run(model_dir, recipe, **kw):
    return llmc_fsm.oneshot(str(model_dir), recipe=recipe, progress=False, **kw)


def test_save_pretrained_writes_what_output_dir_writes(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir
    model = _run(model_dir, W8A8)
    model.save_pretrained(tmp_path / "saved", save_compressed=True)
    _run(model_dir, W8A8, output_dir=tmp_path / "out")

    saved, out = _tensors(tmp_path / "saved"), _tensors(tmp_path / "out")
    assert sorted(saved) == sorted(out)
    assert all(torch.equal(saved[k], out[k]) for k in saved)
    q_proj = "model.layers.0.self_attn.q_proj"
    assert saved[f"{q_proj}.weight"].dtype == torch.int8 and f"{q_proj}.weight_scale" in saved
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    expected = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"] == expected["quantization_config"]
    assert config["quantization_config"]["format"] == "int-quantized"
    assert (tmp_path / "saved" / "recipe.yaml").read_text() == (tmp_path / "out" / "recipe.yaml").read_text()
    assert not (tmp_path / "saved" / "report.json").exists()  # the tokenizer and report are output_dir's

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)  # activation quantization included


def test_save_compressed_false_is_refused_for_a_quantized_model(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir
    model = _run(model_dir, W8A8)
    match = r"^save_pretrained\(save_compressed=False\): llmc-fsm writes a quantized model only compressed"
    with pytest.raises(ValueError, match=match):
        model.save_pretrained(tmp_path / "dense", save_compressed=False)
    assert not (tmp_path / "dense").exists()
    with pytest.raises(ValueError, match=r"state_dict=\.\.\.\): the compressed state dict is built here"):
        model.save_pretrained(tmp_path / "sd", state_dict={})
    assert not (tmp_path / "sd").exists()


def test_a_pruned_model_saves_dense_either_way_and_a_copy_saves_itself(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir
    model = _run(model_dir, PRUNE)
    model.save_pretrained(tmp_path / "a", save_compressed=False)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.model.layers[0].mlp.down_proj.weight.zero_()
    clone.save_pretrained(tmp_path / "b")
    a, b = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    down = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(a[down], model.model.layers[0].mlp.down_proj.weight)
    assert bool(a[down].ne(0).any()) and not bool(b[down].ne(0).any())  # the copy's own weights
    assert "quantization_config" not in json.loads((tmp_path / "a" / "config.json").read_text())


def test_a_streamed_run_model_names_its_output_directory(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir
    model = _run(model_dir, W8A8, output_dir=tmp_path / "out", low_memory=True)
    with pytest.raises(ValueError, match=r"holds no weights \(meta device\); the compressed model is in '.*out'"):
        model.save_pretrained(tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_a_session_of_ones_own_saves_the_model_it_quantized_compressed(tiny_model_dir, tmp_path):
    # the lifecycle without oneshot (docs/oneshot.md, "Under the hood"): run_sequential gives the model the same method
    from llmc_fsm.pipeline.sequential import run_sequential

    model_dir, _ = tiny_model_dir
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    windows = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
    session = llmc_fsm.Session(W8A8)
    session.initialize(model=model, calibration_data=windows)
    run_sequential(session, progress=False)
    session.finalize()
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "int-quantized"
    assert _tensors(tmp_path / "saved")["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(reloaded(windows[:1]).logits, model(windows[:1]).logits)
    pruned = AutoModelForCausalLM.from_pretrained(model_dir)
    session = llmc_fsm.Session(PRUNE)
    session.initialize(model=pruned)
    session.finalize()
    assert "save_pretrained" not in vars(pruned)  # nothing quantized: transformers' own method


def test_llmcompressors_sparse_arguments_are_no_ops_and_a_misspelt_one_is_refused(tiny_model_dir, tmp_path):
    """llm-compressor's save_pretrained(..., disable_sparse_compression=True) writes what the default writes (sparse
    weights are dense either way); a misspelt argument went to transformers, which dropped it without a word."""
    model = _run(tiny_model_dir[0], PRUNE)
    model.save_pretrained(tmp_path / "a")
    model.save_pretrained(tmp_path / "b", disable_sparse_compression=True, skip_sparsity_compression_stats=False)
    a, b = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError) as info:
        model.save_pretrained(tmp_path / "c", save_compresed=True)
    assert str(info.value) == (
        "save_pretrained: unknown argument(s) save_compresed (did you mean save_compressed?); nothing was written. It "
        "takes save_directory, quantization_format, save_compressed and transformers' save_pretrained arguments"
    )
    assert not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match=r"^save_pretrained\(disable_sparse_compression=...\): must be true or false"):
        model.save_pretrained(tmp_path / "c", disable_sparse_compression="yes")
