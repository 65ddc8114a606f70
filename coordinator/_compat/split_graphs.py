"""AOTAutograd's cache for the graphs DDPOptimizer splits out of a DDP model.

DDPOptimizer compiles each bucket's submodule with ``TracingContext.fakify_first_call``
set: the first call of the compiled submodule, on fake inputs, must return fake
outputs carrying Inductor's output strides, which DDPOptimizer hands to the next
bucket's compile. AOTAutograd produces them with ``FakifiedOutWrapper``: the
``meta["val"]`` of every forward-graph output, re-strided to Inductor's strides,
returned once. A cache hit builds no forward graph, so AOTAutograd's cache bypasses
these graphs (``check_cacheable``) and every restart re-runs AOTAutograd for each of
them, although every FX graph hits.

:func:`cached_split_graphs` closes that gap:

* **Miss.** The key is computed as for any graph (``check_cacheable`` runs with the
  flag hidden, every other check intact). When the forward is compiled, the fake
  outputs are *described*: for each output its size, stride, storage offset, storage
  size, dtype, device, requires_grad, whether it is a view, and which earlier output
  it is identical to; symbolic values as the shape environment's expressions, printed
  as Inductor prints its own strides. The description is kept only if rebuilding it
  gives back exactly those fake outputs, checked right there against the originals;
  else the graph is not saved, as before. The description is saved inside the
  AOTAutograd entry (an attribute of the pickled result), so it travels wherever the
  entry does: the local cache, the coordinator's store, Mega-Cache bundles.
* **Hit.** The entry must carry a description; the loaded FX entry's output strides,
  read as ``FakifiedOutWrapper`` reads them, must equal the recorded ones, output for
  output; every symbol must exist in this shape environment. Then the fake outputs are
  rebuilt in this tracing context's fake mode, returned by the first call where the
  miss path would return them, and the tracing context's ``fw_metadata`` is set as the
  miss path sets it. Any failed check is an ``FXGraphCacheMiss``: the graph is compiled
  and saved again, never guessed.
* **Backward bucket count.** DDPOptimizer counts the buckets of a frame up as it
  compiles them; each lazily compiled backward counts down, to find its bucket's
  ``fw_metadata``. A hit has its backward already, so it would leave its slot unused
  and give the next lazily compiled (missed) backward the wrong metadata. The hit's
  backward takes its slot at its first call instead, where the miss's lazy compile
  would have: its bucket is counted down as torch would count it.

Left to the bypass, as before: tensor subclasses, functionalized RNG, effect tokens,
async-collective inputs, unbacked symbols, outputs that share storage without being
the same tensor or alias an input, and any output whose rebuild differs.

Private names (2.11.0, 2.13.0, 2.14.1): ``autograd_cache.check_cacheable``,
``AOTAutogradCache.save``, ``FXGraphCacheMiss``,
``runtime_wrappers.FakifiedOutWrapper`` (``pre_compile``, ``post_compile``,
``out_metas``, ``fwd_output_strides``, ``needs_post_compile``),
``GenericAOTAutogradResult.wrap_post_compile`` (``compiled_fw``/``compiled_bw`` with
``post_compile``, ``runtime_metadata``, ``maybe_subclass_meta``),
``CompiledFxGraph.output_strides``, ``CompiledBackward.num_symints_saved_for_bw_``,
``AOTConfig.cache_info.cache_key`` and ``force_non_lazy_backward_lowering``,
``TracingContext.fakify_first_call``/``fw_metadata``/``ddp_optimizer_ctx``,
``DDPOptimizerContext.curr_bucket``, ``ShapeEnv.deserialize_symexpr``,
``SymExprPrinter``; ``fake_outputs``, which describes and rebuilds the fake tensors, has its
own. Read from the sources of 2.11.0, 2.13.0 and 2.14.1 (``SPLIT_GRAPH_VERSIONS``,
``CHECKED_ON["split_graphs"]``, lists where it is on); the tests
(``tests/test_split_graphs.py``) ran on all three on CPU; on 2.11.0 on an H100 (the restart
benchmark, the GPU tier).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from coordinator._compat.fake_outputs import (
    Mismatch,
    Undescribable,
    describe_outputs,
    final_attributes,
    not_describable_runtime,
    rebuild_outputs,
    restrided,
    same_outputs,
    strides_as_read,
)
from coordinator._compat.versions import CHECKED_ON, unchecked

log = logging.getLogger(__name__)

#: Torch versions (major, minor) whose sources this was read from and whose tests pass.
SPLIT_GRAPH_VERSIONS = CHECKED_ON["split_graphs"]

#: The attribute of an AOTAutograd entry that holds the description of its fake outputs.
RECORD_ATTRIBUTE = "_coordinator_fake_outputs"
_RECORD_VERSION = 3


def split_graphs_unsupported() -> str | None:
    """Why this torch cannot serve DDPOptimizer's split graphs from the cache, or ``None``."""
    import torch

    why = unchecked("split_graphs")
    if why is not None:
        return why
    try:
        _patch_points()
    except (ImportError, AttributeError) as exc:
        return f"torch {torch.__version__} lacks {exc}"
    return None


