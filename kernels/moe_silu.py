"""silu(gate) * up over the grouped GEMM's [P, 2N] output, optionally quantized to fp8 per
1x128 group (step 3 of :func:`moetool.kernels.fused_moe.fused_experts`): :func:`silu_and_mul`
and its reference :func:`silu_and_mul_ref`.

Letters: M = rows (token-slot pairs), N = expert intermediate size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import FLOAT_ACTS, FP8_BLOCK, check, check_device, e4m3_rne, is_interpreted


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
    check(x.dim() == 2 and x.is_contiguous(), "silu_and_mul: x must be 2-D and contiguous")
    check(x.dtype in FLOAT_ACTS, f"silu_and_mul: x has dtype {x.dtype}")
    check(x.shape[1] % 2 == 0, f"silu_and_mul: x has an odd number of columns {x.shape[1]}")
    check_device(_silu_mul_kernel, x)
    M, N = x.shape[0], x.shape[1] // 2
    if row_ids is not None:
        check(row_ids.numel() == M and row_ids.is_contiguous(), "silu_and_mul: row_ids must be [M], contiguous")
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
