"""What a plain ``pip install llmc-fsm`` (no extras) gives, the pytest plugin's start, and ``llmc-fsm modifiers``'s
exit status and state lines (found by a tester, session 37)."""

from __future__ import annotations

import configparser
import importlib.metadata
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import ClassVar

import attrs
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import llmc_fsm
from llmc_fsm import Modifier, hookimpl
from llmc_fsm.cli import plugins as cli_plugins
from llmc_fsm.cli.main import main
from llmc_fsm.core.registry import EXTRA_OF_MODULE, ModifierRegistry
from llmc_fsm.testing import check_modifier

ROOT = Path(__file__).resolve().parents[1]

#: A ``sys.meta_path`` finder that makes ``import <BLOCKED>`` fail as a module that is not installed.
BLOCKER = """
import sys
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Blocker())
"""


def _run(code: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=300
    )


# --- install_requires ---------------------------------------------------------------


def _declared(setup_cfg: Path) -> list[Requirement]:
    parser = configparser.ConfigParser()
    parser.read(setup_cfg)
    return [Requirement(line) for line in parser["options"]["install_requires"].split("\n") if line.strip()]


def _closure(requirements: list[Requirement]) -> set[str]:
    """The distributions ``requirements`` install, transitively (llmc-fsm's own from its setup.cfg in this tree:
    the installed metadata of an editable install is not updated by an edit), markers evaluated without extras."""
    found: set[str] = set()
    todo = list(requirements)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in found or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        found.add(name)
        if name == "llmc-fsm":
            todo.extend(_declared(ROOT / "setup.cfg"))
            continue
        try:
            todo.extend(Requirement(r) for r in importlib.metadata.requires(req.name) or ())
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: then nothing of it was imported either
    return found


#: What each distribution's users import: llmc-fsm's public API (every name of ``llmc_fsm`` and ``llmc_fsm.toolkit``,
#: and the command line), with the test extra its test helpers (``llmc_fsm.testing``), a plugin's entry-point module.
IMPORTS = {
    "llmc-fsm": (
        "setup.cfg",
        (),
        "import llmc_fsm, llmc_fsm.toolkit, llmc_fsm.cli.main\n"
        "for module in (llmc_fsm, llmc_fsm.toolkit):\n"
        "    [getattr(module, name) for name in module.__all__]\n",
    ),
    "llmc-fsm[test]": (
        "setup.cfg",
        ("test",),
        "import llmc_fsm.testing\n[getattr(llmc_fsm.testing, name) for name in llmc_fsm.testing.__all__]\n",
    ),
    "llmc-fsm-pruning": ("plugins/pruning/setup.cfg", (), "import llmc_fsm_pruning\n"),
    "llmc-fsm-training": ("plugins/training/setup.cfg", (), "import llmc_fsm_training\n"),
    "llmc-fsm-quantization": ("plugins/quantization/setup.cfg", (), "import llmc_fsm_quantization\n"),
}

#: Records the third-party modules first-party code imports itself (``import x`` / ``from x import y`` run by a
#: module of llmc-fsm or of a first-party plugin): what a third-party package imports when it finds it installed
#: (transformers imports PIL and accelerate so) is that package's business, not a requirement of ours.
SPY = """
import builtins, json, sys, importlib.metadata
FIRST_PARTY = {"llmc_fsm", "llmc_fsm_pruning", "llmc_fsm_quantization", "llmc_fsm_training"}
direct = set()
_import = builtins.__import__
def _spy(name, globals=None, locals=None, fromlist=(), level=0):
    importer = ((globals or {}).get("__name__") or "").split(".")[0]
    top = name.split(".")[0]
    if level == 0 and importer in FIRST_PARTY and top not in FIRST_PARTY and top not in sys.stdlib_module_names:
        direct.add(top)
    return _import(name, globals, locals, fromlist, level)
builtins.__import__ = _spy
"""


def _extra(setup_cfg: Path, extra: str) -> list[Requirement]:
    parser = configparser.ConfigParser()
    parser.read(setup_cfg)
    return [Requirement(line) for line in parser["options.extras_require"][extra].split("\n") if line.strip()]


