"""One-shot resume (issue 10): a run killed after decoder layer k continues there with ``--resume``.

The resumed result must be bitwise identical to an uninterrupted run (weights,
quantization parameters, report values); ``--resume`` with anything the result
depends on changed is refused, naming what changed; a leftover work directory
without ``--resume`` is reported before any model work.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import tiny_llama
import torch
from safetensors.torch import load_file

import llmc_fsm
import llmc_fsm.data.protocol as llmc_fsm_data
import llmc_fsm.oneshot_job.phases as phases
import llmc_fsm.pipeline.sequential as pipeline_sequential
import llmc_fsm.pipeline.streaming as pipeline_streaming
from llmc_fsm.oneshot_job.resume import LayerProgress
from llmc_fsm.oneshot_job.settings import default_recipe
from llmc_fsm.output.save import dir_size_bytes

pytest.importorskip("transformers")
pytest.importorskip("llmc_fsm_pruning")


#: round-to-nearest FP8 with static input scales: calibrated, its weight update deferred (later layers calibrate on
#: the layers as loaded, :func:`llmc_fsm.pipeline.layer.defers_weights`)
RTN_FP8_STATIC = {"q": {"QuantizationModifier": {"scheme": "FP8"}}}


def _args(tiny_model_dir, out: Path, *extra: str) -> list[str]:
    # --in-memory: these tests check the in-memory path's progress (the CLI streams such a job by default; the
    # streamed path's resume is tested below)
    options = ("--num-samples", "16", "--batch-size", "4", "--in-memory")
    return tiny_llama.oneshot_argv(*tiny_model_dir, out, *options, *extra)


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def _assert_bitwise_equal(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    different = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    assert different == []


def _report_modules(out: Path) -> list[dict]:
    return json.loads((out / "report.json").read_text())["sparsity"]["modules"]


def _listing(directory: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# --------------------------------------------------------------------------- SIGKILL, then --resume
def test_sigkill_at_layer_k_then_resume_is_bitwise_identical(tiny_model_dir, tmp_path):
    ref = tiny_llama.run_cli(_args(tiny_model_dir, tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    assert ref.stderr == ""  # --no-progress: no bar from us, transformers or compressed-tensors

    killed = tiny_llama.run_cli(_args(tiny_model_dir, tmp_path / "out"), signal_at="layer:1:SIGKILL")
    assert killed.returncode == -9  # SIGKILL right after layer 1 was saved
    work = tmp_path / ".out.work"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.work", "ref"]
    assert sorted(p.name for p in (work / "progress" / "pass-0").iterdir()) == [
        "layer-00000.safetensors",
        "layer-00001.safetensors",
    ]

    again = tiny_llama.run_cli(_args(tiny_model_dir, tmp_path / "out"))  # no --resume: one line, nothing touched
    before = _listing(work)
    assert again.returncode == 1
    size = dir_size_bytes(work) / 1e6
    assert again.stderr == (
        f"llmc-fsm oneshot: error: output {str(tmp_path / 'out')!r}: an interrupted run left its progress in "
        f"{str(work)!r} (2 of 4 decoder layers done, {size:.1f} MB); run the same command with --resume "
        "(resume=True) to continue it, or remove that directory to start over\n"
    )
    assert _listing(work) == before

    resumed = tiny_llama.run_cli(_args(tiny_model_dir, tmp_path / "out", "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr == f"WARNING llmc_fsm.output.workdir: resuming from {work} (2 of 4 decoder layers done)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref"]
    _assert_bitwise_equal(tmp_path / "ref", tmp_path / "out")
    assert _report_modules(tmp_path / "out") == _report_modules(tmp_path / "ref")


def test_quantized_layers_resume_with_their_quantization_parameters(tiny_model_dir, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "prune:\n  SparseGPTModifier: {sparsity: 0.5, mask_structure: '2:4'}\n"
        "quantize:\n  GPTQModifier: {scheme: {preset: W4A16, weights: {group_size: 32}}}\n",
        encoding="utf-8",
    )
    pytest.importorskip("llmc_fsm_quantization")
    ref = tiny_llama.run_cli(_args(tiny_model_dir, tmp_path / "ref", "--recipe", str(recipe)))
    assert ref.returncode == 0, ref.stderr
    killed = tiny_llama.run_cli(
        _args(tiny_model_dir, tmp_path / "out", "--recipe", str(recipe)), signal_at="layer:2:SIGKILL"
    )
    assert killed.returncode == -9
    resumed = tiny_llama.run_cli(_args(tiny_model_dir, tmp_path / "out", "--recipe", str(recipe), "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    _assert_bitwise_equal(tmp_path / "ref", tmp_path / "out")
    tensors = _tensors(tmp_path / "out")
    assert "model.layers.0.mlp.down_proj.weight_packed" in tensors  # saved quantized (compressed-tensors)
    assert "model.layers.0.mlp.down_proj.weight_scale" in tensors
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (
        config["quantization_config"]
        == json.loads((tmp_path / "ref" / "config.json").read_text())["quantization_config"]
    )
    modules = _report_modules(tmp_path / "out")
    assert modules == _report_modules(tmp_path / "ref")
    assert {m["bits"] for m in modules if m["name"].startswith("model.layers.")} == {4}


# --------------------------------------------------------------------------- in-process (Python API)
def _tiny_module():
    return tiny_llama.llama(vocab=96, hidden=32, layers=3, heads=2, kv_heads=1, positions=2048)


def _interrupt_after(monkeypatch, layer: int, pass_index: int = 0) -> None:
    original = LayerProgress.save

    def save(self, index, module):
        original(self, index, module)
        if index == layer and self.directory.name == f"pass-{pass_index}":
            raise KeyboardInterrupt

    monkeypatch.setattr(LayerProgress, "save", save)


TWO_PASSES = {
    "prune": {"WandaPruningModifier": {"sparsity": 0.5}},
    "more": {"SparseGPTModifier": {"sparsity": 0.7}},
}


def test_second_pass_interrupted_resumes_bitwise(tmp_path, monkeypatch):
    data = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(1))
    kw = {"recipe": TWO_PASSES, "dataset": data, "batch_size": 4, "fuse_stages": False, "progress": False}
    ref = llmc_fsm.oneshot(model=_tiny_module(), **kw)
    with monkeypatch.context() as m:
        _interrupt_after(m, layer=0, pass_index=1)
        with pytest.raises(KeyboardInterrupt) as info:
            llmc_fsm.oneshot(model=_tiny_module(), output_dir=tmp_path / "o", **kw)
    assert info.value.__notes__[0].startswith("oneshot: the model you passed was changed in place before this error")
    assert info.value.__notes__[-1].endswith(
        "(4 of 6 layer passes done (2 passes over 3 decoder layers)): run the same command with --resume "
        "(resume=True) to continue, or remove that directory"
    )
    out = llmc_fsm.oneshot(model=_tiny_module(), output_dir=tmp_path / "o", resume=True, **kw)
    ref_state, out_state = ref.state_dict(), out.state_dict()
    assert [k for k in ref_state if not torch.equal(ref_state[k], out_state[k])] == []
    assert out.llmc_fsm_report.to_dict()["sparsity"] == ref.llmc_fsm_report.to_dict()["sparsity"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


@pytest.mark.parametrize(
    "recipe",
    [
        {"q": {"GPTQModifier": {"scheme": "W8A8"}}},
        {"q": {"GPTQModifier": {"scheme": "FP8_DYNAMIC"}}},
        {"p": {"SparseGPTModifier": {"sparsity": 0.5}}, "q": {"QuantizationModifier": {"scheme": "W8A8"}}},
        RTN_FP8_STATIC,  # later layers calibrate on the layers as loaded: a resumed run propagates before restoring
    ],
)
def test_activation_quantizing_schemes_resume_bitwise(tmp_path, monkeypatch, recipe):
    # a group's head used to finish the call it began before quantization without input quantization, while
    # a resumed run propagates through fully quantized layers: layer 1 on differed by up to 3 int8 steps
    pytest.importorskip("llmc_fsm_quantization")
    data = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(1))
    kw = {"recipe": recipe, "dataset": data, "batch_size": 4, "fuse_stages": True, "progress": False}
    ref = llmc_fsm.oneshot(model=_tiny_module(), **kw)
    with monkeypatch.context() as m:
        _interrupt_after(m, layer=0)
        with pytest.raises(KeyboardInterrupt):
            llmc_fsm.oneshot(model=_tiny_module(), output_dir=tmp_path / "o", **kw)
    out = llmc_fsm.oneshot(model=_tiny_module(), output_dir=tmp_path / "o", resume=True, **kw)
    ref_state, out_state = ref.state_dict(), out.state_dict()
    assert [k for k in ref_state if not torch.equal(ref_state[k], out_state[k])] == []


def test_resume_reuses_generated_calibration_and_perplexity_before(tiny_model_dir, tmp_path, monkeypatch):
    model_dir, text = tiny_model_dir
    kw = {
        "num_calibration_samples": 8,
        "max_seq_length": 24,
        "batch_size": 4,
        "progress": False,
        "eval_text": text,
        "num_eval_windows": 4,
    }
    ref = llmc_fsm.oneshot(model=str(model_dir), **kw)
    with monkeypatch.context() as m:
        _interrupt_after(m, layer=2)
        with pytest.raises(KeyboardInterrupt):
            llmc_fsm.oneshot(model=str(model_dir), output_dir=tmp_path / "o", **kw)

    def no_generation(*a, **k):
        raise AssertionError("calibration data generated again")

    monkeypatch.setattr("llmc_fsm.oneshot_job.phases.generate_calibration", no_generation)  # where it is called
    measured = []
    perplexity = llmc_fsm_data.perplexity
    monkeypatch.setattr(phases, "perplexity", lambda *a, **k: measured.append(1) or perplexity(*a, **k))
    out = llmc_fsm.oneshot(model=str(model_dir), output_dir=tmp_path / "o", resume=True, **kw)
    assert measured == [1]  # only after compression: the value before is the first run's
    # the interrupted run had reused the dense-perplexity cache the reference run filled: the resumed report keeps
    # its note (it used to drop it), as an uninterrupted run's report would say
    assert out.llmc_fsm_report.to_dict()["eval"]["before"].startswith("reused: measured 20")
    assert "before" not in ref.llmc_fsm_report.to_dict()["eval"]  # the reference measured it itself
    assert out.llmc_fsm_report.calibration == ref.llmc_fsm_report.calibration
    assert (out.llmc_fsm_report.ppl_before, out.llmc_fsm_report.ppl_after) == (
        ref.llmc_fsm_report.ppl_before,
        ref.llmc_fsm_report.ppl_after,
    )
    ref_state, out_state = ref.state_dict(), out.state_dict()
    assert [k for k in ref_state if not torch.equal(ref_state[k], out_state[k])] == []


# --------------------------------------------------------------------------- fingerprint mismatches
@pytest.fixture
def leftover(tiny_model_dir, tmp_path, monkeypatch):
    """A copy of the tiny model and text, and a run on them interrupted after layer 1 (``(model, text, out)``)."""
    model_dir, text = tiny_model_dir
    model = shutil.copytree(model_dir, tmp_path / "model")
    text = Path(shutil.copy(text, tmp_path / "cal.txt"))
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _interrupt_after(m, layer=1)
        with pytest.raises(KeyboardInterrupt):
            llmc_fsm.oneshot(
                model=str(model),
                dataset=text,
                num_calibration_samples=16,
                max_seq_length=32,
                output_dir=out,
                progress=False,
            )
    return model, text, out


def _resume(model, text, out, **changed):
    kw = {
        "model": str(model),
        "dataset": text,
        "num_calibration_samples": 16,
        "max_seq_length": 32,
        "output_dir": out,
        "progress": False,
        "resume": True,
    }
    return llmc_fsm.oneshot(**{**kw, **changed})


def _refusal(work: Path, changes: str) -> str:
    return (
        f"cannot resume from {str(work)!r}: {changes} — changed since that run; use the original settings, or "
        "remove that directory to start over"
    )


def test_resume_with_changed_settings_is_refused_naming_them(leftover, monkeypatch):
    model, text, out = leftover
    work = out.parent / ".out.work"
    before = _listing(work)

    def no_model_work(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("llmc_fsm.oneshot_job.phases.load_model", no_model_work)  # where the job calls it
    cases = [
        ({"recipe": default_recipe(sparsity=0.6)}, "recipe (sparsity_stage.SparseGPTModifier.sparsity 0.5 -> 0.6)"),
        ({"seed": 1}, "seed (0 -> 1)"),
        ({"max_seq_length": 16}, "calibration data (seq_len 32 -> 16)"),
        ({"batch_size": 4}, "pipeline (batch_size 8 -> 4)"),
    ]
    for changed, expected in cases:
        with pytest.raises(ValueError) as info:
            _resume(model, text, out, **changed)
        assert str(info.value) == _refusal(work, expected)
    # calibration text changed
    old_sha = hashlib.sha256(text.read_bytes()).hexdigest()[:16]
    text.write_text(text.read_text() + "w001 w002\n", encoding="utf-8")
    new_sha = hashlib.sha256(text.read_bytes()).hexdigest()[:16]
    with pytest.raises(ValueError) as info:
        _resume(model, text, out)
    assert str(info.value) == _refusal(work, f"calibration data (sha256 {old_sha!r} -> {new_sha!r})")
    # model files changed, and the library version too: both named
    (model / "generation_config.json").write_text("{}\n", encoding="utf-8")
    monkeypatch.setattr(llmc_fsm.core.version, "__version__", "9.9.9")
    with pytest.raises(ValueError) as info:
        _resume(model, text, out)
    assert str(info.value) == _refusal(
        work,
        "model (files changed: generation_config.json); calibration data (sha256 "
        f"{old_sha!r} -> {new_sha!r}); library versions (llmc-fsm '0.1.0' -> '9.9.9')",
    )
    assert _listing(work) == before  # every refusal left the saved progress as it was


def test_resume_without_progress_starts_over_with_a_warning(tmp_path, caplog):
    data = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    with caplog.at_level("WARNING"):
        llmc_fsm.oneshot(model=_tiny_module(), dataset=data, output_dir=tmp_path / "o", resume=True, progress=False)
    assert f"resume: no saved progress in {tmp_path / '.o.work'}; starting from the first layer" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_resume_needs_an_output_directory():
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=_tiny_module(), resume=True, progress=False)
    assert str(info.value) == (
        "resume (--resume) needs output_dir (--output): the progress to resume is kept next to the output"
    )


def test_resume_with_another_thread_count_warns(leftover, monkeypatch, caplog):
    model, text, out = leftover
    threads = torch.get_num_threads()
    monkeypatch.setattr("llmc_fsm.output.workdir._threads", lambda: threads + 1)
    with caplog.at_level("WARNING"):
        _resume(model, text, out)
    assert (
        f"the interrupted run used {threads} torch thread(s), this one {threads + 1}: the result may differ in the "
        f"last bits from an uninterrupted run (pass --threads {threads} for the same bits)"
    ) in caplog.text
    # the report keeps it (a resumed output mixing thread counts could not be told apart; a newcomer's case)
    execution = json.loads((out / "report.json").read_text())["execution"]
    assert (execution["threads"], execution["resumed"]) == (threads, {"threads": threads})


def test_a_streamed_resume_refuses_changed_settings_before_the_saved_progress_is_touched(leftover, monkeypatch):
    model, text, out = leftover  # the progress of an in-memory run
    work = out.parent / ".out.work"
    before = _listing(work)

    def no_model_work(*a, **k):
        raise AssertionError("the model was indexed")

    monkeypatch.setattr("llmc_fsm.oneshot_job.streaming.load_lazy", no_model_work)  # where the streamed job calls it
    with pytest.raises(ValueError) as info:
        _resume(model, text, out, low_memory=True, batch_size=4)
    assert str(info.value) == _refusal(work, "pipeline (batch_size 8 -> 4)")
    assert _listing(work) == before
    assert not out.exists()


# --------------------------------------------------------------------------- the streamed path (low_memory)
GPTQ_G16 = {"q": {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}}}}
SPARSEGPT = {"s": {"SparseGPTModifier": {"sparsity": 0.5}}}


@pytest.fixture
def streamed(tiny_model_dir, monkeypatch):
    """``run(out, **kw)``: a one-shot job on the tiny model (4 decoder layers) and text, with evaluation windows."""
    # a streamed run fixes glibc's mmap threshold for the whole process; spare the rest of the test session
    monkeypatch.setattr("llmc_fsm.oneshot_job.streaming.limit_heap_growth", lambda: False)
    monkeypatch.setenv("LLMC_FSM_PERPLEXITY_CACHE", "off")  # every run measures its perplexity before
    model_dir, text = tiny_model_dir
    base = {
        "model": str(model_dir),
        "dataset": text,
        "eval_text": text,
        "num_eval_windows": 3,
        "num_calibration_samples": 8,
        "max_seq_length": 32,
        "batch_size": 4,
        "progress": False,
    }
    return lambda out, **kw: llmc_fsm.oneshot(**{**base, "output_dir": out, **kw})


def _count_compressed_layers(monkeypatch) -> list[int]:
    """A list that gets one item per decoder layer calibrated and compressed, in memory or streamed."""
    compressed: list[int] = []
    for module in (pipeline_streaming, pipeline_sequential):
        real = module.compress_layer
        monkeypatch.setattr(module, "compress_layer", lambda *a, real=real, **k: compressed.append(1) or real(*a, **k))
    return compressed


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def _report(out: Path) -> dict:
    report = json.loads((out / "report.json").read_text())
    return {k: report[k] for k in ("model", "recipe", "calibration", "eval", "perplexity", "sparsity")}


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("recipe", [GPTQ_G16, SPARSEGPT, RTN_FP8_STATIC], ids=["gptq-w4a16", "sparsegpt", "rtn-fp8"])
def test_a_streamed_run_interrupted_after_layer_k_resumes_bitwise(streamed, tmp_path, monkeypatch, recipe, layer):
    streamed(tmp_path / "ref", recipe=recipe, low_memory=True)
    with monkeypatch.context() as m:
        _interrupt_after(m, layer=layer)
        with pytest.raises(KeyboardInterrupt) as info:
            streamed(tmp_path / "out", recipe=recipe, low_memory=True)
    work = tmp_path / ".out.work"
    assert info.value.__notes__[-1] == (
        f"progress kept in {str(work)!r} ({layer + 1} of 4 decoder layers done): run the same command with --resume "
        "(resume=True) to continue, or remove that directory"
    )
    assert sorted(p.name for p in (work / "progress" / "pass-0").iterdir()) == [
        f"layer-{k:05d}.safetensors" for k in range(layer + 1)
    ]
    compressed = _count_compressed_layers(monkeypatch)
    streamed(tmp_path / "out", recipe=recipe, low_memory=True, resume=True)
    assert len(compressed) == 4 - (layer + 1)  # the saved layers were restored, not calibrated again
    ref, out = _files(tmp_path / "ref"), _files(tmp_path / "out")
    assert len(ref) == 4 + 1 and sorted(out) == sorted(ref)  # the outer tensors, then one shard per decoder layer
    assert [name for name in ref if out[name] != ref[name]] == []
    assert (tmp_path / "out" / "model.safetensors.index.json").read_text() == (
        tmp_path / "ref" / "model.safetensors.index.json"
    ).read_text()
    assert _report(tmp_path / "out") == _report(tmp_path / "ref")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref"]


AUTOROUND = {"q": {"AutoRoundModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}, "iters": 10,
                                         "batch_size": 4}}}  # fmt: skip


@pytest.mark.parametrize("low_memory", [False, True], ids=["in-memory", "streamed"])
def test_an_interrupted_autoround_run_resumes_to_the_uninterrupted_checkpoint(streamed, tmp_path, monkeypatch,
                                                                               low_memory):  # fmt: skip
    """AutoRound tunes each layer toward the float model's output, carried from layer to layer: the resumed run
    runs the restored layers as loaded to get its first layer's float inputs (``resume_float_inputs``); without
    them that layer would be tuned toward another target and the checkpoint would differ."""
    from llmc_fsm_quantization.autoround import AutoRoundModifier

    streamed(tmp_path / "ref", recipe=AUTOROUND, low_memory=low_memory)
    for out in ("out", "without"):
        with monkeypatch.context() as m:
            _interrupt_after(m, layer=1)
            with pytest.raises(KeyboardInterrupt):
                streamed(tmp_path / out, recipe=AUTOROUND, low_memory=low_memory)
    streamed(tmp_path / "out", recipe=AUTOROUND, low_memory=low_memory, resume=True)
    ref, out = _files(tmp_path / "ref"), _files(tmp_path / "out")
    assert sorted(out) == sorted(ref) and [name for name in ref if out[name] != ref[name]] == []
    assert _report(tmp_path / "out") == _report(tmp_path / "ref")
    monkeypatch.setattr(AutoRoundModifier, "resume_float_inputs", lambda self, inputs: None)
    streamed(tmp_path / "without", recipe=AUTOROUND, low_memory=low_memory, resume=True)
    without = _files(tmp_path / "without")
    assert [name for name in ref if without[name] != ref[name]] != []


#: AutoRound's iters: 0 (auto-round's optimized round-to-nearest: each group's range searched on its inputs' mean
#: squares, observed in the calibration pass through the restored layers on a resumed run).
AUTOROUND_RTN = {"q": {"AutoRoundModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}, "iters": 0}}}


@pytest.mark.parametrize("recipe", [AUTOROUND, AUTOROUND_RTN], ids=["tuned", "optimized-rtn"])
@pytest.mark.parametrize("low_memory", [False, True], ids=["in-memory", "streamed"])
def test_a_resumed_autoround_run_reports_every_layers_tuning(streamed, tmp_path, monkeypatch, low_memory, recipe):
    """AutoRound's per-layer tuning errors (report.json ``tuning``) of the layers restored from progress come from
    the saved layers (``progress_state``): the resumed run's report has every layer's, equal to the uninterrupted
    run's, and so are its tensors (iters: 0 too)."""
    streamed(tmp_path / "ref", recipe=recipe, low_memory=low_memory)
    with monkeypatch.context() as m:
        _interrupt_after(m, layer=1)
        with pytest.raises(KeyboardInterrupt):
            streamed(tmp_path / "out", recipe=recipe, low_memory=low_memory)
    compressed = _count_compressed_layers(monkeypatch)
    streamed(tmp_path / "out", recipe=recipe, low_memory=low_memory, resume=True)
    assert len(compressed) == 2  # layers 0 and 1 restored, not tuned again
    ref, out = (json.loads((tmp_path / d / "report.json").read_text())["tuning"] for d in ("ref", "out"))
    assert list(out) == list(ref) == ["AutoRoundModifier (q)"]
    assert sorted(out["AutoRoundModifier (q)"]) == [f"model.layers.{k}" for k in range(4)]
    assert out == ref
    files, ref_files = _files(tmp_path / "out"), _files(tmp_path / "ref")
    assert sorted(files) == sorted(ref_files) and [n for n in ref_files if files[n] != ref_files[n]] == []


