"""DDPOptimizer's split graphs served from AOTAutograd's cache (``_compat.split_graphs``).

Real jobs: one process per rank, gloo, DDP with 1 MB buckets (DDPOptimizer splits the
model's graph at each), a ``file://`` store the jobs share; a restart is a second job on
the same store with empty Inductor cache dirs. Two steps: batch 8, then batch 12 (a
recompile, with a dynamic batch dimension). The worker records what DDPOptimizer hands
each submodule's compile, and which bucket each lazily compiled backward reads its
forward metadata from.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import require_success

from coordinator import Config

SHAPES = [8, 12]


def split(result) -> dict:
    return result.report["stats"]["ddp_split_graphs"]


OPTIONS = {"ddp": True, "bucket_cap_mb": 1, "shapes": SHAPES, "record_split": True}


def assert_same_training(cold, restart):
    """The restart trained exactly as the cold run: what each submodule was compiled
    for, the losses and every parameter's gradient."""
    assert restart.report["split_graphs"]["submod_inputs"] == cold.report["split_graphs"]["submod_inputs"]
    assert restart.report["losses"] == cold.report["losses"]
    assert restart.report["grad_norms"] == cold.report["grad_norms"]
    torch.testing.assert_close(restart.report["losses"], restart.report["ref_losses"], rtol=1e-4, atol=1e-5)


def aot_values(store: Path) -> list[Path]:
    """The AOTAutograd entries in a ``file://`` store, oldest first."""
    return sorted((p for p in store.rglob("*") if p.is_file() and "/v/" in str(p) and "/aot_autograd/" in str(p)),
                  key=lambda p: p.stat().st_mtime)


def test_restarts_serve_every_split_graph_and_turn_anything_wrong_into_a_miss(job, tmp_path):
    secret = {"COORDINATOR_SECRET": "job-secret-0123456"}
    store = tmp_path / "store"
    bundle = f"file://{tmp_path / 'bundles'}"
    # Static inputs tagged as on a GPU: the recompile's backward graphs, compiled eagerly,
    # tag forward outputs that the next bucket's keys then read.
    options = {**OPTIONS, "model": "split_mlp", "store": f"file://{store}", "tag_static_inputs": True}
    cold = job(1, {**options, "bundle": f"save:{bundle}"}, env=secret, name="cold")
    require_success(cold)
    cold = cold[0]
    graphs = split(cold)["saved"]
    frames = cold.report["split_graphs"]["frames"]
    assert len(frames) == 2 and all(len(frame["hits"]) >= 3 for frame in frames), frames  # split, and recompiled
    assert graphs == sum(len(frame["hits"]) for frame in frames), split(cold)
    assert split(cold)["bypassed"] == 0 and cold.report["stats"]["graphs_skipped_aot_autograd"] == 0

    def restart(name, env=secret, **changes):
        results = job(1, {**options, **changes}, env=env, name=name)
        require_success(results)
        return results[0]

    # From the store, with an empty cache dir: every split graph, the recompile's
    # (dynamic batch) included, skips AOTAutograd, and trains exactly as the cold run.
    plain = restart("restart")
    assert split(plain) == {"saved": 0, "served": graphs, "bypassed": 0, "refused": 0}
    assert plain.report["stats"]["graphs_skipped_aot_autograd"] == graphs
    assert all(all(frame["hits"]) and frame["reads"] == [] for frame in plain.report["split_graphs"]["frames"])
    assert_same_training(cold, plain)

    # From a bundle the cold job saved, with no entry in the store: the same.
    restored = restart("bundle", store=None, bundle=f"load:{bundle}")
    assert split(restored)["served"] == graphs, split(restored)
    assert_same_training(cold, restored)

    # A frame that mixes hits and a miss: the store lacks the entry of a middle bucket of
    # the first frame (entries were saved as each backward compiled: the last bucket
    # first). Its lazily compiled backward must read its own bucket's forward metadata,
    # not the last bucket's, which it would read if the hits left their slots unused.
    mixed_store = tmp_path / "mixed-store"
    shutil.copytree(store, mixed_store)
    aot_values(mixed_store)[1].unlink()
    mixed = restart("mixed", store=f"file://{mixed_store}")
    frame = mixed.report["split_graphs"]["frames"][0]
    missed = [i for i, hit in enumerate(frame["hits"]) if not hit]
    assert len(missed) == 1 and 0 <= missed[0] < len(frame["hits"]) - 1, frame
    assert frame["reads"] == missed, frame
    assert split(mixed) == {"saved": 1, "served": graphs - 1, "bypassed": 0, "refused": 0}
    assert_same_training(cold, mixed)

    # Corrupt values: misses, never loaded, and the right training. (A wrong secret takes
    # the same path, ``open_sealed``, for every kind: tests/test_integrity.py.)
    corrupt_store = tmp_path / "corrupt-store"
    shutil.copytree(store, corrupt_store)
    for path in aot_values(corrupt_store):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    corrupt = restart("corrupt", store=f"file://{corrupt_store}")
    assert split(corrupt)["served"] == 0 and split(corrupt)["saved"] == graphs, split(corrupt)
    assert corrupt.report["stats"]["rejected"] >= graphs and "rejected aot_autograd entry" in corrupt.log
    assert corrupt.report["losses"] == cold.report["losses"]

    # Switched off: the split graphs bypass AOTAutograd's cache, as torch's own does.
    off = restart("off", env={**secret, "COORDINATOR_CACHE_DDP_GRAPHS": "0"})
    assert split(off) == {"saved": 0, "served": 0, "bypassed": 0, "refused": 0}
    assert off.report["stats"]["graphs_skipped_aot_autograd"] == 0
    assert off.report["losses"] == cold.report["losses"]


