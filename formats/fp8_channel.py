"""fp8-channel: compressed-tensors ``float-quantized`` W8A8 (FP8_DYNAMIC style).

Tensors of one linear:
  ``weight``        float8_e4m3fn [N, K]
  ``weight_scale``  [N, 1] in the original dtype, the dequantization multiplier (w ~= q * s)

Activations are quantized per token at run time (dynamic), so nothing else is stored.
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
    abs_max,
    abs_max_bits,
    band_rows,
    check_weight,
    fp8_band_buffers,
    fp8_band_error,
    e4m3_to_float,
    check_weight_shape,
    scale_in_dtype,
)
from moetool.formats.fp8_block import AMAX_FLOOR, FP8_E4M3_MAX

def fp8_channel_quant_ref(
    w: torch.Tensor, orig_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact fp8-channel quantization, w [N, K] -> (q e4m3 [N, K], s orig_dtype [N, 1]).

        w32 = w.float();  amax = max |w32| over the row
        s   = (clamp(amax, min=1e-12) / 448).to(orig_dtype).float()   (rounded to orig dtype first)
        q   = (w32 / s).clamp(-448, 448).to(float8_e4m3fn)
    (``scale_in_dtype`` keeps s from rounding to zero: see there; a no-op for bf16 / fp32.)
    """
    w32 = w.float()
    amax = abs_max(w32, 1)[:, None]
    scale = scale_in_dtype(amax.clamp(min=AMAX_FLOOR) / FP8_E4M3_MAX, orig_dtype)
    own = w32.data_ptr() != w.data_ptr()  # divide in place only into our own copy
    scaled = torch.div(w32, scale, out=w32) if own else w32 / scale
    q = scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.to(orig_dtype)


