"""Conversion speed and memory, side by side in one run (issue 6).

    python bench/convert.py                     # 1.3 GiB synthetic bf16 Mixtral-layout model, 1 GiB shards
    python bench/convert.py --size-gib 4 --shard-gib 4 --only fp8-block

Builds (once, cached in --workdir) a synthetic bf16 checkpoint, then measures: `cp` of the
same files (the I/O floor), `moetool quantize` per format, `moetool shard --ep 8`,
`moetool repack --layout stacked`, and llm-compressor's `model_free_ptq` for the matching
scheme when it is installed. Each step runs as its own process; peak RSS is the largest sum
of RSS over the process tree, sampled every 20 ms. Steps run --repeat times, interleaved; the
table prints the median seconds, GB/s of input, ratios against cp and llm-compressor, and peak RSS.
On a shared machine each run waits (up to --idle-wait s) for the other processes to go quiet,
and a run during which they used the CPU anyway (more than 0.3 CPU-s, or 5 % of the run) is run
again, up to --retries times; the table says how many were.
`start-up` is `python -m moetool --help` (interpreter + CLI: what shard and repack pay, which
copy bytes without torch) and `start-up+torch` adds `import torch` and the quantize library
(what quantize pays); the `after start-up` columns subtract the step's own start-up (the plain
one where `start-up+torch` was not measured), which shows the conversion itself against cp
when the input is small enough for the page cache to make cp faster than importing torch.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

LLMC_SCHEME = {"fp8-block": "FP8_BLOCK", "fp8-channel": "FP8_DYNAMIC", "int4-group": "W4A16"}
MOETOOL_FLAG = {"fp8-block": "--fp8-block", "fp8-channel": "--fp8-channel", "int4-group": "--int4"}


def build_checkpoint(path: Path, size_gib: float, shard_gib: float, hidden: int, intermediate: int, experts: int) -> None:
    import math

    import torch

    from moetool.demo.tiny import tiny_config
    from moetool.convert.output import OutputDir
    from moetool.read.safetensors import TensorSpec

    per_layer = (3 * experts * hidden * intermediate + 4 * hidden * hidden + experts * hidden) * 2
    layers = max(1, math.ceil(size_gib * 2**30 / per_layer))
    cfg = tiny_config("mixtral", hidden=hidden, intermediate=intermediate, experts=experts, top_k=2, layers=layers,
                      dtype=torch.bfloat16)
    cfg["vocab_size"] = 1024
    names: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (1024, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        names += [(f"{p}.input_layernorm.weight", (hidden,)), (f"{p}.post_attention_layernorm.weight", (hidden,))]
        names += [(f"{p}.self_attn.{x}_proj.weight", (hidden, hidden)) for x in "qkvo"]
        names.append((f"{p}.block_sparse_moe.gate.weight", (experts, hidden)))
        for e in range(experts):
            b = f"{p}.block_sparse_moe.experts.{e}"
            names += [(f"{b}.w1.weight", (intermediate, hidden)), (f"{b}.w3.weight", (intermediate, hidden)),
                      (f"{b}.w2.weight", (hidden, intermediate))]
    names += [("model.norm.weight", (hidden,)), ("lm_head.weight", (1024, hidden))]
    out = OutputDir(path, force=True)
    files, cur, size = [], [], 0
    for n, shp in names:
        nb = math.prod(shp) * 2
        if cur and size + nb > shard_gib * 2**30:
            files.append(cur)
            cur, size = [], 0
        cur.append((n, shp))
        size += nb
    files.append(cur)
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, part in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        specs = [TensorSpec(n, torch.bfloat16, shp) for n, shp in part]

        def data(part=part):
            for n, shp in part:
                yield n, (torch.randn(*shp, generator=g) * 0.02).to(torch.bfloat16)

        out.write_safetensors(fname, specs, data())
        weight_map.update({n: fname for n, _ in part})
    total = sum(math.prod(s) * 2 for _, s in names)
    out.write_json("model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    out.write_json("config.json", cfg)
    out.finish({"kind": "checkpoint", "bench": [size_gib, shard_gib, hidden, intermediate, experts]})
    (path / "manifest.json").rename(path / "bench-params.json")


class TreeRSS:
    """Peak of the summed RSS of a process and all its descendants (Linux /proc), sampled every
    20 ms; the descendants are looked up every 100 ms (a scan of every process: done every
    20 ms it cost this process 6 % of a core, taken from the step it measures)."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                    children.setdefault(ppid, []).append(int(d))
                except (OSError, IndexError, ValueError):
                    pass
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += children.get(p, [])
        return out

    def _run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        tick = 0
        while not self._stop.is_set():
            if tick % 5 == 0:
                tree = self._tree()
            tick += 1
            total = 0
            for p in tree:
                try:
                    with open(f"/proc/{p}/statm") as f:
                        total += int(f.read().split()[1]) * page
                except OSError:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(0.02)

    def stop(self) -> int:
        self._stop.set()
        self.thread.join()
        return self.peak


