"""One frozen settings object for ``llmc_fsm.oneshot`` and ``llmc-fsm oneshot`` (issue 21, item 3), and every value
that can be checked without the model checked before the model is loaded (issue 27).

The model loaders are patched to fail the test (:func:`no_model_load`), so a check that ran after loading would
show up as that failure instead of the expected error.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import shutil
from pathlib import Path

import attrs
import pytest
import tiny_llama
import torch

pytest.importorskip("transformers")

import llmc_fsm
from llmc_fsm.cli import main
from llmc_fsm.cli.main import build_parser
from llmc_fsm.core.errors import RecipeError
from llmc_fsm.core.registry import get_registry
from llmc_fsm.oneshot_job import api, phases
from llmc_fsm.oneshot_job.resume import fingerprint
from llmc_fsm.oneshot_job.settings import (
    GENERATED,
    OneshotSettings,
    RecipeFlags,
    default_recipe,
    generated_recipe,
    settings_from_flags,
)
from llmc_fsm.recipes.building import resolve_recipe

RECIPE = {"s": {"MagnitudePruningModifier": {"sparsity": 0.5, "ignore": ["lm_head"]}}}
CALIBRATED = {"s": {"WandaPruningModifier": {"sparsity": 0.5, "ignore": ["lm_head"]}}}
#: The pruning modifiers' own refusals (llmc_fsm_pruning.masks), after the recipe's "stage ..., modifier ..., ".
SPARSITY = "argument 'sparsity': sparsity must be a number in [0, 1) (fraction of weights set to zero), got 1.0"
MASK = (
    "argument 'mask_structure': invalid mask_structure '3:2': expected 'unstructured' (alias '0:0') or 'N:M' with "
    "integers 0 < N < M, meaning N nonzero weights are kept in every group of M consecutive weights along the input "
    "dimension (e.g. '2:4' = 50% sparsity)"
)


@pytest.fixture
def no_model_load(monkeypatch):
    """Every way a one-shot run loads a model fails the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the model loader was called")

    for target in (
        "llmc_fsm.models.known.load_model",
        "llmc_fsm.oneshot_job.phases.load_model",
        "llmc_fsm.oneshot_job.phases.load",
        "llmc_fsm.oneshot_job.streaming.load_lazy",
    ):
        monkeypatch.setattr(target, forbidden)


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _cli_settings(*argv: str) -> OneshotSettings:
    return settings_from_flags(build_parser().parse_args(["oneshot", *argv]))


# --------------------------------------------------------------------------- one object, written once
def test_oneshot_takes_exactly_the_settings_fields_with_their_defaults():
    parameters = inspect.signature(llmc_fsm.oneshot).parameters.values()
    *named, rest = parameters  # then llm-compressor's names, each taken or refused (test_llmcompressor_args.py)
    assert (rest.name, rest.kind) == ("llmcompressor_args", inspect.Parameter.VAR_KEYWORD)
    assert [(p.name, p.default) for p in named] == [(f.name, f.default) for f in attrs.fields(OneshotSettings)]


def test_settings_are_frozen():
    settings = OneshotSettings()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        settings.batch_size = 4  # type: ignore[misc]


