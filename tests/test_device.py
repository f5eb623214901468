"""The execution device on the CPU: choosing it, onloading one decoder layer at a time, the activation budget.

CUDA itself is tested in tests/test_cuda.py (marked ``cuda``); here ``torch.cuda.is_available`` /
``device_count`` / ``current_device`` are monkeypatched to check resolution and its errors, and the onloading code
path runs with the CPU as the device (every move is recorded; results compared bit for bit).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from tiny_llama import llama

import llmc_fsm
from llmc_fsm import Session
from llmc_fsm.cli.main import main as cli_main
from llmc_fsm.oneshot_job.settings import OneshotSettings, default_recipe
from llmc_fsm.pipeline import device as device_module
from llmc_fsm.pipeline import forward, sequential
from llmc_fsm.pipeline.device import (
    ActivationStore,
    OffloadedInputs,
    activation_store,
    describe_device,
    device_label,
    onloaded,
    resolve_device,
)
from llmc_fsm.pipeline.sequential import run_sequential


def windows(n: int = 6, length: int = 16) -> torch.Tensor:
    return torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(3))


def linears(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: m.weight.detach().clone()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    }


def fake_cuda(monkeypatch, *, count: int, current: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


# --------------------------------------------------------------------------- resolution and its errors
def test_auto_is_the_cpu_without_cuda_and_the_current_cuda_device_with_it(monkeypatch):
    fake_cuda(monkeypatch, count=0)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    fake_cuda(monkeypatch, count=2, current=1)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("CUDA:0") == torch.device("cuda", 0)
    assert resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_cuda_without_cuda_is_refused_in_one_line(monkeypatch):
    fake_cuda(monkeypatch, count=0)
    with pytest.raises(ValueError) as info:
        OneshotSettings(device="cuda")
    message = str(info.value)
    assert message == (
        f"device (--device) is 'cuda' but torch sees no CUDA device (torch {torch.__version__}, built with CUDA "
        f"{torch.version.cuda or 'none'}); use cpu, or auto to take CUDA only where it exists"
    )
    assert "\n" not in message


def test_a_cuda_index_torch_does_not_see_is_refused(monkeypatch):
    fake_cuda(monkeypatch, count=2)
    with pytest.raises(ValueError, match=r"^device \(--device\) is 'cuda:2' but torch sees 2 CUDA device\(s\) "
                       r"\(cuda:0 to cuda:1\); pick one of those$"):  # fmt: skip
        OneshotSettings(device="cuda:2")
    assert OneshotSettings(device="cuda:1").execution_device == torch.device("cuda", 1)


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:-1", "cuda:x", "", "mps", 3])
def test_unknown_device_strings_are_refused(spec):
    with pytest.raises(ValueError) as info:
        OneshotSettings(device=spec)
    assert str(info.value) == (
        f"device (--device) must be one of auto, cpu, cuda or cuda:N (N a CUDA device index), got {spec!r}"
    )


def test_the_cli_refuses_cuda_without_cuda_before_any_work(monkeypatch, capsys, tmp_path):
    fake_cuda(monkeypatch, count=0)

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("llmc_fsm.oneshot_job.phases.load_model", no_load)
    status = cli_main(["oneshot", "--device", "cuda:0", "--output", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 1
    assert err == (
        "llmc-fsm oneshot: error: device (--device) is 'cuda:0' but torch sees no CUDA device (torch "
        f"{torch.__version__}, built with CUDA {torch.version.cuda or 'none'}); use cpu, or auto to take CUDA only "
        "where it exists\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_describe_the_cpu_and_a_cuda_device(monkeypatch):
    info = describe_device(torch.device("cpu"))
    assert info["device"] == "cpu" and isinstance(info["name"], str) and info["name"]
    assert info["total_memory_bytes"] is None or info["total_memory_bytes"] > 2**20

    class Props:
        name = "NVIDIA H200"
        total_memory = 150_000_000_000

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props)
    cuda = describe_device(torch.device("cuda", 0))
    assert cuda == {"device": "cuda:0", "name": "NVIDIA H200", "total_memory_bytes": 150_000_000_000}
    assert device_label(cuda) == "cuda:0 (NVIDIA H200, 139.7 GiB)"


# --------------------------------------------------------------------------- onloading, recorded
def test_onloaded_restores_every_tensor_and_sends_new_ones_home():
    layer = torch.nn.Linear(4, 3)
    weight = layer.weight
    with onloaded(layer, torch.device("cpu")) as same:
        assert same is layer
        layer.register_buffer("scale", torch.ones(3))  # what a quantizer adds during the block
    assert layer.weight is weight  # the Parameter object is kept (hooks, ties)
    assert layer.scale.device == torch.device("cpu")


def _recording(monkeypatch, model, where=(sequential, forward)):
    """Record every onloaded() the pipeline opens, and every compression, in order (``model``: whose names to use;
    a callable: called for the model when it is first needed)."""
    known: dict[int, str] = {}

    class Names(dict):
        def __missing__(self, key):
            known.update(
                {
                    id(m): n or "model"
                    for n, m in (model if isinstance(model, torch.nn.Module) else model()).named_modules()
                }
            )
            return known[key]

    names = Names()
    events: list[tuple] = []
    real = device_module.onloaded

    def record(module, device, *, skip=()):
        @contextlib.contextmanager
        def block():
            entry = ("on", names[id(module)], str(device), tuple(names[id(m)] for m in skip))
            events.append(entry)
            with real(module, device, skip=skip):
                yield module
            events.append(("off", names[id(module)]))

        return block()

    for module in where:
        monkeypatch.setattr(module, "onloaded", record)
    from llmc_fsm_pruning.wanda import WandaPruningModifier

    original = WandaPruningModifier._compress_group

    def compress(self, modules, accumulator):
        events.extend(("compress", names[id(m)], str(m.weight.device)) for m in modules)
        return original(self, modules, accumulator)

    monkeypatch.setattr(WandaPruningModifier, "_compress_group", compress)
    return events


def test_each_decoder_layer_is_onloaded_for_its_work_and_returned(monkeypatch):
    model = llama(layers=3)
    events = _recording(monkeypatch, model)
    session = Session(default_recipe("wanda", 0.5))
    session.initialize(model=model, calibration_data=windows())
    result = run_sequential(session, batch_size=2, progress=False, device="cpu")
    session.finalize()
    assert events[:2] == [("on", "model", "cpu", ("model.layers",)), ("off", "model")]  # embeddings: the capture
    assert events[2:4] == [("on", "model.layers.0", "cpu", ()), ("off", "model.layers.0")]  # record_calls
    rest = events[4:]
    for index in range(3):
        layer = f"model.layers.{index}"
        start = rest.index(("on", layer, "cpu", ()))
        end = rest.index(("off", layer))
        inside = rest[start + 1 : end]
        compressed = [e[1] for e in inside if e[0] == "compress"]
        assert compressed == [
            f"{layer}.{m}"
            for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        ]  # fmt: skip
        assert all(e[0] == "compress" for e in inside)  # no other module onloaded meanwhile
    assert [e for e in rest if e[0] == "on"] == [("on", f"model.layers.{i}", "cpu", ()) for i in range(3)]
    assert result.device["device"] == "cpu"
    assert result.activations["mode"] == "device" and result.activations["budget_bytes"] is None
    assert result.peak_device_bytes is None and result.layer_peak_device_bytes == []


def test_onloading_changes_no_result():
    reference, moved = llama(layers=3), llama(layers=3)
    for model, device in ((reference, None), (moved, "cpu")):
        session = Session(default_recipe("sparsegpt", 0.5))
        session.initialize(model=model, calibration_data=windows())
        run_sequential(session, batch_size=2, progress=False, device=device)
        session.finalize()
    a, b = linears(reference), linears(moved)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(p.device == torch.device("cpu") for p in moved.parameters())


# --------------------------------------------------------------------------- activation budget
@pytest.fixture
def budget_as_on_a_gpu(monkeypatch):
    """The offload path on the CPU: since 2026-12-07 no budget applies on the CPU (a tester found "in CPU memory, moved
    to the device per batch" reported while nothing moved), so these tests weigh the budget as for a CUDA device, with
    the CPU standing in for it, to run the path a GPU takes."""
    def store(device, activation_bytes, budget_bytes, **kwargs):
        offload = budget_bytes is not None and 2 * activation_bytes > budget_bytes
        return ActivationStore(device=device, offload=offload, activation_bytes=activation_bytes,
                               budget_bytes=budget_bytes)  # fmt: skip

    from llmc_fsm.pipeline import streaming

    monkeypatch.setattr(sequential, "activation_store", store)
    monkeypatch.setattr(streaming, "activation_store", store)


def test_a_tiny_budget_keeps_activations_in_cpu_memory_with_identical_results(budget_as_on_a_gpu):
    results = {}
    for budget in (None, 0):
        model = llama(layers=3)
        session = Session(default_recipe("sparsegpt", 0.5))
        session.initialize(model=model, calibration_data=windows())
        results[budget] = (run_sequential(session, batch_size=2, progress=False, activation_budget=budget), model)
        session.finalize()
    kept, offloaded = results[None][0].activations, results[0][0].activations
    assert kept == {"mode": "device", "activation_bytes": 6 * 16 * 64 * 4, "budget_bytes": None}
    # 3 batches held in CPU memory after the capture and after each of the first two layers
    assert offloaded == {
        "mode": "cpu-offloaded",
        "activation_bytes": 6 * 16 * 64 * 4,
        "budget_bytes": 0,
        "batches_held_in_cpu_memory": 9,
        "batches_moved_to_device": 0,
    }
    a, b = linears(results[None][1]), linears(results[0][1])
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_the_budget_compares_a_layers_inputs_and_outputs(monkeypatch):
    cpu = torch.device("cpu")
    assert not activation_store(cpu, 10**12, None).offload  # the CPU: no separate device memory
    store = activation_store(cpu, 101, 200)  # a budget given for the CPU is not applied
    assert (store.offload, store.budget_bytes, store.mode) == (False, None, "device")
    monkeypatch.setattr(device_module, "free_device_bytes", lambda device: 400)  # a CUDA device with 400 bytes free
    gpu = torch.device("meta")  # any device that is not the CPU: the budget applies
    assert not activation_store(gpu, 100, 200).offload  # 2 x 100 fits in 200
    assert activation_store(gpu, 101, 200).offload
    assert not activation_store(gpu, 100, None).offload and activation_store(gpu, 101, None).offload  # half of 400


def test_offloaded_inputs_move_one_batch_at_a_time():
    store = ActivationStore(device=torch.device("cpu"), offload=True)
    hidden = [torch.randn(2, 3) for _ in range(3)]
    held = store.hold([((h, "extra"), {"mask": None}) for h in hidden])
    assert isinstance(held, OffloadedInputs) and len(held) == 3 and store.keeps == 3
    for (args, kwargs), h in zip(held, hidden, strict=True):
        assert torch.equal(args[0], h) and args[0].data_ptr() != h.data_ptr()  # a copy, same values
        assert args[1] == "extra" and kwargs == {"mask": None}
    assert isinstance(held[1:], OffloadedInputs) and len(held[1:]) == 2


def test_oneshot_reports_the_device_and_where_activations_lived(budget_as_on_a_gpu):
    model = llama(layers=2)
    llmc_fsm.oneshot(
        model=model,
        recipe=default_recipe("wanda", 0.5),
        dataset=windows(),
        batch_size=2,
        progress=False,
        device="cpu",
        activation_budget_mib=0,
    )
    report = model.llmc_fsm_report
    execution = report.to_dict()["execution"]
    assert execution["device"] == describe_device(torch.device("cpu"))
    assert execution["activations"]["mode"] == "cpu-offloaded"
    assert execution["activations"]["budget_bytes"] == 0
    line = next(x for x in report.format_table().splitlines() if x.startswith("device: "))
    assert line == (
        f"device: {device_label(describe_device(torch.device('cpu')))}; activations between layers in CPU memory, "
        "moved to the device per batch (0.0 MiB)"
    )


def test_the_first_progress_line_names_the_device(capsys):
    model = llama(layers=1)
    llmc_fsm.oneshot(model=model, recipe=default_recipe("wanda", 0.5), dataset=windows(), device="cpu")
    first = capsys.readouterr().err.splitlines()[0]
    assert first == f"llmc-fsm oneshot: device {device_label(describe_device(torch.device('cpu')))}"


def test_cuda_tests_not_run_are_counted_in_the_summary():
    """Where torch sees no CUDA device the cuda-marked tests are skipped with the reason, and counted."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-q", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=str(Path(__file__).resolve().parent.parent),
        timeout=300,
    )
    if torch.cuda.is_available():
        assert proc.returncode == 0 and "CUDA test(s) not run" not in proc.stdout, proc.stdout
        return
    reason = f"torch {torch.__version__} (built with CUDA {torch.version.cuda or 'none'}) sees no CUDA device"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "13 skipped" in proc.stdout
    # -ra groups the skips: one line for the plain tests, one per parametrized test
    assert proc.stdout.count(f"needs CUDA: {reason}") == 3
    assert f"13 CUDA test(s) not run: {reason}; run them on a machine with a GPU (python -m pytest -m cuda)" in (
        proc.stdout
    )


