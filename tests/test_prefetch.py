"""A restarting rank's entries fetched and verified before its first compile asks
(``coordinator.features.prefetch``): real rank processes, a ``file://`` store or a real Redis
server, a cold job and then its restart on new, empty Inductor dirs."""

from __future__ import annotations

import pathlib
import threading

import pytest
from conftest import Link, require_success

from coordinator.errors import IntegrityError
from coordinator.features.prefetch import index_key, read_index
from coordinator.protocol.integrity import seal
from coordinator.protocol.stores import open_store

pytestmark = pytest.mark.protocol


def prefetch(result) -> dict:
    return result.report["stats"]["prefetch"]


def index_of(store_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted((store_dir / "prefetch").rglob("rank*"))


def test_a_restart_takes_every_entry_it_asks_for_from_memory(job, tmp_path):
    store = f"file://{tmp_path / 'store'}"
    cold = job(2, {"store": store, "ddp": True})
    require_success(cold)
    assert len(index_of(tmp_path / "store")) == 2  # one index per rank
    restart = job(2, {"store": store, "ddp": True})
    require_success(restart)
    for cold_rank, rank in zip(cold, restart, strict=True):
        counts = prefetch(rank)
        assert counts["prepared"] > 0 and counts["used"] == counts["prepared"], counts
        assert counts["refused"] == 0
        assert rank.report["stats"]["graphs_compiled"] == 0  # every graph from memory
        assert rank.report["stats"]["store_fetches"] == 0  # and none asked of the store
        assert rank.report["losses"] == cold_rank.report["losses"]
        assert "prepared ahead" in rank.log


def test_an_index_of_a_changed_model_is_unused_and_the_job_compiles_what_it_lacks(job, tmp_path):
    store = f"file://{tmp_path / 'store'}"
    require_success(job(1, {"store": store, "model": "mlp"}))
    changed = job(1, {"store": store, "model": "broken"})
    stock = job(1, {"model": "broken", "coordinator": False})
    require_success(changed)
    require_success(stock)
    for rank, alone in zip(changed, stock, strict=True):
        counts = prefetch(rank)
        assert counts["prepared"] > 0 and counts["used"] == 0, counts
        assert rank.report["stats"]["graphs_compiled"] + rank.report["stats"]["graphs_received"] > 0
        assert rank.report["losses"] == alone.report["losses"]


def test_a_tampered_entry_is_refused_ahead_and_compiled_again(job, tmp_path):
    store_dir = tmp_path / "store"
    store = f"file://{store_dir}"
    cold = job(1, {"store": store})
    require_success(cold)
    values = sorted(p for p in (store_dir / "v").rglob("*") if p.is_file() and "/fx_graph/" in str(p))
    assert values
    blob = values[0].read_bytes()
    values[0].write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    restart = job(1, {"store": store})
    require_success(restart)
    (rank,) = restart
    counts = prefetch(rank)
    assert counts["refused"] == 1 and counts["used"] == counts["prepared"] > 0, counts
    assert "prefetch refused" in rank.log
    assert rank.report["stats"]["rejected"] >= 1  # the lookups refused it in the store too
    assert rank.report["stats"]["graphs_compiled"] == 1
    assert rank.report["losses"] == cold[0].report["losses"]


def test_an_index_that_fails_verification_is_refused(tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}")
    key = index_key(b"team-secret", "", "train.py", 0)
    assert read_index(store, key, b"team-secret") is None
    store.set(key, seal(key, b"\x92\xa1a\xa1b", secret=b"team-secret"))
    assert read_index(store, key, b"team-secret") == ["a", "b"]
    with pytest.raises(IntegrityError):
        read_index(store, key, b"another-secret")
    blob = store.get(key)
    store.set(key, blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(IntegrityError):
        read_index(store, key, b"team-secret")
    # The key names the secret's fingerprint, the namespace, the script and the rank.
    assert len({index_key(s, ns, script, rank) for s in (None, b"x") for ns in ("", "team")
                for script in ("a.py", "b.py") for rank in (0, 1)}) == 16


def test_a_store_that_dies_while_a_restart_prepares_leaves_a_job_that_compiles(job, tmp_path, redis_server):
    cold = job(2, {"store": redis_server.url, "ddp": True})
    require_success(cold)
    # The restart reaches Redis through a link that kills it when a rank that has asked for
    # its index asks for its first value: the rest is never fetched.
    index_asked = threading.Event()

    def first_value_asked(request: bytes) -> bool:
        if b"coordinator/prefetch/" in request:
            index_asked.set()
            return False
        return index_asked.is_set() and b"coordinator/v/" in request

    link = Link(redis_server.port, cut_when=first_value_asked, at_cut=redis_server.kill)
    try:
        restart = job(2, {"store": f"redis://127.0.0.1:{link.port}/0", "ddp": True},
                      env={"COORDINATOR_LEASE_S": "2"})
    finally:
        link.close()
    require_success(restart)
    assert link.cut.is_set()
    assert any(prefetch(rank)["used"] < prefetch(rank)["indexed"] for rank in restart)
    for cold_rank, rank in zip(cold, restart, strict=True):
        stats = rank.report["stats"]
        assert stats["graphs_compiled"] > 0 and stats["store_failed"]
        assert rank.report["losses"] == cold_rank.report["losses"]
