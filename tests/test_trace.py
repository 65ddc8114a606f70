"""A traced job: the coordinator's events in tlparse's output and in ``coordinator report``.

One 3-rank gloo job (real processes) runs with both ``TORCH_TRACE`` and
``COORDINATOR_TRACE`` on. The first compiler stalls 3 s, so the other ranks wait for its
graphs; rank 2 then runs a third step at a new batch size, a recompile no other rank
needs. The tests read the same job: the first test to need it runs it (under a file
lock, so that pytest-xdist workers share one run). A second 3-rank job shares one
Inductor cache dir between its ranks, as the ranks of a node do under ``coordinator-run``,
and runs the same graphs on every rank.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_success, run_job

from coordinator.observe.report import load_traces, unmatched_waits, write_report
from coordinator.protocol.node import file_lock


def shared_job(tmp_path_factory, worker_id, name: str, run) -> Path:
    """The directory of a job that ``run(root)`` runs once for all pytest-xdist workers."""
    base = tmp_path_factory.getbasetemp()
    root = (base if worker_id == "master" else base.parent) / name  # shared by the xdist workers
    with file_lock(str(root) + ".lock", None):
        if not (root / "done").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            results = run(root)
            require_success(results)
            (root / "results.json").write_text(json.dumps([r.report for r in results]))
            (root / "logs.json").write_text(json.dumps([r.log for r in results]))
            (root / "done").touch()
    return root


@pytest.fixture(scope="module")
def traced_job(tmp_path_factory, worker_id):
    def run(root):
        options = {"first_compiler": "slow:3", "optimizer": True, "steps": 2}
        env = {"TORCH_TRACE": str(root / "torch-trace"), "COORDINATOR_TRACE": str(root / "trace")}
        return run_job(root, 3, options, env=env, rank_options={2: {"shapes": [8, 8, 12]}})

    return shared_job(tmp_path_factory, worker_id, "traced-job", run)


@pytest.fixture(scope="module")
def node_local_job(tmp_path_factory, worker_id):
    """Four ranks that share their Inductor cache dir, as on a node: one finds in it what another compiled, or
    waits on the node lock while another fetches; three frames (graph breaks) whose compiles
    are slow, so that waiting ranks compile backward graphs early, and skip one that
    another rank compiles."""
    def run(root):
        node = root / "node-cache"
        options = {"model": "broken", "slow_compiles": 1.0, "optimizer": True, "steps": 2}
        return run_job(root, 4, options, env={"COORDINATOR_TRACE": str(root / "trace")},
                       cache_dirs={rank: node for rank in range(4)})

    return shared_job(tmp_path_factory, worker_id, "node-local-job", run)


def assert_row_is_the_ranks_own(row, stats: dict) -> None:
    """The report's row of a rank holds what the rank's own summary and stats() said."""
    assert (row.compiled, row.received, row.local_hits, row.waits, row.rejected) == (
        stats["graphs_compiled"], stats["graphs_received"], stats["graphs_found_in_local_cache"], stats["waits"],
        stats["rejected"]), (row, stats)
    assert (row.bytes_received, row.bytes_published) == (stats["bytes_received"], stats["bytes_published"]), stats
    assert row.waited_s == pytest.approx(stats["waited_s"], abs=0.002) and row.saved_s == pytest.approx(
        stats["compile_time_saved_s"], abs=0.002), (row, stats)


def chromium_events(tlparse_out: Path) -> dict[int, list[dict]]:
    """The coordinator's events of each rank's timeline in tlparse's multi-rank output."""
    by_rank = {}
    for path in tlparse_out.rglob("chromium_events.json"):
        rank_dir = next((part for part in path.relative_to(tlparse_out).parts if part.startswith("rank_")), None)
        if rank_dir is not None:
            events = json.loads(path.read_text())
            by_rank[int(rank_dir.split("_")[1])] = [e for e in events if e.get("cat") == "coordinator"]
    return by_rank


def tlparse_binary() -> str | None:
    """tlparse as installed beside this Python (a venv's), else on the PATH."""
    beside = Path(sys.executable).with_name("tlparse")
    return str(beside) if beside.exists() else shutil.which("tlparse")


