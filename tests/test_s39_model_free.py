"""model_free_ptq / llmc-fsm model-free: found by testers (session 39).

An ``ignore`` written in the model's names (``re:model.visual.*``) means the same modules as in ``oneshot`` where the
checkpoint names them otherwise (transformers 5.25 saves Qwen2.5-VL's vision tower as ``visual.blocks...``); the 2-D
weights of modules that are not ``nn.Linear`` (MoE routers), which llm-compressor's model_free_ptq quantizes, get one
line; the ``ignore`` entries given stay in ``config.json``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

from llmc_fsm import model_free_ptq, oneshot

_MODEL_FREE = "llmc_fsm.oneshot_job.model_free"


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _qwen2_5_vl(directory: Path) -> Path:
    """A tiny Qwen2.5-VL (2 text layers, 2 vision blocks), saved as transformers saves it: ``visual.blocks...``,
    ``model.layers...`` in the checkpoint, ``model.visual.blocks...``, ``model.language_model.layers...`` in memory."""
    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}}  # fmt: skip
    vision = {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "patch_size": 8,
              "spatial_merge_size": 2, "out_hidden_size": 64, "fullatt_block_indexes": [1],
              "window_size": 16}  # fmt: skip
    config = transformers.AutoConfig.for_model("qwen2_5_vl", text_config=text, vision_config=vision, vocab_size=128,
                                               image_token_id=5, video_token_id=6, vision_start_token_id=7)  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def _scales(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale"))


def test_a_re_ignore_in_the_models_names_keeps_the_vision_tower_dense_as_oneshot_does(tmp_path, caplog):
    """ignore [lm_head, re:model.visual.blocks.*, model.visual.merger.mlp.0] (oneshot's names): before, the pattern
    was said to match no module (check the spelling) and all vision blocks were quantized, and the exact name, though
    kept dense, was said to match no module too (found by a tester); now both keep the same modules dense as oneshot,
    the recipe keeps the entries as given, and one INFO line names the checkpoint's spelling."""
    source = _qwen2_5_vl(tmp_path / "src")
    ignore = ["lm_head", "re:model.visual.blocks.*", "model.visual.merger.mlp.0"]
    with caplog.at_level(logging.INFO, logger=_MODEL_FREE):  # and the warnings of every logger
        model_free_ptq(source, tmp_path / "free", scheme="FP8_DYNAMIC", ignore=ignore, progress=False)
    recipe = {"stage": {"QuantizationModifier": {"targets": ["Linear"], "scheme": "FP8_DYNAMIC", "ignore": ignore}}}
    oneshot(model=str(source), recipe=recipe, output_dir=str(tmp_path / "oneshot"), dtype=torch.bfloat16)
    free = _tensors(tmp_path / "free")
    assert [k for k in _scales(free) if "visual" in k] == ["visual.merger.mlp.2"]
    assert len(_scales(free)) == 15  # 7 Linears in each of the 2 text layers and the merger's second Linear
    reference = _tensors(tmp_path / "oneshot")  # saved under the same checkpoint names
    assert _scales(free) == _scales(reference)
    assert all(torch.equal(free[k], reference[k]) for k in free)
    assert "matches no module" not in caplog.text
    messages = [r.getMessage() for r in caplog.records if r.name == _MODEL_FREE and "model's names" in r.getMessage()]
    assert messages == [
        "model_free_ptq: ignore 're:model.visual.blocks.*' names modules by the model's names; the checkpoint names "
        "its Linears visual.blocks.{0..1}.attn.proj, visual.blocks.{0..1}.attn.qkv, "
        "visual.blocks.{0..1}.mlp.down_proj, visual.blocks.{0..1}.mlp.gate_proj, visual.blocks.{0..1}.mlp.up_proj: "
        "kept dense, as oneshot keeps them",
        "model_free_ptq: ignore 'model.visual.merger.mlp.0' names modules by the model's names; the checkpoint names "
        "its Linears visual.merger.mlp.0: kept dense, as oneshot keeps them",
    ]
    recipe_text = (tmp_path / "free" / "recipe.yaml").read_text()
    assert "- re:model.visual.blocks.*" in recipe_text and "- model.visual.merger.mlp.0" in recipe_text
    reloaded = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "free").eval()
    vision = [n for n, m in reloaded.named_modules() if "visual" in n and hasattr(m, "quantization_scheme")]
    assert vision == ["model.visual.merger.mlp.2"]


