"""model_free_ptq / llmc-fsm model-free: found by a tester (session 40).

``dtype`` leaves the model class's keep-in-float32 tensors (DeepSeek-V3's routers) as stored, as ``oneshot`` loads
them; tensors outside the model built from ``config.json`` (DeepSeek-V3's multi-token-prediction layer) get one
warning, their embedding and head left dense; safetensors files the index does not name (Mistral's
``consolidated.safetensors``) get one line, their ``params.json`` left out; an index that disagrees with its shards is
refused in one line before any work.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import tiny_families
import torch
from safetensors.torch import load_file, save_file
from test_s39_model_free import _tensors

from llmc_fsm import model_free_ptq, oneshot

_MODEL_FREE = "llmc_fsm.oneshot_job.model_free"


def _save(family: str, directory: Path, dtype: torch.dtype, shard: str = "60KB") -> Path:
    model = tiny_families.build(family, tie_word_embeddings=False).to(dtype)
    model.save_pretrained(directory, max_shard_size=shard)
    return directory


def _messages(caplog: pytest.LogCaptureFixture, part: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == _MODEL_FREE and part in r.getMessage()]


def test_dtype_bfloat16_leaves_deepseek_v3_float32_routers_as_stored_as_oneshot_writes_them(tmp_path, caplog):
    """dtype=bfloat16 on a float32 DeepSeek-V3: before, the routers' gate.weight and e_score_correction_bias (the
    class's _keep_in_fp32_modules_strict, which from_pretrained loads in float32 at bfloat16) were written in
    bfloat16, while oneshot(dtype=torch.bfloat16) writes them in float32 (found by a tester); now every tensor has
    oneshot's dtype and value, and one INFO line names them."""
    source = _save("deepseek_v3", tmp_path / "src", torch.float32)
    ignore = ["lm_head", "re:.*mlp.gate$"]
    with caplog.at_level(logging.INFO, logger=_MODEL_FREE):
        model_free_ptq(source, tmp_path / "free", scheme="W8A8", ignore=ignore, dtype="bfloat16", progress=False)
    recipe = {"stage": {"QuantizationModifier": {"targets": ["Linear"], "scheme": "W8A8", "ignore": ignore}}}
    oneshot(model=str(source), recipe=recipe, output_dir=str(tmp_path / "oneshot"), dtype=torch.bfloat16)
    free, reference = _tensors(tmp_path / "free"), _tensors(tmp_path / "oneshot")
    routers = sorted(k for k in free if ".mlp.gate." in k)
    parts = ("e_score_correction_bias", "weight")
    assert routers == [f"model.layers.{i}.mlp.gate.{p}" for i in (1, 2, 3) for p in parts]
    assert {free[k].dtype for k in routers} == {torch.float32}
    assert sorted(free) == sorted(reference)
    assert {k: free[k].dtype for k in free} == {k: reference[k].dtype for k in free}
    assert all(torch.equal(free[k], reference[k]) for k in free)
    assert free["model.layers.1.self_attn.o_proj.weight_scale"].dtype == torch.bfloat16
    assert _messages(caplog, "left as stored (") == [
        "model_free_ptq: dtype bfloat16: model.layers.{1..3}.mlp.gate.e_score_correction_bias, "
        "model.layers.{1..3}.mlp.gate.weight left as stored (float32): transformers loads DeepseekV3ForCausalLM's "
        "e_score_correction_bias, gate.weight in float32 at this dtype (oneshot writes them in float32)"
    ]


