"""Integrations that embed a :class:`~llmc_fsm.Session` in a training loop.

- :mod:`llmc_fsm.integrations.torch`: a plain PyTorch loop (what to call where,
  plus small helpers that keep every lifecycle call visible).
- :mod:`llmc_fsm.integrations.transformers`: ``transformers.Trainer`` (imported
  only when that module is imported).

Each is also reached as an attribute after ``import llmc_fsm.integrations`` (imported then, on first use).

Both re-raise :class:`~llmc_fsm.MissingStateError` with the message extended by
how to pass each missing key *in that integration* (same ``missing`` attribute).

Devices. The training loop (or the Trainer) places the student; everything the
library creates follows the student's parameters: pruning masks are made on
their weight's device and move with it, distillation's loss terms live on the
student's device. The one model the library moves is the teacher
(:func:`place_teacher`, called by both integrations after ``initialize``): by
default onto the student's device, or onto ``teacher_device`` — ``"auto" |
"cpu" | "cuda" | "cuda:N"``, resolved and refused exactly as the one-shot
``device`` (:func:`llmc_fsm.pipeline.device.resolve_device`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from llmc_fsm.core.errors import MissingStateError
from llmc_fsm.core.state import missing_state_message
from llmc_fsm.pipeline.device import resolve_device
from llmc_fsm.session.checkpoint import check_checkpoint

if TYPE_CHECKING:  # for annotations only: at run time ``torch`` here is the submodule (see ``__getattr__``)
    import torch

__all__ = ["check_teacher", "place_teacher", "resolve_teacher_device", "start_session", "with_integration_hints"]

logger = logging.getLogger(__name__)


def __getattr__(name: str) -> Any:
    """A submodule reached as an attribute (``llmc_fsm.integrations.torch``, ``.transformers``), imported on first use.

    The PyTorch library was bound here as ``torch`` (``import torch``), so ``llmc_fsm.integrations.torch`` was the
    library until the submodule was imported, and the library's own advice
    (``llmc_fsm.integrations.torch.steps_per_epoch(...)``) failed with ``AttributeError`` (found by a tester).

    Raises:
        AttributeError: ``name`` is not a submodule of this package.
    """
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    msg = f"module {__name__!r} has no attribute {name!r}"
    raise AttributeError(msg)


def with_integration_hints(
    exc: MissingStateError,
    integration: str,
    hint: Callable[[str], str] | Mapping[str, str],
    given: Iterable[str] = (),
) -> MissingStateError:
    """Return a new :class:`MissingStateError` whose message adds, per missing key, how to pass it in ``integration``.

    Args:
        exc: the error raised by ``Session.initialize``.
        integration: a name for the message, e.g. ``"SessionTrainer"``.
        hint: key -> sentence (a mapping, or a function of the key).
        given: the keys the state held (one close to a missing key is named as a possible misspelling).

    The new error keeps ``missing``, ``reasons``, ``lifecycle`` and ``allowed`` (the reasons are shown as the
    session shows them); raise it
    ``from exc``.
    """
    get = hint.get if isinstance(hint, Mapping) else hint
    keys = sorted(set().union(*exc.missing.values())) if exc.missing else []
    # the session's own advice left out: the integration makes those calls (its "pass again what you gave this
    # call (optimizer)" named what the integration passed, found by a tester)
    text = (
        missing_state_message(
            exc.missing, exc.lifecycle, frozenset(), session_advice=False, given=given, reasons=exc.reasons
        )
        if keys
        else str(exc)
    )
    lines = [text, f"How to pass them with {integration}:"]
    for key in keys:
        text = get(key)
        if text:
            lines.append(f"  - {key}: {text}")
    new = MissingStateError(
        "\n".join(lines), lifecycle=exc.lifecycle, missing=exc.missing, allowed=exc.allowed, reasons=exc.reasons
    )
    return new


def start_session(
    session: Any,
    saved: Mapping[str, Any] | None,
    device: torch.device | None,
    hints: tuple[str, Callable[[str], str] | Mapping[str, str]],
    **state: Any,
) -> None:
    """The start of a training run, for both integrations: ``session.initialize(**state)``, the teacher placed on
    ``device`` (:func:`place_teacher`), then the session checkpoint ``saved`` (``read_checkpoint``'s dict, or
    ``None``) loaded. What the checkpoint shows by itself (another recipe, ``steps_per_epoch``, format) is refused
    before ``initialize`` (``check_checkpoint``); whatever fails after it (the teacher not placed, a modifier
    refusing its part) puts the session back as it was before the call — reset, then given back the state gathered
    before (``staging``; ``created`` if there was none) — so the call can be made again.

    Args:
        hints: ``(integration name, key -> sentence)`` for a ``MissingStateError`` (:func:`with_integration_hints`).

    Raises:
        CheckpointError: as above, the session as it was.
        MissingStateError: as ``Session.initialize``, the message extended by ``hints``.
        ValueError: from :func:`place_teacher`, the session as it was.
        LifecycleError, ModifierError: as ``Session.initialize``.
    """
    if saved is not None:
        check_checkpoint(saved, session, **state)
    staged = dict(session.state.values)
    try:
        session.initialize(**state)
    except MissingStateError as exc:
        raise with_integration_hints(exc, *hints, given=[*session.state, *state]) from exc
    try:
        place_teacher(session, device)
        if saved is not None:
            session.load_state_dict(saved)
    except BaseException:
        session.reset()
        if staged:
            session.update_state(**staged)
        raise


def resolve_teacher_device(spec: Any, argument: str = "teacher_device") -> torch.device | None:
    """Where the integrations put the teacher: ``None`` (follow the student) or ``spec`` resolved.

    Args:
        spec: ``None``, or what :func:`llmc_fsm.pipeline.device.resolve_device` accepts (``"auto"``, ``"cpu"``,
            ``"cuda"``, ``"cuda:N"``, a ``torch.device``).
        argument: the argument's name, for the message.

    Raises:
        ValueError: one line, ``<argument> <why>`` — an unknown string, ``cuda`` without CUDA or an index torch
            does not see (the one-shot ``--device`` messages).
    """
    if spec is None:
        return None
    try:
        return resolve_device(spec)
    except ValueError as exc:
        msg = f"{argument} {exc}"
        raise ValueError(msg) from None


def _devices(model: nn.Module) -> list[torch.device]:
    """The distinct devices of ``model``'s parameters and buffers, in order of first appearance."""
    seen: list[torch.device] = []
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device not in seen:
            seen.append(tensor.device)
    return seen


