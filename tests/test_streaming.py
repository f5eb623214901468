"""``oneshot(low_memory=True)``: one decoder layer in memory at a time, same output as the in-memory run.

Each test writes a tiny Llama (3 decoder layers, a word-level tokenizer trained on
the first lines of tinyshakespeare) to a temporary directory with
``save_pretrained``, runs the in-memory one-shot job and the streamed one on the
same recipe and data, and compares what they wrote, tensor by tensor, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_llama
import torch
from safetensors import safe_open

import llmc_fsm
from llmc_fsm.models.lazy import load_lazy
from llmc_fsm.toolkit.heap import limit_heap_growth

GPTQ_G16 = {"q": {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}}}}
SPARSEGPT = {"s": {"SparseGPTModifier": {"sparsity": 0.5}}}
SIZES = {"num_calibration_samples": 8, "max_seq_length": 32, "num_eval_windows": 4, "batch_size": 4}


@pytest.fixture(autouse=True)
def _keep_the_allocator(monkeypatch):
    """A low_memory run fixes glibc's mmap threshold for the whole process; spare the rest of the test session."""
    monkeypatch.setattr("llmc_fsm.oneshot_job.streaming.limit_heap_growth", lambda: False)  # where it is called


@pytest.fixture(autouse=True)
def _measure_both_perplexities(monkeypatch):
    """Each run measures its dense perplexity (the streamed run would otherwise reuse the in-memory one from the
    cache, tests/test_cli_streaming_default.py): the values are compared, not read back."""
    monkeypatch.setenv("LLMC_FSM_PERPLEXITY_CACHE", "off")


