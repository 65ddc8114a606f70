"""One rank of a job that runs Triton kernels outside Inductor (``tests/test_triton_kernels.py``).

    python triton_kernel_job.py STORE_URL [--no-session] [--bench-s S] [--configs N]
                                [--save-bundle URL] [--load-bundle URL] [--barrier DIR]
                                [--fail-first-compile S] [--start-after S] [--compile-s S]
                                [--hold-failure] [--user-manager-late SPEC]

Its own Triton cache dir is ``TRITON_CACHE_DIR``; its rank ``RANK``. Inside
``compile_once(store=STORE_URL)`` it compiles a plain ``@triton.jit`` kernel and runs an
``@triton.autotune``d one (N configs), through Triton's own ``JITFunction.run`` and
``Autotuner.run``, as a library's kernel is called: both with ``warmup=True``, which compiles
without launching. And it builds a small host C module through Triton's
``compile_module_from_src``, as Triton builds a kernel's launcher. This machine has no GPU:
Triton's active driver is one that targets an H100-class GPU (``sm_90``) and launches
nothing, so Triton compiles real cubins here; the autotuner's benchmark (``do_bench``) runs
each config's compile and sleeps ``S`` seconds instead of timing it, with a fixed timing per
config (the first config benchmarked wins).

Prints one JSON line: Triton's compiles (``knobs.compilation.listener`` with ``cache_hit``
False) and the threads they ran in, the host modules it built, the configs it benchmarked,
the config it chose, the cubins in its cache dir (a digest of each, by its path there), and
``coordinator.stats()``. With ``--save-bundle`` it saves the session's bundle after the
kernels; with ``--load-bundle`` it installs a bundle before them. With ``--barrier DIR`` it
calls the kernels only once every rank of the job (``WORLD_SIZE``) has reached them.
``--fail-first-compile S`` injects a fault: this rank's first Triton compile fails after S
seconds (its first stage raises), and the rank calls the kernel again; ``--start-after S``
calls the kernels S seconds after the barrier; ``--compile-s S`` makes each of this rank's
Triton compiles S seconds longer (its first stage sleeps first), as on a slower machine.
``--hold-failure`` keeps the failed compile's exception (its traceback, and the frames in
it, alive) with the garbage collector off. ``--user-manager-late SPEC`` sets
``TRITON_CACHE_MANAGER=SPEC`` inside the session, before the kernels, as a script that sets
it after ``import torch``; ``manager_after`` names the class Triton's knob gives after it.
"""

from __future__ import annotations

import argparse
import gc
import glob
import hashlib
import json
import os
import threading
import time

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import driver

import coordinator
from coordinator.testing import NoGPUDriver

