"""llm-compressor 0.14 example scripts translated by a tester (session 38): a model loaded under llm-compressor's
``load_context`` (its per-expert Linears in place of the fused experts), ``dataset="flickr30k"``,
``pipeline="independent"`` and ``pipeline="datafree"``."""

from __future__ import annotations

import logging

import pytest
import tiny_families
import tiny_llama
import torch
from llmc_fsm_quantization import GPTQModifier, QuantizationModifier, SpinQuantModifier
from torch import nn

import llmc_fsm
from llmc_fsm.data.rows import registered_name_error
from llmc_fsm.oneshot_job.llmcompressor_args import check_llmcompressor_args, modifiers_reading_data
from llmc_fsm.toolkit.targets import select_targets

RTN = {"quant": {"QuantizationModifier": {"scheme": "W8A8", "targets": ["Linear"], "ignore": ["lm_head"]}}}
GPTQ = {"quant": {"GPTQModifier": {"scheme": "W8A16", "targets": ["Linear"], "ignore": ["lm_head"]}}}
LOGGER = "llmc_fsm.oneshot_job.llmcompressor_args"
WHERE = "llmcompressor.modeling.moe.linear_experts"  # where llm-compressor 0.14 defines LinearExperts2D


def _per_expert_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' fused experts' call (hidden [T, H], top_k_index / top_k_weights [T, k]), one MLP per expert."""
    out = torch.zeros_like(hidden_states)
    for e, expert in enumerate(self):
        rows, slot = torch.where(top_k_index == e)
        if len(rows):
            x = hidden_states[rows]
            y = expert.down_proj(nn.functional.silu(expert.gate_proj(x)) * expert.up_proj(x))
            out.index_add_(0, rows, y * top_k_weights[rows, slot, None].to(y.dtype))
    return out


def _linearized_qwen3_moe() -> nn.Module:
    """A tiny Qwen3-MoE whose fused experts are replaced as llm-compressor's ``load_context`` replaces them (checked
    on the tester's repro): a ``LinearExperts2D`` (a ModuleList) of ``ExpertMLPWithGate`` modules holding
    ``gate_proj`` / ``up_proj`` / ``down_proj`` Linears, both classes defined in llm-compressor's module."""
    experts_cls = type("LinearExperts2D", (nn.ModuleList,), {"__module__": WHERE, "forward": _per_expert_forward})
    expert_cls = type("ExpertMLPWithGate", (nn.Module,), {"__module__": WHERE})
    model = tiny_families.build("qwen3_moe")
    for layer in model.model.layers:
        fused = layer.mlp.experts
        experts = experts_cls()
        for e in range(fused.num_experts):
            expert = expert_cls()
            gate, up = fused.gate_up_proj.data[e].chunk(2, dim=0)
            for name, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", fused.down_proj.data[e])):
                linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
                linear.weight.data.copy_(weight)
                setattr(expert, name, linear)
            experts.append(expert)
        layer.mlp.experts = experts
    return model


LINEARIZED_REFUSAL = (
    "model.layers.0.mlp.experts is llm-compressor's LinearExperts2D (llmcompressor.modeling.moe.linear_experts), "
    "which its load_context / linearize_moe put in place of the model's own module (one Linear per expert for fused "
    "experts): transformers reloads only its own layout, so a checkpoint of it would reload with those weights "
    "missing; load the model with AutoModelForCausalLM.from_pretrained directly, without load_context (to bound the "
    "memory, give its directory with low_memory=True instead: model=DIR; --model DIR --low-memory)"
)


def test_a_model_with_llmcompressors_per_expert_linears_is_refused_before_any_work(tmp_path):
    """Found by a tester: a Qwen3-MoE loaded under llm-compressor's ``load_context`` (qwen_example.py) was quantized
    per expert and saved as ``experts.<e>.gate_proj.weight``..., which transformers 5 reloads as unexpected keys,
    leaving the fused ``gate_up_proj`` / ``down_proj`` random (logits moved by 0.09). Now refused in one line
    before any work: nothing written, no weight changed."""
    model = _linearized_qwen3_moe()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = tmp_path / "out"
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(model=model, recipe=RTN, output_dir=out, progress=False)
    assert str(err.value) == LINEARIZED_REFUSAL
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())


def test_selecting_targets_in_a_model_with_llmcompressors_modules_is_refused():
    """The same refusal for a session's modifier (target selection), found by the same tester's case."""
    with pytest.raises(ValueError) as err:
        select_targets(_linearized_qwen3_moe(), ["Linear"], ["lm_head"])
    assert str(err.value) == LINEARIZED_REFUSAL


