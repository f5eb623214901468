"""Issue 27: what a new user trips on — explain of a modifier needing an argument, advice that must itself work,
output inside the source model, an offline Hub ID, torchrun ranks repeating errors, W4A4, the report's wording."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import llmc_fsm
from llmc_fsm.cli.main import main
from llmc_fsm.core.registry import get_registry

pytest.importorskip("llmc_fsm_pruning")


# --------------------------------------------------------------------------- explain NAME
def test_explain_magnitude_pruning_lists_its_arguments_and_its_example_is_accepted(capsys):
    assert main(["explain", "MagnitudePruningModifier"]) == 0
    out = capsys.readouterr().out
    assert out == (
        "MagnitudePruningModifier: arguments (default):\n  sparsity = None\n  init_sparsity = None\n"
        "  final_sparsity = None\n  mask_structure = 'unstructured'\n  targets = ['Linear']\n  ignore = ['lm_head']\n"
        "  leave_enabled = False\n"
        "No plan with the defaults alone: give sparsity (one-shot) or init_sparsity + final_sparsity (gradual). See "
        "its plan with a recipe that sets what it needs, e.g. llmc-fsm explain "
        "'s: {MagnitudePruningModifier: {sparsity: VALUE}}'\n"
    )
    example = out.rsplit("llmc-fsm explain ", 1)[1].strip().strip("'").replace("VALUE", "0.5")
    assert main(["explain", example]) == 0  # the advice works
    assert "MagnitudePruningModifier" in capsys.readouterr().out


def test_explain_every_registered_modifier_name_answers_without_error(capsys):
    for info in get_registry().infos():
        assert main(["explain", info.name]) == 0, capsys.readouterr().err
        assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- advice that must work
def test_the_group_size_advice_is_accepted():
    pytest.importorskip("llmc_fsm_quantization")
    from llmc_fsm_quantization import GPTQModifier

    with pytest.raises(ValueError) as info:
        GPTQModifier(scheme={"preset": "W4A16", "weights": {"group_size": 100}})
    msg = str(info.value)
    assert "e.g. CLI: --group-size 64; recipe: group_size: 64" in msg
    assert "only if every targeted layer's input width is a multiple of 100" in msg
    assert "--block-size 100" in msg
    assert GPTQModifier(scheme={"preset": "W4A16", "weights": {"group_size": 64}}).weight_args.group_size == 64
    assert all(width % 64 == 0 for width in (576, 1536))  # SmolLM2-135M's input widths take the suggested size
    assert GPTQModifier(scheme={"preset": "W4A16", "weights": {"group_size": 100}}, block_size=100).block_size == 100


def test_the_per_channel_preset_advice_is_accepted():
    pytest.importorskip("llmc_fsm_quantization")
    from llmc_fsm_quantization import GPTQModifier

    with pytest.raises(ValueError) as info:
        GPTQModifier(scheme={"preset": "W8A8", "weights": {"group_size": 64}})
    assert str(info.value).endswith("or set weights: {strategy: group, group_size: 64}")
    accepted = GPTQModifier(scheme={"preset": "W8A8", "weights": {"strategy": "group", "group_size": 64}})
    assert accepted.weight_args.group_size == 64
    assert GPTQModifier(scheme="W4A16").weight_args.group_size == 128  # the group-wise preset it names


# --------------------------------------------------------------------------- output inside the source model
def test_an_output_inside_the_source_model_directory_is_refused_before_anything(tiny_model_dir, tmp_path, capsys):
    model_dir, text = tiny_model_dir
    before = sorted(p.name for p in model_dir.rglob("*"))
    out = model_dir / "compressed"
    assert main(["oneshot", "--model", str(model_dir), "--dataset", str(text), "--output", str(out)]) == 1
    assert capsys.readouterr().err == (
        f"llmc-fsm oneshot: error: output directory {str(out)!r} is inside the directory the model is read from "
        f"({str(model_dir)!r}): the output and its work directory would be mixed into the model's files: choose a "
        f"new directory (e.g. {str(model_dir) + '-compressed'!r})\n"
    )
    assert sorted(p.name for p in model_dir.rglob("*")) == before


# --------------------------------------------------------------------------- an offline Hub model ID
def test_an_unreachable_hub_fails_at_once_for_an_uncached_model(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from huggingface_hub import constants

    from llmc_fsm.models.hf_io import load_hub

    for key in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))

    def no_download(*a, **k):
        raise AssertionError("from_pretrained was called")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_download)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        load_hub("nobody-here/no-such-model", torch.float32)
    assert time.monotonic() - t0 < 5
    assert str(info.value).startswith(
        "model 'nobody-here/no-such-model' is not a known name or a local directory, and as a Hugging Face Hub "
        f"model ID it is not in the cache (HF_HUB_OFFLINE=0, Hugging Face cache searched: {tmp_path}) and the Hub "
        "cannot be reached (127.0.0.1:9: "
    )
    assert str(info.value).endswith(
        "): connect to the network, point HF_HUB_CACHE at a cache that holds it, or pass a local model directory"
    )
    assert list(tmp_path.iterdir()) == []


def test_an_unreachable_uncached_hub_model_is_one_line_before_the_device_line(tmp_path, monkeypatch, capsys):
    """A newcomer's case: ``--model out/nonexistent`` (shaped like a Hub ID) printed the device line, then the
    error; the command now refuses it with the same one line before any other, nothing written."""
    from huggingface_hub import constants

    for key in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    capsys.readouterr()
    assert main(["oneshot", "--model", "out/nonexistent", "--output", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "llmc-fsm oneshot: error: model 'out/nonexistent' is not a known name or a local directory, and as a Hugging "
        "Face Hub model ID it is not in the cache"
    )
    assert err.count("\n") == 1
    assert err.endswith(", or pass a local model directory; known model names: smollm2-135m\n")  # (a newcomer's case)
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- torchrun: one error line
def _cli_errors_worker(rank: int, tmp: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Three failures of ``main`` on 2 ranks of one gloo group, each rank's stderr kept; the ranks meet between."""
    import contextlib
    import io

    import torch.distributed as dist

    from llmc_fsm.toolkit import distributed
    from llmc_fsm.toolkit.distributed import PeerFailureError, error_line_to_print

    distributed.ERROR_WAIT_S = 2.0  # how long rank 1 waits for rank 0's line
    said: dict[str, Any] = {}
    cases = {  # every rank's arguments; "alike" fails alike on both, "own" on rank 1 only
        "own": ["explain", "/nonexistent/rank-1.yaml" if rank else "s: {SparseGPTModifier: {sparsity: 0.5}}"],
        "alike": ["explain", "/nonexistent/recipe.yaml"],
    }
    for case, argv in cases.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            said[case] = [main(argv), err.getvalue()]
        dist.barrier()
    said["peer"] = error_line_to_print("llmc-fsm oneshot: error: peer", PeerFailureError("another rank stopped"))
    return said


