"""The event half of :class:`~llmc_fsm.Session`: refusals, guarded hook calls and the eight events.

Per-batch events do not go through ``transitions`` triggers: ``_enter`` checks
the order with one lookup in :data:`~llmc_fsm.core.lifecycle.EVENT_ORDER`, and
``_dispatch`` calls the modifiers :class:`~llmc_fsm.session.scheduling.Schedule`
resolved for the event. Each public event holds the session's lock; each hook
call is guarded by the modifier's :class:`~llmc_fsm.core.guard.Guard`: the
version counters of its targeted parameters are read before it, those of every
other parameter of the modules in the state (the model, a teacher...) at the
hook's first torch call (or before it, once that hook has made a torch call),
and compared only if it raises — so a failure names what it changed inside or
outside the declared targets, and a hook that makes no torch call (a schedule, a
no-op) pays the push and pop of a torch-function mode, not one read per parameter.
"""

from __future__ import annotations

import logging
import numbers
from contextlib import AbstractContextManager
from typing import Any, NoReturn

from transitions import MachineError

from llmc_fsm.core.errors import EventOrderError, LifecycleError, ModifierError
from llmc_fsm.core.guard import Guard, failure
from llmc_fsm.core.lifecycle import EVENT_ORDER, allowed_now, format_calls, order_refusal, refusal
from llmc_fsm.core.modifier import Event
from llmc_fsm.core.state import State
from llmc_fsm.session.scheduling import Schedule, Slot

__all__ = ["SessionEvents"]

logger = logging.getLogger(__name__)


