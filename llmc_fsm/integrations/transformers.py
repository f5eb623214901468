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
                    Trainer's own optimizer steps per epoch (it replaces one
                    given in ``session_state``, with a warning naming both when
                    they differ; that one counts for a dataset without a length)
anything else       ``session_state={"key": value}`` at construction (``model``,
                    ``teacher`` and ``optimizer`` are refused there: pass
                    ``model=``, ``teacher=``, ``optimizers=``)
==================  =============================================================

A session ``model`` that is not the Trainer's (one given with
``trainer.session.update_state(model=...)``; wrappers unwrapped) is refused with a
``ValueError`` at ``train()``, before the Trainer starts (and again at ``on_train_begin``).

``session.initialize()`` runs once in ``on_train_begin``: after the dataloader,
optimizer and model wrapping exist, before the first step. Missing state raises
:class:`~llmc_fsm.MissingStateError` there, with this integration's advice added.

Events come from the Trainer's own step: ``batch_start(batch=inputs,
global_step=state.global_step)`` at the start of every micro-batch
(``training_step``), ``loss_calculated`` inside ``compute_loss`` (a modifier may
replace the loss; the Trainer then divides it for gradient accumulation and
backpropagates it), ``optim_pre_step``/``optim_post_step`` around
``optimizer.step()`` (after gradient clipping), ``batch_end`` at
``on_step_end``/``on_substep_end`` (an ``end`` the step reached fires there,
before the Trainer evaluates and saves that step; an update point at the next
``training_step``), ``finalize`` at ``on_train_end``. The
session's callback runs before every other callback: in a callback of yours,
``on_step_end`` sees the batch ended (``trainer.session.save(...)`` works there)
and ``on_train_begin`` the session initialized.

When a recipe modifier handles ``loss_calculated`` (e.g. distillation), the
trainer sets ``model_accepts_loss_kwargs = False``, so the loss the modifiers see
is the per-micro-batch mean (not pre-divided across the accumulation window) and
the Trainer divides the combined loss by the accumulation steps. With a
``compute_loss_func`` (its loss normalised over the accumulation window; the
Trainer divides it no further) the modifiers get it multiplied by the
accumulation steps and the combined loss is divided back, so a distillation
term weighs the same with or without accumulation.

Refused at construction: ``model_init`` (the Trainer would train a new model,
not the one the session compresses), ``auto_find_batch_size`` (its retry runs
inside the same ``train()``, where the session cannot start again), a
``session=`` already initialized, and a recipe with modifiers that compress on
calibration events only (GPTQ, SparseGPT, AWQ, ...: the Trainer sends none;
also at ``train()``, after a ``session.reset(recipe=...)``).

If ``train()`` raises midway, the session stays ``running``: call
``trainer.session.reset()`` (or ``finalize()``) yourself before the next ``train()``; a modifier's
:class:`~llmc_fsm.ModifierError` says so in its advice (reload the weights first when it changed them). A failed
``initialize`` at ``on_train_begin`` is rolled back: call ``train()`` again, or, when it changed the model's weights,
reload them, ``trainer.session.reset()``, then ``train()``.

Devices: the Trainer places the model (``args.device``); masks and other
modifier state follow its parameters. The teacher is the one model the library
moves: at ``on_train_begin``, once the model is placed, onto the model's device,
or onto ``teacher_device="auto" | "cpu" | "cuda" | "cuda:N"`` (resolved and
refused at construction as the one-shot ``device``;
:func:`llmc_fsm.integrations.place_teacher`).

Checkpoints: every checkpoint the Trainer writes (``save_strategy``) also holds
the session, in ``checkpoint-N/llmc_fsm_session/`` (written after the Trainer's
own files and before its ``save_total_limit`` rotation deletes older checkpoints;
see :mod:`llmc_fsm.session.checkpoint`); ``resume_from_checkpoint=True`` takes
the last checkpoint that holds a session, with a warning when a later one does
not. ``trainer.train(resume_from_checkpoint=
path or True)`` restores it: the Trainer loads model, optimizer, scheduler, RNG
state and skips the trained batches; at ``on_train_begin`` the session is
initialized and then loaded from the checkpoint, so the next step continues
exactly where the saved run stopped (same masks and schedule values; on CPU
with fixed seeds, bitwise-identical weights). A checkpoint without the session
directory, or one written for another recipe or another ``steps_per_epoch``, or
whose global step is not the one in the checkpoint's ``trainer_state.json`` (a session
folder copied from another checkpoint), raises :class:`~llmc_fsm.CheckpointError`
before the Trainer loads anything.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

