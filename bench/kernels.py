"""Benchmark of moetool.kernels on one CUDA GPU (not a test: pytest never collects it).

    python bench/kernels.py                 # table
    python bench/kernels.py --json out.json # also write the rows as JSON ("-" = stdout only)
    python bench/kernels.py --quick         # fewer shapes / reps

What is timed (CUDA events after warm-up, median of --reps runs, random data):
* fused_experts (Triton) for each format vs fused_experts_ref (torch, weights dequantized every
  call) and vs a plain bf16 torch per-expert loop (weights already bf16: the usual eager path).
  The W8A8 formats get e4m3 hidden with its scales, as the dispatcher sends it: fp8-block per
  1x128 group, fp8-channel per token (the scheme's ``act_group``);
* fp8_block_quant, fp8_act_quant (1x128 and per token) and int4_group_quant_pack vs their torch
  references.

Shapes: one EP rank of a layer with E_global experts split over ``ep`` ranks (linear placement,
rank 0 holds experts [0, E_local)); every token picks k distinct experts uniformly, ids of
other ranks' experts are -1 (the allgather view: T tokens, about T*k*E_local/E_global pairs to
compute). Letters: T tokens, H hidden, N intermediate, E experts, k top-k, P computed pairs.

Roofline floor per row: max(FLOPs / peak FLOP/s, bytes / peak bandwidth), with
FLOPs = 6 * P * N * H (three GEMMs' worth: [2N, H] and [H, N]) and bytes = the weights of the
experts that got a token (in the stored format, scales included) + hidden in + fp32 out;
the W8A8 formats count at the fp8 FLOP rate. Peaks are datasheet numbers (dense, no
sparsity): H100 SXM 989 TFLOP/s bf16, 1979 fp8, 3.35 TB/s; H200 the same FLOP/s and 4.8 TB/s. ``floor%`` = floor / measured time.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys

import torch

PEAKS = {  # name substring -> (bf16 FLOP/s, fp8 FLOP/s, bytes/s)
    "H200": (989e12, 1979e12, 4.8e12),
    "H100": (989e12, 1979e12, 3.35e12),
}

LAYERS = {  # name -> (H, N, E_global, ep, k)
    "dsv3-ep8": (7168, 2048, 256, 8, 8),  # DeepSeek-V3 expert shapes, 32 local experts
    "h4096-ep4": (4096, 2048, 256, 4, 8),  # 64 local experts
}
TOKENS = (512, 4096)
FORMATS = ("dense", "fp8-block", "fp8-channel", "int4-group")


def peaks():
    name = torch.cuda.get_device_name()
    for key, value in PEAKS.items():
        if key in name:
            return name, value
    return name, None


def time_cuda(fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of fn() over reps runs, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def routing(T, E_global, E_local, k, device):
    """Uniform distinct top-k over E_global; non-local experts -> -1. ids [T, k], weights [T, k]."""
    scores = torch.rand(T, E_global, device=device)
    ids = scores.topk(k, dim=1).indices
    ids = torch.where(ids < E_local, ids, -1).contiguous()
    w = torch.rand(T, k, device=device)
    return ids, (w / w.sum(1, keepdim=True)).float().contiguous()


def make_experts(fmt, E, H, N, device, group=128):
    """Random bf16 experts -> (w13, w2 in fmt, w13 bf16, w2 bf16, weight bytes per expert)."""
    from moetool.kernels.int4_quant import int4_group_quant_pack
    from moetool.kernels.quant import fp8_block_quant

    w13 = torch.randn(E, 2 * N, H, device=device, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, N, device=device, dtype=torch.bfloat16) * 0.02
    if fmt == "dense":
        t13, t2 = {"weight": w13}, {"weight": w2}
    elif fmt == "fp8-block":
        def blocks(w, split=None):
            parts = [w[:split], w[split:]] if split else [w]
            qs = [fp8_block_quant(p.contiguous()) for p in parts]
            return torch.cat([q for q, _ in qs]), torch.cat([s for _, s in qs])
        p13 = [blocks(w13[e], N) for e in range(E)]
        p2 = [blocks(w2[e]) for e in range(E)]
        t13 = {"weight": torch.stack([q for q, _ in p13]), "weight_scale_inv": torch.stack([s for _, s in p13])}
        t2 = {"weight": torch.stack([q for q, _ in p2]), "weight_scale_inv": torch.stack([s for _, s in p2])}
    elif fmt == "fp8-channel":
        def chan(w):
            s = (w.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448).to(torch.bfloat16)
            return (w.float() / s.float()).clamp(-448, 448).to(torch.float8_e4m3fn), s
        (q13, s13), (q2, s2) = chan(w13), chan(w2)
        t13, t2 = {"weight": q13, "weight_scale": s13}, {"weight": q2, "weight_scale": s2}
    else:
        p13 = [int4_group_quant_pack(w13[e], group, True, torch.bfloat16) for e in range(E)]
        p2 = [int4_group_quant_pack(w2[e], group, True, torch.bfloat16) for e in range(E)]
        t13 = {key: torch.stack([p[key] for p in p13]) for key in p13[0]}
        t2 = {key: torch.stack([p[key] for p in p2]) for key in p2[0]}
    nbytes = sum(v[0].numel() * v.element_size() for v in (*t13.values(), *t2.values()))
    return t13, t2, w13, w2, nbytes


def torch_loop_bf16(x, w13, w2, ids, weights):
    """Eager per-expert loop on bf16 weights (one host sync for the per-expert counts)."""
    T, k = ids.shape
    N = w13.shape[1] // 2
    flat = ids.view(-1)
    order = torch.argsort(flat)
    counts = torch.bincount(flat + 1, minlength=w13.shape[0] + 1).tolist()  # [-1 count, e0, e1, ...]
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    start = counts[0]
    for e, c in enumerate(counts[1:]):
        if c:
            pairs = order[start:start + c]
            tok = pairs // k
            gu = x[tok] @ w13[e].t()
            y = (torch.nn.functional.silu(gu[:, :N]) * gu[:, N:]) @ w2[e].t()
            out.index_add_(0, tok, y.float() * weights.view(-1)[pairs, None])
        start += c
    return out


def bench_moe(args, peak, rows):
    from moetool.formats import get_format
    from moetool.kernels.fused_moe import fused_experts, fused_experts_ref
    from moetool.kernels.moe_weights import SCHEMES
    from moetool.kernels.quant import fp8_act_quant

    dev = "cuda"
    for layer in args.layers:
        H, N, E_global, ep, k = LAYERS[layer]
        E = E_global // ep
        for fmt in args.formats:
            t13, t2, w13, w2, wbytes = make_experts(fmt, E, H, N, dev)
            for T in args.tokens:
                torch.manual_seed(T)
                ids, tw = routing(T, E_global, E, k, dev)
                x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
                kwargs = {"check_ids": False}
                hidden = x
                w8a8 = SCHEMES[fmt].fp8_acts
                if w8a8:  # the dispatcher sends fp8 tokens with their scales
                    hidden, kwargs["hidden_scale"] = fp8_act_quant(x, SCHEMES[fmt].act_group)
                P = int((ids >= 0).sum())
                active = int(torch.unique(ids[ids >= 0]).numel())
                flops = 6.0 * P * N * H
                nbytes = active * wbytes + hidden.numel() * hidden.element_size() + T * H * 4
                fn = functools.partial(fused_experts, hidden, t13, t2, fmt, ids, tw, **kwargs)
                t_tri = time_cuda(fn, args.reps)
                out = fn()
                row = {"kind": "moe", "layer": layer, "format": fmt, "T": T, "E_local": E, "H": H, "N": N,
                       "k": k, "pairs": P, "active_experts": active, "triton_us": t_tri * 1e6}
                if not args.no_ref:
                    ref_kwargs = {key: v for key, v in kwargs.items() if key != "check_ids"}
                    weights = get_format(fmt)  # the reference reads the weights as the format does (int4: g128)
                    ref_fn = functools.partial(fused_experts_ref, hidden, t13, t2, fmt, ids, tw,
                                               dequantize=weights.dequantize, split_rows=weights.split_rows,
                                               **ref_kwargs)
                    row["ref_us"] = time_cuda(ref_fn, max(1, args.reps // 5), warmup=1) * 1e6
                    ref = ref_fn()
                    row["rel_err_vs_ref"] = ((out - ref).norm() / ref.norm()).item()
                loop = functools.partial(torch_loop_bf16, x, w13, w2, ids, tw)
                row["torch_bf16_loop_us"] = time_cuda(loop, args.reps) * 1e6
                row["tflops"] = flops / t_tri / 1e12
                row["gbps"] = nbytes / t_tri / 1e9
                if peak:
                    peak_flops = peak[1] if w8a8 else peak[0]
                    floor = max(flops / peak_flops, nbytes / peak[2])
                    row["floor_us"] = floor * 1e6
                    row["floor_pct"] = 100.0 * floor / t_tri
                rows.append(row)
                print_row(row)
            t13 = t2 = w13 = w2 = None
            torch.cuda.empty_cache()


SWEEP = [  # MoeConfig(block_m, block_n, block_k, group_m, num_warps, num_stages) candidates
    (16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3), (32, 64, 128, 1, 4, 4), (32, 128, 64, 8, 4, 4),
    (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 3), (64, 128, 128, 8, 8, 3), (128, 128, 64, 16, 8, 3),
]


def sweep_moe(args, rows):
    """Time fused_experts under each SWEEP tile config (for choosing default_config)."""
    from moetool.kernels.fused_moe import fused_experts
    from moetool.kernels.moe_tiles import MoeConfig
    from moetool.kernels.moe_weights import SCHEMES
    from moetool.kernels.quant import fp8_act_quant

    for layer in args.layers:
        H, N, E_global, ep, k = LAYERS[layer]
        E = E_global // ep
        for fmt in args.formats:
            t13, t2, *_ = make_experts(fmt, E, H, N, "cuda")
            for T in args.tokens:
                torch.manual_seed(T)
                ids, tw = routing(T, E_global, E, k, "cuda")
                hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                kwargs = {"check_ids": False}
                if SCHEMES[fmt].fp8_acts:
                    hidden, kwargs["hidden_scale"] = fp8_act_quant(hidden, SCHEMES[fmt].act_group)
                times = {}
                for c in [None, *SWEEP]:
                    cfg = MoeConfig(*c) if c else None
                    if cfg and fmt == "fp8-block" and 128 % cfg.block_k:
                        continue
                    try:
                        fn = functools.partial(fused_experts, hidden, t13, t2, fmt, ids, tw, config=cfg, **kwargs)
                        times[str(c or "default")] = time_cuda(fn, args.reps) * 1e6
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                        times[str(c)] = float("nan")
                        print(f"  {c}: {type(e).__name__}: {str(e)[:80]}")
                best = min((v, key) for key, v in times.items() if not math.isnan(v))
                rows.append({"kind": "sweep", "layer": layer, "format": fmt, "T": T, "us": times})
                print(f"{layer:10} {fmt:11} T={T:5d} best {best[1]} {best[0]:.1f} us | "
                      + " ".join(f"{key}:{v:.0f}" for key, v in times.items()))
            t13 = t2 = None
            torch.cuda.empty_cache()


def _tune():
    """bench/tune.py (layers, weights, routing, CUDA-graph timing with L2 flushed)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tune

    return tune


