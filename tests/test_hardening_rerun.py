"""Issue 27: re-running on a one-shot output — the same method and settings are skipped, other ones run.

The rule (llmc_fsm.recipes.history.merge_saved_recipe), the same for ``--method`` and for a recipe, for a saved
directory (CLI and API) and for an in-memory model: a stage whose modifiers and settings were already applied is
skipped with one warning line (nothing left to run: one error line before the model is loaded, nothing written);
otherwise it runs, under a fresh name if its name was applied, and one warning line says what was applied before.
"""

from __future__ import annotations

import logging

import pytest
import tiny_llama
import torch
import yaml

import llmc_fsm
from llmc_fsm.cli.main import main

pytest.importorskip("transformers")
pytest.importorskip("llmc_fsm_pruning")


def _listing(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def pruned(tiny_model_dir, tmp_path_factory):
    """The tiny model pruned by the CLI's default method (SparseGPT 50%) into ``out``."""
    out = tmp_path_factory.mktemp("rerun") / "out"
    assert main(tiny_llama.oneshot_argv(*tiny_model_dir, out, "--num-samples", "8", "--batch-size", "4")) == 0
    return out


def test_the_same_method_again_is_skipped_in_one_line_before_the_model_loads(
    pruned, tiny_model_dir, tmp_path, monkeypatch, capsys, caplog
):
    capsys.readouterr()
    before = _listing(pruned)

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("llmc_fsm.oneshot_job.phases.load_model", no_model)
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.recipes.history"):
        status = main(["oneshot", "--model", str(pruned), "--dataset", str(tiny_model_dir[1]), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"stage 'sparsity_stage' (SparseGPTModifier) was already applied to {pruned} (see its recipe.yaml) with "
        "the same settings (stage 'sparsity_stage'): skipped"
    ]
    assert err == (
        f"llmc-fsm oneshot: error: the recipe has no modifier to run: every stage is already applied to {pruned} "
        "(see its recipe.yaml) with the same settings; nothing to do (change a setting or the method to compress "
        "further)\n"
    )
    assert _listing(pruned) == before  # nothing written


def test_other_settings_run_and_say_what_was_applied_before(pruned, tiny_model_dir, tmp_path, caplog):
    out = tmp_path / "more"
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.recipes.history"):
        model = llmc_fsm.oneshot(
            model=str(pruned),
            recipe={"sparsity_stage": {"SparseGPTModifier": {"sparsity": 0.75, "targets": ["Linear"], "ignore": ["lm_head"]}}},
            dataset=str(tiny_model_dir[1]),
            num_calibration_samples=8,
            max_seq_length=32,
            batch_size=4,
            output_dir=out,
            progress=False,
        )
    assert [r.getMessage() for r in caplog.records] == [
        f"{pruned} (see its recipe.yaml) already had stage 'sparsity_stage' (SparseGPTModifier) applied; stage "
        "'sparsity_stage_2' runs on top of it (SparseGPTModifier.sparsity 0.5 -> 0.75)"
    ]
    saved = yaml.safe_load((out / "recipe.yaml").read_text())
    assert list(saved) == ["sparsity_stage", "sparsity_stage_2"]
    assert [s["modifiers"][0]["SparseGPTModifier"]["sparsity"] for s in saved.values()] == [0.5, 0.75]
    assert model.llmc_fsm_report.total_sparsity == pytest.approx(0.75, abs=1e-6)


def test_an_in_memory_model_follows_the_same_rule(caplog):
    data = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    recipe = {"p": {"MagnitudePruningModifier": {"sparsity": 0.5, "targets": ["Linear"], "ignore": ["lm_head"]}}}
    model = llmc_fsm.oneshot(model=tiny_llama.llama(vocab=96, hidden=32, layers=2), recipe=recipe, dataset=data,
                             progress=False)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, progress=False)
    assert str(info.value) == (
        "the recipe has no modifier to run: every stage is already applied with the same settings; nothing to do "
        "(change a setting or the method to compress further)"
    )
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())  # untouched


