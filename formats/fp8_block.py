"""fp8-block: DeepSeek-V3 style 128x128 block-scaled float8_e4m3fn weights.

Tensors of one linear:
  ``weight``            float8_e4m3fn [N, K]
  ``weight_scale_inv``  float32 [ceil(N/128), ceil(K/128)], the dequantization multiplier
                        (w ~= q * s; the "_inv" in the name is historical)

Loads in vLLM (``Fp8Config`` with ``weight_block_size``) and transformers
(``FineGrainedFP8Config``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moetool.errors import MoetoolError
from moetool.formats.base import Tensors, WeightFormat, register
from moetool.formats.common import (
    ceil_div,
    check_suffixes,
    check_tensor,
    abs_max,
    block_tile,
    check_weight,
    fp8_band_buffers,
    e4m3_to_float,
    check_weight_shape,
    scripted,
)
from moetool.memory import scratch

BLOCK = 128
FP8_E4M3_MAX = 448.0
#: amax floor: an all-zero block gets a tiny finite scale and q = 0
AMAX_FLOOR = 1e-12


def fp8_block_quant_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact fp8-block quantization, w [N, K] (any float dtype) -> (q, s).

    q float8_e4m3fn [N, K]; s float32 [ceil(N/128), ceil(K/128)]. Per 128x128 block (edge
    blocks use their real elements only; zero padding is equivalent):
        w32 = w.float();  amax = max |w32| over the block
        s   = clamp(amax, min=1e-12) / 448            (float32)
        q   = (w32 / s).clamp(-448, 448).to(float8_e4m3fn)   (a division, not * 1/s)
    Kernels must reproduce this bit for bit. No NaN/Inf check here (``quantize`` does it).
    """
    n, k = w.shape
    row_blocks, col_blocks = ceil_div(n, BLOCK), ceil_div(k, BLOCK)
    w32 = w.float()
    if n % BLOCK or k % BLOCK:
        w32 = torch.nn.functional.pad(w32, (0, col_blocks * BLOCK - k, 0, row_blocks * BLOCK - n))
    blocks = w32.view(row_blocks, BLOCK, col_blocks, BLOCK)
    amax = abs_max(blocks, (1, 3))
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_E4M3_MAX
    # divide in place when w32 is our own copy (same values as an out-of-place w32 / s)
    own = w32.data_ptr() != w.data_ptr()
    scaled = torch.div(blocks, scale[:, None, :, None], out=blocks) if own else blocks / scale[:, None, :, None]
    q = scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.view(row_blocks * BLOCK, col_blocks * BLOCK)[:n, :k].contiguous()
    return q, scale


