"""Integrations that embed a :class:`~llmc_fsm.Session` in a training loop.

- :mod:`llmc_fsm.integrations.torch`: a plain PyTorch loop (what to call where,
  plus small helpers that keep every lifecycle call visible).
- :mod:`llmc_fsm.integrations.transformers`: ``transformers.Trainer`` (imported
  only when that module is imported).

Both re-raise :class:`~llmc_fsm.MissingStateError` with the message extended by
how to pass each missing key *in that integration* (same ``missing`` attribute).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from llmc_fsm.core.errors import MissingStateError

__all__ = ["with_integration_hints"]


def with_integration_hints(
    exc: MissingStateError, integration: str, hint: Callable[[str], str] | Mapping[str, str]
) -> MissingStateError:
    """Return a new :class:`MissingStateError` whose message adds, per missing key, how to pass it in ``integration``.

    Args:
        exc: the error raised by ``Session.initialize``.
        integration: a name for the message, e.g. ``"SessionTrainer"``.
        hint: key -> sentence (a mapping, or a function of the key).

    The new error keeps ``missing``, ``lifecycle`` and ``allowed``; raise it
    ``from exc``.
    """
    get = hint.get if isinstance(hint, Mapping) else hint
    keys = sorted(set().union(*exc.missing.values())) if exc.missing else []
    lines = [str(exc), f"How to pass them with {integration}:"]
    for key in keys:
        text = get(key)
        if text:
            lines.append(f"  - {key}: {text}")
    new = MissingStateError("\n".join(lines), lifecycle=exc.lifecycle, missing=exc.missing, allowed=exc.allowed)
    return new
