"""Recipe inputs testers found mishandled in session 37: missing plugins, YAML tags, typos, AWQ's unused arguments."""

from __future__ import annotations

import logging

import pytest
from llmc_fsm_pruning import SparseGPTModifier
from llmc_fsm_quantization import AWQModifier

from llmc_fsm import RecipeError, Session
from llmc_fsm.core import registry as registry_mod
from llmc_fsm.core.registry import ModifierRegistry
from llmc_fsm.oneshot_job.settings import DEFAULT_GENERATED, RecipeFlags
from llmc_fsm.recipes import llmcompressor
from llmc_fsm.recipes.building import resolve_recipe
from llmc_fsm.recipes.loading import load_recipe_data
from llmc_fsm.session.explain import check_state_keys

NEGATIVE_END = (
    "llm-compressor has no 'no end' value: its end -1 lies before the first epoch, so the modifier never runs; "
    "leave end out (null) to run until finalize"
)


def _error(recipe: object) -> str:
    with pytest.raises(RecipeError) as info:
        resolve_recipe(recipe)
    return str(info.value)


@pytest.fixture
def no_pruning(monkeypatch: pytest.MonkeyPatch) -> ModifierRegistry:
    """A registry without any plugin, and llmc-fsm-pruning reported as not installed."""
    registry = ModifierRegistry()
    monkeypatch.setattr(registry_mod, "_REGISTRY", registry)
    monkeypatch.setattr(llmcompressor, "_installed", lambda distribution: distribution != "llmc-fsm-pruning")
    return registry


def test_a_modifier_of_an_uninstalled_distribution_names_the_distribution(no_pruning) -> None:
    """Found by a tester: without llmc-fsm-pruning, SparseGPTModifier was only 'unknown modifier', naming no
    distribution to install."""
    assert _error("s:\n  SparseGPTModifier: {}\n") == (
        "recipe <text>, line 2, stage 's': unknown modifier 'SparseGPTModifier'. SparseGPTModifier is provided by "
        "llmc-fsm-pruning, which is not installed: pip install llmc-fsm-pruning (from a checkout: pip install "
        "./plugins/pruning). Known modifiers: none (is a plugin such as llmc-fsm-pruning installed?)."
    )


def test_a_disabled_distribution_is_not_said_to_be_uninstalled(no_pruning) -> None:
    """The install advice is only for a distribution that is missing: one disabled by LLMC_FSM_DISABLE_PLUGINS is
    named as disabled, as before."""
    no_pruning.disabled.append(registry_mod.DisabledPlugin("llmc-fsm-pruning", "0.1.0", "pruning"))
    assert _error("s:\n  SparseGPTModifier: {}\n") == (
        "recipe <text>, line 2, stage 's': unknown modifier 'SparseGPTModifier'. Known modifiers: none (is a plugin "
        "such as llmc-fsm-pruning installed?). Not loaded, disabled by LLMC_FSM_DISABLE_PLUGINS: llmc-fsm-pruning."
    )


def test_the_default_recipe_without_flags_does_not_claim_flags() -> None:
    """Found by a tester: with no flag given, errors said the recipe was 'generated from --method/--sparsity/...'."""
    assert RecipeFlags().recipe().source == DEFAULT_GENERATED
    assert DEFAULT_GENERATED.startswith("the default recipe (no recipe and no --method")
    assert RecipeFlags(method="sparsegpt").recipe().source == "generated from --method sparsegpt"
    assert RecipeFlags(sparsity=0.4).recipe().source == "generated from --sparsity 0.4"


@pytest.mark.parametrize(
    ("value", "tag"),
    [("!!bool maybe", "bool"), ('!!int ""', "int"), ('!!timestamp "2:4"', "timestamp"), ('!!int "0.5"', "int"),
     ('!!float "x"', "float")],
)  # fmt: skip
def test_a_tagged_value_that_does_not_fit_its_tag_is_a_recipe_error(value, tag) -> None:
    """Found by a tester: !!bool maybe was a KeyError, !!timestamp "2:4" an AttributeError, !!int "" an IndexError
    (tracebacks), !!int "0.5" a bare Python message without the file or line."""
    text = f"s:\n  SparseGPTModifier:\n    sparsity: {value}\n"
    shown = value.split(" ", 1)[1].strip('"')
    with pytest.raises(RecipeError) as info:
        load_recipe_data(text, "r.yaml")
    assert str(info.value) == (
        f"recipe r.yaml, line 3, column 15: not valid YAML/JSON: the value {shown!r} tagged !!{tag} is not a "
        f"valid {tag}; write a valid {tag} or remove the tag"
    )


