"""What a failed modifier hook touched: in-place version counters and the :class:`ModifierError` it becomes.

Every hook the session calls (``on_initialize``, the schedule and event hooks,
the calibration hooks, ``on_end``/``on_finalize``) and every torch hook a
modifier registers with :meth:`~llmc_fsm.Modifier.register_hook` is guarded:
an exception becomes :class:`~llmc_fsm.ModifierError` naming the modifier, the
hook and (for a torch hook) the module, with the original chained.

Whether the hook changed weights before raising is found with the tensors'
in-place version counters (``tensor._version``, bumped by every in-place
operation that autograd can see: ``mul_``, ``copy_``, ``torch._foreach_mul_``,
``param[...] = ...``), compared only when the hook raises. Each modifier's hooks
are guarded by one :class:`Guard`, which watches every parameter of the modules
in the state (the model, a teacher...) in two parts:

- the parameters of the modifier's :attr:`~llmc_fsm.Modifier.resolved_targets`:
  their counters are read before every hook (one integer read each);
- every other parameter (all of them for a modifier that declares no targets):
  read *lazily*. A :class:`~llmc_fsm.core.torch_hooks.FirstTorchCall` mode is
  pushed around the hook and reads their counters at the hook's first torch
  call, before it runs. A hook that makes no torch call (a schedule, a no-op)
  cannot have changed a parameter in place and pays only the push and pop of
  the mode (measured cost: ``docs/lifecycle.md``). Once a hook has made a torch
  call (it does tensor work: distillation, pruning), its guard
  (:meth:`Guard.for_hook`) reads these counters before each of its later calls
  instead (``eager``), so its torch calls do not each pass through a Python mode.

So a failure names exactly the parameters that changed between the hook's start
and its exception, inside the declared targets or outside them. Not seen: writes
through ``tensor.data`` (no counter), a parameter replaced by another object, and
in-place writes made by compiled extensions (pybind functions that are not torch
functions) in a hook before its first torch call.

For ``on_initialize`` (targets are not known yet) every parameter is read eagerly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from llmc_fsm.core.errors import ModifierError
from llmc_fsm.core.torch_hooks import FirstTorchCall, pop_mode, push_mode

__all__ = [
    "NOTHING",
    "Guard",
    "Watched",
    "changed",
    "failure",
    "module_parameters",
    "watched_parameters",
    "without",
]

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


def without(watched: Watched, exclude: Watched) -> Watched:
    """``watched`` minus the tensors of ``exclude`` (compared by identity), in ``watched``'s order."""
    ids = {id(t) for t in exclude[1]}
    kept = [(n, t) for n, t in zip(*watched, strict=True) if id(t) not in ids]
    return tuple(n for n, _ in kept), tuple(t for _, t in kept)


class Guard:
    """The version counters that guard one modifier's hooks (see the module docstring).

    The session builds one per modifier after ``on_initialize``; each of its hooks (an event, a schedule or
    calibration hook, a torch hook) is guarded by :meth:`for_hook`'s guard, which shares the counters and
    decides on its own whether to read the rest of the model lazily or eagerly.

    Use around a hook: ``token = guard.enter()``, call the hook, then
    ``guard.leave(token)`` on success (or any ``BaseException``), or
    ``guard.failed(token)`` when it raised an ``Exception`` (leaves and returns
    the names of the parameters changed in place since ``enter``).

    Args:
        targets: ``(names, tensors)`` of the declared targets' parameters, read before every hook.
        rest: ``(names, tensors)`` of every other watched parameter, read lazily (at the first torch call).

    Attributes:
        names: target names, then the other names.
        eager: whether every counter is read before each call (the rest is empty, or this hook has made a
            torch call before).
    """

    __slots__ = ("eager", "hooks", "mode", "names", "rest", "targets", "tensors")

    def __init__(self, targets: Watched = NOTHING, rest: Watched = NOTHING) -> None:
        self.names: tuple[str, ...] = targets[0] + rest[0]
        self.tensors: tuple[Any, ...] = targets[1] + rest[1]
        self.targets: tuple[Any, ...] = targets[1]
        self.rest: tuple[Any, ...] = rest[1]
        self.eager = not self.rest
        self.mode: FirstTorchCall | None = FirstTorchCall(self.rest) if self.rest else None  # reused by enter()
        self.hooks: dict[Any, Guard] = {}

    def for_hook(self, key: Any, *, reuse_mode: bool = True) -> Guard:
        """The guard of one of the modifier's hooks (``key``: e.g. the event name): same counters, own ``eager``.

        So a hook that makes torch calls (distillation's ``loss_calculated``) does not make the modifier's other
        hooks (its ``batch_start``, which makes none) read every counter. ``reuse_mode=False`` (torch hooks,
        which may run in several threads at once, e.g. ``DataParallel`` replicas): a new mode object per call.
        """
        guard = self.hooks.get(key)
        if guard is None:
            guard = Guard()
            guard.names, guard.tensors, guard.targets, guard.rest = self.names, self.tensors, self.targets, self.rest
            guard.eager = not self.rest
            guard.mode = FirstTorchCall(self.rest) if self.rest and reuse_mode else None
            self.hooks[key] = guard
        return guard

    @property
    def target_names(self) -> tuple[str, ...]:
        """The names of the declared targets' parameters."""
        return self.names[: len(self.targets)]

    def enter(self) -> Any:
        """Before the hook: read the targets' counters (all counters if ``eager``), else push the lazy mode."""
        if self.eager:
            tensors = self.tensors
            return [t._version for t in tensors] if tensors else None
        mode = self.mode
        if mode is None or mode.active:  # not reused, or entered again inside its own hook (nested)
            mode = FirstTorchCall(self.rest)
        mode.active = True
        mode.before = None
        targets = self.targets
        mode.early = [t._version for t in targets] if targets else None
        push_mode(mode)
        return mode

    def leave(self, token: Any) -> None:
        """After the hook: pop the lazy mode; if the hook made a torch call, read eagerly from now on."""
        if token.__class__ is FirstTorchCall:
            pop_mode(token)
            token.active = False
            if token.before is not None:
                self.eager = True

    def failed(self, token: Any) -> list[str]:
        """The hook raised: :meth:`leave`, then return the names of the parameters changed since :meth:`enter`."""
        self.leave(token)
        if token is None:
            return []
        if token.__class__ is not FirstTorchCall:
            return changed((self.names, self.tensors), token)
        n = len(self.targets)
        modified = changed((self.names[:n], self.targets), token.early)
        if token.before is not None:  # else no torch call was made: nothing outside the targets changed
            modified += changed((self.names[n:], self.rest), token.before)
        return modified

    def outside(self, modified: Sequence[str]) -> list[str]:
        """Those of ``modified`` that are not parameters of the declared targets (``[]`` without targets)."""
        if not self.targets:
            return []
        inside = set(self.target_names)
        return [name for name in modified if name not in inside]


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
    outside: Sequence[str] = (),
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
        outside: those of ``modified`` outside the modifier's declared targets (see :meth:`Guard.outside`).
        then: one or two sentences on what the session did and what to do now.
    """
    where = f"{label}'s {hook} on {module}" if module is not None else f"{label}.{hook}()"
    msg = f"{where} raised {type(exc).__name__}: {exc} (during {during})."
    if modified:
        msg += (
            f" It had already changed {len(modified)} parameter(s) in place: {_list(modified)}"
            + (f" ({len(outside)} outside its declared targets: {_list(outside)})" if outside else "")
            + ". Model modified by a failed hook; reload it (the change is not undone)."
        )
    return ModifierError(msg, modifier=label, hook=hook, module=module, modified=modified, advice=then)
