"""Split autotuning's item protocol, with real processes on real stores and fake benchmarks.

A selecting process opens a selection of work items; helper processes (ranks that wait)
take items between polls. The benchmarks are :class:`split_tuning_proc.FakeRequest`:
they sleep and return a fixed time, and log which process ran which item.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest

PROC = Path(__file__).with_name("split_tuning_proc.py")


@pytest.fixture(params=["c10d", "redis"])
def store_url(request):
    if request.param == "c10d":
        store = request.getfixturevalue("tcp_store")
        return f"tcp://127.0.0.1:{store.port}"
    return request.getfixturevalue("redis_server").url


class Procs:
    def __init__(self, tmp_path: Path, store: str) -> None:
        self.tmp, self.store = tmp_path, store
        self.log = tmp_path / "runs.log"
        self.log.touch()
        self.stop = tmp_path / "stop"
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, role: str, rank: int, **spec) -> subprocess.Popen:
        out = self.tmp / f"{role}-{rank}-{len(self.procs)}.json"
        spec = {"role": role, "rank": rank, "store": self.store, "log": str(self.log), "out": str(out),
                "stop_file": str(self.stop), **spec}
        proc = subprocess.Popen([sys.executable, str(PROC), json.dumps(spec)], stdout=subprocess.PIPE, text=True)
        self.procs.append((proc, out))
        if role == "help":
            line = proc.stdout.readline().split()
            assert line[0] == "helping"
            proc.helper_pid = int(line[1])
        return proc

    def result(self, proc: subprocess.Popen, timeout: float = 60) -> dict:
        assert proc.wait(timeout) == 0, f"process exited with {proc.returncode}"
        out = dict(self.procs)[proc]
        return json.loads(out.read_text())

    def runs(self) -> Counter:
        """(pid, item) -> times run."""
        return Counter(tuple(map(int, line.split())) for line in self.log.read_text().splitlines())

    def close(self) -> None:
        self.stop.touch()
        for proc, _ in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def procs(tmp_path, store_url):
    p = Procs(tmp_path, store_url)
    yield p
    p.close()


ITEMS = [[float(10 + i), 0.2, 0.05] for i in range(8)]  # ms, compile s, run s


def test_waiting_ranks_take_items_and_every_rank_gets_the_same_timings(procs):
    helpers = [procs.start("help", rank) for rank in (1, 2)]
    selector = procs.start("select", 0, selection="s1", items=ITEMS)
    first = procs.result(selector)
    assert first["timings"] == [ms for ms, _, _ in ITEMS]
    runs = procs.runs()
    assert all(n == 1 for n in runs.values()), runs  # each item ran once
    assert sorted(index for _, index in runs) == list(range(8))
    by_helpers = sum(1 for pid, _ in runs if pid in {h.helper_pid for h in helpers})
    assert by_helpers >= 2 and first["counts"]["items_received"] == by_helpers
    assert first["counts"]["items_run_here"] == 8 - by_helpers
    assert first["counts"]["backups"] == 0

    # A rank that selects among the same choices later reuses the merged timings.
    again = procs.result(procs.start("select", 3, selection="s1", items=[[99.0, 5, 5]] * 8))
    assert again["timings"] == first["timings"]
    assert again["counts"]["selections_reused"] == 1 and again["counts"]["items_run_here"] == 0
    procs.close()
    helped = [procs.result(h)["counts"]["items_run_for_others"] for h in helpers]
    assert sum(helped) == by_helpers


def test_timings_from_another_gpu_are_calibrated_and_the_merge_is_the_same_everywhere(procs):
    """Two ranks select at once (one reference time 1.0), one helper whose GPU is twice
    as slow (reference 2.0): items the helper ran count half; both selectors get one list."""
    helper = procs.start("help", 2, reference=2.0)
    go = procs.tmp / "go"
    selectors = [procs.start("select", rank, selection="s2", items=ITEMS, reference=1.0,
                             start_after_file=str(go)) for rank in (0, 1)]
    go.touch()
    results = [procs.result(s) for s in selectors]
    assert results[0]["timings"] == results[1]["timings"]
    runs = procs.runs()
    assert all(n == 1 for n in runs.values()), runs
    helper_items = {index for pid, index in runs if pid == helper.helper_pid}
    assert helper_items, "the helper ran nothing"
    for index, ms in enumerate(results[0]["timings"]):
        assert ms == ITEMS[index][0] / (2.0 if index in helper_items else 1.0)


def test_a_helper_that_dies_holding_an_item_is_backed_up(procs):
    helper = procs.start("help", 1)
    selector = procs.start("select", 0, selection="s3", items=ITEMS, backup_after=1.0, hang_in=helper.helper_pid)
    # The helper claims an item and hangs in its benchmark; kill it there.
    deadline = time.monotonic() + 20
    while not any(pid == helper.helper_pid for pid, _ in procs.runs()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    helper.kill()
    result = procs.result(selector)
    assert result["timings"] == [ms for ms, _, _ in ITEMS]
    assert result["counts"]["backups"] == 1


def test_a_selecting_rank_never_waits_for_a_slow_helper(procs):
    """With the default backup delay (0), an item a helper holds is run by the selecting
    rank as soon as it has nothing else to claim: the helper's slowness costs nothing."""
    helper = procs.start("help", 1)
    slow_helper_items = [[float(10 + i), 0.0, 0.05] for i in range(4)]
    selector = procs.start("select", 0, selection="s8", items=slow_helper_items, backup_after=0,
                           hang_in=helper.helper_pid)
    result = procs.result(selector)
    assert result["timings"] == [ms for ms, _, _ in slow_helper_items]
    assert result["counts"]["backups"] >= 1 and result["counts"]["items_run_here"] == 4
    assert result["select_s"] < 4 * 0.05 + 2.0  # the hung helper held nothing up
    assert any(pid == helper.helper_pid for pid, _ in procs.runs())


