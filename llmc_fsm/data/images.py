"""Image-caption calibration data, for vision-language models: Mllama (whose cross-attention decoder layers need
images), LLaVA and Gemma 3 (whose decoder layers get the image features merged into the token embeddings).

The local format is the one Hugging Face's ``ImageFolder`` reads (``datasets.load_dataset("imagefolder",
data_dir=DIR)``): a directory holding a ``metadata.jsonl`` file, one JSON object per non-blank line with

* ``"file_name"``: the image file, relative to the directory (any format PIL opens; converted to RGB);
* ``"text"``: the text that goes with it (a caption, a prompt and its answer...).

A directory with that file is what ``dataset=`` / ``--dataset`` recognises as image calibration data (a directory
without it stays an error, as before). The first ``num_calibration_samples`` records are used, in file order. A text
that does not hold the processor's image placeholder (``processor.image_token``: ``<|image|>`` Mllama, ``<image>``
LLaVA, ``<start_of_image>`` Gemma 3) is made a prompt with one: through the processor's chat template when it has
one (a user turn holding the image then the text, as llm-compressor's multimodal examples build theirs), else with
the placeholder in front. The processor (``AutoProcessor`` of the model directory) tokenizes it (truncated to
``max_seq_length`` tokens), expands the placeholder into the model's image tokens and lays out the image as the
model takes it: for Mllama ``pixel_values [B, 1, tiles, C, H, W]``, ``aspect_ratio_ids [B, 1]``,
``aspect_ratio_mask [B, 1, tiles]``, ``cross_attention_mask [B, L, 1, tiles]``; for LLaVA and Gemma 3
``pixel_values [B, C, H, W]`` (Gemma 3 also ``token_type_ids [B, L]``, 1 on image tokens); always ``input_ids``
and ``attention_mask [B, L]`` (rows padded to the longest of their batch, as llm-compressor's multimodal examples
feed ``processor(text=..., images=...)``).

Source of the layout: transformers' ``MllamaProcessor``, ``LlavaProcessor``, ``Gemma3Processor``; llm-compressor's
``examples/multimodal_vision`` (flickr30k captions through the model's processor).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import attrs
import torch

from llmc_fsm.data.protocol import kept_tokenizer_state
from llmc_fsm.data.text_files import jsonl_records, read_utf8

__all__ = [
    "IMAGE_FAMILIES",
    "METADATA",
    "PROCESSOR_FILES",
    "ImageBatches",
    "ImageCaptions",
    "check_calibration_data",
    "copy_processor_files",
    "cross_attention_layers",
    "image_batches",
    "image_prompt",
    "images_refused",
    "is_image_dataset",
    "is_processor",
    "is_vision_language",
    "load_error",
    "load_processor",
    "processor_files",
    "read_image_captions",
    "text_tokenizer",
]

#: The file that makes a directory an image-caption dataset (Hugging Face ImageFolder's metadata file).
METADATA = "metadata.jsonl"

#: What to give for images, quoted by every refusal.
IMAGE_DATA_HINT = (
    f'a directory with {METADATA}, one {{"file_name": image, "text": caption}} per line (dataset=, --dataset; '
    'docs/architectures.md, "Mllama")'
)

#: The ``model_type`` of the vision-language models that calibrate on images (each tested on a tiny random model
#: with its processor built offline, tests/test_multimodal_calibration.py and tests/test_multimodal_families.py).
IMAGE_FAMILIES = {"mllama": "Mllama", "llava": "LLaVA", "gemma3": "Gemma 3"}

#: Vision-language models refused image data: the processor class transformers 5.24 gives them, and what of it needs
#: torchvision (the torchvision for torch 2.13 on the package index is a CUDA build, whose operators do not load
#: beside the CPU torch: docs/architectures.md, measured).
_NO_IMAGES = {
    "qwen2_vl": ("Qwen2VLProcessor", " for its video processor"),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", " for its video processor"),
    "mistral3": ("PixtralProcessor", ""),
}


def _no_images_reason(model_type: str) -> str:
    processor, part = _NO_IMAGES[model_type]
    return (
        f"its processor ({processor}) needs torchvision{part}, which llmc-fsm does not install, so its image path "
        "was not built or tested"
    )


#: What to give a model that calibrates on text, quoted by the refusals of image data.
TEXT_DATA_HINT = "give a text/JSONL file, a Hugging Face dataset name or a LongTensor [N, L] of token ids"


@attrs.frozen
class ImageCaptions:
    """The records of an image-caption directory: ``(file_name, text)`` pairs, image files checked to exist."""

    directory: Path
    records: tuple[tuple[str, str], ...]

    def digest(self) -> str:
        """sha256 over every record and its image file's bytes (what a resumed run compares)."""
        h = hashlib.sha256()
        for name, text in self.records:
            h.update(json.dumps([name, text]).encode())
            h.update((self.directory / name).read_bytes())
        return h.hexdigest()


