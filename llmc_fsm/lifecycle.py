"""The session lifecycle as data: one transition table and one event-order table.

``TRANSITIONS`` is handed to :class:`transitions.Machine` as it is; the allowed
calls per state, the error messages and the ``llmc-fsm lifecycle --mermaid``
diagram are all derived from it, so they cannot drift apart.

Per-batch events do **not** go through ``transitions`` (a trigger costs ~9 µs):
their order inside ``running`` is checked with one dictionary lookup in
``EVENT_ORDER``. Only the first event fires the ``first_event`` trigger
(initialized -> running).
"""

from __future__ import annotations

from transitions import Machine

__all__ = [
    "CALLS_ALLOWED",
    "EVENTS",
    "EVENT_ORDER",
    "STATES",
    "TRANSITIONS",
    "make_machine",
    "mermaid",
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

#: Events a running session accepts. ``first_event`` is fired by the first of them.
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


def _calls_allowed() -> dict[str, frozenset[str]]:
    allowed: dict[str, set[str]] = {state: set() for state in STATES}
    for row in TRANSITIONS:
        if row["trigger"] == "first_event":  # fired by the first event, never called directly
            continue
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        for source in sources:
            allowed[str(source)].add(str(row["trigger"]))
    for state in ("initialized", "running"):
        allowed[state].update(EVENTS)
    return {state: frozenset(calls) for state, calls in allowed.items()}


#: Lifecycle state -> public session calls allowed in it (derived from the tables).
CALLS_ALLOWED: dict[str, frozenset[str]] = _calls_allowed()


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
