"""dense: the unquantized weight, stored in the model's dtype (bf16 usually)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moetool.errors import MoetoolError
from moetool.formats.base import Tensors, WeightFormat, register
from moetool.formats.common import (
    check_suffixes,
    check_weight,
)

@register
@dataclass(frozen=True)
class Dense(WeightFormat):
    """``weight`` [N, K] in the original dtype; no ``quantization_config``."""

    name: ClassVar[str] = "dense"
    suffixes: ClassVar[tuple[str, ...]] = ("weight",)
    quantized: ClassVar[bool] = False
    row_blocks: ClassVar[dict[str, int]] = {"weight": 1}
    # round trip on torch.randn weights (formats/base.py ``tolerance``): bf16 rounding,
    # rel_err 0.00165 - 0.00168
    tolerance: ClassVar[dict[str, float]] = {"rel_err": 0.0025, "sqnr_db": 52.0}
    # verify of bf16 shards, layer / worst expert (the demo's model, `moetool verify --ep 4
    # --dp 2 --tokens 1024`): served (bf16 activations, weights and stored outputs) 0.0039 /
    # 0.0037; --numerics exact 4e-8 / 0
    verify_tolerances: ClassVar[dict[str, float]] = {"rel_err": 0.01, "expert_rel_err": 0.01}
    activation_quant: ClassVar[str | None] = None
    kernel_scheme: ClassVar[str | None] = "dense"

    def quantize(self, w: torch.Tensor, orig_dtype: torch.dtype) -> Tensors:
        check_weight(w)
        if not orig_dtype.is_floating_point:
            raise MoetoolError(f"cannot store a dense weight as {orig_dtype}")
        return {"weight": w.to(orig_dtype).contiguous()}

    def dequantize(self, t: Tensors) -> torch.Tensor:
        """A fresh float32 copy, even of a float32 weight: callers may overwrite it
        (``error_sums`` does), and it must not be the stored tensor itself."""
        self.logical_shape(t)
        return t["weight"].to(torch.float32, copy=True)

    def logical_shape(self, t: Tensors) -> tuple[int, int]:
        check_suffixes(self.name, t, self.suffixes)
        weight = t["weight"]
        if weight.dim() != 2 or not weight.is_floating_point():
            raise MoetoolError(
                f"weight must be a 2-D float tensor, got {list(weight.shape)} {weight.dtype}"
            )
        n, k = weight.shape
        return n, k

    def quantization_config(self, ignore: list[str]) -> dict | None:
        return None
