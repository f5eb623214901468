"""Every architecture: decoder layers found from the model's structure, and each layer's own inputs.

Tiny random models of each family (tests/tiny_families.py, built offline from transformers configs).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_families import batches, build

from llmc_fsm.models.layers import UnsupportedArchitectureError, find_decoder_layers
from llmc_fsm.pipeline.forward import LayerKwargs, capture_layer_inputs, first_output, with_hidden

#: family -> (decoder layers' qualified name, number, classes of its blocks)
LAYERS = {
    "llama": ("model.layers", 4, {"LlamaDecoderLayer"}),
    "gpt2": ("transformer.h", 4, {"GPT2Block"}),
    "gpt_neox": ("gpt_neox.layers", 4, {"GPTNeoXLayer"}),
    "falcon": ("transformer.h", 4, {"FalconDecoderLayer"}),
    "dbrx": ("transformer.blocks", 2, {"DbrxBlock"}),
    "jamba": ("model.layers", 4, {"JambaMambaDecoderLayer", "JambaAttentionDecoderLayer"}),
    "qwen2_vl": ("model.language_model.layers", 4, {"Qwen2VLDecoderLayer"}),
    "llava": ("model.language_model.layers", 4, {"LlamaDecoderLayer"}),
    "mistral3": ("model.language_model.layers", 4, {"MistralDecoderLayer"}),
    "gemma3_vlm": ("model.language_model.layers", 4, {"Gemma3DecoderLayer"}),
    "mllama": (
        "model.language_model.layers",
        4,
        {"MllamaSelfAttentionDecoderLayer", "MllamaCrossAttentionDecoderLayer"},
    ),
}


@pytest.mark.parametrize("family", sorted(LAYERS))
def test_decoder_layers_are_the_text_decoders(family):
    """The language model's layers, not the vision tower's (which has more blocks: 6), mixed classes allowed."""
    model = build(family)
    name, layers = find_decoder_layers(model)
    expected_name, count, classes = LAYERS[family]
    assert name == expected_name
    assert layers is model.get_submodule(expected_name)
    assert len(layers) == count
    assert {type(layer).__name__ for layer in layers} == classes


def test_whisper_gets_its_decoder_layers_not_the_larger_encoder():
    config = transformers.WhisperConfig(
        vocab_size=128, d_model=32, encoder_layers=3, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip
    model = transformers.WhisperForConditionalGeneration(config)
    name, layers = find_decoder_layers(model)
    assert name == "model.decoder.layers"
    assert layers is model.model.decoder.layers and len(layers) == 2


def test_qwen2_audio_gets_its_language_model_layers_not_the_audio_encoder():
    config = transformers.Qwen2AudioConfig(
        audio_config={"d_model": 32, "encoder_layers": 6, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                      "num_mel_bins": 8, "max_source_positions": 16},
        text_config={"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128},
    )  # fmt: skip
    model = transformers.Qwen2AudioForConditionalGeneration(config)
    name, layers = find_decoder_layers(model)
    assert name == "language_model.layers" or name == "model.language_model.layers"
    assert layers is model.get_decoder().layers and len(layers) == 2


def test_a_decoder_without_a_layer_list_is_refused_naming_the_family():
    class Decoderless(transformers.PreTrainedModel):
        config_class = transformers.LlamaConfig

        def __init__(self, config):
            super().__init__(config)
            self.proj = torch.nn.Linear(4, 4)

    model = Decoderless(transformers.LlamaConfig(num_hidden_layers=2))
    with pytest.raises(UnsupportedArchitectureError) as info:
        find_decoder_layers(model)
    assert str(info.value) == (
        "cannot find the decoder layers of Decoderless (model_type 'llama'): its decoder (get_decoder()) holds no "
        "nn.ModuleList named layers, h, blocks, layer, decoder_layers; the sequential pipeline needs one"
    )


def _layer_by_layer(layers, inputs):
    """The pipeline's uncompressed forward: each layer on the inputs, its outputs the next layer's inputs."""
    for index, layer in enumerate(layers):
        outputs = [layer(*args, **kwargs) for args, kwargs in inputs]
        if index + 1 < len(layers):
            inputs = with_hidden(inputs, outputs)
    return [first_output(out) for out in outputs]


def _model_last_layer_outputs(model, layers, data):
    seen = []
    handle = layers[-1].register_forward_hook(lambda module, args, output: seen.append(first_output(output)))
    try:
        for batch in data:
            model(**batch, use_cache=False)
    finally:
        handle.remove()
    return seen


#: mixed-attention families: sliding-window and full attention layers (Gemma 3: local and global rope too)
MIXED = ["gemma2", "gemma3", "gemma3_vlm", "cohere2", "exaone4", "olmo3", "gpt_oss"]
#: hybrid stacks and mixture-of-experts: layers of several kinds
OTHERS = ["llama", "gpt2", "gpt_neox", "falcon", "jamba", "nemotron_h", "falcon_h1", "qwen3_next", "mixtral",
          "qwen3_moe", "deepseek_v3", "dbrx", "qwen2_vl", "llava", "mistral3", "llava_pixtral", "idefics3",
          "qwen2_audio", "bamba", "bloom", "gpt_bigcode", "mamba2", "deepseek_v4", "glm5", "qwen3_5_moe"]  # fmt: skip


@pytest.mark.parametrize("family", MIXED + OTHERS)
def test_layer_by_layer_forward_equals_the_models_own(family):
    """Each layer gets the mask / rope / cache arguments the model's own forward gives it: same last-layer output."""
    model = build(family)
    _, layers = find_decoder_layers(model)
    data = batches(length=24)  # longer than the sliding window (8)
    with torch.no_grad():
        expected = _model_last_layer_outputs(model, layers, data)
        inputs = capture_layer_inputs(model, layers[0], data)
        assert all(isinstance(kwargs, LayerKwargs) for _, kwargs in inputs)
        got = _layer_by_layer(layers, inputs)
        for out, ref in zip(got, expected, strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        if family in MIXED:  # layer 0's arguments for every layer (the old capture) is measurably wrong
            stale = _layer_by_layer(layers, [(args, dict(kwargs)) for args, kwargs in inputs])
            worst = max(float((s - r).abs().max() / r.abs().max()) for s, r in zip(stale, expected, strict=True))
            assert worst > 1e-3


def test_capture_stubs_are_removed_and_layers_untouched():
    model = build("gemma2")
    _, layers = find_decoder_layers(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        capture_layer_inputs(model, layers[0], batches(num=1))
    assert all("forward" not in layer.__dict__ for layer in layers)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_layer_the_models_forward_skips_is_refused_before_any_work():
    """Mllama's cross-attention layer does not run without images: refused with the family and the reason."""
    model = build("mllama")
    _, layers = find_decoder_layers(model)
    with pytest.raises(RuntimeError) as info, torch.no_grad():
        capture_layer_inputs(model, layers[0], batches(num=1))
    assert str(info.value) == (
        "the forward of MllamaForConditionalGeneration (model_type 'mllama') skips decoder layers [1] (counted from "
        "the first captured) on these calibration inputs; the sequential pipeline cannot calibrate a layer the model "
        "does not run (e.g. cross-attention layers without their image inputs)"
    )
    assert all("forward" not in layer.__dict__ for layer in layers)


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_a_model_unpacking_its_layers_outputs_is_captured_at_any_batch_size(rows):
    """Bamba's forward unpacks each layer's ``(hidden_states, attn_weights)``: the capture's stub returns as many items
    as the layer's annotation says (before, a bare tensor: unpacked along the batch, an error at 1 or 3 rows, a
    silently wrong split at 2)."""
    model = build("bamba")
    _, layers = find_decoder_layers(model)
    data = batches(rows=rows, length=16)
    with torch.no_grad():
        expected = _model_last_layer_outputs(model, layers, data)
        got = _layer_by_layer(layers, capture_layer_inputs(model, layers[0], data))
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("indexers", [["full", "full"], ["full", "shared"]])
def test_a_layer_given_the_previous_layers_other_output_gets_it_from_the_pipeline(indexers):
    """GLM-5 (``glm_moe_dsa``) passes each layer's ``topk_indices`` to the next as ``prev_topk_indices``, which a
    ``"shared"`` indexer layer reads: the pipeline carries it from each layer's output to the next layer's arguments
    (before: refused; a tester found the all-``"full"`` model, which never reads it, refused too). The last layer's
    output equals the model's own, also where the shared layer's ``topk_indices`` decide its attention."""
    model = build("glm_moe_dsa", indexer_types=indexers)
    _, layers = find_decoder_layers(model)
    data = batches(rows=3, length=24)
    with torch.no_grad():
        expected = _model_last_layer_outputs(model, layers, data)
        got = _layer_by_layer(layers, capture_layer_inputs(model, layers[0], data))
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if indexers[1] == "shared":  # without the carried indices the shared layer computes something else
        inputs = capture_layer_inputs(model, layers[0], data)
        with torch.no_grad():
            first = [layers[0](*args, **kwargs) for args, kwargs in inputs]
            nxt = with_hidden(inputs, first)
            other = [(args, {**kwargs, "prev_topk_indices": torch.zeros_like(kwargs["prev_topk_indices"])})
                     for args, kwargs in nxt]  # fmt: skip
            wrong = [first_output(layers[1](*args, **kwargs)) for args, kwargs in other]
        assert max(float((w - r).abs().max()) for w, r in zip(wrong, expected, strict=True)) > 1e-3


def test_glm5_with_a_shared_indexer_layer_is_compressed_alike_on_every_path_and_reloads(tmp_path):
    """GPTQ W4A16 on the tiny GLM-5 whose layer 1 reuses layer 0's ``topk_indices``: in memory, streamed from the
    directory (the default) and ``low_memory`` give the same checkpoint tensor for tensor and the same perplexity
    before and after (the streamed evaluation's layer stand-ins return the ``(hidden_states, topk_indices)`` pair the
    model unpacks: it raised "not enough values to unpack"); the reload's logits equal the in-memory model's."""
    from tiny_llama import calibration_text, compress_on_every_path, word_tokenizer

    text = calibration_text()
    (tmp_path / "cal.txt").write_text(text)
    tokenizer = word_tokenizer(text)
    build("glm_moe_dsa", indexer_types=["full", "shared"]).save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    recipe = {"s": {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}},
                                     "ignore": ["lm_head", "re:.*mlp.gate$"]}}}  # fmt: skip
    runs = compress_on_every_path(tmp_path, recipe, tokenizer)
    tensors = {path: run[1] for path, run in runs.items()}
    ppl = {path: run[2] for path, run in runs.items()}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "memory").eval()
    window = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(window).logits, runs["memory"][0](window).logits)
    for path in ("streamed", "low_memory"):
        assert sorted(tensors[path]) == sorted(tensors["memory"])
        assert all(torch.equal(tensors[path][k], v) for k, v in tensors["memory"].items())
        assert ppl[path] == ppl["memory"]
    assert ppl["memory"]["before"] != ppl["memory"]["after"]


