"""Start one process per rank and run a function in each, with errors that never hang.

Two ways in:

- ``spawn_world(fn, world_size, ...)``: single node; the parent spawns the ranks
  (``multiprocessing`` spawn context), watches them and the result queue, and returns the
  per-rank results. A rank that raises or dies stops the whole run within a bounded time
  with one ``MoetoolError`` naming the rank.
- ``run_under_torchrun(fn, args)``: the process was started by ``torchrun`` (one node or
  many); RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT come from the env.

``fn(rank, world_size, *args)`` runs with the default process group initialised (gloo on
CPU, NCCL on ``cuda:LOCAL_RANK``) and must be a module-level function (spawn pickles it).
What it returns travels to the parent by value (CPU tensors, numbers, dicts, lists...).
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from moetool.errors import MoetoolError

#: seconds the parent keeps collecting reports after the first failure, so that the rank
#: that failed first (the cause) is named rather than a peer that lost its connection
_GRACE_S = 1.0
#: seconds given to a terminated rank before it is killed
_TERM_S = 5.0


@dataclass(frozen=True)
class _Report:
    rank: int
    ok: bool
    t: float  # time.time() when the rank finished or failed
    payload: bytes  # ok: pickled result; else: one-line error text, utf-8


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


def _rank_main(rank: int, world_size: int, backend: str, host: str, port: int,
               pg_timeout_s: float, fn: Callable, args: tuple, q) -> None:
    """Entry point of a spawned rank: init, run, report, always destroy the group."""
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
                timeout_s: float = 600.0, collective_timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return the results
    in rank order.

    ``timeout_s`` bounds the whole run; ``collective_timeout_s`` (default: ``timeout_s``) is
    the process-group timeout, so no collective waits forever. Raises ``MoetoolError`` with
    one line: "rank R failed: ExcType: message", "rank R exited with code C before reporting"
    or "timed out after S s (ranks still running: [...])". The other ranks are terminated.
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
    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, name=f"moetool-rank{r}", daemon=True,
                         args=(r, world_size, backend, host, store.port, collective_timeout_s,
                               fn, args, q))
             for r in range(world_size)]
    for p in procs:
        p.start()
    reports: dict[int, _Report] = {}
    failure: str | None = None
    try:
        failure = _watch(procs, q, reports, timeout_s)
    finally:
        _stop(procs)
        q.close()
        q.cancel_join_thread()
        del store
    if failure is not None:
        raise MoetoolError(failure)
    return [pickle.loads(reports[r].payload) for r in range(world_size)]


def _drain(q, reports: dict[int, _Report], block_s: float) -> None:
    try:
        rep = q.get(timeout=block_s) if block_s > 0 else q.get_nowait()
        reports.setdefault(rep.rank, rep)
        while True:
            rep = q.get_nowait()
            reports.setdefault(rep.rank, rep)
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


def _watch(procs, q, reports: dict[int, _Report], timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    while len(reports) < len(procs):
        _drain(q, reports, 0.05)
        dead = any(p.exitcode is not None and r not in reports for r, p in enumerate(procs))
        if dead:
            # a report written just before exit may still be in the pipe
            _drain(q, reports, 0.2)
        if any(not r.ok for r in reports.values()) or (
                dead and any(p.exitcode is not None and r not in reports for r, p in enumerate(procs))):
            grace = time.monotonic() + _GRACE_S
            while time.monotonic() < grace and len(reports) < len(procs):
                _drain(q, reports, 0.05)
            return _first_failure(procs, reports)
        if time.monotonic() > deadline:
            running = [r for r in range(len(procs)) if r not in reports]
            return f"distributed run timed out after {timeout_s:g} s (ranks still running: {running})"
    return _first_failure(procs, reports)


def _stop(procs) -> None:
    for p in procs:
        p.join(timeout=0.0 if p.exitcode is not None else 0.5)
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + _TERM_S
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=1.0)


def run_under_torchrun(fn: Callable, args: tuple = (), backend: str | None = None,
                       collective_timeout_s: float = 600.0) -> Any:
    """Run ``fn(rank, world_size, *args)`` in a process started by ``torchrun``; returns this
    rank's result. Backend: nccl when CUDA is available, else gloo (unless given). A failure is
    raised as ``MoetoolError`` naming this rank; the group is destroyed either way."""
    try:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]  # noqa: B018 - checked, env:// reads them
    except KeyError as e:
        raise MoetoolError(f"not started by torchrun: environment variable {e.args[0]} is not set") from None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
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