compiles: list[str] = []
module_builds: list[str] = []
MODULE_SOURCE = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static struct PyModuleDef probe = {PyModuleDef_HEAD_INIT, "coordinator_probe_module", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_coordinator_probe_module(void) { return PyModule_Create(&probe); }
"""


def _count_module_builds() -> None:
    from triton.runtime import build

    original = build._build

    def counted(name, *args, **kwargs):
        module_builds.append(name)
        return original(name, *args, **kwargs)

    build._build = counted
benchmarked: list[str] = []
BENCH_S = 0.0


compile_threads: set[str] = set()


def listener(*, src, metadata, metadata_group, times, cache_hit):
    if not cache_hit:
        compiles.append(metadata["name"])
        compile_threads.add(threading.current_thread().name.split("_")[0])


def do_bench(kernel_call, quantiles=None):
    kernel_call()  # compiles the config (warmup=True: nothing launches)
    time.sleep(BENCH_S)
    benchmarked.append(str(len(benchmarked)))
    return [float(len(benchmarked))] * 3  # the first config benchmarked is the fastest


@triton.jit
def scale(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=mask) * 2, mask=mask)


def tuned_kernel(configs: int):
    choices = [triton.Config({"BLOCK": block}, num_warps=warps) for block in (64, 128, 256, 512) for warps in (2, 4)]

    @triton.jit
    def shift(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=mask) + 1, mask=mask)

    return triton.autotune(configs=choices[:configs], key=["n"], do_bench=do_bench, cache_results=True)(shift)


failures: list[str] = []
held: list[BaseException] = []


def fail_first_compile(after_s: float) -> None:
    """This rank's next Triton compile fails after ``after_s`` seconds, in its first stage (a fault injected)."""
    from triton.backends.nvidia.compiler import CUDABackend

    original = CUDABackend.__dict__["make_ttir"]  # the staticmethod itself

    def failing(*args, **kwargs):
        CUDABackend.make_ttir = original
        time.sleep(after_s)
        raise RuntimeError("injected: the compile failed")

    CUDABackend.make_ttir = staticmethod(failing)


def slow_compiles(seconds: float) -> None:
    """Each Triton compile of this rank takes ``seconds`` more: its first stage sleeps first."""
    from triton.backends.nvidia.compiler import CUDABackend

    original = CUDABackend.__dict__["make_ttir"].__func__

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    CUDABackend.make_ttir = staticmethod(slow)


def meet(directory: str) -> None:
    """Wait until every rank of the job has come here (files in ``directory``)."""
    os.makedirs(directory, exist_ok=True)
    open(os.path.join(directory, os.environ.get("RANK", "0")), "w").close()
    deadline = time.monotonic() + 120
    while len(os.listdir(directory)) < int(os.environ["WORLD_SIZE"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ranks did not all reach {directory}")
        time.sleep(0.01)


def main() -> None:
    global BENCH_S
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("--no-session", action="store_true")
    parser.add_argument("--bench-s", type=float, default=0.0)
    parser.add_argument("--configs", type=int, default=4)
    parser.add_argument("--save-bundle", help="after the kernels, save the session's bundle there")
    parser.add_argument("--load-bundle", help="before the kernels, load the bundle there")
    parser.add_argument("--barrier", help="a directory the ranks meet in before the kernels")
    parser.add_argument("--fail-first-compile", type=float, default=None)
    parser.add_argument("--start-after", type=float, default=0.0)
    parser.add_argument("--compile-s", type=float, default=0.0)
    parser.add_argument("--hold-failure", action="store_true")
    parser.add_argument("--user-manager-late")
    args = parser.parse_args()
    BENCH_S = args.bench_s
    driver.set_active(NoGPUDriver())
    knobs.compilation.listener = listener
    shift = tuned_kernel(args.configs)
    x, y = torch.zeros(4096), torch.zeros(4096)

    _count_module_builds()
    if args.compile_s:
        slow_compiles(args.compile_s)

    def job() -> None:
        from triton.runtime.build import compile_module_from_src

        if args.barrier:
            meet(args.barrier)
        time.sleep(args.start_after)
        if args.user_manager_late:
            os.environ["TRITON_CACHE_MANAGER"] = args.user_manager_late
        if args.fail_first_compile is not None:
            fail_first_compile(args.fail_first_compile)
            if args.hold_failure:
                gc.disable()
            try:
                scale.run(x, y, 4096, BLOCK=128, grid=(32,), warmup=True)
            except RuntimeError as exc:
                failures.append(str(exc))
                if args.hold_failure:
                    held.append(exc)
        scale.run(x, y, 4096, BLOCK=128, grid=(32,), warmup=True)
        shift.run(x, y, 4096, grid=(1,), warmup=True)
        compile_module_from_src(MODULE_SOURCE, "coordinator_probe_module")

    began = time.monotonic()
    if args.load_bundle:
        coordinator.load_bundle(args.load_bundle)
    if args.no_session:
        job()
        stats = None
    else:
        with coordinator.compile_once(store=args.store):
            job()
            stats = coordinator.stats()
            if args.save_bundle:
                coordinator.save_bundle(args.save_bundle)
    # A compile that failed (or was left to another rank) must not stay in the kernel's cache,
    # where a launch would raise its error.
    kernel_caches = [caches[0] for caches in shift.fn.device_caches.values()]
    failed_futures = sum(1 for cache in kernel_caches for kernel in cache.values()
                         if getattr(kernel, "future", None) is not None and kernel.future.exception() is not None)
    manager = knobs.cache.manager_class  # None: Triton's own
    cache = os.environ["TRITON_CACHE_DIR"]
    # By kernel key and name: a received kernel's files are in a dir of their own in its key's dir.
    cubins = {f"{os.path.relpath(path, cache).split(os.sep)[0]}/{os.path.basename(path)}":
              hashlib.sha256(open(path, "rb").read()).hexdigest()[:16]
              for path in glob.glob(f"{cache}/*/*.cubin") + glob.glob(f"{cache}/*/coordinator-*/*.cubin")}
    print(json.dumps({"rank": int(os.environ.get("RANK", "0")), "compiles": sorted(compiles),
                      "module_builds": len(module_builds), "compile_threads": sorted(compile_threads),
                      "failures": failures, "failed_futures": failed_futures,
                      "benchmarked": len(benchmarked), "best": str(shift.best_config), "cubins": cubins,
                      "seconds": round(time.monotonic() - began, 2), "stats": stats,
                      "manager_after": manager and f"{manager.__module__}:{manager.__name__}"}))


if __name__ == "__main__":
    main()
