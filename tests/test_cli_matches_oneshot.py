"""``explain --model`` taken as oneshot takes the recipe on that model; ``model-free`` and ``report`` refusals that
match oneshot's (found by a tester)."""

from __future__ import annotations

import json
import logging
import shlex

import pytest
import torch
from safetensors.torch import save_file
from tiny_llama import llama

from llmc_fsm.cli import main

#: the saved history of an output: SparseGPT 50%, as `oneshot` writes it after a run (every stage marked applied)
_SAVED = "sparsity_stage:\n  modifiers:\n  - SparseGPTModifier: {sparsity: 0.5}\n  applied: true\n"


def _model(directory, capsys, recipe_yaml=None):
    """A tiny Llama directory (widths 64: no multiple of W4A16's group size 128), with ``recipe.yaml`` if given."""
    llama(hidden=64, kv_heads=4, tied=False).save_pretrained(directory)
    capsys.readouterr()  # transformers' progress bar
    if recipe_yaml is not None:
        (directory / "recipe.yaml").write_text(recipe_yaml)
    return directory


def _oneshot_refusal(argv, capsys):
    """What ``llmc-fsm oneshot`` says (exit 1, before any weight) with ``argv``: the reference for explain's."""
    assert main(["oneshot", *argv, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llmc-fsm oneshot: error: ") and err.count("\n") == 1
    return err.removeprefix("llmc-fsm oneshot: error: ")


def test_explain_model_refuses_a_recipe_every_stage_of_which_the_saved_output_applied(tmp_path, capsys):
    """``explain RECIPE --model OUT`` read the recipe alone: it approved (exit 0) a recipe that the output's
    recipe.yaml records as applied with the same settings, and the saved recipe.yaml itself, both of which oneshot
    refuses ("the recipe has no modifier to run")."""
    out = _model(tmp_path / "out1", capsys, _SAVED)
    same = tmp_path / "sgpt.yaml"
    same.write_text("sparsity_stage:\n  SparseGPTModifier: {sparsity: 0.5}\n")
    for recipe in (same, out / "recipe.yaml"):
        argv = ["--model", str(out), "--recipe", str(recipe), "--output", str(tmp_path / "o")]
        reference = _oneshot_refusal(argv, capsys)
        assert reference.startswith("the recipe has no modifier to run: ")
        assert main(["explain", str(recipe), "--model", str(out)]) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        on = f"oneshot would refuse this recipe on --model {out}"
        assert captured.err == f"llmc-fsm explain: error: {on}: {reference}"
    assert not (tmp_path / "o").exists()


def test_explain_model_shows_a_stage_under_the_name_oneshot_runs_it_on_a_saved_output(tmp_path, capsys, caplog):
    """A stage of the name the output applied runs as ``sparsity_stage_2`` in oneshot; explain showed it as
    ``sparsity_stage`` and said nothing of the stage applied before."""
    out = _model(tmp_path / "out1", capsys, _SAVED)
    recipe = tmp_path / "sgpt6.yaml"
    recipe.write_text("sparsity_stage:\n  SparseGPTModifier: {sparsity: 0.6}\n")
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.recipes.history"):
        assert main(["explain", str(recipe), "--model", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"Recipe {recipe}: 2 stage(s), 1 modifier(s) to run"
    applied = "Stage 'sparsity_stage': already applied, skipped (SparseGPTModifier)"
    assert lines[2:4] == [applied, "Stage 'sparsity_stage_2':"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{out} (see its recipe.yaml) already had stage 'sparsity_stage' (SparseGPTModifier) applied; stage "
        "'sparsity_stage_2' runs on top of it (SparseGPTModifier.sparsity 0.5 -> 0.6)"
    ]


def test_explain_model_says_oneshot_skips_a_training_stage(tmp_path, capsys, caplog):
    """With a ``run_type: train`` stage, explain --model listed its ``steps_per_epoch`` as MISSING and exited 0
    without saying that one-shot skips the stage, which oneshot says in one warning line."""
    model = _model(tmp_path / "m", capsys)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("s:\n  SparseGPTModifier: {sparsity: 0.5}\n"
                      "ft:\n  run_type: train\n  modifiers: {ConstantPruningModifier: {start: 0}}\n")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.recipes.history"):
        assert main(["explain", str(recipe), "--model", str(model)]) == 0
    out = capsys.readouterr().out
    assert "steps_per_epoch" not in out and "ConstantPruningModifier" not in out
    assert out.startswith(f"Recipe {recipe}: 1 stage(s), 1 modifier(s) to run\n")
    assert [r.getMessage() for r in caplog.records] == [
        "one-shot runs no training: stage(s) 'ft' (run_type: train) skipped, and left out of the saved recipe.yaml; "
        "run them in a training loop (docs/training.md)"
    ]


def test_explain_modifier_name_with_model_runs_oneshots_checks_of_its_defaults(tmp_path, capsys):
    """``explain GPTQModifier --model DIR`` dropped --model ("state present: none", exit 0) where ``oneshot --method
    gptq`` (the same modifier with its defaults) refuses the model's widths; a modifier whose defaults alone are no
    plan refused nothing and checked nothing."""
    model = _model(tmp_path / "m", capsys)
    argv = ["--model", str(model), "--method", "gptq", "--output", str(tmp_path / "o")]
    reference = _oneshot_refusal(argv, capsys)
    assert reference.startswith("GPTQModifier cannot compress 12 of its 14 targets — in_features 64 is not a ")
    assert main(["explain", "GPTQModifier", "--model", str(model)]) == 1
    captured = capsys.readouterr()
    assert "Session lifecycle: staging; state present: model\n" in captured.out
    assert captured.err == f"llmc-fsm explain: error: oneshot would refuse this recipe on --model {model}: {reference}"
    assert main(["explain", "MagnitudePruningModifier", "--model", str(model)]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith("MagnitudePruningModifier: arguments (default):\n")
    assert captured.err == (
        f"llmc-fsm explain: error: --model {model} not checked: MagnitudePruningModifier has no plan with its defaults "
        "alone; give a recipe that sets what it needs (above) with --model\n"
    )


def test_explain_refuses_dtype_without_a_model(tmp_path, capsys):
    """``explain RECIPE --dtype bfloat16`` without --model ignored --dtype silently: a usage error now."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("s:\n  SparseGPTModifier: {sparsity: 0.5}\n")
    with pytest.raises(SystemExit) as info:
        main(["explain", str(recipe), "--dtype", "bfloat16"])
    assert info.value.code == 2
    assert capsys.readouterr() == (
        "",
        "llmc-fsm explain: error: --dtype is the dtype oneshot would load --model in: give --model DIR with it, or "
        "leave --dtype out; see 'llmc-fsm explain --help'\n",
    )


def test_model_free_refuses_an_unknown_model_name_at_once_as_oneshot_does(tmp_path, capsys, monkeypatch):
    """``model-free nope`` (a mistyped directory) went to the Hugging Face Hub (~37 s of retries, 22 log lines)
    before its error; oneshot refuses the name at once, in one line."""
    import compressed_tensors.utils.safetensors_load as loading

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(loading, "get_checkpoint_files", no_hub)
    monkeypatch.chdir(tmp_path)
    for name in ("nope", "./nope"):
        reference = _oneshot_refusal(["--model", name, "--output", "o"], capsys)
        assert main(["model-free", name, "--scheme", "W8A8", "--output", "mfx"]) == 1
        assert capsys.readouterr() == ("", f"llmc-fsm model-free: error: {reference}")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--group-size", "--threads"])
def test_model_free_refuses_a_value_below_one_with_status_1_as_oneshot(tmp_path, capsys, flag):
    """``model-free --group-size 0`` / ``--threads 0`` exited 2 (argparse) where oneshot exits 1, as docs/oneshot.md
    promises for a bad value."""
    model = _model(tmp_path / "m", capsys)
    method = ["--method", "rtn"] if flag == "--group-size" else []
    reference = _oneshot_refusal(["--model", str(model), *method, flag, "0", "--output", str(tmp_path / "o")], capsys)
    assert main(["model-free", str(model), "--scheme", "W4A16", flag, "0", "--output", str(tmp_path / "mf")]) == 1
    assert capsys.readouterr() == ("", f"llmc-fsm model-free: error: {reference}")
    assert not (tmp_path / "mf").exists() and not (tmp_path / "o").exists()


def test_report_on_an_interrupted_run_says_how_far_it_got_and_how_to_finish_it(tmp_path, capsys):
    """``llmc-fsm report OUT`` of a run interrupted while writing OUT (its progress kept in .OUT.work) said only
    "OUT does not exist; pass the output directory ..."."""
    work = tmp_path / ".out.work"
    (work / "progress" / "pass-0").mkdir(parents=True)
    for layer in (0, 1):
        save_file({"w": torch.zeros(2)}, str(work / "progress" / "pass-0" / f"layer-{layer:05d}.safetensors"))
    (work / "progress" / "layout.json").write_text('{"num_layers": 4, "passes": 1}')
    command = ["/venv/bin/llmc-fsm", "oneshot", "--model", "my model", "--output", str(tmp_path / "out")]
    (work / "owner.json").write_text(json.dumps({"command": command, "pid": 1}))
    assert main(["report", str(tmp_path / "out")]) == 1
    resume = f"llmc-fsm oneshot --model 'my model' --output {shlex.quote(str(tmp_path / 'out'))} --resume"
    assert capsys.readouterr() == ("", (
        f"llmc-fsm report: error: {tmp_path / 'out'} does not exist yet: the run writing it was interrupted (or is "
        f"still running), its progress kept in '{work}' (2 of 4 decoder layers done); finish it with `{resume}`, then "
        f"run `llmc-fsm report {tmp_path / 'out'}` again\n"))  # fmt: skip


def test_report_on_an_interrupted_run_says_where_its_relative_paths_point(tmp_path, capsys, monkeypatch):
    """The resume command report printed for an interrupted run kept the run's relative paths, so pasted in another
    directory it failed or started a fresh run (found by a tester): owner.json records the working directory and
    report names it when it is not the current one."""
    started = tmp_path / "project"
    started.mkdir()
    monkeypatch.chdir(started)
    from llmc_fsm.output.workdir import WorkDir

    owner = WorkDir.claim(started / "out")
    owner.settle({}, resume=False)  # writes owner.json as a run does
    record = json.loads((owner.path / "owner.json").read_text())
    assert record["cwd"] == str(started)
    record["command"] = ["/venv/bin/llmc-fsm", "oneshot", "--recipe", "r.yaml", "--output", "out"]
    (owner.path / "owner.json").write_text(json.dumps(record))
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(started / "out")]) == 1
    err = capsys.readouterr().err
    assert "finish it with `llmc-fsm oneshot --recipe r.yaml --output out --resume` run from " \
        f"{str(started)!r}, then run" in err


def test_report_of_a_finished_output_notes_an_interrupted_rerun_into_it(tmp_path, capsys):
    """A finished output whose --overwrite re-run was interrupted (its .OUT.work kept): report printed the old
    run's report as if current, with nothing said (found by a tester). It still prints it, and a note says a later
    run's progress is kept beside it."""
    import llmc_fsm

    out = tmp_path / "out"
    llmc_fsm.oneshot(model=llama(hidden=64, kv_heads=4, tied=False), dataset=torch.randint(0, 64, (2, 16)),
                     output_dir=out, progress=False)  # fmt: skip
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    assert capsys.readouterr().err == ""
    (tmp_path / ".out.work" / "progress").mkdir(parents=True)
    assert main(["report", str(out)]) == 0
    assert capsys.readouterr().err == (
        f"note: this is the report of the finished run in {out}; a later run writing it was interrupted (or is still "
        f"running), its progress kept in '{tmp_path / '.out.work'}' (no decoder layer saved yet)\n")


def test_report_says_a_text_file_is_no_output_directory(tmp_path, capsys):
    """``llmc-fsm report small.txt`` said "small.txt: invalid JSON", as if it were a damaged report."""
    text = tmp_path / "small.txt"
    text.write_text("some calibration text\n")
    assert main(["report", str(text)]) == 1
    assert capsys.readouterr().err == (
        f"llmc-fsm report: error: {text} is neither an output directory of `llmc-fsm oneshot --output DIR` nor its "
        "report.json (not JSON: Expecting value at line 1, column 1); pass that directory\n"
    )


def test_plot_titles_say_asym_as_the_table_does():
    """The ``--plot`` titles of an AWQ W4A16_ASYM output said "4 bits, group size 64" where the table says
    ``int4/g64 asym``."""
    from llmc_fsm.report.plot import error_panel_title, quantization_summary

    def entry(label):
        return {"name": "m", "layer": 0, "zeros": 0, "numel": 8, "bits": 4, "group_size": 64, "quantized": label,
                "rel_output_error": 0.1}  # fmt: skip

    asym = [entry("int4/g64 asym"), entry("int4/g64 asym")]
    assert quantization_summary(asym) == "quantized: 4 bits, group size 64, asym on 2 modules"
    assert quantization_summary([asym[0], entry("int4/g64")]) == "quantized: 4 bits, group size 64, 1 asym on 2 modules"
    assert quantization_summary([entry("int4/g64")]) == "quantized: 4 bits, group size 64 on 1 modules"
    assert error_panel_title(asym) == (
        "quantization: relative output error ||W X - Ŵ X|| / ||W X|| per module (bits 4, group_size 64, asym); line: "
        "mean weighted by size"
    )


@pytest.mark.parametrize(
    ("modifier", "listed", "missing"),
    [("OutputDistillationModifier: {temperature: 2.0}", "teacher", "teacher"),
     ("SparseGPTModifier: {sparsity: 0.5, start: 0}", "calibration_data, steps_per_epoch", "steps_per_epoch")],
)  # fmt: skip
def test_explain_model_refuses_state_oneshot_does_not_give(tmp_path, capsys, modifier, listed, missing):
    """A modifier needing state oneshot does not give (a teacher; a one-shot modifier given a schedule): oneshot
    refuses it before any weight, explain --model listed it as MISSING and exited 0; ``--state KEY`` (the caller
    gives it) still passes."""
    model = _model(tmp_path / "m", capsys)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"stage:\n  modifiers:\n    {modifier}\n")
    argv = ["--model", str(model), "--recipe", str(recipe), "--output", str(tmp_path / "o")]
    reference = _oneshot_refusal(argv, capsys)
    assert main(["explain", str(recipe), "--model", str(model)]) == 1
    captured = capsys.readouterr()
    name = modifier.split(":")[0]
    assert captured.out.endswith(f"Missing before initialize():\n  - {name}: {listed}\n")
    assert captured.err == f"llmc-fsm explain: error: oneshot would refuse this recipe on --model {model}: {reference}"
    assert main(["explain", str(recipe), "--model", str(model), "--state", missing]) == 0
    assert capsys.readouterr().err == ""
    assert not (tmp_path / "o").exists()