def test_the_cli_and_the_api_build_equal_settings(tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("s:\n  MagnitudePruningModifier:\n    sparsity: 0.5\n")
    argv = [
        "--model", "some/model", "--recipe", str(recipe), "--dataset", "cal.txt", "--num-samples", "4",
        "--seq-len", "16", "--eval-text", "eval.txt", "--eval-windows", "3", "--batch-size", "2",
        "--output", str(tmp_path / "o"), "--overwrite", "--resume", "--fuse-stages", "--dtype", "bf16",
        "--threads", "1", "--no-progress",
    ]  # fmt: skip
    api_kw = {
        "model": "some/model",
        "recipe": str(recipe),
        "dataset": "cal.txt",
        "num_calibration_samples": 4,
        "max_seq_length": 16,
        "eval_text": "eval.txt",
        "num_eval_windows": 3,
        "batch_size": 2,
        "output_dir": str(tmp_path / "o"),
        "overwrite": True,
        "resume": True,
        "fuse_stages": True,
        "dtype": torch.bfloat16,
        "threads": 1,
        "progress": False,
    }
    built = []
    monkeypatch.setattr(api, "run_oneshot", built.append)  # what oneshot() hands on: its settings
    llmc_fsm.oneshot(**api_kw)
    assert built == [_cli_settings(*argv)] == [OneshotSettings(**api_kw)]
    assert built[0].dtype == "bfloat16"  # torch.bfloat16 and bf16 are both spelled as docs/oneshot.md does
    assert _cli_settings("--low-memory").low_memory is True
    # no flag: the same defaults; the CLI builds the generated recipe the API builds in prepare
    cli = _cli_settings()
    assert attrs.evolve(cli, recipe=None) == OneshotSettings()
    assert (cli.recipe.source, cli.recipe.to_dict()) == (GENERATED, generated_recipe().to_dict())


def test_recipe_flags_build_the_generated_recipe():
    flags = RecipeFlags(method="gptq", scheme="W8A16", group_size=32, block_size=32, observer="mse")
    (modifier,) = flags.recipe().modifiers
    assert (type(modifier).__name__, modifier.block_size, modifier.observer) == ("GPTQModifier", 32, "mse")
    assert _cli_settings("--method", "gptq", "--scheme", "W8A16", "--group-size", "32", "--block-size", "32",
                         "--observer", "mse").recipe.to_dict() == flags.recipe().to_dict()  # fmt: skip
    # an N:M mask without --sparsity records the sparsity it gives: (M - N) / M
    for mask, sparsity in (("2:4", 0.5), ("1:4", 0.75)):
        (modifier,) = RecipeFlags(mask_structure=mask).recipe().modifiers
        assert (modifier.mask_structure, modifier.sparsity) == (mask, sparsity)
    (modifier,) = RecipeFlags(mask_structure="2:4", sparsity=0.5).recipe().modifiers  # the same value: accepted
    assert modifier.sparsity == 0.5


def test_threads_hold_for_the_call_only(monkeypatch):
    seen = []
    compress = phases.compress
    monkeypatch.setattr(phases, "compress", lambda run: seen.append(torch.get_num_threads()) or compress(run))
    before = torch.get_num_threads()
    wanted = 2 if before != 2 else 1
    model = tiny_llama.llama(vocab=64, hidden=16, heads=2, kv_heads=1)
    llmc_fsm.oneshot(model, recipe=RECIPE, dataset=torch.randint(0, 64, (2, 8)), threads=wanted, progress=False)
    assert (seen, torch.get_num_threads()) == ([wanted], before)


# --------------------------------------------------------------------------- bad values, before the model
def _bad_cases(model: Path, tmp: Path) -> list[tuple[dict, list[str], type, str]]:
    """``(oneshot() arguments, llmc-fsm oneshot flags, exception, message)`` of values refused before loading."""
    a_file = tmp / "a_file"
    a_file.write_text("x")
    missing = tmp / "missing.txt"
    return [
        ({"num_calibration_samples": 0}, ["--num-samples", "0"], ValueError,
         "num_calibration_samples (--num-samples) must be a positive int, got 0"),
        ({"batch_size": 0}, ["--batch-size", "0"], ValueError,
         "batch_size (--batch-size) must be a positive int, got 0"),
        ({"max_seq_length": -4}, ["--seq-len", "-4"], ValueError,
         "max_seq_length (--seq-len) must be a positive int, got -4"),
        ({"num_eval_windows": 0}, ["--eval-windows", "0"], ValueError,
         "num_eval_windows (--eval-windows) must be a positive int, got 0"),
        ({"threads": 0}, ["--threads", "0"], ValueError, "threads (--threads) must be a positive int, got 0"),
        ({"dtype": "int8"}, ["--dtype", "int8"], ValueError,
         "dtype (--dtype) must be one of float32, bfloat16, float16, auto, got 'int8'"),
        ({"device": "gpu"}, ["--device", "gpu"], ValueError,
         "device (--device) must be one of auto, cpu, cuda or cuda:N (N a CUDA device index), got 'gpu'"),
        ({"activation_budget_mib": -1.0}, ["--activation-budget-mib", "-1"], ValueError,
         "activation_budget_mib (--activation-budget-mib) must be a number of MiB >= 0, or None for half the "
         "device's free memory, got -1.0"),
        ({"resume": True}, ["--resume"], ValueError,
         "resume (--resume) needs output_dir (--output): the progress to resume is kept next to the output"),
        ({"output_dir": str(model)}, ["--output", str(model)], ValueError, _source_message(model)),
        ({"dataset": str(missing)}, ["--dataset", str(missing)], FileNotFoundError,
         f"dataset (--dataset): text file not found: {missing}"),
        ({"eval_text": str(missing)}, ["--eval-text", str(missing)], FileNotFoundError,
         f"eval_text (--eval-text): text file not found: {missing}"),
        ({"output_dir": str(a_file / "sub")}, ["--output", str(a_file / "sub")], NotADirectoryError,
         f"cannot create the output directory {str(a_file / 'sub')!r}: {str(a_file)!r} is a file, not a directory"),
    ]  # fmt: skip


def _source_message(model: Path) -> str:
    return (
        f"output directory {str(model.resolve())!r} is the directory the model is read from "
        f"({str(model.resolve())!r}), and the output replaces the whole directory: choose a new directory (e.g. "
        f"{str(model.resolve()) + '-compressed'!r})"
    )


def test_bad_values_are_refused_by_the_api_and_the_cli_before_the_model_loads(
    tiny_model_dir, tmp_path, capsys, no_model_load
):
    model, text = tiny_model_dir
    work = tmp_path / "w"
    work.mkdir()
    cases = _bad_cases(model, work)
    before, model_files = _listing(tmp_path), _listing(model)
    for kw, flags, error, message in cases:
        with pytest.raises(error) as info:
            llmc_fsm.oneshot(str(model), recipe=RECIPE, **{"dataset": str(text), "progress": False, **kw})
        assert (type(info.value), str(info.value)) == (error, message)
        flags = ["--dataset", str(text), *flags] if "--dataset" not in flags else flags
        assert main(["oneshot", "--model", str(model), "--no-progress", *flags]) == 1
        assert capsys.readouterr().err == f"llmc-fsm oneshot: error: {message}\n"
        assert (_listing(tmp_path), _listing(model)) == (before, model_files)  # nothing written, nothing left


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sparsity", "1.0"], f"recipe {GENERATED}, stage 'sparsity_stage', modifier SparseGPTModifier, {SPARSITY}"),
        (
            ["--mask-structure", "3:2"],
            f"recipe {GENERATED}, stage 'sparsity_stage', modifier SparseGPTModifier, {MASK}",
        ),
        (
            ["--mask-structure", "2:4", "--sparsity", "0.7"],
            "--sparsity 0.7 contradicts --mask-structure 2:4: N:M keeps N of every M weights, which fixes the "
            "sparsity at (M - N) / M = 0.5; leave --sparsity out, or use --mask-structure unstructured for another "
            "sparsity",
        ),
        (["--method", "gptq", "--group-size", "0"], "--group-size must be a positive int, got 0"),
        (
            ["--method", "gptq", "--scheme", "W3X"],
            f"recipe {GENERATED}, stage 'quantization_stage', modifier GPTQModifier, argument 'scheme': unknown "
            "quantization scheme 'W3X'; presets: ...",  # the list is compressed-tensors' (checked: it holds W4A16)
        ),
    ],
)
def test_recipe_flag_errors_come_before_the_model_loads(tiny_model_dir, tmp_path, capsys, no_model_load, flags,
                                                        message):  # fmt: skip
    model, text = tiny_model_dir
    argv = ["oneshot", "--model", str(model), "--dataset", str(text), "--output", str(tmp_path / "o"), *flags]
    assert main(argv) == 1
    err = capsys.readouterr().err
    if message.endswith("presets: ..."):
        assert err.startswith(f"llmc-fsm oneshot: error: {message.removesuffix('...')}") and "W4A16" in err
        assert err.count("\n") == 1
    else:
        assert err == f"llmc-fsm oneshot: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_recipe_argument_errors_of_the_api_come_before_the_model_loads(tiny_model_dir, tmp_path, no_model_load):
    model, text = tiny_model_dir
    for arguments, reason in [({"sparsity": 1.0}, SPARSITY), ({"mask_structure": "3:2"}, MASK)]:
        message = f"recipe <dict>, stage 's', modifier SparseGPTModifier, {reason}"
        with pytest.raises(RecipeError) as info:
            llmc_fsm.oneshot(str(model), recipe={"s": {"SparseGPTModifier": arguments}}, dataset=str(text),
                             output_dir=tmp_path / "o", progress=False)  # fmt: skip
        assert str(info.value) == message
    assert list(tmp_path.iterdir()) == []


