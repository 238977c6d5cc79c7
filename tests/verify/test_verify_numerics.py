"""Served and exact numerics: the policy each format declares, and the torch experts' served
emulation against a step-by-step emulation of the engine, in one process (the distributed
path is in test_verify_dispatch.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import verify_workers as vw  # noqa: E402

from moetool.errors import MoetoolError  # noqa: E402
from moetool.formats import FORMATS, get_format  # noqa: E402
from moetool.kernels.common import TOKEN_GROUP as KERNEL_TOKEN_GROUP  # noqa: E402
from moetool.kernels.quant import fp8_act_quant_ref, fp8_dequant_act_ref  # noqa: E402
from moetool.verify.experts import TorchExperts, TritonExperts  # noqa: E402
from moetool.verify.numerics import ACT_GROUPS, TOKEN_GROUP, Numerics, numerics_for, served_dtype  # noqa: E402

CPU = torch.device("cpu")
#: what each built-in format's served numerics quantize its activations with (vLLM's math)
SERVED_ACT_GROUP = {"dense": None, "int4-group": None, "fp8-block": 128, "fp8-channel": 0}


def test_each_format_declares_the_engines_activation_policy():
    assert TOKEN_GROUP == KERNEL_TOKEN_GROUP
    for name, group in SERVED_ACT_GROUP.items():
        nm = numerics_for("served", FORMATS[name], torch.bfloat16)
        assert (nm.act_dtype, nm.act_group) == (torch.bfloat16, group), name
        assert nm.act_quant == FORMATS[name].activation_quant
        exact = numerics_for("exact", FORMATS[name], torch.bfloat16)
        assert (exact.act_dtype, exact.act_group) == (torch.float32, None)
    for name, cls in FORMATS.items():  # every registered format, new ones included
        assert cls.activation_quant is None or cls.activation_quant in ACT_GROUPS, name
    # an engine serves float32 checkpoints in bf16 and fp16 ones in fp16
    assert served_dtype(torch.float32) == served_dtype(torch.bfloat16) == torch.bfloat16
    assert served_dtype(torch.float16) == torch.float16
    # rows and results travel in the served dtype (an fp16 model's in fp16, not bf16), exact in float32
    assert numerics_for("served", FORMATS["dense"], torch.float16).wire_dtype == torch.float16
    assert numerics_for("served", FORMATS["int4-group"], torch.bfloat16).wire_dtype == torch.bfloat16
    assert Numerics("exact").wire_dtype == torch.float32
    with pytest.raises(MoetoolError, match="--numerics 'fast'"):
        numerics_for("fast", FORMATS["dense"], torch.bfloat16)


def test_describe_names_what_runs():
    assert numerics_for("served", FORMATS["fp8-channel"], torch.bfloat16).describe() == \
        "served: bf16 activations, fp8 per token"
    assert numerics_for("served", FORMATS["fp8-block"], torch.float16).describe() == \
        "served: fp16 activations, fp8 1x128 groups"
    assert Numerics("exact").describe() == "exact: float32, unquantized activations"


def _bf16(t):
    return t.to(torch.bfloat16).float()


def _emulate_expert(x, tensors13, tensors2, fmt, group, N):
    """One expert as the engine runs it, step by step: x [n, H] bf16 values -> [n, H]."""
    gate_t, up_t = fmt.split_rows(tensors13, [N, N])
    weights = [fmt.dequantize(t) for t in (gate_t, up_t, tensors2)]
    if group is None:
        weights = [_bf16(w) for w in weights]

    def gemm_input(t):
        return t if group is None else fp8_dequant_act_ref(*fp8_act_quant_ref(t, group), group)

    g, u, d = weights
    xe = gemm_input(x)
    h = _bf16(F.silu(_bf16(xe @ g.t())) * _bf16(xe @ u.t()))
    return gemm_input(h) @ d.t()


@pytest.mark.parametrize("fmt_name", list(SERVED_ACT_GROUP))
def test_served_torch_experts_equal_the_engine_emulation(fmt_name):
    params = {"group_size": 8} if fmt_name == "int4-group" else {}
    layer = vw.make_layer("softmax")
    placement = vw.linear_placement(8, 2)
    local = vw.local_experts(layer, placement, 0, fmt_name, **params)
    fmt = get_format(fmt_name, **params)
    nm = numerics_for("served", fmt, torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, vw.H, generator=gen)
    ids = torch.tensor([[0], [1], [2], [3], [0], [2], [1]])
    w = torch.rand(7, 1, generator=gen)
    counts = torch.bincount(ids.flatten(), minlength=4)
    experts = TorchExperts(numerics=nm)
    experts.bind(local, CPU)
    y = experts.apply(x, None, ids, w, counts)
    want = torch.zeros_like(x)
    xb = _bf16(x)
    for t in range(7):
        s = int(ids[t, 0])
        t13, t2 = local.slot(s)
        want[t] = _bf16(_emulate_expert(xb[t:t + 1], t13, t2, fmt, SERVED_ACT_GROUP[fmt_name], vw.N) * w[t, 0])[0]
    torch.testing.assert_close(y, want, rtol=0, atol=0)  # the same operations in the same order
    # the check can fail: a doubled down scale (or weight, dense) in slot 2 moves its tokens
    key = next((k for k in fmt.suffixes if "scale" in k), "weight")
    local.w2[key][2] *= 2
    broken = TorchExperts(numerics=nm)
    broken.bind(local, CPU)
    rel = float((broken.apply(x, None, ids, w, counts) - want).norm() / want.norm())
    assert rel > 0.1


def test_exact_numerics_keep_float32_and_differ_from_served():
    layer = vw.make_layer("softmax")
    local = vw.local_experts(layer, vw.linear_placement(8, 2), 0, "fp8-channel")
    x = torch.randn(5, vw.H, generator=torch.Generator().manual_seed(2))
    ids = torch.zeros(5, 1, dtype=torch.int64)
    w = torch.ones(5, 1)
    counts = torch.tensor([5, 0, 0, 0])
    outs = {}
    for mode in ("exact", "served"):
        experts = TorchExperts(numerics=numerics_for(mode, local.fmt, torch.bfloat16))
        experts.bind(local, CPU)
        outs[mode] = experts.apply(x, None, ids, w, counts)
    g, u, d = (local.fmt.dequantize(t) for t in (*local.fmt.split_rows(local.slot(0)[0], [vw.N, vw.N]),
                                                  local.slot(0)[1]))
    torch.testing.assert_close(outs["exact"], (F.silu(x @ g.t()) * (x @ u.t())) @ d.t(), rtol=1e-5, atol=1e-5)
    rel = float((outs["served"] - outs["exact"]).norm() / outs["exact"].norm())
    assert 1e-3 < rel < 0.05  # fp8 activations: about 2-3 % per GEMM input


def test_exact_numerics_refuse_the_w8a8_kernels():
    layer = vw.make_layer("softmax")
    local = vw.local_experts(layer, vw.linear_placement(8, 2), 0, "fp8-block")
    with pytest.raises(MoetoolError, match="--numerics exact with --experts triton: the fp8-block kernels"):
        TritonExperts(Numerics("exact")).bind(local, CPU)
