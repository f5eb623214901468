"""Loading models from bad directories, the Hugging Face Hub cache, the locked conversion cache, file modes.

Issue 11 cases 5 (bad model directories, no tokenizer), 6 (concurrent first runs), 8 (``model.safetensors``
written 0600) and Hub model IDs.  Uses a tiny random Llama (2 layers, hidden 16, vocabulary 64) and a word-level
tokenizer, so nothing here needs SmolLM2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import tiny_llama
import torch

from llmc_fsm.cli import main
from llmc_fsm.data.protocol import token_windows
from llmc_fsm.models import hf_io as model_io
from llmc_fsm.models import known as models_mod
from llmc_fsm.models.known import KNOWN_MODELS, load_model

transformers = pytest.importorskip("transformers")


def _tiny_tokenizer():
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {f"w{i}": i for i in range(62)} | {"[UNK]": 62, "</s>": 63}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")


def _tiny_model(*, quantization_config=None):
    model = tiny_llama.llama(vocab=64, hidden=16, heads=2, kv_heads=1)
    if quantization_config is not None:
        model.config.quantization_config = quantization_config
    return model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A complete HF model directory (config, model.safetensors, tokenizer files)."""
    path = tmp_path_factory.mktemp("tiny") / "tiny"
    _tiny_model().save_pretrained(path)
    _tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def umask_027():
    """Run with umask 027 (files 0640, directories 0750), restored afterwards."""
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def _copy(tiny_dir, tmp_path, keep):
    out = tmp_path / "model"
    out.mkdir()
    for name in keep:
        shutil.copy(tiny_dir / name, out / name)
    return out


# ------------------------------------------------------------------ case 5: bad model directories


def test_directory_with_only_config(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path, ["config.json"])
    with pytest.raises(ValueError) as exc:
        load_model(d)
    assert str(exc.value) == (
        f"{d}: no model weights: none of model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
        "pytorch_model.bin.index.json exists (the directory holds: config.json); copy the weights there or save the "
        "model again"
    )


def test_directory_without_config(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path, ["model.safetensors"])
    with pytest.raises(ValueError) as exc:
        load_model(d)
    assert str(exc.value) == f"{d} is not a Hugging Face model directory: config.json is missing"


@pytest.mark.parametrize(
    ("keep_bytes", "cause"),
    [
        (0.5, "Error while deserializing header: incomplete metadata, file not fully covered"),
        (5, "Error while deserializing header: header too small"),
    ],
)
def test_truncated_safetensors(tiny_dir, tmp_path, keep_bytes, cause):
    d = _copy(tiny_dir, tmp_path, ["config.json", "tokenizer.json", "tokenizer_config.json"])
    data = (tiny_dir / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: int(len(data) * keep_bytes) if keep_bytes < 1 else keep_bytes])
    with pytest.raises(ValueError) as exc:
        load_model(d)
    assert str(exc.value) == (
        f"{d / 'model.safetensors'}: not a valid safetensors file (SafetensorError: {cause}); it is probably "
        "truncated or corrupt: copy or save the model again"
    )


def test_sharded_index_with_missing_shard(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path, ["config.json"])
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError) as exc:
        load_model(d)
    shard = d / "model-00001-of-00002.safetensors"
    assert str(exc.value) == f"{shard}: missing (listed in model.safetensors.index.json); copy all weight shards"


