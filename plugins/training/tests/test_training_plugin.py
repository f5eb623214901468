"""The training plugin registers through entry points and its schedules match their closed forms."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from llmc_fsm_training import LearningRateModifier, OutputDistillationModifier, distillation_kl, scheduled_lr
from llmc_fsm_training.distillation import logits_of
from llmc_fsm_training.learning_rate import _ON_OPTIMIZER

from llmc_fsm import ModifierError, Session
from llmc_fsm.integrations.torch import initialize


def test_registered_through_entry_points():
    from llmc_fsm.core.registry import get_registry

    registry = get_registry()
    assert registry.get("OutputDistillationModifier") is OutputDistillationModifier
    assert registry.get("LearningRateModifier") is LearningRateModifier


@pytest.mark.parametrize("epoch", [0.0, 0.25, 0.5, 1.0, 1.5])
def test_scheduled_lr_closed_forms(epoch):
    p = min(epoch / 1.0, 1.0)
    assert scheduled_lr("constant", epoch, init_lr=0.2) == 0.2
    assert scheduled_lr("linear", epoch, init_lr=0.2, final_lr=0.0, end=1.0) == pytest.approx(0.2 * (1 - p))
    assert scheduled_lr("cosine", epoch, init_lr=0.2, final_lr=0.0, end=1.0) == pytest.approx(
        0.1 * (1 + math.cos(math.pi * p))
    )
    assert scheduled_lr("step", epoch, init_lr=0.2, step_size=0.5, gamma=0.5) == pytest.approx(
        0.2 * 0.5 ** math.floor(epoch / 0.5)
    )


def test_yaml_scientific_notation_is_accepted():
    assert LearningRateModifier(init_lr="1e-4").init_lr == pytest.approx(1e-4)


def test_required_state_declared():
    assert OutputDistillationModifier.required_state == {"model", "teacher"}
    assert LearningRateModifier(init_lr=0.1).required_keys() == {"optimizer"}  # constant, no schedule (2026-12-07)


# --- found by a tester (2026-12-07) -------------------------------------------------------------------------------

LINEAR_TO_END_1 = "t:\n  LearningRateModifier: {schedule: linear, init_lr: 1.0e-2, final_lr: 1.0e-3, end: 1.0}\n"


def _tiny_llama(seed: int = 0):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    from tiny_llama import llama

    return llama(seed=seed, layers=1, hidden=32).train()  # tied: lm_head shares the embedding


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 128, (2, 8), generator=g) for _ in range(n)]
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]


def _lr_loop(session, optimizer, scheduler, steps: int, model=None, batches=None) -> list[float]:
    """The documented plain loop; the rate each optimizer step used."""
    used = []
    for i in range(steps):
        session.batch_start()
        if model is None:
            optimizer.param_groups[0]["params"][0].sum().backward()
        else:
            session.loss_calculated(model(**batches[i]).loss).backward()
        session.optim_pre_step()
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        session.optim_post_step()
        scheduler.step()
        optimizer.zero_grad()
        session.batch_end()
    return used


def test_learning_rate_at_end_is_kept_over_a_scheduler_stepping_after_the_optimizer():
    """A LambdaLR stepped after every step wrote 0.5 back after end (the rate used: 0.01, 0.0055, 0.001, 0.5, 0.5)."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    session = Session(LINEAR_TO_END_1)
    initialize(session, optimizer=optimizer, steps_per_epoch=2)
    used = _lr_loop(session, optimizer, scheduler, 5)
    assert used == [0.01, scheduled_lr("linear", 0.5, init_lr=0.01, final_lr=0.001, end=1.0), 0.001, 0.001, 0.001]
    assert session.modifiers[0].last_lr == 0.001  # final_lr exactly (it was 0.0009999999999999992)
    session.finalize()
    assert optimizer.param_groups[0]["lr"] == 0.5  # after finalize the scheduler's again (nothing is written)


