"""A plain loop that sends no optimizer step events, and a modifier whose start the run never reaches: one warning
line each at finalize (both were silent), and a gradual prune ending at finalize holds exactly final_sparsity."""

from __future__ import annotations

import logging

import torch
from llmc_fsm_pruning.masks import num_to_prune
from tiny_llama import llama

from llmc_fsm import Session
from llmc_fsm.integrations.torch import initialize, optimizer_step

GRADUAL = "t:\n  MagnitudePruningModifier: {init_sparsity: 0.1, final_sparsity: 0.6, end: 1.0, update: 0.25}\n"
NOT_REACHED = (
    "t:\n  MagnitudePruningModifier: {init_sparsity: 0.1, final_sparsity: 0.6, start: 2.0, end: 3.0, update: 0.5}\n"
    "  ConstantPruningModifier: {start: 3.0}\n"
)


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 128, (2, 8), generator=g) for _ in range(n)]
    return [{"input_ids": i, "labels": i.clone()} for i in ids]


def _two_documented_steps(recipe: str, caplog) -> Session:
    """``recipe`` over two batches of a documented plain loop (``optimizer_step``), then ``finalize()`` with its
    warnings in ``caplog``."""
    model = llama(layers=1, hidden=32).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = Session(recipe)
    initialize(session, model=model, optimizer=optimizer, steps_per_epoch=2)
    for batch in _batches(2):
        session.batch_start(batch=batch)
        session.loss_calculated(model(**batch).loss).backward()
        optimizer_step(session, optimizer)
        session.batch_end()
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.session.session"):
        session.finalize()
    return session


def test_a_loop_without_optimizer_step_events_is_warned_at_finalize_and_ends_at_final_sparsity(caplog):
    """batch_start/batch_end only, AdamW stepped by the loop: global_step stayed 0, the 0.1 mask was never re-applied
    (the weights regrew), the prune to 0.6 came at finalize AND-ed with the stale mask: 0.636, without a word."""
    model = llama(layers=1, hidden=32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = Session(GRADUAL)
    session.initialize(model=model, steps_per_epoch=4)
    for batch in _batches(4):
        session.batch_start(batch=batch)
        session.loss_calculated(model(**batch).loss).backward()
        optimizer.step()
        optimizer.zero_grad()
        session.batch_end()
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.session.session"):
        session.finalize()
    assert [r.getMessage() for r in caplog.records] == [
        "finalize(): training batches came without optim_pre_step()/optim_post_step() (never called in this run): "
        "global_step stayed 0, so the schedule of MagnitudePruningModifier did not advance; MagnitudePruningModifier "
        "never acted at a step (masks not re-applied); what the schedule had left (a gradual pruning's final "
        "sparsity) was done now, at once. Call optimizer_step(session, optimizer) (llmc_fsm.integrations.torch), or "
        "session.optim_pre_step() / optim_post_step() around optimizer.step()"
    ]
    modifier = session.modifiers[0]
    assert [target for _, target in modifier.history] == [modifier.target_at(0.0), 0.6]
    for name, fraction in modifier.module_sparsity.items():
        weight = session.state.model.get_submodule(name).weight
        assert fraction == num_to_prune(weight.numel(), 0.6) / weight.numel(), name  # was above 0.6


def test_modifiers_never_started_are_named_at_finalize(caplog):
    session = _two_documented_steps(NOT_REACHED, caplog)
    assert [r.getMessage() for r in caplog.records] == [
        "finalize(): MagnitudePruningModifier (start 2), ConstantPruningModifier (start 3) never started: no batch "
        "came at or after their starts (the run ended at global step 2, epoch 1); they did nothing (the model is as "
        "training left it)"
    ]
    assert session.modifiers[0].measured_sparsity is None


def test_a_documented_run_is_not_warned(caplog):
    _two_documented_steps(GRADUAL, caplog)
    assert caplog.records == []


def test_a_batch_without_loss_calculated_while_distillation_is_active_is_named_once(caplog):
    """A loop that forgets session.loss_calculated (or a Trainer subclass whose compute_loss does not call the
    Trainer's): distillation did nothing and nothing said so. One warning line at the first such batch; none for
    the batches before distillation starts (start 1.0, 2 steps per epoch) nor for later ones."""
    from llmc_fsm_training import OutputDistillationModifier

    model = llama(layers=1, hidden=32).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = Session([OutputDistillationModifier(start=1.0)])
    initialize(session, model=model, teacher=llama(seed=7, layers=1, hidden=32), optimizer=optimizer, steps_per_epoch=2)
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.session.events"):
        for batch in _batches(5):
            session.batch_start(batch=batch)
            model(**batch).loss.backward()
            optimizer_step(session, optimizer)
            session.batch_end()
    assert [r.getMessage() for r in caplog.records] == [
        "batch_end(): no loss_calculated(loss) came in this batch (ending at global step 3), so "
        "OutputDistillationModifier, which changes the loss, did nothing in it: the model trained on its own loss. "
        "Call loss = session.loss_calculated(loss) after the forward pass and backpropagate the loss it returns (a "
        "SessionTrainer subclass overriding compute_loss: call super().compute_loss(...)); said once per run"
    ]
    session.finalize()


def test_a_loop_with_loss_calculated_is_not_warned_for_it(caplog):
    from llmc_fsm_training import OutputDistillationModifier

    model = llama(layers=1, hidden=32).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = Session([OutputDistillationModifier()])
    initialize(session, model=model, teacher=llama(seed=7, layers=1, hidden=32), optimizer=optimizer, steps_per_epoch=2)
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.session.events"):
        for batch in _batches(3):
            session.batch_start(batch=batch)
            session.loss_calculated(model(**batch).loss).backward()
            optimizer_step(session, optimizer)
            session.batch_end()
    assert caplog.records == []
    session.finalize()


def test_a_learning_rate_only_loop_without_step_events_is_not_warned_of_masks(caplog):
    """Found by a tester (session 38): a recipe with only a LearningRateModifier, trained without optimizer step
    events, was warned "(masks not re-applied)" and of "a gradual pruning's final sparsity", neither of which it has.
    Those words now come only for modifiers that act on the model."""
    model = llama(layers=1, hidden=32).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = Session("t:\n  LearningRateModifier: {init_lr: 0.01, schedule: cosine, end: 1.0}\n")
    initialize(session, model=model, optimizer=optimizer, steps_per_epoch=2)
    for batch in _batches(2):
        session.batch_start(batch=batch)
        session.loss_calculated(model(**batch).loss).backward()
        optimizer.step()
        session.batch_end()
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.session.session"):
        session.finalize()
    assert [r.getMessage() for r in caplog.records] == [
        "finalize(): training batches came without optim_pre_step()/optim_post_step() (never called in this run): "
        "global_step stayed 0, so the schedule of LearningRateModifier did not advance; LearningRateModifier never "
        "acted at a step. Call optimizer_step(session, optimizer) (llmc_fsm.integrations.torch), or "
        "session.optim_pre_step() / optim_post_step() around optimizer.step()"
    ]
