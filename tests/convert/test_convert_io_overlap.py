"""Conversion at disk speed: quantized checkpoints sharded as byte copies (checked against the
torch executor's plan), files written several at a time, the GPU's start-up and the input's
first reads off the critical path.

The criterion is bit-exact: whichever executor, however many files at once, every file written
is the one the torch executor writes one file at a time (``byte_copy=False``).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moetool.convert import byte_executor as bytecopy
from moetool.convert import conversion
from moetool.convert import torch_executor as executor
from moetool.convert.byte_plan import why_not_byte_copy
from moetool.convert.profile import PROFILE_KEY, sealed, stored_profile
from moetool.convert.quantize import quantize
from moetool.convert.shard import shard
from moetool.model.families import describe
from moetool.read.checkpoint import open_checkpoint
from moetool.read.prefetch import prefetch
from moetool.read.manifest import MANIFEST_NAME, verify_manifest
from moeutil import bench_module, tree_hashes, wait_gone


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny):
    """quantized(fmt, layout="per-expert", family="mixtral", **kw) -> a quantize output (made once)."""
    root = tmp_path_factory.mktemp("quantized")
    made: dict = {}

    def get(fmt: str, layout: str = "per-expert", family: str = "mixtral", intermediate: int = 192, **kw) -> Path:
        key = (fmt, layout, family, intermediate, tuple(sorted(kw.items())))
        if key not in made:
            out = root / f"q{len(made)}"
            quantize(tiny(family, intermediate=intermediate), out, fmt, layout=layout, progress=False, **kw)
            made[key] = out
        return made[key]

    return get


def shard_both(src: Path, tmp_path: Path, monkeypatch, *, byte_copy_expected: bool, **kw) -> tuple[dict, dict]:
    """(files of ``shard``, files of the torch executor's shard, one file at a time); the torch
    executor must not run in the first where ``byte_copy_expected``."""
    ep = kw.pop("ep", 2)
    with monkeypatch.context() as m:
        if byte_copy_expected:
            m.setattr(conversion, "shard_checkpoint", lambda *a, **k: pytest.fail("the torch executor ran"))
        shard(src, tmp_path / "bytes", ep, progress=False, **kw)
    with monkeypatch.context() as m:
        m.setattr(executor, "files_at_once", lambda cores=None: 1)
        shard(src, tmp_path / "torch", ep, progress=False, byte_copy=False, **kw)
    return tree_hashes(tmp_path / "bytes"), tree_hashes(tmp_path / "torch")


# ------------------------------------------------------------------------------ quantized shards by byte copy


@pytest.mark.parametrize("fmt, kw", [("fp8-block", {}), ("fp8-block", {"intermediate": 256}), ("fp8-channel", {}),
                                     ("mxfp4", {}), ("int4-group", {"group_size": 64})])
@pytest.mark.parametrize("layout", ["stacked", "per-expert"])
def test_quantized_shard_is_a_byte_copy_of_the_same_bytes(quantized, tmp_path, monkeypatch, fmt, kw, layout):
    """Per-expert quantized experts (N = 192: fp8 block scales of two 192-row halves stacked as
    they are) to stacked or per-expert EP shards; int4's per-linear weight_shape is not cut
    along rows, so its stacked shard stays with the torch executor."""
    src = quantized(fmt, **kw)
    expected = not (fmt == "int4-group" and layout == "stacked")
    with open_checkpoint(src) as ck:
        reason = why_not_byte_copy(ck, describe(ck.config, ck.tensors), quantized=True, layout=layout)
    assert (reason is None) == expected, reason
    got, want = shard_both(src, tmp_path, monkeypatch, byte_copy_expected=expected, layout=layout)
    assert got == want
    verify_manifest(tmp_path / "bytes")


def test_stacked_quantized_checkpoint_shards_stacked_by_byte_copy(quantized, tmp_path, monkeypatch):
    src = quantized("fp8-block", layout="stacked")
    got, want = shard_both(src, tmp_path, monkeypatch, byte_copy_expected=True, layout="stacked", ep=3)
    assert got == want
    with open_checkpoint(src) as ck:  # cut per expert: the format's split_rows, the torch executor's job
        assert "cut per expert" in why_not_byte_copy(ck, describe(ck.config, ck.tensors), quantized=True,
                                                     layout="per-expert")


def test_disagreeing_check_leaves_the_shard_to_torch(quantized, tmp_path, monkeypatch):
    """A stacked int4 shard planned as a byte copy all the same (its weight_shape let through as
    rows): the torch check disagrees (a [4] weight_shape against its [2]) and the torch executor
    writes the shard, the same bytes as alone, no copy left behind."""
    q = quantized("int4-group", group_size=64)
    monkeypatch.setattr(bytecopy, "why_not_byte_copy", lambda *a, **k: None)
    ran = []
    real = conversion.shard_checkpoint
    monkeypatch.setattr(conversion, "shard_checkpoint", lambda *a, **k: ran.append(1) or real(*a, **k))
    shard(q, tmp_path / "out", 2, progress=False)
    assert ran
    monkeypatch.undo()
    shard(q, tmp_path / "ref", 2, progress=False, byte_copy=False)
    assert tree_hashes(tmp_path / "out") == tree_hashes(tmp_path / "ref")


def test_check_in_a_child_process_commits_after_it_agrees(quantized, tmp_path, monkeypatch):
    """Without torch loaded nor a profile the check runs in a child process while the files are
    copied; no file has its final name before it answers, and the output is the torch executor's."""
    src = quantized("fp8-block")
    monkeypatch.setattr(bytecopy, "torch_loaded", lambda: False)
    monkeypatch.setattr(bytecopy, "stored_profile", lambda ckpt: None)
    seen = []
    real_agrees = bytecopy.TorchCheck.agrees

    def agrees(self):
        seen.append(sorted(p.name for p in (tmp_path / "bytes").rglob("*.safetensors")))
        assert self.proc is not None or self._answer is not None
        return real_agrees(self)

    monkeypatch.setattr(bytecopy.TorchCheck, "agrees", agrees)
    got, want = shard_both(src, tmp_path, monkeypatch, byte_copy_expected=True)
    assert seen and seen[0] == []  # nothing committed while the check ran
    assert got == want


def test_failed_copy_stops_the_check_and_commits_nothing(quantized, tmp_path, monkeypatch):
    src = quantized("fp8-block")
    monkeypatch.setattr(bytecopy, "torch_loaded", lambda: False)
    monkeypatch.setattr(bytecopy, "stored_profile", lambda ckpt: None)
    checks = []
    real_init = bytecopy.TorchCheck.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        checks.append(self)

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bytecopy.TorchCheck, "__init__", init)
    monkeypatch.setattr(bytecopy, "_copy_file", fail)
    with pytest.raises(OSError, match="No space"):
        shard(src, tmp_path / "out", 2, progress=False)
    assert checks and checks[0].proc is None  # killed and reaped
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
    assert not list((tmp_path / "out").rglob("*.safetensors"))


