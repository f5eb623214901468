"""``low_memory`` (the streamed path) on mixture-of-experts checkpoints (issue 24).

transformers 5 saves fused experts per expert (Mixtral ``block_sparse_moe.experts.0.w1.weight``, Qwen3-MoE
``mlp.experts.0.gate_proj.weight``) and fuses them on load with its weight conversion; the lazy loader applies that
same conversion (``llmc_fsm.models.lazy``). Tiny random models from ``tiny_families`` (offline configs), saved with
``save_pretrained`` (per-expert keys) or with the model's own fused tensors (``safetensors.torch.save_model``).
References: transformers' own ``from_pretrained`` of the same directory, and the in-memory one-shot path.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_model
from tiny_families import build

import llmc_fsm
from llmc_fsm.models.lazy import load_lazy

DATA = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
RECIPES = {
    "sparsegpt": {"s": {"SparseGPTModifier": {"sparsity": 0.5, "ignore": ["lm_head"]}}},
    "gptq": {
        "s": {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}, "ignore": ["lm_head"]}}
    },
}
#: a per-expert checkpoint key of layer 0, as transformers 5.24 writes it (read in the test, not assumed)
PER_EXPERT_KEY = {
    "mixtral": "model.layers.0.block_sparse_moe.experts.0.w1.weight",
    "qwen3_moe": "model.layers.0.mlp.experts.0.gate_proj.weight",
}


def _save(family: str, directory, layout: str) -> None:
    """Save the tiny ``family`` model to ``directory``: ``per_expert`` (save_pretrained) or ``fused`` (its tensors)."""
    model = build(family)
    if layout == "per_expert":
        model.save_pretrained(directory)
    else:
        directory.mkdir()
        model.config.save_pretrained(directory)
        save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    per_expert = layout == "per_expert"
    assert (PER_EXPERT_KEY[family] in keys, fused in keys) == (per_expert, not per_expert)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_lazy_loader_builds_every_tensor_as_from_pretrained(tmp_path, family, layout):
    """Every tensor the streamed loader materializes is bit-equal to from_pretrained's, fused experts included."""
    _save(family, tmp_path / "ckpt", layout)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").state_dict()
    lazy, _ = load_lazy(tmp_path / "ckpt")
    assert bool(lazy.converted) == (layout == "per_expert")
    names = [n for i in range(len(lazy.layers)) for n in lazy.layer_names(i)] + lazy.outer_names()
    assert sorted(names) == sorted(lazy.model.state_dict())  # no tied weights in these configs
    with lazy.materialized(names):
        for name in names:
            assert torch.equal(lazy.tensor(name), reference[name]), name
    assert all(lazy.tensor(n).is_meta for n in names)


def _reload(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    return model.eval()


@pytest.mark.parametrize("method", ["sparsegpt", "gptq"])
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_streamed_output_equals_the_in_memory_output(tmp_path, family, layout, method):
    """One-shot from the same checkpoint, streamed (low_memory) and in memory: both outputs reload with no missing
    or unexpected key, the checkpoint files hold the same keys (save_pretrained's: per expert where the source is) and
    tensors, every reloaded tensor bit-equal, every expert matrix compressed (SparseGPT: exactly 50 % zeros per
    expert matrix; GPTQ: every expert tensor changed), logits equal."""
    _save(family, tmp_path / "ckpt", layout)
    if (layout, method) == ("fused", "gptq"):
        return _assert_both_refuse_packing_fused_experts(tmp_path, family)
    outputs, files = {}, []
    for low_memory in (False, True):
        out = tmp_path / f"out_{low_memory}"
        llmc_fsm.oneshot(
            model=str(tmp_path / "ckpt"), recipe=RECIPES[method], dataset=DATA, output_dir=out, progress=False,
            low_memory=low_memory,
        )  # fmt: skip
        outputs[low_memory] = _reload(out)
        files.append({k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()})
    # the checkpoint files: the same keys (save_pretrained's names, the source's layout), every tensor bit-equal
    assert sorted(files[0]) == sorted(files[1])
    assert [k for k, v in files[0].items() if not torch.equal(v, files[1][k])] == []
    stored = PER_EXPERT_KEY[family].removesuffix("weight") + ("weight" if method == "sparsegpt" else "weight_packed")
    assert (stored in files[1]) == (layout == "per_expert")
    in_memory, streamed = outputs[False].state_dict(), outputs[True].state_dict()
    assert sorted(in_memory) == sorted(streamed)
    assert [k for k in in_memory if not torch.equal(in_memory[k], streamed[k])] == []
    source = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").state_dict()
    experts = [k for k in source if ".experts." in k]
    assert len(experts) == 2 * 4  # gate_up_proj and down_proj of 4 layers
    for key in experts:
        if method == "sparsegpt":  # [experts, out, in]: every expert matrix half zeros
            zeros = (streamed[key] == 0).sum(dim=(1, 2))
            if key.endswith("gate_up_proj"):  # gate and up are two matrices of the same size
                half = streamed[key].shape[1] // 2
                zeros = torch.cat([(streamed[key][:, :half] == 0).sum(dim=(1, 2)),
                                   (streamed[key][:, half:] == 0).sum(dim=(1, 2))])  # fmt: skip
                assert zeros.tolist() == [streamed[key][0, :half].numel() // 2] * 8, key
            else:
                assert zeros.tolist() == [streamed[key][0].numel() // 2] * 4, key
        else:
            assert all(not torch.equal(streamed[key][e], source[key][e]) for e in range(4)), key
    with torch.no_grad():
        assert torch.equal(outputs[False](DATA).logits, outputs[True](DATA).logits)


def _assert_both_refuse_packing_fused_experts(tmp_path, family):
    """A checkpoint holding the fused tensors: from_pretrained uses no conversion, so transformers would save the
    experts fused again, and packed fused experts do not reload (tests/test_expert_quantization.py); both paths
    refuse GPTQ with the same line before writing anything (the streamed loader keeps the conversions it used, as
    from_pretrained does)."""
    errors = []
    for low_memory in (False, True):
        with pytest.raises(ValueError) as info:
            llmc_fsm.oneshot(
                model=str(tmp_path / "ckpt"), recipe=RECIPES["gptq"], dataset=DATA, output_dir=tmp_path / "o",
                progress=False, low_memory=low_memory,
            )  # fmt: skip
        errors.append(str(info.value))
        assert not (tmp_path / "o").exists()
    cls = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]
    assert errors[0] == errors[1]
    assert errors[0].startswith(
        f"GPTQModifier: {cls} (model_type '{family}'): fused experts model.layers.0.mlp.experts cannot be quantized: "
        "transformers saves model.layers.0.mlp.experts.down_proj, model.layers.0.mlp.experts.gate_up_proj fused in "
        "the checkpoint"
    )
