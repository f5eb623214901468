"""Test helpers for modifier authors: the conformance kit (:func:`check_modifier`, the ``llmc_fsm_check`` fixture;
pytest11 plugin) and :func:`run_ranks`, a worker run on several processes in one ``torch.distributed`` gloo group."""

from llmc_fsm.testing.kit import ContractViolation, check_modifier, llmc_fsm_check, pytest_addoption
from llmc_fsm.testing.ranks import Worker, run_ranks

__all__ = ["ContractViolation", "Worker", "check_modifier", "llmc_fsm_check", "pytest_addoption", "run_ranks"]
