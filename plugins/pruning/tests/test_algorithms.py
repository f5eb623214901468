"""Tests for the pure-tensor pruning algorithms (magnitude, Wanda, SparseGPT)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llmc_fsm_pruning import (
    InputNormAccumulator,
    magnitude_mask,
    num_to_prune,
    parse_mask_structure,
    sparsegpt_prune,
    sparsegpt_prune_shared,
    wanda_mask,
)

from llmc_fsm.toolkit.obs import HessianAccumulator, HessianNotPositiveDefiniteError, _lower_triangular_inverse

MASK_MSG = r"expected 'unstructured' \(alias '0:0'\) or 'N:M' with integers 0 < N < M"
SPARSITY_MSG = r"sparsity must be a real number in \[0, 1\)"


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #
def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    """Like torch.testing.assert_close (whose first call costs ~2 s of imports)."""
    assert actual.shape == expected.shape
    diff = (actual.double() - expected.double()).abs()
    bound = atol + rtol * expected.double().abs()
    assert bool((diff <= bound).all()), f"max abs diff {float(diff.max()):.3g}"


def correlated_inputs(n_tokens: int, in_features: int, seed: int) -> torch.Tensor:
    """Inputs with strongly correlated channels of very different scales."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(in_features, in_features, generator=g) / in_features**0.5
    scales = torch.exp(torch.randn(in_features, generator=g))
    x = torch.randn(n_tokens, in_features, generator=g) @ mix
    x = x + 0.3 * torch.randn(n_tokens, in_features, generator=g)
    return x * scales


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[-1])
    acc.add_batch(x)
    return acc.hessian.clone()


def recon_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    """||W X^T - W_hat X^T||_F^2 in float64."""
    return float(((x.double() @ (w.double() - w_hat.double()).T) ** 2).sum())


def zeros_per_row(mask: torch.Tensor) -> torch.Tensor:
    return (~mask).sum(dim=1)


def assert_nm(mask: torch.Tensor, n: int, m: int) -> None:
    groups = mask.reshape(mask.shape[0], -1, m)
    assert torch.equal(groups.sum(dim=2), torch.full(groups.shape[:2], n))


def naive_sparsegpt(w, h, sparsity, block_size, damp=0.01):
    """Column-by-column OBS without lazy batching, float64, textbook inverse.

    Same mask rule as the implementation (over the whole block, at block start),
    but every update is applied to all remaining columns immediately.
    """
    w = w.double().clone()
    h = h.double().clone()
    cols = w.shape[1]
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.diag(h).mean() * torch.eye(cols, dtype=torch.float64)
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    u = torch.linalg.cholesky(hinv, upper=True)
    keep = torch.ones_like(w, dtype=torch.bool)
    for c0 in range(0, cols, block_size):
        c1 = min(c0 + block_size, cols)
        score = w[:, c0:c1] ** 2 / torch.diag(u)[c0:c1] ** 2
        score[:, dead[c0:c1]] = -1.0
        k = num_to_prune(c1 * w.shape[0], sparsity) - num_to_prune(c0 * w.shape[0], sparsity)
        if k:
            order = torch.argsort(score.flatten(), stable=True)[:k]
            block = torch.ones(score.numel(), dtype=torch.bool)
            block[order] = False
            keep[:, c0:c1] = block.view_as(score)
        for i in range(c0, c1):
            q = w[:, i] * keep[:, i]
            err = (w[:, i] - q) / u[i, i]
            w[:, i:] -= torch.outer(err, u[i, i:])
            w[:, i] = q
    return w, keep


# --------------------------------------------------------------------------- #
# parse_mask_structure / num_to_prune / argument validation
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "text, expected",
    [
        ("unstructured", None),
        (" Unstructured ", None),
        ("0:0", None),
        ("2:4", (2, 4)),
        ("4:8", (4, 8)),
        ("1:4", (1, 4)),
        (" 2 : 4 ", (2, 4)),
    ],
)
def test_parse_mask_structure_valid(text, expected):
    assert parse_mask_structure(text) == expected


