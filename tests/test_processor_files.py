"""A vision-language model's processor with text calibration, and its files in the output directory.

* ``processor=`` / ``tokenizer=`` a processor object (llm-compressor's scripts pass ``AutoProcessor``'s): texts are
  tokenized by its tokenizer (a processor called with the text alone takes it for images);
* a model directory whose processor cannot be loaded (Qwen2-VL's needs torchvision): its processor files are copied
  into the output byte for byte;
* an in-memory model: its processor found from its ``name_or_path``, as llm-compressor finds it, or a warning.

Models: the tiny random ones of ``tiny_families`` with the processors of ``test_multimodal_families``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_multimodal_families import W4A16, _model_dir, _processor, _tokenizer
from tiny_families import build

import llmc_fsm
from llmc_fsm.data.images import copy_processor_files
from llmc_fsm.data.rows import CalibrationRows, row_batches

TEXTS = ["w1 w2 w3 w4 w5 w6 w7 w8", "w20 w21 w22 w23 w24 w25 w26", "w30 w31 w32 w33 w34 w35", "w40 w41 w42 w43 w44"]
QWEN_RECIPE = {"s": {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}},
                                      "ignore": ["lm_head", "re:.*visual.*"]}}}  # fmt: skip
PREPROCESSOR = {"patch_size": 8, "merge_size": 2, "temporal_patch_size": 2, "image_processor_type":
                "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}  # fmt: skip
CHAT_JSON = '{"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}'
PHASES = "llmc_fsm.oneshot_job.phases"


@pytest.fixture(autouse=True)
def _own_perplexity_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMC_FSM_PERPLEXITY_CACHE", str(tmp_path / "ppl-cache"))


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == PHASES and r.levelno == logging.WARNING]


def _qwen2_vl_dir(root: Path) -> Path:
    """A tiny Qwen2-VL directory with the processor files of a Hub checkpoint written by hand (its processor needs
    torchvision for its video processor: AutoProcessor cannot load it here)."""
    directory = root / "qwen2_vl"
    build("qwen2_vl").save_pretrained(directory)
    _tokenizer(["<pad>", "<s>", "</s>", "<unk>"]).save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    (directory / "chat_template.json").write_text(CHAT_JSON)
    (directory / "video_preprocessor_config.json").write_text('{"video_processor_type": "Qwen2VLVideoProcessor"}')
    return directory


def _skip_with_torchvision() -> None:
    if transformers.utils.is_torchvision_available():
        pytest.skip("torchvision is installed: Qwen2VLProcessor loads")


# --------------------------------------------------------------------------- text through a processor
def test_row_batches_of_a_processor_are_its_tokenizers():
    """row_batches(texts, Gemma3Processor) called the processor with the text as its first argument, images:
    transformers' "Incorrect image source" error (found by a tester). The tokens are now its tokenizer's."""
    processor = _processor("gemma3")
    rows = CalibrationRows(source="list of 4 str", column="text", rows=tuple(TEXTS))
    got = row_batches(rows, processor, seq_len=6, batch_size=2)
    expected = [processor.tokenizer(t, truncation=True, max_length=6)["input_ids"] for t in TEXTS]
    assert [b["input_ids"].tolist() for b in got] == [expected[:2], expected[2:3], expected[3:]]
    assert expected[3] == [48, 49, 50, 51, 52]  # w40...: after the 8 special tokens


@pytest.mark.parametrize("family", ["gemma3", "llava"])
@pytest.mark.parametrize("given", ["processor", "tokenizer"])
def test_a_processor_given_with_texts_calibrates_on_its_tokenizers_tokens(tmp_path, family, given):
    """oneshot(in-memory VLM, processor=AutoProcessor object (or tokenizer=), a list of texts, a text file to
    evaluate on, GPTQ) failed in transformers' image loading (found by a tester: the processor was called with the
    text as images). Now: the same weights and perplexities as with the processor's tokenizer given, and the
    output holds the processor (it reloads with AutoProcessor, as llm-compressor saves the processor given)."""
    directory = _model_dir(tmp_path, family)
    processor = transformers.AutoProcessor.from_pretrained(directory)
    eval_file = tmp_path / "eval.txt"
    eval_file.write_text(" ".join(f"w{i}" for i in range(10, 90)) + "\n")
    outs = {}
    for kind, tok in (("processor", processor), ("reference", processor.tokenizer)):
        model = transformers.AutoModelForImageTextToText.from_pretrained(directory)
        outs[kind] = tmp_path / f"out-{kind}"
        given_as = {given: tok} if kind == "processor" else {"tokenizer": tok}
        llmc_fsm.oneshot(model=model, dataset=TEXTS, recipe=W4A16, output_dir=outs[kind], eval_text=str(eval_file),
                         eval_seq_length=16, num_eval_windows=2, progress=False, **given_as)  # fmt: skip
    got, ref = _weights(outs["processor"]), _weights(outs["reference"])
    assert sorted(got) == sorted(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    report = json.loads((outs["processor"] / "report.json").read_text())
    reference = json.loads((outs["reference"] / "report.json").read_text())
    assert report["calibration"]["num_tokens"] == sum(len(processor.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert report["perplexity"] == reference["perplexity"]
    assert report["eval"] == reference["eval"]
    assert type(transformers.AutoProcessor.from_pretrained(outs["processor"])) is type(processor)


# --------------------------------------------------------------------------- a processor that cannot be loaded
def test_a_directory_whose_processor_cannot_load_keeps_its_processor_files(tmp_path, caplog):
    """A Qwen2-VL directory (its processor needs torchvision): the output held the tokenizer's files only, a warning
    said the processor was not saved (found by a tester). Now its processor files are copied byte for byte; the
    chat_template.jinja the tokenizer's save wrote (a given tokenizer's own template) is not overwritten."""
    _skip_with_torchvision()
    directory = _qwen2_vl_dir(tmp_path)
    (directory / "chat_template.jinja").write_text("{{ 'the source template' }}")
    given = _tokenizer(["<pad>", "<s>", "</s>", "<unk>"])
    given.chat_template = "{{ 'the given template' }}"
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger=PHASES):
        llmc_fsm.oneshot(model=str(directory), tokenizer=given, dataset=TEXTS, recipe=QWEN_RECIPE, output_dir=out,
                         progress=False)  # fmt: skip
    copied = ["preprocessor_config.json", "video_preprocessor_config.json", "chat_template.json"]
    assert all((out / name).read_bytes() == (directory / name).read_bytes() for name in copied)
    assert (out / "chat_template.jinja").read_text() == "{{ 'the given template' }}"
    assert _warnings(caplog) == [
        f"{directory}: its processor could not be loaded (ImportError: Qwen2VLVideoProcessor requires the "
        "Torchvision library but it was not found in your environment); its files are copied into the output as "
        "they are, each unless the tokenizer's save writes one of the same name: preprocessor_config.json, "
        "video_preprocessor_config.json, chat_template.json, chat_template.jinja"
    ]


def test_a_failed_save_leaves_no_output_with_copied_processor_files(tmp_path, monkeypatch):
    """A copy that fails part way (a disk full, here the second file) leaves no output directory: the files are
    copied into the run's staging directory, which a failed run removes."""
    _skip_with_torchvision()
    directory = _qwen2_vl_dir(tmp_path)
    real = shutil.copyfile
    calls = []

    def copy_once(src, dst, **kwargs):
        calls.append(Path(dst).name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(src, dst, **kwargs)

    monkeypatch.setattr("llmc_fsm.data.images.shutil.copyfile", copy_once)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space left on device"):
        llmc_fsm.oneshot(model=str(directory), dataset=TEXTS, recipe=QWEN_RECIPE, output_dir=out, progress=False)
    assert calls == ["preprocessor_config.json", "video_preprocessor_config.json"]
    assert not out.exists()
    assert [p for p in tmp_path.rglob("preprocessor_config.json") if directory not in p.parents] == []


def test_copy_processor_files_copies_what_the_destination_lacks(tmp_path):
    """The processor's files of a directory, its named chat templates included, copied byte for byte; one the
    destination holds (the tokenizer's chat_template.jinja) is left as it is; weights and tokenizer files are not
    the processor's."""
    source, destination = tmp_path / "src", tmp_path / "dst"
    (source / "additional_chat_templates").mkdir(parents=True)
    destination.mkdir()
    files = {"processor_config.json": b'{"a": 1}', "preprocessor_config.json": b"{}\n", "chat_template.jinja": b"s",
             "additional_chat_templates/tool.jinja": b"t\r\n", "tokenizer.json": b"{}", "model.safetensors": b"w"}
    for name, data in files.items():
        (source / name).write_bytes(data)
    (destination / "chat_template.jinja").write_bytes(b"tokenizer's")
    assert copy_processor_files(source, destination) == [
        "processor_config.json", "preprocessor_config.json", "additional_chat_templates/tool.jinja"]  # fmt: skip
    copied = {p.relative_to(destination).as_posix(): p.read_bytes() for p in destination.rglob("*") if p.is_file()}
    assert copied == {
        "processor_config.json": b'{"a": 1}', "preprocessor_config.json": b"{}\n",
        "chat_template.jinja": b"tokenizer's", "additional_chat_templates/tool.jinja": b"t\r\n"}  # fmt: skip


# --------------------------------------------------------------------------- an in-memory model
def test_an_in_memory_model_saves_the_processor_of_its_name_or_path(tmp_path):
    """AutoModelForImageTextToText.from_pretrained(dir) with texts and an output directory: the output had no
    processor files, without a warning (found by a tester). Now the processor of its name_or_path is saved, as
    llm-compressor saves it: the same files as the source's processor writes."""
    directory = _model_dir(tmp_path, "gemma3")
    model = transformers.AutoModelForImageTextToText.from_pretrained(directory)
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, dataset=TEXTS, recipe=W4A16, output_dir=out, progress=False)
    assert (out / "processor_config.json").read_bytes() == (directory / "processor_config.json").read_bytes()
    assert type(transformers.AutoProcessor.from_pretrained(out)).__name__ == "Gemma3Processor"


