"""What ``Session.initialize`` does under ``torch.distributed``: ranks agree before any work; wrappers unwrapped.

* :func:`check_ranks_agree` — every rank compares a digest of its recipe, of
  its model's parameter names/shapes and dtypes and a checksum of its weights (and a teacher's), its
  ``steps_per_epoch``, and the expected world size when one was given (state key ``world_size``); any disagreement
  raises the same
  ``ValueError`` on every rank before a modifier is initialized;
* :func:`unwrap_model` / :func:`unwrap_state` — a ``DistributedDataParallel`` /
  ``DataParallel`` model, one compiled by ``torch.compile`` (an ``OptimizedModule``) or a
  peft ``PeftModel`` is replaced by the module inside it, whose parameters are the live ones the
  wrapper trains (so module names carry no ``module.`` / ``_orig_mod.`` / ``base_model.model.`` prefix).

See :mod:`llmc_fsm.toolkit.distributed` for the collectives and ``docs/distributed.md``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmc_fsm.core.state import State
from llmc_fsm.toolkit.distributed import (
    PeerFailureError,
    _digest,
    all_gather_ints,
    get_world_size,
    is_distributed,
)

__all__ = ["check_ranks_agree", "inference_tensors_refusal", "unwrap_model", "unwrap_state"]


def _recipe_digest(fingerprint: list[dict]) -> int:
    text = json.dumps(fingerprint, sort_keys=True, default=str)
    return _digest(re.sub(r" at 0x[0-9a-fA-F]+", "", text).encode())  # object reprs carry addresses


def _model_digest(model: Any) -> int:
    """A digest of ``model``'s parameter names and shapes (0 for no module)."""
    if not isinstance(model, nn.Module):
        return 0
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    return _digest(repr(shapes).encode())


def _dtypes_digest(model: Any) -> int:
    """A digest of ``model``'s parameter dtypes, in parameter order (0 for no module)."""
    if not isinstance(model, nn.Module):
        return 0
    return _digest(repr([str(p.dtype) for p in model.parameters()]).encode())


#: The dtypes counted per rank when the ranks' parameter dtypes differ (:func:`_differing_dtypes`); any other is
#: counted as ``other``.
_COUNTED_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
)


#: 32-bit words of a parameter's bytes checksummed at a time (:func:`_tensor_checksum`): 4 MiB, which bounds the
#: temporaries (the chunk widened to int64, its products: 8 MiB each) whatever the parameter's size.
CHUNK_WORDS = 1 << 20
#: Odd multipliers of the position weights (the 64-bit golden ratio, and a second odd constant for the chunks).
_WORD_MULTIPLIER, _CHUNK_MULTIPLIER = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F
#: Bytes read per checkpoint tensor for the digest of a model on ``meta`` (16 pieces at fixed offsets).
_FILE_PIECES, _FILE_PIECE = 16, 64
_weights_by_device: dict[tuple[torch.device, int], torch.Tensor] = {}


def _signed(value: int) -> int:
    """``value`` modulo 2**64 as a signed int64."""
    value &= 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >= 1 << 63 else value


def _word_weights(count: int, device: torch.device) -> torch.Tensor:
    """``LongTensor[count]`` on ``device``: the weight of word ``j`` of a chunk, ``((j + 1) * _WORD_MULTIPLIER mod
    2**64) | 1`` (odd, so that any change of one word changes the checksum); computed once per device and size."""
    key = (device, count)
    if key not in _weights_by_device:
        positions = torch.arange(1, count + 1, dtype=torch.int64, device=device)
        _weights_by_device[key] = (positions * _signed(_WORD_MULTIPLIER)) | 1  # int64 products wrap modulo 2**64
    return _weights_by_device[key]


