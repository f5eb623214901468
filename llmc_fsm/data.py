"""Text sources, token windows and the standard perplexity protocol.

The protocol used everywhere in this project (tests, benchmarks, and the peer
benchmark scripts, which load this very module) is:

1. concatenate the evaluation text (:func:`load_text`);
2. tokenize it once, without special tokens;
3. cut ``N`` non-overlapping consecutive windows of ``L`` tokens, from the head
   of the text (evaluation) or from its tail (calibration) -- :func:`token_windows`;
4. perplexity = ``exp`` of the mean next-token negative log-likelihood over all
   ``N * (L - 1)`` predicted positions -- :func:`perplexity`.

This module depends only on ``torch``, ``tqdm`` and (lazily, optionally)
``datasets``; it must stay importable on its own (the peer venv loads it by
file path, without the rest of the package).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["load_text", "perplexity", "token_windows"]

log = logging.getLogger(__name__)

_JSON_TYPES = {str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
_TEXT_SUFFIXES = {".txt", ".raw", ".text", ".md"}
_JSONL_SUFFIXES = {".jsonl", ".ndjson"}
# Characters per tokenizer call; splitting happens at line boundaries.
_CHUNK_CHARS = 1 << 16


def _read_utf8(path: Path) -> str:
    """The text of ``path`` decoded as UTF-8, with universal newlines (as ``Path.read_text``).

    Raises:
        ValueError: the file is not valid UTF-8; the message gives the file, the
            byte offset, line and column of the first bad byte, and what to do.
    """
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        # A plain ValueError (UnicodeDecodeError's constructor takes 5 arguments, so it cannot be re-raised
        # with a new message by callers that do ``type(err)(msg)``).
        raise ValueError(_decode_error_message(path, raw, err)) from None
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


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


def _jsonl_texts(path: Path, text: str) -> list[str]:
    parts: list[str] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            msg = f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})"
            raise ValueError(msg) from None
        parts.append(_record_text(record, f"{path}:{lineno}"))
    return parts


def _read_jsonl(path: Path) -> str:
    parts = _jsonl_texts(path, _read_utf8(path))
    if not parts:
        msg = f"{path}: no records found (empty JSONL file)"
        raise ValueError(msg)
    return "\n\n".join(parts)


def _read_json(path: Path) -> str:
    """A ``.json`` file: a JSON array of ``{"text": ...}`` objects, or JSON Lines of them."""
    text = _read_utf8(path)
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
    if not parts:
        msg = f"{path}: no records found; {expected}"
        raise ValueError(msg)
    return "\n\n".join(parts)


def _load_hf_dataset(source: str) -> str:
    hint = 'pass a local text file (.txt) or JSONL file with a "text" field instead'
    name, config, split = [*source.split(":"), None, None][:3]
    split = split or "test"
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        msg = (
            f"{source!r} is not an existing file; treating it as a Hugging Face dataset name needs the optional "
            f"`datasets` package, which is not installed; {hint}"
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


def load_text(source: str | os.PathLike[str]) -> str:
    """Return the text of ``source`` as one string.

    Args:
        source: one of

            * a path to a plain-text file (any suffix except ``.json``,
              ``.jsonl`` and ``.ndjson``), read as UTF-8 with universal
              newlines (``"\\r\\n"`` and ``"\\r"`` become ``"\\n"``), otherwise unchanged;
            * a path to a ``.jsonl`` / ``.ndjson`` file: the ``"text"`` field of
              every non-blank line, joined with a blank line (``"\\n\\n"``);
            * a path to a ``.json`` file: a JSON array of objects with a string
              ``"text"`` field (other fields are ignored), joined the same way;
              a ``.json`` file holding JSON Lines (as ``datasets``' ``to_json``
              writes) or a single such object is read too;
            * otherwise a Hugging Face dataset, ``name`` or ``name:config:split``
              (split defaults to ``test``), via the optional ``datasets``
              package; its ``"text"`` column is concatenated unchanged.

    Raises:
        FileNotFoundError: ``source`` looks like a file path (has a path
            separator or a known text suffix) but does not exist.
        ValueError: the file is not valid UTF-8 (the message gives file, byte
            offset, line and column); a JSON/JSONL file is not valid JSON, is not
            an array/lines of objects with a string ``"text"`` or has no record
            (the message gives file and line or element); or ``datasets`` is not
            installed.
        RuntimeError: the Hugging Face dataset could not be loaded (e.g. offline).
    """
    path = Path(source).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in _JSONL_SUFFIXES:
            return _read_jsonl(path)
        if suffix == ".json":
            return _read_json(path)
        return _read_utf8(path)
    text_source = os.fspath(source)
    looks_like_path = (
        isinstance(source, os.PathLike)
        or os.sep in text_source
        or (os.altsep is not None and os.altsep in text_source)
        or path.suffix.lower() in _TEXT_SUFFIXES | _JSONL_SUFFIXES | {".json"}
        or text_source.startswith(".")
    )
    if path.exists():  # a directory
        msg = f"{text_source!r} is a directory; pass a text or JSONL file"
        raise ValueError(msg)
    if looks_like_path:
        msg = f"text file not found: {text_source}"
        raise FileNotFoundError(msg)
    return _load_hf_dataset(text_source)


def _is_safe_cut(text: str, p: int) -> bool:
    """True when splitting ``text`` before index ``p`` cannot change byte-level BPE ids.

    With the GPT-2 pre-tokenizer regex a trailing whitespace run ``W`` at the end
    of a chunk is one pre-token.  In the full text ``W`` stays one pre-token when
    followed by ``" X"`` (``X`` not whitespace; the space joins ``X``), or when
    ``W`` is a single character followed directly by ``X``.
    """
    if p <= 0 or p >= len(text) or text[p - 1] != "\n":
        return False
    nxt = text[p]
    if nxt == " ":
        return p + 1 < len(text) and not text[p + 1].isspace()
    return not nxt.isspace() and (p < 2 or not text[p - 2].isspace())


def _chunks(text: str, size: int) -> Iterator[str]:
    """Split ``text`` into pieces of about ``size`` characters at :func:`_is_safe_cut` points."""
    start = 0
    n = len(text)
    while start < n:
        end = start + size
        if end >= n:
            yield text[start:]
            return
        cut = -1
        pos = end
        while True:  # backwards from ``end`` to ``start``
            nl = text.rfind("\n", start, pos)
            if nl < 0:
                break
            if _is_safe_cut(text, nl + 1):
                cut = nl + 1
                break
            pos = nl
        if cut < 0:  # forwards from ``end``
            pos = end
            while True:
                nl = text.find("\n", pos)
                if nl < 0:
                    cut = n
                    break
                if _is_safe_cut(text, nl + 1):
                    cut = nl + 1
                    break
                pos = nl + 1
        yield text[start:cut]
        start = cut


def _chunkable(tokenizer: Any) -> bool:
    """True for fast tokenizers whose only pre-processing is GPT-2 style byte-level BPE."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return False
    pre = backend.pre_tokenizer
    if type(pre).__name__ != "ByteLevel":
        return False
    return not getattr(pre, "add_prefix_space", True) and getattr(pre, "use_regex", False)


