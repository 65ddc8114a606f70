"""A training script that knows nothing of the coordinator (for coordinator-run tests).

    plain_script.py OUT_DIR [--fail N]

Compiles a tiny MLP (forward + backward) and writes ``OUT_DIR/rank<R>.json`` with
Inductor's FX cache counters, the backend Inductor's FX remote cache was given, and
what a Python process this worker starts finds at its start (``child``).
"""

import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist


def main() -> None:
    out_dir = sys.argv[1]
    if "--fail" in sys.argv:
        sys.exit(int(sys.argv[sys.argv.index("--fail") + 1]))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)))
    model(torch.randn(8, 16)).pow(2).mean().backward()
    from torch._dynamo.utils import counters
    from torch._inductor.remote_cache import RemoteFxGraphCache

    backend = RemoteFxGraphCache.backend_override_cls
    child = subprocess.run(
        [sys.executable, "-c", "import json, os, sys; print(json.dumps({'modules': sorted(m for m in sys.modules "
         "if m.split('.')[0] in ('coordinator', 'torch')), 'enable': os.environ.get('COORDINATOR_ENABLE'), "
         "'pythonpath': os.environ.get('PYTHONPATH', '')}))"],
        capture_output=True, text=True, check=True,
    )
    report = {
        "inductor": dict(counters["inductor"]),
        "backend": backend.__name__ if backend else None,
        "imported_by_script": False,
        "local_rank": os.environ.get("LOCAL_RANK"),
        "child": json.loads(child.stdout),
    }
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
