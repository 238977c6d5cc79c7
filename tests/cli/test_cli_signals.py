"""The stop-signal handler's own rules (the real processes are tests/hostile's)."""
from __future__ import annotations

import signal

import pytest

from moetool.cli import signals
from moetool.errors import Interrupted


def test_first_signal_raises_a_relayed_copy_is_swallowed_a_second_one_exits(monkeypatch):
    exits = []

    def _exit(status):
        exits.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(signals.os, "_exit", _exit)
    handler = signals._StopHandler()
    with pytest.raises(Interrupted) as err:
        handler(signal.SIGTERM, None)
    assert err.value.exit_code == 143
    handler.relayed = True  # the relay's copy, delivered after the handler ran
    assert handler(signal.SIGTERM, None) is None and exits == [] and not handler.relayed
    with pytest.raises(SystemExit):
        handler(signal.SIGINT, None)  # the user's second signal: out at once, with the first one's status
    assert exits == [143]


def test_the_relay_sends_nothing_once_the_main_thread_handled_the_signal(monkeypatch):
    sent = []
    monkeypatch.setattr(signals.signal, "pthread_kill", lambda ident, sig: sent.append((ident, sig)))
    handler = signals._StopHandler()
    handler.relay(signal.SIGTERM, 1)  # not handled within RELAY_AFTER_S: sent to the main thread
    assert sent == [(1, signal.SIGTERM)] and handler.relayed
    with pytest.raises(Interrupted):
        handler(signal.SIGTERM, None)
    assert not handler.relayed  # the copy coalesced with the signal it relayed
    handler.relay(signal.SIGTERM, 1)
    assert sent == [(1, signal.SIGTERM)]


def test_restore_leaves_the_handlers_and_wakeup_descriptor_as_they_were():
    before = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    restore = signals.catch_stop_signals()
    assert all(isinstance(signal.getsignal(s), signals._StopHandler) for s in signals.STOP_SIGNALS)
    restore()
    assert {s: signal.getsignal(s) for s in signals.STOP_SIGNALS} == before
    assert signal.set_wakeup_fd(-1) == -1
