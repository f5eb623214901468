"""A safetensors checkpoint's tensors matched to the model its ``config.json`` describes, as ``from_pretrained``
matches them (renamings, fused-expert conversions), reading the files' headers only: which tensors are missing or of
another shape before any weight is read (:func:`check_checkpoint_tensors`), and where each of the model's tensors is
read or built from (:func:`match_checkpoint`, for the lazy loader)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

__all__ = [
    "INDEX_NAME",
    "SAFETENSORS_DTYPES",
    "SINGLE_NAME",
    "CheckpointMatch",
    "Conversion",
    "check_checkpoint_tensors",
    "checkpoint_files",
    "match_checkpoint",
    "mismatch_summary",
]

#: The index of a sharded safetensors checkpoint (Hugging Face's name).
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@attrs.frozen(eq=False)
class Conversion:
    """One transformers ``WeightConverter`` application: the checkpoint tensors it collects and the tensors it builds.

    Attributes:
        converter: the model's converter (from ``get_model_conversion_mapping``); copied for each run.
        first: the model tensor name ``from_pretrained`` files the collected tensors under (the first target).
        keys: ``(file name, checkpoint key, source pattern)`` in the order ``from_pretrained`` collects them
            (its ``dot_natural_key`` order: expert 2 before expert 10).
        names: ``{built tensor name: model tensor name}`` (the first of tied names).
    """

    converter: Any
    first: str
    keys: tuple[tuple[str, str, str], ...]
    names: dict[str, str] = attrs.field(factory=dict)

    def run(self, model: nn.Module, read: Callable[[str, str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{model tensor name: tensor}`` built by the converter from ``read(file, key)`` of each key.

        Raises:
            Exception: what the converter's operations raise (e.g. experts of different shapes).
        """
        from copy import deepcopy

        converter = deepcopy(self.converter)  # from_pretrained copies it for each target too
        for file, key, pattern in self.keys:
            converter.add_tensor(self.first, key, pattern, read(file, key))
        built = converter.convert(self.first, model=model, config=getattr(model, "config", None))
        return {
            self.names.get(name, name): value[0] if isinstance(value, list) else value for name, value in built.items()
        }


