"""``explain(session)``, ``llmc-fsm explain`` and the conformance kit's own failure modes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
import torch

from llmc_fsm import Modifier, Session, State
from llmc_fsm.cli import main
from llmc_fsm.core import registry as plugins_mod
from llmc_fsm.core.registry import ModifierRegistry
from llmc_fsm.session.explain import explain, handled_events
from llmc_fsm.testing import ContractViolation, check_modifier


@attrs.define(kw_only=True, slots=False, eq=False)
class Calib(Modifier):
    """One-shot calibrated pruning."""

    required_state: ClassVar[frozenset[str]] = frozenset({"model", "calibration_data"})
    optional_state: ClassVar[frozenset[str]] = frozenset({"teacher"})
    sparsity: float = 0.5

    def on_initialize(self, state: State) -> None:
        pass

    def on_sequential_epoch_end(self, state: State, modules: Any) -> None:
        pass


@attrs.define(kw_only=True, slots=False, eq=False)
class Hold(Modifier):
    """Hold masks after steps."""

    required_state: ClassVar[frozenset[str]] = frozenset({"model"})
    events: ClassVar[frozenset[str]] = frozenset({"optim_post_step", "batch_start"})
    runs_after: ClassVar[frozenset[str]] = frozenset({"Calib"})

    def on_event(self, state: State, event: Any) -> None:
        pass

    def on_end(self, state: State, event: Any) -> None:
        pass


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> ModifierRegistry:
    reg = ModifierRegistry()
    reg.register(Calib)
    reg.register(Hold)
    monkeypatch.setattr(plugins_mod, "_REGISTRY", reg)
    return reg


RECIPE = """\
old:
  modifiers: {Calib: {}}
  applied: true
train:
  start: 1
  modifiers:
    Hold: {end: 3}
    Calib: {sparsity: 0.7}
"""


class Untouchable:
    """A 'model' that fails on any use: explain must not touch it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"explain touched the model ({name})")


def test_handled_events() -> None:
    assert handled_events(Calib) == ["initialize", "sequential_epoch_end"]
    assert handled_events(Hold()) == ["batch_start", "optim_post_step", "end"]
    assert handled_events(Modifier) == []


