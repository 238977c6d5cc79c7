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
