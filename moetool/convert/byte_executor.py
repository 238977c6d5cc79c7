"""``shard`` and ``repack`` of an unquantized checkpoint as byte copies, without torch.

The plan is the torch executor's (``moetool.convert.plan``), its files turned into header + input
byte spans by ``moetool.convert.byte_plan``. Each output file is copied by one worker (one file per
core at a time, at most 4: ``default_workers``):

    machines of fewer than 8 cores (where the file system takes O_DIRECT):
    input (page cache) --pread--> one of 4 page-aligned 1 MiB staging buffers
        --> sha256 on a second thread (hashlib releases the GIL) --> O_DIRECT write on a third

    elsewhere:
    input (page cache) --pread--> one of 8 reused 256 KiB buffers --write--> FILE.incomplete
                                        \\--> sha256 on a second thread
    (writeback started every 16 MiB, so the final fsync waits only for the tail)

then fsync'd, renamed and journaled by :class:`OutputDir` exactly as the torch executor does
(a re-run resumes either one's files; the manifest is written last). A planned file that is
``same_as`` an earlier one (every EP rank's ``model-common`` file) is hard-linked to it, or
copied, once the copies are done.

Nothing is converted, so nothing needs a value check that the torch path does not do either:
every header, dtype, shape and byte range was validated when the checkpoint was opened, and
``why_not_byte_copy`` leaves everything it does not fully understand to the torch executor.

A quantized checkpoint is sharded this way too (``shard_by_copy``): a :class:`TorchCheck`
builds the torch executor's plan of the same shard (from the profile a quantize output's
manifest holds, ``moetool.convert.profile``; else meanwhile, in a child process when torch is
not loaded) and the files are committed only once it agrees; where it does not, or fails, the
copies are removed and the torch executor shards the checkpoint (raising its error, if any).
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import mmap
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from moetool.model.families import ModelSpec
from moetool.convert.byte_plan import (ByteFile, ByteSource, byte_files, coalesce, copy_groups, is_quantized,
                                       why_not_byte_copy)
from moetool.lazy import import_module
from moetool.read.checkpoint import Checkpoint
from moetool.read.prefetch import prefetch
from moetool.read.safetensors import pread_exactly
from moetool.convert.plan import ExpertLinear, Layout, Plan, Stacked, Summary
from moetool.convert.profile import SAMPLED_EXPERT, plan_facts, sampled_layers, stored_profile
from moetool.convert.output import finish_plan
from moetool.convert.planning import checkpoint_files, checkpoint_plan, shard_plan
from moetool.model.spec import ExpertPlacement
from moetool.convert.output import OutputDir
from moetool.convert.sink import (DIRECT_ALIGN, O_DIRECT, WIDE_CORES, WRITE_SLICE, WRITEBACK_STEP, direct_stage,
                                  naming_file, open_direct, pwrite_all, start_writeback)

#: bytes per read, and per write through the page cache (larger writes are slower on this
#: kernel: see ``sink.WRITE_SLICE``)
CHUNK = WRITE_SLICE
#: direct writes: staging buffers per file (one filled by the copy loop, one hashed, one written, one spare)
STAGE_BUFFERS = 4
#: writes through the page cache: ``CHUNK`` buffers in flight per file between the copy loop and its hasher
BUFFERS = 8
#: copies write with O_DIRECT on machines of fewer than this many cores (``sink.WIDE_CORES``).
#: With 2 cores the CPU bounds a copy, and a direct write saves the page-cache copy and the
#: kernel's writeback: shard --ep 8 of the 1.38 GiB CPU bench input (cached) took 1.01-1.16 s
#: against 1.23-1.26 s buffered, repack 0.93-1.14 against 1.17-1.25. On an H100 host (16 cores,
#: cold page cache, 9.7 GB input) the disk decides: four 4 MiB direct writes in flight beside
#: the input's reads made shard 0.93x cp and repack 0.94x, buffered writes (the kernel's
#: writeback keeps many in flight) 1.22x and 1.32x.
DIRECT_BELOW_CORES = WIDE_CORES
#: the output format of a byte copy: the input's, dense (a quantized input's is its TorchCheck's)
FORMAT = "dense"


def repack_by_copy(ckpt: Checkpoint, spec: ModelSpec, out, layout: Layout, *, max_shard_size: int | None,
                   force: bool, progress: bool, plan_id: str) -> Summary | None:
    """``repack`` as a byte copy; None when the checkpoint does not qualify (``why_not_byte_copy``)."""
    if why_not_byte_copy(ckpt, spec) is not None:
        return None
    source = ByteSource(ckpt, spec)
    files = checkpoint_files(ckpt, spec, layout, copy_groups(ckpt, spec), source.specs, max_shard_size)
    plan = checkpoint_plan(ckpt, files, dict(ckpt.config), FORMAT, layout)
    outdir = OutputDir(Path(out), inputs=[ckpt.root], sources=[ckpt], force=force, plan_id=plan_id)
    return run_byte_plan(plan, byte_files(plan, source), ckpt, outdir, progress=progress)


def shard_by_copy(ckpt: Checkpoint, spec: ModelSpec, out, ep: int, placements: dict[int, ExpertPlacement], *,
                  layout: Layout, placement_name: str, redundant: int, max_shard_size: int | None, force: bool,
                  progress: bool, plan_id: str, links: bool = True, expert_load: Path | None = None) -> Summary | None:
    """``shard`` as a byte copy; None when the checkpoint does not qualify (``why_not_byte_copy``),
    or, quantized, when the torch executor's plan of it differs (nothing is then committed)."""
    if why_not_byte_copy(ckpt, spec, quantized=True, layout=layout) is not None:
        return None
    source = ByteSource(ckpt, spec)
    plan = shard_plan(ckpt, spec, ep, placements, layout, max_shard_size, placement_name, redundant,
                      copy_groups(ckpt, spec), source.specs, FORMAT, {})
    check = None
    if is_quantized(ckpt):
        options = {"ep": ep, "placement": placement_name, "redundant": redundant, "layout": layout,
                   "expert_load": str(expert_load) if expert_load else None, "max_shard_size": max_shard_size}
        check = TorchCheck(ckpt.root, options, plan, source)
        if check.settled and not check.agrees(samples=False):  # the samples' bytes once copied (cached)
            return None
    try:
        outdir = OutputDir(Path(out), inputs=[ckpt.root], sources=[ckpt], force=force, plan_id=plan_id)
        files = byte_files(plan, source)
    except BaseException:  # a refused output: the check's child is not left running
        if check is not None:
            check.close()
        raise
    return run_byte_plan(plan, files, ckpt, outdir, progress=progress, links=links, check=check)


