"""Keep resident memory bounded when large tensors come and go on several threads.

Tensors mapped fresh for every allocation are page-faulted in every time (a tensor's worth of
faults per tensor, most of shard's time once); heap memory is reused without faults but stays
resident when freed. ``bound_malloc`` caps the arenas and serves tensors up to 256 MiB from
the heap, never trimming it by itself; ``trim`` hands freed heap memory back to the OS. The
converters call ``trim_in_background`` after every 64 MiB of output: a trim on another
thread, only while resident memory is above ``RSS_KEEP``. All are no-ops without glibc.
``scratch`` gives each thread buffers it reuses for temporaries that every linear needs again.
(A fixed 1 MiB mmap threshold bounds memory too, but page-faulting every tensor in costs
more than half the conversion speed.)
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
M_ARENA_MAX = -8
M_MMAP_THRESHOLD = -3
M_TRIM_THRESHOLD = -1
#: allocations below this come from the (reused) heap; above it, from their own mapping
MMAP_THRESHOLD = 256 << 20

try:
    # the running process's symbols, libc's among them (ctypes.util.find_library("c") runs
    # `ldconfig -p` in a subprocess: ~5 ms of every start-up)
    _libc = ctypes.CDLL(None)
    _mallopt, _malloc_trim = _libc.mallopt, _libc.malloc_trim
except (OSError, AttributeError):  # not glibc
    _mallopt = _malloc_trim = None


def bound_malloc(arenas: int = 2) -> bool:
    """Process-wide malloc settings for conversion (see the module docstring); True if applied."""
    if not _mallopt:
        return False
    ok = _mallopt(M_ARENA_MAX, arenas)
    ok &= _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    ok &= _mallopt(M_TRIM_THRESHOLD, 4 * MMAP_THRESHOLD)  # free() itself never trims: trim() does
    return bool(ok)


def trim() -> None:
    if _malloc_trim is not None:
        _malloc_trim(0)


_trimming = threading.Lock()
#: resident memory under which freed heap memory is kept for reuse rather than trimmed
RSS_KEEP = 384 << 20


def resident_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def trim_in_background() -> None:
    """``trim`` on a short-lived thread, when resident memory is above ``RSS_KEEP`` and no trim
    is still running. Below it, freed memory stays for reuse (memory handed back is faulted in
    again on the next allocation: unconditional trims tripled shard's page faults); on the
    thread feeding the writer a trim stalled the whole pipeline (0.3 s of shard --ep 8)."""
    if _malloc_trim is None or resident_bytes() < RSS_KEEP or not _trimming.acquire(blocking=False):
        return

    def run() -> None:
        try:
            trim()
        finally:
            _trimming.release()

    threading.Thread(target=run, name="moetool-trim", daemon=True).start()


_scratch = threading.local()


def scratch(slot: str, numel: int, dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
    """A 1-D CPU buffer of ``numel`` elements, kept per thread and reused on every call with the
    same ``slot`` (grown when too small): temporaries that every linear needs again come
    from memory already mapped and in cache, not from fresh allocations page-faulted in.
    The caller must be done with it before asking for the same slot again (a copy to a GPU
    from a ``pin_memory`` buffer: finished, its stream synchronized)."""
    import torch

    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    key = (slot, dtype, pin_memory)
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        bufs[key] = None  # the old buffer goes before the new one is made
        buf = bufs[key] = torch.empty(numel, dtype=dtype, pin_memory=pin_memory)
    return buf[:numel]
