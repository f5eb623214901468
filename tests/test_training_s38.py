"""Training findings of round s38 (found by testers): a teacher shared by two live sessions, the
``llmc_fsm.integrations.torch`` attribute, SessionTrainer's advice after a failure, a learning-rate overlap with
another live session, a swapped session folder on resume, and ``distillation_kl``'s refusals."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import tiny_llama
import torch
from llmc_fsm_pruning.constant import ConstantPruningModifier
from llmc_fsm_training import LearningRateModifier, OutputDistillationModifier, distillation_kl

from llmc_fsm import CheckpointError, LifecycleError, Modifier, ModifierError, Session

VOCAB = 64


# --- a teacher shared by two live sessions ---------------------------------------------------------


def _teacher() -> torch.nn.Sequential:
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5))
    teacher.train()
    teacher[0].eval()  # mixed modes: each module's own mode is given back
    return teacher


def _distill(teacher: torch.nn.Module, seed: int) -> tuple[Session, torch.nn.Module]:
    torch.manual_seed(seed)
    student = torch.nn.Linear(4, 8)
    session = Session([OutputDistillationModifier(temperature=2.0, alpha=1.0)])
    session.initialize(model=student, teacher=teacher)
    return session, student


def _kd(session: Session, student: torch.nn.Module, x: torch.Tensor) -> float:
    session.batch_start()
    student(x)
    session.loss_calculated(torch.tensor(0.0))
    session.batch_end()
    return float(session.modifiers[0].last_distill_loss)


def _reference_kd(student: torch.nn.Module, teacher_linear: torch.nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        s = torch.log_softmax(student(x).double() / 2.0, dim=-1)
        t = torch.log_softmax(teacher_linear(x).double() / 2.0, dim=-1)  # eval mode: no dropout
    return float((t.exp() * (t - s)).sum(-1).mean()) * 4.0


@pytest.mark.parametrize("end", ["finalize", "reset"])
def test_a_shared_teacher_stays_in_eval_mode_until_the_last_session_ends_then_gets_its_modes_back(end):
    """Before: session A's finalize put the shared teacher back in train mode while B still distilled from it (B's
    term ran the teacher's dropout), and B's finalize then "restored" the eval mode it had seen."""
    teacher = _teacher()
    a, _ = _distill(teacher, 1)
    b, student = _distill(teacher, 2)
    assert [m.training for m in teacher.modules()] == [False, False, False]
    getattr(a, end)()
    assert [m.training for m in teacher.modules()] == [False, False, False]  # B still uses it
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    expected = _reference_kd(student, teacher[0], x)
    assert _kd(b, student, x) == pytest.approx(expected, rel=1e-5)
    assert _kd(b, student, x) == pytest.approx(expected, rel=1e-5)
    getattr(b, end)()
    assert [m.training for m in teacher.modules()] == [True, False, True]  # as given before A's initialize


# --- llmc_fsm.integrations.torch as an attribute ----------------------------------------------------


def test_integrations_torch_attribute_is_the_submodule_the_advice_names():
    """Before: ``llmc_fsm.integrations.torch`` was PyTorch (the package did ``import torch``), so the library's advice
    ``llmc_fsm.integrations.torch.steps_per_epoch(...)`` failed with AttributeError when copied."""
    code = (
        "import llmc_fsm\n"
        "sub = llmc_fsm.integrations.torch\n"
        "print(sub.__name__, sub.steps_per_epoch(5, 2))\n"
        "try:\n"
        "    llmc_fsm.integrations.nope\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert done.stdout.splitlines() == [
        "llmc_fsm.integrations.torch 3",
        "module 'llmc_fsm.integrations' has no attribute 'nope'",
    ]


# --- a learning-rate modifier of another live session ---------------------------------------------


def test_lr_overlap_with_another_live_session_names_that_session_as_the_holder():
    """Before: the refusal said "their order in the recipe would decide the rate; keep one of them, or split the
    range", though the two modifiers were in two sessions (one left running, e.g. by an error in a notebook)."""
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    first = Session([LearningRateModifier(schedule="cosine", init_lr=0.1, end=2)])
    first.initialize(optimizer=optimizer, steps_per_epoch=2)
    second = Session([LearningRateModifier(schedule="linear", init_lr=0.1, start=1, end=3)])
    with pytest.raises(ModifierError) as info:
        second.initialize(optimizer=optimizer, steps_per_epoch=2)
    assert str(info.value.__cause__) == (
        "LearningRateModifier (epochs [1, 3)) would set the learning rate of an optimizer that LearningRateModifier "
        "of another live session already sets (epochs [0, 2), overlapping): that session holds the optimizer until "
        "it is finalized; call finalize() or reset() on it (one left running by an error, e.g. in a notebook), or "
        "give this session its own optimizer"
    )
    assert second.lifecycle == "created"
    first.reset()
    second.initialize(optimizer=optimizer, steps_per_epoch=2)
    assert second.lifecycle == "initialized"


# --- distillation_kl -----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_distillation_kl_refuses_a_temperature_that_is_not_a_finite_positive_number(temperature):
    """Before: temperature 0 returned NaN and a negative one a number."""
    logits = torch.randn(2, 3, 10)
    with pytest.raises(ValueError) as info:
        distillation_kl(logits, logits.clone(), temperature)
    assert str(info.value) == f"temperature must be a finite number > 0, got {temperature!r}"


