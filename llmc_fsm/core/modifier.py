"""The :class:`Modifier` base class every compression algorithm derives from.

A modifier is an attrs class: its recipe arguments are attrs fields, validated
by attrs validators/converters when the recipe is resolved (so a bad argument
fails when the session is created, before any state is gathered). It declares
the state keys it needs in ``required_state``; the session checks them at
``initialize`` and calls :meth:`Modifier.on_initialize` exactly once.

Hooks (all optional; the session only calls the ones a class overrides):

==============================  ==================================================
``on_initialize(state)``        once, with the complete, frozen state
``on_start(state, event)``      when the schedule reaches ``start``
``on_update(state, event)``     every ``update`` epochs between start and end
``on_end(state, event)``        when the schedule reaches ``end`` (or at finalize)
``on_event(state, event)``      for each batch event in ``events`` while active
                                (and in ``events_after_end`` after ``on_end``, until finalize)
``on_calibration_start(state)`` one-shot calibration begins
``on_sequential_epoch_end(state, modules)``  a group of layers has been calibrated
``on_calibration_end(state)``   one-shot calibration ends
``on_finalize(state)``          once, at finalize (or when initialize is rolled back)
==============================  ==================================================

:meth:`Modifier.check_model` checks a model before any work (one-shot). Checkpoints:
:meth:`Modifier.state_dict` / :meth:`Modifier.load_state_dict` (default: nothing).
A hook that raises reaches the caller as :class:`~llmc_fsm.ModifierError` (see :mod:`llmc_fsm.core.guard`).

Keyword arguments pass through :data:`ARGUMENT_TRANSLATORS` before ``__init__`` (the metaclass
:class:`ModifierType`): :mod:`llmc_fsm.recipes.llmcompressor` registers the one that reads llm-compressor's argument
names and forms, so ``GPTQModifier(percdamp=0.01)`` in Python reads as the same recipe text does.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
import numbers
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from llmc_fsm.core.guard import Guard, failure, watched_parameters
from llmc_fsm.core.lifecycle import BATCH_EVENTS
from llmc_fsm.core.state import State
from llmc_fsm.core.torch_hooks import HOOK_DICTS

if TYPE_CHECKING:
    import torch


__all__ = [
    "ARGUMENT_TRANSLATORS",
    "BATCH_EVENTS",
    "HOOKS",
    "SCHEDULE_HOOKS",
    "Event",
    "Modifier",
    "ModifierType",
    "modifier_labels",
    "overrides",
    "own_forwards",
]

#: Every modifier hook, in lifecycle order.
HOOKS: tuple[str, ...] = (
    "on_initialize",
    "on_start",
    "on_update",
    "on_calibration_start",
    "on_sequential_epoch_end",
    "on_calibration_end",
    "on_event",
    "on_end",
    "on_finalize",
)

#: The hooks the schedule fires (at an opening event, ``on_end`` also at an ending event, at finalize or reset).
SCHEDULE_HOOKS: frozenset[str] = frozenset({"on_start", "on_update", "on_end"})

#: torch hook kinds :meth:`Modifier.register_hook` accepts (``module.register_<kind>_hook``).
HOOK_KINDS: frozenset[str] = frozenset(HOOK_DICTS)

#: How many :func:`own_forwards` blocks are open on each thread: while any is, every hook registered with
#: :meth:`Modifier.register_hook` does nothing.
_OWN_FORWARDS = threading.local()  # .depth


@contextlib.contextmanager
def own_forwards() -> Any:
    """A block in which a modifier runs forwards of its own (a tuning loop, a search over candidate weights, the
    float layer recomputed for a target): every hook any modifier registered with :meth:`Modifier.register_hook` is
    skipped (returns ``None``, changing nothing), so that those forwards are not taken for calibration data, e.g. by
    another modifier of the same pass (fused stages) accumulating its Hessians on the layer. Hooks registered on
    torch modules directly (``module.register_forward_pre_hook``) still run: a modifier that needs one during its
    own forwards (an input quantizer) registers it so. Blocks nest; per thread: a block on one thread leaves the
    hooks of forwards on another thread running (a process-wide count skipped another thread's calibration: found by
    a tester)."""
    _OWN_FORWARDS.depth = getattr(_OWN_FORWARDS, "depth", 0) + 1
    try:
        yield
    finally:
        _OWN_FORWARDS.depth -= 1


def overrides(modifier: Modifier | type[Modifier], hook: str) -> bool:
    """Whether ``modifier`` (an instance or a class) overrides the base class's ``hook``."""
    cls = modifier if isinstance(modifier, type) else type(modifier)
    return getattr(cls, hook) is not getattr(Modifier, hook)


