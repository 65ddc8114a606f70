"""Inductor's GEMM template selection: each choice compiled once, and split autotuning.

**Each choice compiled once.** Before timing a selection's choices, Inductor precompiles
them in parallel (``AlgorithmSelectorCache.make_precompile_fn``): a Triton template choice
goes to its compile workers once they are up (``AsyncCompile.use_process_pool()``), any
other to threads of this process. On torch 2.11 the timing that follows does not find the
workers' kernels (other Triton cache keys: ``benchmarks/tools/recompile_probe.py``) and
compiles each choice again, one at a time, in the rank's own thread: most of a
max-autotune compile. :func:`precompile_choices_in_process` sends a selection's
precompiles to the threads instead, whose kernels the timing then uses.

**Split autotuning.** Inductor times a selection's choices in
``AlgorithmSelectorCache.benchmark_choices`` (a classmethod: the choices and the tensors
they run on). :func:`split_choice_benchmarks`
replaces it while a session is active: each choice becomes a
:class:`coordinator.split_tuning.WorkItem` that runs Inductor's own timing of that
choice here, and a Triton template choice on a GPU also a :class:`TritonTemplateRequest`
that another rank can run: the template's benchmark request (``TritonBenchmarkRequest``,
which Inductor already keeps picklable for its autotune subprocesses) with the source
of the module it loads. The selection's key hashes the choices' ``hash_key()`` (the
template's source hash, the ATen kernel's name and arguments) and the tensors' shapes,
strides and dtypes. Collective benchmarks, CUTLASS choices and single-choice selections
are left to Inductor.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

log = logging.getLogger(__name__)

Select = Callable[[str, Sequence[Any]], "list[float] | None"]


class TritonTemplateRequest:
    """A Triton template choice's benchmark, for a rank that did not lower the graph."""

    def __init__(self, bmreq: Any, source: str) -> None:
        self.bmreq = bmreq
        self.source = source
        self.unusable = False

    def prepare(self) -> None:
        try:
            self._prepare()
        except Exception as exc:
            # As Inductor does for its own choices: a kernel too large for this GPU is
            # a choice that cannot win, not an error.
            if type(exc).__name__ != "OutOfResources" and "out of resource" not in str(exc):
                raise
            self.unusable = True

    def _prepare(self) -> None:
        import torch
        from torch._inductor.codecache import PyCodeCache

        key, path = PyCodeCache.write(self.source)
        self.bmreq.module_cache_key, self.bmreq.module_path = key, path
        device = torch.device("cuda", torch.cuda.current_device())
        for meta in [*self.bmreq.input_tensor_meta, self.bmreq.output_tensor_meta]:
            meta.device = device
        self.bmreq.precompile()

    def run(self) -> float:
        from torch._dynamo.utils import preserve_rng_state
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        if self.unusable:
            return float("inf")
        # A waiting rank may be inside its own compile: real tensors, and its RNG untouched.
        with unset_fake_temporarily(), preserve_rng_state():
            return self.bmreq.benchmark()

    def __repr__(self) -> str:
        return f"TritonTemplateRequest({self.bmreq.kernel_name})"


def _travelling_request(choice: Any) -> TritonTemplateRequest | None:
    bmreq = getattr(choice, "bmreq", None)
    if bmreq is None or type(bmreq).__name__ != "TritonGPUBenchmarkRequest":
        return None
    try:
        with open(bmreq.module_path) as f:
            source = f.read()
    except OSError:
        return None
    travelling = copy.copy(bmreq)
    travelling.input_tensor_meta = [copy.copy(meta) for meta in bmreq.input_tensor_meta]
    travelling.output_tensor_meta = copy.copy(bmreq.output_tensor_meta)
    for attribute in ("_benchmark_module", "n_regs"):
        if attribute in travelling.__dict__:
            setattr(travelling, attribute, None)
    return TritonTemplateRequest(travelling, source)


def _tensor_signature(tensors: Any) -> list[str]:
    import torch

    signature = []
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            signature.append(f"{tuple(tensor.shape)}:{tuple(tensor.stride())}:{tensor.dtype}:{tensor.device.type}")
        else:
            signature.append(repr(type(tensor)))
    return signature


