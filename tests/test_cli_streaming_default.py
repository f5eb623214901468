"""``llmc-fsm oneshot`` streams a job, data-free or calibrated, by default when the job allows it (``--in-memory`` to
load the whole model).

The command never uses the compressed model in memory, so it takes the ``low_memory`` path whenever the job allows it
and says so in one line (a calibrated job keeps its per-layer progress for ``--resume`` there too:
tests/test_resume.py); jobs that cannot stream run in memory as before; ``oneshot()`` keeps the in-memory path.
Each test runs the CLI on ``tiny_llama.build`` (4 decoder layers) saved to a temporary directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_llama
import torch
from safetensors import safe_open

import llmc_fsm
from llmc_fsm.cli import main
from llmc_fsm.oneshot_job.streaming import STREAMING_NOTE


@pytest.fixture(autouse=True)
def _keep_the_allocator(monkeypatch):
    """A streamed run fixes glibc's mmap threshold for the whole process; spare the rest of the test session."""
    monkeypatch.setattr("llmc_fsm.oneshot_job.streaming.limit_heap_growth", lambda: False)


@pytest.fixture(autouse=True)
def _own_perplexity_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMC_FSM_PERPLEXITY_CACHE", str(tmp_path / "ppl-cache"))


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    return out


def _run(argv: list[str], capsys) -> tuple[int, str]:
    status = main(argv)
    return status, capsys.readouterr().err


RTN = ["--method", "rtn", "--scheme", "W8A8"]


@pytest.mark.parametrize("scheme", ["W8A8", "W4A16"])
def test_the_cli_streams_a_data_free_job_by_default_and_writes_the_in_memory_tensors(tiny_model_dir, tmp_path,
                                                                                     capsys, scheme):
    model_dir, text = tiny_model_dir
    flags = ["--method", "rtn", "--scheme", scheme, *(["--group-size", "16"] if scheme == "W4A16" else [])]
    streamed, in_memory = tmp_path / "streamed", tmp_path / "in-memory"
    status, err = _run(tiny_llama.oneshot_argv(model_dir, text, streamed, "--num-samples", "8", *flags), capsys)
    assert status == 0
    assert STREAMING_NOTE not in err  # --no-progress: no line on stderr
    status, err = _run(tiny_llama.oneshot_argv(model_dir, text, in_memory, "--num-samples", "8", "--in-memory",
                                               *flags), capsys)
    assert status == 0
    assert (streamed / "model.safetensors.index.json").is_file()  # one shard per decoder layer + one for the rest
    assert len(list(streamed.glob("model-*-of-*.safetensors"))) == 4 + 1
    assert not (streamed / "model.safetensors").exists()
    assert [p.name for p in in_memory.glob("*.safetensors")] == ["model.safetensors"]
    a, b = _tensors(streamed), _tensors(in_memory)
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert json.loads((streamed / "config.json").read_text()) == json.loads((in_memory / "config.json").read_text())
    assert (streamed / "recipe.yaml").read_text() == (in_memory / "recipe.yaml").read_text()
    report_s, report_m = (json.loads((d / "report.json").read_text()) for d in (streamed, in_memory))
    assert report_s["sparsity"] == report_m["sparsity"] and report_s["calibration"] == report_m["calibration"]


@pytest.mark.parametrize("method", ["sparsegpt", "gptq"])
def test_a_calibrated_job_streams_by_default_and_in_memory_does_not(tiny_model_dir, tmp_path, capsys, monkeypatch,
                                                                     method):
    """Streamed by default, with glibc's own memory-map threshold (--low-memory fixes it: tests/test_streaming.py);
    --in-memory does not stream."""
    heap_fixed = []
    monkeypatch.setattr("llmc_fsm.oneshot_job.streaming.limit_heap_growth", lambda: heap_fixed.append(1) or False)
    model_dir, text = tiny_model_dir
    flags = ["--num-samples", "4", "--method", method, *(["--scheme", "W4A16", "--group-size", "16"] if method ==
                                                         "gptq" else [])]
    streamed, in_memory = tmp_path / "streamed", tmp_path / "in-memory"
    argv = tiny_llama.oneshot_argv(model_dir, text, streamed, *flags)
    argv.remove("--no-progress")
    status, err = _run(argv, capsys)
    assert status == 0
    assert err.count(STREAMING_NOTE + "\n") == 1
    assert sorted(p.name for p in streamed.glob("*.safetensors")) == [
        f"model-{k:05d}-of-00005.safetensors" for k in range(1, 6)
    ]
    assert heap_fixed == []
    argv = tiny_llama.oneshot_argv(model_dir, text, in_memory, *flags, "--in-memory")
    argv.remove("--no-progress")
    status, err = _run(argv, capsys)
    assert status == 0
    assert STREAMING_NOTE not in err
    assert [p.name for p in in_memory.glob("*.safetensors")] == ["model.safetensors"]
    assert heap_fixed == []
    a, b = _tensors(streamed), _tensors(in_memory)
    assert sorted(a) == sorted(b)
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


