"""``dataset=`` as llm-compressor's examples pass it: a list of texts, a ``datasets.Dataset`` (duck-typed: a fake
one here, ``datasets`` is not a dependency) with an ``input_ids`` or ``text`` column; a ``DatasetDict``, another
object and llm-compressor's registered names refused in one line; ``num_calibration_samples`` / ``max_seq_length``
acting on a token tensor when given."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import tiny_llama
import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import llmc_fsm
from llmc_fsm.cli.main import main
from llmc_fsm.data.rows import TokenRows, read_rows, row_batches
from llmc_fsm.oneshot_job.data import DEFAULT_PROMPTS, describe

RECIPE = {"s": {"SparseGPTModifier": {"sparsity": 0.5, "targets": ["Linear"], "ignore": ["lm_head"]}}}


class FakeDataset:
    """What one-shot reads of a ``datasets.Dataset``: ``column_names``, ``len()``, ``ds[i]`` -> row dict."""

    def __init__(self, **columns):
        self.columns = columns
        self.column_names = list(columns)

    def __len__(self):
        return len(next(iter(self.columns.values())))

    def __getitem__(self, index):
        return {name: values[index] for name, values in self.columns.items()}


class DatasetDict(dict):
    pass


class RecordingTokenizer:
    """Tokenizes ``"a b c"`` to ``[len(word) for word]`` and records the keyword arguments of each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, text, **kw):
        self.calls.append(kw)
        ids = [len(word) for word in text.split()]
        return {"input_ids": ids[: kw["max_length"]] if kw.get("truncation") else ids}


def _ids(batches):
    return [(b["input_ids"].tolist(), b["attention_mask"].tolist() if "attention_mask" in b else None) for b in batches]


# --------------------------------------------------------------------------- rows -> batches
def test_input_ids_rows_are_cut_and_batched_by_equal_length():
    ds = FakeDataset(input_ids=[[1, 2, 3], [4, 5, 6], [7, 8, 9, 10, 11], [12, 13], [14]], other=list("abcde"))
    rows = read_rows(ds, None, None)
    assert (rows.column, rows.rows) == ("input_ids", ((1, 2, 3), (4, 5, 6), (7, 8, 9, 10, 11), (12, 13), (14,)))
    batches = row_batches(rows, None, seq_len=None, batch_size=2)
    assert isinstance(batches, TokenRows)
    assert _ids(batches) == [([[1, 2, 3], [4, 5, 6]], None), ([[7, 8, 9, 10, 11]], None), ([[12, 13]], None), ([[14]], None)]
    assert (batches.shape, batches.numel(), batches.lengths()) == ((5, 5), 14, [3, 3, 5, 2, 1])
    assert isinstance(batches[:1], TokenRows) and batches[:0].shape == (0, 0)
    # the first 3 rows, each cut to 4 tokens; batch size 1
    cut = row_batches(read_rows(ds, 3, 4), None, seq_len=4, batch_size=1)
    assert _ids(cut) == [([[1, 2, 3]], None), ([[4, 5, 6]], None), ([[7, 8, 9, 10]], None)]


