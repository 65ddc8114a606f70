"""Each mend of ``_compat.precompile`` against torch's own path, in a fresh process
(``tests/test_precompiled.py`` runs it): prints one JSON line of what it found."""

from __future__ import annotations

import json
import os
import threading

import torch
import torch.distributed as dist

from coordinator._compat import precompile

LOCAL = threading.local()
LOCAL.scale = 3.0


def scaled(x):
    return x * LOCAL.scale


class First(torch.nn.Linear):
    pass


class Second(torch.nn.Linear):
    pass


def describe(t: torch.Tensor) -> list:
    return [list(t.shape), list(t.stride()), str(t.dtype), str(t.device), t.requires_grad, t.grad is None,
            repr(torch._C._dispatch_keys(t))]


def main() -> None:
    import torch._dynamo.guards as guards
    from torch.distributed.fsdp import fully_shard

    found = {}
    x = torch.ones(3)
    recorded = {}
    tensor = torch.randn(3, 4, requires_grad=True)
    args = (torch.empty_like(tensor, device="meta", requires_grad=True), tensor.device, torch.Tensor,
            torch._C._dispatch_keys(tensor).raw_repr())
    torch_tensor = describe(guards.GuardsStatePickler._unpickle_tensor(*args, None))
    try:
        guards.GuardsStatePickler._unpickle_tensor(*args, guards._Missing("tensor guard tree"))
        found["torch_missing_grad"] = "loaded"
    except TypeError:
        found["torch_missing_grad"] = "TypeError"
    with precompile.precompiled_functions(lambda key: None, lambda key, package: recorded.setdefault(key, package),
                                          lambda key, error: None):
        # A guard state that does not pickle: compiled as without precompile, not packaged.
        found["unpicklable_guard"] = [torch.compile(scaled)(x).tolist(), scaled(x).tolist(),
                                      precompile.complete_package(list(recorded.values())) is None]
        # A parameter's gradient no guard reads: the same fake tensor, without the placeholder.
        found["tensor"] = [describe(guards.GuardsStatePickler._unpickle_tensor(*args, None)), torch_tensor,
                           describe(guards.GuardsStatePickler._unpickle_tensor(
                               *args, guards._Missing("tensor guard tree")))]
        # FSDP2's class, made before fully_shard: the one fully_shard then gives the module.
        made_first = precompile.fsdp_class(First)
        first = fully_shard(First(4, 4))
        second = fully_shard(Second(4, 4))
    made_by_torch = type(second)
    found["fsdp"] = [type(first) is made_first,
                     [made_first.__name__[len("FSDP"):], made_first.__module__, made_first.__bases__[0].__name__,
                      made_first.__deepcopy__ is made_by_torch.__deepcopy__],
                     [made_by_torch.__name__[len("FSDP"):], made_by_torch.__module__,
                      made_by_torch.__bases__[0].__name__, True],
                     precompile.fsdp_class(Second) is made_by_torch]
    print(json.dumps(found))


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        main()
    finally:
        dist.destroy_process_group()