def busy_cpu_seconds() -> float | None:
    """CPU time the whole machine has spent busy (not idle, not waiting for I/O) since boot,
    from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def wait_idle(limit_s: float, busy_fraction: float = 0.05) -> float:
    """Wait (at most ``limit_s``) until the machine is idle: under ``busy_fraction`` of its
    cores busy over half a second. Returns the seconds waited."""
    t0 = time.perf_counter()
    cores = os.cpu_count() or 1
    while time.perf_counter() - t0 < limit_s:
        before = busy_cpu_seconds()
        if before is None:
            break
        time.sleep(0.5)
        if (busy_cpu_seconds() - before) / 0.5 / cores < busy_fraction:
            break
    return time.perf_counter() - t0


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, int, float]:
    """(seconds, peak RSS of the process tree, CPU-seconds other processes used meanwhile:
    the machine's busy time less the step's own, kernel writeback threads included)."""
    import resource

    def own() -> float:  # the step's CPU, and this process's (its RSS sampling thread)
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_CHILDREN),
                                                     resource.getrusage(resource.RUSAGE_SELF)))

    busy0, own0 = busy_cpu_seconds(), own()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    rss = TreeRSS(proc.pid)
    _, err = proc.communicate()
    seconds = time.perf_counter() - t0
    peak = rss.stop()
    own1 = own()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err.decode()[-2000:]}")
    foreign = busy_cpu_seconds() - busy0 - (own1 - own0) if busy0 is not None else 0.0
    return seconds, peak, max(foreign, 0.0)


LLMC_SCRIPT = r"""
import sys
from llmcompressor import model_free_ptq
src, out, scheme, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model_free_ptq(model_stub=src, save_directory=out, scheme=scheme,
               ignore=["lm_head", "re:.*self_attn.*", "re:.*block_sparse_moe.gate$", "re:.*embed_tokens"],
               max_workers=workers, device="cpu")
