"""One-shot resume: the run's fingerprint and its per-layer progress in the work directory.

After each decoder layer is compressed, :class:`LayerProgress` writes
``progress/pass-P/layer-KKKKK.safetensors`` (written to a ``.partial`` file and
renamed, so a kill leaves either the whole file or none):

* the layer's ``state_dict()`` — its compressed weights and, for modules the
  quantization plugin quantized, the compressed-tensors ``weight_scale`` /
  ``weight_zero_point`` (/ ``weight_g_idx``) parameters;
* in the safetensors metadata (JSON): each quantized module's
  ``quantization_scheme`` and ``quantization_status``, and the per-module
  results (:class:`~llmc_fsm.toolkit.calibrated.ModuleResult`) and skipped targets of
  every :class:`~llmc_fsm.toolkit.calibrated.CalibratedModifier`, for the report.

A resumed run re-does everything up to ``calibration_start`` exactly as before,
then restores layers ``0..k-1`` from these files and recomputes the calibration
activations entering layer ``k`` by running the restored layers on the
calibration inputs — the same forwards, on the same weights, as the
uninterrupted run, so the result is bitwise identical (on the same machine,
with the same number of threads). Recomputing costs one forward per restored
layer at resume; storing the activations instead would cost a write of the
whole calibration set's hidden states after every layer.

The calibration windows are kept too (``calibration.safetensors``: generated
calibration data is not generated again), and the perplexity measured before
compression (``eval_before.json``, keyed by the evaluation windows' sha256), so
a resumed run does not measure it again.

:func:`fingerprint` records what the result depends on; :func:`llmc_fsm.output.workdir.fingerprint_changes`
names what differs. A modifier that keeps per-layer state of its own (overrides
``on_sequential_epoch_end`` without deriving from ``CalibratedModifier``) is restored
when it has ``progress_state(layer) -> dict`` (JSON values: its state for the modules
inside ``layer``, saved in the layer's metadata) and
``restore_progress_state(layer, state)`` (the smoothing modifiers have them; one that changes the layer's shapes
also ``restore_layer_structure(layer, state)``, called before the saved tensors are loaded: REAP); a run with
one that has not keeps no per-layer progress (:func:`resumable`). A ``CalibratedModifier``
with these methods keeps that state beside its results (AutoRound: each layer's tuning errors). A modifier that carries
the float model's hidden states from layer to layer (AutoRound's targets) has
``resume_float_inputs(inputs)``: the resumed run also runs its calibration inputs through
each restored layer as loaded, before restoring it, and hands the result over
(:class:`llmc_fsm.pipeline.layer.RestoredLayers`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from llmc_fsm.core import version
from llmc_fsm.core.modifier import Modifier, overrides
from llmc_fsm.core.registry import get_registry
from llmc_fsm.models.hf_io import hub_unreachable, looks_like_hub_id
from llmc_fsm.models.known import KNOWN_MODELS
from llmc_fsm.oneshot_job.data import DEFAULT_PROMPTS, describe
from llmc_fsm.oneshot_job.settings import OneshotSettings
from llmc_fsm.output.workdir import LAYOUT, RANKS_KEY, WorkDir, as_os_error, readable
from llmc_fsm.recipes.model import Recipe
from llmc_fsm.session.session import Session
from llmc_fsm.toolkit.calibrated import CalibratedModifier, ModuleResult
from llmc_fsm.toolkit.distributed import get_world_size
from llmc_fsm.toolkit.views import quantize_expert_inputs, weight_views

__all__ = [
    "LayerProgress",
    "fingerprint",
    "layer_progress",
    "load_eval_before",
    "load_windows",
    "resumable",
    "save_eval_before",
    "save_windows",
]

logger = logging.getLogger(__name__)

_WINDOWS = "calibration.safetensors"
_EVAL_BEFORE = "eval_before.json"


# --------------------------------------------------------------------------- fingerprint
def _digest(chunks: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()[:16]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return f"{t.dtype}{tuple(t.shape)}".encode() + t.view(-1).view(torch.uint8).numpy().tobytes()


def _file_digest(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()[:16]


def _file_stat(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def _model_item(model: Any, hash_files: bool = True) -> dict[str, Any]:
    """The model: its tensors (an ``nn.Module``), its files (a directory: sha256, or size and modification time
    without ``hash_files``), or its name and package."""

    if isinstance(model, nn.Module):
        state = model.state_dict()
        return {
            "module": type(model).__name__,
            "sha256": _digest(k.encode() + _tensor_bytes(v) for k, v in state.items()),
        }
    key = os.fspath(model)
    spec = KNOWN_MODELS.get(key)
    if spec is not None:
        try:
            version = importlib.metadata.version(spec.distribution)
        except importlib.metadata.PackageNotFoundError:
            version = None
        return {"name": key, "package": f"{spec.distribution} {version}"}
    path = Path(key).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
        if not hash_files:
            return {"directory": str(path.resolve()), "files": {p.name: _file_stat(p) for p in files}}
        return {"directory": str(path.resolve()), "files": {p.name: _file_digest(p) for p in files}}
    return {"hub id": key, "revision": _hub_revision(key)} if looks_like_hub_id(key) else {"hub id": key}


#: File suffixes of a model's weights, left out of a tokenizer directory's digest (it may be the model's directory).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def _tokenizer_item(tokenizer: Any) -> dict[str, Any]:
    """The ``tokenizer`` setting: a directory's files (sha256 of each, its weight files left out), a Hub ID and its
    commit, or a tokenizer / processor object's class and the sha256 of what its ``save_pretrained`` writes (its
    vocabulary, special tokens and settings). A resume with another tokenizer reused the first one's calibration
    windows and shipped the second one's files (found by a tester)."""
    if not isinstance(tokenizer, str | os.PathLike):
        kind = f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}"
        save = getattr(tokenizer, "save_pretrained", None)
        if not callable(save):
            return {"object": kind}
        with tempfile.TemporaryDirectory(prefix="llmc-fsm-tokenizer-") as tmp:
            save(tmp)
            files = sorted(p for p in Path(tmp).rglob("*") if p.is_file())
            digest = _digest(chunk for p in files for chunk in (p.name.encode(), p.read_bytes()))
        return {"object": kind, "sha256": digest}
    key = os.fspath(tokenizer)
    path = Path(key).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES))
        return {"directory": str(path.resolve()), "files": {p.name: _file_digest(p) for p in files}}
    return {"hub id": key, "revision": _hub_revision(key)} if looks_like_hub_id(key) else {"name": key}


