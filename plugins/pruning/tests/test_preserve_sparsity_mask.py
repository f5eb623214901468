"""SparseGPT's ``preserve_sparsity_mask``: pruning an already sparse weight further keeps every existing zero.

The reference, :func:`reference_preserving`, is SparseGPT's Algorithm 1 (Frantar & Alistarh, arXiv 2301.00774)
in numpy float64 with plain loops, with the existing zeros put in the mask from the start, written here from the
specification in ``llmc_fsm_pruning.sparsegpt``'s module docstring (it shares no code with the library):

* unstructured: after block ``[c0, c1)`` the weight has ``min(round(p * out * c1), total - E_later)`` weights
  pruned (``total = round(p * numel)``, ``E_later``: existing zeros right of the block, rounding halves up), and
  never fewer than before plus the block's existing zeros; the block's existing zeros are pruned and the lowest
  saliencies ``w^2 / U_cc^2`` among its other weights fill the rest;
* N:M: per row and group of ``M`` columns, the existing zeros, then the lowest saliencies among the others up to
  ``M - N`` pruned in all.

Every pruned weight (existing zeros included) has its error ``w / U_jj`` compensated on the later columns.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from llmc_fsm_pruning import SparseGPTModifier, sparsegpt_prune, sparsegpt_prune_shared
from torch import nn

import llmc_fsm
from llmc_fsm import Session
from llmc_fsm.pipeline.sequential import run_sequential
from llmc_fsm.recipes.building import resolve_recipe

#: Smallest relative saliency gap at a contested selection for an exact mask comparison (float32 vs float64).
MIN_GAP = 1e-4
#: Largest weight difference between the float32 library and the float64 reference, relative to max |W|.
WEIGHT_TOL = 1e-5


def round_half_up(p: float, n: int) -> int:
    """Nearest integer to ``p * n``, halves up, computed exactly from ``p``'s decimal text."""
    return math.floor(Fraction(repr(p)) * n + Fraction(1, 2))


def reference_preserving(
    weight: np.ndarray, hessian: np.ndarray, *, sparsity: float, nm: tuple[int, int] | None, block: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """``(pruned weight, keep mask, smallest relative saliency gap of a contested selection)`` in float64."""
    W = np.array(weight, dtype=np.float64)
    H = np.array(hessian, dtype=np.float64)
    rows, cols = W.shape
    assert all(H[j, j] > 0 for j in range(cols)), "the cases here have no dead inputs"
    existing = W == 0.0
    H = H + 0.01 * np.trace(H) / cols * np.eye(cols)
    U = np.linalg.cholesky(np.linalg.inv(H)).T  # upper: inv(H) = U^T U
    pruned = existing.copy()
    total = round_half_up(sparsity, rows * cols)
    done = 0
    gap = math.inf

    def note_gap(ranked: list, k: int) -> None:
        nonlocal gap
        if 0 < k < len(ranked) and ranked[k][0] > 0:
            gap = min(gap, (ranked[k][0] - ranked[k - 1][0]) / ranked[k][0])

    for i in range(0, cols, block):
        end = min(i + block, cols)
        E = np.zeros((rows, end - i))
        if nm is None:
            in_block = int(existing[:, i:end].sum())
            later = int(existing[:, end:].sum())
            goal = min(round_half_up(sparsity, rows * end), total - later)
            extra = max(0, goal - done - in_block)
            ranked = sorted(
                (W[r, c] ** 2 / U[c, c] ** 2, c, r) for c in range(i, end) for r in range(rows) if not existing[r, c]
            )
            for _, c, r in ranked[:extra]:
                pruned[r, c] = True
            note_gap(ranked, extra)
            done += in_block + extra
        for j in range(i, end):
            if nm is not None and j % nm[1] == 0:
                n, m = nm
                for r in range(rows):
                    free = [c for c in range(j, j + m) if not existing[r, c]]
                    need = max(0, (m - n) - (m - len(free)))
                    ranked = sorted((W[r, c] ** 2 / U[c, c] ** 2, c) for c in free)
                    for _, c in ranked[:need]:
                        pruned[r, c] = True
                    note_gap(ranked, need)
            for r in range(rows):
                E[r, j - i] = W[r, j] / U[j, j] if pruned[r, j] else 0.0
            for c in range(j, end):
                W[:, c] -= E[:, j - i] * U[j, c]
        W[:, end:] -= E @ U[i:end, end:]
    W[pruned] = 0.0
    return W, ~pruned, gap


def calibration(n_tokens: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tokens, cols)) @ (rng.standard_normal((cols, cols)) / math.sqrt(cols))
    return (x + 0.3 * rng.standard_normal((n_tokens, cols))) * np.exp(0.5 * rng.standard_normal(cols))