def test_padding_under_attention_mask_zeros_is_left_out_before_the_cut():
    # right and left padding: only the tokens under 1s are samples (padding never enters the statistics)
    ds = FakeDataset(input_ids=[torch.tensor([[5, 6, 7, 0]]), [0, 0, 8, 9, 4]], attention_mask=[[1, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert read_rows(ds, None, None).rows == ((5, 6, 7), (8, 9, 4))
    batches = row_batches(read_rows(ds, None, 2), None, seq_len=2, batch_size=8)
    assert _ids(batches) == [([[5, 6], [8, 9]], None)]
    for mask, message in (
        ([[1, 0, 1, 1], [1, 1, 1, 1, 1]], "dataset row 0: 'attention_mask' has zeros between ones (padding inside the row)"),
        ([[1, 1, 1, 1], [0, 0, 0, 0, 0]], "dataset row 1: 'attention_mask' is all zeros: the row holds no token"),
        ([[1, 1, 1, 2], [1, 1, 1, 1, 1]], "dataset row 0: 'attention_mask' must hold 0 and 1 only, got [2]"),
        ([[1, 1, 1], [1, 1, 1, 1, 1]], "dataset row 0: 'attention_mask' has 3 values for 4 token ids"),
    ):
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            read_rows(FakeDataset(input_ids=[[5, 6, 7, 0], [0, 0, 8, 9, 4]], attention_mask=mask), None, None)
    with pytest.raises(ValueError, match="^dataset row 0: 'input_ids' holds no token ids: drop empty rows"):
        read_rows(FakeDataset(input_ids=[[]]), None, None)


def test_texts_are_tokenized_as_llmcompressor_tokenizes_a_text_column():
    tok = RecordingTokenizer()
    batches = row_batches(read_rows(["aa b ccc", "dddd"], None, None), tok, seq_len=2, batch_size=4)
    assert _ids(batches) == [([[2, 1]], None), ([[4]], None)]
    # llm-compressor: processor(text, padding=False, max_length=max_seq_length, truncation=True), add_special_tokens
    # left to the tokenizer (True)
    assert tok.calls == [{"padding": False, "truncation": True, "max_length": 2}] * 2
    whole = row_batches(read_rows(FakeDataset(text=["a bb ccc"]), None, None), tok, seq_len=None, batch_size=4)
    assert _ids(whole) == [([[1, 2, 3]], None)] and tok.calls[-1] == {"padding": False, "truncation": False}


def test_shuffle_calibration_samples_false_takes_llmcompressors_order():
    """llm-compressor 0.14 with ``shuffle_calibration_samples=False`` (its ``LengthAwareSampler``) calibrates on the N
    longest rows, longest first; here the first N were taken in their order (found by a tester: static input scales
    and KV scales up to 63% apart; equal to 5e-7 once in its order). The tester's measurement with llm-compressor
    0.14.0.1: rows of 20/32/7/32/1/15 tokens, N=3 -> it calibrated on the rows of 32, 32 and 20 tokens; 32 rows of
    one length come in torch.argsort's order there (16, 31, 30, 29, ... on torch 2.13, CPU)."""
    lengths = [20, 32, 7, 32, 1, 15]
    ds = FakeDataset(input_ids=[[i] * n for i, n in enumerate(lengths)])
    rows = read_rows(ds, 3, None, longest=True)
    assert [row[0] for row in rows.rows] in ([1, 3, 0], [3, 1, 0])  # the two of 32 in argsort's order, then 20
    assert [len(row) for row in rows.rows] == [32, 32, 20]
    assert [row[0] for row in read_rows(ds, 3, None).rows] == [0, 1, 2]  # without it: the first ones, in order
    same = FakeDataset(input_ids=[[i] * 4 for i in range(32)])
    assert [row[0] for row in read_rows(same, None, None, longest=True).rows][:4] == [16, 31, 30, 29]
    # padding counts in the length as llm-compressor's sampler reads it; the tokens under the mask are the sample
    padded = FakeDataset(input_ids=[[1, 2, 0, 0, 0], [3, 4, 5]], attention_mask=[[1, 1, 0, 0, 0], [1, 1, 1]])
    assert read_rows(padded, 1, None, longest=True).rows == ((1, 2),)
    # texts: ordered by their token counts once tokenized (cut to max_seq_length, as llm-compressor tokenizes them)
    texts = ["a", "a b c d", "a b", "a b c"]
    batches = row_batches(read_rows(texts, 2, 3, longest=True), RecordingTokenizer(), seq_len=3, batch_size=1)
    assert [b["input_ids"].shape[1] for b in batches] == [3, 3]  # "a b c d" (cut to 3) and "a b c", not "a", "a b c d"
    with pytest.raises(ValueError, match=r"^shuffle_calibration_samples=True \(llm-compressor's default"):
        llmc_fsm.oneshot(dataset=ds, shuffle_calibration_samples=True)
    with pytest.raises(ValueError, match=r"^shuffle_calibration_samples must be False or None, got 0$"):
        llmc_fsm.oneshot(dataset=ds, shuffle_calibration_samples=0)


def test_describe_names_the_kind_in_one_line():
    assert describe(["a", "b"]) == "list of 2 str"
    assert describe(FakeDataset(text=["a"])) == "test_dataset_objects.FakeDataset"
    assert describe(torch.zeros(2, 3, dtype=torch.long)) == "<tensor (2, 3)>"


# --------------------------------------------------------------------------- refusals, before any work
@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"dataset": DatasetDict(train=FakeDataset(text=["a"]), test=FakeDataset(text=["b"]))},
            "dataset (--dataset) is a test_dataset_objects.DatasetDict of splits 'train', 'test': pass one split, "
            "e.g. dataset=ds['train']",
        ),
        (
            {"dataset": {"text": "a\nb"}},
            "dataset (--dataset) must be a text/JSONL file, a Hugging Face dataset name, a LongTensor [N, L] of token "
            "ids, a list of texts (str) or a datasets.Dataset with an 'input_ids' or 'text' column, got a dict",
        ),
        ({"dataset": ["a", 3]}, "dataset (--dataset) is a list whose item 1 is a int: pass a list of texts (str)"),
        ({"dataset": []}, "dataset (--dataset) is an empty list: pass at least one text"),
        (
            {"dataset": FakeDataset(messages=[[]], prompt=["p"])},
            "dataset (--dataset) is a test_dataset_objects.FakeDataset with columns 'messages', 'prompt' but neither "
            "'input_ids' (token ids) nor 'text': map it to one, e.g. ds.map(lambda s: {'text': ...})",
        ),
        (
            {"dataset": "open_platypus"},
            "dataset (--dataset) 'open_platypus' is a dataset name registered in llm-compressor, whose preprocessing "
            "of it (prompt template, columns) llmc-fsm does not reproduce: load the Hub dataset llm-compressor "
            "loads, 'garage-bAInd/Open-Platypus', map its columns to a 'text' or 'input_ids' column and give it as "
            "a datasets.Dataset (Python), or write it with a 'text' column to a JSONL file (ds.to_json('calibration.jsonl')) "
            "and give that file (the CLI's --dataset); a local text file works too (the Hub id itself is read only when it "
            "has a 'text' column)",
        ),
        (
            {"dataset": FakeDataset(input_ids=[[1, 2]], attention_mask=[[1, 1]], pixel_values=[[[0.5]]])},
            "dataset (--dataset) is a test_dataset_objects.FakeDataset with image / audio inputs ('pixel_values'), "
            "which llmc-fsm does not pass to the model (it reads 'input_ids' or 'text'): calibrating on the tokens "
            "alone would skip them; give images as a directory with processor= (docs/oneshot.md; audio calibration "
            "data is not supported), or remove the columns to calibrate on the text",
        ),
        (
            {"dataset": torch.zeros(8, 16, dtype=torch.long), "num_calibration_samples": 9},
            "num_calibration_samples (--num-samples) 9 is more than the 8 rows of the dataset tensor (8, 16); pass at "
            "most 8, or leave it out to use them all",
        ),
        (
            {"dataset": torch.zeros(8, 16, dtype=torch.long), "max_seq_length": 10000},
            "max_seq_length (--seq-len) 10000 is more than the 16 columns (tokens) of the dataset tensor (8, 16); "
            "pass at most 16, or leave it out to use them all",
        ),
        (  # a tester's case: the loader was named, what to pass instead was not
            {"dataset": torch.utils.data.DataLoader([[1, 2]], batch_size=1)},
            "dataset (--dataset) must be a text/JSONL file, a Hugging Face dataset name, a LongTensor [N, L] of token "
            "ids, a list of texts (str) or a datasets.Dataset with an 'input_ids' or 'text' column, got a "
            "torch.DataLoader: pass the rows it loads (its .dataset); llmc-fsm batches them itself (batch_size=)",
        ),
        (  # a tester's case: it said "got a list" of a list of floats
            {"dataset": FakeDataset(input_ids=[[1.0, 2.0]])},
            "dataset row 0: 'input_ids' must be a list of token ids (int), got a list of floating-point values",
        ),
    ],
)
def test_bad_datasets_are_refused_in_one_line_before_any_work(tmp_path, monkeypatch, kw, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(tmp_path / "no-model"), output_dir=tmp_path / "out", progress=False, **kw)
    assert str(info.value) == message
    assert list(tmp_path.iterdir()) == []