def modifier_labels(modifiers: list[Modifier]) -> list[str]:
    """Labels of ``modifiers`` in order: the class name, ``#k`` appended when a name occurs more than once."""
    names = [m.modifier_name() for m in modifiers]
    seen: dict[str, int] = {}
    labels = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if names.count(name) == 1 else f"{name}#{seen[name]}")
    return labels


class _Binding:
    """The live session a modifier belongs to (a weak reference), the modifier bound (a weak reference), its label
    there and the guard of its hooks.

    A copy of a bound modifier (``copy.copy``, ``copy.deepcopy``) shares it, and is refused by another session while
    the original is bound: the copy holds the original's per-run state (its masks, or hook handles that would remove
    the original's hooks: measured by a tester, a shallow copy run in a second session cleared the first one's
    masks): :meth:`origin_session` is the session the original is bound to now, if any (none once its session is
    finalized or reset; the one it is bound to again after that). Pickling a bound modifier is refused (a
    ``TypeError`` saying so; it failed on the weak reference before)."""

    __slots__ = ("guard", "label", "modifier", "session")

    def __init__(self, session: Any, label: str, modifier: Any) -> None:  # session: a llmc_fsm.Session (not imported)
        self.session = weakref.ref(session)
        self.modifier = weakref.ref(modifier)
        self.label = label
        self.guard: Guard | None = None

    def origin_session(self) -> Any:
        """The session the modifier this binding was made for is bound to now, or ``None``."""
        origin = self.modifier()
        now = origin.__dict__.get("_llmc_fsm_binding") if origin is not None else None
        return now.session() if now is not None else None

    def __deepcopy__(self, memo: dict[int, Any]) -> _Binding:
        return self  # a deep copy shares the original's run state: refused while the original is bound

    def __reduce__(self) -> Any:
        if self.origin_session() is None:  # stale (the original's session finalized or reset): no binding
            return type(None), ()
        msg = (
            f"modifier {self.label} is bound to a live session: it cannot be pickled while its run holds hooks and "
            "state; pickle it before initialize, or after the session's finalize() or reset()"
        )
        raise TypeError(msg)


class Event:
    """What a modifier learns about the current event.

    The session reuses one instance per session and mutates it in place (an
    allocation per event would be measurable); do not keep a reference to it.

    Attributes:
        type: the event name, e.g. ``"optim_post_step"``.
        global_step: optimizer steps completed so far (``int``); during a batch it
            is the index of the optimizer step the batch contributes to.
        epoch: ``global_step / steps_per_epoch`` (``float``), or ``None`` when the
            state has no ``steps_per_epoch``.
        batch: the batch passed to ``batch_start`` (any type), or ``None``.
        loss: the loss passed to ``loss_calculated`` (a scalar tensor), or ``None``.
    """

    __slots__ = ("batch", "epoch", "global_step", "loss", "type")

    def __init__(self) -> None:
        self.type: str = ""
        self.global_step: int = 0
        self.epoch: float | None = None
        self.batch: Any = None
        self.loss: Any = None

    def __repr__(self) -> str:
        return f"Event(type={self.type!r}, global_step={self.global_step}, epoch={self.epoch})"


