"""SIGINT / SIGTERM for a command: the first raises :class:`~moetool.errors.Interrupted` in the
main thread, so every ``finally`` runs (sinks closed, rank processes stopped); a second one
while the first is being handled (a stuck clean-up) ends the process at once.

Python runs signal handlers in the main thread only, but the kernel may hand a process's
signal to any of its threads that does not block it. Caught by a worker thread (a copying
thread, a thread torch or gloo started), the signal only marks the handler as due; a main
thread asleep in ``future.result()`` or ``Thread.join()`` is not woken and runs it once that
wait ends: ``shard`` sat for as long as its copying threads took (60 s in a test whose thread
waited for the interrupt). So a relay thread watches the signal wake-up descriptor and, when
the handler has not run within ``RELAY_AFTER_S``, sends the signal to the main thread itself,
whose wait it then interrupts.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

from moetool.errors import Interrupted

#: signals that stop a command (exit status 128 + the signal: 130, 143)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: how long the main thread has to run the handler on its own before the relay sends it the signal
RELAY_AFTER_S = 0.05


class _StopHandler:
    """The handler and its relay's shared state (``lock`` taken by both, never held while
    waiting; reentrant, as a second signal's handler can run inside the first one's)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.stopping: list[int] = []  # the signal being handled
        self.relayed = False  # the relay sent the main thread a copy of a signal not yet handled

    def __call__(self, signum, frame) -> None:
        with self.lock:
            if self.stopping:
                if self.relayed:  # the relay's copy of the signal already being handled
                    self.relayed = False
                    return
                os._exit(128 + self.stopping[0])
            self.stopping.append(signum)
            self.relayed = False  # a copy sent meanwhile is this same call (the flags coalesce)
        raise Interrupted(signum)

    def relay(self, signum: int, main_ident: int) -> None:
        """``signum`` reached some thread: wait for the main thread to handle it, else send it there."""
        deadline = time.monotonic() + RELAY_AFTER_S
        while time.monotonic() < deadline:
            if self.stopping:
                return
            time.sleep(0.005)
        with self.lock:
            if self.stopping:
                return
            self.relayed = True
            try:
                signal.pthread_kill(main_ident, signum)
            except OSError:  # the main thread is gone
                self.relayed = False


def catch_stop_signals() -> Callable[[], None]:
    """Install the STOP_SIGNALS handler and its relay (main thread only; elsewhere nothing is
    installed). Returns the function that restores what was there before."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    handler = _StopHandler()
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    restore_relay = _start_relay(handler)

    def restore() -> None:
        restore_relay()
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def _start_relay(handler: _StopHandler) -> Callable[[], None]:
    """The relay thread, reading the signal numbers Python writes to its wake-up descriptor;
    returns its stop. Without one (no pipe, a wake-up descriptor someone else set) nothing runs."""
    try:
        read_fd, write_fd = os.pipe()
    except OSError:
        return lambda: None
    os.set_blocking(write_fd, False)  # as set_wakeup_fd requires: a full pipe never blocks a handler
    try:
        old = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        old = None
    if old != -1:  # someone else's descriptor (asyncio's): left to them
        if old is not None:
            signal.set_wakeup_fd(old)
        os.close(read_fd)
        os.close(write_fd)
        return lambda: None
    main_ident = threading.main_thread().ident
    stops = {int(s) for s in STOP_SIGNALS}

    def run() -> None:
        try:
            while True:
                data = os.read(read_fd, 64)
                if not data:  # the write end closed: restored
                    return
                for signum in data:
                    if signum in stops:
                        handler.relay(signum, main_ident)
        except OSError:
            return
        finally:
            os.close(read_fd)

    threading.Thread(target=run, name="moetool-signal-relay", daemon=True).start()

    def stop() -> None:
        signal.set_wakeup_fd(-1)
        os.close(write_fd)

    return stop