def _hub_revision(repo_id: str) -> str | None:
    """The commit of the Hub model ``repo_id`` a load reads: online, ``main``'s commit on the Hub (what
    ``from_pretrained`` fetches then); offline or unreachable, the cached ``main`` snapshot (what it reads then);
    ``None`` when neither is known. A resumed run whose model moved to another commit (a Hub update) mixed two models'
    layers: the ID alone was compared (found by a tester; the cached commit alone missed an update read online)."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache

    if not constants.HF_HUB_OFFLINE and hub_unreachable(constants.ENDPOINT) is None:
        try:
            return HfApi().model_info(repo_id, timeout=10).sha
        except Exception as err:  # the Hub did not answer for it: the load falls back to the cache, and so does this
            logger.info("%s: main's commit not had from the Hub (%s); the cached one is recorded", repo_id, err)
    cached = try_to_load_from_cache(repo_id, "config.json")
    return Path(cached).parent.name if isinstance(cached, str) else None  # snapshots/<commit>/config.json


def _versions(modifiers: Iterable[Modifier]) -> dict[str, str | None]:

    versions: dict[str, str | None] = {"llmc-fsm": version.__version__, "torch": torch.__version__}
    for dist in ("transformers", "compressed-tensors"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    for modifier in modifiers:
        info = get_registry().info(modifier.modifier_name())
        if info is not None and info.distribution is not None:
            versions[info.distribution] = info.version
    return versions


def fingerprint(
    settings: OneshotSettings,
    *,
    recipe: Recipe,
    modifiers: Iterable[Modifier],
    text: str | None,
    hash_files: bool = True,
) -> dict[str, Any]:
    """What a one-shot result depends on, as JSON values (compared item by item on resume).

    Items: ``model`` (sha256 of an in-memory model's tensors; of each file of a
    model directory; a known model's name and package version; a Hub ID and its commit), ``tokenizer`` (only when
    ``settings.tokenizer`` is given: its directory's files but the weights, a Hub ID and its commit, or an object's
    class and the sha256 of what its ``save_pretrained`` writes), ``recipe``
    (every setting of ``recipe``, the resolved one), ``calibration data`` (source and sha256 of its text
    (``text``, the dataset read) or token tensor; windows, length), ``pipeline`` (batch size, stages fused,
    the load ``dtype``, the calibration order within a layer: :mod:`llmc_fsm.pipeline.true_sequential`),
    ``seed``, ``library versions`` (llmc-fsm, torch, transformers,
    compressed-tensors, the modifiers' plugin distributions). Hashing reads the
    model once (~0.3 s for SmolLM2's 0.5 GB); ``hash_files=False`` (a data-free job, which keeps no per-layer
    progress to resume) records a directory's file sizes and modification times instead.

    Which settings enter it, and where, is the ``fingerprint`` metadata of the
    :class:`~llmc_fsm.oneshot_job.settings.OneshotSettings` fields: ``model``, ``recipe`` and
    ``dataset`` by content (here), the others by value (:meth:`OneshotSettings.fingerprint_values`).
    """

    dataset = settings.dataset
    if isinstance(dataset, torch.Tensor):
        data: dict[str, Any] = {"source": describe(dataset), "sha256": _digest([_tensor_bytes(dataset)])}
    elif text is not None:
        data = {"source": describe(dataset), "sha256": _digest([text.encode("utf-8")])}
    else:
        data = {"source": "generated by the model", "sha256": _digest(p.encode() for p in DEFAULT_PROMPTS)}
    items: dict[str, Any] = {
        "model": _model_item(settings.model, hash_files),
        "recipe": recipe.to_dict(),
        "calibration data": data,
    }
    if settings.tokenizer is not None:  # else the model's own: its files are the model's
        items["tokenizer"] = _tokenizer_item(settings.tokenizer)
    for path, value in settings.fingerprint_values().items():
        *parents, key = path
        node = items
        for parent in parents:
            node = node.setdefault(parent, {})
        node[key] = value
    items["pipeline"]["order"] = "true sequential"
    items["library versions"] = _versions(modifiers)
    return json.loads(json.dumps(items))


# --------------------------------------------------------------------------- per-layer progress
def _keeps_progress(modifier: Modifier) -> bool:
    return isinstance(modifier, CalibratedModifier) or callable(getattr(modifier, "progress_state", None))


def resumable(session: Session) -> bool:
    """Whether every modifier's per-layer state can be restored (see the module docstring)."""
    return not any(overrides(m, "on_sequential_epoch_end") and not _keeps_progress(m) for m in session.modifiers)


def layer_progress(work: WorkDir | None, pass_index: int, passes: int, session: Session) -> LayerProgress | None:
    """The saved layers of pass ``pass_index`` in ``work``; ``None`` without a work directory or :func:`resumable`."""
    if work is None or not resumable(session):
        return None
    return LayerProgress(work.progress, pass_index, passes, session)


class LayerProgress:
    """The saved layers of one calibration pass (a :class:`llmc_fsm.pipeline.sequential.LayerCheckpoint`).

    Args:
        progress: the work directory's ``progress/``.
        pass_index / passes: this pass (one per session) and the number of passes.
        session: the pass's session (its modifiers' results are saved and restored).
    """

    def __init__(self, progress: Path, pass_index: int, passes: int, session: Session) -> None:
        self.root, self.passes = progress, passes
        self.directory = progress / f"pass-{pass_index}"
        self.modifiers = dict(zip(session.labels, session.modifiers, strict=True))

    def _file(self, index: int) -> Path:
        return self.directory / f"layer-{index:05d}.safetensors"

    def layers_done(self, num_layers: int) -> int:
        """Leading layers with a readable file (also records the layout for
        :func:`llmc_fsm.output.workdir.progress_summary`)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        layout = self.root / LAYOUT
        if not layout.exists():
            layout.write_text(json.dumps({"num_layers": num_layers, "passes": self.passes}) + "\n", encoding="utf-8")
        done = 0
        while done < num_layers and readable(self._file(done)):
            done += 1
        return done

    def save(self, index: int, layer: nn.Module) -> None:
        """Write layer ``index`` (its state dict; quantization and results as JSON metadata; the number of ranks
        that calibrated it, for a resumed run's report: :func:`llmc_fsm.output.workdir.calibrated_ranks`)."""
        views, view_tensors = _views_of(layer)
        metadata = {
            "quantization": json.dumps(_quantization_of(layer)),
            "results": json.dumps(self._results_of(layer)),
            "views": json.dumps(views),
            RANKS_KEY: str(get_world_size()),
        }
        _write_safetensors({**_unshared(layer.state_dict()), **view_tensors}, self._file(index), metadata)

    def restore(self, index: int, layer: nn.Module) -> None:
        """Load layer ``index`` into ``layer`` and the modifiers' results for its modules.

        Raises:
            ValueError: the file does not fit the layer (another model), naming the file.
        """
        path = self._file(index)
        with safe_open(str(path), "pt") as fh:
            metadata = fh.metadata() or {}
        tensors = load_file(str(path))
        view_tensors = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith(_VIEWS)]}
        quantization = json.loads(metadata.get("quantization", "{}"))
        saved_results = json.loads(metadata.get("results", "{}"))
        for label, saved in saved_results.items():  # the layer's structure first (REAP: its experts dropped)
            structure = getattr(self.modifiers[label], "restore_layer_structure", None)
            if "state" in saved and callable(structure):
                structure(layer, saved["state"])
        try:
            _init_quantization(layer, quantization)
            layer.load_state_dict(tensors, strict=True)
        except (RuntimeError, ValueError, AttributeError) as err:
            msg = f"saved progress {str(path)!r} does not fit decoder layer {index}: {str(err).splitlines()[0]}"
            raise ValueError(msg) from err
        _set_status(layer, quantization)
        _restore_views(layer, json.loads(metadata.get("views", "{}")), view_tensors)
        for label, saved in saved_results.items():
            modifier = self.modifiers[label]
            if "state" in saved:  # a modifier with its own per-layer state (see the module docstring)
                modifier.restore_progress_state(layer, saved["state"])
            if "results" not in saved:
                continue
            modifier.results.update({name: ModuleResult(**fields) for name, fields in saved["results"].items()})
            modifier.skipped.extend(n for n in saved["skipped"] if n not in modifier.skipped)
            if isinstance(getattr(modifier, "routed_tokens", None), dict):  # fused experts: counts of the first run
                modifier.routed_tokens.update(saved.get("routed_tokens", {}))

    def _results_of(self, layer: nn.Module) -> dict[str, Any]:
        inside = {id(v) for m in layer.modules() for v in (m, *weight_views(m).values())}  # with expert views
        out: dict[str, Any] = {}
        for label, modifier in self.modifiers.items():
            if not isinstance(modifier, CalibratedModifier):
                if callable(getattr(modifier, "progress_state", None)):
                    out[label] = {"state": modifier.progress_state(layer)}
                continue
            names = [n for n, m in modifier.resolved_targets.items() if id(m) in inside]
            out[label] = {
                "results": {n: attrs.asdict(modifier.results[n]) for n in names if n in modifier.results},
                "skipped": [n for n in names if n in modifier.skipped],
                "routed_tokens": {
                    n: c for n, c in (getattr(modifier, "routed_tokens", None) or {}).items() if n in names
                },
            }
            if callable(getattr(modifier, "progress_state", None)):  # and state of its own (AutoRound's errors)
                out[label]["state"] = modifier.progress_state(layer)
        return out


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with tensors that share memory with an earlier one copied (safetensors refuses shared memory)."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        ptr = value.untyped_storage().data_ptr()
        out[key] = value.clone() if ptr in seen else value.contiguous()
        seen.add(ptr)
    return out


