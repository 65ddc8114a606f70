"""One rank of a GPU-tier job: compile_once over NCCL's job store, then report what step 1 did.

    torchrun --standalone --virtual-local-rank --nproc-per-node 2 tests/gpu/worker.py OUT_DIR [--mode M] [--backend B]

Both ranks build the same model from the same seed and run the same batch, so equal
kernels with equal configs must give bitwise-equal loss and gradients. Rank 0 starts
first (rank 1 waits a second) and so compiles; rank 1 is the follower. Each rank
writes ``OUT_DIR/rank<R>.json``: FX misses and hits, Triton compiles (cubins a compile
put into Triton's cache, not ones an FX hit emitted), the GEMM template selections,
runtime config searches and coordinate-descent runs it really did, with the kernels
they tuned (counted by wrappers: see ``trace_tuning``), cubins in its Triton cache
dir, the coordinator's stats, and a SHA-256 of the loss and every gradient. With
``--backend gloo`` both ranks may share one GPU (``--virtual-local-rank`` shows each
its GPU as ``cuda:0``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

fresh = tempfile.mkdtemp(prefix=f"gpu-tier-rank{os.environ.get('RANK', 0)}-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh
os.environ["TRITON_CACHE_DIR"] = os.path.join(fresh, "triton")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # Triton compiles in this process, where we count them

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
import coordinator  # noqa: E402
from coordinator.testing import GPT, count_triton_compiles  # noqa: E402

triton_compiles = count_triton_compiles()


def trace_tuning() -> dict:
    """Count the tuning this process really does. Inductor's counters cannot tell: an FX
    cache hit adds the compile-time counter deltas recorded in the entry
    (``counters["inductor"] += graph.counter_deltas``), so a follower's counters repeat
    the leader's GEMM template selections and benchmarks. Counted here instead: GEMM
    template selections (``AlgorithmSelectorCache.benchmark``), runtime config searches
    (``CachingAutotuner.benchmark_all_configs``) and coordinate-descent runs, with the
    first call stacks of each and the first autotune-cache checks, for the tier's log."""
    import traceback

    from torch._inductor import select_algorithm
    from torch._inductor.runtime import triton_heuristics as th

    counts = {"template_selections": 0, "runtime_autotunes": 0, "coordesc_runs": 0}
    tuned: dict = {"searched": [], "descended": []}
    seen: dict = {"counts": counts, "tuned": tuned, "first_template_selection": None, "first_coordesc": None,
                  "cache_checks": []}

    def stack() -> list[str]:
        return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[-14:-2]]

    def counted(owner, name: str, count: str, first: str | None, describe=None, names: str | None = None) -> None:
        original = getattr(owner, name)

        def wrapper(self, *args, **kwargs):
            counts[count] += 1
            if names:
                tuned[names].append(self.inductor_meta.get("kernel_name"))
            if first and seen[first] is None:
                seen[first] = {**(describe(self, *args) if describe else {}), "stack": stack()}
            return original(self, *args, **kwargs)

        setattr(owner, name, wrapper)

    counted(select_algorithm.AlgorithmSelectorCache, "benchmark", "template_selections", "first_template_selection")
    counted(th.CachingAutotuner, "benchmark_all_configs", "runtime_autotunes", None, names="searched")
    # The inner method: the outer one also runs (and returns at once) on every launch of a kernel
    # that coordinate descent skips, such as a GEMM template.
    counted(th.CachingAutotuner, "_coordinate_descent_tuning", "coordesc_runs", "first_coordesc",
            lambda self, launcher, *_: {"kernel": self.inductor_meta.get("kernel_name"), "config": str(launcher.config),
                                        "found_by_coordesc": getattr(launcher.config, "found_by_coordesc", None)},
            names="descended")
    check = th.check_autotune_cache

    def traced_check(configs, filename, inductor_meta):
        found, cache, info = check(configs, filename, inductor_meta)
        if len(seen["cache_checks"]) < 10:
            seen["cache_checks"].append({
                "kernel": inductor_meta.get("kernel_name"), "configs": len(configs), "returned": len(found),
                "found_by_coordesc": getattr(found[0], "found_by_coordesc", None) if len(found) == 1 else None,
                "state": str(info.get("autotune_cache_state"))})
        return found, cache, info

    th.check_autotune_cache = traced_check
    return seen


tuning = trace_tuning()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--mode", default="default")
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    args = p.parse_args()
    logging.basicConfig(format=f"[rank{os.environ['RANK']} %(relativeCreated).0fms] %(name)s: %(message)s")
    logging.getLogger("coordinator").setLevel(os.environ.get("COORDINATOR_TIER_LOG_LEVEL", "INFO"))
    torch.cuda.set_device(0)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.compile(GPT(256, 256, 2, 4, 128).cuda(), mode=args.mode)
    gen = torch.Generator().manual_seed(7)
    idx = torch.randint(256, (8, 128), generator=gen).cuda()
    dist.barrier()
    if rank != 0:
        time.sleep(1.0)  # the leader claims first
    from torch._dynamo.utils import counters

    with coordinator.compile_once():
        loss = model(idx, torch.roll(idx, -1, dims=1))
        loss.backward()
        torch.cuda.synchronize()
    # Embedding gradients are sums by atomic adds (index_put with accumulate), whose order
    # varies run to run on any GPU: they are compared within a tolerance, the rest bitwise.
    digest = hashlib.sha256(loss.detach().cpu().numpy().tobytes())
    atomic = {}
    for name, param in model.named_parameters():
        if name.endswith(("tok.weight", "pos.weight")):
            atomic[name] = param.grad.detach().double().cpu().tolist()
        else:
            digest.update(param.grad.detach().cpu().numpy().tobytes())
    inductor = counters["inductor"]
    report = {
        "rank": rank,
        "mode": args.mode,
        "static_launcher": getattr(torch._inductor.config, "use_static_cuda_launcher", None),
        "coordesc": torch._inductor.config.coordinate_descent_tuning,
        "fx_misses": inductor.get("fxgraph_cache_miss", 0),
        "fx_hits": inductor.get("fxgraph_cache_hit", 0),
        "triton_compiles": triton_compiles(),
        **tuning["counts"],  # template_selections, runtime_autotunes, coordesc_runs: counted, not replayed
        "tuned": tuning["tuned"],  # the kernels it searched and descended
        "cubins_on_disk": len(list(Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin"))),
        "counters": {k: v for k, v in inductor.items()},  # a follower's include the leader's compile-time deltas
        "stats": coordinator.stats(),
        "tuning_trace": {k: v for k, v in tuning.items() if k not in ("counts", "tuned")},
        "digest": digest.hexdigest(),
        "atomic_grads": atomic,
        "loss": loss.item(),
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
