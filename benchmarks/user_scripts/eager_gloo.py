"""A training script that never compiles: a small MLP trained eagerly with DDP over gloo, three
steps. It never imports coordinator. What a launcher costs such a job: its ``import torch``,
launch and exit.

    torchrun --standalone --nproc-per-node 1 eager_gloo.py

Step marks on stderr (``HFSTEP start|end rank=R step=S ... t=SECONDS``), one ``HFJOB {json}``
line per rank on stdout (its ``import torch`` and set-up seconds, step times, losses).
"""
import json
import sys
import time

T_START = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

T_IMPORTED = time.time()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t0 = last = time.time()
    losses, step_s = [], []
    for step in range(3):
        print(f"HFSTEP start rank={rank} step={step + 1} t={time.time():.3f}", file=sys.stderr, flush=True)
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        now = time.time()
        step_s.append(round(now - last, 3))
        print(f"HFSTEP end rank={rank} step={step + 1} t={now:.3f}", file=sys.stderr, flush=True)
        last = now
    print("HFJOB " + json.dumps({
        "rank": rank, "step_s": step_s, "losses": losses, "import_s": round(T_IMPORTED - T_START, 3),
        "setup_s": round(t0 - T_IMPORTED, 3), "total_s": round(time.time() - T_START, 3), "t_start_abs": T_START,
        "loaded": sorted(m for m in ("torch._dynamo", "torch._inductor", "triton", "redis") if m in sys.modules),
    }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