def test_explain_plan(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    session = Session(path)
    session.update_state(model=Untouchable())
    text = explain(session)
    assert text.splitlines() == [
        f"Recipe {path}: 2 stage(s), 2 modifier(s) to run",
        "Session lifecycle: staging; state present: model",
        "Stage 'old': already applied, skipped (Calib)",
        "Stage 'train' [epochs 1 to -]:",
        "  1. Calib  [in-process]",
        "       arguments: sparsity=0.7",
        "       active:    from epoch 1 until finalize",
        "       handles:   initialize, sequential_epoch_end",
        "       requires:  calibration_data (MISSING), model (present), steps_per_epoch (MISSING)",
        "       optional:  teacher (absent)",
        "  2. Hold  [in-process]",
        "       arguments: -",
        "       active:    from epoch 1 until epoch 3",
        "       handles:   batch_start, optim_post_step, end",
        "       requires:  model (present), steps_per_epoch (MISSING)",
        "       optional:  -",
        "       runs after: Calib (when in the recipe)",
        "Missing before initialize():",
        "  - Calib: calibration_data, steps_per_epoch",
        "  - Hold: steps_per_epoch",
    ]


def test_explain_after_initialize_and_empty() -> None:
    session = Session({"s": ["Calib", "Calib"]})
    session.initialize(model=torch.nn.Linear(2, 2), calibration_data=[1])
    text = explain(session)
    assert "  1. Calib#1  [in-process]" in text and "  2. Calib#2  [in-process]" in text
    assert "Session lifecycle: initialized; state present: calibration_data, model" in text
    assert "Missing before initialize" not in text
    assert "No stages: the session runs without modifiers." in explain(Session())
    ready = Session({"s": ["Calib"]})
    ready.update_state(model=1, calibration_data=2)
    assert explain(ready).endswith("Ready to initialize: every required state key is present.\n")


def test_cli_explain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    assert main(["explain", str(path), "--state", "steps_per_epoch"]) == 0
    out = capsys.readouterr().out
    assert "requires:  calibration_data (MISSING), model (MISSING), steps_per_epoch (present)" in out
    assert out.endswith(
        "(Expected here: `llmc-fsm oneshot` gives calibration_data and model; `explain RECIPE --model DIR` runs "
        "oneshot's checks of a model and shows, where a modifier resolves modules (AWQ, SmoothQuant), how they map "
        "on it.)\n"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("s:\n  Hold: {ends: 3}\n")
    assert main(["explain", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"llmc-fsm explain: error: recipe {bad}, line 2, stage 's', modifier Hold: unknown argument 'ends'" in err


def test_cli_explain_a_modifier_name_shows_its_arguments_and_defaults(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["explain", "Calib"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2:5] == ["Stage 'defaults':", "  1. Calib  [in-process]", "       arguments: sparsity=0.5 (default)"]
    (tmp_path / "Calib").write_text("s:\n  Hold: {ends: 3}\n")  # a file of that name wins
    assert main(["explain", "Calib"]) == 1
    assert "unknown argument 'ends'" in capsys.readouterr().err


KNOWN = "Known modifiers: Calib, Hold."


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("calib", " Did you mean 'Calib'?"),  # wrong case
        ("Hol", " Did you mean 'Hold'?"),
        ("Zebra", ""),
        (
            "QuIPModifier",
            " QuIPModifier is an llm-compressor modifier that llmc-fsm does not implement (QuIP-style Hadamard "
            "rotations of every Linear's input at run time, which transformers does not apply when it loads a "
            "compressed-tensors checkpoint; SpinQuantModifier fuses R1/R2 rotations into the weights instead); "
            "remove it from the recipe or use llm-compressor for it.",
        ),
    ],
)
def test_cli_explain_an_unknown_name_gets_the_unknown_modifier_message(tmp_path, capsys, monkeypatch, name, hint):
    monkeypatch.chdir(tmp_path)
    assert main(["explain", name]) == 1
    assert capsys.readouterr().err == (
        f"llmc-fsm explain: error: no recipe file or modifier named {name!r}.{hint} {KNOWN}\n"
    )


def test_cli_explain_an_unknown_name_names_broken_and_disabled_plugins(registry, capsys, monkeypatch) -> None:
    from llmc_fsm.core.errors import PluginError
    from llmc_fsm.core.registry import DisabledPlugin

    monkeypatch.setattr(registry, "errors", [PluginError("plugin 'bad' (badpkg 1.0): ImportError: no module x")])
    monkeypatch.setattr(registry, "disabled", [DisabledPlugin("llmc-fsm-quantization", "0.1.0", "quantization")])
    assert main(["explain", "GPTQModifier"]) == 1
    assert capsys.readouterr().err == (
        f"llmc-fsm explain: error: no recipe file or modifier named 'GPTQModifier'. {KNOWN} 1 plugin(s) failed to "
        "load (run `llmc-fsm modifiers`): plugin 'bad' (badpkg 1.0): ImportError: no "
        "module x Not loaded, disabled by LLMC_FSM_DISABLE_PLUGINS: llmc-fsm-quantization.\n"
    )


@attrs.define(kw_only=True, slots=False, eq=False)
class Needs(Modifier):
    """Needs a rate."""

    rate: float
    steps: int = 3
    names: list = attrs.field(factory=list)

    def on_initialize(self, state: State) -> None:
        pass


def test_cli_explain_a_modifier_with_required_arguments_names_them(registry, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    registry.register(Needs)
    assert main(["explain", "Needs"]) == 0  # lists its arguments (issue 27: it used to be an error)
    assert capsys.readouterr().out == (
        "Needs: arguments (default):\n  rate = (required)\n  steps = 3\n  names = []\n"
        "No plan with the defaults alone: rate (no default). See its plan with a recipe that sets what it needs, "
        "e.g. llmc-fsm explain 's: {Needs: {rate: VALUE}}'\n"
    )
    assert main(["explain", "s: {Needs: {rate: 0.5}}"]) == 0
    assert "arguments: rate=0.5, steps=3 (default), names=[] (default)" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["missing.yaml", "dir/Calib", "Calib:"])
def test_cli_explain_a_text_that_is_no_bare_name_is_still_read_as_a_recipe(tmp_path, capsys, monkeypatch, text):
    monkeypatch.chdir(tmp_path)
    assert main(["explain", text]) == 1
    assert "no recipe file or modifier named" not in capsys.readouterr().err


# --- the conformance kit catches broken modifiers -------------------------------------------


def tiny_state() -> dict[str, Any]:
    return {"model": torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)), "steps_per_epoch": 4}


@attrs.define(kw_only=True, slots=False, eq=False)
class Good(Modifier):
    required_state: ClassVar[frozenset[str]] = frozenset({"model"})
    events: ClassVar[frozenset[str]] = frozenset({"batch_end"})
    seen: list[str] = attrs.field(factory=list, init=False)

    def on_initialize(self, state: State) -> None:
        self.register_hook(state.model[0], lambda *a: None)

    def on_event(self, state: State, event: Any) -> None:
        self.seen.append(event.type)


@attrs.define(kw_only=True, slots=False, eq=False)
class LeaksTorchHook(Good):
    def on_initialize(self, state: State) -> None:
        state.model[0].register_forward_hook(lambda *a: None)


@attrs.define(kw_only=True, slots=False, eq=False)
class UsesUndeclaredKey(Good):
    def on_initialize(self, state: State) -> None:
        state["steps_per_epoch"]


@attrs.define(kw_only=True, slots=False, eq=False)
class StartsItself(Good):
    def on_initialize(self, state: State) -> None:
        self.on_start(state, None)  # work outside its event


@attrs.define(kw_only=True, slots=False, eq=False)
class CrashesOnEvent(Good):
    def on_event(self, state: State, event: Any) -> None:
        raise RuntimeError("bad batch")


@attrs.define(kw_only=True, slots=False, eq=False)
class UnsavableState(Good):
    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "handle": object()}


