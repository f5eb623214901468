"""Which modules a modifier touches: ``targets`` minus ``ignore``, tied weights included.

A pattern matches a module when it equals the module's class name (``"Linear"``),
equals its full name (``"lm_head"``, ``"model.layers.0.mlp.down_proj"``), or is
``"re:<regex>"`` and the regex ``fullmatch``-es the full name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["DEFAULT_IGNORE", "DEFAULT_TARGETS", "matches", "resolve_targets"]

#: Every ``nn.Linear``.
DEFAULT_TARGETS: tuple[str, ...] = ("Linear",)
#: The output head (tied to the input embedding in many LLMs).
DEFAULT_IGNORE: tuple[str, ...] = ("lm_head",)


def matches(name: str, module: nn.Module, pattern: str) -> bool:
    """Whether ``pattern`` selects the module called ``name``."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return pattern == name or pattern == type(module).__name__


def _weights(module: nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters(recurse=False)]


def resolve_targets(
    model: nn.Module, targets: Iterable[str] = DEFAULT_TARGETS, ignore: Iterable[str] = DEFAULT_IGNORE
) -> dict[str, nn.Module]:
    """Return ``{full name: module}`` for the modules to compress, in model order.

    A module is selected when a ``targets`` pattern matches it and no ``ignore``
    pattern does. Tied weights count as one weight: a module whose weight is
    the same ``Parameter`` as an ignored module's is ignored too (ignoring a tied
    ``lm_head`` keeps ``embed_tokens`` intact), and a weight shared by two
    selected modules is selected once (first name wins).

    Raises:
        ValueError: a pattern is not a valid regex, the targets match no module
            (the message lists the targets and some of the model's module names),
            or every matched module is ignored.
    """
    targets = list(targets)
    ignore = list(ignore)
    for pattern in [*targets, *ignore]:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as exc:
                msg = f"invalid regex in pattern {pattern!r}: {exc}"
                raise ValueError(msg) from None
    named = list(model.named_modules())
    ignored_params = {
        id(p) for name, module in named if any(matches(name, module, pat) for pat in ignore) for p in _weights(module)
    }
    selected: dict[str, nn.Module] = {}
    seen: set[int] = set()
    matched_any = False
    for name, module in named:
        if not name or not any(matches(name, module, pat) for pat in targets):
            continue
        matched_any = True
        if any(matches(name, module, pat) for pat in ignore):
            continue
        params = {id(p) for p in _weights(module)}
        if params & ignored_params or params & seen:
            continue
        seen |= params
        selected[name] = module
    if not matched_any:
        sample = ", ".join(f"{n} ({type(m).__name__})" for n, m in named[1:9])
        msg = (
            f"targets {targets} match no module of {type(model).__name__}; patterns are class names "
            f"('Linear'), full names or 're:<regex>'. Some module names: {sample}"
        )
        raise ValueError(msg)
    if not selected:
        msg = f"every module matched by targets {targets} is excluded by ignore {ignore} (or tied to an ignored weight)"
        raise ValueError(msg)
    return selected