def test_rows_are_refused_the_streamed_path(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir
    with pytest.raises(ValueError, match=r"^low_memory \(--low-memory\) cannot run this job: it calibrates on token "
                       r"windows \(\[N, L\]\); calibration data given as a list of texts or a datasets.Dataset runs "
                       r"in memory \(drop low_memory, or pass a LongTensor \[N, L\] of token ids\)$"):  # fmt: skip
        llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=["w001 w002"], low_memory=True,
                         output_dir=tmp_path / "o", progress=False)  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_a_sample_longer_than_the_models_positions_is_refused(tiny_model_dir):
    model_dir, _ = tiny_model_dir  # max_position_embeddings 128
    long = " ".join(["w001"] * 130)
    with pytest.raises(ValueError, match=r"^calibration sample 1 of the dataset has 130 tokens, above the model's "
                       r"max_position_embeddings \(128\): pass max_seq_length \(--seq-len\) of at most 128 to cut"):  # fmt: skip
        llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=["w002", long], progress=False)
    # max_seq_length caps the samples: above the positions, refused only where a sample is longer than them (before,
    # any cap above 128 was, whatever the samples: found by a tester)
    with pytest.raises(ValueError, match=r"^calibration sample 1 of the dataset has 130 tokens"):
        llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=["w002", long], max_seq_length=8192,
                         progress=False)  # fmt: skip
    llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=["w002", "w003 w004"], max_seq_length=8192,
                     progress=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"^sequence length 200 \(--seq-len / eval\) is above the model's "):
        llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=torch.ones(2, 300, dtype=torch.long),
                         max_seq_length=200, progress=False)  # fmt: skip