def test_mtp_layer_outside_the_model_gets_one_warning_and_its_embedding_and_head_stay_dense(tmp_path, caplog):
    """A DeepSeek-V3 checkpoint with a multi-token-prediction layer (model.layers.4, past num_hidden_layers: the
    model built from config.json has no such layer; from_pretrained, and so oneshot, drops it): before, its 2-D
    weights were quantized by name without a word, embed_tokens and shared_head.head included (found by a tester);
    now the embedding- and head-like ones (by name, or shaped [vocab, hidden]) stay dense, the others are quantized
    by name, and one warning says so."""
    source = _save("deepseek_v3", tmp_path / "src", torch.bfloat16)
    torch.manual_seed(0)
    extra = {
        "model.layers.4.embed_tokens.weight": torch.randn(128, 64),
        "model.layers.4.shared_head.head.weight": torch.randn(128, 64),
        "model.layers.4.vocab_proj.weight": torch.randn(128, 64),  # no head's name, the shape [vocab, hidden]
        "model.layers.4.eh_proj.weight": torch.randn(64, 128),
        "model.layers.4.enorm.weight": torch.ones(64),
    }
    save_file({k: v.to(torch.bfloat16) for k, v in extra.items()}, str(source / "model-mtp.safetensors"))
    index = json.loads((source / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(extra, "model-mtp.safetensors"))
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.INFO, logger=_MODEL_FREE):
        model_free_ptq(source, tmp_path / "free", scheme="W8A8", ignore=["lm_head", "re:.*mlp.gate$"], progress=False)
    mtp = load_file(tmp_path / "free" / "model-mtp.safetensors")
    assert {k: str(v.dtype) for k, v in mtp.items()} == {
        "model.layers.4.embed_tokens.weight": "torch.bfloat16",
        "model.layers.4.shared_head.head.weight": "torch.bfloat16",
        "model.layers.4.vocab_proj.weight": "torch.bfloat16",
        "model.layers.4.eh_proj.weight": "torch.int8",
        "model.layers.4.eh_proj.weight_scale": "torch.bfloat16",
        "model.layers.4.enorm.weight": "torch.bfloat16",
    }
    for name in ("model.layers.4.embed_tokens.weight", "model.layers.4.shared_head.head.weight"):
        assert torch.equal(mtp[name], extra[name].to(torch.bfloat16))
    assert _messages(caplog, "not in the model") == [
        "model_free_ptq: 5 checkpoint tensors are not in the model config.json builds (DeepseekV3ForCausalLM; "
        "transformers' from_pretrained, and so oneshot, drops them; vLLM reads a DeepSeek-V3 / GLM-4.5 "
        "multi-token-prediction layer for speculative decoding): quantized by name as Linear weights: "
        "model.layers.4.eh_proj; kept dense as an embedding or output head (named *embed_tokens, *lm_head or "
        "*shared_head.head, or shaped [vocab, hidden] as the model's embedding): model.layers.4.embed_tokens, "
        "model.layers.4.shared_head.head, model.layers.4.vocab_proj; copied as stored: model.layers.4.enorm.weight"
    ]


def test_unindexed_consolidated_safetensors_get_one_line_and_their_params_json_is_left_out(tmp_path, caplog):
    """A Llama checkpoint with Mistral's consolidated.safetensors and params.json beside the indexed shards, and an
    original/model.safetensors: before, both safetensors files were left out without a word and params.json was
    copied, pointing Mistral-format loaders at weights the output does not hold (found by a tester); now one
    warning names the files left out and params.json, which is left out too."""
    source = _save("llama", tmp_path / "src", torch.float32, shard="40KB")
    weights = {f"layers.{i}.attention.wq.weight": torch.zeros(64, 64) for i in range(2)}
    save_file(weights, str(source / "consolidated.safetensors"))
    (source / "original").mkdir()
    save_file(weights, str(source / "original" / "model.safetensors"))
    (source / "params.json").write_text("{}")
    with caplog.at_level(logging.INFO, logger=_MODEL_FREE):
        model_free_ptq(source, tmp_path / "free", scheme="W8A8", progress=False)
    out = tmp_path / "free"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("model-")) == [
        "config.json", "generation_config.json", "model.safetensors.index.json", "recipe.yaml"]  # fmt: skip
    assert _messages(caplog, "safetensors files") == [
        "model_free_ptq: safetensors files beside the checkpoint read (model.safetensors.index.json and the shards it "
        "names) are neither quantized nor copied to the output: consolidated.safetensors, original/model.safetensors; "
        "params.json (Mistral's config of its consolidated weights) is not copied either: the output is in the "
        "Hugging Face format alone (config.json and the shards)"
    ]


@pytest.mark.parametrize("mode", ["unnamed", "wrong_shard", "in_no_shard"])
def test_index_that_disagrees_with_its_shards_is_refused_in_one_line_before_any_work(tmp_path, mode):
    """An index that leaves out a tensor a shard holds, puts a tensor in the wrong shard, or names one no shard
    holds: before, the first was reported as a tensor missing from the checkpoint ('copy the complete checkpoint'),
    the others failed in compressed-tensors' words without the model_free_ptq prefix (found by a tester); now one
    line says the index and the shards disagree, naming tensor and files, and nothing is written."""
    source = _save("llama", tmp_path / "src", torch.float32, shard="40KB")
    path = source / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    weight_map = index["weight_map"]
    name = "model.layers.1.self_attn.k_proj.weight"
    holder = weight_map[name]
    other = next(s for s in sorted(set(weight_map.values())) if s != holder)
    index_name = "model.safetensors.index.json"
    if mode == "unnamed":
        del weight_map[name]
        problem = f"{holder} holds {name}, which {index_name} does not name"
    elif mode == "wrong_shard":
        weight_map[name] = other
        problem = f"{index_name} puts {name} in {other}, it is in {holder}"
    else:
        weight_map["model.layers.1.self_attn.ghost.weight"] = holder
        problem = f"{index_name} puts model.layers.1.self_attn.ghost.weight in {holder}, no shard holds it"
    path.write_text(json.dumps(index))
    with pytest.raises(ValueError) as err:
        model_free_ptq(source, tmp_path / "free", scheme="W8A8", progress=False)
    assert str(err.value) == (
        f"model_free_ptq: {index_name} and the shards disagree: {problem}; nothing was written: fix the index's "
        "weight_map, or copy the checkpoint again"
    )
    assert not (tmp_path / "free").exists()
    shutil.rmtree(source)
