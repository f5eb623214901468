"""Scales and zero points of bfloat16 / float16 weights are compressed-tensors' own, computed in the weight's dtype;
GPTQ compensates the error of the column as stored; actorder orders tied ``diag(H)`` as ``torch.argsort``'s default.

Found by a tester (session 38): on a bfloat16 Llama, int4 asymmetric group-32 round-to-nearest gave 1684 of 2304
``weight_scale`` values and 2254 of 2304 zero points equal to llm-compressor 0.14's. The range was handed to
``calculate_qparams`` in float32 and the scale rounded to bfloat16 once; compressed-tensors, handed the bfloat16 range
by llm-compressor, rounds ``hi - lo``, the division and the zero point each to bfloat16. GPTQ (fp16, asymmetric,
``actorder: static``) inherited it (74% of the weights equal). With ``actorder: static`` and tied ``diag(H)``
(duplicated inputs) a stable sort ordered the columns otherwise than llm-compressor's ``torch.argsort``.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams
from llmc_fsm_quantization.gptq import gptq_quantize
from llmc_fsm_quantization.observers import as_row_args, observe
from llmc_fsm_quantization.rtn import rtn_quantize


def _args(symmetric: bool, strategy: str, bits: int = 4) -> QuantizationArgs:
    extra = {"group_size": 32} if strategy == "group" else {}
    return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, **extra)


def _reference(weight: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' ``calculate_qparams`` of each row's / group's range taken in the weight's own dtype."""
    rows, cols = weight.shape
    groups = weight.reshape(-1, args.group_size) if args.group_size else weight
    lo, hi = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
    scale, zp = calculate_qparams(lo, hi, as_row_args(args))
    shape = (rows, cols // args.group_size) if args.group_size else (rows, 1)
    return scale.reshape(shape), zp.reshape(shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strategy", ["channel", "group"])
def test_observed_scale_and_zero_point_equal_calculate_qparams_of_the_range_in_the_weight_dtype(dtype, strategy):
    """Before: a float32 range, the scale rounded to the weight's dtype once; 12-31% of the asymmetric scales differed
    from compressed-tensors' (the symmetric ones and a float32 weight's were equal, and must stay so)."""
    for seed, (symmetric, bits) in enumerate([(False, 4), (False, 8), (True, 4), (True, 8)]):
        weight = (torch.randn(16, 96, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)
        args = _args(symmetric, strategy, bits)
        for w in (weight, weight.float()):
            scale, zp = observe(w, args, "minmax")
            ref_scale, ref_zp = _reference(w, args)
            assert scale.dtype == torch.float32
            assert torch.equal(scale, ref_scale.float()), (w.dtype, symmetric, bits)
            assert torch.equal(zp, ref_zp), (w.dtype, symmetric, bits)


def test_bfloat16_asymmetric_row_scale_rounds_the_difference_then_the_quotient():
    """Before: scale bf16(4.765625 / 15) = 0.318359375 and zero point round(-8 + 2.0625 / 0.3177) = -2.
    compressed-tensors (bfloat16): hi - lo = 4.765625 rounds to 4.75 (a tie, to even), 4.75 / 15 to 0.31640625,
    lo / scale = -6.5185 to -6.53125, so the zero point is round(-8 + 6.53125) = -1."""
    weight = torch.tensor([[-2.0625, 0.5, 2.703125, 0.0]], dtype=torch.bfloat16)
    args = _args(False, "channel")
    scale, zp = observe(weight, args, "minmax")
    assert scale.tolist() == [[0.31640625]]
    assert zp.tolist() == [[-1]]
    q = rtn_quantize(weight, args, "minmax")
    assert q.scale.tolist() == [[0.31640625]] and q.zero_point.tolist() == [[-1]]


def test_mse_observer_keeps_one_of_the_weight_dtype_candidates():
    """Before: the searched ranges ``p * [lo, hi]`` went to ``calculate_qparams`` in float32 and the kept scale was
    rounded to bfloat16 afterwards, with the zero point of the unrounded scale: no candidate of llm-compressor's
    search (the range scaled in bfloat16) had that pair for most rows."""
    weight = (torch.randn(16, 64, generator=torch.Generator().manual_seed(7)) * 0.05).to(torch.bfloat16)
    args = _args(False, "channel")
    scale, zp = observe(weight, args, "mse")
    lo, hi = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
    candidates = [calculate_qparams(lo * (1 - i / 100), hi * (1 - i / 100), args) for i in range(20)]
    for row in range(16):
        pairs = {(float(s[row]), int(z[row])) for s, z in candidates}
        assert (float(scale[row]), int(zp[row])) in pairs, row


def test_gptq_asymmetric_float16_group_scales_equal_calculate_qparams_of_the_weight():
    """Before: GPTQ took its scales from the float32 copy of the weight (rounded to float16 once): 74% of the weights
    of a float16 asymmetric int4 group-32 layer with actorder static were equal to llm-compressor's."""
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(16, 96, generator=g) * 0.05).to(torch.float16)
    x = torch.randn(256, 96, generator=g)
    hessian = 2.0 / 256 * x.T @ x
    args = _args(False, "group")
    (q,) = gptq_quantize([weight], hessian, args=args, block_size=32, actorder="static")
    ref_scale, ref_zp = _reference(weight, args)
    assert torch.equal(q.scale, ref_scale.float())
    assert torch.equal(q.zero_point, ref_zp)


def test_gptq_compensates_the_error_of_the_column_rounded_to_bfloat16():
    """Columns 0 and 1 coupled by ``H = [[1, .5], [.5, 1]]`` (damping 0): the paper's update gives column 1
    ``w1 + 0.5 (w0 - q0)``. Scale 1.0 / 7.5 in bfloat16 = 0.1337890625; ``q0 = -6 * scale = -0.802734375`` is stored
    as bfloat16 -0.8046875, as compressed-tensors' product in the scale's dtype gives it (llm-compressor compensates
    that). ``-0.5703125 + 0.5 (-0.8671875 + 0.8046875) = -0.6015625``, ``/ scale = -4.496``, so ``q1 = -4 * scale``
    (bfloat16 -0.53515625). Before: the unrounded q0 gave ``-0.6025390625 / scale = -4.504``, so ``q1 = -5 * scale``."""
    weight = torch.tensor([[-0.8671875, -0.5703125, 1.0]], dtype=torch.bfloat16)
    hessian = torch.eye(3)
    hessian[0, 1] = hessian[1, 0] = 0.5
    (q,) = gptq_quantize([weight], hessian, args=_args(True, "channel"), dampening_frac=0.0, actorder=None)
    assert q.scale.tolist() == [[0.1337890625]]
    assert q.weight.tolist() == [[-0.8046875, -0.53515625, 0.9375]]


def test_actorder_static_orders_tied_hessian_diagonal_as_torch_default_argsort():
    """Every input appears 4 times, so ``diag(H)`` ties in fours. llm-compressor 0.14 orders columns with
    ``torch.argsort(diag, descending=True)`` (not stable); before, a stable sort gave another order and ~85% of the
    weights equal. Reference: the natural-order sweep of the weight and Hessian permuted by the default argsort."""
    g = torch.Generator().manual_seed(99)
    weight = torch.randn(16, 96, generator=g) * 0.05
    x = torch.randn(256, 24, generator=g).repeat(1, 4)
    hessian = 2.0 / 256 * x.T @ x
    diag = torch.diagonal(hessian)
    perm = torch.argsort(diag, descending=True)
    assert not torch.equal(perm, torch.argsort(diag, descending=True, stable=True))  # the ties matter here
    args = _args(True, "channel", bits=8)
    (ordered,) = gptq_quantize([weight], hessian, args=args, block_size=32, actorder="static")
    (reference,) = gptq_quantize([weight[:, perm]], hessian[perm][:, perm], args=args, block_size=32, actorder=None)
    assert torch.equal(ordered.weight, reference.weight[:, torch.argsort(perm)])
