"""The names moetool gives the files of an output folder, and the check of a finished one
against its ``manifest.json`` (sha256 and size of every file, written last)."""
from __future__ import annotations

import hashlib
import json
import re
import threading
from pathlib import Path
from typing import Callable, Iterable

from moetool.errors import JSON_ERRORS, MoetoolError


MANIFEST_NAME = "manifest.json"


#: config.json key of a checkpoint whose experts moetool quantized (the output format's name):
#: copied with the config by shard, repack and merge, and kept when the weights are dequantized
#: again, so a quantized output stays known as one without its manifest (verify's --ref check)
QUANTIZED_KEY = "moetool_quantized"


#: the files of an EP rank folder holding the non-expert tensors: the same bytes in every rank
COMMON_STEM = "model-common"


JOURNAL_NAME = ".moetool-journal.json"


LOCK_NAME = ".moetool.lock"


INCOMPLETE = ".incomplete"


HASH_BLOCK = 8 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(HASH_BLOCK)
            if not block:
                return h.hexdigest()
            h.update(block)


def verify_manifest(root: Path, names: Iterable[str] | None = None, workers: int = 8,
                    before: Callable[[str], None] | None = None) -> dict:
    """Check files of a finished output against its manifest (all, or only ``names``).

    Sizes first (cheap, and a truncated file needs no hash), then the sha256 of up to
    ``workers`` files at once (hashlib releases the GIL: one core each, where one core hashes
    slower than a disk reads): the largest first, or with ``before`` in the order of ``names``,
    ``before(name)`` called (and waited for) ahead of each file's hash. Raises MoetoolError
    naming the first missing, truncated or modified file, in the order of ``names`` (else the
    manifest's).
    """
    path = Path(root) / MANIFEST_NAME
    if not path.is_file():
        raise MoetoolError(f"{root}: no {MANIFEST_NAME} (output unfinished or not made by moetool)")
    manifest = read_manifest(path)
    files = manifest["files"]
    names = list(names if names is not None else files)
    for name in names:
        rec = files.get(name)
        if rec is None:
            raise MoetoolError(f"{path}: no entry for {name}")
        p = Path(root) / name
        if not p.is_file():
            raise MoetoolError(f"{p}: missing (listed in {MANIFEST_NAME})")
        if p.stat().st_size != rec["size"]:
            raise MoetoolError(f"{p}: size {p.stat().st_size} bytes, manifest says {rec['size']} (truncated or modified)")
    digests = _hash_files([Path(root) / n for n in names], [files[n]["size"] for n in names], workers,
                          None if before is None else (lambda i: before(names[i])))
    for name, digest in zip(names, digests):
        if isinstance(digest, OSError):
            raise MoetoolError(f"{Path(root) / name}: cannot be read ({digest.strerror or digest})")
        if digest != files[name]["sha256"]:
            raise MoetoolError(f"{Path(root) / name}: sha256 does not match {MANIFEST_NAME} (file modified or corrupt)")
    return manifest


def read_manifest(path: Path) -> dict:
    """The manifest at ``path``: a JSON object whose ``files`` map each name to its ``size``
    (bytes) and ``sha256`` (hex). Raises MoetoolError naming the file and what is wrong."""
    try:
        manifest = json.loads(Path(path).read_text())
    except JSON_ERRORS as e:
        raise MoetoolError(f"{path}: not a valid manifest (not JSON: {e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise MoetoolError(f"{path}: not a valid manifest (no \"files\" object)")
    for name, rec in manifest["files"].items():
        size, digest = (rec.get("size"), rec.get("sha256")) if isinstance(rec, dict) else (None, None)
        if type(size) is not int or size < 0 or not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise MoetoolError(f"{path}: not a valid manifest (entry {name!r} needs a size in bytes and a sha256)")
    return manifest


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _hash_files(paths: list[Path], sizes: list[int], workers: int, before: Callable[[int], None] | None = None) -> list:
    """sha256 hex digest (or the OSError reading it raised) of each path, on up to ``workers``
    daemon threads taking the largest files first (they bound the time), or with ``before`` in
    order, ``before(i)`` ahead of path i: a process that is interrupted leaves at once, not
    when the hashing ends."""
    todo = list(range(len(paths))) if before is not None else sorted(range(len(paths)), key=lambda i: -sizes[i])
    out: list = [None] * len(paths)
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            try:
                if before is not None:
                    before(i)
                out[i] = sha256_file(paths[i])
            except OSError as err:
                out[i] = err

    threads = [threading.Thread(target=work, name="moetool-sha256", daemon=True)
               for _ in range(max(1, min(workers, len(paths))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


RANK_DIR_RE = re.compile(r"rank-(\d{5})-of-(\d{5})")


def rank_dir(rank: int, ep: int) -> str:
    return f"rank-{rank:05d}-of-{ep:05d}"


def read_json_object(path: Path) -> dict | None:
    """The JSON object in ``path``; None when it is missing, unreadable, not JSON or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, *JSON_ERRORS):
        return None
    return data if isinstance(data, dict) else None


def made_by_moetool(manifest: Path) -> bool:
    """``manifest`` is a manifest.json moetool wrote: it names a moetool version and lists files."""
    data = read_json_object(manifest)
    return data is not None and "moetool_version" in data and isinstance(data.get("files"), dict)