@pytest.mark.parametrize("distribution", sorted(IMPORTS))
def test_install_requires_cover_every_third_party_module_its_code_imports(distribution: str, tmp_path: Path) -> None:
    """``pip install llmc-fsm`` gave a package that could not be imported: numpy (toolkit/masks.py) was in no
    requirement and safetensors (oneshot_job/resume.py) only in the [hf] extra (found by a tester). Every
    third-party module the first-party code imports while its public names load must be installed by the declared
    requirements (transitively)."""
    setup_cfg, extras, code = IMPORTS[distribution]
    probe = (
        f"{SPY}{code}"
        "owners = importlib.metadata.packages_distributions()\n"
        "print(json.dumps(sorted({d for m in direct for d in owners.get(m, ['?' + m])})))\n"
    )
    done = _run(probe, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    imported = {canonicalize_name(d) for d in json.loads(done.stdout.splitlines()[-1])}
    requirements = _declared(ROOT / setup_cfg) + [r for e in extras for r in _extra(ROOT / setup_cfg, e)]
    declared = _closure(requirements)
    assert sorted(imported - declared) == []
    assert ("pytest" if extras else "torch") in imported  # the probe saw the imports (it is not vacuous)


def test_the_hf_extra_modules_the_cli_names_are_the_hf_extra() -> None:
    """The modules ``llmc-fsm`` answers with ``pip install "llmc-fsm[hf]"`` are those setup.cfg's [hf] extra
    installs."""
    hf = {requirement.name for requirement in _extra(ROOT / "setup.cfg", "hf")}
    assert hf == {module for module, extra in EXTRA_OF_MODULE.items() if extra == "hf"}


# --- the pytest plugin --------------------------------------------------------------------


def _unrelated_project(tmp_path: Path) -> Path:
    project = tmp_path / "unrelated"
    project.mkdir()
    (project / "test_unrelated.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    return project


def test_pytest_in_an_unrelated_project_starts_when_a_dependency_of_llmc_fsm_is_broken(tmp_path: Path) -> None:
    """The pytest11 plugin imported the conformance kit (torch, the session, safetensors...) at pytest's start, so a
    missing dependency of llmc-fsm failed every test suite of the environment at start ("Error while loading plugin
    pytest11 ... No module named 'safetensors'", found by a tester); torch stands for any dependency here."""
    project = _unrelated_project(tmp_path)
    code = BLOCKER.format(blocked={"torch", "safetensors", "numpy"}) + (
        "import pytest\nrc = pytest.main(['-q', '-p', 'no:cacheprovider', '.'])\n"
        "print('llmc_fsm.testing.kit' in sys.modules, 'torch' in sys.modules)\nsys.exit(rc)\n"
    )
    done = _run(code, cwd=project)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "False False"
    assert "1 passed" in done.stdout


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_llmc_fsm_examples_not_a_positive_integer_is_a_usage_error_naming_the_option(
    value: str, tmp_path: Path
) -> None:
    """``pytest --llmc-fsm-examples 0`` failed inside hypothesis with InvalidArgument (found by a tester)."""
    project = _unrelated_project(tmp_path)
    done = _run("import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))", "--llmc-fsm-examples", value, cwd=project)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    expected = (
        "error: argument --llmc-fsm-examples: must be a positive integer (random lifecycles per llmc_fsm_check() "
        f"call), got {value!r}"
    )
    (line,) = [line for line in done.stderr.splitlines() if "error: argument" in line]
    assert line.endswith(f": {expected}")


@attrs.define(kw_only=True, slots=False, eq=False)
class _Quiet(Modifier):
    """Does nothing."""


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_examples": 0}, "check_modifier: max_examples must be a positive integer, got 0"),
        ({"max_examples": True}, "check_modifier: max_examples must be a positive integer, got True"),
        ({"max_calls": -1}, "check_modifier: max_calls must be an integer >= 0, got -1"),
    ],
)
def test_check_modifier_refuses_example_counts_hypothesis_cannot_run(kwargs: dict, message: str) -> None:
    """``check_modifier(max_examples=0)`` ran the deterministic checks, then failed inside hypothesis with
    InvalidArgument (found by a tester)."""
    with pytest.raises(ValueError) as info:
        check_modifier(_Quiet, dict, **kwargs)
    assert str(info.value) == message


