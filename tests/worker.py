"""One rank of a test job: compile a tiny model under ``compile_once`` and report.

Run as ``python tests/worker.py '<json options>'`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set (the tests spawn one process per rank, as torchrun
does). Writes a JSON report to ``options["out"]``: losses, Inductor's FX cache
counters, how many C++ compiler runs this process made, the seconds it spent in
torch.compile, and ``coordinator.stats()``.

Options:
    store: store spec for compile_once (None = the job's TCPStore)
    model: "mlp" | "blocks" (two Linear+GELU blocks, for ``fsdp_blocks``) | "rank_dependent" |
        "collective" | "repeated" (3 identical layers: with
        ``bucket_cap_mb`` 1, DDP's buckets hold one layer each and Dynamo splits the
        graph at them, so some layers' FX graphs repeat, as a transformer's do) |
        "broken" (3 layers of different widths with a graph break after each: three
        forward and three backward graphs, no DDP needed) | "split_mlp" (layers of
        different widths, 1 MB or more each: with ``bucket_cap_mb`` 1, DDPOptimizer splits
        the graph into several buckets whose outputs differ) | "conv" (convolutions with
        BatchNorm and a linear head, split the same way) | "fused_qkv" (attention layers
        whose q, k and v are parts of one fused projection, split the same way; in each
        layer one part reaches the attention unchanged, a strided slice of the fused
        buffer that the forward saves for the backward) | "positions" ("fused_qkv" with a
        table of the batch's positions, made by ``arange`` of the batch size before the first
        layer and added in each layer, as a rotary embedding's tables are: with a dynamic batch
        it is computed from the frame's symbolic size and crosses every bucket)
    shapes: the batch size of each step (default 8 for every step); a new size recompiles
        (with a dynamic batch dimension)
    tag_static_inputs: tag each graph's static inputs ``_is_inductor_static`` as Inductor
        does on a GPU before it looks the graph up (its cache keys then read their storage
        offset and size), so that CPU runs see what GPU runs see: a backward compiled
        eagerly (it saves symbolic sizes) tags forward outputs DDPOptimizer hands on
    record_split: report what DDPOptimizer handed each submodule's compile (the fake
        inputs' sizes, strides, offsets, dtypes, storage sizes, attributes) and, per frame, which
        buckets hit AOTAutograd's cache, which bucket each lazily compiled backward
        read its forward metadata from, and the shape environment's guards once the
        frame's chain is done
    ddp: wrap in DistributedDataParallel
    bucket_cap_mb: DDP's bucket size (default 25)
    steps: training steps
    first_compiler: "die" | "slow:<seconds>" — what the first process to compile the
        first graph does (decided through a marker file, so exactly one does it);
        "die_early" — the first process to compile a backward graph early
        (``coordinator.features.early_backward``) dies in it; "die_at:<n>" — the process that
        runs the job's n-th compile (early backward compiles not counted) dies in it;
        "kill_at:<n>:<pid>" — that process kills process ``pid`` (a store server) and
        goes on
    slow_compiles: seconds every graph this process compiles takes longer (a pass that
        sleeps), so that ranks wait for one another's graphs as on a GPU
    external_store: "host:port" of a TCPStore hosted by the test, used as the store
    no_pg: do not initialize a process group (fault tests, where a rank dies)
    private_pg: a process group of this rank alone (for DDP), while the coordinator sees the
        job's ranks from RANK and WORLD_SIZE (fault tests of DDP models, where a rank dies)
    coordinator: run under compile_once (default true)
    bundle: "broadcast" (rank 0 runs its steps, then broadcasts its bundle, then the
        others run theirs), "save:<url>" (save this rank's bundle after the steps) or
        "load:<url>" (load the bundle before compiling)
    pg_timeout_s: the process group's timeout (gloo's collectives time out after it)
    model_file: a Python file defining ``Model`` (no arguments), used as the model
        (imported by its file name, so an edited file is a changed model source)
    dtype: "float64" runs the model and its inputs in double precision
    fsdp_blocks: shard the model with FSDP2 and compile each of its blocks apart
        (``fully_shard`` and ``module.compile()`` per block, the torchtitan pattern)
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

import coordinator
from coordinator.testing import frames_traced, inductor_counters, process_compile_seconds


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


class LinearBlock(torch.nn.Module):
    """A block of the "blocks" model: a class of the script's own, as a transformer's
    layers are (Dynamo skips ``module.compile()`` of torch.nn's containers)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(x))


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


class FusedQKVAttention(torch.nn.Module):
    """Attention over one fused q/k/v projection, split into its three parts. All parts
    but ``keep`` are changed (as a rotary embedding changes q and k); ``keep`` stays a
    strided slice of the fused buffer, which the forward saves for the backward."""

    def __init__(self, width: int, heads: int, keep: str) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)
        self.heads, self.keep = heads, keep

    def forward(self, x):
        batch, seq, width = x.shape
        parts = self.qkv(x).split(width, dim=-1)
        parts = [part.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for part in parts]
        q, k, v = (part if name == self.keep else part * 0.5 + part.flip(-1) * 0.25
                   for name, part in zip("qkv", parts, strict=True))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(batch, seq, width))


