"""read_ahead: results in order, at most ``depth`` reads started ahead of the caller."""
from __future__ import annotations

import threading
import time

import pytest

from moetool.read.experts import read_ahead


@pytest.mark.parametrize("depth", [1, 3])
def test_reads_come_in_order_with_at_most_depth_ahead(depth):
    lock = threading.Lock()
    started, consumed, most_ahead, most_at_once, running = [], [], [0], [0], [0]

    def read(i):
        with lock:
            started.append(i)
            running[0] += 1
            most_at_once[0] = max(most_at_once[0], running[0])
            most_ahead[0] = max(most_ahead[0], i - len(consumed))
        time.sleep(0.01 * (i % 3 == 0))  # some reads slower: later ones finish first
        with lock:
            running[0] -= 1
        return i * 10

    for got in read_ahead(read, 10, depth=depth):
        consumed.append(got)
        time.sleep(0.005)
    assert consumed == [i * 10 for i in range(10)] and sorted(started) == list(range(10))
    assert most_ahead[0] <= depth and most_at_once[0] <= depth
    assert list(read_ahead(read, 0, depth=depth)) == []


def test_a_read_ahead_waits_for_what_it_is_told_to(tmp_path):
    """``after`` (the code warm-up's end) runs on the thread before the first read."""
    import threading
    import time

    from moetool.read.prefetch import read_ahead_ranges

    data = tmp_path / "data.bin"
    data.write_bytes(b"z" * 4096)
    gate, order = threading.Event(), []
    thread = read_ahead_ranges([(data, 0, 4096)], 1 << 20, after=lambda: (gate.wait(10), order.append("after")))
    time.sleep(0.1)
    assert thread.is_alive() and order == []
    gate.set()
    thread.join(10)
    assert not thread.is_alive() and order == ["after"]
