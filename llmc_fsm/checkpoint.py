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

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import attrs

from llmc_fsm.checkpoint_io import FORMAT, MANIFEST, VERSION, read_checkpoint, write_checkpoint
from llmc_fsm.errors import CheckpointError, LifecycleError
from llmc_fsm.events import SessionEvents
from llmc_fsm.lifecycle import format_calls

if TYPE_CHECKING:
    import torch

    from llmc_fsm.scheduling import Schedule

__all__ = [
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "SessionCheckpoints",
    "differences",
    "pack_mask",
    "read_checkpoint",
    "recipe_fingerprint",
    "unpack_mask",
    "write_checkpoint",
]

_LIVE = ("initialized", "running")


# --- masks ---------------------------------------------------------------------------------------
def pack_mask(keep: torch.Tensor) -> torch.Tensor:
    """Bit-pack a bool mask: ``uint8`` tensor of ``ceil(numel / 8)`` bytes (row-major, most significant bit first)."""
    import numpy as np
    import torch

    bits = keep.detach().to(device="cpu", dtype=torch.bool).reshape(-1).numpy()
    return torch.from_numpy(np.packbits(bits))


def unpack_mask(packed: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: a CPU ``bool`` tensor of ``shape``.

    Raises:
        ValueError: ``packed`` is not ``uint8`` or has the wrong number of bytes for ``shape``.
    """
    import math

    import numpy as np
    import torch

    numel = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.numel() != (numel + 7) // 8:
        msg = (
            f"a packed mask for shape {tuple(shape)} has {(numel + 7) // 8} uint8 bytes; got "
            f"{packed.numel()} {packed.dtype} elements"
        )
        raise ValueError(msg)
    bits = np.unpackbits(packed.detach().cpu().numpy(), count=numel)
    return torch.from_numpy(bits.astype(bool)).reshape(tuple(shape))


# --- what the checkpoint says about the recipe -------------------------------------------------
def _plain(value: Any) -> Any:
    """A modifier argument as JSON: containers become lists/dicts; other objects their ``repr``."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((_plain(v) for v in value), key=repr)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return {"repr": repr(value)}


def recipe_fingerprint(labels: list[str], modifiers: list[Any], plan: list[tuple[Any, list[Any]]]) -> list[dict]:
    """Per modifier, in execution order: ``{"label", "class", "stage", "arguments"}`` (JSON values)."""
    stage_of = {id(m): stage.name for stage, mods in plan for m in mods}
    result = []
    for label, m in zip(labels, modifiers, strict=True):
        arguments = {f.alias: _plain(getattr(m, f.name)) for f in attrs.fields(type(m)) if f.init}
        result.append(
            {
                "label": label,
                "class": f"{type(m).__module__}.{type(m).__qualname__}",
                "stage": stage_of.get(id(m)),
                "arguments": arguments,
            }
        )
    return result


def differences(saved: list[dict], current: list[dict]) -> list[str]:
    """Every difference between two :func:`recipe_fingerprint` lists, one sentence each."""
    old = {d["label"]: d for d in saved}
    new = {d["label"]: d for d in current}
    out = [
        f"modifier {label} removed (in the checkpoint, not in this session's recipe)"
        for label in old
        if label not in new
    ]
    out += [
        f"modifier {label} added (in this session's recipe, not in the checkpoint)" for label in new if label not in old
    ]
    for label in (label for label in new if label in old):
        a, b = old[label], new[label]
        for key in ("class", "stage"):
            if a[key] != b[key]:
                out.append(f"modifier {label}: {key} {a[key]!r} in the checkpoint, {b[key]!r} now")
        args_a, args_b = a["arguments"], json.loads(json.dumps(b["arguments"]))
        for name in sorted(set(args_a) | set(args_b)):
            va, vb = args_a.get(name, "<not set>"), args_b.get(name, "<not set>")
            if va != vb:
                out.append(f"modifier {label}: argument {name!r} is {va!r} in the checkpoint, {vb!r} now")
    common_old = [label for label in old if label in new]
    common_new = [label for label in new if label in old]
    if common_old != common_new:
        out.append(f"modifier order differs: {common_old} in the checkpoint, {common_new} now")
    return out


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
        "modifiers": {slot.label: slot.modifier.state_dict() for slot in schedule.slots},
    }


def _format_problem(state: Any) -> str | None:
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        return f"not an llmc-fsm session state dict (no format {FORMAT!r})"
    if state.get("version") != VERSION:
        return f"format version {state.get('version')!r}; this llmc-fsm reads version {VERSION}"
    missing = [k for k in ("lifecycle", "global_step", "recipe", "schedule", "modifiers") if k not in state]
    return f"incomplete state dict: no {', '.join(missing)}" if missing else None


def _recipe_problems(state: Any, session: Any) -> list[str]:
    """Format and recipe differences (usable before ``initialize``)."""
    problem = _format_problem(state)
    if problem is not None:
        return [problem]
    current = recipe_fingerprint(session.labels, session.modifiers, session.recipe.plan())
    return differences(state["recipe"], current)


def _problems(state: Any, session: Any) -> list[str]:
    if _format_problem(state) is not None:
        return _recipe_problems(state, session)
    out = _recipe_problems(state, session)
    spe_old, spe_new = state.get("steps_per_epoch"), session.state.get("steps_per_epoch")
    if spe_old != spe_new:
        out.append(f"state steps_per_epoch is {spe_old!r} in the checkpoint, {spe_new!r} now")
    if state["lifecycle"] not in ("initialized", "running"):
        out.append(f"lifecycle {state['lifecycle']!r} in the checkpoint (expected 'initialized' or 'running')")
    return out


def _mismatch(problems: list[str]) -> CheckpointError:
    msg = (
        f"the checkpoint does not match this session ({len(problems)} difference(s)): "
        + "; ".join(problems)
        + ". Nothing was loaded: resume with the recipe and state the checkpoint was written with."
    )
    return CheckpointError(msg, differences=problems)


def restore(session: Any, schedule: Schedule, state: Mapping[str, Any]) -> int:
    """Check ``state`` against ``session``, then load every modifier's part and the schedule; return the step.

    Raises:
        CheckpointError: a difference (nothing loaded), or a modifier refused its
            part (the modifiers loaded before it are restored to their state before).
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
        with self._lock:
            if self.lifecycle not in _LIVE or self._position != "idle" or self._broken is not None:
                self._refuse_checkpoint("state_dict")
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
        """Write :meth:`state_dict` to the directory ``path`` (see :func:`llmc_fsm.checkpoint.write_checkpoint`).

        Raises:
            LifecycleError: as :meth:`state_dict`.
            OSError: the directory cannot be written (the previous checkpoint there stays loadable).
        """
        return write_checkpoint(self.state_dict(), path)

    @classmethod
    def load(cls, path: str | Path, recipe: Any, **state: Any) -> Any:
        """Resume: ``Session(recipe)``, ``initialize(**state)``, then load the checkpoint at ``path``.

        Raises:
            CheckpointError: no readable checkpoint at ``path``, or it does not match
                ``recipe`` (checked before anything is initialized where possible;
                otherwise the new session is reset, releasing its hooks).
            MissingStateError, ModifierError: as :meth:`initialize`.
        """
        saved = read_checkpoint(path)
        session = cls(recipe)
        problems = _recipe_problems(saved, session)
        if problems:
            raise _mismatch(problems)
        session.initialize(**state)
        try:
            session.load_state_dict(saved)
        except BaseException:
            session.reset()
            raise
        return session
