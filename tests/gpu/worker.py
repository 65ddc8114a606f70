"""One rank of a GPU-tier job: compile_once over NCCL's job store, then report what step 1 did.

    torchrun --standalone --virtual-local-rank --nproc-per-node 2 tests/gpu/worker.py OUT_DIR [--mode M]

Both ranks build the same model from the same seed and run the same batch, so equal
kernels with equal configs must give bitwise-equal loss and gradients. Rank 0 starts
first (rank 1 waits a second) and so compiles; rank 1 is the follower. Each rank
writes ``OUT_DIR/rank<R>.json``: FX misses and hits, Triton compiles (cubins a compile
put into Triton's cache, not ones an FX hit emitted), autotune benchmarks, coordinate
descent benchmarks, cubins in its Triton cache dir, the coordinator's stats, and a
SHA-256 of the loss and every gradient.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
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
sys.path.insert(0, str(ROOT / "examples"))
import coordinator  # noqa: E402
from train import GPT  # noqa: E402

from coordinator._compat import count_triton_compiles  # noqa: E402

triton_compiles = count_triton_compiles()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--mode", default="default")
    args = p.parse_args()
    logging.basicConfig(format=f"[rank{os.environ['RANK']}] %(name)s: %(message)s")
    logging.getLogger("coordinator").setLevel(logging.INFO)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
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
        "autotune_benchmarks": sum(v for k, v in inductor.items() if k.startswith("benchmarking.")),
        "select_algorithm_autotune": inductor.get("select_algorithm_autotune", 0),
        "coordesc_benchmarks": inductor.get("coordesc_tuning_bench", 0),
        "cubins_on_disk": len(list(Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin"))),
        "counters": {k: v for k, v in inductor.items()},
        "stats": coordinator.stats(),
        "digest": digest.hexdigest(),
        "atomic_grads": atomic,
        "loss": loss.item(),
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
