"""``llmc-fsm modifiers`` and ``llmc-fsm explain RECIPE``.

``modifiers`` lists every modifier the installed plugins register (name,
distribution and version, required and optional state keys, one-line
description), then the plugins that failed to load with their error and the
ones disabled through ``LLMC_FSM_DISABLE_PLUGINS``.

``explain`` resolves a recipe and prints its plan without touching a model (``(default)`` after each
argument the recipe did not give, and where llm-compressor's default differs for the same recipe, how:
:data:`llmc_fsm.recipes.llmcompressor.DEFAULT_DIFFERENCES`); given a modifier's name instead, the plan of
that modifier alone with every argument at its default. With ``--model DIR`` the recipe (or the modifier with its
defaults) is taken as oneshot takes it on that model (its ``run_type: train`` stages skipped, merged with the history
of a saved output's ``recipe.yaml``, refused when nothing is left to run), and oneshot's checks of the model run.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import attrs

from llmc_fsm.core.errors import MissingStateError, RecipeError
from llmc_fsm.core.modifier import Modifier
from llmc_fsm.core.registry import DISABLE_ENV, get_registry
from llmc_fsm.models.hf_io import meta_model
from llmc_fsm.models.known import KNOWN_MODELS, known_model_dir
from llmc_fsm.models.layers import check_calibrates_from_text, find_decoder_layers
from llmc_fsm.oneshot_job.data import check_modifiers, torch_dtype_of
from llmc_fsm.oneshot_job.phases import recipe_sessions
from llmc_fsm.oneshot_job.settings import DTYPES, _dtype_name
from llmc_fsm.pipeline.sequential import check_modifier_targets_in_layers, output_head
from llmc_fsm.recipes.history import merge_saved_recipe
from llmc_fsm.recipes.llmcompressor import unimplemented_note
from llmc_fsm.session.explain import check_state_keys, explain
from llmc_fsm.session.session import Session

__all__ = ["add_cli", "format_modifiers"]


def _keys(keys: frozenset[str]) -> str:
    return ", ".join(sorted(keys)) or "-"


#: The note after the listing: :meth:`~llmc_fsm.Modifier.required_keys` adds ``steps_per_epoch`` to every modifier
#: given a schedule (its epochs are counted in steps with it).
SCHEDULE_NOTE = "Every modifier given start, end or update (epochs) also requires steps_per_epoch."


def _state_lines(cls: type[Modifier]) -> list[str]:
    """The listing's state lines of ``cls``: a key required for some arguments only (its ``conditional_state``) is
    listed once, with when (``LearningRateModifier`` was listed as requiring ``steps_per_epoch`` and as taking it
    optionally: found by a tester)."""
    conditional = dict(cls.conditional_state)
    required, optional = frozenset(cls.required_state) - set(conditional), frozenset(cls.optional_state)
    lines = [f"      required state: {_keys(required)}"]
    lines.extend(f"      required state: {key}, {when}" for key, when in sorted(conditional.items()))
    lines.append(f"      optional state: {_keys(optional - required - set(conditional))}")
    return lines


def format_modifiers() -> str:
    """The ``llmc-fsm modifiers`` listing as text: every registered modifier; the note on ``steps_per_epoch``
    (:data:`SCHEDULE_NOTE`); the plugins that failed to load, then those that loaded in part (a class refused, the
    names registered from the same entry point given); the plugins disabled."""

    registry = get_registry()
    lines: list[str] = []
    infos = registry.infos()
    if infos:
        lines.append(f"{len(infos)} modifier(s):")
    else:
        lines.append("No modifiers registered (install a plugin such as llmc-fsm-pruning).")
    for info in infos:
        origin = info.distribution or "<in-process>"
        if info.version:
            origin += f" {info.version}"
        lines.append(f"  {info.name}  [{origin}]")
        description = info.cls.description()
        if description:
            lines.append(f"      {description}")
        lines.extend(_state_lines(info.cls))
        if info.cls.events:
            lines.append(f"      batch events: {_keys(info.cls.events)}")
    if infos:
        lines.append(SCHEDULE_NOTE)
    failed = [err for err in registry.errors if not registry.registered_from(err.distribution, err.entry_point)]
    if failed:
        lines.append(f"{len(failed)} plugin(s) failed to load, nothing registered from them:")
        lines.extend(f"  ERROR {err}" for err in failed)
    partly = [err for err in registry.errors if err not in failed]
    if partly:  # a clash refused one class of a plugin whose other classes loaded: it was listed as "broken"
        lines.append(f"{len(partly)} modifier class(es) refused, from plugins that loaded the rest:")
        for err in partly:
            loaded = ", ".join(registry.registered_from(err.distribution, err.entry_point))
            lines.append(f"  ERROR {err}")
            lines.append(f"      registered from that entry point all the same: {loaded}")
    if registry.disabled:
        lines.append(f"Disabled through {DISABLE_ENV}:")
        for item in registry.disabled:
            version = f" {item.version}" if item.version else ""
            lines.append(f"  {item.distribution}{version} (entry point {item.entry_point!r})")
    return "\n".join(lines) + "\n"


def _run_modifiers(args: argparse.Namespace) -> int:
    """Print the listing; exit status 1 when a plugin failed to load or a class of one was refused (the listing is
    printed all the same; it exited 0 with "3 broken plugin(s)", found by a tester)."""
    print(format_modifiers(), end="")
    return 1 if get_registry().errors else 0


def _modifier_info(name: str) -> Any:
    """The registry entry of modifier ``name``.

    Raises:
        ValueError: ``name`` is not a registered modifier (the registry's unknown-modifier message: suggestions,
            known modifiers, llm-compressor modifiers not implemented, plugins that failed to load or are disabled).
    """
    registry = get_registry()
    info = registry.info(name)
    if info is None:
        detail = registry.unknown_message(name, unimplemented_note(name)).removeprefix(f"unknown modifier {name!r}.")
        raise ValueError(f"no recipe file or modifier named {name!r}.{detail}")
    return info


def _defaults_refusal(name: str) -> str | None:
    """Why ``{"defaults": {name: {}}}`` is no valid recipe (its arguments without a default, or the refusal of
    its defaults alone, e.g. no sparsity), or ``None`` when it is one.

    Raises:
        ValueError: ``name`` is not a registered modifier.
    """
    info = _modifier_info(name)
    required = [f.alias for f in _arguments_of(info.cls) if f.default is attrs.NOTHING]
    if required:
        return f"{', '.join(required)} (no default)"
    try:
        Session({"defaults": {name: {}}})
    except (RecipeError, ValueError) as exc:  # the defaults alone are not a valid modifier (e.g. no sparsity)
        return str(exc).rsplit(": ", 1)[-1] if isinstance(exc, RecipeError) else str(exc)
    return None


def _arguments_of(cls: type) -> list[Any]:
    """The attrs fields a recipe gives ``cls`` as arguments (its schedule, shown as such by explain, left out)."""
    schedule = ("start", "end", "update")
    return [f for f in attrs.fields(cls) if f.init and f.name not in schedule] if attrs.has(cls) else []


def _modifier_plan(name: str, state: list[str]) -> str:
    """What ``llmc-fsm explain NAME`` prints: the plan of ``{"defaults": {name: {}}}`` when every argument has a
    default that forms a valid modifier; otherwise its arguments with their defaults and what must be set.

    Raises:
        ValueError: ``name`` is not a registered modifier.
    """

    why = _defaults_refusal(name)
    if why is None:
        return _plan({"defaults": {name: {}}}, state)
    fields = _arguments_of(_modifier_info(name).cls)
    required = [f.alias for f in fields if f.default is attrs.NOTHING]
    lines = [f"{name}: arguments (default):"]
    lines += [
        f"  {f.alias} = {_default(f.default) if f.default is not attrs.NOTHING else '(required)'}" for f in fields
    ]
    unset = [f.alias for f in fields if f.default is None][:1]  # e.g. sparsity, when the defaults alone fail
    example = ", ".join(f"{r}: VALUE" for r in required or unset) or "ARGUMENT: VALUE"
    lines.append(
        f"No plan with the defaults alone: {why}. See its plan with a recipe that sets what it needs, e.g. "
        f"llmc-fsm explain 's: {{{name}: {{{example}}}}}'"
    )
    return "\n".join(lines) + "\n"


def _default(default: object) -> str:
    """An attrs field's default as text (``(computed)`` for a factory that takes the instance)."""

    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return "(computed)" if default.takes_self else repr(default.factory())
    return repr(default)


