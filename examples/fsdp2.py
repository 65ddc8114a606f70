"""FSDP2 (``fully_shard``) with each transformer block compiled on its own, under compile_once.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2.py

Per-block compile gives one graph per distinct block shape, which every rank would
otherwise compile; with ``compile_once`` one rank compiles it and the others load it.
FSDP2's all-gathers run in the forward pass, so the coordinator never waits on keys
whose completion could depend on them (AOTAutograd entries are only looked up).
Runs on CPU with gloo and on GPUs with NCCL.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from train import GPT, setup_distributed  # the same small GPT as examples/train.py

import coordinator


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    device = setup_distributed()

    torch.manual_seed(0)
    model = GPT(256, args.dim, args.layers, heads=4, seq=32).to(device)
    for block in model.blocks:
        block.compile()
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    with coordinator.compile_once():
        for step in range(args.steps):
            idx = torch.randint(256, (4, 32), generator=gen).to(device)
            loss = model(idx, torch.roll(idx, -1, dims=1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"rank {dist.get_rank()} step {step} loss {loss.item():.4f}", flush=True)
    stats = coordinator.stats()
    print(f"rank {dist.get_rank()}: {stats['graphs_compiled']} graphs compiled, "
          f"{stats['graphs_received']} received", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
