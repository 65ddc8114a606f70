"""DDPOptimizer's split frames: the submodules of a frame, compiled out of their order.

DDPOptimizer splits a DDP model's frame into one submodule per gradient bucket and
compiles them in a chain (``SubmodCompiler.run``): each compile is handed the fake
outputs of the one before. :func:`split_frames` calls ``before_chain`` with a
:class:`SplitFrame` once the frame is split and before the chain starts, and tells which
submodule the chain compiles while it compiles it (:func:`chain_position`).

A :class:`SplitFrame` derives any submodule's inputs without compiling the ones before:
it runs the earlier submodules, uncompiled, on fake tensors under the frame's own fake
mode, as DDPOptimizer itself runs a submodule that AOTAutograd did not compile. It can
compile a submodule from those inputs as the chain would (:meth:`SplitFrame.compile`):
the submodule's compile, in a tracing context of its own that shares the frame's fake
mode, shape environment and guards; its first call on the fake inputs; then the backward
AOTAutograd deferred to the first backward call, and the AOTAutograd entry it saves
then. Only the cache entries are kept: the chain compiles every submodule again, and finds
them. A propagated input that differs from the chain's (Inductor gave an output other
strides) only gives the chain another AOTAutograd key: a miss, compiled as before.

Neither leaves a trace in the frame's shape environment, which the chain's keys read (a
guard that a later submodule's compile adds, such as a divisibility, changes how an
earlier one's symbolic sizes print): the propagation runs with guards suppressed and the
fake-tensor cache off (a cached result would skip a guard the chain must add), and the
shape environment is put back, field for field, after each out-of-order compile
(:class:`ShapeEnvState`), which answers from caches of its own meanwhile (an evaluation
cached during it would skip adding a guard that is gone). The chain then adds each guard itself,
when it compiles a submodule or loads its entry, in its own order, as without shares.

Private names: ``_dynamo.backends.distributed.SubmodCompiler`` (``run``,
``compile_submod``, ``module``, ``fake_mode``), ``_dynamo.utils.deepcopy_to_fake_tensor``,
``torch._guards.tracing`` and ``TracingContext`` (copied; ``fakify_first_call``,
``fw_metadata``, ``ddp_optimizer_ctx``, ``output_strides``, ``params_flat`` and its two
siblings, ``aot_graph_name``), ``_functorch._aot_autograd.graph_compile._cache_autograd_info``
(returns the ``try_save_cache_entry`` a lazily compiled backward calls), the deferred
backward of ``_compat.backward``; ``ShapeEnv`` (its attributes, ``suppress_guards``,
``_version_counter``, ``_replacements_version_counter`` (a ``SymNode``'s expression is
cached on it; read with a default where a version lacks it), ``_prev_cache_key``,
``_get_key``, its methods' ``lru_cache``s),
``fake_tensor.disable_fake_tensor_cache``, ``_dispatch.python.enable_python_dispatcher``,
Inductor's ``_is_inductor_static`` tag, AOTAutograd's ``autograd_cache_hit`` counter. Read from
the sources of 2.11.0, 2.13.0 and 2.14.1 (``SubmodCompiler`` differs only in
``compiler_configs``, from 2.13); the keys of shares and chain compared field by field
(the split-key probe, ``benchmarks/RESULTS.md`` at ddb6d09) on torch 2.11 with one H100, and on 2.11, 2.13 and
2.14.1 on CPU (the tests). The tests (``tests/test_split_shares.py``) ran on 2.13.0 and 2.14.1
on CPU (both CI legs), on 2.11.0 on CPU before the put-back (its own test ran there too); on
2.11.0 on 4 H100s over NCCL (the N=4 cold-start benchmark). The caches the put-back keeps
aside ran on 2.11.0 on 2 H200s (the split-cold benchmark); its replacement counter moving on
(``_replacements_version_counter``, in the sources of 2.13.0 and 2.14.1) ran on 2.13.0 and
2.14.1 only (its test, both CI legs). ``SplitFrame.has_symbolic_floats`` reads each
submodule node's ``meta["val"]``/``["example_value"]``; ran on 2.13.0 and 2.14.1
(``tests/test_models.py``, Llama dynamic on 3 ranks), not yet on 2.11.0.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

_thread = threading.local()


def chain_position() -> tuple[SplitFrame, int] | None:
    """The split frame and the index of the submodule its chain is compiling on this
    thread, or ``None``."""
    return getattr(_thread, "position", None)


class SplitFrame:
    """One frame DDPOptimizer split into submodules, before its chain compiles them."""

    def __init__(self, submod_compiler: Any, example_inputs: tuple[Any, ...]) -> None:
        import torch

        self._compiler = submod_compiler
        self._fake_mode = submod_compiler.fake_mode
        self._inputs = list(example_inputs)
        self._nodes = [node for node in submod_compiler.module.graph.nodes if node.op == "call_module"]
        self.submodules = [submod_compiler.fetch_attr(str(node.target)) for node in self._nodes]
        self._propagated: list[list[Any]] = []
        self._env: dict[Any, Any] | None = None
        self._pending: Iterator[Any] = iter(())
        self._placeholders: Iterator[Any] = iter(())
        self._torch = torch

    def __len__(self) -> int:
        return len(self.submodules)

    def identity(self) -> str:
        """A digest that is the same on every rank that split the same frame the same way:
        the split graph's code, each submodule's code, and the frame's inputs' sizes,
        strides, dtypes, devices and whether they require grad."""
        digest = hashlib.sha256(self._compiler.module.code.encode())
        for submodule in self.submodules:
            digest.update(submodule.code.encode())
        for value in self._inputs:
            digest.update(_describe(value).encode())
        return digest.hexdigest()[:40]

    def has_symbolic_floats(self) -> bool:
        """Whether a submodule computes with a symbolic Python float: AOTAutograd's
        ``tensorify_python_scalars`` pass may then ask Dynamo to trace the frame again
        (``TensorifyScalarRestartAnalysis``), and whatever was compiled of it is never used."""
        torch = self._torch
        for module in self.submodules:
            for node in module.graph.nodes:
                value = node.meta.get("val", node.meta.get("example_value"))
                if isinstance(value, torch.SymFloat):
                    return True
        return False

    def kinds(self) -> list[str]:
        """A digest of each submodule that is the same for submodules that compile to the
        same graphs: its operations in order, with the names of its inputs and attributes
        left out (identical layers differ only in those), and the sizes, strides, dtypes and
        requires_grad of the values Dynamo recorded for its inputs. Submodules of one kind
        make the same FX graphs, which Inductor compiles once and then finds in its cache."""
        torch = self._torch
        kinds = []
        for module in self.submodules:
            position: dict[Any, int] = {}
            digest = hashlib.sha256()
            for node in module.graph.nodes:
                position[node] = len(position)
                if node.op == "placeholder":
                    described = _describe(node.meta.get("example_value"))
                elif node.op == "get_attr":
                    value = getattr(module, str(node.target), None)
                    described = _describe(value) if isinstance(value, torch.Tensor) else ""
                else:
                    described = _target_name(node.target)
                args = torch.fx.node.map_arg((node.args, node.kwargs), lambda arg, seen=position: f"%{seen[arg]}")
                digest.update(f"{node.op}|{described}|{args}\n".encode())
            kinds.append(digest.hexdigest()[:16])
        return kinds

    def costs(self) -> list[int]:
        """Each submodule's operator count: what its compile costs, roughly."""
        return [sum(1 for node in mod.graph.nodes if node.op in ("call_function", "call_method", "call_module"))
                for mod in self.submodules]

    def inputs(self, index: int) -> list[Any]:
        """Submodule ``index``'s fake inputs, derived by running the submodules before it
        uncompiled on fake tensors (as DDPOptimizer runs a submodule it did not compile)."""
        from torch._dynamo.utils import deepcopy_to_fake_tensor, to_fake_tensor

        torch, fake_mode = self._torch, self._fake_mode
        if self._env is None:
            self._env, self._pending = {}, iter(self._compiler.module.graph.nodes)
            self._placeholders = iter(self._inputs)
        while len(self._propagated) <= index:
            node = next(self._pending)
            args = [self._env[a] if isinstance(a, torch.fx.Node) else a for a in node.args]
            if node.op == "placeholder":
                self._env[node] = next(self._placeholders)
            elif node.op == "call_function":  # getitem of a submodule's outputs
                self._env[node] = node.target(*args)
            elif node.op == "call_module":
                args = [to_fake_tensor(a, fake_mode) if isinstance(a, torch.Tensor)
                        and not isinstance(a, torch._subclasses.FakeTensor) else a for a in args]
                self._propagated.append(args)
                with self._no_trace(), fake_mode, mock.patch.object(fake_mode, "allow_non_fake_inputs", True):
                    module = deepcopy_to_fake_tensor(self.fetch(node), fake_mode)
                    self._env[node] = module(*args)
        return self._propagated[index]

    def fetch(self, node: Any) -> Any:
        return self._compiler.fetch_attr(str(node.target))

    @contextlib.contextmanager
    def _no_trace(self) -> Iterator[None]:
        """Ops run as Dynamo ran them when it traced the frame (with the Python
        dispatcher: its decompositions keep sizes symbolic where a C++ composite, such as
        ``matmul`` under ``no_grad``, would read a size's value and make the output static),
        with no guard recorded and no fake-tensor cache entry made (a cached result would
        skip the guard a later dispatch of the same op must add)."""
        from torch._dispatch.python import enable_python_dispatcher
        from torch._subclasses.fake_tensor import disable_fake_tensor_cache

        shape_env = self._fake_mode.shape_env
        with contextlib.ExitStack() as stack:
            stack.enter_context(enable_python_dispatcher())
            stack.enter_context(disable_fake_tensor_cache(self._fake_mode))
            if shape_env is not None:
                stack.enter_context(shape_env.suppress_guards())
            yield

    def compile(self, index: int) -> bool:
        """Compile submodule ``index`` from its propagated inputs as the chain would, for
        its cache entries. Returns whether an AOTAutograd entry was saved (``False``: it
        was found instead, or AOTAutograd left it out of its cache)."""
        from torch._dynamo.backends.distributed import SubmodCompiler
        from torch._guards import TracingContext, tracing

        args = self.inputs(index)
        original = self.submodules[index]
        module = _copy_submodule(original)
        context = copy.copy(TracingContext.get())
        for name in ("fw_metadata", "ddp_optimizer_ctx", "output_strides", "aot_graph_name", "params_flat",
                     "params_flat_unwrap_subclasses", "params_unwrapped_to_flat_index"):
            if hasattr(context, name):
                setattr(context, name, None)
        context.fakify_first_call = True
        capture = _Capture()
        _thread.capture = capture
        state = ShapeEnvState(self._fake_mode.shape_env) if self._fake_mode.shape_env is not None else None
        try:
            with tracing(context):
                untag(args)
                compiled = _original_compile_submod(SubmodCompiler)(self._compiler, module, list(args), {})
                fake_mode = self._fake_mode
                with fake_mode, mock.patch.object(fake_mode, "allow_non_fake_inputs", True):
                    compiled(*args)  # the first call, as the chain makes it, before the backward compiles
            if capture.saved or capture.backward is None or capture.save is None:
                return capture.saved  # saved with a backward compiled at once (symbolic sizes), or a hit
            compiled_backward = capture.backward.compile()
            return capture.save(compiled_backward, capture.backward.info.bw_module, capture.backward.fw_metadata,
                                capture.backward.aot_config) is not None
        finally:
            _thread.capture = None
            if state is not None:
                state.restore()


