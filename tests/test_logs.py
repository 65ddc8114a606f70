"""What a user sees with no logging set up: each rank's summary on stderr, once, under every
entry point; the user's own logging configuration, where set, instead.

Marked ``protocol``: the coordinator's own log lines, on jobs whose torch hooks the other
tests pass through on every torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import machine_env

pytestmark = pytest.mark.protocol

PLAIN = str(Path(__file__).with_name("plain_script.py"))

#: A training script that enters compile_once itself and configures no logging (with
#: ``--configure``, it configures the root logger first; with ``--alone``, it runs as one
#: process with no process group, on a directory store).
SCRIPT = textwrap.dedent("""
    import logging
    import sys

    import torch
    import torch.distributed as dist

    import coordinator

    if "--configure" in sys.argv:
        logging.basicConfig(level=logging.INFO, format="USER %(name)s | %(message)s")
    alone = "--alone" in sys.argv
    if not alone:
        dist.init_process_group("gloo")
    with coordinator.compile_once(sys.argv[-1] if alone else None):
        f = torch.compile(lambda x: (x * 2 + 1).relu().sum())
        f(torch.randn(16))
    if not alone:
        dist.barrier()
        dist.destroy_process_group()
""")


def run(args: list[str], tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # An empty Inductor cache dir of the test's own (the node's, shared by its ranks), whatever
    # this process's environment says: the one graph is compiled once, by one rank.
    full_env = dict(os.environ, **machine_env(tmp_path), TORCHINDUCTOR_COMPILE_THREADS="1",
                    TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), **(env or {}))
    for name in ("COORDINATOR_LOG_LEVEL", "COORDINATOR_STORE", "TRITON_CACHE_DIR"):
        if not (env and name in env):
            full_env.pop(name, None)
    return subprocess.run([sys.executable, *[str(script) if a == "SCRIPT" else a for a in args]], env=full_env,
                          capture_output=True, text=True, timeout=240)


def summaries(stderr: str, rank: int) -> list[str]:
    return [line for line in stderr.splitlines() if f"compile_once rank {rank}: compiled " in line]


@pytest.mark.parametrize("launcher", ["torch.distributed.run", "coordinator.jobs.launcher"])
def test_each_rank_summary_once_with_no_logging_set_up(tmp_path, launcher):
    """Plain torchrun with compile_once in the script, and coordinator-run with the script
    joining the worker's session: each rank's summary on stderr exactly once, after its rank."""
    result = run(["-m", launcher, "--standalone", "--nproc-per-node", "2", "SCRIPT"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        lines = summaries(result.stderr, rank)
        assert len(lines) == 1, result.stderr[-3000:]
        assert lines[0].startswith(f"[rank{rank}]:coordinator: compile_once rank {rank}: compiled "), lines
    # One graph, compiled by one rank and received by the other.
    assert sum(int(summaries(result.stderr, r)[0].split("compiled ")[1].split(",")[0]) for r in (0, 1)) == 1


def test_a_script_that_knows_nothing_of_the_coordinator_shows_each_summary_once(tmp_path):
    out = tmp_path / "reports"
    out.mkdir()
    result = run(["-m", "coordinator.jobs.launcher", "--standalone", "--nproc-per-node", "2", PLAIN, str(out)],
                 tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        lines = summaries(result.stderr, rank)
        assert len(lines) == 1 and lines[0].startswith(f"[rank{rank}]:coordinator: compile_once rank {rank}: ")


def test_the_users_logging_configuration_governs_and_nothing_is_printed_twice(tmp_path):
    result = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "SCRIPT", "--configure"],
                 tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        lines = summaries(result.stderr, rank)
        assert len(lines) == 1, result.stderr[-3000:]
        assert lines[0].startswith(f"USER coordinator.api | compile_once rank {rank}: "), lines
    assert "]:coordinator: " not in result.stderr


@pytest.mark.parametrize("level, shown", [(None, True), ("WARNING", False), ("DEBUG", True)])
def test_a_lone_process_shows_its_summary_at_the_log_level(tmp_path, level, shown):
    env = {"COORDINATOR_LOG_LEVEL": level} if level else {}
    result = run(["SCRIPT", "--alone", f"file://{tmp_path / 'store'}"], tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = summaries(result.stderr, 0)
    assert len(lines) == shown, result.stderr[-3000:]
    if shown:
        assert lines[0].startswith("[rank0]:coordinator: compile_once rank 0: compiled 1, ")
    assert (" details: " in result.stderr) == (level == "DEBUG")


def test_a_bad_log_level_is_refused_naming_the_variable(tmp_path):
    result = run(["SCRIPT", "--alone", f"file://{tmp_path / 'store'}"], tmp_path, env={"COORDINATOR_LOG_LEVEL": "LOUD"})
    assert result.returncode != 0
    assert "COORDINATOR_LOG_LEVEL=LOUD: expected one of DEBUG, INFO, WARNING, ERROR" in result.stderr
