"""Counters the tests and benchmarks read (``coordinator.testing``): Triton compiles
(``triton.runtime.cache.FileCacheManager.put``) and Inductor's own counters
(``torch._dynamo.utils.counters``). Not used by the coordinator itself.

Private names: ``FileCacheManager.put`` (cubins Triton compiles), ``torch._dynamo.utils.counters``,
``torch._dynamo.utils.compilation_time_metrics`` (frames traced). Ran on 2.13.0 and 2.14.1 in
the CPU suite, on 2.11.0 in the GPU tier on an H100 and an H200.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def count_triton_compiles() -> Callable[[], int]:
    """Start counting cubins that Triton compiles put into its cache (not the ones an FX
    hit emits straight to disk); returns a function giving the count so far. For the GPU
    tests and benchmarks."""
    from triton.runtime.cache import FileCacheManager

    original = FileCacheManager.put
    count = [0]

    def put(self: Any, data: Any, filename: str, binary: bool = True) -> Any:
        count[0] += filename.endswith(".cubin")
        return original(self, data, filename, binary)

    FileCacheManager.put = put
    return lambda: count[0]


def inductor_counters() -> dict[str, int]:
    """A copy of Inductor's counters (fxgraph_cache_hit/miss, ...)."""
    from torch._dynamo.utils import counters

    return dict(counters["inductor"])


def frames_traced() -> int:
    """Frames whose bytecode Dynamo traced in this process (its ``bytecode_tracing``
    phase; frames it skips without tracing, and functions installed from a precompiled
    package, add none)."""
    from torch._dynamo.utils import compilation_time_metrics

    return len(compilation_time_metrics.get("bytecode_tracing", ()))
