"""Tile sizes of the grouped GEMMs (:mod:`moetool.kernels.moe_gemm`): the config type and the
defaults per weight scheme, measured on an H100 by ``bench/kernels.py --sweep``."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import FP8_BLOCK
from .moe_weights import SCHEMES


@dataclass(frozen=True)
class MoeConfig:
    """Tile sizes of the grouped GEMMs (powers of two >= 16; fp8-block: 128 % block_k == 0)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


# Tiles per scheme for (pairs per expert <= 32, <= 256, more): the best of bench/kernels.py
# --sweep on an H100 (DeepSeek-V3 expert shapes H 7168, N 2048, 32 local experts, bf16
# activations, T 64 / 512 / 4096). (block_m, block_n, block_k, group_m, num_warps, num_stages)
_TILES = {
    "dense": ((16, 128, 128, 1, 4, 3), (128, 128, 64, 16, 8, 3), (128, 128, 64, 16, 8, 3)),
    "fp8-block": ((16, 64, 128, 1, 4, 3), (64, 128, 128, 8, 8, 3), (64, 128, 128, 8, 8, 3)),
    "fp8-channel": ((16, 64, 128, 1, 4, 4), (64, 64, 64, 8, 4, 4), (128, 128, 64, 16, 8, 3)),
    "int4-group": ((16, 64, 64, 1, 4, 3), (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 3)),
}


def default_config(scheme: str, pairs_per_expert: float, act_dtype: torch.dtype, interpreted: bool,
                   group_size: int = 128) -> MoeConfig:
    """Tiles from ``_TILES`` by pairs per expert (T*k/E: an upper bound, -1 pairs included, as
    counting the real ones would need a host sync). fp32 activations: 2 stages (shared memory).
    int4: block_k <= g when g is a power of two, so a K tile never straddles two groups."""
    sch = SCHEMES[scheme]
    if interpreted:  # small tiles: fewer wasted lanes in tiny tests
        return MoeConfig(16, 32, FP8_BLOCK if sch.fp8_acts else 32, 1, 4, 1)
    small, mid, large = _TILES[scheme]
    bm, bn, bk, gm, warps, stages = small if pairs_per_expert <= 32 else mid if pairs_per_expert <= 256 else large
    if act_dtype == torch.float32:
        stages = 2
        bm, bn = min(bm, 64), min(bn, 64)
    if sch.groups and group_size >= 16 and group_size & (group_size - 1) == 0:
        bk = min(bk, group_size)
    return MoeConfig(bm, bn, bk, gm, warps, stages)
