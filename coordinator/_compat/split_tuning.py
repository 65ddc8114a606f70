"""Inductor's GEMM template selection, tuned in shares: the hook and what it hands over.

In max-autotune, ``AlgorithmSelectorCache.__call__`` builds a precompile function for a
selection's choices (``make_precompile_fn``, which starts their compiles at once) and
then times them (``do_autotuning``: precompile, Inductor's local timing cache, benchmark,
and a ``{choice: ms}`` map whose minimum wins). :func:`split_selections` patches both:

* ``make_precompile_fn``: where ``wants()`` says this process tunes selections in shares,
  it starts no compile and returns a :class:`DeferredPrecompile` that remembers its
  arguments;
* ``do_autotuning``: handed a deferred precompile, it gives ``tune`` a :class:`Selection`
  (its key, the choices' hashes, and ``benchmark(indices)``, which runs Inductor's own
  ``do_autotuning`` on those choices alone, with a precompile of those choices alone) and
  returns the ``{choice: ms}`` map ``tune`` gives back, in ``tune``'s order (Inductor picks
  the first minimum, so the order is the tie-break).

Everything else goes Inductor's way: a selection ``tune`` declines, one with a hint
override, a best-config future, a collective choice, or pipelined autotuning runs the
original path with a precompile of all its choices. Where a patched function is not as
expected (another torch), nothing is patched, with a debug line: selections are tuned as
Inductor tunes them.

Private names: ``AlgorithmSelectorCache.make_precompile_fn`` (parameters ``choices``,
``name``, ``inputs_key``), ``AlgorithmSelectorCache.do_autotuning`` (parameters ``name``,
``inputs_key``, ``choices``, ``precompile_fn``, and ``hint_override``,
``best_config_future``, ``is_collective`` where present), ``ChoiceCaller.hash_key``,
``NoValidChoicesError``, ``select_algorithm.use_pipelined_autotuning`` (where present).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

#: The parameters each patched function must have.
_MAKE_PARAMETERS = ("self", "choices", "name", "inputs_key")
_TUNE_PARAMETERS = ("self", "name", "inputs_key", "choices", "precompile_fn")

_state = threading.local()


class Selection:
    """One GEMM selection as the split sees it: its key, its choices' hashes, and how to
    benchmark some of them on this rank's device."""

    def __init__(self, key: str, names: list[str], hashes: list[str],
                 benchmark: Callable[[list[int]], dict[int, float]]) -> None:
        #: Inductor's key of the selection: operation name, input layouts, matmul precision
        #: and every choice's hash (the same on every rank that makes this selection).
        self.key = key
        #: Each choice's name, in Inductor's order (for log lines).
        self.names = names
        #: A short digest of each choice's ``hash_key()``, in Inductor's order.
        self.hashes = hashes
        self._benchmark = benchmark

    def __len__(self) -> int:
        return len(self.hashes)

    def benchmark(self, indices: list[int]) -> dict[int, float]:
        """Precompile and time the choices at ``indices`` here (Inductor's own path on those
        choices alone, its local timing cache included): index -> ms; a choice that failed
        to compile or to run is ``inf``."""
        return self._benchmark(indices)


class DeferredPrecompile:
    """A selection's precompile, not started: :meth:`start` makes Inductor's."""

    precompile_key = None

    def __init__(self, make: Callable[..., Any], owner: Any, arguments: dict[str, Any]) -> None:
        self._make = make
        self._owner = owner
        self.arguments = arguments

    def start(self, choices: list | None = None) -> Any:
        """Inductor's precompile function of ``choices`` (default: all of the selection's)."""
        arguments = dict(self.arguments)
        if choices is not None:
            arguments["choices"] = choices
        with _original_calls():
            return self._make(self._owner, **arguments)

    def __call__(self) -> Any:
        return self.start()()


@contextlib.contextmanager
def _original_calls() -> Iterator[None]:
    outer = getattr(_state, "original", False)
    _state.original = True
    try:
        yield
    finally:
        _state.original = outer


