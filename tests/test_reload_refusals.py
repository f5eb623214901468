"""Families whose compressed checkpoints transformers would not reload, refused before any work (B1's cases, session
30).

Zamba and Zamba2 share one transformer block's weights between their hybrid decoder layers (each layer's own
modules hold the same tensors). B1's cases (session 30): the command's default streamed path failed mid-run ("Tensor
on device cpu is not on the expected device meta"), and a quantized checkpoint of the shared block did not reload
("Linear has no attribute 'weight'"; llm-compressor 0.14's neither). The streamed path refuses such a model before
any work (the default then runs in memory) and the quantizers refuse the shared modules, naming them and the fix."""

from __future__ import annotations

import pytest
import torch
from tiny_families import _TEXT

import llmc_fsm
from llmc_fsm.toolkit import weights_shared_across_layers

transformers = pytest.importorskip("transformers")


def _zamba2(directory, adapters=False):
    hybrid = ["linear_attention", "hybrid"] * 2
    heads = {"num_key_value_heads": 4, "attention_head_dim": 32} if adapters else {"attention_head_dim": 16}
    config = transformers.AutoConfig.for_model(
        "zamba2", **{**_TEXT, **heads}, layers_block_type=hybrid, mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8,
        mamba_ngroups=1, num_mem_blocks=1, use_mem_rope=False, use_shared_attention_adapter=adapters, adapter_rank=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if directory is not None:
        model.save_pretrained(directory)
    return model


def test_weights_several_layers_share_are_found_refused_when_streamed_and_when_quantized(tmp_path):
    model = _zamba2(tmp_path / "zamba2")
    shared = weights_shared_across_layers(model.model.layers)
    assert len(shared) == 12 and shared[0] == (
        "1.shared_transformer.self_attn.q_proj.weight", "3.shared_transformer.self_attn.q_proj.weight"
    )
    assert weights_shared_across_layers(transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("llama", **_TEXT)).model.layers) == []  # fmt: skip
    data = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    prune = {"s": {"SparseGPTModifier": {"sparsity": 0.5, "ignore": ["lm_head"]}}}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(str(tmp_path / "zamba2"), prune, dataset=data, low_memory=True, progress=False,
                         output_dir=tmp_path / "low")  # fmt: skip
    assert str(info.value) == (
        "low_memory (--low-memory) cannot run this job: decoder layers of Zamba2ForCausalLM (model_type 'zamba2') "
        "share 12 weights (e.g. model.layers.1.shared_transformer.self_attn.q_proj.weight is "
        "model.layers.3.shared_transformer.self_attn.q_proj.weight), and the streamed path reads and writes each "
        "layer on its own"
    )
    assert not (tmp_path / "low").exists()
    quantize = {"QuantizationModifier": {"scheme": "W8A8", "ignore": ["lm_head"]}}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"s": quantize}, progress=False)
    assert str(info.value).startswith(
        "QuantizationModifier: Zamba2ForCausalLM (model_type 'zamba2'): model.layers.1.shared_transformer.self_attn."
        "q_proj, model.layers.1.shared_transformer.self_attn.k_proj, "
    )
    assert str(info.value).endswith(
        "hold weights that several decoder layers share, which transformers does not reload quantized (the "
        "checkpoint writes them under one layer's names): add them to ignore (e.g. 're:.*shared_transformer.*')"
    )
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    quantize["QuantizationModifier"]["ignore"].append("re:.*shared_transformer.*")
    llmc_fsm.oneshot(model=model, recipe={"s": quantize}, output_dir=tmp_path / "q", progress=False)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    with torch.no_grad():
        assert torch.equal(reloaded(data[:1]).logits, model(data[:1]).logits)


def test_a_shared_weight_whose_own_module_never_runs_is_named_with_the_module_that_does(caplog):
    """Zamba2's per-layer adapters sit in the shared block of every hybrid layer (layer 1 runs adapter 0, layer 3
    adapter 1; each layer's modules hold the same tensors). Pruned in memory, layer 1's adapter 1 (the target) gets
    no input: the warning said only "received no calibration input" of a module that runs (as layer 3's)."""
    model = _zamba2(None, adapters=True)
    data = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    recipe = {"s": {"SparseGPTModifier": {"sparsity": 0.5, "ignore": ["lm_head"]}}}
    with caplog.at_level("WARNING"):
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, progress=False)
    adapter = "shared_transformer.self_attn.linear_q_adapter_list.1.0"
    assert (
        f"SparseGPTModifier: model.layers.1.{adapter} received no calibration input (its weight is also "
        f"model.layers.3.{adapter}'s: a weight several decoder layers share is calibrated where the first of its "
        "modules runs only); left as it was"
    ) in caplog.messages
    sparsity = {m.name: m.zeros / m.numel for m in model.llmc_fsm_report.modules}
    assert sparsity[f"model.layers.1.{adapter}"] == 0 and sparsity[f"model.layers.1.{adapter[:-3]}0.0"] == 0.5


def test_integer_weights_are_refused_on_families_whose_integer_checkpoint_does_not_reload(tmp_path):
    """OLMo-Hybrid (and Kimi-Linear): transformers 5.25 concatenates the q/k/v convolution weights on load, and
    with integer-quantized weights (W4A16 packed, W8A8) finds none ("Concatenate on tensors destined for
    linear_attn.conv1d.weight. Ckpt contains: 0"): the run wrote the checkpoint and exited 0. Refused before any
    work; FP8 runs and reloads with the in-memory logits."""
    config = transformers.AutoConfig.for_model(
        "olmo_hybrid", **_TEXT, layer_types=["linear_attention"] * 3 + ["full_attention"]
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for scheme in ("W8A8", {"preset": "W4A16", "weights": {"group_size": 16}}):
        with pytest.raises(ValueError) as info:
            llmc_fsm.oneshot(model=model, recipe={"s": {"GPTQModifier": {"scheme": scheme, "ignore": ["lm_head"]}}},
                             dataset=torch.randint(3, 128, (4, 16)), progress=False)  # fmt: skip
        assert str(info.value) == (
            "GPTQModifier: OlmoHybridForCausalLM (model_type 'olmo_hybrid'): transformers "
            f"{transformers.__version__} does not reload this family's checkpoint with integer-quantized weights (its "
            "conversion of the q/k/v conv1d weights finds none: 'Concatenate on tensors destined for "
            "linear_attn.conv1d.weight. Ckpt contains: 0'); use a float scheme (FP8, FP8_DYNAMIC), whose checkpoint "
            "reloads, or prune only"
        )
    recipe = {"s": {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, output_dir=tmp_path / "fp8", progress=False)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    data = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(data).logits, model(data).logits)
