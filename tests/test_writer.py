"""The background writer: writes in order on a thread of their own, a queue bounded by bytes,
a drain with a deadline and progress lines, failures logged without stopping the others."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest

from coordinator.protocol.writer import BackgroundWriter

pytestmark = pytest.mark.protocol


def test_writes_run_in_order_off_the_callers_thread_and_drain():
    writer = BackgroundWriter("test", max_bytes=1000)
    done, threads = [], set()

    def write(i):
        threads.add(threading.current_thread().name)
        done.append(i)

    assert all(writer.submit(f"write {i}", 10, lambda i=i: write(i)) for i in range(20))
    assert writer.drain(timedelta(seconds=10))
    assert done == list(range(20)) and threads == {"coordinator-test"}
    assert (writer.written, writer.written_bytes, writer.failed, writer.refused) == (20, 200, 0, 0)
    assert writer.pending() == (0, 0)
    writer.close()
    assert not writer.submit("after close", 1, lambda: None) and writer.refused == 1


def test_a_full_queue_refuses_and_a_failed_write_does_not_stop_the_others(caplog):
    writer = BackgroundWriter("test", max_bytes=100)
    release = threading.Event()
    done = []
    assert writer.submit("slow", 60, release.wait)  # running: its bytes no longer queued
    time.sleep(0.2)
    assert writer.submit("a", 60, lambda: done.append("a"))
    assert not writer.submit("b", 60, lambda: done.append("b"))  # 120 queued > 100: refused
    assert writer.submit("c", 30, lambda: 1 / 0)
    assert writer.submit("d", 10, lambda: done.append("d"))
    assert writer.pending() == (4, 160)
    release.set()
    with caplog.at_level(logging.WARNING, logger="coordinator.protocol.writer"):
        assert writer.drain(10.0)
    assert done == ["a", "d"] and (writer.written, writer.failed, writer.refused) == (3, 1, 1)
    assert [r.getMessage() for r in caplog.records] == ["test: c failed: division by zero"]
    # One write larger than the bound is taken into an empty queue.
    assert writer.submit("big", 1000, lambda: None) and writer.drain(10.0)
    writer.close()


def test_drain_stops_at_its_deadline_with_progress_lines(caplog):
    writer = BackgroundWriter("test", max_bytes=10**9, progress_interval=timedelta(seconds=0.2))
    release = threading.Event()
    writer.submit("stuck", 5_000_000, release.wait)
    writer.submit("next", 1_000_000, lambda: None)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="coordinator.protocol.writer"):
        assert not writer.drain(timedelta(seconds=1))
    assert 0.9 < time.monotonic() - started < 5
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) >= 3 and lines[0].startswith("test: waiting for 2 writes (6.0 MB) to finish, 0s of 1s"), lines
    writer.close()
    assert writer.pending() == (1, 5_000_000)  # the running write; the queued one dropped
    release.set()
