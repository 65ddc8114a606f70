"""Does a rank's state under ``compile_once`` slow Triton's compiler? (one GPU, ~2 minutes)

In the 4-layer max-autotune runs the leader's Triton compiles took about 8% longer per
compile than one rank alone, in Triton's own stages (LLVM in-process, ptxas outside),
with the coordinator's own frames near zero. This compiles the same kind of kernel again
and again in one process, alternating the states that process is in under (d):

* ``plain``: no session;
* ``open``: inside ``coordinator.compile_once()`` over the job's store (its Inductor
  hooks, its environment for compile workers, its heartbeat thread);
* ``+ballast``: both again, with 457 MB in the job's TCPStore (served from this process,
  as rank 0's store is) and held here, as (d)'s leader holds its kernels.

Each compile is a new ``tl.dot`` kernel (a constexpr salt makes every one a cache miss).
With ``--balanced``, each round runs the four states in its own order (a Latin square), so
that a drift of the host's speed over the run falls on every state alike; the ballast is
put in and taken out as the order needs. Each window also records the host's load average.

    python benchmarks/tools/triton_compile_speed.py --kernels 30 --rounds 3
    python benchmarks/tools/triton_compile_speed.py --kernels 20 --rounds 4 --balanced
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BALLAST_BYTES = 457 * 1000 * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=int, default=30, help="compiles per state per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--balanced", action="store_true",
                   help="each round runs the states in its own order (rounds: a multiple of 4)")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    args = p.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-speed-")

    import torch
    import torch.distributed as dist
    import triton
    import triton.language as tl

    import coordinator
    from coordinator.stores.c10d import C10dStore

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    @triton.jit
    def matmul(a, b, c, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               SALT: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = tl.load(a + rm[:, None] * K + (k + rk)[None, :], mask=(rm[:, None] < M) & ((k + rk)[None, :] < K))
            y = tl.load(b + (k + rk)[:, None] * N + rn[None, :], mask=((k + rk)[:, None] < K) & (rn[None, :] < N))
            acc += tl.dot(x, y)
        acc = acc * (1.0 + SALT * 0.0)
        tl.store(c + rm[:, None] * N + rn[None, :], acc.to(tl.float16), mask=(rm[:, None] < M) & (rn[None, :] < N))

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(minutes=5))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    a = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    b = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    c = torch.empty(256, 256, device="cuda", dtype=torch.float16)
    salt = iter(range(1, 1 << 30))
    blocks = [(64, 64, 32), (128, 64, 32), (64, 128, 64), (128, 128, 32)]

    def compile_some(n: int) -> list[float]:
        seconds = []
        for i in range(n):
            bm, bn, bk = blocks[i % len(blocks)]
            started = time.perf_counter()
            matmul[(triton.cdiv(256, bm), triton.cdiv(256, bn))](a, b, c, 256, 256, 256, BLOCK_M=bm, BLOCK_N=bn,
                                                                 BLOCK_K=bk, SALT=next(salt))
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        return seconds

    compile_some(4)  # Triton's first compile loads its backends
    results: dict[str, list[float]] = {}
    windows: list[dict] = []
    speed_store = C10dStore(store, prefix="speed/")
    held: list[bytes] = []

    def set_ballast(on: bool) -> None:
        if on and not held:
            held.append(os.urandom(BALLAST_BYTES))
            speed_store.set("ballast", held[0])
        elif not on and held:
            speed_store.delete("ballast")
            held.clear()

    def measure(state: str) -> None:
        set_ballast(state.endswith("+ballast"))
        load_before = os.getloadavg()[0]
        if state.startswith("open"):
            with coordinator.compile_once():
                seconds = compile_some(args.kernels)
        else:
            seconds = compile_some(args.kernels)
        results.setdefault(state, []).extend(seconds)
        windows.append({"state": state, "mean_s": statistics.mean(seconds), "load_before": load_before,
                        "load_after": os.getloadavg()[0]})
        print(f"{state:16s} mean {statistics.mean(seconds) * 1000:7.1f} ms  median "
              f"{statistics.median(seconds) * 1000:7.1f} ms  ({len(seconds)} compiles; load average "
              f"{load_before:.1f} -> {os.getloadavg()[0]:.1f})", flush=True)

    states = ("plain", "open", "plain+ballast", "open+ballast")
    if args.balanced:
        latin = [(0, 1, 2, 3), (1, 3, 0, 2), (2, 0, 3, 1), (3, 2, 1, 0)]
        for r in range(args.rounds):
            for index in latin[r % 4]:
                measure(states[index])
    else:  # the first run's order: both states without the ballast, then both with it
        for _ in range(args.rounds):
            for state in states[:2]:
                measure(state)
        for _ in range(args.rounds):
            for state in states[2:]:
                measure(state)

    base = statistics.mean(results["plain"])
    print("\n| state | compiles | mean (ms) | median (ms) | mean ÷ plain |\n|---|---|---|---|---|")
    for state, seconds in results.items():
        print(f"| {state} | {len(seconds)} | {statistics.mean(seconds) * 1000:.1f} | "
              f"{statistics.median(seconds) * 1000:.1f} | {statistics.mean(seconds) / base:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "triton": triton.__version__,
                                              "gpu": torch.cuda.get_device_name(0), "balanced": args.balanced,
                                              "windows": windows, "seconds": results}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
