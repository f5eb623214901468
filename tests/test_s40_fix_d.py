"""Session 40, fixer D: the "changed in place" note on a failed run judged from values (a disk-offloaded model, RWKV's
rescale by 2**0, a weight written back as it was); llm-compressor's dataset names spelled as its registry takes them;
``splits=`` with a registered name refused in one line naming both; a dataset's ``pixel_values`` for a model refused
images told to calibrate on text."""

from __future__ import annotations

import pytest
import tiny_families
import tiny_llama
import torch
from test_dataset_objects import FakeDataset

import llmc_fsm
from llmc_fsm.data.rows import registered_dataset, registered_name_error

SGPT = {"s": {"SparseGPTModifier": {"sparsity": 0.5, "targets": ["Linear"], "ignore": ["lm_head", "head"]}}}
GPTQ = {"quant": {"GPTQModifier": {"scheme": "W8A16", "targets": ["Linear"], "ignore": ["lm_head"]}}}
DATA = torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(0))


def _fail(module, args):
    raise RuntimeError("injected failure")


def test_a_refused_disk_offloaded_model_is_not_said_to_be_changed_in_place(tmp_path):
    """Found by a tester: compressed-tensors' disk offload hands out a fresh copy at each access, so the refusal
    carried "the model you passed was changed in place before this error (N modules: ...)" with every weight
    bit-equal (N varying between runs)."""
    from compressed_tensors.offload import offload_module

    model = tiny_llama.llama(seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    (tmp_path / "offload").mkdir()
    for module in model.model.layers[0].modules():
        offload_module(module, "cpu", "disk", offload_dir=str(tmp_path / "offload"))
    with pytest.raises(ValueError, match="offloaded by compressed-tensors to disk") as info:
        llmc_fsm.oneshot(model=model, recipe={"s": {"QuantizationModifier": {"scheme": "W8A8"}}}, progress=False)
    assert getattr(info.value, "__notes__", None) is None
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_rwkvs_rescale_by_one_in_place_is_not_said_to_change_the_model():
    """Found by a tester: RWKV's eval-mode forward divides its blocks' weights by 2**(block // rescale_every) in
    place, 2**0 = 1 for a small model; the version counters moved, and a failed run's note named 4 modules changed
    when no value was."""
    model = tiny_families.build_rwkv()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.rwkv.blocks[0].register_forward_pre_hook(_fail)
    with pytest.raises(RuntimeError) as info:
        llmc_fsm.oneshot(model=model, recipe=SGPT, dataset=DATA, progress=False)
    assert str(info.value) == "injected failure"
    assert getattr(info.value, "__notes__", None) is None
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_changed_in_place_note_names_the_modules_whose_values_changed_only():
    """A weight replaced by an equal copy and one multiplied by 1 in place were named changed beside the one whose
    values did change (the note judged object identity and version counters only)."""
    model = tiny_llama.llama(seed=0)
    attn = model.model.layers[0].self_attn

    def rewrite_then_fail(module, args):
        with torch.no_grad():
            attn.q_proj.weight = torch.nn.Parameter(attn.q_proj.weight.detach().clone())
            attn.k_proj.weight.mul_(1)
            attn.v_proj.weight.mul_(2)
        raise RuntimeError("injected failure")

    model.model.layers[0].register_forward_pre_hook(rewrite_then_fail)
    with pytest.raises(RuntimeError) as info:
        llmc_fsm.oneshot(model=model, recipe=SGPT, dataset=DATA, progress=False)
    assert info.value.__notes__ == [
        "oneshot: the model you passed was changed in place before this error (1 module: "
        "model.layers.0.self_attn.v_proj); reload it before another run."
    ]


ULTRACHAT = (
    "is a dataset name registered in llm-compressor, whose preprocessing of it (prompt template, columns) llmc-fsm "
    "does not reproduce: load the Hub dataset llm-compressor loads, 'HuggingFaceH4/ultrachat_200k'{split}, map its "
    "columns to a 'text' or 'input_ids' column and give it as a datasets.Dataset (Python), or write it with a 'text' "
    "column to a JSONL file (ds.to_json('calibration.jsonl')) and give that file (the CLI's --dataset); a local text "
    "file works too (the Hub id itself is read only when it has a 'text' column)"
)


def test_llmcompressors_dataset_names_are_found_in_any_spelling_its_registry_takes():
    """Found by a tester: llm-compressor's registry looks names up with ``_``, ``-`` and spaces alike and in any case
    (``dataset="ultrachat-200k"`` is verbatim in 4 of its examples); here only the exact key was refused, and
    "ultrachat-200k" went to the Hub as a dataset id (a ConnectionError offline)."""
    spellings = {"ultrachat-200k": "ultrachat_200k", "open-platypus": "open_platypus", "Open_Platypus": "open_platypus",
                 "FLICKR30K": "flickr30k", "Ultrachat": "ultrachat", "cnn dailymail": "cnn_dailymail",
                 "gsm8k": "gsm8k", "HuggingFaceH4/ultrachat_200k": None, "ultrachat200k": None, "c4-en": None}
    assert {name: registered_dataset(name) for name in spellings} == spellings
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(model=tiny_llama.llama(seed=0), recipe=SGPT, dataset="ultrachat-200k", progress=False)
    expected = "dataset (--dataset) 'ultrachat-200k' (llm-compressor's 'ultrachat_200k') " + ULTRACHAT.format(split="")
    assert str(err.value) == expected


def test_splits_with_a_registered_dataset_name_are_refused_in_one_line_naming_both():
    """Found by a tester: ``oneshot(dataset="ultrachat_200k", splits="train_sft")`` was refused for ``splits``
    alone; only once it was removed did the caller learn that the dataset name is not loaded either (for flickr30k,
    that an image-caption directory is to be written)."""
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(model=tiny_llama.llama(seed=0), recipe=SGPT, dataset="ultrachat_200k", splits="train_sft",
                         progress=False)
    split = " with that split (load_dataset('HuggingFaceH4/ultrachat_200k', split='train_sft'))"
    assert str(err.value) == (
        "llm-compressor oneshot argument splits='train_sft' (accepted: None): the split of a dataset name llmc-fsm "
        "does not load; dataset 'ultrachat_200k' " + ULTRACHAT.format(split=split)
        + "; leave splits out: the rows given are the split"
    )
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(model=tiny_llama.llama(seed=0), recipe=SGPT, dataset="flickr30k",
                         splits={"calibration": "test[:512]"}, progress=False)
    assert str(err.value) == (
        "llm-compressor oneshot argument splits=<dict> (accepted: None): the split of a dataset name llmc-fsm does "
        "not load; dataset 'flickr30k' is an image-caption dataset registered in llm-compressor, which llmc-fsm does "
        "not load: write its images and captions to a directory with metadata.jsonl and give that directory as the "
        "dataset, with the model's processor (processor= or tokenizer=), to calibrate on the images as "
        "llm-compressor does (ds = load_dataset('lmms-lab/flickr30k', split='test[:512]'); save each row's 'image' "
        'as DIR/<i>.jpg and write one {"file_name": "<i>.jpg", "text": " ".join(row["caption"])} line per row to '
        'DIR/metadata.jsonl; LLaVA, Gemma 3 and Mllama take images: docs/architectures.md, "Vision-language '
        'models"); leave splits out: the rows given are the split'
    )
    assert registered_name_error("ultrachat_200k") == "'ultrachat_200k' " + ULTRACHAT.format(split="")


def test_image_rows_for_idefics3_are_told_to_calibrate_on_text_not_to_give_an_image_directory():
    """Found by a tester: a processed dataset with ``pixel_values`` for Idefics3 was told "give images as a
    directory with processor=", which Idefics3 is then refused ("image calibration is not tested ...; calibrate its
    language model on text")."""
    model = tiny_families.build("idefics3")
    rows = FakeDataset(input_ids=[[5, 6, 7, 8]] * 4, pixel_values=[[[0.0] * 4] * 3] * 4)
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(model=model, recipe=GPTQ, dataset=rows, progress=False)
    assert str(err.value) == (
        "dataset (--dataset) is a test_dataset_objects.FakeDataset with image / audio inputs ('pixel_values'), which "
        "llmc-fsm does not pass to the model, and Idefics3ForConditionalGeneration (model_type 'idefics3') is a "
        "vision-language model whose image calibration is not tested (image data is for Mllama ('mllama'), LLaVA "
        "('llava'), Gemma 3 ('gemma3')): calibrate its language model on text; remove the columns to calibrate on "
        "the tokens (ds.remove_columns(['pixel_values'])), or give a text/JSONL file, a Hugging Face dataset name or "
        "a LongTensor [N, L] of token ids"
    )
