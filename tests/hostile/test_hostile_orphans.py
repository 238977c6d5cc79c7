"""Hostile corpus, orphan ranks: whatever ends ``moetool verify`` (SIGKILL, the OOM killer, a
SIGTERM from ``timeout`` or a scheduler), its rank processes end within seconds, not after
their work or the process-group timeout (minutes); under torchrun, a worker ends with its agent.

The verify runs here are made slow on purpose (one-token chunks: each rank would run for
minutes), so a rank that outlives its parent shows. Rank processes are found below the parent
(its children, or its fork server's) by their name, ``moetool-rankR``; a rank that holds its shard open is in the run (past
the process group's set-up, which needs the parent's store and fails fast without it).
Linux only (/proc).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostile import Run, env, moetool, start
from moeutil import alive, proc_stat, wait_gone

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc")

#: a rank must be gone this long after its parent died (the watchdog polls every 0.5 s)
GONE_S = 5.0
#: ranks killed while still importing torch end when they reach their entry point
GONE_STARTING_S = 15.0
#: one-token chunks: each rank runs for minutes unless stopped
SLOW = ("--ep", "2", "--tokens", "100000", "--chunk-size", "1", "--timeout", "300")


@pytest.fixture(scope="module")
def ckpt(tiny, tmp_path_factory) -> tuple[Path, Path]:
    """(model, its ep 2 shards): one MoE layer of 4 experts, hidden 64."""
    model = tiny("mixtral", hidden=64, intermediate=32, experts=4, layers=1, shards=1)
    shards = tmp_path_factory.mktemp("orphans") / "shards"
    r = moetool("shard", model, shards, "--ep", "2")
    assert r.code == 0, r.err
    return model, shards


# ------------------------------------------------------------------------------ /proc helpers


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _ranks(parent: int) -> list[int]:
    """The rank processes below ``parent``: named ``moetool-rankR`` (they are its children, or
    its fork server's), not multiprocessing's resource tracker or fork server."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None:
                children.setdefault(st[1], []).append(int(name))
    below, todo = [], list(children.get(parent, []))
    while todo:
        pid = todo.pop()
        below.append(pid)
        todo += children.get(pid, [])
    return sorted(pid for pid in below if _comm(pid).startswith("moetool-rank"))


def _holds_file_under(pid: int, folder: Path) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"{folder}{os.sep}"):
                return True
        except OSError:
            pass
    return False


