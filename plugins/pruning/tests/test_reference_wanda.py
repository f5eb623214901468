"""Wanda against an independent reference written from the paper.

Sun et al., "A Simple and Effective Pruning Approach for Large Language Models"
(arXiv:2306.11695), Section 3: the score of weight ``W_ij`` is
``S_ij = |W_ij| * ||X_j||_2``, the L2 norm of input channel ``j`` over all calibration
tokens; weights are compared **per output** (each row ``i`` of ``W`` prunes its own
lowest scores), and for N:M each group of ``M`` consecutive weights of a row keeps
its ``N`` highest scores.

:func:`reference_wanda` computes the norms directly from the calibration inputs ``x``
(plain loops, ``math.fsum``), not from the library's accumulators, and shares no code
with the library. Its count rule: a row of ``n`` weights prunes ``round(p * n)``
(nearest integer, halves up, exactly from ``p``'s decimal text) — the library's
documented rule too. The authors' code truncates instead (``int(n * p)``); the two
differ only when ``p * n`` has a fractional part ``>= 1/2``. N:M: ``N`` kept of ``M``,
as the library.

The library's scores are float32; masks are compared exactly on cases whose every
selection is decided by a relative score gap ``> MIN_GAP`` (asserted).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from llmc_fsm_pruning import InputNormAccumulator, WandaPruningModifier, magnitude_mask, wanda_mask
from torch import nn

from llmc_fsm import Session
from llmc_fsm.toolkit.obs import HessianAccumulator

#: Smallest relative score gap at a selection boundary for an exact mask comparison.
MIN_GAP = 1e-5


# --------------------------------------------------------------------------- reference
def round_half_up(p: float, n: int) -> int:
    """Nearest integer to ``p * n``, halves up, exactly (``Fraction('0.35') * 30 == 10.5 -> 11``)."""
    return math.floor(Fraction(repr(p)) * n + Fraction(1, 2))


def reference_wanda(
    weight: list[list[float]], x: list[list[float]], *, sparsity: float, nm: tuple[int, int] | None = None
) -> tuple[np.ndarray, float]:
    """Wanda's keep mask from the weight and the raw calibration inputs; and the smallest selection gap.

    ``weight`` is ``[rows][cols]``, ``x`` is ``[tokens][cols]``. The gap is the smallest
    ``(s_hi - s_lo) / s_hi`` between the highest pruned and the lowest kept score of any
    selection (inf when nothing is contested).
    """
    rows, cols = len(weight), len(weight[0])
    norm = [math.sqrt(math.fsum(token[j] ** 2 for token in x)) for j in range(cols)]
    keep = np.ones((rows, cols), dtype=bool)
    gap = math.inf
    groups = [range(cols)] if nm is None else [range(g, g + nm[1]) for g in range(0, cols, nm[1])]
    for r in range(rows):
        for group in groups:
            ranked = sorted((abs(weight[r][c]) * norm[c], c) for c in group)
            k = round_half_up(sparsity, len(ranked)) if nm is None else nm[1] - nm[0]
            for _, c in ranked[:k]:
                keep[r, c] = False
            if 0 < k < len(ranked) and ranked[k][0] > 0:
                gap = min(gap, (ranked[k][0] - ranked[k - 1][0]) / ranked[k][0])
    return keep, gap


# --------------------------------------------------------------------------- helpers
def inputs(tokens: int, cols: int, seed: int) -> np.ndarray:
    """Correlated channels whose scales span ~2 orders of magnitude (float32 values, float64 array)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, cols)) @ (rng.standard_normal((cols, cols)) / math.sqrt(cols))
    x *= np.exp(rng.standard_normal(cols))
    return x.astype(np.float32).astype(np.float64)


def weight(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed + 7).standard_normal((rows, cols)).astype(np.float32).astype(np.float64)


def sq_norm_from(x: np.ndarray) -> torch.Tensor:
    """``||X_j||^2`` straight from the inputs (float64), the library's ``input_sq_norm`` argument."""
    return torch.from_numpy((x**2).sum(axis=0))


def lib_mask(w: np.ndarray, sq: torch.Tensor, p: float, nm: tuple[int, int] | None) -> np.ndarray:
    structure = "unstructured" if nm is None else f"{nm[0]}:{nm[1]}"
    keep = wanda_mask(torch.from_numpy(w).float(), sq, p, structure)
    assert keep.dtype == torch.bool
    return keep.numpy()


# --------------------------------------------------------------------------- hand-computed cases
def test_hand_computed_unstructured_per_row():
    # Channel norms: ||X_0|| = 8, ||X_1|| = 2, ||X_2|| = 1, ||X_3|| = 0.5.
    x = [[8.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.5]]
    w = [
        [1.0, -2.0, 3.0, -4.0],  # scores 8, 4, 3, 2
        [0.01, -0.3, 0.5, 0.1],  # scores 0.08, 0.6, 0.5, 0.05
    ]
    expected = [[True, True, False, False], [False, True, True, False]]
    keep, _ = reference_wanda(w, x, sparsity=0.5)
    assert keep.tolist() == expected
    assert lib_mask(np.array(w), sq_norm_from(np.array(x)), 0.5, None).tolist() == expected
    # Not what magnitude keeps (it ignores the inputs) ...
    assert magnitude_mask(torch.tensor(w), 0.5).tolist() != expected
    # ... nor what a selection over the whole matrix would keep (row 0 whole, row 1 nothing).
    scores = [8, 4, 3, 2, 0.08, 0.6, 0.5, 0.05]
    whole = [s > sorted(scores)[3] for s in scores]
    assert whole == [True, True, True, True, False, False, False, False]