class SessionEvents:
    """Events, refusals and hook failures of a session (mixed into :class:`~llmc_fsm.Session`)."""

    _lock: AbstractContextManager[Any]  # a threading.RLock
    _fsm: Any
    _state: State
    _position: str
    _step: int
    _schedule: Schedule
    _event: Event
    _broken: str | None
    _in_hook: str | None  # the call whose modifier hooks are running now (a hook calling the session is refused)
    _trained: bool  # a training batch began in this run
    _stepped: bool  # an optim_post_step came in this run
    _calibrated: bool  # a calibration ended in this run
    _loss_given: bool  # a loss_calculated came in the open batch
    _loss_warned: bool  # a batch without loss_calculated was named in this run
    _jump_warned: bool  # a batch_start(global_step=...) ahead of the counted optimizer steps was named in this run

    @property
    def lifecycle(self) -> str:
        """``"created"``, ``"staging"``, ``"initialized"``, ``"running"`` or ``"finalized"``."""
        return self._fsm.state

    @property
    def allowed_calls(self) -> frozenset[str]:
        """The public calls allowed now: lifecycle calls and the events the event order allows next."""
        calls = allowed_now(self.lifecycle, self._position)
        # after a failed hook changed the model, initialize() is refused until reset(), which drops the state: so is
        # update_state() (it was listed as allowed while the initialize() after it was still refused; a tester's case)
        return calls - {"initialize", "update_state"} if self._broken is not None else calls

    # --- refusals and triggers -------------------------------------------------
    def _refuse(self, call: str) -> NoReturn:
        lifecycle = self.lifecycle
        allowed = self.allowed_calls
        if self._broken is not None and call not in allowed:
            msg = f"{call}() refused: {self._broken} Allowed now: {format_calls(allowed)}."
            raise LifecycleError(msg, lifecycle=lifecycle, call=call, allowed=allowed) from None
        msg = refusal(call, lifecycle, self._position)
        raise LifecycleError(msg, lifecycle=lifecycle, call=call, allowed=allowed) from None

    def _refuse_from_hook(self, call: str) -> None:
        """Refuse ``call`` made from inside a modifier's hook of this session (the lock is re-entrant, so the same
        thread gets here): the event being dispatched would reach the other modifiers out of order, a finalize
        would finalize a modifier whose hook is still running."""
        if self._in_hook is None:
            return
        msg = (
            f"{call}() refused: called from a modifier's hook while the session runs {self._in_hook}; a hook must "
            f"not drive its own session (the other modifiers would see the events out of order): make the call from "
            f"your code after {self._in_hook} returns. Nothing was changed."
        )
        raise LifecycleError(msg, lifecycle=self.lifecycle, call=call, allowed=frozenset())

    def _refuse_event(self, event: str) -> NoReturn:
        if self._position == "closed":
            self._refuse(event)
        msg = order_refusal(event, self._position, self.lifecycle, self.allowed_calls)
        raise EventOrderError(msg, lifecycle=self.lifecycle, call=event, allowed=self.allowed_calls) from None

    def _fire(self, trigger: str) -> None:
        """Fire a ``transitions`` trigger; the session checked it first, so a MachineError is a bug here."""
        try:
            getattr(self._fsm, trigger)()
        except MachineError as exc:  # pragma: no cover - every call is checked before its trigger
            msg = f"{trigger}() refused in lifecycle {self.lifecycle!r}: {exc.value}"
            raise LifecycleError(msg, lifecycle=self.lifecycle, call=trigger, allowed=self.allowed_calls) from None

    # --- failures ---------------------------------------------------------------
    def _hook_failed(self, error: ModifierError) -> None:
        """A guarded hook failed (see :mod:`llmc_fsm.core.guard`): refuse further events if it modified the model."""
        if not error.modified:
            return
        with self._lock:
            if self._broken is None:
                self._broken = (
                    f"{error.modifier}'s {error.hook} failed after changing {len(error.modified)} parameter(s) in "
                    "place (model modified by a failed hook; reload it): reload the model (or the last "
                    "checkpoint), then session.reset() or a new Session."
                )
                self._position = "closed"
                for slot in self._schedule.slots:
                    slot.modifier.remove_hooks()

    def _event_failed(self, slot: Slot, hook: str, exc: Exception, token: Any, guard: Guard) -> NoReturn:
        modified = guard.failed(token)
        during = f"{self._event.type}()"
        if modified:
            then = "The session refuses further events and removed every modifier's hooks."
        else:
            checked = (
                "No in-place change to a parameter of the model was seen."
                if guard.tensors
                else "The state holds no model."
            )
            then = (
                f"{checked} The event counts as delivered; modifiers after this one did "
                "not see it. Continue, or finalize()/reset() the session."
            )
        outside = guard.outside(modified)
        error = failure(slot.label, hook, exc, during=during, modified=modified, outside=outside, then=then)
        self._hook_failed(error)
        raise error from exc

    def _call(self, slot: Slot, hook: str, *args: Any) -> Any:
        """Call ``slot``'s ``hook(state, *args)`` guarded (schedule and calibration hooks)."""
        return self._guarded(slot, slot.guard.for_hook(hook), hook, getattr(slot.modifier, hook), *args)

    def _guarded(self, slot: Slot, guard: Guard, hook: str, fn: Any, *args: Any) -> Any:
        """Call ``fn(state, *args)`` (``slot``'s ``hook``) inside ``guard`` (lazy or eager)."""
        token = guard.enter()
        outer, self._in_hook = self._in_hook, f"{self._event.type}()"
        try:
            result = fn(self._state, *args)
        except Exception as exc:
            self._event_failed(slot, hook, exc, token, guard)
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: propagated as they are, but a hook that had
            modified = guard.failed(token)  # changed the model first leaves the session refusing events, as for an
            if modified:  # Exception (it accepted the next event and a rotation ran twice: found by a tester)
                during = f"{self._event.type}()"
                self._hook_failed(failure(slot.label, hook, exc, during=during, modified=modified))
            raise
        finally:
            self._in_hook = outer
        guard.leave(token)
        return result

    # --- events (hot path: no transitions trigger, one dict lookup) ------------
    def _enter(self, event: str, step: int | None = None) -> Event:
        """Check the event order (one lookup), then set the global step (if given) and the shared Event. An event
        sent from inside a modifier's hook is refused first (:meth:`_refuse_from_hook`)."""
        position = self._check_order(event)
        if step is not None:
            if step < self._step:
                self._refuse_step_back(event, step)
            self._step = step
        if self._fsm.state == "initialized":
            self._fsm.first_event()  # type: ignore[attr-defined]
        self._position = position
        ev = self._event
        ev.type = event
        ev.global_step = self._step
        spe = self._state.values.get("steps_per_epoch")
        ev.epoch = self._step / spe if spe else None
        return ev

    def _check_order(self, event: str) -> str:
        """The position ``event`` leads to; raises as :meth:`_enter` when it is not allowed now, changing nothing
        (called first, so a bad argument on a session that is not initialized is refused for the lifecycle, as the
        table says, not for the argument: found by a tester)."""
        if self._in_hook is not None:
            self._refuse_from_hook(event)
        position = EVENT_ORDER[self._position].get(event)
        if position is None:
            self._refuse_event(event)
        return position

    def _refuse_step_back(self, event: str, step: int) -> NoReturn:
        """Refuse ``event(global_step=step)`` below the steps already counted: a per-epoch batch index restarted the
        step every epoch, so learning-rate schedules repeated, gradual pruning stalled and jumped to its end in
        ``finalize()``, without a word (found by a tester)."""
        msg = (
            f"{event}(global_step={step}) refused: the session has counted {self._step} optimizer steps and the step "
            "never goes back (a batch index within the epoch restarts every epoch: schedules would repeat or stall); "
            "pass the optimizer steps completed over the whole run (e.g. epoch * steps_per_epoch + steps in this "
            "epoch, the same value again while gradients accumulate), or leave global_step out and the session "
            "counts optim_post_step() calls. Nothing was changed."
        )
        raise ValueError(msg)

    def _dispatch(self, event: str, ev: Event) -> None:
        """Run ``on_event`` of the modifiers handling ``event``; for ``loss_calculated`` a result replaces the loss."""
        state = self._state
        self._in_hook = event + "()"
        try:
            for slot, handler, guard in self._schedule.dispatch[event]:
                if guard.eager:  # Guard.enter() inlined: read the counters (if any); nothing to leave
                    tensors = guard.tensors
                    token = [t._version for t in tensors] if tensors else None
                    try:
                        result = handler(state, ev)
                    except Exception as exc:
                        self._event_failed(slot, "on_event", exc, token, guard)
                else:  # lazy: the rest of the model is read at the hook's first torch call (not _guarded: hot)
                    token = guard.enter()
                    try:
                        result = handler(state, ev)
                    except Exception as exc:
                        self._event_failed(slot, "on_event", exc, token, guard)
                    except BaseException:
                        guard.leave(token)
                        raise
                    guard.leave(token)
                if result is not None and event == "loss_calculated":
                    ev.loss = result
        finally:
            self._in_hook = None

    def _calibration(self, event: str, *args: Any) -> None:
        for slot in self._schedule.handlers[event]:
            self._call(slot, f"on_{event}", *args)

    def batch_start(self, batch: Any = None, global_step: int | None = None) -> None:
        """A training batch begins; modifiers whose epoch has come are started/updated/ended first.

        Args:
            batch: the batch (any type), passed to modifiers as ``event.batch``.
            global_step: optimizer steps completed so far over the whole run, when
                the caller counts them (e.g. the HF Trainer); otherwise the session
                counts ``optim_post_step`` calls. The same value again (gradient
                accumulation) and a jump forward are taken; a value below
                :attr:`global_step` is refused. A jump forward once the run has
                sent ``optim_post_step`` (the session counts the steps too) is
                taken with one warning line per run naming both counts: the two
                counts should agree (a batch counter passed with gradient
                accumulation ran the schedules at the accumulation factor's speed).

        Raises:
            LifecycleError: not initialized, finalized, or a failed hook modified the model.
            EventOrderError: a batch is still open, or calibration is running.
            ValueError: ``global_step`` is not a non-negative int, or is below :attr:`global_step` (the steps counted
                so far; e.g. a batch index within the epoch): nothing is changed, no modifier runs.
            ModifierError: a modifier hook raised.
        """
        with self._lock:
            self._check_order("batch_start")
            if global_step is not None and (
                isinstance(global_step, bool) or not isinstance(global_step, numbers.Integral) or global_step < 0
            ):
                msg = f"global_step must be a non-negative int, got {global_step!r}"
                raise ValueError(msg)
            if global_step is not None:
                global_step = int(global_step)  # a numpy integer too (a step counter kept in an array)
            counted = self._step
            ev = self._enter("batch_start", global_step)
            if global_step is not None and global_step > counted and self._stepped and not self._jump_warned:
                self._warn_step_jump(global_step, counted)
            if not self._trained:
                self._trained = True
                self._warn_calibration_only()
            ev.batch = batch
            ev.loss = None
            self._loss_given = False
            if self._schedule.pending:
                self._schedule.advance(ev.epoch, self._call_with_event)
            self._dispatch("batch_start", ev)

    def _warn_step_jump(self, given: int, counted: int) -> None:
        """One warning line per run: ``batch_start(global_step=given)`` jumped ahead of the ``counted`` optimizer steps
        while the loop sends ``optim_post_step`` too. A loop with gradient accumulation passing its batch counter ran
        a linear rate schedule to its end after 3 of 4 steps and ended at global step 16 after 8 optimizer steps,
        without a word (found by a tester)."""
        self._jump_warned = True
        logger.warning(
            "batch_start(global_step=%d): the session has counted %d optimizer steps (optim_post_step() calls) and "
            "the given step jumps ahead of them, so the schedules skip %d step(s); with gradient accumulation that is "
            "usually a batch counter passed where the optimizer steps completed belong (the same value again while "
            "gradients accumulate). Pass the optimizer-step count, or leave global_step out: the session counts "
            "optim_post_step() itself. Said once per run",
            given,
            counted,
            given - counted,
        )

    def _warn_calibration_only(self) -> None:
        """At the run's first training batch: one line naming the modifiers that act on calibration events only
        (in a training loop they do nothing; quantization-aware training is not implemented)."""
        if self._calibrated:  # they compressed in this run's calibration already
            return
        idle = [slot.label for slot in self._schedule.slots if slot.calibrates_only]
        if idle:
            logger.warning(
                "%s %s on calibration events only (calibration_start ... calibration_end): in training batches %s "
                "nothing (quantization-aware training is not implemented); compress after training, e.g. "
                "llmc_fsm.oneshot(model, recipe), or send the calibration events",
                ", ".join(idle),
                "compresses" if len(idle) == 1 else "compress",
                "it does" if len(idle) == 1 else "they do",
            )

    def _call_with_event(self, slot: Slot, hook: str) -> None:
        self._call(slot, hook, self._event)

    def loss_calculated(self, loss: Any) -> Any:
        """The batch loss is known; returns the loss, possibly replaced by modifiers (e.g. distillation).

        Args:
            loss: the batch's loss (a tensor, or a number); not ``None``.

        Raises:
            LifecycleError: not initialized, finalized, or a failed hook modified the model.
            EventOrderError: not after ``batch_start``.
            ValueError: ``loss`` is ``None`` (the session is left as it was).
            ModifierError: a modifier hook raised.
        """
        with self._lock:
            self._check_order("loss_calculated")
            if loss is None:
                msg = (
                    "loss_calculated(loss) got None: pass the batch's loss (e.g. outputs.loss of a forward pass with "
                    "labels); modifiers such as distillation add to it or replace it"
                )
                raise ValueError(msg)
            ev = self._enter("loss_calculated")
            ev.loss = loss
            self._loss_given = True
            self._dispatch("loss_calculated", ev)
            return ev.loss

    def optim_pre_step(self) -> None:
        """The optimizer is about to step (gradients are final).

        Raises:
            LifecycleError: not initialized, finalized, or a failed hook modified the model.
            EventOrderError: not after ``batch_start``/``loss_calculated``.
            ModifierError: a modifier hook raised.
        """
        with self._lock:
            self._dispatch("optim_pre_step", self._enter("optim_pre_step"))

    def optim_post_step(self) -> None:
        """The optimizer has stepped; the global step advances by one before modifiers see it.

        Raises:
            LifecycleError: not initialized, finalized, or a failed hook modified the model.
            EventOrderError: not right after ``optim_pre_step``.
            ModifierError: a modifier hook raised.
        """
        with self._lock:
            ev = self._enter("optim_post_step", self._step + 1)
            self._stepped = True
            self._dispatch("optim_post_step", ev)

    def batch_end(self) -> None:
        """The batch is done (with or without an optimizer step); then the modifiers whose ``end`` the step count
        has reached are ended (``on_end``).

        Ending here, after the optimizer step that reached ``end``, puts the end (a gradual pruning's
        ``final_sparsity``) in the model that a Trainer evaluates and checkpoints at that step; at the next
        ``batch_start``, which never comes after the last step, it came only in ``finalize()`` (found by a tester).
        Starts and updates stay at ``batch_start``, as in llm-compressor.

        Raises:
            LifecycleError: not initialized, finalized, or a failed hook modified the model.
            EventOrderError: no batch is open, or it is between ``optim_pre_step`` and ``optim_post_step``.
            ModifierError: a modifier hook raised.
        """
        with self._lock:
            ev = self._enter("batch_end")
            try:
                self._dispatch("batch_end", ev)
            finally:
                ev.batch = None
                ev.loss = None
            if self._schedule.pending:
                self._schedule.advance(ev.epoch, self._call_with_event, ends_only=True)
            if not self._loss_given and not self._loss_warned and self._schedule.dispatch["loss_calculated"]:
                self._warn_no_loss()

    def _warn_no_loss(self) -> None:
        """At the first batch of the run that ended without ``loss_calculated`` while a modifier acting on the loss
        was active: one warning line naming it (distillation did nothing and nothing said so: a custom
        ``compute_loss`` that does not call the Trainer's, a loop that forgot the call; found by a tester)."""
        self._loss_warned = True
        labels = [slot.label for slot, _, _ in self._schedule.dispatch["loss_calculated"]]
        logger.warning(
            "batch_end(): no loss_calculated(loss) came in this batch (ending at global step %d), so %s, which %s the "
            "loss, did nothing in it: the model trained on its own loss. Call loss = session.loss_calculated(loss) "
            "after the forward pass and backpropagate the loss it returns (a SessionTrainer subclass overriding "
            "compute_loss: call super().compute_loss(...)); said once per run",
            self._step,
            ", ".join(labels),
            "changes" if len(labels) == 1 else "change",
        )

    def calibration_start(self) -> None:
        """One-shot calibration begins (modifiers whose start has come are started first).

        Raises:
            LifecycleError: not initialized, finalized, or a failed hook modified the model.
            EventOrderError: inside a batch, or calibration already running.
            ModifierError: a modifier hook raised.
        """
        with self._lock:
            ev = self._enter("calibration_start")
            if self._schedule.pending:
                self._schedule.advance(ev.epoch, self._call_with_event)
            self._calibration("calibration_start")

    def sequential_epoch_end(self, modules: Any) -> None:
        """Calibration data has passed through ``modules`` (e.g. one decoder layer): compress them.

        Raises:
            LifecycleError: not initialized, finalized, or a failed hook modified the model.
            EventOrderError: not between ``calibration_start`` and ``calibration_end``.
            ModifierError: a modifier hook raised.
        """
        with self._lock:
            self._enter("sequential_epoch_end")
            self._calibration("sequential_epoch_end", modules)

    def calibration_end(self) -> None:
        """One-shot calibration has ended.

        Raises:
            LifecycleError: not initialized, finalized, or a failed hook modified the model.
            EventOrderError: calibration is not running.
            ModifierError: a modifier hook raised.
        """
        with self._lock:
            self._enter("calibration_end")
            self._calibrated = True
            self._calibration("calibration_end")
