"""Misuse of the training integrations and modifiers that was taken without a word (found by a tester, 2026-12-07)."""

from __future__ import annotations

import logging
import os

import attrs
import pytest
import torch
from llmc_fsm_pruning.constant import ConstantPruningModifier
from llmc_fsm_pruning.magnitude import MagnitudePruningModifier
from llmc_fsm_training import LearningRateModifier, OutputDistillationModifier
from tiny_llama import llama
from transformers import TrainingArguments

from llmc_fsm import LifecycleError, Modifier, ModifierError, RecipeError, Session
from llmc_fsm.integrations.torch import initialize, optimizer_step, resume_position
from llmc_fsm.integrations.transformers import SessionTrainer

os.environ.setdefault("OMP_NUM_THREADS", "1")
VOCAB = 64


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int = 8) -> None:
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _llama(seed: int = 0, vocab: int = VOCAB):
    return llama(seed=seed, vocab=vocab, kv_heads=4)


def _args(tmp_path, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        per_device_train_batch_size=2,
        max_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model, weights) -> bool:
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


@attrs.define(kw_only=True, slots=False, eq=False)
class _FailsAtInitialize(Modifier):
    """Raises in ``on_initialize``; with ``write`` it zeroes the model's first Linear weight first."""

    required_state = frozenset({"model"})
    write: bool = False

    def on_initialize(self, state):
        if self.write:
            with torch.no_grad():
                state.model[0].weight.zero_()
        raise RuntimeError("boom")


# --- SessionTrainer: the session acts on the objects the Trainer uses ------------------------------------------


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (
            {"model": "other", "tokenizer": "tok"},
            "SessionTrainer(session_state=...) must not hold 'model': the trainer stages it itself, and the session "
            "would use the given one instead of the Trainer's own; pass SessionTrainer(model=...) instead",
        ),
        (
            {"teacher": "t1", "optimizer": "opt"},
            "SessionTrainer(session_state=...) must not hold 'teacher', 'optimizer': the trainer stages them itself, "
            "and the session would use the given ones instead of the Trainer's own; pass SessionTrainer(teacher=...), "
            "SessionTrainer(optimizers=(optimizer, scheduler)) instead",
        ),
    ],
)
def test_trainer_refuses_model_teacher_optimizer_in_session_state(tmp_path, state, message):
    """Before: a model in session_state replaced the Trainer's (it trained model=, the session pruned the other and
    reported its sparsity); a teacher there was used while check_teacher had checked teacher=."""
    session = Session([OutputDistillationModifier()])
    with pytest.raises(ValueError) as info:
        SessionTrainer(
            model=_llama(), args=_args(tmp_path), train_dataset=_Data(2), session=session, session_state=state
        )
    assert str(info.value) == message
    assert session.lifecycle == "created"


def test_trainer_refuses_a_session_model_that_is_not_the_trained_model(tmp_path):
    """Before: trainer.session.update_state(model=other) was taken: the Trainer trained its model while the session
    pruned ``other`` to 0.5 and measured_sparsity reported it."""
    model, other = _llama(), _llama(9)
    before_model, before_other = _weights(model), _weights(other)
    prune = MagnitudePruningModifier(sparsity=0.5)
    trainer = SessionTrainer(model=model, args=_args(tmp_path), train_dataset=_Data(2), recipe=[prune])
    trainer.session.update_state(model=other)
    with pytest.raises(ValueError) as info:
        trainer.train()
    assert str(info.value) == (
        "SessionTrainer: the session's state 'model' (LlamaForCausalLM, given with session.update_state(model=...)) "
        "is not the model the Trainer trains (LlamaForCausalLM, SessionTrainer(model=...)), so the session would "
        "compress a model that is not trained; leave state 'model' to SessionTrainer (it stages model=) or build the "
        "trainer with SessionTrainer(model=that_model)"
    )
    assert trainer.session.lifecycle == "staging" and trainer.session.state.model is other
    assert _same(model, before_model) and _same(other, before_other) and prune.measured_sparsity is None


