"""The transformers.Trainer integration (SessionTrainer) on a tiny random Llama, CPU, a few steps."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmc_fsm_pruning")
pytest.importorskip("llmc_fsm_training")

from llmc_fsm_pruning.constant import ConstantPruningModifier  # noqa: E402
from llmc_fsm_pruning.magnitude import MagnitudePruningModifier  # noqa: E402
from llmc_fsm_training import LearningRateModifier, OutputDistillationModifier  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

from llmc_fsm import MissingStateError, Session  # noqa: E402
from llmc_fsm.integrations.transformers import SessionTrainer  # noqa: E402

VOCAB = 64


def _llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


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
    assert "SessionTrainer(..., teacher=teacher_model)" in str(info.value)
    assert "OutputDistillationModifier" in str(info.value)
    assert steps == []
    assert trainer.session.lifecycle == "staging"


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