def test_distillation_kl_refuses_a_mask_that_is_not_the_logits_leading_shape():
    """Before: such a mask was ignored and the term averaged over every position, padding included."""
    logits = torch.randn(2, 3, 10)
    with pytest.raises(ValueError) as info:
        distillation_kl(logits, logits.clone(), 2.0, torch.ones(3, 2))
    assert str(info.value) == (
        "attention_mask has shape (3, 2), the logits (2, 3, 10): the mask needs the logits' leading shape (2, 3), one "
        "entry per position (1 = real token); pass such a mask, or None to average over every position"
    )


# --- SessionTrainer -----------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

from transformers import TrainingArguments  # noqa: E402

from llmc_fsm.integrations.transformers import SESSION_DIR, SessionTrainer  # noqa: E402


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int = 8) -> None:
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _trainer(tmp_path, recipe, model=None, **kw) -> SessionTrainer:
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", max_steps=2,
                per_device_train_batch_size=2, disable_tqdm=True, dataloader_num_workers=0, seed=0,
                logging_strategy="no")  # fmt: skip
    base.update(kw)
    model = model if model is not None else tiny_llama.llama(seed=0, vocab=VOCAB, kv_heads=4)
    return SessionTrainer(model=model, args=TrainingArguments(**base), train_dataset=_Data(4), recipe=recipe)


class _FailsAtStep(Modifier):
    required_state = frozenset({"model"})
    events = frozenset({"optim_post_step"})

    def on_event(self, state, event):
        raise RuntimeError("bomb")


class _ChangesThenFailsAtInitialize(Modifier):
    required_state = frozenset({"model"})
    fail = True

    def on_initialize(self, state):
        if type(self).fail:
            with torch.no_grad():
                state.model.model.embed_tokens.weight.mul_(0.5)
            raise RuntimeError("boom")


def test_trainer_failure_midway_advises_the_trainers_calls(tmp_path):
    """Before: the advice was the plain session's "Continue, or finalize()/reset() the session", while the next
    train() was refused until trainer.session.reset()."""
    trainer = _trainer(tmp_path, [ConstantPruningModifier(), _FailsAtStep()])
    with pytest.raises(ModifierError) as info:
        trainer.train()
    assert info.value.advice == (
        "No in-place change to a parameter of the model was seen; train() stopped with the session 'running': call "
        "trainer.session.reset(), then trainer.train() to run the recipe again from step 0 on the model as it is, or "
        "trainer.train(resume_from_checkpoint=...) to continue from a checkpoint."
    )
    assert str(info.value).endswith(info.value.advice) and trainer.session.lifecycle == "running"


def test_trainer_initialize_that_changed_the_model_advises_reload_reset_train(tmp_path):
    """Before: the error gave no trainer step, and the next train() was refused by update_state() naming "gather the
    state again", a call the user never made."""
    model = tiny_llama.llama(seed=0, vocab=VOCAB, kv_heads=4)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(tmp_path, [ConstantPruningModifier(), _ChangesThenFailsAtInitialize()], model=model)
    steps = (
        "Reload the model's weights, call trainer.session.reset(), then trainer.train() again (the trainer stages its "
        "model and teacher again)."
    )
    with pytest.raises(ModifierError) as info:
        trainer.train()
    assert info.value.advice == (
        "Rolled back: 1 modifier(s) already initialized were finalized and their hooks removed; the session is still "
        f"'staging' and nothing passed to initialize() was stored. {steps}"
    )
    with pytest.raises(LifecycleError) as again:
        trainer.train()
    assert str(again.value) == (
        "SessionTrainer.train() refused: a failed initialize (an earlier train()) changed the model's weights in "
        f"place, so its session allows only reset(). {steps}"
    )
    model.load_state_dict(weights)
    trainer.session.reset()
    _ChangesThenFailsAtInitialize.fail = False
    try:
        trainer.train()
    finally:
        _ChangesThenFailsAtInitialize.fail = True
    assert trainer.session.lifecycle == "finalized" and trainer.session.global_step == 2


def test_trainer_resume_refuses_a_session_folder_of_another_step(tmp_path):
    """Before: a checkpoint whose llmc_fsm_session/ came from another step resumed without a word, the Trainer at
    its step and the recipe's schedule at the session's."""
    _trainer(tmp_path / "run", [ConstantPruningModifier()], save_strategy="steps", save_steps=1).train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    shutil.rmtree(checkpoint / SESSION_DIR)
    shutil.copytree(tmp_path / "run" / "checkpoint-1" / SESSION_DIR, checkpoint / SESSION_DIR)
    model = tiny_llama.llama(seed=1, vocab=VOCAB, kv_heads=4)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(tmp_path / "again", [ConstantPruningModifier()], model=model)
    with pytest.raises(CheckpointError) as info:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert str(info.value) == (
        f"resume_from_checkpoint={checkpoint}: its session ({SESSION_DIR}/) was saved at global step 1, its "
        "trainer_state.json at global step 2: they come from different steps (a llmc_fsm_session/ copied from "
        "another checkpoint or run?), and the recipe's schedule would jump; resume from a checkpoint folder as "
        "SessionTrainer wrote it"
    )
    assert trainer.session.lifecycle == "staging" and trainer.state.global_step == 0
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
