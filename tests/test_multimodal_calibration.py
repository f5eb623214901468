"""Image calibration data through ``llmc_fsm.oneshot`` and ``llmc-fsm oneshot`` (issue 24, Mllama).

The model is the tiny random Mllama of ``tiny_families`` (4 text layers, layer 1 a cross-attention layer; a vision
tower of 16x16-pixel tiles, up to 4 tiles), saved to a temporary directory with a processor built offline:
``MllamaProcessor(MllamaImageProcessor(size 16x16, max_image_tiles 4), tokenizer)``, the tokenizer a word-level
``tokenizers`` model over the tiny vocabulary (``<|image|>`` at id 5, the config's ``image_token_index``) wrapped in
``PreTrainedTokenizerFast``; ``AutoProcessor.from_pretrained`` reads it back from the directory. The images are
small random RGB PNGs of different sizes (so the processor picks different tile layouts), written in an
image-caption directory (``metadata.jsonl``, :mod:`llmc_fsm.data.images`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tiny_families import VOCAB, build

import llmc_fsm
from llmc_fsm.cli import main
from llmc_fsm.data.images import ImageBatches, image_batches, read_image_captions

IGNORE = ["lm_head", "re:.*vision_model.*", "re:.*multi_modal_projector.*"]
WORDS = [f"w{i}" for i in range(VOCAB - 6)]


@pytest.fixture(autouse=True)
def _own_perplexity_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMC_FSM_PERPLEXITY_CACHE", str(tmp_path / "ppl-cache"))


def _processor(model) -> transformers.MllamaProcessor:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = ["<pad>", "<s>", "</s>", "<unk>", "<|python_tag|>", "<|image|>", *WORDS]
    assert vocab.index("<|image|>") == model.config.image_token_index
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|image|>", "<|python_tag|>"],
    )  # fmt: skip
    vision = model.config.vision_config
    images = transformers.MllamaImageProcessor(
        size={"height": vision.image_size, "width": vision.image_size}, max_image_tiles=vision.max_num_tiles
    )
    return transformers.MllamaProcessor(image_processor=images, tokenizer=tokenizer)


def _model_dir(root: Path) -> Path:
    model = build("mllama")
    directory = root / "mllama"
    model.save_pretrained(directory)
    _processor(model).save_pretrained(directory)
    return directory


def _image_dir(root: Path, num: int = 6, words: list[str] = WORDS) -> Path:
    """``num`` random RGB PNGs (heights 10..35, widths 12..42 pixels) with captions of 4..9 of ``words``."""
    from PIL import Image

    directory = root / "images"
    (directory / "img").mkdir(parents=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(num):
        pixels = rng.integers(0, 256, (10 + 5 * i, 42 - 6 * i, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(directory / "img" / f"{i}.png")
        caption = " ".join(rng.choice(words, size=4 + i))
        lines.append(json.dumps({"file_name": f"img/{i}.png", "text": caption}))
    (directory / "metadata.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mm")
    return _model_dir(root), _image_dir(root)


def assert_w4_g16(weight: torch.Tensor, dense: torch.Tensor, name: str) -> None:
    """4-bit groups of 16 inputs: at most 16 values per group, not the dense weight."""
    groups = weight.detach().reshape(weight.shape[0], -1, 16)
    assert max(len(torch.unique(g)) for row in groups for g in row) <= 16, name
    assert not torch.equal(weight, dense), name


def assert_outside_language_layers_unchanged(model, before: dict, tower: str) -> None:
    """Every tensor outside the language-model layers (``tower``, the projector, embeddings, norms) bit-equal."""
    state = model.state_dict()
    rest = [k for k in before if ".language_model.layers." not in k]
    assert any(tower in k for k in rest) and any("multi_modal_projector" in k for k in rest)
    assert [k for k in rest if not torch.equal(before[k], state[k])] == []


def _text_linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if ".language_model.layers." in n and isinstance(m, torch.nn.Linear)]


def test_image_batches_are_the_processors_tensors(dirs):
    """The batches are the processor's own output on the records (image token put in front), 4 then 2 rows."""
    from PIL import Image

    model_dir, image_dir = dirs
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    captions = read_image_captions(image_dir, 6)
    batches = image_batches(processor, captions, batch_size=4, max_seq_length=64)
    assert isinstance(batches, ImageBatches)
    assert [tuple(b["input_ids"].shape) for b in batches] == [(4, 9), (2, 11)]
    assert batches.shape == (6, 11)
    assert batches.numel() == sum(4 + i + 2 for i in range(6))  # caption + <|image|> + bos
    assert sorted(batches[0]) == sorted(
        ["input_ids", "attention_mask", "pixel_values", "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask"]
    )
    texts = [f"<|image|>{text}" for _, text in captions.records[4:]]
    images = [[Image.open(image_dir / name).convert("RGB")] for name, _ in captions.records[4:]]
    ref = processor(text=texts, images=images, padding=True, return_tensors="pt")
    assert all(torch.equal(ref[k], batches[1][k]) for k in batches[1])
    assert batches[1]["pixel_values"].shape == (2, 1, 4, 3, 16, 16)
    assert isinstance(batches[1:], ImageBatches)
    assert batches[:0].shape == (0, 0)