def test_import_llmc_fsm_loads_names_on_first_use_and_names_an_unknown_one() -> None:
    """``import llmc_fsm`` stays light (the pytest plugin is one of its modules); the names and the subpackages
    still resolve as before."""
    assert llmc_fsm.Session.__name__ == "Session"
    assert llmc_fsm.core.registry.ModifierRegistry is ModifierRegistry
    assert sorted(llmc_fsm._EXPORTS) == llmc_fsm.__all__
    with pytest.raises(AttributeError) as info:
        llmc_fsm.Sesion  # noqa: B018
    assert str(info.value) == "module 'llmc_fsm' has no attribute 'Sesion'"


# --- the command line without transformers ------------------------------------------------

CLI = "from llmc_fsm.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"


def test_oneshot_without_transformers_prints_one_line_naming_the_hf_extra(tmp_path: Path) -> None:
    """``llmc-fsm oneshot`` with llmc-fsm installed without extras ended in a ModuleNotFoundError traceback (found by
    a tester). The quantization plugin is left out, as in that install (it needs transformers)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "cal.txt").write_text("hello world\n")
    args = ["oneshot", "--model", "model", "--dataset", "cal.txt", "--num-samples", "2", "--output", "out"]
    env = {"LLMC_FSM_DISABLE_PLUGINS": "llmc-fsm-quantization"}
    done = _run(BLOCKER.format(blocked={"transformers"}) + CLI, *args, cwd=tmp_path, env=env)
    assert done.returncode == 1
    assert done.stderr == (
        "llmc-fsm oneshot: error: transformers is not installed, and oneshot needs it to read Hugging Face models; "
        "install llmc-fsm's hf extra: pip install \"llmc-fsm[hf]\"\n"
    )
    assert not (tmp_path / "out").exists()


def test_model_free_without_transformers_names_the_hf_extra(tmp_path: Path) -> None:
    """``llmc-fsm model-free`` with transformers missing: the quantization plugin fails to import, and the one line
    says how to install what it misses."""
    (tmp_path / "model").mkdir()
    args = ["model-free", "model", "--scheme", "W8A16", "--output", "out"]
    done = _run(BLOCKER.format(blocked={"transformers"}) + CLI, *args, cwd=tmp_path)
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]
    assert last.startswith("llmc-fsm model-free: error: ")
    assert last.endswith(
        "failed to import 'llmc_fsm_quantization': ModuleNotFoundError: No module named 'transformers' "
        "(install llmc-fsm's hf extra: pip install \"llmc-fsm[hf]\")"
    )
    assert not (tmp_path / "out").exists()


# --- llmc-fsm modifiers -------------------------------------------------------------------


@attrs.define(kw_only=True, slots=False, eq=False)
class _FirstParty(Modifier):
    """The first-party owner of the name."""

    required_state: ClassVar[frozenset[str]] = frozenset({"model"})

    @classmethod
    def modifier_name(cls) -> str:
        return "Taken"


@attrs.define(kw_only=True, slots=False, eq=False)
class _Impostor(_FirstParty):
    """Takes a first-party name."""


@attrs.define(kw_only=True, slots=False, eq=False)
class Friend(Modifier):
    """Registered alongside the impostor."""

    required_state: ClassVar[frozenset[str]] = frozenset({"model"})


@attrs.define(kw_only=True, slots=False, eq=False)
class Sometimes(Modifier):
    """Needs a tokenizer only when asked to."""

    required_state: ClassVar[frozenset[str]] = frozenset({"model", "tokenizer"})
    optional_state: ClassVar[frozenset[str]] = frozenset({"tokenizer", "calibration_data", "teacher"})
    conditional_state: ClassVar[dict[str, str]] = {"tokenizer": "when text is set",
                                                   "calibration_data": "when text is set"}
    text: bool = False

    def required_keys(self) -> frozenset[str]:
        """``model``; ``tokenizer`` and ``calibration_data`` when ``text`` is set (a tokenizer (not a processor)
        reads it). More prose."""
        extra = {"tokenizer", "calibration_data"} if self.text else set()
        return frozenset({"model", *extra})


def _plugin(*classes: type[Modifier]) -> types.ModuleType:
    module = types.ModuleType("fake_plugin")
    module.llmc_fsm_register_modifiers = hookimpl(lambda: list(classes))  # type: ignore[attr-defined]
    return module


def test_modifiers_exits_1_and_says_which_class_was_refused_and_which_loaded(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``llmc-fsm modifiers`` exited 0 while listing "3 broken plugin(s)", and listed as broken a distribution whose
    one class clashed with a first-party name although its other class registered (found by a tester)."""
    registry = ModifierRegistry()
    registry.register(_FirstParty, distribution="llmc-fsm-pruning", version="0.1.0", entry_point="pruning")
    registry.register_plugin(_plugin(_Impostor, Friend), distribution="clash", version="0.2.0", entry_point="c")
    registry.register_plugin(types.ModuleType("nohook"), distribution="empty", version="1.0", entry_point="e")
    monkeypatch.setattr(cli_plugins, "get_registry", lambda: registry)
    assert main(["modifiers"]) == 1
    out = capsys.readouterr().out.splitlines()
    tail = out[out.index(cli_plugins.SCHEDULE_NOTE) + 1 :]
    assert tail == [
        "1 plugin(s) failed to load, nothing registered from them:",
        "  ERROR plugin empty 1.0 (entry point 'e'): implements no llmc_fsm hook (missing @hookimpl?): define "
        "llmc_fsm_register_modifiers marked with @llmc_fsm.hookimpl",
        "1 modifier class(es) refused, from plugins that loaded the rest:",
        "  ERROR plugin clash 0.2.0 (entry point 'c'): modifier name 'Taken' from clash 0.2.0 (entry point 'c') "
        f"({__name__}._Impostor) is already registered by llmc-fsm-pruning 0.1.0 (entry point 'pruning') "
        f"({__name__}._FirstParty); the later one is not registered. Rename one of the classes (override "
        "modifier_name()) or disable one distribution with LLMC_FSM_DISABLE_PLUGINS.",
        "      registered from that entry point all the same: Friend",
    ]


