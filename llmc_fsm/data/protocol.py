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
file path, without the rest of the package).  The file readers live in
``text_files.py`` next to it, loaded by :func:`_sibling` (by file path too when
this module was).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["load_text", "perplexity", "token_windows"]

logger = logging.getLogger(__name__)

# Characters per tokenizer call; splitting happens at line boundaries.
_CHUNK_CHARS = 1 << 16


def _sibling(name: str) -> Any:
    """The module ``llmc_fsm.<name>``; loaded by file path when this file itself was (the peer benchmarks)."""
    if __package__:
        return importlib.import_module(f"{__package__}.{name}")
    key = f"{__name__}.{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
        if spec is None or spec.loader is None:
            msg = f"cannot load {name}.py next to {__file__}"
            raise ImportError(msg)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


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
    files = _sibling("text_files")
    path = Path(source).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in files.JSONL_SUFFIXES:
            return files.read_jsonl(path)
        if suffix == ".json":
            return files.read_json(path)
        return files.read_utf8(path)
    text_source = os.fspath(source)
    looks_like_path = (
        isinstance(source, os.PathLike)
        or os.sep in text_source
        or (os.altsep is not None and os.altsep in text_source)
        or path.suffix.lower() in files.TEXT_SUFFIXES | files.JSONL_SUFFIXES | {".json"}
        or text_source.startswith(".")
    )
    if path.exists():  # a directory, a device, a pipe...
        what = "a directory" if path.is_dir() else "not a regular file"
        msg = f"{text_source!r} is {what}; pass a text or JSONL file"
        raise ValueError(msg)
    if looks_like_path:
        msg = f"text file not found: {text_source}"
        raise FileNotFoundError(msg)
    return files.load_hf_dataset(text_source)


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
                nll = torch.nn.functional.cross_entropy(logits[row, :-1, :].float(), batch[row, 1:], reduction="sum")
                total_nll += float(nll.double())
            del out, logits
            count += batch.shape[0] * (length - 1)
    mean = total_nll / count
    ppl = math.exp(mean)
    logger.debug("perplexity over %d windows x %d tokens: mean NLL %.5f, ppl %.4f", n, length, mean, ppl)
    return ppl
