"""AWQ duo_scaling's weight term w_j with FP8 block and NVFP4 (tensor_group) weights, against a hand computation."""

from __future__ import annotations

import copy
import math

import torch
from llmc_fsm_quantization import AWQModifier, QuantizationModifier
from llmc_fsm_quantization.awq import _group_size, awq_candidate_scales, awq_weight_mean
from test_smoothquant import DATA, tiny

import llmc_fsm


def _hand_mean(weights: list[torch.Tensor], group_of) -> list[float]:
    """Per column j: the mean over every weight's rows of |W_ij| / (max |W| over group_of(i, j) + 1e-6), the
    quotient in the weight's dtype, the rows summed exactly (math.fsum) and rounded once."""
    cols = weights[0].shape[1]
    sums: list[list[float]] = [[] for _ in range(cols)]
    rows = 0
    for w in weights:
        a = w.abs()
        for i in range(a.shape[0]):
            for j in range(cols):
                peak = max(float(a[r, c]) for r, c in group_of(i, j, a.shape))
                quotient = a[i, j] / (torch.tensor(peak, dtype=a.dtype) + 1e-6)
                sums[j].append(float(quotient))
            rows += 1
    return [math.fsum(column) / rows for column in sums]


def _block(h: int, w: int):
    def group_of(i: int, j: int, shape) -> list[tuple[int, int]]:
        r0, c0 = i // h * h, j // w * w
        return [(r, c) for r in range(r0, min(r0 + h, shape[0])) for c in range(c0, min(c0 + w, shape[1]))]

    return group_of


def _runs_of(g: int):
    def group_of(i: int, j: int, shape) -> list[tuple[int, int]]:
        start = (i * shape[1] + j) // g * g
        return [divmod(k, shape[1]) for k in range(start, start + g)]

    return group_of


def test_awq_weight_mean_normalises_each_value_by_its_blocks_max_partial_edge_blocks_their_own() -> None:
    """Found by a tester: with FP8_BLOCK weights w_j divided each value by its row's max, where llm-compressor
    0.14 divides by its 128 x 128 block's (w_j up to 51% off, layer 0's codes differed). A block cut by the bottom
    or right edge is its own group, as the quantizer's block scales (llm-compressor raises there)."""
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(5, 7, generator=g), torch.randn(3, 7, generator=g) * 1e-2]
    got = awq_weight_mean(weights, [(2, 3), (2, 3)])
    assert got.dtype == torch.float64
    assert got.tolist() == _hand_mean(weights, _block(2, 3))
    half = [w.to(torch.bfloat16) for w in weights]  # the quotient in the weight's dtype
    assert awq_weight_mean(half, [(4, 4), (4, 4)]).tolist() == _hand_mean(half, _block(4, 4))


def test_awq_weight_mean_of_nvfp4_weights_normalises_by_each_group_of_16() -> None:
    """Found by a tester: with NVFP4 (tensor_group) weights w_j divided each value by its row's max, where
    llm-compressor 0.14 divides by its group of 16's (w_j up to 31% off)."""
    g = torch.Generator().manual_seed(4)
    weights = [torch.randn(3, 32, generator=g), torch.randn(2, 32, generator=g)]
    awq = AWQModifier()
    nvfp4 = QuantizationModifier(scheme="NVFP4")
    sizes = [_group_size((nvfp4.weight_args, "minmax"))] * 2
    assert sizes == [16, 16]
    assert awq.duo_scaling is True
    assert awq_weight_mean(weights, sizes).tolist() == _hand_mean(weights, _runs_of(16))