@pytest.mark.parametrize("method", ["gptq", "sparsegpt"])
def test_oneshot_on_images_compresses_every_text_linear_and_reloads(tmp_path, dirs, method):
    """oneshot(model directory, image dataset): the 28 Linears of the 4 text layers (the cross-attention layer's
    q/k/v/o among them) compressed, the vision tower, projector, embeddings and norms bit-equal; the result equals
    the sequential pipeline run by hand on the processor's batches (bit for bit); saved with its processor, reloaded
    by transformers with no missing/unexpected key, logits on an image batch equal the in-memory model's."""
    from llmc_fsm_pruning import SparseGPTModifier
    from llmc_fsm_quantization import GPTQModifier

    from llmc_fsm import Session
    from llmc_fsm.pipeline.sequential import run_sequential

    model_dir, image_dir = dirs
    if method == "gptq":
        recipe = {
            "s": {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}, "ignore": IGNORE}}
        }
    else:
        recipe = {"s": {"SparseGPTModifier": {"sparsity": 0.5, "ignore": IGNORE}}}
    out = tmp_path / "out"
    model = llmc_fsm.oneshot(model=str(model_dir), recipe=recipe, dataset=str(image_dir), num_calibration_samples=6,
                             batch_size=4, output_dir=out, progress=False)  # fmt: skip
    assert type(model).__name__ == "MllamaForConditionalGeneration"
    before = transformers.MllamaForConditionalGeneration.from_pretrained(model_dir).state_dict()
    text = _text_linears(model)
    assert len(text) == 28
    cross = [n for n in text if ".layers.1.cross_attn." in n]
    assert [n.rsplit(".", 1)[1] for n in cross] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    for name in text:
        weight = model.get_submodule(name).weight
        if method == "sparsegpt":
            assert int((weight == 0).sum()) == weight.numel() // 2, name
        else:
            assert_w4_g16(weight, before[name + ".weight"], name)
    assert_outside_language_layers_unchanged(model, before, "vision_model")
    assert model.llmc_fsm_report.calibration["num_samples"] == 6

    # the same pipeline by hand, on the processor's batches: the same weights
    ref = transformers.MllamaForConditionalGeneration.from_pretrained(model_dir).eval()
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    batches = image_batches(processor, read_image_captions(image_dir, 6), batch_size=4, max_seq_length=256)
    modifier = SparseGPTModifier if method == "sparsegpt" else GPTQModifier
    session = Session([modifier(**next(iter(recipe["s"].values())))])
    session.initialize(model=ref, calibration_data=list(batches))
    run_sequential(session, progress=False)
    session.finalize()
    assert [n for n in text if not torch.equal(ref.get_submodule(n).weight, model.get_submodule(n).weight)] == []

    reloaded, info = transformers.MllamaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert type(transformers.AutoProcessor.from_pretrained(out)).__name__ == "MllamaProcessor"
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(**batches[1]).logits, model(**batches[1]).logits, rtol=0, atol=1e-5)


