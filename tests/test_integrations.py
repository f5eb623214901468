"""The transformers.Trainer integration (SessionTrainer) on a tiny random Llama, CPU, a few steps."""

from __future__ import annotations

import math

import pytest
import tiny_llama
import torch

transformers = pytest.importorskip("transformers")

from llmc_fsm_pruning.constant import ConstantPruningModifier  # noqa: E402
from llmc_fsm_pruning.magnitude import MagnitudePruningModifier  # noqa: E402
from llmc_fsm_training import LearningRateModifier, OutputDistillationModifier  # noqa: E402
from transformers import LlamaForCausalLM, TrainerCallback, TrainingArguments  # noqa: E402

from llmc_fsm import CheckpointError, LifecycleError, MissingStateError, Session  # noqa: E402
from llmc_fsm.integrations.transformers import SESSION_DIR, SessionTrainer  # noqa: E402

VOCAB = 64


def _llama(seed: int = 0) -> LlamaForCausalLM:
    return tiny_llama.llama(seed=seed, vocab=VOCAB, kv_heads=4)  # Trainer.training_step calls .train()


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int = 8) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _args(tmp_path, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def _linear_zeros(model) -> dict[str, torch.Tensor]:
    return {
        n: (m.weight == 0).clone()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    }


def test_trainer_constant_pruning_masks_hold_exactly(tmp_path):
    model = _llama()
    prune = Session([MagnitudePruningModifier(sparsity=0.5)])  # one-shot prune in-process
    prune.initialize(model=model)
    prune.calibration_start()
    prune.calibration_end()
    prune.finalize()
    before = _linear_zeros(model)
    trainer = SessionTrainer(
        model=model,
        args=_args(tmp_path, max_steps=4, weight_decay=0.1),
        train_dataset=_Data(8),
        recipe=[ConstantPruningModifier()],
    )
    trainer.train()
    assert trainer.session.lifecycle == "finalized"
    assert trainer.session.global_step == 4
    after = _linear_zeros(model)
    for name, zeros in before.items():
        assert torch.equal(after[name], zeros), name
    assert trainer.session.modifiers[0].measured_sparsity == pytest.approx(0.5)


def test_trainer_passes_state_where_born_and_counts_steps_with_accumulation(tmp_path):
    model = _llama()
    lr_mod = LearningRateModifier(schedule="linear", init_lr=0.02, final_lr=0.0, end=2)
    seen = []

    class Recorder(SessionTrainer):
        def create_optimizer(self, *a, **k):
            assert "optimizer" not in self.session.state
            opt = super().create_optimizer(*a, **k)
            assert self.session.state["optimizer"] is opt
            opt.register_step_pre_hook(lambda o, *_: seen.append((self.state.global_step, o.param_groups[0]["lr"])))
            return opt

    trainer = Recorder(
        model=model,
        args=_args(tmp_path, num_train_epochs=2, gradient_accumulation_steps=2),
        train_dataset=_Data(6),  # 3 batches of 2 -> ceil(3 / 2) = 2 optimizer steps per epoch
        recipe=[lr_mod],
    )
    assert trainer.session.state["model"] is model
    trainer.train()
    assert trainer.session.state["steps_per_epoch"] == 2
    assert trainer.session.global_step == trainer.state.global_step == 4
    assert [s for s, _ in seen] == list(range(4))
    for step, lr in seen:
        assert lr == pytest.approx(0.02 * (1 - min(step / 2 / 2, 1))), step


def test_trainer_distillation_changes_the_loss(tmp_path):
    student, teacher = _llama(0), _llama(1)
    mod = OutputDistillationModifier(temperature=2.0, alpha=1.0)
    trainer = SessionTrainer(
        model=student,
        args=_args(tmp_path, max_steps=2, gradient_accumulation_steps=2),
        train_dataset=_Data(8),
        recipe=[mod],
        teacher=teacher,
    )
    assert trainer.model_accepts_loss_kwargs is False
    out = trainer.train()
    # alpha=1: the loss the Trainer logs is the distillation term only
    assert mod.last_distill_loss is not None
    assert out.training_loss == pytest.approx(float(mod.last_distill_loss), rel=0.5)
    assert not math.isclose(out.training_loss, float(mod.last_student_loss), rel_tol=0.05)
    assert not student._forward_hooks


def test_trainer_missing_teacher_reported_before_first_step(tmp_path):
    model = _llama()
    steps = []

    class Spy(SessionTrainer):
        def training_step(self, *a, **k):
            steps.append(1)
            return super().training_step(*a, **k)

    trainer = Spy(
        model=model,
        args=_args(tmp_path, max_steps=2),
        train_dataset=_Data(4),
        recipe=[OutputDistillationModifier(), ConstantPruningModifier()],
    )
    with pytest.raises(MissingStateError) as info:
        trainer.train()
    assert info.value.missing == {"OutputDistillationModifier": frozenset({"teacher"})}
    # only this integration's advice: the session's own ("Pass again what you gave this call (optimizer)") named
    # what SessionTrainer passed, not the user (found by a tester)
    assert str(info.value).splitlines() == [
        "initialize() refused: 1 modifier(s) are missing required state; no modifier was initialized and nothing "
        "was stored (the session is still 'staging'):",
        "  - OutputDistillationModifier requires 'teacher'",
        "How to pass them with SessionTrainer:",
        "  - teacher: SessionTrainer(..., teacher=teacher_model)",
    ]
    assert steps == []
    assert trainer.session.lifecycle == "staging"


def test_a_second_train_is_refused_until_the_session_is_reset_then_runs_with_the_model_and_teacher_again(tmp_path):
    """A second ``train()`` on a finalized session said "Call session.reset()", but ``reset()`` drops the model and
    teacher SessionTrainer stages only at construction, so that advice failed (found by a tester). Now the refusal
    is SessionTrainer's own, and ``train()`` after ``reset()`` stages them again and runs the recipe from step 0; the
    same after a ``train()`` stopped by an error."""
    from llmc_fsm import LifecycleError

    teacher = _llama(1)
    trainer = SessionTrainer(model=_llama(), args=_args(tmp_path, max_steps=2), train_dataset=_Data(4),
                             recipe=[OutputDistillationModifier(), ConstantPruningModifier()], teacher=teacher)  # fmt: skip
    trainer.train()
    with pytest.raises(LifecycleError) as info:
        trainer.train()
    assert str(info.value) == (
        "SessionTrainer.train() refused: its session is 'finalized' (an earlier train() finished); call "
        "trainer.session.reset() first to run the recipe again from step 0 on the model as that run left it (this "
        "trainer stages its model and teacher again), or build a new SessionTrainer"
    )
    assert (info.value.lifecycle, info.value.call, info.value.allowed) == ("finalized", "train", ("reset",))
    trainer.session.reset()
    trainer.session.update_state(extra_key=1)  # staged since the reset: the model and teacher are still staged again
    trainer.train()
    assert trainer.session.lifecycle == "finalized" and trainer.session.global_step == 2
    assert trainer.session.state.teacher is teacher and trainer.session.state.model is trainer.model

    class Failing(SessionTrainer):
        fail = True

        def training_step(self, *a, **k):
            if self.fail:
                raise RuntimeError("out of memory")
            return super().training_step(*a, **k)

    failing = Failing(model=_llama(), args=_args(tmp_path / "f", max_steps=2), train_dataset=_Data(4),
                      recipe=[ConstantPruningModifier()])  # fmt: skip
    with pytest.raises(RuntimeError, match="out of memory"):
        failing.train()
    with pytest.raises(LifecycleError, match=r"its session is 'initialized' \(an earlier train\(\) stopped midway\)"):
        failing.train()
    failing.session.reset()
    failing.fail = False
    failing.train()
    assert failing.session.lifecycle == "finalized" and failing.session.global_step == 2


# --- checkpoint and resume (issue 10) ---------------------------------------------------


def _resume_recipe() -> list:
    layer0 = r"re:model\.layers\.0\..*"
    layer1 = r"re:model\.layers\.1\..*"
    return [
        ConstantPruningModifier(targets=[layer0]),
        MagnitudePruningModifier(targets=[layer1], init_sparsity=0.1, final_sparsity=0.5, end=1.25, update=0.25),
        LearningRateModifier(schedule="linear", init_lr=0.02, final_lr=0.002, end=1.5),
        OutputDistillationModifier(temperature=2.0, alpha=0.5),
    ]


class _Record(TrainerCallback):
    """Per optimizer step: the learning rate used and the zeros of every Linear weight."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple] = {}

    def on_step_end(self, args, state, control, optimizer=None, model=None, **kwargs):
        self.seen[state.global_step] = (optimizer.param_groups[0]["lr"], _linear_zeros(model))


def _trainer(tmp_path, model, **kw) -> tuple[SessionTrainer, _Record]:
    record = _Record()
    trainer = SessionTrainer(
        model=model,
        args=_args(tmp_path, max_steps=6, save_strategy="steps", save_steps=3, weight_decay=0.1),
        train_dataset=_Data(8),  # 4 optimizer steps per epoch
        recipe=_resume_recipe(),
        teacher=_llama(1),
        callbacks=[record],
        **kw,
    )
    return trainer, record


def _pruned_llama(seed: int = 0) -> LlamaForCausalLM:
    model = _llama(seed)
    with torch.no_grad():
        for module in model.model.layers[0].modules():
            if isinstance(module, torch.nn.Linear):
                module.weight[module.weight.abs() < module.weight.abs().median()] = 0.0
    return model


def test_trainer_resume_from_checkpoint_is_identical_to_an_uninterrupted_run(tmp_path):
    reference, ref_record = _trainer(tmp_path / "a", _pruned_llama())
    reference.train()
    checkpoint = tmp_path / "a" / "checkpoint-3"
    assert (checkpoint / SESSION_DIR / "session.json").is_file()
    assert sorted(ref_record.seen) == [1, 2, 3, 4, 5, 6]

    resumed, record = _trainer(tmp_path / "b", _llama(5))  # other initial weights: all must come from the checkpoint
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert sorted(record.seen) == [4, 5, 6]
    assert resumed.session.global_step == 6 and resumed.session.lifecycle == "finalized"
    for step, (lr, zeros) in record.seen.items():
        ref_lr, ref_zeros = ref_record.seen[step]
        assert lr == ref_lr, step
        for name, z in zeros.items():
            assert torch.equal(z, ref_zeros[name]), (step, name)
    assert resumed.session.modifiers[1].history == reference.session.modifiers[1].history
    ref_params = dict(reference.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, ref_params[name]), name


def test_trainer_resume_from_a_checkpoint_without_the_session_is_refused(tmp_path):
    plain = transformers.Trainer(  # a checkpoint written by a plain Trainer: no session in it
        model=_llama(),
        args=_args(tmp_path / "plain", max_steps=2, save_strategy="steps", save_steps=2),
        train_dataset=_Data(4),
    )
    plain.train()
    resumed = SessionTrainer(
        model=_llama(),
        args=_args(tmp_path / "plain", max_steps=4),
        train_dataset=_Data(4),
        recipe=[ConstantPruningModifier()],
    )
    with pytest.raises(CheckpointError) as info:
        resumed.train(resume_from_checkpoint=True)
    msg = str(info.value)
    assert msg.startswith(f"resume_from_checkpoint={tmp_path / 'plain' / 'checkpoint-2'}: no session checkpoint at ")
    assert f"Checkpoints written by SessionTrainer hold the session in {SESSION_DIR}/" in msg
    assert resumed.session.lifecycle == "staging"


def test_trainer_resume_into_another_recipe_is_refused_before_the_trainer_loads_and_train_runs_again(tmp_path):
    """Another recipe: refused in ``train()`` before the Trainer reads the checkpoint's weights; the session stays
    ``staging`` with its state, so ``train()`` without the checkpoint runs (before, it was reset, its model and
    teacher dropped, and the second ``train()`` failed with a MissingStateError)."""
    reference, _ = _trainer(tmp_path / "a", _pruned_llama())
    reference.train()
    recipe = _resume_recipe()
    recipe[1] = MagnitudePruningModifier(targets=[r"re:model\.layers\.1\..*"], init_sparsity=0.2,
                                         final_sparsity=0.5, end=1.25, update=0.25)  # fmt: skip
    model = _llama(5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    other = SessionTrainer(model=model, args=_args(tmp_path / "b", max_steps=2), train_dataset=_Data(8),
                           recipe=recipe, teacher=_llama(1))  # fmt: skip
    with pytest.raises(CheckpointError) as info:
        other.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    assert info.value.differences == (
        "modifier MagnitudePruningModifier: argument 'init_sparsity' is 0.1 in the checkpoint, 0.2 now",
    )
    assert other.session.lifecycle == "staging" and sorted(other.session.state) == ["model", "teacher"]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the Trainer loaded nothing
    other.train()
    assert other.session.lifecycle == "finalized" and other.session.global_step == 2


def test_load_best_model_at_end_says_the_model_holds_an_earlier_steps_weights(tmp_path, caplog):
    """The Trainer loads the best checkpoint before ``on_train_end``: a sparsity schedule's later updates are not in
    the model the session is finalized on; one warning line says so (before: nothing)."""
    layer1 = r"re:model\.layers\.1\..*"
    trainer = SessionTrainer(
        model=_llama(),
        args=_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
                   load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True),  # fmt: skip
        train_dataset=_Data(8),
        eval_dataset=_Data(2),
        recipe=[MagnitudePruningModifier(targets=[layer1], init_sparsity=0.1, final_sparsity=0.5, end=1.0, update=0.25)],
    )
    with caplog.at_level("WARNING", logger="llmc_fsm.integrations.transformers"):
        trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best == str(tmp_path / "checkpoint-1")  # the highest eval loss: the first step's
    assert [r.getMessage() for r in caplog.records if r.name == "llmc_fsm.integrations.transformers"] == [
        f"load_best_model_at_end: the Trainer loaded {best} (step 1) after the last step (4), so the model holds "
        "step 1's weights: what the recipe's modifiers did after it (e.g. a sparsity schedule's later updates) is "
        "not in them; the session is finalized on that model"
    ]


# --- the examples on the real model (CI-sized) -------------------------------------------


def _example(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CI_ARGS = ["--steps", "2", "--seq-len", "16", "--batch-size", "1", "--train-layers", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["finetune_sparse_distill", "trainer_sparse"])
def test_example_short_run_keeps_sparsity(name, shared_data, capsys):
    result = _example(name).main([*CI_ARGS, "--data", str(shared_data / "tinyshakespeare" / "input.txt")])
    assert result["steps"] == 2
    assert result["sparsity_before"] == pytest.approx(0.5, abs=1e-3)
    assert result["sparsity_after"] == result["sparsity_before"]
    out = capsys.readouterr().out
    assert "step   2" in out and "final measured sparsity" in out


def test_trainer_refuses_a_teacher_device_torch_cannot_use_at_construction(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    built = []

    class Spy(SessionTrainer):
        def create_optimizer(self, *a, **k):
            built.append("optimizer")
            return super().create_optimizer(*a, **k)

    with pytest.raises(ValueError) as info:
        Spy(model=_llama(0), args=_args(tmp_path, max_steps=1), train_dataset=_Data(2),
            recipe=[OutputDistillationModifier()], teacher=_llama(1), teacher_device="cuda:0")  # fmt: skip
    assert str(info.value) == (
        f"teacher_device is 'cuda:0' but torch sees no CUDA device (torch {torch.__version__}, built with CUDA "
        f"{torch.version.cuda or 'none'}); use cpu, or auto to take CUDA only where it exists"
    )
    assert built == []


def test_trainer_keeps_the_teacher_on_the_models_device_on_cpu(tmp_path):
    """On the CPU the model's device is the CPU: the teacher stays (same object, same parameters); teacher_device
    "cpu" is accepted. (The move onto a GPU is tests/test_cuda.py's.)"""
    student, teacher = _llama(0), _llama(1)
    params = [p.data_ptr() for p in teacher.parameters()]
    trainer = SessionTrainer(model=student, args=_args(tmp_path, max_steps=1), train_dataset=_Data(2),
                             recipe=[OutputDistillationModifier()], teacher=teacher, teacher_device="cpu")  # fmt: skip
    trainer.train()
    assert trainer.session.lifecycle == "finalized"
    assert [p.data_ptr() for p in teacher.parameters()] == params


# --- refusals and fixes found by a tester (session 31) ------------------------------------------------


def test_model_init_auto_find_batch_size_and_a_started_session_are_refused_at_construction(tmp_path):
    """model_init: the Trainer trained a new model from it while the session pruned the one staged at construction
    (the trained model came out dense, the report said 0.6). auto_find_batch_size: the retry failed with "initialize()
    refused". An initialized session: refused with an update_state() error the caller never made."""
    with pytest.raises(ValueError) as info:
        SessionTrainer(model_init=_llama, args=_args(tmp_path), train_dataset=_Data(4),
                       recipe=[ConstantPruningModifier()])  # fmt: skip
    assert str(info.value) == (
        "SessionTrainer does not take model_init: the Trainer calls it again in train() (and in hyperparameter_search) "
        "and trains that new model, while the session compresses the model staged at construction; build the model "
        "yourself and pass model="
    )
    with pytest.raises(ValueError) as info:
        SessionTrainer(model=_llama(), args=_args(tmp_path, auto_find_batch_size=True), train_dataset=_Data(4),
                       recipe=[ConstantPruningModifier()])  # fmt: skip
    assert str(info.value).startswith("SessionTrainer does not take auto_find_batch_size: after an out-of-memory")
    session = Session([ConstantPruningModifier()])
    session.initialize(model=_llama())
    with pytest.raises(LifecycleError) as info:
        SessionTrainer(model=_llama(), args=_args(tmp_path), train_dataset=_Data(4), session=session)
    assert str(info.value) == (
        "SessionTrainer(session=...): the session is 'initialized'; the trainer stages its model and initializes the "
        "session at on_train_begin, so give a session in 'created' or 'staging' (a new Session, or session.reset() "
        "first)"
    )


def test_a_resume_with_other_steps_per_epoch_is_refused_before_the_trainer_loads_anything(tmp_path):
    """Gradient accumulation 1 against a checkpoint written with 2: the refusal said "Nothing was loaded" after the
    Trainer had loaded the checkpoint's weights and optimizer (the session's check ran at on_train_begin)."""
    reference, _ = _trainer(tmp_path / "a", _pruned_llama())
    reference.train()
    model = _llama(5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    other = SessionTrainer(model=model, args=_args(tmp_path / "b", max_steps=2, per_device_train_batch_size=1),
                           train_dataset=_Data(8), recipe=_resume_recipe(), teacher=_llama(1))  # fmt: skip
    with pytest.raises(CheckpointError) as info:
        other.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    assert info.value.differences == ("state steps_per_epoch is 4 in the checkpoint, 8 now",)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the Trainer loaded nothing
    assert other.session.lifecycle == "staging"


def test_older_checkpoints_are_rotated_only_after_the_session_is_written(tmp_path, monkeypatch, caplog):
    """save_total_limit=1 and the process killed while the session of checkpoint-6 is written: the Trainer had
    already deleted checkpoint-3, leaving nothing to resume from. checkpoint-3 now survives, and
    resume_from_checkpoint=True takes it, saying why."""

    class _Killed(Exception):
        pass

    save = Session.save

    def dies_at_step_6(self, path):
        if "checkpoint-6" in str(path):
            raise _Killed
        return save(self, path)

    monkeypatch.setattr(Session, "save", dies_at_step_6)
    trainer, _ = _trainer(tmp_path, _pruned_llama())
    trainer.args.save_total_limit = 1
    with pytest.raises(_Killed):
        trainer.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    monkeypatch.setattr(Session, "save", save)
    resumed, record = _trainer(tmp_path, _llama(5))
    with caplog.at_level("WARNING"):
        resumed.train(resume_from_checkpoint=True)
    assert (
        f"resume_from_checkpoint=True: {tmp_path / 'checkpoint-6'} holds no session ({SESSION_DIR}/ missing: the run "
        f"stopped before writing it); resuming from {tmp_path / 'checkpoint-3'}, the last checkpoint that holds one"
    ) in caplog.messages
    assert sorted(record.seen) == [4, 5, 6] and resumed.session.lifecycle == "finalized"


def test_distillation_under_accumulation_is_weighted_alike_with_a_compute_loss_func(tmp_path):
    """compute_loss_func (the Trainer then divides the loss no further): the distillation term, a per-micro-batch mean,
    was weighted 4x with 4 accumulation steps against one batch of 4 (a tester's case). The same update either way,
    as with the Trainer's own loss; and after session.reset(recipe=...) adding distillation too (the model was still
    given num_items_in_batch, its loss scaled for the window, the distillation term 4x again)."""

    def loss_func(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1].reshape(-1, VOCAB)
        summed = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), reduction="sum")
        return summed / num_items_in_batch

    def update(batch: int, accumulation: int, reset: bool, func) -> torch.Tensor:
        model = _llama()
        before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
        distill = [OutputDistillationModifier(temperature=2.0, alpha=1.0)]
        trainer = SessionTrainer(
            model=model, args=_args(tmp_path / f"{batch}{accumulation}{reset}{func}", max_steps=1, optim="sgd",
                                    per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation),
            train_dataset=_Data(4), recipe=[ConstantPruningModifier()] if reset else distill, teacher=_llama(1),
            compute_loss_func=func,
        )  # fmt: skip
        if reset:
            trainer.session.reset(recipe=distill)
        trainer.train()
        return model.model.layers[0].mlp.up_proj.weight.detach() - before

    for reset, func in ((False, loss_func), (True, loss_func), (True, None)):  # None: the model's loss, kwargs
        one, four = update(4, 1, reset, func), update(1, 4, reset, func)
        assert one.abs().sum() > 0
        torch.testing.assert_close(four, one, rtol=1e-4, atol=1e-7)


def test_a_recipe_of_calibration_only_modifiers_is_refused_by_the_trainer(tmp_path):
    """llm-compressor's three-stage recipe (docs/recipes.md): SessionTrainer asked for calibration_data it never
    used, then warned that SparseGPT and GPTQ do nothing, and left the model dense. Refused at construction now,
    and at train() after session.reset(recipe=...)."""
    recipe = (
        "sparsity_stage:\n  run_type: oneshot\n  sparsity_modifiers:\n    SparseGPTModifier: {sparsity: 0.5}\n"
        "finetuning_stage:\n  run_type: train\n  finetuning_modifiers:\n    ConstantPruningModifier: {start: 0}\n"
        "quantization_stage:\n  run_type: oneshot\n  quantization_modifiers:\n    GPTQModifier: {scheme: W4A16}\n"
    )
    with pytest.raises(ValueError) as info:
        SessionTrainer(model=_llama(), args=_args(tmp_path), train_dataset=_Data(4), recipe=recipe)
    assert str(info.value) == (
        "SessionTrainer sends no calibration events, and SparseGPTModifier (stage 'sparsity_stage', run_type: "
        "oneshot), GPTQModifier (stage 'quantization_stage', run_type: oneshot) compress on calibration events only "
        "(quantization-aware training is not implemented): in training they would do nothing. Compress with "
        "llmc_fsm.oneshot(model, recipe) before or after training (it skips run_type: train stages), and give "
        "SessionTrainer a recipe of the training stages only"
    )
    trainer = SessionTrainer(model=_llama(), args=_args(tmp_path, max_steps=1), train_dataset=_Data(4),
                             recipe=[ConstantPruningModifier()])
    trainer.session.reset(recipe="s:\n  QuantizationModifier: {scheme: W8A8}\n")
    with pytest.raises(ValueError, match=r"^SessionTrainer sends no calibration events, and QuantizationModifier "
                       r"\(stage 's'\) compresses on calibration events only"):
        trainer.train()
    assert trainer.session.lifecycle == "staging"


def test_a_user_callbacks_step_end_sees_the_batch_ended_and_may_save_the_session(tmp_path):
    """The session's callback was added after the user's: session.save() from a user's on_step_end was refused
    ("a checkpoint is taken between batches ... position 'optim_post_step'")."""
    saved = []

    class SaveSession(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trainer.session.save(tmp_path / f"session-{state.global_step}")
            saved.append(state.global_step)

    trainer = SessionTrainer(model=_llama(), args=_args(tmp_path, max_steps=2), train_dataset=_Data(4),
                             recipe=[ConstantPruningModifier()], callbacks=[SaveSession()])
    trainer.train()
    assert saved == [1, 2]
    assert (tmp_path / "session-2" / "session.json").is_file()