def test_a_recorded_stride_that_differs_from_the_fx_entry_is_a_miss(job, tmp_path):
    # A restart on the cold run's own cache dir, whose AOTAutograd entries have one
    # recorded Inductor stride changed: the product's own check turns that entry into a
    # miss (AOTAutograd runs, the entry is saved again), never a wrong fake output. The
    # model: conv + BatchNorm, where Inductor may give outputs channels-last strides that
    # eager would not, and the next bucket must be compiled for those.
    env = {"TORCHINDUCTOR_KEEP_OUTPUT_STRIDE": "0"}
    cache = tmp_path / "cache"
    options = {**OPTIONS, "model": "conv"}
    cold = job(1, options, env=env, name="cold", cache_dirs={0: cache})
    require_success(cold)
    inputs = [arg for call in cold[0].report["split_graphs"]["submod_inputs"] for arg in call if isinstance(arg, list)]
    assert any(len(arg[0]) == 4 and arg[1][1] == "1" for arg in inputs), inputs  # channels-last inputs
    changed = 0
    for path in (cache / "aotautograd").rglob("*"):
        entry = pickle.loads(path.read_bytes()) if path.is_file() else None
        record = getattr(entry, "_coordinator_fake_outputs", None)
        strides = record and next((s for s in record["strides"] if s), None)
        if strides and not changed:
            strides[-1] = str(int(strides[-1]) + 1)
            path.write_bytes(pickle.dumps(entry))
            changed += 1
    assert changed == 1
    restart = job(1, options, env=env, name="restart", cache_dirs={0: cache})
    require_success(restart)
    assert split(restart[0]) == {"saved": 1, "served": split(cold[0])["saved"] - 1, "bypassed": 0, "refused": 1}
    assert "output strides" in restart[0].log
    assert_same_training(cold[0], restart[0])


def strip_descriptions(cache: Path) -> int:
    """Drop the description of fake outputs from every AOTAutograd entry in ``cache``."""
    stripped = 0
    for path in (cache / "aotautograd").rglob("*"):
        entry = pickle.loads(path.read_bytes()) if path.is_file() else None
        if entry is not None and hasattr(entry, "_coordinator_fake_outputs"):
            del entry._coordinator_fake_outputs
            path.write_bytes(pickle.dumps(entry))
            stripped += 1
    return stripped


