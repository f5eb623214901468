"""Vision-language models through ``llmc_fsm.oneshot``: image calibration of LLaVA and Gemma 3, the refusals of
the families whose processor cannot be built here, the vision tower kept by a data-free recipe, and a Hub ID's
config read before its weights.

The models are the tiny random ones of ``tiny_families`` (4 text layers of width 64, a 6-layer 16x16-pixel vision
tower of 8x8 patches), saved to a temporary directory with a processor built offline from transformers' own
classes: a word-level ``tokenizers`` tokenizer over the tiny vocabulary (the family's image tokens at the ids of its
config) wrapped in ``PreTrainedTokenizerFast``, and the family's image processor sized to the tower:

* LLaVA: ``LlavaProcessor(CLIPImageProcessor(16x16), patch_size=8)``, ``<image>`` (id 5) expanded to 4 tokens, no
  chat template (the placeholder goes in front of the text);
* Gemma 3: ``Gemma3Processor(Gemma3ImageProcessor(16x16), image_seq_length=4)``, ``<start_of_image>`` (id 6)
  expanded to ``<start_of_image>`` + 4 x ``<image_soft_token>`` (id 5) + ``<end_of_image>``; a chat template that
  writes the user turn's image as ``<start_of_image>`` and its text after it.

``AutoProcessor.from_pretrained`` reads each back from the directory. Images: random RGB PNGs of different sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from test_multimodal_calibration import (
    MLLAMA_NEEDS_IMAGES,
    _image_dir,
    assert_outside_language_layers_unchanged,
    assert_w4_g16,
)
from test_multimodal_calibration import _model_dir as mllama_dir
from tiny_families import VOCAB, build

import llmc_fsm
from llmc_fsm.cli import main
from llmc_fsm.data.images import image_batches, image_prompt, read_image_captions

IGNORE = ["lm_head", "re:.*vision_tower.*", "re:.*vision_model.*", "re:.*multi_modal_projector.*"]
W4A16 = {"s": {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}, "ignore": IGNORE}}}
GEMMA_TEMPLATE = (
    "{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<start_of_image>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}"
)


@pytest.fixture(autouse=True)
def _own_perplexity_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMC_FSM_PERPLEXITY_CACHE", str(tmp_path / "ppl-cache"))


def _words(specials: list[str]) -> list[str]:
    return [f"w{i}" for i in range(VOCAB - len(specials))]


def _tokenizer(specials: list[str], **extra) -> transformers.PreTrainedTokenizerFast:
    """Word-level tokenizer: ``specials`` at ids 0.. (pad, bos, eos, unk first), then the words ``w0``..."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = specials + _words(specials)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=specials[4:], **extra,
    )  # fmt: skip


def _processor(family: str):
    if family == "llava":
        tokenizer = _tokenizer(["<pad>", "<s>", "</s>", "<unk>", "<x>", "<image>"])
        images = transformers.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
        return transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                                           vision_feature_select_strategy="default", image_token="<image>",
                                           num_additional_image_tokens=1)  # fmt: skip
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<x>", "<image_soft_token>", "<start_of_image>", "<end_of_image>"]
    roles = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
    tokenizer = _tokenizer(specials, extra_special_tokens=roles)
    images = transformers.Gemma3ImageProcessor(size={"height": 16, "width": 16})
    return transformers.Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_length=4, chat_template=GEMMA_TEMPLATE
    )


FAMILIES = {"llava": "llava", "gemma3": "gemma3_vlm"}  # test name -> tiny_families name


def _model_dir(root: Path, family: str, processor: bool = True) -> Path:
    model = build(FAMILIES.get(family, family))
    directory = root / family
    model.save_pretrained(directory)
    if processor:
        _processor(family).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm")
    _image_dir(root, words=[f"w{i}" for i in range(100)])  # words every tiny tokenizer here holds
    return root


def _language_linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if ".language_model.layers." in n and isinstance(m, torch.nn.Linear)]


def _reload_and_compare(out: Path, model, batch: dict) -> None:
    """The output reloads as the same class with no missing/unexpected/mismatched key; logits on ``batch`` equal."""
    reloaded, info = transformers.AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert type(reloaded) is type(model)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(**batch).logits, model(**batch).logits, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- image calibration: LLaVA, Gemma 3