from llmc_fsm.core.errors import CheckpointError, LifecycleError, ModifierError
from llmc_fsm.integrations import check_teacher, resolve_teacher_device, start_session
from llmc_fsm.session.checkpoint import check_checkpoint, read_checkpoint
from llmc_fsm.session.ranks import unwrap_model
from llmc_fsm.session.scheduling import calibrates_only
from llmc_fsm.session.session import RETRY_ADVICE, Session

__all__ = ["HINTS", "OWN_KEYS", "SESSION_DIR", "SessionCallback", "SessionTrainer", "SessionTrainerMixin"]

logger = logging.getLogger(__name__)

#: What a rolled-back ``initialize`` inside ``train()`` advises instead of the session's :data:`RETRY_ADVICE`.
TRAINER_RETRY_ADVICE = (
    "Fix the cause and call trainer.train() again (the trainer initializes the session at on_train_begin, with the "
    "state staged as before)."
)

#: What a failed ``initialize`` inside ``train()`` that changed the model advises (the session's advice named
#: ``session.reset()`` and "gather the state again", calls the trainer makes: found by a tester).
TRAINER_RELOAD_ADVICE = (
    "Reload the model's weights, call trainer.session.reset(), then trainer.train() again (the trainer stages its "
    "model and teacher again)."
)

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


def _refuse_calibration_only(session: Session) -> None:
    """Refuse a recipe with modifiers that compress on calibration events only (GPTQ, SparseGPT, AWQ, ...): the
    Trainer sends none, so they would do nothing (a tester's case: llm-compressor's three-stage recipe asked for
    ``calibration_data`` the trainer never uses, then left the model dense).

    Raises:
        ValueError: naming them with their stages (and ``run_type``).
    """
    stages = {id(m): stage for stage in session.recipe.stages for m in stage.modifiers}
    idle = []
    for modifier, label in zip(session.modifiers, session.labels, strict=True):
        if calibrates_only(modifier):
            stage = stages.get(id(modifier))
            run_type = f", run_type: {stage.run_type}" if stage is not None and stage.run_type else ""
            idle.append(f"{label} (stage {stage.name!r}{run_type})" if stage is not None else label)
    if idle:
        msg = (
            f"SessionTrainer sends no calibration events, and {', '.join(idle)} "
            f"{'compresses' if len(idle) == 1 else 'compress'} on calibration events only (quantization-aware "
            "training is not implemented): in training they would do nothing. Compress with "
            "llmc_fsm.oneshot(model, recipe) before or after training (it skips run_type: train stages), and give "
            "SessionTrainer a recipe of the training stages only"
        )
        raise ValueError(msg)


#: The state keys SessionTrainer stages itself -> what to pass instead of ``session_state={key: ...}``.
OWN_KEYS: dict[str, str] = {
    "model": "SessionTrainer(model=...)",
    "teacher": "SessionTrainer(teacher=...)",
    "optimizer": "SessionTrainer(optimizers=(optimizer, scheduler))",
}


def _refuse_own_keys(session_state: Any) -> None:
    """Refuse ``session_state`` keys the trainer stages itself (``model``, ``teacher``, ``optimizer``): one given
    there replaced the Trainer's own without a word (the Trainer trained ``model=`` while the session pruned the
    ``session_state`` model; a teacher was checked as ``teacher=`` and used as ``session_state``'s: found by a
    tester).

    Raises:
        ValueError: one line naming the keys and what to pass instead.
    """
    own = [key for key in OWN_KEYS if key in (session_state or {})]
    if own:
        msg = (
            f"SessionTrainer(session_state=...) must not hold {', '.join(repr(k) for k in own)}: the trainer stages "
            f"{'it' if len(own) == 1 else 'them'} itself, and the session would use the given "
            f"{'one' if len(own) == 1 else 'ones'} instead of the Trainer's own; pass "
            f"{', '.join(OWN_KEYS[k] for k in own)} instead"
        )
        raise ValueError(msg)


