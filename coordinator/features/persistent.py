"""The persistent layer: compiled graphs kept between jobs, behind the job's live store.

With ``persist`` set (an object store, ``s3://bucket/prefix``, ``gs://…``, ``az://…``, or a
``file://`` or ``redis://`` store), the ranks still coordinate through the live store (the
job's TCPStore, or the ``store`` setting) exactly as without it, and:

* a lookup that finds nothing in the live store asks the persistent layer first. The rank
  that claimed the key fetches it (the others wait on its claim, as for a compile); a value
  found is verified as every value is (``Context.verify``), published to the live store
  (which ends the claim and wakes the waiters) and returned as a hit. A lookup that does not
  claim (a kind whose lookups never wait, a rank that holds a claim) fetches it itself, and
  a rank whose live store failed reads from the persistent layer alone. A value that fails
  verification is refused (logged, counted) and the rank compiles it, as for a miss;
* every value of an Inductor cache that the session publishes is written to the persistent
  layer in the background (:class:`~coordinator.protocol.writer.BackgroundWriter`, at most
  ``MAX_QUEUED_BYTES`` queued), by the job's first rank to publish it, never on a compile's
  critical path, unless the layer already holds it. When the session closes, the writes
  still queued are drained for up to ``drain_timeout``, with a progress line.

Which rank writes a value is settled by a once-only mark in the live store, named after this
job (``liveness.this_job``: torchrun's run id and restart, else an id the job's ranks agree
on, never a constant), so a later job sharing the store never takes an earlier job's mark for
its own; where the store expires keys the mark lives ``MARK_TTL``. A write that fails frees
its mark, so another rank, or a later job, writes the value.

Keys are the live store's keys (environment, secret, namespace, kind, digest), so a job only
finds values it can load. When the session's core starts (``coordinator.starts``), a thread
opens the layer and connects; the first lookup lists the keys it holds under this job's
prefix, and a key not listed is a miss without a request (a cold job pays one listing, not
a request per graph). The first failure of the layer (a missing bucket, refused
credentials, a server gone) is logged once, naming the URL (a password in it as ``***``, as
in every line naming the layer) and what to do, and the job goes on without it: losing the
persistent layer costs compile time, never the job.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from datetime import timedelta

from coordinator import _compat
from coordinator.errors import ConfigError, StoreError
from coordinator.features.base import Context, Feature, Part
from coordinator.observe.stats import Counts
from coordinator.observe.trace import short_key
from coordinator.protocol.fingerprint import key_prefix
from coordinator.protocol.outcome import Outcome
from coordinator.protocol.singleflight import LookupResult, Singleflight
from coordinator.protocol.stores import shown_url
from coordinator.protocol.stores.base import Store
from coordinator.protocol.writer import BackgroundWriter

log = logging.getLogger(__name__)

#: Most bytes of values waiting to be written; a value past it is not persisted (counted).
MAX_QUEUED_BYTES = 1024 * 1024 * 1024
#: Longest wait of a lookup for the layer to open (connect and list).
OPEN_TIMEOUT = timedelta(seconds=60)
#: How long a write's mark lives where the live store expires keys: the job that set it
#: is long over, or writes a value a second time (the same bytes) past it.
MARK_TTL = timedelta(days=1)
#: Lookups that found nothing in the live store and may ask the persistent layer.
_ASKS = (Outcome.CLAIMED, Outcome.NONBLOCKING, Outcome.UNAVAILABLE)


class PersistCounts(Counts, hits=0, misses=0, rejected=0, bytes_read=0, written=0, bytes_written=0, not_written=0,
                    failed=False):
    """Values found in the persistent layer, refused, and written to it."""

    def summary(self) -> str:
        return (f"persistent layer: {self.hits} found ({self.bytes_read / 1e6:.2f} MB), {self.misses} missing, "
                f"{self.rejected} refused; {self.written} written ({self.bytes_written / 1e6:.2f} MB), "
                f"{self.not_written} not written" + (", failed" if self.failed else ""))


class PersistentLayer(Feature, counts=PersistCounts):
    """This session's persistent layer: the keys it holds, and the writer that adds to it."""

    name = "persistent"
    part = Part.CORE

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.url: str | None = context.config.persist
        #: The URL as lines name it (``shown_url``: a password as ``***``).
        self.shown = shown_url(self.url) if self.url is not None else None
        self._store: Store | None = None
        #: Keys the layer holds (listed when it opened, and written since); values this
        #: session refused, which its own compile replaces.
        self._held: set[str] = set()
        self._refused: set[str] = set()
        #: The keys the listing found (a value published before the listing, by a rank whose
        #: lookups the prefetch answered, is written only if the layer lacks it).
        self._listed_keys: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._list_lock = threading.Lock()
        self._listed = False
        self._writer: BackgroundWriter | None = None
        self._mark: str | None = None

    def enabled(self, routed: frozenset[str]) -> bool:
        return self.url is not None

    def started(self) -> None:
        # The writer's thread starts with the session's core, not at the first write: a
        # first write may come while the interpreter exits, where no thread starts.
        self._writer = BackgroundWriter("persistent layer", MAX_QUEUED_BYTES,
                                        progress_interval=self.context.config.progress_interval)
        threading.Thread(target=self._connect, name="coordinator-persist-connect", daemon=True).start()

    # -- the layer -------------------------------------------------------------------------

    def _connect(self) -> None:
        """Open the layer and its connection (on a thread of its own, from the session's start:
        importing the provider and connecting cost a second, which no compile waits for)."""
        from coordinator.protocol.stores import open_store

        try:
            store = open_store(self.url, chunk_bytes=self.context.config.chunk_bytes)
            store.connect()
        except (ConfigError, StoreError) as exc:
            self._lost(exc)
        else:
            with self._lock:
                self._store = store
        finally:
            self._connected.set()

    def _list(self, store: Store) -> None:
        """List what the layer holds under this job's prefix (once, at the first lookup: the
        prefix names the environment, which the session reads there, after the script has
        picked its device)."""
        config = self.context.config
        started = time.monotonic()
        try:
            held = store.list_keys(key_prefix(config.store_secret, config.namespace) + "/")
        except (ConfigError, StoreError) as exc:
            self._lost(exc)
            return
        with self._lock:
            self._held.update(held)
            self._listed_keys = frozenset(held)
        log.info("compile_once: persistent layer %s holds %d values for this environment (listed in %.2fs)",
                 store.name, len(held), time.monotonic() - started)

    def _lost(self, exc: Exception) -> None:
        """The layer failed: say so once, with what to do, and go on without it."""
        with self._lock:
            if self.counts.failed:
                return
            self.counts.failed = True
            self._store = None
        log.warning("compile_once: persistent layer %s failed, going on without it (graphs it lacks are compiled, "
                    "and nothing more is written to it): %s", self.shown, exc)
        self.context.events.instant("persistent layer lost", error=str(exc))

    def _ready(self) -> Store | None:
        """The layer once it is open and listed, or ``None`` if it failed or did not open in time."""
        if self._listed:
            return self._store
        with self._list_lock:
            if not self._listed:
                if not self._connected.wait(OPEN_TIMEOUT.total_seconds()):
                    self._lost(StoreError(f"not open after {OPEN_TIMEOUT.total_seconds():.0f}s"))
                store = self._store
                if store is not None:
                    self._list(store)
                self._listed = True
        return self._store

    # -- lookups ---------------------------------------------------------------------------

    def looked_up(self, flight: Singleflight, kind: str, key: str, result: LookupResult,
                  rejected: bytes | None) -> LookupResult:
        if result.value is not None or result.outcome not in _ASKS:
            return result
        store = self._ready()
        if store is None:
            return result
        with self._lock:
            held = key in self._held and key not in self._refused
        if not held:
            self.counts.misses += 1
            return result
        began = time.time()
        try:
            value = store.get(key)
        except StoreError as exc:
            self._lost(exc)
            return result
        if value is None or value == rejected:
            self.counts.misses += 1
            return result
        if self.context.verify(kind, key, value) is None:  # logged and traced as a rejection
            with self._lock:
                self._refused.add(key)
            self.counts.rejected += 1
            return result
        self.counts.hits += 1
        self.counts.bytes_read += len(value)
        self.context.events.span("persisted", began, key=short_key(key), bytes=len(value))
        if result.outcome != Outcome.UNAVAILABLE:
            # Ends this rank's claim, if it holds one: its waiters get the value as from a compile.
            flight.publish(key, value)
        return LookupResult(value, Outcome.PERSISTED, result.waited_s)

    # -- writes ----------------------------------------------------------------------------

    def published(self, kind: str, key: str, blob: bytes) -> None:
        if kind not in _compat.KINDS:
            return  # a feature's own value (a precompiled function), which its feature reads from the live store
        with self._lock:
            if self.counts.failed or (key in self._held and key not in self._refused):
                return
            replaces = key in self._refused
            self._held.add(key)
            self._refused.discard(key)
            writer = self._writer
        if writer is None:
            return
        if not writer.submit(f"writing {kind} {short_key(key)} to {self.shown}", len(blob),
                             lambda: self._write(key, blob, replaces)):
            self._count(not_written=1)
            with self._lock:
                self._held.discard(key)

    def _write(self, key: str, blob: bytes, replaces: bool) -> None:
        """One write, on the writer's thread, unless another rank of the job writes ``key``
        (unless it ``replaces`` a value this rank refused); the first failure turns the
        layer off."""
        store = self._ready()
        if store is None:
            self._count(not_written=1)
            return
        if not replaces and key in self._listed_keys:
            return  # the layer held it already
        marked = None if replaces else self._first_to_write(key)
        if marked is False:
            return
        try:
            store.set(key, blob)
        except BaseException as exc:
            if marked:
                self._unmark(key)
            self._count(not_written=1)
            if not isinstance(exc, (ConfigError, StoreError)):
                raise
            self._lost(exc)
            return
        self._count(written=1, bytes_written=len(blob))

    def _first_to_write(self, key: str) -> bool | None:
        """Whether this rank is the job's first to write ``key``: kinds whose lookups never
        wait (AOTAutograd's entries) are published by every rank that compiles them, and
        written once. ``None``: no mark was set (a live store that fails or is missing leaves
        every rank writing)."""
        flight = self.context.flight()
        if flight is None or not flight.available:
            return None
        if self._mark is None:
            self._mark = write_mark(flight.job)
        try:
            return flight.first_to_mark(key, self._mark, ttl=MARK_TTL)
        except StoreError:
            return None

    def _unmark(self, key: str) -> None:
        """Free this job's mark on ``key`` after its write failed: another rank, or a later
        job, may write it."""
        flight = self.context.flight()
        if flight is None or self._mark is None:
            return
        try:
            flight.unmark(key, self._mark)
        except StoreError as exc:  # the mark expires with MARK_TTL where the store expires keys
            log.debug("compile_once: could not free the persistent layer's mark on %s: %s", short_key(key), exc)

    def _count(self, **added: int) -> None:
        with self._lock:
            self.counts.add(**added)

    def close(self) -> None:
        writer = self._writer
        if writer is None:
            return
        timeout = self.context.config.drain_timeout
        writes, nbytes = writer.pending()
        if writes:
            log.info("compile_once: writing %d values (%.1f MB) to the persistent layer %s before exit, for up to "
                     "%.0fs", writes, nbytes / 1e6, self.shown, timeout.total_seconds())
        started = time.monotonic()
        drained = writer.drain(timeout)
        left, left_bytes = writer.pending()
        writer.close()
        if not drained:
            self._count(not_written=left)
            log.warning("compile_once: %d values (%.1f MB) not written to the persistent layer %s: still writing "
                        "after %.0fs", left, left_bytes / 1e6, self.shown, timeout.total_seconds())
        elif self.counts.written:
            log.info("compile_once: wrote %d values (%.1f MB) to the persistent layer %s; %.1fs at exit",
                     self.counts.written, self.counts.bytes_written / 1e6, self.shown,
                     time.monotonic() - started)


def write_mark(job: str) -> str:
    """The mark of a value written by job ``job`` (a hash: a run id may hold any character)."""
    return "persisted-" + hashlib.sha256(job.encode()).hexdigest()[:16]
