"""``Embedding`` targets: weight-only round-to-nearest of ``nn.Embedding`` ([vocab, hidden]) on a 2-layer random
Llama with untied embeddings; scales against a hand computation, the grid, save -> reload with transformers giving
the in-memory logits exactly, and refusals of what does not apply to an embedding."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_quant_models import tiny_llama

import llmc_fsm
from llmc_fsm_quantization import load_kv_cache_scales

W4_G32 = {"preset": "W4A16", "weights": {"group_size": 32}}
W4_ASYM_G32 = {"preset": "W4A16_ASYM", "weights": {"group_size": 32}}
INT8_CHANNEL = {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}


def _hand(weight: torch.Tensor, bits: int, group: int | None, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized weight, scale) of round-to-nearest, float64, per row (channel) or per row and group."""
    w = weight.double()
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group) if group else w.reshape(rows, 1, cols)
    q_min, q_max = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    if symmetric:
        scale = torch.maximum(lo.abs(), hi) / ((q_max - q_min) / 2)
        zero = torch.zeros_like(scale)
    else:
        scale = (hi - lo) / (q_max - q_min)
        zero = (q_min - lo / scale).round().clamp(q_min, q_max)
    q = (g / scale + zero).round().clamp(q_min, q_max)
    return ((q - zero) * scale).reshape(rows, cols), scale.squeeze(-1)


def _assert_reported(model, bits: int, group: int | None, label: str) -> None:
    """The one-shot report lists the quantized embedding outside the layers, with its bits, group size and label."""
    report = model.llmc_fsm_report
    (row,) = [m for m in report.modules if m.name == "model.embed_tokens"]
    assert (row.layer, row.bits, row.group_size, row.numel, row.quantized) == (None, bits, group, 128 * 64, label)
    rows = [line.split("  ") for line in report.format_table().splitlines() if line.startswith("model.embed_tokens")]
    assert [[cell.strip() for cell in row if cell.strip()] for row in rows] == [
        ["model.embed_tokens", "8,192", "0.00%", label, "-"]
    ]


