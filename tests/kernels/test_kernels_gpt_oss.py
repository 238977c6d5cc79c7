"""gpt-oss's experts in the fused kernels: clamped SwiGLU and expert biases (epilogues), against
fused_experts_ref, on the GPU or under Triton's interpreter (fp32 and fp16 activations)."""
from __future__ import annotations

import pytest
import torch

from moetool.formats import get_format
from moetool.kernels import fused_moe as fm

#: relative error of the kernels against the reference: fp32 (summation order), fp16 (the
#: reference emulates the fp16 intermediates)
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
SWIGLU = (1.702, 0.5)  # alpha, limit: a limit the random gate and up cross, so the clamp cuts


def _case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, H, N, T, k = 4, 64, 32, 24, 2
    w13 = {"weight": (torch.randn(E, 2 * N, H, generator=g) / H ** 0.5)}
    w2 = {"weight": (torch.randn(E, H, N, generator=g) / N ** 0.5)}
    b13, b2 = torch.randn(E, 2 * N, generator=g) * 0.2, torch.randn(E, H, generator=g) * 0.2
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    return x, w13, w2, b13, b2, ids, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_clamped_swiglu_and_biases_match_the_reference(dtype, device):
    x, w13, w2, b13, b2, ids, w = _case(dtype)
    fmt = get_format("dense")
    kw = dict(activation="clamped-swiglu", swiglu=SWIGLU)
    want = fm.fused_experts_ref(x, w13, w2, "dense", ids, w, dequantize=fmt.dequantize, split_rows=fmt.split_rows,
                                emulate=None if dtype == torch.float32 else dtype, w13_bias=b13, w2_bias=b2, **kw)
    args = (x.to(device), {"weight": w13["weight"].to(device)}, {"weight": w2["weight"].to(device)}, "dense",
            ids.to(device), w.to(device))
    kw.update(w13_bias=b13.to(device), w2_bias=b2.to(device))
    got = fm.fused_experts(*args, **kw).cpu()
    assert float((got - want).norm() / want.norm()) < TOL[dtype]
    # the clamp and each bias matter: without them the same call is far from the reference
    for drop in ({"activation": "silu", "swiglu": None}, {"w13_bias": None}, {"w2_bias": None}):
        other = fm.fused_experts(*args, **{**kw, **drop}).cpu()
        assert float((other - want).norm() / want.norm()) > 20 * TOL[dtype], drop


def test_clamped_swiglu_needs_its_parameters():
    x, w13, w2, b13, b2, ids, w = _case(torch.float32)
    with pytest.raises(Exception, match="swiglu = \\(alpha, limit\\) goes with activation 'clamped-swiglu'"):
        fm.fused_experts(x, w13, w2, "dense", ids, w, activation="clamped-swiglu")
    with pytest.raises(Exception, match="w2_bias must be float \\[4, 64\\]"):
        fm.fused_experts(x, w13, w2, "dense", ids, w, w2_bias=b2[:, :10])
