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
``SymExprPrinter``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

#: Torch versions (major, minor) whose sources this was read from and whose tests pass.
SPLIT_GRAPH_VERSIONS = ((2, 11), (2, 13), (2, 14))

#: The attribute of an AOTAutograd entry that holds the description of its fake outputs.
RECORD_ATTRIBUTE = "_coordinator_fake_outputs"
_RECORD_VERSION = 3


def split_graphs_unsupported() -> str | None:
    """Why this torch cannot serve DDPOptimizer's split graphs from the cache, or ``None``."""
    import torch

    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version not in SPLIT_GRAPH_VERSIONS:
        checked = ", ".join(f"{major}.{minor}" for major, minor in SPLIT_GRAPH_VERSIONS)
        return f"torch {torch.__version__} is not one of the versions this was checked on ({checked})"
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


class _Undescribable(Exception):
    """An output the description cannot reproduce exactly."""


class _Mismatch(Exception):
    """A recorded description that does not fit the loaded entry or this process."""


# -- describing and rebuilding fake outputs ---------------------------------------------


def _printer() -> Any:
    from torch.fx.experimental.symbolic_shapes import SymExprPrinter

    return SymExprPrinter()


def _expr(value: Any, printer: Any) -> str:
    """An int or a backed symbolic int as the text ``ShapeEnv.deserialize_symexpr`` reads."""
    import torch
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise _Undescribable(f"a {type(value).__name__} where an int was expected")
    if isinstance(value, int):
        return str(value)
    expr = value.node.expr
    if free_unbacked_symbols(expr):
        raise _Undescribable(f"unbacked symbol in {expr}")
    return printer.doprint(expr)


def _constructor_attributes(t: Any) -> frozenset[str]:
    """The attributes a new fake tensor of ``t``'s fake mode has values for (its device
    and mode; the names differ between torch versions)."""
    import torch

    with t.fake_mode:
        return frozenset(name for name, value in vars(torch.empty(0)).items() if value is not None)


def _attributes(t: Any) -> dict:
    """A fake tensor's attributes beyond its constructor's defaults (``None``): tags that
    other code set on it, such as Inductor's ``_is_inductor_static``, which its cache keys
    read. A value that is not plain data is kept as its type's name, which no rebuild
    reproduces: such a tensor is not describable."""
    attributes = {}
    own = _constructor_attributes(t)
    for name, value in sorted(vars(t).items()):
        # Memos (``_item_memo``, ``_nonzero_memo``...) cache a symbol from an earlier trace;
        # without one, torch makes a fresh symbol, as for any new fake tensor.
        if name in own or value is None or "_memo" in name:
            continue
        plain = isinstance(value, (bool, int, float, str)) and type(value) in (bool, int, float, str)
        attributes[name] = value if plain else {"not plain data": type(value).__name__}
    return attributes


def _plain_layout(t: Any, printer: Any, what: str) -> dict:
    layout = _layout(t, printer)
    odd = sorted(name for name, value in layout["attributes"].items() if isinstance(value, dict))
    if odd:
        raise _Undescribable(f"{what} has attributes that are not plain data: {', '.join(odd)}")
    return layout


def _layout(t: Any, printer: Any) -> dict:
    """Everything about a fake tensor that the next bucket's compile can see."""
    return {
        "size": [_expr(s, printer) for s in t.size()],
        "stride": [_expr(s, printer) for s in t.stride()],
        "offset": _expr(t.storage_offset(), printer),
        "nbytes": _expr(t.untyped_storage().nbytes(), printer),
        "dtype": str(t.dtype).removeprefix("torch."),
        "device": str(t.device),
        "requires_grad": bool(t.requires_grad),
        "view": t._base is not None,
        "attributes": _attributes(t),
    }


