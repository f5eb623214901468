"""On a CUDA device: the same results as on the CPU, weights back where they were loaded, peak device memory.

Every test here is marked ``cuda``: it runs wherever torch sees a CUDA device; elsewhere it is skipped with the
reason and the terminal summary counts it (tests/conftest.py). CI has no GPU: none of these ran there.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from llmc_fsm_pruning.constant import ConstantPruningModifier
from llmc_fsm_training import OutputDistillationModifier
from safetensors.torch import load_file
from tiny_llama import llama

import llmc_fsm
from llmc_fsm import Session
from llmc_fsm.integrations.torch import initialize, optimizer_step
from llmc_fsm.oneshot_job.settings import default_recipe
from llmc_fsm.pipeline.sequential import run_sequential

pytestmark = pytest.mark.cuda


def windows(n: int = 8, length: int = 32) -> torch.Tensor:
    return torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(5))


def compress(recipe: dict, device: str, *, budget: int | None = None, dtype=torch.float32):
    model = llama(layers=3, hidden=128).to(dtype)
    session = Session(recipe)
    session.initialize(model=model, calibration_data=windows())
    result = run_sequential(session, batch_size=2, progress=False, device=device, activation_budget=budget)
    (modifier,) = session.modifiers
    session.finalize()
    return model, modifier, result


def linears(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}


def test_wanda_masks_are_identical_on_cuda_and_cpu():
    on_cpu, _, _ = compress(default_recipe("wanda", 0.5), "cpu")
    on_cuda, _, result = compress(default_recipe("wanda", 0.5), "cuda")
    assert result.device["device"].startswith("cuda:")
    for name, weight in linears(on_cuda).items():
        assert weight.device == torch.device("cpu"), name  # back where it was loaded
        assert torch.equal(weight != 0, linears(on_cpu)[name] != 0), name


@pytest.mark.parametrize(
    "recipe",
    [default_recipe("sparsegpt", 0.5), default_recipe("gptq", scheme="W4A16", group_size=32)],
    ids=["sparsegpt", "gptq"],
)
def test_layer_output_errors_agree_within_one_percent(recipe):
    _, cpu_modifier, _ = compress(recipe, "cpu")
    _, cuda_modifier, _ = compress(recipe, "cuda")
    assert list(cpu_modifier.results) == list(cuda_modifier.results)
    for name, cpu_result in cpu_modifier.results.items():
        a, b = cpu_result.rel_output_error, cuda_modifier.results[name].rel_output_error
        assert a is not None and b is not None, name
        assert abs(b - a) <= 0.01 * a, f"{name}: cpu {a:.6f} cuda {b:.6f}"


def test_offloaded_activations_give_bit_identical_weights_on_cuda():
    kept, _, kept_result = compress(default_recipe("sparsegpt", 0.5), "cuda")
    offloaded, _, off_result = compress(default_recipe("sparsegpt", 0.5), "cuda", budget=0)
    assert kept_result.activations["mode"] == "device"
    assert off_result.activations["mode"] == "cpu-offloaded"
    assert off_result.activations["batches_moved_to_device"] > 0
    a, b = linears(kept), linears(offloaded)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_peak_device_memory_is_reported_per_layer_and_bf16_sweeps_run_in_float32():
    model, modifier, result = compress(default_recipe("sparsegpt", 0.5), "cuda", dtype=torch.bfloat16)
    assert len(result.layer_peak_device_bytes) == 3 and all(b > 0 for b in result.layer_peak_device_bytes)
    assert result.peak_device_bytes >= max(result.layer_peak_device_bytes)
    for name, weight in linears(model).items():
        assert weight.dtype == torch.bfloat16 and weight.device == torch.device("cpu")
        assert int((weight == 0).sum()) == weight.numel() // 2, name
        assert modifier.results[name].rel_output_error < 1.0, name


def test_oneshot_on_cuda_reports_the_device():
    model = llama(layers=2)
    llmc_fsm.oneshot(model=model, recipe=default_recipe("wanda", 0.5), dataset=windows(), progress=False,
                     device="cuda")  # fmt: skip
    execution = model.llmc_fsm_report.execution
    index = torch.cuda.current_device()
    assert execution["device"] == {
        "device": f"cuda:{index}",
        "name": torch.cuda.get_device_name(index),
        "total_memory_bytes": torch.cuda.get_device_properties(index).total_memory,
    }
    assert execution["peak_device_bytes"] > 0
    assert all(p.device == torch.device("cpu") for p in model.parameters())


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_the_streamed_path_offloads_activations_to_cpu_memory_under_a_tiny_budget(tiny_model_dir, tmp_path):
    model_dir, text = tiny_model_dir
    runs = {}
    for budget in (None, 0):
        model = llmc_fsm.oneshot(
            model=str(model_dir), recipe=default_recipe("sparsegpt", 0.5), dataset=str(text),
            num_calibration_samples=4, max_seq_length=16, eval_text=str(text), num_eval_windows=2,
            eval_seq_length=16, batch_size=2, output_dir=str(tmp_path / f"out-{budget}"), low_memory=True,
            progress=False, device="cuda", activation_budget_mib=budget,
        )  # fmt: skip
        runs[budget] = model.llmc_fsm_report.to_dict()
    assert runs[None]["execution"]["activations"]["mode"] == "device"
    offloaded = runs[0]["execution"]["activations"]
    assert offloaded["mode"] == "cpu-offloaded" and offloaded["batches_moved_to_device"] > 0
    assert runs[None]["perplexity"] == runs[0]["perplexity"]
    a, b = _tensors(tmp_path / "out-None"), _tensors(tmp_path / "out-0")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- training: state on the parameters' device
def _train_batches(n: int, device: str, vocab: int = 128) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 16), generator=g).to(device)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return batches


def _steps(session: Session, model: torch.nn.Module, optimizer, batches) -> list[torch.Tensor]:
    model.train()
    losses = []
    for batch in batches:
        session.batch_start(batch=batch)
        loss = session.loss_calculated(model(**batch).loss)
        loss.backward()
        optimizer_step(session, optimizer)
        session.batch_end()
        losses.append(loss.detach())
    return losses


def _half_zero(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Zero every other input column of each decoder Linear; returns the zero sets (on the CPU)."""
    with torch.no_grad():
        for weight in linears(model).values():
            weight[:, ::2] = 0.0
    return {name: (weight == 0).cpu() for name, weight in linears(model).items()}


