"""The one place that uses torch's private hook machinery: module hook dictionaries and the torch-function mode stack.

``torch.nn.Module`` keeps its hooks in private attributes (``_forward_hooks``,
``_forward_pre_hooks``, ``_backward_hooks``, ``_backward_pre_hooks``) and the
global module hooks in ``torch.nn.modules.module`` (``_global_forward_hooks``,
``_global_forward_pre_hooks``); torch has no public API to count them. Every
reader in the library goes through these helpers, so a change in torch is fixed here.

:class:`FirstTorchCall` is a ``torch.overrides.TorchFunctionMode`` that the
failure guard (:mod:`llmc_fsm.core.guard`) pushes around a hook: at the hook's
first call of a torch function (``mul_``, ``copy_``, ``torch.no_grad()``'s
``_set_grad_enabled``, a ``Tensor`` attribute read...) it reads the version
counters of the tensors it was given, before that call runs. A hook that makes
no torch call costs one push and one pop of torch's mode stack
(:func:`push_mode` / :func:`pop_mode`: the private calls ``with mode:`` makes,
without its Python frames).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HOOK_DICTS", "FirstTorchCall", "global_forward_hooks_installed", "hook_count", "pop_mode", "push_mode"]

#: Hook kind (``module.register_<kind>_hook``) -> the private ``nn.Module`` dictionary that holds those hooks.
HOOK_DICTS: dict[str, str] = {
    "forward": "_forward_hooks",
    "forward_pre": "_forward_pre_hooks",
    "full_backward": "_backward_hooks",
    "full_backward_pre": "_backward_pre_hooks",
}


def hook_count(module: Any, kinds: Iterable[str] = tuple(HOOK_DICTS)) -> int:
    """Number of torch hooks of ``kinds`` (keys of :data:`HOOK_DICTS`) registered on ``module`` itself.

    Children are not counted; an object without hook dictionaries counts 0.

    Raises:
        KeyError: an unknown kind.
    """
    return sum(len(getattr(module, HOOK_DICTS[kind], None) or ()) for kind in kinds)


def global_forward_hooks_installed() -> bool:
    """Whether global module forward (pre-)hooks are installed (``register_module_forward_hook`` and the pre- one)."""
    from torch.nn.modules import module as torch_module

    return bool(
        getattr(torch_module, "_global_forward_hooks", None) or getattr(torch_module, "_global_forward_pre_hooks", None)
    )


class FirstTorchCall(TorchFunctionMode):
    """A torch-function mode that reads ``tensors``' version counters at the first torch call made under it.

    Every call is passed on unchanged (to the next mode on the stack, then to torch). One instance may be
    pushed again after it was popped (:meth:`arm` first).

    Attributes:
        tensors: the tensors whose ``_version`` is read (a tuple).
        early: what the guard read before pushing the mode (kept here for it; not used by the mode).
        before: ``[tensor._version ...]`` read just before the first torch call, or ``None`` while none was made.
        active: whether it is on a mode stack now (set by its user).
    """

    def __init__(self, tensors: Sequence[Any]) -> None:
        self.tensors = tensors
        self.early: Any = None
        self.before: list[int] | None = None
        self.active = False

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        if self.before is None:  # the mode is off torch's stack while this runs: these reads do not come back here
            self.before = [t._version for t in self.tensors]
        return func(*args, **(kwargs or {}))


#: Push a mode on this thread's torch-function mode stack (torch's own C function; what ``with mode:`` calls).
push_mode: Callable[[TorchFunctionMode], None] = torch._C._push_on_torch_function_stack


def pop_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off this thread's torch-function mode stack (what ``with mode:`` does on exit).

    Fast when ``mode`` is on top. Modes a hook pushed above it and left there are
    put back in their order; if ``mode`` is no longer on the stack (a hook popped
    it), the stack is left as it was.
    """
    try:
        popped = torch._C._pop_torch_function_stack()
    except RuntimeError:  # empty: a hook popped it
        return
    if popped is not mode:
        _pop_below(mode, popped)


def _pop_below(mode: TorchFunctionMode, top: Any) -> None:
    above = [top]  # top first
    while torch._C._len_torch_function_stack():
        popped = torch._C._pop_torch_function_stack()
        if popped is mode:
            break
        above.append(popped)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)
