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
    t, s = read_tensors(tmp_path / "per"), read_tensors(tmp_path / "stacked")
    fmt = get_format("nvfp4")
    for name in [n for n in t if n.endswith(".w1.weight_global_scale")]:
        up = name.replace(".w1.", ".w3.")
        assert torch.equal(t[name], t[up]), name
        # the pair is what quantizing the concatenation gives
        expert = name.rsplit(".w1.", 1)[0]
        gate = {k.rsplit(".", 1)[1]: v for k, v in t.items() if k.startswith(expert + ".w1.")}
        upt = {k.rsplit(".", 1)[1]: v for k, v in t.items() if k.startswith(expert + ".w3.")}
        assert torch.equal(torch.cat([fmt.dequantize(gate), fmt.dequantize(upt)]),
                           fmt.dequantize(fmt.cat_rows([gate, upt])))
    w13 = [n for n in s if n.endswith("w13_weight_global_scale")]
    assert w13 and all(bool((s[n][..., 0] == s[n][..., 1]).all()) for n in w13)