def test_api_only_values_are_refused_in_one_line(no_model_load):
    cases = [
        ({"overwrite": "yes"}, "overwrite (--overwrite) must be True or False, got 'yes'"),
        ({"seed": 1.5}, "seed must be an int, got 1.5"),
        ({"eval_seq_length": 0}, "eval_seq_length must be a positive int, got 0"),
        ({"model": 3}, "model (--model) must be a known model name, a model directory or an nn.Module, got 3"),
        (
            {"dataset": torch.zeros(2, 8)},
            "dataset (--dataset) must hold token ids of shape [N, L] when it is a tensor, got torch.float32 (2, 8)",
        ),
        (
            {"dataset": {"text": "a"}},
            "dataset (--dataset) must be a text/JSONL file, a Hugging Face dataset name, a LongTensor [N, L] of "
            "token ids, a list of texts (str) or a datasets.Dataset with an 'input_ids' or 'text' column, got a dict",
        ),
        ({"output_dir": 7}, "output_dir (--output) must be a path (str or os.PathLike) or None, got 7"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError) as info:
            llmc_fsm.oneshot(**kw)
        assert str(info.value) == message


# --------------------------------------------------------------------------- the resume fingerprint
def _sha16(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _fingerprint_of(settings: OneshotSettings) -> dict:
    """The fingerprint of ``settings`` as ``prepare`` computes it (recipe resolved, dataset text read)."""
    recipe = resolve_recipe(settings.recipe)
    text = Path(settings.dataset).read_text(encoding="utf-8") if settings.dataset is not None else None
    return fingerprint(settings, recipe=recipe, modifiers=recipe.modifiers, text=text)


def test_the_fingerprint_is_the_one_the_previous_code_wrote(tiny_model_dir, tmp_path):
    """A calibrated recipe (a data-free one records file sizes and times instead of hashes: see
    tests/test_performance_mechanisms.py). Same inputs, same fingerprint.json as before the settings object (so an interrupted run of the previous
    version resumes). The expected dict is written out from the previous ``resume.fingerprint`` definition:
    ``model`` = the directory and the first 16 hex digits of each file's sha256; ``recipe`` = the resolved recipe's
    ``to_dict()``; ``calibration data`` = source, sha256 of the text, ``num_samples`` and ``seq_len``;
    ``pipeline`` = ``batch_size``, ``fuse_stages``, the constant ``order`` and ``dtype``; ``seed``; the versions."""
    model, text = tiny_model_dir
    settings = OneshotSettings(
        model=str(model), recipe=CALIBRATED, dataset=str(text), num_calibration_samples=4, max_seq_length=16,
        batch_size=2, fuse_stages=True, dtype="bfloat16", seed=7, output_dir=tmp_path / "o", progress=False,
    )  # fmt: skip
    pruning = get_registry().info("MagnitudePruningModifier").distribution
    expected = {
        "model": {
            "directory": str(model.resolve()),
            "files": {p.name: _sha16(p.read_bytes()) for p in sorted(model.iterdir()) if p.is_file()},
        },
        "recipe": resolve_recipe(CALIBRATED).to_dict(),
        "calibration data": {"source": str(text), "sha256": _sha16(text.read_bytes()), "num_samples": 4, "seq_len": 16},
        "pipeline": {"batch_size": 2, "fuse_stages": True, "order": "true sequential", "dtype": "bfloat16"},
        "seed": 7,
        "library versions": {
            "llmc-fsm": "0.1.0",
            "torch": torch.__version__,
            "transformers": importlib.metadata.version("transformers"),
            "compressed-tensors": importlib.metadata.version("compressed-tensors"),
            pruning: importlib.metadata.version(pruning),
        },
    }
    assert _fingerprint_of(settings) == expected
    run = phases.prepare(settings)  # and what the job writes to its work directory
    try:
        assert json.loads((run.work.path / "fingerprint.json").read_text()) == expected
    finally:
        run.work.abort(RuntimeError("test done"))
    assert list(tmp_path.iterdir()) == []


def test_every_fingerprinted_field_changes_the_fingerprint_and_no_other_does(tiny_model_dir, tmp_path):
    model, text = tiny_model_dir
    other_model = shutil.copytree(model, tmp_path / "model2")
    (other_model / "generation_config.json").write_text("{}\n", encoding="utf-8")
    other_text = tmp_path / "cal2.txt"
    other_text.write_text(text.read_text(encoding="utf-8") + "w001\n", encoding="utf-8")
    base = OneshotSettings(model=str(model), recipe=RECIPE, dataset=str(text), progress=False)
    changes = {  # field -> another valid value (with what it needs)
        "model": {"model": str(other_model)},
        "recipe": {"recipe": {"s": {"MagnitudePruningModifier": {"sparsity": 0.6, "ignore": ["lm_head"]}}}},
        "dataset": {"dataset": str(other_text)},
        "num_calibration_samples": {"num_calibration_samples": 5},
        "max_seq_length": {"max_seq_length": 17},
        "output_dir": {"output_dir": str(tmp_path / "o")},
        "overwrite": {"overwrite": True},
        "resume": {"resume": True, "output_dir": str(tmp_path / "o")},
        "tokenizer": {"tokenizer": "some/tokenizer"},
        "eval_text": {"eval_text": str(text)},
        "num_eval_windows": {"num_eval_windows": 3},
        "eval_seq_length": {"eval_seq_length": 9},
        "batch_size": {"batch_size": 3},
        "seed": {"seed": 1},
        "progress": {"progress": True},
        "fuse_stages": {"fuse_stages": True},
        "low_memory": {"low_memory": True},
        "dtype": {"dtype": "float16"},
        "threads": {"threads": 3},
        "device": {"device": "cpu"},
        "activation_budget_mib": {"activation_budget_mib": 8.0},
        "quantization_format": {"quantization_format": "pack-quantized", "output_dir": str(tmp_path / "o")},
    }
    fields = {f.name: f for f in attrs.fields(OneshotSettings)}
    assert sorted(changes) == sorted(fields)  # a new field must be classified here
    reference = _fingerprint_of(base)
    for name, changed in changes.items():
        after = _fingerprint_of(attrs.evolve(base, **changed))
        differ = sorted(item for item in {*reference, *after} if reference.get(item) != after.get(item))
        path = fields[name].metadata["fingerprint"]
        assert differ == ([] if path is None else [path[0]]), name
        if path is not None and len(path) > 1:  # the value itself is recorded where the metadata says
            assert after[path[0]][path[1]] == getattr(attrs.evolve(base, **changed), name)
    assert {n for n, f in fields.items() if f.metadata["fingerprint"]} == {
        "model", "recipe", "dataset", "num_calibration_samples", "max_seq_length", "batch_size", "seed",
        "fuse_stages", "dtype", "quantization_format",
    }  # fmt: skip


def test_default_recipe_is_unchanged():
    assert default_recipe() == {
        "sparsity_stage": {
            "SparseGPTModifier": {
                "targets": ["Linear"],
                "ignore": ["lm_head"],
                "sparsity": 0.5,
                "mask_structure": "unstructured",
            }
        }
    }
