"""Two compiled functions under ``compile_once`` with a ``file://`` store, counting C++ builds.

    isa_probe_job.py STORE_DIR (both|second)

``both`` compiles ``first`` then ``second`` (Inductor probes the CPU's vector instructions
while compiling ``first``); ``second`` compiles only the second function. Prints one JSON
object: this process's C++ compiler runs by kind (``tests/worker.py``'s ``count_cpp_builds``)
and its FX-graph hits and misses.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import torch
    from worker import count_cpp_builds

    import coordinator

    builds = count_cpp_builds()
    with coordinator.compile_once(f"file://{sys.argv[1]}"):
        if sys.argv[2] == "both":
            torch.compile(lambda x: torch.relu(x) * 2 + 1)(torch.randn(64))
        torch.compile(lambda x: torch.tanh(x).sum(0) + x.mean())(torch.randn(8, 64))
        fx = coordinator.stats()["by_cache"]["fx_graph"]
    print(json.dumps({"builds": builds, "hits": fx["hits"], "misses": fx["misses"]}))


if __name__ == "__main__":
    main()