def _midrun_advice(exc: ModifierError) -> str:
    """The advice of a modifier's failure that stopped ``train()`` midway (the session ``running``), in the trainer's
    calls: the session's own ("Continue, or finalize()/reset() the session") named a continuation the Trainer cannot
    make, and the next ``train()`` was refused until ``trainer.session.reset()`` (found by a tester)."""
    again = (
        "call trainer.session.reset(), then trainer.train() to run the recipe again from step 0 on the model as it "
        "is, or trainer.train(resume_from_checkpoint=...) to continue from a checkpoint"
    )
    if exc.modified:
        return (
            "The session refuses further events and removed every modifier's hooks. Reload the model's weights (or "
            f"resume from a checkpoint, which loads them): {again}."
        )
    return (
        f"No in-place change to a parameter of the model was seen; train() stopped with the session 'running': {again}."
    )


def _checkpoint_step(path: str) -> int | None:
    """The step of a Trainer checkpoint directory ``.../checkpoint-N``, else ``None``."""
    name = os.path.basename(os.path.normpath(path))
    prefix = f"{PREFIX_CHECKPOINT_DIR}-"
    return int(name[len(prefix) :]) if name.startswith(prefix) and name[len(prefix) :].isdigit() else None


def _last_session_checkpoint(output_dir: str) -> str | None:
    """``resume_from_checkpoint=True``: the Trainer's last checkpoint in ``output_dir``, or, when that one holds no
    session (the process stopped between the Trainer's files and the session's), the last one that does, with a
    warning; ``None`` when there is no checkpoint."""
    last = get_last_checkpoint(output_dir)
    if last is None or os.path.isdir(os.path.join(last, SESSION_DIR)):
        return last
    steps = sorted(
        (step, os.path.join(output_dir, name))
        for name in os.listdir(output_dir)
        if (step := _checkpoint_step(name)) is not None and os.path.isdir(os.path.join(output_dir, name, SESSION_DIR))
    )
    if not steps:
        return last  # refused with the session checkpoint's own error
    logger.warning(
        "resume_from_checkpoint=True: %s holds no session (%s/ missing: the run stopped before writing it); "
        "resuming from %s, the last checkpoint that holds one",
        last,
        SESSION_DIR,
        steps[-1][1],
    )
    return steps[-1][1]


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
        session_state: any other state keys, ``{"key": value}`` (not ``model``, ``teacher``, ``optimizer``).

    Attributes:
        session: the :class:`~llmc_fsm.Session`.

    Raises:
        ValueError: both ``recipe`` and ``session`` given, ``session_state`` holds ``model``, ``teacher`` or
            ``optimizer`` (the trainer stages them), ``model_init`` given, a modifier of the recipe compresses
            on calibration events only (the Trainer sends none), ``teacher_device`` does
            not resolve, or the teacher cannot be placed (weights on the meta
            device; ``teacher_device`` for a teacher spread over several devices)
            — at construction, before the Trainer is built; ``auto_find_batch_size`` set in the Trainer's
            arguments (once they are read, in construction).
        LifecycleError: ``session`` is not ``created`` / ``staging`` (before the Trainer is built).
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
        _refuse_own_keys(session_state)
        if kwargs.get("model_init") is not None:
            msg = (
                "SessionTrainer does not take model_init: the Trainer calls it again in train() (and in "
                "hyperparameter_search) and trains that new model, while the session compresses the model staged at "
                "construction; build the model yourself and pass model="
            )
            raise ValueError(msg)
        if session is not None and session.lifecycle not in ("created", "staging"):
            msg = (
                f"SessionTrainer(session=...): the session is {session.lifecycle!r}; the trainer stages its model and "
                "initializes the session at on_train_begin, so give a session in 'created' or 'staging' (a new "
                "Session, or session.reset() first)"
            )
            raise LifecycleError(msg, lifecycle=session.lifecycle, call="SessionTrainer", allowed=session.allowed_calls)
        self._llmc_teacher_device = resolve_teacher_device(teacher_device)
        self.session: Session = session if session is not None else Session(recipe)
        _refuse_calibration_only(self.session)
        given = teacher if teacher is not None else self.session.state.get("teacher")
        check_teacher(self.session, given, self._llmc_teacher_device)
        self._llmc_loss_pending = False
        self._llmc_resume: str | None = None
        self._llmc_saved: dict[str, Any] | None = None  # the session checkpoint train() was asked to resume
        self._llmc_spe_warned = False  # a given steps_per_epoch replaced by the Trainer's was named
        super().__init__(*args, **kwargs)
        if getattr(self.args, "auto_find_batch_size", False):  # type: ignore[attr-defined]
            msg = (
                "SessionTrainer does not take auto_find_batch_size: after an out-of-memory error the Trainer retries "
                "with a smaller batch size inside the same train() call, and the session the first try initialized "
                "(its steps_per_epoch from the first batch size) cannot start again; set "
                "per_device_train_batch_size yourself"
            )
            raise ValueError(msg)
        state: dict[str, Any] = {"model": self.model}
        if teacher is not None:
            state["teacher"] = teacher
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer
        state.update(session_state or {})
        self.session.update_state(**state)
        self._llmc_staged = dict(state)  # staged again by train() after a session.reset() dropped it
        self._llmc_accepts_loss_kwargs = self.model_accepts_loss_kwargs  # the Trainer's own choice
        self._llmc_loss_kwargs()
        # first among the Trainer's callbacks: a user callback's on_step_end sees the batch ended (it may save the
        # session; it was refused there, found by a tester), its on_train_begin the session initialized
        self.callback_handler.callbacks.insert(0, SessionCallback(self))

    def _llmc_loss_kwargs(self) -> None:
        """``model_accepts_loss_kwargs`` off while a recipe modifier reads the loss (``loss_calculated``), so that
        it sees the per-micro-batch mean; the Trainer's own choice otherwise (again at each ``train()``: a
        ``session.reset(recipe=...)`` may change the recipe)."""
        reads = any("loss_calculated" in m.events for m in self.session.modifiers)
        self.model_accepts_loss_kwargs = self._llmc_accepts_loss_kwargs and not reads

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
            steps = self._llmc_steps_per_epoch(dataloader)
            if steps is not None:
                self._llmc_warn_steps_per_epoch(steps, len(dataloader))
                state["steps_per_epoch"] = steps
            self.session.update_state(**state)
        return dataloader

    def _llmc_warn_steps_per_epoch(self, steps: int, batches: int) -> None:
        """One warning line when a ``steps_per_epoch`` staged before (``session_state``, ``update_state``) differs
        from the Trainer's own count ``steps``, which replaces it: the schedules' epochs are then the Trainer's
        (its logs, ``eval_strategy="epoch"``, its checkpoints). The given value was replaced without a word
        (found by a tester)."""
        given = self.session.state.get("steps_per_epoch")
        if given is not None and given != steps and not self._llmc_spe_warned:
            self._llmc_spe_warned = True
            logger.warning(
                "SessionTrainer: steps_per_epoch %d given in the session state is replaced by %d, the Trainer's own "
                "optimizer steps per epoch (ceil(%d batches / gradient_accumulation_steps %d)), so the recipe's "
                "epochs are the Trainer's; a given steps_per_epoch is used only for a training dataset without a "
                "length (an IterableDataset). To stretch a schedule, change start/end/update in the recipe",
                given,
                steps,
                batches,
                self.args.gradient_accumulation_steps,  # type: ignore[attr-defined]
            )

    def _llmc_steps_per_epoch(self, dataloader: Any) -> int | None:
        """The Trainer's optimizer steps per epoch over ``dataloader`` (``None`` without a length)."""
        try:
            batches = len(dataloader)
        except TypeError:
            return None
        accumulation = self.args.gradient_accumulation_steps  # type: ignore[attr-defined]
        return max(1, math.ceil(batches / accumulation)) if batches else None

    def _initialize_session(self) -> None:
        """Initialize the session (called at ``on_train_begin``, before the first step); resume it if asked."""
        saved = self._llmc_saved
        extra = {}
        optimizer = self.optimizer  # type: ignore[attr-defined]
        if optimizer is not None and self.session.state.get("optimizer") is not optimizer:
            extra["optimizer"] = optimizer  # the accelerate-prepared wrapper, same param_groups
        self._llmc_check_model()
        check_teacher(self.session, self.session.state.get("teacher"), self._llmc_teacher_device)
        try:  # the teacher placed where the Trainer put the model; steps_per_epoch is staged now (the dataloader)
            start_session(self.session, saved, self._llmc_teacher_device, ("SessionTrainer", _hint), **extra)
        except CheckpointError as exc:  # the session as before train(): train() may be called again
            raise self._named(exc) from exc
        except ModifierError as exc:  # rolled back: the user's call to make again is train(), not initialize()
            if exc.modified:  # the session refuses everything but reset() now
                exc.set_advice(f"{exc.advice} {TRAINER_RELOAD_ADVICE}".strip())
            else:
                exc.set_advice(exc.advice.replace(RETRY_ADVICE, TRAINER_RETRY_ADVICE))
            raise

    def _llmc_check_model(self) -> None:
        """Refuse, before the session is initialized, a session ``model`` that is not the model the Trainer trains
        (wrappers unwrapped: DDP / accelerate, ``torch.compile``, peft). A model given with
        ``trainer.session.update_state(model=other)`` replaced the Trainer's without a word: the Trainer trained its
        model while the session pruned ``other`` and reported its sparsity (found by a tester).

        Raises:
            ValueError: one line; nothing is changed (the session is still staged).
        """
        staged = self.session.state.get("model")
        trained = self.model  # type: ignore[attr-defined]
        if staged is None or staged is trained or unwrap_model(staged) is unwrap_model(trained):
            return
        msg = (
            f"SessionTrainer: the session's state 'model' ({type(staged).__name__}, given with "
            f"session.update_state(model=...)) is not the model the Trainer trains ({type(trained).__name__}, "
            "SessionTrainer(model=...)), so the session would compress a model that is not trained; leave state "
            "'model' to SessionTrainer (it stages model=) or build the trainer with SessionTrainer(model=that_model)"
        )
        raise ValueError(msg)

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

    def _llmc_check_resume_step(self, step: int) -> None:
        """Refuse a session checkpoint saved at ``step`` beside a ``trainer_state.json`` at another global step (a
        session folder from another checkpoint or run): the Trainer continued from its step and the schedules jumped
        to the session's, without a word (found by a tester). No ``trainer_state.json``, or one that does not read:
        left to the Trainer.

        Raises:
            CheckpointError: one line naming both steps and the folder; nothing changed yet.
        """
        path = os.path.join(str(self._llmc_resume), TRAINER_STATE_NAME)
        try:
            with open(path, encoding="utf-8") as file:
                trainer_step = json.load(file).get("global_step")
        except (OSError, ValueError, AttributeError):
            return
        if isinstance(trainer_step, int) and not isinstance(trainer_step, bool) and trainer_step != step:
            msg = (
                f"resume_from_checkpoint={self._llmc_resume}: its session ({SESSION_DIR}/) was saved at global step "
                f"{step}, its {TRAINER_STATE_NAME} at global step {trainer_step}: they come from different steps (a "
                f"{SESSION_DIR}/ copied from another checkpoint or run?), and the recipe's schedule would jump; resume "
                f"from a checkpoint folder as SessionTrainer wrote it"
            )
            raise CheckpointError(msg)

    # --- checkpoints -----------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; with ``resume_from_checkpoint`` the session is restored from that checkpoint too.

        A session ``reset()`` after an earlier ``train()`` (finished, or stopped by an error) gets back what this
        trainer staged at construction (model, teacher, ``session_state``): the recipe runs again from step 0 on
        the model as the earlier run left it.

        Raises:
            ValueError: ``resume_from_checkpoint=True`` and ``output_dir`` holds no checkpoint, or the recipe (after a
                ``session.reset(recipe=...)``) has a modifier that compresses on calibration events only.
            LifecycleError: the session is not ``created`` / ``staging`` (an earlier ``train()`` finished or stopped
                midway, and the session was not reset), or allows only ``reset()`` (a failed ``initialize`` changed
                the model's weights: reload them, ``trainer.session.reset()``, then ``train()``).
            ValueError: the session's ``model`` is not the model the Trainer trains (given with
                ``trainer.session.update_state(model=...)``), before the Trainer starts and again at
                ``on_train_begin``; the session is still staged.
            ModifierError: a modifier's ``on_initialize`` raised at ``on_train_begin``; rolled back (the message
                says to call ``train()`` again, or, when it changed the model, to reload the weights and
                ``trainer.session.reset()`` first). A modifier's hook that raised later stops the Trainer, the
                session ``running``: the advice names ``trainer.session.reset()`` then ``train()``.
            CheckpointError: the session checkpoint does not match the session: another recipe, or a global step
                other than the checkpoint's ``trainer_state.json``, is refused before the Trainer loads anything;
                whatever fails after the session is initialized puts it back as it was (staged, same state), so
                train() may be called again.
        """
        lifecycle = self.session.lifecycle
        if lifecycle in ("created", "staging") and "initialize" not in self.session.allowed_calls:
            msg = (
                "SessionTrainer.train() refused: a failed initialize (an earlier train()) changed the model's weights "
                f"in place, so its session allows only reset(). {TRAINER_RELOAD_ADVICE}"
            )
            raise LifecycleError(msg, lifecycle=lifecycle, call="train", allowed=self.session.allowed_calls)
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
        self._llmc_check_model()  # before the Trainer loads a checkpoint into its model (again at on_train_begin)
        if resume_from_checkpoint is True:
            resume_from_checkpoint = _last_session_checkpoint(self.args.output_dir)  # type: ignore[attr-defined]
            if resume_from_checkpoint is None:
                msg = f"No valid checkpoint found in output directory ({self.args.output_dir})"  # type: ignore[attr-defined]
                raise ValueError(msg)
        self._llmc_resume = str(resume_from_checkpoint) if resume_from_checkpoint else None
        self._llmc_saved = self._read_session_checkpoint()
        if self._llmc_saved is not None and self.session.lifecycle in ("created", "staging"):
            # the count get_train_dataloader will stage, which replaces a steps_per_epoch given in session_state
            steps = self._llmc_steps_per_epoch(super().get_train_dataloader())  # type: ignore[misc]
            given = {"steps_per_epoch": steps} if steps is not None else {}
            try:  # another recipe or steps_per_epoch: refused before the Trainer loads the checkpoint's weights
                check_checkpoint(self._llmc_saved, self.session, **given)
            except CheckpointError as exc:
                raise self._named(exc) from exc
            self._llmc_check_resume_step(self._llmc_saved["global_step"])
        _refuse_calibration_only(self.session)  # a session.reset(recipe=...) may have changed the recipe
        self._llmc_loss_kwargs()
        try:
            return super().train(resume_from_checkpoint or None, *args, **kwargs)  # type: ignore[misc]
        except ModifierError as exc:
            if self.session.lifecycle == "running" and exc.advice:  # a hook failed mid-run: the Trainer stopped
                exc.set_advice(_midrun_advice(exc))
            raise

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint, then the session in it, then the Trainer's rotation (``save_total_limit``):
        older checkpoints are deleted only once this one holds the session (a process killed in between left no
        checkpoint to resume from: a tester's case)."""
        args = self.args  # type: ignore[attr-defined]
        limit, args.save_total_limit = args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
        finally:
            args.save_total_limit = limit
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"  # type: ignore[attr-defined]
        run_dir = self._get_output_dir(trial=trial)  # type: ignore[attr-defined]
        if args.should_save:
            self.session.save(os.path.join(run_dir, folder, SESSION_DIR))
            if limit:
                rotate_checkpoints(
                    output_dir=run_dir,
                    save_total_limit=limit,
                    best_model_checkpoint=self.state.best_model_checkpoint,  # type: ignore[attr-defined]
                    use_mtime=True,
                )

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
        loss, outputs = result if return_outputs else (result, None)
        loss = self._llmc_loss_calculated(loss)
        return (loss, outputs) if return_outputs else loss

    def _llmc_loss_calculated(self, loss: Any) -> Any:
        """``session.loss_calculated(loss)`` on the per-micro-batch scale. A loss already scaled for gradient
        accumulation (a ``compute_loss_func``, normalised by ``num_items_in_batch`` over the accumulation window;
        the Trainer then divides it no further) is multiplied by the accumulation steps for the modifiers and the
        combined loss divided back: a distillation term (a per-micro-batch mean) is then weighted as with the
        Trainer's own loss (it was weighted N times over with N accumulation steps: a tester's case)."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:  # the Trainer's rule (model_accepts_loss_kwargs is off while a modifier reads the loss)
            scaled = self.compute_loss_func is not None  # type: ignore[attr-defined]
        steps = getattr(self, "current_gradient_accumulation_steps", 1) if scaled else 1
        if steps == 1:
            return self.session.loss_calculated(loss)
        return self.session.loss_calculated(loss * steps) / steps


class SessionTrainer(SessionTrainerMixin, Trainer):
    """``transformers.Trainer`` driving a :class:`~llmc_fsm.Session` (see the module docstring)."""