@pytest.mark.parametrize("fmt, kw", [("fp8-block", {}), ("fp8-block", {"intermediate": 256}), ("mxfp4", {}),
                                     ("int4-group", {"group_size": 64})])
@pytest.mark.parametrize("layout", ["stacked", "per-expert"])
def test_quantize_output_profile_checks_its_shard_without_torch(quantized, tmp_path, monkeypatch, fmt, kw, layout):
    """A quantize output's manifest holds the torch executor's profile of it: its shard's check
    is answered from it, no child process, no torch, and the files are the torch executor's."""
    src = quantized(fmt, **kw)
    if fmt == "int4-group" and layout == "stacked":
        pytest.skip("int4 stacked shards are the torch executor's")
    assert json.loads((src / MANIFEST_NAME).read_text())[PROFILE_KEY]["format"] == fmt
    monkeypatch.setattr(bytecopy, "torch_loaded", lambda: False)
    monkeypatch.setattr(bytecopy.subprocess, "Popen", lambda *a, **k: pytest.fail("a check process ran"))
    got, want = shard_both(src, tmp_path, monkeypatch, byte_copy_expected=True, layout=layout, ep=3)
    assert got == want


def edit_profile(src: Path, dst: Path, edit, seal: bool = True) -> Path:
    """A copy of ``src`` whose manifest's profile ``edit`` changed in place (``seal``: its
    digest made again, as if the torch executor had said so)."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    edit(manifest[PROFILE_KEY])
    if seal:
        manifest[PROFILE_KEY] = sealed(manifest[PROFILE_KEY])
    (dst / MANIFEST_NAME).write_text(json.dumps(manifest))
    return dst


def w13_key(profile: dict) -> str:
    return next(k for k in profile["linears"] if k.endswith(":w13"))


@pytest.mark.parametrize("what", ["spec", "sample"])
def test_profile_that_disagrees_leaves_the_shard_to_torch(quantized, tmp_path, monkeypatch, what):
    """A profile whose facts are not the byte plan's (a w13 scale's shape, a sampled slice's
    bytes) fails the check: the torch executor writes the shard, no copy is kept."""
    def edit(profile):
        if what == "spec":
            profile["linears"][w13_key(profile)][1][2][0] += 1
        else:
            profile["samples"][w13_key(profile)][0] = "0" * 64

    src = edit_profile(quantized("fp8-block"), tmp_path / "src", edit)
    with open_checkpoint(src) as ck:
        assert stored_profile(ck) is not None
    monkeypatch.setattr(bytecopy, "torch_loaded", lambda: False)
    monkeypatch.setattr(bytecopy.subprocess, "Popen", lambda *a, **k: pytest.fail("a check process ran"))
    ran = []
    real = conversion.shard_checkpoint
    monkeypatch.setattr(conversion, "shard_checkpoint", lambda *a, **k: ran.append(1) or real(*a, **k))
    shard(src, tmp_path / "out", 2, progress=False, layout="stacked")
    assert ran
    monkeypatch.undo()
    shard(src, tmp_path / "ref", 2, progress=False, byte_copy=False, layout="stacked")
    assert tree_hashes(tmp_path / "out") == tree_hashes(tmp_path / "ref")


@pytest.mark.parametrize("what", ["code", "inputs", "format", "unsealed"])
def test_profile_of_other_code_or_files_is_ignored(quantized, tmp_path, monkeypatch, what):
    """A profile made by other moetool code, of other headers (a file rewritten since), naming
    another format than the manifest, or edited without its digest, is not used: the check
    runs as without one."""
    def edit(profile):
        if what == "format":
            profile["format"] = "fp8-channel"
        elif what == "unsealed":
            profile["samples"][w13_key(profile)][0] = "0" * 64
        else:
            profile[what] = "0" * 64

    src = edit_profile(quantized("fp8-block"), tmp_path / "src", edit, seal=what != "unsealed")
    with open_checkpoint(src) as ck:
        assert stored_profile(ck) is None
    monkeypatch.setattr(bytecopy, "torch_loaded", lambda: False)
    spawned = []
    real_popen = bytecopy.subprocess.Popen
    monkeypatch.setattr(bytecopy.subprocess, "Popen", lambda *a, **k: spawned.append(1) or real_popen(*a, **k))
    got, want = shard_both(src, tmp_path, monkeypatch, byte_copy_expected=True)
    assert spawned and got == want


def test_check_process_loads_what_the_byte_copy_does_not(quantized, tmp_path):
    """The byte copy itself never imports torch: a shard of a quantized checkpoint in a fresh
    process ends without torch loaded there, its output complete."""
    src = quantized("fp8-block")
    code = ("import sys\nfrom moetool.convert.shard import shard\n"
            f"shard({str(src)!r}, {str(tmp_path / 'out')!r}, 2, progress=False)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    verify_manifest(tmp_path / "out")


# ------------------------------------------------------------------------------ files at once


def test_files_at_once_and_threads_by_cores():
    assert [executor.files_at_once(c) for c in (1, 2, 7, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]
    assert executor.converting_threads(1, "cpu", 2) == 2 and executor.converting_threads(4, "cpu", 16) == 4
    assert executor.converting_threads(4, "cuda", 16) == 2 and executor.converting_threads(2, "cpu", 3) == 1


@pytest.mark.parametrize("fmt", ["fp8-block", "int4-group"])
def test_several_files_at_once_write_the_same_bytes(tiny, tmp_path, monkeypatch, fmt):
    src = tiny("deepseek_v3", shards=3)
    monkeypatch.setattr(executor, "files_at_once", lambda cores=None: 3)
    quantize(src, tmp_path / "three", fmt, progress=False, max_shard_size=200_000)
    monkeypatch.setattr(executor, "files_at_once", lambda cores=None: 1)
    quantize(src, tmp_path / "one", fmt, progress=False, max_shard_size=200_000)
    got = tree_hashes(tmp_path / "three")
    assert got == tree_hashes(tmp_path / "one") and sum(n.endswith(".safetensors") for n in got) > 3


def test_a_failed_file_stops_the_others_and_leaves_the_output_unfinished(tiny, tmp_path, monkeypatch):
    src = tiny("deepseek_v3", shards=3)
    monkeypatch.setattr(executor, "files_at_once", lambda cores=None: 3)
    real = executor.Source.convert
    calls = []

    def convert(self, lin, where, in_fmt=None):
        calls.append(where)
        if len(calls) == 10:
            raise executor.MoetoolError(f"{where}: injected")
        return real(self, lin, where, in_fmt)

    monkeypatch.setattr(executor.Source, "convert", convert)
    with pytest.raises(executor.MoetoolError, match="injected"):
        quantize(src, tmp_path / "out", "fp8-block", progress=False, max_shard_size=200_000)
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
    assert len(calls) < 60  # the other files stopped instead of converting everything


# ------------------------------------------------------------------------------ start-up


def test_probes_run_on_the_cpu_and_restore_the_device(tiny):
    import torch

    with open_checkpoint(tiny("mixtral")) as ck:
        src = executor.Source(ck, describe(ck.config, ck.tensors), None, executor.ErrorStats())
        src.device, ck.pin_memory = torch.device("meta"), True  # stand-ins for cuda and pinned reads
        with src.on_cpu():
            assert src.device.type == "cpu" and not ck.pin_memory
        assert src.device.type == "meta" and ck.pin_memory
        src.ready()  # no GPU start-up to wait for


def test_prefetch_reads_the_source_named_after_quantize(tiny, tmp_path, monkeypatch):
    from moetool.cli import quantize as cli_quantize

    src = tiny("mixtral")
    thread = prefetch(src)
    thread.join(10)
    assert not thread.is_alive()
    assert prefetch(tmp_path / "missing") is None
    asked = []
    monkeypatch.setattr(cli_quantize, "prefetch", lambda path, idle=False, after=None, in_child=False:
                        asked.append((path, idle, after, in_child)))
    cli_quantize._prefetch_source(["quantize", "--format", "fp8-block", str(src), str(tmp_path / "out")])
    cli_quantize._prefetch_source(["shard", str(src), str(tmp_path / "out")])
    assert asked == [(src, True, None, True)]  # behind the import's reads, in a child process

    class Warm:  # a code warm-up under way: the source's reads start at its end
        def wait(self, timeout=None):
            return True

    from moetool.read import code_files

    warm = Warm()
    monkeypatch.setattr(code_files, "_warming", warm)
    cli_quantize._prefetch_source(["quantize", str(src), str(tmp_path / "out")])
    assert asked[1] == (src, True, warm, True)


def _files(folder: Path, sizes=(3 << 20, 1 << 20)) -> list[Path]:
    folder.mkdir(exist_ok=True)
    files = [folder / f"model-{i}.safetensors" for i in range(len(sizes))]
    for f, size in zip(files, sizes):
        f.write_bytes(os.urandom(size))
    return files


def _wait_until_polling(pid: int, seconds: float = 30.0) -> None:
    """Until process ``pid`` sleeps in poll() (its /proc wchan), where a read-ahead child waits
    for the warm-up: past its start and its check of the parent. Where the kernel does not say
    (wchan "0"), a fixed 1.5 s."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            wchan = Path(f"/proc/{pid}/wchan").read_text()
        except OSError:
            wchan = "0"
        if wchan in ("", "0"):
            time.sleep(1.5)
            return
        if "poll" in wchan:
            return
        time.sleep(0.02)
    pytest.fail(f"process {pid} never waited in poll()")