def test_step_schedule_keeps_its_value_at_end():
    """After end the value at end, not the step schedule continued: 0.1, 0.05, 0.025 (end), 0.025, 0.025."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    session = Session([LearningRateModifier(schedule="step", init_lr=0.1, step_size=0.5, gamma=0.5, end=1.0)])
    initialize(session, optimizer=optimizer, steps_per_epoch=2)
    assert _lr_loop(session, optimizer, scheduler, 5) == [0.1, 0.05, 0.025, 0.025, 0.025]


def test_learning_rate_at_end_is_kept_with_the_hf_trainer(tmp_path):
    """HF Trainer, learning_rate=5e-2 (its linear decay), 3 epochs of 2 steps, end 1.0: the rates used were 0.01,
    0.0055, 0.001, then the Trainer's 0.025, 0.0167, 0.0083."""
    from torch.utils.data import Dataset
    from transformers import TrainerCallback, TrainingArguments

    from llmc_fsm.integrations.transformers import SessionTrainer

    class Rows(Dataset):
        def __init__(self) -> None:
            self.rows = [{k: v[0] for k, v in b.items()} for b in _batches(4)]

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return self.rows[i]

    used = []

    class Rates(TrainerCallback):
        def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            used.append(optimizer.param_groups[0]["lr"])

    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_train_epochs=3,
        learning_rate=5e-2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    model = _tiny_llama()
    trainer = SessionTrainer(model=model, args=args, train_dataset=Rows(), recipe=LINEAR_TO_END_1, callbacks=[Rates()])
    trainer.train()
    assert used == [0.01, scheduled_lr("linear", 0.5, init_lr=0.01, final_lr=0.001, end=1.0), *[0.001] * 4]
    assert trainer.session.modifiers[0].last_lr == 0.001


def test_documented_plain_loop_checkpoint_of_a_tied_model_resumes_with_the_rate_at_end(tmp_path):
    """docs/training.md's snippet: save_file(model.state_dict(), ...) raised "Some tensors share memory" for a tied
    model (SmolLM2's); save_model/load_model resume it, and the rate at end is kept after the resume too."""
    from safetensors.torch import load_model, save_file, save_model

    def run(model, save_at=None, checkpoint=None):
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        session = Session(LINEAR_TO_END_1)
        if checkpoint is not None:
            load_model(model, f"{checkpoint}/model.safetensors")
            optimizer.load_state_dict(torch.load(f"{checkpoint}/optimizer.pt", weights_only=True))
            scheduler.load_state_dict(torch.load(f"{checkpoint}/scheduler.pt", weights_only=True))
            initialize(session, optimizer=optimizer, steps_per_epoch=2, checkpoint=f"{checkpoint}/session")
        else:
            initialize(session, optimizer=optimizer, steps_per_epoch=2)
        done = session.global_step
        used = _lr_loop(session, optimizer, scheduler, (save_at or 5) - done, model, _batches(5)[done:])
        if save_at is not None:
            with pytest.raises(RuntimeError, match="Some tensors share memory"):
                save_file(model.state_dict(), str(tmp_path / "x.safetensors"))
            save_model(model, f"{tmp_path}/model.safetensors")
            torch.save(optimizer.state_dict(), f"{tmp_path}/optimizer.pt")
            torch.save(scheduler.state_dict(), f"{tmp_path}/scheduler.pt")
            session.save(f"{tmp_path}/session")
        else:
            session.finalize()
        return used

    reference_model = _tiny_llama()
    reference = run(reference_model)
    assert reference[2:] == [0.001] * 3
    assert run(_tiny_llama(), save_at=3) == reference[:3]
    resumed_model = _tiny_llama(seed=3)
    assert run(resumed_model, checkpoint=tmp_path) == reference[3:]
    assert resumed_model.lm_head.weight is resumed_model.model.embed_tokens.weight  # still tied
    for (name, p), q in zip(resumed_model.named_parameters(), reference_model.parameters(), strict=True):
        assert torch.equal(p, q), name  # bitwise-identical after 5 steps


def test_logits_of_a_tuple_output_with_the_loss_first():
    """return_dict=False with labels gives (loss, logits, ...): output[0], the loss, was taken and refused."""
    loss, logits = torch.tensor(2.5), torch.randn(2, 3, 5)
    assert logits_of((loss, logits, "past")) is logits
    assert logits_of((logits,)) is logits
    with pytest.raises(TypeError) as info:
        logits_of((loss,))
    assert str(info.value) == (
        "cannot find logits in a model output of type tuple: distillation reads output.logits, output['logits'], "
        "or of a tuple the first element (the second after a 0-dim loss); call the model with return_dict=True"
    )


