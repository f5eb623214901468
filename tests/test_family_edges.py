"""Edges of particular model families found by a tester (session 36): a per-token quantized output head in the
perplexity, an ``ignore: [lm_head]`` on a model whose head has another name (BioGPT), OPT-350m's modules outside the
decoder layers, and the report rows of T5's nested-numbered blocks."""

from __future__ import annotations

import logging
import math
import re

import pytest
import tiny_llama
import torch
import transformers
from llmc_fsm_pruning import SparseGPTModifier

import llmc_fsm
from llmc_fsm import Session
from llmc_fsm.data.protocol import logits_are_projection, perplexity
from llmc_fsm.pipeline.sequential import run_sequential
from llmc_fsm.toolkit.targets import resolve_targets

FP8_HEAD = "s:\n  QuantizationModifier:\n    targets: [Linear]\n    scheme: FP8_DYNAMIC\n    ignore: []\n"


def _own_perplexity(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """exp(mean next-token NLL) from the model's own full logits, one window per forward, float64 sums."""
    total = 0.0
    with torch.no_grad():
        for row in windows:
            logits = model(input_ids=row[None]).logits[0, :-1].float()
            total += float(torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum").double())
    return math.exp(total / (windows.shape[0] * (windows.shape[1] - 1)))


def _fp8_head_llama() -> torch.nn.Module:
    model = tiny_llama.llama(layers=2, hidden=64, vocab=512, heads=4, kv_heads=2, positions=128)
    return llmc_fsm.oneshot(model=model, recipe=FP8_HEAD, progress=False)


def _windows(n: int = 3, length: int = 40) -> torch.Tensor:
    return torch.randint(0, 512, (n, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("batch_size", "loss_chunk"), [(1, 128), (2, 16), (3, 7)])
def test_perplexity_of_a_per_token_quantized_head_is_the_models_own(batch_size, loss_chunk):
    """FP8_DYNAMIC with ``ignore: []`` quantizes lm_head's inputs per token. The chunked loss handed the head 2-D
    ``[positions, hidden]`` chunks, on which compressed-tensors takes one scale for the whole chunk: the reported
    perplexity was not the model's (532.501 for 533.114; found by a tester)."""
    model, windows = _fp8_head_llama(), _windows()
    assert model.lm_head.quantization_scheme.input_activations.strategy == "token"
    assert logits_are_projection(model, windows[:1], loss_chunk=loss_chunk)  # scored from chunks: no full logits
    got = perplexity(model, windows, batch_size=batch_size, loss_chunk=loss_chunk, progress=False)
    assert got == pytest.approx(_own_perplexity(model, windows), rel=1e-6)


class _ChunkWideHead(torch.nn.Module):
    """A head whose output for a position depends on the other positions it is handed (one input scale for all of
    them, as a per-tensor dynamic activation quantization has): not what the chunked loss may compute piecewise."""

    def __init__(self, inner: torch.nn.Linear) -> None:
        super().__init__()
        self.inner = inner
        self.weight = inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax() / 8
        return self.inner(torch.round(x / scale) * scale)


def test_perplexity_of_a_head_that_depends_on_the_other_positions_uses_the_full_logits():
    """The first-batch check compared the model's head call with the same call (same positions, same shape), so a
    head whose output depends on what else it is handed passed it and the chunks were scored piecewise."""
    model = tiny_llama.llama(layers=2, hidden=64, vocab=512, heads=4, kv_heads=2, positions=128)
    model.lm_head = _ChunkWideHead(model.lm_head)
    windows = _windows()
    assert not logits_are_projection(model, windows[:1])
    got = perplexity(model, windows, batch_size=1, loss_chunk=16, progress=False)
    assert got == pytest.approx(_own_perplexity(model, windows), rel=1e-6)


def test_a_plain_head_still_passes_the_projection_check():
    model = tiny_llama.llama(layers=2, hidden=64, vocab=512, heads=4, kv_heads=2, positions=128)
    assert logits_are_projection(model, _windows()[:2])
    assert logits_are_projection(model, _windows()[:1], loss_chunk=7)


def _biogpt() -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(
        "biogpt", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def test_a_given_lm_head_ignore_that_matches_nothing_names_the_models_head(caplog):
    """BioGPT's head is ``output_projection``: an explicit ``ignore: [lm_head]`` matched nothing and was never warned
    about (the default ``lm_head`` is quiet on such a model), so the head was quantized without a word."""
    model = _biogpt()
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.toolkit.targets"):
        selected = resolve_targets(model, ["Linear"], ["lm_head"], ignore_given=True)
    assert "output_projection" in selected
    assert [r.getMessage() for r in caplog.records] == [
        "ignore pattern 'lm_head' matches no module: this model's output head is 'output_projection', so it is "
        "compressed; give ignore: [output_projection] to keep it dense"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.toolkit.targets"):
        resolve_targets(model, ["re:.*fc1$"], ["lm_head", "re:.*fc2$"])  # not the default: given; head not a target
    assert [r.getMessage() for r in caplog.records] == [
        "ignore pattern 'lm_head' matches no module: this model's output head is 'output_projection', which the "
        "targets do not compress; give ignore: [output_projection] to keep it dense"
    ]


def test_the_default_lm_head_ignore_stays_quiet_on_a_model_without_one(caplog):
    model = _biogpt()
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.toolkit.targets"):
        resolve_targets(model, ["Linear"], ["lm_head"], ignore_given=False)
        resolve_targets(model, ["Linear"], ["lm_head"])  # a caller that does not know: [lm_head] is the default
    assert caplog.records == []


def _opt350() -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(
        "opt", vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=64, word_embed_proj_dim=16, do_layer_norm_before=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def test_opt350_projections_outside_the_layers_are_refused_alike_in_memory_and_streamed(tmp_path):
    """OPT-350m's project_in/project_out lie outside the decoder layers. The streamed refusal said the pipeline
    calibrates "only the decoder layers", the in-memory one "the decoder layers and the output head"."""
    model = _opt350()
    (tmp_path / "opt").mkdir()
    model.save_pretrained(tmp_path / "opt")
    recipe = "s:\n  GPTQModifier: {scheme: {preset: W8A16, weights: {group_size: 16}}, ignore: [lm_head]}\n"
    data = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = (
        "GPTQModifier targets model.decoder.project_out, model.decoder.project_in, outside the decoder layers "
        "(model.decoder.layers); the sequential pipeline calibrates only the decoder layers and the output head. "
        "Add them to the modifier's ignore list."
    )
    for low_memory in (False, True):
        with pytest.raises(ValueError) as info:
            llmc_fsm.oneshot(model=str(tmp_path / "opt"), recipe=recipe, dataset=data, output_dir=tmp_path / "o",
                             low_memory=low_memory, progress=False)  # fmt: skip
        assert str(info.value) == expected, low_memory
        assert not (tmp_path / "o").exists()


def test_a_model_without_a_linear_head_is_refused_with_the_same_sentence():
    """The in-memory sentence left out the output head where the model's head is no ``nn.Linear``."""
    model = tiny_llama.llama(layers=2, hidden=64, vocab=512, heads=4, kv_heads=2, positions=128)
    model.model.projector = torch.nn.Linear(64, 64)
    model.lm_head = torch.nn.Sequential(model.lm_head)  # no Linear head: get_output_embeddings() is a container
    session = Session(SparseGPTModifier(sparsity=0.5, ignore=["lm_head", "re:lm_head.*"]))
    session.initialize(model=model, calibration_data=torch.randint(0, 512, (2, 16)))
    message = (
        "SparseGPTModifier targets model.projector, outside the decoder layers (model.layers); the sequential "
        "pipeline calibrates only the decoder layers and the output head. Add them to the modifier's ignore list."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        run_sequential(session, progress=False)


def _t5() -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(
        "t5", vocab_size=128, d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForSeq2SeqLM.from_config(cfg).eval()


def test_t5_report_has_one_row_per_encoder_and_decoder_block(tmp_path):
    """T5's blocks hold numbered sub-layers (``block.0.layer.0``, ``.layer.1``): the decoder rows read
    ``decoder.block.0.layer.0`` (for all of block 0) and the encoder had a row per sub-layer."""
    recipe = "s:\n  QuantizationModifier: {targets: [Linear], scheme: FP8_DYNAMIC, ignore: [lm_head]}\n"
    model = llmc_fsm.oneshot(model=_t5(), recipe=recipe, output_dir=tmp_path / "o", progress=False)
    table = model.llmc_fsm_report.format_table().splitlines()
    rows = [line.split()[0] for line in table if re.match(r"\s*(en|de)coder\.", line)]
    assert rows == ["decoder.block.0", "decoder.block.1", "encoder.block.0", "encoder.block.1"]
