"""One rank of a test job: compile a tiny model under ``compile_once`` and report.

Run as ``python tests/worker.py '<json options>'`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set (the tests spawn one process per rank, as torchrun
does). Writes a JSON report to ``options["out"]``: losses, Inductor's FX cache
counters, how many C++ compiler runs this process made, and ``coordinator.stats()``.

Options:
    store: store spec for compile_once (None = the job's TCPStore)
    model: "mlp" | "rank_dependent" | "collective" | "repeated" (3 identical layers: with
        ``bucket_cap_mb`` 1, DDP's buckets hold one layer each and Dynamo splits the
        graph at them, so some layers' FX graphs repeat, as a transformer's do) |
        "broken" (3 layers of different widths with a graph break after each: three
        forward and three backward graphs, no DDP needed)
    ddp: wrap in DistributedDataParallel
    bucket_cap_mb: DDP's bucket size (default 25)
    steps: training steps
    first_compiler: "die" | "slow:<seconds>" — what the first process to compile the
        first graph does (decided through a marker file, so exactly one does it);
        "die_early" — the first process to compile a backward graph early
        (``coordinator.early_backward``) dies in it; "die_at:<n>" — the process that
        runs the job's n-th compile (early backward compiles not counted) dies in it;
        "kill_at:<n>:<pid>" — that process kills process ``pid`` (a store server) and
        goes on
    slow_compiles: seconds every graph this process compiles takes longer (a pass that
        sleeps), so that ranks wait for one another's graphs as on a GPU
    external_store: "host:port" of a TCPStore hosted by the test, used as the store
    no_pg: do not initialize a process group (fault tests, where a rank dies)
    coordinator: run under compile_once (default true)
    bundle: "broadcast" (rank 0 runs its steps, then broadcasts its bundle, then the
        others run theirs), "save:<url>" (save this rank's bundle after the steps) or
        "load:<url>" (load the bundle before compiling)
    pg_timeout_s: the process group's timeout (gloo's collectives time out after it)
    start_after: a path; run the steps only once it exists
    touch_after_steps: a path to create once the steps are done
"""

from __future__ import annotations

import contextlib
import faulthandler
import inspect
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch_counters import inductor_counters

import coordinator


def count_cpp_builds() -> dict[str, int]:
    """Count C++ compiler runs in this process (compile threads are set to 1).

    "kernel" builds produce a kernel library; "header" builds preprocess or precompile
    Inductor's C++ prefix header (once per node, when precompiled headers are on);
    "isa_probe" builds are Inductor's CPU feature checks (``cpu_vec_isa``: tiny sources
    defining a ``*_chk_kernel`` function, built once per cache dir). Which run depends on
    the CPU: AVX2 or AVX-512, and on CPUs with those extensions, AVX512-BF16, -VNNI and AMX.
    """
    from torch._inductor import cpp_builder

    calls = {"kernel": 0, "header": 0, "isa_probe": 0}
    original = cpp_builder.CppBuilder.build

    def kind_of(target: str) -> str:
        if target.endswith((".gch", "header.i")):
            return "header"
        try:
            with open(os.path.splitext(target)[0] + ".cpp") as f:
                if "_chk_kernel" in f.read():
                    return "isa_probe"
        except OSError:
            pass
        return "kernel"

    def build(self, *args, **kwargs):
        calls[kind_of(self.get_target_file_path())] += 1
        return original(self, *args, **kwargs)

    cpp_builder.CppBuilder.build = build
    return calls



