"""Modifier registry: recipe name -> Modifier class, filled from plugins.

Plugins are found through the ``llmc_fsm`` entry-point group of the installed
distributions (``importlib.metadata``) and loaded **one at a time**, the
first-party distributions (:data:`FIRST_PARTY`) first, so their modifier names
cannot be taken by a third-party plugin. A plugin that fails to import (an
exception or ``SystemExit``; ``KeyboardInterrupt`` still propagates), that
implements no ``llmc_fsm`` hook (a missing ``@hookimpl``), whose hook
implementation does not match its specification, whose hook raises, that returns
a class not decorated with ``attrs.define`` / ``attrs.frozen``, or that
registers a modifier name already taken, is recorded as a
:class:`~llmc_fsm.PluginError` (naming the distribution, the entry point and the
cause) in :attr:`ModifierRegistry.errors`, and the other plugins still load.

``LLMC_FSM_DISABLE_PLUGINS`` (comma-separated distribution names, compared
case-insensitively with ``-``/``_``/``.`` treated alike) blocks plugins: their
entry points are not even imported.

In-process registration (tests, notebooks) needs no packaging::

    from llmc_fsm.core.registry import get_registry
    get_registry().register(MyModifier)
"""

from __future__ import annotations

import difflib
import importlib.metadata
import logging
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import pluggy

from llmc_fsm.core import hookspecs as hookspecs
from llmc_fsm.core.errors import PluginError, RecipeError
from llmc_fsm.core.lifecycle import BATCH_EVENTS
from llmc_fsm.core.modifier import Modifier

__all__ = [
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "EXTRA_OF_MODULE",
    "FIRST_PARTY",
    "DisabledPlugin",
    "ModifierInfo",
    "ModifierRegistry",
    "check_modifier_class",
    "declaration_problem",
    "get_registry",
    "missing_extra_hint",
    "unreachable_on_event",
]

logger = logging.getLogger(__name__)

#: Entry-point group plugins register under.
ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME
#: Environment variable: comma-separated distribution names whose plugins are not loaded.
DISABLE_ENV = "LLMC_FSM_DISABLE_PLUGINS"
#: The first-party plugin distributions (``plugins/`` of this repository), loaded before any other: a third-party
#: plugin registering one of their modifier names is the one reported (normalized names, see :func:`_normalize`).
FIRST_PARTY: frozenset[str] = frozenset({"llmc-fsm-pruning", "llmc-fsm-quantization", "llmc-fsm-training"})
#: Top-level module -> the llmc-fsm extra that installs it (setup.cfg's ``[options.extras_require]``): a plugin or a
#: command that fails on one of them missing says ``pip install "llmc-fsm[<extra>]"``.
EXTRA_OF_MODULE: dict[str, str] = {"transformers": "hf", "accelerate": "hf", "gguf": "hf"}


def missing_extra_hint(exc: BaseException) -> str | None:
    """``'install llmc-fsm's hf extra: pip install "llmc-fsm[hf]"'`` when ``exc`` is a :class:`ModuleNotFoundError`
    for a module of an llmc-fsm extra (:data:`EXTRA_OF_MODULE`), else ``None``."""
    if not isinstance(exc, ModuleNotFoundError):
        return None
    extra = EXTRA_OF_MODULE.get((exc.name or "").split(".")[0])
    return None if extra is None else f'install llmc-fsm\'s {extra} extra: pip install "llmc-fsm[{extra}]"'


