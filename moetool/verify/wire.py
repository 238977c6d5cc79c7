"""Token rows on the wire: several parts side by side in one uint8 row (RowLayout), the
activations quantized before the send where the format allows it (fp8 1x128 groups), and the
all2all row (payload, ids, weights, position) that the EP kernels pack and read.

Letters: n = rows, m = tokens this rank routes, H = hidden, k = top-k, G = ceil(H/128).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from moetool.kernels import quant
from moetool.verify.experts import ACT_GROUP


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


def fp8_act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, H] -> (q float8_e4m3fn [m, H], s float32 [m, G]), x ~ q * s per 1x128 group:
    the Triton kernel on CUDA, its pure-torch reference elsewhere (moetool.kernels.quant)."""
    x = x.float().contiguous()
    if x.shape[0] == 0:
        return (torch.empty(0, x.shape[1], dtype=torch.float8_e4m3fn, device=x.device),
                torch.empty(0, math.ceil(x.shape[1] / ACT_GROUP), dtype=torch.float32, device=x.device))
    fn = quant.fp8_act_quant if x.is_cuda else quant.fp8_act_quant_ref
    q, s = fn(x, ACT_GROUP)
    return q, s.float()


def payload(x: torch.Tensor, act_quant: bool, comm_dtype: torch.dtype) -> tuple[list[torch.Tensor], list]:
    """x [m, H] -> the parts to send (hidden, [scales]) and their (dtype, columns)."""
    if act_quant:
        q, s = fp8_act_quant(x.float())  # [m, H], [m, G]
        return [q, s], [(torch.float8_e4m3fn, q.shape[1]), (torch.float32, s.shape[1])]
    return [x], [(comm_dtype, x.shape[1])]


@functools.lru_cache(maxsize=64)
def token_rows(H: int, k: int, act_quant: bool, comm_dtype: torch.dtype) -> RowLayout:
    """The all2all row: payload (fp8 codes [H] + fp32 scales [G], or ``comm_dtype`` [H]),
    int32 global ids [k], fp32 weights [k], int64 global position [1]. Built once per
    arguments: the same object every chunk, cheap to key a CUDA graph on."""
    hidden = (((torch.float8_e4m3fn, H), (torch.float32, math.ceil(H / ACT_GROUP))) if act_quant
              else ((comm_dtype, H),))
    return RowLayout(hidden + ((torch.int32, k), (torch.float32, k), (torch.int64, 1)))


def pack_format(layout: RowLayout, act_quant: bool) -> tuple[torch.dtype, tuple]:
    """pack_rows' hidden dtype and byte offsets (scale or None, ids, weights, position) for a
    ``token_rows`` layout."""
    return layout.parts[0][0], tuple(([layout.offsets[1]] if act_quant else [None]) + layout.offsets[-4:-1])