# --------------------------------------------------------------------------- end to end on a tiny model
def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_list_of_texts_calibrates_as_its_token_ids_do(tiny_model_dir):
    model_dir, _ = tiny_model_dir
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["w001 w002 w003 w004 w005 w006", "w007 w008 w009", "w010 w011 w012 w013 w014 w015 w016 w017", "w018"]
    ids = [tok(t)["input_ids"] for t in texts]
    assert [len(i) for i in ids] == [6, 3, 8, 1]  # this tokenizer adds no special token
    run = llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=texts, num_calibration_samples=3,
                           max_seq_length=7, progress=False)  # fmt: skip
    calibration = run.llmc_fsm_report.calibration
    assert calibration == {
        "source": "list of 4 str, 3 texts tokenized (3-7 tokens)",
        "num_samples": 3,
        "seq_len": 7,
        "num_tokens": 6 + 3 + 7,
    }
    same = llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=FakeDataset(input_ids=[i[:7] for i in ids[:3]]),
                            progress=False)  # fmt: skip
    assert same.llmc_fsm_report.calibration["source"] == "test_dataset_objects.FakeDataset, 3 rows of 'input_ids' (3-7 tokens)"
    assert _same(_weights(run), _weights(same))
    fewer = llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=texts[:2], max_seq_length=7, progress=False)
    assert not _same(_weights(run), _weights(fewer))


def test_texts_are_cut_at_the_tokenizers_model_max_length_and_its_settings_are_restored(tiny_model_dir, tmp_path,
                                                                                         caplog):
    """Two of a tester's cases against llm-compressor 0.14 (TextGenerationDataset): texts were cut at max_seq_length
    above the tokenizer's model_max_length, and not cut at all without max_seq_length, where llm-compressor cuts at
    model_max_length; and the call's truncation stayed set in the fast tokenizer, given or saved beside the model
    (its tokenizer.json then cut every text to max_seq_length tokens)."""
    model_dir, _ = tiny_model_dir
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.model_max_length = 4
    texts = ["w001 w002 w003 w004 w005 w006", "w007 w008 w009", "w010 w011 w012 w013 w014 w015 w016 w017"]
    for given in ({"max_seq_length": 7}, {}):
        caplog.clear()
        with caplog.at_level("WARNING", logger="llmc_fsm.data.rows"):
            run = llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=texts, tokenizer=tok, progress=False,
                                   output_dir=tmp_path / str(len(given)), **given)  # fmt: skip
        assert run.llmc_fsm_report.calibration["source"] == "list of 3 str, 3 texts tokenized (3-4 tokens)"
        assert [r.getMessage() for r in caplog.records] == (
            ["max_seq_length 7 is above the tokenizer's model_max_length 4: texts are cut to 4 tokens, as "
             "llm-compressor cuts them"] if given else []
        )
        assert (tok.backend_tokenizer.truncation, tok.backend_tokenizer.padding) == (None, None)
        saved = json.loads((tmp_path / str(len(given)) / "tokenizer.json").read_text())
        assert (saved["truncation"], saved["padding"]) == (None, None)
    tok.backend_tokenizer.enable_truncation(max_length=100)  # the caller's own setting is kept as it was
    llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=texts, tokenizer=tok, max_seq_length=3,
                     progress=False)  # fmt: skip
    assert tok.backend_tokenizer.truncation["max_length"] == 100


