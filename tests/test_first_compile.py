"""A process that compiles nothing pays nothing; one that compiles later still shares.

Real jobs of two rank processes (gloo, ``torchrun`` or ``coordinator-run``) run
``tests/first_compile_job.py``. A job that trains eagerly and never compiles, under
``coordinator-run`` or inside ``compile_once()``, is compared with the same job under plain
``torchrun``: no Dynamo, Inductor, Redis or Triton module loaded but those stock's loads (none
for a job of collectives alone; torch's optimizers and DDP import Dynamo themselves), no
thread, no process, no store opened (a ``file://`` store's directory is never made; the job's TCPStore holds the
keys stock's holds), no summary line, and the environment and ``sys.path`` exactly as
stock's from the script's first line to its end. A job that compiles only after its eager
steps, through ``torch.compile`` or through Dynamo alone (``torch._dynamo.optimize``, the
trigger that fires inside Dynamo's compile), still compiles each graph once in the job:
the other rank receives every entry. A library's ``torch.compile`` at its import, whose
function never runs, starts nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import machine_env

JOB = str(Path(__file__).with_name("first_compile_job.py"))
#: What torchrun gives each run its own value of.
PER_RUN = ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")
HAS_TRITON = __import__("importlib.util").util.find_spec("triton") is not None


def job(tmp_path: Path, name: str, launcher: str, *args: str, env: dict | None = None) -> list[dict]:
    """Run the job's two ranks; each rank's record, by rank."""
    workdir = tmp_path / name
    workdir.mkdir()
    module = {"stock": "torch.distributed.run", "ours": "coordinator.jobs.launcher"}[launcher]
    # Inductor's and Triton's dirs left unset, as most users leave them: Inductor's default is
    # in the job's TMPDIR.
    unset = ("COORDINATOR_", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(unset)}
    full_env.update(machine_env(workdir), TORCHINDUCTOR_COMPILE_THREADS="1", FIRST_JOB_OUT=str(workdir), **(env or {}))
    done = subprocess.run([sys.executable, "-m", module, "--standalone", "--nproc-per-node", "2", JOB, *args],
                          cwd=workdir, env=full_env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads((workdir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for record in records:
        record["stderr"] = done.stderr
        for phase in ("first_env", "after_import_env", "end_env", "env_in_compile_once"):
            if phase in record:  # each job's own dir, as this test gave it
                record[phase] = {k: v.replace(str(workdir), "<job>") for k, v in record[phase].items()}
    return records


def without_per_run(env: dict) -> dict:
    return {k: v for k, v in env.items() if k not in PER_RUN}


@pytest.mark.parametrize("mode", ["collectives", "eager"])
def test_a_job_that_never_compiles_pays_nothing(tmp_path, mode):
    """``collectives``: the job imports no Dynamo or Inductor module of its own, and none is
    loaded; ``eager`` (DDP and an optimizer, which import Dynamo as without us): the modules
    stock's job loads, no more."""
    triton = ("--import-triton",) if HAS_TRITON else ()
    store = tmp_path / "file-store"
    stock = job(tmp_path, "stock", "stock", mode, *triton)
    ours = job(tmp_path, "ours", "ours", mode, *triton)
    ours_file = job(tmp_path, "ours-file", "ours", mode, *triton, env={"COORDINATOR_STORE": f"file://{store}"})
    in_script = job(tmp_path, "in-script", "stock", mode, "--compile-once", f"file://{store}", *triton)
    in_script_c10d = job(tmp_path, "in-script-c10d", "stock", mode, "--compile-once", "default", *triton)
    for runs in (ours, ours_file, in_script, in_script_c10d):
        for mine, theirs in zip(runs, stock, strict=True):
            seen = mine["before_compile"]
            assert seen == theirs["before_compile"]
            if mode == "collectives":  # Triton's modules only where the script imported Triton
                assert all(name.split(".")[0] == "triton" for name in seen["modules"]), seen["modules"]
            assert seen["children"] == [] and seen["threads"] == ["MainThread"]
            assert not mine["started"] and mine["loss"] == theirs["loss"]
            assert "compile_once rank" not in mine["stderr"]  # no summary of a session that never started
            assert mine.get("stats", {}).get("store_calls", 0) == 0
            assert mine["first_path"] == theirs["first_path"]
            for phase in ("first_env", "after_import_env", "end_env"):
                env = without_per_run(mine[phase])
                if runs is ours_file:  # the setting the user gave stays, as they gave it
                    assert env.pop("COORDINATOR_STORE") == f"file://{store}"
                assert env == without_per_run(theirs[phase]), phase
    for mine in in_script + in_script_c10d:
        assert without_per_run(mine["env_in_compile_once"]) == without_per_run(mine["first_env"])
    assert not store.exists()  # the file:// store was never opened
    # The job's own store: the keys stock's job leaves, none of ours.
    assert ours[0]["store_keys"] == in_script_c10d[0]["store_keys"] == stock[0]["store_keys"]
    if HAS_TRITON:  # Triton imported after the session began: its manager is the session's, unused
        assert {r["triton_manager"] for r in ours + in_script} == {"CoordinatorCacheManager"}
        assert {r["triton_manager"] for r in stock} == {None}


