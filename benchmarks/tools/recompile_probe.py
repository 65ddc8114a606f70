"""Does Inductor's max-autotune compile each GEMM template choice twice?

The profiles of a max-autotune rank on torch 2.11 (benchmarks/RESULTS.md, max-autotune section)
show Triton compiling template choices one at a time when ``benchmark_choice`` first runs them,
about three quarters of step 1, although Inductor precompiles every choice in parallel first
(in threads of the process, or in its compile workers once they are up). This script compiles
one fp32 GEMM (forward and backward) in ``max-autotune-no-cudagraphs`` with empty Inductor and
Triton cache dirs. It records every ``triton.compile`` call in the process (where it came from,
its thread, the kernel, the cache key's hash, whether Triton compiled or found it in its cache,
the time) and where each template selection sends its precompiles. Then it matches the
benchmark-time compiles to the kernels compiled earlier, in this process's threads and, through
Triton's cache dir, in the compile workers, and prints whether the keys were the same and how
the entries differ, and whether the workers' kernels have the same configs (warps, stages,
shared memory) as the ones compiled again. Found on 2.11: the backward's choices go to the
compile workers, and the rank compiles each again under another key. One GPU, about a minute;
``--summarize`` prints the summary again from a saved JSON, with no GPU:

    python benchmarks/tools/recompile_probe.py --out $OUT/recompile-probe.json
    python benchmarks/tools/recompile_probe.py --summarize RECORDS.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import threading
import time
import traceback
from pathlib import Path

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
    import triton
    from triton.runtime.cache import FileCacheManager

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


def run(args: argparse.Namespace) -> dict:
    """Compile the GEMM with empty caches; return the records and Triton's cache entries."""
    import tempfile

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-"))
    import torch
    import triton

    install()
    once = contextlib.nullcontext()
    if args.compile_choices_once:
        from coordinator import _compat

        once = _compat.precompile_choices_in_process()
    a = torch.randn(args.m, args.k, device="cuda", requires_grad=True)
    b = torch.randn(args.k, args.n, device="cuda", requires_grad=True)
    fn = torch.compile(lambda x, y: (x @ y).relu(), mode="max-autotune-no-cudagraphs")
    started = time.perf_counter()
    with once:
        fn(a, b).sum().backward()
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}: "
          f"forward+backward in {wall:.1f} s")
    return {"torch": torch.__version__, "triton": triton.__version__, "wall_s": wall, "records": records,
            "cache_entries": cache_entries(Path(os.environ["TRITON_CACHE_DIR"]))}


def cache_entries(cache_dir: Path) -> dict[str, dict]:
    """Triton's cache entries by folder name: each one's metadata and its TTIR's hash."""
    entries = {}
    for group in cache_dir.iterdir():
        meta = [m for m in group.glob("*.json") if not m.name.startswith("__grp__")]
        ttir = list(group.glob("*.ttir"))
        if meta and ttir:
            entries[group.name] = {"meta": json.loads(meta[0].read_text()),
                                   "ttir": hashlib.sha256(ttir[0].read_bytes()).hexdigest()}
    return entries


def folder_name(kernel_hash: str) -> str:
    """The cache folder Triton 3.x names after a kernel's hash (its hex digest in base32)."""
    import base64

    return base64.b32encode(bytes.fromhex(kernel_hash)).decode().rstrip("=")


def summarize(records: list[dict], entries: dict[str, dict]) -> dict:
    """Print and return what the run found: compiles by where they came from; the
    benchmark-time compiles of kernels this process's precompile threads had compiled (same
    cache key or another); and the cache entries the compile workers made, matched to the
    benchmark-time compiles by TTIR and compared by config (warps, stages, shared memory)."""
    by_where = collections.defaultdict(lambda: [0, 0, 0.0])  # calls, real compiles, seconds
    for r in records:
        entry = by_where[r["where"]]
        entry[0] += 1
        entry[1] += r["compiled"]
        entry[2] += r["seconds"]
    print("| where | triton.compile calls | compiled (cache misses) | seconds |\n|---|---|---|---|")
    for where, (calls, compiled, seconds) in sorted(by_where.items()):
        print(f"| {where} | {calls} | {compiled} | {seconds:.1f} |")

    # Kernels (by source file and name) compiled both in a precompile thread and at benchmark time.
    threads = collections.defaultdict(set)
    for r in records:
        if r["where"] == "precompile thread":
            threads[r["file"], r["kernel"]].add(r["hash"])
    benchmarked = [r for r in records if r["where"] == "benchmark" and r["compiled"]]
    again = [r for r in benchmarked if (r["file"], r["kernel"]) in threads]
    same_key = sum(r["hash"] in threads[r["file"], r["kernel"]] for r in again)
    print(f"benchmark-time compiles of a kernel the precompile threads compiled: {same_key} with the same "
          f"cache key, {len(again) - same_key} with another")

    here = {folder_name(r["hash"]) for r in records if r["hash"]}
    workers = {h: e for h, e in entries.items() if h not in here}
    mine = [entries[h] for h in {folder_name(r["hash"]) for r in benchmarked} if h in entries]
    worker_ttirs = {e["ttir"] for e in workers.values()}
    same_ttir = sum(e["ttir"] in worker_ttirs for e in mine)

    def configs(found) -> collections.Counter:
        return collections.Counter((e["meta"]["name"], e["meta"]["num_warps"], e["meta"]["num_stages"],
                                    e["meta"]["shared"]) for e in found)

    worker_configs = configs(workers.values())
    worker_names = collections.Counter(e["meta"]["name"] for e in workers.values())
    same_configs = configs(mine) <= worker_configs
    print(f"Triton cache entries: {len(entries)}; made by the compile workers: {len(workers)} "
          f"({', '.join(f'{n} {name}' for name, n in worker_names.items())}); "
          f"benchmark-time compiles: {len(mine)}, of which {same_ttir} have the TTIR of a worker's entry; "
          f"every one's config (kernel, warps, stages, shared memory) among the workers': {same_configs}")
    return {"by_where": by_where, "same_key": same_key, "other_key": len(again) - same_key,
            "workers": len(workers), "benchmarked": len(mine), "same_ttir": same_ttir, "same_configs": same_configs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=2048)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--out", default="recompile-probe.json")
    p.add_argument("--compile-choices-once", action="store_true",
                   help="precompile template choices in threads of the process "
                        "(coordinator._compat.precompile_choices_in_process)")
    p.add_argument("--summarize", metavar="JSON", help="print the summary of a saved run (no GPU)")
    args = p.parse_args()
    if args.summarize:
        saved = json.loads(Path(args.summarize).read_text())
    else:
        saved = run(args)
        Path(args.out).write_text(json.dumps(saved))
    # Runs saved before cache_entries: the entries sit in compiled_elsewhere's metadata.
    entries = saved.get("cache_entries") or saved["compiled_elsewhere"]["metadata"]
    summarize(saved["records"], entries)


if __name__ == "__main__":
    main()
