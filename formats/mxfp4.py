"""mxfp4: OCP MX FP4, e2m1 values with one e8m0 (power of two) scale per 32 along K, stored as
compressed-tensors ``mxfp4-pack-quantized`` (what llm-compressor's MXFP4A16 scheme writes).

Tensors of one linear (G = K/32):
  ``weight_packed``  uint8 [N, K/2]: element 2j of a row in the low nibble of byte j, element
                     2j+1 in the high nibble; a nibble is an e2m1 code: bit 3 the sign, bits 0-2
                     the index of 0, 0.5, 1, 1.5, 2, 3, 4, 6
  ``weight_scale``   uint8 [N, G]: e8m0, the biased exponent e of the group's scale 2^(e - 127)

w ~= e2m1 * 2^(e - 127). K must be a multiple of 32 (as compressed-tensors and vLLM need).

Readers. vLLM's compressed-tensors loader reads this layout for linears
(``CompressedTensorsW4A16Mxfp4``, Marlin FP4) and for fused-MoE experts
(``CompressedTensorsW4A4Mxfp4MoEMethod``: ``w13_weight_packed`` / ``w13_weight_scale`` from each
expert's gate/up/down); transformers reads it through compressed-tensors
(``CompressedTensorsConfig``, whose MXFP4 compressor dequantizes it).

The fused layout (``fused_names``): gpt-oss's release, ``quant_method: mxfp4``, stores a layer's
experts as ``experts.gate_up_proj_blocks`` uint8 [E, 2N, K/32, 16] with ``gate_up_proj_scales``
uint8 [E, 2N, K/32] and ``down_proj_blocks`` [E, H, N/32, 16] with ``down_proj_scales``: the
same bytes (a blocks row is a ``weight_packed`` row viewed as [K/32, 16], the scales are
``weight_scale``), output rows first, gate and up rows interleaved (transformers'
``integrations/mxfp4.py`` ``convert_moe_packed_tensors`` decodes a row's byte j into its
elements 2j (low nibble) and 2j+1 and multiplies by 2^(scale - 127); vLLM's gpt-oss loader
reads the blocks as ``w13_weight`` [E, 2N, K/2] as they are). Its readers take gpt-oss experts
only: transformers' ``Mxfp4Config`` converts ``gate_up_proj_blocks`` / ``down_proj_blocks`` of
GptOss experts (on a CPU it dequantizes them), and vLLM's ``Mxfp4Config`` quantizes FusedMoE
layers only. So gpt-oss's experts are written fused in this layout (``moetool quantize --layout
fused``), and per-linear weights (other families, or per-expert) in the compressed-tensors one.

The scale exponent (the readers take any e8m0 code; quantizers differ):
  * OCP MX v1.0: floor(log2 amax) - 2, so amax / scale lies in [4, 8) and values above 6 saturate;
  * compressed-tensors / llm-compressor (``generate_mx_scales``), used here: the same after
    rounding amax up to the next power of two when its mantissa is >= 1.75, so amax / scale lies
    in [3.5, 7): saturation only from (6, 7);
  * triton_kernels (gpt-oss, transformers' on-the-fly quantization): 2^ceil(log2(amax / 6)),
    amax / scale in (3, 6], never saturating but coarser.
  Relative error on torch.randn 1024 x 2048: 0.1150 / 0.1120 / 0.1156; Student-t(3): 0.142 /
  0.139 / 0.151. The compressed-tensors rule is the lowest of the three and gives
  llm-compressor's bytes exactly. Elements round to nearest, ties to even (OCP, compressed-tensors,
  the hardware's e2m1 conversion; triton_kernels' torch downcast rounds ties away from zero), and
  keep their sign: a small negative value is stored as -0 (code 8), as compressed-tensors does.

The NVFP4 format (formats/nvfp4.py) shares the e2m1 codes, packing and the banded CPU quantizer
defined here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from moetool.errors import MoetoolError
from moetool.formats.base import Tensors, WeightFormat, register
from moetool.formats.common import (
    CompressedTensors,
    abs_max_bits,
    band_rows,
    check_suffixes,
    check_tensor,
    check_weight,
    check_weight_shape,
    compressed_tensors_group,
)
from moetool.memory import scratch

GROUP = 32
FP4_MAX = 6.0
E8M0_BIAS = 127
#: the largest finite e8m0 code (255 is NaN)
E8M0_MAX_CODE = 254
#: e2m1 magnitudes by code & 7; codes 8-15 are their negatives (8 is -0.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ------------------------------------------------------------------------ e2m1 codes and packing


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """float32 y -> uint8 e2m1 codes: nearest e2m1 value of clamp(y, -6, 6), ties to even, the
    sign of y kept (-0 for small negatives). No NaN (callers refuse non-finite weights)."""
    bits = y.float().contiguous().view(torch.int32)
    return _encode_table(y.device).index_select(0, _table_index(bits).reshape(-1)).view(y.shape)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> their float32 values."""
    return _value_table(codes.device).index_select(0, codes.reshape(-1).int()).view(codes.shape)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [R, C] (C even) -> uint8 [R, C/2], element 2j in the low nibble of byte j."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: uint8 [R, C/2] -> codes uint8 [R, C]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """e8m0 codes (uint8 or int, 0..254) -> float32 2^(e - 127), exactly (0 is the subnormal 2^-127)."""
    e = e.to(torch.int32)
    return torch.where(e > 0, e << 23, 0x400000).view(torch.float32)


def mxfp4_exponent(amax: torch.Tensor) -> torch.Tensor:
    """float32 group maxima (>= 0) -> e8m0 codes, int32: the biased exponent of amax after adding
    a quarter of its exponent's unit (a mantissa >= 1.75 rounds up), less 2, in [0, 254]."""
    return ((amax.view(torch.int32) + 0x200000) >> 23).sub_(2).clamp_(0, E8M0_MAX_CODE)


