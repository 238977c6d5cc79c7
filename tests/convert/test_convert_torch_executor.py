"""The torch executor's scheduling helpers (moetool.convert.torch_executor)."""
from __future__ import annotations

import os
import threading

import pytest

from moetool.convert.torch_executor import Executor, converter_cpus

linux = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")


@linux
def test_converter_cpus_only_when_every_allowed_cpu_converts():
    allowed = sorted(os.sched_getaffinity(0))
    assert converter_cpus(len(allowed)) == allowed
    assert converter_cpus(len(allowed) + 1) is None
    if len(allowed) > 1:
        assert converter_cpus(len(allowed) - 1) is None


@linux
def test_pinned_converting_threads_get_one_cpu_each_and_the_process_keeps_all():
    allowed = os.sched_getaffinity(0)
    ex = Executor([], workers=2)
    ex.cpus = [min(allowed), max(allowed)]  # as converter_cpus gives on a 2-core machine
    cpus = iter(ex.cpus)
    seen = []

    def worker():
        ex._pin_thread(cpus)
        seen.append(os.sched_getaffinity(0))  # this thread's

    threads = [threading.Thread(target=worker) for _ in range(3)]  # the third finds no CPU left: unpinned
    for t in threads:
        t.start()
        t.join()
    assert seen[:2] == [{min(allowed)}, {max(allowed)}]
    assert seen[2] == allowed
    assert os.sched_getaffinity(0) == allowed  # the calling thread is untouched


def test_one_worker_is_never_pinned():
    assert Executor([], workers=1).cpus is None


def test_nvfp4_gate_and_up_share_their_global_scale(tiny, tmp_path):
    """vLLM's fused MoE reads one nvfp4 global scale per expert's w13 (the gate's): quantize
    writes each expert's gate and up with the joint one, as one [2N, H] linear cut in two, in
    per-expert files as in stacked ones, whichever converting thread asks for which half first
    (min(4, cores) threads)."""
    import torch

    from moetool.convert.quantize import quantize
    from moetool.formats import get_format
    from moeutil import read_tensors

    src = tiny("mixtral", hidden=64, intermediate=32, experts=4)
    per = quantize(src, tmp_path / "per", "nvfp4", progress=False)
    stacked = quantize(src, tmp_path / "stacked", "nvfp4", layout="stacked", progress=False)
    assert per and stacked
    t, s, src_t = read_tensors(tmp_path / "per"), read_tensors(tmp_path / "stacked"), read_tensors(src)
    fmt = get_format("nvfp4")
    for name in [n for n in t if n.endswith(".w1.weight_global_scale")]:
        up = name.replace(".w1.", ".w3.")
        assert torch.equal(t[name], t[up]), name
        # the pair is, byte for byte, what quantizing the source's concatenated gate and up gives
        expert = name.rsplit(".w1.", 1)[0]
        joint = fmt.split_rows(fmt.quantize(torch.cat([src_t[f"{expert}.w1.weight"], src_t[f"{expert}.w3.weight"]]),
                                            torch.bfloat16), [32, 32])
        for half, w in zip(joint, ("w1", "w3")):
            assert all(torch.equal(half[k], t[f"{expert}.{w}.{k}"]) for k in half), (expert, w)
    w13 = [n for n in s if n.endswith("w13_weight_global_scale")]
    assert w13 and all(bool((s[n][..., 0] == s[n][..., 1]).all()) for n in w13)


def test_int4_to_int4_copies_whatever_the_clip(tiny, tmp_path):
    """int4's clip only chose the scales: an mse-clipped input quantized to int4 without clip
    (or the other way) is copied, bytes and observer, not requantized (which added 0.067 mean
    rel error): the summary reports no new error."""
    import json

    from moetool.convert.quantize import quantize
    from moeutil import read_tensors

    src = tiny("mixtral", hidden=64, intermediate=32, experts=4)
    mse = tmp_path / "mse"
    quantize(src, mse, "int4-group", group_size=32, clip="mse", progress=False)
    for clip in ("none", "mse"):
        out = tmp_path / f"again-{clip}"
        summary = quantize(mse, out, "int4-group", group_size=32, clip=clip, progress=False)
        a, b = read_tensors(mse), read_tensors(out)
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), clip
        cfg = json.loads((out / "config.json").read_text())["quantization_config"]
        assert json.dumps(cfg).count('"observer": "mse"') >= 1, cfg
        assert "error over" not in summary.render(), summary.render()  # nothing requantized
    # a different group size is another storage: requantized, and the summary gives its error
    other = quantize(mse, tmp_path / "g16", "int4-group", group_size=16, progress=False)
    assert "int4-group error over " in other.render(), other.render()


def test_a_failed_write_leaves_no_piece_running_and_no_fd_open(tiny, tmp_path, monkeypatch):
    """A file whose write fails after its first chunk: run_plan returns (raising) only once no
    ``Copy`` piece runs any more, and with every input fd it opened closed (a piece that ran
    after ``close()`` read a closed fd, or opened one that leaked)."""
    import time

    from moetool.convert import torch_executor
    from moetool.convert.output import OutputDir
    from moetool.convert.quantize import quantize

    src = tiny("mixtral", hidden=64, intermediate=32, experts=4)
    monkeypatch.setattr(torch_executor, "COPY_PIECE", 64)  # every copied tensor in many pieces
    running = []
    copy_piece = Executor._copy_piece

    def slow_piece(self, *args):
        running.append(1)
        try:
            time.sleep(0.02)
            return copy_piece(self, *args)
        finally:
            running.pop()

    def failing_write(self, name, specs, chunks, metadata=None, on_bytes=None):
        next(iter(chunks))
        raise OSError(f"{name}: disk full")

    monkeypatch.setattr(Executor, "_copy_piece", slow_piece)
    monkeypatch.setattr(OutputDir, "write_safetensors", failing_write)
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="disk full"):
        quantize(src, tmp_path / "out", "fp8-block", progress=False)
    assert not running
    time.sleep(0.2)  # a piece left behind would open its file by now
    assert set(os.listdir("/proc/self/fd")) <= fds
