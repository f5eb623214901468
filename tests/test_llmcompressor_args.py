"""llm-compressor's ``oneshot`` arguments given to ``llmc_fsm.oneshot`` (llmc_fsm.oneshot_job.llmcompressor_args):
each taken under its llmc-fsm name, taken because it changes nothing, or refused saying what to do — before any
work, nothing on disk. Python used to refuse every one with a bare TypeError."""

from __future__ import annotations

import logging

import pytest
import torch

import llmc_fsm
from llmc_fsm.oneshot_job.llmcompressor_args import LLMCOMPRESSOR_ARGS, check_llmcompressor_args

PRUNE = {"prune": {"SparseGPTModifier": {"sparsity": 0.5, "targets": ["Linear"], "ignore": ["lm_head"]}}}
RTN = {"quant": {"QuantizationModifier": {"scheme": "W8A8", "targets": ["Linear"], "ignore": ["lm_head"]}}}


def test_processor_is_the_tokenizer_and_worker_counts_change_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="llmc_fsm.oneshot_job.llmcompressor_args"):
        out = check_llmcompressor_args(
            {"processor": "tok", "preprocessing_num_workers": 8, "pipeline": "sequential", "save_compressed": True},
            ["model", "tokenizer"],
        )
    assert out == {"tokenizer": "tok"}
    assert [r.getMessage() for r in caplog.records] == [
        "llm-compressor argument preprocessing_num_workers=8 taken: a worker count: it changes no result here",
        "llm-compressor argument pipeline='sequential' taken: llmc-fsm calibrates layer by layer, as "
        "llm-compressor's 'sequential' (data-free recipes read no data)",
        "llm-compressor argument save_compressed=True taken: llmc-fsm writes a quantized model compressed "
        "(compressed-tensors)",
    ]


def test_a_taken_value_is_not_told_to_do_what_it_did_and_a_list_is_shown(caplog):
    """A taken value's line says what llmc-fsm does with it, not to pass it; a refused list was shown as ``<list>``
    (found by a tester, with ``sequential_targets``)."""
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.oneshot_job.llmcompressor_args"):
        check_llmcompressor_args({"pipeline": "sequential"}, ["model"])
    assert [r.getMessage() for r in caplog.records] == [
        "llm-compressor argument pipeline='sequential' taken: llmc-fsm calibrates layer by layer, as "
        "llm-compressor's 'sequential' (data-free recipes read no data)"
    ]
    with pytest.raises(ValueError) as info:
        check_llmcompressor_args({"splits": ["train", "test"]}, ["model"])
    assert str(info.value).startswith("llm-compressor oneshot argument splits=['train', 'test'] (accepted: None): ")


def test_one_refusal_is_one_line_and_several_are_listed_together():
    with pytest.raises(ValueError) as one:
        check_llmcompressor_args({"splits": {"calibration": "train[:5%]"}}, ["model"])
    assert str(one.value) == (
        "llm-compressor oneshot argument splits=<dict> (accepted: None): pass the split's rows themselves: a text/JSONL file, a "
        "datasets.Dataset (load_dataset(...)[split]) or token ids"
    )
    with pytest.raises(ValueError) as several:
        check_llmcompressor_args({"pipeline": "basic", "save_compressed": 1, "moe_calibrate_all_experts": True}, [])
    assert str(several.value).splitlines() == [
        "llm-compressor oneshot arguments llmc-fsm does not take as given:",
        "  - pipeline='basic' (accepted: 'sequential' or 'independent' or 'datafree'): llmc-fsm calibrates layer by "
        "layer (llm-compressor's 'sequential'; data-free recipes read no data, and take 'datafree'), and has no "
        "'basic' or 'layer_sequential' pipeline: leave it out",
        "  - save_compressed=1 (accepted: True): llmc-fsm writes a quantized model compressed (compressed-tensors) only; "
        "leave it out",
        "  - moe_calibrate_all_experts=True (accepted: False): " + LLMCOMPRESSOR_ARGS["moe_calibrate_all_experts"].note,
    ]


def test_llmcompressors_default_data_collator_is_taken_and_padding_refused(caplog):
    """``data_collator="truncation"`` is llm-compressor 0.14's default (``DatasetArguments``); a script passing it was
    refused as if it asked for something else (a breaker's case)."""
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.oneshot_job.llmcompressor_args"):
        assert check_llmcompressor_args({"data_collator": "truncation"}, ["model"]) == {}
    note = LLMCOMPRESSOR_ARGS["data_collator"].note
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [f"llm-compressor argument data_collator='truncation' taken: {note}"]
    assert "no token cut" in note and "batch_size 1" in note
    with pytest.raises(ValueError) as err:
        check_llmcompressor_args({"data_collator": "padding"}, ["model"])
    refused = "llm-compressor oneshot argument data_collator='padding' (accepted: None or 'truncation'): "
    assert str(err.value) == refused + note