def _normalize(name: str) -> str:
    """PEP 503 normalization, so ``My_Plugin`` and ``my-plugin`` name the same distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _disabled_from_env() -> frozenset[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    return frozenset(_normalize(part.strip()) for part in raw.split(",") if part.strip())


@attrs.frozen
class ModifierInfo:
    """One registered modifier class and where it came from.

    Attributes:
        name: the recipe name (``cls.modifier_name()``).
        cls: the :class:`~llmc_fsm.Modifier` subclass.
        distribution: the distribution that ships it, or ``None`` (registered in-process).
        version: that distribution's version, or ``None``.
        entry_point: the entry point name it was loaded through, or ``None``.
    """

    name: str
    cls: type[Modifier]
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None


@attrs.frozen
class DisabledPlugin:
    """An entry point skipped because its distribution is listed in ``LLMC_FSM_DISABLE_PLUGINS``."""

    distribution: str
    version: str | None
    entry_point: str


#: :func:`_declared` of a class whose attrs field has no default known before an instance exists.
_PER_INSTANCE = object()


def _declared(modifier: type[Modifier] | Modifier, attr: str) -> Any:
    """``attr`` as the modifier declares it: an instance's own value; for a class, the default of an attrs field of
    that name (``events`` may be a field set per instance) or else the class attribute; :data:`_PER_INSTANCE`
    for a field with no default or a default factory (not called at registration)."""
    if isinstance(modifier, type):
        field = attrs.fields_dict(modifier).get(attr) if attrs.has(modifier) else None
        if field is not None:
            default = field.default
            return _PER_INSTANCE if default is attrs.NOTHING or isinstance(default, attrs.Factory) else default
    return getattr(modifier, attr, None)


def _conditional_problem(value: Any) -> str | None:
    """What is wrong with a ``conditional_state`` declaration (a mapping of state key -> when it is required, both
    non-empty strings), or ``None``. A set of keys was accepted at registration, then ``llmc-fsm modifiers`` failed
    with "dictionary update sequence element #0 has length 15; 2 is required" and listed nothing (found by a
    tester)."""
    if value is _PER_INSTANCE:
        return None
    example = "{'steps_per_epoch': 'unless the schedule is constant'}"
    if not isinstance(value, Mapping):
        return (
            f"conditional_state must be a mapping of state key to when that key is required (e.g. {example}), "
            f"got {value!r}"
        )
    wrong = [
        f"{key!r}: {when!r}"
        for key, when in value.items()
        if not (isinstance(key, str) and key and isinstance(when, str) and when.strip())
    ]
    if wrong:
        return (
            "conditional_state must map non-empty state keys to non-empty when texts, both strings "
            f"(e.g. {example}), got {', '.join(wrong)}"
        )
    return None


def declaration_problem(modifier: type[Modifier] | Modifier) -> str | None:
    """What is wrong with a modifier's declarations (``required_state``, ``optional_state``, ``events``,
    ``events_after_end``, ``runs_after``, ``conditional_state``), or ``None``.

    ``modifier`` is a class (registration; an attrs field's default stands for the class's value) or an instance
    (a modifier given to a session directly, or the conformance kit's: its own values). Checked: each a set of
    strings (a bare string would be read as its characters, a list fails the session's set algebra:
    ``required_state | {"steps_per_epoch"}``), ``events`` among the batch events (a misspelt one would never be
    delivered, silently), ``events_after_end`` among ``events``, and ``conditional_state`` a mapping of non-empty
    state keys to non-empty when texts (``{"steps_per_epoch": "unless the schedule is constant"}``).
    """
    conditional = _conditional_problem(_declared(modifier, "conditional_state"))
    if conditional is not None:
        return conditional
    declared: dict[str, Any] = {}
    for attr in ("required_state", "optional_state", "events", "events_after_end", "runs_after"):
        value = _declared(modifier, attr)
        if value is _PER_INSTANCE:
            continue  # known per instance only: checked when an instance is given
        if not isinstance(value, frozenset | set):  # a string reads as its characters; a list fails set algebra
            example = "batch_start" if attr.startswith("events") else "model"
            return f"{attr} must be a set of strings (e.g. frozenset({{{example!r}}})), got {value!r}"
        wrong = sorted(repr(v) for v in value if not isinstance(v, str) or not v)
        if wrong:
            return f"{attr} must hold non-empty strings, got {', '.join(wrong)}"
        declared[attr] = value
    if "events" not in declared:
        return None
    events = declared["events"]
    unknown = sorted(set(events) - set(BATCH_EVENTS))
    if unknown:
        return f"events {unknown} are not batch events; on_event receives {', '.join(BATCH_EVENTS)}"
    stray = sorted(set(declared.get("events_after_end", ())) - set(events))
    if stray:
        return f"events_after_end {stray} are not in its events {sorted(events)}"
    return None


def unreachable_on_event(modifier: type[Modifier] | Modifier) -> str | None:
    """Why ``modifier``'s ``on_event`` can never be called (it is overridden and ``events`` is empty), or ``None``.

    Only for ``events`` declared on the class: an attrs field ``events`` is set per instance, and an instance made
    with ``events=frozenset()`` turns its handler off on purpose. A warning, not a refusal: a subclass may also turn
    an inherited handler off on purpose, but a class that forgot ``events`` looks just like it (its on_event was
    never called, with no message, found by a tester).
    """
    cls = modifier if isinstance(modifier, type) else type(modifier)
    if "on_event" not in cls.__dict__ or (attrs.has(cls) and "events" in attrs.fields_dict(cls)):
        return None  # not its own on_event (a subclass turning an inherited handler off), or events per instance
    if getattr(cls, "events", None):
        return None
    return (
        f"{cls.__module__}.{cls.__qualname__} overrides on_event but its events are empty, so on_event is never "
        "called; list the batch events it handles, e.g. events = frozenset({'optim_post_step'}) (from "
        f"{', '.join(BATCH_EVENTS)})"
    )


def check_modifier_class(
    modifier: type[Modifier] | Modifier,
    *,
    distribution: str | None = None,
    entry_point: str | None = None,
    stacklevel: int = 2,
    require_attrs: bool = True,
) -> str:
    """Check ``modifier`` as registration does and return its recipe name (``modifier_name()``).

    ``modifier`` is a class, or an instance (its class is checked, and :func:`declaration_problem` reads the
    instance's own declarations). One implementation for :meth:`ModifierRegistry.register`, modifier objects given
    to a :class:`~llmc_fsm.Session` directly and :func:`llmc_fsm.testing.check_modifier`. Warns (``UserWarning``,
    :func:`unreachable_on_event`) when ``on_event`` is overridden and ``events`` is empty; ``stacklevel`` as
    :func:`warnings.warn`'s, counted from the caller (2: the caller's caller). ``require_attrs=False`` (a modifier
    object given to a session directly) lets a subclass that is not decorated itself through, as before the check
    (it runs with its base's arguments; a tester's working subclass was refused).

    Raises:
        PluginError: not a Modifier subclass, a subclass not decorated with ``attrs.define`` / ``attrs.frozen``
            itself, a wrong declaration (:func:`declaration_problem`), or ``modifier_name()`` raising or returning
            anything but a non-empty string without spaces.
    """
    cls = modifier if isinstance(modifier, type) else type(modifier)
    if not (isinstance(cls, type) and issubclass(cls, Modifier)):
        msg = f"{modifier!r} is not a subclass of llmc_fsm.Modifier"
        raise PluginError(msg, distribution=distribution, entry_point=entry_point)
    where = f"{cls.__module__}.{cls.__qualname__}"
    if require_attrs and "__attrs_attrs__" not in cls.__dict__:  # inherited when the class is not decorated
        msg = (
            f"{where} is not an attrs class; decorate it with "
            "@attrs.define(kw_only=True, slots=False, eq=False) (or attrs.frozen), as docs/plugins.md shows"
        )
        raise PluginError(msg, distribution=distribution, entry_point=entry_point)
    problem = declaration_problem(modifier)
    if problem is not None:
        raise PluginError(f"{where}: {problem}", distribution=distribution, entry_point=entry_point)
    unreachable = unreachable_on_event(modifier)
    if unreachable is not None:
        warnings.warn(unreachable, UserWarning, stacklevel=stacklevel + 1)
    try:
        name = cls.modifier_name()
    except Exception as exc:  # one plugin's broken class must not stop the others (nor every command)
        msg = f"{where}.modifier_name() raised {type(exc).__name__}: {exc}"
        raise PluginError(msg, distribution=distribution, entry_point=entry_point) from exc
    if not isinstance(name, str) or not name or name.split() != [name]:
        msg = (
            f"{where}.modifier_name() returned {name!r}: a modifier name is a non-empty string without spaces "
            "(the recipe key)"
        )
        raise PluginError(msg, distribution=distribution, entry_point=entry_point)
    return name


class ModifierRegistry:
    """Maps modifier names to classes and remembers which distribution provided each.

    Attributes:
        manager: the ``pluggy.PluginManager("llmc_fsm")`` holding the loaded plugins
            (each registered under ``"<distribution>:<entry point>"``).
        errors: a :class:`~llmc_fsm.PluginError` per plugin problem, in load order.
        disabled: entry points skipped through ``LLMC_FSM_DISABLE_PLUGINS``.
    """

    def __init__(self) -> None:
        self._infos: dict[str, ModifierInfo] = {}
        self.errors: list[PluginError] = []
        self.disabled: list[DisabledPlugin] = []
        self.manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.manager.add_hookspecs(hookspecs)

    # --- views ------------------------------------------------------------------
    @property
    def classes(self) -> dict[str, type[Modifier]]:
        """Name -> class (a copy)."""
        return {name: info.cls for name, info in self._infos.items()}

    @property
    def distributions(self) -> dict[str, tuple[str | None, str | None]]:
        """Name -> (distribution, version) (a copy)."""
        return {name: (info.distribution, info.version) for name, info in self._infos.items()}

    def infos(self) -> list[ModifierInfo]:
        """Every registered modifier, sorted by name."""
        return [self._infos[name] for name in sorted(self._infos)]

    def registered_from(self, distribution: str | None, entry_point: str | None) -> list[str]:
        """The names registered through ``entry_point`` of ``distribution`` (a :class:`~llmc_fsm.PluginError`'s
        attributes), sorted: the classes of a plugin that did load when another of its classes was refused. ``[]``
        when both are ``None``: classes registered in-process are no one plugin's."""
        if distribution is None and entry_point is None:
            return []
        return sorted(
            name
            for name, info in self._infos.items()
            if (info.distribution, info.entry_point) == (distribution, entry_point)
        )

    def info(self, name: str) -> ModifierInfo | None:
        """The :class:`ModifierInfo` registered as ``name``, or ``None``."""
        return self._infos.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    # --- registration -------------------------------------------------------------
    def register(
        self,
        cls: type[Modifier],
        *,
        distribution: str | None = None,
        version: str | None = None,
        entry_point: str | None = None,
    ) -> None:
        """Register ``cls`` under ``cls.modifier_name()``.

        Use it directly for classes defined in a test or a notebook; installed
        plugins are registered through their entry point instead. Registering
        the same class twice is a no-op.

        Raises:
            PluginError: not a Modifier subclass, a subclass not decorated with
                ``attrs.define`` / ``attrs.frozen`` itself (its arguments would not be
                attrs fields), ``modifier_name()`` raising or returning anything but a
                non-empty string without spaces, or the name is already taken by another
                class (the message names the owner).
        """
        if not isinstance(cls, type):  # an instance is checked where it is used (a session, the kit), not registered
            msg = f"{cls!r} is not a subclass of llmc_fsm.Modifier"
            raise PluginError(msg, distribution=distribution, entry_point=entry_point)
        name = check_modifier_class(cls, distribution=distribution, entry_point=entry_point)
        old = self._infos.get(name)
        if old is not None:
            if old.cls is cls:
                return
            owner = _describe(old.distribution, old.version, old.entry_point)
            new = _describe(distribution, version, entry_point)
            msg = (
                f"modifier name {name!r} from {new} ({cls.__module__}.{cls.__qualname__}) is already registered "
                f"by {owner} ({old.cls.__module__}.{old.cls.__qualname__}); the later one is not registered. "
                f"Rename one of the classes (override modifier_name()) or disable one distribution with "
                f"{DISABLE_ENV}."
            )
            raise PluginError(msg, distribution=distribution, entry_point=entry_point)
        self._infos[name] = ModifierInfo(name, cls, distribution, version, entry_point)

    def unregister(self, name: str) -> None:
        """Forget the modifier registered as ``name`` (no error if unknown)."""
        self._infos.pop(name, None)

    def register_plugin(
        self,
        plugin: Any,
        *,
        distribution: str | None = None,
        version: str | None = None,
        entry_point: str | None = None,
    ) -> list[PluginError]:
        """Register a pluggy plugin object (usually a module) and its modifiers.

        The plugin's hook implementations are validated by pluggy; then its
        ``llmc_fsm_register_modifiers()`` alone is called and each returned class
        is registered. Problems are appended to :attr:`errors` and returned (this
        method does not raise for them). A plugin that fails validation or whose
        hook raises is unregistered again.
        """
        label = _describe(distribution, version, entry_point)
        name = f"{distribution or '<in-process>'}:{entry_point or getattr(plugin, '__name__', repr(plugin))}"
        found: list[PluginError] = []

        def fail(cause: str, exc: BaseException | None = None) -> list[PluginError]:
            err = PluginError(f"plugin {label}: {cause}", distribution=distribution, entry_point=entry_point)
            err.__cause__ = exc
            found.append(err)
            self.errors.append(err)
            logger.warning("%s", err)
            return found

        if self.manager.is_registered(plugin) or self.manager.get_plugin(name) is not None:
            return found  # the same module exposed twice: already loaded
        try:
            self.manager.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:  # pluggy's message spans lines: one line here
            text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            return fail(f"hook implementation does not match its specification: {text}", exc)
        except ValueError as exc:  # pragma: no cover - guarded by the check above
            return fail(str(exc))
        callers = self.manager.get_hookcallers(plugin) or []
        if not callers:
            self.manager.unregister(plugin)
            unmarked = sorted(n for n in dir(plugin) if n.startswith("llmc_fsm_") and callable(getattr(plugin, n)))
            what = f"{', '.join(unmarked)} is not marked" if unmarked else "define llmc_fsm_register_modifiers marked"
            return fail(f"implements no llmc_fsm hook (missing @hookimpl?): {what} with @llmc_fsm.hookimpl")
        unknown = sorted(caller.name for caller in callers if not caller.has_spec())
        if unknown:
            self.manager.unregister(plugin)
            known = ", ".join(sorted(n for n in dir(hookspecs) if n.startswith("llmc_fsm_")))
            return fail(f"implements unknown hook(s) {', '.join(unknown)}; known hooks: {known}")
        others = [p for p in self.manager.get_plugins() if p is not plugin]
        call = self.manager.subset_hook_caller("llmc_fsm_register_modifiers", remove_plugins=others)
        try:
            results = call()
        except (Exception, SystemExit) as exc:
            self.manager.unregister(plugin)
            return fail(f"llmc_fsm_register_modifiers() raised {type(exc).__name__}: {exc}", exc)
        if not results:  # pluggy drops a None result: a hook without return
            return fail("llmc_fsm_register_modifiers() returned None (a missing return?): return a list of Modifier "
                        "subclasses")  # fmt: skip
        for result in results:
            if isinstance(result, type) or not isinstance(result, list | tuple):
                fail(
                    "llmc_fsm_register_modifiers() must return a list of Modifier subclasses, "
                    f"got {type(result).__name__}"
                )
                continue
            for cls in result:
                try:
                    self.register(cls, distribution=distribution, version=version, entry_point=entry_point)
                except PluginError as exc:
                    fail(str(exc))
        return found

    def load_entry_points(self, *, disabled: Iterable[str] | None = None) -> list[PluginError]:
        """Load every plugin of the ``llmc_fsm`` entry-point group, one at a time.

        Args:
            disabled: distribution names not to load; default: the
                ``LLMC_FSM_DISABLE_PLUGINS`` environment variable.

        Returns:
            the plugin errors found by this call (also appended to :attr:`errors`).
        """
        blocked = _disabled_from_env() if disabled is None else frozenset(_normalize(d) for d in disabled)
        found: list[PluginError] = []
        eps = sorted(
            importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
            key=lambda ep: (_normalize(_dist_name(ep) or "") not in FIRST_PARTY, _dist_name(ep) or "", ep.name),
        )
        for ep in eps:
            dist = _dist_name(ep)
            version = ep.dist.version if ep.dist is not None else None
            if dist is not None and _normalize(dist) in blocked:
                self.disabled.append(DisabledPlugin(dist, version, ep.name))
                continue
            try:
                plugin = ep.load()
            except (Exception, SystemExit) as exc:  # a plugin calling sys.exit() must not end the host
                label = _describe(dist, version, ep.name)
                hint = missing_extra_hint(exc)
                err = PluginError(
                    f"plugin {label}: failed to import {ep.value!r}: {type(exc).__name__}: {exc}"
                    + (f" ({hint})" if hint else ""),
                    distribution=dist,
                    entry_point=ep.name,
                )
                err.__cause__ = exc
                self.errors.append(err)
                found.append(err)
                logger.warning("%s", err)
                continue
            found.extend(self.register_plugin(plugin, distribution=dist, version=version, entry_point=ep.name))
        unknown = sorted(blocked - {_normalize(_dist_name(ep) or "") for ep in eps})
        if unknown:
            logger.warning(
                "%s names %s, which no installed llmc_fsm plugin distribution is called (installed: %s); "
                "nothing was disabled for %s",
                DISABLE_ENV if disabled is None else "disabled",
                ", ".join(unknown),
                ", ".join(sorted({_dist_name(ep) or "?" for ep in eps})) or "none",
                "it" if len(unknown) == 1 else "them",
            )
        return found

    # --- lookup -------------------------------------------------------------------
    def get(self, name: str) -> type[Modifier]:
        """Return the class registered as ``name``.

        Raises:
            RecipeError: unknown name, with "did you mean" suggestions, the known
                names, the plugins that failed to load and those disabled.
        """
        info = self._infos.get(name)
        if info is not None:
            return info.cls
        raise RecipeError(self.unknown_message(name)) from None

    def suggestions(self, name: str) -> list[str]:
        """Registered names close to ``name``, best first (at most 3).

        Similarity is :class:`difflib.SequenceMatcher`'s ratio on lower-case names
        without their ``Modifier`` suffix (every modifier shares it, which made
        ``SparseGPTModifer`` look like ``LearningRateModifier``). A name is
        suggested when it scores at least 0.55 and within 0.1 of the best one.
        """
        scored = sorted(
            ((-difflib.SequenceMatcher(None, _stem(name), _stem(known)).ratio(), known) for known in self._infos),
        )
        if not scored or -scored[0][0] < _SUGGEST_CUTOFF:
            return []
        best = -scored[0][0]
        return [known for score, known in scored[:3] if -score >= max(_SUGGEST_CUTOFF, best - _SUGGEST_SPREAD)]

    def unknown_message(self, name: str, note: str | None = None) -> str:
        """The message for an unknown modifier ``name``; ``note`` (e.g. "an llm-compressor modifier llmc-fsm does not
        implement", from :func:`llmc_fsm.recipes.llmcompressor.unimplemented_note`) replaces the suggestions."""
        close = self.suggestions(name)
        hint = f" {note}" if note else f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        known = ", ".join(sorted(self._infos)) or "none (is a plugin such as llmc-fsm-pruning installed?)"
        msg = f"unknown modifier {name!r}.{hint} Known modifiers: {known}."
        if self.errors:
            msg += f" {len(self.errors)} plugin(s) failed to load (run `llmc-fsm modifiers`): " + "; ".join(
                str(e) for e in self.errors
            )
        if self.disabled:
            shown = ", ".join(sorted({d.distribution for d in self.disabled}))
            msg += f" Not loaded, disabled by {DISABLE_ENV}: {shown}."
        return msg


_SUGGEST_CUTOFF = 0.55
_SUGGEST_SPREAD = 0.1


def _stem(name: str) -> str:
    """``name`` lower-cased without a trailing ``modifier`` (or a misspelling of it, e.g. ``modifer``)."""
    lowered = name.lower()
    return re.sub(r"mod[a-z]{0,6}$", "", lowered) or lowered


def _dist_name(ep: importlib.metadata.EntryPoint) -> str | None:
    dist = ep.dist
    if dist is None:
        return None
    return dist.metadata["Name"] or getattr(dist, "name", None)


def _describe(distribution: str | None, version: str | None, entry_point: str | None) -> str:
    text = distribution or "<in-process>"
    if version:
        text += f" {version}"
    if entry_point:
        text += f" (entry point {entry_point!r})"
    return text


_REGISTRY: ModifierRegistry | None = None


def get_registry(*, reload: bool = False) -> ModifierRegistry:
    """Return the process-wide registry, loading the installed plugins on first use.

    Args:
        reload: build a fresh registry (re-reading entry points and
            ``LLMC_FSM_DISABLE_PLUGINS``); classes registered in-process with
            :meth:`ModifierRegistry.register` are dropped.
    """
    global _REGISTRY
    if _REGISTRY is None or reload:
        registry = ModifierRegistry()
        _REGISTRY = registry  # set first: a plugin calling get_registry() while loading gets this one
        registry.load_entry_points()
    return _REGISTRY
