"""``llmc_fsm.toolkit.obs``: the finiteness check and the factor's treatment of its input (issue 26 speed work)."""

from __future__ import annotations

import math

import torch

from llmc_fsm.toolkit.obs import all_finite, inverse_hessian_cholesky


def test_all_finite_decides_an_overflowing_float32_sum_in_float64():
    big = torch.full((4,), 3.0e38)  # finite values whose float32 sum overflows
    assert math.isinf(float(big.sum()))
    assert all_finite(big) is True
    assert all_finite(torch.tensor([1.0, float("nan")])) is False
    assert all_finite(torch.tensor([1.0, float("inf")])) is False
    assert all_finite(torch.tensor([3.0e38, 3.0e38, float("-inf")])) is False
    assert all_finite(torch.tensor([float("inf"), float("-inf")])) is False  # the float32 sum is NaN


def test_factor_leaves_the_hessian_unchanged_and_sets_dead_inputs_to_one():
    torch.manual_seed(0)
    x = torch.randn(64, 6, dtype=torch.float64)
    x[:, 2] = 0.0  # a dead input
    h64 = 2.0 / 64 * x.T @ x
    hessian = h64.to(torch.float32)
    before = hessian.clone()
    U, dead, damping = inverse_hessian_cholesky(hessian, dampening_frac=0.01)
    assert torch.equal(hessian, before)  # not modified, dead entry included
    assert dead.tolist() == [False, False, True, False, False, False]
    ref = h64.clone()
    ref[2, 2] = 1.0
    lam = 0.01 * float(ref.diagonal().mean())
    assert math.isclose(damping, lam, rel_tol=1e-6)
    inverse = torch.linalg.inv(ref + lam * torch.eye(6, dtype=torch.float64))
    assert torch.allclose(U.double().T @ U.double(), inverse, rtol=1e-4, atol=1e-6)
    assert torch.equal(U, torch.triu(U))
    # without dead inputs the input is read in place (no copy) and still not modified
    live = hessian.clone()
    live[2, 2] = 1.0
    kept = live.clone()
    inverse_hessian_cholesky(live, dampening_frac=0.01)
    assert torch.equal(live, kept)
