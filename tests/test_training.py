"""Training-time modifiers in a plain PyTorch loop (llmc_fsm.integrations.torch).

ConstantPruning / MagnitudePruning (llmc-fsm-pruning), OutputDistillation and
LearningRate (llmc-fsm-training).
"""

from __future__ import annotations

import math

import pytest
import torch
from llmc_fsm_pruning.constant import ConstantPruningModifier
from llmc_fsm_pruning.magnitude import MagnitudePruningModifier, cubic_sparsity
from llmc_fsm_training import LearningRateModifier, OutputDistillationModifier, distillation_kl, scheduled_lr
from safetensors.torch import load_file, save_file
from torch import nn

from llmc_fsm import CheckpointError, MissingStateError, RecipeError, Session
from llmc_fsm.integrations.torch import initialize, is_step, optimizer_step, resume_position, steps_per_epoch


class TinyLM(nn.Module):
    """Embedding -> 2 Linear -> logits; returns an object with .logits/.loss like HF models."""

    def __init__(self, vocab: int = 11, hidden: int = 8, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.fc1 = nn.Linear(hidden, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = torch.relu(self.fc1(self.embed(input_ids)))
        logits = self.lm_head(torch.relu(self.fc2(h)))
        out = type("Out", (), {})()
        out.logits = logits
        out.loss = None
        if labels is not None:
            out.loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return out


def _batches(n: int, seed: int = 1, vocab: int = 11) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 5), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


def _zeros(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (m.weight == 0).clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _loop(session: Session, model, optimizer, batches, accumulation: int = 1, epochs: int = 1) -> list[float]:
    losses = []
    for _ in range(epochs):
        for i, batch in enumerate(batches):
            session.batch_start(batch=batch)
            loss = session.loss_calculated(model(**batch).loss)
            (loss / accumulation).backward()
            losses.append(float(loss.detach()))
            if is_step(i, len(batches), accumulation):
                optimizer_step(session, optimizer)
            session.batch_end()
    return losses


# --- ConstantPruning ------------------------------------------------------------


def test_constant_pruning_masks_hold_exactly_in_plain_loop():
    model = TinyLM()
    with torch.no_grad():  # pre-pruned: ~50% zeros in fc1/fc2
        for m in (model.fc1, model.fc2):
            m.weight[m.weight.abs() < m.weight.abs().median()] = 0
    before = _zeros(model)
    assert before["fc1"].float().mean() >= 0.4
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    session = Session([ConstantPruningModifier()])
    session.update_state(model=model)
    initialize(session, optimizer=optimizer)
    _loop(session, model, optimizer, _batches(6))
    session.finalize()
    after = _zeros(model)
    for name in ("fc1", "fc2"):
        assert torch.equal(after[name], before[name]), name
    # lm_head is ignored by default: it trained freely (nothing was zero, nothing forced)
    assert not after["lm_head"].any()
    mod = session.modifiers[0]
    expected = (before["fc1"].sum() + before["fc2"].sum()).item() / (2 * 64)
    assert mod.measured_sparsity == pytest.approx(expected)
    assert mod.num_hooks == 0


def test_constant_pruning_end_stops_holding():
    model = TinyLM()
    with torch.no_grad():
        model.fc1.weight[:, :4] = 0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    session = Session([ConstantPruningModifier(end=0.5, targets=["fc1"])])
    initialize(session, model=model, steps_per_epoch=4)
    _loop(session, model, optimizer, _batches(4))
    session.finalize()
    # held for steps 0-1 (epoch < 0.5), then released: SGD regrows the zeros
    assert (model.fc1.weight[:, :4] != 0).any()


# --- MagnitudePruning -------------------------------------------------------------


def test_magnitude_one_shot_prunes_at_first_batch_and_holds():
    model = TinyLM()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    session = Session([MagnitudePruningModifier(sparsity=0.5)])
    initialize(session, model=model, optimizer=optimizer)
    batches = _batches(4)
    session.batch_start(batch=batches[0])
    zeros = _zeros(model)
    assert zeros["fc1"].sum() == 32 and zeros["fc2"].sum() == 32
    session.batch_end()
    _loop(session, model, optimizer, batches)
    session.finalize()
    assert torch.equal(_zeros(model)["fc1"], zeros["fc1"])
    assert session.modifiers[0].measured_sparsity == pytest.approx(0.5)


def test_magnitude_gradual_follows_cubic_schedule_and_finalize_reaches_final():
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mod = MagnitudePruningModifier(init_sparsity=0.1, final_sparsity=0.8, start=0, end=2, update=0.5)
    session = Session([mod])
    initialize(session, model=model, optimizer=optimizer, steps_per_epoch=4)
    numel = 2 * 64
    measured = {}
    for step, batch in enumerate(_batches(6)):  # stops at epoch 1.5 < end
        session.batch_start(batch=batch)
        measured[step] = sum(int((m.weight == 0).sum()) for m in (model.fc1, model.fc2)) / numel
        session.loss_calculated(model(**batch).loss).backward()
        optimizer_step(session, optimizer)
        session.batch_end()
    # pruning events at steps 0, 2, 4 (epochs 0, 0.5, 1.0); each layer rounds half up
    for step in (0, 2, 4):
        target = cubic_sparsity(step / 4, 0.1, 0.8, 0.0, 2.0)
        assert target == pytest.approx(0.8 + (0.1 - 0.8) * (1 - step / 8) ** 3)
        assert measured[step] == pytest.approx(math.floor(target * 64 + 0.5) / 64)
    assert measured[1] == measured[0] and measured[3] == measured[2]  # masks held between updates
    assert [t for _, t in mod.history] == pytest.approx([cubic_sparsity(e, 0.1, 0.8, 0, 2) for e in (0, 0.5, 1.0)])
    session.finalize()  # training stopped at epoch 1.5: finalize still leaves final_sparsity
    assert mod.measured_sparsity == pytest.approx(math.floor(0.8 * 64 + 0.5) / 64)


def _gradual_run(after=(), **kwargs):
    """init 0.1 -> final 0.5 over epochs [0, 1] (update 0.25, 4 steps an epoch), then the modifiers ``after``,
    trained 2 epochs with AdamW: the sparsity of fc1 + fc2 after every optimizer step, and the modifier."""
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    mod = MagnitudePruningModifier(init_sparsity=0.1, final_sparsity=0.5, start=0, end=1, update=0.25, **kwargs)
    session = Session([mod, *after])
    initialize(session, model=model, optimizer=optimizer, steps_per_epoch=4)
    after_step = []
    for batch in _batches(8):
        session.batch_start(batch=batch)
        session.loss_calculated(model(**batch).loss).backward()
        optimizer_step(session, optimizer)
        after_step.append(sum(int((m.weight == 0).sum()) for m in (model.fc1, model.fc2)) / 128)
        session.batch_end()
    ended = mod.measured_sparsity  # measured at end (the batch of epoch 1.0)
    session.finalize()
    return model, mod, after_step, ended


def test_magnitude_gradual_with_leave_enabled_holds_the_masks_from_end_until_finalize(caplog):
    with caplog.at_level("WARNING", logger="llmc_fsm_pruning.magnitude"):
        model, mod, after_step, ended = _gradual_run(leave_enabled=True)
    assert [r.getMessage() for r in caplog.records] == [
        "MagnitudePruningModifier: leave_enabled: true holds the masks from end (epoch 1.0) until finalize; "
        "llm-compressor 0.14 ignores it (deprecated, always false: its masks are dropped at end)"
    ]
    assert mod.history[-1] == (1.0, 0.5)
    # steps 4..7 (epochs 1.0 to 1.75) come after end: the 0.5 reached at end is held exactly by the masks
    assert after_step[4:] == [0.5, 0.5, 0.5, 0.5]
    assert ended == 0.5
    assert mod.measured_sparsity == 0.5  # measured again at finalize, on the weights
    assert sum(int((m.weight == 0).sum()) for m in (model.fc1, model.fc2)) == 64


def test_magnitude_leave_enabled_is_false_by_default_as_in_llmcompressor_and_drops_the_masks_at_end(caplog):
    """llm-compressor 0.14 forces ``leave_enabled`` to false (its ``on_end`` disables the masks); ours defaulted to
    true and the docs called that llm-compressor's default (found by a tester)."""
    assert MagnitudePruningModifier(sparsity=0.5).leave_enabled is False
    with caplog.at_level("WARNING", logger="llmc_fsm_pruning.magnitude"):
        _, mod, after_step, ended = _gradual_run()
    assert caplog.records == []
    assert ended == 0.5  # at end (the batch of epoch 1.0) the weights are at final_sparsity
    # AdamW regrows the pruned weights at the next step, all but the 6 whose gradient is 0 (inputs of dead ReLUs)
    assert after_step[4:] == [6 / 128] * 4
    assert mod.measured_sparsity == 6 / 128  # finalize measures the weights: no claim of the sparsity that is gone
    assert sum(mod.module_sparsity.values()) * 64 == 6


def _stopped_after_one_step(stop: str) -> tuple[float, str]:
    """A gradual run (0.1 -> 0.9 over 10 epochs) stopped after its first step by ``stop``: the sparsity of fc1 + fc2
    left, and the session's lifecycle."""
    import llmc_fsm

    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    recipe = [MagnitudePruningModifier(init_sparsity=0.1, final_sparsity=0.9, start=0, end=10, update=1)]
    batch = _batches(1)[0]

    def one_step(session: Session) -> None:
        initialize(session, model=model, optimizer=optimizer, steps_per_epoch=4)
        session.batch_start(batch=batch)
        session.loss_calculated(model(**batch).loss).backward()
        optimizer_step(session, optimizer)
        session.batch_end()

    if stop == "create_session error":
        with pytest.raises(RuntimeError, match="out of memory"), llmc_fsm.create_session(recipe) as session:
            one_step(session)
            raise RuntimeError("out of memory")
    else:
        session = Session(recipe)
        one_step(session)
        session.reset() if stop == "reset" else session.finalize()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    return sum(int((m.weight == 0).sum()) for m in (model.fc1, model.fc2)) / 128, session.lifecycle


def test_reset_and_an_error_in_create_session_release_a_gradual_run_without_pruning_to_its_final_sparsity():
    """``reset()`` and leaving ``create_session`` by an exception give the modifiers ``on_finalize`` only: the model
    keeps the sparsity of the last step (found by a tester: both ran ``on_end``, which pruned to ``final_sparsity``,
    0.1 -> 0.9, after a crash); ``finalize()`` ends the run and prunes to it, as documented."""
    first, final = 2 * 6 / 128, 2 * 58 / 128  # per 64-weight module: round(0.1 * 64) = 6, round(0.9 * 64) = 58
    assert _stopped_after_one_step("reset") == (first, "created")
    assert _stopped_after_one_step("create_session error") == (first, "finalized")
    assert _stopped_after_one_step("finalize") == (final, "finalized")


def test_a_constant_pruning_modifier_from_end_holds_what_a_gradual_run_reached():
    """The docs' way to keep the sparsity after ``end`` with the default ``leave_enabled: false``: a
    ``ConstantPruningModifier`` starting at ``end``, after the magnitude modifier in the recipe."""
    _, _, after_step, _ = _gradual_run(after=[ConstantPruningModifier(start=1)])
    assert after_step[3:] == [0.5] * 5  # epochs 0.75 (s = 0.49375: 32 of 64 per module) to 1.75


def test_a_gradual_run_again_after_reset_prunes_as_the_first_did():
    """The same modifier object after ``session.reset()`` runs the schedule anew (found by a tester: the last run's
    ``_final_applied`` and ``history`` survived, and the second run never pruned to ``final_sparsity``)."""
    mod = MagnitudePruningModifier(init_sparsity=0.1, final_sparsity=0.5, start=0, end=1, update=0.25)
    session = Session([mod])
    runs = []
    for _ in range(2):
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        initialize(session, model=model, optimizer=optimizer, steps_per_epoch=4)
        for batch in _batches(6):
            session.batch_start(batch=batch)
            session.loss_calculated(model(**batch).loss).backward()
            optimizer_step(session, optimizer)
            session.batch_end()
        runs.append((list(mod.history), mod.measured_sparsity))
        session.reset()
    assert runs[0] == runs[1] and runs[0][0][-1] == (1.0, 0.5) and runs[0][1] == 0.5


def test_magnitude_leave_enabled_must_be_a_bool():
    with pytest.raises(TypeError) as info:
        MagnitudePruningModifier(sparsity=0.5, leave_enabled="no")
    assert str(info.value) == "leave_enabled must be true or false, got 'no'"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sparsity": 1.0}, "sparsity must be a number in [0, 1) (fraction of weights set to zero), got 1.0"),
        ({"sparsity": -0.1}, "sparsity must be a number in [0, 1) (fraction of weights set to zero), got -0.1"),
        (
            {"init_sparsity": 0.1, "final_sparsity": True, "end": 1, "update": 0.5},
            "final_sparsity must be a number in [0, 1) (fraction of weights set to zero), got True",
        ),
        ({}, "give sparsity (one-shot) or init_sparsity + final_sparsity (gradual)"),
        (
            {"sparsity": 0.5, "init_sparsity": 0.1, "final_sparsity": 0.5, "end": 1, "update": 0.5},
            "give either sparsity (one-shot) or init_sparsity + final_sparsity (gradual), not both",
        ),
        (
            {"init_sparsity": 0.1, "final_sparsity": 0.5},  # no end/update
            "gradual mode needs end and update (epochs; end and update not given): the cubic schedule runs from start "
            "to end",
        ),
        (  # a tester: with end given the message did not say update was the one missing
            {"init_sparsity": 0.1, "final_sparsity": 0.5, "end": 1},
            "gradual mode needs end and update (epochs; update not given): the cubic schedule runs from start to end",
        ),
        (
            {"init_sparsity": 0.6, "final_sparsity": 0.5, "end": 1, "update": 0.5},
            "init_sparsity (0.6) must be <= final_sparsity (0.5)",
        ),
        (
            {"sparsity": 0.5, "mask_structure": "2:3:4"},
            "invalid mask_structure '2:3:4': expected 'unstructured' (alias '0:0') or 'N:M' with integers 0 < N < M, "
            "meaning N nonzero weights are kept in every group of M consecutive weights along the input dimension "
            "(e.g. '2:4' = 50% sparsity)",
        ),
        ({"sparsity": 0.3, "mask_structure": "2:4"}, "sparsity 0.3 contradicts mask_structure '2:4' (0.5)"),
    ],
)
def test_magnitude_argument_validation(kwargs, message):
    with pytest.raises(ValueError) as info:
        MagnitudePruningModifier(**kwargs)
    assert str(info.value) == message