def test_a_saved_recipe_on_the_base_model_says_its_own_stages_are_marked_applied(
    pruned, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """A run's recipe.yaml marks its stages ``applied: true``; given back with the base model (which has no saved
    recipe) the error names the recipe's own marks and how to run them again, before the model loads; with
    ``applied: false`` the same file runs."""
    model_dir, text = tiny_model_dir
    saved = (pruned / "recipe.yaml").read_text()
    assert "applied: true" in saved
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(saved)

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    with monkeypatch.context() as patch:
        patch.setattr("llmc_fsm.oneshot_job.phases.load_model", no_model)
        capsys.readouterr()
        status = main(tiny_llama.oneshot_argv(model_dir, text, tmp_path / "again", "--recipe", str(recipe)))
    assert status == 1
    assert capsys.readouterr().err == (
        "llmc-fsm oneshot: error: the recipe has no modifier to run: it marks every stage 'applied: true' (a "
        "recipe.yaml saved by a run records the stages it applied); to run them again, set 'applied: false' on each "
        "stage (or remove the line)\n"
    )
    assert not (tmp_path / "again").exists()
    recipe.write_text(saved.replace("applied: true", "applied: false"))
    assert main(tiny_llama.oneshot_argv(model_dir, text, tmp_path / "again", "--recipe", str(recipe))) == 0


def test_a_refused_rerun_does_not_first_say_that_its_stage_runs(tiny_model_dir, tmp_path, caplog):
    """Found in session 22: quantizing a quantized output again printed "stage 'q_2' runs on top of it" and then
    refused the model as quantized already; the history line now comes only once the modifiers' checks passed."""
    scheme = {"preset": "W8A16", "weights": {"group_size": 16}}
    quantized = tmp_path / "q"
    llmc_fsm.oneshot(model=str(tiny_model_dir[0]), recipe={"q": {"QuantizationModifier": {"scheme": scheme}}},
                     output_dir=quantized, progress=False)  # fmt: skip
    again = {"q": {"QuantizationModifier": {"scheme": {**scheme, "preset": "W4A16"}, "ignore": ["lm_head"]}}}
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(quantized), recipe=again, output_dir=tmp_path / "again", progress=False)
    assert str(info.value) == (
        "QuantizationModifier: the model is already quantized (its config carries a quantization_config "
        "(quant_method 'compressed-tensors')); quantize the original full-precision model instead"
    )
    assert [r.getMessage() for r in caplog.records] == []
    assert not (tmp_path / "again").exists()


def test_a_rerun_refused_for_its_data_does_not_first_say_that_its_stage_runs(pruned, tiny_model_dir, tmp_path, caplog):
    """A breaker's case after the fix above: SparseGPT 0.5 -> 0.75 on the pruned output, refused for a sequence
    length above the model's positions, printed the history line first (it came after the modifiers' checks, before
    the data's)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(
            model=str(pruned),
            recipe={"sparsity_stage": {"SparseGPTModifier": {"sparsity": 0.75, "ignore": ["lm_head"]}}},
            dataset=str(tiny_model_dir[1]), num_calibration_samples=8, max_seq_length=4096, output_dir=tmp_path / "o",
            progress=False,
        )  # fmt: skip
    assert "max_position_embeddings" in str(info.value)
    assert [r.getMessage() for r in caplog.records if "runs on top of it" in r.getMessage()] == []
    assert not (tmp_path / "o").exists()


def test_an_empty_list_of_modifiers_is_refused_as_empty_not_as_applied():
    """A newcomer's case: ``oneshot(recipe=[])`` on a fresh model said "every stage is already applied ... with the
    same settings", which was false."""
    model = tiny_llama.llama(vocab=96, hidden=32, layers=2)
    data = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=[], dataset=data, progress=False)
    assert str(info.value) == (
        "the recipe has no modifier to run: [] is empty; give at least one modifier, or leave recipe out (None) for "
        "the default recipe (SparseGPT 50%; on the command line, that of --method)"
    )