def run_byte_plan(plan: Plan, files: list[ByteFile], ckpt: Checkpoint, out: OutputDir, *, progress: bool = True,
                  workers: int | None = None, links: bool = True, check: TorchCheck | None = None) -> Summary | None:
    """Write ``files`` (the plan's files that are not ``same_as`` another; skipping those a
    previous run finished), then the ``same_as`` files (hard links, or copies with
    ``links=False``), then what ``finish_plan`` writes. With a ``check``, the files are
    committed only once it agrees; otherwise they are removed and None is returned.
    The kernel reads the input ahead meanwhile (``prefetch``): from a cold page cache, 256 KiB
    reads missing the cache one after another left shard at 1.02x a cp on an H100 host."""
    prefetch(ckpt.root)
    bar = None
    try:
        t0 = time.perf_counter()
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, desc="writing", leave=False)
        lock = threading.Lock()

        def on_bytes(n: int) -> None:
            with lock:
                bar.update(n)

        pending: list[tuple[str, str]] = []
        written = copy_files(files, ckpt.root, out, workers=workers, on_bytes=on_bytes if bar else None,
                             pending=pending if check else None)
        if check is not None:
            if not check.agrees():
                for name, _ in pending:
                    out.incomplete_path(name)  # removes the copy
                return None
            plan = dataclasses.replace(plan, out_format=check.format_name,
                                       manifest_extra={**plan.manifest_extra, **check.format_entries})
            for name, digest in pending:
                out.commit(name, digest)
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
        if bar is not None:  # cleared before an error is printed, so "error:" starts its line
            bar.close()
        out.close()  # the folder is released either way; without a manifest it stays unfinished
        if check is not None:
            check.close()
    return plan.summary(bytes_in=ckpt.files_bytes(), seconds=time.perf_counter() - t0, written=written)


class _Stopped(Exception):
    """Another file failed, or Ctrl-C: this one stops at its next chunk, left ``.incomplete``."""