def test_a_layer_given_an_older_layers_other_output_is_refused_before_any_work():
    """The pipeline carries a layer's other outputs to the next layer only: a forward that passes layer 0's second
    output to layer 2 is refused in one line, naming the argument."""
    model = build("glm_moe_dsa", num_hidden_layers=3, indexer_types=["full", "full", "full"],
                  mlp_layer_types=["dense", "sparse", "sparse"])  # fmt: skip
    _, layers = find_decoder_layers(model)
    forward = type(model.model).forward

    def skipping(self, *args, **kwargs):  # layer 2 gets layer 0's topk_indices: wrap layer 1 to pass them on
        inner = self.layers[1].forward

        def relay(hidden, *a, prev_topk_indices=None, **k):
            out, _ = inner(hidden, *a, prev_topk_indices=prev_topk_indices, **k)
            return out, prev_topk_indices

        self.layers[1].forward = relay
        try:
            return forward(self, *args, **kwargs)
        finally:
            del self.layers[1].forward

    model.model.forward = skipping.__get__(model.model)
    with pytest.raises(NotImplementedError) as info, torch.no_grad():
        capture_layer_inputs(model, layers[0], batches(num=1, rows=3))
    assert str(info.value) == (
        "the forward of GlmMoeDsaForCausalLM (model_type 'glm_moe_dsa') passes decoder layer 2 (counted from the first "
        "captured) output 1 of layer 0 as its argument 'prev_topk_indices'; the sequential pipeline carries a layer's "
        "other outputs to the next layer only: not supported"
    )


