"""Issue 27: a full disk (or a vanished folder) at any write point keeps the resumable progress.

Each write point of a one-shot run with an output directory is made to fail as a full disk does — safetensors'
``SafetensorError`` (not an ``OSError``) where safetensors writes, ``OSError(ENOSPC)`` where Python writes — and
the run must end with one ``OSError`` naming the path, a note saying ``--resume`` continues, the saved layers
kept, no output, and ``resume=True`` finishing with the same weights as an uninterrupted run.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import tiny_llama
import torch
from safetensors import SafetensorError

import llmc_fsm
from llmc_fsm.cli.main import main

pytest.importorskip("transformers")
pytest.importorskip("llmc_fsm_pruning")

FULL = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
#: safetensors' other spelling (found by a newcomer with ``ulimit -f``: it was reported as "[Errno 5] writing failed")
TOO_LARGE = 'Error while serializing: IoError(Custom { kind: Other, error: "File too large (os error 27)" })'


def _tiny():
    return tiny_llama.llama(vocab=96, hidden=32, layers=3, heads=2, kv_heads=1, positions=2048)


def _data():
    return torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(1))


KW = {"recipe": {"p": {"SparseGPTModifier": {"sparsity": 0.5}}}, "batch_size": 4, "progress": False}


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run's weights."""
    return llmc_fsm.oneshot(model=_tiny(), dataset=_data(), **KW).state_dict()


def _listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def _fail_layer(m, layer: int, error: Exception) -> None:
    import llmc_fsm.oneshot_job.resume as resume

    original = resume.save_file

    def save_file(tensors, filename, metadata=None):
        if f"layer-{layer:05d}" in filename:
            raise error
        return original(tensors, filename, metadata=metadata)

    m.setattr(resume, "save_file", save_file)


def _fail_weights(m, layer: int, error: Exception) -> None:
    import transformers.modeling_utils as modeling_utils

    def safe_save_file(*a, **k):
        raise error

    m.setattr(modeling_utils, "safe_save_file", safe_save_file)


def _fail_text(name: str):
    def patch(m, layer: int, error: Exception) -> None:
        original = Path.write_text

        def write_text(self, *a, **k):
            if self.name == name:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
            return original(self, *a, **k)

        m.setattr(Path, "write_text", write_text)

    return patch


def _fail_publish(m, layer: int, error: Exception) -> None:
    original = os.rename

    def rename(src, dst):
        if Path(src).name == "output":  # the staging folder renamed into place: the output folder vanished
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(src))
        return original(src, dst)

    m.setattr(os, "rename", rename)


def _enospc(path: str) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


PARTIAL = "{work}/progress/pass-0/layer-00001.safetensors.partial"
# (id, patch, what the writer raises, layers saved when it fails, expected str(error); {work} = the work directory)
POINTS = [
    ("layer-safetensors", _fail_layer, lambda w: SafetensorError(FULL), 1,
     "[Errno 28] No space left on device: '{work}/progress/pass-0/layer-00001.safetensors'"),  # the file (2026-12-07)
    ("layer-too-large", _fail_layer, lambda w: SafetensorError(TOO_LARGE), 1,
     "[Errno 27] File too large: '{work}/progress/pass-0/layer-00001.safetensors'"),  # fmt: skip
    ("layer-oserror", _fail_layer, lambda w: _enospc(PARTIAL.format(work=w)), 1, f"[Errno 28] No space left on device: '{PARTIAL}'"),
    ("final-weights", _fail_weights, lambda w: SafetensorError(FULL), 3, "[Errno 28] No space left on device: '{work}'"),
    ("recipe.yaml", _fail_text("recipe.yaml"), None, 3, "[Errno 28] No space left on device: '{work}/output/recipe.yaml'"),
    ("report.json", _fail_text("report.json"), None, 3, "[Errno 28] No space left on device: '{work}/output/report.json'"),
    ("publish", _fail_publish, None, 3, "[Errno 2] No such file or directory: '{work}/output'"),
]


