"""OutputDistillationModifier finds the student's attention mask however the call passes it, and a recipe with
llm-compressor's layer-wise distillation arguments is told what ours does (both found by a tester)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from llmc_fsm_training import OutputDistillationModifier

from llmc_fsm import Session
from llmc_fsm.integrations.torch import initialize

T = 3.0
ALPHA = 0.3


class Lookup(torch.nn.Module):
    """Logits ``[batch, seq, 16]`` looked up from the token ids; ``attention_mask`` is accepted and not used."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(16, 16)
        with torch.no_grad():
            self.table.weight.copy_(torch.randn(16, 16, generator=torch.Generator().manual_seed(seed)))

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.table(input_ids)


class CatchAll(Lookup):
    """The same logits; everything after ``input_ids`` goes through ``**kwargs``."""

    def forward(self, input_ids, **kwargs):
        return self.table(input_ids)


def _batch():
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0  # the second sequence has 3 padding tokens
    return ids, mask


def _hand_kd(student, teacher, ids, mask):
    """KL(teacher || student) at temperature T per position, averaged over the real tokens, times T**2."""
    with torch.no_grad():
        log_s = F.log_softmax(student(ids) / T, dim=-1)
        log_t = F.log_softmax(teacher(ids) / T, dim=-1)
    per_position = (log_t.exp() * (log_t - log_s)).sum(-1)
    return float((per_position * mask).sum() / mask.sum() * T * T), float(per_position.mean() * T * T)


def _distill(student, teacher, call):
    modifier = OutputDistillationModifier(temperature=T, alpha=ALPHA)
    session = Session([modifier])
    initialize(session, model=student.train(), teacher=teacher)
    session.batch_start()
    loss = session.loss_calculated(call(student))
    session.batch_end()
    session.finalize()
    return float(modifier.last_distill_loss), float(torch.as_tensor(loss).detach())


@pytest.mark.parametrize(
    ("model", "call"),
    [
        (Lookup, lambda m, ids, mask: m(ids, mask)),
        (Lookup, lambda m, ids, mask: m(ids, attention_mask=mask)),
        (Lookup, lambda m, ids, mask: m(input_ids=ids, attention_mask=mask)),
        (CatchAll, lambda m, ids, mask: m(ids, attention_mask=mask)),
    ],
    ids=["positional", "keyword", "all-keywords", "in-var-keyword"],
)
def test_distillation_averages_over_real_tokens_however_the_mask_is_passed(model, call):
    """``student(ids, mask)`` averaged the KD term over the padding too (0.0257063 for 0.0257167 in the tester's
    run): only a keyword ``attention_mask`` was seen."""
    student, teacher = model(0), model(1)
    ids, mask = _batch()
    masked, unmasked = _hand_kd(student, teacher, ids, mask)
    assert abs(masked - unmasked) > 1e-3  # the two averages differ, so the test tells them apart
    kd, loss = _distill(student, teacher, lambda m: call(m, ids, mask).sum() * 0 + 2.0)
    assert kd == pytest.approx(masked, rel=1e-6, abs=0)
    assert loss == pytest.approx((1 - ALPHA) * 2.0 + ALPHA * masked, rel=1e-6, abs=0)


def test_distillation_of_a_llama_called_with_a_positional_mask():
    """The tester's case: a Llama student called ``student(ids, mask, labels=labels)``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    from tiny_llama import llama

    student, teacher = llama(seed=0, layers=1, hidden=32), llama(seed=1, layers=1, hidden=32)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        log_s = F.log_softmax(student(input_ids=ids, attention_mask=mask).logits / T, dim=-1)
        log_t = F.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits / T, dim=-1)
    per_position = (log_t.exp() * (log_t - log_s)).sum(-1)
    masked = float((per_position * mask).sum() / mask.sum() * T * T)
    assert abs(masked - float(per_position.mean() * T * T)) > 1e-5 * masked
    kd, _ = _distill(student, teacher, lambda m: m(ids, mask, labels=labels).loss)
    assert kd == pytest.approx(masked, rel=1e-6, abs=0)


NAMESAKE = (
    "It is an argument of llm-compressor's OutputDistillationModifier, which does layer-wise distillation (it compares "
    "the outputs of the targeted modules with the teacher's; removed in llm-compressor 0.10); llmc-fsm's "
    "OutputDistillationModifier does not do that: it distils the output logits (Hinton et al.; arguments "
    "temperature and alpha, docs/training.md). Remove it to use llmc-fsm's, or use llm-compressor before 0.10 for "
    "layer-wise distillation."
)


def test_a_recipe_with_llmcompressor_layerwise_distillation_arguments_is_told_what_ours_does():
    """llm-compressor's layer-wise recipe was answered "unknown argument 'targets'. Did you mean 'start'?"."""
    from llmc_fsm import RecipeError

    recipe = {"s": {"OutputDistillationModifier": {"targets": ["re:model.layers.\\d+$"], "temperature": 2.0}}}
    with pytest.raises(RecipeError) as info:
        Session(recipe)
    assert str(info.value) == (
        f"recipe <dict>, stage 's', modifier OutputDistillationModifier: unknown argument 'targets'. {NAMESAKE}"
    )


def test_a_layerwise_distillation_argument_from_python_is_told_what_ours_does():
    with pytest.raises(TypeError) as info:
        OutputDistillationModifier(comparison="square_head")
    assert str(info.value) == (
        f"OutputDistillationModifier() got an unexpected keyword argument 'comparison'. {NAMESAKE}"
    )


@pytest.mark.parametrize(("field", "message"), [
    ("alpha", "alpha must be a number in [0, 1], got True"),
    ("temperature", "temperature must be a finite number > 0, got True"),
])  # fmt: skip
def test_a_boolean_alpha_or_temperature_is_refused(field, message):
    """`alpha: true` and `temperature: true` were read as 1.0 (float(True)) while other float fields refuse booleans
    (found by a tester)."""
    with pytest.raises(ValueError) as info:
        OutputDistillationModifier(**{field: True})
    assert str(info.value) == message
    assert getattr(OutputDistillationModifier(**{field: "0.25"}), field) == 0.25  # a number as a string, as before