@pytest.mark.parametrize(
    ("family", "keys", "prompt"),
    [
        ("llava", ["attention_mask", "input_ids", "pixel_values"], "<image>{}"),
        ("gemma3", ["attention_mask", "input_ids", "pixel_values", "token_type_ids"], "<start_of_image>{}"),
    ],
)
def test_gptq_on_images_compresses_the_language_model_and_reloads(tmp_path, root, family, keys, prompt):
    """oneshot(model directory, image dataset, GPTQ W4A16 g16): the 28 Linears of the 4 language-model layers
    quantized (at most 16 values per group of 16 inputs, none equal to the dense weight), the vision tower, projector,
    embeddings and norms bit-equal; the weights equal Session + run_sequential run by hand on the processor's batches
    (whose prompts are the placeholder then the caption: LLaVA's in front, Gemma 3's through its chat template, both
    expanded to 4 image tokens); the output reloads (AutoModelForImageTextToText, same class, no missing/unexpected
    key), logits on an image batch equal the in-memory model's, the processor saved with it."""
    from llmc_fsm_quantization import GPTQModifier

    from llmc_fsm import Session
    from llmc_fsm.pipeline.sequential import run_sequential

    model_dir, image_dir = _model_dir(tmp_path, family), root / "images"
    out = tmp_path / "out"
    model = llmc_fsm.oneshot(model=str(model_dir), recipe=W4A16, dataset=str(image_dir), num_calibration_samples=6,
                             batch_size=4, output_dir=out, progress=False)  # fmt: skip
    cls = type(transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.from_pretrained(model_dir)))
    assert type(model) is cls
    assert model.llmc_fsm_report.calibration["source"] == f"{image_dir} (images and text)"

    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    captions = read_image_captions(image_dir, 6)
    batches = image_batches(processor, captions, batch_size=4, max_seq_length=256)
    assert sorted(batches[0]) == keys
    assert processor.tokenizer.decode(batches[1]["input_ids"][1], skip_special_tokens=True) == captions.records[5][1]
    image_id = model.config.image_token_id
    assert [int((b["input_ids"] == image_id).sum()) for b in batches] == [16, 8]  # 4 image tokens a row
    assert [image_prompt(processor, c) for _, c in captions.records] == [prompt.format(c) for _, c in captions.records]

    before = cls.from_pretrained(model_dir).state_dict()
    linears = _language_linears(model)
    assert len(linears) == 28
    for name in linears:
        assert_w4_g16(model.get_submodule(name).weight, before[name + ".weight"], name)
    assert_outside_language_layers_unchanged(model, before, "vision_tower")

    ref = cls.from_pretrained(model_dir).eval()
    session = Session([GPTQModifier(**W4A16["s"]["GPTQModifier"])])
    session.initialize(model=ref, calibration_data=list(batches))
    run_sequential(session, progress=False)
    session.finalize()
    assert [n for n in linears if not torch.equal(ref.get_submodule(n).weight, model.get_submodule(n).weight)] == []

    _reload_and_compare(out, model, batches[1])
    assert type(transformers.AutoProcessor.from_pretrained(out)) is type(processor)


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_the_first_decoder_layer_gets_the_image_features_merged(tmp_path, root, family):
    """The pipeline's capture of decoder layer 0's hidden states on an image batch equals what the model's own
    forward gives that layer (``hidden_states[0]``, bit for bit), and differs from the text-only embedding of the
    same token ids exactly at the image tokens (the vision tower's features merged in)."""
    from llmc_fsm.models.layers import find_decoder_layers
    from llmc_fsm.pipeline.forward import capture_layer_inputs

    model = build(FAMILIES[family])
    processor = _processor(family)
    batch = image_batches(processor, read_image_captions(root / "images", 2), batch_size=2, max_seq_length=64)[0]
    _, layers = find_decoder_layers(model)
    with torch.no_grad():
        ((args, kwargs),) = capture_layer_inputs(model, layers[0], [batch])
        captured = args[0] if args else kwargs["hidden_states"]
        own = model(**batch, output_hidden_states=True).hidden_states[0]
        text_only = model(input_ids=batch["input_ids"], output_hidden_states=True).hidden_states[0]
    assert torch.equal(captured, own)
    image = batch["input_ids"] == model.config.image_token_id
    assert int(image.sum()) == 8
    differs = (captured != text_only).any(-1)
    assert torch.equal(differs, image)


