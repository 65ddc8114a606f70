"""Each rank compiles a share of every frame DDPOptimizer splits (``coordinator.features.split_shares``).

Real jobs: one process per rank, gloo, DDP with 1 MB buckets (DDPOptimizer splits the
model's graph at each), a ``file://`` store. Two steps: batch 8, then batch 12 (a
recompile, with a dynamic batch dimension: a second split frame).
"""

from __future__ import annotations

import uuid

import pytest
import torch
from conftest import require_success

from coordinator import Config
from coordinator.features.split_shares import deal, work_order

OPTIONS = {"ddp": True, "bucket_cap_mb": 1, "shapes": [8, 12], "record_split": True}


def split(result) -> dict:
    return result.report["stats"]["ddp_split_graphs"]


def shares(result) -> dict:
    return result.report["stats"]["split_shares"]


def split_graphs(result) -> int:
    return sum(len(frame["hits"]) for frame in result.report["split_graphs"]["frames"])


@pytest.mark.one_torch  # the next test passes through the same hooks, with two frames
def test_the_ranks_compile_a_share_each_and_train_as_stock_does(job, tmp_path):
    # Static inputs tagged as on a GPU (Inductor's keys then read their storage offsets
    # and sizes, and a backward compiled at once tags forward outputs the next bucket reads).
    options = {**OPTIONS, "model": "fused_qkv", "tag_static_inputs": True}
    # Stock on one rank: every rank gets the same batches, so DDP's average of two equal
    # gradients is that gradient, bit for bit.
    stock = job(1, {**options, "coordinator": False}, name="stock")
    require_success(stock)
    store = f"file://{tmp_path / 'store'}"
    ours = job(2, {**options, "store": store}, name="ours")
    require_success(ours)

    graphs = split_graphs(ours[0])
    frames = ours[0].report["split_graphs"]["frames"]
    assert len(frames) == 2 and graphs >= 8, frames  # split, and the recompile's frame split too
    # Each split graph (both frames) went through AOTAutograd and Inductor once in the
    # job: the rank whose share it was saved its entry; every rank's chain loaded it.
    assert sum(split(r)["saved"] for r in ours) == graphs, [split(r) for r in ours]
    assert sum(shares(r)["compiled"] for r in ours) == graphs, [shares(r) for r in ours]
    assert all(split(r)["served"] == graphs and shares(r)["missed"] == 0 for r in ours), [split(r) for r in ours]
    assert all(shares(r)["compiled"] >= 1 for r in ours), [shares(r) for r in ours]  # both ranks took a share
    assert sum(r.fx_misses for r in ours) == 2 * graphs  # a forward and a backward each, compiled once
    assert all(r.report["stats"]["graphs_skipped_aot_autograd"] == graphs for r in ours)
    for mine in ours:
        theirs = stock[0]
        assert mine.report["split_graphs"]["submod_inputs"] == theirs.report["split_graphs"]["submod_inputs"]
        assert mine.report["losses"] == theirs.report["losses"]
        assert mine.report["grad_norms"] == theirs.report["grad_norms"]

    # A restart from the store, with an empty cache dir: every split graph served, and no
    # share compiles anything (their submodules are marked done in the store).
    restart = job(2, {**options, "store": store}, name="restart")
    require_success(restart)
    for r, cold in zip(restart, ours, strict=True):
        assert split(r) == {"saved": 0, "served": graphs, "bypassed": 0, "refused": 0}, split(r)
        assert shares(r)["compiled"] == 0 and r.fx_misses == 0, shares(r)
        assert r.report["losses"] == stock[0].report["losses"]
        # The cold job's shares left no guard behind: its frames' shape environments ended
        # as the restart's, whose chain loaded the same entries with no share before it.
        assert r.report["split_graphs"]["shape_envs"] == cold.report["split_graphs"]["shape_envs"]