FLICKR = (
    "dataset (--dataset) 'flickr30k' is an image-caption dataset registered in llm-compressor, which llmc-fsm does "
    "not load: write its images and captions to a directory with metadata.jsonl and give that directory as the "
    "dataset, with the model's processor (processor= or tokenizer=), to calibrate on the images as llm-compressor "
    "does (ds = load_dataset('lmms-lab/flickr30k', split='test'); save each row's 'image' as DIR/<i>.jpg and write "
    'one {"file_name": "<i>.jpg", "text": " ".join(row["caption"])} line per row to DIR/metadata.jsonl; LLaVA, '
    'Gemma 3 and Mllama take images: docs/architectures.md, "Vision-language models")'
)


def test_llmcompressors_image_dataset_names_point_to_the_image_caption_directory():
    """Found by a tester: gemma3_example.py's ``dataset="flickr30k"`` was told to map the dataset to a 'text' column,
    calibrating a vision-language model on text alone where llm-compressor feeds it the images."""
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(model=tiny_families.build("gemma3_vlm"), recipe=GPTQ, dataset="flickr30k", progress=False)
    assert str(err.value) == FLICKR
    assert "dataset (--dataset) " + registered_name_error("flickr") == FLICKR.replace("'flickr30k'", "'flickr'", 1)


def test_independent_pipeline_says_it_runs_one_pass_and_how_to_get_one_per_modifier(caplog):
    """Found by a tester: ``pipeline="independent"`` was said to be llm-compressor's 'sequential', where its
    IndependentPipeline gives each modifier a calibration pass of its own."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert check_llmcompressor_args({"pipeline": "independent"}, ["model"]) == {}
    assert [r.getMessage() for r in caplog.records] == [
        "llm-compressor argument pipeline='independent' taken: llmc-fsm calibrates layer by layer in one pass, every "
        "modifier of a stage at each layer (llm-compressor's 'sequential'), where llm-compressor's 'independent' "
        "gives each modifier a calibration pass of its own: for one pass per modifier, put each modifier in a stage "
        "of its own"
    ]


DATAFREE_TAKEN = (
    "llm-compressor argument pipeline='datafree' taken: no modifier of this recipe reads calibration data, so none "
    "is read, as llm-compressor's 'datafree'"
)


def test_datafree_pipeline_is_taken_for_a_data_free_recipe_and_refused_naming_what_reads_data(caplog):
    """Found by a tester: ``pipeline="datafree"`` was refused even for spinquant_example.py's data-free recipe."""
    spin = [
        SpinQuantModifier(rotations=["R1", "R2"], transform_type="hadamard"),
        QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
    ]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert check_llmcompressor_args({"pipeline": "datafree"}, {"model": "m", "recipe": spin}) == {}
    assert [r.getMessage() for r in caplog.records] == [DATAFREE_TAKEN]
    with pytest.raises(ValueError) as err:
        check_llmcompressor_args({"pipeline": "datafree"}, {"recipe": [*spin, GPTQModifier(scheme="W8A16")]})
    assert str(err.value) == (
        "llm-compressor oneshot argument pipeline='datafree': GPTQModifier reads calibration data, which "
        "llm-compressor's 'datafree' pipeline does not give; leave pipeline out (llmc-fsm calibrates layer by layer) "
        "or use data-free modifiers only"
    )
    assert modifiers_reading_data(None) == ["SparseGPTModifier"]  # oneshot's default recipe
    with pytest.raises(ValueError) as unknown:
        check_llmcompressor_args({"pipeline": "datafree"}, ["model", "recipe"])  # names only: no recipe to check
    assert str(unknown.value) == (
        "llm-compressor oneshot argument pipeline='datafree': llmc-fsm takes 'datafree' only for a recipe it can "
        "check reads no data, and got none: leave it out"
    )


def test_oneshot_takes_the_datafree_pipeline_for_round_to_nearest_and_refuses_it_for_gptq(caplog, tmp_path):
    """The same through ``llmc_fsm.oneshot`` (which gives its arguments to the check), refused before any work."""
    model = tiny_llama.llama()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        llmc_fsm.oneshot(model=model, recipe=RTN, pipeline="datafree", progress=False)
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [DATAFREE_TAKEN]
    assert model.model.layers[0].mlp.down_proj.weight_scale.shape == (64, 1)
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(model=tiny_llama.llama(), recipe=GPTQ, pipeline="datafree", output_dir=tmp_path / "o")
    assert str(err.value).startswith("llm-compressor oneshot argument pipeline='datafree': GPTQModifier reads ")
    assert list(tmp_path.iterdir()) == []
