"""Session 39, torch.distributed findings of a tester: ranks whose weights differ outside a sample, ranks loaded in
other dtypes, SIGTERM to one rank, and the advice when --resume is refused under several processes."""

from __future__ import annotations

import contextlib
import hashlib
import io
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_llama import llama

from llmc_fsm import Session
from llmc_fsm.oneshot_job import phases
from llmc_fsm.oneshot_job.settings import OneshotSettings, default_recipe
from llmc_fsm.session import ranks as ranks_module
from llmc_fsm.session.ranks import _tensor_checksum
from llmc_fsm.testing import run_ranks

pytest.importorskip("transformers")

TAIL = (
    "Every rank must run the same recipe on the same model; launch them with the same arguments. No modifier was "
    "initialized."
)
HEAD = "initialize() refused on every rank of the process group (2 ranks): "
GATE = "model.layers.0.mlp.gate_proj.weight"


@pytest.fixture
def one_thread(monkeypatch):
    """Spawned ranks with one torch thread each."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def reference_checksum(tensor: torch.Tensor, chunk_words: int) -> int:
    """The checksum the docs describe, in plain Python ints: the bytes zero-padded to 4, as little-endian int32
    words x, chunks c of ``chunk_words`` words, sum_c M_c * sum_j W_j * x[c, j] modulo 2**64 (signed)."""
    mod = 1 << 64
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    data += bytes(-len(data) % 4)
    words = [int.from_bytes(data[i : i + 4], "little", signed=True) for i in range(0, len(data), 4)]
    total = 0
    for c, begin in enumerate(range(0, len(words), chunk_words)):
        part = sum((((j + 1) * 0x9E3779B97F4A7C15) % mod | 1) * x for j, x in enumerate(words[begin:][:chunk_words]))
        total += part * (((c + 1) * 0xC2B2AE3D27D4EB4F) % mod | 1)
    total %= mod
    return total - mod if total >= mod // 2 else total


def shown(checksum: int) -> str:
    """The 8 hex digits a refusal shows for a parameter: sha256 of the checksum's 8 little-endian bytes, the low 32
    bits of its first 8 bytes."""
    return hashlib.sha256(checksum.to_bytes(8, "little", signed=True)).hexdigest()[8:16]


def off_sample_copy(model: torch.nn.Module) -> None:
    """Triple layer 0's gate_proj everywhere but on the strided sample the check read until 2026-12-07 (every
    ``ceil(numel / 4096)``-th value): the tester's perturb.py, on the tiny Llama."""
    with torch.no_grad():
        flat = model.get_parameter(GATE).view(-1)
        step = -(-flat.numel() // 4096)
        off = torch.arange(flat.numel()) % step != 0
        flat[off] *= 3.0


# --------------------------------------------------------------------------- workers (rank side)
def _off_sample_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    model = llama()
    if rank == 1:
        off_sample_copy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    session = Session(default_recipe("sparsegpt", 0.5))
    try:
        session.initialize(model=model, calibration_data=torch.zeros(4, 8, dtype=torch.long))
    except ValueError as exc:
        said = str(exc)
    else:
        said = None
    unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return {"said": said, "unchanged": unchanged, "lifecycle": session.lifecycle}


def _dtype_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    model = llama() if rank == 0 else llama().to(torch.bfloat16)  # rank 1 given --dtype bfloat16
    try:
        Session(default_recipe("sparsegpt", 0.5)).initialize(
            model=model, calibration_data=torch.zeros(4, 8, dtype=torch.long)
        )
    except ValueError as exc:
        return {"said": str(exc)}
    return {"said": None}


def _interrupt(signum: int, *, after_s: float) -> tuple[int, str]:
    """Run :func:`interrupted` for ``signum`` raised in this rank's main thread ``after_s`` seconds from now:
    (exit status, what it printed on stderr)."""
    from llmc_fsm.cli.oneshot import interrupted, signals_as_interrupt

    err = io.StringIO()
    try:
        with signals_as_interrupt():
            time.sleep(after_s)
            signal.raise_signal(signum)
            time.sleep(30)  # the handler raises before this ends
    except KeyboardInterrupt as exc:
        with contextlib.redirect_stderr(err):
            status = interrupted("oneshot", exc)
    else:
        status = -1
    return status, err.getvalue()


def _interrupt_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    import torch.distributed as dist

    from llmc_fsm.toolkit import distributed

    distributed.ERROR_WAIT_S = 2.0  # how long rank 1 waits for rank 0's note (10 s by default)
    out: dict[str, Any] = {}
    if rank == 1:  # a scheduler's SIGTERM to rank 1 alone
        out["one"] = _interrupt(signal.SIGTERM, after_s=0.0)
    else:
        out["one"] = (None, "")
    dist.barrier()
    distributed.ERROR_WAIT_S = 20.0  # Ctrl-C to every rank, rank 0 handling it 1 s after rank 1
    out["every"] = _interrupt(signal.SIGINT, after_s=1.0 if rank == 0 else 0.0)
    return out


# --------------------------------------------------------------------------- tests
def test_the_weights_checksum_covers_every_byte_in_chunks(monkeypatch):
    """Found by a tester: the check at initialize digested a strided sample of 4096 values per parameter, so ranks
    whose weights differed elsewhere were mixed silently. The checksum now reads every byte: it equals the documented
    formula (any dtype, a tensor that is not contiguous, a ragged end, several chunks), and changes with any value,
    a swap, and an even number of sign flips of the odd elements (which change only the top bit of 64-bit words)."""
    tensors = [
        torch.randn(7, 5, generator=torch.Generator().manual_seed(0)),
        torch.randn(3, 3, generator=torch.Generator().manual_seed(1)).bfloat16(),
        torch.arange(11, dtype=torch.uint8),
        torch.randn(6, 4, generator=torch.Generator().manual_seed(2)).t(),
        torch.randn(21, generator=torch.Generator().manual_seed(3))[3:],
    ]
    for chunk in (ranks_module.CHUNK_WORDS, 3, 1):
        monkeypatch.setattr(ranks_module, "CHUNK_WORDS", chunk)
        for t in tensors:
            assert _tensor_checksum(t) == reference_checksum(t, chunk), (t.dtype, tuple(t.shape), chunk)
    monkeypatch.setattr(ranks_module, "CHUNK_WORDS", 2)
    base = torch.randn(64, generator=torch.Generator().manual_seed(4))
    seen = {_tensor_checksum(base)}
    for i in range(64):
        changed = base.clone()
        changed[i] = changed[i] * 3.0
        seen.add(_tensor_checksum(changed))
    swapped = base.clone()
    swapped[[0, 63]] = base[[63, 0]]
    seen.add(_tensor_checksum(swapped))
    flipped = base.clone()
    flipped[1::2] = -flipped[1::2]  # 32 sign flips
    seen.add(_tensor_checksum(flipped))
    assert len(seen) == 67


@pytest.mark.distributed
def test_ranks_whose_weights_differ_outside_a_sample_are_refused(tmp_path, one_thread):
    """Found by a tester: rank 1 on a copy whose layer-0 gate_proj differed outside the strided sample of 4096
    values passed the check at initialize (exit 0, a normal report, 23 of 28 weights unlike one process's: a mixed
    model). Every byte is checksummed now: refused on both ranks, naming the tensor and each rank's checksum."""
    ranks = run_ranks(_off_sample_worker, tmp_path, world_size=2, timeout_s=60.0, join_s=180.0)
    assert all(r["exitcode"] == 0 and "error" not in r["meta"] for r in ranks), [r["meta"] for r in ranks]
    gates = []
    for rank in range(2):
        model = llama()
        if rank == 1:
            off_sample_copy(model)
        gates.append(shown(reference_checksum(model.get_parameter(GATE), 1 << 20)))
    assert gates[0] != gates[1]  # the tester's copy changed every 2nd float32: only the high half of 64-bit words
    expected = (
        f"{HEAD}the ranks loaded different weights (the first that differs is {GATE}, digest per rank — rank 0: "
        f"{gates[0]}; rank 1: {gates[1]}): each rank must load the same checkpoint (a copy on another node "
        f"that differs, or another checkpoint of the same architecture, gives other weights). {TAIL}"
    )
    for r in ranks:
        assert r["meta"]["result"] == {"said": expected, "unchanged": True, "lifecycle": "created"}


@pytest.mark.distributed
def test_ranks_loaded_in_other_dtypes_are_told_the_dtypes(tmp_path, one_thread):
    """Found by a tester: rank 1 given --dtype bfloat16 was refused with "the model's parameter names/shapes differ
    between ranks", which named neither. The refusal now says the dtypes differ, with each rank's count per dtype."""
    ranks = run_ranks(_dtype_worker, tmp_path, world_size=2, timeout_s=60.0, join_s=180.0)
    count = len(list(llama().parameters()))
    expected = (
        f"{HEAD}the model's parameter dtypes differ between ranks (parameters per dtype — rank 0: {count} float32; "
        f"rank 1: {count} bfloat16): each rank must load the model in the same dtype (the same --dtype / "
        f"torch_dtype). {TAIL}"
    )
    assert [r["meta"]["result"] for r in ranks] == [{"said": expected}, {"said": expected}]


@pytest.mark.distributed
def test_sigterm_to_one_rank_is_said_by_that_rank_and_ctrl_c_to_all_once(tmp_path, one_thread):
    """Found by a tester: SIGTERM to rank 1 alone (a scheduler, the OOM path) made it exit 143 printing nothing
    (only rank 0 printed an interruption), while rank 0 blamed "another rank stopped (see its error)". That rank
    now says it, prefixed "rank 1: "; Ctrl-C reaching every rank is still said once, by rank 0, although rank 1
    handles it first."""
    ranks = run_ranks(_interrupt_worker, tmp_path, world_size=2, timeout_s=60.0, join_s=180.0)
    assert all(r["exitcode"] == 0 and "error" not in r["meta"] for r in ranks), [r["meta"] for r in ranks]
    one, every = ([r["meta"]["result"][k] for r in ranks] for k in ("one", "every"))
    assert one == [[None, ""], [143, "rank 1: llmc-fsm oneshot: interrupted (SIGTERM); nothing written\n"]]
    assert every == [[130, "llmc-fsm oneshot: interrupted (Ctrl-C); nothing written\n"], [130, ""]]


def test_resume_refused_under_torchrun_names_the_directory_to_remove(tmp_path, monkeypatch):
    """Found by a tester: --resume under torchrun said "resume the run in one process, or start it again without
    --resume", and starting it again was refused for the progress left. The advice now names the work directory to
    remove first."""
    monkeypatch.setattr(phases, "is_distributed", lambda: True)
    settings = OneshotSettings(output_dir=str(tmp_path / "out"), resume=True)
    with pytest.raises(ValueError) as err:
        phases._check_output(settings)
    assert str(err.value) == (
        "resume (--resume) is not supported with several processes (torch.distributed): resume the run in one "
        f"process (without torchrun), or remove {str(tmp_path.resolve() / '.out.work')!r} and start it again "
        "without --resume"
    )
