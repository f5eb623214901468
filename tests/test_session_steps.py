"""The session's step counting: a global_step that goes back, ends at the batch_end of the step that reaches them,
state keys nothing reads, and the HF Trainer's steps_per_epoch (found by a tester)."""

from __future__ import annotations

import logging

import attrs
import pytest
import tiny_llama
import torch
from llmc_fsm_pruning.magnitude import MagnitudePruningModifier
from llmc_fsm_training import LearningRateModifier, OutputDistillationModifier

from llmc_fsm import Modifier, Session
from llmc_fsm.integrations.torch import initialize, optimizer_step

transformers = pytest.importorskip("transformers")
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from llmc_fsm.integrations.transformers import SESSION_DIR, SessionTrainer  # noqa: E402
from llmc_fsm.session.checkpoint import read_checkpoint  # noqa: E402

VOCAB = 64
SESSION_LOG = "llmc_fsm.session.session"


def _llama(seed: int = 0):
    return tiny_llama.llama(seed=seed, vocab=VOCAB, kv_heads=4)


def _batch(seed: int = 0) -> dict:
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _sparsity(model) -> float:
    """Zeros over all weights of the Linears but lm_head (what the pruning modifiers target by default)."""
    zeros = total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            zeros += int((module.weight == 0).sum())
            total += module.weight.numel()
    return zeros / total


@attrs.define(kw_only=True, slots=False, eq=False)
class _Calls(Modifier):
    """Records each hook with the event it came in and the step."""

    events = frozenset({"batch_start", "batch_end"})
    calls: list = attrs.field(factory=list, init=False)

    def on_initialize(self, state):
        self.calls.append(("on_initialize",))

    def on_start(self, state, event):
        self.calls.append(("on_start", event.type, event.global_step))

    def on_update(self, state, event):
        self.calls.append(("on_update", event.type, event.global_step))

    def on_end(self, state, event):
        self.calls.append(("on_end", event.type, event.global_step))

    def on_event(self, state, event):
        self.calls.append((event.type, event.global_step))


def _step(session: Session, global_step: int | None = None) -> None:
    session.batch_start(global_step=global_step)
    session.optim_pre_step()
    session.optim_post_step()
    session.batch_end()


# --------------------------------------------------------------------------- a global_step that goes back
def test_a_global_step_below_the_steps_counted_is_refused_and_nothing_runs():
    """A loop passing its batch index within the epoch as global_step: the step went back to 0 every epoch, so the
    learning rate repeated its schedule and a gradual pruning stalled, then jumped to its end in finalize(), with
    nothing said (found by a tester)."""
    rec = _Calls(update=0.25)
    session = Session([rec])
    session.initialize(model=torch.nn.Linear(2, 2), steps_per_epoch=4)
    for step in range(4):
        _step(session, global_step=step)
    before = list(rec.calls)
    with pytest.raises(ValueError) as info:
        session.batch_start(global_step=0)
    assert str(info.value) == (
        "batch_start(global_step=0) refused: the session has counted 4 optimizer steps and the step never goes back "
        "(a batch index within the epoch restarts every epoch: schedules would repeat or stall); pass the optimizer "
        "steps completed over the whole run (e.g. epoch * steps_per_epoch + steps in this epoch, the same value "
        "again while gradients accumulate), or leave global_step out and the session counts optim_post_step() "
        "calls. Nothing was changed."
    )
    assert rec.calls == before and session.global_step == 4
    assert session.allowed_calls == {"batch_start", "calibration_start", "finalize", "reset"}  # still between batches
    session.batch_start(global_step=4)  # the step counted over the run: taken
    assert rec.calls[-2:] == [("on_update", "batch_start", 4), ("batch_start", 4)]
    session.batch_end()
    session.batch_start(global_step=4)  # the same again (gradient accumulation: no optimizer step in between)
    session.batch_end()
    session.batch_start(global_step=9)  # a jump forward
    assert rec.calls[-6:] == [
        ("batch_start", 4), ("batch_end", 4), ("batch_start", 4), ("batch_end", 4),
        ("on_update", "batch_start", 9), ("batch_start", 9),
    ]  # fmt: skip
    assert session.global_step == 9


def test_a_resumed_session_refuses_a_step_below_the_checkpoints():
    """A resumed run whose loop restarts its step count at 0 (a per-epoch index again)."""
    first = Session([_Calls()])
    first.initialize(model=torch.nn.Linear(2, 2))
    for _ in range(3):
        _step(first)
    saved = first.state_dict()
    resumed = Session([_Calls()])
    resumed.initialize(model=torch.nn.Linear(2, 2))
    resumed.load_state_dict(saved)
    with pytest.raises(ValueError, match=r"^batch_start\(global_step=1\) refused: the session has counted 3 "):
        resumed.batch_start(global_step=1)
    assert resumed.global_step == 3 and resumed.lifecycle == "running"


