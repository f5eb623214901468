"""Which stages a one-shot run applies: not those already applied to the model with the same settings (its history,
read back so the new ``recipe.yaml`` records them all; see :func:`merge_saved_recipe`), nor those of
``run_type: train``.

A model written by ``oneshot(output_dir=...)`` carries them in ``recipe.yaml``; an
in-memory model that ``oneshot`` returned, in its :data:`APPLIED_RECIPE_ATTR` attribute.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import attrs
import yaml

from llmc_fsm.core.errors import RecipeError
from llmc_fsm.recipes.building import resolve_recipe
from llmc_fsm.recipes.model import Recipe

__all__ = ["APPLIED_RECIPE_ATTR", "merge_saved_recipe", "settings_diff", "without_training_stages"]

logger = logging.getLogger(__name__)


#: The attribute of a model returned by :func:`llmc_fsm.oneshot` that holds its ``recipe.yaml`` text (every stage
#: applied to it so far), so a later ``oneshot`` on the same in-memory model records the whole history.
APPLIED_RECIPE_ATTR = "llmc_fsm_applied_recipe"


def merge_saved_recipe(recipe: Recipe, model: Any, *, notes: list[str] | None = None) -> Recipe:
    """Put the stages already applied to ``model`` first; skip new stages applied before with the same settings.

    The history: a model written by ``oneshot(output_dir=...)`` carries ``recipe.yaml`` with its
    stages marked ``applied`` (every stage of a model's ``recipe.yaml`` is taken as
    applied: llm-compressor writes the recipe it applied without the mark; one that
    cannot be read is left out, with a warning); an in-memory model that ``oneshot`` returned carries
    the same YAML in its :data:`APPLIED_RECIPE_ATTR` attribute. The merged recipe keeps that history first
    (so the new ``recipe.yaml`` tells the model's whole history).

    One rule for every new stage, whatever its source (``--method`` or a recipe) and whatever the model
    (a saved directory or an in-memory model):

    * the same modifiers with the same settings were applied before (under any stage name):
      **skipped**, with a one-line warning naming the applied stage;
    * otherwise it **runs**; when its name was applied it runs under a fresh one
      (``sparsity_stage_2``, ...), and when a stage of the same modifier(s) was applied with other
      settings a one-line warning says what was applied before and what differs (appended to ``notes`` instead
      where given: :func:`llmc_fsm.oneshot` says it once every check of the model, the data and the modifiers
      passed, so that a refusal, e.g. of a model quantized already, is not preceded by a line saying the stage
      runs).
    """

    history = getattr(model, APPLIED_RECIPE_ATTR, None)
    if isinstance(history, str):  # an in-memory model an earlier oneshot() compressed
        saved, where = _read_history(history, f"the model's {APPLIED_RECIPE_ATTR} attribute"), "the model"
    elif isinstance(model, str | os.PathLike) and (Path(model) / "recipe.yaml").is_file():
        where = f"{os.fspath(model)} (see its recipe.yaml)"
        saved = _read_history(Path(model) / "recipe.yaml", os.fspath(Path(model) / "recipe.yaml"))
    else:
        return recipe
    if saved is None:
        return recipe
    done = {stage.name: _settings(stage) for stage in saved.stages}
    names = set(done)
    fresh = []
    for stage in recipe.stages:
        if stage.applied:  # marked applied in the given recipe: history too (once)
            if stage.name not in names:
                names.add(stage.name)
                fresh.append(stage)
            continue
        settings = _settings(stage)
        same = next((name for name, old in done.items() if old == settings), None)
        if same is not None:
            logger.warning(
                "stage %r (%s) was already applied to %s with the same settings (stage %r): skipped",
                stage.name,
                _modifier_names(settings),
                where,
                same,
            )
            continue
        name = stage.name
        if name in names:
            k = 2
            while f"{stage.name}_{k}" in names:
                k += 1
            name = f"{stage.name}_{k}"
            stage = attrs.evolve(stage, name=name)
        names.add(name)
        fresh.append(stage)
        similar = [
            (old_name, old) for old_name, old in done.items() if _modifier_names(old) == _modifier_names(settings)
        ]
        if similar:
            old_name, old = similar[-1]
            line = (
                f"{where} already had stage {old_name!r} ({_modifier_names(old)}) applied; stage {name!r} runs on top "
                f"of it ({settings_diff(old, settings) or 'other settings'})"
            )
            if notes is None:
                logger.warning("%s", line)
            else:
                notes.append(line)
    return Recipe([*saved.stages, *fresh], recipe.source)


def _settings(stage: Any) -> dict[str, Any]:
    """A stage's modifiers and schedule as plain data, without its name and ``applied`` mark."""
    body = Recipe([stage], "").to_dict()[stage.name]
    body.pop("applied", None)
    return body


def _modifier_names(settings: dict[str, Any]) -> str:
    return ", ".join(name for entry in settings["modifiers"] for name in entry)


def settings_diff(old: Any, new: Any, prefix: str = "") -> str:
    """``"key old -> new"`` for every setting that differs between two recipe dicts ("" if none)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [k for k in dict.fromkeys([*old, *new]) if k != "applied"]
        parts = [settings_diff(old.get(k), new.get(k), prefix if k == "modifiers" else f"{prefix}{k}.") for k in keys]
        return "; ".join(p for p in parts if p)
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return "; ".join(p for p in (settings_diff(a, b, prefix) for a, b in zip(old, new, strict=True)) if p)
    return "" if old == new else f"{prefix.rstrip('.')} {old!r} -> {new!r}"


def _read_history(source: Any, where: str) -> Recipe | None:
    """The stages already applied to a model, every one marked applied (``None``, with a warning: unreadable)."""

    try:
        text = source if isinstance(source, str) else source.read_text(encoding="utf-8")
        data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise RecipeError(f"expected a mapping of stage names, got {type(data).__name__}")
        saved = resolve_recipe(data)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecipeError) as exc:
        logger.warning(
            "%s cannot be read as a recipe (%s): the stages applied to the model before are left out of the new "
            "recipe.yaml",
            where,
            str(exc).splitlines()[0],
        )
        return None
    unmarked = [stage.name for stage in saved.stages if not stage.applied]
    if unmarked:
        logger.warning(
            "%s: stage(s) %s not marked applied are taken as the model's history (as llm-compressor writes the "
            "recipe it applied), not run again",
            where,
            ", ".join(repr(n) for n in unmarked),
        )
    return Recipe([attrs.evolve(stage, applied=True) for stage in saved.stages], saved.source)


def without_training_stages(recipe: Recipe) -> Recipe:
    """``recipe`` without its stages of ``run_type: train`` (one-shot runs no training), with a warning.

    llm-compressor's sparse recipes hold the masks in such a stage (``ConstantPruningModifier`` from ``start: 0``)
    for a fine-tuning run after the one-shot ones; its epoch schedule needs ``steps_per_epoch``, which only a
    training loop gives.

    Raises:
        ValueError: every stage is a training one.
    """

    training = [stage.name for stage in recipe.stages if stage.run_type == "train" and not stage.applied]
    if not training:
        return recipe
    names = ", ".join(repr(n) for n in training)
    kept = [stage for stage in recipe.stages if stage.name not in training]
    if not kept:
        msg = f"the recipe has no one-shot stage: {names} have run_type: train; run them in a training loop " + (
            "(docs/training.md)"
        )
        raise ValueError(msg)
    logger.warning(
        "one-shot runs no training: stage(s) %s (run_type: train) skipped, and left out of the saved recipe.yaml; "
        "run them in a training loop (docs/training.md)",
        names,
    )
    return Recipe(kept, recipe.source)