@pytest.mark.parametrize("family", ["gpt_bigcode", "mamba2"])
@pytest.mark.parametrize("streamed", [False, True])
def test_packed_weights_whose_parents_init_reads_them_are_saved_unpacked_and_reload(tmp_path, family, streamed):
    """transformers' weight initialisation reads ``c_proj.weight`` from GPTBigCode's attention and MLP, and
    ``out_proj.weight`` from Mamba-2's mixer, unguarded: a packed checkpoint (no ``weight``) failed to reload
    (``'Linear' object has no attribute 'weight'``). Measured on the meta-device model: those Linears are saved
    int-quantized (same integers), the others packed; the output reloads with the in-memory logits."""
    import json

    from tiny_families import FAMILIES

    import llmc_fsm

    model = build(family)
    model.save_pretrained(tmp_path / "model")
    data = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    recipe = {"s": {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}}}}
    out = tmp_path / "out"
    returned = llmc_fsm.oneshot(model=str(tmp_path / "model"), recipe=recipe, dataset=data, output_dir=out,
                                progress=False, low_memory=streamed)  # fmt: skip
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    layers = len(find_decoder_layers(model)[1])
    unpacked = sorted({"gpt_bigcode": [f"transformer.h.{i}.{m}.c_proj" for i in range(layers) for m in ("attn", "mlp")],
                       "mamba2": [f"backbone.layers.{i}.mixer.out_proj" for i in range(layers)]}[family])  # fmt: skip
    assert sorted(t for g in groups.values() if g["format"] == "int-quantized" for t in g["targets"]) == unpacked
    assert any(g["format"] == "pack-quantized" for g in groups.values())
    cls = getattr(transformers, FAMILIES[family][2] or "AutoModelForCausalLM")
    reloaded, info = cls.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    if not streamed:
        with torch.no_grad():
            torch.testing.assert_close(reloaded.eval()(data[:2]).logits, returned(data[:2]).logits, rtol=0, atol=1e-5)