def describe_outputs(outputs: list[Any], inputs: list[Any]) -> dict:
    """Describe the fake outputs of a forward graph (``FakifiedOutWrapper.out_metas``),
    whose inputs are the fake tensors ``inputs`` (its placeholders' values).

    Returns ``{"outputs": [...], "inputs": {j: layout}, "storages": {k: [nbytes,
    device]}}``. Each output is ``["tensor", layout, storage, base]``, ``["input", j]``
    (input ``j`` itself, saved for the backward), ``["same", k]`` (output ``k`` again),
    ``["int", expr]`` or ``["none"]``. A tensor whose storage no other output or input
    holds has ``storage`` and ``base`` ``None``; else ``storage`` names who holds it
    (``["input", j]``, or ``["output", k]`` for a storage first seen at output ``k``)
    and a view's ``base`` names its base (``["output", k]``, ``["input", j]``, or
    ``["storage"]`` for a base that is not an output). Inputs are rebuilt from their
    layouts, as the miss path returns its own fake inputs, not the caller's tensors.

    Raises:
        _Undescribable: an output cannot be rebuilt exactly.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.multiprocessing.reductions import StorageWeakRef

    printer = _printer()

    def storage_of(t: Any) -> Any:
        return StorageWeakRef(t.untyped_storage())

    input_storages: dict[Any, list[int]] = {}
    for j, t in enumerate(inputs):
        input_storages.setdefault(storage_of(t), []).append(j)
    members: dict[Any, list[int]] = {}
    for index, out in enumerate(outputs):
        if isinstance(out, torch.Tensor) and not any(out is earlier for earlier in outputs[:index]):
            if type(out) is not FakeTensor:
                raise _Undescribable(f"output {index} is a {type(out).__name__}")
            members.setdefault(storage_of(out), []).append(index)

    described: list[Any] = []
    used_inputs: dict[int, dict] = {}
    storages: dict[int, list[Any]] = {}
    for index, out in enumerate(outputs):
        same = next((k for k, earlier in enumerate(outputs[:index]) if earlier is out), None)
        if same is not None:
            described.append(["same", same])
            continue
        if out is None:
            described.append(["none"])
            continue
        if not isinstance(out, torch.Tensor):
            described.append(["int", _expr(out, printer)])
            continue
        if out.layout != torch.strided or out.is_conj() or out.is_neg() or out.is_inference():
            raise _Undescribable(f"output {index} has a layout or flags the rebuild does not set")
        storage = storage_of(out)
        layout = _plain_layout(out, printer, f"output {index}")
        owners = input_storages.get(storage, [])
        if len(owners) > 1:
            raise _Undescribable(f"output {index} aliases inputs {owners}, which share storage")
        if owners:
            j = owners[0]
            used_inputs[j] = _plain_layout(inputs[j], printer, f"input {j}")
            if inputs[j] is out:
                described.append(["input", j])
                continue
            holder: list[Any] | None = ["input", j]
        elif len(members[storage]) > 1:
            first = members[storage][0]
            holder = ["output", first]
            storages[first] = [_expr(out.untyped_storage().nbytes(), printer), str(out.device)]
        else:
            holder = None
        base = None
        if holder is not None and layout["view"]:
            base = next((["output", k] for k in range(index) if out._base is outputs[k]),
                        next((["input", j] for j, t in enumerate(inputs) if out._base is t), ["storage"]))
        described.append(["tensor", layout, holder, base])
    return {"outputs": described, "inputs": used_inputs, "storages": storages}


def _deserialize(shape_env: Any, text: str) -> Any:
    if shape_env is None:
        return int(text)
    try:
        return shape_env.deserialize_symexpr(text)
    except NameError as exc:  # a symbol this shape environment does not have
        raise _Mismatch(f"{text}: {exc}") from None


def _rebuild_tensor(layout: dict, shape_env: Any, storage: Any = None, base: Any = None) -> Any:
    """A fake tensor with ``layout``, made inside the fake mode: in ``storage`` if given
    (a view of ``base``, or of a tensor over the whole storage), else in its own."""
    out = _rebuild_layout(layout, shape_env, storage, base)
    for name, value in layout["attributes"].items():
        setattr(out, name, value)
    return out


def _rebuild_layout(layout: dict, shape_env: Any, storage: Any, base: Any) -> Any:
    import torch

    size = [_deserialize(shape_env, s) for s in layout["size"]]
    stride = [_deserialize(shape_env, s) for s in layout["stride"]]
    offset = _deserialize(shape_env, layout["offset"])
    dtype = getattr(torch, layout["dtype"])
    device = torch.device(layout["device"])
    requires_grad = layout["requires_grad"]

    def over(untyped: Any, at: Any, shape: list[Any], strides: list[Any]) -> Any:
        with torch.no_grad():  # not a view: an alias autograd does not see (``set_``)
            return torch.empty((0,), dtype=dtype, device=device).set_(untyped, at, shape, strides)

    if layout["view"]:
        if base is None:
            if storage is None:
                if requires_grad:
                    raise _Mismatch("a view that requires grad")
                storage = torch.empty((_deserialize(shape_env, layout["nbytes"]),), dtype=torch.uint8,
                                      device=device).untyped_storage()
            base = over(storage, 0, [storage.nbytes() // dtype.itemsize], [1])
        with torch.set_grad_enabled(requires_grad):
            return base.as_strided(size, stride, offset)
    if storage is not None:
        out = over(storage, offset, size, stride)
    elif layout["offset"] != "0":
        raise _Mismatch("a tensor with a storage offset must be a view")
    else:
        out = torch.empty_strided(size, stride, dtype=dtype, device=device)
    return out.requires_grad_(True) if requires_grad else out


def rebuild_outputs(described: dict, fake_mode: Any) -> list[Any]:
    """Fake outputs from :func:`describe_outputs`, made in ``fake_mode``."""
    import torch

    shape_env = getattr(fake_mode, "shape_env", None)
    outputs: list[Any] = []
    with fake_mode:
        inputs = {int(j): _rebuild_tensor(layout, shape_env) for j, layout in described["inputs"].items()}
        storages = {int(k): torch.empty((_deserialize(shape_env, nbytes),), dtype=torch.uint8,
                                        device=torch.device(device)).untyped_storage()
                    for k, (nbytes, device) in described["storages"].items()}
        for item in described["outputs"]:
            kind = item[0]
            if kind == "same":
                outputs.append(outputs[item[1]])
            elif kind == "none":
                outputs.append(None)
            elif kind == "int":
                outputs.append(_deserialize(shape_env, item[1]))
            elif kind == "input":
                outputs.append(inputs[item[1]])
            elif kind == "tensor":
                _, layout, holder, base_ref = item
                storage = base = None
                if holder is not None:
                    owner, at = holder
                    storage = inputs[at].untyped_storage() if owner == "input" else storages[at]
                if base_ref is not None and base_ref[0] != "storage":
                    base = outputs[base_ref[1]] if base_ref[0] == "output" else inputs[base_ref[1]]
                outputs.append(_rebuild_tensor(layout, shape_env, storage, base))
            else:
                raise _Mismatch(f"unknown output kind {kind!r}")
    return outputs


def _same_outputs(rebuilt: list[Any], originals: list[Any]) -> str | None:
    """Where ``rebuilt`` differs from ``originals`` (``None``: nowhere): each tensor's
    layout, and which outputs are the same tensor, share storage, or are views of one
    another."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    printer = _printer()
    if len(rebuilt) != len(originals):
        return f"{len(rebuilt)} outputs, not {len(originals)}"
    for index, (new, old) in enumerate(zip(rebuilt, originals, strict=True)):
        if isinstance(old, torch.Tensor):
            if not isinstance(new, torch.Tensor):
                return f"output {index}: {new!r} is not a tensor"
            if _layout(new, printer) != _layout(old, printer):
                return f"output {index}: {_layout(new, printer)} != {_layout(old, printer)}"
            for k in range(index):
                new_k, old_k = rebuilt[k], originals[k]
                if not isinstance(old_k, torch.Tensor):
                    continue
                relations = (
                    (new is new_k, old is old_k),
                    (StorageWeakRef(new.untyped_storage()) == StorageWeakRef(new_k.untyped_storage()),
                     StorageWeakRef(old.untyped_storage()) == StorageWeakRef(old_k.untyped_storage())),
                    (new._base is new_k, old._base is old_k),
                    (new_k._base is new, old_k._base is old),
                )
                if any(a != b for a, b in relations):
                    return f"outputs {k} and {index} are related differently"
        elif old is None:
            if new is not None:
                return f"output {index}: {new!r} is not None"
        elif isinstance(new, torch.Tensor) or new is None or _expr(new, printer) != _expr(old, printer):
            return f"output {index}: {new!r} != {old!r}"
    return None