def test_a_failed_item_on_a_helper_is_run_by_the_selector(procs):
    helper = procs.start("help", 1)
    result = procs.result(procs.start("select", 0, selection="s4", items=ITEMS, fail_in=helper.helper_pid))
    assert result["timings"] == [ms for ms, _, _ in ITEMS]
    failed = {index for pid, index in procs.runs() if pid == helper.helper_pid}
    assert failed and result["counts"]["items_received"] == 0
    assert result["counts"]["items_run_here"] == 8


def test_a_new_selector_reuses_the_items_a_dead_one_finished(procs):
    """The selecting rank dies after three items (a takeover then lowers the same graph):
    the next selector runs only what is missing, the dead rank's claimed item after the
    backup delay."""
    dead = procs.start("select", 0, selection="s5", items=ITEMS, die_after=4, travel=False)
    assert dead.wait(30) == 9
    before = procs.runs()
    assert len(before) == 4
    result = procs.result(procs.start("select", 1, selection="s5", items=ITEMS, backup_after=0.5, travel=False))
    assert result["timings"] == [ms for ms, _, _ in ITEMS]
    assert result["counts"]["items_run_here"] == 5  # items 3..7; item 3 as a backup
    assert result["counts"]["backups"] == 1


def test_a_wrong_secret_is_refused_and_costs_nothing(procs):
    helper = procs.start("help", 1, secret="other")
    result = procs.result(procs.start("select", 0, selection="s6", items=ITEMS, secret="right"))
    assert result["timings"] == [ms for ms, _, _ in ITEMS]
    assert not any(pid == helper.helper_pid for pid, _ in procs.runs())
    assert result["counts"]["items_run_here"] == 8


