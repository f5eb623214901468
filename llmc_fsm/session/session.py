"""The compression session: a guarded lifecycle that gathers state from many places.

Flow (see ``docs/lifecycle.md``)::

    session = Session(recipe)            # recipe parsed and resolved now
    session.update_state(model=model)    # any number of times, from anywhere
    session.update_state(optimizer=opt)
    session.initialize(teacher=teacher)  # checks every modifier's required keys,
                                         # then calls each on_initialize once
    session.batch_start(); ...           # events (the first one: -> running)
    session.finalize()

Stage changes go through the ``transitions`` machine built from
:data:`llmc_fsm.core.lifecycle.TRANSITIONS`; per-batch events are checked with one
lookup in :data:`llmc_fsm.core.lifecycle.EVENT_ORDER` and dispatched to the modifiers
resolved for that event (:mod:`llmc_fsm.session.scheduling`). Every public call holds
the session's own re-entrant lock, so a session may be called from several
threads; every hook is guarded (:mod:`llmc_fsm.core.guard`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from llmc_fsm.core.errors import LifecycleError, MissingStateError, ModifierError
from llmc_fsm.core.guard import changed, failure, module_parameters
from llmc_fsm.core.lifecycle import CALLS_ALLOWED, make_machine
from llmc_fsm.core.modifier import Event, Modifier
from llmc_fsm.core.state import State, check_state_values, missing_state_message, unused_keys
from llmc_fsm.recipes.building import resolve_recipe
from llmc_fsm.recipes.fingerprint import recipe_fingerprint
from llmc_fsm.recipes.model import Recipe
from llmc_fsm.session.checkpoint import SessionCheckpoints
from llmc_fsm.session.ranks import check_ranks_agree, unwrap_state
from llmc_fsm.session.scheduling import Schedule, Slot

__all__ = ["CALIBRATION_ONLY", "RETRY_ADVICE", "ModifierError", "Session", "active_session", "create_session"]

logger = logging.getLogger(__name__)

#: The last sentence of the ``ModifierError`` of a rolled-back ``initialize`` that changed no parameter (an
#: integration making the call for the user replaces it with its own: ``SessionTrainer`` says ``train()``).
RETRY_ADVICE = "Fix the cause and call initialize() again with all its arguments."

_LIVE = ("initialized", "running")

#: Why a modifier acting on calibration events only requires ``calibration_data`` in a session given an optimizer (a
#: training loop), under the key in ``initialize``'s :class:`MissingStateError` (after the modifier's own reason, if
#: any): a recipe with a one-shot stage and a training stage was refused naming only the key, and once given, the
#: one-shot modifier did nothing in the loop (found by a tester).
CALIBRATION_ONLY = (
    "for its calibration events (calibration_start ... calibration_end), which a training loop does not send: in "
    "training batches it does nothing (quantization-aware training is not implemented). Run its stage with "
    "llmc_fsm.oneshot(model, recipe) before or after training and give this session the training stages only, or "
    "pass calibration_data and send the calibration events"
)


def _missing_reasons(
    slots: list[Slot], missing: dict[str, frozenset[str]], *, training: bool
) -> dict[str, dict[str, str]]:
    """Label -> missing key -> why it is required, for ``initialize``'s :class:`MissingStateError`: each modifier's
    own (:meth:`~llmc_fsm.Modifier.required_because`), and with ``training`` (an optimizer in the state)
    :data:`CALIBRATION_ONLY` for ``calibration_data`` of a modifier that acts on calibration events only."""
    reasons = {slot.label: slot.modifier.required_because() for slot in slots}
    if training:
        for slot in slots:
            if slot.calibrates_only and "calibration_data" in missing[slot.label]:
                own = reasons[slot.label].get("calibration_data")  # e.g. static input scales
                why = f"{own}, {CALIBRATION_ONLY}" if own else CALIBRATION_ONLY
                reasons[slot.label] = {**reasons[slot.label], "calibration_data": why}
    return reasons


class _Lifecycle:
    """The object ``transitions`` drives; its ``state`` attribute is the lifecycle."""

    state: str


class Session(SessionCheckpoints):
    """A compression session with the lifecycle ``created -> staging -> initialized -> running -> finalized``.

    The events (``batch_start`` ... ``calibration_end``) come from
    :class:`~llmc_fsm.session.events.SessionEvents`, the checkpoint methods
    (``state_dict``, ``load_state_dict``, ``save``, ``load``) from
    :class:`~llmc_fsm.session.checkpoint.SessionCheckpoints`. Every public call holds
    the session's re-entrant lock: one session may be called from several threads.

    Args:
        recipe: a recipe file path, YAML/JSON text, a dict, a list of
            :class:`~llmc_fsm.Modifier` objects, a :class:`~llmc_fsm.recipes.model.Recipe`,
            or ``None`` (no modifiers). Parsed and resolved here, so recipe
            errors surface before any state is gathered.

    Raises:
        RecipeError: the recipe cannot be parsed or a modifier argument is invalid.
    """

    def __init__(self, recipe: Any = None) -> None:
        self._recipe: Recipe = resolve_recipe(recipe)
        self._fsm = _Lifecycle()
        make_machine(self._fsm)
        self._lock = threading.RLock()
        self._event = Event()
        self._in_hook: str | None = None
        self._clear_run()

    def _clear_run(self) -> None:
        self._state = State()
        self._position = "closed"
        self._step = 0
        self._schedule = Schedule(self._recipe.modifiers)
        self._broken: str | None = None
        self._trained = False
        self._stepped = False
        self._calibrated = False
        self._loss_given = False
        self._loss_warned = False
        self._jump_warned = False

    # --- read-only views ------------------------------------------------------
    @property
    def state(self) -> State:
        """A read-only snapshot of the state gathered so far (see :class:`~llmc_fsm.State`)."""
        return self._state

    @property
    def recipe(self) -> Recipe:
        """The resolved recipe."""
        return self._recipe

    @property
    def modifiers(self) -> list[Modifier]:
        """The recipe's modifiers, in execution order."""
        return [slot.modifier for slot in self._schedule.slots]

    @property
    def labels(self) -> list[str]:
        """The modifiers' labels (class name, ``#k`` appended for repeats), in execution order."""
        return [slot.label for slot in self._schedule.slots]

    @property
    def global_step(self) -> int:
        """Optimizer steps completed (``int``)."""
        return self._step

    @property
    def failed(self) -> str | None:
        """Why the session refuses further events after a hook modified the model and failed, else ``None``."""
        return self._broken

    # --- staging --------------------------------------------------------------
    def update_state(self, **state: Any) -> None:
        """Store state for the modifiers; they see it at :meth:`initialize`.

        May be called any number of times, from different places; later values
        win. Keys are open-ended (see :class:`~llmc_fsm.State`).

        Raises:
            LifecycleError: the session is already initialized, running or finalized, or an ``initialize`` changed
                the model in place and failed (only :meth:`reset` is allowed then; it drops the state).
            ValueError: a well-known key's value that cannot be what it names (``steps_per_epoch`` not a positive
                int), or a key the session refuses (``global_step``, ``start``, ``batches_per_step``,
                ``teacher_model``: :data:`~llmc_fsm.core.state.REFUSED_KEYS`, one line each on what to do instead;
                :func:`~llmc_fsm.core.state.check_state_values`); nothing is stored.
        """
        with self._lock:
            self._refuse_from_hook("update_state")
            if "update_state" not in CALLS_ALLOWED[self.lifecycle] or self._broken is not None:
                self._refuse("update_state")
            self._state = self._state.merged(check_state_values(state))
            self._fire("update_state")

    def requires(self, key: str) -> bool:
        """Whether a modifier of the recipe requires state ``key`` (its ``required_keys()``, which may depend on its
        arguments: ``calibration_data`` for a ``QuantizationModifier`` with static input scales, not for W8A8)."""
        return any(key in slot.modifier.required_keys() for slot in self._schedule.slots)

    def missing_state(self, **extra: Any) -> dict[str, frozenset[str]]:
        """Return modifier label -> required keys not yet supplied (``extra`` counted as supplied)."""
        state = self._state.merged(extra) if extra else self._state
        missing = {}
        for slot in self._schedule.slots:
            keys = frozenset(k for k in slot.modifier.required_keys() if k not in state)
            if keys:
                missing[slot.label] = keys
        return missing

    def initialize(self, **state: Any) -> None:
        """Merge ``state`` into the stored state and initialize every modifier exactly once.

        All modifiers' required keys are checked first; if any are missing,
        :class:`MissingStateError` names every modifier and key, nothing is
        initialized, nothing (including ``state``) is stored, and the lifecycle
        is unchanged. If a modifier's ``on_initialize`` raises, the modifiers
        already initialized are rolled back (hooks removed, ``on_finalize``
        called), nothing is stored, and :class:`ModifierError` is raised with
        the original exception chained; a retry is allowed — unless the
        initialize changed parameters of a model in the state in place (the
        roll-back cannot undo that): the error then names them and the session
        refuses ``initialize`` until :meth:`reset`. Once initialized, one warning
        line names the state keys no modifier declares (``required_state`` /
        ``optional_state``) and the session does not read (they do nothing).

        A ``model`` (or ``teacher``) wrapped in ``DistributedDataParallel`` /
        ``DataParallel`` or compiled by ``torch.compile`` is unwrapped: modifiers
        and ``state.model`` see the module inside, whose parameters the wrapper
        trains, under its own module names. Under
        ``torch.distributed`` (more than one rank) this is a collective: every
        rank must call it; see :func:`llmc_fsm.session.ranks.check_ranks_agree`.

        Raises:
            LifecycleError: already initialized / running / finalized; a modifier
                object is bound to another live session; a failed hook modified
                the model before.
            MissingStateError: required state keys are missing (in a session given an ``optimizer``, a modifier
                acting on calibration events only says why it needs ``calibration_data``: :data:`CALIBRATION_ONLY`).
            ModifierError: a modifier's ``on_initialize`` raised.
            ValueError: a modifier's ``resolved_targets`` is not a mapping of names to modules (rolled back).
            ValueError: ``steps_per_epoch`` not a positive int, or a refused key (``global_step``, ``start``,
                ``batches_per_step``, ``teacher_model``; as :meth:`update_state`), nothing stored; under
                ``torch.distributed`` the ranks disagree on the recipe, the model, the teacher's weights,
                ``steps_per_epoch`` or the expected ``world_size`` (same message on every rank).
            PeerFailureError: under ``torch.distributed``, another rank stopped or never called ``initialize`` (the
                message asks whether it was called on one rank only).
        """
        with self._lock:
            self._refuse_from_hook("initialize")
            lifecycle = self.lifecycle
            if "initialize" not in CALLS_ALLOWED[lifecycle] or self._broken is not None:
                self._refuse("initialize")
            state = check_state_values(state)
            full = unwrap_state(self._state.merged(state))  # DDP / DataParallel: the module inside
            check_ranks_agree(
                recipe_fingerprint(self.labels, self.modifiers, self.recipe.plan()), full
            )  # under torch.distributed: same recipe/model on every rank, else raise
            missing = self.missing_state(**state)
            if missing:
                slots = [slot for slot in self._schedule.slots if slot.label in missing]
                reasons = _missing_reasons(slots, missing, training=full.get("optimizer") is not None)
                msg = missing_state_message(
                    missing, lifecycle, passed=frozenset(state), given=full.keys(), reasons=reasons
                )
                raise MissingStateError(
                    msg, lifecycle=lifecycle, missing=missing, allowed=CALLS_ALLOWED[lifecycle], reasons=reasons
                )
            self._bind()
            watched = module_parameters(full)
            before = [t._version for t in watched[1]]
            done: list[Slot] = []
            self._in_hook = "initialize()"
            try:
                for slot in self._schedule.slots:
                    try:
                        slot.modifier.on_initialize(full)
                    except BaseException as exc:
                        slot.modifier.remove_hooks()
                        self._roll_back(done, full)
                        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: as they are, but a
                            if changed(watched, before):  # model changed first refuses another initialize()
                                self._broken = (
                                    f"initialize() changed parameters of the model in place before "
                                    f"{type(exc).__name__} stopped it (model modified by an interrupted hook; reload "
                                    "it), then call session.reset() and gather the state again."
                                )
                            raise
                        raise self._initialize_failed(slot, exc, len(done), changed(watched, before)) from exc
                    done.append(slot)
            finally:
                self._in_hook = None
            try:
                self._schedule.watch(full)
            except ValueError as exc:  # a modifier's resolved_targets of another type: roll back as for a failure
                self._roll_back(done, full)
                raise ValueError(f"{exc}. Rolled back: the session is still {self.lifecycle!r}") from None
            self._state = full
            self._position = "idle"
            self._schedule.begin()
            self._fire("initialize")
            self._warn_unused_keys()

    def _warn_unused_keys(self) -> None:
        """After ``initialize``: one warning line naming the state keys that no modifier of the recipe declares
        (``required_state`` / ``optional_state``) and the session does not read (stored and ignored without a
        word before: ``epoch=5``, a misspelt key; found by a tester)."""
        declared = {k for m in self.modifiers for k in (*m.required_keys(), *m.optional_state)}
        unused = unused_keys(self._state, declared)
        if unused:
            logger.warning(
                "initialize(): state %s %s read by no modifier of this recipe (none declares %s in required_state or "
                "optional_state) nor by the session, so %s nothing; remove %s or check the spelling (keys declared: "
                "%s)",
                "key" if len(unused) == 1 else "keys",
                ", ".join(repr(k) for k in unused) + (" is" if len(unused) == 1 else " are"),
                "it" if len(unused) == 1 else "them",
                "it does" if len(unused) == 1 else "they do",
                "it" if len(unused) == 1 else "them",
                ", ".join(sorted(declared)) or "none",
            )

    def _initialize_failed(self, slot: Slot, exc: Exception, done: int, modified: list[str]) -> ModifierError:
        if modified:
            self._broken = (
                f"initialize() changed {len(modified)} parameter(s) of the model in place before a modifier "
                "failed (model modified by a failed hook; reload it), then call session.reset() and gather "
                "the state again."
            )
        then = (
            f"Rolled back: {done} modifier(s) already initialized were finalized and their hooks removed; "
            f"the session is still {self.lifecycle!r} and nothing passed to initialize() was stored."
            + ("" if modified else " " + RETRY_ADVICE)
        )
        return failure(slot.label, "on_initialize", exc, during="initialize()", modified=modified, then=then)

    def _bind(self) -> None:
        reason = self._schedule.bind(self)
        if reason is not None:
            msg = f"initialize() refused: {reason}"
            raise LifecycleError(msg, lifecycle=self.lifecycle, call="initialize", allowed=self.allowed_calls)

    def _roll_back(self, slots: list[Slot], state: State) -> None:
        for slot in reversed(slots):
            try:
                slot.modifier.on_finalize(state)
            except Exception:
                logger.exception("%s.on_finalize() raised during roll-back", slot.label)
            finally:
                slot.modifier.remove_hooks()
        self._schedule.unbind(self)

    # --- ending -----------------------------------------------------------------
    def finalize(self) -> None:
        """End every active modifier (``on_end``), finalize all of them, remove their hooks.

        Runs once. Every modifier is finalized and every hook removed even if one
        raises; the session is then ``finalized`` and the first error is raised as
        :class:`ModifierError` with the original chained. After a failed hook
        modified the model, ``on_end`` is skipped (only ``on_finalize`` releases).

        Raises:
            LifecycleError: not initialized, or already finalized.
            ModifierError: a modifier's ``on_end``/``on_finalize`` raised.
        """
        self._finalize(end=True)

    def _finalize(self, *, end: bool) -> None:
        """:meth:`finalize`; ``end=False``: ``on_finalize`` only (no ``on_end``: a run left by an error is not ended,
        e.g. a gradual pruning modifier does not prune to its final sparsity)."""
        with self._lock:
            self._refuse_from_hook("finalize")
            if "finalize" not in CALLS_ALLOWED[self.lifecycle]:
                self._refuse("finalize")
            errors = self._finalize_modifiers("finalize()", end=end)
            self._position = "closed"
            self._fire("finalize")
            if errors:
                raise errors[0]

    def _finalize_modifiers(self, call: str, *, end: bool = True) -> list[ModifierError]:
        self._in_hook = call
        try:
            return self._end_and_finalize(end)
        finally:
            self._in_hook = None

    def _end_and_finalize(self, end: bool) -> list[ModifierError]:
        """``on_end`` (when ``end``, for each modifier started and not ended) then ``on_finalize`` of every modifier,
        every hook removed; the errors raised, in order."""
        errors: list[ModifierError] = []
        if end and self._broken is None:
            self._warn_unreached()
        ev = self._event
        ev.type = "finalize"
        for slot in self._schedule.slots:
            m = slot.modifier
            hook = "on_end"
            guard = slot.guard
            before = [t._version for t in guard.tensors]  # once per modifier: every counter, read eagerly
            ending = end and slot.started and not slot.ended and self._broken is None
            slot.ended = slot.ended or slot.started
            try:
                for hook in ("on_end", "on_finalize") if ending else ("on_finalize",):  # on_finalize even if
                    try:  # on_end raised: it releases what the modifier holds (a teacher's modes, its hooks)
                        m.on_end(self._state, ev) if hook == "on_end" else m.on_finalize(self._state)
                    except Exception as exc:
                        then = "All modifiers were still finalized and their hooks removed."
                        modified = changed((guard.names, guard.tensors), before)
                        error = failure(
                            slot.label,
                            hook,
                            exc,
                            during="finalize()",
                            modified=modified,
                            outside=guard.outside(modified),
                            then=then,
                        )
                        error.__cause__ = exc
                        if errors:
                            logger.error("%s", error)
                        errors.append(error)
            finally:
                m.remove_hooks()
        self._schedule.clear()
        self._schedule.unbind(self)
        return errors

    def _warn_unreached(self) -> None:
        """At finalize: one warning line if training batches came without any optimizer step event, and one naming
        the modifiers whose ``start`` the run never reached (they did nothing; both were silent, found by testers).
        The words on masks and a gradual pruning only where a modifier acting on the model (``model`` among its
        required keys) is concerned: a learning-rate-only recipe was warned of masks it has none of (found by a
        tester)."""
        slots = self._schedule.slots
        spe = self._state.values.get("steps_per_epoch")
        epoch = f", epoch {self._step / spe:.4g}" if spe else ""
        if self._trained and not self._stepped:
            stepping = [s.label for s in slots if s.handles("optim_pre_step") or s.handles("optim_post_step")]
            scheduled = [s.label for s in slots if s.modifier.is_scheduled]
            on_model = {s.label for s in slots if "model" in s.modifier.required_keys()}
            if stepping or scheduled:
                logger.warning(
                    "finalize(): training batches came without optim_pre_step()/optim_post_step() (never called in "
                    "this run): global_step stayed %d, so %s%s. Call optimizer_step(session, optimizer) "
                    "(llmc_fsm.integrations.torch), or session.optim_pre_step() / optim_post_step() around "
                    "optimizer.step()",
                    self._step,
                    "; ".join(
                        ([f"the schedule of {', '.join(scheduled)} did not advance"] if scheduled else [])
                        + (
                            [
                                f"{', '.join(stepping)} never acted at a step"
                                + (" (masks not re-applied)" if on_model.intersection(stepping) else "")
                            ]
                            if stepping
                            else []
                        )
                    ),
                    "; what the schedule had left (a gradual pruning's final sparsity) was done now, at once"
                    if on_model.intersection(scheduled)
                    else "",
                )
        never = [s for s in slots if not s.started and s.modifier.start is not None] if self._trained else []
        if never:
            logger.warning(
                "finalize(): %s never started: no batch came at or after %s (the run ended at global step %d%s); %s "
                "nothing (the model is as training left it)",
                ", ".join(f"{s.label} (start {s.modifier.start:g})" for s in never),
                "its start" if len(never) == 1 else "their starts",
                self._step,
                epoch,
                "it did" if len(never) == 1 else "they did",
            )

    def reset(self, recipe: Any = None) -> None:
        """Return to ``created`` from any state, keeping the recipe or taking a new one.

        A new recipe is resolved first; if it is invalid, :class:`RecipeError`
        is raised and the session is left exactly as it was. Live modifiers
        (initialized or running) are finalized (``on_finalize`` only: no
        ``on_end``, so the model is left as the last step made it, e.g. not
        pruned to a gradual modifier's final sparsity, as llm-compressor's
        reset) and their hooks removed; the stored state is dropped (and with
        it a failed hook's refusal).

        Raises:
            RecipeError: ``recipe`` is invalid.
        """
        new_recipe = resolve_recipe(recipe) if recipe is not None else self._recipe
        with self._lock:
            self._refuse_from_hook("reset")
            if self.lifecycle in _LIVE:
                for error in self._finalize_modifiers("reset()", end=False):
                    logger.error("during reset: %s", error)
            self._schedule.unbind(self)
            self._recipe = new_recipe
            self._clear_run()
            self._fire("reset")

    def __repr__(self) -> str:
        names = ", ".join(self.labels) or "no modifiers"
        return f"<Session {self.lifecycle} [{names}]>"

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refuse ``pickle.dumps`` / ``copy.copy`` / ``copy.deepcopy`` (they all ask for this first).

        Raises:
            LifecycleError: always (``call="pickle"``); nothing is changed.
        """
        msg = (
            "a Session cannot be pickled or copied (it holds a lock, the modifiers' torch hooks and weak references "
            "bound to this run); save its progress with session.state_dict() or session.save(path) and resume it "
            "with load_state_dict() / Session.load(path, recipe, model=...)"
        )
        raise LifecycleError(msg, lifecycle=self.lifecycle, call="pickle", allowed=self.allowed_calls)


_ACTIVE: ContextVar[Session | None] = ContextVar("llmc_fsm_active_session", default=None)


@contextlib.contextmanager
def create_session(recipe: Any = None) -> Iterator[Session]:
    """Create a :class:`Session` and make it the active one for this thread / asyncio task.

    Use as ``with create_session(recipe) as session: ...``. On exit the previous
    active session (usually none) is restored, and a session left initialized or
    running is finalized so no hook outlives the block. If the block raised,
    its exception propagates, the modifiers get ``on_finalize`` only (no
    ``on_end``: a run stopped by an error is not ended, e.g. not pruned to its
    final sparsity) and finalize errors are only logged.

    Raises:
        RecipeError: the recipe is invalid.
        ModifierError: finalize on exit failed (only when the block did not raise).
    """
    session = Session(recipe)
    token = _ACTIVE.set(session)
    ok = False
    try:
        yield session
        ok = True
    finally:
        _ACTIVE.reset(token)
        if session.lifecycle in _LIVE:
            if ok:
                session.finalize()
            else:
                try:
                    session._finalize(end=False)
                except Exception:
                    logger.exception("finalize() failed while leaving create_session() after an error")


def active_session() -> Session:
    """Return the session made active by the innermost ``create_session`` in this context.

    Sessions are held in a ``contextvars.ContextVar``: each thread and each
    asyncio task sees only its own.

    Raises:
        LifecycleError: no session is active here.
    """
    session = _ACTIVE.get()
    if session is None:
        msg = (
            "no active session in this thread/task: wrap the code in "
            "`with llmc_fsm.create_session(recipe) as session:` or pass a Session explicitly."
        )
        raise LifecycleError(msg, lifecycle="none", call="active_session")
    return session