def test_distillation_of_a_student_called_with_return_dict_false_and_labels():
    """The loop's model(**batch, return_dict=False) with labels: the same loss as with return_dict=True (it raised
    "cannot find logits in a model output of type tuple")."""
    batch = _batches(1)[0]
    combined = []
    for return_dict in (True, False):
        student, teacher = _tiny_llama(), _tiny_llama(seed=7)
        session = Session("t:\n  OutputDistillationModifier: {temperature: 2.0, alpha: 0.5}\n")
        initialize(session, model=student, teacher=teacher)
        session.batch_start(batch=batch)
        output = student(**batch, return_dict=return_dict)
        combined.append(session.loss_calculated(output.loss if return_dict else output[0]))
        distill = session.modifiers[0].last_distill_loss
        with torch.no_grad():
            expected = distillation_kl(student(**batch).logits, teacher(**batch).logits, 2.0, batch["attention_mask"])
        assert torch.equal(distill, expected)
        session.batch_end()
        session.finalize()
    assert torch.equal(combined[0], combined[1])


# --- found by a tester (2026-12-07, second round) -----------------------------------------------------------------


@pytest.mark.parametrize("warmup_first", [True, False])
def test_a_warmup_then_a_decay_give_the_same_rates_in_either_recipe_order(warmup_first):
    """Warmup 0 -> 0.5 then cosine 0.5 -> 2 (4 steps per epoch): with the cosine listed first, the ended warmup wrote
    its end value 0.01 over the cosine at every later step (0.01 from step 2 on)."""
    warmup = LearningRateModifier(schedule="linear", init_lr=1e-4, final_lr=1e-2, start=0, end=0.5)
    decay = LearningRateModifier(schedule="cosine", init_lr=1e-2, final_lr=1e-4, start=0.5, end=2.0)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    session = Session([warmup, decay] if warmup_first else [decay, warmup])
    initialize(session, optimizer=optimizer, steps_per_epoch=4)
    used = _lr_loop(session, optimizer, scheduler, 10)
    expected = [warmup.lr_at(e / 4) if e < 2 else decay.lr_at(min(e / 4, 2.0)) for e in range(10)]
    assert used == expected
    assert used[2] == 1e-2 and used[8:] == [1e-4, 1e-4]
    assert decay.last_lr == 1e-4
    assert warmup.last_lr == warmup.lr_at(0.25)  # what it wrote last: from epoch 0.5 on the decay sets the rate
    session.finalize()


def test_an_ended_rate_without_a_later_schedule_is_still_kept():
    """Two schedules on two optimizers: each keeps its own end value (one ended modifier does not yield to a
    modifier of another optimizer)."""
    first = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=1.0)
    second = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=1.0)
    a = LearningRateModifier(schedule="linear", init_lr=0.1, final_lr=0.01, end=0.5)
    b = LearningRateModifier(schedule="constant", init_lr=0.3, start=0.5)
    sa, sb = Session([a]), Session([b])
    initialize(sa, optimizer=first, steps_per_epoch=2)
    initialize(sb, optimizer=second, steps_per_epoch=2)
    for session in (sa, sb):
        for _ in range(3):
            session.batch_start()
            session.optim_pre_step()
            session.optim_post_step()
            session.batch_end()
    assert first.param_groups[0]["lr"] == 0.01 and second.param_groups[0]["lr"] == 0.3
    sa.finalize()
    sb.finalize()


def test_distillation_holds_no_logits_outside_its_active_batches():
    """start 0.5, end 1.0, 2 steps per epoch: before start and after end the hook kept the last forward's logits
    (with their graph) and inputs until the next forward; now nothing is held between batches or while inactive."""
    student, teacher = _tiny_llama(), _tiny_llama(seed=7)
    modifier = OutputDistillationModifier(start=0.5, end=1.0)
    session = Session([modifier])
    initialize(session, model=student, teacher=teacher, steps_per_epoch=2)
    held = []
    for batch in _batches(4):
        session.batch_start(batch=batch)
        loss = student(**batch).loss
        held.append(modifier._captured is not None)
        session.loss_calculated(loss).backward()
        session.optim_pre_step()
        session.optim_post_step()
        session.batch_end()
        held.append(modifier._captured is not None)
    assert held == [False, False, True, False, False, False, False, False]
    assert modifier.last_distill_loss is not None
    session.finalize()


