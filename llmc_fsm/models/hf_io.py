"""Hugging Face model files: load a model directory or a Hub model ID with one-line errors; fix file modes.

* :func:`load_hf_dir` checks a local directory before ``from_pretrained`` sees it
  (``config.json``, weight files, every safetensors header, an index listing tensors, every tensor the
  config's model needs present and of its shape), so a directory with
  only ``config.json``, a truncated ``model.safetensors`` or a checkpoint missing a tensor fails with one line
  naming the file or tensor; a directory without tokenizer files loads with tokenizer ``None``.
* :func:`load_hub` loads ``org/name`` through ``from_pretrained`` and the Hugging
  Face cache; failures name the ID, ``HF_HUB_OFFLINE`` and the cache searched. When the Hub cannot be reached
  (:func:`hub_unreachable`, one TCP connection, 3 s at most), a cached model loads from the cache and an
  uncached one fails at once instead of after ``from_pretrained``'s retries.
* :func:`model_class` picks the class: ``AutoModelForImageTextToText`` for a vision-language model's config
  (:func:`is_vision_language`: Mllama, LLaVA, Qwen2-VL, Gemma 3, Mistral 3...), so the vision tower and projector
  are loaded, kept and saved whatever the recipe; ``AutoModelForCausalLM`` for every other config.
* :func:`fix_safetensors_permissions` undoes the ``0600`` mode safetensors >= 0.8
  gives the files it writes.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llmc_fsm.data.images import is_vision_language
from llmc_fsm.models.checkpoint_match import check_checkpoint_tensors, mismatch_summary

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "check_safetensors",
    "check_tied",
    "checkpoint_key_renamer",
    "current_umask",
    "dtype_kwargs",
    "first_line",
    "fix_safetensors_permissions",
    "hub_model_unavailable",
    "hub_unreachable",
    "is_vision_language",
    "load_hf_dir",
    "load_hub",
    "looks_like_hub_id",
    "meta_model",
    "model_class",
    "safetensors_index",
]

logger = logging.getLogger(__name__)

#: Weight files ``from_pretrained`` looks for in a model directory.
#: ``from_pretrained`` is not thread-safe (transformers keeps loading state, e.g. weight tying and
#: initialisation switches, in module globals): two threads loading at once can return a model whose declared tied
#: embeddings are two tensors. Every load of this module holds this lock, so loads in one process run one at a time.
_LOAD_LOCK = threading.Lock()

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
#: Files of which at least one is present when a model directory ships a tokenizer.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (``/proc/self/status``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # a restrictive value for the instant it is set
    os.umask(mask)
    return mask


def fix_safetensors_permissions(directory: str | os.PathLike[str]) -> list[Path]:
    """Give every ``*.safetensors`` file under ``directory`` the mode a new file gets under the umask.

    ``safetensors`` >= 0.8 writes through a temporary file that is always created
    ``0600`` and renamed into place (safetensors issue #782), so ``model.safetensors``
    ends up private while ``config.json`` and the tokenizer files follow the umask
    (``0644`` under umask ``022``).  Call this on a directory right after
    ``save_pretrained`` wrote it; files of other names are not touched.

    Returns:
        The files whose mode was changed, sorted.

    Raises:
        OSError: a file's mode could not be changed (e.g. not its owner).
    """
    mode = 0o666 & ~current_umask()
    changed = []
    for file in sorted(Path(directory).rglob("*.safetensors")):
        if file.is_file() and not file.is_symlink() and (file.stat().st_mode & 0o777) != mode:
            file.chmod(mode)
            changed.append(file)
    return changed


def dtype_kwargs(torch_dtype: torch.dtype) -> dict[str, Any]:
    """``{"dtype": torch_dtype}`` for ``from_pretrained`` (``torch_dtype`` before transformers 4.56)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return {key: torch_dtype}


def check_tied(model: PreTrainedModel, where: str) -> None:
    """Check that embeddings the config ties (``tie_word_embeddings``) are one tensor: the output head's weight is
    an embedding's (the input embedding, or in an encoder-decoder model the decoder's: T5Gemma's head is tied to its
    decoder's embedding, and ``get_input_embeddings()`` is the encoder's, which refused a checkpoint transformers
    loads: found by a tester).

    Raises:
        RuntimeError: the config ties them but ``lm_head.weight`` is no embedding's (message prefixed ``where``).
    """
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    out = model.get_output_embeddings()
    embeddings = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if out is None or not any(out.weight is w for w in embeddings):
        msg = f"{where}: config says tie_word_embeddings=True but lm_head.weight is not the embedding weight"
        raise RuntimeError(msg)


def model_class(config: Any) -> Any:
    """The class that loads ``config``'s model with every part of the checkpoint: ``AutoModelForImageTextToText``
    for a vision-language model (:func:`is_vision_language`; ``AutoModelForCausalLM`` gives Mllama's text model
    alone and refuses LLaVA's config); ``AutoModelForCausalLM`` for a decoder-only config it maps; else the first
    class of the config's ``architectures`` that transformers has: an audio-text model no Auto class for causal
    LMs maps (Qwen2-Audio: ``Qwen2AudioForConditionalGeneration``), an encoder-decoder model (Whisper:
    ``WhisperForConditionalGeneration``, where ``AutoModelForCausalLM`` builds ``WhisperForCausalLM``, the decoder
    alone: the encoder would be dropped from the output); else ``AutoModelForCausalLM`` (its error names the
    config)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if is_vision_language(config):
        return AutoModelForImageTextToText
    if type(config) in AutoModelForCausalLM._model_mapping and not getattr(config, "is_encoder_decoder", False):
        return AutoModelForCausalLM
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and hasattr(cls, "from_pretrained"):
            return cls
    return AutoModelForCausalLM


def meta_model(config: Any, dtype: Any = None) -> Any:
    """The model ``config`` describes, built by :func:`model_class` with every parameter on the ``meta`` device (no
    memory, no weight read; buffers such as rotary tables computed as usual), tied weights tied, in eval mode;
    its parameters in ``dtype`` (a ``torch.dtype``; ``None``: torch's default dtype, as ``from_config``), the dtype
    the model will be loaded in, which some checks read (NVFP4 / MX need bfloat16).

    ``config`` itself is not changed: the model is built from a copy (a model class may set fields of the config it
    is given: Whisper's ``WhisperForCausalLM``, which the causal-LM fallback builds for a config without
    ``architectures``, sets ``is_encoder_decoder = False``; on a live model's config that broke its ``generate`` and
    its saved ``config.json``).

    Raises:
        whatever transformers raises for a config it cannot build (``ValueError``, ``KeyError``, ...).
    """
    config = copy.deepcopy(config)
    with _empty_model():
        cls = model_class(config)
        build = getattr(cls, "from_config", None) or cls._from_config  # an Auto class's, or a model class's own
        model = build(config, **({"dtype": dtype} if dtype is not None else {}))
    model.tie_weights()
    return model.eval()


def checkpoint_key_renamer(model: Any) -> Any:
    """A function ``key -> (name, pattern)`` renaming a checkpoint tensor name as ``from_pretrained`` renames it into
    ``model`` (transformers' ``rename_source_key`` with the model's ``get_model_conversion_mapping``: Gemma 3's
    ``vision_tower.encoder...`` is ``model.vision_tower.encoder...``, Mixtral's ``block_sparse_moe.gate`` the router
    ``mlp.gate``); ``pattern`` is not ``None`` for a key a conversion collects into a fused tensor (an expert matrix
    of fused experts). A key that renames to no tensor of ``model`` but is one as stored keeps its name
    (``from_pretrained``'s fallback)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    state = model.state_dict(keep_vars=True)
    mapping = get_model_conversion_mapping(model) if hasattr(model, "base_model_prefix") else []
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None)

    def rename(key: str) -> tuple[str, Any]:
        name, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if name not in state and key in state:
            return key, None
        return name, pattern

    return rename


@contextlib.contextmanager
def _empty_model() -> Iterator[None]:
    """Build models with every parameter on the ``meta`` device (``accelerate.init_empty_weights``) and without
    transformers' weight initialisation (``transformers.initialization.no_init_weights``): initialising a meta
    parameter computes nothing, and the pass over every module took ~0.07 s per SmolLM2-135M build (a third of a
    data-free job's load). Buffers (rotary tables) are computed as usual: the same buffers as a build with the
    initialisation on 45 families of ``tests/tiny_families.py`` (checked by a test)."""
    from accelerate import init_empty_weights

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # a transformers without it: initialised as before
        no_init_weights = contextlib.nullcontext
    with init_empty_weights(), no_init_weights():
        yield


def first_line(err: BaseException) -> str:
    """``"<ErrorType>: <first line of its message>"``, for one-line error messages."""
    return _first_line(err)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def safetensors_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` (``{tensor name: shard file name}``) of a ``model.safetensors.index.json``.

    Raises:
        ValueError: the file is not UTF-8 JSON with a ``weight_map`` object, or that object is empty (one line naming
            the file).
    """
    try:
        weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}")
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # UnicodeDecodeError is a ValueError
        msg = f'{index}: not a valid safetensors index (needs a "weight_map" object): {_first_line(err)}'
        raise ValueError(msg) from None
    if not weight_map:  # from_pretrained failed on it with an IndexError deep in transformers (found by a tester)
        msg = (
            f"{index}: the index lists no tensors (its weight_map is empty); copy the model's complete "
            f"{index.name} or save the model again"
        )
        raise ValueError(msg)
    return dict(weight_map)


def check_safetensors(file: Path) -> None:
    """Fail with one line naming ``file`` when its safetensors header cannot be read.

    Raises:
        ValueError: truncated or corrupt (or not a safetensors file).
    """
    _check_safetensors(file)


def _check_safetensors(file: Path) -> None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt"):
            pass
    except (SafetensorError, OSError) as err:
        msg = (
            f"{file}: not a valid safetensors file ({_first_line(err)}); it is probably truncated or corrupt: "
            "copy or save the model again"
        )
        raise ValueError(msg) from None


def _check_model_dir(path: Path) -> None:
    """Fail with one line naming the file when ``path`` lacks ``config.json`` or usable weights, or holds a peft
    adapter beside the model (``adapter_config.json``)."""
    if not (path / "config.json").is_file():
        msg = f"{path} is not a Hugging Face model directory: config.json is missing"
        raise ValueError(msg)
    if (path / "adapter_config.json").is_file():  # transformers attaches it on load: in memory the save failed
        msg = (  # after all the work, low_memory dropped it without a word (found by a tester)
            f"{path} holds a peft adapter (adapter_config.json) beside the model's weights, which transformers "
            "attaches when loading; llmc-fsm compresses a plain model: merge the adapter first (peft: "
            "PeftModel.from_pretrained(base, DIR).merge_and_unload().save_pretrained(NEW_DIR)) or move the adapter "
            "files out of the directory"
        )
        raise ValueError(msg)
    present = [name for name in _WEIGHT_FILES if (path / name).is_file()]
    if not present:
        held = ", ".join(sorted(p.name for p in path.iterdir())[:8])
        msg = (
            f"{path}: no model weights: none of {', '.join(_WEIGHT_FILES)} exists (the directory holds: {held}); "
            "copy the weights there or save the model again"
        )
        raise ValueError(msg)
    if present[0] == "model.safetensors":
        _check_safetensors(path / "model.safetensors")
    elif present[0] == "model.safetensors.index.json":
        index = path / "model.safetensors.index.json"
        shards = sorted(set(safetensors_index(index).values()))
        for shard in shards:
            if not (path / shard).is_file():
                msg = f"{path / shard}: missing (listed in {index.name}); copy all weight shards"
                raise ValueError(msg)
            _check_safetensors(path / shard)


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        logger.info("%s has no tokenizer files; only token-id data can be used with this model", path)
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError) as err:
        refusal = remote_code_refusal(str(path), err, what="the tokenizer of")
        if refusal is not None:  # not fatal: a tokenizer may be given, or token ids; text needing it is refused
            logger.warning("%s: it is not loaded; only token-id data (or a tokenizer given) can be used", refusal)
            return None
        msg = f"{path}: the tokenizer files could not be loaded ({_first_line(err)})"
        raise ValueError(msg) from err


def remote_code_refusal(model: str, err: BaseException, what: str = "model") -> str | None:
    """One line for transformers' refusal to load a repository whose classes are its own code (``auto_map`` in
    ``config.json``, no model of its type in transformers), else ``None``. llmc-fsm passes ``trust_remote_code=False``
    everywhere: transformers asked "Do you wish to run the custom code? [y/N]" on the terminal, and a ``y`` ran the
    repository's Python files (found by a tester)."""
    text = str(err)
    if "custom code" not in text and "trust_remote_code" not in text:
        return None
    files = "config.json's" if what == "model" else "tokenizer_config.json's"
    return (
        f"{what} {model!r} needs the Python code in its repository ({files} auto_map names classes transformers "
        "does not have): llmc-fsm loads transformers' own classes only and never runs a repository's code "
        "(as llm-compressor with trust_remote_code_model=False)"
    )


def load_hf_dir(path: Path, torch_dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a local Hugging Face model directory after checking its files.

    Returns:
        ``(model, tokenizer)`` in eval mode on CPU, parameters in ``torch_dtype``, of :func:`model_class` (a
        vision-language model with its vision tower); ``tokenizer`` is ``None`` when the directory has no
        tokenizer files.

    Raises:
        ValueError: ``config.json`` or the weights are missing, a safetensors
            file (or shard) is truncated/corrupt, the index lists no tensors, the checkpoint lacks a parameter
            of the model ``config.json`` describes or holds one of another shape (before any weight is read; a
            ``pytorch_model.bin`` one after loading), ``from_pretrained`` fails, or
            tokenizer files exist but cannot be loaded; the message names the file.
        RuntimeError: tied embeddings are declared but not tied after loading.
    """
    from safetensors import SafetensorError
    from transformers import AutoConfig

    _check_model_dir(path)
    with _LOAD_LOCK:
        try:
            config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
            # names and shapes only: any dtype does ("auto" too, which from_pretrained takes and from_config not)
            skeleton = meta_model(config, torch_dtype if isinstance(torch_dtype, torch.dtype) else None)
        except (OSError, ValueError, SafetensorError) as err:
            raise _load_error(path, err) from err
        if not any(getattr(config, k, None) for k in ("quantization_config", "compression_config")):
            check_checkpoint_tensors(skeleton, path)  # before any weight is read; a quantized layout is the quantizer's
        try:
            model, info = model_class(config).from_pretrained(
                str(path),
                config=config,
                **dtype_kwargs(torch_dtype),
                trust_remote_code=False,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # refused below, in one line, rather than in transformers' report
            )
        except (OSError, ValueError, SafetensorError) as err:
            raise _load_error(path, err) from err
        _check_loading_info(model, info, path)
        tokenizer = _load_tokenizer(path)
    model.eval()
    check_tied(model, f"loading {path}")
    return model, tokenizer


def _load_error(path: Path, err: BaseException) -> ValueError:
    return ValueError(remote_code_refusal(str(path), err) or f"could not load the model in {path}: {_first_line(err)}")


def _check_loading_info(model: PreTrainedModel, info: dict[str, Any], path: Path | str) -> None:
    """Refuse what ``from_pretrained`` reports it filled with random values: parameters missing from the checkpoint,
    tensors of another shape (``pytorch_model.bin`` weights, which :func:`~llmc_fsm.models.checkpoint_match.
    check_checkpoint_tensors` does not read before loading). Missing buffers are left alone (computed at
    construction).

    Raises:
        ValueError: one line naming ``path`` (a directory or Hub ID), the missing parameters and the tensors of another
            shape.
    """
    params = {name for name, _ in model.named_parameters()}
    missing = sorted(k for k in info.get("missing_keys", ()) if k in params)
    wrong = [
        f"{k} is {list(stored)}, config.json gives {list(expected)}"
        for k, stored, expected in sorted(info.get("mismatched_keys", ()))
    ]
    if not missing and not wrong:
        return
    msg = (
        f"{path}: the checkpoint does not match the model its config.json describes "
        f"({mismatch_summary(missing, wrong)}); from_pretrained filled those with random values: copy the complete "
        "checkpoint, or fix config.json"
    )
    raise ValueError(msg)


def looks_like_hub_id(key: str) -> bool:
    """True for strings shaped like a Hugging Face Hub model ID, ``org/name`` (one slash, no ``..``)."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", key) is not None and ".." not in key


def hub_unreachable(endpoint: str, timeout_s: float = 3.0) -> str | None:
    """Why a TCP connection to the Hub ``endpoint`` (a URL) cannot be opened within ``timeout_s`` s, or ``None``.

    ``None`` without trying when a proxy is configured (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``, any case):
    the Hub is then reached through it, and ``from_pretrained`` reports what fails.
    """
    if any(
        os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
    ):
        return None
    parts = urllib.parse.urlsplit(endpoint)
    if not parts.hostname:
        return f"no host in {endpoint!r}"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            return None
    except OSError as err:
        return f"{parts.hostname}:{port}: {err.strerror or err}"


def hub_model_unavailable(model_id: str) -> str | None:
    """Why the Hub model ID ``model_id`` cannot be loaded, known before anything is downloaded: its config is not
    in the Hugging Face cache and the Hub cannot be reached (:func:`hub_unreachable`, 3 s at most) — the message
    :func:`load_hub` raises; ``None`` otherwise (``HF_HUB_OFFLINE=1`` is :func:`load_hub`'s own case)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        return None
    unreachable = hub_unreachable(constants.ENDPOINT)
    return None if unreachable is None else _not_in_cache_nor_reachable(model_id, unreachable)


def _not_in_cache_nor_reachable(model_id: str, unreachable: str) -> str:
    from huggingface_hub import constants

    where = f"HF_HUB_OFFLINE=0, Hugging Face cache searched: {constants.HF_HUB_CACHE}"
    return (
        f"model {model_id!r} is not a known name or a local directory, and as a Hugging Face Hub model ID it is not "
        f"in the cache ({where}) and the Hub cannot be reached ({unreachable}): connect to the network, point "
        "HF_HUB_CACHE at a cache that holds it, or pass a local model directory"
    )


def load_hub(model_id: str, torch_dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load ``model_id`` (``org/name``) with ``from_pretrained`` through the Hugging Face cache.

    The cache is ``huggingface_hub``'s (``HF_HUB_CACHE``, default
    ``~/.cache/huggingface/hub``); with ``HF_HUB_OFFLINE=1`` only the cache is read.
    Remote code is never run (``trust_remote_code`` stays off).

    Returns:
        ``(model, tokenizer)`` in eval mode on CPU, of :func:`model_class`; ``tokenizer`` is ``None`` (with
        a warning) when the repository has no loadable tokenizer.

    Raises:
        RuntimeError: the model could not be loaded; the message names the ID,
            ``HF_HUB_OFFLINE``, the cache searched and the cause.
        ValueError: ``from_pretrained`` reports parameters missing from the checkpoint or tensors of another shape
            (one line naming them; it would have filled them with random values).
    """
    from huggingface_hub import constants, try_to_load_from_cache
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoTokenizer

    offline = bool(constants.HF_HUB_OFFLINE)
    where = f"HF_HUB_OFFLINE={int(offline)}, Hugging Face cache searched: {constants.HF_HUB_CACHE}"
    logger.info("loading %s from the Hugging Face Hub (%s)", model_id, where)
    local_only = offline
    if not offline:
        unreachable = hub_unreachable(constants.ENDPOINT)
        if unreachable is not None:  # without a network, from_pretrained retries for ~25 s, warning twice a try
            if not isinstance(try_to_load_from_cache(model_id, "config.json"), str):
                raise RuntimeError(_not_in_cache_nor_reachable(model_id, unreachable))
            local_only = True
            logger.warning(
                "the Hugging Face Hub cannot be reached (%s): loading %s from the cache", unreachable, model_id
            )
    try:
        only = {"local_files_only": True} if local_only else {}
        with _LOAD_LOCK:
            # the class follows the config (model_class); a repository's own code is never run
            config = AutoConfig.from_pretrained(model_id, **only, trust_remote_code=False)
            model, info = model_class(config).from_pretrained(
                model_id,
                config=config,
                **dtype_kwargs(torch_dtype),
                **only,
                trust_remote_code=False,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # refused below, in one line, rather than in transformers' report
            )
    except (OSError, ValueError, SafetensorError) as err:
        cached = isinstance(try_to_load_from_cache(model_id, "config.json"), str)
        if (refusal := remote_code_refusal(model_id, err)) is not None:
            raise RuntimeError(refusal) from err
        if offline and not cached:
            msg = (
                f"model {model_id!r} is not a known name or a local directory, and as a Hugging Face Hub model ID "
                f"it is not in the cache ({where}); nothing is downloaded while HF_HUB_OFFLINE=1: download it once "
                "online, point HF_HUB_CACHE at the cache that holds it, or pass a local model directory"
            )
        else:
            msg = (
                f"could not load the Hugging Face Hub model {model_id!r} ({where}): {_first_line(err)}; check the "
                "ID and the network, or pass a local model directory"
            )
        raise RuntimeError(msg) from err
    _check_loading_info(model, info, model_id)
    try:
        only = {"local_files_only": True} if local_only else {}
        tokenizer = AutoTokenizer.from_pretrained(model_id, **only, trust_remote_code=False)
    except (OSError, ValueError) as err:
        logger.warning("%s: no tokenizer loaded (%s); only token-id data can be used", model_id, _first_line(err))
        tokenizer = None
    model.eval()
    check_tied(model, f"loading {model_id}")
    return model, tokenizer
