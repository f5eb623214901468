"""The one place that reads torch's private hook dictionaries.

``torch.nn.Module`` keeps its hooks in private attributes (``_forward_hooks``,
``_forward_pre_hooks``, ``_backward_hooks``, ``_backward_pre_hooks``) and the
global module hooks in ``torch.nn.modules.module`` (``_global_forward_hooks``,
``_global_forward_pre_hooks``); torch has no public API to count them. Every
reader in the library goes through these helpers, so a change in torch is fixed here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["HOOK_DICTS", "global_forward_hooks_installed", "hook_count"]

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
