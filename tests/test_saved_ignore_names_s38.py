"""Session 38: the ``ignore`` of a saved ``quantization_config`` names each unquantized module both as transformers
names it and as its weight is saved (found by a tester: a Mixtral built from its config listed ``mlp.gate`` while its
tensors are ``block_sparse_moe.gate.weight``; one loaded with ``from_pretrained`` listed only the saved names)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_families import build

import llmc_fsm

pytest.importorskip("transformers")

RECIPE = {"s": {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
BOTH = [
    name
    for i in range(4)
    for name in (f"model.layers.{i}.mlp.gate", f"model.layers.{i}.block_sparse_moe.gate")
]


def saved(out: Path) -> tuple[list[str], set[str]]:
    keys: set[str] = set()
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            keys |= set(f.keys())
    return json.loads((out / "config.json").read_text())["quantization_config"]["ignore"], keys


def test_a_built_and_a_loaded_mixtral_list_their_routers_under_both_names(tmp_path):
    from transformers import AutoModelForCausalLM

    built = build("mixtral")
    built.save_pretrained(tmp_path / "src")
    llmc_fsm.oneshot(model=built, recipe=RECIPE, output_dir=tmp_path / "built", progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    llmc_fsm.oneshot(model=loaded, recipe=RECIPE, output_dir=tmp_path / "loaded", progress=False)
    ignore, keys = saved(tmp_path / "built")
    assert ignore == [*BOTH, "lm_head"]  # compressed-tensors' module names, each followed by its saved name
    assert saved(tmp_path / "loaded")[0] == [  # compressed-tensors' saved names, each followed by the module's
        *(name for i in range(4) for name in (f"model.layers.{i}.block_sparse_moe.gate", f"model.layers.{i}.mlp.gate")),
        "lm_head",
    ]
    routers = sorted(k.removesuffix(".weight") for k in keys if k.endswith("gate.weight"))
    assert routers == [f"model.layers.{i}.block_sparse_moe.gate" for i in range(4)]  # the names on disk
    for name in ignore:  # each a module of the model transformers reloads, or a tensor name of the file
        assert name in dict(built.named_modules()) or f"{name}.weight" in keys, name
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "built")
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(reloaded(input_ids=ids).logits, built(input_ids=ids).logits)


def test_a_vision_tower_is_listed_under_the_names_of_its_saved_tensors_too(tmp_path):
    model = build("llava")
    ignore = ["lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*"]
    recipe = {"s": {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "ignore": ignore}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, output_dir=tmp_path / "out", progress=False)
    ignore, keys = saved(tmp_path / "out")
    modules = dict(model.named_modules())
    tower = [n for n, m in modules.items() if n.startswith("model.vision_tower.") and isinstance(m, torch.nn.Linear)]
    assert tower and all(n in ignore for n in tower)
    on_disk = {k.removesuffix(".weight") for k in keys if k.startswith("vision_tower.") and k.endswith(".weight")}
    assert {n for n in ignore if n.startswith("vision_tower.")} == {
        n for n in on_disk if isinstance(modules.get("model." + n), torch.nn.Linear)
    }
