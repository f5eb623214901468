"""Calibration samples of different lengths: a list of texts, or a Hugging Face ``datasets.Dataset``.

What llm-compressor's calibrated examples pass as ``dataset=`` (``load_dataset(...)``, ``ds.map(...)`` to a ``text``
column, then usually to ``input_ids`` with ``tokenizer(..., padding=False, truncation=True,
add_special_tokens=False)``). The ``datasets`` package is not imported: a dataset is recognised by what it has
(``column_names``, ``len()``, ``ds[i]`` -> a row dict), so ``datasets`` stays an optional dependency.

* a ``list`` / ``tuple`` of ``str``: each text is one calibration sample, tokenized by the model's tokenizer;
* a dataset with an ``input_ids`` column: each row is one calibration sample as it was tokenized (with an
  ``attention_mask`` column, only its tokens under 1s: padding at either end is left out, so it never enters the
  statistics);
* a dataset with a ``text`` column (and no ``input_ids``): each row's text is tokenized by the model's tokenizer.

The first ``num_calibration_samples`` rows are used (all of them when it is not given); each sample is cut to its
first ``max_seq_length`` tokens (token rows: not cut when it is not given). Texts are tokenized as llm-compressor
tokenizes a ``text`` column (``tokenizer(text, padding=False, truncation=True, max_length=max_seq_length)``, the
tokenizer's default ``add_special_tokens=True``: a BOS where the tokenizer adds one; ``max_seq_length`` capped at the
tokenizer's ``model_max_length``, which is used when it is not given), the tokenizer's truncation and padding
settings restored afterwards; a processor given for the tokenizer (llm-compressor's ``processor=``) tokenizes them with
its own tokenizer (``processor.tokenizer``: the same tokens). Samples of different lengths cannot be
one ``LongTensor[N, L]``: they become :class:`TokenRows`, a list of batches ``{"input_ids": LongTensor[B, L_i]}``,
consecutive samples of the same length sharing a batch of at most ``batch_size``; no padding.

Differences from llm-compressor 0.14 (``datasets/utils.py``): it draws the ``num_calibration_samples`` rows at
random by default (``shuffle_calibration_samples=True``) and warns when the dataset has fewer; here the first ones
are taken, in order, and asking for more than there are is refused. With ``shuffle_calibration_samples=False``
both take its order (:func:`longest_first`). A ``DatasetDict`` is refused (pass one split);
llm-compressor's registered dataset names (:data:`LLMCOMPRESSOR_DATASETS`, spelled as its registry takes them:
``_`` / ``-`` / space and case alike) are refused with the Hub id it loads
(an image one, :data:`IMAGE_DATASETS`, with the image-caption directory to write it to).
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from llmc_fsm.data.images import METADATA, TEXT_DATA_HINT, images_refused, text_tokenizer
from llmc_fsm.data.protocol import kept_tokenizer_state

__all__ = [
    "ACCEPTED_DATASETS",
    "IMAGE_DATASETS",
    "LLMCOMPRESSOR_DATASETS",
    "CalibrationRows",
    "TokenRows",
    "dataset_object_error",
    "describe_rows",
    "is_rows",
    "longest_first",
    "read_rows",
    "registered_dataset",
    "registered_name_error",
    "row_batches",
]

logger = logging.getLogger(__name__)

#: llm-compressor's registered dataset names (``src/llmcompressor/transformers/data/*.py``) -> the Hugging Face id
#: (``name[:config]``) its loader reads; its preprocessing (prompt templates, chat formatting) is not reproduced.
LLMCOMPRESSOR_DATASETS = {
    "c4": "allenai/c4",
    "cnn_dailymail": "cnn_dailymail:3.0.0",
    "evolcodealpaca": "theblackcat102/evol-codealpaca-v1",
    "flickr": "lmms-lab/flickr30k",
    "flickr30k": "lmms-lab/flickr30k",
    "gsm8k": "openai/gsm8k",
    "open_platypus": "garage-bAInd/Open-Platypus",
    "peoples_speech": "MLCommons/peoples_speech:test",
    "perfectblend": "mlabonne/open-perfectblend",
    "ultrachat": "HuggingFaceH4/ultrachat_200k",
    "ultrachat_200k": "HuggingFaceH4/ultrachat_200k",
    "wikitext": "Salesforce/wikitext",
}

#: Those of :data:`LLMCOMPRESSOR_DATASETS` whose rows are images with captions (llm-compressor feeds each image with
#: a caption prompt through the model's processor): refused with the image-caption directory to give instead.
IMAGE_DATASETS: frozenset[str] = frozenset({"flickr", "flickr30k"})

#: The kinds of ``dataset=`` one-shot takes, as the refusals name them.
ACCEPTED_DATASETS = (
    "a text/JSONL file, a Hugging Face dataset name, a LongTensor [N, L] of token ids, a list of texts (str) or a "
    "datasets.Dataset with an 'input_ids' or 'text' column"
)


#: Processor outputs of image / audio models (transformers' names) that a ``datasets.Dataset`` of calibration rows
#: may carry beside ``input_ids``: llm-compressor passes every column to the model; llmc-fsm reads only the tokens, so
#: such a dataset is refused (found by a tester: Qwen2-Audio's and LLaVA's were calibrated on their tokens alone).
MODALITY_COLUMNS: frozenset[str] = frozenset(
    {
        "pixel_values",
        "pixel_attention_mask",
        "pixel_values_videos",
        "image_grid_thw",
        "video_grid_thw",
        "image_sizes",
        "image_attention_mask",
        "aspect_ratio_ids",
        "aspect_ratio_mask",
        "cross_attention_mask",
        "input_features",
        "feature_attention_mask",
        "input_values",
        "audio_values",
        "input_audio_embeds",
        "audio_attention_mask",
    }
)


#: Those of :data:`MODALITY_COLUMNS` that carry images.
IMAGE_COLUMNS: frozenset[str] = frozenset(
    name for name in MODALITY_COLUMNS if name.startswith(("pixel_", "image_", "aspect_ratio_", "cross_attention_"))
)


def _type_name(value: Any) -> str:
    """``datasets.Dataset`` (top-level package and class), or the bare name of a builtin (``dict``)."""
    module = type(value).__module__.split(".")[0]
    return type(value).__qualname__ if module == "builtins" else f"{module}.{type(value).__qualname__}"


def _is_dataset(value: Any) -> bool:
    """A ``datasets.Dataset`` or alike: a list of ``column_names``, ``len()`` and ``ds[i]``, not a mapping."""
    columns = getattr(value, "column_names", None)
    return (
        isinstance(columns, list | tuple)
        and not isinstance(value, Mapping)
        and hasattr(value, "__len__")
        and hasattr(value, "__getitem__")
    )


def is_rows(value: Any) -> bool:
    """Whether ``value`` is a list/tuple of texts or a dataset object (checked by :func:`dataset_object_error`)."""
    return (isinstance(value, list | tuple) and not isinstance(value, str)) or _is_dataset(value)


def _lookup_name(name: str) -> str:
    """``name`` as llm-compressor's registry looks it up (compressed-tensors' ``standardize_lookup_name``): ``_`` and
    spaces made ``-``, lower case (``"Open_Platypus"`` -> ``"open-platypus"``)."""
    return name.replace("_", "-").replace(" ", "-").lower()


_LOOKUP = {_lookup_name(name): name for name in LLMCOMPRESSOR_DATASETS}


def registered_dataset(value: str) -> str | None:
    """The key of :data:`LLMCOMPRESSOR_DATASETS` that ``value`` names as llm-compressor's registry finds it
    (``_`` / ``-`` / space and case alike: ``"ultrachat-200k"``, ``"Open_Platypus"``), or ``None``. Found by a
    tester: ``dataset="ultrachat-200k"`` (verbatim in 4 of llm-compressor's examples) was taken for a Hub id."""
    return _LOOKUP.get(_lookup_name(value))


def _split_name(splits: Any) -> str | None:
    """The split llm-compressor 0.14 reads from its ``splits=`` argument (``datasets/utils.py``): a string itself,
    a dict's ``"calibration"`` value, a list's first item; ``None`` otherwise."""
    if isinstance(splits, Mapping):
        splits = splits.get("calibration")
    elif isinstance(splits, list | tuple):
        splits = splits[0] if splits else None
    return splits if isinstance(splits, str) else None


def registered_name_error(value: str, *, splits: Any = None) -> str | None:
    """The refusal of one of llm-compressor's registered dataset names (:data:`LLMCOMPRESSOR_DATASETS`, spelled as
    its registry takes it: :func:`registered_dataset`), after the argument's name; ``None`` for any other string (a
    file named so in the working directory included). An image dataset's (:data:`IMAGE_DATASETS`) points to the
    image-caption directory (:mod:`llmc_fsm.data.images`), which calibrates a vision-language model on images as
    llm-compressor's example does (found by a tester: it steered gemma3_example.py's flickr30k to text alone).

    ``splits``: llm-compressor's ``splits=`` argument given with it (not ``None``): the split it names goes into the
    ``load_dataset`` call shown, and the refusal ends telling to leave ``splits`` out (found by a tester: the
    ``splits`` refusal came first, and only without it was the name refused)."""
    name = registered_dataset(value)
    if name is None or Path(value).expanduser().exists():
        return None
    hub_id = LLMCOMPRESSOR_DATASETS[name]
    given = f"{value!r}" if value == name else f"{value!r} (llm-compressor's {name!r})"
    split = _split_name(splits) if splits is not None else None
    leave_out = "; leave splits out: the rows given are the split" if splits is not None else ""
    if name in IMAGE_DATASETS:
        return (
            f"{given} is an image-caption dataset registered in llm-compressor, which llmc-fsm does not load: "
            f"write its images and captions to a directory with {METADATA} and give that directory as the dataset, "
            "with the model's processor (processor= or tokenizer=), to calibrate on the images as llm-compressor "
            f"does (ds = load_dataset({hub_id!r}, split={split or 'test'!r}); save each row's 'image' as "
            f'DIR/<i>.jpg and write one {{"file_name": "<i>.jpg", "text": " ".join(row["caption"])}} line per row '
            f'to DIR/{METADATA}; LLaVA, Gemma 3 and Mllama take images: docs/architectures.md, "Vision-language '
            f'models"){leave_out}'
        )
    load = f" with that split (load_dataset({hub_id!r}, split={split!r}))" if split else ""
    return (
        f"{given} is a dataset name registered in llm-compressor, whose preprocessing of it (prompt template, "
        f"columns) llmc-fsm does not reproduce: load the Hub dataset llm-compressor loads, {hub_id!r}{load}, map "
        "its columns to a 'text' or 'input_ids' column and give it as a datasets.Dataset (Python), or write it with "
        "a 'text' column to a JSONL file (ds.to_json('calibration.jsonl')) and give that file (the CLI's "
        "--dataset); a local text file works too (the Hub id itself is read only when it has a 'text' column)"
        f"{leave_out}"
    )


def _text_column(dataset: Any, column: str) -> bool:
    """Whether ``column``'s first value that is not ``None`` (of the first 16 rows) is a text (a column of texts that
    happens to carry a processor output's name; found by a tester: a first row of ``None`` was taken for an image)."""
    for i in range(min(len(dataset), 16)):
        item = dataset[i].get(column)
        if item is not None:
            return isinstance(item, str)
    return True  # no value to feed the model


def dataset_object_error(value: Any, model: Any = None) -> str | None:
    """Why ``value`` (not a tensor, a path or ``None``) is no ``dataset=`` one-shot takes, after the argument's name;
    ``None`` when it is a list of texts or a dataset with an ``input_ids`` or ``text`` column and at least one row.

    ``model`` (an ``nn.Module`` or a config; ``None``: not known yet): a dataset with image inputs for a model that
    is refused images (:func:`~llmc_fsm.data.images.images_refused`: Idefics3, a text model...) is told to calibrate
    on text, not to give an image directory."""
    if isinstance(value, Mapping) and value and all(_is_dataset(v) for v in value.values()):
        splits = ", ".join(repr(str(k)) for k in value)
        first = next(iter(value))
        return f"is a {_type_name(value)} of splits {splits}: pass one split, e.g. dataset=ds[{str(first)!r}]"
    if isinstance(value, list | tuple):
        bad = next((i for i, item in enumerate(value) if not isinstance(item, str)), None)
        if bad is not None:
            item = _type_name(value[bad])
            return f"is a {_type_name(value)} whose item {bad} is a {item}: pass a list of texts (str)"
        return None if value else f"is an empty {_type_name(value)}: pass at least one text"
    if _is_dataset(value):
        columns = list(value.column_names)
        modal = [c for c in columns if c in MODALITY_COLUMNS and not _text_column(value, c)]
        refused = images_refused(model) if model is not None and set(modal) & IMAGE_COLUMNS else None
        if refused is not None:
            return (
                f"is a {_type_name(value)} with image / audio inputs ({', '.join(map(repr, modal))}), which "
                f"llmc-fsm does not pass to the model, and {refused}; remove the columns to calibrate on the "
                f"tokens (ds.remove_columns({modal!r})), or {TEXT_DATA_HINT}"
            )
        if modal:
            return (
                f"is a {_type_name(value)} with image / audio inputs ({', '.join(map(repr, modal))}), which "
                "llmc-fsm does not pass to the model (it reads 'input_ids' or 'text'): calibrating on the tokens "
                "alone would skip them; give images as a directory with processor= (docs/oneshot.md; audio "
                "calibration data is not supported), or remove the columns to calibrate on the text"
            )
        if "input_ids" not in columns and "text" not in columns:
            return (
                f"is a {_type_name(value)} with columns {', '.join(map(repr, columns)) or 'none'} but neither "
                "'input_ids' (token ids) nor 'text': map it to one, e.g. ds.map(lambda s: {'text': ...})"
            )
        return None if len(value) else f"is a {_type_name(value)} with no rows: pass at least one"
    loader = getattr(value, "dataset", None)  # a torch DataLoader: llmc-fsm batches the rows itself
    if loader is not None and hasattr(value, "batch_size") and hasattr(value, "collate_fn"):
        return (
            f"must be {ACCEPTED_DATASETS}, got a {_type_name(value)}: pass the rows it loads (its .dataset); "
            "llmc-fsm batches them itself (batch_size=)"
        )
    return f"must be {ACCEPTED_DATASETS}, got a {_type_name(value)}"


def describe_rows(value: Any) -> str:
    """A short name for a list of texts (``list of 3 str``) or a dataset (``datasets.Dataset``)."""
    if isinstance(value, list | tuple):
        return f"{_type_name(value)} of {len(value)} str"
    return _type_name(value)


@attrs.frozen
class CalibrationRows:
    """The calibration samples read from a list of texts or a dataset, before any model work.

    ``column``: ``"input_ids"`` (``rows`` hold token ids, padding left out, already cut to ``max_seq_length``) or
    ``"text"`` (``rows`` hold the texts).
    """

    source: str  # describe_rows of the object
    column: str
    rows: tuple[Any, ...]
    #: texts to be ordered longest first once tokenized, and how many of them to take (``None``: ``rows`` as they are)
    take_longest: int | None = None

    @property
    def tokenized(self) -> bool:
        """Whether the rows are token ids already (no tokenizer needed)."""
        return self.column == "input_ids"

    def digest(self) -> str:
        """sha256 of the column name and every row: what a resumed run compares."""
        h = hashlib.sha256(self.column.encode())
        for row in self.rows:
            h.update(json.dumps(row).encode())
        return h.hexdigest()


def _ids(value: Any, where: str) -> tuple[int, ...]:
    """One row of token ids (a list, or a tensor of shape [L] or [1, L]) as a tuple of ints.

    Raises:
        ValueError: not integers, or another shape.
    """
    if isinstance(value, list | tuple) and not value:
        return ()
    tensor = value if isinstance(value, torch.Tensor) else None
    if tensor is None:
        try:
            tensor = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            tensor = None
    if tensor is not None and tensor.dim() == 2 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor is None or tensor.dim() != 1 or tensor.is_floating_point() or tensor.dtype == torch.bool:
        held = ""
        if tensor is not None and tensor.is_floating_point():
            held = " of floating-point values"
        elif tensor is not None and tensor.dtype == torch.bool:
            held = " of booleans"
        msg = f"{where} must be a list of token ids (int), got a {_type_name(value)}{held}"
        raise ValueError(msg)
    return tuple(int(i) for i in tensor.tolist())


def longest_first(lengths: list[int]) -> list[int]:
    """The indices of samples of ``lengths`` tokens, longest first, as llm-compressor 0.14's ``LengthAwareSampler``
    orders a dataset with ``shuffle_calibration_samples=False`` (``datasets/utils.py``): ``torch.argsort`` of the
    lengths, descending, which is not stable, so samples of equal length come in the order it gives (the same for the
    same torch), e.g. 32 rows of 256 tokens as ``[16, 31, 30, ...]``."""
    return torch.argsort(torch.tensor(lengths, dtype=torch.int64), descending=True).tolist()


def read_rows(value: Any, num_samples: int | None, seq_len: int | None, *, longest: bool = False) -> CalibrationRows:
    """The first ``num_samples`` rows (all of them for ``None``) of a list of texts or a dataset that
    :func:`dataset_object_error` accepts; token ids cut to their first ``seq_len`` (``None``: whole).

    ``longest`` (llm-compressor's ``shuffle_calibration_samples=False``): the ``num_samples`` longest rows instead,
    longest first (:func:`longest_first`): token ids by their length as stored (padding included, before the cut, as
    llm-compressor's sampler reads them); texts are all kept (:attr:`CalibrationRows.take_longest`) and ordered by
    :func:`row_batches` once tokenized.

    Raises:
        ValueError: ``num_samples`` above the number of rows; a row of ``input_ids`` that is not a list of ints or
            holds none; a ``text`` that is not a str (one line each, naming the row).
    """
    count = len(value)
    if num_samples is not None and num_samples > count:
        msg = (
            f"num_calibration_samples (--num-samples) {num_samples} is more than the {count} rows of the dataset "
            f"({describe_rows(value)}); pass at most {count}, or leave it out to use them all"
        )
        raise ValueError(msg)
    used = count if num_samples is None else num_samples
    if num_samples is None and count > LLMCOMPRESSOR_NUM_SAMPLES:  # 20x the work of the script's run there
        logger.warning(
            "num_calibration_samples not given: all %d rows of the dataset are used (llm-compressor's default takes "
            "%d); pass num_calibration_samples to use fewer",
            count,
            LLMCOMPRESSOR_NUM_SAMPLES,
        )
    source = describe_rows(value)
    take = used if longest else None
    if isinstance(value, list | tuple):
        return CalibrationRows(source=source, column="text", rows=tuple(value[: count if longest else used]),
                               take_longest=take)  # fmt: skip
    column = "input_ids" if "input_ids" in value.column_names else "text"
    with_mask = column == "input_ids" and "attention_mask" in value.column_names
    indices: list[int] | range = range(count if longest else used)
    if longest and column == "input_ids":
        lengths = [len(_ids(value[i]["input_ids"], f"dataset row {i}: 'input_ids'")) for i in range(count)]
        indices, take = longest_first(lengths)[:used], None
    rows = []
    for index in indices:
        row = value[index]
        if column == "text":
            if not isinstance(row["text"], str):
                msg = f"dataset row {index}: 'text' must be a str, got a {_type_name(row['text'])}"
                raise ValueError(msg)
            rows.append(row["text"])
            continue
        ids = _ids(row["input_ids"], f"dataset row {index}: 'input_ids'")
        if with_mask:
            ids = _unpadded(ids, _ids(row["attention_mask"], f"dataset row {index}: 'attention_mask'"), index)
        ids = ids[:seq_len]
        if not ids:
            msg = f"dataset row {index}: 'input_ids' holds no token ids: drop empty rows (ds.filter(...))"
            raise ValueError(msg)
        rows.append(ids)
    return CalibrationRows(source=source, column=column, rows=tuple(rows), take_longest=take)


def _unpadded(ids: tuple[int, ...], mask: tuple[int, ...], index: int) -> tuple[int, ...]:
    """The tokens of a row whose ``attention_mask`` is 1 (padding, 0 at either end, left out: as the row before it
    was padded, so padding never enters the statistics).

    Raises:
        ValueError: a mask of another length, of values other than 0/1, all zeros, or with zeros between ones.
    """
    where = f"dataset row {index}: 'attention_mask'"
    if len(mask) != len(ids):
        raise ValueError(f"{where} has {len(mask)} values for {len(ids)} token ids")
    if set(mask) - {0, 1}:
        raise ValueError(f"{where} must hold 0 and 1 only, got {sorted(set(mask) - {0, 1})[:3]}")
    ones = [i for i, m in enumerate(mask) if m == 1]
    if not ones:
        raise ValueError(f"{where} is all zeros: the row holds no token; drop it (ds.filter(...))")
    first, last = ones[0], ones[-1]
    if last - first + 1 != len(ones):
        raise ValueError(f"{where} has zeros between ones (padding inside the row): pass rows padded at one end or not")
    return ids[first : last + 1]


class TokenRows(list):
    """Calibration batches of samples of different lengths: a ``list`` of ``{"input_ids": LongTensor[B, L]}``,
    plus what the one-shot job
    reads of a windows tensor: :attr:`shape` ``(samples, longest sample in tokens)`` and :meth:`numel` (tokens).
    A slice is again a :class:`TokenRows` (of whole batches)."""

    @property
    def shape(self) -> tuple[int, int]:
        """``(number of samples, tokens of the longest sample)``."""
        rows = sum(int(b["input_ids"].shape[0]) for b in self)
        return rows, max((int(b["input_ids"].shape[1]) for b in self), default=0)

    def numel(self) -> int:
        """Tokens of all samples (none is padding)."""
        return sum(int(b["input_ids"].numel()) for b in self)

    def lengths(self) -> list[int]:
        """Each sample's length in tokens, in order."""
        return [int(b["input_ids"].shape[1]) for b in self for _ in range(int(b["input_ids"].shape[0]))]

    def __getitem__(self, index: Any) -> Any:
        item = super().__getitem__(index)
        return TokenRows(item) if isinstance(index, slice) else item


#: llm-compressor 0.14's default ``num_calibration_samples`` (``DatasetArguments``).
LLMCOMPRESSOR_NUM_SAMPLES = 512

#: transformers' ``model_max_length`` of a tokenizer that states none (``VERY_LARGE_INTEGER``, 1e30): no limit.
_NO_LIMIT = 10**29


def _capped(seq_len: int | None, model_max_length: Any) -> int | None:
    """The length texts are cut to, as llm-compressor 0.14 cuts a ``text`` column (``TextGenerationDataset``):
    ``min(max_seq_length, tokenizer.model_max_length)``, with its warning when that caps it, or the tokenizer's
    ``model_max_length`` when ``max_seq_length`` is not given; ``seq_len`` when the tokenizer states no limit."""
    if isinstance(model_max_length, float) and model_max_length.is_integer():  # 2048.0 from a JSON config
        model_max_length = int(model_max_length)
    try:  # a numpy int too (llm-compressor's min() takes any number; a tester's case)
        limit = None if isinstance(model_max_length, bool) else operator.index(model_max_length)
    except TypeError:
        limit = None
    if limit is None or limit >= _NO_LIMIT or limit < 1:
        return seq_len
    model_max_length = limit
    if seq_len is None:
        return model_max_length
    if seq_len > model_max_length:
        logger.warning(
            "max_seq_length %d is above the tokenizer's model_max_length %d: texts are cut to %d tokens, as "
            "llm-compressor cuts them",
            seq_len,
            model_max_length,
            model_max_length,
        )
        return model_max_length
    return seq_len


def row_batches(rows: CalibrationRows, tokenizer: Any, *, seq_len: int | None, batch_size: int) -> TokenRows:
    """``rows`` as model inputs: texts tokenized (``tokenizer(text, padding=False, truncation=seq_len is not None,
    max_length=seq_len)``, special tokens as the tokenizer adds them, as llm-compressor; a processor's texts by its
    own tokenizer, :func:`~llmc_fsm.data.images.text_tokenizer`: the same tokens), consecutive samples of the same
    length stacked into batches of at most ``batch_size`` (``LongTensor[B, L]``).

    Raises:
        ValueError: texts but no tokenizer; a text that gives no token.
    """
    if rows.tokenized:
        ids: list[tuple[int, ...]] = list(rows.rows)
    else:
        if tokenizer is None:
            msg = "a list of texts or a 'text' column needs a tokenizer: pass tokenizer= (or token ids)"
            raise ValueError(msg)
        tokenizer = text_tokenizer(tokenizer)  # a processor's first positional argument is images
        seq_len = _capped(seq_len, getattr(tokenizer, "model_max_length", None))
        cut = {"truncation": True, "max_length": seq_len} if seq_len is not None else {"truncation": False}
        with kept_tokenizer_state(tokenizer):  # the truncation setting the call leaves is not the caller's
            ids = [tuple(tokenizer(text, padding=False, **cut)["input_ids"]) for text in rows.rows]
        chosen = list(range(len(ids)))
        if rows.take_longest is not None:  # llm-compressor's order of the tokenized texts (its lengths: cut ones)
            chosen = longest_first([len(row) for row in ids])[: rows.take_longest]
            ids = [ids[i] for i in chosen]
        empty = next((chosen[i] for i, row in enumerate(ids) if not row), None)
        if empty is not None:
            msg = f"calibration text {empty} gives no token: drop empty texts"
            raise ValueError(msg)
    out = TokenRows()
    start = 0
    while start < len(ids):
        end = start + 1
        while end < len(ids) and end - start < batch_size and len(ids[end]) == len(ids[start]):
            end += 1
        out.append({"input_ids": torch.tensor(ids[start:end], dtype=torch.long)})
        start = end
    return out