@pytest.mark.parametrize(
    "text", ["", "2:2", "4:2", "0:4", "2:0", "-1:4", "2.0:4", "2:4:8", "2/4", "dense", "24", None, 2]
)
def test_parse_mask_structure_invalid(text):
    with pytest.raises(ValueError, match=MASK_MSG):
        parse_mask_structure(text)


@pytest.mark.parametrize(
    "numel, sparsity, expected",
    [
        (100, 0.0, 0),
        (100, 0.5, 50),
        (100, 0.29, 29),  # 0.29 * 100 == 28.999999999999996 in floats
        (3, 0.5, 2),  # 1.5 -> half rounds up
        (2, 0.25, 1),  # 0.5 -> 1
        (10, 0.34, 3),  # 3.4 -> 3
        (10, 0.36, 4),  # 3.6 -> 4
        (1, 0.4, 0),
        (1, 0.95, 1),
        (0, 0.5, 0),
        (4096, 0.7, 2867),  # 2867.2
    ],
)
def test_num_to_prune_rule(numel, sparsity, expected):
    assert num_to_prune(numel, sparsity) == expected


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), float("inf"), True, "0.5", None])
def test_invalid_sparsity_raises(bad):
    w = torch.randn(4, 8)
    h = torch.eye(8)
    x_norm = torch.ones(8)
    with pytest.raises(ValueError, match=SPARSITY_MSG):
        magnitude_mask(w, bad)
    with pytest.raises(ValueError, match=SPARSITY_MSG):
        wanda_mask(w, x_norm, bad)
    with pytest.raises(ValueError, match=SPARSITY_MSG):
        sparsegpt_prune(w, h, sparsity=bad)


@pytest.mark.parametrize("bad", ["2:2", "three:four", "1:0", (4, 2), (0, 4), [2, 4]])
def test_invalid_mask_structure_raises_in_all_algorithms(bad):
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match=MASK_MSG):
        magnitude_mask(w, 0.5, bad)
    with pytest.raises(ValueError, match=MASK_MSG):
        wanda_mask(w, torch.ones(8), 0.5, bad)
    with pytest.raises(ValueError, match=MASK_MSG):
        sparsegpt_prune(w, torch.eye(8), sparsity=0.5, mask_structure=bad)


def test_nm_requires_divisible_in_features():
    w = torch.randn(4, 10)
    msg = r"2:4 sparsity needs in_features divisible by 4, got in_features=10"
    with pytest.raises(ValueError, match=msg):
        magnitude_mask(w, 0.5, "2:4")
    with pytest.raises(ValueError, match=msg):
        wanda_mask(w, torch.ones(10), 0.5, "2:4")
    with pytest.raises(ValueError, match=msg):
        sparsegpt_prune(w, torch.eye(10), sparsity=0.5, mask_structure="2:4")


def test_sparsegpt_argument_errors():
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"hessian must have shape \(8, 8\)"):
        sparsegpt_prune(w, torch.eye(7), sparsity=0.5)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        sparsegpt_prune(w, torch.eye(8), sparsity=0.5, block_size=0)
    with pytest.raises(ValueError, match="block_size must be a multiple of M=4"):
        sparsegpt_prune(w, torch.eye(8), sparsity=0.5, mask_structure="2:4", block_size=6)
    with pytest.raises(ValueError, match=r"dampening_frac must be a number in \[0, 1e\+06\], got -1.0"):
        sparsegpt_prune(w, torch.eye(8), sparsity=0.5, dampening_frac=-1.0)
    h = torch.eye(8)
    h[2, 3] = float("nan")
    with pytest.raises(ValueError, match="hessian contains NaN or Inf"):
        sparsegpt_prune(w, h, sparsity=0.5)
    with pytest.raises(ValueError, match=r"weight must be a 2-D"):
        sparsegpt_prune(torch.randn(8), torch.eye(8), sparsity=0.5)