def test_gemma3_prompt_comes_from_the_chat_template(tmp_path, root):
    """A caption without ``<start_of_image>`` is the chat template's user turn [image, text]; one holding it is
    used as it is (no second image)."""
    processor = _processor("gemma3")
    assert image_prompt(processor, "w1 w2") == "<start_of_image>w1 w2"
    processor.chat_template = GEMMA_TEMPLATE.replace("<start_of_image>", "<start_of_image> w7 ")
    assert image_prompt(processor, "w1 w2") == "<start_of_image> w7 w1 w2"
    assert image_prompt(processor, "w3 <start_of_image> w4") == "w3 <start_of_image> w4"
    assert image_prompt(_processor("llava"), "w1") == "<image>w1"


# --------------------------------------------------------------------------- refused families
TEXT_HINT = "give a text/JSONL file, a Hugging Face dataset name or a LongTensor [N, L] of token ids"
TORCHVISION = "which llmc-fsm does not install, so its image path was not built or tested"


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        (
            "qwen2_vl",
            "Qwen2VLForConditionalGeneration (model_type 'qwen2_vl') cannot calibrate on images: its processor "
            f"(Qwen2VLProcessor) needs torchvision for its video processor, {TORCHVISION}; calibrate its language "
            f"model on text: {TEXT_HINT}",
        ),
        (
            "mistral3",
            "Mistral3ForConditionalGeneration (model_type 'mistral3') cannot calibrate on images: its processor "
            f"(PixtralProcessor) needs torchvision, {TORCHVISION}; calibrate its language model on text: {TEXT_HINT}",
        ),
        (
            "idefics3",
            "Idefics3ForConditionalGeneration (model_type 'idefics3') is a vision-language model whose image "
            "calibration is not tested (image data is for Mllama ('mllama'), LLaVA ('llava'), Gemma 3 ('gemma3')); "
            f"calibrate its language model on text: {TEXT_HINT}",
        ),
    ],
)
def test_untested_families_are_refused_images_before_the_weights_are_read(tmp_path, root, monkeypatch, family,
                                                                           expected):  # fmt: skip
    """A model directory of a family whose image path is not built here: one line naming it and why, from its
    config (no weight read, no output); the in-memory model: the same line, weights unchanged."""
    model_dir = _model_dir(tmp_path, family, processor=False)
    in_memory = build(family)
    before = {k: v.clone() for k, v in in_memory.state_dict().items()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=in_memory, recipe=W4A16, dataset=str(root / "images"), num_calibration_samples=4,
                         progress=False)  # fmt: skip
    assert str(info.value) == expected
    assert all(torch.equal(before[k], v) for k, v in in_memory.state_dict().items())

    def no_load(*args, **kwargs):
        raise AssertionError("weights read")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", no_load)
    out = tmp_path / "out"
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(model_dir), recipe=W4A16, dataset=str(root / "images"), num_calibration_samples=4,
                         output_dir=out, progress=False)  # fmt: skip
    assert str(info.value) == expected
    assert not out.exists()


def test_a_processor_that_cannot_be_loaded_is_refused_before_the_weights(tmp_path, root, monkeypatch):
    """LLaVA with a Pixtral tower (llm-compressor's Pixtral example) takes PixtralProcessor, which needs torchvision
    (not installed here): the job stops on the processor, before any weight is read, naming the directory and why."""
    pytest.importorskip("PIL")
    if transformers.utils.is_torchvision_available():
        pytest.skip("torchvision is installed: PixtralProcessor loads")
    model_dir = _model_dir(tmp_path, "llava_pixtral", processor=False)
    (model_dir / "processor_config.json").write_text(json.dumps({"processor_class": "PixtralProcessor"}))
    _tokenizer(["<pad>", "<s>", "</s>", "<unk>", "<x>", "[IMG]"]).save_pretrained(model_dir)

    def no_load(*args, **kwargs):
        raise AssertionError("weights read")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", no_load)
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(model_dir), recipe=W4A16, dataset=str(root / "images"), num_calibration_samples=4,
                         progress=False)  # fmt: skip
    assert str(info.value) == (
        f"the processor of {model_dir} could not be loaded (ImportError: PixtralProcessor requires the Torchvision "
        "library but it was not found in your environment); image calibration data needs it (images and text to "
        "model inputs)"
    )