def copy_files(files: list[ByteFile], root: Path, out: OutputDir, *, workers: int | None = None,
               on_bytes: Callable[[int], None] | None = None, pending: list[tuple[str, str]] | None = None) -> int:
    """Copy each file (in order, ``workers`` at a time) unless ``out`` already has it; the count
    written. With ``pending``, a copied file is left under its temporary name, uncommitted, and
    (name, sha256) is appended there instead."""
    workers = workers or default_workers()
    inputs = _Inputs(root)
    lock = threading.Lock()

    failed = threading.Event()  # after a failure no further file starts, and those being copied stop

    def one(f: ByteFile) -> int:
        try:
            if failed.is_set():
                return 0
            if out.already_done(f.name, f.nbytes):
                if on_bytes is not None:
                    on_bytes(f.nbytes - len(f.header))  # the data bytes, as a copy counts them
                return 0
            digest = _copy_file(f, inputs, out, on_bytes, failed)
            if pending is None:
                out.commit(f.name, digest)
            else:
                with lock:
                    pending.append((f.name, digest))
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


class _StagedFile:
    """One output file opened with O_DIRECT, written from page-aligned staging buffers
    (``direct_stage()`` bytes each, ``STAGE_BUFFERS`` of them) in file order: the copy loop
    fills a buffer, a hashing thread takes it (hashlib releases the GIL), then a writing
    thread writes it straight to the disk. The file's partial last block, and everything once
    a direct write is refused (EINVAL), go through the page cache in ``CHUNK`` writes."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd  # opened with O_DIRECT
        self.stage = direct_stage()
        self.o_direct = True
        self.h = hashlib.sha256()
        self.error: BaseException | None = None
        self.free: queue.Queue = queue.Queue()
        for _ in range(STAGE_BUFFERS):
            self.free.put(mmap.mmap(-1, self.stage))  # page-aligned, as O_DIRECT needs
        self.to_hash: queue.Queue = queue.Queue()
        self.to_write: queue.Queue = queue.Queue()
        self.written = self.flushed = 0  # bytes written; through the page cache: start of the range not yet flushed
        self.threads = [threading.Thread(target=self._hash_loop, name="moetool-hash", daemon=True),
                        threading.Thread(target=self._write_loop, name="moetool-write", daemon=True)]
        for t in self.threads:
            t.start()
        self.closed = False

    def take(self) -> mmap.mmap:
        """A free staging buffer (waits while all are hashed or written); raises what a thread raised."""
        buf = self.free.get()
        if self.error is not None:
            raise naming_file(self.error, self.path)
        return buf

    def submit(self, buf: mmap.mmap, length: int) -> None:
        """The next ``length`` bytes of the file, at the start of ``buf``; every buffer but the
        last is full, so each direct write starts at an aligned offset."""
        self.to_hash.put((buf, length))

    def finish(self) -> str:
        """Wait for the hashing and writing, fsync: the file's sha256."""
        self._join()
        try:
            if self.error is not None:
                raise naming_file(self.error, self.path)
            try:
                os.fsync(self.fd)
            except OSError as e:
                raise naming_file(e, self.path)
            return self.h.hexdigest()
        finally:
            self.close()

    def close(self) -> None:
        """Stop the threads (once what was submitted is done) and close the file; idempotent."""
        self._join()
        if not self.closed:
            self.closed = True
            os.close(self.fd)

    def _join(self) -> None:
        if self.threads:
            self.to_hash.put(None)
            for t in self.threads:
                t.join()
            self.threads = []

    def _hash_loop(self) -> None:
        while True:
            item = self.to_hash.get()
            if item is not None and self.error is None:
                try:
                    self.h.update(memoryview(item[0])[:item[1]])
                except BaseException as e:  # surfaced by take() / finish()
                    self.error = e
            self.to_write.put(item)
            if item is None:
                return

    def _write_loop(self) -> None:
        while True:
            item = self.to_write.get()
            if item is None:
                return
            buf, length = item
            try:
                if self.error is None:
                    self._write(memoryview(buf)[:length])
            except BaseException as e:  # surfaced by take() / finish()
                self.error = e
            finally:
                self.free.put(buf)

    def _write(self, view: memoryview) -> None:
        """Whole aligned blocks directly; what is left (the file's partial last block, or all of
        it once direct writes are off) through the page cache."""
        head = view.nbytes - view.nbytes % DIRECT_ALIGN if self.o_direct else 0
        if head:
            try:
                pwrite_all(self.fd, view[:head], self.written, self.path)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: an alignment this file does not take
                    raise
                head = 0
            self.written += head
        if head < view.nbytes:
            if self.o_direct:
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
                self.o_direct = False
                self.flushed = self.written
            for start in range(head, view.nbytes, CHUNK):
                piece = view[start:start + CHUNK]
                pwrite_all(self.fd, piece, self.written, self.path)
                self.written += piece.nbytes
            if self.written - self.flushed >= WRITEBACK_STEP:
                start_writeback(self.fd, self.flushed, self.written - self.flushed)
                self.flushed = self.written