def test_magnitude_two_four():
    model = TinyLM()
    session = Session([MagnitudePruningModifier(mask_structure="2:4")])
    session.initialize(model=model)
    session.calibration_start()
    session.calibration_end()
    session.finalize()
    groups = (model.fc1.weight != 0).reshape(8, 2, 4).sum(-1)
    assert (groups <= 2).all()


# --- LearningRate ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "closed_form"),
    [
        ({"schedule": "constant", "init_lr": 0.3}, lambda e: 0.3),
        (
            {"schedule": "linear", "init_lr": 0.3, "final_lr": 0.1, "end": 2},
            lambda e: 0.3 + (0.1 - 0.3) * min(e / 2, 1),
        ),
        (
            {"schedule": "cosine", "init_lr": 0.3, "final_lr": 0.0, "start": 0.5, "end": 2.5},
            lambda e: 0.15 * (1 + math.cos(math.pi * min(max((e - 0.5) / 2, 0), 1))),
        ),
        (
            {"schedule": "step", "init_lr": 0.3, "step_size": 0.75, "gamma": 0.5},
            lambda e: 0.3 * 0.5 ** math.floor(e / 0.75),
        ),
    ],
)
def test_lr_schedule_closed_form_with_accumulation(kwargs, closed_form):
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    seen = []
    optimizer.register_step_pre_hook(lambda opt, *_: seen.append(opt.param_groups[0]["lr"]))
    mod = LearningRateModifier(**kwargs)
    session = Session([mod])
    batches = _batches(8)
    accumulation = 2
    spe = steps_per_epoch(batches, accumulation)
    assert spe == 4
    initialize(session, model=model, optimizer=optimizer, steps_per_epoch=spe)
    _loop(session, model, optimizer, batches, accumulation=accumulation, epochs=3)
    assert session.global_step == 12  # 8 batches / 2 per step * 3 epochs
    start = kwargs.get("start", 0)
    for step, lr in enumerate(seen):
        epoch = step / spe
        end = kwargs.get("end")
        if epoch < start:
            assert lr == 1.0, step  # untouched before start
        elif end is not None and epoch >= end:
            assert lr == pytest.approx(closed_form(end)), step  # held at the end value
        else:
            assert lr == pytest.approx(closed_form(epoch)), step
    session.finalize()


