"""Session 38 fixes in the core: conditional_state checked at registration, MissingStateError's reasons from the
modifiers' own conditional_state, checkpoint reads beside saves, Recipe/Stage constructors that validate,
llmc_fsm.testing's dir(), first_output on nested tuples and Session.load's annotation (each found by a tester)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import typing
from pathlib import Path

import attrs
import pytest
import torch
from filelock import FileLock

from llmc_fsm import (
    CheckpointError,
    MissingStateError,
    Modifier,
    PluginError,
    Recipe,
    RecipeError,
    Session,
    Stage,
    first_output,
    hookimpl,
)
from llmc_fsm.cli import plugins as cli_plugins
from llmc_fsm.core.registry import ModifierRegistry
from llmc_fsm.session import checkpoint_io
from llmc_fsm.session.checkpoint import read_checkpoint, write_checkpoint

# --- 1. conditional_state is checked at registration --------------------------------------------------------------


@attrs.define(kw_only=True, slots=False, eq=False)
class CondSet(Modifier):
    """Declares conditional_state as a set of keys."""

    required_state = frozenset({"model"})
    conditional_state = frozenset({"steps_per_epoch"})


@attrs.define(kw_only=True, slots=False, eq=False)
class Fine(Modifier):
    """A well-declared modifier."""

    required_state = frozenset({"model"})


class _Plugin:
    @hookimpl
    def llmc_fsm_register_modifiers(self):
        return [CondSet, Fine]


_SET_PROBLEM = (
    "conditional_state must be a mapping of state key to when that key is required (e.g. {'steps_per_epoch': "
    "'unless the schedule is constant'}), got frozenset({'steps_per_epoch'})"
)


def test_a_conditional_state_set_refuses_the_class_naming_the_plugin_and_the_listing_still_works(monkeypatch):
    """Before: a set was accepted at registration, then ``llmc-fsm modifiers`` printed only "dictionary update
    sequence element #0 has length 15; 2 is required" and listed no modifier and no plugin."""
    registry = ModifierRegistry()
    found = registry.register_plugin(_Plugin(), distribution="condplug", version="0.1", entry_point="condplug")
    assert [str(e) for e in found] == [
        f"plugin condplug 0.1 (entry point 'condplug'): {CondSet.__module__}.CondSet: {_SET_PROBLEM}"
    ]
    assert registry.registered_from("condplug", "condplug") == ["Fine"]
    monkeypatch.setattr(cli_plugins, "get_registry", lambda: registry)
    out = cli_plugins.format_modifiers()
    assert "  Fine  [condplug 0.1]" in out.splitlines()
    assert f"{CondSet.__module__}.CondSet: {_SET_PROBLEM}" in out


@pytest.mark.parametrize(
    ("declared", "shown"),
    [({"steps_per_epoch": ""}, "'steps_per_epoch': ''"), ({1: "when x"}, "1: 'when x'"), ({"k": 2}, "'k': 2")],
)
def test_a_conditional_state_without_string_keys_and_when_texts_is_refused(declared, shown):
    """Before: any value was accepted and used as a mapping only when the modifiers were listed."""
    cls = attrs.define(kw_only=True, slots=False, eq=False)(
        type("CondBad", (Modifier,), {"conditional_state": declared, "__module__": __name__})
    )
    with pytest.raises(PluginError) as info:
        ModifierRegistry().register(cls)
    assert str(info.value) == (
        f"{__name__}.CondBad: conditional_state must map non-empty state keys to non-empty when texts, both strings "
        f"(e.g. {{'steps_per_epoch': 'unless the schedule is constant'}}), got {shown}"
    )


# --- 2. MissingStateError gives each modifier's own reason ------------------------------------------------------


@attrs.define(kw_only=True, slots=False, eq=False)
class StepRate(Modifier):
    """Needs steps_per_epoch for a stepped schedule only (as LearningRateModifier(schedule="step"))."""

    required_state = frozenset({"optimizer"})
    conditional_state = {"steps_per_epoch": "unless the schedule is constant"}  # noqa: RUF012
    stepped: bool = False

    def required_keys(self):
        return super().required_keys() | ({"steps_per_epoch"} if self.stepped else set())


