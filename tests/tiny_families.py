"""Tiny random models of many transformers families, built offline from their configs (no network, seeded).

:func:`build` returns a model in eval mode (fp32, CPU) of family ``name`` (a key of :data:`FAMILIES`): 4 decoder
layers (2 for the slow hybrid families) of width 64, vocabulary 128, with the family's own mix of layer kinds
(sliding-window and full attention, mamba and attention, dense and mixture-of-experts layers). Multimodal families
are their ``...ForConditionalGeneration`` with a tiny vision (Qwen2-Audio: audio) tower; text-only calibration runs
their language model. Whisper (an encoder-decoder) is here to test its refusal.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 128

_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

_MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 2,
    "image_size": 16,
    "patch_size": 8,
}
_VLM = "AutoModelForImageTextToText"

#: Qwen3.5 / 3.6 / 3.8 MoE's text model: Gated DeltaNet (linear_attn.in_proj_qkv / in_proj_z / in_proj_b / in_proj_a) +
#: full attention, fused experts, a shared expert with a sigmoid gate
_QWEN3_5_LINEAR = {
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
}  # fmt: skip
_QWEN3_5_MOE = {**_QWEN3_5_LINEAR, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32}  # fmt: skip

#: family -> (model_type, config overrides, model class name or None for AutoModelForCausalLM)
FAMILIES: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "llama": ("llama", {}, None),
    "gemma2": ("gemma2", {"layer_types": _MIXED, "sliding_window": 8}, None),
    "gemma3": ("gemma3_text", {"layer_types": _MIXED, "sliding_window": 8}, None),
    "cohere2": ("cohere2", {"layer_types": _MIXED, "sliding_window": 8}, None),
    "exaone4": ("exaone4", {"layer_types": _MIXED, "sliding_window": 8}, None),
    "olmo3": ("olmo3", {"layer_types": _MIXED, "sliding_window": 8}, None),
    "qwen2": ("qwen2", {}, None),
    "qwen3": ("qwen3", {}, None),
    "phi3": ("phi3", {"num_key_value_heads": 4}, None),  # fused qkv_proj / gate_up_proj; Phi-3.5-mini has no GQA
    "cohere": ("cohere", {}, None),  # parallel attention and MLP on one norm
    "gpt_oss": (
        "gpt_oss",
        {"layer_types": _MIXED, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
        None,
    ),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}, None),
    "qwen3_moe": (
        "qwen3_moe",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1},
        None,
    ),
    "jamba": (
        "jamba",
        {
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mamba_d_state": 8,
            "mamba_expand": 2,
            "mamba_dt_rank": 8,
            "use_mamba_kernels": False,
        },
        None,
    ),
    "deepseek_v3": (
        "deepseek_v3",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_shared_experts": 1,
        },
        None,
    ),
    "ernie4_5_moe": (  # its router's score-correction bias is moe_statics.e_score_correction_bias [1, experts]
        "ernie4_5_moe",
        {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32, "moe_layer_start_index": 0},
        None,
    ),
    "minimax": (  # lightning (linear) attention layers between full-attention ones, Mixtral-like experts
        "minimax",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "layer_types": ["linear_attention", "full_attention"] * 2,
         "block_size": 8},
        None,
    ),  # fmt: skip
    "longcat_flash": (  # zero-compute experts: the router chooses among n_routed_experts + zero_expert_num
        "longcat_flash",
        {
            "num_layers": 2, "n_routed_experts": 4, "zero_expert_num": 2, "moe_topk": 2, "expert_ffn_hidden_size": 32,
            "ffn_hidden_size": 64, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "head_dim": 8,
        },
        None,
    ),  # fmt: skip
    "dbrx": (
        "dbrx",
        {
            "_raw": True,
            "d_model": 64,
            "n_heads": 4,
            "n_layers": 2,
            "max_seq_len": 256,
            "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
            "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
        },
        None,
    ),
    "falcon": (
        "falcon",
        {"_raw": True, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "multi_query": True},
        None,
    ),
    "gpt_neox": ("gpt_neox", {"rotary_pct": 0.5}, None),
    "falcon_h1": (
        "falcon_h1",
        {"num_hidden_layers": 2, "mamba_d_state": 8, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_ssm": 128},
        None,
    ),
    "nemotron_h": (
        "nemotron_h",
        {
            "layers_block_type": ["mamba", "moe", "attention", "mlp"],
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "ssm_state_size": 8,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 1,
        },
        None,
    ),
    "qwen3_next": (
        "qwen3_next",
        {
            "layer_types": ["linear_attention", "full_attention"],
            "num_hidden_layers": 2,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
        },
        None,
    ),
    "qwen2_vl": (
        "qwen2_vl",
        {
            "_raw": True,
            "text_config": {
                **_TEXT,
                "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            },
            "vision_config": {
                "depth": 6,
                "embed_dim": 32,
                "hidden_size": 64,
                "num_heads": 2,
                "mlp_ratio": 2,
                "patch_size": 8,
                "spatial_merge_size": 2,
            },
            "image_token_id": 5,
            "video_token_id": 6,
            "vision_start_token_id": 7,
        },
        _VLM,
    ),
    "llava": (
        "llava",
        {
            "_raw": True,
            "text_config": {**_TEXT, "model_type": "llama"},
            "vision_config": {**_VISION, "model_type": "clip_vision_model"},
            "image_token_id": 5,
        },
        _VLM,
    ),
    "mistral3": (
        "mistral3",
        {
            "_raw": True,
            "text_config": {**_TEXT, "model_type": "mistral"},
            "vision_config": {**_VISION, "model_type": "pixtral", "head_dim": 16},
            "image_token_id": 5,
            "spatial_merge_size": 1,
        },
        _VLM,
    ),
    "gemma3_vlm": (
        "gemma3",
        {
            "_raw": True,
            "text_config": {**_TEXT, "model_type": "gemma3_text", "layer_types": _MIXED, "sliding_window": 8},
            "vision_config": {**_VISION, "model_type": "siglip_vision_model"},
            "mm_tokens_per_image": 4,
            "image_token_id": 5,
            "boi_token_id": 6,
            "eoi_token_id": 7,
        },
        _VLM,
    ),
    "mllama": (
        "mllama",
        {
            "_raw": True,
            "text_config": {**_TEXT, "cross_attention_layers": [1]},
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_global_layers": 1,
                "attention_heads": 2,
                "image_size": 16,
                "patch_size": 8,
                "vision_output_dim": 64,
                "intermediate_layers_indices": [0],
            },
            "image_token_index": 5,
        },
        _VLM,
    ),
    "llava_pixtral": (  # llm-compressor's Pixtral example: a LlavaForConditionalGeneration with a Pixtral tower
        "llava",
        {
            "_raw": True,
            "text_config": {**_TEXT, "model_type": "mistral"},
            "vision_config": {**_VISION, "model_type": "pixtral", "head_dim": 16},
            "image_token_id": 5,
        },
        _VLM,
    ),
    "idefics3": (
        "idefics3",
        {
            "_raw": True,
            "text_config": {**_TEXT, "model_type": "llama"},
            "vision_config": dict(_VISION),
            "image_token_id": 5,
            "scale_factor": 1,
        },
        _VLM,
    ),
    "qwen2_audio": (
        "qwen2_audio",
        {
            "_raw": True,
            "text_config": {**_TEXT, "model_type": "qwen2"},
            "audio_config": {
                "d_model": 32,
                "encoder_layers": 6,
                "encoder_attention_heads": 2,
                "encoder_ffn_dim": 64,
                "num_mel_bins": 8,
                "max_source_positions": 16,
            },
            "audio_token_index": 5,
        },
        "Qwen2AudioForConditionalGeneration",
    ),
    "whisper": (
        "whisper",
        {
            "_raw": True,
            "d_model": 64,
            "encoder_layers": 6,
            "decoder_layers": 4,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128,
            "num_mel_bins": 8,
            "max_source_positions": 16,
            "max_target_positions": 64,
            "decoder_start_token_id": 1,
        },
        "WhisperForConditionalGeneration",
    ),
    "gpt2": ("gpt2", {"n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 256}, None),
    # a breaker's families (2026-12-06): parent init reading a child's weight, tuple outputs, Bloom's names
    "gpt_bigcode": ("gpt_bigcode", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "multi_query": True},
                    None),  # fmt: skip
    "mamba2": ("mamba2", {"_raw": True, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 16,
                          "state_size": 8, "n_groups": 1, "expand": 2, "use_mamba_kernels": False}, None),  # fmt: skip
    "bamba": ("bamba", {"num_hidden_layers": 2, "attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 16,
                        "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_expand": 2}, None),  # fmt: skip
    "bloom": ("bloom", {"_raw": True, "hidden_size": 64, "n_layer": 2, "n_head": 4}, None),
    "glm_moe_dsa": ("glm_moe_dsa", {
        "num_hidden_layers": 2, "head_dim": 8, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8,
        "kv_lora_rank": 16, "q_lora_rank": 32, "qk_head_dim": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
        "topk_group": 1, "mlp_layer_types": ["dense", "sparse"], "indexer_types": ["full", "full"]}, None),  # fmt: skip
    "hunyuan_v1_moe": ("hunyuan_v1_moe", {"num_hidden_layers": 2, "num_experts": 4, "moe_topk": 2,
                                          "num_shared_expert": 1, "moe_intermediate_size": 32}, None),  # fmt: skip
    # DeepSeek-V4 (Flash / Pro): MLA-like single-KV attention with grouped output projection, sliding / CSA / HCA
    # compressors with a Lightning indexer, mHC hyper-connections (hc_mult residual streams), hash-routed and top-k
    # routed fused experts
    "deepseek_v4": ("deepseek_v4", {
        "num_key_value_heads": 1, "partial_rotary_factor": 0.5, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
        "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4, "sliding_window": 8, "hc_mult": 4,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "layer_types": ["heavily_compressed_attention", "sliding_attention", "compressed_sparse_attention",
                        "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"]}, None),  # fmt: skip
    # GLM-5.x as its checkpoints are laid out: the first 3 layers dense, the rest MoE (glm_moe_dsa has 2 layers)
    "glm5": ("glm_moe_dsa", {
        "head_dim": 8, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8,
        "kv_lora_rank": 16, "q_lora_rank": 32, "qk_head_dim": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 3, "n_group": 1,
        "topk_group": 1}, None),  # fmt: skip
    # AFMoE (Arcee Trinity): gated attention (self_attn.gate_proj), pre_mlp_layernorm, a router module (mlp.router.gate)
    "afmoe": ("afmoe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_dense_layers": 1,
                        "num_shared_experts": 1, "layer_types": ["sliding_attention", "full_attention"] * 2,
                        "sliding_window": 8, "global_attn_every_n_layers": 2}, None),  # fmt: skip
    # MuseGlimmer: gated attention (self_attn.gate_proj) and Gemma-style pre/post feed-forward norms, a vision tower
    "muse_glimmer": ("muse_glimmer", {"_raw": True, "text_config": dict(_TEXT), "vision_config": {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 16,
        "patch_size": 8}, "image_token_id": 5, "projector_hidden_size": 64}, _VLM),  # fmt: skip
    # Cohere2-MoE: a parallel block (one norm feeds attention and the MoE), a dense first layer
    "cohere2_moe": ("cohere2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 0,
                                    "first_k_dense_replace": 1, "sliding_window": 8, "moe_intermediate_size": 128,
                                    "layer_types": ["sliding_attention", "full_attention"] * 2}, None),  # fmt: skip
    # Llama-4 (vision-language): MoE every second layer (Llama4TextExperts, a shared expert), chunked attention
    "llama4": ("llama4", {"_raw": True, "text_config": {**_TEXT, "num_local_experts": 4, "num_experts_per_tok": 1,
        "intermediate_size": 32, "intermediate_size_mlp": 128, "interleave_moe_layer_step": 2,
        "no_rope_layers": [1, 1, 1, 1], "attention_chunk_size": 8}, "vision_config": {"hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 16, "patch_size": 8,
        "vision_output_dim": 64, "projector_input_dim": 64, "projector_output_dim": 64, "pixel_shuffle_ratio": 0.5},
        "image_token_index": 5}, _VLM),  # fmt: skip
    "qwen3_5_moe": ("qwen3_5_moe_text", _QWEN3_5_MOE, None),  # Qwen3.5 / 3.6 / 3.8 MoE's text model
    # Qwen3.5 / 3.8 dense (Qwen3.5-27B: Qwen3_5ForConditionalGeneration), Gated DeltaNet + full attention
    "qwen3_5_vlm": ("qwen3_5", {"_raw": True, "text_config": {**_TEXT, **_QWEN3_5_LINEAR}, "vision_config": {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}}, _VLM),  # fmt: skip
    # the checkpoints' class (Qwen3_5MoeForConditionalGeneration: llm-compressor's examples load it), a vision tower
    "qwen3_5_moe_vlm": ("qwen3_5_moe", {"_raw": True, "text_config": {**_TEXT, **_QWEN3_5_MOE}, "vision_config": {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}}, _VLM),  # fmt: skip
}


def config(name: str, **extra: Any) -> Any:
    """The tiny config of family ``name`` (``extra``: fields set on top of the family's, e.g. a layer pattern)."""
    from transformers import AutoConfig

    model_type, overrides, _ = FAMILIES[name]
    overrides = {**overrides, **extra}
    if overrides.pop("_raw", False):  # a config whose fields have other names: only the ids and vocabulary
        base = {k: _TEXT[k] for k in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")}
    else:
        base = _TEXT
    return AutoConfig.for_model(model_type, **{**base, **overrides})


def build(name: str, *, seed: int = 0, **extra: Any) -> torch.nn.Module:
    """A tiny random model of family ``name`` in eval mode, weights drawn after ``torch.manual_seed(seed)``
    (``extra``: config fields set on top of the family's, as :func:`config`)."""
    import transformers

    _, _, cls_name = FAMILIES[name]
    cfg = config(name, **extra)
    torch.manual_seed(seed)
    cls = getattr(transformers, cls_name or "AutoModelForCausalLM")
    model = cls.from_config(cfg) if hasattr(cls, "from_config") else cls(cfg)  # an Auto class, or the class itself
    return model.eval()


def batches(num: int = 2, rows: int = 2, length: int = 24, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``num`` calibration batches of ``rows`` random token windows of ``length`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, VOCAB, (rows, length), generator=gen)} for _ in range(num)]


def logits_before_and_after_random_folds(model: torch.nn.Module, mappings: list, data: torch.Tensor, seed: int = 1):
    """``(logits before, logits after)`` of ``model`` on ``data`` when random scales in ``[0.5, 2]`` are folded into
    every one of ``mappings`` (``fold_scales``): equal up to float rounding when the mappings keep the function."""
    from llmc_fsm_quantization.mappings import fold_scales

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        before = model(data).logits
        for mapping in mappings:
            fold_scales(mapping, 0.5 + 1.5 * torch.rand(mapping.channels, generator=gen))
        return before, model(data).logits


def build_rwkv(*, layers: int = 2, rescale_every: int = 6, seed: int = 0) -> torch.nn.Module:
    """A tiny random RWKV-4 model (``RwkvForCausalLM``: blocks ``rwkv.blocks``, head ``head``) in eval mode.

    Not in :data:`FAMILIES`: its blocks are no attention layers, and a model whose ``layers`` exceed
    ``rescale_every`` (its config's inference rescaling, 6 in the checkpoints) is refused before any work."""
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "rwkv", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, attention_hidden_size=64,
        intermediate_size=128, context_length=64, rescale_every=rescale_every,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()