def _run_explain(args: argparse.Namespace) -> int:

    recipe: Any = args.recipe
    if recipe == "-":  # the Unix convention (it was parsed as the YAML text "-", "got a list": a tester's case)
        msg = "RECIPE '-' (standard input) is not read: give the recipe file's path"
        raise ValueError(msg)
    if args.dtype is not None and args.model is None:  # it was ignored (found by a tester): a usage error
        msg = "--dtype is the dtype oneshot would load --model in: give --model DIR with it, or leave --dtype out"
        args._commands[args.command].error(msg)
    if args.fuse_stages and args.model is None:
        msg = "--fuse-stages checks the stages as oneshot --fuse-stages runs them on --model: give --model DIR with it"
        args._commands[args.command].error(msg)
    if not os.path.exists(recipe) and recipe.isidentifier():  # a modifier's name: its plan with the defaults
        if args.model is None:
            print(_modifier_plan(recipe, args.state), end="")
            return 0
        why = _defaults_refusal(recipe)
        if why is not None:  # --model was dropped without a word (found by a tester)
            print(_modifier_plan(recipe, args.state), end="")
            msg = (
                f"--model {args.model} not checked: {recipe} has no plan with its defaults alone; give a recipe "
                "that sets what it needs (above) with --model"
            )
            raise ValueError(msg)
        recipe = {"defaults": {recipe: {}}}
    if args.model is not None:
        return _explain_on_model(args, recipe)
    session = Session(recipe)
    if args.state:
        check_state_keys(session, args.state)
        session.update_state(**_supplied(args.state))
    print(explain(session), end="")
    _say_expected(session, None)
    return 0