# --------------------------------------------------------------------------- #
# Accumulators
# --------------------------------------------------------------------------- #
def test_hessian_accumulator_matches_direct_and_is_split_invariant():
    torch.manual_seed(0)
    x = torch.randn(3, 50, 16) * torch.linspace(0.1, 3.0, 16)  # [batch, seq, C]
    tokens = x.reshape(-1, 16).double()
    expected = 2.0 / tokens.shape[0] * tokens.T @ tokens

    whole = HessianAccumulator(16)
    whole.add_batch(x)
    assert whole.num_samples == 150
    assert_close(whole.hessian.double(), expected, rtol=1e-5, atol=1e-5)

    # Uneven token splits, different leading shapes, and an empty batch.
    split = HessianAccumulator(16)
    flat = x.reshape(-1, 16)
    split.add_batch(flat[:1])
    split.add_batch(flat[1:1])
    split.add_batch(flat[1:40].reshape(1, 39, 16))
    split.add_batch(flat[40:])
    assert split.num_samples == 150
    assert split.hessian.dtype == torch.float32
    assert_close(split.hessian.double(), expected, rtol=1e-5, atol=1e-5)

    # Per-channel squared norms for Wanda come from the diagonal.
    assert_close(split.input_sq_norm.double(), (tokens**2).sum(0), rtol=1e-5, atol=1e-4)


def test_hessian_accumulator_bfloat16_input_and_errors():
    x = torch.randn(10, 8, dtype=torch.bfloat16)
    acc = HessianAccumulator(8)
    assert torch.equal(acc.hessian, torch.zeros(8, 8))
    acc.add_batch(x)
    xf = x.double()
    assert_close(acc.hessian.double(), 2 / 10 * xf.T @ xf, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expected input with last dimension 8"):
        acc.add_batch(torch.randn(4, 9))
    acc.reset()
    assert acc.num_samples == 0
    assert torch.equal(acc.hessian, torch.zeros(8, 8))


def test_input_norm_accumulator():
    torch.manual_seed(1)
    x = torch.randn(2, 33, 12) * 5
    acc = InputNormAccumulator(12)
    acc.add_batch(x[0])
    acc.add_batch(x[1, :7])
    acc.add_batch(x[1, 7:].unsqueeze(0))
    assert acc.num_samples == 66
    expected = (x.reshape(-1, 12).double() ** 2).sum(0)
    assert_close(acc.sq_norm.double(), expected, rtol=1e-6, atol=1e-6)
    assert acc.sq_norm.dtype == torch.float32
    with pytest.raises(ValueError, match="expected input with last dimension 12"):
        acc.add_batch(torch.randn(3, 11))


# --------------------------------------------------------------------------- #
# Magnitude
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.77])
def test_magnitude_unstructured_exact_global_count(sparsity):
    torch.manual_seed(0)
    w = torch.randn(37, 53)
    keep = magnitude_mask(w, sparsity)
    assert keep.dtype == torch.bool and keep.shape == w.shape
    assert int((~keep).sum()) == num_to_prune(w.numel(), sparsity)
    if 0 < sparsity:
        # Every pruned weight is no larger than every kept one.
        assert w.abs()[~keep].max() <= w.abs()[keep].min()


def test_magnitude_exact_count_with_ties():
    w = torch.ones(6, 10, dtype=torch.bfloat16)
    keep = magnitude_mask(w, 0.35)
    assert int((~keep).sum()) == 21


def test_magnitude_2_4():
    w = torch.tensor([[1.0, -4.0, 3.0, 0.5, 0.1, 0.2, -0.3, 0.05]])
    keep = magnitude_mask(w, 0.5, "2:4")
    assert keep.tolist() == [[False, True, True, False, False, True, True, False]]
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    keep = magnitude_mask(w, 0.0, "2:4")  # N:M ignores `sparsity`
    assert_nm(keep, 2, 4)
    assert_nm(magnitude_mask(w, 0.5, (1, 8)), 1, 8)


