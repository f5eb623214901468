"""Building a :class:`~llmc_fsm.recipes.model.Recipe` from parsed recipe data: stages, modifiers, arguments.

Input is what :func:`llmc_fsm.recipes.loading.load_recipe_data` returns (or a
dict given by the caller); every error names the source, line (where YAML gave
it), stage, modifier and argument. Both the llmc-fsm shapes and llm-compressor's
nesting are read (see ``docs/recipes.md``); llm-compressor's argument names are
translated by :mod:`llmc_fsm.recipes.llmcompressor`.
"""

from __future__ import annotations

import difflib
import re
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from llmc_fsm.core.errors import PluginError, RecipeError
from llmc_fsm.core.modifier import Modifier
from llmc_fsm.core.registry import check_modifier_class, get_registry
from llmc_fsm.recipes.llmcompressor import (
    GROUP_SUFFIX,
    RUN_TYPES,
    is_group_key,
    namesake_arguments,
    namesake_note,
    top_level_stages,
    translate_argument,
    unimplemented_note,
)
from llmc_fsm.recipes.loading import line_of, load_recipe_data, looks_like_path, read_recipe_file, shown
from llmc_fsm.recipes.model import STAGE_KEYS, WINDOW_EDGES, Recipe, Stage, epoch_value

__all__ = ["RecipeProblems", "build_recipe", "given_arguments"]

_SHAPE = (
    "a stage maps modifier names to arguments ({Name: {arg: value}}), or lists entries "
    "(- Name: {arg: value}, or - Name)"
)
_LONG_FORM = (
    f"{', '.join(STAGE_KEYS)} and llm-compressor modifier groups ('<group>_modifiers', e.g. 'pruning_modifiers')"
)
#: The longest problem message kept whole (longer ones, a long value repeated, are cut in the middle).
_LONGEST = 1000


#: A modifier's window edge -> (how an omitted value reads, where it may not lie, the rule) for check_window.
def where(
    source: str, line: int | None, stage: str | None = None, modifier: str | None = None, argument: str | None = None
) -> str:
    """``"recipe SOURCE, line N, stage 'S', modifier M, argument 'A'"`` with the parts that are known."""
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


#: ``(argument, modifier)`` -> why ``null`` is refused: llm-compressor 0.14 refuses ``ignore: null`` / ``targets:
#: null`` (its pydantic lists) except SmoothQuant's ``ignore`` (``list | None``: no module ignored, taken here as
#: ``[]``); a blank ``ignore:`` meant ``[]`` (lm_head compressed) to some modifiers here and the default to others.
_NULL_REFUSED: dict[tuple[str, str], str] = {
    (key, name): (
        "null is not a list of module patterns (llm-compressor refuses it): give [] to compress every target "
        "(lm_head too), or leave ignore out for the modifier's default"
        if key == "ignore"
        else "null is not a list of module patterns (llm-compressor refuses it): name the modules, or leave "
        "targets out for the modifier's default"
    )
    for key in ("ignore", "targets")
    for name in (
        "SparseGPTModifier", "WandaPruningModifier", "MagnitudePruningModifier", "ConstantPruningModifier",
        "REAPPruningModifier", "QuantizationModifier", "GPTQModifier", "AutoRoundModifier", "AWQModifier",
        "SmoothQuantModifier", "SpinQuantModifier",
    )
    if (key, name) != ("ignore", "SmoothQuantModifier")
}  # fmt: skip


class RecipeProblems(RecipeError):
    """Several problems in one recipe, reported together (one line each) so that one run finds them all.

    Attributes:
        problems: each problem as the :class:`RecipeError` it would be alone (its message names the
            source, line, stage, modifier and argument; a value a modifier refused keeps that
            exception as ``__cause__``), modifier by modifier in recipe order.
    """

    def __init__(self, source: str, problems: Sequence[RecipeError]) -> None:
        self.problems = tuple(problems)
        lines = [f"recipe {source} has {len(problems)} problems; fix them all, then run it again:"]
        for problem in problems:
            text = str(problem)
            for prefix in (f"recipe {source}, ", f"recipe {source}: "):
                text = text.removeprefix(prefix)
            lines.append(f"  - {text}")
        super().__init__("\n".join(lines))


