"""Every store backend against the same contract, on real servers and real files."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest

from coordinator import ConfigError, StoreError, open_store
from coordinator.errors import StoreFull
from coordinator.protocol.stores.base import TimedStore
from coordinator.protocol.stores.bounds import CallBounds
from coordinator.protocol.stores.c10d import C10dStore
from coordinator.protocol.stores.redis import RedisStore

pytestmark = pytest.mark.protocol

#: Bounds short enough for a test to wait them out.
ONE_SECOND = CallBounds(connect=timedelta(seconds=1), answer=timedelta(seconds=1), tries=1)


@pytest.fixture(params=["c10d", "redis", "file"])
def store(request, tmp_path):
    if request.param == "c10d":
        yield open_store(request.getfixturevalue("tcp_store"))
    elif request.param == "redis":
        server = request.getfixturevalue("redis_server")
        s = RedisStore(server.url, chunk_bytes=4096)
        yield s
        s.close()
    else:
        yield open_store(f"file://{tmp_path / 'store'}")


def test_get_set_delete(store):
    assert store.get("a/b") is None
    store.set("a/b", b"value")
    assert store.get("a/b") == b"value"
    store.set("a/b", b"")
    assert store.get("a/b") == b""
    store.delete("a/b")
    assert store.get("a/b") is None
    store.delete("a/b")  # absent: not an error


def test_add_if_absent_has_one_winner_among_threads(store):
    winners = []

    def claim(i):
        if store.add_if_absent("claim/x", f"owner{i}".encode(), ttl=timedelta(seconds=60)):
            winners.append(i)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert store.get("claim/x") == f"owner{winners[0]}".encode()


def test_large_value_round_trips(store):
    value = bytes(range(256)) * 1000  # 256 kB: 63 chunks in the redis store
    store.set("big", value)
    assert store.get("big") == value
    store.set("big", b"small again")
    assert store.get("big") == b"small again"


def test_values_past_the_tcpstore_message_limit(tcp_store):
    """TCPStore's libuv server drops any message over 8 MiB, and the connection with it."""
    import torch.distributed as dist

    raw = dist.TCPStore("127.0.0.1", tcp_store.port, is_master=False, timeout=timedelta(seconds=30))
    store = C10dStore(raw)
    before = raw.num_keys()
    value = bytes(range(256)) * (37 * 1024 * 1024 // 256)  # 37 MiB: 10 chunks
    store.set("fx/big", value)
    assert store.get("fx/big") == value
    assert raw.num_keys() == before + 11  # 10 chunks and the manifest
    store.set("fx/big", b"small again")  # the old chunks go
    assert store.get("fx/big") == b"small again"
    assert raw.num_keys() == before + 1
    store.set("fx/big", value)
    store.delete("fx/big")
    assert store.get("fx/big") is None and raw.num_keys() == before
    # The connection survived all of it.
    store.set("after", b"ok")
    assert store.get("after") == b"ok"


def test_a_key_deleted_while_read_reads_as_absent(tcp_store):
    """TCPStore answers a get of a key deleted after its check with b"". Seen on the GPU
    host: a follower read a heartbeat as its owner published and deleted it, took the
    empty value for a corrupt one and stopped using the store for the rest of the job."""
    import torch.distributed as dist

    def client():
        return C10dStore(dist.TCPStore("127.0.0.1", tcp_store.port, is_master=False, timeout=timedelta(seconds=30)))

    writer, reader = client(), client()
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            writer.set("h/key/0", b"beat")
            writer.delete("h/key/0")

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        seen = [reader.get("h/key/0") for _ in range(3000)]
    finally:
        stop.set()
        thread.join()
    assert set(seen) <= {None, b"beat"}
    assert b"beat" in seen and None in seen  # the reads did race the writer


def test_rejects_bad_keys(store):
    for bad in ["../escape", "/abs", "sp ace", ""]:
        with pytest.raises(ConfigError):
            store.get(bad)


def test_redis_chunks_are_replaced_and_cleaned(redis_server):
    import redis

    s = RedisStore(redis_server.url, chunk_bytes=1024)
    s.set("k", b"x" * 5000)
    raw = redis.Redis.from_url(redis_server.url)
    assert len([k for k in raw.keys("*") if b"#chunk/" in k]) == 5
    s.set("k", b"y" * 3000)
    assert s.get("k") == b"y" * 3000
    assert len([k for k in raw.keys("*") if b"#chunk/" in k]) == 3
    s.delete("k")
    assert raw.keys("*") == []


def test_redis_missing_chunk_reads_as_absent(redis_server):
    import redis

    s = RedisStore(redis_server.url, chunk_bytes=1024)
    s.set("k", b"x" * 5000)
    raw = redis.Redis.from_url(redis_server.url)
    raw.delete(next(k for k in raw.keys("*") if b"#chunk/" in k))
    assert s.get("k") is None


def test_redis_password_in_url(tmp_path):
    from conftest import RedisServer

    server = RedisServer(tmp_path)
    try:
        import redis

        redis.Redis(port=server.port).config_set("requirepass", "s3cret")
        with pytest.raises(StoreError):
            RedisStore(server.url).get("k")
        s = RedisStore(f"redis://:s3cret@127.0.0.1:{server.port}/0")
        s.set("k", b"v")
        assert s.get("k") == b"v"
        assert "s3cret" not in s.name
    finally:
        server.kill()


def test_dead_redis_raises_store_error(redis_server):
    s = RedisStore(redis_server.url, bounds=ONE_SECOND)
    s.set("k", b"v")
    redis_server.kill()
    with pytest.raises(StoreError, match="redis GET failed"):
        s.get("k")


def test_a_redis_server_that_never_answers_fails_a_call_within_its_bound(silent_server):
    s = RedisStore(f"redis://127.0.0.1:{silent_server.port}/0", bounds=ONE_SECOND)
    started = time.monotonic()
    with pytest.raises(StoreError, match="redis GET failed"):
        s.get("k")
    # 2 s for a loaded machine.
    assert time.monotonic() - started < ONE_SECOND.longest_request().total_seconds() + 2


def test_dead_tcp_store_raises_store_error():
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=2))
    s = C10dStore(client)
    s.set("k", b"v")
    del master
    with pytest.raises(StoreError):
        s.get("k")


