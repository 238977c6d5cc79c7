"""Align token-slot pairs to the grouped GEMM's row blocks: sort them by expert and pad each
expert's run to BLOCK_M (step 1 of :func:`moetool.kernels.fused_moe.fused_experts`).

Letters: T = tokens, k = experts chosen per token, P = T*k token-slot pairs (pair p = token
p // k, slot p % k), E = local experts, BM = BLOCK_M, EM = padded pair capacity (a multiple of BM).

:func:`moe_align_block_size`  topk_ids [T, k] -> sorted_ids int32 [EM] (pairs by expert, each
expert's segment padded to BM with P), expert_ids int32 [EM/BM] (-1 = unused block),
num_post_pad int32 [1]. Pairs whose id is -1 (expert on another rank), or any other id outside
[0, E), are dropped.
:func:`moe_align_block_size_ref` is its plain-loop reference (bit-exact).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check, check_device


def align_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """EM: an upper bound of sum_e ceil(count_e / BM) * BM, rounded up to BM."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(padded, block_m) * block_m


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, sorted_ids_ptr, P, E, EM, fill_per_prog,
                        BLOCK_P: tl.constexpr, E_P2: tl.constexpr, FILL_BLOCK: tl.constexpr):
    """Program c: counts[c, e] = #pairs of expert e in chunk c (pairs [c*BLOCK_P, +BLOCK_P));
    also fills its share of sorted_ids [EM] with the padding value P."""
    c = tl.program_id(0)
    offs = c * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, E_P2)
    e = tl.load(ids_ptr + offs, mask=offs < P, other=-1)  # [BP]
    e = tl.where((e >= 0) & (e < E), e, -1)  # an id outside [0, E) is dropped as -1 is, never placed
    onehot = (e[:, None] == cols[None, :]).to(tl.int32)  # [BP, E_P2]; -1 matches nothing
    tl.store(counts_ptr + c * E_P2 + cols, tl.sum(onehot, axis=0))
    start = c * fill_per_prog
    for off in range(0, fill_per_prog, FILL_BLOCK):
        idx = off + tl.arange(0, FILL_BLOCK)
        tl.store(sorted_ids_ptr + start + idx, P + tl.zeros_like(idx), mask=(idx < fill_per_prog) & (start + idx < EM))