def decode_breakdown(args, rows):
    """Where a decode call's time goes: each step of fused_experts alone (CUDA graph, L2
    flushed) for DeepSeek-V3 EP8 at T <= 16, unsplit and split."""
    from moetool.kernels import fused_moe as fm
    from moetool.kernels.moe_gemm import moe_gemm
    from moetool.kernels.moe_silu import silu_and_mul
    from moetool.kernels.moe_sum import moe_sum
    from moetool.kernels.moe_tiles import MoeConfig
    from moetool.kernels.moe_weights import SCHEMES, parse_weights

    tune = _tune()
    layer = tune.LAYERS["dsv3-ep8"]
    E, N, H, k = layer.E, layer.N, layer.H, layer.k
    for scheme in ("dense", "fp8-block"):
        w13, w2 = tune.make_weights(scheme, E, H, N, "cuda")
        p13 = parse_weights(scheme, w13, "w13", E, 2 * N, H, 128, N)
        p2 = parse_weights(scheme, w2, "w2", E, H, N, 128, None)
        for T in [t for t in args.tokens if t <= 16]:
            hidden, ids, tw = tune._problem(scheme, layer, T, E, "cuda")
            P = T * k
            active = int(torch.unique(ids[ids >= 0]).numel())
            for cfg in (MoeConfig(16, 32, 128, 1, 4, 4), MoeConfig(16, 64, 128, 1, 4, 4),
                        MoeConfig(16, 64, 128, 1, 4, 4, 4, 2), MoeConfig(16, 128, 128, 1, 4, 4, 4, 2),
                        MoeConfig(16, 128, 128, 1, 4, 4, 8, 4)):
                sorted_ids, expert_ids, npp = fm.moe_align_block_size(ids, 16, E)
                a1, a1s = hidden, None
                if SCHEMES[scheme].fp8_acts:
                    a1, a1s = fm.fp8_act_quant(hidden, 128)
                c1 = torch.empty((cfg.split_w13, P, 2 * N) if cfg.split_w13 > 1 else (P, 2 * N),
                                 dtype=torch.float32 if cfg.split_w13 > 1 else torch.bfloat16, device="cuda")
                c3 = torch.empty((cfg.split_w2, P, H) if cfg.split_w2 > 1 else (P, H),
                                 dtype=torch.float32 if cfg.split_w2 > 1 else torch.bfloat16, device="cuda")
                quant = {"quant_fp8": True, "group": 128} if SCHEMES[scheme].fp8_acts else {}
                row_ids = ids.view(-1)

                def g1():
                    moe_gemm(a1, a1s, p13, c1, tw, sorted_ids, expert_ids, npp, P, k, N, False, 128, cfg)

                def silu():
                    return silu_and_mul(c1, row_ids, act_dtype=torch.bfloat16, **quant)

                a2 = silu()
                a2, a2s = a2 if quant else (a2, None)

                def g2():
                    moe_gemm(a2, a2s, p2, c3, tw, sorted_ids, expert_ids, npp, P, 1, H, True, 128, cfg)

                def total():
                    return tune.run_ours(hidden, w13, w2, scheme, ids, tw, cfg, out)

                out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
                parts = {"gemm1": g1, "silu": silu, "gemm2": g2,
                         "sum": lambda: moe_sum(c3, ids, torch.bfloat16, pair_dtype=torch.bfloat16)}
                with tune.fixed_align():
                    us = {name: tune.time_graph(fn, args.reps)["us"] for name, fn in parts.items()}
                    us["total"] = tune.time_graph(total, args.reps)["us"]
                wb = tune.weight_bytes_per_expert(w13, w2)
                b1 = active * sum(v[0].numel() * v.element_size() for v in w13.values())
                row = {"kind": "breakdown", "scheme": scheme, "T": T, "active": active,
                       "config": dataclasses.astuple(cfg), "us": us,
                       "gemm1_tbps": b1 / us["gemm1"] / 1e6, "gemm2_tbps": (active * wb - b1) / us["gemm2"] / 1e6,
                       "total_tbps": active * wb / us["total"] / 1e6}
                rows.append(row)
                print(f"{scheme:9} T={T:3d} act {active:2d} {dataclasses.astuple(cfg)}: "
                      + " ".join(f"{n} {v:7.1f}" for n, v in us.items())
                      + f" | TB/s gemm1 {row['gemm1_tbps']:.2f} gemm2 {row['gemm2_tbps']:.2f} "
                        f"total {row['total_tbps']:.2f}", flush=True)
        w13 = w2 = None
        torch.cuda.empty_cache()


