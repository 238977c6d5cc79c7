"""``shard`` and ``repack`` of an unquantized checkpoint as byte copies, without torch.

The plan is the torch executor's (``moetool.convert.plan``), its files turned into header + input
byte spans by ``moetool.convert.byte_plan``. Each output file is copied by one worker (one file per
core at a time, at most 4: ``default_workers``):

    input (page cache) --pread--> one of 8 reused 256 KiB buffers --write--> FILE.incomplete
                                        \\--> sha256 on a second thread (hashlib releases the GIL)

then fsync'd, renamed and journaled by :class:`OutputDir` exactly as the torch executor does
(a re-run resumes either one's files; the manifest is written last). Writeback is started every
16 MiB so the final fsync waits only for the tail. A planned file that is ``same_as`` an
earlier one (every EP rank's ``model-common`` file) is hard-linked to it, or copied, once
the copies are done.

Nothing is converted, so nothing needs a value check that the torch path does not do either:
every header, dtype, shape and byte range was validated when the checkpoint was opened, and
``why_not_byte_copy`` leaves everything it does not fully understand to the torch executor.
"""
from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from moetool.model.families import ModelSpec
from moetool.convert.byte_plan import ByteFile, ByteSource, byte_files, coalesce, copy_groups, why_not_byte_copy
from moetool.read.checkpoint import Checkpoint
from moetool.read.safetensors import pread_exactly
from moetool.convert.plan import Layout, Plan, Summary
from moetool.convert.output import finish_plan
from moetool.convert.planning import checkpoint_files, checkpoint_plan, shard_plan
from moetool.model.spec import ExpertPlacement
from moetool.convert.output import OutputDir
from moetool.convert.sink import WRITE_SLICE, WRITEBACK_STEP, naming_file, pwrite_all, start_writeback

#: bytes per read / write (larger writes are slower on this kernel: see ``writer.WRITE_SLICE``)
CHUNK = WRITE_SLICE
#: buffers in flight per file between the copy loop and its hasher
BUFFERS = 8
#: the output format of a byte copy: the input's, which ``why_not_byte_copy`` requires to be dense
FORMAT = "dense"


def repack_by_copy(ckpt: Checkpoint, spec: ModelSpec, out, layout: Layout, *, max_shard_size: int | None,
                   force: bool, progress: bool, plan_id: str) -> Summary | None:
    """``repack`` as a byte copy; None when the checkpoint does not qualify (``why_not_byte_copy``)."""
    if why_not_byte_copy(ckpt, spec) is not None:
        return None
    source = ByteSource(ckpt, spec)
    files = checkpoint_files(ckpt, spec, layout, copy_groups(ckpt, spec), source.specs, max_shard_size)
    plan = checkpoint_plan(ckpt, files, dict(ckpt.config), FORMAT, layout)
    outdir = OutputDir(Path(out), inputs=[ckpt.root], force=force, plan_id=plan_id)
    return run_byte_plan(plan, byte_files(plan, source), ckpt, outdir, progress=progress)


def shard_by_copy(ckpt: Checkpoint, spec: ModelSpec, out, ep: int, placements: dict[int, ExpertPlacement], *,
                  layout: Layout, placement_name: str, redundant: int, max_shard_size: int | None, force: bool,
                  progress: bool, plan_id: str, links: bool = True) -> Summary | None:
    """``shard`` as a byte copy; None when the checkpoint does not qualify (``why_not_byte_copy``)."""
    if why_not_byte_copy(ckpt, spec) is not None:
        return None
    source = ByteSource(ckpt, spec)
    plan = shard_plan(ckpt, spec, ep, placements, layout, max_shard_size, placement_name, redundant,
                      copy_groups(ckpt, spec), source.specs, FORMAT, {})
    outdir = OutputDir(Path(out), inputs=[ckpt.root], force=force, plan_id=plan_id)
    return run_byte_plan(plan, byte_files(plan, source), ckpt, outdir, progress=progress, links=links)


def run_byte_plan(plan: Plan, files: list[ByteFile], ckpt: Checkpoint, out: OutputDir, *, progress: bool = True,
                  workers: int | None = None, links: bool = True) -> Summary:
    """Write ``files`` (the plan's files that are not ``same_as`` another; skipping those a
    previous run finished), then the ``same_as`` files (hard links, or copies with
    ``links=False``), then what ``finish_plan`` writes."""
    try:
        t0 = time.perf_counter()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, desc="writing", leave=False)
        lock = threading.Lock()

        def on_bytes(n: int) -> None:
            with lock:
                bar.update(n)

        written = copy_files(files, ckpt.root, out, workers=workers, on_bytes=on_bytes if bar else None)
        for pf in (pf for pf in plan.files if pf.same_as):
            if not out.already_done(pf.name, pf.file_size(), pf.same_as):
                out.same_file(pf.name, pf.same_as, link=links)
                written += 1
            if bar is not None:
                bar.update(pf.nbytes)
        if bar is not None:
            bar.close()
        finish_plan(plan, out)
    finally:
        out.close()  # the folder is released either way; without a manifest it stays unfinished
    return plan.summary(bytes_in=ckpt.files_bytes(), seconds=time.perf_counter() - t0, written=written)


