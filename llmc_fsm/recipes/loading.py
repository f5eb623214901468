"""Reading recipe text: YAML/JSON with line numbers, recipe files and paths.

YAML is read with a :class:`yaml.SafeLoader` subclass (``safe_load`` semantics:
plain data only, no Python objects, no ``eval``) that also records the line of
every mapping and key and rejects duplicate keys, so later errors can say where
they are. Nothing here knows about stages or modifiers (see
:mod:`llmc_fsm.recipes.building`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from llmc_fsm.core.errors import RecipeError

__all__ = [
    "RECIPE_SUFFIXES",
    "MarkedDict",
    "line_of",
    "load_recipe_data",
    "looks_like_path",
    "read_recipe_file",
    "shown",
]

#: File suffixes read as recipes.
RECIPE_SUFFIXES: tuple[str, ...] = (".yaml", ".yml", ".json")


class MarkedDict(dict):  # type: ignore[type-arg]
    """A mapping read from YAML: ``line`` of the mapping, ``key_lines[key]`` of each key (1-based)."""

    line: int | None = None
    key_lines: dict[Any, int]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key_lines = {}


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters with ``...`` (an error line never repeats a long value whole)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def line_of(container: Any, key: Any = None) -> int | None:
    """The 1-based line of ``key`` in ``container`` (or of the container), if it was read from YAML."""
    if not isinstance(container, MarkedDict):
        return None
    if key is not None and key in container.key_lines:
        return container.key_lines[key]
    return container.line


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that records line numbers of mappings and keys, rejects duplicate keys, and turns any
    failure of a value's constructor (``!!bool maybe``: a ``KeyError``; ``!!int ""``: an ``IndexError``) into a
    :class:`yaml.constructor.ConstructorError` at that value's line and column."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (yaml.YAMLError, RecursionError):
            raise
        except Exception:
            tag = node.tag.removeprefix("tag:yaml.org,2002:")
            value = node.value if isinstance(node, yaml.ScalarNode) else f"<{node.id}>"
            problem = (
                f"the value {shown(value)} tagged !!{tag} is not a valid {tag}; write a valid {tag} or remove the tag"
            )
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None


def _construct_mapping(loader: _RecipeLoader, node: yaml.MappingNode) -> Iterable[MarkedDict]:
    data = MarkedDict()
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
    data.update(
        (key, value) for key, value in loader.construct_mapping(node).items() if not isinstance(value, _NotProvided)
    )
    data.key_lines = seen


_RecipeLoader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)

#: Python object tags llm-compressor's saved recipe.yaml holds (it dumps its modifiers with ``yaml.dump``), read as
#: the plain value they wrap; nothing is imported or called, and any other Python object tag stays refused
#: (``safe_load``): compressed-tensors' string enums (``actorder:
#: !!python/object/apply:compressed_tensors.quantization.quant_args.ActivationOrdering [static]``) and
#: ``torch.device`` (AWQ's ``offload_device: !!python/object/apply:torch.device [cpu]``) as their string.
_APPLY = "tag:yaml.org,2002:python/object/apply:"
_STRING_OBJECTS = frozenset(
    {
        "compressed_tensors.quantization.quant_args.ActivationOrdering",
        "compressed_tensors.quantization.quant_args.QuantizationStrategy",
        "compressed_tensors.quantization.quant_args.QuantizationType",
        "compressed_tensors.quantization.quant_args.DynamicType",
        "compressed_tensors.config.base.CompressionFormat",
        "compressed_tensors.quantization.quant_config.QuantizationStatus",
        "torch.device",
    }
)


#: llm-compressor's marker of an argument left at its default (``offload_device:
#: !!python/object/apply:llmcompressor.sentinel.Sentinel [not_provided, <path of its sentinel.py>]``, GPTQ's
#: ``actorder`` [static, ...]): what its recipe.yaml holds for a modifier saved before it was initialized
_SENTINEL = "llmcompressor.sentinel.Sentinel"


class _NotProvided:
    """A value saved as llm-compressor's :data:`_SENTINEL`: its key is left out of the mapping holding it (the
    argument takes this project's default, as it took llm-compressor's)."""


def _construct_apply(loader: _RecipeLoader, suffix: str, node: yaml.Node) -> str | _NotProvided:
    """One of :data:`_STRING_OBJECTS` as llm-compressor saves it, read as its string (``"static"``, ``"cpu"``);
    its :data:`_SENTINEL` as :class:`_NotProvided` (a mapping drops the key)."""
    values = loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode) else None
    if suffix == _SENTINEL and values and all(isinstance(v, str) for v in values):
        return _NotProvided()
    if suffix not in _STRING_OBJECTS or not values or len(values) != 1 or not isinstance(values[0], str):
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"could not determine a constructor for the tag {_APPLY}{suffix} (read: the string enums of "
            f"compressed-tensors and torch.device, as [value])",
            node.start_mark,
        )
    return values[0]


def _construct_tuple(loader: _RecipeLoader, node: yaml.Node) -> list[Any]:
    """``!!python/tuple`` (llm-compressor saves SmoothQuant's inferred mappings so) as a list: plain data."""
    return loader.construct_sequence(node, deep=True)


_RecipeLoader.add_multi_constructor(_APPLY, _construct_apply)
_RecipeLoader.add_constructor("tag:yaml.org,2002:python/tuple", _construct_tuple)


def _yaml_error(exc: yaml.YAMLError, source: str, text: str) -> RecipeError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    if isinstance(exc, yaml.reader.ReaderError) and isinstance(exc.character, int):  # a NUL, a control character:
        start = text.rfind("\n", 0, exc.position) + 1  # its two-line text named "<unicode string>" (a tester's case)
        where = f", line {text.count(chr(10), 0, exc.position) + 1}, column {exc.position - start + 1}"
        problem = f"character U+{exc.character:04X} ({exc.reason}); save the recipe as plain UTF-8 text"
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

    Mappings come back as :class:`MarkedDict` (a ``dict``); JSON that YAML cannot
    read (tabs, for example) is read with :func:`json.loads` (plain dicts, no lines).

    Raises:
        RecipeError: not valid YAML/JSON (with the line), a key given twice in one mapping, or several YAML documents.
    """
    try:
        return _load_yaml(text, source)
    except RecursionError:
        raise _too_deep(source) from None
    except yaml.YAMLError as exc:
        error = _yaml_error(exc, source, text)
        if not (source.endswith(".json") or text.lstrip().startswith(("{", "["))):
            raise error from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise _too_deep(source) from None
    except json.JSONDecodeError as exc:
        msg = f"recipe {source}, line {exc.lineno}, column {exc.colno}: not valid JSON: {exc.msg}"
        raise RecipeError(msg) from None
    except _DuplicateKey as exc:  # as YAML refuses them (JSON's own reading keeps the last value, silently)
        msg = f"recipe {source}: found duplicate key {exc.args[0]!r} in a JSON object; every key must be unique"
        raise RecipeError(msg) from None


def _too_deep(source: str) -> RecipeError:
    return RecipeError(
        f"recipe {source}: not valid YAML/JSON: it nests mappings or lists too deeply to be read (past Python's "
        "recursion limit); a recipe nests a few levels: stage, group, modifier, arguments"
    )


class _DuplicateKey(Exception):
    """A JSON object with a key twice (:func:`_unique_keys`)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def looks_like_path(recipe: Any) -> bool:
    """Whether ``recipe`` names a file or directory rather than holding YAML text.

    True for ``os.PathLike`` objects and for one-line strings that end in a
    recipe suffix or name an existing file or directory.
    """
    if isinstance(recipe, os.PathLike):
        return True
    if not isinstance(recipe, str) or "\n" in recipe or not recipe.strip():
        return False
    return recipe.strip().endswith(RECIPE_SUFFIXES) or os.path.exists(os.path.expanduser(recipe))


def read_recipe_file(path: str | os.PathLike[str]) -> tuple[str, str]:
    """Read a recipe file (``~`` expanded, as for the model, dataset and output paths); return ``(text, source)``
    where ``source`` is the path as given.

    Raises:
        RecipeError: the path does not exist, is a directory (or anything but a
            file), or cannot be read / is not UTF-8.
    """
    source = str(Path(path))
    file = Path(path).expanduser()
    if file.is_dir():
        msg = (
            f"recipe {source!r} is a directory; expected a recipe file ({', '.join(RECIPE_SUFFIXES)}), "
            "e.g. a recipe.yaml inside it"
        )
        raise RecipeError(msg)
    if not file.exists():
        msg = f"recipe file {source!r} does not exist"
        raise RecipeError(msg)
    if not file.is_file():
        msg = f"recipe {source!r} is not a regular file; expected a recipe file ({', '.join(RECIPE_SUFFIXES)})"
        raise RecipeError(msg)
    try:
        return file.read_text(encoding="utf-8"), source
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        msg = f"recipe {source}, line {line}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x}); save it as UTF-8"
        raise RecipeError(msg) from None
    except OSError as exc:
        msg = f"recipe {source}: cannot be read: {exc.strerror or exc}"
        raise RecipeError(msg) from None