@pytest.mark.parametrize("first", ["in memory", "streamed"])
def test_progress_resumes_bitwise_on_the_other_path(streamed, tmp_path, monkeypatch, first):
    """In-memory progress resumed by a streamed run, and streamed progress by an in-memory run: the same files (one
    format), the same fingerprint, the same bits as an uninterrupted run on the resuming path."""
    then = "streamed" if first == "in memory" else "in memory"
    streamed(tmp_path / "ref", recipe=GPTQ_G16, low_memory=then == "streamed")
    with monkeypatch.context() as m:
        _interrupt_after(m, layer=1)
        with pytest.raises(KeyboardInterrupt):
            streamed(tmp_path / "out", recipe=GPTQ_G16, low_memory=first == "streamed")
    compressed = _count_compressed_layers(monkeypatch)
    streamed(tmp_path / "out", recipe=GPTQ_G16, low_memory=then == "streamed", resume=True)
    assert len(compressed) == 2  # layers 0 and 1 restored from the other path's progress
    ref, out = _files(tmp_path / "ref"), _files(tmp_path / "out")
    assert sorted(out) == sorted(ref) == (
        [f"model-{k:05d}-of-00005.safetensors" for k in range(1, 6)] if then == "streamed" else ["model.safetensors"]
    )
    assert [name for name in ref if out[name] != ref[name]] == []
    assert _report(tmp_path / "out") == _report(tmp_path / "ref")


