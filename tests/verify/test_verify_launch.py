"""The rank launcher: results by value, one-line errors naming the rank, no hangs."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks import verify_workers by name
import verify_workers as vw  # noqa: E402

from moetool.errors import MoetoolError  # noqa: E402
from moetool.verify import fork_server  # noqa: E402
from moetool.verify.launch import run_under_torchrun, spawn_world  # noqa: E402
from moetool.verify.reference import reference_moe_forward  # noqa: E402

#: a failing world must be torn down well within this (spawn itself takes a few seconds)
BOUND_S = 45

#: failing 2-rank worlds (rank 1 is the bad one): name -> (rank function, spawn_world keywords)
FAILING = {
    "raises": (vw.raise_on, dict(timeout_s=60, collective_timeout_s=30)),
    "exits": (vw.exit_on, dict(timeout_s=60, collective_timeout_s=30)),
    "hangs": (vw.hang_on, dict(timeout_s=6, collective_timeout_s=120)),
}


def _timed_failure(fn, *args, **kwargs) -> tuple[str | None, float]:
    """(spawn_world's MoetoolError text, None if it raised none; seconds until it returned)."""
    t0 = time.monotonic()
    try:
        spawn_world(fn, *args, **kwargs)
    except MoetoolError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.fixture(scope="module")
def failures():
    """{name: (error text, seconds)} of the FAILING worlds, run at the same time (each
    spawn_world waits for its ranks in a thread of its own)."""
    with ThreadPoolExecutor(len(FAILING)) as pool:
        futures = {name: pool.submit(_timed_failure, fn, 2, args=(1,), **kw) for name, (fn, kw) in FAILING.items()}
        return {name: f.result() for name, f in futures.items()}


def test_a_rank_that_raises_stops_the_world_naming_it(failures):
    msg, elapsed = failures["raises"]
    assert msg is not None and msg.startswith("rank 1 failed: ValueError: shard for rank 1 is corrupt (test)"), msg
    assert "\n" not in msg
    assert elapsed < BOUND_S


def test_a_rank_that_exits_abruptly_is_reported(failures):
    msg, elapsed = failures["exits"]
    assert msg is not None and msg.startswith("rank 1 exited with code 7 before reporting a result"), msg
    assert elapsed < BOUND_S


def test_a_rank_that_hangs_hits_the_timeout(failures):
    msg, elapsed = failures["hangs"]
    assert msg is not None and "timed out after 6 s" in msg and "ranks still running: [0, 1]" in msg, msg
    assert elapsed < BOUND_S


@pytest.mark.skipif(not fork_server.forks(), reason="ranks are spawned here, not forked from a server")
def test_a_preload_found_through_a_path_added_at_run_time_is_preloaded(tmp_path):
    """The server gets this process's sys.path, entries a script inserted included (Python's
    forkserver ignored it up to 3.12.7, CPython gh-117378: such a preload was skipped)."""
    (tmp_path / "runtime_path_probe.py").write_text("")
    code = ("import sys\n"
            f"sys.path[:0] = [{str(tmp_path)!r}, {str(Path(__file__).parent)!r}]\n"
            "if __name__ == '__main__':\n"
            "    import verify_workers as vw\n"
            "    from moetool.verify import fork_server, launch\n"
            "    fork_server.start(('runtime_path_probe',))\n"
            "    print(launch.spawn_world(vw.imported, 2, args=(['runtime_path_probe'],), timeout_s=60))\n")
    script = tmp_path / "start.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", fork_server.START_ENV)}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                       cwd=tmp_path.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[['runtime_path_probe'], ['runtime_path_probe']]", r.stdout + r.stderr


def _gone(pid: int) -> bool:
    """Whether ``pid`` has ended (no process, or a zombie no one has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


#: started by a test's script: the fork server, from the main thread or from one that has ended;
#: its last preload notes that the server got there, then waits for the test's word to go on
START_A_SLOW_SERVER = """
import os, sys, threading, time
folder, thread = sys.argv[1:]
sys.path.insert(0, folder)
import multiprocessing.forkserver as mp_forkserver
from moetool.verify import fork_server
start = lambda: fork_server.start(("slow_preload",))
if thread == "main":
    start()
