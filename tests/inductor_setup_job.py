"""A process that compiles a small MLP's training step (``tests/test_inductor_setup.py``).

    python inductor_setup_job.py OUT.json [--store URL] [--wait S]

With ``--store`` the process runs inside ``coordinator.compile_once(store=URL)``. It calls
``torch.compile``, waits ``S`` seconds (a script building DDP and its optimizer), then runs
the compiled forward and backward once. Writes the output and the gradients (as hex),
Inductor's pattern-matcher counters, the threads alive at the end, and the session's
``inductor_setup`` stats.
"""

import argparse
import json
import threading
import time

import torch
from torch._dynamo.utils import counters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--store", default=None)
    p.add_argument("--wait", type=float, default=0.0)
    args = p.parse_args()
    session = None
    if args.store:
        import coordinator

        session = coordinator.compile_once(store=args.store)
        session.__enter__()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    compiled = torch.compile(model)
    time.sleep(args.wait)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    out = compiled(x)
    out.square().mean().backward()
    record = {
        "output": [float.hex(v) for v in out.detach().flatten().tolist()],
        "grads": [float.hex(v) for p in model.parameters() for v in p.grad.flatten().tolist()[:8]],
        "patterns": {k: v for k, v in counters["inductor"].items() if k.startswith("pattern_matcher")},
        "fx_misses": counters["inductor"].get("fxgraph_cache_miss", 0),
        "threads": sorted(t.name for t in threading.enumerate()),
    }
    if session is not None:
        import coordinator

        record["setup"] = coordinator.stats()["inductor_setup"]
        session.__exit__(None, None, None)
    with open(args.out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
