"""The claim / wait / publish protocol on real stores, with threads and killed processes."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import msgpack
import pytest
from conftest import WaitSeen

from coordinator.features.tuning_steps import TuningSteps
from coordinator.protocol.claims import claim_record
from coordinator.protocol.singleflight import Owner, Singleflight

pytestmark = pytest.mark.protocol


def flight(store, rank, *, lease=1.0, wait_timeout=30.0):
    return Singleflight(
        store,
        owner=Owner.this_process(rank),
        lease=timedelta(seconds=lease),
        wait_timeout=timedelta(seconds=wait_timeout),
        progress_interval=timedelta(seconds=0.5),
    )


@pytest.fixture(params=["c10d", "file"])
def store(request, tmp_path):
    from coordinator import open_store

    if request.param == "c10d":
        return open_store(request.getfixturevalue("tcp_store"))
    return open_store(f"file://{tmp_path}")


def test_claim_wait_publish(store):
    leader, follower = flight(store, 0), flight(WaitSeen(store), 1)
    assert leader.lookup("k", blocking=True).outcome == "claimed"
    result = {}
    t = threading.Thread(target=lambda: result.update(r=follower.lookup("k", blocking=True)))
    t.start()
    assert follower.store.waiting.wait(10)
    time.sleep(0.3)
    assert t.is_alive()  # waiting on the store
    leader.publish("k", b"value")
    t.join(5)
    assert result["r"].value == b"value" and result["r"].outcome == "waited"
    # It waited for the publish: waited_s counts from the lookup's start, before the 0.3 s.
    assert 0.3 <= result["r"].waited_s < 5
    assert flight(store, 2).lookup("k", blocking=True).outcome == "hit"
    leader.close()


def waiting_lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.getMessage().startswith("waiting on ")]


def test_a_waiter_names_the_claimant_and_what_it_computes_less_and_less_often(store, caplog):
    """The claim's record carries what its claimant computes; the waiter's lines name the
    claimant and that, and come after P, 3P, 6P, 12P... of waiting (P: progress_interval)."""
    what = "backward graph 1 of 'GPT.forward' (compile 0/0)"
    leader = flight(store, 0, lease=0.4)  # a heartbeat every 0.1 s wakes the waiter
    follower = Singleflight(store, owner=Owner.this_process(1), lease=timedelta(seconds=0.4),
                            wait_timeout=timedelta(seconds=30), progress_interval=timedelta(seconds=0.2))
    assert leader.lookup("k", blocking=True, what=what).outcome == "claimed"
    record = claim_record(store.get("c/k/0"))
    assert record["what"] == what and (record["rank"], record["pid"]) == (0, os.getpid()) and record["t"] > 0
    threading.Timer(3.0, leader.publish, args=("k", b"value")).start()
    with caplog.at_level(logging.INFO, logger="coordinator"):
        result = follower.lookup("k", blocking=True)
    assert result.outcome == "waited"
    owner = f"rank 0 on {socket.gethostname()} (pid {os.getpid()})"
    pattern = re.compile(rf"waiting on {re.escape(owner)} for {re.escape(what)} \(k\): ([\d.]+)s so far, "
                         r"last heartbeat [\d.]+s ago")
    lines = waiting_lines(caplog)
    assert all(pattern.fullmatch(line) for line in lines), lines
    waited = [float(pattern.fullmatch(line).group(1)) for line in lines]
    due = [0.2, 0.6] + [1.2 * k for k in range(1, 100)]
    assert len(waited) >= 3, lines  # it waited more than 1.2 s
    assert all(w >= d for w, d in zip(waited, due, strict=False)), waited  # none before its time
    assert len(waited) <= sum(d <= result.waited_s for d in due), (waited, result.waited_s)
    leader.close()


def test_a_claim_in_the_list_form_of_earlier_versions_is_read(store, caplog):
    """A claimant of an earlier version wrote ``[rank, host, pid, t]``: its waiters still
    name it, and say its key for what it computes."""
    assert store.add_if_absent("c/k/0", msgpack.packb([5, "old-host", 99, time.time()]))
    store.set("h/k/0", msgpack.packb([0, time.time()]))
    assert Owner.of_claim(store.get("c/k/0")) == Owner(5, "old-host", 99)
    follower = flight(store, 1, lease=30.0, wait_timeout=1.0)
    with caplog.at_level(logging.INFO, logger="coordinator"):
        assert follower.lookup("k", blocking=True).outcome == "deadline"
    assert "on rank 5 on old-host (pid 99) for its key (k), past the 1s deadline; compiling locally" in caplog.text


def test_a_mark_is_first_once(store):
    # Every caller sets the same mark: one of them, and only one, is first.
    flights = [flight(store, rank) for rank in range(3)]
    assert [f.first_to_mark("k", "persisted-job") for f in flights] == [True, False, False]
    assert flights[1].first_to_mark("k", "another") is True
    for f in flights:
        f.close()


def test_abandoned_claim_releases_waiters(store):
    leader, follower = flight(store, 0), flight(store, 1)
    leader.lookup("k", blocking=True)
    threading.Timer(0.3, leader.abandon_all).start()
    r = follower.lookup("k", blocking=True)
    assert (r.value, r.outcome) == (None, "abandoned")
    leader.close()


def test_offer_claims_a_missing_key_or_waits_for_its_holder(store):
    """offer(): for a value this process already has (a local cache hit)."""
    warm, cold = flight(store, 0), flight(store, 1)
    # Nobody has it: the offering rank claims it and publishes its copy; a cold rank gets it.
    assert warm.offer("a").outcome == "claimed"
    warm.publish("a", b"local copy")
    assert cold.lookup("a", blocking=True).value == b"local copy"
    assert flight(store, 2).offer("a").outcome == "hit"  # published: nothing to do
    # A cold rank is computing it: the offering rank waits until it is published...
    assert cold.lookup("b", blocking=True).outcome == "claimed"
    threading.Timer(0.4, cold.publish, args=("b", b"from the cold rank")).start()
    r = warm.offer("b")
    assert (r.value, r.outcome) == (None, "waited") and r.waited_s >= 0.3
    # ... or until it gives up.
    assert cold.lookup("c", blocking=True).outcome == "claimed"
    threading.Timer(0.3, cold.abandon, args=("c",)).start()
    assert warm.offer("c").outcome == "abandoned"
    warm.close()
    cold.close()


def test_a_rejected_value_is_claimed_again_by_one_process_while_the_others_wait(store):
    """A value its readers refuse counts as missing: one claims the key again and compiles,
    the others wait for its value instead of each compiling one."""
    bad = b"corrupt"
    store.set("v/k", bad)
    first, second, third = flight(store, 0), flight(store, 1), flight(store, 2)
    assert first.lookup("k", blocking=True).value == bad  # what every reader finds, and refuses
    assert first.lookup("k", blocking=True, rejected=bad).outcome == "claimed"
    results = {}
    waiters = [threading.Thread(target=lambda f=f: results.update({f.owner.rank: f.lookup("k", blocking=True,
                                                                                         rejected=bad)}))
               for f in (second, third)]
    for t in waiters:
        t.start()
    time.sleep(0.4)
    assert all(t.is_alive() for t in waiters)  # waiting on the claimant, not compiling
    assert first.publish("k", b"good")
    for t in waiters:
        t.join(5)
    assert {rank: (r.value, r.outcome) for rank, r in results.items()} == {1: (b"good", "waited"),
                                                                            2: (b"good", "waited")}
    # The good value replaced the bad one; a later reader of the old bad value gets it at once.
    assert flight(store, 3).lookup("k", blocking=True, rejected=bad).value == b"good"
    # Another bad value later meets a claim of its own (no signal of the ended one is reused).
    store.set("v/k", b"corrupt again")
    assert second.lookup("k", blocking=True, rejected=b"corrupt again").outcome == "claimed"
    for f in (first, second, third):
        f.close()


@pytest.fixture
def sessions(tmp_path, monkeypatch):
    """Ranks' sessions over one directory store, each on a node (cache dir) of its own."""
    from coordinator import Config
    from coordinator.session import Session

    made = []

    def make(rank: int) -> Session:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / f"node{rank}"))
        session = Session(Config(store=f"file://{tmp_path / 'store'}", lease=timedelta(seconds=30)))
        session.flight()  # opened now, on this rank's node
        made.append(session)
        return session

    yield make
    for session in made:
        session.close()