@pytest.mark.parametrize("text", ["a:\n" + "".join("  " * i + f"b{i}:\n" for i in range(1, 3000)), "[" * 3000])
def test_a_recipe_nested_too_deeply_names_the_file(text) -> None:
    """Found by a tester: a recipe nested 3000 deep gave 'maximum recursion depth exceeded', naming no file."""
    with pytest.raises(RecipeError) as info:
        load_recipe_data(text, "deep.yaml")
    assert str(info.value) == (
        "recipe deep.yaml: not valid YAML/JSON: it nests mappings or lists too deeply to be read (past Python's "
        "recursion limit); a recipe nests a few levels: stage, group, modifier, arguments"
    )


def test_awq_without_scheme_refuses_targets_and_observer() -> None:
    """Found by a tester: AWQModifier without a scheme took targets ['re:.*mlp.*'] and observer mse and ignored
    both (attention was smoothed, the observer unused); llm-compressor 0.14's AWQModifier has neither."""
    text = (
        "s:\n  AWQModifier:\n    targets: ['re:.*mlp.*']\n    observer: mse\n"
        "  QuantizationModifier: {scheme: W4A16}\n"
    )
    assert _error(text) == (
        "recipe <text> has 2 problems; fix them all, then run it again:\n"
        "  - line 3, stage 's', modifier AWQModifier, argument 'targets': targets ['re:.*mlp.*'] would select "
        "nothing: AWQModifier without scheme or config_groups quantizes nothing itself (llm-compressor's AWQModifier "
        "has no targets); put targets on the QuantizationModifier that carries the scheme, and give mappings to "
        "restrict which layers are smoothed\n"
        "  - line 4, stage 's', modifier AWQModifier, argument 'observer': observer 'mse' would be unused: "
        "AWQModifier without scheme or config_groups quantizes with the QuantizationModifier's observer "
        "(llm-compressor's AWQModifier has no observer); put observer on that modifier"
    )
    older = AWQModifier(scheme="W4A16", targets=["re:.*mlp.*"], observer="mse")  # the older form takes both
    assert (older.targets, older.observer) == (["re:.*mlp.*"], "mse")


def test_awq_older_form_refuses_kv_cache_scheme_with_a_pointer() -> None:
    """Found by a tester: kv_cache_scheme on the older-form AWQModifier was only 'unknown argument'."""
    text = "s:\n  AWQModifier:\n    scheme: W4A16\n    kv_cache_scheme: {num_bits: 8, type: float}\n"
    assert _error(text) == (
        "recipe <text>, line 4, stage 's', modifier AWQModifier, argument 'kv_cache_scheme': llm-compressor argument "
        "not supported: AWQModifier's older form (scheme or config_groups) quantizes weights only here; write the "
        "current form: AWQModifier (mappings, smoothing) and a QuantizationModifier with the scheme and "
        "kv_cache_scheme"
    )


def test_a_misspelt_group_key_suggests_the_group_key() -> None:
    """Found by a tester: 'quant_modifers' suggested SpinQuantModifier."""
    text = "quant_stage:\n  quant_modifers:\n    QuantizationModifier: {scheme: W4A16}\n"
    assert _error(text) == (
        "recipe <text>, line 2, stage 'quant_stage': unknown modifier or group 'quant_modifers': llm-compressor "
        "modifier group keys end in '_modifiers'; did you mean 'quant_modifiers'?"
    )


def test_an_argument_dedented_beside_its_modifier_says_to_indent_it() -> None:
    """Found by a tester: smoothing_strength beside an empty SmoothQuantModifier got "Did you mean
    'SmoothQuantModifier'?"."""
    text = "s:\n  q_modifiers:\n    SmoothQuantModifier:\n    smoothing_strength: 0.8\n"
    assert _error(text) == (
        "recipe <text>, line 4, stage 's': 'smoothing_strength' is not a modifier but an argument of "
        "SmoothQuantModifier, which has no arguments here: indent it under SmoothQuantModifier (two spaces further in)"
    )


