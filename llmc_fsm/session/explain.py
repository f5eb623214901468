"""``llmc_fsm.session.explain.explain(session)`` / ``llmc-fsm explain RECIPE``: the plan as text, touching no model.

For each stage (applied stages are listed as skipped): the modifiers in
execution order, their arguments (``(default)`` after each value the recipe did
not give, saying where llm-compressor's default differs), their schedule, the events and
lifecycle calls each handles, the state keys each requires or uses and whether
they are present yet, and the ``runs_after`` constraints that shaped the order.
When the state holds a model (e.g. on the meta device) and a modifier has an
``explain_model(model, stage)`` method returning lines (the smoothing modifiers' resolved
mappings; ``stage``: the modifiers of its stage, in execution order), those lines too.

This module depends on :mod:`llmc_fsm.session.session` (it reads a session's recipe,
state and lifecycle); the session does not know about it.
"""

from __future__ import annotations

import difflib
from typing import Any

import attrs

from llmc_fsm.core.lifecycle import BATCH_EVENTS
from llmc_fsm.core.modifier import HOOKS, Modifier, modifier_labels, overrides
from llmc_fsm.core.registry import get_registry
from llmc_fsm.core.state import WELL_KNOWN_KEYS, State
from llmc_fsm.recipes.building import given_arguments
from llmc_fsm.recipes.llmcompressor import default_difference
from llmc_fsm.session.session import Session

__all__ = ["check_state_keys", "explain", "handled_events"]


def handled_events(modifier: Modifier | type[Modifier]) -> list[str]:
    """The lifecycle calls and events ``modifier`` has hooks for, in lifecycle order.

    ``on_event`` contributes the batch events listed in ``events``; a modifier
    that declares no events never receives one.
    """
    cls = modifier if isinstance(modifier, type) else type(modifier)
    handled: list[str] = []
    for hook in HOOKS:
        if not overrides(cls, hook):
            continue
        if hook == "on_event":
            handled.extend(e for e in BATCH_EVENTS if e in cls.events)
        else:
            handled.append(hook.removeprefix("on_"))
    return handled


def _schedule(m: Modifier) -> str:
    start = "the first event" if m.start is None else f"epoch {m.start:g}"
    end = "finalize" if m.end is None else f"epoch {m.end:g}"
    text = f"from {start} until {end}"
    if m.update is not None:
        text += f", update every {m.update:g} epoch(s)"
    return text


def _arguments(m: Modifier) -> str:
    """``name=value`` of every argument; ``(default)`` after each the recipe did not give (for a modifier not
    built from recipe data: each equal to its default), with how llm-compressor's default differs, if it does, or
    what the default stands for (the field's ``default_means`` metadata, e.g. AWQ's ``scheme=None``); ``(from X)``
    after one the modifier set from other arguments (its ``derived_arguments``, e.g. a quantizer's ``targets`` from
    its ``config_groups``); ``(not used: why)`` after one that does nothing as the modifier is written (its
    ``unused_arguments``)."""
    given = given_arguments(m)
    fresh = _built_with_defaults(type(m)) if given is None else None  # defaults as the converters make them
    parts = []
    for field in attrs.fields(type(m)):
        if not field.init or field.name in ("start", "end", "update"):
            continue
        value = getattr(m, field.name)
        default = field.default
        if fresh is not None:  # GPTQModifier's scheme=None stands for 'W4A16' once built: compare what is built
            default = getattr(fresh, field.name)
        elif isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory(m) if default.takes_self else default.factory()
        if given is None:
            defaulted = default is not attrs.NOTHING and value == default
        else:
            defaulted = field.alias not in given
        differs = default_difference(m.modifier_name(), field.alias, value) if defaulted else None
        means = field.metadata.get("default_means") if defaulted else None  # what the default stands for
        derived = getattr(m, "derived_arguments", {}).get(field.alias) if defaulted else None
        unused = getattr(m, "unused_arguments", {}).get(field.alias)
        mark = ""
        if unused:  # does nothing as the modifier is written (e.g. targets with a KV-cache scheme alone)
            mark = f" (not used: {unused})"
        elif derived:  # not given, and not the default either: set from other arguments
            mark = f" (from {derived})"
        elif differs:
            mark = f" (default; {differs})"
        elif means:
            mark = f" (default: {means})"
        elif defaulted:
            mark = " (default)"
        parts.append(f"{field.alias}={value!r}{mark}")
    return ", ".join(parts) or "-"


def _built_with_defaults(cls: type) -> Any:
    """``cls()`` (every argument at its default, converted as the class converts it), or ``None`` where it needs
    arguments or its defaults alone are refused."""
    try:
        return cls()
    except Exception:
        return None


def _keys(keys: Any, state: State, absent: str) -> str:
    if not keys:
        return "-"
    return ", ".join(f"{k} ({'present' if k in state else absent})" for k in sorted(keys))


def _origin(m: Modifier) -> str:

    info = get_registry().info(m.modifier_name())
    if info is None or info.cls is not type(m):
        return f"{type(m).__module__}"
    origin = info.distribution or "in-process"
    return f"{origin} {info.version}" if info.version else origin


def _window(stage: Any) -> str:
    if stage.start is None and stage.end is None:
        return ""
    start = "-" if stage.start is None else f"{stage.start:g}"
    end = "-" if stage.end is None else f"{stage.end:g}"
    return f" [epochs {start} to {end}]"