@pytest.fixture(scope="module")
def text_file(shared_data, tmp_path_factory) -> Path:
    lines = (shared_data / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8").splitlines()[:600]
    path = tmp_path_factory.mktemp("text") / "shakespeare.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _build(directory: Path, text: Path, *, shard: str | None = None, dtype: torch.dtype = torch.float32) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(text.read_text().splitlines(), trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    model = tiny_llama.llama(vocab=tok.get_vocab_size(), layers=3).to(dtype)
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def sharded_dir(text_file, tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("src") / "tiny", text_file, shard="200KB")


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            out.update({key: handle.get_tensor(key) for key in handle.keys()})
    return out


def _both(src: Path, tmp_path: Path, recipe: dict, **kw) -> tuple[Path, Path, torch.nn.Module]:
    """The in-memory and the streamed run on the same inputs; returns their output dirs and the streamed model."""
    llmc_fsm.oneshot(str(src), recipe, output_dir=tmp_path / "mem", progress=False, **kw)
    streamed = llmc_fsm.oneshot(str(src), recipe, output_dir=tmp_path / "low", progress=False, low_memory=True, **kw)
    return tmp_path / "mem", tmp_path / "low", streamed


def _assert_same_output(mem: Path, low: Path) -> None:
    a, b = _tensors(mem), _tensors(low)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    for name in ("config.json", "generation_config.json", "recipe.yaml", "tokenizer.json"):
        assert (mem / name).read_text() == (low / name).read_text(), name
    index = json.loads((low / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in b.values())
    assert set(index["weight_map"]) == set(b)
    shards = [f"model-0000{k}-of-00004.safetensors" for k in (1, 2, 3, 4)]  # the outer tensors, then one per layer
    assert sorted(p.name for p in low.glob("*.safetensors")) == shards
    ra, rb = (json.loads((d / "report.json").read_text()) for d in (mem, low))
    for key in ("model", "recipe", "calibration", "eval", "perplexity", "sparsity"):
        assert ra[key] == rb[key], key


def test_sparsegpt_streamed_from_a_sharded_checkpoint_equals_in_memory(sharded_dir, text_file, tmp_path):
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    mem, low, model = _both(sharded_dir, tmp_path, SPARSEGPT, dataset=text_file, eval_text=text_file, **SIZES)
    _assert_same_output(mem, low)
    report = model.llmc_fsm_report
    assert report.total_sparsity == 0.5
    assert report.ppl_before is not None and report.ppl_after is not None and report.ppl_after != report.ppl_before
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert not list(tmp_path.glob(".*"))  # no work directory left


def test_gptq_w4a16_streamed_equals_in_memory_and_loads_with_from_pretrained(sharded_dir, text_file, tmp_path):
    from transformers import AutoModelForCausalLM

    mem, low, model = _both(sharded_dir, tmp_path, GPTQ_G16, dataset=text_file, eval_text=text_file, **SIZES)
    _assert_same_output(mem, low)
    config = json.loads((low / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    assert "model.layers.0.self_attn.q_proj.weight_packed" in _tensors(low)
    a = AutoModelForCausalLM.from_pretrained(mem).state_dict()
    b = AutoModelForCausalLM.from_pretrained(low).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {m.bits for m in model.llmc_fsm_report.modules if m.layer is not None} == {4}


def test_smoothquant_then_gptq_streamed_equals_in_memory(sharded_dir, text_file, tmp_path):
    # a stage of smoothing and CalibratedModifiers calibrates each layer in the grouped order on both paths: the
    # in-memory one used the plain order and gave other GPTQ weights (410 of 482 tensors on SmolLM2)
    recipe = {
        "quant_stage": {
            "quant_modifiers": {
                "SmoothQuantModifier": {"smoothing_strength": 0.8},
                "GPTQModifier": {"targets": "Linear", "scheme": "W8A8", "ignore": ["lm_head"]},
            }
        }
    }
    mem, low, _ = _both(sharded_dir, tmp_path, recipe, dataset=text_file, **SIZES)
    a, b = _tensors(mem), _tensors(low)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.layers.1.self_attn.q_proj.weight"].dtype == torch.int8


def test_data_free_rtn_and_a_bf16_checkpoint_stream_like_in_memory(text_file, tmp_path):
    src = _build(tmp_path / "bf16", text_file, dtype=torch.bfloat16)
    recipe = {"q": {"QuantizationModifier": {"scheme": "W8A8"}}}
    mem, low, _ = _both(src, tmp_path, recipe, max_seq_length=32)
    _assert_same_output(mem, low)
    assert json.loads((low / "report.json").read_text())["calibration"]["num_samples"] == 0
    assert _tensors(low)["model.embed_tokens.weight"].dtype == torch.float32  # upcast like from_pretrained


def test_only_one_decoder_layer_is_materialized_at_a_time(sharded_dir, text_file):
    from llmc_fsm.models.lazy import ShardWriter
    from llmc_fsm.pipeline.streaming import compress_streaming
    from llmc_fsm.session.session import Session

    lazy, _ = load_lazy(sharded_dir)
    seen = []

    def count(module, args):
        real = [i for i, layer in enumerate(lazy.layers) if any(p.device.type != "meta" for p in layer.parameters())]
        outer = {lazy.tensor(n).device.type for n in lazy.outer_names()}
        seen.append((real, outer))

    for layer in lazy.layers:
        layer.register_forward_pre_hook(count)
    session = Session(SPARSEGPT)
    windows = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    session.initialize(model=lazy.model, calibration_data=windows)
    out = Path(text_file).parent / "out"
    out.mkdir()
    compress_streaming(session, lazy, windows, ShardWriter(out, 4), batch_size=2, progress=False)
    session.finalize()
    captured = [entry for entry in seen if not entry[0]]  # the forwards that capture layer 0's inputs
    assert captured == [([], {"cpu"})] * 2  # two batches of 2 windows, outside tensors read, no layer
    calls = [entry for entry in seen if entry[0]]
    assert all(len(real) == 1 and outer == {"meta"} for real, outer in calls)
    assert sorted({real[0] for real, _ in calls}) == [0, 1, 2]
    assert {p.device.type for p in lazy.model.parameters()} == {"meta"}


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"recipe": SPARSEGPT}, "pass output_dir (--output)"),
        (
            {"recipe": {"m": {"MagnitudePruningModifier": {"sparsity": 0.5}}}, "output": True},
            "MagnitudePruningModifier acts on the whole model at once",
        ),
        ({"recipe": SPARSEGPT, "output": True, "dataset": None}, "pass a calibration dataset (dataset=, --dataset)"),
        (
            {"recipe": {**SPARSEGPT, **GPTQ_G16}, "output": True, "fuse_stages": False},
            "pass fuse_stages=True (--fuse-stages)",
        ),
    ],
)
def test_jobs_low_memory_cannot_run_fail_before_reading_weights(sharded_dir, text_file, tmp_path, kw, message):
    kw = {"dataset": text_file, **kw}
    out = tmp_path / "o" if kw.pop("output", False) else None
    with pytest.raises(ValueError, match=r"^low_memory \(--low-memory\) cannot run this job: ") as err:
        llmc_fsm.oneshot(str(sharded_dir), output_dir=out, progress=False, low_memory=True, max_seq_length=32, **kw)
    assert message in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_in_memory_model_and_unsupported_checkpoints_are_refused(sharded_dir, text_file, tmp_path):
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(sharded_dir)
    with pytest.raises(ValueError, match="pass a model directory or a known model name, not a loaded model"):
        llmc_fsm.oneshot(
            model,
            SPARSEGPT,
            torch.zeros(2, 8, dtype=torch.long),
            output_dir=tmp_path / "o",
            progress=False,
            low_memory=True,
        )
    bin_dir = tmp_path / "bin"  # weights in PyTorch's pickle format: only from_pretrained can read them
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((sharded_dir / "config.json").read_text())
    torch.save(model.state_dict(), bin_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"low_memory reads safetensors weights .* holds pytorch_model\.bin"):
        load_lazy(bin_dir)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((sharded_dir / "config.json").read_text())
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    state.pop("lm_head.weight")
    save_file(state, str(partial / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"does not match the model its config.json describes \(missing "
        r"model\.layers\.1\.mlp\.up_proj\.weight\)",
    ):
        load_lazy(partial)


def test_cli_low_memory(sharded_dir, text_file, tmp_path, capsys):
    from llmc_fsm.cli import main

    args = [
        "oneshot",
        "--model",
        str(sharded_dir),
        "--dataset",
        str(text_file),
        "--num-samples",
        "4",
        "--seq-len",
        "32",
        "--no-progress",
        "--low-memory",
    ]
    assert main([*args, "--output", str(tmp_path / "o")]) == 0
    assert "total" in capsys.readouterr().out
    assert (tmp_path / "o" / "model.safetensors.index.json").is_file()
    assert main(args) != 0
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "low_memory (--low-memory) cannot run this job: it writes the compressed model layer by layer "
        "and keeps none of it in memory: pass output_dir (--output)"
    )
    assert "\n" not in err and "Traceback" not in err