def _table_index(bits: torch.Tensor, out: torch.Tensor | None = None, low: torch.Tensor | None = None) -> torch.Tensor:
    """float32 bits (int32) -> the index of their code in the 2^17-entry tables: the top 16
    bits, then whether any of the low 16 is set. Every e2m1 rounding boundary (0.25, 0.75,
    1.25, 1.75, 2.5, 3.5, 5) has a zero low half, so the top half decides the side of every
    other value and the flag tells an exact tie from a value just above it."""
    out = torch.bitwise_right_shift(bits, 15, out=out).bitwise_and_(0x1FFFE)
    low = torch.bitwise_and(bits, 0xFFFF, out=low).clamp_(max=1)
    return out.bitwise_or_(low)


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _encode_table(device: torch.device) -> torch.Tensor:
    """uint8 [2^17]: the code of every (top half, low-half-set) float32 pattern, computed once
    from the rounding definition (see kernels/fp4_quant.py ``e2m1_encode_ref``)."""
    key = ("codes", torch.device(device))
    table = _TABLES.get(key)
    if table is None:
        top = torch.arange(1 << 16, dtype=torch.int32) << 16
        y = torch.stack([top, top | 1], dim=1).view(-1).view(torch.float32)
        y = y.nan_to_num(0.0).clamp_(-FP4_MAX, FP4_MAX)
        bits = y.view(torch.int32)
        magnitude = bits & 0x7FFFFFFF
        # from 1 up: the mantissa rounded to one bit, to nearest even; below: 2|y| rounded
        normal = ((magnitude + 0x1FFFFF + ((magnitude >> 22) & 1)) >> 22) - 252
        below_one = torch.round(y.abs() * 2.0).int()
        codes = torch.where(magnitude < 0x3F800000, below_one, normal) | ((bits >> 28) & 8)
        table = _TABLES[key] = codes.to(torch.uint8).to(device)
    return table


def _value_table(device: torch.device) -> torch.Tensor:
    """float32 [16]: the value of every code."""
    key = ("values", torch.device(device))
    table = _TABLES.get(key)
    if table is None:
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        table = _TABLES[key] = torch.cat([values, -values]).to(device)
    return table


def _dequant_table(device: torch.device) -> torch.Tensor:
    """float32 [2^17]: the value of every code of ``_encode_table``."""
    key = ("dequant", torch.device(device))
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = _value_table(device).index_select(0, _encode_table(device).int())
    return table


# ------------------------------------------------------------------------ banded CPU quantizer

#: (scale_of, amax [m, G] float32 and the band's first row) -> the band's divisors [m, G]
#: float32; ``scale_of`` also stores the format's scale codes for those rows
ScaleOf = Callable[[torch.Tensor, int], torch.Tensor]


