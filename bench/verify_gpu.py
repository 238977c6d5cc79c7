"""`moetool verify` on GPUs with realistic shapes, and the all2all backend against raw NCCL.

    python bench/verify_gpu.py --ep 4 --dp 2            # on a 4-GPU machine
    python bench/verify_gpu.py --ep 2 --dp 1 --experts 32

1. writes a synthetic DeepSeek-V3-style bf16 checkpoint (default 64 experts, hidden 7168,
   expert intermediate 2048, top-8, one dense + one MoE layer) and times `cp` of it;
2. `moetool quantize --fp8-block --device cuda` (GB/s against the cp floor), `shard --ep`;
3. `verify` for every dispatch x experts backend (NCCL, one GPU per rank, warm-up runs first),
   printing each layer's error and the CUDA-event time of each phase;
4. in a separate NCCL world: raw `all_to_all_single` and `all_gather_into_tensor` of
   4096 tokens x hidden bf16 per rank, and raw all_to_all of exactly the bytes each backend's
   dispatch and combine moved, median of 20 after warm-up: the ratio (dispatch + combine) /
   (two raw all-to-alls of those bytes) is the backend's efficiency. "ratio" spreads the mean
   bytes evenly over the ranks; "ratio exact" (all2all) replays the layer's own split matrix,
   the same bytes between the same pairs, so the routing's load imbalance is in both sides.
Results as a table; --json FILE also writes them.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def raw_collectives(rank: int, world: int, hidden: int, tokens: int, byte_sizes: list[int],
                    matrices: dict[str, list[list[int]]]) -> dict:
    import torch.distributed as dist

    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def bench(fn, n=20, warm=5) -> float:
        """Median microseconds (CUDA events on GPUs)."""
        for _ in range(warm):
            fn()
        if cuda:
            torch.cuda.synchronize()
        times = []
        for _ in range(n):
            dist.barrier()
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
    out = torch.empty_like(x)
    gathered = torch.empty(world * tokens, hidden, device=dev, dtype=torch.bfloat16)
    res = {"a2a_us": bench(lambda: dist.all_to_all_single(out, x)),
           "allgather_us": bench(lambda: dist.all_gather_into_tensor(gathered, x)),
           "bytes_per_rank": x.numel() * 2}
    per_size = {}
    for nbytes in byte_sizes:
        n = max(world, (nbytes // world) * world)
        buf = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
        o = torch.empty_like(buf)
        per_size[str(nbytes)] = bench(lambda: dist.all_to_all_single(o, buf))
    res["a2a_bytes_us"] = per_size
    from dispatch_gpu import _timed, split_a2a_ms  # bench/ is on sys.path (this script's folder)

    res["a2a_exact_us"] = {key: split_a2a_ms(m, rank, lambda fn: _timed(fn, cuda), 20, 5) * 1e3
                           for key, m in matrices.items()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moetool-verify-gpu"))
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192, help="per dp group (4096 per rank with dp 2, ep 4)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per layer (each phase: their median)")
    ap.add_argument("--backends", default="allgather:triton,all2all:triton,all2all-mapped:triton,all2all-mapped:torch",
                    help="dispatch:experts pairs; all2all = the collectives transport, all2all-mapped = mapped")
    ap.add_argument("--backend", default="nccl", help="nccl (GPUs) or gloo (a CPU smoke test of this script)")
    ap.add_argument("--skip-cpu", action="store_true", help="skip the CPU quantize comparison")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from moetool.convert.quantize import quantize
    from moetool.convert.shard import shard
    from moetool.demo.tiny import make_tiny_checkpoint
    from moetool.verify.launch import spawn_world
    from moetool.verify.driver import VerifyOptions, verify_many

    gpu = args.backend == "nccl"
    started = time.perf_counter()

    def stage(what: str) -> None:
        """Progress on stderr, so a run cut off by a timeout still says how far it got."""
        print(f"[{time.perf_counter() - started:7.1f} s] {what}", file=sys.stderr, flush=True)

    out: dict = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "gpus": torch.cuda.device_count(), "args": {
        k: str(v) for k, v in vars(args).items()}}
    w = args.workdir
    shutil.rmtree(w, ignore_errors=True)
    src, q8, shards = w / "model", w / "fp8", w / f"fp8-ep{args.ep}"
    stage("writing the bf16 checkpoint")
    t0 = time.perf_counter()
    make_tiny_checkpoint(src, "deepseek_v3", hidden=args.hidden, intermediate=args.intermediate,
                         experts=args.experts, top_k=args.top_k, layers=2, shards=4)
    out["write_s"] = time.perf_counter() - t0
    in_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    subprocess.run(["sync"])
    stage("cp")
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(w / "cp")], check=True)
    out["cp_s"] = time.perf_counter() - t0
    shutil.rmtree(w / "cp")
    devices = (["cuda"] if args.skip_cpu else ["cuda", "cpu"]) if gpu else ["cpu"]
    for dev in devices:
        dst = q8 if dev == devices[0] else w / "fp8-cpu"
        stage(f"quantize --fp8-block on {dev}")
        t0 = time.perf_counter()
        summary = quantize(src, dst, "fp8-block", device=dev, progress=False)
        out[f"quantize_{dev}_s"] = time.perf_counter() - t0
        out[f"quantize_{dev}_summary"] = summary.render()
    same = None
    if len(devices) == 2:
        same = all(subprocess.run(["cmp", "-s", str(f), str(w / "fp8-cpu" / f.name)]).returncode == 0
                   for f in q8.glob("*.safetensors"))
        shutil.rmtree(w / "fp8-cpu")
    out["quantize_cuda_equals_cpu"] = same
    out["input_gb"] = in_bytes / 1e9
    stage(f"shard --ep {args.ep}")
    t0 = time.perf_counter()
    shard(q8, shards, args.ep, progress=False)
    out["shard_s"] = time.perf_counter() - t0

    jobs = []
    for spec in args.backends.split(","):
        dispatch, experts = spec.split(":")
        dispatch, _, transport = dispatch.partition("-")
        jobs.append((shards, src, VerifyOptions(dp=args.dp, ep=args.ep, dispatch=dispatch, experts=experts,
                                                tokens=args.tokens, chunk_size=args.tokens, warmup=args.warmup,
                                                repeat=args.repeat, backend=args.backend,
                                                transport=transport or "collectives")))
    stage(f"verify: {args.backends}")
    t0 = time.perf_counter()
    reports = verify_many(jobs)
    out["verify_s"] = time.perf_counter() - t0
    out["verify"] = [r.to_json() for r in reports]

    sizes = sorted({int(l.bytes_moved[k]) // args.ep for r in reports for l in r.layers
                    for k in ("dispatch_bytes_sent", "combine_bytes_sent")})
    matrices = {f"{ri}/{l.layer}/{key}": l.bytes_moved[key] for ri, r in enumerate(reports) for l in r.layers
                for key in ("dispatch_split_bytes", "combine_split_bytes") if key in l.bytes_moved}
    stage("raw collectives")
    raw = spawn_world(raw_collectives, args.ep, args.backend, args=(args.hidden, 4096, sizes, matrices),
                      timeout_s=600)[0]
    out["raw"] = raw

    first = devices[0]
    print(f"{out['device']} x{args.ep}: input {in_bytes / 1e9:.2f} GB bf16; cp {out['cp_s']:.1f} s "
          f"({in_bytes / out['cp_s'] / 1e9:.2f} GB/s); quantize fp8-block {first} {out[f'quantize_{first}_s']:.1f} s "
          f"({in_bytes / out[f'quantize_{first}_s'] / 1e9:.2f} GB/s), cpu {out.get('quantize_cpu_s', float('nan')):.1f} s, "
          f"cuda output bit-identical to cpu: {same}; shard {out['shard_s']:.1f} s")
    print(f"raw {args.backend}, 4096 x {args.hidden} bf16 per rank: all_to_all_single {raw['a2a_us']:.0f} us, "
          f"all_gather_into_tensor {raw['allgather_us']:.0f} us")
    print(f"{'dispatch':<14} {'experts':<7} {'layer':>5} {'rel err':>8} {'total ms':>9} {'disp ms':>8} "
          f"{'exp ms':>7} {'comb ms':>8} {'disp MB/rk':>10} {'comb MB/rk':>10} {'raw a2a ms':>10} {'ratio':>6} "
          f"{'raw exact ms':>12} {'ratio exact':>11}")
    for ri, r in enumerate(reports):
        for l in r.layers:
            d_b = l.bytes_moved["dispatch_bytes_sent"] // args.ep
            c_b = l.bytes_moved["combine_bytes_sent"] // args.ep
            raw_ms = (raw["a2a_bytes_us"][str(d_b)] + raw["a2a_bytes_us"][str(c_b)]) / 1e3
            t = l.timings_ms
            ratio = (t["dispatch"] + t["combine"]) / raw_ms if raw_ms else float("nan")
            exact = raw["a2a_exact_us"]
            keys = [f"{ri}/{l.layer}/{k}" for k in ("dispatch_split_bytes", "combine_split_bytes")]
            exact_ms = sum(exact[k] for k in keys) / 1e3 if all(k in exact for k in keys) else float("nan")
            ratio_exact = (t["dispatch"] + t["combine"]) / exact_ms if exact_ms else float("nan")
            name = r.options["dispatch"] + ("-mapped" if r.options.get("transport") == "mapped" else "")
            print(f"{name:<14} {r.options['experts']:<7} {l.layer:>5} {l.rel_err:>8.4f} "
                  f"{t['total']:>9.2f} {t['dispatch']:>8.2f} {t['experts']:>7.2f} {t['combine']:>8.2f} "
                  f"{d_b / 1e6:>10.1f} {c_b / 1e6:>10.1f} {raw_ms:>10.2f} {ratio:>6.2f} {exact_ms:>12.2f} "
                  f"{ratio_exact:>11.2f}  {'PASS' if l.passed else 'FAIL'}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    sys.exit(0 if all(r.passed for r in reports) else 1)


if __name__ == "__main__":
    main()
