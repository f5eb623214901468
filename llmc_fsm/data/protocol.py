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

import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "LOSS_CHUNK",
    "PerplexityCache",
    "kept_tokenizer_state",
    "load_text",
    "logits_are_projection",
    "perplexity",
    "token_windows",
]

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
              ``.jsonl``, ``.ndjson`` and the tables of ``TABLE_SUFFIXES``), read as UTF-8 with universal
              newlines (``"\\r\\n"`` and ``"\\r"`` become ``"\\n"``; a leading byte order mark dropped), otherwise
              unchanged;
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
            separator or a known text suffix) but does not exist; ``org/name``
            whose ``org`` is no folder here is taken as a dataset name.
        ValueError: a table (``.csv``, ``.tsv``, ``.parquet``...); the file holds NUL bytes (UTF-16) or is not
            valid UTF-8 (the message gives file, byte
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
        if suffix in files.TABLE_SUFFIXES:  # its raw bytes were calibrated on (found by a tester)
            msg = (
                f"{path}: a {suffix} file is rows and columns, not calibration text (its header, quotes and "
                f"separators would be tokenized): from Python pass its rows as a datasets.Dataset "
                f"(load_dataset({suffix.lstrip('.')!r}, data_files=...)['train'], a 'text' or 'input_ids' column), or "
                'write its text column as JSONL, one {"text": ...} per line'
            )
            raise ValueError(msg)
        return files.read_utf8(path)
    text_source = os.fspath(source)
    # "org/name[:config[:split]]", a Hugging Face dataset id, when "org" is not a folder here
    hub_id = (
        not isinstance(source, os.PathLike)
        and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]*){0,2}", text_source) is not None
        and not Path(text_source.split("/", 1)[0]).exists()
        and path.suffix.lower() not in files.TEXT_SUFFIXES | files.JSONL_SUFFIXES | {".json"}
    )
    looks_like_path = not hub_id and (
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
        if not path.is_absolute():  # where it was looked for (a newcomer's run from another folder)
            msg += f" (looked for {path.absolute()})"
        if "wikitext-2-raw" in text_source:
            msg += (
                "; the README's commands read WikiText-2 from ../shared/data next to the checkout: link your copy "
                "there (ln -s /path/to/shared ../shared; README.md, 'Data') or give its path"
            )
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


def _tokenize(tokenizer: Any, text: str, need: int | None = None, *, from_end: bool = False) -> list[int]:
    """The ids of ``text`` (no special tokens); with ``need``, at least its first (``from_end``: last) ``need`` ids
    (all of them if it has fewer).

    A chunkable tokenizer (:func:`_chunkable`) tokenizes the text's pieces (:func:`_chunks`) in one batch call, or,
    with ``need``, from the head (tail) in batches of 1, 2, 4... pieces until ``need`` ids are there: a piece's ids
    do not depend on the other pieces, so these are the whole text's first (last) ids.
    """
    with kept_tokenizer_state(tokenizer):
        if getattr(tokenizer, "model_max_length", None) is not None:
            # Silence "Token indices sequence length is longer than the specified maximum".
            tokenizer.model_max_length = int(1e30)
        if not text:
            return []
        if not _chunkable(tokenizer):
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        pieces = list(_chunks(text, _CHUNK_CHARS))
        if from_end:
            pieces.reverse()
        done, batch, count = 0, len(pieces) if need is None else 1, 0
        parts: list[list[int]] = []  # each batch's pieces' ids, in the order tokenized
        while done < len(pieces) and (need is None or count < need):
            todo = pieces[done : done + batch]
            ids = tokenizer(todo[::-1] if from_end else todo, add_special_tokens=False)["input_ids"]
            parts.append([i for piece in ids for i in piece])
            count += len(parts[-1])
            done, batch = done + len(todo), 2 * batch
        return [i for part in (reversed(parts) if from_end else parts) for i in part]


@contextmanager
def kept_tokenizer_state(tokenizer: Any) -> Iterator[None]:
    """Restore ``tokenizer``'s ``model_max_length`` and its fast backend's truncation and padding settings on exit.

    A call ``tokenizer(text, truncation=True, max_length=N)`` leaves the backend truncating at ``N`` (``truncation=
    False`` clears a setting the caller had): the tokenizer given, or the one saved beside the compressed model,
    then cut every later text to ``N`` tokens when ``tokenizer.json`` was read directly (found by a tester;
    llm-compressor 0.14 keeps the state as well). ``tokenizer`` may be ``None`` or a slow tokenizer (nothing kept
    but ``model_max_length``).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    old_max = getattr(tokenizer, "model_max_length", None)
    truncation = getattr(backend, "truncation", None)
    padding = getattr(backend, "padding", None)
    try:
        yield
    finally:
        if old_max is not None:
            tokenizer.model_max_length = old_max
        if backend is not None:
            if truncation is None:
                backend.no_truncation()
            else:
                backend.enable_truncation(**truncation)
            if padding is None:
                backend.no_padding()
            else:
                backend.enable_padding(**padding)


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
    2 cores, identical ids), and only as many pieces from the head (``from_end``:
    the tail) as give the windows' tokens (the same ids: a piece's ids do not
    depend on the others; 32 x 256 tail windows of wiki.test.raw: 0.06 instead of
    1.1 CPU seconds); other tokenizers get the whole text in one call.  Window
    ``i`` is ``ids[s + i*seq_len : s + (i+1)*seq_len]`` where ``s = 0`` (head,
    default) or ``s = len(ids) - num_windows*seq_len`` (``from_end=True``: the
    last ``num_windows*seq_len`` tokens, used for calibration so it does not
    overlap head evaluation windows of a long enough text).

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
    needed = num_windows * seq_len
    ids = _tokenize(tokenizer, text, needed, from_end=from_end)
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


#: Predicted positions whose full-vocabulary logits exist at once (``[LOSS_CHUNK, vocab]`` float32: 25 MB for
#: a 49,152-token vocabulary), when the model's logits are its output projection of the final hidden states.
LOSS_CHUNK = 128
#: Positions of the first batch whose logits the model computes itself, to check that they equal the output
#: projection of the hidden states (a model that scales or caps its logits after the projection fails the check).
_CHECK_POSITIONS = 4


class _HeadInput:
    """Forward pre-hook on the output projection (``lm_head``): keeps its input, the final hidden states
    ``[B, L, hidden]``, and hands the projection only its first ``keep`` positions, so the model computes
    ``[B, keep, vocab]`` logits instead of ``[B, L, vocab]``."""

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None
        self.keep = 0
        self.active = True

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not self.active or not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 3:
            return None
        self.hidden = args[0]
        return (args[0][:, : self.keep], *args[1:])


def _projects(head: torch.nn.Module, hidden: torch.Tensor, logits: torch.Tensor, chunk: int) -> bool:
    """Whether ``logits`` (the model's ``[B, k, vocab]``, its head handed the first ``k`` positions of ``hidden``)
    equal, bitwise, what :func:`_chunked_nll` computes for the first positions of the first window: ``head`` of
    ``hidden[:1, :chunk]`` (``hidden`` is the head's input ``[B, L, hidden]``).

    Comparing with the chunked computation (not with ``head(hidden[:, :k])``, the model's own call) makes a head whose
    output for a position depends on what else it is handed fail the check, and the model then be scored from its full
    logits (until 2026-12-07 the chunks were 2-D ``[positions, hidden]``, on which compressed-tensors' dynamic
    per-token activation quantization takes one scale for the whole chunk; the check compared same-shape 3-D calls
    and passed, and an FP8_DYNAMIC ``lm_head`` reported 532.501 for a perplexity of 533.114: found by a tester).
    """
    mine = _head_logits(head, hidden, 0, 0, chunk)
    k = min(mine.shape[1], logits.shape[1])
    return (
        logits.dim() == 3
        and mine.shape[2:] == logits.shape[2:]
        and torch.equal(mine[:, :k].float(), logits[:1, :k].float())
    )


def _head_logits(head: torch.nn.Module, hidden: torch.Tensor, row: int, start: int, chunk: int) -> torch.Tensor:
    """``head`` of window ``row``'s predicting positions ``start .. start + chunk - 1`` (the last position of
    ``hidden`` ``[B, L, hidden]`` predicts nothing), handed 3-D as the model hands them: ``[1, <= chunk, vocab]``."""
    stop = min(start + chunk, hidden.shape[1] - 1)
    return head(hidden[row : row + 1, start:stop])


def logits_are_projection(model: torch.nn.Module, input_ids: torch.Tensor, *, loss_chunk: int = LOSS_CHUNK) -> bool:
    """Whether ``model``'s logits are its output projection (``get_output_embeddings()``) of its final hidden
    states, as :func:`perplexity` (with the same ``loss_chunk``) checks on its first batch: one forward of
    ``input_ids`` (``LongTensor[B, L]``, moved to the device of the model's first parameter) in which the projection
    makes the first 4 positions' logits only, compared bitwise with what the chunked loss computes for them (the
    projection of the first window's first ``loss_chunk`` positions' hidden states, ``[1, loss_chunk, hidden]``).

    ``False`` for a model without an output projection, or one that changes its logits after it (Gemma 2's
    soft-capping, Cohere's and Granite's scale): :func:`perplexity` then runs its first batch a second time, for its
    full logits (the streamed evaluation, whose decoder layers replay one state per call, feeds that batch's states
    twice: :func:`llmc_fsm.pipeline.streaming.tail_perplexity`).
    """
    head = _output_projection(model)
    if head is None:
        return False
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    extra = _forward_extras(model)
    hook = _HeadInput()
    hook.keep = _CHECK_POSITIONS
    handle = head.register_forward_pre_hook(hook)
    try:
        with torch.inference_mode():
            out = model(input_ids=input_ids.to(device=device, dtype=torch.long), **extra)
            logits = out.logits if hasattr(out, "logits") else out[0]
            hidden = hook.hidden
            hook.active = False
            return (
                hidden is not None
                and tuple(hidden.shape[:2]) == tuple(input_ids.shape)
                and _projects(head, hidden, logits, loss_chunk)
            )
    finally:
        handle.remove()


def _output_projection(model: torch.nn.Module) -> torch.nn.Module | None:
    """``model.get_output_embeddings()`` when it is a module with a 2-D weight, else ``None``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    if isinstance(head, torch.nn.Module) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return head
    return None


def _chunked_nll(head: torch.nn.Module, hidden: torch.Tensor, batch: torch.Tensor, chunk: int) -> float:
    """Summed next-token NLL of ``batch`` (``[B, L]``) from its final hidden states ``[B, L, hidden]``.

    One window at a time, the head is handed ``[1, <= chunk, hidden]`` (3-D, as the model hands it: a head that
    quantizes its input per token sees each position as a token), so the logits of at most ``chunk`` positions
    exist at a time (float32 ``[chunk, vocab]`` and its log-softmax).
    """
    length = hidden.shape[1]
    total = 0.0
    for row in range(batch.shape[0]):
        for p0 in range(0, length - 1, chunk):
            logits = _head_logits(head, hidden, row, p0, chunk)[0].float()
            nll = torch.nn.functional.cross_entropy(logits, batch[row, p0 + 1 : p0 + 1 + chunk], reduction="sum")
            total += float(nll.double())
            del logits
    return total


def _full_nll(logits: torch.Tensor, batch: torch.Tensor) -> float:
    """Summed next-token NLL of ``batch`` (``[B, L]``) from the model's logits ``[B, L, vocab]``, one window at
    a time."""
    total = 0.0
    for row in range(batch.shape[0]):  # per window: no [B*L, vocab] reshape copy
        nll = torch.nn.functional.cross_entropy(logits[row, :-1, :].float(), batch[row, 1:], reduction="sum")
        total += float(nll.double())
    return total


def _forward_extras(model: Any) -> dict[str, bool]:
    """The keyword arguments a scoring forward of ``model`` gets: ``use_cache=False`` and
    ``output_router_logits=False`` where its ``forward`` has such a parameter (transformers' causal LMs; their
    mixture-of-experts families).

    No KV cache: nothing is generated, and a cache holds every layer's keys and values of the batch (transformers'
    NemotronH in 5.25 even fails building one when its first layer has nothing to cache). No router logits: a
    checkpoint whose config sets ``output_router_logits`` (fine-tuned ones ship it) would add the load-balancing
    loss, which the logits do not need, and which fails with an ``IndexError`` when the decoder layers are replayed
    (:func:`llmc_fsm.pipeline.streaming.tail_perplexity`: no router runs, so no router logits are recorded).
    """
    try:
        parameters = inspect.signature(model.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return {}
    return {name: False for name in ("use_cache", "output_router_logits") if name in parameters}


def perplexity(
    model: torch.nn.Module,
    windows: torch.Tensor,
    *,
    batch_size: int = 1,
    progress: bool = True,
    loss_chunk: int = LOSS_CHUNK,
) -> float:
    """Perplexity of a causal LM on token windows: ``exp(mean next-token NLL)``.

    Each window is scored independently (labels = inputs, shifted by one inside
    the window), so ``N * (L - 1)`` positions contribute; the NLL is summed in
    float64 and averaged over all of them (not a mean of per-window means).

    Memory: the full-vocabulary logits of a batch (``[B, L, vocab]`` float32, 50 MB per 256-token window of a
    49k vocabulary) are never made when the model's logits are its output projection
    (``get_output_embeddings()``, e.g. ``lm_head``) of the final hidden states: a pre-hook on the projection
    keeps the hidden states ``[B, L, hidden]`` and lets the model project only their first positions, and the
    loss is computed ``loss_chunk`` positions of one window at a time from the hidden states (the projection is
    handed ``[1, loss_chunk, hidden]``, 3-D as the model hands it, so a per-token quantized input is quantized per
    token; ``[loss_chunk, vocab]`` logits at most, 25 MB at the default 128). On the first batch, the model's own
    logits of the first 4 positions are compared (bitwise) with what the chunked loss computes for them; a model
    that changes its logits after the projection (scaling, soft-capping), or a projection whose output for a
    position depends on the other positions it is handed, fails the check and is scored from its full logits,
    one window of them at a time, as is a model without an output projection.

    Args:
        model: a causal LM; called as ``model(input_ids=LongTensor[B, L])`` (with ``use_cache=False`` and
            ``output_router_logits=False`` when its ``forward`` takes them, as transformers' models do) and
            must return ``.logits`` (or a tuple whose first item is the logits)
            of shape ``[B, L, vocab]``.  Runs on the device of its first
            parameter; its train/eval mode is left unchanged (use eval mode).
        windows: ``LongTensor[N, L]`` from :func:`token_windows`, ``L >= 2``.
        batch_size: windows per forward pass (default 1: with the chunked loss a batch costs only its
            activations, but larger batches were not faster on 2 CPU cores, and a batch of 1 gives the values the
            streamed evaluation of ``llmc_fsm.pipeline.streaming`` gives, bit for bit).
        progress: show a tqdm progress bar (on stderr).
        loss_chunk: positions whose logits exist at once (default :data:`LOSS_CHUNK`).

    Returns:
        The perplexity as a Python float.

    Raises:
        ValueError: ``windows`` is not a 2-D integer tensor with ``L >= 2`` and
            ``N >= 1``, or ``batch_size < 1`` or ``loss_chunk < 1``.
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
    for arg, value in (("batch_size", batch_size), ("loss_chunk", loss_chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            msg = f"{arg} must be an int >= 1, got {value!r}"
            raise ValueError(msg)
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    head = _output_projection(model)
    extra = _forward_extras(model)  # no KV cache, no router logits
    hook = _HeadInput()
    handle = head.register_forward_pre_hook(hook) if head is not None else None
    total_nll = 0.0
    count = 0
    try:
        with torch.inference_mode():
            for start in tqdm(range(0, n, batch_size), desc="perplexity", unit="batch", disable=not progress):
                batch = windows[start : start + batch_size].to(device=device, dtype=torch.long)
                hook.hidden, hook.keep = None, (_CHECK_POSITIONS if start == 0 else 0)
                out = model(input_ids=batch, **extra)
                logits = out.logits if hasattr(out, "logits") else out[0]
                hidden, hook.hidden = hook.hidden, None
                if handle is not None and (hidden is None or tuple(hidden.shape[:2]) != tuple(batch.shape)):
                    hidden = None
                if handle is not None and hidden is not None and start == 0:
                    hook.active = False
                    projected = _projects(head, hidden, logits, loss_chunk)
                    hook.active = True
                    if not projected:
                        hidden = None
                if handle is not None and hidden is None:  # not the projection of the hidden states: full logits
                    logger.debug("perplexity: %s's logits are not its output projection; full logits", type(model))
                    handle.remove()
                    handle = None
                    out = model(input_ids=batch, **extra)
                    logits = out.logits if hasattr(out, "logits") else out[0]
                if handle is not None:
                    hook.active = False
                    try:
                        total_nll += _chunked_nll(head, hidden, batch, loss_chunk)
                    finally:
                        hook.active = True
                else:
                    total_nll += _full_nll(logits, batch)
                del out, logits, hidden
                count += batch.shape[0] * (length - 1)
    finally:
        if handle is not None:
            handle.remove()
    mean = total_nll / count
    ppl = math.exp(mean)
    logger.debug("perplexity over %d windows x %d tokens: mean NLL %.5f, ppl %.4f", n, length, mean, ppl)
    return ppl


class PerplexityCache:
    """Perplexities measured before, keyed by the model's files, the load dtype and the token windows.

    One-shot measures the perplexity of the uncompressed model on every run; for a model read from a
    directory (or a known model's cached directory) that was measured on the same windows before, the value is
    read back instead (a dense SmolLM2 evaluation of 40 x 256 tokens takes ~15-40 s on 2 CPU cores). The key
    is the sha256 of: the directory's resolved path, the name, size and modification time (ns) of each of its
    files, the dtype, the windows' bytes, the torch and transformers versions and :data:`CACHE_VERSION`; a
    changed file, dtype, window or library version measures again. Entries are small JSON files
    (``<key>.json``: the perplexity, when and what it was measured on), written atomically.

    Args:
        directory: where the entries live; ``None`` turns the cache off (nothing read or written).
    """

    #: Part of every key: raise it when the perplexity protocol changes its values.
    CACHE_VERSION = 1
    #: Environment variable naming the cache directory (``off`` or empty: no cache).
    ENV = "LLMC_FSM_PERPLEXITY_CACHE"

    def __init__(self, directory: str | os.PathLike[str] | None) -> None:
        self.directory = None if directory is None else Path(directory).expanduser()

    @classmethod
    def default(cls) -> PerplexityCache:
        """``$LLMC_FSM_PERPLEXITY_CACHE``, else ``perplexity`` under the cache root the converted models use
        (``$LLMC_FSM_CACHE``, else ``$XDG_CACHE_HOME/llmc_fsm``, else ``~/.cache/llmc_fsm``);
        ``LLMC_FSM_PERPLEXITY_CACHE=off`` (or empty) turns it off. (Until 2026-12-05 ``LLMC_FSM_CACHE`` did not move
        it, though README said so: a newcomer's run wrote into the shared ``~/.cache``.)"""
        env = os.environ.get(cls.ENV)
        if env is not None:
            return cls(None if env.strip() in ("", "off") else env)
        root_env, xdg = os.environ.get("LLMC_FSM_CACHE"), os.environ.get("XDG_CACHE_HOME")
        if root_env:
            root = Path(root_env).expanduser()
        else:
            root = Path(xdg).expanduser() / "llmc_fsm" if xdg else Path.home() / ".cache" / "llmc_fsm"
        return cls(root / "perplexity")

    def key(self, model_dir: str | os.PathLike[str], dtype: str, windows: torch.Tensor) -> str | None:
        """The entry's key (64 hex digits), or ``None`` when the cache is off or ``model_dir`` is not a directory."""
        path = Path(model_dir).expanduser()
        if self.directory is None or not path.is_dir():
            return None
        try:
            import transformers

            transformers_version = transformers.__version__
        except ImportError:
            transformers_version = None
        files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(path.iterdir()) if p.is_file()}
        ident = {
            "directory": str(path.resolve()),
            "files": files,
            "dtype": str(dtype),
            "versions": [self.CACHE_VERSION, torch.__version__, transformers_version],
            "windows": [str(windows.dtype), list(windows.shape)],
        }
        h = hashlib.sha256(json.dumps(ident, sort_keys=True).encode())
        h.update(windows.detach().cpu().contiguous().to(torch.int64).numpy().tobytes())
        return h.hexdigest()

    def get(self, key: str | None) -> dict[str, Any] | None:
        """The entry ``{"ppl": float, "measured": ISO time, ...}`` under ``key``, or ``None`` (no entry, unreadable)."""
        if key is None or self.directory is None:
            return None
        try:
            entry = json.loads((self.directory / f"{key}.json").read_text(encoding="utf-8"))
            ppl = float(entry["ppl"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return {**entry, "ppl": ppl} if math.isfinite(ppl) else None

    def put(self, key: str | None, ppl: float, **about: Any) -> None:
        """Keep ``ppl`` under ``key`` (with ``about``: what it was measured on); a cache that cannot be written
        is skipped with a debug log (it only saves time)."""
        if key is None or self.directory is None:
            return
        entry = {"ppl": ppl, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **about}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f"{key}.json.{os.getpid()}.partial"
            tmp.write_text(json.dumps(entry) + "\n", encoding="utf-8")
            os.replace(tmp, self.directory / f"{key}.json")
        except OSError as err:
            logger.debug("perplexity cache %s not written: %s", self.directory, err)