def _wait_ranks(p: subprocess.Popen, shards: Path | None, n: int = 2, within: float = 90.0) -> list[int]:
    """The ``n`` ranks of ``p`` once they exist (``shards``: and each holds a file of them open)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        assert p.poll() is None, f"moetool ended with {p.returncode} before its ranks were up: {_finish(p).err}"
        ranks = _ranks(p.pid)
        if len(ranks) == n and (shards is None or all(_holds_file_under(r, shards) for r in ranks)):
            return ranks
        time.sleep(0.02)
    raise AssertionError(f"no {n} ranks under pid {p.pid} after {within:g} s")


@pytest.fixture
def reap():
    """reap(pid, ...): processes of this test that are SIGKILLed at its end if still there, so a
    failing test leaves no rank burning the CPU for minutes."""
    pids: list[int] = []
    yield pids.append
    for pid in pids:
        if alive(pid) and (_comm(pid).startswith("moetool-rank") or "moetool" in _cmdline(pid)):
            os.kill(pid, signal.SIGKILL)


def _start_verify(ckpt, reap, shards_open: bool) -> tuple[subprocess.Popen, list[int]]:
    """A slow ``moetool verify`` and its rank pids (all reaped at the end), once the ranks
    exist (``shards_open``: and each has its shard files open)."""
    model, shards = ckpt
    p = start("verify", shards, "--ref", model, *SLOW)
    reap(p.pid)
    ranks = _wait_ranks(p, shards if shards_open else None)
    for r in ranks:
        reap(r)
    return p, ranks


def _finish(p: subprocess.Popen) -> Run:
    """Wait for ``p`` and read its output (the ranks share its pipes: they must be gone too)."""
    out, err = p.communicate(timeout=30)
    return Run(p.returncode, out, err)


# ------------------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_sigkill_of_verify_takes_its_ranks_along(ckpt, reap):
    """SIGKILL (as the OOM killer sends) runs no clean-up: the ranks die with their parent."""
    p, ranks = _start_verify(ckpt, reap, shards_open=True)
    p.kill()
    p.wait()
    assert wait_gone(ranks, GONE_S) == [], f"ranks outlived the SIGKILLed parent by {GONE_S:g} s"
    _finish(p)


@pytest.mark.slow
def test_sigkill_while_ranks_start_takes_them_along(ckpt, reap):
    """The parent dies before its ranks could ask to die with it (they are still importing
    torch): each notices when it gets there and exits, instead of waiting for a store that is gone."""
    p, ranks = _start_verify(ckpt, reap, shards_open=False)
    p.kill()
    p.wait()
    assert wait_gone(ranks, GONE_STARTING_S) == [], "ranks outlived the SIGKILLed parent"
    _finish(p)


@pytest.mark.slow
def test_sigterm_stops_the_ranks_and_says_interrupted(ckpt, reap):
    """SIGTERM (``timeout``, a scheduler) to moetool alone: it stops its ranks, says so, 143."""
    p, ranks = _start_verify(ckpt, reap, shards_open=True)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert wait_gone(ranks, GONE_S) == [], f"ranks still running {GONE_S:g} s after SIGTERM"
    run = _finish(p)
    assert run.code == 128 + signal.SIGTERM, run.err
    assert run.error_line == "interrupted", run.err  # verify writes no output folder to resume
    assert time.monotonic() - t0 < GONE_S + 5


#: a torchrun worker, as the agent starts it (own session, env:// variables): it says it is
#: in the distributed run, then stays there
WORKER = """
import time
from moetool.verify.launch import run_under_torchrun

def run(rank, world):
    print("in the run", flush=True)
    time.sleep(600)

run_under_torchrun(run, backend="gloo")
"""

#: torchrun's agent, reduced to what matters: it starts the worker in a new session (as
#: torchrun does: signals to the agent's group never reach it) and waits
AGENT = """
import subprocess, sys
w = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(w.pid, flush=True)
w.wait()
"""


def test_torchrun_worker_dies_with_its_agent(reap):
    """The node's agent is SIGKILLed: its worker, in a session of its own, dies too."""
    workers_env = env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="0", TORCHELASTIC_RUN_ID="orphans")
    agent = subprocess.Popen([sys.executable, "-c", AGENT, WORKER], stdout=subprocess.PIPE, text=True,
                             env=workers_env, start_new_session=True)
    reap(agent.pid)
    try:
        worker = int(agent.stdout.readline())
        reap(worker)
        assert agent.stdout.readline() == "in the run\n"
        agent.kill()
        agent.wait()
        assert wait_gone([worker], GONE_S) == [], f"the worker outlived its agent by {GONE_S:g} s"
    finally:
        agent.stdout.close()


def _pdeathsig() -> int:
    import ctypes

    sig = ctypes.c_int(-1)
    assert ctypes.CDLL(None).prctl(2, ctypes.byref(sig), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) == 0
    return sig.value  # PR_GET_PDEATHSIG


def test_the_tie_to_the_parent_is_undone_on_leaving():
    """run_under_torchrun may run in a caller's own process (a test, a notebook): after it, that
    process no longer dies with its parent, and the watchdog thread is gone."""
    import threading

    from moetool.verify.launch import _die_with_parent

    before = _pdeathsig()
    with _die_with_parent(os.getppid()):
        assert _pdeathsig() == signal.SIGKILL
        watchdogs = [t for t in threading.enumerate() if t.name == "moetool-parent-watchdog"]
        assert len(watchdogs) == 1 and watchdogs[0].is_alive()
    assert _pdeathsig() == before
    watchdogs[0].join(timeout=5)
    assert not watchdogs[0].is_alive()
