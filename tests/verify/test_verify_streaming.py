"""Results handed over while the ranks run (``send_to_parent``) and each layer compared as soon
as both sides have it: in order, never more than the window outstanding, a parent that takes
none times the rank out, and a failed comparison or reference stops the world."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from moetool.errors import MoetoolError
from moetool.verify import driver, launch


def _send_numbered(rank: int, world_size: int, count: int) -> str:
    for n in range(count):
        assert launch.send_to_parent({"n": n, "t": torch.full((4,), float(n))})
    return "done"


def test_messages_arrive_in_order_with_at_most_the_window_outstanding():
    outstanding, most, seen = {0: 0, 1: 0}, {0: 0, 1: 0}, {0: [], 1: []}
    lock = threading.Lock()

    def release_later(rank, release):
        time.sleep(0.05)
        with lock:
            outstanding[rank] -= 1
        release()

    def on_message(rank, obj, release):
        with lock:
            outstanding[rank] += 1
            most[rank] = max(most[rank], outstanding[rank])
        seen[rank].append((obj["n"], float(obj["t"][0])))
        threading.Thread(target=release_later, args=(rank, release)).start()

    got = launch.spawn_world(_send_numbered, 2, "gloo", args=(6,), timeout_s=120, on_message=on_message, window=2)
    assert got == ["done", "done"]
    assert all(seen[r] == [(n, float(n)) for n in range(6)] for r in (0, 1))
    assert max(most.values()) == 2  # the ranks waited for the parent, never ran further ahead


def test_a_parent_that_releases_nothing_times_the_rank_out():
    t0 = time.monotonic()
    with pytest.raises(MoetoolError, match=r"rank \d: the parent released none of its earlier results for 2 s"):
        launch.spawn_world(_send_numbered, 2, "gloo", args=(3,), timeout_s=60, collective_timeout_s=2,
                           on_message=lambda rank, obj, release: None, window=2)
    assert time.monotonic() - t0 < 30


def test_outside_a_world_with_a_parent_nothing_is_sent():
    assert launch.send_to_parent({"n": 0}) is False


def _verify(verify_chain, verify_shards, **kw):
    model, _ = verify_chain
    return driver.verify(verify_shards("fp8-block", 2), model,
                         driver.VerifyOptions(ep=2, tokens=16, dispatch="all2all", **kw))


def test_the_parent_holds_at_most_the_window_of_layers(monkeypatch, verify_chain, verify_shards):
    held = []
    original = driver.LayerCollector._compare_if_ready

    def counting(self, key):
        with self._cond:
            held.append((len(self._refs), max((len(v) for v in self._outputs.values()), default=0),
                         len(self._outputs)))
        return original(self, key)

    monkeypatch.setattr(driver.LayerCollector, "_compare_if_ready", counting)
    monkeypatch.setattr(driver, "COMPARE_WINDOW", 1)
    plain = _verify(verify_chain, verify_shards)
    assert plain.passed and len(plain.layers) == 2
    assert held and max(r for r, _, _ in held) <= 1 and max(n for _, _, n in held) <= 2
    monkeypatch.undo()
    again = _verify(verify_chain, verify_shards)  # the window changes when, not what, is compared
    assert [(l.rel_err, l.worst_expert_rel_err) for l in again.layers] == \
        [(l.rel_err, l.worst_expert_rel_err) for l in plain.layers]


def test_a_failed_comparison_stops_the_world(monkeypatch, verify_chain, verify_shards):
    def broken(reference, per_rank, dp):
        raise MoetoolError("comparison broken on purpose")

    monkeypatch.setattr(driver, "compare_layer", broken)
    with pytest.raises(MoetoolError, match="comparison broken on purpose"):
        _verify(verify_chain, verify_shards)


def test_a_failed_reference_is_the_error_reported(monkeypatch, verify_chain, verify_shards):
    original = driver.iter_references

    def failing(*args, **kwargs):
        for n, item in enumerate(original(*args, **kwargs)):
            if n == 1:
                raise MoetoolError("reference broken on purpose")
            yield item

    monkeypatch.setattr(driver, "iter_references", failing)
    t0 = time.monotonic()
    with pytest.raises(MoetoolError, match="reference broken on purpose"):
        _verify(verify_chain, verify_shards)
    assert time.monotonic() - t0 < 60


def _send_slowly(rank: int, world_size: int, count: int, every_s: float, then_hang: bool) -> str:
    for n in range(count):
        time.sleep(every_s)
        launch.send_to_parent({"n": n})
    if then_hang:
        time.sleep(60)
    return "done"


def test_once_messages_come_the_timeout_bounds_the_silence_between_them():
    release = lambda rank, obj, release: release()  # noqa: E731
    t0 = time.monotonic()  # 3 s of messages every 0.6 s: longer than the timeout, never silent for it
    assert launch.spawn_world(_send_slowly, 1, "gloo", args=(5, 0.6, False), timeout_s=2.5,
                              on_message=release) == ["done"]
    assert time.monotonic() - t0 > 2.5
    with pytest.raises(MoetoolError, match=r"nothing came from the ranks for 2.5 s \(ranks still running: \[0\]\)"):
        launch.spawn_world(_send_slowly, 1, "gloo", args=(1, 0.0, True), timeout_s=2.5, on_message=release)


def test_a_layer_asked_for_twice_is_checked_once(verify_chain, verify_shards):
    report = _verify(verify_chain, verify_shards, layers=(2, 1, 2, 1), timeout_s=60)
    assert report.passed and [l.layer for l in report.layers] == [2, 1]
