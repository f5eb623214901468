"""Test helpers for modifier authors: the conformance kit (:func:`check_modifier`, the ``llmc_fsm_check`` fixture;
pytest11 plugin) and :func:`run_ranks`, a worker run on several processes in one ``torch.distributed`` gloo group.

pytest loads :mod:`llmc_fsm.testing.plugin` in every project of the environment (entry point ``pytest11``); this
package imports only that module (pytest and the standard library) at its import: :func:`check_modifier`,
:class:`ContractViolation`, :func:`run_ranks` and :class:`Worker` are imported on first use (:pep:`562`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from llmc_fsm.testing.plugin import llmc_fsm_check, pytest_addoption

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs
    from llmc_fsm.testing.kit import check_modifier
    from llmc_fsm.testing.lifecycles import ContractViolation
    from llmc_fsm.testing.ranks import Worker, run_ranks

#: Name -> the module that defines it, imported on first use (listed by ``dir()``).
_LAZY = {
    "ContractViolation": "llmc_fsm.testing.lifecycles",
    "check_modifier": "llmc_fsm.testing.kit",
    "Worker": "llmc_fsm.testing.ranks",
    "run_ranks": "llmc_fsm.testing.ranks",
}

__all__ = ["ContractViolation", "Worker", "check_modifier", "llmc_fsm_check", "pytest_addoption", "run_ranks"]


def __getattr__(name: str) -> Any:
    """``check_modifier``, ``ContractViolation``, ``run_ranks`` or ``Worker``, imported on first use.

    Raises:
        AttributeError: ``name`` is none of them.
    """
    module = _LAZY.get(name)
    if module is None:
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, ``check_modifier``, ``ContractViolation``, ``run_ranks`` and ``Worker`` included (``dir()``
    and ``help()`` left them out: found by a tester). pytest loads :mod:`llmc_fsm.testing.plugin` as its plugin (the
    ``pytest11`` entry point), not this package, so listing them imports nothing at pytest's start."""
    return sorted({*globals(), *__all__})
