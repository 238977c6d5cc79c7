"""Read parts of a checkpoint into the page cache on a thread while this process does
something else (imports torch: 4-5 s on a GPU host, time the disk would otherwise idle), so
the reads that follow find the bytes in memory.

The bytes go from the file to /dev/null inside the kernel (``sendfile``, 64 MiB a call, the
GIL released meanwhile): no process memory fills, and cached bytes are swept at ~30 GB/s.
(Linux caps ``POSIX_FADV_WILLNEED`` at the device's readahead window: 8 MiB of a whole file
on the H100 hosts, so asking is not enough.) A hint only: any failure ends it quietly, and
the reads that follow read what it did not. Torch-free.

The shared libraries a package's import maps (``package_libraries``: torch's, gigabytes in a
CUDA build) can be read first. From a cold page cache, ``import torch`` on an H100 host took
6.9 s alone and 10.2 s while the checkpoint was read ahead, against 4.3 s cached: each page
fault of the dynamic loader waits for an 8 MiB read-around behind the checkpoint's reads,
where whole files read in order go at the disk's rate.
"""
from __future__ import annotations

import importlib.util
import os
import struct
import threading
from pathlib import Path
from typing import Iterable


#: share of the memory available (MemAvailable) a folder's prefetch may fill
PREFETCH_SHARE = 0.5
#: bytes per call: one GIL hand-over per call while another thread imports torch
PREFETCH_STEP = 64 << 20
#: where a package's import starts loading shared libraries (their dependencies are followed)
LIBRARY_ROOTS = {"torch": ("_C*.so", "lib/libtorch_global_deps.so"), "triton": ("_C/*.so",)}

#: folders already being read ahead by this process (a second ask for one is answered by the first)
_started: dict[Path, threading.Thread | None] = {}
_lock = threading.Lock()


def available_memory() -> int:
    """MemAvailable (Linux), or 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def read_ahead_ranges(ranges: Iterable[tuple[Path, int, int]], budget: int) -> threading.Thread | None:
    """On a daemon thread, read each (file, offset, length) in order into the page cache until
    ``budget`` bytes are read. Returns the thread, or None where there is no ``sendfile``."""
    sendfile = getattr(os, "sendfile", None)
    if sendfile is None:
        return None
    ranges = list(ranges)

    def run() -> None:
        left = budget
        try:
            null = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            return
        try:
            for path, offset, length in ranges:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    end = offset + length
                    while left > 0 and offset < end:
                        n = sendfile(null, fd, offset, min(PREFETCH_STEP, left, end - offset))
                        if n <= 0:
                            break
                        offset += n
                        left -= n
                finally:
                    os.close(fd)
                if left <= 0:
                    return
        except OSError:
            return
        finally:
            os.close(null)

    thread = threading.Thread(target=run, name="moetool-prefetch", daemon=True)
    thread.start()
    return thread


def prefetch(root: Path | None, packages: Iterable[str] = ()) -> threading.Thread | None:
    """The shared libraries of ``packages`` (``package_libraries``), then the
    ``*.safetensors`` files of the folder ``root`` in name order (the order conversions read
    them), into the page cache, up to ``PREFETCH_SHARE`` of the memory available: a command
    that imports torch before its first read (quantize) then finds its input in memory, and a
    byte copy's small reads stop waiting on the disk one after another. A folder already
    asked for in this process is not read again (the first ask's thread is returned)."""
    key = Path(root).resolve() if root is not None and Path(root).is_dir() else None
    with _lock:
        if key is not None and key in _started:
            return _started[key]
        try:
            files = sorted(key.glob("*.safetensors")) if key is not None else []
            ranges = [(f, 0, f.stat().st_size) for f in files]
        except OSError:
            ranges = []
        libraries = [(f, 0, size) for f, size in package_libraries(packages)]
        thread = read_ahead_ranges(libraries + ranges, int(available_memory() * PREFETCH_SHARE)) \
            if libraries or ranges else None
        if key is not None:
            _started[key] = thread
    return thread


# ------------------------------------------------------------------------- shared libraries


def package_libraries(packages: Iterable[str]) -> list[tuple[Path, int]]:
    """(file, size) of the shared libraries that importing each package maps from its own
    installation (``LIBRARY_ROOTS`` and, transitively, their ``DT_NEEDED`` entries found along
    their RUNPATH: torch's CUDA libraries in a pip install), dependencies before the libraries
    that need them (the order the dynamic loader relocates them in); never imports them.
    System libraries (found nowhere along a RUNPATH) are left out: other programs keep them
    cached. Empty for a package that is not installed or not ELF."""
    seen: dict[Path, None] = {}
    for package in packages:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin:
            continue
        folder = Path(spec.origin).parent
        todo = [p for pattern in LIBRARY_ROOTS.get(package, ()) for p in sorted(folder.glob(pattern))]
        order: list[Path] = []
        while todo:
            lib = todo.pop(0).resolve()
            if lib in seen or lib in order:
                continue
            order.append(lib)
            needed, runpath = elf_needed(lib)
            dirs = [Path(d.replace("$ORIGIN", str(lib.parent))) for d in runpath] + [lib.parent]
            for name in needed:
                found = next((d / name for d in dirs if (d / name).is_file()), None)
                if found is not None:
                    todo.append(found)
        for lib in reversed(order):
            seen[lib] = None
    out = []
    for lib in seen:
        try:
            out.append((lib, lib.stat().st_size))
        except OSError:
            pass
    return out


_DT_NEEDED, _DT_STRTAB, _DT_RPATH, _DT_RUNPATH = 1, 5, 15, 29


def elf_needed(path: Path) -> tuple[list[str], list[str]]:
    """(``DT_NEEDED`` names, RUNPATH / RPATH folders) of a 64-bit little-endian ELF shared
    library; ([], []) for anything else or anything unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return [], []
            phoff, = struct.unpack_from("<Q", head, 0x20)
            phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            loads, dynamic = [], None
            for i in range(phnum):
                kind, _, offset, vaddr, _, filesz, _, _ = struct.unpack_from("<IIQQQQQQ", table, i * phentsize)
                if kind == 1:  # PT_LOAD
                    loads.append((vaddr, offset, filesz))
                elif kind == 2:  # PT_DYNAMIC
                    dynamic = (offset, filesz)
            if dynamic is None:
                return [], []
            f.seek(dynamic[0])
            entries = f.read(dynamic[1])
            strtab, needed, paths = None, [], []
            for tag, value in struct.iter_unpack("<qQ", entries[:len(entries) // 16 * 16]):
                if tag == 0:
                    break
                if tag == _DT_STRTAB:
                    strtab = value
                elif tag == _DT_NEEDED:
                    needed.append(value)
                elif tag in (_DT_RPATH, _DT_RUNPATH):
                    paths.append(value)
            base = next((off + strtab - va for va, off, size in loads if strtab is not None and va <= strtab < va + size),
                        None)
            if base is None:
                return [], []

            def string(at: int) -> str:
                f.seek(base + at)
                return f.read(4096).split(b"\0", 1)[0].decode("utf-8", "replace")

            return [string(v) for v in needed], [d for v in paths for d in string(v).split(":") if d]
    except (OSError, struct.error):
        return [], []