#: id of a modifier built from recipe data -> (a weak reference to it, the arguments the recipe gave it, in
#: llmc-fsm names); keyed by id because a modifier class may define ``__eq__`` (attrs' default) and so no hash.
_GIVEN: dict[int, tuple[weakref.ref[Modifier], frozenset[str]]] = {}


def _set_given(modifier: Modifier, given: frozenset[str]) -> None:
    key = id(modifier)
    _GIVEN[key] = (weakref.ref(modifier, lambda _: _GIVEN.pop(key, None)), given)


def given_arguments(modifier: Modifier) -> frozenset[str] | None:
    """The arguments (llmc-fsm names) a recipe gave ``modifier``; ``None`` when it was not built from recipe data.

    Every other argument of a modifier built from a recipe has its default. A GPTQModifier that took a
    QuantizationModifier's config (llm-compressor's idiom) counts that modifier's arguments as given too.
    """
    ref, given = _GIVEN.get(id(modifier), (None, None))
    return given if ref is not None and ref() is modifier else None


def build_recipe(data: Any, source: str) -> Recipe:
    """Build and validate a recipe from plain data (see the module docs).

    Every modifier's arguments are checked before the error is raised: unknown
    argument names, refused llm-compressor arguments, values a modifier refuses
    (each argument that fails is set aside and the modifier built again without
    it, to find the next), unknown modifiers and modifiers outside their stage's
    window, unknown stage keys and bad stage-key values are collected over the
    whole recipe. One problem raises its own
    :class:`RecipeError`; several raise one :class:`RecipeProblems` listing
    them all. A structural problem (a stage that is not a mapping...) ends the
    reading there, listed after the problems found before it.

    Raises:
        RecipeError: bad structure, unknown modifier or argument, an invalid
            argument value, a modifier outside its stage's window, or an
            impossible ``runs_after`` order.
        RecipeProblems: (a ``RecipeError``) several of those.
    """
    if data is None or (isinstance(data, Mapping | list) and not data):
        msg = (
            f"recipe {source} is empty: give at least one stage with a modifier "
            "(for a Session without modifiers, pass Session(recipe=None))"
        )
        raise RecipeError(msg)
    if isinstance(data, list):
        entries = all(isinstance(item, str | Mapping) for item in data)  # modifier entries ("- Name: {...}")
        hint = "put it under a stage name, e.g. `default:` followed by the list" if entries else _SHAPE
        msg = (
            f"recipe {source}, line {line_of(data) or 1}: the top level must map stage names to modifiers, "
            f"got a list; {hint}"
        )
        raise RecipeError(msg)
    if not isinstance(data, Mapping):
        msg = f"recipe {source}: the top level must map stage names to modifiers, got {type(data).__name__}"
        if isinstance(data, str) and not source.startswith("<"):  # a file of plain text (a data file given?)
            msg += " (the file holds plain text, not a YAML or JSON mapping of stages)"
        elif isinstance(data, str) and "\n" not in data:
            shown = data if len(data) <= 80 else data[:77] + "..."
            msg += f" (if {shown!r} is meant to be a file, it does not exist)"
        raise RecipeError(msg)
    builder = _Builder(source)
    try:
        stages = [builder.stage(name, body, line) for name, body, line in top_level_stages(data, source)]
    except RecipeError as exc:  # the structure stops the reading: the problems found so far, then this one
        if not builder.problems:
            raise
        builder.problems.append(exc)
        builder.lines.append(None)
    if builder.problems:
        if len(builder.problems) == 1:
            raise builder.problems[0]
        raise RecipeProblems(source, builder.problems)
    if not stages:
        msg = f"recipe {source} has no stages (only metadata); give at least one stage with a modifier"
        raise RecipeError(msg)
    return Recipe(stages, source)


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


