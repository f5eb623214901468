"""The ``llmc-fsm`` command line (``llmc-fsm = llmc_fsm.cli:main``)."""

from llmc_fsm.cli.main import main

__all__ = ["main"]