def test_outputs_that_view_a_larger_buffer_are_served_and_a_refused_restart_trains_right(job, tmp_path):
    # Attention over a fused q/k/v projection: in each layer one of q, k, v reaches the
    # attention unchanged, a strided slice of the fused buffer (at offset 0, then at an
    # offset), which the forward saves for the backward: an output over a larger storage
    # than it spans, with no other output holding that storage. Static shapes, then the
    # recompile's symbolic batch.
    cache = tmp_path / "cache"
    options = {**OPTIONS, "model": "fused_qkv", "store": f"file://{tmp_path / 'store'}"}
    cold = job(1, options, name="cold", cache_dirs={0: cache})
    require_success(cold)
    cold = cold[0]
    graphs = split(cold)["saved"]
    frames = cold.report["split_graphs"]["frames"]
    assert len(frames) == 2 and graphs == sum(len(frame["hits"]) for frame in frames) >= 6, (frames, split(cold))
    assert split(cold)["bypassed"] == 0, cold.log[-3000:]

    # From the store, with an empty cache dir: every one served, and what each next bucket
    # was compiled for equals what torch's own path handed it (sizes, strides, offsets,
    # storage sizes, attributes).
    restart = job(1, options, name="restart")
    require_success(restart)
    assert split(restart[0]) == {"saved": 0, "served": graphs, "bypassed": 0, "refused": 0}
    assert_same_training(cold, restart[0])

    # Every split graph refused (the cold run's own cache dir, its descriptions dropped):
    # each is compiled by AOTAutograd again, described and saved again, and trains right.
    assert strip_descriptions(cache) == graphs
    refused = job(1, {**options, "store": None}, name="refused", cache_dirs={0: cache})
    require_success(refused)
    assert split(refused[0]) == {"saved": graphs, "served": 0, "bypassed": 0, "refused": graphs}
    assert_same_training(cold, refused[0])


def test_the_switch_reads_its_environment_variable():
    assert Config.resolve(environ={}).cache_ddp_graphs is True
    assert Config.resolve(environ={"COORDINATOR_CACHE_DDP_GRAPHS": "0"}).cache_ddp_graphs is False
    assert Config.resolve(environ={"COORDINATOR_CACHE_DDP_GRAPHS": "0"}, cache_ddp_graphs=True).cache_ddp_graphs


# -- the description itself, against torch's own fake tensors -----------------------------


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv())


def test_outputs_with_views_aliases_inputs_and_symbolic_sizes_rebuild_exactly():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    from coordinator._compat.fake_outputs import describe_outputs, rebuild_outputs, same_outputs

    mode = fake_mode()
    shape_env = mode.shape_env
    s0 = shape_env.create_symintnode(
        shape_env.create_symbol(6, ConstantSource("s_batch"), dynamic_dim=DimDynamic.DYNAMIC), hint=6)
    with mode:
        weight = torch.empty(8, 4)
        x = torch.empty(s0, 8)
        fresh = torch.empty(s0, 4)
        channels_last = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
        outputs = [fresh, weight.t(), x, fresh[1:], torch.ops.aten._unsafe_view(fresh, [s0 * 4]), s0, 3, None, fresh,
                   channels_last]
    x._is_inductor_static = True  # as Inductor tags a GPU graph's static inputs; its cache keys read it
    record = describe_outputs(outputs, [weight, x])
    rebuilt = rebuild_outputs(record, mode)
    assert same_outputs(rebuilt, outputs) is None
    assert rebuilt[8] is rebuilt[0] and rebuilt[1]._base is not None and rebuilt[4]._base is None
    assert rebuilt[2]._is_inductor_static is True and not hasattr(rebuilt[0], "_is_inductor_static")
    # A wrong rebuild is caught by the same comparison.
    assert same_outputs(rebuilt[:1] + rebuilt[2:3] + rebuilt[2:], outputs) is not None