def _patch_points() -> tuple[Any, Any, Any, Any]:
    from torch._functorch._aot_autograd import aot_autograd_result, autograd_cache, runtime_wrappers

    for owner, name in ((autograd_cache, "check_cacheable"), (autograd_cache, "FXGraphCacheMiss"),
                        (autograd_cache.AOTAutogradCache, "save"),
                        (runtime_wrappers.FakifiedOutWrapper, "pre_compile"),
                        (runtime_wrappers.FakifiedOutWrapper, "post_compile"),
                        (aot_autograd_result.GenericAOTAutogradResult, "wrap_post_compile")):
        getattr(owner, name)
    return autograd_cache, runtime_wrappers, aot_autograd_result, autograd_cache.AOTAutogradCache


def aot_autograd_cache_hits() -> int:
    """AOTAutograd cache hits in this process so far (torch's own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["aot_autograd"].get("autograd_cache_hit", 0))


# -- the patches --------------------------------------------------------------------------


class SplitGraphCache:
    """The patches that let AOTAutograd's cache save and serve DDPOptimizer's split
    graphs, with their state: the descriptions of fake outputs compiled in this process,
    kept until their graph's entry is saved.

    Events, passed to ``report(event, detail)``: ``saved`` (a miss saved with its fake
    outputs), ``bypassed`` (a miss left to the bypass: its outputs cannot be described),
    ``served`` (a hit whose fake outputs were rebuilt), ``refused`` (a hit turned into a
    miss: no description, or one that does not fit).
    """

    def __init__(self, report: Callable[[str, str], None] | None = None) -> None:
        from torch._guards import TracingContext

        self._report = report
        self._context = TracingContext
        self._cache_module, runtime_wrappers, aot_autograd_result, self._cache_class = _patch_points()
        self._wrapper_class = runtime_wrappers.FakifiedOutWrapper
        self._result_class = aot_autograd_result.GenericAOTAutogradResult
        self._miss = self._cache_module.FXGraphCacheMiss
        self._originals: dict[str, Any] = {}
        #: AOTAutograd key -> description of its fake outputs (None: not describable).
        self._described: dict[str, dict | None] = {}
        #: AOTAutograd key -> describes its fake outputs, once they are final.
        self._undescribed: dict[str, Callable[[], None]] = {}

    def _event(self, event: str, detail: str = "") -> None:
        if event in ("bypassed", "refused"):
            log.info("compile_once: DDP split graph %s from AOTAutograd's cache: %s",
                     "not saved" if event == "bypassed" else "not loaded", detail)
        if self._report is not None:
            self._report(event, detail)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The patches, for the duration."""
        owners = {"check_cacheable": self._cache_module, "save": self._cache_class,
                  "pre_compile": self._wrapper_class, "post_compile": self._wrapper_class,
                  "wrap_post_compile": self._result_class}
        for name, owner in owners.items():
            self._originals[name] = owner.__dict__[name]
        patches = {"check_cacheable": self._check_cacheable, "save": staticmethod(self._save),
                   "pre_compile": self._pre_compile, "post_compile": self._post_compile,
                   "wrap_post_compile": self._wrap_post_compile}
        try:
            for name, patch in patches.items():
                setattr(owners[name], name, patch)
            yield
        finally:
            for name, owner in owners.items():
                setattr(owner, name, self._originals[name])

    # -- a miss: the key, the description, the save -------------------------------------------

    def _check_cacheable(self, gm: Any) -> None:
        context = self._context.try_get()
        if context is None or not context.fakify_first_call:
            return self._originals["check_cacheable"](gm)
        context.fakify_first_call = False  # every other check still runs
        try:
            return self._originals["check_cacheable"](gm)
        finally:
            context.fakify_first_call = True

    @property
    def _pre_compile(self) -> Callable[..., None]:
        original = self._originals["pre_compile"]

        def pre_compile(wrapper: Any, fw_module: Any, *args: Any, **kwargs: Any) -> None:
            import torch

            original(wrapper, fw_module, *args, **kwargs)
            if wrapper.needs_post_compile:
                wrapper._coordinator_inputs = [
                    node.meta["val"] for node in fw_module.graph.find_nodes(op="placeholder")
                    if isinstance(node.meta.get("val"), torch.Tensor)
                ]

        return pre_compile

    @property
    def _post_compile(self) -> Callable[..., Any]:
        original = self._originals["post_compile"]
        cache = self

        def post_compile(wrapper: Any, compiled_fn: Any, aot_config: Any, *, runtime_metadata: Any) -> Any:
            cache_info = getattr(aot_config, "cache_info", None)
            if not wrapper.needs_post_compile or cache_info is None:
                return original(wrapper, compiled_fn, aot_config, runtime_metadata=runtime_metadata)
            originals = list(wrapper.out_metas)
            result = original(wrapper, compiled_fn, aot_config, runtime_metadata=runtime_metadata)
            key, fake_mode = cache_info.cache_key, cache._context.get().fake_mode
            # Described as DDPOptimizer receives them: at the first call, or at the save if
            # that comes first (a backward compiled eagerly is saved before the first call).
            # Not earlier: the backward's compile tags the forward's outputs it takes as
            # inputs (Inductor's ``_is_inductor_static``, which its cache keys read).
            cache._undescribed[key] = lambda: cache._describe(key, originals, wrapper, runtime_metadata, fake_mode)

            @functools.wraps(result)
            def first_call(args: Any) -> Any:
                describe = cache._undescribed.pop(key, None)
                if describe is not None:
                    describe()
                return result(args)

            return first_call

        return post_compile

    def _describe(self, key: str, originals: list[Any], wrapper: Any, runtime_metadata: Any, fake_mode: Any) -> None:
        try:
            self._described[key] = self._description(originals, wrapper, runtime_metadata, fake_mode)
        except (Undescribable, Mismatch) as exc:
            self._described[key] = None
            self._event("bypassed", f"{key}: {exc}")
        except Exception as exc:  # an unexpected shape of torch: leave the graph to the bypass
            self._described[key] = None
            log.warning("compile_once: could not describe the fake outputs of %s", key, exc_info=True)
            self._event("bypassed", f"{key}: {exc}")

    def _description(self, originals: list[Any], wrapper: Any, runtime_metadata: Any, fake_mode: Any) -> dict:
        """The description of a fakified first call's outputs, checked against them."""
        reason = not_describable_runtime(runtime_metadata, None)
        if reason:
            raise Undescribable(reason)
        record = describe_outputs(originals, getattr(wrapper, "_coordinator_inputs", []))
        rebuilt = rebuild_outputs(record, fake_mode)
        difference = same_outputs(rebuilt, originals)
        if difference:
            raise Undescribable(f"rebuilt {difference}")
        shape_env = getattr(fake_mode, "shape_env", None)
        record["strides"] = strides_as_read(wrapper.fwd_output_strides, shape_env)
        record["final_attributes"] = [final_attributes(out, index) for index, out in enumerate(wrapper.out_metas)]
        difference = same_outputs(restrided(self._wrapper_class, rebuilt, record, shape_env), wrapper.out_metas)
        if difference:
            raise Undescribable(f"re-strided {difference}")
        record["version"] = _RECORD_VERSION
        return record

    def _save(self, key: str, entry: Any, *args: Any, **kwargs: Any) -> None:
        describe = self._undescribed.pop(key, None)
        if describe is not None:
            describe()
        if key in self._described:
            record = self._described.pop(key)
            if record is None:
                return None  # not describable: not saved, as torch would not save it
            setattr(entry, RECORD_ATTRIBUTE, record)
            self._event("saved", key)
        return self._originals["save"].__func__(key, entry, *args, **kwargs)

    # -- a hit ----------------------------------------------------------------------------------

    @property
    def _wrap_post_compile(self) -> Callable[..., Any]:
        original, cache = self._originals["wrap_post_compile"], self

        def wrap_post_compile(entry: Any, args: Any, aot_config: Any, fx_config: Any) -> Any:
            context = cache._context.try_get()
            if context is None or not context.fakify_first_call:
                return original(entry, args, aot_config, fx_config)
            return cache._serve(original, entry, args, aot_config, fx_config, context)

        return wrap_post_compile

    def _serve(self, original: Callable[..., Any], entry: Any, args: Any, aot_config: Any, fx_config: Any,
               context: Any) -> Any:
        """A hit under ``fakify_first_call``: checked, then its first call returns the
        rebuilt fake outputs; any difference is an ``FXGraphCacheMiss``."""
        record = getattr(entry, RECORD_ATTRIBUTE, None)
        reason = not_describable_runtime(entry.runtime_metadata, entry.maybe_subclass_meta)
        if record is None or record.get("version") != _RECORD_VERSION:
            reason = "the entry has no description of its fake outputs"
        if reason:
            self._event("refused", reason)
            raise self._miss(reason)
        ddp_context = getattr(context, "ddp_optimizer_ctx", None)
        forward, backward = entry.compiled_fw, entry.compiled_bw
        # Would torch have compiled this backward lazily (and so counted its bucket down)?
        lazy = (backward is not None and ddp_context is not None
                and getattr(backward, "num_symints_saved_for_bw_", 0) == 0
                and not getattr(aot_config, "force_non_lazy_backward_lowering", False))

        def forward_post_compile(result: Any, config: Any) -> Any:
            result = type(forward).post_compile(forward, result, config)
            shape_env = getattr(context.fake_mode, "shape_env", None)
            strides = strides_as_read(getattr(result, "output_strides", None), shape_env)
            if strides != record["strides"]:
                raise Mismatch(f"the FX entry's output strides {strides} are not the recorded {record['strides']}")
            outputs = rebuild_outputs(record, context.fake_mode)
            return _first_call_returns(restrided(self._wrapper_class, outputs, record, shape_env), result)

        def backward_post_compile(result: Any, config: Any) -> Any:
            return _first_call_counts_down(type(backward).post_compile(backward, result, config), ddp_context)

        forward.post_compile = forward_post_compile
        if lazy:
            backward.post_compile = backward_post_compile
        try:
            compiled = original(entry, args, aot_config, fx_config)
        except Mismatch as exc:
            self._event("refused", str(exc))
            raise self._miss(str(exc)) from None
        finally:
            forward.__dict__.pop("post_compile", None)
            if backward is not None:
                backward.__dict__.pop("post_compile", None)
        context.fw_metadata = entry.runtime_metadata
        self._event("served")
        return compiled


