"""FP4 (e2m1) weight quantization and dequantization kernels and their pure-torch references
(bit-exact with each other): NVFP4 and MXFP4 as compressed-tensors stores them.

Letters: N = rows (output features), K = columns (input features), g = group size along K
(16 for NVFP4, 32 for MXFP4), G = K / g.

* :func:`nvfp4_quant`   w [N, K] -> weight_packed uint8 [N, K/2], weight_scale float8_e4m3fn [N, G],
                        weight_global_scale float32 [1];  w ~= e2m1 * weight_scale / weight_global_scale
* :func:`mxfp4_quant`   w [N, K] -> weight_packed uint8 [N, K/2], weight_scale uint8 [N, G] (e8m0,
                        a biased exponent);  w ~= e2m1 * 2^(weight_scale - 127)
* :func:`fp4_dequant`   either of them -> float32 [N, K]

Codes: 4 bits each, bit 3 the sign and bits 0-2 the index of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (the
e2m1 bit pattern); element 2j of a row in the low nibble of byte j, element 2j+1 in the high one.

Formulas, w32 = w.float(), amax = max |w32| over a group of g consecutive elements of a row:

  NVFP4  gs   = 2688 / max(max |w32| over the whole tensor, 1e-12)     2688 = 448 * 6, float32
         s    = e4m3(clamp((amax / 6) * gs, 2^-9, 448))                round to nearest even
         y    = w32 / (float(s) / gs)
  MXFP4  e    = clamp(E(amax) - 2, 0, 254), E(a) = the biased float32 exponent of a after adding
                a quarter of its unit in the last exponent place (a mantissa >= 1.75 rounds up)
         y    = w32 / 2^(e - 127)
  both   code = e2m1(clamp(y, -6, 6)), round to nearest, ties to even, the sign of y kept (a
                small negative y gives -0, code 8)

Every division is IEEE correctly rounded (``tl.math.div_rn``, torch's ``/``), the e4m3 and e2m1
roundings are integer arithmetic here, so the kernels equal the references byte for byte on the
GPU and under the Triton interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetool.errors import MoetoolError

from .common import AMAX_EPS, FP8_MAX, check_2d_contiguous, check_device, check_float, e4m3_rne

FP4_MAX = 6.0
NVFP4_GROUP = 16
MXFP4_GROUP = 32
#: the NVFP4 global scale maps the tensor's amax to the largest e4m3 scale times the largest e2m1
NVFP4_GLOBAL_MAX = FP8_MAX * FP4_MAX
#: the smallest positive e4m3 value: NVFP4 group scales are at least this (an all-zero group too)
E4M3_MIN = 2.0**-9
E8M0_BIAS = 127
#: the largest finite e8m0 code (255 is NaN)
E8M0_MAX_CODE = 254
#: e2m1 magnitudes by code & 7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ---------------------------------------------------------------------------------------------
# pure-torch references
# ---------------------------------------------------------------------------------------------


def e2m1_encode_ref(y: torch.Tensor) -> torch.Tensor:
    """float32 y with |y| <= 6 (clamped, no NaN) -> e2m1 codes uint8, round to nearest even.

    From 1 up the float32 mantissa is rounded to one bit (sign, exponent and that bit are the
    code, less 252 for the exponent bias); below 1 the code is 2|y| rounded to an integer, which
    adding 2^23 in float32 does."""
    bits = y.view(torch.int32)
    sign = (bits >> 28) & 8
    magnitude = bits & 0x7FFFFFFF
    normal = ((magnitude + 0x1FFFFF + ((magnitude >> 22) & 1)) >> 22) - 252
    below_one = (y.abs() * 2.0 + 8388608.0).view(torch.int32) - 0x4B000000
    return (torch.where(magnitude < 0x3F800000, below_one, normal) | sign).to(torch.uint8)


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [16]: the value of every code (8 is -0.0)."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([values, -values])


def e2m1_decode_ref(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> their float32 values."""
    return e2m1_table(codes.device)[codes.long()]