def test_the_cli_says_in_one_line_that_it_streams(tiny_model_dir, tmp_path, capsys):
    model_dir, text = tiny_model_dir
    argv = tiny_llama.oneshot_argv(model_dir, text, tmp_path / "o", "--num-samples", "4", *RTN)
    argv.remove("--no-progress")
    status, err = _run(argv, capsys)
    assert status == 0
    assert err.count(STREAMING_NOTE + "\n") == 1
    assert STREAMING_NOTE == (
        "llmc-fsm oneshot: streaming one decoder layer at a time (the default when the job allows it; --in-memory "
        "loads the whole model)"
    )


def test_a_job_that_cannot_stream_runs_in_memory_silently(tiny_model_dir, tmp_path, capsys, caplog):
    model_dir, text = tiny_model_dir
    out = tmp_path / "o"
    # magnitude pruning acts on the whole model at once: the streamed path refuses it, the CLI runs it in memory
    argv = tiny_llama.oneshot_argv(model_dir, text, out, "--num-samples", "4", "--method", "magnitude")
    argv.remove("--no-progress")
    with caplog.at_level("INFO", logger="llmc_fsm.oneshot_job.streaming"):
        status, err = _run(argv, capsys)
    assert status == 0
    assert STREAMING_NOTE not in err
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    assert any(r.getMessage().startswith("in memory: it compresses one decoder layer at a time, but "
                                         "MagnitudePruningModifier acts on the whole model") for r in caplog.records)


def test_a_kv_cache_job_runs_in_memory_by_default_and_saves_its_scales(tiny_model_dir, tmp_path, capsys, caplog):
    model_dir, text = tiny_model_dir
    out = tmp_path / "o"
    recipe = tmp_path / "kv.yaml"  # kv_cache_scheme alone: observed through the whole model's attention forward
    recipe.write_text(
        "q:\n  QuantizationModifier:\n    kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor, "
        "dynamic: false, symmetric: true}\n"
    )
    argv = tiny_llama.oneshot_argv(model_dir, text, out, "--num-samples", "4", "--recipe", str(recipe))
    argv.remove("--no-progress")
    with caplog.at_level("INFO", logger="llmc_fsm.oneshot_job.streaming"):
        status, err = _run(argv, capsys)
    assert status == 0, err
    assert STREAMING_NOTE not in err
    assert any(r.getMessage() == "in memory: QuantizationModifier: kv_cache_scheme observes the attention's keys and "
               "values in the whole model's forward; run without low_memory" for r in caplog.records)
    saved = _tensors(out)
    assert sorted(n for n in saved if n.endswith(("k_scale", "v_scale"))) == sorted(
        f"model.layers.{i}.self_attn.{k}" for i in range(4) for k in ("k_scale", "v_scale"))
    report = json.loads((out / "report.json").read_text())
    [(label, scales)] = report["kv_cache"].items()
    assert label == "QuantizationModifier (q)"
    assert scales == {f"model.layers.{i}.self_attn": {k: saved[f"model.layers.{i}.self_attn.{k}"].flatten().tolist()
                                                     for k in ("k_scale", "v_scale")} for i in range(4)}