def fp8_channel_quant_measured(
    w: torch.Tensor, orig_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """``fp8_channel_quant_ref(w, orig_dtype)`` bit for bit, plus the error sums of its
    dequantization (sum w32^2, sum (q * s - w32)^2, per element in float32 as ``dequantize``).
    CPU; a band of rows at a time in per-thread buffers (see ``fp8_block_quant_measured``)."""
    n, k = w.shape
    rows = band_rows(n, k)
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    scale = torch.empty((n, 1), dtype=orig_dtype)
    ref_buf, work_buf, bits_buf = fp8_band_buffers(rows * k)
    amax_buf = torch.empty(rows, dtype=torch.float32)
    sig = noise = 0.0
    for r0 in range(0, n, rows):
        m = min(rows, n - r0)
        ref, work, bits = (b[: m * k] for b in (ref_buf, work_buf, bits_buf))
        ref2 = ref.view(m, k)
        ref2.copy_(w[r0 : r0 + m])
        amax = abs_max_bits(ref2, 1, amax_buf[:m], work.view(m, k))[:, None]
        s = scale_in_dtype(amax.clamp_(min=AMAX_FLOOR).div_(FP8_E4M3_MAX), orig_dtype)
        torch.div(ref2, s, out=work.view(m, k)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        qb = q[r0 : r0 + m]
        qb.copy_(work.view(m, k))
        scale[r0 : r0 + m] = s
        band_sig, band_noise = fp8_band_error(ref, qb, s, work.view(m, k), bits)
        sig, noise = sig + band_sig, noise + band_noise
    return q, scale, sig, noise


@register
@dataclass(frozen=True)
class Fp8Channel(CompressedTensors, WeightFormat):
    name: ClassVar[str] = "fp8-channel"
    suffixes: ClassVar[tuple[str, ...]] = ("weight", "weight_scale")
    row_blocks: ClassVar[dict[str, int]] = {"weight": 1, "weight_scale": 1}
    weight_dtype: ClassVar[torch.dtype | None] = torch.float8_e4m3fn
    # round trip on torch.randn weights (formats/base.py ``tolerance``): rel_err 0.0260 - 0.0265
    tolerance: ClassVar[dict[str, float]] = {"rel_err": 0.035, "sqnr_db": 29.1}
    # verify, layer / worst expert on `moetool demo --format fp8-channel`'s shards (bf16
    # DeepSeek-V3-style model, H 256, N 192, 16 experts; `verify --ep 4 --dp 2 --tokens 1024`):
    # served (W8A8, per-token fp8 activations from bf16) 0.050 / 0.067, --numerics exact
    # 0.036 / 0.048; the limits add margin, an injected fault gives 0.5 - 1.5 and fails
    verify_tolerances: ClassVar[dict[str, float]] = {"rel_err": 0.08, "expert_rel_err": 0.09}
    # W8A8: the config declares dynamic per-token fp8 activations, so vLLM quantizes each
    # token's activations to fp8 with one scale per row before both expert GEMMs
    activation_quant: ClassVar[str | None] = "fp8-token"
    kernel_scheme: ClassVar[str | None] = "fp8-channel"
    config_label: ClassVar[str] = "fp8-channel"
    ct_weights: ClassVar[tuple[str, int, str]] = ("float", 8, "channel")
    ct_storage: ClassVar[tuple[str, ...]] = ("float-quantized", "naive-quantized")
    cli_flags: ClassVar[tuple[str, ...]] = ("--fp8-channel",)
    cli_help: ClassVar[str] = "fp8 e4m3, per-channel scales (compressed-tensors)"

    def quantize(self, w: torch.Tensor, orig_dtype: torch.dtype) -> Tensors:
        """w [N, K] -> {weight: e4m3 [N, K], weight_scale: orig_dtype [N, 1]}."""
        check_weight_shape(w)  # finiteness from the row maxima below
        try:
            q, scale = fp8_channel_quant_ref(w, orig_dtype)
        except MoetoolError:
            check_weight(w)  # NaN/Inf in w explains a non-finite scale: say so
            raise
        check_weight(w, scale)
        return {"weight": q, "weight_scale": scale}

    def quantize_measured(self, w: torch.Tensor, orig_dtype: torch.dtype) -> tuple[Tensors, float, float]:
        check_weight_shape(w)
        if w.device.type != "cpu":
            return super().quantize_measured(w, orig_dtype)
        try:
            q, scale, sig, noise = fp8_channel_quant_measured(w, orig_dtype)
        except MoetoolError:
            check_weight(w)  # NaN/Inf in w explains a non-finite scale: say so
            raise
        check_weight(w, scale)
        return {"weight": q, "weight_scale": scale}, sig, noise

    def dequantize(self, t: Tensors) -> torch.Tensor:
        self.logical_shape(t)
        return e4m3_to_float(t["weight"]).mul_(t["weight_scale"].float())

    def logical_shape(self, t: Tensors) -> tuple[int, int]:
        """Also checks that the tensors are complete and consistent."""
        check_suffixes(self.name, t, self.suffixes)
        weight = t["weight"]
        if weight.dim() != 2:
            raise MoetoolError(f"weight is not 2-D: shape {list(weight.shape)}")
        n, k = weight.shape
        check_tensor(t, "weight", (n, k), [torch.float8_e4m3fn])
        check_tensor(t, "weight_scale", (n, 1), floating=True)
        return n, k

    def quantization_config(self, ignore: list[str]) -> dict | None:
        """compressed-tensors: fp8 weights per output channel, fp8 activations per token,
        computed at run time (dynamic)."""
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "channel",
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "token",
                        "symmetric": True,
                        "dynamic": True,
                    },
                    "output_activations": None,
                }
            },
            "ignore": list(ignore),
            "kv_cache_scheme": None,
        }

    @classmethod
    def params_from_config(cls, config: dict) -> dict | None:
        params = super().params_from_config(config)
        if params is not None:
            activations = next(iter(config["config_groups"].values())).get("input_activations")
            if isinstance(activations, dict) and activations.get("dynamic") is False:
                # served as dynamic per-token fp8 (``activation_quant``); static scales are not kept
                raise MoetoolError("unsupported compressed-tensors fp8 with static activation scales "
                                   "(input_activations dynamic false); moetool reads dynamic activations")
        return params

    @classmethod
    def params_from_weights(cls, weights: dict) -> dict:
        if weights.get("symmetric", True) is not True:
            raise MoetoolError("unsupported compressed-tensors fp8 weights with zero points")
        return {}
