"""Keep resident memory bounded when large tensors come and go on several threads.

glibc raises its mmap threshold after big blocks are freed, so later tensors come from the
heap, and freed heap memory stays resident; each converting thread may also get an arena of
its own. ``bound_malloc`` caps the arenas; ``trim`` hands freed heap memory back to the OS and
is called now and then by the converters. Both are no-ops where glibc is not available.
(A fixed 1 MiB mmap threshold bounds memory too, but page-faulting every tensor in costs
more than half the conversion speed.)
"""
from __future__ import annotations

import ctypes
import ctypes.util

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
