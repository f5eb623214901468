"""Session checkpoints (issue 10): state_dict/load_state_dict, save/load, mismatches, atomic writes, compact masks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest
import torch
from llmc_fsm_pruning.constant import ConstantPruningModifier
from llmc_fsm_pruning.magnitude import MagnitudePruningModifier
from llmc_fsm_training import LearningRateModifier
from torch import nn

from llmc_fsm import CheckpointError, LifecycleError, Modifier, Session
from llmc_fsm.session.checkpoint import MANIFEST, read_checkpoint, write_checkpoint
from llmc_fsm.toolkit.masks import pack_mask, unpack_mask

REPO = Path(__file__).resolve().parents[1]


@attrs.define(kw_only=True, slots=False, eq=False)
class Counter(Modifier):
    """Counts optimizer steps in a tensor and a JSON value; can refuse to load."""

    events = frozenset({"optim_post_step"})
    refuse_load: bool = attrs.field(default=False, init=False)
    steps: int = attrs.field(default=0, init=False)
    updates: list = attrs.field(factory=list, init=False)
    total: torch.Tensor = attrs.field(factory=lambda: torch.zeros(3), init=False)

    def on_update(self, state, event):
        self.updates.append(event.epoch)

    def on_event(self, state, event):
        self.steps += 1
        self.total += torch.tensor([1.0, 2.0, 3.0])

    def state_dict(self):
        return {"steps": self.steps, "updates": list(self.updates), "nested": {"total": self.total.clone()}}

    def load_state_dict(self, state):
        if self.refuse_load:
            raise ValueError("not mine")
        self.steps = state["steps"]
        self.updates = list(state["updates"])
        self.total = state["nested"]["total"].clone()


def _steps(session: Session, n: int) -> None:
    for _ in range(n):
        session.batch_start()
        session.optim_pre_step()
        session.optim_post_step()
        session.batch_end()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))


# --- masks ------------------------------------------------------------------------------------------


def test_pack_mask_bit_order_and_round_trip():
    keep = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    packed = pack_mask(keep)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [0b10110000, 0b10000000]
    assert torch.equal(unpack_mask(packed, (9,)), keep)
    g = torch.Generator().manual_seed(0)
    for shape in [(1,), (7, 3), (64, 64), (5, 13, 2)]:
        mask = torch.rand(shape, generator=g) > 0.5
        assert torch.equal(unpack_mask(pack_mask(mask), shape), mask), shape


def test_unpack_mask_wrong_size_is_refused():
    with pytest.raises(ValueError, match=r"a packed mask for shape \(4, 4\) has 2 uint8 bytes; got 3 torch.uint8"):
        unpack_mask(torch.zeros(3, dtype=torch.uint8), (4, 4))


# --- round trip -------------------------------------------------------------------------------------


def test_state_dict_round_trip_continues_exactly(tmp_path):
    a = Session([Counter(start=1, end=3, update=0.5)])
    a.initialize(steps_per_epoch=2)
    _steps(a, 3)
    saved = a.state_dict()  # started at step 2 (epoch 1), one counted step since
    assert saved["global_step"] == 3 and saved["lifecycle"] == "running"
    assert saved["schedule"] == {"Counter": {"started": True, "ended": False, "next_update": 1.5}}
    assert saved["stages"] == {"default": "active"}
    assert saved["modifiers"]["Counter"]["steps"] == 1
    a.save(tmp_path / "ckpt")
    b = Session.load(tmp_path / "ckpt", [Counter(start=1, end=3, update=0.5)], steps_per_epoch=2)
    assert b.lifecycle == "running" and b.global_step == 3
    counter = b.modifiers[0]
    assert counter.steps == 1 and counter.total.tolist() == [1.0, 2.0, 3.0]
    _steps(a, 4)
    _steps(b, 4)
    for m in (a.modifiers[0], counter):  # updates at epochs 1.5, 2, 2.5; ended at epoch 3 (step 6)
        assert m.updates == [1.5, 2.0, 2.5]
        assert m.steps == 4 and m.total.tolist() == [4.0, 8.0, 12.0]
    assert (
        b.state_dict()["schedule"]
        == a.state_dict()["schedule"]
        == {"Counter": {"started": True, "ended": True, "next_update": None}}
    )


def test_checkpoint_files_are_json_and_safetensors_only(tmp_path):
    session = Session([Counter()])
    session.initialize()
    _steps(session, 2)
    session.save(tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["format"] == "llmc-fsm-session" and manifest["version"] == 1
    assert manifest["state"]["modifiers"]["Counter"] == {
        "steps": 2,
        "updates": [],
        "nested": {"total": {"__tensor__": "modifiers/Counter/nested/total"}},
    }
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [".session.lock", MANIFEST, manifest["tensors"]]  # the lock: empty, saves take turns on it
    assert (tmp_path / ".session.lock").stat().st_size == 0
    assert manifest["tensors"].endswith(".safetensors")


def test_masks_take_at_most_a_sixteenth_of_the_weight_bytes(tmp_path):
    model = _model()
    prune = Session([MagnitudePruningModifier(sparsity=0.5, ignore=[])])
    prune.initialize(model=model)
    prune.calibration_start()
    prune.calibration_end()
    prune.finalize()
    session = Session([ConstantPruningModifier(ignore=[])])
    session.initialize(model=model)
    _steps(session, 1)
    session.save(tmp_path)
    weight_bytes = sum(m.weight.numel() * 4 for m in model if isinstance(m, nn.Linear))
    tensor_file = next(tmp_path.glob("tensors-*.safetensors"))
    assert tensor_file.stat().st_size <= weight_bytes / 16
    masks = read_checkpoint(tmp_path)["modifiers"]["ConstantPruningModifier"]["masks"]
    assert sorted(masks) == ["0", "2", "3", "4"]
    assert all(t.dtype == torch.uint8 and t.numel() == 64 * 64 // 8 for t in masks.values())
    for name, bits in masks.items():
        assert torch.equal(unpack_mask(bits, (64, 64)), model.get_submodule(name).weight != 0), name


# --- mismatches name the difference -----------------------------------------------------------------------


def _saved(tmp_path, recipe, **state) -> Path:
    session = Session(recipe)
    session.initialize(**state)
    _steps(session, 1)
    return session.save(tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        ([Counter()], ["modifier LearningRateModifier removed (in the checkpoint, not in this session's recipe)"]),
        (
            [Counter(), LearningRateModifier(init_lr=0.1), Counter()],
            [
                "modifier Counter removed (in the checkpoint, not in this session's recipe)",
                "modifier Counter#1 added (in this session's recipe, not in the checkpoint)",
                "modifier Counter#2 added (in this session's recipe, not in the checkpoint)",
            ],
        ),
        (
            [Counter(), LearningRateModifier(init_lr=0.2)],
            ["modifier LearningRateModifier: argument 'init_lr' is 0.1 in the checkpoint, 0.2 now"],
        ),
        (
            [LearningRateModifier(init_lr=0.1), Counter()],
            [
                "modifier order differs: ['Counter', 'LearningRateModifier'] in the checkpoint, "
                "['LearningRateModifier', 'Counter'] now"
            ],
        ),
    ],
)
def test_loading_into_another_recipe_names_every_difference_and_loads_nothing(tmp_path, recipe, expected):
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0)
    path = _saved(tmp_path, [Counter(), LearningRateModifier(init_lr=0.1)], optimizer=opt, steps_per_epoch=4)
    session = Session(recipe)
    session.initialize(optimizer=opt, steps_per_epoch=4)
    with pytest.raises(CheckpointError) as info:
        session.load_state_dict(read_checkpoint(path))
    assert list(info.value.differences) == expected
    assert str(info.value).startswith(f"the checkpoint does not match this session ({len(expected)} difference(s)): ")
    assert str(info.value).endswith(
        "Nothing was loaded: resume with the recipe and state the checkpoint was written with."
    )
    assert session.global_step == 0 and session.lifecycle == "initialized"
    assert all(getattr(m, "steps", 0) == 0 for m in session.modifiers)
    with pytest.raises(CheckpointError, match="difference"):  # Session.load refuses before initializing
        Session.load(path, recipe, optimizer=opt, steps_per_epoch=4)


@attrs.define(kw_only=True, slots=False, eq=False)
class OtherCounter(Modifier):
    """Another class under the same recipe name."""

    @classmethod
    def modifier_name(cls) -> str:
        return "Counter"


def test_other_steps_per_epoch_and_class_are_named(tmp_path):
    path = _saved(tmp_path, [Counter(start=0)], steps_per_epoch=4)
    session = Session([OtherCounter(start=0)])
    session.initialize(steps_per_epoch=5)
    with pytest.raises(CheckpointError) as info:
        session.load_state_dict(read_checkpoint(path))
    assert info.value.differences == (
        "modifier Counter: class 'test_checkpoint.Counter' in the checkpoint, 'test_checkpoint.OtherCounter' now",
        "state steps_per_epoch is 4 in the checkpoint, 5 now",
    )


def test_a_modifier_refusing_its_part_loads_nothing():
    first, second = Counter(), Counter()
    a = Session([first, second])
    a.initialize()
    _steps(a, 2)
    saved = a.state_dict()
    b1, b2 = Counter(), Counter()
    b2.refuse_load = True
    b = Session([b1, b2])
    b.initialize()
    with pytest.raises(
        CheckpointError,
        match=r"^Counter#2.load_state_dict\(\) refused its part of the checkpoint: "
        r"not mine. Nothing was loaded.$",
    ):
        b.load_state_dict(saved)
    assert b1.steps == 0 and b1.total.tolist() == [0.0, 0.0, 0.0]  # the first one was restored
    assert b.global_step == 0 and b.lifecycle == "initialized"


def test_default_modifier_state_is_empty_and_refuses_foreign_state():
    m = Modifier()
    assert m.state_dict() == {}
    m.load_state_dict({})
    with pytest.raises(ValueError, match=r"Modifier keeps no checkpoint state .* holds \['x'\] for it"):
        m.load_state_dict({"x": 1})


def test_not_a_checkpoint_or_damaged_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"no session checkpoint at .*missing: the directory does not exist"):
        read_checkpoint(tmp_path / "missing")
    with pytest.raises(CheckpointError, match=rf"no session checkpoint at .*: it has no {MANIFEST}"):
        read_checkpoint(tmp_path)
    session = Session([Counter()])
    session.initialize()
    session.save(tmp_path / "ckpt")
    tensors = next((tmp_path / "ckpt").glob("tensors-*"))
    data = tensors.read_bytes()
    tensors.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"does not match the SHA-256 in session.json \(damaged\)"):
        read_checkpoint(tmp_path / "ckpt")
    tensors.unlink()
    with pytest.raises(CheckpointError, match=r"its tensor file tensors-\w+.safetensors cannot be read"):
        read_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"session.json is damaged \(JSONDecodeError"):
        read_checkpoint(tmp_path / "ckpt")
    fresh = Session()
    fresh.initialize()
    with pytest.raises(CheckpointError, match=r"not an llmc-fsm session state dict \(no format 'llmc-fsm-session'\)"):
        fresh.load_state_dict({"format": "something else"})


def test_unserialisable_state_is_refused_before_writing(tmp_path):
    with pytest.raises(TypeError, match=r"checkpoint state at modifiers/x: a object is neither a tensor nor a JSON"):
        write_checkpoint({"modifiers": {"x": object()}}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


# --- when a checkpoint may be taken or loaded ------------------------------------------------------------


def test_checkpoint_calls_are_refused_where_they_cannot_be_exact():
    session = Session([Counter()])
    with pytest.raises(
        LifecycleError,
        match=r"state_dict\(\) refused: a checkpoint is taken between batches of an "
        r"initialized or running session \(lifecycle 'created'\)",
    ):
        session.state_dict()
    session.initialize()
    saved = session.state_dict()
    session.batch_start()
    with pytest.raises(LifecycleError, match=r"position 'batch_start'"):
        session.state_dict()
    with pytest.raises(LifecycleError, match=r"^save\(\) refused: a checkpoint is taken between batches"):
        session.save("unused")  # named as the call made (it said state_dict())
    with pytest.raises(
        LifecycleError,
        match=r"load_state_dict\(\) refused: load a checkpoint right after "
        r"initialize\(\), before the first event \(lifecycle 'running', position 'batch_start'\)",
    ):
        session.load_state_dict(saved)
    session.batch_end()
    session.finalize()
    with pytest.raises(LifecycleError, match=r"lifecycle 'finalized'"):
        session.state_dict()


# --- a kill during the write leaves the previous checkpoint loadable -------------------------------------

_KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import llmc_fsm.session.checkpoint_io as io
    from test_checkpoint import Counter, _steps
    from llmc_fsm import Session

    path, where = sys.argv[1], sys.argv[2]
    session = Session([Counter()])
    session.initialize()
    _steps(session, 1)
    session.save(path)                       # the previous checkpoint: step 1
    _steps(session, 2)
    real_write, real_replace = io._write_atomic, os.replace

    def kill():
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "tensors":                   # half of the new tensor file written
        def write(target, data):
            if target.name.startswith("tensors-"):
                with open(target.with_name("." + target.name + ".tmp"), "wb") as f:
                    f.write(data[: len(data) // 2])
                kill()
            real_write(target, data)
        io._write_atomic = write
    else:                                    # new tensor file in place, manifest not yet swapped
        def replace(src, dst):
            if str(dst).endswith("session.json"):
                kill()
            real_replace(src, dst)
        os.replace = replace
    session.save(path)
    print("not killed")
    """
)