def test_timed_store_reports_every_call(store):
    took = []
    timed = TimedStore(store, took.append)
    assert timed.name == store.name
    timed.set("t/k", b"v" * 10000)
    assert timed.get("t/k") == b"v" * 10000
    assert timed.add_if_absent("t/claim", b"1") is True
    timed.delete("t/k")
    assert timed.get("t/k") is None
    assert len(took) == 5 and all(seconds >= 0 for seconds in took) and sum(took) > 0


def test_get_many_reads_values_and_absent_keys_in_order_with_a_call_per_request(store, request):
    big = os.urandom(3 * 1024 * 1024 + 5)  # chunked on Redis (1 MiB chunks below)
    if isinstance(store, RedisStore):
        store = RedisStore(request.getfixturevalue("redis_server").url, chunk_bytes=1024 * 1024)
    store.set("gm/a", b"first")
    store.set("gm/big", big)
    assert store.get_many(["gm/big", "gm/none", "gm/a"]) == [big, None, b"first"]
    seconds: list[float] = []
    timed = TimedStore(store, seconds.append)
    assert timed.get_many(["gm/a", "gm/none"]) == [b"first", None]
    # Redis reads them in one MGET; the others make a request a key, and count so.
    assert len(seconds) == (1 if isinstance(store, RedisStore) else 2)


def test_timed_store_reports_failed_calls_and_passes_the_error_on(redis_server):
    took = []
    timed = TimedStore(RedisStore(redis_server.url, bounds=ONE_SECOND), took.append)
    timed.set("k", b"v")
    redis_server.kill()
    with pytest.raises(StoreError, match="redis GET failed"):
        timed.get("k")
    assert len(took) == 2


def test_open_store_choices(tmp_path):
    with pytest.raises(ConfigError, match="unknown store URL scheme"):
        open_store("http://example")
    with pytest.raises(ConfigError, match="names a host"):
        open_store("file://host/path")
    with pytest.raises(StoreError, match="not initialized"):
        open_store(None)
    s = open_store(f"file://{tmp_path}")
    assert open_store(s) is s


def raw_redis(server):
    import redis

    return redis.Redis.from_url(server.url)


def over_maxmemory(server, by: int) -> None:
    """Set the server's maxmemory to ``by`` bytes below (negative: above) what it uses now.
    Below, noeviction refuses every write, whatever its size."""
    raw = raw_redis(server)
    raw.config_set("maxmemory", raw.info("memory")["used_memory"] - by)


