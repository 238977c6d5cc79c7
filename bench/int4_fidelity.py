"""int4 reconstruction error and quantize speed: moetool against llm-compressor, same weights.

    python bench/int4_fidelity.py --llmc-python /work/.bench/llmc/bin/python   # the table
    python bench/int4_fidelity.py --quick --no-llmc --json -                    # moetool only
    python bench/int4_fidelity.py --device cuda --no-llmc                       # + the Triton kernel

Weights, bf16, seeded: for each distribution (``gauss`` N(0, 0.02^2); ``t5``, ``t3``:
Student-t with 5 and 3 degrees of freedom, heavy-tailed, scaled to std 0.02) and each
``--shapes`` N x K (default: DeepSeek-V3 expert gate/up 2048 x 7168 and down 7168 x 2048,
Qwen3-30B-A3B expert 768 x 2048 and 2048 x 768), one tensor; ``--checkpoint PATH`` adds the
routed experts' linears of a local checkpoint (its first MoE layer, ``--experts`` of them).

Quantizers, group 128: ``moetool`` (``--int4``), ``moetool mse`` (``--int4-clip mse``) and
llm-compressor's ``W4A16`` (``model_free_ptq``, run by ``--llmc-python``: llm-compressor lives
in its own venv, never in moetool's), each symmetric and (``--asymmetric``, on by default)
asymmetric against ``W4A16_ASYM``. llm-compressor's output is read back from its safetensors
and, like ours, dequantized by ``Int4Group.dequantize`` (tests/formats check that it equals
compressed-tensors' own decompression).

Table, per distribution and over all tensors: mean and max of the relative error
||dequant(w) - w|| / ||w|| per tensor, ``vs llmc``: the mean over llm-compressor's mean
(same weights, same symmetry; < 1 is better). Speed: moetool's ``quantize_measured`` in this
process (what ``moetool quantize`` runs per linear on CPU), GB/s of bf16 input, best of
``--repeat``; llm-compressor's whole ``model_free_ptq`` call (read, quantize, write the same
tensors; timed inside its process, so no interpreter start-up). With ``--device cuda``: the
Triton kernel (``quantize_cuda``), checked bit-exact against the CPU tensors, timed with CUDA
events (median of ``--repeat``).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moetool.formats import Int4Group

DISTRIBUTIONS = ("gauss", "t5", "t3")
SHAPES = ("2048x7168", "7168x2048", "768x2048", "2048x768")
STD = 0.02
GROUP = 128
#: llm-compressor scheme of each symmetry
LLMC_SCHEMES = {True: "W4A16", False: "W4A16_ASYM"}

LLMC_SCRIPT = r"""
import json, sys, time
from llmcompressor import model_free_ptq
src, out, scheme = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
model_free_ptq(model_stub=src, save_directory=out, scheme=scheme, ignore=[], max_workers=1, device="cpu")
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def make_weight(dist: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dist == "gauss":
        w = torch.randn(*shape, generator=g)
    else:
        nu = float(dist[1:])
        # Student-t: a normal over sqrt(chi2(nu) / nu); chi2(nu) = 2 * Gamma(nu / 2)
        chi2 = torch._standard_gamma(torch.full(shape, nu / 2), generator=g) * 2
        w = torch.randn(*shape, generator=g) / torch.sqrt(chi2 / nu) / math.sqrt(nu / (nu - 2))
    return (w * STD).to(torch.bfloat16)


def checkpoint_weights(path: Path, experts: int) -> dict[str, torch.Tensor]:
    """The routed experts' linears (gate, up, down) of the first MoE layer, as the model's dtype."""
    from moetool.convert.torch_executor import model_dtype
    from moetool.read.checkpoint import open_checkpoint
    from moetool.read.experts import ExpertReader

    out = {}
    with open_checkpoint(path) as ck:
        reader = ExpertReader(ck)
        dtype = model_dtype(ck.config)
        layer = reader.spec.moe_layers[0]
        for e in range(min(experts, layer.num_experts)):
            for role, lin in zip(("gate", "up", "down"), reader.gate_up_down(layer, e), strict=True):
                out[f"ckpt.l{layer.index}.e{e}.{role}"] = reader.fmt.dequantize(lin).to(dtype)
    return out


def rel_err(fmt: Int4Group, t: dict, w: torch.Tensor) -> float:
    w32 = w.float()
    return float((fmt.dequantize(t) - w32).norm() / w32.norm())


def moetool_rows(weights: dict, symmetric: bool, clip: str, repeat: int) -> tuple[dict, float]:
    """Per tensor relative error, and the best over ``repeat`` of the seconds quantize_measured
    takes for all of them (after an untimed pass)."""
    fmt = Int4Group(GROUP, symmetric, clip)
    errors = {name: rel_err(fmt, fmt.quantize_measured(w, w.dtype)[0], w) for name, w in weights.items()}
    best = math.inf  # the first pass above warmed the scratch buffers up
    for _ in range(repeat):
        t0 = time.perf_counter()
        for w in weights.values():
            fmt.quantize_measured(w, w.dtype)
        best = min(best, time.perf_counter() - t0)
    return errors, best


def llmc_rows(weights: dict, symmetric: bool, python: str, workdir: Path) -> tuple[dict, float]:
    """llm-compressor's model_free_ptq on a checkpoint of ``weights`` (one linear each)."""
    from safetensors.torch import load_file, save_file

    src, out = workdir / "src", workdir / f"llmc-{LLMC_SCHEMES[symmetric]}"
    shutil.rmtree(out, ignore_errors=True)
    names = {name: f"model.layers.0.mlp.experts.{i}.down_proj" for i, name in enumerate(weights)}
    if symmetric or not (src / "model.safetensors").exists():  # written once per run
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        save_file({f"{base}.weight": weights[name].contiguous() for name, base in names.items()},
                  str(src / "model.safetensors"), metadata={"format": "pt"})
        (src / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}))
    p = subprocess.run([python, "-c", LLMC_SCRIPT, str(src), str(out), LLMC_SCHEMES[symmetric]],
                       capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"llm-compressor failed ({p.returncode}): {p.stderr[-2000:]}")
    seconds = json.loads(p.stdout.strip().splitlines()[-1])["seconds"]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    weights_args = next(iter(config["config_groups"].values()))["weights"]
    assert (weights_args["group_size"], weights_args["symmetric"]) == (GROUP, symmetric), weights_args
    got = {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(str(f)))
    fmt = Int4Group(GROUP, symmetric)
    return {name: rel_err(fmt, {s: got[f"{base}.{s}"] for s in fmt.suffixes}, weights[name])
            for name, base in names.items()}, seconds