class _RemovedHook:
    """What a removed :class:`_ModifierHook` pickles as: a hook that does nothing (returns ``None``, so the module's
    inputs, outputs and gradients are left as they are)."""

    __slots__ = ("label",)

    def __init__(self, label: str) -> None:
        self.label = label

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _ModifierHook:
    """A modifier's torch hook as the module holds it (:meth:`Modifier.register_hook`).

    A copy of the model (``copy.deepcopy``, an EMA copy) holds the hook itself, as it held the function: while the
    hook is registered on the module it was registered on, the copy's forwards run it as the original's do. Once it
    is removed there (``remove_hooks``: the session's finalize, reset or roll-back), it does nothing when called and
    pickles as a hook that does nothing (:class:`_RemovedHook`): a copy made during a run kept running the finished
    modifier's hook and could not be pickled, with an error saying its session had not been finalized (found by a
    tester). Pickling a registered one (``torch.save`` of the whole model while the session runs) raises a
    ``TypeError`` naming the modifier: the hook function's pickle by name failed with an unrelated ``PicklingError``
    (found by a tester)."""

    __slots__ = ("call", "handle", "label")

    def __init__(self, call: Callable[..., Any], label: str) -> None:
        self.call = call
        self.label = label
        self.handle: Any = None  # the torch RemovableHandle, once registered

    @property
    def registered(self) -> bool:
        """Whether the hook is still in the hook dict of the module it was registered on (``True`` before that)."""
        handle = self.handle
        if handle is None:
            return True
        hooks = handle.hooks_dict_ref()
        return hooks is not None and handle.id in hooks

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.registered:  # removed from its module: a copy of the model holding it runs nothing
            return None
        return self.call(*args, **kwargs)

    def __copy__(self) -> _ModifierHook:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _ModifierHook:
        return self

    def __reduce__(self) -> Any:
        if not self.registered:
            return _RemovedHook, (self.label,)
        msg = (
            f"the model holds a torch hook of {self.label}, a modifier of a session that has not been finalized, and "
            "a hook cannot be pickled: save model.state_dict() (or save_pretrained), or pickle the model after "
            "session.finalize() (or reset()) removed its hooks"
        )
        raise TypeError(msg)


