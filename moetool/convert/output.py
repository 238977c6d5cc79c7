"""Atomic, resumable output folders.

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

import errno
import fcntl
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from moetool.convert.plan import Plan, PlannedFile
from moetool import __version__
from moetool.errors import JSON_ERRORS, MoetoolError
from moetool.read.manifest import (INCOMPLETE, JOURNAL_NAME, LOCK_NAME, MANIFEST_NAME, RANK_DIR_RE, made_by_moetool,
                                   read_json_object, sha256_file)
from moetool.read.safetensors import TensorSpec, safetensors_header
from moetool.convert.sink import HashingSink, naming_file, pwrite_all

if TYPE_CHECKING:  # this module loads without torch: byte-copy shard / repack use OutputDir too
    import torch

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


@dataclass
class FileRecord:
    sha256: str
    size: int


class OutputDir:
    """One output folder of a conversion.

    ``plan_id`` identifies the plan (input checksum-free fingerprint: input file sizes and
    mtimes + options); a journal from another plan is refused (``force`` replaces it).
    """

    def __init__(self, root: Path, *, inputs: Iterable[Path] = (), force: bool = False, plan_id: str = "",
                 sources: Iterable = ()):
        self.root = Path(root)
        self.plan_id = plan_id
        #: the checkpoints read (``check_unchanged()``), checked again before the manifest
        self.sources = list(sources)
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
        journal = self.root / JOURNAL_NAME
        if manifest.exists():
            ours = made_by_moetool(manifest)
            if not force:
                if ours and journal.exists():  # a run stopped between the manifest and its clean-up
                    journal.unlink()
                    self._folder_lock.remove_file()  # the output is complete: no lock file in it
                    self._folder_lock.created = False
                raise MoetoolError(f"{self.root}: already holds a complete output ({MANIFEST_NAME}); use --force to overwrite")
            if ours:
                # the old output becomes a journal of no plan first: stopped while its files are
                # deleted, the folder is an unfinished output, never a manifest listing lost files
                os.replace(manifest, journal)
        if force:
            if _our_journal(journal):
                self._remove_listed(journal, "files")
                journal.unlink()
                self._remove_temporary_names()
        else:
            self._refuse_foreign()
        self._journal = self._load_journal()
        if not journal.exists():
            self._save_journal()  # marks the folder as this plan's unfinished output from the start

    def _refuse_foreign(self) -> None:
        """Raise unless the folder is empty or holds our unfinished output of this same plan."""
        if _refuse_foreign_files(self.root, self.plan_id):
            (self.root / (JOURNAL_NAME + INCOMPLETE)).unlink()

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
        """Delete the files a previous journal of this folder lists (files moetool wrote), so
        that a new plan with other file names leaves no stale shard behind; then folders left
        empty (EP rank folders of another --ep). Only regular files inside the folder, never
        through a symbolic link, never our own bookkeeping files."""
        for name in list((read_json_object(listing) or {}).get(key, {})):
            path = self._inside(str(name))
            if path is None or path.name in (MANIFEST_NAME, JOURNAL_NAME, LOCK_NAME):
                continue
            if path.is_file() and not path.is_symlink():
                path.unlink()
            self._prune(path.parent)

    def _inside(self, name: str) -> Path | None:
        """``root / name`` when it is a path inside the folder reached through real folders only."""
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            return None
        folder = self.root
        for part in rel.parts[:-1]:
            folder = folder / part
            if folder.is_symlink():
                return None
        return self.root / rel

    def _prune(self, folder: Path) -> None:
        """Remove ``folder`` and its parents below the root while they are real, empty folders."""
        while folder != self.root and folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent

    def _remove_temporary_names(self) -> None:
        """--force over an unfinished output of ours (its journal): the temporary files it left in
        its folders (the root and the EP rank folders), then rank folders left empty."""
        folders = [self.root] + [p for p in self.root.iterdir()
                                 if p.is_dir() and not p.is_symlink() and RANK_DIR_RE.fullmatch(p.name)]
        for folder in folders:
            for path in folder.glob("*" + INCOMPLETE):
                if path.is_file() and not path.is_symlink():
                    path.unlink()
            self._prune(folder)

    # -- journal ------------------------------------------------------------------------
    def _load_journal(self) -> dict[str, dict]:
        path = self.root / JOURNAL_NAME
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
        except JSON_ERRORS:
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
        if self._inside(name) is None:  # a link on the way could lead anywhere, the input included
            parts = Path(name).parts
            link = next((p for p in (self.root / Path(*parts[:i]) for i in range(1, len(parts))) if p.is_symlink()),
                        None)
            if link is None:
                raise MoetoolError(f"{name!r}: not a name inside the output folder {self.root}")
            raise MoetoolError(f"{link}: is a link (to {os.readlink(link)}); moetool writes only into real folders "
                               "(remove it, or choose another output folder)")
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
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # ENOSPC, EIO of a write, fsync or close: the error names the file
            raise naming_file(e, tmp) from None
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
        sink = HashingSink(self.incomplete_path(name))
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
        """Write manifest.json last (sha256 and size of every file) and drop the journal; an
        input changed since it was opened is refused first (the output stays unfinished)."""
        for source in self.sources:
            source.check_unchanged()
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
        """Temporary files of this output's names that an interrupted earlier run left: a
        complete output holds none. (Files of other names are not ours to remove.)"""
        for name in [*self.records, JOURNAL_NAME, MANIFEST_NAME]:
            path = self._inside(name + INCOMPLETE)
            if path is not None and (path.is_file() or path.is_symlink()):
                path.unlink()


def _refuse_foreign_files(root: Path, plan_id: str) -> bool:
    """Raise unless ``root`` is empty or holds our unfinished output of plan ``plan_id``; True
    when it holds only the first journal's temporary file of a run stopped while writing it
    (the caller removes it)."""
    journal = root / JOURNAL_NAME
    if journal.exists():
        if _journal_plan(journal) == plan_id:
            return False
        raise MoetoolError(f"{root}: holds the unfinished output of another moetool run (other input or "
                           f"options, see {JOURNAL_NAME}); re-run that command to finish it, or use --force "
                           f"to replace it")
    stray_journal = root / (JOURNAL_NAME + INCOMPLETE)
    stray = stray_journal.is_file() and not stray_journal.is_symlink()
    found = sorted(p.name for p in root.iterdir() if p.name != LOCK_NAME and not (stray and p == stray_journal))
    if found:
        raise MoetoolError(f"{root}: is not empty and holds no unfinished moetool output (found {found[0]}"
                           f"{f' and {len(found) - 1} more' if len(found) > 1 else ''}); choose an empty "
                           f"folder, or use --force to write into it")
    return stray


def refuse_output(root: Path, *, inputs: Iterable[Path] = (), force: bool = False, plan_id: str = "") -> None:
    """Raise what :class:`OutputDir` would refuse for these arguments, writing nothing: what
    ``--dry-run`` checks of its output folder (a second run's lock aside)."""
    root = Path(root)
    for inp in inputs:
        _refuse_nesting(root, Path(inp))
    if root.exists() and not root.is_dir():
        raise MoetoolError(f"{root}: exists and is not a folder; choose an output folder")
    above = next(p for p in (root, *root.absolute().parents) if os.path.lexists(p))
    if not above.is_dir():
        raise MoetoolError(f"{root}: cannot create the output folder ({os.strerror(errno.ENOTDIR)})")
    if force or not root.is_dir():
        return
    if (root / MANIFEST_NAME).exists():
        raise MoetoolError(f"{root}: already holds a complete output ({MANIFEST_NAME}); use --force to overwrite")
    _refuse_foreign_files(root, plan_id)


def _rename_over(tmp: Path, final: Path) -> None:
    """``os.replace(tmp, final)``. Where both already name one file (a hard link finished by an
    interrupted run, linked again on resume), rename(2) does nothing and leaves ``tmp``:
    remove it then."""
    os.replace(tmp, final)
    if os.path.lexists(tmp):
        os.unlink(tmp)


def _our_journal(path: Path) -> bool:
    """A journal moetool wrote: a run's (it names its plan) or a complete output's manifest
    set aside by --force (it names a moetool version)."""
    data = read_json_object(path)
    return data is not None and ("plan_id" in data or "moetool_version" in data)


def _journal_plan(path: Path) -> str | None:
    return (read_json_object(path) or {}).get("plan_id")


class FolderLock:
    """Exclusive ``flock`` on ``ROOT/.moetool.lock``, which holds the owner's pid. A second
    writer fails at once naming that pid; a lock whose holder died is free (the kernel drops a
    flock with its process), so a stale lock file is simply taken over."""

    def __init__(self, root: Path):
        self.fd: int | None = None
        self.path = Path(root) / LOCK_NAME
        while True:
            try:  # whether this run made the file decides whether a refused run removes it
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                self.created = True
            except FileExistsError:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                self.created = False
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


#: bytes a side-file copy reads and writes at a time
COPY_CHUNK = 1 << 20


def _copy_durably(src: Path, dst: Path) -> None:
    """``src``'s bytes into a new file ``dst``, fsync'd."""
    with open(src, "rb") as fin:  # a read error names ``src`` (shutil's copy names it for a full disk too)
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            offset = 0
            while chunk := fin.read(COPY_CHUNK):
                pwrite_all(fd, memoryview(chunk), offset, dst)
                offset += len(chunk)
            try:
                os.fsync(fd)
            except OSError as e:
                raise naming_file(e, dst) from None
        finally:
            os.close(fd)


def _version() -> str:
    return __version__


def _refuse_nesting(out: Path, inp: Path) -> None:
    """The output is neither the input nor inside it, nor the other way round: by path, and by
    the folders themselves (device and inode), which a bind mount shows under another path."""
    out_r, in_r = out.resolve(), inp.resolve()
    if out_r == in_r or in_r in out_r.parents or any(_same_folder(p, in_r) for p in (out_r, *out_r.parents)):
        raise MoetoolError(f"output {out} is inside the input {inp}; the input folder is never written")
    if out_r in in_r.parents or any(_same_folder(p, out_r) for p in in_r.parents):
        raise MoetoolError(f"input {inp} is inside the output {out}; choose an output folder elsewhere")


def _same_folder(a: Path, b: Path) -> bool:
    try:
        sa, sb = a.stat(), b.stat()
    except OSError:  # not there (yet)
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def write_indexes(plan: Plan, out: OutputDir) -> None:
    """One model.safetensors.index.json per output folder holding several safetensors files."""
    folders: dict[str, list[PlannedFile]] = {}
    for f in plan.files:
        folder = f.name.rsplit("/", 1)[0] + "/" if "/" in f.name else ""
        folders.setdefault(folder, []).append(f)
    for folder, files in folders.items():
        if len(files) == 1 and files[0].name.endswith("/model.safetensors" if folder else "model.safetensors"):
            continue
        weight_map = {s.name: f.name[len(folder):] for f in files for s in f.specs}
        total = sum(f.nbytes for f in files)
        out.write_json(f"{folder}model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def finish_plan(plan: Plan, out: OutputDir, more_manifest: Callable[[], dict] | None = None) -> None:
    """After the safetensors files: side files, JSON files, indexes, and the manifest last, with
    the entries ``more_manifest`` returns (called once everything else is written)."""
    for src_path, name in plan.other_files:
        out.copy_file(src_path, name)
    for name, obj in plan.json_files.items():
        out.write_json(name, obj)
    if plan.write_index:
        write_indexes(plan, out)
    out.finish({**plan.manifest_extra, **(more_manifest() if more_manifest else {})})
