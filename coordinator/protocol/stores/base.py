"""The key-value store interface every transport implements.

The singleflight protocol needs only five operations from a store: read a value,
write a value, delete, an atomic *create-if-absent* (the claim), and waiting for a
key. Waiting is :meth:`Store.watch`: a backend with a blocking primitive (the c10d
store's server-side ``wait``, Redis publish/subscribe) wakes the waiter when the key is
written with :meth:`Store.signal`; the others poll. Keys are short ASCII paths
(``[A-Za-z0-9._:/-]``); values are bytes. Backends
raise :class:`~coordinator.errors.StoreError` for any transport failure, so the
caller can fall back to compiling locally, and its subclass
:class:`~coordinator.errors.StoreFull` for a write refused for lack of room (the store
can still be read).

A backend that expires keys (:attr:`Store.expires`: Redis) honours ``ttl=`` on writes and
:meth:`Store.expire`; the others keep keys until they are deleted. :meth:`Store.capacity`
is the largest value a backend can hold, where it knows one.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import re
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

from coordinator.errors import ConfigError

_KEY_RE = re.compile(r"^[A-Za-z0-9._:/-]+$")


def ttl_ms(ttl: timedelta | None) -> int | None:
    """``ttl`` in whole milliseconds (at least 1), or ``None``; refuses a TTL that is not positive.

    Raises:
        ConfigError: ``ttl`` is zero or negative.
    """
    if ttl is None:
        return None
    if ttl <= timedelta(0):
        raise ConfigError(f"ttl={ttl.total_seconds():g}s: a time to live must be a positive number of seconds")
    return max(1, int(ttl.total_seconds() * 1000))


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid store key, else raise ``ConfigError``."""
    if not _KEY_RE.match(key) or ".." in key or key.startswith("/"):
        raise ConfigError(f"invalid store key {key!r}: use [A-Za-z0-9._:/-], no '..'")
    return key


@dataclasses.dataclass(frozen=True)
class StoredEntry:
    """A key as :meth:`Store.list_entries` lists it: its size, and when it was written
    (seconds since the epoch) where the store knows."""

    key: str
    size: int
    modified: float | None = None


class Store(abc.ABC):
    """A byte-valued key-value store shared by all ranks of a job (or by many jobs)."""

    #: Short name used in log lines and stats.
    name: str = "store"
    #: Whether it can hold a job's live claims and signals (:meth:`add_if_absent`, :meth:`watch`);
    #: an object store holds bundles and the persistent layer only.
    live: bool = True
    #: Whether ``ttl=`` and :meth:`expire` expire keys here (else keys live until deleted).
    expires: bool = False
    #: Whether :meth:`get_many` reads its keys in one request (else one request a key).
    reads_at_once: bool = False

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """Return the value of ``key``, or ``None`` if it is absent."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys`` (``None`` for an absent one): one request where the backend
        reads several keys at once (:attr:`reads_at_once`: Redis' ``MGET``, which also reads
        them at one instant); this default reads them one by one, in the order given."""
        return [self.get(key) for key in keys]

    @abc.abstractmethod
    def set(self, key: str, value: bytes, ttl: timedelta | None = None) -> None:
        """Write ``value`` under ``key``; readers see the old value or the whole new one.

        ``ttl``, where the backend supports expiry, bounds how long the value lives.
        """

    @abc.abstractmethod
    def add_if_absent(self, key: str, value: bytes, ttl: timedelta | None = None) -> bool:
        """Atomically create ``key`` with ``value`` unless it exists.

        Returns:
            True if this call created the key (the caller now owns it), False if the
            key already existed. ``ttl``, where the backend supports expiry, bounds how
            long the key lives.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; removing an absent key is not an error."""

    def list_keys(self, prefix: str) -> list[str]:
        """Keys that start with ``prefix`` (for listing bundles); not every backend can."""
        raise NotImplementedError(f"{type(self).__name__} cannot list keys")

    def list_entries(self, prefix: str) -> list[StoredEntry]:
        """:meth:`list_keys` with each key's size and time of writing. This default reads
        every value for its size and knows no time; backends that can ask for both do."""
        entries = []
        for key in self.list_keys(prefix):
            value = self.get(key)
            if value is not None:
                entries.append(StoredEntry(key, len(value)))
        return entries

    def signal(self, key: str, value: bytes, ttl: timedelta | None = None) -> None:
        """Write a small, write-once ``value`` under ``key`` and wake whoever watches it
        (:meth:`watch`); ``ttl`` as for :meth:`set`."""
        self.set(key, value, ttl)

    def expire(self, key: str, ttl: timedelta) -> None:  # noqa: B027 - most stores keep keys until deleted
        """Where keys expire (:attr:`expires`), let ``key`` live ``ttl`` from now (if it exists)."""

    def capacity(self) -> int | None:
        """The largest value this store can hold, in bytes (Redis: its ``maxmemory`` less what
        the server uses empty), or ``None`` where no limit is known."""
        return None

    @contextlib.contextmanager
    def watch(self, prefix: str) -> Iterator[Watch]:
        """Wait for keys under ``prefix`` written with :meth:`signal`. This default polls."""
        yield PollingWatch(self)

    def connect(self) -> None:  # noqa: B027 - most stores connect at their first call, any time
        """Open the connection now, so that a call made while the interpreter exits (an
        ``atexit`` handler, which can no longer start the threads some clients need to
        connect) finds it open. Never raises: a store that is down fails its later calls."""

    def prepare_watch(self) -> None:  # noqa: B027 - a polling store has nothing to open
        """Open now what a :meth:`watch` will need (a connection of its own), so that the
        first wait does not: a job's waiters all start waiting at the same moment."""

    def close(self) -> None:  # noqa: B027 - most stores hold nothing to release
        """Release connections; the store is unusable afterwards."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class Watch(abc.ABC):
    """Waits for signalled keys under one prefix (see :meth:`Store.watch`)."""

    #: Whether a wait blocks on the server (True) or polls the key (False).
    blocking: bool = False

    @abc.abstractmethod
    def wait(self, key: str, timeout_s: float) -> bytes | None:
        """The value of ``key`` once it exists, or ``None`` after ``timeout_s`` seconds."""


class PollingWatch(Watch):
    """Reads the key with a growing pause (10 to 200 ms) between reads."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def wait(self, key: str, timeout_s: float) -> bytes | None:
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            value = self.store.get(key)
            if value is not None:
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(delay, left))
            delay = min(delay * 1.5, 0.2)


