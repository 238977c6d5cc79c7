"""Triton kernels with thin checked host wrappers, each with a pure-torch reference beside it.

Run on CUDA tensors, or on CPU with TRITON_INTERPRET=1 set before this package is imported.
A leaf: the modules import torch, triton and ``moetool.errors`` only (a weight format passes
what a kernel needs to know about it; it names its scheme as ``kernel_scheme``).

Modules (import the names from them):

* ``quant``        fp8 block / per-token-group / per-token quantization (weights, activations)
* ``int4_quant``   int4 group quantization and pack-quantized packing (weights)
* ``fused_moe``    ``fused_experts``: one rank's routed experts, the pipeline below, and its reference
* ``moe_align``    token-slot pairs sorted by expert and padded to the GEMM's row blocks
* ``moe_weights``  the stacked weight schemes: their checks and the reference's dequantization
* ``moe_gemm``     the grouped expert GEMM
* ``moe_tiles``    its tile sizes per scheme
* ``moe_silu``     silu(gate) * up, optionally fp8-quantized per 1x128 group or per token
* ``moe_sum``      the sum over each token's k slots
* ``ep_dispatch``, ``ep_combine``  expert-parallel routing, packing and combining of token rows
* ``common``       exact rounding helpers, host checks and constants (``TOKEN_GROUP``) shared by
                   the kernels
"""
