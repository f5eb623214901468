"""Where the sequential pipeline computes: the execution device, one decoder layer onloaded at a time, and where the
activations between layers live.

* :func:`resolve_device` — ``"auto" | "cpu" | "cuda" | "cuda:N"`` (or a ``torch.device``) to a ``torch.device``,
  refusing in one line what cannot run (``cuda`` without CUDA, an index torch does not see, an unknown string);
* :func:`describe_device` — its name and total memory (for the first progress line and the report);
* :func:`onloaded` — a module's own parameters and buffers moved to the device inside a block, and back to where
  each came from after it (tensors the block created on the device, e.g. a quantizer's scales, go to the module's
  home device too); the weights of the model stay where they were loaded;
* :class:`ActivationStore` / :class:`OffloadedInputs` — the hidden states between decoder layers either stay on the
  device (they fit in the activation budget) or live in CPU memory (pinned where CUDA is the device) and are moved
  to the device one calibration batch at a time; both give bit-identical results (a copy moves values exactly).

Forwards run in the model's dtype on the device; the statistics and the OBS sweeps of the first-party modifiers run
in float32 whatever the model's dtype (:class:`llmc_fsm.toolkit.obs.HessianAccumulator`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
import torch
from torch import nn

__all__ = [
    "DEFAULT_ACTIVATION_SHARE",
    "DEVICE_CHOICES",
    "ActivationStore",
    "OffloadedInputs",
    "activation_store",
    "describe_device",
    "device_label",
    "free_device_bytes",
    "onloaded",
    "resolve_device",
]

logger = logging.getLogger(__name__)

#: The device strings :func:`resolve_device` accepts (``cpu:N`` too, the CPU: what ``str(torch.device("cpu", 0))`` is).
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"

#: The activation budget when none is given: this share of the device's free memory (measured before layer 0).
DEFAULT_ACTIVATION_SHARE = 0.5

_CUDA = re.compile(r"cuda(?::(\d+))?")
_CPU = re.compile(r"cpu(?::\d+)?")


def resolve_device(spec: Any) -> torch.device:
    """The execution device that ``spec`` names.

    Args:
        spec: ``"auto"`` (the current CUDA device when torch sees one, else the CPU), ``"cpu"`` (or ``"cpu:N"``, the
            same CPU: torch gives a CPU device an index without meaning), ``"cuda"`` (the current CUDA device),
            ``"cuda:N"``, or a ``torch.device`` of those kinds (``torch.device("cpu", 0)`` was refused although the
            docs accept a ``torch.device``: found by a tester).

    Returns:
        A ``torch.device`` (``cuda`` devices always with their index; the CPU always ``torch.device("cpu")``).

    Raises:
        ValueError: one line: an unknown string, ``cuda`` when torch sees no CUDA device, or an index torch does
            not see — each saying what to use instead.
    """
    text = str(spec).strip().lower() if isinstance(spec, str | torch.device) else None
    if text == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if text is not None and _CPU.fullmatch(text):
        return torch.device("cpu")
    found = _CUDA.fullmatch(text) if text is not None else None
    if found is None:
        msg = f"must be one of {DEVICE_CHOICES} (N a CUDA device index), got {spec!r}"
        raise ValueError(msg)
    if not torch.cuda.is_available():
        msg = (
            f"is {spec!r} but torch sees no CUDA device (torch {torch.__version__}, built with CUDA "
            f"{torch.version.cuda or 'none'}); use cpu, or auto to take CUDA only where it exists"
        )
        raise ValueError(msg)
    count = torch.cuda.device_count()
    index = int(found[1]) if found[1] is not None else torch.cuda.current_device()
    if index >= count:
        msg = f"is {spec!r} but torch sees {count} CUDA device(s) (cuda:0 to cuda:{count - 1}); pick one of those"
        raise ValueError(msg)
    return torch.device("cuda", index)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def describe_device(device: torch.device) -> dict[str, Any]:
    """``{"device": "cuda:0", "name": "NVIDIA H200", "total_memory_bytes": int}`` of an execution device.

    The CPU's total memory is the machine's physical memory (``os.sysconf``; ``None`` where unknown).
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return {"device": f"cuda:{index}", "name": props.name, "total_memory_bytes": int(props.total_memory)}
    try:
        total = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        total = None
    return {"device": str(device), "name": _cpu_name(), "total_memory_bytes": total}


