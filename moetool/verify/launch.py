"""Start one process per rank and run a function in each, with errors that never hang.

Two ways in:

- ``spawn_world(fn, world_size, ...)``: single node; the parent starts the ranks (on Linux
  forked by a ``multiprocessing`` fork server that imported torch once, elsewhere spawned),
  watches them and the result queue, and returns the per-rank results. A rank that raises or dies stops the whole run within a bounded time
  with one ``MoetoolError`` naming the rank.
- ``run_under_torchrun(fn, args)``: the process was started by ``torchrun`` (one node or
  many); RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT come from the env.

``fn(rank, world_size, *args)`` runs with the default process group initialised (gloo on
CPU, NCCL on ``cuda:LOCAL_RANK``) and must be a module-level function (spawn pickles it).
What it returns travels to the parent by value (CPU tensors, numbers, dicts, lists...). A
rank of a ``spawn_world`` given ``on_message`` may also hand results over while it runs
(``send_to_parent``), at most ``window`` of them not yet released by the parent: neither side
holds more than that, however long the run.

No rank outlives its parent (``_die_with_parent``): a rank dies within a second of the
process that started it (the spawning ``moetool``, through the fork server, which ends with
it; or torchrun's agent), however that one
ended (SIGKILL, the OOM killer; a rank still importing torch then exits when it reaches its
entry point); an interrupted ``spawn_world`` stops its ranks before it returns.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.forkserver as mp_forkserver
import os
import pickle
import queue as queue_mod
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from moetool.errors import MoetoolError
from moetool.read import code_files
from moetool.verify import fork_server

#: seconds the parent keeps collecting reports after the first failure, so that the rank
#: that failed first (the cause) is named rather than a peer that lost its connection
_GRACE_S = 1.0
#: seconds the parent waits for ranks that reported to exit on their own before terminating them
_EXIT_S = 0.5
#: seconds given to a terminated rank before it is killed
_TERM_S = 5.0
#: seconds between two checks of a rank's watchdog that its parent is still there
_WATCH_S = 0.5
#: exit status of a rank whose parent is gone (nobody is left to read it)
_ORPHANED = 1
_PR_SET_PDEATHSIG, _PR_GET_PDEATHSIG = 1, 2


@dataclass(frozen=True)
class _Report:
    rank: int
    ok: bool
    t: float  # time.time() when the rank finished or failed
    payload: bytes  # ok: pickled result; else: one-line error text, utf-8
    message: bool = False  # a ``send_to_parent`` message on the way, not the rank's end


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    if len(msg) > 500:
        msg = msg[:500] + " ..."
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _setup_rank(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    # CPU ranks share few cores: one thread each, or 4 ranks on 2 cores crawl
    torch.set_num_threads(1)
    return torch.device("cpu")


def _rank_context(preload: Sequence[str] = ()):
    """Linux: a fork server that imported torch and this module once starts every rank of this
    process's worlds by forking (a rank up in ~0.1 s, where a fresh interpreter importing torch
    takes 1-5 s); it never touches CUDA, so its children may. ``preload``: more modules the
    server imports, read when it starts (``fork_server.start``: the verify command's start, or
    this process's first world): what the ranks of the run import, so that each one does not
    (transformers' modeling code: 1.1 CPU-s a rank here; where cores are plenty the ranks'
    start is as late, the imports done once instead of per rank). Elsewhere, or with
    ``MOETOOL_RANK_START=spawn``: spawn."""
    if fork_server.start(preload):
        return tmp.get_context("forkserver")  # the server's: multiprocessing's one fork server
    return tmp.get_context("spawn")


def _release_fork_server() -> None:
    """Close this forked child's copy of the fork server's "alive" pipe (multiprocessing gives
    every child one, so that it may start processes through the server too: ranks never do)."""
    server = getattr(mp_forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _name_process(name: str) -> None:
    """Linux: this process's name in ps / top / /proc/PID/comm (15 bytes at most)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _set_pdeathsig(sig: int) -> int | None:
    """Linux: the signal this process gets when its parent dies (prctl PR_SET_PDEATHSIG, 0 for
    none); returns the previous one. None where there is no prctl (other systems)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        previous = ctypes.c_int(0)
        if libc.prctl(_PR_GET_PDEATHSIG, ctypes.byref(previous), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) != 0:
            return None
        zero = ctypes.c_ulong(0)
        if libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(sig), zero, zero, zero) != 0:
            return None
        return previous.value
    except (OSError, AttributeError):  # no libc to load, or no prctl in it
        return None


@contextlib.contextmanager
def _die_with_parent(parent_pid: int) -> Iterator[None]:
    """While inside, this process dies soon after ``parent_pid``, its parent, however that one
    ends: a SIGKILL, the OOM killer or a crash run no clean-up, and a rank left behind would keep
    its memory, GPU and peers' collectives (up to the process-group timeout, minutes) for nothing.

    - Linux: the kernel sends SIGKILL when the parent exits (PR_SET_PDEATHSIG). The parent may
      already be gone before that was set (a rank spends seconds importing torch first): then
      ``os.getppid()`` is no longer ``parent_pid`` and the process exits at once.
    - everywhere: a watchdog thread checks ``os.getppid()`` every ``_WATCH_S`` and hard-exits
      (``os._exit``: no clean-up that could block) when the parent changed; it covers systems
      without prctl and a death signal cleared meanwhile (an exec of a setuid program, a
      library that resets it).

    The kernel sends the death signal when the parent *thread* that started this process
    ends: ``spawn_world`` starts the ranks in the thread that then waits for them, and
    torchrun's agent starts its workers in its main thread.

    On leaving, both are undone (the previous death signal comes back): ``run_under_torchrun``
    may run in a caller's own process."""
    previous = _set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(_ORPHANED)
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(_WATCH_S):
            if os.getppid() != parent_pid:
                os._exit(_ORPHANED)

    threading.Thread(target=watch, name="moetool-parent-watchdog", daemon=True).start()
    try:
        yield
    finally:
        stop.set()
        if previous is not None:
            _set_pdeathsig(previous)


#: in a rank of a world started with ``on_message``: (queue, its credits, rank, timeout seconds)
_channel: tuple | None = None


def send_to_parent(obj: Any) -> bool:
    """From inside a rank: hand ``obj`` (CPU tensors, numbers, containers) to the parent's
    ``on_message`` now, first waiting while ``window`` earlier messages of this rank are not
    yet released by the parent. False, and nothing sent, where no parent takes messages (under
    torchrun, or a world started without ``on_message``): the caller returns ``obj`` at the end."""
    if _channel is None:
        return False
    q, credits, rank, timeout_s = _channel
    deadline = time.monotonic() + timeout_s
    while not credits.acquire(timeout=_WATCH_S):
        if time.monotonic() > deadline:
            raise MoetoolError(f"rank {rank}: the parent released none of its earlier results for {timeout_s:g} s")
    q.put(_Report(rank, True, time.time(), pickle.dumps(_to_cpu(obj)), message=True))
    return True


def _rank_main(rank: int, world_size: int, backend: str, host: str, port: int,
               pg_timeout_s: float, parent_pid: int, env: dict, fn: Callable, args: tuple, q,
               credits=None) -> None:
    """Entry point of a rank: tied to the parent first thing, then init, run, report, always
    destroy the group. ``env``: the spawning process's environment when it started the world
    (a rank forked by the fork server would otherwise have the server's, from its start)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the fork server's is SIG_IGN (fork_server.start)
    watched = os.getppid()
    if watched != parent_pid:
        # forked by the fork server: that server is this process's parent, and it must be the
        # spawning process's child. It ends when every holder of its "alive" pipe has closed
        # it: the spawning process, and each forked child, which this rank must not stay
        # (else the server, and through it this rank, would outlive a killed moetool)
        _release_fork_server()
        if _parent_of(watched) != parent_pid:
            os._exit(_ORPHANED)
    _name_process(f"moetool-rank{rank}")
    global _channel
    _channel = None if credits is None else (q, credits, rank, pg_timeout_s)
    with _die_with_parent(watched):
        for key in set(os.environ) - set(env):
            del os.environ[key]
        os.environ.update(env)
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        report = None
        try:
            device = _setup_rank(backend, rank)
            store = dist.TCPStore(host, port, world_size, is_master=False,
                                  timeout=timedelta(seconds=pg_timeout_s))
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout_s),
                                    device_id=device if backend == "nccl" else None)
            result = fn(rank, world_size, *args)
            if rank == 0:
                code_files.record()  # the libraries a rank maps (CUDA, NCCL, Triton): the next run's warm-up
            report = _Report(rank, True, time.time(), pickle.dumps(_to_cpu(result)))
        except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
            if os.environ.get("MOETOOL_TRACEBACK"):
                traceback.print_exc()
            report = _Report(rank, False, time.time(), _one_line(e).encode())
        # the report goes out before the group is destroyed: peers that then lose their
        # connection report later, so the parent sees the cause first
        try:
            q.put(report)
            q.close()
            q.join_thread()
        finally:
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - a broken group must not mask the report
                    pass


def spawn_world(fn: Callable, world_size: int, backend: str = "gloo", args: tuple = (),
                timeout_s: float = 600.0, collective_timeout_s: float | None = None,
                on_message: Callable[[int, Any, Callable[[], None]], None] | None = None, window: int = 2,
                abort: threading.Event | None = None, preload: Sequence[str] = ()) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return the results
    in rank order. ``preload``: modules the ranks will import (``_rank_context``).

    ``on_message(rank, obj, release)``: called in this thread, in order, for each
    ``send_to_parent(obj)`` of a rank; ``release()`` (any thread, once) gives the rank one of
    its ``window`` credits back. An exception from it stops the world and is raised as it is.
    Once messages come, ``timeout_s`` bounds the time since the last one instead (a run of
    many layers takes as long as it takes; a stuck one still ends).
    ``abort``: set by another thread to stop the world ("stopped by the caller").

    ``timeout_s`` bounds the whole run; ``collective_timeout_s`` (default: ``timeout_s``) is
    the process-group timeout, so no collective waits forever. Raises ``MoetoolError`` with
    one line: "rank R failed: ExcType: message", "rank R exited with code C before reporting"
    or "timed out after S s (ranks still running: [...])". The other ranks are terminated.

    Every rank is stopped before this returns or raises, an ``Interrupted`` or
    ``KeyboardInterrupt`` included (at once then: SIGTERM, SIGKILL after ``_TERM_S``); if this
    process dies without that (SIGKILL, a second signal's ``os._exit``), the ranks die with it
    (``_die_with_parent``). The ranks stay in this process's group: a terminal's Ctrl-C / Ctrl-Z,
    ``timeout`` or ``kill -- -PGID`` reach the whole run, as they would a single process.
    """
    if backend not in ("gloo", "nccl"):
        raise MoetoolError(f"unknown distributed backend {backend!r} (expected gloo or nccl)")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise MoetoolError(f"--backend nccl needs {world_size} GPUs, found {torch.cuda.device_count()}")
    if collective_timeout_s is None:
        collective_timeout_s = timeout_s
    host = "127.0.0.1"
    # the parent owns the rendezvous store: port 0 lets the OS pick a free port, no race
    store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=collective_timeout_s))
    ctx = _rank_context(preload)
    q = ctx.Queue()
    env = dict(os.environ)
    credits = [ctx.Semaphore(window) if on_message is not None else None for _ in range(world_size)]
    procs = [ctx.Process(target=_rank_main, name=f"moetool-rank{r}", daemon=True,
                         args=(r, world_size, backend, host, store.port, collective_timeout_s,
                               os.getpid(), env, fn, args, q, credits[r]))
             for r in range(world_size)]
    reports: dict[int, _Report] = {}
    failure: str | None = None
    watched = False
    try:
        for p in procs:  # inside the try: an interruption between two starts stops the first ones
            try:
                p.start()
            except (EOFError, ConnectionError):  # the fork server skips a preload's ImportError only
                raise MoetoolError(f"the fork server that starts the ranks died while importing "
                                   f"{', '.join([__name__, *preload])} (its error is above); "
                                   f"{fork_server.START_ENV}=spawn starts the ranks without it") from None
        failure = _watch(procs, q, reports, timeout_s, _Messages(on_message, credits), abort)
        watched = True
    finally:
        # after an exception (Interrupted, KeyboardInterrupt) there is nothing to wait for
        _stop(procs, _EXIT_S if watched else 0.0)
        q.close()
        q.cancel_join_thread()
        del store
    if failure is not None:
        raise MoetoolError(failure)
    return [pickle.loads(reports[r].payload) for r in range(world_size)]


