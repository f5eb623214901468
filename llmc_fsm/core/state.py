"""The state a session gathers for its modifiers.

State keys are open-ended: the well-known keys below get attributes, and any
other key a future modifier needs is reachable with ``state["key"]`` or
``state.get("key")``. A :class:`State` is a read-only snapshot — the session
replaces it on every ``update_state``; nobody mutates it.
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import attrs

__all__ = [
    "REFUSED_KEYS",
    "SESSION_KEYS",
    "WELL_KNOWN_KEYS",
    "State",
    "as_count",
    "check_state_values",
    "missing_state_message",
    "unused_keys",
]


def _freeze(values: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(values))


class _Key:
    """A well-known state key read as an attribute of :class:`State`: its value, or ``None`` when not supplied."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, state: State | None, owner: type | None = None) -> Any:
        return self if state is None else state.values.get(self.name)


@attrs.frozen
class State(Mapping[str, Any]):
    """A read-only snapshot of the session state.

    Attributes ``model``, ``teacher``, ``optimizer``, ``calibration_data``,
    ``train_data`` and ``steps_per_epoch`` return ``None`` when not supplied.
    ``state["key"]`` raises ``KeyError`` naming the keys that are present;
    ``state.get("key", default)`` does not. A key whose value is ``None`` counts
    as absent (``"key" in state`` is False).

    The objects themselves (the model, the optimizer...) are not copied: a
    modifier prunes the real model. Only the key -> object mapping is frozen.
    """

    values: Mapping[str, Any] = attrs.field(factory=dict, converter=_freeze)

    # --- Mapping protocol -------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        """The value of ``key``.

        Raises:
            KeyError: ``key`` is absent or ``None``; the message names the keys present.
        """
        value = self.values.get(key)
        if value is None:
            present = ", ".join(sorted(self)) or "none"
            msg = f"state has no key {key!r} (present: {present}); supply it with update_state({key}=...)"
            raise KeyError(msg)
        return value

    def __iter__(self) -> Iterator[str]:
        return (key for key, value in self.values.items() if value is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key: object) -> bool:
        return self.values.get(key) is not None  # type: ignore[call-overload]

    def get(self, key: str, default: Any = None) -> Any:
        value = self.values.get(key)
        return default if value is None else value

    def merged(self, updates: Mapping[str, Any]) -> State:
        """Return a new snapshot with ``updates`` applied (later values win)."""
        return State({**self.values, **updates})

    # --- well-known keys (``None`` when not supplied) ------------------------
    model = _Key(
        "The model being compressed (``torch.nn.Module``), or ``None``.\n\n"
        "After ``Session.initialize`` it is the module inside a ``DistributedDataParallel`` /\n"
        "``DataParallel`` / ``torch.compile`` wrapper if one was given (see\n"
        ":func:`llmc_fsm.session.ranks.unwrap_model`)."
    )
    teacher = _Key("The teacher model for distillation (``torch.nn.Module``), or ``None``.")
    optimizer = _Key("The training optimizer (``torch.optim.Optimizer``), or ``None``.")
    calibration_data = _Key("Calibration batches for one-shot work (iterable of model inputs), or ``None``.")
    train_data = _Key("Training data (e.g. a ``DataLoader``), or ``None``.")
    steps_per_epoch = _Key("Optimizer steps per epoch (``int``), used to turn steps into epochs, or ``None``.")

    def __getattr__(self, name: str) -> Any:
        """Only the well-known keys are attributes: ``state.tokenizer`` raises an ``AttributeError`` that says to
        read the key by subscript (it was a bare one, found by a tester writing a plugin)."""
        if name.startswith("_"):
            raise AttributeError(name)
        known = [key for key, value in vars(State).items() if isinstance(value, _Key)]
        msg = (
            f"state has no attribute {name!r}: only {', '.join(known)} are attributes; read other keys with "
            f"state[{name!r}] (or state.get({name!r}))"
        )
        raise AttributeError(msg)

    def __repr__(self) -> str:
        keys = ", ".join(sorted(self))
        return f"State({keys})"


#: Keys with attribute access on :class:`State`, in documentation order.
WELL_KNOWN_KEYS: tuple[str, ...] = tuple(name for name, value in vars(State).items() if isinstance(value, _Key))


#: The keys the session (and its integrations) read themselves, declared by a modifier or not: the well-known keys
#: and ``world_size`` (:func:`llmc_fsm.session.ranks.check_ranks_agree`).
SESSION_KEYS: frozenset[str] = frozenset(WELL_KNOWN_KEYS) | {"world_size"}

#: State keys refused by :func:`check_state_values`, each with what to do instead. Stored, they were ignored
#: without a word: llm-compressor's own ``initialize`` arguments (``start``: the epoch to resume from;
#: ``batches_per_step``: its gradient accumulation; ``teacher_model``: its name of the teacher) and a
#: ``global_step`` that the first step did not start from (found by a tester).
REFUSED_KEYS: dict[str, str] = {
    "global_step": (
        "the session counts optimizer steps itself (one per optim_post_step()); to set the step pass "
        "session.batch_start(global_step=N), to resume a run load its session checkpoint "
        "(llmc_fsm.integrations.torch.initialize(session, checkpoint=dir), or session.load_state_dict(saved))"
    ),
    "start": (
        "the epoch to resume from (llm-compressor's initialize(start=...)) is not a state key here (a modifier's "
        "start is a recipe argument): resume a run from its session checkpoint "
        "(llmc_fsm.integrations.torch.initialize(session, checkpoint=dir), or session.load_state_dict(saved)), or "
        "set the step with session.batch_start(global_step=N)"
    ),
    "batches_per_step": (
        "the session counts optimizer steps, not batches: with gradient accumulation send "
        "optim_pre_step()/optim_post_step() only for the batches that step the optimizer "
        "(llmc_fsm.integrations.torch.optimizer_step and is_step) and give steps_per_epoch in optimizer steps "
        "(llmc_fsm.integrations.torch.steps_per_epoch(train_loader, gradient_accumulation_steps))"
    ),
    "teacher_model": "the distillation teacher's key is 'teacher' (llm-compressor's teacher_model): pass teacher=...",
}


def as_count(value: Any) -> int | None:
    """``value`` as a Python int when it is an integer (a numpy int, a 0-d integer tensor: anything with
    ``__index__``), not a bool; else ``None``."""
    try:
        return None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        return None


def check_state_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with each well-known key's value checked before it is stored. A key of :data:`REFUSED_KEYS` with a
    value other than ``None`` is refused (stored, nothing read it). ``steps_per_epoch`` must be a
    positive integer, and a numpy int (or a 0-d integer tensor) is stored as the Python int (kept as given, it made
    epochs numpy floats that a checkpoint could not write, and a tensor learning rate: found by a tester). A string
    failed at the first event with a ``TypeError`` after the session had moved, and ``0`` (an empty loader's
    length) turned every schedule off without a word (found by a fuzzing tester).

    Returns:
        A new dict of ``values`` (``steps_per_epoch`` as an ``int``).

    Raises:
        ValueError: naming the key, the value and what to give (one line per refused key).
    """
    refused = [key for key in REFUSED_KEYS if values.get(key) is not None]
    if refused:
        msg = "\n".join(f"state key {key!r} refused, nothing was stored: {REFUSED_KEYS[key]}" for key in refused)
        raise ValueError(msg)
    out = dict(values)
    spe = out.get("steps_per_epoch")
    if spe is None:
        return out
    count = as_count(spe)
    if count is None or count < 1:
        msg = (
            f"steps_per_epoch must be a positive int (optimizer steps per epoch), got {spe!r}"
            + (" (an empty training loader?)" if count == 0 else "")
            + "; e.g. llmc_fsm.integrations.torch.steps_per_epoch(train_loader, gradient_accumulation_steps), "
            "ceil(len(train_loader) / gradient_accumulation_steps)"
        )
        raise ValueError(msg)
    out["steps_per_epoch"] = count
    return out