@pytest.mark.parametrize(("scheme", "bits", "group", "symmetric", "label"), [
    (W4_G32, 4, 32, True, "int4/g32"), (W4_ASYM_G32, 4, 32, False, "int4/g32 asym"),
    (INT8_CHANNEL, 8, None, True, "int8"),
])
def test_an_embedding_is_quantized_by_round_to_nearest_and_reloads(tmp_path, scheme, bits, group, symmetric,
                                                                   label) -> None:
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    emb = model.model.embed_tokens
    original = emb.weight.detach().clone()
    out = tmp_path / "out"
    recipe = {"q": {"QuantizationModifier": {"scheme": scheme, "targets": ["Embedding", "Linear"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, output_dir=out, progress=False)
    expected, scale = _hand(original, bits, group, symmetric)
    torch.testing.assert_close(emb.weight_scale.double(), scale, rtol=1e-6, atol=0)
    # the grid of the stored (float32) scale and zero point: float32 rounding, as the checkpoint decompresses
    s, z = emb.weight_scale.float(), emb.weight_zero_point.float()
    rows, cols = original.shape
    cols_per = group or cols
    g = original.reshape(rows, -1, cols_per)
    q = (g / s.unsqueeze(-1) + z.unsqueeze(-1)).round().clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    assert torch.equal(emb.weight, ((q - z.unsqueeze(-1)) * s.unsqueeze(-1)).reshape(rows, cols))
    torch.testing.assert_close(emb.weight.double(), expected, rtol=0, atol=float(scale.max()) * 1.0001)  # <= 1 step
    _assert_reported(model, bits, group, label)
    per_group = emb.weight.reshape(emb.weight.shape[0], -1, group or emb.weight.shape[1])
    assert max(len(torch.unique(row)) for rows in per_group for row in rows) <= 2**bits
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = config["config_groups"].values()
    (embedding_group,) = [g for g in groups if {"model.embed_tokens", "Embedding"} & set(g["targets"])]
    assert embedding_group["format"] == "int-quantized"  # not packed: see the next test
    assert embedding_group["input_activations"] is None
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, model(x).logits)


def test_a_packed_embedding_checkpoint_is_what_transformers_cannot_reload(tmp_path, monkeypatch) -> None:
    # why embeddings are saved int-quantized: the pack-quantized form fails in transformers 5.24's weight init
    from compressed_tensors.config import CompressionFormat
    from transformers import AutoModelForCausalLM

    import llmc_fsm.output.save as save

    model = tiny_llama()
    recipe = {"q": {"QuantizationModifier": {"scheme": W4_G32, "targets": ["Embedding"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, progress=False)

    def keep_packed(modules):
        for sub in modules.values():
            sub.quantization_scheme.format = CompressionFormat.pack_quantized

    monkeypatch.setattr(save, "unpacked_embeddings", keep_packed)
    out = tmp_path / "packed"
    out.mkdir()
    save.save_model(model, out)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    with pytest.raises(AttributeError, match="'Embedding' object has no attribute 'weight'"):
        AutoModelForCausalLM.from_pretrained(out)


INT8_TENSOR = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"}
#: llm-compressor's tests/llmcompressor/transformers/compression/recipes/new_quant_simple.yaml: static int8 inputs
#: on the Linears (calibrated), the Embedding weight-only
SIMPLE = {"QuantizationModifier": {"ignore": ["lm_head"], "config_groups": {
    "group_0": {"weights": INT8_TENSOR, "targets": ["Linear"], "input_activations": {
        "num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor"}},
    "group_1": {"weights": INT8_TENSOR, "targets": ["Embedding"]}}}}
#: new_quant_weight.yaml: a QuantizationModifier config over Linear and Embedding, then a bare GPTQModifier taking it
WEIGHT = {"QuantizationModifier": {"ignore": ["lm_head", "model.layers.0.mlp.down_proj"], "config_groups": {
    "group_0": {"weights": INT8_TENSOR, "targets": ["Linear", "Embedding"]}}}, "GPTQModifier": {"block_size": 128}}
KV = {"QuantizationModifier": {"scheme": W4_G32, "targets": ["Embedding", "Linear"], "kv_cache_scheme": {
    "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}}}


@pytest.mark.parametrize(("stage", "bits", "group", "label"), [
    (SIMPLE, 8, None, "int8/tensor"), (WEIGHT, 8, None, "int8/tensor"), (KV, 4, 32, "int4/g32"),
])
def test_an_embedding_in_a_calibrated_modifier_is_rounded_to_nearest_after_the_layers(tmp_path, stage, bits, group,
                                                                                       label):
    """llm-compressor's recipes that quantize the Embedding beside calibrated Linears (static input scales, GPTQ,
    a KV-cache scheme; before, refused): the embedding is rounded to nearest, its scale equal to the hand
    computation and its values on the stored scale's grid, within one step of the float64 hand rounding (GPTQ has
    no Hessian to act on for one-hot inputs); it is quantized at calibration end, so the decoder layers calibrate on
    the float embedding: every other weight equals that of the same recipe without the Embedding target; the
    checkpoint reloads with the in-memory logits."""
    from transformers import AutoModelForCausalLM

    data = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    model = tiny_llama()
    original = model.model.embed_tokens.weight.detach().clone()
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, recipe={"q": stage}, dataset=data, output_dir=out, progress=False)
    emb = model.model.embed_tokens
    expected, scale = _hand(original, bits, group, True)  # per group of a row
    if group is None:  # per tensor: one scale over the whole matrix
        scale = (original.abs().max().double() / ((2**bits - 1) / 2)).reshape(1)
        expected = torch.clamp(torch.round(original.double() / scale), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * scale
    torch.testing.assert_close(emb.weight_scale.double().flatten(), scale.flatten(), rtol=1e-6, atol=0)
    s = emb.weight_scale.float().reshape(-1, 1) if group is None else emb.weight_scale.float().unsqueeze(-1)
    g = original.reshape(1, -1) if group is None else original.reshape(original.shape[0], -1, group)
    q = torch.clamp(torch.round(g / s), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    assert torch.equal(emb.weight, (q * s).reshape(original.shape))  # on the grid of the stored scale
    torch.testing.assert_close(emb.weight.double(), expected, rtol=0, atol=float(scale.max()) * 1.0001)  # <= 1 step
    _assert_reported(model, bits, group, label)
    without = tiny_llama()
    dense = json.loads(json.dumps(stage))  # the same recipe without the Embedding target
    for spec in dense.values():
        if "targets" in spec:
            spec["targets"] = [t for t in spec["targets"] if t != "Embedding"]
        groups = spec.get("config_groups", {})
        for name, group in list(groups.items()):
            group["targets"] = [t for t in group["targets"] if t != "Embedding"]
            if not group["targets"]:
                del groups[name]
    llmc_fsm.oneshot(model=without, recipe={"q": dense}, dataset=data, progress=False)
    assert not hasattr(without.model.embed_tokens, "weight_scale")
    for name, param in without.named_parameters():
        assert torch.equal(param, model.get_parameter(name)) or name == "model.embed_tokens.weight", name
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    if "kv_cache_scheme" in stage["QuantizationModifier"]:  # transformers does not apply the KV-cache scales itself
        assert load_kv_cache_scales(reloaded, out) == 2
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, model(x).logits)


def test_imatrix_mse_on_an_embedding_rounds_with_minmax_and_says_so(tmp_path, caplog) -> None:
    """Found by a tester: imatrix_mse (the inputs' importance) on an Embedding rounded with minmax (there is no
    importance of token ids) while the saved config said imatrix_mse. Now a warning says so, the embedding's config
    group records minmax, and its values are minmax round-to-nearest (equal to a minmax run's)."""
    import logging

    data = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    runs = {}
    for observer in ("imatrix_mse", "minmax"):
        model = tiny_llama()
        stage = {"QuantizationModifier": {"scheme": W4_G32, "targets": ["Embedding", "Linear"], "observer": observer}}
        with caplog.at_level(logging.WARNING):
            llmc_fsm.oneshot(model=model, recipe={"q": stage}, dataset=data, output_dir=tmp_path / observer,
                             progress=False)  # fmt: skip
        runs[observer] = model.model.embed_tokens.weight.detach().clone()
    assert (
        "QuantizationModifier: model.embed_tokens: imatrix_mse weights the error by the calibration inputs' "
        "importance, which an Embedding's token-id inputs do not give: rounded with minmax (so recorded in the saved "
        "config)" in caplog.text
    )
    assert torch.equal(runs["imatrix_mse"], runs["minmax"])
    config = json.loads((tmp_path / "imatrix_mse" / "config.json").read_text())["quantization_config"]
    observers = {tuple(g["targets"]): g["weights"]["observer"] for g in config["config_groups"].values()}
    assert observers[("model.embed_tokens",)] == "minmax"
    assert set(observers.values()) == {"minmax", "imatrix_mse"}  # the Linears keep theirs


def test_an_embedding_in_a_calibrated_modifier_is_refused_with_low_memory(tmp_path) -> None:
    """The streamed path writes the tensors outside the layers before compressing any: an Embedding target of a
    calibrating modifier is refused there before any work, saying so."""
    directory = tmp_path / "model"
    tiny_llama().save_pretrained(directory)
    data = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(
            model=str(directory), recipe={"q": SIMPLE}, dataset=data, output_dir=tmp_path / "o", low_memory=True,
            progress=False,
        )  # fmt: skip
    assert str(info.value) == (
        "low_memory (--low-memory) cannot run this job: QuantizationModifier: an Embedding target is quantized when "
        "the calibration ends, after the streamed path wrote the tensors outside the decoder layers; run without "
        "low_memory"
    )
    assert not (tmp_path / "o").exists()
    by_name = {"q": {"QuantizationModifier": {**SIMPLE["QuantizationModifier"], "config_groups": {
        "group_0": SIMPLE["QuantizationModifier"]["config_groups"]["group_0"],
        "group_1": {"weights": INT8_TENSOR, "targets": ["re:.*embed_tokens$"]}}}}}  # fmt: skip
    with pytest.raises(ValueError) as info:  # selected by name: refused once the targets are known
        llmc_fsm.oneshot(
            model=str(directory), recipe=by_name, dataset=data, output_dir=tmp_path / "o", low_memory=True,
            progress=False,
        )  # fmt: skip
    assert str(info.value) == (
        "QuantizationModifier targets model.embed_tokens, outside the decoder layers (model.layers); the sequential "
        "pipeline calibrates only the decoder layers and the output head. The streamed path (low_memory; the "
        "command's default when the job allows it) writes the tensors outside the layers before compressing any: run "
        "in memory (--in-memory; Python: low_memory=False), or add them to the modifier's ignore list."
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("stage", [SIMPLE, {"QuantizationModifier": {"scheme": W4_G32, "targets": ["Embedding", "Linear"]}}])
def test_the_command_runs_an_embedding_recipe_in_memory_by_default(tmp_path, stage) -> None:
    """``llmc-fsm oneshot`` streams a job by default when it can: an Embedding target (of a calibrating modifier, or
    data-free) makes it run in memory instead (found by testers: it streamed, then refused, naming --low-memory)."""
    import sys
    from pathlib import Path

    import yaml
    from transformers import AutoModelForCausalLM

    from llmc_fsm.cli import main

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    import tiny_llama as words  # a tiny Llama with a word-level tokenizer trained on its calibration text

    directory, text = words.build_with_text(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(directory)  # untied, so that the embedding is not ignored with lm_head
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(directory)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"q": stage}))
    assert main(words.oneshot_argv(directory, text, tmp_path / "o", "--recipe", str(recipe))) == 0
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "o")
    assert hasattr(reloaded.model.embed_tokens, "weight_scale")  # quantized in the checkpoint


@pytest.mark.parametrize(("modifier", "args", "message"), [
    ("QuantizationModifier", {"scheme": "FP8_DYNAMIC", "targets": ["Embedding"]},
     "an Embedding's inputs are token ids: quantize its weight only (e.g. W8A16, W4A16): model.embed_tokens"),
    ("QuantizationModifier", {"scheme": "NVFP4A16", "targets": ["Embedding"]},
     "an Embedding is quantized with int weights or FP8 per channel / tensor only (not NVFP4, MX, block): "
     "model.embed_tokens"),
    ("AutoRoundModifier", {"scheme": W4_G32, "targets": ["Embedding", "Linear"]},  # found by a tester: refused late
     "AutoRound tunes the decoder layers' Linears on their output error: quantize the embedding with a "
     "QuantizationModifier (round-to-nearest, weight only) in the same stage: model.embed_tokens"),
])
def test_what_does_not_apply_to_an_embedding_is_refused_before_any_work(modifier, args, message) -> None:
    model = tiny_llama()
    before = model.model.embed_tokens.weight.detach().clone()
    data = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"q": {modifier: args}}, dataset=data, progress=False)
    assert message in str(info.value)
    assert torch.equal(model.model.embed_tokens.weight, before)
    assert not hasattr(model.model.embed_tokens, "quantization_scheme")


def test_a_tied_embedding_is_ignored_with_lm_head() -> None:
    model = tiny_llama(tied=True)
    recipe = {"q": {"QuantizationModifier": {"scheme": W4_G32, "targets": ["Embedding", "Linear"]}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, progress=False)
    assert not hasattr(model.model.embed_tokens, "quantization_scheme")  # tied to the ignored lm_head
    assert hasattr(model.model.layers[0].mlp.up_proj, "quantization_scheme")


def test_a_tied_model_with_its_embedding_and_head_targeted_quantizes_both_untied(tmp_path, caplog) -> None:
    """Tied Llama, targets Linear and Embedding, ignore []: as llm-compressor 0.14 (``untie_word_embeddings`` when the
    targets hold an embedding), the head is untied and both are quantized, each on its own weight. Until session 31
    the head was left in float as "tied to model.embed_tokens" without a word. The saved config unties them and the
    reload gives the in-memory logits."""
    from transformers import AutoModelForCausalLM

    model = tiny_llama(tied=True)
    assert model.config.tie_word_embeddings
    embedding = model.model.embed_tokens.weight.detach().clone()
    recipe = {"q": {"QuantizationModifier": {"scheme": W4_G32, "targets": ["Linear", "Embedding"], "ignore": []}}}
    with caplog.at_level("WARNING"):
        llmc_fsm.oneshot(model=model, recipe=recipe, output_dir=tmp_path / "out", progress=False)
    assert (
        "QuantizationModifier: the head lm_head is tied to the input embedding: untied (its own copy of the weight; "
        "config tie_word_embeddings false) so that each of them is quantized on its own (as llm-compressor)"
    ) in caplog.messages
    bits = {m.name: m.bits for m in model.llmc_fsm_report.modules}
    assert bits["model.embed_tokens"] == 4 and bits["lm_head"] == 4
    _, scale = _hand(embedding, 4, 32, True)
    for module in (model.model.embed_tokens, model.lm_head):  # each from the float weight, on the same grid
        torch.testing.assert_close(module.weight_scale.double(), scale, rtol=1e-6, atol=0)
    assert torch.equal(model.model.embed_tokens.weight, model.lm_head.weight)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["ignore"] == []
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)
