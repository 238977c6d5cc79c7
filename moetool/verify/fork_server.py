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
    """Start the server now, importing ``WATCH``, ``LAUNCH`` and ``preload``, unless one runs already (or
    ranks are spawned: False). It imports while this process goes on; the first rank waits for it."""
    if not forks():
        return False
    mp_forkserver.set_forkserver_preload(list(dict.fromkeys((WATCH, LAUNCH, *preload))))
    with _sigint_ignored(), _this_sys_path():
        mp_forkserver.ensure_running()
    return True


#: held while this process's PYTHONPATH is the server's (starts may come from several threads)
_env_lock = threading.Lock()


@contextmanager
def _this_sys_path() -> Iterator[None]:
    """PYTHONPATH holding this process's ``sys.path`` while the server starts: multiprocessing
    hands the server that path, but its ``forkserver.main`` ignored it up to Python 3.12.7 /
    3.13.0 (CPython gh-117378; 3.10 and 3.11 keep it), so a preload importable only through an
    entry added at run time (a script's ``sys.path.insert``, pytest's) was skipped as an
    ImportError and every rank imported it itself. The ranks take this process's environment
    back (``launch._rank_main``); entries twice on the server's path are harmless (site drops them)."""
    with _env_lock:
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # "": the working folder, the server's too
        try:
            yield
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before


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
