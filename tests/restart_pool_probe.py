"""Inductor's compile workers in a cold job and in its restart, as a GPU host would start them.

    restart_pool_probe.py STORE_DIR RUN [hits-only]

Poses as a GPU host to the session's compile workers (``_compat.compile_workers._cuda_host``;
Dynamo itself must still see a CPU), so that it sizes, starts or holds Inductor's pool as
on one, then compiles a small CPU model under ``compile_once`` with a ``file://`` store: in
a cold job (empty store) every graph misses; run again on an empty Inductor dir, every graph
hits, from the entries the index of the first run names. Then, unless ``hits-only``,
compiles a function no other run compiled (its constant is ``RUN``): a miss. Prints one
JSON object: ``compile_threads`` and whether the pool was up at the session's start, after
the model's compile and after the miss, and the session's ``compile_workers`` counts.
"""

import json
import sys


def main() -> None:
    import torch
    from torch._inductor import config

    import coordinator
    from coordinator import _compat
    from coordinator._compat import compile_workers

    compile_workers._cuda_host = lambda: True
    seen: dict = {"threads": {"torch": config.compile_threads}}

    def now(where: str) -> None:
        seen[where] = {"threads": config.compile_threads, "pool": _compat.pool_started()}

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with coordinator.compile_once(f"file://{sys.argv[1]}"):
        compiled = torch.compile(model)  # the session's compile part starts at the call
        now("start")
        compiled(torch.randn(8, 16)).sum().backward()
        now("model")
        if sys.argv[3:] != ["hits-only"]:
            run = float(sys.argv[2])
            torch.compile(lambda x: torch.sigmoid(x) * run + x.cos())(torch.randn(8))
            now("miss")
        seen["counts"] = coordinator.stats()["compile_workers"]
    now("after")
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
