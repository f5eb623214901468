"""Fused mixture-of-experts weights and GPT-2's Conv1D pruned through Linear views (issue 24).

Tiny random models from ``tiny_families`` (transformers 5 configs, offline). References are computed in the tests
from the model's own tensors: each expert's routed tokens from the router's own top-k, its matrices sliced from the
fused parameters by hand, statistics in float64.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers
from llmc_fsm_pruning import MagnitudePruningModifier, WandaPruningModifier
from llmc_fsm_pruning.magnitude import magnitude_mask
from llmc_fsm_pruning.wanda import wanda_mask
from tiny_families import FAMILIES, build
from torch.nn import functional as F

import llmc_fsm
from llmc_fsm import Session
from llmc_fsm.pipeline.sequential import run_sequential
from llmc_fsm.toolkit import LinearView, observe_inputs, select_targets, weight_views

DATA = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))


def _experts(model, family):
    """The first fused-experts module of ``family`` and its router."""
    if family == "dbrx":
        ffn = model.transformer.blocks[0].ffn
        return ffn.experts, ffn
    if family == "gpt_oss":
        return model.model.layers[0].mlp.experts, model.model.layers[0].mlp.router
    layer = next(layer for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    return layer.mlp.experts, layer.mlp.gate


def _routing(family, router, hidden):
    """``top_k_index, top_k_weights`` as the family's own router gives them for ``hidden`` ``[tokens, hidden]``."""
    if family == "dbrx":  # router: the DbrxFFN
        weights, index = router.route_tokens_to_experts(router.router(hidden))
        return index, weights
    _, weights, index = router(hidden)
    return index, weights


def _reference_matrices(experts, family, e):
    """Expert ``e``'s (gate, up, down) as ``[out, in]`` Linear weights, sliced from the fused parameters by hand."""
    if family == "dbrx":
        ffn = experts.ffn_hidden_size
        w1, v1, w2 = (getattr(experts.mlp, p)[e * ffn : (e + 1) * ffn] for p in ("w1", "v1", "w2"))
        return w1, v1, w2.T
    if family == "gpt_oss":  # [E, hidden, 2 * inter], gate/up interleaved
        gate_up = experts.gate_up_proj[e].T
        return gate_up[0::2], gate_up[1::2], experts.down_proj[e].T
    inter = experts.down_proj.shape[2]
    return experts.gate_up_proj[e][:inter], experts.gate_up_proj[e][inter:], experts.down_proj[e]


