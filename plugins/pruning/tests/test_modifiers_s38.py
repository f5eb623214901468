"""Session 38 findings of a tester on SparseGPT / Wanda options: an N:M structure on a module whose in_features M does
not divide is refused before any work (it failed mid-layer), and SparseGPT takes ``dampening_frac: 0`` as GPTQ and
llm-compressor do."""

from __future__ import annotations

import logging

import pytest
import torch
from llmc_fsm_pruning import SparseGPTModifier, WandaPruningModifier
from test_modifiers import DATA, Toy

from llmc_fsm import ModifierError, Session
from llmc_fsm.pipeline.sequential import run_sequential


@pytest.mark.parametrize("cls", [SparseGPTModifier, WandaPruningModifier])
def test_n_m_on_in_features_m_does_not_divide_is_refused_at_initialize_naming_every_module(cls):
    """Found by a tester: 2:4 on a Linear with in_features 102 pruned the layer's other modules, then failed in the
    sweep with "2:4 sparsity needs in_features divisible by 4, got in_features=102" naming no module (the CLI after
    loading and calibrating). Now initialize refuses it, every such module named, and nothing changes."""
    torch.manual_seed(0)
    model = Toy(width=18).eval()  # a: in_features 18 (not a multiple of 4); b: 36
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    session = Session([cls(mask_structure="2:4", ignore=["head"])])
    with pytest.raises(ModifierError) as info:
        session.initialize(model=model, calibration_data=DATA)
    assert str(info.value.__cause__) == (
        f"{cls.__name__} cannot compress 2 of its 4 targets — in_features 18 is not a multiple of M=4 (mask_structure "
        "'2:4' keeps 2 of every 4 consecutive weights along the input dimension): layers.{0..1}.a. Narrow targets or "
        "add these modules to ignore."
    )
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    fine = Session([cls(mask_structure="2:4", ignore=["head", "re:.*\\.a$"])])
    fine.initialize(model=model, calibration_data=DATA)  # the modules M divides: accepted
    assert sorted(fine.modifiers[0].resolved_targets) == ["layers.0.b", "layers.1.b"]


def test_sparsegpt_takes_dampening_frac_zero_and_retries_a_singular_hessian(caplog):
    """Found by a tester: docs/quantization.md says GPTQ and SparseGPT retry a Hessian that is not positive
    definite with dampening_frac 0 (from 0: 1e-4), but SparseGPTModifier refused 0 ("must be a number in (0, 1e+06]")
    while GPTQModifier and llm-compressor's SparseGPT accept it. 2 windows of 3 tokens give a rank-6 Hessian of the
    16 inputs of layers.*.a: undamped, it is singular, and the retry prunes it with 1e-4."""
    model = Toy().eval()
    torch.manual_seed(0)
    model = Toy().eval()
    session = Session([SparseGPTModifier(dampening_frac=0, ignore=["head"])])
    data = DATA[:2, :3]
    session.initialize(model=model, calibration_data=data)
    with caplog.at_level(logging.WARNING):
        run_sequential(session, batch_size=2, progress=False)
    session.finalize()
    modifier = session.modifiers[0]
    assert modifier.dampening_frac == 0.0
    names = ["layers.0.a", "layers.0.b", "layers.1.a", "layers.1.b"]
    assert modifier.dampening_results == dict.fromkeys(names, 1e-4)
    assert [r.getMessage() for r in caplog.records if "positive definite" in r.getMessage()] == [
        f"SparseGPT: {name}: Hessian not positive definite with dampening_frac=0; compressed with "
        "dampening_frac=0.0001 (1 retry)" for name in names
    ]
    for name in names:
        weight = model.get_submodule(name).weight
        assert int((weight == 0).sum()) == weight.numel() // 2, name
