"""A compiled model with a graph break, trained with DDP under compile_once.

    torchrun --standalone --nproc-per-node 2 examples/graph_break.py

The graph break in the middle of ``forward`` splits it into two graphs (and two
backward graphs); each is compiled by one rank and received by the others.
Runs on CPU with gloo and on GPUs with NCCL.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from train import setup_distributed  # shared with examples/train.py

import coordinator


class TwoPart(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.second = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Tanh())

    def forward(self, x):
        h = self.first(x)
        torch._dynamo.graph_break()  # e.g. a print or a data-dependent branch
        return self.second(h)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    args = p.parse_args()
    device = setup_distributed()

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(torch.compile(TwoPart(args.dim).to(device)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    with coordinator.compile_once():
        for step in range(args.steps):
            loss = model(torch.randn(8, args.dim, device=device)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"rank {dist.get_rank()} step {step} loss {loss.item():.4f}", flush=True)
    stats = coordinator.stats()
    print(f"rank {dist.get_rank()}: {stats['graphs_compiled']} graphs compiled, "
          f"{stats['graphs_received']} received", flush=True)
    # DDP before its process group: a gloo group destroyed by DDP's reducer, which holds the
    # interpreter lock, can wait forever on its worker thread, which needs that lock.
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