class _Sleeper:
    """A process to wait for, as the code warm-up's child: ``pid`` and ``wait``."""

    def __init__(self, seconds: float):
        self.proc = subprocess.Popen(["sleep", str(seconds)])
        self.pid = self.proc.pid

    def wait(self, timeout=None) -> bool:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfd_open: Linux 5.3 and later")
def test_child_read_ahead_waits_for_the_warm_up_then_fills_the_cache(tmp_path, monkeypatch):
    """quantize's read-ahead runs in a child process (no GIL of the importing parent to wait
    for): nothing is read while the code warm-up runs, every page once it has ended."""
    from moetool.read import prefetch as pf

    cache = bench_module("convert")  # evict, cached_share (mincore: asks without reading)
    files = _files(tmp_path / "src")
    if cache.evict(files) != 0.0:
        pytest.skip("this file system keeps the pages (or mincore is missing)")
    monkeypatch.setattr(pf, "_started", {})
    warm = _Sleeper(60)
    try:
        reader = pf.prefetch(tmp_path / "src", idle=True, after=warm, in_child=True)
        assert isinstance(reader, pf.ChildReadAhead) and pf.prefetch(tmp_path / "src") is reader  # once per folder
        _wait_until_polling(reader.pid)
        time.sleep(0.2)
        assert reader.is_alive() and cache.cached_share(files) == 0.0
    finally:
        warm.proc.kill()
        warm.proc.wait()
    reader.join(30)
    assert not reader.is_alive() and cache.cached_share(files) == 1.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
