"""The faults a cluster's store gives, on real stores: a full Redis (noeviction and
allkeys-lru), a server killed and started again, claims a dead job left, a full disk.

The first tests drive the protocol directly (threads and processes of their own); the
last ones run jobs of real rank processes under ``compile_once``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import threading
import time
from datetime import timedelta

import msgpack
import pytest
import redis
import torch
from conftest import RedisServer, WaitSeen, require_success, small_file_system

from coordinator.protocol.singleflight import Owner, Singleflight
from coordinator.protocol.stores.base import TimedStore
from coordinator.testing import open_test_store

pytestmark = pytest.mark.protocol


_made: list[Singleflight] = []


@pytest.fixture(autouse=True)
def _close_flights():
    yield
    while _made:
        with contextlib.suppress(Exception):
            _made.pop().close()


def flight(store, rank: int = 0, *, lease: float = 30.0, job: str = "job-b", signalled: bool = True,
           wait_timeout: float = 60.0) -> Singleflight:
    """A process's singleflight client (of job ``job``), closed at the end of the test; its
    store says when it waits on a claim (``WaitSeen``)."""
    made = Singleflight(WaitSeen(store), owner=Owner.this_process(rank, job), lease=timedelta(seconds=lease),
                        wait_timeout=timedelta(seconds=wait_timeout), progress_interval=timedelta(seconds=30),
                        signalled_waits=signalled)
    _made.append(made)
    return made


def wait_in_thread(f: Singleflight, key: str) -> tuple[threading.Thread, dict]:
    """``f``'s blocking lookup of ``key`` in a thread; returns once the lookup waits for the
    signals of another process's claim (or has ended without waiting)."""
    got: dict = {}
    f.store.waiting.clear()

    def run():
        started = time.monotonic()
        got["result"] = f.lookup(key, blocking=True)
        got["took"] = time.monotonic() - started

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while not f.store.waiting.wait(0.05) and thread.is_alive():
        assert time.monotonic() < deadline, f"the lookup of {key} neither waited nor ended"
    return thread, got


def set_maxmemory_below_use(server: RedisServer, by: int = 300_000) -> None:
    """noeviction with maxmemory well below what the server uses: every write is refused.
    A 500 kB key first, so that the limit can be that far below the use and still leave the
    store's capacity (maxmemory less the server's startup use) above a 200 kB value: Redis
    shrinks idle clients' buffers a few seconds later (tens of kB here), which must not
    make room again."""
    raw = redis.Redis.from_url(server.url)
    raw.set("test-filler", bytes(500_000))
    raw.config_set("maxmemory", raw.info("memory")["used_memory"] - by)


# -- a claimant that cannot finish releases its waiters at once -----------------------------

@pytest.mark.parametrize("signalled", [True, False], ids=["signalled", "polling"])
def test_a_claimant_whose_store_fills_up_releases_its_waiters_at_once(tmp_path, signalled):
    """Redis reaches maxmemory (noeviction) while a rank compiles: its publish is refused.
    It releases the claim at once (the marker is refused too: the claim is deleted, and the
    signal still reaches subscribers), so its waiters compile now, not a lease later. Then
    the store is only read: a published value is a hit, a miss claims nothing."""
    server = RedisServer(tmp_path, "--maxmemory-policy", "noeviction")
    try:
        claimant, waiter = flight(open_test_store(server.url), 0), flight(open_test_store(server.url), 1,
                                                                          signalled=signalled)
        assert claimant.lookup("published", blocking=True).outcome == "claimed"
        assert claimant.publish("published", b"an early value")
        assert claimant.lookup("k", blocking=True).outcome == "claimed"
        thread, got = wait_in_thread(waiter, "k")
        assert thread.is_alive()
        set_maxmemory_below_use(server)
        assert claimant.publish("k", bytes(200_000)) is False
        # For a backoff (1 s) the store is only read: a published value is a hit, a miss claims nothing.
        assert claimant.health.writable() is False
        assert claimant.lookup("published", blocking=True).value == b"an early value"
        assert claimant.lookup("k2", blocking=True).outcome == "nonblocking"
        thread.join(30)
        # Woken by the signal, or (polling) by the claim's deletion at its next look, a
        # quarter lease on: not after the 30 s lease.
        assert got["took"] < (3 if signalled else 12), got
        assert got["result"].outcome in ("abandoned", "unavailable")
    finally:
        server.kill()


