"""int4-group: compressed-tensors ``pack-quantized`` W4A16, group-wise int4 weights.

Tensors of one linear (g = group size, G = ceil(K/g)):
  ``weight_packed``      int32 [N, ceil(K/8)]; element 8w+i of a row sits in bits [4i, 4i+4) of
                         word w, stored as the unsigned code q+8. Bits past K are zero.
  ``weight_scale``       [N, G] in the original dtype, the dequantization multiplier
  ``weight_shape``       int32 [2] = [N, K]
  ``weight_zero_point``  (asymmetric only) int32 [ceil(N/8), G]: zero points z+8 packed the same
                         way but along N (element 8w+i of a column in word w of that column)

w ~= (q - z) * s with q, z in [-8, 7] (z = 0 when symmetric). Scales as compressed-tensors
computes them (symmetric: max |w| / 7.5), or clipped per group where that lowers the squared
error (``clip="mse"``, ``mse_clip_ratios``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from moetool.errors import MoetoolError
from moetool.formats.base import CliParam, Tensors, WeightFormat, register
from moetool.formats.common import (
    CompressedTensors,
    cat_row_blocked,
    ceil_div,
    check_suffixes,
    check_tensor,
    abs_max,
    band_rows,
    check_weight,
    check_weight_shape,
    scale_in_dtype,
    scripted,
    split_row_blocked,
    tile_rows,
)
from moetool.formats.fp8_block import AMAX_FLOOR
from moetool.memory import scratch

INT4_MIN, INT4_MAX = -8, 7
#: what max |w| maps to, symmetric: half the code range, as compressed-tensors computes int4
#: scales (max |w| / 7 left the code -8 unused: 6 % more error than llm-compressor's W4A16)
SYMMETRIC_RANGE = (INT4_MAX - INT4_MIN) / 2
#: what max(w, 0) - min(w, 0) maps to, asymmetric: the whole code range
ASYMMETRIC_RANGE = INT4_MAX - INT4_MIN
#: ``Int4Group.clip``: "none", the scale of the group's whole range; "mse", the clip ratio of
#: ``mse_clip_ratios``
CLIPS = ("none", "mse")
#: the candidates of ``mse_clip_ratios``: (coarse step, coarse candidates, refinement levels),
#: ratios 1 - i/16 for i < 6 (1 down to 11/16), then +-1/32 and +-1/64 around the best. On
#: torch.randn and Student-t weights, g128, it finds clips as good as every 1/64 from 1 to
#: 0.69 (21 candidates; 1/128 steps gain < 0.1 %), with 10 candidates
MSE_SEARCH = (1 / 16, 6, 2)
#: elements ``mse_clip_ratios`` searches at a time: the group band and the candidates' codes
#: stay in a core's L2 (3584x1024, g128, one core: 85 ms at 512K, 66 at 256K, 73 at 128K)
MSE_CHUNK = 1 << 18
LITTLE_ENDIAN = sys.byteorder == "little"
NIBBLES_PER_WORD = 8


def _nibble_shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, 4, dtype=torch.int64, device=device)


def pack_int4(q: torch.Tensor, packed_dim: int = 1) -> torch.Tensor:
    """q int8 [N, K] with values in [-8, 7] -> int32 words, 8 codes (q+8) per word.

    packed_dim=1: [N, ceil(K/8)], element 8w+i of a row in bits [4i, 4i+4) of word w.
    packed_dim=0: [ceil(N/8), K], the same along columns (how zero points are stored).
    Padding nibbles past the end are 0, as compressed-tensors' ``pack_to_int32`` writes them.
    """
    if packed_dim == 0:
        return pack_int4(q.t(), packed_dim=1).t().contiguous()
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"pack_int4 needs a 2-D int8 tensor, got {q.dtype} {list(q.shape)}")
    if q.numel() and (int(q.min()) < INT4_MIN or int(q.max()) > INT4_MAX):
        raise ValueError("pack_int4 values must lie in [-8, 7]")
    n, k = q.shape
    words = ceil_div(k, NIBBLES_PER_WORD)
    if LITTLE_ENDIAN and k % NIBBLES_PER_WORD == 0:
        # two nibbles per byte (element 2j low, 2j+1 high), 4 bytes per little-endian word:
        # element 8w+i lands in bits [4i, 4i+4) of word w, as below, in byte-wide passes
        codes = (q + 8).view(torch.uint8)  # [N, K] in [0, 16)
        pairs = torch.empty((n, k // 2), dtype=torch.uint8, device=q.device)  # row-major strides for the view
        torch.bitwise_or(codes[:, 0::2], codes[:, 1::2] << 4, out=pairs)
        return pairs.view(torch.int32)  # [N, K/8]
    codes = (q + 8).to(torch.int32)  # [N, K] in [0, 16)
    if k % NIBBLES_PER_WORD:  # padding nibbles are 0 bits
        codes = torch.nn.functional.pad(codes, (0, words * NIBBLES_PER_WORD - k))
    codes = codes.view(n, words, NIBBLES_PER_WORD)
    # nibble i goes to bits [4i, 4i+4); int32 shifts wrap the top nibble into the sign bit,
    # which is the two's-complement reading of the unsigned word
    packed = torch.empty((n, words), dtype=torch.int32, device=q.device).copy_(codes[..., 0])
    for i in range(1, NIBBLES_PER_WORD):
        packed |= codes[..., i] << (4 * i)
    return packed


def unpack_int4(packed: torch.Tensor, length: int, packed_dim: int = 1) -> torch.Tensor:
    """Inverse of ``pack_int4``: int32 words -> int8 values in [-8, 7], cropped to ``length``
    along ``packed_dim`` (K for weights, N for zero points)."""
    if packed_dim == 0:
        return unpack_int4(packed.t(), length, packed_dim=1).t().contiguous()
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(
            f"unpack_int4 needs a 2-D int32 tensor, got {packed.dtype} {list(packed.shape)}"
        )
    n, words = packed.shape
    if words != ceil_div(length, NIBBLES_PER_WORD):
        raise ValueError(f"{words} int32 words cannot hold {length} int4 values")
    if LITTLE_ENDIAN and packed.is_contiguous():
        pairs = packed.view(torch.uint8)  # [N, 4*words], byte j holds elements 2j (low), 2j+1 (high)
        codes = torch.stack([pairs & 0xF, pairs >> 4], dim=-1).view(n, words * NIBBLES_PER_WORD)
        return codes[:, :length].view(torch.int8) - 8
    shifts = _nibble_shifts(packed.device).to(torch.int32)
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift, then the low nibble
    return codes.reshape(n, words * NIBBLES_PER_WORD)[:, :length].to(torch.int8) - 8


def _stored_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 scales -> the value each has once stored in ``dtype``, as float32, floored at
    dtype's smallest subnormal as ``scale_in_dtype`` does, but an overflow stays inf: a clip
    candidate too large for fp16 loses the search (its error is NaN) instead of raising."""
    info = torch.finfo(dtype)
    return scale.clamp(min=info.tiny * info.eps).to(dtype).float()