def test_tlparse_shows_each_ranks_compiles_waits_and_receives(traced_job, tmp_path):
    tlparse = tlparse_binary()
    if tlparse is None:  # the README's test command installs it (the "test" extra)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "tlparse"], check=True)
        tlparse = tlparse_binary()
    out = tmp_path / "tl_out"
    done = subprocess.run([tlparse, str(traced_job / "torch-trace"), "--all-ranks-html", "-o", str(out),
                           "--overwrite", "--no-browser"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    by_rank = chromium_events(out)
    assert sorted(by_rank) == [0, 1, 2], sorted(p.relative_to(out) for p in out.rglob("chromium_events.json"))
    compiled_by = {e["args"]["key"]: rank for rank, events in by_rank.items()
                   for e in events if e["name"] == "compile"}
    assert any(key.startswith("fx_graph/") for key in compiled_by), by_rank
    # Another rank waited on the compiler's graph and received it; the wait names the compiler.
    waits = [(rank, e) for rank, events in by_rank.items() for e in events if e["name"] == "wait"]
    assert waits, by_rank
    for rank, wait in waits:
        assert wait["args"]["owner"] == compiled_by.get(wait["args"]["key"]) != rank, wait
        assert wait["args"]["ended"] == "received"
        assert any(e["name"] == "receive" and e["args"]["key"] == wait["args"]["key"] for e in by_rank[rank])
    # On each rank's page, beside Dynamo's and Inductor's artifacts.
    pages = "\n".join(p.read_text(errors="replace") for p in out.rglob("*.html"))
    assert "coordinator_compile" in pages and "coordinator_wait" in pages and "coordinator_receive" in pages


def test_report_merges_the_ranks_and_warns_about_a_graph_one_rank_needed(traced_job):
    reports = json.loads((traced_job / "results.json").read_text())
    report = write_report(traced_job / "trace")
    merged = json.loads((traced_job / "trace" / "job.trace.json").read_text())
    events = merged["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2}  # one row per rank
    assert all({"name", "ph", "pid", "tid"} <= set(e) and ("ts" in e or e["ph"] == "M") for e in events)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1", "rank 2"}

    # Every wait is matched to the rank that compiled the graph.
    compiled = {(e["pid"], e["args"]["key"]) for e in events if e["name"] == "compile"}
    waits = [e for e in events if e["name"] == "wait"]
    assert waits and all((e["args"]["owner"], e["args"]["key"]) in compiled for e in waits), waits
    assert not [w for w in report.warnings if "waited" in w], report.warnings

    # The table agrees with each rank's own counters, column for column.
    for row, rank_report in zip(report.rows, reports, strict=True):
        assert_row_is_the_ranks_own(row, rank_report["stats"])
        assert row.first_step_s is not None
    # Rank 2's recompile (batch 12) is a graph no other rank needed: named, with its ranks.
    divergent = [w for w in report.warnings if "never needed it" in w]
    traces = load_traces(traced_job / "trace")

    def needed(rank):
        return {e["args"]["key"] for e in traces[rank]
                if e["name"] in ("compile", "receive") and e["args"]["key"].startswith("fx_graph/")}

    rank2_only = needed(2) - needed(0) - needed(1)
    assert rank2_only and len(divergent) == len(rank2_only), report.warnings
    for key in rank2_only:
        assert any(key in w and "needed by rank 2 only" in w and "ranks 0, 1 never needed it" in w
                   for w in divergent), divergent
    assert {p.name for p in report.written} == {"job.trace.json", "job.png", "job.svg"}

    # The command prints the same.
    done = subprocess.run([sys.executable, "-m", "coordinator.cli", "report", str(traced_job / "trace")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "never needed it" in done.stdout and done.stdout.splitlines()[0].split()[:3] == ["rank", "compiled",
                                                                                          "received"]
    legend = done.stdout.split("columns:\n", 1)[1]
    for column in done.stdout.splitlines()[0].split():  # each column explained once
        assert sum(line.split()[0] == column for line in legend.splitlines() if line.strip()) == 1, column


def test_report_without_matplotlib_writes_the_trace_and_the_table_and_an_empty_dir_is_an_error(traced_job, tmp_path):
    trace = tmp_path / "trace"
    shutil.copytree(traced_job / "trace", trace, ignore=shutil.ignore_patterns("job.*"))
    without_matplotlib = ("import sys; sys.modules['matplotlib'] = None; "
                          "from coordinator.cli import main; sys.exit(main())")
    done = subprocess.run([sys.executable, "-c", without_matplotlib, "report", str(trace)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].split()[:3] == ["rank", "compiled", "received"]
    assert "note: no picture: matplotlib is not installed" in done.stdout
    assert sorted(p.name for p in trace.glob("job.*")) == ["job.trace.json"]
    assert {e["pid"] for e in json.loads((trace / "job.trace.json").read_text())["traceEvents"]} == {0, 1, 2}

    empty = subprocess.run([sys.executable, "-m", "coordinator.cli", "report", str(tmp_path / "nothing")],
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 1 and "no rank traces" in empty.stderr, (empty.stdout, empty.stderr)


@pytest.mark.protocol  # the node's copy and the report: the coordinator's own; the traced job above covers the hooks
def test_report_on_a_node_local_job_warns_of_nothing_and_agrees_with_each_ranks_summary(node_local_job):
    """Every rank ran the same graphs: whether it compiled one, received it from the store or
    the node's copy, or found it in the node's cache dir, it needed it; no warning. The
    table and each rank's summary line count the same events."""
    reports = json.loads((node_local_job / "results.json").read_text())
    logs = json.loads((node_local_job / "logs.json").read_text())
    report = write_report(node_local_job / "trace", picture=False)
    assert report.warnings == [], report.warnings
    assert sum(row.local_hits for row in report.rows) > 0, report.table()  # the shared dir was used
    graphs = {row.compiled + row.received + row.local_hits for row in report.rows}
    assert len(graphs) == 1 and graphs.pop() >= 6, report.table()  # 3 forward, 3 backward graphs, on every rank
    for row, rank_report, log in zip(report.rows, reports, logs, strict=True):
        stats = rank_report["stats"]
        assert_row_is_the_ranks_own(row, stats)
        [line] = [line for line in log.splitlines() if f"compile_once rank {row.rank}: " in line]
        summary = line[line.index("compile_once rank"):]
        assert len(summary) <= 200, summary
        assert f"compiled {row.compiled}, received {row.received}, local {row.local_hits}, " in summary, summary
        assert f"; waits {row.waits} ({row.waited_s:.1f}s); saved {row.saved_s:.1f}s;" in summary, summary


def test_a_wait_is_checked_against_the_rank_it_named():
    """A wait names the rank whose claim it read; a value published before the waiter read
    any claim names nobody, and there is nothing to check."""
    def wait(owner, ended):
        return {"name": "wait", "dur": 1e6, "args": {"key": "fx_graph/abc", "owner": owner, "ended": ended}}

    compiled = {"name": "compile", "args": {"key": "fx_graph/abc"}}
    assert unmatched_waits({0: [compiled], 1: [wait(0, "received"), wait(None, "received")]}) == []
    warned = unmatched_waits({0: [], 1: [wait(0, "received")], 2: [wait(None, "deadline")]})
    assert [w.split(" held by ")[1].split(",")[0] for w in warned] == ["rank 0", "rank None"], warned