class ImageBatches(list):
    """Calibration batches of model inputs (dicts of tensors, ``model(**batch)``) made from images and text.

    A ``list`` of the batch dicts, plus what the one-shot job reads of a windows tensor: :attr:`shape`
    ``(samples, longest row in tokens)`` and :meth:`numel` (tokens that are not padding). A slice is again an
    :class:`ImageBatches` (of whole batches).
    """

    @property
    def shape(self) -> tuple[int, int]:
        """``(number of samples, tokens of the longest row)``."""
        rows = sum(int(b["input_ids"].shape[0]) for b in self)
        return rows, max((int(b["input_ids"].shape[1]) for b in self), default=0)

    def numel(self) -> int:
        """Tokens that are not padding (the sum of the attention masks)."""
        return sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel() for b in self)

    def __getitem__(self, index: Any) -> Any:
        item = super().__getitem__(index)
        return ImageBatches(item) if isinstance(index, slice) else item


#: The files a transformers processor writes beside its tokenizer's (``ProcessorMixin.save_pretrained`` and its
#: image, video and audio parts; transformers 5's ``PROCESSOR_NAME``, ``IMAGE_PROCESSOR_NAME`` /
#: ``FEATURE_EXTRACTOR_NAME``, ``VIDEO_PROCESSOR_NAME``, ``AUDIO_TOKENIZER_NAME``, ``CHAT_TEMPLATE_FILE``,
#: ``LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE``), and the folder of its named chat templates (``CHAT_TEMPLATE_DIR``).
PROCESSOR_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "audio_tokenizer_config.json",
    "chat_template.json",
    "chat_template.jinja",
)
PROCESSOR_TEMPLATES_DIR = "additional_chat_templates"


def is_processor(value: Any) -> bool:
    """Whether ``value`` is a transformers processor (a ``ProcessorMixin``: ``Gemma3Processor``,
    ``LlavaProcessor``...), whose first positional argument is images (or audio), not text. Read from the class's
    bases by name, so that transformers is not imported for it."""
    return any(cls.__name__ == "ProcessorMixin" for cls in type(value).__mro__)


def text_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer that tokenizes text: a processor's own ``tokenizer`` (:func:`is_processor`; called as
    ``tokenizer(text)`` a processor takes the text for images: found by a tester, ``processor=`` with text
    calibration failed in transformers' image loading), else ``tokenizer`` as it is (``None`` included)."""
    inner = getattr(tokenizer, "tokenizer", None) if is_processor(tokenizer) else None
    return tokenizer if inner is None else inner


def processor_files(directory: Path) -> list[str]:
    """The processor's files (:data:`PROCESSOR_FILES`, and the files of its ``additional_chat_templates`` folder as
    ``additional_chat_templates/<name>``) that ``directory`` holds, in that order (``[]``: none)."""
    found = [name for name in PROCESSOR_FILES if (directory / name).is_file()]
    templates = directory / PROCESSOR_TEMPLATES_DIR
    if templates.is_dir():
        found += [f"{PROCESSOR_TEMPLATES_DIR}/{p.name}" for p in sorted(templates.iterdir()) if p.is_file()]
    return found


def copy_processor_files(source: Path, destination: Path) -> list[str]:
    """Copy the processor's files of the model directory ``source`` (:func:`processor_files`) into ``destination``
    byte for byte (a link is copied as the file it points to), leaving out those ``destination`` holds already (the
    tokenizer's save writes ``chat_template.jinja`` too); the names copied, in :func:`processor_files`' order.

    Raises:
        OSError: a file cannot be read or written (the ones copied before it stay in ``destination``).
    """
    copied = []
    for name in processor_files(source):
        target = destination / name
        if target.exists():
            continue
        target.parent.mkdir(exist_ok=True)
        shutil.copyfile(source / name, target)
        copied.append(name)
    return copied


def is_image_dataset(source: Any) -> bool:
    """Whether ``source`` (a ``dataset=`` value) is a directory holding :data:`METADATA`."""
    return isinstance(source, str | os.PathLike) and (Path(source).expanduser() / METADATA).is_file()