class FusedQKV(torch.nn.Module):
    """Two ``FusedQKVAttention`` layers (q kept, then v kept) over a batch of 512-wide rows
    read as 4 positions of 128."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(128, 512)
        self.layers = torch.nn.Sequential(FusedQKVAttention(512, 8, "q"), FusedQKVAttention(512, 8, "v"))
        self.head = torch.nn.Linear(512, 16)

    def forward(self, x):
        return self.head(self.layers(self.embed(x.view(x.shape[0], 4, 128))))


class Positions(FusedQKV):
    """``FusedQKV`` with a table of the batch's positions that scales each layer's input,
    made as HF Llama's rotary tables are (transformers 5.17): under ``no_grad``, the product
    of a buffer and an ``arange`` of the frame's symbolic size by ``@``. Made in the first
    bucket, saved there for the backward (the scaling's gradient reads it), and handed to
    every later bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rates", torch.linspace(0.01, 0.04, 4))

    def forward(self, x):
        batch = x.shape[0]
        with torch.no_grad():
            positions = torch.arange(batch, dtype=x.dtype)
            table = (self.rates[None, :, None] @ positions[None, None, :]).transpose(1, 2)  # [1, batch, 4]
        scale = 1 + table.reshape(batch, 4, 1)
        h = self.embed(x.view(batch, 4, 128))
        for layer in self.layers:
            h = layer(h * scale)
        return self.head(h)


def make_model(kind: str, rank: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "fused_qkv":
        return FusedQKV()
    if kind == "positions":
        return Positions()
    if kind == "split_mlp":
        # A bucket ends in tanh, whose backward reads its output: the output DDPOptimizer
        # hands on is also one the backward takes.
        return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 1024),
                                   torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 256), torch.nn.Tanh(),
                                   torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 16))
    if kind == "conv":
        # Two convolutions in a row: the first one's output, which crosses into the next
        # bucket, keeps the channels-last layout Inductor gives convolutions on CPU.
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 192, 3, padding=1), torch.nn.BatchNorm2d(192), torch.nn.Conv2d(192, 192, 3, padding=1),
            torch.nn.Conv2d(192, 192, 3, padding=1), torch.nn.BatchNorm2d(192), torch.nn.ReLU(), torch.nn.Flatten(),
            torch.nn.Linear(192 * 8 * 8, 16))
    if kind == "repeated":
        layers = [module for _ in range(3) for module in (torch.nn.Linear(512, 512), torch.nn.GELU())]
        return torch.nn.Sequential(*layers)
    if kind == "broken":
        return Broken()
    if kind == "blocks":
        return torch.nn.Sequential(LinearBlock(), LinearBlock())
    if kind.endswith(".py"):
        import importlib

        sys.path.insert(0, os.path.dirname(kind))
        return importlib.import_module(os.path.basename(kind)[:-3]).Model()
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


def record_split_graphs() -> dict:
    """What DDPOptimizer hands each submodule's compile, and its bucket count per frame
    (option ``record_split``): filled in while the job runs."""
    from torch._dynamo.backends import distributed as ddp_optimizer
    from torch._dynamo.utils import counters

    record: dict = {"submod_inputs": [], "frames": [], "shape_envs": []}
    compile_submod = ddp_optimizer.SubmodCompiler.compile_submod

    def describe(a):
        if not isinstance(a, torch.Tensor):
            return repr(a)
        tags = sorted(f"{k}={v!r}" for k, v in vars(a).items()
                      if v is not None and k not in ("_fake_device", "fake_device", "fake_mode") and "_memo" not in k)
        return [list(map(str, a.shape)), list(map(str, a.stride())), str(a.storage_offset()), str(a.dtype),
                str(a.untyped_storage().nbytes()), a._base is not None, tags]

    def recording_compile_submod(self, mod, args, kwargs):
        record["submod_inputs"].append([describe(a) for a in args])
        return compile_submod(self, mod, args, kwargs)

    class Buckets(list):
        """DDPOptimizer's per-bucket forward metadata: which buckets hit AOTAutograd's
        cache as they were appended, and which indices lazy backward compiles read."""

        def __init__(self):
            super().__init__()
            self.hits_before = counters["aot_autograd"]["autograd_cache_hit"]
            self.frame = {"hits": [], "reads": []}
            record["frames"].append(self.frame)

        def append(self, metadata):
            hits = counters["aot_autograd"]["autograd_cache_hit"]
            self.frame["hits"].append(hits > self.hits_before)
            self.hits_before = hits
            super().append(metadata)

        def __getitem__(self, index):
            self.frame["reads"].append(index)
            return super().__getitem__(index)

    context_init = ddp_optimizer.DDPOptimizerContext.__init__

    def recording_init(self):
        context_init(self)
        self.metadata_per_bucket = Buckets()

    compile_fn = ddp_optimizer.DDPOptimizer.compile_fn

    def recording_compile_fn(self, gm, example_inputs, **kwargs):
        compiled = compile_fn(self, gm, example_inputs, **kwargs)
        shape_env = torch._guards.detect_fake_mode(example_inputs).shape_env
        record["shape_envs"].append({
            "guards": sorted(str(g.expr) for g in shape_env.guards),
            "replacements": sorted(f"{k} = {v}" for k, v in shape_env.replacements.items()),
            "divisible": sorted(map(str, shape_env.divisible)),
        })
        return compiled

    ddp_optimizer.SubmodCompiler.compile_submod = recording_compile_submod
    ddp_optimizer.DDPOptimizerContext.__init__ = recording_init
    ddp_optimizer.DDPOptimizer.compile_fn = recording_compile_fn
    return record