def _tokenize(tokenizer: Any, text: str) -> list[int]:
    # Silence "Token indices sequence length is longer than the specified maximum".
    old_max = getattr(tokenizer, "model_max_length", None)
    try:
        if old_max is not None:
            tokenizer.model_max_length = int(1e30)
        if not text:
            return []
        if not _chunkable(tokenizer):
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        pieces = list(_chunks(text, _CHUNK_CHARS))
        ids: list[int] = []
        for piece_ids in tokenizer(pieces, add_special_tokens=False)["input_ids"]:
            ids.extend(piece_ids)
        return ids
    finally:
        if old_max is not None:
            tokenizer.model_max_length = old_max


def token_windows(
    tokenizer: Any,
    text: str,
    *,
    num_windows: int,
    seq_len: int,
    from_end: bool = False,
) -> torch.LongTensor:
    """Tokenize ``text`` once and cut non-overlapping consecutive windows.

    The text is tokenized without special tokens (no BOS) and without the
    too-long-sequence warning.  For GPT-2 style byte-level BPE tokenizers (such
    as SmolLM2's) it is tokenized as a batch of ~64 KiB pieces split only at
    newlines where the split provably cannot change the ids (about 2x faster on
    2 cores, identical ids); other tokenizers get the whole text in one call.  Window ``i`` is ``ids[s + i*seq_len : s +
    (i+1)*seq_len]`` where ``s = 0`` (head, default) or ``s = len(ids) -
    num_windows*seq_len`` (``from_end=True``: the last ``num_windows*seq_len``
    tokens, used for calibration so it does not overlap head evaluation windows
    of a long enough text).

    Returns:
        ``torch.LongTensor`` of shape ``[num_windows, seq_len]`` (dtype int64, CPU).

    Raises:
        ValueError: ``tokenizer`` is ``None`` (e.g. a model directory without
            tokenizer files), ``num_windows`` or ``seq_len`` is not a positive
            int, or the text has fewer than ``num_windows * seq_len`` tokens (the
            message gives both numbers and what to lower).
    """
    if tokenizer is None:
        msg = (
            "text needs a tokenizer, but there is none (the model directory has no tokenizer files?); add the "
            "tokenizer files to the model directory, or pass token ids (a LongTensor [N, L]) instead of text"
        )
        raise ValueError(msg)
    for arg, value in (("num_windows", num_windows), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            msg = f"{arg} must be a positive int, got {value!r}"
            raise ValueError(msg)
    ids = _tokenize(tokenizer, text)
    needed = num_windows * seq_len
    if len(ids) < needed:
        fit = len(ids) // seq_len
        advice = (
            f"lower the number of windows (--num-samples / --eval-windows; at most {fit} fit at {seq_len} tokens) "
            "or the window length (--seq-len), or use a longer text"
            if fit
            else f"not even one window of {seq_len} tokens fits: use a longer text or a shorter --seq-len"
        )
        msg = f"the text has {len(ids)} tokens but {num_windows} windows x {seq_len} tokens need {needed}; {advice}"
        raise ValueError(msg)
    start = len(ids) - needed if from_end else 0
    flat = torch.tensor(ids[start : start + needed], dtype=torch.long)
    return flat.view(num_windows, seq_len)


def perplexity(
    model: torch.nn.Module,
    windows: torch.Tensor,
    *,
    batch_size: int = 1,
    progress: bool = True,
) -> float:
    """Perplexity of a causal LM on token windows: ``exp(mean next-token NLL)``.

    Each window is scored independently (labels = inputs, shifted by one inside
    the window), so ``N * (L - 1)`` positions contribute; the NLL is summed in
    float64 and averaged over all of them (not a mean of per-window means).

    Args:
        model: a causal LM; called as ``model(input_ids=LongTensor[B, L])`` and
            must return ``.logits`` (or a tuple whose first item is the logits)
            of shape ``[B, L, vocab]``.  Runs on the device of its first
            parameter; its train/eval mode is left unchanged (use eval mode).
        windows: ``LongTensor[N, L]`` from :func:`token_windows`, ``L >= 2``.
        batch_size: windows per forward pass (default 1: the ``[B, L, vocab]``
            float32 logits dominate peak memory, ~50 MB per 256-token window for
            a 49k vocabulary, and a larger batch is not faster on CPU).
        progress: show a tqdm progress bar (on stderr).

    Returns:
        The perplexity as a Python float.

    Raises:
        ValueError: ``windows`` is not a 2-D integer tensor with ``L >= 2`` and
            ``N >= 1``, or ``batch_size < 1``.
    """
    from tqdm.auto import tqdm

    if windows.ndim != 2 or windows.dtype not in (torch.int64, torch.int32):
        msg = (
            "windows must be an integer tensor of shape [num_windows, seq_len], "
            f"got {windows.dtype} {tuple(windows.shape)}"
        )
        raise ValueError(msg)
    n, length = windows.shape
    if n < 1 or length < 2:
        msg = f"need at least 1 window of at least 2 tokens, got shape {tuple(windows.shape)}"
        raise ValueError(msg)
    if batch_size < 1:
        msg = f"batch_size must be >= 1, got {batch_size}"
        raise ValueError(msg)
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    total_nll = 0.0
    count = 0
    with torch.inference_mode():
        for start in tqdm(range(0, n, batch_size), desc="perplexity", unit="batch", disable=not progress):
            batch = windows[start : start + batch_size].to(device=device, dtype=torch.long)
            out = model(input_ids=batch)
            logits = out.logits if hasattr(out, "logits") else out[0]
            for row in range(batch.shape[0]):  # per window: no [B*L, vocab] reshape copy
                nll = torch.nn.functional.cross_entropy(
                    logits[row, :-1, :].float(), batch[row, 1:], reduction="sum"
                )
                total_nll += float(nll.double())
            del out, logits
            count += batch.shape[0] * (length - 1)
    mean = total_nll / count
    ppl = math.exp(mean)
    log.debug("perplexity over %d windows x %d tokens: mean NLL %.5f, ppl %.4f", n, length, mean, ppl)
    return ppl