@attrs.define(kw_only=True, slots=False, eq=False)
class Calibrated(Modifier):
    """Needs calibration_data for static scales only."""

    required_state = frozenset({"model"})
    optional_state = frozenset({"calibration_data"})
    conditional_state = {"calibration_data": "when input activations have static scales"}  # noqa: RUF012

    def required_keys(self):
        return super().required_keys() | {"calibration_data"}


@attrs.define(kw_only=True, slots=False, eq=False)
class Plain(Modifier):
    """Declares nothing conditional."""


_HEAD = (
    "initialize() refused: {n} modifier(s) are missing required state; no modifier was initialized and nothing was "
    "stored (the session is still 'created'):"
)
_SPE = (
    "steps_per_epoch is the number of optimizer steps per epoch (an int): modifiers count their epochs in steps with "
    "it."
)


def test_missing_state_names_each_modifiers_own_reason_for_a_conditional_key():
    """Before: steps_per_epoch was always "required because the modifier has a start/end/update schedule in epochs",
    wrong for a stepped schedule without them, and a conditional_state text (calibration_data) was never shown."""
    session = Session([StepRate(stepped=True), Calibrated()])
    with pytest.raises(MissingStateError) as info:
        session.initialize(optimizer=1, model=2)
    assert str(info.value) == "\n".join(
        [
            _HEAD.format(n=2),
            "  - StepRate requires 'steps_per_epoch'",
            "      'steps_per_epoch' is required unless the schedule is constant",
            "  - Calibrated requires 'calibration_data'",
            "      'calibration_data' is required when input activations have static scales",
            "Supply them where they are created with session.update_state(calibration_data=..., steps_per_epoch=...), "
            "or pass them to session.initialize(calibration_data=..., steps_per_epoch=...).",
            "Pass again what you gave this call (model, optimizer): it was not stored.",
            _SPE,
        ]
    )


def test_a_scheduled_modifier_without_conditional_state_is_told_its_start_end_update_needs_steps_per_epoch():
    """The reason of the base rule (start/end/update in epochs) is given only to a modifier that has them."""
    session = Session([Plain(start=1)])
    with pytest.raises(MissingStateError) as info:
        session.initialize()
    assert str(info.value).splitlines()[1:3] == [
        "  - Plain requires 'steps_per_epoch'",
        "      'steps_per_epoch' is required because the modifier has a start/end/update schedule in epochs",
    ]
    assert StepRate(stepped=False).required_because() == {}
    assert StepRate(stepped=True, start=1).required_because() == {"steps_per_epoch": "unless the schedule is constant"}


# --- 3. checkpoint reads beside saves -------------------------------------------------------------------------------


def _save(directory: Path, value: int) -> None:
    write_checkpoint({"value": value, "t": torch.full((3,), value)}, directory)


def _replace(directory: Path, value: int, scratch: Path) -> None:
    """What a save does in ``directory``, without its lock: new tensor file, new manifest, old tensor file removed."""
    old = {p.name for p in directory.glob("tensors-*.safetensors")}
    _save(scratch, value)
    for entry in scratch.glob("tensors-*.safetensors"):
        shutil.copy(entry, directory / entry.name)
    shutil.copy(scratch / "session.json", directory / ".session.json.new")
    os.replace(directory / ".session.json.new", directory / "session.json")
    for name in old:
        (directory / name).unlink()


def test_a_checkpoint_read_waits_while_a_save_holds_the_lock(tmp_path):
    """Before: a read took no lock; one read in 300 beside saves in another process failed with "its tensor file ...
    cannot be read (No such file or directory)", the save's cleanup having removed the file its manifest named."""
    directory = tmp_path / "ckpt"
    _save(directory, 1)
    result: list = []
    lock = FileLock(directory / ".session.lock", fallback_to_soft=False)
    lock.acquire()
    try:
        reader = threading.Thread(target=lambda: result.append(read_checkpoint(directory)))
        reader.start()
        reader.join(0.5)
        assert result == []  # waiting for the save
        _replace(directory, 2, tmp_path / "scratch")
    finally:
        lock.release()
    reader.join(10)
    assert result[0]["value"] == 2 and result[0]["t"].tolist() == [2, 2, 2]