def _strides_as_read(strides: list[Any] | None, shape_env: Any) -> list[Any] | None:
    """Output strides as ``FakifiedOutWrapper`` reads them, printed: from the tracing
    context (ints or symbolic ints) or from an FX entry (printed expressions, read as
    ``set_tracing_context_output_strides`` reads them for a fakified first call)."""
    if strides is None:
        return None
    printer = _printer()
    read = []
    for exprs in strides:
        if exprs is None:
            read.append(None)
            continue
        values = [_deserialize(shape_env, e) if isinstance(e, str) else e for e in exprs]
        read.append([_expr(v, printer) for v in values])
    return read


def _final_attributes(out: Any, index: int) -> dict | None:
    """The attributes of a fake output as the first call returns it (``None``: not a tensor)."""
    import torch

    if not isinstance(out, torch.Tensor):
        return None
    attributes = _attributes(out)
    odd = sorted(name for name, value in attributes.items() if isinstance(value, dict))
    if odd:
        raise _Undescribable(f"output {index} has attributes that are not plain data: {', '.join(odd)}")
    return attributes


def _restrided(wrapper_class: Any, outputs: list[Any], record: dict, shape_env: Any) -> list[Any]:
    """``outputs`` re-strided to the recorded Inductor strides by ``FakifiedOutWrapper``'s
    own code, with the attributes the first call's outputs had."""
    strides = [None if s is None else [_deserialize(shape_env, e) for e in s] for s in record["strides"] or []]
    final = wrapper_class(out_metas=list(outputs), fwd_output_strides=strides or None)
    final = final._compute_output_meta_with_inductor_strides()
    for out, attributes in zip(final, record["final_attributes"], strict=True):
        for name, value in (attributes or {}).items():
            setattr(out, name, value)
    return final


