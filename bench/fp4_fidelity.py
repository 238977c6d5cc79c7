"""FP4 reconstruction error, moetool against llm-compressor on the same weights (issue 16).

    python bench/fp4_fidelity.py --llmc-python /work/.bench/llmc/bin/python
    python bench/fp4_fidelity.py --src CKPT --llmc-python ...     # a bf16 Mixtral-layout checkpoint

Builds (once, cached in --workdir) a synthetic bf16 Mixtral-layout checkpoint per weight
distribution (--dist): ``normal`` = N(0, 1/fan_in), as moetool's tiny models; ``t3`` = Student-t
with 3 degrees of freedom scaled to the same variance, heavy-tailed as real weights are. Or
takes --src. Then quantizes the routed experts with ``moetool quantize --format nvfp4 / mxfp4``
and with llm-compressor's ``model_free_ptq`` (schemes NVFP4A16 / MXFP4A16, in the --llmc-python
interpreter: its own venv), dequantizes every expert linear of both outputs with moetool's
format code (both are compressed-tensors checkpoints) and prints, per distribution, format and
tool: linears, the mean and max over linears of the relative error ||w' - w|| / ||w||, the
relative error of all of them together, moetool's mean against llm-compressor's, and how many
linears have byte-identical tensors in both outputs.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moetool.convert.quantize import quantize
from moetool.demo.tiny import tiny_config, tiny_tensors
from moetool.formats import get_format

FORMATS = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}

LLMC_SCRIPT = r"""
import sys
from llmcompressor import model_free_ptq
src, out, scheme = sys.argv[1], sys.argv[2], sys.argv[3]
model_free_ptq(model_stub=src, save_directory=out, scheme=scheme,
               ignore=["lm_head", "re:.*self_attn.*", "re:.*block_sparse_moe.gate$", "re:.*embed_tokens"],
               max_workers=1, device="cpu")
"""


def build_checkpoint(path: Path, dist: str, hidden: int, intermediate: int, experts: int, layers: int) -> None:
    """A bf16 Mixtral-layout checkpoint whose routed experts follow ``dist``."""
    cfg = tiny_config("mixtral", hidden=hidden, intermediate=intermediate, experts=experts, top_k=2, layers=layers,
                      dtype=torch.bfloat16)
    tensors = tiny_tensors("mixtral", cfg, seed=0)
    if dist == "t3":
        g = torch.Generator().manual_seed(1)
        for name, w in tensors.items():
            if ".experts." in name:
                # Student-t(3) = Z / sqrt(chi2(3) / 3); its variance 3 scaled to 1 / fan_in
                chi2 = (torch.randn(3, *w.shape, generator=g) ** 2).sum(0)
                t3 = torch.randn(w.shape, generator=g) / (chi2 / 3).sqrt()
                tensors[name] = (t3 / math.sqrt(3 * w.shape[1])).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def read(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p in sorted(root.glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def compare(src: dict[str, torch.Tensor], outputs: dict[str, dict[str, torch.Tensor]], fmt_name: str) -> dict:
    """Per tool: relative errors of the dequantized expert linears, and identical linears."""
    fmt = get_format(fmt_name)
    bases = sorted(n.removesuffix(".weight") for n in src if ".experts." in n and n.endswith(".weight"))
    rows: dict[str, dict] = {}
    for tool, tensors in outputs.items():
        errs, sig, noise = [], 0.0, 0.0
        for base in bases:
            w = src[f"{base}.weight"].double()
            deq = fmt.dequantize({s: tensors[f"{base}.{s}"] for s in fmt.suffixes}).double()
            e2, s2 = float(((deq - w) ** 2).sum()), float((w * w).sum())
            errs.append(math.sqrt(e2 / s2))
            sig, noise = sig + s2, noise + e2
        rows[tool] = {"linears": len(bases), "mean_rel": sum(errs) / len(errs), "max_rel": max(errs),
                      "total_rel": math.sqrt(noise / sig)}
    if len(outputs) == 2:
        a, b = outputs.values()
        same = sum(all(torch.equal(a[f"{base}.{s}"].view(torch.uint8), b[f"{base}.{s}"].view(torch.uint8))
                       for s in fmt.suffixes) for base in bases)
        rows["identical_linears"] = same
    return rows


def have_llmc(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "from llmcompressor import model_free_ptq"], capture_output=True).returncode == 0
    except OSError:  # no such interpreter
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path(".bench/fp4_fidelity"))
    ap.add_argument("--src", type=Path, help="a bf16 Mixtral-layout checkpoint instead of the synthetic ones")
    ap.add_argument("--dist", default="normal,t3", help="synthetic weight distributions: normal, t3")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--formats", default="nvfp4,mxfp4")
    ap.add_argument("--llmc-python", default=sys.executable, help="python that has llmcompressor installed")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    llmc = have_llmc(args.llmc_python)
    if not llmc:
        print("llm-compressor not installed (--llmc-python): its rows are skipped", file=sys.stderr)
    sources = {"src": args.src} if args.src else {}
    for dist in ([] if args.src else args.dist.split(",")):
        path = args.workdir / f"src-{dist}"
        params = [dist, args.hidden, args.intermediate, args.experts, args.layers]
        marker = path / "bench-params.json"
        if not marker.exists() or json.loads(marker.read_text()) != params:
            shutil.rmtree(path, ignore_errors=True)
            print(f"building the {dist} checkpoint in {path} ...", file=sys.stderr)
            build_checkpoint(path, *params)
            marker.write_text(json.dumps(params))
        sources[dist] = path

    results = []
    for dist, src in sources.items():
        src_tensors = read(src)
        for fmt_name in args.formats.split(","):
            out = args.workdir / "out" / f"{dist}-{fmt_name}"
            quantize(src, out / "moetool", fmt_name, progress=False, force=True)
            outputs = {"moetool": read(out / "moetool")}
            if llmc:
                shutil.rmtree(out / "llmc", ignore_errors=True)
                p = subprocess.run([args.llmc_python, "-c", LLMC_SCRIPT, str(src), str(out / "llmc"), FORMATS[fmt_name]],
                                   capture_output=True, text=True)
                if p.returncode:
                    raise SystemExit(f"llm-compressor failed on {src} ({FORMATS[fmt_name]}): {p.stderr[-2000:]}")
                outputs["llm-compressor"] = read(out / "llmc")
            rows = compare(src_tensors, outputs, fmt_name)
            same = rows.pop("identical_linears", None)
            theirs = rows.get("llm-compressor", {}).get("mean_rel")
            for tool, r in rows.items():
                results.append({"weights": dist, "format": fmt_name, "tool": tool, **r,
                                "vs_llmc": (r["mean_rel"] / theirs - 1) if theirs and tool == "moetool" else None,
                                "identical_linears": same if tool == "moetool" else None})
    if args.json:
        print(json.dumps({"rows": results}, indent=2))
        return
    print(f"{'weights':<8} {'format':<6} {'tool':<15} {'linears':>7} {'mean rel':>9} {'max rel':>9} {'all rel':>9} "
          f"{'vs llmc':>8} {'identical':>9}")
    for r in results:
        vs = f"{100 * r['vs_llmc']:+.2f}%" if r["vs_llmc"] is not None else "-"
        same = f"{r['identical_linears']}/{r['linears']}" if r["identical_linears"] is not None else "-"
        print(f"{r['weights']:<8} {r['format']:<6} {r['tool']:<15} {r['linears']:>7} {r['mean_rel']:>9.5f} "
              f"{r['max_rel']:>9.5f} {r['total_rel']:>9.5f} {vs:>8} {same:>9}")


if __name__ == "__main__":
    main()
