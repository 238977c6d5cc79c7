"""silu(gate) * up over the grouped GEMM's [P, 2N] output, optionally quantized to fp8 per
1x128 group or per token (step 3 of :func:`moetool.kernels.fused_moe.fused_experts`):
:func:`silu_and_mul` and its reference :func:`silu_and_mul_ref`.

Letters: M = rows (token-slot pairs), N = expert intermediate size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import (
    FLOAT_ACTS,
    FP8_BLOCK,
    TOKEN_GROUP,
    act_scale_cols,
    check,
    check_device,
    e4m3_rne,
    is_interpreted,
    round_to_bf16,
)


@triton.jit
def round_to(y, ROUND: tl.constexpr):
    """fp32 y rounded to bf16 (ROUND 1) or fp16 (2), still fp32; 0: unchanged."""
    if ROUND == 1:
        y = round_to_bf16(y)
    elif ROUND == 2:
        y = y.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def _silu_mul_tile(x_row, cols, mask, N, stride_xn, alpha, limit, ROUND: tl.constexpr, CLAMPED: tl.constexpr,
                   splits, stride_xs, SPLITS: tl.constexpr, ROUND_IN: tl.constexpr):
    """silu(gate) * up in fp32 over the columns ``cols`` of rows ``x_row`` ([BM, BN]); CLAMPED
    (gpt-oss): gate clamped above at ``limit``, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1). ROUND: rounded to the input's dtype first (1 bf16,
    2 fp16, 0 none), as the engine stores it. SPLITS: x holds ``splits`` fp32 partials
    ``stride_xs`` apart, summed in order and rounded as ROUND_IN says (what an unsplit GEMM
    would have stored) before anything else."""
    if SPLITS:
        g = tl.zeros(mask.shape, dtype=tl.float32)
        u = tl.zeros(mask.shape, dtype=tl.float32)
        for s in range(splits):
            part = x_row + s * stride_xs
            g += tl.load(part + cols[None, :] * stride_xn, mask=mask, other=0.0)
            u += tl.load(part + (cols + N)[None, :] * stride_xn, mask=mask, other=0.0)
        g = round_to(g, ROUND_IN)
        u = round_to(u, ROUND_IN)
    else:
        g = tl.load(x_row + cols[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_row + (cols + N)[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
    return round_to(swiglu(g, u, alpha, limit, CLAMPED), ROUND)


@triton.jit
def swiglu(g, u, alpha, limit, CLAMPED: tl.constexpr):
    """fp32 gate and up -> silu(g) * u; CLAMPED (gpt-oss): g clamped above at ``limit``, u to
    [-limit, limit], then g * sigmoid(alpha * g) * (u + 1)."""
    if CLAMPED:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return g / (1.0 + tl.exp(-(g * alpha))) * (u + 1.0)
    else:
        return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _silu_mul_kernel(
    x_ptr, y_ptr, ys_ptr, ids_ptr, M, N, alpha, limit, splits,
    stride_xs, stride_xm, stride_xn, stride_ym, stride_yn, stride_sm, stride_sn,
    CLAMPED: tl.constexpr, HAS_IDS: tl.constexpr, QUANT_FP8: tl.constexpr, TWO_PASS: tl.constexpr,
    ROUND: tl.constexpr, SOFT_FP8: tl.constexpr, SPLITS: tl.constexpr, ROUND_IN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """x [M, 2N] (gate | up) -> y [M, N] = silu(gate) * up, computed in fp32. SPLITS: x is
    ``splits`` fp32 partials [splits, M, 2N] of a split-K GEMM, summed first (ROUND_IN).

    HAS_IDS: rows whose ids[row] < 0 are skipped (pairs never computed). QUANT_FP8: y (rounded
    as ROUND says) is stored as e4m3 with scales ys [M, ceil(N/BLOCK_N)] (BLOCK_N = group; per
    token: BLOCK_N >= N, one group), as ``fp8_act_quant``. TWO_PASS: per token with N > BLOCK_N,
    ys [M, 1]: one pass over the row for the amax, one recomputing y for the codes.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    if HAS_IDS:
        rmask = rmask & (tl.load(ids_ptr + rows, mask=rmask, other=-1) >= 0)
    rows64 = rows.to(tl.int64)
    x_row = x_ptr + rows64[:, None] * stride_xm
    y_row = y_ptr + rows64[:, None] * stride_ym
    if TWO_PASS:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            mask = rmask[:, None] & (n0 + cols < N)[None, :]
            y = _silu_mul_tile(x_row, n0 + cols, mask, N, stride_xn, alpha, limit, ROUND, CLAMPED, splits,
                                stride_xs, SPLITS, ROUND_IN)
            amax = tl.maximum(amax, tl.max(tl.abs(y), axis=1))
        s = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
        for n0 in range(0, N, BLOCK_N):
            mask = rmask[:, None] & (n0 + cols < N)[None, :]
            y = _silu_mul_tile(x_row, n0 + cols, mask, N, stride_xn, alpha, limit, ROUND, CLAMPED, splits,
                                stride_xs, SPLITS, ROUND_IN)
            q = e4m3_rne(tl.clamp(tl.math.div_rn(y, s[:, None]), -448.0, 448.0), SOFT_FP8)
            tl.store(y_row + (n0 + cols)[None, :] * stride_yn, q, mask=mask)
        tl.store(ys_ptr + rows64 * stride_sm, s, mask=rmask)
    else:
        mask = rmask[:, None] & (cols < N)[None, :]
        y = _silu_mul_tile(x_row, cols, mask, N, stride_xn, alpha, limit, ROUND, CLAMPED, splits, stride_xs,
                            SPLITS, ROUND_IN)
        y_ptrs = y_row + cols[None, :] * stride_yn
        if QUANT_FP8:
            amax = tl.max(tl.abs(y), axis=1)
            s = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
            q = e4m3_rne(tl.clamp(tl.math.div_rn(y, s[:, None]), -448.0, 448.0), SOFT_FP8)
            tl.store(y_ptrs, q, mask=mask)
            tl.store(ys_ptr + rows64 * stride_sm + pid_n * stride_sn, s, mask=rmask)
        else:
            tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


