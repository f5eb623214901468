"""Several processes with torch.distributed (gloo, CPU): one-shot and DDP training match one process.

Tests marked ``distributed`` start 2 processes (``torch.multiprocessing``, spawn) that
join a gloo process group through a file rendezvous in ``tmp_path``; each rank writes
its results (tensors as safetensors, the rest as JSON in the metadata) and the test
compares them with each other and with a single-process run in the test process.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_s39_distributed import reference_checksum, shown
from tiny_llama import llama

import llmc_fsm
from llmc_fsm import Session
from llmc_fsm.oneshot_job.settings import default_recipe
from llmc_fsm.recipes.fingerprint import recipe_fingerprint
from llmc_fsm.session.ranks import _recipe_digest, check_ranks_agree, unwrap_model
from llmc_fsm.testing import run_ranks
from llmc_fsm.toolkit.distributed import get_rank, get_world_size, is_distributed, is_main_process, shard, split_counts

WORLD = 2
RECIPES = {
    "sparsegpt": default_recipe("sparsegpt", 0.5),
    "wanda": default_recipe("wanda", 0.5),
    "gptq": default_recipe("gptq", scheme="W4A16", group_size=32),
}


def windows(n: int = 8, length: int = 32) -> torch.Tensor:
    return torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(1))


def linears(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    modules = model.named_modules()
    return {n: m.weight.detach().clone() for n, m in modules if isinstance(m, torch.nn.Linear) and n != "lm_head"}


# --------------------------------------------------------------------------- process launcher (test side)
def launch(worker: str, tmp_path: Path, *, timeout_s: float = 60.0, join_s: float = 180.0) -> list[dict[str, Any]]:
    """Run ``WORKERS[worker]`` on ``WORLD`` spawned ranks (:func:`llmc_fsm.testing.run_ranks`); per rank
    ``{"meta", "tensors", "exitcode"}``."""
    return run_ranks(WORKERS[worker], tmp_path, world_size=WORLD, timeout_s=timeout_s, join_s=join_s)


@pytest.fixture
def one_thread(monkeypatch):
    """Spawned ranks and the single-process reference run with one torch thread each."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------- workers (rank side)
def _oneshot_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    from llmc_fsm_pruning.wanda import InputNormAccumulator

    from llmc_fsm.toolkit.obs import HessianAccumulator

    # The accumulators alone: each rank adds its half of the same tokens, then all_reduce.
    x = torch.randn(10, 3, 16, generator=torch.Generator().manual_seed(7))
    hess, norms = HessianAccumulator(16), InputNormAccumulator(16)
    for acc in (hess, norms):
        acc.add_batch(x[:6] if rank == 0 else x[6:])
        acc.all_reduce()
    tensors["acc/hessian"], tensors["acc/sq_norm"] = hess.hessian, norms.sq_norm
    info: dict[str, Any] = {"acc_samples": [hess.num_samples, norms.num_samples]}
    for name, recipe in RECIPES.items():
        model = llama()
        out = tmp / f"out-{name}-rank{rank}" if name == "sparsegpt" else None
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=windows(), batch_size=2, progress=False, output_dir=out)
        for n, w in linears(model).items():
            tensors[f"{name}/{n}"] = w
        info[name] = {"calibration": model.llmc_fsm_report.calibration, "table": model.llmc_fsm_report.format_table()}
    return info


def _mismatch_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    errors: dict[str, Any] = {}
    model = llama()
    before = linears(model)
    session = Session(default_recipe("sparsegpt", 0.5 if rank == 0 else 0.6))
    try:
        session.initialize(model=model, calibration_data=windows())
    except ValueError as exc:
        errors["recipe"] = str(exc)
    errors["lifecycle_after"] = session.lifecycle
    session = Session(default_recipe("sparsegpt", 0.5))
    try:
        session.initialize(model=model, calibration_data=windows(), world_size=3)
    except ValueError as exc:
        errors["world_size"] = str(exc)
    try:  # the one-shot job: refused before any compression, weights untouched
        llmc_fsm.oneshot(
            model=model, recipe=default_recipe("wanda", 0.5 if rank == 0 else 0.25), dataset=windows(), progress=False
        )
    except ValueError as exc:
        errors["oneshot"] = str(exc)
    errors["unchanged"] = all(torch.equal(w, before[n]) for n, w in linears(model).items())
    return errors


