"""The saved ``recipe.yaml`` records every argument a modifier ran with, ``null``s included (issue 22), and reads back
to modifiers with equal arguments (``Recipe.to_dict`` / ``to_yaml``, the one place a recipe is written)."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import tiny_llama
import yaml

pytest.importorskip("llmc_fsm_quantization")
pytest.importorskip("llmc_fsm_pruning")

from llmc_fsm.cli import main
from llmc_fsm.core.registry import get_registry
from llmc_fsm.recipes.building import given_arguments, resolve_recipe
from llmc_fsm.recipes.history import merge_saved_recipe
from llmc_fsm.recipes.model import Recipe, Stage


def _arguments(modifier: Any) -> dict[str, Any]:
    """Every init argument of ``modifier`` by recipe name, with its value (schedule fields included)."""
    return {f.alias: getattr(modifier, f.name) for f in attrs.fields(type(modifier)) if f.init}


#: AutoRoundModifier given only a scheme and iters: what its saved recipe.yaml holds (the values ``explain`` shows).
AUTOROUND_SAVED = {
    "q": {
        "modifiers": [
            {
                "AutoRoundModifier": {
                    "targets": ["Linear"],
                    "scheme": "W4A16",
                    "config_groups": None,
                    "observer": "minmax",
                    "input_observer": None,
                    "ignore": ["lm_head"],
                    "kv_cache_scheme": None,
                    "calibrate_all_experts": False,
                    "iters": 2,
                    "lr": None,
                    "batch_size": 8,
                    "enable_torch_compile": True,
                    "disable_opt_rtn": False,
                    "device_ids": None,
                }
            }
        ],
        "applied": True,
    }
}


def test_an_autoround_stage_is_saved_with_every_argument_nulls_included() -> None:
    recipe = resolve_recipe("q:\n  AutoRoundModifier: {scheme: W4A16, iters: 2}\n")
    assert recipe.to_dict(applied=True) == AUTOROUND_SAVED
    text = recipe.to_yaml(applied=True)
    assert "      lr: null\n" in text and "      device_ids: null\n" in text
    assert yaml.safe_load(text) == AUTOROUND_SAVED
    (original,) = recipe.stages[0].modifiers
    (read_back,) = resolve_recipe(text).stages[0].modifiers
    assert _arguments(read_back) == _arguments(original)
    # every argument is now given by the recipe: explain marks none of them "(default)"
    assert given_arguments(read_back) == frozenset(AUTOROUND_SAVED["q"]["modifiers"][0]["AutoRoundModifier"])


#: One instance per registered modifier (with the arguments it requires), for the round trip below.
_REQUIRED = {
    "LearningRateModifier": {"init_lr": 0.1},
    "MagnitudePruningModifier": {"sparsity": 0.5},
    "REAPPruningModifier": {"sparsity": 0.5},
}


@pytest.mark.parametrize("name", sorted(info.name for info in get_registry().infos()))
def test_every_modifier_reads_back_from_its_saved_recipe_with_equal_arguments(name: str) -> None:
    modifier = get_registry().get(name)(**_REQUIRED.get(name, {}))
    recipe = Recipe([Stage("s", [modifier])], "<objects>")
    written = recipe.to_dict(applied=True)["s"]["modifiers"][0][name]
    nulls = {f.alias for f in attrs.fields(type(modifier)) if f.init and getattr(modifier, f.name) is None}
    assert {key for key, value in written.items() if value is None} == nulls - {"start", "end", "update"}
    assert set(written) == set(_arguments(modifier)) - ({"start", "end", "update"} & nulls)
    (read_back,) = resolve_recipe(recipe.to_yaml(applied=True)).stages[0].modifiers
    assert type(read_back) is type(modifier)
    assert _arguments(read_back) == _arguments(modifier)
    assert Recipe([Stage("s", [read_back])], "<text>").to_dict(applied=True) == recipe.to_dict(applied=True)


def test_a_set_schedule_is_written_and_an_unset_one_left_out() -> None:
    recipe = resolve_recipe(
        "s:\n  MagnitudePruningModifier: {init_sparsity: 0.1, final_sparsity: 0.5, start: 0, end: 2, update: 1}\n"
    )
    written = recipe.to_dict()["s"]["modifiers"][0]["MagnitudePruningModifier"]
    assert (written["start"], written["end"], written["update"]) == (0.0, 2.0, 1.0)
    assert written["sparsity"] is None
    unset = resolve_recipe("s:\n  MagnitudePruningModifier: {sparsity: 0.5}\n").to_dict()["s"]["modifiers"][0]
    assert {"start", "end", "update"}.isdisjoint(unset["MagnitudePruningModifier"])
    assert unset["MagnitudePruningModifier"]["init_sparsity"] is None


def test_a_recipe_saved_without_its_nulls_still_counts_as_the_same_settings(tmp_path) -> None:
    # outputs written before the nulls were recorded: the same recipe is recognised as already applied
    old = (
        "q:\n  modifiers:\n  - AutoRoundModifier:\n      targets: [Linear]\n      scheme: W4A16\n      observer: "
        "minmax\n      ignore: [lm_head]\n      calibrate_all_experts: false\n      iters: 2\n      batch_size: 8\n"
        "      enable_torch_compile: true\n      disable_opt_rtn: false\n  applied: true\n"
    )
    (tmp_path / "recipe.yaml").write_text(old)
    merged = merge_saved_recipe(resolve_recipe("q:\n  AutoRoundModifier: {scheme: W4A16, iters: 2}\n"), tmp_path)
    assert [(stage.name, stage.applied) for stage in merged.stages] == [("q", True)]
    assert merged.to_dict() == AUTOROUND_SAVED


def test_the_cli_saves_the_nulls_and_its_recipe_yaml_runs_again_to_the_same_output(tmp_path, capsys) -> None:
    model, text = tiny_llama.build_with_text(tmp_path)
    out = tmp_path / "out"
    argv = tiny_llama.oneshot_argv(model, text, out, "--method", "gptq", "--group-size", "64")
    assert main(argv) == 0
    saved = yaml.safe_load((out / "recipe.yaml").read_text())
    assert saved == {
        "quantization_stage": {
            "modifiers": [
                {
                    "GPTQModifier": {
                        "targets": ["Linear"],
                        "scheme": {"preset": "W4A16", "weights": {"group_size": 64}},
                        "config_groups": None,
                        "observer": "minmax",
                        "input_observer": None,
                        "ignore": ["lm_head"],
                        "kv_cache_scheme": None,
                        "calibrate_all_experts": False,
                        "block_size": 128,
                        "dampening_frac": 0.01,
                        "actorder": "static",
                    }
                }
            ],
            "applied": True,
        }
    }
    assert json.loads((out / "report.json").read_text())["recipe"] == saved
    # the saved recipe, its stage marked not applied, given back with --recipe: the same run, the same output
    again = tmp_path / "again.yaml"
    saved["quantization_stage"]["applied"] = False
    again.write_text(yaml.safe_dump(saved, sort_keys=False))
    out2 = tmp_path / "out2"
    assert main(tiny_llama.oneshot_argv(model, text, out2, "--recipe", str(again))) == 0
    capsys.readouterr()
    assert (out2 / "recipe.yaml").read_text() == (out / "recipe.yaml").read_text()
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in out2.glob("*.safetensors"))
    assert all((out / name).read_bytes() == (out2 / name).read_bytes() for name in shards)
