"""The output head (``lm_head``) as a calibrated target: GPTQ on the final hidden states, as llm-compressor's
``examples/quantization_w4a4_fp4/qwen3_8_gptq_awq_example.py`` targets it (``re:.*lm_head``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from llmc_fsm_quantization import gptq_quantize, resolve_scheme

import llmc_fsm
from llmc_fsm.toolkit import HessianAccumulator

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from tiny_llama import llama

W4G16 = {"preset": "W4A16", "weights": {"group_size": 16}}


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("untied") / "model"
    llama(layers=2, hidden=64, heads=4, kv_heads=2, tied=False).save_pretrained(path)
    return path


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


DATA = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(2))


def _head_hessian(model, data: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The Hessian of lm_head's inputs in ``model`` (as compressed) over ``data`` in batches, accumulated batch by batch
    as the pipeline does (:class:`~llmc_fsm.toolkit.HessianAccumulator`)."""
    accumulator = HessianAccumulator(model.lm_head.in_features)
    handle = model.lm_head.register_forward_pre_hook(lambda m, a: accumulator.add_batch(a[0].detach()))
    with torch.no_grad():
        for chunk in data.split(batch_size):
            model(chunk)
    handle.remove()
    return accumulator.hessian


def test_gptq_on_lm_head_uses_the_final_hidden_states_of_the_quantized_layers(tmp_path, untied_dir) -> None:
    """lm_head's GPTQ weights equal :func:`gptq_quantize` of its float weight with the Hessian of its inputs as the
    compressed model computes them (the final norm of the last quantized layer's output), accumulated batch by batch;
    the saved checkpoint reloads with the in-memory logits."""
    model = _load(untied_dir)
    original = model.lm_head.weight.detach().clone()
    recipe = {"q": {"GPTQModifier": {"scheme": W4G16, "targets": ["Linear"], "ignore": []}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, batch_size=4, output_dir=tmp_path / "out", progress=False)
    (expected,) = gptq_quantize([original], _head_hessian(model, DATA, 4), args=resolve_scheme(W4G16, ["Linear"]).weights)
    assert torch.equal(model.lm_head.weight, expected.weight)
    assert torch.equal(model.lm_head.weight_scale, expected.scale)
    reloaded = _load(tmp_path / "out")
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)
    rows = {m["name"]: m for m in json.loads((tmp_path / "out" / "report.json").read_text())["sparsity"]["modules"]}
    assert rows["lm_head"]["bits"] == 4 and rows["lm_head"]["rel_output_error"] > 0


def test_static_input_scale_of_lm_head_is_the_range_of_its_inputs(untied_dir) -> None:
    """FP8 with static inputs on lm_head (the QuantizationModifier observes the float model's inputs): its input
    scale is max|x| / 448 of the float model's final normed hidden states (static_minmax)."""
    model = _load(untied_dir)
    scheme = {"preset": "FP8", "input_activations": {"observer": "static_minmax"}}
    recipe = {"q": {"QuantizationModifier": {"scheme": scheme, "ignore": []}}}
    reference = _load(untied_dir)
    top: list[float] = []
    reference.lm_head.register_forward_pre_hook(lambda m, a: top.append(float(a[0].abs().max())))
    with torch.no_grad():
        for chunk in DATA.split(4):
            reference(chunk)
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=DATA, batch_size=4, progress=False)
    assert torch.equal(model.lm_head.input_scale.reshape(()), torch.tensor(max(top), dtype=torch.float32) / 448.0)


def test_the_command_runs_an_lm_head_job_in_memory_and_low_memory_refuses_it(tmp_path) -> None:
    """The command's default streams when the job allows it; a job that calibrates lm_head runs in memory (the
    streamed path writes the tensors outside the layers first), and --low-memory refuses it in one line, before any
    weight is read, writing nothing."""
    from tiny_llama import build_with_text, oneshot_argv, run_cli
    from transformers import AutoModelForCausalLM

    model_dir, text = build_with_text(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.tie_word_embeddings = False  # an untied head, as Qwen3-8B's
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(model_dir)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "q:\n  GPTQModifier:\n    targets: [Linear]\n    ignore: []\n    scheme: {preset: W4A16, weights: {group_size: 16}}\n"
    )
    done = run_cli(oneshot_argv(model_dir, text, tmp_path / "out", "--recipe", str(recipe), "--num-samples", "4"))
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert "lm_head" not in config["ignore"]
    refused = run_cli(
        oneshot_argv(model_dir, text, tmp_path / "low", "--recipe", str(recipe), "--num-samples", "4", "--low-memory")
    )
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1] == (
        "llmc-fsm oneshot: error: low_memory (--low-memory) cannot run this job: GPTQModifier compresses lm_head, the "
        "output head (calibrated on the last layer's outputs), and the streamed path writes the tensors outside the "
        "decoder layers first"
    )
    assert not (tmp_path / "low").exists() or not any((tmp_path / "low").iterdir())


