"""nvfp4: NVIDIA FP4, e2m1 values with an fp8-e4m3 scale per 16 along K and a per-tensor float32
global scale, stored as compressed-tensors ``nvfp4-pack-quantized`` exactly as llm-compressor's
NVFP4A16 scheme writes it.

Tensors of one linear (G = K/16):
  ``weight_packed``        uint8 [N, K/2]: e2m1 codes, element 2j of a row in the low nibble of
                           byte j, element 2j+1 in the high nibble (formats/mxfp4.py)
  ``weight_scale``         float8_e4m3fn [N, G]: the group scales, in the global scale's units
  ``weight_global_scale``  float32 [1]: the DIVISOR of the group scales

w ~= e2m1 * weight_scale / weight_global_scale (compressed-tensors ``_dequantize``: scale /
global_scale, then times the codes' values; vLLM takes 1 / weight_global_scale as the kernels'
multiplier: "ct stores the inverse"). K must be a multiple of 16.

Quantization, w32 = w.float(), amax = max |w32| over a group:
    gs = 2688 / max(max |w32| over the tensor, 1e-12)            (float32; 2688 = 448 * 6)
    s  = e4m3(clamp((amax / 6) * gs, 2^-9, 448))                  (round to nearest even)
    q  = e2m1(clamp(w32 / (float(s) / gs), -6, 6))                (nearest, ties to even)
This is llm-compressor's formula (``generate_gparam``, then ``calculate_qparams`` with the global
scale, then ``quantize``), computed in float32 throughout: llm-compressor rounds the tensor
maximum's quotient and amax / 6 to the weights' dtype (bf16) first, so on bf16 weights its codes
differ from these in a few groups, with the same error (bench/fp4_fidelity.py, 48 expert linears
of 2048 x 768: mean relative error 0.09510 here, 0.09509 llm-compressor). An all-zero group gets
the smallest e4m3 scale and zero codes (llm-compressor gives it 0.125: the same zeros).

One global scale per fused linear. vLLM reads a single global scale for an expert's fused gate
and up (``w13_weight_global_scale[:, 0]``, with a warning when gate's and up's differ) and for
a merged dense gate_up (``weight_global_scale.max()``), so llm-compressor fuses them: gate and up
get the global scale of their joint maximum. Quantize them as one w13 [2N, K] (one global scale)
and cut it with ``split_rows``: each half keeps that global scale.

A stacked w13 made by ``cat_rows`` keeps one global scale per part, float32 [2] (as vLLM's
``w13_weight_global_scale`` [E, 2]); in general ``weight_global_scale`` [P] covers N / P rows each.

Readers: vLLM (``CompressedTensorsW4A16Fp4`` for linears, Marlin FP4 on GPUs without FP4 tensor
cores; ``CompressedTensorsW4A4Nvfp4MoEMethod`` with ``use_a16`` for fused-MoE experts) and
transformers through compressed-tensors (``CompressedTensorsConfig``; its NVFP4 compressor
dequantizes). The W4A4 NVFP4 scheme also stores a calibrated ``input_global_scale`` per linear,
which needs activations moetool does not have: it is neither written nor read here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moetool.errors import MoetoolError
from moetool.formats.base import Tensors, WeightFormat, register
from moetool.formats.common import (
    CompressedTensors,
    check_suffixes,
    check_tensor,
    check_weight,
)
from moetool.formats.fp8_block import AMAX_FLOOR, FP8_E4M3_MAX
from moetool.formats.mxfp4 import (
    FP4_MAX,
    Fp4Quantize,
    e2m1_decode,
    fp4_config,
    fp4_logical_shape,
    fp4_quant_bands,
    fp4_weights_only,
    unpack_fp4,
)

GROUP = 16
#: the global scale maps the tensor's amax to the largest e4m3 scale times the largest e2m1
GLOBAL_MAX = FP8_E4M3_MAX * FP4_MAX
#: the smallest positive e4m3 value, the floor of every group scale (an all-zero group's too)
E4M3_MIN = 2.0**-9


def tensor_amax(w: torch.Tensor) -> torch.Tensor:
    """float32 [1]: max |w| (NaN propagates), 0 for an empty w."""
    if not w.numel():
        return torch.zeros(1, device=w.device)
    return torch.maximum(w.amax(), w.amin().neg()).float().reshape(1)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 tensor maxima -> global scales 2688 / max(amax, 1e-12)."""
    return torch.full_like(amax, GLOBAL_MAX) / amax.clamp(min=AMAX_FLOOR)


