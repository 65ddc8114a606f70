"""The job's own torch.distributed store (TCPStore) as a coordinator store.

This is the embedded default: a torchrun job already runs a TCPStore for
rendezvous, so ranks can meet there with no server and no configuration. It lives
as long as the job, so nothing persists across jobs. Claims use ``compare_set``
with an empty expected value, which TCPStore treats as create-if-absent. Calls are
serialized with a lock so the heartbeat thread can share the connection; none of
them blocks. A read is a ``compare_set`` whose expected value no stored value equals
(``_ABSENT``): it answers the key's value, or ``_ABSENT`` for a missing key, in one round
trip, and writes nothing. (A ``get`` waits until the key exists: after a ``check``, a key
deleted in between, such as a liveness key at its job's exit, would hold the reader until
the store's timeout.)

TCPStore's libuv server (the default since torch 2.4) refuses any message over 8 MiB
and drops the connection, which is also the process group's. An FX-graph entry with
bundled Triton kernels easily exceeds that (max-autotune bundles every candidate), so
values above ``CHUNK_BYTES`` are written as chunks and a manifest
(:mod:`coordinator.protocol.stores.chunks`, as the Redis store does); the lock is released
between chunks so heartbeats go on.

A blocking wait (:meth:`C10dStore.watch`) is a ``get``, which blocks until the key exists,
on a client of its own (``clone``), kept in a pool and reused;
:meth:`C10dStore.prepare_watch` opens the first one when the session starts, so that a
job's waiters do not all connect at the moment of the first wait.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from coordinator.errors import StoreError
from coordinator.protocol.stores import chunks
from coordinator.protocol.stores.base import PollingWatch, Store, Watch, check_key

#: Largest single TCPStore value we write: half the libuv server's 8 MiB message limit.
CHUNK_BYTES = 4 * 1024 * 1024
#: What a read expects: no value we write equals it (they start with a tag byte).
_ABSENT = b"\x00coordinator: absent"


class C10dStore(Store):
    """Wraps a ``torch.distributed.Store`` (TCPStore, PrefixStore, FileStore, HashStore)."""

    name = "c10d"

    def __init__(self, store: Any, prefix: str = "coordinator/") -> None:
        self._store = store
        self._prefix = prefix
        self._lock = threading.Lock()
        self._idle_waiters: list[Any] = []  # clients of their own for blocking waits, not in use

    def _call(self, what: str, fn, *args):
        try:
            with self._lock:
                return fn(*args)
        except Exception as exc:  # c10d raises RuntimeError/DistStoreError subclasses
            raise StoreError(f"torch.distributed store {what} failed: {exc}") from exc

    def _read(self, full: str) -> bytes | None:
        def read():
            value = bytes(self._store.compare_set(full, _ABSENT, _ABSENT))
            # Every value we write starts with a tag byte: an empty one means absent too.
            return None if value == _ABSENT else value or None

        return self._call("get", read)

    def _chunk_key(self, full: str, upload_id: str, index: int) -> str:
        return f"{full}#chunk/{upload_id}/{index}"

    def get(self, key: str) -> bytes | None:
        full = self._prefix + check_key(key)
        head = self._read(full)
        if head is None:
            return None
        return chunks.join(key, head, lambda upload_id, n: [
            self._read(self._chunk_key(full, upload_id, index)) for index in range(n)
        ])

    def set(self, key: str, value: bytes, ttl: timedelta | None = None) -> None:
        full = self._prefix + check_key(key)
        old = self._read(full)
        head, upload_id, parts = chunks.split(value, CHUNK_BYTES)
        for index, part in enumerate(parts):
            self._call("set", self._store.set, self._chunk_key(full, upload_id, index), part)
        self._call("set", self._store.set, full, head)
        self._delete_chunks(full, old)

    def _delete_chunks(self, full: str, head: bytes | None) -> None:
        upload_id, n = chunks.chunk_names(head)
        for index in range(n):
            self._call("delete", self._store.delete_key, self._chunk_key(full, upload_id, index))

    def add_if_absent(self, key: str, value: bytes, ttl: timedelta | None = None) -> bool:
        full = self._prefix + check_key(key)
        if len(value) + 1 > CHUNK_BYTES:
            raise StoreError(f"claim value for {key} is {len(value)} bytes; the limit is {CHUNK_BYTES - 1}")
        current = self._call("compare_set", self._store.compare_set, full, b"", chunks.RAW + value)
        return bytes(current) == chunks.RAW + value

    def signal(self, key: str, value: bytes, ttl: timedelta | None = None) -> None:
        full = self._prefix + check_key(key)
        self._call("compare_set", self._store.compare_set, full, b"", chunks.RAW + value)

    @contextlib.contextmanager
    def watch(self, prefix: str) -> Iterator[Watch]:
        # A wait blocks its connection: it gets one of its own, so that this process's other
        # store calls (torch.distributed's too, on the job's store) never queue behind it.
        waiter = self._take_waiter()
        if waiter is None:
            yield PollingWatch(self)
            return
        try:
            yield _C10dWatch(self, waiter)
        finally:
            with self._lock:
                self._idle_waiters.append(waiter)

    def prepare_watch(self) -> None:
        # TCPStore's connect resolves the peer's name; at a job's first wait every waiter
        # would connect at once, and a burst of lookups can stall a connect for seconds.
        with self._lock:
            if self._idle_waiters or not hasattr(self._store, "clone"):
                return
        waiter = self._call("clone", self._store.clone)
        with self._lock:
            self._idle_waiters.append(waiter)

    def close(self) -> None:
        # The wrapped store is the job's (or the caller's) and stays open; the clients
        # cloned for waits are ours, and close as their last reference goes.
        with self._lock:
            self._idle_waiters.clear()

    def _take_waiter(self) -> Any | None:
        with self._lock:
            if self._idle_waiters:
                return self._idle_waiters.pop()
        if not hasattr(self._store, "clone"):
            return None
        return self._call("clone", self._store.clone)

    def delete(self, key: str) -> None:
        full = self._prefix + check_key(key)
        old = self._read(full)
        self._call("delete", self._store.delete_key, full)
        self._delete_chunks(full, old)


class _C10dWatch(Watch):
    """A blocking ``get`` on a client of its own: TCPStore's ``get`` waits on the server
    until the key exists, so the wake-up and the signal's value come in one call (the
    client's ``wait`` and then a ``get`` would be two, each a return to Python)."""

    blocking = True

    def __init__(self, store: C10dStore, client: Any) -> None:
        self.store, self.client = store, client

    def wait(self, key: str, timeout_s: float) -> bytes | None:
        full = self.store._prefix + check_key(key)
        try:
            self.client.set_timeout(timedelta(seconds=max(timeout_s, 0.001)))
            head = bytes(self.client.get(full))
        except Exception as exc:
            if "timeout" in str(exc).lower():
                return None
            raise StoreError(f"torch.distributed store wait failed: {exc}") from exc
        return chunks.join(key, head, lambda upload_id, n: [None] * n) if head else None