def test_step_counting_with_uneven_accumulation():
    assert steps_per_epoch(7, 3) == 3
    assert [is_step(i, 7, 3) for i in range(7)] == [False, False, True, False, False, True, True]
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = Session([LearningRateModifier(schedule="linear", init_lr=0.1, end=1)])
    initialize(session, model=model, optimizer=optimizer, steps_per_epoch=steps_per_epoch(7, 3))
    _loop(session, model, optimizer, _batches(7), accumulation=3)
    assert session.global_step == 3
    session.finalize()


def test_lr_validation():
    with pytest.raises(ValueError, match=r"^schedule 'cosine' needs end \(epochs\): it runs from start to end$"):
        LearningRateModifier(schedule="cosine", init_lr=0.1)
    with pytest.raises(ValueError, match=r"^schedule 'step' needs step_size \(epochs between decays\)$"):
        LearningRateModifier(schedule="step", init_lr=0.1)
    with pytest.raises(ValueError, match=r"^unknown schedule 'exp'; use one of constant, linear, cosine, step$"):
        LearningRateModifier(schedule="exp", init_lr=0.1)
    with pytest.raises(ValueError, match=r"^init_lr must be a finite number > 0, got 0\.0$"):
        LearningRateModifier(init_lr=0)
    # inf was taken and written into the optimizer (found by a tester)
    with pytest.raises(ValueError, match=r"^init_lr must be a finite number > 0, got inf$"):
        LearningRateModifier(init_lr=float("inf"))
    with pytest.raises(ValueError, match=r"^final_lr must be a finite number >= 0, got inf$"):
        LearningRateModifier(schedule="linear", init_lr=0.1, final_lr=float("inf"), end=1)
    with pytest.raises(ValueError, match=r"^gamma must be a finite number > 0, got inf$"):
        LearningRateModifier(schedule="step", init_lr=0.1, step_size=1, gamma=float("inf"))
    with pytest.raises(ValueError, match=r"^init_lr must be a finite number > 0, got inf$"):  # not an OverflowError
        LearningRateModifier(init_lr=10**400)