def _quantization_of(layer: nn.Module) -> dict[str, Any]:
    out = {}
    for name, module in layer.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None:
            status = getattr(module, "quantization_status", None)
            out[name] = {"scheme": scheme.model_dump(mode="json"), "status": getattr(status, "value", status)}
    return out


def _init_quantization(layer: nn.Module, quantization: Mapping[str, Any]) -> None:
    """Give the modules that were quantized their compressed-tensors parameters (values come with the state dict)."""
    if not quantization:
        return
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization

    for name, info in quantization.items():
        scheme = QuantizationScheme.model_validate(info["scheme"])
        initialize_module_for_quantization(layer.get_submodule(name), scheme, force_zero_point=True)


#: Key prefix, in a layer's progress file, of the quantization parameters kept on expert views (not in the state dict).
_VIEWS = "__llmc_fsm_views__."


def _expert_views(layer: nn.Module) -> dict[str, Any]:
    """``{name inside layer: view}`` of the expert matrices of the layer's fused experts."""
    return {
        f"{name}.{suffix}" if name else suffix: view
        for name, module in layer.named_modules()
        for suffix, view in weight_views(module).items()
        if view.expert is not None
    }


def _views_of(layer: nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What the quantization plugin keeps on the layer's expert views outside the state dict: per quantized view its
    scheme and checkpoint name (metadata) and its ``quantized_params`` (tensors, keys prefixed ``_VIEWS``)."""
    info: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, view in _expert_views(layer).items():
        scheme = getattr(view, "quantization_scheme", None)
        if scheme is not None:
            info[name] = {"scheme": scheme.model_dump(mode="json"), "checkpoint_name": view.checkpoint_name}
            tensors.update({f"{_VIEWS}{name}.{k}": t.contiguous() for k, t in view.quantized_params.items()})
    return info, tensors


def _restore_views(layer: nn.Module, info: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """Give the layer's expert views back what :func:`_views_of` saved (their values came with the state dict)."""
    if not info:
        return
    from compressed_tensors.quantization import QuantizationScheme, QuantizationStatus

    views = _expert_views(layer)
    for name, entry in info.items():
        view = views[name]
        view.quantization_scheme = QuantizationScheme.model_validate(entry["scheme"])
        view.quantization_status = QuantizationStatus.FROZEN
        view.checkpoint_name = entry["checkpoint_name"]
        prefix = f"{_VIEWS}{name}."
        view.quantized_params = {k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix)}
    for view in views.values():  # Llama 4's experts compute as transformers' reloaded Linear experts do
        quantize_expert_inputs(view.source)