def test_bloom_gets_llmcompressors_smoothing_mappings_by_default():
    """Bloom's fused ``query_key_value`` and ``dense_h_to_4h`` (before: "no smoothing mapping fits"): the default
    mappings are llm-compressor's registry entry for ``BloomForCausalLM``, and the smoothed model computes what the
    float one does."""
    from llmc_fsm_quantization.mappings import default_mappings

    model = build("bloom")
    assert [(m.smooth_name, m.balance_names) for m in default_mappings(model)] == [
        (f"transformer.h.{i}.{norm}", (f"transformer.h.{i}.{balance}",))
        for i in range(2)
        for norm, balance in [("input_layernorm", "self_attention.query_key_value"),
                              ("post_attention_layernorm", "mlp.dense_h_to_4h")]  # fmt: skip
    ]


def test_a_smooth_layer_without_a_weight_is_refused_naming_the_mapping():
    """llm-compressor's Bloom AWQ mapping ``gelu_impl -> dense_4h_to_h``: an activation has no weight to fold the
    scales into; one line naming the mapping (before: an AttributeError from the fold)."""
    from llmc_fsm_quantization.mappings import MappingSpec, resolve_mappings

    model = build("bloom")
    with pytest.raises(ValueError) as info:
        resolve_mappings(model, [MappingSpec("re:.*gelu_impl$", ("re:.*dense_4h_to_h$",))], owner="AWQModifier")
    assert str(info.value) == (
        "smoothing mapping transformer.h.0.mlp.gelu_impl -> transformer.h.0.mlp.dense_4h_to_h: the smooth layer "
        "(BloomGelu) has no weight to fold the scales into; a smooth layer is a norm or a Linear: leave the mapping out"
    )


