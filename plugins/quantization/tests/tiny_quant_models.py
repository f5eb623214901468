"""The tiny random Llama the quantization plugin's tests compress (no network; the same arguments give the same
weights, bit for bit)."""

from __future__ import annotations

import torch


def tiny_llama(layers: int = 2, hidden: int = 64, *, kv_heads: int = 2, tied: bool = False) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` in eval mode, float32 on the CPU, weights drawn after ``torch.manual_seed(0)``.

    Vocabulary 128, ``layers`` decoder layers of width ``hidden`` (MLP ``2 * hidden``), 4 attention heads and
    ``kv_heads`` key/value heads, 64 positions; ``tied``: ``lm_head`` shares the embedding.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).eval()