@dataclass
class _Messages:
    """Where the ranks' ``send_to_parent`` messages go: ``on_message`` (None: a world without)."""

    on_message: Callable | None
    credits: list
    taken_at: float | None = None  # time.monotonic() of the last message

    def take(self, rep: _Report) -> None:
        if self.on_message is None:
            raise MoetoolError(f"rank {rep.rank} sent a message to a parent that takes none")
        self.on_message(rep.rank, pickle.loads(rep.payload), self.credits[rep.rank].release)
        self.taken_at = time.monotonic()


def _drain(q, reports: dict[int, _Report], block_s: float, messages: _Messages | None = None) -> None:
    try:
        rep = q.get(timeout=block_s) if block_s > 0 else q.get_nowait()
        while True:
            if rep.message:
                if messages is not None and rep.rank not in reports:
                    messages.take(rep)
            else:
                reports.setdefault(rep.rank, rep)
            rep = q.get_nowait()
    except queue_mod.Empty:
        pass


def _first_failure(procs, reports: dict[int, _Report]) -> str | None:
    """The cause, not its echoes: a rank that died without reporting (os._exit, a signal,
    the OOM killer) comes first, then the earliest reported exception. Peers that lost
    their connection to the culprit report later."""
    dead = [r for r, p in enumerate(procs) if r not in reports and p.exitcode is not None]
    bad = sorted((r for r in reports.values() if not r.ok), key=lambda r: (r.t, r.rank))
    others = len(dead) + len(bad) - 1
    tail = f" ({others} other rank(s) failed after it)" if others > 0 else ""
    if dead:
        r = dead[0]
        return f"rank {r} exited with code {procs[r].exitcode} before reporting a result{tail}"
    if bad:
        r = bad[0]
        return f"rank {r.rank} failed: {r.payload.decode()}{tail}"
    return None