@pytest.mark.parametrize("all_experts", [False, True], ids=["routed", "all-experts"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss", "dbrx"])
def test_observing_experts_leaves_their_output_unchanged_and_feeds_each_expert_its_inputs(family, all_experts):
    """The experts module's output is bit-equal with the observation hook; each view gets exactly its inputs."""
    model = build(family)
    experts, router = _experts(model, family)
    hidden = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        index, weights = _routing(family, router, hidden)
        expected = experts(hidden, index, weights)
    views = weight_views(experts)
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [
        view.register_forward_pre_hook(lambda m, a, n=name: seen.setdefault(n, []).append(a[0]))
        for name, view in views.items()
    ]
    hook = experts.register_forward_pre_hook(
        lambda m, a, k: observe_inputs(m, a, k, all_experts=all_experts), with_kwargs=True
    )
    with torch.no_grad():
        got = experts(hidden, index, weights)
    hook.remove()
    for handle in handles:
        handle.remove()
    assert torch.equal(got, expected)
    prefix = "mlp." if family == "dbrx" else ""
    names = ("w1", "v1", "w2") if family == "dbrx" else ("gate_proj", "up_proj", "down_proj")
    for e in range(4):
        routed = (index == e).any(dim=-1)
        x = hidden if all_experts else hidden[routed]
        gate, up, down = (f"{prefix}{e}.{n}" for n in names)
        assert views[gate].routed_tokens == views[down].routed_tokens == int(routed.sum())
        if x.shape[0] == 0:
            assert gate not in seen
            continue
        assert torch.equal(seen[gate][0], x) and seen[up][0] is seen[gate][0]
        g, u, d = _reference_matrices(experts, family, e)
        assert torch.equal(views[gate].weight, g) and torch.equal(views[up].weight, u)
        assert torch.equal(views[down].weight, d)
        x64 = x.double()
        if family == "gpt_oss":  # its own gate: clamp, sigmoid(alpha * gate), (up + 1)
            b = experts.gate_up_proj_bias[e].double()
            gate_out = (x64 @ g.double().T + b[0::2]).clamp(max=experts.limit)
            up_out = (x64 @ u.double().T + b[1::2]).clamp(-experts.limit, experts.limit)
            inner = (up_out + 1) * gate_out * torch.sigmoid(gate_out * experts.alpha)
        else:
            inner = F.silu(x64 @ g.double().T) * (x64 @ u.double().T)
        torch.testing.assert_close(seen[down][0].double(), inner, rtol=1e-5, atol=1e-5)


def _layer0_expert_inputs(model, family):
    """Per expert of the first MoE layer: the tokens the router sends it on ``DATA``, from the original model."""
    experts, _ = _experts(model, family)
    captured = []
    handle = experts.register_forward_pre_hook(lambda m, a: captured.append((a[0], a[1])))
    with torch.no_grad():
        model(DATA)
    handle.remove()
    hidden = torch.cat([h.reshape(-1, h.shape[-1]) for h, _ in captured])
    index = torch.cat([i.reshape(hidden.shape[0] if len(captured) == 1 else -1, i.shape[-1]) for _, i in captured])
    return hidden, index


@pytest.mark.parametrize("all_experts", [False, True], ids=["routed", "all-experts"])
def test_wanda_prunes_each_expert_from_its_own_input_norms(all_experts):
    """Mixtral layer 0 (its inputs are the original model's): each expert matrix equals Wanda on that expert's own
    tokens (routed, or all with ``calibrate_all_experts``), norms computed here in float64."""
    model = build("mixtral")
    experts, _ = _experts(model, "mixtral")
    hidden, index = _layer0_expert_inputs(model, "mixtral")
    originals = [tuple(w.detach().clone() for w in _reference_matrices(experts, "mixtral", e)) for e in range(4)]
    session = Session([WandaPruningModifier(sparsity=0.5, calibrate_all_experts=all_experts)])
    session.initialize(model=model, calibration_data=DATA)
    run_sequential(session, batch_size=4, progress=False)
    modifier = session.modifiers[0]
    session.finalize()
    for e, (g, u, d) in enumerate(originals):
        routed = (index == e).any(dim=-1)
        x = (hidden if all_experts else hidden[routed]).double()
        inner = F.silu(x @ g.double().T) * (x @ u.double().T)
        norms_in, norms_inner = x.square().sum(0), inner.square().sum(0)
        got = _reference_matrices(experts, "mixtral", e)
        for weight, norms, new in ((g, norms_in, got[0]), (u, norms_in, got[1]), (d, norms_inner, got[2])):
            assert torch.equal(new, weight * wanda_mask(weight, norms.float(), 0.5))
        for n in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.0.mlp.experts.{e}.{n}"
            assert modifier.routed_tokens[name] == int(routed.sum())
            assert modifier.results[name].samples == x.shape[0]
            assert modifier.results[name].sparsity == 0.5


def test_an_expert_the_router_never_picks_is_named_and_left_unless_all_experts_calibrate(tmp_path, caplog):
    """GPT-OSS (interleaved, transposed, biased experts) with expert 3's router bias at -1e4: no routed token. It is
    named in a warning, left as it was and counted at 0% in the report's sparsity; with calibrate_all_experts it is
    pruned from every token and its routed count stays 0."""
    model = build("gpt_oss")
    for layer in model.model.layers:
        with torch.no_grad():
            layer.mlp.router.bias[3] = -1e4
    before = model.model.layers[0].mlp.experts.down_proj[3].clone()
    recipe = {"s": {"SparseGPTModifier": {"sparsity": 0.5}}}
    with caplog.at_level(logging.WARNING):
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "a", progress=False)
    idle = [f"model.layers.{i}.mlp.experts.3.{n}" for i in range(4) for n in ("gate_proj", "up_proj", "down_proj")]
    assert f"the router sent no calibration token to 3 expert matrices: {', '.join(idle[:3])}; left as they were" in (
        caplog.text
    )
    assert torch.equal(model.model.layers[0].mlp.experts.down_proj[3], before)
    report = model.llmc_fsm_report
    by_name = {m.name: m for m in report.modules}
    assert set(idle) <= set(report.targeted) and all(by_name[n].zeros == 0 for n in idle)
    pruned = [m for m in report.modules if m.name in set(report.targeted) and m.name not in idle]
    total = sum(m.numel for m in report.modules if m.name in set(report.targeted))
    assert report.total_sparsity == sum(m.zeros for m in pruned) / total < 0.5
    assert all(by_name[n].routed_tokens == 0 for n in idle)
    assert all(by_name[m.name].routed_tokens > 0 for m in pruned if ".experts." in m.name)
    layers = "{0..3}"
    assert (
        f"no routed token: model.layers.{layers}.mlp.experts.3.gate_proj, model.layers.{layers}.mlp.experts.3.up_proj, "
        f"model.layers.{layers}.mlp.experts.3.down_proj, left as they were (no calibration input) (report.json: "
        "routed_tokens)"
    ) in report.format_table()
    entries = {m["name"]: m for m in report.to_dict()["sparsity"]["modules"]}
    assert entries[idle[0]]["routed_tokens"] == 0 and "routed_tokens" not in entries["model.layers.0.self_attn.q_proj"]
    model = build("gpt_oss")
    for layer in model.model.layers:
        with torch.no_grad():
            layer.mlp.router.bias[3] = -1e4
    recipe = {"s": {"SparseGPTModifier": {"sparsity": 0.5, "calibrate_all_experts": True}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "b", progress=False)
    assert model.llmc_fsm_report.total_sparsity == 0.5


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "dbrx", "gpt_oss", "deepseek_v3", "qwen3_next", "gpt2"])
def test_sparsegpt_prunes_every_expert_and_conv1d_and_the_output_reloads(tmp_path, family):
    """Every expert matrix (and every Conv1D) 50% sparse, counted in the report; saved in the fused layout:
    transformers reloads every key and gives the in-memory logits."""
    model = build(family)
    llmc_fsm.oneshot(
        model=model, recipe={"s": {"SparseGPTModifier": {"sparsity": 0.5}}}, dataset=DATA,
        output_dir=tmp_path / "o", progress=False,
    )  # fmt: skip
    report = model.llmc_fsm_report
    views = {
        f"{n}.{s}" if s else n: v for n, m in model.named_modules() for s, v in weight_views(m).items()
    }  # fmt: skip
    assert views and set(views) <= set(report.targeted)
    for name, view in views.items():
        weight = view.weight
        assert weight.numel() - int(torch.count_nonzero(weight)) == weight.numel() // 2, name
    assert report.total_sparsity == 0.5
    cls = getattr(transformers, FAMILIES[family][2] or "AutoModelForCausalLM")
    reloaded, info = cls.from_pretrained(tmp_path / "o", output_loading_info=True)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(DATA[:2]).logits, model(DATA[:2]).logits)