def pack_fp4_ref(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [R, C] (C even) -> uint8 [R, C/2], element 2j in the low nibble of byte j."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_fp4_ref(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4_ref`: uint8 [R, C/2] -> codes uint8 [R, C]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def e8m0_to_float_ref(e: torch.Tensor) -> torch.Tensor:
    """e8m0 codes (uint8 or int, 0..254) -> float32 2^(e - 127), exactly (code 0 is the
    subnormal 2^-127)."""
    e = e.to(torch.int32)
    return torch.where(e > 0, e << 23, 0x400000).view(torch.float32)


def mxfp4_exponent_ref(amax: torch.Tensor) -> torch.Tensor:
    """float32 group maxima -> their e8m0 scale codes (int32): clamp(E(amax) - 2, 0, 254)."""
    return (((amax.view(torch.int32) + 0x200000) >> 23) - 2).clamp(0, E8M0_MAX_CODE)


def nvfp4_global_scale_ref(amax: torch.Tensor) -> torch.Tensor:
    """float32 tensor maxima -> float32 global scales 2688 / max(amax, 1e-12)."""
    return torch.full_like(amax, NVFP4_GLOBAL_MAX) / amax.clamp(min=AMAX_EPS)


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    N, K = w.shape
    if K % group:
        raise MoetoolError(f"fp4 quantization needs K divisible by {group}, got K={K}")
    return w.float().reshape(N, K // group, group)


def nvfp4_quant_ref(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Reference of :func:`nvfp4_quant` (same inputs, same dict, bit-exact)."""
    N, K = w.shape
    groups = _groups(w, NVFP4_GROUP)  # [N, G, 16]
    amax_t = groups.abs().amax() if groups.numel() else torch.zeros((), dtype=torch.float32, device=w.device)
    gs = nvfp4_global_scale_ref(amax_t.reshape(1))
    scale = ((groups.abs().amax(-1) / FP4_MAX) * gs).clamp(E4M3_MIN, FP8_MAX).to(torch.float8_e4m3fn)  # [N, G]
    eff = scale.float() / gs
    y = (groups / eff[..., None]).clamp(-FP4_MAX, FP4_MAX)
    codes = e2m1_encode_ref(y.reshape(N, K))
    return {"weight_packed": pack_fp4_ref(codes), "weight_scale": scale, "weight_global_scale": gs}


def mxfp4_quant_ref(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Reference of :func:`mxfp4_quant` (same inputs, same dict, bit-exact)."""
    N, K = w.shape
    groups = _groups(w, MXFP4_GROUP)  # [N, G, 32]
    e = mxfp4_exponent_ref(groups.abs().amax(-1))  # [N, G]
    y = (groups / e8m0_to_float_ref(e)[..., None]).clamp(-FP4_MAX, FP4_MAX)
    codes = e2m1_encode_ref(y.reshape(N, K))
    return {"weight_packed": pack_fp4_ref(codes), "weight_scale": e.to(torch.uint8)}


def fp4_dequant_ref(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """NVFP4 (``weight_global_scale`` present, one entry) or MXFP4 tensors of one linear ->
    float32 [N, K]: e2m1 * (s / gs), or e2m1 * 2^(e - 127)."""
    values = e2m1_decode_ref(unpack_fp4_ref(t["weight_packed"]))  # [N, K]
    N, K = values.shape
    scale = t["weight_scale"]
    if "weight_global_scale" in t:
        eff = scale.float() / t["weight_global_scale"].float()
    else:
        eff = e8m0_to_float_ref(scale)
    G = scale.shape[1]
    return (values.view(N, G, K // G) * eff[..., None]).view(N, K)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _e2m1_encode(y):
    """float32 y, |y| <= 6, no NaN -> int32 e2m1 codes (as :func:`e2m1_encode_ref`)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 28) & 8
    magnitude = bits & 0x7FFFFFFF
    normal = ((magnitude + 0x1FFFFF + ((magnitude >> 22) & 1)) >> 22) - 252
    # 2|y| is exact, so a fused multiply-add rounds this sum the same as two operations
    below_one = (tl.abs(y) * 2.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return tl.where(magnitude < 0x3F800000, below_one, normal) | sign


@triton.jit
def _e2m1_decode(code):
    """int32 codes 0..15 -> float32 values: index i = code & 7 is i / 2 below 4, else the
    integer (2 + (i & 1)) << ((i >> 1) - 2) (2, 3, 4, 6)."""
    i = code & 7
    large = (2 + (i & 1)) << tl.maximum((i >> 1) - 2, 0)
    value = tl.where(i < 4, i.to(tl.float32) * 0.5, large.to(tl.float32))
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _e4m3_decode(b):
    """int32 e4m3 bit patterns of positive finite values -> float32, exactly."""
    e = b >> 3
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e > 0, normal, m.to(tl.float32) * 0.001953125)


@triton.jit
def _e8m0_decode(e):
    """int32 e8m0 codes 0..254 -> float32 2^(e - 127) (code 0: the subnormal 2^-127)."""
    return tl.where(e > 0, e << 23, 0x400000).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_quant_kernel(
    w_ptr, packed_ptr, scale_ptr, amax_ptr, gs_ptr,
    N, K, stride_wn, stride_pn, stride_sn,
    NV: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: rows [pid_n*BLOCK_N, +BLOCK_N) x columns [pid_k*BLOCK_K, +BLOCK_K) of w [N, K].

    NV: NVFP4 (e4m3 group scales, the global scale from the tensor amax at ``amax_ptr``, written
    to ``gs_ptr`` by program (0, 0)); else MXFP4 (e8m0 group scales). K % GROUP == 0 and
    BLOCK_K % GROUP == 0, so masked columns are whole groups, never stored."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    rmask = rows < N
    mask = rmask[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(w_ptr + rows64[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.reshape(x, [BLOCK_N, BLOCK_K // GROUP, GROUP])
    amax = tl.max(tl.abs(x), axis=2)  # [BN, BG]
    gcols = pid_k * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)  # [BG]
    gmask = rmask[:, None] & (gcols < K // GROUP)[None, :]
    s_ptrs = scale_ptr + rows64[:, None] * stride_sn + gcols[None, :]
    if NV:
        # a NaN amax (NaN in w) stays NaN, as torch's clamp keeps it: the caller checks gs
        gs = tl.math.div_rn(2688.0, tl.maximum(tl.load(amax_ptr), 1e-12, propagate_nan=tl.PropagateNan.ALL))
        s = tl.clamp(tl.math.div_rn(amax, 6.0) * gs, 0.001953125, 448.0)
        s_bits = e4m3_rne(s, True)  # integer rounding: exact on the GPU and interpreted alike
        eff = tl.math.div_rn(_e4m3_decode(s_bits.to(tl.int32)), gs)
        tl.store(s_ptrs, s_bits, mask=gmask)
        if (pid_n == 0) & (pid_k == 0):
            tl.store(gs_ptr, gs)
    else:
        e = ((amax.to(tl.int32, bitcast=True) + 0x200000) >> 23) - 2
        e = tl.minimum(tl.maximum(e, 0), 254)
        eff = _e8m0_decode(e)
        tl.store(s_ptrs, e.to(tl.uint8), mask=gmask)
    y = tl.clamp(tl.math.div_rn(x, eff[:, :, None]), -6.0, 6.0)
    codes = tl.reshape(_e2m1_encode(y), [BLOCK_N, BLOCK_K // 2, 2])
    shifts = tl.arange(0, 2) * 4
    packed = tl.sum(codes << shifts[None, None, :], axis=2)  # [BN, BK/2], < 256
    pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    pmask = rmask[:, None] & (pcols < K // 2)[None, :]
    tl.store(packed_ptr + rows64[:, None] * stride_pn + pcols[None, :], packed.to(tl.uint8), mask=pmask)


def _launch_quant(w: torch.Tensor, nv: bool) -> dict[str, torch.Tensor]:
    check_2d_contiguous("w", w)
    check_float("w", w)
    check_device(_fp4_quant_kernel, w)
    group = NVFP4_GROUP if nv else MXFP4_GROUP
    N, K = w.shape
    if K % group:
        raise MoetoolError(f"{'nv' if nv else 'mx'}fp4 quantization needs K divisible by {group}, got K={K}")
    dev = w.device
    packed = torch.empty((N, K // 2), dtype=torch.uint8, device=dev)
    scale = torch.empty((N, K // group), dtype=torch.uint8, device=dev)  # e4m3 bits for NVFP4
    gs = torch.empty(1, dtype=torch.float32, device=dev)
    if nv:
        # the tensor's amax (reductions propagate NaN, which the caller checks in gs)
        amax = torch.maximum(w.amax(), w.amin().neg()).float().reshape(1) if w.numel() else torch.zeros(1, device=dev)
    if w.numel():
        block_k = min(128, triton.next_power_of_2(K))
        block_n = max(1, 4096 // block_k)
        grid = (triton.cdiv(N, block_n), triton.cdiv(K, block_k))
        _fp4_quant_kernel[grid](
            w, packed, scale, amax if nv else gs, gs, N, K, w.stride(0), packed.stride(0), scale.stride(0),
            NV=nv, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        )
    elif nv:
        gs.copy_(nvfp4_global_scale_ref(torch.zeros(1, device=dev)))
    if nv:
        return {"weight_packed": packed, "weight_scale": scale.view(torch.float8_e4m3fn), "weight_global_scale": gs}
    return {"weight_packed": packed, "weight_scale": scale}


def nvfp4_quant(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """NVFP4 quantization of one weight (compressed-tensors ``nvfp4-pack-quantized``).

    w [N, K] fp32/fp16/bf16, contiguous, K % 16 == 0 -> {"weight_packed": uint8 [N, K/2],
    "weight_scale": float8_e4m3fn [N, K/16], "weight_global_scale": float32 [1]} (module
    docstring). Not checked here: NaN/Inf input (the global scale is then NaN or 0)."""
    return _launch_quant(w, True)


def mxfp4_quant(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """MXFP4 quantization of one weight (compressed-tensors ``mxfp4-pack-quantized``).

    w [N, K] fp32/fp16/bf16, contiguous, K % 32 == 0 -> {"weight_packed": uint8 [N, K/2],
    "weight_scale": uint8 [N, K/32] (e8m0)} (module docstring). Not checked here: NaN/Inf input
    (its group gets a finite scale code and meaningless codes)."""
    return _launch_quant(w, False)


@triton.jit
def _fp4_dequant_kernel(
    packed_ptr, scale_ptr, gs_ptr, out_ptr,
    N, K, stride_pn, stride_sn, stride_on,
    NV: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: the [BLOCK_N, BLOCK_K] tile of out [N, K] = e2m1 * its group's scale."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    byte = tl.load(packed_ptr + rows64[:, None] * stride_pn + (cols // 2)[None, :], mask=mask, other=0)
    code = (byte.to(tl.int32) >> ((cols & 1) * 4)[None, :]) & 0xF
    s = tl.load(scale_ptr + rows64[:, None] * stride_sn + (cols // GROUP)[None, :], mask=mask, other=0).to(tl.int32)
    if NV:
        eff = tl.math.div_rn(_e4m3_decode(s), tl.load(gs_ptr))
    else:
        eff = _e8m0_decode(s)
    tl.store(out_ptr + rows64[:, None] * stride_on + cols[None, :], _e2m1_decode(code) * eff, mask=mask)


def fp4_dequant(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """NVFP4 (with a one-entry ``weight_global_scale``) or MXFP4 tensors of one linear ->
    float32 [N, K], as :func:`fp4_dequant_ref`."""
    packed, scale = t["weight_packed"], t["weight_scale"]
    nv = "weight_global_scale" in t
    check_2d_contiguous("weight_packed", packed)
    check_2d_contiguous("weight_scale", scale)
    check_device(_fp4_dequant_kernel, packed, scale)
    group = NVFP4_GROUP if nv else MXFP4_GROUP
    N, K = packed.shape[0], packed.shape[1] * 2
    scale_dtype = torch.float8_e4m3fn if nv else torch.uint8  # e4m3 scales / e8m0 exponents
    if packed.dtype != torch.uint8 or scale.dtype != scale_dtype or scale.shape != (N, K // group):
        raise MoetoolError(f"fp4 dequant: weight_packed {packed.dtype} {list(packed.shape)} and weight_scale "
                           f"{scale.dtype} {list(scale.shape)} are not one {'nv' if nv else 'mx'}fp4 linear")
    gs = t["weight_global_scale"].float().reshape(-1) if nv else scale
    if nv and gs.numel() != 1:
        raise MoetoolError(f"fp4 dequant: weight_global_scale has {gs.numel()} entries, expected 1")
    out = torch.empty((N, K), dtype=torch.float32, device=packed.device)
    if N and K:
        block_k = min(128, triton.next_power_of_2(K))
        block_n = max(1, 4096 // block_k)
        _fp4_dequant_kernel[(triton.cdiv(N, block_n), triton.cdiv(K, block_k))](
            packed, scale.view(torch.uint8), gs, out, N, K, packed.stride(0), scale.stride(0), out.stride(0),
            NV=nv, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        )
    return out
