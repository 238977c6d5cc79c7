"""``shard`` and ``repack`` as byte copies (moetool.convert.byte_plan / moetool.convert.byte_executor).

The criterion is bit-exact: every file the byte copy writes (safetensors, indexes, configs,
manifest) must be identical to what the torch executor writes for the same command
(``byte_copy=False``), and the byte copy must really have been used where the checkpoint
qualifies (the torch executor is disabled while it runs) and never where it does not.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetool.convert import byte_executor as bytecopy

from moetool.convert import torch_executor as convert
from moetool.model.families import describe
from moetool.convert.byte_plan import ByteFile, Span, coalesce, why_not_byte_copy
from moetool.read.checkpoint import open_checkpoint
from moetool.errors import MoetoolError
from moetool.convert.repack import repack
from moetool.convert.shard import shard
from moetool.read.manifest import JOURNAL_NAME, MANIFEST_NAME, verify_manifest
from moeutil import rewrite_file, tensor_files, tree_hashes


def run_both(kind: str, src: Path, tmp_path: Path, monkeypatch, **kw) -> tuple[dict, dict]:
    """(files of the byte copy, files of the torch executor) for one command."""
    fn = repack if kind == "repack" else shard
    args = ("stacked",) if kind == "repack" else (kw.pop("ep"),)
    if kind == "repack" and "layout" in kw:
        args = (kw.pop("layout"),)
    with monkeypatch.context() as m:
        m.setattr(convert, "run_plan", lambda *a, **k: pytest.fail("the torch executor ran"))
        fn(src, tmp_path / "bytes", *args, progress=False, **kw)
    fn(src, tmp_path / "torch", *args, progress=False, byte_copy=False, **kw)
    return tree_hashes(tmp_path / "bytes"), tree_hashes(tmp_path / "torch")


# ------------------------------------------------------------------------------ same bytes


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
@pytest.mark.parametrize("layout", ["stacked", "per-expert"])
def test_repack_same_bytes(tiny, tmp_path, monkeypatch, family, layout):
    src = tiny(family)
    before = tree_hashes(src)
    got, want = run_both("repack", src, tmp_path, monkeypatch, layout=layout)
    assert got == want
    assert tree_hashes(src) == before  # the input is never written


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
@pytest.mark.parametrize("layout", ["stacked", "per-expert"])
@pytest.mark.parametrize("ep", [1, 2, 3])
def test_shard_same_bytes(tiny, tmp_path, monkeypatch, family, layout, ep):
    """ep 3 over 4 or 8 experts: the last rank holds more (its headers differ from the others')."""
    src = tiny(family)
    got, want = run_both("shard", src, tmp_path, monkeypatch, ep=ep, layout=layout)
    assert got == want
    verify_manifest(tmp_path / "bytes")


def test_shard_options_same_bytes(tiny, tmp_path, monkeypatch):
    """Round-robin placement, redundant experts from a load file, a size limit per file."""
    src = tiny("mixtral", experts=8)
    load = tmp_path / "load.json"
    load.write_text(json.dumps({"layers": {"0": [5, 1, 1, 90, 1, 1, 1, 1], "1": [1] * 8}}))
    for i, kw in enumerate([dict(placement="round-robin"), dict(redundant=2, expert_load=load),
                            dict(max_shard_size=300_000)]):
        got, want = run_both("shard", src, tmp_path / str(i), monkeypatch, ep=4, **kw)
        assert got == want, kw


def test_stacked_source_same_bytes(tiny, tmp_path, monkeypatch):
    """A stacked checkpoint back to per-expert (rows [0, N) and [N, 2N) of each w13 slot) and sharded."""
    stacked = tmp_path / "stacked"
    repack(tiny("qwen2_moe"), stacked, "stacked", progress=False)
    got, want = run_both("repack", stacked, tmp_path / "a", monkeypatch, layout="per-expert")
    assert got == want
    got, want = run_both("shard", stacked, tmp_path / "b", monkeypatch, ep=2, layout="stacked")
    assert got == want


def test_repack_max_shard_size_same_bytes(tiny, tmp_path, monkeypatch):
    got, want = run_both("repack", tiny("mixtral"), tmp_path, monkeypatch, layout="stacked", max_shard_size=400_000)
    assert got == want and sum(n.endswith(".safetensors") for n in got) > 2


# ------------------------------------------------------------------------------ who takes what


def test_quantized_input_goes_to_torch(tiny, tmp_path):
    """An fp8 checkpoint is not a byte copy (its scales are cut per block): the torch executor
    repacks it, and says so by having run."""
    q = tmp_path / "q"
    from moetool.convert.quantize import quantize

    quantize(tiny("mixtral"), q, "fp8-block", progress=False)
    with open_checkpoint(q) as ck:
        assert why_not_byte_copy(ck, describe(ck.config, ck.tensors)) == "quantized checkpoint"
    r = repack(q, tmp_path / "r", "stacked", progress=False)
    assert r.out_format == "fp8-block" and r.files_written


def test_expert_unlike_expert_0_keeps_the_torch_error(tiny, copy_ckpt, cli, tmp_path):
    """An expert stored in another dtype: the byte copy declines, and the user sees the torch
    path's one-line error naming the tensor, before anything is written."""
    src = copy_ckpt(tiny("mixtral"))
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    rewrite_file(src / tensor_files(src)[name], lambda t: t.update({name: t[name].float()}))
    with open_checkpoint(src) as ck:
        assert "experts.2.w3.weight is F32" in why_not_byte_copy(ck, describe(ck.config, ck.tensors))
    r = cli("repack", src, tmp_path / "o", "--layout", "stacked", "-q")
    assert r.code == 2 and "experts.2.w3: tensors" in r.error_line and "differ from expert 0's" in r.error_line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_transformers_v5_fused_same_bytes(tiny, tmp_path, monkeypatch, family):
    """transformers v5's fused experts are the stacked layout under other names: a byte copy."""
    src = tiny(family, layout="v5")
    for layout in ("stacked", "per-expert"):
        got, want = run_both("repack", src, tmp_path / f"r-{layout}", monkeypatch, layout=layout)
        assert got == want
        got, want = run_both("shard", src, tmp_path / f"s-{layout}", monkeypatch, ep=3, layout=layout)
        assert got == want


@pytest.mark.parametrize("family, reason", [("llama4", "fused experts stored input-first"),
                                            ("gpt_oss", "fused experts stored input-first")])
def test_input_first_fused_experts_go_to_torch(tiny, tmp_path, family, reason):
    src = tiny(family)
    with open_checkpoint(src) as ck:
        assert why_not_byte_copy(ck, describe(ck.config, ck.tensors)).endswith(reason)
    if family == "llama4":
        assert repack(src, tmp_path / "a", "stacked", progress=False).files_written


# ------------------------------------------------------------------------------ resume, errors


def fail_on(monkeypatch, n: int):
    """Make the byte copy raise when it starts its n-th file (1-based), after the earlier ones."""
    orig = bytecopy._copy_file
    count = [0]

    def copy_file(f, *a, **k):
        count[0] += 1
        if count[0] == n:
            raise OSError(28, "No space left on device (test)")
        return orig(f, *a, **k)

    monkeypatch.setattr(bytecopy, "_copy_file", copy_file)


def test_byte_copy_resumes(tiny, tmp_path, monkeypatch):
    """A run that stops after some files leaves no manifest; the re-run skips the finished
    files (their sha256 still match) and the output equals the torch executor's."""
    src = tiny("mixtral")
    ref = tmp_path / "ref"
    shard(src, ref, 4, progress=False, byte_copy=False)
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        fail_on(m, 3)
        m.setattr(bytecopy, "default_workers", lambda: 1)  # files 1 and 2 finish, 3 fails, 4 never starts
        with pytest.raises(OSError):
            shard(src, out, 4, progress=False)
    assert not (out / MANIFEST_NAME).exists() and (out / JOURNAL_NAME).exists()
    assert len(json.loads((out / JOURNAL_NAME).read_text())["files"]) == 2
    summary = shard(src, out, 4, progress=False)
    n_files = sum(name.endswith(".safetensors") for name in json.loads((ref / MANIFEST_NAME).read_text())["files"])
    assert summary.files_skipped == 2 and summary.files_written == n_files - 2
    assert tree_hashes(out) == tree_hashes(ref)


def test_byte_copy_resumes_torch_output(tiny, tmp_path, monkeypatch):
    """The torch executor and the byte copy fingerprint the same plan alike: either resumes
    the other's finished files."""
    src = tiny("mixtral")
    ref = tmp_path / "ref"
    repack(src, ref, "stacked", progress=False, byte_copy=False)
    out = tmp_path / "out"
    orig = convert.OutputDir.write_safetensors
    calls = [0]

    def stop_second(self, *a, **k):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(28, "No space left on device (test)")
        return orig(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(convert.OutputDir, "write_safetensors", stop_second)
        m.setattr(convert, "usable_cores", lambda: 2)  # one file at a time (16 cores: 4 at once, none finished)
        with pytest.raises(OSError):
            repack(src, out, "stacked", progress=False, byte_copy=False)
    summary = repack(src, out, "stacked", progress=False)
    assert summary.files_skipped == 1 and summary.files_written == 1
    assert tree_hashes(out) == tree_hashes(ref)


def test_complete_output_needs_force(tiny, cli, tmp_path):
    src = tiny("mixtral")
    assert cli("shard", src, tmp_path / "o", "--ep", "2", "-q").code == 0
    r = cli("shard", src, tmp_path / "o", "--ep", "2", "-q")
    assert r.code == 2 and "already holds a complete output" in r.error_line
    assert cli("shard", src, tmp_path / "o", "--ep", "2", "-q", "--force").code == 0
    verify_manifest(tmp_path / "o")


def test_input_shrinking_while_copying_is_an_error(tmp_path):
    """A read past the end of an input file (changed under us) names the file."""
    (tmp_path / "a.safetensors").write_bytes(b"x" * 100)
    inputs = bytecopy._Inputs(tmp_path)
    try:
        with pytest.raises(MoetoolError, match=r"a\.safetensors: unexpected end of file at byte 100"):
            inputs.read_into("a.safetensors", 50, memoryview(bytearray(80)))
    finally:
        inputs.close()


# ------------------------------------------------------------------------------ the plan itself


def test_coalesce_merges_adjacent_spans_of_one_file():
    spans = [Span("a", 0, 10), Span("a", 10, 5), Span("b", 15, 5), Span("a", 15, 1), Span("a", 30, 0)]
    assert coalesce(spans) == [Span("a", 0, 15), Span("b", 15, 5), Span("a", 15, 1)]


@pytest.mark.parametrize("workers", [1, 2])
def test_copy_files_hashes_like_sha256(tmp_path, workers):
    """The executor's digests are the plain sha256 of each file (files sharing a prefix too)."""
    import hashlib
    import os

    from moetool.convert.output import OutputDir

    data = os.urandom(3 * bytecopy.CHUNK + 123)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x").write_bytes(data)
    prefix = [Span("x", 0, bytecopy.CHUNK + 7), Span("x", 5, 2 * bytecopy.CHUNK)]
    files = [ByteFile("a", b"hdr", prefix + [Span("x", 100, 50)]),
             ByteFile("b", b"hdr", prefix + [Span("x", 0, len(data))]),
             ByteFile("c", b"hdr", list(prefix)),
             ByteFile("d", b"other", prefix)]
    out = OutputDir(tmp_path / "out")
    assert bytecopy.copy_files(files, tmp_path / "in", out, workers=workers) == 4
    for f in files:
        body = f.header + b"".join(data[s.offset:s.offset + s.length] for s in f.spans)
        assert (tmp_path / "out" / f.name).read_bytes() == body
        assert out.records[f.name].sha256 == hashlib.sha256(body).hexdigest()
    assert not list((tmp_path / "out").glob("*.incomplete"))


@pytest.mark.parametrize("mode", ["direct", "plain", "refused", "tmpfs"])
def test_staged_copies_write_the_same_bytes_whatever_the_writes(tmp_path, monkeypatch, mode):
    """Files of many staging buffers and a partial last block, copied with direct writes,
    through the page cache ("plain", as on a machine of many cores; tmpfs where the kernel
    refuses O_DIRECT), and with every direct write refused (EINVAL, forced by a 1-byte
    alignment): the same bytes, the plain sha256, nothing left under a temporary name."""
    import hashlib
    import os
    import shutil
    import tempfile

    import moetool.convert.sink as sink
    from moetool.convert.output import OutputDir

    if mode == "tmpfs":
        if not os.access("/dev/shm", os.W_OK):
            pytest.skip("no writable /dev/shm")
        tmp_path = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        monkeypatch.setattr(sink, "DIRECT_STAGE", 3 * 4096)
        monkeypatch.setattr(bytecopy, "CHUNK", 5000)  # reads straddle the staging buffers
        monkeypatch.setattr(bytecopy, "direct_writes", lambda: mode != "plain")  # plain: a many-core machine
        if mode == "refused":
            monkeypatch.setattr(bytecopy, "DIRECT_ALIGN", 1)
        data = os.urandom(100_000)
        (tmp_path / "in").mkdir()
        (tmp_path / "in" / "x").write_bytes(data)
        files = [ByteFile("a", b"h" * 13, [Span("x", 7, 60_000), Span("x", 0, 40_000)]),
                 ByteFile("b", b"", [Span("x", 0, 3 * 4096)]),  # ends at a buffer's end
                 ByteFile("c", b"hdr", [])]
        out = OutputDir(tmp_path / "out")
        assert bytecopy.copy_files(files, tmp_path / "in", out, workers=2) == 3
        for f in files:
            body = f.header + b"".join(data[s.offset:s.offset + s.length] for s in f.spans)
            assert (tmp_path / "out" / f.name).read_bytes() == body
            assert out.records[f.name].sha256 == hashlib.sha256(body).hexdigest()
        assert not list((tmp_path / "out").glob("*.incomplete"))
        out.close()
    finally:
        if mode == "tmpfs":
            shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("direct", [True, False])
def test_a_failed_write_names_the_file_and_commits_nothing(tmp_path, monkeypatch, direct):
    """A write that fails (a full disk; direct: on the writing thread) stops the copy at its
    next buffer: the error names the file, the file stays under its temporary name, no thread
    is left."""
    import errno
    import os
    import threading

    import moetool.convert.sink as sink
    from moetool.convert.output import OutputDir

    monkeypatch.setattr(sink, "DIRECT_STAGE", 4096)
    monkeypatch.setattr(bytecopy, "CHUNK", 4096)
    monkeypatch.setattr(bytecopy, "direct_writes", lambda: direct)
    writes = []

    def pwrite_all(fd, view, offset, path=None):
        writes.append(offset)
        if len(writes) == 3:
            raise sink.naming_file(OSError(errno.ENOSPC, "No space left on device"), path)
        os.pwrite(fd, view, offset)

    monkeypatch.setattr(bytecopy, "pwrite_all", pwrite_all)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x").write_bytes(os.urandom(200_000))
    out = OutputDir(tmp_path / "out")
    before = threading.active_count()
    with pytest.raises(OSError, match="No space") as e:
        bytecopy.copy_files([ByteFile("a", b"", [Span("x", 0, 200_000)])], tmp_path / "in", out, workers=1)
    assert e.value.filename == str(tmp_path / "out" / "a.incomplete")
    assert len(writes) < 200_000 // 4096  # stopped early
    assert threading.active_count() == before
    assert not (tmp_path / "out" / "a").exists() and (tmp_path / "out" / "a.incomplete").exists()
    out.close()


def test_torch_stays_importable_lazily():
    """Library modules on the byte-copy path import without torch (checked in a fresh process)."""
    code = ("import sys\nimport moetool.cli, moetool.convert.shard, moetool.convert.repack, moetool.convert.byte_executor, moetool.read.checkpoint\n"
            "assert 'torch' not in sys.modules\n"
            "from moetool.read.safetensors import DTYPES\nimport torch\nassert DTYPES['BF16'] is torch.bfloat16\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert torch.bfloat16  # the test process itself has torch


def test_failure_stops_the_files_in_flight(tmp_path, monkeypatch):
    """A file that fails stops the other files being copied at their next chunk (as Ctrl-C
    does): the error surfaces without waiting for whole files, and none of them is committed."""
    import os
    import threading
    import time

    from moetool.convert.output import OutputDir

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x").write_bytes(os.urandom(16 * bytecopy.CHUNK))
    b_failed = threading.Event()
    orig = bytecopy._Inputs.read_into

    def read_into(self, file, offset, view):
        if file == "missing":
            b_failed.set()
        elif offset >= bytecopy.CHUNK:  # a's second chunk: after b has failed
            assert b_failed.wait(10)
            time.sleep(0.05)
        return orig(self, file, offset, view)

    monkeypatch.setattr(bytecopy._Inputs, "read_into", read_into)
    files = [ByteFile("a", b"h", [Span("x", 0, 16 * bytecopy.CHUNK)]), ByteFile("b", b"h", [Span("missing", 0, 8)])]
    out = OutputDir(tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="missing"):  # b's own error, not a's stop
        bytecopy.copy_files(files, tmp_path / "in", out, workers=2)
    assert out.records == {} and not (tmp_path / "out" / "a").exists()


def test_output_that_cannot_be_opened_leaves_no_thread(tmp_path):
    """An output file that cannot be created raises its OSError and leaves no hashing thread behind."""
    import threading
    import time

    from moetool.convert.output import OutputDir

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x").write_bytes(b"z" * 64)
    out = OutputDir(tmp_path / "out")
    (tmp_path / "out" / "a.incomplete").mkdir()  # open() of the temporary name fails

    # threads of earlier tests may still be ending: only hashing threads started here count
    before = {t for t in threading.enumerate() if t.name == "moetool-hash"}

    def new_hashers() -> list:
        return [t for t in threading.enumerate() if t.name == "moetool-hash" and t not in before]

    with pytest.raises(IsADirectoryError):
        bytecopy.copy_files([ByteFile("a", b"h", [Span("x", 0, 8)])], tmp_path / "in", out, workers=1)
    deadline = time.monotonic() + 2
    while new_hashers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not new_hashers()


def test_progress_counts_resumed_files_like_written_ones(tmp_path):
    """The progress total is the plan's tensor bytes: a file skipped on resume counts what
    copying it counts (its data, not its header)."""
    from moetool.convert.output import OutputDir

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x").write_bytes(bytes(range(256)) * 8)
    files = [ByteFile("a", b"header-a", [Span("x", 0, 1000)]), ByteFile("b", b"header-b", [Span("x", 7, 900)])]
    counted = []
    for run in range(2):
        n = [0]
        with OutputDir(tmp_path / "out", plan_id="p") as out:
            bytecopy.copy_files(files, tmp_path / "in", out, workers=1, on_bytes=lambda k: n.__setitem__(0, n[0] + k))
        counted.append(n[0])
    assert counted == [1900, 1900]


@pytest.mark.parametrize("command", ["shard", "quantize"])
def test_an_error_while_writing_is_printed_after_the_bar_is_cleared(tiny, cli, tmp_path, monkeypatch, command):
    """A disk filling up mid-file: the progress bar's clearing (``\\r`` spaces ``\\r``) came
    after shard's error line, so a terminal erased the error it had just shown."""
    import errno
    import os

    src = tiny("mixtral")
    real = os.pwrite

    def full(fd, data, offset):  # the data files' writes only (the lock's owner line goes on)
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors.incomplete"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    args = ["--ep", "2"] if command == "shard" else ["--fp8-block"]
    r = cli(command, src, tmp_path / "out", *args)
    assert r.code == 2
    shown = r.err.rstrip("\n").split("\n")[-1].split("\r")[-1]  # what a terminal shows on the last line
    assert shown.startswith("error: ") and "No space left on device" in shown, repr(r.err[-300:])
