"""Modifier registry: recipe name -> Modifier class, filled from plugins.

(Minimal version; entry-point discovery is added in plugins work.)
"""

from __future__ import annotations

import difflib

import pluggy

from llmc_fsm import hookspecs
from llmc_fsm.errors import PluginError, RecipeError
from llmc_fsm.modifier import Modifier

__all__ = ["ModifierRegistry", "get_registry"]


class ModifierRegistry:
    """Maps modifier names to classes and remembers which distribution provided each."""

    def __init__(self) -> None:
        self.classes: dict[str, type[Modifier]] = {}
        self.distributions: dict[str, tuple[str | None, str | None]] = {}
        self.errors: list[PluginError] = []
        self.manager = pluggy.PluginManager("llmc_fsm")
        self.manager.add_hookspecs(hookspecs)

    def register(self, cls: type[Modifier], *, distribution: str | None = None, version: str | None = None) -> None:
        """Register ``cls`` under ``cls.modifier_name()``.

        Raises:
            PluginError: not a Modifier subclass, or the name is already taken.
        """
        if not (isinstance(cls, type) and issubclass(cls, Modifier)):
            msg = f"{cls!r} is not a subclass of llmc_fsm.Modifier"
            raise PluginError(msg, distribution=distribution)
        name = cls.modifier_name()
        if name in self.classes and self.classes[name] is not cls:
            owner = self.distributions[name][0] or "<unknown>"
            msg = f"modifier name {name!r} is already registered by {owner}"
            raise PluginError(msg, distribution=distribution)
        self.classes[name] = cls
        self.distributions[name] = (distribution, version)

    def get(self, name: str) -> type[Modifier]:
        """Return the class registered as ``name``.

        Raises:
            RecipeError: unknown name, with "did you mean" suggestions.
        """
        try:
            return self.classes[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self.classes), n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            known = ", ".join(sorted(self.classes)) or "none (is a plugin such as llmc-fsm-pruning installed?)"
            msg = f"unknown modifier {name!r}.{hint} Known modifiers: {known}."
            raise RecipeError(msg) from None


_REGISTRY: ModifierRegistry | None = None


def get_registry() -> ModifierRegistry:
    """Return the process-wide registry, loading plugins on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = ModifierRegistry()
    return _REGISTRY
