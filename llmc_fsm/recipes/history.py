"""Which stages a one-shot run applies: not those already applied to the model (its history, read back so the new
``recipe.yaml`` records them all), nor those of ``run_type: train``.

A model written by ``oneshot(output_dir=...)`` carries them in ``recipe.yaml``; an
in-memory model that ``oneshot`` returned, in its :data:`APPLIED_RECIPE_ATTR` attribute.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import attrs

from llmc_fsm.core.errors import RecipeError
from llmc_fsm.recipes.building import resolve_recipe
from llmc_fsm.recipes.model import Recipe

__all__ = ["APPLIED_RECIPE_ATTR", "merge_saved_recipe", "settings_diff", "without_training_stages"]

logger = logging.getLogger(__name__)


#: The attribute of a model returned by :func:`llmc_fsm.oneshot` that holds its ``recipe.yaml`` text (every stage
#: applied to it so far), so a later ``oneshot`` on the same in-memory model records the whole history.
APPLIED_RECIPE_ATTR = "llmc_fsm_applied_recipe"


def merge_saved_recipe(recipe: Recipe, model: Any, generated: bool) -> Recipe:
    """Put the stages already applied to a saved model first; skip or rename new stages of the same name.

    A model written by ``oneshot(output_dir=...)`` carries ``recipe.yaml`` with its
    stages marked ``applied`` (every stage of a model's ``recipe.yaml`` is taken as
    applied: llm-compressor writes the recipe it applied without the mark; one that
    cannot be read is left out, with a warning); an in-memory model that ``oneshot`` returned carries
    the same YAML in its :data:`APPLIED_RECIPE_ATTR` attribute (its new stages
    always run, renamed like a generated recipe's when a name was applied).
    Re-running on that directory keeps those stages (so
    the new ``recipe.yaml`` tells the model's whole history). A stage of a
    *generated* recipe (``--method``) whose name was applied gets a fresh name
    (``sparsity_stage_2``, ...) and runs; a stage of a given recipe whose name was
    applied is skipped, with a warning that names the settings that differ.
    """

    history = getattr(model, APPLIED_RECIPE_ATTR, None)
    if isinstance(history, str):  # an in-memory model an earlier oneshot() compressed: its stages always run
        saved, generated = _read_history(history, f"the model's {APPLIED_RECIPE_ATTR} attribute"), True
    elif isinstance(model, str | os.PathLike) and (Path(model) / "recipe.yaml").is_file():
        saved = _read_history(Path(model) / "recipe.yaml", os.fspath(Path(model) / "recipe.yaml"))
    else:
        return recipe
    if saved is None:
        return recipe
    done = {stage.name: stage for stage in saved.stages}
    fresh = []
    for stage in recipe.stages:
        if stage.name not in done:
            fresh.append(stage)
        elif generated:
            k = 2
            while f"{stage.name}_{k}" in done:
                k += 1
            fresh.append(attrs.evolve(stage, name=f"{stage.name}_{k}"))
        else:
            old = Recipe([done[stage.name]], saved.source).to_dict()
            new = Recipe([stage], recipe.source).to_dict()
            diff = settings_diff(old.get(stage.name), new.get(stage.name))
            logger.warning(
                "stage %r was already applied to %s (see its recipe.yaml): skipped%s",
                stage.name,
                model,
                f"; its settings differ: {diff} — give the stage a new name to apply it" if diff else "",
            )
    return Recipe([*saved.stages, *fresh], recipe.source)


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
    import yaml

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
