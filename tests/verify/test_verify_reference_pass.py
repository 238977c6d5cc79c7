"""The parent's reference pass: one read of each expert for every dp group and the probe,
bit-exact with a plain per-expert loop, refusing an incomplete pass, and stoppable."""
from __future__ import annotations

import threading

import pytest
import torch

from moetool.errors import MoetoolError
from moetool.model.families import describe
from moetool.model.spec import RouterSpec
from moetool.read.checkpoint import open_checkpoint
from moetool.read.experts import ExpertReader
from moetool.verify.driver import VerifyOptions, iter_references
from moetool.formats.registry import FORMATS
from moetool.verify.numerics import model_numerics
from moetool.verify.reference import StreamingReference, reference_moe_forward, swiglu
from moetool.verify.router import route
from moetool.verify.tokens import make_tokens, norm_weight_name

T, H, N, E, K = 20, 32, 24, 6, 2


def _weights(seed: int):
    gen = torch.Generator().manual_seed(seed)
    experts = [tuple(torch.randn(shape, generator=gen) * 0.2 for shape in ((N, H), (N, H), (H, N))) for _ in range(E)]
    return torch.randn(E, H, generator=gen), experts


def _loop(x, gate, spec, experts):
    """Written out independently: each expert's tokens by nonzero, accumulated in expert order."""
    ids, w = route(x, gate, spec, None, None)
    out = torch.zeros_like(x)
    for e, (g, u, d) in enumerate(experts):
        tok, j = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel():
            out.index_add_(0, tok, swiglu(x[tok], g, u, d) * w[tok, j][:, None])
    return out


def test_streaming_reference_matches_a_per_expert_loop_for_every_batch():
    gate, experts = _weights(0)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(T, H, generator=gen), torch.randn(T + 3, H, generator=gen)]
    probe = torch.randn(5, H, generator=gen)
    spec = RouterSpec(top_k=K)
    ref = StreamingReference(xs, gate, None, spec, probe=probe)
    for e, w in enumerate(experts):
        ref.add(e, *w)
    got = ref.finish()
    for x, y in zip(xs, got):
        assert torch.equal(y, _loop(x, gate, spec, experts))
    for e, w in enumerate(experts):
        assert torch.equal(ref.probe_out[e], swiglu(probe, *w))


def test_streaming_reference_refuses_a_missing_or_repeated_expert():
    gate, experts = _weights(2)
    ref = StreamingReference([torch.randn(T, H)], gate, None, RouterSpec(top_k=K))
    for e, w in enumerate(experts[:-1]):
        ref.add(e, *w)
    with pytest.raises(MoetoolError, match="1 experts never given"):
        ref.finish()
    with pytest.raises(MoetoolError, match="expert 0 given twice"):
        ref.add(0, *experts[0])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moetool.demo.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ref") / "m", "deepseek_v3", hidden=64, intermediate=32,
                                experts=8, top_k=2, layers=3, dtype=torch.float32)
    with open_checkpoint(path) as ckpt:
        yield ckpt, describe(ckpt.config, ckpt.tensors)


def test_reference_pass_reads_each_expert_once_for_all_groups(tiny, monkeypatch):
    ckpt, spec = tiny
    reads: list[tuple[int, int]] = []
    original = ExpertReader.expert_linears

    def counting(self, layer, e, roles):
        reads.append((layer.index, e))
        return original(self, layer, e, roles)

    monkeypatch.setattr(ExpertReader, "expert_linears", counting)
    layers = [m.index for m in spec.moe_layers]
    opts = VerifyOptions(dp=2, ep=2, tokens=16)
    numerics = model_numerics("exact", FORMATS["dense"], ckpt, spec)
    got = dict(iter_references(ckpt, spec, opts, layers, numerics, torch.device("cpu")))
    assert sorted(reads) == sorted((i, e) for i in layers for e in range(spec.layer(i).num_experts))
    assert len(reads) == len(set(reads))
    # the same numbers as the plain forward, one group at a time
    reader = ExpertReader(ckpt, spec)
    layer = spec.layer(layers[0])
    nw = ckpt.get(norm_weight_name(layer))
    for g in range(2):
        x = make_tokens(layer.index, g, 16, layer.hidden, 0, nw, numerics)
        want = reference_moe_forward(x, ckpt.get(layer.router_weight).float(),
                                     ckpt.get(layer.correction_bias).float() if layer.correction_bias else None,
                                     layer.router, [reader.expert_fp32(layer, e) for e in range(layer.num_experts)],
                                     reader.shared_fp32(layer))
        assert torch.equal(got[layer.index].groups[g], want)
    assert sorted(got[layer.index].probe) == list(range(layer.num_experts))


def test_reference_pass_stops_when_asked(tiny):
    ckpt, spec = tiny
    stop = threading.Event()
    stop.set()
    numerics = model_numerics("exact", FORMATS["dense"], ckpt, spec)
    got = dict(iter_references(ckpt, spec, VerifyOptions(tokens=8), [m.index for m in spec.moe_layers], numerics,
                               torch.device("cpu"), stop))
    assert got == {}
