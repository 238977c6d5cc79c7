"""Atomic, resumable output folders and a streaming safetensors writer.

Every data file is written to ``<name>.incomplete``, fsync'd and renamed. A journal
(``.moetool-journal.json``) records each finished file with its sha256, so a re-run of the
same plan skips files whose bytes still match. The index, config.json and ``manifest.json``
(sha256 + size of every file) are written last: an output folder without a manifest is
visibly unfinished. The input folder is never written.

One run at a time: the folder is locked (``flock`` on ``.moetool.lock``, holding the writer's
pid) from the first check to the manifest. A run writes only into an empty folder, into our own
unfinished output of the same plan (a resume: its journal names the plan), or with ``force``;
a folder holding anything else is refused, naming a file found there.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import queue
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from moetool.read.checkpoint import writable_bytes
from moetool.errors import MoetoolError

if TYPE_CHECKING:  # this module loads without torch: byte-copy shard / repack use OutputDir too
    import torch

MANIFEST_NAME = "manifest.json"
JOURNAL_NAME = ".moetool-journal.json"
LOCK_NAME = ".moetool.lock"
INCOMPLETE = ".incomplete"
#: the metadata every safetensors file of a conversion carries in its header
SAFETENSORS_METADATA = {"format": "pt"}
HASH_BLOCK = 8 << 20
#: largest single write(): on this kernel (6.18, ext4) a write of 512 KiB or more from one
#: buffer ran 2-5x slower in the kernel's copy into the page cache than the same bytes in
#: 256 KiB writes (3.5 GB/s); tensors are written in slices of this size
WRITE_SLICE = 256 << 10


@dataclass(frozen=True)
class TensorSpec:
    """An output tensor known before any data is computed."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def dtype_name(self) -> str:
        from moetool.read.checkpoint import DTYPE_NAMES

        return DTYPE_NAMES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a CPU tensor (made contiguous first if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return writable_bytes(t.contiguous())


def safetensors_header(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length + JSON header (padded with spaces to 8 bytes) for tensors in order.
    ``specs``: anything with ``name``, ``dtype_name`` (safetensors), ``shape`` and ``nbytes``."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype_name, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(HASH_BLOCK)
            if not block:
                return h.hexdigest()
            h.update(block)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
#: 0.78 GB: 0.51-0.55 CPU-s for copy + sha256 + writes against 0.60-0.63 buffered)
DIRECT_STAGE = 1 << 20
#: staging buffers per file: one being filled, the rest queued for or being written
DIRECT_BUFFERS = 4
#: offset, length and address alignment of direct writes (the largest logical block size
#: Linux block devices use)
DIRECT_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_memmove = ctypes.memmove  # a ctypes foreign function: releases the GIL while it copies


def _open_direct(path: Path) -> int | None:
    """``path`` created for writing with ``O_DIRECT``; None where the system or file system
    refuses it (no O_DIRECT, tmpfs on older kernels, some network file systems)."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_DIRECT, 0o644)
    except OSError:
        return None


def _buffer_address(view: memoryview) -> int | None:
    """Address of a writable contiguous buffer (a tensor's bytes); None for read-only ones."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


class _HashingSink:
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
        fd = _open_direct(path) if direct else None
        self.direct = fd is not None  # staging buffers and an I/O thread
        self.o_direct = self.direct  # the file still has O_DIRECT (a refused write clears it)
        self.file = open(path, "wb") if fd is None else open(fd, "wb", buffering=0, closefd=True)
        if self.direct:
            import mmap

            self._free: queue.Queue = queue.Queue()
            for _ in range(DIRECT_BUFFERS):
                self._free.put(mmap.mmap(-1, DIRECT_STAGE))  # page-aligned, zero-filled on demand
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
            k = min(n - done, DIRECT_STAGE - self._pos, WRITE_SLICE)
            if src is not None:
                _memmove(self._stage_addr + self._pos, src + done, k)
            else:  # read-only bytes (the header): a copy under the GIL, small
                self._stage_view[self._pos:self._pos + k] = view[done:done + k]
            self.hash.update(self._stage_view[self._pos:self._pos + k])
            self._pos += k
            done += k
            if self._pos == DIRECT_STAGE:
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
            import fcntl

            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
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


@dataclass
class FileRecord:
    sha256: str
    size: int


class OutputDir:
    """One output folder of a conversion.

    ``plan_id`` identifies the plan (input checksum-free fingerprint: input file sizes and
    mtimes + options); a journal from another plan is discarded on resume.
    """

    def __init__(self, root: Path, *, inputs: Iterable[Path] = (), force: bool = False, plan_id: str = ""):
        self.root = Path(root)
        self.plan_id = plan_id
        self._lock = threading.Lock()  # files may be finished on several threads (byte copy)
        self.records: dict[str, FileRecord] = {}
        self.skipped: list[str] = []
        for inp in inputs:
            _refuse_nesting(self.root, Path(inp))
        if self.root.exists() and not self.root.is_dir():
            raise MoetoolError(f"{self.root}: exists and is not a folder; choose an output folder")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MoetoolError(f"{self.root}: cannot create the output folder ({e.strerror})") from None
        self._folder_lock: FolderLock | None = FolderLock(self.root)
        try:
            self._claim(force)
            self._folder_lock.write_owner()
        except BaseException:
            if self._folder_lock.created:  # a refused folder is left as it was found
                self._folder_lock.remove_file()
            self.close()
            raise

    def _claim(self, force: bool) -> None:
        """With the lock held: refuse a folder that is not ours to write (unless ``force``),
        clear what an earlier output of ours left there, and start or resume the journal."""
        manifest = self.root / MANIFEST_NAME
        if manifest.exists():
            if not force:
                raise MoetoolError(f"{self.root}: already holds a complete output ({MANIFEST_NAME}); use --force to overwrite")
            self._remove_listed(manifest, "files")  # the old output's files: none may linger beside the new
            manifest.unlink()
        journal = self.root / JOURNAL_NAME
        if force:
            self._remove_listed(journal, "files")
            journal.unlink(missing_ok=True)
        else:
            self._refuse_foreign()
        self._journal = self._load_journal()
        if not journal.exists():
            self._save_journal()  # marks the folder as this plan's unfinished output from the start

    def _refuse_foreign(self) -> None:
        """Raise unless the folder is empty or holds our unfinished output of this same plan."""
        journal = self.root / JOURNAL_NAME
        if journal.exists():
            if _journal_plan(journal) == self.plan_id:
                return
            raise MoetoolError(f"{self.root}: holds the unfinished output of another moetool run (other input or "
                               f"options, see {JOURNAL_NAME}); re-run that command to finish it, or use --force "
                               f"to replace it")
        found = sorted(p.name for p in self.root.iterdir() if p.name != LOCK_NAME)
        if found:
            raise MoetoolError(f"{self.root}: is not empty and holds no unfinished moetool output (found {found[0]}"
                               f"{f' and {len(found) - 1} more' if len(found) > 1 else ''}); choose an empty "
                               f"folder, or use --force to write into it")

    def close(self) -> None:
        """Release the folder (idempotent). :meth:`finish` does it once the manifest is
        written; an executor that stops early calls it, leaving the folder unfinished."""
        if self._folder_lock is not None:
            self._folder_lock.release()
            self._folder_lock = None

    def __enter__(self) -> OutputDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _remove_listed(self, listing: Path, key: str) -> None:
        """Delete the files a previous manifest or journal of this folder lists (files moetool
        wrote), so that a new plan with other file names leaves no stale shard behind;
        then folders left empty (EP rank folders of another --ep)."""
        try:
            names = list(json.loads(listing.read_text()).get(key, {}))
        except (OSError, ValueError, AttributeError):
            return
        for name in names:
            rel = Path(str(name))
            if rel.is_absolute() or ".." in rel.parts:
                continue
            path = self.root / rel
            if path.is_file():
                path.unlink()
            parent = path.parent
            while parent != self.root and parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
                parent = parent.parent

    # -- journal ------------------------------------------------------------------------
    def _load_journal(self) -> dict[str, dict]:
        path = self.root / JOURNAL_NAME
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}
        if not isinstance(data, dict) or data.get("plan_id") != self.plan_id:
            return {}
        files = data.get("files", {})
        return dict(files) if isinstance(files, dict) else {}

    def _save_journal(self) -> None:
        self._write_atomic(JOURNAL_NAME, json.dumps({"plan_id": self.plan_id, "files": self._journal}, indent=1).encode())

    def already_done(self, name: str, size: int | None = None, same_as: str | None = None) -> bool:
        """True (and recorded) when a previous run finished ``name`` and its bytes still match
        (and it has the ``size`` the plan expects, where given). A ``same_as`` file that is
        still the same file as its finished twin (a hard link) takes the twin's record
        without being hashed again."""
        rec = self._journal.get(name)
        path = self.root / name
        if rec is None or not path.is_file() or path.stat().st_size != rec["size"]:
            return False
        if size is not None and rec["size"] != size:
            return False
        twin = self.records.get(same_as) if same_as else None
        linked = twin is not None and twin.sha256 == rec["sha256"] and os.path.samefile(path, self.root / same_as)
        if not linked and sha256_file(path) != rec["sha256"]:
            return False
        with self._lock:
            self.records[name] = FileRecord(rec["sha256"], rec["size"])
            self.skipped.append(name)
        return True

    def incomplete_path(self, name: str) -> Path:
        """Where ``name`` is written until it is complete (its folder created). A leftover of
        an earlier run there is removed, never written through: it may be a hard link to a
        finished file."""
        final = self.root / name
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(final.name + INCOMPLETE)
        tmp.unlink(missing_ok=True)
        return tmp

    def commit(self, name: str, sha256: str) -> FileRecord:
        """``name`` is complete at :meth:`incomplete_path` (written and fsync'd; ``sha256`` of
        its bytes): rename it to its final name and record it in the journal."""
        final = self.root / name
        _rename_over(final.with_name(final.name + INCOMPLETE), final)
        _fsync_dir(final.parent)
        record = FileRecord(sha256, final.stat().st_size)
        with self._lock:
            self.records[name] = record
            self._journal[name] = {"sha256": record.sha256, "size": record.size}
            self._save_journal()
        return record

    # -- writing ------------------------------------------------------------------------
    def _write_atomic(self, name: str, data: bytes) -> FileRecord:
        final, tmp = self.root / name, self.incomplete_path(name)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _rename_over(tmp, final)
        _fsync_dir(final.parent)
        return FileRecord(hashlib.sha256(data).hexdigest(), len(data))

    def write_json(self, name: str, obj, *, record: bool = True) -> None:
        data = (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()
        rec = self._write_atomic(name, data)
        if record:
            self.records[name] = rec

    def copy_file(self, src: Path, name: str) -> None:
        final, tmp = self.root / name, self.incomplete_path(name)
        _copy_durably(src, tmp)
        _rename_over(tmp, final)
        self.records[name] = FileRecord(sha256_file(final), final.stat().st_size)

    def same_file(self, name: str, target: str, *, link: bool = True) -> FileRecord:
        """Make ``name`` a file with the bytes of ``target``, a file of this output finished
        earlier (recorded): a hard link to it, or a copy where links are off or the file system
        refuses one. Its record is ``target``'s; like every file it appears under its final
        name only once complete."""
        rec = self.records.get(target)
        if rec is None:
            raise MoetoolError(f"{self.root}: {name} is to be the same as {target}, which is not written yet")
        src, tmp = self.root / target, self.incomplete_path(name)
        linked = False
        if link:
            try:
                os.link(src, tmp)
                linked = True
            except OSError:  # no hard links here (EPERM, EXDEV, EMLINK, ENOTSUP...): copy
                pass
        if not linked:
            _copy_durably(src, tmp)
        return self.commit(name, rec.sha256)

    def write_safetensors(
        self,
        name: str,
        specs: list[TensorSpec],
        chunks: Iterator[tuple[str, torch.Tensor]],
        metadata: dict[str, str] | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> FileRecord:
        """Stream ``chunks`` — (tensor name, data) pairs in ``specs`` order, a tensor's data
        possibly split over several consecutive chunks along its bytes — into ``name``.

        Every tensor must receive exactly its spec's byte count, dtype included, or the file
        is left as ``.incomplete`` and a MoetoolError names the tensor.
        """
        sink = _HashingSink(self.incomplete_path(name))
        ok = False
        try:
            sink.write(safetensors_header(specs, metadata))
            want = iter(specs)
            current, remaining = None, 0
            for tname, data in chunks:
                if remaining == 0:
                    current = next(want, None)
                    if current is None:
                        raise MoetoolError(f"{name}: unexpected extra tensor {tname}")
                    remaining = current.nbytes
                if tname != current.name or data.dtype != current.dtype:
                    raise MoetoolError(f"{name}: expected data of {current.name} ({current.dtype}), got {tname} ({data.dtype})")
                n = data.numel() * data.element_size()
                if n > remaining:
                    raise MoetoolError(f"{name}: tensor {tname} got {n} bytes more than its shape {list(current.shape)} holds")
                remaining -= n
                sink.write(data)
                if on_bytes is not None:
                    on_bytes(n)
            if remaining or next(want, None) is not None:
                raise MoetoolError(f"{name}: tensor data ended early ({current.name if current else 'first tensor'})")
            ok = True
        finally:
            digest = sink.close(ok)
        return self.commit(name, digest)

    def finish(self, manifest_extra: dict | None = None) -> dict:
        """Write manifest.json last (sha256 and size of every file) and drop the journal."""
        files = {n: {"sha256": r.sha256, "size": r.size} for n, r in sorted(self.records.items())}
        manifest = {"moetool_version": _version(), **(manifest_extra or {}), "files": files}
        self._remove_leftovers()
        self.write_json(MANIFEST_NAME, manifest, record=False)
        (self.root / JOURNAL_NAME).unlink(missing_ok=True)
        if self._folder_lock is not None:
            self._folder_lock.remove_file()
        _fsync_dir(self.root)
        self.close()
        return manifest

    def _remove_leftovers(self) -> None:
        """Temporary files an interrupted earlier run left (its ``.incomplete`` files whose
        final names this run wrote, or no longer plans): a complete output holds none."""
        folders = {self.root} | {(self.root / name).parent for name in self.records}
        for folder in folders:
            for path in folder.glob("*" + INCOMPLETE):
                if path.is_file() or path.is_symlink():
                    path.unlink()


def _rename_over(tmp: Path, final: Path) -> None:
    """``os.replace(tmp, final)``. Where both already name one file (a hard link finished by an
    interrupted run, linked again on resume), rename(2) does nothing and leaves ``tmp``:
    remove it then."""
    os.replace(tmp, final)
    if os.path.lexists(tmp):
        os.unlink(tmp)


def _journal_plan(path: Path) -> str | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data.get("plan_id") if isinstance(data, dict) else None


class FolderLock:
    """Exclusive ``flock`` on ``ROOT/.moetool.lock``, which holds the owner's pid. A second
    writer fails at once naming that pid; a lock whose holder died is free (the kernel drops a
    flock with its process), so a stale lock file is simply taken over."""

    def __init__(self, root: Path):
        import fcntl

        self.fd: int | None = None
        self.path = Path(root) / LOCK_NAME
        self.created = not self.path.exists()  # by this run (under the lock, checked again below)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise MoetoolError(f"{root} is being written by process {holder} (another moetool run); "
                                   f"wait for it or stop it") from None
            except OSError:
                os.close(fd)
                raise
            # the holder before us may have removed the file as it finished: then our lock is on
            # a file nobody else will open; lock the one at the path now
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
            self.created = True
        self.fd = fd

    def write_owner(self) -> None:
        """Record this process as the writer (once the folder is known to be ours to write: a
        refused run leaves the file as it found it)."""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def remove_file(self) -> None:
        """Remove the lock file while still holding the lock (the output is complete)."""
        self.path.unlink(missing_ok=True)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # drops the flock
            self.fd = None

    __del__ = release


def _copy_durably(src: Path, dst: Path) -> None:
    """``src``'s bytes into a new file ``dst``, fsync'd."""
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


def _version() -> str:
    from moetool import __version__

    return __version__


def _refuse_nesting(out: Path, inp: Path) -> None:
    out_r, in_r = out.resolve(), inp.resolve()
    if out_r == in_r or in_r in out_r.parents:
        raise MoetoolError(f"output {out} is inside the input {inp}; the input folder is never written")
    if out_r in in_r.parents:
        raise MoetoolError(f"input {inp} is inside the output {out}; choose an output folder elsewhere")


def verify_manifest(root: Path, names: Iterable[str] | None = None) -> dict:
    """Check files of a finished output against its manifest (all, or only ``names``).

    Raises MoetoolError naming the first missing, truncated or modified file.
    """
    path = Path(root) / MANIFEST_NAME
    if not path.is_file():
        raise MoetoolError(f"{root}: no {MANIFEST_NAME} (output unfinished or not made by moetool)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
        raise MoetoolError(f"{path}: invalid manifest") from None
    for name in (names if names is not None else files):
        rec = files.get(name)
        if rec is None:
            raise MoetoolError(f"{path}: no entry for {name}")
        p = Path(root) / name
        if not p.is_file():
            raise MoetoolError(f"{p}: missing (listed in {MANIFEST_NAME})")
        if p.stat().st_size != rec["size"]:
            raise MoetoolError(f"{p}: size {p.stat().st_size} bytes, manifest says {rec['size']} (truncated or modified)")
        if sha256_file(p) != rec["sha256"]:
            raise MoetoolError(f"{p}: sha256 does not match {MANIFEST_NAME} (file modified or corrupt)")
    return manifest