def test_pickling_a_model_that_holds_a_running_sessions_hook_says_so(tmp_path):
    """torch.save(model) in the middle of a distillation run raised "PicklingError: Can't pickle <function
    OutputDistillationModifier._capture>: it's not the same object as ..."; a deep copy of the model still works."""
    import copy
    import pickle

    student, teacher = _tiny_llama(), _tiny_llama(seed=7)
    session = Session([OutputDistillationModifier()])
    initialize(session, model=student, teacher=teacher)
    with pytest.raises(TypeError) as info:
        torch.save(student, tmp_path / "model.pt")
    assert str(info.value) == (
        "the model holds a torch hook of OutputDistillationModifier, a modifier of a session that has not been "
        "finalized, and a hook cannot be pickled: save model.state_dict() (or save_pretrained), or pickle the model "
        "after session.finalize() (or reset()) removed its hooks"
    )
    copied = copy.deepcopy(student)
    assert list(copied._forward_hooks.values()) == list(student._forward_hooks.values())
    session.finalize()
    assert len(pickle.dumps(student)) > 0  # no hook left: the model pickles


# --- found by a tester (2026-12-07, third round) ------------------------------------------------------------------

_ROLLED_BACK = (
    " (during initialize()). Rolled back: 1 modifier(s) already initialized were finalized and their hooks removed; "
    "the session is still 'created' and nothing passed to initialize() was stored. Fix the cause and call "
    "initialize() again with all its arguments."
)
_OVERLAP = (
    " both set the learning rate of the same optimizer over overlapping epochs, so their order in the recipe would "
    "decide the rate; "
)


def _lr(schedule, init_lr, final_lr=0.0, start=None, end=None):
    return LearningRateModifier(schedule=schedule, init_lr=init_lr, final_lr=final_lr, start=start, end=end)


@pytest.mark.parametrize(
    ("ranges", "expected"),
    [
        (  # the tester's warmup + decay, warmup listed first: the decay wrote over the warmup from step 0
            [("linear", 1e-3, 1e-1, 0, 0.5), ("cosine", 1e-1, 1e-3, 0, 3)],
            "LearningRateModifier#1 (epochs [0, 0.5)) and LearningRateModifier#2 (epochs [0, 3))" + _OVERLAP
            + "make one start where the other ends: start LearningRateModifier#2 at LearningRateModifier#1's end "
            "(start: 0.5)",
        ),
        (  # decay listed first: the ended warmup wrote 0.1 over the decay at every step
            [("cosine", 1e-1, 1e-3, 0, 3), ("linear", 1e-3, 1e-1, 0, 0.5)],
            "LearningRateModifier#2 (epochs [0, 0.5)) and LearningRateModifier#1 (epochs [0, 3))" + _OVERLAP
            + "make one start where the other ends: start LearningRateModifier#1 at LearningRateModifier#2's end "
            "(start: 0.5)",
        ),
        (  # nested
            [("constant", 0.5, 0.0, 0, 3), ("constant", 0.2, 0.0, 1, 2)],
            "LearningRateModifier#1 (epochs [0, 3)) and LearningRateModifier#2 (epochs [1, 2))" + _OVERLAP
            + "make one start where the other ends: end LearningRateModifier#1 at LearningRateModifier#2's start "
            "(end: 1)",
        ),
        (  # overlapping, the later-starting one listed first
            [("linear", 1e-1, 1e-3, 0.5, 2), ("linear", 1e-3, 1e-1, 0, 1)],
            "LearningRateModifier#2 (epochs [0, 1)) and LearningRateModifier#1 (epochs [0.5, 2))" + _OVERLAP
            + "make one start where the other ends: end LearningRateModifier#2 at LearningRateModifier#1's start "
            "(end: 0.5)",
        ),
        (  # two open-ended constants
            [("constant", 0.5, 0.0, None, None), ("constant", 0.2, 0.0, None, None)],
            "LearningRateModifier#1 (epochs 0 onwards (no end)) and LearningRateModifier#2 (epochs 0 onwards (no end))"
            + _OVERLAP + "keep one of them, or split the range so that one starts where the other ends",
        ),
        (  # an open-ended constant started inside a decay
            [("cosine", 1e-1, 1e-3, 0, 3), ("constant", 0.2, 0.0, 2, None)],
            "LearningRateModifier#1 (epochs [0, 3)) and LearningRateModifier#2 (epochs 2 onwards (no end))" + _OVERLAP
            + "make one start where the other ends: end LearningRateModifier#1 at LearningRateModifier#2's start "
            "(end: 2)",
        ),
    ],
)
def test_two_rate_schedules_of_one_optimizer_with_overlapping_ranges_are_refused_at_initialize(ranges, expected):
    """Overlapping ranges were taken and the recipe order silently decided the rate (a warmup over [0, 0.5) and a
    cosine decay over [0, 3): no warmup when it was listed first, no decay when it was listed second)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=1.0)
    session = Session([_lr(*r) for r in ranges])
    with pytest.raises(ModifierError) as info:
        initialize(session, optimizer=optimizer, steps_per_epoch=4)
    assert str(info.value.__cause__) == expected
    assert str(info.value) == "LearningRateModifier#2.on_initialize() raised ValueError: " + expected + _ROLLED_BACK
    assert session.lifecycle == "created"
    assert optimizer.param_groups[0]["lr"] == 1.0
    assert id(optimizer) not in _ON_OPTIMIZER  # the first one's registration was rolled back with it
    follow = Session([_lr("linear", 1e-3, 1e-1, 0, 0.5), _lr("cosine", 1e-1, 1e-3, 0.5, 3)])
    initialize(follow, optimizer=optimizer, steps_per_epoch=4)  # nothing left to refuse it
    follow.finalize()


def test_a_rate_schedule_overlapping_one_of_another_live_session_on_the_same_optimizer_is_refused():
    """Two sessions on one optimizer: the second one's schedule overlapping the first one's was taken too."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=1.0)
    first = Session([_lr("linear", 1e-3, 1e-1, 0, 1)])
    initialize(first, optimizer=optimizer, steps_per_epoch=4)
    second = Session([_lr("linear", 1e-1, 1e-3, 0.5, 2)])
    with pytest.raises(ModifierError) as info:
        initialize(second, optimizer=optimizer, steps_per_epoch=4)
    assert str(info.value.__cause__) == (  # the other session named as the holder (session 38)
        "LearningRateModifier (epochs [0.5, 2)) would set the learning rate of an optimizer that LearningRateModifier "
        "of another live session already sets (epochs [0, 1), overlapping): that session holds the optimizer until it "
        "is finalized; call finalize() or reset() on it (one left running by an error, e.g. in a notebook), or give "
        "this session its own optimizer"
    )
    first.finalize()
    initialize(second, optimizer=optimizer, steps_per_epoch=4)  # the first one finalized: nothing overlaps now
    second.finalize()