def test_a_modifier_dedented_to_group_level_names_the_stage_group() -> None:
    """Found by a tester: the hint named 'modifiers:' although the stage's group was obcq_modifiers."""
    text = "s:\n  obcq_modifiers:\n  SparseGPTModifier:\n    sparsity: 0.7\n"
    assert _error(text).split("\n")[1] == (
        "  - line 3, stage 's': unknown stage key(s) 'SparseGPTModifier' (modifier names go under 'obcq_modifiers' "
        "here: indent them under it); the long form accepts modifiers, applied, start, end, run_type and "
        "llm-compressor modifier groups ('<group>_modifiers', e.g. 'pruning_modifiers')"
    )


def test_a_list_entry_with_arguments_beside_its_name_says_to_indent_them() -> None:
    """Found by a tester: the error dumped the whole entry as a dict."""
    text = "s:\n  obcq_modifiers:\n    - SparseGPTModifier:\n      sparsity: 0.7\n      block_size: 128\n"
    assert _error(text) == (
        "recipe <text>, line 3, stage 's': the list entry SparseGPTModifier has its arguments (sparsity, block_size) "
        "beside its name, at the same indent: indent the arguments under the name (- SparseGPTModifier:, then each "
        "argument two spaces further in)"
    )


def test_a_top_level_anchor_holder_is_ignored_beside_stages(caplog) -> None:
    """Found by a tester: 'x-defaults: &d {...}' beside '*_stage' keys was refused as "unknown modifier 'sparsity'";
    llm-compressor reads only the '_stage' keys. Without any '_stage' key it stays a stage (and an error)."""
    text = "x-defaults: &d\n  sparsity: 0.6\nsparsity_stage:\n  sparsity_modifiers:\n    SparseGPTModifier: *d\n"
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.recipes.llmcompressor"):
        recipe = resolve_recipe(text)
    assert [s.name for s in recipe.stages] == ["sparsity_stage"] and recipe.modifiers[0].sparsity == 0.6
    assert caplog.messages == [
        "recipe <text>, line 1: top-level key 'x-defaults' ignored: it is not a stage (its name does not end in "
        "'_stage' and it holds no modifier), as llm-compressor reads only the '*_stage' keys of a recipe that has some"
    ]
    assert _error(text.replace("sparsity_stage", "s")).startswith(
        "recipe <text>, line 2, stage 'x-defaults': unknown modifier 'sparsity'. Did you mean 'SparseGPTModifier'?"
    )


@pytest.mark.parametrize(
    ("args", "shown", "extra"),
    [("targets: ''", "''", ""), ("ignore: ['']", "['']", " ([] for none)"),
     ("targets: [Linear, ' ']", "['Linear', ' ']", "")],
)  # fmt: skip
def test_an_empty_module_pattern_is_refused(args, shown, extra) -> None:
    """Found by a tester: targets '' quantized every Linear (llm-compressor: none); ignore [''] ignored nothing."""
    key = args.split(":")[0]
    assert _error(f"s:\n  QuantizationModifier:\n    scheme: W4A16\n    {args}\n") == (
        f"recipe <text>, line 4, stage 's', modifier QuantizationModifier, argument {key!r}: {key} {shown}: an empty "
        f"module pattern names no module (llm-compressor matches nothing with it); give module names or "
        f"patterns{extra}, or leave {key} out for the modifier's default"
    )


def test_a_negative_modifier_end_is_refused_as_a_stage_end() -> None:
    """Found by a tester: end: -1 was taken on a modifier (never active) but refused on a stage."""
    assert _error("s:\n  ConstantPruningModifier:\n    end: -1\n") == (
        f"recipe <text>, line 3, stage 's', modifier ConstantPruningModifier, argument 'end': end must be >= 0 "
        f"epochs, got -1: {NEGATIVE_END}"
    )
    assert _error("s:\n  end: -1\n  modifiers:\n    ConstantPruningModifier:\n") == (
        f"recipe <text>, line 2, stage 's': end must be >= 0 epochs, got -1: {NEGATIVE_END}"
    )


