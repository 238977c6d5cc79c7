"""The GPU-only paths of a rank: experts read onto the device a slot at a time, and the shared
expert in the served dtype on a side stream. Skipped without CUDA (CI); run on the device."""
from __future__ import annotations

import pytest
import torch

from moetool.model.spec import ExpertActivation
from moetool.read.shards import EPShards
from moetool.verify.layer import PhaseTimer, _shared_on_side
from moetool.verify.numerics import numerics_for
from moetool.formats.registry import FORMATS
from moetool.read.experts import ExpertReader
from moetool.verify.rank import load_local_experts
from moetool.verify.reference import shared_forward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
#: bf16 GEMMs against float32 GEMMs of the same bf16 values, rounded alike: accumulation order
SHARED_REL_ERR = 1e-2


@pytest.mark.parametrize("fmt", ["fp8-block", "int4-group", "dense"])
def test_experts_read_to_the_gpu_slot_by_slot_equal_the_host_read(verify_shards, fmt):
    shards = EPShards(verify_shards(fmt, 2), check=False)
    ckpt, spec = shards.open_rank(1, check=False)
    with ckpt:
        reader = ExpertReader(ckpt, spec)
        layer = spec.moe_layers[0]
        slots = shards.placements[layer.index].slots[1]
        host = load_local_experts(reader, layer, slots)
        dev = load_local_experts(reader, layer, slots, torch.device("cuda"))
    for a, b in ((host.w13, dev.w13), (host.w2, dev.w2)):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k].is_cuda and torch.equal(a[k], b[k].cpu()), k


def test_shared_expert_on_a_side_stream_matches_the_served_emulation():
    gen = torch.Generator().manual_seed(0)
    T, H, Ns = 64, 256, 384
    x = torch.randn(T, H, generator=gen)
    shared = (torch.randn(Ns, H, generator=gen) * H ** -0.5, torch.randn(Ns, H, generator=gen) * H ** -0.5,
              torch.randn(H, Ns, generator=gen) * Ns ** -0.5, torch.randn(1, H, generator=gen) * H ** -0.5)
    nm = numerics_for("served", FORMATS["dense"], torch.bfloat16)
    want = shared_forward(nm.round(x), tuple(nm.round(w) for w in shared), nm.round)
    timer = PhaseTimer(torch.device("cuda"))
    side = torch.cuda.Stream()
    y = _shared_on_side(side, nm.round(x).cuda(), tuple(w.to("cuda", nm.act_dtype) for w in shared), nm,
                        type("L", (), {"activation": ExpertActivation()})(), timer)
    torch.cuda.current_stream().wait_stream(side)
    got = y.float().cpu()
    assert y.dtype == torch.bfloat16
    assert float((got - want).norm() / want.norm()) < SHARED_REL_ERR
    assert timer.report()["cuda_shared_s"] > 0
