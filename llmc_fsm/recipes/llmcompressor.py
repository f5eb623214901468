"""Reading recipes written for llm-compressor: their nesting and their argument names.

llm-compressor nests ``stage -> <group>_modifiers -> ModifierName -> arguments``,
a stage may carry ``run_type: oneshot|train``, and modifier groups may also sit
at the top level (one implicit ``default`` stage). The builder
(:mod:`llmc_fsm.recipes.building`) reads that nesting directly; this module holds
what is specific to it:

* :func:`is_group_key` -- ``<group>_modifiers`` keys;
* :func:`top_level_stages` -- top-level groups gathered into one ``default``
  stage, the old ``stages:`` wrapper unwrapped, ``version``/``metadata`` skipped,
  ``args`` refused (llm-compressor evaluates its "eval" expressions with them;
  llmc-fsm has no expression language);
* :data:`ARGUMENT_RULES` -- llm-compressor argument names that the llmc-fsm
  modifiers do not have as fields: each is renamed, accepted and ignored (with
  the reason), or refused with the reason. Such a rule is only consulted for a
  name that is *not* a field of the modifier class, so a plugin that implements
  the argument itself always wins. Two ``"value"`` rules rewrite llm-compressor
  forms of arguments the modifiers do have (``scheme: {PRESET: targets}``,
  ``observer: {weights: NAME}``).

``docs/recipes.md`` carries the same table for readers (a test compares them). The same rules apply to modifiers
built in Python (``GPTQModifier(percdamp=0.01)``): :func:`translate_arguments` is registered in
:data:`llmc_fsm.core.modifier.ARGUMENT_TRANSLATORS`.

:data:`DEFAULT_DIFFERENCES` says where an llmc-fsm default differs from llm-compressor's for the same
recipe (``llmc-fsm explain`` shows it next to the value; the run logs it and the saved recipe.yaml records
the value used).

:data:`UNIMPLEMENTED_MODIFIERS` names llm-compressor modifiers llmc-fsm does not
implement, so that the unknown-modifier error says so (:func:`unimplemented_note`).
"""

from __future__ import annotations

import difflib
import dis
import importlib.metadata
import logging
import math
import numbers
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from llmc_fsm.core.errors import RecipeError
from llmc_fsm.core.modifier import ARGUMENT_TRANSLATORS
from llmc_fsm.core.registry import get_registry
from llmc_fsm.recipes.loading import MarkedDict, line_of, shown

__all__ = [
    "ARGUMENT_RULES",
    "DEFAULT_DIFFERENCES",
    "FIRST_PARTY_MODIFIERS",
    "GROUP_SUFFIX",
    "NAMESAKES",
    "NEGATIVE_END",
    "RUN_TYPES",
    "STAGE_SUFFIX",
    "UNIMPLEMENTED_MODIFIERS",
    "ArgumentRule",
    "Namesake",
    "default_difference",
    "is_group_key",
    "is_numpy_bool",
    "is_numpy_scalar",
    "missing_plugin_note",
    "namesake_arguments",
    "namesake_note",
    "number_from_string",
    "plugin_getattr",
    "top_level_stages",
    "translate_argument",
    "translate_arguments",
    "unimplemented_note",
]

logger = logging.getLogger(__name__)

#: Suffix of llm-compressor modifier-group keys (``pruning_modifiers``, ``quantization_modifiers``...).
GROUP_SUFFIX = "_modifiers"
#: Values a stage's ``run_type`` may take (``post_train``: another name of ``oneshot`` in llm-compressor's recipes).
RUN_TYPES: tuple[str, ...] = ("oneshot", "post_train", "train")
#: Top-level keys llm-compressor writes as recipe metadata; read and ignored.
METADATA_KEYS: tuple[str, ...] = ("version", "metadata")
#: Suffix of llm-compressor's stage keys; in a recipe with such keys, a top-level key that is no stage (a YAML
#: anchor holder) is ignored, as llm-compressor reads only those keys (:func:`top_level_stages`).
STAGE_SUFFIX = "_stage"
#: Name of the stage that top-level modifier groups form (as in llm-compressor).
DEFAULT_STAGE = "default"


def _not_a_stage(key: Any, body: Any) -> bool:
    """Whether top-level ``key`` is no stage to read (a holder of YAML anchors, ``x-defaults: &d {...}``): its name
    does not end in :data:`STAGE_SUFFIX`, it is none of the keys read otherwise, and its value is a scalar or a
    mapping with no modifier name (capitalized), modifier group or ``modifiers`` key."""
    if not isinstance(key, str) or key.endswith(STAGE_SUFFIX) or key in (*METADATA_KEYS, "args", "stages"):
        return False
    if is_group_key(key) or body is None:
        return False
    if isinstance(body, str | int | float | bool):
        return True
    return isinstance(body, Mapping) and not any(
        isinstance(k, str) and (k[:1].isupper() or is_group_key(k) or k == "modifiers") for k in body
    )