def _missing(function: Any, wanted: tuple[str, ...]) -> list[str] | None:
    """The parameters of ``wanted`` that ``function`` lacks (``None``: not inspectable). A
    wrapper that names what it wraps (``functools.wraps``) is seen through."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return None
    return [name for name in wanted if name not in parameters]


def split_tuning_unsupported() -> str | None:
    """Why this torch's selections cannot be tuned in shares, or ``None``."""
    try:
        from torch._inductor import select_algorithm
    except ImportError as exc:
        return f"no torch._inductor.select_algorithm ({exc})"
    cache = getattr(select_algorithm, "AlgorithmSelectorCache", None)
    if cache is None or not hasattr(select_algorithm, "NoValidChoicesError"):
        return "AlgorithmSelectorCache or NoValidChoicesError not found"
    for name, wanted in (("make_precompile_fn", _MAKE_PARAMETERS), ("do_autotuning", _TUNE_PARAMETERS)):
        function = cache.__dict__.get(name)
        missing = _missing(function, wanted) if callable(function) else None
        if missing is None or missing:
            return f"AlgorithmSelectorCache.{name} is not as expected (missing {missing or 'the function'})"
    return None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _pipelined(select_algorithm: Any) -> bool:
    check = getattr(select_algorithm, "use_pipelined_autotuning", None)
    try:
        return bool(check()) if callable(check) else False
    except Exception:
        return True  # unknown: Inductor's way


@contextlib.contextmanager
def split_selections(wants: Callable[[], bool],
                     tune: Callable[[Selection], dict[int, float] | None]) -> Iterator[None]:
    """While active, GEMM selections are timed by ``tune`` where ``wants()`` (see the module).

    ``tune(selection)`` returns index -> ms for every choice, in the order whose first
    minimum must win, or ``None`` to tune the selection as Inductor does.
    """
    reason = split_tuning_unsupported()
    if reason is not None:
        log.debug("split tuning: %s; selections are tuned as Inductor tunes them", reason)
        yield
        return
    from torch._inductor import select_algorithm

    cache = select_algorithm.AlgorithmSelectorCache
    original_make = cache.__dict__["make_precompile_fn"]
    original_tune = cache.__dict__["do_autotuning"]
    make_precompile_fn = _deferring_make(original_make, wants)
    do_autotuning = _tuning_in_shares(original_tune, select_algorithm, tune)
    cache.make_precompile_fn = make_precompile_fn
    cache.do_autotuning = do_autotuning
    try:
        yield
    finally:
        cache.make_precompile_fn = original_make
        cache.do_autotuning = original_tune


def _deferring_make(original_make: Callable[..., Any], wants: Callable[[], bool]) -> Callable[..., Any]:
    """``make_precompile_fn``, patched: a :class:`DeferredPrecompile` where ``wants()``."""
    make_signature = inspect.signature(original_make)

    @functools.wraps(original_make)
    def make_precompile_fn(self, *args, **kwargs):
        if getattr(_state, "original", False):
            return original_make(self, *args, **kwargs)
        try:
            wanted = wants()
        except Exception:
            log.debug("split tuning: deciding failed; this selection is tuned as Inductor tunes it", exc_info=True)
            wanted = False
        if not wanted:
            return original_make(self, *args, **kwargs)
        bound = make_signature.bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        arguments["choices"] = list(arguments["choices"])
        return DeferredPrecompile(original_make, self, arguments)

    return make_precompile_fn