#: widest row chunk a per-token program holds (one pass at or below it)
_TOKEN_BLOCK_N = 4096
#: programs a call wants before its blocks may grow (about one per SM of an H100)
MIN_PROGRAMS = 128


def silu_blocks(M: int, N: int, block_n: int, quant: bool, per_token: bool,
                min_programs: int = MIN_PROGRAMS) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of one call: rows of up to 4096 elements a program, then fewer rows
    and (unquantized: block_n is not a quantization group's width nor a row's pass) narrower
    columns, down to 128, until the call has ``min_programs``. Decode's few rows otherwise gave
    four programs all of an [8, 2N] of split-K partials to read (DeepSeek-V3 EP8 int4 T=1:
    9.7 us under ncu). per_token: one program a row block, whatever block_n."""
    block_m = max(1, min(64, 4096 // block_n))

    def programs():
        return triton.cdiv(M, block_m) * (1 if per_token else triton.cdiv(N, block_n))

    while block_m > 1 and programs() < min_programs:
        block_m //= 2
    while not quant and block_n > 128 and programs() < min_programs:
        block_n //= 2
    return block_m, block_n


#: round_to's ROUND for an activation dtype
ROUND_CODE = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 0}


def silu_and_mul(x: torch.Tensor, row_ids: torch.Tensor | None = None, *, quant_fp8: bool = False,
                 out_dtype: torch.dtype | None = None, group: int = FP8_BLOCK, soft_fp8: bool | None = None,
                 clamp: tuple[float, float] | None = None, act_dtype: torch.dtype | None = None):
    """x [M, 2N] float, contiguous -> silu(x[:, :N]) * x[:, N:] [M, N] (out_dtype, default x's).

    x may also be fp32 [S, M, 2N], the S partials of a split-K GEMM: each row is their sum (in
    slice order, fp32), rounded to ``act_dtype`` (what the unsplit GEMM would have stored; also
    the default out_dtype and, with quant_fp8, the dtype y is rounded to before quantizing).

    clamp: (alpha, limit) for gpt-oss's clamped SwiGLU instead: gate = min(gate, limit),
    up = clamp(up, -limit, limit), gate * sigmoid(alpha * gate) * (up + 1).

    row_ids: optional int [M]; rows with a negative id are skipped (left unwritten).
    quant_fp8: returns (q e4m3 [M, N], s fp32 [M, ceil(N/group)]) instead (group = TOKEN_GROUP:
    s [M, 1], one scale per row), quantized like :func:`moetool.kernels.quant.fp8_act_quant`
    from the product rounded to x's dtype (what the engine stores and then quantizes).
    """
    check(x.dim() in (2, 3) and x.is_contiguous(), "silu_and_mul: x must be [M, 2N] or [S, M, 2N], contiguous")
    check(x.dtype in FLOAT_ACTS and (x.dim() == 2 or x.dtype == torch.float32),
          f"silu_and_mul: x has dtype {x.dtype} (split-K partials: float32)")
    check(x.shape[-1] % 2 == 0, f"silu_and_mul: x has an odd number of columns {x.shape[-1]}")
    check(act_dtype is None or act_dtype in FLOAT_ACTS, f"silu_and_mul: act_dtype must be a float dtype, got {act_dtype}")
    check_device(_silu_mul_kernel, x)
    check(x.dim() == 2 or x.shape[0] >= 1, "silu_and_mul: split-K partials x [S, M, 2N] need S >= 1")
    check(out_dtype is None or out_dtype in FLOAT_ACTS, f"silu_and_mul: out_dtype must be a float dtype, got {out_dtype}")
    splits = x.shape[0] if x.dim() == 3 else 0
    act_dtype = act_dtype or x.dtype
    M, N = x.shape[-2], x.shape[-1] // 2
    if row_ids is not None:
        check(row_ids.numel() == M and row_ids.is_contiguous(), "silu_and_mul: row_ids must be [M], contiguous")
    per_token = quant_fp8 and group == TOKEN_GROUP
    if quant_fp8 and not per_token:
        check(group >= 16 and group & (group - 1) == 0,
              f"silu_and_mul: the fp8 group must be a power of two >= 16 or TOKEN_GROUP, got {group}")
    dev = x.device
    if quant_fp8:
        y = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=dev)
        ys = torch.empty((M, act_scale_cols(N, group)), dtype=torch.float32, device=dev)
        block_n = min(triton.next_power_of_2(max(N, 16)), _TOKEN_BLOCK_N) if per_token else group
    else:
        y = torch.empty((M, N), dtype=out_dtype or act_dtype, device=dev)
        ys = y
        block_n = min(1024, triton.next_power_of_2(max(N, 16)))
    if M and N:
        if soft_fp8 is None:
            soft_fp8 = is_interpreted(_silu_mul_kernel)
        y_arg = y.view(torch.uint8) if quant_fp8 and soft_fp8 else y
        # the interpreter pays per program: its blocks never shrink (the values do not depend on them)
        block_m, block_n = silu_blocks(M, N, block_n, bool(quant_fp8), per_token,
                                       1 if is_interpreted(_silu_mul_kernel) else MIN_PROGRAMS)
        grid = (triton.cdiv(M, block_m), 1 if per_token else triton.cdiv(N, block_n))
        _silu_mul_kernel[grid](
            x, y_arg, ys, row_ids if row_ids is not None else x, M, N,
            float(clamp[0]) if clamp else 1.0, float(clamp[1]) if clamp else 0.0, max(splits, 1),
            x.stride(0) if splits else 0, x.stride(-2), x.stride(-1), y.stride(0), y.stride(1), ys.stride(0),
            ys.stride(1),
            CLAMPED=clamp is not None, HAS_IDS=row_ids is not None, QUANT_FP8=bool(quant_fp8), TWO_PASS=per_token and N > block_n,
            ROUND=ROUND_CODE[act_dtype] if quant_fp8 else 0, SOFT_FP8=bool(soft_fp8), SPLITS=splits > 0,
            ROUND_IN=ROUND_CODE[act_dtype] if splits else 0, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
        )
    return (y, ys) if quant_fp8 else y


def silu_and_mul_ref(x: torch.Tensor, clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """x [M, 2N] -> fp32 [M, N] = silu(gate) * up, or with ``clamp`` = (alpha, limit) gpt-oss's
    clamped SwiGLU (see :func:`silu_and_mul`)."""
    gu = x.float()
    N = gu.shape[1] // 2
    g, u = gu[:, :N], gu[:, N:]
    if clamp is None:
        return F.silu(g) * u
    alpha, limit = clamp
    g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return g * torch.sigmoid(g * alpha) * (u + 1)
