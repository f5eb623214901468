"""``llmc-fsm oneshot`` refuses before any work, and a refused call leaves the disk as it was.

* an already quantized checkpoint (a ``quantization_config``, or an older ``compression_config``, in its
  ``config.json``) is refused from that config, before any weight is read, with the one-line message the check on
  a loaded model gives (the modifier's own wording and hint);
* a call that fails a check (a recipe argument, the dataset, a quantized model) creates nothing: no output, no
  work directory beside it, not even for a moment (the parent directory's modification time is unchanged).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import tiny_llama
import torch

pytest.importorskip("transformers")
pytest.importorskip("llmc_fsm_pruning")
pytest.importorskip("llmc_fsm_quantization")

import llmc_fsm
from llmc_fsm.cli import main


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> tuple[Path, Path, Path]:
    """``(float model directory, calibration text, its GPTQ W4A16 output)`` of a tiny 4-layer Llama."""
    root = tmp_path_factory.mktemp("quantized")
    model, text = tiny_llama.build_with_text(root)
    out = root / "w4a16"
    assert main(tiny_llama.oneshot_argv(model, text, out, "--method", "gptq", "--group-size", "64")) == 0
    return model, text, out


def _refuse_loading(monkeypatch) -> None:
    """From here on, every way the job reads a model's weights fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model's weights were read before the refusal")

    monkeypatch.setattr("llmc_fsm.oneshot_job.phases.load_model", refuse)  # the in-memory path
    monkeypatch.setattr("llmc_fsm.oneshot_job.streaming.load_lazy", refuse)  # the CLI's default streamed path
    monkeypatch.setattr("transformers.PreTrainedModel.from_pretrained", refuse)


def _already_quantized(owner: str, hint: str, why: str = "quantization_config (quant_method 'compressed-tensors')"):
    return f"{owner}: the model is already quantized (its config carries a {why}); {hint}"


QUANTIZE_HINT = "quantize the original full-precision model instead"
PRUNE_HINT = (
    "compress the original full-precision model: prune first, then quantize (a sparsity stage before the "
    "quantization stage in one recipe)"
)
MAGNITUDE_HINT = "compress the original full-precision model instead"

#: --method, the recipe it stands for (for the Python API), and the message it gets on a quantized checkpoint.
METHODS = [
    ("gptq", {"s": {"GPTQModifier": {"scheme": "W4A16"}}}, _already_quantized("GPTQModifier", QUANTIZE_HINT)),
    ("rtn", {"s": {"QuantizationModifier": {"scheme": "W4A16"}}},
     _already_quantized("QuantizationModifier", QUANTIZE_HINT)),
    ("sparsegpt", {"s": {"SparseGPTModifier": {"sparsity": 0.5}}}, _already_quantized("SparseGPTModifier", PRUNE_HINT)),
    ("wanda", {"s": {"WandaPruningModifier": {"sparsity": 0.5}}},
     _already_quantized("WandaPruningModifier", PRUNE_HINT)),
    ("magnitude", {"s": {"MagnitudePruningModifier": {"sparsity": 0.5}}},
     _already_quantized("MagnitudePruningModifier", MAGNITUDE_HINT)),
]


def _snapshot(directory: Path) -> dict[str, tuple[bool, int]]:
    """Every path under ``directory`` (relative) -> (is a directory, size in bytes)."""
    return {
        os.fspath(p.relative_to(directory)): (p.is_dir(), 0 if p.is_dir() else p.stat().st_size)
        for p in directory.rglob("*")
    }


@pytest.mark.parametrize(("method", "recipe", "message"), METHODS, ids=[m[0] for m in METHODS])
def test_a_quantized_checkpoint_is_refused_from_its_config_before_any_weight_is_read(
    quantized, tmp_path, capsys, monkeypatch, method, recipe, message
) -> None:
    _, text, out = quantized
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    # the check on a loaded model (an nn.Module whose config carries the same quantization_config) says the same
    model = tiny_llama.llama(vocab=96, hidden=32, heads=2, kv_heads=1)
    model.config.quantization_config = config
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=torch.randint(0, 96, (4, 16)), progress=False)
    assert str(info.value) == message

    _refuse_loading(monkeypatch)
    parent = tmp_path / "runs"
    parent.mkdir()
    os.utime(parent, ns=(10**18, 10**18))  # any entry created (and removed) there would change it
    # no --no-progress: the line is all the command prints, no device line, no progress bar
    argv = ["oneshot", "--model", str(out), "--dataset", str(text), "--seq-len", "32", "--method", method]
    assert main([*argv, "--output", str(parent / "again")]) == 1
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"llmc-fsm oneshot: error: {message}\n")
    assert _snapshot(parent) == {} and parent.stat().st_mtime_ns == 10**18
    # the Python API refuses the same way, from the same config
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(out), recipe=recipe, dataset=text, max_seq_length=32, output_dir=parent / "py")
    assert str(info.value) == message
    assert _snapshot(parent) == {} and parent.stat().st_mtime_ns == 10**18