def _tuning_in_shares(original_tune: Callable[..., Any], select_algorithm: Any,
                      tune: Callable[[Selection], dict[int, float] | None]) -> Callable[..., Any]:
    """``do_autotuning``, patched: a deferred precompile's selection timed by ``tune``."""
    tune_signature = inspect.signature(original_tune)
    no_valid_choices = select_algorithm.NoValidChoicesError

    @functools.wraps(original_tune)
    def do_autotuning(self, *args, **kwargs):
        bound = tune_signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        deferred = arguments.get("precompile_fn")
        if not isinstance(deferred, DeferredPrecompile):
            return original_tune(self, *args, **kwargs)
        choices = list(arguments["choices"])
        timings = None
        if (arguments.get("hint_override") is None and arguments.get("best_config_future") is None
                and not arguments.get("is_collective") and not _pipelined(select_algorithm)
                and len(choices) > 1):
            selection = _selection(bound, choices, deferred, original_tune, no_valid_choices)
            timings = _tuned(tune, selection, choices, arguments["name"])
        if timings is None:
            arguments["precompile_fn"] = deferred.start(choices)
            return original_tune(*bound.args, **bound.kwargs)
        if all(not math.isfinite(timing) for timing in timings.values()):
            raise no_valid_choices
        return timings

    return do_autotuning


def _selection(bound: inspect.BoundArguments, choices: list, deferred: DeferredPrecompile,
               original_tune: Callable[..., Any], no_valid_choices: type[Exception]) -> Selection:
    """The :class:`Selection` of ``do_autotuning``'s arguments ``bound``: its ``benchmark``
    runs Inductor's ``do_autotuning`` on some choices alone."""
    import torch

    arguments = bound.arguments
    name, inputs_key = arguments["name"], arguments["inputs_key"]
    hashes = [_digest(choice.hash_key()) for choice in choices]
    key = _digest("\0".join([str(name), str(inputs_key), torch.get_float32_matmul_precision(), *sorted(hashes)]))

    def benchmark(indices: list[int]) -> dict[int, float]:
        subset = [choices[i] for i in indices]
        share = inspect.BoundArguments(bound.signature, bound.arguments.copy())
        share.arguments["choices"] = subset
        share.arguments["precompile_fn"] = deferred.start(subset)
        try:
            with _original_calls():
                measured = original_tune(*share.args, **share.kwargs)
        except no_valid_choices:
            measured = {}
        by_choice = {id(choice): timing for choice, timing in (measured or {}).items()}
        return {i: float(by_choice.get(id(choices[i]), math.inf)) for i in indices}

    return Selection(key, [str(getattr(choice, "name", "?")) for choice in choices], hashes, benchmark)


def _tuned(tune: Callable[[Selection], dict[int, float] | None], selection: Selection, choices: list,
           name: Any) -> dict[Any, float] | None:
    """``tune``'s timings of ``selection``, by choice (``None``: tune it as Inductor does)."""
    try:
        result = tune(selection)
    except Exception:
        log.warning("compile_once: tuning a %s selection in shares failed; it is tuned here as Inductor tunes "
                    "it", name, exc_info=True)
        return None
    if result is None:
        return None
    return {choices[i]: result[i] for i in result}


def gpu_identity() -> tuple[str | None, str]:
    """This process's GPU, named the same in every process that uses it, if the process
    looks like it has one of its own: ``(identity, "")``, or ``(None, why not)``.

    One GPU per rank of the node: the process sees at least ``LOCAL_WORLD_SIZE`` GPUs and
    uses the one of its ``LOCAL_RANK``, or it sees one GPU (``CUDA_VISIBLE_DEVICES`` naming
    one device, as torchrun's ``--virtual-local-rank`` sets it). Whether another process
    uses the same one is for the caller to find out (the identity is the device's UUID).
    """
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA device"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    count = torch.cuda.device_count()
    index = torch.cuda.current_device()
    visible = [part for part in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if part.strip()]
    if count >= local_world and count > 1:
        if index != local_rank % count:
            return None, f"rank uses cuda:{index}, not cuda:{local_rank} of its {count} GPUs"
    elif not (count == 1 and len(visible) == 1):
        return None, f"{count} GPU(s) for {local_world} local ranks"
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return None, "the GPU's UUID is unknown"
    return f"cuda-{uuid}", ""