def test_a_recompile_shares_every_graph_of_a_model_with_rotary_like_tables(job, tmp_path):
    # What HF Llama (transformers 5.17) on a GPU shows the frames: the first bucket makes a
    # table from the recompile's symbolic size by a product under no_grad (on torch 2.11,
    # C++'s matmul run outside the Python dispatcher makes it static), and every later bucket
    # reads it; a backward compiled at once tags the forward outputs DDPOptimizer hands on
    # (Inductor on a GPU, emulated here). Every share of both frames is still the chain's.
    options = {**OPTIONS, "model": "positions", "tag_static_inputs": True}
    stock = job(1, {**options, "coordinator": False}, name="stock")
    require_success(stock)
    trace = tmp_path / "trace"
    ours = job(2, {**options, "store": f"file://{tmp_path / 'store'}"}, name="ours",
               env={"COORDINATOR_TRACE": str(trace)})
    require_success(ours)
    graphs = split_graphs(ours[0])
    frames = ours[0].report["split_graphs"]["frames"]
    assert len(frames) == 2 and graphs >= 8, frames
    assert sum(shares(r)["compiled"] for r in ours) == graphs, [shares(r) for r in ours]
    assert all(split(r)["served"] == graphs and shares(r)["missed"] == 0 for r in ours), \
        [(split(r), shares(r)) for r in ours]
    assert sum(r.fx_misses for r in ours) == 2 * graphs
    for mine in ours:
        assert mine.report["split_graphs"]["submod_inputs"] == stock[0].report["split_graphs"]["submod_inputs"]
        assert mine.report["losses"] == stock[0].report["losses"]
    # Per frame, in each rank's counts and in the job's report: every submodule compiled
    # once for the job, and served to every rank's chain.
    sizes = [len(frame["hits"]) for frame in frames]
    for r in ours:
        assert [(f["graphs"], f["served"], f["missed"]) for f in shares(r)["frames"]] == [(n, n, 0) for n in sizes]
    assert [sum(r_frames) for r_frames in zip(*([f["compiled"] for f in shares(r)["frames"]] for r in ours),
                                                strict=True)] == sizes
    # The first split was dealt by operator counts; the recompile's, by the seconds each
    # submodule's compile took in it, alike on every rank: each submodule dealt once.
    assert all([f["costs_from"] for f in shares(r)["frames"]] == ["operators", "seconds of frame #0"]
               for r in ours), [shares(r)["frames"] for r in ours]
    assert sum(shares(r)["frames"][1]["dealt"] for r in ours) == sizes[1]
    from coordinator.observe.report import write_report

    report = write_report(trace, picture=False)
    assert [(f.frame, f.graphs, f.compiled, f.served, f.missed) for f in report.frames] == \
        [(n, size, size, 2 * size, 0) for n, size in enumerate(sizes)], report.frame_table()
    # The price of each frame: every rank spent seconds on its share and on its chain,
    # and the report sums what the ranks counted.
    for n, row in enumerate(report.frames):
        counted = [shares(r)["frames"][n] for r in ours]
        assert all(f["compile_id"] and f["share_s"] > 0 and f["chain_s"] > 0 for f in counted), counted
        assert row.shares_s == pytest.approx(sum(f["share_s"] for f in counted), abs=0.01)
        assert row.chains_s == pytest.approx(sum(f["chain_s"] for f in counted), abs=0.01)
    # Each rank's part of each frame, as the rank counted it: the deal, its compiles, its waits.
    assert [(row.frame, row.rank) for row in report.shares] == [(n, rank) for n in range(len(sizes)) for rank in (0, 1)]
    for row in report.shares:
        counted = shares(ours[row.rank])["frames"][row.frame]
        assert (row.dealt, row.compiled, row.taken) == (counted["dealt"], counted["compiled"], counted["taken"])
        assert row.waited_s == pytest.approx(counted["waited_s"], abs=0.01)
    assert sum(row.dealt for row in report.shares) == sum(sizes), report.frame_table()
    assert "split frames per rank" in report.frame_table()
    from coordinator.observe.report import FRAME_LEGEND

    headers = [line.split(":", 1)[1].split() for line in report.frame_table().splitlines() if ":" in line]
    assert len(headers) == 2 and all(column in FRAME_LEGEND for columns in headers for column in columns), headers


def test_an_input_the_propagation_gets_wrong_is_a_miss_compiled_in_the_chain(job, tmp_path):
    # Without keep_output_stride, Inductor gives the convolutions' outputs channels-last
    # strides that eager would not: the inputs propagated to the next buckets differ from
    # the chain's, so the chain's keys differ from the shares'. Those are misses that the
    # chain compiles, with the right result.
    env = {"TORCHINDUCTOR_KEEP_OUTPUT_STRIDE": "0"}
    results = job(2, {**OPTIONS, "model": "conv", "store": f"file://{tmp_path / 'store'}"}, env=env)
    require_success(results)
    for r in results:
        assert shares(r)["missed"] >= 1, shares(r)
        assert split(r)["served"] + shares(r)["missed"] == split_graphs(r), (split(r), shares(r))
        torch.testing.assert_close(r.report["losses"], r.report["ref_losses"], rtol=1e-4, atol=1e-5)
    assert results[0].report["losses"] == results[1].report["losses"]