def test_conformance_kit_passes_a_good_modifier() -> None:
    check_modifier(Good, tiny_state, max_examples=200)


def test_conformance_kit_fixture_uses_option(llmc_fsm_check: Any) -> None:
    llmc_fsm_check(Good, tiny_state)


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (LeaksTorchHook, "register hooks with Modifier.register_hook()"),
        (UsesUndeclaredKey, "initialize() with only its declared keys"),
        (StartsItself, "on_start() ran during initialize()"),
        (CrashesOnEvent, "on_event() raised during a valid batch_end(): RuntimeError: bad batch"),
        (
            UnsavableState,
            "UnsavableState: its state_dict() after one batch could not be written and loaded into a fresh session: "
            "TypeError: checkpoint state at modifiers/UnsavableState/handle: a object is neither a tensor nor a JSON",
        ),
    ],
)
def test_conformance_kit_catches(cls: type[Modifier], message: str) -> None:
    with pytest.raises(ContractViolation, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_modifier(cls, tiny_state, max_examples=200)


def test_conformance_kit_requires_a_complete_state_factory() -> None:
    with pytest.raises(ContractViolation, match=r"state_factory\(\) does not supply the required key\(s\) \['model'\]"):
        check_modifier(Good, dict, max_examples=1)


# --- (default) marks the values the recipe did not give ---------------------------------------------


def _arguments_line(recipe: Any) -> str:
    lines = [line for line in explain(Session(recipe)).splitlines() if line.startswith("       arguments: ")]
    assert len(lines) == 1
    return lines[0].removeprefix("       arguments: ")


def test_explain_marks_only_the_values_the_recipe_did_not_give() -> None:
    assert _arguments_line("s: {Calib: {sparsity: 0.5}}") == "sparsity=0.5"  # given, though equal to the default
    assert _arguments_line("s: {Calib: {}}") == "sparsity=0.5 (default)"
    assert _arguments_line([Calib(sparsity=0.5)]) == "sparsity=0.5 (default)"  # an object: compared to the default
    assert _arguments_line([Calib(sparsity=0.7)]) == "sparsity=0.7"


LM_HEAD = "llm-compressor's default ignore is empty, which quantizes lm_head too: give ignore: [] for that"
NO_SCHEME = (
    "llm-compressor has no default scheme: without scheme or config_groups its QuantizationModifier refuses the "
    "recipe and its GPTQModifier only uses a config an earlier modifier attached; give scheme: W4A16 for the same run "
    "there"
)
NO_SCHEME_AUTOROUND = (
    "llm-compressor has no default scheme: without scheme or config_groups its AutoRoundModifier has none to tune and "
    "stops ('AutoRoundModifier requires at least one quantization scheme'); give scheme: W4A16 for the same run there"
)
GPTQ_REST = (
    "kv_cache_scheme=None (default), calibrate_all_experts=False (default), block_size=128 (default), "
    "dampening_frac=0.01 (default), actorder='static' (default)"
)


@pytest.fixture
def quantizers(registry: ModifierRegistry) -> None:
    from llmc_fsm_quantization.gptq import GPTQModifier
    from llmc_fsm_quantization.rtn import QuantizationModifier

    registry.register(GPTQModifier)
    registry.register(QuantizationModifier)


@pytest.mark.usefixtures("quantizers")
@pytest.mark.parametrize(
    ("recipe", "line"),
    [
        (  # values the recipe gave are not marked, even the ones equal to a default (targets)
            "s: {GPTQModifier: {scheme: W8A16, targets: [Linear], dampening_frac: 0.05}}",
            "targets=['Linear'], scheme='W8A16', config_groups=None (default), observer='minmax' (default), "
            f"input_observer=None (default), ignore=['lm_head'] (default; {LM_HEAD}), kv_cache_scheme=None (default), "
            "calibrate_all_experts=False (default), block_size=128 (default), dampening_frac=0.05, "
            "actorder='static' (default)",
        ),
        (  # nothing given: every value a default, with where llm-compressor's defaults differ
            "s: {GPTQModifier: {}}",
            f"targets=['Linear'] (default), scheme='W4A16' (default; {NO_SCHEME}), config_groups=None (default), "
            f"observer='minmax' (default), input_observer=None (default), ignore=['lm_head'] (default; {LM_HEAD}), "
            + GPTQ_REST,
        ),
        (  # ignore given as llm-compressor's default; scheme None next to config_groups: no difference to name
            "s: {GPTQModifier: {ignore: [], config_groups: {g: {targets: [Linear], weights: {num_bits: 8}}}}}",
            "targets=['Linear'] (default), scheme=None (default), config_groups={'g': {'targets': ['Linear'], "
            "'weights': {'num_bits': 8}}}, observer='minmax' (default), input_observer=None (default), ignore=[], "
            + GPTQ_REST,
        ),
        (  # targets set from config_groups: marked so, not "(default)" (a newcomer of session 16)
            "s: {GPTQModifier: {ignore: [], config_groups: {g: {targets: ['re:.*self_attn.*'], weights: {num_bits: 8}}}}}",
            "targets=['re:.*self_attn.*'] (from config_groups), scheme=None (default), config_groups={'g': {'targets': "
            "['re:.*self_attn.*'], 'weights': {'num_bits': 8}}}, observer='minmax' (default), input_observer=None "
            "(default), ignore=[], " + GPTQ_REST,
        ),
        (  # a bare GPTQModifier takes the QuantizationModifier's config: those arguments count as given
            "s: {QuantizationModifier: {scheme: W8A16, ignore: [lm_head]}, GPTQModifier: {}}",
            "targets=['Linear'] (default), scheme='W8A16', config_groups=None (default), observer='minmax' (default), "
            "input_observer=None (default), ignore=['lm_head'], " + GPTQ_REST,
        ),
    ],
)
def test_explain_marks_defaults_and_where_llm_compressor_differs(recipe: str, line: str) -> None:
    assert _arguments_line(recipe) == line


@pytest.mark.usefixtures("quantizers")
def test_cli_explain_a_quantizer_by_name_shows_every_default(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["explain", "QuantizationModifier"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[4] == (
        f"       arguments: targets=['Linear'] (default), scheme='W4A16' (default; {NO_SCHEME}), config_groups=None "
        "(default), observer='minmax' (default), input_observer=None (default), ignore=['lm_head'] (default; "
        f"{LM_HEAD}), kv_cache_scheme=None (default), calibrate_all_experts=False (default)"
    )


def test_explain_names_where_llm_compressor_pruning_defaults_differ(registry: ModifierRegistry) -> None:
    from llmc_fsm_pruning.constant import ConstantPruningModifier
    from llmc_fsm_pruning.sparsegpt import SparseGPTModifier

    registry.register(SparseGPTModifier)
    registry.register(ConstantPruningModifier)
    assert _arguments_line("s: {SparseGPTModifier: {sparsity: 0.5, ignore: [lm_head]}}") == (
        "targets=['Linear'] (default), ignore=['lm_head'], sparsity=0.5, mask_structure='unstructured' (default), "
        "calibrate_all_experts=False (default), block_size=128 (default), dampening_frac=0.01 (default), "
        "preserve_sparsity_mask=False (default)"
    )
    assert _arguments_line("s: {ConstantPruningModifier: {}}") == (
        "targets=['Linear'] (default; llm-compressor requires targets (no default): give targets: [Linear] there), "
        "ignore=['lm_head'] (default; llm-compressor has no ignore: every module its targets match is pruned there, "
        "lm_head included)"
    )


def test_explain_names_llmcompressors_autoround_defaults(registry: ModifierRegistry) -> None:
    """AutoRound's note is its own (llm-compressor's AutoRoundModifier stops without a scheme), not GPTQ's."""
    from llmc_fsm_quantization.autoround import AutoRoundModifier

    registry.register(AutoRoundModifier)
    line = _arguments_line("s: {AutoRoundModifier: {}}")
    assert line.startswith(
        f"targets=['Linear'] (default), scheme='W4A16' (default; {NO_SCHEME_AUTOROUND}), config_groups=None (default)"
    )
    assert f"ignore=['lm_head'] (default; {LM_HEAD})" in line and "GPTQModifier" not in line


def test_explain_says_what_awqs_default_scheme_stands_for(registry: ModifierRegistry) -> None:
    """llm-compressor's current AWQ form leaves the scheme to the QuantizationModifier after it: explain says so
    instead of a bare ``scheme=None (default)``; a scheme the recipe gives is shown as given."""
    from llmc_fsm_quantization.awq import AWQModifier

    registry.register(AWQModifier)
    line = _arguments_line("s: {AWQModifier: {}}")
    assert "scheme=None (default: the quantizing modifier in the same stage carries the scheme)" in line
    assert "config_groups=None (default)," in line
    given = _arguments_line("s: {AWQModifier: {scheme: W4A16}}")
    assert "scheme='W4A16'," in given and "the quantizing modifier" not in given



def test_cli_explain_dash_is_not_read_as_recipe_text(capsys) -> None:
    """``llmc-fsm explain -`` parsed '-' as the YAML text of a list ("got a list"; a fuzzing tester's nit)."""
    assert main(["explain", "-"]) == 1
    assert capsys.readouterr().err == (
        "llmc-fsm explain: error: RECIPE '-' (standard input) is not read: give the recipe file's path\n"
    )


_EMBEDDING_RECIPE = """\
test_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          weights: {num_bits: 8, type: int, symmetric: true, strategy: tensor}
          input_activations: {num_bits: 8, type: int, symmetric: false, strategy: tensor}
          targets: [Linear]
        group_1:
          weights: {num_bits: 8, type: int, symmetric: true, strategy: tensor}
          targets: [Embedding]
"""


@pytest.mark.usefixtures("quantizers")
def test_explain_model_accepts_a_quantized_embedding_as_oneshot_does(tmp_path, capsys):
    """llm-compressor's new_quant_simple.yaml (a weight-only group on ``Embedding``) ran in ``oneshot``, which
    quantizes ``model.embed_tokens`` data-free, but ``explain --model`` said "oneshot would refuse this recipe ...:
    QuantizationModifier targets model.embed_tokens, outside the decoder layers" (found by a tester): its check
    left out the targets a modifier compresses without calibration inputs."""
    from tiny_llama import llama

    from llmc_fsm import oneshot

    llama(hidden=64, kv_heads=4, tied=False).save_pretrained(tmp_path / "m")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(_EMBEDDING_RECIPE)
    capsys.readouterr()
    assert main(["explain", str(recipe), "--model", str(tmp_path / "m")]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.endswith(
        f"(Expected here: `llmc-fsm oneshot` gives calibration_data; oneshot's checks of --model {tmp_path / 'm'} "
        "pass.)\n"
    )
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    done = oneshot(model=str(tmp_path / "m"), recipe=str(recipe), dataset=ids, output_dir=str(tmp_path / "out"),
                   low_memory=False)  # the reference: oneshot runs it, the embedding quantized
    assert hasattr(done.get_input_embeddings(), "quantization_scheme")
