"""Recipes: named stages of modifiers with arguments.

Sources accepted by :func:`resolve_recipe`: ``None`` (no modifiers), a
:class:`Recipe`, a :class:`~llmc_fsm.Modifier` or a list of them (used as they
are, never round-tripped through text), a dict (whose stage bodies may also hold
modifier objects), YAML/JSON text, or a path to a ``.yaml``/``.yml``/``.json``
file. Recipes written for llm-compressor (``stage -> <group>_modifiers ->
modifier``, ``run_type``) are read too. See ``docs/recipes.md`` for the format.

This module holds the resolved recipe (:class:`Recipe`, :class:`Stage`, the
execution order, writing back to YAML); reading text lives in
:mod:`llmc_fsm.recipes.loading`, building stages and modifiers from data in
:mod:`llmc_fsm.recipes.building`.
"""

from __future__ import annotations

import enum
import heapq
import math
import numbers
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import yaml

from llmc_fsm.core.errors import RecipeError
from llmc_fsm.core.modifier import Modifier
from llmc_fsm.recipes.llmcompressor import NEGATIVE_END, RUN_TYPES, is_numpy_scalar, number_from_string

__all__ = ["SCHEDULE_FIELDS", "STAGE_KEYS", "Recipe", "Stage"]

#: Keys of a stage's long form ``{modifiers: ..., applied: ..., start: ..., end: ..., run_type: ...}``
#: (besides llm-compressor's ``<group>_modifiers`` keys).
STAGE_KEYS: tuple[str, ...] = ("modifiers", "applied", "start", "end", "run_type")

#: The schedule fields every modifier has (epochs; ``None``: from the first event, until finalize, never).
SCHEDULE_FIELDS: tuple[str, ...] = ("start", "end", "update")

#: How a modifier's window must sit in its stage's: key -> (its unset meaning, the side refused, the rule).
WINDOW_EDGES = {
    "start": ("null (the first event)", "before", "at or after"),
    "end": ("null (finalize)", "after", "at or before"),
}


def epoch_value(value: Any, at: str, key: str) -> float | None:
    """``value`` (a stage's or a modifier's ``start`` / ``end``) as a float number of epochs, or ``None``; a
    number written as a string (``"1e-1"``, which YAML 1.1 reads as a string) is taken.

    Raises:
        RecipeError: not a finite number >= 0 (the message starts with ``at`` and names ``key``).
    """
    if value is None:
        return None
    written = number_from_string(value)  # "1e-1": YAML 1.1 reads it as a string; a modifier's start takes it too
    value = written if written is not None else value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        msg = f"{at}: {key} must be a number of epochs or null, got {value!r}"
        raise RecipeError(msg)
    if not math.isfinite(value):
        msg = f"{at}: {key} must be a finite number of epochs or null, got {value!r}"
        raise RecipeError(msg)
    if value < 0:
        msg = f"{at}: {key} must be >= 0 epochs, got {value}" + (f": {NEGATIVE_END}" if key == "end" else "")
        raise RecipeError(msg)
    return float(value)


@attrs.define(eq=False)
class Stage:
    """One named stage: modifiers in recipe order.

    Attributes:
        name: the stage name.
        modifiers: modifier objects, in recipe order (a tuple is taken as a list).
        applied: the stage was already applied to a saved model; its modifiers do not run.
        start: epoch the stage starts at (a number >= 0, kept as a ``float``), or ``None``; modifiers may not start
            before it.
        end: epoch the stage ends at, after ``start``, or ``None``; modifiers may not end after it.
        run_type: llm-compressor's ``"oneshot"``, ``"post_train"`` or ``"train"``, or ``None``; recorded
            and written back, it does not change how the modifiers run (the caller's
            loop -- one-shot calibration or training -- fires their events).

    Raises (at construction, and again when a :class:`Recipe` is built from the stage):
        RecipeError: a value the recipe's dict form refuses, with its message (``start must be a number of epochs
            or null``, ``run_type must be oneshot or post_train or train``...): a name that is not a string,
            modifiers that are not a list of :class:`~llmc_fsm.Modifier` objects, ``applied`` not a bool, a modifier
            starting before the stage's ``start`` or ending after its ``end``. These were accepted, and failed later
            with an ``AttributeError`` or as a saved recipe.yaml that a session refused (found by a tester).
    """

    name: str
    modifiers: list[Modifier]
    applied: bool = False
    start: float | None = None
    end: float | None = None
    run_type: str | None = None

    def __attrs_post_init__(self) -> None:
        _check_stage(self, None)


