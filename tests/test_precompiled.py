"""Precompiled functions shared through the store (``coordinator.features.precompiled``).

Real jobs: one process per rank, gloo, a ``file://`` store the jobs share; a restart is
a later job on the same store with empty Inductor cache dirs and ``precompile`` on. The
model has a graph break after each layer (three frames), and the batch size changes
(a recompile). "Traced" counts the frames whose bytecode Dynamo traced in the process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import machine_env, require_success

from coordinator.testing import free_port

pytestmark = pytest.mark.skipif(
    __import__("coordinator._compat", fromlist=["x"]).precompile_unsupported() is not None,
    reason="no precompiled functions on this torch")

ON = {"COORDINATOR_PRECOMPILE": "1", "COORDINATOR_SECRET": "job-secret-0123456"}


def packages(store: Path) -> list[Path]:
    return [p for p in store.rglob("*") if p.is_file() and "/v/" in str(p) and "/precompile/" in str(p)]


def precompiled(result) -> dict:
    return result.report["stats"]["precompiled_functions"]


def correct(result, cold=None):
    report = result.report
    torch.testing.assert_close(report["losses"], report["ref_losses"], rtol=1e-4, atol=1e-5)
    if cold is not None:
        assert report["losses"] == cold.report["losses"]
        assert report["grad_norms"] == cold.report["grad_norms"]


def test_restarts_install_functions_without_tracing_and_fall_back_to_tracing(job, tmp_path):
    store = tmp_path / "store"
    bundle = f"file://{tmp_path / 'bundles'}"
    options = {"model": "broken", "store": f"file://{store}", "shapes": [8, 8]}

    def run(name, world=1, env=ON, **changes):
        results = job(world, {**options, **changes}, env=env, name=name)
        require_success(results)
        return results

    # Cold, 2 ranks: one publishes the package of Broken.forward (3 frames with their
    # graphs); every rank traces, as none had it when it called torch.compile.
    cold = run("cold", world=2)
    assert sum(precompiled(r)["published"] for r in cold) == 1, [precompiled(r) for r in cold]
    assert all(r.report["frames_traced"] >= 3 for r in cold)
    for r in cold:
        correct(r)
    assert len(packages(store)) == 1

    # Restart from the store, empty cache dir: installed, nothing traced, no C++ compiler
    # run (the kernels travel with the package), the same training bit for bit. A new
    # batch size fails the guards: traced and recompiled, right, no crash; the grown
    # package is published.
    grown = run("new-shape", shapes=[8, 8, 6], bundle=f"save:{bundle}")[0]
    assert precompiled(grown)["installed"] == 1 and precompiled(grown)["failed"] == 0, precompiled(grown)
    assert grown.report["cpp_builds"]["kernel"] > 0  # the recompile's kernels
    correct(grown)
    assert grown.report["losses"][:2] == cold[0].report["losses"]
    assert precompiled(grown)["published"] == 1
    warm = run("warm", shapes=[8, 8, 6])[0]
    assert warm.report["frames_traced"] == 0, warm.log[-3000:]
    assert warm.report["cpp_builds"]["kernel"] == 0
    assert warm.report["losses"] == grown.report["losses"] and warm.report["grad_norms"] == grown.report["grad_norms"]
    assert precompiled(warm)["installed"] >= 1 and precompiled(warm)["failed"] == 0, precompiled(warm)

    # Another dtype: the guards fail; traced, right, no crash.
    double = run("float64", dtype="float64")[0]
    assert double.report["frames_traced"] >= 3 and precompiled(double)["installed"] == 1
    correct(double)

    # A bundle saved by a job restores the next one, with no store entry: nothing traced.
    restored = run("bundle", store=None, shapes=[8, 8, 6], bundle=f"load:{bundle}")[0]
    assert restored.report["frames_traced"] == 0, restored.log[-3000:]
    assert restored.report["losses"] == grown.report["losses"]

    # A corrupt package, and one signed with another secret: misses, traced, right.
    corrupt_store = tmp_path / "corrupt-store"
    shutil.copytree(store, corrupt_store)
    for path in packages(corrupt_store):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    corrupt = run("corrupt", store=f"file://{corrupt_store}")[0]
    assert corrupt.report["frames_traced"] >= 3 and precompiled(corrupt)["installed"] == 0
    assert "rejected precompiled function" in corrupt.log
    correct(corrupt, cold[0])
    signed = run("other-secret-012345", env={**ON, "COORDINATOR_SECRET": "another-secret-0123"})[0]
    assert signed.report["frames_traced"] >= 3 and precompiled(signed)["installed"] == 0
    correct(signed, cold[0])


def test_an_edited_model_source_is_traced(job, tmp_path):
    # The forward is wrapped as transformers wraps HF models' (tests/decorated.py): the
    # package holds the wrapper's frame, which guards the wrapped function's name.
    source = tmp_path / "model_v.py"
    body = ("import torch\nfrom decorated import renamed_kwarg\n\nclass Model(torch.nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n        self.fc = torch.nn.Linear(16, 4)\n\n"
            "    @renamed_kwarg('inputs', 'x')\n    def forward(self, x):\n        return self.fc(x) * {}\n")
    options = {"model_file": str(source), "store": f"file://{tmp_path / 'store'}", "shapes": [8, 8, 6]}
    source.write_text(body.format(2))
    first = job(1, options, env=ON, name="v1")
    require_success(first)
    assert precompiled(first[0])["published"] >= 1
    same = job(1, options, env=ON, name="v1-again")
    require_success(same)
    assert same[0].report["frames_traced"] == 0 and precompiled(same[0])["failed"] == 0, same[0].log[-3000:]
    assert same[0].report["losses"] == first[0].report["losses"]
    source.write_text(body.format(3))  # same lines, another result
    edited = job(1, options, env=ON, name="v2")
    require_success(edited)
    assert edited[0].report["frames_traced"] >= 1 and precompiled(edited[0])["installed"] == 0
    correct(edited[0])
    assert edited[0].report["losses"] != first[0].report["losses"]


def test_fsdp2_blocks_install_and_train_right_and_ddp_optimizer_frames_are_traced(job, tmp_path):
    store = f"file://{tmp_path / 'store'}"
    # FSDP2 per block (compiled, then sharded): both blocks install the package, merged
    # into one (the blocks share their function, and their inputs differ): nothing traced.
    fsdp = {"model": "blocks", "fsdp_blocks": True, "store": store}
    cold = job(2, fsdp, env=ON, name="fsdp-cold")
    require_success(cold)
    assert sum(precompiled(r)["published"] for r in cold) == 1
    restart = job(2, fsdp, env=ON, name="fsdp-restart")
    require_success(restart)
    for r in restart:
        assert precompiled(r)["installed"] == 2 and precompiled(r)["failed"] == 0, r.log[-3000:]
        assert r.report["frames_traced"] == 0, r.log[-3000:]
        assert r.report["losses"] == cold[r.rank].report["losses"]

    # DDPOptimizer splits the frame: torch packages nothing for it; traced, no error.
    ddp = {"model": "split_mlp", "ddp": True, "bucket_cap_mb": 1, "store": store}
    ddp_cold = job(1, ddp, env=ON, name="ddp-cold")
    require_success(ddp_cold)
    ddp_restart = job(1, ddp, env=ON, name="ddp-restart")
    require_success(ddp_restart)
    assert ddp_restart[0].report["frames_traced"] >= 1
    assert ddp_restart[0].report["losses"] == ddp_cold[0].report["losses"]
    assert "not installed" not in ddp_restart[0].log or precompiled(ddp_restart[0])["failed"] == 0


def test_each_mend_gives_what_torchs_own_path_gives(tmp_path):
    """``_compat.precompile``'s mends against torch's own path, in a fresh process."""
    env = dict(os.environ, **machine_env(tmp_path), MASTER_PORT=str(free_port()),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "precompile_mends.py")], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    # A guard state that does not pickle crashed torch's compile; now compiled, not packaged.
    compiled, eager, no_package = found["unpicklable_guard"]
    assert compiled == eager and no_package
    # The tensor of a guard state: as torch's, and a placeholder gradient (which torch's
    # own unpickler refuses) read back as none.
    assert found["torch_missing_grad"] == "TypeError"
    ours, torchs, with_placeholder = found["tensor"]
    assert ours == torchs == with_placeholder
    # FSDP2's class: made early, fully_shard gives it to the module; made the same way
    # (name, module, base, deepcopy) as fully_shard makes one; one made by fully_shard is reused.
    same_class, made_early, made_by_torch, reused = found["fsdp"]
    assert same_class and reused and made_early[1:] == made_by_torch[1:]