def bench_quant(args, peak, rows):
    from moetool.kernels.quant import (
        fp8_act_quant,
        fp8_act_quant_ref,
        fp8_block_quant,
        fp8_block_quant_ref,
    )
    from moetool.kernels.common import TOKEN_GROUP
    from moetool.kernels.int4_quant import int4_group_quant_pack, int4_group_quant_pack_ref

    dev = "cuda"
    w = torch.randn(7168, 4096, device=dev, dtype=torch.bfloat16)
    x = torch.randn(4096, 7168, device=dev, dtype=torch.bfloat16)
    cases = [  # (name, input, kernel, reference, bytes moved per element)
        ("fp8_block_quant", w, fp8_block_quant, fp8_block_quant_ref, 2 + 1),
        ("fp8_act_quant", x, fp8_act_quant, fp8_act_quant_ref, 2 + 1),
        ("fp8_act_quant_token", x, lambda t: fp8_act_quant(t, TOKEN_GROUP),
         lambda t: fp8_act_quant_ref(t, TOKEN_GROUP), 2 + 1),
        ("int4_quant_pack_sym", w, lambda t: int4_group_quant_pack(t, 128, True),
         lambda t: int4_group_quant_pack_ref(t, 128, True), 2 + 0.5),
        ("int4_quant_pack_asym", w, lambda t: int4_group_quant_pack(t, 128, False),
         lambda t: int4_group_quant_pack_ref(t, 128, False), 2 + 0.5),
    ]
    for name, t, fn, ref_fn, bytes_per_elt in cases:
        nbytes = t.numel() * bytes_per_elt  # read bf16, write the quantized values (scales ignored)
        t_k = time_cuda(functools.partial(fn, t), args.reps)
        t_r = time_cuda(functools.partial(ref_fn, t), max(3, args.reps // 5))
        # bit-exactness is defined against the CPU reference: torch on CUDA divides by a Python
        # scalar as a multiply by its reciprocal (not correctly rounded), so the same reference
        # run on the GPU can differ in the last bit of a scale (reported as ref_gpu_equals_cpu)
        out, ref_cpu, ref_gpu = fn(t), ref_fn(t.cpu()), ref_fn(t)
        row = {"kind": "quant", "name": name, "shape": list(t.shape), "triton_us": t_k * 1e6, "ref_us": t_r * 1e6,
               "triton_gbps": nbytes / t_k / 1e9, "ref_gbps": nbytes / t_r / 1e9,
               "bit_exact": _same(_cpu(out), ref_cpu), "ref_gpu_equals_cpu": _same(_cpu(ref_gpu), ref_cpu)}
        if peak:
            row["floor_pct"] = 100.0 * (nbytes / peak[2]) / t_k
        rows.append(row)
        print_row(row)


def _cpu(a):
    return {key: v.cpu() for key, v in a.items()} if isinstance(a, dict) else tuple(v.cpu() for v in a)


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return all(torch.equal(a[key], b[key]) for key in a)
    return all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y) for x, y in zip(a, b))


