"""The output directory of the one-shot job: checked before any work, written atomically, saved in HF layout.

* :func:`check_output_dir` — every check that needs no model (exists, empty,
  writable, not the working directory); the output is then written in a hidden
  work directory and renamed into place (:mod:`llmc_fsm.workdir`);
* :func:`save_model` — the model in Hugging Face layout (safetensors). A model
  whose modules carry ``compressed-tensors`` quantization (the quantization
  plugin's GPTQ/RTN) is saved compressed through ``compressed-tensors``: packed
  int4 (``pack-quantized``) for W4A16, int8 (``int-quantized``) for W8A8, fp8
  (``float-quantized``) for FP8, with ``quantization_config``
  (``quant_method: compressed-tensors``) in ``config.json`` and, when the
  quantized weights are sparse, a dense-format ``sparsity_config`` recording
  the measured sparsity and its structure. ``transformers`` loads it with
  ``compressed-tensors`` installed, vLLM serves it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from llmc_fsm.recipe import Recipe

logger = logging.getLogger(__name__)

__all__ = [
    "check_output_dir",
    "check_output_not_source",
    "compressed_state_dict",
    "dir_size_bytes",
    "pruned_sparsity",
    "quantized_modules",
    "quantized_weights_as_compressed",
    "save_model",
    "sparsity_structure",
    "weights_disk_bytes",
    "weights_on_grid",
    "write_output",
    "write_quantization_config",
]


#: A non-empty directory holding one of these may be replaced with overwrite=True.
_MODEL_DIR_MARKERS = ("config.json", "recipe.yaml", "report.json", "model.safetensors")


def check_output_dir(output_dir: str | os.PathLike[str] | None, overwrite: bool) -> Path | None:
    """The resolved output directory, checked before any model work (``None`` when not given).

    Raises:
        FileExistsError: it exists and is a file, or is non-empty without ``overwrite``, or ``overwrite`` would
            replace a directory that is not a model output.
        ValueError: it is the working directory or contains it, or a mount point.
        NotADirectoryError: its first existing parent is a file (``README.md/sub``).
        PermissionError: its first existing parent is not writable.

    The directory itself is created later, with its work directory
    (:meth:`llmc_fsm.workdir.WorkDir.claim`), still before any model work.
    """
    if output_dir is None:
        return None
    path = Path(output_dir).expanduser().resolve()
    if path.exists() and not path.is_dir():
        msg = f"output {str(path)!r} exists and is not a directory"
        raise FileExistsError(msg)
    cwd = Path.cwd().resolve()
    if path == cwd or path in cwd.parents:
        msg = (
            f"output directory {str(path)!r} is the current directory or contains it, and the output replaces the "
            "whole directory; choose a new directory (e.g. --output out/my-model)"
        )
        raise ValueError(msg)
    if path.is_dir() and os.path.ismount(path):
        msg = (
            f"output directory {str(path)!r} is a mount point, which the output cannot replace (it is written "
            f"beside the directory and then renamed into place); pass a directory inside it, e.g. "
            f"{str(path / 'model')!r}"
        )
        raise ValueError(msg)
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            msg = (
                f"output directory {str(path)!r} exists and is not empty; pass overwrite=True (--overwrite) to "
                "replace it"
            )
            if (path / "report.json").is_file():
                msg += ". It holds a finished run (report.json), so there is nothing to resume"
                msg += (
                    " (its model is quantized, and a quantized model is not compressed further: start from the "
                    "full-precision one)"
                    if _is_quantized_dir(path)
                    else "; to compress that model further, give it as the model (model=DIR, --model DIR) with a new "
                    "output directory"
                )
            raise FileExistsError(msg)
        if not any((path / name).exists() for name in _MODEL_DIR_MARKERS):
            msg = (
                f"output directory {str(path)!r} does not look like a model directory (none of "
                f"{', '.join(_MODEL_DIR_MARKERS)}); overwrite=True (--overwrite) only replaces an earlier output or a "
                "model directory, never other files. Choose a new directory or empty this one yourself"
            )
            raise FileExistsError(msg)
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        msg = f"cannot create the output directory {str(path)!r}: {str(parent)!r} is a file, not a directory"
        raise NotADirectoryError(msg)
    if not os.access(parent, os.W_OK):
        msg = (
            f"cannot write the output directory {str(path)!r}: cannot create files in {str(parent)!r} "
            "(Permission denied)"
        )
        raise PermissionError(msg)
    return path


def check_output_not_source(output_dir: Any, model: Any) -> None:
    """Refuse an output directory that is, or contains, the directory the model is read from.

    ``model`` is a directory path, a known model name (its cache directory) or a loaded transformers model (its
    ``name_or_path``). The output replaces its
    whole directory when it is written, so even with ``overwrite`` the source model would be lost.

    Raises:
        ValueError: it is; nothing was read or written.
    """
    if output_dir is None:
        return
    from llmc_fsm.models import KNOWN_MODELS, cache_root

    out = Path(output_dir).expanduser().resolve()
    candidates = [model] if isinstance(model, str | os.PathLike) else [getattr(model, "name_or_path", None)]
    for candidate in candidates:
        if not isinstance(candidate, str | os.PathLike) or not os.fspath(candidate):
            continue
        source = Path(candidate).expanduser().resolve()
        known = isinstance(candidate, str) and candidate in KNOWN_MODELS and not source.is_dir()
        if known:  # read from its cache directory, which need not exist yet
            source = (cache_root() / "models" / candidate).resolve()
        if (known or source.is_dir()) and (out == source or out in source.parents):
            relation = "is" if out == source else "contains"
            msg = (
                f"output directory {str(out)!r} {relation} the directory the model is read from ({str(source)!r}), "
                f"and the output replaces the whole directory: choose a new directory (e.g. "
                f"{str(source) + '-compressed'!r})"
            )
            raise ValueError(msg)


def sparsity_structure(recipe: Recipe) -> str | None:
    """The first non-unstructured ``mask_structure`` of the recipe's modifiers (e.g. ``"2:4"``), else ``None``.

    Stages already applied count too: a 2:4 model quantized in a later run keeps its 2:4 (GPTQ keeps every zero).
    """
    for modifier in (m for stage in recipe.stages for m in stage.modifiers):
        structure = getattr(modifier, "mask_structure", None)
        if isinstance(structure, str) and structure not in ("unstructured", "0:0"):
            return structure
    return None


def write_output(
    directory: Path, model: nn.Module, tokenizer: Any, recipe: Recipe, report: Any, disk_before: int | None
) -> None:
    """Write the model (:func:`save_model`), its tokenizer and ``recipe.yaml`` (stages applied) into ``directory``.

    Also fills ``report.disk`` (bytes of the weights before and after) and
    ``report.seconds["save"]``; ``report.json`` is the caller's to write, last.

    Raises:
        OSError: writing failed.
    """
    import time

    t0 = time.perf_counter()
    save_model(model, directory, sparsity_structure=sparsity_structure(recipe), sparsity=pruned_sparsity(report))
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
    (directory / "recipe.yaml").write_text(recipe.to_yaml(applied=True), encoding="utf-8")
    report.disk = {
        "before_bytes": disk_before,
        "after_bytes": sum(p.stat().st_size for p in directory.glob("*.safetensors")),
    }
    report.seconds["save"] = time.perf_counter() - t0


def weights_disk_bytes(source: Path, loaded: nn.Module) -> int:
    """Bytes of the weight files a model was loaded from (``*.safetensors``, else ``*.bin``): in ``source`` when it
    is a directory, else in the directory the model was loaded from (a known model's cache), else its parameters'
    size in memory. Tokenizer and config files do not count."""
    for directory in (source, Path(getattr(loaded, "name_or_path", "") or "/nonexistent")):
        if directory.is_dir():
            for pattern in ("*.safetensors", "*.bin"):
                weights = list(directory.glob(pattern))
                if weights:
                    return sum(p.stat().st_size for p in weights)
    return sum(p.numel() * p.element_size() for p in loaded.parameters())


def dir_size_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of every file under ``path`` (0 if it does not exist)."""
    root = Path(path)
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of the modules that carry a ``compressed-tensors`` ``quantization_scheme``."""
    return {name: m for name, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}


def pruned_sparsity(report: Any) -> float:
    """Fraction of the quantized weights in ``report`` that are pruned (zero before quantization, kept zero).

    A quantized module's ``zeros`` in the report count only those (see
    :class:`llmc_fsm.calibration.ModuleResult`): values that quantization rounds
    to zero are not sparsity. 0.0 without quantized modules.
    """
    quantized = [m for m in report.modules if m.bits is not None]
    numel = sum(m.numel for m in quantized)
    return sum(m.zeros for m in quantized) / numel if numel else 0.0


@contextlib.contextmanager
def weights_on_grid() -> Iterator[Callable[[Iterable[nn.Module]], None]]:
    """Yields ``mark(modules)``: until the block ends, forwards skip re-quantizing the weights of those modules.

    compressed-tensors' forward fake-quantizes a ``frozen`` module's weight on every
    call; ours already hold exactly those values (fake quantization is idempotent), as
    the weights of a reloaded checkpoint do, whose modules are marked ``compressed``.
    ``mark`` marks the frozen quantized modules among ``modules`` so too (activation
    quantization still runs; other modules are left alone), and the block restores
    ``frozen`` when it ends: the same outputs bitwise, ~40% less time per forward for
    W8A8 on SmolLM2-135M. compressed-tensors is imported only when a module carries a
    quantization scheme.
    """
    marked: list[nn.Module] = []

    def mark(modules: Iterable[nn.Module]) -> None:
        quantized = [m for m in modules if getattr(m, "quantization_scheme", None) is not None]
        if not quantized:
            return
        from compressed_tensors.quantization import QuantizationStatus

        for module in quantized:
            if module.quantization_status == QuantizationStatus.FROZEN:
                module.quantization_status = QuantizationStatus.COMPRESSED
                marked.append(module)

    try:
        yield mark
    finally:
        if marked:
            from compressed_tensors.quantization import QuantizationStatus

            for module in marked:
                module.quantization_status = QuantizationStatus.FROZEN


@contextlib.contextmanager
def quantized_weights_as_compressed(model: nn.Module) -> Iterator[None]:
    """Within the block, forwards skip the re-quantization of every weight of ``model`` that already holds its
    grid values (:func:`weights_on_grid` for all its modules)."""
    with weights_on_grid() as mark:
        mark(model.modules())
        yield


def save_model(
    model: nn.Module, directory: Path, *, sparsity_structure: str | None = None, sparsity: float = 0.0
) -> None:
    """Write ``model`` to ``directory`` in Hugging Face layout; compressed through compressed-tensors if quantized.

    The in-memory model is not changed: the compressed tensors are built in a
    separate state dict, module by module, with compressed-tensors' own
    compressors (``BaseCompressor.compress``).

    Args:
        model: a ``transformers`` ``PreTrainedModel``.
        directory: an existing, empty directory.
        sparsity_structure: written to ``sparsity_config`` when the quantized weights are sparse
            (e.g. ``"2:4"``; default ``"unstructured"``).
        sparsity: the fraction of the quantized weights that was pruned before quantization
            (:func:`pruned_sparsity`); from 5% on, a dense-format ``sparsity_config`` is written.
            Given, not measured: quantization rounds small values to exact zeros that are not sparsity.

    Raises:
        OSError: writing failed.
    """
    from llmc_fsm.models import fix_safetensors_permissions

    _save_weights(model, directory, sparsity_structure, sparsity)
    fix_safetensors_permissions(directory)  # safetensors writes 0600 files; follow the umask like the rest


def _save_weights(model: nn.Module, directory: Path, sparsity_structure: str | None, sparsity: float) -> None:
    if not quantized_modules(model):
        model.save_pretrained(directory, safe_serialization=True)
        return
    model.save_pretrained(directory, state_dict=compressed_state_dict(model), safe_serialization=True)
    write_quantization_config(model, directory, sparsity=sparsity, sparsity_structure=sparsity_structure)


def compressed_state_dict(module: nn.Module, prefix: str = "") -> dict[str, Any]:
    """``module``'s state dict, keys prefixed, with each quantized submodule's tensors compressed.

    Each quantized submodule's compressed-tensors format is inferred (and set on its scheme) and its
    tensors replaced by what that format's compressor (``BaseCompressor.compress``) gives, e.g.
    ``weight_packed`` int32 + ``weight_shape`` for ``pack-quantized``. ``module`` is not changed.
    """
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_model_format
    from compressed_tensors.utils.module import get_direct_state_dict

    from llmc_fsm.quantized_format import unpacked_zero_points

    unpacked_zero_points(quantized_modules(module))
    infer_model_format(module)  # sets each quantized module's scheme.format
    state = {prefix + key: value for key, value in module.state_dict().items()}
    for name, sub in quantized_modules(module).items():
        scheme = sub.quantization_scheme
        local = get_direct_state_dict(sub)
        packed = BaseCompressor.get_value_from_registry(scheme.format.value).compress(local, scheme)
        sub_prefix = f"{prefix}{name}." if name else prefix
        for key in local:
            state.pop(sub_prefix + key, None)
        state.update({sub_prefix + key: value.contiguous() for key, value in packed.items() if value is not None})
    return state


def write_quantization_config(
    model: nn.Module, directory: Path, *, sparsity: float, sparsity_structure: str | None
) -> None:
    """Add ``quantization_config`` (status compressed) to ``directory/config.json`` from ``model``'s schemes.

    Reads only the schemes on ``model``'s modules, so its weights may be on the ``meta`` device. A
    dense-format ``sparsity_config`` is added when ``sparsity`` (pruned fraction of the quantized weights,
    :func:`pruned_sparsity`) is >= 5%.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationStatus

    from llmc_fsm.quantized_format import leaf_targets

    with leaf_targets(quantized_modules(model)):  # what was quantized, not recipe patterns (the config holds the
        compressor = ModelCompressor.from_pretrained_model(model)  # modules' scheme objects: written inside)
        compressor.quantization_config.quantization_status = QuantizationStatus.COMPRESSED  # what the tensors are
        compressor.update_config(str(directory))
    if sparsity >= 0.05:
        targets = sorted(quantized_modules(model))
        _write_sparsity_config(directory, sparsity, sparsity_structure or "unstructured", targets)


def _write_sparsity_config(directory: Path, sparsity: float, structure: str, targets: list[str]) -> None:
    from compressed_tensors.config import DenseSparsityConfig

    config_path = directory / "config.json"
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    sparsity_config = DenseSparsityConfig(global_sparsity=sparsity, sparsity_structure=structure, targets=targets)
    config["quantization_config"]["sparsity_config"] = sparsity_config.model_dump()
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _is_quantized_dir(path: Path) -> bool:
    """Whether ``path/config.json`` carries a ``quantization_config`` (unreadable or absent: ``False``)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("quantization_config") is not None