def test_autotune_keys_are_claimed_only_inside_a_tuning_step(sessions):
    """A kernel's best config is saved at its first launch. Looked up at a graph's load it is
    only read: a claim there would last until the kernel first runs, maybe after a collective.
    Inside the kernel's tuning step a miss claims it, and another rank's step waits for it."""
    leader, follower = sessions(0), sessions(1)
    assert leader.get("autotune", "kernel") is None  # at load: a read
    assert not leader.flight().holds_claims()

    got = {}
    with leader.feature(TuningSteps).step():
        assert leader.get("autotune", "kernel") is None  # claimed: this rank tunes it
        assert leader.flight().holds_claims()

        def follower_step():
            with follower.feature(TuningSteps).step():
                got["value"] = follower.get("autotune", "kernel")

        waiter = threading.Thread(target=follower_step)
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive()  # waits while the leader tunes
        leader.put("autotune", "kernel", b'{"XBLOCK": 64, "time_taken_ms": 3}')
    waiter.join(10)
    assert got["value"] == b'{"XBLOCK": 64, "time_taken_ms": 3}'
    assert not leader.flight().holds_claims() and not follower.flight().holds_claims()


def test_a_tuning_step_that_saves_nothing_releases_its_waiters(sessions):
    """A kernel that declines to tune saves nothing: its step's claim ends with the step,
    and a rank waiting for it tunes the kernel itself, long before the 30 s lease."""
    leader, follower = sessions(0), sessions(1)
    got = {}

    def follower_step():
        with follower.feature(TuningSteps).step():
            got["value"] = follower.get("autotune", "declined")

    with leader.feature(TuningSteps).step():
        assert leader.get("autotune", "declined") is None
        waiter = threading.Thread(target=follower_step)
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive()
        started = time.monotonic()
    waiter.join(10)
    assert got == {"value": None} and time.monotonic() - started < 5
    assert not leader.flight().holds_claims()


