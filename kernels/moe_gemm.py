"""The grouped expert GEMM (steps 2 and 4 of :func:`moetool.kernels.fused_moe.fused_experts`):
C[p] = B[expert of p's block] @ A[p // a_row_div] for the pairs sorted by
:func:`moetool.kernels.moe_align.moe_align_block_size`.

Letters: P = token-slot pairs, R x C = one expert's logical weight (out x in), K = C, E =
local experts, BM / BN / BK = tile sizes (:class:`moetool.kernels.moe_tiles.MoeConfig`).

:func:`moe_gemm` is the host wrapper (weights checked by
:func:`moetool.kernels.moe_weights.parse_weights`), :func:`moe_gemm_ref` its torch reference
on dequantized weights.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .common import FP8_BLOCK, TOKEN_GROUP, act_scale_cols, check, is_interpreted, round_to_bf16
from .fp4_quant import _e4m3_decode, _e8m0_decode
from .moe_silu import ROUND_CODE, round_to, swiglu
from .moe_tiles import MoeConfig
from .moe_weights import StackedWeights
from .quant import fp8_dequant_act_ref

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


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
def _e2m1_times_2_14(codes):
    """int32 e2m1 codes 0..15 -> float32 values / 2^14: sign, exponent and mantissa moved to an
    fp16's bits 15 and 9-11, whose value is exactly the code's over 2^14 (code 1, 0.5, becomes
    the fp16 subnormal 2^-15); the caller multiplies 2^14 into the group scale."""
    bits = ((codes & 0x8) << 12) | ((codes & 0x7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


#: int4 weights dequantized by packed 16-bit PTX (:func:`_int4_quads`); False: the same values by
#: Triton's scalar ops (tests compare the two bit for bit)
INT4_ASM = True
#: int4 tiles of one group (g % BLOCK_K == 0) and < 64 rows dot the codes and scale the fp32 product
#: (not the weights); H100, DeepSeek-V3 EP8: T=1 76.5 -> 66.1 us, T=16 1.00-1.24x, T=128 / 512 1.04 /
#: 1.05x; the 128-row tiles of T=4096 (wgmma, its product read out every K tile) 2.1x slower
INT4_CODES = True


def _quads_asm(fma: str, one: int, magic: int) -> tl.constexpr:
    """:func:`_int4_quads`' PTX for one 16-bit type: $4 two int16 (eight codes), $5 two 2^m + z,
    $6 two scales -> $0..$3 nibble n's (q - z) * s of both. lop3 0xEA = (a & b) | c."""
    lines = ["mov.b32 one, %#x;" % one, "mov.b32 nzero, 0x80008000;", "xor.b32 nz, $5, 0x80008000;",
             "shr.u32 t1, $4, 4;", "shr.u32 t2, $4, 8;", "shr.u32 t3, $4, 12;"]
    lines += [f"lop3.b32 ${n}, {src}, 0x000F000F, {magic * 0x10001:#x}, 0xEA;" for n, src in enumerate(("$4", "t1", "t2", "t3"))]
    lines += [f"{fma} ${n}, ${n}, one, nz;" for n in range(4)]  # 2^m + q - (2^m + z): exact
    lines += [f"{fma} ${n}, ${n}, $6, nzero;" for n in range(4)]  # times s, + (-0): the one rounding
    return tl.constexpr("{ .reg .b32 t1, t2, t3, nz, one, nzero; " + " ".join(lines) + " }")


_QUADS_BF16 = _quads_asm("fma.rn.bf16x2", 0x3F803F80, 0x4300)
_QUADS_F16 = _quads_asm("fma.rn.f16x2", 0x3C003C00, 0x6400)


