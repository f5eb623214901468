"""``llmc-fsm --version`` and ``llmc-fsm report OUT [--plot FILE]`` (issue 11), on a tiny model's real output."""

from __future__ import annotations

import importlib.metadata
import json
import sys

import pytest
import tiny_llama
import torch

pytest.importorskip("transformers")

import llmc_fsm
from llmc_fsm.cli import main
from llmc_fsm.report.build import ModuleSparsity, OneshotReport


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == "llmc-fsm 0.1.0\n"
    assert llmc_fsm.__version__ == importlib.metadata.version("llmc-fsm") == "0.1.0"


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A real one-shot output: a tiny 2-layer Llama, magnitude 50%, saved with report.json."""
    model = tiny_llama.llama(vocab=64, hidden=16, heads=2, kv_heads=1)
    out = tmp_path_factory.mktemp("run") / "out"
    pruned = llmc_fsm.oneshot(
        model=model,
        recipe={"s": {"MagnitudePruningModifier": {"sparsity": 0.5, "ignore": ["lm_head"]}}},
        dataset=torch.randint(0, 64, (2, 8)),
        max_seq_length=8,
        output_dir=out,
        progress=False,
    )
    return pruned.llmc_fsm_report, out


def test_an_unknown_option_is_named_by_the_subcommand_with_the_option_meant(capsys, tmp_path, monkeypatch):
    """A misspelt option of a subcommand: exit status 2 before any work, one line naming the subcommand, the
    unknown arguments and the closest option, and pointing at the subcommand's --help; nothing written."""
    monkeypatch.chdir(tmp_path)
    # the second: a prefix of an option is not taken as the option (argparse's default took --num-sample as
    # --num-samples and ran the job: found by a README-only newcomer)
    for given, meant in ((["--methd", "gptq"], "--method"), (["--num-sample", "8"], "--num-samples")):
        with pytest.raises(SystemExit) as info:
            main(["oneshot", *given, "--output", "out"])
        assert info.value.code == 2
        assert capsys.readouterr().err == (
            f"llmc-fsm oneshot: error: unrecognized arguments: {' '.join(given)} (did you mean {meant}?); "
            "see 'llmc-fsm oneshot --help'\n"
        )
        assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit) as info:
        main(["modifiers", "extra"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "llmc-fsm modifiers: error: unrecognized arguments: extra; see 'llmc-fsm modifiers --help'\n"
    )
    with pytest.raises(SystemExit) as info:
        main(["oneshot", "--method", "sparsegtp"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "llmc-fsm oneshot: error: argument --method: invalid choice: 'sparsegtp' (choose from 'sparsegpt', 'wanda', "
        "'magnitude', 'gptq', 'rtn') (did you mean 'sparsegpt'?); see 'llmc-fsm oneshot --help'\n"
    )
    with pytest.raises(SystemExit) as info:
        main(["onesht"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "llmc-fsm: error: argument COMMAND: invalid choice: 'onesht' (choose from 'lifecycle', 'modifiers', 'explain', "
        "'oneshot', 'model-free', 'report') (did you mean 'oneshot'?); see 'llmc-fsm --help'\n"
    )
    with pytest.raises(SystemExit) as info:
        main(["compress"])  # no choice close to it: no guess
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "llmc-fsm: error: argument COMMAND: invalid choice: 'compress' (choose from 'lifecycle', 'modifiers', "
        "'explain', 'oneshot', 'model-free', 'report'); see 'llmc-fsm --help'\n"
    )
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "llmc-fsm: error: the following arguments are required: COMMAND; see 'llmc-fsm --help'\n"
    )


def test_a_misspelt_required_option_is_named_with_the_missing_one(capsys, tmp_path, monkeypatch):
    """argparse reports a missing required option before unknown ones: ``--outpu DIR`` said only that --output was
    missing. The misspelt option given is named with the one meant; a token after ``--`` is not an option."""
    monkeypatch.chdir(tmp_path)
    cases = (
        (["model-free", "m", "--scheme", "W8A8", "--outpu", "o"], "model-free", "--output (--outpu was given: did "
         "you mean --output?)"),
        (["model-free", "m", "--scheme", "W8A8", "--outpu=o", "--ignor", "x"], "model-free", "--output (--outpu was "
         "given: did you mean --output?; --ignor was given: did you mean --ignore?)"),
        (["model-free", "m", "--scheme", "W8A8", "--", "--outpu"], "model-free", "--output"),
        (["--verison"], "", "COMMAND (--verison was given: did you mean --version?)"),
        # a positional given as an option (it was told "did you mean --help?"; a tester's case)
        (["model-free", "--model", "m", "--output", "o"], "model-free", "--scheme (--model was given: MODEL is "
         "positional, give it without --model)"),
        (["model-free", "--mdoel", "m", "--scheme", "W8A8"], "model-free", "--output (--mdoel was given: MODEL is "
         "positional, give it without --mdoel)"),
    )
    for argv, command, missing in cases:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        prog = f"llmc-fsm {command}".strip()
        assert capsys.readouterr().err == (
            f"{prog}: error: the following arguments are required: {missing}; see '{prog} --help'\n"
        )
    with pytest.raises(SystemExit) as info:
        main(["report", "--out", "x"])
    assert capsys.readouterr().err == (
        "llmc-fsm report: error: unrecognized arguments: --out (OUT is positional, give it without --out); see "
        "'llmc-fsm report --help'\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_subcommand_given_as_an_option_and_a_model_given_as_a_positional_are_named(capsys, tmp_path, monkeypatch):
    """``llmc-fsm --oneshot`` was told only that COMMAND is required, and ``llmc-fsm oneshot smollm2-135m`` only that
    the model name is unrecognized (session 28's left items): each names the form meant. The model hint is not given
    when --model is there (the stray token is then something else)."""
    monkeypatch.chdir(tmp_path)
    cases = (
        (["--oneshot"], "llmc-fsm: error: the following arguments are required: COMMAND (--oneshot was given: oneshot "
         "is a subcommand, give it without --); see 'llmc-fsm --help'\n"),
        (["--model-fre"], "llmc-fsm: error: the following arguments are required: COMMAND (--model-fre was given: "
         "model-free is a subcommand, give it without --); see 'llmc-fsm --help'\n"),
        (["oneshot", "smollm2-135m", "--num-samples", "4"], "llmc-fsm oneshot: error: unrecognized arguments: "
         "smollm2-135m (give the model as --model smollm2-135m); see 'llmc-fsm oneshot --help'\n"),
        (["oneshot", "--num-sample", "4", "smollm2-135m"], "llmc-fsm oneshot: error: unrecognized arguments: "
         "--num-sample 4 smollm2-135m (did you mean --num-samples?; give the model as --model smollm2-135m); see "
         "'llmc-fsm oneshot --help'\n"),
        (["--oneshot", "--model", "x"], "llmc-fsm: error: argument COMMAND: invalid choice: 'x' (choose from "
         "'lifecycle', 'modifiers', 'explain', 'oneshot', 'model-free', 'report') (--oneshot was given: oneshot is a "
         "subcommand, give it without --); see 'llmc-fsm --help'\n"),  # B4's case; --model is not model-free
        (["explain", "r.yaml", "stage2"], "llmc-fsm explain: error: unrecognized arguments: stage2; see 'llmc-fsm "
         "explain --help'\n"),  # a stray token beside a positional need not be a model (B4's case)
        (["oneshot", "--model", "a", "b"], "llmc-fsm oneshot: error: unrecognized arguments: b; see 'llmc-fsm "
         "oneshot --help'\n"),
        (["oneshot", "--model=a", "b"], "llmc-fsm oneshot: error: unrecognized arguments: b; see 'llmc-fsm "
         "oneshot --help'\n"),
    )
    for argv, expected in cases:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert capsys.readouterr().err == expected
    assert list(tmp_path.iterdir()) == []


def test_verbose_is_taken_before_or_after_the_subcommand(capsys, tmp_path, monkeypatch):
    """``llmc-fsm oneshot -v ...`` was refused with "did you mean --overwrite?": -v / --verbose is the top level's
    option, taken after any subcommand too (and a misspelling of it is named)."""
    monkeypatch.chdir(tmp_path)
    for argv in (["-v", "oneshot", "--model", "nope"], ["oneshot", "--model", "nope", "-v"], ["oneshot", "--verbose",
                 "--model", "nope"]):
        with pytest.raises(ValueError, match="unknown model 'nope'"):  # -v: the error is raised, not printed
            main(argv)
    assert main(["oneshot", "--model", "nope"]) == 1
    assert capsys.readouterr().err.startswith("llmc-fsm oneshot: error: unknown model 'nope'")
    with pytest.raises(SystemExit) as info:
        main(["oneshot", "--verbos", "--model", "nope"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "llmc-fsm oneshot: error: unrecognized arguments: --verbos (did you mean --verbose?); "
        "see 'llmc-fsm oneshot --help'\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_report_from_dict_round_trips(saved_run):
    report, out = saved_run
    saved = json.loads((out / "report.json").read_text())
    again = OneshotReport.from_dict(saved)
    assert again.to_dict() == saved == json.loads(report.to_json())
    assert again.format_table() == report.format_table()


def test_report_reprints_the_saved_report(saved_run, capsys):
    report, out = saved_run
    assert main(["report", str(out)]) == 0
    assert capsys.readouterr().out == report.format_table() + "\n"
    assert main(["report", str(out / "report.json")]) == 0  # the file itself works too
    assert capsys.readouterr().out == report.format_table() + "\n"


def test_report_into_a_pipe_nobody_reads_exits_quietly(saved_run):
    """`llmc-fsm report OUT | head -1`: the reader stops; no error line (it said "[Errno 32] Broken pipe", exit 1)."""
    import subprocess

    _, out = saved_run
    code = (
        "import os, sys\n"
        "read, write = os.pipe(); os.close(read); os.dup2(write, 1)  # stdout: a pipe whose reader is gone\n"
        "from llmc_fsm.cli import main\n"
        f"sys.exit(main(['report', {str(out)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")


def test_output_dash_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["oneshot", "--method", "rtn", "--output", "-"]) == 1
    assert capsys.readouterr().err == (
        "llmc-fsm oneshot: error: output '-': the output is a model directory, which cannot go to standard output; "
        "give a directory (e.g. --output out/my-model)\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_report_plot_png(saved_run, tmp_path, capsys):
    from matplotlib.image import imread

    _, out = saved_run
    png = tmp_path / "sparsity.png"
    assert main(["report", str(out), "--plot", str(png)]) == 0
    assert capsys.readouterr().out.endswith(f"plot: {png}\n")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(png).shape == (504, 1320, 4)  # 11 x 4.2 in at 120 dpi: one panel


def _with_quantization(data):
    data = json.loads(json.dumps(data))
    for i, entry in enumerate(data["sparsity"]["modules"]):
        if entry["targeted"]:
            error = 0.01 * (1 + i % 5) * (1 + (entry["layer"] or 0))
            entry |= {"bits": 4, "group_size": 128, "rel_output_error": error}
    return data


def test_report_plot_with_quantization_has_a_second_panel(saved_run, tmp_path):
    from matplotlib.image import imread

    _, out = saved_run
    quant_out = tmp_path / "q"
    quant_out.mkdir()
    data = _with_quantization(json.loads((out / "report.json").read_text()))
    (quant_out / "report.json").write_text(json.dumps(data))
    png = tmp_path / "quant.png"
    assert main(["report", str(quant_out), "--plot", str(png)]) == 0
    assert imread(png).shape == (900, 1320, 4)  # 11 x 7.5 in at 120 dpi: two panels


def test_plot_model_without_decoder_layers(tmp_path):
    from matplotlib.image import imread

    from llmc_fsm.report.plot import plot_report

    report = OneshotReport(
        model="Sequential",
        recipe={},
        calibration={"source": "x", "num_samples": 1, "seq_len": 2},
        modules=[ModuleSparsity(name=str(i), layer=None, zeros=i, numel=4) for i in range(3)],
        targeted=["0", "1", "2"],
    )
    png = plot_report(report.to_dict(), tmp_path / "seq.png")
    assert imread(png).shape == (504, 1320, 4)


def test_report_without_matplotlib_fails_before_printing(saved_run, tmp_path, capsys, monkeypatch):
    _, out = saved_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert main(["report", str(out), "--plot", str(tmp_path / "x.png")]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "llmc-fsm report: error: drawing a plot needs matplotlib, which is not installed; install it with "
        "`pip install 'llmc-fsm[plot]'` (or `pip install 'matplotlib>=3.7'`)\n"
    )


def test_report_plot_bad_target(saved_run, tmp_path, capsys):
    _, out = saved_run
    assert main(["report", str(out), "--plot", str(tmp_path / "plot.txt")]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(
        f"llmc-fsm report: error: cannot draw {tmp_path / 'plot.txt'}: the file name must end in an image format ("
    )
    assert "png" in captured.err
    missing = tmp_path / "nope" / "p.png"
    assert main(["report", str(out), "--plot", str(missing)]) == 1
    assert capsys.readouterr().err == (
        f"llmc-fsm report: error: cannot draw {missing}: the directory {missing.parent} does not exist\n"
    )


def test_report_bad_inputs(tmp_path, capsys):
    missing = tmp_path / "missing"
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "report.json").write_text('{"model": "x",\n "sparsity": ')
    other = tmp_path / "other"
    other.mkdir()
    (other / "report.json").write_text('{"model": "x"}')
    cases = {
        missing: f"{missing} does not exist; pass the output directory of `llmc-fsm oneshot --output DIR`",
        empty: f"{empty / 'report.json'} not found: {empty} is not an output directory of `llmc-fsm oneshot --output "
        "DIR`",
        broken: f"{broken / 'report.json'}: invalid JSON (Expecting value at line 2, column 14)",
        other: f"{other / 'report.json'}: not a one-shot report written by llmc-fsm oneshot (missing 'sparsity')",
    }
    for path, message in cases.items():
        assert main(["report", str(path)]) == 1
        captured = capsys.readouterr()
        assert (captured.out, captured.err) == ("", f"llmc-fsm report: error: {message}\n")


def test_error_panel_title_names_what_made_the_error():
    from llmc_fsm.report.plot import error_panel_title

    pruned = [{"rel_output_error": 0.1, "zeros": 8, "numel": 16}, {"zeros": 3}]  # the second has no error: not counted
    # a dense weight's few exact zeros (0.03%) do not make it pruned
    quantized = [{"rel_output_error": 0.1, "zeros": 3, "numel": 10000, "bits": 4, "group_size": 64}]
    both = [{"rel_output_error": 0.1, "zeros": 8000, "numel": 16000, "bits": 4, "group_size": 64}, *quantized]
    tail = "relative output error ||W X - Ŵ X|| / ||W X|| per module{}; line: mean weighted by size"
    assert error_panel_title(pruned) == "pruning: " + tail.format("")
    assert error_panel_title(quantized) == "quantization: " + tail.format(" (bits 4, group_size 64)")
    assert error_panel_title(both) == "pruning + quantization: " + tail.format(" (bits 4, group_size 64)")
    # several modifiers measured the same module (2:4 then GPTQ): the panel shows the last one's, and says so
    steps = [
        {"modifier": "SparseGPTModifier (s)", "rel_output_error": 0.3},
        {"modifier": "GPTQModifier (q)", "rel_output_error": 0.06},
    ]
    stacked = [{**both[0], "rel_output_errors": steps}]
    assert error_panel_title(stacked) == (
        "the last step (quantization, after pruning): relative output error ||W X - Ŵ X|| / ||W X|| per module "
        "against the weights it received (bits 4, group_size 64); line: mean weighted by size"
    )


def test_a_finished_output_is_not_resumed_and_the_error_says_so(saved_run):
    _, out = saved_run
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(FileExistsError) as info:
        llmc_fsm.oneshot(
            model=tiny_llama.llama(vocab=64, hidden=16, heads=2, kv_heads=1),
            recipe={"s": {"MagnitudePruningModifier": {"sparsity": 0.5}}},
            dataset=torch.randint(0, 64, (2, 8)),
            max_seq_length=8,
            output_dir=out,
            resume=True,
            progress=False,
        )
    assert str(info.value) == (
        f"output directory {str(out)!r} exists and is not empty; pass overwrite=True (--overwrite) to replace it. "
        "It holds a finished run (report.json), so there is nothing to resume; to compress that model further, "
        "give it as the model (model=DIR, --model DIR) with a new output directory"
    )
    assert sorted(p.name for p in out.iterdir()) == before


def test_an_empty_scheme_is_refused(capsys):
    assert main(["oneshot", "--method", "gptq", "--scheme", " "]) == 1
    assert capsys.readouterr().err == (
        "llmc-fsm oneshot: error: --scheme is empty: give a preset name, e.g. --scheme W4A16\n"
    )


def test_fewer_calibration_tokens_than_hessian_inputs_warn_once_before_the_work(caplog):
    model = tiny_llama.llama(vocab=64, hidden=16, heads=2, kv_heads=1)  # down_proj has 32 inputs
    with caplog.at_level("WARNING", logger="llmc_fsm.oneshot_job.data"):
        llmc_fsm.oneshot(
            model=model,
            recipe={"s": {"SparseGPTModifier": {"sparsity": 0.5}}},
            dataset=torch.randint(0, 64, (2, 8)),
            max_seq_length=8,
            progress=False,
        )
    warnings = [r.getMessage() for r in caplog.records if r.name == "llmc_fsm.oneshot_job.data"]
    assert warnings == [
        "SparseGPTModifier: 16 calibration tokens for up to 32 inputs (model.layers.0.mlp.down_proj): the Hessians "
        "are rank-deficient and the result depends on float rounding (batch size, threads); give at least 32 tokens "
        "(--num-samples x --seq-len)"
    ]


def test_a_busy_machine_is_said_when_threads_are_not_given(tiny_model_dir, tmp_path, monkeypatch, caplog, capsys):
    """A README-only newcomer measured the same GPTQ job 15x slower with torch's 2 threads than with --threads 1
    under a load of ~4-6 on 2 cores; one line says so when the load is at least torch's thread count and --threads
    is not given (the default stays: the thread count moves float rounding). Said with the device line, after every
    check: a refusal stays one line (a later newcomer saw the busy line before a refusal), and not without progress
    (a test reading every warning failed on a busy machine)."""
    import llmc_fsm.oneshot_job.api as api

    model_dir, text = tiny_model_dir
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(api.os, "getloadavg", lambda: (4.5, 4.0, 3.0))
    monkeypatch.setattr(api.torch, "get_num_threads", lambda: 2)
    busy = ("the machine is busy (1-minute load 4.5 for torch's 2 threads): multi-threaded compression can then be "
            "many times slower (measured up to 15x on 2 cores); --threads 1 (threads=1) may finish sooner")
    rtn = ["--method", "rtn", "--scheme", "W8A8", "--eval-windows", "1"]
    runs = (
        (["--output", "a", *rtn], [busy]),
        (["--output", "b", *rtn, "--threads", "1"], []),
        (["--output", "c", *rtn, "--no-progress"], []),
        (["--output", "d", "--model", str(tmp_path / "missing")], []),  # refused before any work: the error alone
    )
    for extra, said in runs:
        caplog.clear()
        argv = ["oneshot", "--model", str(model_dir), "--dataset", str(text), "--seq-len", "32", *extra]
        with caplog.at_level("WARNING", logger="llmc_fsm.oneshot_job.api"):
            main(argv)
        assert [r.getMessage() for r in caplog.records if r.name == "llmc_fsm.oneshot_job.api"] == said, extra
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("llmc-fsm oneshot: error: ")

    def unobtainable():
        raise OSError("Load averages are unobtainable")

    monkeypatch.setattr(api.os, "getloadavg", unobtainable)  # a line only said never stops the run
    caplog.clear()
    assert main(["oneshot", "--model", str(model_dir), "--output", "e", *rtn]) == 0
    assert not [r for r in caplog.records if "unobtainable" in r.getMessage()]


def test_compressed_tensors_warnings_marked_log_once_are_said_once(capsys):
    """compressed-tensors logs repeated warnings with loguru's ``log_once``, which loguru's default handler ignores:
    a block size that does not divide SmolLM2's widths was said 180 times in one run (a tester's count)."""
    loguru = pytest.importorskip("loguru")
    assert main(["lifecycle"]) == 0
    capsys.readouterr()
    for _ in range(3):
        loguru.logger.bind(log_once=True).warning("block quantization strategy requires strict division (test)")
    loguru.logger.warning("said each time (test)")
    loguru.logger.warning("said each time (test)")
    err = capsys.readouterr().err
    assert err.count("strict division (test)") == 1 and err.count("said each time (test)") == 2
