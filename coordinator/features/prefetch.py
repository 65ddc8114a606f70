"""Restarts whose compiled entries are in memory before the first compile asks for them.

A job asks the store for the same entries each time it runs. Each rank keeps an **index**
of the store keys it asked for, in the order it asked, and writes it, sealed like every
value (``coordinator.protocol.integrity``), after each compile and when its session ends, to
the stores a later job can reach before its script has run: the ``store`` setting's URL
and the persistent layer (``persist``). The job's own TCPStore is not one: it exists only
after ``init_process_group`` and starts empty. The index's key names the secret's
fingerprint, the namespace, the script and the rank, not the run (a restart is a new run):
``prefetch/<secret>/<namespace>/<script>/rank<R>``.

When the session's core starts (the script calls ``torch.compile``, or its first lookup
comes: ``coordinator.starts``), a thread reads its rank's index from those stores and
fetches each value it names (the live store
first, then the persistent layer), verifies it as every value is verified, and keeps it in
memory, at most ``prefetch_mb`` MB, while the script sets up DDP and its optimizer and
Dynamo traces the first frame. A lookup of a key the thread holds takes it from memory (``Outcome.PREPARED``): no
store request, no node lock, no claim. A lookup of a key the thread has not reached yet
waits for it at most ``READY_WAIT`` (the thread waits on no rank, and its store calls are
bounded), where the lookup may wait at all; after one such wait runs out, no lookup waits
again. A key that failed (missing, refused, past the memory bound) is asked of the store at
once; a store that fails is not asked again by the thread. A value that fails verification is
never kept (counted as refused; the lookup then meets it in the store, refuses it again and
has it compiled). A lookup inside a compile that must not wait (an early backward compile)
leaves the prepared value for the lookup that follows. An entry the job never asks for, such
as a changed model's, costs its memory until the session ends, and the next index leaves it
out. Each value is handed out once, then dropped; a key asked of the store before its value
came is not kept.

The index is written by one thread of its own, behind the compile; at exit the session waits
for its last write at most ``drain_timeout``. Where the store expires keys (Redis) an index
lives ``INDEX_TTL``; each run writes it again.

The summary's ``prefetch`` counts say how many entries the index named, how many were
prepared ahead (MB, seconds), how many of those the job used, and how many were refused.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import msgpack

from coordinator.errors import ConfigError, IntegrityError, StoreError
from coordinator.features.base import Context, Feature, Part
from coordinator.observe.stats import Counts
from coordinator.protocol.fingerprint import secret_fingerprint
from coordinator.protocol.integrity import open_sealed, seal
from coordinator.protocol.stores.base import Store

log = logging.getLogger(__name__)

#: Longest wait of a lookup for a key the thread has yet to fetch.
READY_WAIT = timedelta(seconds=10)
#: Values fetched at once (stores that answer over a network answer several requests at once).
FETCHES_AT_ONCE = 4
#: How long an index lives where the store expires keys (Redis): each run writes it again.
INDEX_TTL = timedelta(days=7)


class PrefetchCounts(Counts, indexed=0, prepared=0, used=0, refused=0, missing=0, bytes=0, seconds=0.0,
                     written=0):
    """Entries the index named, prepared ahead (``bytes``, in ``seconds``), used by lookups,
    refused (failed verification), missing (no store held one, or its store failed); indexes this rank
    ``written``."""

    line = ("prefetch: {prepared} of {indexed} indexed entries prepared ahead ({bytes} bytes in {seconds:.2f}s), "
            "{used} used, {refused} refused, {missing} missing")
    shown_if = ("indexed",)


def script_name() -> str:
    """What names the job's script across its runs: its real path (``python -m`` sets it to
    the module's file once the module runs; before that, the module's name)."""
    first = sys.argv[0] if sys.argv else ""
    if first == "-m":
        argv = getattr(sys, "orig_argv", None) or []
        return "-m " + argv[argv.index("-m") + 1] if "-m" in argv[:-1] else "-m"
    return os.path.realpath(first) if first else "<interactive>"


def index_key(secret: bytes | None, namespace: str, script: str, rank: int) -> str:
    """The store key of rank ``rank``'s index (``script``: :func:`script_name`)."""
    digest = hashlib.sha256(script.encode()).hexdigest()[:16]
    return f"prefetch/{secret_fingerprint(secret)}/{namespace or '_'}/{digest}/rank{rank}"


def read_index(store: Store, key: str, secret: bytes | None) -> list[str] | None:
    """The store keys an index names, or ``None`` if ``store`` holds none under ``key``.

    Raises:
        IntegrityError: the index fails verification.
        StoreError: the store failed.
    """
    blob = store.get(key)
    if blob is None:
        return None
    keys = msgpack.unpackb(open_sealed(key, blob, secret=secret, what="value").payload, raw=False)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise IntegrityError(f"index {key} holds no list of keys")
    return keys