@triton.jit
def _align_scatter_kernel(ids_ptr, counts_ptr, base_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
                          P, E, num_chunks, num_blocks,
                          BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, E_P2: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK_B: tl.constexpr):
    """Program c places chunk c's pairs: dest = pad_start[e] + (#pairs of e in earlier chunks)
    + (#pairs of e earlier in this chunk). Program 0 also writes expert_ids and num_post_pad.
    base [num_chunks, E_P2] is scratch: each program's per-expert start, gathered per pair."""
    c = tl.program_id(0)
    cols = tl.arange(0, E_P2)
    total = tl.zeros([E_P2], dtype=tl.int32)
    before = tl.zeros([E_P2], dtype=tl.int32)
    for r0 in range(0, num_chunks, ROWS):
        r = r0 + tl.arange(0, ROWS)
        cnt = tl.load(counts_ptr + r[:, None] * E_P2 + cols[None, :], mask=(r < num_chunks)[:, None], other=0)
        total += tl.sum(cnt, axis=0)
        before += tl.sum(tl.where((r < c)[:, None], cnt, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_P2], 0 past E
    pad_end = tl.cumsum(padded, axis=0)
    tl.store(base_ptr + c * E_P2 + cols, pad_end - padded + before)
    tl.debug_barrier()  # the row is read back below by other threads of this program
    offs = c * BLOCK_P + tl.arange(0, BLOCK_P)
    valid = offs < P
    e = tl.load(ids_ptr + offs, mask=valid, other=-1)  # [BP]
    valid = valid & (e >= 0) & (e < E)
    e = tl.where(valid, e, -1)
    base = tl.load(base_ptr + c * E_P2 + e, mask=valid, other=0)
    # rank of pair i among this chunk's pairs of the same expert: #{j < i : e_j == e_i}
    j = tl.arange(0, BLOCK_P)
    same = (e[:, None] == e[None, :]) & (j[None, :] < j[:, None])  # [BP, BP]
    rank = tl.sum(same.to(tl.int32), axis=1)
    tl.store(sorted_ids_ptr + base + rank, offs.to(tl.int32), mask=valid)
    if c == 0:
        tl.store(num_post_pad_ptr, tl.sum(padded, axis=0))
        for b0 in range(0, num_blocks, BLOCK_B):
            blk = b0 + tl.arange(0, BLOCK_B)
            # owner of block b = number of experts whose padded run ends at or before it
            owner = tl.sum((pad_end[None, :] <= (blk * BLOCK_M)[:, None]).to(tl.int32), axis=1)
            tl.store(expert_ids_ptr + blk, tl.where(owner < E, owner, -1), mask=blk < num_blocks)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """topk_ids [T, k] (int32/int64 local ids, -1 = not on this rank; any id outside
    [0, num_experts) is dropped as -1 is), contiguous -> (sorted_ids int32 [EM], expert_ids
    int32 [EM/BM], num_post_pad int32 [1]).

    sorted_ids lists pair indices p = t*k + j grouped by expert (ascending e, then ascending p),
    each expert's run starting at a multiple of BM and padded with P = T*k; block b holds expert
    expert_ids[b] (-1 past the last used block). Two Triton launches over chunks of 128 pairs
    (count, then place), no host synchronisation.
    """
    check(topk_ids.dim() == 2 and topk_ids.is_contiguous(), "topk_ids must be [T, k], contiguous")
    check(topk_ids.dtype in (torch.int32, torch.int64), f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    check(block_m > 0 and block_m & (block_m - 1) == 0, f"block_m must be a power of two, got {block_m}")
    check(num_experts >= 0, f"num_experts must be >= 0, got {num_experts}")
    check_device(_align_count_kernel, topk_ids)
    dev = topk_ids.device
    P, E = topk_ids.numel(), num_experts
    EM = align_capacity(P, E, block_m)
    expert_ids = torch.full((EM // block_m,), -1, dtype=torch.int32, device=dev)
    num_post_pad = torch.zeros((1,), dtype=torch.int32, device=dev)
    if P == 0 or E == 0:
        return torch.full((EM,), P, dtype=torch.int32, device=dev), expert_ids, num_post_pad
    sorted_ids = torch.empty((EM,), dtype=torch.int32, device=dev)
    e_p2 = max(16, triton.next_power_of_2(E))
    block_p = max(16, min(128, triton.next_power_of_2(P)))
    num_chunks = triton.cdiv(P, block_p)
    warps = 8 if block_p * e_p2 >= 16384 else 4
    scratch = torch.empty((2, num_chunks, e_p2), dtype=torch.int32, device=dev)  # counts, bases
    fill = triton.cdiv(EM, num_chunks)
    _align_count_kernel[(num_chunks,)](topk_ids, scratch[0], sorted_ids, P, E, EM, fill,
                                       BLOCK_P=block_p, E_P2=e_p2, FILL_BLOCK=1024, num_warps=warps)
    _align_scatter_kernel[(num_chunks,)](
        topk_ids, scratch[0], scratch[1], sorted_ids, expert_ids, num_post_pad, P, E, num_chunks, EM // block_m,
        BLOCK_M=block_m, BLOCK_P=block_p, E_P2=e_p2, ROWS=max(1, min(16, 4096 // e_p2)),
        BLOCK_B=max(16, min(256, 8192 // e_p2)), num_warps=warps,
    )
    return sorted_ids, expert_ids, num_post_pad


def moe_align_block_size_ref(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """Plain-loop reference of :func:`moe_align_block_size` (same outputs, bit-exact)."""
    flat = topk_ids.reshape(-1).tolist()
    P = len(flat)
    EM = align_capacity(P, num_experts, block_m)
    sorted_ids = [P] * EM
    expert_ids = [-1] * (EM // block_m)
    pos = 0
    for e in range(num_experts):
        pairs = [p for p, x in enumerate(flat) if x == e]
        for i, p in enumerate(pairs):
            sorted_ids[pos + i] = p
        blocks = -(-len(pairs) // block_m)
        for b in range(blocks):
            expert_ids[pos // block_m + b] = e
        pos += blocks * block_m
    dev = topk_ids.device
    return (
        torch.tensor(sorted_ids, dtype=torch.int32, device=dev),
        torch.tensor(expert_ids, dtype=torch.int32, device=dev),
        torch.tensor([pos], dtype=torch.int32, device=dev),
    )