def _label(m: Modifier) -> str:
    return m.modifier_name()


def _check_stage(stage: Stage, source: str | None) -> None:
    """Check ``stage`` as the recipe builder checks a stage of a dict (its messages); ``start``/``end`` are stored as
    floats, a tuple of modifiers as a list. ``source``: the recipe's, named first in a message (``None``: a stage
    built on its own).

    Raises:
        RecipeError: the first value refused (see :class:`Stage`).
    """
    if not isinstance(stage.name, str):
        msg = ("" if source is None else f"recipe {source}: ") + f"stage names must be strings, got {stage.name!r}"
        raise RecipeError(msg)
    at = ("" if source is None else f"recipe {source}, ") + f"stage {stage.name!r}"
    if isinstance(stage.modifiers, tuple):
        stage.modifiers = list(stage.modifiers)
    if not isinstance(stage.modifiers, list):
        wrap = f": wrap it in a list, [{_label(stage.modifiers)}(...)]" if isinstance(stage.modifiers, Modifier) else ""
        msg = f"{at}: modifiers must be a list of llmc_fsm.Modifier objects, got {type(stage.modifiers).__name__}{wrap}"
        raise RecipeError(msg)
    bad = next((m for m in stage.modifiers if not isinstance(m, Modifier)), None)
    if bad is not None:
        msg = (
            f"{at}: modifiers must be llmc_fsm.Modifier objects, got {bad!r}; for modifier names and arguments "
            "give a dict {stage: {Name: {arg: value}}} to resolve_recipe(...) or Session(...)"
        )
        raise RecipeError(msg)
    if not isinstance(stage.applied, bool):
        msg = f"{at}: applied must be true or false, got {stage.applied!r}"
        raise RecipeError(msg)
    if stage.run_type is not None and stage.run_type not in RUN_TYPES:
        msg = f"{at}: run_type must be {' or '.join(RUN_TYPES)} (as in llm-compressor), got {stage.run_type!r}"
        raise RecipeError(msg)
    stage.start = epoch_value(stage.start, at, "start")
    stage.end = epoch_value(stage.end, at, "end")
    if stage.start is not None and stage.end is not None and stage.end <= stage.start:
        msg = f"{at}: the stage's end ({stage.end}) must be after its start ({stage.start})"
        raise RecipeError(msg)
    for m in stage.modifiers:
        for key, (null, outside, rule) in WINDOW_EDGES.items():
            bound, value = getattr(stage, key), getattr(m, key, None)
            if bound is None or (value is not None and (value >= bound if key == "start" else value <= bound)):
                continue
            msg = (
                f"{at}, modifier {_label(m)}, argument {key!r}: the modifier {key}s at "
                f"{null if value is None else value}, {outside} its stage's {key} ({bound}); a modifier must {key} "
                f"{rule} its stage's {key}"
            )
            raise RecipeError(msg)


