"""Triton kernels outside Inductor, compiled and tuned once per job (``coordinator.features.triton_kernels``).

Each rank is a real process (``tests/triton_kernel_job.py``) that calls a ``@triton.jit``
kernel and an ``@triton.autotune``d one through Triton's own ``JITFunction.run`` and
``Autotuner.run``: Triton compiles real cubins for an ``sm_90`` target on this CPU machine
and asks its cache manager as it does on a GPU. The ranks share a real store (a directory,
or a Redis port nobody listens on for the dead store).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from coordinator.observe.report import write_report
from coordinator.testing import free_port

pytest.importorskip("triton", reason="Triton is installed with torch's CUDA builds (CI's second torch)")

JOB = Path(__file__).with_name("triton_kernel_job.py")
INSTALL_JOB = Path(__file__).with_name("triton_install_job.py")
CONFIGS = 6


def _env(tmp_path: Path, rank: int, name: str, node: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COORDINATOR_", "TRITON_"))}
    # A node's ranks share an Inductor cache dir, where the node keeps its copy of what it
    # fetched or published.
    return {**env, "RANK": str(rank), "WORLD_SIZE": "3", "TRITON_CACHE_DIR": str(tmp_path / f"{name}-rank{rank}"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"{name}-{node}-inductor"), "TMPDIR": str(tmp_path), **extra}


def _job(tmp_path: Path, store: str, ranks: int, name: str, *args: str, per_rank: dict | None = None,
         own_nodes: bool = False, **extra: str) -> list[dict]:
    """Run ``ranks`` rank processes at once, each on an empty Triton cache dir of its own
    (``per_rank``: more arguments of some ranks), on one node (``own_nodes``: each on its own)."""
    per_rank = per_rank or {}
    procs = [subprocess.Popen([sys.executable, str(JOB), store, "--configs", str(CONFIGS), *args,
                               *per_rank.get(rank, ())],
                              env=_env(tmp_path, rank, name, f"node{rank}" if own_nodes else "node", **extra),
                              stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(ranks)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        result = json.loads(out.strip().splitlines()[-1])
        result["stderr"] = err
        results.append(result)
    return results


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict:
    """What one rank compiles and benchmarks without the coordinator."""
    tmp_path = tmp_path_factory.mktemp("alone")
    (result,) = _job(tmp_path, "unused", 1, "alone", "--no-session")
    assert Counter(result["compiles"]) == {"scale": 1, "shift": CONFIGS}, result
    assert result["benchmarked"] == CONFIGS and result["module_builds"] == 1
    return result


def test_three_ranks_compile_each_kernel_and_run_each_tuning_once(tmp_path, alone):
    """Three ranks at once: each kernel is compiled by one rank and each tuning run by one,
    the waiting ranks compiling configs of the tuning for it; all of them run the same
    config and hold the same cubins. A restart on empty dirs compiles and benchmarks nothing."""
    store = f"file://{tmp_path / 'store'}"
    # Three ranks of one host (a thread each for configs on this 2-core machine) reach the
    # tuned kernel together; each compile takes long enough (0.3 s more) for the waiting
    # ranks to come while the tuner still compiles its configs, however fast the machine.
    trace = tmp_path / "trace"
    results = _job(tmp_path, store, 3, "job", "--bench-s", "0.2", "--compile-s", "0.3",
                   "--barrier", str(tmp_path / "meet"),
                   LOCAL_WORLD_SIZE="3", COORDINATOR_TRACE=str(trace))
    compiles = Counter(name for r in results for name in r["compiles"])
    assert compiles == Counter(alone["compiles"]), [r["compiles"] for r in results]  # the ranks' sum: one rank's
    assert sum(r["benchmarked"] for r in results) == alone["benchmarked"]
    assert sum(r["module_builds"] for r in results) == 1  # a host module too
    assert {r["best"] for r in results} == {alone["best"]}
    cubins: dict[str, set[str]] = {}
    for r in results:
        for path, digest in r["cubins"].items():
            cubins.setdefault(path, set()).add(digest)
    assert all(len(digests) == 1 for digests in cubins.values()), cubins  # one binary per kernel key
    assert len(cubins) == 1 + CONFIGS and all(len(r["cubins"]) >= 2 for r in results), cubins
    # Configs compiled at once in threads are Triton's own compiles: the same kernels, bit for bit.
    assert {path: next(iter(digests)) for path, digests in cubins.items()} == alone["cubins"]
    assert "coordinator-triton" in {name for r in results for name in r["compile_threads"]}, results
    assert all(r["failed_futures"] == 0 for r in results)  # configs left to other ranks are not cached as failures
    stats = [r["stats"] for r in results]
    assert sum(s["triton_kernels_compiled"] for s in stats) == 1 + CONFIGS + 1, stats
    assert sum(s["triton_tunings_run"] for s in stats) == 1 and sum(s["triton_tunings_received"] for s in stats) == 2
    assert all(s["triton_kernels_compiled"] + s["triton_kernels_received"] >= 2 for s in stats), stats
    # The ranks that waited for the tuning compiled configs of it meanwhile.
    tuner = next(s for s in stats if s["triton_tunings_run"])
    assert sum(s["triton"]["configs_compiled_ahead"] for s in stats if s is not tuner) >= 1, stats
    assert tuner["triton_kernels_received"] >= 1, tuner
    assert all("triton compiled" in r["stderr"] for r in results)  # the summary line counts them
    assert all(s["triton"]["device"] == "cpu" for s in stats)
    # The report counts them as the ranks did, and names the device kind tunings were shared within.
    report = write_report(trace, picture=False)
    rows = {row.rank: row for row in report.triton}
    for s in stats:
        row = rows[s["rank"]]
        assert (row.compiled, row.received, row.tuned, row.tunings_received) == (
            s["triton_kernels_compiled"], s["triton_kernels_received"], s["triton_tunings_run"],
            s["triton_tunings_received"]), (row, s)
    assert {row.device for row in report.triton} == {"cpu"} and "shared within" in report.triton_table()

    (restart,) = _job(tmp_path, store, 1, "restart")
    assert restart["compiles"] == [] and restart["benchmarked"] == restart["module_builds"] == 0, restart
    assert restart["best"] == alone["best"] and restart["cubins"].items() <= alone["cubins"].items()
    assert restart["stats"]["triton_tunings_received"] == 1, restart["stats"]


def test_a_tampered_triton_entry_is_a_miss(tmp_path, alone):
    """Every Triton entry altered in the store: a later rank refuses each, warns, and
    compiles and tunes everything itself."""
    store_dir = tmp_path / "store"
    (first,) = _job(tmp_path, f"file://{store_dir}", 1, "first")
    assert Counter(first["compiles"]) == Counter(alone["compiles"])
    values = [p for p in store_dir.glob("v/*/*/*/triton*/*") if p.is_file()]
    assert len(values) == 1 + CONFIGS + 1 + 1, values  # the kernels, the host module and the tuning
    for path in values:
        blob = path.read_bytes()
        path.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    (second,) = _job(tmp_path, f"file://{store_dir}", 1, "second")
    assert Counter(second["compiles"]) == Counter(alone["compiles"]) and second["benchmarked"] == CONFIGS
    assert second["module_builds"] == 1
    assert second["stats"]["rejected"] >= 2 and second["stats"]["triton_kernels_received"] == 0, second["stats"]
    assert "rejected triton" in second["stderr"]


def test_a_dead_store_means_local_triton_compiles(tmp_path, alone):
    """A Redis port nobody listens on: each rank, on a node of its own, compiles and tunes
    everything itself, and the job ends."""
    results = _job(tmp_path, f"redis://127.0.0.1:{free_port()}/0", 2, "dead", own_nodes=True)
    for r in results:
        assert Counter(r["compiles"]) == Counter(alone["compiles"]) and r["benchmarked"] == CONFIGS, r
        assert r["stats"]["store_failed"] and r["stats"]["triton_kernels_received"] == 0, r["stats"]


def test_a_users_own_triton_cache_manager_is_left_alone(tmp_path, alone):
    """``TRITON_CACHE_MANAGER`` set by the user: Triton keeps asking the user's manager, the
    session says it steps aside, and nothing of Triton's reaches the store."""
    store_dir = tmp_path / "store"
    calls = tmp_path / "calls.txt"
    manager = Path(__file__).with_name("triton_user_manager.py")
    results = _job(tmp_path, f"file://{store_dir}", 2, "users", TRITON_CACHE_MANAGER="triton_user_manager:Recording",
                   PYTHONPATH=str(manager.parent), RECORDED_CALLS=str(calls))
    for r in results:
        assert Counter(r["compiles"]) == Counter(alone["compiles"]), r
        assert r["stats"]["triton"] is None and r["stats"]["triton_kernels_compiled"] == 0, r["stats"]
        assert "the user's own (triton_user_manager:Recording)" in r["stderr"], r["stderr"][-2000:]
    assert calls.read_text().count("get_group") >= 2 * (1 + CONFIGS)
    assert not list(store_dir.glob("v/*/*/*/triton*"))