def selection_key(choices: Sequence[Any], autotune_args: Any) -> str | None:
    """A key that names these choices on these tensor shapes, on every rank."""
    try:
        tensors = autotune_args.get_benchmark_tensors(False)
        inputs, output = tensors.unpack()
        parts = [*(choice.hash_key() for choice in choices), *_tensor_signature([*inputs, output])]
    except Exception:  # a choice without a stable key: Inductor tunes it alone
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:40]


@contextlib.contextmanager
def split_choice_benchmarks(select: Select, make_item: Callable[..., Any]) -> Iterator[None]:
    """While active, route Inductor's timing of a selection's choices through ``select``
    (``select(key, items)`` returns their timings, or ``None`` to let Inductor time them).
    ``make_item(name, run_here, request)`` builds one work item."""
    try:
        from torch._inductor.select_algorithm import AlgorithmSelectorCache
    except ImportError:
        yield
        return
    original = AlgorithmSelectorCache.__dict__.get("benchmark_choices")
    if not isinstance(original, classmethod):
        log.debug("AlgorithmSelectorCache.benchmark_choices not found; split autotuning is off")
        yield
        return
    benchmark = original.__func__

    def benchmark_choices(cls, choices, autotune_args, *args, **kwargs):
        is_collective = kwargs.get("is_collective", args[0] if args else False)
        if is_collective or len(choices) < 2 or any("CUTLASS" in type(c).__name__ for c in choices):
            return benchmark(cls, choices, autotune_args, *args, **kwargs)
        key = selection_key(choices, autotune_args)
        if key is None:
            return benchmark(cls, choices, autotune_args, *args, **kwargs)

        def run_here(choice):
            return lambda: benchmark(cls, [choice], autotune_args, *args, **kwargs)[choice]

        items = [make_item(str(getattr(c, "name", c)), run_here(c), _travelling_request(c)) for c in choices]
        timings = select(key, items)
        if timings is None:
            return benchmark(cls, choices, autotune_args, *args, **kwargs)
        return dict(zip(choices, timings, strict=True))

    AlgorithmSelectorCache.benchmark_choices = classmethod(benchmark_choices)
    try:
        yield
    finally:
        AlgorithmSelectorCache.benchmark_choices = original


_precompiling = threading.local()


@contextlib.contextmanager
def precompile_choices_in_process() -> Iterator[None]:
    """While active, a template selection's precompiles run in threads of this process
    (Inductor's path when its compile workers are not up), never in the workers."""
    try:
        from torch._inductor.async_compile import AsyncCompile
        from torch._inductor.select_algorithm import AlgorithmSelectorCache
    except ImportError:
        yield
        return
    original_make = AlgorithmSelectorCache.__dict__.get("make_precompile_fn")
    original_use_pool = AsyncCompile.__dict__.get("use_process_pool")
    if not callable(original_make) or not isinstance(original_use_pool, classmethod):
        log.debug("make_precompile_fn or AsyncCompile.use_process_pool not found; precompiles stay as they are")
        yield
        return
    use_pool = original_use_pool.__func__

    def make_precompile_fn(self, *args, **kwargs):
        depth = getattr(_precompiling, "depth", 0)
        _precompiling.depth = depth + 1
        try:
            return original_make(self, *args, **kwargs)
        finally:
            _precompiling.depth = depth

    def use_process_pool(cls):
        if getattr(_precompiling, "depth", 0):
            return False
        return use_pool(cls)

    AlgorithmSelectorCache.make_precompile_fn = make_precompile_fn
    AsyncCompile.use_process_pool = classmethod(use_process_pool)
    try:
        yield
    finally:
        AlgorithmSelectorCache.make_precompile_fn = original_make
        AsyncCompile.use_process_pool = original_use_pool


def reference_ms() -> float | None:
    """This GPU's time for a fixed matmul: the calibration of split autotuning's timings."""
    import torch

    if not torch.cuda.is_available():
        return None
    from torch._dynamo.utils import preserve_rng_state
    from torch._inductor.runtime.benchmarking import benchmarker
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), preserve_rng_state():
        a = torch.randn(2048, 2048, dtype=torch.float16, device="cuda")
        return float(benchmarker.benchmark_gpu(lambda: a @ a))


def device_name() -> str:
    """A name for this process's device, the same in every process that uses it."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    index = torch.cuda.current_device()
    try:
        return f"cuda-{torch.cuda.get_device_properties(index).uuid}"
    except Exception:
        return f"cuda-{index}"