# --------------------------------------------------------------------------- #
# Wanda
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("sparsity", [0.0, 0.25, 0.5, 0.6])
def test_wanda_per_row_exact_and_score_order(sparsity):
    torch.manual_seed(0)
    w = torch.randn(20, 30)
    x = correlated_inputs(200, 30, seed=3)
    norms = InputNormAccumulator(30)
    norms.add_batch(x)
    keep = wanda_mask(w, norms.sq_norm, sparsity)
    k = num_to_prune(30, sparsity)
    assert torch.equal(zeros_per_row(keep), torch.full((20,), k))
    score = w.abs() * norms.sq_norm.sqrt()
    if k:
        pruned_max = score.masked_fill(keep, -1).max(dim=1).values
        kept_min = score.masked_fill(~keep, math.inf).min(dim=1).values
        assert bool((pruned_max <= kept_min).all())


def test_wanda_uses_input_norms():
    # Channel 0 has tiny weights but a huge input norm: Wanda keeps it, magnitude prunes it.
    w = torch.tensor([[0.1, 1.0, 0.9, 0.8]])
    sq = torch.tensor([1e4, 1.0, 1.0, 1.0])
    assert wanda_mask(w, sq, 0.5).tolist() == [[True, True, False, False]]
    assert magnitude_mask(w, 0.5).tolist() == [[False, True, True, False]]
    # Scale invariance of the norms, and equivalence to the HessianAccumulator source.
    torch.manual_seed(2)
    w = torch.randn(8, 16)
    x = correlated_inputs(64, 16, seed=4)
    acc_h, acc_n = HessianAccumulator(16), InputNormAccumulator(16)
    acc_h.add_batch(x)
    acc_n.add_batch(x)
    m1 = wanda_mask(w, acc_n.sq_norm, 0.5)
    assert torch.equal(m1, wanda_mask(w, acc_h.input_sq_norm, 0.5))
    assert torch.equal(m1, wanda_mask(w, acc_n.sq_norm * 7.0, 0.5))


def test_wanda_2_4_and_errors():
    torch.manual_seed(0)
    w = torch.randn(12, 32)
    keep = wanda_mask(w, torch.rand(32) + 0.1, 0.5, "2:4")
    assert_nm(keep, 2, 4)
    with pytest.raises(ValueError, match=r"input_sq_norm must have shape \(32,\)"):
        wanda_mask(w, torch.ones(31), 0.5)
    bad = torch.ones(32)
    bad[3] = -1
    with pytest.raises(ValueError, match="finite and non-negative"):
        wanda_mask(w, bad, 0.5)


# --------------------------------------------------------------------------- #
# SparseGPT
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("sparsity", [0.5, 0.3, 0.7])
@pytest.mark.parametrize("block_size", [128, 32, 7])
def test_sparsegpt_exact_per_layer_and_per_block_counts(sparsity, block_size):
    torch.manual_seed(0)
    w = torch.randn(24, 100)
    x = correlated_inputs(300, 100, seed=1)
    pruned, keep = sparsegpt_prune(w, hessian_of(x), sparsity=sparsity, block_size=block_size)
    assert pruned.shape == w.shape and pruned.dtype == w.dtype
    assert keep.dtype == torch.bool
    assert int((~keep).sum()) == num_to_prune(24 * 100, sparsity)
    for c0 in range(0, 100, block_size):
        c1 = min(c0 + block_size, 100)
        k = num_to_prune(c1 * 24, sparsity) - num_to_prune(c0 * 24, sparsity)
        assert int((~keep[:, c0:c1]).sum()) == k
    # the mask adapts across rows (selection over the whole block, Algorithm 1)
    assert len(set(zeros_per_row(keep).tolist())) > 1
    assert bool((pruned[~keep] == 0).all())
    assert bool((pruned[keep] != 0).all())
    assert bool(torch.isfinite(pruned).all())


def test_sparsegpt_half_sparsity_is_exactly_half():
    torch.manual_seed(0)
    w = torch.randn(64, 384)
    x = correlated_inputs(512, 384, seed=2)
    _, keep = sparsegpt_prune(w, hessian_of(x), sparsity=0.5, block_size=128)
    assert int((~keep).sum()) == w.numel() // 2
    for c0 in (0, 128, 256):
        assert int((~keep[:, c0 : c0 + 128]).sum()) == 64 * 64


