"""Acceptance tests: real rank processes compiling a real model under compile_once.

Each test starts a job of 3 processes (gloo, the real TCPStore of
``init_process_group``, or a real Redis server, or a real directory), each with an
empty Inductor cache dir. "Unique graphs" is 2 for the test model (forward and
backward). A follower "builds no kernel" means zero ``CppBuilder.build`` calls for
kernel libraries; with Inductor's precompiled headers on (its default) a rank on a
fresh node still precompiles the C++ prefix header once, and with
``TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0`` it runs no compiler at all.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import require_success

UNIQUE_GRAPHS = 2
WORLD = 3


NO_PCH = {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}


def assert_compiled_once(results, unique_graphs=UNIQUE_GRAPHS, *, no_compiler=False):
    require_success(results)
    assert sum(r.fx_misses for r in results) == unique_graphs, [r.report["inductor"] for r in results]
    for r in results:
        assert r.fx_misses + r.fx_hits == unique_graphs
        if r.fx_misses == 0:
            builds = r.report["cpp_builds"]
            assert builds["kernel"] == 0, f"rank {r.rank} compiled kernels: {builds}"
            if no_compiler:
                assert builds["header"] == 0, f"rank {r.rank} ran the C++ compiler: {builds}"
            assert r.report["stats"]["kernels_received"] > 0
        torch.testing.assert_close(r.report["losses"], r.report["ref_losses"], rtol=1e-4, atol=1e-5)


def test_job_store_ddp_compiles_each_graph_once(job):
    results = job(WORLD, {"ddp": True, "steps": 2})
    assert_compiled_once(results)
    # Followers waited on the store and report what they saved.
    followers = [r for r in results if r.fx_misses == 0]
    assert len(followers) == WORLD - 1
    for r in followers:
        stats = r.report["stats"]
        assert stats["graphs_received"] == UNIQUE_GRAPHS and stats["graphs_compiled"] == 0
        assert stats["bytes_received"] > 0 and stats["compile_time_saved_s"] > 0
        assert stats["timeout_extension_s"] == 0  # gloo: no NCCL timeouts to extend
        assert stats["store"] == "c10d"


@pytest.mark.protocol
@pytest.mark.parametrize("backend", ["redis", "file"])
def test_shared_store_and_second_job_compiles_nothing(job, backend, redis_server, tmp_path):
    url = redis_server.url if backend == "redis" else f"file://{tmp_path / 'shared-cache'}"
    # The directory store runs without precompiled headers: followers run no compiler at all.
    env = NO_PCH if backend == "file" else {}
    first = job(WORLD, {"store": url, "ddp": True}, env=env)
    assert_compiled_once(first, no_compiler=backend == "file")
    # A new job: new processes, empty local cache dirs, same store.
    second = job(WORLD, {"store": url, "ddp": True}, env=env)
    require_success(second)
    for r in second:
        assert r.fx_misses == 0 and r.fx_hits == UNIQUE_GRAPHS
        assert r.report["cpp_builds"]["kernel"] == 0
        assert r.report["cpp_builds"]["isa_probe"] == 0  # the CPU's probe libraries came with the entries
        if backend == "file":
            assert r.report["cpp_builds"]["header"] == 0
        assert r.report["stats"]["waited_s"] < 1.0


def test_a_repeated_graph_is_received_once_then_loaded_from_the_local_cache(job):
    # 3 identical layers, one per DDP bucket: 6 FX lookups (forward and backward of each
    # layer) for 4 graphs, so two lookups repeat an earlier graph.
    # Inductor does not keep remote hits in its local cache; compile_once does, so a
    # rank's later lookups of a graph it received load from disk and never reach the
    # store. The ranks may take turns compiling; either way each graph crosses once.
    # Backward graphs compiled early (by a rank that waits, so at some runs only) are one
    # more lookup each, of a graph counted here once: off, so that the lookups are exact;
    # and so are shares of the split frame (coordinator.features.split_shares: each compiles its
    # graphs out of the chain, which then loads them through their AOTAutograd entries).
    results = job(2, {"model": "repeated", "ddp": True, "bucket_cap_mb": 1, "steps": 1},
                  env={"COORDINATOR_EARLY_BACKWARD": "0", "COORDINATOR_CONCURRENT_SPLITS": "0"})
    require_success(results)
    assert sum(r.fx_misses for r in results) == 4
    for r in results:
        stats = r.report["stats"]
        assert r.fx_misses + r.fx_hits == 6
        assert stats["graphs_compiled"] + stats["graphs_received"] == 4, stats
        # Fetched from the store: each graph received, and each AOTAutograd entry received
        # (DDP's split graphs, published after their backward), once.
        aot_received = stats["by_cache"].get("aot_autograd", {}).get("hits", 0)
        assert stats["store_fetches"] == stats["graphs_received"] + aot_received, stats
        assert stats["bytes_from_node"] == 0, stats
        torch.testing.assert_close(r.report["losses"], r.report["ref_losses"], rtol=1e-4, atol=1e-5)


def test_saved_is_the_compile_time_of_the_graphs_a_rank_loaded(job, tmp_path):
    """``saved`` counts the FX graphs a rank loaded instead of compiling, at the compile
    time recorded with each, and nothing else: not the AOTAutograd entries of DDP's split
    graphs it loaded too, whose recorded time holds their FX graphs' compiles again. So no
    rank's ``saved`` exceeds what the other rank spent in torch.compile."""
    from coordinator.observe.report import load_traces

    trace = tmp_path / "trace"
    results = job(2, {"model": "repeated", "ddp": True, "bucket_cap_mb": 1, "steps": 1},
                  env={"COORDINATOR_TRACE": str(trace), "COORDINATOR_EARLY_BACKWARD": "0"})
    require_success(results)
    events = load_traces(trace)
    loaded_kinds = set()
    for r in results:
        received = [e for e in events[r.rank] if e["name"] == "receive"]
        loaded_kinds |= {e["args"]["key"].split("/")[0] for e in received}
        fx_recorded = [e["args"]["saved_s"] for e in received if e["args"]["key"].startswith("fx_graph/")]
        saved = r.report["stats"]["compile_time_saved_s"]
        assert saved == pytest.approx(sum(fx_recorded), abs=0.01), (saved, fx_recorded)
        assert (saved > 0) == bool(fx_recorded)
        other = results[1 - r.rank]
        assert saved <= other.report["compile_seconds"], (saved, other.report["compile_seconds"])
    assert {"aot_autograd", "fx_graph"} <= loaded_kinds, loaded_kinds