def read_image_captions(source: str | os.PathLike[str], num_samples: int) -> ImageCaptions:
    """The first ``num_samples`` records of the image-caption directory ``source``.

    Raises:
        ValueError: a line that is not valid UTF-8 / JSON, or not an object with string ``"file_name"`` and
            ``"text"`` (``{path}:{line}: ...``); fewer records than ``num_samples`` (both counts, and what to lower).
        FileNotFoundError: a record's image file does not exist (file and line named).
    """
    directory = Path(source).expanduser()
    path = directory / METADATA
    records: list[tuple[str, str]] = []
    for number, record in jsonl_records(path, read_utf8(path)):
        if len(records) == num_samples:
            break
        if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("file_name", "text")):
            msg = f'{path}:{number}: expected a JSON object with string "file_name" and "text" fields'
            raise ValueError(msg)
        if not (directory / record["file_name"]).is_file():
            msg = f"{path}:{number}: image file not found: {directory / record['file_name']}"
            raise FileNotFoundError(msg)
        records.append((record["file_name"], record["text"]))
    if len(records) < num_samples:
        msg = (
            f"the image dataset {os.fspath(source)} has {len(records)} records but {num_samples} calibration samples "
            f"were asked for; lower --num-samples / num_calibration_samples to at most {len(records)} or add records"
        )
        raise ValueError(msg)
    return ImageCaptions(directory=directory, records=tuple(records))