def test_a_rank_whose_store_refuses_writes_still_waits_for_another_rank_s_claim(tmp_path):
    """A rank whose publish was refused claims nothing for its backoff, but a graph another
    rank is compiling (that rank could write when it claimed) it waits for and receives."""
    server = RedisServer(tmp_path, "--maxmemory-policy", "noeviction")
    try:
        full, other = flight(open_test_store(server.url), 0), flight(open_test_store(server.url), 1)
        assert full.lookup("k", blocking=True).outcome == "claimed"
        raw = redis.Redis.from_url(server.url)
        set_maxmemory_below_use(server)
        assert full.publish("k", bytes(200_000)) is False and not full.health.writable()
        raw.config_set("maxmemory", 0)  # room again, which this rank learns only after its backoff
        assert other.lookup("x", blocking=True).outcome == "claimed"
        thread, got = wait_in_thread(full, "x")
        assert thread.is_alive() and not full.health.writable()  # waiting, not compiling
        assert other.publish("x", b"from the other rank")
        thread.join(10)
        assert (got["result"].value, got["result"].outcome) == (b"from the other rank", "waited")
        assert full.lookup("y", blocking=True).outcome in ("nonblocking", "claimed")  # nobody holds y
    finally:
        server.kill()


def test_a_value_larger_than_the_store_holds_is_not_sent(tmp_path, caplog):
    """maxmemory 2 MB (about 1.2 MB for keys): a 2 MB value is never sent (said once, with
    the size and the limit), and its claim is released at once."""
    server = RedisServer(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    try:
        claimant, waiter = flight(open_test_store(server.url), 0), flight(open_test_store(server.url), 1)
        limit = claimant.store.capacity()
        assert 0 < limit < 2_000_000
        for key in ("a", "b"):
            assert claimant.lookup(key, blocking=True).outcome == "claimed"
            thread, got = wait_in_thread(waiter, key)
            with caplog.at_level(logging.WARNING, "coordinator"):
                assert claimant.publish(key, bytes(2_000_000)) is False
            thread.join(10)
            assert got["result"].outcome == "abandoned" and got["took"] < 3, got
        said = [r.getMessage() for r in caplog.records if "is not sent" in r.getMessage()]
        assert len(said) == 1, said
        assert f"holds at most {limit} bytes" in said[0] and "a value of 2000000 bytes" in said[0]
        assert claimant.lookup("c", blocking=True).outcome == "claimed"  # small values still go
        assert claimant.publish("c", bytes(1000))
        assert redis.Redis.from_url(server.url).keys("*/v/a") == []
    finally:
        server.kill()


class EvictingStore(TimedStore):
    """Loses each value right after it is written, as a Redis under allkeys-lru at
    maxmemory can: the waiters' wake-up finds it gone."""

    def __init__(self, inner) -> None:
        super().__init__(inner, lambda seconds: None)

    def signal(self, key, value, ttl=None):
        at = key.split("/")[1]
        if value == b"published":
            self.inner.delete(f"v/{at}")
        self.inner.signal(key, value, ttl)


def test_a_value_evicted_before_its_waiters_read_it_is_compiled_again_at_once(redis_server):
    claimant = flight(EvictingStore(open_test_store(redis_server.url)), 0)
    waiter = flight(open_test_store(redis_server.url), 1)
    assert claimant.lookup("k", blocking=True).outcome == "claimed"
    thread, got = wait_in_thread(waiter, "k")
    assert claimant.publish("k", bytes(100_000))  # over the inline size: the waiter reads v/k
    thread.join(10)
    assert got["result"].outcome == "claimed" and got["took"] < 3, got  # not a third of the 30 s lease


# -- a store that fails is tried again ---------------------------------------------------

def test_a_store_that_comes_back_is_used_again(tmp_path, caplog):
    """The server dies: lookups return at once while the backoff runs (1 s, then 2 s), with
    no store call; it starts again on the same port: the next try after the backoff finds
    it, and the rank claims and publishes again."""
    server = RedisServer(tmp_path)
    calls: list = []
    f = flight(TimedStore(open_test_store(server.url), calls.append), 0)
    assert f.lookup("before", blocking=True).outcome == "claimed" and f.publish("before", b"v")
    server.kill()
    assert f.lookup("k", blocking=True).outcome == "unavailable"  # the failure starts a 1 s backoff
    n = len(calls)
    started = time.monotonic()
    assert f.lookup("k", blocking=True).outcome == "unavailable"
    assert len(calls) == n and time.monotonic() - started < 0.05  # at once, no store call
    time.sleep(1.1)
    assert f.lookup("k", blocking=True).outcome == "unavailable"  # tried, still down: 2 s more
    n = len(calls)
    time.sleep(1.0)
    assert f.lookup("k", blocking=True).outcome == "unavailable" and len(calls) == n
    server.start()
    time.sleep(1.1)
    with caplog.at_level(logging.INFO, "coordinator"):
        assert f.lookup("k", blocking=True).outcome == "claimed"
    assert "answers again" in caplog.text
    assert f.publish("k", b"after") and f.available
    assert flight(open_test_store(server.url), 1).lookup("k", blocking=True).value == b"after"
    server.kill()


# -- what claims leave in the store --------------------------------------------------------

def ttls(server: RedisServer) -> dict[str, int]:
    """Every key of the server and its time to live in ms (-1: none)."""
    raw = redis.Redis.from_url(server.url)
    return {key.decode().removeprefix("coordinator/"): raw.pttl(key) for key in raw.keys("*")}


def evicted_keys(server: RedisServer) -> int:
    """How many keys the server has evicted since it started (``INFO stats``)."""
    return redis.Redis.from_url(server.url).info("stats")["evicted_keys"]


def test_claims_heartbeats_and_signals_expire_with_the_lease(redis_server):
    """Every key of a claim lives a few leases past its claimant's last heartbeat; the
    liveness key half a lease; only values and their markers stay."""
    lease = 0.4
    f = flight(open_test_store(redis_server.url), 0, lease=lease)
    assert f.lookup("left", blocking=True).outcome == "claimed"
    assert f.lookup("done", blocking=True).outcome == "claimed"
    time.sleep(lease)  # a few beats
    assert f.publish("done", b"value")
    live = ttls(redis_server)
    kinds = {key.split("/")[0] for key in live}
    assert {"c", "h", "w", "j", "v", "d"} <= kinds, live
    for key, ttl in live.items():
        limit = {"c": 3, "h": 2, "w": 2, "a": 2, "j": 0.25}.get(key.split("/")[0])
        if limit is None:
            assert ttl == -1, (key, ttl)  # values and their markers live as the store keeps them
        else:
            assert 0 < ttl <= limit * lease * 1000, (key, ttl)
    f._claims.heartbeat.stop()  # the process dies: nothing beats any more
    time.sleep(3 * lease + 0.3)
    assert sorted(ttls(redis_server)) == ["d/done", "v/done"]


def test_an_old_claim_record_is_still_read():
    """Claims written before they named their job were a list."""
    old = msgpack.packb([3, "node7", 4242, 1.5])
    assert Owner.of_claim(old) == Owner(3, "node7", 4242, "")
    new = msgpack.packb({"rank": 3, "host": "node7", "pid": 4242, "t": 1.5, "job": "j1", "what": "a graph"})
    assert Owner.of_claim(new) == Owner(3, "node7", 4242, "j1")


# -- claims of a job that ended ------------------------------------------------------------

CLAIMANT = """
import json, sys, time
from datetime import timedelta
from coordinator.testing import open_test_store
from coordinator.protocol.singleflight import Owner, Singleflight

spec = json.loads(sys.argv[1])
f = Singleflight(open_test_store(spec["store"]), owner=Owner.this_process(9, spec["job"]),
                 lease=timedelta(seconds=spec["lease"]), wait_timeout=timedelta(seconds=60),
                 progress_interval=timedelta(seconds=30))
for key in spec["keys"]:
    assert f.lookup(key, blocking=True).outcome == "claimed"
print("claimed", flush=True)
if spec.get("exit"):
    f._claims.held.clear()  # leaves its claims unreleased, as a process whose store failed at exit
    f.close()
else:
    time.sleep(600)  # killed by the test
"""


def claimant(url: str, job: str, keys: list[str], lease: float, *, exit: bool = False) -> subprocess.Popen:
    spec = json.dumps({"store": url, "job": job, "keys": keys, "lease": lease, "exit": exit})
    proc = subprocess.Popen([sys.executable, "-c", CLAIMANT, spec], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def test_a_killed_job_s_claim_in_redis_is_taken_over_without_a_lease(redis_server, caplog):
    """Job A's process claims and is killed. Job B's waiter finds A's liveness key gone
    a quarter lease after A's last heartbeat and takes over, well before its lease."""
    lease = 8.0
    proc = claimant(redis_server.url, "job-a", ["k"], lease)
    proc.kill()
    proc.wait()
    killed = time.monotonic()
    b = flight(open_test_store(redis_server.url), 1, lease=lease)
    with caplog.at_level(logging.INFO, "coordinator"):
        result = b.lookup("k", blocking=True)
    took = time.monotonic() - killed
    assert result.outcome == "claimed"
    assert took < lease / 2, took  # a quarter lease of liveness and an eighth of looking, at most
    assert "belongs to job job-a, which has ended; taking over" in caplog.text
    assert "no heartbeat" not in caplog.text


def test_claims_a_job_left_at_a_normal_exit_are_taken_over_at_once(tmp_path):
    """A process of job A exits normally without releasing its claims (its store failed
    then): it deletes its job's liveness key, and job B takes them over at once."""
    url = f"file://{tmp_path / 'store'}"
    proc = claimant(url, "job-a", ["k1", "k2"], 30.0, exit=True)
    assert proc.wait(30) == 0
    b = flight(open_test_store(url), 1, lease=30.0)
    started = time.monotonic()
    for key in ("k1", "k2"):
        assert b.lookup(key, blocking=True).outcome == "claimed"
        assert b.publish(key, b"value")
    assert time.monotonic() - started < 2


def test_a_killed_job_costs_one_lease_in_all_on_a_directory_store(tmp_path, caplog):
    """The directory store keeps a killed job's liveness key: the first of its claims is
    judged by its lease; that also finds the job gone (its key did not move), so its other
    claims are taken over at once, in this process and in a process of a later job."""
    url = f"file://{tmp_path / 'store'}"
    lease = 2.0
    proc = claimant(url, "job-a", ["k1", "k2", "k3"], lease)
    proc.kill()
    proc.wait()
    b = flight(open_test_store(url), 1, lease=lease)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, "coordinator"):
        assert b.lookup("k1", blocking=True).outcome == "claimed"
    first = time.monotonic() - started
    assert lease <= first < 3 * lease, first
    assert b.publish("k1", b"value")
    started = time.monotonic()
    assert b.lookup("k2", blocking=True).outcome == "claimed"
    later = flight(open_test_store(url), 2, lease=lease, job="job-c")
    assert later.lookup("k3", blocking=True).outcome == "claimed"
    assert time.monotonic() - started < 1
    assert "job job-a holds claims but has beaten no heartbeat for a lease" in caplog.text


def test_an_abandoned_claim_of_a_running_job_means_compile_locally(redis_server):
    """Another job's claim is taken over only if that job has ended: an abandoned claim of a
    job that runs ends the wait as inside a job (the graph is compiled locally)."""
    a = flight(open_test_store(redis_server.url), 0, job="job-a")
    b = flight(open_test_store(redis_server.url), 1, job="job-b")
    assert a.lookup("k", blocking=True).outcome == "claimed"
    thread, got = wait_in_thread(b, "k")
    a.abandon("k")
    thread.join(10)
    assert got["result"].outcome == "abandoned"
    assert flight(open_test_store(redis_server.url), 2, job="job-c").lookup("k", blocking=True).outcome \
        == "abandoned"


# -- jobs of real rank processes -------------------------------------------------------------

WORLD = 3
#: Long enough that a wait for a compile on this machine's busy cores stays under half of it.
LEASE_S = 60.0


def longest_waits(trace_dir) -> dict[int, float]:
    """Each rank's longest wait (seconds), from the traces the ranks wrote."""
    longest: dict[int, float] = {}
    for path in trace_dir.glob("rank*.json"):
        rank = int(path.name[4:].split("-")[0])
        for line in path.read_text().splitlines():
            line = line.strip().rstrip(",")
            if not line.startswith("{"):
                continue
            event = json.loads(line)
            if event.get("name") == "wait":
                longest[rank] = max(longest.get(rank, 0.0), event.get("dur", 0) / 1e6)
    return longest


def run_traced(job, tmp_path, name: str, options: dict, env: dict | None = None, **kwargs):
    """A job of ``WORLD`` ranks with a lease of ``LEASE_S``, tracing each rank's waits."""
    trace = tmp_path / f"trace-{name}"
    results = job(kwargs.pop("world", WORLD), options, name=name,
                  env={"COORDINATOR_LEASE_S": str(LEASE_S), "COORDINATOR_TRACE": str(trace), **(env or {})},
                  **kwargs)
    return results, longest_waits(trace)


def assert_no_lease_long_wait(results, waits) -> None:
    """No rank waited for anything as long as half a lease, nor judged a lease lapsed."""
    assert all(seconds < LEASE_S / 2 for seconds in waits.values()), waits
    for r in results:
        assert "no heartbeat for" not in r.log and "past the" not in r.log, r.log[-3000:]


def assert_right_losses(results) -> None:
    for r in results:
        torch.testing.assert_close(r.report["losses"], r.report["ref_losses"], rtol=1e-4, atol=1e-5)


def said_store_failed(r) -> bool:
    return "coordinator store redis" in r.log and ("failed (" in r.log or "refuses writes" in r.log)


@pytest.mark.parametrize("policy", ["noeviction", "allkeys-lru"])
def test_a_full_redis_holds_no_rank_for_a_lease_in_this_job_or_the_next(job, tmp_path, policy):
    """A 2 MB Redis under a job whose values come to about 1.9 MB, and then a second job on
    the same server. Under noeviction the server refuses writes once full: a rank whose
    publish is refused releases its claim at once and then only reads the store; under
    allkeys-lru values and claims are evicted. Either way no rank waits a lease, and each
    rank whose store failed says so in its summary."""
    server = RedisServer(tmp_path / "redis", "--maxmemory", "2mb", "--maxmemory-policy", policy)
    try:
        options = {"store": server.url, "model": "broken", "steps": 2}
        for name in ("first", "second"):
            results, waits = run_traced(job, tmp_path, name, options)
            require_success(results)
            assert_right_losses(results)
            assert_no_lease_long_wait(results, waits)
            compiled = [r.fx_misses for r in results]
            print(f"{policy} {name} job: FX compiles per rank {compiled}, longest waits {waits}")
            for r in results:
                assert r.report["stats"]["store_failed"] == said_store_failed(r), r.log[-3000:]
                assert f"store redis 127.0.0.1:{server.port}/0" in r.log  # named once
                assert "redis redis://" not in r.log
            if policy == "noeviction" and name == "first":
                assert any("refuses writes" in r.log for r in results)
            if policy == "allkeys-lru":
                evicted = evicted_keys(server)
                print(f"allkeys-lru after the {name} job: {evicted} keys evicted")
                assert evicted > 0  # the first job already filled the server
        # What claims left behind expires: every key but values and their markers has a TTL.
        for key, ttl in ttls(server).items():
            assert ttl > 0 or key.split("/")[0] in ("v", "d", "n") or "#chunk/" in key, (key, ttl)
    finally:
        server.kill()


MANY_GRAPHS = """
import torch

gelu = torch.nn.functional.gelu
graph_break = torch._dynamo.graph_break


class Model(torch.nn.Module):
    \"\"\"Eight layers of different widths with a graph break after each (unrolled: Dynamo
    cannot resume a frame after a break inside a loop): 16 FX graphs.\"\"\"

    def __init__(self):
        super().__init__()
        widths = [16 + 8 * i for i in range(9)]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        l0, l1, l2, l3, l4, l5, l6, l7 = self.layers
        x = gelu(l0(x))
        graph_break()
        x = gelu(l1(x))
        graph_break()
        x = gelu(l2(x))
        graph_break()
        x = gelu(l3(x))
        graph_break()
        x = gelu(l4(x))
        graph_break()
        x = gelu(l5(x))
        graph_break()
        x = gelu(l6(x))
        graph_break()
        return gelu(l7(x))
"""


def test_after_a_short_outage_the_ranks_share_again(job, tmp_path):
    """The rank that runs the job's second compile kills the Redis server; it starts again,
    empty, on the same port 3 s later. The ranks compile locally meanwhile and share again
    after it: the job's FX compiles stay within 1.5x of one rank's, not 3x."""
    model = tmp_path / "many_graphs.py"
    model.write_text(MANY_GRAPHS)
    server = RedisServer(tmp_path / "redis")
    outage: dict = {}

    def restart_after_3s():
        while server.proc.poll() is None:
            time.sleep(0.02)
        outage["killed"] = time.monotonic()
        time.sleep(3.0)
        server.start()
        outage["back"] = time.monotonic()

    watcher = threading.Thread(target=restart_after_3s, daemon=True)
    watcher.start()
    try:
        results, waits = run_traced(job, tmp_path, "outage", {
            "store": server.url, "model_file": str(model), "steps": 1, "slow_compiles": 1.0,
            "first_compiler": f"kill_at:2:{server.proc.pid}"})
        require_success(results)
        assert "back" in outage, "the store was not killed"
        assert_right_losses(results)
        assert_no_lease_long_wait(results, waits)
        one_rank = 16  # the model's FX graphs: what one rank alone compiles
        compiled = sum(r.fx_misses for r in results)
        print(f"outage: FX compiles per rank {[r.fx_misses for r in results]}, {compiled} in all for "
              f"{one_rank} graphs ({compiled / one_rank:.2f}x one rank's); longest waits {waits}")
        assert all(r.report["stats"]["graphs_compiled"] + r.report["stats"]["graphs_received"] >= one_rank
                   for r in results)
        assert compiled <= 1.5 * one_rank, [r.fx_misses for r in results]
        failed = [r for r in results if r.report["stats"]["store_failed"]]
        assert failed and all(said_store_failed(r) == (r in failed) for r in results)
        for r in failed:
            assert "answers again" in r.log
            assert f"store redis 127.0.0.1:{server.port}/0, failed" in r.log  # the summary
    finally:
        server.kill()


def test_a_claim_left_by_a_killed_process_of_another_job_holds_no_rank_for_a_lease(job, tmp_path):
    """Job A's only rank dies in its first compile, holding the claim. Job B, right after,
    finds that claim: A's liveness key is gone within a quarter lease of its death, so B's
    ranks take the claim over instead of waiting out its lease."""
    server = RedisServer(tmp_path / "redis")
    try:
        dead, _ = run_traced(job, tmp_path, "a", {"store": server.url, "first_compiler": "die"}, world=1)
        assert dead[0].returncode == 17
        assert [key for key in ttls(server) if key.startswith("c/")], "job A left no claim"
        # The same pass (its marker taken, it kills nothing more): the same FX keys.
        results, waits = run_traced(job, tmp_path, "b", {"store": server.url, "first_compiler": "die"})
        require_success(results)
        assert_right_losses(results)
        assert_no_lease_long_wait(results, waits)
        print(f"job B after a killed job A: longest waits {waits}")
        assert any("which has ended; taking over" in r.log for r in results)
    finally:
        server.kill()


def enospc_lines(log: str) -> list[str]:
    return [line for line in log.splitlines()
            if "No space left" in line or "ENOSPC" in line or "Errno 28" in line or "no room" in line]


def test_a_full_node_local_file_system_runs_the_job_as_without_the_coordinator(job, tmp_path):
    """The node's Inductor cache dir (one for the 3 ranks) on a 4.5 MB file system, which a
    job without the coordinator fits in (it used 3.8 MB at most where measured) and the
    node-local copies would overfill (5.3 MB). The copies stop (one line per rank, their
    space freed), and the job ends with the losses of the job without the coordinator and no
    other ENOSPC warning."""
    with small_file_system(tmp_path / "node-fs", "4608k") as fs:
        def on_the_node(name):
            return {rank: fs / name for rank in range(WORLD)}

        stock = job(WORLD, {"model": "broken", "coordinator": False}, cache_dirs=on_the_node("stock"))
        require_success(stock)
        assert not any(enospc_lines(r.log) for r in stock)
        used = int(subprocess.check_output(["du", "-sb", str(fs / "stock")]).split()[0])
        subprocess.run(["rm", "-rf", str(fs / "stock")], check=True)
        ours = job(WORLD, {"model": "broken"}, cache_dirs=on_the_node("ours"))
        require_success(ours)
        lines = {r.rank: enospc_lines(r.log) for r in ours}
        print(f"full file system: stock used {used} bytes; the coordinator's job said {lines}")
        assert any(lines.values()), "the copies never filled the file system"
        for r in ours:
            assert len(lines[r.rank]) <= 1 and all("no room for node-local copies" in line for line in lines[r.rank])
            assert r.report["losses"] == stock[r.rank].report["losses"]