def unused_keys(state: Iterable[str], declared: Iterable[str]) -> list[str]:
    """The keys of ``state`` that neither the session (:data:`SESSION_KEYS`) nor a modifier (``declared``: every
    modifier's required and optional keys) reads, sorted."""
    return sorted(set(state) - SESSION_KEYS - set(declared))


def missing_state_message(
    missing: Mapping[str, frozenset[str]],
    lifecycle: str,
    passed: frozenset[str],
    *,
    session_advice: bool = True,
    given: Iterable[str] = (),
    reasons: Mapping[str, Mapping[str, str]] | None = None,
) -> str:
    """The message of the :class:`~llmc_fsm.MissingStateError` ``initialize`` raises (``missing``: label -> keys);
    ``session_advice=False``: without the lines on how to pass them to the session's own calls (an integration that
    makes those calls gives its own, :func:`llmc_fsm.integrations.with_integration_hints`). ``given``: the keys the
    state holds or this call gave; one close to a missing key is named as a possible misspelling (``optimiser`` for
    ``optimizer``). ``reasons``: label -> key -> when the modifier requires that key
    (:meth:`~llmc_fsm.Modifier.required_because`), one line each under its modifier. The reason for
    ``steps_per_epoch`` was one fixed sentence ("the modifier has a start/end/update schedule in epochs"), wrong for a
    step learning-rate schedule without them, and a modifier's own ``conditional_state`` texts were never shown
    (found by a tester)."""
    lines = [
        f"initialize() refused: {len(missing)} modifier(s) are missing required state; "
        f"no modifier was initialized and nothing was stored (the session is still {lifecycle!r}):"
    ]
    for label, keys in missing.items():
        lines.append(f"  - {label} requires {', '.join(repr(k) for k in sorted(keys))}")
        why = (reasons or {}).get(label, {})
        lines.extend(f"      {key!r} is required {why[key]}" for key in sorted(keys) if key in why)
    all_keys = sorted(set().union(*missing.values()))
    unused = sorted(set(given) - set(all_keys))
    for key in all_keys:
        close = difflib.get_close_matches(key, unused, n=1, cutoff=0.8)
        if close:
            lines.append(f"{close[0]!r} was given: a misspelling of {key!r}?")
    example = ", ".join(f"{k}=..." for k in all_keys)
    if session_advice:
        lines.append(
            f"Supply them where they are created with session.update_state({example}), or pass them to "
            f"session.initialize({example})."
        )
    if passed and session_advice:
        lines.append(f"Pass again what you gave this call ({', '.join(sorted(passed))}): it was not stored.")
    if "steps_per_epoch" in all_keys:
        lines.append(
            "steps_per_epoch is the number of optimizer steps per epoch (an int): modifiers count their epochs in "
            "steps with it."
        )
    return "\n".join(lines)