def test_bad_directory_is_one_line_from_the_cli(tiny_dir, tmp_path, capsys):
    d = _copy(tiny_dir, tmp_path, ["config.json"])
    text = tmp_path / "cal.txt"
    text.write_text("w1 w2 w3 " * 50, encoding="utf-8")
    assert main(["oneshot", "--model", str(d), "--dataset", str(text), "--seq-len", "16", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"llmc-fsm oneshot: error: {d}: no model weights: none of model.safetensors,")


def test_directory_without_tokenizer_loads_with_tokenizer_none(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path, ["config.json", "model.safetensors"])
    model, tokenizer = load_model(d)
    assert tokenizer is None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference, _ = load_model(tiny_dir)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    with pytest.raises(ValueError, match=r"^text needs a tokenizer, but there is none"):
        token_windows(tokenizer, "w1 w2", num_windows=1, seq_len=2)


def test_oneshot_on_directory_without_tokenizer_with_token_ids(tiny_dir, tmp_path):
    import llmc_fsm

    d = _copy(tiny_dir, tmp_path, ["config.json", "model.safetensors"])
    model = llmc_fsm.oneshot(
        model=str(d),
        recipe={"s": {"MagnitudePruningModifier": {"sparsity": 0.5, "ignore": ["lm_head"]}}},
        dataset=torch.randint(0, 64, (2, 8)),
        max_seq_length=8,
        progress=False,
    )
    assert model.llmc_fsm_report.total_sparsity == pytest.approx(0.5)


def test_broken_tokenizer_files_are_not_ignored(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path, ["config.json", "model.safetensors", "tokenizer_config.json"])
    (d / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{d}: the tokenizer files could not be loaded \("):
        load_model(d)


# ------------------------------------------------------------------ case 8: file modes


def test_fix_safetensors_permissions_follows_umask(tiny_dir, tmp_path, umask_027):
    out = tmp_path / "saved"
    _tiny_model().save_pretrained(out)
    model_io.fix_safetensors_permissions(out)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o640
    assert (out / "config.json").stat().st_mode & 0o777 == 0o640  # what every other file gets
    assert model_io.fix_safetensors_permissions(out) == []  # nothing left to change
    assert model_io.current_umask() == 0o027


# ------------------------------------------------------------------ case 6: the conversion cache


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path):
    """Make the known-model conversion convert the tiny model (0.5 s per conversion, counted)."""
    fake = tmp_path / "pkg" / "fake.gguf"
    fake.parent.mkdir()
    fake.write_bytes(b"GGUF")
    conversions = []
    real_model_loader = transformers.AutoModelForCausalLM.from_pretrained
    real_tokenizer_loader = transformers.AutoTokenizer.from_pretrained

    def model_loader(path, *args, gguf_file=None, **kwargs):
        if gguf_file is None:
            return real_model_loader(path, *args, **kwargs)
        conversions.append(threading.get_ident())
        time.sleep(0.5)  # long enough for a second run to start meanwhile
        return _tiny_model(quantization_config={"quant_method": "gguf"})

    def tokenizer_loader(path, *args, gguf_file=None, **kwargs):
        return _tiny_tokenizer() if gguf_file else real_tokenizer_loader(path, *args, **kwargs)

    monkeypatch.setattr(models_mod, "_find_gguf", lambda spec: fake)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_loader)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer_loader)
    return conversions


def test_two_first_runs_at_once_convert_once(fake_gguf, tmp_path):
    cache = tmp_path / "cache"
    results, errors = [], []

    def run():
        try:
            results.append(load_model("smollm2-135m", cache_dir=cache))
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert len(fake_gguf) == 1  # the second run waited on the lock, then used the finished cache
    assert len(results) == 2
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert torch.equal(results[0][0](input_ids=ids).logits, results[1][0](input_ids=ids).logits)
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["smollm2-135m"]  # no temp dirs left
    assert sorted(p.name for p in (cache / "locks").iterdir()) == ["smollm2-135m.lock"]


def test_complete_cache_is_never_removed(fake_gguf, tmp_path, umask_027):
    target = tmp_path / "cache" / "models" / "smollm2-135m"
    spec = KNOWN_MODELS["smollm2-135m"]
    models_mod._build_cache("smollm2-135m", spec, target)
    assert (target / "model.safetensors").stat().st_mode & 0o777 == 0o640  # case 8 for the cache
    assert target.stat().st_mode & 0o777 == 0o750
    inode = (target / "model.safetensors").stat().st_ino
    models_mod._build_cache("smollm2-135m", spec, target)  # a run that started before the cache was complete
    assert (target / "model.safetensors").stat().st_ino == inode  # kept, not replaced under a loading process
    assert len(fake_gguf) == 2
    assert sorted(p.name for p in target.parent.iterdir()) == ["smollm2-135m"]