@pytest.mark.parametrize(
    ("schedule", "kwargs", "message"),
    [
        ("exp", {}, "unknown schedule 'exp'; use one of constant, linear, cosine, step"),
        ("step", {}, "schedule 'step' needs step_size (epochs between decays)"),
        ("linear", {}, "schedule 'linear' needs end (epochs): it runs from start to end"),
        ("cosine", {"step_size": 1.0}, "schedule 'cosine' needs end (epochs): it runs from start to end"),
    ],
)
def test_scheduled_lr_refuses_missing_arguments_with_value_error(schedule, kwargs, message):
    with pytest.raises(ValueError) as info:
        scheduled_lr(schedule, 0.5, init_lr=0.1, **kwargs)
    assert str(info.value) == message


# --- Distillation -------------------------------------------------------------------


def test_distillation_loss_equals_hand_computed_value():
    student, teacher = TinyLM(vocab=3, hidden=4, seed=0), TinyLM(vocab=3, hidden=4, seed=1)
    mod = OutputDistillationModifier(temperature=2.0, alpha=0.25)
    session = Session([mod])
    initialize(session, model=student, teacher=teacher)
    ids = torch.tensor([[0, 2, 1]])
    mask = torch.tensor([[1, 1, 0]])  # last position is padding: excluded from the KL mean
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    session.batch_start(batch=batch)
    out = student(**batch)
    combined = session.loss_calculated(out.loss)

    # by hand, with plain Python floats
    s_logits = out.logits.detach()[0].tolist()
    with torch.no_grad():
        t_logits = teacher(input_ids=ids).logits[0].tolist()

    def softmax(xs):
        m = max(xs)
        e = [math.exp(x - m) for x in xs]
        return [v / sum(e) for v in e]

    kls = []
    for p in range(2):
        q_t = softmax([x / 2.0 for x in t_logits[p]])
        q_s = softmax([x / 2.0 for x in s_logits[p]])
        kls.append(sum(a * (math.log(a) - math.log(b)) for a, b in zip(q_t, q_s, strict=True)))
    kd = 4.0 * sum(kls) / 2
    expected = 0.75 * float(out.loss.detach()) + 0.25 * kd
    assert float(combined.detach()) == pytest.approx(expected, rel=1e-5)
    assert float(mod.last_distill_loss) == pytest.approx(kd, rel=1e-5)
    combined.backward()  # differentiable w.r.t. the student only
    assert student.fc1.weight.grad is not None and teacher.fc1.weight.grad is None
    session.batch_end()
    session.finalize()
    assert mod.num_hooks == 0 and not student._forward_hooks


def test_distillation_gives_the_teacher_back_its_training_modes_at_finalize():
    student, teacher = TinyLM(seed=0), TinyLM(seed=1)
    teacher.train()
    teacher.fc2.eval()  # a mixed teacher: each module gets its own mode back
    session = Session([OutputDistillationModifier()])
    initialize(session, model=student, teacher=teacher)
    assert not any(m.training for m in teacher.modules())  # eval while the session runs
    batch = _batches(1)[0]
    session.batch_start(batch=batch)
    session.loss_calculated(student(**batch).loss).backward()
    session.batch_end()
    session.finalize()
    assert [(name, m.training) for name, m in teacher.named_modules()] == [
        ("", True),
        ("embed", True),
        ("fc1", True),
        ("fc2", False),
        ("lm_head", True),
    ]


