"""Writes to the persistent layer, once per job: the mark that says which rank writes a value
names the job (never a constant), expires where the live store expires keys, and is freed
when its write fails, so that a later job writes what an earlier one could not."""

from __future__ import annotations

import os

import pytest
import redis
from conftest import RedisServer

from coordinator import Config
from coordinator.features.persistent import MARK_TTL, PersistentLayer, write_mark
from coordinator.protocol.stores import open_store
from coordinator.session import Session

pytestmark = pytest.mark.protocol

KEY = "pt2:fx-graph-v1::persisted-graph"
VALUE = os.urandom(2 * 1024 * 1024)


def job(run_id: str, live: str, persist: str, monkeypatch, tmp_path) -> Session:
    """One rank of a job named ``run_id`` (torchrun's TORCHELASTIC_RUN_ID), on a node of its
    own, that compiled KEY."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / run_id))
    session = Session(Config(store=live, persist=persist))
    assert session.get("fx_graph", KEY) is None  # claimed: this rank compiles it
    session.put("fx_graph", KEY, VALUE)
    session.close()
    return session


def marks(server: RedisServer) -> dict[str, int]:
    """The persistent layer's marks in the live store, with their time to live (ms)."""
    client = redis.Redis(port=server.port)
    return {key.decode(): client.pttl(key) for key in client.scan_iter("*persisted-*")}


def test_a_write_that_failed_frees_its_mark_and_a_later_job_writes_it(tmp_path, monkeypatch, caplog):
    live = RedisServer(tmp_path / "live")
    # The layer's server refuses a value this large: a write that fails after its mark was set.
    layer = RedisServer(tmp_path / "layer", "--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
    try:
        first = job("job-a", live.url, layer.url, monkeypatch, tmp_path)
        counts = first.feature(PersistentLayer).counts
        assert counts.failed and (counts.written, counts.not_written) == (0, 1), counts
        assert any("persistent layer" in r.getMessage() and "failed, going on without it" in r.getMessage()
                   for r in caplog.records)
        assert marks(live) == {}  # freed: the write it promised did not happen

        redis.Redis(port=layer.port).config_set("maxmemory", 0)
        # The value leaves the shared live store (expired or evicted), its marks stay.
        client = redis.Redis(port=live.port)
        client.delete(*[key for key in client.scan_iter() if b"persisted-" not in key])
        second = job("job-b", live.url, layer.url, monkeypatch, tmp_path)
        counts = second.feature(PersistentLayer).counts
        assert (counts.failed, counts.written) == (False, 1), counts
        stored = open_store(layer.url).get(second.store_key("fx_graph", KEY))
        assert stored is not None and len(stored) > len(VALUE)  # the sealed entry
        # The second job's mark, named after it, lives at most MARK_TTL.
        (mark, ttl), = marks(live).items()
        assert mark.endswith("/" + write_mark(second.flight().job)) and second.flight().job.startswith("job-b")
        assert 0 < ttl <= MARK_TTL.total_seconds() * 1000
    finally:
        live.kill()
        layer.kill()


def test_torchruns_run_id_none_is_no_job_id(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # torchrun without --standalone sets TORCHELASTIC_RUN_ID=none in every job: marks named
    # after it would be one job's for every job.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    session = Session(Config(store=f"file://{tmp_path / 'live'}"))
    assert session.get("fx_graph", KEY) is None
    assert "none" not in session.flight().job
    session.close()
