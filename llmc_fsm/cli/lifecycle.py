"""``llmc-fsm lifecycle``: show the session lifecycle generated from the transition table."""

from __future__ import annotations

import argparse

from llmc_fsm.core.lifecycle import describe, mermaid


def _run(args: argparse.Namespace) -> int:
    if args.mermaid:
        print(mermaid(), end="")
        return 0
    print(describe(), end="")
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("lifecycle", help="print the session lifecycle", description=__doc__)
    parser.add_argument(
        "--mermaid", action="store_true", help="print a mermaid stateDiagram-v2 generated from the table"
    )
    parser.set_defaults(func=_run)
