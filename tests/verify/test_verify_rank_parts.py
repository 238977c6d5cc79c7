"""Parts of a verify run around the ranks, each broken on purpose: results crossing to the
parent compacted only where exact, per-expert loading refusing unlike experts, the parent's
reference thread stopped by a failed world, an interrupted rank not waiting for its hashing."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from moetool.demo.tiny import make_tiny_checkpoint
from moetool.errors import MoetoolError
from moetool.model.families import describe
from moetool.read.checkpoint import open_checkpoint
from moetool.read.experts import ExpertReader
from moetool.read.shards import EPShards
from moetool.verify import driver, rank
from moetool.verify.rank import compact, load_local_experts, opened_and_checked


def test_compact_sends_half_precision_only_where_every_value_survives():
    exact = torch.randn(64, 32).to(torch.bfloat16).float()
    assert compact(exact).dtype == torch.bfloat16 and torch.equal(compact(exact).float(), exact)
    fp16_only = torch.full((4,), 1 + 2 ** -10)  # exact in fp16, not in bf16
    assert compact(fp16_only).dtype == torch.float16
    fine = torch.full((4,), 1 + 2 ** -20)  # exact in neither
    assert compact(fine).dtype == torch.float32
    with_nan = exact.clone()
    with_nan[0, 0] = float("nan")
    got = compact(with_nan)
    assert got.dtype == torch.float32 and torch.isnan(got[0, 0])
    assert compact(torch.arange(4)).dtype == torch.int64  # not a float32 tensor: as it is


@pytest.fixture(scope="module")
def per_expert(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("pe") / "m", "qwen3_moe", hidden=64, intermediate=32,
                                experts=4, top_k=2, layers=2, dtype=torch.float32, shards=1)
    with open_checkpoint(path) as ckpt:
        yield ckpt, describe(ckpt.config, ckpt.tensors)


def test_per_expert_loading_stacks_every_expert(per_expert):
    ckpt, spec = per_expert
    reader = ExpertReader(ckpt, spec)
    layer = spec.moe_layers[0]
    local = load_local_experts(reader, layer, list(range(layer.num_experts)))
    for e in range(layer.num_experts):
        g, u, d = (lin["weight"] for lin in reader.gate_up_down(layer, e))
        assert torch.equal(local.w13["weight"][e], torch.cat([g, u])) and torch.equal(local.w2["weight"][e], d)
    assert local.num_experts == layer.num_experts  # on all ranks: the kernels' tile rules count over them


@pytest.mark.parametrize("damage", ["shape", "dtype", "missing"])
def test_per_expert_loading_refuses_an_expert_unlike_the_first(per_expert, monkeypatch, damage):
    ckpt, spec = per_expert
    reader = ExpertReader(ckpt, spec)
    layer = spec.moe_layers[0]
    original = ExpertReader.gate_up_down

    def unlike(self, lay, e):
        gate, up, down = original(self, lay, e)
        if e == 2:
            w = down["weight"]
            if damage == "shape":  # broadcastable into slot 0's [H, N]: a stack would refuse it
                down = {"weight": w[:1]}
            elif damage == "dtype":
                down = {"weight": w.to(torch.float16)}
            else:  # the weight missing: an expert with none of slot 0's tensors
                down = {}
        return gate, up, down

    monkeypatch.setattr(ExpertReader, "gate_up_down", unlike)
    with pytest.raises(MoetoolError, match=r"local slot 2 \(expert 2\) has w2 tensors"):
        load_local_experts(reader, layer, list(range(layer.num_experts)))


def test_a_failed_world_stops_the_reference_thread(monkeypatch, verify_chain, verify_shards):
    model, chain = verify_chain
    seen: dict = {}

    def slow_reference(ref_ckpt, spec, opts, layer_ids, numerics, device, stop=None):
        seen["stopped"] = stop.wait(30)
        yield from ()

    def failing_world(*args, **kwargs):
        raise MoetoolError("rank 1 failed: on purpose")

    monkeypatch.setattr(driver, "iter_references", slow_reference)
    monkeypatch.setattr(driver, "spawn_world", failing_world)
    t0 = time.monotonic()
    with pytest.raises(MoetoolError, match="on purpose"):
        driver.verify(verify_shards("fp8-block", 2), model, driver.VerifyOptions(ep=2, tokens=8))
    assert seen["stopped"] and time.monotonic() - t0 < 20


def test_an_interrupted_rank_does_not_wait_for_its_hashing(monkeypatch, verify_shards):
    shards = EPShards(verify_shards("fp8-block", 2), check=False)
    release = threading.Event()
    monkeypatch.setattr(rank, "verify_manifest", lambda *a, **k: release.wait(30))
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with opened_and_checked(shards, 0):
            raise KeyboardInterrupt
    assert time.monotonic() - t0 < 5
    release.set()


def test_before_fill_sees_the_stack_before_the_experts_are_read(per_expert, monkeypatch):
    ckpt, spec = per_expert
    reader = ExpertReader(ckpt, spec)
    layer = spec.moe_layers[0]
    reads: list[int] = []
    original = ExpertReader.gate_up_down
    monkeypatch.setattr(ExpertReader, "gate_up_down", lambda self, lay, e: reads.append(e) or original(self, lay, e))
    seen = {}

    def before_fill(local):
        seen["reads"] = list(reads)
        seen["w13"] = local.w13["weight"].clone()

    local = load_local_experts(reader, layer, list(range(layer.num_experts)), before_fill=before_fill)
    assert seen["reads"] == [0]  # expert 0 gives the shapes; nothing else is read before the rehearsal
    assert seen["w13"].shape == local.w13["weight"].shape and not seen["w13"].any()
    assert reads == list(range(layer.num_experts)) and local.w13["weight"].any()


def test_a_rehearsal_on_zero_weights_leaves_the_checked_run_as_it_was(monkeypatch, verify_chain, verify_shards):
    """The first layer run once on zero weights before they are read (on GPUs by default; forced
    here): the report is the one without it. The torch backend caches its dequantized weights
    at bind: a rehearsal that left them would check the zeros."""
    model, _ = verify_chain
    shards = verify_shards("fp8-block", 2)
    opts = driver.VerifyOptions(ep=2, tokens=16, dispatch="all2all", experts="torch", layers=(1, 2))
    reports = {}
    for forced in ("0", "1"):
        monkeypatch.setenv(rank.REHEARSE_ENV, forced)
        reports[forced] = driver.verify(shards, model, opts)
    plain, rehearsed = reports["0"], reports["1"]
    assert plain.passed and rehearsed.passed
    for a, b in zip(plain.layers, rehearsed.layers):
        assert (a.rel_err, a.max_abs_err, a.worst_expert_rel_err) == (b.rel_err, b.max_abs_err, b.worst_expert_rel_err)
    assert "rank_rehearsed_s" in rehearsed.timings_s and "rank_rehearsed_s" not in plain.timings_s