@pytest.mark.protocol
def test_killed_claimant_is_taken_over_after_lease(job, tcp_store):
    results = job(
        WORLD,
        {"no_pg": True, "external_store": f"127.0.0.1:{tcp_store.port}", "first_compiler": "die"},
        env={"COORDINATOR_LEASE_S": "2"},
    )
    died = [r for r in results if r.returncode == 17]
    survivors = [r for r in results if r.returncode != 17]
    assert len(died) == 1, [(r.rank, r.returncode) for r in results]
    assert_compiled_once(survivors)
    assert any("expired" in r.log and "taking over" in r.log for r in survivors)


#: A waiting rank's progress line (``coordinator.protocol.waiting``).
WAITING = re.compile(r"waiting on rank (\d+) on (\S+) \(pid (\d+)\) for (.+) \((fx_graph/[0-9a-f]+)\): "
                     r"([\d.]+)s so far, last heartbeat [\d.]+s ago")


@pytest.mark.protocol
def test_slow_claimant_keeps_its_claim(job, tcp_store):
    """The first compile stalls for 4 lease periods; its heartbeat keeps the claim. The
    waiting ranks' lines name the rank and host they wait on and the graph it compiles,
    and come less and less often: after 0.5, 1.5, 3, 6, 9... s (progress_interval 0.5 s)."""
    results = job(
        WORLD,
        {"no_pg": True, "external_store": f"127.0.0.1:{tcp_store.port}", "first_compiler": "slow:6"},
        env={"COORDINATOR_LEASE_S": "1.5", "COORDINATOR_PROGRESS_S": "0.5"},
    )
    assert_compiled_once(results)
    [compiler] = [r for r in results if r.fx_misses > 0]
    followers = [r for r in results if r.fx_misses == 0]
    assert all(r.report["stats"]["waited_s"] >= 4.5 for r in followers)  # 3 leases at least
    assert not any("taking over" in r.log for r in results)
    for r in followers:
        lines = [match.groups() for match in map(WAITING.search, r.log.splitlines()) if match]
        assert lines, r.log[-3000:]
        for rank, host, _, what, _, _ in lines:
            assert (int(rank), host) == (compiler.rank, socket.gethostname())
            # The model's graphs (an nn.Sequential), in Dynamo's first compile.
            assert re.fullmatch(r"(forward|backward) graph \d+ of 'Sequential.forward' \(compile 0/0\)", what), what
        assert lines[0][3].startswith("forward graph "), lines[0]  # the stalled compile: the forward
        waited = [float(line[-1]) for line in lines if line[4] == lines[0][4]]  # the first wait's lines
        due = [0.5, 1.5] + [3.0 * k for k in range(1, 200)]
        assert len(waited) >= 3, waited  # it waited 4.5 s at least
        assert all(w >= d for w, d in zip(waited, due, strict=False)), waited  # none before its time
        assert len(waited) <= sum(d <= r.report["stats"]["waited_s"] for d in due), waited