def test_existing_cache_gets_the_umask_mode(fake_gguf, tmp_path, umask_027):
    target = tmp_path / "cache" / "models" / "smollm2-135m"
    models_mod._build_cache("smollm2-135m", KNOWN_MODELS["smollm2-135m"], target)
    (target / "model.safetensors").chmod(0o600)  # as written before the fix
    load_model("smollm2-135m", cache_dir=tmp_path / "cache")
    assert (target / "model.safetensors").stat().st_mode & 0o777 == 0o640
    assert len(fake_gguf) == 1  # loaded from the cache, not converted again


def test_stale_cache_is_replaced(fake_gguf, tmp_path):
    target = tmp_path / "cache" / "models" / "smollm2-135m"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no marker: an interrupted or foreign directory
    model, tokenizer = load_model("smollm2-135m", cache_dir=tmp_path / "cache")
    assert models_mod._cache_is_valid(target)
    assert tokenizer is not None
    assert model.config.num_hidden_layers == 2


def test_unwritable_cache_root_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RuntimeError) as exc:
        load_model("smollm2-135m", cache_dir=blocker)
    assert str(exc.value) == (
        f"cannot create the model cache under {blocker}: Not a directory; set LLMC_FSM_CACHE to a writable directory"
    )


# ------------------------------------------------------------------ Hugging Face Hub model IDs