# --------------------------------------------------------------------------- ends at the step that reaches them
def test_an_end_is_fired_at_the_batch_end_of_the_step_that_reaches_it():
    """start and updates at batch_start (as llm-compressor), the end at batch_end once the step count reached it:
    at the next batch_start (never sent after the last step) it came only in finalize()."""
    rec = _Calls(start=0.0, end=1.0, update=0.5)
    session = Session([rec])
    session.initialize(model=torch.nn.Linear(2, 2), steps_per_epoch=2)
    for _ in range(2):
        _step(session)
    assert [c for c in rec.calls if c[0].startswith("on_")] == [
        ("on_initialize",),
        ("on_start", "batch_start", 0),
        ("on_update", "batch_start", 1),
        ("on_end", "batch_end", 2),
    ]
    assert rec.calls[-2:] == [("batch_end", 2), ("on_end", "batch_end", 2)]  # the batch's own batch_end first
    session.finalize()
    assert rec.calls[-1] == ("on_end", "batch_end", 2)  # not again in finalize()
    late = _Calls(start=1.0)  # a start the step count reaches at a batch_end waits for the next batch_start
    session = Session([late])
    session.initialize(model=torch.nn.Linear(2, 2), steps_per_epoch=2)
    for _ in range(3):
        _step(session)
    assert [c for c in late.calls if c[0] == "on_start"] == [("on_start", "batch_start", 2)]


