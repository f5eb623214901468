"""Saving the one-shot output in Hugging Face layout, compressed where the model is quantized.

Checked before any work by :mod:`llmc_fsm.output.directory`; written in a hidden work directory and renamed into
place (:mod:`llmc_fsm.output.workdir`).

* :class:`CompressedSavePretrained` — what ``oneshot`` puts in place of the returned model's ``save_pretrained``,
  so that llm-compressor's ``model.save_pretrained(SAVE_DIR, save_compressed=True)`` writes the same compressed
  checkpoint as ``output_dir``, not the dense weights with their scales beside them.
* :func:`save_model` — the model in Hugging Face layout (safetensors). A model
  whose modules carry ``compressed-tensors`` quantization (the quantization
  plugin's GPTQ/RTN) is saved compressed through ``compressed-tensors``: packed
  int4 (``pack-quantized``) for W4A16, int8 (``int-quantized``) for W8A8, fp8
  (``float-quantized``) for FP8, with ``quantization_config``
  (``quant_method: compressed-tensors``) in ``config.json`` and, when the
  quantized weights are sparse, a dense-format ``sparsity_config`` recording
  the sparse modules, their sparsity and structure (:func:`sparsity_metadata`). ``transformers`` loads it with
  ``compressed-tensors`` installed, vLLM serves it. Expert matrices of fused
  mixture-of-experts weights quantized per expert (:func:`quantized_views`) are
  packed the same way and written under the per-expert names transformers 5
  reads back (it reloads them dequantized into the fused parameters).
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import json
import logging
import os
import re
import shutil
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
from torch import nn

from llmc_fsm.models.hf_io import checkpoint_key_renamer, meta_model
from llmc_fsm.models.known import fix_safetensors_permissions
from llmc_fsm.output.compressed import (
    attention_scheme,
    ignore_for_reload,
    kv_cache_scheme,
    leaf_targets,
    unpacked_embeddings,
    unpacked_zero_points,
)
from llmc_fsm.recipes.model import Recipe
from llmc_fsm.report.build import OneshotReport, build_report
from llmc_fsm.toolkit.masks import SPARSE_FROM, zeros_structure
from llmc_fsm.toolkit.packed import format_problem, kept_packed, saved_as
from llmc_fsm.toolkit.targets import tied_head
from llmc_fsm.toolkit.views import LinearView, expert_checkpoint_names, reloads_as_linears, weight_views

logger = logging.getLogger(__name__)

__all__ = [
    "QUANTIZATION_FORMATS",
    "CompressedSavePretrained",
    "SparsityMetadata",
    "check_quantization_format",
    "choose_formats",
    "compressed_state_dict",
    "dir_size_bytes",
    "is_quantized",
    "model_sparsity",
    "quantized_modules",
    "quantized_views",
    "quantized_weights_as_compressed",
    "save_model",
    "sparsity_metadata",
    "sparsity_structure",
    "warn_formats",
    "weights_disk_bytes",
    "weights_on_grid",
    "write_output",
    "write_quantization_config",
]


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
    directory: Path,
    model: nn.Module,
    tokenizer: Any,
    recipe: Recipe,
    report: Any,
    disk_before: int | None,
    quantization_format: str | None = None,
) -> None:
    """Write the model (:func:`save_model`), its tokenizer and ``recipe.yaml`` (stages applied) into ``directory``.

    Also fills ``report.disk`` (bytes of the weights before and after) and
    ``report.seconds["save"]``; ``report.json`` is the caller's to write, last.

    Raises:
        OSError: writing failed.
    """

    t0 = time.perf_counter()
    save_model(
        model,
        directory,
        sparsity=sparsity_metadata(model, report, sparsity_structure(recipe)),
        quantization_format=quantization_format,
    )
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


def quantized_views(model: nn.Module) -> dict[str, LinearView]:
    """``{name: view}`` of the expert matrices of fused experts that the quantization plugin quantized.

    Such a :class:`~llmc_fsm.toolkit.views.LinearView` carries ``quantization_scheme``, ``quantized_params``
    (``weight_scale``, ``weight_zero_point``) and ``checkpoint_name`` (the per-expert module name transformers 5
    reads back, :func:`~llmc_fsm.toolkit.views.expert_checkpoint_names`); its matrix in the fused parameter holds the
    dequantized values.
    """
    return {
        f"{name}.{suffix}" if name else suffix: view
        for name, module in model.named_modules()
        for suffix, view in weight_views(module).items()
        if getattr(view, "quantization_scheme", None) is not None
    }


@attrs.frozen
class SparsityMetadata:
    """What a saved ``sparsity_config`` (compressed-tensors' dense format: the zeros are stored as zeros) records.

    Attributes:
        global_sparsity: the pruned fraction of the whole model's parameters (:func:`model_sparsity`), in
            ``[0, 1]``.
        structure: ``"N:M"`` (N zeros in every M inputs, as compressed-tensors and vLLM read it) when every target
            follows it, else ``"unstructured"``.
        targets: the modules whose weights are sparse (at least 5% pruned zeros), by name; an expert matrix of
            fused experts by the per-expert module name the checkpoint holds it under (as the
            ``quantization_config`` targets it).
    """

    global_sparsity: float
    structure: str
    targets: list[str]


def sparsity_metadata(model: nn.Module, report: Any, structure: str | None) -> SparsityMetadata | None:
    """The ``sparsity_config`` of ``model`` after a run with ``report`` (a one-shot report, or ``None``), whose recipe
    asked for ``structure`` (:func:`sparsity_structure`), or ``None`` when no module is sparse.

    The sparse modules are those of ``model`` whose weights have at least 5% pruned zeros in the report (a quantized
    module's count only the zeros it had before quantization), not every quantized one. (llm-compressor 0.14 writes
    no ``sparsity_config``; this follows its older ``infer_sparsity_structure_from_model`` and
    ``infer_sparse_targets_and_ignores`` rules.) The structure is written as compressed-tensors and vLLM read it,
    ``N`` zeros in every ``M`` inputs, which for the recipe's ``N:M`` (N kept of every M, NVIDIA's reading, as the
    first-party pruning modifiers take it) is ``(M - N):M`` (the same for ``2:4``), where a sparse module's weight
    follows it (measured: :attr:`~llmc_fsm.report.build.ModuleSparsity.fewest_zeros`); else, or when the recipe asks
    for no structure (a model pruned elsewhere), ``"2:4"`` where more than 80% of the sparse modules follow it (vLLM's
    2:4 kernels); else ``"unstructured"``. The targets are the sparse modules that follow the structure (vLLM takes
    its 2:4 kernels for them): with a structure, a module whose zeros do not follow it (an ignored head with zero
    rows of a padded vocabulary) is not a target and does not turn a 2:4 model unstructured (until 2026-12-06 it
    did: a tester's case). An expert matrix of fused experts is listed under its per-expert checkpoint name
    (:func:`_saved_expert_names`: ``model.layers.0.mlp.experts.3.gate_proj``, Mixtral's
    ``model.layers.0.block_sparse_moe.experts.3.w1``), the name its packed tensors are written under; the experts of a
    family whose checkpoint keeps them fused (GPT-OSS, DBRX: no per-expert name exists) are not listed. (Until
    2026-12-07 no expert matrix was listed: a 2:4 Qwen3-MoE's targets named its attention only, a tester's case.)
    """
    if report is None:
        return None
    names = {name: name for name, _ in model.named_modules()}
    names.update(_saved_expert_names(model, {m.name for m in report.modules if m.sparsity >= SPARSE_FROM}))
    sparse = [m for m in report.modules if m.sparsity >= SPARSE_FROM and m.name in names]
    if not sparse:
        return None
    asked = zeros_structure(structure) if structure is not None else None
    if asked is not None and any(m.follows(asked) for m in sparse):
        followed = asked
    elif sum(m.follows("2:4") for m in sparse) > 0.8 * len(sparse):
        followed = "2:4"
    else:
        followed = "unstructured"
    listed = [m.name for m in sparse if followed == "unstructured" or m.follows(followed)]
    return SparsityMetadata(
        global_sparsity=model_sparsity(report, model, listed),
        structure=followed,
        targets=sorted(names[name] for name in listed),
    )


def _saved_expert_names(model: nn.Module, wanted: set[str]) -> dict[str, str]:
    """``{view name: checkpoint module name}`` of the expert matrices of fused experts named in ``wanted`` (view
    names, ``<experts>.<e>.gate_proj``): a quantized one's ``checkpoint_name`` (its packed tensors' name); a dense
    one's name as saved (:func:`~llmc_fsm.toolkit.views.expert_checkpoint_names`; Llama 4's dense experts are written
    as Linears under their view names, :func:`dense_linear_experts`). A family whose checkpoint keeps the experts
    fused (``expert_checkpoint_names`` raises) has none."""
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        views = {f"{name}.{s}" if name else s: (s, v) for s, v in weight_views(module).items() if s}
        if not any(full in wanted for full in views):  # no expert of this module is sparse (or a Conv1D)
            continue
        saved: dict[str, str] | None = None
        for full, (suffix, view) in views.items():
            if full not in wanted:
                continue
            if getattr(view, "quantization_scheme", None) is not None and getattr(view, "checkpoint_name", None):
                out[full] = view.checkpoint_name
            elif reloads_as_linears(module):
                out[full] = full
            else:
                if saved is None:
                    try:
                        saved = expert_checkpoint_names(model, name, module)
                    except ValueError:  # kept fused in the checkpoint: no per-expert module to name
                        saved = {}
                if suffix in saved:
                    out[full] = saved[suffix]
    return out


def model_sparsity(report: Any, model: nn.Module, sparse: Iterable[str] = ()) -> float:
    """The pruned zeros of the weights in ``report`` over all of ``model``'s parameters (tied ones once; quantization
    parameters not counted): compressed-tensors' ``global_sparsity``, "the average sparsity of the entire model", as a
    fraction in ``[0, 1]``.

    Pruned zeros are the zeros of the modules a pruning modifier changed
    (:attr:`~llmc_fsm.report.build.ModuleSparsity.pruned`) and of the modules named in ``sparse`` (report names: the
    ``sparsity_config`` targets, e.g. a 2:4 model pruned by an earlier run and quantized in this one); the zeros a
    module no pruning modifier touched already had (a tied head's zero rows, which the report lists "not targeted")
    are not sparsity. (llm-compressor's older ``infer_global_sparsity`` counted the zeros of every parameter: until
    2026-12-07 so did this, 0.3968 for SmolLM2 2:4 + W4A16 instead of 53,084,163 / 134,515,008 = 0.3946, a
    tester's case.) A quantized module's ``zeros`` in the report count only the zeros it held before quantization
    (see :class:`llmc_fsm.toolkit.calibrated.ModuleResult`): values that quantization rounds to zero are not sparsity.
    0.0 for a model without parameters.
    """
    numel = sum(p.numel() for name, p in model.named_parameters() if not _quantization_parameter(name))
    counted = set(sparse)
    zeros = sum(m.zeros for m in report.modules if getattr(m, "pruned", False) or m.name in counted)
    return zeros / numel if numel else 0.0


def _quantization_parameter(name: str) -> bool:
    """A scale, zero point or group index compressed-tensors attaches (``weight_scale``, ``input_zero_point``,
    ``k_scale``, ``weight_g_idx``...): not a parameter of the model (a tester counted them in ``global_sparsity``'s
    denominator, 1-3% low on a tiny model)."""
    return name.rsplit(".", 1)[-1].endswith(("_scale", "_zero_point", "_g_idx"))


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


class CompressedSavePretrained:
    """``model.save_pretrained`` of a model that ``oneshot`` compressed in memory (set by
    :meth:`attach`): writes what ``oneshot(output_dir=...)`` writes there, without the tokenizer and report.json.

    llm-compressor's scripts end with ``model.save_pretrained(SAVE_DIR, save_compressed=True)`` (its ``oneshot``
    wraps the method the same way). transformers' own method would write the quantized weights dense, with the
    compressed-tensors parameters (``weight_scale``...) as stray tensors and no ``quantization_config``: the
    reloaded model would run without its activation quantization, silently. So:

    * ``save_compressed=True`` (the default, as llm-compressor's): the model in Hugging Face layout through
      :func:`save_model` (compressed-tensors where quantized, a ``sparsity_config`` for sparse quantized weights),
      and ``recipe.yaml`` (the stages applied). Other keyword arguments (``max_shard_size``...) go to
      transformers' ``save_pretrained``; one it does not name is refused (transformers would drop a misspelt
      ``save_compresed`` without a word), except with ``push_to_hub=True`` (the Hub's own arguments).
      llm-compressor's ``disable_sparse_compression`` and ``skip_sparsity_compression_stats`` are taken as no-ops:
      sparse weights are written dense either way (llm-compressor 0.14 no longer compresses them either).
    * ``save_compressed=False``: refused for a quantized model (``ValueError``, nothing written); a model that was
      only pruned is saved as with ``True`` (its weights are dense either way).

    The object holds the model, so ``copy.deepcopy(model)`` gets its own (saving the copy). transformers' method
    stays reachable as ``type(model).save_pretrained(model, ...)``.
    """

    def __init__(
        self,
        model: nn.Module,
        recipe_yaml: str,
        sparsity_structure: str | None,
        streamed_to: Path | None = None,
        recipe: Recipe | None = None,
    ) -> None:  # sparsity_structure: the recipe's (:func:`sparsity_structure`); recipe: the one that ran, its modifiers
        self.model = model
        self.recipe_yaml = recipe_yaml
        self.sparsity_structure = sparsity_structure
        self.streamed_to = streamed_to
        self.recipe = recipe

    @classmethod
    def attach(cls, model: nn.Module, recipe: Recipe, *, streamed_to: Path | None = None) -> None:
        """Put the method on ``model`` (a transformers ``PreTrainedModel``; anything else is left alone).

        ``streamed_to``: the output directory of a streamed run, whose returned model is on the ``meta`` device;
        its ``save_pretrained`` then refuses, naming that directory.
        """
        if not callable(getattr(type(model), "save_pretrained", None)):
            return
        yaml = recipe.to_yaml(applied=True)
        model.save_pretrained = cls(model, yaml, sparsity_structure(recipe), streamed_to, recipe=recipe)

    def __call__(
        self,
        save_directory: str | os.PathLike[str],
        quantization_format: str | None = None,
        save_compressed: bool = True,
        **kwargs: Any,
    ) -> None:
        """Write the compressed model and ``recipe.yaml`` into ``save_directory`` (created if missing). The arguments
        in llm-compressor's order (``save_pretrained(save_directory, quantization_format, save_compressed)``).

        ``push_to_hub=True``: the repository (``repo_id``, default the directory's name; ``private``, ``token``...,
        as transformers takes them) is created before anything is written, and what this call wrote (quantization
        config and ``recipe.yaml`` included) is uploaded in one commit (``commit_message``, ``create_pr``) once it
        is complete. A call that fails leaves no new file: the directory is removed when it did not exist, else the
        files it added (a file it replaced stays replaced).

        Raises:
            ValueError: ``save_compressed=False`` for a quantized model; a ``quantization_format`` its weights
                cannot be saved in (:func:`check_quantization_format`); a ``state_dict`` given (the compressed
                one is built here); a keyword argument neither transformers' ``save_pretrained`` nor
                llm-compressor's names (without ``push_to_hub``); ``save_directory`` is an existing file; a streamed
                run's model.
            OSError: writing failed.
            huggingface_hub's errors (e.g. ``OfflineModeIsEnabled`` under ``HF_HUB_OFFLINE=1``): with
                ``push_to_hub``, the repository could not be created or the upload failed.
        """
        if self.streamed_to is not None:
            msg = (
                "save_pretrained: this model was compressed one decoder layer at a time (low_memory) and holds no "
                f"weights (meta device); the compressed model is in {str(self.streamed_to)!r}: copy that directory"
            )
            raise ValueError(msg)
        model = self.model
        quantized = is_quantized(model)
        if not isinstance(save_compressed, bool):
            raise ValueError(f"save_compressed must be true or false, got {save_compressed!r}")
        if not save_compressed and quantized:
            msg = (
                "save_pretrained(save_compressed=False): llmc-fsm writes a quantized model only compressed "
                "(compressed-tensors); dense weights without their quantization config would reload without its "
                "activation quantization. Call save_pretrained(save_directory) (save_compressed=True)"
            )
            raise ValueError(msg)
        if quantization_format is not None:
            check_quantization_format(model, quantization_format)
        if "state_dict" in kwargs:
            raise ValueError("save_pretrained(state_dict=...): the compressed state dict is built here; leave it out")
        kwargs = _transformers_save_kwargs(type(model).save_pretrained, kwargs)
        directory = Path(save_directory)
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"save_pretrained: {str(directory)!r} is a file, not a directory")
        hub = _HubPush.take(kwargs, type(model).save_pretrained, directory)
        if hub is not None:
            hub.create_repo()  # before anything is written: offline, no token... fails here
        with _undone_on_failure(directory) as before:
            directory.mkdir(parents=True, exist_ok=True)
            report = getattr(model, "llmc_fsm_report", None)
            if report is None and self.recipe is not None:  # a Session run (run_sequential): its modifiers' results
                report = _session_report(model, self.recipe)
            save_model(
                model,
                directory,
                sparsity=sparsity_metadata(model, report, self.sparsity_structure),
                quantization_format=quantization_format,
                **kwargs,
            )
            (directory / "recipe.yaml").write_text(self.recipe_yaml, encoding="utf-8")
            if hub is not None:  # the whole checkpoint (quantization config and recipe.yaml included) in one commit
                hub.upload(before)

    def __repr__(self) -> str:
        return f"<llmc-fsm compressed save_pretrained of {type(self.model).__name__}>"


def _session_report(model: nn.Module, recipe: Recipe) -> OneshotReport:
    """The per-module report of ``model`` compressed by a :class:`~llmc_fsm.Session` of ``recipe`` (its modifiers,
    which ran, hold their per-module results), as ``oneshot`` builds it: what :func:`sparsity_metadata` reads for the
    ``sparsity_config``, so ``model.save_pretrained`` after ``Session`` + ``run_sequential`` writes what ``oneshot(
    output_dir=...)`` writes (a quantized module's zeros are those it held before quantization). Until 2026-12-07
    that path wrote ``"sparsity_config": {}`` for SparseGPT 2:4 + GPTQ W4A16 (found by a tester)."""
    return build_report(
        model=model,
        model_name=type(model).__name__,
        recipe=recipe,
        modifiers=[m for stage in recipe.stages for m in stage.modifiers],
        calibration={},
        ppl_before=None,
        ppl_after=None,
        eval=None,
        seconds={},
        targeted=[],
    )


def _root_entries(directory: Path) -> dict[str, float]:
    """``{name: modification time}`` of the entries directly in ``directory`` (``{}``: none, or no directory)."""
    if not directory.is_dir():
        return {}
    return {entry.name: entry.stat().st_mtime for entry in directory.iterdir()}


@contextlib.contextmanager
def _undone_on_failure(directory: Path) -> Iterator[dict[str, float]]:
    """Yield :func:`_root_entries` of ``directory`` as it is; when the block raises, remove what it created: the
    directory and its parents that did not exist, else the entries it added (files it replaced stay replaced).
    Found by a tester: a failed ``save_pretrained(push_to_hub=True)`` left its new, empty directory behind."""
    missing = []
    top = directory.absolute()
    while not top.exists():
        missing.append(top)
        top = top.parent
    before = _root_entries(directory)
    try:
        yield before
    except BaseException:
        if missing:
            shutil.rmtree(missing[-1], ignore_errors=True)
        else:
            for entry in directory.iterdir():
                if entry.name in before:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        raise


@attrs.define
class _HubPush:
    """``save_pretrained(..., push_to_hub=True)``'s upload, done here rather than by transformers (whose upload runs
    before the quantization config and ``recipe.yaml`` are written, and which then passed our
    ``safe_serialization`` on to ``HfApi.create_repo``: a ``TypeError``, found by a tester). As transformers does:
    ``repo_id`` (default: the directory's name), ``commit_message``, ``create_pr``, ``token``; the other arguments
    go to ``HfApi.create_repo`` (``private``...); the root entries the save added or changed are uploaded."""

    repo_id: str
    token: Any
    commit_message: str
    create_pr: bool
    create_args: dict[str, Any]
    directory: Path

    @classmethod
    def take(cls, kwargs: dict[str, Any], method: Callable[..., Any], directory: Path) -> _HubPush | None:
        """The push ``kwargs`` asks for (``None``: none); its arguments are removed from ``kwargs``, which keeps
        those ``method`` (transformers' ``save_pretrained``) names."""
        if not kwargs.pop("push_to_hub", False):
            return None
        known = inspect.signature(method).parameters
        hub = {k: kwargs.pop(k) for k in list(kwargs) if k not in known or k == "token"}
        return cls(
            repo_id=hub.pop("repo_id", directory.absolute().name),
            token=hub.pop("token", None),
            commit_message=hub.pop("commit_message", None) or "Upload model",
            create_pr=bool(hub.pop("create_pr", False)),
            create_args=hub,
            directory=directory,
        )

    def create_repo(self) -> None:
        """Create the repository when missing (``exist_ok``), keeping its full id.

        Raises:
            huggingface_hub's errors (offline mode, no network, no token...) and ``TypeError`` for an argument
            ``HfApi.create_repo`` does not take.
        """
        from huggingface_hub import HfApi  # optional third-party: huggingface_hub (installed with transformers)

        api = HfApi()
        self.repo_id = api.create_repo(self.repo_id, exist_ok=True, token=self.token, **self.create_args).repo_id

    def upload(self, before: dict[str, float]) -> None:
        """Upload the root entries of the directory that are not in ``before`` or changed since (a folder whole).

        Raises:
            huggingface_hub's errors.
        """
        changed = [name for name, mtime in _root_entries(self.directory).items() if before.get(name) != mtime]
        patterns = [name + "/**" if (self.directory / name).is_dir() else name for name in sorted(changed)]
        from huggingface_hub import HfApi  # optional third-party: huggingface_hub (installed with transformers)

        HfApi().upload_folder(
            repo_id=self.repo_id,
            folder_path=self.directory,
            commit_message=self.commit_message,
            token=self.token,
            create_pr=self.create_pr,
            allow_patterns=patterns,
        )


#: llm-compressor's ``save_pretrained`` arguments for sparse compression, which it no longer does (0.14): no-ops here
LLMCOMPRESSOR_SAVE_NOOPS = ("disable_sparse_compression", "skip_sparsity_compression_stats")


def _transformers_save_kwargs(method: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for transformers' ``save_pretrained`` ``method``: llm-compressor's no-ops removed (each a bool),
    ``safe_serialization=True`` removed when ``method`` does not name it (transformers 5 writes safetensors only);
    one ``method`` does not name refused unless ``push_to_hub`` is set (then the Hub's arguments pass through).

    Raises:
        ValueError: an unknown argument (with the closest known names), a no-op that is not a bool, or
            ``safe_serialization`` other than ``True`` where ``method`` does not name it.
    """
    for name in LLMCOMPRESSOR_SAVE_NOOPS:
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise ValueError(f"save_pretrained({name}=...): must be true or false, got {kwargs[name]!r}")
    kwargs = {k: v for k, v in kwargs.items() if k not in LLMCOMPRESSOR_SAVE_NOOPS}
    known = [n for n in inspect.signature(method).parameters if n not in ("self", "kwargs")]
    if "safe_serialization" in kwargs and "safe_serialization" not in known:  # transformers 5: safetensors only
        if kwargs["safe_serialization"] is not True:
            msg = (
                f"save_pretrained(safe_serialization={kwargs['safe_serialization']!r}): this transformers writes "
                "safetensors only; leave it out"
            )
            raise ValueError(msg)
        del kwargs["safe_serialization"]  # what it writes anyway (llm-compressor's scripts may pass it)
    unknown = [k for k in kwargs if k not in known]
    hub = _hub_arguments() if kwargs.get("push_to_hub") else set()
    unknown = [k for k in unknown if k not in hub]  # with push_to_hub, the repository's (private, repo_id...)
    if unknown:
        names = ["quantization_format", "save_compressed", *known, *LLMCOMPRESSOR_SAVE_NOOPS, *sorted(hub)]
        close = sorted({c for k in unknown for c in difflib.get_close_matches(k, names, n=2)})
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        msg = (
            f"save_pretrained: unknown argument(s) {', '.join(unknown)}{hint}; nothing was written. It takes "
            "save_directory, quantization_format, save_compressed and transformers' save_pretrained arguments"
        )
        raise ValueError(msg)
    return kwargs


def _hub_arguments() -> set[str]:
    """The arguments ``save_pretrained(push_to_hub=True)`` takes beyond transformers' save: ``HfApi.create_repo``'s
    (``private``, ``repo_type``...) and the upload's (``repo_id``, ``commit_message``, ``create_pr``, ``token``). A
    misspelt one was passed to ``create_repo`` and failed there with a ``TypeError`` (found by a re-tester)."""
    from huggingface_hub import HfApi  # optional third-party: huggingface_hub (installed with transformers)

    return {"repo_id", "commit_message", "create_pr", "token"} | (
        set(inspect.signature(HfApi.create_repo).parameters) - {"self"}
    )


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` carries compressed-tensors quantization: a scheme on a module, on a fused experts' matrix
    (:func:`quantized_views`) or a KV-cache scheme."""
    return bool(quantized_modules(model) or quantized_views(model) or kv_cache_scheme(model) is not None)


def save_model(
    model: nn.Module,
    directory: Path,
    *,
    sparsity: SparsityMetadata | None = None,
    quantization_format: str | None = None,
    **save_kwargs: Any,
) -> None:
    """Write ``model`` to ``directory`` in Hugging Face layout; compressed through compressed-tensors if quantized.

    The in-memory model is not changed: the compressed tensors are built in a
    separate state dict, module by module, with compressed-tensors' own
    compressors (``BaseCompressor.compress``).

    Args:
        model: a ``transformers`` ``PreTrainedModel``.
        directory: an existing, empty directory.
        sparsity: written as a dense-format ``sparsity_config`` when the model is quantized
            (:func:`sparsity_metadata`); ``None``: none. Given, not measured here: quantization rounds small values
            to exact zeros that are not sparsity.
        quantization_format: the compressed-tensors format of every quantized weight (:func:`choose_formats`);
            ``None``: each its recipe's or the default.
        save_kwargs: passed on to transformers' ``save_pretrained`` (e.g. ``max_shard_size``).

    Raises:
        ValueError: a format a quantized weight cannot be saved in (:func:`check_quantization_format`), before
            anything is written.
        OSError: writing failed.
    """

    _save_weights(model, directory, sparsity, quantization_format, save_kwargs)
    fix_safetensors_permissions(directory)  # safetensors writes 0600 files; follow the umask like the rest


def _save_weights(
    model: nn.Module,
    directory: Path,
    sparsity: SparsityMetadata | None,
    quantization_format: str | None,
    save_kwargs: dict[str, Any],
) -> None:
    # transformers' own method: the model may carry CompressedSavePretrained, which calls this
    hf_save = type(model).save_pretrained
    if "safe_serialization" in inspect.signature(hf_save).parameters:  # transformers 4 (5 writes safetensors only)
        save_kwargs = {"safe_serialization": True, **save_kwargs}
    kv_only = kv_cache_scheme(model) is not None
    if not quantized_modules(model) and not quantized_views(model) and not (kv_only and dense_linear_experts(model)):
        hf_save(model, directory, **save_kwargs)
        if kv_only:  # KV-cache scales only (kv_cache_scheme alone): weights untouched
            write_quantization_config(model, directory, sparsity=sparsity)
        return
    # (KV-cache scales only on Llama 4: its fused experts are written per expert, as transformers reloads them)
    state_dict = compressed_state_dict(model, quantization_format=quantization_format)
    warn_formats(model)
    hf_save(model, directory, state_dict=state_dict, **save_kwargs)
    write_quantization_config(model, directory, sparsity=sparsity)
    _untie_quantized_embedding(model, directory)


def _untie_quantized_embedding(model: nn.Module, directory: Path) -> None:
    """A tied model whose input embedding was quantized and whose head (sharing the weight, so ignored) was not:
    the checkpoint holds both, the embedding compressed and the head in float, so its ``config.json`` gets
    ``tie_word_embeddings: false`` (transformers otherwise warns that the config ties two different tensors, and
    does not tie them; the reloaded logits are the in-memory ones either way)."""
    head = tied_head(model)
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False) or head is None:
        return
    if not hasattr(model.get_input_embeddings(), "quantization_scheme") or hasattr(head, "quantization_scheme"):
        return
    path = directory / "config.json"
    saved = json.loads(path.read_text())
    saved["tie_word_embeddings"] = False
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    logger.info("the quantized input embedding and the float head are saved apart: config tie_word_embeddings false")


def compressed_state_dict(
    module: nn.Module, prefix: str = "", *, quantization_format: str | None = None, root: nn.Module | None = None
) -> dict[str, Any]:
    """``module``'s state dict, keys prefixed, with each quantized submodule's tensors compressed. ``root``: the model
    ``module`` is the submodule ``prefix`` of (one decoder layer when streamed), whose weight initialisation decides
    which modules may be packed (:func:`_init_reads_weight`); ``None``: ``module`` is the model.

    Each quantized submodule's compressed-tensors format is chosen (:func:`choose_formats`; set on its scheme) and
    its tensors replaced by what that format's compressor (``BaseCompressor.compress``) gives, e.g.
    ``weight_packed`` int32 + ``weight_shape`` for ``pack-quantized``. ``module``'s tensors are not changed.

    Raises:
        ValueError: ``quantization_format`` (or a recipe's config-group ``format``) that a quantized module's weights
            cannot be saved in (nothing is compressed).
    """
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.utils.module import get_direct_state_dict

    if quantization_format is not None:
        check_quantization_format(module, quantization_format)
    modules = quantized_modules(module)
    choose_formats(module, modules, quantization_format, root=root, prefix=prefix)
    state = {prefix + key: value for key, value in module.state_dict().items()}
    for name, sub in modules.items():
        scheme = sub.quantization_scheme
        local = get_direct_state_dict(sub)
        packed = kept_packed(sub, scheme.format.value, local)  # packed when it was quantized (NVFP4, MX, FP8 block)
        if packed is None:
            packed = BaseCompressor.get_value_from_registry(scheme.format.value).compress(local, scheme)
        sub_prefix = f"{prefix}{name}." if name else prefix
        for key in local:
            state.pop(sub_prefix + key, None)
        state.update({sub_prefix + key: value.contiguous() for key, value in packed.items() if value is not None})
    state.update(_expert_tensors(module, prefix, state, quantization_format))
    return state


#: The compressed-tensors formats ``quantization_format`` may name (which of them a weight allows:
#: :func:`~llmc_fsm.toolkit.packed.weight_formats`).
QUANTIZATION_FORMATS = (
    "pack-quantized",
    "int-quantized",
    "float-quantized",
    "naive-quantized",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
    "mxfp6-pack-quantized",
    "mxfp8-quantized",
)


def check_quantization_format(model: nn.Module, quantization_format: Any) -> None:
    """Refuse a ``quantization_format`` (llm-compressor's ``save_pretrained`` argument: the compressed-tensors format
    every quantized weight is saved in) that is not one of :data:`QUANTIZATION_FORMATS` or that a quantized weight of
    ``model`` cannot be saved in.

    Raises:
        ValueError: an unknown format (the known ones listed), ``dense`` (quantized weights are saved compressed),
            a model without quantized weights, or a weight whose scheme does not allow it (each named, with the
            formats it allows).
    """
    if quantization_format == "dense":
        msg = (
            "quantization_format 'dense': llmc-fsm saves quantized weights only compressed (dense weights without "
            "their quantization config would reload without its activation quantization); leave it out"
        )
        raise ValueError(msg)
    if quantization_format not in QUANTIZATION_FORMATS:
        msg = (
            f"quantization_format must be one of compressed-tensors' formats {', '.join(QUANTIZATION_FORMATS)}, "
            f"got {quantization_format!r}"
        )
        raise ValueError(msg)
    schemes = {name: (type(sub), sub.quantization_scheme) for name, sub in quantized_modules(model).items()}
    schemes.update({name: (saved_as(view), view.quantization_scheme) for name, view in quantized_views(model).items()})
    if not schemes:
        msg = (
            f"quantization_format {quantization_format!r} is the format quantized weights are saved in, and the "
            "model has no quantized weights: leave it out"
        )
        raise ValueError(msg)
    _check_formats(schemes, quantization_format)


#: Attribute of a quantized module: the compressed-tensors ``format`` its recipe's scheme named (``None``: not
#: named), kept by :func:`choose_formats` before it first sets the scheme's format for a save.
RECIPE_FORMAT_ATTR = "recipe_quantization_format"


def choose_formats(
    model: nn.Module,
    modules: dict[str, nn.Module],
    quantization_format: str | None = None,
    *,
    root: nn.Module | None = None,
    prefix: str = "",
) -> None:
    """Set the compressed-tensors format each of ``modules`` (quantized modules of ``model``) is saved in, as its
    scheme's ``format``: ``quantization_format`` when given (llm-compressor's ``save_pretrained`` argument), else the
    ``format`` its recipe's scheme named, else the default. :func:`warn_formats` then says which reader cannot
    read what was chosen.

    The default is the format compressed-tensors infers, except where transformers 5.25 could not reload it, where
    it is ``int-quantized`` (the same integers and scales, one int8 per value): asymmetric int weights
    (:func:`~llmc_fsm.output.compressed.unpacked_zero_points`), embeddings
    (:func:`~llmc_fsm.output.compressed.unpacked_embeddings`) and classes whose weight initialisation reads
    ``weight`` (:func:`_unpacked_where_init_reads_weight`). A format asked for is written as asked, with a warning
    where transformers cannot reload it; the default's asymmetric ``int-quantized`` weights get a warning that vLLM
    does not serve them.

    Raises:
        ValueError: a format one of ``modules`` cannot be saved in (:func:`~llmc_fsm.toolkit.packed.format_problem`;
            every such module named, no scheme changed).
    """
    from compressed_tensors.compressors.format import infer_model_format
    from compressed_tensors.config import CompressionFormat

    for sub in modules.values():
        if not hasattr(sub, RECIPE_FORMAT_ATTR):
            fmt = sub.quantization_scheme.format
            setattr(sub, RECIPE_FORMAT_ATTR, getattr(fmt, "value", fmt))
    asked = {
        name: quantization_format or getattr(sub, RECIPE_FORMAT_ATTR)
        for name, sub in modules.items()
        if (quantization_format or getattr(sub, RECIPE_FORMAT_ATTR)) is not None
    }
    _check_formats({name: (type(modules[name]), modules[name].quantization_scheme) for name in asked}, asked)
    default = {name: sub for name, sub in modules.items() if name not in asked}
    for name, fmt in asked.items():
        modules[name].quantization_scheme.format = CompressionFormat(fmt)
    for sub in default.values():
        sub.quantization_scheme.format = None
    unpacked_zero_points(default)
    unpacked_embeddings(default)
    named = {f"{prefix}{n}" if n else prefix.removesuffix("."): m for n, m in default.items()}  # n == "": the module
    _unpacked_where_init_reads_weight(model if root is None else root, named)
    infer_model_format(model)  # sets the format of every quantized module whose scheme has none yet
    for name, sub in modules.items():
        setattr(sub, FORMAT_ASKED_ATTR, name in asked)


#: Attribute of a quantized module: whether its saved format was asked for (:func:`choose_formats`), read by
#: :func:`warn_formats`.
FORMAT_ASKED_ATTR = "quantization_format_asked"


def warn_formats(model: nn.Module, *, root: nn.Module | None = None) -> None:
    """After the quantized modules of ``model`` were saved (:func:`choose_formats` ran on each, in one call or one
    decoder layer at a time): one warning per kind of saved format one of the two readers does not read (the
    default ``int-quantized`` asymmetric int weights: vLLM; ``pack-quantized`` ones asked for and packed FP4 of a
    class whose initialisation reads its weight: transformers 5.25). ``root``: the model whose weight
    initialisation is probed, when ``model`` holds the quantized modules under the same names but is not it
    (``model_free_ptq``'s tree of Linears)."""
    modules = quantized_modules(model)
    asked = {name for name, sub in modules.items() if getattr(sub, FORMAT_ASKED_ATTR, False)}
    _warn_formats(model if root is None else root, modules, asked)


def _check_formats(schemes: dict[str, tuple[type, Any]], formats: str | dict[str, str]) -> None:
    """Refuse (``ValueError``, every module named) formats that ``{name: (module class, scheme)}`` cannot be saved in;
    ``formats``: one for all, or per name."""
    problems: dict[str, list[str]] = {}
    for name, (module_type, scheme) in schemes.items():
        fmt = formats if isinstance(formats, str) else formats[name]
        problem = format_problem(module_type, scheme, fmt)
        if problem is not None:
            problems.setdefault(problem, []).append(name)
    if problems:
        parts = "; ".join(
            f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}: {p}" for p, names in problems.items()
        )
        msg = (
            f"quantized weights cannot be saved in the compressed-tensors format asked for ({parts}); give a format "
            "their weights allow, or none (the default)"
        )
        raise ValueError(msg)


#: The packed float formats (weight_packed, no weight): no unpacked format holds their values.
_PACKED_FLOAT_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp6-pack-quantized")


def _warn_formats(model: nn.Module, modules: dict[str, nn.Module], asked: dict[str, str]) -> None:
    """One warning per kind of saved format that one of the two readers (transformers, vLLM) does not read."""
    asym_default, float_inputs_default, asym_packed, packed_unloadable, fp_unloadable = [], [], [], [], []
    for name, sub in modules.items():
        scheme = sub.quantization_scheme
        fmt = getattr(scheme.format, "value", scheme.format)
        weights, inputs = scheme.weights, scheme.input_activations
        asymmetric_int = weights is not None and str(weights.type) == "int" and not weights.symmetric
        if fmt in _PACKED_FLOAT_FORMATS and _init_reads_weight(model, name, sub):
            fp_unloadable.append(name)
        elif name not in asked:
            if asymmetric_int and fmt == "int-quantized" and inputs is None and not isinstance(sub, nn.Embedding):
                asym_default.append(name)
            elif (
                weights is not None
                and str(weights.type) == "int"
                and weights.num_bits == 4
                and weights.symmetric
                and inputs is not None
                and str(inputs.type) == "float"
                and fmt == "int-quantized"
                and not isinstance(sub, nn.Embedding)
            ):
                float_inputs_default.append(name)
        elif fmt == "pack-quantized":
            if asymmetric_int:
                asym_packed.append(name)
            elif isinstance(sub, nn.Embedding) or _init_reads_weight(model, name, sub):
                packed_unloadable.append(name)
    embedding = any(isinstance(sub, nn.Embedding) for sub in modules.values())
    per_group = (
        " (a quantized Embedding is saved int-quantized only: give the other modules' config group format: "
        "pack-quantized instead)"
        if embedding
        else ""
    )
    if asym_default:
        logger.warning(
            "%d modules with asymmetric int weights (e.g. %s) are saved int-quantized (one int8 per value): "
            "transformers reloads them, vLLM has no kernel for weight-only int-quantized weights. For vLLM save them "
            "pack-quantized, as llm-compressor does: quantization_format='pack-quantized' (--quantization-format; "
            "transformers 5.25 cannot reload that, its compressed-tensors loader allocates unpacked zero points)",
            len(asym_default),
            asym_default[0],
        )
    if float_inputs_default:
        logger.warning(
            "%d modules with int4 weights and float input activations (e.g. %s, W4A8-FP8) are saved int-quantized "
            "(one int8 per value, compressed-tensors' inferred format): transformers reloads them, vLLM's W4A8-FP8 "
            "scheme reads packed weights. For vLLM save them pack-quantized, as llm-compressor's W4A8-FP8 examples "
            "do: quantization_format='pack-quantized' (--quantization-format; transformers reloads that too)%s",
            len(float_inputs_default),
            float_inputs_default[0],
            per_group,
        )
    if asym_packed:
        logger.warning(
            "%d modules with asymmetric int weights (e.g. %s) are saved pack-quantized as asked: vLLM serves them, "
            "transformers 5.25 cannot reload them (its compressed-tensors loader allocates unpacked zero points: size "
            "mismatch); int-quantized (the default) reloads in transformers",
            len(asym_packed),
            asym_packed[0],
        )
    if fp_unloadable:
        logger.warning(
            "%d modules (e.g. %s) are saved in a packed FP4/FP6 format (no other format holds those values): "
            "transformers 5.25 cannot reload them (this architecture's weight initialisation reads their weight, "
            "which a packed module has not); vLLM reads them",
            len(fp_unloadable),
            fp_unloadable[0],
        )
    if packed_unloadable:
        logger.warning(
            "%d modules (e.g. %s) are saved pack-quantized as asked: transformers 5.25 cannot reload them (its weight "
            "initialisation reads their weight, which a packed module has not); int-quantized (the default) reloads",
            len(packed_unloadable),
            packed_unloadable[0],
        )


def _expert_tensors(
    module: nn.Module, prefix: str, state: dict[str, Any], quantization_format: str | None = None
) -> dict[str, Any]:
    """The compressed tensors of ``module``'s quantized expert matrices (:func:`quantized_views`), under their
    per-expert checkpoint names; the fused parameters they were read from are removed from ``state``.

    Each matrix is packed by compressed-tensors' compressor of its scheme's format (``pack-quantized``:
    ``weight_packed``, ``weight_scale``, ``weight_shape``), as a Linear module of that shape would be. transformers 5
    writes these keys unchanged and, on reload, decompresses them and fuses the experts again (dequantized).
    """
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat

    out = _dense_linear_experts(module, prefix, state)
    views = quantized_views(module)
    if not views:
        return out
    owners = {id(sub): name for name, sub in module.named_modules()}
    for view in views.values():
        owner = owners[id(view.owner)]
        state.pop(f"{prefix}{owner}.{view.param_name}" if owner else prefix + view.param_name, None)
        scheme = view.quantization_scheme
        if not hasattr(view, RECIPE_FORMAT_ATTR):
            setattr(view, RECIPE_FORMAT_ATTR, getattr(scheme.format, "value", scheme.format))
        fmt = quantization_format or getattr(view, RECIPE_FORMAT_ATTR)  # quantization_format: checked by the caller
        scheme.format = CompressionFormat(fmt) if fmt is not None else infer_module_format(nn.Linear, scheme)
        asymmetric_int = scheme.weights is not None and not scheme.weights.symmetric and scheme.weights.type == "int"
        if fmt is None and asymmetric_int and scheme.format == CompressionFormat.pack_quantized:
            scheme.format = CompressionFormat.int_quantized  # as a Linear's default (unpacked_zero_points): reloads
        local = {"weight": view.weight.detach().contiguous(), **view.quantized_params}
        packed = kept_packed(view, scheme.format.value, local)  # packed when it was quantized (MX)
        if packed is None:
            packed = BaseCompressor.get_value_from_registry(scheme.format.value).compress(local, scheme)
        out.update(
            {f"{view.checkpoint_name}.{key}": value.contiguous() for key, value in packed.items() if value is not None}
        )
    return out


def dense_linear_experts(model: nn.Module) -> dict[str, LinearView]:
    """``{name: view}`` of the expert matrices left dense (not quantized) in fused experts that transformers reloads
    as one Linear per expert matrix (:func:`~llmc_fsm.toolkit.views.reloads_as_linears`: Llama 4): a compressed
    checkpoint holds them per expert, under these names (the module names transformers gives their Linears; checked
    to be saved unrenamed by :func:`~llmc_fsm.toolkit.views.linear_expert_names`), and its config ignores them."""
    return {
        f"{name}.{suffix}" if name else suffix: view
        for name, sub in model.named_modules()
        if reloads_as_linears(sub)
        for suffix, view in weight_views(sub).items()
        if getattr(view, "quantization_scheme", None) is None
    }


def _dense_linear_experts(module: nn.Module, prefix: str, state: dict[str, Any]) -> dict[str, Any]:
    """The dense expert matrices of ``module``'s experts that transformers reloads as Linears
    (:func:`dense_linear_experts`), as per-expert ``<name>.weight`` tensors; the fused parameters they were read from
    are removed from ``state`` (a quantized checkpoint of Llama 4 must hold no fused expert tensor: transformers loads
    its experts as Linears, and vLLM reads either per-expert or fused names, not both)."""
    views = dense_linear_experts(module)
    owners = {id(sub): name for name, sub in module.named_modules()}
    out: dict[str, Any] = {}
    for name, view in views.items():
        owner = owners[id(view.owner)]
        state.pop(f"{prefix}{owner}.{view.param_name}" if owner else prefix + view.param_name, None)
        out[f"{prefix}{name}.weight"] = view.weight.detach().contiguous()
    return out


def write_quantization_config(model: nn.Module, directory: Path, *, sparsity: SparsityMetadata | None) -> None:
    """Add ``quantization_config`` (status compressed) to ``directory/config.json`` from ``model``'s schemes.

    Reads only the schemes on ``model``'s modules, so its weights may be on the ``meta`` device. A
    dense-format ``sparsity_config`` is added from ``sparsity`` (:func:`sparsity_metadata`) when given.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    views = quantized_views(model)
    modules = quantized_modules(model)
    several = len({v.quantization_scheme.model_dump_json(exclude={"targets"}) for v in views.values()}) > 1
    experts_group = bool(views and modules) and (several or _experts_need_group(modules, views))
    # the recipe's targets where they select what was quantized, else what was quantized (the config holds the
    # modules' scheme objects: written inside); not beside fused experts (the experts' group is chosen by its targets)
    with leaf_targets(modules, by_name=experts_group, model=None if views else model):
        if modules:
            compressor = ModelCompressor.from_pretrained_model(model)
        elif views and several:  # only Llama 4's experts, of several schemes: a group of each, by name
            compressor = ModelCompressor(quantization_config=QuantizationConfig(config_groups={}))
            _add_expert_groups_by_name(compressor.quantization_config, views)
        elif views:  # only fused experts quantized
            compressor = ModelCompressor(quantization_config=_experts_only_config(model, views))
        else:  # only KV-cache scales: compressed-tensors' config of a KV-only model (no group, dense format)
            compressor = ModelCompressor(quantization_config=QuantizationConfig(config_groups={}, format="dense"))
        compressor.quantization_config.quantization_status = QuantizationStatus.COMPRESSED  # what the tensors are
        # the rotations fused into the weights (SpinQuant's transform_config, under compressed-tensors'
        # TRANSFORM_CONFIG_NAME; from_pretrained_model reads it, the other branches do not)
        compressor.transform_config = getattr(model, "transform_config", None)
        config = compressor.quantization_config  # every unquantized module a class target would match on reload
        config.ignore = ignore_for_reload(model, quantized_modules(model), list(config.ignore or []))
        config.ignore += [n for n in dense_linear_experts(model) if n not in config.ignore]  # reloaded as Linears
        config.kv_cache_scheme = kv_cache_scheme(model) or config.kv_cache_scheme  # the plugin's calibrated KV scales
        if (attention := attention_scheme(model)) is not None:  # attention quantization: q/k/v scales
            config.config_groups[f"group_{len(config.config_groups)}"] = attention.model_copy(deep=True)
        if experts_group and several:
            _add_expert_groups_by_name(config, views)
        elif experts_group:
            _add_experts_group(config, views)
        compressor.update_config(str(directory))
    if sparsity is not None:
        _write_sparsity_config(directory, sparsity)


def _experts_need_group(modules: dict[str, nn.Module], views: dict[str, LinearView]) -> bool:
    """Whether the fused experts' matrices need a config group of their own beside the quantized Linear modules':
    unless every one of those has the experts' scheme (one group targeting ``Linear`` then covers all)."""
    same = next(iter(views.values())).quantization_scheme.model_dump_json(exclude={"targets"})
    return any(sub.quantization_scheme.model_dump_json(exclude={"targets"}) != same for sub in modules.values())


def _add_experts_group(config: Any, views: dict[str, LinearView]) -> None:
    r"""Give the fused experts' matrices their own config group (:func:`_experts_need_group`).

    transformers 5.25 reloads every fused expert with one group's scheme (``get_experts_scheme``): the first whose
    ``re:`` targets mention ``experts``, else the first with a class-name target. A group of the experts' scheme
    targeting their per-expert checkpoint names (``re:.*\.experts\.\d+\.(down_proj|gate_proj|up_proj)$``) is the
    group transformers then picks for them; it matches no module of the reloaded model (its experts are fused), and
    the other groups target their modules by name (:func:`llmc_fsm.output.compressed.leaf_targets`), so that no
    module, an expert's matrix included, is named by two groups.
    """
    scheme = next(iter(views.values())).quantization_scheme.model_copy(deep=True)
    names = sorted({view.checkpoint_name.rsplit(".", 1)[1] for view in views.values()})
    scheme.targets = [rf"re:.*\.experts\.\d+\.({'|'.join(names)})$"]
    config.config_groups[f"group_{len(config.config_groups)}"] = scheme
    formats = {getattr(g.format, "value", g.format) for g in config.config_groups.values() if g.format is not None}
    if len(formats) > 1:  # as compressed-tensors writes a config whose groups have different formats
        config.format = "mixed-precision"


def _add_expert_groups_by_name(config: Any, views: dict[str, LinearView]) -> None:
    """Expert matrices of several schemes (only for experts transformers reloads as one Linear per expert matrix:
    Llama 4; the plugin refuses others): their checkpoint names (the names of the reloaded Linears) join the config
    group of the same scheme, whose targets name its modules (:func:`~llmc_fsm.output.compressed.leaf_targets`), or a
    group of their own."""
    by_scheme: dict[str, list[LinearView]] = {}
    for view in views.values():
        by_scheme.setdefault(view.quantization_scheme.model_dump_json(exclude={"targets"}), []).append(view)
    for key, members in by_scheme.items():
        names = sorted(view.checkpoint_name for view in members)
        same = [g for g in config.config_groups.values() if g.model_dump_json(exclude={"targets"}) == key]
        if same and "Linear" not in same[0].targets:  # a group of the same scheme naming its modules: theirs too
            same[0].targets = [*same[0].targets, *names]
            continue
        scheme = members[0].quantization_scheme.model_copy(deep=True)
        scheme.targets = names
        config.config_groups[f"group_{len(config.config_groups)}"] = scheme
    formats = {getattr(g.format, "value", g.format) for g in config.config_groups.values() if g.format is not None}
    config.format = "mixed-precision" if len(formats) > 1 else next(iter(formats), config.format)


def _experts_only_config(model: nn.Module, views: dict[str, LinearView]) -> Any:
    """The ``quantization_config`` of a model whose only quantized weights are fused experts' matrices.

    One config group (the experts' scheme, the plugin allows one) targeting ``Linear``, which transformers 5.24's
    experts loader takes for the experts (its ``get_experts_scheme``), with every ``nn.Linear`` module of the model
    under ``ignore`` (none of them is quantized).
    """
    from compressed_tensors.quantization import QuantizationConfig

    scheme = next(iter(views.values())).quantization_scheme.model_copy(deep=True)
    scheme.targets = ["Linear"]
    return QuantizationConfig(
        config_groups={"group_0": scheme},
        format=scheme.format.value,
        ignore=[name for name, sub in model.named_modules() if name and isinstance(sub, nn.Linear)],
    )


def _write_sparsity_config(directory: Path, sparsity: SparsityMetadata) -> None:
    from compressed_tensors.config import DenseSparsityConfig

    config_path = directory / "config.json"
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    sparsity_config = DenseSparsityConfig(
        global_sparsity=sparsity.global_sparsity, sparsity_structure=sparsity.structure, targets=sparsity.targets
    )
    config["quantization_config"]["sparsity_config"] = sparsity_config.model_dump()
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _init_reads_weight(model: nn.Module, name: str, module: nn.Module) -> bool:
    """Whether reloading ``model``'s checkpoint fails when the Linear ``name`` (``module``) has no ``weight``, as a
    module of a packed checkpoint has none (``weight_packed`` instead): transformers' weight initialisation
    (``_init_weights``, run on the modules of the loaded model) reads ``weight`` unguarded in some families — of the
    module itself (Falcon's ``FalconLinear``: ``'FalconLinear' object has no attribute 'weight'``, transformers
    5.24), or of a child from its parent (GPTBigCode's attention reads ``c_proj.weight``, Mamba's and Mamba-2's
    mixers ``out_proj.weight``, transformers 5.25; a breaker's case).

    Measured, not listed: on the model its config describes, built on the ``meta`` device once per model
    (:class:`_InitProbe`), the module's ``weight`` is removed and ``_init_weights`` is called on it and on each of
    its ancestors up to its decoder layer (on ``meta`` nothing is initialised; not the model's root, whose own
    initialisation may build a ``[positions, positions]`` mask in memory), each time the ``_init_weights`` of the
    sub-model transformers initialises it with (:func:`_owner_init`: a vision tower's own; SigLIP's reads every
    Linear's ``weight``); an ``AttributeError`` naming ``weight`` means the reload would fail. A model without a
    config, or whose names its config's model does not have, is probed on the module's class alone (the module
    itself).
    """
    if not isinstance(module, nn.Linear) or getattr(model, "_init_weights", None) is None:
        return False
    probe = _INIT_PROBES.get(model)
    if probe is None:
        probe = _INIT_PROBES[model] = _InitProbe(model)
    return probe.reads_weight(name, module)


class _InitProbe:
    """The ``meta``-device model of ``model``'s config, and per module name (layer indices left out) and chain of
    module classes (the module, its parent, ... the root) whether ``_init_weights`` on that chain reads the module's
    ``weight`` (:func:`_init_reads_weight`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.skeleton: nn.Module | bool | None = False  # False: not built yet; None: cannot be built
        self.found: dict[tuple[Any, ...], bool] = {}
        self.renamer: Any = None  # checkpoint name -> the skeleton's (checkpoint_key_renamer), built when needed

    def _built(self) -> nn.Module | None:
        if self.skeleton is False:
            config = getattr(self.model, "config", None)
            try:
                self.skeleton = meta_model(config) if config is not None else None
            except Exception as err:  # a config transformers cannot build alone: the class probe
                logger.debug("no meta-device model to probe the weight initialisation on (%s)", err)
                self.skeleton = None
        return self.skeleton  # type: ignore[return-value]

    def _rename(self, skeleton: nn.Module) -> Any:
        if self.renamer is None:
            self.renamer = checkpoint_key_renamer(skeleton)
        return self.renamer

    @staticmethod
    def _chain(skeleton: nn.Module, name: str) -> list[nn.Module] | None:
        """The module ``name`` of ``skeleton``, its parent, ..., the root (``None``: no such module)."""
        parts = name.split(".")
        prefixes = [".".join(parts[:i]) for i in range(len(parts), -1, -1)]
        try:
            return [skeleton.get_submodule(p) for p in prefixes]
        except AttributeError:  # its names are not the model's (an in-memory model of another class)
            return None

    def reads_weight(self, name: str, module: nn.Module) -> bool:
        skeleton = self._built()
        chain = self._chain(skeleton, name) if skeleton is not None else None
        if chain is None and skeleton is not None:  # a checkpoint name (model_free_ptq): renamed
            renamed, fused = self._rename(skeleton)(f"{name}.weight")
            if fused is None:
                name = renamed.removesuffix(".weight")
                chain = self._chain(skeleton, name)
        if chain is None or not isinstance(chain[0], nn.Linear):
            return _class_init_reads_weight(self.model, module)
        inits = [_owner_init(chain[i:]) for i in range(len(chain))]
        lists = [i for i, m in enumerate(chain) if isinstance(m, nn.ModuleList)]
        end = lists[0] if lists else 1  # up to its decoder layer: the root's init may build [positions, positions]
        chain, inits = chain[:end], inits[:end]
        key = (re.sub(r"\.\d+(?=\.|$)", ".#", name), *(type(m) for m in chain))  # the same in every layer
        if key not in self.found:
            target = chain[0]
            weight = target._parameters.pop("weight", None)
            try:
                self.found[key] = any(_init_raises_on_weight(init, m) for init, m in zip(inits, chain, strict=True))
            finally:
                target._parameters["weight"] = weight
        return self.found[key]


def _owner_init(ancestors: list[nn.Module]) -> Callable[[nn.Module], Any]:
    """The ``_init_weights`` transformers runs on ``ancestors[0]`` at load (``ancestors``: the module, its parent,
    ..., the root): that of the innermost ``PreTrainedModel`` among them, the module itself included, as
    ``PreTrainedModel.initialize_weights`` (transformers 5.25) dispatches each sub-model's own init to its modules:
    a vision tower's (``SiglipVisionModel``) to the tower's Linears, not the root's
    (``Gemma3ForConditionalGeneration``).
    A sub-model is known as transformers' dispatch finds it: by its ``_initialize_weights`` (``PreTrainedModel``'s);
    the root's init when none has one."""
    owner = next((m for m in ancestors if callable(getattr(m, "_initialize_weights", None))), ancestors[-1])
    return owner._init_weights  # type: ignore[return-value]


#: model -> its :class:`_InitProbe` (while the model lives: choose_formats runs once per decoder layer when streamed).
_INIT_PROBES: weakref.WeakKeyDictionary[nn.Module, _InitProbe] = weakref.WeakKeyDictionary()


def _init_raises_on_weight(init: Callable[[nn.Module], Any], module: nn.Module) -> bool:
    try:
        init(module)
    except AttributeError as exc:
        return "weight" in str(exc)
    except Exception as exc:  # an init that fails on meta for another reason: not this
        logger.debug("_init_weights(%s) on the meta-device model raised %r", type(module).__name__, exc)
    return False


def _class_init_reads_weight(model: nn.Module, module: nn.Module) -> bool:
    """The class probe: ``_init_weights`` on a bare module of ``module``'s class without ``weight``."""
    if type(module) is nn.Linear:
        return False
    probe = nn.Module.__new__(type(module))
    nn.Module.__init__(probe)
    probe.register_parameter("bias", None)
    probe.in_features, probe.out_features = module.in_features, module.out_features
    return _init_raises_on_weight(model._init_weights, probe)  # type: ignore[operator]


def _unpacked_where_init_reads_weight(model: nn.Module, modules: dict[str, nn.Module]) -> None:
    """Quantized modules that compressed-tensors would pack and whose class the model's weight initialisation reads
    ``weight`` of (:func:`_init_reads_weight`: Falcon's ``FalconLinear``) are saved ``int-quantized``: their integer
    values under ``weight`` (one int8 each, so a 4-bit weight takes 8 bits on disk), which reload. Packed, transformers
    5.24 failed to reload the checkpoint (``'FalconLinear' object has no attribute 'weight'``). Sets
    ``quantization_scheme.format`` of those modules."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat

    for name, sub in modules.items():
        scheme = sub.quantization_scheme
        if scheme.format not in (None, CompressionFormat.pack_quantized):
            continue
        if _init_reads_weight(model, name, sub):
            scheme.format = None
            if infer_module_format(type(sub), scheme) == CompressionFormat.pack_quantized:
                scheme.format = CompressionFormat.int_quantized
