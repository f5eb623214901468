"""On a CUDA device: the same results as on the CPU, weights back where they were loaded, peak device memory.

Every test here is marked ``cuda``: it runs wherever torch sees a CUDA device; elsewhere it is skipped with the
reason and the terminal summary counts it (tests/conftest.py). CI has no GPU: none of these ran there.
"""

from __future__ import annotations

import pytest
import torch
from tiny_llama import llama

import llmc_fsm
from llmc_fsm import Session
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
