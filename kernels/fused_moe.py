"""Grouped expert computation (vLLM ``fused_moe`` style) for one rank's local experts.

Letters: T = tokens, H = hidden size, N = expert intermediate size, E = local experts,
k = experts chosen per token, P = T*k token-slot pairs (pair p = token p // k, slot p % k),
BM = BLOCK_M, EM = padded pair capacity (a multiple of BM).

Pipeline of :func:`fused_experts` (each step a kernel with a torch reference beside it):

1. :func:`moe_align_block_size`  topk_ids [T, k] -> pairs sorted by expert, each expert's segment
   padded to BM: sorted_ids int32 [EM] (padding = P), expert_ids int32 [EM/BM] (-1 = unused
   block), num_post_pad int32 [1]. Pairs whose id is -1 (expert on another rank) are dropped.
2. grouped GEMM 1 (``_moe_gemm_kernel``): cache1[p] = w13[e] @ x[p // k]     [P, 2N]
3. :func:`silu_and_mul`: cache2[p] = silu(gate) * up                           [P, N]
   (fp8-block: quantized per 1x128 group to e4m3 + fp32 scales, DeepSeek style)
4. grouped GEMM 2: cache3[p] = w2[e] @ cache2[p] (* topk_weight[p])           [P, H] fp32
5. :func:`moe_sum`: out[t] = sum over slots j with id >= 0 of cache3[t*k + j]  [T, H] fp32

Weight formats (stacked, leading dim E; "logical" [R, C] is [2N, H] for w13, [H, N] for w2):
  dense        weight [E, R, C] float
  fp8-block    weight e4m3 [E, R, C]; weight_scale_inv fp32 [E, ceil(R/128), ceil(C/128)], for w13
               gate and up blocks stacked separately: [E, 2*ceil(N/128), ceil(H/128)]  (W8A8)
  fp8-channel  weight e4m3 [E, R, C]; weight_scale [E, R, 1]                         (W8A16)
  int4-group   weight_packed int32 [E, R, ceil(C/8)]; weight_scale [E, R, ceil(C/g)];
               weight_shape [E, 2] (not read); optional weight_zero_point int32
               [E, ceil(R/8), ceil(C/g)] packed along R (w13: over all 2N rows)       (W4A16)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moetool.errors import MoetoolError

from .common import check_device, e4m3_rne, is_interpreted, round_to_bf16
from .quant import fp8_act_quant, fp8_dequant_act_ref

FMT_CODES = {"dense": 0, "fp8-block": 1, "fp8-channel": 2, "int4-group": 3}
FP8_BLOCK = 128
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_FLOAT_ACTS = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------
# 1. align: sort token-slot pairs by expert, pad each expert's run to BLOCK_M
# ---------------------------------------------------------------------------------------------


def align_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """EM: an upper bound of sum_e ceil(count_e / BM) * BM, rounded up to BM."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(padded, block_m) * block_m


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, sorted_ids_ptr, P, EM, fill_per_prog,
                        BLOCK_P: tl.constexpr, E_P2: tl.constexpr, FILL_BLOCK: tl.constexpr):
    """Program c: counts[c, e] = #pairs of expert e in chunk c (pairs [c*BLOCK_P, +BLOCK_P));
    also fills its share of sorted_ids [EM] with the padding value P."""
    c = tl.program_id(0)
    offs = c * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, E_P2)
    e = tl.load(ids_ptr + offs, mask=offs < P, other=-1)  # [BP]
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
    valid = valid & (e >= 0)
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
    """topk_ids [T, k] (int32/int64 local ids, -1 = not on this rank, all < num_experts),
    contiguous -> (sorted_ids int32 [EM], expert_ids int32 [EM/BM], num_post_pad int32 [1]).

    sorted_ids lists pair indices p = t*k + j grouped by expert (ascending e, then ascending p),
    each expert's run starting at a multiple of BM and padded with P = T*k; block b holds expert
    expert_ids[b] (-1 past the last used block). Two Triton launches over chunks of 128 pairs
    (count, then place), no host synchronisation.
    """
    _check(topk_ids.dim() == 2 and topk_ids.is_contiguous(), "topk_ids must be [T, k], contiguous")
    _check(block_m > 0 and block_m & (block_m - 1) == 0, f"block_m must be a power of two, got {block_m}")
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
    _align_count_kernel[(num_chunks,)](topk_ids, scratch[0], sorted_ids, P, EM, fill,
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


# ---------------------------------------------------------------------------------------------
# 2./4. grouped GEMM: C[p] = B[expert of p's block] @ A[p // a_row_div]
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_k(ptrs, even_mask, mask, EVEN_K: tl.constexpr):
    """Load a tile whose K extent is whole (EVEN_K: only ``even_mask``, None = unmasked) or
    ragged (``mask``, zero fill)."""
    if EVEN_K:
        if even_mask is None:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=even_mask, other=0.0)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, b_zp_ptr, c_ptr, topk_weights_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
    N, K, EM, num_valid, a_row_div, split_n, split_nb, group_k,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_be, stride_bn, stride_bk,
    stride_se, stride_sn, stride_sk,
    stride_ze, stride_zn, stride_zk,
    stride_cm, stride_cn,
    FMT: tl.constexpr, HAS_ZP: tl.constexpr, GROUP_TILE: tl.constexpr, EVEN_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One program: BLOCK_M sorted pairs (one expert) x BLOCK_N output columns.

    A [rows, K] (row of pair p: p // a_row_div); B logical [E, N, K]; C [P, N].
    FMT 0 dense: B float, cast to DOT_DTYPE.
    FMT 1 fp8-block (W8A8): A, B e4m3; per 128-wide K block acc += (A@B) * a_s[m] * b_s[n];
          a_scale [rows, ceil(K/128)], b_scale rows: n // 128 below split_n, else
          split_nb + (n - split_n) // 128 (gate / up blocks stacked separately).
    FMT 2 fp8-channel (W8A16): B e4m3 cast to DOT_DTYPE, scale [E, N, 1] applied after the K loop.
    FMT 3 int4-group (W4A16): B int32 [E, N, ceil(K/8)] nibbles, scale [E, N, ceil(K/g)],
          zero points [E, ceil(N/8), ceil(K/g)] (HAS_ZP); tile dequantized as (q - z) * s.
          GROUP_TILE: g % BLOCK_K == 0, so scales / zero points are loaded once per K tile.
    EVEN_K: K % BLOCK_K == 0, no K masks. Weight rows are read modulo N (always in bounds, no
    N masks on weight loads); the extra columns are dropped by the masked store.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % num_in_group) % group_m)
    pid_n = (pid % num_in_group) // group_m

    if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)  # [BM] int32, P = padding
    m_mask = pair < num_valid
    pair64 = pair.to(tl.int64)
    a_rows = (pair // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    n_mask = offs_n < N
    offs_bn = offs_n % N  # weight rows, always in range: B loads need no N mask
    offs_bn64 = offs_bn.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert * stride_be
    if FMT == 1:  # fp8-block weight scale row of each output row (gate / up blocks apart)
        s_rows = tl.where(offs_bn < split_n, offs_bn // 128, split_nb + (offs_bn - split_n) // 128)
        bs_base = b_scale_ptr + expert * stride_se + s_rows.to(tl.int64) * stride_sn  # [BN]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k  # [BK]
        k_mask = kk < K
        a = _load_k(a_ptr + a_rows[:, None] * stride_am + kk[None, :] * stride_ak,
                    m_mask[:, None], m_mask[:, None] & k_mask[None, :], EVEN_K)  # [BM, BK]
        if FMT == 3:
            # one load per int32 word (contiguous along K), then 8 nibbles each: k = 8 * w + i
            kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK/8]
            words = _load_k(b_base + offs_bn64[None, :] * stride_bn + kw[:, None] * stride_bk,
                            None, (kw < tl.cdiv(K, 8))[:, None], EVEN_K)  # [BK/8, BN] int32
            shifts = tl.arange(0, 8) * 4
            q = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK/8, 8, BN]: q + 8
            q = tl.reshape(q, [BLOCK_K, BLOCK_N])  # padding nibbles past K give finite b, a = 0
            if GROUP_TILE:  # the K tile lies in one group: one scale / zero point per column
                grp = k0 // group_k
                s = tl.load(b_scale_ptr + expert * stride_se + offs_bn64 * stride_sn + grp * stride_sk)
                s = s.to(tl.float32)[None, :]
                if HAS_ZP:
                    zw = tl.load(b_zp_ptr + expert * stride_ze + (offs_bn64 // 8) * stride_zn + grp * stride_zk)
                    q = q - ((zw >> ((offs_bn % 8) * 4)) & 0xF)[None, :]  # (q + 8) - (z + 8)
                else:
                    q = q - 8
            else:
                grp = kk // group_k
                s = tl.load(
                    b_scale_ptr + expert * stride_se + offs_bn64[None, :] * stride_sn + grp[:, None] * stride_sk,
                    mask=k_mask[:, None], other=0.0,
                ).to(tl.float32)
                if HAS_ZP:
                    zw = tl.load(
                        b_zp_ptr + expert * stride_ze + (offs_bn64 // 8)[None, :] * stride_zn
                        + grp[:, None] * stride_zk,
                        mask=k_mask[:, None], other=0,
                    )
                    q = q - ((zw >> ((offs_bn % 8) * 4)[None, :]) & 0xF)
                else:
                    q = q - 8
            b = (q.to(tl.float32) * s).to(DOT_DTYPE)
            acc += tl.dot(a.to(DOT_DTYPE), b, input_precision=PREC)
        elif FMT == 1:
            b = _load_k(b_base + offs_bn64[None, :] * stride_bn + kk[:, None] * stride_bk,
                        None, k_mask[:, None], EVEN_K)  # [BK, BN] e4m3
            kb = k0 // 128
            a_s = tl.load(a_scale_ptr + a_rows * stride_asm + kb * stride_ask, mask=m_mask, other=0.0)
            b_s = tl.load(bs_base + kb * stride_sk)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            b = _load_k(b_base + offs_bn64[None, :] * stride_bn + kk[:, None] * stride_bk,
                        None, k_mask[:, None], EVEN_K)
            acc += tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=PREC)

    if FMT == 2:
        cs = tl.load(b_scale_ptr + expert * stride_se + offs_bn64 * stride_sn)
        acc = acc * cs.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        w = tl.load(topk_weights_ptr + pair64, mask=m_mask, other=0.0)
        acc = acc * w[:, None]
    tl.store(
        c_ptr + pair64[:, None] * stride_cm + offs_n.to(tl.int64)[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


@dataclass(frozen=True)
class MoeConfig:
    """Tile sizes of the grouped GEMMs (powers of two >= 16; fp8-block: 128 % block_k == 0)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


# Tiles per format for (pairs per expert <= 32, <= 256, more): the best of bench/kernels.py
# --sweep on an H100 (DeepSeek-V3 expert shapes H 7168, N 2048, 32 local experts, bf16
# activations, T 64 / 512 / 4096). (block_m, block_n, block_k, group_m, num_warps, num_stages)
_TILES = {
    "dense": ((16, 128, 128, 1, 4, 3), (128, 128, 64, 16, 8, 3), (128, 128, 64, 16, 8, 3)),
    "fp8-block": ((16, 64, 128, 1, 4, 3), (64, 128, 128, 8, 8, 3), (64, 128, 128, 8, 8, 3)),
    "fp8-channel": ((16, 64, 128, 1, 4, 4), (64, 64, 64, 8, 4, 4), (128, 128, 64, 16, 8, 3)),
    "int4-group": ((16, 64, 64, 1, 4, 3), (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 3)),
}


def default_config(fmt_name: str, pairs_per_expert: float, act_dtype: torch.dtype, interpreted: bool,
                   group_size: int = 128) -> MoeConfig:
    """Tiles from ``_TILES`` by pairs per expert (T*k/E: an upper bound, -1 pairs included, as
    counting the real ones would need a host sync). fp32 activations: 2 stages (shared memory).
    int4: block_k <= g when g is a power of two, so a K tile never straddles two groups."""
    if interpreted:  # small tiles: fewer wasted lanes in tiny tests
        return MoeConfig(16, 32, 128 if fmt_name == "fp8-block" else 32, 1, 4, 1)
    small, mid, large = _TILES[fmt_name]
    bm, bn, bk, gm, warps, stages = small if pairs_per_expert <= 32 else mid if pairs_per_expert <= 256 else large
    if act_dtype == torch.float32:
        stages = 2
        bm, bn = min(bm, 64), min(bn, 64)
    if fmt_name == "int4-group" and group_size >= 16 and group_size & (group_size - 1) == 0:
        bk = min(bk, group_size)
    return MoeConfig(bm, bn, bk, gm, warps, stages)


@dataclass
class _Weights:
    """One stacked linear, checked: logical [E, R, C] in format ``fmt``."""

    fmt: int
    main: torch.Tensor  # weight / weight_packed
    scale: torch.Tensor | None
    zp: torch.Tensor | None


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise MoetoolError(msg)


def _parse_weights(fmt_name: str, t: dict, name: str, E: int, R: int, C: int, group_size: int,
                   split_rows: int | None) -> _Weights:
    """Validate the stacked tensors of ``name`` (w13 / w2), logical [E, R, C]."""
    for key, v in t.items():
        _check(isinstance(v, torch.Tensor), f"{name}[{key!r}] is not a tensor")
        _check(key == "weight_shape" or v.is_contiguous(), f"{name}[{key!r}] must be contiguous")

    def need(key, shape, dtypes=None, floating=False):
        _check(key in t, f"{name} ({fmt_name}) is missing {key!r}")
        v = t[key]
        _check(tuple(v.shape) == tuple(shape), f"{name}[{key!r}] has shape {list(v.shape)}, expected {list(shape)}")
        if dtypes is not None:
            _check(v.dtype in dtypes, f"{name}[{key!r}] has dtype {v.dtype}, expected {dtypes}")
        if floating:
            _check(v.dtype in _FLOAT_ACTS, f"{name}[{key!r}] has dtype {v.dtype}, expected a float dtype")
        return v

    code = FMT_CODES[fmt_name]
    if fmt_name == "dense":
        return _Weights(code, need("weight", (E, R, C), floating=True), None, None)
    if fmt_name == "fp8-block":
        nb = triton.cdiv(C, FP8_BLOCK)
        rb = triton.cdiv(R, FP8_BLOCK) if split_rows is None else 2 * triton.cdiv(split_rows, FP8_BLOCK)
        w = need("weight", (E, R, C), [torch.float8_e4m3fn])
        return _Weights(code, w, need("weight_scale_inv", (E, rb, nb), [torch.float32]), None)
    if fmt_name == "fp8-channel":
        w = need("weight", (E, R, C), [torch.float8_e4m3fn])
        return _Weights(code, w, need("weight_scale", (E, R, 1), floating=True), None)
    # int4-group
    G = triton.cdiv(C, group_size)
    w = need("weight_packed", (E, R, triton.cdiv(C, 8)), [torch.int32])
    s = need("weight_scale", (E, R, G), floating=True)
    if "weight_shape" in t:
        _check(tuple(t["weight_shape"].shape) in ((E, 2), (2,)), f"{name}['weight_shape'] must be [E, 2]")
    zp = need("weight_zero_point", (E, triton.cdiv(R, 8), G), [torch.int32]) if "weight_zero_point" in t else None
    return _Weights(code, w, s, zp)


def _invoke_gemm(a, a_scale, wts: _Weights, c, topk_weights, sorted_ids, expert_ids, num_post_pad,
                 num_valid, a_row_div, split_n, mul_weight, group_size, cfg: MoeConfig):
    """C [P, R] = grouped GEMM of A rows with the experts' [R, C] weights (see the kernel)."""
    R = c.shape[1]
    K = a.shape[1]
    EM = sorted_ids.numel()
    main, scale = wts.main, wts.scale
    scale_ = scale if scale is not None else main
    zp_ = wts.zp if wts.zp is not None else main
    a_scale_ = a_scale if a_scale is not None else a
    if wts.fmt == 1:
        dot_dtype, prec = tl.float8e4nv, "ieee"
    else:
        dot_dtype = _TL_DTYPES[a.dtype]
        if dot_dtype == tl.bfloat16 and is_interpreted(_moe_gemm_kernel):
            dot_dtype = tl.float32  # the interpreter's bf16 tl.dot is wrong
        prec = "ieee" if dot_dtype == tl.float32 else "tf32"
    grid = (triton.cdiv(EM, cfg.block_m) * triton.cdiv(R, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a, a_scale_, main, scale_, zp_, c, topk_weights,
        sorted_ids, expert_ids, num_post_pad,
        R, K, EM, num_valid, a_row_div, split_n, triton.cdiv(split_n, FP8_BLOCK), group_size,
        a.stride(0), a.stride(1), a_scale_.stride(0), a_scale_.stride(-1),
        main.stride(0), main.stride(1), main.stride(2),
        scale_.stride(0), scale_.stride(1), scale_.stride(-1),
        zp_.stride(0), zp_.stride(1), zp_.stride(-1),
        c.stride(0), c.stride(1),
        FMT=wts.fmt, HAS_ZP=wts.zp is not None, GROUP_TILE=group_size % cfg.block_k == 0,
        EVEN_K=K % cfg.block_k == 0,
        MUL_WEIGHT=bool(mul_weight),
        DOT_DTYPE=dot_dtype, PREC=prec,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


# ---------------------------------------------------------------------------------------------
# 3. silu(gate) * up, optionally quantized to fp8 per 1x128 group
# ---------------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(
    x_ptr, y_ptr, ys_ptr, ids_ptr, M, N,
    stride_xm, stride_xn, stride_ym, stride_yn, stride_sm, stride_sn,
    HAS_IDS: tl.constexpr, QUANT_FP8: tl.constexpr, SOFT_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """x [M, 2N] (gate | up) -> y [M, N] = silu(gate) * up, computed in fp32.

    HAS_IDS: rows whose ids[row] < 0 are skipped (pairs never computed). QUANT_FP8: y is stored
    as e4m3 with scales ys [M, ceil(N/BLOCK_N)] (BLOCK_N = group), as ``fp8_act_quant``.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    if HAS_IDS:
        rmask = rmask & (tl.load(ids_ptr + rows, mask=rmask, other=-1) >= 0)
    mask = rmask[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    x_row = x_ptr + rows64[:, None] * stride_xm
    g = tl.load(x_row + cols[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + (cols + N)[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    y_ptrs = y_ptr + rows64[:, None] * stride_ym + cols[None, :] * stride_yn
    if QUANT_FP8:
        amax = tl.max(tl.abs(y), axis=1)
        s = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
        q = e4m3_rne(tl.clamp(tl.math.div_rn(y, s[:, None]), -448.0, 448.0), SOFT_FP8)
        tl.store(y_ptrs, q, mask=mask)
        tl.store(ys_ptr + rows64 * stride_sm + pid_n * stride_sn, s, mask=rmask)
    else:
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, row_ids: torch.Tensor | None = None, *, quant_fp8: bool = False,
                 out_dtype: torch.dtype | None = None, group: int = FP8_BLOCK, soft_fp8: bool | None = None):
    """x [M, 2N] float, contiguous -> silu(x[:, :N]) * x[:, N:] [M, N] (out_dtype, default x's).

    row_ids: optional int [M]; rows with a negative id are skipped (left unwritten).
    quant_fp8: returns (q e4m3 [M, N], s fp32 [M, ceil(N/group)]) instead, quantized like
    :func:`moetool.kernels.fp8_act_quant` from the fp32 product.
    """
    _check(x.dim() == 2 and x.is_contiguous(), "silu_and_mul: x must be 2-D and contiguous")
    _check(x.dtype in _FLOAT_ACTS, f"silu_and_mul: x has dtype {x.dtype}")
    _check(x.shape[1] % 2 == 0, f"silu_and_mul: x has an odd number of columns {x.shape[1]}")
    check_device(_silu_mul_kernel, x)
    M, N = x.shape[0], x.shape[1] // 2
    if row_ids is not None:
        _check(row_ids.numel() == M and row_ids.is_contiguous(), "silu_and_mul: row_ids must be [M], contiguous")
    dev = x.device
    if quant_fp8:
        y = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=dev)
        ys = torch.empty((M, triton.cdiv(N, group)), dtype=torch.float32, device=dev)
        block_n = group
    else:
        y = torch.empty((M, N), dtype=out_dtype or x.dtype, device=dev)
        ys = y
        block_n = min(1024, triton.next_power_of_2(max(N, 16)))
    if M and N:
        if soft_fp8 is None:
            soft_fp8 = is_interpreted(_silu_mul_kernel)
        y_arg = y.view(torch.uint8) if quant_fp8 and soft_fp8 else y
        block_m = max(1, min(64, 4096 // block_n))
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
        _silu_mul_kernel[grid](
            x, y_arg, ys, row_ids if row_ids is not None else x, M, N,
            x.stride(0), x.stride(1), y.stride(0), y.stride(1), ys.stride(0), ys.stride(1),
            HAS_IDS=row_ids is not None, QUANT_FP8=bool(quant_fp8), SOFT_FP8=bool(soft_fp8),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
        )
    return (y, ys) if quant_fp8 else y


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2N] -> fp32 [M, N] = silu(gate) * up."""
    gu = x.float()
    N = gu.shape[1] // 2
    return F.silu(gu[:, :N]) * gu[:, N:]


# ---------------------------------------------------------------------------------------------
# 5. weighted reduction over the k slots
# ---------------------------------------------------------------------------------------------


@triton.jit
def _moe_sum_kernel(c_ptr, ids_ptr, out_ptr, H, stride_cp, stride_ch, stride_ot, stride_oh,
                    TOPK: tl.constexpr, BLOCK_H: tl.constexpr, OUT_BF16: tl.constexpr):
    """out[t] = sum_j (ids[t, j] >= 0 ? c[t*TOPK + j] : 0), in slot order j = 0..TOPK-1, in fp32;
    OUT_BF16: rounded once to bfloat16 (nearest even) on the store."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        p = t * TOPK + j
        valid = tl.load(ids_ptr + p + tl.zeros_like(cols)) >= 0  # [BH], one id broadcast
        acc += tl.load(c_ptr + p * stride_cp + cols * stride_ch, mask=hmask & valid, other=0.0).to(tl.float32)
    if OUT_BF16:
        tl.store(out_ptr + t * stride_ot + cols * stride_oh, round_to_bf16(acc).to(tl.bfloat16), mask=hmask)
    else:
        tl.store(out_ptr + t * stride_ot + cols * stride_oh, acc, mask=hmask)


#: what moe_sum / fused_experts can write: fp32, or bf16 rounded once from the fp32 sum
OUT_DTYPES = (torch.float32, torch.bfloat16)


def moe_sum(c: torch.Tensor, topk_ids: torch.Tensor, out_dtype: torch.dtype = torch.float32,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """c [T*k, H] (rows of dropped pairs may hold anything), topk_ids [T, k] -> [T, H] out_dtype
    (fp32, or bf16 rounded from the fp32 sum), into ``out`` when given (out_dtype, [T, H])."""
    _check(out_dtype in OUT_DTYPES, f"moe_sum: out_dtype must be float32 or bfloat16, got {out_dtype}")
    _check(topk_ids.dim() == 2 and topk_ids.is_contiguous(), "moe_sum: topk_ids must be [T, k], contiguous")
    T, k = topk_ids.shape
    _check(c.dim() == 2 and c.shape[0] == T * k and c.is_contiguous(), "moe_sum: c must be [T*k, H], contiguous")
    H = c.shape[1]
    out = _check_out(out, T, H, out_dtype, c.device)
    check_device(_moe_sum_kernel, c, topk_ids, out)
    if T and H:
        if k == 0:
            return out.zero_()
        block_h = min(1024, triton.next_power_of_2(H))
        _moe_sum_kernel[(T, triton.cdiv(H, block_h))](
            c, topk_ids, out, H, c.stride(0), c.stride(1), out.stride(0), out.stride(1),
            TOPK=k, BLOCK_H=block_h, OUT_BF16=out_dtype == torch.bfloat16, num_warps=4,
        )
    return out


def _check_out(out: torch.Tensor | None, T: int, H: int, out_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``out`` checked against [T, H] out_dtype, or a new tensor."""
    if out is None:
        return torch.empty((T, H), dtype=out_dtype, device=device)
    _check(out.dtype == out_dtype and tuple(out.shape) == (T, H),
           f"out must be {out_dtype} [{T}, {H}], got {out.dtype} {list(out.shape)}")
    return out


def moe_sum_ref(c: torch.Tensor, topk_ids: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference of :func:`moe_sum` (same slot order, so bit-exact)."""
    T, k = topk_ids.shape
    c3 = torch.where((topk_ids >= 0)[:, :, None], c.view(T, k, -1).float(), 0.0)
    out = torch.zeros((T, c.shape[1]), dtype=torch.float32, device=c.device)
    for j in range(k):
        out += c3[:, j]
    return out.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# the whole expert computation
# ---------------------------------------------------------------------------------------------


def _check_common(hidden, w13, w2, fmt_name, topk_ids, topk_weights, hidden_scale, activation, apply_router_weight):
    _check(fmt_name in FMT_CODES, f"unknown weight format {fmt_name!r} (known: {', '.join(FMT_CODES)})")
    _check(activation == "silu", f"unsupported expert activation {activation!r} (only 'silu')")
    _check(hidden.dim() == 2, f"hidden must be [T, H], got shape {list(hidden.shape)}")
    _check(topk_ids.dim() == 2 and topk_ids.shape[0] == hidden.shape[0],
           f"topk_ids must be [T, k] with T = {hidden.shape[0]}, got {list(topk_ids.shape)}")
    _check(topk_ids.dtype in (torch.int32, torch.int64), f"topk_ids must be int32/int64, got {topk_ids.dtype}")
    if apply_router_weight:
        _check(topk_weights is not None and tuple(topk_weights.shape) == tuple(topk_ids.shape),
               "topk_weights must have the shape of topk_ids")
        _check(topk_weights.dtype == torch.float32, f"topk_weights must be float32, got {topk_weights.dtype}")
    main = "weight_packed" if fmt_name == "int4-group" else "weight"
    for name, t in (("w13", w13), ("w2", w2)):
        _check(isinstance(t, dict) and main in t, f"{name} ({fmt_name}) must be a dict holding {main!r}")
        _check(t[main].dim() == 3, f"{name}[{main!r}] must be 3-D [E, rows, cols]")
    if hidden.dtype == torch.float8_e4m3fn:
        _check(fmt_name == "fp8-block", f"fp8 hidden states need the fp8-block format, not {fmt_name}")
        T, H = hidden.shape
        _check(hidden_scale is not None and tuple(hidden_scale.shape) == (T, triton.cdiv(H, FP8_BLOCK))
               and hidden_scale.dtype == torch.float32,
               f"fp8 hidden needs hidden_scale float32 [T, ceil(H/128)] = [{T}, {triton.cdiv(H, FP8_BLOCK)}]")
    else:
        _check(hidden.dtype in _FLOAT_ACTS, f"hidden has dtype {hidden.dtype}, expected fp16/bf16/fp32/e4m3")
        _check(hidden_scale is None, "hidden_scale is only for float8_e4m3fn hidden states")
    E = w13[main].shape[0]
    two_n = w13[main].shape[1]
    _check(two_n % 2 == 0, f"w13 has an odd number of rows {two_n} (gate rows then up rows)")
    return E, two_n // 2


def fused_experts(
    hidden: torch.Tensor,
    w13: dict[str, torch.Tensor],
    w2: dict[str, torch.Tensor],
    fmt_name: str,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    hidden_scale: torch.Tensor | None = None,
    apply_router_weight: bool = True,
    group_size: int = 128,
    activation: str = "silu",
    config: MoeConfig | None = None,
    check_ids: bool = True,
    soft_fp8: bool | None = None,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One rank's routed experts with Triton kernels -> out [T, H] out_dtype (float32, or
    bfloat16 rounded once from the fp32 sum, e.g. for a bf16 combine); written into ``out``
    when given (out_dtype [T, H], rows may be strided), e.g. a buffer other ranks read.

    hidden [T, H] fp16/bf16/fp32, or float8_e4m3fn with hidden_scale fp32 [T, ceil(H/128)]
    (rows of hidden and hidden_scale may be strided, e.g. views into a received buffer)
    (fp8-block only; float hidden is quantized per 1x128 group here for fp8-block).
    w13 / w2: stacked tensors of ``fmt_name`` (module docstring), logical [E, 2N, H] / [E, H, N].
    topk_ids [T, k] int local expert slots, -1 = not on this rank (never computed, adds 0);
    topk_weights [T, k] fp32.
        out[t] = sum_{j: id >= 0} (topk_weights[t, j] if apply_router_weight else 1)
                 * w2[e] @ (silu(g) * u),  [g; u] = w13[e] @ hidden[t],  e = topk_ids[t, j]
    group_size: the int4 group g. config: tile sizes (default: :func:`default_config`).
    check_ids: raise if an id >= E (one host synchronisation).
    """
    E, N = _check_common(hidden, w13, w2, fmt_name, topk_ids, topk_weights, hidden_scale, activation,
                         apply_router_weight)
    T, H = hidden.shape
    k = topk_ids.shape[1]
    w13p = _parse_weights(fmt_name, w13, "w13", E, 2 * N, H, group_size, N)
    w2p = _parse_weights(fmt_name, w2, "w2", E, H, N, group_size, None)
    _check(hidden.stride(1) == 1 and topk_ids.is_contiguous(), "hidden needs contiguous rows and topk_ids must be contiguous")
    _check(out_dtype in OUT_DTYPES, f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if out is not None:
        _check_out(out, T, H, out_dtype, hidden.device)
    tensors = [hidden, topk_ids, w13p.main, w2p.main]
    if apply_router_weight:
        _check(topk_weights.is_contiguous(), "topk_weights must be contiguous")
        tensors.append(topk_weights)
    check_device(_moe_gemm_kernel, *tensors)
    dev = hidden.device
    if T == 0 or k == 0 or E == 0 or N == 0 or H == 0:
        return _check_out(out, T, H, out_dtype, dev).zero_()
    if check_ids:
        top = int(topk_ids.max())
        _check(top < E, f"topk_ids holds local expert {top} but only {E} experts are on this rank")

    P = T * k
    interpreted = is_interpreted(_moe_gemm_kernel)
    act_dtype = hidden.dtype if hidden.dtype in _FLOAT_ACTS else torch.bfloat16
    cfg = config or default_config(fmt_name, P / E, act_dtype, interpreted, group_size)
    _check(all(b >= 16 and b & (b - 1) == 0 for b in (cfg.block_m, cfg.block_n, cfg.block_k)),
           f"tile sizes must be powers of two >= 16: {cfg}")
    fp8 = fmt_name == "fp8-block"
    _check(not fp8 or FP8_BLOCK % cfg.block_k == 0, f"fp8-block needs block_k dividing 128: {cfg}")
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(topk_ids, cfg.block_m, E)
    weights = topk_weights if apply_router_weight else hidden

    a1, a1_scale = hidden, hidden_scale
    if fp8 and hidden.dtype != torch.float8_e4m3fn:
        a1, a1_scale = fp8_act_quant(hidden.contiguous(), FP8_BLOCK, soft_fp8=soft_fp8)
    cache1 = torch.empty((P, 2 * N), dtype=act_dtype, device=dev)
    _invoke_gemm(a1, a1_scale, w13p, cache1, weights, sorted_ids, expert_ids, num_post_pad,
                 P, k, N, False, group_size, cfg)
    row_ids = topk_ids.view(-1)
    if fp8:
        a2, a2_scale = silu_and_mul(cache1, row_ids, quant_fp8=True, soft_fp8=soft_fp8)
    else:
        a2, a2_scale = silu_and_mul(cache1, row_ids), None
    cache3 = torch.empty((P, H), dtype=torch.float32, device=dev)
    _invoke_gemm(a2, a2_scale, w2p, cache3, weights, sorted_ids, expert_ids, num_post_pad,
                 P, 1, H, apply_router_weight, group_size, cfg)
    return moe_sum(cache3, topk_ids, out_dtype, out)


def dequantize_stacked(fmt_name: str, t: dict[str, torch.Tensor], e: int, rows: int, cols: int,
                       group_size: int = 128, split_rows: int | None = None) -> torch.Tensor:
    """Expert e of stacked format tensors -> fp32 [rows, cols], through ``moetool.formats``
    (the one definition of each format's dequantization).

    split_rows: fp8-block w13, whose gate (first split_rows rows) and up blocks are scaled
    separately: each half is dequantized with its own ceil(split_rows/128) scale rows.
    """
    from moetool.formats import get_format

    one = {key: v[e] for key, v in t.items() if key != "weight_shape"}
    if fmt_name == "int4-group":
        fmt = get_format(fmt_name, group_size=group_size, symmetric="weight_zero_point" not in t)
        one["weight_shape"] = torch.tensor([rows, cols], dtype=torch.int32)
        return fmt.dequantize(one)
    fmt = get_format(fmt_name)
    if fmt_name == "fp8-block" and split_rows is not None:
        nb = triton.cdiv(split_rows, FP8_BLOCK)
        w, s = one["weight"], one["weight_scale_inv"]
        gate = fmt.dequantize({"weight": w[:split_rows], "weight_scale_inv": s[:nb]})
        up = fmt.dequantize({"weight": w[split_rows:], "weight_scale_inv": s[nb:]})
        return torch.cat([gate, up])
    return fmt.dequantize(one)


def fused_experts_ref(
    hidden: torch.Tensor,
    w13: dict[str, torch.Tensor],
    w2: dict[str, torch.Tensor],
    fmt_name: str,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    hidden_scale: torch.Tensor | None = None,
    apply_router_weight: bool = True,
    group_size: int = 128,
    activation: str = "silu",
) -> torch.Tensor:
    """Pure-torch reference of :func:`fused_experts` (same arguments) -> fp32 [T, H].

    Per local expert: gather its tokens, dequantize its weights to fp32 (``moetool.formats``),
    y = (silu(x w_gate^T) * (x w_up^T)) w2^T, all in fp32; fp8 hidden is dequantized with its
    scales. Unlike the kernels, float hidden is not quantized for fp8-block and the intermediate
    activation is not rounded (to act dtype / fp8): that difference is the kernels' error.
    """
    E, N = _check_common(hidden, w13, w2, fmt_name, topk_ids, topk_weights, hidden_scale, activation,
                         apply_router_weight)
    T, H = hidden.shape
    if hidden.dtype == torch.float8_e4m3fn:
        x = fp8_dequant_act_ref(hidden, hidden_scale, FP8_BLOCK)
    else:
        x = hidden.float()
    out = torch.zeros((T, H), dtype=torch.float32, device=hidden.device)
    for e in range(E):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        w13e = dequantize_stacked(fmt_name, w13, e, 2 * N, H, group_size, split_rows=N)  # [2N, H]
        w2e = dequantize_stacked(fmt_name, w2, e, H, N, group_size)  # [H, N]
        gu = x[tok] @ w13e.t()  # [t_e, 2N]
        y = (F.silu(gu[:, :N]) * gu[:, N:]) @ w2e.t()  # [t_e, H]
        if apply_router_weight:
            y = y * topk_weights[tok, slot].float()[:, None]
        out.index_add_(0, tok, y)
    return out
