"""A ``transformers.Trainer`` integration: the Trainer drives the session's lifecycle.

Usage::

    from llmc_fsm.integrations.transformers import SessionTrainer

    trainer = SessionTrainer(model=student, args=args, train_dataset=ds,
                             recipe=recipe, teacher=teacher)   # or session=Session(...)
    trainer.train()            # initialize before the first step, finalize at the end
    trainer.session            # the Session (finalized after train())

Where each piece of state is handed over (``session.update_state``), where the
objects are born:

==================  =============================================================
``model``           at construction (``self.model`` after ``Trainer.__init__``)
``teacher``         at construction, from ``teacher=`` (put in eval mode by the
                    distillation modifier; moved at ``on_train_begin`` to the
                    device the Trainer put the model on, or to ``teacher_device``)
``optimizer``       when the Trainer creates it (``create_optimizer``), or at
                    construction when passed with ``optimizers=(opt, sched)``
``train_data``,     in ``get_train_dataloader``: the real dataloader and
``steps_per_epoch`` ``ceil(len(dataloader) / gradient_accumulation_steps)``, the
                    Trainer's own optimizer steps per epoch
anything else       ``session_state={"key": value}`` at construction
==================  =============================================================

``session.initialize()`` runs once in ``on_train_begin``: after the dataloader,
optimizer and model wrapping exist, before the first step. Missing state raises
:class:`~llmc_fsm.MissingStateError` there, with this integration's advice added.

Events come from the Trainer's own step: ``batch_start(batch=inputs,
global_step=state.global_step)`` at the start of every micro-batch
(``training_step``), ``loss_calculated`` inside ``compute_loss`` (a modifier may
replace the loss; the Trainer then divides it for gradient accumulation and
backpropagates it), ``optim_pre_step``/``optim_post_step`` around
``optimizer.step()`` (after gradient clipping), ``batch_end`` at
``on_step_end``/``on_substep_end``, ``finalize`` at ``on_train_end``.

When a recipe modifier handles ``loss_calculated`` (e.g. distillation), the
trainer sets ``model_accepts_loss_kwargs = False``, so the loss the modifiers see
is the per-micro-batch mean (not pre-divided across the accumulation window) and
the Trainer divides the combined loss by the accumulation steps.

If ``train()`` raises midway, the session stays ``running``: call
``trainer.session.finalize()`` (or ``reset()``) yourself.

Devices: the Trainer places the model (``args.device``); masks and other
modifier state follow its parameters. The teacher is the one model the library
moves: at ``on_train_begin``, once the model is placed, onto the model's device,
or onto ``teacher_device="auto" | "cpu" | "cuda" | "cuda:N"`` (resolved and
refused at construction as the one-shot ``device``;
:func:`llmc_fsm.integrations.place_teacher`).

Checkpoints: every checkpoint the Trainer writes (``save_strategy``) also holds
the session, in ``checkpoint-N/llmc_fsm_session/`` (written after the Trainer's
own files; see :mod:`llmc_fsm.session.checkpoint`). ``trainer.train(resume_from_checkpoint=
path or True)`` restores it: the Trainer loads model, optimizer, scheduler, RNG
state and skips the trained batches; at ``on_train_begin`` the session is
initialized and then loaded from the checkpoint, so the next step continues
exactly where the saved run stopped (same masks and schedule values; on CPU
with fixed seeds, bitwise-identical weights). A checkpoint without the session
directory, or one written for another recipe, raises
:class:`~llmc_fsm.CheckpointError` before the first step.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from llmc_fsm.core.errors import CheckpointError, LifecycleError
from llmc_fsm.integrations import check_teacher, resolve_teacher_device, start_session
from llmc_fsm.session.checkpoint import check_checkpoint, read_checkpoint
from llmc_fsm.session.session import Session

__all__ = ["HINTS", "SESSION_DIR", "SessionCallback", "SessionTrainer", "SessionTrainerMixin"]

logger = logging.getLogger(__name__)

#: The session's directory inside each ``checkpoint-N/``.
SESSION_DIR = "llmc_fsm_session"

#: How to pass each well-known key with SessionTrainer (used in MissingStateError messages).
HINTS: dict[str, str] = {
    "model": "SessionTrainer(model=model, ...)",
    "teacher": "SessionTrainer(..., teacher=teacher_model)",
    "optimizer": (
        "the Trainer creates it in create_optimizer() before training starts; to use your own pass "
        "SessionTrainer(..., optimizers=(optimizer, scheduler))"
    ),
    "steps_per_epoch": (
        "computed from the training dataloader and gradient_accumulation_steps; give a train_dataset with a "
        "length, or for an IterableDataset pass SessionTrainer(..., session_state={'steps_per_epoch': N})"
    ),
    "train_data": "set from the Trainer's training dataloader; give SessionTrainer(..., train_dataset=...)",
}


def _hint(key: str) -> str:
    return HINTS.get(
        key,
        f"SessionTrainer(..., session_state={{'{key}': ...}}), or trainer.session.update_state({key}=...) "
        "before trainer.train()",
    )


class SessionCallback(TrainerCallback):
    """Fires the optimizer/batch-end events and the lifecycle calls from the Trainer's callback points.

    Added by :class:`SessionTrainerMixin`; not useful alone (``batch_start`` and
    ``loss_calculated`` come from the trainer's ``training_step``/``compute_loss``).
    """

    def __init__(self, trainer: SessionTrainerMixin) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._initialize_session()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.session.optim_pre_step()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.session.optim_post_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.session.batch_end()

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.session.batch_end()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session = self.trainer.session
        best = getattr(state, "best_model_checkpoint", None) if args.load_best_model_at_end else None
        step = _checkpoint_step(best) if best else None
        if step is not None and step != state.global_step:  # the Trainer loaded it before this callback
            logger.warning(
                "load_best_model_at_end: the Trainer loaded %s (step %d) after the last step (%d), so the model "
                "holds step %d's weights: what the recipe's modifiers did after it (e.g. a sparsity schedule's "
                "later updates) is not in them; the session is finalized on that model",
                best,
                step,
                state.global_step,
                step,
            )
        if session.lifecycle in ("initialized", "running"):
            session.finalize()


def _checkpoint_step(path: str) -> int | None:
    """The step of a Trainer checkpoint directory ``.../checkpoint-N``, else ``None``."""
    name = os.path.basename(os.path.normpath(path))
    prefix = f"{PREFIX_CHECKPOINT_DIR}-"
    return int(name[len(prefix) :]) if name.startswith(prefix) and name[len(prefix) :].isdigit() else None


class SessionTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass (before it) to drive a :class:`~llmc_fsm.Session`.

    Keyword arguments (on top of the Trainer's):
        recipe: a recipe (anything :class:`~llmc_fsm.Session` accepts); a new
            session is created from it. Give ``recipe`` or ``session``.
        session: an existing session in ``created``/``staging`` (e.g. one you
            already gave extra state with ``update_state``).
        teacher: the teacher model for distillation (state key ``teacher``).
        teacher_device: where the teacher is moved at ``on_train_begin``:
            ``None`` (default) = the device of the model's first parameter, once
            the Trainer has placed it; ``"auto"``, ``"cpu"``, ``"cuda"``,
            ``"cuda:N"`` or a ``torch.device`` as the one-shot ``device``.
        session_state: any other state keys, ``{"key": value}``.

    Attributes:
        session: the :class:`~llmc_fsm.Session`.

    Raises:
        ValueError: both ``recipe`` and ``session`` given, ``teacher_device`` does
            not resolve, or the teacher cannot be placed (weights on the meta
            device; ``teacher_device`` for a teacher spread over several devices)
            — at construction, before the Trainer is built.
    """

    def __init__(
        self,
        *args: Any,
        recipe: Any = None,
        session: Session | None = None,
        teacher: Any = None,
        teacher_device: Any = None,
        session_state: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if session is not None and recipe is not None:
            msg = "give recipe= or session=, not both (a session already holds its recipe)"
            raise ValueError(msg)
        self._llmc_teacher_device = resolve_teacher_device(teacher_device)
        self.session: Session = session if session is not None else Session(recipe)
        given = teacher if teacher is not None else (session_state or {}).get("teacher")
        given = given if given is not None else self.session.state.get("teacher")
        check_teacher(self.session, given, self._llmc_teacher_device)
        self._llmc_loss_pending = False
        self._llmc_resume: str | None = None
        self._llmc_saved: dict[str, Any] | None = None  # the session checkpoint train() was asked to resume
        super().__init__(*args, **kwargs)
        state: dict[str, Any] = {"model": self.model}
        if teacher is not None:
            state["teacher"] = teacher
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer
        state.update(session_state or {})
        self.session.update_state(**state)
        self._llmc_staged = dict(state)  # staged again by train() after a session.reset() dropped it
        if any("loss_calculated" in m.events for m in self.session.modifiers):
            self.model_accepts_loss_kwargs = False
        self.add_callback(SessionCallback(self))

    # --- where the objects are born ---------------------------------------------
    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = super().create_optimizer(*args, **kwargs)  # type: ignore[misc]
        if self.session.lifecycle in ("created", "staging"):
            self.session.update_state(optimizer=optimizer)
        return optimizer

    def get_train_dataloader(self) -> Any:
        dataloader = super().get_train_dataloader()  # type: ignore[misc]
        if self.session.lifecycle in ("created", "staging"):
            state: dict[str, Any] = {"train_data": dataloader}
            try:
                batches = len(dataloader)
            except TypeError:
                batches = None
            if batches:
                accumulation = self.args.gradient_accumulation_steps  # type: ignore[attr-defined]
                state["steps_per_epoch"] = max(1, math.ceil(batches / accumulation))
            self.session.update_state(**state)
        return dataloader

    def _initialize_session(self) -> None:
        """Initialize the session (called at ``on_train_begin``, before the first step); resume it if asked."""
        saved = self._llmc_saved
        extra = {}
        optimizer = self.optimizer  # type: ignore[attr-defined]
        if optimizer is not None and self.session.state.get("optimizer") is not optimizer:
            extra["optimizer"] = optimizer  # the accelerate-prepared wrapper, same param_groups
        check_teacher(self.session, self.session.state.get("teacher"), self._llmc_teacher_device)
        try:  # the teacher placed where the Trainer put the model; steps_per_epoch is staged now (the dataloader)
            start_session(self.session, saved, self._llmc_teacher_device, ("SessionTrainer", _hint), **extra)
        except CheckpointError as exc:  # the session as before train(): train() may be called again
            raise self._named(exc) from exc

    def _named(self, exc: CheckpointError) -> CheckpointError:
        """``exc`` with the checkpoint it was read from first."""
        return CheckpointError(f"resume_from_checkpoint={self._llmc_resume}: {exc}", differences=exc.differences)

    def _read_session_checkpoint(self) -> dict[str, Any] | None:
        if self._llmc_resume is None:
            return None
        path = os.path.join(self._llmc_resume, SESSION_DIR)
        try:
            return read_checkpoint(path)
        except CheckpointError as exc:
            msg = (
                f"resume_from_checkpoint={self._llmc_resume}: {exc}. Checkpoints written by SessionTrainer hold "
                f"the session in {SESSION_DIR}/; resume from one of those, or train without resume_from_checkpoint."
            )
            raise CheckpointError(msg) from exc

    # --- checkpoints -----------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; with ``resume_from_checkpoint`` the session is restored from that checkpoint too.

        A session ``reset()`` after an earlier ``train()`` (finished, or stopped by an error) gets back what this
        trainer staged at construction (model, teacher, ``session_state``): the recipe runs again from step 0 on
        the model as the earlier run left it.

        Raises:
            ValueError: ``resume_from_checkpoint=True`` and ``output_dir`` holds no checkpoint.
            LifecycleError: the session is not ``created`` / ``staging`` (an earlier ``train()`` finished or stopped
                midway, and the session was not reset).
            CheckpointError: the session checkpoint does not match the session: another recipe is refused before
                the Trainer loads anything; whatever fails after the session is initialized puts it back as it
                was (staged, same state), so train() may be called again.
        """
        lifecycle = self.session.lifecycle
        if lifecycle not in ("created", "staging"):
            earlier = "finished" if lifecycle == "finalized" else "stopped midway"
            msg = (
                f"SessionTrainer.train() refused: its session is {lifecycle!r} (an earlier train() {earlier}); call "
                "trainer.session.reset() first to run the recipe again from step 0 on the model as that run left it "
                "(this trainer stages its model and teacher again), or build a new SessionTrainer"
            )
            raise LifecycleError(msg, lifecycle=lifecycle, call="train", allowed=self.session.allowed_calls)
        dropped = {k: v for k, v in self._llmc_staged.items() if k not in self.session.state}
        if dropped:  # reset() dropped what __init__ staged (whatever was staged since)
            self.session.update_state(**dropped)
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)  # type: ignore[attr-defined]
            if resume_from_checkpoint is None:
                msg = f"No valid checkpoint found in output directory ({self.args.output_dir})"  # type: ignore[attr-defined]
                raise ValueError(msg)
        self._llmc_resume = str(resume_from_checkpoint) if resume_from_checkpoint else None
        self._llmc_saved = self._read_session_checkpoint()
        if self._llmc_saved is not None and self.session.lifecycle in ("created", "staging"):
            try:  # another recipe: refused before the Trainer loads the checkpoint's weights
                check_checkpoint(self._llmc_saved, self.session)
            except CheckpointError as exc:
                raise self._named(exc) from exc
        return super().train(resume_from_checkpoint or None, *args, **kwargs)  # type: ignore[misc]

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)  # type: ignore[misc]
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"  # type: ignore[attr-defined]
        output_dir = os.path.join(self._get_output_dir(trial=trial), folder)  # type: ignore[attr-defined]
        if self.args.should_save:  # type: ignore[attr-defined]
            self.session.save(os.path.join(output_dir, SESSION_DIR))

    # --- the Trainer's own step ---------------------------------------------------
    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self.session.batch_start(batch=inputs, global_step=self.state.global_step)  # type: ignore[attr-defined]
        self._llmc_loss_pending = True
        try:
            return super().training_step(model, inputs, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._llmc_loss_pending = False

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        result = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)  # type: ignore[misc]
        if not self._llmc_loss_pending:  # evaluation, or a second compute_loss in one step
            return result
        self._llmc_loss_pending = False
        if return_outputs:
            loss, outputs = result
            return self.session.loss_calculated(loss), outputs
        return self.session.loss_calculated(result)


class SessionTrainer(SessionTrainerMixin, Trainer):
    """``transformers.Trainer`` driving a :class:`~llmc_fsm.Session` (see the module docstring)."""