def gpu_rows(weights: dict, symmetric: bool, clip: str, repeat: int) -> dict:
    """The Triton kernel on each tensor: bit-exact with the CPU path, and its time."""
    fmt = Int4Group(GROUP, symmetric, clip)
    mismatches, times = [], []
    for name, w in weights.items():
        want = fmt.quantize(w, w.dtype)
        wc = w.cuda()
        got = fmt.quantize_cuda(wc, w.dtype)
        if got is None or any(not torch.equal(got[s].cpu(), want[s]) for s in want):
            mismatches.append(name)
        ms = []
        for _ in range(repeat + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fmt.quantize_cuda(wc, w.dtype)
            end.record()
            torch.cuda.synchronize()
            ms.append(start.elapsed_time(end))
        times.append(statistics.median(ms[2:]) / 1e3)
    total = sum(w.numel() * w.element_size() for w in weights.values())
    return {"bit_exact": not mismatches, "mismatches": mismatches, "seconds": sum(times),
            "gbps": total / sum(times) / 1e9}


def summarize(errors: dict, groups: dict) -> dict:
    """{group: (mean, max)} of the per-tensor errors of each group of tensor names."""
    return {g: (statistics.mean(errors[n] for n in names), max(errors[n] for n in names))
            for g, names in groups.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of NxK")
    ap.add_argument("--dists", default=",".join(DISTRIBUTIONS), help=f"comma list of {', '.join(DISTRIBUTIONS)}")
    ap.add_argument("--seeds", type=int, default=1, help="tensors per distribution and shape")
    ap.add_argument("--checkpoint", type=Path, help="also a local checkpoint's routed experts (first MoE layer)")
    ap.add_argument("--experts", type=int, default=8, help="experts of --checkpoint")
    ap.add_argument("--asymmetric", action=argparse.BooleanOptionalAction, default=True,
                    help="also asymmetric, against W4A16_ASYM")
    ap.add_argument("--llmc-python", default=sys.executable, help="python that has llmcompressor installed")
    ap.add_argument("--no-llmc", action="store_true", help="moetool only")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: also the Triton kernel")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs (best of, CPU; median of, CUDA)")
    ap.add_argument("--workdir", type=Path, help="llm-compressor's input and output (default: a temporary folder)")
    ap.add_argument("--quick", action="store_true", help="small shapes, one repeat")
    ap.add_argument("--json", help="also write the results as JSON to this file (- = stdout, table to stderr)")
    args = ap.parse_args(argv)
    if args.quick:
        args.shapes, args.repeat = "512x1024,1024x512", 1

    weights: dict[str, torch.Tensor] = {}
    groups: dict[str, list[str]] = {}
    for dist in filter(None, args.dists.split(",")):
        if dist not in DISTRIBUTIONS:
            ap.error(f"--dists: unknown distribution {dist!r} (known: {', '.join(DISTRIBUTIONS)})")
        for shape in filter(None, args.shapes.split(",")):
            n, k = (int(v) for v in shape.lower().split("x"))
            for seed in range(args.seeds):
                name = f"{dist}.{n}x{k}.s{seed}"
                weights[name] = make_weight(dist, (n, k), seed)
                groups.setdefault(dist, []).append(name)
    if args.checkpoint:
        ckpt = checkpoint_weights(args.checkpoint, args.experts)
        weights.update(ckpt)
        groups["checkpoint"] = list(ckpt)
    groups["all"] = list(weights)
    in_bytes = sum(w.numel() * w.element_size() for w in weights.values())

    llmc = not args.no_llmc and subprocess.run([args.llmc_python, "-c", "import llmcompressor"],
                                               capture_output=True).returncode == 0
    if not args.no_llmc and not llmc:
        print(f"llm-compressor is not importable by {args.llmc_python} (--llmc-python): its rows are skipped",
              file=sys.stderr)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="int4-fidelity-"))
    results: list[dict] = []
    try:
        for symmetric in (True, False) if args.asymmetric else (True,):
            sym = "sym" if symmetric else "asym"
            errors: dict[str, dict] = {}
            runs = {}
            if llmc:
                errors["llmc"], seconds = llmc_rows(weights, symmetric, args.llmc_python, workdir)
                runs["llmc"] = {"quantizer": f"llm-compressor {LLMC_SCHEMES[symmetric]}", "seconds": seconds,
                                "what": "model_free_ptq call"}
            for clip in ("none", "mse"):
                key = "moetool" if clip == "none" else "moetool mse"
                errors[key], seconds = moetool_rows(weights, symmetric, clip, args.repeat)
                runs[key] = {"quantizer": f"moetool {sym}" + (" --int4-clip mse" if clip == "mse" else ""),
                             "seconds": seconds, "what": "quantize_measured"}
                if args.device == "cuda":
                    runs[key]["cuda"] = gpu_rows(weights, symmetric, clip, args.repeat)
            for key, run in runs.items():
                stats = summarize(errors[key], groups)
                base = summarize(errors["llmc"], groups) if llmc else None
                results.append({
                    **run, "symmetric": symmetric, "gbps": in_bytes / run["seconds"] / 1e9,
                    "groups": {g: {"mean": m, "max": x, "vs_llmc": (m / base[g][0]) if base else None}
                               for g, (m, x) in stats.items()},
                    "tensors": errors[key],
                })
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    out = sys.stderr if args.json == "-" else sys.stdout
    print(f"{len(weights)} tensors, {in_bytes / 1e9:.3f} GB bf16, group {GROUP}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", file=out)
    print(f"{'quantizer':<32} {'weights':<11} {'mean rel err':>12} {'max rel err':>11} {'vs llmc':>8} "
          f"{'CPU GB/s':>9}" + (f" {'CUDA GB/s':>10} {'bit-exact':>9}" if args.device == "cuda" else ""), file=out)
    for r in results:
        for i, (g, v) in enumerate(r["groups"].items()):
            ratio = f"{v['vs_llmc']:.4f}" if v["vs_llmc"] is not None else "-"
            speed = f"{r['gbps']:.3f}" if i == 0 else ""
            line = f"{r['quantizer'] if i == 0 else '':<32} {g:<11} {v['mean']:>12.5f} {v['max']:>11.5f} {ratio:>8} {speed:>9}"
            if args.device == "cuda":
                cuda = r.get("cuda")
                line += (f" {cuda['gbps']:>10.2f} {str(cuda['bit_exact']):>9}" if cuda and i == 0 else f" {'':>10} {'':>9}")
            print(line, file=out)
    if args.json:
        payload = json.dumps({"tensors": len(weights), "bytes": in_bytes, "group_size": GROUP,
                              "torch": torch.__version__, "threads": torch.get_num_threads(),
                              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                              "rows": results}, indent=1)
        if args.json == "-":
            print(payload)
        else:
            Path(args.json).write_text(payload)
    if args.device == "cuda" and not all(r["cuda"]["bit_exact"] for r in results if "cuda" in r):
        print("CUDA kernel output differs from the CPU path", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
