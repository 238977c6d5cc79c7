"""Token rows on the wire: several parts side by side in one uint8 row (RowLayout), the
activations quantized before the send where the numerics say so (fp8 in 1x128 groups or per
token), and the all2all row (payload, ids, weights, position) that the EP kernels pack and read.

Letters: n = rows, m = tokens this rank routes, H = hidden, k = top-k, G = fp8 scales per row
(ceil(H/128) for 1x128 groups, 1 per token). ``act_group``: the fp8 group size (128, or
``TOKEN_GROUP`` = 0 for one scale per token), None for unquantized rows.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from moetool.kernels import quant
from moetool.verify.numerics import TOKEN_GROUP


@dataclass(frozen=True)
class RowLayout:
    """Several 2-D parts side by side in one uint8 row, so one collective carries tokens,
    scales, ids and weights together (gloo cannot send float8 either). Each part starts at a
    16-byte boundary, so reading a part back is a strided view of the received buffer, not a copy."""

    parts: tuple[tuple[torch.dtype, int], ...]  # (dtype, columns) of each part

    ALIGN: ClassVar[int] = 16

    @property
    def offsets(self) -> list[int]:
        out, off = [], 0
        for dtype, cols in self.parts:
            out.append(off)
            off += -(-cols * dtype.itemsize // self.ALIGN) * self.ALIGN
        return out + [off]

    @property
    def row_bytes(self) -> int:
        return self.offsets[-1]

    def pack(self, values: list[torch.Tensor]) -> torch.Tensor:
        """values[i] [n, cols_i] (any dtype castable to part i's) -> uint8 [n, row_bytes]."""
        n = values[0].shape[0]
        buf = torch.empty(n, self.row_bytes, dtype=torch.uint8, device=values[0].device)
        for view, v in zip(self.unpack(buf), values):
            view.copy_(v)
        return buf

    def unpack(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """uint8 [n, row_bytes] -> one strided view [n, cols_i] per part (dtype_i)."""
        offs = self.offsets
        return [buf[:, offs[i]:offs[i] + cols * dtype.itemsize].view(dtype)
                for i, (dtype, cols) in enumerate(self.parts)]


def scale_columns(H: int, act_group: int) -> int:
    """fp8 scales per row of H activations: one per group, one per token (``TOKEN_GROUP``)."""
    return 1 if act_group == TOKEN_GROUP else math.ceil(H / act_group)


def fp8_act_quant(x: torch.Tensor, act_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, H] -> (q float8_e4m3fn [m, H], s float32 [m, G]), x ~ q * s per group of the row:
    the Triton kernel on CUDA, its pure-torch reference elsewhere (moetool.kernels.quant)."""
    x = x.float().contiguous()
    if x.shape[0] == 0:
        return (torch.empty(0, x.shape[1], dtype=torch.float8_e4m3fn, device=x.device),
                torch.empty(0, scale_columns(x.shape[1], act_group), dtype=torch.float32, device=x.device))
    fn = quant.fp8_act_quant if x.is_cuda else quant.fp8_act_quant_ref
    q, s = fn(x, act_group)
    return q, s.float()


def payload(x: torch.Tensor, act_group: int | None, comm_dtype: torch.dtype) -> tuple[list[torch.Tensor], list]:
    """x [m, H] -> the parts to send (hidden, [scales]) and their (dtype, columns)."""
    if act_group is not None:
        q, s = fp8_act_quant(x, act_group)  # [m, H], [m, G]
        return [q, s], [(torch.float8_e4m3fn, q.shape[1]), (torch.float32, s.shape[1])]
    return [x], [(comm_dtype, x.shape[1])]


@functools.lru_cache(maxsize=64)
def token_rows(H: int, k: int, act_group: int | None, comm_dtype: torch.dtype) -> RowLayout:
    """The all2all row: payload (fp8 codes [H] + fp32 scales [G], or ``comm_dtype`` [H]),
    int32 global ids [k], fp32 weights [k], int64 global position [1]. Built once per
    arguments: the same object every chunk, cheap to key a CUDA graph on."""
    hidden = (((torch.float8_e4m3fn, H), (torch.float32, scale_columns(H, act_group))) if act_group is not None
              else ((comm_dtype, H),))
    return RowLayout(hidden + ((torch.int32, k), (torch.float32, k), (torch.int64, 1)))


def pack_format(layout: RowLayout, act_group: int | None) -> tuple[torch.dtype, tuple]:
    """pack_rows' hidden dtype and byte offsets (scale or None, ids, weights, position) for a
    ``token_rows`` layout."""
    quantized = act_group is not None
    return layout.parts[0][0], tuple(([layout.offsets[1]] if quantized else [None]) + layout.offsets[-4:-1])