else:
    t = threading.Thread(target=start)
    t.start()
    t.join()
    while not os.path.exists(os.path.join(folder, "reached")):  # past TIE, WATCH and LAUNCH
        time.sleep(0.05)
print(mp_forkserver._forkserver._forkserver_pid, flush=True)
"""


@pytest.mark.skipif(not fork_server.forks(), reason="ranks are spawned here, not forked from a server")
@pytest.mark.parametrize("thread", ["main", "ended"])
def test_a_server_still_importing_ends_with_the_process_that_started_it(tmp_path, thread):
    """A fork server started from the main thread ends with that process, even in the middle of
    its imports: it used to import on for seconds, holding the command's stderr. One started
    from a thread that has ended serves on while its process lives (the death signal follows
    the thread, so such a start asks none)."""
    (tmp_path / "slow_preload.py").write_text(
        "import os, time\n"
        f"os.chdir({str(tmp_path)!r})\n"
        "open('reached', 'w').close()\n"
        "for _ in range(3000):  # a minute at most\n"
        "    if os.path.exists('go'):\n"
        "        open('went on', 'w').close()\n"
        "        break\n"
        "    time.sleep(0.02)\n")
    env = {k: v for k, v in os.environ.items() if k != fork_server.START_ENV}
    # (the server holds the script's stdout: read its line, then wait for the script alone)
    p = subprocess.Popen([sys.executable, "-c", START_A_SLOW_SERVER, str(tmp_path), thread], stdout=subprocess.PIPE,
                         text=True, env=env)
    with p.stdout:
        line = p.stdout.readline()
    assert p.wait(timeout=120) == 0 and line.strip().isdigit(), line
    server = int(line)
    try:
        if thread == "main":
            deadline = time.monotonic() + 30
            while not _gone(server) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _gone(server) and not (tmp_path / "reached").exists()
        else:  # its process has ended: the server goes on
            (tmp_path / "go").touch()
            deadline = time.monotonic() + 30
            while not (tmp_path / "went on").exists() and not _gone(server) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert (tmp_path / "went on").exists()
    finally:
        if not _gone(server):
            os.kill(server, signal.SIGKILL)


@pytest.mark.skipif(not fork_server.forks(), reason="ranks are spawned here, not forked from a server")
def test_the_suites_ranks_fork_with_the_test_modules_preloaded():
    """tests/conftest.py's fork server imports tests/rank_steps.py, so the ranks of every world
    the suite starts run the EP steps' torch references on CPU tensors (the interpreted kernels
    only where a world asks)."""
    assert spawn_world(vw.preloaded, 2, timeout_s=60) == [{"rank_steps": True, "route_tokens": "reference"}] * 2


def test_unknown_backend_is_refused_before_spawning():
    with pytest.raises(MoetoolError, match="unknown distributed backend"):
        spawn_world(vw.raise_on, 2, backend="mpi")


def test_run_under_torchrun_needs_its_environment(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(MoetoolError, match="not started by torchrun: environment variable RANK"):
        run_under_torchrun(vw.raise_on, (1,))


def test_run_under_torchrun_refuses_a_local_rank_without_a_gpu(monkeypatch):
    """Two processes a node on a one-GPU host under NCCL: one line naming the rank and the fix,
    before CUDA's "invalid device ordinal" (seen on an H100 host)."""
    for key, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "1")):
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(MoetoolError, match=r"^rank 1: LOCAL_RANK 1 has no GPU on this node \(1 found\): .*"
                                           r"--nproc-per-node\), or pass --backend gloo$"):
        run_under_torchrun(vw.raise_on, (1,), backend="nccl")


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