def _explain_on_model(args: argparse.Namespace, recipe: Any) -> int:
    """``explain RECIPE --model DIR``: the recipe as oneshot would run it on the model (:func:`recipe_sessions` of
    :mod:`llmc_fsm.oneshot_job.phases`: its ``run_type: train`` stages skipped with oneshot's warning, merged with
    the history a saved output keeps in its ``recipe.yaml``, oneshot's refusal when nothing is left to run), its
    plan printed, then the checks oneshot runs on the same ``meta``-device model, one session per stage not yet
    applied, as oneshot runs them (one for all with ``--fuse-stages``, as ``oneshot --fuse-stages``); the "runs on
    top of it" lines of the history logged once they pass.

    Raises:
        ValueError: ``"oneshot would refuse this recipe on --model DIR: <oneshot's message>"``, after the plan for
            a check of the model (before it when nothing is left to run); no ``config.json`` in ``DIR``.
        RecipeError: the recipe itself is invalid.
    """
    dtype = args.dtype or "float32"
    on = f"--model {args.model}" + (f" --dtype {dtype}" if dtype != "float32" else "")
    on += " --fuse-stages" if args.fuse_stages else ""
    notes: list[str] = []
    try:  # oneshot's own merge: explain approved recipes oneshot refuses, under other stage names (found by a tester)
        merged, sessions = recipe_sessions(args.model, recipe, args.fuse_stages, notes)
    except RecipeError:
        raise
    except ValueError as exc:  # nothing left to run: oneshot's refusal, before the model is read
        raise ValueError(f"oneshot would refuse this recipe on {on}: {exc}") from None
    model = _meta_model(args.model, dtype)
    session = Session(merged)
    if args.state:
        check_state_keys(session, args.state)
        session.update_state(**_supplied(args.state))
    session.update_state(model=model)
    refusal, state_refused = None, False
    try:  # the checks oneshot runs on the same meta-device model before any weight (group sizes, targets...)
        if any(s.requires("calibration_data") for s in sessions):
            check_calibrates_from_text(model)  # an encoder-decoder model (Whisper) calibrates on no token ids
        check_modifiers(sessions, model, True)
        for checked in sessions:
            _check_in_layers(checked, model)
    except MissingStateError as exc:  # state oneshot does not give (a teacher, steps_per_epoch): oneshot refuses
        supplied = set(args.state or ())  # unless --state says the caller gives it (explain exited 0; a tester)
        if any(key not in supplied for keys in exc.missing.values() for key in keys):
            refusal = ValueError(f"oneshot would refuse this recipe on {on}: {exc}")
            state_refused = True  # the plan's "Missing before initialize()" says why, not "refuses the model"
    except ValueError as exc:
        refusal = ValueError(f"oneshot would refuse this recipe on {on}: {exc}")
    model_refused = refusal is not None and not state_refused
    print(explain(session, model_refused=model_refused, fuse_stages=args.fuse_stages), end="")
    if refusal is not None:
        raise refusal
    history = logging.getLogger(merge_saved_recipe.__module__)
    for line in notes:  # as oneshot says them: once every check passed
        history.warning("%s", line)
    _say_expected(session, args.model)
    return 0


def _say_expected(session: Session, model: str | None) -> None:
    """The closing line when all the plan misses is what oneshot gives (the model, calibration data)."""
    given_by_oneshot = {"model", "calibration_data"}
    missing = {key for keys in session.missing_state().values() for key in keys}
    if missing and missing <= given_by_oneshot:
        fit = (
            f"oneshot's checks of --model {model} pass"
            if model is not None
            else "`explain RECIPE --model DIR` runs oneshot's checks of a model and shows, where a modifier resolves "
            "modules (AWQ, SmoothQuant), how they map on it"
        )
        print(f"(Expected here: `llmc-fsm oneshot` gives {' and '.join(sorted(missing))}; {fit}.)")


