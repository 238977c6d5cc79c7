"""The fork server verify's ranks are forked from (Linux): its start and what it imports.

Torch-free, so that ``moetool verify`` can start it before this process imports torch: the
server is a fresh interpreter importing torch, moetool's rank runtime and (--whole-model)
transformers' modeling code beside the command's own imports, instead of after them (7-9 s
of a cold start on a GPU host, every second of it before the first rank could start).
``moetool.verify.launch`` starts the ranks through it; a server already running is reused,
whatever a later start asks it to import (the ranks then import the rest themselves).
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver as mp_forkserver
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

#: environment variable: ``spawn`` starts every rank as a fresh interpreter, as before the fork
#: server (a way around it, should a system's fork server misbehave)
START_ENV = "MOETOOL_RANK_START"

#: imported first by every server: it ends with the process that started it (its main thread)
TIE = "moetool.verify.server_tie"
#: the module that starts the ranks (imported by every server)
LAUNCH = "moetool.verify.launch"
#: imported first by every server: it notes the files its imports open, for the code warm-up
#: of the next run (:mod:`moetool.read.code_files`; the ranks inherit it)
WATCH = "moetool.read.code_watch"
#: what the ranks of a MoE-only check import
MOE_ONLY_MODULES = ("moetool.verify.rank",)
#: what the ranks of a --whole-model check import: transformers' shared modeling code too (the
#: family's own module is a small part of it: 0.04 s of 1.15 s here)
WHOLE_MODEL_MODULES = ("moetool.verify.whole_model", "moetool.verify.rank", "transformers.modeling_utils")


def forks() -> bool:
    """Whether ranks start by forking from the server (Linux, unless ``MOETOOL_RANK_START=spawn``)."""
    return (sys.platform.startswith("linux") and "forkserver" in mp.get_all_start_methods()
            and os.environ.get(START_ENV, "forkserver") != "spawn")


def start(preload: Sequence[str] = ()) -> bool:
    """Start the server now, importing ``TIE``, ``WATCH``, ``LAUNCH`` and ``preload``, unless one runs
    already (or ranks are spawned: False). It imports while this process goes on; the first rank
    waits for it."""
    if not forks():
        return False
    mp_forkserver.set_forkserver_preload(list(dict.fromkeys((TIE, WATCH, LAUNCH, *preload))))
    with _sigint_ignored(), _server_env():
        mp_forkserver.ensure_running()
    return True


#: held while this process's environment is the server's (starts may come from several threads)
_env_lock = threading.Lock()
#: environment variable read by ``TIE`` in the server: the pid of the process whose main thread started it
PARENT_ENV = "MOETOOL_FORK_SERVER_PARENT"


@contextmanager
def _server_env() -> Iterator[None]:
    """The server's environment while it starts: ``PARENT_ENV`` naming this process where the
    start comes from its main thread (``TIE`` then has the server end with it), and PYTHONPATH
    holding this process's ``sys.path``. multiprocessing hands the server that path, but its
    ``forkserver.main`` ignored it up to Python 3.12.7 / 3.13.0 (CPython gh-117378; 3.10 and
    3.11 keep it), so a preload importable only through an entry added at run time (a script's
    ``sys.path.insert``, pytest's) was skipped as an ImportError and every rank imported it
    itself. The ranks take this process's environment back (``launch._rank_main``); entries
    twice on the server's path are harmless (site drops them)."""
    main = threading.current_thread() is threading.main_thread()
    with _env_lock:
        before = {name: os.environ.get(name) for name in ("PYTHONPATH", PARENT_ENV)}
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # "": the working folder, the server's too
        if main:
            os.environ[PARENT_ENV] = str(os.getpid())
        else:
            os.environ.pop(PARENT_ENV, None)
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while the server is started, which inherits that: a Ctrl-C during its
    seconds of imports (the terminal signals every process of the command) printed the
    server's KeyboardInterrupt traceback under the command's one-line "interrupted". The
    server ignores SIGINT once it serves anyway; its ranks get the default handler back
    (``launch._rank_main``). Only the main thread may change handlers: elsewhere, as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)  # None: set outside Python
