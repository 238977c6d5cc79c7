"""Streaming file writers of the torch executor: bytes in, a durable file and its sha256 out.

``HashingSink`` writes on a background thread and hashes each slice right after it is written;
where the file system takes ``O_DIRECT`` it stages the bytes in page-aligned buffers written
straight to the disk by a second thread. ``pwrite_all`` and ``start_writeback`` serve the byte
executor too. Errors name the file being written (an OSError on a descriptor names none).
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import queue
import threading
from pathlib import Path

from moetool.read.safetensors import tensor_bytes

#: largest single write(): on this kernel (6.18, ext4) a write of 512 KiB or more from one
#: buffer ran 2-5x slower in the kernel's copy into the page cache than the same bytes in
#: 256 KiB writes (3.5 GB/s); tensors are written in slices of this size
WRITE_SLICE = 256 << 10


#: the writer asks the kernel to start writing back every this many bytes, so the disk works
#: while the data is produced and the final fsync waits only for the tail
WRITEBACK_STEP = 16 << 20
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages in the range; do not wait
try:
    _sync_file_range = ctypes.CDLL(None).sync_file_range  # libc's, as moetool.memory finds it
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
except (OSError, AttributeError):  # not Linux / glibc: the fsync at the end does it all
    _sync_file_range = None


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``: a hint, its result is ignored (the
    durability still comes from fsync)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


#: direct I/O (``O_DIRECT``) of the torch writer: the output is staged in page-aligned buffers
#: of this size, each written straight to the disk by a second thread, so no page-cache copy is
#: made and no kernel writeback follows (a quantize of the 1.38 GiB benchmark input writes
#: 0.78 GB: 0.51-0.55 CPU-s for copy + sha256 + writes against 0.60-0.63 buffered; 4 MiB
#: buffers: 0.56-0.57 s)
DIRECT_STAGE = 1 << 20
#: the staging buffers are ``WIDE_FACTOR`` times larger where the machine has ``WIDE_CORES`` or
#: more: an H100 host's disk took 1.30 GB/s in 1 MiB direct writes one at a time, 1.87 GB/s in
#: 4 MiB writes four at a time (one per file being written: ``torch_executor.files_at_once``)
WIDE_FACTOR, WIDE_CORES = 4, 8
#: staging buffers per file: one being filled, the rest queued for or being written
DIRECT_BUFFERS = 4
#: offset, length and address alignment of direct writes (the largest logical block size
#: Linux block devices use)
DIRECT_ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)
_memmove = ctypes.memmove  # a ctypes foreign function: releases the GIL while it copies


def direct_stage() -> int:
    """The size of the direct writer's staging buffers on this machine."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return DIRECT_STAGE * WIDE_FACTOR if cores >= WIDE_CORES else DIRECT_STAGE


def open_direct(path: Path) -> int | None:
    """``path`` created for writing with ``O_DIRECT``; None where the system or file system
    refuses it (no O_DIRECT, tmpfs on older kernels, some network file systems)."""
    if not O_DIRECT:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | O_DIRECT, 0o644)
    except OSError:
        return None