def test_sparsegpt_2_4_pattern_and_dtype():
    torch.manual_seed(0)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    x = correlated_inputs(256, 64, seed=5)
    pruned, keep = sparsegpt_prune(w, hessian_of(x), sparsity=0.5, mask_structure="2:4", block_size=16)
    assert pruned.dtype == torch.bfloat16
    assert_nm(keep, 2, 4)
    groups = (pruned != 0).reshape(32, -1, 4).sum(dim=2)
    assert int(groups.max()) <= 2  # at least 2 zeros in every group of 4
    assert bool((pruned[~keep] == 0).all())
    assert_nm(sparsegpt_prune(w, hessian_of(x), sparsity=0.0, mask_structure="1:4")[1], 1, 4)


def test_sparsegpt_nm_is_independent_of_block_size():
    # The N:M mask is chosen per group from the fully updated weights, and the
    # lazy block updates are exact, so the block size must not change the result.
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    h = hessian_of(correlated_inputs(256, 64, seed=6))
    ref, ref_keep = sparsegpt_prune(w, h, sparsity=0.5, mask_structure="2:4", block_size=64)
    for bs in (4, 8, 32):
        out, keep = sparsegpt_prune(w, h, sparsity=0.5, mask_structure="2:4", block_size=bs)
        assert torch.equal(keep, ref_keep)
        assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sparsity, block_size", [(0.5, 16), (0.4, 24), (0.6, 64)])
def test_sparsegpt_matches_naive_column_by_column_obs(sparsity, block_size):
    torch.manual_seed(0)
    w = torch.randn(12, 48)
    x = correlated_inputs(200, 48, seed=7)
    x[:, 5] = 0.0  # one dead input
    h = hessian_of(x)
    out, keep = sparsegpt_prune(w, h, sparsity=sparsity, block_size=block_size)
    ref, ref_keep = naive_sparsegpt(w, h, sparsity, block_size)
    assert torch.equal(keep, ref_keep)
    assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)


def test_sparsegpt_identity_hessian_reduces_to_blockwise_magnitude():
    # With H = I there is nothing to compensate: SparseGPT = magnitude pruning of each block.
    torch.manual_seed(0)
    w = torch.randn(10, 32)
    out, keep = sparsegpt_prune(w, torch.eye(32), sparsity=0.5, block_size=8)
    for c0 in range(0, 32, 8):
        blk = w[:, c0 : c0 + 8]
        expected = magnitude_mask(blk, 0.5)
        assert torch.equal(keep[:, c0 : c0 + 8], expected)
    assert torch.equal(out, w * keep)


def low_rank_inputs(n_tokens: int, in_features: int, rank: int, seed: int) -> torch.Tensor:
    """LLM-like activations: a rank-``rank`` signal plus isotropic noise, with
    per-channel scales spread over ~an order of magnitude."""
    g = torch.Generator().manual_seed(seed)
    factors = torch.randn(rank, in_features, generator=g) / rank**0.5
    scales = torch.exp(0.5 * torch.randn(in_features, generator=g))
    x = torch.randn(n_tokens, rank, generator=g) @ factors
    return (x + 0.2 * torch.randn(n_tokens, in_features, generator=g)) * scales


@pytest.mark.parametrize("structure", [None, "2:4"])
def test_sparsegpt_reconstruction_beats_magnitude_and_wanda(structure):
    torch.manual_seed(0)
    w = torch.randn(96, 256)
    x = low_rank_inputs(1024, 256, rank=64, seed=11)
    acc = HessianAccumulator(256)
    for chunk in x.split(100):
        acc.add_batch(chunk)
    pruned, keep = sparsegpt_prune(w, acc.hessian, sparsity=0.5, mask_structure=structure)
    err_sgpt = recon_error(w, pruned, x)
    err_mag = recon_error(w, w * magnitude_mask(w, 0.5, structure), x)
    err_wanda = recon_error(w, w * wanda_mask(w, acc.input_sq_norm, 0.5, structure), x)
    err_mask_only = recon_error(w, w * keep, x)
    # Measured with these seeds: SparseGPT / magnitude = 0.23 (unstructured) and
    # 0.20 (2:4); SparseGPT / Wanda = 0.43 and 0.30; SparseGPT / (its own mask
    # without the OBS update) = 0.37 and 0.35.
    assert err_sgpt < 0.6 * err_mag, err_sgpt / err_mag
    assert err_sgpt < 0.6 * err_wanda, err_sgpt / err_wanda
    assert err_sgpt < 0.5 * err_mask_only, err_sgpt / err_mask_only


