"""``llmc-fsm modifiers`` and ``llmc-fsm explain RECIPE``.

``modifiers`` lists every modifier the installed plugins register (name,
distribution and version, required and optional state keys, one-line
description), then the plugins that failed to load with their error and the
ones disabled through ``LLMC_FSM_DISABLE_PLUGINS``.

``explain`` resolves a recipe and prints its plan without touching a model (``(default)`` after each
argument the recipe did not give, and where llm-compressor's default differs for the same recipe, how:
:data:`llmc_fsm.recipes.llmcompressor.DEFAULT_DIFFERENCES`); given a modifier's name instead, the plan of
that modifier alone with every argument at its default.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import attrs

from llmc_fsm.core.errors import MissingStateError, RecipeError
from llmc_fsm.core.registry import DISABLE_ENV, get_registry
from llmc_fsm.models.hf_io import meta_model
from llmc_fsm.models.known import KNOWN_MODELS, known_model_dir
from llmc_fsm.models.layers import check_calibrates_from_text, find_decoder_layers
from llmc_fsm.oneshot_job.data import check_modifiers, torch_dtype_of
from llmc_fsm.oneshot_job.settings import DTYPES, _dtype_name
from llmc_fsm.pipeline.sequential import check_modifier_targets_in_layers, output_head
from llmc_fsm.recipes.llmcompressor import unimplemented_note
from llmc_fsm.recipes.model import Recipe
from llmc_fsm.session.explain import explain
from llmc_fsm.session.session import Session

__all__ = ["add_cli", "format_modifiers"]


def _keys(keys: frozenset[str]) -> str:
    return ", ".join(sorted(keys)) or "-"


def format_modifiers() -> str:
    """The ``llmc-fsm modifiers`` listing as text."""

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
        lines.append(f"      required state: {_keys(info.cls.required_state)}")
        lines.append(f"      optional state: {_keys(info.cls.optional_state)}")
        if info.cls.events:
            lines.append(f"      batch events: {_keys(info.cls.events)}")
    if registry.errors:
        lines.append(f"{len(registry.errors)} broken plugin(s):")
        lines.extend(f"  ERROR {err}" for err in registry.errors)
    if registry.disabled:
        lines.append(f"Disabled through {DISABLE_ENV}:")
        for item in registry.disabled:
            version = f" {item.version}" if item.version else ""
            lines.append(f"  {item.distribution}{version} (entry point {item.entry_point!r})")
    return "\n".join(lines) + "\n"


def _run_modifiers(args: argparse.Namespace) -> int:
    print(format_modifiers(), end="")
    return 0


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


def _modifier_plan(name: str, state: list[str]) -> str:
    """What ``llmc-fsm explain NAME`` prints: the plan of ``{"defaults": {name: {}}}`` when every argument has a
    default that forms a valid modifier; otherwise its arguments with their defaults and what must be set.

    Raises:
        ValueError: ``name`` is not a registered modifier.
    """

    info = _modifier_info(name)
    schedule = ("start", "end", "update")  # explain shows them as the schedule, not as arguments
    fields = [f for f in attrs.fields(info.cls) if f.init and f.name not in schedule] if attrs.has(info.cls) else []
    required = [f.alias for f in fields if f.default is attrs.NOTHING]
    why = f"{', '.join(required)} (no default)" if required else None
    if why is None:
        try:
            return _plan({"defaults": {name: {}}}, state)
        except (RecipeError, ValueError) as exc:  # the defaults alone are not a valid modifier (e.g. no sparsity)
            why = str(exc).rsplit(": ", 1)[-1] if isinstance(exc, RecipeError) else str(exc)
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

    recipe = args.recipe
    if recipe == "-":  # the Unix convention (it was parsed as the YAML text "-", "got a list": a tester's case)
        msg = "RECIPE '-' (standard input) is not read: give the recipe file's path"
        raise ValueError(msg)
    if not os.path.exists(recipe) and recipe.isidentifier():
        print(_modifier_plan(recipe, args.state), end="")  # a modifier's name: its plan with the defaults
        return 0
    session = Session(recipe)
    if args.state:
        session.update_state(**_supplied(args.state))
    model = _meta_model(args.model, args.dtype) if args.model is not None else None
    refusal = None
    if model is not None:
        session.update_state(model=model)
        try:  # the checks oneshot runs on the same meta-device model before any weight (group sizes, targets...)
            checked = _oneshot_part(session)
            if checked is not None:
                if checked.requires("calibration_data"):
                    check_calibrates_from_text(model)  # an encoder-decoder model (Whisper) calibrates on no token ids
                check_modifiers(_stage_sessions(checked), model, True)
                _check_in_layers(checked, model)
        except MissingStateError:
            refusal = None  # a training recipe: the plan lists what it needs
        except ValueError as exc:
            on = f"--model {args.model}" + (f" --dtype {args.dtype}" if args.dtype != "float32" else "")
            refusal = ValueError(f"oneshot would refuse this recipe on {on}: {exc}")
    print(explain(session, model_refused=refusal is not None), end="")
    if refusal is not None:
        raise refusal
    given_by_oneshot = {"model", "calibration_data"}
    missing = {key for keys in session.missing_state().values() for key in keys}
    if missing and missing <= given_by_oneshot:
        fit = (
            f"oneshot's checks of --model {args.model} pass"
            if model is not None
            else "`explain RECIPE --model DIR` runs oneshot's checks of a model and shows, where a modifier resolves "
            "modules (AWQ, SmoothQuant), how they map on it"
        )
        print(f"(Expected here: `llmc-fsm oneshot` gives {' and '.join(sorted(missing))}; {fit}.)")
    return 0


def _oneshot_part(session: Session) -> Session | None:
    """A session of ``session``'s recipe without its ``run_type: train`` stages, which one-shot skips (``None`` when
    every stage is one): their state keys (``steps_per_epoch``) made explain skip every check, so a later stage's
    refusal went unsaid (a README-only newcomer's case: llm-compressor's 2:4 recipe of docs/recipes.md)."""
    kept = [stage for stage in session.recipe.stages if stage.run_type != "train"]
    if len(kept) == len(session.recipe.stages):
        return session
    return Session(Recipe(kept, session.recipe.source)) if kept else None


def _stage_sessions(session: Session) -> list[Session]:
    """One session per stage not yet applied, as one-shot runs a recipe (``fuse_stages=False``): with the whole
    recipe as one session, a modifier's ``check_stage`` saw the modifiers of every stage, so explain passed an AWQ
    stage whose quantizer sits in another stage, which one-shot refuses (found by a tester)."""
    fresh = [stage for stage in session.recipe.stages if not stage.applied]
    if len(fresh) <= 1:
        return [session]
    return [Session(Recipe([stage], session.recipe.source)) for stage in fresh]


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
        description="List every modifier registered by the installed plugins, and the plugins that failed to load.",
    )
    parser.set_defaults(func=_run_modifiers)

    parser = sub.add_parser(
        "explain",
        help="print a recipe's plan without touching a model",
        description=(
            "Resolve RECIPE (a .yaml/.yml/.json file) and print its stages, the modifiers in execution order, "
            "their arguments, the events each handles and the state keys each requires. RECIPE may also be a "
            "modifier's name (see llmc-fsm modifiers), e.g. GPTQModifier: its arguments and their defaults "
            "(a modifier with arguments that have no default names them instead)."
        ),
    )
    parser.add_argument(
        "recipe", metavar="RECIPE", help="recipe file (.yaml, .yml or .json), or a modifier name (e.g. GPTQModifier)"
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
        "(e.g. AWQ's smoothing mappings)",
    )
    parser.add_argument(
        "--dtype",
        type=_dtype_name,  # as oneshot's --dtype: bf16, fp16, half, fp32, float too
        choices=DTYPES,
        default="float32",
        help="with --model: the dtype oneshot would load it in (as oneshot --dtype; default float32); NVFP4 and MX "
        "schemes need bfloat16",
    )
    parser.set_defaults(func=_run_explain)