def test_a_user_set_mmap_threshold_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")
    assert limit_heap_growth() is False


def test_trim_heap_gives_free_heap_pages_back():
    import platform

    from llmc_fsm.toolkit.heap import trim_heap

    if platform.libc_ver()[0] != "glibc":
        assert trim_heap() is False
        return
    blocks = [bytearray(64 * 1024) for _ in range(2000)]  # ~125 MiB of heap blocks (below the mmap threshold)
    pin = bytearray(64 * 1024)  # above them: freeing the blocks leaves free pages inside the heap, not at its top
    del blocks
    assert trim_heap() is True  # malloc_trim(0) returns 1 when it gave pages back
    del pin


def test_the_cli_fuses_stages_for_a_low_memory_run_of_several_stages(tiny_model_dir, tmp_path, capsys):
    import tiny_llama

    from llmc_fsm.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "a:\n  SparseGPTModifier: {sparsity: 0.5}\nb:\n  WandaPruningModifier: {sparsity: 0.6}\n", encoding="utf-8"
    )
    argv = tiny_llama.oneshot_argv(*tiny_model_dir, tmp_path / "o", "--recipe", str(recipe), "--low-memory")
    assert main(argv) == 1
    assert "pass fuse_stages=True (--fuse-stages)" in capsys.readouterr().err
    assert main([*argv, "--fuse-stages"]) == 0  # the one-pass run the message asks for
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert [stage["applied"] for stage in report["recipe"].values()] == [True, True]