def test_sparsegpt_zero_sparsity_returns_weight_unchanged():
    torch.manual_seed(0)
    w = torch.randn(8, 16, dtype=torch.float16)
    h = hessian_of(torch.randn(40, 16))
    out, keep = sparsegpt_prune(w, h, sparsity=0.0)
    assert out.dtype == torch.float16
    assert torch.equal(out, w)
    assert out.data_ptr() != w.data_ptr()
    assert bool(keep.all())
    assert torch.equal(magnitude_mask(w, 0.0), torch.ones(8, 16, dtype=torch.bool))
    assert bool(wanda_mask(w, torch.ones(16), 0.0).all())


def test_sparsegpt_dead_inputs_no_nan_and_pruned_first():
    torch.manual_seed(0)
    w = torch.randn(16, 32)
    x = correlated_inputs(128, 32, seed=8)
    dead_cols = [0, 3, 17, 30]
    x[:, dead_cols] = 0.0
    h = hessian_of(x)
    assert bool((torch.diag(h)[dead_cols] == 0).all())
    out, keep = sparsegpt_prune(w, h, sparsity=0.5, block_size=16)
    assert bool(torch.isfinite(out).all())
    assert not bool(keep[:, dead_cols].any())  # free to prune: pruned first
    assert int((~keep).sum()) == 16 * 16

    # More dead columns than the per-block budget: kept dead weights keep their value.
    x[:, :12] = 0.0
    out, keep = sparsegpt_prune(w, hessian_of(x), sparsity=0.25, block_size=16)
    assert bool(torch.isfinite(out).all())
    assert int((~keep).sum()) == 16 * 8
    kept_dead = keep[:, :12]
    assert torch.equal(out[:, :12][kept_dead], w[:, :12][kept_dead])

    # A fully dead layer is still finite.
    out, keep = sparsegpt_prune(w, torch.zeros(32, 32), sparsity=0.5)
    assert bool(torch.isfinite(out).all())
    assert int((~keep).sum()) == 16 * 16


def _indefinite_hessian() -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(0)))
    return q @ torch.diag(torch.tensor([-1.0, 2.0, 3.0, 3.0, 4.0, 5.0])) @ q.T


def test_sparsegpt_not_positive_definite_raises():
    w = torch.randn(4, 6)
    with pytest.raises(HessianNotPositiveDefiniteError, match="larger dampening_frac"):
        sparsegpt_prune(w, _indefinite_hessian(), sparsity=0.5, max_dampening_retries=0)
    with pytest.raises(ValueError, match="not positive definite"):
        sparsegpt_prune(w, _indefinite_hessian(), sparsity=0.5, max_dampening_retries=1)


def test_sparsegpt_retries_with_growing_dampening(caplog):
    # mean(diag H) = 16/6; lambda must exceed 1: frac 0.01 -> 0.1 fail, 1.0 succeeds.
    w = torch.randn(4, 6)
    with caplog.at_level(logging.WARNING):
        out, keep = sparsegpt_prune(w, _indefinite_hessian(), sparsity=0.5)
    assert bool(torch.isfinite(out).all())
    assert int((~keep).sum()) == 12
    assert [r.getMessage() for r in caplog.records if "dampening_frac" in r.getMessage()] == [
        "SparseGPT: Hessian not positive definite with dampening_frac=0.01; compressed with dampening_frac=1 "
        "(2 retries)"
    ]