def test_longcat_router_over_routed_and_zero_experts_is_ignored_and_the_rest_quantized(tmp_path):
    """LongCat-Flash's router (mlp.router.classifier: 4 routed + 2 zero-compute experts = 6 rows) is kept dense as a
    router; every expert matrix is quantized; the checkpoint names it in ignore and reloads with the in-memory logits."""
    model = build("longcat_flash")
    router = "model.layers.0.mlp.router.classifier"
    assert model.get_submodule(router).weight.shape[0] == 6
    selection = select_targets(model, ["Linear"], ["lm_head"], views=True)
    assert selection.ignored[router] == "router of a mixture-of-experts layer"
    before = {n: model.get_submodule(f"model.layers.{n}.mlp.router.classifier").weight.clone() for n in (0, 1)}
    recipe = {"q": {"GPTQModifier": {"targets": ["Linear"], "ignore": ["lm_head"],
                                     "scheme": {"preset": "W4A16", "weights": {"group_size": 16}}}}}  # fmt: skip
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    for n, weight in before.items():
        assert torch.equal(model.get_submodule(f"model.layers.{n}.mlp.router.classifier").weight, weight)
    quantized = {m.name: m.bits for m in model.llmc_fsm_report.modules}
    assert quantized["model.layers.1.mlp.experts.3.down_proj"] == 4 and quantized[router] is None
    config = transformers.AutoConfig.from_pretrained(tmp_path / "o").quantization_config
    assert {router, "model.layers.1.mlp.router.classifier"} <= set(config["ignore"])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(DATA[:2]).logits, model(DATA[:2]).logits)