def test_distillation_ignores_the_forward_of_a_deep_copy_of_the_student():
    """A deep copy of the student made after initialize (an EMA / ``AveragedModel`` copy) carries the capture hook in
    its copied ``_forward_hooks``; its forward after the student's must not replace the student's logits (found by a
    tester: the distillation term was computed on the copy's logits, and the student got no gradient from it)."""
    import copy

    def run(copy_forward: bool) -> tuple[float, torch.Tensor]:
        student, teacher = TinyLM(seed=0), TinyLM(seed=1)
        session = Session([OutputDistillationModifier(alpha=1.0)])
        initialize(session, model=student, teacher=teacher)
        ema = copy.deepcopy(student)
        with torch.no_grad():  # the copy computes other logits
            ema.lm_head.weight.mul_(3.0)
        batch = _batches(1)[0]
        session.batch_start(batch=batch)
        out = student(**batch)
        if copy_forward:
            ema(**batch)
        loss = session.loss_calculated(out.loss)
        loss.backward()
        session.batch_end()
        session.finalize()
        return float(loss.detach()), student.lm_head.weight.grad.clone()

    alone, with_copy = run(False), run(True)
    assert with_copy[0] == alone[0]
    assert torch.equal(with_copy[1], alone[1]) and float(alone[1].abs().sum()) > 0


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.0])
def test_distillation_temperature_must_be_finite_and_positive(value):
    with pytest.raises(ValueError) as info:
        OutputDistillationModifier(temperature=value)
    assert str(info.value) == f"temperature must be a finite number > 0, got {value!r}"


def test_an_integrations_missing_state_error_names_a_misspelled_key_too():
    """The integrations rebuild the message with their own advice; the "misspelling?" line was lost there (found by
    a tester)."""
    session = Session([OutputDistillationModifier()])
    with pytest.raises(MissingStateError) as info:
        initialize(session, model=TinyLM(), teachr=TinyLM(seed=1))
    assert "'teachr' was given: a misspelling of 'teacher'?" in str(info.value).splitlines()


def test_distillation_kl_is_zero_for_identical_logits():
    x = torch.randn(2, 3, 5)
    assert float(distillation_kl(x, x.clone(), 3.0)) == pytest.approx(0.0, abs=1e-6)


def test_distillation_without_forward_warns_and_keeps_the_loss():
    session = Session([OutputDistillationModifier()])
    initialize(session, model=TinyLM(), teacher=TinyLM(seed=2))
    session.batch_start()
    with pytest.warns(RuntimeWarning, match="without a training forward"):
        assert float(session.loss_calculated(torch.tensor(1.0))) == 1.0


# --- MissingStateError before any step -----------------------------------------------


def test_missing_teacher_and_optimizer_reported_before_any_step():
    model = TinyLM()
    session = Session([OutputDistillationModifier(), LearningRateModifier(init_lr=0.1)])
    session.update_state(model=model, steps_per_epoch=4)
    with pytest.raises(MissingStateError) as info:
        initialize(session)
    err = info.value
    assert err.missing == {
        "OutputDistillationModifier": frozenset({"teacher"}),
        "LearningRateModifier": frozenset({"optimizer"}),
    }
    text = str(err)
    assert "OutputDistillationModifier" in text and "LearningRateModifier" in text
    assert "session.update_state(teacher=teacher)" in text
    assert "session.update_state(optimizer=optimizer)" in text
    assert session.lifecycle == "staging" and session.global_step == 0


def test_recipe_yaml_uses_registered_names():
    recipe = """
    train:
      ConstantPruningModifier: {}
      LearningRateModifier: {schedule: linear, init_lr: 0.01, end: 1}
      OutputDistillationModifier: {temperature: 3, alpha: 0.7}
    """
    session = Session(recipe)
    assert [type(m).__name__ for m in session.modifiers] == [
        "ConstantPruningModifier",
        "LearningRateModifier",
        "OutputDistillationModifier",
    ]
    with pytest.raises(RecipeError) as info:
        Session("train:\n  OutputDistillationModifier: {alpha: 2}\n")
    assert str(info.value) == (
        "recipe <text>, line 2, stage 'train', modifier OutputDistillationModifier, argument 'alpha': "
        "alpha must be a number in [0, 1], got 2.0"
    )


# --- the lifecycle contract (llmc_fsm.testing) ----------------------------------------


@pytest.mark.parametrize(
    ("factory", "state"),
    [
        (ConstantPruningModifier, lambda: {"model": TinyLM()}),
        (lambda: MagnitudePruningModifier(sparsity=0.5), lambda: {"model": TinyLM()}),
        (
            lambda: MagnitudePruningModifier(init_sparsity=0.1, final_sparsity=0.5, end=2, update=1),
            lambda: {"model": TinyLM(), "steps_per_epoch": 1},
        ),
        (OutputDistillationModifier, lambda: {"model": TinyLM(), "teacher": TinyLM(seed=3)}),
        (
            lambda: LearningRateModifier(schedule="linear", init_lr=0.1, end=2),
            lambda: {"optimizer": torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), "steps_per_epoch": 2},
        ),
    ],
)
@pytest.mark.filterwarnings("ignore:OutputDistillationModifier:RuntimeWarning")
def test_modifiers_obey_the_lifecycle_contract(factory, state):
    from llmc_fsm.testing import check_modifier

    check_modifier(factory, state, max_examples=200, loss_factory=lambda: torch.tensor(1.0))


# --- checkpoint and resume (issue 10) ---------------------------------------------------------------------


def _resume_recipe() -> list:
    return [
        ConstantPruningModifier(targets=["fc1"]),
        MagnitudePruningModifier(targets=["fc2"], init_sparsity=0.1, final_sparsity=0.6, end=1.5, update=0.25),
        LearningRateModifier(schedule="cosine", init_lr=0.05, final_lr=0.001, end=2),
        OutputDistillationModifier(temperature=2.0, alpha=0.5),
    ]