def test_sparsegpt_names_the_modules_and_gives_the_dampening_used_after_retries(caplog):
    """A retry logged "SparseGPT: Hessian not positive definite with dampening_frac=0.01; retrying with
    dampening_frac=0.1" per retry without naming the modules, and the damping finally used was not returned
    (found by a tester): one warning names them and dampening_used receives the value."""
    weights = [torch.randn(4, 6, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    used: list[float] = []
    with caplog.at_level(logging.WARNING):
        sparsegpt_prune_shared(weights, _indefinite_hessian(), sparsity=0.5, modules="l.{q,k}_proj",
                               dampening_used=used)
    assert [r.getMessage() for r in caplog.records if "dampening_frac" in r.getMessage()] == [
        "SparseGPT: l.{q,k}_proj: Hessian not positive definite with dampening_frac=0.01; compressed with "
        "dampening_frac=1 (2 retries)"
    ]
    assert used == [1.0]
    with pytest.raises(HessianNotPositiveDefiniteError) as err:
        sparsegpt_prune_shared(weights, _indefinite_hessian(), sparsity=0.5, max_dampening_retries=1,
                               modules="l.{q,k}_proj")
    assert str(err.value) == (
        "SparseGPT: l.{q,k}_proj: the Hessian is not positive definite even with dampening_frac=0.1 (started at "
        "0.01, 1 retry). Use a larger dampening_frac or more / more diverse calibration samples."
    )
    used.clear()
    sparsegpt_prune_shared(weights, torch.eye(6), sparsity=0.5, dampening_used=used)
    assert used == [0.01]


# --------------------------------------------------------------------------- #
# Property test: the count rule
# --------------------------------------------------------------------------- #
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    out_features=st.integers(1, 9),
    in_features=st.one_of(st.integers(1, 40), st.integers(1, 10).map(lambda g: 4 * g)),
    sparsity=st.floats(0.0, 0.95),
    block_size=st.sampled_from([4, 8, 12, 128]),
    seed=st.integers(0, 2**16),
)
def test_property_zero_counts_follow_rule(out_features, in_features, sparsity, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(3 * in_features + 1, in_features, generator=g)
    h = hessian_of(x)
    sq = (x**2).sum(0)

    # The rule itself: nearest integer to sparsity * n.
    for n in (in_features, w.numel()):
        k = num_to_prune(n, sparsity)
        assert abs(k - sparsity * n) <= 0.5 + 1e-9 and 0 <= k <= n

    assert int((~magnitude_mask(w, sparsity)).sum()) == num_to_prune(w.numel(), sparsity)
    k_row = torch.full((out_features,), num_to_prune(in_features, sparsity))
    assert torch.equal(zeros_per_row(wanda_mask(w, sq, sparsity)), k_row)
    pruned, keep = sparsegpt_prune(w, h, sparsity=sparsity, block_size=block_size)
    assert int((~keep).sum()) == num_to_prune(w.numel(), sparsity)
    assert bool(torch.isfinite(pruned).all())
    assert bool((pruned[~keep] == 0).all())

    if in_features % 4 == 0:
        assert_nm(magnitude_mask(w, sparsity, "2:4"), 2, 4)
        assert_nm(wanda_mask(w, sq, sparsity, "2:4"), 2, 4)
        assert_nm(sparsegpt_prune(w, h, sparsity=sparsity, mask_structure="2:4", block_size=block_size)[1], 2, 4)
    else:
        with pytest.raises(ValueError, match="divisible by 4"):
            magnitude_mask(w, sparsity, "2:4")


def test_hessian_block_triangle_path_equals_full_product():
    # in_features >= 1024 takes the symmetric (upper block triangle + mirror) path
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 50, 1030, generator=g)
    acc = HessianAccumulator(1030)
    acc.add_batch(x[0])
    first = acc.hessian.clone()  # read between batches: mirrored, then updated again
    acc.add_batch(x[1:])
    flat = x.reshape(-1, 1030).double()
    expected = 2.0 / flat.shape[0] * flat.T @ flat
    assert_close(acc.hessian.double(), expected, rtol=1e-4, atol=1e-3)
    assert torch.equal(acc.hessian, acc.hessian.T)
    assert_close(first.double(), 2.0 / 50 * x[0].double().T @ x[0].double(), rtol=1e-4, atol=1e-3)


# --------------------------------------------------------------------------- #
# SparseGPT on weights that share a Hessian (q/k/v, gate/up)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("structure, block_size", [("unstructured", 32), ("unstructured", 7), ("2:4", 16)])
def test_sparsegpt_shared_equals_pruning_each_weight_alone(structure, block_size):
    torch.manual_seed(0)
    weights = [torch.randn(24, 64), torch.randn(8, 64), torch.randn(8, 64, dtype=torch.bfloat16)]
    h = hessian_of(correlated_inputs(256, 64, seed=11))
    shared = sparsegpt_prune_shared(weights, h, sparsity=0.5, mask_structure=structure, block_size=block_size)
    assert len(shared) == 3
    for w, (out, keep) in zip(weights, shared, strict=True):
        ref, ref_keep = sparsegpt_prune(w, h, sparsity=0.5, mask_structure=structure, block_size=block_size)
        assert out.dtype == w.dtype and out.shape == w.shape
        assert torch.equal(keep, ref_keep)  # each weight's mask is chosen over its own rows only
        assert_close(out.float(), ref.float(), rtol=1e-5, atol=1e-5)
        assert int((~keep).sum()) == w.numel() // 2


@pytest.mark.parametrize("structure", ["unstructured", "2:4"])
def test_sparsegpt_shared_reports_the_measured_output_error(structure):
    # from the sweep's own terms; measured here on X itself, with an input channel that is always zero (dead)
    torch.manual_seed(1)
    x = correlated_inputs(512, 64, seed=12)
    x[:, 3] = 0.0
    weights = [torch.randn(24, 64), torch.randn(8, 64)]
    errors: list[float] = []
    shared = sparsegpt_prune_shared(weights, hessian_of(x), sparsity=0.5, mask_structure=structure, errors=errors)
    assert len(errors) == 2
    for w, (out, _keep), error in zip(weights, shared, errors, strict=True):
        measured = (recon_error(w, out, x) / float(((x.double() @ w.double().T) ** 2).sum())) ** 0.5
        assert error == pytest.approx(measured, rel=1e-4)
        assert 0.01 < error < 1.0
    nothing: list[float] = []
    sparsegpt_prune_shared(weights, hessian_of(x), sparsity=0.0, errors=nothing)
    assert nothing == [0.0, 0.0]


@pytest.mark.parametrize("dampening_frac", [1e4, 1e6])
def test_sparsegpt_shared_reports_the_measured_output_error_under_huge_damping(dampening_frac):
    # nearly all of the sweep's terms are then damping; their difference had lost its float32 digits
    torch.manual_seed(1)
    x = correlated_inputs(512, 64, seed=12)
    weights = [torch.randn(24, 64), torch.randn(8, 64)]
    errors: list[float] = []
    shared = sparsegpt_prune_shared(weights, hessian_of(x), sparsity=0.5, dampening_frac=dampening_frac, errors=errors)
    for w, (out, _keep), error in zip(weights, shared, errors, strict=True):
        measured = (recon_error(w, out, x) / float(((x.double() @ w.double().T) ** 2).sum())) ** 0.5
        assert error == pytest.approx(measured, rel=1e-4)
        assert error > 0.1


def test_sparsegpt_shared_rejects_bad_groups():
    h = torch.eye(8)
    with pytest.raises(ValueError, match="at least one 2-D weight"):
        sparsegpt_prune_shared([], h, sparsity=0.5)
    msg = r"same in_features and device, got \[\(\(4, 8\), 'cpu'\), \(\(4, 6\), 'cpu'\)\]"
    with pytest.raises(ValueError, match=msg):
        sparsegpt_prune_shared([torch.randn(4, 8), torch.randn(4, 6)], h, sparsity=0.5)


@pytest.mark.parametrize("n", [1, 5, 128, 129, 300])
def test_lower_triangular_inverse_matches_a_triangular_solve(n):
    x = correlated_inputs(2 * n + 8, n, seed=n)
    h = x.T @ x / n + 0.1 * torch.eye(n)
    chol = torch.linalg.cholesky(h)
    inv = _lower_triangular_inverse(chol)
    ref = torch.linalg.solve_triangular(chol, torch.eye(n), upper=False)
    assert bool((inv.triu(1) == 0).all())
    assert_close(inv, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))
