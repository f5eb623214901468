"""How the CLI logs: warnings on their own line beside progress bars, and once under torchrun (found by testers)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from llmc_fsm.cli.main import _log_level

_BAR_AND_WARNING = """
import logging, sys
from tqdm import tqdm
import llmc_fsm.cli.lifecycle as command
from llmc_fsm.cli.main import main

def run(args):
    for i in tqdm(range(3), desc="compressing layers", file=sys.stderr):
        if i == 1:
            logging.getLogger("llmc_fsm.x").warning("mid-bar")
    return 0

command._run = run
sys.exit(main(["lifecycle"]))
"""


def test_a_warning_raised_mid_bar_gets_its_own_line():
    """The warning went on the bar's line (`compressing layers:  0%| | 0/3 [...]WARNING ...`), so filtering the bar
    lines out of a log file removed it too."""
    done = subprocess.run([sys.executable, "-c", _BAR_AND_WARNING], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.split("\n") if "mid-bar" in line]
    assert [line.split("\r")[-1] for line in lines] == ["WARNING llmc_fsm.x: mid-bar"]


@pytest.mark.parametrize(("env", "verbose", "level"), [
    ({}, False, logging.WARNING),
    ({"WORLD_SIZE": "2", "RANK": "0"}, False, logging.WARNING),
    ({"WORLD_SIZE": "2", "RANK": "1"}, False, logging.ERROR),
    ({"WORLD_SIZE": "2", "RANK": "1"}, True, logging.DEBUG),
    ({"WORLD_SIZE": "1", "RANK": "1"}, False, logging.WARNING),
])  # fmt: skip
def test_warnings_come_from_rank_0_only_under_torchrun(monkeypatch, env, verbose, level):
    """Every rank printed the same warnings (a rank-deficient Hessian, an ignore pattern matching nothing): N copies
    of each under torchrun; their errors are still printed."""
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _log_level(verbose) == level