def test_a_config_group_integer_written_as_a_string() -> None:
    """Found by a tester: group_size "128" in config_groups was "TypeError: '<' not supported between instances of
    'str' and 'int'", naming neither the group nor the field. Now read as pydantic reads it, or refused by name."""
    text = "s:\n  GPTQModifier:\n    config_groups:\n      g:\n        targets: [Linear]\n"
    text += "        weights: {num_bits: 4, strategy: group, group_size: SIZE}\n"
    (modifier,) = resolve_recipe(text.replace("SIZE", '"128"')).modifiers
    assert modifier.config_groups["g"]["weights"]["group_size"] == 128
    assert _error(text.replace("SIZE", '"12x"')) == (
        "recipe <text>, line 3, stage 's', modifier GPTQModifier, argument 'config_groups': config_groups entry 'g', "
        "weights: group_size must be an integer, got '12x'"
    )


def test_a_modifier_object_under_another_name_is_refused() -> None:
    """Found by a tester: {"WandaPruningModifier": SparseGPTModifier()} ran SparseGPT silently."""
    assert _error({"s": {"WandaPruningModifier": SparseGPTModifier()}}) == (
        "recipe <dict>, stage 's': the key 'WandaPruningModifier' maps to a SparseGPTModifier object: the key names "
        "the modifier, so write 'SparseGPTModifier' as the key, or give a WandaPruningModifier"
    )


def test_an_unknown_state_key_is_refused_with_the_closest() -> None:
    """Found by a tester: explain --state calibration-data was counted as present (calibration_data still
    MISSING)."""
    session = Session("s:\n  SparseGPTModifier: {}\n")
    check_state_keys(session, ["model", "calibration_data"])
    with pytest.raises(ValueError) as info:
        check_state_keys(session, ["calibration-data"])
    assert str(info.value) == (
        "unknown state key 'calibration-data': it is no well-known state key and no modifier of the recipe requires "
        "or uses it. Did you mean 'calibration_data'? Known: calibration_data, model, optimizer, steps_per_epoch, "
        "teacher, train_data"
    )


def test_a_long_value_is_cut_in_errors() -> None:
    """Found by a tester: a 200 KB value was repeated whole in the error (a 200 KB line)."""
    big = "x" * 200_000
    message = _error(f"s:\n  SparseGPTModifier:\n    mask_structure: {big}\n")
    assert len(message) < 500 and f"'{'x' * 76}..." in message
    message = _error(f"s:\n  - {{a: 1, c: '{big}'}}\n")
    assert len(message) < 500 and message.endswith("...")


def test_explain_refuses_an_unknown_state_key_with_the_close_one(tmp_path, capsys):
    """`llmc-fsm explain R --state calibration-data` counted the misspelt key as present, while calibration_data
    stayed missing (found by a tester)."""
    from llmc_fsm.cli.main import main as cli_main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("s:\n  SparseGPTModifier:\n    sparsity: 0.5\n")
    assert cli_main(["explain", str(recipe), "--state", "calibration-data", "--state", "model"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llmc-fsm explain: error: unknown state key 'calibration-data': it is no well-known state "
                          "key and no modifier of the recipe requires or uses it. Did you mean 'calibration_data'?")
    assert cli_main(["explain", str(recipe), "--state", "calibration_data", "--state", "model"]) == 0


def test_a_stage_start_on_a_one_shot_stage_is_named_as_the_stage_s():
    """`start: 0` written on the stage blamed SparseGPTModifier's start/end/update ("remove them") although the
    modifier was given none: it inherits the stage's (found by a tester)."""
    import tiny_llama
    import torch

    import llmc_fsm

    recipe = {"s": {"start": 0, "modifiers": {"SparseGPTModifier": {"sparsity": 0.5}}}}
    with pytest.raises(llmc_fsm.MissingStateError) as info:
        llmc_fsm.oneshot(model=tiny_llama.llama(), recipe=recipe, dataset=torch.randint(3, 100, (4, 16)),
                         progress=False)  # fmt: skip
    assert str(info.value) == (
        "SparseGPTModifier: start/end/update are a training schedule counted in epochs (steps_per_epoch, which "
        "one-shot does not give) (given on stage 's': its modifiers inherit the stage's start/end), and this modifier "
        "compresses once from calibration data: remove them to run it in one-shot (llm-compressor's oneshot ignores "
        "them)"
    )
