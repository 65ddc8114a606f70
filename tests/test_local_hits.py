"""A rank that starts with a warm local cache, next to cold ranks.

Inductor reads its local cache first, so a warm rank (a restarted job, a reused
node) never asks the store. Without help it leaves the cold ranks compiling and
reaches the first collective alone; gloo's collectives time out then (NCCL's too,
unless Inductor's timeout extension covers the cold ranks' compile). Under
``compile_once`` the warm rank publishes its local copy when no rank has the graph,
or waits on the store while a cold rank compiles it.

Each test first fills one cache dir with a one-rank job, then gives it to rank 0.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from conftest import require_success

from coordinator import Config
from coordinator.features.local_hits import LocalHits
from coordinator.session import Session

UNIQUE_GRAPHS = 2  # forward and backward


def warm_cache(job, tmp_path, options=None):
    """A cache dir filled by a one-rank job with ``options`` (the graphs' keys depend on
    them: a first-compiler pass is part of the key, whatever it does)."""
    cache = tmp_path / "warm-inductor"
    require_success(job(1, dict(options or {}, coordinator=False), cache_dirs={0: cache}, name="fill"))
    (tmp_path / "first-compiler").unlink(missing_ok=True)
    return cache


def test_a_graph_found_twice_in_the_local_cache_counts_and_publishes_once(tmp_path, monkeypatch):
    """An early backward compile loads a graph from the local cache, and the backward pass
    loads it again: one graph this rank needed, found locally, published once. A graph
    received from the store and then served from the local cache is no local hit."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "node"))
    session = Session(Config(store=f"file://{tmp_path / 'store'}"))
    built = []

    def remote_value():
        built.append(1)
        return b"entry of the backward graph"

    for _ in range(2):
        session.feature(LocalHits).served_locally("pt2:fx-graph-v1::backward", remote_value, [])
    session.put("fx_graph", "pt2:fx-graph-v1::forward", b"entry of the forward graph")
    # Published behind the compile: read only once written (a lookup before that claims it).
    assert session.flight().drain(timedelta(seconds=30))
    other = Session(Config(store=f"file://{tmp_path / 'store'}"))
    assert other.get("fx_graph", "pt2:fx-graph-v1::backward") == b"entry of the backward graph"
    assert other.get("fx_graph", "pt2:fx-graph-v1::forward") == b"entry of the forward graph"
    other.feature(LocalHits).served_locally("pt2:fx-graph-v1::forward", remote_value, [])
    mine, theirs = session.stats.as_dict(), other.stats.as_dict()
    assert (mine["graphs_found_in_local_cache"], mine["graphs_shared_from_local_cache"], len(built)) == (1, 1, 1)
    assert (theirs["graphs_received"], theirs["graphs_found_in_local_cache"]) == (2, 0)
    session.close()
    other.close()


def test_warm_rank_publishes_its_local_graphs_and_a_cold_rank_loads_them(job, tmp_path):
    cache = warm_cache(job, tmp_path)
    published = tmp_path / "warm-rank-done"
    results = job(2, {"no_pg": True, "store": f"file://{tmp_path / 'store'}"}, cache_dirs={0: cache},
                  rank_options={0: {"touch_after_steps": str(published)}, 1: {"start_after": str(published)}})
    require_success(results)
    warm, cold = results
    assert warm.fx_misses == 0 and warm.fx_hits == UNIQUE_GRAPHS
    assert warm.report["stats"]["graphs_shared_from_local_cache"] == UNIQUE_GRAPHS
    assert cold.fx_misses == 0 and cold.report["stats"]["graphs_received"] == UNIQUE_GRAPHS
    # The C++ kernels came with the local entries: the cold rank built none.
    assert cold.report["cpp_builds"]["kernel"] == 0, cold.report["cpp_builds"]
    assert cold.report["stats"]["kernels_received"] > 0
    for r in results:
        torch.testing.assert_close(r.report["losses"], r.report["ref_losses"], rtol=1e-4, atol=1e-5)

    # Opted out, a warm rank leaves the store alone and the cold rank compiles.
    published.unlink()
    results = job(2, {"no_pg": True, "store": f"file://{tmp_path / 'store-2'}"}, cache_dirs={0: cache},
                  env={"COORDINATOR_SHARE_LOCAL_HITS": "0"},
                  rank_options={0: {"touch_after_steps": str(published)}, 1: {"start_after": str(published)}})
    require_success(results)
    assert results[0].report["stats"]["graphs_shared_from_local_cache"] == 0
    assert results[1].fx_misses == UNIQUE_GRAPHS


@pytest.mark.protocol
def test_warm_rank_waits_on_the_store_not_in_a_collective_that_times_out(job, tmp_path):
    """The cold rank compiles slowly (6 s stall); the gloo timeout is 3 s. The warm rank
    starts its step once the cold rank is compiling (the first compiler's marker file)."""
    cache = warm_cache(job, tmp_path, {"first_compiler": "slow:0"})
    marker = str(tmp_path / "first-compiler")
    options = {"ddp": True, "steps": 2, "pg_timeout_s": 3, "first_compiler": "slow:6"}
    per_rank = {0: {"start_after": marker}}

    # Without the coordinator the warm rank enters DDP's all-reduce 6+ s before the cold
    # rank does, and gloo ends the job.
    results = job(2, dict(options, coordinator=False), cache_dirs={0: cache}, rank_options=per_rank, name="plain")
    warm = results[0]
    assert warm.returncode != 0 and warm.report is None, warm.log[-2000:]
    assert "timed out" in warm.log.lower() or "timeout" in warm.log.lower(), warm.log[-2000:]

    # With compile_once the warm rank finds the cold rank's claim and waits on the store.
    (tmp_path / "first-compiler").unlink()
    results = job(2, options, cache_dirs={0: cache}, rank_options=per_rank, name="coordinated")
    require_success(results)
    warm, cold = results
    assert warm.fx_misses == 0 and cold.fx_misses >= 1
    assert warm.report["stats"]["waited_s"] > 3, warm.report["stats"]
    for r in results:
        torch.testing.assert_close(r.report["losses"], r.report["ref_losses"], rtol=1e-4, atol=1e-5)
