"""Session 39 fixes (d): resume refusals that named no real change, and the saved global sparsity."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import tiny_llama
import torch
from safetensors.torch import load_file
from test_resume_inputs import stopped_after_layer

import llmc_fsm
from llmc_fsm.cli import main
from llmc_fsm.output.workdir import fingerprint_changes

pytest.importorskip("transformers")

W4A16 = """quant_stage:
  quant_modifiers:
    GPTQModifier: {ignore: [lm_head], scheme: {preset: W4A16, weights: {group_size: 32}}}
"""


def _argv(tiny_model_dir, out, *extra):
    model, text = tiny_model_dir
    return tiny_llama.oneshot_argv(model, text, out, "--num-samples", "8", "--batch-size", "4", *extra)


def _interrupted_cli(monkeypatch, argv, layer: int = 1) -> None:
    """``llmc-fsm ARGV`` stopped by Ctrl-C right after decoder layer ``layer`` is saved."""
    with stopped_after_layer(monkeypatch, layer):
        try:
            assert main(argv) != 0
        except KeyboardInterrupt:
            pass  # main may let it through: the progress is kept either way


def _tensors(directory):
    """Every tensor of the checkpoint in ``directory`` (its shards together)."""
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_a_one_stage_run_resumed_with_fuse_stages_equals_an_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch,
                                                                            caplog):
    """Found by a tester: a one-stage GPTQ run killed after layer 1, resumed with ``--fuse-stages``, was refused
    "pipeline (fuse_stages False -> True) — changed since that run", though one stage runs in one pass either way.
    It resumes now, says the flag makes no difference, and writes the uninterrupted run's tensors bit for bit."""
    recipe = tmp_path / "w4a16.yaml"
    recipe.write_text(W4A16)
    assert main(_argv(tiny_model_dir, tmp_path / "whole", "--recipe", str(recipe))) == 0
    out = tmp_path / "out"
    _interrupted_cli(monkeypatch, _argv(tiny_model_dir, out, "--recipe", str(recipe)))
    assert sorted(p.name for p in (tmp_path / ".out.work" / "progress" / "pass-0").iterdir()) == [
        "layer-00000.safetensors", "layer-00001.safetensors"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.output.workdir"):
        assert main(_argv(tiny_model_dir, out, "--recipe", str(recipe), "--resume", "--fuse-stages")) == 0
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming from")] == [
        f"resuming from {tmp_path / '.out.work'} (2 of 4 decoder layers done; fuse_stages False -> True makes no "
        "difference here: one stage to run)"
    ]
    whole, resumed = _tensors(tmp_path / "whole"), _tensors(out)
    assert sorted(whole) == sorted(resumed) and len(whole) > 4 * 7
    assert all(torch.equal(whole[k], resumed[k]) and whole[k].dtype == resumed[k].dtype for k in whole)
    assert not (tmp_path / ".out.work").exists()


def test_a_resume_whose_recipe_only_renames_its_stage_is_refused_in_one_short_line(tiny_model_dir, tmp_path,
                                                                                 monkeypatch, capsys):
    """Found by a tester: a run of a recipe file (stage ``quant_stage``) resumed with ``--method gptq --scheme W4A16
    --group-size 32`` (stage ``quantization_stage``, same modifier and settings) was refused in a ~950-character
    line dumping both recipes. The refusal names the rename and advises the original recipe file; nothing is
    touched."""
    recipe = tmp_path / "w4a16.yaml"
    recipe.write_text(W4A16)
    out = tmp_path / "out"
    _interrupted_cli(monkeypatch, _argv(tiny_model_dir, out, "--recipe", str(recipe)))
    work = tmp_path / ".out.work"
    before = sorted(p.name for p in (work / "progress" / "pass-0").iterdir())
    capsys.readouterr()
    generated = ("--method", "gptq", "--scheme", "W4A16", "--group-size", "32")
    assert main(_argv(tiny_model_dir, out, "--resume", *generated)) != 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"llmc-fsm oneshot: error: cannot resume from {str(work)!r}: recipe (stage 'quant_stage' renamed "
        "'quantization_stage' (same modifiers and settings)) — changed since that run; resume with the interrupted "
        "run's recipe file (--recipe), whose stage names recipe.yaml keeps, or remove that directory to start over"
    )
    assert sorted(p.name for p in (work / "progress" / "pass-0").iterdir()) == before
    assert not out.exists()