@pytest.mark.parametrize("raised", [KeyboardInterrupt, ValueError])
def test_an_interruption_inside_a_materialized_layer_is_what_is_raised(tmp_path, monkeypatch, raised):
    """A breaker's case: SIGTERM inside GPTQ's sweep of fused experts (streamed) left a tensor its traceback held,
    putting it back on ``meta`` failed (``torch.utils.swap_tensors``: "Expected use_count ..."), and that
    RuntimeError replaced the interruption: exit 1 and the kept progress deleted instead of exit 143. The release
    on the way out now skips such a tensor; a failed release with no exception in flight still raises."""
    import llmc_fsm.models.lazy as lazy_module

    tiny_llama.llama(vocab=64, hidden=32, layers=2).save_pretrained(tmp_path / "m")
    lazy, _ = load_lazy(tmp_path / "m")
    names = lazy.layer_names(0)
    real = lazy_module._swap

    def refusing(target, value):  # as swap_tensors refuses a tensor something else still references
        if value.device.type == "meta" and target is lazy.tensor(names[0]):
            raise RuntimeError("Expected use_count of t1 to be 1 or 2 with an AccumulateGrad node but got 2")
        real(target, value)

    monkeypatch.setattr(lazy_module, "_swap", refusing)
    with pytest.raises(raised), lazy.materialized(names):
        raise raised
    assert lazy.tensor(names[0]).device.type != "meta"  # kept its values
    assert all(lazy.tensor(n).device.type == "meta" for n in names[1:])  # the others released
    with pytest.raises(RuntimeError, match="Expected use_count"), lazy.materialized(names):
        pass


def test_a_hybrid_stacks_second_layer_class_is_compressed_in_its_own_order_when_streamed(tmp_path):
    """B1's case (session 30): the streamed path recorded the call order of layer 0 only and gave it to every layer,
    so OLMo-Hybrid's full-attention layer (after three linear-attention layers) was compressed in another order than
    in memory: its o_proj and MLP weights differed (2-3% of the mask, logits 0.25 apart). Each class's first layer
    is recorded, as in memory: the same tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from tiny_families import _TEXT

    config = AutoConfig.for_model("olmo_hybrid", **_TEXT, layer_types=["linear_attention"] * 3 + ["full_attention"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "olmo_hybrid")
    data = torch.randint(3, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    recipe = {"s": {"SparseGPTModifier": {"sparsity": 0.5, "ignore": ["lm_head"]}}}
    mem, low, _ = _both(tmp_path / "olmo_hybrid", tmp_path, recipe, dataset=data)
    a, b = _tensors(mem), _tensors(low)
    assert sorted(a) == sorted(b) and "model.layers.3.self_attn.o_proj.weight" in a
    assert [key for key in a if not torch.equal(a[key], b[key])] == []


@pytest.mark.parametrize(("family", "extra"), [("gemma2", {}), ("cohere", {}), ("llama", {})])
def test_the_streamed_perplexity_of_logits_changed_after_the_head_equals_in_memory(tmp_path, family, extra):
    """Gemma 2 soft-caps its logits, Cohere scales them: perplexity() saw they are not the head's projection and
    called the model a second time, which in the streamed evaluation took the next window's replayed states (the
    last window found none: a StopIteration traceback, the CLI's default path). Llama: the projection path."""
    from tiny_families import build

    from llmc_fsm.data.protocol import perplexity
    from llmc_fsm.pipeline.streaming import streamed_states, tail_perplexity

    model = build(family)
    model.save_pretrained(tmp_path)
    windows = torch.randint(3, 128, (3, 16), generator=torch.Generator().manual_seed(0))
    expected = perplexity(model, windows)
    lazy, _ = load_lazy(tmp_path)
    states, as_tuple = streamed_states(lazy, windows)
    assert tail_perplexity(lazy, windows, states, as_tuple) == expected


def test_logits_are_projection_tells_the_models_that_change_their_logits_after_the_head():
    from tiny_families import build

    from llmc_fsm.data.protocol import logits_are_projection

    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    assert [logits_are_projection(build(f), ids) for f in ("llama", "gemma2", "cohere")] == [True, False, False]