def test_a_checkpoint_read_without_a_lock_file_reads_again_when_a_save_replaced_it_meanwhile(tmp_path, monkeypatch):
    """Where no lock file is there (nothing is created by a read), a read whose manifest changed under it was
    reported as a missing tensor file, as if the checkpoint were damaged."""
    directory = tmp_path / "ckpt"
    _save(directory, 1)
    (directory / ".session.lock").unlink()
    original = checkpoint_io._read_once
    calls: list[int] = []

    def saved_meanwhile(path, text):
        calls.append(1)
        if len(calls) == 1:
            _replace(directory, 2, tmp_path / "scratch")
        return original(path, text)

    monkeypatch.setattr(checkpoint_io, "_read_once", saved_meanwhile)
    state = read_checkpoint(directory)
    assert (state["value"], len(calls)) == (2, 2)
    assert not (directory / ".session.lock").exists()


def test_a_checkpoint_missing_its_tensor_file_is_still_reported_as_such(tmp_path):
    directory = tmp_path / "ckpt"
    _save(directory, 1)
    (name,) = [p.name for p in directory.glob("tensors-*.safetensors")]
    (directory / name).unlink()
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(directory)
    assert str(info.value) == (
        f"session checkpoint {directory}: its tensor file {name} cannot be read (No such file or directory)"
    )


# --- 4. Recipe and Stage constructors validate ------------------------------------------------------------------------

_RECIPE_HINT = (
    "read a dict, YAML text, a path or modifiers with llmc_fsm.recipes.building.resolve_recipe(...), or give them to "
    "Session(...)"
)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda m: Stage(1, [m]), "stage names must be strings, got 1"),
        (lambda m: Stage("s", m), "stage 's': modifiers must be a list of llmc_fsm.Modifier objects, got Plain: "
                                  "wrap it in a list, [Plain(...)]"),
        (lambda m: Stage("s", ["x"]), "stage 's': modifiers must be llmc_fsm.Modifier objects, got 'x'; for modifier "
                                      "names and arguments give a dict {stage: {Name: {arg: value}}} to "
                                      "resolve_recipe(...) or Session(...)"),
        (lambda m: Stage("s", [m], start="a"), "stage 's': start must be a number of epochs or null, got 'a'"),
        (lambda m: Stage("s", [m], end=-1), "stage 's': end must be >= 0 epochs, got -1: llm-compressor has no 'no "
                                            "end' value: its end -1 lies before the first epoch, so the modifier "
                                            "never runs; leave end out (null) to run until finalize"),
        (lambda m: Stage("s", [m], start=2, end=1), "stage 's': the stage's end (1.0) must be after its start (2.0)"),
        (lambda m: Stage("s", [m], run_type="foo"), "stage 's': run_type must be oneshot or post_train or train (as "
                                                    "in llm-compressor), got 'foo'"),
        (lambda m: Stage("s", [m], applied="yes"), "stage 's': applied must be true or false, got 'yes'"),
        (lambda m: Recipe({"s": {"Plain": {}}}), f"Recipe takes a list of Stage objects, got dict; {_RECIPE_HINT}"),
        (lambda m: Recipe("x.yaml"), f"Recipe takes a list of Stage objects, got str; {_RECIPE_HINT}"),
        (lambda m: Recipe([m]), f"Recipe takes a list of Stage objects, got Plain in the list; {_RECIPE_HINT} (wrap "
                                "modifier objects in a Stage: Recipe([Stage('default', [modifier, ...])]))"),
        (lambda m: Recipe(Stage("s", [m])), "Recipe takes a list of Stage objects, got Stage; give [stage]"),
        (lambda m: Recipe([Stage("s", [m])], source=3), "Recipe: source must be a string naming where the recipe "
                                                        "came from, got 3"),
    ],
)
def test_recipe_and_stage_constructors_refuse_what_the_dict_form_refuses(make, message):
    """Before: Recipe({...}) / Recipe('x.yaml') / Recipe([modifier]) failed with "'str' object has no attribute
    'name'"; Stage('s', ['x']) was accepted and Session(Recipe(...)) failed with an AttributeError; a stage name 1,
    start 'a' and run_type 'foo' were accepted."""
    with pytest.raises(RecipeError) as info:
        make(Plain())
    assert str(info.value) == message


