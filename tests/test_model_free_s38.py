"""model_free_ptq / llmc-fsm model-free: found by testers (session 38).

The asymmetric int weights' format (``quantization_format``, ``--quantization-format``), NVFP4's bfloat16 advice in
model-free's own terms, flags checked as oneshot checks them (and ``threads``), a tied output head named in
``ignore``, and a PyTorch ``.bin`` shard named in the safetensors index.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_llama import llama

from llmc_fsm import model_free_ptq, oneshot
from llmc_fsm.oneshot_job import model_free as model_free_module


def _checkpoint(directory: Path, *, tied: bool = False, dtype: torch.dtype = torch.bfloat16) -> Path:
    llama(hidden=64, tied=tied, kv_heads=4).to(dtype).save_pretrained(directory)
    return directory


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _refused(tmp_path: Path, source: Path, message: str, **kwargs) -> None:
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError) as info:
        model_free_ptq(source, tmp_path / "out", **{"progress": False, **kwargs})
    assert str(info.value) == message
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no work directory


# --------------------------------------------------------------------------- quantization_format
def test_quantization_format_pack_quantized_writes_asymmetric_int_weights_as_oneshot_does(tmp_path, caplog):
    """model_free_ptq had no quantization_format (TypeError) while its warning on W4A16_ASYM's int-quantized weights
    told the user to pass quantization_format='pack-quantized' (--quantization-format); found by a tester."""
    source = _checkpoint(tmp_path / "src")
    with caplog.at_level(logging.WARNING):
        model_free_ptq(source, tmp_path / "free", scheme="W4A16_ASYM", group_size=64, ignore=["lm_head"],
                       quantization_format="pack-quantized", progress=False)  # fmt: skip
    scheme = {"preset": "W4A16_ASYM", "weights": {"group_size": 64}}
    recipe = {"stage": {"QuantizationModifier": {"targets": ["Linear"], "scheme": scheme, "ignore": ["lm_head"]}}}
    oneshot(model=str(source), recipe=recipe, output_dir=str(tmp_path / "oneshot"), dtype=torch.bfloat16,
            quantization_format="pack-quantized")  # fmt: skip
    free, reference = _tensors(tmp_path / "free"), _tensors(tmp_path / "oneshot")
    assert sorted(free) == sorted(reference)
    assert all(torch.equal(free[k], reference[k]) for k in free)
    assert free["model.layers.0.mlp.down_proj.weight_packed"].dtype == torch.int32
    config = json.loads((tmp_path / "free" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized"
    assert [g["format"] for g in config["config_groups"].values()] == ["pack-quantized"]
    assert "are saved pack-quantized as asked: vLLM serves them" in caplog.text


def test_the_cli_takes_quantization_format(tmp_path, capsys):
    """``llmc-fsm model-free --quantization-format`` was an unrecognized argument; found by a tester."""
    from llmc_fsm.cli import main

    source = _checkpoint(tmp_path / "src")
    base = ["model-free", str(source), "--scheme", "W4A16_ASYM", "--group-size", "64", "--no-progress"]
    assert main([*base, "--quantization-format", "pack-quantized", "--output", str(tmp_path / "cli")]) == 0
    config = json.loads((tmp_path / "cli" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized"
    capsys.readouterr()
    assert main([*base, "--quantization-format", "packed", "--output", str(tmp_path / "bad")]) == 1
    assert capsys.readouterr().err == (
        "llmc-fsm model-free: error: model_free_ptq: quantization_format (--quantization-format) must be one of "
        "compressed-tensors' formats pack-quantized, int-quantized, float-quantized, naive-quantized, "
        "nvfp4-pack-quantized, mxfp4-pack-quantized, mxfp6-pack-quantized, mxfp8-quantized, got 'packed'\n"
    )
    assert not (tmp_path / "bad").exists()


def test_a_format_the_schemes_weights_cannot_be_saved_in_is_refused_before_any_output(tmp_path):
    """Found by a tester (no quantization_format before): refused before any work, as oneshot refuses it."""
    source = _checkpoint(tmp_path / "src")
    message = (
        "model_free_ptq: quantization_format (--quantization-format) 'pack-quantized' does not fit the scheme: "
        "FP8_DYNAMIC: 8-bit float weights are saved float-quantized or naive-quantized, not pack-quantized; give "
        "a format its weights allow, or leave it out (each scheme's default)"
    )
    _refused(tmp_path, source, message, scheme="FP8_DYNAMIC", quantization_format="pack-quantized")


def test_nvfp4_on_a_float16_checkpoint_names_model_free_dtype_not_oneshot(tmp_path):
    """The refusal advised ``oneshot(MODEL_DIR, dtype='bfloat16')``, an argument of another function; found by a
    tester."""
    source = _checkpoint(tmp_path / "src", dtype=torch.float16)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(Exception) as info:
        model_free_ptq(source, tmp_path / "out", scheme="NVFP4A16", progress=False)
    assert str(info.value) == (
        "model_free_ptq: QuantizationModifier refuses this checkpoint: QuantizationModifier cannot compress 14 of its "
        "14 targets — torch.float16 weight: NVFP4 / MX checkpoints decompress to bfloat16 on load "
        "(compressed-tensors 0.20), and transformers then cannot run the reloaded model (bfloat16 weights against "
        "torch.float16 inputs); "
        "load the model in bfloat16 (CLI: --dtype bfloat16; Python: model_free_ptq(..., dtype='bfloat16')): "
        "model.layers.{0..1}.mlp.down_proj, model.layers.{0..1}.mlp.gate_proj, model.layers.{0..1}.mlp.up_proj, "
        "model.layers.{0..1}.self_attn.k_proj, model.layers.{0..1}.self_attn.o_proj, "
        "model.layers.{0..1}.self_attn.q_proj, model.layers.{0..1}.self_attn.v_proj."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# --------------------------------------------------------------------------- flags
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"overwrite": "no"}, "model_free_ptq: overwrite (--overwrite) must be True or False, got 'no'"),
        ({"progress": "no"}, "model_free_ptq: progress (--no-progress) must be True or False, got 'no'"),
        ({"max_workers": "4"}, "model_free_ptq: max_workers must be a positive int, got '4'"),
        ({"max_workers": 0}, "model_free_ptq: max_workers must be a positive int, got 0"),
        ({"threads": 0}, "model_free_ptq: threads (--threads) must be a positive int, got 0"),
    ],
)
def test_flags_of_the_wrong_type_are_refused_in_one_line(tmp_path, kwargs, message):
    """``overwrite="no"`` replaced an existing output (a non-empty string is true), ``progress="no"`` showed bars,
    ``max_workers="4"`` and ``0`` were taken, and there was no ``threads``; found by a tester."""
    _refused(tmp_path, _checkpoint(tmp_path / "src"), message, scheme="W8A8", **kwargs)


def test_overwrite_given_as_a_string_keeps_an_existing_output(tmp_path):
    """``overwrite="no"`` replaced the output of an earlier run; found by a tester."""
    source = _checkpoint(tmp_path / "src")
    model_free_ptq(source, tmp_path / "out", scheme="W8A8", ignore=["lm_head"], progress=False)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with pytest.raises(ValueError) as info:
        model_free_ptq(source, tmp_path / "out", scheme="FP8_DYNAMIC", progress=False, overwrite="no")
    assert str(info.value) == "model_free_ptq: overwrite (--overwrite) must be True or False, got 'no'"
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


def test_threads_sets_torchs_threads_during_the_call_and_puts_them_back(tmp_path, monkeypatch):
    """docs/oneshot.md said ``--threads`` works as oneshot's, and the Python API had no ``threads``; found by a
    tester."""
    seen = []
    write = model_free_module._write

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return write(*args, **kwargs)

    monkeypatch.setattr(model_free_module, "_write", recording)
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    try:
        model_free_ptq(_checkpoint(tmp_path / "src"), tmp_path / "out", scheme="W8A8", progress=False, threads=want)
        assert seen == [want]
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- a tied head
@pytest.mark.parametrize("pattern", ["lm_head", "re:.*lm_head"])
def test_a_tied_head_named_in_ignore_gets_a_line_saying_it_is_tied_not_matches_no_module(tmp_path, caplog, pattern):
    """``ignore=['lm_head']`` on a tie_word_embeddings checkpoint (as llm-compressor's qwen3_fp8_block.py example
    writes it) warned "ignore pattern 'lm_head' matches no module (check the spelling ...)"; found by a tester."""
    source = _checkpoint(tmp_path / "src", tied=True)
    assert "lm_head.weight" not in _tensors(source)
    with caplog.at_level(logging.INFO):
        model_free_ptq(source, tmp_path / "out", scheme="W8A8", ignore=[pattern], progress=False)
    assert "matches no module" not in caplog.text
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model_free_ptq: ignore")]
    assert lines == [
        f"model_free_ptq: ignore {pattern!r}: the output head lm_head is tied to the input embedding "
        "model.embed_tokens and has no weight of its own in the checkpoint: nothing to keep dense"
    ]
    assert len([k for k in _tensors(tmp_path / "out") if k.endswith(".weight_scale")]) == 14


def test_without_ignore_a_tied_head_is_not_said_to_be_kept_dense(tmp_path, caplog):
    """With no ignore on a tied checkpoint the line said lm_head is kept dense and that llm-compressor's empty
    default "quantizes lm_head too": there is no lm_head weight (llm-compressor quantizes embed_tokens); found by a
    tester."""
    source = _checkpoint(tmp_path / "src", tied=True)
    with caplog.at_level(logging.INFO):
        model_free_ptq(source, tmp_path / "out", scheme="W8A8", progress=False)
    assert "quantizes lm_head too" not in caplog.text and "matches no module" not in caplog.text
    lines = [r.getMessage() for r in caplog.records if " ignore" in r.getMessage()]
    assert lines == [
        "model_free_ptq: no ignore given: nothing to keep dense: the output head lm_head is tied to the input "
        "embedding model.embed_tokens and has no weight of its own in the checkpoint (the embedding is no Linear: "
        "left as stored; llm-compressor's empty default ignore quantizes model.embed_tokens)"
    ]
    tensors = _tensors(tmp_path / "out")
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert "model.embed_tokens.weight_scale" not in tensors
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["lm_head"]


# --------------------------------------------------------------------------- PyTorch weights
def test_a_bin_shard_named_in_the_index_is_reported_as_pytorch_weights_not_a_corrupt_file(tmp_path):
    """A ``.bin`` shard in model.safetensors.index.json was reported as "not a valid safetensors file (... header
    too large); it is probably truncated or corrupt"; found by a tester."""
    source = tmp_path / "src"
    llama(hidden=64, kv_heads=4, tied=False).to(torch.bfloat16).save_pretrained(source, max_shard_size="60KB")
    index_path = source / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    torch.save(load_file(source / last), source / "pytorch_model-00009.bin")
    (source / last).unlink()
    index["weight_map"] = {k: "pytorch_model-00009.bin" if v == last else v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    message = (
        "model_free_ptq: pytorch_model-00009.bin (named in model.safetensors.index.json) holds PyTorch weights "
        "(torch.save's zip / pickle), not safetensors: model-free reads only safetensors files; save the model as "
        "safetensors first (transformers: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR) writes "
        "safetensors) and run model-free on NEW_DIR"
    )
    _refused(tmp_path, source, message, scheme="W8A8")


def test_a_checkpoint_of_pytorch_weights_only_is_told_to_convert(tmp_path):
    """A ``pytorch_model.bin`` checkpoint was told only that no .safetensors file was found; found by a tester."""
    source = tmp_path / "src"
    source.mkdir()
    model = llama(hidden=64, kv_heads=4)
    model.config.save_pretrained(source)
    torch.save(model.state_dict(), source / "pytorch_model.bin")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(FileNotFoundError) as info:
        model_free_ptq(source, tmp_path / "out", scheme="W8A8", progress=False)
    assert str(info.value) == (
        "model_free_ptq: the checkpoint needs model.safetensors.index.json or exactly one .safetensors file at its "
        "top level (found: none); pytorch_model.bin: PyTorch weights (torch.save's zip / pickle), not safetensors: "
        "model-free reads only safetensors files; save the model as safetensors first (transformers: "
        "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR) writes safetensors) and run model-free on "
        "NEW_DIR"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before