def test_child_read_ahead_dies_with_the_command(tmp_path):
    """A command that ends (Ctrl-C, a refusal, SIGKILL) takes its read-ahead child along: one
    waiting on a warm-up that never ends is gone soon after its parent."""
    _files(tmp_path / "src")
    warm = _Sleeper(120)
    code = ("import os, sys; from pathlib import Path; from moetool.read import prefetch as pf\n"
            "class W:\n    pid = int(sys.argv[2])\n    def wait(self, timeout=None): return False\n"
            "r = pf.prefetch(Path(sys.argv[1]), after=W(), in_child=True)\n"
            "print(type(r).__name__, r.pid, flush=True); sys.stdin.read(); os._exit(0)")
    try:
        command = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "src"), str(warm.pid)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        kind, pid = command.stdout.readline().split()
        assert kind == "ChildReadAhead"
        _wait_until_polling(int(pid))  # past its check that the parent is there: only the death signal is left
        command.stdin.close()  # the command ends
        assert command.wait(30) == 0
        assert wait_gone([int(pid)], 5.0) == [], f"the read-ahead child {pid} outlived its command by 5 s"
    finally:
        warm.proc.kill()
        warm.proc.wait()


def test_read_ahead_stays_on_a_thread_where_no_child_can_wait(tmp_path, monkeypatch):
    """Without pidfd_open (not Linux, an old kernel) the read-ahead is the thread it was."""
    import threading

    from moetool.read import prefetch as pf

    def no_pidfd(pid):
        raise OSError(38, "Function not implemented")

    _files(tmp_path / "src")
    monkeypatch.setattr(pf, "_started", {})
    monkeypatch.setattr(pf.os, "pidfd_open", no_pidfd, raising=False)
    warm = _Sleeper(60)
    try:
        reader = pf.prefetch(tmp_path / "src", after=warm, in_child=True)
        assert isinstance(reader, threading.Thread)
        time.sleep(0.2)
        assert reader.is_alive()  # waiting for the warm-up, on the thread
    finally:
        warm.proc.kill()
        warm.proc.wait()
    reader.join(30)
    assert not reader.is_alive()


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64", reason="ioprio_get")
def test_idle_read_ahead_runs_at_the_idle_io_priority():
    """The read-ahead quantize asks for before importing torch reads in the idle I/O class
    (``ioprio_get`` of its thread: class 3 in bits 13 and up); this thread is left as it was."""
    import ctypes
    import threading

    from moetool.read import prefetch as pf

    def ioprio() -> int:
        return ctypes.CDLL(None).syscall(252, 1, 0)  # ioprio_get(IOPRIO_WHO_PROCESS, this thread)

    before, got = ioprio(), []
    thread = threading.Thread(target=lambda: got.append((pf.idle_io_priority(), ioprio() >> 13)))
    thread.start()
    thread.join()
    assert got == [(True, 3)] and ioprio() == before