def test_the_streamed_path_onloads_each_layer_it_reads(monkeypatch, tiny_model_dir, tmp_path):
    """--low-memory: each decoder layer, read from the checkpoint, is onloaded for its work and written from where
    it was read."""
    from llmc_fsm.pipeline import streaming

    model_dir, text = tiny_model_dir
    seen = {}
    real_load = llmc_fsm.oneshot_job.streaming.load_lazy

    def load_lazy(*args, **kwargs):
        lazy, tokenizer = real_load(*args, **kwargs)
        seen["model"] = lazy.model
        return lazy, tokenizer

    monkeypatch.setattr(llmc_fsm.oneshot_job.streaming, "load_lazy", load_lazy)
    events = _recording(monkeypatch, lambda: seen["model"], where=(streaming,))
    llmc_fsm.oneshot(
        model=str(model_dir),
        recipe=default_recipe("wanda", 0.5),
        dataset=str(text),
        num_calibration_samples=4,
        max_seq_length=16,
        output_dir=str(tmp_path / "out"),
        low_memory=True,
        progress=False,
        device="cpu",
    )
    assert events[:2] == [("on", "model", "cpu", ("model.layers",)), ("off", "model")]
    assert events[2:4] == [("on", "model.layers.0", "cpu", ()), ("off", "model.layers.0")]  # record_calls
    onloads = [e for e in events[4:] if e[0] == "on"]
    assert onloads == [("on", f"model.layers.{i}", "cpu", ()) for i in range(4)]
    for index in range(4):
        layer = f"model.layers.{index}"
        start, end = events.index(("on", layer, "cpu", ()), 4), events.index(("off", layer), 4)
        assert [e[1].rsplit(".", 1)[0] for e in events[start + 1 : end]] == [f"{layer}.self_attn"] * 3 + [
            f"{layer}.self_attn"
        ] + [f"{layer}.mlp"] * 3


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_the_streamed_path_honours_the_activation_budget_with_identical_output(tiny_model_dir, tmp_path,
                                                                               budget_as_on_a_gpu):
    """--low-memory --activation-budget-mib 0: the hidden states between layers (calibration and evaluation) wait
    in CPU memory; the output and the perplexities are bit-identical to those of the unlimited run, and the report
    says which ran."""
    model_dir, text = tiny_model_dir
    runs = {}
    for budget in (None, 0):
        model = llmc_fsm.oneshot(
            model=str(model_dir),
            recipe=default_recipe("sparsegpt", 0.5),
            dataset=str(text),
            num_calibration_samples=4,
            max_seq_length=16,
            eval_text=str(text),
            num_eval_windows=2,
            eval_seq_length=16,
            batch_size=2,
            output_dir=str(tmp_path / f"out-{budget}"),
            low_memory=True,
            progress=False,
            device="cpu",
            activation_budget_mib=budget,
        )
        runs[budget] = model.llmc_fsm_report.to_dict()
    hidden = 64 * 4  # float32 hidden states of width 64
    unlimited, offloaded = runs[None]["execution"]["activations"], runs[0]["execution"]["activations"]
    assert unlimited == {"mode": "device", "activation_bytes": (4 + 2) * 16 * hidden, "budget_bytes": None}
    # calibration: 2 batches held after the capture and after each of the first 3 of 4 layers; evaluation: 2 windows
    # held after the capture and after each of the 4 layers (they go on to the perplexity after)
    assert offloaded == {
        "mode": "cpu-offloaded",
        "activation_bytes": (4 + 2) * 16 * hidden,
        "budget_bytes": 0,
        "batches_held_in_cpu_memory": 2 * 4 + 2 * 5,
        "batches_moved_to_device": 0,  # the device is the CPU: a held batch is already there
    }
    assert runs[None]["perplexity"] == runs[0]["perplexity"]
    a, b = _tensors(tmp_path / "out-None"), _tensors(tmp_path / "out-0")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_compress_streaming_refuses_a_bad_budget_before_any_work():
    from llmc_fsm.pipeline.streaming import compress_streaming

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"{name} was used")

    for budget in (-1, 1.5, True):
        with pytest.raises(ValueError) as info:
            compress_streaming(Untouchable(), Untouchable(), torch.zeros(0, 1), Untouchable(), activation_budget=budget)
        assert str(info.value) == f"activation_budget must be a number of bytes >= 0 or None, got {budget!r}"


