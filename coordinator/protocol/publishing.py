"""Publishing a claimed key's value, in front of the compile or behind it, and giving it up.

A claimant writes ``v/<key>`` and then ends its claim (``Claims.published``: the end signal,
the "done" marker, the claim's keys deleted). A value written behind the compile goes to the
writer (``coordinator.protocol.writer``) with its claim handed off, so that the claimant may
wait on other claims while it is written. A value that cannot be written (the store is down
or refuses writes, the value is larger than the store can hold, the writer's queue is full)
abandons its claim instead (``Claims.abandon``: at once where the store answers, else from the
heartbeat thread), which ends its waiters' waits. The marks a process sets
once (``n/<key>/<mark>``) are written here too. ``coordinator.protocol.singleflight``
describes the protocol.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable
from datetime import timedelta

from coordinator.errors import StoreError
from coordinator.protocol.claims import Claims
from coordinator.protocol.health import StoreHealth
from coordinator.protocol.stores.base import Store
from coordinator.protocol.writer import BackgroundWriter

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Publisher:
    """One process's writes of the values it claimed, and its claims' abandonment."""

    store: Store
    claims: Claims
    health: StoreHealth
    #: Where :meth:`publish_behind` writes run (``None``: in the caller's thread).
    writer: BackgroundWriter | None
    _told_full: bool = dataclasses.field(default=False, init=False)
    _told_too_large: bool = dataclasses.field(default=False, init=False)

    def publish(self, key: str, value: bytes) -> bool:
        """See :meth:`coordinator.protocol.singleflight.Singleflight.publish`."""
        if not self.health.writable():
            self.claims.abandon(key)
            return False
        try:
            unsent = self._too_large(len(value))
            if not unsent:
                self.store.set(f"v/{key}", value)
        except StoreError as exc:
            self.health.failed(exc)
            unsent = True
        if unsent:
            self.claims.abandon(key)
            return False
        self.claims.published(key, value)
        return True

    def publish_behind(self, key: str, value: Callable[[], bytes], *, nbytes: int, what: str,
                       published: Callable[[bool, bytes], None] | None = None) -> bool:
        """See :meth:`coordinator.protocol.singleflight.Singleflight.publish_behind`."""
        def write() -> None:
            try:
                blob = value()
            except BaseException:
                self.claims.abandon(key)
                raise
            ok = self.publish(key, blob)
            if published is not None:
                published(ok, blob)

        if self.writer is None:
            write()
            return True
        self.claims.hand_off(key)
        if self.writer.submit(what, nbytes, write):
            return True
        if not self._told_full:
            self._told_full = True
            log.warning("compile_once: %.1f MB wait to be published, the bound is %.1f MB (publish_queue_mb): %s is "
                        "not published; other ranks compile it", self.writer.pending()[1] / 1e6,
                        self.writer.max_bytes / 1e6, what)
        self.claims.abandon(key)
        return False

    def _too_large(self, size: int) -> bool:
        """Whether a value of ``size`` bytes is larger than the store can hold (said once)."""
        limit = self.store.capacity()
        if limit is None or size <= limit:
            return False
        if not self._told_too_large:
            self._told_too_large = True
            log.warning("coordinator store %s holds at most %d bytes (%.2f MB: maxmemory less the server's own use); "
                        "a value of %d bytes (%.2f MB) is not sent to it, nor any other value over that limit: "
                        "each rank compiles those graphs", self.store.name, limit, limit / 1e6, size, size / 1e6)
        return True

    def abandon_all(self, only: Callable[[str], bool]) -> int:
        """See :meth:`coordinator.protocol.singleflight.Singleflight.abandon_all`."""
        keys = [key for key in self.claims.keys() if only(key)]
        for key in keys:
            self.claims.abandon(key, publishing=False)
        return len(keys)

    def drain(self, timeout: timedelta) -> bool:
        """Let the writes behind the compile finish, up to ``timeout``; whether all did."""
        if self.writer is None:
            return True
        writes, nbytes = self.writer.pending()
        if writes and self.writer.drain(timeout):
            return True
        if writes:
            log.warning("compile_once: %d entries (%.1f MB) were not published within %.0fs; the ranks or jobs that "
                        "need them compile them", writes, nbytes / 1e6, timeout.total_seconds())
            return False
        return True

    def first_to_mark(self, key: str, mark: str | int, *, ttl: timedelta | None = None) -> bool:
        """See :meth:`coordinator.protocol.singleflight.Singleflight.first_to_mark`."""
        # A value of this call's own: a store whose create-if-absent returns the value it
        # found (the c10d store's compare_set) must not tell a second setter it was first.
        return self.store.add_if_absent(f"n/{key}/{mark}", uuid.uuid4().hex.encode(), ttl=ttl)

    def unmark(self, key: str, mark: str | int) -> None:
        """See :meth:`coordinator.protocol.singleflight.Singleflight.unmark`."""
        self.store.delete(f"n/{key}/{mark}")

    def close(self) -> None:
        """Stop the writer (what it has not written is lost) and abandon every claim still
        held, those being written included."""
        if self.writer is not None:
            self.writer.close()
        for key in self.claims.keys(publishing=True):
            self.claims.abandon(key)
