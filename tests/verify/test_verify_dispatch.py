"""Distributed dispatch -> experts -> combine against the single-process reference (gloo, CPU).

Spawning a world costs seconds, so each world (ep = 2, 4, and 3 with an uneven placement and
redundant replicas) runs once per module and carries many cases (the ep 2 world also the
transport vote and a full shared-memory folder), the three worlds at once; the tests then read
their results. Criteria: ProbeExperts outputs are exact, so dispatch + combine must be bit-exact;
real float32 experts must match the reference to float32 rounding (GEMM batch shapes and
summation order differ); served numerics (bf16 activations, fp8 ones for the fp8 formats) must
match a direct torch emulation of the engine's math to within bf16 rounding.
"""
from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks import verify_workers by name
import verify_workers as vw  # noqa: E402

from moetool.formats import FORMATS, TOLERANCES, get_format  # noqa: E402
from moetool.kernels.quant import fp8_act_quant_ref, fp8_dequant_act_ref  # noqa: E402
from moetool.verify import transports  # noqa: E402
from moetool.verify.launch import spawn_world  # noqa: E402
from moetool.verify.reference import reference_moe_forward  # noqa: E402
from moetool.verify.router import route  # noqa: E402

#: all2all-mapped: the all2all dispatcher storing into the other ranks' shared memory
DISPATCHERS = ("allgather", "all2all", "all2all-mapped")
#: the W8A8 formats and their fp8 activation groups as vLLM runs them (0: one scale per token)
W8A8 = {"fp8-block": 128, "fp8-channel": 0}
#: float32 rounding: relative to the largest output element
RTOL = 1e-6
#: bf16 tokens on the wire and bf16 returned sums: a few bf16 roundings (2^-8 each)
RTOL_BF16 = 2e-2
#: served numerics against the engine emulation: the same math, summed in another order, can
#: round one bf16 output element to its neighbour (2^-8 relative)
RTOL_SERVED = 2 ** -7
#: tokens per chunk of the cases that run in several chunks: every group of more than 8 tokens
#: below takes two or three, the last partial, while smaller groups (and the empty one) send
#: nothing in some of them. Each chunk launches the all2all dispatcher's kernels, interpreted
#: on CPU at tens of ms a launch: more chunks of the same kinds would test nothing new
CHUNK = 8


def _cases(dps, group_sizes, routers, extra=None):
    """Per dp and dispatcher: a bit-exact probe case, each router in several chunks (CHUNK,
    experts alternately weight-and-reduce or delegating it), the first router in one chunk.
    all2all-mapped sends the rows all2all packs, through shared memory: the first two routers
    (both experts modes, shared experts on its combined rows), more would test all2all again."""
    cases = []
    for dp in dps:
        sizes = group_sizes[dp]
        for d in DISPATCHERS:
            base = dict(dp=dp, dispatcher=d, group_sizes=sizes, extra=extra)
            if not vw.ROUTERS[routers[0]][0].apply_weight_on_input:
                cases.append(dict(base, router=routers[0], chunk_size=CHUNK, probe=True))
            for i, router in enumerate(routers[:2] if d == "all2all-mapped" else routers):
                cases.append(dict(base, router=router, chunk_size=CHUNK, reduce=i % 2 == 0, shared=i == 1,
                                  shared_gate=i == 1, seed=i))
            cases.append(dict(base, router=routers[0], chunk_size=4096, reduce=False))
    return cases


