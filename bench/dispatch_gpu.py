"""The dispatchers alone on GPUs: dispatch + combine time against raw NCCL all-to-alls.

    python bench/dispatch_gpu.py --ep 4 --dp 2            # on a 4-GPU machine
    python bench/dispatch_gpu.py --ep 2 --dp 1 --backend gloo --tokens 256 --hidden 512   # CPU smoke test

Each rank routes its share of ``--tokens`` per dp group (random top-k of ``--experts``, linear
placement, fp8 activations as for fp8-block shards), then ``Dispatcher.prepare`` and
``finalize`` run with a stand-in expert output (random rows, no GEMMs). Each phase is timed
with CUDA events after a barrier and a synchronize (median of ``--iters`` after warm-up);
the comparator is ``all_to_all_single`` of the same number of bytes per rank (even splits),
timed the same way ("ratio"); "ratio exact" replays the all2all dispatcher's own split matrix
(the same bytes between the same pairs, so the routing's imbalance counts in the comparator
too); "all2all-mapped" is the all2all dispatcher storing into the other ranks' memory
(``--transport mapped``), against the same comparators; "raw tp gather" is the all-gather the all2all combine ends with, alone.
With ``--out`` on GPUs, every rank writes a Chrome trace of one dispatch + combine and rank 0 a
torch.profiler table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _timed(fn, cuda: bool) -> tuple[object, float, float]:
    """(result, CUDA-event ms, wall ms) of fn() after a barrier and a synchronize."""
    import torch.distributed as dist

    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        e.record()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    return out, (s.elapsed_time(e) if cuda else wall), wall


def split_a2a_ms(matrix: list[list[int]], rank: int, timed, iters: int, warmup: int) -> float:
    """Median ms of a raw all_to_all_single moving exactly ``matrix`` ([R][R] bytes, row r = what
    rank r sends to each rank): the same bytes between the same pairs as the dispatcher moved,
    imbalance included. ``timed(fn)`` -> (result, ms, wall ms) as :func:`_timed`."""
    import torch.distributed as dist

    send = [int(b) for b in matrix[rank]]
    recv = [int(row[rank]) for row in matrix]
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    buf = torch.randint(0, 255, (sum(send),), dtype=torch.uint8, device=dev)
    out = torch.empty(sum(recv), dtype=torch.uint8, device=dev)
    times = []
    for it in range(warmup + iters):
        _, t, _ = timed(lambda: dist.all_to_all_single(out, buf, output_split_sizes=recv, input_split_sizes=send))
        if it >= warmup:
            times.append(t)
    return statistics.median(times)


def host_costs(disp, x, ids, w, token_index, table, num_slots, world: int, reps: int = 50) -> dict[str, float]:
    """Host microseconds per call of each step the all2all dispatcher launches (on CUDA the
    calls queue without waiting, so the loop measures the launch path, not the GPU; on CPU,
    under the Triton interpreter, it only checks that the calls still run)."""
    import torch.distributed as dist

    from moetool.kernels import ep_combine, ep_dispatch
    from moetool.verify.experts import ACT_GROUP
    from moetool.verify.wire import token_rows

    m, k = ids.shape
    H = x.shape[1]
    counts = torch.empty(world, dtype=torch.int64, device=x.device)
    recv = torch.empty_like(counts)
    order = ep_dispatch.route_tokens(ids, token_index, table.rank, table.count, counts)
    layout = token_rows(H, k, True, disp.comm_dtype)  # fp8 rows, as the timed dispatch sends
    offs = (layout.offsets[1], *layout.offsets[-4:-1])
    send = torch.empty(m * min(k, world), layout.row_bytes, dtype=torch.uint8, device=x.device)
    rows = torch.randn(m * 2, H, device=x.device).to(torch.bfloat16)
    pos = torch.full((m, world), -1, dtype=torch.int64, device=x.device)
    pos[:, 0] = torch.arange(m, device=x.device)
    steps = {
        "route_tokens": lambda: ep_dispatch.route_tokens(ids, token_index, table.rank, table.count, counts),
        "pack_rows": lambda: ep_dispatch.pack_rows(x, ids, w, token_index, order, counts, send,
                                                   torch.float8_e4m3fn, offs, ACT_GROUP),
        "local_slots": lambda: ep_dispatch.local_slots(ids, token_index, table.rank, table.slot, table.count,
                                                       0, num_slots),
        "combine_rows": lambda: ep_combine.combine_rows(rows, pos),
        "counts all_to_all_single": lambda: dist.all_to_all_single(recv, counts),
        "torch add (one aten op)": lambda: counts.add(1),
    }
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    out = {}
    for name, fn in steps.items():
        for _ in range(min(5, reps)):
            fn()
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out[name] = (time.perf_counter() - t0) / reps * 1e6
        sync()
    return out


def _expert_output(prep, fake_out: dict) -> torch.Tensor:
    """The stand-in expert output, where real experts would have written it: into the
    dispatcher's buffer when it names one (the mapped transport; untimed, as the experts'
    own writes are), else the random rows themselves."""
    rows = fake_out[prep.out_dtype][:prep.hidden.shape[0]]
    if prep.out_buffer is None:
        return rows
    return prep.out_buffer.copy_(rows)


def act_group(opts: dict) -> int | None:
    """The rows' fp8 group (fp8-block's 1x128) or None for bf16 rows."""
    return 128 if opts["act_quant"] else None


def mapped_host_costs(disp, x, ids, w, token_index, info, table, num_slots, act_group: int | None, fake_out,
                      reps: int = 50) -> dict[str, float]:
    """Host microseconds per call of the mapped prepare and finalize once their CUDA graphs
    replay, and of the pieces of a replay (key, one staged copy, the graph launch); each loop
    ends with a synchronize outside the timing, so the GPU never holds the host back."""
    from moetool.verify.chunk import CommStats
    from moetool.verify.wire import token_rows

    stats = CommStats(expert_tokens=[0] * num_slots)
    prep = disp.prepare(x, ids, w, token_index, info, table, num_slots, act_group, stats)
    out = _expert_output(prep, fake_out)
    disp.finalize(out, prep, True, stats)
    torch.cuda.synchronize()
    cache = disp.transport.dispatch_graphs
    args = (x, ids, w, token_index, table, num_slots, act_group,
            token_rows(x.shape[1], ids.shape[1], act_group, disp.comm_dtype),
            disp.transport.buffers)  # as MappedTransport.dispatch passes them
    graph, buffers, _ = next(iter(cache._graphs.values()))
    steps = {
        "prepare": lambda: disp.prepare(x, ids, w, token_index, info, table, num_slots, act_group, stats),
        "finalize": lambda: disp.finalize(out, prep, True, stats),
        "graph key": lambda: cache._key(args),
        "one staged copy": lambda: buffers[0].copy_(ids),
        "graph replay": graph.replay,
    }
    res = {}
    for name, fn in steps.items():
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        res[name] = statistics.median(times)
    stats.pending.clear()
    return res


def worker(rank: int, world: int, opts: dict) -> dict:
    import torch.distributed as dist

    from moetool.model.placement import linear_placement
    from moetool.verify.chunk import ChunkInfo, CommStats
    from moetool.verify.dispatchers import get_dispatcher
    from moetool.verify.topology import RouteTable, Topology, all_gather_tensor

    topo = Topology.create(opts["dp"])
    cuda = topo.device.type == "cuda"
    dev = topo.device
    H, E, k, T = opts["hidden"], opts["experts"], opts["top_k"], opts["tokens"]
    placement = linear_placement(E, world)
    table = RouteTable.build(placement, dev)
    num_slots = len(placement.slots[rank])
    gen = torch.Generator(device="cpu").manual_seed(1000 + topo.group_index)  # same tokens in a tp group
    x_group = torch.randn(T, H, generator=gen).to(dev)
    logits = torch.randn(T, E, generator=gen).to(dev)
    w_group, ids_group = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    info = ChunkInfo(sizes=[T] * topo.dp, starts=[g * T for g in range(topo.dp)])
    # stand-in expert output, in the dtype the experts would write (bf16 for the all2all combine)
    fake_out = {dt: torch.randn(T * topo.tp * world, H, device=dev).to(dt) for dt in (torch.float32, torch.bfloat16)}
    res = {}
    for name in opts["dispatchers"]:
        base, _, transport = name.partition("-")  # all2all-mapped: the mapped transport
        disp = get_dispatcher(base, topo, comm_dtype=torch.bfloat16, **({"transport": transport} if transport else {}))
        rows = disp.token_slice(T)
        x = x_group[rows]
        ids, w = ids_group[rows].contiguous(), w_group[rows].contiguous()
        token_index = info.starts[topo.group_index] + rows.start + torch.arange(x.shape[0], device=dev)
        d_ms, c_ms, d_wall, c_wall = [], [], [], []
        stats = CommStats(expert_tokens=[0] * num_slots)
        for it in range(opts["warmup"] + opts["iters"]):
            stats = CommStats(expert_tokens=[0] * num_slots)
            prep, d, dw = _timed(lambda: disp.prepare(x, ids, w, token_index, info, table, num_slots,
                                                      act_group(opts), stats), cuda)
            out = _expert_output(prep, fake_out)
            _, c, cw = _timed(lambda: disp.finalize(out, prep, True, stats), cuda)
            if it >= opts["warmup"]:
                d_ms.append(d), c_ms.append(c), d_wall.append(dw), c_wall.append(cw)
        stats.settle()  # the mapped transport counts after the timed calls
        if cuda and opts.get("profile_dir"):  # every rank records its own trace (rank skew shows)
            from torch.profiler import ProfilerActivity, profile

            dist.barrier()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                prep = disp.prepare(x, ids, w, token_index, info, table, num_slots, act_group(opts),
                                    CommStats(expert_tokens=[0] * num_slots))
                disp.finalize(_expert_output(prep, fake_out), prep, True, CommStats(expert_tokens=[0] * num_slots))
                torch.cuda.synchronize()
            if rank == 0:
                table_txt = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
                Path(opts["profile_dir"], f"profile_{name}.txt").write_text(table_txt)
            prof.export_chrome_trace(str(Path(opts["profile_dir"], f"trace_{name}_rank{rank}.json")))
        exact = {}
        if stats.dispatch_split_bytes:  # every rank's [R] splits -> the [R][R] matrix, then replayed raw
            for key in ("dispatch_split_bytes", "combine_split_bytes"):
                mine = torch.tensor(getattr(stats, key), dtype=torch.int64, device=dev)
                rows = torch.empty(world * world, dtype=torch.int64, device=dev)
                all_gather_tensor(rows, mine)
                exact[key] = split_a2a_ms(rows.view(world, world).tolist(), rank, lambda fn: _timed(fn, cuda),
                                          opts["iters"], opts["warmup"])
        sent = torch.tensor([stats.dispatch_bytes_sent, stats.combine_bytes_sent], dtype=torch.float64, device=dev)
        dist.all_reduce(sent)
        mean_bytes = [int(v) // world for v in sent.tolist()]
        raw_ms = []
        for nbytes in mean_bytes:
            n = max(world, (nbytes // world) * world)
            buf = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
            o = torch.empty_like(buf)
            times = []
            for it in range(opts["warmup"] + opts["iters"]):
                _, t, _ = _timed(lambda: dist.all_to_all_single(o, buf), cuda)
                if it >= opts["warmup"]:
                    times.append(t)
            raw_ms.append(statistics.median(times))
        gather_ms = 0.0
        if topo.tp > 1:  # the all2all combine ends with an all-gather of [ceil(T/tp), H] bf16 in the tp group
            part = torch.randn((T + topo.tp - 1) // topo.tp, H, device=dev).to(torch.bfloat16)
            full = part.new_empty(topo.tp * part.shape[0], H)
            times = []
            for it in range(opts["warmup"] + opts["iters"]):
                _, t, _ = _timed(lambda: all_gather_tensor(full, part, group=topo.tp_group), cuda)
                if it >= opts["warmup"]:
                    times.append(t)
            gather_ms = statistics.median(times)
            rep = part.repeat(topo.tp, 1)  # the same exchange as an all-to-all (each rank's part to every rank)
            times = []
            for it in range(opts["warmup"] + opts["iters"]):
                _, t, _ = _timed(lambda: dist.all_to_all_single(full, rep, group=topo.tp_group), cuda)
                if it >= opts["warmup"]:
                    times.append(t)
            res.setdefault("raw_tp_exchange_as_a2a_ms", statistics.median(times))
        if name == "all2all-mapped" and cuda:
            res["mapped_host_us"] = mapped_host_costs(disp, x, ids, w, token_index, info, table, num_slots,
                                                      act_group(opts), fake_out)
        if name == "all2all" and (cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            res["host_us"] = host_costs(disp, x, ids, w, token_index, table, num_slots, world, 50 if cuda else 1)
        res[name] = {"raw_exact_dispatch_ms": exact.get("dispatch_split_bytes", float("nan")),
                     "raw_exact_combine_ms": exact.get("combine_split_bytes", float("nan")),
                     "raw_tp_gather_ms": gather_ms, "dispatch_ms": statistics.median(d_ms), "combine_ms": statistics.median(c_ms),
                     "dispatch_wall_ms": statistics.median(d_wall), "combine_wall_ms": statistics.median(c_wall),
                     "dispatch_bytes": mean_bytes[0], "combine_bytes": mean_bytes[1],
                     "raw_dispatch_ms": raw_ms[0], "raw_combine_ms": raw_ms[1],
                     "tokens_received": stats.tokens_received}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192, help="per dp group")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--no-act-quant", action="store_true", help="send bf16 rows instead of fp8 + scales")
    ap.add_argument("--dispatchers", default="all2all,all2all-mapped,allgather",
                    help="all2all-mapped: the all2all dispatcher with the mapped transport")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--out", type=Path, help="folder for results.json and rank 0's profiler tables")
    args = ap.parse_args()

    from moetool.verify.launch import spawn_world

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    opts = {"dp": args.dp, "tokens": args.tokens, "hidden": args.hidden, "experts": args.experts,
            "top_k": args.top_k, "act_quant": not args.no_act_quant, "dispatchers": args.dispatchers.split(","),
            "warmup": args.warmup, "iters": args.iters, "profile_dir": str(args.out) if args.out else None}
    per_rank = spawn_world(worker, args.ep, args.backend, args=(opts,), timeout_s=240)
    print(f"--ep {args.ep} --dp {args.dp}, {args.tokens} tokens per dp group, hidden {args.hidden}, "
          f"top-{args.top_k} of {args.experts}, {'fp8' if opts['act_quant'] else 'bf16'} rows, {args.backend}; "
          f"max over ranks of each rank's median (ms)")
    print(f"{'dispatcher':<19} {'dispatch':>9} {'combine':>8} {'wall d/c':>12} {'MB/rank d':>9} {'MB/rank c':>9} "
          f"{'raw a2a d':>9} {'raw a2a c':>9} {'ratio':>6} {'raw tp gather':>13}")
    rows = {}
    for name in opts["dispatchers"]:
        r = {key: max(pr[name][key] for pr in per_rank) for key in per_rank[0][name]}
        ratio = (r["dispatch_ms"] + r["combine_ms"]) / (r["raw_dispatch_ms"] + r["raw_combine_ms"])
        r["ratio"] = ratio
        r["ratio_exact"] = (r["dispatch_ms"] + r["combine_ms"]) / (r["raw_exact_dispatch_ms"] + r["raw_exact_combine_ms"])
        rows[name] = r
        print(f"{name:<19} {r['dispatch_ms']:>9.3f} {r['combine_ms']:>8.3f} "
              f"{r['dispatch_wall_ms']:>5.2f}/{r['combine_wall_ms']:<6.2f} {r['dispatch_bytes'] / 1e6:>9.1f} "
              f"{r['combine_bytes'] / 1e6:>9.1f} {r['raw_dispatch_ms']:>9.3f} {r['raw_combine_ms']:>9.3f} {ratio:>6.2f} "
              f"{r['raw_tp_gather_ms']:>13.3f}")
    for name, r in rows.items():
        if r["ratio_exact"] == r["ratio_exact"]:
            print(f"{name}: raw all_to_all_single with the dispatcher's own splits (imbalance kept): dispatch "
                  f"{r['raw_exact_dispatch_ms']:.3f} ms, combine {r['raw_exact_combine_ms']:.3f} ms, "
                  f"ratio {r['ratio_exact']:.2f}")
    if "raw_tp_exchange_as_a2a_ms" in per_rank[0]:
        print(f"the tp all-gather's bytes as an all_to_all_single in the tp group: "
              f"{max(pr['raw_tp_exchange_as_a2a_ms'] for pr in per_rank):.3f} ms")
    if "host_us" in per_rank[0]:
        print("host time per call, microseconds (max over ranks): " + ", ".join(
            f"{key} {max(pr['host_us'][key] for pr in per_rank):.0f}" for key in per_rank[0]["host_us"]))
    if "mapped_host_us" in per_rank[0]:
        print("all2all-mapped, host time per call once the graphs replay, microseconds (max over ranks): " + ", ".join(
            f"{key} {max(pr['mapped_host_us'][key] for pr in per_rank):.0f}" for key in per_rank[0]["mapped_host_us"]))
    if args.out:
        (args.out / "dispatch_gpu.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                                 "max_over_ranks": rows, "per_rank": per_rank},
                                                                indent=2, default=str))


if __name__ == "__main__":
    main()