def _uses_teacher(session: Any) -> bool:
    return any("teacher" in getattr(m, "required_state", ()) for m in session.modifiers)


def check_teacher(session: Any, teacher: Any, device: torch.device | None, argument: str = "teacher_device") -> None:
    """Refuse, before the session is initialized, a teacher :func:`place_teacher` could not place.

    Only when a modifier of ``session`` requires ``teacher`` and ``teacher`` is an ``nn.Module``.

    Raises:
        ValueError: one line: the teacher's weights are on the ``meta`` device (not loaded), or ``device`` was
            given for a teacher spread over several devices (dispatched with a device map).
    """
    if not isinstance(teacher, nn.Module) or not _uses_teacher(session):
        return
    devices = _devices(teacher)
    if any(d.type == "meta" for d in devices):
        msg = (
            "the teacher's weights are on the meta device (not loaded); load them (e.g. from_pretrained without "
            "a meta device map) before training"
        )
        raise ValueError(msg)
    if device is not None and len(devices) > 1:
        msg = (
            f"{argument} is {str(device)!r} but the teacher is spread over {', '.join(map(str, devices))} "
            f"(a device map); leave {argument} unset to keep it as dispatched"
        )
        raise ValueError(msg)


def place_teacher(session: Any, device: torch.device | None) -> torch.device | None:
    """Move the session's teacher (state ``teacher``) to ``device``, or (``None``) to the student's device.

    Nothing moves when no modifier of ``session`` requires ``teacher``, when the teacher is not an ``nn.Module``
    or is the student itself, when it is already there, or (``device`` ``None``) when the teacher is spread over
    several devices (dispatched with a device map) or the student has no tensors. The move is
    ``teacher.to(device)``: in place, the same module and parameter objects.

    Args:
        session: an initialized session (its state holds ``model`` and ``teacher``).
        device: from :func:`resolve_teacher_device`.

    Returns:
        The teacher's device afterwards (``None`` when there is no teacher to place or it spans several devices).
    """
    teacher, student = session.state.get("teacher"), session.state.get("model")
    if not isinstance(teacher, nn.Module) or teacher is student or not _uses_teacher(session):
        return None
    devices = _devices(teacher)
    if device is None:
        student_devices = _devices(student) if isinstance(student, nn.Module) else []
        if len(devices) > 1 or not student_devices:
            return devices[0] if len(devices) == 1 else None
        device = student_devices[0]
    if devices != [device]:
        teacher.to(device)
        logger.info("teacher moved to %s", device)
    return device
