"""benchmarks/tools/profile_summary.py on py-spy raw samples shaped like a GPU rank's and a CPU rank's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_summary

MAIN = "thread (100): MainThread;<module> (job.py:1);main (job.py:9)"
BACKWARD = "backward (torch/autograd/__init__.py:381);_engine_run_backward (torch/autograd/graph.py:869)"
COMPILE = ("CompiledFunction.backward (torch/_functorch/_aot_autograd/runtime_wrappers.py:2);"
           "compile_fx_inner (torch/_inductor/compile_fx.py:7);"
           "CachingAutotuner._precompile_config (torch/_inductor/runtime/triton_heuristics.py:872);"
           "compile (triton/compiler/compiler.py:324);CUDABackend.make_llir (triton/backends/nvidia/compiler.py:417)")
ENGINE = "thread (101): Dummy-1;BackwardCFunction.apply (torch/autograd/function.py:317)"


def phases(tmp_path: Path, lines: list[str]):
    samples = tmp_path / "rank0.txt"
    samples.write_text("\n".join(lines) + "\n")
    return profile_summary.main_thread_phases(samples, 100, 50.0)


def test_gpu_rank_backward_compile_is_counted_from_the_engine_thread(tmp_path):
    # The main thread waits 10 s in the engine; the engine thread compiles for 8 s of it.
    seconds, _, stages = phases(tmp_path, [
        f"{MAIN};{BACKWARD} 500",
        f"{ENGINE};{COMPILE} 400",
        "thread (102): ThreadPoolExecutor-0_0;Thread._bootstrap (threading.py:1030) 300",  # not counted
        f"{MAIN};compile_fx_inner (torch/_inductor/compile_fx.py:7) 50",
    ])
    assert seconds["Triton kernels (load, launch, tune)"] == pytest.approx(8.0)
    assert seconds[profile_summary.ENGINE_OUTSIDE_PYTHON] == pytest.approx(2.0)
    assert seconds["Inductor (lowering, codegen, cache)"] == pytest.approx(1.0)
    assert sum(seconds.values()) == pytest.approx(11.0)  # the main thread's life
    assert stages == {"compile: make_llir": pytest.approx(8.0)}


def test_cpu_rank_backward_compile_stays_on_the_main_thread(tmp_path):
    # On CPU the engine runs on the main thread: its compile frames sit under the engine call.
    seconds, _, _ = phases(tmp_path, [
        (f"{MAIN};{BACKWARD};BackwardCFunction.apply (torch/autograd/function.py:317);"
         "CppBuilder.build (torch/_inductor/cpp_builder.py:1) 300"),
        f"{MAIN};{BACKWARD} 100",  # backward kernels in C++
    ])
    assert seconds["C++ kernel compile (gcc, in this process)"] == pytest.approx(6.0)
    assert seconds[profile_summary.ENGINE_OUTSIDE_PYTHON] == pytest.approx(2.0)
    assert sum(seconds.values()) == pytest.approx(8.0)
