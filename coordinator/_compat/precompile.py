r"""Dynamo's precompiled functions: a function installed from a package, without tracing.

With ``torch._dynamo.config.caching_precompile`` on, each ``torch.compile`` of a function
(or module) made while it is on gets a ``CompilePackage``: every frame Dynamo traces
for it (the function, its graph-break resume functions, each recompile) is recorded with
its guards and its transformed bytecode, and AOTAutograd records each graph's compiled
forward and backward (a ``BundledAOTAutogradCacheArtifact``, Triton kernels included)
once its backward is compiled. At the next ``torch.compile`` of the same function,
``DynamoCache.load(fn)`` returns the saved ``PrecompileCacheEntry`` and the package
installs it: the compiled graphs into the module's globals and the guarded bytecode
onto the function's code object, so its first call runs compiled code with no tracing.
A call whose guards fail is traced as usual.

:func:`precompiled_functions` routes that load to the coordinator (``load``, given the
package's source id, returns verified pickle bytes or ``None``; ``None`` falls back to
torch's own disk cache, where a restored bundle puts packages) and reports each package
Dynamo records (``recorded``). :func:`complete_package` merges the packages of one
function once every graph in them has its backend. It also mends, for the duration,
what torch's precompile gets wrong:

* **A failing guard crashed the retrace** (``AssertionError: Name '__builtins_dict___0'
  already exists in scope``): ``install`` puts the saving process's
  ``__builtins_dict___<n>`` (and ``__compiled_fn_<n>``) names into the module's globals,
  and this process's name counter (``bytecode_transformation._unique_id_counter``) then
  generates the same names. After each install the counter is moved past the number of
  every dunder global of the modules the package installed into (pytorch#196822
  proposes the same upstream).
* **A recompile after a backward did not load** (``TypeError: assigned grad expected to
  be a Tensor or None but got grad of type _Missing``): the guard state pickles each
  tensor's ``.grad``, and a parameter's gradient, which no guard reads, is pickled as a
  ``_Missing`` placeholder that the unpickler then assigns. Read back as no gradient;
  a gradient a guard reads is in the guard tree and pickled in full.
* **A block compiled before it is sharded did not load** (``KeyError`` in
  ``_unpickle_fsdp_module_type``): FSDP2's per-block pattern (torchtitan's) compiles each
  block, which installs its package, and only then ``fully_shard``\ s it, which makes the
  ``FSDP<Block>`` class the guards name. That class is made first, exactly as
  ``fully_shard`` makes it, and ``fully_shard`` then reuses it (:func:`fsdp_class`).
* **A guard on a decorated function did not load** (``'_Missing' object has no
  attribute '__name__'``): transformers wraps HF models' ``forward`` in a decorator
  (``deprecate_kwarg``) whose frame holds the original function and guards
  ``func.__name__``; its module attribute is the wrapper, so torch pickles the original
  as a placeholder ("fqn mismatch"). A function found behind the attribute's
  ``__wrapped__`` chain is pickled as that path (:func:`_function_behind_wrappers`), the
  same object at load. The wrapper's compiled code is then installed into its own
  module's globals: ``install`` used the module its ``__module__`` names, which
  ``functools.wraps`` copies from the wrapped function (``NameError:
  __compiled_fn_...`` at its first call).
* **A module the compiled code loads was missing** (``NameError:
  ___module_collections_..._c0``): Dynamo installs a module it needs under a name made
  from its id (``install_global_by_id``), and the package records only the modules the
  traced code imported itself. Each module installed while a package records is added
  to its imports. And after every install, each global the installed code loads must be
  there (:func:`_check_globals`), else the package is refused and the function traced.
* **FSDP2 modules' guards failed at every call**: the guard state rebuilds a module
  through its class's ``__new__``, and ``FSDPModule.__new__`` returns an instance of the
  original class, so the loaded ``TYPE_MATCH`` guard named ``Block`` and never matched
  the ``FSDPBlock`` it guards. While a guard state loads, the module keeps its class.
* **A frame whose guards do not serialize crashed its compile**: an object in the guard
  state that does not pickle (a ``threading.local``) raised out of ``serialize_guards``,
  which catches only its own ``PackageError`` (now raised for any failure); and on a
  ``PackageError`` (an HF Qwen2 layer under FSDP2) the guard builder bypasses the
  frame's package entry, leaving no guard state, which ``convert_frame`` then asserts on
  (``check_fn.guards_state must not be None``). An empty state is given instead; the
  bypassed entry drops it, so the frame is compiled and never packaged.
* **AOTAutograd's cache never hit across processes** while caching precompile is on:
  its keys held the process's own backend id (:func:`_aot_keys_without_backend_ids`).
* **A package that does not install** (another torch, Python, GPU or Triton, a changed
  source): torch logs a warning and compiles fresh; the reason is reported through
  ``on_install(source_id, error)`` instead, with ``error`` ``None`` on success.

While on, caching precompile drops ``ID_MATCH``, ``CLOSURE_MATCH``, ``WEAKREF_ALIVE`` and
``DICT_VERSION`` guards for every compile (torch warns about each): that is why it is off
unless asked for (``Config.precompile``).

Not for DDPOptimizer frames: ``_clone_with_backend`` (``convert_frame.py``) builds their
converter without the package, so nothing is recorded for them and they are traced.

Private names (2.11.0, 2.13.0, 2.14.1): ``torch._dynamo.config.caching_precompile``;
``torch._dynamo.package``: ``DynamoCache`` (``load``, ``record_package``, the module
instance), ``CompilePackage`` (``install``, ``uninstall``, ``source_id``,
``source_id_from_fn``, ``cache_entry``, ``_codes``, ``_current_entry``, ``_innermost_fn``,
``_initialized``), ``PrecompileCacheEntry``, ``_hash_sourcelines``;
``precompile_context.PrecompileContext`` (``serialize_artifact_by_key``,
``record_artifact``); ``bytecode_transformation._unique_id_counter``;
``guards.GuardsStatePickler`` (``reducer_override``, ``_unpickle_tensor``,
``_unpickle_fsdp_module_type``),
``guards._Missing``, ``guards.CheckFunctionManager`` (``__init__`` with ``save_guards``,
``guards_state``, ``serialize_guards``), ``exc.PackageError``;
``package.load_guards_state``, ``CompilePackage.add_import_source``,
``output_graph.OutputGraph.install_global_unsafe`` (``package``);
``autograd_cache.AOTAutogradCachePickler._reduce_aot_config``, ``AOTConfig.precompile_backend_id``;
``fsdp._fully_shard._fully_shard`` (``get_cls_to_fsdp_cls``, ``FSDPModule`` and its
``__new__``, ``_orig_cls_mro_index``, ``_unimplemented_deepcopy``; the class as
``_fsdp_init._apply_to_module`` makes it). Read from the sources of 2.11.0, 2.13.0 and 2.14.1
(``PRECOMPILE_VERSIONS``, ``CHECKED_ON["precompile"]``, lists where it is offered); the tests
(``tests/test_precompiled.py``, with ``tests/precompile_mends.py``) ran on 2.13.0 and 2.14.1 on
CPU; on 2.11.0 on an H200 (the restart benchmark, HF Llama).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import logging
import pickle
import re
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from coordinator._compat.versions import CHECKED_ON, unchecked

log = logging.getLogger(__name__)

#: Torch versions (major, minor) whose sources this was read from and whose tests pass.
PRECOMPILE_VERSIONS = CHECKED_ON["precompile"]

_NUMBERED = re.compile(r"_(\d+)$")


def precompile_unsupported() -> str | None:
    """Why this torch gets no precompiled functions, or ``None``."""
    why = unchecked("precompile")
    if why is not None:
        return why
    try:
        import torch._dynamo.package  # noqa: F401
        from torch._dynamo.precompile_context import PrecompileContext  # noqa: F401
    except ImportError as exc:
        return f"torch._dynamo.package is missing ({exc})"
    return None


def package_key(fn: Callable[..., Any]) -> str | None:
    """The key of ``fn``'s package: torch's (its qualified name and first line) and a
    hash of its source, so an edited function never gets an old package (torch checks
    the sources it inlined, not the function's own); ``None`` without a source."""
    import hashlib
    import inspect

    from torch._dynamo.eval_frame import innermost_fn
    from torch._dynamo.package import CompilePackage

    fn = innermost_fn(fn)
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    return f"{CompilePackage.source_id_from_fn(fn)}-{hashlib.sha256(source.encode()).hexdigest()[:16]}"


def _check_entry(entry: Any) -> None:
    """Raise ``RuntimeError`` where torch's ``CompilePackage.initialize`` would: another
    system (Python, torch, CUDA, Triton, GPU) or an edited inlined source."""
    import importlib

    from torch._dynamo.package import _hash_sourcelines

    entry.dynamo.check_versions()
    for code in entry.dynamo.source_info.inlined_sources:
        module = importlib.import_module(code.module)
        if _hash_sourcelines(module, code.firstlineno, code.lastlineno) != code.checksum:
            raise RuntimeError(f"source changed: {code.module} lines {code.firstlineno}-{code.lastlineno}")


def _check_globals(package: Any) -> None:
    """Raise ``RuntimeError`` if a global that an installed function's compiled code
    loads is not there: a name torch's package did not record would be a ``NameError``
    at the first call, in the middle of a training step."""
    import builtins
    import dis

    from torch._dynamo.package import SerializedCode

    def loaded(code: Any) -> Iterator[str]:
        for instruction in dis.get_instructions(code):
            if instruction.opname == "LOAD_GLOBAL":
                yield instruction.argval
        for const in code.co_consts:
            if inspect.iscode(const):
                yield from loaded(const)

    for entry in package._codes.values():
        scope = vars(sys.modules[entry.python_module])
        for guarded in entry.guarded_codes:
            for name in loaded(SerializedCode.to_code_object(guarded.dynamo_code)):
                if name not in scope and not hasattr(builtins, name):
                    raise RuntimeError(f"its code loads global {name!r}, which the package does not install")


def _advance_name_counter(names: Iterator[str]) -> None:
    """Make this process's Dynamo name counter generate only numbers above ``names``'."""
    import torch._dynamo.bytecode_transformation as bt

    highest = max((int(m.group(1)) for name in names if (m := _NUMBERED.search(name))), default=-1)
    current = next(bt._unique_id_counter)
    bt._unique_id_counter = itertools.count(max(current, highest + 1))


@contextlib.contextmanager
def _guard_state_mends() -> Iterator[None]:
    """The guard-state mends of the module docstring: ``_Missing`` grads, FSDP2 classes
    of blocks not sharded yet, guards that do not serialize; restored on exit."""
    with _unpickler_mends(), _serialization_mends(), _load_guards_state_mend(), _reducer_mend(), \
            _import_sources_mend():
        yield


@contextlib.contextmanager
def _unpickler_mends() -> Iterator[None]:
    """Guard states unpickle ``_Missing`` grads as ``None``, and FSDP2 classes of blocks
    not sharded yet (:func:`fsdp_class`)."""
    import torch._dynamo.guards as guards_module

    pickler = guards_module.GuardsStatePickler
    torch_unpickle_tensor = pickler.__dict__["_unpickle_tensor"]

    def _unpickle_tensor(cls: type, meta: Any, device: Any, pytype: type, keys: int, grad: Any) -> Any:
        # Named as torch's: guard states pickle this method by its name.
        if isinstance(grad, guards_module._Missing):
            grad = None
        return torch_unpickle_tensor.__func__(cls, meta, device, pytype, keys, grad)

    torch_unpickle_fsdp_type = pickler.__dict__["_unpickle_fsdp_module_type"]

    def _unpickle_fsdp_module_type(cls: type, original_type: type) -> type:
        # Named as torch's: guard states pickle this method by its name.
        return fsdp_class(original_type)

    pickler._unpickle_tensor = classmethod(_unpickle_tensor)
    pickler._unpickle_fsdp_module_type = classmethod(_unpickle_fsdp_module_type)
    try:
        yield
    finally:
        pickler._unpickle_tensor = torch_unpickle_tensor
        pickler._unpickle_fsdp_module_type = torch_unpickle_fsdp_type


@contextlib.contextmanager
def _serialization_mends() -> Iterator[None]:
    """Guards that do not serialize raise ``PackageError`` (the package entry is bypassed)
    and leave an empty guard state behind."""
    import torch._dynamo.guards as guards_module
    from torch._dynamo.exc import PackageError

    manager = guards_module.CheckFunctionManager
    torch_manager_init = manager.__init__
    torch_serialize = manager.serialize_guards

    def serialize_guards(self: Any, *args: Any, **kwargs: Any) -> bytes:
        try:
            return torch_serialize(self, *args, **kwargs)
        except PackageError:
            raise
        except Exception as exc:  # an object of the guard state that does not pickle
            raise PackageError(f"guard state does not serialize: {exc}") from exc

    def manager_init(self: Any, *args: Any, save_guards: bool = False, **kwargs: Any) -> None:
        torch_manager_init(self, *args, save_guards=save_guards, **kwargs)
        if save_guards and self.guards_state is None:
            # Guard serialization failed and the output graph bypassed its package entry
            # (``bypass_package``); an empty state lets convert_frame go on, and the
            # bypassed entry ignores it.
            self.guards_state = b""

    manager.__init__, manager.serialize_guards = manager_init, serialize_guards
    try:
        yield
    finally:
        manager.__init__, manager.serialize_guards = torch_manager_init, torch_serialize


@contextlib.contextmanager
def _load_guards_state_mend() -> Iterator[None]:
    """FSDP2 modules keep their class while a guard state loads."""
    import torch._dynamo.package as package_module

    torch_load_guards_state = package_module.load_guards_state

    def load_guards_state(guards_state: bytes) -> Any:
        with _fsdp_modules_keep_their_class():
            return torch_load_guards_state(guards_state)

    package_module.load_guards_state = load_guards_state
    try:
        yield
    finally:
        package_module.load_guards_state = torch_load_guards_state


@contextlib.contextmanager
def _reducer_mend() -> Iterator[None]:
    """Guard states pickle a function behind wrappers as that function."""
    import torch._dynamo.guards as guards_module

    pickler = guards_module.GuardsStatePickler
    torch_reduce = pickler.reducer_override

    def reducer_override(self: Any, obj: Any) -> Any:
        behind = _behind_wrappers(obj)
        return (_function_behind_wrappers, behind) if behind is not None else torch_reduce(self, obj)

    pickler.reducer_override = reducer_override
    try:
        yield
    finally:
        pickler.reducer_override = torch_reduce


@contextlib.contextmanager
def _import_sources_mend() -> Iterator[None]:
    """A module the output graph installs as a global becomes an import source of the
    package being recorded."""
    import torch._dynamo.output_graph as output_graph_module

    graph_class = output_graph_module.OutputGraph
    torch_install_global = graph_class.install_global_unsafe

    def install_global_unsafe(self: Any, name: str, value: Any) -> None:
        torch_install_global(self, name, value)
        package = getattr(self, "package", None)
        if isinstance(value, types.ModuleType) and package is not None and package._current_entry is not None:
            package.add_import_source(name, value.__name__)

    graph_class.install_global_unsafe = install_global_unsafe
    try:
        yield
    finally:
        graph_class.install_global_unsafe = torch_install_global


@contextlib.contextmanager
def precompiled_functions(
    load: Callable[[str], bytes | None],
    recorded: Callable[[str, Any], None],
    on_install: Callable[[str, BaseException | None], None],
) -> Iterator[None]:
    """Caching precompile on, its loads from ``load(package key)`` first, ``recorded(key,
    package)`` told of each package Dynamo records, each install's outcome reported to
    ``on_install(key, error)``; all restored on exit."""
    import torch._dynamo.config as dynamo_config
    import torch._dynamo.package as package_module

    cache = package_module.DynamoCache
    package_class = package_module.CompilePackage
    torch_load, torch_record, torch_install = cache.load, cache.record_package, package_class.install

    def record_package(package: Any) -> None:
        torch_record(package)
        key = package_key(package._innermost_fn)
        if key is not None:
            recorded(key, package)

    saved_flag = dynamo_config.caching_precompile
    dynamo_config.caching_precompile = True
    cache.load = _load_entry_patch(torch_load, load, on_install)
    cache.record_package = record_package
    package_class.install = _install_patch(torch_install, on_install)
    try:
        with _guard_state_mends(), _aot_keys_without_backend_ids():
            yield
    finally:
        dynamo_config.caching_precompile = saved_flag
        package_class.install = torch_install
        for name in ("load", "record_package"):
            cache.__dict__.pop(name, None)


def _load_entry_patch(torch_load: Callable[[Callable[..., Any]], Any], load: Callable[[str], bytes | None],
                      on_install: Callable[[str, BaseException | None], None]) -> Callable[[Callable[..., Any]], Any]:
    """``DynamoCache.load`` that loads a function's package from ``load(package key)``
    first, reporting an entry that does not fit to ``on_install``."""
    import torch._dynamo.package as package_module
    from torch._dynamo.precompile_context import PrecompileContext

    def load_entry(fn: Callable[..., Any]) -> Any:
        key = package_key(fn)
        data = load(key) if key is not None else None
        if data is None:
            return torch_load(fn)
        try:
            entry = pickle.loads(data)
            if not isinstance(entry, package_module.PrecompileCacheEntry):
                raise TypeError(f"not a PrecompileCacheEntry: {type(entry).__name__}")
            _check_entry(entry)
        except Exception as exc:  # a verified value that does not fit: compile as usual
            on_install(key, exc)
            return None
        for backend in entry.backends.values():  # later saves of this package need them
            PrecompileContext.record_artifact(backend)
        return entry

    return load_entry


def _install_patch(torch_install: Callable[[Any, dict], None],
                   on_install: Callable[[str, BaseException | None], None]) -> Callable[[Any, dict], None]:
    """``CompilePackage.install`` into the function's own globals, each outcome reported
    to ``on_install``; a failed install is undone and raised as a ``RuntimeError``."""
    import torch._dynamo.package as package_module

    package_class = package_module.CompilePackage

    def install(package: Any, backends: dict) -> None:
        key = package_key(package._innermost_fn) or package.source_id
        # The function's compiled code runs in its own globals: install there, not in the
        # module its ``__module__`` names (a ``functools.wraps`` wrapper takes the name of
        # the function it wraps, so its compiled calls were not found).
        main = package._codes[package._innermost_fn.__code__]
        main.python_module = package._innermost_fn.__globals__.get("__name__", main.python_module)
        modules = {sys.modules.get(code.python_module) for code in package._codes.values()}
        try:
            torch_install(package, backends)
            _check_globals(package)
        except Exception as exc:
            # torch compiles fresh on a RuntimeError only, and only from a package that
            # is not initialized: undo the install, then hand it back as a new one.
            on_install(key, exc)
            package.uninstall()
            package_class.__init__(package, None)
            raise RuntimeError(f"precompiled package {key} did not install: {exc}") from exc
        finally:
            # Names the install put into the modules (``__builtins_dict___<n>`` stays even
            # after an uninstall) must not be generated again by a retrace.
            _advance_name_counter(name for module in modules if module is not None
                                  for name in list(vars(module)) if name.startswith("__"))
        on_install(key, None)

    return install


@contextlib.contextmanager
def _aot_keys_without_backend_ids() -> Iterator[None]:
    """AOTAutograd's cache keys without the precompile backend id, which names the
    graph's compiled function in this process only (``__compiled_fn_<n>_<uuid>``): with
    it in the key, no AOTAutograd entry was ever found by another process. A hit names
    its artifact with this process's id (``autograd_cache.py`` says so), and a saved entry
    drops it, so the entry does not depend on it."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler

    torch_reduce = AOTAutogradCachePickler.__dict__["_reduce_aot_config"]

    def _reduce_aot_config(self: Any, aot_config: Any) -> Any:
        if getattr(aot_config, "precompile_backend_id", None) is not None:
            aot_config = dataclasses.replace(aot_config, precompile_backend_id=None)
        return torch_reduce(self, aot_config)

    AOTAutogradCachePickler._reduce_aot_config = _reduce_aot_config
    try:
        yield
    finally:
        AOTAutogradCachePickler._reduce_aot_config = torch_reduce


def _behind_wrappers(obj: Any) -> tuple[str, str, int] | None:
    """``(module, qualname, depth)`` when ``obj`` is a function that its module's
    attribute of that name hides behind ``depth`` wrappers (``functools.wraps``)."""
    if not inspect.isfunction(obj) or "<locals>" in obj.__qualname__ or obj.__module__ not in sys.modules:
        return None
    found: Any = sys.modules[obj.__module__]
    for name in obj.__qualname__.split("."):
        found = getattr(found, name, None)
    for depth in range(1, 9):
        found = getattr(found, "__wrapped__", None)
        if found is None:
            return None
        if found is obj:
            return obj.__module__, obj.__qualname__, depth
    return None


def _function_behind_wrappers(module: str, qualname: str, depth: int) -> Any:
    """The function :func:`_behind_wrappers` described."""
    import importlib

    found: Any = importlib.import_module(module)
    for name in qualname.split("."):
        found = getattr(found, name)
    for _ in range(depth):
        found = found.__wrapped__
    return found


@contextlib.contextmanager
def _fsdp_modules_keep_their_class() -> Iterator[None]:
    """While a guard state unpickles: an FSDP2 module is rebuilt as an instance of its
    ``FSDP<Block>`` class, as it was when its guards were made. ``FSDPModule.__new__``
    builds an instance of the original class instead (for indexing into containers), so
    a loaded ``TYPE_MATCH`` guard expected ``Block`` and failed on every real call."""
    try:
        from torch.distributed.fsdp._fully_shard import _fully_shard as fsdp
    except ImportError:
        yield
        return
    module_class = fsdp.FSDPModule
    torch_new = module_class.__dict__["__new__"]

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        original = cls.__mro__[getattr(cls, "_orig_cls_mro_index", 2)]
        return original.__new__(cls)

    module_class.__new__ = __new__
    try:
        yield
    finally:
        module_class.__new__ = torch_new


def fsdp_class(cls: type) -> type:
    """FSDP2's class for modules of ``cls``, made as ``fully_shard`` makes it (and then
    reuses) if no module of ``cls`` was sharded yet."""
    from torch.distributed.fsdp._fully_shard import _fully_shard as fsdp

    classes = fsdp.get_cls_to_fsdp_cls()
    if cls not in classes:
        module = getattr(fsdp, "_apply_to_module", fsdp.fully_shard).__module__  # where fully_shard makes it
        classes[cls] = type(f"FSDP{cls.__name__}", (fsdp.FSDPModule, cls),
                            {"__deepcopy__": fsdp._unimplemented_deepcopy, "__module__": module})
    return classes[cls]


def complete_package(packages: list[Any]) -> tuple[Any, int] | None:
    """The packages Dynamo recorded for one function, merged into one
    ``PrecompileCacheEntry`` (a pickle, for the store), with their count of guarded
    entries; ``None`` until every graph in them has its compiled backend (a backward
    compiles at its first call) and no frame of them is being compiled.

    Each ``torch.compile`` of a function has a package of its own, and torch keeps one
    per function (the last recorded): the blocks of a model compiled one by one
    (``block.compile()``), whose inputs differ (the first block's input needs no grad),
    would each find only its own entries. Merged, every block finds all.
    """
    import copy

    from torch._dynamo.package import PrecompileCacheEntry
    from torch._dynamo.precompile_context import PrecompileContext

    def own(code: Any) -> Any:  # a copy whose lists the merge may extend
        code = copy.copy(code)
        code.guarded_codes, code.backend_ids = list(code.guarded_codes), list(code.backend_ids)
        return code

    if not packages or any(package._current_entry is not None for package in packages):
        return None
    merged = copy.copy(packages[0].cache_entry())
    merged.codes = [own(code) for code in merged.codes]
    for package in packages[1:]:
        by_code = {code.python_code: code for code in merged.codes}
        for code in package.cache_entry().codes:
            into = by_code.get(code.python_code)
            if into is None:
                merged.codes.append(own(code))
                continue
            # A package installed from a merged one holds its entries already.
            into.guarded_codes.extend(g for g in code.guarded_codes if g not in into.guarded_codes)
            into.backend_ids.extend(b for b in code.backend_ids if b not in into.backend_ids)
    backends = {}
    for backend_id in merged.backend_ids:
        backend = PrecompileContext.serialize_artifact_by_key(backend_id)
        if backend is None:
            return None
        backends[backend_id] = backend
    entries = sum(len(code.guarded_codes) for code in merged.codes)
    if entries == 0:
        return None
    return PrecompileCacheEntry(dynamo=merged, backends=backends), entries
