"""The files a command's processes run (shared libraries, Python modules), read into the page
cache at the command's first instant, before any checkpoint read.

A cold start (page cache empty, as on a fresh node) spends its first seconds faulting in the
code of torch, CUDA, NCCL and transformers a few pages at a time: ~1 GB of small reads behind
`import torch` on an H100 host, more in the ranks. Bulk reads of a checkpoint starve those
reads, so verify waited for its imports before reading ahead, and the disk idled. Instead each
command records at its end what its processes mapped and imported (:func:`record`: a text
list in the user's cache folder, merged over runs), and the next run reads that list in large
reads on a few threads first thing (:func:`warm`): the imports then find their files in
memory, and the checkpoint's reads can start once the warm-up is done instead of once the
imports are (:func:`warming`).

A hint only: no list (a first run), a damaged list, a file gone, anything that fails is
skipped quietly; the imports then read what they need themselves. Torch-free.
``MOETOOL_CODE_LIST``: the list's path, or ``off`` (neither read nor recorded).
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
import sys
import threading
from pathlib import Path

from moetool.read.prefetch import CacheFiller, available_memory

ENV = "MOETOOL_CODE_LIST"
#: entries a list keeps at most (a run of verify --whole-model imports ~5000 files)
MAX_FILES = 20000
#: threads reading shared libraries (largest first); one more reads Python modules in import order
LIBRARY_THREADS = 3
#: a process-mapped file is code if its name says so (checkpoints are mapped too, never listed)
_SHARED_OBJECT = re.compile(r"\.so(\.[0-9.]+)?$")
_MODULE_SUFFIXES = (".py", ".pyc", ".so", ".pyd")

_warming: Warming | None = None
_lock = threading.Lock()


def list_path() -> Path | None:
    """Where this interpreter's list lives (one per Python executable and version: another
    environment imports other files), or None when ``MOETOOL_CODE_LIST=off``."""
    given = os.environ.get(ENV, "")
    if given.lower() in ("off", "0", "no", "false"):
        return None
    if given:
        return Path(given)
    key = hashlib.sha256(f"{sys.executable}\0{sys.version}\0{sys.prefix}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "moetool" / f"code-files-{key}.txt"


def read_list(path: Path) -> list[str]:
    """The absolute paths a list names, in its order; [] for a list missing or unreadable."""
    try:
        text = path.read_text(encoding="utf-8", errors="strict")
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    return [line for line in text.splitlines() if line.startswith("/")][:MAX_FILES]


def current_files() -> list[str]:
    """What this process runs: the shared libraries it maps (/proc/self/maps, Linux), then
    the files of its imported modules in import order (sources and their bytecode caches)."""
    files: dict[str, None] = {}
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    name = fields[5].rstrip("\n")
                    if _SHARED_OBJECT.search(name):
                        files[name] = None
    except OSError:
        pass
    for module in list(sys.modules.values()):
        for attr in ("__file__", "__cached__"):
            name = getattr(module, attr, None)
            if isinstance(name, str) and name.endswith(_MODULE_SUFFIXES) and os.path.isabs(name):
                files[name] = None
    return list(files)


def record(path: Path | None = None) -> None:
    """Merge this process's files (:func:`current_files`) into the list, dropping entries whose
    file is gone; written whole under a temporary name, then renamed. Quiet on any failure."""
    path = list_path() if path is None else path
    if path is None:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        merged = dict.fromkeys(read_list(path))
        merged.update(dict.fromkeys(current_files()))
        kept = [f for f in merged if os.path.isfile(f)][:MAX_FILES]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text("".join(f + "\n" for f in kept), encoding="utf-8")
        os.replace(tmp, path)
    except (OSError, ValueError):
        try:
            tmp.unlink()
        except OSError:
            pass


class Warming:
    """Reading a list's files into the page cache on daemon threads: shared libraries largest
    first on ``LIBRARY_THREADS`` threads, Python modules in the list's (import) order on one.
    ``budget``: bytes read at most (a share of the memory available)."""

    def __init__(self, files: list[str], budget: int):
        sized = []
        for name in files:
            try:
                st = os.stat(name)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):  # never a FIFO or a device: opening one could block
                sized.append((name, st.st_size))
        libraries = sorted((f for f in sized if _SHARED_OBJECT.search(f[0])), key=lambda f: -f[1])
        modules = [f for f in sized if not _SHARED_OBJECT.search(f[0])]
        #: bytes the list's files hold, and how many were read into the cache so far
        self.total_bytes = sum(s for _, s in sized)
        self.bytes_read = 0
        self._left = budget
        self._libraries = libraries
        self._count_lock = threading.Lock()
        self._threads = [threading.Thread(target=self._read, args=(self._next_library,), daemon=True,
                                          name=f"moetool-warm-lib{i}") for i in range(LIBRARY_THREADS)]
        self._threads.append(threading.Thread(target=self._read, args=(iter(modules).__next__,), daemon=True,
                                              name="moetool-warm-py"))
        for t in self._threads:
            t.start()

    def _next_library(self) -> tuple[str, int]:
        with self._count_lock:
            if not self._libraries:
                raise StopIteration
            return self._libraries.pop(0)

    def _read(self, take) -> None:
        try:
            filler = CacheFiller()
        except OSError:
            return
        try:
            while True:
                try:
                    name, size = take()
                except StopIteration:
                    return
                with self._count_lock:
                    if self._left < size:
                        continue
                    self._left -= size
                try:
                    done = filler.fill(Path(name), 0, size)
                except OSError:
                    continue
                with self._count_lock:
                    self.bytes_read += done
        finally:
            filler.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Until every file is read (or ``timeout`` seconds); True once done."""
        for t in self._threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self._threads)


def warm() -> Warming | None:
    """Start reading this interpreter's list into the page cache (once per process: a second
    call returns the first's); None where there is no list or it is off."""
    global _warming
    with _lock:
        if _warming is None:
            path = list_path()
            files = read_list(path) if path is not None else []
            if files and getattr(os, "sendfile", None) is not None:
                _warming = Warming(files, int(available_memory() * 0.25))
        return _warming


def warming() -> Warming | None:
    """The warm-up this process started, if any: its end is when bulk reads may begin."""
    return _warming