def test_hand_computed_two_four_and_four_eight():
    x = [[8.0, 2.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0]]  # one token: norms are |x|
    w = [[1.0, -2.0, 3.0, -4.0, 5.0, 0.5, -0.25, 2.1]]  # scores 8, 4, 3, 2 | 5, 0.5, 0.25, 2.1
    two_four = [[True, True, False, False, True, False, False, True]]
    four_eight = [[True, True, True, False, True, False, False, False]]  # top 4 of the row: 8, 5, 4, 3
    assert reference_wanda(w, x, sparsity=0.0, nm=(2, 4))[0].tolist() == two_four
    assert reference_wanda(w, x, sparsity=0.0, nm=(4, 8))[0].tolist() == four_eight
    sq = sq_norm_from(np.array(x))
    assert lib_mask(np.array(w), sq, 0.5, (2, 4)).tolist() == two_four
    assert lib_mask(np.array(w), sq, 0.5, (4, 8)).tolist() == four_eight


def test_hand_computed_rounding_of_the_row_count():
    # 3 weights at 50%: 1.5 -> 2 pruned (halves up); the authors' int(1.5) would prune 1.
    x = [[1.0, 1.0, 1.0]]
    w = [[3.0, 1.0, 2.0]]
    assert reference_wanda(w, x, sparsity=0.5)[0].tolist() == [[True, False, False]]
    assert lib_mask(np.array(w), sq_norm_from(np.array(x)), 0.5, None).tolist() == [[True, False, False]]


# --------------------------------------------------------------------------- random cases
CASES = [
    # rows, cols, tokens, sparsity, N:M
    (20, 30, 200, 0.5, None),
    (7, 41, 64, 0.25, None),
    (16, 64, 256, 0.7, None),
    (5, 30, 50, 0.35, None),  # 10.5 per row -> 11
    (9, 30, 90, 0.33, None),  # 9.9 per row -> 10
    (12, 64, 128, 0.0, (2, 4)),
    (6, 96, 300, 0.0, (4, 8)),
    (10, 32, 40, 0.0, (1, 4)),
]


@pytest.mark.parametrize("rows, cols, tokens, p, nm", CASES)
def test_library_mask_equals_reference(rows, cols, tokens, p, nm):
    seed = rows * 100 + cols
    x, w = inputs(tokens, cols, seed), weight(rows, cols, seed)
    expected, gap = reference_wanda(w.tolist(), x.tolist(), sparsity=p, nm=nm)
    assert gap > MIN_GAP, f"ill-conditioned case (gap {gap:.2g})"
    keep = lib_mask(w, sq_norm_from(x), p if nm is None else 0.5, nm)
    assert np.array_equal(keep, expected), f"{int((keep != expected).sum())} mask entries differ"
    if nm is None:  # every row prunes exactly round(p * cols)
        assert ((~keep).sum(axis=1) == round_half_up(p, cols)).all()
    # the mask really depends on the inputs: magnitude alone keeps other weights
    assert not np.array_equal(magnitude_mask(torch.from_numpy(w), p, None if nm is None else nm).numpy(), expected)


@pytest.mark.parametrize("nm", [None, (2, 4)])
def test_library_accumulators_give_the_reference_mask(nm):
    """The library's statistics paths (batched, 3-D inputs) lead to the same mask as the raw inputs."""
    rows, cols = 24, 48
    x, w = inputs(300, cols, 5), weight(rows, cols, 5)
    expected, gap = reference_wanda(w.tolist(), x.tolist(), sparsity=0.5, nm=nm)
    assert gap > MIN_GAP
    norms, hess = InputNormAccumulator(cols), HessianAccumulator(cols)
    xt = torch.from_numpy(x).float()
    for chunk in (xt[:7], xt[7:107].reshape(4, 25, cols), xt[107:]):
        norms.add_batch(chunk)
        hess.add_batch(chunk)
    assert norms.num_samples == hess.num_samples == 300
    for sq in (norms.sq_norm, hess.input_sq_norm):
        assert np.array_equal(lib_mask(w, sq, 0.5, nm), expected)


class _TwoLinears(nn.Module):
    def __init__(self, cols: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(cols, cols), nn.Linear(cols, 16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.relu(self.layers[0](x)))


@pytest.mark.parametrize("structure", ["unstructured", "4:8"])
def test_modifier_keeps_exactly_the_reference_survivors(structure):
    """WandaPruningModifier: each weight is W * reference mask, the mask computed from the inputs it saw."""
    cols = 32
    torch.manual_seed(0)
    model = _TwoLinears(cols).eval()
    dense = [m.weight.detach().double().numpy().copy() for m in model.layers]
    x = torch.from_numpy(inputs(3 * 40, cols, 11)).float().reshape(3, 40, cols)
    with torch.no_grad():  # what each Linear sees in a plain forward of the dense model
        seen = [x.reshape(-1, cols).double().numpy(), torch.relu(model.layers[0](x)).reshape(-1, cols).double().numpy()]
    session = Session({"s": {"WandaPruningModifier": {"sparsity": 0.5, "mask_structure": structure}}})
    session.initialize(model=model, calibration_data=x)
    session.calibration_start()
    with torch.no_grad():
        for batch in x:
            model(batch)
    session.calibration_end()
    session.finalize()
    assert isinstance(session.modifiers[0], WandaPruningModifier)
    nm = None if structure == "unstructured" else (4, 8)
    for layer, w, xs in zip(model.layers, dense, seen, strict=True):
        keep, gap = reference_wanda(w.tolist(), xs.tolist(), sparsity=0.5, nm=nm)
        assert gap > MIN_GAP
        assert np.array_equal(layer.weight.detach().double().numpy(), w * keep)
