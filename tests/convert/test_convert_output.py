"""The streaming safetensors writer and atomic, resumable output folders."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from moetool.read.checkpoint import open_checkpoint
from moetool.read.safetensors import DTYPES, read_safetensors_header
from moetool.errors import MoetoolError
from moetool.convert.output import OutputDir
from moetool.read.manifest import INCOMPLETE, JOURNAL_NAME, MANIFEST_NAME, sha256_file, verify_manifest
from moetool.read.safetensors import TensorSpec, tensor_bytes
from moeutil import bit_equal


def specs_of(tensors: dict) -> list[TensorSpec]:
    return [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=torch.int64).to(dtype)


def test_every_allowed_dtype_round_trips(tmp_path):
    tensors = {f"t_{name}": sample(dt) for name, dt in DTYPES.items()}
    tensors["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    tensors["scalar"] = torch.tensor(3.5, dtype=torch.float32)
    out = OutputDir(tmp_path / "o")
    rec = out.write_safetensors("model.safetensors", specs_of(tensors), iter(tensors.items()), metadata={"format": "pt"})
    path = tmp_path / "o" / "model.safetensors"
    assert rec.sha256 == sha256_file(path) and rec.size == path.stat().st_size
    loaded = load_file(str(path))  # the reference reader agrees
    for name, t in tensors.items():
        assert bit_equal(loaded[name].reshape(-1), t.reshape(-1)) and loaded[name].shape == t.shape, name
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    start, infos, _ = read_safetensors_header(path)
    assert start % 8 == 0  # header padded to 8 bytes
    assert set(infos) == set(tensors)


def test_tensors_larger_than_one_write(tmp_path):
    """A tensor of several ``WRITE_SLICE`` writes (and a ragged tail) lands byte for byte."""
    from moetool.convert.sink import WRITE_SLICE

    big = torch.randn(WRITE_SLICE // 4 * 3 + 37, generator=torch.Generator().manual_seed(1))  # float32
    tensors = {"big": big, "after": torch.arange(5, dtype=torch.int64)}
    out = OutputDir(tmp_path / "o")
    rec = out.write_safetensors("m.safetensors", specs_of(tensors), iter(tensors.items()))
    loaded = load_file(str(tmp_path / "o" / "m.safetensors"))
    assert bit_equal(loaded["big"], big) and bit_equal(loaded["after"], tensors["after"])
    assert rec.sha256 == sha256_file(tmp_path / "o" / "m.safetensors")


def _sink_pieces():
    g = torch.Generator().manual_seed(2)
    return [b"header bytes, not a multiple of 8", torch.randn(3000, generator=g),  # 12000 B
            torch.arange(7, dtype=torch.int16), torch.zeros(0), torch.randn(5000, generator=g).bfloat16()[::2],
            b"", torch.randint(0, 255, (8192 * 3,), generator=g, dtype=torch.uint8)]


def _expected_bytes(pieces) -> bytes:
    return b"".join(p if isinstance(p, bytes) else bytes(tensor_bytes(p)) for p in pieces)


def _write_sink(path, pieces, **kw):
    from moetool.convert.sink import HashingSink

    sink = HashingSink(path, **kw)
    for p in pieces:
        sink.write(p)
    return sink, sink.close(True)


@pytest.mark.parametrize("folder", ["tmp", "shm"])
def test_direct_io_sink_writes_and_hashes_the_same_bytes(tmp_path, monkeypatch, folder):
    """The O_DIRECT sink (small staging buffers here: many of them, a ragged tail written
    through the page cache) gives the bytes and sha256 of the plain one; on a file system
    without O_DIRECT (tmpfs on older kernels) it falls back to plain writes."""
    import hashlib
    import os
    from pathlib import Path

    import moetool.convert.sink as w

    if folder == "shm":
        if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
            pytest.skip("no writable /dev/shm")
        import tempfile

        tmp_path = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        monkeypatch.setattr(w, "DIRECT_STAGE", 8192)
        pieces = _sink_pieces()
        want = _expected_bytes(pieces)
        sink, digest = _write_sink(tmp_path / "direct", pieces)
        plain, plain_digest = _write_sink(tmp_path / "plain", pieces, direct=False)
        assert not plain.direct
        assert (tmp_path / "direct").read_bytes() == want == (tmp_path / "plain").read_bytes()
        assert digest == plain_digest == hashlib.sha256(want).hexdigest()
        if folder == "tmp" and w.O_DIRECT:
            assert sink.direct  # ext4 / xfs / btrfs take it: the path above was the direct one
    finally:
        if folder == "shm":
            import shutil

            shutil.rmtree(tmp_path, ignore_errors=True)


def test_direct_io_sink_falls_back_when_a_direct_write_is_refused(tmp_path, monkeypatch):
    """A direct write the file refuses (EINVAL: unaligned, forced here by a 1-byte alignment)
    switches the file to plain writes; the bytes and sha256 are the same."""
    import hashlib

    import moetool.convert.sink as w

    monkeypatch.setattr(w, "DIRECT_STAGE", 8192)
    monkeypatch.setattr(w, "DIRECT_ALIGN", 1)
    pieces = _sink_pieces()
    want = _expected_bytes(pieces)
    sink, digest = _write_sink(tmp_path / "f", pieces)
    if not sink.direct:
        pytest.skip("this file system does not take O_DIRECT")
    assert (tmp_path / "f").read_bytes() == want and digest == hashlib.sha256(want).hexdigest()
    assert not sink.o_direct


def test_direct_io_sink_error_leaves_the_file_unfinished(tmp_path, monkeypatch):
    """A failing write surfaces from close() (the output stays .incomplete in OutputDir)."""
    import os

    import moetool.convert.sink as w
    from moetool.convert.sink import HashingSink

    monkeypatch.setattr(w, "DIRECT_STAGE", 8192)

    def refuse(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", refuse)
    sink = HashingSink(tmp_path / "f")
    if not sink.direct:
        sink.close(False)
        pytest.skip("this file system does not take O_DIRECT")
    for p in _sink_pieces():
        try:
            sink.write(p)
        except OSError:
            break
    with pytest.raises(OSError, match="No space"):
        sink.close(True)


def test_streams_a_tensor_in_several_chunks(tmp_path):
    big = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    small = torch.ones(7, dtype=torch.bfloat16)
    chunks = [("big", big[i:i + 3]) for i in range(0, 10, 3)] + [("small", small)]
    OutputDir(tmp_path).write_safetensors("x.safetensors", specs_of({"big": big, "small": small}), iter(chunks))
    got = load_file(str(tmp_path / "x.safetensors"))
    assert torch.equal(got["big"], big) and torch.equal(got["small"], small)


def test_non_contiguous_tensors_are_written_in_logical_order(tmp_path):
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()  # a transposed view
    assert bytes(tensor_bytes(t)) == t.contiguous().numpy().tobytes()
    OutputDir(tmp_path).write_safetensors("x.safetensors", specs_of({"t": t}), iter([("t", t)]))
    assert torch.equal(load_file(str(tmp_path / "x.safetensors"))["t"], t)


@pytest.mark.parametrize("case, message", [
    ("short", "x.safetensors: tensor data ended early (b)"),
    ("long", "x.safetensors: tensor a got 32 bytes more than its shape [2, 2] holds"),
    ("dtype", "x.safetensors: expected data of a (torch.float32), got a (torch.float16)"),
    ("order", "x.safetensors: expected data of a (torch.float32), got b (torch.float32)"),
    ("extra", "x.safetensors: unexpected extra tensor c"),
])
def test_wrong_data_is_an_error_and_leaves_no_final_file(tmp_path, case, message):
    a, b = torch.ones(2, 2), torch.zeros(3)
    specs = specs_of({"a": a, "b": b})
    chunks = {
        "short": [("a", a), ("b", b[:2])],
        "long": [("a", torch.ones(4, 2))],
        "dtype": [("a", a.half())],
        "order": [("b", b), ("a", a)],
        "extra": [("a", a), ("b", b), ("c", b)],
    }[case]
    out = OutputDir(tmp_path)
    with pytest.raises(MoetoolError) as err:
        out.write_safetensors("x.safetensors", specs, iter(chunks))
    assert str(err.value) == message
    assert not (tmp_path / "x.safetensors").exists()
    assert (tmp_path / f"x.safetensors{INCOMPLETE}").exists()
    assert "x.safetensors" not in json.loads((tmp_path / JOURNAL_NAME).read_text()).get("files", {}) \
        if (tmp_path / JOURNAL_NAME).exists() else True


def test_journal_resume_and_manifest(tmp_path):
    t = {"w": torch.randn(4, 4)}
    with OutputDir(tmp_path / "o", plan_id="p1") as out:
        out.write_safetensors("a.safetensors", specs_of(t), iter(t.items()))
    journal = json.loads((tmp_path / "o" / JOURNAL_NAME).read_text())
    assert journal["plan_id"] == "p1" and set(journal["files"]) == {"a.safetensors"}
    # same plan: the finished file is recognised
    with OutputDir(tmp_path / "o", plan_id="p1") as again:
        size = (tmp_path / "o" / "a.safetensors").stat().st_size
        assert not again.already_done("a.safetensors", size + 8)  # not the size the plan expects
        assert again.already_done("a.safetensors", size) and again.skipped == ["a.safetensors"]
    # a modified file is not trusted
    p = tmp_path / "o" / "a.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    with OutputDir(tmp_path / "o", plan_id="p1") as again:
        assert not again.already_done("a.safetensors")
    # finish: manifest last, journal and lock file gone
    out = OutputDir(tmp_path / "o", plan_id="p1")
    out.write_safetensors("a.safetensors", specs_of(t), iter(t.items()))
    out.write_json("config.json", {"x": 1})
    manifest = out.finish({"kind": "checkpoint"})
    assert set(manifest["files"]) == {"a.safetensors", "config.json"}
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["a.safetensors", "config.json", MANIFEST_NAME]
    assert verify_manifest(tmp_path / "o")["kind"] == "checkpoint"
    with pytest.raises(MoetoolError, match="already holds a complete output"):
        OutputDir(tmp_path / "o")
    OutputDir(tmp_path / "o", force=True).close()  # --force: the manifest goes first
    assert not (tmp_path / "o" / MANIFEST_NAME).exists()


def test_verify_manifest_errors(tmp_path):
    out = OutputDir(tmp_path)
    out.write_json("a.json", {"a": 1})
    out.write_json("b.json", {"b": 2})
    out.finish()
    (tmp_path / "a.json").write_text('{\n  "a": 2\n}\n')  # same size, other bytes
    with pytest.raises(MoetoolError) as err:
        verify_manifest(tmp_path)
    assert str(err.value) == f"{tmp_path / 'a.json'}: sha256 does not match manifest.json (file modified or corrupt)"
    (tmp_path / "b.json").write_text("{}")
    with pytest.raises(MoetoolError, match=r"b.json: size 2 bytes, manifest says 13 \(truncated or modified\)$"):
        verify_manifest(tmp_path, ["b.json"])
    with pytest.raises(MoetoolError, match=r"no entry for c.json$"):
        verify_manifest(tmp_path, ["c.json"])
    (tmp_path / MANIFEST_NAME).unlink()
    with pytest.raises(MoetoolError, match=r"no manifest.json \(output unfinished or not made by moetool\)$"):
        verify_manifest(tmp_path)


def test_nesting_refused(tmp_path):
    (tmp_path / "in").mkdir()
    with pytest.raises(MoetoolError, match="is inside the input"):
        OutputDir(tmp_path / "in" / "out", inputs=[tmp_path / "in"])
    with pytest.raises(MoetoolError, match="is inside the output"):
        OutputDir(tmp_path, inputs=[tmp_path / "in"])
    assert not (tmp_path / "in" / "out").exists()
    OutputDir(tmp_path / "sibling", inputs=[tmp_path / "in"])


def test_tiny_writer_output_is_a_valid_checkpoint(tmp_path):
    from moetool.demo.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "c", "mixtral", hidden=64, intermediate=48, experts=4, top_k=2,
                                layers=2, shards=3)
    assert not (path / MANIFEST_NAME).exists() and not (path / JOURNAL_NAME).exists()
    with open_checkpoint(path) as ck:
        assert len(ck.files) == 3
        assert ck.config["num_local_experts"] == 4 and ck.config["intermediate_size"] == 48


def test_plan_id_follows_inputs_and_options(tiny, tmp_path, copy_ckpt):
    import os

    from moetool.convert.planning import plan_id

    src = copy_ckpt(tiny("mixtral", hidden=64, intermediate=32))
    with open_checkpoint(src) as ck:
        a = plan_id(ck, fmt="fp8-block")
        assert a == plan_id(ck, fmt="fp8-block") != plan_id(ck, fmt="int4-group")
        f = src / ck.files[0]
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert plan_id(ck, fmt="fp8-block") != a


def test_output_path_that_is_a_file(tmp_path, cli, tiny):
    (tmp_path / "afile").write_text("x")
    r = cli("quantize", tiny("mixtral"), tmp_path / "afile", "--fp8-block", "--quiet")
    assert r.code == 2 and r.error_line == f"{tmp_path / 'afile'}: exists and is not a folder; choose an output folder"
    r = cli("quantize", tiny("mixtral"), tmp_path / "afile" / "sub", "--fp8-block", "--quiet")
    assert r.code == 2
    assert r.error_line == f"{tmp_path / 'afile' / 'sub'}: cannot create the output folder (Not a directory)"


def test_journal_of_another_plan_is_refused_and_force_removes_its_files(tmp_path):
    t = {"w": torch.randn(4, 4)}
    with OutputDir(tmp_path, plan_id="A") as out:
        out.write_safetensors("model-00001-of-00003.safetensors", specs_of(t), iter(t.items()))
    (tmp_path / "keep.txt").write_text("not ours")
    with pytest.raises(MoetoolError, match="holds the unfinished output of another moetool run"):
        OutputDir(tmp_path, plan_id="B")
    assert (tmp_path / "model-00001-of-00003.safetensors").exists()
    OutputDir(tmp_path, plan_id="B", force=True).close()  # plan A's files cannot be resumed: they go
    assert not (tmp_path / "model-00001-of-00003.safetensors").exists()
    assert (tmp_path / "keep.txt").exists()


def _rewrite_in_place(path) -> None:
    """The same size, other bytes (the last data byte flipped): a writer's in-place rewrite."""
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))


