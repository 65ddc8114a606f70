"""The job's own torch.distributed store (TCPStore) as a coordinator store.

This is the embedded default: a torchrun job already runs a TCPStore for
rendezvous, so ranks can meet there with no server and no configuration. It lives
as long as the job, so nothing persists across jobs. Claims use ``compare_set``
with an empty expected value, which TCPStore treats as create-if-absent. Calls are
serialized with a lock so the heartbeat thread can share the connection; none of
them blocks, because ``get`` is only issued for keys that ``check`` found.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from coordinator.errors import StoreError
from coordinator.stores.base import Store, check_key


class C10dStore(Store):
    """Wraps a ``torch.distributed.Store`` (TCPStore, PrefixStore, FileStore, HashStore)."""

    name = "c10d"

    def __init__(self, store: Any, prefix: str = "coordinator/") -> None:
        self._store = store
        self._prefix = prefix
        self._lock = threading.Lock()

    def _call(self, what: str, fn, *args):
        try:
            with self._lock:
                return fn(*args)
        except Exception as exc:  # c10d raises RuntimeError/DistStoreError subclasses
            raise StoreError(f"torch.distributed store {what} failed: {exc}") from exc

    def get(self, key: str) -> bytes | None:
        full = self._prefix + check_key(key)

        def read():
            if not self._store.check([full]):
                return None
            return bytes(self._store.get(full))

        return self._call("get", read)

    def set(self, key: str, value: bytes, ttl: timedelta | None = None) -> None:
        self._call("set", self._store.set, self._prefix + check_key(key), value)

    def add_if_absent(self, key: str, value: bytes, ttl: timedelta | None = None) -> bool:
        full = self._prefix + check_key(key)
        current = self._call("compare_set", self._store.compare_set, full, b"", value)
        return bytes(current) == value

    def delete(self, key: str) -> None:
        self._call("delete", self._store.delete_key, self._prefix + check_key(key))
