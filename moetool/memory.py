"""Keep resident memory bounded when large tensors come and go on several threads.

glibc raises its mmap threshold after big blocks are freed, so later tensors come from the
heap, and freed heap memory stays resident; each converting thread may also get an arena of
its own. ``bound_malloc`` caps the arenas; ``trim`` hands freed heap memory back to the OS and
is called now and then by the converters. Both are no-ops where glibc is not available.
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

try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _mallopt, _malloc_trim = _libc.mallopt, _libc.malloc_trim
except (OSError, AttributeError):  # not glibc
    _mallopt = _malloc_trim = None


def bound_malloc(arenas: int = 2) -> bool:
    return bool(_mallopt and _mallopt(M_ARENA_MAX, arenas))


def trim() -> None:
    if _malloc_trim is not None:
        _malloc_trim(0)


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
