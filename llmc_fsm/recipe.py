"""Recipes: named stages of modifiers with arguments.

Sources accepted by :func:`resolve_recipe`: ``None`` (no modifiers), a
:class:`Recipe`, a :class:`~llmc_fsm.Modifier` or a list of them (used as they
are, never round-tripped through text), a dict (whose stage bodies may also hold
modifier objects), YAML/JSON text, or a path to a ``.yaml``/``.yml``/``.json``
file. See ``docs/recipes.md`` for the format.

YAML is read with a :class:`yaml.SafeLoader` subclass (safe_load semantics: only
plain data, no Python objects, no ``eval``) that also records line numbers and
rejects duplicate keys, so errors can say where they are.
"""

from __future__ import annotations

import difflib
import heapq
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml

from llmc_fsm.errors import RecipeError
from llmc_fsm.modifier import Modifier

__all__ = ["STAGE_KEYS", "Recipe", "Stage", "load_recipe_data", "resolve_recipe"]

#: Keys of a stage's long form ``{modifiers: ..., applied: ..., start: ..., end: ...}``.
STAGE_KEYS: tuple[str, ...] = ("modifiers", "applied", "start", "end")


# --- YAML with line numbers ------------------------------------------------------------


class _Marked(dict):  # type: ignore[type-arg]
    """A mapping read from YAML: ``line`` of the mapping, ``key_lines[key]`` of each key (1-based)."""

    line: int | None = None
    key_lines: dict[Any, int]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key_lines = {}


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that records line numbers of mappings and keys and rejects duplicate keys."""


def _construct_mapping(loader: _RecipeLoader, node: yaml.MappingNode) -> Iterable[_Marked]:
    data = _Marked()
    data.line = node.start_mark.line + 1
    yield data
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=False)
        try:
            first = seen.get(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, "found an unhashable key", key_node.start_mark
            ) from None
        if first is not None:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r} (first at line {first}); every key must be unique",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line + 1
    data.update(loader.construct_mapping(node))
    data.key_lines = seen


_RecipeLoader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)


def _yaml_error(exc: yaml.YAMLError, source: str) -> RecipeError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    return RecipeError(f"recipe {source}{where}: not valid YAML/JSON: {problem}")


def _load_yaml(text: str, source: str) -> Any:
    loader = _RecipeLoader(text)
    docs: list[tuple[int, Any]] = []
    try:
        while loader.check_node():
            node = loader.get_node()
            docs.append((node.start_mark.line + 1, loader.construct_document(node)))
    finally:
        loader.dispose()
    content = [(line, data) for line, data in docs if data is not None]
    if len(content) > 1:
        lines = ", ".join(str(line) for line, _ in content)
        msg = (
            f"recipe {source} holds {len(content)} YAML documents (starting at lines {lines}): YAML front matter "
            "and several documents separated by '---' are not supported. Put all stages in one mapping, in one "
            "document."
        )
        raise RecipeError(msg)
    return content[0][1] if content else None


def load_recipe_data(text: str, source: str = "<text>") -> Any:
    """Parse recipe ``text`` (YAML or JSON) into plain data, with line numbers where YAML gives them.

    JSON that YAML cannot read (tabs, for example) is read with :func:`json.loads`.

    Raises:
        RecipeError: not valid YAML/JSON (with the line), or several YAML documents.
    """
    try:
        return _load_yaml(text, source)
    except yaml.YAMLError as exc:
        error = _yaml_error(exc, source)
        if not (source.endswith(".json") or text.lstrip().startswith(("{", "["))):
            raise error from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        msg = f"recipe {source}, line {exc.lineno}, column {exc.colno}: not valid JSON: {exc.msg}"
        raise RecipeError(msg) from None


# --- the resolved recipe ------------------------------------------------------------------


@attrs.define(eq=False)
class Stage:
    """One named stage: modifiers in recipe order.

    Attributes:
        name: the stage name.
        modifiers: modifier objects, in recipe order.
        applied: the stage was already applied to a saved model; its modifiers do not run.
        start: epoch the stage starts at, or ``None``; modifiers may not start before it.
        end: epoch the stage ends at, or ``None``; modifiers may not end after it.
    """

    name: str
    modifiers: list[Modifier]
    applied: bool = False
    start: float | None = None
    end: float | None = None


def _label(m: Modifier) -> str:
    return m.modifier_name()


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
        RecipeError: the modifiers' ``runs_after`` constraints cannot be met.
    """

    stages: list[Stage] = attrs.field(factory=list)
    source: str = "<none>"

    def __attrs_post_init__(self) -> None:
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

        Modifier arguments are all the modifier's attrs init fields (defaults
        included, so a saved recipe shows every setting used) except those that
        are ``None`` by default and still ``None``; tuples and sets become lists.

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
            data[stage.name] = body
        return data

    def to_yaml(self, *, applied: bool | Iterable[str] | None = None) -> str:
        """The recipe as YAML text that :func:`resolve_recipe` reads back (see :meth:`to_dict`)."""
        return yaml.safe_dump(self.to_dict(applied=applied), sort_keys=False, default_flow_style=False)


