"""``oneshot(dtype=...)`` / ``--dtype``: the dtype a model directory is loaded, quantized and saved in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_quant_models import tiny_llama
from transformers import AutoModelForCausalLM

import llmc_fsm
from llmc_fsm.cli import main

RECIPE = {"q": {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}}}}
DATA = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))


def _bf16_dir(root: Path) -> Path:
    directory = root / "bf16"
    tiny_llama().to(torch.bfloat16).save_pretrained(directory)
    return directory


def _saved_dtypes(out: Path) -> tuple[str, set[str]]:
    """The config's dtype and those of the floating-point tensors of every shard (the CLI streams by default: a shard
    per decoder layer)."""
    floats: set[str] = set()
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            floats |= {str(f.get_tensor(k).dtype) for k in f.keys() if f.get_tensor(k).is_floating_point()}
    assert floats  # some tensor was read
    return json.loads((out / "config.json").read_text())["dtype"], floats


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_a_bf16_directory_is_quantized_and_saved_in_bf16_with_auto_or_bfloat16(tmp_path, dtype) -> None:
    source, out = _bf16_dir(tmp_path), tmp_path / "out"
    model = llmc_fsm.oneshot(str(source), recipe=RECIPE, dataset=DATA, output_dir=out, progress=False, dtype=dtype)
    assert model.dtype == torch.bfloat16
    assert _saved_dtypes(out) == ("bfloat16", {"torch.bfloat16"})  # weights left unquantized, scales: all bf16
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)


def test_the_default_float32_saves_a_bf16_directory_in_float32(tmp_path) -> None:
    out = tmp_path / "out"
    llmc_fsm.oneshot(str(_bf16_dir(tmp_path)), recipe=RECIPE, dataset=DATA, output_dir=out, progress=False)
    assert _saved_dtypes(out) == ("float32", {"torch.float32"})


def test_low_memory_with_auto_writes_the_in_memory_checkpoint(tmp_path) -> None:
    source = _bf16_dir(tmp_path)
    for name, low in (("mem", False), ("low", True)):
        llmc_fsm.oneshot(str(source), recipe=RECIPE, dataset=DATA, output_dir=tmp_path / name, progress=False,
                         dtype="auto", low_memory=low)
    tensors = {}
    for name in ("mem", "low"):
        tensors[name] = {}
        for file in (tmp_path / name).glob("*.safetensors"):
            with safe_open(str(file), "pt") as f:
                tensors[name].update({k: f.get_tensor(k) for k in f.keys()})
    assert tensors["mem"].keys() == tensors["low"].keys()
    assert all(torch.equal(v, tensors["low"][k]) for k, v in tensors["mem"].items())
    assert json.loads((tmp_path / "low" / "config.json").read_text())["dtype"] == "bfloat16"


def test_bad_dtypes_are_refused_before_any_work(tmp_path) -> None:
    source = _bf16_dir(tmp_path)
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(str(source), recipe=RECIPE, dataset=DATA, output_dir=tmp_path / "o", progress=False,
                         dtype="int8")
    assert str(info.value) == "dtype (--dtype) must be one of float32, bfloat16, float16, auto, got 'int8'"
    model = AutoModelForCausalLM.from_pretrained(source)
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model, recipe=RECIPE, dataset=DATA, progress=False, dtype=torch.float16)
    assert str(info.value) == (  # its own dtype (bfloat16) or 'auto' is taken (session 38)
        "dtype (--dtype) 'float16' applies to a model given as a name or directory; an in-memory model is "
        "compressed and saved in its own dtype (bfloat16): leave dtype out (or give 'auto'), or convert the model "
        "first (e.g. model.to(torch.float16))"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16"]
    assert not any(hasattr(m, "quantization_scheme") for m in model.modules())


def test_cli_dtype(tmp_path, capsys) -> None:
    source = _bf16_dir(tmp_path)
    text = tmp_path / "cal.txt"
    text.write_text(" ".join(f"w{i % 97}" for i in range(4000)))
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(97)} | {"[UNK]": 127}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(source)
    out = tmp_path / "out"
    argv = ["oneshot", "--model", str(source), "--method", "gptq", "--scheme", "W4A16", "--group-size", "16",
            "--dataset", str(text), "--num-samples", "8", "--seq-len", "32", "--output", str(out), "--no-progress"]
    assert main([*argv, "--dtype", "auto"]) == 0
    assert _saved_dtypes(out)[0] == "bfloat16"
