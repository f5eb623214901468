"""A Hugging Face causal LM whose weights stay on disk until a part of it is needed (one-shot ``low_memory``).

:func:`load_lazy` builds the model from ``config.json`` with every parameter on
the ``meta`` device (``accelerate.init_empty_weights``: no memory; buffers such
as the rotary ``inv_freq`` are computed as usual) and indexes its safetensors
checkpoint — ``model.safetensors``, or shards listed in
``model.safetensors.index.json``. :meth:`LazyModel.materialized` loads the
tensors of one decoder layer (or of everything outside the decoder layers) and
puts them back on ``meta`` when the block ends.

Tensors are swapped into the model's existing parameter objects
(``torch.utils.swap_tensors``), so a parameter keeps its identity: tied weights
stay tied, and the modules a modifier selected at ``initialize`` are the ones
that get the weights. A tensor stored in the model's dtype is memory-mapped
(copy-on-write, ``safetensors.safe_open``): only the pages a computation touches
become resident — an embedding lookup touches the rows of its tokens only.

:class:`ShardWriter` writes the output in Hugging Face layout:
``model-0000k-of-0000n.safetensors`` files and ``model.safetensors.index.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch
from torch import nn

from llmc_fsm.models.hf_io import _check_model_dir, _load_tokenizer, check_tied, dtype_kwargs
from llmc_fsm.models.layers import find_decoder_layers

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["INDEX_NAME", "LazyModel", "ShardWriter", "load_lazy", "save_config"]

logger = logging.getLogger(__name__)

#: The index of a sharded safetensors checkpoint (Hugging Face's name).
INDEX_NAME = "model.safetensors.index.json"
_SINGLE_NAME = "model.safetensors"


@attrs.define(eq=False)
class LazyModel:
    """A model on the ``meta`` device and where each of its tensors lies in the checkpoint.

    Attributes:
        model: the model; its parameters are on ``meta`` except inside :meth:`materialized`.
        directory: the checkpoint directory.
        sources: ``{model tensor name: (file name, checkpoint key)}`` for every
            tensor of the state dict, tied tensors once (under the first name).
        layers_name: qualified name of the decoder-layer list (e.g. ``"model.layers"``).
        layers: the decoder layers.
    """

    model: PreTrainedModel
    directory: Path
    sources: dict[str, tuple[str, str]]
    layers_name: str
    layers: nn.ModuleList
    _tensors: dict[str, torch.Tensor] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._tensors = dict(self.model.state_dict(keep_vars=True))

    def layer_names(self, index: int) -> list[str]:
        """The tensor names of decoder layer ``index`` (full names)."""
        prefix = f"{self.layers_name}.{index}."
        return [name for name in self.sources if name.startswith(prefix)]

    def outer_names(self) -> list[str]:
        """The tensor names outside the decoder layers: embeddings, final norm, head (tied ones once)."""
        prefix = f"{self.layers_name}."
        return [name for name in self.sources if not name.startswith(prefix)]

    def tensor(self, name: str) -> torch.Tensor:
        """The model's parameter or buffer called ``name`` (on ``meta`` unless materialized)."""
        return self._tensors[name]

    @contextlib.contextmanager
    def materialized(self, names: Iterable[str], module: nn.Module | None = None) -> Iterator[None]:
        """Load ``names`` from the checkpoint for the block; put them (and ``module``'s new parameters) back on meta.

        ``module`` (a decoder layer) also releases the parameters created inside it
        meanwhile, e.g. the quantization scale and zero point GPTQ adds.

        Raises:
            safetensors.SafetensorError / OSError: a checkpoint file could not be read.
        """
        names = list(names)
        try:
            self._load(names)
            yield
        finally:
            extra = list(module.parameters()) if module is not None else []
            for tensor in [*(self._tensors[n] for n in names), *extra]:
                if tensor.device.type != "meta":
                    _swap(tensor, torch.empty_like(tensor, device="meta"))

    def _load(self, names: list[str]) -> None:
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.sources[name][0], []).append(name)
        for file, group in by_file.items():
            with safe_open(str(self.directory / file), framework="pt") as handle:
                for name in group:
                    target = self._tensors[name]
                    value = handle.get_tensor(self.sources[name][1])
                    _swap(target, value.to(target.dtype) if value.dtype != target.dtype else value)


def _swap(target: torch.Tensor, value: torch.Tensor) -> None:
    """Give ``target`` (a parameter or buffer) ``value``'s data, keeping the Python object."""
    if isinstance(target, nn.Parameter):
        value = nn.Parameter(value, requires_grad=target.requires_grad)
    torch.utils.swap_tensors(target, value)