class TimedStore(Store):
    """A store that reports how long each call made through it took.

    The session wraps its store in one and adds the seconds to the rank's stats, so a
    rank can say how much of its time the store cost: the first profile to read when a
    job over one store is slower than over another.
    """

    def __init__(self, inner: Store, record: Callable[[float], None]) -> None:
        self.inner = inner
        self.name = inner.name
        self.expires = inner.expires
        self.reads_at_once = inner.reads_at_once
        self._record = record

    def _timed(self, fn, *args):
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._record(time.perf_counter() - started)

    def get(self, key: str) -> bytes | None:
        return self._timed(self.inner.get, key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if self.inner.reads_at_once:
            return self._timed(self.inner.get_many, keys)
        return [self.get(key) for key in keys]  # a call each, as the store makes them

    def set(self, key: str, value: bytes, ttl: timedelta | None = None) -> None:
        self._timed(self.inner.set, key, value, ttl)

    def add_if_absent(self, key: str, value: bytes, ttl: timedelta | None = None) -> bool:
        return self._timed(self.inner.add_if_absent, key, value, ttl)

    def delete(self, key: str) -> None:
        self._timed(self.inner.delete, key)

    def list_keys(self, prefix: str) -> list[str]:
        return self._timed(self.inner.list_keys, prefix)

    def list_entries(self, prefix: str) -> list[StoredEntry]:
        return self._timed(self.inner.list_entries, prefix)

    def signal(self, key: str, value: bytes, ttl: timedelta | None = None) -> None:
        self._timed(self.inner.signal, key, value, ttl)

    def expire(self, key: str, ttl: timedelta) -> None:
        self._timed(self.inner.expire, key, ttl)

    def capacity(self) -> int | None:
        return self.inner.capacity()

    @contextlib.contextmanager
    def watch(self, prefix: str) -> Iterator[Watch]:
        with self.inner.watch(prefix) as inner:
            yield _TimedWatch(inner, self._timed)

    def prepare_watch(self) -> None:
        self.inner.prepare_watch()

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"<TimedStore {self.inner!r}>"


class _TimedWatch(Watch):
    def __init__(self, inner: Watch, timed: Callable) -> None:
        self.inner, self._timed = inner, timed
        self.blocking = inner.blocking

    def wait(self, key: str, timeout_s: float) -> bytes | None:
        return self._timed(self.inner.wait, key, timeout_s)