def test_input_ids_rows_of_different_lengths_calibrate_every_token(tiny_model_dir):
    model_dir, _ = tiny_model_dir
    rows = [list(range(3, 3 + n)) for n in (20, 12, 20, 5)]
    ds = FakeDataset(input_ids=rows, attention_mask=[[1] * len(r) for r in rows])
    run = llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=ds, progress=False)
    assert run.llmc_fsm_report.calibration == {
        "source": "test_dataset_objects.FakeDataset, 4 rows of 'input_ids' (5-20 tokens)",
        "num_samples": 4,
        "seq_len": 20,
        "num_tokens": 57,
    }
    first = llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=ds, num_calibration_samples=1, progress=False)
    assert first.llmc_fsm_report.calibration["num_tokens"] == 20
    assert not _same(_weights(run), _weights(first))
    # the same rows padded to 20 at the right under attention_mask zeros: the same samples, weights and report
    padded = FakeDataset(input_ids=[r + [0] * (20 - len(r)) for r in rows],
                         attention_mask=[[1] * len(r) + [0] * (20 - len(r)) for r in rows])
    again = llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=padded, progress=False)
    assert again.llmc_fsm_report.calibration == run.llmc_fsm_report.calibration
    assert _same(_weights(run), _weights(again))


def test_a_tensor_is_cut_to_the_given_sizes_and_used_whole_otherwise(tiny_model_dir):
    model_dir, _ = tiny_model_dir
    tensor = torch.randint(3, 100, (8, 32), generator=torch.Generator().manual_seed(0))
    whole = llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=tensor, progress=False)
    assert whole.llmc_fsm_report.calibration == {
        "source": "<tensor (8, 32)>", "num_samples": 8, "seq_len": 32, "num_tokens": 256,
    }  # fmt: skip
    cut = llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=tensor, num_calibration_samples=2,
                           max_seq_length=10, progress=False)  # fmt: skip
    assert cut.llmc_fsm_report.calibration == {
        "source": "<tensor (8, 32)>, its first 2 rows x 10 tokens", "num_samples": 2, "seq_len": 10, "num_tokens": 20,
    }  # fmt: skip
    given = llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=tensor[:2, :10].clone(), progress=False)
    assert _same(_weights(cut), _weights(given))
    assert not _same(_weights(cut), _weights(whole))