def _check_in_layers(session: Session, model: Any) -> None:
    """The pipeline's check that each modifier compresses what it calibrates inside the decoder layers
    (:func:`~llmc_fsm.pipeline.sequential.check_modifier_targets_in_layers`, in memory: the output head and a
    data-free modifier's targets may lie outside), on the targets each modifier's ``check_model`` selects: explain
    said "oneshot's checks pass" where oneshot then refused (a tester's case, Gemma 3n's per-layer projections)."""
    try:
        layers_name, layers = find_decoder_layers(model)
    except ValueError:  # no decoder layers: oneshot refuses the model itself (not a check of the recipe)
        return
    head = output_head(model)
    for modifier in session.modifiers:
        targets = modifier.check_model(model)
        if isinstance(targets, dict):
            check_modifier_targets_in_layers(modifier, targets, layers, layers_name, head=head)


def _supplied(keys: list[str]) -> dict[str, Any]:
    """Stand-ins for the state keys ``--state`` counts as supplied: ``True``, and ``1`` for ``steps_per_epoch``
    (which must be a positive int)."""
    return {key: 1 if key == "steps_per_epoch" else True for key in keys}


def _plan(recipe: Any, state: list[str]) -> str:
    session = Session(recipe)
    if state:
        check_state_keys(session, state)
        session.update_state(**_supplied(state))
    return explain(session)


def _meta_model(directory: str, dtype: str = "float32") -> Any:
    """The model a Hugging Face directory's ``config.json`` (or a known model name's, as ``oneshot --model`` takes
    it: ``smollm2-135m``, its cached directory) describes, on the meta device (no weights read), its parameters in
    ``dtype`` (a ``--dtype`` name; ``auto``: the config's) as ``oneshot --dtype`` loads them.

    Raises:
        ValueError: no ``config.json`` there.
    """

    from transformers import AutoConfig

    if directory in KNOWN_MODELS and not os.path.isdir(directory):
        directory = os.fspath(known_model_dir(directory))
    if not os.path.isfile(os.path.join(directory, "config.json")):
        msg = (
            f"--model {directory}: no config.json there; give a Hugging Face model directory or a known model name "
            f"({', '.join(sorted(KNOWN_MODELS))})"
        )
        raise ValueError(msg)
    config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
    return meta_model(config, torch_dtype_of(dtype, config))  # the model oneshot loads (a VLM's tower included)


def add_cli(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "modifiers",
        help="list every discovered modifier plugin",
        description=(
            "List every modifier registered by the installed plugins, and the plugins that failed to load or had a "
            "modifier class refused. Exit status: 0, or 1 when any plugin failed to load or had a class refused "
            "(the listing is printed all the same)."
        ),
    )
    parser.set_defaults(func=_run_modifiers)

    parser = sub.add_parser(
        "explain",
        help="print a recipe's plan without touching a model",
        description=(
            "Resolve RECIPE (a .yaml/.yml/.json file, or the recipe's YAML text itself) and print its stages, "
            "the modifiers in execution order, "
            "their arguments, the events each handles and the state keys each requires. RECIPE may also be a "
            "modifier's name (see llmc-fsm modifiers), e.g. GPTQModifier: its arguments and their defaults "
            "(a modifier with arguments that have no default names them instead)."
        ),
    )
    parser.add_argument(
        "recipe",
        metavar="RECIPE",
        help=(
            "recipe file (.yaml, .yml or .json), recipe text inline (e.g. 's: {GPTQModifier: {scheme: W8A8}}'), "
            "or a modifier name (e.g. GPTQModifier)"
        ),
    )
    parser.add_argument(
        "--state",
        metavar="KEY",
        action="append",
        default=[],
        help="count state KEY as supplied (repeatable), e.g. --state model --state calibration_data",
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="a Hugging Face model directory or a known model name (smollm2-135m): its architecture (config.json, "
        "on the meta device, no weights) is the state's model, and modifiers that resolve modules on it show them "
        "(e.g. AWQ's smoothing mappings); the recipe is merged with the stages a saved output's recipe.yaml marks "
        "applied, as oneshot merges it",
    )
    parser.add_argument(
        "--dtype",
        type=_dtype_name,  # as oneshot's --dtype: bf16, fp16, half, fp32, float too
        choices=DTYPES,
        default=None,
        help="with --model: the dtype oneshot would load it in (as oneshot --dtype; default float32); NVFP4 and MX "
        "schemes need bfloat16",
    )
    parser.add_argument(
        "--fuse-stages",
        action="store_true",
        help="with --model: check the stages as oneshot --fuse-stages runs them (one session, one layer-by-layer "
        "pass; e.g. AWQ in one stage and its quantizer in the next), not each stage on its own",
    )
    parser.set_defaults(func=_run_explain)