def checkpoint_files(directory: Path) -> dict[str, str]:
    """``{checkpoint key: file name}`` of the safetensors checkpoint in ``directory`` (one file or shards)."""
    from safetensors import safe_open

    if (directory / SINGLE_NAME).is_file():
        with safe_open(str(directory / SINGLE_NAME), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), SINGLE_NAME)
    if (directory / INDEX_NAME).is_file():
        return dict(json.loads((directory / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"])
    held = ", ".join(sorted(p.name for p in directory.glob("pytorch_model*.bin"))[:3])
    msg = (
        f"{directory}: low_memory reads safetensors weights (model.safetensors or {INDEX_NAME}), but the directory "
        f"holds {held or 'no safetensors file'}; convert it once with from_pretrained + save_pretrained"
    )
    raise ValueError(msg)


def mismatch_summary(missing: list[str], wrong: list[str]) -> str:
    """``"missing a, b, c, d, e and 3 more; other shapes: x, ..."``: the first five of ``missing`` (parameter names)
    and of ``wrong`` (one text per tensor of another shape), then a count; a part with nothing is left out."""

    def first(names: list[str]) -> str:
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    parts = [f"missing {first(missing)}"] if missing else []
    return "; ".join(parts + ([f"other shapes: {first(wrong)}"] if wrong else []))


def check_checkpoint_tensors(model: nn.Module, directory: Path) -> None:
    """Refuse, before any weight is read, a safetensors checkpoint that ``from_pretrained`` would load into ``model``
    with parameters left at their random initialisation (a tensor missing from the files) or refused with a
    multi-line report (a tensor of another shape): found by a tester, a checkpoint without one ``down_proj`` was
    loaded, compressed and saved without a word.

    ``model`` is the model ``config.json`` describes on the ``meta`` device (:func:`llmc_fsm.models.hf_io.meta_model`,
    the class ``from_pretrained`` builds); checkpoint keys are renamed and fused expert tensors built (on ``meta``) as
    ``from_pretrained`` does. Not counted missing, as ``from_pretrained`` does not count them: buffers (computed at
    construction, e.g. rotary tables), a parameter tied to one the files hold (``lm_head`` tied to the embedding),
    parameters matching the model's ``_keys_to_ignore_on_load_missing``. A directory without safetensors weights
    (``pytorch_model.bin``) is not checked here.

    Raises:
        ValueError: one line naming the directory, the missing parameters (the first five, then a count) and the
            tensors of another shape (file, checkpoint key, stored shape, the shape config.json gives); or an index
            that lists a tensor in a shard that does not hold it.
    """
    if not ((directory / SINGLE_NAME).is_file() or (directory / INDEX_NAME).is_file()):
        return
    match = match_checkpoint(model, directory, checkpoint_files(directory))
    params = {name for name, _ in model.named_parameters()}  # tied parameters once, under their first name
    patterns = getattr(model, "_keys_to_ignore_on_load_missing", None) or ()
    ignored = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
    missing = [n for n in match.missing if n in params and (ignored is None or ignored.search(n) is None)]
    wrong = [w[1] for w in match.wrong]
    if not missing and not wrong:
        return
    msg = (
        f"{directory}: the checkpoint does not match the model its config.json describes "
        f"({mismatch_summary(missing, wrong)}); nothing was loaded: copy the complete checkpoint, or fix config.json"
    )
    raise ValueError(msg)


@attrs.frozen
class CheckpointMatch:
    """What :func:`_match` found: ``plain`` / ``converted`` as :class:`LazyModel`'s ``sources`` / ``converted``;
    ``missing``: state-dict tensors (first tied names) no checkpoint tensor gives; ``wrong``: per tensor of another
    shape (or failed conversion), ``(text for low_memory, text naming the file)``; ``mapping``: the model's
    weight conversions."""

    plain: dict[str, tuple[str, str]]
    converted: dict[str, Conversion]
    missing: list[str]
    wrong: list[tuple[str, str]]
    mapping: list[Any]


def match_checkpoint(model: nn.Module, directory: Path, files: Mapping[str, str]) -> CheckpointMatch:
    """The matching of :func:`llmc_fsm.models.lazy.load_lazy`, without raising (reads the safetensors headers only)."""
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    tensors = model.state_dict(keep_vars=True)
    first_of: dict[int, str] = {}
    canonical = {name: first_of.setdefault(id(tensor), name) for name, tensor in tensors.items()}
    mapping = get_model_conversion_mapping(model) if hasattr(model, "base_model_prefix") else []
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    plain: dict[str, tuple[str, str]] = {}
    collected: dict[str, list[tuple[str, str, str]]] = {}
    for key in sorted(files, key=dot_natural_key):  # from_pretrained's order: it fixes the order experts are stacked
        name, pattern = rename_source_key(key, renamings, converters, prefix, tensors)
        if name not in tensors and key in tensors:  # from_pretrained's fallback: the key as stored
            name, pattern = rename_source_key(key, [], [], prefix, tensors)
        if name not in tensors:
            continue
        if pattern is None:
            plain.setdefault(canonical[name], (files[key], key))
        else:
            collected.setdefault(name, []).append((files[key], key, pattern))

    shapes: dict[str, tuple[list[int], torch.dtype]] = {}
    by_file: dict[str, list[str]] = {}
    for file, key in [*plain.values(), *((f, k) for keys in collected.values() for f, k, _ in keys)]:
        by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        with safe_open(str(directory / file), framework="pt") as handle:
            held = set(handle.keys())
            for key in keys:
                if key not in held:  # a stale index: it raised a raw SafetensorError traceback (found by a tester)
                    msg = (
                        f"{directory}: {INDEX_NAME} lists {key} in {file}, which does not hold it; the index does "
                        "not match the shards: copy the checkpoint again, or save the model again"
                    )
                    raise ValueError(msg)
                stored = handle.get_slice(key)
                shapes[key] = (list(stored.get_shape()), SAFETENSORS_DTYPES.get(stored.get_dtype(), torch.float32))

    wrong: list[tuple[str, str]] = []
    misshapen: set[str] = set()
    converted: dict[str, Conversion] = {}
    for first, keys in collected.items():
        conversion = Conversion(by_pattern[keys[0][2]], first, tuple(keys))
        where = f"{keys[0][1]} ... in {keys[0][0]}"
        try:
            built = conversion.run(model, lambda _f, k: torch.empty(shapes[k][0], dtype=shapes[k][1], device="meta"))
        except Exception as exc:  # a converter's operation failing on these shapes: named below
            text = f"transformers' conversion of {keys[0][1]} ... failed: {exc}"
            wrong.append((f"{first} ({text})", f"{first} (transformers' conversion of {where} failed: {exc})"))
            continue
        for name, value in built.items():
            if name not in tensors:
                text = f"{name} (built by transformers' conversion, not a tensor of the model)"
                wrong.append((text, f"{name} (built from {where}: not a tensor of the model)"))
            elif list(value.shape) != list(tensors[name].shape):
                stored, expected = list(value.shape), list(tensors[name].shape)
                wrong.append(
                    (
                        f"{name} {stored} (the config gives {expected})",
                        f"{name} built from {where} is {stored}, config.json gives {expected}",
                    )
                )
                misshapen.add(canonical[name])
            else:
                conversion.names[name] = canonical[name]
                converted[canonical[name]] = conversion
    for name, (file, key) in plain.items():
        if shapes[key][0] != list(tensors[name].shape):
            stored, expected = shapes[key][0], list(tensors[name].shape)
            wrong.append(
                (
                    f"{name} {stored} (the config gives {expected})",
                    f"{key} in {file} is {stored}, config.json gives {expected}",
                )
            )
    found = {*plain, *converted, *misshapen}
    missing = [n for n in dict.fromkeys(canonical.values()) if n not in found]
    return CheckpointMatch(plain, converted, missing, wrong, mapping)


#: safetensors' dtype names (``get_slice(...).get_dtype()``) of the float dtypes a checkpoint holds.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