def _untied_cli_model(root: Path) -> tuple[Path, Path]:
    from tiny_llama import build_with_text
    from transformers import AutoModelForCausalLM

    model_dir, text = build_with_text(root)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(model_dir)
    return model_dir, text


@pytest.mark.parametrize(
    ("recipe", "signal"),
    [
        ("q:\n  GPTQModifier:\n    targets: [Linear]\n    ignore: []\n    scheme: {preset: W4A16, weights: {group_size: 16}}\n",
         "layer:3:SIGKILL"),
        ("q:\n  QuantizationModifier:\n    targets: [Linear]\n    ignore: []\n    scheme: {preset: FP8, input_activations: "
         "{observer: static_minmax}}\n", "layer:3:SIGKILL"),
    ],
    ids=["gptq", "fp8-static"],
)
def test_a_run_killed_after_its_last_layer_resumes_to_the_same_head(tmp_path, recipe, signal) -> None:
    """Killed right after the last of the 4 decoder layers is saved (the head not yet compressed), --resume runs the
    restored layers to give the head its inputs: the checkpoint equals an uninterrupted run's, tensor for tensor (a
    tester found the head calibrated on the embedding's output before)."""
    from safetensors.torch import load_file
    from tiny_llama import oneshot_argv, run_cli

    model_dir, text = _untied_cli_model(tmp_path)
    (tmp_path / "recipe.yaml").write_text(recipe)
    options = ["--recipe", str(tmp_path / "recipe.yaml"), "--num-samples", "4"]
    reference = run_cli(oneshot_argv(model_dir, text, tmp_path / "ref", *options))
    assert reference.returncode == 0, reference.stderr[-2000:]
    killed = run_cli(oneshot_argv(model_dir, text, tmp_path / "out", *options), signal_at=signal)
    assert killed.returncode == -9
    resumed = run_cli(oneshot_argv(model_dir, text, tmp_path / "out", *options, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "(4 of 4 decoder layers done)" in resumed.stderr
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert sorted(ours) == sorted(theirs) and any(k.startswith("lm_head.") and k != "lm_head.weight" for k in ours)
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []


def test_the_head_of_a_model_whose_forward_reads_its_layers_attributes(tmp_path) -> None:
    """Nemotron-H's forward reads each layer's ``block_type`` to pick its mask: the replayed layers give the real
    layers' attributes (a tester found the run failing after every layer was compressed), and lm_head's GPTQ
    weights equal gptq_quantize on its inputs in the compressed model."""
    from tiny_families import build

    model = build("nemotron_h")
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    original = model.lm_head.weight.detach().clone()
    scheme = {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}
    recipe = {"q": {"GPTQModifier": {"scheme": scheme, "targets": ["Linear"], "ignore": []}}}  # experts too
    data = torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(1))
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=2, progress=False)
    (expected,) = gptq_quantize([original], _head_hessian(model, data, 2), args=resolve_scheme(scheme, ["Linear"]).weights)
    assert torch.equal(model.lm_head.weight, expected.weight)


@pytest.mark.parametrize(
    "stage",
    [
        {"GPTQModifier": {"scheme": W4G16, "targets": ["Linear"], "ignore": []}},
        {"QuantizationModifier": {"scheme": W4G16, "targets": ["Linear"], "ignore": []}},  # data-free
    ],
    ids=["gptq", "rtn"],
)
def test_a_head_tied_to_the_embedding_is_untied_and_quantized_leaving_the_embedding(tmp_path, stage, caplog) -> None:
    """llm-compressor's quantizers untie a tied head they target (``untie_word_embeddings``): so do ours, saying so in
    one line; the embedding keeps its float values, the head is quantized (GPTQ: on its inputs, as an untied model's
    head), the saved config says ``tie_word_embeddings: false``, and the reload gives the in-memory logits."""
    model = llama(layers=2, hidden=64, heads=4, kv_heads=2)  # tied, as SmolLM2
    embedding = model.model.embed_tokens.weight.detach().clone()
    with caplog.at_level("INFO", logger="llmc_fsm_quantization._base"):
        llmc_fsm.oneshot(model=model, recipe={"q": stage}, dataset=DATA, batch_size=4, output_dir=tmp_path / "out",
                         progress=False)  # fmt: skip
    name = next(iter(stage))
    assert [r.getMessage() for r in caplog.records if "untied" in r.getMessage()] == [
        f"{name}: the head lm_head is tied to the input embedding: untied (its own copy of the weight; config "
        "tie_word_embeddings false) so that quantizing it leaves the embedding as it is (as llm-compressor)"
    ]
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    assert model.lm_head.weight is not model.model.embed_tokens.weight and hasattr(model.lm_head, "weight_scale")
    assert not torch.equal(model.lm_head.weight, embedding)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and "lm_head" not in config["quantization_config"]["ignore"]
    reloaded = _load(tmp_path / "out")
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(x).logits, reloaded(x).logits)
