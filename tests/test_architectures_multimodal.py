"""Multimodal models (llm-compressor's vision-language and audio examples, issue 24): the language model's decoder is
compressed, the towers and projectors the recipe ignores are left as they were, and the output reloads.

Tiny random models from ``tiny_families`` (transformers 5 configs, offline), calibrated on text tokens only. Each
test reloads the saved model with transformers and compares its keys and logits with the in-memory model's.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from tiny_families import FAMILIES, batches, build

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
    _model, layers_name, before, reloaded, info, expected, got = _oneshot_and_reload(
        tmp_path, family, ("GPTQModifier", {"scheme": scheme})
    )
    _assert_reloads(info, expected, got)
    quantized = {n for n, m in reloaded.named_modules() if hasattr(m, "quantization_scheme")}
    assert quantized == set(_linears(reloaded, layers_name))
    towers = {n: p for n, p in reloaded.named_parameters() if _is_tower(family, n.rsplit(".", 1)[0])}
    assert towers
    for name, param in towers.items():
        assert torch.equal(param, before[name]), name


WHISPER_CALIBRATED = (
    "WhisperForConditionalGeneration (model_type 'whisper') is an encoder-decoder model: its decoder layers "
    "(model.decoder.layers) attend to the encoder's output, which the sequential pipeline's calibration (token ids as "
    "the model's input_ids) does not produce; it calibrates and evaluates decoder-only language models (multimodal "
    "ones on text, through their language model): not supported; a recipe that needs no calibration data (e.g. "
    "FP8_DYNAMIC or W8A8 round-to-nearest) runs on it"
)


def test_whisper_is_refused_before_any_work_naming_the_family_and_why():
    """Whisper's decoder attends to encoder states computed from audio features: text tokens cannot calibrate it."""
    model = build("whisper")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedArchitectureError) as info:
        llmc_fsm.oneshot(model=model, recipe={"s": {"SparseGPTModifier": {"sparsity": 0.5}}}, dataset=DATA,
                         progress=False)  # fmt: skip
    assert str(info.value) == WHISPER_CALIBRATED
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# --------------------------------------------------------------------------- Mllama: cross-attention layers (issue 24)
def _mllama_image_batches(model, num: int = 2, rows: int = 2, length: int = 24) -> list[dict[str, torch.Tensor]]:
    """Calibration batches with one random image each (every tile, aspect ratio 1x1), as MllamaProcessor lays them
    out: ``pixel_values [B, 1, tiles, C, H, W]``, ``aspect_ratio_ids [B, 1]``, ``aspect_ratio_mask [B, 1, tiles]``,
    ``cross_attention_mask [B, L, 1, tiles]`` (every token sees the image), the image token first."""
    vision = model.config.vision_config
    tiles, gen = vision.max_num_tiles, torch.Generator().manual_seed(1)
    out = []
    for batch in batches(num=num, rows=rows, length=length):
        ids = batch["input_ids"].clone()
        ids[:, 0] = model.config.image_token_index
        size = (rows, 1, tiles, vision.num_channels, vision.image_size, vision.image_size)
        out.append({
            "input_ids": ids,
            "pixel_values": torch.randn(size, generator=gen),
            "aspect_ratio_ids": torch.ones(rows, 1, dtype=torch.long),
            "aspect_ratio_mask": torch.ones(rows, 1, tiles, dtype=torch.long),
            "cross_attention_mask": torch.ones(rows, length, 1, tiles, dtype=torch.long),
        })  # fmt: skip
    return out


def test_mllama_layer_inputs_with_images_equal_the_models_own_forward():
    """With image inputs the model's forward runs the cross-attention layer, and each layer gets its own captured
    arguments (cross_attention_states from the vision tower, cross_attention_mask, full_text_row_masked_out_mask):
    the layer-by-layer last-layer output equals the model's own (bit for bit here)."""
    from test_architectures import _layer_by_layer, _model_last_layer_outputs

    from llmc_fsm.pipeline.forward import capture_layer_inputs

    model = build("mllama")
    _, layers = find_decoder_layers(model)
    assert type(layers[1]).__name__ == "MllamaCrossAttentionDecoderLayer"
    data = _mllama_image_batches(model)
    with torch.no_grad():
        expected = _model_last_layer_outputs(model, layers, data)
        inputs = capture_layer_inputs(model, layers[0], data)
        assert inputs[0][1].per_layer[1][1]["cross_attention_states"] is not None
        for out, ref in zip(_layer_by_layer(layers, inputs), expected, strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["sparsegpt", "gptq"])
