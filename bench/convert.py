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
``--cold`` drops the whole page cache before each run (root only: as a fresh machine);
``--cold-input`` only the checkpoint's pages (the tools' code stays in memory, as on a machine
that ran python before). ``--old DIR...`` runs every moetool step again with the moetool of each older checkout DIR, as
STEP@DIR in the same table: a before/after in one run, against the same cp.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
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


def build_checkpoint(path: Path, size_gib: float, shard_gib: float, hidden: int, intermediate: int, experts: int,
                     device: str = "cpu") -> None:
    """The synthetic bf16 checkpoint (random weights drawn on ``device``: a CUDA device draws the
    GPU benchmark's gigabytes in seconds)."""
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
    g = torch.Generator(device=device).manual_seed(0)
    weight_map = {}
    for i, part in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        specs = [TensorSpec(n, torch.bfloat16, shp) for n, shp in part]

        def data(part=part):
            for n, shp in part:
                yield n, (torch.randn(*shp, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()

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


def cached_share(files: list[Path]) -> float | None:
    """The share of ``files``' pages in the page cache (``mincore`` on a mapping: it asks
    without reading, where a read with ``RWF_NOWAIT`` starts the kernel's read-ahead of what it
    misses); None where that cannot be asked (not Linux, only empty files). Linux answers
    "all cached" for a file this user can neither write nor owns: ask of the bench's own."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    pages = cached = 0
    for f in files:
        size = f.stat().st_size
        if not size:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = ctypes.create_string_buffer((size + page - 1) // page)
                if libc.mincore(addr, size, vec) != 0:
                    return None
                pages += len(vec.raw)
                cached += sum(b & 1 for b in vec.raw)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return cached / pages if pages else None


def evict(files: list[Path]) -> float | None:
    """Drop ``files``' pages from the page cache (``POSIX_FADV_DONTNEED`` after a sync: no root
    needed, and the rest of the cache, the tools' code with it, stays); returns
    :func:`cached_share` after."""
    subprocess.run(["sync"])
    if not hasattr(os, "posix_fadvise"):  # not Linux
        return None
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return cached_share(files)


def timed(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> tuple[float, int, float]:
    """(seconds, peak RSS of the process tree, CPU-seconds other processes used meanwhile:
    the machine's busy time less the step's own, kernel writeback threads included).
    ``cwd``: where it runs (``python -m`` puts it first on sys.path)."""
    import resource

    def own() -> float:  # the step's CPU, and this process's (its RSS sampling thread)
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_CHILDREN),
                                                     resource.getrusage(resource.RUSAGE_SELF)))

    busy0, own0 = busy_cpu_seconds(), own()
    t0 = time.perf_counter()
    env = {**os.environ, **(env or {}), T0_ENV: repr(time.time())}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd)
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


# ------------------------------------------------------------------ per-phase trace of one step

#: wall-clock time (time.time()) the bench took just before starting the traced step
T0_ENV = "MOETOOL_BENCH_T0"


class Phases:
    """Spans (start, end, bytes) per phase name, seconds from the step's start, from any thread."""

    def __init__(self, t0: float):
        self.t0, self.lock, self.spans = t0, threading.Lock(), {}

    def add(self, name: str, start: float, end: float, nbytes: int = 0) -> None:
        with self.lock:
            self.spans.setdefault(name, []).append((start - self.t0, end - self.t0, nbytes))

    def timing(self, name: str, fn, count_result: bool = False, count_arg: int | None = None):
        """``fn`` wrapped: each call one span of ``name`` (bytes: its int result, or the size of argument ``count_arg``)."""
        def wrapper(*a, **k):
            start = time.time()
            result = None
            try:
                result = fn(*a, **k)
                return result
            finally:
                n = result if count_result and isinstance(result, int) else 0
                if count_arg is not None and len(a) > count_arg:
                    try:
                        n = memoryview(a[count_arg]).nbytes
                    except TypeError:
                        n = sum(memoryview(b).nbytes for b in a[count_arg])
                self.add(name, start, time.time(), n)
        return wrapper

    def summary(self) -> dict:
        out = {}
        for name, spans in sorted(self.spans.items(), key=lambda kv: min(s[0] for s in kv[1])):
            spans.sort()
            union, cur_s, cur_e = 0.0, None, None
            for s, e, _ in spans:
                if cur_e is None or s > cur_e:
                    if cur_e is not None:
                        union += cur_e - cur_s
                    cur_s, cur_e = s, e
                else:
                    cur_e = max(cur_e, e)
            union += (cur_e - cur_s) if cur_e is not None else 0.0
            out[name] = {"calls": len(spans), "bytes": sum(s[2] for s in spans), "busy_s": sum(e - s for s, e, _ in spans),
                         "wall_s": union, "first_s": spans[0][0], "last_s": max(e for _, e, _ in spans)}
        return out


def instrument(ph: Phases, prefix: str = "") -> None:
    """Time this process's reads, writes, hashing, fsyncs and first imports of the heavy
    packages into ``ph`` (phase names after ``prefix``), wrapped from outside."""
    import hashlib
    import importlib.util

    for name in ("pread", "preadv", "copy_file_range", "sendfile"):
        if hasattr(os, name):
            setattr(os, name, ph.timing(prefix + name, getattr(os, name), count_result=True))
    for name in ("pwrite", "write"):
        setattr(os, name, ph.timing(prefix + name, getattr(os, name), count_result=True))
    os.fsync = ph.timing(prefix + "fsync", os.fsync)
    os.fdatasync = ph.timing(prefix + "fsync", os.fdatasync)
    os.replace = ph.timing(prefix + "rename", os.replace)
    real_sha = hashlib.sha256

    class TimedSha:
        def __init__(self, data=b"", **kw):
            self.h = real_sha(**kw)
            if data:
                self.update(data)

        def update(self, data):
            start = time.time()
            self.h.update(data)
            ph.add(prefix + "sha256", start, time.time(), memoryview(data).nbytes)

        def hexdigest(self):
            return self.h.hexdigest()

        def digest(self):
            return self.h.digest()

    hashlib.sha256 = TimedSha

    class ImportTimer:
        """Times the first import of the packages named (their whole import, dependencies included)."""
        watch = {"torch", "triton", "typer", "moetool.formats.registry", "tqdm"}

        def find_spec(self, name, path=None, target=None):
            if name not in self.watch:
                return None
            self.watch.discard(name)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def timed_exec(module, _exec=exec_module, _name=name):
                start = time.time()
                try:
                    _exec(module)
                finally:
                    ph.add(f"{prefix}import {_name}", start, time.time())
            spec.loader.exec_module = timed_exec
            return spec

    sys.meta_path.insert(0, ImportTimer())


#: the environment variable carrying the time (time.time()) the byte check's child was spawned
SPAWN_ENV = "MOETOOL_BENCH_CHECK_SPAWN"
#: the module a quantized byte-copy shard runs in its check child (moetool.convert.byte_executor)
CHECK_MODULE = "moetool.convert.byte_check"


def traced_check(trace_path: str, argv: list[str]) -> None:
    """The byte check's child (``python -m moetool.convert.byte_check ARGS``) with its start-up,
    imports, reads and planning timed; its raw spans go to ``trace_path`` for the parent's trace."""
    ph = Phases(float(os.environ.get(T0_ENV) or time.time()))
    ph.add("check: python start", float(os.environ.get(SPAWN_ENV) or ph.t0), time.time())
    instrument(ph, "check: ")
    start = time.time()
    import moetool.convert.byte_check as byte_check
    ph.add("check: import byte_check (torch, formats)", start, time.time())
    for attr, phase in (("open_checkpoint", "check: open checkpoint"), ("shard_facts", "check: shard_facts"),
                        ("format_profile", "check: the torch profile"), ("plan_facts", "check: the plan from it"),
                        ("build_shard_plan", "check: build the torch plan")):  # whichever this checkout has
        if hasattr(byte_check, attr):
            setattr(byte_check, attr, ph.timing(phase, getattr(byte_check, attr)))
    real_exit = byte_check.exit_now

    def exit_now(status: int) -> None:
        Path(trace_path).write_text(json.dumps(ph.spans))
        real_exit(status)

    byte_check.exit_now = exit_now
    sys.argv = [CHECK_MODULE, *argv]
    byte_check.main()


def traced_child(trace_path: str, argv: list[str]) -> None:
    """``moetool ARGV`` in this process with its reads, writes, hashing, fsyncs, imports, tensor
    reads and GPU conversions timed (wrapped from outside: the library is not changed); the
    per-phase summary goes to ``trace_path`` as JSON when the command ends. The child process of
    a quantized byte-copy shard's check runs under :func:`traced_check`; its phases are merged."""
    import subprocess as sp

    ph = Phases(float(os.environ.get(T0_ENV) or time.time()))
    ph.add("python start", ph.t0, time.time())
    instrument(ph)
    check_trace = Path(trace_path + ".check")
    check_trace.unlink(missing_ok=True)
    real_popen = sp.Popen

    class TracedPopen(real_popen):
        def __init__(self, args, *a, **k):
            if isinstance(args, list) and args[1:3] == ["-m", CHECK_MODULE]:
                args = [args[0], str(Path(__file__).resolve()), "--trace-check", str(check_trace), "--", *args[3:]]
                k["env"] = {**(k.get("env") or os.environ), SPAWN_ENV: repr(time.time())}
            super().__init__(args, *a, **k)

    sp.Popen = TracedPopen
    patched: set[str] = set()

    def patch_loaded() -> None:
        """Wrap library functions once their modules are loaded."""
        def wrap(module: str, owner: str, attr: str, phase: str, **kw) -> None:
            mod = sys.modules.get(module)
            key = f"{module}.{owner}.{attr}"
            if mod is None or key in patched:
                return
            obj = getattr(mod, owner) if owner else mod
            if hasattr(obj, attr):
                setattr(obj, attr, ph.timing(phase, getattr(obj, attr), **kw))
                patched.add(key)
        wrap("moetool.read.checkpoint", "Checkpoint", "_read", "read tensor (alloc + pread)")
        wrap("moetool.read.checkpoint", "", "open_checkpoint", "open checkpoint (headers)")
        wrap("moetool.convert.torch_executor", "Source", "convert", "convert (quantize one linear)")
        wrap("moetool.convert.torch_executor", "Planner", "specs", "plan (probe specs)")
        wrap("moetool.convert.output", "OutputDir", "commit", "commit (rename, journal)")
        wrap("moetool.convert.output", "OutputDir", "finish", "finish (manifest)")
        wrap("moetool.convert.output", "OutputDir", "already_done", "resume check")
        wrap("moetool.convert.sink", "HashingSink", "write", "sink.write (producer blocked)")
        wrap("moetool.convert.sink", "HashingSink", "close", "sink.close (drain + fsync)")
        for m in ("moetool.convert.sink", "moetool.convert.byte_executor"):
            wrap(m, "", "start_writeback", "sync_file_range")
        wrap("moetool.convert.byte_executor", "", "copy_files", "copy files (all)")
        wrap("moetool.convert.conversion", "", "build_plan", "build the plan (probes included)")
        wrap("moetool.convert.torch_executor", "Source", "ready", "wait for the GPU start-up")
        wrap("moetool.convert.byte_executor", "TorchCheck", "agrees", "check: parent waits for the answer")
        wrap("moetool.convert.byte_executor", "TorchCheck", "_expected", "check: parent reads its samples")
        wrap("moetool.convert.byte_executor", "TorchCheck", "_from_profile", "check: from the input's profile")
        wrap("moetool.convert.conversion", "", "_profile_entry", "profile of the output (manifest)")

    import moetool.lazy as lazy

    real_import = lazy.import_module

    def import_module(name):
        mod = real_import(name)
        patch_loaded()
        return mod

    lazy.import_module = import_module
    import moetool.__main__ as entry

    def dump() -> None:
        patch_loaded()
        ph.add("process end", time.time(), time.time())
        if check_trace.exists():
            for name, spans in json.loads(check_trace.read_text()).items():
                ph.spans.setdefault(name, []).extend(tuple(x) for x in spans)
            check_trace.unlink()
        Path(trace_path).write_text(json.dumps(ph.summary()))

    real_exit = entry.exit_now

    def exit_now():
        dump()
        real_exit()

    entry.exit_now = exit_now
    sys.argv = ["moetool", *argv]
    import moetool.cli  # noqa: F401  (loaded now so its modules' later imports are patched)

    patch_loaded()
    try:
        entry.entry()
    finally:
        dump()


def print_trace(name: str, trace: dict) -> None:
    """The phases of one step, on stderr (with the step's time: stdout keeps the table or JSON)."""
    out = sys.stderr
    print(f"  {name}: phases (s from the process start; busy = summed over threads, wall = covered)", file=out)
    print(f"    {'phase':<34} {'calls':>7} {'GB':>7} {'busy s':>8} {'wall s':>8} {'first':>7} {'last':>7} {'GB/s busy':>9}",
          file=out)
    for phase, r in trace.items():
        gbps = r["bytes"] / r["busy_s"] / 1e9 if r["bytes"] and r["busy_s"] else 0
        print(f"    {phase:<34} {r['calls']:>7} {r['bytes'] / 1e9:>7.2f} {r['busy_s']:>8.2f} {r['wall_s']:>8.2f} "
              f"{r['first_s']:>7.2f} {r['last_s']:>7.2f} {gbps or '':>9.3}", file=out)


# ------------------------------------------------------------------ I/O floors and alternatives

def io_probe(src: Path, scratch: Path, gib: float = 2.0) -> list[tuple[str, float, float]]:
    """The disk's and this CPU's floors, and the ways of copying a file: (what, seconds, GB/s).
    Every write ends with fsync (the durable copy conversion promises). Reads come from the
    page cache (the input was just written or read)."""
    import hashlib
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    scratch.mkdir(parents=True, exist_ok=True)
    files = sorted(src.glob("*.safetensors"))
    big = max(files, key=lambda f: f.stat().st_size)
    nbytes = min(big.stat().st_size, int(gib * 2**30)) // (16 << 20) * (16 << 20)
    rows: list[tuple[str, float, float]] = []

    def row(what: str, seconds: float, n: int = nbytes) -> None:
        rows.append((what, seconds, n / seconds / 1e9))
        print(f"  io: {what:<58} {seconds:6.2f} s {n / seconds / 1e9:6.2f} GB/s", file=sys.stderr)

    def run(what: str, fn, n: int = nbytes) -> None:
        dst = scratch / "probe.bin"
        dst.unlink(missing_ok=True)
        subprocess.run(["sync"])
        t0 = time.perf_counter()
        fn(dst)
        row(what, time.perf_counter() - t0, n)
        dst.unlink(missing_ok=True)

    total = sum(f.stat().st_size for f in files)
    t0 = time.perf_counter()
    subprocess.run(["sh", "-c", " ".join(f"cat '{f}' >/dev/null;" for f in files)])
    row("cat input > /dev/null (page cache)", time.perf_counter() - t0, total)
    data = memoryview(bytearray(os.urandom(1 << 20) * 256))  # 256 MiB
    t0 = time.perf_counter()
    h = hashlib.sha256()
    for _ in range(4):
        h.update(data)
    row("sha256, one thread", time.perf_counter() - t0, 4 * data.nbytes)
    for threads in (4, 8):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: [hashlib.sha256(data).digest() for _ in range(2)], range(threads)))
        row(f"sha256, {threads} threads (one file each)", time.perf_counter() - t0, threads * 2 * data.nbytes)

    def pread_write(chunk: int, hash_it: bool = False, writeback: bool = True):
        def go(dst: Path) -> None:
            fi, fo = os.open(big, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            buf = memoryview(bytearray(chunk))
            h = hashlib.sha256()
            flushed = 0
            for off in range(0, nbytes, chunk):
                n = os.preadv(fi, [buf], off)
                os.pwrite(fo, buf[:n], off)
                if hash_it:
                    h.update(buf[:n])
                if writeback and off + n - flushed >= 16 << 20:
                    os.sync_file_range(fo, flushed, off + n - flushed, os.SYNC_FILE_RANGE_WRITE) \
                        if hasattr(os, "sync_file_range") else None
                    flushed = off + n
            os.fsync(fo)
            os.close(fi), os.close(fo)
        return go

    def read_only(chunk: int):
        def go(dst: Path) -> None:
            fi = os.open(big, os.O_RDONLY)
            buf = memoryview(bytearray(chunk))
            for off in range(0, nbytes, chunk):
                os.preadv(fi, [buf], off)
            os.close(fi)
        return go

    def copy_range(step: int):
        def go(dst: Path) -> None:
            fi, fo = os.open(big, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            off = 0
            while off < nbytes:
                off += os.copy_file_range(fi, fo, min(step, nbytes - off), off, off)
            os.fsync(fo)
            os.close(fi), os.close(fo)
        return go

    def direct(chunk: int, threads: int):
        def go(dst: Path) -> None:
            fi = os.open(big, os.O_RDONLY)
            fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]

            def part(i: int) -> None:
                buf = memoryview(bufs[i])
                for off in range(i * chunk, nbytes, threads * chunk):
                    n = os.preadv(fi, [buf], off)
                    os.pwrite(fo, buf[:n], off)
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(part, range(threads)))
            os.fsync(fo)
            os.close(fi), os.close(fo)
        return go

    run("pread only, 1 MiB (page cache)", read_only(1 << 20))
    run("pread + pwrite 256 KiB + sync_file_range + fsync (byte copy)", pread_write(256 << 10))
    run("  same, + sha256 on the same thread", pread_write(256 << 10, hash_it=True))
    run("pread + pwrite 1 MiB + fsync", pread_write(1 << 20))
    run("pread + pwrite 8 MiB + fsync", pread_write(8 << 20))
    run("pread + pwrite 8 MiB, no sync_file_range, + fsync", pread_write(8 << 20, writeback=False))
    run("copy_file_range 64 MiB calls + fsync", copy_range(64 << 20))
    for chunk, threads in ((1 << 20, 1), (4 << 20, 1), (16 << 20, 1), (4 << 20, 4), (16 << 20, 4), (16 << 20, 8)):
        run(f"O_DIRECT pwrite {chunk >> 20} MiB x {threads} thread(s) + fsync", direct(chunk, threads))
    for args, what in ((["bs=8M", "conv=fsync"], "dd from /dev/zero bs=8M conv=fsync"),
                       (["bs=8M", "oflag=direct", "conv=fsync"], "dd from /dev/zero bs=8M oflag=direct")):
        run(what, lambda dst, args=args: subprocess.run(
            ["dd", "if=/dev/zero", f"of={dst}", f"count={nbytes >> 23}", *args], capture_output=True))
    return rows