def test_awq_with_fp8_block_weights_takes_w_j_per_block_in_its_chosen_scales() -> None:
    """Found by a tester: an AWQ + FP8_BLOCK run searched duo_scaling candidates whose w_j was normalised per row,
    so layer 0's chosen scales and codes differed from llm-compressor 0.14's (equal once w_j is per block).

    Reference: layer 0's q/k/v scales rebuilt from the float model's layer-0 input (x_j) and a hand w_j over
    16 x 24 blocks (64 columns: the last block of each row is cut to 16), at the exponent the run chose."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [16, 24]}
    scheme = {"weights": weights}  # FP8_BLOCK's weights, without its input activations' groups of 128
    model = tiny()
    original = copy.deepcopy(model)
    awq = AWQModifier()
    llmc_fsm.oneshot(model=model, recipe=[awq, QuantizationModifier(scheme=scheme)], dataset=DATA, progress=False)
    name = "model.layers.0.input_layernorm"
    result = awq.smoothing_results[name]
    assert result["duo_scaling"] is True
    attn = original.model.layers[0].self_attn
    captured = {}
    handle = attn.register_forward_pre_hook(lambda m, a, k: captured.update(k=k), with_kwargs=True)
    with torch.no_grad():
        original(DATA, use_cache=False)
    handle.remove()
    x = captured["k"]["hidden_states"].reshape(-1, 64)
    x_mean = (x.abs().sum(dim=0, dtype=torch.float64) / x.shape[0]).float()
    weights = [getattr(attn, n).weight.detach() for n in ("q_proj", "k_proj", "v_proj")]
    w_mean = torch.tensor(_hand_mean(weights, _block(16, 24)), dtype=torch.float64)
    expected = awq_candidate_scales(x_mean, w_mean, result["exponent"])
    assert awq.smoothing_scales[name].tolist() == expected.tolist()


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4,
                        num_experts_per_tok=2, tie_word_embeddings=False)
    return MixtralForCausalLM(cfg).eval()


def _w4(**kw):
    return QuantizationModifier(scheme={"preset": "W4A16", "weights": {"group_size": 16}},
                                ignore=["lm_head", "re:.*mlp.gate$"], **kw)


_ROUTED_LINE = (
    "AWQModifier: the scales of 8 expert mappings (e.g. model.layers.0.mlp.experts.0.up_proj) are searched on the "
    "tokens the router sent each expert; llm-compressor 0.14 gives every expert every calibration token by default "
    "(moe_calibrate_all_experts=True), so these scales differ from its: set calibrate_all_experts: true on the "
    "AWQModifier (or on the stage's quantizing modifier) to calibrate as it does"
)


def _expert_tokens(awq):
    return [awq.smoothing_results[f"model.layers.{i}.mlp.experts.{e}.up_proj"]["tokens"] for i in (0, 1)
            for e in range(4)]


def test_awq_on_fused_experts_says_each_experts_scales_come_from_its_routed_tokens_unlike_llm_compressor(
    caplog,
) -> None:
    """Found by a tester: AWQ searched each expert's up -> down scale on its routed tokens only (143, 115, ... of
    256), where llm-compressor 0.14 gives every expert every token by default, and nothing said so."""
    awq = AWQModifier()
    with caplog.at_level("WARNING", logger="llmc_fsm_quantization.awq"):
        llmc_fsm.oneshot(model=_mixtral(), recipe=[awq, _w4()], dataset=DATA, progress=False)
    assert [r.getMessage() for r in caplog.records if r.name == "llmc_fsm_quantization.awq"] == [_ROUTED_LINE]
    tokens = _expert_tokens(awq)
    assert sum(tokens[:4]) == sum(tokens[4:]) == 2 * 256  # each of the 256 tokens reached its top 2 experts only


def test_awq_calibrate_all_experts_gives_every_expert_every_token_and_follows_the_quantizers_setting(caplog) -> None:
    """``calibrate_all_experts: true`` on the QuantizationModifier (docs/oneshot.md's advice for llm-compressor's
    ``moe_calibrate_all_experts``) did not reach AWQ, which had no such argument (found by a tester); now AWQ takes
    the quantizer's value when it gives none, its own otherwise, and every expert's statistics, search and clipping
    see all 256 tokens; the model's output still follows the router."""
    inherited, own, refused = AWQModifier(), AWQModifier(calibrate_all_experts=True, apply_clip=True), AWQModifier(
        calibrate_all_experts=False)
    with caplog.at_level("WARNING", logger="llmc_fsm_quantization.awq"):
        llmc_fsm.oneshot(model=_mixtral(), recipe=[inherited, _w4(calibrate_all_experts=True)], dataset=DATA,
                         progress=False)
        llmc_fsm.oneshot(model=_mixtral(), recipe=[own, _w4()], dataset=DATA, progress=False)
    assert [r.getMessage() for r in caplog.records if r.name == "llmc_fsm_quantization.awq"] == []
    assert _expert_tokens(inherited) == _expert_tokens(own) == [256] * 8
    assert {r["tokens"] for n, r in own.clipping_results.items() if ".experts." in n} == {256}
    caplog.clear()
    with caplog.at_level("WARNING", logger="llmc_fsm_quantization.awq"):
        llmc_fsm.oneshot(model=_mixtral(), recipe=[refused, _w4(calibrate_all_experts=True)], dataset=DATA,
                         progress=False)
    assert [r.getMessage() for r in caplog.records if r.name == "llmc_fsm_quantization.awq"] == [_ROUTED_LINE]
    assert sum(_expert_tokens(refused)[:4]) == 2 * 256