def test_under_torchrun_an_error_every_rank_raises_is_printed_once_and_a_ranks_own_by_that_rank(tmp_path):
    """Under torchrun an error every rank raises alike is one line, from rank 0 (what this test protected before). But
    rank 1 printed nothing at all, so its own error (a model or recipe missing on its node, a crash) was never shown
    while rank 0 said "another rank stopped (see its error)" (found by a tester). Now a rank prints its own error
    prefixed "rank N: ", and not an error rank 0 printed the same, nor another rank's failure."""
    from llmc_fsm.testing import run_ranks

    ranks = run_ranks(_cli_errors_worker, tmp_path, world_size=2, timeout_s=60.0, join_s=120.0)
    assert all("error" not in rank["meta"] for rank in ranks), [rank["meta"] for rank in ranks]
    first, second = (rank["meta"]["result"] for rank in ranks)
    missing = "llmc-fsm explain: error: recipe file '/nonexistent/{}.yaml' does not exist\n"
    assert first["own"] == [0, ""]
    assert second["own"] == [1, "rank 1: " + missing.format("rank-1")]
    assert first["alike"] == [1, missing.format("recipe")]
    assert second["alike"] == [1, ""]
    assert first["peer"] == "llmc-fsm oneshot: error: peer"  # rank 0 says another rank's failure
    assert second["peer"] is None