@triton.jit
def _int4_quads(x, z, s, DOT_DTYPE: tl.constexpr, ASM: tl.constexpr):
    """int16 x, each four int4 codes (nibble n at bits 4n: K column 4j + n of element j, value
    q + 8), z int32 (what the code loses: the zero point + 8, or 8) and scale s (ASM: DOT_DTYPE)
    -> four DOT_DTYPE tensors, nibble n's (q_n - z) * s rounded once: the values of the plain
    int4 path ((q - z) in fp32 times s, cast).
    ASM (16-bit DOT_DTYPE, s stored in it): no int -> float conversions, which bound the plain
    path (Hopper converts 16 values per SM a clock): per two int16 (one 32-bit register, eight
    codes) three shifts, then per nibble pair one lop3 puts both codes into the mantissas of
    2^m + q (2^m: the power of two whose ulp is 1, bf16 128, fp16 1024), one packed fma
    subtracts 2^m + z exactly, one multiplies by s with the one rounding."""
    if ASM:
        if DOT_DTYPE == tl.bfloat16:
            zb = (z | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + z, exact
            return tl.inline_asm_elementwise(asm=_QUADS_BF16, constraints="=r,=r,=r,=r,r,r,r",
                                             args=[x, zb, s], dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
        else:
            zb = (z | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + z, exact
            return tl.inline_asm_elementwise(asm=_QUADS_F16, constraints="=r,=r,=r,=r,r,r,r",
                                             args=[x, zb, s], dtype=(tl.float16,) * 4, is_pure=True, pack=2)
    else:
        x32 = x.to(tl.int32)
        sf = s.to(tl.float32)
        w0 = (((x32 & 0xF) - z).to(tl.float32) * sf).to(DOT_DTYPE)
        w1 = ((((x32 >> 4) & 0xF) - z).to(tl.float32) * sf).to(DOT_DTYPE)
        w2 = ((((x32 >> 8) & 0xF) - z).to(tl.float32) * sf).to(DOT_DTYPE)
        w3 = ((((x32 >> 12) & 0xF) - z).to(tl.float32) * sf).to(DOT_DTYPE)
        return w0, w1, w2, w3


def _codes_asm(fma: str, one: int, magic: int, neg_bias: int) -> tl.constexpr:
    """:func:`_int4_codes`' PTX for one 16-bit type: $1 two int16 -> $0 the codes of their low
    nibbles, q - 8 (2^m + q from a lop3, minus 2^m + 8 by a packed fma: exact)."""
    return tl.constexpr("{ .reg .b32 one, nb; " + " ".join([
        f"lop3.b32 $0, $1, 0x000F000F, {magic * 0x10001:#x}, 0xEA;", f"mov.b32 one, {one * 0x10001:#x};",
        f"mov.b32 nb, {neg_bias * 0x10001:#x};", f"{fma} $0, $0, one, nb;"]) + " }")


_CODES_BF16 = _codes_asm("fma.rn.bf16x2", 0x3F80, 0x4300, 0xC308)  # 128 + q - 136
_CODES_F16 = _codes_asm("fma.rn.f16x2", 0x3C00, 0x6400, 0xE408)  # 1024 + q - 1032


@triton.jit
def _int4_codes(x, n: tl.constexpr, DOT_DTYPE: tl.constexpr, ASM: tl.constexpr):
    """int16 x (four int4 codes each, nibble n at bits 4n, value q + 8) -> nibble n's q - 8 in
    DOT_DTYPE (exact): a shift and one pure unary asm (ASM), which the compiler may both move
    into the MMA operand's layout, or the same value by Triton's ops."""
    if n > 0:
        x = x >> (4 * n)
    if ASM:
        if DOT_DTYPE == tl.bfloat16:
            return tl.inline_asm_elementwise(asm=_CODES_BF16, constraints="=r,r", args=[x], dtype=tl.bfloat16,
                                             is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(asm=_CODES_F16, constraints="=r,r", args=[x], dtype=tl.float16,
                                             is_pure=True, pack=2)
    else:
        return ((x.to(tl.int32) & 0xF) - 8).to(DOT_DTYPE)


@triton.jit
def _quad_columns(a, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The activations [BM, BK] -> their columns 4j, 4j + 1, 4j + 2, 4j + 3, [BM, BK/4] each
    (the K columns of nibbles 0 .. 3 of :func:`_int4_quads` / :func:`_int4_codes`)."""
    a_l0, a_l1 = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 4, 2, 2]))  # column 4j + 2h + l
    a0, a2 = tl.split(a_l0)
    a1, a3 = tl.split(a_l1)
    return a0, a1, a2, a3


@triton.jit
def _fp4_half(codes, sb, HAS_GS: tl.constexpr, FP4_GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """int32 e2m1 codes [BK/2, BN] of one parity (row j: K column k0 + 2j or k0 + 2j + 1) and
    the tile's scale bits sb [BK/g, BN] -> the dequantized half tile [BK/2, BN] DOT_DTYPE:
    e2m1 * scale in fp32 (nvfp4: e2m1 * the e4m3 group scale, 6 significant bits, exact in
    DOT_DTYPE; the division by the global scale is the kernel's epilogue's). Row j lies in
    group j // (g/2): the scales broadcast over a [BK/g, g/2, BN] view."""
    G2: tl.constexpr = FP4_GROUP // 2
    v = tl.reshape(_e2m1_times_2_14(codes), [BLOCK_K // FP4_GROUP, G2, BLOCK_N])
    if HAS_GS:
        b = v * (_e4m3_decode(sb) * 16384.0)[:, None, :]
    else:  # 2^(e - 127) * 2^14 may pass the float32 range: two exact products instead
        b = (v * 16384.0) * _e8m0_decode(sb)[:, None, :]
    return tl.reshape(b, [BLOCK_K // 2, BLOCK_N]).to(DOT_DTYPE)


@triton.jit
def _fp4_tile_t(packed, sb, HAS_GS: tl.constexpr, FP4_GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Swapped operands: bytes [BN, BK/2] of one K tile (byte j: K columns 2j, its low nibble,
    and 2j + 1) and the scale bits sb [BN, BK/g] -> the dequantized tile [BN, BK] DOT_DTYPE in K
    order, the values of :func:`_fp4_half` (the two nibbles of a byte stay in one thread: the
    dot's register operand holds K columns 2j and 2j + 1 side by side)."""
    v = tl.join(_e2m1_times_2_14(packed & 0xF), _e2m1_times_2_14(packed >> 4))  # [BN, BK/2, 2]
    v = tl.reshape(v, [BLOCK_N, BLOCK_K // FP4_GROUP, FP4_GROUP])
    if HAS_GS:
        b = v * (_e4m3_decode(sb) * 16384.0)[:, :, None]
    else:
        b = (v * 16384.0) * _e8m0_decode(sb)[:, :, None]
    return tl.reshape(b, [BLOCK_N, BLOCK_K]).to(DOT_DTYPE)


@triton.jit
def _swap_scales(b_scale_ptr, b_zp_ptr, s_rows, z_rows, z_shift, k0, K, group_k, stride_sk, stride_zk,
                 FMT: tl.constexpr, HAS_ZP: tl.constexpr, GROUP_TILE: tl.constexpr, FP4_GROUP: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Swapped operands: the scales of the K tile at k0 (nothing past K), loaded one tile ahead of
    their use (a few bytes a row, too narrow for the pipeliner's asynchronous copies) -> (s, z):
    fp4 s = scale bits int32 [BN, BK/g]; int4 with one group per K tile s = fp32 [BN] and z
    int32 [BN], what q + 8 loses (the zero point + 8, or 8); per-element int4 groups: unused."""
    if FMT == 4:
        kg = k0 // FP4_GROUP + tl.arange(0, BLOCK_K // FP4_GROUP)  # [BK/g]
        sb = tl.load(s_rows[:, None] + kg[None, :] * stride_sk, mask=(kg < K // FP4_GROUP)[None, :], other=0)
        return sb.to(tl.int32), tl.zeros([BLOCK_N], dtype=tl.int32)
    elif GROUP_TILE:
        grp = k0 // group_k
        inside = tl.zeros([BLOCK_N], dtype=tl.int32) + k0 < K  # [BN]
        s = tl.load(s_rows + grp * stride_sk, mask=inside, other=0.0).to(tl.float32)
        if HAS_ZP:
            zw = tl.load(z_rows + grp * stride_zk, mask=inside, other=0)
            return s, (zw >> z_shift) & 0xF
        else:
            return s, tl.full([BLOCK_N], 8, tl.int32)
    else:
        return tl.zeros([BLOCK_N], dtype=tl.float32), tl.zeros([BLOCK_N], dtype=tl.int32)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, b_zp_ptr, b_gs_ptr, c_ptr, topk_weights_ptr, bias_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
    N, K, EM, num_valid, a_row_div, split_n, split_nb, group_k, gs_rows, k_split,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_be, stride_bn, stride_bk,
    stride_se, stride_sn, stride_sk,
    stride_ze, stride_zn, stride_zk,
    stride_gse, stride_bias_e,
    stride_cs, stride_cm, stride_cn, alpha, limit,
    FMT: tl.constexpr, HAS_ZP: tl.constexpr, GROUP_TILE: tl.constexpr, EVEN_K: tl.constexpr,
    FP4_GROUP: tl.constexpr, HAS_GS: tl.constexpr, BS_TILE: tl.constexpr, SPLIT: tl.constexpr,
    SWAP_AB: tl.constexpr, QUADS: tl.constexpr, ASM: tl.constexpr, CODES: tl.constexpr,
    SILU: tl.constexpr, CLAMPED: tl.constexpr, ROUND: tl.constexpr,
    MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, SOFT_BF16: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One program: BLOCK_M sorted pairs (one expert) x BLOCK_N output columns (x one K slice).

    A [rows, K] (row of pair p: p // a_row_div); B logical [E, N, K]; C [P, N].
    FMT 0 dense: B float, cast to DOT_DTYPE.
    FMT 1 fp8-block (W8A8): A, B e4m3; per 128-wide K block acc += (A@B) * a_s[m] * b_s[n];
          a_scale [rows, ceil(K/128)], b_scale rows: n // 128 below split_n, else
          split_nb + (n - split_n) // 128 (gate / up blocks stacked separately). BS_TILE: the
          tile's BLOCK_N rows lie in one scale row (BLOCK_N divides 128 and split_n, or
          split_n = N), so b_s is one number a K block: acc += (A@B) * (a_s[m] * b_s), one FMA
          an element, and no [BN] scale vector to load and lay out every K block.
    FMT 2 fp8-channel (W8A8, per token): A, B e4m3; acc = A@B over all of K (the tensor cores'
          partial sums added into the fp32 acc every K tile), then times a_s[m] * b_s[n]
          (a_scale [rows, 1], b_scale [E, N, 1]).
    FMT 3 int4-group (W4A16): B int32 [E, N, ceil(K/8)] nibbles, scale [E, N, ceil(K/g)],
          zero points [E, ceil(N/8), ceil(K/g)] (HAS_ZP); tile dequantized as (q - z) * s.
          GROUP_TILE: g % BLOCK_K == 0, so scales / zero points are loaded once per K tile.
          QUADS (unswapped, BLOCK_K >= 64, g % 4 == 0): B read as int16 [E, N, K/4], element j
          the codes of K columns 4j .. 4j + 3, dequantized by :func:`_int4_quads` (ASM: packed
          16-bit PTX, no int -> float conversions) into four [BK/4, BN] tiles dotted with A's
          columns 4j + n: the same dequantized values, summed in another order. CODES (GROUP_TILE,
          BLOCK_M < 64): the dots take the codes q - 8 (:func:`_int4_codes`, exact) and the fp32
          product is scaled, minus (z - 8) * sum(a) for zero points: the weights never rounded.
    FMT 4 fp4 (W4A16): B uint8 [E, N, K/2], e2m1 codes, k = 2j in the low nibble of byte j,
          2j + 1 in the high one; scale [E, N, K/FP4_GROUP] as uint8 bits: e4m3 divided by the
          global scale gs [E, P] of the row (HAS_GS, nvfp4: row n takes gs[n // gs_rows]), or
          e8m0 (mxfp4). Tile dequantized as e2m1 * scale in fp32 (BLOCK_K % FP4_GROUP == 0,
          BLOCK_K >= 32). nvfp4's global scale is not in the tile, whose e2m1 * s (6 significant
          bits) the dot's 16-bit dtype holds exactly: the fp32 sum is multiplied by 1 / gs of its
          row after the K loop (the format's e2m1 * s / gs; the quotients s / gs, rounded into
          every tile before, cost a division per group scale in the loop). The two nibbles of a byte stay apart: the low ones are the tile's even
          K columns, the high ones its odd columns, dotted with A's even and odd columns (split
          from one contiguous load), so no register shuffles put the codes in K order (which
          cost 18-22 % at T <= 128 on an H100).
    SOFT_BF16: C is bf16 and the kernel interpreted, whose fp32 -> bf16 cast truncates: round
    to nearest even with integer math instead (the GPU's cast does that itself).
    EVEN_K: K % BLOCK_K == 0, no K masks. Weight rows are read modulo N (always in bounds, no
    N masks on weight loads); the extra columns are dropped by the masked store.
    SWAP_AB (FMT 3 / 4): the weight tile is dequantized as [BN, BK] and is the dot's first
    operand, acc^T [BN, BM] = W @ A^T: the tensor cores read it from registers (Hopper's wgmma
    takes only its first operand there), so it needs no trip through shared memory and the
    dot can run while the next tile is dequantized; the activations [BM, BK] stream through
    shared memory as the second operand. acc is transposed back before the epilogue. The weight
    scales of each K tile are loaded one tile ahead (:func:`_swap_scales`). With SILU the tile's
    gate and up rows alternate in groups of 8 (rows 16q + i and 16q + 8 + i: gate and up of one
    output column), the two rows one thread of the MMA's accumulator layout holds, so splitting
    them moves no data.
    SPLIT (split-K): program (i, s) sums only K columns [s * k_split, (s + 1) * k_split) (k_split
    a multiple of BLOCK_K) and stores its fp32 partial in C's slice s (C [S, P, N], stride_cs);
    the bias is added by slice 0 alone, the top-k weight by every slice (both are linear).
    SILU (w13, the N rows gate rows then up rows): the tile's BLOCK_N weight rows are BLOCK_N / 2
    gate rows and the up rows of the same columns, interleaved (tile column 2j: gate row n,
    2j + 1: up row N/2 + n, n = pid_n * BLOCK_N / 2 + j), and C [P, N/2] gets
    swiglu(gate, up) (moe_silu's, CLAMPED: gpt-oss's with alpha, limit) of the two rounded as
    ROUND says (1 bf16, 2 fp16: what C1 would have stored), in fp32, stored in C's dtype: step
    3 of fused_experts in GEMM1's epilogue, no [P, N] intermediate.
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
    if SILU and SWAP_AB:  # tile row 16q + i: gate row n, 16q + 8 + i: up row N/2 + n, n = 8q + i (i < 8)
        j = tl.arange(0, BLOCK_N)
        offs_n = pid_n * (BLOCK_N // 2) + (j // 16) * 8 + j % 8  # [BN]
        n_mask = offs_n < N // 2
        offs_bn = offs_n % (N // 2) + ((j // 8) % 2) * (N // 2)
    elif SILU:  # tile column 2j: gate row n, 2j + 1: up row N/2 + n, n the output column
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2  # [BN]
        n_mask = offs_n < N // 2
        offs_bn = offs_n % (N // 2) + (tl.arange(0, BLOCK_N) % 2) * (N // 2)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
        n_mask = offs_n < N
        offs_bn = offs_n % N  # weight rows, always in range: B loads need no N mask
    offs_bn64 = offs_bn.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert * stride_be
    if FMT == 1 and BS_TILE:  # fp8-block, the tile's rows in one 128-row block: its scale row, one pointer
        n0 = (pid_n * BLOCK_N) % N
        s_row0 = tl.where(n0 < split_n, n0 // 128, split_nb + (n0 - split_n) // 128)
        bs_base = b_scale_ptr + expert * stride_se + s_row0.to(tl.int64) * stride_sn
    elif FMT == 1:  # fp8-block weight scale row of each output row (gate / up blocks apart)
        s_rows = tl.where(offs_bn < split_n, offs_bn // 128, split_nb + (offs_bn - split_n) // 128)
        bs_base = b_scale_ptr + expert * stride_se + s_rows.to(tl.int64) * stride_sn  # [BN]
    if FMT == 4:
        bs_base = b_scale_ptr + expert * stride_se + offs_bn64 * stride_sn  # [BN]

    if SPLIT:
        k_lo = tl.program_id(1) * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
    else:
        k_lo = 0
        k_hi = K
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # acc^T
        s_rows = b_scale_ptr + expert * stride_se + offs_bn64 * stride_sn  # [BN]
        z_rows = b_zp_ptr + expert * stride_ze + (offs_bn64 // 8) * stride_zn  # [BN] (int4 zero points)
        z_shift = (offs_bn % 8) * 4
        s_next, z_next = _swap_scales(b_scale_ptr, b_zp_ptr, s_rows, z_rows, z_shift, k_lo, K, group_k, stride_sk,
                                      stride_zk, FMT, HAS_ZP, GROUP_TILE, FP4_GROUP, BLOCK_K, BLOCK_N)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k  # [BK]
        k_mask = kk < K
        a = _load_k(a_ptr + a_rows[:, None] * stride_am + kk[None, :] * stride_ak,
                    m_mask[:, None], m_mask[:, None] & k_mask[None, :], EVEN_K)  # [BM, BK]
        if SWAP_AB:
            s_cur, z_cur = s_next, z_next
            s_next, z_next = _swap_scales(b_scale_ptr, b_zp_ptr, s_rows, z_rows, z_shift, k0 + BLOCK_K, K, group_k,
                                          stride_sk, stride_zk, FMT, HAS_ZP, GROUP_TILE, FP4_GROUP, BLOCK_K, BLOCK_N)
            if FMT == 4:
                kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK/2] bytes
                packed = _load_k(b_base + offs_bn64[:, None] * stride_bn + kb[None, :] * stride_bk,
                                 None, (kb < K // 2)[None, :], EVEN_K).to(tl.int32)  # [BN, BK/2]
                w = _fp4_tile_t(packed, s_cur, HAS_GS, FP4_GROUP, BLOCK_K, BLOCK_N, DOT_DTYPE)
            else:
                kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK/8] words: k = 8 * w + i
                words = _load_k(b_base + offs_bn64[:, None] * stride_bn + kw[None, :] * stride_bk,
                                None, (kw < tl.cdiv(K, 8))[None, :], EVEN_K)  # [BN, BK/8] int32
                shifts = tl.arange(0, 8) * 4
                q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, [BLOCK_N, BLOCK_K])  # q + 8
                if GROUP_TILE:
                    w = ((q - z_cur[:, None]).to(tl.float32) * s_cur[:, None]).to(DOT_DTYPE)
                else:
                    grp = kk // group_k
                    s = tl.load(b_scale_ptr + expert * stride_se + offs_bn64[:, None] * stride_sn
                                + grp[None, :] * stride_sk, mask=k_mask[None, :], other=0.0).to(tl.float32)
                    if HAS_ZP:
                        zw = tl.load(z_rows[:, None] + grp[None, :] * stride_zk, mask=k_mask[None, :], other=0)
                        q = q - ((zw >> z_shift[:, None]) & 0xF)
                    else:
                        q = q - 8
                    w = (q.to(tl.float32) * s).to(DOT_DTYPE)
            acc = tl.dot(w, tl.trans(a.to(DOT_DTYPE)), acc, input_precision=PREC)
        elif FMT == 3 and QUADS:  # B as int16 [E, N, K/4]: element j holds K columns 4j .. 4j + 3
            kq = k0 // 4 + tl.arange(0, BLOCK_K // 4)  # [BK/4]
            q_mask = (kq < 2 * tl.cdiv(K, 8))[:, None]
            x = _load_k(b_base + offs_bn64[None, :] * stride_bn + kq[:, None] * stride_bk,
                        None, q_mask, EVEN_K)  # [BK/4, BN] int16
            a_dot = a.to(DOT_DTYPE)
            a0, a1, a2, a3 = _quad_columns(a_dot, BLOCK_M, BLOCK_K)
            if GROUP_TILE:  # the K tile lies in one group: one scale / zero point per column
                grp = k0 // group_k
                s = tl.load(b_scale_ptr + expert * stride_se + offs_bn64 * stride_sn + grp * stride_sk)  # [BN]
                if HAS_ZP:
                    zw = tl.load(b_zp_ptr + expert * stride_ze + (offs_bn64 // 8) * stride_zn + grp * stride_zk)
                    z = (zw >> ((offs_bn % 8) * 4)) & 0xF  # z + 8
                else:
                    z = tl.full([BLOCK_N], 8, tl.int32)
            else:  # groups of g >= 4 columns: element j's four in one
                grp = (k0 + 4 * tl.arange(0, BLOCK_K // 4)) // group_k  # [BK/4]
                s = tl.load(b_scale_ptr + expert * stride_se + offs_bn64[None, :] * stride_sn + grp[:, None] * stride_sk,
                            mask=q_mask, other=0.0)
                if HAS_ZP:
                    zw = tl.load(b_zp_ptr + expert * stride_ze + (offs_bn64 // 8)[None, :] * stride_zn
                                 + grp[:, None] * stride_zk, mask=q_mask, other=0)
                    z = (zw >> ((offs_bn % 8) * 4)[None, :]) & 0xF
                else:
                    z = tl.full([1, BLOCK_N], 8, tl.int32)
            if GROUP_TILE and CODES:
                # dot the codes q - 8 (exact in DOT_DTYPE) and scale the fp32 product: the codes' only
                # op is a unary asm, which lets the compiler load them straight into the MMA's operand
                # layout (no shared-memory trip of a dequantized tile)
                p = tl.dot(a0, _int4_codes(x, 0, DOT_DTYPE, ASM), input_precision=PREC)
                p = tl.dot(a1, _int4_codes(x, 1, DOT_DTYPE, ASM), p, input_precision=PREC)
                p = tl.dot(a2, _int4_codes(x, 2, DOT_DTYPE, ASM), p, input_precision=PREC)
                p = tl.dot(a3, _int4_codes(x, 3, DOT_DTYPE, ASM), p, input_precision=PREC)
                if HAS_ZP:  # (q - z) * s summed = s * (sum a (q - 8) - (z - 8) sum a)
                    p = p - tl.sum(a_dot.to(tl.float32), axis=1)[:, None] * (z - 8).to(tl.float32)[None, :]
                acc += p * s.to(tl.float32)[None, :]
            else:
                if GROUP_TILE:
                    s, z = s[None, :], z[None, :]
                w0, w1, w2, w3 = _int4_quads(x, z, s, DOT_DTYPE, ASM)  # [BK/4, BN] each: K columns 4j + n
                acc = tl.dot(a0, w0, acc, input_precision=PREC)
                acc = tl.dot(a1, w1, acc, input_precision=PREC)
                acc = tl.dot(a2, w2, acc, input_precision=PREC)
                acc = tl.dot(a3, w3, acc, input_precision=PREC)
        elif FMT == 3:
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
        elif FMT == 4:  # the low nibbles are the tile's even K columns, the high ones its odd columns
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK/2] bytes: byte j holds k0 + 2j, k0 + 2j + 1
            packed = _load_k(b_base + offs_bn64[None, :] * stride_bn + kb[:, None] * stride_bk,
                             None, (kb < K // 2)[:, None], EVEN_K).to(tl.int32)  # [BK/2, BN]
            kg = k0 // FP4_GROUP + tl.arange(0, BLOCK_K // FP4_GROUP)  # [BK/g] groups
            sb = _load_k(bs_base[None, :] + kg[:, None] * stride_sk, None,
                         (kg < K // FP4_GROUP)[:, None], EVEN_K).to(tl.int32)  # [BK/g, BN] bits
            b_even = _fp4_half(packed & 0xF, sb, HAS_GS, FP4_GROUP, BLOCK_K, BLOCK_N, DOT_DTYPE)
            b_odd = _fp4_half(packed >> 4, sb, HAS_GS, FP4_GROUP, BLOCK_K, BLOCK_N, DOT_DTYPE)
            a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))  # [BM, BK/2] each
            acc = tl.dot(a_even.to(DOT_DTYPE), b_even, acc, input_precision=PREC)
            acc = tl.dot(a_odd.to(DOT_DTYPE), b_odd, acc, input_precision=PREC)
        elif FMT == 1:
            b = _load_k(b_base + offs_bn64[None, :] * stride_bn + kk[:, None] * stride_bk,
                        None, k_mask[:, None], EVEN_K)  # [BK, BN] e4m3
            kb = k0 // 128
            a_s = tl.load(a_scale_ptr + a_rows * stride_asm + kb * stride_ask, mask=m_mask, other=0.0)
            b_s = tl.load(bs_base + kb * stride_sk)  # [BN], or one scale (BS_TILE)
            if BS_TILE:  # one FMA an element: the row scales times the tile's one weight scale first
                acc += tl.dot(a, b) * (a_s * b_s)[:, None]
            else:
                acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        elif FMT == 2:
            b = _load_k(b_base + offs_bn64[None, :] * stride_bn + kk[:, None] * stride_bk,
                        None, k_mask[:, None], EVEN_K)  # [BK, BN] e4m3
            # Hopper's fp8 MMA keeps a narrower accumulator: fold it into the fp32 acc every K tile
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            b = _load_k(b_base + offs_bn64[None, :] * stride_bn + kk[:, None] * stride_bk,
                        None, k_mask[:, None], EVEN_K)
            acc += tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=PREC)

    if FMT == 4 and HAS_GS:  # nvfp4: the sum over e2m1 * s tiles, divided by each row's global scale once here
        inv_gs = 1.0 / tl.load(b_gs_ptr + expert * stride_gse + offs_bn // gs_rows)  # [BN]
        if SWAP_AB:
            acc = acc * inv_gs[:, None]
        else:
            acc = acc * inv_gs[None, :]
    if SWAP_AB and SILU:  # acc^T [BN, BM]: rows 16q + i and 16q + 8 + i sit in one thread of the MMA's layout
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * stride_bias_e + offs_bn64).to(tl.float32)
            acc = acc + bias[:, None]
        pairs = tl.permute(tl.reshape(acc, [BLOCK_N // 16, 2, 8, BLOCK_M]), [0, 2, 3, 1])  # [BN/16, 8, BM, 2]
        gate, up = tl.split(tl.reshape(pairs, [BLOCK_N // 2, BLOCK_M, 2]))  # [BN/2, BM] each
        y = tl.trans(swiglu(round_to(gate, ROUND), round_to(up, ROUND), alpha, limit, CLAMPED))  # [BM, BN/2]
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(c_ptr + pair64[:, None] * stride_cm + cols.to(tl.int64)[None, :] * stride_cn,
                 y.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & (cols < N // 2)[None, :])
        return
    if SWAP_AB:
        acc = tl.trans(acc)  # [BM, BN]
    if FMT == 2:
        a_s = tl.load(a_scale_ptr + a_rows * stride_asm, mask=m_mask, other=0.0)
        cs = tl.load(b_scale_ptr + expert * stride_se + offs_bn64 * stride_sn)
        acc = acc * a_s[:, None] * cs.to(tl.float32)[None, :]
    if HAS_BIAS:  # the expert's bias [R] on the GEMM's float32 result, before the top-k weight
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_bn64).to(tl.float32)
        if SPLIT:
            bias = tl.where(tl.program_id(1) == 0, bias, 0.0)
        acc = acc + bias[None, :]
    if MUL_WEIGHT:
        w = tl.load(topk_weights_ptr + pair64, mask=m_mask, other=0.0)
        acc = acc * w[:, None]
    if SILU:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))  # [BM, BN/2] each
        y = swiglu(round_to(gate, ROUND), round_to(up, ROUND), alpha, limit, CLAMPED)
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(c_ptr + pair64[:, None] * stride_cm + cols.to(tl.int64)[None, :] * stride_cn,
                 y.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & (cols < N // 2)[None, :])
        return
    if SOFT_BF16:
        acc = round_to_bf16(acc)
    c_base = c_ptr
    if SPLIT:
        c_base = c_ptr + tl.program_id(1).to(tl.int64) * stride_cs
    tl.store(
        c_base + pair64[:, None] * stride_cm + offs_n.to(tl.int64)[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def moe_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, wts: StackedWeights, c: torch.Tensor,
             topk_weights: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
             num_post_pad: torch.Tensor, num_valid: int, a_row_div: int, split_n: int, mul_weight: bool,
             group_size: int, cfg: MoeConfig, bias: torch.Tensor | None = None, silu: bool = False,
             clamp: tuple[float, float] | None = None) -> None:
    """c[p] = (A[p // a_row_div] @ W[e]^T + bias[e]) (* topk_weights[p] when mul_weight) for every pair
    p < num_valid of a block of sorted_ids, e = that block's expert; other rows of c untouched.

    a [rows, K] with contiguous rows: e4m3 with a_scale fp32 [rows, ceil(K/128)] for fp8-block,
    [rows, 1] for fp8-channel (the scheme's ``act_group``; a_scale rows may be strided), else
    fp16/bf16/fp32 (a_scale None); wts: one stacked linear, logical [E, R, K], checked by
    :func:`moetool.kernels.moe_weights.parse_weights`; c [P, R]; topk_weights fp32 [P] (read
    only when mul_weight). Split-K: c fp32 [S, P, R] instead, S slices of K (of whole K tiles,
    the last ones may be short or empty), each pair's row of slice s holding that slice's part
    of the product (a slice past K holds zeros); their sum is the result.
    sorted_ids / expert_ids / num_post_pad: ``moe_align_block_size`` with
    BM = cfg.block_m; split_n: the gate rows of an fp8-block w13 (R for any other linear);
    group_size: int4's g (fp4 schemes: their own group, which cfg.block_k must be a multiple of).
    bias: optional [E, R] (any float dtype, rows contiguous): each expert's bias (gpt-oss).
    silu (a w13, R = 2N: gate rows then up rows): c [P, N] 16/32-bit float gets silu(gate) * up
    (clamp = (alpha, limit): gpt-oss's clamped SwiGLU) of the product rounded to c's dtype, as
    :func:`moetool.kernels.moe_silu.silu_and_mul` of the unfused product (not for W8A8 a, nor
    split-K). cfg.swap_ab (int4 / fp4): the same product as W @ A^T, the weights the dot's
    first operand (the kernel's SWAP_AB).
    """
    check(a.dim() == 2 and a.stride(1) == 1 and c.dim() in (2, 3),
          "moe_gemm: a must be 2-D with contiguous rows, c [P, R] or [S, P, R]")
    splits = c.shape[0] if c.dim() == 3 else 1
    check(c.dim() == 2 or (c.dtype == torch.float32 and splits >= 1),
          f"moe_gemm: split-K partials c [S, P, R] must be float32, got {c.dtype}")
    out_cols = wts.main.shape[1] // 2 if silu else wts.main.shape[1]
    check(c.shape[-1] == out_cols and (not silu or wts.main.shape[1] % 2 == 0),
          f"moe_gemm: c has {c.shape[-1]} columns, the weights {wts.main.shape[1]} rows"
          + (" (gate then up: c takes half)" if silu else ""))
    check(not silu or (c.dim() == 2 and c.dtype in ROUND_CODE and wts.act_group is None),
          f"moe_gemm: silu in the epilogue writes 16/32-bit float rows [P, N] from 16/32-bit activations, "
          f"got c {c.dtype} {list(c.shape)}")
    R = wts.main.shape[1]
    K = a.shape[1]
    # the sizes the kernel trusts: each read or write outside them is out of bounds
    check(wts.cols is None or K == wts.cols, f"moe_gemm: a has {K} columns, the weights {wts.cols}")
    check(c.dtype in _TL_DTYPES, f"moe_gemm: c must be fp16/bf16/fp32, got {c.dtype}")
    check(0 <= num_valid <= c.shape[-2] and a_row_div >= 1 and num_valid <= a.shape[0] * a_row_div,
          f"moe_gemm: {num_valid} pairs need c of as many rows (has {c.shape[-2]}) and a of "
          f"ceil({num_valid} / {a_row_div}) (has {a.shape[0]})")
    check(not mul_weight or topk_weights.numel() >= num_valid,
          f"moe_gemm: {num_valid} pairs need as many topk_weights, got {topk_weights.numel()}")
    check(expert_ids.numel() * cfg.block_m == sorted_ids.numel(),
          f"moe_gemm: sorted_ids [{sorted_ids.numel()}] and expert_ids [{expert_ids.numel()}] are not aligned "
          f"to block_m {cfg.block_m}")
    if wts.act_group is not None:
        G = act_scale_cols(K, wts.act_group)
        got = "none" if a_scale is None else f"{a_scale.dtype} {list(a_scale.shape)}"
        check(a.dtype == torch.float8_e4m3fn and a_scale is not None and a_scale.dtype == torch.float32
              and tuple(a_scale.shape) == (a.shape[0], G),
              f"moe_gemm: W8A8 needs a float8_e4m3fn with a_scale float32 [{a.shape[0]}, {G}], got a {a.dtype}, "
              f"a_scale {got}")
    else:
        check(a.dtype in _TL_DTYPES and a_scale is None, f"moe_gemm: a must be fp16/bf16/fp32, got {a.dtype}")
    EM = sorted_ids.numel()
    main, scale = wts.main, wts.scale
    scale_ = scale if scale is not None else main
    zp_ = wts.zp if wts.zp is not None else main
    gs_ = wts.global_scale if wts.global_scale is not None else main
    check(not cfg.swap_ab or wts.fmt in (3, 4),
          "moe_gemm: swap_ab is for the weight-only int4 / fp4 schemes (the dequantized tile in registers)")
    if wts.fp4_group is not None:
        check(cfg.block_k % wts.fp4_group == 0 and cfg.block_k >= 32,
              f"moe_gemm: block_k {cfg.block_k} is not whole fp4 groups of {wts.fp4_group} (and >= 32: two half "
              f"tiles of K >= 16)")
        scale_ = scale_.view(torch.uint8)  # e4m3 bits (nvfp4), decoded in the kernel
    a_scale_ = a_scale if a_scale is not None else a
    if bias is not None:
        check(bias.dim() == 2 and tuple(bias.shape) == (wts.main.shape[0], R) and bias.stride(1) == 1
              and bias.is_floating_point(), f"moe_gemm: bias must be float [{wts.main.shape[0]}, {R}], got "
                                            f"{bias.dtype} {list(bias.shape)}")
    bias_ = bias if bias is not None else main
    if wts.act_group is not None:  # e4m3 x e4m3 dots
        dot_dtype, prec = tl.float8e4nv, "ieee"
    else:
        dot_dtype = _TL_DTYPES[a.dtype]
        if dot_dtype == tl.bfloat16 and is_interpreted(_moe_gemm_kernel):
            dot_dtype = tl.float32  # the interpreter's bf16 tl.dot is wrong
        prec = "ieee" if dot_dtype == tl.float32 else "tf32"
    def launch(cfg: MoeConfig) -> None:
        # int4 as int16 quads (four dots of K tile / 4 >= 16 columns; every quad in one group)
        quads = wts.fmt == 3 and not cfg.swap_ab and cfg.block_k >= 64 and main.stride(2) == 1 and group_size % 4 == 0
        b = main.view(torch.int16) if quads else main
        group_tile = group_size % cfg.block_k == 0
        codes = INT4_CODES and cfg.block_m < 64 and group_tile  # (with quads)
        k_split = triton.cdiv(triton.cdiv(K, cfg.block_k), splits) * cfg.block_k  # whole K tiles per slice
        grid = (triton.cdiv(EM, cfg.block_m) * triton.cdiv(R, cfg.block_n), splits)
        _moe_gemm_kernel[grid](
            a, a_scale_, b, scale_, zp_, gs_, c, topk_weights, bias_,
            sorted_ids, expert_ids, num_post_pad,
            R, K, EM, num_valid, a_row_div, split_n, triton.cdiv(split_n, FP8_BLOCK), group_size,
            R // gs_.shape[1] if wts.global_scale is not None else R, k_split,
            a.stride(0), a.stride(1), a_scale_.stride(0), a_scale_.stride(-1),
            b.stride(0), b.stride(1), b.stride(2),
            scale_.stride(0), scale_.stride(1), scale_.stride(-1),
            zp_.stride(0), zp_.stride(1), zp_.stride(-1),
            gs_.stride(0), bias_.stride(0),
            c.stride(0) if splits > 1 else 0, c.stride(-2), c.stride(-1),
            float(clamp[0]) if clamp else 1.0, float(clamp[1]) if clamp else 0.0,
            FMT=wts.fmt, HAS_ZP=wts.zp is not None, GROUP_TILE=group_tile,
            EVEN_K=K % cfg.block_k == 0, FP4_GROUP=wts.fp4_group or 16, HAS_GS=wts.global_scale is not None,
            BS_TILE=wts.fmt == 1 and FP8_BLOCK % cfg.block_n == 0 and (split_n % cfg.block_n == 0 or split_n == R),
            SPLIT=splits > 1, SWAP_AB=cfg.swap_ab, QUADS=quads, CODES=codes,
            ASM=quads and INT4_ASM and dot_dtype in (tl.bfloat16, tl.float16) and not is_interpreted(_moe_gemm_kernel)
            and (codes or scale.dtype == a.dtype),  # the dequantized quads multiply the scale in the dot's dtype
            SILU=silu, CLAMPED=clamp is not None, ROUND=ROUND_CODE[c.dtype] if silu else 0,
            MUL_WEIGHT=bool(mul_weight), HAS_BIAS=bias is not None, SOFT_BF16=c.dtype == torch.bfloat16 and is_interpreted(_moe_gemm_kernel),
            DOT_DTYPE=dot_dtype, PREC=prec,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    key = (cfg, a.dtype, c.dtype, wts.fmt, silu, splits > 1, bias is not None)
    cfg = _FITTED.get(key, cfg)
    while True:
        try:
            launch(cfg)
            return
        except OutOfResources:  # raised when compiling, before anything ran: the next smaller pipeline
            if cfg.num_stages <= 1:
                raise
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
            _FITTED[key] = cfg


#: tiles whose pipeline did not fit the device's shared memory -> the fewer stages that did (the
#: tables are tuned with 16-bit output rows; float32 rows, e.g. a float32 model's, need more)
_FITTED: dict[tuple, MoeConfig] = {}


def moe_gemm_ref(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, topk_weights: torch.Tensor,
                 sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_valid: int, a_row_div: int,
                 mul_weight: bool, block_m: int) -> torch.Tensor:
    """Reference of :func:`moe_gemm` in fp32 on dequantized weights w fp32 [E, R, K] (e.g.
    ``dequantize_stacked`` of each expert) -> [num_valid, R], zero rows for pairs in no block.
    e4m3 a is dequantized with a_scale: [rows, ceil(K/128)] per 1x128 group, or [rows, 1] per
    token (the same thing when K <= 128).
    Not bit-exact: the kernel sums its K tiles in another order, and fp8-block scales each
    128-column block's partial sum."""
    if a.dtype == torch.float8_e4m3fn:
        x = fp8_dequant_act_ref(a, a_scale, TOKEN_GROUP if a_scale.shape[1] == 1 else FP8_BLOCK)
    else:
        x = a.float()
    out = torch.zeros((num_valid, w.shape[1]), dtype=torch.float32, device=a.device)
    for b, e in enumerate(expert_ids.tolist()):
        if e < 0:
            continue
        pairs = sorted_ids[b * block_m:(b + 1) * block_m].long()
        pairs = pairs[pairs < num_valid]  # [n] (padding dropped)
        y = x[pairs // a_row_div] @ w[e].t()  # [n, R]
        if mul_weight:
            y = y * topk_weights.reshape(-1)[pairs].float()[:, None]
        out[pairs] = y
    return out