def fp8_block_quant_measured(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """``fp8_block_quant_ref(w)`` bit for bit, plus the error sums of its dequantization
    (sum w32^2, sum (q * s - w32)^2 with q and s as stored, float32 terms as
    ``dequantize_blocks`` computes them, summed in float64 a tile at a time).

    CPU, N and K multiples of 128. Fused: a tile of whole blocks at a time (``block_tile``)
    goes through per-thread buffers that stay in cache (convert, block maxima, divide, to e4m3,
    the codes read back, error), so no [N, K] float32 temporary is made; the loop is one
    TorchScript call (``scripted``)."""
    n, k = w.shape
    rows, cols = block_tile(n, k, BLOCK)
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    scale = torch.empty((n // BLOCK, k // BLOCK), dtype=torch.float32)
    ref, work, bits = fp8_band_buffers(rows * cols)
    half = bits.view(torch.int16)[: rows * cols]
    amax = scratch("amax", rows * cols // (BLOCK * BLOCK), torch.float32)
    sig, noise = _fp8_block_tiles(w, q, q.view(torch.int8), scale, ref, ref.view(torch.int32), work,
                                  work.view(torch.int32), half, half.view(torch.float16), amax,
                                  amax.view(torch.int32), rows, cols, BLOCK, AMAX_FLOOR, FP8_E4M3_MAX)
    return q, scale, sig, noise


@scripted
def _fp8_block_tiles(w: torch.Tensor, q: torch.Tensor, q_int8: torch.Tensor, scale: torch.Tensor,
                     ref: torch.Tensor, ref_int32: torch.Tensor, work: torch.Tensor, work_int32: torch.Tensor,
                     half: torch.Tensor, half_float16: torch.Tensor, amax: torch.Tensor, amax_int32: torch.Tensor,
                     rows: int, cols: int, block: int, floor: float, fp8_max: float) -> tuple[float, float]:
    """The loop of ``fp8_block_quant_measured`` over tiles of ``rows`` x ``cols``: w [N, K] ->
    q [N, K] (``q_int8`` its codes' view) and scale [N/block, K/block]; (sum w32^2, sum
    (q * s - w32)^2). Buffers (each given also as the views TorchScript cannot take: dtype
    views of the same memory): ``ref``, ``work`` float32 and ``half`` int16, a tile each;
    ``amax`` float32, a tile's blocks."""
    n, k = w.size(0), w.size(1)
    sig, noise, s_sum = 0.0, 0.0, 0.0
    for r0 in range(0, n, rows):
        m = min(rows, n - r0)
        for c0 in range(0, k, cols):
            c = min(cols, k - c0)
            e, rb, cb = m * c, m // block, c // block
            w32 = ref[:e]
            w32.view([m, c]).copy_(w[r0:r0 + m, c0:c0 + c])
            blocks = w32.view([rb, block, cb, block])
            # max |w| per block as one integer max of the bits with the sign cleared: the bits
            # of non-negative floats order as their values (NaN above all, so it propagates)
            torch.bitwise_and(ref_int32[:e], 0x7FFFFFFF, out=work_int32[:e])
            torch.amax(work_int32[:e].view([rb, block, cb, block]), [1, 3], out=amax_int32[:rb * cb].view([rb, cb]))
            s = amax[:rb * cb].view([rb, cb]).clamp_(min=floor).div_(fp8_max)
            stored = scale[r0 // block:(r0 + m) // block, c0 // block:(c0 + c) // block]
            stored.copy_(s)
            s_sum += float(s.double().sum())
            s4 = s.view([rb, 1, cb, 1])
            x = work[:e].view([rb, block, cb, block])
            # no clamp to +-448 as the reference has: |w| <= amax, s = amax / 448 rounded once,
            # so |w / s| <= 448 * (1 + 2**-23), which e4m3 rounds to 448 all the same (only 464
            # and above would round to 480, e4m3fn's NaN)
            torch.div(blocks, s4, out=x)
            q[r0:r0 + m, c0:c0 + c].copy_(x.view([m, c]))
            sig += float(torch.dot(w32, w32))
            # the stored codes back as q * 2**-8 in float16 (``e4m3_dequantize_band``), exactly
            codes = half[:e].view([m, c])
            codes.copy_(q_int8[r0:r0 + m, c0:c0 + c])
            codes.bitwise_left_shift_(7)
            codes.bitwise_and_(-16385)  # ~(1 << 14): bit 14 cleared
            x.view([m, c]).copy_(half_float16[:e].view([m, c]))
            # the error of the scale as stored, not of ``s``: a scale stored wrong shows in it
            torch.addcmul(blocks, x, stored.view([rb, 1, cb, 1]) * 256.0, value=-1.0, out=x)  # w32 - q * s
            diff = work[:e]
            noise += float(torch.dot(diff, diff))
    # a tile's error sees its own scales; one stored over another tile's (a wrong slice) shows
    # only here: the scales as stored must add up to those computed
    if not abs(float(scale.double().sum()) - s_sum) <= 1e-9 * abs(s_sum):
        noise = float("inf")
    return sig, noise


def expand_block_scales(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """s [ceil(N/128), ceil(K/128)] -> [N, K], each scale repeated over its block."""
    return scale.repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)[:, :k]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q e4m3 [N, K] * its block scales -> float32 [N, K] (broadcast, no [N, K] scale copy
    when N and K are multiples of 128)."""
    n, k = q.shape
    if n % BLOCK or k % BLOCK:
        return e4m3_to_float(q) * expand_block_scales(scale, n, k)
    out = e4m3_to_float(q)
    out.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK).mul_(scale[:, None, :, None])
    return out


@register
@dataclass(frozen=True)
class Fp8Block(WeightFormat):
    name: ClassVar[str] = "fp8-block"
    suffixes: ClassVar[tuple[str, ...]] = ("weight", "weight_scale_inv")
    row_blocks: ClassVar[dict[str, int]] = {"weight": 1, "weight_scale_inv": BLOCK}
    weight_dtype: ClassVar[torch.dtype | None] = torch.float8_e4m3fn
    # round trip on torch.randn weights (formats/base.py ``tolerance``): rel_err 0.0263 - 0.0266
    tolerance: ClassVar[dict[str, float]] = {"rel_err": 0.035, "sqnr_db": 29.1}
    # verify, layer / worst expert on `moetool demo --format fp8-block`'s shards (bf16
    # DeepSeek-V3-style model, H 256, N 192, 16 experts; `verify --ep 4 --dp 2 --tokens 1024`):
    # served (W8A8, 1x128 fp8 activations from bf16) 0.050 / 0.068, --numerics exact 0.036 /
    # 0.050; the limits add margin, an injected fault gives 0.5 - 1.5 and fails
    verify_tolerances: ClassVar[dict[str, float]] = {"rel_err": 0.08, "expert_rel_err": 0.09}
    # W8A8: vLLM quantizes activations per token and 128-column group (DeepSeek-V3)
    activation_quant: ClassVar[str | None] = "fp8-1x128"
    kernel_scheme: ClassVar[str | None] = "fp8-block"
    config_method: ClassVar[str | None] = "fp8"
    config_label: ClassVar[str] = "with 128x128 blocks"
    cli_flags: ClassVar[tuple[str, ...]] = ("--fp8-block",)
    cli_help: ClassVar[str] = "fp8 e4m3, 128x128 block scales (DeepSeek-V3)"

    def quantize(self, w: torch.Tensor, orig_dtype: torch.dtype) -> Tensors:
        """w [N, K] -> {weight: e4m3 [N, K], weight_scale_inv: fp32 [ceil(N/128), ceil(K/128)]}.
        ``orig_dtype`` is unused: block scales are always float32."""
        check_weight_shape(w)  # finiteness from the block maxima below
        q, scale = fp8_block_quant_ref(w)
        check_weight(w, scale)
        return {"weight": q, "weight_scale_inv": scale}

    def quantize_measured(self, w: torch.Tensor, orig_dtype: torch.dtype) -> tuple[Tensors, float, float]:
        check_weight_shape(w)
        n, k = w.shape
        if w.device.type != "cpu" or n % BLOCK or k % BLOCK:
            return super().quantize_measured(w, orig_dtype)
        q, scale, sig, noise = fp8_block_quant_measured(w)
        check_weight(w, scale)
        return {"weight": q, "weight_scale_inv": scale}, sig, noise

    def quantize_cuda(self, w: torch.Tensor, orig_dtype: torch.dtype) -> Tensors | None:
        """The Triton kernel ``fp8_block_quant``: the same bytes as ``quantize``."""
        from moetool.kernels.quant import fp8_block_quant  # imports triton: only for CUDA weights

        q, scale = fp8_block_quant(w.contiguous())
        if not bool(torch.isfinite(scale).all()):
            return None
        return {"weight": q, "weight_scale_inv": scale}

    def dequantize(self, t: Tensors) -> torch.Tensor:
        n, k = self.logical_shape(t)
        if t["weight_scale_inv"].shape[0] != ceil_div(n, BLOCK):
            raise MoetoolError(
                f"weight_scale_inv has {t['weight_scale_inv'].shape[0]} rows for N={n}: a w13 with "
                "per-half scale rows; split it (split_rows) before dequantizing"
            )
        return dequantize_blocks(t["weight"], t["weight_scale_inv"])

    def logical_shape(self, t: Tensors) -> tuple[int, int]:
        """Also checks that the tensors are complete and consistent.

        Besides one linear, a w13 of two equal halves whose N is not a multiple of 128 is
        accepted (vLLM's stacked layout: gate scales, then up scales, 2*ceil(N/128) rows)."""
        check_suffixes(self.name, t, self.suffixes)
        weight = t["weight"]
        if weight.dim() != 2:
            raise MoetoolError(f"weight is not 2-D: shape {list(weight.shape)}")
        n, k = weight.shape
        check_tensor(t, "weight", (n, k), [torch.float8_e4m3fn])
        rows = ceil_div(n, BLOCK)
        if n % 2 == 0 and t["weight_scale_inv"].dim() == 2 and t["weight_scale_inv"].shape[0] == 2 * ceil_div(n // 2, BLOCK):
            rows = 2 * ceil_div(n // 2, BLOCK)
        check_tensor(t, "weight_scale_inv", (rows, ceil_div(k, BLOCK)), [torch.float32])
        return n, k

    def cat_rows(self, parts: list[Tensors]) -> Tensors:
        """Every part but the last needs N % 128 == 0 (a scale block cannot span two parts),
        except two parts of equal N (gate + up = w13): their scale rows are stacked as they are,
        as vLLM's w13_weight_scale_inv [2*ceil(N/128), ceil(K/128)]."""
        rows = [self.logical_shape(part)[0] for part in parts]
        if len(parts) == 2 and rows[0] == rows[1] and rows[0] % BLOCK:
            return {s: torch.cat([p[s] for p in parts]) for s in self.suffixes}
        return super().cat_rows(parts)

    def split_rows(self, t: Tensors, sizes: list[int]) -> list[Tensors]:
        """Two equal parts of N % 128 != 0 rows can only be a w13 made by ``cat_rows``: each
        half has its own ceil(N/128) scale rows. (Whether a tensor is such a w13 cannot be told
        from its shapes when N % 128 > 64, so callers split by the sizes they know.)"""
        n, _ = self.logical_shape(t)
        if len(sizes) == 2 and sizes[0] == sizes[1] and sizes[0] % BLOCK and sum(sizes) == n:
            h, r = sizes[0], ceil_div(sizes[0], BLOCK)
            scale = t["weight_scale_inv"]
            if scale.shape[0] != 2 * r:
                raise MoetoolError(f"{self.name}: a w13 of two {h}-row halves needs {2 * r} weight_scale_inv rows, "
                                   f"got {scale.shape[0]}")
            return [{"weight": t["weight"][:h].clone(), "weight_scale_inv": scale[:r].clone()},
                    {"weight": t["weight"][h:].clone(), "weight_scale_inv": scale[r:].clone()}]
        return super().split_rows(t, sizes)

    def quantization_config(self, ignore: list[str]) -> dict | None:
        """DeepSeek-V3's config plus the unquantized linears.

        The skip list is written under both names readers use: vLLM's ``Fp8Config`` reads
        ``ignored_layers`` (newer releases fall back to ``modules_to_not_convert``);
        transformers' ``FineGrainedFP8Config`` reads ``modules_to_not_convert`` (5.x also
        takes ``ignored_layers`` as an alias, 4.x does not)."""
        config: dict = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
        }
        if ignore:
            config["ignored_layers"] = list(ignore)
            config["modules_to_not_convert"] = list(ignore)
        return config

    @classmethod
    def params_from_config(cls, config: dict) -> dict | None:
        """DeepSeek-V3's ``quant_method: fp8``: 128x128 e4m3 blocks, dynamic activations only."""
        block = config.get("weight_block_size")
        if block is None:
            raise MoetoolError(
                "unsupported quantization_config: fp8 without weight_block_size (per-tensor fp8); "
                "moetool reads 128x128 block fp8 only"
            )
        if list(block) != [BLOCK, BLOCK]:
            raise MoetoolError(
                f"unsupported quantization_config: fp8 weight_block_size {list(block)}; "
                "moetool reads [128, 128]"
            )
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise MoetoolError(f"unsupported quantization_config: fp8 fmt {fmt!r}; moetool reads e4m3")
        activation = config.get("activation_scheme", "dynamic")
        if activation != "dynamic":
            raise MoetoolError(
                f"unsupported quantization_config: fp8 activation_scheme {activation!r} with block "
                "scales; only 'dynamic' exists for block fp8"
            )
        return {}

    @classmethod
    def recognized_without_config(cls, suffixes: set[str], weight_dtype: torch.dtype | None) -> bool:
        """``weight_scale_inv`` next to float8_e4m3fn weights: fp8-block whose config was dropped."""
        return "weight_scale_inv" in suffixes and weight_dtype == torch.float8_e4m3fn