def test_token_ids_the_embedding_has_no_row_for_are_refused_before_any_forward(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir
    rows = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    for data, low, high in (
        (torch.full((2, 8), rows, dtype=torch.long), rows, rows),  # a tensor of another tokenizer's ids
        (FakeDataset(input_ids=[[5, 6, -100], [7, 8]]), -100, 8),  # a label pad id left in the rows
    ):
        message = (
            f"calibration token ids must lie in [0, {rows}) (the rows of the model's input embedding), got ids from "
            f"{low} to {high}: were they made by this model's tokenizer (no -100 or other padding marks)?"
        )
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            llmc_fsm.oneshot(model=str(model_dir), recipe=RECIPE, dataset=data, output_dir=tmp_path / "o", progress=False)
        assert not (tmp_path / "o").exists()



def test_a_tokenizer_of_a_larger_vocabulary_is_refused_before_any_forward(tiny_model_dir, tmp_path, capsys):
    """A model directory holding another model's tokenizer (ids beyond its embedding): the command failed in the
    embedding with a traceback (IndexError), streamed or in memory (a tester's case); evaluation text and the prompts
    of the default generated calibration too (they failed in generate())."""
    model_dir, text = tiny_model_dir
    small = tmp_path / "small"
    shutil.copytree(model_dir, small)
    tiny_llama.llama(vocab=8, layers=2, positions=128).save_pretrained(small)  # its tokenizer's ids reach past 8
    capsys.readouterr()  # save_pretrained's progress bar
    for extra in ([], ["--in-memory"], ["--method", "rtn", "--scheme", "W8A8", "--eval-text", str(text)]):
        argv = ["oneshot", "--model", str(small), "--dataset", str(text), "--seq-len", "8", "--num-samples", "2",
                "--method", "gptq", "--scheme", "W8A8", "--no-progress", "--output", str(tmp_path / "out"), *extra]
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("llmc-fsm oneshot: error: the tokenizer gives token ids up to ") and err.endswith(
            ", but the model's input embedding has 8 rows: it is not this model's tokenizer (its vocabulary is "
            "larger); give the model's own (tokenizer=, or its files in the model directory)\n"
        ), err
        assert not (tmp_path / "out").exists()
    # the default calibration is generated from prompts: a tokenizer giving them ids past the embedding (B4's case)
    words = sorted({w for p in DEFAULT_PROMPTS for w in p.replace(".", " ").replace(",", " ").split()})
    tok = Tokenizer(WordLevel({"[UNK]": 0, "</s>": 1} | {w: 100 + i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    prompts_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
    with pytest.raises(ValueError, match=r"^the tokenizer gives token ids up to 1\d\d, but the model's input "
                                         r"embedding has 8 rows: it is not this model's tokenizer"):
        llmc_fsm.oneshot(model=tiny_llama.llama(vocab=8, layers=2, positions=128), tokenizer=prompts_tokenizer,
                         recipe=RECIPE, num_calibration_samples=2, max_seq_length=8, progress=False)  # fmt: skip


def test_a_text_column_named_like_a_processor_output_is_not_refused():
    """Only image / audio processor outputs are refused (a tester's case: a column of texts named ``input_values``)."""
    from llmc_fsm.data.rows import dataset_object_error

    assert dataset_object_error(FakeDataset(text=["w001 w002"], input_values=["some words"])) is None
    assert dataset_object_error(FakeDataset(text=["w001 w002"], input_values=[[0.1, 0.2]])).startswith(
        "is a test_dataset_objects.FakeDataset with image / audio inputs ('input_values')"
    )


def test_a_processor_output_column_is_judged_by_its_first_value():
    """A first row of ``None`` was taken for an image (a tester's case); the first value decides."""
    from llmc_fsm.data.rows import dataset_object_error

    assert dataset_object_error(FakeDataset(text=["a", "b"], input_values=[None, "some words"])) is None
    assert dataset_object_error(FakeDataset(text=["a", "b"], pixel_values=[None, [[0.5]]])) is not None


def test_all_rows_of_a_dataset_larger_than_llmcompressors_default_are_used_with_a_warning(caplog):
    """llm-compressor takes 512 rows when num_calibration_samples is not given; llmc-fsm takes them all, as its docs
    say: a script ported unchanged did 20x the work without a word (a tester's case). Said once, above 512 rows."""
    with caplog.at_level("WARNING", logger="llmc_fsm.data.rows"):
        assert len(read_rows(FakeDataset(input_ids=[[1]] * 512), None, None).rows) == 512
        assert caplog.records == []
        assert len(read_rows(FakeDataset(input_ids=[[1]] * 513), None, None).rows) == 513
        assert len(read_rows(FakeDataset(input_ids=[[1]] * 513), 513, None).rows) == 513
    assert [r.getMessage() for r in caplog.records] == [
        "num_calibration_samples not given: all 513 rows of the dataset are used (llm-compressor's default takes 512); "
        "pass num_calibration_samples to use fewer"
    ]


def test_the_cap_reads_model_max_length_of_any_integral_number():
    """A model_max_length of 2048.0 (a JSON config) or a numpy int was passed over (B4's case): llm-compressor's
    min() caps with any number. A bool, a fractional number or transformers' 'no limit' (1e30) caps nothing."""
    import numpy as np

    from llmc_fsm.data.rows import _capped

    assert (_capped(None, 2048.0), _capped(12, np.int64(16)), _capped(20, np.int64(16))) == (2048, 12, 16)
    assert (_capped(None, True), _capped(8, 2048.5), _capped(None, int(1e30)), _capped(8, None)) == (None, 8, None, 8)


def test_a_dataset_name_without_the_datasets_package_says_how_to_install_it(monkeypatch):
    """The refusal named the optional ``datasets`` package but not the command that installs it (a newcomer's case)."""
    import sys

    from llmc_fsm.data.text_files import load_hf_dataset

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ValueError) as info:
        load_hf_dataset("HuggingFaceH4/ultrachat_200k")
    assert str(info.value) == (
        "'HuggingFaceH4/ultrachat_200k' is not an existing file; treating it as a Hugging Face dataset name needs the "
        "optional `datasets` package, which is not installed (pip install datasets); pass a local text file (.txt) or "
        'JSONL file with a "text" field instead'
    )
