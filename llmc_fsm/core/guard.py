"""What a failed modifier hook touched: in-place version counters and the :class:`ModifierError` it becomes.

Every hook the session calls (``on_initialize``, the schedule and event hooks,
the calibration hooks, ``on_end``/``on_finalize``) and every torch hook a
modifier registers with :meth:`~llmc_fsm.Modifier.register_hook` is guarded:
an exception becomes :class:`~llmc_fsm.ModifierError` naming the modifier, the
hook and (for a torch hook) the module, with the original chained.

Whether the hook changed weights before raising is found cheaply with the
tensors' in-place version counters (``tensor._version``, bumped by every
in-place operation that autograd can see: ``mul_``, ``copy_``,
``torch._foreach_mul_``...): the counters of the *watched* parameters are read
before the hook (one integer read per parameter, ~40 ns) and compared after a
failure. Watched are the parameters of the modifier's
:attr:`~llmc_fsm.Modifier.resolved_targets`; for ``on_initialize`` (targets are
not known yet) and for the session hooks of a modifier that declares no targets
(it may change any weight, e.g. ``lm_head``), every parameter of the modules in
the state (:func:`module_parameters`). So the per-event cost of a modifier with
targets stays one read per targeted parameter, and a change such a modifier
makes *outside* its targets is not seen (nor are changes in the torch hooks of a
modifier without targets). Writes through ``tensor.data`` bypass the counter and
are not detected.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from llmc_fsm.core.errors import ModifierError

__all__ = ["NOTHING", "Watched", "changed", "failure", "module_parameters", "watched_parameters"]

#: (parameter names, the tensors) — two parallel tuples, so taking a snapshot is one comprehension.
Watched = tuple[tuple[str, ...], tuple[Any, ...]]

NOTHING: Watched = ((), ())


def _collect(prefixed: Iterable[tuple[str, Any]]) -> Watched:
    names: list[str] = []
    tensors: list[Any] = []
    seen: set[int] = set()
    for prefix, module in prefixed:
        for name, param in module.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                names.append(prefix + name)
                tensors.append(param)
    return tuple(names), tuple(tensors)


def watched_parameters(targets: Mapping[str, Any]) -> Watched:
    """The parameters of ``targets`` (``{module name: module}``) as ``(names, tensors)``, each tensor once."""
    return _collect((f"{name}." if name else "", module) for name, module in targets.items())


def module_parameters(state: Mapping[str, Any]) -> Watched:
    """Every parameter of the ``torch.nn.Module`` values in ``state``; keys other than ``model`` prefix ``key:``."""
    return _collect(
        ("" if key == "model" else f"{key}:", value)
        for key, value in state.items()
        if callable(getattr(value, "named_parameters", None))
    )


def changed(watched: Watched, before: Sequence[int] | None) -> list[str]:
    """Names of the watched parameters whose version counter moved since ``before`` was read."""
    if not before:
        return []
    names, tensors = watched
    return [name for name, tensor, version in zip(names, tensors, before, strict=True) if tensor._version != version]


def _list(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def failure(
    label: str,
    hook: str,
    exc: BaseException,
    *,
    during: str,
    modified: Sequence[str] = (),
    module: str | None = None,
    then: str = "",
) -> ModifierError:
    """Build the :class:`ModifierError` for ``label``'s ``hook`` that raised ``exc`` (raise it ``from exc``).

    Args:
        label: the modifier's label in its session.
        hook: ``"on_event"``, ``"forward_pre hook"``...
        exc: what the hook raised.
        during: where it happened, e.g. ``"optim_post_step()"``.
        modified: parameters changed in place before the failure (see :func:`changed`).
        module: the hooked module's name, for torch hooks.
        then: one or two sentences on what the session did and what to do now.
    """
    where = f"{label}'s {hook} on {module}" if module is not None else f"{label}.{hook}()"
    msg = f"{where} raised {type(exc).__name__}: {exc} (during {during})."
    if modified:
        msg += (
            f" It had already changed {len(modified)} parameter(s) in place: {_list(modified)}. "
            "Model modified by a failed hook; reload it (the change is not undone)."
        )
    if then:
        msg += " " + then
    return ModifierError(msg, modifier=label, hook=hook, module=module, modified=modified)