def test_rank_dependent_graphs_never_wait(job):
    results = job(WORLD, {"model": "rank_dependent"}, env={"COORDINATOR_PROGRESS_S": "1"})
    require_success(results)
    for r in results:
        assert r.fx_misses == UNIQUE_GRAPHS and r.fx_hits == 0
        assert r.report["stats"]["waited_s"] < 1.0
        assert "waiting on rank " not in r.log


# The node's shared cache dir is the coordinator's own matter: one torch (the rank read is caught
# on every torch in the separate case).
@pytest.mark.parametrize("cache", ["separate", pytest.param("shared", marks=pytest.mark.one_torch)])
def test_a_graph_whose_code_depends_on_the_rank_is_never_shared(job, tmp_path, cache):
    # A post-grad pass adds the rank to the forward's output after the FX key is computed.
    # Loading rank 0's graph, rank 1 and 2 would add 0: their losses would be rank 0's.
    cache_dirs = {rank: tmp_path / "node-cache" for rank in range(WORLD)} if cache == "shared" else None
    results = job(WORLD, {"rank_baking_pass": True}, cache_dirs=cache_dirs)
    require_success(results)
    for r in results:
        torch.testing.assert_close(r.report["losses"], r.report["ref_losses"], rtol=1e-4, atol=1e-5)
        assert r.fx_misses == UNIQUE_GRAPHS and r.fx_hits == 0, r.report["inductor"]
        assert r.report["stats"]["graphs_rank_dependent"] == UNIQUE_GRAPHS
        assert "__main__.__call__" in r.log  # "read the rank while compiling (in …)" or "(rank R read it in …)"
    assert any("read the rank while compiling (in __main__.__call__)" in r.log for r in results)
    losses = [r.report["losses"][0] for r in results]
    assert len(set(losses)) == WORLD, losses


@pytest.mark.protocol
def test_collective_in_compiled_forward_does_not_deadlock(job):
    results = job(WORLD, {"model": "collective", "steps": 2}, timeout=200)
    require_success(results)
    assert sum(r.fx_misses for r in results) < WORLD * UNIQUE_GRAPHS
    for r in results:
        torch.testing.assert_close(r.report["losses"], r.report["ref_losses"], rtol=1e-4, atol=1e-5)


@pytest.mark.protocol
def test_dead_store_falls_back_to_local_compiles(job, redis_server):
    url = redis_server.url
    redis_server.kill()
    results = job(WORLD, {"store": url})
    require_success(results)
    for r in results:
        assert r.fx_misses == UNIQUE_GRAPHS
        assert r.report["stats"]["store_failed"] is True
        assert "compiling locally, trying it again in 1s" in r.log


@pytest.mark.protocol
def test_local_ranks_sharing_a_cache_dir_fetch_once_per_node(job, tmp_path):
    # 4 ranks of one "node": one Inductor cache dir. One compiles each graph; of the
    # others, one per graph reads it from the store and the rest from the node's copy.
    results = job(4, {}, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "node-local")})
    require_success(results)
    compiled = sum(r.report["stats"]["graphs_compiled"] for r in results)
    assert compiled == UNIQUE_GRAPHS
    assert sum(r.report["stats"]["store_fetches"] for r in results) <= UNIQUE_GRAPHS
    for r in results:
        torch.testing.assert_close(r.report["losses"], r.report["ref_losses"], rtol=1e-4, atol=1e-5)


def test_a_graph_loaded_first_on_an_empty_dir_brings_the_cpus_probe_libraries(tmp_path):
    """Inductor probes the CPU's vector instructions (a g++ build each) at the first C++ kernel
    of a process; the probe libraries travel with every CPU FX entry, so a later job that
    loads, on an empty cache dir, a graph the first job compiled after its probes builds none
    (``tests/isa_probe_job.py``: real processes, a ``file://`` store)."""
    job = Path(__file__).with_name("isa_probe_job.py")

    def run(name: str, mode: str) -> dict:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / name)}
        env.pop("COORDINATOR_STORE", None)
        out = subprocess.run([sys.executable, str(job), str(tmp_path / "store"), mode], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run("first", "both")
    assert first["misses"] == 2 and first["builds"]["isa_probe"] > 0, first
    later = run("later", "second")  # its first (and only) graph is the first job's second
    assert later["hits"] == 1 and later["misses"] == 0, later
    assert later["builds"]["kernel"] == 0 and later["builds"]["isa_probe"] == 0, later
