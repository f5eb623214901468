"""The real SmolLM2-135M quantized with GPTQ W4A16, saved in the compressed-tensors format, reloaded by transformers.

Calibration 16 x 128 tokens from the tail of wikitext-2 test, perplexity on 8 x 128 tokens from its head (the
windows of tests/test_oneshot.py: both run ``smollm2_oneshot`` of conftest.py). One module-scoped run; the
assertions read its output.
"""

from __future__ import annotations

import json

import pytest
import torch

from llmc_fsm.data.protocol import load_text, perplexity, token_windows

#: Dense perplexity on these 8 x 128 windows (tests/test_oneshot.py measures it too).
DENSE_PPL = 50.369
#: GPTQ W4A16 (group 64, actorder static) with 16 x 128 calibration tokens: measured 66.61 (2 BLAS threads, torch
#: 2.13 CPU, batches of 8; 68.22 / 70.75 / 70.18 with 1 thread / batches of 4 / both; the plain, not grouped,
#: pipeline order gave 75.44; on 2026-12-06 with OMP_NUM_THREADS=1: 75.48, at the revision before this line's and
#: at this one). 2048 tokens leave the 1536-wide down_proj Hessians rank-deficient, so float rounding moves the
#: result (SparseGPT moved 13% over threads and batches, tests/test_oneshot.py): the band is +-15%, which holds the
#: measured 66.61-75.48.
GPTQ_PPL = 66.61


@pytest.fixture(scope="module")
def gptq_run(smollm2, smollm2_oneshot, shared_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("quant") / "smollm2-w4a16"
    scheme = {"preset": "W4A16", "weights": {"group_size": 64}}
    quantized = smollm2_oneshot({"quantization_stage": {"GPTQModifier": {"scheme": scheme}}}, out)
    wiki = shared_data / "wikitext-2-raw" / "wiki.test.raw"
    windows = token_windows(smollm2[1], load_text(wiki), num_windows=8, seq_len=128)
    return quantized, out, windows


@pytest.mark.slow
def test_smollm2_w4a16_reloads_with_the_same_logits_and_perplexity(gptq_run):
    from transformers import AutoModelForCausalLM

    quantized, out, windows = gptq_run
    report = quantized.llmc_fsm_report
    assert report.ppl_before == pytest.approx(DENSE_PPL, rel=1e-3)
    assert report.ppl_after == pytest.approx(GPTQ_PPL, rel=0.15)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(quantized(windows[:2]).logits, reloaded(windows[:2]).logits)
    assert perplexity(reloaded, windows, progress=False) == pytest.approx(report.ppl_after, rel=0.005)


@pytest.mark.slow
def test_smollm2_w4a16_checkpoint_format_and_size(gptq_run):
    _, out, _ = gptq_run
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["format"], config["quantization_status"]) == (
        "compressed-tensors",
        "pack-quantized",
        "compressed",
    )
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 64, True)
    assert config["ignore"] == ["lm_head"]
    report = json.loads((out / "report.json").read_text())
    modules = [m for m in report["sparsity"]["modules"] if m["targeted"]]
    assert len(modules) == 30 * 7 and all(m["bits"] == 4 and m["group_size"] == 64 for m in modules)
    assert all(0 < m["rel_output_error"] < 0.25 for m in modules)
    # int4 + fp32 scales per 64 weights: the Linear weights shrink ~6x; the tied embedding stays fp32
    assert report["disk"]["after_bytes"] < 0.35 * report["disk"]["before_bytes"]
