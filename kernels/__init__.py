"""Triton kernels with thin checked host wrappers, each with a pure-torch reference beside it.

Run on CUDA tensors, or on CPU with TRITON_INTERPRET=1 set before this package is imported.
"""
from .fused_moe import (
    MoeConfig,
    fused_experts,
    fused_experts_ref,
    moe_align_block_size,
    moe_align_block_size_ref,
    moe_sum,
    moe_sum_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from .quant import (
    fp8_act_quant,
    fp8_act_quant_ref,
    fp8_block_quant,
    fp8_block_quant_ref,
    int4_dequant_ref,
    int4_group_quant_pack,
    int4_group_quant_pack_ref,
)

__all__ = [
    "MoeConfig",
    "fp8_act_quant",
    "fp8_act_quant_ref",
    "fp8_block_quant",
    "fp8_block_quant_ref",
    "fused_experts",
    "fused_experts_ref",
    "int4_dequant_ref",
    "int4_group_quant_pack",
    "int4_group_quant_pack_ref",
    "moe_align_block_size",
    "moe_align_block_size_ref",
    "moe_sum",
    "moe_sum_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
]