"""


def have_llmc(python: str) -> bool:
    return subprocess.run([python, "-c", "import llmcompressor; from llmcompressor import model_free_ptq"],
                          capture_output=True).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path(".bench/convert"))
    ap.add_argument("--size-gib", type=float, default=1.3)
    ap.add_argument("--shard-gib", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3584)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--only", default="", help="comma list of steps (cp, start-up, start-up+torch, fp8-block, fp8-channel, int4-group, shard, repack, llmc-*)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--llmc-python", default=sys.executable, help="python that has llmcompressor installed")
    ap.add_argument("--llmc-workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeat", type=int, default=3, help="runs per step; the table shows the median")
    ap.add_argument("--idle-wait", type=float, default=30.0,
                    help="before each run, wait up to this many seconds for the machine to be idle")
    ap.add_argument("--retries", type=int, default=2,
                    help="runs again (at most this often) a run during which other processes used the CPU")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    src = args.workdir / "src"
    params = [args.size_gib, args.shard_gib, args.hidden, args.intermediate, args.experts]
    marker = src / "bench-params.json"
    if not marker.exists() or json.loads(marker.read_text()).get("bench") != params:
        shutil.rmtree(src, ignore_errors=True)
        print(f"building a {args.size_gib} GiB synthetic checkpoint in {src} ...", file=sys.stderr)
        build_checkpoint(src, *params)
    in_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    only = set(filter(None, args.only.split(",")))
    moetool = [sys.executable, "-m", "moetool"]
    steps: list[tuple[str, list[str], Path]] = []
    out = args.workdir / "out"

    def add(name, cmd, dst):
        if not only or name in only:
            steps.append((name, cmd, dst))

    # the floor for a durable copy: moetool fsyncs every file it writes, so cp must sync too
    add("cp", ["sh", "-c", f"cp -r '{src}' '{out / 'cp'}' && sync"], out / "cp")
    add("start-up", moetool + ["--help"], out / "start-up")
    add("start-up+torch", [sys.executable, "-c", "import moetool.cli, moetool.lazy as l; l.freeze_imports = 1; l.import_module('moetool.convert.quantize')"],
        out / "start-up+torch")  # as `moetool quantize` imports it
    for fmt, flag in MOETOOL_FLAG.items():
        add(fmt, moetool + ["quantize", str(src), str(out / fmt), flag, "-q", "--device", args.device], out / fmt)
    add("shard", moetool + ["shard", str(src), str(out / "shard"), "--ep", "8", "-q"], out / "shard")
    add("repack", moetool + ["repack", str(src), str(out / "repack"), "--layout", "stacked", "-q"], out / "repack")
    if have_llmc(args.llmc_python):
        for fmt, scheme in LLMC_SCHEME.items():
            add(f"llmc-{fmt}", [args.llmc_python, "-c", LLMC_SCRIPT, str(src), str(out / f"llmc-{fmt}"), scheme,
                                str(args.llmc_workers)], out / f"llmc-{fmt}")
    else:
        print("llm-compressor not installed (--llmc-python): its rows are skipped", file=sys.stderr)

    runs: dict[str, list[tuple[float, int, float]]] = {name: [] for name, _, _ in steps}
    repeated = 0
    for _ in range(args.repeat):  # interleaved, so drifting disk speed hits every step alike
        for name, cmd, dst in steps:
            for attempt in range(args.retries + 1):
                shutil.rmtree(dst, ignore_errors=True)
                dst.parent.mkdir(parents=True, exist_ok=True)
                subprocess.run(["sync"])
                wait_idle(args.idle_wait)
                seconds, peak, foreign = timed(cmd)
                shutil.rmtree(dst, ignore_errors=True)
                # kernel writeback for the step itself: ~0.1 CPU-s for cp of this input
                disturbed = foreign > max(0.3, 0.05 * seconds)
                note = f" (other processes used {foreign:.2f} CPU-s meanwhile)" if disturbed else ""
                print(f"  {name}: {seconds:.2f} s{note}", file=sys.stderr)
                if not disturbed or attempt == args.retries:
                    break
                repeated += 1
            runs[name].append((seconds, peak, foreign))
    results = {}
    for name, rs in runs.items():
        seconds = statistics.median(r[0] for r in rs)
        results[name] = {"seconds": seconds, "gbps": in_bytes / seconds / 1e9,
                         "peak_rss_mb": max(r[1] for r in rs) / 1e6, "runs": [round(r[0], 2) for r in rs],
                         "foreign_cpu_s": [round(r[2], 2) for r in rs]}

    cp = results.get("cp", {}).get("seconds")
    plain_startup = results.get("start-up", {}).get("seconds")
    torch_startup = results.get("start-up+torch", {}).get("seconds") or plain_startup
    rows = []
    for name, r in results.items():
        llmc = results.get(f"llmc-{name}", {}).get("seconds")
        startup = torch_startup if name in MOETOOL_FLAG else plain_startup  # quantize imports torch
        work = (r["seconds"] - startup if startup and name not in ("cp", "start-up", "start-up+torch")
                and not name.startswith("llmc") else None)
        rows.append({"step": name, **r, "vs_cp": (cp / r["seconds"]) if cp else None,
                     "vs_llmc": (llmc / r["seconds"]) if llmc and not name.startswith("llmc") else None,
                     "after_startup_s": work, "after_startup_vs_cp": (cp / work) if cp and work else None})
    if args.json:
        print(json.dumps({"input_bytes": in_bytes, "repeated_runs": repeated, "rows": rows}, indent=2))
        return
    print(f"input: {in_bytes / 2**30:.2f} GiB bf16 in {len(list(src.glob('*.safetensors')))} shard(s), "
          f"{os.cpu_count()} cores, device {args.device}")
    print(f"median of {args.repeat} runs per step; peak RSS is the largest seen; {repeated} run(s) repeated "
          f"because other processes used the CPU")
    print(f"{'step':<20} {'seconds':>8} {'GB/s':>6} {'x cp':>6} {'x llmc':>7} {'peak RSS MB':>12} "
          f"{'after start-up s':>17} {'x cp':>6}")

    def fmt(v, spec=".2f"):
        return format(v, spec) if v else "-"

    for r in rows:
        print(f"{r['step']:<20} {r['seconds']:>8.2f} {r['gbps']:>6.2f} {fmt(r['vs_cp']):>6} {fmt(r['vs_llmc']):>7} "
              f"{r['peak_rss_mb']:>12.0f} {fmt(r['after_startup_s']):>17} {fmt(r['after_startup_vs_cp']):>6}")


if __name__ == "__main__":
    main()