def _plain(value: Any, where: str) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v, where) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(_plain(v, where) for v in value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v, where) for k, v in value.items()}
    msg = f"{where}: a {type(value).__name__} cannot be written to a YAML recipe"
    raise RecipeError(msg)


def _modifier_args(m: Modifier, stage: str) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for field in attrs.fields(type(m)):
        if not field.init:
            continue
        value = getattr(m, field.name)
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory(m) if default.takes_self else default.factory()
        if value is None and default is None:  # unset schedule fields and the like
            continue
        where = f"stage {stage!r}, modifier {_label(m)}, argument {field.alias!r}"
        args[field.alias] = _plain(value, where)
    return args


# --- building -------------------------------------------------------------------------------


def _where(source: str, line: int | None, stage: str | None = None, modifier: str | None = None,
           argument: str | None = None) -> str:
    parts = [f"recipe {source}"]
    if line is not None:
        parts.append(f"line {line}")
    if stage is not None:
        parts.append(f"stage {stage!r}")
    if modifier is not None:
        parts.append(f"modifier {modifier}")
    if argument is not None:
        parts.append(f"argument {argument!r}")
    return ", ".join(parts)


def _line(container: Any, key: Any = None) -> int | None:
    if not isinstance(container, _Marked):
        return None
    if key is not None and key in container.key_lines:
        return container.key_lines[key]
    return container.line


def _failing_argument(exc: BaseException, cls: type, given: Mapping[str, Any]) -> str | None:
    """Best guess of the argument an attrs validator/converter refused.

    attrs' own validators pass the attribute in the exception; otherwise the
    first argument the message names, else the first argument whose converter
    alone refuses its value.
    """
    for arg in exc.args[1:2]:
        if isinstance(arg, attrs.Attribute):
            return arg.alias or arg.name
    text = str(exc)
    found = []
    for name in list(given):
        for quoted in (f"'{name}'", f"{name} ", f"{name}:", f"({name})", f"{name}="):
            pos = text.find(quoted)
            if pos >= 0 and (pos == 0 or not (text[pos - 1].isalnum() or text[pos - 1] == "_")):
                found.append((pos, name))
                break
    if found:
        return min(found)[1]
    for field in attrs.fields(cls):
        alias = field.alias or field.name
        if alias in given and field.converter is not None:
            try:
                field.converter(given[alias])
            except Exception:
                return alias
    return None


