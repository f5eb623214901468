"""Conformance kit for modifier authors: :func:`check_modifier` and the ``llmc_fsm_check`` fixture (pytest11 plugin)."""

from llmc_fsm.testing.kit import ContractViolation, check_modifier, llmc_fsm_check, pytest_addoption

__all__ = ["ContractViolation", "check_modifier", "llmc_fsm_check", "pytest_addoption"]
