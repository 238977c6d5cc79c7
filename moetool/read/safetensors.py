"""The safetensors format, both ways: dtype names, header parsing and checking (reading), the
header of a file to write (``TensorSpec``, ``safetensors_header``), zero-copy byte views.

Opening a checkpoint needs no torch: headers are checked with ``DTYPE_SIZES`` alone; ``DTYPES``
and ``DTYPE_NAMES`` map names to torch dtypes on first use.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moetool.errors import JSON_ERRORS, MoetoolError

if TYPE_CHECKING:
    import torch


MAX_HEADER_BYTES = 100 * 1024 * 1024


#: the largest dimension and element count a tensor may have (torch sizes are int64)
MAX_DIM = 2**63 - 1
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
    except JSON_ERRORS as e:
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
        if any(d > MAX_DIM for d in shape) or math.prod(max(d, 1) for d in shape) > MAX_DIM:
            raise MoetoolError(f"{path}: tensor {name} has shape {shape}: a dimension or the element count is past "
                               f"int64, as no tensor can be")
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


def pread_exactly(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill ``view`` from byte ``offset`` of the open file ``fd``; ``path`` names it in the error."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise MoetoolError(f"{path}: unexpected end of file at byte {offset + done} (file changed while reading?)")
        done += n


#: the metadata every safetensors file of a conversion carries in its header
SAFETENSORS_METADATA = {"format": "pt"}


@dataclass(frozen=True)
class TensorSpec:
    """An output tensor known before any data is computed."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def dtype_name(self) -> str:
        return __getattr__("DTYPE_NAMES")[self.dtype]

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
