"""FP8 block experts of one block per matrix: their scale broadcasts, transformers reloads them, and no warning says
otherwise."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
import transformers

import llmc_fsm

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

DATA = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))


def test_fp8_block_experts_of_one_block_reload_and_get_no_reload_warning(tmp_path, caplog) -> None:
    """Every FP8_BLOCK fused-experts run warned "transformers X will not reload this checkpoint into its fused
    experts", also when each expert matrix is one 128x128 block, whose scale broadcasts and which transformers does
    reload (found by a tester): the warning is now given only where a matrix spans several blocks."""
    from tiny_families import build  # tests/, on the path above

    model = build("qwen3_moe", hidden_size=128, moe_intermediate_size=128, head_dim=32, num_hidden_layers=2)
    model = model.to(torch.bfloat16)
    recipe = {"s": {"QuantizationModifier": {"scheme": "FP8_BLOCK", "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    with caplog.at_level(logging.WARNING):
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=tmp_path / "o", progress=False)
    assert [r.getMessage() for r in caplog.records if "will not reload" in r.getMessage()] == []
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o", output_loading_info=True)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    for layer, again in zip(model.model.layers, reloaded.model.layers, strict=True):
        experts, back = layer.mlp.experts, again.mlp.experts
        assert torch.equal(back.gate_up_proj, experts.gate_up_proj) and torch.equal(back.down_proj, experts.down_proj)
