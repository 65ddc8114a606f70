"""Every example runs on CPU with gloo, 2 ranks, 2 steps, and compiles each graph once, under
torchrun and, unchanged, under ``coordinator-run`` (which has already entered ``compile_once``
in each worker when the script enters it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import machine_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def job_output(result: subprocess.CompletedProcess) -> str:
    """What a failed job printed: its stdout's end, and its stderr's without Python's list
    of extension modules (a fatal error's dump ends with it, and hid the error's own line)."""
    stderr = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("Extension modules:"))
    return f"stdout:\n{result.stdout[-1500:]}\nstderr:\n{stderr[-4000:]}"


def aborted_at_exit_after_its_work(result: subprocess.CompletedProcess) -> bool:
    """torch's own gloo exit abort (docs/operations.md, "A line that is torch's"): every rank
    ended its session (its summary line) and the job printed its results, then one rank died
    of SIGABRT with ``terminate called without an active exception`` while the interpreter
    finalized, and the launcher reported it. Any other failure is a failure."""
    summaries = [result.stderr.count(f"compile_once rank {rank}: ") for rank in (0, 1)]
    return (all(count >= 1 for count in summaries)
            and "terminate called without an active exception" in result.stderr
            and re.search(r"exitcode\s*: -6 ", result.stderr) is not None
            and ("FX graphs compiled across ranks" in result.stdout or "graphs compiled," in result.stdout))


@pytest.mark.parametrize("launcher", [
    "torch.distributed.run",
    # The launcher's own tests are protocol tests: CI runs them on one torch.
    pytest.param("coordinator.jobs.launcher", marks=pytest.mark.protocol),
])
@pytest.mark.parametrize(
    "script, args",
    [
        ("train.py", ["--steps", "2", "--layers", "1", "--dim", "32", "--seq", "16"]),
        # FSDP2 and graph breaks pass through hooks the suite covers on every torch (the Qwen
        # FSDP2 model, every multi-frame job): one torch.
        pytest.param("fsdp2.py", ["--steps", "2"], marks=pytest.mark.one_torch),
        pytest.param("graph_break.py", ["--steps", "2"], marks=pytest.mark.one_torch),
    ],
)
def test_example_compiles_each_graph_once(tmp_path, launcher, script, args):
    env = dict(os.environ, **machine_env(tmp_path))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    result = subprocess.run(
        [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", "2", str(EXAMPLES / script), *args],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0 or aborted_at_exit_after_its_work(result), job_output(result)
    if launcher == "coordinator.jobs.launcher":  # one session per worker: the launcher's, which the script joined
        for rank in (0, 1):
            assert result.stderr.count(f"compile_once rank {rank}: ") == 1, result.stderr[-3000:]
    if script == "train.py":
        match = re.search(r"FX graphs compiled across ranks: (\d+)", result.stdout)
        assert match and int(match.group(1)) > 0, result.stdout
        received = [int(m) for m in re.findall(r"^\s+\d+\s+[\d.]+\s+\d+\s+(\d+)", result.stdout, re.M)]
        assert sum(received) == int(match.group(1)), result.stdout  # 2 ranks: the other rank's graphs
    else:
        pattern = r"rank \d: (\d+) graphs compiled, (\d+) received"
        counts = [tuple(map(int, m)) for m in re.findall(pattern, result.stdout)]
        assert len(counts) == 2, result.stdout
        # Each graph compiled once, by whichever rank claimed it first; every rank has all.
        unique = counts[0][0] + counts[0][1]
        assert unique > 0 and all(c + r == unique for c, r in counts), counts
        assert sum(c for c, _ in counts) == unique, counts
