"""fp8 quantization kernels and their pure-torch references (bit-exact with each other).

Letters: N = rows (output features), K = columns (input features), T = tokens, H = hidden,
B = block / group edge (128 for fp8).

* :func:`fp8_block_quant`   w [N, K] -> q e4m3 [N, K], s fp32 [ceil(N/B), ceil(K/B)]  (DeepSeek-V3)
* :func:`fp8_act_quant`     x [T, H] -> q e4m3 [T, H], s fp32 [T, ceil(H/B)]          (per-token group)
                            or, with group = TOKEN_GROUP, s fp32 [T, 1]              (per token)

fp8 formula, per block:  s = clamp(amax, 1e-12) / 448 (fp32);  q = e4m3(clamp(w / s, +-448)),
w ~= q * s. Divisions are IEEE correctly rounded (``tl.math.div_rn``), casts round to nearest
even, so the kernels equal the references byte for byte.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetool.errors import MoetoolError

from .common import (
    AMAX_EPS,
    FP8_MAX,
    TOKEN_GROUP,
    check_2d_contiguous,
    check_device,
    check_float,
    e4m3_rne,
    is_interpreted,
)

# ---------------------------------------------------------------------------------------------
# fp8 e4m3: block (weights) and per-token-group (activations) quantization, one kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fp8_quant_kernel(
    x_ptr, q_ptr, s_ptr,
    R, C,
    stride_xr, stride_xc, stride_qr, stride_qc, stride_sr, stride_sc,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROW_WISE: tl.constexpr, SOFT_FP8: tl.constexpr,
):
    """One program quantizes the tile x[pid_r*BLOCK_R :, pid_c*BLOCK_C :] of x [R, C].

    ROW_WISE: one scale per row of the tile (activation groups, s [R, ceil(C/BLOCK_C)]);
    else one scale for the whole tile (weight blocks, s [ceil(R/BLOCK_R), ceil(C/BLOCK_C)]).
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    rmask = rows < R
    mask = rmask[:, None] & (cols < C)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if ROW_WISE:
        amax = tl.max(tl.abs(x), axis=1)  # [BR]
        s = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
        y = tl.math.div_rn(x, s[:, None])
        tl.store(s_ptr + rows64 * stride_sr + pid_c * stride_sc, s, mask=rmask)
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)  # scalar
        s = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
        y = tl.math.div_rn(x, s)
        tl.store(s_ptr + pid_r * stride_sr + pid_c * stride_sc, s)
    q = e4m3_rne(tl.clamp(y, -448.0, 448.0), SOFT_FP8)
    tl.store(q_ptr + rows64[:, None] * stride_qr + cols[None, :] * stride_qc, q, mask=mask)


