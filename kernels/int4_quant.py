"""int4 group quantization and compressed-tensors pack-quantized packing (W4A16), the Triton
kernel and its pure-torch reference (bit-exact with each other).

Letters: N = rows (output features), K = columns (input features), g = int4 group size.

* :func:`int4_group_quant_pack` w [N, K] -> compressed-tensors pack-quantized tensors
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetool.errors import MoetoolError

from .common import AMAX_EPS, check_2d_contiguous, check_device, check_float, rint_small, round_to_bf16


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


# ---------------------------------------------------------------------------------------------
# int4 group quantization + pack-quantized packing (compressed-tensors W4A16)
# ---------------------------------------------------------------------------------------------

_SCALE_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@triton.jit
def _round_scale(s, SCALE_KIND: tl.constexpr):
    """fp32 scale -> the value it has once stored in the scale dtype (0 fp32, 1 fp16, 2 bf16),
    floored at that dtype's smallest subnormal (changes fp16 only: 2^-24)."""
    if SCALE_KIND == 1:
        s = tl.maximum(s, 5.9604644775390625e-08).to(tl.float16).to(tl.float32)
    elif SCALE_KIND == 2:
        s = round_to_bf16(s)
    return s


@triton.jit
def _int4_scales(a, b, ratio, SYMMETRIC: tl.constexpr, SCALE_KIND: tl.constexpr):
    """Group scales and zero points for a clip ratio (``moetool.formats``' ``_group_scales``).

    Symmetric: a = max |w| floored at 1e-12, b unused; s = dtype(a * ratio / 7.5), z = 0.
    Asymmetric: a = min(min w, 0), b = max(max w, 0); lo = a * ratio, hi = b * ratio,
    s = dtype(max(hi - lo, 1e-12) / 15), z = clamp(round(-lo / s) - 8, -8, 7). [BN] each."""
    if SYMMETRIC:
        s = _round_scale(tl.math.div_rn(a * ratio, 7.5), SCALE_KIND)
        z = tl.zeros_like(s)
    else:
        lo = a * ratio
        hi = b * ratio
        s = _round_scale(tl.math.div_rn(tl.maximum(hi - lo, 1e-12), 15.0), SCALE_KIND)
        z = rint_small(tl.clamp(tl.math.div_rn(-lo, s), -64.0, 64.0)) - 8.0
        z = tl.clamp(z, -8.0, 7.0)
    return s, z


@triton.jit
def _int4_codes(w, s, z):
    """Codes q = clamp(round(w / s) + z, -8, 7) as float32 [BN, BG]."""
    q = rint_small(tl.clamp(tl.math.div_rn(w, s[:, None]), -64.0, 64.0)) + z[:, None]
    return tl.clamp(q, -8.0, 7.0)


@triton.jit
def _pairwise_sum(x, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, LOG2_G: tl.constexpr):
    """x [BN, BG] (BG a power of two) -> [BN]: element j + width/2 added to element j, width
    halving down to 1, as :func:`pairwise_sum_ref`: one order of additions, whatever the
    layout (two operands per addition, and a + b == b + a)."""
    for level in tl.static_range(LOG2_G):
        x = tl.sum(tl.reshape(x, [BLOCK_N, 2, BLOCK_G >> (level + 1)]), axis=1)
    return tl.reshape(x, [BLOCK_N])


@triton.jit
def _int4_clip_error(w, mask, a, b, ratio, SYMMETRIC: tl.constexpr, SCALE_KIND: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, LOG2_G: tl.constexpr):
    """sum ((q - z) * s - w)^2 per row for the group clipped to ``ratio`` [BN]: float32,
    pairwise; lanes outside the group add 0."""
    s, z = _int4_scales(a, b, ratio, SYMMETRIC, SCALE_KIND)
    d = (_int4_codes(w, s, z) - z[:, None]) * s[:, None] - w
    d = tl.where(mask, d, 0.0)
    return _pairwise_sum(d * d, BLOCK_N, BLOCK_G, LOG2_G)