def _oneshot_where_rank_1_stops(rank: int, stop) -> None:
    """One-shot on 3 layers; rank 1 calls ``stop()`` when the second decoder layer is about to be compressed."""
    from llmc_fsm.toolkit.calibrated import CalibratedModifier

    if rank == 1:
        calls = []
        original = CalibratedModifier._compress_all

        def stopping(self, modules):
            calls.append(1)
            if len(calls) == 2:
                stop()
            return original(self, modules)

        CalibratedModifier._compress_all = stopping
    llmc_fsm.oneshot(model=llama(layers=3), dataset=windows(), batch_size=2, progress=False)


def _dying_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    _oneshot_where_rank_1_stops(rank, lambda: os._exit(3))  # rank 1 dies
    return {}


#: The group's collective timeout in the hanging-rank test, and the longest rank 1 stalls (seconds).
HANG_TIMEOUT_S, STALL_CAP_S = 5.0, 120.0


def _hanging_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    def stall() -> None:
        """Rank 1 stalls until rank 0 has written its result (at most STALL_CAP_S), and records how it ended."""
        reported = tmp / "rank0.safetensors"
        deadline = time.monotonic() + STALL_CAP_S
        while time.monotonic() < deadline and not reported.exists():
            time.sleep(0.05)
        (tmp / "stall.json").write_text(json.dumps({"rank_0_reported_during_the_stall": reported.exists()}))

    _oneshot_where_rank_1_stops(rank, stall)
    return {}


def _ddp_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    from llmc_fsm_pruning.masks import num_to_prune
    from torch.nn.parallel import DistributedDataParallel

    from llmc_fsm.integrations.torch import initialize, optimizer_step
    from llmc_fsm.toolkit.distributed import all_gather_ints

    recipe = {
        "train": {
            "MagnitudePruningModifier": {
                "init_sparsity": 0.2,
                "final_sparsity": 0.6,
                "start": 0,
                "end": 3,
                "update": 1,
                "targets": ["Linear"],
            }
        }
    }
    info: dict[str, Any] = {}
    for when in ("before_wrapping", "after_wrapping"):
        model = llama()
        session = Session(recipe)
        if when == "before_wrapping":
            session.update_state(model=model)
        ddp = DistributedDataParallel(model)
        if when == "after_wrapping":
            session.update_state(model=ddp)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        initialize(session, optimizer=optimizer, steps_per_epoch=2)
        targets = session.modifiers[0].resolved_targets
        steps, agree, sparsity = 6, [], []  # epochs 0, 1, 2: 0.2, 0.48, 0.59; the last batch_end: 0.6
        data = torch.Generator().manual_seed(100 + rank)  # each rank trains on its own batches
        for _ in range(steps):
            batch = torch.randint(0, 128, (2, 16), generator=data)
            session.batch_start(batch=batch)
            loss = session.loss_calculated(ddp(input_ids=batch, labels=batch).loss)
            loss.backward()
            optimizer_step(session, optimizer)
            session.batch_end()
            keep = torch.cat([(m.weight != 0).reshape(-1) for m in targets.values()])
            digest = int(torch.sum(keep.to(torch.int64) * torch.arange(1, keep.numel() + 1)))
            table = all_gather_ints([digest, int(keep.numel() - keep.sum())])
            agree.append(len({tuple(row) for row in table}) == 1)
            sparsity.append(table[0][1] / keep.numel())
        session.finalize()
        for n, w in linears(model).items():
            tensors[f"{when}/{n}"] = w
        info[when] = {
            "final_zeros": sum(int((m.weight == 0).sum()) for m in targets.values()),
            "expected_zeros": sum(num_to_prune(m.weight.numel(), 0.6) for m in targets.values()),
            "state_model_is_inner": session.state.model is model,
            "targets": sorted(targets),
            "agree": agree,
            "sparsity": sparsity,
        }
    return info


