"""Make ``llmc_fsm_pruning`` importable from a source checkout.

Once the plugin is pip-installed this is a no-op.
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("llmc_fsm_pruning") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