def test_redis_at_maxmemory_refuses_writes_and_is_still_read(tmp_path):
    """noeviction at maxmemory: every write is refused (StoreFull), reads, deletes and
    PEXPIRE still work, a refused signal still reaches its subscribers, and a chunked value
    whose write is refused part way leaves no chunk behind."""
    from conftest import RedisServer

    server = RedisServer(tmp_path, "--maxmemory-policy", "noeviction")
    try:
        s = RedisStore(server.url, chunk_bytes=32 * 1024)
        s.set("kept", bytes(500_000))
        got = {}
        with s.watch("w/k/0") as watch:
            over_maxmemory(server, 100_000)
            with pytest.raises(StoreFull, match="maxmemory"):
                s.set("more", b"v")
            with pytest.raises(StoreFull, match="maxmemory"):
                s.add_if_absent("claim", b"me")
            assert s.get("kept") == bytes(500_000)
            s.expire("kept", timedelta(seconds=60))
            thread = threading.Thread(target=lambda: got.setdefault("signal", watch.wait("w/k/0/1", 5)))
            thread.start()
            time.sleep(0.2)
            with pytest.raises(StoreFull):
                s.signal("w/k/0/1", b"abandoned")
            thread.join(5)
        assert got["signal"] == b"abandoned"
        over_maxmemory(server, -50_000)  # room for a chunk or two of the next value, not for all of it
        with pytest.raises(StoreFull):
            s.set("big", bytes(300_000))
        assert s.get("big") is None
        assert not raw_redis(server).keys("*big#chunk/*")
        s.delete("kept")
    finally:
        server.kill()


def test_redis_capacity_is_maxmemory_less_what_the_server_uses_empty(tmp_path, redis_server):
    from conftest import RedisServer

    assert RedisStore(redis_server.url).capacity() is None  # no maxmemory
    server = RedisServer(tmp_path / "limited", "--maxmemory", "2mb")
    try:
        startup = raw_redis(server).info("memory")["used_memory_startup"]
        assert RedisStore(server.url).capacity() == 2 * 1024 * 1024 - startup
    finally:
        server.kill()


def test_redis_keys_expire_and_ttls_must_be_positive(redis_server):
    s = RedisStore(redis_server.url)
    assert s.expires and s.name == f"redis 127.0.0.1:{redis_server.port}/0"
    s.set("short", b"v", ttl=timedelta(milliseconds=300))
    s.signal("w/k/0/1", b"beat", ttl=timedelta(milliseconds=300))
    assert s.add_if_absent("c/k/0", b"me", ttl=timedelta(milliseconds=300))
    s.set("extended", b"v", ttl=timedelta(milliseconds=300))
    s.expire("extended", timedelta(seconds=60))
    time.sleep(0.6)
    assert [s.get(k) for k in ("short", "w/k/0/1", "c/k/0", "extended")] == [None, None, None, b"v"]
    for ttl in (timedelta(0), timedelta(seconds=-5)):
        with pytest.raises(ConfigError, match=r"ttl=-?\d+s: a time to live must be a positive"):
            s.set("k", b"v", ttl=ttl)


def test_a_full_directory_store_refuses_writes_and_is_still_read(tmp_path):
    from conftest import small_file_system

    with small_file_system(tmp_path / "fs", "1m") as root:
        s = open_store(f"file://{root}")
        s.set("kept", b"value")
        with pytest.raises(StoreFull, match="No space left"):
            for n in range(100):
                s.set(f"fill/{n}", bytes(100_000))
        with pytest.raises(StoreFull):
            s.add_if_absent("claim", bytes(200_000))
        assert s.get("kept") == b"value"
        assert not [name for name in os.listdir(root) if ".tmp-" in name]  # no half-written temp file left
        s.delete("kept")


def test_a_redis_watch_works_right_after_the_server_restarted(tmp_path):
    """The subscriber connections kept between waits die with the server; the first wait
    after it is back opens a new one instead of failing."""
    from conftest import RedisServer

    server = RedisServer(tmp_path)
    try:
        s = RedisStore(server.url)
        s.prepare_watch()
        with s.watch("w/a/0") as watch:
            s.signal("w/a/0/1", b"beat")
            assert watch.wait("w/a/0/1", 2) == b"beat"
        server.kill()
        server.start()
        with s.watch("w/b/0") as watch:
            s.signal("w/b/0/1", b"beat")
            assert watch.wait("w/b/0/1", 2) == b"beat"
    finally:
        server.kill()


def test_a_key_deleted_for_good_while_read_never_holds_the_reader(tcp_store):
    """A TCPStore ``get`` waits until its key exists: a read that found a key that is then
    deleted for good (a job's liveness key at its exit) must not wait for it."""
    import torch.distributed as dist

    def client():
        return C10dStore(dist.TCPStore("127.0.0.1", tcp_store.port, is_master=False, timeout=timedelta(seconds=30)))

    writer, reader = client(), client()
    seen: list = []
    stop = threading.Event()

    def read_each():
        n = 0
        while not stop.is_set():
            seen.append(reader.get(f"j/{n}"))
            n = (n + 1) % 400

    thread = threading.Thread(target=read_each, daemon=True)
    thread.start()
    for _ in range(3):
        for n in range(400):
            writer.set(f"j/{n}", b"beat")
        for n in range(400):
            writer.delete(f"j/{n}")
    stop.set()
    thread.join(10)
    assert not thread.is_alive(), "a read waited for a deleted key"
    assert set(seen) <= {None, b"beat"} and b"beat" in seen
