"""Test code that runs under ``torchrun``: a function run on several CPU processes joined in one gloo group.

:func:`run_ranks` starts ``world_size`` processes (``torch.multiprocessing``, spawn), each joins a
``torch.distributed`` gloo process group through a file rendezvous in a directory, runs the worker and writes what it
returns to ``rank<r>.safetensors`` in that directory (tensors as safetensors, the rest as JSON in its metadata); the
test process reads the files and compares the ranks with each other and with a one-process run::

    def _worker(rank, directory, tensors):          # module level: the spawned ranks import it by name
        model = tiny_model()
        llmc_fsm.oneshot(model=model, dataset=windows(), progress=False)
        tensors.update(model.state_dict())          # compared bit for bit in the test
        return {"per_rank": model.llmc_fsm_report.calibration["per_rank"]}   # anything JSON can hold

    def test_two_ranks(tmp_path):
        ranks = run_ranks(_worker, tmp_path)
        assert all("error" not in rank["meta"] for rank in ranks)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

__all__ = ["Worker", "run_ranks"]

#: ``worker(rank, directory, tensors) -> result``: runs on every rank inside the process group; fills ``tensors``
#: (``{name: tensor}``, written with safetensors) and returns something JSON can hold.
Worker = Callable[[int, Path, dict[str, torch.Tensor]], Any]


def _start_line(directory: Path, rank: int, world_size: int) -> None:
    """Wait (without a timeout: the parent's ``join_s`` bounds it) until every rank has started, so that the group's
    timeout measures the ranks' work, not how long each spawned process took to import torch."""
    (directory / f"started-{rank}").touch()
    while not all((directory / f"started-{r}").exists() for r in range(world_size)):
        time.sleep(0.02)


def _rank_main(rank: int, world_size: int, directory: str, worker: Worker, timeout_s: float) -> None:
    """One rank: join the gloo group, run ``worker``, write ``rank<r>.safetensors`` (tensors + JSON metadata)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    _start_line(Path(directory), rank, world_size)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{directory}/rendezvous",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"rank": rank}
    t0 = time.perf_counter()
    try:
        meta["result"] = worker(rank, Path(directory), tensors)
    except Exception as exc:
        meta["error"] = {"type": type(exc).__name__, "message": str(exc)}
    meta["seconds"] = time.perf_counter() - t0
    meta["finished_at"] = time.time()
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        f"{directory}/rank{rank}.safetensors",
        metadata={"json": json.dumps(meta)},
    )
    if "error" not in meta:
        dist.barrier()  # leave together
    # The results are on disk. End the process without interpreter teardown: gloo's worker threads can abort
    # (SIGABRT, "terminate called without an active exception") while the process group is destroyed or the
    # interpreter finalizes (pytorch/pytorch#179291), which would fail a test whose ranks all did their work.
    os._exit(0)


def run_ranks(
    worker: Worker,
    directory: str | os.PathLike[str],
    *,
    world_size: int = 2,
    timeout_s: float = 60.0,
    join_s: float = 180.0,
) -> list[dict[str, Any]]:
    """Run ``worker`` on ``world_size`` spawned processes in one gloo process group; return what each rank wrote.

    Each rank runs with one torch thread, waits until every rank has started (a file ``started-<r>`` each: the
    time a spawned process takes to import torch, which varies with the machine's load, counts toward no timeout),
    joins the group through the file rendezvous ``<directory>/rendezvous`` with the collective timeout
    ``timeout_s``, calls ``worker(rank, Path(directory), tensors)`` and writes
    ``<directory>/rank<r>.safetensors``; a rank whose worker returned waits at a barrier for the others, then every
    rank exits at once (``os._exit(0)``, see the source). ``worker`` must be importable by name (a module-level
    function): the ranks are spawned, not forked.

    Args:
        worker: see :data:`Worker`.
        directory: an empty directory (``tmp_path``); the ranks' files go there.
        world_size: number of ranks (processes).
        timeout_s: the process group's collective timeout, seconds.
        join_s: how long the ranks may run, seconds, all together; after it they are killed.

    Returns:
        Per rank, in rank order: ``{"meta", "tensors", "exitcode"}``. ``meta`` is ``None`` when the rank wrote
        nothing (it died); else ``{"rank", "result"`` (what ``worker`` returned) or ``"error"`` (``{"type",
        "message"}`` of the exception it raised), ``"seconds"`` (the worker's wall time), ``"finished_at"``
        (``time.time()`` when it returned or raised)``}``. ``tensors`` is what it put in ``tensors`` (empty when it
        died); ``exitcode`` the process's exit status.

    Raises:
        AssertionError: a rank was still running after ``join_s`` (every rank is killed first), naming the pids.
    """
    ctx = mp.get_context("spawn")
    where = os.fspath(directory)
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, where, worker, timeout_s)) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + join_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if hung:
        msg = f"ranks still running after {join_s} s: pids {hung}"
        raise AssertionError(msg)
    out: list[dict[str, Any]] = []
    for rank, p in enumerate(procs):
        path = Path(where) / f"rank{rank}.safetensors"
        if not path.exists():
            out.append({"meta": None, "tensors": {}, "exitcode": p.exitcode})
            continue
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["json"])
        out.append({"meta": meta, "tensors": load_file(str(path)), "exitcode": p.exitcode})
    return out