def test_spawn_start_method_on_request(monkeypatch, tmp_path):
    """MOETOOL_RANK_START=spawn: ranks are fresh interpreters (the way around the fork server),
    and a world still runs; their environment is the spawning process's either way. Rank 0
    records the code it ran for the next run's warm-up (moetool.read.code_files): the
    libraries it maps, the modules it imported."""
    from moetool.read import code_files
    from moetool.verify import launch

    monkeypatch.setenv("MOETOOL_RANK_START", "spawn")
    assert launch._rank_context().get_start_method() == "spawn"
    monkeypatch.setenv("MOETOOL_SEEN_BY_RANKS", "yes")
    assert launch.spawn_world(_env_value, 2, "gloo", args=("MOETOOL_SEEN_BY_RANKS",), timeout_s=120) == ["yes", "yes"]
    monkeypatch.delenv("MOETOOL_RANK_START")
    assert launch._rank_context().get_start_method() == "forkserver"
    code_list = tmp_path / "code-files.txt"
    monkeypatch.setenv(code_files.ENV, str(code_list))
    assert launch.spawn_world(_env_value, 2, "gloo", args=("MOETOOL_SEEN_BY_RANKS",), timeout_s=120) == ["yes"] * 2
    listed = code_files.read_list(code_list)
    assert any(Path(f).name.startswith("libtorch_cpu.so") and r for f, r in listed.items())  # touched ranges
    import torch.distributed.distributed_c10d as c10d  # as its import read it: bytecode, or the source

    reads = code_files.import_reads(c10d.__file__, c10d.__cached__)
    assert reads and all(f in listed for f in reads)
    monkeypatch.setenv(code_files.ENV, "off")
    monkeypatch.setenv("MOETOOL_SEEN_BY_RANKS", "later")  # set after the fork server started
    assert launch.spawn_world(_env_value, 2, "gloo", args=("MOETOOL_SEEN_BY_RANKS",), timeout_s=120) == ["later"] * 2


def _env_value(rank: int, world_size: int, key: str) -> str | None:
    import os

    return os.environ.get(key)


SPY_CUDA = """
import sys, torch, torch.cuda
touched = []
for name in ("is_available", "device_count", "current_device", "init", "_lazy_init", "get_device_properties",
             "get_device_capability", "get_device_name", "set_device", "synchronize"):
    real = getattr(torch.cuda, name)
    setattr(torch.cuda, name, lambda *a, _n=name, _r=real, **k: (touched.append(_n), _r(*a, **k))[1])
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
print(",".join(touched) or "none")
"""


