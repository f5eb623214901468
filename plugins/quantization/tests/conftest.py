"""Make ``llmc_fsm_quantization`` importable from a source checkout.

Once the plugin is pip-installed this is a no-op.
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("llmc_fsm_quantization") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