def sparse_weight(rows: int, cols: int, seed: int, zeros: np.ndarray | float) -> np.ndarray:
    """A float32-representable weight with exact zeros where ``zeros`` (a mask, or a fraction drawn at random)."""
    rng = np.random.default_rng(seed + 1000)
    w = rng.standard_normal((rows, cols)).astype(np.float32).astype(np.float64)
    mask = rng.random((rows, cols)) < zeros if isinstance(zeros, float) else zeros
    w[mask] = 0.0
    return w


def library(w: np.ndarray, h: np.ndarray, **kw) -> tuple[np.ndarray, np.ndarray]:
    out, keep = sparsegpt_prune(torch.from_numpy(w).float(), torch.from_numpy(h), **kw)
    return out.double().numpy(), keep.numpy()


def _first_block_dense_zeros(rows: int, cols: int) -> np.ndarray:
    mask = np.zeros((rows, cols), dtype=bool)
    mask[:, :16] = np.random.default_rng(5).random((rows, 16)) < 0.9  # more than the block's share of 50%
    return mask


def _last_block_all_zero(rows: int, cols: int) -> np.ndarray:
    mask = np.zeros((rows, cols), dtype=bool)
    mask[:, cols - 16 :] = True  # the earlier blocks must leave room for these
    return mask