def is_group_key(key: Any) -> bool:
    """Whether ``key`` is an llm-compressor modifier group such as ``pruning_modifiers``."""
    return isinstance(key, str) and key.endswith(GROUP_SUFFIX) and len(key) > len(GROUP_SUFFIX)


def top_level_stages(data: Mapping[Any, Any], source: str) -> list[tuple[Any, Any, int | None]]:
    """``[(stage name, stage body, line)]`` of a top-level mapping, llm-compressor shapes included.

    Top-level ``<group>_modifiers`` keys become one stage named ``default`` (at the
    place of the first group), whose body holds those groups; ``stages:`` (an
    older llm-compressor wrapper) contributes the stages it maps; ``version`` and
    ``metadata`` are skipped. In a recipe with keys ending in ``_stage``, a key that is no stage (its name does
    not end so and its value is a scalar or a mapping without modifier names or groups: a holder of YAML anchors
    such as ``x-defaults: &d {...}``) is skipped with one warning line, as llm-compressor skips every such key.
    Every other key is a stage name.

    Raises:
        RecipeError: a top-level ``args`` key, a ``stages:`` value that is not a
            mapping, or a ``default`` stage next to top-level groups.
    """
    stages: list[tuple[Any, Any, int | None]] = []
    groups = MarkedDict()
    staged = any(isinstance(key, str) and key.endswith(STAGE_SUFFIX) for key in data)
    for key, body in data.items():
        line = line_of(data, key)
        if staged and _not_a_stage(key, body):
            logger.warning(
                "recipe %s, line %s: top-level key %r ignored: it is not a stage (its name does not end in %r and it "
                "holds no modifier), as llm-compressor reads only the '*%s' keys of a recipe that has some",
                source, line or 1, key, STAGE_SUFFIX, STAGE_SUFFIX,
            )  # fmt: skip
            continue
        if key == "args":
            msg = (
                f"recipe {source}, line {line or 1}: 'args' (llm-compressor's values for its eval expressions) "
                "is not supported: llmc-fsm has no expression language. Write the values in place and remove 'args'"
            )
            raise RecipeError(msg)
        if key in METADATA_KEYS:
            continue
        if is_group_key(key):
            if not groups:
                groups.line = line
                stages.append((DEFAULT_STAGE, groups, line))
            groups[key] = body
            groups.key_lines[key] = line  # type: ignore[assignment]
        elif key == "stages" and isinstance(body, Mapping) and body:
            stages.extend((name, inner, line_of(body, name)) for name, inner in body.items())
        elif key == "stages" and body is not None and not isinstance(body, Mapping):
            msg = f"recipe {source}, line {line or 1}: 'stages' must map stage names to stages"
            raise RecipeError(msg)
        else:
            stages.append((key, body, line))
    names = [name for name, _, _ in stages]
    if groups and names.count(DEFAULT_STAGE) > 1:
        msg = (
            f"recipe {source}: top-level '<group>_modifiers' keys form the stage {DEFAULT_STAGE!r}, "
            f"and the recipe also has a stage named {DEFAULT_STAGE!r}; rename that stage"
        )
        raise RecipeError(msg)
    return stages


#: llm-compressor modifiers llmc-fsm does not implement -> what they do (and what to do without them).
UNIMPLEMENTED_MODIFIERS: dict[str, str] = {
    "QuIPModifier": (
        "QuIP-style Hadamard rotations of every Linear's input at run time, which transformers does not apply when "
        "it loads a compressed-tensors checkpoint; SpinQuantModifier fuses R1/R2 rotations into the weights instead"
    ),
}


#: First-party modifier name -> the distribution providing it (its folder under ``plugins/`` in a checkout).
FIRST_PARTY_MODIFIERS: dict[str, tuple[str, str]] = {
    **{
        name: ("llmc-fsm-pruning", "pruning")
        for name in (
            "SparseGPTModifier", "WandaPruningModifier", "MagnitudePruningModifier", "ConstantPruningModifier",
            "REAPPruningModifier",
        )
    },
    **{
        name: ("llmc-fsm-quantization", "quantization")
        for name in (
            "QuantizationModifier", "GPTQModifier", "AWQModifier", "AutoRoundModifier", "SmoothQuantModifier",
            "LogarithmicEqualizationModifier", "SpinQuantModifier",
        )
    },
    **{name: ("llmc-fsm-training", "training") for name in ("LearningRateModifier", "OutputDistillationModifier")},
}  # fmt: skip


