"""The background writer: writes in order on a thread of their own, a queue bounded by bytes,
a drain with a deadline and progress lines, failures logged without stopping the others."""

from __future__ import annotations

import logging
import subprocess
import sys
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
    started, release = threading.Event(), threading.Event()
    done = []
    assert writer.submit("slow", 60, lambda: (started.set(), release.wait()))
    assert started.wait(10)  # running: its bytes no longer queued
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


class _Interrupt(BaseException):
    """Not an ``Exception``: what a write may raise that a plain ``except Exception`` misses."""


def test_a_write_that_raises_a_base_exception_leaves_the_writer_working(caplog):
    writer = BackgroundWriter("test", max_bytes=1000)
    done = []

    def interrupted():
        raise _Interrupt("stop here")

    with caplog.at_level(logging.WARNING, logger="coordinator.protocol.writer"):
        assert writer.submit("interrupted", 10, interrupted)
        assert writer.submit("exits", 10, lambda: exit(3))
        assert writer.submit("after", 10, lambda: done.append("after"))
        assert writer.drain(timedelta(seconds=10))  # nothing left running
    assert done == ["after"] and (writer.written, writer.failed) == (1, 2) and writer.pending() == (0, 0)
    assert [r.getMessage() for r in caplog.records] == ["test: interrupted failed: stop here", "test: exits failed: 3"]
    writer.close()


def test_the_thread_runs_from_the_start_so_a_write_submitted_at_exit_runs(tmp_path):
    # Python 3.12 and later refuse to start a thread from an atexit handler: the writer's
    # thread must already run when the first write comes then.
    writer = BackgroundWriter("eager", max_bytes=1000)
    assert any(t.name == "coordinator-eager" and t.is_alive() for t in threading.enumerate())
    writer.close()
    out = tmp_path / "written"
    script = f"""
import atexit
from coordinator.protocol.writer import BackgroundWriter
writer = BackgroundWriter("at-exit", max_bytes=1000)
def at_exit():
    assert writer.submit("at exit", 1, lambda: open({str(out)!r}, "w").write("ok"))
    assert writer.drain(10.0)
atexit.register(at_exit)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert out.read_text() == "ok"