# --------------------------------------------------------------------------- W4A4 warns
def test_w4a4_warns_in_one_line(caplog):
    pytest.importorskip("llmc_fsm_quantization")
    from llmc_fsm_quantization import QuantizationModifier

    with caplog.at_level(logging.WARNING, logger="llmc_fsm_quantization.schemes"):
        QuantizationModifier(scheme="W4A4")
        QuantizationModifier(scheme="W8A8")
    assert [r.getMessage() for r in caplog.records] == [
        "scheme W4A4 quantizes activations to 4-bit integers, which without rotations (QuaRot, SpinQuant) or "
        "calibrated clipping scales (neither is applied here) usually ruins the model's perplexity; W4A16 or W8A8 "
        "keep it"
    ]


# --------------------------------------------------------------------------- the report's wording
def test_the_report_says_tokens_generated_by_the_model(tiny_model_dir):
    pytest.importorskip("transformers")
    from llmc_fsm.report.build import OneshotReport

    report = OneshotReport.from_dict(
        {**_minimal_report(),
         "calibration": {"num_samples": 4, "seq_len": 8, "source": "generated by the model (seed 0, 8 prompts)"}}
    )
    line = report.format_table().splitlines()[1]
    assert line == "calibration: 4 x 8 tokens generated by the model (seed 0, 8 prompts)"


def _minimal_report() -> dict:
    model = torch.nn.Sequential(torch.nn.Embedding(8, 8), torch.nn.Linear(8, 8))
    out = llmc_fsm.oneshot(
        model=model,
        recipe={"p": {"MagnitudePruningModifier": {"sparsity": 0.5, "targets": ["Linear"], "ignore": []}}},
        dataset=torch.randint(0, 8, (2, 8)),
        progress=False,
    )
    return out.llmc_fsm_report.to_dict()


@pytest.mark.parametrize("path", [[], ["--low-memory"]])
def test_a_modifiers_refusal_mid_run_prints_its_own_line_without_the_sessions_advice(
    tiny_model_dir, tmp_path, capsys, path
):
    """A NaN weight in layer 1 of a model directory, found when its layer is compressed (the streamed path reads it
    only then): the command printed the library's ModifierError, "... The event counts as delivered; modifiers after
    this one did not see it. Continue, or finalize()/reset() the session." The modifier's own line; exit 1."""
    import shutil

    import tiny_llama
    from safetensors.torch import load_file, save_file

    model_dir, text = tiny_model_dir
    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    assert main(tiny_llama.oneshot_argv(broken, text, tmp_path / "out", "--num-samples", "4", *path)) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "llmc-fsm oneshot: error: SparseGPTModifier: the weights of model.layers.1.mlp.down_proj hold NaN or Inf "
        "values, so they cannot be compressed: the checkpoint (or an earlier change to the model) is broken there"
    )
    assert not (tmp_path / "out").exists()


def test_under_torchrun_only_rank_0_says_it_was_interrupted(monkeypatch, capsys):
    """SIGTERM under torchrun: rank 1 printed "interrupted (SIGTERM); nothing written" beside rank 0's "progress
    kept ..." line (found by a tester); only rank 0, the one that writes, says it now. Both exit 143."""
    from llmc_fsm.cli import oneshot as cli_oneshot

    exc = cli_oneshot.Terminated()
    exc.add_note("progress kept in 'out' (2 of 4 layers): run the same command with --resume")
    for main, expected in ((True, "llmc-fsm oneshot: interrupted (SIGTERM); progress kept in 'out' (2 of 4 layers): "
                                  "run the same command with --resume\n"),):  # another rank: test_s39_distributed
        monkeypatch.setattr(cli_oneshot, "is_main_process", lambda main=main: main)
        assert cli_oneshot.interrupted("oneshot", exc) == 143
        assert capsys.readouterr().err == expected
