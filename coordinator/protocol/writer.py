"""Writes that must not sit on a compile's critical path, done by a thread of their own.

A :class:`BackgroundWriter` takes writes (what it is, its size, a function that does it)
and runs them one after another on a daemon thread, in the order given. The thread starts
with the writer, so that a first write submitted while the interpreter exits (from an
``atexit`` handler, where Python 3.12 and later refuse to start threads) still runs. Its queue is
bounded by bytes: a write that would take it past ``max_bytes`` is refused (``submit``
returns False) rather than holding more memory or making the caller wait (one larger
than ``max_bytes`` is taken only into an empty queue). At the end,
:meth:`BackgroundWriter.drain` waits for what is queued until a deadline, logging a
progress line while it waits, and :meth:`BackgroundWriter.close` stops the thread and drops
what is left. A write that raises anything, ``BaseException`` included, is logged and
counted; the ones after it still run (a caller that wants to stop after a failure makes its
own writes do nothing).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

log = logging.getLogger(__name__)


class BackgroundWriter:
    """One daemon thread running submitted writes in order, at most ``max_bytes`` queued."""

    def __init__(self, name: str, max_bytes: int, *, progress_interval: timedelta = timedelta(seconds=10)) -> None:
        self.name = name
        self.max_bytes = max_bytes
        self.progress_interval = progress_interval.total_seconds()
        self._queue: collections.deque[tuple[str, int, Callable[[], None]]] = collections.deque()
        self._queued_bytes = 0
        self._running: tuple[str, int] | None = None
        self._changed = threading.Condition()
        self._closed = False
        #: Writes done, writes that raised, writes refused (queue full or closed).
        self.written = self.failed = self.refused = 0
        #: Bytes of the writes done.
        self.written_bytes = 0
        self._thread = threading.Thread(target=self._run, name=f"coordinator-{name}", daemon=True)
        self._thread.start()

    def submit(self, what: str, nbytes: int, fn: Callable[[], None]) -> bool:
        """Queue ``fn`` (a write of ``nbytes`` bytes, described as ``what`` in log lines).

        Returns:
            False if it was refused: the queue would hold more than ``max_bytes``, or the
            writer is closed.
        """
        with self._changed:
            if self._closed or (self._queued_bytes + nbytes > self.max_bytes and self._queue):
                self.refused += 1
                return False
            self._queue.append((what, nbytes, fn))
            self._queued_bytes += nbytes
            self._changed.notify_all()
        return True

    def pending(self) -> tuple[int, int]:
        """(writes queued or running, their bytes)."""
        with self._changed:
            running = self._running
            return (len(self._queue) + (running is not None),
                    self._queued_bytes + (running[1] if running is not None else 0))

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                what, nbytes, fn = self._queue.popleft()
                self._queued_bytes -= nbytes
                self._running = (what, nbytes)
            try:
                fn()
                ok = True
            except BaseException as exc:  # one failed write, whatever it raised, must not stop the others
                log.warning("%s: %s failed: %s", self.name, what, exc or type(exc).__name__)
                ok = False
            with self._changed:
                self._running = None
                if ok:
                    self.written += 1
                    self.written_bytes += nbytes
                else:
                    self.failed += 1
                self._changed.notify_all()

    def drain(self, timeout: timedelta | float) -> bool:
        """Wait until every queued write has run, or ``timeout`` passes; log progress every
        ``progress_interval`` meanwhile.

        Returns:
            Whether nothing is left.
        """
        timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        started = time.monotonic()
        deadline = started + timeout_s
        next_line = started + self.progress_interval
        with self._changed:
            while self._queue or self._running is not None:
                now = time.monotonic()
                if now >= deadline:
                    return False
                if now >= next_line:
                    writes = len(self._queue) + (self._running is not None)
                    log.info("%s: waiting for %d writes (%.1f MB) to finish, %.0fs of %.0fs", self.name, writes,
                             (self._queued_bytes + (self._running[1] if self._running else 0)) / 1e6,
                             now - started, timeout_s)
                    next_line = now + self.progress_interval
                self._changed.wait(min(deadline, next_line) - now)
        return True

    def close(self) -> None:
        """Stop taking writes and stop the thread once the write it runs ends; queued ones
        are dropped."""
        with self._changed:
            self._closed = True
            self._queue.clear()
            self._queued_bytes = 0
            self._changed.notify_all()