def _installed(distribution: str) -> bool:
    """Whether ``distribution`` is installed (its metadata is found)."""
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def missing_plugin_note(name: str) -> str | None:
    """For a first-party modifier (:data:`FIRST_PARTY_MODIFIERS`) that is not registered because its distribution
    is not installed (not merely disabled through ``LLMC_FSM_DISABLE_PLUGINS``, which the registry's message names),
    one sentence saying which distribution to install; else ``None``."""
    if name not in FIRST_PARTY_MODIFIERS:
        return None
    distribution, folder = FIRST_PARTY_MODIFIERS[name]
    registry = get_registry()
    if name in registry or any(d.distribution == distribution for d in registry.disabled) or _installed(distribution):
        return None
    return (
        f"{name} is provided by {distribution}, which is not installed: pip install {distribution} (from a checkout: "
        f"pip install ./plugins/{folder})."
    )


def unimplemented_note(name: str) -> str | None:
    """For an llm-compressor modifier llmc-fsm does not implement, one sentence saying so; for a first-party
    modifier whose distribution is not installed, which one to install (:func:`missing_plugin_note`); else
    ``None`` (the unknown-modifier message then suggests close names)."""
    what = UNIMPLEMENTED_MODIFIERS.get(name)
    if what is None:
        return missing_plugin_note(name)
    return (
        f"{name} is an llm-compressor modifier that llmc-fsm does not implement ({what}); remove it from the "
        "recipe or use llm-compressor for it."
    )


