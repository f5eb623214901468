"""benchmarks/gpu_oneshot.py on the CPU: its arguments, its measures and its refusal without CUDA.

The benchmark itself needs a GPU (and ``--dry-run`` runs our side on a tiny shape in ~1 min on 2 cores: too slow
for the suite; it was run by hand while writing it). Nothing here measures anything.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_oneshot.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_oneshot", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults_are_the_issues_protocol(bench):
    args = bench.parse_args([])
    assert (args.num_samples, args.seq_len, args.methods, args.device) == (128, 2048, ["gptq", "sparsegpt"], "cuda")
    assert bench.LLAMA_3_2_1B["num_hidden_layers"] == 16 and bench.LLAMA_3_2_1B["hidden_size"] == 2048
    if not torch.cuda.is_available():
        assert bench.parse_args(["--dry-run"]).device == "cpu"


def test_bad_sizes_are_refused(bench, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(["--num-samples", "0"])
    assert info.value.code == 2
    assert "--num-samples must be a positive int, got 0" in capsys.readouterr().err


def test_layer_output_error_is_the_relative_norm(bench):
    dense = [torch.tensor([[3.0, 4.0]]), torch.tensor([[1.0, 0.0]])]
    compressed = [torch.tensor([[3.0, 3.0]]), torch.tensor([[1.0, 0.0]])]
    assert bench.layer_output_errors(dense, compressed) == [1.0 / 5.0, 0.0]


def test_ratios_against_the_targets(bench):
    ours = {"wall_s": 40.0, "peak_device_bytes": 900}
    peer = {"wall_s": 100.0, "peak_device_bytes": 1000}
    assert bench._ratios(ours, peer) == {
        "wall_ours_over_peer": 0.4,
        "wall_target_met": True,
        "peak_device_memory_ours_over_peer": 0.9,
        "peak_device_memory_target_met": True,
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA device")
def test_without_cuda_it_refuses_before_any_work(bench, capsys, tmp_path):
    assert bench.main(["--model-dir", str(tmp_path / "m")]) == 2
    assert capsys.readouterr().err == ("gpu_oneshot: needs a CUDA device (torch sees none); use --dry-run on the CPU\n")
    assert not (tmp_path / "m").exists()
