"""session.save(dir) removes only files it wrote (found by a tester: it deleted every tensors-*.safetensors and
hidden .*.tmp in the directory, other programs' files too)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from llmc_fsm import Session
from llmc_fsm.session.checkpoint_io import read_checkpoint, write_checkpoint

#: Files another program keeps in the directory: name -> bytes.
OTHERS = {
    "notes.txt": b"mine",
    "tensors-mine.safetensors": b"mine",
    "tensors-0123456789abcdef.safetensors": b"a name like ours, not its digest",
    "session.json.tmp": b"mine",
    ".editor.tmp": b"mine",
}


def _ours(path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name not in OTHERS)


def _tensor_name(value: float) -> str:
    """The tensor file write_checkpoint writes for {"w": tensor([value])}, computed from its bytes."""
    from safetensors.torch import save

    return f"tensors-{hashlib.sha256(save({'w': torch.tensor([value])})).hexdigest()[:16]}.safetensors"


def test_saving_twice_keeps_other_files_and_removes_the_previous_tensor_file(tmp_path):
    for name, data in OTHERS.items():
        (tmp_path / name).write_bytes(data)
    write_checkpoint({"w": torch.tensor([1.0])}, tmp_path)
    assert _ours(tmp_path) == sorted([".session.lock", "session.json", _tensor_name(1.0)])
    write_checkpoint({"w": torch.tensor([2.0])}, tmp_path)
    assert _ours(tmp_path) == sorted([".session.lock", "session.json", _tensor_name(2.0)])  # the step-1 tensor file is gone
    assert {name: (tmp_path / name).read_bytes() for name in OTHERS} == OTHERS
    assert torch.equal(read_checkpoint(tmp_path)["w"], torch.tensor([2.0]))


def test_session_save_keeps_other_files(tmp_path):
    """The tester's case, through Session.save."""
    for name, data in OTHERS.items():
        (tmp_path / name).write_bytes(data)
    session = Session([])
    session.initialize()
    session.save(tmp_path)
    session.save(tmp_path)
    session.finalize()
    assert {name: (tmp_path / name).read_bytes() for name in OTHERS} == OTHERS
    named = json.loads((tmp_path / "session.json").read_text())["tensors"]
    assert _ours(tmp_path) == sorted([".session.lock", "session.json", named])


def test_leftovers_of_a_killed_save_are_removed(tmp_path):
    """A tensor file whose name holds its own digest (written, manifest not swapped) and the temporary file of a
    process that no longer runs are ours: removed; a temporary file of a running process is left alone."""
    from safetensors.torch import save

    write_checkpoint({"w": torch.tensor([1.0])}, tmp_path)
    (tmp_path / _tensor_name(3.0)).write_bytes(save({"w": torch.tensor([3.0])}))  # killed before its manifest
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = f".session.json.{int(done.stdout)}-0badc0de.tmp"
    alive = f".{_tensor_name(4.0)}.{os.getpid()}-0badc0de.tmp"
    (tmp_path / dead).write_bytes(b"half")
    (tmp_path / alive).write_bytes(b"being written")
    write_checkpoint({"w": torch.tensor([2.0])}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".session.lock", alive, "session.json", _tensor_name(2.0)])


def test_saving_to_a_file_is_refused_and_leaves_it(tmp_path):
    target = tmp_path / "ckpt"
    target.write_bytes(b"x")
    with pytest.raises(NotADirectoryError) as info:
        write_checkpoint({"w": torch.tensor([1.0])}, target)
    assert str(info.value) == (
        f"cannot save a session checkpoint to {target}: it is a file, not a directory; give a directory path"
    )
    assert target.read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize(("content", "why"), [('{"my": "own notes"}', "format None, not 'llmc-fsm-session'"),
                                              ("notes\n", "not JSON")])
def test_a_session_json_another_program_wrote_is_not_replaced(tmp_path, content, why) -> None:
    """A save replaced a user's own session.json without a word (found by a tester)."""
    (tmp_path / "session.json").write_text(content)
    with pytest.raises(FileExistsError) as info:
        write_checkpoint({"step": 1, "w": torch.ones(2)}, tmp_path)
    assert str(info.value) == (
        f"cannot save a session checkpoint to {tmp_path}: its session.json is not an llmc-fsm session checkpoint "
        f"({why}) and would be replaced; save to another directory, or remove that file first")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session.json"]
    assert (tmp_path / "session.json").read_text() == content
    write_checkpoint({"step": 1, "w": torch.ones(2)}, tmp_path / "own")
    write_checkpoint({"step": 2, "w": torch.zeros(2)}, tmp_path / "own")  # its own manifest: replaced
    assert read_checkpoint(tmp_path / "own")["step"] == 2


def test_two_saves_to_one_directory_take_turns(tmp_path, monkeypatch):
    """Two threads saving to one directory: the second save's cleanup removed the tensor file the first had just
    written, before the first's manifest named it, so the checkpoint did not load (8 of 40 tries; found by a
    tester). Here the first save stops after its tensor file until the second has finished or waited 0.5 s."""
    from llmc_fsm.session import checkpoint_io

    first_wrote, second_done, write = threading.Event(), threading.Event(), checkpoint_io._write_atomic

    def slow(target, data):
        write(target, data)
        if threading.current_thread().name == "first" and target.name.startswith("tensors-"):
            first_wrote.set()
            second_done.wait(0.5)

    monkeypatch.setattr(checkpoint_io, "_write_atomic", slow)
    first = threading.Thread(target=write_checkpoint, args=({"w": torch.tensor([1.0])}, tmp_path), name="first")
    first.start()
    assert first_wrote.wait(30)
    write_checkpoint({"w": torch.tensor([2.0])}, tmp_path)
    second_done.set()
    first.join()
    assert torch.equal(read_checkpoint(tmp_path)["w"], torch.tensor([2.0]))  # the later save's, complete
    assert sorted(p.name for p in tmp_path.iterdir()) == [".session.lock", "session.json", _tensor_name(2.0)]
