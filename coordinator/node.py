"""Node-level single fetch: one process per node reads a key from the store.

Local ranks share Inductor's cache dir. When several of them need the same key at
once, the first to take the key's lock (``flock`` on a file in
``<cache dir>/coordinator/locks``) asks the store; the others wait on the lock and
then find the value in ``<cache dir>/coordinator/values`` (written by temp file +
rename). Values found there are verified like any other. Fetches from the store per
job are then one per node, not one per rank. The lock wait polls, so it ends at the
same deadline as any wait on the store.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
import uuid
from collections.abc import Callable, Iterator

from coordinator.errors import WaitTimeout


class NodeCache:
    """Values fetched or published by any process of this node, keyed by store key."""

    def __init__(self, cache_dir: str) -> None:
        self.root = os.path.join(cache_dir, "coordinator")

    def _path(self, kind: str, key: str) -> str:
        return os.path.join(self.root, kind, hashlib.sha256(key.encode()).hexdigest()[:40])

    def read(self, key: str) -> bytes | None:
        try:
            with open(self._path("values", key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def write(self, key: str, value: bytes) -> None:
        path = self._path("values", key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(value)
        os.replace(tmp, path)

    @contextlib.contextmanager
    def lock(self, key: str, timeout_s: float, while_waiting: Callable[[], bool] | None = None) -> Iterator[None]:
        """Hold the node-wide lock of ``key``; raises ``WaitTimeout`` past ``timeout_s``
        (at once when ``timeout_s`` is 0 and another process holds it). ``while_waiting``
        is called between two tries (it returns whether it did work)."""
        path = self._path("locks", key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a+") as f:
            deadline = time.monotonic() + timeout_s
            delay = 0.005
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise WaitTimeout(f"node lock of {key} still held after {timeout_s:.0f}s") from None
                    if while_waiting is not None and while_waiting():
                        delay = 0.005
                        continue
                    time.sleep(delay)
                    delay = min(delay * 1.5, 0.2)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
