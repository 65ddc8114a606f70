"""Fake tensors described as data and rebuilt exactly: the outputs a compiled graph's
first call returns to DDPOptimizer (``split_graphs``).

A description holds, per output, everything the next bucket's compile can see of it:
size, stride, storage offset, storage size, dtype, device, requires_grad, whether it is
a view, its plain attributes (Inductor's ``_is_inductor_static``, which its cache keys
read), and how outputs relate: the same tensor, a shared storage, which one is whose
base, which are the forward's own inputs or views of them. Symbolic values are the
shape environment's expressions, printed and read back as Inductor prints and reads its
own output strides (``SymExprPrinter``, ``ShapeEnv.deserialize_symexpr``). A description
is only trusted once :func:`same_outputs` finds its rebuild equal to the originals.

Private names: ``symbolic_shapes.SymExprPrinter``, ``free_unbacked_symbols`` and
``statically_known_true``, ``ShapeEnv.deserialize_symexpr``, ``FakeTensor`` and its
``fake_mode``, a tensor's ``_base``, ``StorageWeakRef``,
``FakifiedOutWrapper._compute_output_meta_with_inductor_strides``. Checked with
``split_graphs``, which it serves: read from the sources of 2.11.0, 2.13.0 and 2.14.1; the
tests (``tests/test_split_graphs.py``) ran on all three on CPU; on 2.11.0 on an H100 (the
restart benchmark, the GPU tier).
"""

from __future__ import annotations

from typing import Any


class Undescribable(Exception):
    """An output the description cannot reproduce exactly."""


class Mismatch(Exception):
    """A recorded description that does not fit the loaded entry or this process."""


def _printer() -> Any:
    from torch.fx.experimental.symbolic_shapes import SymExprPrinter

    return SymExprPrinter()


def _expr(value: Any, printer: Any) -> str:
    """An int or a backed symbolic int as the text ``ShapeEnv.deserialize_symexpr`` reads."""
    import torch
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise Undescribable(f"a {type(value).__name__} where an int was expected")
    if isinstance(value, int):
        return str(value)
    expr = value.node.expr
    if free_unbacked_symbols(expr):
        raise Undescribable(f"unbacked symbol in {expr}")
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
        raise Undescribable(f"{what} has attributes that are not plain data: {', '.join(odd)}")
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
        Undescribable: an output cannot be rebuilt exactly.
    """
    import torch

    printer = _printer()
    input_storages, members = _storages(outputs, inputs)
    described: list[Any] = []
    used_inputs: dict[int, dict] = {}
    storages: dict[int, list[Any]] = {}
    for index, out in enumerate(outputs):
        same = next((k for k, earlier in enumerate(outputs[:index]) if earlier is out), None)
        if same is not None:
            described.append(["same", same])
        elif out is None:
            described.append(["none"])
        elif not isinstance(out, torch.Tensor):
            described.append(["int", _expr(out, printer)])
        else:
            owners = input_storages.get(_storage_of(out), [])
            described.append(_describe_tensor(index, outputs, inputs, owners, members, printer, used_inputs, storages))
    return {"outputs": described, "inputs": used_inputs, "storages": storages}


def _storage_of(t: Any) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def _storages(outputs: list[Any], inputs: list[Any]) -> tuple[dict[Any, list[int]], dict[Any, list[int]]]:
    """Which inputs, and which distinct tensor outputs, hold each storage.

    Raises:
        Undescribable: a tensor output is not a plain fake tensor.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    input_storages: dict[Any, list[int]] = {}
    for j, t in enumerate(inputs):
        input_storages.setdefault(_storage_of(t), []).append(j)
    members: dict[Any, list[int]] = {}
    for index, out in enumerate(outputs):
        if isinstance(out, torch.Tensor) and not any(out is earlier for earlier in outputs[:index]):
            if type(out) is not FakeTensor:
                raise Undescribable(f"output {index} is a {type(out).__name__}")
            members.setdefault(_storage_of(out), []).append(index)
    return input_storages, members


def _describe_tensor(index: int, outputs: list[Any], inputs: list[Any], owners: list[int],
                     members: dict[Any, list[int]], printer: Any, used_inputs: dict[int, dict],
                     storages: dict[int, list[Any]]) -> list[Any]:
    """Tensor output ``index`` as :func:`describe_outputs` describes it (``["input", j]``
    or ``["tensor", layout, storage, base]``); ``owners``: the inputs holding its storage.
    Records the inputs it uses in ``used_inputs`` and a storage it shares with a later
    output in ``storages``."""
    import torch

    out = outputs[index]
    if out.layout != torch.strided or out.is_conj() or out.is_neg() or out.is_inference():
        raise Undescribable(f"output {index} has a layout or flags the rebuild does not set")
    storage = _storage_of(out)
    layout = _plain_layout(out, printer, f"output {index}")
    if len(owners) > 1:
        raise Undescribable(f"output {index} aliases inputs {owners}, which share storage")
    if owners:
        j = owners[0]
        used_inputs[j] = _plain_layout(inputs[j], printer, f"input {j}")
        if inputs[j] is out:
            return ["input", j]
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
    return ["tensor", layout, holder, base]


def deserialize(shape_env: Any, text: str) -> Any:
    if shape_env is None:
        return int(text)
    try:
        return shape_env.deserialize_symexpr(text)
    except NameError as exc:  # a symbol this shape environment does not have
        raise Mismatch(f"{text}: {exc}") from None