@pytest.mark.parametrize(("family", "norm"), [("hunyuan_v1_moe", "post_attention_layernorm"),
                                            ("afmoe", "pre_mlp_layernorm"), ("cohere2_moe", "input_layernorm")])
def test_awq_smooths_moe_blocks_whose_router_is_nested_or_whose_norm_is_parallel_and_reloads(tmp_path, family, norm):
    """HunYuan-MoE's router Linear is ``mlp.gate.wg`` and AFMoE's ``mlp.router.gate`` (inside a router module holding
    nothing else), Cohere2-MoE's one norm feeds attention and its MoE block alike: refused or left unsmoothed before
    session 25, their MoE norm mapping is now searched (its error no worse than unsmoothed), and AWQ + W4A16 reloads
    with no missing or unexpected key and the in-memory logits."""
    import transformers
    from tiny_families import FAMILIES

    import llmc_fsm
    from llmc_fsm_quantization import AWQModifier

    model = build(family)
    data = torch.randint(3, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    awq = AWQModifier(scheme={"preset": "W4A16", "weights": {"group_size": 16}}, ignore=["lm_head"])
    llmc_fsm.oneshot(model=model, recipe=[awq], dataset=data, output_dir=tmp_path / "o", progress=False)
    result = awq.smoothing_results[f"model.layers.1.{norm}"]
    assert result["error"] <= result["error_unsmoothed"]
    cls = getattr(transformers, FAMILIES[family][2] or "AutoModelForCausalLM")
    reloaded, info = cls.from_pretrained(tmp_path / "o", output_loading_info=True)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(data[:2]).logits, model(data[:2]).logits)


def test_awq_on_experts_without_one_router_names_the_block_children():
    """A router module that holds more than its Linear (here HunYuan-MoE's ``mlp.gate`` given a parameter of its own)
    is not taken for a router: AWQ cannot smooth the experts and says so, naming the block's children."""
    import llmc_fsm

    model = build("hunyuan_v1_moe")
    for layer in model.model.layers:
        layer.mlp.gate.register_parameter("temperature", torch.nn.Parameter(torch.ones(1)))
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"s": {"AWQModifier": {"ignore": ["lm_head"]}}},
                         dataset=torch.randint(3, 128, (2, 16)), progress=False)  # fmt: skip
    assert str(info.value).startswith(
        "AWQModifier: HunYuanMoEV1ForCausalLM (model_type 'hunyuan_v1_moe') keeps fused experts in "
        "model.layers.{0..1}.mlp.experts that no smoothing mapping reaches (no child of the block is one router with "
        "an [experts, hidden] weight, or holds one and nothing else (children: gate, experts, shared_mlp)), so they "
        "would be quantized unsmoothed"
    )


