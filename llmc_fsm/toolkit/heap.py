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

__all__ = [
    "MMAP_THRESHOLD",
    "THP_VARIABLE",
    "limit_heap_growth",
    "private_pages",
    "release_file_pages",
    "trim_heap",
    "use_huge_pages",
]

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


#: PyTorch's CPU allocator reads this environment variable (``c10/core/impl/alloc_cpu.cpp``) once, at its first
#: allocation: ``1`` aligns every allocation of 2 MiB or more to 2 MiB and asks the kernel for transparent huge
#: pages for it (``madvise(MADV_HUGEPAGE)``).
THP_VARIABLE = "THP_MEM_ALLOC_ENABLE"


def use_huge_pages() -> bool:
    """Ask PyTorch's CPU allocator for transparent huge pages for the rest of the process (``THP_MEM_ALLOC_ENABLE=1``).

    torch reads the setting at its first CPU allocation, so this takes effect only when called before any tensor
    was made (the command line does it first thing; a library call cannot). Large tensors then cost a page fault
    per 2 MiB instead of per 4 KiB: SmolLM2-135M, GPTQ W4A16 through the command's default (streamed) path, 2 idle
    cores, three runs each: 2.1 -> 0.86 million page faults, wall 32.5-37.6 s -> 34.8-35.2 s (the same mean, a
    third of the spread), peak RSS 0.79 -> 0.66 GB (``docs/memory.md``). Not with :func:`limit_heap_growth`
    (``--low-memory``), which maps every large tensor afresh: zeroing whole huge pages for them made SparseGPT
    ~10% slower there. The kernel decides: with
    ``/sys/kernel/mm/transparent_hugepage/enabled`` at ``never`` nothing changes. Leaves a value the user set
    (``THP_MEM_ALLOC_ENABLE=0`` keeps it off).

    Returns:
        Whether this call set the variable.
    """
    if THP_VARIABLE in os.environ:
        return False
    os.environ[THP_VARIABLE] = "1"
    return True


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
    entries = _pagemap(storage.data_ptr() // _PAGE_SIZE, 1)
    return bool(entries) and _private(entries[0])


def release_file_pages(tensor: torch.Tensor) -> int:
    """Unmap the resident pages of ``tensor``'s storage that a file (or shared memory) backs (Linux only).

    After a weight of a memory-mapped checkpoint was given a new storage, its old pages stay mapped, and counted in
    the resident set, as long as anything else of the file map lives (the map holds the whole checkpoint): the
    rounded and the loaded copy are then both resident. The pages this releases were never written by this
    process (each is checked first), so they hold the file's bytes: a later read of the old storage, if any
    reference to it remains, maps them again from the file with the same values. Nothing is released when any
    page of the storage is private memory (written, or anonymous): dropping such a page would lose what was
    written. Only pages wholly inside the storage are touched (``madvise(MADV_DONTNEED)``; the kernel's
    ``Documentation/admin-guide/mm/pagemap.rst`` for the flags read first).

    Args:
        tensor: any tensor; only a CPU tensor's storage can be released.

    Returns:
        The bytes of resident pages released (0 when nothing was, or on a system without ``/proc/self/pagemap``).
    """
    storage = tensor.untyped_storage()
    if tensor.device.type != "cpu" or storage.nbytes() == 0:
        return 0
    first = -(-storage.data_ptr() // _PAGE_SIZE)
    end = (storage.data_ptr() + storage.nbytes()) // _PAGE_SIZE
    entries = _pagemap(first, end - first) if end > first else []
    if not entries or any(_private(entry) for entry in entries):
        return 0
    resident = sum(entry >> 63 & 1 for entry in entries)
    libc = _libc()
    if resident == 0 or libc is None:
        return 0
    if libc.madvise(ctypes.c_void_p(first * _PAGE_SIZE), ctypes.c_size_t((end - first) * _PAGE_SIZE), _MADV_DONTNEED):
        return 0
    return resident * _PAGE_SIZE


def _pagemap(page: int, count: int) -> list[int]:
    """The ``/proc/self/pagemap`` entries of ``count`` pages from page number ``page`` (``[]`` where unreadable)."""
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(page * 8)
            raw = pagemap.read(count * 8)
    except OSError:
        return []
    return [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw) - 7, 8)]


def _private(entry: int) -> bool:
    """A pagemap entry of a resident page that is neither file-backed nor shared (bits 63 and 61)."""
    return bool(entry >> 63 & 1) and not entry >> 61 & 1


#: ``madvise`` advice ``MADV_DONTNEED`` (Linux ``mman-common.h``).
_MADV_DONTNEED = 4

_LIBC_ANY: list[ctypes.CDLL | None] = []


def _libc() -> ctypes.CDLL | None:
    """The C library (any, for ``madvise``) on Linux, loaded once; ``None`` elsewhere."""
    if not _LIBC_ANY:
        libc = None
        if platform.system() == "Linux":
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            except (OSError, AttributeError):
                libc = None
        _LIBC_ANY.append(libc)
    return _LIBC_ANY[0]


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