def _fsdp2_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """FSDP2's ``fully_shard`` (DTensor parameters): refused at initialize like FSDP1, the session left as it was
    (it passed initialize and failed at the first batch inside a pruning hook: found by a tester)."""
    from torch.distributed.fsdp import fully_shard

    from llmc_fsm_pruning import MagnitudePruningModifier

    model = llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    session = Session([MagnitudePruningModifier(sparsity=0.5)])
    try:
        session.initialize(model=model)
    except ValueError as exc:
        refused = {"error_type": type(exc).__name__, "message": str(exc), "lifecycle": session.lifecycle}
    else:
        refused = {"error_type": None}
    # as a teacher, only run forward, it is taken
    from llmc_fsm_training import OutputDistillationModifier

    session = Session([OutputDistillationModifier()])
    session.initialize(model=llama(seed=1), teacher=model)
    refused["teacher_lifecycle"] = session.lifecycle
    session.finalize()
    return refused


def _other_weights_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    from llmc_fsm.models.lazy import load_lazy

    errors: dict[str, Any] = {}
    model = llama(seed=rank)  # the same architecture, other weights on each rank
    before = linears(model)
    session = Session(default_recipe("sparsegpt", 0.5))
    try:
        session.initialize(model=model, calibration_data=windows())
    except ValueError as exc:
        errors["in_memory"] = str(exc)
    errors["unchanged"] = all(torch.equal(w, before[n]) for n, w in linears(model).items())
    errors["lifecycle_after"] = session.lifecycle
    from safetensors.torch import save_file

    directory = tmp / f"model-{rank}"  # written by hand: transformers' save_pretrained writes config.json on rank 0
    directory.mkdir()
    model.config.to_json_file(directory / "config.json")
    state = {n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied to the embedding
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    lazy, _ = load_lazy(directory)  # the streamed path: parameters on meta, read from the files later
    try:
        Session(default_recipe("sparsegpt", 0.5)).initialize(model=lazy.model, calibration_data=windows())
    except ValueError as exc:
        errors["streamed"] = str(exc)
    return errors


WORKERS = {
    "other_weights": _other_weights_worker,
    "fsdp2": _fsdp2_worker,
    "oneshot": _oneshot_worker,
    "mismatch": _mismatch_worker,
    "dying": _dying_worker,
    "hanging": _hanging_worker,
    "ddp": _ddp_worker,
}


# --------------------------------------------------------------------------- without a process group
def test_split_counts_are_contiguous_and_deterministic():
    assert split_counts(32, 2) == [16, 16]
    assert split_counts(10, 4) == [3, 3, 2, 2]
    assert split_counts(3, 3) == [1, 1, 1]
    assert split_counts(0, 2) == [0, 0]
    with pytest.raises(ValueError, match="need world_size >= 1 and total >= 0, got world_size=0, total=4"):
        split_counts(4, 0)


def test_one_process_is_rank_zero_of_one():
    data = windows()
    assert not is_distributed()
    assert (get_rank(), get_world_size(), is_main_process()) == (0, 1, True)
    local, counts = shard(data)
    assert local is data
    assert counts == [8]


def test_expected_world_size_without_a_process_group():
    model = llama()
    session = Session(default_recipe("wanda"))
    with pytest.raises(ValueError) as info:
        session.initialize(model=model, calibration_data=windows(), world_size=2)
    assert str(info.value) == (
        "expected world size 2 (state world_size) but this process runs without a torch.distributed process group "
        "of that size (world size 1): launch it with torchrun --nproc-per-node ..."
    )
    assert session.lifecycle == "created"
    with pytest.raises(
        ValueError,
        match=r"^state world_size must be a positive int \(the number of ranks expected\), "
        r"got 'two'$",
    ):
        session.initialize(model=model, calibration_data=windows(), world_size="two")
    session.initialize(model=model, calibration_data=windows(), world_size=1)
    assert session.lifecycle == "initialized"
    session.finalize()


def test_a_wrapped_model_is_unwrapped_at_initialize():
    model = llama()
    wrapped = torch.nn.DataParallel(model)  # CPU-only: wraps without devices, like DDP it holds .module
    assert unwrap_model(wrapped) is model
    assert unwrap_model(model) is model
    session = Session(default_recipe("wanda"))
    session.update_state(model=wrapped)
    assert session.state.model is wrapped  # stored as given until initialize
    session.initialize(calibration_data=windows())
    assert session.state.model is model
    targets = session.modifiers[0].resolved_targets
    assert "model.layers.0.self_attn.q_proj" in targets
    assert not any(name.startswith("module.") for name in targets)
    session.finalize()


def test_fsdp2_parameters_are_refused_at_initialize(tmp_path, one_thread):
    (rank,) = run_ranks(WORKERS["fsdp2"], tmp_path, world_size=1, timeout_s=60.0, join_s=180.0)
    assert rank["exitcode"] == 0
    assert rank["meta"]["result"] == {
        "error_type": "ValueError",
        "message": "the model's parameters are DTensors (FSDP2's fully_shard or tensor parallelism): they are sharded "
        "across ranks, so a modifier cannot see whole weights; wrap the model in DistributedDataParallel instead",
        "lifecycle": "created",
        "teacher_lifecycle": "initialized",
    }


def _fingerprint(session: Session) -> list[dict]:
    return recipe_fingerprint(session.labels, session.modifiers, session.recipe.plan())


def test_recipe_digest_ignores_object_addresses():
    a = Session(default_recipe("sparsegpt", 0.5))
    b = Session(default_recipe("sparsegpt", 0.5))
    c = Session(default_recipe("sparsegpt", 0.6))
    assert _recipe_digest(_fingerprint(a)) == _recipe_digest(_fingerprint(b)) != _recipe_digest(_fingerprint(c))
    check_ranks_agree(_fingerprint(a), a.state)  # no process group, no expected size: nothing to check


# --------------------------------------------------------------------------- 2 ranks
@pytest.mark.distributed
def test_two_ranks_match_one_process(tmp_path, one_thread):
    """SparseGPT, Wanda, GPTQ on 2 ranks: same masks as one process, weights within 1e-5, identical across ranks."""
    ranks = launch("oneshot", tmp_path)
    for rank in ranks:
        assert rank["exitcode"] == 0 and "error" not in rank["meta"], rank["meta"]
        assert rank["meta"]["result"]["acc_samples"] == [30, 30]
    # accumulators: identical on both ranks, equal to one process over all tokens
    from llmc_fsm_pruning.wanda import InputNormAccumulator

    from llmc_fsm.toolkit.obs import HessianAccumulator

    x = torch.randn(10, 3, 16, generator=torch.Generator().manual_seed(7))
    hess, norms = HessianAccumulator(16), InputNormAccumulator(16)
    hess.add_batch(x)
    norms.add_batch(x)
    t0, t1 = ranks[0]["tensors"], ranks[1]["tensors"]
    assert torch.equal(t0["acc/hessian"], t1["acc/hessian"])
    torch.testing.assert_close(t0["acc/hessian"], hess.hessian, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(t0["acc/sq_norm"], norms.sq_norm, rtol=1e-6, atol=1e-6)

    for name, recipe in RECIPES.items():
        model = llama()
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=windows(), batch_size=2, progress=False)
        single = linears(model)
        for n, w in single.items():
            key = f"{name}/{n}"
            assert torch.equal(t0[key], t1[key]), f"{key}: ranks differ"
            if name != "gptq":
                assert torch.equal(t0[key] != 0, w != 0), f"{key}: mask differs from one process"
                assert int((w == 0).sum()) == w.numel() // 2, key
            torch.testing.assert_close(t0[key], w, rtol=0, atol=1e-5, msg=f"{key}: weights differ from one process")
        calibration = ranks[0]["meta"]["result"][name]["calibration"]
        assert calibration["num_samples"] == 8 and calibration["per_rank"] == [4, 4]
        assert calibration["num_tokens"] == 8 * 32
    table = ranks[0]["meta"]["result"]["sparsegpt"]["table"]
    assert "calibration: 8 x 32 tokens from <tensor (8, 32)> (split over 2 ranks: 4 + 4)" in table
    # only rank 0 writes the output directory
    assert (tmp_path / "out-sparsegpt-rank0" / "report.json").is_file()
    assert not (tmp_path / "out-sparsegpt-rank1").exists()
    saved = json.loads((tmp_path / "out-sparsegpt-rank0" / "report.json").read_text())
    assert saved["calibration"]["per_rank"] == [4, 4]


@pytest.mark.distributed
def test_ranks_disagreeing_fail_on_every_rank_with_the_same_message(tmp_path, one_thread):
    ranks = launch("mismatch", tmp_path)
    results = [rank["meta"]["result"] for rank in ranks]
    assert all(rank["exitcode"] == 0 and "error" not in rank["meta"] for rank in ranks), ranks
    d0 = _recipe_digest(_fingerprint(Session(default_recipe("sparsegpt", 0.5)))) & 0xFFFFFFFF
    d1 = _recipe_digest(_fingerprint(Session(default_recipe("sparsegpt", 0.6)))) & 0xFFFFFFFF
    expected = (
        "initialize() refused on every rank of the process group (2 ranks): the recipe differs between ranks "
        f"(digest per rank — rank 0: {d0:08x}; rank 1: {d1:08x}). Every rank must run the same recipe on the "
        "same model; launch them with the same arguments. No modifier was initialized."
    )
    assert results[0]["recipe"] == results[1]["recipe"] == expected
    assert results[0]["lifecycle_after"] == results[1]["lifecycle_after"] == "created"
    expected = (
        "initialize() refused on every rank of the process group (2 ranks): expected world size 3 (state "
        "world_size) but the process group has 2 ranks. Every rank must run the same recipe on the same model; "
        "launch them with the same arguments. No modifier was initialized."
    )
    assert results[0]["world_size"] == results[1]["world_size"] == expected
    assert results[0]["oneshot"] == results[1]["oneshot"]
    assert results[0]["oneshot"].startswith(
        "initialize() refused on every rank of the process group (2 ranks): the recipe differs between ranks"
    )
    assert results[0]["unchanged"] and results[1]["unchanged"]


def _hex(data: bytes) -> str:
    """The 8 hex digits the refusal shows for a digest of ``data``: the low 32 bits of sha256's first 8 bytes."""
    return hashlib.sha256(data).hexdigest()[8:16]


@pytest.mark.distributed
def test_ranks_given_different_weights_of_one_architecture_are_refused_naming_the_first(tmp_path, one_thread):
    """Found by a tester: ranks given different checkpoints of the same architecture (same names, shapes, dtypes)
    passed the check at initialize, which digested only the structure, and the run mixed them silently (each module
    broadcast by its owner). Now a digest of a sample of the values refuses it on every rank, before any work,
    naming the first tensor that differs: the parameter in memory, the checkpoint's tensor on the streamed path."""
    ranks = launch("other_weights", tmp_path)
    assert all(rank["exitcode"] == 0 and "error" not in rank["meta"] for rank in ranks), [r["meta"] for r in ranks]
    results = [rank["meta"]["result"] for rank in ranks]
    embed = [llama(seed=r).model.embed_tokens.weight.detach() for r in range(WORLD)]
    # in memory: the checksum of every byte (session 39; a sample of 4096 values before), by an independent reference
    sampled = [shown(reference_checksum(e, 1 << 20)) for e in embed]
    tail = (
        "each rank must load the same checkpoint (a copy on another node that differs, or another checkpoint of the "
        "same architecture, gives other weights). Every rank must run the same recipe on the same model; launch "
        "them with the same arguments. No modifier was initialized."
    )
    head = "initialize() refused on every rank of the process group (2 ranks): the ranks loaded different weights"
    expected = (
        f"{head} (the first that differs is model.embed_tokens.weight, digest per rank — rank 0: {sampled[0]}; "
        f"rank 1: {sampled[1]}): {tail}"
    )
    assert results[0]["in_memory"] == results[1]["in_memory"] == expected
    assert results[0]["unchanged"] and results[1]["unchanged"]
    assert results[0]["lifecycle_after"] == results[1]["lifecycle_after"] == "created"
    # streamed: 16 pieces of 64 bytes at fixed offsets of the tensor's bytes in model.safetensors
    raw = [e.numpy().tobytes() for e in embed]
    pieces = [_hex(b"".join(b[len(b) * i // 16 : len(b) * i // 16 + 64] for i in range(16))) for b in raw]
    expected = (
        f"{head} (the first that differs is model.embed_tokens.weight (in model.safetensors), digest per rank — "
        f"rank 0: {pieces[0]}; rank 1: {pieces[1]}): {tail}"
    )
    assert results[0]["streamed"] == results[1]["streamed"] == expected


@pytest.mark.distributed
def test_a_rank_dying_mid_run_is_reported_by_the_others(tmp_path, one_thread):
    ranks = launch("dying", tmp_path, timeout_s=30.0)
    assert ranks[1]["exitcode"] == 3 and ranks[1]["meta"] is None
    meta = ranks[0]["meta"]
    assert ranks[0]["exitcode"] == 0
    error = meta["error"]
    assert error["type"] == "ModifierError", error
    assert "raised PeerFailureError: rank 0 of 2: torch.distributed all_reduce" in error["message"]
    assert "another rank stopped (see its error) or did not reach this step within" in error["message"]
    assert meta["seconds"] < 30.0  # reported before the collective timeout, not a hang


@pytest.mark.distributed
@pytest.mark.slow
def test_a_hanging_rank_is_reported_within_the_collective_timeout(tmp_path, one_thread):
    """Rank 1 stalls before compressing its second layer until rank 0 has reported; rank 0's wait is ended by the
    group's timeout while rank 1 is still stalled (an order of events, not a wall time: the check does not depend
    on how loaded the machine is)."""
    ranks = launch("hanging", tmp_path, timeout_s=HANG_TIMEOUT_S)
    error = ranks[0]["meta"]["error"]
    assert "raised PeerFailureError: rank 0 of 2: torch.distributed all_reduce" in error["message"]
    assert f"Timed out waiting {int(HANG_TIMEOUT_S * 1000)}ms" in error["message"]
    stall = json.loads((tmp_path / "stall.json").read_text())
    assert stall["rank_0_reported_during_the_stall"]  # the timeout, not the stalled rank, ended the wait


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_training_keeps_masks_identical_across_ranks(tmp_path, one_thread):
    ranks = launch("ddp", tmp_path)
    for rank in ranks:
        assert rank["exitcode"] == 0 and "error" not in rank["meta"], rank["meta"]
    t0, t1 = ranks[0]["tensors"], ranks[1]["tensors"]
    for when in ("before_wrapping", "after_wrapping"):
        info = [rank["meta"]["result"][when] for rank in ranks]
        for i in info:
            assert i["state_model_is_inner"]
            assert "model.layers.0.self_attn.q_proj" in i["targets"]
            assert all(i["agree"]), i["agree"]  # masks identical on both ranks after every step
        assert info[0]["sparsity"] == info[1]["sparsity"]
        assert [round(s, 2) for s in info[0]["sparsity"]] == [0.2, 0.2, 0.48, 0.48, 0.59, 0.6]  # end at batch_end
        assert info[0]["final_zeros"] == info[0]["expected_zeros"]
        for key in (k for k in t0 if k.startswith(when)):
            assert torch.equal(t0[key], t1[key]), key
    # the state given before and after wrapping trains the same model
    for key in (k for k in t0 if k.startswith("before_wrapping")):
        assert torch.equal(t0[key], t0[key.replace("before_wrapping", "after_wrapping")]), key


def _work_dir_with_one_layer(output: Path) -> Any:
    from safetensors.torch import save_file

    from llmc_fsm.output.workdir import WorkDir

    work = WorkDir.claim(output)
    work.settle({"model": "tiny"}, resume=False)
    (work.progress / "pass-0").mkdir(parents=True)
    save_file({"x": torch.zeros(1)}, work.progress / "pass-0" / "layer-0.safetensors")  # readable: reused on resume
    return work


def test_another_ranks_failure_keeps_the_finished_layers_as_an_interruption_does(tmp_path):
    """Found by a tester: when a peer rank died, rank 0's collective failed and it removed the finished-layer
    progress (while torchrun was stopping it), so nothing was left to resume. Now another rank's failure (a
    PeerFailureError, even inside a modifier's error) keeps it, with the line that says how to resume; an error of
    the run itself still removes the work directory."""
    from safetensors.torch import load_file

    from llmc_fsm.core.errors import ModifierError
    from llmc_fsm.toolkit.distributed import DistributedError, PeerFailureError

    work = _work_dir_with_one_layer(tmp_path / "out")
    try:
        try:
            raise PeerFailureError("rank 0 of 2: torch.distributed all_reduce (Hessian) failed (...)")
        except PeerFailureError as cause:
            raise ModifierError("SparseGPTModifier.on_sequential_epoch_end() raised", modifier="m", hook="h") from cause
    except ModifierError as exc:
        error = exc
    work.abort(error)
    assert error.__notes__ == [
        f"progress kept in {str(tmp_path / '.out.work')!r} (1 decoder layers done): run the same command with "
        "--resume (resume=True) to continue, or remove that directory"
    ]
    assert torch.equal(load_file(tmp_path / ".out.work" / "progress" / "pass-0" / "layer-0.safetensors")["x"],
                       torch.zeros(1))
    work.release()
    for exc in (ValueError("a recipe error"), DistributedError("ranks computed different weights")):
        work = _work_dir_with_one_layer(tmp_path / "again")
        work.abort(exc)
        assert not hasattr(exc, "__notes__") and not (tmp_path / ".again.work").exists()


def test_model_free_refuses_several_processes_before_any_work(tmp_path, monkeypatch):
    """Found by a tester: ``llmc-fsm model-free`` under torchrun planned on every rank, every rank tried to claim
    the output, and the ranks' check failed on the planning tree. Now it refuses at once, in one line."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError) as info:
        llmc_fsm.model_free_ptq(tmp_path / "nothing-here", tmp_path / "out", scheme="W8A8")
    assert str(info.value) == (
        "model_free_ptq (llmc-fsm model-free) runs in one process, and this is one of 2 (torchrun / "
        "torch.distributed): run it without torchrun"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_expected_world_size_without_torchrun_is_refused(monkeypatch, capsys):
    """Found by a tester: LLMC_FSM_WORLD_SIZE=3 in a process started without torchrun was ignored and the run went
    on in one process. Now it is refused as the Python API's world_size= is; 1 is accepted."""
    from llmc_fsm.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LLMC_FSM_WORLD_SIZE", "3")
    assert main(["lifecycle"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "llmc-fsm lifecycle: error: LLMC_FSM_WORLD_SIZE expects world size 3 but this process runs alone, without "
        "torchrun (WORLD_SIZE unset): launch it with torchrun --nproc-per-node ... so that the ranks add up to 3, or "
        "unset LLMC_FSM_WORLD_SIZE\n"
    )
    monkeypatch.setenv("LLMC_FSM_WORLD_SIZE", "1")
    assert main(["lifecycle"]) == 0


def test_python_dash_m_runs_the_cli():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "llmc_fsm", "--version"], capture_output=True, text=True, check=False)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"llmc-fsm {llmc_fsm.__version__}")


@pytest.mark.distributed
def test_torchrun_cli_checks_the_expected_world_size_on_every_rank():
    """``torchrun -m llmc_fsm``: the CLI joins the process group and refuses before any work."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMC_FSM_WORLD_SIZE": "3"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "llmc_fsm",
        "lifecycle",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=120)
    assert proc.returncode != 0
    line = (
        "llmc-fsm lifecycle: error: LLMC_FSM_WORLD_SIZE expects world size 3 but torchrun started 2 ranks; "
        "fix --nnodes/--nproc-per-node or LLMC_FSM_WORLD_SIZE"
    )
    assert proc.stderr.count(line) == 1, proc.stderr  # both ranks fail (exit 1); only rank 0 prints the line
    assert "created" not in proc.stdout  # the command itself never ran


def test_a_compiled_model_is_unwrapped_at_initialize_and_its_checkpoint_loads_into_the_plain_model():
    recipe = {"s": {"MagnitudePruningModifier": {"sparsity": 0.5}, "OutputDistillationModifier": {}}}
    model = llama().train()  # the distillation hook captures training forwards
    compiled = torch.compile(model, backend="eager")
    assert unwrap_model(torch.nn.DataParallel(compiled)) is model  # in any nesting
    session = Session(recipe)
    session.initialize(model=compiled, teacher=torch.compile(llama(seed=1), backend="eager"))
    assert session.state.model is model
    assert type(session.state.teacher).__name__ == "LlamaForCausalLM"
    targets = session.modifiers[0].resolved_targets
    assert len(targets) == 14 and "lm_head" not in targets  # the default ignore: [lm_head] matches
    assert not any(name.startswith("_orig_mod.") for name in targets)
    ids = windows(2, 16)
    session.batch_start(batch={"input_ids": ids})
    loss = session.loss_calculated(compiled(input_ids=ids, labels=ids).loss)  # the hook ran in the compiled forward
    assert session.modifiers[1].last_distill_loss is not None
    loss.backward()
    session.batch_end()
    assert not (model.lm_head.weight == 0).any()
    saved = session.state_dict()
    session.finalize()
    plain = Session(recipe)
    plain.initialize(model=llama(), teacher=llama(seed=1))
    plain.load_state_dict(saved)  # masks named as the model's own modules
    assert plain.modifiers[0].resolved_targets.keys() == targets.keys()
    plain.finalize()
