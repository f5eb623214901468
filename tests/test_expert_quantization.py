"""GPTQ and round-to-nearest per expert matrix of fused mixture-of-experts weights (issue 24).

Tiny random models from ``tiny_families`` (transformers 5 configs, offline). References are computed in the tests:
each expert's routed tokens from the inputs its experts module received during calibration (the router's own
top-k), its Hessian and a GPTQ sweep (arXiv 2210.17323, Alg. 1) in float64, round-to-nearest by hand; the saved
checkpoint is read with safetensors and its packed integers unpacked with compressed-tensors.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from safetensors import safe_open
from tiny_families import FAMILIES, build
from torch.nn import functional as F

import llmc_fsm
from llmc_fsm.toolkit import weight_views

DATA = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
#: the end of every refusal of a scheme on fused experts
FOR_VLLM = " (NVFP4, NVFP4A16 and FP8_BLOCK experts are written per expert for vLLM instead)"
#: 512 tokens: each expert of the tiny Mixtral gets more routed tokens than its widest input (128)
MORE = torch.randint(3, 128, (16, 32), generator=torch.Generator().manual_seed(0))
SCHEME = {"preset": "W4A16", "weights": {"group_size": 16}}
GROUP, Q_MIN, Q_MAX = 16, -8, 7


def _saved(directory) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``directory`` (all its shards), by key."""
    tensors = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open has no iterator)
    return tensors


def _experts_modules(model):
    return {n: m for n, m in model.named_modules() if weight_views(m) and "" not in weight_views(m)}