def test_an_in_memory_model_whose_processor_cannot_load_gets_its_files_copied(tmp_path):
    """An in-memory Qwen2-VL loaded from a directory whose processor needs torchvision: its processor files are
    copied from its name_or_path as they are (the output had none, found by a tester)."""
    _skip_with_torchvision()
    directory = _qwen2_vl_dir(tmp_path)
    model = transformers.AutoModelForImageTextToText.from_pretrained(directory)
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, dataset=TEXTS, recipe=QWEN_RECIPE, output_dir=out, progress=False)
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "chat_template.json"):
        assert (out / name).read_bytes() == (directory / name).read_bytes()


def test_an_in_memory_model_without_a_processor_to_find_says_so(tmp_path, caplog):
    """An in-memory VLM whose name_or_path is no directory (built in memory): the output has no processor files,
    and one warning now says so and what to pass (before: nothing said)."""
    model = build("gemma3_vlm")
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger=PHASES):
        llmc_fsm.oneshot(model=model, dataset=torch.randint(8, 90, (4, 8)), recipe=W4A16, output_dir=out,
                         progress=False)  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "recipe.yaml", "report.json"]  # fmt: skip
    assert _warnings(caplog) == [
        "the in-memory vision-language model's processor files (processor_config.json, preprocessor_config.json...) "
        "are not saved with the output: it has no name_or_path; pass processor=AutoProcessor.from_pretrained(<the "
        "model's directory>) (or tokenizer=) to save them"
    ]


