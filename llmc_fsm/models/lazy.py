"""A Hugging Face causal LM whose weights stay on disk until a part of it is needed (one-shot ``low_memory``).

:func:`load_lazy` builds the model from ``config.json`` with every parameter on
the ``meta`` device (``accelerate.init_empty_weights``: no memory; buffers such
as the rotary ``inv_freq`` are computed as usual) and indexes its safetensors
checkpoint — ``model.safetensors``, or shards listed in
``model.safetensors.index.json``. :meth:`LazyModel.materialized` loads the
tensors of one decoder layer (or of everything outside the decoder layers) and
puts them back on ``meta`` when the block ends.

Checkpoint keys are matched to the model's tensors with transformers' own
weight conversion (``get_model_conversion_mapping`` and
``core_model_loading.rename_source_key``, as ``from_pretrained`` applies them):
renamed keys (Mixtral's ``block_sparse_moe`` -> ``mlp``) are read under their
checkpoint name, and tensors that ``from_pretrained`` builds from several
checkpoint tensors (transformers 5's fused mixture-of-experts parameters
``experts.gate_up_proj`` / ``experts.down_proj``, from the per-expert
``experts.<e>.gate_proj.weight`` ...) are built by the same converter
(``WeightConverter.convert``) from the keys it collects, in the order
``from_pretrained`` collects them; a checkpoint that already holds the fused
tensors is read as it is.

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

from llmc_fsm.data.images import is_vision_language
from llmc_fsm.models.checkpoint_match import (
    INDEX_NAME,
    Conversion,
    checkpoint_files,
    match_checkpoint,
    mismatch_summary,
)
from llmc_fsm.models.hf_io import (
    _check_model_dir,
    _empty_model,
    _load_tokenizer,
    check_tied,
    dtype_kwargs,
    model_class,
)
from llmc_fsm.models.layers import find_decoder_layers

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "LazyModel",
    "ShardWriter",
    "load_lazy",
    "save_config",
]

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class LazyModel:
    """A model on the ``meta`` device and where each of its tensors lies in the checkpoint.

    Attributes:
        model: the model; its parameters are on ``meta`` except inside :meth:`materialized`.
        directory: the checkpoint directory.
        sources: ``{model tensor name: (file name, checkpoint key)}`` for every
            tensor of the state dict read as stored (possibly renamed), tied tensors once (under the first name).
        converted: ``{model tensor name: conversion}`` for the tensors transformers' weight conversion
            builds from several checkpoint tensors (fused experts); the tensors one conversion builds share it.
        layers_name: qualified name of the decoder-layer list (e.g. ``"model.layers"``).
        layers: the decoder layers.
    """

    model: PreTrainedModel
    directory: Path
    sources: dict[str, tuple[str, str]]
    layers_name: str
    layers: nn.ModuleList
    converted: dict[str, Conversion] = attrs.field(factory=dict)
    _tensors: dict[str, torch.Tensor] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._tensors = dict(self.model.state_dict(keep_vars=True))

    def layer_names(self, index: int) -> list[str]:
        """The tensor names of decoder layer ``index`` (full names)."""
        prefix = f"{self.layers_name}.{index}."
        return [name for name in (*self.sources, *self.converted) if name.startswith(prefix)]

    def outer_names(self) -> list[str]:
        """The tensor names outside the decoder layers: embeddings, final norm, head (tied ones once)."""
        prefix = f"{self.layers_name}."
        return [name for name in (*self.sources, *self.converted) if not name.startswith(prefix)]

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
        except BaseException:  # an error or an interruption (SIGTERM, Ctrl-C) on its way out: it is what is raised
            self._release(names, module, unwinding=True)
            raise
        self._release(names, module, unwinding=False)

    def _release(self, names: list[str], module: nn.Module | None, *, unwinding: bool) -> None:
        """Put ``names`` (and ``module``'s parameters) back on ``meta``. ``unwinding``: an exception is on its way
        out, whose traceback may still hold one of these tensors (then ``swap_tensors`` refuses it: "Expected
        use_count ... but got 2"); such a tensor keeps its values rather than replace the exception (a breaker's
        case: SIGTERM inside GPTQ's sweep of fused experts became that RuntimeError, and the run's kept progress was
        deleted as for a failure)."""
        extra = list(module.parameters()) if module is not None else []
        for tensor in [*(self._tensors[n] for n in names), *extra]:
            if tensor.device.type != "meta":
                try:
                    _swap(tensor, torch.empty_like(tensor, device="meta"))
                except RuntimeError:
                    if not unwinding:
                        raise

    def _load(self, names: list[str]) -> None:
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for name in names:
            if name in self.sources:
                by_file.setdefault(self.sources[name][0], []).append(name)
        for file, group in by_file.items():
            with safe_open(str(self.directory / file), framework="pt") as handle:
                for name in group:
                    _swap_cast(self._tensors[name], handle.get_tensor(self.sources[name][1]))
        wanted = set(names)
        conversions = {id(c): c for name, c in self.converted.items() if name in wanted}
        for conversion in conversions.values():
            built = conversion.run(self.model, lambda file, key: _read(self.directory / file, key))
            for name, value in built.items():
                if name in wanted:
                    _swap_cast(self._tensors[name], value)


def _read(path: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(key)


def _swap_cast(target: torch.Tensor, value: torch.Tensor) -> None:
    _swap(target, value.to(target.dtype) if value.dtype != target.dtype else value)


def _swap(target: torch.Tensor, value: torch.Tensor) -> None:
    """Give ``target`` (a parameter or buffer) ``value``'s data, keeping the Python object."""
    if isinstance(target, nn.Parameter):
        value = nn.Parameter(value, requires_grad=target.requires_grad)
    torch.utils.swap_tensors(target, value)


def _match_sources(
    model: nn.Module, directory: Path, files: Mapping[str, str]
) -> tuple[dict[str, tuple[str, str]], dict[str, Conversion]]:
    """Map each state-dict tensor (tied ones once) to the checkpoint tensors it is read or built from; check shapes.

    Each checkpoint key is renamed as ``from_pretrained`` renames it (transformers'
    ``rename_source_key`` with the model's ``get_model_conversion_mapping``: renamings,
    then at most one converter). A key a converter collects joins that converter's
    :class:`Conversion`, which is run once here on ``meta`` tensors of the stored
    shapes and dtypes (no data read) to learn the tensors it builds and check their
    shapes. Checkpoint keys that match no tensor are left unread, as ``from_pretrained``
    leaves unexpected keys. The conversions actually used are kept on the model as
    ``_weight_conversions``, as ``from_pretrained`` keeps them, so saving writes the
    checkpoint's layout back.

    Returns:
        ``(sources, converted)`` as in :class:`LazyModel`.

    Raises:
        ValueError: tensors missing from the checkpoint or of another shape, or a conversion that fails
            (the first five are named).
    """
    match = match_checkpoint(model, directory, files)
    missing, wrong = match.missing, [w[0] for w in match.wrong]
    if missing or wrong:
        msg = (
            f"{directory}: the checkpoint does not match the model its config.json describes "
            f"({mismatch_summary(missing, wrong)}); nothing was loaded: copy the complete checkpoint, or fix "
            "config.json"  # as in memory: saving again brings back no absent tensor (its advice before; a tester)
        )
        raise ValueError(msg)
    if match.mapping:
        model._weight_conversions = [t for t in match.mapping if t.was_used()]  # as from_pretrained keeps them
    return match.plain, match.converted


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
            the checkpoint's tensors do not match the config (named), the model
            has no decoder-layer list, or the config is a vision-language model's
            (:func:`llmc_fsm.data.images.is_vision_language`: its tower would be dropped).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    directory = Path(path).expanduser()
    _check_model_dir(directory)
    files = checkpoint_files(directory)
    config = AutoConfig.from_pretrained(str(directory), trust_remote_code=False)
    if is_vision_language(config):  # AutoModelForCausalLM would build the text model alone: the tower dropped
        msg = (
            f"{directory} holds a vision-language model (model_type {config.model_type!r}): the streamed path "
            "builds the text model alone, which would drop the vision tower from the output; run it in memory"
        )
        raise ValueError(msg)
    whole = model_class(config)
    if whole is not AutoModelForCausalLM:  # an encoder-decoder or audio-text model: parts dropped
        msg = (
            f"{directory} holds a model AutoModelForCausalLM does not build whole ({whole.__name__}, "
            f"model_type {config.model_type!r}): the streamed path would drop its other parts from the output; "
            "run it in memory"
        )
        raise ValueError(msg)
    with _empty_model():  # parameters on meta, not initialised; buffers (rotary inv_freq) computed as usual
        model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(torch_dtype))
    model.tie_weights()
    model.eval()
    check_tied(model, f"loading {directory}")
    if model.can_generate() and (directory / "generation_config.json").is_file():  # as from_pretrained reads it:
        with contextlib.suppress(OSError):  # an unreadable one is left for the config-derived one, as there
            model.generation_config = GenerationConfig.from_pretrained(str(directory))
    sources, converted = _match_sources(model, directory, files)
    layers_name, layers = find_decoder_layers(model)
    return LazyModel(model, directory, sources, layers_name, layers, converted), _load_tokenizer(directory)


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
