"""compile_once installs Inductor hooks and restores every one of them on exit."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch._inductor.remote_cache as remote_cache
from torch._dynamo.callback import callback_handler

import coordinator
from coordinator import ConfigError, api


def snapshot():
    return (
        remote_cache.RemoteFxGraphCache.backend_override_cls,
        remote_cache.RemoteAOTAutogradCache.backend_override_cls,
        remote_cache.RemoteDynamoPGOCache.backend_override_cls,
        inductor_config.fx_graph_remote_cache,
        functorch_config.enable_remote_autograd_cache,
        len(callback_handler.end_callbacks),
    )


def test_hooks_are_installed_and_restored(tmp_path):
    before = snapshot()
    with coordinator.compile_once(f"file://{tmp_path}") as session:
        assert snapshot() == before and not session.started  # nothing until the first sign of a compile
        torch.compile(lambda x: x + 1)  # the call alone starts it: the hooks are in before the first frame
        assert session.started
        backend = remote_cache.RemoteFxGraphCache.backend_override_cls
        assert backend is not None and backend.__name__ == "CoordinatorFxGraphBackend"
        assert inductor_config.fx_graph_remote_cache is True
        assert functorch_config.enable_remote_autograd_cache is True
        # The override really reaches the session: a put through Inductor's own class.
        cache = remote_cache.RemoteFxGraphCache("fx-graph-v1")
        cache.put("somekey", {"data": "eA==", "time_taken_ms": 1234})
        # Published behind the compile: a get before the writer ran finds a claim this
        # process holds, and misses.
        assert session.flight().drain(timedelta(seconds=30))
        assert cache.get("somekey") == {"data": "eA==", "time_taken_ms": 1234}
        assert cache.get("missing") is None
        assert session.stats.as_dict()["by_cache"]["fx_graph"]["published"] == 1
        # Every store call went through the session's timing: the put, the hit, the miss.
        assert session.stats.as_dict()["store_calls"] >= 3 and session.stats.as_dict()["store_s"] > 0
        # Another compile_once with other settings is refused, naming the setting and both values.
        with pytest.raises(ConfigError, match=r"already active in this process with other settings: "
                                              r"store \(COORDINATOR_STORE\): active 'file://.*', requested None$"):
            with coordinator.compile_once():
                pass
        assert api.active_session() is session
    assert snapshot() == before
    assert coordinator.stats()["graphs_received"] == 1
    assert coordinator.stats()["compile_time_saved_s"] == pytest.approx(1.234)


def test_a_nested_compile_once_with_the_same_settings_joins_the_active_one(tmp_path, monkeypatch):
    """A script written for the context manager, run where compile_once is already active
    (coordinator-run enters it for the whole process): the inner one joins, and leaving it
    leaves the session open."""
    monkeypatch.setenv("COORDINATOR_STORE", f"file://{tmp_path}")
    monkeypatch.setenv("COORDINATOR_LEASE_S", "7")
    before = snapshot()
    with coordinator.compile_once() as outer:
        with coordinator.compile_once(lease=7, store=f"file://{tmp_path}") as inner:  # the same, given as arguments
            assert inner is outer
            torch.compile(lambda x: x + 1)
        # The inner exit closed nothing: the hooks and the session are still there.
        assert api.active_session() is outer and snapshot() != before
        assert remote_cache.RemoteFxGraphCache.backend_override_cls.__name__ == "CoordinatorFxGraphBackend"
        remote_cache.RemoteFxGraphCache("fx-graph-v1").put("k", {"data": "eA==", "time_taken_ms": 5})
        assert outer.flight().drain(timedelta(seconds=30))  # published behind the compile
        assert coordinator.stats()["by_cache"]["fx_graph"]["published"] == 1
        with pytest.raises(ConfigError) as refused:
            with coordinator.compile_once(lease=3, namespace="team", secret="s3cret-0123456789"):
                pass
        message = str(refused.value)
        assert "lease (COORDINATOR_LEASE_S): active 7s, requested 3s" in message
        assert "namespace (COORDINATOR_NAMESPACE): active '', requested 'team'" in message
        assert "secret (COORDINATOR_SECRET): active none, requested set" in message
        assert "s3cret" not in message and "store" not in message
        assert api.active_session() is outer
    assert api.active_session() is None and snapshot() == before


def test_hooks_are_restored_after_an_exception(tmp_path):
    before = snapshot()
    with pytest.raises(ZeroDivisionError):
        with coordinator.compile_once(f"file://{tmp_path}"):
            raise ZeroDivisionError
    assert snapshot() == before


def test_no_process_group_means_local_compiles(caplog):
    with coordinator.compile_once() as session:
        assert session.get("fx_graph", "k") is None
    assert "no store yet" in caplog.text


def test_enable_from_env(tmp_path):
    code = (
        "import coordinator, torch, torch._inductor.remote_cache as rc;"
        "assert coordinator.enable_from_env();"
        "assert rc.RemoteFxGraphCache.backend_override_cls is None;"  # nothing before the first compile
        "torch.compile(lambda x: x);"
        "print(rc.RemoteFxGraphCache.backend_override_cls.__name__)"
    )
    env = {"COORDINATOR_ENABLE": "1", "COORDINATOR_STORE": f"file://{tmp_path}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "CoordinatorFxGraphBackend"
    env["COORDINATOR_ENABLE"] = "0"
    code = "import coordinator; assert not coordinator.enable_from_env()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def test_sitecustomize_enables_without_code_change(tmp_path):
    from pathlib import Path

    hook = Path(coordinator.__file__).resolve().parent / "_site"
    # A library that first asks whether torch is installed (transformers does) changes nothing.
    code = ("import importlib.util; assert importlib.util.find_spec('torch'); "
            "import torch, torch._inductor.remote_cache as rc; torch.compile(lambda x: x); "
            "print(rc.RemoteFxGraphCache.backend_override_cls.__name__)")
    env = {"COORDINATOR_ENABLE": "1", "COORDINATOR_STORE": f"file://{tmp_path}", "PYTHONPATH": str(hook),
           "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "CoordinatorFxGraphBackend", out.stderr
    # It enters compile_once as the script's import of torch ends: a process that never
    # imports torch never starts it, and its first line runs before any of it.
    out = subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
    env["COORDINATOR_STORE"] = "nonsense"
    out = subprocess.run([sys.executable, "-c", "import torch; print('started')"], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "started" and "coordinator: not enabled: ConfigError" in out.stderr


def _compile_workers_seen(tmp_path: Path, mode: str, **env: str) -> dict:
    """What ``tests/compile_worker_probe.py`` reports, run in a fresh process with ``env``
    on top of this one's (less Inductor's Redis, compile-thread and local-ranks settings)."""
    unset = ("TORCHINDUCTOR_COMPILE_THREADS", "LOCAL_WORLD_SIZE")
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_REDIS") and k not in unset}
    base["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    probe = Path(__file__).with_name("compile_worker_probe.py")
    out = subprocess.run([sys.executable, str(probe), str(tmp_path / "store"), mode], env={**base, **env},
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_compile_jobs_stay_off_redis_whenever_the_pool_started(tmp_path):
    """Routing the autotune cache bakes ``autotune_remote_cache`` into every kernel; a compile
    worker building that cache without our backend would fall back to Inductor's Redis on
    localhost:6379 (seconds of redis-py retries a lookup where no server listens). Inside a
    session every Triton compile job carries an invalid Redis URL, so that the backend fails
    at once: in a pool the session started, and in one the script's own compile started
    before it (Inductor's pool, real worker processes: ``tests/compile_worker_probe.py``).
    A user's own Redis settings, or remote autotune cache, are left alone."""
    from coordinator import _compat

    def seen(mode: str, **env: str) -> dict:
        return _compile_workers_seen(tmp_path, mode, TORCHINDUCTOR_COMPILE_THREADS="2", **env)

    guarded = {"redis_url": _compat.NO_REDIS_URL, "builds_redis_cache": False}
    fresh = seen("not-started")
    assert "autotune" in fresh["routed"]
    assert {k: fresh["during"][k] for k in guarded} == guarded, fresh

    early = seen("started")  # the script compiled first: its workers started without the guard
    assert early["before"]["redis_url"] is None and early["before"]["builds_redis_cache"], early
    assert {k: early["during"][k] for k in guarded} == guarded, early

    users = seen("not-started", TORCHINDUCTOR_REDIS_HOST="my-redis")  # the user's Redis: theirs
    assert users["during"]["redis_url"] is None and users["during"]["builds_redis_cache"], users
    users = seen("not-started", TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE="1")  # their own cache, on localhost
    assert users["during"]["redis_url"] is None and users["during"]["builds_redis_cache"], users


def test_a_sessions_compile_workers_get_its_part_of_the_hosts_cores(tmp_path):
    """torch starts min(32, cores) compile workers in every rank, whatever the ranks on the
    host: a session gives each its part (``LOCAL_WORLD_SIZE``), unless the user set a number
    or the pool already runs, and starts the pool with the session where Triton is."""
    from coordinator import _compat

    assert [_compat.compile_pool_size(32, n) for n in (1, 2, 4, 8, 64)] == [32, 16, 8, 4, 1]
    assert [_compat.compile_pool_size(128, n) for n in (1, 2, 8)] == [32, 32, 16]
    def seen(mode: str, **env: str) -> dict:
        return _compile_workers_seen(tmp_path, mode, **env)

    cores = _compat.compile_pool_size(len(os.sched_getaffinity(0)), 1)
    alone = seen("no-jobs")
    assert alone["threads"] == {"torch": cores, "session": cores}, alone
    triton = importlib.util.find_spec("triton") is not None
    assert alone["pool_at_start"] is triton  # started with the session where Triton is
    if triton:  # without Triton no pool starts either way
        assert seen("no-jobs", COORDINATOR_WARM_COMPILE_POOL="0")["pool_at_start"] is False
    two = seen("no-jobs", LOCAL_WORLD_SIZE="2")
    assert two["threads"] == {"torch": cores, "session": _compat.compile_pool_size(len(os.sched_getaffinity(0)), 2)}
    users = seen("no-jobs", LOCAL_WORLD_SIZE="2", TORCHINDUCTOR_COMPILE_THREADS="3")
    assert users["threads"] == {"torch": 3, "session": 3}, users
    if cores > 1:  # a pool already running keeps its size
        running = seen("started", LOCAL_WORLD_SIZE="2")
        assert running["threads"] == {"torch": cores, "session": cores}, running


def test_a_restart_whose_entries_hit_starts_no_compile_workers_until_it_compiles(tmp_path):
    """A restart whose entries all hit loads their kernels in the rank: its compile workers
    are held back (``compile_threads`` at 1, no pool) until the first graph it compiles
    itself, which starts them; a cold job starts them with the session
    (``tests/restart_pool_probe.py``, posing as a GPU host: two real runs on one store)."""
    from coordinator import _compat

    unset = ("TORCHINDUCTOR_COMPILE_THREADS", "LOCAL_WORLD_SIZE", "COORDINATOR_STORE")
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_REDIS") and k not in unset}
    probe = Path(__file__).with_name("restart_pool_probe.py")

    def run(n: int, *mode: str) -> dict:
        env = {**base, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor{n}")}  # each run an empty dir
        out = subprocess.run([sys.executable, str(probe), str(tmp_path / "store"), str(n), *mode], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cores = _compat.compile_pool_size(len(os.sched_getaffinity(0)), 1)
    triton = importlib.util.find_spec("triton") is not None
    cold = run(1)
    assert cold["counts"] == {"held": False, "hits_held": 0, "started_at_miss": False}, cold
    assert cold["start"] == {"threads": cores, "pool": triton}, cold
    restart = run(2)
    if cores > 1:
        assert restart["counts"] == {"held": True, "hits_held": 2, "started_at_miss": True}, restart
        assert restart["start"] == {"threads": 1, "pool": False}, restart
        assert restart["model"] == {"threads": 1, "pool": False}, restart  # every graph hit: no worker
        assert restart["miss"] == {"threads": cores, "pool": triton}, restart  # its own compile started them
    assert restart["after"]["threads"] == cores, restart
    quiet = run(3, "hits-only")  # never compiles: gives its number back at exit, and no worker ever started
    assert quiet["counts"] == {"held": cores > 1, "hits_held": 2 if cores > 1 else 0, "started_at_miss": False}, quiet
    assert quiet["after"] == {"threads": cores, "pool": False}, quiet


def test_reads_of_the_rank_are_reported_except_for_logging(tmp_path):
    import logging

    import torch.distributed as dist

    from coordinator import _compat

    def reads_the_rank(group):
        return dist.get_rank(), group.rank()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        reads: list[str] = []
        with _compat.rank_reads(reads.append):
            reads_the_rank(group)
            # torch's log formatter prefixes each record with the rank: not a read that changes code.
            logging.getLogger("torch._inductor.select_algorithm").warning("a warning during a compile")
            dist.barrier()
        assert reads == [f"{__name__}.reads_the_rank"] * 2
        assert dist.get_rank() == 0 and group.rank() == 0
        assert dist.get_rank is dist.distributed_c10d.get_rank and "report" not in str(dist.get_rank.__code__)
    finally:
        dist.destroy_process_group()


def test_the_summary_is_one_short_line_and_the_details_go_to_debug():
    from coordinator.observe.stats import Stats

    stats = Stats(rank=65535)
    stats.store, stats.store_failed = "rediss", True
    for n in range(99_999):  # counts of 5 digits in every field
        for name, args, dur in (("compile", {"key": f"fx_graph/{n}"}, 0), ("local hit", {"key": f"fx_graph/{n}"}, 0),
                                ("wait", {"key": f"fx_graph/{n}"}, 1e6), ("rejected", {"key": f"fx_graph/{n}"}, 0),
                                ("receive", {"key": f"fx_graph/{n}", "bytes": 10**6, "saved_s": 1.0,
                                             "from": "store"}, 0)):
            stats.count({"name": name, "args": args, "dur": dur})
    stats.rank_dependent = 99_999
    line = stats.summary()
    assert len(line) <= 200, (len(line), line)
    assert line.startswith("compile_once rank 65535: compiled 99999, received 99999, local 99999, "
                           "rank-dependent 99999; waits 99999 (99999.0s); saved 99999.0s; MB in 99999.00"), line
    assert line.endswith("; rejected 99999; store rediss, failed"), line
    details = Stats(0)
    details.aot_autograd_hits = lambda: 3
    assert "3 graphs skipped AOTAutograd" in details.details() and "NCCL timeout extended" in details.details()


def test_a_store_that_cannot_be_opened_still_counts_what_the_rank_compiled(tmp_path, caplog):
    """A store that fails at open (here a directory that cannot be made) means local
    compiles; the summary counts them and names the store, failed."""
    from coordinator.session import Session
    from coordinator.settings import Config

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    session = Session(Config(store=f"file://{blocker}/store"))
    for graph in ("forward", "backward"):
        assert session.get("fx_graph", f"pt2:fx-graph-v1::{graph}:c1") is None  # Inductor compiles
        session.put("fx_graph", f"pt2:fx-graph-v1::{graph}:c1", b"entry")
    session.close()
    stats = session.stats.as_dict()
    assert (stats["graphs_compiled"], stats["store"], stats["store_failed"]) == (2, "file", True)
    assert "compiled 2, received 0" in session.stats.summary()
    assert session.stats.summary().endswith("store file, failed")
    assert caplog.text.count("cannot open the store") == 1