def test_a_modifier_that_only_keeps_zeros_is_refused_a_quantized_checkpoint_too(quantized, tmp_path, capsys,
                                                                                  monkeypatch) -> None:
    # ConstantPruningModifier makes no zeros (so it may follow a quantizing modifier of the same recipe), but a
    # packed checkpoint holds no weights to keep: it used to fail after loading, blaming ignore ['lm_head']
    _, text, out = quantized
    _refuse_loading(monkeypatch)
    recipe = tmp_path / "hold.yaml"
    recipe.write_text("stage:\n  pruning_modifiers:\n    ConstantPruningModifier: {}\n")
    argv = ["oneshot", "--model", str(out), "--dataset", str(text), "--seq-len", "32", "--recipe", str(recipe)]
    assert main([*argv, "--output", str(tmp_path / "out"), "--no-progress"]) == 1
    message = _already_quantized("ConstantPruningModifier", MAGNITUDE_HINT)
    assert capsys.readouterr().err == f"llmc-fsm oneshot: error: {message}\n"
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.work").exists()


def _float_dir_with(config_extra: dict, source: Path, target: Path) -> Path:
    """A copy of the float model directory ``source`` whose config.json also holds ``config_extra``."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **config_extra}))
    return target


KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@pytest.mark.parametrize(
    ("extra", "method", "message"),
    [
        (
            {"compression_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"}},
            "gptq",
            _already_quantized("GPTQModifier", QUANTIZE_HINT, "compression_config (quant_method 'compressed-tensors')"),
        ),
        (  # a bitmask-compressed sparse checkpoint (transformers 5 does not read a compression_config at all)
            {"compression_config": {"sparsity_config": {"format": "sparse-bitmask"}}},
            "sparsegpt",
            _already_quantized("SparseGPTModifier", PRUNE_HINT, "compression_config"),
        ),
        (
            {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {},
                                     "kv_cache_scheme": KV_SCHEME}},
            "magnitude",
            _already_quantized(
                "MagnitudePruningModifier",
                MAGNITUDE_HINT,
                "quantization_config (quant_method 'compressed-tensors') with a kv_cache_scheme and no weight scheme: "
                "its KV-cache scales, which transformers does not load, would be lost; put the kv_cache_scheme in the "
                "recipe that compresses the full-precision model",
            ),
        ),
    ],
    ids=["compression_config", "compression_config-no-method", "kv-cache-only"],
)
def test_every_quantized_config_key_is_refused_before_loading(
    quantized, tmp_path, capsys, monkeypatch, extra, method, message
) -> None:
    model, text, _ = quantized
    directory = _float_dir_with(extra, model, tmp_path / "model")  # float weights: only the config says otherwise
    _refuse_loading(monkeypatch)
    argv = ["oneshot", "--model", str(directory), "--dataset", str(text), "--seq-len", "32", "--method", method]
    assert main([*argv, "--output", str(tmp_path / "out"), "--no-progress"]) == 1
    assert capsys.readouterr().err == f"llmc-fsm oneshot: error: {message}\n"
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.work").exists()


def test_the_in_memory_check_reads_a_compression_config_too() -> None:
    model = tiny_llama.llama(vocab=96, hidden=32, heads=2, kv_heads=1)
    model.config.compression_config = {"quant_method": "compressed-tensors"}
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, recipe=METHODS[0][1], dataset=torch.randint(0, 96, (4, 16)), progress=False)
    assert str(info.value) == _already_quantized(
        "GPTQModifier", QUANTIZE_HINT, "compression_config (quant_method 'compressed-tensors')"
    )


def test_a_config_the_model_classes_cannot_build_is_checked_after_loading(quantized, tmp_path, monkeypatch) -> None:
    # the early check steps aside (the loaded model's check refuses it, as before) instead of failing on its own
    _, text, out = quantized

    def cannot_build(config):
        raise ValueError("Unrecognized configuration class")

    class Loaded(Exception):
        pass

    def load_model(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr("llmc_fsm.models.hf_io.model_class", cannot_build)
    monkeypatch.setattr("llmc_fsm.oneshot_job.phases.load_model", load_model)
    with pytest.raises(Loaded):
        llmc_fsm.oneshot(model=str(out), recipe=METHODS[0][1], dataset=text, max_seq_length=32, progress=False)


# --------------------------------------------------------------------------- a refused call leaves the disk as it was
def _bad_recipe(root: Path) -> list[str]:
    path = root / "bad.yaml"
    path.write_text("s:\n  SparseGPTModifier:\n    sparsity: 0.5\n    bogus_arg: 3\n")
    return ["--recipe", str(path)]


def _empty_dataset(root: Path) -> list[str]:
    (root / "empty.txt").write_text("\n")
    return ["--dataset", str(root / "empty.txt")]


@pytest.mark.parametrize(
    ("case", "args", "message"),
    [
        (
            "recipe",
            _bad_recipe,
            "recipe {root}/bad.yaml, line 4, stage 's', modifier SparseGPTModifier: unknown argument 'bogus_arg'. "
            "SparseGPTModifier accepts: start, end, update, targets, ignore, sparsity, mask_structure, "
            "calibrate_all_experts, block_size, dampening_frac, preserve_sparsity_mask",
        ),
        (
            "dataset",
            _empty_dataset,
            "dataset (--dataset): {root}/empty.txt holds no text; pass a file with text in it (e.g. wikitext-2's "
            "wiki.test.raw)",
        ),
        ("quantized", lambda root: ["--method", "gptq"], _already_quantized("GPTQModifier", QUANTIZE_HINT)),
    ],
    ids=["recipe", "dataset", "quantized"],
)
@pytest.mark.parametrize("output", ["out", "a/b/out"], ids=["output", "missing-parents"])
def test_a_refused_call_creates_nothing_not_even_for_a_moment(
    quantized, tmp_path, capsys, case, args, message, output
) -> None:
    model, text, out = quantized
    root = tmp_path / "inputs"
    root.mkdir()
    extra = args(root)
    parent = tmp_path / "runs"
    parent.mkdir()
    (parent / "kept.txt").write_text("a file that was there before\n")
    os.utime(parent, ns=(10**18, 10**18))  # creating and removing a work directory there would change it
    before = _snapshot(parent)
    source = out if case == "quantized" else model
    argv = ["oneshot", "--model", str(source), "--seq-len", "32", "--no-progress", "--output", str(parent / output)]
    argv += extra if "--dataset" in extra else ["--dataset", str(text), *extra]
    assert main(argv) == 1
    assert capsys.readouterr().err == f"llmc-fsm oneshot: error: {message.format(root=root)}\n"
    assert _snapshot(parent) == before
    assert parent.stat().st_mtime_ns == 10**18


def test_a_group_size_no_target_width_allows_is_refused_before_any_weight_is_read(
    quantized, tmp_path, capsys, monkeypatch
) -> None:
    """A staged recipe (prune, then GPTQ W4A16 with the preset's group size 128; the tiny model's widths are 32,
    64...) runs in memory, not streamed: its group-size refusal still comes from the ``meta``-device model built from
    the config, before any weight is read, with the message the loaded model gets."""
    from transformers import AutoModelForCausalLM

    model_dir, text, _ = quantized
    recipe = {
        "prune_stage": {"SparseGPTModifier": {"sparsity": 0.5, "ignore": ["lm_head"]}},
        "quant_stage": {"GPTQModifier": {"ignore": ["lm_head"], "scheme": "W4A16"}},
    }
    with pytest.raises(ValueError) as loaded:  # the check on the loaded model
        llmc_fsm.oneshot(model=AutoModelForCausalLM.from_pretrained(model_dir), recipe=recipe,
                         dataset=torch.randint(0, 96, (4, 32)), progress=False)
    assert str(loaded.value).startswith("GPTQModifier cannot compress ")
    assert "is not a multiple of group_size 128" in str(loaded.value)
    capsys.readouterr()  # from_pretrained's progress bar
    _refuse_loading(monkeypatch)
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    argv = ["oneshot", "--model", str(model_dir), "--dataset", str(text), "--seq-len", "32"]
    assert main([*argv, "--recipe", str(tmp_path / "recipe.json"), "--output", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"llmc-fsm oneshot: error: {loaded.value}\n")
    assert not (tmp_path / "out").exists()


def test_explain_with_a_model_reports_the_refusal_oneshot_would_give(quantized, tmp_path, capsys, monkeypatch) -> None:
    """``explain RECIPE --model DIR`` prints the plan, then runs the checks oneshot runs on the same ``meta``-device
    model: a group size that divides no target's width is an error (exit 1) with oneshot's message; a recipe that
    fits exits 0. No weight is read."""
    model_dir, _, _ = quantized
    _refuse_loading(monkeypatch)
    bad = tmp_path / "g128.json"
    bad.write_text(json.dumps({"quant_stage": {"GPTQModifier": {"ignore": ["lm_head"], "scheme": "W4A16"}}}))
    assert main(["explain", str(bad), "--model", str(model_dir)]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith(f"Recipe {bad}: 1 stage(s), 1 modifier(s) to run\n")
    assert "Session lifecycle: staging; state present: model\n" in captured.out
    assert captured.out.endswith("Not ready: a modifier refuses the model (below).\n")
    assert "Ready to initialize" not in captured.out
    assert captured.err.startswith(
        f"llmc-fsm explain: error: oneshot would refuse this recipe on --model {model_dir}: GPTQModifier cannot "
        "compress 24 of its 28 targets — in_features 64 is not a multiple of group_size 128: "
    )
    assert captured.err.count("\n") == 1
    good = tmp_path / "g32.json"
    scheme = {"preset": "W4A16", "weights": {"group_size": 32}}
    good.write_text(json.dumps({"quant_stage": {"GPTQModifier": {"ignore": ["lm_head"], "scheme": scheme}}}))
    assert main(["explain", str(good), "--model", str(model_dir)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.endswith(
        f"(Expected here: `llmc-fsm oneshot` gives calibration_data; oneshot's checks of --model {model_dir} pass.)\n"
    )
    # a run_type: train stage (one-shot skips it) needing steps_per_epoch made explain skip every check: the later
    # stage's refusal went unsaid (a README-only newcomer's case, llm-compressor's 2:4 recipe of docs/recipes.md)
    trained = tmp_path / "trained.yaml"
    trained.write_text("ft:\n  run_type: train\n  modifiers: {ConstantPruningModifier: {start: 0}}\n"
                       "s2:\n  GPTQModifier: {ignore: [lm_head], scheme: W4A16}\n")  # fmt: skip
    assert main(["explain", str(trained), "--model", str(model_dir)]) == 1
    assert capsys.readouterr().err.startswith(
        f"llmc-fsm explain: error: oneshot would refuse this recipe on --model {model_dir}: GPTQModifier cannot "
        "compress 24 of its 28 targets"
    )


def test_the_check_before_loading_builds_the_model_in_the_dtype_given(quantized, tmp_path, capsys, monkeypatch) -> None:
    """NVFP4A16 needs the model loaded in bfloat16 (its checkpoint decompresses to bfloat16). On a float32 directory
    with ``--dtype bfloat16`` the ``meta``-device model of the check is built in bfloat16, as the load then takes it,
    and the job runs; without ``--dtype`` oneshot refuses before any weight is read, and ``explain --model`` says
    the same unless given the same ``--dtype``."""
    model_dir, _, _ = quantized
    recipe = tmp_path / "nvfp4a16.yaml"
    recipe.write_text("quant_stage:\n  QuantizationModifier: {targets: [Linear], scheme: NVFP4A16, ignore: [lm_head]}\n")
    argv = ["oneshot", "--model", str(model_dir), "--recipe", str(recipe), "--no-progress"]
    assert main([*argv, "--dtype", "bfloat16", "--output", str(tmp_path / "bf16")]) == 0
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["format"] == "nvfp4-pack-quantized"
    capsys.readouterr()
    with monkeypatch.context() as patched:
        _refuse_loading(patched)
        assert main([*argv, "--output", str(tmp_path / "fp32")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("llmc-fsm oneshot: error: QuantizationModifier cannot compress 28 of its 28 targets — "
                              "torch.float32 weight: NVFP4 / MX checkpoints decompress to bfloat16 on load")
        assert "load the model in bfloat16 (CLI: --dtype bfloat16; oneshot(MODEL_DIR, dtype='bfloat16')" in err
        assert not (tmp_path / "fp32").exists()
        assert main(["explain", str(recipe), "--model", str(model_dir)]) == 1
        assert capsys.readouterr().err.startswith(
            f"llmc-fsm explain: error: oneshot would refuse this recipe on --model {model_dir}: QuantizationModifier "
            "cannot compress 28 of its 28 targets — torch.float32 weight: ")
        assert main(["explain", str(recipe), "--model", str(model_dir), "--dtype", "bfloat16"]) == 0
        assert capsys.readouterr().err == ""


def test_a_sequence_longer_than_the_model_takes_is_refused_before_any_weight_is_read(
    quantized, tmp_path, capsys, monkeypatch
) -> None:
    """``--seq-len`` above ``max_position_embeddings``: the one line of the error, from the config's ``meta`` model
    (it used to come after the device and streaming lines, once the model was indexed)."""
    model_dir, text, _ = quantized
    limit = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    _refuse_loading(monkeypatch)
    argv = ["oneshot", "--model", str(model_dir), "--dataset", str(text), "--seq-len", str(limit + 1)]
    assert main([*argv, "--output", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    message = (
        f"sequence length {limit + 1} (--seq-len / eval) is above the model's max_position_embeddings ({limit}); "
        f"use at most {limit}"
    )
    assert (captured.out, captured.err) == ("", f"llmc-fsm oneshot: error: {message}\n")
    assert not (tmp_path / "out").exists()
