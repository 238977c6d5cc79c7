"""Read parts of a checkpoint into the page cache, on a thread or in a child process, while
this process does something else (imports torch: 4-5 s on a GPU host, time the disk would
otherwise idle), so the reads that follow find the bytes in memory.

The bytes go from the file to /dev/null inside the kernel (``sendfile``, 64 MiB a call, the
GIL released meanwhile): no process memory fills, and cached bytes are swept at ~30 GB/s.
(Linux caps ``POSIX_FADV_WILLNEED`` at the device's readahead window: 8 MiB of a whole file
on the H100 hosts, so asking is not enough.) A hint only: any failure ends it quietly, and
the reads that follow read what it did not. Torch-free.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from moetool.read.code_files import ChildWarming


#: share of the memory available (MemAvailable) a folder's prefetch may fill
PREFETCH_SHARE = 0.5
#: bytes per call: one GIL hand-over per call while another thread imports torch
PREFETCH_STEP = 64 << 20
#: prctl option: the signal a process gets when the thread that started it ends
_PR_SET_PDEATHSIG = 1
#: folders already being read ahead by this process (a second ask for one is answered by the first)
_started: dict[Path, object] = {}
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


#: ``ioprio_set`` syscall numbers (Linux) by machine
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
_IOPRIO_WHO_PROCESS, _IOPRIO_CLASS_IDLE, _IOPRIO_CLASS_SHIFT = 1, 3, 13


def idle_io_priority() -> bool:
    """This thread's reads and writes to the idle I/O class (Linux ``ioprio_set``): the disk
    serves them only when no other request waits (schedulers with priorities: mq-deadline,
    bfq). True if set."""
    number = _IOPRIO_SET.get(os.uname().machine) if hasattr(os, "uname") else None
    if number is None:
        return False
    try:
        return ctypes.CDLL(None).syscall(number, _IOPRIO_WHO_PROCESS, 0,
                                         _IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT) == 0
    except (OSError, AttributeError):
        return False


#: bytes per ``POSIX_FADV_WILLNEED`` of :meth:`CacheFiller.ask`: Linux reads at most the
#: device's read-ahead window per call (128 KiB by default), so larger asks would be cut short
ASK_STEP = 128 << 10


class CacheFiller:
    """Reads byte ranges of files into the page cache: ``sendfile`` to /dev/null,
    ``PREFETCH_STEP`` a call (the GIL released meanwhile), one descriptor per file kept open
    until ``close`` (and with it the kernel's sequential read-ahead state).

    ``exact``: the ranges are scattered (the pages a library's code touched), so the kernel's
    read-ahead is switched off for these descriptors (``POSIX_FADV_RANDOM``): with it, each
    range read sequentially grew its window up to the device's (8 MiB on the H100 hosts) past
    the range's end. :meth:`ask` then queues a file's ranges at once."""

    #: descriptors kept open at most (all are closed when one more is needed)
    MAX_OPEN = 256

    def __init__(self, exact: bool = False):
        """OSError where there is no ``sendfile`` (a hint then: nothing is read ahead)."""
        if getattr(os, "sendfile", None) is None:
            raise OSError(errno.ENOSYS, "no sendfile here")
        self._null = os.open(os.devnull, os.O_WRONLY)
        self._fds: dict[Path, int] = {}
        self.exact = exact and hasattr(os, "posix_fadvise")

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            if len(self._fds) >= self.MAX_OPEN:
                self._close_files()
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
            if self.exact:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd

    def ask(self, path: Path, ranges: Iterable[tuple[int, int]]) -> None:
        """Queue reads of ``ranges`` (offset, length) of ``path`` without waiting for them
        (``POSIX_FADV_WILLNEED``): the disk gets them all at once, then :meth:`fill` waits
        for each and reads what the asks did not. OSError where the file cannot be opened."""
        if not hasattr(os, "posix_fadvise"):
            return
        fd = self._fd(path)
        for offset, length in ranges:
            for start in range(offset, offset + length, ASK_STEP):
                os.posix_fadvise(fd, start, min(ASK_STEP, offset + length - start), os.POSIX_FADV_WILLNEED)

    def fill(self, path: Path, offset: int, length: int, stop: threading.Event | None = None) -> int:
        """Bytes read into the cache from ``offset`` (fewer at the end of the file or once
        ``stop`` is set). OSError where the file cannot be read."""
        fd = self._fd(path)
        done = 0
        while done < length and not (stop is not None and stop.is_set()):
            n = os.sendfile(self._null, fd, offset + done, min(PREFETCH_STEP, length - done))
            if n <= 0:
                break
            done += n
        return done

    def _close_files(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def close(self) -> None:
        self._close_files()
        os.close(self._null)


def fill_ranges(ranges: Iterable[tuple[Path, int, int]], budget: int, stop: threading.Event | None = None) -> None:
    """Read each (file, offset, length) in order into the page cache until ``budget`` bytes are
    read (or ``stop`` is set); a file that cannot be read is skipped."""
    left = budget
    try:
        filler = CacheFiller()
    except OSError:
        return
    try:
        for path, offset, length in ranges:
            if left <= 0 or (stop is not None and stop.is_set()):
                return
            try:
                left -= filler.fill(Path(path), offset, min(length, left), stop)
            except OSError:
                continue
    finally:
        filler.close()


def read_ahead_ranges(ranges: Iterable[tuple[Path, int, int]], budget: int,
                      stop: threading.Event | None = None, idle: bool = False,
                      after: Callable[[], object] | None = None) -> threading.Thread | None:
    """On a daemon thread, read each (file, offset, length) in order into the page cache until
    ``budget`` bytes are read (or ``stop`` is set); ``idle``: at the idle I/O priority;
    ``after``: called first (what the reads wait for). Returns the thread, or None where there
    is no ``sendfile``."""
    if getattr(os, "sendfile", None) is None:
        return None
    ranges = list(ranges)

    def run() -> None:
        if after is not None:
            after()
        if idle:
            idle_io_priority()
        fill_ranges(ranges, budget, stop)

    thread = threading.Thread(target=run, name="moetool-prefetch", daemon=True)
    thread.start()
    return thread


def torch_free_child(code: str, *args: str, **popen) -> subprocess.Popen:
    """A child interpreter running ``code`` (``python -I -S``: no site packages, no ``PYTHON*``
    variables, so nothing heavy is imported), with the folder that holds this moetool first on
    its ``sys.path``; ``args`` are its ``sys.argv[1:]``, ``popen`` goes to ``subprocess.Popen``.
    OSError where it cannot start."""
    root = str(Path(__file__).resolve().parents[2])
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); " + code,
                             root, *args], close_fds=True, **popen)


class ChildReadAhead:
    """:func:`fill_ranges` in a :func:`torch_free_child`, so that its reads never wait for this
    process's GIL. On a thread
    here each ``sendfile`` had to take the GIL back from ``import torch``, which held it for up
    to 0.3-0.4 s at a time on this project's 2-core machine (loading a library, compiling a
    module where no bytecode is kept).
    The child dies with the thread that started it (``PR_SET_PDEATHSIG``, Linux only: a Ctrl-C'd
    or finished command leaves no read-ahead behind), and first waits for ``after_pid`` to end
    (the code warm-up's child, through its ``pidfd``: this process has not reaped it, so the pid
    is still that child's). Like the thread it replaces: ``join``, ``is_alive``."""

    def __init__(self, ranges: list[tuple[Path, int, int]], budget: int, idle: bool, after_pid: int | None):
        """OSError where the child cannot be started, or ``after_pid`` cannot be waited for here
        (no ``pidfd_open``: Linux 5.3 and later)."""
        after_fd = os.pidfd_open(after_pid) if after_pid is not None else None  # AttributeError: not Linux
        spec = {"parent": os.getpid(), "after_fd": after_fd, "idle": idle, "budget": budget,
                "ranges": [(str(f), o, n) for f, o, n in ranges]}
        try:
            self._proc = torch_free_child("from moetool.read import prefetch; prefetch._child_main()",
                                          stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          pass_fds=() if after_fd is None else (after_fd,))
        finally:
            if after_fd is not None:
                os.close(after_fd)
        try:
            with self._proc.stdin:
                self._proc.stdin.write(json.dumps(spec).encode())
        except OSError:  # the child ended at once (a broken interpreter): no reader left behind
            self._proc.kill()
            self._proc.wait()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def join(self, timeout: float | None = None) -> None:
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def is_alive(self) -> bool:
        return self._proc.poll() is None


def end_with_parent() -> None:
    """Linux: this process gets SIGKILL when the thread that started it ends
    (``PR_SET_PDEATHSIG``); elsewhere nothing. For torch-free helper children."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        pass


def _child_main() -> None:
    """:class:`ChildReadAhead`'s child: its spec (JSON) on stdin."""
    spec = json.loads(sys.stdin.buffer.read())
    end_with_parent()
    if os.getppid() != spec["parent"]:  # the parent ended before the death signal was set
        return
    if spec["after_fd"] is not None:
        ended = select.poll()  # (select() refuses descriptors past 1023)
        ended.register(spec["after_fd"], select.POLLIN)
        ended.poll()  # readable once that process has ended
    if spec["idle"]:
        idle_io_priority()
    fill_ranges([(Path(f), o, n) for f, o, n in spec["ranges"]], spec["budget"])


def prefetch(root: Path, idle: bool = False, after: ChildWarming | None = None, in_child: bool = False):
    """The ``*.safetensors`` files of the folder ``root`` into the page cache, in name order
    (the order conversions read them), up to ``PREFETCH_SHARE`` of the memory available: a
    command that imports torch before its first read (quantize) then finds its input in
    memory, and a byte copy's small reads stop waiting on the disk one after another. A folder
    already asked for in this process is not read again (the first ask's reader is returned:
    quantize's command and then its library both ask, and read a cold input twice over).

    ``idle``: read at the idle I/O priority, behind every other read and write of the machine:
    quantize asks so while torch imports, whose page faults then go first (a cold ``import
    torch`` took 6.9 s alone on an H100 host and 9-14 s beside the read-ahead of its input),
    and the conversion's own reads and writes go before the read-ahead after it. ``after``:
    what the reads wait for (the code warm-up's child, :mod:`moetool.read.code_files`: its
    ``wait()`` and ``pid``). ``in_child``: read in a :class:`ChildReadAhead` (Linux; for a
    command about to import torch; ask from the main thread: the child ends with the thread that
    asked), else on a thread, as where the child cannot start. Returns the reader (a thread or
    a :class:`ChildReadAhead`: ``join``, ``is_alive``), or None where there is nothing to read."""
    if not Path(root).is_dir():
        return None
    key = Path(root).resolve()
    with _lock:
        if key not in _started:
            try:
                ranges = [(f, 0, f.stat().st_size) for f in sorted(key.glob("*.safetensors"))]
            except OSError:
                ranges = []
            budget = int(available_memory() * PREFETCH_SHARE)
            reader = None
            if ranges and in_child and sys.platform.startswith("linux"):  # a death signal, a pidfd
                try:
                    # ended and reaped, or still the child we started: only we reap it (quantize
                    # has no other thread waiting on the warm-up), so its pid is not reused meanwhile
                    ended = after is None or after.wait(0)
                    reader = ChildReadAhead(ranges, budget, idle, None if ended else after.pid)
                except (OSError, AttributeError, ValueError):  # no pidfd_open, a pid gone, no child
                    reader = None
            if reader is None and ranges:
                reader = read_ahead_ranges(ranges, budget, idle=idle, after=None if after is None else after.wait)
            _started[key] = reader
        return _started[key]
