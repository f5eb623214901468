"""Plugin discovery through real distributions found by ``importlib.metadata``.

Each test writes ``*.dist-info`` folders (``METADATA`` + ``entry_points.txt``)
and plugin modules into a temporary directory put on ``sys.path``; nothing
mocks the discovery function.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import attrs
import pluggy
import pytest

import llmc_fsm
from llmc_fsm import Modifier, PluginError, RecipeError, Session, hookimpl
from llmc_fsm.cli import main
from llmc_fsm.core import registry as plugins_mod
from llmc_fsm.core.registry import DISABLE_ENV, ModifierRegistry, get_registry

SAMPLE_DIR = Path(__file__).parent / "sample_plugin"

OK_PLUGIN = """
import attrs
from llmc_fsm import Modifier, hookimpl

@attrs.define(kw_only=True, slots=False, eq=False)
class {cls}(Modifier):
    '''{doc}'''

@hookimpl
def llmc_fsm_register_modifiers():
    return [{cls}]
"""


class Site:
    """A temporary site directory holding generated distributions."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.monkeypatch = monkeypatch
        self.modules: set[str] = set()

    def add(self, dist: str, version: str, entry_points: dict[str, str], modules: dict[str, str] | None = None) -> None:
        folder = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        folder.mkdir()
        (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        eps = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        (folder / "entry_points.txt").write_text(f"[llmc_fsm]\n{eps}")
        for module, source in (modules or {}).items():
            (self.root / f"{module}.py").write_text(textwrap.dedent(source))
            self.modules.add(module)

    def add_ok(self, dist: str, cls: str, *, version: str = "1.0", module: str | None = None) -> None:
        module = module or dist.replace("-", "_")
        self.add(dist, version, {"main": module}, {module: OK_PLUGIN.format(cls=cls, doc=f"{cls} from {dist}.")})

    def add_sample(self) -> None:
        """The sample third-party plugin: source from tests/sample_plugin, metadata generated here."""
        self.monkeypatch.syspath_prepend(str(SAMPLE_DIR))
        self.modules.add("llmc_fsm_sample")
        self.add("llmc-fsm-sample", "0.3.0", {"sample": "llmc_fsm_sample"})


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    before = set(sys.modules)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.setattr(plugins_mod, "_REGISTRY", None)
    s = Site(tmp_path, monkeypatch)
    yield s
    for name in set(sys.modules) - before:
        if name.split(".")[0] in s.modules:
            del sys.modules[name]


def ours(registry: ModifierRegistry, *dists: str) -> list[PluginError]:
    """The registry's errors for the given distributions (installed first-party plugins may add others)."""
    return [e for e in registry.errors if e.distribution in dists]


# --- discovery -------------------------------------------------------------------------------


def test_public_markers_use_the_project_name() -> None:
    assert llmc_fsm.hookimpl.project_name == "llmc_fsm"
    assert llmc_fsm.hookspec.project_name == "llmc_fsm"
    assert plugins_mod.ENTRY_POINT_GROUP == "llmc_fsm"


def test_sample_plugin_is_discovered_with_distribution_and_version(site: Site) -> None:
    site.add_sample()
    registry = get_registry()
    info = registry.info("SampleMagnitudeMask")
    assert info is not None
    assert (info.distribution, info.version, info.entry_point) == ("llmc-fsm-sample", "0.3.0", "sample")
    assert info.cls.__module__ == "llmc_fsm_sample"
    assert ours(registry, "llmc-fsm-sample") == []
    # it is registered with pluggy under "<distribution>:<entry point>"
    assert registry.manager.get_plugin("llmc-fsm-sample:sample") is sys.modules["llmc_fsm_sample"]


def test_registry_is_cached_until_reload(site: Site) -> None:
    first = get_registry()
    assert "SampleMagnitudeMask" not in first
    site.add_sample()
    assert get_registry() is first
    second = get_registry(reload=True)
    assert second is not first
    assert "SampleMagnitudeMask" in second


def test_recipe_uses_discovered_plugin(site: Site) -> None:
    site.add_sample()
    session = Session({"prune": {"SampleMagnitudeMask": {"fraction": 0.25}}})
    (modifier,) = session.modifiers
    assert type(modifier).__name__ == "SampleMagnitudeMask"
    assert modifier.fraction == 0.25


def test_broken_import_is_reported_and_others_still_load(site: Site) -> None:
    site.add("llmc-fsm-broken", "2.1", {"broken": "broken_plugin"}, {"broken_plugin": "import no_such_module_xyz\n"})
    site.add_ok("llmc-fsm-zzz-ok", "ZzzModifier")  # sorts after the broken one
    registry = get_registry()
    assert "ZzzModifier" in registry
    (err,) = ours(registry, "llmc-fsm-broken")
    assert isinstance(err, PluginError)
    assert err.distribution == "llmc-fsm-broken"
    assert err.entry_point == "broken"
    text = str(err)
    assert "llmc-fsm-broken 2.1" in text
    assert "'broken'" in text
    assert "ModuleNotFoundError" in text
    assert "no_such_module_xyz" in text
    assert isinstance(err.__cause__, ModuleNotFoundError)


def test_exception_at_import_is_reported(site: Site) -> None:
    site.add("llmc-fsm-boom", "1.0", {"boom": "boom_plugin"}, {"boom_plugin": "raise RuntimeError('kaboom')\n"})
    site.add_sample()
    registry = get_registry()
    (err,) = ours(registry, "llmc-fsm-boom")
    assert "RuntimeError: kaboom" in str(err)
    assert "SampleMagnitudeMask" in registry


def test_hookimpl_signature_mismatch_is_reported(site: Site) -> None:
    source = """
    from llmc_fsm import hookimpl

    @hookimpl
    def llmc_fsm_register_modifiers(config):
        raise AssertionError("never called")
    """
    site.add("llmc-fsm-badsig", "0.1", {"bad": "badsig_plugin"}, {"badsig_plugin": source})
    site.add_ok("llmc-fsm-zz", "ZzModifier")
    registry = get_registry()
    (err,) = ours(registry, "llmc-fsm-badsig")
    text = str(err)
    assert "llmc-fsm-badsig 0.1 (entry point 'bad')" in text
    assert "does not match its specification" in text
    assert "config" in text
    assert "\n" not in text  # pluggy's message spans three lines: one here
    assert isinstance(err.__cause__, pluggy.PluginValidationError)
    assert registry.manager.get_plugin("llmc-fsm-badsig:bad") is None
    assert "ZzModifier" in registry


def test_unknown_hook_name_is_reported(site: Site) -> None:
    source = """
    from llmc_fsm import hookimpl

    @hookimpl
    def llmc_fsm_register_modifier():
        return []
    """
    site.add("llmc-fsm-typo", "0.1", {"typo": "typo_plugin"}, {"typo_plugin": source})
    registry = get_registry()
    (err,) = ours(registry, "llmc-fsm-typo")
    assert "unknown hook(s) llmc_fsm_register_modifier;" in str(err)
    assert "known hooks: llmc_fsm_register_modifiers" in str(err)
    assert registry.manager.get_plugin("llmc-fsm-typo:typo") is None


def test_duplicate_modifier_name_is_reported_and_first_wins(site: Site) -> None:
    site.add_ok("llmc-fsm-aaa", "SharedName")
    site.add_ok("llmc-fsm-bbb", "SharedName")
    site.add_ok("llmc-fsm-ccc", "CccModifier")
    registry = get_registry()
    assert registry.info("SharedName").distribution == "llmc-fsm-aaa"
    assert ours(registry, "llmc-fsm-aaa") == []
    (err,) = ours(registry, "llmc-fsm-bbb")
    text = str(err)
    assert "'SharedName'" in text
    assert "llmc-fsm-bbb 1.0 (entry point 'main')" in text
    assert "already registered by llmc-fsm-aaa 1.0" in text
    assert "CccModifier" in registry


def test_hook_that_raises_or_returns_garbage_is_reported(site: Site) -> None:
    raising = """
    from llmc_fsm import hookimpl

    @hookimpl
    def llmc_fsm_register_modifiers():
        raise KeyError("oops")
    """
    garbage = """
    from llmc_fsm import hookimpl

    @hookimpl
    def llmc_fsm_register_modifiers():
        return [int]
    """
    site.add("llmc-fsm-raising", "1.0", {"r": "raising_plugin"}, {"raising_plugin": raising})
    site.add("llmc-fsm-garbage", "1.0", {"g": "garbage_plugin"}, {"garbage_plugin": garbage})
    registry = get_registry()
    (err,) = ours(registry, "llmc-fsm-raising")
    assert "llmc_fsm_register_modifiers() raised KeyError: 'oops'" in str(err)
    (err,) = ours(registry, "llmc-fsm-garbage")
    assert "<class 'int'> is not a subclass of llmc_fsm.Modifier" in str(err)


def test_system_exit_at_import_is_reported_and_keyboard_interrupt_still_propagates(site: Site) -> None:
    site.add("llmc-fsm-exits", "1.0", {"exits": "exits_plugin"}, {"exits_plugin": "raise SystemExit('bye')\n"})
    site.add_sample()
    registry = get_registry()
    (err,) = ours(registry, "llmc-fsm-exits")
    assert str(err) == (
        "plugin llmc-fsm-exits 1.0 (entry point 'exits'): failed to import 'exits_plugin': SystemExit: bye"
    )
    assert isinstance(err.__cause__, SystemExit)
    assert "SampleMagnitudeMask" in registry
    site.add("llmc-fsm-ctrlc", "1.0", {"c": "ctrlc_plugin"}, {"ctrlc_plugin": "raise KeyboardInterrupt\n"})
    with pytest.raises(KeyboardInterrupt):
        get_registry(reload=True)


NO_HOOK_PLUGIN = """
import attrs
import pluggy
from llmc_fsm import Modifier

@attrs.define(kw_only=True, slots=False, eq=False)
class {cls}(Modifier):
    '''never registered'''

{marker}
def llmc_fsm_register_modifiers():
    return [{cls}]
"""


def test_plugin_without_a_hook_implementation_is_reported(site: Site) -> None:
    unmarked = NO_HOOK_PLUGIN.format(cls="NoHookModifier", marker="")
    other_project = NO_HOOK_PLUGIN.format(cls="OtherMarkModifier", marker="@pluggy.HookimplMarker('llmc-fsm')")
    site.add("llmc-fsm-nohook", "0.2", {"nohook": "nohook_plugin"}, {"nohook_plugin": unmarked})
    site.add("llmc-fsm-othermark", "0.2", {"other": "othermark_plugin"}, {"othermark_plugin": other_project})
    site.add("llmc-fsm-empty", "0.2", {"empty": "empty_plugin"}, {"empty_plugin": "X = 1\n"})
    registry = get_registry()
    unmarked_text = "implements no llmc_fsm hook (missing @hookimpl?): llmc_fsm_register_modifiers is not marked with "
    assert [str(e) for e in ours(registry, "llmc-fsm-nohook", "llmc-fsm-othermark", "llmc-fsm-empty")] == [
        "plugin llmc-fsm-empty 0.2 (entry point 'empty'): implements no llmc_fsm hook (missing @hookimpl?): define "
        "llmc_fsm_register_modifiers marked with @llmc_fsm.hookimpl",
        f"plugin llmc-fsm-nohook 0.2 (entry point 'nohook'): {unmarked_text}@llmc_fsm.hookimpl",
        f"plugin llmc-fsm-othermark 0.2 (entry point 'other'): {unmarked_text}@llmc_fsm.hookimpl",
    ]
    assert registry.manager.get_plugin("llmc-fsm-nohook:nohook") is None
    with pytest.raises(RecipeError, match=r"failed to load .*llmc-fsm-nohook 0\.2 \(entry point 'nohook'\)"):
        Session({"s": {"NoHookModifier": {}}})


def test_first_party_distribution_keeps_its_names_against_a_third_party_that_sorts_first(site: Site) -> None:
    site.add_ok("aaa-clash", "ClashModifier")  # sorts before llmc-fsm-training
    site.add_ok("llmc-fsm-training", "ClashModifier", version="0.9", module="first_party_training")  # shadows the real
    registry = get_registry()
    info = registry.info("ClashModifier")
    assert (info.distribution, info.cls.__module__) == ("llmc-fsm-training", "first_party_training")
    assert ours(registry, "llmc-fsm-training") == []
    (err,) = ours(registry, "aaa-clash")
    assert str(err) == (
        "plugin aaa-clash 1.0 (entry point 'main'): modifier name 'ClashModifier' from aaa-clash 1.0 (entry point "
        "'main') (aaa_clash.ClashModifier) is already registered by llmc-fsm-training 0.9 (entry point 'main') "
        "(first_party_training.ClashModifier); the later one is not registered. Rename one of the classes (override "
        "modifier_name()) or disable one distribution with LLMC_FSM_DISABLE_PLUGINS."
    )
    assert plugins_mod.FIRST_PARTY == frozenset({"llmc-fsm-pruning", "llmc-fsm-quantization", "llmc-fsm-training"})


def test_a_modifier_class_not_decorated_with_attrs_is_refused(site: Site) -> None:
    source = """
    from llmc_fsm import Modifier, hookimpl

    class PlainModifier(Modifier):
        def __init__(self, alpha=1.0):
            self.alpha = alpha

    @hookimpl
    def llmc_fsm_register_modifiers():
        return [PlainModifier]
    """
    site.add("llmc-fsm-plain", "1.0", {"plain": "plain_plugin"}, {"plain_plugin": source})
    registry = get_registry()
    assert "PlainModifier" not in registry
    (err,) = ours(registry, "llmc-fsm-plain")
    assert str(err) == (
        "plugin llmc-fsm-plain 1.0 (entry point 'plain'): plain_plugin.PlainModifier is not an attrs class; decorate "
        "it with @attrs.define(kw_only=True, slots=False, eq=False) (or attrs.frozen), as docs/plugins.md shows"
    )
    class Undecorated(LocalPruning):  # an attrs base is not enough: the class itself must be decorated
        pass

    with pytest.raises(PluginError) as info:
        ModifierRegistry().register(Undecorated)
    assert str(info.value).startswith(
        "test_plugins.test_a_modifier_class_not_decorated_with_attrs_is_refused.<locals>.Undecorated is not an attrs "
        "class; decorate it with @attrs.define("
    )


def test_disable_env_blocks_plugins_before_import(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    site.add("llmc-fsm-broken", "2.1", {"broken": "broken2_plugin"}, {"broken2_plugin": "raise SystemError\n"})
    site.add_sample()
    monkeypatch.setenv(DISABLE_ENV, " LLMC_FSM_Broken , llmc-fsm-sample")
    registry = get_registry()
    assert ours(registry, "llmc-fsm-broken", "llmc-fsm-sample") == []
    assert "SampleMagnitudeMask" not in registry
    assert "broken2_plugin" not in sys.modules
    assert {(d.distribution, d.version, d.entry_point) for d in registry.disabled} >= {
        ("llmc-fsm-broken", "2.1", "broken"),
        ("llmc-fsm-sample", "0.3.0", "sample"),
    }


def test_a_disabled_name_no_distribution_has_is_warned(
    site: Site, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    site.add_sample()
    monkeypatch.setenv(DISABLE_ENV, "llmc-fsm-sampel,llmc-fsm-sample")
    with caplog.at_level("WARNING", logger="llmc_fsm.core.registry"):
        registry = get_registry()
    assert "SampleMagnitudeMask" not in registry
    lines = [r.getMessage() for r in caplog.records if DISABLE_ENV in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith(
        "LLMC_FSM_DISABLE_PLUGINS names llmc-fsm-sampel, which no installed llmc_fsm plugin distribution is called "
        "(installed: "
    )
    assert lines[0].endswith("); nothing was disabled for it")
    assert "llmc-fsm-sample" in lines[0]


# --- in-process registration and lookup -----------------------------------------------------


@attrs.define(kw_only=True, slots=False, eq=False)
class LocalPruning(Modifier):
    """Local test modifier."""


def test_register_in_process() -> None:
    registry = ModifierRegistry()
    registry.register(LocalPruning)
    registry.register(LocalPruning)  # same class again: no-op
    assert registry.get("LocalPruning") is LocalPruning
    assert registry.info("LocalPruning").distribution is None

    other = attrs.make_class("LocalPruning", {}, bases=(Modifier,), slots=False)
    with pytest.raises(PluginError, match=r"'LocalPruning' from <in-process> .* is already registered by <in-process>"):
        registry.register(other)
    with pytest.raises(PluginError, match=r"is not a subclass of llmc_fsm\.Modifier"):
        registry.register(dict)  # type: ignore[arg-type]


def test_a_hook_without_return_is_reported(site: Site) -> None:
    """pluggy drops a ``None`` result: a hook that forgets ``return`` registered nothing and said nothing."""
    source = """
    from llmc_fsm import hookimpl

    @hookimpl
    def llmc_fsm_register_modifiers():
        pass
    """
    site.add("llmc-fsm-noreturn", "1.0", {"n": "noreturn_plugin"}, {"noreturn_plugin": source})
    (err,) = ours(get_registry(), "llmc-fsm-noreturn")
    assert str(err) == (
        "plugin llmc-fsm-noreturn 1.0 (entry point 'n'): llmc_fsm_register_modifiers() returned None (a missing "
        "return?): return a list of Modifier subclasses"
    )


@pytest.mark.parametrize(
    ("declaration", "problem"),
    [
        ("required_state = 'model'", "required_state must be a set of strings (e.g. frozenset({'model'})), got 'model'"),
        ("required_state = None", "required_state must be a set of strings (e.g. frozenset({'model'})), got None"),
        ("required_state = ['model']",
         "required_state must be a set of strings (e.g. frozenset({'model'})), got ['model']"),
        ("optional_state = frozenset({1})", "optional_state must hold non-empty strings, got 1"),
        ("events = frozenset({'batch_strat'})",
         "events ['batch_strat'] are not batch events; on_event receives batch_start, loss_calculated, "
         "optim_pre_step, optim_post_step, batch_end"),
        ("events_after_end = frozenset({'batch_end'})", "events_after_end ['batch_end'] are not in its events []"),
    ],
)
def test_a_class_declaration_that_would_fail_silently_is_refused_at_registration(declaration, problem) -> None:
    """A string ``required_state`` was read as its characters (``requires d, e, l, m, o``), a misspelt event was
    never delivered: each is refused when the class is registered, naming the class."""
    namespace: dict = {}
    exec(f"class Declared(Modifier):\n    {declaration}\n", {"Modifier": Modifier}, namespace)  # noqa: S102
    cls = attrs.define(kw_only=True, slots=False, eq=False)(namespace["Declared"])
    with pytest.raises(PluginError) as info:
        ModifierRegistry().register(cls)
    assert str(info.value) == f"{cls.__module__}.Declared: {problem}"


def test_register_plugin_object_validates_hooks() -> None:
    class Good:
        @hookimpl
        def llmc_fsm_register_modifiers(self):
            return [LocalPruning]

    class Bad:
        @hookimpl
        def llmc_fsm_register_modifiers(self, session):
            return [LocalPruning]

    registry = ModifierRegistry()
    assert registry.register_plugin(Bad(), entry_point="bad") != []
    assert "LocalPruning" not in registry
    assert registry.register_plugin(Good(), entry_point="good") == []
    assert "LocalPruning" in registry


def test_unknown_modifier_suggests_names_and_mentions_broken_plugins() -> None:
    registry = ModifierRegistry()
    registry.register(LocalPruning)
    registry.errors.append(PluginError("plugin x 1.0 (entry point 'x'): failed to import"))
    with pytest.raises(RecipeError) as info:
        registry.get("localpruning")
    text = str(info.value)
    assert "unknown modifier 'localpruning'. Did you mean 'LocalPruning'?" in text
    assert "Known modifiers: LocalPruning." in text
    assert "1 plugin(s) failed to load" in text
    assert "plugin x 1.0" in text


# --- CLI -----------------------------------------------------------------------------------


def test_cli_modifiers_lists_modifiers_and_broken_plugins(site: Site, capsys: pytest.CaptureFixture[str]) -> None:
    site.add_sample()
    site.add("llmc-fsm-broken", "2.1", {"broken": "broken3_plugin"}, {"broken3_plugin": "import nope_nope\n"})
    site.add_ok("llmc-fsm-off", "OffModifier")
    site.monkeypatch.setenv(DISABLE_ENV, "llmc-fsm-off")
    assert main(["modifiers"]) == 1  # a plugin failed to load
    out = capsys.readouterr().out
    assert "SampleMagnitudeMask  [llmc-fsm-sample 0.3.0]" in out
    assert "Zero the smallest-magnitude fraction of every Linear weight" in out
    assert "required state: model" in out
    assert "optional state: -" in out
    assert "batch events: optim_post_step" in out
    assert "ERROR plugin llmc-fsm-broken 2.1 (entry point 'broken'): failed to import" in out
    assert "nope_nope" in out
    assert "llmc-fsm-off 1.0 (entry point 'main')" in out
    assert "OffModifier" not in out.split("Disabled")[0]


# --- conformance kit on the sample plugin ---------------------------------------------------


def test_sample_plugin_obeys_the_lifecycle_contract(site: Site) -> None:
    import torch

    from llmc_fsm.testing import check_modifier

    site.add_sample()
    cls = get_registry().get("SampleMagnitudeMask")
    check_modifier(
        lambda: cls(fraction=0.5),
        lambda: {"model": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))},
        max_examples=200,
    )


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("raise", "modifier_name() raised RuntimeError: exploded"),
        (42, "modifier_name() returned 42: a modifier name is a non-empty string without spaces (the recipe key)"),
        ("", "modifier_name() returned '': a modifier name is a non-empty string without spaces (the recipe key)"),
    ],
)
def test_a_broken_modifier_name_is_one_plugin_error_and_the_disabled_are_named(name, problem, monkeypatch) -> None:
    """B4's cases (session 31): a plugin class whose modifier_name() raised broke every command, even jobs not using
    it (``error: exploded``, naming no distribution); one returning 42 made ``llmc-fsm modifiers`` fail with a
    traceback. Now a PluginError of that class (the others register); an unknown name also says which
    distributions LLMC_FSM_DISABLE_PLUGINS kept out."""

    def modifier_name(cls):
        if name == "raise":
            raise RuntimeError("exploded")
        return name

    broken = attrs.make_class("Broken", {}, bases=(Modifier,), slots=False)
    broken.modifier_name = classmethod(modifier_name)
    registry = ModifierRegistry()
    with pytest.raises(PluginError) as info:
        registry.register(broken)
    assert str(info.value).endswith(problem) and len(registry) == 0
    registry.register(LocalPruning)
    registry.disabled.append(plugins_mod.DisabledPlugin("llmc-fsm-pruning", "0.1.0", "pruning"))
    with pytest.raises(RecipeError) as info:
        registry.get("SparseGPTModifier")
    assert str(info.value).endswith(f"Not loaded, disabled by {DISABLE_ENV}: llmc-fsm-pruning.")