def test_an_ignored_container_in_the_models_names_keeps_the_modules_in_it_dense_as_oneshot_does(tmp_path, caplog):
    """ignore [lm_head, model.visual]: oneshot keeps every module in the container dense; model-free said the name
    matches no module and quantized the vision tower (checkpoint: visual.blocks...), as a tester found for re:."""
    source = _qwen2_5_vl(tmp_path / "src")
    ignore = ["lm_head", "model.visual"]
    with caplog.at_level(logging.WARNING):
        model_free_ptq(source, tmp_path / "free", scheme="FP8_DYNAMIC", ignore=ignore, progress=False)
    recipe = {"stage": {"QuantizationModifier": {"targets": ["Linear"], "scheme": "FP8_DYNAMIC", "ignore": ignore}}}
    oneshot(model=str(source), recipe=recipe, output_dir=str(tmp_path / "oneshot"), dtype=torch.bfloat16)
    free, reference = _tensors(tmp_path / "free"), _tensors(tmp_path / "oneshot")
    assert [k for k in _scales(free) if "visual" in k] == []
    assert _scales(free) == _scales(reference) and len(_scales(free)) == 14
    assert "matches no module" not in caplog.text


def test_a_router_left_dense_gets_one_line_saying_llm_compressor_would_quantize_it(tmp_path, caplog):
    """llm-compressor's example ignore [model.embed_tokens, lm_head] on a Qwen3-MoE: llm-compressor 0.14 writes the
    routers mlp.gate (2-D weights of Qwen3MoeTopKRouter) quantized; llmc-fsm leaves them as stored, which is right
    (transformers does not reload them quantized), but said nothing (found by a tester)."""
    import tiny_families

    tiny_families.build("qwen3_moe").to(torch.bfloat16).save_pretrained(tmp_path / "src")
    with caplog.at_level(logging.INFO, logger=_MODEL_FREE):
        model_free_ptq(tmp_path / "src", tmp_path / "free", scheme="FP8_DYNAMIC",
                       ignore=["model.embed_tokens", "lm_head"], progress=False)  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.name == _MODEL_FREE and "2-D weights" in r.getMessage()]
    assert lines == [
        "model_free_ptq: 2-D weights of modules that are not nn.Linear are left as stored: "
        "model.layers.{0..3}.mlp.gate (Qwen3MoeTopKRouter); llm-compressor's model_free_ptq quantizes every 2-D "
        "weight its ignore does not name, but transformers does not reload these classes quantized, and vLLM keeps "
        "embeddings and MoE routers dense"
    ]
    free, source = _tensors(tmp_path / "free"), _tensors(tmp_path / "src")
    assert [k for k in free if ".mlp.gate." in k] == [f"model.layers.{i}.mlp.gate.weight" for i in range(4)]
    assert all(torch.equal(free[k], source[k]) for k in free if ".mlp.gate." in k)


def test_the_names_given_in_ignore_stay_in_the_configs_ignore_list(tmp_path):
    """model.embed_tokens (no Linear weight) disappeared from config.json's ignore, which listed only lm_head, while
    llm-compressor keeps the list given (found by a tester); the exact names given (a config's first) are kept, not
    re: patterns (a later model-free run on the output could not quantize what they match)."""
    import tiny_families
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import FP8_DYNAMIC

    tiny_families.build("qwen3_moe").to(torch.bfloat16).save_pretrained(tmp_path / "src")
    model_free_ptq(tmp_path / "src", tmp_path / "free", scheme="FP8_DYNAMIC",
                   ignore=["model.embed_tokens", "lm_head", "re:.*mlp.gate$"], progress=False)  # fmt: skip
    config = json.loads((tmp_path / "free" / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["lm_head", "model.embed_tokens"]
    group = QuantizationScheme(targets=["Linear"], **FP8_DYNAMIC)
    given = QuantizationConfig(config_groups={"group_0": group}, ignore=["model.embed_tokens"])
    model_free_ptq(tmp_path / "src", tmp_path / "config", config=given, ignore=["lm_head"], progress=False)
    config = json.loads((tmp_path / "config" / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["lm_head", "model.embed_tokens"]