def _watch(procs, q, reports: dict[int, _Report], timeout_s: float, messages: _Messages | None = None,
           abort: threading.Event | None = None) -> str | None:
    deadline = time.monotonic() + timeout_s
    while len(reports) < len(procs):
        _drain(q, reports, 0.05, messages)
        if abort is not None and abort.is_set():
            return "stopped by the caller"
        dead = any(p.exitcode is not None and r not in reports for r, p in enumerate(procs))
        if dead:
            # a report written just before exit may still be in the pipe
            _drain(q, reports, 0.2, messages)
        if any(not r.ok for r in reports.values()) or (
                dead and any(p.exitcode is not None and r not in reports for r, p in enumerate(procs))):
            grace = time.monotonic() + _GRACE_S
            while time.monotonic() < grace and len(reports) < len(procs):
                _drain(q, reports, 0.05)
            return _first_failure(procs, reports)
        last = messages.taken_at if messages is not None else None
        if time.monotonic() > (deadline if last is None else max(deadline, last + timeout_s)):
            running = [r for r in range(len(procs)) if r not in reports]
            if last is not None:
                return (f"distributed run timed out: nothing came from the ranks for {timeout_s:g} s "
                        f"(ranks still running: {running})")
            return f"distributed run timed out after {timeout_s:g} s (ranks still running: {running})"
    return _first_failure(procs, reports)