def _scales(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int4 scale per row and group of 16 columns, ``max |w| / 7.5`` (float32, as stored)."""
    return w.float().reshape(w.shape[0], -1, GROUP).abs().amax(-1) / 7.5


def _rtn(w: torch.Tensor) -> torch.Tensor:
    s = _scales(w).repeat_interleave(GROUP, dim=1)
    return torch.clamp(torch.round(w.float() / s), Q_MIN, Q_MAX) * s


def _gptq_reference(w: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01):
    """GPTQ in float64 with static activation order (columns swept by descending ``diag H``, groups of 16 kept in
    the original order, their scales from the original weight). Returns the weight and, per entry, ``w / scale``
    just before it was rounded."""
    cols = w.shape[1]
    scale = _scales(w).double()
    perm = torch.argsort(torch.diagonal(hessian), descending=True, stable=True)
    h = hessian[perm][:, perm]
    h = h + damp * torch.diagonal(h).mean() * torch.eye(cols, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    wp = w.double()[:, perm].clone()
    before = torch.empty_like(wp)
    for j in range(cols):
        s = scale[:, int(perm[j]) // GROUP]
        before[:, j] = wp[:, j] / s
        q = torch.clamp(torch.round(before[:, j]), Q_MIN, Q_MAX) * s
        err = (wp[:, j] - q) / u[j, j]
        wp[:, j] = q
        wp[:, j + 1 :] -= err[:, None] * u[j, j + 1 :][None, :]
    out, ratio = torch.empty_like(wp), torch.empty_like(wp)
    out[:, perm], ratio[:, perm] = wp, before
    return out, ratio, perm


def _assert_gptq_equal(got: torch.Tensor, w: torch.Tensor, hessian: torch.Tensor, name: str, share: int = 20) -> None:
    """``got`` is the float64 GPTQ of ``w``: equal integers, except that a row (at most 1 in ``share`` of them) may
    part from the reference from a column whose value before rounding was within 1e-4 of a rounding boundary (float32
    vs float64: e.g. a group's largest weight, at exactly +-7.5 scales before the error of earlier columns moves it)."""
    ref, ratio, perm = _gptq_reference(w, hessian)
    s = _scales(w).double().repeat_interleave(GROUP, dim=1)
    q_got, q_ref = torch.round(got.double() / s), torch.round(ref / s)
    assert torch.equal(got, q_got.float() * _scales(w).repeat_interleave(GROUP, dim=1)), name  # on the grid
    parted = 0
    for r in torch.nonzero((q_got != q_ref).any(dim=1)).flatten().tolist():
        first = next(int(c) for c in perm if q_got[r, c] != q_ref[r, c])
        assert abs(abs(ratio[r, first] - torch.floor(ratio[r, first])) - 0.5) < 1e-4, (name, r, first)
        parted += 1
    assert parted <= got.shape[0] // share, (name, parted)


def _capture(experts):
    """Each calibration call of ``experts`` (before its matrices are quantized, and one the modifier counted: the
    pipeline's first-layer call-order trace is not): (tokens [n, hidden], top-k index [n, k], the fused gate_up_proj
    at that moment)."""
    calls, pending = [], []
    views = list(weight_views(experts).values())

    def pre(module, args, kwargs):
        pending.clear()
        if getattr(views[0], "quantization_scheme", None) is None:
            hidden, index = args[0], args[1]
            pending.append((hidden.detach().reshape(-1, hidden.shape[-1]).clone(), index.detach().clone(),
                            module.gate_up_proj.detach().clone(), sum(v.routed_tokens for v in views)))  # fmt: skip

    def post(module, args, output):
        if pending and sum(v.routed_tokens for v in views) != pending[0][3]:
            calls.append(pending[0][:3])

    handles = [experts.register_forward_pre_hook(pre, with_kwargs=True), experts.register_forward_hook(post)]
    return calls, handles


def _reload(path, family):
    cls = getattr(transformers, FAMILIES[family][2] or "AutoModelForCausalLM")
    reloaded, info = cls.from_pretrained(path, output_loading_info=True)
    return reloaded.eval(), info


def _assert_reloads_as_in_memory(path, family, model, experts) -> None:
    """``path`` reloads with no missing or unexpected key, every fused experts module and the logits equal to
    ``model``'s."""
    reloaded, info = _reload(path, family)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    for name, module in experts.items():
        again = reloaded.get_submodule(name)
        assert torch.equal(again.gate_up_proj, module.gate_up_proj) and torch.equal(again.down_proj, module.down_proj)
    with torch.no_grad():
        assert torch.equal(reloaded(DATA[:2]).logits, model(DATA[:2]).logits)


def test_gptq_quantizes_each_expert_from_its_routed_tokens_and_the_checkpoint_holds_its_bits(tmp_path):
    """Mixtral, every layer: each expert matrix equals a float64 GPTQ of its original weight with the Hessian of its
    own routed tokens (down_proj: of act(gate) x up of them); the report counts every expert matrix (4 bits, group
    16, its routed tokens); the checkpoint holds each expert's packed integers under transformers' per-expert
    names, and reloads with no missing or unexpected key, the experts equal to the in-memory fused values."""
    model = build("mixtral")
    experts = _experts_modules(model)
    originals = {n: (m.gate_up_proj.detach().clone(), m.down_proj.detach().clone()) for n, m in experts.items()}
    captures = {n: _capture(m) for n, m in experts.items()}
    recipe = {"s": {"GPTQModifier": {"scheme": SCHEME}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=MORE, output_dir=tmp_path / "o", progress=False)
    for _, handles in captures.values():
        for handle in handles:
            handle.remove()
    report = model.llmc_fsm_report
    by_name = {m.name: m for m in report.modules}
    inter = model.config.intermediate_size
    for name, module in experts.items():
        calls = captures[name][0]
        assert calls
        gate_up, down = originals[name]
        for e in range(module.num_experts):
            xs = [x[(index == e).any(-1)].double() for x, index, _ in calls]
            hs = [F.silu(x @ gu[e, :inter].double().T) * (x @ gu[e, inter:].double().T)
                  for x, (_, _, gu) in zip(xs, calls, strict=True)]  # fmt: skip
            h_in = sum(x.T @ x for x in xs)
            h_down = sum(h.T @ h for h in hs)
            tokens = sum(x.shape[0] for x in xs)
            views = weight_views(module)
            _assert_gptq_equal(views[f"{e}.gate_proj"].weight, gate_up[e, :inter], h_in, f"{name}.{e}.gate_proj")
            _assert_gptq_equal(views[f"{e}.up_proj"].weight, gate_up[e, inter:], h_in, f"{name}.{e}.up_proj")
            _assert_gptq_equal(views[f"{e}.down_proj"].weight, down[e], h_down, f"{name}.{e}.down_proj")
            for matrix in ("gate_proj", "up_proj", "down_proj"):
                entry = by_name[f"{name}.{e}.{matrix}"]
                assert (entry.bits, entry.group_size, entry.routed_tokens) == (4, 16, tokens) and tokens > 0
    assert "every expert got tokens" in report.format_table()
    _assert_reloads_as_in_memory(tmp_path / "o", "mixtral", model, experts)
    files = sorted((tmp_path / "o").glob("*.safetensors"))
    with safe_open(str(files[0]), "pt") as f:
        keys = set(f.keys())
        assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in keys)
        view = weight_views(model.model.layers[2].mlp.experts)["1.up_proj"]  # Mixtral's w3
        prefix = "model.layers.2.block_sparse_moe.experts.1.w3."
        assert {prefix + k for k in ("weight_packed", "weight_scale", "weight_shape")} <= keys
        scale = f.get_tensor(prefix + "weight_scale")
        ints = unpack_from_int32(f.get_tensor(prefix + "weight_packed"), 4, torch.Size([inter, 64]))
    assert torch.equal(scale, view.quantized_params["weight_scale"])
    assert torch.equal(ints.float() * scale.repeat_interleave(GROUP, dim=1), view.weight)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_round_to_nearest_rounds_each_expert_matrix_by_hand_and_reloads(tmp_path, family):
    """QuantizationModifier (data-free): every expert matrix equals its original rounded by hand (symmetric int4,
    group 16); reload with no missing or unexpected key, experts and logits equal."""
    model = build(family)
    experts = _experts_modules(model)
    originals = {f"{n}.{s}": v.weight.detach().clone() for n, m in experts.items() for s, v in weight_views(m).items()}
    recipe = {"s": {"QuantizationModifier": {"scheme": SCHEME}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    by_name = {m.name: m for m in model.llmc_fsm_report.modules}
    for name, module in experts.items():
        for suffix, view in weight_views(module).items():
            assert torch.equal(view.weight, _rtn(originals[f"{name}.{suffix}"])), f"{name}.{suffix}"
            entry = by_name[f"{name}.{suffix}"]
            assert (entry.bits, entry.group_size, entry.routed_tokens) == (4, 16, None)
    reloaded, info = _reload(tmp_path / "o", family)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    for name, module in experts.items():
        assert torch.equal(reloaded.get_submodule(name).gate_up_proj, module.gate_up_proj)
    with torch.no_grad():
        assert torch.equal(reloaded(DATA[:2]).logits, model(DATA[:2]).logits)


def test_square_expert_matrices_are_named_apart_and_reload(tmp_path):
    """Experts whose ``down_proj`` is square-sized like ``gate_proj`` (``moe_intermediate_size == hidden_size``) are
    told apart when their checkpoint names are read (found by llm-compressor's recipe corpus: it was refused as
    'not one expert matrix'): every expert matrix rounded by hand, reload with no missing or unexpected key and
    equal logits."""
    import transformers
    from tiny_families import config

    cfg = config("qwen3_moe")
    cfg.moe_intermediate_size = cfg.hidden_size
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    experts = _experts_modules(model)
    originals = {f"{n}.{s}": v.weight.detach().clone() for n, m in experts.items() for s, v in weight_views(m).items()}
    assert {tuple(w.shape) for w in originals.values()} == {(cfg.hidden_size, cfg.hidden_size)}
    recipe = {"s": {"QuantizationModifier": {"scheme": SCHEME}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    for name, module in experts.items():
        for suffix, view in weight_views(module).items():
            assert torch.equal(view.weight, _rtn(originals[f"{name}.{suffix}"])), f"{name}.{suffix}"
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o", output_loading_info=True)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    for name, module in experts.items():
        assert torch.equal(reloaded.get_submodule(name).gate_up_proj, module.gate_up_proj)
        assert torch.equal(reloaded.get_submodule(name).down_proj, module.down_proj)
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(DATA[:2]).logits, model(DATA[:2]).logits)


#: modules whose in_features group size 16 does not divide in the tiny configs, ignored by name: Jamba's mamba
#: ``dt_proj`` (8), Nemotron-H's shared expert ``down_proj`` (7688, transformers' default)
MISFIT = {
    "jamba": ["lm_head", "re:.*mamba\\.dt_proj$"],
    "nemotron_h": ["lm_head", "re:.*shared_experts\\.down_proj$"],
}


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "qwen3_next", "jamba", "nemotron_h"])
def test_gptq_quantizes_every_expert_and_the_output_reloads(tmp_path, family):
    model = build(family)
    recipe = {"s": {"GPTQModifier": {"scheme": SCHEME, **({"ignore": MISFIT[family]} if family in MISFIT else {})}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    report = model.llmc_fsm_report
    names = [f"{n}.{s}" for n, m in _experts_modules(model).items() for s in weight_views(m)]
    by_name = {m.name: m for m in report.modules}
    assert names and all(by_name[n].bits == 4 and by_name[n].routed_tokens is not None for n in names)
    reloaded, info = _reload(tmp_path / "o", family)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    with torch.no_grad():
        assert torch.equal(reloaded(DATA[:2]).logits, model(DATA[:2]).logits)


def _never_route_expert_3(model):
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            with torch.no_grad():
                gate.e_score_correction_bias[3] = -1e4


def test_an_expert_without_routed_tokens_is_rounded_to_nearest_and_named(tmp_path, caplog):
    """DeepSeek-V3 with expert 3's selection bias at -1e4: GPTQ has no Hessian for it, so its matrices are rounded to
    nearest (equal to hand rounding), named in a warning and in the report; with calibrate_all_experts they are
    quantized by GPTQ from every token (routed count still 0)."""
    model = build("deepseek_v3")
    _never_route_expert_3(model)
    experts = _experts_modules(model)
    idle = [f"{n}.3.{m}" for n in experts for m in ("gate_proj", "up_proj", "down_proj")]
    originals = {n: model.get_submodule(n.rsplit(".", 2)[0]) for n in idle}
    originals = {
        n: weight_views(m)[".".join(n.rsplit(".", 2)[1:])].weight.detach().clone() for n, m in originals.items()
    }
    recipe = {"s": {"GPTQModifier": {"scheme": SCHEME}}}
    with caplog.at_level(logging.WARNING):
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "a", progress=False)
    assert "GPTQModifier: the router sent no calibration token to 3 expert matrices: model.layers.1.mlp.experts.3." in (
        caplog.text
    )
    assert "quantized by round-to-nearest (no input statistics; set calibrate_all_experts: true" in caplog.text
    for name in idle:
        view = weight_views(model.get_submodule(name.rsplit(".", 2)[0]))[".".join(name.rsplit(".", 2)[1:])]
        assert torch.equal(view.weight, _rtn(originals[name])), name
    report = model.llmc_fsm_report
    by_name = {m.name: m for m in report.modules}
    assert all(by_name[n].routed_tokens == 0 and by_name[n].bits == 4 for n in idle)
    assert "quantized by round-to-nearest (no calibration input)" in report.format_table()
    reloaded, info = _reload(tmp_path / "a", "deepseek_v3")
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    with torch.no_grad():
        assert torch.equal(reloaded(DATA[:2]).logits, model(DATA[:2]).logits)
    model = build("deepseek_v3")
    _never_route_expert_3(model)
    recipe = {"s": {"GPTQModifier": {"scheme": SCHEME, "calibrate_all_experts": True}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "b", progress=False)
    by_name = {m.name: m for m in model.llmc_fsm_report.modules}
    assert all(by_name[n].routed_tokens == 0 and by_name[n].rel_output_error is not None for n in idle)


REFUSALS = {
    "gpt_oss": (
        "gpt_oss",
        {"scheme": SCHEME},
        "GPTQModifier: GptOssForCausalLM (model_type 'gpt_oss'): fused experts model.layers.0.mlp.experts cannot be "
        "quantized: transformers saves model.layers.0.mlp.experts.gate_up_proj, model.layers.0.mlp.experts.down_proj "
        "fused in the checkpoint (its conversion mapping has no per-expert key for them) and reads compressed-tensors "
        "quantized weights into fused experts only through such a per-expert mapping: quantized per expert they "
        "reload as unexpected keys with model.layers.0.mlp.experts.gate_up_proj missing (randomly initialised; "
        "measured on transformers 5.24, and on 5.25 with llm-compressor 0.14's Qwen3-VL-MoE checkpoints: packed int4, "
        "NVFP4, and FP8 weights with their scales), packed under the fused name as unexpected "
        "model.layers.0.mlp.experts.gate_up_proj.weight_packed ... keys (5.24), so no quantized experts can be written "
        "that it reloads; to quantize the rest of the model, add 're:.*mlp.experts' to the modifier's ignore (the "
        "experts are then saved dense, as they are, and reload)",
    ),
    "dbrx": (
        "dbrx",
        {"scheme": SCHEME},
        "GPTQModifier: DbrxForCausalLM (model_type 'dbrx'): fused experts transformer.blocks.0.ffn.experts cannot be "
        "quantized: transformers saves transformer.blocks.0.ffn.experts.mlp.w1, transformer.blocks.0.ffn.experts.mlp."
        "v1, transformer.blocks.0.ffn.experts.mlp.w2 fused in the checkpoint (its conversion mapping has no "
        "per-expert key for them) and reads compressed-tensors quantized weights into fused experts only through "
        "such a per-expert mapping: quantized per expert they reload as unexpected keys with "
        "transformer.blocks.0.ffn.experts.mlp.w1 missing (randomly initialised; measured on transformers 5.24, and on "
        "5.25 with llm-compressor 0.14's Qwen3-VL-MoE checkpoints: packed int4, NVFP4, and FP8 weights with their "
        "scales), packed under the fused name as unexpected transformer.blocks.0.ffn.experts.mlp.w1.weight_packed ... "
        "keys (5.24), so no quantized experts can be written that it reloads; to quantize the rest of the model, add "
        "'re:.*ffn.experts' to the modifier's ignore (the experts are then saved dense, as they are, and reload)",
    ),
    "ignored": (
        "mixtral",
        {"scheme": SCHEME, "ignore": ["lm_head", "re:.*\\.experts"]},
        "GPTQModifier: MixtralForCausalLM (model_type 'mixtral'): the fused experts model.layers.{0..3}.mlp.experts "
        "are not quantized, and transformers does not reload dense fused experts from a compressed-tensors checkpoint "
        "(its experts loader decompresses quantized weights only: the experts missing in 5.24, 'torch.cat(): expected "
        "a non-empty list of Tensors' in 5.25; measured on Mixtral): quantize them too (target them, in this modifier "
        "or another of the recipe; leave them out of ignore)",
    ),
    "partial": (
        "mixtral",
        {"scheme": SCHEME, "ignore": ["lm_head", "re:.*experts\\.0\\.down_proj"]},
        "GPTQModifier: MixtralForCausalLM (model_type 'mixtral'): model.layers.{0..3}.mlp.experts.0.down_proj would "
        "stay dense while other expert matrices are quantized; transformers' experts loader rebuilds a layer's fused "
        "experts from packed weights only (measured on 5.24: the dense ones were missing): quantize every expert "
        "matrix (no ignore pattern inside the experts) or none of the model",
    ),
    "activations": (  # W4A8 (int4 weights, dynamic int8 inputs; W8A8 is written for vLLM since session 26)
        "mixtral",
        {"config_groups": {"g": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True}}}},
        "GPTQModifier: MixtralForCausalLM (model_type 'mixtral'): fused experts model.layers.{0..3}.mlp.experts: "
        "input activations are quantized on fused experts only with FP8 weights per channel or tensor "
        "(FP8_DYNAMIC) or MXFP4 weights with dynamic inputs (MXFP4): transformers reloads other experts from packed "
        "weight-only formats alone (W4A16, W8A16, MXFP4A16)" + FOR_VLLM,
    ),
    "asymmetric": (
        "mixtral",
        {"scheme": {"preset": "W4A16_ASYM", "weights": {"group_size": 16}}},
        "GPTQModifier: MixtralForCausalLM (model_type 'mixtral'): fused experts model.layers.{0..3}.mlp.experts: "
        "symmetric int weights that compressed-tensors packs (pack-quantized: W4A16, W8A16), MXFP4 / MXFP6 weights "
        "(MXFP4A16, MXFP6A16) or symmetric FP8 weights per channel or tensor (FP8_DYNAMIC) only: transformers "
        "rebuilds a checkpoint's experts from their packed weights, scales and shapes (no zero point) or from fp8 "
        "weights times their scales, no other format" + FOR_VLLM,
    ),
    "fp8_asymmetric": (  # found by a tester: it ran, and the FP8 zero points made the checkpoint fail to reload
        "mixtral",
        {"config_groups": {"g": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "symmetric": False, "strategy": "channel"}}}},
        "GPTQModifier: MixtralForCausalLM (model_type 'mixtral'): fused experts model.layers.{0..3}.mlp.experts: "
        "symmetric int weights that compressed-tensors packs (pack-quantized: W4A16, W8A16), MXFP4 / MXFP6 weights "
        "(MXFP4A16, MXFP6A16) or symmetric FP8 weights per channel or tensor (FP8_DYNAMIC) only: transformers "
        "rebuilds a checkpoint's experts from their packed weights, scales and shapes (no zero point) or from fp8 "
        "weights times their scales, no other format" + FOR_VLLM,
    ),
    "static_int8_inputs": (  # FP8 weights with static int8 inputs: one FP8 input_scale per expert matrix only
        "mixtral",
        {"config_groups": {"g": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}, "input_activations": {
            "num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}}}},
        "GPTQModifier: MixtralForCausalLM (model_type 'mixtral'): fused experts model.layers.{0..3}.mlp.experts: "
        "static input activations on fused experts are 8-bit float, symmetric, per tensor only (one input_scale [1] "
        "per expert matrix, as the FP8 preset writes them); use the FP8 preset or FP8_DYNAMIC" + FOR_VLLM,
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_transformers_cannot_reload_is_refused_before_any_work(tmp_path, case):
    family, args, message = REFUSALS[case]
    model = build(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(
            model=model, recipe={"s": {"GPTQModifier": args}}, dataset=DATA, output_dir=tmp_path / "o", progress=False
        )
    assert str(info.value) == message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "o").exists()


def test_mxfp8_on_fused_experts_is_refused_before_the_shared_global_scales_are_looked_up(tmp_path):
    """Found by llm-compressor's recipe corpus (tests/e2e/moe_configs/nvfp4_moe.yaml): the lookup of the modules
    that share an NVFP4 global scale ran before the experts' refusal and raised AttributeError on an expert view."""
    model = build("qwen3_moe").to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = {"s": {"QuantizationModifier": {"scheme": "MXFP8A16", "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    assert str(info.value) == (
        "QuantizationModifier: Qwen3MoeForCausalLM (model_type 'qwen3_moe'): fused experts "
        "model.layers.{0..3}.mlp.experts: symmetric int weights that compressed-tensors packs (pack-quantized: W4A16, "
        "W8A16), MXFP4 / MXFP6 weights (MXFP4A16, MXFP6A16) or symmetric FP8 weights per channel or tensor "
        "(FP8_DYNAMIC) only: transformers rebuilds a checkpoint's experts from their packed weights, scales and shapes "
        "(no zero point) or from fp8 weights times their scales, no other format" + FOR_VLLM
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "o").exists()


#: FP8 block weights (blocks of 16 x 16: the tiny widths) with dynamic FP8 inputs per group of 16, as FP8_BLOCK
_FP8_BLOCK_16 = {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                             "block_structure": [16, 16]},
                 "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                                       "group_size": 16, "dynamic": True}}  # fmt: skip
_FOR_VLLM = {
    "qwen3_moe-NVFP4A16": ("qwen3_moe", "NVFP4A16", "NVFP4 weights: transformers' experts loader decompresses each "
                           "expert from weight_packed, weight_scale and weight_shape alone, without its "
                           "weight_global_scale"),
    "mixtral-NVFP4A16": ("mixtral", "NVFP4A16", "NVFP4 weights:"),
    "qwen3_moe-NVFP4": ("qwen3_moe", "NVFP4", "NVFP4 weights:"),  # also input global scales, per expert
    "mixtral-FP8_BLOCK": ("mixtral", _FP8_BLOCK_16, "FP8 block weights (FP8_BLOCK): transformers' experts loader "
                          "multiplies each expert's fp8 weight by its weight_scale by broadcasting"),
    "GPTQ-qwen3_moe-NVFP4A16": ("qwen3_moe", "NVFP4A16", "NVFP4 weights:"),  # GPTQ's sweep with the shared scales
    "GPTQ-mixtral-FP8_BLOCK": ("mixtral", _FP8_BLOCK_16, "FP8 block weights (FP8_BLOCK):"),
    # int8 weights per channel, dynamic int8 inputs per token (llm-compressor's qwen3.5_int8.py; session 26)
    "qwen3_moe-W8A8": ("qwen3_moe", "W8A8", "input activations are quantized on fused experts only with FP8 weights"),
    "GPTQ-mixtral-W8A8": ("mixtral", "W8A8", "input activations are quantized on fused experts only"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_FOR_VLLM))
def test_nvfp4_and_fp8_block_experts_are_written_per_expert_for_vllm(tmp_path, caplog, case):
    """NVFP4, FP8 block and W8A8 int8 on fused experts (llm-compressor's Qwen3-30B-A3B NVFP4 and FP8_BLOCK examples;
    refused before, since transformers does not reload them): each expert matrix is saved per expert as vLLM reads it,
    one warning line says why transformers will not reload it, every saved expert decompresses (compressed-tensors'
    own compressor) to the in-memory fused matrix exactly, an expert's gate and up share one NVFP4 global scale,
    and the data-free schemes' checkpoint equals model_free_ptq's of the same float checkpoint, tensor for tensor
    (round-to-nearest; GPTQ's are checked against the in-memory model only)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from llmc_fsm.toolkit import expert_checkpoint_names, weight_views

    family, scheme, why = _FOR_VLLM[case]
    model = build(family).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "src")
    router = "re:.*block_sparse_moe.gate$" if family == "mixtral" else "re:.*mlp.gate$"
    group = {"scheme": scheme}
    if isinstance(scheme, dict):
        group = {"config_groups": {"g": {"targets": ["Linear"], **scheme}}}
    modifier = "GPTQModifier" if case.startswith("GPTQ") else "QuantizationModifier"
    recipe = {"s": {modifier: {**group, "ignore": ["lm_head", router]}}}
    with caplog.at_level(logging.WARNING):
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=MORE, output_dir=tmp_path / "o", progress=False)
    lines = [r.getMessage() for r in caplog.records if "saved per expert" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith(
        f"{modifier}: {type(model).__name__} (model_type '{family}'): fused experts "
        "model.layers.{0..3}.mlp.experts: their expert matrices are quantized and saved per expert, in the layout "
        f"vLLM reads; transformers {transformers.__version__} will not reload this checkpoint into its fused "
        f"experts: {why}"
    )
    saved = _saved(tmp_path / "o")
    config = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    (entry,) = config["config_groups"].values()
    fmt = entry["format"]
    compressor = BaseCompressor.get_value_from_registry(fmt)
    group_scheme = QuantizationScheme.model_validate(entry)
    checked = 0
    for name, module in model.named_modules():
        if not name.endswith("mlp.experts"):
            continue
        names = expert_checkpoint_names(model, name, module)
        for suffix, view in weight_views(module).items():
            prefix = names[suffix] + "."
            tensors = {k.removeprefix(prefix): v for k, v in saved.items() if k.startswith(prefix)}
            assert f"{names[suffix]}.weight" not in saved or fmt != "nvfp4-pack-quantized"
            weight = compressor.decompress(tensors, group_scheme)["weight"]
            assert torch.equal(weight.to(view.weight.dtype), view.weight)
            checked += 1
    assert checked == 4 * 4 * 3
    if fmt == "nvfp4-pack-quantized":
        gate, up = ("w1", "w3") if family == "mixtral" else ("gate_proj", "up_proj")
        experts = "block_sparse_moe.experts" if family == "mixtral" else "mlp.experts"
        for layer in range(4):
            for e in range(4):
                p = f"model.layers.{layer}.{experts}.{e}."
                assert torch.equal(saved[p + gate + ".weight_global_scale"], saved[p + up + ".weight_global_scale"])
        assert ("input_global_scale" in " ".join(saved)) == (scheme == "NVFP4")
    if scheme != "NVFP4" and modifier == "QuantizationModifier":  # data-free: model_free_ptq writes the same
        llmc_fsm.model_free_ptq(tmp_path / "src", tmp_path / "free", scheme, ignore=["lm_head", router], progress=False)
        free = {}
        for file in (tmp_path / "free").glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                free.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
        assert sorted(free) == sorted(saved)
        assert all(torch.equal(free[k], saved[k]) for k in free)


def _write_packed_experts(model, directory, layout):
    """Save ``model`` (transformers' ``save_pretrained``), then replace each fused expert parameter in the checkpoint
    by compressed-tensors ``pack-quantized`` tensors of its expert matrices (symmetric int4, group 16, scales
    ``max |w| / 7.5``), under the per-expert names (``layout="per_expert"``: ``<experts>.<e>.gate_proj.weight_packed``
    ..., the names of our views and of llm-compressor's linearized experts) or under the fused parameter's name
    (``"fused"``: ``<experts>.gate_up_proj.weight_packed`` ..., every expert matrix of it stacked), with a
    ``quantization_config`` whose one group targets ``Linear`` and ignores every ``nn.Linear`` (only experts packed).
    Returns (the keys of the expert matrices removed from the checkpoint, the keys written)."""
    import json

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file, save_file

    model.save_pretrained(directory)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    (file,) = sorted(directory.glob("*.safetensors"))
    state = load_file(str(file))
    owners = {id(m): n for n, m in model.named_modules()}
    removed, stacked = set(), {}
    for name, experts in _experts_modules(model).items():
        for suffix, view in weight_views(experts).items():
            fused = f"{owners[id(view.owner)]}.{view.param_name}"
            removed |= {fused, f"{name}.{suffix}.weight"} & set(state)  # what save_pretrained wrote for it
            w = view.weight.detach()
            packed = compressor.compress({"weight": w, "weight_scale": _scales(w)}, scheme)
            for key, value in packed.items():
                if layout == "per_expert":
                    state[f"{name}.{suffix}.{key}"] = value.contiguous()
                else:
                    stacked.setdefault(f"{fused}.{key}", []).append(value)
    state.update({key: torch.stack(values) for key, values in stacked.items()})
    for key in removed:
        del state[key]
    written = sorted(set(state) - set(load_file(str(file))))
    save_file(state, str(file), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": scheme.model_dump(mode="json")},
        "ignore": [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)],
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return removed, written


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("family", ["gpt_oss", "dbrx"])
def test_why_gpt_oss_and_dbrx_experts_are_refused_packed_experts_do_not_reload(tmp_path, family, layout):
    """The refusal's measured reason (transformers 5.24 has no conversion mapping for these experts): packed expert
    tensors written per expert or under the fused name reload as unexpected keys, every fused expert parameter
    missing (randomly initialised)."""
    model = build(family)
    removed, written = _write_packed_experts(model, tmp_path / "o", layout)
    assert removed and written
    _, info = _reload(tmp_path / "o", family)
    assert sorted(info["missing_keys"]) == sorted(removed)
    assert sorted(info["unexpected_keys"]) == written


def test_the_same_per_expert_packed_layout_reloads_where_transformers_maps_it():
    """Control for the test above: the same writer on Qwen3-MoE (whose conversion mapping reads
    ``mlp.experts.<e>.gate_proj.weight``...) reloads with no missing or unexpected key and each expert matrix
    equal to its integers x scale."""
    import tempfile
    from pathlib import Path

    model = build("qwen3_moe")
    with tempfile.TemporaryDirectory() as tmp:
        removed, written = _write_packed_experts(model, Path(tmp), "per_expert")
        reloaded, info = _reload(tmp, "qwen3_moe")
    assert removed and written
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    for name, experts in _experts_modules(model).items():
        again = weight_views(reloaded.get_submodule(name))
        for suffix, view in weight_views(experts).items():
            assert torch.equal(again[suffix].weight, _rtn(view.weight)), f"{name}.{suffix}"


def _interrupted_and_resumed(tmp_path, monkeypatch, make_model, **kw):
    """An uninterrupted one-shot run of ``make_model()`` into ``tmp_path / "ref"``, one killed after layer 1 is saved
    and resumed into ``tmp_path / "o"``; asserts the two checkpoints hold the same tensors, returns both models."""
    from llmc_fsm.oneshot_job.resume import LayerProgress

    ref = llmc_fsm.oneshot(model=make_model(), output_dir=tmp_path / "ref", **kw)
    original = LayerProgress.save

    def save(self, index, module):
        original(self, index, module)
        if index == 1:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(LayerProgress, "save", save)
        with pytest.raises(KeyboardInterrupt):
            llmc_fsm.oneshot(model=make_model(), output_dir=tmp_path / "o", **kw)
    out = llmc_fsm.oneshot(model=make_model(), output_dir=tmp_path / "o", resume=True, **kw)
    files = [sorted(d.glob("*.safetensors")) for d in (tmp_path / "ref", tmp_path / "o")]
    with safe_open(str(files[0][0]), "pt") as a, safe_open(str(files[1][0]), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert [k for k in a.keys() if not torch.equal(a.get_tensor(k), b.get_tensor(k))] == []
    return ref, out


def test_an_interrupted_run_resumes_with_each_expert_s_quantization(tmp_path, monkeypatch):
    """Killed after layer 1 and resumed: the expert views of the restored layers get back their scales, scheme,
    checkpoint names and routed-token counts (kept in the layer's progress file), so the saved checkpoint and the
    report equal the uninterrupted run's."""
    kw = {"recipe": {"s": {"GPTQModifier": {"scheme": SCHEME}}}, "dataset": DATA, "progress": False}
    ref, out = _interrupted_and_resumed(tmp_path, monkeypatch, lambda: build("mixtral"), **kw)
    assert out.llmc_fsm_report.to_dict()["sparsity"] == ref.llmc_fsm_report.to_dict()["sparsity"]


def test_falcon_gptq_output_reloads_its_falconlinear_unpacked(tmp_path):
    """Falcon's _init_weights reads FalconLinear.weight unguarded, which a packed module has not on reload
    (transformers 5.24: "'FalconLinear' object has no attribute 'weight'"): its quantized FalconLinear are saved
    int-quantized (integer values under weight), and the checkpoint reloads with every key and equal logits. The
    config keeps the recipe's target, Linear (it selects exactly the quantized modules; FalconLinear before)."""
    import json

    model = build("falcon")
    recipe = {"s": {"GPTQModifier": {"scheme": SCHEME}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    config = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert (config["format"], config["config_groups"]["group_0"]["targets"]) == ("int-quantized", ["Linear"])
    reloaded, info = _reload(tmp_path / "o", "falcon")
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    with torch.no_grad():
        assert torch.equal(reloaded(DATA[:2]).logits, model(DATA[:2]).logits)


def _fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 per output channel by hand: scale ``max |w_row| / 448`` (float32, ``[out, 1]``), the weight
    ``fp8(w / scale) * scale``."""
    scale = w.float().abs().amax(dim=1, keepdim=True) / 448.0
    q = (w.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.float() * scale, scale


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fp8_dynamic_rounds_each_expert_matrix_by_hand_saves_it_per_expert_and_reloads(tmp_path, family, caplog):
    """FP8_DYNAMIC on fused experts (llm-compressor's tests/e2e/moe_configs/fp8_dynamic_moe.yaml; transformers 5.25
    reloads fp8 experts): every expert matrix is its original rounded to FP8 per channel by hand; the checkpoint
    holds each expert's fp8 weight and scale under transformers' per-expert names and no input scale; the run says in
    one warning that the experts' inputs are not quantized here nor on reload; the reload has no missing or
    unexpected key, the experts and the logits equal to the in-memory model's."""
    model = build(family)
    experts = _experts_modules(model)
    originals = {f"{n}.{s}": v.weight.detach().clone() for n, m in experts.items() for s, v in weight_views(m).items()}
    recipe = {"s": {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    with caplog.at_level(logging.WARNING, logger="llmc_fsm_quantization"):
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    warned = [r.getMessage() for r in caplog.records if "fused experts' input activations" in r.getMessage()]
    assert warned == [
        f"QuantizationModifier: {type(model).__name__} (model_type {family!r}): fused experts "
        "model.layers.{0..3}.mlp.experts: the fused experts' input activations (per token, dynamic) are not "
        "quantized in memory nor when transformers reloads the checkpoint (fused experts are not Linear modules; "
        "transformers runs them dense): their weights are, and the saved config asks the serving engine (vLLM) to "
        "quantize their inputs; a perplexity llmc-fsm measures does not include that"
    ]
    for name, module in experts.items():
        for suffix, view in weight_views(module).items():
            want, scale = _fp8_channel(originals[f"{name}.{suffix}"])
            assert torch.equal(view.weight, want), f"{name}.{suffix}"
            assert torch.equal(view.quantized_params["weight_scale"], scale), f"{name}.{suffix}"
    view = weight_views(model.model.layers[1].mlp.experts)["2.down_proj"]
    prefix = view.checkpoint_name + "."
    with safe_open(str(sorted((tmp_path / "o").glob("*.safetensors"))[0]), "pt") as f:
        keys = set(f.keys())
        assert {k.removeprefix(prefix) for k in keys if k.startswith(prefix)} == {"weight", "weight_scale"}
        fp8, scale = f.get_tensor(prefix + "weight"), f.get_tensor(prefix + "weight_scale")
    assert fp8.dtype == torch.float8_e4m3fn and torch.equal(scale, view.quantized_params["weight_scale"])
    assert torch.equal(fp8.float() * scale, view.weight)
    assert not any(k.endswith("input_scale") for k in keys)
    _assert_reloads_as_in_memory(tmp_path / "o", family, model, experts)


def _fp8_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` rounded to FP8 (e4m3) per tensor by hand: ``scale = max|w| / 448`` ``[1]``, ``fp8(w / scale) * scale``."""
    scale = (w.float().abs().amax() / 448.0).reshape(1)
    q = (w.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.float() * scale, scale


def _routed_input_maxima(experts_module, seq_len=DATA.shape[1]):
    """Hooks recording, per expert matrix suffix (``"2.gate_proj"``), the largest |input| over the tokens routed to
    its expert in the calibration calls the modifier counted (the routed counts grew), before that matrix was
    quantized: ``gate_proj`` / ``up_proj`` see the routed hidden states, ``down_proj`` their ``act(gate) * up`` with
    the fused ``gate_up_proj`` as it was at that call, computed one calibration sample (``seq_len`` tokens) at a
    time, as the modifier observes them."""
    views = weight_views(experts_module)
    maxima, pending = {}, []

    def pre(module, args, kwargs):
        pending.clear()
        hidden, index = args[0].reshape(-1, args[0].shape[-1]), args[1]
        index = index.reshape(hidden.shape[0], -1)
        seen = {}
        samples = hidden.shape[0] // seq_len
        for part, part_index in zip(hidden.chunk(samples), index.chunk(samples), strict=True):
            for e in range(module.num_experts):
                x = part[(part_index == e).any(dim=-1)]
                if x.shape[0] == 0:
                    continue
                w = module.gate_up_proj[e]
                h = module._apply_gate(F.linear(x, w.T if module.is_transposed else w))
                for proj, value in (("gate_proj", x), ("up_proj", x), ("down_proj", h)):
                    if getattr(views[f"{e}.{proj}"], "quantization_scheme", None) is None:
                        key = f"{e}.{proj}"
                        seen[key] = max(seen.get(key, 0.0), float(value.detach().abs().max()))
        pending.append((seen, sum(v.routed_tokens for v in views.values())))

    def post(module, args, output):
        if pending and sum(v.routed_tokens for v in views.values()) != pending[0][1]:
            for key, value in pending[0][0].items():
                maxima[key] = max(maxima.get(key, 0.0), value)

    handles = [experts_module.register_forward_pre_hook(pre, with_kwargs=True), experts_module.register_forward_hook(post)]
    return maxima, handles


@pytest.mark.parametrize(("family", "modifier"), [("qwen3_moe", "QuantizationModifier"),
                                                ("mixtral", "QuantizationModifier"), ("mixtral", "AutoRoundModifier")])
def test_fp8_static_calibrates_each_expert_s_input_scale_on_its_routed_tokens_and_saves_it(
    tmp_path, family, modifier, caplog
):
    """The FP8 preset on fused experts (llm-compressor's examples/quantizing_moe/mixtral_example.py, qwen_example.py;
    AutoRound with ``iters: 0``, its examples/autoround/quantization_w8a8_fp8/llama4_static_quant_example.py, refused
    on experts before session 25):
    every expert matrix is its original rounded to FP8 per tensor by hand; its static input scale is the largest
    |input| over the tokens routed to its expert, divided by 448 (observer static_minmax), saved under its per-expert
    name (``experts.<e>.gate_proj.input_scale``: what llm-compressor 0.14 writes for the same recipe, measured by
    benchmarks/families_vs_llmcompressor.py --methods fp8); one warning says the experts' inputs are not quantized
    here nor on reload; the reload reports exactly those input scales as unexpected keys, and its experts and logits
    equal the in-memory model's."""
    model = build(family)
    experts = _experts_modules(model)
    originals = {f"{n}.{s}": v.weight.detach().clone() for n, m in experts.items() for s, v in weight_views(m).items()}
    captured = {name: _routed_input_maxima(module) for name, module in experts.items()}
    args = {"scheme": "FP8", "ignore": ["lm_head", "re:.*mlp.gate$"]}
    recipe = {"s": {modifier: {**args, "iters": 0} if modifier == "AutoRoundModifier" else args}}
    with caplog.at_level(logging.WARNING, logger="llmc_fsm_quantization"):
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    for _, handles in captured.values():
        for handle in handles:
            handle.remove()
    warned = [r.getMessage() for r in caplog.records if "fused experts' input activations" in r.getMessage()]
    assert warned == [
        f"{modifier}: {type(model).__name__} (model_type {family!r}): fused experts "
        "model.layers.{0..3}.mlp.experts: the fused experts' input activations (per tensor, static: each expert's "
        "input_scale is calibrated on the tokens routed to it and saved, and transformers reports those as unexpected "
        "keys on reload) are not quantized in memory nor when transformers reloads the checkpoint (fused experts "
        "are not Linear modules; transformers runs them dense): their weights are, and the saved config asks the "
        "serving engine (vLLM) to quantize their inputs; a perplexity llmc-fsm measures does not include that"
    ]
    expected_unexpected = []
    for name, module in experts.items():
        maxima = captured[name][0]
        assert len(maxima) == len(weight_views(module)), name  # every expert got tokens (no fallback here)
        for suffix, view in weight_views(module).items():
            want, scale = _fp8_tensor(originals[f"{name}.{suffix}"])
            assert torch.equal(view.weight, want), f"{name}.{suffix}"
            assert torch.equal(view.quantized_params["weight_scale"], scale), f"{name}.{suffix}"
            input_scale = view.quantized_params["input_scale"]
            assert input_scale.dtype == torch.float32 and input_scale.shape == (1,)
            assert torch.equal(input_scale, torch.tensor([maxima[suffix]]) / 448.0), f"{name}.{suffix}"
            expected_unexpected.append(f"{view.checkpoint_name}.input_scale")
    view = weight_views(model.model.layers[1].mlp.experts)["2.down_proj"]
    prefix = view.checkpoint_name + "."
    with safe_open(str(sorted((tmp_path / "o").glob("*.safetensors"))[0]), "pt") as f:
        keys = set(f.keys())
        assert {k.removeprefix(prefix) for k in keys if k.startswith(prefix)} == {"weight", "weight_scale", "input_scale"}
        assert torch.equal(f.get_tensor(prefix + "input_scale"), view.quantized_params["input_scale"])
    reloaded, info = _reload(tmp_path / "o", family)
    renamed = [k.replace(".block_sparse_moe.", ".mlp.") for k in expected_unexpected]  # Mixtral's checkpoint names
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], sorted(renamed))
    for name, module in experts.items():
        again = reloaded.get_submodule(name)
        assert torch.equal(again.gate_up_proj, module.gate_up_proj) and torch.equal(again.down_proj, module.down_proj)
    with torch.no_grad():
        assert torch.equal(reloaded(DATA[:2]).logits, model(DATA[:2]).logits)


@pytest.mark.parametrize("observer", ["minmax", "memoryless_minmax"])
def test_static_expert_input_scales_do_not_depend_on_the_batch_size(tmp_path, observer):
    """Found by a tester: with an observer that keeps a moving average or the last observation, each expert's input
    scale changed with batch_size (an expert matrix was observed once per batch, a Linear once per sample). Each
    expert matrix now sees one sample's routed tokens at a time: batch sizes 1, 3 and 8 give the same gate_proj
    scales of layer 0 (its inputs are the embeddings: no float difference), equal to a hand computation of the
    observer over the samples in order (each sample's [min, max] of the tokens routed to the expert; minmax: the
    moving average v <- 0.99 v + 0.01 v_sample of both, memoryless: the last sample's; scale = max(|min|, max) / 448)."""
    data = torch.randint(3, 128, (8, 16), generator=torch.Generator().manual_seed(7))
    scales = []
    for batch_size in (1, 3, 8):
        model = build("qwen3_moe")
        experts = model.model.layers[0].mlp.experts
        views = weight_views(experts)
        ranges, pending = {}, []  # expert -> [(min, max) of each sample that routed tokens to it], in order

        def pre(module, args, kwargs, pending=pending, views=views):
            pending.clear()
            if getattr(views["0.gate_proj"], "quantization_scheme", None) is not None:
                return
            hidden, index = args[0], args[1].reshape(args[0].shape[0], -1)
            seen = {}
            for part, part_index in zip(hidden.chunk(hidden.shape[0] // 16), index.chunk(hidden.shape[0] // 16)):
                for e in range(module.num_experts):
                    x = part[(part_index == e).any(dim=-1)]
                    if x.shape[0]:
                        seen.setdefault(e, []).append((float(x.min()), float(x.max())))
            pending.append((seen, sum(v.routed_tokens for v in views.values())))

        def post(module, args, output, pending=pending, views=views, ranges=ranges):
            if pending and sum(v.routed_tokens for v in views.values()) != pending[0][1]:  # a call it counted
                for e, values in pending[0][0].items():
                    ranges.setdefault(e, []).extend(values)

        handles = [experts.register_forward_pre_hook(pre, with_kwargs=True), experts.register_forward_hook(post)]
        recipe = {"s": {"QuantizationModifier": {
            "scheme": "FP8", "input_observer": observer, "ignore": ["lm_head", "re:.*mlp.gate$"]}}}  # fmt: skip
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=batch_size, progress=False)
        for handle in handles:
            handle.remove()
        scales.append({e: float(views[f"{e}.gate_proj"].quantized_params["input_scale"]) for e in ranges})
        assert sorted(ranges) == [0, 1, 2, 3] and sum(len(v) for v in ranges.values()) > 8  # several per expert
        for e, observed in ranges.items():
            lo, hi = observed[0] if observer == "minmax" else observed[-1]
            if observer == "minmax":
                for sample_lo, sample_hi in observed[1:]:
                    lo, hi = lo * 0.99 + sample_lo * 0.01, hi * 0.99 + sample_hi * 0.01
            assert scales[-1][e] == pytest.approx(max(-lo, hi) / 448.0, rel=1e-6), (batch_size, e)
    assert scales[0] == scales[1] == scales[2]


def test_fp8_static_with_calibrate_all_experts_on_bfloat16(tmp_path, caplog):
    """Found by a tester: a bfloat16 model's expert input scales were saved float32 (a Linear's are bfloat16), and
    the warning said 'routed' with calibrate_all_experts. Now each expert's input_scale has the weight's dtype, as the
    dense Linears' do; with every token through every expert, the gate_proj scales of a layer are equal (the same
    inputs) and the warning says so; the reload gives the in-memory logits."""
    build("qwen3_moe").to(torch.bfloat16).save_pretrained(tmp_path / "src")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16).eval()
    recipe = {"s": {"QuantizationModifier": {
        "scheme": "FP8", "calibrate_all_experts": True, "ignore": ["lm_head", "re:.*mlp.gate$"]}}}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="llmc_fsm_quantization"):
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    assert "each expert's input_scale is calibrated on every calibration token (calibrate_all_experts) and" in (
        caplog.text
    )
    dense = model.model.layers[0].self_attn.q_proj.input_scale
    assert dense.dtype == torch.bfloat16
    for name, module in _experts_modules(model).items():
        views = weight_views(module)
        assert {v.quantized_params["input_scale"].dtype for v in views.values()} == {torch.bfloat16}
        gates = {float(views[f"{e}.gate_proj"].quantized_params["input_scale"]) for e in range(4)}
        assert len(gates) == 1, name
    with safe_open(str(sorted((tmp_path / "o").glob("*.safetensors"))[0]), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.experts.1.up_proj.input_scale").dtype == torch.bfloat16
    reloaded, _ = _reload(tmp_path / "o", "qwen3_moe")
    with torch.no_grad():
        assert torch.equal(reloaded(DATA[:2]).logits, model(DATA[:2]).logits)


def test_fp8_static_gives_an_expert_without_routed_tokens_the_largest_scale_of_its_projection(tmp_path, caplog):
    """DeepSeek-V3 with expert 3 never routed, the FP8 preset: expert 3's matrices are rounded to nearest and each
    takes, as its static input scale, the largest calibrated one of the same projection in its layer (the one value
    vLLM applies to all experts of a fused projection); the warning says so; the reload's logits equal the in-memory
    model's."""
    model = build("deepseek_v3")
    _never_route_expert_3(model)
    experts = _experts_modules(model)
    recipe = {"s": {"GPTQModifier": {"scheme": "FP8", "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    with caplog.at_level(logging.WARNING):
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    assert (
        "nearest (no input statistics; set calibrate_all_experts: true to calibrate them on every token); their "
        "static input scale: the largest of the same projection's calibrated experts" in caplog.text
    )
    for name, module in experts.items():
        views = weight_views(module)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            others = [v.quantized_params["input_scale"] for s, v in views.items() if s.endswith(proj) and s[0] != "3"]
            assert views[f"3.{proj}"].routed_tokens == 0
            assert torch.equal(views[f"3.{proj}"].quantized_params["input_scale"], max(others)), (name, proj)
            assert len({float(t) for t in others}) > 1  # the calibrated experts differ: the maximum is a choice
    reloaded, _ = _reload(tmp_path / "o", "deepseek_v3")
    with torch.no_grad():
        assert torch.equal(reloaded(DATA[:2]).logits, model(DATA[:2]).logits)


def test_nvfp4_gives_an_expert_without_routed_tokens_the_smallest_input_global_scale_of_its_projection(
    tmp_path, caplog
):
    """Found by a tester on DeepSeek-V4 (a hash router left experts idle): NVFP4 on fused experts raised
    AttributeError when an expert got no calibration token. DeepSeek-V3 in bfloat16 with expert 3 never routed:
    expert 3's matrices take the smallest calibrated NVFP4 input global scale of the same projection in their layer
    (448 * 6 / max|x|: the largest input range, as FP8's largest input scale), the warning says so, and it is
    saved under expert 3's names."""
    model = build("deepseek_v3").to(torch.bfloat16)
    _never_route_expert_3(model)
    experts = _experts_modules(model)
    recipe = {"s": {"QuantizationModifier": {"scheme": "NVFP4", "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    with caplog.at_level(logging.WARNING):
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    assert (
        "nearest (no input statistics; set calibrate_all_experts: true to calibrate them on every token); their "
        "NVFP4 input global scale: the smallest of the same projection's calibrated experts" in caplog.text
    )
    saved = _saved(tmp_path / "o")
    for name, module in experts.items():
        views = weight_views(module)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            others = [v.quantized_params["input_global_scale"] for s, v in views.items()
                      if s.endswith(proj) and s[0] != "3"]  # fmt: skip
            idle = views[f"3.{proj}"].quantized_params["input_global_scale"]
            assert views[f"3.{proj}"].routed_tokens == 0
            assert torch.equal(idle, min(others)), (name, proj)
            assert len({float(t) for t in others}) > 1  # the calibrated experts differ: the minimum is a choice
            assert torch.equal(saved[f"{name}.3.{proj}.input_global_scale"], idle)


#: Kimi-K2-style non-uniform quantization: FP8 (dynamic inputs) on attention, int4 g16 weight-only on the experts
MIXED = {
    "attention": {"targets": ["re:.*self_attn\\..*"], "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}, "input_activations": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}},
    "experts": {"targets": ["re:.*\\.experts\\..*"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}},
}  # fmt: skip


@pytest.mark.parametrize("modifier", ["QuantizationModifier", "GPTQModifier"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_config_groups_with_one_group_for_the_experts_reload(tmp_path, family, modifier):
    """Several config groups, the experts in one of them (before: refused): the saved config gives the experts a
    group of their scheme targeting their per-expert checkpoint names with a re: pattern, which is the group
    transformers 5.25's experts loader takes for them (get_experts_scheme), the attention its group by name; format
    mixed-precision. Round-to-nearest: every expert matrix equals int4 g16 rounding by hand; the attention Linears
    carry FP8 scales; the reload has no missing or unexpected key and the in-memory experts and logits."""
    from transformers.integrations.compressed_tensors import get_experts_scheme

    model = build(family)
    experts = _experts_modules(model)
    originals = {f"{n}.{s}": v.weight.detach().clone() for n, m in experts.items() for s, v in weight_views(m).items()}
    recipe = {"s": {modifier: {"config_groups": MIXED, "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "o").quantization_config
    assert config["format"] == "mixed-precision"
    names = "w1|w2|w3" if family == "mixtral" else "down_proj|gate_proj|up_proj"
    groups = {g["format"]: g["targets"] for g in config["config_groups"].values()}
    assert groups["pack-quantized"] == [f"re:.*\\.experts\\.\\d+\\.({names})$"]
    attention = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".self_attn." in n]
    assert groups["float-quantized"] == sorted(attention)  # by name: a class target ("Linear") would also name
    # every expert's matrix, two groups for one module (a breaker's case: llmc-fsm itself refused the saved config)
    ct_config = transformers.utils.quantization_config.CompressedTensorsConfig.from_dict(config).quantization_config
    assert get_experts_scheme(ct_config).weights.num_bits == 4  # the group transformers reloads the experts with
    assert model.model.layers[0].self_attn.q_proj.weight_scale.shape == (model.config.num_attention_heads * 16, 1)
    if modifier == "QuantizationModifier":
        for name, module in experts.items():
            for suffix, view in weight_views(module).items():
                assert torch.equal(view.weight, _rtn(originals[f"{name}.{suffix}"])), f"{name}.{suffix}"
    _assert_reloads_as_in_memory(tmp_path / "o", family, model, experts)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_an_embedding_target_beside_fused_experts_reloads(tmp_path, family):
    """Found by a tester: targets [Linear, Embedding] on a MoE model saved the embedding's group (int-quantized)
    first, and transformers' experts loader took that group's format for the experts: the reload failed
    (KeyError 'weight', the fused experts missing). The experts now get their own group; reload equal."""
    model = build(family)
    experts = _experts_modules(model)
    recipe = {"s": {"QuantizationModifier": {"targets": ["Linear", "Embedding"], "scheme": SCHEME}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    assert hasattr(model.model.embed_tokens, "weight_scale")
    _assert_reloads_as_in_memory(tmp_path / "o", family, model, experts)


def test_expert_matrices_in_groups_of_different_schemes_are_refused(tmp_path):
    """transformers reloads every expert of the model with one scheme: expert 0 in a W4A16 group and the others in a
    W8A16 group is refused before any work, naming both groups."""
    groups = {
        "first": {"targets": ["re:.*\\.experts\\.0\\..*"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}},
        "rest": {"targets": ["re:.*\\.experts\\.[1-3]\\..*"], "weights": {
            "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}},
    }  # fmt: skip
    model = build("qwen3_moe")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = {"s": {"QuantizationModifier": {"config_groups": groups, "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    assert str(info.value) == (
        "QuantizationModifier: Qwen3MoeForCausalLM (model_type 'qwen3_moe'): the fused experts' matrices are in "
        "several config groups (first, rest): transformers reloads every expert of the model with one group's "
        "scheme; put all expert matrices in one config group"
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "o").exists()


def _qwen3_moe_refusal(tmp_path, preset: str) -> str:
    """The message of QuantizationModifier ``preset`` refused on the tiny float32 Qwen3-MoE; the weights are
    unchanged and nothing is written."""
    model = build("qwen3_moe")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = {"s": {"QuantizationModifier": {"scheme": preset, "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "o").exists()
    return str(info.value)


def test_fp8_experts_are_refused_before_any_work_where_transformers_reads_packed_int_experts_only(
    tmp_path, monkeypatch
):
    """transformers 5.24's experts loader read packed int weights only (its FP8 path came in 5.25)."""
    import llmc_fsm.toolkit.packed as packed

    monkeypatch.setattr(packed, "_transformers_version", lambda: "5.24.0")
    assert _qwen3_moe_refusal(tmp_path, "FP8_DYNAMIC") == (
        "QuantizationModifier: Qwen3MoeForCausalLM (model_type 'qwen3_moe'): fused experts "
        "model.layers.{0..3}.mlp.experts: FP8 expert weights reload from transformers 5.25 on (installed: 5.24.0, "
        "whose experts loader reads packed int weights only): upgrade transformers, or use W4A16 / W8A16" + FOR_VLLM
    )


def test_a_quantized_jamba_calls_dt_proj_as_the_reloaded_one_does(tmp_path):
    """Jamba's mixer calls ``dt_proj`` as a module (so its input quantization runs) only when the config says the
    model is quantized, as transformers marks a model it loads quantized; the quantized in-memory model is marked the
    same way, so that FP8_DYNAMIC's reload gives its logits (before: 0.0079 apart). The mark is not saved."""
    model = build("jamba")
    recipe = {"s": {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head", "re:.*router.*"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    assert model.config._is_quantized is True
    assert "_is_quantized" not in (tmp_path / "o" / "config.json").read_text()
    reloaded, info = _reload(tmp_path / "o", "jamba")
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    with torch.no_grad():
        assert torch.equal(reloaded(DATA[:2]).logits, model(DATA[:2]).logits)


def test_jambas_dt_proj_is_quantized_with_a_kv_cache_as_without_and_the_report_marks_what_gptq_left(tmp_path):
    """Jamba's mixer reads ``dt_proj.weight @ x`` until the model is quantized, so calibration never reaches it. A
    breaker found round-to-nearest FP8_DYNAMIC quantizing it data-free but leaving it float32 once a KV-cache scheme
    made the run calibrate (llm-compressor quantizes it either way), and GPTQ's report labelling the layer "8b/g8"
    over the dt_proj weights it left as they were. Now a target whose scheme needs no input statistics is rounded
    without them, and a layer with targeted weights left unquantized is marked with a footnote."""
    from llmc_fsm_quantization import load_kv_cache_scales

    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    weights = {}
    for name, extra in (("data_free", {}), ("kv", {"kv_cache_scheme": kv})):
        model = build("jamba")
        recipe = {"s": {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"], **extra}}}
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / name, progress=False)
        weights[name] = model.model.layers[0].mamba.dt_proj.weight.detach().clone()
        with safe_open(str(sorted((tmp_path / name).glob("*.safetensors"))[0]), "pt") as f:
            assert f.get_tensor("model.layers.0.mamba.dt_proj.weight").dtype == torch.float8_e4m3fn
        reloaded, _ = _reload(tmp_path / name, "jamba")
        load_kv_cache_scales(reloaded, tmp_path / name)
        with torch.no_grad():
            assert torch.equal(reloaded(DATA[:2]).logits, model(DATA[:2]).logits)
    assert torch.equal(weights["kv"], weights["data_free"])

    model = build("jamba")
    scheme = {"preset": "W8A16", "weights": {"group_size": 8}}
    recipe = {"s": {"GPTQModifier": {"scheme": scheme, "ignore": ["lm_head", "re:.*router.*"]}}}
    table = llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, progress=False).llmc_fsm_report.format_table()
    rows = {line.split()[0]: line.split()[3] for line in table.splitlines() if line.split()[:1] in (["0"], ["1"])}
    assert rows == {"0": "int8/g8*", "1": "int8/g8"}  # layer 0: mamba (dt_proj left), layer 1: attention
    assert ("*: weights of the layer a modifier targeted, left unquantized (not quantized by the recipe, or no "
            "calibration input reached them): 2 modules, 2,048 weights ") in table
    assert "model.layers.{0,2}.mamba.dt_proj" in table


@pytest.mark.parametrize("modifier", ["QuantizationModifier", "GPTQModifier"])
@pytest.mark.parametrize(
    ("family", "preset"), [("qwen3_moe", "MXFP4A16"), ("mixtral", "MXFP6A16"), ("qwen3_moe", "MXFP4")]
)
def test_mx_weights_on_fused_experts_hold_what_the_checkpoint_decompresses_to_and_reload(
    tmp_path, family, preset, modifier
):
    """MXFP4A16 / MXFP6A16 on fused experts (llm-compressor's examples/quantization_w4a16_fp4/mxfp4/qwen3_example.py),
    a bfloat16 model loaded from its directory: each expert matrix in memory is what compressed-tensors' compressor
    decompresses its saved tensors to (before: up to 0.015 apart, the fake-quantized values unrounded in bfloat16),
    every scale a power of two; the reload has no missing or unexpected key, the experts and the logits equal.
    MXFP4 (dynamic MX inputs; refused on experts before session 26, DeepSeek-V4's mixed example): the same, the
    attention's inputs quantized in memory and on reload, the experts' by neither (transformers runs them dense)."""
    from compressed_tensors.compressors import BaseCompressor

    build(family).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    cls = getattr(transformers, FAMILIES[family][2] or "AutoModelForCausalLM")
    model = cls.from_pretrained(tmp_path / "src", dtype=torch.bfloat16).eval()
    experts = _experts_modules(model)
    recipe = {"s": {modifier: {"scheme": preset, "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "o").quantization_config
    fmt = config["format"]
    assert fmt == f"mxfp{preset[4]}-pack-quantized"
    compressor = BaseCompressor.get_value_from_registry(fmt)
    with safe_open(str(sorted((tmp_path / "o").glob("*.safetensors"))[0]), "pt") as f:
        for name, module in experts.items():
            for view in weight_views(module).values():
                saved = {k: f.get_tensor(f"{view.checkpoint_name}.{k}") for k in ("weight_packed", "weight_scale")}
                assert saved["weight_scale"].dtype == torch.uint8  # E8M0 exponents: powers of two
                restored = compressor.decompress(dict(saved), view.quantization_scheme)["weight"]
                assert torch.equal(restored, view.weight), view.checkpoint_name
    _assert_reloads_as_in_memory(tmp_path / "o", family, model, experts)


def test_explain_with_a_moe_directory_gives_the_experts_warning_once_as_oneshot_does(tmp_path, caplog):
    """``explain RECIPE --model DIR`` runs oneshot's checks, which give the FP8_DYNAMIC experts warning: once (the
    newcomer of session 15 saw it from oneshot only); oneshot gives it once too (its checks, then initialize)."""
    import json

    from llmc_fsm.cli import main

    build("qwen3_moe").save_pretrained(tmp_path / "moe")
    recipe = tmp_path / "fp8.json"
    stage = {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head", "re:.*mlp.gate$"]}}
    recipe.write_text(json.dumps({"s": stage}))

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if "fused experts' input activations" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="llmc_fsm_quantization"):
        assert main(["explain", str(recipe), "--model", str(tmp_path / "moe")]) == 0
        assert len(warned()) == 1 and warned()[0].startswith(
            "QuantizationModifier: Qwen3MoeForCausalLM (model_type 'qwen3_moe'): fused experts "
            "model.layers.{0..3}.mlp.experts: the fused experts' input activations (per token, dynamic) are not "
            "quantized in memory"
        )
        caplog.clear()
        llmc_fsm.oneshot(
            model=str(tmp_path / "moe"), recipe=str(recipe), dataset=DATA, output_dir=tmp_path / "o", progress=False
        )
        assert len(warned()) == 1


def test_a_scheme_the_experts_cannot_take_is_refused_before_the_model_s_dtype(tmp_path):
    """MXFP8A16 on a float32 MoE model: the experts' refusal comes first (a bfloat16 load would not make it run; the
    newcomer of session 15 got the dtype refusal, then this one, with NVFP4A16, which the experts now take)."""
    assert _qwen3_moe_refusal(tmp_path, "MXFP8A16") == (
        "QuantizationModifier: Qwen3MoeForCausalLM (model_type 'qwen3_moe'): fused experts "
        "model.layers.{0..3}.mlp.experts: symmetric int weights that compressed-tensors packs (pack-quantized: W4A16, "
        "W8A16), MXFP4 / MXFP6 weights (MXFP4A16, MXFP6A16) or symmetric FP8 weights per channel or tensor "
        "(FP8_DYNAMIC) only: transformers rebuilds a checkpoint's experts from their packed weights, scales and shapes "
        "(no zero point) or from fp8 weights times their scales, no other format" + FOR_VLLM
    )


@pytest.mark.parametrize("modifier", ["QuantizationModifier", "GPTQModifier"])
def test_int8_per_channel_experts_in_bfloat16_hold_what_the_checkpoint_decompresses_to_and_reload(tmp_path, modifier):
    """Found on Llama 4's experts: int8 weights per channel rounded with a float32 scale, then saved with the scale in
    bfloat16, left expert entries one bfloat16 ulp off what the checkpoint decompresses to (the reloaded logits
    differed by 0.004). Each expert matrix now holds (q - zero point) * its saved scale: equal to compressed-tensors'
    decompression of the saved tensors, and the reloaded logits equal the in-memory ones."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from llmc_fsm.toolkit import expert_checkpoint_names

    build("qwen3_moe").save_pretrained(tmp_path / "src")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16).eval()
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}
    recipe = {"s": {modifier: {"config_groups": {"g": group}, "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=MORE, output_dir=tmp_path / "o", progress=False)
    saved = _saved(tmp_path / "o")
    (entry,) = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]["config_groups"].values()
    compressor = BaseCompressor.get_value_from_registry(entry["format"])
    scheme = QuantizationScheme.model_validate(entry)
    for name, module in _experts_modules(model).items():
        names = expert_checkpoint_names(model, name, module)
        for suffix, view in weight_views(module).items():
            prefix = names[suffix] + "."
            tensors = {k.removeprefix(prefix): v for k, v in saved.items() if k.startswith(prefix)}
            assert torch.equal(compressor.decompress(tensors, scheme)["weight"], view.weight), f"{name}.{suffix}"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(DATA[:2]).logits, model(DATA[:2]).logits)


def test_low_memory_writes_a_checkpoint_whose_only_quantized_weights_are_experts(tmp_path):
    """Found by a tester: with only fused experts' matrices quantized (targets ``re:.*experts.*``), ``low_memory``
    wrote each layer dense and no ``quantization_config`` (its layer writer and its config step looked at quantized
    modules only), exiting 0. Now in memory, streamed and ``low_memory`` write the same checkpoint tensor for
    tensor, with the experts' weight scales and a quantization_config, and perplexities."""
    from tiny_llama import calibration_text, compress_on_every_path, word_tokenizer

    text = calibration_text()
    (tmp_path / "cal.txt").write_text(text)
    tokenizer = word_tokenizer(text)
    build("mixtral").save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    recipe = {"s": {"QuantizationModifier": {"targets": ["re:.*experts.*"], "scheme": "FP8_DYNAMIC",
                                             "ignore": ["lm_head", "re:.*gate$"]}}}  # fmt: skip
    runs = compress_on_every_path(tmp_path, recipe, tokenizer)
    memory = runs["memory"][1]
    assert sum(k.endswith("weight_scale") for k in memory) == 4 * 4 * 3
    for path in ("streamed", "low_memory"):
        tensors = runs[path][1]
        assert sorted(tensors) == sorted(memory)
        assert all(torch.equal(tensors[k], v) for k, v in memory.items()), path
        assert runs[path][2] == runs["memory"][2]
        assert "quantization_config" in json.loads((tmp_path / path / "config.json").read_text())


@pytest.mark.parametrize("stages", ["one", "two"])
def test_one_modifier_for_the_attention_and_another_for_the_experts_runs_and_reloads(tmp_path, stages):
    """Found by a tester (session 26): FP8_DYNAMIC on the attention in one modifier and GPTQ W4A16 on the experts in
    another (one stage or two) was refused: the first modifier, checked alone, saw the experts left dense. The recipe
    is now checked whole: it runs and reloads with the in-memory logits; two modifiers that both leave the experts
    dense are still refused, with the first one's message, before any work."""
    ignore = ["lm_head", "re:.*mlp.gate$"]
    attention = {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "targets": ["re:.*self_attn.*"], "ignore": ignore}}
    experts = {"GPTQModifier": {"scheme": SCHEME, "targets": ["re:.*experts.*"], "ignore": ignore}}
    recipe = {"s": {**attention, **experts}} if stages == "one" else {"a": attention, "b": experts}
    model = build("qwen3_moe")
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=MORE, output_dir=tmp_path / "o", progress=False)
    _assert_reloads_as_in_memory(tmp_path / "o", "qwen3_moe", model, _experts_modules(model))
    qkv = {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "targets": [r"re:.*self_attn\.[qkv]_proj$"]}}
    out = {"GPTQModifier": {"scheme": SCHEME, "targets": ["re:.*self_attn.o_proj$"]}}
    twice = {"s": {**qkv, **out}} if stages == "one" else {"a": qkv, "b": out}
    model = build("qwen3_moe")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=twice, dataset=MORE, output_dir=tmp_path / "r", progress=False)
    assert str(info.value).startswith(
        "QuantizationModifier: Qwen3MoeForCausalLM (model_type 'qwen3_moe'): the fused experts "
        "model.layers.{0..3}.mlp.experts are not quantized"
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("modifiers", [["GPTQModifier"], ["GPTQModifier", "QuantizationModifier"]])
def test_a_second_run_on_the_attention_keeps_the_experts_an_earlier_run_quantized(tmp_path, modifiers):
    """Experts quantized W4 by a first in-memory run, the attention W8 by a second (one quantizer, or two over
    disjoint modules): the second is not refused as leaving the experts dense; both schemes are saved and the
    checkpoint reloads with the in-memory logits."""
    model = build("qwen3_moe")
    first = {"q": {"QuantizationModifier": {"targets": ["re:.*mlp.experts.*"], "scheme": SCHEME}}}
    llmc_fsm.oneshot(model=model, recipe=first, dataset=DATA, output_dir=tmp_path / "a", progress=False)
    experts = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    eight = {"preset": "W8A16", "weights": {"group_size": 16}}
    patterns = ["re:.*self_attn.(q|k)_proj$", "re:.*self_attn.(v|o)_proj$"][: len(modifiers)]
    if len(modifiers) == 1:
        patterns = ["re:.*self_attn.*"]
    second = {"q": {m: {"targets": [p], "scheme": eight} for m, p in zip(modifiers, patterns, strict=True)}}
    llmc_fsm.oneshot(model=model, recipe=second, dataset=DATA, output_dir=tmp_path / "b", progress=False)
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, experts)
    groups = transformers.AutoConfig.from_pretrained(tmp_path / "b").quantization_config["config_groups"]
    assert {g["weights"]["num_bits"] for g in groups.values()} == {4, 8}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(DATA[:2]).logits, model(DATA[:2]).logits)


@pytest.mark.parametrize("family", ["gpt_oss", "dbrx"])
def test_experts_left_dense_run_where_the_checkpoint_keeps_them_fused(tmp_path, family):
    """GPT-OSS and DBRX keep their experts fused in the checkpoint (no per-expert conversion): their experts cannot
    be quantized, and leaving them out was refused too ("transformers does not reload dense fused experts", measured
    on Mixtral, whose checkpoint holds them per expert): B2, session 31. Dense, they reload as they are."""
    model = build(family)
    experts = [n for n, m in model.named_modules() if weight_views(m)]
    ignore = ["lm_head", "re:.*experts.*", "re:.*router.*"]
    recipe = {"q": {"QuantizationModifier": {"scheme": "W8A8", "ignore": ignore}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, output_dir=tmp_path / "o", progress=False)
    assert experts and all(not any(m.name.startswith(e) and m.bits for m in model.llmc_fsm_report.modules)
                           for e in experts)  # fmt: skip
    reloaded, info = type(model).from_pretrained(tmp_path / "o", output_loading_info=True)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(DATA[:2]).logits, model(DATA[:2]).logits)


def test_a_kv_cache_scheme_alone_is_refused_where_dense_experts_would_not_reload():
    """Mixtral (experts per expert in the checkpoint): kv_cache_scheme alone wrote a checkpoint transformers could
    not load ("We encountered some issues during automatic conversion"), exit 0 (B2, session 31). Refused before
    any work; GPT-OSS (experts kept fused) runs."""
    kv = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
    recipe = {"q": {"QuantizationModifier": {"kv_cache_scheme": kv}}}
    model = build("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, progress=False)
    assert str(info.value).startswith(
        "QuantizationModifier: MixtralForCausalLM (model_type 'mixtral'): kv_cache_scheme alone leaves the fused "
        "experts model.layers.{0..3}.mlp.experts dense, and transformers does not reload dense fused experts from a "
        "compressed-tensors checkpoint"
    )
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    llmc_fsm.oneshot(model=build("gpt_oss"), recipe=recipe, dataset=DATA, progress=False)