def test_a_rank_that_tuned_kernels_still_waits_for_graphs(sessions):
    """A recompile after kernels tuned at their first launch: the rank holds no claim, so
    it waits for the graph another rank compiles instead of compiling it again."""
    a, b = sessions(0), sessions(1)
    with a.feature(TuningSteps).step():
        assert a.get("autotune", "kernel") is None
        a.put("autotune", "kernel", b'{"XBLOCK": 64}')
    assert b.get("fx_graph", "recompiled") is None  # b compiles it
    threading.Timer(0.5, b.put, ("fx_graph", "recompiled", b'{"data": "graph"}')).start()
    assert a.get("fx_graph", "recompiled") == b'{"data": "graph"}'  # a waited for it
    assert a.stats.as_dict()["graphs_compiled"] == 0


def test_nonblocking_lookup_never_waits_or_claims(store):
    leader = flight(store, 0)
    leader.lookup("k", blocking=True)
    start = time.monotonic()
    assert flight(store, 1).lookup("k", blocking=False).outcome == "nonblocking"
    assert flight(store, 1).lookup("other", blocking=False).outcome == "nonblocking"
    assert time.monotonic() - start < 1
    # Nobody claimed "other": a blocking asker gets it.
    assert flight(store, 2).lookup("other", blocking=True).outcome == "claimed"
    leader.close()


def test_claim_holder_does_not_wait(store):
    a, b = flight(store, 0), flight(store, 1)
    assert a.lookup("x", blocking=True).outcome == "claimed"
    assert b.lookup("y", blocking=True).outcome == "claimed"
    # a holds x and asks for y (held by b): waiting could deadlock, so it compiles.
    start = time.monotonic()
    assert a.lookup("y", blocking=True).outcome == "nonblocking"
    assert time.monotonic() - start < 1
    a.close()
    b.close()