_HUB_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from llmc_fsm.cli import main
    from llmc_fsm.models.known import load_model

    out = {}
    try:
        load_model("acme/does-not-exist")
    except RuntimeError as err:
        out["error"] = str(err)
    out["cli_rc"] = main(["oneshot", "--model", "acme/does-not-exist", "--no-progress"])
    model, tok = load_model("acme/tiny-llama")
    out["class"] = type(model).__name__
    out["tokens"] = tok("w1 w2 w9")["input_ids"]
    out["logits_sum"] = float(model(input_ids=__import__("torch").tensor([[1, 2, 3]])).logits.double().sum())
    print(json.dumps(out))
    """
)


def test_hub_ids_offline(tiny_dir, tmp_path):
    hub = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = hub / "models--acme--tiny-llama" / "snapshots" / commit
    shutil.copytree(tiny_dir, snapshot)
    (hub / "models--acme--tiny-llama" / "refs").mkdir()
    (hub / "models--acme--tiny-llama" / "refs" / "main").write_text(commit)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _HUB_SCRIPT], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = (
        "model 'acme/does-not-exist' is not a known name or a local directory, and as a Hugging Face Hub model ID it "
        f"is not in the cache (HF_HUB_OFFLINE=1, Hugging Face cache searched: {hub}); nothing is downloaded while "
        "HF_HUB_OFFLINE=1: download it once online, point HF_HUB_CACHE at the cache that holds it, or pass a local "
        "model directory"
    )
    assert out["error"] == expected
    assert out["cli_rc"] == 1
    assert f"llmc-fsm oneshot: error: {expected}\n" in proc.stderr
    assert out["class"] == "LlamaForCausalLM"
    assert out["tokens"] == [1, 2, 9]
    reference, _ = load_model(tiny_dir)
    with torch.inference_mode():
        expected_sum = float(reference(input_ids=torch.tensor([[1, 2, 3]])).logits.double().sum())
    assert out["logits_sum"] == pytest.approx(expected_sum, rel=1e-6)


@pytest.mark.parametrize(
    ("key", "hub"),
    [("acme/tiny", True), ("Org_1/model.v2-x", True), ("./acme/tiny", False), ("../x/y", False), ("a/b/c", False)],
)
def test_hub_id_shape(key, hub):
    assert model_io.looks_like_hub_id(key) is hub


def test_non_hub_unknown_name_lists_choices():
    with pytest.raises(ValueError) as exc:
        load_model("gpt-17")
    assert str(exc.value) == (
        "unknown model 'gpt-17': known model names are smollm2-135m; or pass a local Hugging Face model directory "
        "(config.json + weights + tokenizer) or a Hugging Face Hub model ID (org/name)"
    )
    with pytest.raises(ValueError) as exc:  # the Hub's spelling of the known name (a newcomer's try)
        load_model("SmolLM2-135M")
    assert str(exc.value).startswith("unknown model 'SmolLM2-135M' (did you mean 'smollm2-135m'?): known model names")
    for key in ("SmolLM2-135M-Instruct", "smolm2-135m"):  # the README's name of the model; a letter left out
        with pytest.raises(ValueError) as exc:  # found by a README-only newcomer (session 38): no suggestion
            load_model(key)
        assert str(exc.value).startswith(f"unknown model {key!r} (did you mean 'smollm2-135m'?): known model names")


@pytest.mark.parametrize("key", ["/nope/model", "./nope", "../nope/model", "~/nope-model"])
def test_a_path_that_does_not_exist_is_named_as_a_missing_directory(key):
    # a newcomer's try: '--model /nope/model' used to read "unknown model", as if it were a name
    with pytest.raises(ValueError) as exc:
        load_model(key)
    assert str(exc.value) == (
        f"model directory {key!r} does not exist; pass an existing local Hugging Face model directory "
        "(config.json + weights + tokenizer) or a known model name (smollm2-135m)"
    )


def test_an_unknown_or_empty_model_is_refused_in_one_line_before_the_device_line(capsys, tmp_path):
    """A newcomer saw the device line printed before 'unknown model' (two lines); a breaker saw --model '' named as
    '.'. Now both are refused with the data files read and before anything about the device or the model is said."""
    from llmc_fsm.cli import main

    for model, line in [
        ("smollm2-135", "unknown model 'smollm2-135' (did you mean 'smollm2-135m'?): known model names are "
                        "smollm2-135m; or pass a local Hugging Face model directory (config.json + weights + "
                        "tokenizer) or a Hugging Face Hub model ID (org/name)"),
        ("", "the model is empty: pass a known model name (smollm2-135m) or a local Hugging Face model directory"),
    ]:  # fmt: skip
        code = main(["oneshot", "--model", model, "--method", "rtn", "--scheme", "W8A8", "--output",
                     str(tmp_path / "o"), "--no-progress"])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 1 and err == f"llmc-fsm oneshot: error: {line}\n"
    assert not (tmp_path / "o").exists()


def test_meta_models_are_built_without_weight_initialisation_and_with_the_same_buffers(monkeypatch):
    """``meta_model`` skips transformers' weight initialisation (a pass over every module that computes nothing on
    ``meta``): ``init_weights`` is not called, and every family of ``tests/tiny_families.py`` gets the buffers
    (rotary tables, ...) a build with the initialisation gives, bit for bit, and the same parameter names, shapes
    and dtypes."""
    import copy

    import transformers
    from accelerate import init_empty_weights
    from tiny_families import FAMILIES, config

    calls = []
    original = transformers.PreTrainedModel.init_weights
    monkeypatch.setattr(transformers.PreTrainedModel, "init_weights", lambda self: calls.append(type(self).__name__))
    model_io.meta_model(config("llama"))
    assert calls == []
    monkeypatch.setattr(transformers.PreTrainedModel, "init_weights", original)
    built = 0
    for family in FAMILIES:
        cfg = config(family)
        cls = model_io.model_class(cfg)
        try:
            with init_empty_weights():
                initialised = (getattr(cls, "from_config", None) or cls._from_config)(copy.deepcopy(cfg))
        except ValueError:  # qwen2_audio: no causal-LM class builds its config alone
            continue
        initialised.tie_weights()  # as meta_model ties them
        fast = model_io.meta_model(cfg)
        ours, theirs = dict(fast.named_buffers()), dict(initialised.named_buffers())
        assert ours.keys() == theirs.keys(), family
        for name, buffer in theirs.items():
            assert (ours[name].device, ours[name].dtype) == (buffer.device, buffer.dtype), (family, name)
            if buffer.device.type != "meta":
                assert torch.equal(ours[name], buffer), (family, name)
        shapes = {n: (p.shape, p.dtype) for n, p in fast.named_parameters()}
        assert shapes == {n: (p.shape, p.dtype) for n, p in initialised.named_parameters()}, family
        built += 1
    assert built == len(FAMILIES) - 1


def test_a_model_offloaded_to_disk_by_compressed_tensors_is_refused_before_any_work(tmp_path):
    """compressed-tensors' disk offloading (llm-compressor's ``load_context`` / ``device_map='auto_offload'``) hands
    out a new onloaded copy at each access: the run was refused as "tied weights" between unrelated modules (the
    copies' ids reused), and with that fixed its compressed weights would have been lost. Refused in one line, the
    weights unchanged; a Session driven by hand refuses the same when its modifier selects targets. CPU offloading
    onloaded to the CPU gives the stored tensors themselves and runs."""
    from compressed_tensors.offload import offload_module

    import llmc_fsm
    from llmc_fsm_quantization import QuantizationModifier

    model = tiny_llama.llama(seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    (tmp_path / "offload").mkdir()
    for module in model.model.layers[0].modules():
        offload_module(module, "cpu", "disk", offload_dir=str(tmp_path / "offload"))
    expected = (
        "the model is offloaded by compressed-tensors to disk (load_offloaded_model, device_map='auto_offload', "
        "llm-compressor's load_context): each access to a weight reads a new copy, so weights compressed in place "
        "would be lost; give its directory instead with low_memory=True (model=DIR: streamed one decoder layer at a "
        "time; --model DIR --low-memory)"
    )
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe={"s": {"QuantizationModifier": {"scheme": "W8A8"}}}, progress=False)
    assert str(info.value) == expected
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    session = llmc_fsm.Session([QuantizationModifier(scheme="W8A8")])
    with pytest.raises(llmc_fsm.ModifierError) as info:
        session.initialize(model=model)
    assert str(info.value.__cause__) == expected


def test_a_repository_whose_model_is_its_own_code_is_refused_without_running_it(tiny_dir, tmp_path):
    """``auto_map`` to a repository's own classes: transformers asked "Do you wish to run the custom code? [y/N]" on
    the terminal, and a ``y`` ran the repository's files (found by a tester). Refused in one line, nothing run, even
    with ``y`` on stdin; nothing written."""
    model = tmp_path / "remote"
    shutil.copytree(tiny_dir, model)
    marker = tmp_path / "CODE_RAN"
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="tinycustom", auto_map={"AutoConfig": "configuration_tiny.TinyCustomConfig",
                                                     "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM"})
    (model / "config.json").write_text(json.dumps(config))
    code = f"open({str(marker)!r}, 'a').write('ran')\nfrom transformers import LlamaConfig, LlamaForCausalLM\n"
    body = "class TinyCustomConfig(LlamaConfig):\n    model_type = 'tinycustom'\n"
    (model / "configuration_tiny.py").write_text(code + body)
    (model / "modeling_tiny.py").write_text(code + "class TinyCustomForCausalLM(LlamaForCausalLM):\n    pass\n")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "llmc_fsm", "oneshot", "--model", str(model), "--method", "rtn", "--scheme",
               "W8A8", "--output", str(out), "--no-progress", "--eval-windows", "1"]
    proc = subprocess.run(command, input="y\ny\ny\ny\n", capture_output=True, text=True, timeout=300, check=False,
                          env=os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        f"llmc-fsm oneshot: error: model {str(model)!r} needs the Python code in its repository (config.json's "
        "auto_map names classes transformers does not have): llmc-fsm loads transformers' own classes only "
        "and never runs a repository's code (as llm-compressor with trust_remote_code_model=False)"
    )
    assert "custom code" not in proc.stdout + proc.stderr.replace("Python code", "")  # transformers' prompt: never
    assert not marker.exists() and not out.exists()
    loader = (  # the loader itself, past the one-shot's first check, answering y too
        "import pathlib, sys, torch\nfrom llmc_fsm.models.hf_io import load_hf_dir\n"
        "try:\n    load_hf_dir(pathlib.Path(sys.argv[1]), torch.float32)\nexcept ValueError as e:\n    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", loader, str(model)], input="y\ny\ny\n", capture_output=True,
                          text=True, timeout=300, check=False, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert proc.stdout.startswith(f"model {str(model)!r} needs the Python code in its repository"), proc.stdout
    assert not marker.exists()


def test_a_local_directory_shaped_like_a_hub_id_is_reported_as_the_directory(tiny_dir, tmp_path, monkeypatch):
    """``models/newarch`` whose config transformers cannot read was reported as a Hub ID missing from the cache
    (found by a tester); ``./models/newarch`` got the directory's own error. Both get it now."""
    from huggingface_hub import constants

    import llmc_fsm

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the tester's case: online, the Hub unreachable
    monkeypatch.setattr(model_io, "hub_unreachable", lambda *a, **k: "no network in this test")
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "models" / "newarch"
    shutil.copytree(tiny_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"model_type": "llama9"}))
    for key in ("models/newarch", "./models/newarch"):
        with pytest.raises(ValueError, match=rf"^could not load the model in {key.removeprefix('./')}: ValueError: "
                                             r"The checkpoint you are trying to load has model type `llama9`"):
            llmc_fsm.oneshot(model=key, dataset=torch.randint(0, 64, (2, 8)), progress=False)


