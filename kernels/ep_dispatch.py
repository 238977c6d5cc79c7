"""Expert-parallel dispatch bookkeeping: where each token goes, where its row sits in the send
buffer, and which of a received row's experts are local. Each step is one kernel (the torch
version of each is a dozen small ops, and at serving sizes the host time of launching them,
not the GPU, dominated the all2all dispatch), with a pure-torch reference beside it. Kernel
and reference agree exactly: the outputs are integers, and the packed rows are bytes made by
the same rounding (fp8 codes as ``quant.fp8_act_quant``, bf16 rounded to nearest even).

Letters: m = tokens routed by this rank, M = rows received, k = top-k, E = global experts,
W = most replicas of an expert, R = ranks, L = local slots. The route table (``RouteTable`` in
``moetool.verify.topology``): rank_tab / slot_tab int64 [E, W] (-1 padded), count_tab int64 [E];
a token at global position p that chose expert e uses replica ``p % count_tab[e]``.

1. :func:`route_tokens` topk_ids [m, k], token_index [m] -> order int64 [R, m] (index of token
   t among those sent to rank r, -1 = not sent), counts int64 [R] (tokens per destination rank,
   a token counted once per rank however many of its experts live there)
2. :func:`pack_rows`    x [m, H], ids, weights, token_index, order, counts -> the send rows
   (uint8 [P, B], rank-major, tokens ascending): each token quantized once (fp8 per 1 x group
   or per token) or cast, stored in the row of every destination with its ids, weights and global
   position; returns pos int64 [R, m] (row of (r, t), -1 = not sent)
3. :func:`local_slots`   received global ids [M, k], token_index [M], this rank -> local_ids
   int64 [M, k] (-1 = on another rank), expert_num_tokens int64 [L]
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moetool.errors import MoetoolError

from .common import (
    TOKEN_GROUP,
    PeerBuffers,
    act_scale_cols,
    check_device,
    check_rank,
    e4m3_rne,
    is_interpreted,
    round_to_bf16,
)
from .quant import fp8_act_quant_ref

_INTS = (torch.int32, torch.int64)
#: elements of the [tokens, k, ranks or slots] one-hot block a program holds at once
_ONEHOT_BUDGET = 4096


def _block_tokens(k_p2: int, n_p2: int) -> int:
    return max(1, _ONEHOT_BUDGET // (k_p2 * n_p2))


def _check_tables(rank_tab: torch.Tensor, slot_tab: torch.Tensor | None, count_tab: torch.Tensor) -> None:
    for name, t in (("rank_tab", rank_tab), ("slot_tab", slot_tab)):
        if t is not None and (t.dim() != 2 or t.dtype != torch.int64 or not t.is_contiguous()):
            raise MoetoolError(f"{name} must be contiguous int64 [E, W], got {t.dtype} {list(t.shape)}")
    if slot_tab is not None and slot_tab.shape != rank_tab.shape:  # both are read at rank_tab's [e, w]
        raise MoetoolError(f"slot_tab {list(slot_tab.shape)} must have rank_tab's shape {list(rank_tab.shape)}")
    if (count_tab.dim() != 1 or count_tab.dtype != torch.int64 or count_tab.shape[0] != rank_tab.shape[0]
            or not count_tab.is_contiguous()):
        raise MoetoolError(f"count_tab must be contiguous int64 [E] = [{rank_tab.shape[0]}], got {count_tab.dtype} "
                           f"{list(count_tab.shape)}")


def _check_ids(ids: torch.Tensor, token_index: torch.Tensor) -> None:
    if ids.dim() != 2 or ids.dtype not in _INTS or ids.stride(1) != 1:
        raise MoetoolError(f"topk ids must be int32/int64 [n, k] with contiguous rows, got {ids.dtype} "
                           f"{list(ids.shape)}")
    if token_index.dim() != 1 or token_index.dtype != torch.int64 or token_index.shape[0] != ids.shape[0]:
        raise MoetoolError(f"token_index must be int64 [{ids.shape[0]}], got {token_index.dtype} "
                           f"{list(token_index.shape)}")


# ---------------------------------------------------------------------------------------------
# 1. tokens per destination rank, and each token's place among them
# ---------------------------------------------------------------------------------------------


@triton.jit
def _replica(ids_ptr, tok_ptr, count_ptr, t, j, valid, n, W, stride_ids, stride_tok):
    """Index into the [E, W] route tables of the replica each (token t, choice j) uses:
    e * W + position % count[e] ([BT, KP2] int64; 0 where not ``valid``)."""
    e = tl.load(ids_ptr + t[:, None].to(tl.int64) * stride_ids + j[None, :], mask=valid, other=0).to(tl.int64)
    tok = tl.load(tok_ptr + t.to(tl.int64) * stride_tok, mask=t < n, other=0)
    return e * W + tok[:, None] % tl.load(count_ptr + e, mask=valid, other=1)


@triton.jit
def _route_tokens_kernel(ids_ptr, tok_ptr, rank_ptr, count_ptr, order_ptr, counts_ptr, peer_counts_ptr,
                         m, k, W, me, stride_ids, stride_tok,
                         BLOCK_T: tl.constexpr, K_P2: tl.constexpr, TO_PEERS: tl.constexpr):
    """Program r: one pass over the tokens, a running count of those that go to rank r; with
    TO_PEERS the count is also stored at [me] of rank r's copy of the received-counts buffer."""
    r = tl.program_id(0)
    j = tl.arange(0, K_P2)
    running = tl.zeros((), dtype=tl.int64)
    for t0 in range(0, m, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        valid = (t[:, None] < m) & (j[None, :] < k)
        at = _replica(ids_ptr, tok_ptr, count_ptr, t, j, valid, m, W, stride_ids, stride_tok)
        dest = tl.load(rank_ptr + at, mask=valid, other=-1)  # [BT, KP2]
        hit = tl.max((dest == r).to(tl.int32), axis=1)  # [BT]
        order = running + tl.cumsum(hit, axis=0).to(tl.int64) - 1
        tl.store(order_ptr + r.to(tl.int64) * m + t, tl.where(hit > 0, order, -1), mask=t < m)
        running += tl.sum(hit, axis=0).to(tl.int64)
    tl.store(counts_ptr + r, running)
    if TO_PEERS:
        tl.store(tl.load(peer_counts_ptr + r).to(tl.pointer_type(tl.int64)) + me, running)


@triton.jit
def _route_hits_kernel(ids_ptr, tok_ptr, rank_ptr, count_ptr, hits_ptr, block_sums_ptr, m, k, W, R, n_blocks,
                       stride_ids, stride_tok, BLOCK_T: tl.constexpr, K_P2: tl.constexpr):
    """Program b (several-block chunks, pass 1): for token block b, hits[r, t] = 1 if token t
    goes to rank r else 0 (into the order buffer, which pass 2 overwrites), and the block's
    number of such tokens per rank into block_sums[r, b]."""
    b = tl.program_id(0)
    t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, K_P2)
    valid = (t[:, None] < m) & (j[None, :] < k)
    at = _replica(ids_ptr, tok_ptr, count_ptr, t, j, valid, m, W, stride_ids, stride_tok)
    dest = tl.load(rank_ptr + at, mask=valid, other=-1)  # [BT, KP2]: the dependent loads, once
    for r in range(R):
        hit = tl.max((dest == r).to(tl.int64), axis=1)  # [BT]
        tl.store(hits_ptr + r * m + t, hit, mask=t < m)  # R * m stays far below 2**31
        tl.store(block_sums_ptr + r * n_blocks + b, tl.sum(hit, axis=0))