def test_cli_dataset_directory_of_images(tmp_path, dirs, capsys):
    """``llmc-fsm oneshot --dataset DIR`` (DIR with metadata.jsonl) calibrates on the images: it runs in memory (the
    streamed path reads text; said in the log) and the output reloads with every text Linear at 50 % zeros."""
    model_dir, image_dir = dirs
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"s": {"SparseGPTModifier": {"sparsity": 0.5, "ignore": IGNORE}}}), encoding="utf-8")
    out = tmp_path / "out"
    eval_text = tmp_path / "eval.txt"
    eval_text.write_text(" ".join(WORDS * 4), encoding="utf-8")
    argv = ["oneshot", "--model", str(model_dir), "--dataset", str(image_dir), "--recipe", str(recipe),
            "--num-samples", "4", "--eval-text", str(eval_text), "--eval-windows", "2", "--seq-len", "32",
            "--no-progress", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    reloaded = transformers.MllamaForConditionalGeneration.from_pretrained(out)
    for name in _text_linears(reloaded):
        weight = reloaded.get_submodule(name).weight
        assert int((weight == 0).sum()) == weight.numel() // 2, name
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert report["calibration"]["source"] == f"{image_dir} (images and text)"
    assert report["calibration"]["num_samples"] == 4
    # perplexity before/after on text: the model's own forward on token ids (cross-attention layers skipped)
    assert 1 < report["perplexity"]["before"] < 1e4 and 1 < report["perplexity"]["after"] < 1e4


def test_low_memory_with_images_is_refused(tmp_path, dirs):
    model_dir, image_dir = dirs
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(model_dir), dataset=str(image_dir), num_calibration_samples=4, low_memory=True,
                         output_dir=tmp_path / "out", progress=False)  # fmt: skip
    assert str(info.value) == (
        "low_memory (--low-memory) cannot run this job: it calibrates on token windows of text; image calibration "
        "data runs in memory (drop --low-memory)"
    )


# --------------------------------------------------------------------------- refusals, before any work
MLLAMA_NEEDS_IMAGES = (
    "{family} (model_type 'mllama') has cross-attention decoder layers [1] that read the vision tower's output, "
    "which text calibration data (token ids) does not run: give image calibration data, a directory with "
    'metadata.jsonl, one {{"file_name": image, "text": caption}} per line (dataset=, --dataset; '
    'docs/architectures.md, "Mllama")'
)


def test_mllama_with_text_is_refused_before_the_weights_are_read(tmp_path, dirs, monkeypatch):
    """A Mllama directory with a text file: one line naming the model and what to give; no weights read, no output."""
    model_dir, _ = dirs
    text = tmp_path / "cal.txt"
    text.write_text(" ".join(WORDS * 20), encoding="utf-8")

    def no_load(*args, **kwargs):
        raise AssertionError("weights read")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", no_load)
    out = tmp_path / "out"
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(model_dir), dataset=str(text), output_dir=out, progress=False)
    assert str(info.value) == MLLAMA_NEEDS_IMAGES.format(family="MllamaForConditionalGeneration")
    assert not out.exists()


