"""Waits that block on the store (c10d ``wait``, Redis publish/subscribe; the directory store
polls): each of the four ways a wait ends, on each store, with the claimant in another process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from coordinator.singleflight import Owner, Singleflight
from coordinator.stores.base import TimedStore

CLAIMANT = f"""
import sys, time, json
from datetime import timedelta
sys.path.insert(0, {str(Path(__file__).parent)!r})
from split_tuning_proc import open_test_store
from coordinator.singleflight import Owner, Singleflight
spec = json.loads(sys.argv[1])
f = Singleflight(open_test_store(spec["store"]), owner=Owner.this_process(9), lease=timedelta(seconds=spec["lease"]),
                 wait_timeout=timedelta(seconds=30), progress_interval=timedelta(seconds=30), signalled_waits=True)
assert f.lookup("k", blocking=True).outcome == "claimed"
print("claimed", flush=True)
time.sleep(spec["hold"])
if spec["end"] == "publish":
    f.publish("k", b"value")
elif spec["end"] == "abandon":
    f.abandon("k")
else:
    time.sleep(600)  # killed by the test
print("done", flush=True)
time.sleep(0.5)
"""


@pytest.fixture(params=["c10d", "redis", "file"])
def store_spec(request, tmp_path):
    if request.param == "c10d":
        return request.param, f"tcp://127.0.0.1:{request.getfixturevalue('tcp_store').port}"
    if request.param == "redis":
        return request.param, request.getfixturevalue("redis_server").url
    return request.param, f"file://{tmp_path}"


def claimant(store: str, end: str, hold: float, lease: float = 1.0) -> subprocess.Popen:
    spec = json.dumps({"store": store, "end": end, "hold": hold, "lease": lease})
    proc = subprocess.Popen([sys.executable, "-c", CLAIMANT, spec], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def waiter(url: str, calls: list, *, lease: float = 1.0, wait_timeout: float = 30.0) -> Singleflight:
    sys.path.insert(0, str(Path(__file__).parent))
    from split_tuning_proc import open_test_store

    store = TimedStore(open_test_store(url), lambda seconds: calls.append(seconds))
    return Singleflight(store, owner=Owner.this_process(1), lease=timedelta(seconds=lease),
                        wait_timeout=timedelta(seconds=wait_timeout), progress_interval=timedelta(seconds=30),
                        signalled_waits=True)


def test_a_signalled_wait_ends_when_the_value_is_published(store_spec):
    kind, url = store_spec
    proc = claimant(url, "publish", hold=2.0, lease=1.0)
    calls: list = []
    f = waiter(url, calls, lease=1.0)
    with f.store.watch("w/k/0") as watch:
        assert watch.blocking == (kind != "file")
    started = time.monotonic()
    result = f.lookup("k", blocking=True)
    assert (result.value, result.outcome) == (b"value", "waited")
    assert 1.5 < time.monotonic() - started < 5
    if kind != "file":
        # Heartbeats every 0.25 s for about 2 s: a blocking wait costs two or three calls
        # per heartbeat; polling costs three reads per poll (10 to 200 ms apart).
        assert len(calls) <= 3 * 9 + 8, len(calls)
    assert proc.wait(10) == 0


def test_a_signalled_wait_ends_when_the_claim_is_abandoned(store_spec):
    _, url = store_spec
    proc = claimant(url, "abandon", hold=1.0)
    started = time.monotonic()
    result = waiter(url, []).lookup("k", blocking=True)
    assert result.outcome == "abandoned" and time.monotonic() - started < 4
    assert proc.wait(10) == 0


def test_a_signalled_wait_takes_over_when_the_claimant_dies(store_spec):
    _, url = store_spec
    proc = claimant(url, "hang", hold=0.0, lease=1.0)
    f = waiter(url, [], lease=1.0)
    time.sleep(0.3)
    killed = time.monotonic()
    proc.kill()
    proc.wait()
    result = f.lookup("k", blocking=True)
    taken_over = time.monotonic() - killed
    assert result.outcome == "claimed"  # the next generation is ours
    assert 0.7 < taken_over < 4, taken_over
    f.abandon("k")


def test_a_signalled_wait_ends_at_its_deadline(store_spec):
    _, url = store_spec
    proc = claimant(url, "hang", hold=0.0, lease=5.0)
    try:
        started = time.monotonic()
        result = waiter(url, [], lease=5.0, wait_timeout=1.5).lookup("k", blocking=True)
        assert result.outcome == "deadline"
        assert 1.4 < time.monotonic() - started < 3.5
    finally:
        proc.kill()
        proc.wait()


def test_waiters_of_a_dead_claimant_follow_the_first_to_take_over(store_spec):
    """The taker signals "moved" on the dead claim: a waiter with a long lease follows it
    at once instead of waiting out its own lease."""
    _, url = store_spec
    proc = claimant(url, "hang", hold=0.0, lease=1.0)
    patient = waiter(url, [], lease=30.0)
    results: dict = {}
    thread = threading.Thread(target=lambda: results.setdefault("patient", patient.lookup("k", blocking=True)))
    thread.start()
    time.sleep(0.3)
    proc.kill()
    proc.wait()
    killed = time.monotonic()
    taker = waiter(url, [], lease=1.0)
    assert taker.lookup("k", blocking=True).outcome == "claimed"
    time.sleep(0.5)
    assert taker.publish("k", b"value")
    thread.join(10)
    assert not thread.is_alive()
    assert (results["patient"].value, results["patient"].outcome) == (b"value", "waited")
    assert time.monotonic() - killed < 6  # not the patient waiter's own 30 s lease
