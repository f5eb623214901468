"""Multimodal models (llm-compressor's vision-language and audio examples, issue 24): the language model's decoder is
compressed, the towers and projectors the recipe ignores are left as they were, and the output reloads.

Tiny random models from ``tiny_families`` (transformers 5 configs, offline), calibrated on text tokens only. Each
test reloads the saved model with transformers and compares its keys and logits with the in-memory model's.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from tiny_families import FAMILIES, build

import llmc_fsm
from llmc_fsm.models.layers import UnsupportedArchitectureError, find_decoder_layers

DATA = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))

#: family -> ignore patterns of its towers and projectors (as llm-compressor's examples write them)
TOWERS = {
    "qwen2_vl": ["re:.*visual.*"],
    "llava": ["re:.*vision_tower.*", "re:.*multi_modal_projector.*"],
    "llava_pixtral": ["re:.*vision_tower.*", "re:.*multi_modal_projector.*"],
    "mistral3": ["re:.*vision_tower.*", "re:.*multi_modal_projector.*"],
    "gemma3_vlm": ["re:.*vision_tower.*", "re:.*multi_modal_projector.*"],
    "idefics3": ["re:.*vision_model.*", "re:.*connector.*"],
    "qwen2_audio": ["re:.*audio_tower.*", "re:.*multi_modal_projector.*"],
}


def _is_tower(family, name):
    return any(re.fullmatch(p[3:], name) for p in TOWERS[family])


def _linears(model, prefix):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(prefix + ".")}


def _oneshot_and_reload(tmp_path, family, modifier):
    model = build(family)
    layers_name, _ = find_decoder_layers(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    recipe = {"s": {modifier[0]: {**modifier[1], "ignore": ["lm_head", *TOWERS[family]]}}}
    out = tmp_path / family
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, output_dir=out, progress=False)
    cls = getattr(transformers, FAMILIES[family][2]) if FAMILIES[family][2] != "AutoModelForImageTextToText" else (
        transformers.AutoModelForImageTextToText
    )
    reloaded, info = cls.from_pretrained(out, output_loading_info=True)
    reloaded.eval()
    with torch.no_grad():
        expected, got = model(DATA[:2]).logits, reloaded(DATA[:2]).logits
    return model, layers_name, before, reloaded, info, expected, got


def _assert_reloads(info, expected, got):
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"]), list(info["mismatched_keys"])) == (
        [],
        [],
        [],
    )
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", sorted(TOWERS))
def test_sparsegpt_prunes_the_language_model_only_and_the_output_reloads(tmp_path, family):
    """Every Linear of the text decoder layers exactly 50% zeros; every other parameter (towers, projectors,
    embeddings, head, norms) bit-equal to before; reload with no missing/unexpected key and equal logits."""
    model, layers_name, before, _, info, expected, got = _oneshot_and_reload(
        tmp_path, family, ("SparseGPTModifier", {"sparsity": 0.5})
    )
    decoder = _linears(model, layers_name)
    assert decoder
    for name, module in decoder.items():
        assert int((module.weight == 0).sum()) == module.weight.numel() // 2, name
    pruned = {f"{n}.weight" for n in decoder}
    for name, param in model.named_parameters():
        if name not in pruned:
            assert torch.equal(param, before[name]), name
    assert any(_is_tower(family, n) for n in before)  # the tower exists and was compared above
    _assert_reloads(info, expected, got)


@pytest.mark.parametrize("family", sorted(TOWERS))
def test_gptq_quantizes_the_language_model_only_and_the_output_reloads(tmp_path, family):
    """The reloaded model's quantized modules are exactly the text decoder layers' Linears; towers and projectors
    come back unquantized and equal to before; reload with no missing/unexpected key and equal logits."""
    scheme = {"preset": "W4A16", "weights": {"group_size": 16}}
    model, layers_name, before, reloaded, info, expected, got = _oneshot_and_reload(
        tmp_path, family, ("GPTQModifier", {"scheme": scheme})
    )
    _assert_reloads(info, expected, got)
    quantized = {n for n, m in reloaded.named_modules() if hasattr(m, "quantization_scheme")}
    assert quantized == set(_linears(reloaded, layers_name))
    towers = {n: p for n, p in reloaded.named_parameters() if _is_tower(family, n.rsplit(".", 1)[0])}
    assert towers
    for name, param in towers.items():
        assert torch.equal(param, before[name]), name


def test_whisper_is_refused_before_any_work_naming_the_family_and_why():
    """Whisper's decoder attends to encoder states computed from audio features: text tokens cannot calibrate it."""
    model = build("whisper")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedArchitectureError) as info:
        llmc_fsm.oneshot(model=model, recipe={"s": {"SparseGPTModifier": {"sparsity": 0.5}}}, dataset=DATA,
                         progress=False)  # fmt: skip
    assert str(info.value) == (
        "WhisperForConditionalGeneration (model_type 'whisper') is an encoder-decoder model: its decoder layers "
        "(model.decoder.layers) attend to the encoder's output, which the sequential pipeline's calibration (token "
        "ids as the model's input_ids) does not produce; it calibrates decoder-only language models (multimodal "
        "ones on text, through their language model): not supported"
    )
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