# --------------------------------------------------------------------------- weights too large for CPU memory
def test_weights_too_large_for_cpu_memory_take_the_streamed_path(monkeypatch, tiny_model_dir, tmp_path, capsys):
    from llmc_fsm.oneshot_job import streaming as job_streaming

    model_dir, text = tiny_model_dir
    need = job_streaming.estimated_weight_bytes(model_dir, "float32")
    assert need == sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))  # stored float32, loaded float32
    monkeypatch.setattr(job_streaming, "available_memory_bytes", lambda: need - 1)
    model = llmc_fsm.oneshot(
        model=str(model_dir),
        recipe=default_recipe("wanda", 0.5),
        dataset=str(text),
        num_calibration_samples=4,
        max_seq_length=16,
        output_dir=str(tmp_path / "out"),
        device="cpu",
    )
    assert all(p.is_meta for p in model.parameters())  # the streamed path's model
    assert (tmp_path / "out" / "report.json").is_file()
    what = (
        f"the weights of {model_dir} ({need / 2**30:.2f} GiB in float32) do not fit in the CPU memory available "
        f"({(need - 1) / 2**30:.2f} GiB)"
    )
    assert f"llmc-fsm oneshot: {what}: streaming one decoder layer at a time (--low-memory)" in capsys.readouterr().err
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=str(model_dir), dataset=str(text), max_seq_length=16, progress=False, device="cpu")
    assert str(info.value) == (
        f"{what}, and the streamed path (--low-memory) cannot run this job: it writes the compressed model layer by "
        "layer and keeps none of it in memory: pass output_dir (--output)"
    )