def _stop(procs, exit_s: float) -> None:
    """Stop every started rank within exit_s + _TERM_S + 1 s: ``exit_s`` for ranks that are exiting
    on their own, then SIGTERM, ``_TERM_S`` more, then SIGKILL. An exception raised meanwhile (a
    second KeyboardInterrupt) still kills the ranks left before it goes on."""
    started = [p for p in procs if p.pid is not None]
    try:
        _join(started, exit_s)
        for p in started:
            if p.exitcode is None:
                p.terminate()
        _join(started, _TERM_S)
    finally:
        for p in started:
            if p.exitcode is None:
                p.kill()
        _join(started, 1.0)


def _join(procs, timeout_s: float) -> None:
    """Wait until every process has exited or ``timeout_s`` has passed (one deadline for all)."""
    end = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))


def run_under_torchrun(fn: Callable, args: tuple = (), backend: str | None = None,
                       collective_timeout_s: float = 600.0) -> Any:
    """Run ``fn(rank, world_size, *args)`` in a process started by ``torchrun``; returns this
    rank's result. Backend: nccl when CUDA is available, else gloo (unless given). A failure is
    raised as ``MoetoolError`` naming this rank; the group is destroyed either way.

    While it runs, this process dies with its parent, the node's torchrun agent
    (``_die_with_parent``): torchrun starts each worker in its own session, so when the agent is
    SIGKILLed (or OOM-killed) nothing else would stop it. An agent that died before this call is
    not noticed (torchrun does not tell its workers its pid); such a worker's collectives still
    end within ``collective_timeout_s``."""
    try:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]  # noqa: B018 - checked, env:// reads them
    except KeyError as e:
        raise MoetoolError(f"not started by torchrun: environment variable {e.args[0]} is not set") from None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and local_rank >= torch.cuda.device_count():
        raise MoetoolError(f"rank {rank}: LOCAL_RANK {local_rank} has no GPU on this node "
                           f"({torch.cuda.device_count()} found): start at most that many processes per node "
                           "(torchrun --nproc-per-node), or pass --backend gloo")
    with _die_with_parent(os.getppid()):
        device = _setup_rank(backend, local_rank)
        try:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=collective_timeout_s),
                                    device_id=device if backend == "nccl" else None)
            return fn(rank, world_size, *args)
        except MoetoolError as e:
            raise MoetoolError(f"rank {rank} failed: {e}") from e
        except Exception as e:
            raise MoetoolError(f"rank {rank} failed: {_one_line(e)}") from e
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