def test_a_store_that_dies_mid_selection_leaves_the_selector_timing_alone(tmp_path, redis_server):
    procs = Procs(tmp_path, redis_server.url)
    try:
        slow = [[float(10 + i), 0.0, 0.3] for i in range(8)]
        selector = procs.start("select", 0, selection="s7", items=slow, travel=False)
        deadline = time.monotonic() + 20
        while len(procs.runs()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        redis_server.kill()
        result = procs.result(selector)
        assert result["timings"] == [ms for ms, _, _ in slow]
        assert sum(procs.runs().values()) == 8
    finally:
        procs.close()


def test_a_rank_waiting_on_a_key_helps_between_polls(tcp_store, tmp_path):
    """The singleflight wait calls ``help_once``: the waiter runs items while it waits."""
    from coordinator import open_store
    from coordinator.singleflight import Owner, Singleflight
    from coordinator.split_tuning import SplitTuning, WorkItem

    sys.path.insert(0, str(PROC.parent))
    from split_tuning_proc import FakeRequest

    store = open_store(tcp_store)
    log = tmp_path / "runs.log"
    owner = Singleflight(store, owner=Owner.this_process(0), lease=timedelta(seconds=5),
                         wait_timeout=timedelta(seconds=30), progress_interval=timedelta(seconds=5))
    waiter = Singleflight(store, owner=Owner.this_process(1), lease=timedelta(seconds=5),
                          wait_timeout=timedelta(seconds=30), progress_interval=timedelta(seconds=5))
    helper = SplitTuning(store, prefix="t", rank=1)
    waiter.while_waiting = helper.help_once
    assert owner.lookup("graph", blocking=True).outcome == "claimed"
    outcome = []
    wait = threading.Thread(target=lambda: outcome.append(waiter.lookup("graph", blocking=True).outcome))
    wait.start()
    selector = SplitTuning(store, prefix="t", rank=0, backup_after=timedelta(seconds=20))

    def here(index):
        return lambda: (time.sleep(0.1), float(index))[1]

    items = [WorkItem(f"c{i}", here(i), FakeRequest(i, float(i), run_s=0.1, log=str(log))) for i in range(6)]
    assert selector.select("sel", items) == [float(i) for i in range(6)]
    owner.publish("graph", b"compiled")
    wait.join(10)
    assert outcome == ["waited"]
    assert helper.counts.items_run_for_others == selector.counts.items_received >= 1
    owner.close()
    waiter.close()


SELECTING_SCRIPT = """
import json, os, sys, torch
import torch._inductor.config as inductor_config
import coordinator
inductor_config.freezing = True  # on CPU, GEMM template choices need frozen weights
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).eval()
with coordinator.compile_once(store=sys.argv[1], caches="autotune"), torch.no_grad():
    out = torch.compile(model, mode="max-autotune-no-cudagraphs")(torch.ones(32, 64))
print(json.dumps({"split": coordinator.stats()["split_autotune"], "sum": out.sum().item()}))
"""


def test_inductor_selections_go_through_the_store_and_a_later_rank_reuses_them(tmp_path):
    """A real max-autotune selection on the CPU (frozen weights: a C++ template and ATen):
    the first process selects through the store; a second one, compiling the same graph
    itself (FX graphs not shared here), reuses the merged timings and times nothing."""
    results = []
    for rank in (0, 1):
        env = dict(os.environ, COORDINATOR_SPLIT_AUTOTUNE="1", WORLD_SIZE="2", RANK=str(rank),
                   TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"cache{rank}"), TMPDIR=str(tmp_path))
        done = subprocess.run([sys.executable, "-c", SELECTING_SCRIPT, f"file://{tmp_path / 'store'}"],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = results[0]["split"], results[1]["split"]
    assert first["selections"] >= 1 and first["items_run_here"] >= 2 * first["selections"]
    assert second["selections"] == 0 and second["selections_reused"] == first["selections"]
    assert second["items_run_here"] == 0
    assert results[0]["sum"] == results[1]["sum"]


def test_timings_on_one_device_take_turns(tmp_path, monkeypatch):
    """Two ranks sharing a GPU never time at once (``DeviceLock``: flock across processes)."""
    from coordinator.split_tuning import DeviceLock

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    intervals = []

    def timing():
        with DeviceLock("gpu-test").held():
            start = time.monotonic()
            time.sleep(0.2)
            intervals.append((start, time.monotonic()))

    threads = [threading.Thread(target=timing) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    intervals.sort()
    assert len(intervals) == 3
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(intervals, intervals[1:], strict=False))