def device_label(info: dict[str, Any]) -> str:
    """``"cuda:0 (NVIDIA H200, 139.8 GiB)"`` from :func:`describe_device`'s dict."""
    total = info.get("total_memory_bytes")
    memory = f", {total / 2**30:.1f} GiB" if total else ""
    return f"{info['device']} ({info['name']}{memory})"


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device (``torch.cuda.mem_get_info``); ``None`` for the CPU (no separate device memory)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


# --------------------------------------------------------------------------- onloading
def _home_of(module: nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _own_tensors(module: nn.Module, skip: set[int]) -> Iterator[tuple[nn.Module, str, str, torch.Tensor]]:
    """``(owner, name, "parameter" | "buffer", tensor)`` of every module under ``module`` not under ``skip``."""
    stack = [module]
    while stack:
        sub = stack.pop()
        if id(sub) in skip:
            continue
        for name, param in sub._parameters.items():
            if param is not None:
                yield sub, name, "parameter", param
        for name, buf in sub._buffers.items():
            if buf is not None:
                yield sub, name, "buffer", buf
        stack.extend(sub._modules.values())


def _move(owner: nn.Module, name: str, kind: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device == device or tensor.is_meta:  # a lazily loaded model's tensors not read yet stay where they are
        return
    if kind == "parameter":
        tensor.data = tensor.data.to(device)  # the same Parameter object: hooks, optimizers, ties keep it
    else:
        owner._buffers[name] = tensor.to(device)


@contextlib.contextmanager
def onloaded(module: nn.Module, device: torch.device, *, skip: Iterable[nn.Module] = ()) -> Iterator[nn.Module]:
    """Inside the block, the parameters and buffers of ``module`` (but not of the submodules in ``skip``) are on
    ``device``; after it (an error included) each is back on the device it came from, and any tensor the block
    added on ``device`` (a quantizer's scale and zero point) goes to the module's home device (that of its first
    tensor before the block; the CPU when it had none).

    Parameters keep their identity (``param.data`` is replaced), so hooks, ties and references to them stay valid;
    a tensor shared by two modules moves once. On the device the tensors already are on, nothing is copied.

    Yields:
        ``module``.
    """
    home = _home_of(module)
    skipped = {id(m) for m in skip}
    where: dict[int, torch.device] = {}
    for owner, name, kind, tensor in list(_own_tensors(module, skipped)):
        where.setdefault(id(owner._parameters.get(name) if kind == "parameter" else tensor), tensor.device)
        _move(owner, name, kind, tensor, device)
        if kind == "buffer":  # the moved buffer is a new tensor: remember it under its new identity
            where[id(owner._buffers[name])] = tensor.device
    try:
        yield module
    finally:
        for owner, name, kind, tensor in list(_own_tensors(module, skipped)):
            _move(owner, name, kind, tensor, where.get(id(tensor), home))


# --------------------------------------------------------------------------- activations between layers
@attrs.define(kw_only=True, eq=False)
class ActivationStore:
    """Where the hidden states between decoder layers live.

    Attributes:
        device: the execution device.
        offload: ``False``: they stay on ``device``; ``True``: in CPU memory (pinned when ``device`` is CUDA), each
            batch's copied to ``device`` when a forward takes it (:class:`OffloadedInputs`).
        activation_bytes: bytes of one layer's hidden states over all calibration batches (the estimate the choice
            was made on).
        budget_bytes: the budget they were compared with (``None``: unlimited, the CPU's own memory).
        fetches / keeps: batches moved to the device / into CPU memory so far (offloaded mode only).
    """

    device: torch.device
    offload: bool
    activation_bytes: int = 0
    budget_bytes: int | None = None
    fetches: int = 0
    keeps: int = 0

    @property
    def mode(self) -> str:
        """``"device"`` or ``"cpu-offloaded"`` (as the report names it)."""
        return "cpu-offloaded" if self.offload else "device"

    def keep(self, hidden: torch.Tensor) -> torch.Tensor:
        """Where ``hidden`` waits for the next layer: itself, or (offloaded) its copy in CPU memory."""
        if not self.offload:
            return hidden
        self.keeps += 1
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        held = torch.empty(hidden.shape, dtype=hidden.dtype, device="cpu", pin_memory=pin)
        held.copy_(hidden)  # blocking: the values are read later, after the device copy is gone
        return held

    def fetch(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` on the execution device (a pinned host copy moves asynchronously on the current stream)."""
        if hidden.device == self.device:
            return hidden
        self.fetches += 1
        return hidden.to(self.device, non_blocking=hidden.is_pinned())

    def hold(self, inputs: Sequence[tuple[tuple[Any, ...], dict[str, Any]]]) -> Any:
        """The next layer's inputs as they wait between layers: ``inputs`` itself, or :class:`OffloadedInputs`."""
        if not self.offload:
            return inputs
        items = [item for item in (inputs.raw() if isinstance(inputs, OffloadedInputs) else inputs)]
        return OffloadedInputs([((self.keep(args[0]), *args[1:]), kwargs) for args, kwargs in items], self)

    def wrap(self, inputs: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> Any:
        """``inputs`` whose hidden states were already put where they wait (by :meth:`keep`), ready for a layer."""
        return OffloadedInputs(list(inputs), self) if self.offload else inputs

    def report(self) -> dict[str, Any]:
        """What the report says about the activations: mode, bytes, budget, batches moved."""
        return {
            "mode": self.mode,
            "activation_bytes": self.activation_bytes,
            "budget_bytes": self.budget_bytes,
            **(
                {"batches_held_in_cpu_memory": self.keeps, "batches_moved_to_device": self.fetches}
                if self.offload
                else {}
            ),
        }


class OffloadedInputs(Sequence):
    """Calibration inputs of a decoder layer whose hidden states (first positional argument) live in CPU memory.

    Indexing or iterating gives ``(args, kwargs)`` with the hidden states on the execution device, one batch at a
    time (:meth:`ActivationStore.fetch`); the other arguments (masks, rotary embeddings) are as captured.
    """

    def __init__(self, items: list[tuple[tuple[Any, ...], dict[str, Any]]], store: ActivationStore) -> None:
        self._items = items
        self.store = store

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return OffloadedInputs(self._items[index], self.store)
        args, kwargs = self._items[index]
        return (self.store.fetch(args[0]), *args[1:]), kwargs

    def raw(self) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """The items as held (hidden states in CPU memory)."""
        return list(self._items)


def activation_store(
    device: torch.device, activation_bytes: int, budget_bytes: int | None, *, share: float = DEFAULT_ACTIVATION_SHARE
) -> ActivationStore:
    """Choose where the activations between layers live.

    They stay on ``device`` when the inputs and the outputs of a layer (``2 * activation_bytes``) fit in the
    budget: ``budget_bytes`` when given, else ``share`` of the device's free memory (CUDA). On the CPU no budget
    applies, ``budget_bytes`` included: the device's memory is the CPU memory an offload would move them to (a
    budget there reported "in CPU memory, moved to the device per batch" and mode ``cpu-offloaded`` while nothing
    moved: found by a tester).
    """
    budget = budget_bytes
    if device.type == "cpu":
        if budget is not None:
            logger.info("activation budget of %d bytes not applied: the device is the CPU", budget)
        budget = None
    elif budget is None:
        free = free_device_bytes(device)
        budget = None if free is None else int(free * share)
    offload = budget is not None and 2 * activation_bytes > budget
    store = ActivationStore(device=device, offload=offload, activation_bytes=activation_bytes, budget_bytes=budget)
    logger.info(
        "activations between layers: %s (%d bytes, budget %s)",
        store.mode,
        activation_bytes,
        "unlimited" if budget is None else f"{budget} bytes",
    )
    return store
