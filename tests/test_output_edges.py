"""Issue 11 cases 4, 7 and 14 around the one-shot output: exact messages, nothing lost, nothing left behind.

* case 4: an output path that cannot be written fails before any model work, in one line;
* case 7: SIGTERM is handled like Ctrl-C (one line, exit 143/130, the partial output removed);
  a work directory whose owner is gone is cleaned up, a live owner's is never touched;
* case 14: an ``nn.Sequential`` pruned through the Python API reports its targets; ``--no-progress``
  silences transformers' and compressed-tensors' bars and restores the caller's settings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_llama
import torch
from torch import nn

import llmc_fsm
from llmc_fsm.cli import main
from llmc_fsm.oneshot_job.progress import TQDM_MODULES, quiet_progress
from llmc_fsm.output.directory import check_output_dir

pytest.importorskip("transformers")
pytest.importorskip("llmc_fsm_pruning")


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _tiny_module(layers: int = 2):
    return tiny_llama.llama(vocab=96, hidden=32, layers=layers, heads=2, kv_heads=1, positions=2048)


DATA = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("llmc_fsm.oneshot_job.phases.load_model", refuse)  # where the job calls it


# --------------------------------------------------------------------------- case 4: unwritable outputs
def _refused_before_loading(output: Path | str, error: type[Exception], message: str) -> None:
    """``oneshot`` raises ``error`` with ``message`` (with the ``no_model_loading`` fixture: before loading the model;
    it carried a wall-clock bound, which a busy machine broke: timings belong in benchmarks/)."""
    with pytest.raises(error) as info:
        llmc_fsm.oneshot(model="smollm2-135m", output_dir=output, progress=False)
    assert str(info.value) == message


def test_output_under_a_regular_file(tmp_path, no_model_loading, capsys):
    (tmp_path / "README.md").write_text("# readme\n")
    out = tmp_path / "README.md" / "sub"
    message = (
        f"cannot create the output directory {str(out)!r}: {str(tmp_path / 'README.md')!r} is a file, not a directory"
    )
    _refused_before_loading(out, NotADirectoryError, message)
    _refused_before_loading(out / "deeper", NotADirectoryError, message.replace("/sub'", "/sub/deeper'"))
    assert main(["oneshot", "--no-progress", "--output", str(out)]) == 1
    assert capsys.readouterr().err == f"llmc-fsm oneshot: error: {message}\n"
    assert _names(tmp_path) == ["README.md"]
    assert (tmp_path / "README.md").read_text() == "# readme\n"


def test_output_that_is_a_regular_file(tmp_path, no_model_loading, capsys):
    out = tmp_path / "model.txt"
    out.write_text("keep me\n")
    message = (
        f"output {str(out)!r} exists and is not a directory; choose a new directory for the output (e.g. "
        "--output out/my-model), or move the file away"
    )
    _refused_before_loading(out, FileExistsError, message)
    assert main(["oneshot", "--no-progress", "--output", str(out)]) == 1
    assert capsys.readouterr().err == f"llmc-fsm oneshot: error: {message}\n"
    assert _names(tmp_path) == ["model.txt"]
    assert out.read_text() == "keep me\n"


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs Linux /sys")
def test_output_under_sys(no_model_loading):
    reason = "Operation not permitted" if os.geteuid() == 0 else "Permission denied"  # mkdir vs the access check
    message = f"cannot write the output directory '/sys/llmc-fsm-out': cannot create files in '/sys' ({reason})"
    _refused_before_loading("/sys/llmc-fsm-out", PermissionError, message)
    _refused_before_loading("/sys/a/b/out", PermissionError, message.replace("/sys/llmc-fsm-out", "/sys/a/b/out"))
    assert not Path("/sys/llmc-fsm-out").exists() and not Path("/sys/a").exists()


def test_output_in_an_unwritable_parent(tmp_path, no_model_loading, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: let the permission check see what another user would
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == parent else real_access(p, mode))
    try:
        message = (
            f"cannot write the output directory {str(parent / 'a' / 'out')!r}: cannot create files in {str(parent)!r} "
        )
        _refused_before_loading(parent / "a" / "out", PermissionError, message + "(Permission denied)")
        assert _names(parent) == []
    finally:
        parent.chmod(0o755)


def test_output_on_a_read_only_mount_says_so(tmp_path, no_model_loading, monkeypatch):
    """A read-only mount was reported as "Permission denied" (session 28's left item): the mode was fine, the mount
    is what to change. The mount is simulated as the kernel reports one (statvfs's ST_RDONLY, access() false)."""
    parent = tmp_path / "mnt"
    parent.mkdir()
    real_access, real_statvfs = os.access, os.statvfs

    class _ReadOnly:
        def __init__(self, real):
            self._real = real
            self.f_flag = real.f_flag | os.ST_RDONLY

    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == parent else real_access(p, mode))
    monkeypatch.setattr(os, "statvfs", lambda p: _ReadOnly(real_statvfs(p)) if Path(p) == parent else real_statvfs(p))
    message = f"cannot write the output directory {str(parent / 'out')!r}: cannot create files in {str(parent)!r} "
    _refused_before_loading(parent / "out", PermissionError, message + "(Read-only file system)")
    assert _names(parent) == []


# --------------------------------------------------------------------------- case 7: SIGTERM, Ctrl-C, stale work dirs
def _cli_args(tiny_model_dir, out: Path, *extra: str) -> list[str]:
    # --in-memory: what these cases check (per-layer progress, the load and save phases) is the in-memory path's;
    # the CLI streams such a job by default (tests/test_cli_streaming_default.py)
    return tiny_llama.oneshot_argv(*tiny_model_dir, out, "--num-samples", "8", "--in-memory", *extra)


def test_sigterm_before_any_layer_leaves_nothing(tiny_model_dir, tmp_path):
    run = tiny_llama.run_cli(_cli_args(tiny_model_dir, tmp_path / "new" / "out"), signal_at="load:SIGTERM")
    assert run.returncode == 143
    assert run.stderr == "llmc-fsm oneshot: interrupted (SIGTERM); nothing written\n"
    assert _names(tmp_path) == []  # the work directory and the parent it created are gone


def test_sigterm_during_save_keeps_the_layers_and_resume_finishes(tiny_model_dir, tmp_path):
    run = tiny_llama.run_cli(_cli_args(tiny_model_dir, tmp_path / "out"), signal_at="save:SIGTERM")
    work = tmp_path / ".out.work"
    assert run.returncode == 143
    assert run.stderr == (
        f"llmc-fsm oneshot: interrupted (SIGTERM); progress kept in {str(work)!r} (4 of 4 decoder layers done): "
        "run the same command with --resume (resume=True) to continue, or remove that directory\n"
    )
    assert _names(tmp_path) == [".out.work"]
    assert "output" not in _names(work)  # the half-written output is removed
    again = tiny_llama.run_cli(_cli_args(tiny_model_dir, tmp_path / "out", "--resume"))
    assert again.returncode == 0, again.stderr
    assert _names(tmp_path) == ["out"]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["sparsity"]["total_targeted"] == 0.5


@pytest.mark.parametrize("started_with", ["SIGINT handled", "SIGINT ignored"])
def test_ctrl_c_mid_run_is_one_line_with_exit_130(tiny_model_dir, tmp_path, started_with):
    """Ctrl-C after layer 0. "SIGINT ignored": the CLI started as a background job of a shell without job control
    starts with SIGINT ignored (inherited through exec) and Python installs no KeyboardInterrupt handler; the run
    then finished (exit 0, nothing on stderr) — the harness now delivers SIGINT as a terminal's Ctrl-C either way
    (tiny_llama.CLI_WITH_SIGNAL)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if started_with == "SIGINT ignored" else None
    try:
        run = tiny_llama.run_cli(_cli_args(tiny_model_dir, tmp_path / "out"), signal_at="layer:0:SIGINT")
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    assert run.returncode == 130, run.stderr
    assert run.stderr == (
        f"llmc-fsm oneshot: interrupted (Ctrl-C); progress kept in {str(tmp_path / '.out.work')!r} (1 of 4 decoder "
        "layers done): run the same command with --resume (resume=True) to continue, or remove that directory\n"
    )


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_a_second_interrupt_during_the_clean_up_changes_nothing(tiny_model_dir, tmp_path, signal_name):
    """A double Ctrl-C (2 ms apart): the second cut the clean-up, which then said "nothing written" over the kept
    progress, or printed a traceback from an atexit callback. The first interrupt now ignores further ones."""
    run = tiny_llama.run_cli(_cli_args(tiny_model_dir, tmp_path / "out"), signal_at=f"layer:0:{signal_name}x2")
    what = "Ctrl-C" if signal_name == "SIGINT" else "SIGTERM"
    assert (run.returncode, run.stderr) == (130 if signal_name == "SIGINT" else 143, (
        f"llmc-fsm oneshot: interrupted ({what}); progress kept in {str(tmp_path / '.out.work')!r} (1 of 4 decoder "
        "layers done): run the same command with --resume (resume=True) to continue, or remove that directory\n"
    ))  # fmt: skip


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    return int(proc.stdout)


def test_stale_work_dir_of_a_dead_owner_is_cleaned_up(tmp_path):
    work = tmp_path / ".o.work"
    (work / "output").mkdir(parents=True)
    (work / "output" / "model.safetensors").write_bytes(b"\0" * 1000)  # a save killed half-way
    (work / "owner.lock").touch()
    (work / "owner.json").write_text(json.dumps({"pid": _dead_pid(), "host": "h", "started": "t"}))
    llmc_fsm.oneshot(model=_tiny_module(), dataset=DATA, output_dir=tmp_path / "o", progress=False)
    assert _names(tmp_path) == ["o"]


def test_a_live_owners_work_dir_is_never_touched(tmp_path):
    work = tmp_path / ".o.work"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import json, os, sys, time; from filelock import FileLock; w = sys.argv[1]; os.makedirs(w + '/output');"
            "lock = FileLock(w + '/owner.lock'); lock.acquire();"
            "json.dump({'pid': os.getpid(), 'host': 'hostA', 'started': '2026-01-01T00:00:00+00:00'},"
            " open(w + '/owner.json', 'w')); print('held', flush=True); time.sleep(60)",
            str(work),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        before = sorted(str(p) for p in work.rglob("*"))
        with pytest.raises(FileExistsError) as info:
            llmc_fsm.oneshot(model=_tiny_module(), dataset=DATA, output_dir=tmp_path / "o", progress=False)
        assert str(info.value) == (
            f"output {str(tmp_path / 'o')!r} is being written by another run (pid {holder.pid} on hostA, since "
            "2026-01-01T00:00:00+00:00); wait for it to finish or choose another output directory"
        )
        assert sorted(str(p) for p in work.rglob("*")) == before
    finally:
        holder.kill()
        holder.wait()


def test_an_output_moved_aside_by_a_killed_swap_is_restored(tmp_path):
    work = tmp_path / ".o.work"
    (work / "previous").mkdir(parents=True)
    (work / "previous" / "report.json").write_text("{}")
    with pytest.raises(FileExistsError, match="exists and is not empty; pass overwrite=True"):
        llmc_fsm.oneshot(model=_tiny_module(), dataset=DATA, output_dir=tmp_path / "o", progress=False)
    assert (tmp_path / "o" / "report.json").read_text() == "{}"


# --------------------------------------------------------------------------- case 14: reports and progress bars
def test_sequential_pruned_through_the_api_reports_its_targets():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    llmc_fsm.oneshot(
        model=model, recipe={"s": {"MagnitudePruningModifier": {"sparsity": 0.5, "ignore": []}}}, progress=False
    )
    report = model.llmc_fsm_report
    assert report.targeted == ["0", "2"]
    assert report.total_sparsity == 0.5
    assert report.format_table().splitlines()[:7] == [
        "model: Sequential",
        "calibration: none (no modifier needs calibration data)",
        "      0          64    50.00%",
        "      2          32    50.00%",
        "  total          96    50.00%   (targeted weights)",
        "",
        "perplexity: not measured (pass --eval-text FILE)",
    ]


def test_no_progress_silences_library_bars_and_restores_the_callers_settings(tmp_path, capfd):
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    from llmc_fsm.models.known import load_model

    pytest.importorskip("llmc_fsm_quantization")
    quantized = tmp_path / "q"
    llmc_fsm.oneshot(
        model=_tiny_module(),
        recipe={"q": {"QuantizationModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 32}}}}},
        dataset=DATA,
        output_dir=quantized,
        progress=False,
    )
    assert capfd.readouterr().err == ""  # transformers' "Writing model shards" is silenced too
    load_model(quantized)  # loading a compressed-tensors model draws transformers' and compressed-tensors' bars
    err = capfd.readouterr().err
    assert "Loading weights" in err and "Applying quantization config" in err and "Compressing model" in err
    with quiet_progress():
        load_model(quantized)
    assert capfd.readouterr().err == ""
    # the caller's settings come back as they were, whichever they were
    assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()
    modules = [sys.modules[name] for name in TQDM_MODULES]
    originals = [m.tqdm for m in modules]
    hf_logging.disable_progress_bar()
    try:
        with quiet_progress():
            assert [m.tqdm(range(2)).disable for m in modules] == [True] * 3
        assert not hf_logging.is_progress_bar_enabled() and are_progress_bars_disabled()
    finally:
        hf_logging.enable_progress_bar()
    assert [m.tqdm for m in modules] == originals
    assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()


def test_weights_disk_bytes_counts_weight_files_only(tmp_path):
    import torch

    from llmc_fsm.output.save import weights_disk_bytes

    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x" * 100)
    (d / "tokenizer.json").write_bytes(b"y" * 1000)  # not weights: not counted
    model = torch.nn.Linear(2, 2)
    model.name_or_path = str(d)
    assert weights_disk_bytes(Path("smollm2-135m"), model) == 100  # a known name: the directory it was loaded from
    assert weights_disk_bytes(d, model) == 100
    (d / "model.safetensors").unlink()
    assert weights_disk_bytes(d, model) == (4 + 2) * 4  # no weight file: the fp32 parameters' size


def test_a_finished_quantized_output_is_not_told_to_start_from_the_full_precision_model(tmp_path):
    """Rerunning (or resuming) into a finished quantized output said "a quantized model is not compressed further:
    start from the full-precision one", though the user had given the full-precision model (found by a tester)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("{}")
    (out / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}}))
    with pytest.raises(FileExistsError) as err:
        check_output_dir(out, overwrite=False)
    assert str(err.value) == (
        f"output directory {str(out)!r} exists and is not empty; pass overwrite=True (--overwrite) to replace it. It "
        "holds a finished run (report.json), so there is nothing to resume"
    )