#: What Inductor sets on a GPU graph's static inputs just before it computes the graph's
#: key (``compile_fx``), and its keys read (``codecache.extract_tensor_metadata_for_cache_key``:
#: the storage offset and size of a tagged tensor); nothing else reads it.
_STATIC_TAG = "_is_inductor_static"


def compile_settings_digest() -> str:
    """The compile settings AOTAutograd's and Inductor's keys read, as a digest: ranks deal
    a frame's submodules only among ranks whose settings agree."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    digest = hashlib.sha256()
    for config in (inductor_config, functorch_config):
        saved = config.save_config_portable() if hasattr(config, "save_config_portable") else {}
        digest.update(repr(sorted(saved.items())).encode())
    return digest.hexdigest()[:16]


def untag(args: Any) -> None:
    """Take Inductor's static-input tag off a split submodule's inputs before its compile.

    A backward compiled at once (symbolic sizes) tags the forward outputs it saves, and
    DDPOptimizer hands those same fake tensors to the next submodule, whose keys then read
    the storage size of every such input. Whether an input carries the tag depends on
    which graphs this process compiled before, not on the graph: a share's propagated
    inputs never carry it, the chain's do. The tag changes no code (Inductor tags its own
    static inputs again before computing its key), so the chain and the shares key every
    submodule on untagged inputs alike."""
    import torch

    for value in args:
        if isinstance(value, torch.Tensor) and _STATIC_TAG in vars(value):
            delattr(value, _STATIC_TAG)


def _copy_submodule(original: Any) -> Any:
    """A copy of a split submodule with a graph of its own (``compile_submod`` rewrites its
    module's output) and everything else of the original's, in the same order (AOTAutograd's
    key pickles the module's attributes): parameters, Dynamo's metadata and the sources of
    its inputs (which the key reads)."""
    module = type(original).__new__(type(original))
    shallow = ("_modules", "_parameters", "_buffers", "meta")
    vars(module).update((name, copy.copy(value) if name in shallow else value)
                        for name, value in vars(original).items())
    module.graph = copy.deepcopy(original.graph)  # owned by the copy, its code regenerated
    for mine, theirs in zip(module.graph.nodes, original.graph.nodes, strict=True):
        if hasattr(theirs, "_dynamo_source"):  # set by DDPOptimizer on placeholders
            mine._dynamo_source = theirs._dynamo_source
    return module


class ShapeEnvState:
    """A shape environment's state, put back later: every attribute, containers copied two
    levels deep (dicts of lists, as of deferred runtime asserts) and the small records they
    hold (value ranges' source locations, which are updated in place); and what its methods
    cache, kept aside meanwhile.

    A shape environment's methods cache their answers on the class, on their arguments;
    some add a guard or a replacement as they answer, so an answer cached while the state
    is later put back would skip a guard that is gone. From the save until
    :meth:`restore`, each cached method answers from an empty cache of its own, thrown away
    then: the caches of before come back, holding nothing from in between. The version
    counters move on at the restore: the caches kept on them start again."""

    def __init__(self, shape_env: Any) -> None:
        self.shape_env = shape_env
        self._saved = {name: _copied(value) for name, value in vars(shape_env).items()}
        self._cached: list[tuple[type, str, Any]] = []
        self._cleared: list[Any] = []  # cached methods that cannot be given a cache of their own
        for klass in type(shape_env).__mro__:
            for name, attribute in list(vars(klass).items()):
                if not callable(getattr(attribute, "cache_clear", None)):
                    continue
                fresh = _fresh_cache(attribute)
                if fresh is None:
                    self._cleared.append(attribute)
                else:
                    self._cached.append((klass, name, attribute))
                    setattr(klass, name, fresh)

    def restore(self) -> None:
        """Put every attribute back as saved (attributes added since are dropped), and the
        methods' caches as they were at the save."""
        state = vars(self.shape_env)
        version = state.get("_version_counter", 0)
        replacements_version = state.get("_replacements_version_counter", 0)
        for name in [name for name in state if name not in self._saved]:
            del state[name]
        for name, value in self._saved.items():
            state[name] = _copied(value)
        # Both counters move on, never back: what was cached on a value they took
        # meanwhile (a symbolic size's expression under the replacements of then, kept on
        # the size itself) would otherwise be taken as current when they take it again.
        if "_replacements_version_counter" in state:
            state["_replacements_version_counter"] = replacements_version + 1
        if "_version_counter" in state:
            state["_version_counter"] = version + 1
            state["_prev_cache_key"] = self.shape_env._get_key()
        for klass, name, attribute in self._cached:
            setattr(klass, name, attribute)
        self._cached = []
        for attribute in self._cleared:
            attribute.cache_clear()


def _fresh_cache(attribute: Any) -> Any:
    """An empty cache around what cached method ``attribute`` caches (a
    ``functools.lru_cache``, or the shape environment's ``_lru_cache``, kept on its version
    counter), or ``None`` for another kind (a decorator around a cache)."""
    import functools

    from torch.fx.experimental import symbolic_shapes

    wrapped = getattr(attribute, "__wrapped__", None)
    if wrapped is None or isinstance(wrapped, functools._lru_cache_wrapper):
        return None
    if isinstance(attribute, functools._lru_cache_wrapper):
        return functools.lru_cache(attribute.cache_parameters()["maxsize"])(wrapped)
    if callable(getattr(attribute, "cache_info", None)):
        return symbolic_shapes._lru_cache(wrapped, attribute.cache_info().maxsize)
    return None


def _copied(value: Any, depth: int = 2) -> Any:
    import collections.abc
    import dataclasses

    if depth and isinstance(value, dict):
        copied = copy.copy(value)  # keeps defaultdict factories and OrderedDict order
        for key, item in value.items():
            copied[key] = _copied(item, depth - 1)
        return copied
    if depth and isinstance(value, list):
        copied = copy.copy(value)
        copied[:] = [_copied(item, depth - 1) for item in value]
        return copied
    if isinstance(value, collections.abc.MutableSet):  # sets of symbols and expressions
        return copy.copy(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return copy.copy(value)
    return value


class _Capture:
    """What one out-of-order compile left for its backward: the backward AOTAutograd
    deferred, and the function that saves the AOTAutograd entry once it is compiled."""

    def __init__(self) -> None:
        self.backward: Any = None
        self.save: Callable[..., Any] | None = None
        self.saved = False


def capture_backward(backward: Any) -> bool:
    """Take a deferred backward reported on this thread while a :class:`SplitFrame`
    compiles out of order; returns whether it was taken."""
    capture = getattr(_thread, "capture", None)
    if capture is None:
        return False
    capture.backward = backward
    return True


def _describe(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"T{tuple(map(str, value.shape))}{tuple(map(str, value.stride()))}{value.dtype}{value.device}" \
               f"{value.requires_grad}"
    return repr(type(value).__name__) if not isinstance(value, (int, float, bool, str)) else repr(value)


def _target_name(target: Any) -> str:
    """An operation's target by its qualified name (a module's attribute path stays)."""
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


_ORIGINAL_COMPILE_SUBMOD = "_coordinator_original_compile_submod"


def _original_compile_submod(cls: Any) -> Callable[..., Any]:
    return getattr(cls, _ORIGINAL_COMPILE_SUBMOD, cls.compile_submod)


@contextlib.contextmanager
def split_frames(before_chain: Callable[[SplitFrame], None],
                 chain_compiled: Callable[[SplitFrame, int, bool], None] | None = None,
                 chain_ended: Callable[[SplitFrame, float], None] | None = None) -> Iterator[None]:
    """For the duration: call ``before_chain`` with each frame DDPOptimizer splits,
    before its chain; mark which submodule the chain compiles (:func:`chain_position`);
    call ``chain_compiled(frame, index, served)`` after each (``served``: AOTAutograd's
    cache had it, locally or through the store), and ``chain_ended(frame, began)`` when
    the chain ends (``began``: the ``time.time()`` of the split); and keep, for an
    out-of-order compile, the function that saves its AOTAutograd entry."""
    from torch._dynamo.backends.distributed import SubmodCompiler
    from torch._functorch._aot_autograd import graph_compile

    original_run = SubmodCompiler.__dict__["run"] if "run" in SubmodCompiler.__dict__ else None
    original_compile_submod = SubmodCompiler.__dict__["compile_submod"]
    original_cache_info = graph_compile.__dict__["_cache_autograd_info"]
    run = _splitting_run(SubmodCompiler.run, before_chain, chain_ended)
    compile_submod = _marking_compile_submod(original_compile_submod, chain_compiled)
    cache_autograd_info = _capturing_cache_info(original_cache_info)

    SubmodCompiler.run = run
    SubmodCompiler.compile_submod = compile_submod
    setattr(SubmodCompiler, _ORIGINAL_COMPILE_SUBMOD, original_compile_submod)
    graph_compile._cache_autograd_info = cache_autograd_info
    try:
        yield
    finally:
        if original_run is None:
            del SubmodCompiler.run
        else:
            SubmodCompiler.run = original_run
        SubmodCompiler.compile_submod = original_compile_submod
        delattr(SubmodCompiler, _ORIGINAL_COMPILE_SUBMOD)
        graph_compile._cache_autograd_info = original_cache_info


def _splitting_run(base_run: Callable[..., Any], before_chain: Callable[[SplitFrame], None],
                   chain_ended: Callable[[SplitFrame, float], None] | None) -> Callable[..., Any]:
    """``SubmodCompiler.run``, patched: ``before_chain`` before the chain, ``chain_ended`` after."""

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.time()
        frame = SplitFrame(self, args)
        if len(frame) > 1:
            before_chain(frame)
        self._coordinator_frame = frame
        try:
            return base_run(self, *args, **kwargs)
        finally:
            if len(frame) > 1 and chain_ended is not None:
                chain_ended(frame, began)

    return run


def _marking_compile_submod(original_compile_submod: Callable[..., Any],
                            chain_compiled: Callable[[SplitFrame, int, bool], None] | None) -> Callable[..., Any]:
    """``SubmodCompiler.compile_submod``, patched: the chain's position while it compiles
    (:func:`chain_position`), and ``chain_compiled`` after."""
    from torch._dynamo.utils import counters

    def compile_submod(self: Any, input_mod: Any, args: Any, kwargs: Any) -> Any:
        frame = getattr(self, "_coordinator_frame", None)
        index = next((i for i, m in enumerate(frame.submodules) if m is input_mod), None) if frame else None
        outer = getattr(_thread, "position", None)
        _thread.position = (frame, index) if index is not None else None
        if index is not None:
            untag(args)
        hits = counters["aot_autograd"].get("autograd_cache_hit", 0)
        try:
            compiled = original_compile_submod(self, input_mod, args, kwargs)
        finally:
            _thread.position = outer
        if index is not None and chain_compiled is not None:
            chain_compiled(frame, index, counters["aot_autograd"].get("autograd_cache_hit", 0) > hits)
        return compiled

    return compile_submod


def _capturing_cache_info(original_cache_info: Callable[..., Any]) -> Callable[..., Any]:
    """``_cache_autograd_info``, patched: an out-of-order compile's capture keeps the
    function that saves its AOTAutograd entry."""

    def cache_autograd_info(*args: Any, **kwargs: Any) -> Any:
        save, entry = original_cache_info(*args, **kwargs)
        capture = getattr(_thread, "capture", None)
        if capture is not None:
            capture.save = save
            capture.saved = entry is not None
        return save, entry

    return cache_autograd_info
