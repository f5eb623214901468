"""Distillation refuses at initialize a student or teacher that gives no logits for the student's inputs, and
ConstantPruningModifier holds the weights with |w| <= 1e-8 at zero, as llm-compressor does (found by a tester)."""

from __future__ import annotations

import pytest
import torch
from llmc_fsm_pruning.constant import ConstantPruningModifier
from llmc_fsm_training import OutputDistillationModifier
from tiny_llama import llama
from transformers import LlamaConfig, LlamaModel, T5Config, T5ForConditionalGeneration

from llmc_fsm import ModifierError, Session
from llmc_fsm.integrations.torch import initialize, optimizer_step

BASE_MODEL = (
    "the {role} is a LlamaModel, a transformers base model without a language-modeling head: its output has hidden "
    "states, no logits, and distillation compares the two models' logits; pass the model with its head "
    "(AutoModelForCausalLM.from_pretrained instead of AutoModel.from_pretrained)"
)
ENCODER_DECODER = (
    "the teacher is a T5ForConditionalGeneration, an encoder-decoder model (config.is_encoder_decoder): distillation "
    "runs the teacher on the student's inputs (without labels, so no decoder input) and compares the two models' "
    "logits position by position, which needs decoder-only language models; pass a decoder-only causal LM "
    "(AutoModelForCausalLM) instead"
)


def _base_llama() -> LlamaModel:
    """What ``AutoModel.from_pretrained`` gives for a Llama checkpoint: no lm_head (vocabulary 128, as ``llama()``)."""
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaModel(config)


def _t5() -> T5ForConditionalGeneration:
    config = T5Config(vocab_size=128, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
    return T5ForConditionalGeneration(config)


def _refusal(student, teacher) -> tuple[str, str, bool]:
    session = Session([OutputDistillationModifier()])
    session.update_state(model=student, teacher=teacher)
    with pytest.raises(ModifierError) as info:
        session.initialize()
    return str(info.value.__cause__), session.lifecycle, bool(student._forward_hooks)


def test_distillation_refuses_a_teacher_without_a_language_modeling_head_at_initialize():
    """Before: a LlamaModel teacher (AutoModel instead of AutoModelForCausalLM) was taken, and the first step raised
    "cannot find logits in a model output of type BaseModelOutputWithPast", the session left running."""
    teacher = _base_llama()
    assert _refusal(llama(seed=0).train(), teacher) == (BASE_MODEL.format(role="teacher"), "staging", False)
    assert teacher.training  # not put in eval mode by a refused initialize


def test_distillation_refuses_a_student_without_a_language_modeling_head_at_initialize():
    """Before: a LlamaModel student was taken, and its first training forward raised inside the model's call (the
    distillation hook found no logits in its output)."""
    assert _refusal(_base_llama().train(), llama(seed=1)) == (BASE_MODEL.format(role="student"), "staging", False)


def test_distillation_refuses_an_encoder_decoder_teacher_at_initialize():
    """Before: a T5 teacher was taken, and the first loss_calculated failed inside transformers ("You must specify
    exactly one of input_ids or inputs_embeds"): run on the student's inputs it had no decoder input."""
    assert _refusal(llama(seed=0).train(), _t5()) == (ENCODER_DECODER, "staging", False)


def test_constant_pruning_holds_weights_of_at_most_1e_8_at_zero_as_llm_compressor():
    """Before: only exact zeros were held (``w != 0``); llm-compressor keeps ``|w| > 1e-8``, so the weights 1e-9 and
    -1e-9 were set to 0 by it and kept by us."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 1, bias=False))
    start = torch.tensor([[0.0, 1e-9, -1e-9, 1e-8, 1e-7, -1e-7]])
    with torch.no_grad():
        model[0].weight.copy_(start)
    modifier = ConstantPruningModifier(targets=["Linear"], ignore=[])
    session = Session([modifier])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the step itself changes nothing
    initialize(session, model=model, optimizer=optimizer)
    session.batch_start()
    loss = session.loss_calculated(model(torch.ones(1, 6)).sum())
    loss.backward()
    assert torch.equal(model[0].weight, start)  # masks taken at start, applied after the step
    optimizer_step(session, optimizer)
    session.batch_end()
    expected = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1e-7, -1e-7]])
    assert torch.equal(model[0].weight, expected)
    session.finalize()
    assert modifier.measured_sparsity == 4 / 6
    assert torch.equal(model[0].weight, expected)