def test_magnitude_prunes_each_expert_matrix_on_its_own():
    model = build("qwen3_moe")
    experts, _ = _experts(model, "qwen3_moe")
    originals = [tuple(w.detach().clone() for w in _reference_matrices(experts, "qwen3_moe", e)) for e in range(4)]
    session = Session([MagnitudePruningModifier(sparsity=0.5)])
    session.initialize(model=model)
    session.calibration_start()
    session.calibration_end()
    session.finalize()
    for e, old in enumerate(originals):
        for weight, new in zip(old, _reference_matrices(experts, "qwen3_moe", e), strict=True):
            assert torch.equal(new, weight * magnitude_mask(weight, 0.5))


def test_wanda_prunes_conv1d_as_its_transposed_linear():
    """GPT-2's c_attn (weight [in, out]) is pruned per output row of its transpose from ln_1's output norms."""
    model = build("gpt2")
    conv = model.transformer.h[0].attn.c_attn
    inputs = []
    handle = conv.register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
    with torch.no_grad():
        model(DATA)
    handle.remove()
    old = conv.weight.detach().clone()
    norms = torch.cat([x.reshape(-1, 64) for x in inputs]).double().square().sum(0).float()
    session = Session([WandaPruningModifier(sparsity=0.5)])
    session.initialize(model=model, calibration_data=DATA)
    run_sequential(session, batch_size=4, progress=False)
    session.finalize()
    assert torch.equal(conv.weight, (old.T * wanda_mask(old.T, norms, 0.5)).T)
    assert session.modifiers[0].results["transformer.h.0.attn.c_attn"].sparsity == 0.5


def test_routers_are_ignored_by_default_and_views_not_registered():
    """DBRX's router is an nn.Linear: ignored as a router unless named exactly; views add no module or key."""
    model = build("dbrx")
    keys = list(model.state_dict())
    modules = [n for n, _ in model.named_modules()]
    selection = select_targets(model, ["Linear"], ["lm_head"], views=True)
    router = "transformer.blocks.0.ffn.router.layer"
    assert selection.ignored[router] == "router of a mixture-of-experts layer"
    assert router not in selection.selected
    assert isinstance(selection.selected["transformer.blocks.0.ffn.experts.mlp.3.w2"], LinearView)
    named = select_targets(model, [router], [], views=True)
    assert list(named.selected) == [router]
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_modules()] == modules
    copied = copy.deepcopy(model)  # the cached views follow the copy's own parameters
    view = weight_views(copied.transformer.blocks[0].ffn.experts)["mlp.1.w2"]
    assert view.owner is copied.transformer.blocks[0].ffn.experts.mlp
    assert view.weight.data_ptr() == copied.transformer.blocks[0].ffn.experts.mlp.w2.data_ptr() + 32 * 64 * 4
    only = select_targets(model, ["re:.*experts.mlp.1.v1$"], [], views=True)
    assert list(only.selected) == [
        "transformer.blocks.0.ffn.experts.mlp.1.v1",
        "transformer.blocks.1.ffn.experts.mlp.1.v1",
    ]
    ignored = select_targets(model, ["Linear"], ["lm_head", "transformer.blocks.0.ffn.experts"], views=True)
    assert not any(n.startswith("transformer.blocks.0.ffn.experts") for n in ignored.selected)
    assert "transformer.blocks.1.ffn.experts.mlp.0.w1" in ignored.selected


def test_quantizing_conv1d_is_refused_before_any_work_saying_why(tmp_path):
    """GPT-2's Conv1D: refused by the quantizers, naming the modules and why (fused experts are quantized per expert:
    tests/test_expert_quantization.py)."""
    from llmc_fsm_quantization._base import CONV1D_REFUSAL

    model = build("gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = {"s": {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}}}}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    assert str(info.value) == (
        "GPTQModifier: GPT2LMHeadModel (model_type 'gpt2') keeps transformer.h.{0..3}.attn.c_attn, transformer.h."
        "{0..3}.attn.c_proj, transformer.h.{0..3}.mlp.c_fc, transformer.h.{0..3}.mlp.c_proj as transformers Conv1D: "
        + CONV1D_REFUSAL
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "o").exists()