def test_a_librarys_compile_at_import_starts_nothing(tmp_path):
    """A library that decorates a helper with ``torch.compile`` as it is imported (flash-
    linear-attention's activations do) and never runs it: the modules ``torch.compile``
    imports are imported, as without us, and nothing else: no thread, no process, no summary."""
    stock = job(tmp_path, "stock", "stock", "library")
    ours = job(tmp_path, "ours", "ours", "library")
    for mine, theirs in zip(ours, stock, strict=True):
        assert mine["before_compile"] == theirs["before_compile"]  # the modules stock's call loads, no more
        assert mine["before_compile"]["threads"] == ["MainThread"] and not mine["before_compile"]["children"]
        assert not mine["started"] and "compile_once rank" not in mine["stderr"]


@pytest.mark.parametrize("mode", ["compile", "optimize"])
def test_a_job_that_compiles_after_its_eager_steps_shares_every_graph(tmp_path, mode):
    """The compile comes after two eager DDP steps, when the session has done nothing: one
    rank compiles each graph and the other receives it, through ``torch.compile`` (the part
    starts at the call) and through Dynamo alone (it starts inside Dynamo's compile, before
    the frame is traced)."""
    stock = job(tmp_path, "stock", "stock", mode)
    ours = job(tmp_path, "ours", "ours", mode)
    assert [r["output"] for r in ours] == [r["output"] for r in stock]
    assert all(not r["before_compile"]["started"] and r["started"] for r in ours)
    compiled = [r["stats"]["graphs_compiled"] for r in ours]
    received = [r["stats"]["graphs_received"] for r in ours]
    assert sum(compiled) == 1 and sum(received) == 1, (compiled, received)
    for rank in (0, 1):
        assert ours[0]["stderr"].count(f"[rank{rank}]:coordinator: compile_once rank {rank}: ") == 1


@pytest.mark.parametrize("given", [None, "relative/inductor"])
def test_inductor_s_cache_dir_is_named_as_inductor_names_it(tmp_path, given):
    """The session names Inductor's cache dir without importing Inductor
    (``_compat.inductor_cache_dir``): the same dir as Inductor's own ``cache_dir()``, in a
    fresh process, with the variable unset (its default, under the process's TMPDIR) or set
    (relative to the working dir); and naming it sets nothing and makes no dir."""
    code = ("import json, os, sys; from coordinator import _compat; ours = _compat.inductor_cache_dir();"
            "untouched = os.environ.get('TORCHINDUCTOR_CACHE_DIR'), os.path.exists(ours), "
            "'torch._inductor' in sys.modules;"
            "from torch._inductor.runtime.cache_dir_utils import cache_dir;"
            "print(json.dumps([ours, cache_dir(), untouched]))")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["TMPDIR"] = str(tmp_path)
    if given is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = given
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    ours, inductors, untouched = json.loads(done.stdout.strip().splitlines()[-1])
    assert ours == inductors and ours.startswith(str(tmp_path))
    assert untouched == [given, False, False]


def test_a_patch_of_a_module_not_imported_yet_comes_in_at_its_import(tmp_path, monkeypatch):
    """``_compat.once_imported``: a module never imported is neither imported nor patched; one
    imported inside the block is patched from its import to the block's end, and a module
    imported already is patched at once (Inductor's template selection: about a second to
    import, which a job that selects no template never pays)."""
    import contextlib
    import importlib

    from coordinator._compat.imports import once_imported

    (tmp_path / "late_module.py").write_text("VALUE = 'own'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "late_module", raising=False)

    @contextlib.contextmanager
    def patch():
        module = sys.modules["late_module"]
        module.VALUE = "patched"
        yield
        module.VALUE = "own"

    with once_imported("late_module", patch):
        assert "late_module" not in sys.modules  # not imported to be patched
    with once_imported("late_module", patch):
        module = importlib.import_module("late_module")
        assert module.VALUE == "patched"
    assert module.VALUE == "own" and not any(getattr(f, "name", None) == "late_module" for f in sys.meta_path)
    with once_imported("late_module", patch):  # imported already: at once
        assert module.VALUE == "patched"
    assert module.VALUE == "own"
