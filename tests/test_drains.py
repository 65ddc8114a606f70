"""What is still being written when a session ends, over a slow store: the entries published
behind the compile and the persistent layer's writes each get ``drain_timeout``, then are
dropped with a warning that says how much; a queue past ``publish_queue_mb`` refuses an entry
and releases its claim at once. Each case shows the lines a user sees."""

from __future__ import annotations

import logging
import os
import time

import pytest
from conftest import Link, RedisServer

from coordinator import Config
from coordinator.features.persistent import PersistentLayer
from coordinator.session import Session

pytestmark = pytest.mark.protocol

MB = 1024 * 1024
#: Bytes per second through the slow link: a 2 MiB value takes 20 s.
RATE = 100_000


@pytest.fixture
def slow_redis(tmp_path):
    """A Redis server, and a URL that reaches it through a link of RATE bytes per second."""
    server = RedisServer(tmp_path / "redis")
    link = Link(server.port, rate=RATE)
    yield server, f"redis://127.0.0.1:{link.port}/0"
    link.close()
    server.kill()


def claimed_and_compiled(session: Session, key: str, nbytes: int) -> None:
    assert session.get("fx_graph", key) is None  # claimed: this rank compiles it
    session.put("fx_graph", key, os.urandom(nbytes))


def claimed_at_once(url: str, key: str, monkeypatch, tmp_path) -> bool:
    """Whether another rank, on another node, takes ``key``'s claim without waiting."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "other-node"))
    other = Session(Config(store=url))
    started = time.monotonic()
    claimed = other.get("fx_graph", key) is None
    other.close()
    return claimed and time.monotonic() - started < 5


def close_and_tell(session: Session, caplog) -> tuple[float, list[str]]:
    caplog.clear()
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="coordinator"):
        session.close()
    return time.monotonic() - started, [r.getMessage() for r in caplog.records]


def test_entries_still_publishing_at_exit_are_dropped_after_drain_timeout(slow_redis, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    server, slow_url = slow_redis
    session = Session(Config(store=slow_url, drain_timeout=1, progress_interval=0.4))
    claimed_and_compiled(session, "pt2:fx-graph-v1::big", 2 * MB)
    took, lines = close_and_tell(session, caplog)
    assert took < 10, took  # 1 s of drain, then the release of the claim
    assert "publishing: waiting for 1 writes (2.1 MB) to finish, 0s of 1s" in lines, lines
    assert ("compile_once: 1 entries (2.1 MB) were not published within 1s; the ranks or jobs that need them "
            "compile them") in lines, lines
    assert claimed_at_once(server.url, "pt2:fx-graph-v1::big", monkeypatch, tmp_path)  # its claim was released


def test_the_persistent_layers_writes_at_exit_are_dropped_after_drain_timeout(slow_redis, tmp_path, monkeypatch,
                                                                             caplog):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _, slow_url = slow_redis
    session = Session(Config(store=f"file://{tmp_path / 'live'}", persist=slow_url, drain_timeout=1))
    claimed_and_compiled(session, "pt2:fx-graph-v1::big", 2 * MB)
    took, lines = close_and_tell(session, caplog)
    assert took < 10, took
    assert (f"compile_once: writing 1 values (2.1 MB) to the persistent layer {slow_url} before exit, for up to 1s"
            in lines), lines
    assert (f"compile_once: 1 values (2.1 MB) not written to the persistent layer {slow_url}: still writing after 1s"
            in lines), lines
    assert session.feature(PersistentLayer).counts.not_written == 1


def test_an_entry_past_the_publish_queue_is_not_published_and_its_claim_released(slow_redis, tmp_path, monkeypatch,
                                                                                caplog):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    server, slow_url = slow_redis
    session = Session(Config(store=slow_url, publish_queue_mb=1, drain_timeout=1))
    with caplog.at_level(logging.WARNING, logger="coordinator"):
        # The first one writes for 9 s; of the next two, one at most fits the 1 MB queue.
        for name in ("first", "second", "third"):
            claimed_and_compiled(session, f"pt2:fx-graph-v1::{name}", int(0.9 * MB))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings  # said once
    assert "MB wait to be published, the bound is 1.0 MB (publish_queue_mb): fx_graph entry" in warnings[0]
    assert "is not published; other ranks compile it" in warnings[0], warnings
    assert session.flight().writer.refused >= 1
    assert claimed_at_once(server.url, "pt2:fx-graph-v1::third", monkeypatch, tmp_path)  # released at once, not at exit
    close_and_tell(session, caplog)
