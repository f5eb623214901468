"""One-shot's inputs on resume and the work directory around publishing (found by a tester, session 34).

A resume with another tokenizer, a changed method, an unreadable progress file or ``dtype="auto"``; an interrupt
or a SIGKILL once the output is in place; ``quantization_format`` with AWQ's older form (its own scheme).
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys

import pytest
import tiny_llama
import torch
from safetensors.torch import load_file, save_file

import llmc_fsm
from llmc_fsm.oneshot_job.resume import LayerProgress, _model_item
from llmc_fsm.output.directory import check_output_dir
from llmc_fsm.output.workdir import WorkDir, fingerprint_changes

pytest.importorskip("transformers")

WORKDIR_LOG = "llmc_fsm.output.workdir"
SPARSE = {"p": {"SparseGPTModifier": {"sparsity": 0.5}}}


def _kw(tiny_model_dir, **extra):
    model, text = tiny_model_dir
    return {
        "model": str(model),
        "recipe": SPARSE,
        "dataset": str(text),
        "num_calibration_samples": 8,
        "max_seq_length": 32,
        "progress": False,
        **extra,
    }


@contextlib.contextmanager
def stopped_after_layer(monkeypatch, layer: int = 1):
    """Inside the block, Ctrl-C (``KeyboardInterrupt``) right after decoder layer ``layer`` is saved."""
    original = LayerProgress.save

    def save(self, index, module):
        original(self, index, module)
        if index == layer:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(LayerProgress, "save", save)
        yield


def _interrupted(monkeypatch, kw: dict, layer: int = 1) -> None:
    """``llmc_fsm.oneshot(**kw)`` stopped by Ctrl-C right after decoder layer ``layer`` is saved."""
    with stopped_after_layer(monkeypatch, layer), pytest.raises(KeyboardInterrupt):
        llmc_fsm.oneshot(**kw)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == WORKDIR_LOG and r.levelno == logging.WARNING]


# --------------------------------------------------------------------------- AWQ's own scheme and the format
def test_awq_with_its_own_scheme_takes_quantization_format(tiny_model_dir, tmp_path):
    """AWQModifier with ``scheme`` (the older form, AWQ quantizes itself) and ``quantization_format`` was refused:
    "the recipe quantizes no weights: leave it out", though the same run without it quantized every Linear."""
    pytest.importorskip("llmc_fsm_quantization")
    scheme = {"preset": "W4A16_ASYM", "weights": {"group_size": 32}}
    recipe = {"q": {"AWQModifier": {"ignore": ["lm_head"], "scheme": scheme}}}
    out = tmp_path / "out"
    llmc_fsm.oneshot(**_kw(tiny_model_dir, recipe=recipe, output_dir=out, quantization_format="pack-quantized"))
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized"
    keys = load_file(str(out / "model.safetensors"))
    assert sorted(k for k in keys if k.startswith("model.layers.0.self_attn.q_proj.")) == [
        "model.layers.0.self_attn.q_proj.weight_packed",
        "model.layers.0.self_attn.q_proj.weight_scale",
        "model.layers.0.self_attn.q_proj.weight_shape",
        "model.layers.0.self_attn.q_proj.weight_zero_point",
    ]


# --------------------------------------------------------------------------- the tokenizer
def test_resume_with_another_tokenizer_directory_is_refused_naming_it(tiny_model_dir, tmp_path, monkeypatch):
    """A resume with another ``tokenizer=`` went on silently: the first tokenizer's saved calibration windows were
    reused and the output shipped the second tokenizer's files."""
    model, text = tiny_model_dir
    other = tmp_path / "other-tokenizer"
    words = " ".join(reversed(text.read_text().split()))
    tiny_llama.word_tokenizer(words, vocab_size=100).save_pretrained(other)
    out = tmp_path / "out"
    _interrupted(monkeypatch, _kw(tiny_model_dir, tokenizer=str(model), output_dir=out))
    work = tmp_path / ".out.work"
    before = sorted(p.name for p in (work / "progress" / "pass-0").iterdir())
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(**_kw(tiny_model_dir, tokenizer=str(other), output_dir=out, resume=True))
    assert str(err.value) == (
        f"cannot resume from {str(work)!r}: tokenizer (directory {str(model.resolve())!r} -> "
        f"{str(other.resolve())!r}) — changed since that run; use the original settings, or remove that directory "
        "to start over"
    )
    assert sorted(p.name for p in (work / "progress" / "pass-0").iterdir()) == before


