"""The files a command's processes run (shared libraries, Python modules), read into the page
cache at the command's first instant, before any checkpoint read.

A cold start (page cache empty, as on a fresh node) spends its first seconds faulting in the
code of torch, CUDA, NCCL and transformers a few pages at a time: ~1 GB of small reads behind
`import torch` on an H100 host, more in the ranks. Bulk reads of a checkpoint starve those
reads, so verify waited for its imports before reading ahead, and the disk idled. Instead each
command records at its end what its processes ran (:func:`record`: a text list in the user's
cache folder, merged over runs): the byte ranges of each shared library they touched (pages
present in their page tables: a third of the 3-4 GB of libraries they map), and the files of
the modules they imported. The next run has a child interpreter read that list first thing,
unless its code is in memory already (:func:`warm`; 0.8 GB in ~3 s on an H100 host): the
imports and the ranks' CUDA start then find their code in memory, and verify --whole-model
reads ahead from the spawn instead of after its check's imports (:func:`warming`). Not from
the start: there, bulk reads slowed even a warm, CPU-bound import by half.

Beside what a process maps and imports, :func:`watch` notes what it opens and lists through
Python (an audit hook): transformers' package metadata, configs, the folders the import
system lists. The list's lines: ``PATH`` (the whole file), ``PATH<TAB>OFFSET+LENGTH,...``
(those ranges of it) or ``PATH/`` (a folder, listed).

A hint only: no list (a first run), a damaged list, a file gone, anything that fails is
skipped quietly; the imports then read what they need themselves. Torch-free.
``MOETOOL_CODE_LIST``: the list's path, or ``off`` (neither read nor recorded).
"""
from __future__ import annotations

import _imp
import hashlib
import importlib.util
import os
import re
import stat
import subprocess
import sys
import threading
import types
from pathlib import Path

from moetool.read.prefetch import CacheFiller, available_memory, torch_free_child

ENV = "MOETOOL_CODE_LIST"
#: entries a list keeps at most (a run of verify --whole-model imports ~5000 files)
MAX_FILES = 20000
#: threads reading shared libraries (largest first); one more reads Python modules in import order
LIBRARY_THREADS = 3
#: a process-mapped file is code if its name says so (checkpoints are mapped too, never listed)
_SHARED_OBJECT = re.compile(r"\.so(\.[0-9.]+)?$")
_MODULE_SUFFIXES = (".py", ".pyc", ".so", ".pyd")
#: a pagemap entry's high byte with bit 63 set: the page is present
_PRESENT = re.compile(rb"[\x80-\xff]+")
#: touched ranges closer than this are read as one (fewer, larger reads)
RANGE_GAP = 256 << 10

#: files and package metadata read through Python, larger than this, are data, not code
MAX_OPENED_BYTES = 64 << 20
#: the names of moetool's reader threads, whose opens are not the run's
_READER_THREADS = ("moetool-warm", "moetool-read", "moetool-prefetch")
#: what an opened file is never: a checkpoint's or a conversion's data
_DATA_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npy", ".npz", ".tmp", ".part")

_warming: ChildWarming | None = None
_lock = threading.Lock()
#: what this process opened for reading (files) and listed (folders, with a trailing "/")
#: through Python since :func:`watch`, in order
_opened: dict[str, None] = {}
#: set on a thread while it makes the record (its reads of bytecode headers are not the run's)
_recording = threading.local()
_watching = False


def watch() -> None:
    """From now on, note what this process opens for reading and lists through Python (an
    audit hook: its imports' files and folders, the package metadata transformers reads,
    configs): beside the shared libraries it maps, that is what a cold start waits on the disk
    for. Forked processes inherit it. Once per process; not while the list is off."""
    global _watching
    if _watching or list_path() is None:
        return
    _watching = True

    def hook(event: str, args: tuple) -> None:
        try:
            if threading.current_thread().name.startswith(_READER_THREADS) or getattr(_recording, "on", False):
                return  # moetool's own reads (this warm-up, read-aheads, the record): not what the run needs
            if event == "open":
                path, flags = args[0], args[2]
                if isinstance(flags, int) and flags & os.O_ACCMODE != os.O_RDONLY:
                    return
                suffix = ""
            elif event in ("os.listdir", "os.scandir"):
                path, suffix = args[0], "/"
            else:
                return
            if isinstance(path, (str, bytes, os.PathLike)):
                name = os.path.abspath(os.fsdecode(path))
                if not name.startswith(("/proc/", "/sys/", "/dev/")):
                    _opened[name + suffix] = None
        except Exception:  # noqa: BLE001 - an audit hook that raises breaks the call it watches
            pass

    sys.addaudithook(hook)


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


