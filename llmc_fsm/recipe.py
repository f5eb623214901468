"""Recipes: named stages of modifiers with arguments.

Sources accepted by :func:`resolve_recipe`: ``None`` (no modifiers), a
:class:`Recipe`, a list of :class:`~llmc_fsm.Modifier` objects (used as they
are), a dict, YAML/JSON text, or a path to a ``.yaml``/``.yml``/``.json`` file.
See ``docs/recipes.md`` for the format. YAML is read with ``yaml.safe_load``
only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml

from llmc_fsm.errors import RecipeError
from llmc_fsm.modifier import Modifier

__all__ = ["Recipe", "Stage", "resolve_recipe"]


@attrs.define(eq=False)
class Stage:
    """One named stage: modifiers in recipe order. ``applied`` marks a stage already run on a saved model."""

    name: str
    modifiers: list[Modifier]
    applied: bool = False


@attrs.define(eq=False)
class Recipe:
    """A resolved recipe. ``source`` names where it came from (a path, ``"<text>"``, ``"<dict>"``...)."""

    stages: list[Stage] = attrs.field(factory=list)
    source: str = "<none>"

    @property
    def modifiers(self) -> list[Modifier]:
        """Modifiers of the stages not yet applied, in recipe order."""
        return [m for stage in self.stages if not stage.applied for m in stage.modifiers]


def _where(source: str, stage: str | None = None, modifier: str | None = None) -> str:
    parts = [f"recipe {source}"]
    if stage is not None:
        parts.append(f"stage {stage!r}")
    if modifier is not None:
        parts.append(f"modifier {modifier}")
    return ", ".join(parts)


def _build_modifier(name: str, args: Any, *, source: str, stage: str) -> Modifier:
    from llmc_fsm.plugins import get_registry

    try:
        cls = get_registry().get(name)
    except RecipeError as exc:
        raise RecipeError(f"{_where(source, stage)}: {exc}") from None
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        msg = f"{_where(source, stage, name)}: arguments must be a mapping, got {type(args).__name__}"
        raise RecipeError(msg)
    accepted = {a.alias for a in attrs.fields(cls) if a.init}
    unknown = sorted(set(args) - accepted)
    if unknown:
        msg = (
            f"{_where(source, stage, name)}: unknown argument(s) {', '.join(map(repr, unknown))}; "
            f"accepted: {', '.join(sorted(accepted))}"
        )
        raise RecipeError(msg)
    try:
        return cls(**args)
    except (TypeError, ValueError) as exc:
        msg = f"{_where(source, stage, name)}: {exc}"
        raise RecipeError(msg) from exc


def _stage_modifiers(body: Any, *, source: str, stage: str) -> tuple[list[Modifier], bool]:
    applied = False
    if isinstance(body, Mapping) and "modifiers" in body:
        extra = sorted(set(body) - {"modifiers", "applied"})
        if extra:
            msg = f"{_where(source, stage)}: unknown stage key(s) {extra}; a stage accepts 'modifiers' and 'applied'"
            raise RecipeError(msg)
        applied = bool(body.get("applied", False))
        body = body["modifiers"]
    items: list[tuple[str, Any]]
    if isinstance(body, Mapping):
        items = list(body.items())
    elif isinstance(body, Sequence) and not isinstance(body, str):
        items = []
        for entry in body:
            if isinstance(entry, Modifier):
                items.append(("", entry))
            elif isinstance(entry, Mapping) and len(entry) == 1:
                items.extend(entry.items())
            else:
                msg = f"{_where(source, stage)}: each list entry must be {{ModifierName: {{arguments}}}}, got {entry!r}"
                raise RecipeError(msg)
    else:
        msg = f"{_where(source, stage)}: a stage must map modifier names to arguments, got {body!r}"
        raise RecipeError(msg)
    if not items:
        msg = f"{_where(source, stage)}: the stage has no modifiers; remove it or add one"
        raise RecipeError(msg)
    modifiers = [
        args if isinstance(args, Modifier) else _build_modifier(str(name), args, source=source, stage=stage)
        for name, args in items
    ]
    return modifiers, applied


def _from_mapping(data: Mapping[str, Any], source: str) -> Recipe:
    if not data:
        msg = f"recipe {source} is empty: give at least one stage with a modifier"
        raise RecipeError(msg)
    stages = []
    for name, body in data.items():
        modifiers, applied = _stage_modifiers(body, source=source, stage=str(name))
        stages.append(Stage(str(name), modifiers, applied))
    return Recipe(stages, source)


def _load_text(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        msg = f"recipe {source} is not valid YAML/JSON{line}: {getattr(exc, 'problem', exc)}"
        raise RecipeError(msg) from None


def resolve_recipe(recipe: Any) -> Recipe:
    """Parse and validate ``recipe`` into a :class:`Recipe` with modifier objects.

    Raises:
        RecipeError: unreadable source, bad structure, unknown modifier or argument,
            or an invalid argument value; the message names the source, stage and
            modifier.
    """
    if recipe is None:
        return Recipe()
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, Modifier):
        recipe = [recipe]
    if isinstance(recipe, Mapping):
        return _from_mapping(recipe, "<dict>")
    if isinstance(recipe, os.PathLike) or (isinstance(recipe, str) and "\n" not in recipe and (
        recipe.endswith((".yaml", ".yml", ".json")) or os.path.exists(recipe))):
        path = Path(recipe)
        if not path.is_file():
            msg = f"recipe file {str(path)!r} does not exist"
            raise RecipeError(msg)
        data = _load_text(path.read_text(encoding="utf-8"), str(path))
        source = str(path)
    elif isinstance(recipe, str):
        data = _load_text(recipe, "<text>")
        source = "<text>"
    elif isinstance(recipe, Sequence):
        if not all(isinstance(m, Modifier) for m in recipe):
            msg = "a recipe list must contain only llmc_fsm.Modifier objects"
            raise RecipeError(msg)
        return Recipe([Stage("default", list(recipe))], "<objects>") if recipe else Recipe(source="<objects>")
    else:
        msg = f"unsupported recipe type {type(recipe).__name__}: pass a path, YAML text, a dict or a list of Modifiers"
        raise RecipeError(msg)
    if not isinstance(data, Mapping):
        msg = f"recipe {source} must be a mapping of stage names to modifiers, got {type(data).__name__}"
        raise RecipeError(msg)
    return _from_mapping(data, source)