class FirstCompilerPass(CustomGraphPass):
    """A post-grad pass that makes the first compiling process die or stall.

    Its uuid is constant, so it does not change the FX key; only a process that
    really compiles (a claimant) runs it.
    """

    def __init__(self, action: str, marker: str) -> None:
        self.action = action
        self.marker = marker

    def __call__(self, graph) -> None:
        early = any("early_backward" in frame.filename for frame in inspect.stack())
        if self.action == "die_early" and not early:
            return
        if self.action.startswith(("die_at:", "kill_at:")):
            if not early:
                self._at_nth_compile()
            return
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        if self.action in ("die", "die_early"):
            os._exit(17)
        if self.action.startswith("slow:"):
            time.sleep(float(self.action.split(":", 1)[1]))

    def _at_nth_compile(self) -> None:
        # This compile's number in the job: the first marker file it manages to create.
        number = 1
        while True:
            try:
                os.close(os.open(f"{self.marker}.{number}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                break
            except FileExistsError:
                number += 1
        _, at, *pid = self.action.split(":")
        if number != int(at):
            return
        if self.action.startswith("die_at:"):
            os._exit(17)
        os.kill(int(pid[0]), signal.SIGKILL)

    def uuid(self) -> str:
        return "coordinator-tests-first-compiler"


class Passes(CustomGraphPass):
    """Several post-grad passes, in order."""

    def __init__(self, passes: list[CustomGraphPass]) -> None:
        self.passes = passes

    def __call__(self, graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> str:
        return "+".join(graph_pass.uuid() for graph_pass in self.passes)


class SlowCompilesPass(CustomGraphPass):
    """A post-grad pass that sleeps in every graph this process compiles (constant uuid:
    the FX key does not change)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, graph) -> None:
        time.sleep(self.seconds)

    def uuid(self) -> str:
        return "coordinator-tests-slow-compiles"


class Broken(torch.nn.Module):
    """Three layers with a graph break after each: Dynamo compiles each as a frame of
    its own, and AOTAutograd defers each one's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16 + 8 * i) if i == 0 else
                                          torch.nn.Linear(16 + 8 * (i - 1), 16 + 8 * i) for i in range(3))

    def forward(self, x):
        # Unrolled: Dynamo cannot resume a frame after a break inside a loop.
        x = torch.nn.functional.gelu(self.layers[0](x))
        torch._dynamo.graph_break()
        x = torch.nn.functional.gelu(self.layers[1](x))
        torch._dynamo.graph_break()
        return torch.nn.functional.gelu(self.layers[2](x))


class RankBakingPass(CustomGraphPass):
    """A post-grad pass that adds this rank to a graph's first output, as Inductor's
    bucketing passes bake rank-dependent offsets into code: the rank is read after the
    FX key is computed (the uuid is constant), so every rank looks the graph up under
    the same key. A rank that loaded another rank's graph would add that rank."""

    def __call__(self, graph) -> None:
        rank = dist.get_rank()
        output = graph.find_nodes(op="output")[0]
        outputs = list(output.args[0])
        with graph.inserting_before(output):
            baked = graph.call_function(torch.ops.aten.add.Tensor, (outputs[0], rank))
        baked.meta = dict(outputs[0].meta)
        outputs[0] = baked
        output.args = (type(output.args[0])(outputs),)

    def uuid(self) -> str:
        return "coordinator-tests-rank-baking"


def make_model(kind: str, rank: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "repeated":
        layers = [module for _ in range(3) for module in (torch.nn.Linear(512, 512), torch.nn.GELU())]
        return torch.nn.Sequential(*layers)
    if kind == "broken":
        return Broken()
    width = 32 + (8 * rank if kind == "rank_dependent" else 0)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 4))


class WithAllReduce(torch.nn.Module):
    """A forward that contains a collective, compiled into the graph."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        y = self.inner(x)
        y = torch.ops._c10d_functional.all_reduce(y, "sum", "0")
        y = torch.ops._c10d_functional.wait_tensor(y)
        return y / dist.get_world_size()


def main() -> None:
    options = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, format=f"[rank{os.environ['RANK']}] %(name)s: %(message)s")
    rank = int(os.environ["RANK"])
    builds = count_cpp_builds()
    passes = []
    if options.get("first_compiler"):
        passes.append(FirstCompilerPass(options["first_compiler"], options["marker"]))
    if options.get("slow_compiles"):
        passes.append(SlowCompilesPass(float(options["slow_compiles"])))
    if options.get("rank_baking_pass"):
        passes.append(RankBakingPass())
    if passes:
        from torch._inductor import config as inductor_config

        inductor_config.post_grad_custom_post_pass = passes[0] if len(passes) == 1 else Passes(passes)

    use_pg = not options.get("no_pg")
    if use_pg:
        timeout = options.get("pg_timeout_s")
        dist.init_process_group("gloo", timeout=None if timeout is None else timedelta(seconds=timeout))
    store = options.get("store")
    if options.get("external_store"):
        host, port = options["external_store"].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False)

    kind = options.get("model", "mlp")
    model = make_model(kind, rank)
    reference = make_model(kind, rank)
    if kind == "collective":
        model, reference = WithAllReduce(model), WithAllReduce(reference)
    # Compile the module, then wrap it: on torch 2.13 Dynamo skips DDP's own forward.
    compiled = torch.compile(model)
    if options.get("ddp"):
        compiled = torch.nn.parallel.DistributedDataParallel(compiled, bucket_cap_mb=options.get("bucket_cap_mb", 25))

    torch.manual_seed(1)
    width = 512 if kind == "repeated" else 16
    batches = [torch.randn(8, width) for _ in range(options.get("steps", 2))]
    losses, ref_losses, step_times = [], [], []

    def run_steps():
        if options.get("start_after"):
            while not os.path.exists(options["start_after"]):
                time.sleep(0.05)
        for x in batches:
            start = time.perf_counter()
            loss = compiled(x).pow(2).mean()
            loss.backward()
            step_times.append(time.perf_counter() - start)
            losses.append(loss.item())
            expected = reference(x) + (rank if options.get("rank_baking_pass") else 0)
            ref_losses.append(expected.pow(2).mean().item())
        if options.get("touch_after_steps"):
            open(options["touch_after_steps"], "w").close()

    bundle = options.get("bundle", "")
    bundle_result = None
    if bundle.startswith("load:"):
        bundle_result = coordinator.load_bundle(bundle[len("load:"):])
    context = coordinator.compile_once(store) if options.get("coordinator", True) else contextlib.nullcontext()
    with context:
        if bundle == "broadcast":
            if rank == 0:
                run_steps()
            bundle_result = coordinator.broadcast_bundle(0)
            if rank != 0:
                run_steps()
        else:
            run_steps()
        if bundle.startswith("save:"):
            bundle_result = {"bytes": coordinator.save_bundle(bundle[len("save:"):])}
        result = {
            "rank": rank,
            "losses": losses,
            "ref_losses": ref_losses,
            "step_times": step_times,
            "cpp_builds": builds,
            "inductor": inductor_counters(),
            "bundle": bundle_result,
        }
    result["stats"] = coordinator.stats()
    with open(options["out"], "w") as f:
        json.dump(result, f)
    if use_pg:
        # Leave together: rank 0 hosts the TCPStore that teardown still talks to. A rank
        # still here after a minute writes its threads' stacks into its log.
        faulthandler.dump_traceback_later(60)
        dist.barrier()
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