def test_a_storage_size_printed_otherwise_but_provably_equal_is_the_same_and_any_other_is_not():
    """Inductor sized a recompile's buffer ``2048*s + 6144*Max(1, s - 1) - 2048`` (the fused
    q/k/v model of ``benchmarks/model_suite_job.py`` at 3 ranks), which a rebuild over
    ``empty_strided`` prints ``8192*s - 8192``: equal for every ``s`` the shape environment
    allows (at least 2), so the same tensor; a larger storage is not."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic
    from torch.utils._sympy.functions import Max

    from coordinator._compat.fake_outputs import describe_outputs, rebuild_outputs, same_outputs

    mode = fake_mode()
    shape_env = mode.shape_env
    symbol = shape_env.create_symbol(6, ConstantSource("s_seq"), dynamic_dim=DimDynamic.DYNAMIC)
    seq = shape_env.create_symintnode(symbol, hint=6)

    def over(nbytes_expr):
        nbytes = shape_env.create_symintnode(nbytes_expr, hint=int(nbytes_expr.subs(symbol, 6)))
        with mode:
            storage = torch.empty((nbytes,), dtype=torch.uint8).untyped_storage()
            return torch.empty((0,)).set_(storage, 0, [4 * seq - 4, 512], [512, 1])

    inductors = over(2048 * (symbol - 1) + 6144 * Max(1, symbol - 1))
    rebuilt = rebuild_outputs(describe_outputs([inductors], []), mode)
    assert str(rebuilt[0].untyped_storage().nbytes()) != str(inductors.untyped_storage().nbytes())
    assert same_outputs(rebuilt, [inductors]) is None
    # A storage one row larger, whatever s is: not the same.
    larger = over(2048 * (symbol - 1) + 6144 * Max(1, symbol - 1) + 2048)
    assert same_outputs(rebuilt, [larger]) is not None


def forward_graph_outputs(module: torch.nn.Module, x: torch.Tensor, dynamic: bool) -> tuple[list, list]:
    """The fake outputs and inputs of the forward graph AOTAutograd builds for ``module``
    (what ``FakifiedOutWrapper`` returns for a split graph): torch's own, to compare with."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.compile_fx import min_cut_rematerialization_partition

    captured = {}

    def forward_compiler(gm, example_inputs):
        captured["outputs"] = [node.meta.get("val") for node in gm.graph.find_nodes(op="output")[0].args[0]]
        captured["inputs"] = [node.meta["val"] for node in gm.graph.find_nodes(op="placeholder")
                              if isinstance(node.meta.get("val"), torch.Tensor)]
        return gm

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=forward_compiler, bw_compiler=lambda g, _: g,
                                     partition_fn=min_cut_rematerialization_partition)

    torch._dynamo.reset()
    torch.compile(module, backend=backend, dynamic=dynamic)(x).sum().backward()
    return captured["outputs"], captured["inputs"]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
def test_outputs_over_a_larger_storage_rebuild_as_torch_made_them(dynamic):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from worker import FusedQKVAttention

    from coordinator._compat.fake_outputs import _layout, _printer, describe_outputs, rebuild_outputs, same_outputs

    torch.manual_seed(0)
    outputs, inputs = {}, {}
    for keep in "qv":  # the slice kept at offset 0, and at an offset
        outputs[keep], inputs[keep] = forward_graph_outputs(FusedQKVAttention(64, 4, keep), torch.randn(2, 6, 64),
                                                            dynamic)
    for keep in "qv":
        # Among torch's own outputs: a tensor, not a view, over a storage larger than it spans.
        wide = [out for out in outputs[keep] if isinstance(out, torch.Tensor) and out._base is None
                and out.untyped_storage().nbytes() > out.numel() * out.element_size()]
        assert wide, [(tuple(o.shape), o.stride()) for o in outputs[keep] if isinstance(o, torch.Tensor)]
        assert any(out.storage_offset() != 0 for out in wide) == (keep == "v")
        mode = next(o for o in outputs[keep] if isinstance(o, torch.Tensor)).fake_mode
        rebuilt = rebuild_outputs(describe_outputs(outputs[keep], inputs[keep]), mode)
        assert same_outputs(rebuilt, outputs[keep]) is None
        printer = _printer()
        for new, old in zip(rebuilt, outputs[keep], strict=True):
            if isinstance(old, torch.Tensor):  # sizes, strides, offsets and storage sizes, as torch made them
                assert _layout(new, printer) == _layout(old, printer)
        if dynamic:
            assert any(not str(_layout(out, printer)["nbytes"]).isdigit() for out in wide)


def test_unbacked_sizes_and_subclasses_are_left_to_the_bypass():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: F401

    from coordinator._compat.fake_outputs import Undescribable, describe_outputs

    mode = fake_mode()
    unbacked = mode.shape_env.create_unbacked_symint()
    with mode:
        data_dependent = torch.empty(unbacked, 4)
    with pytest.raises(Undescribable, match="unbacked"):
        describe_outputs([data_dependent], [])
    with pytest.raises(Undescribable):
        describe_outputs([torch.nn.Parameter(torch.empty(2))], [])
    with mode:
        constant = torch.empty(2)
    constant.constant = torch.ones(2)  # a real tensor behind a fake: no description carries it
    with pytest.raises(Undescribable, match="not plain data"):
        describe_outputs([constant], [])