def test_trainer_takes_the_trained_model_inside_a_wrapper(tmp_path):
    """The model check unwraps (DataParallel here; DDP, torch.compile, peft alike): the same module is not refused."""
    model = _llama()
    prune = MagnitudePruningModifier(sparsity=0.5)
    trainer = SessionTrainer(model=model, args=_args(tmp_path), train_dataset=_Data(2), recipe=[prune])
    trainer.session.update_state(model=torch.nn.DataParallel(model))
    trainer.train()
    assert trainer.session.lifecycle == "finalized" and trainer.session.state.model is model


def test_trainer_rolled_back_initialize_says_to_call_train_again(tmp_path):
    """Before: the error inside trainer.train() said "call initialize() again with all its arguments", a call the
    user never makes there."""
    recipe = [_FailsAtInitialize()]
    trainer = SessionTrainer(model=_llama(), args=_args(tmp_path), train_dataset=_Data(2), recipe=recipe)
    with pytest.raises(ModifierError) as info:
        trainer.train()
    assert str(info.value) == (
        "_FailsAtInitialize.on_initialize() raised RuntimeError: boom (during initialize()). Rolled back: 0 "
        "modifier(s) already initialized were finalized and their hooks removed; the session is still 'staging' and "
        "nothing passed to initialize() was stored. Fix the cause and call trainer.train() again (the trainer "
        "initializes the session at on_train_begin, with the state staged as before)."
    )
    assert info.value.modifier == "_FailsAtInitialize" and info.value.hook == "on_initialize"
    assert isinstance(info.value.__cause__, RuntimeError) and str(info.value.__cause__) == "boom"
    assert trainer.session.lifecycle == "staging"


# --- plain loops -------------------------------------------------------------------------------------------------


def _jump_loop(session, model, optimizer, *, batch_counter: bool) -> list[float]:
    """Two epochs of 8 batches, accumulation 2, passing a global_step; returns the rate of each optimizer step."""
    rates, batch = [], 0
    for _ in range(2):
        for i in range(8):
            session.batch_start(global_step=batch if batch_counter else session.global_step)
            loss = session.loss_calculated(model(torch.ones(1, 2)).sum())
            (loss / 2).backward()
            if i % 2 == 1:
                optimizer_step(session, optimizer)
                rates.append(optimizer.param_groups[0]["lr"])
            session.batch_end()
            batch += 1
    return rates


