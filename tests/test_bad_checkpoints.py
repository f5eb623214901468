"""Broken model checkpoints refused in one line before any work, and what a failed run leaves behind.

Found by a tester: an index with an empty weight_map crashed inside transformers; a checkpoint missing a tensor was
compressed with transformers' random values in its place (exit 0), and one of another shape was refused in
transformers' multi-line report, or quantized by model_free into a checkpoint that cannot reload.
"""

from __future__ import annotations

import errno
import gc
import pickle
import types
import weakref

import pytest
import tiny_families
import tiny_llama
import torch
import transformers
from safetensors.torch import load_file, save_file

import llmc_fsm
from llmc_fsm.cli import main
from llmc_fsm.models.hf_io import load_hf_dir
from llmc_fsm.oneshot_job.data import torch_dtype_of
from llmc_fsm.output.workdir import WorkDir
from llmc_fsm.session import checkpoint_io
from llmc_fsm.toolkit import views

FP8 = {"s": {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}}}
NO_MATCH = "the checkpoint does not match the model its config.json describes"


@pytest.fixture
def model_dir(tmp_path):
    """A tiny tied Llama (``lm_head`` not in the file) with a tokenizer, and calibration text."""
    return tiny_llama.build_with_text(tmp_path)


def _rewrite(directory, change):
    """Rewrite ``directory/model.safetensors`` with ``change(tensors)``."""
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_an_index_listing_no_tensors_is_refused_in_one_line(model_dir, tmp_path):
    """An index whose weight_map is empty crashed from_pretrained with an IndexError (34 lines), and model_free
    advised running oneshot on the directory, which crashed."""
    directory, _ = model_dir
    (directory / "model.safetensors").rename(directory / "model-00001-of-00001.safetensors")
    index = directory / "model.safetensors.index.json"
    index.write_text('{"metadata": {}, "weight_map": {}}')
    expected = (
        f"{index}: the index lists no tensors (its weight_map is empty); copy the model's complete "
        "model.safetensors.index.json or save the model again"
    )
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(directory), recipe=FP8, output_dir=tmp_path / "a", progress=False)
    assert str(info.value) == expected
    with pytest.raises(ValueError) as info:
        llmc_fsm.model_free_ptq(str(directory), tmp_path / "b", scheme="FP8_DYNAMIC", progress=False)
    assert str(info.value) == expected
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_index_naming_the_wrong_shard_is_refused_in_one_line(model_dir, tmp_path, capsys):
    """An index listing a tensor in a shard that does not hold it (a partly re-saved copy) crashed oneshot with a
    raw SafetensorError traceback, streamed and in memory (found by a re-tester)."""
    import json

    directory, text = model_dir
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    key = "model.layers.0.mlp.down_proj.weight"
    first = {k: v for k, v in tensors.items() if k != key}
    save_file(first, str(directory / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file({key: tensors[key]}, str(directory / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in tensors}  # the stale entry: key in shard 1
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    expected = (
        f"{directory}: model.safetensors.index.json lists {key} in model-00001-of-00002.safetensors, which does not "
        "hold it; the index does not match the shards: copy the checkpoint again, or save the model again"
    )
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(directory), recipe=FP8, output_dir=tmp_path / "a", progress=False)
    assert str(info.value) == expected
    assert main(tiny_llama.oneshot_argv(directory, text, tmp_path / "b", "--num-samples", "4")) == 1  # streamed
    assert capsys.readouterr().err == f"llmc-fsm oneshot: error: {expected}\n"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_peft_adapter_beside_the_model_is_refused_before_any_work(model_dir, tmp_path, capsys):
    """Adapter files beside the weights: transformers attached the LoRA layers on load, so in memory the save failed
    after all the work (peft's version), and low_memory dropped the adapter without a word (found by a re-tester)."""
    directory, text = model_dir
    (directory / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    expected = (
        f"{directory} holds a peft adapter (adapter_config.json) beside the model's weights, which transformers "
        "attaches when loading; llmc-fsm compresses a plain model: merge the adapter first (peft: "
        "PeftModel.from_pretrained(base, DIR).merge_and_unload().save_pretrained(NEW_DIR)) or move the adapter "
        "files out of the directory"
    )
    for low_memory in (False, True):
        with pytest.raises(ValueError) as info:
            llmc_fsm.oneshot(model=str(directory), recipe=FP8, output_dir=tmp_path / "a", progress=False,
                             low_memory=low_memory)
        assert str(info.value) == expected
    assert main(tiny_llama.oneshot_argv(directory, text, tmp_path / "b", "--num-samples", "4")) == 1
    assert capsys.readouterr().err == f"llmc-fsm oneshot: error: {expected}\n"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

def test_a_missing_tensor_is_refused_before_any_work_on_every_path(model_dir, tmp_path, capsys):
    """A checkpoint without one down_proj was loaded with a random one, compressed and saved (exit 0); model_free
    wrote the checkpoint without it. The tied head absent from the file is not missing."""
    directory, text = model_dir
    _rewrite(directory, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    expected = (
        f"{directory}: {NO_MATCH} (missing model.layers.1.mlp.down_proj.weight); nothing was loaded: copy the "
        "complete checkpoint, or fix config.json"
    )
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(directory), recipe=FP8, output_dir=tmp_path / "a", progress=False)
    assert str(info.value) == expected
    assert main(tiny_llama.oneshot_argv(directory, text, tmp_path / "b", "--num-samples", "4")) == 1  # streamed
    assert capsys.readouterr().err == f"llmc-fsm oneshot: error: {expected}\n"
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(directory), recipe=FP8, output_dir=tmp_path / "c", progress=False, low_memory=True)
    assert str(info.value) == expected  # low_memory advised "save the model again", which brings back nothing
    with pytest.raises(ValueError) as info:
        llmc_fsm.model_free_ptq(str(directory), tmp_path / "d", scheme="FP8_DYNAMIC", progress=False)
    assert str(info.value) == (
        f"model_free_ptq: {NO_MATCH} (missing model.layers.1.mlp.down_proj.weight); nothing was written: copy the "
        "complete checkpoint, or fix config.json"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.txt", "model"]


def test_a_wrongly_shaped_tensor_is_named_with_its_file_and_both_shapes(model_dir, tmp_path):
    """A q_proj stored 64x8 (config 64x64) was refused with transformers' "You set `ignore_mismatched_sizes` to
    `False`..." after its report; model_free quantized it into a checkpoint that cannot reload."""
    directory, _ = model_dir
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(directory, lambda t: t.update({name: t[name][:, :8].contiguous()}))
    shape = f"{name} in model.safetensors is [64, 8], config.json gives [64, 64]"
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(directory), recipe=FP8, output_dir=tmp_path / "a", progress=False)
    assert str(info.value) == (
        f"{directory}: {NO_MATCH} (other shapes: {shape}); nothing was loaded: copy the complete checkpoint, or fix "
        "config.json"
    )
    with pytest.raises(ValueError) as info:
        llmc_fsm.model_free_ptq(str(directory), tmp_path / "b", scheme="FP8_DYNAMIC", progress=False)
    assert str(info.value) == (
        f"model_free_ptq: {NO_MATCH} (other shapes: {shape}); nothing was written: copy the complete checkpoint, "
        "or fix config.json"
    )


def test_a_pytorch_bin_checkpoint_missing_a_tensor_is_refused_after_loading(tmp_path):
    """pytorch_model.bin weights are not read before loading: transformers' own report of what it filled with
    random values is refused (it was a warning, and the run went on)."""
    model = tiny_llama.llama(tied=False)
    model.config.save_pretrained(tmp_path)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError) as info:
        load_hf_dir(tmp_path, torch.float32)
    assert str(info.value) == (
        f"{tmp_path}: {NO_MATCH} (missing lm_head.weight); from_pretrained filled those with random values: copy the "
        "complete checkpoint, or fix config.json"
    )


def _failing_sparsegpt(monkeypatch, at):
    from llmc_fsm_pruning import sparsegpt

    original, calls = sparsegpt.SparseGPTModifier._compress_group, []

    def compress(self, modules, acc):
        calls.append(1)
        if len(calls) == at:
            raise RuntimeError("boom")
        return original(self, modules, acc)

    monkeypatch.setattr(sparsegpt.SparseGPTModifier, "_compress_group", compress)


@pytest.mark.parametrize(("at", "advice"), [
    (3, " The model you passed was changed in place by this run before the error (see the note): reload it."),
    (1, " The model you passed was not changed."),
])  # fmt: skip
def test_a_failed_oneshot_gives_no_session_advice(monkeypatch, at, advice):
    """oneshot() raised the session's "No in-place change to a parameter of the model was seen. The event counts as
    delivered; ... Continue, or finalize()/reset() the session." to a caller holding no session, beside a note
    listing the modules the run had changed."""
    _failing_sparsegpt(monkeypatch, at)
    model = tiny_llama.llama()
    with pytest.raises(llmc_fsm.ModifierError) as info:
        llmc_fsm.oneshot(model=model, recipe={"s": {"SparseGPTModifier": {"sparsity": 0.5}}},
                         dataset=torch.randint(3, 100, (4, 16)), progress=False)  # fmt: skip
    assert str(info.value) == (
        "SparseGPTModifier.on_sequential_epoch_end() raised RuntimeError: boom (during sequential_epoch_end())."
        + advice
    )
    assert (getattr(info.value, "__notes__", None) is not None) == (at == 3)


def test_weight_views_leave_nothing_on_the_module():
    """The views were cached on each module (``_llmc_fsm_weight_views``) and left there: torch.save(model) of a
    fused-experts model pickled llmc-fsm's LinearView, so loading it needed llmc-fsm."""
    model = tiny_families.build("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    found = views.weight_views(experts)
    assert len(found) == 3 * experts.num_experts and views.weight_views(experts) is found
    assert all(v.owner is experts and v.source is experts for v in found.values())
    assert "_llmc_fsm_weight_views" not in experts.__dict__
    assert b"llmc_fsm" not in pickle.dumps(experts)
    views.clear_weight_views(experts)
    assert views.weight_views(experts) is not found
    gone = weakref.ref(experts)
    del model, experts, found
    gc.collect()
    assert gone() is None  # the views cached for it do not keep it alive


def test_a_failed_session_save_keeps_the_previous_checkpoint_and_names_the_file(tmp_path, monkeypatch):
    """A full disk left the new tensors-*.safetensors beside the previous checkpoint and raised an OSError without a
    path."""
    checkpoint_io.write_checkpoint({"w": torch.ones(2)}, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    write = checkpoint_io._write_atomic

    def full(target, data):
        if target.name == "session.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        write(target, data)

    monkeypatch.setattr(checkpoint_io, "_write_atomic", full)
    with pytest.raises(OSError) as info:
        checkpoint_io.write_checkpoint({"w": torch.zeros(2)}, tmp_path)
    assert str(info.value) == (
        f"cannot save a session checkpoint: writing {tmp_path / 'session.json'} failed (No space left on device); "
        "the previous checkpoint there was kept"
    )
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_file_in_place_of_the_work_directory_is_named(tmp_path):
    """It said "cannot create files in '<parent>' (File exists)", naming the wrong thing."""
    (tmp_path / ".out.work").write_text("x")
    with pytest.raises(FileExistsError) as info:
        WorkDir.claim(tmp_path / "out")
    assert str(info.value) == (
        f"cannot write the output directory {str(tmp_path / 'out')!r}: {str(tmp_path / '.out.work')!r}, where the "
        "run keeps its work directory, exists and is not a directory; remove or rename it"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.work"]


def test_resuming_with_an_unreadable_fingerprint_says_it_is_unreadable(tmp_path):
    """A corrupt fingerprint.json with --resume said "changed since that run; use the original settings", which no
    settings could satisfy."""
    work = WorkDir.claim(tmp_path / "out")
    (work.progress / "pass-0").mkdir(parents=True)
    save_file({"a": torch.ones(1)}, str(work.progress / "pass-0" / "layer-0.safetensors"))
    (work.path / "fingerprint.json").write_text("{not json")
    try:
        with pytest.raises(ValueError) as info:
            work.settle({"model": "m"}, resume=True)
    finally:
        work.release()
    assert str(info.value) == (
        f"cannot resume from {str(work.path)!r}: its fingerprint.json (the settings of the interrupted run) is "
        "missing or unreadable, so this run cannot be checked against them; remove that directory to start over"
    )


def test_the_dtype_of_a_config_is_read_without_the_deprecated_torch_dtype(monkeypatch):
    """Reading config.torch_dtype made transformers warn "`torch_dtype` is deprecated!" on every in-memory run of a
    model whose config names no dtype."""

    def deprecated(self):
        raise AssertionError("config.torch_dtype read")

    monkeypatch.setattr(transformers.PretrainedConfig, "torch_dtype", property(deprecated))
    assert torch_dtype_of("auto", transformers.LlamaConfig()) is torch.float32
    assert torch_dtype_of("auto", types.SimpleNamespace(torch_dtype="bfloat16")) is torch.bfloat16  # transformers 4
    assert torch_dtype_of("auto", transformers.LlamaConfig(dtype="float16")) is torch.float16


def test_a_full_disk_while_saving_progress_names_the_file(tmp_path, monkeypatch):
    """A full disk while a layer was saved said "[Errno 28] No space left on device: '<work directory>'", naming
    the directory instead of the file, and left the partial file taking the space."""
    from safetensors import SafetensorError

    from llmc_fsm.oneshot_job import resume

    def full(tensors, filename, metadata=None):
        open(filename, "wb").write(b"x")
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                              'space left on device" })')  # fmt: skip

    monkeypatch.setattr(resume, "save_file", full)
    with pytest.raises(OSError) as info:
        resume.save_windows(tmp_path, torch.zeros(2, 4, dtype=torch.long))
    assert str(info.value) == f"[Errno 28] No space left on device: '{tmp_path / 'calibration.safetensors'}'"
    assert list(tmp_path.iterdir()) == []
