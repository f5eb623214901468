"""Readers for the text sources of :func:`llmc_fsm.data.protocol.load_text`: UTF-8 text, JSON, JSON Lines, HF datasets.

Like :mod:`llmc_fsm.data.protocol` this module depends only on the standard library (and, lazily and optionally, on
``datasets``): the peer benchmark scripts load ``data.py`` by file path, and ``data.py`` loads this file the same way.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

__all__ = [
    "JSONL_SUFFIXES",
    "TABLE_SUFFIXES",
    "TEXT_SUFFIXES",
    "jsonl_records",
    "load_hf_dataset",
    "read_json",
    "read_jsonl",
    "read_utf8",
]

_JSON_TYPES = {str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
TEXT_SUFFIXES = frozenset({".txt", ".raw", ".text", ".md"})
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
#: Files of rows and columns, refused as calibration text (their header, quotes and separators would be tokenized).
TABLE_SUFFIXES = frozenset({".csv", ".tsv", ".parquet", ".arrow", ".feather"})


def read_utf8(path: Path) -> str:
    """The text of ``path`` decoded as UTF-8, with universal newlines (as ``Path.read_text``); a leading UTF-8 byte
    order mark is dropped (it would be tokenized as a character).

    Raises:
        ValueError: the file is not valid UTF-8, or holds NUL bytes (a UTF-16 file of ASCII text decodes as UTF-8
            with a NUL after every character: it was calibrated on as such, found by a tester); the message gives
            the file, the byte offset, line and column of the first bad byte, and what to do.
    """
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        # A plain ValueError (UnicodeDecodeError's constructor takes 5 arguments, so it cannot be re-raised
        # with a new message by callers that do ``type(err)(msg)``).
        raise ValueError(_decode_error_message(path, raw, err)) from None
    if "\x00" in text:
        raise ValueError(_nul_message(path, raw))
    text = text.removeprefix("\ufeff")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def _nul_message(path: Path, raw: bytes) -> str:
    offset = raw.index(b"\x00")
    line = raw.count(b"\n", 0, offset) + 1
    column = len(raw[raw.rfind(b"\n", 0, offset) + 1 : offset].decode("utf-8")) + 1  # valid UTF-8 before it
    return (
        f"{path}: not a text file: it holds NUL bytes (the first at byte offset {offset}, line {line}, column "
        f"{column}): UTF-16 text or binary data; pass a UTF-8 text file (e.g. `iconv -f utf-16 -t utf-8 FILE > "
        'FILE.utf8`), or a JSON/JSONL file of {"text": ...} records'
    )


def _decode_error_message(path: Path, raw: bytes, err: UnicodeDecodeError) -> str:
    offset = err.start
    line_start = raw.rfind(b"\n", 0, offset) + 1
    line = raw.count(b"\n", 0, offset) + 1
    column = len(raw[line_start:offset].decode("utf-8")) + 1  # everything before ``offset`` decodes
    where = f"byte 0x{raw[offset]:02x} at byte offset {offset} (line {line}, column {column})"
    if b"\x00" in raw[:8192]:
        return (
            f"{path}: not a text file: it holds binary data (NUL bytes) and is not valid UTF-8: {where}; "
            'pass a UTF-8 text file, or a JSON/JSONL file of {"text": ...} records'
        )
    return (
        f"{path}: not UTF-8 text: {where} is invalid ({err.reason}); text files must be UTF-8: convert it, "
        "e.g. `iconv -f latin1 -t utf-8 FILE > FILE.utf8`"
    )


def _record_text(record: Any, where: str) -> str:
    if not isinstance(record, dict) or "text" not in record:
        msg = f'{where}: expected a JSON object with a "text" field'
        raise ValueError(msg)
    text = record["text"]
    if not isinstance(text, str):
        msg = f'{where}: the "text" field must be a string, got {type(text).__name__}'
        raise ValueError(msg)
    return text


def jsonl_records(path: Path, text: str) -> list[tuple[int, Any]]:
    """``(line number, parsed value)`` of every non-blank line of ``text`` (the contents of ``path``).

    Raises:
        ValueError: a line is not valid JSON (``{path}:{line}: invalid JSON (... at column N)``).
    """
    records: list[tuple[int, Any]] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            records.append((lineno, json.loads(line)))
        except json.JSONDecodeError as exc:
            msg = f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})"
            raise ValueError(msg) from None
    return records


def _jsonl_texts(path: Path, text: str) -> list[str]:
    return [_record_text(record, f"{path}:{lineno}") for lineno, record in jsonl_records(path, text)]


def _joined(path: Path, parts: list[str], hint: str) -> str:
    """The records' texts joined with a blank line; ``ValueError`` (``no records found`` + ``hint``) for none."""
    if not parts:
        msg = f"{path}: no records found{hint}"
        raise ValueError(msg)
    return "\n\n".join(parts)


