"""One rank of a job that trains eagerly and may compile later (``tests/test_first_compile.py``).

    python first_compile_job.py (collectives|eager|compile|optimize|library) [--compile-once URL] [--import-triton]

Launched by ``torchrun`` or ``coordinator-run`` (gloo, CPU). Every rank trains a small MLP
under DDP for two eager steps (``collectives``: all-reduces a tensor instead, which imports
no Dynamo module: torch's optimizers and DDP import Dynamo, also in a job that never
compiles), then:

* ``collectives``, ``eager``: nothing more: the job never compiles;
* ``compile``: calls ``torch.compile`` on a function and runs it (the same inputs on every rank);
* ``optimize``: the same through ``torch._dynamo.optimize("inductor")``, which never calls
  ``torch.compile``: a frame reaches Dynamo with no other sign of a compile before it;
* ``library``: imports a library that decorates a helper with ``torch.compile`` as it is
  imported (``tests/compiled_library.py``), and never calls it.

With ``--compile-once URL`` the training runs inside ``coordinator.compile_once(URL)``
(``default``: the job's own store) under a plain ``torchrun``; with ``--import-triton`` the
script imports Triton after torch, as a library would, and compiles no Triton kernel.

Each rank writes ``rank<R>.json`` into ``FIRST_JOB_OUT``: the environment at the script's first line,
after ``import torch`` and at the end, ``sys.path`` at the first line, the Dynamo, Inductor,
Redis and Triton modules loaded and the Python threads and child processes alive before the
compile, the keys of the job's TCPStore after a barrier (rank 0), whether the coordinator's
session started, its stats, and the compiled function's output.
"""

import os
import sys

FIRST_ENV = dict(os.environ)
FIRST_PATH = list(sys.path)

import importlib  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402

import torch  # noqa: E402

AFTER_IMPORT_ENV = dict(os.environ)

import torch.distributed as dist  # noqa: E402, I001
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

def loaded() -> list[str]:
    return sorted(name for name in sys.modules if name.split(".")[0] in ("redis", "triton")
                  or name.startswith(("torch._dynamo", "torch._inductor")))


def children() -> list[int]:
    """Processes this one started that are still alive (Linux's per-thread child lists)."""
    found = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            found += [int(pid) for pid in f.read().split()]
    return found


def session():
    api = sys.modules.get("coordinator.api")
    return None if api is None else api.current_session()


def train(mode: str, steps: int = 2) -> float:
    if mode == "collectives":
        total = torch.ones(4)
        dist.all_reduce(total)
        return float(total.sum())
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return float(loss)


def compiled_output(mode: str) -> list[float]:
    def f(x):
        return (x * 3.0).sin() + x.cos() * x

    if mode == "compile":
        fn = torch.compile(f)
    else:
        dynamo = importlib.import_module("torch._dynamo")
        fn = dynamo.optimize("inductor")(f)
    return fn(torch.linspace(-1, 1, 16)).tolist()


def main() -> None:
    mode = sys.argv[1]
    url = sys.argv[sys.argv.index("--compile-once") + 1] if "--compile-once" in sys.argv else None
    if "--import-triton" in sys.argv:
        import triton  # noqa: F401
    if mode == "library":
        import compiled_library  # noqa: F401
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record = {"rank": rank, "mode": mode}
    context = None
    if url is not None:
        import coordinator

        context = coordinator.compile_once(None if url == "default" else url)
        context.__enter__()
        record["env_in_compile_once"] = dict(os.environ)
    record["loss"] = train(mode)
    record["before_compile"] = {"modules": loaded(), "threads": sorted(t.name for t in threading.enumerate()),
                                "children": children(),
                                "started": bool(session() is not None and session().started)}
    if "--import-triton" in sys.argv:
        from triton import knobs

        manager = knobs.cache.__dict__.get("manager_class")
        record["triton_manager"] = None if manager is None else manager.__name__
    if mode in ("compile", "optimize"):
        record["output"] = compiled_output(mode)
    dist.barrier()
    if rank == 0:
        from torch.distributed.distributed_c10d import _get_default_store

        record["store_keys"] = _get_default_store().num_keys()
    dist.barrier()
    if context is not None:
        context.__exit__(None, None, None)
    current = session()
    record["started"] = bool(current is not None and current.started)
    if current is not None:
        import coordinator

        record["stats"] = coordinator.stats()
    record.update(first_env=FIRST_ENV, after_import_env=AFTER_IMPORT_ENV, end_env=dict(os.environ),
                  first_path=FIRST_PATH)
    with open(os.path.join(os.environ["FIRST_JOB_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