def _fresh_run(seed: int = 0):
    """Student (fc1 pre-pruned), teacher, AdamW, a session staged but not initialized."""
    model = TinyLM(seed=seed)
    if seed == 0:
        with torch.no_grad():
            model.fc1.weight[model.fc1.weight.abs() < model.fc1.weight.abs().median()] = 0.0
    teacher = TinyLM(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    session = Session(_resume_recipe())
    session.update_state(model=model, teacher=teacher, optimizer=optimizer, steps_per_epoch=steps_per_epoch(6, 2))
    return model, optimizer, session


def _train(session, model, optimizer, batches, *, epochs, accumulation, start=(0, 0), save_at=None, directory=None):
    """The documented plain loop; returns {global_step: (lr, fc1 zeros, fc2 zeros, distill loss)} per step."""
    seen = {}
    start_epoch, skip = start
    for epoch in range(start_epoch, epochs):
        for i, batch in enumerate(batches):
            if epoch == start_epoch and i < skip:
                continue
            session.batch_start(batch=batch)
            loss = session.loss_calculated(model(**batch).loss)
            (loss / accumulation).backward()
            stepped = is_step(i, len(batches), accumulation)
            if stepped:
                optimizer_step(session, optimizer)
            session.batch_end()
            if stepped:
                distill = session.modifiers[3].last_distill_loss
                seen[session.global_step] = (
                    optimizer.param_groups[0]["lr"],
                    (model.fc1.weight == 0).clone(),
                    (model.fc2.weight == 0).clone(),
                    float(distill),
                )
                if session.global_step == save_at:
                    save_file(model.state_dict(), str(directory / "model.safetensors"))
                    torch.save(optimizer.state_dict(), directory / "optimizer.pt")
                    session.save(directory / "session")
                    return seen
    session.finalize()
    return seen


@pytest.fixture(scope="module")
def reference_run():
    """The uninterrupted run: 3 epochs of 6 batches, accumulation 2 (3 optimizer steps per epoch, 9 in all)."""
    model, optimizer, session = _fresh_run()
    initialize(session)
    seen = _train(session, model, optimizer, _batches(6), epochs=3, accumulation=2)
    return seen, {n: p.detach().clone() for n, p in model.named_parameters()}, list(session.modifiers[1].history)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_interrupted_and_resumed_run_is_identical_to_an_uninterrupted_one(tmp_path, reference_run, k):
    """ConstantPruning + gradual magnitude + cosine LR + distillation; interrupted after k optimizer steps."""
    reference, ref_weights, ref_history = reference_run
    batches = _batches(6)
    assert sorted(reference) == list(range(1, 10))
    model, optimizer, session = _fresh_run()
    initialize(session)
    first = _train(session, model, optimizer, batches, epochs=3, accumulation=2, save_at=k, directory=tmp_path)
    assert sorted(first) == list(range(1, k + 1))
    del model, optimizer, session

    model, optimizer, session = _fresh_run(seed=3)  # a new process starts from other weights
    model.load_state_dict(load_file(str(tmp_path / "model.safetensors")))
    optimizer.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    initialize(session, checkpoint=tmp_path / "session")
    assert session.global_step == k and session.lifecycle == "running"
    start = resume_position(session, len(batches), 2)
    assert start == (k // 3, (k % 3) * 2)
    resumed = _train(session, model, optimizer, batches, epochs=3, accumulation=2, start=start)
    assert sorted(resumed) == list(range(k + 1, 10))
    for step, (lr, zeros1, zeros2, distill) in resumed.items():  # same schedule values and masks at every step
        ref_lr, ref1, ref2, ref_distill = reference[step]
        assert lr == ref_lr, step
        assert torch.equal(zeros1, ref1) and torch.equal(zeros2, ref2), step
        assert distill == ref_distill, step
    assert session.modifiers[1].history == ref_history
    assert ref_history[-1] == (5 / 3, 0.6)  # end (1.5) reached at the first batch of step 5
    for name, p in model.named_parameters():  # bitwise-identical weights after 9 steps
        assert torch.equal(p, ref_weights[name]), name


def test_resume_into_another_recipe_is_refused_and_leaves_the_session_as_it_was(tmp_path):
    """Refused before ``initialize`` (the recipe differs): the session stays ``staging`` with its state, nothing
    initialized, so ``initialize`` may be called again (before, it was reset to ``created``, its state dropped, while
    the message said "Nothing was loaded")."""
    model, optimizer, session = _fresh_run()
    initialize(session)
    _train(session, model, optimizer, _batches(6), epochs=1, accumulation=2, save_at=2, directory=tmp_path)
    session.finalize()
    other = Session([*_resume_recipe()[:3], OutputDistillationModifier(temperature=4.0, alpha=0.5)])
    other.update_state(model=model, teacher=TinyLM(seed=7), optimizer=optimizer, steps_per_epoch=3)
    with pytest.raises(CheckpointError) as info:
        initialize(other, checkpoint=tmp_path / "session")
    assert info.value.differences == (
        "modifier OutputDistillationModifier: argument 'temperature' is 2.0 in the checkpoint, 4.0 now",
    )
    assert other.lifecycle == "staging" and len(model._forward_hooks) == 0
    assert sorted(other.state) == ["model", "optimizer", "steps_per_epoch", "teacher"]
    assert all(m._binding is None for m in other.modifiers)  # never initialized
    initialize(other)  # the same session, without the checkpoint
    assert other.lifecycle == "initialized"
    other.finalize()


def test_a_checkpoint_a_modifier_refuses_after_initialize_puts_the_session_back_as_it_was(tmp_path, monkeypatch):
    """What only a modifier can refuse shows after ``initialize``: the session is reset and given its state back
    (``staging``, hooks removed), not left ``created`` with nothing."""
    model, optimizer, session = _fresh_run()
    initialize(session)
    _train(session, model, optimizer, _batches(6), epochs=1, accumulation=2, save_at=2, directory=tmp_path)
    session.finalize()
    model, optimizer, session = _fresh_run()
    staged = dict(session.state.values)

    def refuse(self, state):
        raise ValueError("not mine")

    monkeypatch.setattr(OutputDistillationModifier, "load_state_dict", refuse)
    with pytest.raises(CheckpointError, match=r"OutputDistillationModifier.load_state_dict\(\) refused its part"):
        initialize(session, checkpoint=tmp_path / "session")
    assert session.lifecycle == "staging" and dict(session.state.values) == staged
    assert len(model._forward_hooks) == 0


def test_resume_position_arithmetic():
    session = Session()
    session.initialize()
    for step, expected in [(0, (0, 0)), (2, (0, 4)), (3, (1, 0)), (7, (2, 2))]:
        session._step = step  # a checkpointed step count
        assert resume_position(session, 5, 2) == expected, step  # 5 batches, 2 per step -> 3 steps per epoch
    with pytest.raises(ValueError, match="batches_per_epoch must be an int >= 1, got 0"):
        resume_position(session, 0)


# --- Devices: state follows the student's parameters; the teacher is placed by the integration -----------------


def _fake_cuda(monkeypatch, *, count: int, current: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def _no_cuda_message(spec: str) -> str:
    return (
        f"teacher_device is {spec!r} but torch sees no CUDA device (torch {torch.__version__}, built with CUDA "
        f"{torch.version.cuda or 'none'}); use cpu, or auto to take CUDA only where it exists"
    )


@pytest.mark.parametrize(
    ("spec", "count", "message"),
    [
        ("cuda", 0, _no_cuda_message("cuda")),
        ("cuda:0", 0, _no_cuda_message("cuda:0")),
        ("cuda:2", 2, "teacher_device is 'cuda:2' but torch sees 2 CUDA device(s) (cuda:0 to cuda:1); pick one "
         "of those"),
        ("gpu", 0, "teacher_device must be one of auto, cpu, cuda or cuda:N (N a CUDA device index), got 'gpu'"),
        (3, 0, "teacher_device must be one of auto, cpu, cuda or cuda:N (N a CUDA device index), got 3"),
    ],
)
def test_teacher_device_is_refused_in_one_line_before_anything_is_initialized(monkeypatch, spec, count, message):
    _fake_cuda(monkeypatch, count=count)
    student, teacher = TinyLM(seed=0), TinyLM(seed=1)
    session = Session([OutputDistillationModifier()])
    with pytest.raises(ValueError) as info:
        initialize(session, model=student, teacher=teacher, teacher_device=spec)
    assert str(info.value) == message
    assert session.lifecycle == "created" and "model" not in session.state
    assert not student._forward_hooks  # nothing hooked


def test_teacher_device_resolves_like_the_oneshot_device_and_the_teacher_is_moved_there(monkeypatch):
    """With CUDA faked (2 devices, current 1) ``auto`` and ``cuda`` name cuda:1; the teacher's ``to`` is called with
    that device after initialize (recorded: the real move is tests/test_cuda.py's), and not at all by default while
    it is already on the student's device."""
    moved: list[torch.device] = []

    class Recorded(TinyLM):
        def to(self, *args, **kwargs):
            moved.append(args[0])
            return self

    _fake_cuda(monkeypatch, count=2, current=1)
    for spec, expected in (("auto", torch.device("cuda", 1)), ("cuda", torch.device("cuda", 1)),
                           ("cuda:0", torch.device("cuda", 0)), (None, None), ("cpu", None)):  # fmt: skip
        moved.clear()
        session = Session([OutputDistillationModifier()])
        initialize(session, model=TinyLM(seed=0), teacher=Recorded(seed=1), teacher_device=spec)
        assert session.lifecycle == "initialized"
        assert moved == ([] if expected is None else [expected]), spec
        session.finalize()


def test_the_teacher_is_placed_only_when_a_modifier_uses_it(monkeypatch):
    moved = []

    class Recorded(TinyLM):
        def to(self, *args, **kwargs):
            moved.append(args[0])
            return self

    _fake_cuda(monkeypatch, count=1)
    session = Session([ConstantPruningModifier()])
    initialize(session, model=TinyLM(), teacher=Recorded(seed=1), teacher_device="cuda")
    assert moved == []  # no modifier requires 'teacher': it stays out of device memory
    session.finalize()


def test_a_teacher_on_the_meta_device_is_refused_before_initialize():
    with torch.device("meta"):
        teacher = TinyLM(seed=1)
    student = TinyLM(seed=0)
    session = Session([OutputDistillationModifier()])
    with pytest.raises(ValueError) as info:
        initialize(session, model=student, teacher=teacher)
    assert str(info.value) == (
        "the teacher's weights are on the meta device (not loaded); load them (e.g. from_pretrained without a meta "
        "device map) before training"
    )
    assert session.lifecycle == "created" and not student._forward_hooks


def test_masks_are_made_on_the_weights_device():
    from llmc_fsm_pruning.constant import MaskSet

    weight = torch.empty(3, 4, device="meta", dtype=torch.float16)
    masks = MaskSet()
    masks.set("w", weight, torch.tensor([[True, False, True, False]] * 3))  # a keep-mask read on the CPU
    assert masks.masks[0].device == torch.device("meta") and masks.masks[0].dtype == torch.float16
    assert masks.keep("w").device == torch.device("meta") and masks.keep("w").dtype == torch.bool


def test_constant_pruning_masks_follow_a_model_cast_after_they_were_taken():
    model = TinyLM()
    with torch.no_grad():
        for layer in (model.fc1, model.fc2):
            layer.weight[:, ::2] = 0.0  # half the columns zero
    before = _zeros(model)
    mod = ConstantPruningModifier()
    session = Session([mod])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(session, model=model, optimizer=optimizer)
    batches = _batches(4)
    _loop(session, model, optimizer, batches[:2])  # masks taken at the first batch, float32
    assert {m.dtype for m in mod._masks.masks} == {torch.float32}
    model.to(torch.float64)  # the same Parameter objects, cast: the masks are cast at the next re-application
    _loop(session, model, optimizer, batches[2:])
    assert {m.dtype for m in mod._masks.masks} == {torch.float64}
    after = _zeros(model)
    assert all(torch.equal(after[n], before[n]) for n in ("fc1", "fc2"))
    assert all(int(after[n].sum()) == 8 * 4 for n in ("fc1", "fc2"))
    session.finalize()
    assert mod.measured_sparsity == pytest.approx(0.5)


def test_to_device_moves_every_tensor_of_nested_inputs_and_copies_none_already_there():
    from collections import namedtuple

    from llmc_fsm_training.distillation import to_device

    Pair = namedtuple("Pair", "a b")
    ids, mask = torch.tensor([[1, 2]]), torch.ones(1, 2)
    moved = to_device(({"input_ids": ids, "mask": [mask, "keep"]}, Pair(ids, 3), None), torch.device("meta"))
    assert moved[0]["input_ids"].device.type == "meta" and moved[0]["input_ids"].shape == (1, 2)
    assert moved[0]["mask"][0].device.type == "meta" and moved[0]["mask"][1] == "keep"
    assert type(moved[1]) is Pair and moved[1].a.device.type == "meta" and moved[1].b == 3 and moved[2] is None
    same = to_device({"input_ids": ids}, torch.device("cpu"))
    assert same["input_ids"] is ids


def test_the_teacher_computes_on_its_own_device_and_its_logits_come_back_to_the_students():
    """A teacher "on the meta device" (its one buffer there) gets the student's inputs moved there; the logits it
    returns (CPU, fixed) are compared with the student's on the student's device: the KL is the hand value."""

    seen = {}

    class Elsewhere(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("anchor", torch.empty(1, device="meta"))

        def forward(self, input_ids, attention_mask=None):
            seen["input_ids"], seen["attention_mask"] = input_ids.device, attention_mask.device
            return type("Out", (), {"logits": torch.zeros((*input_ids.shape, 11))})()

    student = TinyLM(seed=0)
    mod = OutputDistillationModifier(temperature=1.0, alpha=1.0)
    session = Session([mod])
    session.initialize(model=student, teacher=Elsewhere())  # the integrations refuse a meta teacher; the modifier not
    batch = _batches(1)[0]
    session.batch_start(batch=batch)
    out = student(**batch)
    loss = session.loss_calculated(out.loss)
    assert seen == {"input_ids": torch.device("meta"), "attention_mask": torch.device("meta")}
    log_q_s = torch.log_softmax(out.logits.detach().double(), dim=-1)
    expected = (torch.full_like(log_q_s, 1 / 11) * (math.log(1 / 11) - log_q_s)).sum(-1).mean()  # KL(uniform||q_s)
    assert loss.device == torch.device("cpu")
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    session.batch_end()
    session.finalize()


def test_a_calibration_only_modifier_in_a_training_loop_is_named_at_the_first_batch(caplog):
    """Round-to-nearest quantization acts on calibration events only: in training batches it does nothing (no
    quantization-aware training). One warning line at the run's first batch names it (before: nothing, and the
    finalized model was silently float)."""
    from llmc_fsm_quantization import QuantizationModifier

    model = TinyLM()
    session = Session([QuantizationModifier(scheme="W8A8", ignore=["lm_head"]), LearningRateModifier(init_lr=0.1)])
    session.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=2)
    with caplog.at_level("WARNING", logger="llmc_fsm.session.events"):
        for batch in _batches(2):
            session.batch_start(batch)
            session.loss_calculated(model(**batch).loss)
            session.batch_end()
    assert [r.getMessage() for r in caplog.records if r.name == "llmc_fsm.session.events"] == [
        "QuantizationModifier compresses on calibration events only (calibration_start ... calibration_end): in "
        "training batches it does nothing (quantization-aware training is not implemented); compress after "
        "training, e.g. llmc_fsm.oneshot(model, recipe), or send the calibration events"
    ]
    session.finalize()
    caplog.clear()  # calibrated first: it has compressed, nothing to say
    model = TinyLM()
    session = Session([QuantizationModifier(scheme="W8A8", ignore=["lm_head"])])
    session.initialize(model=model)
    session.calibration_start()
    session.calibration_end()
    with caplog.at_level("WARNING", logger="llmc_fsm.session.events"):
        session.batch_start()
        session.batch_end()
    assert [r for r in caplog.records if r.name == "llmc_fsm.session.events"] == []
    assert hasattr(model.fc1, "quantization_scheme")
    session.finalize()


def test_distillation_takes_a_number_as_the_loss():
    """``loss_calculated`` takes "a tensor, or a number": with distillation a float loss gave an AttributeError."""
    model, teacher = TinyLM(), TinyLM(seed=7)
    session = Session([OutputDistillationModifier(temperature=2.0, alpha=0.5)])
    session.initialize(model=model, teacher=teacher)
    batch = _batches(1)[0]
    session.batch_start(batch)
    out = model(**batch)
    loss = session.loss_calculated(out.loss.item())
    kd = distillation_kl(out.logits, teacher(**batch).logits, 2.0, batch["attention_mask"])
    torch.testing.assert_close(loss, 0.5 * torch.tensor(out.loss.item()) + 0.5 * kd, rtol=1e-6, atol=1e-6)
    session.batch_end()
    session.finalize()
