"""Waits that block on the store (c10d ``wait``, Redis publish/subscribe; the directory store
polls): each of the four ways a wait ends, on each store, with the claimant in another process
of the same job (``JOB``: a lapsed lease is judged by the heartbeat alone)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from conftest import WaitSeen

from coordinator.protocol.singleflight import Owner, Singleflight
from coordinator.protocol.stores.base import TimedStore
from coordinator.testing import open_test_store

pytestmark = pytest.mark.protocol

#: The job of the claimants and the waiters here.
JOB = "signalled-waits-test"

CLAIMANT = """
import sys, time, json
from datetime import timedelta
from coordinator.testing import open_test_store
from coordinator.protocol.singleflight import Owner, Singleflight

spec = json.loads(sys.argv[1])
f = Singleflight(open_test_store(spec["store"]), owner=Owner.this_process(9, spec["job"]),
                 lease=timedelta(seconds=spec["lease"]),
                 wait_timeout=timedelta(seconds=30), progress_interval=timedelta(seconds=30), signalled_waits=True)
assert f.lookup("k", blocking=True).outcome == "claimed"
print("claimed", flush=True)
time.sleep(spec["hold"])
if spec["end"] == "publish":
    f.publish("k", b"x" * spec["value_size"] if spec.get("value_size") else b"value")
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


def claimant(store: str, end: str, hold: float, lease: float = 1.0, value_size: int = 0) -> subprocess.Popen:
    spec = json.dumps({"store": store, "end": end, "hold": hold, "lease": lease, "value_size": value_size,
                       "job": JOB})
    proc = subprocess.Popen([sys.executable, "-c", CLAIMANT, spec], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def waiter(url: str, calls: list, *, lease: float = 1.0, wait_timeout: float = 30.0) -> Singleflight:

    store = WaitSeen(open_test_store(url), lambda seconds: calls.append(seconds))
    return Singleflight(store, owner=Owner.this_process(1, JOB), lease=timedelta(seconds=lease),
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
    assert patient.store.waiting.wait(10)  # on the claim that dies
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


class CallLog(TimedStore):
    """Names every store call, and the wake-ups of watches, in order."""

    def __init__(self, inner, names: list) -> None:
        super().__init__(inner, lambda seconds: None)
        self.names = names
        for name in ("get", "set", "add_if_absent", "delete", "signal"):
            method = getattr(inner, name)
            setattr(self, name, lambda *a, _m=method, _n=name, **k: (names.append(_n), _m(*a, **k))[1])

    @contextlib.contextmanager
    def watch(self, prefix):
        names = self.names

        class Logged:
            def __init__(self, watch):
                self.inner, self.blocking = watch, watch.blocking

            def wait(self, key, timeout_s):
                value = self.inner.wait(key, timeout_s)
                names.append("wake" if value is not None else "timeout")
                return value

        with self.inner.watch(prefix) as watch:
            yield Logged(watch)


@pytest.mark.parametrize("size", [100, 200_000])
def test_the_end_signal_carries_a_small_value(store_spec, size):
    """A value up to INLINE_VALUE_BYTES comes with the wake-up: the waiter makes no store call
    after it. A larger one is read from the store right after the wake-up, once."""
    from coordinator.protocol.singleflight import INLINE_VALUE_BYTES

    assert 100 <= INLINE_VALUE_BYTES < 200_000
    kind, url = store_spec
    proc = claimant(url, "publish", hold=1.0, lease=30.0, value_size=size)

    names: list = []
    f = Singleflight(CallLog(open_test_store(url), names), owner=Owner.this_process(1, JOB),
                     lease=timedelta(seconds=30), wait_timeout=timedelta(seconds=30),
                     progress_interval=timedelta(seconds=30), signalled_waits=True)
    result = f.lookup("k", blocking=True)
    assert (result.value, result.outcome) == (b"x" * size, "waited")
    assert proc.wait(10) == 0
    if kind == "file":  # polls: the value is read like any key
        return
    after_wake = names[names.index("wake") + 1:]
    assert after_wake == ([] if size == 100 else ["get"]), names