WORLDS = {
    # ep=2, dp=1: every router family, both experts weight-and-reduce modes, fp8-block, faults
    "ep2": (2, _cases([1, 2], {1: [19], 2: [11, 6]}, list(vw.ROUTERS)) + [
        dict(dp=1, router="v3-grouped", dispatcher=d, group_sizes=[19], chunk_size=c, fmt=f, numerics="served",
             shared=True)
        for f in W8A8 for d in DISPATCHERS for c in (4096, CHUNK)] + [
        dict(dp=1, router="softmax", dispatcher="allgather", group_sizes=[19], fmt=f, numerics="served", reduce=r,
             fmt_params={"group_size": 8} if f == "int4-group" else {})
        for f in ("dense", "int4-group") for r in (True, False)] + [
        dict(dp=1, router="softmax", dispatcher="all2all", group_sizes=[19], swap=(1, 0, 1), fault="swap"),
        dict(dp=1, router="softmax", dispatcher="all2all-mapped", group_sizes=[19], swap=(0, 0, 1), fault="swap",
             timeout_s=42.5),
        dict(dp=1, router="softmax", dispatcher="allgather", group_sizes=[19], scale=(0, 1), fault="scale"),
        dict(dp=1, router="v3-grouped", dispatcher="all2all", group_sizes=[19], fmt="fp8-block", scale=(1, 2),
             fault="scale", numerics="served"),
    ]),
    # ep=4: dp 1 (tp 4), dp 2 (uneven groups, different chunk counts, an empty group), dp 4 (tp 1)
    "ep4": (4, _cases([1, 2, 4], {1: [21], 2: [13, 0], 4: [9, 3, 7, 5]}, ["v3-grouped", "softmax"])
            + _cases([2], {2: [13, 6]}, ["llama4"])
            # tokens and returned sums in bf16, as served; 21 tokens over tp 4 pad the all-gather.
            # all2all-mapped sends the rows all2all packs (tests/kernels: packed into and combined
            # from peer buffers byte for byte): once, for its bf16 results buffers, in chunks at tp 2
            + [dict(dp=dp, router="softmax", dispatcher=d, group_sizes=sizes, comm_dtype="bfloat16", chunk_size=c)
               for d in ("allgather", "all2all") for dp, sizes in ((1, [21]), (2, [13, 6])) for c in (4096, CHUNK)]
            + [dict(dp=2, router="softmax", dispatcher="all2all-mapped", group_sizes=[13, 6], comm_dtype="bfloat16",
                    chunk_size=CHUNK)]),
    # 7 experts on 3 ranks (linear: 2, 2, 3) plus replicas of experts 0 and 5
    "ep3": (3, _cases([1, 3], {1: [23], 3: [9, 4, 10]}, ["softmax-noren", "llama4"],
                      extra={0: [2], 5: [0, 1]})),
}


#: checks of verify_workers.CHECKS each world runs after its cases
WORLD_CHECKS = {"ep2": ("transports", "shm_full")}
#: how each world runs the dispatch and combine steps (tests/rank_steps.py): the ep 2 world
#: runs the Triton kernels (interpreted) through every dispatcher, format and fault; the larger
#: worlds test what the ranks do around them with the kernels' references (tests/kernels holds
#: each kernel bit-exact to its reference with more ranks, replicas, bf16 rows, empty groups),
#: at a third of their CPU time (the interpreter was ~85 % of it)
EP_STEPS = {"ep2": "kernels", "ep4": "references", "ep3": "references"}