def _checkpoint_files(directory: Path) -> dict[str, str]:
    """``{checkpoint key: file name}`` of the safetensors checkpoint in ``directory`` (one file or shards)."""
    from safetensors import safe_open

    if (directory / _SINGLE_NAME).is_file():
        with safe_open(str(directory / _SINGLE_NAME), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), _SINGLE_NAME)
    if (directory / INDEX_NAME).is_file():
        return dict(json.loads((directory / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"])
    held = ", ".join(sorted(p.name for p in directory.glob("pytorch_model*.bin"))[:3])
    msg = (
        f"{directory}: low_memory reads safetensors weights (model.safetensors or {INDEX_NAME}), but the directory "
        f"holds {held or 'no safetensors file'}; convert it once with from_pretrained + save_pretrained"
    )
    raise ValueError(msg)


def _match_sources(model: nn.Module, directory: Path, files: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Map each state-dict tensor (tied ones once) to its checkpoint file and key; check names and shapes.

    Raises:
        ValueError: tensors missing from the checkpoint or of another shape (the first five are named).
    """
    from safetensors import safe_open

    groups: dict[int, list[str]] = {}
    tensors = model.state_dict(keep_vars=True)
    for name, tensor in tensors.items():
        groups.setdefault(id(tensor), []).append(name)
    sources: dict[str, tuple[str, str]] = {}
    missing: list[str] = []
    for names in groups.values():
        key = next((n for n in names if n in files), None)
        if key is None:
            missing.append(names[0])
        else:
            sources[names[0]] = (files[key], key)
    wrong: list[str] = []
    by_file: dict[str, list[str]] = {}
    for name, (file, _key) in sources.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(directory / file), framework="pt") as handle:
            for name in names:
                shape = list(handle.get_slice(sources[name][1]).get_shape())
                if shape != list(tensors[name].shape):
                    wrong.append(f"{name} {shape} (the config gives {list(tensors[name].shape)})")
    if missing or wrong:
        parts = [f"missing {', '.join(missing[:5])}" + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")]
        parts = (parts if missing else []) + ([f"other shapes: {', '.join(wrong[:5])}"] if wrong else [])
        msg = (
            f"{directory}: the checkpoint does not match the model its config.json describes ({'; '.join(parts)}); "
            "low_memory needs the tensor names from_pretrained/save_pretrained use: save the model again"
        )
        if any("experts" in name for name in missing):  # transformers 5 saves fused experts per expert
            msg = (
                f"{directory}: the checkpoint keeps mixture-of-experts weights per expert ({'; '.join(parts)}), "
                "which transformers fuses on load (its weight conversion); low_memory reads each tensor by the "
                "model's own name and does not convert them: run without low_memory"
            )
        raise ValueError(msg)
    return sources


def load_lazy(
    path: str | os.PathLike[str], torch_dtype: torch.dtype = torch.float32
) -> tuple[LazyModel, PreTrainedTokenizerBase | None]:
    """Build the causal LM in ``path`` on the ``meta`` device and index its safetensors checkpoint.

    ``path`` is checked as :func:`llmc_fsm.models.hf_io.load_hf_dir` checks it
    (``config.json``, weight files, every safetensors header), then every tensor
    of the model is looked up in the checkpoint (by name, with its shape) before
    anything is computed. No weight is read.

    Returns:
        ``(lazy model, tokenizer)``: the model is in eval mode with parameters of
        dtype ``torch_dtype`` on ``meta`` (tied embeddings tied); ``tokenizer`` is
        ``None`` when the directory has no tokenizer files.

    Raises:
        ValueError: a file is missing or corrupt, the weights are not safetensors,
            the checkpoint's tensors do not match the config (named), or the model
            has no decoder-layer list.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(path).expanduser()
    _check_model_dir(directory)
    files = _checkpoint_files(directory)
    config = AutoConfig.from_pretrained(str(directory))
    with init_empty_weights():  # parameters on meta; buffers (rotary inv_freq) computed as usual
        model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(torch_dtype))
    model.tie_weights()
    model.eval()
    check_tied(model, f"loading {directory}")
    sources = _match_sources(model, directory, files)
    layers_name, layers = find_decoder_layers(model)
    return LazyModel(model, directory, sources, layers_name, layers), _load_tokenizer(directory)


@attrs.define(eq=False)
class ShardWriter:
    """Writes a checkpoint shard by shard: ``model-0000k-of-0000n.safetensors`` and the index.

    Attributes:
        directory: an existing directory.
        num_shards: ``n``, known before the first shard is written.
        weight_map: ``{tensor name: file name}`` written so far.
        total_size: bytes of tensor data written so far.
    """

    directory: Path
    num_shards: int
    weight_map: dict[str, str] = attrs.field(factory=dict)
    total_size: int = 0

    def write(self, shard: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write ``tensors`` (contiguous, sharing no memory) as shard ``shard`` (1-based).

        Raises:
            ValueError: ``shard`` outside ``1..num_shards`` or already written.
            OSError: the file could not be written.
        """
        from safetensors.torch import save_file

        name = f"model-{shard:05d}-of-{self.num_shards:05d}.safetensors"
        if not 1 <= shard <= self.num_shards or name in self.weight_map.values():
            msg = f"shard {shard} is outside 1..{self.num_shards} or already written"
            raise ValueError(msg)
        save_file(dict(tensors), str(self.directory / name), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(tensors, name))
        self.total_size += sum(t.numel() * t.element_size() for t in tensors.values())

    def finish(self) -> None:
        """Write ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map`` sorted by name)."""
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def save_config(model: PreTrainedModel, directory: Path) -> None:
    """Write ``config.json`` (and ``generation_config.json``) as ``model.save_pretrained`` writes them.

    Sets ``config.dtype`` and ``config.architectures`` from the model first, as ``save_pretrained`` does; reads
    no weight, so the model may be on ``meta``.
    """
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)