def _buffer_address(view: memoryview) -> int | None:
    """Address of a writable contiguous buffer (a tensor's bytes); None for read-only ones."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


class HashingSink:
    """File writer that hashes what it writes, on a background thread (write and sha256 both
    release the GIL), so the producer's compute overlaps them. Each 256 KiB slice is hashed
    right after it is written, while it is still in the cache: one thread for both used 0.1
    CPU-s less per quantize of the 1.38 GiB benchmark input than a writing and a hashing thread
    each reading the whole tensor (1.35 s against 1.42 s, median of six runs).

    Where the file system takes ``O_DIRECT`` (``direct``, the default), the slices are copied
    into page-aligned staging buffers instead and hashed there, and a second thread writes each
    full buffer to the disk; the last partial block goes through the page cache (O_DIRECT
    switched off for it). Where it does not, or a direct write is refused, the plain writes
    below are used."""

    def __init__(self, path: Path, depth: int = 3, direct: bool = True):
        self.path = path
        self.hash = hashlib.sha256()
        self.error: BaseException | None = None
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.written = self.flushed = 0
        fd = open_direct(path) if direct else None
        self.direct = fd is not None  # staging buffers and an I/O thread
        self.o_direct = self.direct  # the file still has O_DIRECT (a refused write clears it)
        self.file = open(path, "wb") if fd is None else open(fd, "wb", buffering=0, closefd=True)
        if self.direct:
            self.stage = direct_stage()
            self._free: queue.Queue = queue.Queue()
            for _ in range(DIRECT_BUFFERS):
                self._free.put(mmap.mmap(-1, self.stage))  # page-aligned, zero-filled on demand
            self._io: queue.Queue = queue.Queue()
            self._stage = self._stage_view = None
            self._pos = self._offset = 0
            self.io_thread = threading.Thread(target=self._run_io, daemon=True)
            self.io_thread.start()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _write(self, data) -> None:
        view = memoryview(data)
        if self.direct:
            self._stage_bytes(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
            return
        for start in range(0, view.nbytes, WRITE_SLICE):
            piece = view[start:start + WRITE_SLICE]
            self.file.write(piece)
            self.hash.update(piece)
        self.written += view.nbytes
        if self.written - self.flushed >= WRITEBACK_STEP:
            self.file.flush()
            start_writeback(self.file.fileno(), self.flushed, self.written - self.flushed)
            self.flushed = self.written

    # -- direct I/O ---------------------------------------------------------------------
    def _stage_bytes(self, view: memoryview) -> None:
        """Copy ``view`` into the staging buffers a slice at a time, hashing each slice from
        the buffer right after the copy; full buffers go to the I/O thread."""
        n = view.nbytes
        src = _buffer_address(view) if n else None
        done = 0
        while done < n:
            if self._stage is None:
                self._stage = self._free.get()
                self._stage_view = memoryview(self._stage)
                self._stage_addr = _buffer_address(self._stage_view)
            k = min(n - done, self.stage - self._pos, WRITE_SLICE)
            if src is not None:
                _memmove(self._stage_addr + self._pos, src + done, k)
            else:  # read-only bytes (the header): a copy under the GIL, small
                self._stage_view[self._pos:self._pos + k] = view[done:done + k]
            self.hash.update(self._stage_view[self._pos:self._pos + k])
            self._pos += k
            done += k
            if self._pos == self.stage:
                self._submit()
        self.written += n

    def _submit(self) -> None:
        """The buffer being filled (``_pos`` bytes) to the I/O thread, to be written at
        ``_offset``: every buffer but the file's last is full, so offsets stay aligned."""
        self._io.put((self._stage, self._offset, self._pos))
        self._offset += self._pos
        self._stage, self._stage_view, self._pos = None, None, 0

    def _run_io(self) -> None:
        while True:
            item = self._io.get()
            if item is None:
                return
            buf, offset, length = item
            try:
                if self.error is None:
                    self._pwrite_staged(memoryview(buf)[:length], offset)
            except BaseException as e:  # surfaced by write() / close()
                self.error = e
            finally:
                self._free.put(buf)

    def _pwrite_staged(self, view: memoryview, offset: int) -> None:
        """Whole aligned blocks directly; a partial last block through the page cache (O_DIRECT
        switched off for it). A direct write the file refuses (EINVAL: an alignment it does
        not take) switches the file to plain writes for good, the same bytes written again."""
        fd = self.file.fileno()
        head = view.nbytes - view.nbytes % DIRECT_ALIGN if self.o_direct else 0
        if head:
            try:
                pwrite_all(fd, view[:head], offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                head = 0
        if head < view.nbytes:
            self._direct_off(fd)
            pwrite_all(fd, view[head:], offset + head)

    def _direct_off(self, fd: int) -> None:
        if self.o_direct:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
            self.o_direct = False

    # -- threads ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                break
            if self.error is not None:
                continue
            try:
                self._write(item)
            except BaseException as e:  # surfaced by close()
                self.error = e
        if self.direct:
            if self._pos:
                self._submit()
            self._io.put(None)

    def write(self, item) -> None:
        if self.error is not None:
            raise naming_file(self.error, self.path)
        self.queue.put(item if isinstance(item, (bytes, memoryview)) else tensor_bytes(item))

    def close(self, ok: bool) -> str:
        self.queue.put(None)
        self.thread.join()
        if self.direct:
            self.io_thread.join()
        try:
            if ok and self.error is None:
                self.file.flush()
                os.fsync(self.file.fileno())
        except OSError as e:
            raise naming_file(e, self.path)
        finally:
            self.file.close()
        if self.error is not None:
            raise naming_file(self.error, self.path)
        return self.hash.hexdigest()


def naming_file(err: BaseException, path: Path) -> BaseException:
    """``err``, naming ``path`` when it is an OSError that names no file (a write or fsync
    on a descriptor: ENOSPC, EIO, EFBIG), so the one-line error says which file failed."""
    if isinstance(err, OSError) and err.filename is None:
        err.filename = str(path)
    return err


def pwrite_all(fd: int, view: memoryview, offset: int, path: Path | None = None) -> None:
    """All of ``view`` at byte ``offset`` of ``fd`` (a write that makes no progress is an
    error); a failure names ``path``, the file ``fd`` writes."""
    done = 0
    try:
        while done < view.nbytes:
            n = os.pwrite(fd, view[done:], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, "write returned 0")
            done += n
    except OSError as e:
        raise naming_file(e, path) if path is not None else e