def _rebuild_tensor(layout: dict, shape_env: Any, storage: Any = None, base: Any = None) -> Any:
    """A fake tensor with ``layout``, made inside the fake mode: in ``storage`` if given
    (a view of ``base``, or of a tensor over the whole storage), else in its own."""
    out = _rebuild_layout(layout, shape_env, storage, base)
    for name, value in layout["attributes"].items():
        setattr(out, name, value)
    return out


def _rebuild_layout(layout: dict, shape_env: Any, storage: Any, base: Any) -> Any:
    import torch

    size = [deserialize(shape_env, s) for s in layout["size"]]
    stride = [deserialize(shape_env, s) for s in layout["stride"]]
    offset = deserialize(shape_env, layout["offset"])
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
                    raise Mismatch("a view that requires grad")
                storage = torch.empty((deserialize(shape_env, layout["nbytes"]),), dtype=torch.uint8,
                                      device=device).untyped_storage()
            base = over(storage, 0, [storage.nbytes() // dtype.itemsize], [1])
        with torch.set_grad_enabled(requires_grad):
            return base.as_strided(size, stride, offset)
    if storage is not None:
        out = over(storage, offset, size, stride)
    else:
        out = torch.empty_strided(size, stride, dtype=dtype, device=device)
        if layout["offset"] != "0" or _expr(out.untyped_storage().nbytes(), _printer()) != layout["nbytes"]:
            # Not a view, yet over a larger buffer than it spans (a part of a fused
            # projection, once the trace dropped the view): a storage of the size recorded.
            nbytes = deserialize(shape_env, layout["nbytes"])
            whole = torch.empty((nbytes,), dtype=torch.uint8, device=device).untyped_storage()
            out = over(whole, offset, size, stride)
    return out.requires_grad_(True) if requires_grad else out


def rebuild_outputs(described: dict, fake_mode: Any) -> list[Any]:
    """Fake outputs from :func:`describe_outputs`, made in ``fake_mode``."""
    import torch

    shape_env = getattr(fake_mode, "shape_env", None)
    outputs: list[Any] = []
    with fake_mode:
        inputs = {int(j): _rebuild_tensor(layout, shape_env) for j, layout in described["inputs"].items()}
        storages = {int(k): torch.empty((deserialize(shape_env, nbytes),), dtype=torch.uint8,
                                        device=torch.device(device)).untyped_storage()
                    for k, (nbytes, device) in described["storages"].items()}
        for item in described["outputs"]:
            kind = item[0]
            if kind == "same":
                outputs.append(outputs[item[1]])
            elif kind == "none":
                outputs.append(None)
            elif kind == "int":
                outputs.append(deserialize(shape_env, item[1]))
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
                raise Mismatch(f"unknown output kind {kind!r}")
    return outputs


def same_outputs(rebuilt: list[Any], originals: list[Any]) -> str | None:
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
            if not _same_layout(new, old, printer):
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


def _same_layout(new: Any, old: Any, printer: Any) -> bool:
    """Whether fake tensors ``new`` and ``old`` have the same layout: printed alike, or alike
    but for a storage size that prints differently and that the shape environment proves
    equal for every size it allows (Inductor sizes a buffer ``2048*s + 6144*Max(1, s - 1) -
    2048`` where a rebuild gets ``8192*s - 8192``, ``s`` being at least 2). Cache keys never
    read a symbolic storage size; sizes, strides and offsets are compared as printed."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    new_layout, old_layout = _layout(new, printer), _layout(old, printer)
    if new_layout == old_layout:
        return True
    if {**new_layout, "nbytes": None} != {**old_layout, "nbytes": None}:
        return False
    new_nbytes, old_nbytes = new.untyped_storage().nbytes(), old.untyped_storage().nbytes()
    return not isinstance(new_nbytes, int) and bool(statically_known_true(new_nbytes == old_nbytes))


def strides_as_read(strides: list[Any] | None, shape_env: Any) -> list[Any] | None:
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
        values = [deserialize(shape_env, e) if isinstance(e, str) else e for e in exprs]
        read.append([_expr(v, printer) for v in values])
    return read


def final_attributes(out: Any, index: int) -> dict | None:
    """The attributes of a fake output as the first call returns it (``None``: not a tensor)."""
    import torch

    if not isinstance(out, torch.Tensor):
        return None
    attributes = _attributes(out)
    odd = sorted(name for name, value in attributes.items() if isinstance(value, dict))
    if odd:
        raise Undescribable(f"output {index} has attributes that are not plain data: {', '.join(odd)}")
    return attributes


def restrided(wrapper_class: Any, outputs: list[Any], record: dict, shape_env: Any) -> list[Any]:
    """``outputs`` re-strided to the recorded Inductor strides by ``FakifiedOutWrapper``'s
    own code, with the attributes the first call's outputs had."""
    strides = [None if s is None else [deserialize(shape_env, e) for e in s] for s in record["strides"] or []]
    final = wrapper_class(out_metas=list(outputs), fwd_output_strides=strides or None)
    final = final._compute_output_meta_with_inductor_strides()
    for out, attributes in zip(final, record["final_attributes"], strict=True):
        for name, value in (attributes or {}).items():
            setattr(out, name, value)
    return final


def not_describable_runtime(runtime_metadata: Any, subclass_meta: Any) -> str | None:
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
