"""FP4 quantize / dequantize kernels on a GPU: bytes against the CPU formats, and throughput.

    python bench/fp4_quant_gpu.py [--rows 7168 --cols 2048] [--json OUT.json]

For a bf16 weight [rows, cols] (N(0, 0.02) with outliers): ``nvfp4_quant`` and ``mxfp4_quant``
against the formats' CPU ``quantize`` byte for byte (what ``quantize_cuda`` promises), then the
median time of each kernel and of ``fp4_dequant`` (triton.testing.do_bench, which flushes the
L2 cache before every run), as GB/s of bytes read and written, next to a device-to-device copy
of the weight (the memory floor: read + write the same bytes) and the CPU quantize.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from moetool.formats import get_format
from moetool.kernels.fp4_quant import fp4_dequant, mxfp4_quant, nvfp4_quant


def nbytes(t: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in t.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=7168)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    w_cpu = torch.randn(args.rows, args.cols, generator=g) * 0.02
    w_cpu[::97, ::31] *= 40  # outliers
    w_cpu[:3, :64] = 0  # all-zero groups
    w_cpu = w_cpu.to(torch.bfloat16)
    w = w_cpu.cuda()
    results: dict = {"shape": [args.rows, args.cols], "device": torch.cuda.get_device_name()}
    copy_dst = torch.empty_like(w)
    ms = triton.testing.do_bench(lambda: copy_dst.copy_(w), return_mode="median")
    results["copy"] = {"ms": ms, "gbps": 2 * w.numel() * 2 / ms / 1e6}
    for name, kernel in (("nvfp4", nvfp4_quant), ("mxfp4", mxfp4_quant)):
        fmt = get_format(name)
        t0 = time.perf_counter()
        want = fmt.quantize(w_cpu, torch.bfloat16)
        cpu_s = time.perf_counter() - t0
        got = kernel(w)
        torch.cuda.synchronize()
        exact = all(torch.equal(got[s].cpu().view(torch.uint8), want[s].view(torch.uint8)) for s in want)
        via_format = fmt.quantize_cuda(w, torch.bfloat16)
        exact_format = all(torch.equal(via_format[s].cpu().view(torch.uint8), want[s].view(torch.uint8)) for s in want)
        moved = w.numel() * 2 + nbytes(got)
        q_ms = triton.testing.do_bench(lambda: kernel(w), return_mode="median")
        deq = fp4_dequant(got)
        deq_exact = torch.equal(deq.cpu(), fmt.dequantize(want))
        d_ms = triton.testing.do_bench(lambda: fp4_dequant(got), return_mode="median")
        results[name] = {"bit_exact": exact, "quantize_cuda_bit_exact": exact_format, "dequant_exact": deq_exact,
                         "quant_ms": q_ms, "quant_gbps": moved / q_ms / 1e6,
                         "dequant_ms": d_ms, "dequant_gbps": (nbytes(got) + deq.numel() * 4) / d_ms / 1e6,
                         "cpu_quantize_s": cpu_s}
    print(f"{results['device']}, weight {args.rows} x {args.cols} bf16; copy {results['copy']['ms']:.4f} ms "
          f"({results['copy']['gbps']:.0f} GB/s)")
    print(f"{'format':<7} {'bit-exact':>9} {'quant ms':>9} {'GB/s':>6} {'dequant ms':>11} {'GB/s':>6} {'CPU s':>6}")
    for name in ("nvfp4", "mxfp4"):
        r = results[name]
        ok = r["bit_exact"] and r["quantize_cuda_bit_exact"] and r["dequant_exact"]
        print(f"{name:<7} {str(ok):>9} {r['quant_ms']:>9.4f} {r['quant_gbps']:>6.0f} {r['dequant_ms']:>11.4f} "
              f"{r['dequant_gbps']:>6.0f} {r['cpu_quantize_s']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