@triton.jit
def _route_order_kernel(order_ptr, block_sums_ptr, counts_ptr, peer_counts_ptr, m, n_blocks, me,
                        BLOCK_T: tl.constexpr, NB_P2: tl.constexpr, TO_PEERS: tl.constexpr):
    """Program (b, r) (pass 2): the hits of block b become each token's index among those sent
    to rank r (the earlier blocks' sums, then a scan); the last block also writes the count."""
    b = tl.program_id(0)
    r = tl.program_id(1)
    nb = tl.arange(0, NB_P2)
    before = tl.sum(tl.load(block_sums_ptr + r * n_blocks + nb, mask=nb < b, other=0), axis=0)
    t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    row = order_ptr + r.to(tl.int64) * m + t
    hit = tl.load(row, mask=t < m, other=0)
    order = before + tl.cumsum(hit, axis=0) - 1
    tl.store(row, tl.where(hit > 0, order, -1), mask=t < m)
    if b == n_blocks - 1:
        total = before + tl.sum(hit, axis=0)
        tl.store(counts_ptr + r, total)
        if TO_PEERS:
            tl.store(tl.load(peer_counts_ptr + r).to(tl.pointer_type(tl.int64)) + me, total)


def route_tokens(topk_ids: torch.Tensor, token_index: torch.Tensor, rank_tab: torch.Tensor,
                 count_tab: torch.Tensor, counts: torch.Tensor, peer_counts: PeerBuffers | None = None,
                 me: int = 0, block_elements: int = 4096) -> torch.Tensor:
    """topk_ids int [m, k] (global experts), token_index int64 [m] -> order int64 [R, m]: the
    index of token t among the tokens sent to rank r (ascending), -1 = none of its experts'
    replicas is on r. Writes the tokens per rank into ``counts`` (int64 [R], contiguous; a
    token counts once per rank however many of its experts live there). Only this rank's
    data is needed, so the send rows can be filled while the counts travel. Ids must lie in
    [0, E); they are not checked on the device.

    ``peer_counts`` (int64 [R] on every rank, see :class:`PeerBuffers`): each count is also
    stored at [me] of the destination rank's copy, so after a barrier rank r holds the rows
    every rank sends it, with no collective.

    ``block_elements``: [tokens, k] elements per program (a tuning knob; any value gives the
    same result)."""
    _check_ids(topk_ids, token_index)
    _check_tables(rank_tab, None, count_tab)
    _check_counts(counts)
    m, k = topk_ids.shape
    R = counts.shape[0]
    _check_peers("route_tokens: peer_counts", peer_counts, R, (R,), torch.int64, me)
    order = torch.empty(R, m, dtype=torch.int64, device=topk_ids.device)
    check_device(_route_tokens_kernel, topk_ids, token_index, rank_tab, count_tab, counts,
                 *([] if peer_counts is None else [peer_counts.addresses]))
    if not R:
        return order
    k_p2 = triton.next_power_of_2(max(k, 1))
    bt = min(triton.next_power_of_2(max(m, 16)), triton.next_power_of_2(max(16, block_elements // k_p2)))
    n_blocks = triton.cdiv(m, bt)
    peers = counts if peer_counts is None else peer_counts.addresses
    warps = max(4, min(16, bt * k_p2 // 1024))
    if n_blocks <= 1:  # one block: one program per rank, one pass
        _route_tokens_kernel[(R,)](
            topk_ids, token_index, rank_tab, count_tab, order, counts, peers, m, k, rank_tab.shape[1], me,
            topk_ids.stride(0), token_index.stride(0), BLOCK_T=bt, K_P2=k_p2, TO_PEERS=peer_counts is not None,
            num_warps=warps)
        return order
    # several blocks: a running count over them would be a chain of dependent loads per block in
    # one program per rank; instead every block finds its hits, then every (block, rank) scans
    # its hits after the earlier blocks' sums
    block_sums = torch.empty(R, n_blocks, dtype=torch.int64, device=topk_ids.device)
    _route_hits_kernel[(n_blocks,)](
        topk_ids, token_index, rank_tab, count_tab, order, block_sums, m, k, rank_tab.shape[1], R, n_blocks,
        topk_ids.stride(0), token_index.stride(0), BLOCK_T=bt, K_P2=k_p2, num_warps=warps)
    _route_order_kernel[(n_blocks, R)](
        order, block_sums, counts, peers, m, n_blocks, me, BLOCK_T=bt,
        NB_P2=triton.next_power_of_2(n_blocks), TO_PEERS=peer_counts is not None, num_warps=4)
    return order


def route_tokens_ref(topk_ids, token_index, rank_tab, count_tab, counts, peer_counts=None, me=0, block_elements=4096):
    """Reference of :func:`route_tokens` (same arguments)."""
    _check_ids(topk_ids, token_index)
    _check_tables(rank_tab, None, count_tab)
    _check_counts(counts)
    R = counts.shape[0]
    _check_peers("route_tokens: peer_counts", peer_counts, R, (R,), torch.int64, me)
    ids = topk_ids.long()
    dest = rank_tab[ids, token_index[:, None] % count_tab[ids]]  # [m, k]
    sent = (dest[None, :, :] == torch.arange(R, device=ids.device)[:, None, None]).any(dim=2)  # [R, m]
    counts.copy_(sent.sum(dim=1))
    for r in range(R if peer_counts is not None else 0):
        peer_counts.views[r][me] = counts[r]
    # the scan runs along the last, contiguous dim (along dim 0 of [m, R] it is ~10x slower on CUDA)
    return torch.where(sent, torch.cumsum(sent, 1) - 1, -1)


def _check_counts(counts: torch.Tensor) -> None:
    if counts.dim() != 1 or counts.dtype != torch.int64 or not counts.is_contiguous():
        raise MoetoolError(f"counts must be contiguous int64 [R], got {counts.dtype} {list(counts.shape)}")


def _check_peers(what: str, peers: PeerBuffers | None, R: int, shape: tuple, dtype: torch.dtype, me: int) -> None:
    if peers is None:
        return
    v = peers.views[0]
    if len(peers) != R or tuple(v.shape) != tuple(shape) or v.dtype != dtype:
        raise MoetoolError(f"{what} must be {R} peer buffers {dtype} {list(shape)}, got {len(peers)} x "
                           f"{v.dtype} {list(v.shape)}")
    check_rank(what, me, R)


# ---------------------------------------------------------------------------------------------
# 2. the send rows: payload (fp8 codes + scales, or the wire dtype), ids, weights, position
# ---------------------------------------------------------------------------------------------


class RowOffsets(NamedTuple):
    """Byte offsets of the parts of a send row (hidden always starts at byte 0); each part
    starts at a multiple of its element size. ``scale`` is None when rows are not quantized.
    Any 4-tuple in this order is accepted."""

    scale: int | None  # float32 [G]
    ids: int  # int32 [k]
    weights: int  # float32 [k]
    token: int  # int64 [1]


PACK_DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _pack_rows_kernel(x_ptr, ids_ptr, w_ptr, tok_ptr, order_ptr, counts_ptr, pos_ptr, out_ptr,
                      H, k, R, m, me, cap, stride_x, stride_ids, stride_w, stride_tok,
                      B: tl.constexpr, SCALE_OFF: tl.constexpr, IDS_OFF: tl.constexpr, W_OFF: tl.constexpr,
                      TOK_OFF: tl.constexpr, HID_KIND: tl.constexpr,
                      GROUP: tl.constexpr, NG: tl.constexpr, K_P2: tl.constexpr, TO_PEERS: tl.constexpr,
                      PER_TOKEN: tl.constexpr, WHOLE_ROW: tl.constexpr):
    """Program (t, h-block of NG groups): quantize (or cast) x[t, block] once, store it into
    the send row of every rank t goes to (row = rows of the ranks before + order); the h-block 0
    program also stores the metadata and the row numbers (pos). PER_TOKEN: one fp8 scale for
    the row, stored by h-block 0 (GROUP x NG is then just the h-block; WHOLE_ROW: it holds the
    row, else each program of the row finds the amax in a pass over all of it first).
    With TO_PEERS, out_ptr holds int64 [R] addresses of every rank's receive buffer, and the row of (r, t) is row
    me * cap + order of rank r's buffer (pos = r * cap + order). out_ptr is the uint8 buffer;
    each part is addressed in bytes and cast to its type (one argument instead of a view per
    dtype: at serving sizes the host time of a launch is what the dispatch waits on).
    HID_KIND: 0 fp8 codes from integer math (uint8, interpreter), 1 fp8 (hardware cast), 2 bf16,
    3 fp16, 4 fp32."""
    t = tl.program_id(0)
    pid_h = tl.program_id(1)
    g = pid_h * NG + tl.arange(0, NG)  # [NG] group index
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [NG, GROUP]
    in_h = cols < H
    x = tl.load(x_ptr + t.to(tl.int64) * stride_x + cols, mask=in_h, other=0.0).to(tl.float32)
    s = tl.zeros((NG,), dtype=tl.float32)
    if HID_KIND <= 1:
        if PER_TOKEN:  # same formula as quant._fp8_token_quant_kernel
            if WHOLE_ROW:
                amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
            else:
                span = tl.arange(0, NG * GROUP)
                amax = tl.zeros((), dtype=tl.float32)
                for h0 in range(0, H, NG * GROUP):
                    xs = tl.load(x_ptr + t.to(tl.int64) * stride_x + h0 + span, mask=h0 + span < H, other=0.0)
                    amax = tl.maximum(amax, tl.max(tl.abs(xs.to(tl.float32)), axis=0))
            s_tok = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
            s = s + s_tok  # [NG], the one scale
            v = e4m3_rne(tl.clamp(tl.math.div_rn(x, s_tok), -448.0, 448.0), HID_KIND == 0)
        else:  # same formula as quant._fp8_quant_kernel (ROW_WISE)
            s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), 448.0)
            v = e4m3_rne(tl.clamp(tl.math.div_rn(x, s[:, None]), -448.0, 448.0), HID_KIND == 0)
    elif HID_KIND == 2:  # the interpreter's fp32 -> bf16 cast truncates; round first
        v = round_to_bf16(x).to(tl.bfloat16)
    elif HID_KIND == 3:
        v = x.to(tl.float16)
    else:
        v = x
    j = tl.arange(0, K_P2)
    ids = tl.load(ids_ptr + t.to(tl.int64) * stride_ids + j, mask=j < k, other=0).to(tl.int32)
    w = tl.load(w_ptr + t.to(tl.int64) * stride_w + j, mask=j < k, other=0.0).to(tl.float32)
    tok = tl.load(tok_ptr + t.to(tl.int64) * stride_tok)
    start = tl.zeros((), dtype=tl.int64)
    for r in range(R):
        o = tl.load(order_ptr + r * m + t)
        if TO_PEERS:
            p = tl.where(o >= 0, r * cap + o, -1)
            row = tl.load(out_ptr.to(tl.pointer_type(tl.int64)) + r).to(tl.pointer_type(tl.uint8)) + (me * cap + o) * B
        else:
            p = tl.where(o >= 0, start + o, -1)
            start += tl.load(counts_ptr + r)
            row = out_ptr + p * B
        if pid_h == 0:
            tl.store(pos_ptr + r * m + t, p)
        if p >= 0:
            tl.store(row.to(tl.pointer_type(v.dtype)) + cols, v, mask=in_h)
            if HID_KIND <= 1:
                if PER_TOKEN:
                    tl.store((row + SCALE_OFF).to(tl.pointer_type(tl.float32)) + g, s, mask=g == 0)
                else:
                    tl.store((row + SCALE_OFF).to(tl.pointer_type(tl.float32)) + g, s, mask=g * GROUP < H)
            if pid_h == 0:
                tl.store((row + IDS_OFF).to(tl.pointer_type(tl.int32)) + j, ids, mask=j < k)
                tl.store((row + W_OFF).to(tl.pointer_type(tl.float32)) + j, w, mask=j < k)
                tl.store((row + TOK_OFF).to(tl.pointer_type(tl.int64)), tok)


def _check_pack(x, topk_ids, topk_weights, token_index, order, counts, out, hidden_dtype, offsets, group,
                peers=None, me=0):
    offsets = RowOffsets(*offsets)
    m, H = x.shape if x.dim() == 2 else (-1, -1)
    if x.dim() != 2 or not x.is_floating_point() or x.stride(1) != 1 or H == 0:
        raise MoetoolError(f"pack_rows: x must be a float [m, H] with contiguous rows, got {x.dtype} {list(x.shape)}")
    _check_ids(topk_ids, token_index)
    k = topk_ids.shape[1]
    if topk_ids.shape[0] != m or tuple(topk_weights.shape) != (m, k) or topk_weights.stride(1) != 1:
        raise MoetoolError(f"pack_rows: topk ids / weights must be [{m}, k] with contiguous rows, got "
                           f"{list(topk_ids.shape)} / {list(topk_weights.shape)}")
    if order.dim() != 2 or order.dtype != torch.int64 or order.shape[1] != m or not order.is_contiguous():
        raise MoetoolError(f"pack_rows: order must be contiguous int64 [R, {m}], got {order.dtype} {list(order.shape)}")
    _check_counts(counts)
    if counts.shape[0] != order.shape[0]:
        raise MoetoolError(f"pack_rows: counts [{counts.shape[0]}] and order [{order.shape[0]}, m] disagree on R")
    if peers is not None:
        R = order.shape[0]
        if len(peers) != R:
            raise MoetoolError(f"pack_rows: {len(peers)} peer buffers for {R} ranks")
        out = peers.views[0]
        if out.shape[0] % R or out.shape[0] // R < m:
            raise MoetoolError(f"pack_rows: peer receive buffers [{out.shape[0]}, B] must hold {R} regions "
                               f"of at least {m} rows")
        check_rank("pack_rows", me, R)
    if out.dim() != 2 or out.dtype != torch.uint8 or not out.is_contiguous() or out.shape[1] % 16:
        raise MoetoolError(f"pack_rows: out must be contiguous uint8 [rows, B] with B a multiple of 16, got "
                           f"{out.dtype} {list(out.shape)}")
    if hidden_dtype not in PACK_DTYPES:
        raise MoetoolError(f"pack_rows: hidden dtype must be one of {PACK_DTYPES}, got {hidden_dtype}")
    quant = hidden_dtype == torch.float8_e4m3fn
    if quant != (offsets.scale is not None):
        raise MoetoolError("pack_rows: fp8 rows need a scale offset, other rows none")
    if group != TOKEN_GROUP and (group < 16 or group & (group - 1)):
        raise MoetoolError(f"pack_rows: the fp8 group must be a power of two >= 16 or TOKEN_GROUP (0), got {group}")
    G = act_scale_cols(H, group)
    spans = [(0, H * hidden_dtype.itemsize, 1), (offsets.ids, 4 * k, 4), (offsets.weights, 4 * k, 4),
             (offsets.token, 8, 8)] + ([(offsets.scale, 4 * G, 4)] if quant else [])
    if any(off < 0 or off % align or off + size > out.shape[1] for off, size, align in spans):
        raise MoetoolError(f"pack_rows: offsets {tuple(offsets)} do not fit rows of {out.shape[1]} bytes "
                           f"(H {H}, k {k}, dtype {hidden_dtype})")


def pack_rows(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, token_index: torch.Tensor,
              order: torch.Tensor, counts: torch.Tensor, out: torch.Tensor | PeerBuffers, hidden_dtype: torch.dtype,
              offsets: RowOffsets, group: int = 128, me: int = 0) -> torch.Tensor:
    """Fill the send rows, rank-major, tokens ascending -> pos int64 [R, m]: the row of out
    that holds token t for rank r (-1 = not sent), what the combine reads back by.

    x float [m, H] (row stride free), topk_ids int [m, k], topk_weights [m, k], token_index
    int64 [m], order int64 [R, m] and counts int64 [R] (from :func:`route_tokens`), out uint8
    [rows, B] with rows >= counts.sum() (known on the device only, so size it for the worst
    case: m * min(k, R)). The row
    holds x as ``hidden_dtype`` at byte 0 (float8_e4m3fn: per-token 1 x ``group`` codes, the
    fp32 scales [ceil(H/group)] at ``offsets.scale``, or one scale per row for group =
    TOKEN_GROUP, bit-identical to ``quant.fp8_act_quant``), ids as int32,
    weights as fp32 and the token index as int64. Other bytes of out are left as they were.

    ``out`` may instead be :class:`PeerBuffers`: every rank's receive buffer uint8 [R * cap, B],
    one region of cap >= m rows per source rank. The row for rank r then goes straight into
    rank r's buffer, row me * cap + order[r, t] (no exchange of counts needed first), and pos
    is r * cap + order[r, t]: where the result comes back in a buffer of the same regions."""
    peers = out if isinstance(out, PeerBuffers) else None
    _check_pack(x, topk_ids, topk_weights, token_index, order, counts, None if peers else out, hidden_dtype,
                offsets, group, peers, me)
    offsets = RowOffsets(*offsets)
    if peers is not None:
        out, cap = peers.addresses, peers.views[0].shape[0] // order.shape[0]
        B = peers.views[0].shape[1]
    else:
        cap, B = 0, out.shape[1]
    check_device(_pack_rows_kernel, x, topk_ids, topk_weights, token_index, order, counts, out)
    m, H = x.shape
    R, k = order.shape[0], topk_ids.shape[1]
    pos = torch.empty(R, m, dtype=torch.int64, device=x.device)
    if not (m and R):
        return pos
    if hidden_dtype == torch.float8_e4m3fn:
        kind = 0 if is_interpreted(_pack_rows_kernel) else 1
    else:
        kind = {torch.bfloat16: 2, torch.float16: 3, torch.float32: 4}[hidden_dtype]
    per_token = group == TOKEN_GROUP
    if per_token:  # h-blocks of up to 8192 columns: one program holds a DeepSeek-V3 row (7168)
        group = min(128, max(16, triton.next_power_of_2(H)))
        ng = max(1, min(64, triton.next_power_of_2(-(-H // group))))
    else:
        ng = max(1, min(8, triton.next_power_of_2(-(-H // group))))
    h_blocks = triton.cdiv(H, group * ng)
    _pack_rows_kernel[(m, h_blocks)](
        x, topk_ids, topk_weights, token_index, order, counts, pos, out, H, k, R, m, me, cap,
        x.stride(0), topk_ids.stride(0), topk_weights.stride(0), token_index.stride(0),
        B=B, SCALE_OFF=offsets.scale or 0, IDS_OFF=offsets.ids, W_OFF=offsets.weights,
        TOK_OFF=offsets.token, HID_KIND=kind, GROUP=group, NG=ng, K_P2=triton.next_power_of_2(max(k, 1)),
        TO_PEERS=peers is not None, PER_TOKEN=per_token, WHOLE_ROW=h_blocks == 1, num_warps=8 if group * ng >= 4096 else 4)
    return pos


def pack_rows_ref(x, topk_ids, topk_weights, token_index, order, counts, out, hidden_dtype, offsets, group=128,
                  me=0):
    """Reference of :func:`pack_rows` (same arguments)."""
    peers = out if isinstance(out, PeerBuffers) else None
    _check_pack(x, topk_ids, topk_weights, token_index, order, counts, None if peers else out, hidden_dtype,
                offsets, group, peers, me)
    if peers is not None:
        cap = peers.views[0].shape[0] // order.shape[0]
        pos = torch.where(order >= 0, order + cap * torch.arange(order.shape[0], device=order.device)[:, None], -1)
        dest = [(peers.views[r], order[r] + me * cap) for r in range(order.shape[0])]
    else:
        pos = torch.where(order >= 0, order + (torch.cumsum(counts, 0) - counts)[:, None], -1)
        dest = [(out, pos[r]) for r in range(order.shape[0])]
    offsets = RowOffsets(*offsets)
    m, H = x.shape
    k = topk_ids.shape[1]
    parts = [(0, hidden_dtype, H)]
    if hidden_dtype == torch.float8_e4m3fn:
        q, s = fp8_act_quant_ref(x, group)
        values = [q, s]
        parts.append((offsets.scale, torch.float32, s.shape[1]))
    else:
        values = [x.to(hidden_dtype)]
    values += [topk_ids.to(torch.int32), topk_weights.float(), token_index[:, None]]
    parts += [(offsets.ids, torch.int32, k), (offsets.weights, torch.float32, k), (offsets.token, torch.int64, 1)]
    for r, (buf, row) in enumerate(dest):
        sel = pos[r] >= 0
        rows = row[sel]
        for (off, dtype, cols), v in zip(parts, values):
            buf[rows, off:off + cols * dtype.itemsize] = v[sel].contiguous().view(torch.uint8)
    return pos


# ---------------------------------------------------------------------------------------------
# 3. which of a received row's experts this rank computes
# ---------------------------------------------------------------------------------------------


@triton.jit
def _local_slots_kernel(ids_ptr, tok_ptr, rank_ptr, slot_ptr, count_ptr, out_ptr, counts_ptr, rows_ptr,
                        M, k, L, W, me, cap, stride_ids, stride_tok, n_blocks, n_programs,
                        BLOCK_T: tl.constexpr, K_P2: tl.constexpr, L_P2: tl.constexpr, REGIONS: tl.constexpr):
    """Program p: token blocks p, p + n_programs, ...; their per-slot counts are summed here
    and added to counts once (one atomic per slot and program, not per block).
    REGIONS: the rows are regions of ``cap`` rows, region s holding rows_ptr[s] valid rows
    first; the rest (stale bytes) get local ids -1 and their ids are not read."""
    j = tl.arange(0, K_P2)
    slots = tl.arange(0, L_P2)
    per_slot = tl.zeros((L_P2,), dtype=tl.int32)
    for blk in range(tl.program_id(0), n_blocks, n_programs):
        t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        inside = (t[:, None] < M) & (j[None, :] < k)
        valid = inside
        if REGIONS:
            filled = tl.load(rows_ptr + t // cap, mask=t < M, other=0)
            valid = valid & ((t % cap) < filled)[:, None]
        at = _replica(ids_ptr, tok_ptr, count_ptr, t, j, valid, M, W, stride_ids, stride_tok)
        r = tl.load(rank_ptr + at, mask=valid, other=-1)
        s = tl.load(slot_ptr + at, mask=valid, other=-1)
        local = tl.where(r == me, s, -1)  # [BT, KP2]
        tl.store(out_ptr + t[:, None].to(tl.int64) * k + j[None, :], local, mask=inside)
        hit = (local[:, :, None] == slots[None, None, :]).to(tl.int32)  # [BT, KP2, LP2]
        per_slot += tl.sum(tl.sum(hit, axis=1), axis=0)
    tl.atomic_add(counts_ptr + slots, per_slot.to(tl.int64), mask=slots < L)


def _check_regions(M: int, region_rows: torch.Tensor | None) -> None:
    if region_rows is None:
        return
    _check_counts(region_rows)
    if not region_rows.shape[0] or M % region_rows.shape[0]:
        raise MoetoolError(f"local_slots: {M} rows are not {region_rows.shape[0]} equal regions")


def local_slots(ids: torch.Tensor, token_index: torch.Tensor, rank_tab: torch.Tensor, slot_tab: torch.Tensor,
                count_tab: torch.Tensor, rank: int, num_slots: int,
                region_rows: torch.Tensor | None = None, max_programs: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """ids int [M, k] (global experts; rows may be strided views), token_index int64 [M] (may be
    strided) -> (local_ids int64 [M, k], expert_num_tokens int64 [L]).

    ``region_rows`` int64 [R]: the rows are R regions of M / R rows (one per source rank, as
    :func:`pack_rows` fills peer buffers) and only the first region_rows[s] rows of region s
    were sent; the others hold stale bytes, get local ids -1 and are not read.

    ``max_programs``: programs at most, each taking every max_programs-th token block (fewer
    atomic additions into the counts; any value gives the same result)."""
    _check_ids(ids, token_index)
    _check_tables(rank_tab, slot_tab, count_tab)
    M, k = ids.shape
    _check_regions(M, region_rows)
    dev = ids.device
    out = torch.empty(M, k, dtype=torch.int64, device=dev)
    counts = torch.zeros(num_slots, dtype=torch.int64, device=dev)
    check_device(_local_slots_kernel, ids, token_index, rank_tab, slot_tab, count_tab,
                 *([] if region_rows is None else [region_rows]))
    if M and k:
        k_p2, l_p2 = triton.next_power_of_2(k), triton.next_power_of_2(max(num_slots, 1))
        bt = _block_tokens(k_p2, l_p2)
        regions = region_rows is not None
        n_blocks = triton.cdiv(M, bt)
        n_programs = min(n_blocks, max_programs)
        _local_slots_kernel[(n_programs,)](
            ids, token_index, rank_tab, slot_tab, count_tab, out, counts, region_rows if regions else counts,
            M, k, num_slots, rank_tab.shape[1], rank, M // region_rows.shape[0] if regions else M,
            ids.stride(0), token_index.stride(0), n_blocks, n_programs,
            BLOCK_T=bt, K_P2=k_p2, L_P2=l_p2, REGIONS=regions)
    return out, counts


def local_slots_ref(ids, token_index, rank_tab, slot_tab, count_tab, rank, num_slots, region_rows=None,
                    max_programs=256):
    """Reference of :func:`local_slots` (same arguments)."""
    _check_ids(ids, token_index)
    _check_tables(rank_tab, slot_tab, count_tab)
    M = ids.shape[0]
    filled = torch.ones(M, dtype=torch.bool, device=ids.device)
    _check_regions(M, region_rows)
    if region_rows is not None:
        cap = M // region_rows.shape[0]
        row = torch.arange(M, device=ids.device)
        filled = row % cap < region_rows[row // cap]
    e = torch.where(filled[:, None], ids.long(), 0)
    choice = torch.where(filled, token_index, 0)[:, None] % count_tab[e]
    local = torch.where(filled[:, None] & (rank_tab[e, choice] == rank), slot_tab[e, choice], -1)  # [M, k]
    counted = local[(local >= 0) & (local < num_slots)]
    return local, torch.bincount(counted, minlength=num_slots)