@pytest.mark.protocol
def test_a_rank_killed_while_compiling_its_share_is_taken_over(job, tcp_store):
    # Each rank trains its own DDP model (a process group of its own), so the job goes on
    # when one dies; the coordinator sees the three ranks of the job (RANK, WORLD_SIZE,
    # torchrun's run id). The first rank to compile anything, inside its share, dies: its
    # slots' lease lapses, and the others' chains compile those submodules.
    env = {"COORDINATOR_LEASE_S": "2", "TORCHELASTIC_RUN_ID": uuid.uuid4().hex}
    results = job(3, {**OPTIONS, "model": "split_mlp", "private_pg": True,
                      "external_store": f"127.0.0.1:{tcp_store.port}", "first_compiler": "die"}, env=env)
    died = [r for r in results if r.returncode == 17]
    survivors = [r for r in results if r.returncode != 17]
    assert len(died) == 1, [(r.rank, r.returncode, r.log[-2000:]) for r in results]
    require_success(survivors)
    assert any("owner stopped" in r.log for r in survivors), [r.log[-3000:] for r in survivors]
    for r in survivors:
        assert split(r)["served"] + shares(r)["missed"] == split_graphs(r), (split(r), shares(r))
        torch.testing.assert_close(r.report["losses"], r.report["ref_losses"], rtol=1e-4, atol=1e-5)


def test_a_shape_environment_put_back_equals_the_one_saved():
    # What an out-of-order compile adds to the frame's shape environment (guards,
    # replacements, divisibility, value ranges, cached results) is taken back: torch's own
    # comparison of shape environments finds it equal to a copy made before.
    import copy

    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from coordinator._compat.split_frames import ShapeEnvState

    env = ShapeEnv()
    a, b = (env.create_symintnode(env.create_symbol(hint, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC),
                                  hint=hint) for name, hint in (("a", 8), ("b", 6)))
    assert a > 2
    before = copy.deepcopy(env)
    evaluate = ShapeEnv._inner_evaluate_expr
    cached = evaluate.cache_info().currsize  # the answer to a > 2, which added its guard
    state = ShapeEnvState(env)
    assert a % 4 == 0 and b == 6 and a * b > 10 and a < 100
    assert env.replacements and env.divisible and len(env.guards) > len(before.guards)
    assert ShapeEnv._inner_evaluate_expr is not evaluate  # answered from a cache of its own
    state.restore()
    env.check_equal(before)
    # The answers cached before the save are cached still; none from in between.
    assert ShapeEnv._inner_evaluate_expr is evaluate and evaluate.cache_info().currsize == cached >= 1
    assert not env.replacements and not env.divisible and len(env.guards) == 1
    assert a % 4 == 0  # asked again: a guard again, not an answer cached from before
    assert len(env.guards) == 2 and env.divisible


def test_a_size_read_during_a_put_back_compile_is_read_again_after():
    # A symbolic size keeps its expression under the replacements of the moment it was
    # read, keyed on the shape environment's replacement counter. After the put-back the
    # counter must not take again a value it had during the compile: the size would give
    # the compile's replacement (b for a) although the environment no longer has it.
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from coordinator._compat.split_frames import ShapeEnvState

    env = ShapeEnv()
    a, b, c = (env.create_symintnode(env.create_symbol(hint, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC),
                                     hint=hint) for name, hint in (("a", 8), ("b", 8), ("c", 5)))
    symbol = a.node.expr
    state = ShapeEnvState(env)
    assert a == b  # the compile learns a = b
    assert a.node.expr != symbol  # and the size reads as b
    state.restore()
    assert c == 5  # the chain learns something else: a replacement of its own
    assert a.node.expr == symbol, a.node.expr


def test_the_deal_is_the_same_on_every_rank_and_balances_the_cost():
    costs = [40, 10, 10, 25, 5, 30, 12]
    owners = deal(costs, 3)
    assert owners == deal(list(costs), 3)  # the same inputs, the same deal
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == rank) for rank in range(3)]
    assert max(loads) - min(loads) <= max(costs), loads
    assert sorted(set(owners)) == [0, 1, 2]
    assert deal(costs, 1) == [0] * len(costs)
    assert deal([], 4) == []
    # Submodules of one kind (identical layers) go to one rank, whose first of them compiles
    # the graphs the others find in its cache; the kinds' groups are balanced over the ranks.
    costs, kinds = [11, 40, 35, 17, 40, 35, 18, 1], ["embed", "a", "b", "c", "a", "b", "d", "head"]
    owners = deal(costs, 2, kinds)
    assert owners[1] == owners[4] and owners[2] == owners[5] and owners[1] != owners[2], owners
    assert owners == deal(costs, 2, list(kinds))
    assert deal(costs, 2, [str(i) for i in range(len(costs))]) == deal(costs, 2)


def test_a_rank_done_with_its_share_takes_the_groups_others_reach_last_first():
    owners = [1, 0, 2, 3, 3, 2, 1]
    assert work_order(owners, 0) == [[1], [6], [5], [4], [0], [2], [3]]
    assert work_order(owners, 3) == [[3], [4], [1], [6], [5], [0], [2]]
    # Every submodule exactly once in every rank's order; a kind's group stays together.
    for rank in range(4):
        assert sorted(i for group in work_order(owners, rank) for i in group) == list(range(7))
    assert work_order([0, 0, 1, 1], 1, ["a", "a", "b", "c"]) == [[2], [3], [0, 1]]
    assert work_order([0, 0], 0) == [[0], [1]] and work_order([], 2) == []


