"""benchmarks/tools/recompile_probe.py's summary, on records and cache entries shaped like a GPU run's."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recompile_probe


def kernel_hash(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def record(where: str, name: str, file: str, compiled: bool = True) -> dict:
    return {"where": where, "kernel": "triton_mm", "file": file, "hash": kernel_hash(name), "compiled": compiled,
            "seconds": 1.0}


def entry(ttir: str, warps: int, stages: int) -> dict:
    return {"meta": {"name": "triton_mm", "num_warps": warps, "num_stages": stages, "shared": 1024 * stages},
            "ttir": ttir}


def test_backward_choices_compiled_by_workers_and_again_by_the_rank():
    records = [
        record("precompile thread", "fwd", "fwd.py"),  # the forward's choice: compiled once, in a thread
        record("benchmark", "fwd", "fwd.py", compiled=False),  # its benchmark finds it in Triton's cache
        record("benchmark", "bwd-1", "bwd1.py"),
        record("benchmark", "bwd-2", "bwd2.py"),
    ]
    entries = {
        recompile_probe.folder_name(kernel_hash("fwd")): entry("t-fwd", 4, 3),
        recompile_probe.folder_name(kernel_hash("bwd-1")): entry("t-rank-1", 4, 3),
        recompile_probe.folder_name(kernel_hash("bwd-2")): entry("t-rank-2", 8, 4),
        "WORKER1": entry("t-worker-1", 4, 3),  # the same configs, another source text
        "WORKER2": entry("t-worker-2", 8, 4),
    }
    found = recompile_probe.summarize(records, entries)
    assert (found["same_key"], found["other_key"]) == (0, 0)  # no thread-precompiled kernel compiled again
    assert (found["workers"], found["benchmarked"], found["same_ttir"]) == (2, 2, 0)
    assert found["same_configs"] is True


def test_a_config_the_workers_never_compiled_is_reported():
    records = [record("benchmark", "bwd-1", "bwd1.py")]
    entries = {recompile_probe.folder_name(kernel_hash("bwd-1")): entry("t-rank", 2, 5),
               "WORKER": entry("t-worker", 4, 3)}
    assert recompile_probe.summarize(records, entries)["same_configs"] is False


def test_a_thread_precompiled_kernel_compiled_again_under_its_own_key():
    records = [record("precompile thread", "fwd", "fwd.py"), record("benchmark", "fwd", "fwd.py")]
    entries = {recompile_probe.folder_name(kernel_hash("fwd")): entry("t-fwd", 4, 3)}
    found = recompile_probe.summarize(records, entries)
    assert (found["same_key"], found["other_key"], found["workers"]) == (1, 0, 0)