def test_deepseeks_latent_attention_gets_llmcompressors_mappings_and_the_float_model_is_unchanged():
    """DeepSeek-V3's multi-head latent attention (no q/k/v_proj) was left unsmoothed (warned); its mappings are now
    llm-compressor's DeepSeek entry: input_layernorm -> q_a_proj, kv_a_proj_with_mqa; q_a_layernorm -> q_b_proj;
    kv_a_layernorm -> kv_b_proj. Random scales folded through them leave the logits as they were."""
    from tiny_families import logits_before_and_after_random_folds

    from llmc_fsm_quantization.mappings import default_mappings

    model = build("deepseek_v3")
    mappings = default_mappings(model)
    attention = [(m.smooth_name, m.balance_names) for m in mappings if m.smooth_name.startswith("model.layers.0.")][:3]
    layer = "model.layers.0."
    assert attention == [
        (layer + "input_layernorm", (layer + "self_attn.q_a_proj", layer + "self_attn.kv_a_proj_with_mqa")),
        (layer + "self_attn.q_a_layernorm", (layer + "self_attn.q_b_proj",)),
        (layer + "self_attn.kv_a_layernorm", (layer + "self_attn.kv_b_proj",)),
    ]
    before, after = logits_before_and_after_random_folds(model, mappings, torch.randint(3, 128, (2, 16)))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def _reload_compare(tmp_path, family, recipe):
    """Compress ``family`` through ``llmc_fsm.oneshot``, reload the output with transformers; logits and keys."""
    from tiny_families import FAMILIES

    import llmc_fsm

    model = build(family)
    data = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    out = tmp_path / family
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=out, progress=False)
    cls = getattr(transformers, FAMILIES[family][2] or "AutoModelForCausalLM")
    reloaded, info = cls.from_pretrained(out, output_loading_info=True)
    reloaded.eval()
    with torch.no_grad():
        expected = model(data[:2]).logits
        got = reloaded(data[:2]).logits
    return model, reloaded, info, expected, got


_MM_IGNORE = ["lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*"]


@pytest.mark.parametrize("family", ["gpt_neox"])
def test_gptq_output_reloads_with_every_key_and_the_same_logits(tmp_path, family):
    """The saved ignore uses the reloaded model's names (GPT-NeoX's head is 'embed_out'). Multimodal models
    (towers and projectors unquantized on reload): tests/test_architectures_multimodal.py."""
    scheme = {"preset": "W4A16", "weights": {"group_size": 16}}
    recipe = {"s": {"GPTQModifier": {"scheme": scheme, "ignore": _MM_IGNORE}}}
    model, reloaded, info, expected, got = _reload_compare(tmp_path, family, recipe)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    towers = [
        n for n, m in reloaded.named_modules() if ("vision_tower" in n or "projector" in n) and hasattr(m, "weight")
    ]
    assert all(not hasattr(reloaded.get_submodule(n), "quantization_scheme") for n in towers)
    decoder = [n for n, m in reloaded.named_modules() if hasattr(m, "quantization_scheme")]
    assert decoder and all(".layers." in n and "vision" not in n for n in decoder)


#: mixture-of-experts families -> (fused experts module names, their weights)
MOE = {
    "mixtral": ("model.layers.{0..3}.mlp.experts", "down_proj, gate_up_proj"),
    "qwen3_moe": ("model.layers.{0..3}.mlp.experts", "down_proj, gate_up_proj"),
    "deepseek_v3": ("model.layers.{1..3}.mlp.experts", "down_proj, gate_up_proj"),
    "gpt_oss": ("model.layers.{0..3}.mlp.experts", "down_proj, down_proj_bias, gate_up_proj, gate_up_proj_bias"),
    "jamba": ("model.layers.{1,3}.feed_forward.experts", "down_proj, gate_up_proj"),
    "dbrx": ("transformer.blocks.{0..1}.ffn.experts.mlp", "v1, w1, w2"),
    "nemotron_h": ("model.layers.1.mixer.experts", "down_proj, up_proj"),
    "qwen3_next": ("model.layers.{0..1}.mlp.experts", "down_proj, gate_up_proj"),
}


