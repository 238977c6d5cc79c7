"""The numerics of the converted side of a verify run: what the serving engine computes.

``served`` (the default) runs each format the way vLLM's fused MoE runs that checkpoint:
activations at the MoE boundary and between the expert GEMMs in the served dtype (bf16;
fp16 for an fp16 model), fp8 activation quantization where the format's config declares it
(its ``activation_quant``: fp8-block 1x128 groups, fp8-channel per token, each quantized from
the bf16 values), weight-only formats with their dequantized weights in the served dtype
(W4A16, W16A16). ``exact`` keeps everything in float32 with unquantized activations, so the
only error left is the weights' (to isolate a weight fault from activation rounding).

Torch only (the parent uses it for the reference's tokens); the kernels that implement the
served math live in ``moetool.kernels`` and are loaded by the ranks alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moetool.errors import MoetoolError

NUMERICS = ("served", "exact")
#: an activation group size of 0: one fp8 scale per token (``moetool.kernels.common.TOKEN_GROUP``)
TOKEN_GROUP = 0
#: a format's ``activation_quant`` -> the fp8 group size along the row
ACT_GROUPS = {"fp8-1x128": 128, "fp8-token": TOKEN_GROUP}


def served_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype an engine serves a model of ``model_dtype`` in: fp16 stays fp16, everything else
    runs in bf16 (vLLM's ``--dtype auto`` serves float32 checkpoints in bf16 as well)."""
    return torch.float16 if model_dtype == torch.float16 else torch.bfloat16


@dataclass(frozen=True)
class Numerics:
    """How the converted side computes one MoE layer."""

    mode: str  # "served" | "exact"
    #: activations at the MoE boundary and between the expert GEMMs (float32 when exact)
    act_dtype: torch.dtype = torch.float32
    #: fp8 activation quantization before each expert GEMM: the group size along the row (128,
    #: or TOKEN_GROUP for one scale per token), None = activations stay in ``act_dtype``
    act_group: int | None = None

    @property
    def exact(self) -> bool:
        return self.mode == "exact"

    @property
    def wire_dtype(self) -> torch.dtype:
        """dtype of unquantized token rows and of the experts' results on the wire: the
        activations' (float32 when exact)."""
        return self.act_dtype

    @property
    def act_quant(self) -> str | None:
        """The format's ``activation_quant`` these numerics apply ("fp8-1x128", "fp8-token", None)."""
        return next((name for name, g in ACT_GROUPS.items() if g == self.act_group), None)

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """x float -> float32 holding the values x has in ``act_dtype`` (a copy when rounding)."""
        if self.act_dtype == torch.float32:
            return x.float()
        return x.to(self.act_dtype).float()

    def describe(self) -> str:
        """'served: bf16 activations, fp8 per-token' / 'exact: float32, unquantized activations'."""
        if self.exact:
            return "exact: float32, unquantized activations"
        dtype = str(self.act_dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float16", "fp16")
        quant = {None: "", 128: ", fp8 1x128 groups", TOKEN_GROUP: ", fp8 per token"}[self.act_group]
        return f"served: {dtype} activations{quant}"

    def to_json(self) -> dict:
        return {"mode": self.mode, "act_dtype": str(self.act_dtype).replace("torch.", ""),
                "act_quant": self.act_quant}


def model_numerics(mode: str, fmt, ckpt, spec) -> Numerics:
    """The numerics of ``mode`` for a checkpoint (``ckpt`` with its ``spec``) whose experts are in
    ``fmt``; the model's dtype is its first MoE layer's router weight's (routers are never
    quantized). The parent and the ranks both ask the shards, so both round alike."""
    return numerics_for(mode, fmt, ckpt.info(spec.moe_layers[0].router_weight).dtype)


def numerics_for(mode: str, fmt, model_dtype: torch.dtype) -> Numerics:
    """The numerics of ``mode`` for shards in format ``fmt`` (a ``WeightFormat``: its
    ``activation_quant`` is the served policy) of a model stored in ``model_dtype``."""
    if mode not in NUMERICS:
        raise MoetoolError(f"--numerics {mode!r}: expected {' or '.join(NUMERICS)}")
    if mode == "exact":
        return Numerics("exact")
    quant = fmt.activation_quant
    if quant is not None and quant not in ACT_GROUPS:
        raise MoetoolError(f"format {fmt.name}: activation_quant {quant!r} is not one verify runs "
                           f"({', '.join(ACT_GROUPS)})")
    return Numerics("served", served_dtype(model_dtype), ACT_GROUPS.get(quant) if quant else None)
