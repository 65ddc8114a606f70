"""Inductor's one-time set-up ahead of the first compile (``coordinator.features.inductor_setup``).

Real processes (``tests/inductor_setup_job.py``) compile a small MLP's training step: stock,
without the coordinator; ours, inside ``compile_once`` with a ``file://`` store, once with the
script waiting after ``torch.compile`` (the set-up ends before the first frame), once
compiling at once (the frame stops the set-up and waits for the step under way), and once as
a restart from the same store (no set-up). Every run computes the same outputs and gradients,
bit for bit, and Inductor's pattern matcher matches the same patterns as stock's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import machine_env

JOB = str(Path(__file__).with_name("inductor_setup_job.py"))
STEPS = {"import compile_fx", "torch_key"}


def run(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COORDINATOR_", "TORCHINDUCTOR_CACHE_DIR"))}
    env.update(machine_env(tmp_path / name), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"{name}-inductor"),
               TORCHINDUCTOR_COMPILE_THREADS="1")
    done = subprocess.run([sys.executable, JOB, str(out), *args], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_setup_runs_before_the_first_compile_and_changes_nothing_it_compiles(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    stock = run(tmp_path, "stock")
    ahead = run(tmp_path, "ahead", "--store", store, "--wait", "8")
    at_once = run(tmp_path, "at-once", "--store", f"file://{tmp_path / 'other-store'}")
    restart = run(tmp_path, "restart", "--store", store)
    for ours in (ahead, at_once, restart):
        assert (ours["output"], ours["grads"]) == (stock["output"], stock["grads"])
        assert "coordinator-setup" not in ours["threads"]  # the set-up's thread ended
    for ours in (ahead, at_once):  # cold: every pattern matched as in stock's compile
        assert ours["patterns"] == stock["patterns"] and ours["fx_misses"] == stock["fx_misses"] > 0
    # Done before the frame came: every step taken, none waited for.
    assert set(ahead["setup"]["steps"]) == STEPS and ahead["setup"]["waited_s"] == 0, ahead["setup"]
    # The frame came at once: the steps taken before it are the first ones, in order.
    taken = list(at_once["setup"]["steps"])
    assert taken == ["import compile_fx", "torch_key"][:len(taken)], at_once["setup"]
    # A restart whose entries are in the store: no set-up.
    assert restart["setup"]["skipped"] == "a restart" and restart["setup"]["steps"] == {}, restart["setup"]
    assert restart["fx_misses"] == 0