def _on_model(m: Modifier, model: Any, stage: tuple[Modifier, ...]) -> list[str]:
    """What ``m.explain_model(model, stage)`` says about the state's model (e.g. smoothing mappings), if it says
    anything; ``stage``: the modifiers of ``m``'s stage (AWQ names the mappings its stage's quantizer leaves dense)."""
    describe = getattr(m, "explain_model", None)
    if describe is None or not callable(getattr(model, "named_modules", None)):
        return []
    try:
        found = describe(model, stage)
    except ValueError as err:
        found = [f"does not fit this model: {err}"]
    return [f"       {'on model:' if i == 0 else '':<10} {line}" for i, line in enumerate(found)]


def check_state_keys(session: Session, keys: list[str]) -> None:
    """Check the state keys a caller says it supplies (``llmc-fsm explain --state KEY``) before they are counted.

    A key is known when it is a well-known state key (:data:`~llmc_fsm.core.state.WELL_KNOWN_KEYS`) or one a
    modifier of the session's recipe requires or uses.

    Raises:
        ValueError: an unknown key (``calibration-data``: it was counted as present while ``calibration_data`` stayed
            missing, found by a tester), with the closest known key and the known keys.
    """
    known = set(WELL_KNOWN_KEYS)
    for modifier in session.modifiers:
        known |= set(modifier.required_keys()) | set(modifier.optional_state)
    unknown = [key for key in keys if key not in known]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key.replace("-", "_"), sorted(known), n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        msg = (
            f"unknown state key {key!r}: it is no well-known state key and no modifier of the recipe requires or "
            f"uses it.{hint} Known: {', '.join(sorted(known))}"
        )
        raise ValueError(msg)


def explain(session: Session, *, model_refused: bool = False, fuse_stages: bool = False) -> str:
    """Return ``session``'s plan as text, touching no model (see the module docstring).

    ``model_refused``: the state's model was checked and a modifier refuses it (``llmc-fsm explain --model``, which
    prints the refusal itself): the last line then says so (instead of "Ready to initialize"). ``fuse_stages``: the
    stages run as ``oneshot(fuse_stages=True)`` runs them (``llmc-fsm explain --fuse-stages``): the one-shot line
    for several calibrated stages says they share one layer-by-layer pass (it said one pass each, found by a tester).

    Raises:
        TypeError: ``session`` is not a :class:`~llmc_fsm.Session`.
    """
    if not isinstance(session, Session):
        msg = f"explain() takes a llmc_fsm.Session, got {type(session).__name__}"
        raise TypeError(msg)
    recipe = session.recipe
    state = session.state
    plan = {id(stage): modifiers for stage, modifiers in recipe.plan()}
    labels = dict(zip(map(id, recipe.modifiers), modifier_labels(recipe.modifiers), strict=True))
    present = ", ".join(sorted(state)) or "none"
    lines = [
        f"Recipe {recipe.source}: {len(recipe.stages)} stage(s), {len(labels)} modifier(s) to run",
        f"Session lifecycle: {session.lifecycle}; state present: {present}",
    ]
    if not recipe.stages:
        lines.append("No stages: the session runs without modifiers.")
    position = 0
    for stage in recipe.stages:
        if stage.applied:
            names = ", ".join(m.modifier_name() for m in stage.modifiers)
            lines.append(f"Stage {stage.name!r}{_window(stage)}: already applied, skipped ({names})")
            continue
        lines.append(f"Stage {stage.name!r}{_window(stage)}:")
        for m in plan[id(stage)]:
            position += 1
            lines.append(f"  {position}. {labels[id(m)]}  [{_origin(m)}]")
            lines.append(f"       arguments: {_arguments(m)}")
            lines.append(f"       active:    {_schedule(m)}")
            lines.append(f"       handles:   {', '.join(handled_events(m)) or 'nothing'}")
            lines.append(f"       requires:  {_keys(m.required_keys(), state, 'MISSING')}")
            optional = frozenset(m.optional_state) - m.required_keys()
            lines.append(f"       optional:  {_keys(optional, state, 'absent')}")
            after = sorted(m.runs_after)
            if after:
                lines.append(f"       runs after: {', '.join(after)} (when in the recipe)")
            together = recipe.modifiers if fuse_stages else plan[id(stage)]  # fused: one stage of every modifier
            lines.extend(_on_model(m, state.get("model"), tuple(together)))
    calibrated = [
        stage.name
        for stage in recipe.stages
        if not stage.applied and any(overrides(m, "on_calibration_end") for m in stage.modifiers)
    ]
    if len(calibrated) > 1 and fuse_stages:
        lines.append(
            f"One-shot (fuse_stages): stages {', '.join(map(repr, calibrated))} share one layer-by-layer calibration "
            "pass: at each decoder layer every stage's modifiers compress it in recipe order before the calibration "
            "inputs move on through the compressed layer (see docs/quantization.md)."
        )
    elif len(calibrated) > 1:
        lines.append(
            f"One-shot: stages {', '.join(map(repr, calibrated))} run in that order, one layer-by-layer calibration "
            "pass each, every pass on the model the previous stages compressed (oneshot(fuse_stages=True) shares "
            "one pass; see docs/quantization.md)."
        )
    if session.lifecycle in ("created", "staging"):
        missing = session.missing_state()
        if missing:
            lines.append("Missing before initialize():")
            lines.extend(f"  - {label}: {', '.join(sorted(keys))}" for label, keys in missing.items())
        elif not model_refused:
            lines.append("Ready to initialize: every required state key is present.")
        if model_refused:
            lines.append("Not ready: a modifier refuses the model (below).")
    return "\n".join(lines) + "\n"