def test_the_cli_default_streams_a_calibrated_job_and_resumes_it_after_sigkill(tiny_model_dir, tmp_path):
    args = ("--num-samples", "16", "--batch-size", "4", "--method", "gptq", "--scheme", "W4A16", "--group-size", "16")
    ref = tiny_llama.run_cli(tiny_llama.oneshot_argv(*tiny_model_dir, tmp_path / "ref", *args))
    assert ref.returncode == 0, ref.stderr
    killed = tiny_llama.run_cli(tiny_llama.oneshot_argv(*tiny_model_dir, tmp_path / "out", *args),
                                signal_at="layer:1:SIGKILL")
    assert killed.returncode == -9
    work = tmp_path / ".out.work"
    resumed = tiny_llama.run_cli(tiny_llama.oneshot_argv(*tiny_model_dir, tmp_path / "out", *args, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr == f"WARNING llmc_fsm.output.workdir: resuming from {work} (2 of 4 decoder layers done)\n"
    ref_files, out_files = _files(tmp_path / "ref"), _files(tmp_path / "out")
    assert len(ref_files) == 4 + 1  # streamed by default: one shard per decoder layer and one for the rest
    assert sorted(out_files) == sorted(ref_files)
    assert [name for name in ref_files if out_files[name] != ref_files[name]] == []
    assert _report_modules(tmp_path / "out") == _report_modules(tmp_path / "ref")


def test_a_resumed_run_that_fails_keeps_the_progress_it_resumed(leftover, monkeypatch):
    model, text, out = leftover
    work = out.parent / ".out.work"
    before = _listing(work)

    def broken_load(run):
        raise RuntimeError("disk full of surprises")

    with monkeypatch.context() as m:
        m.setattr("llmc_fsm.oneshot_job.phases.load", broken_load)
        with pytest.raises(RuntimeError, match="disk full of surprises") as info:
            _resume(model, text, out)
    after = _listing(work)
    rewritten = {"owner.json", "fingerprint.json"}  # written again by the resuming run, same contents' sizes
    assert {k: v for k, v in after.items() if k not in rewritten} == {
        k: v for k, v in before.items() if k not in rewritten
    }
    sizes = [{k: v[0] for k, v in listing.items() if k in rewritten} for listing in (after, before)]
    assert sizes[0] == sizes[1]
    assert f"progress kept in {str(work)!r} (2 of " in "\n".join(info.value.__notes__)
    _resume(model, text, out)  # and it still resumes
    assert (out / "report.json").exists() and not work.exists()


def test_an_interrupted_overwrite_is_named_when_resumed_without_overwrite(leftover, monkeypatch):
    """An earlier output being replaced (--overwrite) stays until the new one is complete; resumed without
    --overwrite, the refusal said "It holds a finished run (report.json), so there is nothing to resume" while the
    interrupted run's progress waited beside it."""
    from llmc_fsm.output.workdir import work_dir_path

    model, text, out = leftover
    shutil.rmtree(work_dir_path(out))
    _resume(model, text, out, resume=False)  # a finished output
    with monkeypatch.context() as m:
        _interrupt_after(m, layer=1)
        with pytest.raises(KeyboardInterrupt):
            _resume(model, text, out, resume=False, overwrite=True)
    assert (out / "report.json").is_file() and (work_dir_path(out) / "fingerprint.json").is_file()
    with pytest.raises(FileExistsError) as info:
        _resume(model, text, out)
    assert str(info.value) == (
        f"output directory {str(out)!r} exists and is not empty; pass overwrite=True (--overwrite) to replace it. A "
        f"run replacing it (interrupted, or still running) keeps its progress in {str(work_dir_path(out))!r}: to "
        "continue an interrupted one, run the same command with --overwrite --resume (overwrite=True, resume=True)"
    )
    _resume(model, text, out, overwrite=True)  # and that continues it
    assert not work_dir_path(out).exists()


def test_a_hub_models_fingerprint_holds_the_commit_it_reads(tmp_path, monkeypatch):
    """A resumed run of a Hub ID whose ``main`` moved to another commit (a Hub update) mixed two models' layers: the ID
    alone was compared (found by a tester). The fingerprint holds the cached snapshot's commit; offline and not
    cached, none is known."""
    from huggingface_hub import constants

    from llmc_fsm.oneshot_job.resume import _model_item

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    folder = tmp_path / "hub" / "models--acme--tiny"
    assert _model_item("acme/tiny") == {"hub id": "acme/tiny", "revision": None}
    for commit in ("a" * 40, "b" * 40):
        (folder / "snapshots" / commit).mkdir(parents=True)
        (folder / "snapshots" / commit / "config.json").write_text("{}")
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text(commit)
        assert _model_item("acme/tiny") == {"hub id": "acme/tiny", "revision": commit}
    assert _model_item("not-a/hub/id") == {"hub id": "not-a/hub/id"}
    # online the load fetches main's commit on the Hub, whatever the cache holds: that one is recorded
    import huggingface_hub

    import llmc_fsm.oneshot_job.resume as resume

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(resume, "hub_unreachable", lambda endpoint: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo_id, timeout=None: type("I", (), {
        "sha": "c" * 40})())  # fmt: skip
    assert _model_item("acme/tiny") == {"hub id": "acme/tiny", "revision": "c" * 40}


def test_the_same_calibration_file_named_from_another_directory_is_the_same_data():
    """``--dataset cal.txt`` then, resuming from another directory, ``../run/cal.txt``: refused as "calibration data
    (source 'cal.txt' -> '../run/cal.txt') — changed" (a tester's case). Its digest decides; another digest, or
    another count or length, is a change."""
    from llmc_fsm.output.workdir import fingerprint_changes

    saved = {"calibration data": {"source": "cal.txt", "sha256": "ab", "num_samples": 8, "seq_len": 32}}
    moved = {"calibration data": {"source": "../run/cal.txt", "sha256": "ab", "num_samples": 8, "seq_len": 32}}
    assert fingerprint_changes(saved, moved) == []
    other = {"calibration data": {**moved["calibration data"], "sha256": "cd"}}
    assert fingerprint_changes(saved, other) == [
        "calibration data (source 'cal.txt' -> '../run/cal.txt'; sha256 'ab' -> 'cd')"
    ]
    copied = {"model": {"directory": "/b/m", "files": {"model.safetensors": "ab"}}}  # a copy of the same files
    assert fingerprint_changes({"model": {"directory": "/a/m", "files": {"model.safetensors": "ab"}}}, copied) == []
    assert fingerprint_changes({"model": {"directory": "/a/m", "files": {"model.safetensors": "cd"}}}, copied) == [
        "model (directory '/a/m' -> '/b/m')"
    ]
    longer = {"calibration data": {**moved["calibration data"], "seq_len": 16}}
    assert fingerprint_changes(saved, longer) == [
        "calibration data (source 'cal.txt' -> '../run/cal.txt'; seq_len 32 -> 16)"
    ]


def test_the_report_text_says_a_run_continued_an_interrupted_one():
    from llmc_fsm.report.build import _execution_lines

    device = {"device": "cpu", "name": "x86_64", "total_memory_bytes": None}
    lines = _execution_lines({"device": device, "threads": 1, "resumed": {"threads": 2}})
    assert lines == ["device: cpu (x86_64)", "resumed: continued an interrupted run's saved progress (it used 2 torch "
                     "thread(s), this run 1)"]
    assert _execution_lines({"device": device, "threads": 2}) == ["device: cpu (x86_64)"]