def _optional_epoch(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy numbers too
        msg = f"must be a number of epochs or null, got {value!r}"
        raise TypeError(msg)
    if not math.isfinite(value):  # nan passed every comparison unchecked; inf never comes (found by a tester)
        msg = f"must be a finite number of epochs or null, got {value!r}"
        raise ValueError(msg)
    return float(value)


def _check_schedule(instance: Modifier, attribute: attrs.Attribute, value: float | None) -> None:
    if value is None:
        return
    if attribute.name == "update" and value <= 0:
        msg = f"update must be > 0 epochs, got {value}"
        raise ValueError(msg)
    if attribute.name == "start" and value < 0:
        msg = f"start must be >= 0 epochs, got {value}"
        raise ValueError(msg)


#: Functions ``translate(cls, kwargs) -> kwargs`` that rewrite a modifier's keyword arguments before its
#: ``__init__``, in order (a translator raises ``ValueError`` to refuse an argument). Registered by the modules that
#: own a dialect (:mod:`llmc_fsm.recipes.llmcompressor`); the recipe builder's arguments pass through them too, so
#: a translator must leave arguments already in llmc-fsm's form unchanged.
ARGUMENT_TRANSLATORS: list[Callable[[type, dict[str, Any]], dict[str, Any]]] = []


class ModifierType(abc.ABCMeta):
    """The metaclass of :class:`Modifier`: ``SomeModifier(**kwargs)`` builds the modifier from the keyword arguments
    :data:`ARGUMENT_TRANSLATORS` give (an ``ABCMeta``, so a subclass may also derive from ``abc.ABC``)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        for translate in ARGUMENT_TRANSLATORS:
            kwargs = translate(cls, kwargs)
        return super().__call__(*args, **kwargs)


@attrs.define(kw_only=True, slots=False, eq=False)
class Modifier(metaclass=ModifierType):
    """Base class for compression modifiers (pruning, quantization, distillation, schedules).

    Subclass it with ``@attrs.define(kw_only=True, slots=False, eq=False)`` and
    declare recipe arguments as attrs fields with validators. Class attributes:

    - ``required_state``: state keys :meth:`on_initialize` needs; ``initialize``
      refuses to run until every modifier's keys are present.
    - ``optional_state``: keys used when present.
    - ``events``: the batch events :meth:`on_event` handles (default: none).
      Declaring them lets the session skip this modifier on every other event.
    - ``runs_after``: names of modifiers this one must follow within an event.
    - ``events_after_end``: the events of ``events`` that :meth:`on_event` still
      handles after :meth:`on_end`, until finalize (default: none), e.g. pruning
      masks held after the schedule ends.

    Recipe fields shared by every modifier (all in epochs, ``float``):

    - ``start``: when :meth:`on_start` fires; ``None`` (default) = at the first event.
    - ``end``: when :meth:`on_end` fires; ``None`` (default) = active until finalize.
    - ``update``: period of :meth:`on_update` between start and end; ``None`` = never.

    A modifier with a numeric ``start``, ``end`` or ``update`` also requires
    ``steps_per_epoch`` (steps are turned into epochs with it).

    Raises (at construction): ``TypeError``/``ValueError`` from attrs validators
    for bad arguments, e.g. ``end`` not after ``start``.
    """

    required_state: ClassVar[frozenset[str]] = frozenset()
    optional_state: ClassVar[frozenset[str]] = frozenset()
    #: Keys :meth:`required_keys` requires for some arguments only, each with when (``{"steps_per_epoch": "unless
    #: the schedule is constant with no start/end/update"}``): what ``llmc-fsm modifiers`` lists beside them and the
    #: reason a :class:`~llmc_fsm.MissingStateError` gives (:meth:`required_because`). A mapping of strings to
    #: strings; anything else (a set of keys) is refused at registration.
    conditional_state: ClassVar[Mapping[str, str]] = {}
    events: ClassVar[frozenset[str]] = frozenset()
    runs_after: ClassVar[frozenset[str]] = frozenset()
    events_after_end: ClassVar[frozenset[str]] = frozenset()

    start: float | None = attrs.field(default=None, converter=_optional_epoch, validator=_check_schedule)
    end: float | None = attrs.field(default=None, converter=_optional_epoch, validator=_check_schedule)
    update: float | None = attrs.field(default=None, converter=_optional_epoch, validator=_check_schedule)

    def __attrs_post_init__(self) -> None:
        if self.start is not None and self.end is not None and self.end <= self.start:
            msg = f"end ({self.end}) must be after start ({self.start})"
            raise ValueError(msg)

    # --- declared needs ---------------------------------------------------
    @classmethod
    def modifier_name(cls) -> str:
        """The name recipes use for this class (the class name)."""
        return cls.__name__

    @classmethod
    def description(cls) -> str:
        """First line of the class docstring."""
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    def required_keys(self) -> frozenset[str]:
        """The state keys this instance needs at ``initialize``.

        ``required_state`` plus ``steps_per_epoch`` when the schedule is numeric.
        """
        if self.is_scheduled:
            return frozenset(self.required_state) | {"steps_per_epoch"}
        return frozenset(self.required_state)

    def required_because(self) -> dict[str, str]:
        """Why each key of :meth:`required_keys` that only some arguments require is required: key -> when text,
        read by :class:`~llmc_fsm.MissingStateError`'s message (``'calibration_data' is required when ...``).

        The keys of ``conditional_state`` that :meth:`required_keys` holds, with their text; ``steps_per_epoch``
        of a modifier given ``start``/``end``/``update`` that declares it neither required nor conditional, with
        ``"because the modifier has a start/end/update schedule in epochs"``. Keys required by every instance
        (``required_state``) have no entry.

        Returns:
            A new dict, key (str) -> when text (str); empty when no key is conditional.
        """
        keys = self.required_keys()
        reasons = {key: when for key, when in self.conditional_state.items() if key in keys}
        spe = "steps_per_epoch"
        if self.is_scheduled and spe in keys and spe not in reasons and spe not in self.required_state:
            reasons[spe] = "because the modifier has a start/end/update schedule in epochs"
        return reasons

    @property
    def is_scheduled(self) -> bool:
        """Whether ``start``, ``end`` or ``update`` is set (needs ``steps_per_epoch``)."""
        return self.start is not None or self.end is not None or self.update is not None

    @property
    def resolved_targets(self) -> dict[str, torch.nn.Module]:
        """``{full module name: module}`` this modifier compresses, selected at initialize.

        The one public way for a modifier to say which modules it touches: the
        one-shot report and the pipeline's target check read it, and the session
        guards this modifier's hooks with the version counters of these modules'
        parameters (read once, right after ``on_initialize``: select targets
        there). Empty before ``initialize`` and for modifiers that touch no
        module (schedules, distillation); subclasses that select modules override it.
        """
        return {}

    def check_model(self, model: torch.nn.Module) -> Any:
        """Checks that need only ``model`` (pure: names, classes, shapes; maybe on ``meta``); raise ``ValueError``.

        One-shot calls it for every modifier right after loading, before any measuring or calibration.
        """

    # --- checkpoints ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Return what this modifier needs to continue exactly after a resume (default: nothing).

        Called between batches (the session refuses to save inside a batch).
        Values are ``torch.Tensor`` (stored in safetensors), JSON values
        (``None``, bool, int, float, str, lists) or nested ``dict``s of them
        with string keys; recipe arguments need not be included (the checkpoint
        records them and refuses a session whose arguments differ). Store masks
        compactly (e.g. :func:`llmc_fsm.toolkit.masks.pack_mask`), not as float copies.
        """
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; called after ``on_initialize``, before the first event.

        Tensors come back on the CPU; JSON lists as lists. Validate everything
        before changing anything.

        Raises:
            ValueError: ``state`` does not fit this modifier (the default accepts
                only an empty dict).
        """
        if state:
            msg = (
                f"{self.modifier_name()} keeps no checkpoint state (it does not implement load_state_dict), "
                f"but the checkpoint holds {sorted(state)} for it"
            )
            raise ValueError(msg)

    # --- the live session this modifier belongs to ----------------------------
    @property
    def _binding(self) -> _Binding | None:
        return self.__dict__.get("_llmc_fsm_binding")

    def _guard(self) -> Guard:
        binding = self._binding
        if binding is not None and binding.guard is not None:
            return binding.guard  # the session's: targets before each hook, the rest of the state lazily
        targets = self.resolved_targets  # not (yet) in a session: its targets only
        return Guard(watched_parameters(targets)) if targets else Guard()

    # --- torch hooks that finalize always removes ---------------------------
    def register_hook(
        self,
        module: torch.nn.Module,
        hook: Callable[..., Any],
        kind: str = "forward",
        **kwargs: Any,
    ) -> Any:
        """Register a torch hook on ``module`` that the session removes at finalize.

        The hook is guarded: an exception inside it reaches the caller (e.g.
        the model's forward inside the one-shot pipeline) as
        :class:`~llmc_fsm.ModifierError` naming this modifier and the module.
        If it changed parameters in place before raising (of
        :attr:`resolved_targets` or, in a session, of any module in the state),
        the error names them and the modifier's session refuses further events
        (see :mod:`llmc_fsm.core.guard`). In a model compiled with ``torch.compile``
        the hook runs eagerly (``torch._dynamo.disable``), not traced into the graph.

        Args:
            module: the ``torch.nn.Module`` to hook.
            hook: the hook function, with the signature torch expects for ``kind``.
            kind: ``"forward"``, ``"forward_pre"``, ``"full_backward"`` or
                ``"full_backward_pre"`` (``module.register_<kind>_hook``).
            **kwargs: passed on (e.g. ``with_kwargs=True``).

        Returns:
            the torch ``RemovableHandle``.

        Raises:
            ValueError: unknown ``kind``.
        """
        if kind not in HOOK_KINDS:
            msg = f"unknown hook kind {kind!r}; use forward, forward_pre, full_backward or full_backward_pre"
            raise ValueError(msg)

        key = (kind, id(module))  # its guard's own lazy/eager state (see Guard.for_hook)

        @functools.wraps(hook)
        def guarded(*args: Any, **kw: Any) -> Any:
            if getattr(_OWN_FORWARDS, "depth", 0):  # a modifier's own forwards (:func:`own_forwards`)
                return None
            guard = self._guard().for_hook(key, reuse_mode=False)
            token = guard.enter()
            try:
                result = hook(*args, **kw)
            except Exception as exc:
                modified = guard.failed(token)
                raise self._torch_hook_failed(module, kind, exc, modified, guard.outside(modified)) from exc
            except BaseException:
                guard.leave(token)
                raise
            guard.leave(token)
            return result

        dynamo = sys.modules.get("torch._dynamo")  # loaded by torch.compile (and transformers); not imported here
        if dynamo is not None:  # in a torch.compile'd model the hook runs eagerly: it keeps Python state
            guarded = dynamo.disable(guarded)
        binding = self._binding
        label = binding.label if binding is not None else self.modifier_name()
        wrapped = _ModifierHook(guarded, label)
        handle = getattr(module, f"register_{kind}_hook")(wrapped, **kwargs)
        wrapped.handle = handle
        self.__dict__.setdefault("_llmc_fsm_hooks", []).append(handle)
        return handle

    def _module_name(self, module: Any) -> str:
        for name, target in self.resolved_targets.items():
            if target is module:
                return name
        binding = self._binding
        session = binding.session() if binding is not None else None
        model = session.state.get("model") if session is not None else None
        for name, sub in getattr(model, "named_modules", list)():
            if sub is module:
                return name or "the model"
        return type(module).__name__

    def _torch_hook_failed(
        self, module: Any, kind: str, exc: Exception, modified: list[str], outside: list[str]
    ) -> Exception:
        binding = self._binding
        session = binding.session() if binding is not None else None
        label = binding.label if binding is not None else self.modifier_name()
        if not modified:
            checked = "parameter of the model" if session is not None else "targeted parameter"
            then = f"No in-place change to a {checked} was seen; the hook stays registered."
        elif session is not None:
            then = "The session refuses further events and removed every modifier's hooks."
        else:
            then = "The modifier's hooks were removed."
        error = failure(
            label,
            f"{kind} hook",
            exc,
            during="a forward/backward pass of the model",
            modified=modified,
            module=self._module_name(module),
            outside=outside,
            then=then,
        )
        if session is not None:
            session._hook_failed(error)
        elif modified:
            self.remove_hooks()
        return error

    def __getstate__(self) -> dict[str, Any]:
        """What a copy or a pickle takes: everything but the torch hook handles of a run (:meth:`register_hook`),
        which belong to the object that registered them (a copy holding them removed the original's hooks, and a
        pickle of finished handles could not be loaded back: found by testers). The session binding is kept (a copy
        of a bound modifier is refused while its original is bound; pickling one is refused). A ``slots=True`` attrs
        subclass has attrs' own ``__getstate__`` instead (modifiers are ``slots=False``: docs/plugins.md)."""
        state = dict(self.__dict__)
        state.pop("_llmc_fsm_hooks", None)
        return state

    def remove_hooks(self) -> int:
        """Remove every hook registered with :meth:`register_hook`; return how many."""
        handles = self.__dict__.pop("_llmc_fsm_hooks", [])
        for handle in handles:
            handle.remove()
        return len(handles)

    @property
    def num_hooks(self) -> int:
        """Number of live hooks registered with :meth:`register_hook`."""
        return len(self.__dict__.get("_llmc_fsm_hooks", ()))

    # --- lifecycle hooks (no-ops; override what you need) -------------------
    def on_initialize(self, state: State) -> None:
        """Prepare with the complete state; raise if something is unusable."""

    def on_start(self, state: State, event: Event) -> None:
        """Begin the modifier's active period."""

    def on_update(self, state: State, event: Event) -> None:
        """Periodic update while active (every ``update`` epochs)."""

    def on_end(self, state: State, event: Event) -> None:
        """End the active period (at ``end``, or at finalize when ``end`` is omitted)."""

    def on_event(self, state: State, event: Event) -> Any:
        """Handle a batch event listed in ``events``; for ``loss_calculated`` a
        returned tensor replaces the loss."""

    def on_calibration_start(self, state: State) -> None:
        """One-shot calibration begins: attach observers/hooks."""

    def on_sequential_epoch_end(self, state: State, modules: Any) -> None:
        """Calibration data has passed through ``modules``: compress them now."""

    def on_calibration_end(self, state: State) -> None:
        """One-shot calibration has ended."""

    def on_finalize(self, state: State) -> None:
        """Leave the model in its final form; release everything."""
