"""What every benchmark script reads from Linux: a process's memory fields and the machine's load.

Standard library only, so the peer scripts (run in their own venv) import it too.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["loadavg", "status_kib"]


def status_kib(field: str = "VmHWM") -> int:
    """A ``/proc/self/status`` memory field of this process in KiB: ``VmHWM`` (peak resident set,
    = ``ru_maxrss``) by default, or e.g. ``VmRSS``.

    Raises:
        RuntimeError: the field is not there (not Linux).
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def loadavg() -> str:
    """The 1-minute load average, two decimals (a benchmark is only as good as the machine is quiet)."""
    return f"{os.getloadavg()[0]:.2f}"