@pytest.mark.parametrize("command, old_mtime", [("quantize", False), ("shard", False), ("repack", False),
                                                ("merge", False), ("quantize", True)])
def test_an_input_rewritten_while_it_is_read_leaves_the_output_unfinished(tmp_path, tiny, copy_ckpt, monkeypatch,
                                                                         cli, command, old_mtime):
    """A shard of the input rewritten after the first output file was committed: the output
    would hold files of both versions; it is not marked complete, and the error names the file.
    ``old_mtime``: the rewrite puts the old modification time back (``cp -p``, ``touch -r``)."""
    import os

    from moetool.convert.shard import shard

    src = copy_ckpt(tiny("mixtral"))
    if command == "merge":
        ranks = tmp_path / "ranks"
        shard(src, ranks, 2, progress=False)
        changed = sorted(ranks.glob("rank-*/model-0*.safetensors"))[-1]
        args = ["shard", "--merge", str(ranks)]
    else:
        changed = sorted(src.glob("*.safetensors"))[-1]
        args = {"quantize": ["quantize", str(src)], "shard": ["shard", str(src)], "repack": ["repack", str(src)]}[command]
    args += [str(tmp_path / "out")] + {"quantize": ["--fp8-block"], "shard": ["--ep", "2"],
                                       "repack": ["--layout", "stacked"], "merge": []}[command]
    assert changed.is_file()
    real_commit = OutputDir.commit
    done = []

    def commit(self, name, sha256):
        record = real_commit(self, name, sha256)
        if not done:
            done.append(name)
            before = changed.stat()
            _rewrite_in_place(changed)
            if old_mtime:
                os.utime(changed, ns=(before.st_atime_ns, before.st_mtime_ns))
        return record

    monkeypatch.setattr(OutputDir, "commit", commit)
    r = cli(*args)
    assert done and r.code == 2, r
    assert r.err.strip().splitlines()[-1] == (f"error: {changed}: changed while moetool read it (size, modification or "
                                              "status change time, or inode); the output is left unfinished: re-run "
                                              "with --force to convert it again"), r.err
    assert not (tmp_path / "out" / MANIFEST_NAME).exists() and (tmp_path / "out" / JOURNAL_NAME).exists()


