"""The rank launcher: results by value, one-line errors naming the rank, no hangs."""
from __future__ import annotations

import os
import socket
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks import verify_workers by name
import verify_workers as vw  # noqa: E402

from moetool.errors import MoetoolError  # noqa: E402
from moetool.verify.launch import run_under_torchrun, spawn_world  # noqa: E402
from moetool.verify.reference import reference_moe_forward  # noqa: E402

#: a failing world must be torn down well within this (spawn itself takes a few seconds)
BOUND_S = 45


def _timed_failure(fn, *args, **kwargs) -> tuple[str, float]:
    t0 = time.monotonic()
    with pytest.raises(MoetoolError) as info:
        spawn_world(fn, *args, **kwargs)
    return str(info.value), time.monotonic() - t0


def test_a_rank_that_raises_stops_the_world_naming_it():
    msg, elapsed = _timed_failure(vw.raise_on, 2, args=(1,), timeout_s=60, collective_timeout_s=30)
    assert msg.startswith("rank 1 failed: ValueError: shard for rank 1 is corrupt (test)"), msg
    assert "\n" not in msg
    assert elapsed < BOUND_S


def test_a_rank_that_exits_abruptly_is_reported():
    msg, elapsed = _timed_failure(vw.exit_on, 2, args=(1,), timeout_s=60, collective_timeout_s=30)
    assert msg.startswith("rank 1 exited with code 7 before reporting a result"), msg
    assert elapsed < BOUND_S


def test_a_rank_that_hangs_hits_the_timeout():
    msg, elapsed = _timed_failure(vw.hang_on, 2, args=(1,), timeout_s=6, collective_timeout_s=120)
    assert "timed out after 6 s" in msg and "ranks still running: [0, 1]" in msg, msg
    assert elapsed < BOUND_S


def test_unknown_backend_is_refused_before_spawning():
    with pytest.raises(MoetoolError, match="unknown distributed backend"):
        spawn_world(vw.raise_on, 2, backend="mpi")


def test_run_under_torchrun_needs_its_environment(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(MoetoolError, match="not started by torchrun: environment variable RANK"):
        run_under_torchrun(vw.raise_on, (1,))


def test_run_under_torchrun_single_rank_layer(monkeypatch):
    """A one-rank world in this process (ep = 1): the layer equals the reference."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    threads = torch.get_num_threads()
    cases = [dict(dp=1, router="v3-grouped", dispatcher=d, group_sizes=[9], chunk_size=4, shared=True)
             for d in ("allgather", "all2all")]
    try:
        results = run_under_torchrun(vw.run_cases, (cases,), backend="gloo")
    finally:
        torch.set_num_threads(threads)
    assert not torch.distributed.is_initialized()
    layer = vw.make_layer("v3-grouped", shared=True)
    ref = reference_moe_forward(vw.make_tokens(9), layer["gate"], layer["bias"], layer["spec"], layer["experts"],
                                layer["shared"])
    for res in results:
        torch.testing.assert_close(res["y"], ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))
        assert res["stats"]["chunks"] == 3 and res["stats"]["pairs_computed"] == 27
