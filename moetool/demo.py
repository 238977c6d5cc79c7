"""``moetool demo``: the whole chain on a built-in tiny model, no download.

tiny DeepSeek-V3-style model (bf16, 16 experts, top-4, grouped sigmoid routing with
correction bias, a shared expert) -> inspect -> quantize --fp8-block -> shard --ep 4 ->
verify --dp 2 --ep 4 (CPU, gloo) with a final verdict.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

from moetool.checkpoint import open_checkpoint
from moetool.inspect import inspect_checkpoint, render
from moetool.quantize import quantize
from moetool.shard import shard
from moetool.tiny import make_tiny_checkpoint
from moetool.verify_shards import VerifyOptions, verify


def run_demo(workdir: Path | None = None, *, echo: Callable[[str], None] = print, ep: int = 4, dp: int = 2,
             fmt: str = "fp8-block", dispatch: str = "all2all") -> bool:
    """Run the chain; returns True when verification passed."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="moetool-demo-") as tmp:
        root = Path(workdir) if workdir else Path(tmp)
        model, quant, shards = root / "tiny-moe", root / f"tiny-moe-{fmt}", root / f"tiny-moe-{fmt}-ep{ep}"
        echo(f"[1/4] writing a tiny DeepSeek-V3-style MoE checkpoint to {model}")
        make_tiny_checkpoint(model, "deepseek_v3")
        with open_checkpoint(model) as ckpt:
            echo(_indent(render(inspect_checkpoint(ckpt))))
        echo(f"[2/4] moetool quantize {model.name} {quant.name} --{fmt.replace('int4-group', 'int4')}")
        echo(_indent(quantize(model, quant, fmt, group_size=64, progress=False).render()))
        echo(f"[3/4] moetool shard {quant.name} {shards.name} --ep {ep}")
        echo(_indent(shard(quant, shards, ep, progress=False).render()))
        echo(f"[4/4] moetool verify {shards.name} --ref {model.name} --dp {dp} --ep {ep} --all2all {dispatch}"
             " (one process per rank, gloo on CPU)")
        report = verify(shards, model, VerifyOptions(dp=dp, ep=ep, dispatch=dispatch, tokens=256))
        echo(_indent(report.render()))
    verdict = "PASSED" if report.passed else "FAILED"
    echo(f"demo {verdict}: quantized to {fmt}, split over {ep} EP ranks, and the distributed forward matches the "
         f"unquantized model on every MoE layer ({time.perf_counter() - t0:.1f} s)" if report.passed else
         f"demo {verdict}: see the table above")
    return report.passed


def _indent(text: str) -> str:
    return "\n".join("      " + line for line in text.splitlines())