def _not_describable_runtime(runtime_metadata: Any, subclass_meta: Any) -> str | None:
    """Why a forward with this metadata is left to the bypass, or ``None``."""
    if subclass_meta is not None:
        return "tensor subclasses"
    if getattr(runtime_metadata, "is_rng_op_functionalized", False):
        return "functionalized RNG"
    if getattr(runtime_metadata, "tokens", None):
        return "effect tokens"
    if getattr(runtime_metadata, "act_input_indices", None):
        return "async collective inputs"
    return None


# -- the patches --------------------------------------------------------------------------


class SplitGraphEvents:
    """What :func:`cached_split_graphs` reports: ``saved`` (a miss saved with its fake
    outputs), ``bypassed`` (a miss left to the bypass: its outputs cannot be described),
    ``served`` (a hit whose fake outputs were rebuilt), ``refused`` (a hit turned into a
    miss: no description, or one that does not fit)."""

    def __init__(self, report: Callable[[str, str], None] | None = None) -> None:
        self._report = report

    def __call__(self, event: str, detail: str = "") -> None:
        if event in ("bypassed", "refused"):
            log.info("compile_once: DDP split graph %s from AOTAutograd's cache: %s",
                     "not saved" if event == "bypassed" else "not loaded", detail)
        if self._report is not None:
            self._report(event, detail)