@pytest.mark.parametrize(("patch", "error", "saved", "expected"), [p[1:] for p in POINTS], ids=[p[0] for p in POINTS])
def test_a_full_disk_at_each_write_point_keeps_the_progress_and_resume_finishes(
    tmp_path, monkeypatch, reference, patch, error, saved, expected
):
    ref = reference
    out, work = tmp_path / "o", tmp_path / ".o.work"
    with monkeypatch.context() as m:
        patch(m, 1, error(work) if error else None)
        with pytest.raises(OSError) as info:
            llmc_fsm.oneshot(model=_tiny(), dataset=_data(), output_dir=out, **KW)
    assert str(info.value) == expected.format(work=work, out=out)
    assert info.value.__notes__[-1] == (
        f"progress kept in {str(work)!r} ({saved} of 3 decoder layers done): run the same command with --resume "
        "(resume=True) to continue, or remove that directory"
    )
    assert not out.exists()
    layers = [f"progress/pass-0/layer-{i:05d}.safetensors" for i in range(saved)]
    assert [f for f in _listing(work) if f.startswith("progress/pass-0/")] == layers  # kept, no partial file
    resumed = llmc_fsm.oneshot(model=_tiny(), dataset=_data(), output_dir=out, resume=True, **KW).state_dict()
    assert [k for k in ref if not torch.equal(ref[k], resumed[k])] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    assert (out / "model.safetensors").is_file() and (out / "report.json").is_file()


def test_the_cli_says_it_in_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    out, work = tmp_path / "out", tmp_path / ".out.work"
    with monkeypatch.context() as m:
        _fail_layer(m, 2, SafetensorError(FULL))
        argv = tiny_llama.oneshot_argv(*tiny_model_dir, out, "--num-samples", "8", "--batch-size", "4", "--in-memory")
        status = main(argv)  # --in-memory: per-layer progress is the in-memory path's (the CLI streams by default)
    err = capsys.readouterr().err
    assert status == 1
    assert err == (
        f"llmc-fsm oneshot: error: [Errno 28] No space left on device: "
        f"{str(work / 'progress' / 'pass-0' / 'layer-00002.safetensors')!r}; progress kept in "
        f"{str(work)!r} (2 of 4 decoder layers done): run the same command with --resume (resume=True) to "
        "continue, or remove that directory\n"
    )
    assert sorted(p.name for p in (work / "progress" / "pass-0").iterdir()) == [
        "layer-00000.safetensors",
        "layer-00001.safetensors",
    ]


def test_a_corrupt_input_file_is_not_reported_as_a_write_failure(tiny_model_dir, tmp_path, capsys):
    """A truncated model.safetensors, with an output: the error chain holds safetensors' header error, which was
    taken for a failed write ("[Errno 5] writing failed (safetensors: ... incomplete metadata ...)" on the output's
    work directory; found by a tester). It is the input's one line, as without an output."""
    import shutil

    from llmc_fsm.output.workdir import write_failure

    model_dir, text = tiny_model_dir
    source = tmp_path / "trunc"
    shutil.copytree(model_dir, source)
    with open(source / "model.safetensors", "r+b") as handle:
        handle.truncate(5000)
    lines = []
    for extra in ([], ["--in-memory"]):
        argv = tiny_llama.oneshot_argv(source, text, tmp_path / "out", "--method", "gptq", "--group-size", "32", *extra)
        assert main(argv) == 1
        lines.append(capsys.readouterr().err.strip().splitlines()[-1])
    expected = (
        f"llmc-fsm oneshot: error: {source / 'model.safetensors'}: not a valid safetensors file (SafetensorError: "
        "Error while deserializing header: incomplete metadata, file not fully covered); it is probably truncated or "
        "corrupt: copy or save the model again"
    )
    assert lines == [expected, expected]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trunc"]
    assert write_failure(ValueError("x")) is None
    assert isinstance(write_failure(SafetensorError(FULL)), SafetensorError)
    assert write_failure(SafetensorError("Error while deserializing header: incomplete metadata")) is None  # a read
    try:
        try:
            raise SafetensorError(FULL)
        except SafetensorError:
            raise ValueError("another error, raised from None") from None
    except ValueError as exc:
        assert write_failure(exc) is None  # a suppressed context is not followed


def test_ctrl_c_right_after_the_old_output_is_moved_aside_puts_it_back(tmp_path, monkeypatch):
    """``publish`` moves an earlier output to ``previous`` and the new one into place; a Ctrl-C landing right after
    the first rename (outside its ``try``) left the old output only in ``previous`` (a tester's case)."""
    import llmc_fsm.output.workdir as workdir

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    work = workdir.WorkDir.claim(out)
    work.staging.mkdir()
    (work.staging / "new.txt").write_text("new")
    real = os.rename
    calls = []

    def rename_then_interrupt(src, dst):
        real(src, dst)
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(workdir.os, "rename", rename_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        work.publish()
    assert calls == [("out", "previous"), ("previous", "out")]
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    work.release()
