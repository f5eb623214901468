"""The session lifecycle as data: one transition table and one event-order table.

``TRANSITIONS`` is handed to :class:`transitions.Machine` as it is; the allowed
calls per state, the error messages and the ``llmc-fsm lifecycle --mermaid``
diagram are all derived from it, so they cannot drift apart.

Per-batch events do **not** go through ``transitions`` (a trigger costs ~9 µs):
their order inside ``running`` is checked with one dictionary lookup in
``EVENT_ORDER``. Only the first event fires the ``first_event`` trigger
(initialized -> running). The event lists (batch, calibration, opening events),
the calls allowed per state and position, and the refusal messages are derived
here from ``EVENTS``, ``EVENT_ORDER`` and ``TRANSITIONS``.
"""

from __future__ import annotations

from collections.abc import Iterable

from transitions import Machine

__all__ = [
    "BATCH_EVENTS",
    "CALIBRATION_EVENTS",
    "CALLS_ALLOWED",
    "ENDING_EVENTS",
    "EVENTS",
    "EVENT_ORDER",
    "OPENING_EVENTS",
    "POSITIONS",
    "STATES",
    "TRANSITIONS",
    "allowed_now",
    "describe",
    "format_calls",
    "make_machine",
    "mermaid",
    "order_refusal",
    "refusal",
    "where",
]

STATES: tuple[str, ...] = ("created", "staging", "initialized", "running", "finalized")

#: The five stage changes. Work (storing state, initializing modifiers, ...) is
#: done by the session *before* it fires the trigger, so a call that fails
#: leaves the state where it was.
TRANSITIONS: list[dict[str, object]] = [
    {"trigger": "update_state", "source": ["created", "staging"], "dest": "staging"},
    {"trigger": "initialize", "source": ["created", "staging"], "dest": "initialized"},
    {"trigger": "first_event", "source": "initialized", "dest": "running"},
    {"trigger": "finalize", "source": ["initialized", "running"], "dest": "finalized"},
    {"trigger": "reset", "source": list(STATES), "dest": "created"},
]

#: Events a running session accepts, in the order they occur; the one list every
#: other event table (batch events, calibration events, hooks allowed per call,
#: explain's listing) is derived from. ``first_event`` is fired by the first of them.
EVENTS: tuple[str, ...] = (
    "batch_start",
    "loss_calculated",
    "optim_pre_step",
    "optim_post_step",
    "batch_end",
    "calibration_start",
    "sequential_epoch_end",
    "calibration_end",
)

#: Position inside ``initialized``/``running`` -> {event: next position}.
#: ``idle`` is between batches; a batch is ``batch_start`` -> [``loss_calculated``]
#: -> [``optim_pre_step`` -> ``optim_post_step``] -> ``batch_end`` (a batch with no
#: optimizer step is valid: gradient accumulation). Calibration events never
#: happen inside a batch.
EVENT_ORDER: dict[str, dict[str, str]] = {
    "idle": {"batch_start": "batch_start", "calibration_start": "calibrating"},
    "batch_start": {
        "loss_calculated": "loss_calculated",
        "optim_pre_step": "optim_pre_step",
        "batch_end": "idle",
    },
    "loss_calculated": {"optim_pre_step": "optim_pre_step", "batch_end": "idle"},
    "optim_pre_step": {"optim_post_step": "optim_post_step"},
    "optim_post_step": {"batch_end": "idle"},
    "calibrating": {"sequential_epoch_end": "calibrating", "calibration_end": "idle"},
    # Outside initialized/running no event is accepted.
    "closed": {},
}

#: Events that may come between batches: the schedule (``on_start``/``on_update``/
#: ``on_end``) advances at them.
OPENING_EVENTS: tuple[str, ...] = tuple(e for e in EVENTS if e in EVENT_ORDER["idle"])

#: Events that close a batch: the schedule ends (``on_end``) there the modifiers whose ``end`` the batch's
#: optimizer step reached, so an evaluation or checkpoint taken after that step holds the end (llm-compressor ends
#: modifiers at ``BATCH_END``; found by a tester, 2026-12-07). Starts and updates wait for an opening event.
ENDING_EVENTS: tuple[str, ...] = ("batch_end",)

#: The one-shot calibration events: the one entering ``calibrating`` and those inside it.
CALIBRATION_EVENTS: tuple[str, ...] = tuple(
    e for e in EVENTS if EVENT_ORDER["idle"].get(e) == "calibrating" or e in EVENT_ORDER["calibrating"]
)

#: The per-batch events, in the order they occur inside one batch.
BATCH_EVENTS: tuple[str, ...] = tuple(e for e in EVENTS if e not in CALIBRATION_EVENTS)

#: Lifecycle state -> the event positions the session can be at in it.
POSITIONS: dict[str, tuple[str, ...]] = {
    "created": ("closed",),
    "staging": ("closed",),
    "initialized": ("idle",),
    "running": tuple(p for p in EVENT_ORDER if p != "closed"),
    "finalized": ("closed",),
}


def _calls_allowed() -> dict[str, frozenset[str]]:
    allowed: dict[str, set[str]] = {state: set() for state in STATES}
    for row in TRANSITIONS:
        if row["trigger"] == "first_event":  # fired by the first event, never called directly
            continue
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        for source in sources:
            allowed[str(source)].add(str(row["trigger"]))
    return {state: frozenset(calls) for state, calls in allowed.items()}