def _beside_name(entry: Mapping[Any, Any]) -> bool:
    """Whether a list entry of several keys is a modifier name without arguments followed by arguments at its
    indent (``- SparseGPTModifier:`` then ``sparsity: 0.7`` under the dash, not further in)."""
    first, *rest = entry
    return (
        isinstance(first, str)
        and (first in get_registry() or first[:1].isupper())
        and entry[first] is None
        and all(isinstance(k, str) and not k[:1].isupper() for k in rest)
    )


def _group_key_typo(name: str) -> str | None:
    """``quant_modifiers`` for a misspelt group key such as ``quant_modifers`` (lower case, ending in ``_mod...``);
    else ``None``."""
    found = re.fullmatch(r"([a-z0-9_]+?)_?mod[a-z]*", name)
    if found is None or name.endswith(GROUP_SUFFIX) or not found[1]:
        return None
    return f"{found[1]}{GROUP_SUFFIX}"


def _takes(modifier: str, argument: str) -> bool:
    """Whether registered modifier ``modifier`` has the argument ``argument``."""
    cls = get_registry().classes.get(modifier)
    return cls is not None and attrs.has(cls) and any((a.alias or a.name) == argument for a in attrs.fields(cls))


def _is_long_form(body: Any) -> bool:
    return isinstance(body, Mapping) and any(k in STAGE_KEYS or is_group_key(k) for k in body)