def read_list(path: Path) -> dict[str, list[tuple[int, int]] | None]:
    """The files a list names (absolute paths, in its order) -> their byte ranges (offset,
    length), or None for the whole file; {} for a list missing or unreadable. Damaged lines
    are skipped."""
    try:
        text = path.read_text(encoding="utf-8", errors="strict")
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    files: dict[str, list[tuple[int, int]] | None] = {}
    for line in text.splitlines()[:MAX_FILES]:
        name, _, spans = line.partition("\t")
        if not name.startswith("/"):
            continue
        try:
            ranges = [tuple(int(v) for v in span.split("+")) for span in spans.split(",")] if spans else None
        except ValueError:
            continue
        if ranges is not None and (name.endswith("/") or any(len(r) != 2 or r[0] < 0 or r[1] <= 0 for r in ranges)):
            continue
        files[name] = ranges  # type: ignore[assignment]
    return files


def merge_ranges(ranges: list[tuple[int, int]], gap: int = RANGE_GAP) -> list[tuple[int, int]]:
    """(offset, length) ranges, sorted and joined where fewer than ``gap`` bytes lie between."""
    out: list[list[int]] = []
    for lo, n in sorted(ranges):
        if out and lo <= out[-1][0] + out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], lo + n - out[-1][0])
        else:
            out.append([lo, n])
    return [(lo, n) for lo, n in out]


def touched_ranges() -> dict[str, list[tuple[int, int]] | None]:
    """Each shared library this process maps -> the byte ranges of it the process has touched:
    pages present in its page tables (/proc/self/pagemap, bit 63; readable by the process
    itself, Linux). The kernel maps up to 64 KiB of cached pages around each fault, so this
    is what was touched and a little around it. None (the whole file) where pagemap says
    nothing: it cannot be read, or no page is present. {} where the maps cannot be read."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    mappings = []  # (library, first address, end address, file offset)
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                name = fields[5].rstrip("\n") if len(fields) == 6 else ""
                if name.startswith("/") and _SHARED_OBJECT.search(name):
                    lo, hi = (int(v, 16) for v in fields[0].split("-"))
                    mappings.append((name, lo, hi, int(fields[2], 16)))
    except (OSError, ValueError):
        return {}
    spans: dict[str, list[tuple[int, int]]] = {name: [] for name, *_ in mappings}
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            for name, lo, hi, offset in mappings:
                pagemap.seek(lo // page * 8)
                flags = pagemap.read((hi - lo) // page * 8)[7::8]  # each little-endian entry's high byte
                spans[name] += [(offset + run.start() * page, (run.end() - run.start()) * page)
                                for run in _PRESENT.finditer(flags)]
    except OSError:
        return dict.fromkeys(spans)
    return {name: merge_ranges(r) if r else None for name, r in spans.items()}


def current_files() -> dict[str, list[tuple[int, int]] | None]:
    """What this process runs: the shared libraries it maps with the ranges it touched (the
    whole file where pagemap says nothing), then the files its imports read, in import order,
    whole (:func:`import_reads`)."""
    files = touched_ranges()
    _recording.on = True
    try:
        _add_import_reads(files)
    finally:
        _recording.on = False
    for name in list(_opened):
        if name.endswith("/") or (not name.endswith(_DATA_SUFFIXES) and _small_file(name)):
            files.setdefault(name, None)
    return files


def _add_import_reads(files: dict) -> None:
    """Into ``files``, what the imports of this process's modules read, but for those imported
    since :func:`watch` (its audit hook noted their opens)."""
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):
            continue
        # from the module's own namespace: a lazy module's __getattr__ (transformers',
        # scipy's) imports what it is asked for, 2.4-6.8 s of a rank's end on an H100 host
        file, cached = module.__dict__.get("__file__"), module.__dict__.get("__cached__")
        if isinstance(cached, str) and cached in _opened:
            # imported since watch() (every import of a source file tries its cache first):
            # what it opened is listed below, as it was opened. Not asked of __file__: a
            # warning or traceback line reads a source again, long after its import
            continue
        for name in import_reads(file, cached):
            files.setdefault(name, None)


def import_reads(file, cached) -> list[str]:
    """The files an import of a module (its ``__file__`` and ``__cached__``) read: its bytecode
    alone where that is valid for the source (the source is then only stat'ed: listing it too
    had the warm-up read 19 MB of sources for quantize's 1028 modules with bytecode, whose
    imports never read them); else the source, and the bytecode where it is checked against a
    hash of the source (both read). Absolute paths of existing files with a module's suffix."""
    names = [n for n in (file, cached) if isinstance(n, str) and n.endswith(_MODULE_SUFFIXES) and os.path.isabs(n)]
    if len(names) == 2 and names[0].endswith(".py") and names[1].endswith(".pyc") and _bytecode_is_valid(*names):
        return names[1:]
    return [n for n in names if os.path.isfile(n)]