def _group_scales(
    span: tuple[torch.Tensor, ...], ratio: torch.Tensor | float, orig_dtype: torch.dtype, final: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales and zero points of groups clipped to ``ratio`` of their range.

    ``span``: (amax,) symmetric, amax = max |w| floored at 1e-12; (low, high) asymmetric,
    low = min(min w, 0), high = max(max w, 0); float32 [B] each, not modified. ``ratio``: a
    float or float32 [B]. Returns (s, z), float32 [B] (z None when symmetric):
      symmetric:  s = dtype(amax * ratio / 7.5)
      asymmetric: lo = low * ratio, hi = high * ratio
                  s = dtype(max(hi - lo, 1e-12) / 15);  z = clamp(round(-lo / s) - 8, -8, 7)
    (``ratio`` 1 is the format's plain scale; ``final``: the scale the format stores, which
    must be finite.)"""
    to_dtype = scale_in_dtype if final else _stored_scale
    if len(span) == 1:
        return to_dtype(span[0] * ratio / SYMMETRIC_RANGE, orig_dtype), None
    low, high = span[0] * ratio, span[1] * ratio
    s = to_dtype((high - low).clamp_(min=AMAX_FLOOR).div_(ASYMMETRIC_RANGE), orig_dtype)
    zero = torch.div(low.neg_(), s).round_().sub_(8).clamp_(INT4_MIN, INT4_MAX)
    return s, zero


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """x [B, n] -> [B], each row summed as a pairwise tree: padded with zeros to P, the next
    power of two, element j + P/2 is added to element j, and again on the first half, down to
    one element. One fixed order of float32 additions, which the Triton kernel repeats on its
    power-of-two block (its padding lanes are zeros too), so both pick the same clip.
    Overwrites x (in place: a transposed copy to sum whole rows cost more than it saved)."""
    n = x.shape[-1]
    while n > 1:
        half = 1 << ((n - 1).bit_length() - 1)  # elements [n - half, half) pair with padding: unchanged
        x[..., : n - half].add_(x[..., half:n])
        n = half
    return x[..., 0]


def mse_clip_ratios(groups: torch.Tensor, symmetric: bool, orig_dtype: torch.dtype) -> torch.Tensor:
    """The clip ratio of ``clip="mse"`` for each group: groups float32 [B, g] -> float32 [B].

    Candidates, in this order (``MSE_SEARCH``): 1, 15/16, ..., 11/16; then around the best so
    far r*: r* + 1/32, r* - 1/32; then around the new best, r* + 1/64, r* - 1/64. Each
    candidate's scale (and zero point) is ``_group_scales`` of that ratio, and its error is
    the float32 squared error of the group dequantized as ``Int4Group.dequantize`` does,
    sum ((q - z) * s - w)^2 with ``pairwise_sum``. A candidate replaces the best only with a
    strictly smaller error: ties keep the earlier one (1 first), and a NaN error (a scale
    too large for fp16) never wins. ``MSE_CHUNK`` elements at a time, through this thread's
    scratch buffer."""
    b, g = groups.shape
    rows = max(1, MSE_CHUNK // g)
    ratio = torch.empty(b, dtype=torch.float32)
    work = scratch("mse_work", min(b, rows) * g, torch.float32)
    for r0 in range(0, b, rows):
        chunk = groups[r0 : r0 + rows]
        ratio[r0 : r0 + rows] = _mse_clip_chunk(chunk, symmetric, orig_dtype, work[: chunk.numel()].view(chunk.shape))
    return ratio


def _mse_clip_chunk(groups: torch.Tensor, symmetric: bool, orig_dtype: torch.dtype, work: torch.Tensor) -> torch.Tensor:
    """``mse_clip_ratios`` of groups [B, g], with ``work`` float32 [B, g] for the codes."""
    if symmetric:
        span = (abs_max(groups, -1).clamp_(min=AMAX_FLOOR),)
    else:
        span = (groups.amin(dim=-1).clamp_(max=0), groups.amax(dim=-1).clamp_(min=0))
    step, coarse, levels = MSE_SEARCH

    def error(ratio):
        s, zero = _group_scales(span, ratio, orig_dtype, final=False)
        q = torch.div(groups, s[:, None], out=work).round_()
        if zero is None:
            q.clamp_(INT4_MIN, INT4_MAX)
        else:  # q - z directly: round(w / s) within [-8 - z, 7 - z] (a clamp to tensor bounds: 4x slower)
            torch.maximum(q, (INT4_MIN - zero)[:, None], out=q)
            torch.minimum(q, (INT4_MAX - zero)[:, None], out=q)
        return pairwise_sum(q.mul_(s[:, None]).sub_(groups).square_())

    best_ratio = torch.ones(groups.shape[0], dtype=torch.float32)
    best_err = error(1.0).clone()
    for i in range(1, coarse):
        err = error(1.0 - i * step)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio.masked_fill_(better, 1.0 - i * step)
    for level in range(levels):
        step /= 2
        around = best_ratio.clone()
        for delta in (step, -step):
            ratio = around + delta
            err = error(ratio)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_ratio = torch.where(better, ratio, best_ratio)
    return best_ratio


def int4_group_quant_ref(
    w: torch.Tensor, group_size: int, symmetric: bool, orig_dtype: torch.dtype, clip: str = "none"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The exact int4 group quantization, w [N, K] (K % group_size == 0) ->
    (q int8 [N, K], s orig_dtype [N, K/g], z int8 [N, K/g] or None when symmetric).

    Per group of g consecutive elements of a row, w32 = w.float(), r = 1 (clip "none") or the
    group's ``mse_clip_ratios`` (clip "mse"):
      symmetric:  s = (clamp(max |w32|, 1e-12) * r / 7.5).to(orig_dtype).float()
                  q = round(w32 / s).clamp(-8, 7)
      asymmetric: lo = min(min w32, 0) * r;  hi = max(max w32, 0) * r
                  s = (clamp(hi - lo, 1e-12) / 15).to(orig_dtype).float()
                  z = (round(-lo / s) - 8).clamp(-8, 7)
                  q = (round(w32 / s) + z).clamp(-8, 7)
    round is torch.round (half to even). Symmetric as compressed-tensors computes it: max |w|
    maps to 7.5, half the code range, so -max|w| gets code -8 and +max|w| is clamped to 7.
    (``scale_in_dtype`` keeps s from rounding to zero: see there; a no-op for bf16 / fp32.)
    """
    n, k = w.shape
    if k % group_size:
        raise MoetoolError(
            f"has K={k} columns, which group size {group_size} does not divide "
            "(compressed-tensors and vLLM need whole groups; pick a divisor of K)"
        )
    w32 = w.float()
    own = w32.data_ptr() != w.data_ptr()  # work in place only in our own copy
    groups = w32.view(n, k // group_size, group_size)
    ratio: torch.Tensor | float = 1.0
    if clip == "mse":
        flat = groups.view(-1, group_size)
        rows = band_rows(flat.shape[0], group_size)
        ratio = torch.cat([mse_clip_ratios(flat[r0 : r0 + rows], symmetric, orig_dtype)
                           for r0 in range(0, flat.shape[0], rows)]).view(n, k // group_size)
    if symmetric:
        span = (abs_max(groups, -1).clamp_(min=AMAX_FLOOR),)
    else:
        span = (groups.amin(dim=-1).clamp_(max=0), groups.amax(dim=-1).clamp_(min=0))
    scale, zero = _group_scales(span, ratio, orig_dtype, final=True)
    q = torch.div(groups, scale[..., None], out=groups if own else None).round_()
    if zero is not None:
        q.add_(zero[..., None])
    q = q.clamp_(INT4_MIN, INT4_MAX).view(n, k).to(torch.int8)
    return q, scale.to(orig_dtype), None if zero is None else zero.to(torch.int8)


def int4_group_quant_measured(
    w: torch.Tensor, group_size: int, symmetric: bool, orig_dtype: torch.dtype, clip: str = "none"
) -> tuple[Tensors, float, float]:
    """``int4_group_quant_ref`` followed by ``pack_int4`` (the format's tensors, bit for bit),
    plus the error sums of their dequantization (sum w32^2, sum ((q - z) * s - w32)^2, float32
    terms as ``Int4Group.dequantize`` computes them, summed in float64 a band at a time).

    CPU, little-endian, K a multiple of 8 and of ``group_size``. A band of whole rows at a time
    (``tile_rows``) goes through per-thread buffers that stay in cache, the codes packed two
    per byte straight from the band; the loop is one TorchScript call (``scripted``).
    ``clip="mse"`` searches each group's clip ratio first (``mse_clip_ratios``, band by band)."""
    n, k = w.shape
    groups_per_row = k // group_size
    rows = tile_rows(n, k)
    packed = torch.empty((n, k // 2), dtype=torch.uint8)
    scale = torch.empty((n, groups_per_row), dtype=orig_dtype)
    zero_point = None if symmetric else torch.empty((n, groups_per_row), dtype=torch.int8)
    ref = scratch("ref", rows * k, torch.float32)
    work = scratch("work", rows * k, torch.float32)
    codes = scratch("codes", rows * k, torch.int8)
    shifted = scratch("pairs", rows * k // 2, torch.int16)
    span = scratch("amax", 2 * rows * groups_per_row, torch.float32)
    ratio = None
    if clip == "mse":
        ratio = torch.empty((n, groups_per_row), dtype=torch.float32)
        for r0 in range(0, n, rows):
            band = ref[: min(rows, n - r0) * k].view(-1, group_size)
            band.view(-1, k).copy_(w[r0 : r0 + rows])
            ratio[r0 : r0 + rows] = mse_clip_ratios(band, symmetric, orig_dtype).view(-1, groups_per_row)
    info = torch.finfo(orig_dtype)
    sig, noise = _int4_group_tiles(w, packed, scale, zero_point, ratio, ref, ref.view(torch.int32), work,
                                   work.view(torch.int32), codes, codes.view(torch.uint8), codes.view(torch.int16),
                                   shifted, span, span.view(torch.int32), rows, group_size, orig_dtype,
                                   info.tiny * info.eps, AMAX_FLOOR, SYMMETRIC_RANGE, float(ASYMMETRIC_RANGE),
                                   INT4_MIN, INT4_MAX)
    if not bool(torch.isfinite(scale).all()):  # as ``scale_in_dtype`` raises it
        raise MoetoolError(f"has values too large for {orig_dtype} scales")
    t = {"weight_packed": packed.view(torch.int32), "weight_scale": scale,
         "weight_shape": torch.tensor([n, k], dtype=torch.int32)}
    if zero_point is not None:
        t["weight_zero_point"] = pack_int4(zero_point, packed_dim=0)
    return t, sig, noise


@scripted
def _int4_group_tiles(w: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor],
                      ratio: Optional[torch.Tensor], ref: torch.Tensor, ref_int32: torch.Tensor, work: torch.Tensor,
                      work_int32: torch.Tensor, codes: torch.Tensor, codes_uint8: torch.Tensor,
                      codes_int16: torch.Tensor, shifted: torch.Tensor, span: torch.Tensor, span_int32: torch.Tensor,
                      rows: int, group_size: int, dtype: torch.dtype, smallest: float, floor: float,
                      symmetric_range: float, asymmetric_range: float, lowest: int, highest: int) -> tuple[float, float]:
    """The loop of ``int4_group_quant_measured`` over bands of ``rows`` rows: w [N, K] ->
    packed uint8 [N, K/2], scale [N, G] (``dtype``), zero_point int8 [N, G] (None: symmetric);
    (sum w32^2, sum ((q - z) * s - w32)^2). ``ratio`` float32 [N, G], the clip (None: 1).
    ``_group_scales`` and ``scale_in_dtype`` as formulas (``smallest``: dtype's smallest
    subnormal; a scale too large for dtype is left inf, for the caller to raise). Buffers
    (each given also as the dtype views TorchScript cannot take): ``ref``, ``work`` float32,
    ``codes`` int8 and ``shifted`` int16 (half as many), a band each; ``span`` float32, two
    per group of a band."""
    n, k = w.size(0), w.size(1)
    g = k // group_size
    sig, noise = 0.0, 0.0
    for r0 in range(0, n, rows):
        m = min(rows, n - r0)
        e = m * k
        w32 = ref[:e]
        groups = w32.view([m, g, group_size])
        w32.view([m, k]).copy_(w[r0:r0 + m])
        x = work[:e].view([m, g, group_size])
        if zero_point is None:  # s = dtype(max |w| * r / 7.5)
            # max |w| per group as one integer max of the bits with the sign cleared
            torch.bitwise_and(ref_int32[:e], 0x7FFFFFFF, out=work_int32[:e])
            torch.amax(work_int32[:e].view([m, g, group_size]), [2], out=span_int32[:m * g].view([m, g]))
            amax = span[:m * g].view([m, g]).clamp_(min=floor)
            if ratio is not None:
                amax = amax * ratio[r0:r0 + m]
            s = (amax / symmetric_range).clamp_(min=smallest).to(dtype).float()
            torch.div(groups, s.unsqueeze(2), out=x).round_()
            zero = s  # unused
        else:  # lo = min(w, 0) * r, hi = max(w, 0) * r; s = dtype((hi - lo) / 15), z = round(-lo / s) - 8
            low = torch.amin(groups, [2]).clamp_(max=0.0)
            high = torch.amax(groups, [2]).clamp_(min=0.0)
            if ratio is not None:
                low, high = low * ratio[r0:r0 + m], high * ratio[r0:r0 + m]
            s = (high - low).clamp_(min=floor).div_(asymmetric_range).clamp_(min=smallest).to(dtype).float()
            zero = torch.div(low.neg_(), s).round_().sub_(8.0).clamp_(lowest, highest)
            torch.div(groups, s.unsqueeze(2), out=x).round_().add_(zero.unsqueeze(2))
            zero_point[r0:r0 + m] = zero
        x.clamp_(lowest, highest)
        scale[r0:r0 + m] = s
        # codes q + 8 in [0, 16), element 2j in the low nibble of byte j, 2j + 1 in the high:
        # as little-endian int16 pairs v = c0 + 256 * c1, v | (v >> 4) holds c0 + 16 * c1 in
        # its low byte, which the conversion to uint8 keeps (contiguous int16 passes: strided
        # byte views took four times as long)
        codes[:e].copy_(work[:e])
        codes_uint8[:e].add_(8)  # q + 8 wraps nothing: [-8, 7] -> [0, 15]
        pairs = codes_int16[:e // 2].view([m, k // 2])
        torch.bitwise_right_shift(pairs, 4, out=shifted[:e // 2].view([m, k // 2])).bitwise_or_(pairs)
        packed[r0:r0 + m].copy_(shifted[:e // 2].view([m, k // 2]))  # the low byte of each
        # error: dequantize's (q - z) * s, element by element
        sig += float(torch.dot(w32, w32))
        if zero_point is not None:
            x.sub_(zero.unsqueeze(2))
        x.mul_(s.unsqueeze(2))
        diff = work[:e].sub_(w32)
        noise += float(torch.dot(diff, diff))
    return sig, noise


def expand_groups(per_group: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """[N, ceil(K/g)] -> [N, K], each value repeated over its group (the last may be partial)."""
    return per_group.repeat_interleave(group_size, dim=1)[:, :k]


@register
@dataclass(frozen=True)
class Int4Group(CompressedTensors, WeightFormat):
    """``group_size``: columns per scale; ``symmetric``: False adds packed zero points;
    ``clip``: "none", scales of the whole group range, or "mse", each group's clip ratio of
    least squared error (``mse_clip_ratios``; the same tensors format, observer "mse").

    ``suffixes`` is per instance: the class attribute is the symmetric set."""

    name: ClassVar[str] = "int4-group"
    suffixes: ClassVar[tuple[str, ...]] = ("weight_packed", "weight_scale", "weight_shape")
    optional_suffixes: ClassVar[tuple[str, ...]] = ("weight_zero_point",)
    # round trip on torch.randn weights (formats/base.py ``tolerance``; quantize_measured, seeds
    # 0-9, 256x256 .. 2048x512 and 300x384, bf16): symmetric rel_err g32 0.095, g64 0.104,
    # g128 0.110 - 0.112, g256 0.120, g512 0.127 (asymmetric 0.081 / 0.092 / 0.102 / 0.110 /
    # 0.118; --int4-clip mse 0.087 / 0.095 / 0.101 / 0.105 / 0.107): the limit holds for groups
    # up to 512 with ~18 % margin
    tolerance: ClassVar[dict[str, float]] = {"rel_err": 0.15, "sqnr_db": 16.4}
    # verify, layer / worst expert measured with `moetool demo --format int4-group` (bf16
    # DeepSeek-V3-style model, H 256, N 192, 16 experts, g64): 0.141 / 0.194 (its chain with
    # --int4-clip mse: 0.130 / 0.177); the limits add margin, an injected fault gives 0.5 - 1.5
    verify_tolerances: ClassVar[dict[str, float]] = {"rel_err": 0.25, "expert_rel_err": 0.35}
    # W4A16: activations stay in the model's dtype
    activation_quant: ClassVar[str | None] = None
    kernel_scheme: ClassVar[str | None] = "int4-group"
    config_label: ClassVar[str] = "int4-group"
    ct_weights: ClassVar[tuple[str, int, str]] = ("int", 4, "group")
    ct_storage: ClassVar[tuple[str, ...]] = ("pack-quantized",)
    cli_flags: ClassVar[tuple[str, ...]] = ("--int4",)
    cli_help: ClassVar[str] = "int4 group W4A16 (compressed-tensors pack-quantized)"
    cli_params: ClassVar[dict[str, CliParam]] = {
        "group_size": CliParam("--group-size", "int4 group size", positive=True),
        "symmetric": CliParam("--symmetric/--asymmetric", "int4 zero point"),
        "clip": CliParam("--int4-clip", "int4 group scales: none (the whole range) or mse (the clip "
                         "ratio of least squared error, searched per group; slower)"),
    }

    group_size: int = 128
    symmetric: bool = True
    clip: str = "none"

    def __post_init__(self) -> None:
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise MoetoolError(f"int4-group group_size must be an integer, got {self.group_size!r}")
        if self.group_size <= 0:
            raise MoetoolError(f"int4-group group_size must be positive, got {self.group_size}")
        if not isinstance(self.symmetric, bool):
            raise MoetoolError(
                f"int4-group symmetric must be true or false, got {self.symmetric!r}"
            )
        if self.clip not in CLIPS:
            raise MoetoolError(f"int4-group clip (--int4-clip) must be {' or '.join(CLIPS)}, got {self.clip!r}")
        if not self.symmetric:
            object.__setattr__(self, "suffixes", (*Int4Group.suffixes, *Int4Group.optional_suffixes))

    def quantize(self, w: torch.Tensor, orig_dtype: torch.dtype) -> Tensors:
        """w [N, K] -> weight_packed, weight_scale, weight_shape (+ weight_zero_point)."""
        check_weight_shape(w)  # finiteness from the group scales below
        n, k = w.shape
        try:
            q, scale, zero_point = int4_group_quant_ref(w, self.group_size, self.symmetric, orig_dtype, self.clip)
        except MoetoolError:
            check_weight(w)  # NaN/Inf in w explains a non-finite scale: say so
            raise
        check_weight(w, scale)
        t = {
            "weight_packed": pack_int4(q),
            "weight_scale": scale,
            "weight_shape": torch.tensor([n, k], dtype=torch.int32, device=w.device),
        }
        if zero_point is not None:
            t["weight_zero_point"] = pack_int4(zero_point, packed_dim=0)
        return t

    def quantize_measured(self, w: torch.Tensor, orig_dtype: torch.dtype) -> tuple[Tensors, float, float]:
        check_weight_shape(w)
        k = w.shape[1]
        if w.device.type != "cpu" or not LITTLE_ENDIAN or k % NIBBLES_PER_WORD or k % self.group_size:
            return super().quantize_measured(w, orig_dtype)
        try:
            t, sig, noise = int4_group_quant_measured(w, self.group_size, self.symmetric, orig_dtype, self.clip)
        except MoetoolError:
            check_weight(w)  # NaN/Inf in w explains a non-finite scale: say so
            raise
        check_weight(w, t["weight_scale"])
        return {s: t[s] for s in self.suffixes}, sig, noise

    def quantize_cuda(self, w: torch.Tensor, orig_dtype: torch.dtype) -> Tensors | None:
        """The Triton kernel ``int4_group_quant_pack`` (the same bytes as ``quantize``) where
        groups are whole words: K % g == 0 and g % 8 == 0."""
        if w.shape[1] % self.group_size or self.group_size % NIBBLES_PER_WORD:
            return None
        from moetool.kernels.int4_quant import int4_group_quant_pack  # imports triton: only for CUDA weights

        search = MSE_SEARCH if self.clip == "mse" else None
        t = int4_group_quant_pack(w.contiguous(), self.group_size, self.symmetric, orig_dtype, search)
        if not bool(torch.isfinite(t["weight_scale"]).all()):
            return None
        return {s: t[s] for s in self.suffixes}

    def dequantize(self, t: Tensors) -> torch.Tensor:
        n, k = self.logical_shape(t)
        q = unpack_int4(t["weight_packed"], k).float()
        zero_point = None if self.symmetric else unpack_int4(t["weight_zero_point"], n, packed_dim=0).float()
        if k % self.group_size == 0:  # broadcast per group, no [N, K] copies of scales
            groups = q.view(n, k // self.group_size, self.group_size)
            if zero_point is not None:
                groups.sub_(zero_point[..., None])
            groups.mul_(t["weight_scale"].float()[..., None])
            return q
        if zero_point is not None:
            q = q - expand_groups(zero_point, self.group_size, k)
        return q * expand_groups(t["weight_scale"].float(), self.group_size, k)

    def stores_like(self, other: WeightFormat) -> bool:
        """The clip only chose the scales: int4 of the same group size and symmetry is copied
        (an mse-clipped input requantized without clip, or the other way, only adds error)."""
        return (type(other) is type(self) and other.group_size == self.group_size
                and other.symmetric == self.symmetric)

    def logical_shape(self, t: Tensors) -> tuple[int, int]:
        """[N, K] from ``weight_shape``; also checks every tensor against it."""
        check_suffixes(self.name, t, self.suffixes)
        shape = check_tensor(t, "weight_shape", (2,), [torch.int32, torch.int64])
        n, k = (int(v) for v in shape)
        if n <= 0 or k <= 0:
            raise MoetoolError(f"weight_shape {[n, k]} is not a valid [N, K]")
        groups = ceil_div(k, self.group_size)
        check_tensor(t, "weight_packed", (n, ceil_div(k, NIBBLES_PER_WORD)), [torch.int32])
        check_tensor(t, "weight_scale", (n, groups), floating=True)
        if not self.symmetric:
            check_tensor(
                t, "weight_zero_point", (ceil_div(n, NIBBLES_PER_WORD), groups), [torch.int32]
            )
        return n, k

    def cat_rows(self, parts: list[Tensors]) -> Tensors:
        """Asymmetric: every part but the last needs N % 8 == 0 (zero points are packed along N)."""
        shapes = [self.logical_shape(part) for part in parts]
        if len({k for _, k in shapes}) > 1:
            raise MoetoolError(f"int4-group: cannot concatenate parts of different K: {shapes}")
        rows = [n for n, _ in shapes]
        t = cat_row_blocked(self.name, parts, rows, self._row_blocks())
        t["weight_shape"] = torch.tensor(  # in the parts' dtype: compressed-tensors writes int64
            [sum(rows), shapes[0][1]], dtype=parts[0]["weight_shape"].dtype, device=t["weight_packed"].device
        )
        return {suffix: t[suffix] for suffix in self.suffixes}

    def split_rows(self, t: Tensors, sizes: list[int]) -> list[Tensors]:
        n, k = self.logical_shape(t)
        parts = split_row_blocked(self.name, t, n, sizes, self._row_blocks())
        for part, size in zip(parts, sizes, strict=True):
            part["weight_shape"] = torch.tensor(
                [size, k], dtype=t["weight_shape"].dtype, device=t["weight_packed"].device
            )
        return [{suffix: part[suffix] for suffix in self.suffixes} for part in parts]

    def _row_blocks(self) -> dict[str, int]:
        """Logical rows per stored row of each tensor that is cut along N."""
        blocks = {"weight_packed": 1, "weight_scale": 1}
        if not self.symmetric:
            blocks["weight_zero_point"] = NIBBLES_PER_WORD
        return blocks

    def quantization_config(self, ignore: list[str]) -> dict | None:
        """compressed-tensors W4A16: int4 weights in groups along K, activations unquantized.
        ``clip="mse"`` is recorded where compressed-tensors keeps how scales were computed, the
        weights' ``observer`` (llm-compressor names its own search "mse" too); "none" writes
        no observer, as llm-compressor's minmax default."""
        weights = {
            "num_bits": 4,
            "type": "int",
            "strategy": "group",
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "dynamic": False,
        }
        if self.clip == "mse":
            weights["observer"] = "mse"
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": None,
                    "output_activations": None,
                }
            },
            "ignore": list(ignore),
            "kv_cache_scheme": None,
        }

    @classmethod
    def params_from_weights(cls, weights: dict) -> dict:
        if weights.get("actorder") == "group":
            raise MoetoolError(
                "unsupported compressed-tensors int4 with actorder 'group' (weight_g_idx)"
            )
        clip = "mse" if weights.get("observer") == "mse" else "none"
        return {"group_size": weights.get("group_size"), "symmetric": weights.get("symmetric", True), "clip": clip}