def test_heartbeat_keeps_a_long_claim(store):
    # Leases long enough that a loaded 2-core CI machine cannot starve the heartbeat thread.
    leader, follower = flight(store, 0, lease=1.0), flight(store, 1, lease=1.0)
    leader.lookup("k", blocking=True)
    threading.Timer(4.0, leader.publish, args=("k", b"v")).start()  # 4 leases
    r = follower.lookup("k", blocking=True)
    assert (r.value, r.outcome) == (b"v", "waited")


def test_deadline_ends_the_wait(store):
    leader = flight(store, 0)
    leader.lookup("k", blocking=True)
    r = flight(store, 1, wait_timeout=0.5).lookup("k", blocking=True)
    assert (r.value, r.outcome) == (None, "deadline")
    leader.close()


def test_killed_owner_is_taken_over_once(tmp_path):
    """A process claims and is SIGKILLed; of 3 waiters exactly one takes over."""
    from coordinator import open_store

    url = f"file://{tmp_path}"
    code = (
        "import time, sys; from datetime import timedelta; from coordinator import open_store;"
        "from coordinator.protocol.singleflight import Singleflight, Owner;"
        f"f = Singleflight(open_store({url!r}), owner=Owner.this_process(9), lease=timedelta(seconds=1),"
        " wait_timeout=timedelta(seconds=30), progress_interval=timedelta(seconds=1));"
        "assert f.lookup('k', blocking=True).outcome == 'claimed'; print('claimed', flush=True); time.sleep(600)"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert owner.stdout.readline().strip() == "claimed"
    store = open_store(url)
    results = []

    seen = [WaitSeen(store) for _ in range(3)]

    def wait(rank):
        f = flight(seen[rank], rank)
        r = f.lookup("k", blocking=True)
        results.append(r.outcome)
        if r.outcome == "claimed":
            time.sleep(0.5)
            f.publish("k", b"from the new owner")

    threads = [threading.Thread(target=wait, args=(rank,)) for rank in range(3)]
    for t in threads:
        t.start()
    for s in seen:  # each waits on the owner's claim before the owner dies
        assert s.waiting.wait(20)
    owner.kill()
    owner.wait()
    for t in threads:
        t.join(20)
    assert sorted(results) == ["claimed", "waited", "waited"]
    assert store.get("c/k/1") is None  # the new owner published and cleaned its claim


def test_stale_claim_from_a_dead_job_is_taken_over(tmp_path):
    from coordinator import open_store

    store = open_store(f"file://{tmp_path}")
    old = flight(store, 0)
    old.lookup("k", blocking=True)
    old._claims.heartbeat.stop()  # the old job vanished without cleaning up
    old._claims.held.clear()
    start = time.monotonic()
    r = flight(store, 1, lease=0.5).lookup("k", blocking=True)
    assert r.outcome == "claimed"
    assert 0.5 <= time.monotonic() - start < 5


def test_store_failure_means_compile_locally(redis_server):
    from coordinator.protocol.stores.bounds import CallBounds
    from coordinator.protocol.stores.redis import RedisStore

    second = timedelta(seconds=1)
    f = flight(RedisStore(redis_server.url, bounds=CallBounds(connect=second, answer=second, tries=1)), 0)
    assert f.lookup("k", blocking=True).outcome == "claimed"
    redis_server.kill()
    assert f.publish("k", b"v") is False
    assert f.lookup("k2", blocking=True).outcome == "unavailable"
    assert not f.available


def test_node_lock_is_exclusive_and_bounded(tmp_path):
    from coordinator.errors import WaitTimeout
    from coordinator.protocol.node import NodeCache

    a, b = NodeCache(str(tmp_path)), NodeCache(str(tmp_path))
    got = []
    held, release = threading.Event(), threading.Event()

    def hold():
        with a.lock("k", 5):
            got.append("a")
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    start = time.monotonic()
    with pytest.raises(WaitTimeout):
        with b.lock("k", 0):  # a claim holder only tries
            pass
    assert time.monotonic() - start < 0.2
    threading.Timer(0.3, release.set).start()
    with b.lock("k", 5):  # others wait until it is free
        got.append("b")
    t.join()
    assert got == ["a", "b"]
    a.write("k", b"v")
    assert b.read("k") == b"v" and b.read("other") is None
