"""The sum over each token's k slots (step 5 of :func:`moetool.kernels.fused_moe.fused_experts`):
out[t] = sum over slots j with id >= 0 of c[t*k + j], in slot order, in fp32:
:func:`moe_sum` and its reference :func:`moe_sum_ref` (bit-exact).

Letters: T = tokens, k = slots per token, H = hidden size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check, check_device, round_to_bf16


@triton.jit
def _moe_sum_kernel(c_ptr, ids_ptr, out_ptr, H, splits, stride_cs, stride_cp, stride_ch, stride_ot, stride_oh,
                    TOPK: tl.constexpr, BLOCK_H: tl.constexpr, OUT_BF16: tl.constexpr, SPLITS: tl.constexpr,
                    PAIR_BF16: tl.constexpr):
    """out[t] = sum_j (ids[t, j] >= 0 ? c[t*TOPK + j] : 0), in slot order j = 0..TOPK-1, in fp32;
    OUT_BF16: rounded once to bfloat16 (nearest even) on the store. SPLITS: c holds ``splits``
    fp32 partials of each pair's row, ``stride_cs`` apart: a pair's row is their sum in slice
    order, rounded to bf16 first when PAIR_BF16 (as an unsplit GEMM's bf16 row)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        p = t * TOPK + j
        valid = tl.load(ids_ptr + p + tl.zeros_like(cols)) >= 0  # [BH], one id broadcast
        if SPLITS:
            row = tl.zeros([BLOCK_H], dtype=tl.float32)
            for s in range(splits):
                row += tl.load(c_ptr + s * stride_cs + p * stride_cp + cols * stride_ch, mask=hmask & valid, other=0.0)
            if PAIR_BF16:
                row = round_to_bf16(row)
            acc += row
        else:
            acc += tl.load(c_ptr + p * stride_cp + cols * stride_ch, mask=hmask & valid, other=0.0).to(tl.float32)
    if OUT_BF16:
        tl.store(out_ptr + t * stride_ot + cols * stride_oh, round_to_bf16(acc).to(tl.bfloat16), mask=hmask)
    else:
        tl.store(out_ptr + t * stride_ot + cols * stride_oh, acc, mask=hmask)


#: what moe_sum / fused_experts can write: fp32, or bf16 rounded once from the fp32 sum
OUT_DTYPES = (torch.float32, torch.bfloat16)


def moe_sum(c: torch.Tensor, topk_ids: torch.Tensor, out_dtype: torch.dtype = torch.float32,
            out: torch.Tensor | None = None, pair_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """c [T*k, H] (rows of dropped pairs may hold anything), topk_ids [T, k] -> [T, H] out_dtype
    (fp32, or bf16 rounded from the fp32 sum), into ``out`` when given (out_dtype, [T, H]).

    c may also be fp32 [S, T*k, H], the S partials of a split-K GEMM: a pair's row is their sum
    (slice order, fp32) rounded to ``pair_dtype`` (bf16: as the unsplit GEMM's bf16 row)."""
    check(out_dtype in OUT_DTYPES, f"moe_sum: out_dtype must be float32 or bfloat16, got {out_dtype}")
    check(pair_dtype in OUT_DTYPES, f"moe_sum: pair_dtype must be float32 or bfloat16, got {pair_dtype}")
    check(topk_ids.dim() == 2 and topk_ids.is_contiguous(), "moe_sum: topk_ids must be [T, k], contiguous")
    T, k = topk_ids.shape
    check(c.dim() in (2, 3) and c.shape[-2] == T * k and c.is_contiguous() and (c.dim() == 2 or c.dtype == torch.float32),
          "moe_sum: c must be [T*k, H] (or float32 [S, T*k, H]), contiguous")
    check(c.dim() == 2 or c.shape[0] >= 1, "moe_sum: split-K partials c [S, T*k, H] need S >= 1")
    splits = c.shape[0] if c.dim() == 3 else 0
    H = c.shape[-1]
    out = check_out(out, T, H, out_dtype, c.device)
    check_device(_moe_sum_kernel, c, topk_ids, out)
    if T and H:
        if k == 0:
            return out.zero_()
        block_h = min(1024, triton.next_power_of_2(H))
        _moe_sum_kernel[(T, triton.cdiv(H, block_h))](
            c, topk_ids, out, H, max(splits, 1), c.stride(0) if splits else 0, c.stride(-2), c.stride(-1),
            out.stride(0), out.stride(1), TOPK=k, BLOCK_H=block_h, OUT_BF16=out_dtype == torch.bfloat16,
            SPLITS=splits > 0, PAIR_BF16=pair_dtype == torch.bfloat16, num_warps=4,
        )
    return out


def check_out(out: torch.Tensor | None, T: int, H: int, out_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``out`` checked against [T, H] out_dtype, or a new tensor."""
    if out is None:
        return torch.empty((T, H), dtype=out_dtype, device=device)
    check(out.dtype == out_dtype and tuple(out.shape) == (T, H),
          f"out must be {out_dtype} [{T}, {H}], got {out.dtype} {list(out.shape)}")
    return out


def moe_sum_ref(c: torch.Tensor, topk_ids: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                pair_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference of :func:`moe_sum` (same slice and slot order, so bit-exact)."""
    T, k = topk_ids.shape
    if c.dim() == 3:  # split-K partials: each pair's row first
        rows = torch.zeros(c.shape[1:], dtype=torch.float32, device=c.device)
        for part in c:
            rows += part
        c = rows.to(pair_dtype)
    c3 = torch.where((topk_ids >= 0)[:, :, None], c.reshape(T, k, c.shape[-1]).float(), 0.0)
    out = torch.zeros((T, c.shape[1]), dtype=torch.float32, device=c.device)
    for j in range(k):
        out += c3[:, j]
    return out.to(out_dtype)
