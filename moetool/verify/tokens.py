"""The test tokens of a verify run, made the same way by the ranks (their input) and by the
parent (the reference's input): deterministic per (seed, layer, dp group), scaled like real
MoE inputs. Letters: T = tokens, H = hidden."""
from __future__ import annotations

import torch

from moetool.model.families import MoELayerSpec
from moetool.verify.numerics import Numerics

#: rows of the probe batch each local expert runs alone
PROBE_TOKENS = 32


def make_tokens(layer: int, group: int, tokens: int, hidden: int, seed: int,
                norm_weight: torch.Tensor | None, numerics: Numerics | None = None) -> torch.Tensor:
    """Deterministic test tokens [T, H] float32 for one (layer, dp group): N(0, 1) rows scaled
    by the layer's post-attention RMSNorm weight, as real MoE inputs are; rounded to the
    served dtype of ``numerics`` (the reference then sees exactly the converted side's input,
    and both route the same)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 1_009 + group)
    x = torch.randn(tokens, hidden, generator=g)
    if norm_weight is not None:
        x = x * norm_weight.float()
    return x if numerics is None else numerics.round(x)


def probe_tokens(layer: int, hidden: int, seed: int, norm_weight: torch.Tensor | None,
                 numerics: Numerics | None = None) -> torch.Tensor:
    """The probe batch [PROBE_TOKENS, H] of a layer, the same on every rank."""
    return make_tokens(layer, 10_007, PROBE_TOKENS, hidden, seed, norm_weight, numerics)


def norm_weight_name(layer: MoELayerSpec) -> str:
    return layer.prefix.rsplit(".", 1)[0] + ".post_attention_layernorm.weight"
