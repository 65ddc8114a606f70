"""Redis (or Valkey) as a coordinator store, for sharing compiles across jobs.

``redis://[:password@]host:port/db`` or ``rediss://`` for TLS. Claims are
``SET key value NX PX lease``. Redis refuses values over 512 MB and large values
block the server, so a value longer than ``chunk_bytes`` is written as chunks under
an upload id, and only then is the key set to a small manifest naming them
(:mod:`coordinator.stores.chunks`): a reader never sees a half-written value. redis-py is imported only when this store
is chosen.
"""

from __future__ import annotations

from datetime import timedelta

from coordinator.errors import StoreError
from coordinator.stores import chunks
from coordinator.stores.base import Store, check_key


class RedisStore(Store):
    """A Redis server reached through redis-py; values chunked above ``chunk_bytes``."""

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        chunk_bytes: int = 64 * 1024 * 1024,
        prefix: str = "coordinator/",
        timeout: timedelta = timedelta(seconds=10),
    ) -> None:
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - redis is a declared dependency
            raise StoreError("the redis store needs redis-py: pip install redis") from exc
        self._redis_errors = (redis.exceptions.RedisError, OSError)
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout.total_seconds(),
            socket_connect_timeout=timeout.total_seconds(),
        )
        self._chunk_bytes = chunk_bytes
        self._prefix = prefix
        # Never log the password.
        self.name = f"redis {url.split('@')[-1]}"

    def _key(self, key: str) -> str:
        return self._prefix + check_key(key)

    def _chunk_key(self, key: str, upload_id: str, index: int) -> str:
        return f"{self._key(key)}#chunk/{upload_id}/{index}"

    def _run(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._redis_errors as exc:
            raise StoreError(f"redis {what} failed on {self.name}: {exc}") from exc

    def get(self, key: str) -> bytes | None:
        head = self._run("GET", self._client.get, self._key(key))
        if head is None:
            return None
        return chunks.join(key, head, lambda upload_id, n: self._get_chunks(key, upload_id, n))

    def _get_chunks(self, key: str, upload_id: str, n: int) -> list[bytes | None]:
        parts = []
        for start in range(0, n, 8):
            pipe = self._client.pipeline(transaction=False)
            for index in range(start, min(start + 8, n)):
                pipe.get(self._chunk_key(key, upload_id, index))
            parts.extend(self._run("GET chunks", pipe.execute))
        return parts

    def set(self, key: str, value: bytes, ttl: timedelta | None = None) -> None:
        px = int(ttl.total_seconds() * 1000) if ttl is not None else None
        head, upload_id, parts = chunks.split(value, self._chunk_bytes)
        for index, part in enumerate(parts):
            self._run("SET chunk", self._client.set, self._chunk_key(key, upload_id, index), part, px=px)
        old = self._run("SET", self._client.set, self._key(key), head, px=px, get=True)
        self._delete_chunks(key, old)

    def _delete_chunks(self, key: str, head: bytes | None) -> None:
        upload_id, n = chunks.chunk_names(head)
        names = [self._chunk_key(key, upload_id, i) for i in range(n)]
        if names:
            self._run("DEL chunks", self._client.delete, *names)

    def list_keys(self, prefix: str) -> list[str]:
        pattern = self._key(prefix) + "*"
        names = self._run("SCAN", lambda: list(self._client.scan_iter(match=pattern, count=1000)))
        start = len(self._prefix)
        return sorted(n.decode()[start:] for n in names if b"#chunk/" not in n)

    def add_if_absent(self, key: str, value: bytes, ttl: timedelta | None = None) -> bool:
        px = int(ttl.total_seconds() * 1000) if ttl is not None else None
        created = self._run("SET NX", self._client.set, self._key(key), chunks.RAW + value, nx=True, px=px)
        return bool(created)

    def delete(self, key: str) -> None:
        old = self._run("GETDEL", self._client.getdel, self._key(key))
        self._delete_chunks(key, old)

    def close(self) -> None:
        self._client.close()
