"""Make ``llmc_fsm_quantization`` importable from a source checkout.

Once the plugin is pip-installed this is a no-op.
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("llmc_fsm_quantization") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _keep_glibcs_allocator(monkeypatch):
    """As tests/conftest.py: in-process CLI runs stream calibrated jobs by default, which would fix glibc's mmap
    threshold for the rest of the test session."""
    monkeypatch.setattr("llmc_fsm.oneshot_job.streaming.limit_heap_growth", lambda: False)
