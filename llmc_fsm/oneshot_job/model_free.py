"""``llmc_fsm.model_free_ptq``: data-free quantization of a safetensors checkpoint without loading the model.

llm-compressor's ``model_free_ptq`` (``llmcompressor.entrypoints.model_free``), with its arguments: the weights are
read from the checkpoint's safetensors files one shard at a time, each Linear weight is quantized with the scheme,
and the shard is written again in compressed-tensors format; nothing builds or runs the model, so it works for an
architecture transformers does not know and for checkpoints larger than memory (one shard at a time). Only
data-free schemes: weight quantization and dynamic activations (``W8A8``, ``FP8_DYNAMIC``, ``FP8_BLOCK``,
``W4A16``, ``NVFP4A16``, ``MXFP4A16``, ...); anything that needs calibration data is refused before any work.

How it runs, in the project's own terms:

* the scheme (a preset name, a ``QuantizationScheme``) or the ``QuantizationConfig`` becomes a one-stage recipe
  with one :class:`QuantizationModifier` (the quantization plugin's), run through a :class:`~llmc_fsm.Session` like
  every other job: ``initialize`` on a ``meta``-device model of ``nn.Linear`` modules named as the checkpoint names
  them (:func:`linear_tree`) resolves the targets and runs every check of the scheme (group sizes, block shapes,
  dtypes) before any weight is read; ``calibration_start``; one ``sequential_epoch_end`` per shard with that shard's
  weights read in (the modifier quantizes them); ``calibration_end``; ``finalize``;
* which tensors are Linear weights: a ``<module>.weight`` of two dimensions, as llm-compressor's
  ``match_quantizable_tensors`` decides, except that where transformers can build the architecture from
  ``config.json`` (on the ``meta`` device, nothing read), a module the model defines as anything but
  ``nn.Linear`` (an ``Embedding``, GPT-2's ``Conv1D``, a norm) is not one: transformers would not reload it
  quantized (llm-compressor quantizes it when the ``ignore`` list does not name it; one INFO line names those the
  targets match, MoE routers such as Qwen3-MoE's ``mlp.gate`` included). Modules named ``*norm`` are never
  targets. A tensor of three dimensions matched by the targets (fused mixture-of-experts weights such as
  ``experts.gate_up_proj``) is refused: :func:`llmc_fsm.oneshot` quantizes those per expert;
* ``ignore`` matches the checkpoint's module names and, where transformers builds the architecture, the model's
  names too (exact names and ``re:`` patterns alike: ``re:model.visual.*`` keeps Qwen2.5-VL's vision tower dense,
  which its checkpoint names ``visual.blocks...``), so a list written for :func:`llmc_fsm.oneshot` keeps the same
  modules dense; the exact names given stay in ``config.json``'s ``ignore``, as llm-compressor writes them;
* NVFP4 weights that vLLM fuses (``q/k/v_proj``, ``gate/up_proj``, ...) share one global scale, as in
  :func:`llmc_fsm.oneshot`: the weights of one parent module are read together (from whichever shards hold them)
  and written into the shard of the first one (the index says where each tensor is);
* tensors the model built from ``config.json`` does not load (DeepSeek-V3's multi-token-prediction layer) are
  written too, with one warning: embedding- and head-like 2-D weights dense (:func:`_embedding_like`), other 2-D
  weights quantized by name; ``dtype`` leaves the model class's keep-in-float32 tensors as stored;
* ``converter``: a compressed-tensors converter (``compressed_tensors.entrypoints.convert``, e.g.
  ``FP8BlockDequantizer``, ``ModelOptNvfp4Converter``) applied to each shard's tensors first, as llm-compressor
  does; the tensors it needs together are read together (its ``get_dependencies``);
* the output is written in a hidden work directory and renamed into place (:mod:`llmc_fsm.output.workdir`): a
  failed or interrupted call leaves no output; every file of the checkpoint directory that is not a safetensors
  shard (config, tokenizer, ...) is copied, ``config.json`` gains ``quantization_config`` (every Linear left
  unquantized listed under ``ignore``) and ``recipe.yaml`` records the recipe run.

Differences from llm-compressor 0.14, each said in a log line where it applies: the default ``ignore`` keeps
``lm_head`` dense (as every llmc-fsm recipe); shards are processed one at a time (``max_workers`` is accepted and
has no effect: torch's threads do the work within a shard); one device (a list of several is refused); asymmetric
int weights are saved ``int-quantized`` by default, as ``oneshot`` saves them (transformers reloads them;
llm-compressor writes ``pack-quantized``, which vLLM serves: ``quantization_format="pack-quantized"``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn
from tqdm.auto import tqdm

from llmc_fsm.core.errors import ModifierError, RecipeError
from llmc_fsm.models.checkpoint_match import mismatch_summary
from llmc_fsm.models.hf_io import (
    check_safetensors,
    checkpoint_key_renamer,
    first_line,
    fix_safetensors_permissions,
    meta_model,
    safetensors_index,
)
from llmc_fsm.models.known import CACHE_MARKER, KNOWN_MODELS, known_model_dir
from llmc_fsm.oneshot_job.api import _torch_threads
from llmc_fsm.oneshot_job.settings import OneshotSettings, _dtype_name
from llmc_fsm.output.directory import check_output_dir, check_output_not_source
from llmc_fsm.output.save import compressed_state_dict, warn_formats, write_quantization_config
from llmc_fsm.output.workdir import WorkDir, recover_previous
from llmc_fsm.session.session import Session
from llmc_fsm.toolkit.distributed import get_world_size, launched_world_size
from llmc_fsm.toolkit.packed import expert_reload_problem, format_problem
from llmc_fsm.toolkit.targets import compact_names, model_family, tied_head
from llmc_fsm.toolkit.views import reloads_as_linears

__all__ = ["QUANTIZATION_PARAMS", "already_quantized", "checkpoint_classes", "linear_tree", "model_free_ptq"]

logger = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"
#: Weight files of other formats beside the safetensors checkpoint (PyTorch pickles, GGUF): not copied.
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".gguf")


def model_free_ptq(
    model_stub: str | os.PathLike[str],
    save_directory: str | os.PathLike[str],
    scheme: Any = None,
    config: Any = None,
    ignore: Iterable[str] | None = None,
    max_workers: int = 1,
    device: str | torch.device | list[Any] | None = None,
    converter: Any = None,
    *,
    overwrite: bool = False,
    progress: bool = True,
    dtype: str | torch.dtype | None = None,
    group_size: int | None = None,
    quantization_format: str | None = None,
    threads: int | None = None,
) -> Path:
    """Quantize the Linear weights of a safetensors checkpoint with a data-free scheme, shard by shard.

    Args:
        model_stub: a checkpoint directory (``*.safetensors`` files, with ``model.safetensors.index.json`` when
            sharded), a known model name (``smollm2-135m``), or a Hugging Face Hub id (downloaded through
            compressed-tensors' ``get_checkpoint_files``).
        save_directory: the output directory (created; an existing non-empty one only with ``overwrite``).
        scheme: a compressed-tensors preset name (``"FP8_BLOCK"``, ``"W4A16"``, ``"NVFP4A16"``, ...), a
            ``QuantizationScheme`` (its ``targets``; none: every Linear) or its mapping. Exactly one of ``scheme`` and
            ``config``.
        config: a compressed-tensors ``QuantizationConfig`` (or its mapping): its ``config_groups``, each with its
            targets, and its ``ignore`` (added to ``ignore``); a ``kv_cache_scheme`` needs calibration: refused.
        ignore: module names or ``re:`` patterns left unquantized (with the modules in a container named), as the
            checkpoint names them or, where transformers builds the architecture, as the model does (``oneshot``'s
            names: ``re:model.visual.*`` for Qwen2.5-VL's ``visual.blocks...``); the exact names are kept in
            ``config.json``'s ``ignore``. ``None`` (not given): ``lm_head``, as every llmc-fsm recipe's default,
            said in a log line (llm-compressor's default is empty); ``[]``: nothing.
        max_workers: a positive int, accepted for llm-compressor's scripts; shards are processed one at a time.
        device: where the weights are rounded: ``None`` / ``"cpu"``, or one CUDA device (``"cuda:0"``); the
            output is the same on either (up to the device's float arithmetic).
        converter: a compressed-tensors ``Converter`` applied to each shard's tensors before quantization (e.g.
            ``FP8BlockDequantizer`` for a checkpoint stored in block FP8); its ``update_config`` gives the
            checkpoint's quantization config that ours is merged into.
        overwrite: ``True`` / ``False``: replace an existing output directory that holds a model.
        progress: ``True`` / ``False``: a tqdm bar over the shards.
        dtype: ``"bfloat16"`` / ``"float16"`` / ``"float32"`` (or the ``torch.dtype``): the checkpoint's float
            tensors (not the quantization parameters of modules quantized already, nor the tensors transformers
            keeps in float32 at that dtype: left as stored, one INFO line) are read in it and the output written in
            it, ``config.json`` saying so — NVFP4 and MX need bfloat16 (llmc-fsm's argument, as ``oneshot``'s
            ``dtype``; ``None``: as stored).
        group_size: replaces the weight group size of ``scheme``, a preset name whose int weights are quantized in
            groups (``W4A16``'s 128: SmolLM2's width 576 needs 64), as ``oneshot``'s ``--group-size`` (llmc-fsm's
            argument; ``None``: the preset's).
        quantization_format: the compressed-tensors format of every quantized weight written, as ``oneshot``'s
            ``quantization_format`` (``"pack-quantized"``, ``"int-quantized"``, ...; ``None``: each scheme's
            default, as ``oneshot`` saves it: asymmetric int weights ``int-quantized``, which transformers reloads
            and vLLM does not serve; ``"pack-quantized"`` writes them as llm-compressor's ``model_free_ptq`` does,
            for vLLM). llmc-fsm's argument.
        threads: torch CPU threads during the call (``torch.set_num_threads``, put back afterwards), a positive
            int, as ``oneshot``'s ``threads`` (llmc-fsm's argument; ``None``: torch's choice).

    Returns:
        The output directory (resolved).

    Raises:
        ValueError: several processes (``torchrun``, a ``torch.distributed`` group of more than one rank: it runs
            in one), before anything else; ``overwrite`` / ``progress`` not a bool, ``max_workers`` not a positive
            int, ``threads`` not a positive int or ``None``, ``quantization_format`` not one of compressed-tensors'
            formats (as ``oneshot``'s, named with its flag) or one the scheme's weights cannot be saved in; both
            or neither of ``scheme`` / ``config``; an unknown or invalid ``scheme`` / ``config``; ``group_size``
            not a positive int, or given with a ``config``, a scheme object or a preset whose weights are not int
            groups (``FP8_DYNAMIC``, ``NVFP4A16``, ``MXFP4A16``); a scheme that needs calibration data (static
            activation scales, NVFP4's input global scale, ``kv_cache_scheme``, an ``imatrix_mse`` observer), naming
            what needs it; a targeted tensor of three dimensions; several devices; a shard named in the index (or
            the only weights file) that is a PyTorch ``.bin`` file, not safetensors; an index that disagrees with its
            shards (a tensor in another shard than it says, in none, or not named) — before the output is created.
        ModifierError: what the quantization modifier refuses at ``initialize`` on the checkpoint's names, shapes
            and dtypes (targets matching nothing, a group size or block shape that does not fit), from its
            ``ValueError`` — before the output is created.
        FileNotFoundError: ``model_stub`` holds no safetensors checkpoint.
        RuntimeError: ``device`` names a CUDA device and torch sees none.
        FileExistsError / PermissionError / NotADirectoryError: as :func:`llmc_fsm.output.directory.check_output_dir`.
        OSError: reading or writing a file failed (the output is not created).
    """
    started = time.perf_counter()
    _refuse_several_processes()
    max_workers, overwrite, progress, threads = _flags(max_workers, overwrite, progress, threads, quantization_format)
    check_output_dir(save_directory, overwrite)  # the cheapest refusal (claimed after the checks below)
    with _torch_threads(threads):
        plan = _plan(model_stub, scheme, config, ignore, device, converter, dtype, group_size, quantization_format)
        if max_workers != 1:
            logger.warning(
                "model_free_ptq: shards are processed one at a time (max_workers=%s has no effect)", max_workers
            )
        output = _claim(save_directory, model_stub, overwrite)
        try:
            output.settle({"model_free_ptq": True}, resume=False)
            _write(plan, output.staging, progress=progress)
            output.publish()
        except BaseException as exc:
            output.abort(exc)
            raise
    dense = {name for name, module in plan.tree.named_modules() if _is_linear(module)} - plan.targets
    logger.info(
        "model_free_ptq: %d Linear weights quantized, %d left as they were, in %d shards: %s (%.1f s)",
        len(plan.targets),
        len(dense),
        len(plan.jobs),
        output.output,
        time.perf_counter() - started,
    )
    return output.output


def _refuse_several_processes() -> None:
    """Refuse to run as one of several processes: every rank planned and claimed the same output, and the ranks'
    check at ``initialize`` failed on the planning tree (found by a tester); nothing here is split between ranks."""
    world = max(get_world_size(), launched_world_size())
    if world > 1:
        msg = (
            f"model_free_ptq (llmc-fsm model-free) runs in one process, and this is one of {world} "
            "(torchrun / torch.distributed): run it without torchrun"
        )
        raise ValueError(msg)


@attrs.define(eq=False)
class _Plan:
    """What :func:`model_free_ptq` found before writing anything.

    Attributes:
        session: initialized on :attr:`tree`; its modifier quantizes each shard's Linears.
        tree: the checkpoint's Linear weights as ``meta`` modules (:func:`linear_tree`).
        targets: the tree's module names the modifier quantizes.
        files: ``{relative name: local path}`` of the checkpoint's files.
        jobs: ``{output shard: {source file: tensor names}}`` (:func:`_jobs`).
        converters: the converter, if any, in a list.
        skeleton: the architecture's model on ``meta`` (``None``: transformers cannot build it).
        classes: :func:`checkpoint_classes` of :attr:`skeleton` (``None`` without it).
        base: the quantization config ours is merged into (the checkpoint's or the converter's; ``None``).
        device: where the weights are rounded.
        dtype: the float tensors' dtype (``None``: as stored).
        quantization_format: the compressed-tensors format every quantized weight is written in (``None``: each
            scheme's default).
        ignore: the ``ignore`` entries given (the config's, then the argument's): their exact names are kept in
            ``config.json``'s ``ignore``, as llm-compressor keeps the list given.
        kept: the tensor names :attr:`dtype` does not convert (:func:`_kept_in_float32`: left as stored).
        shards: the checkpoint's safetensors files read (the index's shards, or the one file).
    """

    session: Session
    tree: nn.Module
    targets: set[str]
    files: dict[str, str]
    jobs: dict[str, dict[str, list[str]]]
    converters: list[Any]
    skeleton: nn.Module | None
    classes: dict[str, tuple[str, type] | None] | None
    base: Any
    device: torch.device
    dtype: torch.dtype | None
    quantization_format: str | None
    ignore: list[str] = attrs.Factory(list)
    kept: frozenset[str] = frozenset()
    shards: frozenset[str] = frozenset()


def _plan(
    model_stub: Any,
    scheme: Any,
    config: Any,
    ignore: Any,
    device: Any,
    converter: Any,
    dtype: Any,
    group_size: Any,
    quantization_format: str | None = None,
) -> _Plan:
    """Every check of :func:`model_free_ptq` (arguments, checkpoint, scheme on the real shapes), nothing written.

    Raises:
        as :func:`model_free_ptq`.
    """
    run_device = _device(device)
    cast = _dtype(dtype)
    given = _given_ignore(ignore, config)
    session = _session(scheme, config, ignore, group_size)
    _check_data_free(session)
    files = _checkpoint_files(model_stub)
    existing = _existing_config(files, converter)
    converters = [converter] if converter is not None else []
    weight_map = _weight_map(files)
    jobs = _jobs(weight_map, files, converters)
    stored = {name: t for job in jobs.values() for name, t in _converted(job, converters, None, meta=True).items()}
    skeleton = _meta_model(files)
    kept = _kept_in_float32(skeleton, stored, cast)
    shapes = _cast(stored, cast, kept)
    outside: list[str] = []
    dense_outside: dict[str, tuple[str, type]] = {}
    if skeleton is not None:
        _check_against_config(skeleton, shapes, weight_map)
        outside = _outside_model(skeleton, shapes)
        dense_outside = _embedding_like(skeleton, shapes, outside)
    classes = None if skeleton is None else checkpoint_classes(skeleton, shapes)
    tree = linear_tree(shapes, None if classes is None else {**classes, **dense_outside})
    if classes is not None:
        arguments = (scheme, config, ignore, group_size)
        session, ignore, told = _tied_head_ignore(session, tree, skeleton, classes, arguments)
        session = _ignore_checkpoint_names(session, tree, classes, scheme, config, ignore, group_size)
    _check_fused_experts(shapes, session, skeleton)
    _check_left_to_quantize(session, tree, shapes)  # first: a checkpoint quantized already has no Linear left
    _check_some_linear(tree, shapes)
    try:
        session.initialize(model=tree)
    except ModifierError as exc:  # the modifier's own refusal, without the session's advice to its API callers
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        msg = f"model_free_ptq: {exc.modifier} refuses this checkpoint: {_own_terms(str(cause), scheme)}"
        raise ModifierError(msg, modifier=exc.modifier, hook=exc.hook) from cause
    targets = {n for m in session.modifiers for n in m.resolved_targets}
    base = converter.update_config(existing) if converter is not None else existing
    _check_ignored_by_pattern(base, targets)
    if classes is not None:
        _warn_expert_reload(session, sorted(t for t in targets if t in classes and classes[t] is None))
    _check_format(session, quantization_format, scheme)
    if classes is not None:
        _note_other_weights(session, shapes, classes, told)
    if outside:
        _warn_outside(skeleton, outside, targets, dense_outside)
    return _Plan(
        session,
        tree,
        targets,
        files,
        jobs,
        converters,
        skeleton,
        classes,
        base,
        run_device,
        cast,
        quantization_format,
        given,
        kept,
        frozenset(weight_map.values()),
    )


def _write(plan: _Plan, staging: Path, *, progress: bool) -> None:
    """Quantize and write every shard into ``staging``, then the checkpoint's other files and the configs."""
    written, size = _quantize_shards(plan, staging, progress=progress)
    fix_safetensors_permissions(staging)  # safetensors writes 0600: a server of another user could not read them
    plan.session.finalize()
    _write_metadata(staging, plan.files, plan.tree, written, size, plan.session, plan.skeleton, plan.shards)
    if plan.dtype is not None and (staging / "config.json").exists():  # the dtype the tensors are written in
        data = json.loads((staging / "config.json").read_text(encoding="utf-8"))
        for key in ("torch_dtype", "dtype"):
            if key in data or key == "dtype":
                data[key] = str(plan.dtype).removeprefix("torch.")
        (staging / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _merge_config(staging / "config.json", plan.base, plan.targets)
    if plan.skeleton is not None:
        _targets_as_loaded(staging / "config.json", plan.classes or {})
        quantized = plan.targets | already_quantized(written)
        _ignore_unquantized_linears(staging / "config.json", plan.skeleton, plan.classes or {}, quantized)
    _keep_given_ignore(staging / "config.json", plan.ignore)


def _given_ignore(ignore: Iterable[str] | None, config: Any) -> list[str]:
    """The ``ignore`` entries the caller gave: the ``config``'s (a ``QuantizationConfig`` or its mapping), then the
    argument's (a string is one entry; ``None``: none), as :func:`_recipe` orders them."""
    own = [ignore] if isinstance(ignore, str) else list(ignore or [])
    from_config = list(_plain_scheme(config).get("ignore") or []) if config is not None else []
    return list(dict.fromkeys([*from_config, *own]))


def _keep_given_ignore(config_path: Path, given: Sequence[str]) -> None:
    """Append to ``quantization_config.ignore`` the exact names of ``given`` (the caller's ``ignore``) it lacks, as
    llm-compressor's ``model_free_ptq`` writes the list given: an entry naming a module without a Linear weight
    (``model.embed_tokens``) disappeared from it (found by a tester). Harmless on reload: every module an entry
    names, by the checkpoint's name or the model's, was left dense. ``re:`` patterns are not kept (the Linears they
    matched are listed by name): a later ``model_free_ptq`` on the output could not quantize what a pattern of its
    config matches (:func:`_check_ignored_by_pattern`), while the names of modules it quantizes leave the list."""
    if not given or not config_path.exists():
        return
    data = json.loads(config_path.read_text(encoding="utf-8"))
    config = data.get("quantization_config")
    if config is None:
        return
    listed = list(config.get("ignore") or [])
    missing = [e for e in given if isinstance(e, str) and not e.startswith("re:") and e not in listed]
    if missing:
        config["ignore"] = [*listed, *missing]
        config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _check_against_config(model: nn.Module, shapes: Mapping[str, torch.Tensor], weight_map: Mapping[str, str]) -> None:
    """Refuse a checkpoint that does not hold the model its ``config.json`` describes (``model``, on ``meta``): a
    parameter no checkpoint tensor gives (renamed as ``from_pretrained`` renames; a parameter tied to one given, one
    of a module quantized already, or one matching the model's ``_keys_to_ignore_on_load_missing`` is not missing), or
    a tensor of another shape than the config's. Found by a tester: a checkpoint without a ``down_proj`` was written
    without it, and a ``q_proj`` stored 64x8 (config 64x64) was quantized into a checkpoint that cannot reload.

    Raises:
        ValueError: one line naming the missing parameters (the first five, then a count) and the tensors of another
            shape (checkpoint name, file, stored shape, the config's).
    """
    rename = checkpoint_key_renamer(model)
    state = model.state_dict(keep_vars=True)
    first_of: dict[int, str] = {}
    canonical = {name: first_of.setdefault(id(tensor), name) for name, tensor in state.items()}
    quantized = already_quantized(shapes)
    given: set[str] = set()
    wrong: list[str] = []
    for key, tensor in sorted(shapes.items()):
        name, pattern = rename(key)
        if key.rpartition(".")[0] in quantized:  # stored packed or with scales: its shapes are not the dense ones
            name, pattern = rename(f"{key.rpartition('.')[0]}.weight")
            given.update(canonical[n] for n in state if n.rpartition(".")[0] == name.rpartition(".")[0])
            continue
        if name not in state:
            continue
        given.add(canonical[name])
        expected = list(state[name].shape)
        if pattern is None and list(tensor.shape) != expected:
            wrong.append(f"{key} in {weight_map.get(key, '?')} is {list(tensor.shape)}, config.json gives {expected}")
    patterns = getattr(model, "_keys_to_ignore_on_load_missing", None) or ()
    ignored = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
    missing = [
        name
        for name, _ in model.named_parameters()  # tied parameters once, under their first name
        if name not in given and (ignored is None or ignored.search(name) is None)
    ]
    if not missing and not wrong:
        return
    msg = (
        "model_free_ptq: the checkpoint does not match the model its config.json describes "
        f"({mismatch_summary(missing, wrong)}); nothing was written: copy the complete checkpoint, or fix config.json"
    )
    raise ValueError(msg)


def _kept_in_float32(
    model: nn.Module | None, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None
) -> frozenset[str]:
    """The names of ``tensors`` (checkpoint names; their stored dtypes) that ``dtype`` does not convert: those of the
    model class's ``_keep_in_fp32_modules`` (for float16) and ``_keep_in_fp32_modules_strict`` (for float16 and
    bfloat16), which ``from_pretrained`` loads in float32 at that dtype (transformers' ``_get_dtype_plan``, its
    patterns searched in the model's names, ``*`` as any text): DeepSeek-V3's and GLM-4.5's router ``gate.weight``
    and ``e_score_correction_bias``. They are left as stored, and one INFO line names those whose stored dtype is not
    ``dtype``. Found by a tester: ``--dtype bfloat16`` wrote DeepSeek-V3's float32 routers in bfloat16, while
    ``oneshot(..., dtype=torch.bfloat16)`` writes them in float32.

    Args:
        model: the architecture built on ``meta`` from ``config.json`` (``None``: none kept).
        tensors: ``{checkpoint name: tensor}`` as stored (any device; only dtypes are read).
        dtype: the dtype of ``model_free_ptq`` (``None``: nothing converted, none kept).
    """
    plan_of = getattr(model, "_get_dtype_plan", None)
    plan = plan_of(dtype) if plan_of is not None and dtype is not None else {}
    if not plan:
        return frozenset()
    patterns = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in plan))
    rename = checkpoint_key_renamer(model)
    state = model.state_dict(keep_vars=True)
    kept = set()
    for key in tensors:
        name, pattern = rename(key)
        if (name in state or pattern is not None) and patterns.search(name) is not None:
            kept.add(key)
    changed = sorted(k for k in kept if tensors[k].dtype in _FLOATS.values() and tensors[k].dtype != dtype)
    if changed:
        stored = ", ".join(sorted({str(tensors[k].dtype).removeprefix("torch.") for k in changed}))
        logger.info(
            "model_free_ptq: dtype %s: %s left as stored (%s): transformers loads %s's %s in float32 at this dtype "
            "(oneshot writes them in float32)",
            str(dtype).removeprefix("torch."),
            compact_names(changed),
            stored,
            type(model).__name__,
            ", ".join(sorted(plan)),
        )
    return frozenset(kept)


#: Module names (the end of a checkpoint module's name) of input embeddings and output heads: a 2-D weight of one
#: outside the model built from ``config.json`` is left dense (:func:`_embedding_like`).
_HEAD_NAMES = ("embed_tokens", "lm_head", "shared_head.head")
#: Parameter names of quantization parameters beyond :data:`QUANTIZATION_PARAMS` (KV cache scales): not reported as
#: tensors outside the model.
_SCALE_SUFFIXES = ("_scale", "_zero_point")


def _outside_model(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of ``tensors`` (checkpoint names) that ``model`` (built from ``config.json`` on ``meta``) does not
    load, renamed as ``from_pretrained`` renames them: ``from_pretrained``, and so ``oneshot``, drops them
    (DeepSeek-V3's and GLM-4.5's multi-token-prediction layer, ``model.layers.N`` past ``num_hidden_layers``, which
    vLLM reads for speculative decoding). Quantization parameters (of modules quantized already, KV cache scales) are
    not counted."""
    rename = checkpoint_key_renamer(model)
    state = model.state_dict(keep_vars=True)
    quantized = already_quantized(tensors)
    outside = []
    for key in sorted(tensors):
        module, _, param = key.rpartition(".")
        if module in quantized or param in QUANTIZATION_PARAMS or param.endswith(_SCALE_SUFFIXES):
            continue
        name, pattern = rename(key)
        if pattern is None and name not in state:
            outside.append(key)
    return outside


def _embedding_like(
    model: nn.Module, tensors: Mapping[str, torch.Tensor], outside: Iterable[str]
) -> dict[str, tuple[str, type]]:
    """``{module: (module, nn.Embedding)}`` for the 2-D ``<module>.weight`` of ``outside`` (:func:`_outside_model`)
    that are an input embedding or an output head: ``<module>`` ends with ``embed_tokens``, ``lm_head`` or
    ``shared_head.head`` (DeepSeek-V3's multi-token-prediction layer; vLLM loads those as an embedding and a head), or
    the weight has the shape ``[vocab, hidden]`` of the model's input embedding or output head. Given to
    :func:`linear_tree` as their classes, they are no Linear: left dense, as the model's own embedding and (by
    default) ``lm_head``. Found by a tester: they were quantized by name."""
    shapes = set()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        with contextlib.suppress(AttributeError, NotImplementedError, TypeError):
            weight = getattr(getattr(model, get)(), "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                shapes.add(tuple(weight.shape))
    dense = {}
    for key in outside:
        module, _, param = key.rpartition(".")
        if param != "weight" or tensors[key].dim() != 2 or not module:
            continue
        named = any(module == n or module.endswith(f".{n}") for n in _HEAD_NAMES)
        if named or tuple(tensors[key].shape) in shapes:
            dense[module] = (module, nn.Embedding)
    return dense


def _warn_outside(model: nn.Module, outside: Sequence[str], targets: Collection[str], dense: Mapping[str, Any]) -> None:
    """One warning naming the checkpoint tensors outside the model built from ``config.json``
    (:func:`_outside_model`) and what is done with each: quantized by name (a 2-D ``<module>.weight`` the targets
    match: llm-compressor's rule where the model says nothing), kept dense as an embedding or output head
    (:func:`_embedding_like`), or copied as stored. Found by a tester: DeepSeek-V3's multi-token-prediction layer was
    quantized without a word, its ``embed_tokens`` and ``shared_head.head`` included."""
    quantized: list[str] = []
    kept: list[str] = []
    copied: list[str] = []
    for key in outside:
        module = key.rpartition(".")[0]
        group, name = (quantized, module) if module in targets else (kept, module) if module in dense else (copied, key)
        if name not in group:
            group.append(name)
    parts = [
        f"{what}: {compact_names(names)}"
        for what, names in (
            ("quantized by name as Linear weights", quantized),
            (
                "kept dense as an embedding or output head (named *embed_tokens, *lm_head or *shared_head.head, or "
                "shaped [vocab, hidden] as the model's embedding)",
                kept,
            ),
            ("copied as stored", copied),
        )
        if names
    ]
    logger.warning(
        "model_free_ptq: %d checkpoint tensors are not in the model config.json builds (%s; transformers' "
        "from_pretrained, and so oneshot, drops them; vLLM reads a DeepSeek-V3 / GLM-4.5 multi-token-prediction "
        "layer for speculative decoding): %s",
        len(outside),
        type(model).__name__,
        "; ".join(parts),
    )


def _check_some_linear(tree: nn.Module, shapes: Mapping[str, torch.Tensor]) -> None:
    """Refuse a checkpoint with no Linear weight at all (GPT-2's ``Conv1D`` weights only)."""
    if any(_is_linear(m) for m in tree.modules()):
        return
    others = [n for n, t in shapes.items() if n.endswith(".weight") and t.dim() == 2]
    msg = (
        "model_free_ptq: the checkpoint holds no Linear weight (a 2-D '<module>.weight' of an nn.Linear module); "
        f"its 2-D weights ({', '.join(others[:3]) or 'none'}{' ...' if len(others) > 3 else ''}) belong to other "
        "module classes (GPT-2's Conv1D stores its weight transposed): run llmc_fsm.oneshot on the directory"
    )
    raise ValueError(msg)


# --------------------------------------------------------------------------- arguments
def _flags(
    max_workers: Any, overwrite: Any, progress: Any, threads: Any, quantization_format: Any
) -> tuple[int, bool, bool, int | None]:
    """``max_workers``, ``overwrite``, ``progress`` and ``threads`` checked (numpy's ints and bools taken as
    Python's); ``overwrite``, ``progress``, ``threads`` and ``quantization_format`` by the validators of
    :class:`~llmc_fsm.oneshot_job.settings.OneshotSettings`' fields of those names, as ``oneshot`` checks them.
    Found by a tester: ``overwrite="no"`` replaced an existing output (a non-empty string is true), ``progress="no"``
    showed bars, ``max_workers="4"`` and ``0`` were taken.

    Raises:
        ValueError: one line naming the argument (and its flag), what it must be and the value given.
    """
    fields = attrs.fields_dict(OneshotSettings)
    checked = {}
    for name, value in (
        ("overwrite", overwrite),
        ("progress", progress),
        ("threads", threads),
        ("quantization_format", quantization_format),
    ):
        field = fields[name]
        value = field.converter(value) if field.converter is not None else value
        try:
            field.validator(None, field, value)
        except ValueError as err:
            msg = f"model_free_ptq: {err}"
            raise ValueError(msg) from None
        checked[name] = value
    workers = fields["threads"].converter(max_workers)  # np.int64(4) as 4, as oneshot takes numbers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        msg = f"model_free_ptq: max_workers must be a positive int, got {max_workers!r}"
        raise ValueError(msg)
    return workers, checked["overwrite"], checked["progress"], checked["threads"]


def _check_format(session: Session, quantization_format: str | None, scheme: Any) -> None:
    """Refuse, before any work, a ``quantization_format`` that a weight scheme of the session's modifiers cannot be
    saved in (:func:`~llmc_fsm.toolkit.packed.format_problem` for a Linear, the rule ``oneshot`` applies).
    ``scheme``: ``model_free_ptq``'s (a preset name is how the message names it; else the config's group names).

    Raises:
        ValueError: every such scheme named, with the formats its weights allow.
    """
    if quantization_format is None:
        return
    name = scheme if isinstance(scheme, str) else None if scheme is None else "the scheme"
    problems = [
        f"{name or group}: {problem}"
        for modifier in session.modifiers
        for group, scheme in (getattr(modifier, "quantization_schemes", None) or {}).items()
        if scheme.weights is not None
        and (problem := format_problem(nn.Linear, scheme, quantization_format)) is not None
    ]
    if problems:
        msg = (
            f"model_free_ptq: quantization_format (--quantization-format) {quantization_format!r} does not fit the "
            f"scheme: {'; '.join(problems)}; give a format its weights allow, or leave it out (each scheme's default)"
        )
        raise ValueError(msg)


#: The float dtypes ``dtype`` converts (not FP8 / FP4 values of quantized tensors).
_FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _dtype(dtype: Any) -> torch.dtype | None:
    """``dtype`` as a ``torch.dtype`` (``None`` stays ``None``)."""
    if dtype is None or dtype in _FLOATS.values():
        return dtype
    name = _dtype_name(str(dtype).removeprefix("torch."))  # oneshot's spellings too (bf16, fp16, half, ...)
    if name not in _FLOATS:
        msg = f"model_free_ptq: dtype {dtype!r}: give one of {', '.join(_FLOATS)} (or leave it out: as stored)"
        raise ValueError(msg)
    return _FLOATS[name]


def _device(device: Any) -> torch.device:
    """The one device the weights are rounded on."""
    if isinstance(device, list | tuple):
        if len(device) != 1:
            msg = (
                f"model_free_ptq: device={device!r}: several devices (llm-compressor's multi-GPU shard scheduling) "
                "are not supported; give one device"
            )
            raise ValueError(msg)
        device = device[0]
    try:
        run = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):
        msg = f"model_free_ptq: device {device!r} is not a torch device; give 'cpu' or 'cuda:N' (or leave it out)"
        raise ValueError(msg) from None
    if run.type == "cuda" and not torch.cuda.is_available():
        msg = f"model_free_ptq: device {str(run)!r}: torch sees no CUDA device; leave device out to run on the CPU"
        raise RuntimeError(msg)
    return run


def _plain_scheme(scheme: Any) -> Any:
    """A scheme or config object as the mapping a recipe holds."""
    dump = getattr(scheme, "model_dump", None)
    return dump(exclude_none=True, mode="json") if dump is not None else scheme


def _session(scheme: Any, config: Any, ignore: Iterable[str] | None, group_size: Any) -> Session:
    """The session of :func:`_recipe`; a scheme or config the modifier refuses is reported as ``model_free_ptq``'s
    argument (``--scheme`` on the command line), not as the one-stage recipe it became, which the caller never wrote.

    Raises:
        ValueError: as :func:`_recipe`; the modifier refuses the scheme or config (its reason, one line).
    """
    recipe = _recipe(scheme, config, ignore, group_size)
    try:
        return Session(recipe)
    except RecipeError as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        given = "config" if scheme is None else "scheme (--scheme)" if isinstance(scheme, str) else "scheme"
        msg = f"model_free_ptq: {given}: {cause}"
        raise ValueError(msg) from cause


def _own_terms(message: str, scheme: Any) -> str:
    """``message`` (the modifier's refusal) with its advice in ``model_free_ptq``'s terms: the group size to use given
    as ``--group-size N`` / ``group_size=N`` (a preset name) or in the scheme's weights, not as a recipe's entry;
    NVFP4's / MX's bfloat16 as ``model_free_ptq``'s ``dtype`` (``--dtype``), not as ``oneshot``'s nor a loaded
    model's (found by a tester: an fp16 checkpoint was told ``oneshot(MODEL_DIR, dtype='bfloat16')``)."""

    def advice(found: re.Match[str]) -> str:
        size = found.group(1)
        if isinstance(scheme, str):
            return f"(--group-size {size}; Python: model_free_ptq(..., group_size={size}))"
        return f"(group_size: {size} in the weights of the scheme or config given)"

    message = _RECIPE_GROUP_ADVICE.sub(advice, message)
    return _LOADED_DTYPE_ADVICE.sub(_DTYPE_ADVICE, message)


#: The quantizer's group-size advice in recipe terms (``(CLI: --group-size 64; recipe: scheme: {...})``).
_RECIPE_GROUP_ADVICE = re.compile(r"\(CLI: --group-size (\d+); recipe: [^()]*\)")
#: The quantizer's bfloat16 advice for NVFP4 / MX, in oneshot's and a loaded model's terms.
_LOADED_DTYPE_ADVICE = re.compile(
    r"load the model in bfloat16 \(CLI: --dtype bfloat16; .*?model\.to\(torch\.bfloat16\)\)"
)
_DTYPE_ADVICE = "load the model in bfloat16 (CLI: --dtype bfloat16; Python: model_free_ptq(..., dtype='bfloat16'))"


def _recipe(scheme: Any, config: Any, ignore: Iterable[str] | None, group_size: Any = None) -> dict[str, Any]:
    """The one-stage recipe ``model_free_ptq`` runs: one ``QuantizationModifier``.

    Raises:
        ValueError: both or neither of ``scheme`` / ``config``; a ``kv_cache_scheme``; ``group_size`` refused
            (:func:`_group_scheme`).
    """
    if (scheme is None) == (config is None):
        msg = "model_free_ptq: give exactly one of scheme and config"
        raise ValueError(msg)
    given = ignore is not None
    ignore = [ignore] if isinstance(ignore, str) else list(ignore or [])
    args: dict[str, Any]
    if group_size is not None:
        args = {"targets": ["Linear"], "scheme": _group_scheme(scheme, group_size)}
    elif isinstance(scheme, str):
        args = {"targets": ["Linear"], "scheme": scheme}
    elif scheme is not None:
        group = dict(_plain_scheme(scheme))
        group["targets"] = list(group.get("targets") or ["Linear"])
        args = {"config_groups": {"config_group_0": group}}
    else:
        plain = dict(_plain_scheme(config))
        if plain.get("kv_cache_scheme") is not None:
            msg = (
                "model_free_ptq: kv_cache_scheme needs the key and value activations of calibration data; "
                "run llmc_fsm.oneshot with a dataset"
            )
            raise ValueError(msg)
        given = given or plain.get("ignore") is not None
        ignore = [*(plain.get("ignore") or []), *ignore]
        groups = plain.get("config_groups") or {}
        args = {"config_groups": {k: {**v, "targets": list(v.get("targets") or ["Linear"])} for k, v in groups.items()}}
    if given:
        args["ignore"] = ignore
    return {"model_free_stage": {"quantization_modifiers": {"QuantizationModifier": args}}}


def _group_scheme(scheme: Any, group_size: Any) -> dict[str, Any]:
    """``scheme`` (a preset name) with its weight group size replaced by ``group_size``, as a recipe's ``scheme``
    holds it (``{preset: W4A16, weights: {group_size: 64}}``, as ``oneshot --group-size`` writes it).

    Raises:
        ValueError: ``group_size`` is not a positive int; ``scheme`` is not a preset name (a config, a scheme
            object: their weights give the group size); the preset's weights are not int groups (``FP8_DYNAMIC``
            per channel, ``NVFP4A16``'s groups of 16 and MX's of 32 fixed by the format), unless ``group_size`` is
            the preset's own (``--group-size 16`` with NVFP4A16 changes nothing, as oneshot takes it).
    """
    # compressed-tensors comes with the quantization plugin, not with llmc_fsm: imported where a scheme is built
    from compressed_tensors.quantization import QuantizationStrategy, QuantizationType
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES, is_preset_scheme, preset_name_to_scheme

    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        msg = f"model_free_ptq: group_size (--group-size) must be a positive int, got {group_size!r}"
        raise ValueError(msg)
    if not isinstance(scheme, str):
        msg = (
            "model_free_ptq: group_size (--group-size) replaces a preset's weight group size: give scheme as a "
            "preset name (e.g. 'W4A16'), or set group_size in the weights of the scheme or config given"
        )
        raise ValueError(msg)

    def int_groups(weights: Any) -> bool:
        return weights is not None and (weights.type, weights.strategy) == (
            QuantizationType.INT,
            QuantizationStrategy.GROUP,
        )

    weights = preset_name_to_scheme(scheme, ["Linear"]).weights if is_preset_scheme(scheme.upper()) else None
    if weights is not None and not int_groups(weights) and weights.group_size != group_size:  # the preset's own: kept
        kind, per = (getattr(v, "value", v) for v in (weights.type, weights.strategy))
        per += f" of {weights.group_size}" if weights.group_size else ""
        presets = sorted(name for name, fields in PRESET_SCHEMES.items() if int_groups(fields.get("weights")))
        msg = (
            f"model_free_ptq: group_size (--group-size) applies to presets whose int weights are quantized in groups "
            f"({', '.join(presets)}); {scheme} quantizes {kind} weights per {per}: leave group_size out"
        )
        raise ValueError(msg)
    return {"preset": scheme, "weights": {"group_size": group_size}}


def _ignore_checkpoint_names(
    session: Session,
    tree: nn.Module,
    classes: Mapping[str, tuple[str, type] | None],
    scheme: Any,
    config: Any,
    ignore: Iterable[str] | None,
    group_size: Any = None,
) -> Session:
    """The session again with the checkpoint's names added to ``ignore`` for every module that an entry of it (an
    exact name, the default ``lm_head`` too, or a ``re:`` pattern) matches by the model's name while the checkpoint
    names it otherwise (LLaVA's ``lm_head`` is ``language_model.lm_head`` in its checkpoint; transformers 5.25 saves
    Qwen2.5-VL's vision tower ``model.visual.blocks...`` as ``visual.blocks...``): an ``ignore`` written for
    ``oneshot`` (the model's names) keeps the same modules dense here; names as the checkpoint has them match as in
    llm-compressor's model_free_ptq. The user's entries stay in the list (``recipe.yaml`` means the same in
    ``oneshot``); an entry that matches only the model's names gets those names in ``tree`` as modules without
    weights, so that it is not reported as matching no module, and one INFO line names the checkpoint's spelling.
    An entry naming a container (``model.visual``) covers the modules in it, as in ``oneshot``.
    Until 2026-12-07 a ``re:`` pattern was not translated: ``re:model.visual.*`` was said to match no module and the
    vision tower was quantized (found by a tester)."""
    from compressed_tensors.utils.match import match_name

    aliases = {c: loaded[0] for c, loaded in sorted(classes.items()) if loaded is not None and loaded[0] != c}
    current = [name for m in session.modifiers for name in getattr(m, "ignore", None) or []]
    modules = dict(tree.named_modules())  # as the checkpoint spells them (the placeholders added below are not)
    extra: list[str] = []
    for entry in current:
        found = {c: hit for c, model_name in aliases.items() if (hit := _matched_at(model_name, entry)) is not None}
        extra += [c for c in found if c not in current and c not in extra and _matched_at(c, entry) is None]
        if not found or any(match_name(name, entry) for name in modules if name):
            continue
        for hit in found.values():  # the model's names, so that the entry matches a module of the tree
            _add_placeholder(tree, hit)
        linears = [c for c in found if _is_linear(modules.get(c))]
        if linears and (entry.startswith("re:") or ignore is not None):  # the default lm_head: said below
            logger.info(
                "model_free_ptq: ignore %r names modules by the model's names; the checkpoint names its Linears %s: "
                "kept dense, as oneshot keeps them",
                entry,
                compact_names(linears),
            )
    if not extra:
        return session
    if ignore is None:
        logger.warning(
            "model_free_ptq: no ignore given: lm_head is kept dense (the checkpoint names it %s; llm-compressor's "
            "default ignore is empty, which quantizes it too: give ignore=[], on the command line --ignore with no "
            "name, for that)",
            ", ".join(extra),
        )
    recipe = _recipe(scheme, config, ignore, group_size)
    recipe["model_free_stage"]["quantization_modifiers"]["QuantizationModifier"]["ignore"] = [*current, *extra]
    return Session(recipe)


def _matched_at(name: str, entry: str) -> str | None:
    """The first of the module name ``name`` and its containers (``a.b.c``, ``a.b``, ``a``) that the ignore entry
    ``entry`` (an exact name or ``re:`` pattern) matches, else ``None``: an ignored container keeps the modules in it
    dense, as :func:`~llmc_fsm.toolkit.targets.select_targets` ignores them."""
    from compressed_tensors.utils.match import match_name

    parts = name.split(".")
    return next((n for n in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if match_name(n, entry)), None)


def _add_placeholder(tree: nn.Module, name: str) -> bool:
    """Add ``name`` to ``tree`` as plain modules without parameters where it is not there, as :func:`linear_tree`
    adds every other module of the checkpoint; ``False`` (stopping there) at a part that ``nn.Module`` uses itself,
    such as ``type``."""
    parent = tree
    for part in name.split("."):
        if part not in parent._modules:
            if hasattr(parent, part):
                return False
            parent.add_module(part, nn.Module())
        parent = parent._modules[part]
    return True


def _tied_head_ignore(
    session: Session,
    tree: nn.Module,
    skeleton: nn.Module,
    classes: Mapping[str, tuple[str, type] | None],
    arguments: tuple[Any, Any, Any, Any],
) -> tuple[Session, Any, str | None]:
    """The session and ``ignore`` where the model's output head is tied to its input embedding and the checkpoint
    holds no weight of its own for it (``tie_word_embeddings``: Qwen3-0.6B): the head's name is added to ``tree`` as
    a module without weights, so that an ``ignore`` naming it (``lm_head``, ``re:.*lm_head``, as llm-compressor's
    ``examples/model_free_ptq/qwen3_fp8_block.py`` writes it) matches and gets one INFO line saying so instead of
    "matches no module"; with no ``ignore`` given, the default ``[lm_head]`` is given explicitly (the modifier's
    line on the default would say ``lm_head`` is kept dense and that llm-compressor quantizes it: there is none,
    llm-compressor quantizes the embedding) and one INFO line says what is true. Found by a tester.

    ``arguments``: ``model_free_ptq``'s ``(scheme, config, ignore, group_size)``; the ``ignore`` returned is
    ``ignore``, or ``[head]`` where the default was given explicitly; the third value is the embedding's checkpoint
    name where the line said llm-compressor quantizes it (else ``None``).
    """
    from compressed_tensors.utils.match import match_name

    scheme, config, ignore, group_size = arguments
    head = tied_head(skeleton)
    if head is None:
        return session, ignore, None
    modules = dict(skeleton.named_modules())
    head_name = next(name for name, module in modules.items() if module is head)
    if any(loaded is not None and loaded[0] == head_name for loaded in classes.values()):
        return session, ignore, None  # the checkpoint holds its weight too: in the tree as a module, as stored
    embedding = skeleton.get_input_embeddings()
    embedding_name = next(name for name, module in modules.items() if module is embedding)
    stored = next((c for c, loaded in classes.items() if loaded is not None and loaded[0] == embedding_name), None)
    stored = stored or embedding_name
    if not _add_placeholder(tree, head_name):  # a name nn.Module uses itself: no placeholder
        return session, ignore, None
    tied = (
        f"the output head {head_name} is tied to the input embedding {stored} and has no weight of its own in the "
        "checkpoint"
    )
    if ignore is None and (config is None or _plain_scheme(config).get("ignore") is None):
        logger.info(
            "model_free_ptq: no ignore given: nothing to keep dense: %s (the embedding is no Linear: left as stored; "
            "llm-compressor's empty default ignore quantizes %s)",
            tied,
            stored,
        )
        return _session(scheme, config, [head_name], group_size), [head_name], stored
    named = [i for m in session.modifiers for i in getattr(m, "ignore", None) or [] if match_name(head_name, i)]
    if named:
        logger.info("model_free_ptq: ignore %s: %s: nothing to keep dense", ", ".join(map(repr, named)), tied)
    return session, ignore, None


def _patterns(modifier: Any) -> tuple[list[str], list[str]]:
    """``(targets, ignore)`` of a quantization modifier: its config groups' targets (else its ``targets``), and its
    ``ignore``."""
    groups = getattr(modifier, "config_groups", None) or {}
    targets = [t for g in groups.values() for t in (g.get("targets") if isinstance(g, dict) else g.targets) or []]
    if not groups:
        targets = [t for t in getattr(modifier, "targets", None) or [] if isinstance(t, str)]
    return targets, list(getattr(modifier, "ignore", None) or [])


def _note_other_weights(
    session: Session,
    tensors: Mapping[str, torch.Tensor],
    classes: Mapping[str, tuple[str, type] | None],
    told: str | None = None,
) -> None:
    """One INFO line naming the 2-D ``<module>.weight`` tensors left as stored because the architecture builds their
    modules as another class than ``nn.Linear`` (a MoE router such as Qwen3-MoE's ``mlp.gate``, an embedding), where
    the targets match them and ``ignore`` does not: llm-compressor 0.14's ``model_free_ptq`` takes every such weight
    for a Linear's and quantizes it, while transformers does not reload them quantized and vLLM keeps routers dense.
    ``told``: a module not named again (the tied head's embedding, which :func:`_tied_head_ignore` named). Found by a
    tester: a router written FP8 block by llm-compressor was left bfloat16 here without a word."""
    from compressed_tensors.utils.match import match_name

    quantized = already_quantized(tensors)
    by_class: dict[str, list[str]] = {}
    for name, tensor in tensors.items():
        module, _, param = name.rpartition(".")
        loaded = classes.get(module)
        if (
            param != "weight"
            or tensor.dim() != 2
            or module.endswith("norm")
            or module in quantized
            or module == told
            or loaded is None
            or issubclass(loaded[1], nn.Linear)
        ):
            continue
        for modifier in session.modifiers:
            targets, ignore = _patterns(modifier)
            if any(_matched_at(module, i) is not None or _matched_at(loaded[0], i) is not None for i in ignore):
                continue
            if "Linear" in targets or any(match_name(module, t) for t in targets):
                by_class.setdefault(loaded[1].__name__, []).append(module)
                break
    if by_class:
        names = "; ".join(f"{compact_names(sorted(n))} ({cls})" for cls, n in sorted(by_class.items()))
        logger.info(
            "model_free_ptq: 2-D weights of modules that are not nn.Linear are left as stored: %s; llm-compressor's "
            "model_free_ptq quantizes every 2-D weight its ignore does not name, but transformers does not reload "
            "these classes quantized, and vLLM keeps embeddings and MoE routers dense",
            names,
        )


def _check_left_to_quantize(session: Session, tree: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse a checkpoint quantized already whose every Linear weight left is ignored: nothing to do (the
    modifier's own error would only say that ignore excludes every target)."""
    from compressed_tensors.utils.match import match_name

    quantized = already_quantized(tensors)
    if not quantized:
        return
    ignore = [name for m in session.modifiers for name in getattr(m, "ignore", None) or []]
    left = [n for n, m in tree.named_modules() if _is_linear(m) and not any(match_name(n, i) for i in ignore)]
    if not left:
        msg = (
            f"model_free_ptq: the checkpoint is quantized already ({compact_names(sorted(quantized))} hold "
            "quantization parameters beside their weights) and no other Linear weight is left to quantize; start "
            "from the unquantized checkpoint, or give a converter that dequantizes it (compressed_tensors."
            "entrypoints.convert: CompressedTensorsDequantizer, FP8BlockDequantizer)"
        )
        raise ValueError(msg)


def _calibrated_parts(modifier: Any) -> tuple[list[str], list[str]]:
    """What of ``modifier``'s schemes needs calibration inputs, and what to use instead (each a list of phrases)."""
    needs: list[str] = []
    instead: list[str] = []
    for scheme in (getattr(modifier, "quantization_schemes", None) or {}).values():
        inputs, weights = scheme.input_activations, scheme.weights
        dynamic = None if inputs is None else str(getattr(inputs.dynamic, "value", inputs.dynamic)).lower()
        if dynamic == "local":  # NVFP4: per-group scales at run time, under a per-module global scale
            needs.append(
                "the per-module input_global_scale of NVFP4's activations (their group scales are dynamic, the "
                "global scale above them is calibrated from each Linear's inputs)"
            )
            instead.append("NVFP4A16 (NVFP4 weights, activations not quantized)")
        elif dynamic == "false":
            needs.append("static input-activation scales")
            instead.append("a scheme with dynamic activations (FP8_DYNAMIC, W8A8)")
        if weights is not None and weights.observer == "imatrix_mse":
            needs.append("the imatrix_mse observer (it weighs each weight's error by its input's mean square)")
            instead.append("another observer (minmax, mse)")
    return list(dict.fromkeys(needs)), list(dict.fromkeys(instead))


def _check_data_free(session: Session) -> None:
    """Refuse a recipe whose modifier needs calibration data (static input scales, NVFP4's input global scale,
    ``imatrix_mse``), naming what needs it."""
    for label, modifier in zip(session.labels, session.modifiers, strict=True):
        if "calibration_data" in modifier.required_keys():
            needs, instead = _calibrated_parts(modifier)
            what = " and ".join(needs) if needs else "this scheme"
            use = f"use {' or '.join(instead)}, or" if instead else "use a scheme with dynamic activations, or"
            msg = (
                f"model_free_ptq runs no calibration: {label} needs calibration data for {what}; {use} run "
                "llmc_fsm.oneshot with a dataset"
            )
            raise ValueError(msg)


# --------------------------------------------------------------------------- the checkpoint
def _checkpoint_files(model_stub: Any) -> dict[str, str]:
    """``{relative file name: local path}`` of the checkpoint's files (a directory, a known model, a Hub id)."""
    stub = str(model_stub)
    if stub in KNOWN_MODELS:
        directory = known_model_dir(stub)
    elif Path(stub).expanduser().exists():
        directory = Path(stub).expanduser().resolve()
    else:
        from compressed_tensors.utils.safetensors_load import get_checkpoint_files

        try:
            return dict(get_checkpoint_files(stub))
        except Exception as err:
            msg = (
                f"model_free_ptq: {stub!r} is not a directory here, a known model ({', '.join(KNOWN_MODELS)}) or a "
                f"Hugging Face Hub id that could be read ({first_line(err)})"
            )
            raise FileNotFoundError(msg) from None
    if not directory.is_dir():
        msg = f"model_free_ptq: {str(directory)!r} is not a directory of a safetensors checkpoint"
        raise FileNotFoundError(msg)
    return {
        str(p.relative_to(directory)): str(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    }


def _existing_config(files: Mapping[str, str], converter: Any) -> Any:
    """The checkpoint's own ``quantization_config`` as a compressed-tensors ``QuantizationConfig`` (``None``:
    none, or another tool's that ``converter`` reads); ours is merged into it.

    Raises:
        ValueError: a quantization config of another method (``fp8``, ``modelopt``, ...) and no converter.
    """
    from compressed_tensors.quantization import QuantizationConfig

    if "config.json" not in files:
        return None
    with open(files["config.json"], encoding="utf-8") as f:
        existing = json.load(f).get("quantization_config")
    if existing is None:
        return None
    method = existing.get("quant_method") if isinstance(existing, dict) else None
    if method == "compressed-tensors":
        plain = {k: v for k, v in existing.items() if k not in ("quant_method", "version", "transform_config")}
        return QuantizationConfig.model_validate(plain)
    if converter is None:
        msg = (
            f"model_free_ptq: the checkpoint is quantized already (its config.json has a quantization_config, "
            f"quant_method {method!r}); give a converter that reads that format "
            "(compressed_tensors.entrypoints.convert: FP8BlockDequantizer, ModelOptNvfp4Converter, ...), or start "
            "from the unquantized checkpoint"
        )
        raise ValueError(msg)
    return None


def _weight_map(files: Mapping[str, str]) -> dict[str, str]:
    """``{tensor name: shard file name}`` from the index, or from the one safetensors file."""
    from safetensors import safe_open

    if _INDEX in files:
        weight_map = safetensors_index(Path(files[_INDEX]))
        missing = sorted({s for s in weight_map.values() if s not in files})
        if missing:
            msg = f"model_free_ptq: {_INDEX} names shards that are not in the checkpoint: {', '.join(missing)}"
            raise FileNotFoundError(msg)
        for shard in sorted(set(weight_map.values())):
            _check_shard(shard, files[shard], indexed=True)
        _check_index(weight_map, files)
        return weight_map
    shards = [name for name in files if name.endswith(".safetensors") and "/" not in name]
    if len(shards) != 1:
        found = ", ".join(shards) if shards else "none"
        pickles = [name for name in files if "/" not in name and _pytorch_weights(files[name])]
        hint = f"; {', '.join(pickles)}: {_PYTORCH_ADVICE}" if not shards and pickles else ""
        msg = (
            f"model_free_ptq: the checkpoint needs {_INDEX} or exactly one .safetensors file at its top level "
            f"(found: {found}){hint}"
        )
        raise FileNotFoundError(msg)
    _check_shard(shards[0], files[shards[0]], indexed=False)
    with safe_open(files[shards[0]], framework="pt") as f:
        return dict.fromkeys(f.keys(), shards[0])


#: A shard's name as ``save_pretrained`` writes it (``model-00002-of-00007.safetensors``): prefix and count.
_SHARD_NAME = re.compile(r"(.*)-\d+-of-(\d+)\.safetensors")


def _check_index(weight_map: Mapping[str, str], files: Mapping[str, str]) -> None:
    """Refuse, before any work, an index whose ``weight_map`` and shards disagree (each shard's header read): a
    tensor the index puts in a shard that does not hold it (in another, or in none), or a tensor of a shard the index
    does not name (a shard of the same series, ``model-00007-of-00007.safetensors``, included where the index names
    none of its tensors). Found by a tester: the first two failed in compressed-tensors' own words after the checks, the
    third was reported as a tensor missing from the checkpoint.

    Raises:
        ValueError: one line naming the first three disagreements (tensor and files) and how many there are.
    """
    from safetensors import safe_open

    named = set(weight_map.values())
    series = {m.group(1, 2) for s in named if (m := _SHARD_NAME.fullmatch(s)) is not None}
    siblings = {f for f in files if (m := _SHARD_NAME.fullmatch(f)) is not None and m.group(1, 2) in series}
    held: dict[str, list[str]] = {}
    for shard in sorted(named | siblings):
        with safe_open(files[shard], framework="pt") as f:
            for key in f.keys():
                held.setdefault(key, []).append(shard)
    problems = []
    for name, shard in weight_map.items():
        where = held.get(name, [])
        if shard not in where:
            found = f"it is in {', '.join(where)}" if where else "no shard holds it"
            problems.append(f"{_INDEX} puts {name} in {shard}, {found}")
    unnamed = [(name, shards[0]) for name, shards in held.items() if name not in weight_map]
    problems += [f"{shard} holds {name}, which {_INDEX} does not name" for name, shard in unnamed]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        msg = (
            f"model_free_ptq: {_INDEX} and the shards disagree: {'; '.join(problems[:3])}{more}; nothing was "
            f"written: fix the index's weight_map, or copy the checkpoint again"
        )
        raise ValueError(msg)


#: What to do with weights saved by ``torch.save`` (:func:`_pytorch_weights`).
_PYTORCH_ADVICE = (
    "PyTorch weights (torch.save's zip / pickle), not safetensors: model-free reads only safetensors files; save "
    "the model as safetensors first (transformers: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR) "
    "writes safetensors) and run model-free on NEW_DIR"
)


def _pytorch_weights(path: str) -> bool:
    """Whether the file at ``path`` begins as ``torch.save`` writes (a zip archive since torch 1.6, a pickle of
    protocol 2 to 5 before): ``pytorch_model.bin`` and its shards."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head == b"PK\x03\x04" or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def _check_shard(name: str, path: str, *, indexed: bool) -> None:
    """Fail with one line when the weights file ``name`` (at ``path``; ``indexed``: named in the index) cannot be
    read as safetensors: a PyTorch weights file (a ``.bin`` shard named in the index beside safetensors ones) says so
    and how to convert it (it was reported as a truncated safetensors file; found by a tester), anything else as
    :func:`~llmc_fsm.models.hf_io.check_safetensors` reports it.

    Raises:
        ValueError: not a readable safetensors file.
    """
    try:
        check_safetensors(Path(path))
    except ValueError:
        if not _pytorch_weights(path):
            raise
        where = f" (named in {_INDEX})" if indexed else ""
        msg = f"model_free_ptq: {name}{where} holds {_PYTORCH_ADVICE}"
        raise ValueError(msg) from None


class _ParentSiblings:
    """Dependencies for compressed-tensors' ``build_inverse_weight_maps``: the first ``.weight`` of a parent module
    (in name order) needs the others, so that a parent's Linear weights are read (and written) together; a
    ``.weight`` needs its module's ``.bias`` (a shard may end between them)."""

    def __init__(self, weight_map: Mapping[str, str]) -> None:
        by_parent: dict[str, list[str]] = {}
        for name in sorted(weight_map):
            module, _, param = name.rpartition(".")
            if param == "weight" and "." in module:
                by_parent.setdefault(module.rpartition(".")[0], []).append(name)
        self._deps = {names[0]: set(names[1:]) for names in by_parent.values() if len(names) > 1}
        self._bias = {
            f"{m}.weight": f"{m}.bias" for m in (n.rpartition(".")[0] for n in weight_map if n.endswith(".bias"))
        }

    def get_dependencies(self, weight_name: str) -> set[str]:
        deps = set(self._deps.get(weight_name, ()))
        if weight_name in self._bias:
            deps.add(self._bias[weight_name])
        return deps


def _jobs(
    weight_map: Mapping[str, str], files: Mapping[str, str], converters: list[Any]
) -> dict[str, dict[str, list[str]]]:
    """``{output shard name: {source file path: tensor names}}``: each tensor in exactly one job (compressed-tensors'
    ``build_inverse_weight_maps`` with the converters' dependencies, and a parent module's weights together: NVFP4
    siblings share a global scale), shards in name order."""
    from compressed_tensors.entrypoints.convert.converters import build_inverse_weight_maps

    try:
        maps = build_inverse_weight_maps(dict(weight_map), dict(files), [*converters, _ParentSiblings(weight_map)])
    except ValueError as err:
        msg = f"model_free_ptq: {err}"
        raise ValueError(msg) from None
    return {shard: maps[shard] for shard in sorted(maps)}


def _converted(
    job: Mapping[str, list[str]],
    converters: list[Any],
    dtype: torch.dtype | None,
    *,
    meta: bool,
    kept: Collection[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """The job's tensors (on ``meta`` or read to the CPU), through the converters, float ones in ``dtype`` (not
    those named in ``kept``)."""
    from compressed_tensors.utils.safetensors_load import load_tensors_from_inverse_weight_map

    tensors = load_tensors_from_inverse_weight_map(dict(job), torch.device("meta" if meta else "cpu"))
    for converter in converters:
        tensors = converter.validate(tensors) if meta else converter.process(tensors)
    return _cast(tensors, dtype, kept)


def _cast(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype | None, kept: Collection[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """``tensors`` with their float ones in ``dtype`` (``None``: as they are), not those of modules quantized
    already (:func:`already_quantized`: their weights and scales stay as stored) nor those named in ``kept`` (the
    model's keep-in-float32 tensors, :func:`_kept_in_float32`)."""
    if dtype is not None:
        quantized = already_quantized(tensors)
        for name, tensor in tensors.items():
            if (
                tensor.dtype in _FLOATS.values()
                and tensor.dtype != dtype
                and name.rpartition(".")[0] not in quantized
                and name not in kept
            ):
                tensors[name] = tensor.to(dtype)
    return tensors


def _meta_model(files: Mapping[str, str]) -> nn.Module | None:
    """The model ``config.json`` describes, built on ``meta`` (``None``: transformers cannot build it; the tensor
    names alone decide then, as in llm-compressor). Its module classes say which weights are Linear; the save probes
    its weight initialisation (classes that read ``weight`` are not packed, as in ``oneshot``)."""
    if "config.json" not in files:
        logger.warning(
            "model_free_ptq: the checkpoint has no config.json: every 2-D '<module>.weight' outside *norm modules is "
            "taken for a Linear weight (llm-compressor's rule); ignore embeddings and other 2-D weights that are not "
            "Linear"
        )
        return None
    from transformers import AutoConfig

    try:
        model = meta_model(AutoConfig.from_pretrained(str(Path(files["config.json"]).parent), trust_remote_code=False))
    except Exception as err:  # an architecture transformers does not know, or a config it cannot build
        logger.warning(
            "model_free_ptq: transformers cannot build this model (%s): every 2-D '<module>.weight' outside *norm "
            "modules is taken for a Linear weight (llm-compressor's rule); ignore embeddings and other 2-D weights "
            "that are not Linear",
            first_line(err),
        )
        return None
    return model


def checkpoint_classes(model: nn.Module, tensors: Iterable[str]) -> dict[str, tuple[str, type] | None]:
    """``{checkpoint module name: (name, class) of the module of model it loads into}`` for each ``<module>.weight``
    of ``tensors`` that ``model`` (built from the checkpoint's config) reads, renamed as ``from_pretrained`` renames
    it (transformers' ``rename_source_key`` with the model's ``get_model_conversion_mapping``: Mixtral's
    ``block_sparse_moe.gate`` is the router ``mlp.gate``); ``None`` for one a conversion collects into a fused
    tensor (an expert matrix of fused experts: a Linear weight, as ``oneshot`` quantizes it per expert). An output
    head tied to the input embedding counts as an ``nn.Embedding`` (a checkpoint may hold its weight too; the model
    reloads the embedding's there, and ``oneshot`` leaves a tied head alone)."""
    rename = checkpoint_key_renamer(model)
    state = model.state_dict(keep_vars=True)
    modules = dict(model.named_modules())
    classes: dict[str, tuple[str, type] | None] = {}
    for key in tensors:
        module, _, param = key.rpartition(".")
        if param != "weight":
            continue
        name, pattern = rename(key)
        if pattern is not None:
            classes[module] = None
        elif name in state and name.rpartition(".")[0] in modules:
            loaded = name.rpartition(".")[0]
            classes[module] = (loaded, type(modules[loaded]))
    head = tied_head(model)  # tied to the input embedding: transformers reloads the embedding there, not a Linear
    if head is not None:
        head_name = next(n for n, m in modules.items() if m is head)
        for module, loaded in classes.items():
            if loaded is not None and loaded[0] == head_name:
                classes[module] = (head_name, nn.Embedding)
    return classes


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


#: Tensor names (the part after the module's name) of quantization parameters: a module with one of them in the
#: checkpoint is quantized already (compressed-tensors' names, DeepSeek's block-FP8 ``weight_scale_inv``, ModelOpt's
#: ``weight_scale_2``).
QUANTIZATION_PARAMS = frozenset(
    {
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_global_scale",
        "weight_g_idx",
        "weight_shape",
        "weight_scale_inv",
        "weight_scale_2",
        "input_scale",
        "input_global_scale",
    }
)


def already_quantized(tensors: Iterable[str]) -> set[str]:
    """The module names of ``tensors`` (checkpoint names) that hold a quantization parameter
    (:data:`QUANTIZATION_PARAMS`): quantized already, left as stored."""
    return {name.rpartition(".")[0] for name in tensors if name.rpartition(".")[2] in QUANTIZATION_PARAMS}


class CheckpointLinears(nn.Module):
    """The root of :func:`linear_tree`: the checkpoint's Linear weights as modules, nothing else (no forward)."""


def linear_tree(
    tensors: Mapping[str, torch.Tensor], classes: Mapping[str, tuple[str, type] | None] | None = None
) -> nn.Module:
    """A ``meta``-device model with one ``nn.Linear`` per Linear weight of ``tensors``, named as the checkpoint
    names it (``model.layers.0.self_attn.q_proj``), and every other module of the checkpoint (``embed_tokens``, a
    norm, the containers on the way) as a plain module without parameters (an ``ignore`` naming it matches it).

    A Linear weight is ``<module>.weight`` with two dimensions, ``<module>`` not ending in ``norm``, not quantized
    already (:func:`already_quantized`: an FP8 checkpoint's ``weight`` beside its ``weight_scale``) and, where
    ``classes`` (:func:`checkpoint_classes`) gives its class, of class ``nn.Linear`` (a subclass too).
    ``<module>.bias`` (one dimension) becomes its bias. Shapes and dtypes are the tensors'; no memory is used.

    Args:
        tensors: ``{checkpoint name: tensor}`` (any device; only shapes and dtypes are read).
        classes: ``{checkpoint module name: class}`` (:func:`checkpoint_classes`; ``None``, or a name it lacks or
            maps to ``None``: names and shapes alone decide).
    """
    from transformers.core_model_loading import dot_natural_key  # from_pretrained's order of checkpoint names

    root = CheckpointLinears()
    linears = {}
    quantized = already_quantized(tensors)
    # the modules in the checkpoint names' natural order (layers.2 before layers.10), whatever order the shards' jobs
    # gave: config.json's ignore list (in module order) followed the hash seed (found by a tester)
    tensors = {name: tensors[name] for name in sorted(tensors, key=dot_natural_key)}
    for name, tensor in tensors.items():
        module, _, param = name.rpartition(".")
        if param != "weight" or tensor.dim() != 2 or not module or module.endswith("norm") or module in quantized:
            continue
        loaded = classes.get(module) if classes is not None else None
        if loaded is not None and not issubclass(loaded[1], nn.Linear):
            continue
        linears[module] = tensor
    for name in tensors:  # every other module of the checkpoint as a plain module, so that ignore names match
        parent = root
        for part in name.rpartition(".")[0].split(".") if "." in name else []:
            if part not in parent._modules:
                if hasattr(parent, part):  # a name nn.Module uses itself ("type", "forward"): no placeholder
                    break
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
    for module in sorted(linears, key=lambda n: n.count(".")):
        weight = linears[module]
        bias = tensors.get(f"{module}.bias")
        has_bias = bias is not None and bias.dim() == 1 and bias.shape[0] == weight.shape[0]
        linear = nn.Linear(
            weight.shape[1], weight.shape[0], bias=has_bias, device="meta", dtype=weight.dtype
        ).requires_grad_(False)
        parent_name, _, leaf = module.rpartition(".")
        parent = root
        for part in parent_name.split(".") if parent_name else []:
            child = parent._modules.get(part)
            if child is None:
                child = nn.Module()
                parent.add_module(part, child)
            parent = child
        existing = parent._modules.get(leaf)
        if existing is not None:  # a container created for a deeper name first: keep its children
            for child_name, child in existing.named_children():
                linear.add_module(child_name, child)
        parent.add_module(leaf, linear)
    return root


def _check_fused_experts(tensors: Mapping[str, torch.Tensor], session: Session, skeleton: nn.Module | None) -> None:
    """Refuse three-dimensional tensors (fused experts) that the recipe's targets match and its ignore does not; and
    fused experts left dense where transformers reloads a compressed-tensors checkpoint's experts as one Linear per
    expert matrix (Llama 4, :func:`~llmc_fsm.toolkit.reloads_as_linears`: found by a tester, the output did not
    load, ``NotImplementedError: "normal_kernel_cpu" not implemented for 'Float8_e4m3fn'``)."""
    from compressed_tensors.utils.match import match_name

    as_linears = sorted(
        {name.rpartition(".")[0] for name, tensor in tensors.items() if tensor.dim() == 3}
        & ({n for n, m in skeleton.named_modules() if reloads_as_linears(m)} if skeleton else set())
    )
    if as_linears:
        family = model_family(skeleton)
        msg = (
            f"model_free_ptq: {family} keeps its experts fused ({compact_names(as_linears)}), and transformers "
            "replaces them by one Linear per expert matrix when it loads a compressed-tensors checkpoint, so a "
            "checkpoint with them fused (dense or not) would not reload; run llmc_fsm.oneshot on the directory (it "
            "writes them per expert, quantized)"
        )
        raise ValueError(msg)
    fused = []
    for modifier in session.modifiers:
        targets, ignore = _patterns(modifier)
        for name, tensor in tensors.items():
            module, _, param = name.rpartition(".")
            if (
                tensor.dim() != 3
                or param == "weight"  # a convolution's: not a Linear weight, left as stored
                or module.rpartition(".")[2] != "experts"  # another 3-D parameter (a vision head's probe): as stored
                or any(match_name(module, i) or match_name(name, i) for i in ignore)
            ):
                continue
            if "Linear" in targets or any(match_name(module, t) or match_name(name, t) for t in targets):
                fused.append(f"{name} {list(tensor.shape)}")
    if fused:
        msg = (
            f"model_free_ptq quantizes 2-D Linear weights; these targeted tensors are fused experts of three "
            f"dimensions: {compact_names(fused)}; add their modules to ignore, or run llmc_fsm.oneshot on the "
            "directory, which quantizes the fused experts of the families docs/architectures.md lists per expert "
            "(not GPT-OSS's nor DBRX's)"
        )
        raise ValueError(msg)


def _one_block(scheme: Any, shape: Sequence[int]) -> bool:
    """Whether ``scheme``'s block weights give a matrix of ``shape`` (``[out, in]``) a ``weight_scale`` that
    broadcasts against it (one block, or one per value, along each dimension): transformers' experts loader
    multiplies an expert's fp8 weight by its scale by broadcasting, so it reloads such a matrix, quantized as per
    tensor."""
    w = scheme.weights
    if w is None or str(getattr(w.strategy, "value", w.strategy)) != "block" or not w.block_structure:
        return False
    return all(math.ceil(int(d) / int(b)) in (1, int(d)) for d, b in zip(shape, w.block_structure, strict=True))


def _warn_expert_reload(session: Session, experts: list[str]) -> None:
    """One warning line when expert matrices of the architecture's fused experts (per-expert checkpoint weights
    that transformers collects into one fused parameter) get a scheme transformers would not reload into it
    (:func:`~llmc_fsm.toolkit.packed.expert_reload_problem`): the checkpoint is then for vLLM, which reads experts
    per expert. ``oneshot`` writes NVFP4 and FP8 block experts the same way, with the same warning
    (:func:`~llmc_fsm.toolkit.packed.experts_for_vllm`), and refuses the other schemes."""
    from transformers import __version__ as transformers_version

    problems: dict[str, list[str]] = {}
    for modifier in session.modifiers:
        scheme_of = getattr(modifier, "scheme_of", None)
        for name in experts:
            if scheme_of is not None and name in modifier.resolved_targets:
                scheme = scheme_of(name)
                problem = expert_reload_problem(scheme)
                if problem is not None and _one_block(scheme, modifier.resolved_targets[name].weight.shape):
                    weights = scheme.weights.model_copy(update={"strategy": "tensor", "block_structure": None})
                    problem = expert_reload_problem(scheme.model_copy(update={"weights": weights}))
                if problem is not None:
                    problems.setdefault(problem, []).append(name)
    for problem, names in problems.items():
        logger.warning(
            "model_free_ptq: %d expert matrices of fused experts (e.g. %s) are quantized per expert, as vLLM reads "
            "them; transformers %s will not reload this checkpoint into its fused experts: %s",
            len(names),
            names[0],
            transformers_version,
            problem,
        )


def _claim(save_directory: Any, model_stub: Any, overwrite: bool) -> WorkDir:
    """The output directory checked (not the source) and its work directory claimed."""
    path = check_output_dir(save_directory, overwrite)
    if path is None:
        msg = "model_free_ptq: save_directory is required"
        raise ValueError(msg)
    check_output_not_source(path, str(model_stub))
    if recover_previous(path):
        path = check_output_dir(save_directory, overwrite)
    return WorkDir.claim(path)


# --------------------------------------------------------------------------- the work
def _swap(target: torch.Tensor, value: torch.Tensor) -> None:
    """Give the parameter ``target`` ``value``'s data, keeping the Python object (the modifier holds the module)."""
    torch.utils.swap_tensors(target, nn.Parameter(value, requires_grad=False))


def _quantize_shards(plan: _Plan, staging: Path, *, progress: bool) -> tuple[dict[str, str], int]:
    """Read, quantize and write each job's shard; ``{tensor name: shard}`` of what was written and its bytes.

    Without a converter a shard is read one parent module's Linear weights at a time (the rest last), so the
    memory held is the shard's output (its quantized weights, smaller, and the tensors copied as they are) and one
    parent's full-precision weights, not the whole shard as read; a converter gets the whole shard at once."""
    from safetensors.torch import save_file

    staging.mkdir(parents=True, exist_ok=True)
    modules = dict(plan.tree.named_modules())
    written: dict[str, str] = {}
    total = 0
    plan.session.calibration_start()
    bar = tqdm(plan.jobs.items(), total=len(plan.jobs), desc="quantizing shards", unit="shard", disable=not progress)
    for shard, job in bar:
        out: dict[str, torch.Tensor] = {}
        for tensors in _units(job, plan, modules):
            out.update(_quantize_unit(tensors, plan, modules))
        path = staging / shard
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(out, str(path), metadata={"format": "pt"})
        written.update(dict.fromkeys(out, shard))
        total += sum(t.numel() * t.element_size() for t in out.values())
        del out
    plan.session.calibration_end()
    return written, total


def _units(
    job: Mapping[str, list[str]], plan: _Plan, modules: Mapping[str, nn.Module]
) -> Iterator[dict[str, torch.Tensor]]:
    """The job's tensors in the pieces :func:`_quantize_shards` reads them in (on the CPU, in ``plan.dtype``)."""
    from safetensors import safe_open

    if plan.converters:
        yield _converted(job, plan.converters, plan.dtype, meta=False, kept=plan.kept)
        return
    where = {name: file for file, names in job.items() for name in names}
    parents: dict[str, list[str]] = {}
    rest: list[str] = []
    for name in where:
        module_name, _, param = name.rpartition(".")
        if _is_linear(modules.get(module_name)) and param in ("weight", "bias"):
            parents.setdefault(module_name.rpartition(".")[0], []).append(name)
        else:
            rest.append(name)
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(file, framework="pt")) for file in job}
        for names in [*parents.values(), rest]:
            if names:
                yield _cast({name: handles[where[name]].get_tensor(name) for name in names}, plan.dtype, plan.kept)


def _quantize_unit(
    tensors: dict[str, torch.Tensor], plan: _Plan, modules: Mapping[str, nn.Module]
) -> dict[str, torch.Tensor]:
    """Swap the Linear weights of ``tensors`` into the tree, have the session's modifier quantize them
    (``sequential_epoch_end``), and return ``tensors`` with each quantized module's weight replaced by its
    compressed tensors; the modules go back to ``meta``."""
    here = {}
    for name in list(tensors):
        module_name, _, param = name.rpartition(".")
        module = modules.get(module_name)
        if _is_linear(module) and param in ("weight", "bias") and getattr(module, param, None) is not None:
            _swap(getattr(module, param), tensors[name].to(plan.device))
            here[module_name] = module
    if here:
        plan.session.sequential_epoch_end(list(here.values()))
    out = dict(tensors)
    for module_name, module in here.items():
        if module_name not in plan.targets:
            continue
        for key in (f"{module_name}.weight", f"{module_name}.bias"):
            out.pop(key, None)
        packed = compressed_state_dict(
            module, f"{module_name}.", quantization_format=plan.quantization_format, root=plan.skeleton
        )
        out.update({key: value.detach().to("cpu").contiguous() for key, value in packed.items()})
    for module in here.values():  # back to meta: the next piece's memory only
        for param in list(module._parameters.values()):
            if param is not None:
                _swap(param, torch.empty_like(param, device="meta"))
    return out


def _write_metadata(
    staging: Path,
    files: Mapping[str, str],
    tree: nn.Module,
    written: Mapping[str, str],
    size: int,
    session: Session,
    root: nn.Module | None,
    read: Collection[str] = frozenset(),
) -> None:
    """Copy the checkpoint's other files (not weights of other formats, nor safetensors files other than ``read``,
    the shards read, nor a ``params.json`` beside Mistral's ``consolidated*`` weights left out: Mistral's loaders,
    vLLM's ``--config-format mistral --load-format mistral``, read it and then look for those weights); write the
    index (``total_size``: ``size``, the bytes of the tensors, as Hugging Face's), ``quantization_config`` and
    ``recipe.yaml``. One warning names each kind of weights file left out (and the ``params.json`` left out with
    them). Found by a tester: ``consolidated.safetensors`` was left out silently, its ``params.json`` copied."""
    unread = [name for name in files if name.endswith(".safetensors") and name not in read]
    skipped = [name for name in files if name.endswith(_OTHER_WEIGHTS)]
    mistral = {str(Path(name).parent / "params.json") for name in [*unread, *skipped]}
    mistral = {name for name in mistral if name in files and _consolidated_beside(name, [*unread, *skipped])}
    for name, path in files.items():
        if name.endswith((".safetensors", *_OTHER_WEIGHTS)) or name in (_INDEX, CACHE_MARKER, *mistral):
            continue  # CACHE_MARKER: llmc-fsm's cache's
        target = staging / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    params = (
        f"; {', '.join(sorted(mistral))} (Mistral's config of its consolidated weights) is not copied either: the "
        "output is in the Hugging Face format alone (config.json and the shards)"
        if mistral
        else ""
    )
    if skipped:
        logger.warning(
            "model_free_ptq: weights in other formats are not copied to the output (the safetensors ones are what "
            "was quantized): %s%s",
            ", ".join(skipped),
            "" if unread else params,
        )
    if unread:
        logger.warning(
            "model_free_ptq: safetensors files beside the checkpoint read (%s) are neither quantized nor copied to the "
            "output: %s%s",
            f"{_INDEX} and the shards it names" if _INDEX in files else ", ".join(sorted(read)),
            ", ".join(unread),
            params,
        )
    shards = sorted(set(written.values()))
    if _INDEX in files or len(shards) > 1:
        index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(written.items()))}
        (staging / _INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config_path = staging / "config.json"
    if config_path.exists():
        data = json.loads(config_path.read_text(encoding="utf-8"))
        data.pop("quantization_config", None)  # the checkpoint's own: merged back by _merge_config
        config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        write_quantization_config(tree, staging, sparsity=None)
    else:
        logger.warning("model_free_ptq: the checkpoint has no config.json: no quantization_config written")
    warn_formats(tree, root=root)
    (staging / "recipe.yaml").write_text(session.recipe.to_yaml(applied=True), encoding="utf-8")


def _consolidated_beside(params: str, left_out: Sequence[str]) -> bool:
    """Whether one of ``left_out`` (checkpoint file names) is Mistral-format weights (``consolidated*``:
    ``consolidated.safetensors``, ``consolidated.00.pth``) in the folder of ``params`` (a ``params.json``)."""
    folder = Path(params).parent
    return any(Path(n).parent == folder and Path(n).name.startswith("consolidated") for n in left_out)


def _merge_config(config_path: Path, base: Any, targets: set[str]) -> None:
    """Merge ours into ``base``: the checkpoint's own quantization config (compressed-tensors'), or what the
    converter's ``update_config`` gave for its format (``None``: nothing to merge, e.g. a dequantizer) — its groups
    first, ours after (compressed-tensors' ``QuantizationConfig.merge``); ``ignore``: the checkpoint's, less the
    modules quantized now (``targets``), then ours (``merge`` keeps only the first)."""
    from compressed_tensors.quantization import QuantizationConfig

    if base is None or not config_path.exists():
        return
    data = json.loads(config_path.read_text(encoding="utf-8"))
    ours = QuantizationConfig.model_validate(data["quantization_config"])
    for group in ours.config_groups.values():  # a class target would also claim the checkpoint's own quantized
        if any(not t.startswith("re:") and "." not in t for t in group.targets):  # modules: name ours
            group.targets = sorted(targets)
    base = base.model_copy(deep=True)
    base.ignore = [name for name in base.ignore or [] if name not in targets]
    base.merge(ours)
    base.ignore = [*base.ignore, *(name for name in ours.ignore or [] if name not in base.ignore)]
    data["quantization_config"] = {**data["quantization_config"], **base.model_dump(mode="json", exclude_none=True)}
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _check_ignored_by_pattern(base: Any, targets: set[str]) -> None:
    """Refuse, before any work, targets that the checkpoint's (or converter's) quantization config ignores by a
    ``re:`` pattern: the merged config would keep ignoring them on reload."""
    from compressed_tensors.utils.match import match_name

    patterns = [name for name in (base.ignore if base is not None else None) or [] if name.startswith("re:")]
    clashes = sorted(t for t in targets if any(match_name(t, p) for p in patterns))
    if clashes:
        msg = (
            f"model_free_ptq: the checkpoint's quantization config ignores {compact_names(clashes)} by a pattern "
            f"({', '.join(patterns)}), which this scheme quantizes: the merged config would leave them unquantized on "
            "reload; add them to ignore, or dequantize the checkpoint first"
        )
        raise ValueError(msg)


def _targets_as_loaded(config_path: Path, classes: Mapping[str, tuple[str, type] | None]) -> None:
    """Rename the module names among ``quantization_config``'s config-group targets from the checkpoint's names to
    the names of the modules they load into (:func:`checkpoint_classes`), as ``oneshot`` writes them: transformers
    5.25 applies the config to the model's own names (Gemma 3's checkpoint holds ``language_model.model.layers...``,
    the model ``model.language_model.layers...``), so a group that targets modules by name (several schemes, e.g. a
    vision tower saved unpacked beside packed decoder layers) quantized nothing on reload there, and its packed
    weights were missing (found by a tester). ``re:`` patterns and class names are left as they are."""
    if not config_path.exists():
        return
    data = json.loads(config_path.read_text(encoding="utf-8"))
    groups = (data.get("quantization_config") or {}).get("config_groups") or {}
    changed = False
    for group in groups.values():
        targets = group.get("targets") or []
        renamed = [classes[t][0] if classes.get(t) is not None else t for t in targets]
        if renamed != targets:
            group["targets"], changed = renamed, True
    if changed:
        config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _ignore_unquantized_linears(
    config_path: Path, model: nn.Module, classes: Mapping[str, tuple[str, type] | None], targets: set[str]
) -> None:
    """Add to ``quantization_config.ignore`` every Linear module of ``model`` (the architecture's, built on ``meta``)
    that no quantized checkpoint weight loads into, where a config group targets the class ``Linear``: on reload
    transformers would quantize it (a tied ``lm_head``, whose weight the checkpoint does not hold; a module named
    otherwise in the checkpoint), as :func:`llmc_fsm.output.compressed.ignore_for_reload` does for ``oneshot``."""
    if not config_path.exists():
        return
    data = json.loads(config_path.read_text(encoding="utf-8"))
    config = data.get("quantization_config") or {}
    if not any("Linear" in (g.get("targets") or []) for g in (config.get("config_groups") or {}).values()):
        return
    loaded = {classes[t][0] for t in targets if classes.get(t) is not None} | set(targets)
    listed = set(config.get("ignore") or [])
    extra = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in loaded and n not in listed]
    if extra:
        config["ignore"] = [*(config.get("ignore") or []), *extra]
        config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