def test_compressed_tensors_cannot_quantize_a_conv1d():
    """The measured reason of the Conv1D refusal (fails, and the refusal should go, once compressed-tensors can):
    its initializer refuses a Conv1D, and applying a config that targets one (what transformers does on reload)
    leaves it without quantization parameters."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization

    scheme = QuantizationScheme(
        targets=["re:.*c_attn$"], weights=QuantizationArgs(num_bits=4, type="int", strategy="channel", symmetric=True)
    )
    model = build("gpt2")
    conv = model.transformer.h[0].attn.c_attn
    with pytest.raises(
        ValueError,
        match=r"^Quantization of module type <class 'transformers.pytorch_utils.Conv1D'> "
        r"is not supported$",
    ):
        initialize_module_for_quantization(conv, scheme, force_zero_point=True)
    fresh = build("gpt2")
    apply_quantization_config(fresh, QuantizationConfig(config_groups={"g": scheme}, format="pack-quantized"))
    assert not any(hasattr(m, "weight_scale") for m in fresh.modules())


def test_low_memory_prunes_conv1d_like_in_memory_and_refuses_a_checkpoint_without_the_experts_saying_why(tmp_path):
    """GPT-2 streamed from disk gives the in-memory weights (mixture-of-experts checkpoints stream too:
    tests/test_architectures_streamed_experts.py); a Mixtral checkpoint that lacks expert tensors is refused before
    any work, naming them."""
    from safetensors.torch import load_file, save_file

    recipe = {"s": {"SparseGPTModifier": {"sparsity": 0.5}}}
    build("gpt2").save_pretrained(tmp_path / "gpt2")
    in_memory = build("gpt2")
    llmc_fsm.oneshot(model=in_memory, recipe=recipe, dataset=DATA, output_dir=tmp_path / "a", progress=False)
    llmc_fsm.oneshot(
        model=str(tmp_path / "gpt2"), recipe=recipe, dataset=DATA, output_dir=tmp_path / "b", progress=False,
        low_memory=True,
    )  # fmt: skip
    streamed = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    assert all(torch.equal(v, streamed.state_dict()[k]) for k, v in in_memory.state_dict().items())
    build("mixtral").save_pretrained(tmp_path / "mixtral")
    path = tmp_path / "mixtral" / "model.safetensors"
    tensors = load_file(path)
    save_file({k: v for k, v in tensors.items() if ".experts.3." not in k}, path, metadata={"format": "pt"})
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(
            model=str(tmp_path / "mixtral"), recipe=recipe, dataset=DATA, output_dir=tmp_path / "c", progress=False,
            low_memory=True,
        )  # fmt: skip
    assert str(info.value).startswith(
        f"{tmp_path / 'mixtral'}: the checkpoint does not match the model its config.json describes (other shapes: "
        "model.layers.0.mlp.experts.gate_up_proj [3, 256, 64] (the config gives [4, 256, 64])"
    )
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_pattern_naming_one_fused_parameter_selects_only_that_parameters_expert_matrices(family):
    """``re:.*\\.down_proj$`` matched the fused experts module through its ``down_proj`` parameter, and the whole
    module was selected: every expert's gate and up matrices were pruned / quantized too (a breaker's case). Now a
    pattern that matches the module only through a parameter's name selects that parameter's views, as target and as
    ignore; one naming the module itself (``re:.*experts$``) still selects all of them."""
    from llmc_fsm.toolkit.targets import select_targets

    model = build(family)

    def kinds(selection):
        return sorted({name.rsplit(".", 1)[1] for name in selection.selected if ".experts." in name})

    down = select_targets(model, [r"re:.*\.down_proj$"], ["lm_head"], views=True)
    assert kinds(down) == ["down_proj"]
    assert len([n for n in down.selected if ".experts." in n]) == 4 * model.config.num_local_experts
    rest = select_targets(model, ["Linear"], ["lm_head", r"re:.*\.down_proj$"], views=True)
    assert kinds(rest) == ["gate_proj", "up_proj"]
    whole = select_targets(model, [r"re:.*mlp\.experts$"], [], views=True)
    assert kinds(whole) == ["down_proj", "gate_proj", "up_proj"]