def tag_static_inputs() -> None:
    """Option ``tag_static_inputs``: Inductor's GPU-only tagging of static inputs, on any device."""
    import torch._inductor.compile_fx as compile_fx

    compile_graph = compile_fx._compile_fx_inner

    def tagging_compile_graph(gm, example_inputs, *args, **kwargs):
        for i in kwargs.get("static_input_idxs") or ():
            if isinstance(example_inputs[i], torch.Tensor):
                example_inputs[i]._is_inductor_static = True
        return compile_graph(gm, example_inputs, *args, **kwargs)

    compile_fx._compile_fx_inner = tagging_compile_graph


def main() -> None:
    options = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, format=f"[rank{os.environ['RANK']}] %(name)s: %(message)s")
    rank = int(os.environ["RANK"])
    builds = count_cpp_builds()
    passes = []
    if options.get("first_compiler"):
        passes.append(FirstCompilerPass(options["first_compiler"], options["marker"]))
    if options.get("slow_compiles") is not None:
        passes.append(SlowCompilesPass(float(options["slow_compiles"])))
    if options.get("rank_baking_pass"):
        passes.append(RankBakingPass())
    if passes:
        from torch._inductor import config as inductor_config

        inductor_config.post_grad_custom_post_pass = passes[0] if len(passes) == 1 else Passes(passes)

    use_pg = not options.get("no_pg") and not options.get("private_pg")
    if use_pg:
        timeout = options.get("pg_timeout_s")
        dist.init_process_group("gloo", timeout=None if timeout is None else timedelta(seconds=timeout))
    elif options.get("private_pg"):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    store = options.get("store")
    if options.get("external_store"):
        host, port = options["external_store"].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False)

    kind = options.get("model_file") or options.get("model", "mlp")
    dtype = getattr(torch, options.get("dtype", "float32"))
    model = make_model(kind, rank).to(dtype)
    reference = make_model(kind, rank).to(dtype)
    if kind == "collective":
        model, reference = WithAllReduce(model), WithAllReduce(reference)
    if options.get("device_index") is not None:
        # As if this rank compiled for another CUDA device index (plain torchrun's cuda:RANK).
        from coordinator.protocol import devices

        devices.current_index = lambda: str(options["device_index"])
    bundle = options.get("bundle", "")
    bundle_result = None
    if bundle.startswith("load:"):
        bundle_result = coordinator.load_bundle(bundle[len("load:"):])
    session = contextlib.ExitStack()
    if options.get("coordinator", True):
        # Entered before torch.compile: a function is packaged (``precompile``) only if
        # compiled while the session is on.
        session.enter_context(coordinator.compile_once(store))
    if options.get("fsdp_blocks"):
        from torch.distributed.fsdp import fully_shard

        for block in model:
            block.compile()
            fully_shard(block)
        compiled = fully_shard(model)
    else:
        # Compile the module, then wrap it: on torch 2.13 Dynamo skips DDP's own forward.
        compiled = torch.compile(model)
    if options.get("ddp"):
        compiled = torch.nn.parallel.DistributedDataParallel(compiled, bucket_cap_mb=options.get("bucket_cap_mb", 25))

    split_record = record_split_graphs() if options.get("record_split") else None
    if options.get("tag_static_inputs"):
        tag_static_inputs()
    torch.manual_seed(1)
    shapes = options.get("shapes") or [8] * options.get("steps", 2)
    if kind == "conv":
        batches = [torch.randn(n, 3, 8, 8) for n in shapes]
    else:
        batches = [torch.randn(n, 512 if kind in ("repeated", "split_mlp", "fused_qkv", "positions") else 16)
                   for n in shapes]
    batches = [x.to(dtype) for x in batches]
    losses, ref_losses, step_times, grad_norms = [], [], [], []
    # An optimizer step that changes nothing (lr 0): marks each step in a coordinator trace.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0) if options.get("optimizer") else None

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
            grad_norms.append([p.grad.norm().item() for p in model.parameters()])
            if optimizer is not None:
                optimizer.step()
            model.zero_grad(set_to_none=True)
            expected = reference(x) + (rank if options.get("rank_baking_pass") else 0)
            ref_losses.append(expected.pow(2).mean().item())
        if options.get("touch_after_steps"):
            open(options["touch_after_steps"], "w").close()

    with session:
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
            "grad_norms": grad_norms,
            "split_graphs": split_record,
            "cpp_builds": builds,
            "inductor": inductor_counters(),
            "frames_traced": frames_traced(),
            "compile_seconds": process_compile_seconds(),
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