def _tensor_checksum(tensor: torch.Tensor) -> int:
    """A position-weighted checksum of every byte of ``tensor`` (any dtype, on its own device), as a signed int64.

    The bytes, zero-padded to a multiple of 4, are read as little-endian int32 words ``x`` (sign-extended to int64)
    in chunks ``c`` of :data:`CHUNK_WORDS`; the checksum is ``sum_c M_c * sum_j W_j * x[c, j]`` modulo 2**64, with
    odd weights ``W_j`` (:func:`_word_weights`) and ``M_c = ((c + 1) * _CHUNK_MULTIPLIER mod 2**64) | 1``. Integer
    arithmetic: exact, and the same in any order of summation (any device, any number of threads). Any change of one
    word changes it (odd weights), and since a word's change is below 2**32, changes of several words cancel by
    chance only (at worst about 2**-33 for sign flips, which change only a word's top bit; int64 words would let an
    even number of top-bit flips cancel always). A chunk's temporaries are about 20 MiB; nothing is copied to the CPU
    but the result (a tensor that is not contiguous is made contiguous first)."""
    data = tensor.detach()
    data = data.reshape(-1) if data.is_contiguous() else data.contiguous().reshape(-1)
    raw = data.view(torch.uint8) if data.dtype != torch.uint8 else data
    total = torch.zeros((), dtype=torch.int64, device=raw.device)
    step = CHUNK_WORDS * 4
    for chunk, begin in enumerate(range(0, raw.numel(), step)):
        piece = raw[begin : begin + step]
        if piece.numel() % 4 or piece.storage_offset() % 4:  # the ragged end, or bytes not on a 4-byte boundary
            padded = torch.zeros(-(-piece.numel() // 4) * 4, dtype=torch.uint8, device=raw.device)
            padded[: piece.numel()] = piece
            piece = padded
        words = piece.view(torch.int32).to(torch.int64)
        weights = _word_weights(CHUNK_WORDS, raw.device)[: words.numel()]
        partial = torch.dot(words, weights) if raw.device.type == "cpu" else (words * weights).sum()  # dot: 3x faster
        total += partial * _signed((chunk + 1) * _CHUNK_MULTIPLIER | 1)
    return int(total.item())


def _checkpoint_digests(model: nn.Module) -> list[tuple[str, int]]:
    """``(what, digest)`` per tensor of the safetensors checkpoint a ``meta`` model was built from (its
    ``name_or_path`` directory), from :data:`_FILE_PIECES` pieces of its bytes; ``[]`` when there is none."""
    directory = Path(str(getattr(model, "name_or_path", "") or ""))
    if not str(directory) or not directory.is_dir():
        return []
    out = []
    for path in sorted(directory.glob("*.safetensors")):
        try:
            with path.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
                for key in sorted(k for k in header if k != "__metadata__"):
                    begin, end = header[key]["data_offsets"]
                    pieces = []
                    for i in range(_FILE_PIECES):
                        f.seek(8 + size + begin + (end - begin) * i // _FILE_PIECES)
                        pieces.append(f.read(min(_FILE_PIECE, end - begin)))
                    out.append((f"{key} (in {path.name})", _digest(b"".join(pieces))))
        except (OSError, ValueError, KeyError, TypeError):  # unreadable: its own error comes when it is read
            out.append((path.name, 0))
    return out


def _persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` per persistent buffer of ``model`` (those its ``state_dict`` holds and a checkpoint
    loads, e.g. DeepSeek-V3's router ``e_score_correction_bias``; shared ones once), in module order."""
    out, seen = [], set()
    for prefix, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is None or name in module._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            out.append((f"{prefix}.{name}" if prefix else name, buffer))
    return out


def _value_digests(model: Any, prefix: str = "") -> list[tuple[str, int]]:
    """``(tensor name, digest of the checksum of all its bytes)`` per parameter and persistent buffer of ``model``
    (tied ones once; each name after ``prefix``; :func:`_tensor_checksum`, whose 8 little-endian bytes are digested
    so that the 8 hex digits a refusal shows depend on all 64 bits); for tensors on ``meta`` (the streamed path reads
    each layer later) the checkpoint's tensors instead, from pieces of their bytes (:func:`_checkpoint_digests`:
    reading the whole checkpoint here would double the streamed path's reads). ``DTensor`` s (a teacher sharded by
    FSDP2: each rank holds another shard) are left out. Persistent buffers were not checked until 2026-12-08 (a rank
    given another DeepSeek-V3 router bias ran on; found by a tester)."""
    if not isinstance(model, nn.Module):
        return []
    out, on_meta = [], False
    for name, p in [*model.named_parameters(), *_persistent_buffers(model)]:
        if type(p).__name__ == "DTensor":  # a teacher sharded by FSDP2: each rank holds its own shard
            continue
        if p.is_meta:
            on_meta = True
        else:
            out.append((prefix + name, _digest(_tensor_checksum(p).to_bytes(8, "little", signed=True))))
    return out + ([(prefix + what, d) for what, d in _checkpoint_digests(model)] if on_meta else [])


def _positive_int_or_none(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"{name} must be a positive int (the number of ranks expected), got {value!r}"
        raise ValueError(msg)
    return value


def _ranks(table: list[list[int]], column: int) -> str:
    groups: dict[int, list[int]] = {}
    for rank, row in enumerate(table):
        groups.setdefault(row[column], []).append(rank)
    return "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v & 0xFFFFFFFF:08x}" for v, r in groups.items()
    )


def check_ranks_agree(fingerprint: list[dict], state: State) -> None:
    """Raise the same error on every rank unless all ranks agree on recipe, model structure, weights, world size and
    ``steps_per_epoch``.

    Called by ``Session.initialize`` before any modifier is initialized. One
    ``all_gather`` of seven int64 per rank: a digest of the recipe's ``fingerprint`` (each
    modifier's label, class, stage and arguments:
    :func:`llmc_fsm.recipes.fingerprint.recipe_fingerprint`), a digest of the model's
    parameter names and shapes, one of their dtypes, the expected world size (state key
    ``world_size``, optional), the state's ``steps_per_epoch`` (ranks counting epochs differently pruned at other
    steps, found by a tester), and digests of the weights' values and their names (the model's without an optimizer
    in the state, and a ``teacher``'s always, since no wrapper keeps it equal across the ranks: a checksum of every
    byte of each parameter and persistent buffer, :func:`_tensor_checksum`, or for a model on ``meta``
    pieces of each tensor of its safetensors checkpoint; ranks given different checkpoints of one architecture
    were mixed silently, each module's owner broadcasting its own, found by a tester, and until 2026-12-07 a
    strided sample of 4096 values per parameter missed a difference outside it, found by a tester); when the
    values differ, a second ``all_gather`` of one digest per tensor names the first that differs, and when the
    dtypes differ, one of each rank's parameter count per dtype names them (rank 1 given ``--dtype bfloat16`` was
    said to differ in "names/shapes", found by a tester). With ``world_size`` given and no
    process group, it must be 1.

    Raises:
        ValueError: ``world_size`` is not a positive int; the ranks disagree (on
            every rank, with the same message); the world size differs from
            the expected one.
        PeerFailureError: the first collective failed (another rank stopped, or never called ``initialize``: the
            message asks whether it was called on one rank only).
        DistributedError: a later collective failed.
    """
    expected = _positive_int_or_none("state world_size", state.get("world_size"))
    world = get_world_size()
    if not is_distributed():
        if expected is not None and expected != world:
            msg = (
                f"expected world size {expected} (state world_size) but this process runs without a torch.distributed "
                f"process group of that size (world size {world}): launch it with torchrun --nproc-per-node ..."
            )
            raise ValueError(msg)
        return
    training = state.get("optimizer") is not None  # DistributedDataParallel makes the ranks' weights equal itself
    values = [] if training else _value_digests(state.get("model"))
    values += _value_digests(state.get("teacher"), "teacher ")  # no wrapper keeps a teacher's weights equal
    labels = [label for label, _ in values]
    spe = state.get("steps_per_epoch")
    row = [
        _recipe_digest(fingerprint),
        _model_digest(state.get("model")),
        -1 if expected is None else expected,
        _digest(repr(values).encode()),
        _digest(repr(labels).encode()),
        _dtypes_digest(state.get("model")),
        -1 if spe is None else int(spe),
    ]
    try:
        table = all_gather_ints(row, what="all_gather (recipe check at initialize)")
    except PeerFailureError as exc:  # the first collective of a run: a rank that never calls it is the usual cause
        msg = (
            f"{exc} initialize() (which oneshot() calls) is collective under torch.distributed: every rank of the "
            "process group must call it; was it called on one rank only (e.g. under `if rank == 0:`)? Call "
            "oneshot() / initialize() on every rank (they share the work, rank 0 writes the output), or compress in "
            "a process of its own, started without torchrun"
        )
        raise PeerFailureError(msg) from exc
    problems = []
    if len({r[0] for r in table}) > 1:
        problems.append(f"the recipe differs between ranks (digest per rank — {_ranks(table, 0)})")
    if len({r[1] for r in table}) > 1:
        problems.append(f"the model's parameter names/shapes differ between ranks ({_ranks(table, 1)})")
    elif len({r[5] for r in table}) > 1:  # rank 1 loaded with --dtype bfloat16 (a tester)
        problems.append(_differing_dtypes(state.get("model")))
    elif len({r[3] for r in table}) > 1:  # the same structure, other values: a different checkpoint (a tester)
        problems.append(_differing_weights(table, values))
    if len({r[6] for r in table}) > 1:  # schedules in epochs would drift apart (found by a tester)
        given = ", ".join(f"rank {k}: {r[6] if r[6] != -1 else 'none'}" for k, r in enumerate(table))
        problems.append(
            f"the ranks have different steps_per_epoch ({given}): their schedules in epochs (pruning steps, "
            "learning rate) and their masks would drift apart; give every rank the same steps_per_epoch and the same "
            "number of batches, e.g. shard the data with a DistributedSampler (it pads every rank's shard to "
            "ceil(len(dataset) / world_size) samples)"
        )
    wanted = sorted({r[2] for r in table if r[2] != -1})
    if len(wanted) > 1 or (wanted and len({r[2] for r in table}) > 1):
        given = ", ".join(f"rank {k}: {r[2] if r[2] != -1 else 'none'}" for k, r in enumerate(table))
        problems.append(f"the ranks expect different world sizes ({given})")
    elif wanted and wanted[0] != world:
        problems.append(f"expected world size {wanted[0]} (state world_size) but the process group has {world} ranks")
    if problems:
        msg = (
            f"initialize() refused on every rank of the process group ({world} ranks): " + "; ".join(problems) + ". "
            "Every rank must run the same recipe on the same model; launch them with the same arguments. "
            "No modifier was initialized."
        )
        raise ValueError(msg)


def _differing_dtypes(model: Any) -> str:
    """The problem with ranks whose parameters' dtypes differ, with each rank's count of parameters per dtype (a
    second ``all_gather``; every rank calls it, having seen the same table)."""
    params = list(model.parameters()) if isinstance(model, nn.Module) else []
    counts = [sum(p.dtype == dtype for p in params) for dtype in _COUNTED_DTYPES]
    table = all_gather_ints([*counts, len(params) - sum(counts)], what="all_gather (dtypes check at initialize)")
    names = [str(dtype).removeprefix("torch.") for dtype in _COUNTED_DTYPES] + ["other"]
    groups: dict[str, list[int]] = {}
    for rank, row in enumerate(table):
        present = sorted(((n, name) for n, name in zip(row, names, strict=True) if n), key=lambda item: -item[0])
        said = ", ".join(f"{n} {name}" for n, name in present) or "none"
        groups.setdefault(said, []).append(rank)
    per_rank = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {s}" for s, r in groups.items())
    return (
        f"the model's parameter dtypes differ between ranks (parameters per dtype — {per_rank}): each rank must "
        "load the model in the same dtype (the same --dtype / torch_dtype)"
    )


def _differing_weights(table: list[list[int]], values: list[tuple[str, int]]) -> str:
    """The problem with ranks whose weights differ, naming the first tensor that does (a second ``all_gather``, of
    one digest per tensor; every rank calls it, having seen the same ``table``)."""
    if len({r[4] for r in table}) > 1:  # e.g. the streamed path's checkpoint files differ in their tensors' names
        where = f"the checkpoints hold different tensors ({_ranks(table, 4)})"
    else:
        digests = all_gather_ints([d for _, d in values], what="all_gather (weights check at initialize)")
        first = next(i for i in range(len(values)) if len({r[i] for r in digests}) > 1)
        where = f"the first that differs is {values[first][0]}, digest per rank — {_ranks(digests, first)}"
    return (
        f"the ranks loaded different weights ({where}): each rank must load the same checkpoint (a copy on another "
        "node that differs, or another checkpoint of the same architecture, gives other weights)"
    )


# --------------------------------------------------------------------------- wrappers
def unwrap_model(model: Any) -> Any:
    """The module inside ``DistributedDataParallel`` / ``DataParallel`` / ``torch.compile`` / peft ``PeftModel``
    wrappers, in any nesting (``model`` itself otherwise).

    The wrapped module's parameters are the ones the wrapper trains, so
    modifiers that change them in place act on the live model, under the
    model's own module names (``lm_head``, not ``_orig_mod.lm_head`` or ``base_model.model.lm_head``; a peft model's
    base model still holds its adapter layers, which targets never select: :func:`llmc_fsm.toolkit.select_targets`).

    Raises:
        ValueError: a ``FullyShardedDataParallel`` model (its parameters are sharded across ranks; not
            supported).
    """
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
            continue
        if _is_compiled(model):
            model = model._orig_mod
            continue
        if _is_peft(model):
            model = model.get_base_model()
            continue
        if type(model).__name__ == "FullyShardedDataParallel":
            msg = (
                "FullyShardedDataParallel shards the parameters across ranks, so a modifier cannot see whole "
                "weights; wrap the model in DistributedDataParallel instead"
            )
            raise ValueError(msg)
        return model


def _is_peft(model: Any) -> bool:
    """Whether ``model`` is peft's ``PeftModel`` (duck-typed: its ``peft_config`` and ``get_base_model``; peft is not
    imported here)."""
    return "peft" in sys.modules and hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def _is_compiled(model: Any) -> bool:
    """Whether ``model`` is ``torch.compile``'s ``OptimizedModule`` (torch._dynamo is imported once anything is
    compiled, so it is not imported here for a model that is not)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def inference_tensors_refusal(model: Any, what: str = "model") -> str | None:
    """One line when ``model`` holds parameters made under ``torch.inference_mode()`` (they keep no version counter,
    which the session's guard reads, and cannot be changed in place outside that mode: it failed with a bare
    RuntimeError, found by a tester), else ``None``."""
    if isinstance(model, nn.Module) and any(p.is_inference() for p in model.parameters()):
        return (
            f"the {what}'s parameters were made under torch.inference_mode(), which keeps them from being changed or "
            f"watched outside it: load (or build) the {what} outside inference_mode"
        )
    return None


def unwrap_state(state: State) -> State:
    """``state`` with ``model`` and ``teacher`` unwrapped (:func:`unwrap_model`); ``state`` if none is wrapped.

    Raises:
        ValueError: as :func:`unwrap_model`; a ``model`` whose parameters are ``DTensor`` s (FSDP2's ``fully_shard``,
            tensor parallelism: sharded across ranks; a teacher, only run forward, is taken) or that is an
            ``AveragedModel`` (an EMA / SWA copy, whose weights are averaged from the trained model's: the session
            pruned the copy while the trained model stayed dense, found by a tester; as a ``teacher`` it is taken).
    """
    updates = {}
    for key in ("model", "teacher"):
        value = state.get(key)
        inner = unwrap_model(value) if value is not None else None
        if (
            key == "model"
            and isinstance(inner, nn.Module)
            and any(type(p).__name__ == "DTensor" for p in inner.parameters())
        ):
            msg = (
                "the model's parameters are DTensors (FSDP2's fully_shard or tensor parallelism): they are sharded "
                "across ranks, so a modifier cannot see whole weights; wrap the model in DistributedDataParallel "
                "instead"
            )
            raise ValueError(msg)
        if (refusal := inference_tensors_refusal(inner, key)) is not None:  # a teacher too: the guard reads it
            raise ValueError(refusal)
        if key == "model" and isinstance(inner, torch.optim.swa_utils.AveragedModel):
            msg = (
                "the model is an AveragedModel (an EMA / SWA copy): its weights are averaged from the trained "
                "model's, not trained, so the modifiers would change the copy and not the model the optimizer "
                "trains; give the session that model (to compress the averaged weights themselves, give the "
                "copy's .module)"
            )
            raise ValueError(msg)
        if inner is not value:
            updates[key] = inner
    return state.merged(updates) if updates else state