def test_a_users_manager_set_after_the_session_began_is_kept(tmp_path, alone):
    """``TRITON_CACHE_MANAGER`` set by the script after ``import torch`` (the session's class
    is on Triton's knob by then): Triton builds the user's manager from then on, the session
    says so, nothing of Triton's reaches the store, and at exit the knob gives the user's class."""
    store_dir = tmp_path / "store"
    calls = tmp_path / "calls.txt"
    manager = Path(__file__).with_name("triton_user_manager.py")
    (result,) = _job(tmp_path, f"file://{store_dir}", 1, "late", "--user-manager-late", "triton_user_manager:Recording",
                     PYTHONPATH=str(manager.parent), RECORDED_CALLS=str(calls))
    assert Counter(result["compiles"]) == Counter(alone["compiles"]), result
    assert result["stats"]["triton_kernels_compiled"] == 0, result["stats"]
    assert "user's own (triton_user_manager:Recording), set after the session began" in result["stderr"]
    assert calls.read_text().count("get_group") >= 1 + CONFIGS
    assert not list(store_dir.glob("v/*/*/*/triton*"))
    assert result["manager_after"] == "triton_user_manager:Recording"


def test_a_bundle_carries_triton_kernels_and_tunings(tmp_path, alone):
    """A job's bundle holds the Triton kernels and tunings it compiled outside Inductor: a
    later job on empty dirs that installs it, with no session, compiles and benchmarks nothing."""
    bundles = f"file://{tmp_path / 'bundles'}"
    (first,) = _job(tmp_path, f"file://{tmp_path / 'store'}", 1, "first", "--save-bundle", bundles)
    assert Counter(first["compiles"]) == Counter(alone["compiles"])
    (later,) = _job(tmp_path, "unused", 1, "later", "--no-session", "--load-bundle", bundles)
    assert later["compiles"] == [] and later["benchmarked"] == later["module_builds"] == 0, later
    assert later["best"] == alone["best"] and later["cubins"].items() <= first["cubins"].items()