def test_resume_takes_the_same_tokenizer_object_rebuilt_and_refuses_another(tiny_model_dir, tmp_path, monkeypatch):
    """A tokenizer object: the same one built again resumes (its files' digest, not its identity), another is
    refused; before, any tokenizer object resumed."""
    text = tiny_model_dir[1].read_text()
    out = tmp_path / "out"
    _interrupted(monkeypatch, _kw(tiny_model_dir, tokenizer=tiny_llama.word_tokenizer(text), output_dir=out))
    other_words = " ".join(reversed(text.split()))  # the same words: a smaller vocabulary makes it another
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(
            **_kw(tiny_model_dir, tokenizer=tiny_llama.word_tokenizer(other_words, 100), output_dir=out, resume=True)
        )
    message = str(err.value)
    assert message.startswith(f"cannot resume from {str(tmp_path / '.out.work')!r}: tokenizer (a ")
    assert message.count(" object (sha256 ") == 2
    assert message.endswith(
        ") — changed since that run; use the original settings, or remove that directory to start over"
    )
    llmc_fsm.oneshot(**_kw(tiny_model_dir, tokenizer=tiny_llama.word_tokenizer(text), output_dir=out, resume=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --------------------------------------------------------------------------- the method changed
def test_model_files_hashed_and_stat_ed_are_not_compared(tiny_model_dir):
    """A calibrated run (model files by sha256) resumed as a data-free one (sizes and modification times) listed
    every model file as changed beside the recipe; only the recipe differs."""
    model = tiny_model_dir[0]
    saved = {"model": _model_item(str(model), True), "recipe": {"method": "gptq"}}
    current = {"model": _model_item(str(model), False), "recipe": {"method": "rtn"}}
    assert fingerprint_changes(saved, current) == ["recipe (method 'gptq' -> 'rtn')"]
    changed = {"model": {**current["model"], "files": {"config.json": [1, 2]}}, "recipe": {"method": "rtn"}}
    assert fingerprint_changes(current, changed) == [
        "model (files changed: config.json, generation_config.json, model.safetensors, tokenizer.json, "
        "tokenizer_config.json)"
    ]


# --------------------------------------------------------------------------- unreadable progress
def test_an_unreadable_layer_file_is_named_and_not_counted(tmp_path, caplog):
    """A truncated layer file was silently computed again while the message said "resuming ... (5 of 8 decoder
    layers done)"."""
    out = tmp_path / "out"
    first = WorkDir.claim(out)
    first.settle({"x": 1}, resume=False)
    layers = first.progress / "pass-0"
    layers.mkdir(parents=True)
    (first.progress / "layout.json").write_text('{"num_layers": 8, "passes": 1}\n')
    for index in range(5):
        save_file({"w": torch.zeros(4)}, str(layers / f"layer-{index:05d}.safetensors"))
    with (layers / "layer-00001.safetensors").open("r+b") as fh:
        fh.truncate(100)
    first._lock.release()  # its process died
    with caplog.at_level(logging.WARNING, logger=WORKDIR_LOG):
        again = WorkDir.claim(out)
        again.settle({"x": 1}, resume=True)
    assert _warnings(caplog) == [
        f"saved progress {layers / 'layer-00001.safetensors'} cannot be read (truncated or corrupt): decoder layer 1 "
        "and the layers after it are computed again",
        f"resuming from {tmp_path / '.out.work'} (1 of 8 decoder layers done)",
    ]
    again.release()


# --------------------------------------------------------------------------- dtype auto
def test_resume_with_dtype_auto_of_a_float32_checkpoint_run_in_float32(tiny_model_dir, tmp_path, monkeypatch):
    """``dtype="auto"`` resolves to the config's float32: a float32 run resumed with it was refused as
    ``pipeline (dtype 'float32' -> 'auto')``."""
    assert json.loads((tiny_model_dir[0] / "config.json").read_text())["dtype"] == "float32"
    ref = tmp_path / "ref"
    llmc_fsm.oneshot(**_kw(tiny_model_dir, dtype="float32", output_dir=ref))
    out = tmp_path / "out"
    _interrupted(monkeypatch, _kw(tiny_model_dir, dtype="float32", output_dir=out))
    llmc_fsm.oneshot(**_kw(tiny_model_dir, dtype="auto", output_dir=out, resume=True))
    a, b = load_file(str(ref / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


# --------------------------------------------------------------------------- after the output is in place
def test_interrupt_while_removing_the_work_directory_finishes_publishing(tmp_path, monkeypatch, caplog):
    """Ctrl-C / SIGTERM while the work directory was removed after the output was in place raised: the command said
    "interrupted (SIGTERM); nothing written" and exited 143 though the output was complete."""
    out = tmp_path / "out"
    work = WorkDir.claim(out)
    work.settle({"x": 1}, resume=False)
    work.staging.mkdir()
    (work.staging / "report.json").write_text("{}\n")
    real = WorkDir._remove
    calls = []

    def remove_interrupted(self):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real(self)

    monkeypatch.setattr(WorkDir, "_remove", remove_interrupted)
    with caplog.at_level(logging.WARNING, logger=WORKDIR_LOG):
        try:
            work.publish()
        except KeyboardInterrupt:
            pytest.fail("publish raised the interrupt that came once the output was in place")
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]
    assert _warnings(caplog) == [
        f"interrupted (Ctrl-C) after the output was complete in {out}: its work directory is removed and the run "
        "finishes"
    ]


#: ``llmc-fsm ARGV`` with SIGNAL (argv[1]) sent to itself when the work directory starts being removed after publish
CLI_SIGNAL_AT_REMOVE = """
import os, signal, sys
import llmc_fsm.output.workdir as workdir
original = workdir.WorkDir._remove
def remove(self):
    if self._published:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return original(self)
workdir.WorkDir._remove = remove
from llmc_fsm.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _cli(*args: str) -> subprocess.CompletedProcess:
    env_cmd = [sys.executable, "-c", CLI_SIGNAL_AT_REMOVE, *args]
    return subprocess.run(env_cmd, capture_output=True, text=True, timeout=300, check=False)


def test_sigterm_after_publish_exits_0_with_the_output_complete(tiny_model_dir, tmp_path):
    """The command, SIGTERM while the work directory was removed: "interrupted (SIGTERM); nothing written", exit
    143, although the output was complete."""
    out = tmp_path / "out"
    run = _cli("SIGTERM", *tiny_llama.oneshot_argv(*tiny_model_dir, out, "--num-samples", "8"))
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines()[-1] == (
        f"WARNING {WORKDIR_LOG}: interrupted (SIGTERM) after the output was complete in {out}: its work directory is "
        "removed and the run finishes"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "report.json").is_file()


def test_sigkill_after_publish_leaves_a_leftover_that_is_not_sent_to_resume(tiny_model_dir, tmp_path):
    """SIGKILL after the output was in place left its work directory; a rerun said to resume a run "replacing it",
    and --overwrite was refused with "an interrupted run left its progress ... --resume"."""
    out, work = tmp_path / "out", tmp_path / ".out.work"
    argv = tiny_llama.oneshot_argv(*tiny_model_dir, out, "--num-samples", "8")
    killed = _cli("SIGKILL", *argv)
    assert killed.returncode == -9
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.work", "out"]
    assert (work / "progress" / "pass-0" / "layer-00003.safetensors").is_file()
    with pytest.raises(FileExistsError) as err:
        check_output_dir(out, overwrite=False)
    assert str(err.value) == (
        f"output directory {str(out)!r} exists and is not empty; pass overwrite=True (--overwrite) to replace it. It "
        "holds a finished run (report.json), so there is nothing to resume; to compress that model further, give it "
        f"as the model (model=DIR, --model DIR) with a new output directory. {str(work)!r} is left over from that run "
        "(stopped before removing it): nothing in it is to resume, delete it"
    )
    again = tiny_llama.run_cli([*argv, "--overwrite"])
    assert again.returncode == 0, again.stderr
    assert again.stderr.splitlines()[0] == (
        f"WARNING {WORKDIR_LOG}: removing {work}: the run that wrote {out} finished (its report.json) and was stopped "
        "before removing it"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