def test_unknown_names_are_a_type_error_with_the_closest_name(tmp_path):
    with pytest.raises(TypeError, match=r"^oneshot\(\) got unexpected keyword arguments: 'num_calibration_sample' "
                       r"\(did you mean 'num_calibration_samples'\?\), 'frobnicate'$"):
        llmc_fsm.oneshot("smollm2-135m", RTN, num_calibration_sample=4, frobnicate=1, output_dir=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_through_oneshot_refused_before_any_work_and_processor_taken(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir
    with pytest.raises(ValueError, match=r"^shuffle_calibration_samples=True \(llm-compressor's default: rows drawn at "):
        llmc_fsm.oneshot(str(model_dir), RTN, output_dir=tmp_path / "o", shuffle_calibration_samples=True)
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match=r"^tokenizer is given twice \(also under its llm-compressor name\)"):
        llmc_fsm.oneshot(str(model_dir), RTN, tokenizer=str(model_dir), processor=str(model_dir))
    model = llmc_fsm.oneshot(str(model_dir), RTN, processor=str(model_dir), pipeline="sequential", progress=False,
                             output_dir=tmp_path / "p", precision="bfloat16", splits=None)
    assert (tmp_path / "p" / "tokenizer.json").exists() and model.llmc_fsm_report is not None
    assert model.dtype == torch.bfloat16  # precision is the dtype
    with pytest.raises(ValueError, match=r"^dtype is given twice \(also under its llm-compressor name\)"):
        llmc_fsm.oneshot(str(model_dir), RTN, dtype="float16", precision="bfloat16")
    # the default's own value given explicitly is given too (before, precision silently won over dtype="float32")
    with pytest.raises(ValueError, match=r"^dtype is given twice \(also under its llm-compressor name\)"):
        llmc_fsm.oneshot(str(model_dir), RTN, dtype="float32", precision="bfloat16")
    with pytest.raises(ValueError, match=r"^device is given twice \(also under its llm-compressor name\)"):
        llmc_fsm.oneshot(str(model_dir), RTN, device="auto", oneshot_device="cpu")


def test_sequential_targets_naming_the_decoder_layers_is_taken_and_another_unit_refused(tiny_model_dir, tmp_path,
                                                                                         caplog):
    """15 of llm-compressor's example scripts pass ``sequential_targets=["LlamaDecoderLayer"]`` (or their family's
    layer class): what llmc-fsm calibrates anyway, taken with one line (it was refused: "leave it out"). Another unit
    (attention and MLP blocks apart) is refused before any work, for a directory (on its config) and a model."""
    from transformers import AutoModelForCausalLM

    model_dir, text = tiny_model_dir
    refusal = (
        "sequential_targets=['LlamaAttention', 'LlamaMLP'] (llm-compressor's unit of sequential calibration): "
        "llmc-fsm calibrates the model's decoder layers (model.layers: LlamaDecoderLayer) one at a time and no other "
        "unit; pass sequential_targets=['LlamaDecoderLayer'] or leave it out"
    )
    in_memory = AutoModelForCausalLM.from_pretrained(model_dir)
    for model in (str(model_dir), in_memory):
        with pytest.raises(ValueError) as info:
            llmc_fsm.oneshot(model, RTN, output_dir=tmp_path / "o", sequential_targets=["LlamaAttention", "LlamaMLP"],
                             progress=False)  # fmt: skip
        assert str(info.value) == refusal
        assert not (tmp_path / "o").exists()
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.oneshot_job.phases"):
        llmc_fsm.oneshot(str(model_dir), RTN, sequential_targets=["LlamaDecoderLayer"], progress=False)
    assert [r.getMessage() for r in caplog.records if "sequential_targets" in r.getMessage()] == [
        "sequential_targets=['LlamaDecoderLayer'] taken: the decoder layers (model.layers) are what llmc-fsm "
        "calibrates one at a time (this recipe calibrates nothing)"  # RTN W8A8: data-free
    ]


def test_an_encoder_decoder_model_is_refused_as_such_before_its_sequential_targets():
    """In memory, the sequential_targets refusal came first and its advice ("pass ['WhisperDecoderLayer']") led
    straight into the encoder-decoder refusal (a tester's case); as for a directory, that one comes first now."""
    from tiny_families import build

    data = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    gptq = {"s": {"GPTQModifier": {"scheme": "W8A16", "targets": ["Linear"], "ignore": ["proj_out"]}}}
    with pytest.raises(ValueError, match=r"encoder-decoder"):
        llmc_fsm.oneshot(build("whisper"), gptq, data, progress=False,
                         sequential_targets=["WhisperEncoderLayer", "WhisperDecoderLayer"])  # fmt: skip


def test_an_in_memory_model_finds_its_tokenizer_from_where_it_was_loaded(tiny_model_dir, tmp_path):
    # llm-compressor's scripts load the model themselves and pass no tokenizer: oneshot takes the model's own, from
    # its name_or_path, as llm-compressor does; a model built in memory has none and is refused as before
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, text = tiny_model_dir
    texts = [text.read_text()[:2000], text.read_text()[2000:4000]]
    found = llmc_fsm.oneshot(AutoModelForCausalLM.from_pretrained(model_dir), PRUNE, dataset=texts,
                             max_seq_length=32, progress=False)
    given = llmc_fsm.oneshot(AutoModelForCausalLM.from_pretrained(model_dir), PRUNE, dataset=texts,
                             max_seq_length=32, tokenizer=AutoTokenizer.from_pretrained(model_dir), progress=False)
    assert found.llmc_fsm_report.calibration == given.llmc_fsm_report.calibration
    assert torch.equal(found.model.layers[0].mlp.up_proj.weight, given.model.layers[0].mlp.up_proj.weight)
    built = AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(model_dir).config)
    built.name_or_path = built.config._name_or_path = ""  # from_config copies the loaded config's path
    with pytest.raises(ValueError, match=r"^an in-memory model needs tokenizer= to tokenize text \(or pass dataset as a "
                       r"LongTensor of token ids\); its name_or_path has no tokenizer llmc-fsm can load \(no "
                       r"tokenizer files here, or one that is its repository's own code\)$"):
        llmc_fsm.oneshot(built, PRUNE, dataset=texts, max_seq_length=32, output_dir=tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()


def test_an_evaluation_window_longer_than_the_model_names_where_its_length_comes_from(tiny_model_dir):
    """A tensor dataset and no max_seq_length: the calibration takes the tensor's columns, the evaluation windows
    the default 256; the refusal named --seq-len, which the caller never gave (a docs breaker's case)."""
    import json

    model_dir, text = tiny_model_dir
    limit = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    data = torch.randint(3, 100, (4, 16))
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(str(model_dir), PRUNE, dataset=data, eval_text=str(text), progress=False)
    assert str(info.value) == (
        "evaluation window length 256 (the default: set eval_seq_length, or max_seq_length / --seq-len) is above "
        f"the model's max_position_embeddings ({limit}); use at most {limit}"
    )
    with pytest.raises(ValueError, match=r"^the dataset tensor's length 300 \(its columns; max_seq_length, --seq-len, "):
        llmc_fsm.oneshot(str(model_dir), PRUNE, dataset=torch.randint(3, 100, (4, 300)), progress=False)


def test_another_model_revision_is_refused_naming_the_snapshot_way():
    """It said "llmc-fsm loads a local directory or known name", where Hub IDs load too (a tester's case)."""
    with pytest.raises(ValueError) as info:
        check_llmcompressor_args({"model_revision": "abc123"}, ["model"])
    assert str(info.value) == (
        "llm-compressor oneshot argument model_revision='abc123' (accepted: 'main'): llmc-fsm loads a Hub ID at its "
        "main revision (or a local directory, or a known name): pass that revision's snapshot directory as the model "
        "instead (huggingface_hub.snapshot_download(ID, revision=...) gives it)"
    )


def test_moe_calibrate_all_experts_false_is_taken_as_what_it_asks(caplog):
    """``moe_calibrate_all_experts=False`` (llm-compressor's autoround MXFP8 example passes it) was taken with the
    refusal's advice, "set calibrate_all_experts: true on the modifier instead", though False is what llmc-fsm does
    (found by a tester)."""
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.oneshot_job.llmcompressor_args"):
        assert check_llmcompressor_args({"moe_calibrate_all_experts": False}, ["model"]) == {}
    assert [r.getMessage() for r in caplog.records] == [
        "llm-compressor argument moe_calibrate_all_experts=False taken: llmc-fsm routes each token to its own experts "
        "(its default), as asked"
    ]
