"""How the CLI logs: warnings on their own line beside progress bars, and each rank's labelled (found by testers)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from llmc_fsm.cli.main import _log_format

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


@pytest.mark.parametrize(("env", "line"), [
    ({}, "%(levelname)s %(name)s: %(message)s"),
    ({"WORLD_SIZE": "2", "RANK": "1"}, "rank 1: %(levelname)s %(name)s: %(message)s"),
    ({"WORLD_SIZE": "1", "RANK": "1"}, "%(levelname)s %(name)s: %(message)s"),
])  # fmt: skip
def test_every_rank_prints_its_warnings_saying_whose(monkeypatch, env, line):
    """Every rank printed the same warnings unlabelled, N copies under torchrun; printing rank 0's alone lost the
    warnings of the modules the other ranks compress (a dampening retry on rank 1: found by a tester)."""
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _log_format() == line