@register
@dataclass(frozen=True)
class Nvfp4(Fp4Quantize, CompressedTensors, WeightFormat):
    name: ClassVar[str] = "nvfp4"
    suffixes: ClassVar[tuple[str, ...]] = ("weight_packed", "weight_scale", "weight_global_scale")
    # round trip on torch.randn weights (formats/base.py ``tolerance``): rel_err 0.0946 - 0.0958
    tolerance: ClassVar[dict[str, float]] = {"rel_err": 0.125, "sqnr_db": 18.0}
    # verify, layer / worst expert measured with `moetool demo --format nvfp4` (bf16
    # DeepSeek-V3-style model, H 256, N 192, 16 experts, weights dequantized): 0.131 / 0.178
    # (the tests' tiny Mixtral, 32 tokens: 0.169 / 0.179); the limits add margin, an injected
    # fault gives 0.5 - 1.5 and fails
    verify_tolerances: ClassVar[dict[str, float]] = {"rel_err": 0.25, "expert_rel_err": 0.31}
    # W4A16 (NVFP4A16): activations stay in the model's dtype; the fused GEMM dequantizes the
    # weight tiles in registers (as vLLM's emulation and Marlin FP4 paths do without FP4 MMA)
    activation_quant: ClassVar[str | None] = None
    kernel_scheme: ClassVar[str | None] = "nvfp4"
    # an expert's gate and up are quantized as one w13, for one global scale (module docstring);
    # read by the converter once formats/base.py declares it (False for every other format)
    joint_gate_up: ClassVar[bool] = True
    config_label: ClassVar[str] = "nvfp4"
    ct_weights: ClassVar[tuple[str, int, str]] = ("float", 4, "tensor_group")
    ct_storage: ClassVar[tuple[str, ...]] = ("nvfp4-pack-quantized",)
    cli_flags: ClassVar[tuple[str, ...]] = ("--nvfp4",)
    fp4_group: ClassVar[int] = GROUP
    cli_help: ClassVar[str] = "fp4 e2m1, e4m3 scale per 16, fp32 global scale (NVFP4A16, compressed-tensors)"

    def _quantize_cpu(self, w: torch.Tensor, measure: bool) -> tuple[Tensors, float, float]:
        """-> {weight_packed: uint8 [N, K/2], weight_scale: e4m3 [N, K/16], weight_global_scale:
        float32 [1]}, sums."""
        n, k = w.shape
        amax = tensor_amax(w)
        check_weight(w, amax)
        gs = nvfp4_global_scale(amax)
        scale = torch.empty((n, k // GROUP), dtype=torch.float8_e4m3fn)

        def scale_of(amax: torch.Tensor, r0: int) -> torch.Tensor:
            s = amax.div_(FP4_MAX).mul_(gs).clamp_(E4M3_MIN, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
            scale[r0 : r0 + s.shape[0]] = s
            return s.float().div_(gs)

        packed, sig, noise = fp4_quant_bands(w, GROUP, scale_of, measure)
        return {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": gs}, sig, noise

    def quantize_cuda(self, w: torch.Tensor, orig_dtype: torch.dtype) -> Tensors | None:
        """The Triton kernel ``nvfp4_quant``: the same bytes as ``quantize``."""
        if w.shape[1] % GROUP:
            return None  # ``quantize`` names the problem
        from moetool.kernels.fp4_quant import nvfp4_quant  # imports triton: only for CUDA weights

        t = nvfp4_quant(w.contiguous())
        gs = t["weight_global_scale"]
        if not bool(torch.isfinite(gs).all() & (gs > 0).all()):
            return None  # NaN (a NaN in w) or 0 (an Inf): ``quantize`` names it
        return t

    def dequantize(self, t: Tensors) -> torch.Tensor:
        n, k = self.logical_shape(t)
        gs = t["weight_global_scale"]
        parts = gs.numel()
        # the group scales' dequantization multipliers, s / gs, per part of N / P rows
        eff = t["weight_scale"].float().view(parts, n // parts, k // GROUP).div_(gs.float().view(parts, 1, 1))
        values = e2m1_decode(unpack_fp4(t["weight_packed"]))  # [N, K]
        values.view(n, k // GROUP, GROUP).mul_(eff.view(n, k // GROUP, 1))
        return values

    def logical_shape(self, t: Tensors) -> tuple[int, int]:
        """Also checks that the tensors are complete and consistent: ``weight_global_scale`` has
        one entry, or P entries of N / P rows each (a stacked w13: P = 2)."""
        check_suffixes(self.name, t, self.suffixes)
        n, k = fp4_logical_shape(self.name, t, GROUP, [torch.float8_e4m3fn])
        gs = t["weight_global_scale"]
        parts = gs.numel() if gs.dim() == 1 else 0
        if parts == 0 or n % parts:
            raise MoetoolError(f"weight_global_scale has shape {list(gs.shape)}, expected [1] "
                               f"(or [P] for P parts of equal rows of N={n})")
        check_tensor(t, "weight_global_scale", (parts,), [torch.float32])
        return n, k

    def cat_rows(self, parts: list[Tensors]) -> Tensors:
        """Each part keeps its global scales: ``weight_global_scale`` is concatenated, so every
        part needs the same rows per global scale (gate + up of equal N: [2])."""
        if not parts:
            raise MoetoolError(f"{self.name}: nothing to concatenate")
        shapes = [self.logical_shape(part) for part in parts]
        if len({k for _, k in shapes}) > 1:
            raise MoetoolError(f"{self.name}: cannot concatenate parts of different K: {shapes}")
        per_scale = {n // part["weight_global_scale"].numel() for (n, _), part in zip(shapes, parts)}
        if len(per_scale) > 1:
            raise MoetoolError(f"{self.name}: cannot concatenate parts of {[n for n, _ in shapes]} rows: each "
                               "keeps its global scale, which must cover equally many rows")
        return {s: torch.cat([part[s] for part in parts]) for s in self.suffixes}

    def split_rows(self, t: Tensors, sizes: list[int]) -> list[Tensors]:
        """Each part gets the global scale(s) of its rows: one when it lies within the rows of one
        global scale (a half of a w13 quantized as one linear), or whole ones."""
        n, _ = self.logical_shape(t)
        if any(size <= 0 for size in sizes) or sum(sizes) != n:
            raise MoetoolError(f"cannot split N={n} rows into parts of {sizes} rows")
        gs = t["weight_global_scale"]
        rows = n // gs.numel()  # per global scale
        out, start = [], 0
        for size in sizes:
            end = start + size
            if start // rows == (end - 1) // rows:
                first, last = start // rows, start // rows + 1
            elif start % rows == 0 and end % rows == 0:
                first, last = start // rows, end // rows
            else:
                raise MoetoolError(f"{self.name}: rows [{start}, {end}) straddle global scales of "
                                   f"{rows} rows each (parts: {sizes})")
            out.append({"weight_packed": t["weight_packed"][start:end].clone(),
                        "weight_scale": t["weight_scale"][start:end].clone(),
                        "weight_global_scale": gs[first:last].clone()})
            start = end
        return out

    def quantization_config(self, ignore: list[str]) -> dict | None:
        """compressed-tensors NVFP4A16: e2m1 weights, e4m3 scales per 16 along K and a global
        scale per tensor (strategy tensor_group), activations unquantized."""
        return fp4_config("nvfp4-pack-quantized",
                          {"strategy": "tensor_group", "group_size": GROUP, "scale_dtype": "torch.float8_e4m3fn"},
                          ignore)

    @classmethod
    def params_from_config(cls, config: dict) -> dict | None:
        params = super().params_from_config(config)
        if params is not None:
            fp4_weights_only(cls.name, config, GROUP)
        return params

    @classmethod
    def recognized_without_config(cls, suffixes: set[str], weight_dtype: torch.dtype | None) -> bool:
        """``weight_global_scale`` next to ``weight_packed``: nvfp4 whose config was dropped (no
        other compressed-tensors format stores a weight global scale)."""
        return {"weight_packed", "weight_global_scale"} <= suffixes