def _epoch(value: Any, where: str, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"{where}: {key} must be a number of epochs or null, got {value!r}"
        raise RecipeError(msg)
    if value < 0:
        msg = f"{where}: {key} must be >= 0 epochs, got {value}"
        raise RecipeError(msg)
    return float(value)


class _Builder:
    def __init__(self, source: str) -> None:
        self.source = source

    def recipe(self, data: Any) -> Recipe:
        source = self.source
        if data is None or (isinstance(data, Mapping | list) and not data):
            msg = (
                f"recipe {source} is empty: give at least one stage with a modifier "
                "(for a session without modifiers, pass recipe=None)"
            )
            raise RecipeError(msg)
        if isinstance(data, list):
            msg = (
                f"recipe {source}, line {_line(data) or 1}: the top level must map stage names to modifiers, "
                "got a list; put it under a stage name, e.g. `default:` followed by the list"
            )
            raise RecipeError(msg)
        if not isinstance(data, Mapping):
            msg = f"recipe {source}: the top level must map stage names to modifiers, got {type(data).__name__}"
            if isinstance(data, str) and "\n" not in data:
                msg += f" (if {data!r} is meant to be a file, it does not exist)"
            raise RecipeError(msg)
        stages = [self.stage(name, body, _line(data, name)) for name, body in data.items()]
        try:
            return Recipe(stages, source)
        except RecipeError:
            raise
        except Exception as exc:  # pragma: no cover - defensive: a broken runs_after attribute
            raise RecipeError(f"recipe {source}: {exc}") from exc

    def stage(self, name: Any, body: Any, line: int | None) -> Stage:
        source = self.source
        if not isinstance(name, str):
            msg = f"{_where(source, line)}: stage names must be strings, got {name!r}"
            raise RecipeError(msg)
        where = _where(source, line, name)
        applied = False
        start = end = None
        if isinstance(body, Mapping) and any(k in body for k in STAGE_KEYS):
            if "modifiers" not in body:
                present = [k for k in STAGE_KEYS if k in body]
                msg = (
                    f"{where}: a stage with {', '.join(map(repr, present))} must list its modifiers under "
                    "'modifiers:' (long form: modifiers, applied, start, end)"
                )
                raise RecipeError(msg)
            extra = [k for k in body if k not in STAGE_KEYS]
            if extra:
                msg = (
                    f"{_where(source, _line(body, extra[0]), name)}: unknown stage key(s) "
                    f"{', '.join(map(repr, extra))}; the long form accepts {', '.join(STAGE_KEYS)}"
                )
                raise RecipeError(msg)
            applied = body.get("applied", False)
            if not isinstance(applied, bool):
                msg = f"{_where(source, _line(body, 'applied'), name)}: applied must be true or false, got {applied!r}"
                raise RecipeError(msg)
            start = _epoch(body.get("start"), _where(source, _line(body, "start"), name), "start")
            end = _epoch(body.get("end"), _where(source, _line(body, "end"), name), "end")
            if start is not None and end is not None and end <= start:
                where = _where(source, _line(body, "end"), name)
                msg = f"{where}: the stage's end ({end}) must be after its start ({start})"
                raise RecipeError(msg)
            line = _line(body, "modifiers") or line
            body = body["modifiers"]
        entries = self.entries(body, name, line)
        stage = Stage(name, [], applied, start, end)
        for mod_name, args, mod_line in entries:
            stage.modifiers.append(self.modifier(mod_name, args, stage, mod_line))
        return stage

    def entries(self, body: Any, stage: str, line: int | None) -> list[tuple[str, Any, int | None]]:
        source = self.source
        shape = (
            "a stage maps modifier names to arguments ({Name: {arg: value}}), or lists entries "
            "(- Name: {arg: value}, or - Name)"
        )
        items: list[tuple[str, Any, int | None]] = []
        if body is None:
            pass
        elif isinstance(body, Modifier):
            items.append((_label(body), body, line))
        elif isinstance(body, Mapping):
            items.extend((key, args, _line(body, key)) for key, args in body.items())
        elif isinstance(body, Sequence) and not isinstance(body, str | bytes):
            for entry in body:
                if isinstance(entry, Modifier):
                    items.append((_label(entry), entry, line))
                elif isinstance(entry, str):
                    items.append((entry, None, line))
                elif isinstance(entry, Mapping) and len(entry) == 1:
                    ((key, args),) = entry.items()
                    items.append((key, args, _line(entry, key)))
                else:
                    where = _where(source, _line(entry) or line, stage)
                    msg = f"{where}: each list entry must be one modifier ({shape}), got {entry!r}"
                    raise RecipeError(msg)
        else:
            msg = f"{_where(source, line, stage)}: {shape}; got {body!r}"
            raise RecipeError(msg)
        if not items:
            msg = f"{_where(source, line, stage)}: the stage has no modifiers; remove the stage or add a modifier"
            raise RecipeError(msg)
        for key, _, key_line in items:
            if not isinstance(key, str):
                msg = f"{_where(source, key_line, stage)}: modifier names must be strings, got {key!r}"
                raise RecipeError(msg)
        return items

    def modifier(self, name: str, args: Any, stage: Stage, line: int | None) -> Modifier:
        if isinstance(args, Modifier):
            modifier = args
        else:
            modifier = self.build(name, args, stage, line)
        self.check_window(modifier, stage, line, args)
        return modifier

    def build(self, name: str, args: Any, stage: Stage, line: int | None) -> Modifier:
        from llmc_fsm.plugins import get_registry

        source = self.source
        registry = get_registry()
        if name not in registry:
            raise RecipeError(f"{_where(source, line, stage.name)}: {registry.unknown_message(name)}")
        cls = registry.get(name)
        where = _where(source, line, stage.name, name)
        if args is None:
            args = {}  # an empty body means "all defaults"
        if not isinstance(args, Mapping):
            msg = (
                f"{where}: arguments must be a mapping of argument names to values (or empty for all "
                f"defaults), got {type(args).__name__} {args!r}"
            )
            raise RecipeError(msg)
        fields = [a for a in attrs.fields(cls) if a.init]
        accepted = [a.alias or a.name for a in fields]
        for key in args:
            if not isinstance(key, str) or key not in accepted:
                close = difflib.get_close_matches(str(key), accepted, n=1, cutoff=0.6)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                msg = (
                    f"{_where(source, _line(args, key) or line, stage.name, name)}: unknown argument {key!r}.{hint} "
                    f"{name} accepts: {', '.join(accepted)}"
                )
                raise RecipeError(msg)
        kwargs = dict(args)
        if stage.start is not None and "start" in accepted and "start" not in kwargs:
            kwargs["start"] = stage.start
        if stage.end is not None and "end" in accepted and "end" not in kwargs:
            kwargs["end"] = stage.end
        try:
            return cls(**kwargs)
        except Exception as exc:
            argument = _failing_argument(exc, cls, kwargs)
            arg_line = _line(args, argument) if argument is not None else None
            text = str(exc.args[0]) if len(exc.args) > 1 and isinstance(exc.args[1], attrs.Attribute) else str(exc)
            msg = f"{_where(source, arg_line or line, stage.name, name, argument)}: {type(exc).__name__}: {text}"
            raise RecipeError(msg) from exc

    def check_window(self, m: Modifier, stage: Stage, line: int | None, args: Any) -> None:
        start, end = getattr(m, "start", None), getattr(m, "end", None)
        if stage.start is not None and (start is None or start < stage.start):
            where = _where(self.source, _line(args, "start") or line, stage.name, _label(m))
            shown = "null (the first event)" if start is None else start
            msg = (
                f"{where}, argument 'start': the modifier starts at {shown}, before its stage's start "
                f"({stage.start}); a modifier must start at or after its stage's start"
            )
            raise RecipeError(msg)
        if stage.end is not None and (end is None or end > stage.end):
            where = _where(self.source, _line(args, "end") or line, stage.name, _label(m))
            shown = "null (finalize)" if end is None else end
            msg = (
                f"{where}, argument 'end': the modifier ends at {shown}, after its stage's end "
                f"({stage.end}); a modifier must end at or before its stage's end"
            )
            raise RecipeError(msg)


def _looks_like_path(recipe: Any) -> bool:
    if isinstance(recipe, os.PathLike):
        return True
    return (
        isinstance(recipe, str)
        and "\n" not in recipe
        and (recipe.strip().endswith((".yaml", ".yml", ".json")) or os.path.isfile(recipe))
    )


def resolve_recipe(recipe: Any) -> Recipe:
    """Parse and validate ``recipe`` into a :class:`Recipe` with modifier objects.

    Args:
        recipe: ``None``, a :class:`Recipe`, a Modifier or list of Modifiers, a
            dict, YAML/JSON text, or a path (``str`` or ``os.PathLike``) to a
            ``.yaml``/``.yml``/``.json`` file.

    Raises:
        RecipeError: unreadable source, bad structure, unknown modifier or argument,
            an invalid argument value, a modifier outside its stage's window, or an
            impossible ``runs_after`` order; the message names the source, line
            (where YAML gives it), stage, modifier and argument.
    """
    if recipe is None:
        return Recipe()
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, Modifier):
        recipe = [recipe]
    if isinstance(recipe, Mapping):
        return _Builder("<dict>").recipe(recipe)
    if _looks_like_path(recipe):
        path = Path(recipe)
        if not path.is_file():
            msg = f"recipe file {str(path)!r} does not exist"
            raise RecipeError(msg)
        source = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            msg = f"recipe {source}: cannot be read: {exc}"
            raise RecipeError(msg) from None
        return _Builder(source).recipe(load_recipe_data(text, source))
    if isinstance(recipe, str):
        return _Builder("<text>").recipe(load_recipe_data(recipe, "<text>"))
    if isinstance(recipe, Sequence) and not isinstance(recipe, bytes):
        bad = [m for m in recipe if not isinstance(m, Modifier)]
        if bad:
            msg = (
                f"a recipe list must contain only llmc_fsm.Modifier objects, got {bad[0]!r}; "
                "use a dict {stage: [...]} for modifier names and arguments"
            )
            raise RecipeError(msg)
        if not recipe:
            return Recipe(source="<objects>")
        return Recipe([Stage("default", list(recipe))], "<objects>")
    msg = f"unsupported recipe type {type(recipe).__name__}: pass a path, YAML text, a dict or a list of Modifiers"
    raise RecipeError(msg)