_printed = set()


def _fmt(v, width=9, prec=1):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-".rjust(width)
    if isinstance(v, float):
        return f"{v:{width}.{prec}f}"
    return str(v).rjust(width)


def print_row(r):
    if r["kind"] == "moe":
        if "moe" not in _printed:
            _printed.add("moe")
            print(f"\n{'layer':10} {'format':11} {'T':>5} {'pairs':>6} {'act.E':>5} {'triton us':>10} "
                  f"{'TFLOP/s':>8} {'GB/s':>7} {'floor us':>9} {'floor%':>6} {'bf16 loop us':>12} "
                  f"{'ref us':>10} {'rel err':>8}")
        err = r.get("rel_err_vs_ref")
        err_s = f"{err:8.2e}" if err is not None else "-"
        print(f"{r['layer']:10} {r['format']:11} {r['T']:5d} {r['pairs']:6d} {r['active_experts']:5d} "
              f"{_fmt(r['triton_us'], 10)} {_fmt(r['tflops'], 8)} {_fmt(r['gbps'], 7, 0)} "
              f"{_fmt(r.get('floor_us'), 9)} {_fmt(r.get('floor_pct'), 6)} {_fmt(r['torch_bf16_loop_us'], 12)} "
              f"{_fmt(r.get('ref_us'), 10)} {err_s:>8}")
    else:
        if "quant" not in _printed:
            _printed.add("quant")
            print(f"\n{'quant kernel':22} {'shape':>12} {'triton us':>10} {'GB/s':>7} {'floor%':>6} "
                  f"{'ref us':>9} {'ref GB/s':>8} {'bit-exact':>9} {'ref gpu=cpu':>11}")
        print(f"{r['name']:22} {'x'.join(map(str, r['shape'])):>12} {_fmt(r['triton_us'], 10)} "
              f"{_fmt(r['triton_gbps'], 7, 0)} {_fmt(r.get('floor_pct'), 6)} {_fmt(r['ref_us'], 9)} "
              f"{_fmt(r['ref_gbps'], 8, 0)} {r['bit_exact']!s:>9} {r['ref_gpu_equals_cpu']!s:>11}")
    sys.stdout.flush()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", nargs="?", const="-", default=None, help="write rows as JSON to FILE (- = stdout)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--no-ref", action="store_true", help="skip the (slow) torch reference")
    ap.add_argument("--no-quant", action="store_true")
    ap.add_argument("--quick", action="store_true", help="one layer, T=512 and 4096, reps 5")
    ap.add_argument("--sweep", action="store_true", help="time tile configs instead (for default_config)")
    ap.add_argument("--breakdown", action="store_true", help="time each step of a decode call instead")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU")
    if args.quick:
        args.layers, args.reps = args.layers[:1], 5
    name, peak = peaks()
    print(f"device: {name}; peaks: " + (f"{peak[0] / 1e12:.0f} TFLOP/s bf16, {peak[1] / 1e12:.0f} fp8, "
                                        f"{peak[2] / 1e12:.2f} TB/s" if peak else "unknown"))
    rows: list[dict] = []
    if args.sweep or args.breakdown:
        (sweep_moe if args.sweep else decode_breakdown)(args, rows)
        args.no_quant = True
    else:
        bench_moe(args, peak, rows)
    if not args.no_quant:
        bench_quant(args, peak, rows)
    if args.json:
        payload = json.dumps({"device": name, "rows": rows}, indent=1)
        if args.json == "-":
            print(payload)
        else:
            with open(args.json, "w") as f:
                f.write(payload)


if __name__ == "__main__":
    main()