@pytest.mark.parametrize("family", sorted(MOE))
def test_fused_experts_are_refused_for_quantizers_and_viewed_per_expert_for_pruning(family):
    """SparseGPT used to skip fused experts silently and report 50%. Without views (a modifier that compresses Linear
    modules only) they are refused before any work, naming the family; with views (pruning) every expert matrix of
    every such module is selected."""
    from llmc_fsm.toolkit.targets import select_targets
    from llmc_fsm.toolkit.views import LinearView

    model = build(family)
    names, weights = MOE[family]
    model_type = model.config.model_type
    with pytest.raises(ValueError) as info:
        select_targets(model, ["Linear"], ["lm_head"])
    assert str(info.value) == (
        f"{type(model).__name__} (model_type {model_type!r}) keeps its experts fused in {names} ({weights}: every "
        "expert's weights in one tensor, not one Linear per expert), which targets ['Linear'] select; this modifier "
        "compresses Linear modules only (SparseGPT, Wanda, magnitude, GPTQ, QuantizationModifier and AutoRound "
        "compress fused experts per expert): add 're:.*\\.experts' to ignore to compress the other modules"
    )
    selection = select_targets(model, ["Linear"], ["lm_head", "re:.*\\.experts"])
    assert selection.selected and not any(".experts" in name for name in selection.selected)
    viewed = select_targets(model, ["Linear"], ["lm_head"], views=True).selected
    fused = [n for n, m in model.named_modules() if type(m).__name__.endswith("Experts")]  # DBRX: DbrxExperts
    per_expert = 3 if family != "nemotron_h" else 2  # Nemotron-H's experts have no gate
    expected = len(fused) * 4 * per_expert
    assert sum(isinstance(m, LinearView) for m in viewed.values()) == expected


def test_moe_with_experts_ignored_compresses_the_rest_and_reports_only_those(tmp_path):
    import llmc_fsm

    model = build("mixtral")
    experts = {k: v.clone() for k, v in model.state_dict().items() if ".experts." in k}
    data = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    recipe = {"s": {"SparseGPTModifier": {"sparsity": 0.5, "ignore": ["lm_head", "re:.*\\.experts"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=tmp_path / "o", progress=False)
    report = model.llmc_fsm_report
    assert all(".experts" not in name for name in report.targeted)
    untouched = "not targeted: 49 modules, 401,408 weights, sparsity 0.00%: "
    # 48 expert matrices of 128 x 64 (4 layers x 4 experts x 3) and lm_head (8,192), folded into one line
    assert f"{untouched}model.layers.{{0..3}}.mlp.experts.0.gate_proj, " in report.format_table()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in experts.items())
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o", output_loading_info=True)
    assert sorted(info["missing_keys"]) == []
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(data[:2]).logits, model(data[:2]).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt_neox", "falcon", "bloom"])
def test_query_key_value_families_get_default_mappings_that_keep_the_float_model(family):
    """GPT-NeoX, Falcon and Bloom share the fused ``query_key_value`` / ``dense_h_to_4h`` names: their default
    mappings (Falcon's one norm feeds attention and MLP alike, so both are its balance layers) keep the logits
    under random folds."""
    from tiny_families import logits_before_and_after_random_folds

    from llmc_fsm_quantization.mappings import default_mappings

    model = build(family)
    mappings = default_mappings(model)
    first = [(m.smooth_name.split(".")[-1], m.balance_names) for m in mappings if ".0." in m.smooth_name]
    prefix = {"gpt_neox": "gpt_neox.layers.0.", "falcon": "transformer.h.0.", "bloom": "transformer.h.0."}[family]
    attention = "attention" if family == "gpt_neox" else "self_attention"
    expected = {
        "falcon": [("input_layernorm", (f"{prefix}{attention}.query_key_value", f"{prefix}mlp.dense_h_to_4h"))],
    }.get(family, [("input_layernorm", (f"{prefix}{attention}.query_key_value",)),
                   ("post_attention_layernorm", (f"{prefix}mlp.dense_h_to_4h",))])  # fmt: skip
    assert first == expected
    before, after = logits_before_and_after_random_folds(model, mappings, torch.randint(3, 128, (2, 16)))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
