"""Expert-parallel combine: sum the rows each token got back from the ranks it was sent to.

Letters: P = rows received back (one per (token, destination rank) pair, in send order),
m = tokens this rank routed, H = hidden, R = ranks.

    out[t] = sum over r = 0..R-1 with pos[t, r] >= 0 of rows[pos[t, r]]      (fp32, r ascending)

The sum runs in fp32 from 0.0 in rank order, in both the kernel and its reference, so the two
agree bit for bit. The kernel writes fp32, or rounds once to bfloat16 (round to nearest even)
so the result can go straight into a bf16 collective buffer.

Where ranks map each other's buffers (:class:`~moetool.kernels.common.PeerBuffers`),
:func:`combine_from_peers` reads each token's rows where the experts of every rank left them
and sums them in one pass: the same sum, bit for bit, as sending the rows back first and then
:func:`combine_rows`. (Storing the results back into the senders' buffers and summing there,
two kernels, measured 0.63 ms against 0.39 on 2 H200s: docs/perf.md.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetool.errors import MoetoolError

from .common import PeerBuffers, check_device, check_rank, round_to_bf16

OUT_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _combine_kernel(rows_ptr, sources_ptr, pos_ptr, out_ptr, peers_ptr, H, stride_rows, cap, me, stride_pos_t,
                    stride_pos_r, stride_out, n_peers, row0,
                    R: tl.constexpr, BLOCK_H: tl.constexpr, OUT_BF16: tl.constexpr, TO_PEERS: tl.constexpr,
                    PULL: tl.constexpr):
    """Program (t, h-block): out[t, cols] = sum over valid r (pos[t, r] >= 0, r ascending, fp32
    from 0) of rows[pos[t, r], cols], or with PULL of sources[r][me * cap + pos[t, r] - r * cap, cols]
    (sources_ptr: the address table; rows_ptr then only gives their dtype). With TO_PEERS the
    sum goes to row row0 + t of each of the n_peers buffers at peers_ptr instead (out_ptr then
    only gives the dtype); bf16 out is rounded once, to nearest even."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for r in tl.static_range(R):
        p = tl.load(pos_ptr + t * stride_pos_t + r * stride_pos_r).to(tl.int64) + tl.zeros((BLOCK_H,), dtype=tl.int64)
        if PULL:
            src = tl.load(sources_ptr + r).to(tl.pointer_type(rows_ptr.dtype.element_ty))
            at = src + (p + (me - r) * cap) * H + cols
        else:
            at = rows_ptr + p * stride_rows + cols
        acc += tl.load(at, mask=in_h & (p >= 0), other=0.0).to(tl.float32)
    if OUT_BF16:
        v = round_to_bf16(acc).to(tl.bfloat16)
    else:
        v = acc
    if TO_PEERS:
        for q in range(n_peers):
            dst = tl.load(peers_ptr + q).to(tl.pointer_type(out_ptr.dtype.element_ty))
            tl.store(dst + (row0 + t).to(tl.int64) * H + cols, v, mask=in_h)
    else:
        tl.store(out_ptr + t.to(tl.int64) * stride_out + cols, v, mask=in_h)


# the one kernel under each public function's name (``_<name>_kernel``, what callers check
# for the Triton interpreter)
_combine_rows_kernel = _combine_from_peers_kernel = _combine_kernel


def _check_args(rows: torch.Tensor, pos: torch.Tensor, out: torch.Tensor | None) -> None:
    if rows.dim() != 2 or not rows.is_floating_point():
        raise MoetoolError(f"combine: rows must be a 2-D float tensor [P, H], got {rows.dtype} {list(rows.shape)}")
    if pos.dim() != 2 or pos.dtype not in (torch.int32, torch.int64):
        raise MoetoolError(f"combine: pos must be int32/int64 [m, R], got {pos.dtype} {list(pos.shape)}")
    if out is not None:
        if out.dtype not in OUT_DTYPES:
            raise MoetoolError(f"combine: out must be float32 or bfloat16, got {out.dtype}")
        if tuple(out.shape) != (pos.shape[0], rows.shape[1]) or out.stride(1) != 1:
            raise MoetoolError(f"combine: out must be [m, H] = [{pos.shape[0]}, {rows.shape[1]}] with "
                               f"contiguous rows, got {list(out.shape)}")


def _check_gather(pos: torch.Tensor, rows: torch.Tensor, out, peers: PeerBuffers, row0: int) -> None:
    v = peers.views[0]
    if out is not None:
        raise MoetoolError("combine: give out or peers, not both")
    if v.dim() != 2 or v.dtype not in OUT_DTYPES or v.shape[1] != rows.shape[1] or not 0 <= row0 <= v.shape[0] - pos.shape[0]:
        raise MoetoolError(f"combine: peer buffers {v.dtype} {list(v.shape)} cannot take {pos.shape[0]} rows of "
                           f"{rows.shape[1]} at row {row0}")