def direct_writes() -> bool:
    """Whether copies write with O_DIRECT here (``DIRECT_BELOW_CORES``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return cores < DIRECT_BELOW_CORES


def _copy_file(f: ByteFile, inputs: _Inputs, out: OutputDir, on_bytes: Callable[[int], None] | None,
               stop: threading.Event) -> str:
    """``f`` written and fsync'd under its temporary name: its sha256. Direct writes where
    ``direct_writes`` says so and the file system takes O_DIRECT, else through the page cache."""
    path = out.incomplete_path(f.name)
    fd = open_direct(path) if direct_writes() else None
    if fd is None:
        return _copy_buffered(f, inputs, path, on_bytes, stop)
    try:
        dst = _StagedFile(path, fd)
    except BaseException:
        os.close(fd)
        raise
    try:
        buf, pos = dst.take(), 0
        view = memoryview(buf)
        header = memoryview(f.header)
        for src, offset, length in [(None, 0, header.nbytes)] + [(s.file, s.offset, s.length) for s in coalesce(f.spans)]:
            done = 0
            while done < length:
                if stop.is_set():
                    raise _Stopped
                k = min(length - done, dst.stage - pos, CHUNK)
                if src is None:
                    view[pos:pos + k] = header[done:done + k]
                else:
                    inputs.read_into(src, offset + done, view[pos:pos + k])  # straight into the staging buffer
                    if on_bytes is not None:
                        on_bytes(k)
                pos += k
                done += k
                if pos == dst.stage:
                    dst.submit(buf, pos)
                    buf, pos = dst.take(), 0
                    view = memoryview(buf)
        dst.submit(buf, pos)
        return dst.finish()
    finally:
        dst.close()


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


def _copy_buffered(f: ByteFile, inputs: _Inputs, path: Path, on_bytes: Callable[[int], None] | None,
                   stop: threading.Event) -> str:
    """``f`` through the page cache: each ``CHUNK`` read into one of ``BUFFERS`` reused buffers
    and written by the copy loop, hashed on a second thread; writeback started every
    ``WRITEBACK_STEP``, so the final fsync waits only for the tail."""
    free: queue.Queue = queue.Queue()
    for _ in range(BUFFERS):
        free.put(bytearray(CHUNK))
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
            hasher.thread.join()
        os.close(fd)
    return digest


# ---------------------------------------------------------------------------------- the check


#: the module that builds the torch executor's plan of a shard (imports torch)
CHECK_MODULE = "moetool.convert.byte_check"


class TorchCheck:
    """Whether the torch executor would write the byte copy's plan of a quantized shard: the
    same file headers, manifest and JSON files, and the same bytes for one expert slice of each
    layer shape. Answered at once (``settled``) from the profile the checkpoint's manifest
    holds (``moetool.convert.profile``: a quantize output's), or where torch is loaded;
    otherwise a child process works it out while the files are copied (on an H100 host with a
    cold page cache, ``import torch`` takes 10 s there, sharing the disk with the copy)."""

    def __init__(self, root: Path, options: dict, plan: Plan, source: ByteSource):
        self.plan, self.source = plan, source
        self.samples = _samples(plan, source)
        args = {"source": str(root), **options, "samples": self.samples}
        self.proc: subprocess.Popen | None = None
        self.facts: dict | None = self._from_profile(options)
        self.settled = self.facts is not None or torch_loaded()
        if self.facts is None and self.settled:
            try:
                self.facts = _plain(import_module(CHECK_MODULE).shard_facts(**args))
            except Exception:  # the torch executor raises it again as the command's error
                self.facts = None
        elif not self.settled:
            self.proc = subprocess.Popen([sys.executable, "-m", CHECK_MODULE, json.dumps(args)],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                         env=_child_env())
        self._answer: bool | None = None

    def _from_profile(self, options: dict) -> dict | None:
        """The facts from the profile the checkpoint's manifest holds; None without one that fits."""
        profile = stored_profile(self.source.ckpt)
        if profile is None:
            return None
        try:
            facts = plan_facts(self.source.ckpt, self.source.spec, profile, **options, samples=self.samples)
        except Exception:  # a profile that does not fit this checkpoint, or malformed: the torch check says
            return None
        return None if facts is None else _plain(facts)

    def agrees(self, samples: bool = True) -> bool:
        """Wait for the facts (once); True when they are the byte plan's. ``samples=False``:
        all but the sampled slices' bytes, which are read from the input (before the copy,
        from a cold disk: 0.1 s of an H100 host's 5 s fp8 shard)."""
        if self._answer is None:
            if self.proc is not None:
                out, _ = self.proc.communicate()
                self.facts = json.loads(out) if self.proc.returncode == 0 and out.strip() else None
                self.proc = None
            if self.facts is None:
                self._answer = False
            elif not samples:
                return {**self.facts, "samples": None} == self._expected(samples=False)
            else:
                self._answer = self.facts == self._expected()
        return self._answer

    def _expected(self, samples: bool = True) -> dict:
        mine = _plain({"headers": {pf.name: hashlib.sha256(pf.header()).hexdigest() for pf in self.plan.files
                                   if not pf.same_as},
                       "manifest_extra": self.plan.manifest_extra, "json_files": self.plan.json_files,
                       "samples": [self._sample_shas(name, index) for name, index in self.samples] if samples
                       else None})
        for key in FORMAT_ENTRIES:  # the format is the check's to say
            mine["manifest_extra"][key] = self.facts["manifest_extra"].get(key)
        return mine

    def _sample_shas(self, name: str, index: int) -> list[str]:
        g = next(pf for pf in self.plan.files if pf.name == name).groups[index]
        inputs = _Inputs(self.source.ckpt.root)
        try:
            shas = []
            for spans in self.source.slice_spans(g, 0).values():
                h = hashlib.sha256()
                for span in spans:
                    buf = bytearray(span.length)
                    inputs.read_into(span.file, span.offset, memoryview(buf))
                    h.update(buf)
                shas.append(h.hexdigest())
            return shas
        finally:
            inputs.close()

    @property
    def format_name(self) -> str:
        return self.facts["manifest_extra"]["format"]

    @property
    def format_entries(self) -> dict:
        return {k: self.facts["manifest_extra"][k] for k in FORMAT_ENTRIES}

    def close(self) -> None:
        """Stop the child process, if it still runs (the copy failed or was interrupted)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _child_env() -> dict:
    """The environment of the check's ``python -m``: this moetool found first, and (Python 3.11+)
    not the working directory, where a ``moetool`` or ``torch`` folder would shadow them."""
    here = str(Path(__file__).resolve().parents[2])  # the folder holding this moetool package
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONSAFEPATH": "1"}


def torch_loaded() -> bool:
    """Whether this process has imported torch (then the check costs no import)."""
    return "torch" in sys.modules


#: the manifest entries of a shard that name the format (the torch check's)
FORMAT_ENTRIES = ("format", "format_params")


def _samples(plan: Plan, source: ByteSource) -> list[list]:
    """[file name, group index] of the first expert group of each kind and layer shape whose
    expert (stacked: slot 0's) is the one a profile samples, in the first layer of that shape."""
    first_layers = set(sampled_layers(source.spec).values())
    seen, out = set(), []
    for pf in plan.files:
        if pf.same_as:
            continue
        for i, g in enumerate(pf.groups):
            if isinstance(g, (Stacked, ExpertLinear)):
                expert = g.experts[0] if isinstance(g, Stacked) else g.expert
                layer = source.layers[g.layer]
                key = (layer.hidden, layer.intermediate, g.which if isinstance(g, Stacked) else g.role)
                if key not in seen and expert == SAMPLED_EXPERT and g.layer in first_layers:
                    seen.add(key)
                    out.append([pf.name, i])
    return out


def _plain(obj):
    """``obj`` as JSON gives it back (tuples as lists, keys as strings): comparable with facts
    read from the child."""
    return json.loads(json.dumps(obj, default=str))