@pytest.mark.one_torch  # the split frames' hooks run in the tests above on every torch
def test_a_rank_whose_share_goes_slowly_has_its_unstarted_work_taken(job, tmp_path):
    # Rank 1's compiles each take 4 s longer (a pass that sleeps 4 s there, none on rank 0:
    # the same pass on both, so the same keys): rank 0, done with its own groups, compiles
    # rank 1's unstarted ones instead of waiting for them.
    ours = job(2, {**OPTIONS, "model": "fused_qkv", "shapes": [8], "store": f"file://{tmp_path / 'store'}"},
               rank_options={0: {"slow_compiles": 0.0}, 1: {"slow_compiles": 4.0}})
    require_success(ours)
    graphs = split_graphs(ours[0])
    assert graphs >= 4
    fast, slow = (shares(r)["frames"][0] for r in ours)
    assert fast["taken"] >= 1 and slow["taken"] == 0, (fast, slow)
    assert fast["compiled"] > fast["dealt"] and slow["compiled"] < slow["dealt"], (fast, slow)
    assert shares(ours[1])["lost"] == fast["taken"] and shares(ours[0])["lost"] == 0, [shares(r) for r in ours]
    # Still once per job: every split graph compiled by one rank and served to both chains.
    assert fast["compiled"] + slow["compiled"] == graphs, (fast, slow)
    assert all(split(r)["served"] == graphs and shares(r)["missed"] == 0 for r in ours), [split(r) for r in ours]


@pytest.mark.one_torch  # the deal's peers; the split frames' hooks run in the tests above on every torch
def test_ranks_on_other_device_indices_are_dealt_no_share(job, tmp_path):
    # Plain torchrun on a GPU host: rank 1 compiles for cuda:1, under keys rank 0 never
    # uses. Each rank then walks its chain alone: no share, no wait on the other's slots.
    rank_options = {rank: {"device_index": rank} for rank in range(2)}
    ours = job(2, {**OPTIONS, "model": "fused_qkv", "store": f"file://{tmp_path / 'store'}"},
               rank_options=rank_options)
    require_success(ours)
    graphs = split_graphs(ours[0])
    assert graphs >= 4
    for r in ours:
        counts = shares(r)
        assert counts["compiled"] == 0 and counts["skipped"] == 0 and counts["waited"] == 0, counts
        # Each graph went through this rank's chain: compiled there, or (on CPU the two
        # indices are one key space) found already published by the other rank's chain.
        assert all(f["served"] + f["missed"] == f["graphs"] and f["share_s"] == 0 and f["compiled"] == 0
                   for f in counts["frames"]), counts["frames"]
        assert sum(f["graphs"] for f in counts["frames"]) == graphs


_PEER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from coordinator.protocol import devices
from coordinator.protocol.stores.c10d import C10dStore
port, rank, index, delay = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
devices.current_index = lambda: index
store = C10dStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)))
time.sleep(delay)
indices = devices.DeviceIndices(store, "p", "job", rank)
indices.publish()
print(indices.peers(5, wait_s=4.0))
"""


@pytest.mark.protocol
def test_each_rank_deals_among_the_ranks_on_its_device_index(tcp_store):
    # Five ranks: 0 and 2 on cuda:0, 1 and 3 on cuda:1 (rank 2 writes its index a second
    # late), rank 4 never writes one and counts as everyone's peer once the wait ends.
    import subprocess
    import sys

    ranks = {0: ("0", 0.0), 1: ("1", 0.0), 2: ("0", 1.0), 3: ("1", 0.0)}
    procs = {rank: subprocess.Popen([sys.executable, "-c", _PEER, str(tcp_store.port), str(rank), index, str(delay)],
                                    stdout=subprocess.PIPE, text=True) for rank, (index, delay) in ranks.items()}
    peers = {rank: proc.communicate(timeout=120)[0].strip() for rank, proc in procs.items()}
    assert peers == {0: "[0, 2, 4]", 1: "[1, 3, 4]", 2: "[0, 2, 4]", 3: "[1, 3, 4]"}, peers


def test_the_switch_reads_its_environment_variable():
    assert Config.resolve(environ={}).concurrent_splits is True
    assert Config.resolve(environ={"COORDINATOR_CONCURRENT_SPLITS": "0"}).concurrent_splits is False
    assert Config.resolve(environ={"COORDINATOR_CONCURRENT_SPLITS": "0"}, concurrent_splits=True).concurrent_splits