def combine_rows(rows: torch.Tensor, pos: torch.Tensor, out: torch.Tensor | None = None,
                 peers: PeerBuffers | None = None, row0: int = 0) -> torch.Tensor | None:
    """rows float [P, H] (contiguous rows), pos int [m, R] (any strides; -1 = token not sent to that rank)
    -> out [m, H]: float32 unless ``out`` (float32 or bfloat16, row stride free) is given.
    Positions must lie in [-1, P); they are not checked on the device.

    ``peers`` (instead of out): buffers [N, H] float32 or bfloat16 of several ranks (a tp
    group's all-gather targets); row t goes to row row0 + t of every one of them, and nothing
    is returned: the all-gather done by the stores themselves."""
    _check_args(rows, pos, out)
    if peers is not None:
        _check_gather(pos, rows, out, peers, row0)
        out = peers.views[0]
    elif out is None:
        out = torch.empty(pos.shape[0], rows.shape[1], dtype=torch.float32, device=rows.device)
    check_device(_combine_kernel, rows, pos, out, *([] if peers is None else [peers.addresses]))
    m, R = pos.shape
    H = rows.shape[1]
    if m and H:
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        block_h = min(1024, triton.next_power_of_2(H))
        _combine_kernel[(m, triton.cdiv(H, block_h))](
            rows, pos, pos, out, out if peers is None else peers.addresses, H, rows.stride(0), 0, 0, pos.stride(0),
            pos.stride(1), out.stride(0), 0 if peers is None else len(peers), row0,
            R=R, BLOCK_H=block_h, OUT_BF16=out.dtype == torch.bfloat16, TO_PEERS=peers is not None, PULL=False,
            num_warps=4,
        )
    return None if peers is not None else out


def combine_rows_ref(rows: torch.Tensor, pos: torch.Tensor, out: torch.Tensor | None = None,
                     peers: PeerBuffers | None = None, row0: int = 0) -> torch.Tensor | None:
    """Pure-torch reference of :func:`combine_rows` (same arguments, same summation order)."""
    _check_args(rows, pos, out)
    if peers is not None:
        _check_gather(pos, rows, out, peers, row0)
        v = peers.views[0]
        part = combine_rows_ref(rows, pos, torch.empty(pos.shape[0], rows.shape[1], dtype=v.dtype, device=v.device))
        for view in peers.views:
            view[row0:row0 + pos.shape[0]] = part
        return None
    m, R = pos.shape
    acc = torch.zeros(m, rows.shape[1], dtype=torch.float32, device=rows.device)
    for r in range(R):
        sel = pos[:, r] >= 0
        if bool(sel.any()):
            acc[sel] += rows[pos[sel, r]].float()
    if out is None:
        return acc
    out.copy_(acc)  # torch rounds to nearest even, as the kernel does
    return out


# ---------------------------------------------------------------------------------------------
# the sums read straight from the ranks' expert outputs, through mapped peer memory
# ---------------------------------------------------------------------------------------------


def _check_sources(sources: PeerBuffers, pos: torch.Tensor, me: int) -> int:
    R = len(sources)
    v = sources.views[0]
    if v.dim() != 2 or not v.is_floating_point() or v.shape[0] % max(R, 1):
        raise MoetoolError(f"combine_from_peers: sources must be R = {R} float buffers [R * cap, H], got "
                           f"{v.dtype} {list(v.shape)}")
    if pos.dim() != 2 or pos.dtype not in (torch.int32, torch.int64) or pos.shape[1] != R:
        raise MoetoolError(f"combine_from_peers: pos must be int32/int64 [m, {R}], got {pos.dtype} {list(pos.shape)}")
    check_rank("combine_from_peers", me, R)
    return v.shape[0] // R


def combine_from_peers(sources: PeerBuffers, pos: torch.Tensor, me: int, out: torch.Tensor | None = None,
                       peers: PeerBuffers | None = None, row0: int = 0) -> torch.Tensor | None:
    """sources: every rank's expert output [R * cap, H] float (region s = the rows rank s sent
    it, in order), pos int [m, R] (any strides): r * cap + j for the j-th row this rank sent to
    rank r, -1 = token not sent there, as :func:`~moetool.kernels.ep_dispatch.pack_rows`
    returns it (transposed) -> out[t] = sum over r of sources[r][me * cap + j], in rank order:
    what :func:`combine_rows` gives on the rows gathered back into this rank's layout, bit for
    bit, with the rows read where the experts wrote them. ``out`` and ``peers`` as in :func:`combine_rows`. Positions
    must lie in [-1, R * cap); they are not checked on the device."""
    cap = _check_sources(sources, pos, me)
    H = sources.views[0].shape[1]
    mine = sources.views[me]
    _check_args(mine, pos, out)
    if peers is not None:
        _check_gather(pos, mine, out, peers, row0)
        out = peers.views[0]
    elif out is None:
        out = torch.empty(pos.shape[0], H, dtype=torch.float32, device=mine.device)
    check_device(_combine_kernel, sources.addresses, pos, out, *([] if peers is None else [peers.addresses]))
    m, R = pos.shape
    if m and H:
        block_h = min(1024, triton.next_power_of_2(H))
        _combine_kernel[(m, triton.cdiv(H, block_h))](
            mine, sources.addresses, pos, out, out if peers is None else peers.addresses, H, mine.stride(0), cap, me,
            pos.stride(0), pos.stride(1), out.stride(0), 0 if peers is None else len(peers), row0,
            R=R, BLOCK_H=block_h, OUT_BF16=out.dtype == torch.bfloat16, TO_PEERS=peers is not None, PULL=True,
            num_warps=4,
        )
    return None if peers is not None else out


def combine_from_peers_ref(sources: PeerBuffers, pos: torch.Tensor, me: int, out: torch.Tensor | None = None,
                           peers: PeerBuffers | None = None, row0: int = 0) -> torch.Tensor | None:
    """Reference of :func:`combine_from_peers` (same arguments): the rows gathered into this
    rank's layout (region r = rank r's results for this rank), then :func:`combine_rows_ref`."""
    cap = _check_sources(sources, pos, me)
    back = torch.cat([v[me * cap:(me + 1) * cap] for v in sources.views])  # [R * cap, H]
    return combine_rows_ref(back, pos, out, peers, row0)