def _same_zeros(model: torch.nn.Module, zeros: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal((weight == 0).cpu(), zeros[name]) for name, weight in linears(model).items())


def test_constant_pruning_masks_live_on_the_cuda_weights_and_hold_their_zeros():
    model = llama(layers=2).cuda()
    zeros = _half_zero(model)
    modifier = ConstantPruningModifier()
    session = Session([modifier])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    initialize(session, model=model, optimizer=optimizer)
    _steps(session, model, optimizer, _train_batches(3, "cuda"))
    assert {mask.device.type for mask in modifier._masks.masks} == {"cuda"}
    assert _same_zeros(model, zeros)
    session.finalize()
    assert modifier.measured_sparsity == pytest.approx(0.5)


def test_constant_pruning_masks_follow_a_model_moved_to_cuda_after_they_were_taken():
    model = llama(layers=2)
    zeros = _half_zero(model)
    modifier = ConstantPruningModifier()
    session = Session([modifier])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(session, model=model, optimizer=optimizer)
    _steps(session, model, optimizer, _train_batches(1, "cpu"))  # masks taken on the CPU
    assert {mask.device.type for mask in modifier._masks.masks} == {"cpu"}
    model.cuda()  # the same Parameter objects, now on the GPU
    _steps(session, model, optimizer, _train_batches(2, "cuda"))
    assert {mask.device.type for mask in modifier._masks.masks} == {"cuda"}
    assert _same_zeros(model, zeros)
    session.finalize()


def _reference_loss(batch: dict[str, torch.Tensor], temperature: float, alpha: float) -> float:
    """The distillation loss of llama(seed=0) against llama(seed=1) on the CPU, the KL written out in float64."""
    student, teacher = llama(seed=0), llama(seed=1)
    batch = {k: v.cpu() for k, v in batch.items()}
    with torch.no_grad():
        out = student(**batch)
        s = torch.log_softmax(out.logits.double() / temperature, dim=-1)
        t = torch.log_softmax(teacher(input_ids=batch["input_ids"]).logits.double() / temperature, dim=-1)
    kd = float((t.exp() * (t - s)).sum(-1).mean()) * temperature**2
    return (1 - alpha) * float(out.loss) + alpha * kd


@pytest.mark.parametrize(("teacher_device", "where"), [(None, "cuda"), ("cpu", "cpu")], ids=["follows", "cpu"])
def test_the_teacher_is_placed_on_the_students_device_or_teacher_device(teacher_device, where):
    student, teacher = llama(seed=0).cuda(), llama(seed=1)
    modifier = OutputDistillationModifier(temperature=2.0, alpha=0.5)
    session = Session([modifier])
    optimizer = torch.optim.SGD(student.parameters(), lr=0.0)
    initialize(session, model=student, teacher=teacher, optimizer=optimizer, teacher_device=teacher_device)
    assert {p.device.type for p in teacher.parameters()} == {where}
    batch = _train_batches(1, "cuda")[0]
    (loss,) = _steps(session, student, optimizer, [batch])
    assert loss.device.type == "cuda" and modifier.last_distill_loss.device.type == "cuda"
    assert math.isclose(float(loss), _reference_loss(batch, 2.0, 0.5), rel_tol=1e-4)
    session.finalize()


def test_a_teacher_spread_over_two_devices_is_left_alone_or_refused_with_teacher_device():
    student, teacher = llama(seed=0).cuda(), llama(seed=1)
    teacher.model.layers[0].cuda()  # as a device map would put it
    session = Session([OutputDistillationModifier()])
    index = torch.cuda.current_device()
    with pytest.raises(ValueError) as info:
        initialize(session, model=student, teacher=teacher, teacher_device="cuda")
    assert str(info.value) == (
        f"teacher_device is 'cuda:{index}' but the teacher is spread over cpu, cuda:{index} (a device map); leave "
        "teacher_device unset to keep it as dispatched"
    )
    assert session.lifecycle == "created"
    initialize(session, model=student, teacher=teacher)
    assert teacher.model.embed_tokens.weight.device.type == "cpu"  # left as dispatched
    assert teacher.model.layers[0].self_attn.q_proj.weight.device.type == "cuda"
    session.finalize()


def test_session_trainer_on_cuda_moves_the_teacher_to_the_models_device(tmp_path):
    from transformers import TrainingArguments

    from llmc_fsm.integrations.transformers import SessionTrainer

    class Windows(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}

    student, teacher = llama(seed=0), llama(seed=1)
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], save_strategy="no", per_device_train_batch_size=2, max_steps=2,
        disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    modifier = OutputDistillationModifier()
    trainer = SessionTrainer(model=student, args=args, train_dataset=Windows(), recipe=[modifier], teacher=teacher)
    trainer.train()
    assert {p.device.type for p in student.parameters()} == {"cuda"}
    assert {p.device.type for p in teacher.parameters()} == {"cuda"}
    assert modifier.last_distill_loss is not None and trainer.session.lifecycle == "finalized"