def test_modifiers_exits_0_without_plugin_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    registry = ModifierRegistry()
    registry.register(Friend, distribution="friendly", version="1.0", entry_point="f")
    monkeypatch.setattr(cli_plugins, "get_registry", lambda: registry)
    assert main(["modifiers"]) == 0
    assert capsys.readouterr().out == (
        "1 modifier(s):\n"
        "  Friend  [friendly 1.0]\n"
        "      Registered alongside the impostor.\n"
        "      required state: model\n"
        "      optional state: -\n"
        f"{cli_plugins.SCHEDULE_NOTE}\n"
    )


def test_modifiers_lists_a_conditionally_required_key_once_with_its_condition(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """LearningRateModifier was listed with "required state: optimizer, steps_per_epoch" and "optional state:
    steps_per_epoch" (found by a tester): a key required for some arguments only (conditional_state) is listed
    once, with when."""
    registry = ModifierRegistry()
    registry.register(Sometimes, distribution="some", version="1.0", entry_point="s")
    monkeypatch.setattr(cli_plugins, "get_registry", lambda: registry)
    assert main(["modifiers"]) == 0
    assert capsys.readouterr().out.splitlines()[3:7] == [
        "      required state: model",
        "      required state: calibration_data, when text is set",
        "      required state: tokenizer, when text is set",
        "      optional state: teacher",
    ]


def test_modifiers_lists_learning_rate_steps_per_epoch_once(capsys: pytest.CaptureFixture[str]) -> None:
    """The tester's case, on the installed training plugin."""
    main(["modifiers"])
    out = capsys.readouterr().out.splitlines()
    start = out.index("  LearningRateModifier  [llmc-fsm-training 0.1.0]")
    assert out[start + 2 : start + 5] == [
        "      required state: optimizer",
        "      required state: steps_per_epoch, unless the schedule is constant with no start/end/update",
        "      optional state: -",
    ]


def test_a_failed_in_process_plugin_is_not_said_to_have_loaded_the_in_process_classes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Classes registered in-process share no entry point with a plugin object registered in-process that failed:
    the failure is not listed as a plugin that "loaded the rest"."""
    registry = ModifierRegistry()
    registry.register(Friend)
    registry.register_plugin(types.ModuleType("nohook"))
    monkeypatch.setattr(cli_plugins, "get_registry", lambda: registry)
    assert main(["modifiers"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[out.index(cli_plugins.SCHEDULE_NOTE) + 1 :] == [
        "1 plugin(s) failed to load, nothing registered from them:",
        "  ERROR plugin <in-process>: implements no llmc_fsm hook (missing @hookimpl?): define "
        "llmc_fsm_register_modifiers marked with @llmc_fsm.hookimpl",
    ]
