"""What every benchmark script reads from Linux: a process's memory fields, its age, and the machine's load.

Standard library only, so the peer scripts (run in their own venv) import it too.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["loadavg", "process_seconds", "status_kib"]


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


def process_seconds() -> float:
    """Wall seconds since this process started (its ``exec``, i.e. before the interpreter imported anything):
    ``/proc/uptime`` now minus the ``starttime`` field of ``/proc/self/stat`` (both in the kernel's clock ticks,
    so the resolution is 1 / ``SC_CLK_TCK``, 10 ms on Linux).

    Raises:
        RuntimeError: not Linux (no ``/proc``).
    """
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError as exc:
        raise RuntimeError(f"no /proc to read the process start from: {exc}") from None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 (state) is fields[0]
    start_ticks = int(fields[19])  # field 22, starttime
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def loadavg() -> str:
    """The 1-minute load average, two decimals (a benchmark is only as good as the machine is quiet)."""
    return f"{os.getloadavg()[0]:.2f}"


def for_eval(model, copy: bool = True):
    """The model to measure perplexity on (both sides of ``recipes_vs_llmcompressor.py``): a bfloat16 model is
    evaluated in float32 (its values are exact in float32; bfloat16 matrix products on a CPU without bf16
    instructions take ~10 min per 40 windows of 256 tokens). ``copy``: cast a deep copy, leaving the model to be saved
    in its own dtype. Cast tensor by tensor: transformers refuses ``.float()`` on a model it reloaded as quantized.
    A model with only some bfloat16 tensors (llm-compressor 0.14's AutoRound on a float32 model returns the tuned
    layers' weights in bfloat16, so the model's own forward stops at the first float32/bfloat16 product) is cast
    the same way."""
    import copy as _copy

    import torch  # only the torch processes call this

    if all(tensor.dtype != torch.bfloat16 for tensor in model.parameters()):
        return model
    model = _copy.deepcopy(model) if copy else model
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.dtype == torch.bfloat16:
            tensor.data = tensor.data.float()
    return model