def _order_stage(stage: Stage, later: Mapping[str, str], source: str) -> list[Modifier]:
    """Stable topological order of one stage's modifiers under ``runs_after``.

    Recipe order is kept wherever the constraints allow (the ready modifier with
    the lowest recipe index goes first). ``later`` maps names only present in a
    later stage to that stage: running after them is impossible.
    """
    mods = stage.modifiers
    names = [_label(m) for m in mods]
    preds: list[set[int]] = []
    for i, m in enumerate(mods):
        wanted = set(m.runs_after)
        for name in sorted(wanted):
            if name in later and name not in names:
                msg = (
                    f"recipe {source}, stage {stage.name!r}, modifier {names[i]}: impossible order: it must run "
                    f"after {name} (runs_after), but {name} is only in the later stage {later[name]!r}. Move one "
                    "of them so that they share a stage or the order of stages matches."
                )
                raise RecipeError(msg)
        preds.append({j for j, n in enumerate(names) if n in wanted and j != i})
    succ: list[list[int]] = [[] for _ in mods]
    for i, ps in enumerate(preds):
        for j in ps:
            succ[j].append(i)
    indegree = [len(ps) for ps in preds]
    ready = [i for i, d in enumerate(indegree) if d == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for k in succ[i]:
            indegree[k] -= 1
            if indegree[k] == 0:
                heapq.heappush(ready, k)
    if len(order) < len(mods):
        left = {i for i in range(len(mods)) if i not in set(order)}
        node = min(left)
        path: list[int] = []
        while node not in path:
            path.append(node)
            node = min(j for j in preds[node] if j in left)
        cycle = [*path[path.index(node) :], node]
        text = " runs after ".join(names[i] for i in cycle)
        msg = (
            f"recipe {source}, stage {stage.name!r}: runs_after constraints form a cycle: {text}. "
            "No order satisfies them; remove one of the modifiers or split them into separate stages."
        )
        raise RecipeError(msg)
    return [mods[i] for i in order]


@attrs.define(eq=False)
class Recipe:
    """A resolved recipe.

    Attributes:
        stages: the stages, in recipe order.
        source: where it came from (a path, ``"<text>"``, ``"<dict>"``, ``"<objects>"``...).

    Raises (at construction):
        RecipeError: ``stages`` not a list (or tuple) of :class:`Stage` objects (a dict, YAML text, a path or
            modifiers are read by :func:`~llmc_fsm.recipes.building.resolve_recipe`; they failed with an
            ``AttributeError``, found by a tester), ``source`` not a string, a stage :class:`Stage` refuses (checked
            again: a stage may be changed after it was built), two stages of one name (a ``stages:`` mapping and a
            top-level stage of the same name: both ran, and the saved recipe, a mapping by stage name, kept one;
            found by a fuzzing tester), or the modifiers' ``runs_after`` constraints cannot be met.
    """

    stages: list[Stage] = attrs.field(factory=list)
    source: str = "<none>"

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.source, str):
            msg = f"Recipe: source must be a string naming where the recipe came from, got {self.source!r}"
            raise RecipeError(msg)
        if isinstance(self.stages, tuple):
            self.stages = list(self.stages)
        listed = isinstance(self.stages, list)
        wrong = [s for s in self.stages if not isinstance(s, Stage)] if listed else [self.stages]
        if wrong:
            bad = wrong[0]
            got = type(bad).__name__ + (" in the list" if listed else "")
            if isinstance(bad, Stage):  # one stage, not in a list
                hint = "; give [stage]"
            else:
                hint = (
                    "; read a dict, YAML text, a path or modifiers with llmc_fsm.recipes.building.resolve_recipe(...), "
                    "or give them to Session(...)"
                )
            if isinstance(bad, Modifier):
                hint += " (wrap modifier objects in a Stage: Recipe([Stage('default', [modifier, ...])]))"
            raise RecipeError(f"Recipe takes a list of Stage objects, got {got}{hint}")
        for stage in self.stages:
            _check_stage(stage, self.source)
        names = [stage.name for stage in self.stages]
        twice = next((name for name in names if names.count(name) > 1), None)
        if twice is not None:
            msg = f"recipe {self.source}: two stages are named {twice!r} (stage names are unique); rename one"
            raise RecipeError(msg)
        self.plan()

    def plan(self) -> list[tuple[Stage, list[Modifier]]]:
        """Each stage not yet applied with its modifiers in execution order.

        Within a stage, modifiers keep recipe order except where a ``runs_after``
        constraint moves one after the modifiers it names; a name not in the
        recipe is ignored, a name in an earlier stage is already satisfied.

        Raises:
            RecipeError: a ``runs_after`` cycle, or a modifier that must run after
                one that only appears in a later stage.
        """
        live = [stage for stage in self.stages if not stage.applied]
        result = []
        for index, stage in enumerate(live):
            later: dict[str, str] = {}
            for other in reversed(live[index + 1 :]):
                for m in other.modifiers:
                    later[_label(m)] = other.name
            result.append((stage, _order_stage(stage, later, self.source)))
        return result

    @property
    def modifiers(self) -> list[Modifier]:
        """Modifiers of the stages not yet applied, in execution order (see :meth:`plan`)."""
        return [m for _, modifiers in self.plan() for m in modifiers]

    def to_dict(self, *, applied: bool | Iterable[str] | None = None) -> dict[str, Any]:
        """The recipe as plain data (the long stage form), ready for YAML.

        Args:
            applied: ``None`` keeps each stage's ``applied`` flag; ``True`` marks
                every stage applied; a collection of stage names marks those
                (stages already applied stay applied).

        Modifier arguments are all the modifier's attrs init fields, defaults and
        ``None`` values included (a saved recipe records every value used, and reads
        back to equal arguments), except the schedule fields ``start``, ``end`` and
        ``update`` while ``None``; tuples and sets become lists,
        pydantic models (a compressed-tensors ``QuantizationScheme`` given as
        ``scheme``, the ``QuantizationArgs`` in one) the mapping of their given fields, an object with a
        ``to_recipe()`` method (an ``AWQMapping``) what it returns.

        Raises:
            RecipeError: an unknown stage name in ``applied``, or an argument value
                YAML cannot hold (the message names stage, modifier and argument).
        """
        names = {stage.name for stage in self.stages}
        if applied is None or isinstance(applied, bool):
            marked = names if applied else set()
        else:
            marked = set(applied)
            unknown = sorted(marked - names)
            if unknown:
                msg = f"recipe {self.source}: no stage named {', '.join(map(repr, unknown))}; stages: {sorted(names)}"
                raise RecipeError(msg)
        data: dict[str, Any] = {}
        for stage in self.stages:
            body: dict[str, Any] = {
                "modifiers": [{_label(m): _modifier_args(m, stage.name)} for m in stage.modifiers],
                "applied": stage.applied or stage.name in marked,
            }
            if stage.start is not None:
                body["start"] = stage.start
            if stage.end is not None:
                body["end"] = stage.end
            if stage.run_type is not None:
                body["run_type"] = stage.run_type
            data[stage.name] = body
        return data

    def to_yaml(self, *, applied: bool | Iterable[str] | None = None) -> str:
        """The recipe as YAML text that :func:`resolve_recipe` reads back (see :meth:`to_dict`)."""
        return yaml.safe_dump(self.to_dict(applied=applied), sort_keys=False, default_flow_style=False)