def test_an_in_memory_model_given_its_processor_directory_as_text_saves_that_processor(tmp_path):
    """processor="<dir>" (a string, as llm-compressor's scripts pass it) with an in-memory VLM: the output got no
    processor files and nothing was said, while without it the name_or_path's were saved (found by a tester).
    Now the processor of the given directory is saved, as llm-compressor loads AutoProcessor from it."""
    directory = _model_dir(tmp_path, "gemma3")
    model = transformers.AutoModelForImageTextToText.from_pretrained(directory)
    model.name_or_path = model.config._name_or_path = ""  # only the given directory tells where the processor is
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, processor=str(directory), dataset=TEXTS, recipe=W4A16, output_dir=out,
                     progress=False)  # fmt: skip
    assert (out / "processor_config.json").read_bytes() == (directory / "processor_config.json").read_bytes()
    assert type(transformers.AutoProcessor.from_pretrained(out)).__name__ == "Gemma3Processor"


def test_an_audio_model_directory_keeps_its_feature_extractor(tmp_path):
    """Whisper (llm-compressor's FP8_DYNAMIC example): the output had no preprocessor_config.json, so
    AutoProcessor could not read it (found by a tester): the processor was kept for vision-language models only.
    Now a directory holding a feature extractor's config keeps its processor too."""
    directory = tmp_path / "whisper"
    build("whisper").save_pretrained(directory)
    _tokenizer(["<pad>", "<s>", "</s>", "<unk>"]).save_pretrained(directory)
    transformers.WhisperFeatureExtractor(feature_size=build("whisper").config.num_mel_bins).save_pretrained(directory)
    out = tmp_path / "out"
    recipe = {"s": {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}}}
    llmc_fsm.oneshot(model=str(directory), recipe=recipe, output_dir=out, progress=False)
    processor = transformers.AutoProcessor.from_pretrained(out)  # transformers 5 writes it in processor_config.json
    assert type(processor).__name__ == "WhisperProcessor"
    assert processor.feature_extractor.to_dict() == transformers.WhisperFeatureExtractor.from_pretrained(
        directory).to_dict()
