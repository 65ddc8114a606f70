"""Node-level single fetch, and the file locks the processes of a node share.

Local ranks share Inductor's cache dir. When several of them need the same key at
once, the first to take the key's lock (``flock`` on a file in
``<cache dir>/coordinator/locks``) asks the store; the others wait on the lock and
then find the value in ``<cache dir>/coordinator/values`` (written by temp file +
rename). Values found there are verified like any other. Fetches from the store per
job are then one per node, not one per rank. The lock wait polls, so it ends at the
same deadline as any wait on the store. Such a wait is a wait on another process's
work, as one on the store is: it is an event (``wait``, via ``node lock``), from the
moment the lock was found taken, or the end of the work the rank did meanwhile, until
the lock is free.

A bundle (``coordinator.bundles``) installs FX graphs into the node's Inductor cache dir,
where a rank then finds them as its own: :func:`record_bundled` notes each one's key in
``<cache dir>/coordinator/bundled`` (one empty file per graph) and :func:`bundled` tells a
rank that finds a graph in its local cache whether a bundle put it there (so that what
it saved counts: ``coordinator.features.local_hits``).

Every node-wide lock of the coordinator goes through :func:`file_lock`: the per-key
locks above, a bundle's install (``coordinator.bundles``) and the :class:`DeviceLock`
that lets one early backward compile run per device (``coordinator.features.early_backward``).

The copies never cost the job its disk. A copy is written only while the file system keeps
``RESERVE_FRACTION`` of its size (up to 1 GiB, and at least four times the copy) free
after it, so that Inductor's own writes, which come between two copies, find room. When
that no longer holds, or a write meets ``ENOSPC``/``EDQUOT`` anyway, the process stops
copying, deletes the copies it wrote, says so once, and from then on asks the store
directly, without the node's locks: the job then uses its disk as a job without the
coordinator does.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator

from coordinator.errors import WaitTimeout
from coordinator.observe.trace import NO_EVENTS, NoEvents, short_key
from coordinator.protocol.outcome import Outcome
from coordinator.protocol.singleflight import LookupResult, Singleflight

log = logging.getLogger(__name__)

#: The share of the file system that must stay free after a node copy is written (at most
#: ``RESERVE_CAP_BYTES``, at least four times the copy).
RESERVE_FRACTION = 0.10
RESERVE_CAP_BYTES = 1 << 30
_FULL = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def file_lock(path: str, wait_s: float | None, while_waiting: Callable[[], bool] | None = None,
              waited: Callable[[float], None] | None = None) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` (created with its folder if missing).

    ``wait_s=None`` blocks until the lock is free; otherwise tries for up to ``wait_s``
    seconds (0: once), calling ``while_waiting`` between two tries (it returns whether
    it did work, which makes the next try come sooner). Yields whether this process holds
    the lock. ``waited``, if the first try found the lock taken and a later one got it, is
    called with the wall-clock time the wait began (after the last work ``while_waiting`` did).
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a+") as f:
        if wait_s is None:
            fcntl.flock(f, fcntl.LOCK_EX)
            locked = True
        else:
            locked = _try_flock(f, time.monotonic() + wait_s, while_waiting, waited)
        try:
            yield locked
        finally:
            if locked:
                fcntl.flock(f, fcntl.LOCK_UN)


def _try_flock(f, deadline: float, while_waiting: Callable[[], bool] | None,
               waited: Callable[[float], None] | None) -> bool:
    delay = 0.005
    wait_began = None
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if wait_began is not None and waited is not None:
                waited(wait_began)
            return True
        except BlockingIOError:
            if wait_began is None:
                wait_began = time.time()
            if time.monotonic() >= deadline:
                return False
            if while_waiting is not None and while_waiting():
                wait_began = time.time()  # the work is not waiting: the wait starts after it
                delay = 0.005
                continue
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)


def _bundled_path(cache_dir: str, local_key: str) -> str:
    return os.path.join(cache_dir, "coordinator", "bundled", hashlib.sha256(local_key.encode()).hexdigest()[:40])


def record_bundled(cache_dir: str, local_keys: list[str]) -> None:
    """Note that a bundle installed the FX graphs of ``local_keys`` (Inductor's own keys)
    into the Inductor cache dir ``cache_dir``."""
    for key in local_keys:
        path = _bundled_path(cache_dir, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb"):
            pass


def bundled(cache_dir: str, local_key: str) -> bool:
    """Whether a bundle installed the FX graph of ``local_key`` into ``cache_dir``."""
    return os.path.exists(_bundled_path(cache_dir, local_key))


class DeviceLock:
    """One piece of device work at a time across the processes of a node."""

    def __init__(self, name: str) -> None:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
        self.path = os.path.join(tempfile.gettempdir(), "coordinator-device-locks", f"{safe}.lock")

    def tried(self) -> contextlib.AbstractContextManager[bool]:
        """Hold the lock if no other process does; yields whether this one holds it."""
        return file_lock(self.path, 0.0)


class NodeCache:
    """Values fetched or published by any process of this node, keyed by store key."""

    def __init__(self, cache_dir: str, events: NoEvents = NO_EVENTS) -> None:
        self.root = os.path.join(cache_dir, "coordinator")
        self._events = events
        #: False once the file system filled up: no more copies, no node locks.
        self.copying = True
        self._written: list[str] = []  # the copies this process wrote

    def _path(self, kind: str, key: str) -> str:
        return os.path.join(self.root, kind, hashlib.sha256(key.encode()).hexdigest()[:40])

    def read(self, key: str) -> bytes | None:
        try:
            with open(self._path("values", key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def write(self, key: str, value: bytes) -> bool:
        """Keep this node's copy of ``key``; never raises. Returns whether it was kept."""
        if not self.copying:
            return False
        path = self._path("values", key)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        try:
            self._check_room(len(value))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            if exc.errno in _FULL:
                self.stop_copying(exc)
            else:
                log.debug("could not keep %s on this node: %s", key, exc)
            return False
        self._written.append(path)
        return True

    def _check_room(self, size: int) -> None:
        """Raise ``ENOSPC`` unless the file system keeps its reserve free after ``size`` more bytes."""
        os.makedirs(self.root, exist_ok=True)
        fs = os.statvfs(self.root)
        free, total = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
        reserve = max(min(total * RESERVE_FRACTION, RESERVE_CAP_BYTES), 4 * size)
        if free - size < reserve:
            raise OSError(errno.ENOSPC, f"{free / 1e6:.1f} MB free of {total / 1e6:.1f} MB, "
                                        f"{reserve / 1e6:.1f} MB kept for the job")

    def stop_copying(self, exc: OSError) -> None:
        """The file system is full: stop copying, delete this process's copies, say so once."""
        if not self.copying:
            return
        self.copying = False
        freed = 0
        for path in self._written:
            try:
                freed += os.path.getsize(path)
                os.remove(path)
            except OSError:
                pass
        self._written.clear()
        log.warning("compile_once: the file system of %s has no room for node-local copies (%s): no more copies; "
                    "freed the %.1f MB this process wrote, and local ranks ask the store", self.root,
                    exc.strerror or exc, freed / 1e6)

    def forget(self, key: str, value: bytes) -> None:
        """Remove this node's copy of ``key`` if it is ``value`` (a value that failed
        verification), so that local ranks ask the store instead."""
        path = self._path("values", key)
        try:
            with open(path, "rb") as f:
                if f.read() != value:
                    return
            os.remove(path)
        except FileNotFoundError:
            pass

    def lookup(self, flight: Singleflight, key: str, *, blocking: bool, wait_s: float | None,
               work_first: Callable[[], bool] | None, leaf: bool = False) -> LookupResult:
        """Look ``key`` up once per node: from this node's copy, else, under the key's node
        lock (so sibling processes wait here instead of asking the store), from the store,
        keeping what it returns. ``wait_s=None``: this process must not wait (it holds a
        claim), so it only tries the lock. ``work_first`` runs while it waits (either wait);
        ``leaf``: as ``Singleflight.lookup``'s."""
        local = self.read(key)
        if local is not None:
            return LookupResult(local, Outcome.NODE)
        if not self.copying:
            return flight.lookup(key, blocking=blocking, before_waiting=work_first, leaf=leaf)
        started = time.monotonic()
        wait_began: list[float] = []
        try:
            with self.lock(key, wait_s or 0.0, work_first if wait_s is not None else None, wait_began.append):
                local = self.read(key)
                if wait_began:  # another process of this node held the key's lock
                    self._events.span("wait", wait_began[0], key=short_key(key), via="node lock",
                                      ended="received" if local is not None else "asked the store")
                if local is not None:
                    return LookupResult(local, Outcome.NODE, time.monotonic() - started)
                lock_wait = time.monotonic() - started
                result = flight.lookup(key, blocking=blocking, before_waiting=work_first, leaf=leaf)
                result.waited_s += lock_wait
                if result.value is not None:
                    self.write(key, result.value)
                return result
        except WaitTimeout:
            return flight.lookup(key, blocking=blocking, leaf=leaf)
        except OSError as exc:  # the node's lock could not be made
            if exc.errno in _FULL:
                self.stop_copying(exc)
            else:
                log.warning("compile_once: node-local lookup of %s failed (%s); asking the store", key, exc)
            return flight.lookup(key, blocking=blocking, leaf=leaf)

    @contextlib.contextmanager
    def lock(self, key: str, timeout_s: float, while_waiting: Callable[[], bool] | None = None,
             waited: Callable[[float], None] | None = None) -> Iterator[None]:
        """Hold the node-wide lock of ``key``; raises ``WaitTimeout`` past ``timeout_s``
        (at once when ``timeout_s`` is 0 and another process holds it). ``while_waiting``
        is called between two tries (it returns whether it did work); ``waited`` as
        :func:`file_lock` calls it."""
        with file_lock(self._path("locks", key), timeout_s, while_waiting, waited) as locked:
            if not locked:
                raise WaitTimeout(f"node lock of {key} still held after {timeout_s:.0f}s")
            yield