def test_in_memory_and_low_memory_together_are_refused_before_any_work(tiny_model_dir, tmp_path, capsys):
    model_dir, text = tiny_model_dir
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as info:  # a usage error, as argparse's own
        main(tiny_llama.oneshot_argv(model_dir, text, out, "--in-memory", "--low-memory"))
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "llmc-fsm oneshot: error: --in-memory and --low-memory contradict each other: pass one of them (or neither: "
        "stream when possible); see 'llmc-fsm oneshot --help'\n"
    )
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_dense_perplexity_is_reused_by_the_streamed_default(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Second identical run: the streamed perplexity before is read from the cache (not measured), said in the table
    and report.json, and equals the first run's; the perplexity after is measured again and is the same."""
    import llmc_fsm.oneshot_job.streaming as streaming

    model_dir, text = tiny_model_dir
    measured = []
    real = streaming.streamed_states
    monkeypatch.setattr(streaming, "streamed_states", lambda *a, **k: measured.append(1) or real(*a, **k))
    extra = ["--num-samples", "4", "--eval-text", str(text), "--eval-windows", "3", *RTN]
    assert main(tiny_llama.oneshot_argv(model_dir, text, tmp_path / "a", *extra)) == 0
    first_table = capsys.readouterr().out
    assert len(measured) == 1 and "(before: reused" not in first_table
    assert main(tiny_llama.oneshot_argv(model_dir, text, tmp_path / "b", *extra)) == 0
    second_table = capsys.readouterr().out
    assert len(measured) == 1  # the dense pass was not run again
    first, second = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("a", "b"))
    assert second["perplexity"] == first["perplexity"]
    assert second["eval"]["before"].startswith("reused: measured ") and "before" not in first["eval"]
    assert "(before: reused: measured " in second_table
    # the in-memory path measures the same value bit for bit (batch 1), and reuses the streamed one too
    assert main(tiny_llama.oneshot_argv(model_dir, text, tmp_path / "c", *extra, "--in-memory")) == 0
    third = json.loads((tmp_path / "c" / "report.json").read_text())
    assert third["perplexity"] == first["perplexity"]
    assert third["eval"]["before"].startswith("reused: measured ")


def test_the_python_api_keeps_the_in_memory_path(tiny_model_dir, tmp_path):
    model_dir, text = tiny_model_dir
    model = llmc_fsm.oneshot(str(model_dir), dataset=str(text), num_calibration_samples=4, max_seq_length=32,
                             output_dir=tmp_path / "o", progress=False)
    assert not any(p.is_meta for p in model.parameters())
    assert [p.name for p in (tmp_path / "o").glob("*.safetensors")] == ["model.safetensors"]


