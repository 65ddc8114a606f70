"""Whether a store may be asked now: a failed store is retried with backoff, never dropped.

A store can fail in two ways, and a process tracks each apart:

* **Down** (a connection refused or lost, a timeout, an I/O error): lookups return at once
  (the rank compiles locally) and nothing is written until the backoff has passed; then
  the next call tries the store again. The backoff starts at ``FIRST_RETRY_S`` and doubles
  at each failed try up to ``LAST_RETRY_S``: a short outage costs the compiles made during
  it, a long one a try every half minute. The first call that succeeds ends it, and
  sharing resumes.
* **Full** (:class:`~coordinator.errors.StoreFull`: Redis at ``maxmemory`` under
  ``noeviction``, a full disk under a directory store): the store is still read (a
  published value is a hit, a claim another rank holds is waited for), but nothing is
  claimed or written until the same backoff has passed; then the next claims try again,
  and the first value published ends it. (A full Redis refuses a large write and may still
  take a small one: only a value written counts.)

Failures met while a backoff runs (a call that was already on its way, the heartbeat
thread) do not lengthen it. Each change is logged once (the failure as a warning, the
recovery at INFO) and the failure is a ``store lost`` event, so the rank's summary says
``failed``.
"""

from __future__ import annotations

import logging
import threading
import time

from coordinator.errors import StoreError, StoreFull
from coordinator.observe.trace import NO_EVENTS, NoEvents

log = logging.getLogger(__name__)

#: The first wait before a failed store is tried again, in seconds...
FIRST_RETRY_S = 1.0
#: ... doubled at each failed try up to this.
LAST_RETRY_S = 30.0


class _Backoff:
    """One way of failing: since when, and when to try again."""

    def __init__(self) -> None:
        self.since: float | None = None  # monotonic time of the first failure; None: healthy
        self.delay = FIRST_RETRY_S
        self.retry_at = 0.0

    def failed(self, now: float) -> bool:
        """Record a failure; returns whether it is the first of an episode."""
        if self.since is None:
            self.since, self.delay, self.retry_at = now, FIRST_RETRY_S, now + FIRST_RETRY_S
            return True
        if now >= self.retry_at:  # the try after the backoff failed too
            self.delay = min(self.delay * 2, LAST_RETRY_S)
            self.retry_at = now + self.delay
        return False

    def due(self, now: float) -> bool:
        return self.since is None or now >= self.retry_at


class StoreHealth:
    """The down and full states of one process's store, and their backoffs."""

    def __init__(self, name: str, events: NoEvents = NO_EVENTS) -> None:
        self.name = name
        self.events = events
        self._down = _Backoff()
        self._full = _Backoff()
        self._lock = threading.Lock()

    def reachable(self) -> bool:
        """Whether the store may be asked now: it is up, or its backoff has passed."""
        with self._lock:
            return self._down.due(time.monotonic())

    def writable(self) -> bool:
        """Whether the store may be written now: up and not full, or their backoffs have passed."""
        with self._lock:
            now = time.monotonic()
            return self._down.due(now) and self._full.due(now)

    def is_down(self) -> bool:
        with self._lock:
            return self._down.since is not None

    def failed(self, exc: StoreError) -> None:
        """A call failed: start or lengthen the backoff of its kind."""
        full = isinstance(exc, StoreFull)
        with self._lock:
            now = time.monotonic()
            first = (self._full if full else self._down).failed(now)
            delay = (self._full if full else self._down).delay
        if not first:
            log.debug("coordinator store %s still %s (%s); next try in %.0fs", self.name,
                      "refuses writes" if full else "fails", exc, delay)
            return
        self.events.instant("store lost", error=str(exc))
        if full:
            log.warning("coordinator store %s refuses writes (%s); reading from it and compiling locally what it "
                        "lacks, writing again in %.0fs", self.name, exc, delay)
        else:
            log.warning("coordinator store %s failed (%s); compiling locally, trying it again in %.0fs",
                        self.name, exc, delay)

    def answered(self) -> None:
        """A call succeeded: the store is up."""
        with self._lock:
            since, self._down.since = self._down.since, None
        if since is not None:
            log.info("coordinator store %s answers again after %.1fs; sharing resumes", self.name,
                        time.monotonic() - since)

    def wrote(self) -> None:
        """A value was written: the store is up and takes writes."""
        self.answered()
        with self._lock:
            since, self._full.since = self._full.since, None
        if since is not None:
            log.info("coordinator store %s takes writes again after %.1fs", self.name, time.monotonic() - since)
