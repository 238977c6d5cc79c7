"""Keep resident memory bounded when large tensors come and go on several threads.

Tensors mapped fresh for every allocation are page-faulted in every time (a tensor's worth of
faults per tensor, most of shard's time once); heap memory is reused without faults but stays
resident when freed. ``bound_malloc`` caps the arenas and serves tensors up to 256 MiB from
the heap, never trimming it by itself; ``trim`` hands freed heap memory back to the OS (the
converters run it on a background thread, ``trim_in_background``) and is
called by the converters after every 128 MiB of output. Both are no-ops without glibc.
``scratch`` gives each thread buffers it reuses for temporaries that every linear needs again.
(A fixed 1 MiB mmap threshold bounds memory too, but page-faulting every tensor in costs
more than half the conversion speed.)
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading

import torch

M_ARENA_MAX = -8
M_MMAP_THRESHOLD = -3
M_TRIM_THRESHOLD = -1
#: allocations below this come from the (reused) heap; above it, from their own mapping
MMAP_THRESHOLD = 256 << 20

try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
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


def trim_in_background() -> None:
    """``trim`` on a short-lived thread, unless one is still running: a trim walks every arena
    (a few tens of ms once much memory is free), which on the thread feeding the writer stalled
    the whole pipeline (0.3 s of shard --ep 8 on the bench input)."""
    if _malloc_trim is None or not _trimming.acquire(blocking=False):
        return

    def run() -> None:
        try:
            trim()
        finally:
            _trimming.release()

    threading.Thread(target=run, name="moetool-trim", daemon=True).start()


_scratch = threading.local()


def scratch(slot: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU buffer of ``numel`` elements, kept per thread and reused on every call with the
    same ``slot`` (grown when too small): temporaries that every linear needs again come
    from memory already mapped and in cache, not from fresh allocations page-faulted in.
    The caller must be done with it before asking for the same slot again."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    buf = bufs.get((slot, dtype))
    if buf is None or buf.numel() < numel:
        buf = bufs[(slot, dtype)] = torch.empty(numel, dtype=dtype)
    return buf[:numel]