class _Builder:
    """Builds stages and modifiers for one recipe source."""

    def __init__(self, source: str) -> None:
        self.source = source
        #: problems found so far, each as the error it would raise alone (see :func:`build_recipe`)
        self.problems: list[RecipeError] = []
        self.lines: list[int | None] = []  # the line of each problem, where known (orders a modifier's problems)
        #: ``[(modifier name, arguments)]`` before the entry being built, in its stage (an argument dedented
        #: beside an empty modifier is named as that modifier's)
        self.before: list[tuple[str, Any]] = []

    def problem(self, msg: str, cause: BaseException | None = None, line: int | None = None) -> None:
        """Record one problem (raised together with the others at the end of the recipe); a message longer than
        :data:`_LONGEST` characters (a long value repeated in it) is cut in its middle."""
        if len(msg) > _LONGEST:
            cut = len(msg) - _LONGEST + 5
            msg = f"{msg[: _LONGEST // 2]} ... {msg[_LONGEST // 2 + cut :]}"
        error = RecipeError(msg)
        if cause is not None:
            error.__cause__ = cause
        self.problems.append(error)
        self.lines.append(line)

    # --- stages -------------------------------------------------------------------------
    def stage(self, name: Any, body: Any, line: int | None) -> Stage:
        if not isinstance(name, str):
            msg = f"{where(self.source, line)}: stage names must be strings, got {name!r}"
            raise RecipeError(msg)
        stage = Stage(name, [])
        parts = self.long_form(stage, body, line) if _is_long_form(body) else [(body, line)]
        entries = [entry for part, part_line in parts for entry in self.entries(part, name, part_line)]
        if not entries:
            first_line = parts[0][1] if parts else line
            at = where(self.source, first_line, name)
            raise RecipeError(f"{at}: the stage has no modifiers; remove the stage or add a modifier")
        for i, (mod_name, args, mod_line) in enumerate(entries):
            self.before = [(m, m_args) for m, m_args, _ in entries[:i]]
            modifier = self.modifier(mod_name, args, stage, mod_line)
            if modifier is None:  # its problems are recorded
                continue
            take = getattr(modifier, "take_stage_config", None)  # e.g. a bare GPTQModifier after a quantization config
            if callable(take):
                try:
                    kept = take(list(stage.modifiers), name)
                except ValueError as exc:
                    self.problem(f"{where(self.source, mod_line, name, mod_name)}: {exc}")
                    continue
                taken = [m for m in stage.modifiers if all(k is not m for k in kept)]
                own = given_arguments(modifier)
                if taken and own is not None:
                    _set_given(modifier, own.union(*(given_arguments(m) or () for m in taken)))
                stage.modifiers = kept
            stage.modifiers.append(modifier)
        return stage

    def long_form(self, stage: Stage, body: Mapping[Any, Any], line: int | None) -> list[tuple[Any, int | None]]:
        """Read the stage keys into ``stage``; return the modifier parts ``[(body, line)]`` in key order.

        A stage without modifier parts raises; an unknown stage key or a bad value of one is recorded as a
        problem (the value left at its default), so that the stage's modifiers are still checked."""
        name, source = stage.name, self.source
        parts = [
            (value, line_of(body, key) or line)
            for key, value in body.items()
            if key == "modifiers" or is_group_key(key)
        ]
        if not parts:
            present = [k for k in STAGE_KEYS if k in body]
            msg = (
                f"{where(source, line, name)}: a stage with {', '.join(map(repr, present))} must list its modifiers "
                f"under 'modifiers:' or llm-compressor groups such as 'pruning_modifiers:' (long form: {_LONG_FORM})"
            )
            raise RecipeError(msg)
        extra = [k for k in body if k not in STAGE_KEYS and not is_group_key(k)]
        if extra:
            hint = ""
            if all(isinstance(k, str) and k[:1].isupper() for k in extra):
                groups = [k for k in body if k == "modifiers" or is_group_key(k)]
                hint = (
                    f" (modifier names go under {groups[0]!r} here: indent them under it)"
                    if len(groups) == 1
                    else " (modifier names go under 'modifiers:' when a stage has stage keys)"
                )
            msg = (
                f"{where(source, line_of(body, extra[0]), name)}: unknown stage key(s) "
                f"{', '.join(map(repr, extra))}{hint}; the long form accepts {_LONG_FORM}"
            )
            self.problem(msg, line=line_of(body, extra[0]))
        # a stage key with a bad value is a problem; the stage is read on without it (its modifiers are checked)
        stage.applied = body.get("applied", False)
        if not isinstance(stage.applied, bool):
            at = where(source, line_of(body, "applied"), name)
            self.problem(f"{at}: applied must be true or false, got {stage.applied!r}")
            stage.applied = False
        stage.run_type = body.get("run_type")
        if stage.run_type is not None and stage.run_type not in RUN_TYPES:
            at = where(source, line_of(body, "run_type"), name)
            self.problem(
                f"{at}: run_type must be {' or '.join(RUN_TYPES)} (as in llm-compressor), got {stage.run_type!r}"
            )
            stage.run_type = None
        for key in ("start", "end"):
            try:
                setattr(stage, key, epoch_value(body.get(key), where(source, line_of(body, key), name), key))
            except RecipeError as exc:
                self.problems.append(exc)
                self.lines.append(line_of(body, key))
        if stage.start is not None and stage.end is not None and stage.end <= stage.start:
            at = where(source, line_of(body, "end"), name)
            self.problem(f"{at}: the stage's end ({stage.end}) must be after its start ({stage.start})")
            stage.end = None
        return parts

    def entries(self, body: Any, stage: str, line: int | None) -> list[tuple[str, Any, int | None]]:
        """``[(modifier name, arguments or object, line)]`` of one modifier part (mapping or list)."""
        items: list[tuple[str, Any, int | None]] = []
        if body is None:
            pass
        elif isinstance(body, Modifier):
            items.append((body.modifier_name(), body, line))
        elif isinstance(body, Mapping):
            items.extend((key, args, line_of(body, key)) for key, args in body.items())
        elif isinstance(body, Sequence) and not isinstance(body, str | bytes):
            for entry in body:
                if isinstance(entry, Modifier):
                    items.append((entry.modifier_name(), entry, line))
                elif isinstance(entry, str):
                    items.append((entry, None, line))
                elif isinstance(entry, Mapping) and len(entry) == 1:
                    ((key, args),) = entry.items()
                    items.append((key, args, line_of(entry, key)))
                elif isinstance(entry, Mapping) and entry and _beside_name(entry):
                    name, *args = entry
                    at = where(self.source, line_of(entry) or line, stage)
                    msg = (
                        f"{at}: the list entry {name} has its arguments ({', '.join(map(str, args))}) beside its "
                        f"name, at the same indent: indent the arguments under the name (- {name}:, then each "
                        "argument two spaces further in)"
                    )
                    raise RecipeError(msg)
                else:
                    at = where(self.source, line_of(entry) or line, stage)
                    raise RecipeError(f"{at}: each list entry must be one modifier ({_SHAPE}), got {shown(entry)}")
        else:
            raise RecipeError(f"{where(self.source, line, stage)}: {_SHAPE}; got {shown(body)}")
        for key, _, key_line in items:
            if not isinstance(key, str):
                msg = f"{where(self.source, key_line, stage)}: modifier names must be strings, got {key!r}"
                raise RecipeError(msg)
        return items

    # --- modifiers ------------------------------------------------------------------------
    def modifier(self, name: str, args: Any, stage: Stage, line: int | None) -> Modifier | None:
        """The modifier of one entry, or ``None`` when it has problems (recorded)."""
        if isinstance(args, Modifier) and args.modifier_name() != name:  # ran the object's class silently (a tester)
            msg = (
                f"{where(self.source, line, stage.name)}: the key {name!r} maps to a {args.modifier_name()} object: "
                f"the key names the modifier, so write {args.modifier_name()!r} as the key, or give a {name}"
            )
            self.problem(msg)
            return None
        modifier = args if isinstance(args, Modifier) else self.build(name, args, stage, line)
        if modifier is None:
            return None
        try:  # as registration checks a class: an object given directly, or a field-level events set per instance
            check_modifier_class(modifier, require_attrs=not isinstance(args, Modifier))
        except PluginError as exc:
            self.problem(f"{where(self.source, line, stage.name)}: {exc}", exc)
            return None
        if not self.check_window(modifier, stage, line, args):
            return None
        return modifier

    def build(self, name: str, args: Any, stage: Stage, line: int | None) -> Modifier | None:
        """Build modifier ``name`` from the recipe's ``args``; ``None`` when it has problems (each recorded, in
        the order of their lines)."""
        known = len(self.problems)
        modifier = self.build_checked(name, args, stage, line)
        found = sorted(zip(self.lines[known:], self.problems[known:], strict=True), key=lambda p: p[0] or line or 0)
        self.lines[known:] = [at for at, _ in found]
        self.problems[known:] = [error for _, error in found]
        return modifier

    def build_checked(self, name: str, args: Any, stage: Stage, line: int | None) -> Modifier | None:

        registry = get_registry()
        if name not in registry and stage.name in registry:  # {"QuantizationModifier": {"scheme": ...}}
            msg = (
                f"{where(self.source, line, stage.name)}: {stage.name!r} is a modifier, not a stage: a recipe maps "
                f"stage names to their modifiers, e.g. {{'my_stage': {{'{stage.name}': {{{name!r}: ...}}}}}}"
            )
            raise RecipeError(msg)
        if name not in registry:
            at = where(self.source, line, stage.name)
            group = _group_key_typo(name)
            if group is not None:
                msg = (
                    f"{at}: unknown modifier or group {name!r}: llm-compressor modifier group keys end in "
                    f"{GROUP_SUFFIX!r}; did you mean {group!r}?"
                )
                self.problem(msg)
                return None
            owner = next((m for m, m_args in reversed(self.before) if m_args is None and _takes(m, name)), None)
            if owner is not None:
                msg = (
                    f"{at}: {name!r} is not a modifier but an argument of {owner}, which has no arguments here: "
                    f"indent it under {owner} (two spaces further in)"
                )
                self.problem(msg)
                return None
            self.problem(f"{at}: {registry.unknown_message(name, unimplemented_note(name))}")
            return None
        cls = registry.get(name)
        if args is None:
            args = {}  # an empty body means "all defaults"
        if not isinstance(args, Mapping):
            msg = (
                f"{where(self.source, line, stage.name, name)}: arguments must be a mapping of argument names to "
                f"values (or empty for all defaults), got {type(args).__name__} {args!r}"
            )
            self.problem(msg)
            return None
        known = len(self.problems)
        kwargs, given_as = self.arguments(cls, name, args, stage, line)
        given = frozenset(kwargs)
        accepted = {a.alias or a.name for a in attrs.fields(cls) if a.init}
        if stage.start is not None and "start" in accepted and "start" not in kwargs:
            kwargs["start"] = stage.start
        if stage.end is not None and "end" in accepted and "end" not in kwargs:
            kwargs["end"] = stage.end
        while True:
            try:
                modifier = cls(**kwargs)
            except Exception as exc:
                argument = _failing_argument(exc, cls, kwargs)
                if len(self.problems) > known and (argument is None or argument not in given):
                    # after an argument was set aside, a failure no given argument explains may be a
                    # consequence of setting it aside: the problems found so far are reported
                    return None
                self.refused(exc, argument, cls, name, args, given_as, stage, line)
                if argument is None or argument not in kwargs:
                    return None
                del kwargs[argument]  # build again without it: the next argument the modifier refuses, if any
                continue
            if len(self.problems) > known:
                return None
            _set_given(modifier, given)
            return modifier

    def refused(
        self,
        exc: Exception,
        argument: str | None,
        cls: type,
        name: str,
        args: Mapping[str, Any],
        given_as: Mapping[str, str],
        stage: Stage,
        line: int | None,
    ) -> None:
        """Record ``cls(**kwargs)``'s refusal ``exc`` of ``argument`` (``None``: not known) as a problem."""
        key = given_as.get(argument, argument) if argument is not None else None
        arg_line = line_of(args, key) if key is not None else None
        text = str(exc.args[0]) if len(exc.args) > 1 and isinstance(exc.args[1], attrs.Attribute) else str(exc)
        for value in args.values():  # a long value the modifier repeats is shown cut (a 200 KB string: a tester's)
            if len(repr(value)) > 80:
                text = text.replace(repr(value), shown(value))
        at = where(self.source, arg_line or line, stage.name, name, argument)
        if key != argument:
            at += f" (given as {key!r})"
        kind = "" if type(exc) is ValueError else f"{type(exc).__name__}: "  # a plain bad value needs no label
        self.problem(f"{at}: {kind}{text}", exc, arg_line)

    def arguments(
        self, cls: type[Modifier], name: str, args: Mapping[str, Any], stage: Stage, line: int | None
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """``(kwargs, {kwarg: recipe key it came from})``: llm-compressor names translated; an unknown or refused
        argument is recorded as a problem and left out."""
        accepted = [a.alias or a.name for a in attrs.fields(cls) if a.init]
        kwargs: dict[str, Any] = {}
        given_as: dict[str, str] = {}
        unknown = [key for key in args if isinstance(key, str) and key not in accepted]
        theirs = namesake_arguments(name, unknown)  # llm-compressor's arguments of its different modifier of this name
        if theirs:
            key_line = line_of(args, theirs[0]) or line
            msg = (
                f"{where(self.source, key_line, stage.name, name)}: unknown argument{'s' if len(theirs) > 1 else ''} "
                f"{', '.join(repr(key) for key in theirs)}. {namesake_note(name, theirs)}"
            )
            self.problem(msg, line=key_line)
        for key, value in args.items():
            if key in theirs:  # said above, once for all of them
                continue
            key_line = line_of(args, key) or line
            at = where(self.source, key_line, stage.name, name)
            is_field = isinstance(key, str) and key in accepted
            if value is None and is_field and (key, name) in _NULL_REFUSED:  # a blank entry (a tester's case)
                self.problem(f"{at}, argument {key!r}: {_NULL_REFUSED[key, name]}", line=key_line)
                continue
            try:
                translated = (
                    None if not isinstance(key, str) else translate_argument(name, key, value, args, is_field=is_field)
                )
            except ValueError as exc:
                self.problem(f"{at}, argument {key!r}: {exc}", line=key_line)
                continue
            if translated is None and is_field:
                kwargs[key] = value
                continue
            if translated is None:
                close = difflib.get_close_matches(str(key), accepted, n=1, cutoff=0.6)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                msg = f"{at}: unknown argument {key!r}.{hint} {name} accepts: {', '.join(accepted)}"
                self.problem(msg, line=key_line)
                continue
            for target, new in translated.items():
                if target not in accepted:
                    msg = f"{at}, argument {key!r}: it maps to {target!r}, which {name} does not accept"
                    self.problem(msg, line=key_line)
                    continue
                if target in args and target != key and args[target] != new:
                    msg = f"{at}, argument {key!r}: it sets {target!r} to {new!r}, but {target!r} is also given"
                    self.problem(msg, line=key_line)
                    continue
                kwargs[target] = new
                if target != key:
                    given_as[target] = key
        return kwargs, given_as

    def check_window(self, m: Modifier, stage: Stage, line: int | None, args: Any) -> bool:
        """Whether the modifier's ``start``/``end`` lie inside its stage's window (each edge outside: a problem)."""
        inside = True
        for key, (null, outside, rule) in WINDOW_EDGES.items():
            bound, value = getattr(stage, key), getattr(m, key, None)
            if bound is None or (value is not None and (value >= bound if key == "start" else value <= bound)):
                continue
            at = where(self.source, line_of(args, key) or line, stage.name, m.modifier_name())
            msg = (
                f"{at}, argument {key!r}: the modifier {key}s at {null if value is None else value}, {outside} its "
                f"stage's {key} ({bound}); a modifier must {key} {rule} its stage's {key}"
            )
            self.problem(msg)
            inside = False
        return inside


def resolve_recipe(recipe: Any) -> Recipe:
    """Parse and validate ``recipe`` into a :class:`Recipe` with modifier objects.

    Args:
        recipe: ``None``, a :class:`Recipe`, a Modifier or list of Modifiers, a
            dict, YAML/JSON text, or a path (``str`` or ``os.PathLike``) to a
            ``.yaml``/``.yml``/``.json`` file.

    Raises:
        RecipeError: unreadable source (missing file, a directory, not UTF-8), bad
            structure, unknown modifier or argument, an invalid argument value, a
            modifier outside its stage's window, or an impossible ``runs_after``
            order; the message names the source, line (where YAML gives it),
            stage, modifier and argument.
    """
    if recipe is None:
        return Recipe()
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, Modifier):
        recipe = [recipe]
    if isinstance(recipe, Mapping):
        return build_recipe(recipe, "<dict>")
    if looks_like_path(recipe):
        text, source = read_recipe_file(recipe)
        return build_recipe(load_recipe_data(text, source), source)
    if isinstance(recipe, str):
        return build_recipe(load_recipe_data(recipe, "<text>"), "<text>")
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
        for modifier in recipe:  # as registration checks a class (a misspelt event would never be delivered)
            try:
                check_modifier_class(modifier, stacklevel=3, require_attrs=False)  # a warning: at Session(...)
            except PluginError as exc:
                raise RecipeError(f"{where('<objects>', None, 'default')}: {exc}") from exc
        return Recipe([Stage("default", list(recipe))], "<objects>")
    msg = f"unsupported recipe type {type(recipe).__name__}: pass a path, YAML text, a dict or a list of Modifiers"
    raise RecipeError(msg)
