"""The C library's heap: give freed memory back to the system (glibc only; elsewhere these do nothing).

PyTorch's CPU tensors come from ``malloc``. glibc serves large blocks from
their own memory maps at first, but raises that threshold (up to 32 MiB) each
time such a block is freed; afterwards layer-sized tensors come from the heap,
and freed heap memory stays in the process (its resident set) while anything
above it is still in use. Two remedies, measured in ``docs/memory.md``:

* :func:`trim_heap` after each decoder layer (the in-memory pipeline): gives
  back the free heap pages; costs about a millisecond.
* :func:`limit_heap_growth` (``low_memory``): a fixed 128 KiB threshold, so
  every large tensor is mapped fresh and unmapped when freed; flat peak, but a
  page fault per page of every large tensor.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

import torch

__all__ = ["MMAP_THRESHOLD", "limit_heap_growth", "private_pages", "trim_heap"]

logger = logging.getLogger(__name__)

#: glibc's ``mallopt`` parameter number of ``M_MMAP_THRESHOLD`` (``malloc.h``).
_M_MMAP_THRESHOLD = -3
#: Allocations above this size get their own memory map, returned to the system when freed.
MMAP_THRESHOLD = 128 * 1024


def limit_heap_growth() -> bool:
    """Make glibc serve every allocation above 128 KiB from its own memory map, for the rest of the process.

    glibc starts with that threshold but raises it (up to 32 MiB) each time a
    mapped block is freed, after which a decoder layer's tensors come from the
    heap; tensors that outlive a layer (the next layer's inputs) then pin the
    heap, and the freed layers are not given back: measured on a 32-layer model
    of SmolLM2's width (one-shot SparseGPT), the process grew by ~110 MiB over
    the run, ~8 layers' weights, and its peak kept rising with depth. A fixed
    threshold (``mallopt(M_MMAP_THRESHOLD, 128 KiB)``, what the environment
    variable ``MALLOC_MMAP_THRESHOLD_=131072`` does) keeps it flat; the price is
    a page fault per page of every large tensor. SmolLM2-135M, SparseGPT, 32 x
    256 calibration tokens: peak 1.00 -> 0.59 GB, wall 34 -> 47 s (see
    ``docs/memory.md``). Does nothing on other C libraries, or when
    ``MALLOC_MMAP_THRESHOLD_`` is set (the user's choice stands; e.g.
    ``33554432`` trades memory back for speed).

    Returns:
        Whether the threshold was set.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _glibc()
    if libc is None:
        return False
    done = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    logger.debug("glibc mmap threshold fixed at %d bytes: %s", MMAP_THRESHOLD, done)
    return done


def trim_heap() -> bool:
    """Give the free pages of glibc's heaps back to the system (``malloc_trim(0)``); ``False`` elsewhere.

    Called by the sequential pipeline after each decoder layer: the activations
    of a layer's calibration and propagation forwards are freed by then, and
    without it their pages stay resident. SmolLM2-135M, GPTQ W4A16, 32 x 256
    calibration tokens: peak resident set 1.29 -> 1.04 GB, no measurable time
    (``docs/benchmarks.md``).
    """
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def private_pages(tensor: torch.Tensor) -> bool:
    """Whether the first page of ``tensor``'s storage is resident and private to this process (Linux only).

    A checkpoint loaded by ``from_pretrained`` lies in one private memory map of its safetensors file: a weight
    only read is backed by the file's pages (clean, shared with the page cache), a weight written once is backed
    by anonymous copies made on write. Replacing a weight's storage by a new tensor frees nothing of that map, so
    after a modifier that wrote the weights in place (rotations, smoothing) a second modifier that hands each
    weight a new storage keeps both copies resident (SmolLM2-135M, SpinQuant R1+R2 then W4A16 RTN: +0.38 GB of
    peak resident set, ``docs/benchmarks.md``). Callers write into a storage for which this is ``True`` (the
    write costs no page fault) and may replace one for which it is ``False`` (no write into the file map's
    pages, each of which would be copied first).

    Reads the page's flags from ``/proc/self/pagemap`` (bit 63: present, bit 61: file page or shared anonymous;
    the kernel's ``Documentation/admin-guide/mm/pagemap.rst``), which every process may read for itself.

    Args:
        tensor: any tensor; only a CPU tensor can answer ``True``.

    Returns:
        ``True`` for a resident anonymous (or copied-on-write) page; ``False`` for a file-backed or absent page,
        a non-CPU tensor, an empty storage, or a system without ``/proc/self/pagemap``.
    """
    storage = tensor.untyped_storage()
    if tensor.device.type != "cpu" or storage.nbytes() == 0:
        return False
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(storage.data_ptr() // _PAGE_SIZE * 8)
            entry = int.from_bytes(pagemap.read(8), "little")
    except OSError:
        return False
    present, file_or_shared = entry >> 63 & 1, entry >> 61 & 1
    return bool(present and not file_or_shared)


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_LIBC: list[ctypes.CDLL | None] = []


def _glibc() -> ctypes.CDLL | None:
    """glibc, loaded once; ``None`` on other systems or C libraries."""
    if not _LIBC:
        libc = None
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL("libc.so.6")
                libc.malloc_trim  # noqa: B018  (present in every glibc; checked once)
            except (OSError, AttributeError):
                libc = None
        _LIBC.append(libc)
    return _LIBC[0]