def test_the_modules_ranks_preload_exist_and_never_touch_cuda():
    """The fork server imports them, then forks the ranks: a module that asked CUDA anything
    while imported (even ``is_available``, which initializes the driver) would leave every GPU
    rank unable to use CUDA. And the server skips a preload it cannot import, silently: a
    misspelt name would only cost every rank its imports again."""
    from moetool.verify import driver, whole_model

    modules = ["moetool.verify.launch", *driver.RANK_MODULES, *whole_model.RANK_MODULES]
    r = subprocess.run([sys.executable, "-c", SPY_CUDA, *modules], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "none", f"CUDA asked while importing: {r.stdout}"


def test_a_preload_that_raises_is_one_line_naming_it(tmp_path):
    """The fork server survives a preload's ImportError only; anything else it raises kills the
    server, which the first rank's start met as a bare EOFError."""
    (tmp_path / "broken_preload.py").write_text("raise RuntimeError('a broken install')\n")
    code = ("from moetool.verify import launch\n"
            "from moetool.errors import MoetoolError\n"
            "try:\n"
            "    launch.spawn_world(abs, 2, preload=('broken_preload',), timeout_s=60)\n"
            "except MoetoolError as e:\n"
            "    print('error:', e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.pop("MOETOOL_RANK_START", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "error: the fork server that starts the ranks died while importing moetool.verify.launch, " \
           "broken_preload (its error is above); MOETOOL_RANK_START=spawn starts the ranks without it" in r.stdout, \
        r.stdout + r.stderr
    assert "RuntimeError: a broken install" in r.stderr  # the server's own traceback, above


SPY_SERVER_START = """
import json, sys
import multiprocessing.forkserver as fs
seen = []
def spy():  # the server itself is not started: the command fails before it needs one
    seen.append({"torch": "torch" in sys.modules, "preload": list(fs._forkserver._preload_modules)})
fs.ensure_running = spy
from moetool.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"seen": seen, "code": code}))
"""


def test_verify_starts_the_ranks_fork_server_before_it_imports_torch(tmp_path):
    """`moetool verify` starts the fork server its ranks come from first thing, with what its
    ranks import (--whole-model: transformers' modeling code too), so that the server imports
    beside the command's own `import torch` instead of after it."""
    from moetool.verify import fork_server

    (tmp_path / "shards").mkdir()  # no manifest: verify fails, after the start
    env = {k: v for k, v in os.environ.items() if k != "MOETOOL_RANK_START"}
    for flags, modules in (([], fork_server.MOE_ONLY_MODULES), (["--whole-model"], fork_server.WHOLE_MODEL_MODULES)):
        argv = ["verify", str(tmp_path / "shards"), "--ref", str(tmp_path), *flags]
        r = subprocess.run([sys.executable, "-c", SPY_SERVER_START, *argv], capture_output=True, text=True,
                           timeout=120, env=env)
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["seen"][:1] == [{"torch": False, "preload": [fork_server.TIE, fork_server.WATCH, fork_server.LAUNCH,
                                                                *modules]}], (flags, out)
        assert out["code"] != 0


def test_verify_starts_no_fork_server_without_ranks_to_start(tmp_path, cli, monkeypatch):
    """Not for a shards folder that is not there (the error comes first), nor under torchrun
    (its agent starts the ranks); with MOETOOL_RANK_START=spawn there is no server to start."""
    from moetool.verify import fork_server

    started = []
    monkeypatch.setattr(fork_server, "start", lambda preload=(): started.append(preload))
    (tmp_path / "shards").mkdir()
    assert cli("verify", tmp_path / "missing", "--ref", tmp_path).code != 0
    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999").items():
        monkeypatch.setenv(key, value)
    assert cli("verify", tmp_path / "shards", "--ref", tmp_path).code != 0
    assert started == []
    monkeypatch.setenv("MOETOOL_RANK_START", "spawn")
    assert not fork_server.forks()


def _child_fork_server(pid: int) -> int | None:
    """The pid of ``pid``'s child running multiprocessing's fork server, if there is one."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"multiprocessing.forkserver" in cmdline:
            return int(entry)
    return None


def _handles_sigint(pid: int) -> bool:
    """Whether ``pid`` has a SIGINT disposition of its own yet (caught or ignored, /proc status):
    a process still starting dies of it silently, a started interpreter raises KeyboardInterrupt."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = dict(line.split(":", 1) for line in f if line.startswith(("SigIgn", "SigCgt")))
    except OSError:
        return False
    return any(int(v, 16) >> 1 & 1 for v in masks.values())  # bit SIGINT - 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server and /proc are Linux's")
def test_ctrl_c_while_the_early_fork_server_imports_prints_one_line(tmp_path):
    """Ctrl-C (SIGINT to every process of the command) while the server `verify` started first
    thing is still importing: the command's one line and exit 130, not the server's
    KeyboardInterrupt traceback as well (it starts with SIGINT ignored, as it serves)."""
    import signal

    (tmp_path / "shards").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MOETOOL_RANK_START"}
    p = subprocess.Popen([sys.executable, "-m", "moetool", "verify", str(tmp_path / "shards"), "--ref", str(tmp_path),
                          "--whole-model"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    deadline = time.monotonic() + 60
    server = None
    while (server is None or not _handles_sigint(server)) and p.poll() is None and time.monotonic() < deadline:
        server = _child_fork_server(p.pid)
        time.sleep(0.01)
    assert p.poll() is None, "the command ended before its fork server's interpreter was up"
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    # the server's stderr too (it holds the pipe until it ends); verify writes no output folder,
    # so no word of resuming one
    assert err.strip().splitlines() == ["error: interrupted"], err