def read_jsonl(path: Path) -> str:
    """The ``"text"`` field of every non-blank line of a JSON Lines file, joined with ``"\\n\\n"``.

    Raises:
        ValueError: the file is not UTF-8, a line is not valid JSON or not an object with a string
            ``"text"`` (the message gives file and line), or the file has no record.
    """
    return _joined(path, _jsonl_texts(path, read_utf8(path)), " (empty JSONL file)")


def read_json(path: Path) -> str:
    """The texts of a ``.json`` file (a JSON array of ``{"text": ...}`` objects, one such object, or JSON Lines).

    Raises:
        ValueError: the file is not UTF-8 or not valid JSON, an element is not an object with a string
            ``"text"`` (the message gives file and element), or there is no record.
    """
    text = read_utf8(path)
    expected = 'expected a JSON array of {"text": ...} objects, or JSON Lines (one such object per line)'
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg != "Extra data":  # several top-level values: JSON Lines under a .json name
            msg = f"{path}: invalid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); {expected}"
            raise ValueError(msg) from None
        parts = _jsonl_texts(path, text)
    else:
        if isinstance(document, dict):  # one record (also valid JSON Lines)
            if not isinstance(document.get("text"), str):
                keys = ", ".join(map(repr, list(document)[:5])) or "none"
                msg = f'{path}: {expected}; got one object without a string "text" field (keys: {keys})'
                raise ValueError(msg)
            document = [document]
        if not isinstance(document, list):
            msg = f"{path}: {expected}; got a JSON {_JSON_TYPES.get(type(document), 'value')}"
            raise ValueError(msg)
        parts = [_record_text(record, f"{path}: element [{i}]") for i, record in enumerate(document)]
    return _joined(path, parts, f"; {expected}")


def load_hf_dataset(source: str) -> str:
    """The ``"text"`` column of a Hugging Face dataset ``name[:config[:split]]`` (split ``test`` by default), joined.

    Raises:
        ValueError: the optional ``datasets`` package is not installed, or the dataset has no ``"text"`` column.
        RuntimeError: ``datasets.load_dataset`` failed (unknown name, offline, ...).
    """
    hint = 'pass a local text file (.txt) or JSONL file with a "text" field instead'
    name, config, split = [*source.split(":"), None, None][:3]
    split = split or "test"
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        msg = (
            f"{source!r} is not an existing file; treating it as a Hugging Face dataset name needs the optional "
            f"`datasets` package, which is not installed (pip install datasets); {hint}"
        )
        raise ValueError(msg) from None
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as exc:  # network errors, unknown names, offline mode, ...
        msg = (
            f"could not load the Hugging Face dataset {source!r} (name:config:split) "
            f"({type(exc).__name__}: {exc}); {hint}"
        )
        raise RuntimeError(msg) from None
    if "text" not in ds.column_names:
        msg = f'the Hugging Face dataset {source!r} has no "text" column (columns: {ds.column_names}); {hint}'
        raise ValueError(msg)
    return "".join(ds["text"])
