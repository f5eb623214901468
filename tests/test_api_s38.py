"""Python API edges found by a tester (session 38): ``save_pretrained(push_to_hub=True)``, ``dtype`` with an
in-memory model, ``tokenizer`` and ``seed`` checked when the settings are built, and ``run_sequential`` on token ids
outside the model's vocabulary."""

import json
import os
from typing import ClassVar

import huggingface_hub
import pytest
import tiny_llama
import torch
from huggingface_hub import constants
from huggingface_hub.errors import OfflineModeIsEnabled

import llmc_fsm
from llmc_fsm import Session
from llmc_fsm.oneshot_job import api
from llmc_fsm.oneshot_job.settings import OneshotSettings, default_recipe
from llmc_fsm.pipeline.sequential import run_sequential

W8A8 = {"q": {"QuantizationModifier": {"scheme": "W8A8", "ignore": ["lm_head"]}}}
PRUNE = {"s": {"SparseGPTModifier": {"sparsity": 0.5}}}
DATA = torch.arange(64).reshape(4, 16) % 128


def _quantized():
    model = tiny_llama.llama()
    llmc_fsm.oneshot(model=model, recipe=W8A8, dataset=DATA, progress=False)
    return model


# --------------------------------------------------------------------------- save_pretrained(push_to_hub=True)
def test_push_to_hub_offline_raises_the_hubs_error_and_leaves_no_directory(tmp_path, monkeypatch):
    """``save_pretrained(push_to_hub=True)`` always failed with ``TypeError: HfApi.create_repo() got an unexpected
    keyword argument 'safe_serialization'`` (llmc-fsm passed it, transformers 5.25 no longer takes it and hands it
    to the Hub), leaving the new directory behind (found by a tester)."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = _quantized()
    target = tmp_path / "new" / "out"
    with pytest.raises(OfflineModeIsEnabled) as info:
        model.save_pretrained(target, push_to_hub=True, repo_id="me/x")
    assert str(info.value) == (
        f"Cannot reach {constants.ENDPOINT}/api/repos/create: offline mode is enabled. To disable it, please unset "
        "the `HF_HUB_OFFLINE` environment variable."
    )
    assert list(tmp_path.iterdir()) == []


def test_push_to_hub_with_a_misspelt_argument_names_it_before_the_hub_is_reached(tmp_path, monkeypatch):
    """Found by a re-tester: with push_to_hub every argument transformers' save does not name went to
    HfApi.create_repo, which failed with "TypeError: ... unexpected keyword argument 'max_shard_sizee'"; without
    push_to_hub the same typo gets the did-you-mean. The hub's own arguments (private, repo_type...) are taken."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = _quantized()
    with pytest.raises(ValueError) as info:
        model.save_pretrained(tmp_path / "out", push_to_hub=True, max_shard_sizee="1MB", private=True)
    assert str(info.value) == (
        "save_pretrained: unknown argument(s) max_shard_sizee (did you mean max_shard_size?); nothing was written. It "
        "takes save_directory, quantization_format, save_compressed and transformers' save_pretrained arguments"
    )
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OfflineModeIsEnabled):  # private=True reaches the hub (offline here)
        model.save_pretrained(tmp_path / "out", push_to_hub=True, private=True)


class _FakeHub:
    """``HfApi`` stand-in: records each call and, at the upload, the files and ``config.json`` it would send."""

    calls: ClassVar[list] = []

    def create_repo(self, repo_id, *, token=None, private=None, repo_type=None, exist_ok=False):
        kw = {"token": token, "private": private, "exist_ok": exist_ok}
        kw.update({"repo_type": repo_type} if repo_type is not None else {})
        self.calls.append(("create_repo", repo_id, kw))
        return type("RepoUrl", (), {"repo_id": f"me/{repo_id}"})()

    def upload_folder(self, *, folder_path, **kw):
        config = json.loads((folder_path / "config.json").read_text())
        sent = sorted(os.listdir(folder_path))
        self.calls.append(("upload_folder", kw, sent, config["quantization_config"]["quant_method"]))


def test_push_to_hub_uploads_the_finished_checkpoint_once(tmp_path, monkeypatch):
    """The upload ran inside transformers' ``save_pretrained``, before the quantization config and ``recipe.yaml``
    were written (and failed first on ``safe_serialization``, found by a tester): the repository is now created
    before anything is written and the whole checkpoint uploaded in one commit after it is complete; a file that was
    in the directory before and did not change is not uploaded."""
    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeHub)
    _FakeHub.calls = []
    model = _quantized()
    target = tmp_path / "x"
    target.mkdir()
    (target / "notes.txt").write_text("mine\n")
    model.save_pretrained(target, push_to_hub=True, private=True, token="t", commit_message="c")
    (create, upload) = _FakeHub.calls
    assert create == ("create_repo", "x", {"exist_ok": True, "token": "t", "private": True})
    written = ["config.json", "generation_config.json", "model.safetensors", "recipe.yaml"]
    assert upload == (
        "upload_folder",
        {"repo_id": "me/x", "commit_message": "c", "token": "t", "create_pr": False, "allow_patterns": written},
        sorted([*written, "notes.txt"]),
        "compressed-tensors",
    )


