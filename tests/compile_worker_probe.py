"""What a Triton compile job sees in Inductor's compile workers, before, inside and beside a session.

    compile_worker_probe.py STORE_DIR (started|not-started|no-jobs)

Hands Inductor's own pool of compile workers (``AsyncCompile.process_pool``: real worker
processes) the job Inductor hands it for each Triton kernel, ``_worker_compile_triton``,
with :func:`load` in place of the kernel's source: the "kernel" it builds records the
worker's ``TORCHINDUCTOR_REDIS_URL`` and whether Inductor's own remote autotune cache can
be built there, which is what a kernel's ``cached_autotune`` builds when its
``inductor_meta`` asks for one. Building it does not connect, so nothing here depends on
what listens on port 6379.

With ``started``, the script's own compile starts the pool before the session (one job);
then one job inside ``compile_once``, after a ``torch.compile`` call has started its compile
part (none with ``no-jobs``). The process poses as a GPU host
(``torch.cuda.is_available``, ``torch.version.cuda``), so that the session routes Triton's
autotune cache and sizes and starts the pool, as on one. Prints one JSON object: each job's
record, ``compile_threads`` before and inside the session, and whether the pool was up as
the session started.
"""

import json
import os
import sys


class Probe:
    """A stand-in for the kernel a compile worker loads and precompiles."""

    def __init__(self) -> None:
        from torch._inductor.remote_cache import create_cache

        self.pid = os.getpid()
        self.redis_url = os.environ.get("TORCHINDUCTOR_REDIS_URL")
        cache = create_cache("probe", False, "FbRemoteAutotuneCache", "RemoteAutotuneCache")
        self.builds_redis_cache = cache is not None

    def precompile(self, warm_cache_only: bool = False) -> None:
        pass

    def prepare_for_pickle(self) -> None:
        pass


def load() -> Probe:
    return Probe()


def job() -> dict:
    import compile_worker_probe  # this file by its module name, which the workers import
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.runtime.compile_tasks import _worker_compile_triton

    job = AsyncCompile.process_pool().submit(_worker_compile_triton, compile_worker_probe.load, {}, {})
    probe, _ = job.result(timeout=120)
    return {"pid": probe.pid, "redis_url": probe.redis_url, "builds_redis_cache": probe.builds_redis_cache}


def main() -> None:
    import torch
    from torch._inductor import config

    import coordinator
    from coordinator import _compat

    torch.cuda.is_available = lambda: True
    torch.version.cuda = torch.version.cuda or "13.0"
    store, mode = sys.argv[1], sys.argv[2]
    seen = {"threads": {"torch": config.compile_threads}}
    if mode == "started":
        seen["before"] = job()
    with coordinator.compile_once(f"file://{store}") as session:
        torch.compile(lambda x: x)  # the session's compile part starts at the call
        seen["threads"]["session"] = config.compile_threads
        seen["pool_at_start"] = _compat.pool_started()
        seen["routed"] = sorted(session.routed)
        if mode != "no-jobs":
            seen["during"] = job()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