def test_global_step_ahead_of_the_counted_steps_warns_once(caplog):
    """Before: a loop with accumulation 2 passing its batch counter as global_step was taken silently: a linear
    rate with end 1 reached 0 after 3 of 4 steps and the run ended at global step 16 after 8 optimizer steps."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    lr = LearningRateModifier(schedule="linear", init_lr=0.1, final_lr=0.0, end=1)
    session = Session([lr])
    initialize(session, model=model, optimizer=optimizer, steps_per_epoch=4)
    with caplog.at_level(logging.WARNING, logger="llmc_fsm"):
        _jump_loop(session, model, optimizer, batch_counter=True)
    jumps = [r.getMessage() for r in caplog.records if "jumps ahead" in r.getMessage()]
    assert jumps == [
        "batch_start(global_step=3): the session has counted 2 optimizer steps (optim_post_step() calls) and the "
        "given step jumps ahead of them, so the schedules skip 1 step(s); with gradient accumulation that is usually "
        "a batch counter passed where the optimizer steps completed belong (the same value again while gradients "
        "accumulate). Pass the optimizer-step count, or leave global_step out: the session counts optim_post_step() "
        "itself. Said once per run"
    ]
    assert session.global_step == 16  # still taken: a jump forward is allowed (docs/lifecycle.md)
    session.finalize()


def test_global_step_equal_to_the_counted_steps_does_not_warn(caplog):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    session = Session([LearningRateModifier(schedule="linear", init_lr=0.1, final_lr=0.0, end=1)])
    initialize(session, model=model, optimizer=optimizer, steps_per_epoch=4)
    with caplog.at_level(logging.WARNING, logger="llmc_fsm"):
        rates = _jump_loop(session, model, optimizer, batch_counter=False)
    assert not [r for r in caplog.records if "jumps ahead" in r.getMessage()]
    assert rates == pytest.approx([0.1, 0.075, 0.05, 0.025, 0.0, 0.0, 0.0, 0.0])
    session.finalize()


def test_resume_position_refuses_counts_other_than_the_session_steps_per_epoch():
    """Before: with the session's steps_per_epoch 5 (10 batches, accumulation 2), forgetting the accumulation gave
    (0, 7) and a loader of 3 batches (3, 2), silently."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    session = Session([LearningRateModifier(schedule="linear", init_lr=0.1, end=2)])
    initialize(session, model=model, optimizer=optimizer, steps_per_epoch=5)
    for _ in range(7):
        session.batch_start()
        optimizer_step(session, optimizer)
        session.batch_end()
    assert resume_position(session, 10, 2) == (1, 4)
    with pytest.raises(ValueError) as info:
        resume_position(session, 10)
    assert str(info.value) == (
        "resume_position(): steps_per_epoch is 5 in the session, 10 from batches_per_epoch 10 and "
        "gradient_accumulation_steps 1 (ceil(10 / 1)); pass the length of the loader the run trains on and the "
        "gradient_accumulation_steps that gave the session its steps_per_epoch"
    )
    with pytest.raises(ValueError, match=r"^resume_position\(\): steps_per_epoch is 5 in the session, 2 from "):
        resume_position(session, 3, 2)
    assert session.global_step == 7


# --- modifiers -----------------------------------------------------------------------------------------------------


def test_distillation_refuses_a_teacher_with_another_vocabulary_at_initialize():
    """Before: a teacher with 80 tokens for a student with 64 was initialized and failed only at the first
    loss_calculated, inside the training loop."""
    student, teacher = _llama(), _llama(1, vocab=80)
    session = Session([OutputDistillationModifier()])
    session.update_state(model=student, teacher=teacher)
    with pytest.raises(ModifierError) as info:
        session.initialize()
    assert str(info.value.__cause__) == (
        "the student's output vocabulary has 64 tokens and the teacher's 80 (output embeddings): distillation "
        "compares their logits token by token, so both need the same vocabulary size (a shared tokenizer is not enough "
        "when one model's embeddings were padded to another size); pass a teacher whose output size is the student's, "
        "or resize one model's embeddings (resize_token_embeddings) to match"
    )
    assert session.lifecycle == "staging" and not student._forward_hooks


def test_learning_rate_init_lr_zero_is_a_warmup_from_zero():
    """Before: init_lr 0 was refused ("must be a finite number > 0"), though a warmup from 0 is common (HF)."""
    warmup = LearningRateModifier(schedule="linear", init_lr=0.0, final_lr=1e-3, end=1)
    assert [warmup.lr_at(e) for e in (0.0, 0.5, 1.0)] == [0.0, 5e-4, 1e-3]
    assert LearningRateModifier(schedule="cosine", init_lr=0, final_lr=1e-3, end=1).lr_at(0.0) == 0.0
    with pytest.raises(ValueError) as info:
        LearningRateModifier(schedule="linear", init_lr=0.0, end=1)
    assert str(info.value) == (
        "init_lr and final_lr are both 0: schedule 'linear' would set the learning rate to 0 at every step; give "
        "final_lr > 0 (a warmup from 0 to final_lr)"
    )
    for schedule in ("constant", "step"):
        with pytest.raises(ValueError) as info:
            LearningRateModifier(schedule=schedule, init_lr=0.0, step_size=1)
        assert str(info.value) == "init_lr must be a finite number > 0, got 0.0"


