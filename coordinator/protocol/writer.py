"""Writes behind the compile: a rank's store writes, in one background thread.

A rank that compiled a graph publishes its entries (sealed, copied to the node, written to
the store), and a job that persists its compile writes them further; none of that is the
compile's business. :class:`BackgroundWriter` takes each write as a function and runs it in
a thread of its own, in the order given, so that the compile goes on at once:

* **Bounded.** The writes waiting hold at most ``max_bytes`` (their values' sizes as the
  submitter gives them). A write that would pass the bound is refused at once
  (:meth:`BackgroundWriter.submit` returns False, the first refusal is logged): the
  caller gives up what it meant to write (a claim it releases), so that a slow store
  costs other ranks a compile, never this rank's time. ``max_bytes=0`` runs every write in
  the caller's thread, as it comes.
* **Drained.** :meth:`BackgroundWriter.drain` waits until every write submitted so far
  has run, up to a deadline, with a progress line while it waits; a session drains its
  writer when it closes, so a process that exits normally loses nothing. A process that
  dies loses the writes still waiting: what they carried is missing from the store, and
  the next rank or job to need it compiles it.
* **Never fatal.** A write that raises is logged and counted; the next one runs.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WriterCounts:
    """What one writer did."""

    #: Writes run (in the background or, with no bound, in the caller's thread).
    written: int = 0
    #: Writes refused because the queue was full.
    refused: int = 0
    #: Writes that raised.
    failed: int = 0
    #: The most bytes that waited at once.
    peak_bytes: int = 0


class BackgroundWriter:
    """Runs submitted writes in one daemon thread, in order, within a byte bound."""

    def __init__(self, name: str, max_bytes: int) -> None:
        self.name = name
        self.max_bytes = max_bytes
        self.counts = WriterCounts()
        self._queue: collections.deque[tuple[str, int, Callable[[], None]]] = collections.deque()
        self._bytes = 0  # waiting or running
        self._running = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._told_full = False

    def submit(self, what: str, nbytes: int, write: Callable[[], None]) -> bool:
        """Run ``write`` (described as ``what``, carrying ``nbytes``) behind the caller.

        Returns:
            False if it was refused (the queue holds too many bytes already): it will
            never run.
        """
        if self.max_bytes <= 0:
            self._run(what, write)
            return True
        with self._cond:
            if self._bytes and self._bytes + nbytes > self.max_bytes:
                self.counts.refused += 1
                if not self._told_full:
                    self._told_full = True
                    log.warning("compile_once: the %s queue holds %.1f MB, its bound is %.1f MB: %s is not "
                                "written (the store is slower than the compile; other ranks compile what is not "
                                "published)", self.name, self._bytes / 1e6, self.max_bytes / 1e6, what)
                return False
            self._queue.append((what, nbytes, write))
            self._bytes += nbytes
            self.counts.peak_bytes = max(self.counts.peak_bytes, self._bytes)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"coordinator-{self.name}", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def pending(self) -> int:
        """Writes submitted and not yet finished."""
        with self._cond:
            return len(self._queue) + self._running

    def drain(self, timeout: timedelta, progress_interval: timedelta = timedelta(seconds=10)) -> bool:
        """Wait until every write submitted so far has run, at most ``timeout``, logging
        what is left every ``progress_interval``. Returns whether all ran."""
        deadline = time.monotonic() + timeout.total_seconds()
        next_line = time.monotonic() + progress_interval.total_seconds()
        with self._cond:
            while self._queue or self._running:
                now = time.monotonic()
                if now >= deadline:
                    log.warning("compile_once: %d %s writes (%.1f MB) did not finish within %.0fs; the next job "
                                "compiles what they carried", len(self._queue) + self._running, self.name,
                                self._bytes / 1e6, timeout.total_seconds())
                    return False
                if now >= next_line:
                    log.info("compile_once: finishing %d %s writes (%.1f MB) before exit",
                             len(self._queue) + self._running, self.name, self._bytes / 1e6)
                    next_line = now + progress_interval.total_seconds()
                self._cond.wait(min(deadline, next_line) - now)
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                what, nbytes, write = self._queue.popleft()
                self._running = 1
            try:
                self._run(what, write)
            finally:
                with self._cond:
                    self._running = 0
                    self._bytes -= nbytes
                    self._cond.notify_all()

    def _run(self, what: str, write: Callable[[], None]) -> None:
        try:
            write()
            self.counts.written += 1
        except Exception:
            self.counts.failed += 1
            log.warning("compile_once: writing %s failed", what, exc_info=True)