@pytest.mark.parametrize("step", ["write", "fsync"])
@pytest.mark.parametrize("kind", ["json", "copy"])
def test_a_small_file_s_write_error_names_the_file(tmp_path, monkeypatch, step, kind):
    """ENOSPC or EIO while writing config.json, the index, the journal or manifest.json (or
    copying a side file) used to print only ``[Errno 28] No space left on device``."""
    import errno
    import os

    import moetool.convert.output as output

    out = OutputDir(tmp_path / "o")
    (tmp_path / "side.txt").write_text("tokens")
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def failing(*args, **kw):
        raise full

    if step == "fsync":
        monkeypatch.setattr(os, "fsync", failing)
    elif kind == "copy":
        monkeypatch.setattr(os, "pwrite", failing)
    else:
        class Full:  # a buffered file whose write finds the disk full
            def __init__(self, path, mode):
                self.f = open(path, mode)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, data):
                raise full

        monkeypatch.setattr(output, "open", Full, raising=False)
    with pytest.raises(OSError) as e:
        if kind == "json":
            out.write_json("config.json", {"a": 1})
        else:
            out.copy_file(tmp_path / "side.txt", "tokenizer.json")
    monkeypatch.undo()
    name = "config.json" if kind == "json" else "tokenizer.json"
    assert e.value.filename == str(tmp_path / "o" / (name + INCOMPLETE)) and e.value.errno == errno.ENOSPC
    assert not (tmp_path / "o" / name).exists()
