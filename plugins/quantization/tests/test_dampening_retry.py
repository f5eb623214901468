"""GPTQ's damping retries: the warning names the modules and the dampening_frac used, which the modifier records."""

from __future__ import annotations

import logging

import torch
from compressed_tensors.quantization import QuantizationArgs
from llmc_fsm_quantization import GPTQModifier, gptq_quantize
from tiny_quant_models import tiny_llama

from llmc_fsm import Session
from llmc_fsm.pipeline.sequential import run_sequential

INT8_CHANNEL = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")


def test_gptq_names_the_modules_and_the_dampening_used_when_the_hessian_needed_more(caplog) -> None:
    """The warning said "GPTQ: Hessian not positive definite with dampening_frac=0; retrying with
    dampening_frac=0.0001" without naming the modules, and nothing said which damping they were quantized with
    (found by a tester)."""
    hessian = torch.ones(4, 4)  # rank 1: the Cholesky factorisation fails without damping
    weights = [torch.randn(3, 4, generator=torch.Generator().manual_seed(0)) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.toolkit.obs"):
        out = gptq_quantize(weights, hessian, args=INT8_CHANNEL, dampening_frac=0.0, modules="l.{q,k}_proj")
    assert [r.getMessage() for r in caplog.records] == [
        "GPTQ: l.{q,k}_proj: Hessian not positive definite with dampening_frac=0; compressed with "
        "dampening_frac=0.0001 (1 retry)"
    ]
    assert [q.dampening_frac for q in out] == [1e-4, 1e-4]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.toolkit.obs"):
        out = gptq_quantize(weights, torch.eye(4), args=INT8_CHANNEL, dampening_frac=0.0, modules="l.{q,k}_proj")
    assert caplog.records == []
    assert [q.dampening_frac for q in out] == [0.0, 0.0]


def test_gptq_modifier_records_the_dampening_each_module_was_quantized_with(caplog) -> None:
    """With dampening_frac 0 and two calibration tokens every Hessian is singular: each module is retried with
    dampening_frac 1e-4, which the modifier did not record (the report kept only the configured 0; found by a
    tester): now dampening_results maps each such module to the value used, and each warning names its modules."""
    modifier = GPTQModifier(scheme="W8A8", dampening_frac=0.0, ignore=["lm_head"])
    session = Session([modifier])
    session.initialize(model=tiny_llama(), calibration_data=torch.tensor([[5, 6]]))
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.toolkit.obs"):
        run_sequential(session, batch_size=1, progress=False)
    session.finalize()
    names = [f"model.layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")]
    assert modifier.dampening_results == dict.fromkeys(names, 1e-4)
    assert caplog.records[0].getMessage() == (
        "GPTQ: model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj: "
        "Hessian not positive definite with dampening_frac=0; compressed with dampening_frac=0.0001 (1 retry)"
    )
    assert len(caplog.records) == 8  # one per Hessian: q/k/v, o, gate/up, down in each layer


def test_the_report_records_the_dampening_a_module_was_quantized_with(tmp_path) -> None:
    """report.json kept only the recipe's dampening_frac 0 while every module was quantized with 1e-4 after a retry
    (found by a tester): each such module's entry now carries the dampening_frac used, and reads back."""
    import json

    import llmc_fsm
    from llmc_fsm.report.build import OneshotReport

    recipe = {"q": {"GPTQModifier": {"scheme": "W8A8", "dampening_frac": 0.0, "ignore": ["lm_head"]}}}
    llmc_fsm.oneshot(model=tiny_llama(), recipe=recipe, dataset=torch.tensor([[5, 6]]), output_dir=tmp_path / "o",
                     progress=False)
    data = json.loads((tmp_path / "o" / "report.json").read_text())
    used = {m["name"]: m.get("dampening_frac") for m in data["sparsity"]["modules"] if m.get("bits")}
    assert len(used) == 14 and set(used.values()) == {1e-4}
    again = OneshotReport.from_dict(data)
    assert {m.name: m.dampening_frac for m in again.modules if m.bits} == used