def test_prefetch_reads_each_folder_once(tiny, monkeypatch):
    """A folder asked for twice is read once (quantize's command asks, then its library)."""
    from moetool.read import prefetch as pf

    src = tiny("mixtral", shards=2)
    read = []
    monkeypatch.setattr(pf, "_started", {})
    monkeypatch.setattr(pf, "read_ahead_ranges",
                        lambda ranges, budget, **kw: read.append([r[0] for r in ranges]) or None)
    pf.prefetch(src)
    pf.prefetch(src)
    assert read == [sorted(Path(src).resolve().glob("*.safetensors"))]


def test_probes_ahead_give_the_probes_one_by_one(tiny, monkeypatch):
    """Parallel probes fill the planner's cache with what sequential probing finds; a probe
    that fails is left out, for ``specs`` to raise in plan order."""
    from moetool.formats import get_format

    with open_checkpoint(tiny("deepseek_v3")) as ck:
        spec = describe(ck.config, ck.tensors)
        src = executor.Source(ck, spec, get_format("fp8-block"), executor.ErrorStats())
        ahead, one_by_one = executor.Planner([src]), executor.Planner([src])
        ahead.probe_ahead(("gate", "up", "down"))
        layer = spec.moe_layers[0]
        assert ahead._probe_cache == {
            one_by_one._probe_key(0, layer, w): one_by_one._probe(0, layer, w) for w in ("gate", "up", "down")}
        real = executor.Planner._probe_linear

        def failing(src, layer, what):
            if what == "down":
                raise executor.MoetoolError("down: injected")
            return real(src, layer, what)

        monkeypatch.setattr(executor.Planner, "_probe_linear", staticmethod(failing))
        partial = executor.Planner([src])
        partial.probe_ahead(("gate", "up", "down"))
        assert len(partial._probe_cache) == 2 and src.stats.count == 0


