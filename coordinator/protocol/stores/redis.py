"""Redis (or Valkey) as a coordinator store, for sharing compiles across jobs.

``redis://[:password@]host:port/db`` or ``rediss://`` for TLS. Claims are
``SET key value NX PX ttl``; keys written with a ``ttl`` expire (``PX``), and
:meth:`RedisStore.expire` is ``PEXPIRE``. Redis refuses values over 512 MB and large values
block the server, so a value longer than ``chunk_bytes`` is written as chunks under
an upload id, and only then is the key set to a small manifest naming them
(:mod:`coordinator.protocol.stores.chunks`): a reader never sees a half-written value, and
the chunks of a write that fails are deleted.

A server at ``maxmemory`` under ``noeviction`` refuses writes with an ``OOM`` error: that is
:class:`~coordinator.errors.StoreFull`, and reads, deletes, ``PEXPIRE`` and ``PUBLISH`` still
work. :meth:`RedisStore.capacity` reads ``maxmemory`` once (``INFO memory``; a server that
refuses ``INFO`` has no known limit). redis-py is imported only when this store is chosen.

Each call waits for its connection and for each answer at most what ``bounds.REDIS`` says
(:mod:`coordinator.protocol.stores.bounds`), and is tried once; a blocking wait ends at its own
timeout.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from coordinator.errors import StoreError, StoreFull
from coordinator.protocol.stores import chunks
from coordinator.protocol.stores.base import Store, Watch, check_key, ttl_ms
from coordinator.protocol.stores.bounds import REDIS, CallBounds
from coordinator.settings import shown_url

_UNKNOWN = object()


class RedisStore(Store):
    """A Redis server reached through redis-py; values chunked above ``chunk_bytes``."""

    name = "redis"
    expires = True
    reads_at_once = True

    def __init__(
        self,
        url: str,
        *,
        chunk_bytes: int = 64 * 1024 * 1024,
        prefix: str = "coordinator/",
        bounds: CallBounds = REDIS,
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:  # pragma: no cover - redis is a declared dependency
            raise StoreError("the redis store needs redis-py: pip install redis") from exc
        self._redis_errors = (redis.exceptions.RedisError, OSError)
        self._refused = redis.exceptions.OutOfMemoryError
        self._response_error = redis.exceptions.ResponseError
        scheme, _, where = shown_url(url).partition("://")
        # Named without user, password or query, and the scheme once: "redis host:port/db".
        self.name = f"{scheme} {where.rpartition('***@')[2].partition('?')[0].partition('#')[0]}"
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_connect_timeout=bounds.connect.total_seconds(),
                socket_timeout=bounds.answer.total_seconds(),  # each send and each wait for an answer
                retry=Retry(NoBackoff(), bounds.tries - 1),  # on a timeout or a lost connection
            )
        except ValueError as exc:  # check_store_url refuses these first
            raise StoreError(f"cannot use redis store {self.name}: {exc}") from None
        self._chunk_bytes = chunk_bytes
        self._prefix = prefix
        self._subscribers: list[Any] = []  # subscriber connections not in a wait
        self._subscribers_lock = threading.Lock()
        self._capacity: Any = _UNKNOWN

    def _key(self, key: str) -> str:
        return self._prefix + check_key(key)

    def _chunk_key(self, key: str, upload_id: str, index: int) -> str:
        return f"{self._key(key)}#chunk/{upload_id}/{index}"

    def _run(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._redis_errors as exc:
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: BaseException) -> StoreError:
        if isinstance(exc, self._refused):
            return StoreFull(f"redis {what} refused on {self.name}: {exc}")
        return StoreError(f"redis {what} failed on {self.name}: {exc}")

    def get(self, key: str) -> bytes | None:
        head = self._run("GET", self._client.get, self._key(key))
        if head is None:
            return None
        return chunks.join(key, head, lambda upload_id, n: self._get_chunks(key, upload_id, n))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        heads = self._run("MGET", self._client.mget, [self._key(key) for key in keys])
        return [None if head is None else chunks.join(key, head, lambda i, n, key=key: self._get_chunks(key, i, n))
                for key, head in zip(keys, heads, strict=True)]

    def _get_chunks(self, key: str, upload_id: str, n: int) -> list[bytes | None]:
        parts = []
        for start in range(0, n, 8):
            pipe = self._client.pipeline(transaction=False)
            for index in range(start, min(start + 8, n)):
                pipe.get(self._chunk_key(key, upload_id, index))
            parts.extend(self._run("GET chunks", pipe.execute))
        return parts

    def set(self, key: str, value: bytes, ttl: timedelta | None = None) -> None:
        px = ttl_ms(ttl)
        head, upload_id, parts = chunks.split(value, self._chunk_bytes)
        written: list[str] = []
        try:
            for index, part in enumerate(parts):
                name = self._chunk_key(key, upload_id, index)
                self._run("SET chunk", self._client.set, name, part, px=px)
                written.append(name)
            old = self._run("SET", self._client.set, self._key(key), head, px=px, get=True)
        except StoreError:
            if written:  # a value that was not published leaves no chunks behind (DEL works at maxmemory)
                with contextlib.suppress(StoreError):
                    self._run("DEL chunks", self._client.delete, *written)
            raise
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
        px = ttl_ms(ttl)
        created = self._run("SET NX", self._client.set, self._key(key), chunks.RAW + value, nx=True, px=px)
        return bool(created)

    def delete(self, key: str) -> None:
        old = self._run("GETDEL", self._client.getdel, self._key(key))
        self._delete_chunks(key, old)

    def signal(self, key: str, value: bytes, ttl: timedelta | None = None) -> None:
        # The key for a waiter that subscribes later, the message (with the value) for the
        # subscribed ones: one round trip. At maxmemory the SET is refused and the PUBLISH
        # still wakes the subscribed waiters; the refusal is raised after it.
        import msgpack

        channel, _, name = self._key(key).rpartition("/")
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._key(key), chunks.RAW + value, px=ttl_ms(ttl))
        pipe.publish(channel, msgpack.packb([name, value]))
        results = self._run("SET+PUBLISH", pipe.execute, raise_on_error=False)
        failed = next((result for result in results if isinstance(result, BaseException)), None)
        if failed is not None:
            raise self._error("SET+PUBLISH", failed) from failed

    def expire(self, key: str, ttl: timedelta) -> None:
        self._run("PEXPIRE", self._client.pexpire, self._key(key), ttl_ms(ttl))

    def capacity(self) -> int | None:
        """``maxmemory`` less the memory the server used when it started, read once; ``None``
        when no ``maxmemory`` is set or the server refuses ``INFO``."""
        if self._capacity is _UNKNOWN:
            try:
                info = self._client.info("memory")
            except self._response_error:  # INFO renamed or disabled (managed Redis): no known limit
                info = {}
            except self._redis_errors as exc:
                raise self._error("INFO", exc) from exc
            maxmemory = int(info.get("maxmemory", 0) or 0)
            self._capacity = max(0, maxmemory - int(info.get("used_memory_startup", 0) or 0)) if maxmemory else None
        return self._capacity

    @contextlib.contextmanager
    def watch(self, prefix: str) -> Iterator[Watch]:
        # A subscriber connection is kept between waits (a pool of them, one per concurrent
        # wait): reconnecting at every wait would add a connect per node to each publish. A
        # wait's channel is left at the start of the next wait, so that nothing but the
        # message lies between a wake-up and the caller.
        channel = self._key(prefix).rstrip("/")
        pubsub = self._subscribed(channel)
        try:
            yield _RedisWatch(self, pubsub, channel)
        except BaseException:
            with contextlib.suppress(*self._redis_errors):
                pubsub.close()
            raise
        with self._subscribers_lock:
            self._subscribers.append(pubsub)

    def _subscribed(self, channel: str) -> Any:
        """A subscriber connection on ``channel``: a kept one, else a new one. A kept one that
        fails (its server restarted since) is closed with every other kept one, and a new
        one is tried."""
        while True:
            with self._subscribers_lock:
                pubsub = self._subscribers.pop() if self._subscribers else None
            kept = pubsub is not None
            if not kept:
                pubsub = self._take_subscriber()
            try:
                left = getattr(pubsub, "coordinator_channel", None)
                if left is not None and left != channel:
                    self._run("UNSUBSCRIBE", pubsub.unsubscribe, left)
                pubsub.coordinator_channel = None
                self._run("SUBSCRIBE", pubsub.subscribe, channel)
                pubsub.coordinator_channel = channel
                return pubsub
            except StoreError:
                with self._subscribers_lock:
                    stale, self._subscribers = [pubsub, *self._subscribers], []
                for each in stale:
                    with contextlib.suppress(*self._redis_errors):
                        each.close()
                if not kept:
                    raise

    def _take_subscriber(self) -> Any:
        with self._subscribers_lock:
            if self._subscribers:
                return self._subscribers.pop()
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        # A channel of its own keeps the connection subscribed (open) between waits.
        self._run("SUBSCRIBE", pubsub.subscribe, f"{self._prefix}idle/{uuid.uuid4().hex}")
        return pubsub

    def prepare_watch(self) -> None:
        # Open the subscriber connection and one for the other calls now, not a job's worth
        # at the first wait (at 1,000 waiters such a burst delayed the first value by 5 to 17 s).
        with self._subscribers_lock:
            if self._subscribers:
                return
        subscriber = self._take_subscriber()
        with self._subscribers_lock:
            self._subscribers.append(subscriber)
        self._run("PING", self._client.ping)

    def close(self) -> None:
        with self._subscribers_lock:
            subscribers, self._subscribers = self._subscribers, []
        for pubsub in subscribers:
            with contextlib.suppress(*self._redis_errors):
                pubsub.close()
        self._client.close()


class _RedisWatch(Watch):
    """Signals arrive as messages on the prefix's channel; a key is read from the store
    only until the first one that does not exist yet (later ones come as messages).

    Signal slots are numbered: a wait for slot ``n`` also ends with a message of a later
    slot (the claimant's beat counter can run ahead of what the waiter read when the
    store refused to keep it, at ``maxmemory``; the signals still come as messages)."""

    blocking = True

    def __init__(self, store: RedisStore, pubsub: Any, channel: str) -> None:
        self.store, self.pubsub, self.channel = store, pubsub, channel.encode()
        self.seen: dict[str, bytes] = {}
        self.live = False

    def wait(self, key: str, timeout_s: float) -> bytes | None:
        import msgpack

        name = key.rpartition("/")[2]
        if name in self.seen:
            return self.seen[name]
        later = self._later(name)
        if later is not None:
            return later
        if not self.live:
            value = self.store.get(key)
            if value is not None:
                return value
            self.live = True  # subscribed before this read: anything later is a message
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            message = self.store._run("message", self.pubsub.get_message, timeout=left)
            # Skip other messages: a channel of an earlier wait on this connection, a pong.
            if message is None or message.get("type") != "message" or message.get("channel") != self.channel:
                continue
            got, value = msgpack.unpackb(message["data"])
            self.seen[got] = value
            if got == name or self._later(name) is not None:
                return value

    def _later(self, name: str) -> bytes | None:
        """The signal of the first slot after ``name`` that came as a message, if any."""
        if not name.isdigit():
            return None
        later = [int(got) for got in self.seen if got.isdigit() and int(got) > int(name)]
        return self.seen[str(min(later))] if later else None
