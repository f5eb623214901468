"""Session 40, fix A1: what ranks agree on at initialize, a one-rank initialize, and two refusals that said too little.

The ranks' tests start 2 gloo processes (``llmc_fsm.testing.run_ranks``); the others run in the test process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tiny_families
import torch
from test_s39_distributed import HEAD, TAIL, reference_checksum, shown
from tiny_llama import llama

from llmc_fsm import CheckpointError, MissingStateError, Session
from llmc_fsm.session.checkpoint import read_checkpoint
from llmc_fsm.testing import run_ranks

pytest.importorskip("transformers")

PRUNE = {"train": {"MagnitudePruningModifier": {"init_sparsity": 0.2, "final_sparsity": 0.6, "start": 0, "end": 2,
                                                "update": 0.5, "leave_enabled": True}}}  # fmt: skip
DISTILL = {"train": {"OutputDistillationModifier": {"alpha": 0.5}}}
BIAS = "model.layers.2.mlp.gate.e_score_correction_bias"


@pytest.fixture
def one_thread(monkeypatch):
    """Spawned ranks with one torch thread each."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _said(call: Any) -> str | None:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------- workers (rank side)
def _agree_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = llama(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = Session(PRUNE)
    out["spe"] = _said(lambda: session.initialize(model=model, optimizer=opt, steps_per_epoch=3 + rank))
    out["spe_lifecycle"] = session.lifecycle
    same = Session(PRUNE)
    out["same_spe"] = _said(lambda: same.initialize(model=model, optimizer=opt, steps_per_epoch=3))
    same.reset()
    teacher = llama(seed=1 + rank)  # rank 1 given another teacher checkpoint
    distill = Session(DISTILL)
    out["teacher"] = _said(lambda: distill.initialize(model=model, teacher=teacher, optimizer=opt, steps_per_epoch=2))
    out["teacher_lifecycle"] = distill.lifecycle
    routed = tiny_families.build("deepseek_v3")
    if rank == 1:  # another router bias: a persistent buffer, loaded from the checkpoint
        with torch.no_grad():
            routed.get_buffer(BIAS).add_(0.5)
    tensors["bias"] = routed.get_buffer(BIAS).detach().clone()
    out["buffer"] = _said(lambda: Session().initialize(model=routed))
    from torch.distributed.fsdp import fully_shard

    sharded = llama(seed=1)  # a teacher sharded by FSDP2: each rank holds other shards of the same weights
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    fsdp = Session(DISTILL)
    try:
        fsdp.initialize(model=model, teacher=sharded, optimizer=opt, steps_per_epoch=2)
    except Exception as exc:
        out["fsdp_teacher"] = f"{type(exc).__name__}: {exc}"
    else:
        out["fsdp_teacher"] = fsdp.lifecycle
        fsdp.finalize()
    return out


def _one_rank_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    if rank != 0:
        return {"initialized": False}
    session = Session(PRUNE)
    try:
        session.initialize(model=llama(seed=0), steps_per_epoch=3)
    except Exception as exc:
        return {"type": type(exc).__name__, "said": str(exc), "lifecycle": session.lifecycle}
    return {"type": None}


@pytest.fixture(scope="module")
def agree(tmp_path_factory):
    """The ranks of :func:`_agree_worker`: per rank ``{"meta", "tensors", "exitcode"}``."""
    ranks = run_ranks(_agree_worker, tmp_path_factory.mktemp("agree"), world_size=2, timeout_s=60.0, join_s=240.0)
    assert all(r["exitcode"] == 0 and "error" not in r["meta"] for r in ranks), [r["meta"] for r in ranks]
    return ranks


@pytest.mark.distributed
def test_ranks_given_different_steps_per_epoch_are_refused_at_initialize(agree, one_thread):
    """Found by a tester: ranks given different steps_per_epoch (each from its own uneven shard's loader) passed the
    check at initialize, then pruned at different epochs: the ranks' masks and learning rates drifted apart."""
    results = [r["meta"]["result"] for r in agree]
    expected = (
        f"{HEAD}the ranks have different steps_per_epoch (rank 0: 3, rank 1: 4): their schedules in epochs (pruning "
        "steps, learning rate) and their masks would drift apart; give every rank the same steps_per_epoch and the "
        "same number of batches, e.g. shard the data with a DistributedSampler (it pads every rank's shard to "
        f"ceil(len(dataset) / world_size) samples). {TAIL}"
    )
    assert results[0]["spe"] == results[1]["spe"] == expected
    assert results[0]["spe_lifecycle"] == results[1]["spe_lifecycle"] == "created"
    assert results[0]["same_spe"] is None and results[1]["same_spe"] is None


@pytest.mark.distributed
def test_ranks_given_different_teachers_are_refused_when_training(agree, one_thread):
    """Found by a tester: with an optimizer in the state (training) no weight was compared, and a teacher, which no
    wrapper keeps equal across the ranks, could differ per rank: each rank distilled from another teacher."""
    results = [r["meta"]["result"] for r in agree]
    embed = [shown(reference_checksum(llama(seed=1 + r).model.embed_tokens.weight, 1 << 20)) for r in range(2)]
    expected = (
        f"{HEAD}the ranks loaded different weights (the first that differs is teacher model.embed_tokens.weight, "
        f"digest per rank — rank 0: {embed[0]}; rank 1: {embed[1]}): each rank must load the same checkpoint (a copy "
        f"on another node that differs, or another checkpoint of the same architecture, gives other weights). {TAIL}"
    )
    assert results[0]["teacher"] == results[1]["teacher"] == expected
    assert results[0]["teacher_lifecycle"] == results[1]["teacher_lifecycle"] == "created"


@pytest.mark.distributed
def test_ranks_whose_persistent_buffers_differ_are_refused(agree, one_thread):
    """Found by a tester: the weights check read parameters only, so ranks whose DeepSeek-V3 router bias (a
    persistent buffer, loaded from the checkpoint) differed ran on, each routing tokens its own way."""
    results = [r["meta"]["result"] for r in agree]
    bias = [shown(reference_checksum(r["tensors"]["bias"], 1 << 20)) for r in agree]
    assert bias[0] != bias[1]
    expected = (
        f"{HEAD}the ranks loaded different weights (the first that differs is {BIAS}, digest per rank — rank 0: "
        f"{bias[0]}; rank 1: {bias[1]}): each rank must load the same checkpoint (a copy on another node that "
        f"differs, or another checkpoint of the same architecture, gives other weights). {TAIL}"
    )
    assert results[0]["buffer"] == results[1]["buffer"] == expected


@pytest.mark.distributed
def test_a_teacher_sharded_by_fsdp2_is_taken_by_the_teacher_check(agree, one_thread):
    """Guards the teacher check above: its first version checksummed a teacher's DTensor shards and failed on every
    rank with a bare RuntimeError (aten.dot.default got mixed torch.Tensor and DTensor); shards are left out."""
    results = [r["meta"]["result"] for r in agree]
    assert results[0]["fsdp_teacher"] == results[1]["fsdp_teacher"] == "initialized"


@pytest.mark.distributed
def test_initialize_on_one_rank_only_names_the_likely_cause(tmp_path, one_thread):
    """Found by a tester: `if rank == 0: oneshot(...)` inside a torchrun job waited for the process group's timeout,
    then said only that another rank stopped or did not reach this step."""
    ranks = run_ranks(_one_rank_worker, tmp_path, world_size=2, timeout_s=5.0, join_s=120.0)
    result = ranks[0]["meta"]["result"]
    assert result["type"] == "PeerFailureError" and result["lifecycle"] == "created"
    assert result["said"].startswith("rank 0 of 2: torch.distributed all_gather (recipe check at initialize) failed (")
    assert result["said"].endswith(
        "This rank stops too. initialize() (which oneshot() calls) is collective under torch.distributed: every rank "
        "of the process group must call it; was it called on one rank only (e.g. under `if rank == 0:`)? Call "
        "oneshot() / initialize() on every rank (they share the work, rank 0 writes the output), or compress in a "
        "process of its own, started without torchrun"
    )


# --------------------------------------------------------------------------- one process
def test_a_resume_with_other_steps_per_epoch_says_what_they_follow_from(tmp_path):
    """Found by a tester: a SessionTrainer checkpoint resumed at another world size was refused naming only the two
    numbers ("state steps_per_epoch is 3 in the checkpoint, 6 now"), not what makes them differ."""
    model = llama(seed=0)
    first = Session(PRUNE)
    first.initialize(model=model, steps_per_epoch=3)
    first.save(tmp_path / "session")
    first.finalize()
    second = Session(PRUNE)
    second.initialize(model=model, steps_per_epoch=6)
    with pytest.raises(CheckpointError) as info:
        second.load_state_dict(read_checkpoint(tmp_path / "session"))
    assert str(info.value) == (
        "the checkpoint does not match this session (1 difference(s)): state steps_per_epoch is 3 in the checkpoint, "
        "6 now. The optimizer steps per epoch follow from the training set's size, the number of processes (world "
        "size), the per-device batch size and gradient accumulation: resume with the ones the checkpoint was written "
        "with. Nothing was loaded: resume with the recipe and state the checkpoint was written with."
    )
    assert info.value.differences == ("state steps_per_epoch is 3 in the checkpoint, 6 now",)
    assert second.global_step == 0 and second.lifecycle == "initialized"


MIXED = """
sparsity_stage:
  run_type: oneshot
  sparsity_modifiers:
    SparseGPTModifier: {sparsity: 0.5, targets: ["Linear"], ignore: ["lm_head"]}
finetuning_stage:
  run_type: train
  pruning_modifiers:
    ConstantPruningModifier: {start: 0, end: 1.5}
"""


def test_a_one_shot_stage_in_a_training_session_says_why_it_needs_calibration_data():
    """Found by a tester: a recipe with a one-shot stage (SparseGPT) and a training stage, in a plain training loop,
    was refused naming only the key 'calibration_data'; once given, the first batch warned that SparseGPT does nothing
    in training. The refusal now says so and what to do."""
    model = llama(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = Session(MIXED)
    with pytest.raises(MissingStateError) as info:
        session.initialize(model=model, optimizer=opt, steps_per_epoch=4)
    assert str(info.value).splitlines()[:3] == [
        "initialize() refused: 1 modifier(s) are missing required state; no modifier was initialized and nothing "
        "was stored (the session is still 'created'):",
        "  - SparseGPTModifier requires 'calibration_data'",
        "      'calibration_data' is required for its calibration events (calibration_start ... calibration_end), "
        "which a training loop does not send: in training batches it does nothing (quantization-aware training is "
        "not implemented). Run its stage with llmc_fsm.oneshot(model, recipe) before or after training and give "
        "this session the training stages only, or pass calibration_data and send the calibration events",
    ]
    assert session.lifecycle == "created"
    static = Session({"q": {"QuantizationModifier": {"scheme": "FP8", "targets": ["Linear"], "ignore": ["lm_head"]}}})
    with pytest.raises(MissingStateError) as info:  # its own reason first, then the same words
        static.initialize(model=model, optimizer=opt)
    assert str(info.value).splitlines()[2] == (
        "      'calibration_data' is required when an observer needs the inputs' importance (imatrix_mse), input "
        "activations have static scales, or a kv_cache_scheme is given, for its calibration events (calibration_start "
        "... calibration_end), which a training loop does not send: in training batches it does nothing "
        "(quantization-aware training is not implemented). Run its stage with llmc_fsm.oneshot(model, recipe) before "
        "or after training and give this session the training stages only, or pass calibration_data and send the "
        "calibration events"
    )
    without = Session(MIXED)  # no optimizer: a one-shot session, whose calibration needs the data; no such line
    with pytest.raises(MissingStateError) as info:
        without.initialize(model=model, steps_per_epoch=4)
    assert str(info.value).splitlines()[2] == (
        "Supply them where they are created with session.update_state(calibration_data=...), or pass them to "
        "session.initialize(calibration_data=...)."
    )