def importable_checkout(path: Path) -> Path:
    """An --old checkout (a git archive of a commit, say), its ``moetool.formats`` and
    ``moetool.kernels`` linked into the package where they are not (``package-dir`` maps
    them only in an install)."""
    path = path.resolve()
    for sub in ("formats", "kernels"):
        link = path / "moetool" / sub
        if (path / sub).is_dir() and not link.exists():
            link.symlink_to(Path("..") / sub)
    return path


def main() -> None:
    if sys.argv[1:2] == ["--trace-child"]:
        traced_child(sys.argv[2], sys.argv[4:])  # --trace-child JSON -- moetool arguments
        return
    if sys.argv[1:2] == ["--trace-check"]:
        traced_check(sys.argv[2], sys.argv[4:])  # --trace-check JSON -- the byte check's arguments
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path(".bench/convert"))
    ap.add_argument("--size-gib", type=float, default=1.3)
    ap.add_argument("--shard-gib", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3584)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--only", default="", help="comma list of steps (cp, cat, start-up, start-up+torch, fp8-block, fp8-channel, int4-group, shard, repack, cp-fp8, cat-fp8, shard-fp8, llmc-*)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--llmc-python", default=sys.executable, help="python that has llmcompressor installed")
    ap.add_argument("--llmc-workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeat", type=int, default=3, help="runs per step; the table shows the median")
    ap.add_argument("--idle-wait", type=float, default=30.0,
                    help="before each run, wait up to this many seconds for the machine to be idle")
    ap.add_argument("--retries", type=int, default=2,
                    help="runs again (at most this often) a run during which other processes used the CPU")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace", action="store_true",
                    help="time each moetool step's phases (reads, writes, sha256, fsync, imports, conversion) and print them")
    ap.add_argument("--io-probe", action="store_true",
                    help="first measure the disk's and the CPU's floors and the ways of copying a file")
    ap.add_argument("--cold", action="store_true",
                    help="drop the page cache before each step (root only): reads come from the disk")
    ap.add_argument("--cold-input", action="store_true",
                    help="drop only the input's pages (and a kept fp8 output's) before each step: the checkpoint "
                         "comes from the disk, the tools' code from memory, as on a machine that ran python before")
    ap.add_argument("--ep", type=int, default=8, help="ranks of the shard step")
    ap.add_argument("--old", type=Path, nargs="*", default=[],
                    help="other checkouts (a git archive of a commit, say) whose moetool runs each moetool step "
                         "too, interleaved with this one's, as STEP@FOLDER (the same cp, the same run)")
    args = ap.parse_args()
    if args.cold and args.cold_input:
        ap.error("--cold drops the whole page cache; --cold-input only the input's: give one")
    args.workdir = args.workdir.resolve()  # --old steps run in their checkout's folder

    src = args.workdir / "src"
    params = [args.size_gib, args.shard_gib, args.hidden, args.intermediate, args.experts]
    params += [args.device] if args.device != "cpu" else []  # drawn on the GPU: other values
    marker = src / "bench-params.json"
    if not marker.exists() or json.loads(marker.read_text()).get("bench") != params:
        shutil.rmtree(src, ignore_errors=True)
        print(f"building a {args.size_gib} GiB synthetic checkpoint in {src} ...", file=sys.stderr)
        t0 = time.perf_counter()
        build_checkpoint(src, *params)
        print(f"  built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    in_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    only = set(filter(None, args.only.split(",")))
    moetool = [sys.executable, "-m", "moetool"]
    traces: dict[str, dict] = {}
    if args.trace:
        trace_file = args.workdir / "trace.json"
        moetool = [sys.executable, str(Path(__file__).resolve()), "--trace-child", str(trace_file), "--"]
    steps: list[tuple[str, list[str], Path, Path | None]] = []
    out = args.workdir / "out"
    if args.io_probe:
        io_probe(src, args.workdir / "probe")
    olds = [importable_checkout(p) for p in args.old]

    def add(name, cmd, dst, moetool_step=True):
        if only and name not in only:
            return
        steps.append((name, cmd, dst, None))
        for old in olds if moetool_step else ():  # the same step with an older checkout's moetool
            old_dst = dst.with_name(f"{dst.name}@{old.name}")
            steps.append((f"{name}@{old.name}", [str(old_dst) if c == str(dst) else c for c in cmd], old_dst, old))

    # the floor for a durable copy: moetool fsyncs every file it writes, so cp must sync too
    add("cp", ["sh", "-c", f"cp -r '{src}' '{out / 'cp'}' && sync"], out / "cp", False)
    add("cat", ["sh", "-c", f"cat '{src}'/*.safetensors > /dev/null"], out / "cat", False)  # the read floor
    add("start-up", moetool + ["--help"], out / "start-up")
    add("start-up+torch", [sys.executable, "-c", "import moetool.cli, moetool.lazy as l; l.freeze_imports = 1; l.import_module('moetool.convert.quantize')"],
        out / "start-up+torch")  # as `moetool quantize` imports it
    for fmt, flag in MOETOOL_FLAG.items():
        add(fmt, moetool + ["quantize", str(src), str(out / fmt), flag, "-q", "--device", args.device], out / fmt)
    add("shard", moetool + ["shard", str(src), str(out / "shard"), "--ep", str(args.ep), "-q"], out / "shard")
    add("repack", moetool + ["repack", str(src), str(out / "repack"), "--layout", "stacked", "-q"], out / "repack")
    # the fp8-block output (kept from its step) copied and sharded: a quantized input
    fp8 = out / "fp8-block"
    add("cp-fp8", ["sh", "-c", f"cp -r '{fp8}' '{out / 'cp-fp8'}' && sync"], out / "cp-fp8", False)
    add("cat-fp8", ["sh", "-c", f"cat '{fp8}'/*.safetensors > /dev/null"], out / "cat-fp8", False)
    add("shard-fp8", moetool + ["shard", str(fp8), str(out / "shard-fp8"), "--ep", "1", "-q"], out / "shard-fp8")
    if have_llmc(args.llmc_python):
        for fmt, scheme in LLMC_SCHEME.items():
            add(f"llmc-{fmt}", [args.llmc_python, "-c", LLMC_SCRIPT, str(src), str(out / f"llmc-{fmt}"), scheme,
                                str(args.llmc_workers)], out / f"llmc-{fmt}", False)
    else:
        print("llm-compressor not installed (--llmc-python): its rows are skipped", file=sys.stderr)

    names = {name for name, _, _, _ in steps}
    keep = {fp8} if {"cp-fp8", "cat-fp8", "shard-fp8"} & names else set()
    if keep and "fp8-block" not in names:
        raise SystemExit("cp-fp8, cat-fp8 and shard-fp8 read the fp8-block step's output: add fp8-block to --only")
    runs: dict[str, list[tuple[float, int, float]]] = {name: [] for name, _, _, _ in steps}
    repeated = 0
    for _ in range(args.repeat):  # interleaved, so drifting disk speed hits every step alike
        for name, cmd, dst, old in steps:
            # (shard-fp8@FOLDER shards this checkout's fp8-block output, whose profile is of other code)
            env = {"PYTHONPATH": str(old)} if old else None
            for attempt in range(args.retries + 1):
                shutil.rmtree(dst, ignore_errors=True)
                dst.parent.mkdir(parents=True, exist_ok=True)
                subprocess.run(["sync"])
                if args.cold:
                    Path("/proc/sys/vm/drop_caches").write_text("3\n")
                elif args.cold_input:
                    left = evict([f for d in (src, *keep) if d.is_dir() for f in d.glob("*.safetensors")])
                    if left is not None and left > 0.05:
                        print(f"  ({left:.0%} of the input's pages stayed cached)", file=sys.stderr)
                wait_idle(args.idle_wait)
                seconds, peak, foreign = timed(cmd, env=env, cwd=old)
                if args.trace and name.split("@")[0] not in ("cp", "cat", "cp-fp8", "cat-fp8") and trace_file.exists():
                    traces[name] = json.loads(trace_file.read_text())
                    trace_file.unlink()
                    print_trace(name, traces[name])
                if dst not in keep:
                    shutil.rmtree(dst, ignore_errors=True)
                # kernel writeback for the step itself: ~0.1 CPU-s for cp of this input
                disturbed = foreign > max(0.3, 0.05 * seconds)
                note = f" (other processes used {foreign:.2f} CPU-s meanwhile)" if disturbed else ""
                print(f"  {name}: {seconds:.2f} s{note}", file=sys.stderr)
                if not disturbed or attempt == args.retries:
                    break
                repeated += 1
            runs[name].append((seconds, peak, foreign))
        for dst in keep:
            shutil.rmtree(dst, ignore_errors=True)
    results = {}
    for name, rs in runs.items():
        seconds = statistics.median(r[0] for r in rs)
        results[name] = {"seconds": seconds, "gbps": in_bytes / seconds / 1e9, "trace": traces.get(name),
                         "peak_rss_mb": max(r[1] for r in rs) / 1e6, "runs": [round(r[0], 2) for r in rs],
                         "foreign_cpu_s": [round(r[2], 2) for r in rs]}

    cp = results.get("cp", {}).get("seconds")
    plain_startup = results.get("start-up", {}).get("seconds")
    rows = []
    for name, r in results.items():
        base, at, tag = name.partition("@")  # STEP@FOLDER: the step with an --old checkout's moetool
        llmc = results.get(f"llmc-{name}", {}).get("seconds")
        own_startup = results.get(f"start-up{at}{tag}", {}).get("seconds") or plain_startup
        own_torch = results.get(f"start-up+torch{at}{tag}", {}).get("seconds") or own_startup
        startup = own_torch if base in MOETOOL_FLAG else own_startup  # quantize imports torch
        work = (r["seconds"] - startup if startup and base not in ("cp", "start-up", "start-up+torch")
                and not name.startswith("llmc") else None)
        # a copy of its input
        floor = results.get("cp-fp8", {}).get("seconds") if base in ("shard-fp8", "cat-fp8") else cp
        rows.append({"step": name, **r, "vs_cp": (floor / r["seconds"]) if floor else None,
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
          f"{'after start-up s':>17} {'x cp':>6}  runs (s)")

    def fmt(v, spec=".2f"):
        return format(v, spec) if v else "-"

    for r in rows:
        print(f"{r['step']:<20} {r['seconds']:>8.2f} {r['gbps']:>6.2f} {fmt(r['vs_cp']):>6} {fmt(r['vs_llmc']):>7} "
              f"{r['peak_rss_mb']:>12.0f} {fmt(r['after_startup_s']):>17} {fmt(r['after_startup_vs_cp']):>6}  "
              f"{' / '.join(f'{x:.2f}' for x in r['runs'])}")


if __name__ == "__main__":
    main()