def test_constant_learning_rate_without_schedule_needs_no_steps_per_epoch():
    """Before: it required steps_per_epoch "because the modifier has a start/end/update schedule in epochs", which
    it did not have."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    lr = LearningRateModifier(schedule="constant", init_lr=1e-3)
    session = Session([lr])
    session.initialize(optimizer=optimizer)
    session.batch_start()
    optimizer_step(session, optimizer)
    session.batch_end()
    session.finalize()
    assert optimizer.param_groups[0]["lr"] == 1e-3 and lr.last_lr == 1e-3
    assert LearningRateModifier(schedule="constant", init_lr=1e-3, start=1).required_keys() == {
        "optimizer",
        "steps_per_epoch",
    }
    assert LearningRateModifier(schedule="step", init_lr=1e-3, step_size=1).required_keys() == {
        "optimizer",
        "steps_per_epoch",
    }


def test_reused_modifiers_start_each_run_with_empty_read_outs():
    """Before: a LearningRateModifier reused in a second session kept last_lr 0.01 from the first (its rate not
    written in that run), while MagnitudePruningModifier.history was reset."""
    lr = LearningRateModifier(schedule="constant", init_lr=0.01, start=1)
    hold = ConstantPruningModifier()
    distill = OutputDistillationModifier()
    batch = {k: v[None] for k, v in _Data(1)[0].items()}

    def run(steps: int) -> None:
        student = _llama()
        student.train()
        optimizer = torch.optim.SGD(student.parameters(), lr=0.0)
        session = Session([lr, hold, distill])
        initialize(session, model=student, teacher=_llama(3), optimizer=optimizer, steps_per_epoch=1)
        for _ in range(steps):
            session.batch_start(batch=batch)
            session.loss_calculated(student(**batch).loss).backward()
            optimizer_step(session, optimizer)
            session.batch_end()
        if steps == 0:
            assert (lr.last_lr, hold.measured_sparsity, distill.last_distill_loss) == (None, None, None)
            assert distill.last_student_loss is None
        session.finalize()

    run(2)
    assert lr.last_lr == 0.01 and hold.measured_sparsity is not None and distill.last_distill_loss is not None
    run(0)


def test_bad_final_sparsity_is_the_one_problem_reported():
    """Before: final_sparsity 1.5 also gave "gradual mode needs both init_sparsity and final_sparsity", though both
    were given (a consequence of setting the bad value aside)."""
    recipe = "s:\n  MagnitudePruningModifier: {init_sparsity: 0.2, final_sparsity: 1.5, end: 1, update: 0.5}\n"
    with pytest.raises(RecipeError) as info:
        Session(recipe)
    assert str(info.value) == (
        "recipe <text>, line 2, stage 's', modifier MagnitudePruningModifier, argument 'final_sparsity': "
        "final_sparsity must be a number in [0, 1) (fraction of weights set to zero), got 1.5"
    )
    with pytest.raises(ValueError) as info:
        MagnitudePruningModifier(init_sparsity=0.2, end=1, update=0.5)
    assert str(info.value) == "gradual mode needs an initial and a final sparsity; missing: final_sparsity"


def test_initialize_that_changed_the_model_and_failed_allows_only_reset():
    """Before: the error's allowed calls listed update_state, and update_state was taken, but the initialize after it
    was still refused until reset()."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    session = Session([_FailsAtInitialize(write=True)])
    session.update_state(model=model)
    with pytest.raises(ModifierError):
        session.initialize()
    assert session.allowed_calls == {"reset"}
    with pytest.raises(LifecycleError) as info:
        session.update_state(model=torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert str(info.value) == (
        "update_state() refused: initialize() changed 1 parameter(s) of the model in place before a modifier failed "
        "(model modified by a failed hook; reload it), then call session.reset() and gather the state again. "
        "Allowed now: reset()."
    )
    assert info.value.allowed == ("reset",) and session.state.model is model
    session.reset()
    session.update_state(model=torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert session.lifecycle == "staging"
