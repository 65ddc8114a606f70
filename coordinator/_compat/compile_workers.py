"""Inductor's compile workers: what their jobs see, how many a rank starts, and when.

On a GPU, Inductor compiles Triton kernels in a pool of worker processes
(``AsyncCompile.process_pool``: a ``SubprocPool`` by default). Three things about it
matter to a session:

* **What a worker's job sees.** Routing the autotune cache switches
  ``autotune_remote_cache`` on, and Inductor bakes that switch into every kernel's
  ``inductor_meta``. A worker loading the kernel builds its own autotune cache from it,
  without our ``backend_override_cls``, so it falls back to Inductor's Redis backend on
  localhost:6379: with redis-py installed and no server there, redis-py retries each
  lookup for about 4 s. A worker's environment is the one its pool started with, which
  may be before the session (the script compiled something first, or the pool was
  started early), so an environment variable set in this process would not reach it.
  Inductor passes each job the variables it wants a running pool to see (``extra_env``
  of ``_worker_compile_triton``); :func:`compile_jobs_without_redis` adds an invalid
  ``TORCHINDUCTOR_REDIS_URL`` to them, which makes that backend fail at construction, at
  once (``create_cache`` logs it to the worker's log file and goes on without one). The
  kernel's cache is routed to the coordinator when it arrives in this process
  (``triton_tuning.route_autotune_cache``). Left alone where the user configured
  Inductor's Redis (its variables, or its remote autotune cache on before the session). A
  worker keeps the variable after the session; kernels compiled then ask for no remote
  autotune cache unless the user configured one, and then the guard was never set.
* **How many.** Each rank starts ``compile_threads`` workers, torch's default the smaller
  of 32 and the cores it may run on, whatever the number of ranks on the host: 2 ranks on
  32 cores start 64 workers, 8 ranks 256. :func:`size_compile_pool` gives each of a
  host's ranks its part of the cores instead (``LOCAL_WORLD_SIZE``), where the user set no
  number (``TORCHINDUCTOR_COMPILE_THREADS``) and the pool has not started. On CPU nothing
  is changed: there ``compile_threads`` sizes the thread pool that builds C++ kernels.
* **When.** Plain ``torch.compile`` starts the pool at its first compile (the ``inductor``
  backend module's ``maybe_warm_pool``), and until the workers are up the first graph
  builds its kernels one by one in the main process. :func:`warm_compile_pool` calls the
  same function when the session's compile part starts (the script's ``torch.compile``
  call); torch's ``TORCH_WARM_POOL=0`` turns both off.
  :func:`hold_compile_pool` keeps the pool from starting at all, for a restart whose
  entries all hit: with ``compile_threads`` at 1, ``AsyncCompile`` loads each kernel in
  the rank (``use_process_pool`` is false, ``maybe_warm_pool`` and ``warm_pool`` start
  nothing, ``submit`` runs its task at once), which a restart does faster than through
  workers that have nothing to compile (1.7 s of ``async_compile.wait`` against 0.8 s on
  an H200). ``compile_threads`` is not part of any cache key (``_cache_config_ignore_prefix``).

Private names: ``torch._inductor.async_compile`` (``maybe_warm_pool``,
``AsyncCompile.process_pool``, its ``lru_cache``), ``compile_worker.subproc_pool.SubprocPool``
and ``compile_worker.tracked_process_pool.TrackedProcessPoolExecutor`` (``submit``),
``runtime.compile_tasks._worker_compile_triton`` (its positional ``extra_env``, applied with
``os.environ.update`` in the worker), ``config.compile_threads`` (read through
``get_compile_threads`` by ``use_process_pool``, ``warm_pool``, ``submit``, ``process_pool``), ``remote_cache``'s
``RedisRemoteCacheBackend`` (reads ``TORCHINDUCTOR_REDIS_URL`` at construction). Read from the
sources of 2.11.0, 2.13.0 and 2.14.1; the jobs' environment and the pool's size ran on 2.13.0
and 2.14.1 (CPU tests, Inductor's own pool); all three (what a job sees, how many, when) on
2.11.0 (H200s).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

#: Inductor's Redis URL as compile workers' jobs see it while we route autotune caches.
NO_REDIS_URL = "coordinator-no-remote-cache-in-compile-workers://"
_REDIS_VARIABLES = ("TORCHINDUCTOR_REDIS_URL", "TORCHINDUCTOR_REDIS_HOST", "TORCHINDUCTOR_REDIS_PORT")
#: torch's own cap on a rank's compile workers (``config.decide_compile_threads``).
_TORCH_MAX_WORKERS = 32


def _pool_classes() -> tuple[type, ...]:
    from torch._inductor.compile_worker.subproc_pool import SubprocPool
    from torch._inductor.compile_worker.tracked_process_pool import TrackedProcessPoolExecutor

    return SubprocPool, TrackedProcessPoolExecutor


@contextlib.contextmanager
def compile_jobs_without_redis() -> Iterator[None]:
    """For the duration, every Triton compile job Inductor hands a compile worker, in a
    pool started before or after, carries ``TORCHINDUCTOR_REDIS_URL=NO_REDIS_URL``;
    nothing where the user configured Inductor's Redis (one of its variables is set)."""
    if any(name in os.environ for name in _REDIS_VARIABLES):
        yield
        return
    try:
        from torch._inductor.runtime.compile_tasks import _worker_compile_triton

        classes = _pool_classes()
    except ImportError as exc:  # another layout: at least the workers started from now on
        log.debug("compile_once: compile jobs not found (%s); guarding workers started from now on", exc)
        with _workers_started_without_redis():
            yield
        return

    def guarded(submit: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(submit)
        def submit_without_redis(self: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
            if fn is _worker_compile_triton and len(args) >= 2 and isinstance(args[1], dict):
                args = (args[0], {**args[1], "TORCHINDUCTOR_REDIS_URL": NO_REDIS_URL}, *args[2:])
            return submit(self, fn, *args, **kwargs)

        return submit_without_redis

    own = {cls: cls.__dict__.get("submit") for cls in classes}
    for cls in classes:
        cls.submit = guarded(cls.submit)
    try:
        yield
    finally:
        for cls, submit in own.items():
            if submit is None:
                del cls.submit  # inherited again
            else:
                cls.submit = submit


@contextlib.contextmanager
def _workers_started_without_redis() -> Iterator[None]:
    """The invalid URL in this process's environment, which workers started from now on inherit."""
    os.environ["TORCHINDUCTOR_REDIS_URL"] = NO_REDIS_URL
    try:
        yield
    finally:
        if os.environ.get("TORCHINDUCTOR_REDIS_URL") == NO_REDIS_URL:
            del os.environ["TORCHINDUCTOR_REDIS_URL"]


def pool_started() -> bool:
    """Whether this process has created Inductor's compile worker pool."""
    from torch._inductor.async_compile import AsyncCompile

    return AsyncCompile.process_pool.cache_info().currsize > 0


def _cuda_host() -> bool:
    """Whether this process runs where a CUDA GPU is (Triton's kernels, compile workers)."""
    import torch

    return torch.version.cuda is not None and torch.cuda.is_available()


def host_cpus() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def compile_pool_size(cpus: int, local_ranks: int) -> int:
    """Compile workers for each of ``local_ranks`` ranks on a host of ``cpus`` cores:
    torch's own number for one rank (the smaller of 32 and the cores), split among them."""
    return max(1, min(_TORCH_MAX_WORKERS, cpus // max(1, local_ranks)))


def size_compile_pool(local_ranks: int) -> int | None:
    """Give this rank its part of the host's cores for compile workers, where a CUDA GPU
    is, the user set no number (``TORCHINDUCTOR_COMPILE_THREADS``) and the pool has not
    started; returns the number set, or ``None`` where it left torch's."""
    if local_ranks < 2 or not _cuda_host():
        return None
    try:
        if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ or pool_started():
            return None
        from torch._inductor import config

        workers = compile_pool_size(host_cpus(), local_ranks)
        if config.compile_threads is not None and config.compile_threads <= workers:
            return None
        config.compile_threads = workers
    except Exception as exc:  # torch's own number, as without us
        log.debug("compile_once: could not size Inductor's compile workers: %s", exc)
        return None
    log.debug("compile_once: %d compile workers for this rank (%d ranks on this host)", workers, local_ranks)
    return workers


def warm_compile_pool() -> None:
    """Start Inductor's compile worker pool now, where a CUDA GPU is. Inductor's own
    function decides the rest as it would at its first compile: no Triton, or
    ``TORCH_WARM_POOL=0``, starts nothing."""
    if not _cuda_host():
        return
    try:
        from torch._inductor.async_compile import maybe_warm_pool

        maybe_warm_pool()
    except Exception as exc:  # Inductor starts it at its first kernel, as without us
        log.debug("compile_once: could not start Inductor's compile workers early: %s", exc)


def hold_compile_pool() -> Callable[[bool], None] | None:
    """Keep Inductor's compile workers from starting, where a CUDA GPU is, the pool has not
    started and it would have more than one worker: ``compile_threads`` at 1 until the
    returned ``release(start)`` puts the number back (unless something else changed it
    meanwhile) and, with ``start``, starts the pool as Inductor's first compile would.
    ``None``: nothing held. ``release`` is called on the thread that compiles."""
    if not _cuda_host():
        return None
    try:
        from torch._inductor import config

        if config.compile_threads is None:  # torch decides it lazily, at its first compile
            config.compile_threads = config.decide_compile_threads()
        if pool_started() or config.compile_threads <= 1:
            return None
        workers = config.compile_threads
        config.compile_threads = 1
    except Exception as exc:  # torch's own behaviour, as without us
        log.debug("compile_once: could not hold Inductor's compile workers: %s", exc)
        return None
    released = False

    def release(start: bool) -> None:
        nonlocal released
        if released:
            return
        released = True
        if config.compile_threads == 1:
            config.compile_threads = workers
        if start:
            warm_compile_pool()

    return release
