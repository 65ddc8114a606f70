"""Does Inductor's max-autotune compile each GEMM template choice twice?

The profiles of a max-autotune rank on torch 2.11 (RESULTS.md, eleventh and twelfth sessions)
show Triton compiling template choices one at a time when ``benchmark_choice`` first runs them,
about three quarters of step 1, although Inductor precompiles every choice in parallel first
(in threads of the process, or in its compile workers once they are up). This script compiles
one fp32 GEMM (forward and backward) in ``max-autotune-no-cudagraphs`` with empty Inductor and
Triton cache dirs. It records every ``triton.compile`` call in the process (where it came from,
its thread, the kernel, the cache key's hash, whether Triton compiled or found it in its cache,
the time) and where each template selection sends its precompiles. Then it matches the
benchmark-time compiles to the kernels compiled earlier, in this process's threads and, through
Triton's cache dir, in the compile workers, and prints whether the keys were the same and how
the entries differ. Found on 2.11: the backward's choices go to the compile workers, and the
rank compiles each again under another key. One GPU, about a minute:

    python benchmarks/gpu/recompile_probe.py --out $OUT/recompile-probe.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import threading
import time
import traceback

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-"))

import torch
import triton
from triton.runtime.cache import FileCacheManager

records: list[dict] = []
_local = threading.local()
_lock = threading.Lock()


def _where() -> str:
    names = {frame.name for frame in traceback.extract_stack()}
    if "precompile_with_captured_stdout" in names:
        return "precompile thread"
    if names & {"benchmark_choice", "benchmark_choices", "benchmark_example_value"}:
        return "benchmark"
    if "coordinate_descent_tuning" in names:
        return "coordinate descent"
    return "other"


def _describe(value) -> str:
    return repr(value)[:2000]


def install() -> None:
    original_compile = triton.compile
    original_put_group = FileCacheManager.put_group

    def put_group(self, filename, group):
        _local.puts = getattr(_local, "puts", 0) + 1
        return original_put_group(self, filename, group)

    def compile(src, *args, **kwargs):
        _local.puts = 0
        started = time.perf_counter()
        kernel = original_compile(src, *args, **kwargs)
        fn = getattr(src, "fn", None)
        record = {
            "where": _where(),
            "thread": threading.current_thread().name,
            "kernel": getattr(fn, "__name__", None) or getattr(src, "name", "?"),
            "module": getattr(fn, "__module__", None),
            "file": getattr(getattr(fn, "fn", None), "__code__", None) and fn.fn.__code__.co_filename,
            "hash": getattr(kernel, "hash", None),
            "compiled": _local.puts > 0,
            "seconds": time.perf_counter() - started,
            "target": _describe(kwargs.get("target", args[0] if args else None)),
            "options": _describe(kwargs.get("options", args[1] if len(args) > 1 else None)),
            "src_hash": src.hash() if hasattr(src, "hash") else None,
            "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
        }
        with _lock:
            records.append(record)
        return kernel

    FileCacheManager.put_group = put_group
    triton.compile = compile

    # Where each template selection sends its precompiles: threads here, or the compile workers.
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.select_algorithm import AlgorithmSelectorCache

    original_make = AlgorithmSelectorCache.make_precompile_fn

    def make_precompile_fn(self, choices, name, inputs_key, *args, **kwargs):
        print(f"precompile: {name}, {len(choices)} choices, thread {threading.current_thread().name}, "
              f"compile workers in use: {AsyncCompile.use_process_pool()}", flush=True)
        return original_make(self, choices, name, inputs_key, *args, **kwargs)

    AlgorithmSelectorCache.make_precompile_fn = make_precompile_fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=2048)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--out", default="recompile-probe.json")
    args = p.parse_args()
    install()
    a = torch.randn(args.m, args.k, device="cuda", requires_grad=True)
    b = torch.randn(args.k, args.n, device="cuda", requires_grad=True)
    fn = torch.compile(lambda x, y: (x @ y).relu(), mode="max-autotune-no-cudagraphs")
    started = time.perf_counter()
    fn(a, b).sum().backward()
    torch.cuda.synchronize()
    wall = time.perf_counter() - started

    by_where = collections.defaultdict(lambda: [0, 0, 0.0])  # calls, real compiles, seconds
    for r in records:
        entry = by_where[r["where"]]
        entry[0] += 1
        entry[1] += r["compiled"]
        entry[2] += r["seconds"]
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}: "
          f"forward+backward in {wall:.1f} s")
    print("| where | triton.compile calls | compiled (cache misses) | seconds |\n|---|---|---|---|")
    for where, (calls, compiled, seconds) in sorted(by_where.items()):
        print(f"| {where} | {calls} | {compiled} | {seconds:.1f} |")

    # Kernels (by source file and name) compiled both in a precompile thread and at benchmark time.
    pre = collections.defaultdict(list)
    for r in records:
        if r["where"] == "precompile thread":
            pre[(r["file"], r["kernel"])].append(r)
    same_key = other_key = 0
    examples = []
    for r in records:
        if r["where"] != "benchmark" or not r["compiled"]:
            continue
        earlier = pre.get((r["file"], r["kernel"]))
        if not earlier:
            continue
        if any(e["hash"] == r["hash"] for e in earlier):
            same_key += 1
        else:
            other_key += 1
            if len(examples) < 3:
                e = earlier[0]
                examples.append({field: (e[field], r[field]) for field in ("hash", "src_hash", "target", "options",
                                                                           "triton_cache_dir", "file")
                                 if e[field] != r[field]})
    print(f"benchmark-time compiles of a kernel the precompile threads compiled: {same_key} with the same "
          f"cache key, {other_key} with another")
    for example in examples:
        print("differs (precompile, benchmark):", json.dumps(example, indent=1)[:3000])
    elsewhere = compiled_elsewhere({r["hash"] for r in records}, {r["hash"] for r in records if r["where"] == "benchmark"})
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "triton": triton.__version__, "wall_s": wall, "records": records,
                   "compiled_elsewhere": elsewhere}, f)


def compiled_elsewhere(here: set[str], benchmarked: set[str]) -> dict:
    """Triton's cache entries that this process did not compile (Inductor's compile workers
    did), matched by their TTIR to the kernels compiled again at benchmark time; prints how
    the two entries' metadata differ."""
    import hashlib
    from pathlib import Path

    from triton.runtime import cache

    # Triton names a cache entry's folder by its hash in base32 (3.x), or by the hash itself.
    folder = getattr(cache, "_base32", lambda key: key)
    here = {folder(h) for h in here if h}
    benchmarked = {folder(h) for h in benchmarked if h}
    entries = {}
    for group in Path(os.environ["TRITON_CACHE_DIR"]).iterdir():
        meta = [m for m in group.glob("*.json") if not m.name.startswith("__grp__")]
        ttir = list(group.glob("*.ttir"))
        if meta and ttir:
            entries[group.name] = {"meta": json.loads(meta[0].read_text()),
                                   "ttir": hashlib.sha256(ttir[0].read_bytes()).hexdigest()}
    workers = {h: e for h, e in entries.items() if h not in here}
    by_ttir = {e["ttir"]: h for h, e in workers.items()}
    matched, diffs = 0, []
    for h in benchmarked:
        mine = entries.get(h)
        theirs = by_ttir.get(mine["ttir"]) if mine else None
        if theirs is None:
            continue
        matched += 1
        if len(diffs) < 3:
            a, b = workers[theirs]["meta"], mine["meta"]
            diffs.append({k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)})
    print(f"Triton cache entries: {len(entries)}; compiled by other processes (compile workers): {len(workers)}; "
          f"benchmark-time compiles whose TTIR a worker had compiled: {matched} of {len(benchmarked)}")
    for d in diffs:
        print("metadata differs (worker, benchmark):", json.dumps(d)[:2000])
    return {"entries": len(entries), "workers": len(workers), "matched": matched, "diffs": diffs,
            "metadata": {h: {"mine": h in here, **e} for h, e in entries.items()}}


if __name__ == "__main__":
    main()