CASES = [
    # id, rows, cols, sparsity, N:M, block, existing zeros
    ("random-20pct-to-50pct", 12, 64, 0.5, None, 16, 0.2),
    ("first-block-90pct-zero", 12, 64, 0.5, None, 16, _first_block_dense_zeros(12, 64)),
    ("last-block-all-zero", 12, 64, 0.5, None, 16, _last_block_all_zero(12, 64)),
    ("partial-block-to-70pct", 9, 40, 0.7, None, 16, 0.3),
    ("2of4-over-30pct", 10, 64, 0.5, (2, 4), 16, 0.3),
    ("4of8-over-25pct", 8, 64, 0.5, (4, 8), 32, 0.25),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_library_equals_the_float64_reference_and_keeps_every_existing_zero(case) -> None:
    _, rows, cols, p, nm, block, zeros = case
    seed = rows * 100 + cols
    x = calibration(4 * cols, cols, seed)
    h = 2.0 / x.shape[0] * x.T @ x
    w = sparse_weight(rows, cols, seed, zeros)
    existing = w == 0.0
    ref, ref_keep, gap = reference_preserving(w, h, sparsity=p, nm=nm, block=block)
    assert gap > MIN_GAP, f"ill-conditioned case (gap {gap:.2g}): choose another seed"
    structure = "unstructured" if nm is None else f"{nm[0]}:{nm[1]}"
    out, keep = library(w, h, sparsity=p, mask_structure=structure, block_size=block, preserve_sparsity_mask=True)
    np.testing.assert_array_equal(keep, ref_keep)
    assert np.abs(out - ref).max() <= WEIGHT_TOL * np.abs(ref).max()
    assert (out[existing] == 0.0).all() and not keep[existing].any()
    assert ((out == 0.0) == ~keep).all()  # no kept weight is exactly zero on these cases
    if nm is None:
        assert int((out == 0.0).sum()) == round_half_up(p, rows * cols)
    else:
        n, m = nm
        groups = existing.reshape(rows, cols // m, m).sum(axis=2)
        zeros_per_group = (out == 0.0).reshape(rows, cols // m, m).sum(axis=2)
        np.testing.assert_array_equal(zeros_per_group, np.maximum(groups, m - n))
        assert (groups > m - n).any() and (groups < m - n).any()  # both sides of max() are exercised


def test_without_the_flag_an_existing_zero_can_come_back_and_with_it_it_cannot() -> None:
    # Inputs 0 and 1 are nearly the same feature; block_size 1 with 50% of 4 weights prunes 1, 0, 1, 0 weights in
    # the four blocks (cumulative counts 1, 1, 2, 2). Column 0 is pruned by the count and its error moves onto
    # column 1, which was zero: afresh, block 1 prunes nothing and keeps that compensation.
    h = torch.tensor([[1.0, 0.99, 0.0, 0.0], [0.99, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    w = torch.tensor([[1.0, 0.0, 2.0, 3.0]])
    fresh, fresh_keep = sparsegpt_prune(w, h, sparsity=0.5, block_size=1)
    assert fresh[0, 1].abs() > 0.5 and fresh_keep.tolist() == [[False, True, False, True]]
    kept, kept_keep = sparsegpt_prune(w, h, sparsity=0.5, block_size=1, preserve_sparsity_mask=True)
    assert kept_keep.tolist() == [[False, False, True, True]]
    torch.testing.assert_close(kept, torch.tensor([[0.0, 0.0, 2.0, 3.0]]), rtol=0, atol=1e-6)


def test_without_existing_zeros_the_flag_changes_nothing() -> None:
    x = calibration(256, 64, 2)
    h = torch.from_numpy(2.0 / x.shape[0] * x.T @ x)
    w = torch.from_numpy(sparse_weight(12, 64, 2, 0.0)).float()
    for structure in ("unstructured", "2:4"):
        a, ka = sparsegpt_prune(w, h, sparsity=0.5, mask_structure=structure, block_size=16)
        b, kb = sparsegpt_prune(
            w, h, sparsity=0.5, mask_structure=structure, block_size=16, preserve_sparsity_mask=True
        )
        assert torch.equal(a, b) and torch.equal(ka, kb)


def test_2_4_then_75_percent_keeps_every_2_4_zero_and_has_exactly_the_count() -> None:
    x = calibration(320, 64, 3)
    h = torch.from_numpy(2.0 / x.shape[0] * x.T @ x)
    w = torch.from_numpy(sparse_weight(16, 64, 3, 0.0)).float()
    two_four, _ = sparsegpt_prune(w, h, sparsity=0.5, mask_structure="2:4", block_size=16)
    assert int((two_four == 0).sum()) == 16 * 64 // 2
    further, keep = sparsegpt_prune(two_four, h, sparsity=0.75, block_size=16, preserve_sparsity_mask=True)
    assert bool((further[two_four == 0] == 0).all())
    assert int((further == 0).sum()) == 768 and int((~keep).sum()) == 768


def test_shared_weights_each_keep_their_own_zeros_and_counts() -> None:
    x = calibration(256, 48, 4)
    h = torch.from_numpy(2.0 / x.shape[0] * x.T @ x)
    a = torch.from_numpy(sparse_weight(8, 48, 4, 0.1)).float()
    b = torch.from_numpy(sparse_weight(20, 48, 5, 0.4)).float()
    together = sparsegpt_prune_shared([a, b], h, sparsity=0.5, block_size=16, preserve_sparsity_mask=True)
    for w, (out, keep) in zip((a, b), together, strict=True):
        alone, alone_keep = sparsegpt_prune(w, h, sparsity=0.5, block_size=16, preserve_sparsity_mask=True)
        assert torch.equal(keep, alone_keep)
        torch.testing.assert_close(out, alone, rtol=0, atol=1e-5)
        assert bool((out[w == 0] == 0).all()) and int((out == 0).sum()) == round_half_up(0.5, w.numel())


def test_a_weight_sparser_than_the_target_is_refused() -> None:
    w = torch.ones(4, 8)
    w[:, :5] = 0  # 20 zeros; 40% prunes 13
    with pytest.raises(ValueError) as info:
        sparsegpt_prune(w, torch.eye(8), sparsity=0.4, block_size=8, preserve_sparsity_mask=True)
    assert str(info.value) == (
        "preserve_sparsity_mask: the weight [4, 8] already has 20 zeros, more than the 13 that sparsity 0.4 prunes, "
        "and every existing zero stays pruned; give a higher sparsity (the weight's is 0.625) or "
        "preserve_sparsity_mask: false (the mask is then chosen afresh)"
    )
    with pytest.raises(ValueError, match=r"^preserve_sparsity_mask: weight 1 \[4, 8\] already has 20 zeros"):
        sparsegpt_prune_shared([torch.ones(4, 8), w], torch.eye(8), sparsity=0.4, preserve_sparsity_mask=True)
    # N:M keeps them all whatever their number (a group ends with max(M - N, existing) zeros); with H = I there is
    # no compensation, so the second group prunes its zero and its smallest other weight (0.5)
    w[:, 5:] = torch.tensor([0.5, 2.0, 3.0])
    out, _ = sparsegpt_prune(w, torch.eye(8), sparsity=0.0, mask_structure="2:4", block_size=8,
                             preserve_sparsity_mask=True)
    assert torch.equal(out, torch.tensor([[0.0] * 6 + [2.0, 3.0]] * 4))
    with pytest.raises(ValueError, match=r"^preserve_sparsity_mask must be true or false, got 1$"):
        sparsegpt_prune(w, torch.eye(8), sparsity=0.7, preserve_sparsity_mask=1)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, 2 * width)
        self.b = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class _Toy(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


DATA = torch.randint(0, 32, (6, 12), generator=torch.Generator().manual_seed(0))


def _run(model: nn.Module, modifier: SparseGPTModifier) -> SparseGPTModifier:
    session = Session([modifier])
    session.initialize(model=model, calibration_data=DATA)
    run_sequential(session, batch_size=3, progress=False)
    session.finalize()
    return modifier


def _linears(model: _Toy) -> dict[str, nn.Linear]:
    return {f"layers.{i}.{n}": getattr(layer, n) for i, layer in enumerate(model.layers) for n in ("a", "b")}


def test_the_modifier_prunes_a_2_4_model_to_75_percent_keeping_its_zeros() -> None:
    torch.manual_seed(0)
    model = _Toy().eval()
    _run(model, SparseGPTModifier(mask_structure="2:4", ignore=["head"], block_size=16))
    before = {name: lin.weight.detach().clone() for name, lin in _linears(model).items()}
    modifier = _run(model, SparseGPTModifier(sparsity=0.75, ignore=["head"], block_size=16,
                                             preserve_sparsity_mask=True))
    for name, lin in _linears(model).items():
        assert bool((lin.weight[before[name] == 0] == 0).all()), name
        assert int((lin.weight == 0).sum()) == lin.weight.numel() * 3 // 4, name
        assert modifier.results[name].sparsity == 0.75


def test_the_modifier_refuses_targets_sparser_than_its_sparsity_before_calibration() -> None:
    torch.manual_seed(0)
    model = _Toy().eval()
    with torch.no_grad():
        model.layers[0].a.weight[:, :10] = 0  # 320 of 512 zeros
        model.layers[1].b.weight[:12] = 0  # 384 of 512
    modifier = SparseGPTModifier(sparsity=0.5, ignore=["head"], preserve_sparsity_mask=True)
    with pytest.raises(ValueError) as info:
        modifier.check_model(model)
    assert str(info.value) == (
        "SparseGPTModifier cannot compress 2 of its 4 targets — already more zeros than sparsity 0.5 prunes, and "
        "preserve_sparsity_mask keeps every existing zero pruned (give a higher sparsity, or preserve_sparsity_mask: "
        "false to choose the mask afresh): layers.0.a, layers.1.b. Narrow targets or add these modules to ignore."
    )
    SparseGPTModifier(sparsity=0.5, ignore=["head"]).check_model(model)  # without the flag: nothing to refuse
    SparseGPTModifier(mask_structure="2:4", ignore=["head"], preserve_sparsity_mask=True).check_model(model)
    with pytest.raises(ValueError, match=r"^preserve_sparsity_mask must be true or false, got 'yes'$"):
        SparseGPTModifier(preserve_sparsity_mask="yes")


def test_llm_compressors_recipe_argument_is_read() -> None:
    recipe = resolve_recipe(
        "sparsity_stage:\n  run_type: oneshot\n  sparsity_modifiers:\n    SparseGPTModifier:\n"
        "      sparsity: 0.75\n      preserve_sparsity_mask: true\n      mask_structure: '0:0'\n"
    )
    (modifier,) = recipe.modifiers
    assert isinstance(modifier, SparseGPTModifier) and modifier.preserve_sparsity_mask is True
    assert "preserve_sparsity_mask: true" in recipe.to_yaml(applied=True)


def test_a_later_stage_keeping_a_sparser_mask_is_refused_before_the_first_stage_runs() -> None:
    """Stage 1 prunes to 0.7, stage 2 keeps every zero with preserve_sparsity_mask at 0.5: it cannot reach 0.5, and
    was refused only after stage 1 had pruned the model (as llm-compressor fails; a tester's case). Refused before
    any work now; at an equal or higher sparsity it runs."""
    def recipe(later: float) -> dict:
        first = {"SparseGPTModifier": {"sparsity": 0.7, "mask_structure": "0:0", "ignore": ["head"]}}
        second = {"SparseGPTModifier": {"sparsity": later, "mask_structure": "0:0", "ignore": ["head"],
                                        "preserve_sparsity_mask": True}}  # fmt: skip
        return {"sparsity_stage": {"sparsity_modifiers": first}, "more_stage": {"sparsity_modifiers": second}}

    torch.manual_seed(0)
    model = _Toy().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe(0.5), dataset=DATA, progress=False)
    assert str(info.value) == (
        "SparseGPTModifier of stage 'more_stage' keeps every zero with preserve_sparsity_mask, but SparseGPTModifier "
        "of stage 'sparsity_stage' prunes 4 of its targets to sparsity 0.7 before it, above its own 0.5 (e.g. "
        "layers.0.a): give it a sparsity of at least 0.7, or preserve_sparsity_mask: false"
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    two_four = recipe(0.3)  # an N:M first stage prunes its structure's fraction (missed at first: a tester's case)
    two_four["sparsity_stage"]["sparsity_modifiers"]["SparseGPTModifier"]["mask_structure"] = "2:4"
    with pytest.raises(ValueError, match=r"of stage 'sparsity_stage' prunes 4 of its targets to sparsity 0.5 before "
                                         r"it, above its own 0.3 \(e.g. layers.0.a\)"):
        llmc_fsm.oneshot(model=model, recipe=two_four, dataset=DATA, progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    llmc_fsm.oneshot(model=model, recipe=recipe(0.7), dataset=DATA, progress=False)
