"""A recipe's fingerprint: each modifier's label, class, stage and arguments as JSON values, and their differences.

Session checkpoints store it (a checkpoint refuses to load into a session with another recipe) and ranks compare its
digest before any work (:func:`llmc_fsm.session.ranks.check_ranks_agree`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["differences", "recipe_fingerprint"]


def _plain(value: Any) -> Any:
    """A modifier argument as JSON: containers become lists/dicts, an object with a ``to_recipe()`` method what it
    returns (as a recipe holds it); other objects their ``repr``."""
    if callable(getattr(value, "to_recipe", None)):
        value = value.to_recipe()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((_plain(v) for v in value), key=repr)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return {"repr": repr(value)}


def recipe_fingerprint(labels: list[str], modifiers: list[Any], plan: list[tuple[Any, list[Any]]]) -> list[dict]:
    """Per modifier, in execution order: ``{"label", "class", "stage", "arguments"}`` (JSON values)."""
    stage_of = {id(m): stage.name for stage, mods in plan for m in mods}
    result = []
    for label, m in zip(labels, modifiers, strict=True):
        arguments = {f.alias: _plain(getattr(m, f.name)) for f in attrs.fields(type(m)) if f.init}
        result.append(
            {
                "label": label,
                "class": f"{type(m).__module__}.{type(m).__qualname__}",
                "stage": stage_of.get(id(m)),
                "arguments": arguments,
            }
        )
    return result


def differences(saved: list[dict], current: list[dict]) -> list[str]:
    """Every difference between two :func:`recipe_fingerprint` lists, one sentence each."""
    old = {d["label"]: d for d in saved}
    new = {d["label"]: d for d in current}
    out = [
        f"modifier {label} removed (in the checkpoint, not in this session's recipe)"
        for label in old
        if label not in new
    ]
    out += [
        f"modifier {label} added (in this session's recipe, not in the checkpoint)" for label in new if label not in old
    ]
    for label in (label for label in new if label in old):
        a, b = old[label], new[label]
        for key in ("class", "stage"):
            if a[key] != b[key]:
                out.append(f"modifier {label}: {key} {a[key]!r} in the checkpoint, {b[key]!r} now")
        args_a, args_b = a["arguments"], json.loads(json.dumps(b["arguments"]))
        for name in sorted(set(args_a) | set(args_b)):
            va, vb = args_a.get(name, "<not set>"), args_b.get(name, "<not set>")
            if va != vb:
                out.append(f"modifier {label}: argument {name!r} is {va!r} in the checkpoint, {vb!r} now")
    common_old = [label for label in old if label in new]
    common_new = [label for label in new if label in old]
    if common_old != common_new:
        out.append(f"modifier order differs: {common_old} in the checkpoint, {common_new} now")
    return out