@pytest.mark.parametrize("where", ["profile", "profile and manifest"])
def test_profile_with_other_format_params_is_refused(quantized, tmp_path, monkeypatch, where):
    """A re-sealed profile whose format parameters are not those the input declares (its
    manifest's, config.json's quantization_config) is not used: the shard's manifest gives the
    input's group size, as the torch executor's does, not the profile's."""
    def edit(profile):
        profile["format_params"]["group_size"] = 32

    src = edit_profile(quantized("int4-group", group_size=64), tmp_path / "src", edit)
    if where == "profile and manifest":
        manifest = json.loads((src / MANIFEST_NAME).read_text())
        manifest["format_params"] = manifest[PROFILE_KEY]["format_params"]  # a shard's manifest has them
        (src / MANIFEST_NAME).write_text(json.dumps(manifest))
    with open_checkpoint(src) as ck:
        assert stored_profile(ck) is None
    shard(src, tmp_path / "out", 2, progress=False, layout="per-expert")
    assert json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())["format_params"]["group_size"] == 64
    shard(src, tmp_path / "ref", 2, progress=False, byte_copy=False, layout="per-expert")
    assert tree_hashes(tmp_path / "out") == tree_hashes(tmp_path / "ref")


@pytest.mark.parametrize("what", ["layers", "linears", "samples"])
def test_malformed_profile_leaves_the_check_to_torch(quantized, tmp_path, what):
    """A sealed profile of the wrong shape (a list where a mapping belongs) never crashes
    shard: the check runs as without one."""
    def edit(profile):
        profile[what] = list(profile[what]) if isinstance(profile[what], dict) else [profile[what]]

    src = edit_profile(quantized("fp8-block"), tmp_path / "src", edit)
    shard(src, tmp_path / "out", 2, progress=False, layout="stacked")
    shard(src, tmp_path / "ref", 2, progress=False, byte_copy=False, layout="stacked")
    assert tree_hashes(tmp_path / "out") == tree_hashes(tmp_path / "ref")
