"""Checkpoint reader: a local folder or a Hub repo id, validated up front, tensors read lazily.

Only ``*.safetensors`` and ``*.json`` files are ever read. Pickle checkpoints (``.bin``,
``.pt``...) are refused, never loaded, and so are the folders ``moetool shard`` writes (a rank
folder, a shard root): they are not models. Headers are parsed here (plain JSON) so that every
structural problem is found before any work starts; tensor data is then read one tensor (or
one expert slice) at a time with plain positioned reads into fresh buffers.
"""
from __future__ import annotations

import json
import os
import re
import struct
import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moetool.errors import MoetoolError

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_HEADER_BYTES = 100 * 1024 * 1024

#: safetensors dtype string -> bytes per element. Anything else is refused. Headers are parsed
#: and checked with this table alone: opening a checkpoint needs no torch (a byte-copy
#: shard or repack never imports it); ``DTYPES`` maps the names to torch dtypes when data is read.
DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}
_TORCH_DTYPE_ATTRS = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}
_torch_tables: dict[str, dict] = {}


def __getattr__(name: str):
    """``DTYPES`` (safetensors name -> torch dtype) and ``DTYPE_NAMES`` (the inverse), built on
    first use so that importing this module does not import torch."""
    if name in ("DTYPES", "DTYPE_NAMES"):
        if not _torch_tables:
            import torch

            dtypes = {k: getattr(torch, v) for k, v in _TORCH_DTYPE_ATTRS.items()}
            _torch_tables.update(DTYPES=dtypes, DTYPE_NAMES={v: k for k, v in dtypes.items()})
        return _torch_tables[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def writable_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (keeps the tensor alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    buf = (ctypes.c_char * n).from_address(t.data_ptr())
    buf.owner = t
    return memoryview(buf).cast("B")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file (relative to the checkpoint root), dtype, shape and the
    byte range of its data inside the file (absolute offsets)."""

    name: str
    file: str
    dtype_name: str  # safetensors dtype name: "BF16", "F8_E4M3"...
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def dtype(self) -> "torch.dtype":
        return __getattr__("DTYPES")[self.dtype_name]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_safetensors_header(path: Path) -> tuple[int, dict[str, TensorInfo], dict]:
    """Parse and check one safetensors file's header without reading tensor data.

    Returns (data_start, {name: TensorInfo}, metadata). Raises MoetoolError naming the file
    for truncation, corruption, overlapping ranges or a dtype outside ``DTYPES``.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise MoetoolError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise MoetoolError(f"{path}: corrupt or truncated safetensors header (header length {n}, file size {size})")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoetoolError(f"{path}: corrupt safetensors header ({e.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise MoetoolError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise MoetoolError(f"{path}: corrupt safetensors header (__metadata__ is not a JSON object)")
    data_start = 8 + n
    infos: dict[str, TensorInfo] = {}
    data_end = 0
    for name, entry in header.items():
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(dtype_name, str) or not isinstance(shape, list) or not all(
                    type(v) is int and v >= 0 for v in (*shape, begin, end)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise MoetoolError(f"{path}: corrupt safetensors header entry for tensor {name}") from None
        if dtype_name not in DTYPE_SIZES:
            raise MoetoolError(
                f"{path}: tensor {name} has dtype {dtype_name}, not one of {', '.join(DTYPE_SIZES)}"
            )
        numel = 1
        for d in shape:
            numel *= int(d)
        if end - begin != numel * DTYPE_SIZES[dtype_name] or begin < 0:
            raise MoetoolError(f"{path}: tensor {name} byte range {begin}..{end} does not match shape {shape} {dtype_name}")
        infos[name] = TensorInfo(name, path.name, dtype_name, tuple(int(d) for d in shape), data_start + begin, data_start + end)
        data_end = max(data_end, end)
    ordered = sorted(infos.values(), key=lambda i: (i.begin, i.end))
    for prev, cur in zip(ordered, ordered[1:]):
        if cur.begin < prev.end:
            raise MoetoolError(f"{path}: tensors {prev.name} and {cur.name} overlap in the file (corrupt header)")
    if data_start + data_end > size:
        raise MoetoolError(
            f"{path}: truncated safetensors file: header says {data_start + data_end} bytes, file has {size}"
        )
    # the data section is exactly the tensors, back to back (as the safetensors library demands):
    # no bytes after the last one, no hole before or between them
    if data_start + data_end < size:
        raise MoetoolError(f"{path}: {size - data_start - data_end} trailing bytes after the last tensor "
                           f"(header says {data_start + data_end} bytes, file has {size}; corrupt or appended to)")
    at = data_start
    for cur in ordered:
        if cur.begin != at:
            raise MoetoolError(f"{path}: bytes {at - data_start}..{cur.begin - data_start} of the data section "
                               f"belong to no tensor (before {cur.name}; corrupt header)")
        at = cur.end
    return data_start, infos, metadata


def _check_relative(name: str, where: str) -> None:
    p = Path(name)
    if p.is_absolute() or ".." in p.parts or len(p.parts) != 1 or not name:  # shards sit next to the index
        raise MoetoolError(f"{where}: shard path {name!r} must be a plain relative file name")


def pread_exactly(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill ``view`` from byte ``offset`` of the open file ``fd``; ``path`` names it in the error."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise MoetoolError(f"{path}: unexpected end of file at byte {offset + done} (file changed while reading?)")
        done += n


class Checkpoint:
    """A validated safetensors checkpoint folder.

    ``tensors``: {name: TensorInfo} over all shards; ``config``: parsed config.json.
    Tensor data is read lazily with :meth:`get` / :meth:`get_rows`.
    """

    def __init__(self, root: Path, config: dict, tensors: dict[str, TensorInfo], files: list[str]):
        self.root = root
        self.config = config
        self.tensors = tensors
        self.files = files
        self._fds: dict[str, int] = {}
        #: read into page-locked buffers (set when tensors go on to a GPU)
        self.pin_memory = False
        self._suffix_index: dict[str, set[str]] | None = None

    # -- reading ---------------------------------------------------------------------------
    def suffixes(self, base: str, sep: str = ".") -> set[str]:
        """Suffixes stored for ``base``: ``base.weight``, ``base.weight_scale_inv``... -> {"weight",
        "weight_scale_inv"} (sep "."), or for a stacked base ``P.experts.w13`` the ``w13_*``
        tensors' suffixes (sep "_"). From an index built once, not a scan of every name."""
        if self._suffix_index is None:
            index: dict[str, set[str]] = {}
            for name in self.tensors:
                parent, _, last = name.rpartition(".")
                index.setdefault(parent, set()).add(last)
            self._suffix_index = index
        if sep == ".":
            return set(self._suffix_index.get(base, ()))
        parent, _, last = base.rpartition(".")
        head = last + sep
        return {s[len(head):] for s in self._suffix_index.get(parent, ()) if s.startswith(head)}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise MoetoolError(f"{self.root}: tensor {name} not found in the checkpoint") from None

    def get(self, name: str, scratch: str | None = None) -> torch.Tensor:
        """Read one tensor into a fresh CPU tensor (plain reads, no memory map, so resident
        memory holds only the tensors in use, never a shard).

        ``scratch``: read into this thread's reusable buffer of that name instead
        (``moetool.memory.scratch``), for a tensor dropped before the thread reads into the
        same buffer again (an input that is converted, not written as it is)."""
        info = self.info(name)
        return self._read(info.file, info.begin, info.nbytes, scratch).view(info.dtype).reshape(info.shape)

    def get_rows(self, name: str, index: int) -> torch.Tensor:
        """``tensor[index]`` along dim 0, reading only that slice (fused expert tensors [E, ...])."""
        info = self.info(name)
        if not info.shape or not 0 <= index < info.shape[0]:
            raise MoetoolError(f"{name}: index {index} out of range for shape {list(info.shape)}")
        row = info.nbytes // info.shape[0]
        return self._read(info.file, info.begin + index * row, row).view(info.dtype).reshape(info.shape[1:])

    def _read(self, file: str, offset: int, nbytes: int, scratch: str | None = None) -> torch.Tensor:
        import torch
        from moetool.memory import scratch as scratch_buffer

        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(self.root / file, os.O_RDONLY)
        if scratch is not None and not self.pin_memory:
            buf = scratch_buffer(scratch, nbytes, torch.uint8)
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        pread_exactly(fd, writable_bytes(buf), offset, self.root / file)
        return buf

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def files_bytes(self) -> int:
        return sum((self.root / f).stat().st_size for f in self.files)

    def __repr__(self) -> str:
        return f"Checkpoint({self.root}, {len(self.tensors)} tensors in {len(self.files)} files)"


def resolve_source(source: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder as is, else a Hub repo id fetched (safetensors + json only) into the HF cache.

    Honours HF_HUB_OFFLINE and the local cache through huggingface_hub.
    """
    text = str(source)
    path = Path(os.path.expanduser(text)) if text.startswith("~") else Path(source)
    if path.exists():
        if not path.is_dir():
            raise MoetoolError(f"{path}: a checkpoint must be a folder (or a Hub repo id), not a file")
        if revision is not None:
            raise MoetoolError(f"--revision applies to Hub repo ids, but {path} is a local folder")
        return path
    if text.count("/") != 1 or text.startswith((".", "/", "~")) or text.endswith("/"):
        raise MoetoolError(f"{source}: no such folder, and not a Hub repo id of the form owner/name")
    if path.parent.is_dir():  # a mistyped local path (tiny/mixtrall), not a repo id: no Hub lookup
        raise MoetoolError(f"{source}: no such folder (the folder {path.parent} exists here, so this is "
                           "taken as a local path, not a Hub repo id)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as e:  # pragma: no cover - a runtime dependency
        raise MoetoolError(f"huggingface_hub is needed to fetch {source}: {e}") from None
    import huggingface_hub.errors as hf_errors

    offline = (LocalEntryNotFoundError,) + tuple(
        c for c in (getattr(hf_errors, "OfflineModeIsEnabled", None),) if c is not None)
    try:
        local = snapshot_download(text, revision=revision, allow_patterns=["*.safetensors", "*.json"])
    except offline:
        raise MoetoolError(f"{source}: not in the local Hugging Face cache and the Hub cannot be reached (HF_HUB_OFFLINE?)") from None
    except HfHubHTTPError as e:
        raise MoetoolError(f"{source}: Hub error: {str(e).splitlines()[0]}") from None
    except Exception as e:  # repository not found, revision not found, network...
        raise MoetoolError(f"{source}: cannot fetch from the Hub: {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return Path(local)


# ------------------------------------------------------------------ outputs of ``moetool shard``
# They are not models: a rank folder holds one rank's experts renumbered from 0, a shard root
# holds only rank folders. Every command that reads a model refuses both here, in the one
# open path; ``verify`` and ``shard --merge`` read them through ``moetool.convert.shard.EPShards``.

SHARD_MANIFEST = "manifest.json"  # moetool.convert.output.MANIFEST_NAME (the writer is not imported here)
RANK_DIR_RE = re.compile(r"rank-(\d{5})-of-(\d{5})")
SHARD_COMMANDS = "`moetool verify` and `moetool shard --merge`"


class ShardOutputError(MoetoolError):
    """A folder written by ``moetool shard`` was given where a model is read. ``root``: the
    shard root (the folder given, or the parent of the rank folder given); ``rank``: the rank
    folder given, or None for a shard root."""

    def __init__(self, message: str, root: Path, rank: Path | None = None):
        super().__init__(message)
        self.root, self.rank = root, rank


def _shard_root_summary(root: Path) -> str | None:
    """'EP 4, finished' (or unfinished) for a folder written by ``moetool shard``, else None."""
    manifest = root / SHARD_MANIFEST
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            data = None
        if isinstance(data, dict) and data.get("kind") == "ep-shards":
            return f"EP {data.get('ep')}, finished"
    ranks = sorted(m.group(2) for p in root.iterdir() if p.is_dir() and (m := RANK_DIR_RE.fullmatch(p.name)))
    if ranks:
        return f"EP {int(ranks[0])}, unfinished: no {SHARD_MANIFEST}"
    return None


def refuse_shard_output(root: Path, config: dict | None = None) -> None:
    """Raise ShardOutputError when ``root`` is a shard root, or (its ``config.json`` given) one
    rank folder of ``moetool shard``, which a command reading a model must not take."""
    if config is None:
        summary = _shard_root_summary(root)
        if summary is not None:
            raise ShardOutputError(
                f"{root}: is the output of moetool shard ({summary}), not a model; "
                f"{SHARD_COMMANDS} take it", root)
        return
    ep = config.get("moetool_ep")
    if ep is None:
        return
    ep = ep if isinstance(ep, dict) else {}
    parent = root.parent if RANK_DIR_RE.fullmatch(root.name) else None
    where = f"rank {ep.get('rank')} of {ep.get('ep')}" if "rank" in ep and "ep" in ep else "one rank"
    raise ShardOutputError(
        f"{root}: is one rank folder ({where}) of a moetool shard output, not a model: it holds only that "
        f"rank's experts, renumbered from 0; {SHARD_COMMANDS} take the shard folder"
        + (f" ({parent})" if parent is not None else ""), parent or root, root)


def open_checkpoint(source: str | os.PathLike, revision: str | None = None, *,
                    ep_rank: bool = False) -> Checkpoint:
    """Resolve ``source`` and validate it completely; see module docstring for what is checked.

    A shard root or (unless ``ep_rank``: the readers of shards, and ``inspect``) one rank
    folder of ``moetool shard`` output is refused with a :class:`ShardOutputError`."""
    root = resolve_source(source, revision)
    names = sorted(p.name for p in root.iterdir() if p.is_file())
    st_files = [n for n in names if n.endswith(".safetensors")]
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if not st_files:
        if pickles:
            raise MoetoolError(
                f"{root / pickles[0]}: pickle checkpoints are refused (never loaded); convert the model to safetensors first"
            )
        refuse_shard_output(root)
        raise MoetoolError(f"{root}: no .safetensors files found")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise MoetoolError(f"{config_path}: not found (every checkpoint needs its config.json)")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MoetoolError(f"{config_path}: invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise MoetoolError(f"{config_path}: not a JSON object")
    if not ep_rank:
        refuse_shard_output(root, config)

    index_path = root / INDEX_NAME
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise MoetoolError(f"{index_path}: invalid index (needs a JSON object with a weight_map)") from None
        shard_names = sorted(set(weight_map.values()))
        for shard in shard_names:
            _check_relative(shard, str(index_path))
            if not (root / shard).is_file():
                raise MoetoolError(f"{root / shard}: shard named in {INDEX_NAME} is missing")
        for extra in sorted(set(st_files) - set(shard_names)):
            raise MoetoolError(f"{root / extra}: shard is not listed in {INDEX_NAME}")
    elif len(st_files) > 1 and SINGLE_NAME in st_files:
        raise MoetoolError(f"{root}: has {SINGLE_NAME} and other .safetensors files but no {INDEX_NAME}")
    else:
        shard_names = st_files

    tensors: dict[str, TensorInfo] = {}
    for shard in shard_names:
        _, infos, _ = read_safetensors_header(root / shard)
        for name, info in infos.items():
            if name in tensors:
                raise MoetoolError(f"{root / shard}: tensor {name} also stored in {tensors[name].file}")
            if weight_map is not None and weight_map.get(name) != shard:
                where = weight_map.get(name)
                raise MoetoolError(
                    f"{root / shard}: tensor {name} is not in {INDEX_NAME}" if where is None
                    else f"{root / shard}: tensor {name} is indexed under {where}"
                )
            tensors[name] = info
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in tensors:
                raise MoetoolError(f"{root / shard}: tensor {name} is listed in {INDEX_NAME} but absent from its shard")
    return Checkpoint(root, config, dict(sorted(tensors.items())), list(shard_names))
