"""docs/recipes.md is tested: every YAML example resolves, every error shown is the exact message.

Conventions in the markdown (HTML comments, invisible when rendered), each on the
line before a fenced block:

* ``<!-- file: NAME -->`` before a ```` ```yaml ```` block: the recipe is written to
  ``NAME`` and resolved from that path (so messages name it); without it the
  block is resolved as text and must succeed unless an error block follows.
* ``<!-- error -->`` before a ```` ```text ```` block: the exact ``RecipeError`` of
  the YAML block just before it.
* ``<!-- error-of-path: NAME/ -->``: the exact error of resolving ``NAME`` when it
  is a directory.
* ``<!-- select-targets: {"targets": [...], "ignore": [...]} -->``: the exact
  ``ValueError`` of :func:`llmc_fsm.toolkit.targets.select_targets` on a tiny Llama with
  tied embeddings.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import attrs
import pytest

from llmc_fsm import RecipeError
from llmc_fsm.recipes.building import resolve_recipe
from llmc_fsm.recipes.llmcompressor import ARGUMENT_RULES

DOC = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
_MARKER = re.compile(r"<!--\s*(?P<kind>[\w-]+)(?::\s*(?P<arg>.*?))?\s*-->\s*$")


@attrs.frozen
class Block:
    lang: str
    body: str
    marker: str | None
    arg: str | None
    line: int


def blocks() -> list[Block]:
    text = DOC.read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip().splitlines()
        marker = _MARKER.search(before[-1]) if before else None
        found.append(
            Block(
                lang=match["lang"],
                body=textwrap.dedent(match["body"]),
                marker=marker["kind"] if marker else None,
                arg=marker["arg"] if marker else None,
                line=text[: match.start()].count("\n") + 1,
            )
        )
    return found


def cases() -> list[tuple[Block, Block | None]]:
    """Each YAML block with the error block that follows it (or None)."""
    items = blocks()
    result = []
    for i, block in enumerate(items):
        if block.lang == "yaml":
            nxt = items[i + 1] if i + 1 < len(items) else None
            result.append((block, nxt if nxt is not None and nxt.marker == "error" else None))
    return result


@pytest.fixture(autouse=True)
def real_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed plugins, freshly loaded (other tests may have swapped the registry)."""
    from llmc_fsm.core import registry as plugins

    monkeypatch.setattr(plugins, "_REGISTRY", None)
    monkeypatch.delenv(plugins.DISABLE_ENV, raising=False)


def test_the_doc_has_examples_of_each_kind():
    kinds = [b.marker for b in blocks()]
    assert len(cases()) >= 7
    assert kinds.count("error") >= 5 and "error-of-path" in kinds and "select-targets" in kinds


@pytest.mark.parametrize(("block", "error"), cases(), ids=lambda c: f"line{c.line}" if isinstance(c, Block) else "")
def test_yaml_example(block: Block, error: Block | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    source: str = block.body
    if block.marker == "file":
        Path(block.arg).write_text(block.body, encoding="utf-8")
        source = block.arg
    if error is None:
        assert resolve_recipe(source).stages
        return
    with pytest.raises(RecipeError) as info:
        resolve_recipe(source)
    assert str(info.value) == error.body.strip()


def test_directory_error_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (block,) = [b for b in blocks() if b.marker == "error-of-path"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / block.arg).mkdir()
    with pytest.raises(RecipeError) as info:
        resolve_recipe(block.arg.rstrip("/"))
    assert str(info.value) == block.body.strip()


def test_select_targets_examples() -> None:
    from test_targets import llama

    from llmc_fsm.toolkit.targets import select_targets

    for block in [b for b in blocks() if b.marker == "select-targets"]:
        args = json.loads(block.arg)
        with pytest.raises(ValueError) as info:
            select_targets(llama(tied=True), args["targets"], args["ignore"])
        assert str(info.value) == block.body.strip()


def _table_rows() -> list[list[str]]:
    text = DOC.read_text(encoding="utf-8").split("### Argument names", 1)[1].split("\n\n")
    table = next(part for part in text if part.startswith("| modifier |"))
    return [[c.strip() for c in row.strip("|").split("|")] for row in table.splitlines()[2:]]


def test_argument_table_matches_the_code() -> None:
    in_doc = set()
    for modifiers, arguments, here, _why in _table_rows():
        mods = list(ARGUMENT_RULES) if modifiers == "every modifier" else modifiers.split(", ")
        for mod in mods:
            for arg in arguments.replace("`", "").split(", "):
                in_doc.add((mod, arg))
                rule = ARGUMENT_RULES[mod][arg]
                if here == "ignored":
                    assert rule.action == "ignore" and set(rule.accept) <= {True, False}, (mod, arg)
                elif here == "refused":
                    assert rule.action == "refuse" and not rule.accept, (mod, arg)
                elif here.endswith(" only"):
                    assert rule.accept and rule.action in ("ignore", "refuse"), (mod, arg)
                elif rule.action == "value":
                    assert here.startswith("`{") and f"→ `{arg}`" in here, (mod, arg)
                else:
                    assert rule.action == "rename" and f"`{rule.target}`" in here, (mod, arg)
    in_code = {(mod, arg) for mod, rules in ARGUMENT_RULES.items() for arg in rules}
    assert in_doc == in_code
