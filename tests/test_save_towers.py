"""Saving: a vision-language model whose vision tower is quantized too (not ignored; the tower's Linears are
initialised on reload by the tower's own ``_init_weights``, SigLIP's reads every Linear's ``weight``), and the saved
config groups' targets (the recipe's where they select exactly what was quantized, as llm-compressor writes them)."""

from __future__ import annotations

import json
import logging

import torch
import transformers
from tiny_families import build
from tiny_llama import llama

import llmc_fsm

TOWER = "model.vision_tower."


def _image_batch():
    """Two rows of 12 tokens, each with Gemma 3's 4 image tokens (id 5) at 2..5, and their 16x16 images."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(8, 128, (2, 12), generator=gen)
    ids[:, 2:6] = 5
    token_type_ids = (ids == 5).long()
    pixel_values = torch.randn(2, 3, 16, 16, generator=gen)
    return {"input_ids": ids, "token_type_ids": token_type_ids, "pixel_values": pixel_values}


def _quantize_all(tmp_path, scheme, dtype=torch.float32):
    model = build("gemma3_vlm").to(dtype)
    recipe = {"s": {"QuantizationModifier": {"targets": ["Linear"], "scheme": scheme, "ignore": ["lm_head"]}}}
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, recipe=recipe, output_dir=out, progress=False)
    return model, out


def test_a_quantized_siglip_tower_of_gemma3_is_saved_unpacked_and_reloads_with_the_in_memory_logits(tmp_path):
    """Found by a tester: W4A16 over Gemma 3's SigLIP tower saved the tower packed (``weight_packed``), and
    ``Gemma3ForConditionalGeneration.from_pretrained`` failed (``'Linear' object has no attribute 'weight'``): the
    check for an initialisation that reads ``weight`` ran the root's ``_init_weights``, while transformers runs the
    tower's (``SiglipPreTrainedModel``) on the tower's modules."""
    model, out = _quantize_all(tmp_path, {"preset": "W4A16", "weights": {"group_size": 16}})
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    formats = {g["format"]: sorted({t.startswith(TOWER) for t in g["targets"]}) for g in groups.values()}
    assert formats == {"int-quantized": [True], "pack-quantized": [False]}
    reloaded, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    reloaded.eval()
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    quantized = {n for n, m in reloaded.named_modules() if hasattr(m, "quantization_scheme")}
    tower = {n for n, m in model.named_modules() if n.startswith(TOWER) and isinstance(m, torch.nn.Linear)}
    assert tower and tower <= quantized
    batch = _image_batch()
    with torch.no_grad():
        expected, got = model(**batch).logits, reloaded(**batch).logits
        towers = [m.model.vision_tower(batch["pixel_values"]).last_hidden_state for m in (model, reloaded)]
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(towers[1], towers[0], rtol=0, atol=1e-5)


def test_nvfp4_over_gemma3s_siglip_tower_warns_that_transformers_cannot_reload_it(tmp_path, caplog):
    """Found by a tester: NVFP4A16 over Gemma 3's SigLIP tower (no unpacked format holds FP4 values) saved a
    checkpoint transformers cannot reload, without a word: the tower's ``_init_weights`` was not probed."""
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.output.save"):
        _, out = _quantize_all(tmp_path, "NVFP4A16", torch.bfloat16)
    warned = [r.getMessage() for r in caplog.records if r.name == "llmc_fsm.output.save"]
    assert warned == [
        "39 modules (e.g. model.vision_tower.encoder.layers.0.self_attn.k_proj) are saved in a packed FP4/FP6 "
        "format (no other format holds those values): transformers 5.25 cannot reload them (this architecture's "
        "weight initialisation reads their weight, which a packed module has not); vLLM reads them"
    ]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert ([g["targets"] for g in config["config_groups"].values()], config["ignore"]) == ([["Linear"]], ["lm_head"])


W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
W4G16 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}


def _save(tmp_path, recipe):
    model = llama()
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, recipe=recipe, output_dir=out, progress=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    quantized = {n: m.quantization_scheme.weights.num_bits for n, m in reloaded.named_modules()
                 if hasattr(m, "quantization_scheme")}
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)
    return config, quantized