def test_a_gradual_prune_ending_at_the_last_step_is_in_the_model_before_finalize():
    """MagnitudePruning end=2 (8 steps of 4 per epoch): after the last batch the model held 0.45, the update of
    epoch 1; the final 0.5 came in finalize(), after whatever the loop did with the model at its last step."""
    model = _llama().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    mod = MagnitudePruningModifier(init_sparsity=0.1, final_sparsity=0.5, end=2, update=1.0)
    session = Session([mod])
    initialize(session, model=model, optimizer=optimizer, steps_per_epoch=4)
    for step in range(8):
        session.batch_start(batch=_batch(step))
        session.loss_calculated(model(**_batch(step)).loss).backward()
        optimizer_step(session, optimizer)
        session.batch_end()
    assert _sparsity(model) == 0.5
    assert mod.history == [(0.0, pytest.approx(0.1)), (1.0, 0.45), (2.0, 0.5)]  # epochs of the steps they came at
    assert mod.measured_sparsity == 0.5
    session.finalize()
    assert mod.history[-1] == (2.0, 0.5) and len(mod.history) == 3


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 3) -> None:
        self.ids = torch.randint(0, VOCAB, (n, 8), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _args(path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(path), use_cpu=True, report_to=[], save_strategy="no", per_device_train_batch_size=2,
                learning_rate=1e-3, logging_steps=100, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    base.update(kw)
    return TrainingArguments(**base)


def _saved_sparsity(checkpoint) -> float:
    from safetensors.torch import load_file

    tensors = load_file(checkpoint / "model.safetensors")
    weights = [v for k, v in tensors.items() if k.endswith("proj.weight")]
    return sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)


class _Evaluated(TrainerCallback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.seen.append((state.global_step, _sparsity(model)))


def test_the_trainers_last_evaluation_and_checkpoint_hold_an_end_at_the_last_step(tmp_path):
    """eval and save every epoch, the pruning's end at the end of training: the evaluation at step 8 and
    checkpoint-8 held 0.45, the model after train() 0.5 (the end came at on_train_end; found by a tester). An update
    point (epoch 1, step 4) is still applied at the next batch_start, after the evaluation and checkpoint of step 4,
    as in llm-compressor."""
    mod = MagnitudePruningModifier(init_sparsity=0.1, final_sparsity=0.5, end=2, update=1.0)
    evaluated = _Evaluated()
    trainer = SessionTrainer(
        model=_llama(), args=_args(tmp_path, num_train_epochs=2, eval_strategy="epoch", save_strategy="epoch"),
        train_dataset=_Data(8), eval_dataset=_Data(2, seed=4), recipe=[mod], callbacks=[evaluated],
    )  # fmt: skip
    trainer.train()
    first = _saved_sparsity(tmp_path / "checkpoint-4")  # the prune of epoch 0 (0.1 of each weight, rounded)
    assert 0.1 <= first < 0.1001
    assert evaluated.seen == [(4, first), (8, 0.5)]
    assert _saved_sparsity(tmp_path / "checkpoint-8") == 0.5
    assert mod.history == [(0.0, pytest.approx(0.1)), (1.0, 0.45), (2.0, 0.5)]


def _boundary_trainer(path, model, record):
    recipe = [
        MagnitudePruningModifier(init_sparsity=0.1, final_sparsity=0.5, end=1.25, update=0.25),  # ends at step 5
        LearningRateModifier(schedule="linear", init_lr=0.02, final_lr=0.002, end=1.5),  # ends at step 6
    ]
    return SessionTrainer(
        model=model, args=_args(path, max_steps=8, save_strategy="steps", save_steps=5, learning_rate=1e-2),
        train_dataset=_Data(8), recipe=recipe, callbacks=[record],
    )  # fmt: skip


class _Steps(TrainerCallback):
    def __init__(self) -> None:
        self.seen: dict[int, tuple] = {}

    def on_step_end(self, args, state, control, optimizer=None, model=None, **kwargs):
        self.seen[state.global_step] = (optimizer.param_groups[0]["lr"], _sparsity(model))


def test_a_checkpoint_at_the_step_an_end_fires_holds_it_and_resumes_bit_identical(tmp_path):
    """checkpoint-5, the step the pruning ends at: it holds the final sparsity and the modifier ended; resumed from
    it, the run continues exactly as the uninterrupted one (masks dropped at end, weights, history)."""
    reference_steps = _Steps()
    reference = _boundary_trainer(tmp_path / "a", _llama(), reference_steps)
    reference.train()
    checkpoint = tmp_path / "a" / "checkpoint-5"
    assert _saved_sparsity(checkpoint) == 0.5
    saved = read_checkpoint(checkpoint / SESSION_DIR)
    assert saved["global_step"] == 5
    assert saved["schedule"]["MagnitudePruningModifier"] == {"started": True, "ended": True, "next_update": None}
    assert reference_steps.seen[5][1] == 0.5 and reference_steps.seen[6][1] < 0.5  # masks dropped at end: regrown

    steps = _Steps()
    resumed = _boundary_trainer(tmp_path / "b", _llama(5), steps)  # other weights: all come from the checkpoint
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert sorted(steps.seen) == [6, 7, 8]
    assert all(steps.seen[s] == reference_steps.seen[s] for s in (6, 7, 8))
    assert resumed.session.modifiers[0].history == reference.session.modifiers[0].history
    ref = dict(reference.model.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in resumed.model.named_parameters())


# --------------------------------------------------------------------------- state keys nothing reads
REFUSED = {
    "global_step": (
        "state key 'global_step' refused, nothing was stored: the session counts optimizer steps itself (one per "
        "optim_post_step()); to set the step pass session.batch_start(global_step=N), to resume a run load its "
        "session checkpoint (llmc_fsm.integrations.torch.initialize(session, checkpoint=dir), or "
        "session.load_state_dict(saved))"
    ),
    "start": (
        "state key 'start' refused, nothing was stored: the epoch to resume from (llm-compressor's "
        "initialize(start=...)) is not a state key here (a modifier's start is a recipe argument): resume a run "
        "from its session checkpoint (llmc_fsm.integrations.torch.initialize(session, checkpoint=dir), or "
        "session.load_state_dict(saved)), or set the step with session.batch_start(global_step=N)"
    ),
    "batches_per_step": (
        "state key 'batches_per_step' refused, nothing was stored: the session counts optimizer steps, not "
        "batches: with gradient accumulation send optim_pre_step()/optim_post_step() only for the batches that "
        "step the optimizer (llmc_fsm.integrations.torch.optimizer_step and is_step) and give steps_per_epoch in "
        "optimizer steps (llmc_fsm.integrations.torch.steps_per_epoch(train_loader, gradient_accumulation_steps))"
    ),
    "teacher_model": (
        "state key 'teacher_model' refused, nothing was stored: the distillation teacher's key is 'teacher' "
        "(llm-compressor's teacher_model): pass teacher=..."
    ),
}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_llm_compressors_initialize_arguments_are_refused_as_state_keys_with_what_to_do(key):
    """update_state(global_step=100) was stored and ignored (the first step still ran at 0), as were
    llm-compressor's initialize(start=1.0, batches_per_step=2); teacher_model= gave only "requires 'teacher'"."""
    rec = _Calls()
    session = Session([rec])
    session.update_state(model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError) as info:
        session.update_state(**{key: 2})
    assert str(info.value) == REFUSED[key]
    with pytest.raises(ValueError) as info:
        session.initialize(**{key: 2}, steps_per_epoch=4)
    assert str(info.value) == REFUSED[key]
    assert session.lifecycle == "staging" and sorted(session.state) == ["model"] and rec.calls == []
    session.update_state(**{key: None})  # None is no value: nothing refused, nothing stored
    assert sorted(session.state) == ["model"]


def test_several_refused_keys_are_named_one_line_each():
    session = Session([OutputDistillationModifier()])
    with pytest.raises(ValueError) as info:
        session.initialize(model=_llama(), teacher_model=_llama(1), start=1.0, batches_per_step=2)
    assert str(info.value) == "\n".join(REFUSED[k] for k in ("start", "batches_per_step", "teacher_model"))
    assert session.lifecycle == "created" and len(session.state) == 0


def test_keys_no_modifier_reads_are_named_in_one_warning_at_initialize(caplog):
    """epoch=5, a misspelt key: stored and ignored without a word. Keys the session reads (world_size, the
    well-known ones) and those a modifier declares (required or optional) are not named."""
    session = Session([LearningRateModifier(init_lr=0.1)])
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    session.update_state(epoch=5, train_data=[1], world_size=1, model=torch.nn.Linear(2, 2))
    with caplog.at_level(logging.WARNING, logger=SESSION_LOG):
        session.initialize(optimizer=optimizer, lerning_rate=0.1, steps_per_epoch=4)
    assert [r.getMessage() for r in caplog.records] == [
        "initialize(): state keys 'epoch', 'lerning_rate' are read by no modifier of this recipe (none declares "
        "them in required_state or optional_state) nor by the session, so they do nothing; remove them or check "
        "the spelling (keys declared: optimizer, steps_per_epoch)"
    ]
    assert session.lifecycle == "initialized"
    caplog.clear()
    quiet = Session([LearningRateModifier(init_lr=0.1)])
    with caplog.at_level(logging.WARNING, logger=SESSION_LOG):
        quiet.initialize(optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters()), steps_per_epoch=4,
                         model=torch.nn.Linear(2, 2), world_size=1)
    assert caplog.records == []


# --------------------------------------------------------------------------- the Trainer's steps_per_epoch
def test_the_trainer_names_a_given_steps_per_epoch_it_replaces_by_its_own(tmp_path, caplog):
    """session_state={'steps_per_epoch': 10} with a loader of 4 optimizer steps: replaced by 4 without a word
    (found by a tester); the rule stays (the recipe's epochs are the Trainer's), one warning line names both."""
    lr = LearningRateModifier(init_lr=0.1, schedule="linear", end=1)
    trainer = SessionTrainer(model=_llama(), args=_args(tmp_path, max_steps=2), train_dataset=_Data(8),
                             recipe=[lr], session_state={"steps_per_epoch": 10})  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.integrations.transformers"):
        trainer.train()
    assert [r.getMessage() for r in caplog.records] == [
        "SessionTrainer: steps_per_epoch 10 given in the session state is replaced by 4, the Trainer's own "
        "optimizer steps per epoch (ceil(4 batches / gradient_accumulation_steps 1)), so the recipe's epochs are "
        "the Trainer's; a given steps_per_epoch is used only for a training dataset without a length (an "
        "IterableDataset). To stretch a schedule, change start/end/update in the recipe"
    ]
    assert trainer.session.state["steps_per_epoch"] == 4 and lr.last_lr == 0.1 * (1 - 1 / 4)
    caplog.clear()
    same = SessionTrainer(model=_llama(), args=_args(tmp_path, max_steps=1), train_dataset=_Data(8),
                          recipe=[LearningRateModifier(init_lr=0.1)], session_state={"steps_per_epoch": 4})
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.integrations.transformers"):
        same.train()
    assert caplog.records == []  # the same number: nothing to say


def test_a_resume_with_a_replaced_steps_per_epoch_is_checked_against_the_trainers_count(tmp_path):
    """The resume check compared the checkpoint's 4 with the 10 given in session_state, which the Trainer's 4
    replaces: a resume that would run identically was refused ("4 in the checkpoint, 10 now")."""
    def trainer(path, model):
        return SessionTrainer(
            model=model, args=_args(path, max_steps=4, save_strategy="steps", save_steps=2), train_dataset=_Data(8),
            recipe=[LearningRateModifier(init_lr=0.1, schedule="linear", end=1)], session_state={"steps_per_epoch": 10},
        )  # fmt: skip

    reference = trainer(tmp_path / "a", _llama())
    reference.train()
    resumed = trainer(tmp_path / "b", _llama(5))
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert resumed.session.global_step == 4 and resumed.session.state["steps_per_epoch"] == 4
    ref = dict(reference.model.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in resumed.model.named_parameters())


def test_reading_a_key_that_is_not_well_known_as_an_attribute_says_to_subscript() -> None:
    """``state.tokenizer`` raised a bare AttributeError; a plugin author copying ``state.model`` did not learn how to
    read their own key (found by a tester)."""
    from llmc_fsm.core.state import State

    state = State({"model": "m", "tokenizer": "t"})
    assert (state.model, state["tokenizer"], state.steps_per_epoch) == ("m", "t", None)
    with pytest.raises(AttributeError) as info:
        _ = state.tokenizer
    assert str(info.value) == (
        "state has no attribute 'tokenizer': only model, teacher, optimizer, calibration_data, train_data, "
        "steps_per_epoch are attributes; read other keys with state['tokenizer'] (or state.get('tokenizer'))")