def test_three_rate_schedules_that_follow_each_other_in_reversed_recipe_order_are_taken():
    """[2, no end), [1, 2) and [0, 1) listed in that order follow each other: the overlap check refuses none of them
    (a guard on the refusal above, which compares a new schedule with every one already initialized)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    warmup = _lr("linear", 1e-3, 1e-1, 0, 1)
    session = Session([_lr("constant", 0.5, start=2), _lr("constant", 0.2, start=1, end=2), warmup])
    initialize(session, optimizer=optimizer, steps_per_epoch=4)
    used = _lr_loop(session, optimizer, scheduler, 12)
    assert used == [warmup.lr_at(s / 4) for s in range(4)] + [0.2] * 4 + [0.5] * 4
    session.finalize()


def test_a_deep_copy_of_the_student_made_during_distillation_pickles_after_finalize():
    """copy.deepcopy(student) during the run (an EMA copy) kept the distillation hook after finalize: pickle.dumps of
    the copy raised "TypeError: the model holds a torch hook of OutputDistillationModifier, a modifier of a session
    that has not been finalized ..." although it had been."""
    import copy
    import io
    import pickle

    student, teacher = _tiny_llama(), _tiny_llama(seed=7)
    modifier = OutputDistillationModifier()
    session = Session([modifier])
    initialize(session, model=student, teacher=teacher)
    copied = copy.deepcopy(student)
    session.finalize()
    batch = _batches(1)[0]
    with torch.no_grad():
        assert torch.equal(copied(**batch).logits, student(**batch).logits)
    assert modifier._captured is None and modifier.last_distill_loss is None  # the copy's hook ran nothing
    assert len(pickle.dumps(copied)) > 0
    buffer = io.BytesIO()
    torch.save(copied, buffer)
    assert buffer.tell() > 0