def fp4_quant_bands(w: torch.Tensor, group: int, scale_of: ScaleOf, measure: bool) -> tuple[torch.Tensor, float, float]:
    """w [N, K] on the CPU (K % group == 0) -> (weight_packed uint8 [N, K/2], sum w32^2,
    sum (dequantized - w32)^2), the sums 0.0 unless ``measure``.

    A band of rows at a time goes through per-thread buffers that stay in cache: convert to
    float32, group maxima, ``scale_of`` (the format's scales and divisors), divide, code (one
    table lookup on the float32 bits), pack two codes a byte; with ``measure`` the codes'
    values times the divisors against w32, in float32 per element. Raises on NaN/Inf."""
    n, k = w.shape
    groups_per_row = k // group
    rows = band_rows(n, k)
    packed = torch.empty((n, k // 2), dtype=torch.uint8)
    ref_buf = scratch("ref", rows * k, torch.float32)
    work_buf = scratch("work", rows * k, torch.float32)
    index_buf = scratch("index", rows * k, torch.int32)
    low_buf = scratch("fp4.low", rows * k, torch.int32)
    codes_buf = scratch("fp4.codes", rows * k, torch.uint8)
    pairs_buf = scratch("pairs", rows * k // 2, torch.int16)
    amax_buf = torch.empty(rows * groups_per_row, dtype=torch.float32)
    encode, values = _encode_table(w.device), _dequant_table(w.device) if measure else None
    sig = noise = 0.0
    for r0 in range(0, n, rows):
        m = min(rows, n - r0)
        ref, work = ref_buf[: m * k], work_buf[: m * k]
        groups = ref.view(m, groups_per_row, group)
        groups.view(m, k).copy_(w[r0 : r0 + m])
        work3 = work.view(groups.shape)
        amax = abs_max_bits(groups, -1, amax_buf[: m * groups_per_row].view(m, groups_per_row), work3)
        if not bool(torch.isfinite(amax).all()):
            check_weight(w)  # raises, counting the NaN/Inf values
        divisor = scale_of(amax, r0)
        torch.div(groups, divisor[..., None], out=work3)
        index = _table_index(work.view(torch.int32), out=index_buf[: m * k], low=low_buf[: m * k])
        codes = torch.index_select(encode, 0, index, out=codes_buf[: m * k])
        # as little-endian int16 pairs v = c0 + 256 * c1 (codes < 16), v | (v >> 4) holds
        # c0 + 16 * c1 in its low byte, which the conversion to uint8 keeps
        pairs = codes.view(torch.int16)
        shifted = pairs_buf[: m * k // 2]
        torch.bitwise_right_shift(pairs, 4, out=shifted).bitwise_or_(pairs)
        packed[r0 : r0 + m].view(-1).copy_(shifted)
        if measure:
            sig += float(torch.dot(ref, ref))
            torch.index_select(values, 0, index, out=work)
            work3.mul_(divisor[..., None])
            work.sub_(ref)
            noise += float(torch.dot(work, work))
    return packed, sig, noise


def check_groups(name: str, k: int, group: int) -> None:
    """K divisible by the group size (whole groups, as compressed-tensors and vLLM need)."""
    if k % group:
        raise MoetoolError(
            f"has K={k} columns, which {name}'s groups of {group} do not divide "
            "(compressed-tensors and vLLM need whole groups)"
        )


def fp4_logical_shape(name: str, t: Tensors, group: int, scale_dtypes: list[torch.dtype]) -> tuple[int, int]:
    """[N, K] from ``weight_packed`` [N, K/2], with ``weight_scale`` [N, K/group] checked."""
    packed = t["weight_packed"]
    if packed.dim() != 2:
        raise MoetoolError(f"weight_packed is not 2-D: shape {list(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    check_tensor(t, "weight_packed", (n, k // 2), [torch.uint8])
    if k % group:
        raise MoetoolError(f"weight_packed holds K={k} values a row, not whole {name} groups of {group}")
    check_tensor(t, "weight_scale", (n, k // group), scale_dtypes)
    return n, k


def fp4_config(storage: str, weights: dict, ignore: list[str]) -> dict:
    """A compressed-tensors config of one weight-only group of FP4 ``weights`` arguments, with
    the keys llm-compressor writes for its NVFP4A16 / MXFP4A16 schemes."""
    return {
        "quant_method": "compressed-tensors",
        "format": storage,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "float", **weights, "symmetric": True, "dynamic": False},
                "input_activations": None,
                "output_activations": None,
                "format": storage,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


def fp4_weights_only(name: str, config: dict, group: int) -> None:
    """A compressed-tensors FP4 group moetool reads: symmetric, ``group`` columns per scale, and
    activations left unquantized (the weight-only ...A16 schemes)."""
    weights, _ = compressed_tensors_group(config)
    if weights.get("group_size") != group:
        raise MoetoolError(f"unsupported compressed-tensors {name} with group_size {weights.get('group_size')}; "
                           f"{name} has groups of {group}")
    if weights.get("symmetric", True) is not True:
        raise MoetoolError(f"unsupported compressed-tensors {name} with zero points (symmetric false)")
    scheme = next(iter(config["config_groups"].values()))
    if scheme.get("input_activations") is not None:
        raise MoetoolError(f"unsupported compressed-tensors {name} with quantized input activations; "
                           f"moetool reads the weight-only scheme ({name.upper()}A16, input_activations null)")


class Fp4Quantize:
    """``quantize`` / ``quantize_measured`` of the fp4 formats: shape and group checks, then the
    format's CPU band quantizer (``_quantize_cpu``); a CUDA weight handed here (its Triton kernel,
    ``quantize_cuda``, declined it) is quantized on the CPU and moved back. ``fp4_group``: the
    elements per scale along K."""

    fp4_group: ClassVar[int]

    def quantize(self, w: torch.Tensor, orig_dtype: torch.dtype) -> Tensors:
        """w [N, K] -> the format's tensors (``_quantize_cpu``). ``orig_dtype`` is unused: the fp4
        formats' scale dtypes are fixed."""
        return self._quantize(w, measure=False)[0]

    def quantize_measured(self, w: torch.Tensor, orig_dtype: torch.dtype) -> tuple[Tensors, float, float]:
        return self._quantize(w, measure=True)

    def _quantize(self, w: torch.Tensor, measure: bool) -> tuple[Tensors, float, float]:
        check_weight_shape(w)
        check_groups(self.name, w.shape[1], self.fp4_group)
        if w.device.type != "cpu":
            t, sig, noise = self._quantize(w.cpu(), measure)
            return {s: v.to(w.device) for s, v in t.items()}, sig, noise
        return self._quantize_cpu(w, measure)

    def _quantize_cpu(self, w: torch.Tensor, measure: bool) -> tuple[Tensors, float, float]:
        """CPU w [N, K], K whole groups -> (tensors, sum w^2, sum error^2; zeros unless measure)."""
        raise NotImplementedError


@register
@dataclass(frozen=True)
class Mxfp4(Fp4Quantize, CompressedTensors, WeightFormat):
    name: ClassVar[str] = "mxfp4"
    suffixes: ClassVar[tuple[str, ...]] = ("weight_packed", "weight_scale")
    row_blocks: ClassVar[dict[str, int]] = {"weight_packed": 1, "weight_scale": 1}
    # round trip on torch.randn weights (formats/base.py ``tolerance``): rel_err 0.1112 - 0.1126
    tolerance: ClassVar[dict[str, float]] = {"rel_err": 0.146, "sqnr_db": 16.7}
    # verify, layer / worst expert measured with `moetool demo --format mxfp4` (bf16
    # DeepSeek-V3-style model, H 256, N 192, 16 experts, weights dequantized): 0.153 / 0.210
    # (the tests' tiny Mixtral, 32 tokens: 0.199 / 0.205); the limits add margin, an injected
    # fault gives 0.5 - 1.5 and fails
    verify_tolerances: ClassVar[dict[str, float]] = {"rel_err": 0.30, "expert_rel_err": 0.37}
    # W4A16: activations stay in the model's dtype; the fused GEMM dequantizes the weight
    # tiles in registers
    activation_quant: ClassVar[str | None] = None
    kernel_scheme: ClassVar[str | None] = "mxfp4"
    config_label: ClassVar[str] = "mxfp4"
    ct_weights: ClassVar[tuple[str, int, str]] = ("float", 4, "group")
    ct_storage: ClassVar[tuple[str, ...]] = ("mxfp4-pack-quantized",)
    cli_flags: ClassVar[tuple[str, ...]] = ("--mxfp4",)
    fp4_group: ClassVar[int] = GROUP
    cli_help: ClassVar[str] = "fp4 e2m1, e8m0 scale per 32 (OCP MXFP4, compressed-tensors)"
    #: the fused expert layout (gpt-oss's release): a layer's experts as
    #: ``experts.{gate_up_proj,down_proj}_{name}`` [E, rows, ...], by the format's tensor
    fused_names: ClassVar[dict[str, str]] = {"weight_packed": "blocks", "weight_scale": "scales"}
    #: the ``quant_method`` of a checkpoint stored in the fused layout
    fused_config_method: ClassVar[str] = "mxfp4"

    def _quantize_cpu(self, w: torch.Tensor, measure: bool) -> tuple[Tensors, float, float]:
        """-> {weight_packed: uint8 [N, K/2], weight_scale: uint8 [N, K/32]}, sums."""
        n, k = w.shape
        scale = torch.empty((n, k // GROUP), dtype=torch.uint8)

        def scale_of(amax: torch.Tensor, r0: int) -> torch.Tensor:
            e = mxfp4_exponent(amax)
            scale[r0 : r0 + e.shape[0]] = e
            return e8m0_to_float(e)

        packed, sig, noise = fp4_quant_bands(w, GROUP, scale_of, measure)
        return {"weight_packed": packed, "weight_scale": scale}, sig, noise

    def quantize_cuda(self, w: torch.Tensor, orig_dtype: torch.dtype) -> Tensors | None:
        """The Triton kernel ``mxfp4_quant``: the same bytes as ``quantize``."""
        if w.shape[1] % GROUP or not bool(torch.isfinite(w.amax()) & torch.isfinite(w.amin())):
            return None  # ``quantize`` names the problem
        from moetool.kernels.fp4_quant import mxfp4_quant  # imports triton: only for CUDA weights

        return mxfp4_quant(w.contiguous())

    def dequantize(self, t: Tensors) -> torch.Tensor:
        n, k = self.logical_shape(t)
        values = e2m1_decode(unpack_fp4(t["weight_packed"]))  # [N, K]
        values.view(n, k // GROUP, GROUP).mul_(e8m0_to_float(t["weight_scale"])[..., None])
        return values

    def logical_shape(self, t: Tensors) -> tuple[int, int]:
        """Also checks that the tensors are complete and consistent."""
        check_suffixes(self.name, t, self.suffixes)
        return fp4_logical_shape(self.name, t, GROUP, [torch.uint8])

    def quantization_config(self, ignore: list[str]) -> dict | None:
        """compressed-tensors MXFP4A16: e2m1 weights, e8m0 scales per 32 along K, activations
        unquantized."""
        return fp4_config("mxfp4-pack-quantized",
                          {"strategy": "group", "group_size": GROUP, "scale_dtype": "torch.uint8"}, ignore)

    @classmethod
    def params_from_config(cls, config: dict) -> dict | None:
        params = super().params_from_config(config)
        if params is not None:
            fp4_weights_only(cls.name, config, GROUP)
        return params

    # -- the fused layout (gpt-oss's release) -------------------------------------------------
    def to_fused(self, suffix: str, t: torch.Tensor) -> torch.Tensor:
        """One tensor of a linear (or of a stack of them, [..., R, C]) -> its rows in the fused
        layout: ``weight_packed`` [R, K/2] -> blocks [R, K/32, 16] (a view); scales as they are."""
        if suffix == "weight_packed":
            return t.reshape(*t.shape[:-1], t.shape[-1] * 2 // GROUP, GROUP // 2)
        return t

    def from_fused(self, suffix: str, t: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_fused`: blocks [..., R, K/32, 16] -> ``weight_packed`` [..., R, K/2]."""
        if suffix == "weight_packed":
            if t.dim() < 3 or t.shape[-1] != GROUP // 2:
                raise MoetoolError(f"blocks of shape {list(t.shape)}, expected [..., rows, K/{GROUP}, {GROUP // 2}]")
            return t.reshape(*t.shape[:-2], t.shape[-2] * (GROUP // 2))
        return t

    def fused_quantization_config(self, ignore: list[str]) -> dict:
        """gpt-oss's ``quantization_config``: its experts mxfp4, every linear of ``ignore`` not
        (the release lists them as patterns; transformers and vLLM take plain names too)."""
        return {"quant_method": self.fused_config_method, "modules_to_not_convert": list(ignore)}