def _set_status(layer: nn.Module, quantization: Mapping[str, Any]) -> None:
    if not quantization:
        return
    from compressed_tensors.quantization import QuantizationStatus

    for name, info in quantization.items():
        if info["status"] is not None:
            layer.get_submodule(name).quantization_status = QuantizationStatus(info["status"])


def _write_safetensors(tensors: dict[str, torch.Tensor], target: Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to ``target`` through ``target.partial`` (renamed into place when complete).

    Raises:
        OSError: the write failed (a full disk): its errno, naming ``target`` (a full disk named the work directory,
            found by a tester); the partial file is removed.
    """
    tmp = target.with_name(target.name + ".partial")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, target)
    except (OSError, SafetensorError) as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and (err.filename is not None or err.errno is None):
            raise  # names its file already
        named = as_os_error(err, target) if isinstance(err, SafetensorError) else OSError(err.errno, err.strerror)
        named.filename = str(target)
        raise named from err


# --------------------------------------------------------------------------- calibration windows
def save_windows(work: Path, windows: torch.Tensor) -> None:
    """Keep the calibration windows (``LongTensor[N, L]``) for a resumed run."""
    _write_safetensors({"windows": windows.contiguous()}, work / _WINDOWS)


def load_windows(work: Path) -> torch.Tensor | None:
    """The calibration windows a run saved in ``work``, or ``None``."""
    path = work / _WINDOWS
    return load_file(str(path))["windows"] if readable(path) else None


# --------------------------------------------------------------------------- perplexity before compression
def _eval_key(windows: torch.Tensor) -> str:
    return _digest([_tensor_bytes(windows)])


def save_eval_before(work: Path, windows: torch.Tensor, ppl: float, note: str | None = None) -> None:
    """Keep the perplexity measured before compression on ``windows`` (``LongTensor[N, L]``), and the report's note
    on where it came from (``"reused: measured <time>"`` when the dense-perplexity cache gave it)."""
    tmp = work / (_EVAL_BEFORE + ".partial")
    record = {"windows_sha256": _eval_key(windows), "ppl": ppl, "note": note}
    tmp.write_text(json.dumps(record) + "\n", encoding="utf-8")
    os.replace(tmp, work / _EVAL_BEFORE)


def load_eval_before(work: Path, windows: torch.Tensor) -> tuple[float, str | None] | None:
    """``(perplexity, note)`` a run saved in ``work`` for the same evaluation ``windows``, or ``None``."""
    try:
        saved = json.loads((work / _EVAL_BEFORE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if saved.get("windows_sha256") != _eval_key(windows):
        return None
    return float(saved["ppl"]), saved.get("note")