def is_vision_language(config: Any) -> bool:
    """Whether ``config`` is a vision-language model's: it has a ``vision_config`` and its ``model_type`` is one
    ``AutoModelForImageTextToText`` loads (transformers' ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (
        getattr(config, "vision_config", None) is not None
        and getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    )


def cross_attention_layers(config: Any) -> list[int]:
    """The decoder layers that read image states (``cross_attention_layers`` of the text config: Mllama); ``[]``
    for every other model."""
    text = getattr(config, "text_config", None) or config
    layers = getattr(text, "cross_attention_layers", None)
    return list(layers) if isinstance(layers, list | tuple) else []


def _family(model: Any) -> tuple[Any, str]:
    """``(config, "Class (model_type 'x')")`` of a model (its class) or a config (its ``architectures``), named as
    the other refusals name a model."""
    config = model if not isinstance(model, torch.nn.Module) else getattr(model, "config", None)
    if isinstance(model, torch.nn.Module):
        name = type(model).__name__
    else:
        name = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    model_type = getattr(config, "model_type", None)
    return config, f"{name} (model_type {model_type!r})" if model_type else name


def images_refused(model: Any) -> str | None:
    """Why ``model`` (an ``nn.Module`` or a config) is refused image calibration data, as a clause naming it and
    ending with what to do (e.g. "Idefics3ForConditionalGeneration (model_type 'idefics3') is a vision-language
    model whose image calibration is not tested (image data is for ...): calibrate its language model on text");
    ``None`` for one of :data:`IMAGE_FAMILIES`. The refusals of image data that is not a directory (a dataset's
    ``pixel_values`` column) quote it, so they do not steer to an image directory :func:`check_calibration_data`
    refuses next (found by a tester, on Idefics3)."""
    config, family = _family(model)
    model_type = getattr(config, "model_type", None)
    if model_type in IMAGE_FAMILIES:
        return None
    tested = ", ".join(f"{name} ({key!r})" for key, name in IMAGE_FAMILIES.items())
    if model_type in _NO_IMAGES:
        reason = _no_images_reason(model_type)
        return f"{family} cannot calibrate on images ({reason}): calibrate its language model on text"
    if is_vision_language(config):
        return (
            f"{family} is a vision-language model whose image calibration is not tested (image data is for "
            f"{tested}): calibrate its language model on text"
        )
    return f"{family} calibrates on text (image data is for the vision-language models {tested})"


def check_calibration_data(model: Any, *, images: bool, source: Any) -> None:
    """Refuse, before any work, calibration data of the wrong kind for ``model`` (an ``nn.Module`` or the
    ``config`` of a model directory).

    ``images``: the data is an image-caption directory (``source``); else token ids / text.

    Raises:
        ValueError: one line naming the model and what to give: a model with cross-attention layers (Mllama) given
            text; images for a model that is not one of :data:`IMAGE_FAMILIES` (a text model; Qwen2-VL,
            Qwen2.5-VL and Mistral 3 with why; another vision-language model, untested).
    """
    config, family = _family(model)
    layers = cross_attention_layers(config)
    if layers and not images:
        msg = (
            f"{family} has cross-attention decoder layers {layers} that read the vision tower's output, which text "
            f"calibration data (token ids) does not run: give image calibration data, {IMAGE_DATA_HINT}"
        )
        raise ValueError(msg)
    model_type = getattr(config, "model_type", None)
    if not images or model_type in IMAGE_FAMILIES:
        return
    tested = ", ".join(f"{name} ({key!r})" for key, name in IMAGE_FAMILIES.items())
    if model_type in _NO_IMAGES:
        msg = (
            f"{family} cannot calibrate on images: {_no_images_reason(model_type)}; calibrate its language model on "
            f"text: {TEXT_DATA_HINT}"
        )
    elif is_vision_language(config):
        msg = (
            f"{family} is a vision-language model whose image calibration is not tested (image data is for {tested}); "
            f"calibrate its language model on text: {TEXT_DATA_HINT}"
        )
    else:
        msg = (
            f"{family} calibrates on text: the image dataset {os.fspath(source)} is for vision-language models "
            f"({tested}); {TEXT_DATA_HINT}"
        )
    raise ValueError(msg)


def load_error(err: BaseException) -> str:
    """``"<ErrorType>: <first sentence of its message>"``: why a processor could not be loaded, in one line
    (transformers' messages run on with installation advice)."""
    cause = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    cause = cause.split(". ")[0].rstrip(".")
    return f"{type(err).__name__}: {cause}"


def load_processor(tokenizer: Any, model: Any) -> Any:
    """The processor that turns images and text into model inputs: ``tokenizer`` when it is one (has an
    ``image_processor``), else ``AutoProcessor.from_pretrained`` of ``tokenizer`` (a directory) or of ``model`` (a
    directory).

    Raises:
        ValueError: neither gives a processor (an in-memory model without one); the message says what to pass. A
            directory whose processor cannot be loaded (e.g. an ``ImportError``: a library it needs is missing):
            one line naming the directory and the cause's first line.
    """
    if hasattr(tokenizer, "image_processor"):
        return tokenizer
    from transformers import AutoProcessor

    for where in (tokenizer, model):
        if isinstance(where, str | os.PathLike) and Path(where).expanduser().is_dir():
            directory = os.fspath(Path(where).expanduser())
            try:
                processor = AutoProcessor.from_pretrained(directory, trust_remote_code=False)
            except (ImportError, OSError, ValueError, TypeError, AttributeError) as err:
                msg = (
                    f"the processor of {directory} could not be loaded ({load_error(err)}); image "
                    "calibration data needs it (images and text to model inputs)"
                )
                raise ValueError(msg) from err
            if hasattr(processor, "image_processor"):
                return processor
    msg = (
        "image calibration data needs the model's processor (images and text to model inputs): pass "
        "tokenizer=AutoProcessor.from_pretrained(<model directory>) or the model directory (model=, --model)"
    )
    raise ValueError(msg)


def image_prompt(processor: Any, text: str) -> str:
    """``text`` as a prompt holding one image: unchanged when it holds ``processor.image_token`` (the placeholder
    the processor expands); else the processor's chat template applied to one user turn ``[image, text]``
    (``add_generation_prompt=False``), as llm-compressor's multimodal examples build theirs; else the placeholder in
    front of the text (a processor without a chat template)."""
    token = getattr(processor, "image_token", None)
    if token is None or token in text:
        return text
    if getattr(processor, "chat_template", None):
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        return processor.apply_chat_template(turn, tokenize=False, add_generation_prompt=False)
    return f"{token}{text}"


def image_batches(processor: Any, captions: ImageCaptions, *, batch_size: int, max_seq_length: int) -> ImageBatches:
    """The records of ``captions`` as model inputs, ``batch_size`` records per batch (the last may hold fewer).

    Each text is made a prompt holding the image (:func:`image_prompt`); ``processor(text=..., images=[[image]]
    per row, padding=True, truncation=True, max_length=max_seq_length, return_tensors="pt")`` makes the batch
    (the tensors of the module docstring).
    """
    from PIL import Image

    out = ImageBatches()
    for start in range(0, len(captions.records), batch_size):
        chunk = captions.records[start : start + batch_size]
        texts = [image_prompt(processor, text) for _, text in chunk]
        images = []
        for name, _ in chunk:
            with Image.open(captions.directory / name) as image:
                images.append([image.convert("RGB")])
        with kept_tokenizer_state(getattr(processor, "tokenizer", processor)):  # saved beside the model after
            batch = processor(
                text=texts,
                images=images,
                padding=True,
                truncation=True,
                max_length=max_seq_length,
                return_tensors="pt",
            )
        out.append({k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})
    return out
