"""Launches per second of a Triton autotuner, with and without a session.

    python benchmarks/triton_launches.py [--launches N] [--repeat R] [--label L]

A library's ``@triton.autotune``d kernel built without ``cache_results`` (as most are,
flash-linear-attention's among them) is tuned once, then launched N times through Triton's
own ``Autotuner.run``, without a session and inside ``compile_once`` (a ``file://`` store),
alternately, R times each. There is no GPU here: Triton's active driver targets ``sm_90``
and launches nothing, and each launch goes as far as a launch can without one
(``warmup=True``: the tuned config's kernel found in the kernel cache and returned), so
what is timed is the launch path in Python, which is what the session could add to.
Needs Triton (torch's CUDA build). Prints a table and writes its section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.runtime import driver

sys.path.insert(0, str(Path(__file__).parent))
from common import command, heading, machine, save, table_head  # noqa: E402

import coordinator  # noqa: E402
from coordinator.testing import NoGPUDriver  # noqa: E402


def do_bench(kernel_call, quantiles=None):
    kernel_call()
    return [1.0, 1.0, 1.0]


@triton.autotune(configs=[triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})], key=["n"],
                 do_bench=do_bench)
@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def launches_per_second(x: torch.Tensor, launches: int) -> float:
    add_one.run(x, 4096, grid=(1,), warmup=True)  # tuned (or found) and compiled before the clock
    began = time.perf_counter()
    for _ in range(launches):
        add_one.run(x, 4096, grid=(1,), warmup=True)
    return launches / (time.perf_counter() - began)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--label", default="triton-launches")
    p.add_argument("--out", default=str(Path(__file__).with_name("RESULTS.md")))
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="triton-launches-")
    os.environ["TRITON_CACHE_DIR"] = f"{tmp}/triton"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{tmp}/inductor"
    driver.set_active(NoGPUDriver())
    x = torch.zeros(4096)
    rates: dict[str, list[float]] = {"without a session": [], "inside compile_once": []}
    for _ in range(args.repeat):
        rates["without a session"].append(launches_per_second(x, args.launches))
        with coordinator.compile_once(store=f"file://{tmp}/store"):
            rates["inside compile_once"].append(launches_per_second(x, args.launches))
    base = statistics.median(rates["without a session"])
    lines = heading(args.label, f"Command: `{command('triton_launches.py')}`")
    lines += [f"Machine: {machine(0)}, triton {triton.__version__}. {args.launches} launches of a tuned "
              f"`@triton.autotune` kernel built without `cache_results`, {args.repeat} times each, alternately.", ""]
    lines += table_head("job", "launches per second (median)", "÷ without", "runs")
    for name, values in rates.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {median:,.0f} | {median / base:.2f}× | "
                     + ", ".join(f"{v:,.0f}" for v in values) + " |")
    section = "\n".join(lines) + "\n"
    print(section)
    save(args.label, {"command": command("triton_launches.py"), "rates": rates}, section, out=args.out)


if __name__ == "__main__":
    main()
