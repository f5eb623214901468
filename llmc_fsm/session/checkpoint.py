"""Session checkpoints: ``state_dict()``/``load_state_dict()``, ``session.save(dir)``/``Session.load(dir, recipe)``.

A checkpoint holds the session's progress — lifecycle, global step, each
modifier's schedule position (started, ended, next update), stage progress —
and each modifier's own :meth:`~llmc_fsm.Modifier.state_dict` (masks, pruning
history, distillation settings, learning-rate position...). It records the
recipe as each modifier's label, class, stage and arguments, and
``steps_per_epoch``; loading into a session whose recipe or modifiers differ
raises :class:`~llmc_fsm.CheckpointError` naming every difference before
anything changes. Model, optimizer and RNG state are the caller's (saved and
restored as usual).

On disk (:func:`write_checkpoint` / :func:`read_checkpoint`) a checkpoint is a
directory with ``session.json`` (everything but tensors, plus the name and
SHA-256 of the tensor file) and ``tensors-<digest>.safetensors`` — no pickle.
Each file is written to a temporary sibling and renamed into place, the
manifest last, and the previous tensor file is removed only after that: a kill
at any moment leaves the previous checkpoint loadable. Masks are stored
bit-packed (:func:`pack_mask`: 1 bit per weight, 1/32 of the fp32 weight bytes).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn, Self

from llmc_fsm.core.errors import CheckpointError, LifecycleError
from llmc_fsm.core.lifecycle import format_calls
from llmc_fsm.recipes.fingerprint import differences, recipe_fingerprint
from llmc_fsm.session.checkpoint_io import FORMAT, MANIFEST, VERSION, read_checkpoint, write_checkpoint
from llmc_fsm.session.events import SessionEvents
from llmc_fsm.session.scheduling import Schedule

__all__ = [
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "SessionCheckpoints",
    "check_checkpoint",
    "read_checkpoint",
    "write_checkpoint",
]

_LIVE = ("initialized", "running")


# --- masks ---------------------------------------------------------------------------------------
# --- session state <-> dict -------------------------------------------------------------------
def session_state(session: Any, schedule: Schedule, step: int) -> dict[str, Any]:
    """The state dict of ``session`` (between batches; see :meth:`~llmc_fsm.Session.state_dict`)."""
    plan = session.recipe.plan()
    return {
        "format": FORMAT,
        "version": VERSION,
        "lifecycle": session.lifecycle,
        "global_step": step,
        "steps_per_epoch": session.state.get("steps_per_epoch"),
        "recipe": recipe_fingerprint(session.labels, session.modifiers, plan),
        "stages": schedule.progress([(stage.name, mods) for stage, mods in plan]),
        "schedule": schedule.state_dict(),
        "modifiers": {slot.label: _modifier_state(slot) for slot in schedule.slots},
    }


def _modifier_state(slot: Any) -> dict[str, Any]:
    """``slot``'s modifier's ``state_dict()``, refused unless a dict (a forgotten ``return`` saved ``None``, and the
    checkpoint was then refused at load as "damaged": found by a tester).

    Raises:
        TypeError: naming the modifier and what it returned.
    """
    state = slot.modifier.state_dict()
    if not isinstance(state, dict):
        msg = (
            f"{slot.label}.state_dict() returned {type(state).__name__}, not a dict (a missing return?); nothing saved"
        )
        raise TypeError(msg)
    return state


def _format_problem(state: Any) -> str | None:
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        return f"not an llmc-fsm session state dict (no format {FORMAT!r})"
    if state.get("version") != VERSION:
        return f"format version {state.get('version')!r}; this llmc-fsm reads version {VERSION}"
    missing = [k for k in ("lifecycle", "global_step", "recipe", "schedule", "modifiers") if k not in state]
    return f"incomplete state dict: no {', '.join(missing)}" if missing else None


def _damage(state: Mapping[str, Any]) -> str | None:
    """What is malformed in a state dict of the right format (fields of the wrong type, a schedule entry without
    its fields), else ``None``: a damaged ``session.json`` raised a bare ValueError / KeyError / TypeError, loaded
    part of itself before failing, or loaded without any modifier's state (found by a fuzzing tester). Whether each
    modifier of the recipe has its entries is checked against the session (:func:`_entries_missing`)."""
    step = state["global_step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"global_step {step!r} is not a step count"
    if not isinstance(state["recipe"], list):
        return f"its recipe is a {type(state['recipe']).__name__}, not a list"
    for key in ("schedule", "modifiers"):
        if not isinstance(state[key], Mapping) or not all(isinstance(v, Mapping) for v in state[key].values()):
            return f"its {key} is not a mapping of modifier labels to mappings"
    for label, entry in state["schedule"].items():
        fields = {"started", "ended", "next_update"}
        if not fields <= set(entry) or not all(isinstance(entry[f], bool) for f in ("started", "ended")):
            return f"the schedule of {label} lacks started / ended / next_update"
        upcoming = entry["next_update"]
        if upcoming is not None and (isinstance(upcoming, bool) or not isinstance(upcoming, int | float)):
            return f"the schedule of {label} has next_update {upcoming!r}"
    return None


def _entry_missing(state: Mapping[str, Any], session: Any) -> str | None:
    """The first modifier of ``session`` with no entry in the checkpoint's ``schedule`` or ``modifiers`` (a modifier
    without state writes ``{}``: an entry missing is damage, not 'nothing to load'), else ``None``."""
    return next(
        (f"it has no {key} entry for {label}" for key in ("schedule", "modifiers") for label in session.labels
         if label not in state[key]),
        None,
    )  # fmt: skip


def _damaged(problem: str) -> CheckpointError:
    msg = (
        f"the checkpoint is damaged: {problem}. Nothing was loaded: resume from an intact checkpoint (an earlier "
        "one, or a new run)"
    )
    return CheckpointError(msg, differences=[problem])


def _recipe_problems(state: Any, session: Any) -> list[str]:
    """Format and recipe differences (usable before ``initialize``)."""
    problem = _format_problem(state)
    if problem is not None:
        return [problem]
    current = recipe_fingerprint(session.labels, session.modifiers, session.recipe.plan())
    try:
        return differences(state["recipe"], current)
    except (TypeError, KeyError, AttributeError, ValueError):  # entries that are not what state_dict() writes
        raise _damaged("its recipe entries are not modifier records") from None


def _problems(state: Any, session: Any, given: Mapping[str, Any] | None = None) -> list[str]:
    """Every difference; ``given``: the state ``initialize`` will get (before it: ``steps_per_epoch`` is compared
    only where it is known, in ``given`` or in the staged state)."""
    if _format_problem(state) is not None:
        return _recipe_problems(state, session)
    damage = _damage(state)
    if damage is not None:
        raise _damaged(damage)
    out = _recipe_problems(state, session)
    damage = None if out else _entry_missing(state, session)  # the same modifiers: each must have its entries
    if damage is not None:
        raise _damaged(damage)
    known = {**session.state.values, **(given or {})}
    spe_old, spe_new = state.get("steps_per_epoch"), known.get("steps_per_epoch")
    if (given is None or "steps_per_epoch" in known) and spe_old != spe_new:
        out.append(f"state steps_per_epoch is {spe_old!r} in the checkpoint, {spe_new!r} now")
    if state["lifecycle"] not in ("initialized", "running"):
        out.append(f"lifecycle {state['lifecycle']!r} in the checkpoint (expected 'initialized' or 'running')")
    return out


def check_checkpoint(state: Any, session: Any, **given: Any) -> None:
    """Before ``session.initialize(**given)``: what :meth:`~SessionCheckpoints.load_state_dict` would refuse in the
    checkpoint ``state`` (:func:`read_checkpoint`'s dict) that shows already — its format, another recipe, another
    ``steps_per_epoch`` (where it is staged or in ``given``), a lifecycle it cannot resume from — so that a resume
    that cannot work is refused before anything is initialized.

    Raises:
        CheckpointError: every difference found, in one message; nothing is changed.
    """
    problems = _problems(state, session, given)
    if problems:
        raise _mismatch(problems)


#: Said after the differences when ``steps_per_epoch`` is one of them: what it follows from (a resume at another world
#: size was refused naming only the two numbers, found by a tester).
SPE_CAUSES = (
    "The optimizer steps per epoch follow from the training set's size, the number of processes (world size), the "
    "per-device batch size and gradient accumulation: resume with the ones the checkpoint was written with."
)


def _mismatch(problems: list[str]) -> CheckpointError:
    """The :class:`CheckpointError` naming ``problems`` (its ``differences``), with :data:`SPE_CAUSES` when
    ``steps_per_epoch`` differs."""
    causes = " " + SPE_CAUSES if any(p.startswith("state steps_per_epoch is ") for p in problems) else ""
    msg = (
        f"the checkpoint does not match this session ({len(problems)} difference(s)): "
        + "; ".join(problems)
        + "."
        + causes
        + " Nothing was loaded: resume with the recipe and state the checkpoint was written with."
    )
    return CheckpointError(msg, differences=problems)


def restore(session: Any, schedule: Schedule, state: Mapping[str, Any]) -> int:
    """Check ``state`` against ``session``, then load every modifier's part and the schedule; return the step.

    Raises:
        CheckpointError: a difference or damage (a field of the wrong type, a modifier's entry missing; nothing
            loaded), or a modifier refused its part (the modifiers loaded before it are restored to their state
            before).
    """
    problems = _problems(state, session)
    if problems:
        raise _mismatch(problems)
    previous = {slot.label: slot.modifier.state_dict() for slot in schedule.slots}
    done = []
    for slot in schedule.slots:
        try:
            slot.modifier.load_state_dict(state["modifiers"].get(slot.label, {}))
        except Exception as exc:
            for other in done:
                other.modifier.load_state_dict(previous[other.label])
            msg = f"{slot.label}.load_state_dict() refused its part of the checkpoint: {exc}. Nothing was loaded."
            raise CheckpointError(msg) from exc
        done.append(slot)
    schedule.load_state_dict(state["schedule"])
    return int(state["global_step"])


# --- the Session methods ----------------------------------------------------------------------
class SessionCheckpoints(SessionEvents):
    """Checkpoint methods of :class:`~llmc_fsm.Session` (a base class of it; see the module docstring)."""

    def state_dict(self) -> dict[str, Any]:
        """The session's progress: lifecycle, step, schedule, stages and each modifier's ``state_dict()``.

        Tensors stay tensors; everything else is JSON values. Model and
        optimizer state are not included (save them as usual).

        Raises:
            LifecycleError: not initialized/running, inside a batch or calibration,
                or a failed hook modified the model.
        """
        return self._state_dict("state_dict")

    def _state_dict(self, call: str) -> dict[str, Any]:
        with self._lock:
            self._refuse_from_hook(call)
            if self.lifecycle not in _LIVE or self._position != "idle" or self._broken is not None:
                self._refuse_checkpoint(call)
            return session_state(self, self._schedule, self._step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the session that wrote ``state`` (:meth:`state_dict`) stopped.

        Call it after :meth:`initialize` and before the first event. Everything
        is checked before anything changes.

        Raises:
            LifecycleError: not right after ``initialize``.
            CheckpointError: ``state`` was written for another recipe (a modifier
                added/removed, a class or argument changed, another
                ``steps_per_epoch``) or a modifier refused its part.
        """
        with self._lock:
            self._refuse_from_hook("load_state_dict")
            if self.lifecycle != "initialized" or self._broken is not None:
                self._refuse_checkpoint("load_state_dict")
            self._step = restore(self, self._schedule, state)
            if state["lifecycle"] == "running":
                self._fire("first_event")

    def _refuse_checkpoint(self, call: str) -> NoReturn:
        if self._broken is not None:
            self._refuse(call)
        if call == "load_state_dict":
            why = "load a checkpoint right after initialize(), before the first event"
        else:
            why = "a checkpoint is taken between batches of an initialized or running session"
        where = f"lifecycle {self.lifecycle!r}" + (f", position {self._position!r}" if self.lifecycle in _LIVE else "")
        msg = f"{call}() refused: {why} ({where}). Allowed now: {format_calls(self.allowed_calls)}."
        raise LifecycleError(msg, lifecycle=self.lifecycle, call=call, allowed=self.allowed_calls) from None

    def save(self, path: str | Path) -> Path:
        """Write :meth:`state_dict` to the directory ``path``
        (:func:`~llmc_fsm.session.checkpoint_io.write_checkpoint`).

        Raises:
            LifecycleError: as :meth:`state_dict`.
            OSError: the directory cannot be written (the previous checkpoint there stays loadable).
        """
        return write_checkpoint(self._state_dict("save"), path)

    @classmethod
    def load(cls, path: str | Path, recipe: Any, **state: Any) -> Self:
        """Resume: ``Session(recipe)``, ``initialize(**state)``, then load the checkpoint at ``path``.

        Returns:
            The new session (of the class it is called on), initialized, where the saved one stopped.

        Raises:
            CheckpointError: no readable checkpoint at ``path``, or it does not match
                ``recipe`` (checked before anything is initialized where possible,
                :func:`check_checkpoint`; otherwise the new session is reset, releasing its hooks).
            MissingStateError, ModifierError: as :meth:`initialize`.
        """
        saved = read_checkpoint(path)
        session = cls(recipe)
        check_checkpoint(saved, session, **state)
        session.initialize(**state)
        try:
            session.load_state_dict(saved)
        except BaseException:
            session.reset()
            raise
        return session