# --------------------------------------------------------------------------- a data-free recipe keeps the tower
def test_data_free_w8a8_on_a_vision_language_directory_keeps_the_vision_tower(tmp_path, root):
    """Round-to-nearest W8A8 (no calibration data) on a Mllama and a LLaVA directory: the model is the
    ...ForConditionalGeneration (AutoModelForImageTextToText), the tower and projector dense and bit-equal, every
    language-model Linear quantized; the output (with the processor's files) reloads as the same class with no
    missing/unexpected key and logits on an image batch equal the in-memory model's."""
    recipe = {"s": {"QuantizationModifier": {"scheme": "W8A8", "ignore": IGNORE}}}
    for family, directory in (("mllama", mllama_dir(tmp_path)), ("llava", _model_dir(tmp_path, "llava"))):
        out = tmp_path / f"out-{family}"
        model = llmc_fsm.oneshot(model=str(directory), recipe=recipe, output_dir=out, progress=False)
        cls = type(build(FAMILIES.get(family, family)))
        assert type(model) is cls
        before = cls.from_pretrained(directory).state_dict()
        state = model.state_dict()
        tower = [k for k in before if "vision_" in k or "multi_modal_projector" in k]
        assert len(tower) > 10 and [k for k in tower if not torch.equal(before[k], state[k])] == []
        for name in _language_linears(model):
            assert model.get_submodule(name).quantization_scheme.input_activations.num_bits == 8, name
            assert not torch.equal(model.get_submodule(name).weight, before[name + ".weight"]), name
        processor = transformers.AutoProcessor.from_pretrained(out)
        batch = image_batches(processor, read_image_captions(root / "images", 2), batch_size=2, max_seq_length=64)[0]
        _reload_and_compare(out, model, batch)


def test_cli_data_free_on_mllama_keeps_the_vision_tower(tmp_path):
    """``llmc-fsm oneshot`` with a data-free recipe (the CLI streams such jobs by default when it can): the output
    is the MllamaForConditionalGeneration with its vision tower."""
    from safetensors import safe_open

    directory = mllama_dir(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"s": {"QuantizationModifier": {"scheme": "W8A8", "ignore": IGNORE}}}))
    out = tmp_path / "out"
    assert main(["oneshot", "--model", str(directory), "--recipe", str(recipe), "--no-progress", "--output",
                 str(out)]) == 0  # fmt: skip
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["MllamaForConditionalGeneration"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert any("vision_model" in n for n in names)
    _, info = transformers.AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())


# --------------------------------------------------------------------------- a Hub ID's config, before its weights
_HUB_SCRIPT = """
import json, sys
import llmc_fsm, transformers

def no_load(*args, **kwargs):
    raise AssertionError("weights read")

transformers.PreTrainedModel.from_pretrained = no_load
try:
    llmc_fsm.oneshot(model="acme/tiny-mllama", dataset=sys.argv[1], progress=False)
except ValueError as err:
    print(json.dumps({"error": str(err)}))
"""


def test_a_hub_id_given_text_for_a_model_that_needs_images_is_refused_before_loading(tmp_path):
    """A Mllama Hub ID in the Hugging Face cache (HF_HUB_OFFLINE=1) with a text file: the config is read from the
    cache and the job refused with the Mllama line before any weight is read."""
    import shutil

    hub = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(mllama_dir(tmp_path), hub / "models--acme--tiny-mllama" / "snapshots" / commit)
    (hub / "models--acme--tiny-mllama" / "refs").mkdir()
    (hub / "models--acme--tiny-mllama" / "refs" / "main").write_text(commit)
    text = tmp_path / "cal.txt"
    text.write_text(" ".join(["w1", "w2", "w3"] * 200), encoding="utf-8")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _HUB_SCRIPT, str(text)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] == MLLAMA_NEEDS_IMAGES.format(family="MllamaForConditionalGeneration")