def _bytecode_is_valid(source: str, cached: str) -> bool:
    """Whether the import system takes ``cached`` without reading ``source``: its header's magic
    number, then the source's mtime and size it records, as importlib checks them (False for a
    stale cache, one checked against a hash of the source, or a file missing)."""
    try:
        with open(cached, "rb") as f:
            header = f.read(16)
        st = os.stat(source)
    except OSError:
        return False
    if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(header[4:8], "little")
    if flags & ~0b11:  # reserved bits: importlib refuses the cache
        return False
    if flags & 0b1:  # hash-based: checked ones hash the source, unchecked ones as --check-hash-based-pycs says
        mode = _imp.check_hash_based_pycs
        return mode == "never" or (mode != "always" and not flags & 0b10)
    return (int.from_bytes(header[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(header[12:16], "little") == st.st_size & 0xFFFFFFFF)


def _small_file(name: str) -> bool:
    try:
        st = os.stat(name)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size <= MAX_OPENED_BYTES


def _exists(name: str) -> bool:
    """A listed file still there (a folder's entry, with its trailing "/", a folder)."""
    return os.path.isdir(name) if name.endswith("/") else os.path.isfile(name)


def record(path: Path | None = None) -> None:
    """Merge this process's files (:func:`current_files`) into the list: a file's ranges are
    the union of both (whole, if either says whole), files gone are dropped. Written whole
    under a temporary name, then renamed (another writer's list may replace it: the last one
    stays whole); not at all when it holds this process's files already. Quiet on any failure."""
    path = list_path() if path is None else path
    if path is None:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # one per writer
    try:
        merged = read_list(path)
        changed = False
        for name, ranges in current_files().items():
            old = merged.get(name, [])
            new = None if old is None or ranges is None else merge_ranges(old + ranges)
            if name not in merged or new != old:
                merged[name], changed = new, True
        if not changed:  # the usual case once a command has run: no stat of every entry, no write
            return
        lines = []
        for name, ranges in merged.items():
            if len(lines) < MAX_FILES and _exists(name):
                lines.append(name if ranges is None else name + "\t" + ",".join(f"{o}+{n}" for o, n in ranges))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        os.replace(tmp, path)
    except (OSError, ValueError):
        try:
            tmp.unlink()
        except OSError:
            pass


class Warming:
    """Reading a list's files (:func:`read_list`'s dict) into the page cache on daemon
    threads: the shared libraries' ranges, largest library first, on ``LIBRARY_THREADS``
    threads; the modules' files in the list's (import) order on one more. ``budget``: bytes
    read at most (a file that would pass it is left)."""

    def __init__(self, files: dict[str, list[tuple[int, int]] | None], budget: int):
        libraries, modules = [], []
        for name, ranges in files.items():
            if name.endswith("/"):
                modules.append((name, [], 0))
                continue
            try:
                st = os.stat(name)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):  # never a FIFO or a device: opening one could block
                continue
            spans = [(0, st.st_size)] if ranges is None else \
                [(o, min(n, st.st_size - o)) for o, n in ranges if o < st.st_size]
            item = (name, spans, sum(n for _, n in spans))
            (libraries if _SHARED_OBJECT.search(name) else modules).append(item)
        libraries.sort(key=lambda item: -item[2])
        #: bytes the list asks for, and how many were read into the cache so far
        self.total_bytes = sum(item[2] for item in libraries + modules)
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

    def _next_library(self) -> tuple[str, list[tuple[int, int]], int]:
        with self._count_lock:
            if not self._libraries:
                raise StopIteration
            return self._libraries.pop(0)

    def _read(self, take) -> None:
        try:
            filler = CacheFiller(exact=True)
        except OSError:
            return
        try:
            while True:
                try:
                    name, spans, size = take()
                except StopIteration:
                    return
                if name.endswith("/"):  # a folder the imports list: its entries read into the cache
                    try:
                        with os.scandir(name) as entries:
                            for _ in entries:
                                pass
                    except OSError:
                        pass
                    continue
                with self._count_lock:
                    if self._left < size:
                        continue
                    self._left -= size
                done = 0
                try:
                    filler.ask(Path(name), spans)
                    for offset, length in spans:
                        done += filler.fill(Path(name), offset, length)
                except OSError:
                    pass
                with self._count_lock:
                    self.bytes_read += done
        finally:
            filler.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Until every file is read (or ``timeout`` seconds); True once done."""
        for t in self._threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self._threads)


class ChildWarming:
    """:class:`Warming` run by a :func:`moetool.read.prefetch.torch_free_child`: its threads then hold no GIL of this process, whose imports hold
    it most of the time (a Python thread reading 10,000 small files here waited for the GIL
    after every call, and read at 0.2-0.3 GB/s). Its own session: a Ctrl-C at the terminal
    leaves it to end its reads; its output goes nowhere."""

    def __init__(self, path: Path, budget: int):
        # niced: on a small machine with the files already in memory its CPU would only slow the command
        code = ("import os; os.nice(10); from moetool.read import code_files; "
                "code_files.Warming(code_files.read_list(code_files.Path(sys.argv[1])), int(sys.argv[2])).wait()")
        self._proc = torch_free_child(code, str(path), str(budget), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The child's exit status once it has ended (0: every file read or skipped quietly)."""
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the child has read every file (or ``timeout`` seconds); True once done."""
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


def warm() -> ChildWarming | None:
    """Start reading this interpreter's list into the page cache, in a child process (once per
    process: a second call returns the first's); None where there is no list, it is off or
    holds nothing, or the child cannot start."""
    global _warming
    with _lock:
        if _warming is None:
            path = list_path()
            files = read_list(path) if path is not None else {}
            if files and getattr(os, "sendfile", None) is not None and not looks_cached(files):
                try:
                    _warming = ChildWarming(path, int(available_memory() * 0.25))
                except OSError:
                    pass
        return _warming


def looks_cached(files: dict[str, list[tuple[int, int]] | None], samples: int = 4) -> bool:
    """Whether the list's code is in memory already (a warm machine: a second child process
    would only cost CPU, 2-4 % of a small CPU quantize here): one page in the middle of the
    largest touched range of each of its ``samples`` largest libraries, read with RWF_NOWAIT
    (which fails rather than wait for the disk). False where that cannot be asked."""
    nowait = getattr(os, "RWF_NOWAIT", None)
    spans = sorted(((max(ranges, key=lambda r: r[1]), name) for name, ranges in files.items()
                    if ranges and _SHARED_OBJECT.search(name)), key=lambda item: -item[0][1])[:samples]
    if nowait is None or not spans:
        return False
    buf = bytearray(4096)
    for (offset, length), name in spans:
        try:
            fd = os.open(name, os.O_RDONLY)
        except OSError:
            return False
        try:
            if os.preadv(fd, [buf], (offset + length // 2) // 4096 * 4096, nowait) <= 0:
                return False
        except OSError:  # EAGAIN: not in memory; or no RWF_NOWAIT on this file system
            return False
        finally:
            os.close(fd)
    return True


def warming() -> ChildWarming | None:
    """The warm-up this process started, if any: its end is when bulk reads may begin."""
    return _warming