def test_mllama_compressed_on_image_batches_reloads(tmp_path, method):
    """SparseGPT 50 % / GPTQ W4A16 g16 through the sequential pipeline (``run_sequential``) on image batches: every
    Linear of the text decoder, the cross-attention layer's included, compressed; the vision tower and projector
    untouched; saved, reloaded with no missing, unexpected or mismatched key, logits (with an image) equal."""
    from llmc_fsm_pruning import SparseGPTModifier
    from llmc_fsm_quantization import GPTQModifier

    from llmc_fsm import Session
    from llmc_fsm.output.save import save_model
    from llmc_fsm.pipeline.sequential import run_sequential

    model = build("mllama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ignore = ["lm_head", "re:.*vision_model.*", "re:.*multi_modal_projector.*"]
    if method == "sparsegpt":
        modifier = SparseGPTModifier(sparsity=0.5, ignore=ignore)
    else:
        modifier = GPTQModifier(scheme={"preset": "W4A16", "weights": {"group_size": 16}}, ignore=ignore)
    data = _mllama_image_batches(model)
    session = Session([modifier])
    session.initialize(model=model, calibration_data=data)
    run_sequential(session, progress=False)
    session.finalize()
    text = [n for n, m in model.named_modules() if ".language_model.layers." in n and isinstance(m, torch.nn.Linear)]
    assert any(".layers.1.cross_attn." in n for n in text)
    for name in text:
        weight = model.get_submodule(name).weight
        if method == "sparsegpt":
            assert int((weight == 0).sum()) == weight.numel() // 2, name
        else:
            assert not torch.equal(weight, before[name + ".weight"]), name
    rest = [k for k in before if ".language_model.layers." not in k]
    assert [k for k in rest if not torch.equal(before[k], model.state_dict()[k])] == []
    out = tmp_path / "o"
    out.mkdir()
    save_model(model, out)
    reloaded, info = transformers.MllamaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(**data[0]).logits, model(**data[0]).logits, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ model directories: the class their config names
def test_the_loader_class_keeps_every_part_the_checkpoint_holds(tmp_path):
    """The config of a saved checkpoint: decoder-only: ``AutoModelForCausalLM``; Whisper (encoder-decoder): its
    ``architectures`` class, not the ``WhisperForCausalLM`` (decoder alone) that ``AutoModelForCausalLM`` maps;
    Qwen2-Audio (no causal-LM Auto mapping): its ``architectures`` class."""
    from llmc_fsm.models.hf_io import model_class

    def saved_config(family):
        build(family).save_pretrained(tmp_path / family)  # writes the config with its architectures
        return transformers.AutoConfig.from_pretrained(tmp_path / family)

    assert model_class(saved_config("llama")) is transformers.AutoModelForCausalLM
    assert model_class(saved_config("whisper")) is transformers.WhisperForConditionalGeneration
    assert model_class(saved_config("qwen2_audio")) is transformers.Qwen2AudioForConditionalGeneration


def test_a_whisper_directory_is_refused_before_its_weights_are_read_not_cut_to_its_decoder(tmp_path, capsys,
                                                                                            monkeypatch):
    """A calibrated job on a Whisper checkpoint directory: refused from the ``meta``-device model, with the in-memory
    model's message, nothing written. Before, ``AutoModelForCausalLM`` built ``WhisperForCausalLM`` and the output
    silently held the decoder alone."""
    from llmc_fsm.cli import main

    build("whisper").save_pretrained(tmp_path / "whisper")
    capsys.readouterr()  # save_pretrained's progress bar
    recipe = tmp_path / "gptq.yaml"
    recipe.write_text("s:\n  GPTQModifier: {targets: [Linear], scheme: W8A8, ignore: [proj_out]}\n")

    def refuse(*args, **kwargs):
        raise AssertionError("the model's weights were read before the refusal")

    monkeypatch.setattr("llmc_fsm.oneshot_job.phases.load_model", refuse)
    monkeypatch.setattr("llmc_fsm.oneshot_job.streaming.load_lazy", refuse)
    argv = ["oneshot", "--model", str(tmp_path / "whisper"), "--recipe", str(recipe), "--no-progress"]
    assert main([*argv, "--output", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == f"llmc-fsm oneshot: error: {WHISPER_CALIBRATED}\n"
    assert not (tmp_path / "out").exists()


def _whisper_inputs(model):
    gen = torch.Generator().manual_seed(3)
    config = model.config
    features = torch.randn(2, config.num_mel_bins, 2 * config.max_source_positions, generator=gen)
    return {"input_features": features, "decoder_input_ids": torch.randint(3, config.vocab_size, (2, 10), generator=gen)}


def test_a_data_free_job_quantizes_every_linear_of_whispers_encoder_and_decoder(tmp_path, capsys, caplog):
    """llm-compressor's Whisper FP8 example is data-free (``oneshot(model=model, recipe=recipe)``, no dataset): the CLI
    runs such a recipe on a Whisper directory in memory (the streamed path would drop the encoder), every Linear of
    encoder and decoder but the ignored ``proj_out`` is quantized, the output reloads with its class and the in-memory
    logits, and the report gives one row per encoder layer. Before, every Whisper job was refused."""
    from llmc_fsm.cli import main

    model = build("whisper")
    model.save_pretrained(tmp_path / "whisper")
    recipe = tmp_path / "w8a8.yaml"
    recipe.write_text("s:\n  QuantizationModifier: {targets: [Linear], scheme: W8A8, ignore: [proj_out]}\n")
    capsys.readouterr()
    assert main(["oneshot", "--model", str(tmp_path / "whisper"), "--recipe", str(recipe), "--no-progress",
                 "--output", str(tmp_path / "out")]) == 0  # fmt: skip
    report = capsys.readouterr().out
    in_memory = llmc_fsm.oneshot(model=build("whisper"), recipe=str(recipe), progress=False)
    reloaded, info = transformers.WhisperForConditionalGeneration.from_pretrained(tmp_path / "out",
                                                                                 output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    quantized = {n for n, m in reloaded.named_modules() if hasattr(m, "quantization_scheme")}
    assert quantized == linears - {"proj_out"}
    assert {n.split(".")[1] for n in quantized} == {"encoder", "decoder"}
    inputs = _whisper_inputs(model)
    with torch.no_grad():
        expected = in_memory.eval()(**inputs).logits
        torch.testing.assert_close(reloaded.eval()(**inputs).logits, expected, rtol=0, atol=0)
        assert not torch.equal(expected, model(**inputs).logits)
    rows = [line.split() for line in report.splitlines() if line.lstrip().startswith("model.encoder.layers.")]
    assert rows == [[f"model.encoder.layers.{i}", "32,768", "0.00%", "int8", "a:int8", "-"] for i in range(6)]
    decoder = [line.split()[0] for line in report.splitlines() if line.lstrip().startswith("model.decoder.layers.")]
    assert decoder == [f"model.decoder.layers.{i}" for i in range(model.config.decoder_layers)]  # not bare indices
    assert not [line for line in report.splitlines() if re.match(r"\s*\d+\s+[\d,]+\s", line)]


def test_a_data_free_whisper_job_with_an_evaluation_text_is_refused_before_any_work(tmp_path, capsys):
    """Perplexity evaluation feeds token ids as ``input_ids``, which Whisper's forward does not take: refused in one
    line before the weights are read, naming what to leave out; nothing written."""
    from llmc_fsm.cli import main

    build("whisper").save_pretrained(tmp_path / "whisper")
    (tmp_path / "eval.txt").write_text("some text to evaluate on\n" * 200)
    capsys.readouterr()
    argv = ["oneshot", "--model", str(tmp_path / "whisper"), "--scheme", "W8A8", "--method", "rtn", "--no-progress",
            "--eval-text", str(tmp_path / "eval.txt"), "--output", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 1
    assert capsys.readouterr().err == (
        "llmc-fsm oneshot: error: WhisperForConditionalGeneration (model_type 'whisper') is an encoder-decoder "
        "model: its decoder layers (model.decoder.layers) attend to the encoder's output, which perplexity "
        "evaluation (token ids as the model's input_ids, --eval-text / eval_text) does not give; it calibrates and "
        "evaluates decoder-only language models (multimodal ones on text, through their language model): not "
        "supported; leave out the evaluation text\n"
    )
    assert not (tmp_path / "out").exists()


def test_whispers_head_is_named_when_the_default_ignore_names_no_module(caplog):
    """A recipe without ``ignore``: the default ``[lm_head]`` names no module of Whisper, whose head is ``proj_out``;
    the line says the head is quantized (it was: llm-compressor's empty default does the same) instead of claiming
    ``lm_head`` is kept dense."""
    model = build("whisper")
    with caplog.at_level("WARNING"):
        out = llmc_fsm.oneshot(model=model, recipe={"s": {"QuantizationModifier": {"scheme": "W8A8"}}}, progress=False)
    assert hasattr(out.proj_out, "quantization_scheme")
    assert [r.getMessage() for r in caplog.records if "no ignore given" in r.getMessage()] == [
        "QuantizationModifier: no ignore given: the default ignore [lm_head] names no module of "
        "WhisperForConditionalGeneration (model_type 'whisper'), so its output head proj_out is quantized like any "
        "target (as llm-compressor's empty default does); give ignore: [proj_out] to keep it dense"
    ]


def test_a_qwen2_audio_directory_runs_in_memory_with_its_audio_tower(tmp_path, capsys):
    """Qwen2-Audio from a directory (no ``AutoModelForCausalLM`` mapping: before, the load failed): the streamed path
    declines it (it would drop the tower), the job runs in memory, and the output holds the whole model: the
    language model's Linears quantized, the tower as it was, reloaded by its class with the in-memory logits."""
    from llmc_fsm.cli import main
    from llmc_fsm.models.lazy import load_lazy

    model = build("qwen2_audio")
    model.save_pretrained(tmp_path / "qwen2_audio")
    with pytest.raises(ValueError, match=r"holds a model AutoModelForCausalLM does not build whole "
                                         r"\(Qwen2AudioForConditionalGeneration, model_type 'qwen2_audio'\): the "
                                         r"streamed path would drop its other parts from the output; run it in memory"):
        load_lazy(tmp_path / "qwen2_audio", torch.float32)
    recipe = tmp_path / "w8a8.yaml"
    ignore = ["lm_head", *TOWERS["qwen2_audio"]]
    recipe.write_text(f"s:\n  QuantizationModifier: {{targets: [Linear], scheme: W8A8, ignore: {ignore}}}\n")
    out = tmp_path / "out"
    argv = ["oneshot", "--model", str(tmp_path / "qwen2_audio"), "--recipe", str(recipe), "--no-progress"]
    assert main([*argv, "--output", str(out)]) == 0
    capsys.readouterr()
    reloaded, info = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    reloaded.eval()
    assert reloaded.config.architectures == ["Qwen2AudioForConditionalGeneration"]
    quantized = {n for n, m in reloaded.named_modules() if hasattr(m, "quantization_scheme")}
    layers_name, _ = find_decoder_layers(reloaded)
    assert quantized == set(_linears(reloaded, layers_name))
    tower = {n: p.detach().clone() for n, p in model.named_parameters() if _is_tower("qwen2_audio", n)}
    got_tower = dict(reloaded.named_parameters())
    assert tower and all(torch.equal(got_tower[n], p) for n, p in tower.items())
    in_memory = llmc_fsm.oneshot(model=model, recipe=str(recipe), dataset=DATA, progress=False)
    with torch.no_grad():
        _assert_reloads(info, in_memory(DATA[:2]).logits, reloaded(DATA[:2]).logits)


def test_explain_with_a_whisper_directory_refuses_a_calibrated_recipe_as_oneshot_does(tmp_path, capsys):
    """``explain RECIPE --model DIR`` runs oneshot's checks: a GPTQ recipe on a Whisper directory gets oneshot's
    refusal (before, explain said "oneshot's checks of --model ... pass"); a data-free one is ready."""
    from llmc_fsm.cli import main

    build("whisper").save_pretrained(tmp_path / "whisper")
    (tmp_path / "gptq.yaml").write_text("s:\n  GPTQModifier: {targets: [Linear], scheme: W8A8, ignore: [proj_out]}\n")
    (tmp_path / "rtn.yaml").write_text("s:\n  QuantizationModifier: {targets: [Linear], scheme: W8A8}\n")
    capsys.readouterr()
    assert main(["explain", str(tmp_path / "gptq.yaml"), "--model", str(tmp_path / "whisper")]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"llmc-fsm explain: error: oneshot would refuse this recipe on --model {tmp_path / 'whisper'}: "
        f"{WHISPER_CALIBRATED}"
    )
    assert main(["explain", str(tmp_path / "rtn.yaml"), "--model", str(tmp_path / "whisper")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "Ready to initialize: every required state key is present."


def test_saving_an_in_memory_whisper_leaves_its_config_an_encoder_decoders(tmp_path):
    """A Whisper built in memory (``from_config``: no ``architectures``) saved by ``oneshot(output_dir=...)``: the
    save's weight-initialisation probe built the model of its config with the causal-LM fallback,
    ``WhisperForCausalLM``, whose ``__init__`` sets ``config.is_encoder_decoder = False`` — on the live config: the
    returned model's ``generate`` failed (KeyError 'input_ids') and the saved config.json said the same."""
    model = build("whisper")
    assert model.config.architectures is None and model.config.is_encoder_decoder
    recipe = {"s": {"QuantizationModifier": {"targets": ["Linear"], "scheme": "W8A8", "ignore": ["proj_out"]}}}
    returned = llmc_fsm.oneshot(model=model, recipe=recipe, output_dir=str(tmp_path / "out"), progress=False)
    assert returned.config.is_encoder_decoder is True
    assert json.loads((tmp_path / "out" / "config.json").read_text())["is_encoder_decoder"] is True
    inputs = _whisper_inputs(model)
    with torch.no_grad():
        generated = returned.generate(input_features=inputs["input_features"], max_new_tokens=2)
    assert generated.shape[0] == inputs["input_features"].shape[0]