def test_config_groups_keep_the_recipes_re_targets_where_they_select_exactly_the_quantized_modules(tmp_path):
    """Found by a tester: two config groups (``re:.*self_attn.*`` int8, ``re:.*mlp.*`` int4) were saved with each
    group's targets replaced by the names of its modules; llm-compressor keeps the recipe's targets, which select
    the same modules on reload."""
    groups = {"attn": {"targets": ["re:.*self_attn.*"], "weights": W8},
              "mlp": {"targets": ["re:.*mlp.*"], "weights": W4G16}}
    modifier = {"ignore": ["lm_head"], "config_groups": groups}
    config, quantized = _save(tmp_path, {"q": {"QuantizationModifier": modifier}})
    assert [g["targets"] for g in config["config_groups"].values()] == [["re:.*self_attn.*"], ["re:.*mlp.*"]]
    assert config["ignore"] == ["lm_head"]
    assert quantized == {f"model.layers.{i}.{p}": 8 if p.startswith("self_attn") else 4 for i in range(2)
                         for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def test_overlapping_config_group_targets_are_saved_as_module_names(tmp_path):
    """Targets two modifiers' groups share (``Linear`` int8 with ``re:.*mlp.*`` ignored, then ``re:.*mlp.*`` int4:
    an MLP Linear matches both groups' targets, the first modifier's ignore is not in the config) are not kept:
    each group names its modules, so that the reload quantizes each module with its own scheme."""
    first = {"targets": ["Linear"], "ignore": ["lm_head", "re:.*mlp.*"], "scheme": {"weights": W8}}
    second = {"targets": ["re:.*mlp.*"], "scheme": {"weights": W4G16}}
    config, quantized = _save(tmp_path, {"a": {"QuantizationModifier": first}, "b": {"QuantizationModifier": second}})
    mlp = sorted(f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down"))
    attention = sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo")
    assert sorted(sorted(g["targets"]) for g in config["config_groups"].values()) == sorted([attention, mlp])
    assert quantized == {**{n: 8 for n in attention}, **{n: 4 for n in mlp}}


def test_a_kept_re_target_that_also_matches_an_ignored_tower_reloads_with_the_tower_unquantized(tmp_path):
    """``re:.*self_attn.*`` kept as the saved target also matches the ignored SigLIP tower's attention Linears;
    compressed-tensors lists those under ``ignore`` by their checkpoint names (``vision_tower.…``), while
    transformers applies the config to the reloaded model's names (``model.vision_tower.…``): they are listed under
    those too, else the reload quantizes the tower's attention."""
    source = tmp_path / "model"
    model = build("gemma3_vlm")
    model.save_pretrained(source)
    recipe = {"q": {"QuantizationModifier": {"targets": ["re:.*self_attn.*"], "scheme": {"weights": W8},
                                             "ignore": ["re:.*vision_tower.*"]}}}
    out = tmp_path / "out"
    compressed = llmc_fsm.oneshot(model=source, recipe=recipe, output_dir=out, progress=False).eval()
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert [g["targets"] for g in config["config_groups"].values()] == [["re:.*self_attn.*"]]
    q_proj = "vision_tower.encoder.layers.0.self_attn.q_proj"
    assert (q_proj in config["ignore"], f"model.{q_proj}" in config["ignore"]) == (True, True)
    reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(out).eval()
    quantized = {n for n, m in reloaded.named_modules() if hasattr(m, "quantization_scheme")}
    assert quantized == {f"model.language_model.layers.{i}.self_attn.{p}_proj" for i in range(4) for p in "qkvo"}
    batch = _image_batch()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, compressed(**batch).logits, rtol=0, atol=1e-5)


def test_model_free_saves_gemma3s_quantized_siglip_tower_unpacked_as_oneshot_does(tmp_path):
    """Found by a tester: ``model_free_ptq`` W4A16 over Gemma 3's SigLIP tower packed it and the output did not
    reload (``'Linear' object has no attribute 'weight'``), nor did NVFP4A16's warn: the initialisation probe looked
    the checkpoint's names (``vision_tower.encoder...``) up in the model, whose tower is ``model.vision_tower...``.
    The names are now renamed as ``from_pretrained`` renames them: the tower is saved unpacked, the same tensors as
    ``oneshot``'s, and the output reloads."""
    from safetensors.torch import load_file

    from llmc_fsm import model_free_ptq

    model = build("gemma3_vlm")
    model.save_pretrained(tmp_path / "src")
    scheme = {"preset": "W4A16", "weights": {"group_size": 16}}
    model_free_ptq(tmp_path / "src", tmp_path / "free", scheme=scheme, progress=False)
    recipe = {"s": {"QuantizationModifier": {"targets": ["Linear"], "scheme": scheme, "ignore": ["lm_head"]}}}
    llmc_fsm.oneshot(model=str(tmp_path / "src"), recipe=recipe, output_dir=tmp_path / "one", progress=False)
    free, one = load_file(tmp_path / "free" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert free.keys() == one.keys() and all(torch.equal(free[k], one[k]) for k in free)
    tower = sorted(k for k in free if k.startswith("vision_tower.") and k.endswith("fc1.weight"))
    assert tower and all(free[k].dtype == torch.int8 for k in tower)  # int-quantized: the codes under weight
    configs = [json.loads((tmp_path / d / "config.json").read_text())["quantization_config"] for d in ("free", "one")]
    groups = [sorted(sorted(g["targets"]) for g in c["config_groups"].values()) for c in configs]
    assert groups[0] == groups[1] and any(t.startswith(TOWER) for g in groups[0] for t in g)  # the model's names
    reloaded, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        tmp_path / "free", output_loading_info=True
    )
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
