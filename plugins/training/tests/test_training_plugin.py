"""The training plugin registers through entry points and its schedules match their closed forms."""

from __future__ import annotations

import math

import pytest
from llmc_fsm_training import LearningRateModifier, OutputDistillationModifier, scheduled_lr


def test_registered_through_entry_points():
    from llmc_fsm.core.registry import get_registry

    registry = get_registry()
    assert registry.get("OutputDistillationModifier") is OutputDistillationModifier
    assert registry.get("LearningRateModifier") is LearningRateModifier


@pytest.mark.parametrize("epoch", [0.0, 0.25, 0.5, 1.0, 1.5])
def test_scheduled_lr_closed_forms(epoch):
    p = min(epoch / 1.0, 1.0)
    assert scheduled_lr("constant", epoch, init_lr=0.2) == 0.2
    assert scheduled_lr("linear", epoch, init_lr=0.2, final_lr=0.0, end=1.0) == pytest.approx(0.2 * (1 - p))
    assert scheduled_lr("cosine", epoch, init_lr=0.2, final_lr=0.0, end=1.0) == pytest.approx(
        0.1 * (1 + math.cos(math.pi * p))
    )
    assert scheduled_lr("step", epoch, init_lr=0.2, step_size=0.5, gamma=0.5) == pytest.approx(
        0.2 * 0.5 ** math.floor(epoch / 0.5)
    )


def test_yaml_scientific_notation_is_accepted():
    assert LearningRateModifier(init_lr="1e-4").init_lr == pytest.approx(1e-4)


def test_required_state_declared():
    assert OutputDistillationModifier.required_state == {"model", "teacher"}
    assert LearningRateModifier(init_lr=0.1).required_keys() == {"optimizer", "steps_per_epoch"}
