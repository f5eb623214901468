"""Embedding a :class:`~llmc_fsm.Session` in a plain PyTorch training loop.

What to call where (every call is a plain :class:`~llmc_fsm.Session` method; the
helpers below only remove arithmetic and re-raise errors with loop-specific
advice)::

    session = Session(recipe)                       # recipe parsed and validated here
    session.update_state(model=model)               # where the model is built
    session.update_state(teacher=teacher)           # where the teacher is loaded
    optimizer = torch.optim.AdamW(model.parameters(), lr=...)
    session.update_state(optimizer=optimizer,       # where the optimizer is built
                         steps_per_epoch=steps_per_epoch(loader, accumulation))
    initialize(session)                             # once, before the first batch:
                                                    # all missing state reported here
    for epoch in range(epochs):
        for i, batch in enumerate(loader):
            session.batch_start(batch=batch)
            out = model(**batch)
            loss = session.loss_calculated(out.loss)   # modifiers may replace the loss
            (loss / accumulation).backward()
            if is_step(i, len(loader), accumulation):
                optimizer_step(session, optimizer)     # optim_pre_step, step, optim_post_step, zero_grad
            session.batch_end()
    session.finalize()                               # masks/hooks released, final sparsity

Rules the session enforces (:class:`~llmc_fsm.EventOrderError` otherwise): a
batch is ``batch_start -> [loss_calculated] -> [optim_pre_step ->
optim_post_step] -> batch_end``; a batch without an optimizer step (gradient
accumulation) is valid. The session counts optimizer steps itself (at
``optim_post_step``), so ``event.epoch = global_step / steps_per_epoch`` is right
as long as ``steps_per_epoch`` counts *optimizer* steps — use
:func:`steps_per_epoch`.

Checkpoints and resume. Save right after the ``batch_end`` of a batch that
stepped the optimizer (the session refuses inside a batch); model, optimizer and
RNG state are yours to save as usual, the session's progress goes next to them::

            session.batch_end()
            if is_step(i, len(loader), accumulation) and session.global_step % save_every == 0:
                directory = f"ckpt/step-{session.global_step}"
                save_model(model, f"{directory}/model.safetensors")  # safetensors.torch: tied weights too
                torch.save(optimizer.state_dict(), f"{directory}/optimizer.pt")
                session.save(f"{directory}/session")          # masks, schedule, modifier state

(``save_file(model.state_dict(), ...)`` raises "Some tensors share memory" for a model with tied weights, such
as SmolLM2's embedding and ``lm_head``; ``save_model`` stores a shared tensor once and ``load_model`` fills
every name that shares it.)

To resume, rebuild everything as for a fresh run, load model and optimizer
state, then pass the session directory to :func:`initialize` — it initializes
the session and loads the checkpoint before the first event — and skip the
batches already trained (:func:`resume_position`)::

    load_model(model, f"{directory}/model.safetensors")  # safetensors.torch
    optimizer.load_state_dict(torch.load(f"{directory}/optimizer.pt", weights_only=True))
    initialize(session, checkpoint=f"{directory}/session")
    start_epoch, skip = resume_position(session, len(loader), accumulation)
    for epoch in range(start_epoch, epochs):
        for i, batch in enumerate(loader):
            if epoch == start_epoch and i < skip:
                continue                                # already trained before the checkpoint
            ...                                         # the loop above, unchanged

The resumed run is then identical to an uninterrupted one (same masks and
schedule values at every step; bitwise-identical weights on CPU with a
deterministic data order).

Call ``loss_calculated`` with the per-batch (mean) loss *before* dividing it for
gradient accumulation: distillation combines it with a per-batch mean KL term.

Devices: put the student where it trains before :func:`initialize` (masks and
other modifier state are made on, and follow, its parameters' device).
:func:`initialize` puts the teacher on the student's device, or on
``teacher_device="auto" | "cpu" | "cuda" | "cuda:N"`` (e.g. ``"cpu"`` to keep a
large teacher out of device memory: the teacher then computes there, on copies
of the student's inputs); see :mod:`llmc_fsm.integrations`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from llmc_fsm.core.state import as_count
from llmc_fsm.integrations import check_teacher, resolve_teacher_device, start_session
from llmc_fsm.session.checkpoint import read_checkpoint
from llmc_fsm.session.session import Session

__all__ = ["HINTS", "initialize", "is_step", "optimizer_step", "resume_position", "steps_per_epoch"]

#: How to pass each well-known key in a plain loop (used in MissingStateError messages).
HINTS: dict[str, str] = {
    "model": "session.update_state(model=model) right after building/loading the model",
    "teacher": "session.update_state(teacher=teacher) after loading the teacher (a separate, frozen model)",
    "optimizer": (
        "create the optimizer before initializing, then session.update_state(optimizer=optimizer) "
        "(or initialize(session, optimizer=optimizer))"
    ),
    "steps_per_epoch": (
        "session.update_state(steps_per_epoch=steps_per_epoch(train_loader, gradient_accumulation_steps)) "
        "from llmc_fsm.integrations.torch: optimizer steps per epoch"
    ),
    "train_data": "session.update_state(train_data=train_loader)",
    "calibration_data": "session.update_state(calibration_data=batches)",
}


def _hint(key: str) -> str:
    return HINTS.get(key, f"session.update_state({key}=...) where that object is created")


def steps_per_epoch(loader: Any, gradient_accumulation_steps: int = 1) -> int:
    """Optimizer steps per epoch: ``ceil(batches / gradient_accumulation_steps)``.

    ``loader`` is anything with ``len()`` (a ``DataLoader``: its number of
    batches) or that number itself (a numpy int too). The last, partial accumulation window of an
    epoch counts as a step, as in the HF Trainer and :func:`is_step`.

    Raises:
        ValueError: ``gradient_accumulation_steps`` is not an int >= 1, no length, or no batch (an empty loader,
            0: it gave 1 step, where the session refuses ``steps_per_epoch=0``; found by a tester).
    """
    _check_accumulation(gradient_accumulation_steps)
    batches = as_count(loader)
    if batches is None:
        try:
            batches = len(loader)
        except TypeError:
            msg = f"{type(loader).__name__} has no len(); pass the number of batches per epoch instead"
            raise ValueError(msg) from None
    if batches < 1:
        msg = f"{batches} batches per epoch: give a training loader with at least one batch (an empty one?)"
        raise ValueError(msg)
    return math.ceil(batches / gradient_accumulation_steps)


def _check_accumulation(gradient_accumulation_steps: Any) -> None:
    """Raise ``ValueError`` unless ``gradient_accumulation_steps`` is an int >= 1 (a numpy int too; a string, a float
    or 0 gave a TypeError, a truncated count or a ZeroDivisionError: found by a fuzzing tester)."""
    count = as_count(gradient_accumulation_steps)
    if count is None or count < 1:
        msg = f"gradient_accumulation_steps must be an int >= 1, got {gradient_accumulation_steps!r}"
        raise ValueError(msg)


def is_step(batch_index: int, batches_per_epoch: int | None, gradient_accumulation_steps: int = 1) -> bool:
    """Whether the batch at ``batch_index`` (0-based, within the epoch) ends an accumulation window.

    True every ``gradient_accumulation_steps`` batches and at the last batch of
    the epoch (``batches_per_epoch``, ``None`` when unknown).

    Raises:
        ValueError: ``gradient_accumulation_steps`` is not an int >= 1.
    """
    _check_accumulation(gradient_accumulation_steps)
    last = batches_per_epoch is not None and batch_index + 1 == batches_per_epoch
    return (batch_index + 1) % gradient_accumulation_steps == 0 or last


def optimizer_step(session: Session, optimizer: Any, *, scheduler: Any = None, zero_grad: bool = True) -> None:
    """Fire ``optim_pre_step``, call ``optimizer.step()``, fire ``optim_post_step``; then scheduler and zero_grad.

    Gradient clipping and similar go before this call (gradients are final at
    ``optim_pre_step``). ``scheduler.step()`` runs after ``optim_post_step``;
    a LearningRateModifier sets the rate at ``optim_pre_step`` and so wins.

    An ``accelerate`` optimizer (``Accelerator.prepare``) called on every micro-batch inside
    ``accelerator.accumulate(...)``, accelerate's gradient-accumulation idiom: its ``step()`` does nothing while
    gradients accumulate (``gradient_state.sync_gradients`` false), and neither do the session's step events nor
    ``scheduler.step()``, so the session and the scheduler count the optimizer steps taken (they counted every
    micro-batch: the schedules ran at the accumulation factor's speed, found by testers).
    """
    steps = getattr(getattr(optimizer, "gradient_state", None), "sync_gradients", True) is not False
    if steps:
        session.optim_pre_step()
    optimizer.step()
    if steps:
        session.optim_post_step()
    if scheduler is not None and steps:  # a scheduler not prepared by accelerate would step every micro-batch
        scheduler.step()
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)


def initialize(
    session: Session, *, checkpoint: str | Path | None = None, teacher_device: Any = None, **state: Any
) -> None:
    """``session.initialize(**state)``, the teacher placed, then (with ``checkpoint``) the saved session resumed.

    Args:
        session: a session in ``created``/``staging``.
        checkpoint: a directory written by ``session.save`` (see the module
            docstring); the checkpoint is read before anything is initialized.
        teacher_device: where the teacher (state ``teacher``, when a modifier
            requires it) is moved after ``initialize``: ``None`` (default) = the
            device of the student's first parameter; ``"auto"``, ``"cpu"``,
            ``"cuda"``, ``"cuda:N"`` or a ``torch.device`` as the one-shot
            ``device`` (:func:`llmc_fsm.integrations.place_teacher`).
        **state: passed to ``Session.initialize``.

    Raises:
        ValueError: ``teacher_device`` does not resolve, or the teacher cannot be
            placed (weights on the meta device; ``teacher_device`` for a teacher
            spread over several devices) — one line, before anything is
            initialized or read.
        MissingStateError: as from ``Session.initialize`` (same ``missing``), the
            message extended by how to supply each key in a plain loop.
        CheckpointError: ``checkpoint`` is unreadable or was written for another
            recipe or ``steps_per_epoch`` (refused before ``initialize``), or a modifier refused its part (the
            session is then put back as it was before the call: :func:`~llmc_fsm.integrations.start_session`).
        LifecycleError, ModifierError: as from ``Session.initialize``.
    """
    device = resolve_teacher_device(teacher_device)
    check_teacher(session, state.get("teacher", session.state.get("teacher")), device)
    saved = read_checkpoint(checkpoint) if checkpoint is not None else None
    start_session(session, saved, device, ("a plain PyTorch loop", _hint), **state)


def resume_position(session: Session, batches_per_epoch: int, gradient_accumulation_steps: int = 1) -> tuple[int, int]:
    """``(epoch, batches to skip in it)`` where a session resumed at ``session.global_step`` continues.

    Valid for a checkpoint saved right after an optimizer step (see the module
    docstring), with the epoch arithmetic of :func:`steps_per_epoch`/:func:`is_step`.

    Raises:
        ValueError: ``batches_per_epoch`` < 1 or ``gradient_accumulation_steps`` < 1, or the optimizer steps per
            epoch they make (``ceil(batches_per_epoch / gradient_accumulation_steps)``) differ from the session's
            ``steps_per_epoch`` (a forgotten accumulation argument, another loader: the position was wrong without a
            word, found by a tester); checked when the session holds a ``steps_per_epoch``.
    """
    count = as_count(batches_per_epoch)
    if count is None or count < 1:
        msg = f"batches_per_epoch must be an int >= 1, got {batches_per_epoch!r}"
        raise ValueError(msg)
    batches_per_epoch = count
    per_epoch = steps_per_epoch(batches_per_epoch, gradient_accumulation_steps)
    session_steps = session.state.get("steps_per_epoch")
    if session_steps is not None and session_steps != per_epoch:
        msg = (
            f"resume_position(): steps_per_epoch is {session_steps} in the session, {per_epoch} from "
            f"batches_per_epoch {batches_per_epoch} and gradient_accumulation_steps {gradient_accumulation_steps} "
            f"(ceil({batches_per_epoch} / {gradient_accumulation_steps})); pass the length of the loader the run "
            "trains on and the gradient_accumulation_steps that gave the session its steps_per_epoch"
        )
        raise ValueError(msg)
    epoch, steps_done = divmod(session.global_step, per_epoch)
    return epoch, steps_done * int(as_count(gradient_accumulation_steps) or 1)