def test_in_memory_mllama_with_token_ids_is_refused_and_unchanged():
    model = build("mllama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = torch.randint(6, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, dataset=data, progress=False)
    assert str(info.value) == MLLAMA_NEEDS_IMAGES.format(family="MllamaForConditionalGeneration")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_cli_mllama_with_text_exits_1_with_the_line(tmp_path, dirs, capsys):
    model_dir, _ = dirs
    text = tmp_path / "cal.txt"
    text.write_text(" ".join(WORDS * 20), encoding="utf-8")
    out = tmp_path / "out"
    assert (
        main(["oneshot", "--model", str(model_dir), "--dataset", str(text), "--no-progress", "--output", str(out)]) == 1
    )
    expected = MLLAMA_NEEDS_IMAGES.format(family="MllamaForConditionalGeneration")
    assert capsys.readouterr().err.splitlines()[-1] == f"llmc-fsm oneshot: error: {expected}"
    assert not out.exists()


def test_text_model_with_images_is_refused(dirs):
    model = build("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _, image_dir = dirs
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, dataset=str(image_dir), num_calibration_samples=4, progress=False)
    assert str(info.value) == (
        f"LlamaForCausalLM (model_type 'llama') calibrates on text: the image dataset {image_dir} is for "
        "vision-language models (Mllama ('mllama'), LLaVA ('llava'), Gemma 3 ('gemma3')); give a text/JSONL file, a "
        "Hugging Face dataset name or a LongTensor [N, L] of token ids"
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_in_memory_mllama_with_images_needs_its_processor(dirs):
    _, image_dir = dirs
    model = build("mllama")
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, dataset=str(image_dir), num_calibration_samples=4, progress=False)
    assert str(info.value) == (
        "image calibration data needs the model's processor (images and text to model inputs): pass "
        "tokenizer=AutoProcessor.from_pretrained(<model directory>) or the model directory (model=, --model)"
    )


def test_in_memory_mllama_with_its_processor_runs(dirs):
    """An nn.Module with ``tokenizer=`` its processor (llm-compressor's way): the cross-attention layer compressed."""
    model_dir, image_dir = dirs
    model = transformers.MllamaForConditionalGeneration.from_pretrained(model_dir).eval()
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    recipe = {"s": {"SparseGPTModifier": {"sparsity": 0.5, "ignore": IGNORE}}}
    llmc_fsm.oneshot(model=model, tokenizer=processor, recipe=recipe, dataset=str(image_dir),
                     num_calibration_samples=2, progress=False)  # fmt: skip
    weight = model.model.language_model.layers[1].cross_attn.k_proj.weight
    assert int((weight == 0).sum()) == weight.numel() // 2


def test_image_dataset_errors_name_the_file_and_line(tmp_path, dirs):
    _, image_dir = dirs
    with pytest.raises(ValueError) as info:
        read_image_captions(image_dir, 7)
    assert str(info.value) == (
        f"the image dataset {image_dir} has 6 records but 7 calibration samples were asked for; lower --num-samples "
        "/ num_calibration_samples to at most 6 or add records"
    )
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "w1"}\n{"image": "b.png"}\n', encoding="utf-8")
    with pytest.raises(FileNotFoundError) as missing:
        read_image_captions(bad, 1)
    assert str(missing.value) == f"{bad / 'metadata.jsonl'}:1: image file not found: {bad / 'a.png'}"
    (bad / "a.png").write_bytes((image_dir / "img" / "0.png").read_bytes())
    assert read_image_captions(bad, 1).records == (("a.png", "w1"),)
    with pytest.raises(ValueError) as fields:
        read_image_captions(bad, 2)
    assert str(fields.value) == (
        f'{bad / "metadata.jsonl"}:2: expected a JSON object with string "file_name" and "text" fields'
    )
    (bad / "metadata.jsonl").write_text('{"file_name": "a.png",\n', encoding="utf-8")
    with pytest.raises(ValueError) as syntax:
        read_image_captions(bad, 1)
    assert (
        str(syntax.value)
        == f"{bad / 'metadata.jsonl'}:1: invalid JSON (Expecting property name enclosed in double quotes at column 23)"
    )


def test_images_with_a_known_text_model_name_are_refused(dirs):
    _, image_dir = dirs
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model="smollm2-135m", dataset=str(image_dir), num_calibration_samples=4, progress=False)
    assert str(info.value) == (
        f"image calibration data ({image_dir}) needs a local model directory or a loaded model (model=, --model); "
        "'smollm2-135m' is a known text model or a Hub ID"
    )


def test_a_data_free_recipe_on_mllama_needs_no_images(tmp_path, dirs):
    """Round-to-nearest W4A16 takes no calibration data: Mllama runs as before, an image directory given is unused."""
    model_dir, image_dir = dirs
    recipe = {
        "s": {"QuantizationModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}, "ignore": IGNORE}}
    }
    model = llmc_fsm.oneshot(model=str(model_dir), recipe=recipe, dataset=str(image_dir), progress=False)
    assert (
        model.llmc_fsm_report.calibration["source"]
        == "none (no modifier needs calibration data; the dataset given is not used)"
    )


def test_the_resume_fingerprint_follows_the_records_and_the_image_bytes(tmp_path, dirs):
    """``ImageCaptions.digest`` (the fingerprint's calibration data): the same for the same files, changed by one
    byte of an image or one caption."""
    import shutil

    _, image_dir = dirs
    copy = tmp_path / "copy"
    shutil.copytree(image_dir, copy)
    digest = read_image_captions(image_dir, 2).digest()
    assert read_image_captions(copy, 2).digest() == digest
    image = copy / "img" / "1.png"
    raw = bytearray(image.read_bytes())
    raw[-20] ^= 1
    image.write_bytes(bytes(raw))
    assert read_image_captions(copy, 2).digest() != digest
    assert read_image_captions(copy, 1).digest() == read_image_captions(image_dir, 1).digest()
    lines = (image_dir / "metadata.jsonl").read_text(encoding="utf-8").replace('"text": "', '"text": "w0 ', 1)
    (copy / "metadata.jsonl").write_text(lines, encoding="utf-8")
    assert read_image_captions(copy, 1).digest() != read_image_captions(image_dir, 1).digest()