def test_a_failed_save_into_an_existing_directory_removes_only_what_it_added(tmp_path, monkeypatch):
    """A save that failed halfway left its files behind (found by a tester, with ``push_to_hub``): the files it
    added are removed, what was there stays."""

    class _Unreachable(_FakeHub):
        def upload_folder(self, **kw):
            raise ConnectionError("hub unreachable")

    monkeypatch.setattr(huggingface_hub, "HfApi", _Unreachable)
    model = _quantized()
    (tmp_path / "notes.txt").write_text("mine\n")
    with pytest.raises(ConnectionError, match=r"^hub unreachable$"):
        model.save_pretrained(tmp_path, push_to_hub=True, repo_id="me/x")
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_safe_serialization_true_is_taken_and_false_refused(tmp_path):
    """transformers 5.25's ``save_pretrained`` has no ``safe_serialization`` (safetensors only): llm-compressor's
    scripts' ``safe_serialization=True`` was refused as an unknown argument; ``False`` cannot be honoured."""
    model = _quantized()
    model.save_pretrained(tmp_path / "a", safe_serialization=True)
    assert sorted(os.listdir(tmp_path / "a")) == [
        "config.json", "generation_config.json", "model.safetensors", "recipe.yaml"
    ]  # fmt: skip
    with pytest.raises(ValueError) as info:
        model.save_pretrained(tmp_path / "b", safe_serialization=False)
    assert str(info.value) == (
        "save_pretrained(safe_serialization=False): this transformers writes safetensors only; leave it out"
    )
    assert not (tmp_path / "b").exists()


# --------------------------------------------------------------------------- dtype with an in-memory model
def _refusal(dtype: str, own: str) -> str:
    return (
        f"dtype (--dtype) {dtype!r} applies to a model given as a name or directory; an in-memory model is compressed "
        f"and saved in its own dtype ({own}): leave dtype out (or give 'auto'), or convert the model first (e.g. "
        f"model.to(torch.{dtype}))"
    )


@pytest.mark.parametrize("given", ["float32", torch.float32, "fp32"])
def test_another_dtype_than_an_in_memory_models_own_is_refused(given):
    """``dtype="float32"`` on a bfloat16 model was taken silently (the model stayed bfloat16), found by a tester."""
    model = tiny_llama.llama().to(torch.bfloat16)
    with pytest.raises(ValueError) as info:
        OneshotSettings(model=model, dtype=given)
    assert str(info.value) == _refusal("float32", "bfloat16")
    with pytest.raises(ValueError) as info:
        OneshotSettings(model=tiny_llama.llama(), dtype="float16")
    assert str(info.value) == _refusal("float16", "float32")


def test_an_in_memory_model_takes_its_own_dtype_auto_and_precision_auto(monkeypatch):
    """``dtype="bfloat16"`` (the model's own), ``"auto"`` and llm-compressor's ``precision="auto"`` were refused
    for a bfloat16 model (found by a tester); a name or directory still defaults to float32."""
    model = tiny_llama.llama().to(torch.bfloat16)
    for given in (None, "auto", "bfloat16", torch.bfloat16, "bf16"):
        assert OneshotSettings(model=model, dtype=given).dtype == "bfloat16"
    built = []
    monkeypatch.setattr(api, "run_oneshot", built.append)
    llmc_fsm.oneshot(model=model, dataset=DATA, precision="auto")
    llmc_fsm.oneshot(model=model, dataset=DATA)
    assert [s.dtype for s in built] == ["bfloat16", "bfloat16"]
    assert OneshotSettings().dtype == "float32"
    assert OneshotSettings(model="org/name", dtype=None).dtype == "float32"


# --------------------------------------------------------------------------- tokenizer
def _not_a_tokenizer(kind: str) -> str:
    return (
        "tokenizer must be a tokenizer or processor (e.g. AutoTokenizer.from_pretrained(...)), a tokenizer directory "
        f"or a Hub id, got {kind}"
    )


def _no_directory(key: str, why: str) -> str:
    return (
        f"tokenizer {key!r} {why}: pass the directory of the tokenizer's files (tokenizer.json, "
        "tokenizer_config.json...), a Hub id (org/name) or a tokenizer object"
    )