@triton.jit
def _int4_quant_pack_kernel(
    w_ptr, qp_ptr, s_ptr, zp_ptr,
    N, K, G, KW, NW,
    stride_wn, stride_wk, stride_qn, stride_qk, stride_sn, stride_sk, stride_zn, stride_zk,
    SYMMETRIC: tl.constexpr, SCALE_KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    LOG2_G: tl.constexpr, MSE_STEP: tl.constexpr, MSE_COARSE: tl.constexpr, MSE_LEVELS: tl.constexpr,
):
    """One program: rows [pid_n*BLOCK_N, +BLOCK_N) x group pid_g (columns [pid_g*G, +G)) of w [N, K].

    Writes weight_packed [N, KW] int32 (K packed 8 per word), weight_scale [N, ceil(K/G)] and,
    asymmetric, weight_zero_point [NW, ceil(K/G)] int32 (N packed 8 per word). G % 8 == 0,
    BLOCK_G = next_pow2(G), BLOCK_N % 8 == 0. Padding nibbles are 0.
    MSE_COARSE > 0: the clip ratio search of :func:`int4_group_quant_pack_ref` (ratios
    1 - i * MSE_STEP for i < MSE_COARSE, then MSE_LEVELS refinements), else ratio 1.
    """
    pid_n = tl.program_id(0)
    pid_g = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    lcol = tl.arange(0, BLOCK_G)  # [BG]
    cols = pid_g * G + lcol
    rmask = rows < N
    mask = rmask[:, None] & ((lcol < G) & (cols < K))[None, :]
    rows64 = rows.to(tl.int64)
    w = tl.load(w_ptr + rows64[:, None] * stride_wn + cols[None, :] * stride_wk, mask=mask, other=0.0)
    w = w.to(tl.float32)
    if SYMMETRIC:
        a = tl.maximum(tl.max(tl.abs(w), axis=1), 1e-12)  # [BN]
        b = a
    else:
        a = tl.minimum(tl.min(w, axis=1), 0.0)  # masked entries are 0: no effect
        b = tl.maximum(tl.max(w, axis=1), 0.0)
    ratio = tl.full([BLOCK_N], 1.0, tl.float32)
    if MSE_COARSE > 0:
        best = _int4_clip_error(w, mask, a, b, ratio, SYMMETRIC, SCALE_KIND, BLOCK_N, BLOCK_G, LOG2_G)
        for i in tl.static_range(1, MSE_COARSE):
            candidate = tl.full([BLOCK_N], 1.0 - i * MSE_STEP, tl.float32)
            err = _int4_clip_error(w, mask, a, b, candidate, SYMMETRIC, SCALE_KIND, BLOCK_N, BLOCK_G, LOG2_G)
            better = err < best  # ties keep the earlier ratio; NaN never wins
            best = tl.where(better, err, best)
            ratio = tl.where(better, candidate, ratio)
        for level in tl.static_range(MSE_LEVELS):
            around = ratio
            for sign in tl.static_range(2):
                candidate = around + (1.0 - 2.0 * sign) * (MSE_STEP / (2 << level))
                err = _int4_clip_error(w, mask, a, b, candidate, SYMMETRIC, SCALE_KIND, BLOCK_N, BLOCK_G, LOG2_G)
                better = err < best
                best = tl.where(better, err, best)
                ratio = tl.where(better, candidate, ratio)
    s, z = _int4_scales(a, b, ratio, SYMMETRIC, SCALE_KIND)
    q = _int4_codes(w, s, z).to(tl.int32)
    u = tl.where(mask, q + 8, 0)  # [BN, BG] nibble values
    shifts = tl.arange(0, 8) * 4
    words = tl.sum(tl.reshape(u, [BLOCK_N, BLOCK_G // 8, 8]) << shifts[None, None, :], axis=2)
    lw = tl.arange(0, BLOCK_G // 8)
    wcols = pid_g * (G // 8) + lw
    wmask = rmask[:, None] & ((lw < G // 8) & (wcols < KW))[None, :]
    tl.store(qp_ptr + rows64[:, None] * stride_qn + wcols[None, :] * stride_qk, words, mask=wmask)
    tl.store(s_ptr + rows64 * stride_sn + pid_g * stride_sk, s.to(s_ptr.dtype.element_ty), mask=rmask)
    if not SYMMETRIC:
        zu = tl.where(rmask, z.to(tl.int32) + 8, 0)  # [BN]
        zwords = tl.sum(tl.reshape(zu, [BLOCK_N // 8, 8]) << shifts[None, :], axis=1)  # [BN/8]
        zrows = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        tl.store(zp_ptr + zrows * stride_zn + pid_g * stride_zk, zwords, mask=zrows < NW)


def _check_search(mse_search: tuple[float, int, int] | None) -> tuple[float, int, int]:
    """``mse_search`` -> (step, coarse candidates, refinement levels); (0.0, 0, 0) for None."""
    if mse_search is None:
        return 0.0, 0, 0
    step, coarse, levels = mse_search
    if not (0 < step and isinstance(coarse, int) and coarse >= 1 and isinstance(levels, int) and levels >= 0
            and (1 - (coarse - 1) * step) - step / 2 > 0):
        raise MoetoolError(f"int4 mse search must be (step > 0, coarse >= 1, levels >= 0) with ratios > 0, "
                           f"got {mse_search}")
    return float(step), coarse, levels


def int4_group_quant_pack(
    w: torch.Tensor, group_size: int, symmetric: bool = True, scale_dtype: torch.dtype = torch.bfloat16,
    mse_search: tuple[float, int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized int4 (W4A16) quantization of one weight.

    w [N, K] fp32/fp16/bf16, contiguous; group_size g (multiple of 8) along K ->
    {"weight_packed": int32 [N, ceil(K/8)] (element 8w+i in bits [4i, 4i+4) of word w, as q+8),
     "weight_scale": scale_dtype [N, ceil(K/g)], "weight_shape": int32 [2] = (N, K),
     asymmetric also "weight_zero_point": int32 [ceil(N/8), ceil(K/g)] (z+8 packed along N)}.
    Dequant: (q - z) * s (z = 0 symmetric). Symmetric scales map max |w| to 7.5 (as
    compressed-tensors). ``mse_search`` (step, coarse, levels): each group's clip ratio is
    searched as :func:`int4_group_quant_pack_ref` says; None: ratio 1. Scales are floored at
    the scale dtype's smallest subnormal (matters for fp16 only). K need not divide by g (the
    last group is partial), unlike ``moetool.formats`` which insists on whole groups. Not
    checked here: NaN/Inf input and fp16 scale overflow (``moetool.formats`` raises on both
    before quantizing).
    """
    check_2d_contiguous("w", w)
    check_float("w", w)
    check_device(_int4_quant_pack_kernel, w)
    if group_size <= 0 or group_size % 8:
        raise MoetoolError(f"int4 group size must be a positive multiple of 8, got {group_size}")
    if scale_dtype not in _SCALE_KINDS:
        raise MoetoolError(f"int4 scale dtype must be fp32/fp16/bf16, got {scale_dtype}")
    step, coarse, levels = _check_search(mse_search)
    N, K = w.shape
    nG, KW, NW = triton.cdiv(K, group_size), triton.cdiv(K, 8), triton.cdiv(N, 8)
    dev = w.device
    out = {
        "weight_packed": torch.empty((N, KW), dtype=torch.int32, device=dev),
        "weight_scale": torch.empty((N, nG), dtype=scale_dtype, device=dev),
        "weight_shape": torch.tensor([N, K], dtype=torch.int32, device=dev),
    }
    zp = torch.empty((NW, nG), dtype=torch.int32, device=dev)
    if not symmetric:
        out["weight_zero_point"] = zp
    if N == 0 or K == 0:
        zp.zero_()
        return out
    block_g = triton.next_power_of_2(group_size)
    block_n = max(8, min(64, 4096 // block_g))
    grid = (triton.cdiv(N, block_n), nG)
    qp, s = out["weight_packed"], out["weight_scale"]
    _int4_quant_pack_kernel[grid](
        w, qp, s, zp, N, K, group_size, KW, NW,
        w.stride(0), w.stride(1), qp.stride(0), qp.stride(1), s.stride(0), s.stride(1),
        zp.stride(0), zp.stride(1),
        SYMMETRIC=bool(symmetric), SCALE_KIND=_SCALE_KINDS[scale_dtype], BLOCK_N=block_n, BLOCK_G=block_g,
        LOG2_G=block_g.bit_length() - 1, MSE_STEP=step, MSE_COARSE=coarse, MSE_LEVELS=levels,
        num_warps=4, enable_fp_fusion=False,  # (q - z) * s - w and the sums rounded as the torch code does
    )
    return out


def pack_int4_ref(u: torch.Tensor) -> torch.Tensor:
    """Nibbles u int [R, C] in [0, 16) -> int32 [R, ceil(C/8)], element 8w+i in bits [4i, 4i+4)
    of word w; padding nibbles are 0."""
    R, C = u.shape
    u = _pad_to(u.to(torch.int64), R, -(-C // 8) * 8).view(R, -1, 8)
    shifts = torch.arange(8, device=u.device, dtype=torch.int64) * 4
    words = (u << shifts).sum(dim=2)  # < 2^32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4_ref(words: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4_ref`: int32 [R, W] -> nibbles int32 [R, cols] in [0, 16)."""
    shifts = torch.arange(8, device=words.device, dtype=torch.int32) * 4
    u = (words[:, :, None] >> shifts) & 0xF  # [R, W, 8]
    return u.reshape(words.shape[0], -1)[:, :cols]


def _scale_in_dtype(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 scales -> ``dtype``, first raised to dtype's smallest subnormal (as
    ``moetool.formats.common.scale_in_dtype``): only fp16 is affected, where the scale of an
    all-zero group would otherwise flush to 0 and give 0/0."""
    info = torch.finfo(dtype)
    return s.clamp(min=info.tiny * info.eps).to(dtype)


def pairwise_sum_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., P] (P a power of two) -> [...]: element j + P/2 added to element j, then the same
    on the first half, down to one element (the order ``_pairwise_sum`` adds in)."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _int4_scales_ref(span: tuple[torch.Tensor, torch.Tensor], ratio, symmetric: bool, scale_dtype: torch.dtype):
    """(s float32, z float32 or None) of groups clipped to ``ratio`` (see ``_int4_scales``)."""
    a, b = span
    if symmetric:
        return _scale_in_dtype(a * ratio / 7.5, scale_dtype).float(), None
    lo, hi = a * ratio, b * ratio
    s = _scale_in_dtype((hi - lo).clamp(min=AMAX_EPS) / 15.0, scale_dtype).float()
    return s, (torch.round(-lo / s) - 8).clamp(-8, 7)


def _int4_codes_ref(w32: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
    """w32 [N, nG, P], s and z [N, nG] -> codes q float32 [N, nG, P], z added and clamped."""
    q = torch.round(w32 / s[:, :, None])
    if z is not None:
        q = q + z[:, :, None]
    return q.clamp(-8, 7)


def int4_group_quant_pack_ref(
    w: torch.Tensor, group_size: int, symmetric: bool = True, scale_dtype: torch.dtype = torch.bfloat16,
    mse_search: tuple[float, int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Reference of :func:`int4_group_quant_pack` (same inputs, same dict, bit-exact).

    Per group (zeros pad the last one to g, and every one to P = next_pow2(g)), for a clip
    ratio r: symmetric s = dtype(max(max |w|, 1e-12) * r / 7.5), z = 0; asymmetric
    lo = min(min w, 0) * r, hi = max(max w, 0) * r, s = dtype(max(hi - lo, 1e-12) / 15),
    z = clamp(round(-lo / s) - 8, -8, 7); then q = clamp(round(w / s) + z, -8, 7).
    r = 1 without ``mse_search``. With (step, coarse, levels): the candidates are
    1 - i * step for i < coarse, in that order, then for each level l = 1..levels, around the
    best so far r*: r* + step / 2^l, r* - step / 2^l. A candidate's error is
    ``pairwise_sum_ref`` of ((q - z) * s - w)^2 in float32; it replaces the best only when
    strictly smaller (ties keep the earlier; NaN, from a scale that overflows fp16, never wins).
    """
    N, K = w.shape
    g = group_size
    nG = -(-K // g)
    P = 1 << (g - 1).bit_length()
    w32 = torch.nn.functional.pad(_pad_to(w.float(), N, nG * g).view(N, nG, g), (0, P - g))  # [N, nG, P]
    if symmetric:
        span = (w32.abs().amax(dim=2).clamp(min=AMAX_EPS), None)  # [N, nG]
    else:
        span = (w32.amin(dim=2).clamp(max=0.0), w32.amax(dim=2).clamp(min=0.0))

    def error(ratio):
        s, z = _int4_scales_ref(span, ratio, symmetric, scale_dtype)
        q = _int4_codes_ref(w32, s, z)
        if z is not None:
            q = q - z[:, :, None]
        return pairwise_sum_ref(torch.square(q * s[:, :, None] - w32))

    ratio = torch.ones(N, nG, device=w.device)
    if mse_search is not None:
        step, coarse, levels = mse_search
        best = error(ratio)

        def consider(candidate):
            nonlocal best, ratio
            err = error(candidate)
            better = err < best
            best = torch.where(better, err, best)
            ratio = torch.where(better, candidate, ratio)

        for i in range(1, coarse):
            consider(torch.full_like(ratio, 1.0 - i * step))
        for level in range(1, levels + 1):
            around = ratio
            consider(around + step / 2**level)
            consider(around - step / 2**level)
    s, z = _int4_scales_ref(span, ratio, symmetric, scale_dtype)
    q = _int4_codes_ref(w32, s, z)[:, :, :g]
    u = (q.to(torch.int32) + 8).reshape(N, nG * g)[:, :K]
    out = {
        "weight_packed": pack_int4_ref(u),
        "weight_scale": s.to(scale_dtype),
        "weight_shape": torch.tensor([N, K], dtype=torch.int32, device=w.device),
    }
    if z is not None:
        out["weight_zero_point"] = pack_int4_ref((z.to(torch.int32) + 8).t()).t().contiguous()
    return out


def int4_dequant_ref(t: dict[str, torch.Tensor], shape: tuple[int, int], group_size: int) -> torch.Tensor:
    """pack-quantized tensors of one linear (see :func:`int4_group_quant_pack`) -> fp32 [N, K]."""
    N, K = shape
    g = group_size
    q = unpack_int4_ref(t["weight_packed"], K) - 8  # [N, K]
    s = t["weight_scale"].float().repeat_interleave(g, 1)[:, :K]
    if "weight_zero_point" in t:
        z = (unpack_int4_ref(t["weight_zero_point"].t().contiguous(), N) - 8).t()  # [N, nG]
        q = q - z.repeat_interleave(g, 1)[:, :K]
    return q.float() * s
