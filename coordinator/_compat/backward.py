"""AOTAutograd's deferred backward compiles, for a rank to run them early.

AOTAutograd compiles a graph's backward lazily, at its first backward call: unless the
graph saves symbolic ints, ``_aot_stage2b_bw_compile`` returns an
``AutogradLazyBackwardCompileInfo`` (the backward graph, its inputs already restrided to
the compiled forward's real output strides, the tracing and compile contexts) and no
compiled function. Everything that compile needs is known once the forward is compiled.
:func:`deferred_backwards` reports each such backward as a :class:`DeferredBackward`,
whose :meth:`~DeferredBackward.compile` runs the compile the first backward call would
run, with the forward metadata of that graph set on the tracing context (as
``_AutogradBackwardCompiler._prepare_lazy_backward_context`` does for DDPOptimizer's
split graphs, whose bucket counter it leaves alone), and returns the compiled function.
An early compile drops it: what it leaves is the FX-graph entry, in the store and in the
local cache, which the first backward call's own compile then loads.

Private names: ``_functorch._aot_autograd.graph_compile._aot_stage2b_bw_compile`` (its
arguments ``fw_metadata``, ``aot_config`` and, from 2.13, ``bw_compiler``; on 2.11 the
compiler is ``aot_config.bw_compiler``), the fields of ``AutogradLazyBackwardCompileInfo``
(``bw_module``, ``placeholder_list``, ``saved_context``, ``saved_compile_context``),
``TracingContext.fw_metadata`` and ``output_strides``, ``torch._guards.tracing`` and
``compile_context``, ``torch._dynamo.utils.get_metrics_context``,
``_functorch._aot_autograd.logging_utils.graph_being_compiled`` (``"<aot_id>_backward"``
while a backward compiles). Read from the sources of
2.11.0, 2.13.0 and 2.14.1; ran on 2.13.0 and 2.14.1 (CPU tests) and on 2.11.0 on an H100
(the max-autotune benchmark, the GPU tier). :func:`is_restart`:
``torch._dynamo.exc.RestartAnalysis`` (AOTAutograd raises its subclass
``TensorifyScalarRestartAnalysis``); ran on 2.13.0 and 2.14.1.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)


class SkipCompile(Exception):
    """Raised from a cache lookup to stop an early compile: another rank has the graph,
    or is compiling it. Never escapes :meth:`DeferredBackward.compile`."""


def _raised(exc: BaseException | None, kind: type[BaseException]) -> bool:
    """Whether ``exc`` is, or wraps (Inductor and Dynamo re-raise compile errors wrapped),
    a ``kind``."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__ or getattr(exc, "inner_exception", None)
        seen += 1
    return False


def is_restart(exc: BaseException | None) -> bool:
    """Whether ``exc`` is, or wraps, Dynamo's signal to trace the frame again
    (``RestartAnalysis``, e.g. AOTAutograd's ``TensorifyScalarRestartAnalysis``, which
    Dynamo's backend wrappers let through so the frame is traced again with a Python
    float specialized)."""
    try:
        from torch._dynamo.exc import RestartAnalysis
    except ImportError:
        return False
    return _raised(exc, RestartAnalysis)


def is_skip(exc: BaseException | None) -> bool:
    """Whether ``exc`` is, or wraps, a :class:`SkipCompile`."""
    return _raised(exc, SkipCompile)


class DeferredBackward:
    """One graph's backward that AOTAutograd will compile at its first backward call."""

    def __init__(self, info: Any, bw_compiler: Callable[..., Any], fw_metadata: Any, disable_amp: bool,
                 aot_id: Any = None, aot_config: Any = None) -> None:
        self.info = info
        self.bw_compiler = bw_compiler
        self.fw_metadata = fw_metadata
        self.disable_amp = disable_amp
        self.aot_id = aot_id
        self.aot_config = aot_config

    def compiling_now(self) -> bool:
        """Whether AOTAutograd is compiling this backward on this process right now (its
        first backward call is looking the graph up): compiling it again inside that
        compile would re-enter Inductor's config patch of the same graph."""
        from torch._functorch._aot_autograd import logging_utils

        return f"{self.aot_id}_backward" in getattr(logging_utils, "graph_being_compiled", [])

    def compile(self) -> Any:
        """Compile the backward now, as its first backward call would, and return the
        compiled function. Raises :class:`SkipCompile` if a lookup stopped it."""
        import torch
        from torch._dynamo.utils import get_metrics_context
        from torch._guards import compile_context, tracing

        info = self.info
        context = info.saved_context
        saved_metadata = getattr(context, "fw_metadata", None)
        saved_strides = getattr(context, "output_strides", None)
        saved_stride_values = None if saved_strides is None else list(saved_strides)
        amp = torch._C._DisableAutocast() if self.disable_amp else contextlib.nullcontext()
        try:
            with tracing(context), compile_context(info.saved_compile_context), amp, torch.no_grad(), \
                    get_metrics_context():
                if context is not None:
                    context.fw_metadata = self.fw_metadata
                return self.bw_compiler(copy.deepcopy(info.bw_module), info.placeholder_list)
        finally:
            if context is not None:
                # The forward compile this one ran inside of reads both after it.
                context.fw_metadata = saved_metadata
                if saved_strides is not None:
                    saved_strides[:] = saved_stride_values
                context.output_strides = saved_strides


@contextlib.contextmanager
def deferred_backwards(report: Callable[[DeferredBackward], None]) -> Iterator[None]:
    """Call ``report`` with each backward AOTAutograd defers to its first backward call,
    for the duration."""
    import torch
    from torch._functorch._aot_autograd import graph_compile

    original = graph_compile.__dict__["_aot_stage2b_bw_compile"]
    signature = inspect.signature(original)

    def bw_compile(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            info, compiled = result
            if compiled is None and info is not None and hasattr(info, "bw_module"):
                bound = signature.bind(*args, **kwargs).arguments
                aot_config = bound["aot_config"]
                bw_compiler = bound.get("bw_compiler") or aot_config.bw_compiler  # 2.11: on the config
                # The caller decides on autocast from the state it is in, as this is now.
                report(DeferredBackward(info, bw_compiler, bound["fw_metadata"],
                                        torch._C._is_any_autocast_enabled(), getattr(aot_config, "aot_id", None),
                                        aot_config))
        except Exception:  # never fail a compile over an optimisation
            log.warning("compile_once: could not record a deferred backward compile", exc_info=True)
        return result

    graph_compile._aot_stage2b_bw_compile = bw_compile
    try:
        yield
    finally:
        graph_compile._aot_stage2b_bw_compile = original