@pytest.mark.parametrize("held", [False, True], ids=["dropped", "held-with-the-collector-off"])
def test_a_compile_that_fails_releases_the_ranks_waiting_for_it(tmp_path, alone, held):
    """The rank that claimed a kernel fails to compile it (a fault injected into Triton's first
    stage): the ranks waiting for it are released at once and compile it themselves, long
    before their deadline, and the failed rank's next call gets the kernel. So too when the
    failed rank keeps the error (its traceback holds Triton's frames) with the collector off:
    the claim ends where it was taken, not when Python frees the compile's objects."""
    began = time.monotonic()
    failing = ("--fail-first-compile", "3", *(("--hold-failure",) if held else ()))
    results = _job(tmp_path, f"file://{tmp_path / 'store'}", 3, "failed", "--barrier", str(tmp_path / "meet"),
                   per_rank={0: failing, 1: ("--start-after", "1"), 2: ("--start-after", "1")},
                   COORDINATOR_WAIT_TIMEOUT_S="120")
    assert time.monotonic() - began < 90
    failed, *waiters = results
    assert failed["failures"] == ["injected: the compile failed"], failed
    assert all(r["stats"]["waits"] >= 1 for r in waiters), [r["stats"] for r in waiters]
    assert all(any(path.endswith("/scale.cubin") for path in r["cubins"]) for r in results), results
    assert all(Counter(r["compiles"]).get("shift", 0) + r["stats"]["triton_kernels_received"] >= 1 for r in results)


def test_concurrent_installs_never_leave_a_mixed_or_partial_group(tmp_path):
    """Three processes install their own bytes of the same kernels into one Triton cache dir,
    while another writes them as Triton does when it compiles one itself and two more read
    them as Triton does: every group a reader gets is whole and one writer's, and every
    group an installer is handed is its own, complete."""
    rounds = 60
    start = tmp_path / "start"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COORDINATOR_", "TRITON_"))}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "shared-triton")
    roles = [("install", "a"), ("install", "b"), ("install", "c"), ("triton", "t"), ("read", "r1"), ("read", "r2")]
    procs = [subprocess.Popen([sys.executable, str(INSTALL_JOB), role, writer, str(rounds), str(start)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for role, writer in roles]
    time.sleep(1.0)  # every process imported Triton and waits
    start.touch()
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for report in reports:
        assert report["mixed"] == [] and report["partial"] == [], report
    installers = [r for r in reports if r["role"] == "install"]
    readers = [r for r in reports if r["role"] == "read"]
    assert all(r["groups"] + r["refused"] == rounds for r in installers), installers
    assert sum(r["groups"] for r in installers) >= rounds, installers  # each round, some installer's group
    assert all(r["rounds_seen"] == rounds and r["groups"] >= rounds for r in readers), readers


def test_an_autotuner_is_changed_once_and_launches_through_tritons_own_run(tmp_path, monkeypatch):
    """The session changes an autotuner at its first launch, not at every one: from then on
    ``autotuner.run`` is Triton's own (nothing of the session's runs per launch), its result
    caching is on while the session runs, and at the end it is as it was."""
    import torch
    import triton
    import triton.language as tl
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner

    import coordinator
    from coordinator.testing import NoGPUDriver

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    tuned = triton.autotune(configs=[triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})], key=["n"],
                            do_bench=lambda call, quantiles=None: (call(), [1.0] * 3)[1])(add_one)
    x = torch.zeros(256)
    before = driver._active  # no default driver on a machine without a GPU: put back what was there
    driver.set_active(NoGPUDriver())
    try:
        assert not tuned.cache_results
        with coordinator.compile_once(store=f"file://{tmp_path / 'store'}"):
            wrapped = Autotuner.run  # the session's, for first launches
            tuned.run(x, 256, grid=(1,), warmup=True)
            assert tuned.cache_results and tuned.__dict__["run"].__func__ is not wrapped
            own_run = tuned.__dict__["run"]
            tuned.run(x, 256, grid=(1,), warmup=True)
            assert tuned.__dict__["run"] is own_run  # nothing changed at the second launch
            stats = coordinator.stats()
        assert "run" not in tuned.__dict__ and not tuned.cache_results
        assert stats["triton_tunings_run"] == 1, stats
    finally:
        driver._active = before