class _Stopped(Exception):
    """Another file failed, or Ctrl-C: this one stops at its next chunk, left ``.incomplete``."""


def copy_files(files: list[ByteFile], root: Path, out: OutputDir, *, workers: int | None = None,
               on_bytes: Callable[[int], None] | None = None) -> int:
    """Copy each file (in order, ``workers`` at a time) unless ``out`` already has it; the count written."""
    workers = workers or default_workers()
    inputs = _Inputs(root)

    failed = threading.Event()  # after a failure no further file starts, and those being copied stop

    def one(f: ByteFile) -> int:
        try:
            if failed.is_set():
                return 0
            if out.already_done(f.name, f.nbytes):
                if on_bytes is not None:
                    on_bytes(f.nbytes - len(f.header))  # the data bytes, as a copy counts them
                return 0
            _copy_file(f, inputs, out, on_bytes, failed)
            return 1
        except _Stopped:
            return 0
        except BaseException:
            failed.set()
            raise

    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="moetool-copy") as pool:
            futures = [pool.submit(one, f) for f in files]  # started in order
            try:
                return sum(fut.result() for fut in futures)
            except BaseException:  # a failed file, or Ctrl-C: files being copied stop, no other starts
                failed.set()
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    finally:
        inputs.close()


def default_workers() -> int:
    """Files copied at once: one per core (each has a copy loop and a hashing thread), at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


# ---------------------------------------------------------------------------------- one file


class _Inputs:
    """Read-only descriptors of the input files, opened once and shared by the copying threads."""

    def __init__(self, root: Path):
        self.root = root
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def read_into(self, file: str, offset: int, view: memoryview) -> None:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                fd = self._fds[file] = os.open(self.root / file, os.O_RDONLY)
        pread_exactly(fd, view, offset, self.root / file)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _Hasher:
    """sha256 of one output file on its own thread, fed buffers in file order by the copy loop."""

    def __init__(self, release: Callable[[bytearray], None]):
        self.release = release
        self.h = hashlib.sha256()
        self.error: BaseException | None = None
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="moetool-hash", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            view, buf = item
            try:
                if self.error is None:
                    self.h.update(view)
            except BaseException as e:  # surfaced by finish()
                self.error = e
            finally:
                if buf is not None:
                    self.release(buf)

    def feed(self, view: memoryview, buf: bytearray | None = None) -> None:
        """Hash ``view``, then hand ``buf`` (the buffer it is part of) back to the copy loop."""
        self.q.put((view, buf))

    def finish(self) -> str:
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.h.hexdigest()


def _copy_file(f: ByteFile, inputs: _Inputs, out: OutputDir, on_bytes: Callable[[int], None] | None,
               stop: threading.Event) -> None:
    free: queue.Queue = queue.Queue()
    for _ in range(BUFFERS):
        free.put(bytearray(CHUNK))
    path = out.incomplete_path(f.name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # as open()
    written = flushed = 0
    ok, hasher = False, None
    try:
        hasher = _Hasher(free.put)  # after the open: a failed open leaves no thread
        hasher.feed(memoryview(f.header))
        pwrite_all(fd, memoryview(f.header), 0, path)
        written = len(f.header)
        for span in coalesce(f.spans):
            for off in range(0, span.length, CHUNK):
                if stop.is_set():
                    raise _Stopped
                buf = free.get()
                view = memoryview(buf)[:min(CHUNK, span.length - off)]
                inputs.read_into(span.file, span.offset + off, view)
                pwrite_all(fd, view, written, path)
                hasher.feed(view, buf)
                written += len(view)
                if written - flushed >= WRITEBACK_STEP:
                    start_writeback(fd, flushed, written - flushed)
                    flushed = written
                if on_bytes is not None:
                    on_bytes(len(view))
        digest = hasher.finish()
        try:
            os.fsync(fd)
        except OSError as e:
            raise naming_file(e, path)
        ok = True
    finally:
        if not ok and hasher is not None:
            hasher.q.put(None)
        os.close(fd)
    out.commit(f.name, digest)