def plugin_getattr(package: str, notes: Mapping[str, str] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the first-party plugin package ``package`` (``llmc_fsm_<folder>``) that explains
    in one line a name it lacks: an llm-compressor modifier llmc-fsm does not implement (``QuIPModifier``,
    :func:`unimplemented_note`), a modifier of another first-party plugin (where to import it from, or which
    distribution to install), or a name of ``notes`` (its own sentence). Found by a tester: an llm-compressor script
    translated by swapping its imports stopped with a bare "cannot import name 'QuIPModifier'".

    ``from <package> import <name>`` gets ``ImportError`` with that line (an ``AttributeError`` raised by a module
    ``__getattr__`` there becomes Python's generic "cannot import name"); attribute access gets ``AttributeError``
    with it, so ``hasattr`` is false and ``getattr(module, name, default)`` gives the default. Any other name: the
    usual ``AttributeError``.
    """
    folder = package.removeprefix("llmc_fsm_")

    def note_for(name: str) -> str | None:
        if notes and name in notes:
            return notes[name]
        provider = FIRST_PARTY_MODIFIERS.get(name)
        if provider is None:
            return unimplemented_note(name)
        distribution, home = provider
        if home == folder:
            return None
        elsewhere = f"{name} is in {distribution}, not {package}: from llmc_fsm_{home} import {name}"
        return missing_plugin_note(name) or elsewhere

    def __getattr__(name: str) -> Any:
        note, module = note_for(name), sys.modules[package]
        if note is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}", name=name, obj=module)
        caller = sys._getframe(1)  # the code asking: an IMPORT_FROM instruction for "from <package> import name"
        if caller.f_code.co_code[caller.f_lasti] == dis.opmap["IMPORT_FROM"]:
            raise ImportError(note, name=package)
        raise AttributeError(note, name=name, obj=module)

    return __getattr__


@attrs.frozen
class Namesake:
    """An llm-compressor modifier with the name of an llmc-fsm modifier that does something else.

    Attributes:
        arguments: the arguments of llm-compressor's modifier that ours does not have.
        theirs: what llm-compressor's does (a phrase).
        ours: what llmc-fsm's does (a phrase).
        instead: what to do for llm-compressor's behaviour (a phrase).
    """

    arguments: frozenset[str]
    theirs: str
    ours: str
    instead: str


#: llmc-fsm modifiers sharing a name with a different llm-compressor modifier; a recipe giving that one's arguments
#: is told so once (:func:`namesake_note`), not with an unknown argument and a close name ("unknown argument
#: 'targets'. Did you mean 'start'?", found by a tester).
NAMESAKES: dict[str, Namesake] = {
    "OutputDistillationModifier": Namesake(
        arguments=frozenset(
            "targets projection projection_args transforms transforms_args comparison comparison_args orig_scale "
            "distill_scale offload_layer_output".split()
        ),
        theirs=(
            "layer-wise distillation (it compares the outputs of the targeted modules with the teacher's; removed in "
            "llm-compressor 0.10)"
        ),
        ours="distils the output logits (Hinton et al.; arguments temperature and alpha, docs/training.md)",
        instead="use llm-compressor before 0.10 for layer-wise distillation",
    ),
}


def namesake_arguments(name: str, keys: list[str]) -> list[str]:
    """The arguments among ``keys`` that belong to llm-compressor's different modifier named ``name``
    (:data:`NAMESAKES`), in the order given."""
    namesake = NAMESAKES.get(name)
    return [key for key in keys if namesake is not None and key in namesake.arguments]


def namesake_note(name: str, keys: list[str]) -> str | None:
    """For the unknown arguments ``keys`` given to modifier ``name``: when some are those of llm-compressor's
    different modifier of that name (:func:`namesake_arguments`), a sentence (``It is an argument...`` / ``They are
    arguments...``) saying what each modifier does and what to do; else ``None``."""
    theirs = namesake_arguments(name, keys)
    if not theirs:
        return None
    namesake = NAMESAKES[name]
    return (
        f"{'It is an argument' if len(theirs) == 1 else 'They are arguments'} of llm-compressor's {name}, which does "
        f"{namesake.theirs}; llmc-fsm's {name} does not do that: it {namesake.ours}. Remove "
        f"{'it' if len(theirs) == 1 else 'them'} to use llmc-fsm's, or {namesake.instead}."
    )


# --- argument names ---------------------------------------------------------------------------


@attrs.frozen
class ArgumentRule:
    """How one llm-compressor argument name is read for one modifier.

    Attributes:
        action: ``"rename"`` (passed on as ``target``), ``"ignore"`` (accepted,
            no effect; only the ``accept`` values when given), ``"refuse"``, or
            ``"value"``: the modifier has this argument, but llm-compressor also
            accepts a form of its value that ``convert`` rewrites (``convert``
            returns ``None`` for a value that needs no rewriting).
        note: why, in one phrase (shown in errors and in ``docs/recipes.md``).
        target: the llmc-fsm argument a ``"rename"`` maps to.
        accept: for ``"ignore"``: the only values accepted (others are refused); empty = any.
        convert: for ``"rename"``/``"value"``: function turning the value (and the
            other arguments) into ``{argument: value}``; raises ``ValueError`` to refuse.
    """

    action: str
    note: str
    target: str | None = None
    accept: tuple[Any, ...] = ()
    convert: Callable[[Any, Mapping[str, Any]], dict[str, Any]] | None = None


_SCHEME_FIELDS = frozenset({"weights", "input_activations", "output_activations", "targets", "format", "preset"})


def _preset_targets(value: Any, args: Mapping[str, Any]) -> dict[str, Any] | None:
    """llm-compressor's ``scheme: {PRESET: targets}`` -> ``scheme: PRESET`` and ``targets``; with several presets
    (``{W8A8: [re:.*q_proj$], FP8_DYNAMIC: [Linear]}``) -> ``config_groups`` ``group_0``, ``group_1``... in that
    order, as llm-compressor builds them (a module several select takes compressed-tensors' first matching target:
    docs/quantization.md, "Several config groups")."""
    if not isinstance(value, Mapping) or not value or set(value) & _SCHEME_FIELDS:
        return None  # a preset name, or a mapping of scheme fields: the modifier reads it
    presets = {}
    for preset, targets in value.items():
        targets = _as_list(targets)
        if not isinstance(targets, list):  # null, a number: a TypeError escaped here (found by a fuzzing tester)
            msg = f"the targets of preset {preset!r} must be a module pattern or a list of them, got {targets!r}"
            raise ValueError(msg)
        presets[preset] = targets
    if len(presets) > 1:  # the modifier's own targets, if given, are checked against the groups' as for any groups
        return {
            "config_groups": {f"group_{i}": {"preset": p, "targets": t} for i, (p, t) in enumerate(presets.items())}
        }
    ((preset, targets),) = presets.items()
    given = args.get("targets")
    if given is not None and _as_list(given) != targets:
        raise ValueError(f"its targets {targets!r} differ from the modifier's targets {args['targets']!r}")
    return {"scheme": preset, "targets": targets}


def _observer_mapping(value: Any, args: Mapping[str, Any]) -> dict[str, Any] | None:
    """llm-compressor's ``observer: {weights: NAME, input: NAME}`` -> ``observer: NAME``, ``input_observer: NAME``."""
    if not isinstance(value, Mapping):
        return None
    if not value or not set(value) <= {"weights", "input"}:
        msg = f"only the weight and input observers can be chosen ({{weights: NAME, input: NAME}}), got {dict(value)!r}"
        raise ValueError(msg)
    names = {"weights": "observer", "input": "input_observer"}
    return {names[key]: name for key, name in value.items()}


_LAYERWISE = "llmc-fsm always calibrates one decoder layer at a time (what sequential_update: true meant)"
_OFFLOAD = "memory placement only; llmc-fsm keeps only the current layer's statistics"
_GROUP = "llm-compressor's bookkeeping of the group key; the stage and group come from the recipe nesting"
_SEQ_TARGETS = "the pipeline finds the decoder layers from the model; remove it"
_OWL = (
    "OWL layer-wise sparsity is not implemented (null, llm-compressor's default, is off); give one sparsity for every "
    "layer"
)

_PERCDAMP = ArgumentRule("rename", "llm-compressor's older name of dampening_frac", target="dampening_frac")
_REQUIRES_DATA = (
    "llm-compressor records in its saved recipe.yaml whether its modifier needs calibration data; llmc-fsm derives "
    "that from the modifier and its scheme"
)
_COMMON: dict[str, ArgumentRule] = {
    "group": ArgumentRule("ignore", _GROUP),
    "requires_calibration_data": ArgumentRule("ignore", _REQUIRES_DATA, accept=(True, False)),
}
_SPARSITY_BASE: dict[str, ArgumentRule] = {
    **_COMMON,
    "sequential_update": ArgumentRule("ignore", _LAYERWISE, accept=(True, False)),
    "sequential_targets": ArgumentRule("refuse", _SEQ_TARGETS),
    "percdamp": _PERCDAMP,
    "sparsity_profile": ArgumentRule("ignore", _OWL, accept=(None,)),  # null: llm-compressor's default, OWL off
    "owl_m": ArgumentRule("ignore", _OWL, accept=(None,)),  # (refused at null too until a newcomer's recipe, s36)
    "owl_lmbda": ArgumentRule("ignore", _OWL, accept=(None,)),
    "offload_hessians": ArgumentRule("ignore", _OFFLOAD, accept=(True, False)),
}
_QUANT_BASE: dict[str, ArgumentRule] = {
    **_COMMON,
    "sequential_update": ArgumentRule("ignore", _LAYERWISE, accept=(True, False)),
    "weight_observer": ArgumentRule("rename", "the weight observer", target="observer"),
    "scheme": ArgumentRule("value", "llm-compressor's {PRESET: targets} form", convert=_preset_targets),
    "observer": ArgumentRule("value", "llm-compressor's {weights: NAME} form", convert=_observer_mapping),
    "output_observer": ArgumentRule("refuse", "output activations are not quantized"),
    "bypass_divisibility_checks": ArgumentRule(
        "ignore", "only false: every group must divide the input width", accept=(False,)
    ),
}

#: modifier name -> llm-compressor argument name -> rule (only for names the class does not have).
ARGUMENT_RULES: dict[str, dict[str, ArgumentRule]] = {
    "SparseGPTModifier": dict(_SPARSITY_BASE),
    "WandaPruningModifier": {
        **_SPARSITY_BASE,
        "percdamp": ArgumentRule("refuse", "Wanda inverts no Hessian, so it has no damping; remove it"),
    },
    "MagnitudePruningModifier": {
        **_COMMON,
        "update_scheduler": ArgumentRule("ignore", "only 'cubic', the schedule llmc-fsm uses", accept=("cubic",)),
        "scheduler_args": ArgumentRule("ignore", "the cubic schedule takes none", accept=(None, {})),
        "apply_globally": ArgumentRule("ignore", "only false: sparsity is per layer", accept=(False,)),
    },
    "ConstantPruningModifier": dict(_COMMON),
    "GPTQModifier": {
        **_QUANT_BASE,
        "sequential_targets": ArgumentRule("refuse", _SEQ_TARGETS),
        "percdamp": _PERCDAMP,
        "offload_hessians": ArgumentRule("ignore", _OFFLOAD, accept=(True, False)),
        "batched_quantization": ArgumentRule(
            "ignore", "how many same-shape modules llm-compressor sweeps at once on a GPU (speed and memory only)"
        ),
    },
    "QuantizationModifier": dict(_QUANT_BASE),
    "AutoRoundModifier": dict(_QUANT_BASE),
    "AWQModifier": {
        **_COMMON,
        "kv_cache_scheme": ArgumentRule(
            "refuse",
            "AWQModifier's older form (scheme or config_groups) quantizes weights only here; write the current form: "
            "AWQModifier (mappings, smoothing) and a QuantizationModifier with the scheme and kv_cache_scheme",
        ),
    },
}


def translate_argument(
    modifier: str, key: str, value: Any, args: Mapping[str, Any], *, is_field: bool = False
) -> dict[str, Any] | None:
    """Translate llm-compressor argument ``key`` of modifier ``modifier`` (see :data:`ARGUMENT_RULES`).

    Args:
        is_field: ``key`` is an argument of the modifier class; then only a
            ``"value"`` rule applies (the class's own argument wins otherwise).

    Returns:
        ``None`` when nothing is to be translated (the caller passes a field on
        as it is, or reports an unknown argument); ``{}`` when the argument is
        accepted and ignored; else ``{argument: value}`` to pass instead.

    Raises:
        ValueError: the rule refuses the argument or this value; the message says why.
    """
    rule = ARGUMENT_RULES.get(modifier, _COMMON).get(key)
    if rule is None or is_field != (rule.action == "value"):
        return None
    if rule.action == "refuse" and not (rule.accept and _accepted(value, rule.accept)):
        raise ValueError(f"llm-compressor argument not supported: {rule.note}")
    if rule.action in ("ignore", "refuse"):
        if rule.accept and not _accepted(value, rule.accept):
            shown = " or ".join(repr(v) for v in rule.accept)
            raise ValueError(f"llm-compressor argument accepted only as {shown}, got {value!r}: {rule.note}")
        logger.warning("%s: llm-compressor argument %r=%r accepted and ignored: %s", modifier, key, value, rule.note)
        return {}
    if rule.convert is not None:
        return rule.convert(value, args)
    return {rule.target: value}  # type: ignore[dict-item]


_LM_HEAD_DENSE = "llm-compressor's default ignore is empty, which quantizes lm_head too: give ignore: [] for that"

_NO_DEFAULT_SCHEME = (
    "llm-compressor has no default scheme: without scheme or config_groups its QuantizationModifier refuses the "
    "recipe and its GPTQModifier only uses a config an earlier modifier attached; give scheme: W4A16 for the same run "
    "there"
)

_NO_DEFAULT_SCHEME_AUTOROUND = (
    "llm-compressor has no default scheme: without scheme or config_groups its AutoRoundModifier has none to tune and "
    "stops ('AutoRoundModifier requires at least one quantization scheme'); give scheme: W4A16 for the same run there"
)

_LM_HEAD_PRUNED = (
    "llm-compressor's default ignore is empty, which prunes lm_head too (with a warning): give ignore: [] for that"
)

#: modifier name -> argument -> how llm-compressor's default differs for the same recipe, when the recipe does
#: not give the argument (and the default value is not ``None``). The quantizing modifiers and SparseGPT / Wanda
#: keep ``lm_head`` dense by default (``ignore: [lm_head]``); llm-compressor's ``ignore`` defaults to ``[]``, so
#: its ``targets: [Linear]`` quantizes (prunes) ``lm_head`` too. The quantizing modifiers quantize with ``W4A16``
#: when neither ``scheme`` nor ``config_groups`` is given; llm-compressor has no default scheme; SparseGPT /
#: Wanda prune 50% without ``sparsity``, which llm-compressor requires; its Magnitude / Constant pruning require
#: ``targets`` and have no ``ignore``, where ours default to ``[Linear]`` and ``[lm_head]``. (Its weight
#: observer ``minmax`` becomes ``memoryless_minmax``, the same range for a weight observed once: no difference.)
DEFAULT_DIFFERENCES: dict[str, dict[str, str]] = {
    **{
        name: {"ignore": _LM_HEAD_DENSE, "scheme": _NO_DEFAULT_SCHEME}
        for name in ("GPTQModifier", "QuantizationModifier")
    },
    "AutoRoundModifier": {"ignore": _LM_HEAD_DENSE, "scheme": _NO_DEFAULT_SCHEME_AUTOROUND},
    **{
        name: {
            "ignore": _LM_HEAD_PRUNED,
            "sparsity": "llm-compressor has no default sparsity: give sparsity: 0.5 there",
        }
        for name in ("SparseGPTModifier", "WandaPruningModifier")
    },
    **{
        name: {
            "targets": "llm-compressor requires targets (no default): give targets: [Linear] there",
            "ignore": "llm-compressor has no ignore: every module its targets match is pruned there, lm_head included",
        }
        for name in ("MagnitudePruningModifier", "ConstantPruningModifier")
    },
}


def default_difference(modifier: str, argument: str, value: Any) -> str | None:
    """How llm-compressor's default of ``argument`` of ``modifier`` differs from llmc-fsm's default ``value``
    (one phrase), or ``None`` when they agree, the value is ``None`` (nothing set by default, e.g. ``scheme``
    next to ``config_groups``) or llm-compressor has no such argument (see :data:`DEFAULT_DIFFERENCES`)."""
    return None if value is None else DEFAULT_DIFFERENCES.get(modifier, {}).get(argument)


def _accepted(value: Any, accept: tuple[Any, ...]) -> bool:
    return any(value is v if v is None or isinstance(v, bool) else value == v for v in accept)


def translate_arguments(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of ``cls(**kwargs)`` with llm-compressor's argument names and value forms rewritten by
    :data:`ARGUMENT_RULES` (for a class whose :meth:`~llmc_fsm.Modifier.modifier_name`, or a base class's, has rules;
    others as given).

    What the recipe builder does for recipe text, for a modifier built in Python: ``GPTQModifier(percdamp=0.01)``
    is ``GPTQModifier(dampening_frac=0.01)``, ``QuantizationModifier(scheme={"W4A16": ["Linear"]})`` is
    ``scheme="W4A16", targets=["Linear"]``; an argument accepted and ignored is logged and dropped. Arguments in
    llmc-fsm's form are left as they are (the builder's translated arguments pass through here again).

    Raises:
        TypeError: an argument neither the class nor llm-compressor's rules know (a typo), with the closest name,
            or one of llm-compressor's different modifier of the same name, saying so (:func:`namesake_note`).
        ValueError: an argument llmc-fsm refuses (with llm-compressor's reason), one that maps to an argument the
            class does not have, one that sets an argument also given with another value, or an empty module
            pattern in ``targets`` / ``ignore`` (``''``: it selected the whole model, llm-compressor nothing), or a
            negative ``end`` (:data:`NEGATIVE_END`).
    """
    # a subclass (a plugin's GPTQModifier with more arguments) takes the rules of the first class it derives from
    # that has them
    if not attrs.has(cls):
        return kwargs
    names = [getattr(k, "modifier_name", lambda k=k: k.__name__)() for k in cls.__mro__ if isinstance(k, type)]
    name = next((n for n in names if n in ARGUMENT_RULES), None)
    accepted = {a.alias or a.name for a in attrs.fields(cls) if a.init}
    rules = ARGUMENT_RULES.get(name, {}) if name is not None else {}
    for key in kwargs:
        if key not in accepted and key not in rules:  # a typo: Python's TypeError, with the closest name
            namesake = namesake_note(cls.modifier_name(), [key]) if hasattr(cls, "modifier_name") else None
            if namesake is not None:  # llm-compressor's argument of its different modifier of this name
                raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {key!r}. {namesake}")
            close = difflib.get_close_matches(str(key), sorted(accepted), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {key!r}{hint}")
    end = kwargs.get("end") if "end" in accepted else None
    if isinstance(end, numbers.Real) and not isinstance(end, bool) and end < 0:  # as a stage's end (a tester's case)
        raise ValueError(f"end must be >= 0 epochs, got {end}: {NEGATIVE_END}")
    for key in ("targets", "ignore"):
        value = kwargs.get(key) if key in accepted else None
        items = [value] if isinstance(value, str) else value if isinstance(value, list | tuple) else []
        if any(isinstance(item, str) and not item.strip() for item in items):
            msg = (
                f"{key} {shown(value)}: an empty module pattern names no module (llm-compressor matches nothing with "
                f"it); give module names or patterns{' ([] for none)' if key == 'ignore' else ''}, or leave {key} out "
                "for the modifier's default"
            )
            raise ValueError(msg)
    if name is None:
        return kwargs
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        try:
            translated = translate_argument(name, key, value, kwargs, is_field=key in accepted)
        except ValueError as exc:
            raise ValueError(f"{name}: argument {key!r}: {exc}") from None
        if translated is None:
            out[key] = value
            continue
        for target, new in translated.items():
            if target not in accepted:
                raise ValueError(f"{name}: argument {key!r} maps to {target!r}, which {name} does not accept")
            if target != key and target in kwargs and _as_list(kwargs[target]) != _as_list(new):
                raise ValueError(f"{name}: argument {key!r} sets {target!r} to {new!r}, but {target!r} is also given")
            out[target] = new
    return out


#: Why a negative ``end`` (a modifier's or a stage's) is refused.
NEGATIVE_END = (
    "llm-compressor has no 'no end' value: its end -1 lies before the first epoch, so the modifier never runs; "
    "leave end out (null) to run until finalize"
)

#: Declared field types that take a number, as attrs keeps them under ``from __future__ import annotations``.
_NUMBER_TYPES = {"float": float, "int": int, "float | None": float, "int | None": int, "Optional[float]": float,
                 "Optional[int]": int}  # fmt: skip
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def _number_kind(declared: Any) -> type | None:
    """``float`` or ``int`` for a field declared so (or optional: ``float | None``, ``Optional[int]``; as a string
    or as the type itself), else ``None``."""
    if isinstance(declared, str):
        return _NUMBER_TYPES.get(declared.replace(" ", "").replace("|", " | "))
    if declared in (float, int):
        return declared
    if typing.get_origin(declared) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(declared) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 and kinds[0] in (float, int) else None
    return None


def is_numpy_scalar(value: Any) -> bool:
    """Whether ``value`` is a numpy scalar (or a 0-d array): ``.item()`` gives the Python value (numpy is not
    imported here)."""
    return type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0


def is_numpy_bool(value: Any) -> bool:
    """Whether ``value`` is a numpy bool (``np.True_``: ``numpy.bool`` in numpy 2, ``numpy.bool_`` in 1.x; numpy is
    not imported here)."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def _float(value: numbers.Real) -> float:
    """``float(value)``, or a signed ``inf`` where no float holds it (``Fraction(10**400)``)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _plain_number(value: numbers.Real, kind: type) -> int | float | None:
    """``value`` (a number, not a bool) as the Python ``kind`` an argument is declared (``float`` or ``int``) where
    pydantic's lax mode takes it so: a numpy number (``np.float64(0.5)``, a ``float`` subclass that YAML cannot
    write: found by a tester, a run crashed when saving its recipe; ``np.float32(0.01)``, ``np.int64(128)``), an
    integral float for an int (``128.0``, ``np.float32(128.0)``; only up to 2**53: ``1e300`` is left for the
    validator to refuse); ``None`` when it is to be left as it is."""
    if kind is float:
        if type(value) is int:  # as written, unless no float holds it (10**400: refused as inf, not an OverflowError)
            return None if abs(value) <= sys.float_info.max else (math.inf if value > 0 else -math.inf)
        return None if type(value) is float else _float(value)
    if isinstance(value, numbers.Integral):
        return None if type(value) is int else int(value)
    number = _float(value)
    return int(number) if number.is_integer() and abs(number) <= 2**53 else None


def number_from_string(value: Any) -> float | None:
    """The number a string writes (``"0.1"``, YAML 1.1's ``1e-1``), else ``None``."""
    return float(value) if isinstance(value, str) and _NUMBER.fullmatch(value.strip()) else None


def numbers_from_strings(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A number written as a string for an argument declared ``float`` or ``int`` (``sparsity: "0.5"``, and YAML's
    ``5e-1``, which YAML 1.1 reads as a string), read as the number, as llm-compressor's pydantic arguments do; an
    ``int`` only from a string of an integral value (``"128"``, ``"128.0"``); and an integral float for an ``int``
    (``block_size: 128.0``, ``iters: 200.0``), as pydantic's lax mode reads it (found by a tester: refused here,
    taken by llm-compressor); a numpy number or bool as the Python one. Anything else is left for the field's own
    validator."""
    if not attrs.has(cls):
        return kwargs
    kinds = {a.alias or a.name: _number_kind(a.type) for a in attrs.fields(cls) if a.init}
    out = dict(kwargs)
    for key in _SCHEME_ARGUMENTS:
        if key in kinds and isinstance(kwargs.get(key), Mapping):
            out[key] = _scheme_numbers(kwargs[key], 1 if key == "kv_cache_scheme" else 3, key)
    for key, value in kwargs.items():
        if is_numpy_scalar(value):  # np.True_, np.str_("static"): the Python value, as pydantic takes them
            value = out[key] = value.item()  # (testers' cases: a numpy bool was refused, a numpy str kept)
            if isinstance(value, bool):
                continue  # a str goes on: np.str_("128") for an int is read as "128" is
        kind = kinds.get(key)
        if kind is not None and isinstance(value, numbers.Real) and not isinstance(value, bool):
            number = _plain_number(value, kind)
            if number is not None:
                out[key] = number
                continue
        if kind is None or not isinstance(value, str) or not _NUMBER.fullmatch(value.strip()):
            continue
        number = float(value)
        if kind is float:
            out[key] = number
        elif number.is_integer():  # "128", "128.0", "1.28e2" (pydantic's lax int)
            out[key] = int(number)
    return out


#: Arguments holding quantization scheme mappings: their integer fields (:data:`_SCHEME_INTS`) written as strings
#: are read as numbers, as pydantic's lax mode does in llm-compressor (``group_size: "128"`` was a TypeError naming
#: neither group nor field, found by a tester).
_SCHEME_ARGUMENTS = ("scheme", "config_groups", "kv_cache_scheme")
_SCHEME_INTS = frozenset({"num_bits", "group_size"})


def _scheme_numbers(value: Mapping[Any, Any], depth: int, where: str) -> Mapping[Any, Any]:
    """``value`` with every :data:`_SCHEME_INTS` field (up to ``depth`` mappings down) written as an integral number
    string (``"128"``) read as the ``int``; a changed mapping is a copy (a :class:`MarkedDict` keeps its lines), an
    unchanged one is ``value`` itself.

    Raises:
        ValueError: such a field is another string (``"12x"``, ``"0.5"``), naming ``where`` (the argument, the
            config group and the scheme part).
    """
    changed: dict[Any, Any] = {}
    for key, item in value.items():
        if key in _SCHEME_INTS and isinstance(item, str):
            number = float(item) if _NUMBER.fullmatch(item.strip()) else None
            if number is None or not number.is_integer():
                raise ValueError(f"{where}: {key} must be an integer, got {shown(item)}")
            changed[key] = int(number)
        elif isinstance(item, Mapping) and depth > 1:
            part = f"entry {key!r}" if where == "config_groups" else str(key)
            new = _scheme_numbers(item, depth - 1, f"{where} {part}" if " " not in where else f"{where}, {part}")
            if new is not item:
                changed[key] = new
    if not changed:
        return value
    copy = MarkedDict(value) if isinstance(value, MarkedDict) else dict(value)
    if isinstance(value, MarkedDict):
        copy.line, copy.key_lines = value.line, dict(value.key_lines)
    copy.update(changed)
    return copy


for _translator in (numbers_from_strings, translate_arguments):
    if _translator not in ARGUMENT_TRANSLATORS:
        ARGUMENT_TRANSLATORS.append(_translator)


def _as_list(value: Any) -> Any:
    """``"Linear"`` as ``["Linear"]``, a tuple as a list (a targets-like value compared either way); others as given."""
    return [value] if isinstance(value, str) else list(value) if isinstance(value, tuple) else value