def test_a_stage_starting_after_its_modifier_is_refused_as_the_dict_form_refuses_it():
    """Before: it ran, and its to_yaml() was a recipe.yaml that Session(...) refused ("the modifier starts at 0.0,
    before its stage's start")."""
    with pytest.raises(RecipeError) as built:
        Stage("s", [Plain(start=0, end=8)], start=5)
    with pytest.raises(RecipeError) as read:
        Session({"s": {"start": 5, "modifiers": {"Plain": Plain(start=0, end=8)}}})
    expected = (
        "stage 's', modifier Plain, argument 'start': the modifier starts at 0.0, before its stage's start (5.0); a "
        "modifier must start at or after its stage's start"
    )
    assert str(built.value) == expected
    assert str(read.value) == f"recipe <dict>, {expected}"


def test_a_stage_changed_after_it_was_built_is_checked_again_by_recipe():
    stage = Stage("s", [Plain(start=1)], start=1)
    assert (stage.start, type(stage.start)) == (1.0, float)
    stage.run_type = "foo"
    with pytest.raises(RecipeError) as info:
        Recipe([stage], "<objects>")
    assert str(info.value) == (
        "recipe <objects>, stage 's': run_type must be oneshot or post_train or train (as in llm-compressor), got 'foo'"
    )


# --- 5. llmc_fsm.testing lists its lazy names ---------------------------------------------------------------------

_LAZY = ("ContractViolation", "Worker", "check_modifier", "run_ranks")


def test_dir_of_llmc_fsm_testing_lists_the_kit_without_importing_it():
    """Before: dir() and help() left out check_modifier, ContractViolation, run_ranks and Worker (no __dir__)."""
    code = (
        "import sys, llmc_fsm.testing as t\n"
        f"print([n for n in {_LAZY!r} if n in dir(t)], 'llmc_fsm.testing.kit' in sys.modules, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.splitlines() == [f"{list(_LAZY)!r} False False"]


def test_pytest_loads_the_plugin_module_whose_names_import_nothing_heavy():
    """pytest reads every name dir() gives of a plugin module at its start: were it the package, listing the kit there
    would import it (torch, the session) in every project of the environment. The entry point names the plugin
    module, which holds only the option and the fixture."""
    from importlib.metadata import entry_points

    (plugin,) = [e for e in entry_points(group="pytest11") if e.name == "llmc_fsm"]
    assert plugin.value == "llmc_fsm.testing.plugin"
    code = ("import sys, llmc_fsm.testing.plugin as p\ndir(p)\n"
            "print('llmc_fsm.testing.kit' in sys.modules, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.splitlines() == ["False False"]


# --- 6. type hints that tell the truth ----------------------------------------------------------------------------


def test_first_output_of_a_nested_tuple_is_the_tensor_inside():
    """Before: first_output(((t,),)) returned the tuple (t,), though annotated -> torch.Tensor."""
    hidden = torch.ones(2, 3)
    assert first_output(((hidden,), "cache")) is hidden
    assert first_output([hidden, None]) is hidden
    with pytest.raises(TypeError) as info:
        first_output((None, hidden))
    assert str(info.value) == (
        "cannot read the hidden states from a decoder layer output of type tuple (its first item: NoneType)"
    )


def test_session_load_is_annotated_as_returning_the_session():
    """Before: annotated -> Any."""
    assert typing.get_type_hints(Session.load)["return"] is typing.Self


def test_the_plain_loop_and_trainer_hints_keep_each_modifiers_reason_and_the_error_carries_them():
    """Found after the first fix: the integrations rebuilt the message from ``missing`` alone, so the reasons the
    session gives were lost through ``llmc_fsm.integrations.torch.initialize`` and the Trainer."""
    import pickle

    from llmc_fsm.integrations.torch import initialize

    session = Session("s:\n  LearningRateModifier: {schedule: cosine, init_lr: 0.01, end: 2}\n")
    with pytest.raises(MissingStateError) as info:
        initialize(session, model=torch.nn.Linear(2, 2))
    reason = "'steps_per_epoch' is required unless the schedule is constant with no start/end/update"
    assert info.value.reasons == {
        "LearningRateModifier": {"steps_per_epoch": "unless the schedule is constant with no start/end/update"}
    }
    assert f"  - LearningRateModifier requires 'optimizer', 'steps_per_epoch'\n      {reason}\n" in str(info.value)
    assert pickle.loads(pickle.dumps(info.value)).reasons == info.value.reasons
