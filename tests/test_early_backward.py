"""Backward graphs compiled early by the ranks that wait (``coordinator.features.early_backward``).

Real jobs: one process per rank, gloo, the job's TCPStore (or a TCPStore the test hosts
for the fault cases, or a Redis server the test kills). Each compile sleeps a little (the
worker's ``slow_compiles`` pass) so that, as on a GPU, a rank that loads a graph reaches
the next one while another rank still compiles it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import require_success

from coordinator import Config

# "broken": three frames, each with a forward and a deferred backward: 6 graphs.
GRAPHS = 6


def early(result) -> dict:
    return result.report["stats"]["early_backward"]


def the_survivor_that_took_over(results):
    """Of a 2-rank job where one rank died (exit code 17), the other: finished, after
    taking the dead rank's claim over."""
    died = [r for r in results if r.returncode == 17]
    survivors = [r for r in results if r.returncode != 17]
    assert len(died) == 1 and len(survivors) == 1, [(r.rank, r.returncode, r.log[-2000:]) for r in results]
    survivor = survivors[0]
    assert survivor.returncode == 0 and survivor.report is not None, survivor.log[-3000:]
    assert "taking over" in survivor.log
    return survivor


def test_a_waiting_rank_compiles_backward_graphs_early_and_each_graph_compiles_once(job):
    results = job(2, {"model": "broken", "steps": 2, "slow_compiles": 2.0})
    require_success(results)
    # Every graph compiled once in the job: the early compiles did not duplicate work.
    assert sum(r.report["stats"]["graphs_compiled"] for r in results) == GRAPHS, [r.report["stats"] for r in results]
    for r in results:
        stats = r.report["stats"]
        assert stats["graphs_compiled"] + stats["graphs_received"] == GRAPHS, stats
        assert early(r)["failed"] == 0, r.log[-3000:]
        torch.testing.assert_close(r.report["losses"], r.report["ref_losses"], rtol=1e-4, atol=1e-5)
    # The rank that waited for the forward graphs compiled backward graphs meanwhile,
    # and the other rank's backward pass loaded them.
    assert sum(early(r)["compiled"] for r in results) >= 1, [early(r) for r in results]
    helper = max(results, key=lambda r: early(r)["compiled"])
    other = next(r for r in results if r is not helper)
    assert other.report["stats"]["graphs_received"] >= early(helper)["compiled"]
    assert results[0].report["losses"] == results[1].report["losses"]


@pytest.mark.one_torch  # a subset of the hooks that the tests with the feature on pass through on every torch
def test_off_no_backward_is_compiled_early(job):
    results = job(2, {"model": "broken", "steps": 1, "slow_compiles": 2.0},
                  env={"COORDINATOR_EARLY_BACKWARD": "0"})
    require_success(results)
    # The feature is off: no counts at all (``None``), so nothing was compiled or skipped early.
    assert all(early(r) is None for r in results), [early(r) for r in results]
    assert sum(r.report["stats"]["graphs_compiled"] for r in results) == GRAPHS


@pytest.mark.protocol
def test_a_rank_killed_in_an_early_compile_is_taken_over_after_its_lease(job, tcp_store):
    # The first rank to compile a backward graph early dies in it, holding its claim. The
    # survivor's backward pass waits on that claim until the lease runs out, takes it
    # over and compiles the graph: the job finishes with the right losses.
    results = job(
        2,
        {"model": "broken", "steps": 1, "slow_compiles": 2.0, "no_pg": True,
         "external_store": f"127.0.0.1:{tcp_store.port}", "first_compiler": "die_early"},
        env={"COORDINATOR_LEASE_S": "2"},
    )
    survivor = the_survivor_that_took_over(results)
    torch.testing.assert_close(survivor.report["losses"], survivor.report["ref_losses"], rtol=1e-4, atol=1e-5)


@pytest.mark.protocol
def test_a_leader_killed_while_the_other_rank_compiles_early_is_taken_over(job, tcp_store):
    # The rank compiling the second forward graph dies in it. The other rank, waiting for
    # that graph, compiles the first graph's backward meanwhile, then takes the dead
    # rank's claim over once its lease lapses, and finishes alone with the right losses.
    results = job(
        2,
        {"model": "broken", "steps": 1, "slow_compiles": 2.0, "no_pg": True,
         "external_store": f"127.0.0.1:{tcp_store.port}", "first_compiler": "die_at:2"},
        env={"COORDINATOR_LEASE_S": "2"},
    )
    survivor = the_survivor_that_took_over(results)
    assert early(survivor)["compiled"] >= 1 and early(survivor)["failed"] == 0, early(survivor)
    torch.testing.assert_close(survivor.report["losses"], survivor.report["ref_losses"], rtol=1e-4, atol=1e-5)


@pytest.mark.protocol
def test_a_store_that_dies_mid_job_ends_in_local_compiles(job, redis_server):
    # The rank compiling the second forward graph kills the Redis server while the other
    # rank waits for that graph (compiling a backward early). Both fall back to local
    # compiles and finish with the losses of an uncompiled model.
    results = job(2, {"model": "broken", "steps": 2, "slow_compiles": 2.0, "store": redis_server.url,
                      "first_compiler": f"kill_at:2:{redis_server.proc.pid}"})
    require_success(results)
    assert redis_server.proc.poll() is not None, "the store was not killed"
    assert any(r.report["stats"]["store_failed"] for r in results), [r.report["stats"] for r in results]
    assert any("compiling locally, trying it again in 1s" in r.log for r in results)
    for r in results:
        torch.testing.assert_close(r.report["losses"], r.report["ref_losses"], rtol=1e-4, atol=1e-5)
    assert results[0].report["losses"] == results[1].report["losses"]


def test_the_switch_reads_its_environment_variable():
    assert Config.resolve(environ={}).early_backward is True
    assert Config.resolve(environ={"COORDINATOR_EARLY_BACKWARD": "off"}).early_backward is False
    assert Config.resolve(environ={"COORDINATOR_EARLY_BACKWARD": "off"}, early_backward=True).early_backward is True
