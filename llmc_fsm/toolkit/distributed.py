"""Several processes with ``torch.distributed``: split calibration data, reduce statistics, agree before work.

Nothing here launches processes or moves bytes itself: ranks are started by
``torchrun`` (or any launcher that sets up a ``torch.distributed`` process
group) and every collective is a ``torch.distributed`` call (gloo on CPU, NCCL
on GPUs). See ``docs/distributed.md`` for the commands.

Every function is a no-op (or answers for one process) unless a process group
is initialized with more than one rank (:func:`is_distributed`). What the
library does under a process group:

* :func:`shard` — each rank calibrates on a contiguous slice of the
  calibration windows (:func:`split_counts`: the first ``N mod W`` ranks get
  one window more), after checking that every rank holds the same windows;
* statistics accumulators are summed over the ranks before a layer is
  compressed (:func:`all_reduce_accumulator`, called by
  :class:`~llmc_fsm.toolkit.calibrated.CalibratedModifier`); every rank then computes
  the same weights, which :func:`check_same_values` verifies;
* the modules of a decoder layer are **assigned to ranks** (:func:`assign_to_ranks`, balanced by their sweep cost
  :func:`sweep_cost`, about rows x columns²) for a modifier whose compression changes only the weights
  (``CalibratedModifier.shares_work_across_ranks``): each rank compresses its share, then the new weights are
  broadcast from their owner (:func:`broadcast_tensor`), so N ranks cut the sweep time too;
  :func:`rank_work` sums up what each rank did;
* at ``Session.initialize`` every rank compares digests of its recipe and
  model, and a ``DistributedDataParallel`` model is unwrapped
  (:mod:`llmc_fsm.session.ranks`);
* :func:`process_group_from_env` — what the CLI does under ``torchrun``; :func:`error_line_to_print` — which rank
  prints an error, and how; :func:`interrupt_line_to_print` — which rank prints an interruption.

A collective that fails (another rank stopped, or did not arrive within the
process group's timeout) raises :class:`PeerFailureError` (a :class:`DistributedError`) naming this rank
and the step, instead of hanging.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ERROR_WAIT_S",
    "DistributedError",
    "PeerFailureError",
    "all_gather_ints",
    "all_gather_rows",
    "all_reduce_accumulator",
    "all_reduce_tensor",
    "assign_to_ranks",
    "broadcast_tensor",
    "broadcast_values",
    "check_same_values",
    "error_line_to_print",
    "get_rank",
    "get_world_size",
    "interrupt_line_to_print",
    "is_distributed",
    "is_main_process",
    "launched_world_size",
    "note_interrupt",
    "peer_failure",
    "process_group_from_env",
    "rank_work",
    "reduce_statistics",
    "refuse_without_process_group",
    "shard",
    "split_counts",
    "sweep_cost",
]

logger = logging.getLogger(__name__)

#: Collective timeout (seconds) the CLI gives the process group; ``LLMC_FSM_DIST_TIMEOUT`` overrides it.
DEFAULT_TIMEOUT_S = 600.0
#: Environment variable: collective timeout in seconds for the CLI's process group.
TIMEOUT_ENV = "LLMC_FSM_DIST_TIMEOUT"
#: Environment variable: the world size the CLI expects (checked on every rank before any work).
WORLD_SIZE_ENV = "LLMC_FSM_WORLD_SIZE"

_timeout_s: float | None = None  # set when process_group_from_env created the group
#: Dtypes every backend broadcasts as they are (gloo has no float8, int16 or unsigned types beyond uint8); any other
#: travels as the bytes of the tensor (``uint8``), which a broadcast copies exactly.
_WIRE_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64}
)


class DistributedError(RuntimeError):
    """A ``torch.distributed`` collective failed: another rank stopped or timed out, or the ranks diverged."""


class PeerFailureError(DistributedError):
    """A collective failed because another rank stopped (it died or raised) or did not reach the same step within
    the process group's timeout: the cause is elsewhere, this rank's own work is sound (its finished progress may be
    kept, and a non-zero rank does not print it: :func:`peer_failure`)."""


def peer_failure(exc: BaseException | None) -> PeerFailureError | None:
    """The :class:`PeerFailureError` behind ``exc`` (``exc`` itself, or one it was raised from or while handling, at
    any depth: a modifier's hook wraps it in a ``ModifierError``), or ``None``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, PeerFailureError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ if exc.__cause__ is not None else exc.__context__
    return None


# --------------------------------------------------------------------------- who am I
def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialized with more than one rank."""

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """This process's rank in the default process group (0 without one)."""

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """Ranks in the default process group (1 without one)."""

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def launched_world_size() -> int:
    """The number of processes ``torchrun`` started, from ``WORLD_SIZE`` (1 when unset or not a number)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:  # not a number: not torchrun's
        return 1


def refuse_without_process_group(what: str) -> None:
    """Refuse to run as one of several processes that torchrun started (``WORLD_SIZE`` > 1) when no process group of
    several ranks is initialized: each process would run the whole job alone, on the same output (found by a tester:
    ``oneshot()`` under torchrun without ``init_process_group`` ran two full jobs, and rank 1 died with a
    ``FileExistsError`` traceback, or with ``overwrite`` the two silently wrote one output twice).

    Args:
        what: the call, as the message names it (``"oneshot(...)"``).

    Raises:
        ValueError: one line naming the world size and what to do: ``init_process_group`` first, or no torchrun.
    """
    launched = launched_world_size()
    if launched > 1 and get_world_size() == 1:
        msg = (
            f"{what} runs as one of {launched} processes (WORLD_SIZE={launched}: torchrun) but no torch.distributed "
            "process group of several ranks is initialized, so each process would run the whole job on the same "
            f"output: call torch.distributed.init_process_group() on every rank before {what}, or run it without "
            "torchrun"
        )
        raise ValueError(msg)


def is_main_process() -> bool:
    """Whether this process is rank 0 (or the only process): the one that writes output files."""
    return get_rank() == 0


def _device() -> torch.device:
    """Where collective tensors live: the current CUDA device for NCCL, else the CPU."""

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------- collectives
@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:  # DistBackendError, gloo/NCCL errors, timeouts
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        timeout = f"{_timeout_s:g} s" if _timeout_s is not None else "the process group's timeout"
        msg = (
            f"rank {get_rank()} of {get_world_size()}: torch.distributed {what} failed ({first}); another rank "
            f"stopped (see its error) or did not reach this step within {timeout}. This rank stops too."
        )
        raise PeerFailureError(msg) from exc


def all_reduce_tensor(tensor: torch.Tensor, *, op: str = "sum", what: str = "all_reduce") -> torch.Tensor:
    """``torch.distributed.all_reduce`` of ``tensor`` in place (``op``: ``"sum"``, ``"max"``, ``"min"``).

    The tensor is moved to the collective device (CUDA for NCCL) and back.
    Without a process group of more than one rank it is returned unchanged.

    Returns:
        ``tensor`` (reduced in place; the same object).

    Raises:
        DistributedError: the collective failed (another rank stopped or timed out).
        ValueError: unknown ``op``.
    """

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        msg = f"op must be one of {', '.join(ops)}, got {op!r}"
        raise ValueError(msg)
    if not is_distributed():
        return tensor
    device = _device()
    work = tensor if tensor.device == device else tensor.to(device)
    with _collective(what):
        dist.all_reduce(work, op=ops[op])
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_gather_ints(values: Sequence[int], *, what: str = "all_gather") -> list[list[int]]:
    """Every rank's ``values`` (int64, the same length on every rank), indexed by rank.

    Without a process group: ``[list(values)]``.

    Raises:
        DistributedError: the collective failed.
    """

    if not is_distributed():
        return [list(values)]
    device = _device()
    local = torch.tensor(list(values), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    with _collective(what):
        dist.all_gather(gathered, local)
    return [g.cpu().tolist() for g in gathered]


def all_gather_rows(rows: torch.Tensor, *, what: str = "all_gather") -> torch.Tensor:
    """Every rank's ``rows`` ``[n_rank, *shape]`` concatenated in rank order: ``[sum of n_rank, *shape]``.

    ``shape`` and the dtype must be the same on every rank; ``n_rank`` may differ (0 included). With the contiguous
    slices of :func:`shard`, rows kept one per calibration window come back in the windows' order. Without a process
    group: ``rows``.

    Raises:
        DistributedError: the collective failed.
    """
    if not is_distributed():
        return rows
    counts = [c[0] for c in all_gather_ints([rows.shape[0]], what=what)]
    device = _device()
    padded = torch.zeros((max(counts), *rows.shape[1:]), dtype=rows.dtype, device=device)
    padded[: rows.shape[0]] = rows.to(device)
    gathered = [torch.empty_like(padded) for _ in counts]
    with _collective(what):
        dist.all_gather(gathered, padded)
    return torch.cat([g[:n] for g, n in zip(gathered, counts, strict=True)]).to(rows.device)


def all_reduce_accumulator(accumulator: Any) -> None:
    """Sum a statistics accumulator over every rank, in place (a collective: every rank must call it).

    The accumulator implements ``all_reduce()`` (e.g.
    :meth:`llmc_fsm.toolkit.obs.HessianAccumulator.all_reduce`), which reduces its
    sufficient statistics and restores its own normalisation, so that it then
    holds what one process that saw every rank's inputs would hold (equal up
    to float rounding, identical on every rank).

    Raises:
        TypeError: the accumulator has no ``all_reduce()`` (raised on every rank alike).
        DistributedError: the collective failed.
    """
    reduce = getattr(accumulator, "all_reduce", None)
    if not callable(reduce):
        msg = (
            f"{type(accumulator).__name__} has no all_reduce(): a statistics accumulator must implement "
            "all_reduce() (sum its statistics over the ranks) to calibrate under torch.distributed"
        )
        raise TypeError(msg)
    reduce()


def reduce_statistics(
    accumulators: dict[str, Any], modules: dict[str, Any], new_accumulator: Callable[[Any], Any], *, owner: str
) -> None:
    """Sum the calibration accumulators of ``modules`` over every rank, in place in ``accumulators``.

    Every rank calls this with the same module names (one decoder layer's targets). A rank
    without an accumulator for a module the others saw inputs for (data-dependent routing,
    e.g. mixture-of-experts) contributes an empty one (``new_accumulator(module)``). Which
    modules share an accumulator is agreed on first with one ``all_reduce`` of a small int64
    vector, then each shared accumulator is reduced once (:func:`all_reduce_accumulator`).

    Raises:
        DistributedError: ranks disagree on which modules share statistics (the message starts with
            ``owner``), or a collective failed.
    """
    names = list(modules)
    if not names:
        return
    first: dict[int, int] = {}
    leader = []  # per name: index of the first name sharing its accumulator, -1 without samples
    for i, name in enumerate(names):
        acc = accumulators.get(name)
        leader.append(-1 if acc is None or acc.num_samples == 0 else first.setdefault(id(acc), i))
    n = len(names)
    table = torch.tensor(leader + [-x if x >= 0 else -n - 1 for x in leader], dtype=torch.int64)
    all_reduce_tensor(table, op="max", what="all_reduce (statistics layout)")
    agreed, lowest = table[:n].tolist(), [-x for x in table[n:].tolist()]
    if any(a >= 0 and lo <= n and lo != a for a, lo in zip(agreed, lowest, strict=True)):
        msg = (
            f"{owner}: ranks disagree on which targets share calibration inputs "
            f"({', '.join(names)}); every rank must run the same model code"
        )
        raise DistributedError(msg)
    for i, name in enumerate(names):
        if agreed[i] >= 0 and leader[i] < 0:  # no samples here: an empty accumulator, shared like elsewhere
            lead = names[agreed[i]]
            accumulators[name] = new_accumulator(modules[name]) if agreed[i] == i else accumulators[lead]
    for i, name in enumerate(names):
        if agreed[i] == i:
            all_reduce_accumulator(accumulators[name])


def broadcast_tensor(tensor: torch.Tensor, *, src: int, what: str = "broadcast") -> torch.Tensor:
    """``torch.distributed.broadcast`` of ``tensor`` from rank ``src``, in place (moved to the collective device and
    back when it lives elsewhere). Without a process group of more than one rank: unchanged.

    Any dtype, bit for bit: one the backends lack (float8, int16, uint16/32/64: gloo raised "Invalid scalar type"
    for FP8_DYNAMIC's float8 zero points, found by a tester) travels as the ``uint8`` bytes of the same storage.

    Returns:
        ``tensor`` (the same object, holding rank ``src``'s values).

    Raises:
        DistributedError: the collective failed.
    """
    if not is_distributed():
        return tensor
    device = _device()
    work = tensor if tensor.device == device and tensor.is_contiguous() else tensor.to(device).contiguous()
    wire = work if work.dtype in _WIRE_DTYPES else work.reshape(-1).view(torch.uint8)  # the same bytes
    with _collective(what):
        dist.broadcast(wire, src=src)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def broadcast_values(values: Sequence[float], *, src: int, what: str = "broadcast") -> list[float]:
    """Rank ``src``'s ``values`` (float64; the same length on every rank) on every rank."""
    if not is_distributed():
        return list(values)
    flat = torch.tensor([float(v) for v in values], dtype=torch.float64)
    return broadcast_tensor(flat, src=src, what=what).tolist()


def sweep_cost(weight_shape: Sequence[int]) -> int:
    """The cost of an OBS sweep over a ``[rows, columns]`` weight, in multiply-adds up to a constant:
    ``rows * columns ** 2`` (each of the ``columns`` steps updates the ``rows x remaining columns`` block; the
    Cholesky factor costs ``columns ** 3``, shared by the modules of one input)."""
    rows, columns = int(weight_shape[0]), int(weight_shape[-1])
    return rows * columns * columns


def assign_to_ranks(costs: Sequence[int], world_size: int, loads: list[int] | None = None) -> list[int]:
    """The rank that does each unit of work: longest first, each to the rank with the least work so far.

    Deterministic (ties: the earlier unit first, the lower rank), so every rank computes the same assignment from
    the same ``costs``; the largest load is at most 4/3 of the best possible (Graham's LPT bound).

    Args:
        costs: per unit of work, its cost (e.g. :func:`sweep_cost`).
        world_size: ranks.
        loads: per rank, the work it already has (updated in place: a caller assigning the work of one decoder
            layer group by group keeps the ranks balanced over the layer); default: none.

    Returns:
        ``owner[i]`` for each unit ``i``.

    Raises:
        ValueError: ``world_size < 1``, a negative cost, or ``loads`` of another length than ``world_size``.
    """
    if world_size < 1 or any(c < 0 for c in costs) or (loads is not None and len(loads) != world_size):
        msg = f"need world_size >= 1 and costs >= 0, got world_size={world_size}, costs={list(costs)}"
        if loads is not None and world_size >= 1 and len(loads) != world_size:
            msg = f"loads must hold one value per rank ({world_size}), got {len(loads)}"
        raise ValueError(msg)
    load = loads if loads is not None else [0] * world_size
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += costs[i]
    return owner


def rank_work(modifiers: Iterable[Any]) -> list[dict[str, Any]]:
    """What each rank compressed, summed over ``modifiers``' ``work_shares`` (``{module: (rank, cost, seconds)}``,
    kept by :class:`~llmc_fsm.toolkit.calibrated.CalibratedModifier` when several ranks share the work).

    Returns:
        Per rank ``{"modules": int, "cost": float (rows x columns²), "seconds": float}``; ``[]`` when no work was
        shared (one process, or modifiers that compress every module on every rank). When some modules of a
        sharing modifier were compressed on every rank anyway (``compressed_on_every_rank``: fused experts'
        matrices under a quantizer), each rank's entry also holds ``"every_rank": int``, their number.
    """
    modifiers = list(modifiers)
    shares = [share for m in modifiers for share in (getattr(m, "work_shares", None) or {}).values()]
    if not shares:
        return []
    replicated = sum(len(getattr(m, "compressed_on_every_rank", None) or ()) for m in modifiers)
    world = max(get_world_size(), 1 + max(rank for rank, _, _ in shares))
    out = [{"modules": 0, "cost": 0.0, "seconds": 0.0} for _ in range(world)]
    for rank, cost, seconds in shares:
        out[rank]["modules"] += 1
        out[rank]["cost"] += float(cost)
        out[rank]["seconds"] += float(seconds)
    if replicated:
        for entry in out:
            entry["every_rank"] = replicated
    return out


def check_same_values(values: dict[str, Sequence[float]], *, what: str) -> None:
    """Raise on every rank if any entry of ``values`` differs between ranks (one collective).

    ``values`` is ``{name: numbers}`` with the same names and lengths on every
    rank (e.g. checksums of the weights each rank computed). Compared exactly.

    Raises:
        DistributedError: naming the entries that differ (the same message on every rank), or a failed collective.
    """
    if not is_distributed() or not values:
        return
    names = list(values)
    flat = torch.tensor([float(v) for name in names for v in values[name]], dtype=torch.float64)
    both = torch.cat([flat, -flat])
    all_reduce_tensor(both, op="max", what=f"all_reduce ({what} check)")
    hi, neg_lo = both[: flat.numel()], both[flat.numel() :]
    differs = (hi != -neg_lo).tolist()
    bad, pos = [], 0
    for name in names:
        n = len(values[name])
        if any(differs[pos : pos + n]):
            bad.append(name)
        pos += n
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        msg = (
            f"ranks computed different {what} for {len(bad)} module(s) ({shown}) from the same reduced statistics: "
            "their arithmetic differs (different device kinds, library versions or thread settings); run every rank "
            "on the same kind of device with the same software"
        )
        raise DistributedError(msg)


# --------------------------------------------------------------------------- calibration data
def split_counts(total: int, world_size: int) -> list[int]:
    """Items per rank for a contiguous split of ``total`` items: the first ``total mod world_size`` ranks get one more.

    Rank ``r`` takes items ``[sum(counts[:r]), sum(counts[:r + 1]))``.

    Raises:
        ValueError: ``world_size < 1`` or ``total < 0``.
    """
    if world_size < 1 or total < 0:
        msg = f"need world_size >= 1 and total >= 0, got world_size={world_size}, total={total}"
        raise ValueError(msg)
    base, extra = divmod(total, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def _digest(data: bytes) -> int:
    """A signed 64-bit digest of ``data`` (sha256, first 8 bytes)."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big", signed=True)


def shard(windows: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """This rank's contiguous slice of the calibration windows, and every rank's count.

    Args:
        windows: ``LongTensor[N, L]``, the same on every rank (checked: one
            collective over a digest of the tensor).

    Returns:
        ``(windows[start:end], counts)``: ``counts[r]`` windows for rank ``r``
        (:func:`split_counts`). Without a process group: ``(windows, [N])``.
        ``N == 0`` (data-free runs) is returned as is on every rank.

    Raises:
        ValueError: fewer windows than ranks, or ranks holding different windows
            (the same message on every rank).
        DistributedError: the collective failed.
    """
    total = int(windows.shape[0])
    world = get_world_size()
    if not is_distributed() or total == 0:
        return windows, [total]
    header = repr((tuple(windows.shape), str(windows.dtype))).encode()
    digest = _digest(header + windows.cpu().contiguous().numpy().tobytes())
    table = all_gather_ints([digest], what="all_gather (calibration data check)")
    differ = [r for r, (d,) in enumerate(table) if d != table[0][0]]
    if differ:
        msg = (
            f"ranks hold different calibration windows (rank(s) {', '.join(map(str, differ))} differ from rank 0): "
            "every rank must load the same data, which is then split between them; give every rank the same "
            "dataset, sizes and seed"
        )
        raise ValueError(msg)
    if total < world:
        msg = (
            f"{total} calibration window(s) cannot be split across {world} ranks (each rank needs at least one): "
            f"use at least {world} samples (--num-samples) or fewer ranks"
        )
        raise ValueError(msg)
    counts = split_counts(total, world)
    start = sum(counts[: get_rank()])
    return windows[start : start + counts[get_rank()]], counts


# --------------------------------------------------------------------------- the CLI under torchrun
#: Seconds a rank other than 0 waits for rank 0's error line (:func:`error_line_to_print`) before it prints its own.
ERROR_WAIT_S = 10.0
_ERROR_KEY = "llmc_fsm/error/rank0"


def error_line_to_print(line: str, exc: BaseException, *, wait_s: float | None = None) -> str | None:
    """What this rank prints for the error ``exc`` that stops it (``line``: the command's one line for it), so that
    an error every rank raises alike is said once and one rank's own error is said at all.

    Without a process group of more than one rank, and on rank 0: ``line`` (rank 0 also leaves it in the process
    group's key-value store for the others). On another rank: ``None`` when ``exc`` comes from another rank's
    failure (:func:`peer_failure`: rank 0 says it) or when rank 0 left the same line within ``wait_s`` seconds
    (default :data:`ERROR_WAIT_S`; an error every rank raises alike: a recipe's, a refusal at ``initialize``), else
    ``"rank N: " + line`` (its own: a model or data file missing on its node, a crash; until 2026-12-07 only rank 0
    printed, so such an error was never shown, found by a tester). A store that cannot be reached counts as a
    different line. Never raises.
    """
    if not is_distributed():
        return line
    rank = get_rank()
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # no store to share lines through: each rank says its own
        store = None
    if rank == 0:
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(_ERROR_KEY, line)
        return line
    if peer_failure(exc) is not None:
        return None
    if store is not None:
        deadline = time.monotonic() + (ERROR_WAIT_S if wait_s is None else wait_s)
        with contextlib.suppress(Exception):  # rank 0's store gone with it: say it here
            while not store.check([_ERROR_KEY]) and time.monotonic() < deadline:  # store.wait logs its timeout
                time.sleep(0.05)
            if store.check([_ERROR_KEY]) and store.get(_ERROR_KEY).decode("utf-8") == line:
                return None
    return f"rank {rank}: {line}"


_INTERRUPT_KEY = "llmc_fsm/interrupted/rank0"


def note_interrupt() -> None:
    """On rank 0 of a process group of several ranks: leave in the group's key-value store that rank 0 was
    interrupted (Ctrl-C, SIGTERM), for :func:`interrupt_line_to_print` on the others; elsewhere nothing. Called by
    the CLI's signal handler, as soon as the signal is handled. Never raises."""
    if is_distributed() and get_rank() == 0:
        with contextlib.suppress(Exception):
            dist.distributed_c10d._get_default_store().set(_INTERRUPT_KEY, "1")


def interrupt_line_to_print(line: str, *, wait_s: float | None = None) -> str | None:
    """What this rank prints when it is interrupted (``line``: the command's one line for it), so that an interrupt
    reaching every rank (Ctrl-C under torchrun) is said once, by rank 0, and one reaching a single rank is said by it.

    Without a process group of more than one rank, and on rank 0: ``line`` (rank 0 also calls :func:`note_interrupt`).
    On another rank: ``None`` when rank 0 was interrupted too (its note in the store within ``wait_s`` seconds,
    default :data:`ERROR_WAIT_S`), else ``"rank N: " + line`` (a scheduler's or the OOM killer's SIGTERM to one rank:
    until 2026-12-07 that rank printed nothing and rank 0 blamed "another rank", found by a tester). A store that
    cannot be reached counts as rank 0 not interrupted. Never raises.
    """
    if not is_distributed():
        return line
    rank = get_rank()
    if rank == 0:
        note_interrupt()
        return line
    deadline = time.monotonic() + (ERROR_WAIT_S if wait_s is None else wait_s)
    with contextlib.suppress(Exception):  # rank 0's store gone with it: say it here
        store = dist.distributed_c10d._get_default_store()
        while not store.check([_INTERRUPT_KEY]) and time.monotonic() < deadline:  # store.wait logs its timeout
            time.sleep(0.05)
        if store.check([_INTERRUPT_KEY]):
            return None
    return f"rank {rank}: {line}"


def _env_number(name: str, cast: Any, default: Any) -> Any:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = cast(raw)
    except ValueError:
        value = None
    if value is None or value <= 0:
        msg = f"environment variable {name} must be a positive number, got {raw!r}"
        raise ValueError(msg)
    return value


@contextlib.contextmanager
def process_group_from_env() -> Iterator[bool]:
    """Initialize the default process group when launched by ``torchrun`` with more than one rank; destroy it on exit.

    Launched by ``torchrun`` means ``WORLD_SIZE`` (> 1), ``RANK`` and
    ``MASTER_ADDR`` are set; the rendezvous is torchrun's (``init_method="env://"``).
    Backend: NCCL when CUDA is available (device ``LOCAL_RANK``), else gloo.
    Collective timeout: ``$LLMC_FSM_DIST_TIMEOUT`` seconds (default
    :data:`DEFAULT_TIMEOUT_S`). If ``$LLMC_FSM_WORLD_SIZE`` is set, every rank
    checks it against the group's size right away (one ``all_gather``), before
    any work. Does nothing when a process group already exists or the
    environment names a single process (where ``$LLMC_FSM_WORLD_SIZE``, if set, must be 1).

    Yields:
        Whether this context created a process group.

    Raises:
        ValueError: a bad environment variable, or a world size other than the expected one (also without
            torchrun: ``$LLMC_FSM_WORLD_SIZE`` above 1 in a process started alone).
    """

    global _timeout_s
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    expected = _env_number(WORLD_SIZE_ENV, int, None)
    if dist.is_available() and dist.is_initialized():
        yield False
        return
    if world <= 1 or "RANK" not in os.environ or not dist.is_available():
        if expected is not None and expected != 1:  # it was ignored, and the run went on in one process (a tester)
            msg = (
                f"{WORLD_SIZE_ENV} expects world size {expected} but this process runs alone, without torchrun "
                f"(WORLD_SIZE {os.environ.get('WORLD_SIZE') or 'unset'}): launch it with torchrun --nproc-per-node "
                f"... so that the ranks add up to {expected}, or unset {WORLD_SIZE_ENV}"
            )
            raise ValueError(msg)
        yield False
        return
    timeout = float(_env_number(TIMEOUT_ENV, float, DEFAULT_TIMEOUT_S))
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, init_method="env://", timeout=timedelta(seconds=timeout))
    _timeout_s = timeout
    try:
        if expected is not None:
            table = all_gather_ints([expected], what="all_gather (world size check)")
            values = sorted({row[0] for row in table})
            if values != [get_world_size()]:
                msg = (
                    f"{WORLD_SIZE_ENV} expects world size {', '.join(map(str, values))} but torchrun started "
                    f"{get_world_size()} ranks; fix --nnodes/--nproc-per-node or {WORLD_SIZE_ENV}"
                )
                raise ValueError(msg)
        logger.info("process group: rank %d of %d (%s)", get_rank(), get_world_size(), backend)
        yield True
    finally:
        _timeout_s = None
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