@contextlib.contextmanager
def cached_split_graphs(report: Callable[[str, str], None] | None = None) -> Iterator[None]:
    """Let AOTAutograd's cache save and serve DDPOptimizer's split graphs for the duration.

    ``report(event, detail)`` is called for each event of :class:`SplitGraphCache`.
    """
    with SplitGraphCache(report).installed():
        yield


def _first_call_returns(outputs: list[Any], compiled: Any) -> Callable[[list[Any]], Any]:
    """``compiled`` (boxed), whose first call returns ``outputs`` instead of running, as
    ``FakifiedOutWrapper``'s wrapper does."""
    pending = [outputs]

    def forward(args: list[Any]) -> Any:
        if pending:
            return pending.pop()
        return compiled(args)

    forward._boxed_call = True  # type: ignore[attr-defined]
    return forward


def _first_call_counts_down(compiled_backward: Any, ddp_context: Any) -> Callable[..., Any]:
    """``compiled_backward``, whose first call takes its bucket's slot in DDPOptimizer's
    count, as the lazy compile of a missed backward would at that call."""
    pending = [True]

    @functools.wraps(compiled_backward)
    def backward(*args: Any, **kwargs: Any) -> Any:
        if pending:
            pending.pop()
            ddp_context.curr_bucket -= 1
        return compiled_backward(*args, **kwargs)

    return backward