def test_text_for_a_model_without_tokenizer_files_is_refused_saying_what_the_command_can_do(tiny_dir, tmp_path,
                                                                                            capsys):
    """The line said "pass dataset as a LongTensor of token ids", which the command line cannot (a tester's case)."""
    d = _copy(tiny_dir, tmp_path, ["config.json", "model.safetensors"])
    text = tmp_path / "cal.txt"
    text.write_text("w1 w2 w3 " * 400)
    for extra in ([], ["--in-memory"]):
        argv = ["oneshot", "--model", str(d), "--dataset", str(text), "--seq-len", "8", "--num-samples", "2",
                "--method", "magnitude", "--no-progress", "--output", str(tmp_path / "out"), *extra]
        assert main(argv) == 1
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(f"llmc-fsm oneshot: error: model {str(d)!r} has no tokenizer llmc-fsm can load (no "
                               "tokenizer files, or one that is its repository's own code), so ")
        assert line.endswith("cannot be tokenized; add the tokenizer files to its directory (from Python also: "
                             "tokenizer=..., or dataset= a LongTensor of token ids)")
    assert not (tmp_path / "out").exists()


def _remote_code_tokenizer(tiny_dir, tmp_path):
    """A copy of ``tiny_dir`` whose tokenizer_config.json names its repository's own tokenizer class (auto_map)."""
    model = tmp_path / "rc"
    shutil.copytree(tiny_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(auto_map={"AutoTokenizer": ["tokenization_tiny.TinyTokenizer", None]},
                  tokenizer_class="TinyTokenizer")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def test_a_tokenizer_that_is_its_repositorys_own_code_is_never_run(tiny_dir, tmp_path, caplog):
    """A tokenizer_config.json with auto_map to the repository's code got transformers' text (a tester's case). In
    a model directory it is not loaded, said in one line (a tokenizer given, token ids or a data-free recipe still
    run; llm-compressor 0.14 stops with token ids and fails saving a data-free run there); given as the tokenizer,
    or needed for text, it is refused in one line."""
    import llmc_fsm

    model = _remote_code_tokenizer(tiny_dir, tmp_path)
    refusal = (
        "needs the Python code in its repository (tokenizer_config.json's auto_map names classes transformers does "
        "not have): llmc-fsm loads transformers' own classes only and never runs a repository's code (as "
        "llm-compressor with trust_remote_code_model=False)"
    )
    with caplog.at_level("WARNING", logger="llmc_fsm.models.hf_io"):
        assert model_io._load_tokenizer(model) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"the tokenizer of {str(model)!r} {refusal}: it is not loaded; only token-id data (or a tokenizer given) can "
        "be used"
    ]
    rtn = {"s": {"QuantizationModifier": {"scheme": "W8A8", "ignore": ["lm_head"]}}}
    llmc_fsm.oneshot(model=str(model), recipe=rtn, progress=False)  # data-free: runs
    text = tmp_path / "cal.txt"
    text.write_text("w1 w2 w3 " * 400)
    kw = {"recipe": rtn, "dataset": str(text), "max_seq_length": 8, "num_calibration_samples": 2, "progress": False}
    llmc_fsm.oneshot(model=str(model), tokenizer=str(tiny_dir), **kw)  # a tokenizer given: runs
    with pytest.raises(ValueError, match=r"^model '.*rc' has no tokenizer llmc-fsm can load \(no tokenizer files, or "):
        llmc_fsm.oneshot(model=str(model), **{**kw, "recipe": {"s": {"GPTQModifier": {"scheme": "W8A8"}}}})
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(tiny_dir), tokenizer=str(model), **kw)
    assert str(info.value) == f"the tokenizer {str(model)!r} {refusal}"
    # an in-memory model loaded from that directory: the same cause said, not "no tokenizer files here"
    from transformers import AutoModelForCausalLM

    caplog.clear()
    with caplog.at_level("WARNING"), pytest.raises(ValueError, match=r"its name_or_path has no tokenizer llmc-fsm "):
        llmc_fsm.oneshot(model=AutoModelForCausalLM.from_pretrained(model), **kw)
    assert f"the tokenizer of {str(model)!r} {refusal}: it is not loaded" in [r.getMessage() for r in caplog.records]


