"""``llmc_fsm.toolkit.obs``: the finiteness check and the factor's treatment of its input (issue 26 speed work)."""

from __future__ import annotations

import math

import pytest
import torch

from llmc_fsm.pipeline.forward import first_output
from llmc_fsm.toolkit.obs import all_finite, inverse_hessian_cholesky, obs_sweep


def test_all_finite_decides_an_overflowing_float32_sum_in_float64():
    big = torch.full((4,), 3.0e38)  # finite values whose float32 sum overflows
    assert math.isinf(float(big.sum()))
    assert all_finite(big) is True
    assert all_finite(torch.tensor([1.0, float("nan")])) is False
    assert all_finite(torch.tensor([1.0, float("inf")])) is False
    assert all_finite(torch.tensor([3.0e38, 3.0e38, float("-inf")])) is False
    assert all_finite(torch.tensor([float("inf"), float("-inf")])) is False  # the float32 sum is NaN


def test_all_finite_reads_a_parameter_without_a_warning():
    """The NaN/Inf check on a model's weight (a Parameter that requires grad) printed torch's "Converting a tensor
    with requires_grad=True to a scalar" warning in every in-memory CLI run (found this session)."""
    import warnings

    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all_finite(weight) is True
        assert all_finite(torch.nn.Parameter(torch.tensor([1.0, float("nan")]))) is False


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


def test_a_diagonal_only_accumulator_keeps_the_mean_squares_and_has_no_hessian():
    import pytest

    from llmc_fsm.toolkit.obs import HessianAccumulator

    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(3, 5, 600, generator=g, dtype=torch.float64) for _ in range(3)]  # 600: blocked path
    full, diag = HessianAccumulator(600), HessianAccumulator(600, diagonal_only=True)
    for x in batches:
        full.add_batch(x.to(torch.float32))
        diag.add_batch(x.to(torch.float32))
    x = torch.cat([b.reshape(-1, 600) for b in batches])
    expected = 2.0 * x.square().sum(0) / x.shape[0]  # diag(H) = (2/n) sum_t x_tj^2, float64 reference
    assert diag.diagonal.shape == (600,) and diag.num_samples == 45
    torch.testing.assert_close(diag.diagonal.to(torch.float64), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(full.diagonal.to(torch.float64), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(diag.input_sq_norm.to(torch.float64), x.square().sum(0), rtol=1e-5, atol=0)
    with pytest.raises(AttributeError, match=r"keeps diag\(H\) only"):
        diag.hessian  # noqa: B018
    assert getattr(diag, "hessian", None) is None  # how the report's error step finds none to measure with
    diag.all_reduce()  # one process: nothing to combine, nothing changed
    torch.testing.assert_close(diag.diagonal.to(torch.float64), expected, rtol=1e-5, atol=0)


def test_bad_inputs_to_the_sweep_and_the_factor_are_refused_in_one_line():
    """B4's cases (session 31): a lower Cholesky factor (torch.linalg.cholesky's default) was swept as if upper,
    giving other weights silently; ``max_dampening_retries=-1`` reported "(-1 retries)" on the identity; the layer
    output reader raised IndexError on an empty tuple where its docstring says TypeError."""
    class Round:  # each column rounded to an integer
        sub_block = 1

        def begin_block(self, c0: int, c1: int, W1: torch.Tensor, d1: torch.Tensor) -> None:
            """Nothing to prepare per block."""

        def column(self, j: int, W1: torch.Tensor, i: int, out: torch.Tensor) -> torch.Tensor:
            return torch.round(W1[i], out=out)

    h = torch.eye(4) * 2 + 0.5
    upper = inverse_hessian_cholesky(h).U
    weight_t = torch.randn(4, 3)
    obs_sweep(weight_t.clone(), upper, Round())
    with pytest.raises(ValueError, match=r"^U must be upper triangular \(inverse_hessian_cholesky's U\)"):
        obs_sweep(weight_t.clone(), upper.T.contiguous(), Round())
    with pytest.raises(ValueError, match=r"^max_dampening_retries must be an int >= 0, got -1$"):
        inverse_hessian_cholesky(torch.eye(3), max_dampening_retries=-1)
    with pytest.raises(TypeError, match=r"^cannot read the hidden states from a decoder layer output of type tuple$"):
        first_output(())