@contextlib.contextmanager
def cached_split_graphs(report: Callable[[str, str], None] | None = None) -> Iterator[None]:
    """Let AOTAutograd's cache save and serve DDPOptimizer's split graphs for the duration.

    ``report(event, detail)`` is called for each event of :class:`SplitGraphEvents`.
    """
    import torch
    from torch._guards import TracingContext

    autograd_cache, runtime_wrappers, aot_autograd_result, cache_class = _patch_points()
    events = SplitGraphEvents(report)
    wrapper_class = runtime_wrappers.FakifiedOutWrapper
    result_class = aot_autograd_result.GenericAOTAutogradResult
    original_check = autograd_cache.__dict__["check_cacheable"]
    original_save = cache_class.__dict__["save"]
    original_pre = wrapper_class.__dict__["pre_compile"]
    original_post = wrapper_class.__dict__["post_compile"]
    original_wrap = result_class.__dict__["wrap_post_compile"]
    miss = autograd_cache.FXGraphCacheMiss
    #: AOTAutograd key -> description of its fake outputs (None: not describable).
    described: dict[str, dict | None] = {}
    #: AOTAutograd key -> describes its fake outputs, once they are final.
    undescribed: dict[str, Callable[[], None]] = {}

    def check_cacheable(gm: Any) -> None:
        context = TracingContext.try_get()
        if context is None or not context.fakify_first_call:
            return original_check(gm)
        context.fakify_first_call = False  # every other check still runs
        try:
            return original_check(gm)
        finally:
            context.fakify_first_call = True

    def pre_compile(self: Any, fw_module: Any, *args: Any, **kwargs: Any) -> None:
        original_pre(self, fw_module, *args, **kwargs)
        if self.needs_post_compile:
            self._coordinator_inputs = [
                node.meta["val"] for node in fw_module.graph.find_nodes(op="placeholder")
                if isinstance(node.meta.get("val"), torch.Tensor)
            ]

    def post_compile(self: Any, compiled_fn: Any, aot_config: Any, *, runtime_metadata: Any) -> Any:
        cache_info = getattr(aot_config, "cache_info", None)
        if not self.needs_post_compile or cache_info is None:
            return original_post(self, compiled_fn, aot_config, runtime_metadata=runtime_metadata)
        originals = list(self.out_metas)
        result = original_post(self, compiled_fn, aot_config, runtime_metadata=runtime_metadata)
        key = cache_info.cache_key
        fake_mode = TracingContext.get().fake_mode
        # Described as DDPOptimizer receives them: at the first call, or at the save if
        # that comes first (a backward compiled eagerly is saved before the first call).
        # Not earlier: the backward's compile tags the forward's outputs it takes as
        # inputs (Inductor's ``_is_inductor_static``, which its cache keys read).
        undescribed[key] = lambda: describe_now(key, originals, self, runtime_metadata, fake_mode)

        @functools.wraps(result)
        def first_call(args: Any) -> Any:
            describe = undescribed.pop(key, None)
            if describe is not None:
                describe()
            return result(args)

        return first_call

    def describe_now(key: str, originals: list[Any], wrapper: Any, runtime_metadata: Any, fake_mode: Any) -> None:
        try:
            described[key] = _describe(originals, wrapper, runtime_metadata, fake_mode)
        except (_Undescribable, _Mismatch) as exc:
            described[key] = None
            events("bypassed", f"{key}: {exc}")
        except Exception as exc:  # an unexpected shape of torch: leave the graph to the bypass
            described[key] = None
            log.warning("compile_once: could not describe the fake outputs of %s", key, exc_info=True)
            events("bypassed", f"{key}: {exc}")

    def _describe(originals: list[Any], wrapper: Any, runtime_metadata: Any, fake_mode: Any) -> dict:
        reason = _not_describable_runtime(runtime_metadata, None)
        if reason:
            raise _Undescribable(reason)
        record = describe_outputs(originals, getattr(wrapper, "_coordinator_inputs", []))
        rebuilt = rebuild_outputs(record, fake_mode)
        difference = _same_outputs(rebuilt, originals)
        if difference:
            raise _Undescribable(f"rebuilt {difference}")
        shape_env = getattr(fake_mode, "shape_env", None)
        record["strides"] = _strides_as_read(wrapper.fwd_output_strides, shape_env)
        record["final_attributes"] = [_final_attributes(out, index) for index, out in enumerate(wrapper.out_metas)]
        final = _restrided(wrapper_class, rebuilt, record, shape_env)
        difference = _same_outputs(final, wrapper.out_metas)
        if difference:
            raise _Undescribable(f"re-strided {difference}")
        record["version"] = _RECORD_VERSION
        return record

    def save(key: str, entry: Any, *args: Any, **kwargs: Any) -> None:
        describe = undescribed.pop(key, None)
        if describe is not None:
            describe()
        if key in described:
            record = described.pop(key)
            if record is None:
                return None  # not describable: not saved, as torch would not save it
            setattr(entry, RECORD_ATTRIBUTE, record)
            events("saved", key)
        return original_save.__func__(key, entry, *args, **kwargs)

    def wrap_post_compile(self: Any, args: Any, aot_config: Any, fx_config: Any) -> Any:
        context = TracingContext.try_get()
        if context is None or not context.fakify_first_call:
            return original_wrap(self, args, aot_config, fx_config)
        record = getattr(self, RECORD_ATTRIBUTE, None)
        reason = _not_describable_runtime(self.runtime_metadata, self.maybe_subclass_meta)
        if record is None or record.get("version") != _RECORD_VERSION:
            reason = "the entry has no description of its fake outputs"
        if reason:
            events("refused", reason)
            raise miss(reason)
        ddp_context = getattr(context, "ddp_optimizer_ctx", None)
        forward, backward = self.compiled_fw, self.compiled_bw
        lazy = (backward is not None and ddp_context is not None
                and getattr(backward, "num_symints_saved_for_bw_", 0) == 0
                and not getattr(aot_config, "force_non_lazy_backward_lowering", False))

        def forward_post_compile(result: Any, config: Any) -> Any:
            result = type(forward).post_compile(forward, result, config)
            shape_env = getattr(context.fake_mode, "shape_env", None)
            strides = _strides_as_read(getattr(result, "output_strides", None), shape_env)
            if strides != record["strides"]:
                raise _Mismatch(f"the FX entry's output strides {strides} are not the recorded {record['strides']}")
            outputs = rebuild_outputs(record, context.fake_mode)
            return _first_call_returns(_restrided(wrapper_class, outputs, record, shape_env), result)

        def backward_post_compile(result: Any, config: Any) -> Any:
            return _first_call_counts_down(type(backward).post_compile(backward, result, config), ddp_context)

        forward.post_compile = forward_post_compile
        if lazy:
            backward.post_compile = backward_post_compile
        try:
            compiled = original_wrap(self, args, aot_config, fx_config)
        except _Mismatch as exc:
            events("refused", str(exc))
            raise miss(str(exc)) from None
        finally:
            forward.__dict__.pop("post_compile", None)
            if backward is not None:
                backward.__dict__.pop("post_compile", None)
        context.fw_metadata = self.runtime_metadata
        events("served")
        return compiled

    autograd_cache.check_cacheable = check_cacheable
    cache_class.save = staticmethod(save)
    wrapper_class.pre_compile = pre_compile
    wrapper_class.post_compile = post_compile
    result_class.wrap_post_compile = wrap_post_compile
    try:
        yield
    finally:
        autograd_cache.check_cacheable = original_check
        cache_class.save = original_save
        wrapper_class.pre_compile = original_pre
        wrapper_class.post_compile = original_post
        result_class.wrap_post_compile = original_wrap


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