def test_a_tokenizer_that_is_no_tokenizer_is_refused_before_any_work(tmp_path):
    """``tokenizer=42`` / ``object()`` were taken and ``output_dir`` written without a tokenizer;
    ``tokenizer="./missing_dir"`` failed after the run had started with transformers' ``OSError`` (found by a
    tester)."""
    out = tmp_path / "out"
    for given, kind in ((42, "int"), (object(), "object"), (tiny_llama.llama(), "LlamaForCausalLM"), (str, "type")):
        with pytest.raises(ValueError) as info:
            llmc_fsm.oneshot(model=tiny_llama.llama(), dataset=DATA, tokenizer=given, output_dir=out, progress=False)
        assert str(info.value) == _not_a_tokenizer(kind)
    file = tmp_path / "file.json"
    file.write_text("{}")
    for given, why in (("./missing_dir", "does not exist"), (str(file), "is a file, not a directory")):
        with pytest.raises(ValueError) as info:
            llmc_fsm.oneshot(model=tiny_llama.llama(), dataset=DATA, tokenizer=given, output_dir=out, progress=False)
        assert str(info.value) == _no_directory(given, why)
    assert sorted(os.listdir(tmp_path)) == ["file.json"]


def test_a_tokenizer_object_directory_or_hub_id_is_taken():
    words = tiny_llama.word_tokenizer("a b c")
    for given in (words, lambda text: {"input_ids": [1]}, "org/name", "gpt2", str(os.getcwd()), None):
        assert OneshotSettings(tokenizer=given).tokenizer is given


# --------------------------------------------------------------------------- seed
def test_a_seed_torch_cannot_take_is_refused_when_the_settings_are_built():
    """``seed=2**70`` was taken and the run failed after loading the model with torch's "Overflow when unpacking
    long long" (found by a tester)."""
    for seed in (2**64, -(2**63) - 1, 2**70):
        with pytest.raises(ValueError) as info:
            OneshotSettings(seed=seed)
        assert str(info.value) == f"seed must be from -2**63 to 2**64 - 1 (what torch.manual_seed takes), got {seed}"
    for seed in (2**64 - 1, -(2**63), -1):
        torch.manual_seed(seed)  # what torch takes
        assert OneshotSettings(seed=seed).seed == seed


# --------------------------------------------------------------------------- run_sequential and the vocabulary
def test_run_sequential_refuses_ids_outside_the_vocabulary_before_any_event():
    """``run_sequential`` raised torch's bare ``IndexError`` from the embedding where ``oneshot`` says what is wrong
    (found by a tester); the session is left initialized and runs on valid ids afterwards."""
    model = tiny_llama.llama()
    before = model.model.layers[0].mlp.up_proj.weight.clone()
    session = Session(PRUNE)
    session.initialize(model=model, calibration_data=torch.tensor([[1, 2, 300, 4]]))
    for data, low, high in ((None, 1, 300), ([torch.tensor([[5, -100, 7]])], -100, 7)):
        with pytest.raises(ValueError) as info:
            run_sequential(session, calibration_data=data, progress=False)
        assert str(info.value) == (
            f"calibration token ids must lie in [0, 128) (the rows of the model's input embedding), got ids from {low} "
            f"to {high}: were they made by this model's tokenizer (no -100 or other padding marks)?"
        )
        assert session.lifecycle == "initialized"
        assert torch.equal(model.model.layers[0].mlp.up_proj.weight, before)
    run_sequential(session, calibration_data=DATA, progress=False)
    session.finalize()
    assert float((model.model.layers[0].mlp.up_proj.weight == 0).float().mean()) == 0.5


@pytest.mark.parametrize(("shape", "what"), [((0, 8), "no row"), ((2, 0), "rows of no token")])
def test_an_empty_token_tensor_is_refused_before_any_work(shape, what):
    """Found by a re-tester: a [0, L] tensor ran to the end, compressed nothing and saved the model dense (no
    quantization_config); [N, 0] failed inside transformers. The list and file forms were refused already."""
    model = tiny_llama.llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, dataset=torch.zeros(shape, dtype=torch.long), progress=False)
    assert str(info.value) == f"dataset (--dataset) holds {what} (shape {shape}): give at least one token window"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_run_sequential_refuses_calibration_data_of_no_token_and_leaves_the_session_initialized():
    model = tiny_llama.llama()
    session = Session(default_recipe("sparsegpt", 0.5))
    session.initialize(model=model, calibration_data=torch.zeros((0, 8), dtype=torch.long))
    with pytest.raises(ValueError) as info:
        run_sequential(session, progress=False)
    assert str(info.value) == (
        "the calibration data holds no token (input_ids of shape (0, 8)): give at least one window of tokens"
    )
    assert session.lifecycle == "initialized"