#: Lifecycle state -> the session calls other than events allowed in it (derived
#: from ``TRANSITIONS``). Which events are allowed depends on the position inside
#: the state as well: see :func:`allowed_now`.
CALLS_ALLOWED: dict[str, frozenset[str]] = _calls_allowed()


def allowed_now(lifecycle: str, position: str) -> frozenset[str]:
    """The public calls a session in ``lifecycle`` at event ``position`` accepts (calls and events)."""
    return CALLS_ALLOWED[lifecycle] | frozenset(EVENT_ORDER[position])


def where(position: str) -> str:
    """``position`` in words: ``"between batches"``, ``"after batch_start()"``, ``"during calibration"``."""
    if position == "idle":
        return "between batches"
    if position == "calibrating":
        return "during calibration"
    return f"after {position}()"


def format_calls(calls: Iterable[str]) -> str:
    """``"a(), b()"`` for a set of call names, sorted; ``"none"`` when empty."""
    return ", ".join(f"{c}()" for c in sorted(calls)) or "none"


def describe() -> str:
    """The calls allowed in each lifecycle state, events by position (``llmc-fsm lifecycle``)."""
    lines = []
    for state in STATES:
        positions = POSITIONS[state]
        calls = CALLS_ALLOWED[state]
        if len(positions) == 1:
            names = ", ".join(sorted(allowed_now(state, positions[0])))
            lines.append(f"{state:12} allows: {names}")
            continue
        lines.append(f"{state:12} allows: {', '.join(sorted(calls))}, and the next event in order:")
        lines.extend(f"{'':14}{where(p)}: {', '.join(sorted(EVENT_ORDER[p]))}" for p in positions)
    return "\n".join(lines) + "\n"


def refusal(call: str, lifecycle: str, position: str) -> str:
    """The message of the :class:`~llmc_fsm.LifecycleError` for ``call`` refused in ``lifecycle``."""
    if call in ("update_state", "initialize") and lifecycle in ("initialized", "running"):
        why = (
            f"the session is already initialized (lifecycle {lifecycle!r}) and its state is frozen: every "
            "modifier was initialized exactly once with the state it had then, so new state would never reach "
            "them. To start over with new state, call session.reset() (finalizes the modifiers) and then "
            "update_state()/initialize() again, or create a new Session"
        )
    elif call in ("update_state", "initialize") and lifecycle == "finalized":
        why = (
            "the session is finalized and its state is frozen. Call session.reset() to reuse it "
            "(optionally with a new recipe), or create a new Session"
        )
    elif call == "finalize" and lifecycle == "finalized":
        why = "the session is already finalized; finalize() runs once. Call session.reset() to reuse it"
    elif call == "finalize":
        why = f"the session was never initialized (lifecycle {lifecycle!r}); call initialize() first"
    elif lifecycle in ("created", "staging"):
        why = f"the session is not initialized yet (lifecycle {lifecycle!r}); call initialize() first"
    elif lifecycle == "finalized":
        why = "the session is finalized; no events are accepted. Call session.reset() to reuse it"
    else:
        why = f"not allowed in lifecycle {lifecycle!r}"
    return f"{call}() refused: {why}. Allowed now: {format_calls(allowed_now(lifecycle, position))}."


def order_refusal(event: str, position: str, lifecycle: str, allowed: Iterable[str]) -> str:
    """The message of the :class:`~llmc_fsm.EventOrderError` for ``event`` at ``position`` of a session in
    ``lifecycle`` whose calls ``allowed`` now (finalize and reset too: the message named only the events, where a
    refusal names the state, the call and every call allowed; a fuzzing tester's case)."""
    expected = frozenset(EVENT_ORDER[position])
    place = where(position)
    if position == "calibrating":
        place += " (calibration events never occur inside a batch)"
    return (
        f"{event}() out of order: {place} the next event must be one of {format_calls(expected)}; a batch is "
        "batch_start -> [loss_calculated] -> [optim_pre_step -> optim_post_step] -> batch_end. Lifecycle "
        f"{lifecycle!r}; allowed now: {format_calls(allowed)}."
    )


def make_machine(model: object) -> Machine:
    """Attach the lifecycle machine to ``model`` (its ``state`` attribute holds the lifecycle)."""
    return Machine(
        model=model,
        states=list(STATES),
        transitions=TRANSITIONS,
        initial="created",
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )


def mermaid() -> str:
    """Return the lifecycle as a mermaid ``stateDiagram-v2``, generated from ``TRANSITIONS``.

    Uses ``transitions``' own mermaid engine (no graphviz needed), with its title
    front matter and ``class`` statements corrected to mermaid syntax.
    """
    from transitions.extensions.diagrams import GraphMachine

    class _Model:
        pass

    machine = GraphMachine(
        model=_Model(),
        states=list(STATES),
        transitions=TRANSITIONS,
        initial="created",
        auto_transitions=False,
        graph_engine="mermaid",
        title="llmc-fsm session lifecycle",
        show_conditions=True,
    )
    text = str(machine.get_graph().draw(None)).rstrip() + "\n"
    # transitions 0.9 writes the title as bare front matter and capitalises `class`
    # statements; mermaid wants `title:` and lowercase `class`.
    text = text.replace("---\nllmc-fsm session lifecycle\n---", "---\ntitle: llmc-fsm session lifecycle\n---", 1)
    return "\n".join("  class " + line[8:] if line.startswith("  Class ") else line for line in text.split("\n"))