@pytest.mark.parametrize("where", ["tensors", "manifest"])
def test_kill_during_checkpoint_write_leaves_the_previous_one_loadable(tmp_path, where):
    path = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_SCRIPT, str(path), where], env=env, capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert len(list(path.glob("tensors-*.safetensors"))) == (2 if where == "manifest" else 1)
    saved = read_checkpoint(path)
    assert saved["global_step"] == 1 and saved["modifiers"]["Counter"]["steps"] == 1
    session = Session.load(path, [Counter()])
    assert session.global_step == 1
    _steps(session, 1)
    session.save(path)  # the next save cleans up the leftovers (and takes the lock the killed save held)
    names = sorted(p.name for p in path.iterdir())
    assert names[:2] == [".session.lock", MANIFEST] and len(names) == 3 and names[2].startswith("tensors-")


def test_the_mismatch_example_in_the_docs_is_the_real_message(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def magnitude(init: float) -> MagnitudePruningModifier:
        return MagnitudePruningModifier(init_sparsity=init, final_sparsity=0.5, end=2, update=0.5)

    path = _saved(
        tmp_path,
        [magnitude(0.1), LearningRateModifier(schedule="cosine", init_lr=0.1, end=2)],
        model=model,
        optimizer=opt,
        steps_per_epoch=4,
    )
    with pytest.raises(CheckpointError) as info:
        Session.load(path, [magnitude(0.2)], model=model, optimizer=opt, steps_per_epoch=4)
    doc = (REPO / "docs" / "lifecycle.md").read_text(encoding="utf-8")
    assert f"```text\n{info.value}\n```" in doc


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("global_step", "x", "global_step 'x' is not a step count"),
        ("global_step", True, "global_step True is not a step count"),
        ("recipe", None, "its recipe is a NoneType, not a list"),
        ("recipe", [1, 2], "its recipe entries are not modifier records"),
        ("schedule", {}, "it has no schedule entry for MagnitudePruningModifier"),
        ("schedule", {"MagnitudePruningModifier": {"started": 1}}, "the schedule of MagnitudePruningModifier lacks "
                                                                    "started / ended / next_update"),
        ("modifiers", {}, "it has no modifiers entry for MagnitudePruningModifier"),
        ("modifiers", [], "its modifiers is not a mapping of modifier labels to mappings"),
    ],
)
def test_a_damaged_checkpoint_is_refused_before_anything_loads(tmp_path, key, value, problem):
    """A fuzzing tester's cases: a hand-edited session.json raised a bare ValueError / KeyError / TypeError, one
    (schedule emptied) after the modifier's masks were loaded, and 'modifiers: {}' loaded with no masks at all."""
    recipe = {"s": {"MagnitudePruningModifier": {"init_sparsity": 0.1, "final_sparsity": 0.5, "start": 0, "end": 2,
                                                 "update": 0.5}}}  # fmt: skip
    model = _model()
    state = {"model": model, "steps_per_epoch": 2, "optimizer": torch.optim.SGD(model.parameters(), lr=0.0)}
    path = _saved(tmp_path, recipe, **state)
    session_json = path / "session.json"
    saved = json.loads(session_json.read_text())
    saved["state"][key] = value
    session_json.write_text(json.dumps(saved))
    with pytest.raises(CheckpointError) as info:
        Session.load(path, recipe, **state)
    assert str(info.value) == (
        f"the checkpoint is damaged: {problem}. Nothing was loaded: resume from an intact checkpoint (an earlier one, "
        "or a new run)"
    )
    fresh = Session(recipe)
    fresh.initialize(**state)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"^the checkpoint is damaged: "):
        fresh.load_state_dict(read_checkpoint(path))
    assert fresh.modifiers[0].state_dict() == Session(recipe).modifiers[0].state_dict()  # nothing loaded
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