def _launch_fp8_quant(x, block_r, block_c, row_wise, soft_fp8, s_shape):
    R, C = x.shape
    q = torch.empty((R, C), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(s_shape, dtype=torch.float32, device=x.device)
    if R == 0 or C == 0:
        return q, s
    if soft_fp8 is None:
        soft_fp8 = is_interpreted(_fp8_quant_kernel)
    q_arg = q.view(torch.uint8) if soft_fp8 else q
    grid = (triton.cdiv(R, block_r), triton.cdiv(C, block_c))
    _fp8_quant_kernel[grid](
        x, q_arg, s, R, C,
        x.stride(0), x.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
        BLOCK_R=block_r, BLOCK_C=block_c, ROW_WISE=row_wise, SOFT_FP8=bool(soft_fp8),
        num_warps=8 if block_r * block_c >= 8192 else 4,
    )
    return q, s


@triton.jit
def _fp8_token_quant_kernel(
    x_ptr, q_ptr, s_ptr, T, H, stride_xt, stride_qt, stride_st,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, ONE_PASS: tl.constexpr, SOFT_FP8: tl.constexpr,
):
    """One program quantizes rows [pid*BLOCK_T, +BLOCK_T) of x [T, H] with one scale per row:
    a pass over the row for its amax, then one that stores the codes (ONE_PASS: H <= BLOCK_H,
    the row stays in registers between the two)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_H)  # [BH]
    x_rows = x_ptr + rows64[:, None] * stride_xt
    amax = tl.zeros([BLOCK_T], dtype=tl.float32)
    if ONE_PASS:
        mask = rmask[:, None] & (cols < H)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
    else:
        for h0 in range(0, H, BLOCK_H):
            mask = rmask[:, None] & (h0 + cols < H)[None, :]
            x = tl.load(x_rows + h0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    s = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
    tl.store(s_ptr + rows64 * stride_st, s, mask=rmask)
    q_rows = q_ptr + rows64[:, None] * stride_qt
    if ONE_PASS:
        q = e4m3_rne(tl.clamp(tl.math.div_rn(x, s[:, None]), -448.0, 448.0), SOFT_FP8)
        tl.store(q_rows + cols[None, :], q, mask=mask)
    else:
        for h0 in range(0, H, BLOCK_H):
            mask = rmask[:, None] & (h0 + cols < H)[None, :]
            x = tl.load(x_rows + h0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            q = e4m3_rne(tl.clamp(tl.math.div_rn(x, s[:, None]), -448.0, 448.0), SOFT_FP8)
            tl.store(q_rows + h0 + cols[None, :], q, mask=mask)


#: widest row chunk a per-token program holds (one pass at or below it)
_TOKEN_BLOCK_H = 4096


def _launch_fp8_token_quant(x, soft_fp8):
    T, H = x.shape
    q = torch.empty((T, H), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((T, 1), dtype=torch.float32, device=x.device)
    if T == 0:
        return q, s
    if soft_fp8 is None:
        soft_fp8 = is_interpreted(_fp8_token_quant_kernel)
    block_h = min(triton.next_power_of_2(max(H, 16)), _TOKEN_BLOCK_H)
    block_t = max(1, min(16, 2048 // block_h))
    _fp8_token_quant_kernel[(triton.cdiv(T, block_t),)](
        x, q.view(torch.uint8) if soft_fp8 else q, s, T, H, x.stride(0), q.stride(0), s.stride(0),
        BLOCK_T=block_t, BLOCK_H=block_h, ONE_PASS=H <= block_h, SOFT_FP8=bool(soft_fp8),
        num_warps=8 if block_t * block_h >= 4096 else 4,
    )
    return q, s


def fp8_block_quant(w: torch.Tensor, block: int = 128, *, soft_fp8: bool | None = None):
    """DeepSeek-V3 block quantization of one weight.

    w [N, K] fp32/fp16/bf16, contiguous -> (q float8_e4m3fn [N, K],
    s float32 [ceil(N/block), ceil(K/block)]) with w ~= q * s per block (``weight_scale_inv``).
    ``soft_fp8``: force the integer e4m3 rounding path (default: only under the interpreter).
    """
    check_2d_contiguous("w", w)
    check_float("w", w)
    check_device(_fp8_quant_kernel, w)
    if block < 16 or block & (block - 1):
        raise MoetoolError(f"fp8 block size must be a power of two >= 16, got {block}")
    N, K = w.shape
    return _launch_fp8_quant(w, block, block, False, soft_fp8, (triton.cdiv(N, block), triton.cdiv(K, block)))


def fp8_act_quant(x: torch.Tensor, group: int = 128, *, soft_fp8: bool | None = None):
    """Per-token-group fp8 quantization (DeepSeek ``act_quant``), H need not divide by group.

    x [T, H] fp32/fp16/bf16, rows contiguous (the row stride is free) -> (q float8_e4m3fn
    [T, H], s float32 [T, ceil(H/group)]), x ~= q * s per 1 x group slice.
    group = TOKEN_GROUP (0): one scale per token, s float32 [T, 1], any H (FP8_DYNAMIC).
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise MoetoolError(f"x must be 2-D with contiguous rows, got shape {tuple(x.shape)} "
                           f"strides {tuple(x.stride())}")
    check_float("x", x)
    check_device(_fp8_quant_kernel, x)
    if group == TOKEN_GROUP:
        return _launch_fp8_token_quant(x, soft_fp8)
    if group < 16 or group & (group - 1):
        raise MoetoolError(f"fp8 group size must be a power of two >= 16, got {group}")
    T, H = x.shape
    block_r = max(1, min(32, 4096 // group))
    return _launch_fp8_quant(x, block_r, group, True, soft_fp8, (T, triton.cdiv(H, group)))


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def fp8_block_quant_ref(w: torch.Tensor, block: int = 128):
    """Reference of :func:`fp8_block_quant`: w [N, K] -> (q e4m3 [N, K], s fp32 [nN, nK])."""
    N, K = w.shape
    nN, nK = -(-N // block), -(-K // block)
    w32 = _pad_to(w.float(), nN * block, nK * block).view(nN, block, nK, block)
    amax = w32.abs().amax(dim=(1, 3))  # [nN, nK]
    s = amax.clamp(min=AMAX_EPS) / FP8_MAX
    q = (w32 / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nN * block, nK * block)[:N, :K].contiguous(), s


def fp8_act_quant_ref(x: torch.Tensor, group: int = 128):
    """Reference of :func:`fp8_act_quant`: x [T, H] -> (q e4m3 [T, H], s fp32 [T, ceil(H/group)]),
    or s fp32 [T, 1] for group = TOKEN_GROUP."""
    T, H = x.shape
    if group == TOKEN_GROUP:
        x32 = x.float()
        amax = x32.abs().amax(dim=1, keepdim=True) if H else x32.new_zeros(T, 1)
        s = amax.clamp(min=AMAX_EPS) / FP8_MAX  # [T, 1]
        return (x32 / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s
    nG = -(-H // group)
    x32 = _pad_to(x.float(), T, nG * group).view(T, nG, group)
    s = x32.abs().amax(dim=2).clamp(min=AMAX_EPS) / FP8_MAX  # [T, nG]
    q = (x32 / s[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(T, nG * group)[:, :H].contiguous(), s


def fp8_dequant_block_ref(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """q e4m3 [N, K], s fp32 [ceil(N/block), ceil(K/block)] -> fp32 [N, K] (also fits act scales
    with block rows = 1 via :func:`fp8_dequant_act_ref`)."""
    N, K = q.shape
    s_full = s.float().repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]
    return q.float() * s_full


def fp8_dequant_act_ref(q: torch.Tensor, s: torch.Tensor, group: int = 128) -> torch.Tensor:
    """q e4m3 [T, H], s fp32 [T, ceil(H/group)] (group = TOKEN_GROUP: [T, 1]) -> fp32 [T, H]."""
    if group == TOKEN_GROUP:
        return q.float() * s.float()
    return q.float() * s.float().repeat_interleave(group, 1)[:, : q.shape[1]]
