"""The pytest plugin of :mod:`llmc_fsm.testing` (entry point ``pytest11``: pytest loads it in every project of an
environment where llmc-fsm is installed): the ``--llmc-fsm-examples N`` option and the ``llmc_fsm_check`` fixture.

It imports nothing but pytest and the standard library at pytest's start: the conformance kit (torch, the session,
hypothesis) is imported when a test uses the fixture. A broken or missing dependency of llmc-fsm made pytest fail at
start in unrelated projects ("Error while loading plugin pytest11"), found by a tester.
"""

from __future__ import annotations

import argparse
import functools
import importlib
from collections.abc import Callable

import pytest

__all__ = ["llmc_fsm_check", "pytest_addoption"]


def _positive_int(text: str) -> int:
    """``--llmc-fsm-examples``'s value as an int.

    Raises:
        argparse.ArgumentTypeError: not an integer >= 1 (pytest reports it as a usage error naming the option; 0
            failed inside hypothesis with ``InvalidArgument``, found by a tester).
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        msg = f"must be a positive integer (random lifecycles per llmc_fsm_check() call), got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("llmc-fsm", "llmc-fsm modifier conformance")
    group.addoption(
        "--llmc-fsm-examples",
        type=_positive_int,
        default=None,
        metavar="N",
        help="random lifecycles per llmc_fsm_check() call, a positive integer (default: check_modifier's, 100)",
    )


@pytest.fixture
def llmc_fsm_check(request: pytest.FixtureRequest) -> Callable[..., None]:
    """:func:`~llmc_fsm.testing.check_modifier`, with ``max_examples`` taken from ``--llmc-fsm-examples`` when
    given."""
    # Imported when a test asks for the fixture, not at pytest's start (see the module docstring): the kit imports
    # torch and the session.
    check_modifier = importlib.import_module("llmc_fsm.testing.kit").check_modifier
    examples = request.config.getoption("llmc_fsm_examples", default=None)
    if examples is None:
        return check_modifier
    return functools.partial(check_modifier, max_examples=examples)