def _plain(value: Any, where: str) -> Any:
    """``value`` as YAML-safe data; a pydantic model (e.g. a compressed-tensors ``QuantizationScheme``) becomes
    the mapping of the fields that were given, in JSON form (unset and ``None`` fields left out); a numpy scalar
    (``np.str_("Linear")``, ``np.int64(8)``: YAML's safe writer refused them when the recipe was saved, after the
    work), an enum and a subclass of a plain type become the plain value."""
    if is_numpy_scalar(value):
        value = value.item()  # a numpy scalar (or a 0-d array) as the Python value
    if isinstance(value, enum.Enum):
        value = value.value
    if callable(getattr(value, "to_recipe", None)):  # an argument object that says its recipe form (AWQMapping)
        value = value.to_recipe()
    if value is None or type(value) in (bool, int, float, str):
        return value
    for plain in (bool, int, float, str):  # a subclass: np.float64, an IntEnum's value
        if isinstance(value, plain):
            return plain(value)
    pydantic = sys.modules.get("pydantic")  # no pydantic model can exist unless pydantic was imported
    if pydantic is not None and isinstance(value, pydantic.BaseModel):
        try:
            value = value.model_dump(mode="json", exclude_unset=True, exclude_none=True)
        except ValueError as err:  # pydantic_core.PydanticSerializationError
            msg = f"{where}: the {type(value).__name__} cannot be written to a YAML recipe: {err}"
            raise RecipeError(msg) from None
    if isinstance(value, list | tuple):
        return [_plain(v, where) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(_plain(v, where) for v in value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v, where) for k, v in value.items()}
    msg = f"{where}: a {type(value).__name__} cannot be written to a YAML recipe"
    raise RecipeError(msg)


def _modifier_args(m: Modifier, stage: str) -> dict[str, Any]:
    """Every argument ``m`` runs with (its attrs init fields, by recipe name), ``None`` values included, so that a
    saved recipe records each value used; the schedule fields only when set (unset: from the first event until
    finalize, what ``explain`` shows as the schedule)."""
    args: dict[str, Any] = {}
    for field in attrs.fields(type(m)):
        if not field.init:
            continue
        value = getattr(m, field.name)
        if value is None and field.name in SCHEDULE_FIELDS:  # unset schedule: shown by explain as the schedule
            continue
        where = f"stage {stage!r}, modifier {_label(m)}, argument {field.alias!r}"
        args[field.alias] = _plain(value, where)
    return args