@pytest.fixture(scope="module")
def world_runs():
    """{world name: [per rank {"cases": [...], check: ...}]}. The worlds run at the same time
    (each spawn_world waits for its ranks in a thread of its own), so one world's start-up
    and collective waits overlap another's work."""
    with ThreadPoolExecutor(len(WORLDS)) as pool:
        futures = {name: pool.submit(spawn_world, vw.run_world, world, timeout_s=300,
                                     args=(cases, WORLD_CHECKS.get(name, ()), EP_STEPS[name]))
                   for name, (world, cases) in WORLDS.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def worlds(world_runs):
    """{world name: (world size, cases, per rank [per case {"y", "stats", ...}])}."""
    return {name: (world, cases, [r["cases"] for r in world_runs[name]]) for name, (world, cases) in WORLDS.items()}


def _layer(case):
    return vw.make_layer(case["router"], case.get("seed", 0), case.get("shared", False), case.get("shared_gate", False))


def _tokens(case):
    return vw.make_tokens(sum(case["group_sizes"]), case.get("seed", 0) + 1, case.get("probe", False))


def _engine_emulation(case):
    """What vLLM's fused MoE computes for the case's format, written out step by step in torch
    (the served numerics; independent of moetool's experts backends): routing from the float32
    input (as the reference routes), the experts' input in bf16; W8A8 formats quantize each GEMM input to fp8 from those bf16 values (1x128 groups
    for fp8-block, one scale per token for fp8-channel) and multiply the dequantized weights
    in float32; weight-only formats multiply bf16 activations by their dequantized weights
    rounded to bf16; gate and up outputs, silu(gate) * up and each weighted (token, expert)
    output are stored in bf16, summed over k in float32; the shared expert runs in bf16; the
    block's output is bf16."""
    layer, x = _layer(case), _tokens(case)
    fmt = get_format(case["fmt"], **case.get("fmt_params", {}))
    group = W8A8.get(case["fmt"])

    def bf16(t):
        return t.to(torch.bfloat16).float()

    def gemm_input(t):
        if group is None:
            return t
        return fp8_dequant_act_ref(*fp8_act_quant_ref(t, group), group)

    def weight(w):
        deq = fmt.dequantize(fmt.quantize(w, torch.float32))
        return deq if group is not None else bf16(deq)

    ids, w = route(x, layer["gate"], layer["spec"], layer["bias"])  # from the float32 input, as the reference
    x = bf16(x)
    routed = torch.zeros_like(x)
    for e, (g, u, d) in enumerate(layer["experts"]):
        tok, j = torch.nonzero(ids == e, as_tuple=True)
        xe = gemm_input(x[tok])
        h = bf16(torch.nn.functional.silu(bf16(xe @ weight(g).t())) * bf16(xe @ weight(u).t()))
        routed.index_add_(0, tok, bf16((gemm_input(h) @ weight(d).t()) * w[tok, j][:, None]))
    if layer["shared"] is not None:
        sg, su, sd, gate = (None if t is None else bf16(t) for t in layer["shared"])
        shared = bf16(bf16(torch.nn.functional.silu(bf16(x @ sg.t())) * bf16(x @ su.t())) @ sd.t())
        if gate is not None:
            shared = bf16(torch.sigmoid(x @ gate.t()) * shared)
        routed = routed + shared
    return bf16(routed)


def _reference(case):
    layer, x = _layer(case), _tokens(case)
    if case.get("probe"):
        ids, _ = route(x, layer["gate"], layer["spec"], layer["bias"])
        return vw.probe_reference(x, ids)
    if case.get("numerics") == "served":
        return _engine_emulation(case)
    experts = layer["experts"]
    if case.get("fmt", "dense") != "dense":  # exact numerics: the shard's dequantized weights, float32 math
        fmt = get_format(case["fmt"], **case.get("fmt_params", {}))
        experts = [tuple(fmt.dequantize(fmt.quantize(w, torch.float32)) for w in e) for e in experts]
    return reference_moe_forward(x, layer["gate"], layer["bias"], layer["spec"], experts, layer["shared"])


def _per_rank(world, case, results, ci):
    """[(rank, y, reference rows of its group)]."""
    ref = _reference(case)
    tp = world // case["dp"]
    sizes = case["group_sizes"]
    return [(r, results[r][ci]["y"], vw.group_tokens(ref, sizes, r // tp)) for r in range(world)]


def _label(case):
    keys = ("dispatcher", "router", "dp", "chunk_size", "reduce", "fmt", "experts", "probe", "comm_dtype", "numerics")
    return " ".join(f"{k}={case[k]}" for k in keys if k in case)


@pytest.mark.parametrize("name", list(WORLDS))
def test_matches_reference(worlds, name):
    world, cases, results = worlds[name]
    checked = 0
    for ci, case in enumerate(cases):
        if case.get("fault"):
            continue
        for r, y, ref in _per_rank(world, case, results, ci):
            assert y.shape == ref.shape, f"rank {r}: {_label(case)}"
            if case.get("probe"):
                assert torch.equal(y, ref), f"rank {r} not bit-exact: {_label(case)}"
            else:
                rtol = (RTOL_SERVED if case.get("numerics") == "served" else
                        RTOL_BF16 if case.get("comm_dtype") == "bfloat16" else RTOL)
                atol = rtol * float(ref.abs().max()) if ref.numel() else 0.0
                torch.testing.assert_close(y, ref, rtol=rtol, atol=atol, msg=lambda m: f"rank {r} {_label(case)}: {m}")
            checked += 1
    assert checked > 10


@pytest.mark.parametrize("name", list(WORLDS))
def test_every_token_expert_pair_computed_exactly_once(worlds, name):
    world, cases, results = worlds[name]
    for ci, case in enumerate(cases):
        k = vw.ROUTERS[case["router"]][0].top_k
        stats = [results[r][ci]["stats"] for r in range(world)]
        assert sum(s["pairs_computed"] for s in stats) == k * sum(case["group_sizes"]), _label(case)
        assert all(sum(s["expert_tokens"]) == s["pairs_computed"] for s in stats)
        assert sum(s["dispatch_bytes_sent"] for s in stats) == sum(s["dispatch_bytes_recv"] for s in stats)
        assert sum(s["combine_bytes_sent"] for s in stats) == sum(s["combine_bytes_recv"] for s in stats)
        tp = world // case["dp"]
        chunks = max(-(-t // case.get("chunk_size", 4096)) for t in case["group_sizes"])
        assert all(s["chunks"] == chunks for s in stats)
        assert all(s["tokens_in"] == case["group_sizes"][r // tp] for r, s in enumerate(stats))
        if case["dispatcher"].startswith("all2all"):
            # a token row reaches a rank at most once, however many of its experts live there
            assert sum(s["tokens_received"] for s in stats) <= sum(s["pairs_computed"] for s in stats)
            # the split matrices the benchmarks replay hold the same bytes as the counters
            # (the dispatch counters add each chunk's 8-byte counts to every other rank)
            for r, s in enumerate(stats):
                d, c = s["dispatch_split_bytes"], s["combine_split_bytes"]
                assert sum(d) - d[r] + 8 * (world - 1) * chunks == s["dispatch_bytes_sent"], _label(case)
                assert sum(c) - c[r] == s["combine_bytes_sent"] and c[r] >= 0, _label(case)


def test_redundant_replicas_all_serve_tokens(worlds):
    world, cases, results = worlds["ep3"]
    placement = vw.linear_placement(7, 3, cases[0]["extra"])
    for ci, case in enumerate(cases):
        if case["router"] != "softmax-noren" or case["dp"] != 1:
            continue
        for e in (0, 5):
            served = [results[r][ci]["stats"]["expert_tokens"][s] for r, s in placement.replicas[e]]
            assert all(n > 0 for n in served), f"expert {e} replicas served {served}: {_label(case)}"


def test_served_numerics_match_the_engine_emulation_and_the_format_tolerance(worlds):
    world, cases, results = worlds["ep2"]
    served = [(ci, c) for ci, c in enumerate(cases) if c.get("numerics") == "served" and not c.get("fault")]
    assert len(served) == 2 * len(W8A8) * len(DISPATCHERS) + 4
    outs: dict[str, list] = {}
    for ci, case in served:
        fmt = case["fmt"]
        assert all(results[r][ci]["stats"]["act_quant"] == {"fp8-block": "fp8-1x128", "fp8-channel": "fp8-token"}
                   .get(fmt) for r in range(world)), _label(case)
        assert results[0][ci]["stats"]["numerics"]["act_dtype"] == "bfloat16"
        y = results[0][ci]["y"]
        emulated = _engine_emulation(case)
        # the same math in another summation order: equal to within one bf16 rounding
        torch.testing.assert_close(y, emulated, rtol=RTOL_SERVED, atol=RTOL_SERVED * float(emulated.abs().max()))
        # a few bf16 roundings apart at most (experts that leave weighting to the dispatcher
        # weight their rounded outputs in float32: one rounding fewer than the emulation)
        assert float((y - emulated).norm() / emulated.norm()) < 5e-3, _label(case)
        layer, x = _layer(case), _tokens(case)
        exact = reference_moe_forward(x, layer["gate"], layer["bias"], layer["spec"], layer["experts"],
                                      layer["shared"])
        rel = float((y - exact).norm() / exact.norm())
        assert 1e-4 < rel < FORMATS[fmt].verify_tolerances["rel_err"], (rel, _label(case))
        outs.setdefault(fmt, []).append(y)
    for ys in outs.values():  # every dispatcher and chunking gives the same answer
        for y in ys[1:]:
            torch.testing.assert_close(y, ys[0], rtol=RTOL_SERVED, atol=RTOL_SERVED * float(ys[0].abs().max()))


@pytest.mark.parametrize("fault", ["swap", "scale"])
def test_injected_faults_are_caught(worlds, fault):
    world, cases, results = worlds["ep2"]
    faulty = [(ci, c) for ci, c in enumerate(cases) if c.get("fault") == fault]
    assert faulty
    for ci, case in faulty:
        ref = _reference(case)
        y = results[0][ci]["y"]
        rel = float((y - ref).norm() / ref.norm())
        assert rel > 0.05, f"{fault} not caught (rel err {rel:.3g}): {_label(case)}"


def test_mapped_barriers_wait_the_timeout_given(worlds):
    """The all2all dispatcher's timeout_s (what a verify rank passes from --timeout) is the limit
    of the mapped transport's peer-memory barriers; PeerMemory's own default is 300 s."""
    world, cases, results = worlds["ep2"]
    given = [(ci, c) for ci, c in enumerate(cases) if "timeout_s" in c]
    assert given
    for ci, case in given:
        assert [results[r][ci]["peer_timeout_ms"] for r in range(world)] == [42_500] * world
    default = next(ci for ci, c in enumerate(cases) if c["dispatcher"] == "all2all-mapped" and "timeout_s" not in c)
    assert results[0][default]["peer_timeout_ms"] == 300_000


def _gpu_cases(world):
    groups = ((1, [300]), (2, [170, 90])) if world >= 2 else ((1, [300]),)
    # the Triton experts compute the served numerics only (W8A8 for fp8-block): exact is refused
    return [dict(dp=dp, router="v3-grouped", dispatcher=d, group_sizes=sizes, chunk_size=c, fmt=f, experts=e,
                 shared=True, numerics="served" if e == "triton" else "exact")
            for dp, sizes in groups for d in DISPATCHERS for c in (4096, 64)
            for f in ("dense", "fp8-block") for e in ("torch", "triton")] + [
        dict(dp=1, router="softmax", dispatcher=d, group_sizes=[50], chunk_size=8, probe=True) for d in DISPATCHERS] + [
        # the same layer four times on one dispatcher: the mapped transport replays CUDA graphs
        dict(dp=dp, router="v3-grouped", dispatcher="all2all-mapped", group_sizes=sizes, chunk_size=4096,
             fmt="fp8-block", experts="triton", numerics="served", repeat=4) for dp, sizes in groups]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")
def test_nccl_torch_and_triton_experts():
    """NCCL on up to 2 GPUs (one GPU: an ep=1 world still runs every CUDA code path)."""
    pytest.importorskip("moetool.kernels.fused_moe")
    world = min(2, torch.cuda.device_count())
    cases = _gpu_cases(world)
    results = spawn_world(vw.run_cases, world, backend="nccl", args=(cases,), timeout_s=300)
    for ci, case in enumerate(cases):
        for r, y, ref in _per_rank(world, case, results, ci):
            if case.get("probe"):
                assert torch.equal(y, ref), f"rank {r} not bit-exact: {_label(case)}"
                continue
            rel = float((y - ref).norm() / ref.norm())
            # torch experts: float32 (GPU GEMMs and atomics reorder sums), fp8-block against the
            # fp8-emulating reference. Triton: tiles accumulate differently, and for fp8-block the
            # kernels also round gate/up to bf16 and quantize silu(g)*u to fp8 before the down
            # GEMM, which the emulation does not (measured 1.3 % on H100)
            if case["experts"] == "torch":
                limit = 1e-5
            else:
                limit = TOLERANCES["fp8-block"]["rel_err"] if case["fmt"] == "fp8-block" else 1e-2
            assert rel < limit, f"rank {r} rel err {rel:.3g}: {_label(case)}"
        if case.get("repeat"):  # replays give the eager run's bytes
            for r in range(world):
                ys = results[r][ci]["ys"]
                assert all(torch.equal(y, ys[0]) for y in ys[1:]), f"rank {r}: repeats differ: {_label(case)}"
                assert results[r][ci]["graph_replays"] > 0, f"rank {r}: no CUDA graph replayed: {_label(case)}"


def test_mapped_transport_without_shared_memory_room_is_one_error(world_runs):
    for rank, run in enumerate(world_runs["ep2"]):
        msg, created = run["shm_full"]
        assert msg.startswith(f"rank {rank}: --transport mapped: cannot map 1048576 bytes of shared memory"), msg
        assert msg.endswith("(No space left on device); use --transport collectives"), msg
        assert len(created) == 1 and not os.path.exists(created[0]), created  # its file was created, then removed


def test_transport_choice_is_the_same_on_every_rank(world_runs, monkeypatch):
    for out in (run["transports"] for run in world_runs["ep2"]):  # rank 1 alone "on another host": both refuse mapped
        assert out[:3] == ["collectives", "mapped", "collectives"]
        assert out[3].startswith("--transport mapped needs every rank on one host"), out[3]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) != (2, 0))
    assert not transports._all_peers_reachable()
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    assert transports._all_peers_reachable()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_auto_transport_on_gpus_is_one_answer():
    """On the GPUs of one host, auto is mapped when they all reach each other, and every rank agrees."""
    results = spawn_world(vw.transports_cuda, 2, backend="nccl", timeout_s=120)
    want = "mapped" if transports._all_peers_reachable() else "collectives"
    assert results == [want, want]
