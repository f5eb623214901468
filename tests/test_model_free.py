"""``llmc_fsm.model_free_ptq`` (llm-compressor's ``model_free_ptq``): data-free quantization shard by shard.

The reference for what it writes is ``llmc_fsm.oneshot`` with the equivalent data-free recipe on the same
directory: the same tensors, key for key and bit for bit, and the same reloaded logits.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import llmc_fsm
from llmc_fsm import ModifierError, model_free_ptq, oneshot
from tiny_llama import llama

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _checkpoint(directory: Path, *, hidden: int = 64, shard: str | None = "60KB", tied: bool = False) -> Path:
    model = llama(hidden=hidden, tied=tied, kv_heads=4).to(torch.bfloat16)
    if shard is None:
        model.save_pretrained(directory)
    else:
        model.save_pretrained(directory, max_shard_size=shard)
    return directory


@contextlib.contextmanager
def safe_open_tensors(directory: Path):
    """The tensors of ``directory/model.safetensors`` as a dict to change; written back (index too) on exit."""
    tensors = load_file(directory / "model.safetensors")
    yield tensors
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _reloaded_logits(directory: Path, family: str | None = None) -> torch.Tensor:
    import transformers

    import tiny_families

    name = (tiny_families.FAMILIES[family][2] if family else None) or "AutoModelForCausalLM"
    model = getattr(transformers, name).from_pretrained(directory).eval()
    with torch.no_grad():
        return model(torch.arange(24).unsqueeze(0)).logits


@pytest.mark.parametrize(
    ("scheme", "hidden"),
    [("W8A8", 64), ("FP8_DYNAMIC", 64), ("NVFP4A16", 64), ("MXFP4A16", 64), ("FP8_BLOCK", 128), ("W4A16", 128)],
)
def test_each_shard_is_written_as_oneshot_writes_the_model(tmp_path, scheme, hidden):
    source = _checkpoint(tmp_path / "src", hidden=hidden, shard=f"{hidden - 4}KB")
    assert len(list(source.glob("*.safetensors"))) > 2  # the layers' weights lie in several shards
    model_free_ptq(source, tmp_path / "free", scheme=scheme, ignore=["lm_head"], progress=False)
    recipe = {"stage": {"QuantizationModifier": {"targets": ["Linear"], "scheme": scheme, "ignore": ["lm_head"]}}}
    oneshot(model=str(source), recipe=recipe, output_dir=str(tmp_path / "oneshot"), dtype=torch.bfloat16)

    free, reference = _tensors(tmp_path / "free"), _tensors(tmp_path / "oneshot")
    assert sorted(free) == sorted(reference)
    assert all(torch.equal(free[k], reference[k]) for k in free)
    assert any(k.endswith(("weight_packed", "weight_scale")) for k in free)
    config = json.loads((tmp_path / "free" / "config.json").read_text())["quantization_config"]
    expected = json.loads((tmp_path / "oneshot" / "config.json").read_text())["quantization_config"]
    assert config == expected
    assert torch.equal(_reloaded_logits(tmp_path / "free"), _reloaded_logits(tmp_path / "oneshot"))
    index = json.loads((tmp_path / "free" / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(index) == sorted(free)
    assert (tmp_path / "free" / "recipe.yaml").read_text().startswith("model_free_stage:")


def test_nvfp4_siblings_in_other_shards_share_one_global_scale(tmp_path):
    source = _checkpoint(tmp_path / "src", shard="10KB")
    source_map = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    split = {source_map[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"}
    assert len(split) > 1  # the siblings were saved in different shards
    model_free_ptq(source, tmp_path / "free", scheme="NVFP4A16", ignore=["lm_head"], progress=False)
    index = json.loads((tmp_path / "free" / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = _tensors(tmp_path / "free")
    for parent, names in (("self_attn", "qkv"), ("mlp", ("gate", "up"))):
        keys = [f"model.layers.0.{parent}.{n}_proj.weight_global_scale" for n in names]
        assert len({index[k] for k in keys}) == 1  # read and written together
        names = [k.removesuffix("_global_scale") for k in keys]
        weights = [load_file(source / source_map[n])[n] for n in names]
        amax = max(w.abs().max() for w in weights)  # bfloat16, the weights' dtype
        expected = (448.0 * 6.0) / amax  # FP8 E4M3 max x FP4 E2M1 max over the set's max |w|, in bfloat16
        for key in keys:  # (compressed-tensors' generate_gparam computes in the weights' dtype), stored float32
            assert tensors[key].dtype == torch.float32
            assert torch.equal(tensors[key], expected.reshape(1).float())


def test_without_ignore_lm_head_stays_dense_and_an_embedding_is_never_a_linear(tmp_path, caplog):
    source = _checkpoint(tmp_path / "src", shard=None)
    with caplog.at_level(logging.INFO):
        model_free_ptq(source, tmp_path / "free", scheme="W8A8", progress=False)
    tensors = _tensors(tmp_path / "free")
    assert "lm_head.weight" in tensors and "lm_head.weight_scale" not in tensors
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert "model.embed_tokens.weight_scale" not in tensors
    assert "14 Linear weights quantized, 1 left as they were, in 1 shards" in caplog.text
    config = json.loads((tmp_path / "free" / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["lm_head"]


def test_max_workers_is_taken_with_a_warning_line(tmp_path, caplog):
    """llm-compressor's ``max_workers``: taken, said in a warning line (an INFO line before, invisible by default,
    where docs/oneshot.md promises a line; found by a tester)."""
    source = _checkpoint(tmp_path / "src", shard=None)
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.oneshot_job.model_free"):
        model_free_ptq(source, tmp_path / "free", scheme="W8A8", ignore=["lm_head"], max_workers=4, progress=False,
                       dtype="bf16")  # oneshot's short dtype spellings too (refused here before: a tester)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "model_free_ptq: shards are processed one at a time (max_workers=4 has no effect)"
    ]


def _made_up_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    directory.mkdir()
    torch.manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(32, 16),
        "model.blocks.0.proj.weight": torch.randn(8, 16),
        "model.blocks.0.proj.bias": torch.randn(8),
        "model.blocks.0.norm.weight": torch.randn(16),
        "model.final_norm.weight": torch.randn(16),
    }
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"model_type": "made_up_arch", "architectures": ["MadeUpForCausalLM"], "hidden_size": 16}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text("{}")
    return tensors


def test_an_architecture_transformers_does_not_know_is_quantized_by_tensor_names(tmp_path, caplog):
    original = _made_up_checkpoint(tmp_path / "src")
    with caplog.at_level(logging.WARNING):
        model_free_ptq(
            tmp_path / "src", tmp_path / "free", scheme="W8A8", ignore=["model.embed_tokens"], progress=False
        )
    assert "transformers cannot build this model" in caplog.text
    out = _tensors(tmp_path / "free")
    assert sorted(out) == [
        "model.blocks.0.norm.weight",
        "model.blocks.0.proj.bias",
        "model.blocks.0.proj.weight",
        "model.blocks.0.proj.weight_scale",
        "model.embed_tokens.weight",
        "model.final_norm.weight",
    ]
    w = original["model.blocks.0.proj.weight"]
    scale = w.abs().amax(dim=1, keepdim=True) / 127.5  # int8 per output channel, symmetric: range 255 / 2
    assert torch.equal(out["model.blocks.0.proj.weight_scale"], scale)
    assert torch.equal(out["model.blocks.0.proj.weight"], torch.clamp(torch.round(w / scale), -128, 127).to(torch.int8))
    for key in ("model.embed_tokens.weight", "model.blocks.0.norm.weight", "model.blocks.0.proj.bias"):
        assert torch.equal(out[key], original[key])
    assert (tmp_path / "free" / "tokenizer.json").read_text() == "{}"


def test_a_checkpoint_stored_in_block_fp8_is_dequantized_by_the_converter_first(tmp_path):
    from compressed_tensors.entrypoints.convert import FP8BlockDequantizer

    source = _checkpoint(tmp_path / "src", hidden=128, shard=None)
    dense = load_file(source / "model.safetensors")
    stored, dequantized = {}, {}
    for key, value in dense.items():
        if key.endswith("_proj.weight"):  # DeepSeek's block FP8: fp8 weight, float32 scale per 128 x 128 block
            blocks = value.float().reshape(value.shape[0] // 128, 128, value.shape[1] // 128, 128)
            scale_inv = blocks.abs().amax(dim=(1, 3)) / 448.0
            fp8 = (blocks / scale_inv[:, None, :, None]).reshape(value.shape).to(torch.float8_e4m3fn)
            stored[key], stored[key + "_scale_inv"] = fp8, scale_inv
            expanded = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
            dequantized[key] = (fp8.float() * expanded).to(torch.bfloat16)
        else:
            stored[key] = dequantized[key] = value
    fp8_dir = tmp_path / "fp8"
    fp8_dir.mkdir()
    save_file(stored, str(fp8_dir / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    save_file(dequantized, str(plain_dir / "model.safetensors"))
    (plain_dir / "config.json").write_text((source / "config.json").read_text())

    converter = FP8BlockDequantizer(targets=[r"re:.*_proj$"])
    model_free_ptq(fp8_dir, tmp_path / "free", scheme="W8A8", ignore=["lm_head"], converter=converter, progress=False)
    model_free_ptq(plain_dir, tmp_path / "reference", scheme="W8A8", ignore=["lm_head"], progress=False)
    free, reference = _tensors(tmp_path / "free"), _tensors(tmp_path / "reference")
    assert sorted(free) == sorted(reference)
    assert all(torch.equal(free[k], reference[k]) for k in free)
    config = json.loads((tmp_path / "free" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and "weight_block_size" not in config
    assert torch.equal(_reloaded_logits(tmp_path / "free"), _reloaded_logits(tmp_path / "reference"))


def _refused(tmp_path, error, message, **kwargs):
    source = kwargs.pop("source", None) or _checkpoint(tmp_path / "src", shard=None)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(error) as info:
        model_free_ptq(source, tmp_path / "out", progress=False, **kwargs)
    assert str(info.value) == message
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no work directory


def test_scheme_and_config_together_or_neither_are_refused(tmp_path):
    message = "model_free_ptq: give exactly one of scheme and config"
    _refused(tmp_path, ValueError, message, scheme="W8A8", config={"config_groups": {}})
    _refused(tmp_path, ValueError, message)


_NEEDS_DATA = "model_free_ptq runs no calibration: QuantizationModifier needs calibration data for "


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scheme": "FP8"}, _NEEDS_DATA + "static input-activation scales; use a scheme with dynamic activations "
         "(FP8_DYNAMIC, W8A8), or run llmc_fsm.oneshot with a dataset"),
        ({"scheme": {"weights": {"num_bits": 4, "observer": "imatrix_mse", "strategy": "group", "group_size": 32}}},
         _NEEDS_DATA + "the imatrix_mse observer (it weighs each weight's error by its input's mean square); use "
         "another observer (minmax, mse), or run llmc_fsm.oneshot with a dataset"),
        ({"scheme": "NVFP4"}, _NEEDS_DATA + "the per-module input_global_scale of NVFP4's activations (their group "
         "scales are dynamic, the global scale above them is calibrated from each Linear's inputs); use NVFP4A16 "
         "(NVFP4 weights, activations not quantized), or run llmc_fsm.oneshot with a dataset"),
    ],
)
def test_a_scheme_that_needs_calibration_data_is_refused_naming_what_needs_it(tmp_path, kwargs, message):
    """NVFP4 was refused as needing "static activation scales, a kv_cache_scheme or an imatrix_mse observer" with
    the advice to use dynamic activations, which NVFP4's are (found by a tester): the per-module input global
    scale is what needs data, and NVFP4A16 is the data-free alternative."""
    _refused(tmp_path, ValueError, message, **kwargs)


def test_a_kv_cache_scheme_is_refused(tmp_path):
    config = {
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8}}},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
    }
    message = (
        "model_free_ptq: kv_cache_scheme needs the key and value activations of calibration data; run "
        "llmc_fsm.oneshot with a dataset"
    )
    _refused(tmp_path, ValueError, message, config=config)


def test_a_group_size_that_does_not_divide_is_refused_before_any_output(tmp_path):
    with pytest.raises(ModifierError, match=r"in_features 64 is not a multiple of group_size 128"):
        model_free_ptq(_checkpoint(tmp_path / "src"), tmp_path / "out", scheme="W4A16", progress=False)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_targets_that_match_nothing_are_refused_by_the_modifier_on_the_checkpoint_names(tmp_path):
    scheme = {"targets": ["re:.*does_not_exist$"], "weights": {"num_bits": 8}}
    with pytest.raises(ModifierError, match=r"select no module with a Linear-like weight in CheckpointLinears"):
        model_free_ptq(_checkpoint(tmp_path / "src", shard=None), tmp_path / "out", scheme=scheme, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_targeted_fused_experts_of_three_dimensions_are_refused(tmp_path):
    source = tmp_path / "src"
    _made_up_checkpoint(source)
    tensors = load_file(source / "model.safetensors")
    tensors["model.blocks.0.experts.gate_up_proj"] = torch.zeros(4, 16, 32)
    save_file(tensors, str(source / "model.safetensors"))
    message = (
        "model_free_ptq quantizes 2-D Linear weights; these targeted tensors are fused experts of three dimensions: "
        "model.blocks.0.experts.gate_up_proj [4, 16, 32]; add their modules to ignore, or run llmc_fsm.oneshot on "
        "the directory, which quantizes the fused experts of the families docs/architectures.md lists per expert "
        "(not GPT-OSS's nor DBRX's)"
    )
    _refused(tmp_path, ValueError, message, source=source, scheme="W8A8", ignore=["model.embed_tokens"])
    scheme = {"targets": [r"re:.*\.proj$"], "weights": {"num_bits": 8, "strategy": "channel"}}  # not the experts
    model_free_ptq(source, tmp_path / "out", scheme=scheme, progress=False)
    out = _tensors(tmp_path / "out")
    assert torch.equal(out["model.blocks.0.experts.gate_up_proj"], tensors["model.blocks.0.experts.gate_up_proj"])
    assert "model.blocks.0.proj.weight_scale" in out


def test_a_device_torch_does_not_know_is_refused(tmp_path):
    message = "model_free_ptq: device 'nope' is not a torch device; give 'cpu' or 'cuda:N' (or leave it out)"
    _refused(tmp_path, ValueError, message, scheme="W8A8", device="nope")


def test_several_devices_are_refused(tmp_path):
    message = (
        "model_free_ptq: device=['cpu', 'cpu']: several devices (llm-compressor's multi-GPU shard scheduling) are not "
        "supported; give one device"
    )
    _refused(tmp_path, ValueError, message, scheme="W8A8", device=["cpu", "cpu"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA; this one has it")
def test_a_cuda_device_without_cuda_is_refused(tmp_path):
    message = "model_free_ptq: device 'cuda:0': torch sees no CUDA device; leave device out to run on the CPU"
    _refused(tmp_path, RuntimeError, message, scheme="W8A8", device="cuda:0")


def test_an_existing_output_is_kept_without_overwrite(tmp_path):
    source = _checkpoint(tmp_path / "src", shard=None)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="exists and holds other files .not a model directory"):
        model_free_ptq(source, tmp_path / "out", scheme="W8A8", progress=False)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]


def test_a_failure_while_writing_leaves_no_output(tmp_path, monkeypatch):
    import llmc_fsm.oneshot_job.model_free as model_free

    source = _checkpoint(tmp_path / "src", shard="60KB")
    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr("safetensors.torch.save_file", failing_save)
    with pytest.raises(OSError, match="No space left on device"):
        model_free.model_free_ptq(source, tmp_path / "out", scheme="W8A8", progress=False)
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


_W4A16_G16 = {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group", "group_size": 16, "type": "int"}}


@pytest.mark.parametrize(
    ("family", "scheme"),
    [
        ("mixtral", _W4A16_G16),  # the router block_sparse_moe.gate loads into mlp.gate, not a Linear: kept
        ("qwen3_moe", _W4A16_G16),  # per-expert checkpoint weights of fused experts: quantized per expert
        ("gpt_bigcode", _W4A16_G16),  # attn.c_proj's init reads its weight: int-quantized, not packed
        ("falcon", "W8A8"),  # tied lm_head (not in the checkpoint): listed under ignore for the reload
        ("mamba2", "W8A8"),  # conv1d.weight has three dimensions: a convolution, left as stored
    ],
)
def test_families_are_written_as_oneshot_writes_them(tmp_path, family, scheme):
    import tiny_families

    tiny_families.build(family).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    model_free_ptq(tmp_path / "src", tmp_path / "free", scheme=scheme, ignore=["lm_head"], progress=False)
    group = {"targets": ["Linear"], "scheme": scheme} if isinstance(scheme, str) else {"config_groups": {"g": scheme}}
    recipe = {"stage": {"QuantizationModifier": {**group, "ignore": ["lm_head"]}}}
    oneshot(model=str(tmp_path / "src"), recipe=recipe, output_dir=str(tmp_path / "oneshot"), dtype=torch.bfloat16)
    free, reference = _tensors(tmp_path / "free"), _tensors(tmp_path / "oneshot")
    assert sorted(free) == sorted(reference)
    assert all(torch.equal(free[k], reference[k]) for k in free)
    assert torch.equal(_reloaded_logits(tmp_path / "free"), _reloaded_logits(tmp_path / "oneshot"))


def test_fp8_block_experts_of_one_block_get_no_reload_warning_and_reload(tmp_path, caplog):
    """FP8_BLOCK on fused experts always warned "transformers X will not reload this checkpoint into its fused
    experts", also for expert matrices of one 128x128 block, whose scale broadcasts and which transformers reloads
    (found by a tester)."""
    import tiny_families

    model = tiny_families.build("qwen3_moe", hidden_size=128, moe_intermediate_size=128, head_dim=32,
                                num_hidden_layers=2).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "src")
    with caplog.at_level(logging.WARNING):
        model_free_ptq(tmp_path / "src", tmp_path / "free", scheme="FP8_BLOCK", ignore=["lm_head", "re:.*mlp.gate$"],
                       progress=False)
    assert [r.getMessage() for r in caplog.records if "will not reload" in r.getMessage()] == []
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "free", output_loading_info=True)
    assert (sorted(info["missing_keys"]), sorted(info["unexpected_keys"])) == ([], [])
    tensors = _tensors(tmp_path / "free")
    experts = reloaded.model.layers[1].mlp.experts
    expected = tensors["model.layers.1.mlp.experts.2.down_proj.weight"].float() * tensors[
        "model.layers.1.mlp.experts.2.down_proj.weight_scale"].float()
    assert torch.equal(experts.down_proj[2], expected.to(torch.bfloat16))


def test_a_scheme_transformers_cannot_reload_into_fused_experts_is_written_for_vllm_with_a_warning(tmp_path, caplog):
    import tiny_families

    tiny_families.build("qwen3_moe").to(torch.bfloat16).save_pretrained(tmp_path / "src")
    with caplog.at_level(logging.WARNING):
        model_free_ptq(tmp_path / "src", tmp_path / "free", scheme="NVFP4A16", ignore=["lm_head"], progress=False)
    assert (
        "model_free_ptq: 48 expert matrices of fused experts (e.g. model.layers.0.mlp.experts.0.down_proj) are "
        "quantized per expert, as vLLM reads them; transformers "
    ) in caplog.text
    assert "will not reload this checkpoint into its fused experts: NVFP4 weights:" in caplog.text
    tensors = _tensors(tmp_path / "free")
    assert "model.layers.0.mlp.experts.3.up_proj.weight_global_scale" in tensors


def test_a_checkpoint_of_conv1d_weights_only_is_refused(tmp_path):
    import tiny_families

    tiny_families.build("gpt2").to(torch.bfloat16).save_pretrained(tmp_path / "src")
    message = (
        "model_free_ptq: the checkpoint holds no Linear weight (a 2-D '<module>.weight' of an nn.Linear module); its "
        "2-D weights (transformer.h.0.attn.c_attn.weight, transformer.h.0.attn.c_proj.weight, "
        "transformer.h.0.mlp.c_fc.weight ...) belong to other module classes (GPT-2's Conv1D stores its weight "
        "transposed): run llmc_fsm.oneshot on the directory"
    )
    _refused(tmp_path, ValueError, message, source=tmp_path / "src", scheme="W8A8")


def test_ignore_given_empty_quantizes_lm_head_as_llm_compressor_does(tmp_path):
    source = _checkpoint(tmp_path / "src", shard=None)
    model_free_ptq(source, tmp_path / "free", scheme="W8A8", ignore=[], progress=False)
    tensors = _tensors(tmp_path / "free")
    assert "lm_head.weight_scale" in tensors
    assert json.loads((tmp_path / "free" / "config.json").read_text())["quantization_config"]["ignore"] == []


def test_packed_fp4_of_a_class_whose_init_reads_its_weight_is_warned_by_both_jobs(tmp_path, caplog):
    """Falcon's FalconLinear: transformers' _init_weights reads weight, which a packed NVFP4 module has not; no
    unpacked format holds FP4 values, so both jobs write it (vLLM reads it) and say transformers cannot reload it."""
    import tiny_families

    tiny_families.build("falcon").to(torch.bfloat16).save_pretrained(tmp_path / "src")
    recipe = {"stage": {"QuantizationModifier": {"targets": ["Linear"], "scheme": "NVFP4A16", "ignore": ["lm_head"]}}}
    tail = (
        ") are saved in a packed FP4/FP6 format (no other format holds those values): transformers 5.25 cannot "
        "reload them (this architecture's weight initialisation reads their weight, which a packed module has not); "
        "vLLM reads them"
    )
    for job in ("oneshot", "model_free"):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            if job == "oneshot":
                oneshot(
                    model=str(tmp_path / "src"), recipe=recipe, output_dir=str(tmp_path / job), dtype=torch.bfloat16
                )
            else:
                model_free_ptq(tmp_path / "src", tmp_path / job, scheme="NVFP4A16", ignore=["lm_head"], progress=False)
        lines = [r.getMessage() for r in caplog.records if tail in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("16 modules (e.g. transformer.h.0."), job
    with pytest.raises(AttributeError, match="has no attribute 'weight'"):
        _reloaded_logits(tmp_path / "model_free")


def _as_modelopt_nvfp4(source: Path, directory: Path) -> None:
    """``source`` (compressed-tensors NVFP4A16 on the MLP) rewritten in ModelOpt's NVFP4 layout, as
    nvidia/DeepSeek-R1-NVFP4 stores it: ``weight`` (uint8, two FP4 values a byte), ``weight_scale`` (FP8 per 16),
    ``weight_scale_2`` (1 / the global scale), ``input_scale``; ``quant_method: modelopt`` in config.json."""
    directory.mkdir()
    tensors = _tensors(source)
    stored = {}
    for key, value in tensors.items():
        module, _, param = key.rpartition(".")
        if param == "weight_packed":
            stored[f"{module}.weight"] = value
            stored[f"{module}.input_scale"] = torch.ones(1)
        elif param == "weight_global_scale":
            stored[f"{module}.weight_scale_2"] = 1 / value
        else:
            stored[key] = value
    save_file(stored, str(directory / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    (directory / "config.json").write_text(json.dumps(config))


def test_a_modelopt_nvfp4_checkpoint_is_converted_and_its_attention_quantized_as_deepseek_r1_example(tmp_path):
    """examples/model_free_ptq/deepseek_r1_nvfp4_fp8_block.py: ModelOptNvfp4Converter turns the MLP's ModelOpt NVFP4
    into compressed-tensors' NVFP4 (and its config group), FP8_BLOCK quantizes the attention; the config keeps both."""
    from compressed_tensors.entrypoints.convert import ModelOptNvfp4Converter

    source = _checkpoint(tmp_path / "src", hidden=128, shard=None)
    mlp_ignored = ["lm_head", r"re:.*self_attn\..*"]
    model_free_ptq(source, tmp_path / "nvfp4", scheme="NVFP4A16", ignore=mlp_ignored, progress=False)
    _as_modelopt_nvfp4(tmp_path / "nvfp4", tmp_path / "modelopt")

    mlp = r"re:.*mlp\.(gate|up|down)_proj$"
    converter = ModelOptNvfp4Converter(targets=[mlp])
    scheme = {"targets": [r"re:.*self_attn\.(q|k|v|o)_proj$"], "weights": {"num_bits": 8, "type": "float",
              "strategy": "block", "block_structure": [128, 128], "symmetric": True, "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                                    "symmetric": True, "dynamic": True}}  # fmt: skip
    model_free_ptq(tmp_path / "modelopt", tmp_path / "out", scheme=scheme, converter=converter, progress=False)

    out = _tensors(tmp_path / "out")
    converted = ModelOptNvfp4Converter(targets=[mlp]).process(load_file(tmp_path / "modelopt" / "model.safetensors"))
    for key, value in converted.items():
        if ".mlp." in key:
            assert torch.equal(out[key], value), key  # the converter's tensors, written as they are
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    groups = list(config["config_groups"].values())
    attention = [r"re:.*self_attn\.(q|k|v|o)_proj$"]  # as given: it selects exactly the modules quantized
    assert [g["targets"] for g in groups] == [[mlp], attention]
    assert groups[0]["weights"]["strategy"] == "tensor_group" and groups[1]["weights"]["strategy"] == "block"
    assert config["ignore"] == ["lm_head"]
    logits = _reloaded_logits(tmp_path / "out")
    assert torch.isfinite(logits).all()


def test_a_checkpoint_quantized_by_another_method_needs_a_converter(tmp_path):
    source = _checkpoint(tmp_path / "src", shard=None)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (source / "config.json").write_text(json.dumps(config))
    message = (
        "model_free_ptq: the checkpoint is quantized already (its config.json has a quantization_config, quant_method "
        "'fp8'); give a converter that reads that format (compressed_tensors.entrypoints.convert: FP8BlockDequantizer, "
        "ModelOptNvfp4Converter, ...), or start from the unquantized checkpoint"
    )
    _refused(tmp_path, ValueError, message, source=source, scheme="W8A8")


def test_the_rest_of_a_compressed_tensors_checkpoint_is_quantized_and_the_configs_merged(tmp_path):
    """A checkpoint whose MLP is NVFP4A16 already (compressed-tensors): its modules are left as stored (an FP8
    ``weight`` beside its scale too), the attention gets W8A8, the config keeps both groups, and the attention
    modules the first config ignored are no longer ignored."""
    source = _checkpoint(tmp_path / "src", hidden=128, shard=None)
    model_free_ptq(source, tmp_path / "half", scheme="NVFP4A16", ignore=["lm_head", r"re:.*self_attn\..*"],
                   progress=False)  # fmt: skip
    half = _tensors(tmp_path / "half")
    model_free_ptq(tmp_path / "half", tmp_path / "out", scheme="W8A8", ignore=["lm_head"], progress=False)
    out = _tensors(tmp_path / "out")
    for key, value in half.items():
        if ".mlp." in key:
            assert torch.equal(out[key], value), key
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert [g["weights"]["strategy"] for g in config["config_groups"].values()] == ["tensor_group", "channel"]
    reloaded = _reloaded_logits(tmp_path / "out")  # each module reloads into its own group (both targeted Linear)
    attention_only = tmp_path / "attention"
    model_free_ptq(source, attention_only, scheme="W8A8", ignore=["lm_head", r"re:.*mlp\..*"], progress=False)
    mlp_only = _reloaded_logits(tmp_path / "half")
    assert torch.isfinite(reloaded).all() and not torch.equal(reloaded, mlp_only)
    assert config["ignore"] == ["lm_head"]  # the first run's ignore named the attention modules: quantized now


def test_targets_the_checkpoint_config_ignores_by_pattern_are_refused_before_any_work(tmp_path):
    source = _checkpoint(tmp_path / "src", hidden=128, shard=None)
    model_free_ptq(source, tmp_path / "half", scheme="NVFP4A16", ignore=["lm_head", r"re:.*self_attn\..*"],
                   progress=False)  # fmt: skip
    config = json.loads((tmp_path / "half" / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", r"re:.*self_attn\..*"]  # as a recipe may have written it
    (tmp_path / "half" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        model_free_ptq(tmp_path / "half", tmp_path / "out", scheme="W8A8", ignore=["lm_head"], progress=False)
    assert str(info.value) == (
        "model_free_ptq: the checkpoint's quantization config ignores model.layers.{0..1}.self_attn.k_proj, "
        "model.layers.{0..1}.self_attn.o_proj, model.layers.{0..1}.self_attn.q_proj, "
        "model.layers.{0..1}.self_attn.v_proj by a pattern "
        "(re:.*self_attn\\..*), which this scheme quantizes: the merged config would leave them unquantized on "
        "reload; add them to ignore, or dequantize the checkpoint first"
    )
    assert not (tmp_path / "out").exists()


def test_the_command_writes_what_the_function_writes(tmp_path, capsys, caplog):
    from llmc_fsm.cli import main

    source = _checkpoint(tmp_path / "src", shard="60KB")
    base = ["model-free", str(source), "--scheme", "W8A8", "--no-progress"]
    assert main([*base, "--output", str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out == f"output: {tmp_path / 'cli'}\n"
    model_free_ptq(source, tmp_path / "api", scheme="W8A8", progress=False)
    cli, api = _tensors(tmp_path / "cli"), _tensors(tmp_path / "api")
    assert sorted(cli) == sorted(api) and all(torch.equal(cli[k], api[k]) for k in cli)
    assert "lm_head.weight_scale" not in cli  # no --ignore: lm_head kept dense
    assert main([*base, "--ignore", "--output", str(tmp_path / "all")]) == 0  # no name: nothing ignored
    assert "lm_head.weight_scale" in _tensors(tmp_path / "all")
    capsys.readouterr()
    assert main(["model-free", str(source), "--scheme", "FP8", "--output", str(tmp_path / "fp8")]) == 1
    assert capsys.readouterr().err == (
        "llmc-fsm model-free: error: model_free_ptq runs no calibration: QuantizationModifier needs calibration data "
        "for static input-activation scales; use a scheme with dynamic activations (FP8_DYNAMIC, W8A8), or run "
        "llmc_fsm.oneshot with a dataset\n"
    )
    assert not (tmp_path / "fp8").exists()
    # a newcomer's case: the refusal of a scheme on these widths came after the default-ignore warning line
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["model-free", str(source), "--scheme", "FP8_BLOCK", "--output", str(tmp_path / "block")]) == 1
    assert [r.getMessage() for r in caplog.records if "no ignore given" in r.getMessage()] == []
    err = capsys.readouterr().err
    assert err.startswith("llmc-fsm model-free: error: model_free_ptq: QuantizationModifier refuses this checkpoint: ")
    assert err.count("\n") == 1
    assert not (tmp_path / "block").exists()


def test_the_command_runs_with_the_threads_given(tmp_path, monkeypatch, capsys):
    """``--threads N`` as oneshot's: torch's CPU threads for the run (the output the same); 0 is refused."""
    import llmc_fsm.cli.model_free as command
    from llmc_fsm.cli import main

    source = _checkpoint(tmp_path / "src", shard="60KB")
    seen = []

    def run(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return model_free_ptq(*args, **kwargs)

    monkeypatch.setattr(command, "model_free_ptq", run)
    before = torch.get_num_threads()
    try:
        want = 1 if before != 1 else 2
        base = ["model-free", str(source), "--scheme", "W8A8", "--no-progress"]
        assert main([*base, "--threads", str(want), "--output", str(tmp_path / "t")]) == 0
        assert seen == [want]
    finally:
        torch.set_num_threads(before)
    model_free_ptq(source, tmp_path / "api", scheme="W8A8", progress=False)
    cli, api = _tensors(tmp_path / "t"), _tensors(tmp_path / "api")
    assert sorted(cli) == sorted(api) and all(torch.equal(cli[k], api[k]) for k in cli)
    capsys.readouterr()
    assert main([*base, "--threads", "0", "--output", str(tmp_path / "z")]) == 1  # as oneshot's bad value
    assert capsys.readouterr().err == "llmc-fsm model-free: error: threads (--threads) must be a positive int, got 0\n"
    assert not (tmp_path / "z").exists()


def test_a_bias_in_another_shard_than_its_weight_is_read_and_written_with_it(tmp_path):
    source = tmp_path / "src"
    original = _made_up_checkpoint(source)
    (source / "model.safetensors").unlink()
    first = {k: v for k, v in original.items() if k != "model.blocks.0.proj.bias"}
    save_file(first, str(source / "model-00001-of-00002.safetensors"))
    save_file({"model.blocks.0.proj.bias": original["model.blocks.0.proj.bias"]},
              str(source / "model-00002-of-00002.safetensors"))  # fmt: skip
    index = {k: "model-00001-of-00002.safetensors" for k in first}
    index["model.blocks.0.proj.bias"] = "model-00002-of-00002.safetensors"
    (source / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    model_free_ptq(source, tmp_path / "free", scheme="W8A8", ignore=["model.embed_tokens"], progress=False)
    out = _tensors(tmp_path / "free")
    assert torch.equal(out["model.blocks.0.proj.bias"], original["model.blocks.0.proj.bias"])
    written = json.loads((tmp_path / "free" / "model.safetensors.index.json").read_text())["weight_map"]
    assert written["model.blocks.0.proj.bias"] == written["model.blocks.0.proj.weight"]
    assert sorted(written) == sorted(out)


def test_weights_of_other_formats_are_not_copied_and_the_index_counts_tensor_bytes(tmp_path, caplog):
    source = _checkpoint(tmp_path / "src", shard="60KB")
    (source / "pytorch_model.bin").write_bytes(b"old pickle")
    with caplog.at_level(logging.WARNING):
        model_free_ptq(source, tmp_path / "free", scheme="W8A8", ignore=["lm_head"], progress=False)
    assert not (tmp_path / "free" / "pytorch_model.bin").exists()
    assert (
        "model_free_ptq: weights in other formats are not copied to the output (the safetensors ones are what was "
        "quantized): pytorch_model.bin"
    ) in caplog.text
    index = json.loads((tmp_path / "free" / "model.safetensors.index.json").read_text())
    tensors = _tensors(tmp_path / "free")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("modifier", ["QuantizationModifier", "GPTQModifier"])
@pytest.mark.parametrize("scheme", ["W8A8", "W8A16"])
def test_a_bfloat16_models_int8_codes_are_those_its_in_memory_forward_computes_with(tmp_path, scheme, modifier):
    """compressed-tensors' forward re-quantizes a frozen module's (already rounded) bfloat16 weight at every call,
    dividing by the scale in bfloat16; the checkpoint holds the codes that gives, so the reloaded model computes
    what the in-memory one did (a change that saved the nearest codes to w / scale instead, dividing in float32,
    broke this by up to 0.018 in the logits: reverted; docs/quantization.md, "Saved formats")."""
    source = _checkpoint(tmp_path / "src", hidden=128, shard=None)
    recipe = {"stage": {modifier: {"targets": ["Linear"], "scheme": scheme, "ignore": ["lm_head"]}}}
    data = {"dataset": torch.randint(0, 128, (4, 16)), "max_seq_length": 16} if modifier == "GPTQModifier" else {}
    model = oneshot(model=str(source), recipe=recipe, output_dir=str(tmp_path / "out"), dtype=torch.bfloat16, **data)
    with torch.no_grad():
        in_memory = model(torch.arange(24).unsqueeze(0)).logits
    assert torch.equal(_reloaded_logits(tmp_path / "out"), in_memory)


@pytest.mark.parametrize("family", ["llava", "gpt_neox"])
def test_the_output_head_is_kept_dense_as_oneshot_keeps_it(tmp_path, family, caplog):
    """LLaVA's checkpoint names its head language_model.lm_head (transformers 5: lm_head): the default ignore
    [lm_head] keeps it dense, as in oneshot; GPT-NeoX's embed_out tied to embed_in is no Linear to quantize (a
    tester found both quantized: ignore [lm_head] matched the checkpoint's names only)."""
    import tiny_families

    tiny_families.build(family).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    with caplog.at_level(logging.WARNING):
        model_free_ptq(tmp_path / "src", tmp_path / "free", scheme="W8A8", progress=False)
    recipe = {"stage": {"QuantizationModifier": {"targets": ["Linear"], "scheme": "W8A8"}}}
    oneshot(model=str(tmp_path / "src"), recipe=recipe, output_dir=str(tmp_path / "oneshot"), dtype=torch.bfloat16)
    free, reference = _tensors(tmp_path / "free"), _tensors(tmp_path / "oneshot")
    head = "language_model.lm_head" if family == "llava" else "embed_out"
    assert f"{head}.weight_scale" not in free
    scales = sorted(k for k in free if k.endswith("weight_scale"))
    assert scales == sorted(k for k in reference if k.endswith("weight_scale"))
    assert torch.equal(_reloaded_logits(tmp_path / "free", family), _reloaded_logits(tmp_path / "oneshot", family))
    if family == "llava":
        assert "no ignore given: lm_head is kept dense (the checkpoint names it language_model.lm_head;" in caplog.text
        assert "on the command line --ignore with no name" in caplog.text
        # the default lm_head matches no checkpoint name, but the checkpoint's name added beside it keeps the head
        # dense: no "so language_model.lm_head is compressed" (found by a tester: it contradicted the line above)
        assert "matches no module" not in caplog.text


@pytest.mark.parametrize("tied", [False, True])  # tied: no Linear at all is left (the head is the embedding)
def test_a_checkpoint_quantized_already_with_nothing_left_is_refused_in_one_line(tmp_path, tied):
    source = _checkpoint(tmp_path / "src", shard=None, tied=tied)
    model_free_ptq(source, tmp_path / "w8a8", scheme="W8A8", progress=False)
    with pytest.raises(ValueError) as info:
        model_free_ptq(tmp_path / "w8a8", tmp_path / "again", scheme="W8A8", progress=False)
    assert str(info.value) == (
        "model_free_ptq: the checkpoint is quantized already (model.layers.{0..1}.mlp.down_proj, "
        "model.layers.{0..1}.mlp.gate_proj, model.layers.{0..1}.mlp.up_proj, model.layers.{0..1}.self_attn.k_proj, "
        "model.layers.{0..1}.self_attn.o_proj, model.layers.{0..1}.self_attn.q_proj, "
        "model.layers.{0..1}.self_attn.v_proj hold quantization parameters beside their weights) and no other Linear "
        "weight is left to quantize; start from the unquantized checkpoint, or give a converter that dequantizes it "
        "(compressed_tensors.entrypoints.convert: CompressedTensorsDequantizer, FP8BlockDequantizer)"
    )
    assert not (tmp_path / "again").exists()


def test_without_config_json_the_names_alone_decide_and_say_so(tmp_path, caplog):
    original = _made_up_checkpoint(tmp_path / "src")
    (tmp_path / "src" / "config.json").unlink()
    with caplog.at_level(logging.WARNING):
        model_free_ptq(tmp_path / "src", tmp_path / "free", scheme="W8A8", ignore=["model.embed_tokens"],
                       progress=False)  # fmt: skip
    assert "model_free_ptq: the checkpoint has no config.json: every 2-D '<module>.weight' outside *norm" in caplog.text
    assert "model_free_ptq: the checkpoint has no config.json: no quantization_config written" in caplog.text
    assert torch.equal(_tensors(tmp_path / "free")["model.embed_tokens.weight"], original["model.embed_tokens.weight"])


def test_llm_compressor_example_ignore_lists_name_modules_without_a_spelling_warning(tmp_path, caplog):
    """Kimi-K2's example ignores model.embed_tokens and re:.*mlp.gate$ (modules with no Linear weight): they match
    modules of the checkpoint, so no "matches no module (check the spelling...)" line; a 3-D parameter that is no
    fused experts' (a vision head's probe) is left as stored, not refused as one."""
    import tiny_families

    tiny_families.build("qwen3_moe").to(torch.bfloat16).save_pretrained(tmp_path / "src")
    with safe_open_tensors(tmp_path / "src") as add:
        add["model.vision_head.probe"] = torch.ones(1, 1, 8)
    ignore = ["re:.*gate$", "lm_head", "model.embed_tokens"]
    with caplog.at_level(logging.WARNING):
        model_free_ptq(tmp_path / "src", tmp_path / "free", scheme=_W4A16_G16, ignore=ignore, progress=False)
    assert "matches no module" not in caplog.text
    out = _tensors(tmp_path / "free")
    assert torch.equal(out["model.vision_head.probe"], torch.ones(1, 1, 8, dtype=out["model.vision_head.probe"].dtype))
    assert "model.layers.0.mlp.gate.weight" in out and "model.layers.0.mlp.gate.weight_scale" not in out


def test_session_requires_names_what_a_modifier_needs_with_its_arguments():
    def session(scheme: str) -> llmc_fsm.Session:
        return llmc_fsm.Session({"s": {"QuantizationModifier": {"targets": ["Linear"], "scheme": scheme}}})

    assert (session("W8A8").requires("model"), session("W8A8").requires("calibration_data")) == (True, False)
    assert session("FP8").requires("calibration_data") is True  # static input scales: from calibration inputs
    assert llmc_fsm.Session({"s": {"SparseGPTModifier": {"sparsity": 0.5}}}).requires("calibration_data") is True
    assert llmc_fsm.Session({"s": {"SparseGPTModifier": {"sparsity": 0.5}}}).requires("teacher") is False


def test_both_groups_target_linear_and_each_module_reloads_into_its_own(tmp_path):
    """A checkpoint whose down_proj is FP8 block already (its config: a group targeting Linear), the rest quantized
    W8A8: our group names its modules, so transformers gives each module its own group's layout (with a second
    Linear-class group, down_proj's block scales [2, 2] met the channel layout [128, 1]: size mismatch on reload)."""
    source = _checkpoint(tmp_path / "src", hidden=128, shard=None)
    others = ["lm_head", r"re:.*(q|k|v|o|gate|up)_proj$"]
    model_free_ptq(source, tmp_path / "block", scheme="FP8_BLOCK", ignore=others, progress=False)
    model_free_ptq(tmp_path / "block", tmp_path / "out", scheme="W8A8", ignore=["lm_head"], progress=False)
    from transformers import AutoModelForCausalLM

    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    schemes = {n: m.quantization_scheme.weights.strategy for n, m in reloaded.named_modules() if n.endswith("_proj")}
    assert {schemes[f"model.layers.{i}.mlp.down_proj"] for i in range(2)} == {"block"}
    assert {s for n, s in schemes.items() if "down_proj" not in n} == {"channel"}


def test_dtype_reads_a_float32_checkpoint_in_bfloat16_as_oneshots_dtype_does(tmp_path):
    """NVFP4 needs bfloat16 weights; a float32 checkpoint (the known SmolLM2 is one) with dtype="bfloat16" gives
    what oneshot(dtype="bfloat16") writes; the CLI's --dtype the same (the refusal's hint names it)."""
    from llmc_fsm.cli import main

    llama(hidden=64, tied=False).save_pretrained(tmp_path / "src")  # float32
    with pytest.raises(ModifierError, match=r"load the model in bfloat16 \(CLI: --dtype bfloat16"):
        model_free_ptq(tmp_path / "src", tmp_path / "refused", scheme="NVFP4A16", progress=False)
    model_free_ptq(tmp_path / "src", tmp_path / "free", scheme="NVFP4A16", dtype="bfloat16", progress=False)
    recipe = {"stage": {"QuantizationModifier": {"targets": ["Linear"], "scheme": "NVFP4A16"}}}
    oneshot(model=str(tmp_path / "src"), recipe=recipe, output_dir=str(tmp_path / "oneshot"), dtype=torch.bfloat16)
    free, reference = _tensors(tmp_path / "free"), _tensors(tmp_path / "oneshot")
    assert sorted(free) == sorted(reference) and all(torch.equal(free[k], reference[k]) for k in free)
    assert json.loads((tmp_path / "free" / "config.json").read_text())["dtype"] == "bfloat16"
    assert torch.equal(_reloaded_logits(tmp_path / "free"), _reloaded_logits(tmp_path / "oneshot"))
    argv = ["model-free", str(tmp_path / "src"), "--scheme", "NVFP4A16", "--dtype", "bfloat16", "--no-progress"]
    assert main([*argv, "--output", str(tmp_path / "cli")]) == 0
    cli = _tensors(tmp_path / "cli")
    assert all(torch.equal(cli[k], free[k]) for k in free)


def test_a_corrupt_shard_or_index_is_named_in_one_line(tmp_path):
    source = _checkpoint(tmp_path / "src", shard=None)
    (source / "model.safetensors").write_bytes(b"\x00" * 100)  # a header length far beyond the file
    with pytest.raises(ValueError, match=r"model.safetensors: not a valid safetensors file \(SafetensorError: "):
        model_free_ptq(source, tmp_path / "out", scheme="W8A8", progress=False)
    index = tmp_path / "idx"
    _checkpoint(index, shard="60KB")
    (index / "model.safetensors.index.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match=r'model.safetensors.index.json: not a valid safetensors index \(needs a "'):
        model_free_ptq(index, tmp_path / "out", scheme="W8A8", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx", "src"]


def test_the_written_weights_follow_the_umask(tmp_path):
    """safetensors writes its files 0600; oneshot's outputs follow the umask and model-free's did not (a server
    running as another user could not read the weights; found by a tester)."""
    import os

    source = _checkpoint(tmp_path / "src", shard="60KB")
    old = os.umask(0o022)
    try:
        out = model_free_ptq(source, tmp_path / "out", scheme="W8A8", progress=False)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.glob("*.safetensors")}
    assert len(modes) > 1 and set(modes.values()) == {0o644}


def test_group_size_replaces_an_int_presets_group_as_oneshots_group_size_does(tmp_path):
    """A checkpoint 64 wide could not take W4A16 (groups of 128) model-free: the refusal said to use
    ``--group-size 64``, which model-free did not have (found by a tester). ``group_size`` writes what ``oneshot``
    writes for the recipe ``oneshot --group-size`` generates."""
    source = _checkpoint(tmp_path / "src", shard=None)
    model_free_ptq(source, tmp_path / "free", scheme="W4A16", group_size=32, ignore=["lm_head"], progress=False)
    scheme = {"preset": "W4A16", "weights": {"group_size": 32}}
    recipe = {"stage": {"QuantizationModifier": {"targets": ["Linear"], "scheme": scheme, "ignore": ["lm_head"]}}}
    oneshot(model=str(source), recipe=recipe, output_dir=str(tmp_path / "oneshot"), dtype=torch.bfloat16)
    free, reference = _tensors(tmp_path / "free"), _tensors(tmp_path / "oneshot")
    assert sorted(free) == sorted(reference)
    assert all(torch.equal(free[k], reference[k]) for k in free)
    assert free["model.layers.0.mlp.down_proj.weight_scale"].shape == (64, 128 // 32)
    groups = json.loads((tmp_path / "free" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert groups["group_0"]["weights"]["group_size"] == 32


def test_the_group_size_advice_names_model_free_arguments_not_a_recipe(tmp_path):
    """The refusal of a group that does not divide the widths advised ``CLI: --group-size 64; recipe: scheme:
    {preset: W4A16, ...}``, a flag and a recipe model-free did not have (found by a tester)."""
    with pytest.raises(ModifierError) as info:
        model_free_ptq(_checkpoint(tmp_path / "src", shard=None), tmp_path / "out", scheme="W4A16", progress=False)
    message = str(info.value)
    assert message.startswith(
        "model_free_ptq: QuantizationModifier refuses this checkpoint: QuantizationModifier cannot compress "
    )
    assert message.endswith(
        "Use a group size that divides every target's input width, e.g. 64 (--group-size 64; Python: "
        "model_free_ptq(..., group_size=64)), or add these modules to ignore."
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("scheme", "per"),
    [
        ("NVFP4A16", "float weights per tensor_group of 16"),
        ("FP8_DYNAMIC", "float weights per channel"),
        ("MXFP4A16", "float weights per group of 32"),
    ],
)
def test_group_size_is_refused_for_a_preset_whose_weights_are_not_int_groups(tmp_path, scheme, per):
    """A group size for a preset whose group its format fixes (or that has none) is refused, naming the presets it
    applies to (found by a tester: model-free had no group size at all)."""
    message = (
        "model_free_ptq: group_size (--group-size) applies to presets whose int weights are quantized in groups "
        "(W2A16, W2A4, W2A8, W3A16, W3A4, W3A8, W4A16, W4A16_ASYM, W4A4, W4A8, W4AFP8, W5A16, W5A8, W6A16, W6A8, "
        f"W7A16, W7A8, W8A16); {scheme} quantizes {per}: leave group_size out"
    )
    _refused(tmp_path, ValueError, message, scheme=scheme, group_size=64)


@pytest.mark.parametrize(("scheme", "size"), [("NVFP4A16", 16), ("MXFP4A16", 32)])
def test_a_float_presets_own_group_size_is_taken_and_changes_nothing(tmp_path, scheme, size):
    """``--group-size 16`` with NVFP4A16 (32 with MX) was refused here while oneshot takes the format's own value
    (found by a tester): it is taken, and the output is tensor for tensor the one without it."""
    source = _checkpoint(tmp_path / "src", shard=None, tied=False)
    source_bf16 = tmp_path / "bf16"
    transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(source_bf16)
    model_free_ptq(source_bf16, tmp_path / "plain", scheme=scheme, progress=False)
    model_free_ptq(source_bf16, tmp_path / "sized", scheme=scheme, group_size=size, progress=False)
    plain, sized = _tensors(tmp_path / "plain"), _tensors(tmp_path / "sized")
    assert sorted(plain) == sorted(sized) and all(torch.equal(plain[k], sized[k]) for k in plain)


def test_group_size_is_refused_with_a_scheme_object_or_a_value_that_is_no_positive_int(tmp_path):
    """``group_size`` replaces a preset's group: with a scheme mapping it is refused (its weights say the group),
    and so is a value that is not a positive int."""
    message = (
        "model_free_ptq: group_size (--group-size) replaces a preset's weight group size: give scheme as a preset "
        "name (e.g. 'W4A16'), or set group_size in the weights of the scheme or config given"
    )
    _refused(tmp_path, ValueError, message, scheme={"weights": {"num_bits": 8}}, group_size=64)
    for bad in (0, True, 32.0):
        message = f"model_free_ptq: group_size (--group-size) must be a positive int, got {bad!r}"
        _refused(tmp_path, ValueError, message, scheme="W4A16", group_size=bad)


def test_an_unknown_scheme_is_named_as_model_free_ptqs_argument_not_an_internal_recipe(tmp_path):
    """An unknown scheme was reported as ``recipe <dict>, stage 'model_free_stage', modifier QuantizationModifier,
    argument 'scheme': ...``, a recipe the caller never wrote (found by a tester)."""
    message = (
        "model_free_ptq: scheme (--scheme): unknown quantization scheme 'W4X16' (did you mean 'W4A16'?); presets: "
        "FP8, FP8_BLOCK, FP8_DYNAMIC, INT8, MXFP4, MXFP4A16, MXFP4XFP8, MXFP6A16, MXFP6A8, MXFP8, MXFP8A16, NVFP4, "
        "NVFP4A16, W2A16, W2A4, W2A8, W3A16, W3A4, W3A8, W4A16, W4A16_ASYM, W4A4, W4A8, W4AFP8, W5A16, W5A8, W6A16, "
        "W6A8, W7A16, W7A8, W8A16, W8A8"
    )
    _refused(tmp_path, ValueError, message, scheme="W4X16")


def test_the_linear_tree_orders_modules_naturally_whatever_order_the_tensors_come_in():
    """config.json's ignore list (written in module order) followed the order of the shards' jobs, which followed the
    hash seed (two Kimi-K2 rows of the recipe corpus differed between runs; found by a tester)."""
    from llmc_fsm.oneshot_job.model_free import linear_tree

    names = ["model.layers.10.mlp.up_proj", "model.layers.2.self_attn.q_a_proj", "model.layers.2.self_attn.kv_a_proj",
             "model.layers.1.mlp.up_proj"]
    meta = {f"{n}.weight": torch.empty(4, 4, device="meta") for n in names}
    orders = {tuple(n for n, m in linear_tree(dict(o)).named_modules() if isinstance(m, torch.nn.Linear))
              for o in (meta.items(), reversed(meta.items()))}
    assert orders == {("model.layers.1.mlp.up_proj", "model.layers.2.self_attn.kv_a_proj",
                       "model.layers.2.self_attn.q_a_proj", "model.layers.10.mlp.up_proj")}
