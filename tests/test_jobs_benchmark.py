"""benchmarks/jobs_vs_llmcompressor.py's summary of several rounds (``--repeat``): each side's median and the ratio
of the medians. Nothing here runs a job; the rows are made up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # the script imports its sibling _measure
    try:
        spec = importlib.util.spec_from_file_location("jobs_vs_llmcompressor", BENCH / "jobs_vs_llmcompressor.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def _rows():
    rows = []
    for n, (ours, peer) in enumerate([(30.0, 90.0), (33.0, 66.0), (31.0, 70.0)], start=1):
        rows.append({"job": "gptq-cli", "side": "llmc-fsm", "e2e_s": ours, "cpu_s": 2 * ours,
                     "peak_rss_bytes": 6e8 + n, "load": "0.1 -> 1.8", "round": n})
        rows.append({"job": "gptq", "side": "llmcompressor 0.14.0.1", "e2e_s": peer, "cpu_s": 2 * peer,
                     "peak_rss_bytes": 1.2e9, "load": "1.8 -> 1.9", "round": n})
    return rows


def test_medians_of_each_side_and_their_ratio(bench):
    text = bench.render(_rows())
    # one ratio line per round, then the medians: ours 31.0 s (of 30, 33, 31), the peer's 70.0 s (of 90, 66, 70)
    assert "- gptq-cli: ours / llmcompressor (gptq), round 2, e2e wall 0.50x, CPU 0.50x, peak RSS 0.50x" in text
    assert "| gptq-cli | llmc-fsm | 3 | 31.00 | - | 62.00 | 0.600 | - |" in text
    assert "| gptq | llmcompressor 0.14.0.1 | 3 | 70.00 | - | 140.00 | 1.200 | - |" in text
    assert text.endswith("- gptq-cli: ours / llmcompressor (gptq), medians, e2e wall 0.44x, CPU 0.44x, peak RSS 0.50x")


def test_one_round_has_no_medians(bench):
    rows = [r for r in _rows() if r["round"] == 1]
    text = bench.render(rows)
    assert "Medians" not in text
    assert text.endswith("- gptq-cli: ours / llmcompressor (gptq), same run, e2e wall 0.33x, CPU 0.33x, peak RSS 0.50x")