class Prefetch(Feature, counts=PrefetchCounts):
    """This rank's index, and the entries it prepared from the last one."""

    name = "prefetch"
    part = Part.CORE

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        config = context.config
        self._bound = config.prefetch_mb * 2**20
        #: Each store a restart can reach at its start, and the prefix of its values' keys:
        #: the live store's (where the singleflight protocol keeps them), the persistent layer's.
        self._sources = [(url, prefix) for url, prefix in ((config.store, "v/"), (config.persist, ""))
                         if isinstance(url, str)]
        self._key = index_key(config.store_secret, config.namespace, script_name(), int(os.environ.get("RANK", "0")))
        self._lock = threading.Condition()
        #: Store keys asked for in this session, in order; how many of them the last write held.
        self._asked: dict[str, None] = {}
        self._written = 0
        self._writer: threading.Thread | None = None
        #: Keys of the last index not handed out yet: their values (``None``: still coming).
        self._pending: dict[str, bytes | None] = {}
        self._fetching = False
        #: Set once the last index was read (or found missing, or the thread stopped).
        self._index_read = threading.Event()
        #: Set when a lookup waited ``READY_WAIT`` in vain: no lookup waits again.
        self._waits_over = False
        self._closed = False
        self._stores: list[tuple[Store, str]] | None = None
        self._failed: set[int] = set()  # the sources that failed (by index): not asked again
        self._opening = threading.Lock()

    def enabled(self, routed: frozenset[str]) -> bool:
        return self._bound > 0 and bool(self._sources)

    def started(self) -> None:
        with self._lock:
            self._fetching = True
        threading.Thread(target=self._prepare, name="coordinator-prefetch", daemon=True).start()

    # -- the stores ----------------------------------------------------------------------------

    def _open(self) -> list[tuple[int, Store, str]]:
        """The source stores that have not failed, each with its number and its values'
        prefix; opened once (one that cannot be opened is left out)."""
        from coordinator.protocol.stores import open_store

        with self._opening:
            if self._stores is None:
                self._stores = []
                for url, prefix in self._sources:
                    try:
                        self._stores.append((open_store(url, chunk_bytes=self.context.config.chunk_bytes), prefix))
                    except (ConfigError, StoreError) as exc:
                        log.debug("compile_once: prefetch cannot open %s: %s", url, exc)
            stores = list(enumerate(self._stores))
        with self._lock:
            return [(i, store, prefix) for i, (store, prefix) in stores if i not in self._failed]

    def _lost(self, source: int, store: Store, exc: StoreError) -> None:
        """A source failed: it is not asked again in this session (its lookups ask the
        session's own store, whose failures the session handles)."""
        with self._lock:
            if source in self._failed:
                return
            self._failed.add(source)
        log.info("compile_once: prefetch stops using %s: %s", store.name, exc)

    # -- preparing the last index's entries ------------------------------------------------

    def _prepare(self) -> None:
        began = time.monotonic()
        try:
            stores = self._open()
            keys = self._index(stores)
            if keys:  # with none, ``finally`` says the index was read
                with self._lock:
                    # A key looked up before the index was read is not fetched: it was asked already.
                    self._pending = {key: None for key in keys if key not in self._asked}
                    self.counts.indexed = len(keys)
                    keys = list(self._pending)
                self._index_read.set()
                with ThreadPoolExecutor(FETCHES_AT_ONCE, thread_name_prefix="coordinator-prefetch") as pool:
                    for key in keys:
                        pool.submit(self._fetch, key)
        except Exception as exc:  # never fails the job: its lookups ask the store
            log.warning("compile_once: prefetch stopped: %s: %s", type(exc).__name__, exc)
        finally:
            self._index_read.set()
            with self._lock:
                self._fetching = False
                self._pending = {key: value for key, value in self._pending.items() if value is not None}
                self.counts.seconds = round(time.monotonic() - began, 3)
                self._lock.notify_all()
        if self.counts.indexed:
            log.info("compile_once: %s", self.counts.summary())

    def _index(self, stores: list[tuple[int, Store, str]]) -> list[str]:
        """The first index the stores hold for this rank (empty: none, or none that verifies)."""
        for source, store, _ in stores:
            try:
                keys = read_index(store, self._key, self.context.config.store_secret)
            except IntegrityError as exc:
                log.warning("compile_once: refused the prefetch index %s in %s: %s", self._key, store.name, exc)
                continue
            except StoreError as exc:
                self._lost(source, store, exc)
                continue
            if keys is not None:
                return list(dict.fromkeys(keys))
        return []

    def _fetch(self, key: str) -> None:
        value = None
        try:
            with self._lock:
                wanted = key in self._pending and not self._closed and self.counts.bytes < self._bound
            if wanted:
                value = self._first_value(key)
        finally:
            with self._lock:
                # Kept only while a lookup may still take it, and within the bound.
                if (value is not None and key in self._pending and not self._closed
                        and self.counts.bytes + len(value) <= self._bound):
                    self._pending[key] = value
                    self.counts.prepared += 1
                    self.counts.bytes += len(value)
                else:
                    self._pending.pop(key, None)
                self._lock.notify_all()

    def _first_value(self, key: str) -> bytes | None:
        """``key``'s value from the first store that holds one; ``None`` if none does or the
        value fails verification."""
        for source, store, prefix in self._open():
            try:
                value = store.get(prefix + key)
            except StoreError as exc:
                self._lost(source, store, exc)
                continue
            if value is None:
                continue
            try:
                open_sealed(key, value, secret=self.context.config.store_secret)
            except IntegrityError as exc:
                log.warning("compile_once: prefetch refused %s from %s: %s", key, store.name, exc)
                self._count(refused=1)
                return None
            return value
        self._count(missing=1)
        return None

    def _count(self, **added: int) -> None:
        with self._lock:
            self.counts.add(**added)

    def expects_entries(self, timeout: float) -> bool:
        """Whether the last index named entries: this job is a restart whose lookups it
        answers. Waits for the index's read at most ``timeout`` seconds (``False`` after)."""
        if not self._index_read.wait(timeout):
            return False
        with self._lock:
            return self.counts.indexed > 0

    # -- lookups -----------------------------------------------------------------------------

    def prepared(self, key: str, *, wait: bool) -> bytes | None:
        """``key``'s value if it was prepared ahead (handed out once). With ``wait``, a key the
        thread has yet to fetch is waited for, at most ``READY_WAIT`` (the thread waits on no
        rank, and its store calls are bounded); once a wait has run out, none waits again."""
        with self._lock:
            if key not in self._pending:
                return None
            if self._pending[key] is None and not (wait and not self._waits_over):
                return None
            deadline = time.monotonic() + READY_WAIT.total_seconds()
            while self._pending.get(key, b"") is None and self._fetching:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._waits_over = True
                    self._pending.pop(key, None)
                    log.info("compile_once: prefetch of %s not ready after %.0fs; asking the store (and no longer "
                             "waiting for the prefetch)", key, READY_WAIT.total_seconds())
                    return None
                self._lock.wait(left)
            value = self._pending.pop(key, None)
            if value is not None:
                self.counts.used += 1
            return value

    def asked(self, kind: str, inductor_key: str) -> None:
        key = self.context.store_key(kind, inductor_key)
        with self._lock:
            self._asked.setdefault(key)
            pending = self._pending.get(key, b"") is None
            if pending:  # asked of the store meanwhile: not kept when it arrives
                self._pending.pop(key, None)

    # -- writing this session's index --------------------------------------------------------

    def compile_ended(self) -> None:
        self._write_soon()

    def _write_soon(self) -> threading.Thread | None:
        """Start the index's writer unless it runs (it writes until the index it wrote is the
        latest) or there is nothing new. Returns the writer, if one runs."""
        with self._lock:
            if self._writer is not None and self._writer.is_alive():
                return self._writer
            if len(self._asked) == self._written:
                return None
            self._writer = threading.Thread(target=self._write, name="coordinator-prefetch-index", daemon=True)
            self._writer.start()
            return self._writer

    def _write(self) -> None:
        """Write the index to every source store that has not failed, until it holds every key
        asked so far."""
        while True:
            with self._lock:
                keys = list(self._asked)
                if len(keys) == self._written:
                    return
            blob = seal(self._key, msgpack.packb(keys), meta={"rank": int(os.environ.get("RANK", "0"))},
                        secret=self.context.config.store_secret)
            for source, store, _ in self._open():
                try:
                    store.set(self._key, blob, ttl=INDEX_TTL if store.expires else None)
                except StoreError as exc:
                    self._lost(source, store, exc)
            with self._lock:
                self._written = len(keys)
                self.counts.written += 1

    def close(self) -> None:
        """Write the last index (up to ``drain_timeout``) and drop what was not used."""
        with self._lock:
            self._closed = True
            self._pending.clear()
        writer = self._write_soon()
        if writer is not None:
            writer.join(self.context.config.drain_timeout.total_seconds())
            if writer.is_alive():
                log.warning("compile_once: the prefetch index %s was not written within %.0fs", self._key,
                            self.context.config.drain_timeout.total_seconds())