def _fingerprint(stages: int = 1) -> dict:
    gptq = {"GPTQModifier": {"scheme": {"preset": "W4A16"}, "targets": ["Linear"], "config_groups": None}}
    recipe = {f"s{i}": {"applied": False, "modifiers": [copy.deepcopy(gptq)]} for i in range(stages)}
    return {
        "recipe": recipe,
        "calibration data": {"source": "cal.txt", "sha256": "ab"},
        "pipeline": {"batch_size": 4, "fuse_stages": False},
        "seed": 0,
    }


def test_settings_that_can_change_the_result_are_still_named_and_recipe_changes_name_only_the_changed_keys():
    """``fuse_stages`` with two stages to run (two passes or one), or beside another pipeline change, is still named;
    a changed recipe names its changed settings, cut, not whole stages (found by a tester: the whole stage was
    dumped)."""
    one, two = _fingerprint(), _fingerprint(2)
    assert fingerprint_changes(one, {**one, "pipeline": {"batch_size": 4, "fuse_stages": True}}) == []
    fused_two = {**two, "pipeline": {"batch_size": 4, "fuse_stages": True}}
    assert fingerprint_changes(two, fused_two) == ["pipeline (fuse_stages False -> True)"]
    assert fingerprint_changes(one, {**one, "pipeline": {"batch_size": 2, "fuse_stages": True}}) == [
        "pipeline (batch_size 4 -> 2)"]  # fmt: skip
    changed = copy.deepcopy(one)
    changed["recipe"]["s0"]["modifiers"][0]["GPTQModifier"]["config_groups"] = {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 128, "strategy": "group"}}}  # fmt: skip
    changed["recipe"]["s1"] = {"applied": False, "modifiers": [{"SparseGPTModifier": {"sparsity": 0.5}}]}
    assert fingerprint_changes(one, changed) == [
        "recipe (stage 's1' added (SparseGPTModifier); s0.GPTQModifier.config_groups None -> {'group_0': "
        "{'targets': ['Linear'], 'weights': {'num_bits...)"
    ]


def test_global_sparsity_counts_only_the_zeros_a_pruning_modifier_made(tmp_path):
    """Found by a tester: ``sparsity_config.global_sparsity`` added the zeros of every module in the report, so a
    tied head's zero rows (listed "not targeted") counted as pruned: SmolLM2 2:4 + W4A16 saved 0.3968 instead of
    0.3946. Only modules a pruning modifier changed count now."""
    model = tiny_llama.llama()  # tied: lm_head is the embedding
    with torch.no_grad():
        model.lm_head.weight[-20:] = 0  # 20 zero rows of 64
    linears = {n: m.weight.numel() for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head"}  # fmt: skip
    params = sum(p.numel() for p in model.parameters())
    recipe = {
        "sparsity_stage": {"SparseGPTModifier": {"sparsity": 0.5, "mask_structure": "2:4", "ignore": ["lm_head"]}},
        "quantization_stage": {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 32}},
                                                "ignore": ["lm_head"]}},
    }  # fmt: skip
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=torch.randint(0, 108, (8, 32), generator=torch.Generator()
                     .manual_seed(0)), output_dir=out, progress=False)  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    head = [m for m in report["sparsity"]["modules"] if m["name"] == "lm_head"]
    assert [(m["zeros"], m["targeted"]) for m in head] == [(20 * 64, False)]
    pruned = sum(m["zeros"] for m in report["sparsity"]["modules"] if m["targeted"])
    assert pruned == sum(linears.values()) // 2  # 2:4: half of each pruned weight (random weights: no other zero)
    config = json.loads((out / "config.json").read_text())["quantization_config"]["sparsity_config"]
    assert config["global_sparsity"] == pruned / params  # was (pruned + 1280) / params
    assert config["global_sparsity"] == 0.5 * sum(linears.values()) / params