def test_the_streamed_output_keeps_the_generation_config_and_the_stored_dtype(tiny_model_dir, tmp_path, capsys):
    """Found by a tester on the streamed path (the command's default): the source's generation_config.json was
    replaced by one derived from config.json (sampling settings and a second EOS id lost), and a bf16 checkpoint whose
    config names no dtype was written float32 under --dtype auto. Both paths now write the same files' contents."""
    import shutil

    model_dir, text = tiny_model_dir
    source = tmp_path / "source"
    shutil.copytree(model_dir, source)
    from transformers import AutoModelForCausalLM

    bf16 = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    bf16.save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (source / "config.json").write_text(json.dumps(config))
    generation = {"bos_token_id": 1, "eos_token_id": [2, 9], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (source / "generation_config.json").write_text(json.dumps(generation))
    outputs = {}
    for name, extra in (("streamed", []), ("in-memory", ["--in-memory"])):
        out = tmp_path / name
        status, _ = _run(tiny_llama.oneshot_argv(source, text, out, *RTN, "--dtype", "auto", *extra), capsys)
        assert status == 0
        outputs[name] = out
    kept = json.loads((outputs["streamed"] / "generation_config.json").read_text())
    assert {k: kept[k] for k in generation} == generation
    assert (outputs["streamed"] / "generation_config.json").read_text() == (
        outputs["in-memory"] / "generation_config.json"
    ).read_text()
    dtypes = [json.loads((outputs[n] / "config.json").read_text())["dtype"] for n in ("streamed", "in-memory")]
    assert dtypes == ["bfloat16", "bfloat16"]
    streamed, in_memory = _tensors(outputs["streamed"]), _tensors(outputs["in-memory"])
    assert sorted(streamed) == sorted(in_memory)
    assert all(torch.equal(streamed[k], in_memory[k]) for k in streamed)
    assert streamed["model.embed_tokens.weight"].dtype == torch.bfloat16
    # a stray file the checkpoint does not name (Mistral's consolidated.safetensors sorts first) is not asked
    from safetensors.torch import save_file

    from llmc_fsm.oneshot_job.streaming import _dtype

    save_file({"x": torch.zeros(2, dtype=torch.float32)}, str(source / "consolidated.safetensors"))
    assert _dtype("auto", source) == torch.bfloat16


def test_an_unreadable_generation_config_is_left_for_the_derived_one_as_in_memory(tiny_model_dir, tmp_path, capsys):
    """from_pretrained passes over a generation_config.json it cannot read; the streamed path refused the model
    ("... is not a valid JSON file": a tester's case). Both paths now run and write one derived from config.json."""
    import shutil

    model_dir, text = tiny_model_dir
    source = tmp_path / "source"
    shutil.copytree(model_dir, source)
    (source / "generation_config.json").write_text('{"eos_token_id": [2,')  # truncated
    written = []
    for name, extra in (("streamed", []), ("in-memory", ["--in-memory"])):
        out = tmp_path / name
        status, _ = _run(tiny_llama.oneshot_argv(source, text, out, *RTN, *extra), capsys)
        assert status == 0
        written.append(json.loads((out / "generation_config.json").read_text()))
    config = json.loads((source / "config.json").read_text())
    assert [w["eos_token_id"] for w in written] == [config["eos_token_id"]] * 2


def test_a_data_free_job_quantizing_modules_outside_the_layers_runs_in_memory_by_default(tmp_path, capsys):
    """B1's case (session 30): Gemma 3n's per-layer projections lie outside the decoder layers; a data-free FP8 job
    on the default (streamed) path was refused mid-way, advising to ignore them, while in memory it quantizes them
    (at calibration end) and reloads. The default now runs such a job in memory; --low-memory refuses it in one line
    before any work."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from tiny_families import _TEXT

    mixed = ["sliding_attention", "full_attention"] * 2
    config = AutoConfig.for_model(
        "gemma3n_text", **{**_TEXT, "intermediate_size": [128] * 4}, layer_types=mixed, sliding_window=8,
        altup_num_inputs=2, laurel_rank=8, hidden_size_per_layer_input=8, num_kv_shared_layers=0,
        activation_sparsity_pattern=[0.0] * 4, vocab_size_per_layer_input=128,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gemma3n")
    args = ["oneshot", "--model", str(tmp_path / "gemma3n"), "--method", "rtn", "--scheme", "FP8_DYNAMIC"]
    assert main([*args, "--output", str(tmp_path / "out")]) == 0
    assert STREAMING_NOTE not in capsys.readouterr().err
    tensors = _tensors(tmp_path / "out")
    assert tensors["model.per_layer_model_projection.weight"].dtype == torch.float8_e4m3fn
    assert "model.altup_projections.0.weight_scale" in tensors
    assert main([*args, "--low-memory", "--output", str(tmp_path / "low")]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "llmc-fsm oneshot: error: low_memory (--low-memory) cannot run this job: QuantizationModifier compresses "
        "model.per_layer_model_projection, model.altup_projections.0, model.altup_unembed_projections.0 outside the "
        "decoder layers, and the streamed path writes the tensors outside the decoder layers first"
    )
    assert not (tmp_path / "low").exists()
    # explain --model said "oneshot's checks pass" for a calibrated recipe that oneshot refuses on these modules
    recipe = tmp_path / "sparsegpt.yaml"
    recipe.write_text("s:\n  SparseGPTModifier: {sparsity: 0.5, ignore: [lm_head]}\n")
    assert main(["explain", str(recipe), "--model", str(tmp_path / "gemma3n")]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"llmc-fsm explain: error: oneshot would refuse this recipe on --model {tmp_path / 'gemma3n'}: SparseGPTModifier "
        "targets model.per_layer_model_projection, model.altup_projections.0, model.altup_unembed_projections.0, "
        "outside the decoder layers (model.layers); the sequential pipeline calibrates only the decoder layers and "
        "the output head. Add them to the modifier's ignore list."
    )
    recipe.write_text("s:\n  QuantizationModifier: {scheme: FP8_DYNAMIC, ignore: [lm_head]}\n")  # data-free: runs
    assert main(["explain", str(recipe), "--model", str(tmp_path / "gemma3n")]) == 0