def test_a_remote_code_tokenizer_is_said_once_by_the_command(tiny_dir, tmp_path, capsys, caplog):
    """The command's default (streamed) path loaded the tokenizer, fell back to the in-memory path on the missing
    tokenizer, loaded it again and said the warning twice (session 28's left item): once now, and the same refusal on
    each path."""
    model = _remote_code_tokenizer(tiny_dir, tmp_path)
    text = tmp_path / "cal.txt"
    text.write_text("w1 w2 w3 " * 400)
    for extra in ([], ["--in-memory"], ["--low-memory"]):
        argv = ["oneshot", "--model", str(model), "--dataset", str(text), "--seq-len", "8", "--num-samples", "2",
                "--method", "gptq", "--scheme", "W8A8", "--no-progress", "--output", str(tmp_path / "out"), *extra]
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert main(argv) == 1
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 1, warned
        assert warned[0].startswith(f"the tokenizer of {str(model)!r} needs the Python code in its repository")
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"llmc-fsm oneshot: error: model {str(model)!r} has no tokenizer llmc-fsm can "
                                   "load (no tokenizer files, or one that is its repository's own code), so text "
                                   "(--dataset, --eval-text or the default generated calibration) cannot be tokenized")
    assert not (tmp_path / "out").exists()


def test_a_corrupt_tokenizer_beside_an_in_memory_model_is_named(tiny_dir, tmp_path):
    """The model's name_or_path holds a broken tokenizer.json: "no tokenizer llmc-fsm can load (no tokenizer files
    here, or one that is its repository's own code)" named neither (a tester's case); its own error now."""
    import llmc_fsm
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_dir, model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    (model_dir / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, dataset=["w1 w2 w3 " * 20] * 2, max_seq_length=8, progress=False)
    assert str(info.value).startswith(f"{model_dir}: the tokenizer files could not be loaded (JSONDecodeError: ")


def test_a_head_tied_to_the_decoders_embedding_passes_the_tie_check():
    """T5Gemma ties its head to its decoder's embedding; ``get_input_embeddings()`` is the encoder's, so a data-free
    recipe was refused with "config says tie_word_embeddings=True but lm_head.weight is not the embedding weight"
    though transformers loads the checkpoint (B2, session 31). A head tied to no embedding is still refused."""
    import transformers

    sub = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128}  # fmt: skip
    config = transformers.T5GemmaConfig(encoder=sub, decoder=sub, vocab_size=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.T5GemmaForConditionalGeneration(config)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    model_io.check_tied(model, "t5gemma")
    model.get_output_embeddings().weight = torch.nn.Parameter(model.get_output_embeddings().weight.clone())
    with pytest.raises(RuntimeError, match=r"^t5gemma: config says tie_word_embeddings=True but lm_head\.weight is"):
        model_io.check_tied(model, "t5gemma")
