"""One training job of a third-party model, written as a user would: it never imports ``coordinator``.

    torchrun --standalone --nproc-per-node N benchmarks/model_suite_job.py --model llama --json OUT
    coordinator-run --standalone --nproc-per-node N benchmarks/model_suite_job.py --model llama --json OUT

Models are built from HuggingFace ``transformers`` configs (random init, no download):

* ``llama``: ``LlamaForCausalLM`` under DDP;
* ``llama-dynamic``: the same, ``torch.compile(dynamic=True)``;
* ``llama-solo``: the same without DDP (each rank all-reduces its gradients itself,
  outside the compiled model), so no frame is split by DDPOptimizer;
* ``phi3``: ``Phi3ForCausalLM`` under DDP: its attention splits one fused q/k/v projection
  into q, k and v (and its MLP one fused gate/up projection), so the graphs DDPOptimizer
  splits out return slices of a larger buffer;
* ``gpt2``: ``GPT2LMHeadModel`` under DDP (dropout on): one fused q/k/v projection (a
  ``Conv1D``) split into q, k and v, and the output head tied to the embeddings;
* ``bert``: ``BertForMaskedLM`` under DDP (dropout on);
* ``convnext``: ``ConvNextForImageClassification`` under DDP;
* ``fused-qkv``: a decoder of plain ``torch.nn`` layers under DDP (no ``transformers``):
  one fused q/k/v ``Linear`` whose output is viewed as (q, k, v) heads and unbound, and a
  GELU MLP; its split graphs take and return views at offsets into one projection;
* ``qwen-fsdp``: ``Qwen2ForCausalLM`` under FSDP2, ``fully_shard`` and ``compile`` per decoder
  layer (the torchtitan pattern).

Each runs ``--steps`` training steps (forward, backward, AdamW) at one input shape, then one
step at another (longer sequences; for the vision model a larger batch): a recompile. Every
rank gets the same batches, so losses must be bitwise equal across ranks and to a run with
no coordinator. Rank 0 writes every rank's step times, losses and Inductor's FX-graph cache
counters to ``--json``; under ``coordinator-run`` it adds ``coordinator.stats()``, read from
the module the launcher loaded. With ``--reference`` it also runs the same steps on a fresh
copy of the model in eager mode and writes their losses (``ref_losses``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

#: The script's first line after the standard library: what the launcher (and, under
#: coordinator-run, the worker's sitecustomize) cost before it is "launch"; the imports follow.
SCRIPT_BEGAN = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

IMPORTED = time.time()

MODELS = ("llama", "llama-dynamic", "llama-solo", "phi3", "gpt2", "bert", "convnext", "fused-qkv", "qwen-fsdp")
#: Model sizes: "bench" for benchmarks/model_suite.py, "tiny" for the tests.
SIZES = {
    "bench": {"hidden": 128, "layers": 2, "heads": 4, "vocab": 512, "batch": 4, "seq": (32, 48), "image": 64},
    "tiny": {"hidden": 32, "layers": 2, "heads": 2, "vocab": 128, "batch": 2, "seq": (8, 12), "image": 32},
    # Large enough for DDP to split every model into two or more buckets (its first holds 1 MB).
    "split": {"hidden": 512, "layers": 4, "heads": 8, "vocab": 512, "batch": 4, "seq": (32, 48), "image": 64},
    # The GPU restart job (benchmarks/restart.py): a 142M Llama (or Phi-3) in bf16, 16 query and
    # key/value heads.
    "restart": {"hidden": 1024, "intermediate": 2816, "layers": 6, "heads": 16, "kv_heads": 16, "vocab": 32000,
                "batch": 8, "seq": (512, 384), "image": 224, "dtype": "bfloat16"},
}


class FusedQKVBlock(torch.nn.Module):
    """A pre-norm decoder block with one fused q/k/v projection."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attention = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, t, h))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class FusedQKV(torch.nn.Module):
    """A small decoder of :class:`FusedQKVBlock` layers; its forward returns ``.loss`` as
    ``transformers``' models do."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(FusedQKVBlock(hidden, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss)


def build(name: str, size: dict) -> torch.nn.Module:
    h, layers, heads = size["hidden"], size["layers"], size["heads"]
    if name == "fused-qkv":
        return FusedQKV(size["vocab"], h, layers, heads)
    import transformers as tf

    if name.startswith("llama"):
        config = tf.LlamaConfig(vocab_size=size["vocab"], hidden_size=h,
                                intermediate_size=size.get("intermediate", 2 * h), num_hidden_layers=layers,
                                num_attention_heads=heads,
                                num_key_value_heads=size.get("kv_heads", heads // 2),
                                max_position_embeddings=max(256, *size["seq"]))
        return tf.LlamaForCausalLM(config)
    if name == "phi3":
        config = tf.Phi3Config(vocab_size=size["vocab"], hidden_size=h,
                               intermediate_size=size.get("intermediate", 2 * h), num_hidden_layers=layers,
                               num_attention_heads=heads,
                               num_key_value_heads=size.get("kv_heads", heads // 2),
                               max_position_embeddings=max(256, *size["seq"]),
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return tf.Phi3ForCausalLM(config)
    if name == "gpt2":
        config = tf.GPT2Config(vocab_size=size["vocab"], n_embd=h, n_layer=layers, n_head=heads,
                               n_inner=size.get("intermediate"), n_positions=max(256, *size["seq"]))
        return tf.GPT2LMHeadModel(config)
    if name == "qwen-fsdp":
        config = tf.Qwen2Config(vocab_size=size["vocab"], hidden_size=h, intermediate_size=2 * h,
                                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                                max_position_embeddings=256)
        return tf.Qwen2ForCausalLM(config)
    if name == "bert":
        config = tf.BertConfig(vocab_size=size["vocab"], hidden_size=h, num_hidden_layers=layers,
                               num_attention_heads=heads, intermediate_size=2 * h, max_position_embeddings=256)
        return tf.BertForMaskedLM(config)
    if name == "convnext":
        config = tf.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[h // 4, h // 2],
                                   depths=[max(1, layers // 2)] * 2, num_labels=10,
                                   image_size=size["image"])
        return tf.ConvNextForImageClassification(config)
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def batch(name: str, size: dict, step: int, shape: int, device: torch.device) -> dict:
    """The same batch on every rank: step ``step`` at shape number ``shape`` (0 or 1)."""
    gen = torch.Generator().manual_seed(1000 + step)
    if name == "convnext":
        n = size["batch"] * (1 + shape)  # the shape change: a larger batch
        pixels = torch.randn(n, 3, size["image"], size["image"], generator=gen)
        labels = torch.randint(10, (n,), generator=gen)
        return {"pixel_values": pixels.to(device), "labels": labels.to(device)}
    ids = torch.randint(size["vocab"], (size["batch"], size["seq"][shape]), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids}


def reference_losses(name: str, size: dict, shapes: list[int], device: torch.device) -> list[float]:
    """The job's steps on a fresh copy of the model, built from the same seed, in eager mode
    and in this process alone: every rank gets the same batches, so the gradients a job's
    ranks average are this process's own."""
    torch.manual_seed(0)
    model = build(name, size).to(device, getattr(torch, size.get("dtype", "float32"))).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step, shape in enumerate(shapes):
        loss = model(**batch(name, size, step, shape, device)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def time_module_loads() -> list[float]:
    """Seconds spent in Inductor's ``PyCodeCache.load_by_key_path`` (loading each compiled
    graph's and kernel's Python module), appended per call."""
    from torch._inductor.codecache import PyCodeCache

    spent: list[float] = []
    original = PyCodeCache.__dict__["load_by_key_path"].__func__

    def load_by_key_path(cls, *args, **kwargs):
        begin = time.perf_counter()
        try:
            return original(cls, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - begin)

    PyCodeCache.load_by_key_path = classmethod(load_by_key_path)
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument("--size", choices=tuple(SIZES), default="bench")
    p.add_argument("--steps", type=int, default=2, help="steps at the first shape; then one at the second")
    p.add_argument("--json", required=True)
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="DDP's bucket size in MB (default: DDP's own, 25): smaller buckets, more split graphs")
    p.add_argument("--cache-per-rank", action="store_true",
                   help="each rank its own empty Inductor cache dir, as ranks on separate nodes have")
    p.add_argument("--reference", action="store_true",
                   help="rank 0 also runs the steps in eager mode, without DDP/FSDP or torch.compile, and "
                        "writes their losses (ref_losses); random ops (dropout) then draw as eager does "
                        "(Inductor's fallback_random), so the two runs' losses can be compared")
    p.add_argument("--profile", default=None, metavar="PREFIX",
                   help="profile this process with cProfile into PREFIX.rank<N>.prof (timings then include "
                        "the profiler's overhead)")
    args = p.parse_args()
    # model_suite.py --profile-ranks: py-spy samples this rank's process until its steps end.
    profile_self = os.environ.get("SUITE_PROFILE_SELF")
    sampler = None
    if profile_self:
        from self_profile import start_self_profile

        sampler = start_self_profile(f"{profile_self}-rank{os.environ.get('RANK', 0)}.txt")
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        atexit.register(lambda: (profiler.disable(), profiler.dump_stats(
            f"{args.profile}.rank{os.environ.get('RANK', 0)}.prof")))
        profiler.enable()
    if args.cache_per_rank:
        import tempfile

        cache = tempfile.mkdtemp(prefix=f"inductor-rank{os.environ.get('RANK', 0)}-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")

    module_loads = time_module_loads()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    backend = os.environ.get("SUITE_BACKEND") or ("nccl" if cuda else "gloo")
    dist.init_process_group(backend, timeout=timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    size = SIZES[args.size]

    if args.reference:
        from torch._inductor import config as inductor_config

        inductor_config.fallback_random = True
    torch.manual_seed(0)
    model = build(args.model, size).to(device, getattr(torch, size.get("dtype", "float32"))).train()
    if args.model == "qwen-fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            layer.compile()
            fully_shard(layer)
        fully_shard(model)
        runner = model
    else:
        # Compile the module, then wrap it (on torch 2.13 Dynamo skips DDP's own forward).
        compiled = torch.compile(model, dynamic=True if args.model == "llama-dynamic" else None)
        runner = compiled if args.model == "llama-solo" else torch.nn.parallel.DistributedDataParallel(
            compiled, **({"bucket_cap_mb": args.bucket_mb} if args.bucket_mb else {}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    shapes = [0] * args.steps + [1]
    losses, step_ends = [], []
    built = time.time()
    dist.barrier()
    start = time.time()
    for step, shape in enumerate(shapes):
        loss = runner(**batch(args.model, size, step, shape, device)).loss
        loss.backward()
        if args.model == "llama-solo" and world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # syncs the device
        step_ends.append(time.time())
    if sampler is not None:
        from self_profile import stop_self_profile

        stop_self_profile(sampler)

    import resource

    from torch._dynamo.utils import calculate_time_spent, compilation_time_metrics, counters, get_compilation_metrics

    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    ref_losses = reference_losses(args.model, size, shapes, device) if args.reference and rank == 0 else None

    coordinator = sys.modules.get("coordinator")  # loaded by coordinator-run, never imported here
    mine = {
        "rank": rank,
        "start": start,
        "launched": float(os.environ.get("SUITE_LAUNCHED", "nan")),
        # The script's timeline: its first line, torch imported, model built and wrapped
        # (then NCCL's first barrier, then ``start``).
        "script_began": SCRIPT_BEGAN, "imported": IMPORTED, "built": built,
        "step_ends": step_ends,
        "losses": [float.hex(x) for x in losses],
        "fx_misses": counters["inductor"].get("fxgraph_cache_miss", 0),
        "fx_hits": counters["inductor"].get("fxgraph_cache_hit", 0),
        "aot_autograd": dict(counters["aot_autograd"]),
        "frames_traced": len(compilation_time_metrics.get("bytecode_tracing", ())),  # frames Dynamo traced
        # Seconds inside torch.compile: ``entire_frame_compile`` (Dynamo, AOTAutograd and
        # Inductor for each frame) and ``total_wall_time`` (with the lazy backward compiles).
        "compile_s": calculate_time_spent(),
        "phases_s": {phase: sum(times) for phase, times in compilation_time_metrics.items()},
        "module_loads_s": sum(module_loads),
        # Each compile Dynamo recorded: a frame's (Dynamo, then its backend: for a split frame,
        # DDPOptimizer's chain, with the coordinator's shares) or a lazily compiled backward's.
        "compiles": [{"id": str(m.compile_id), "forward": m.is_forward is not False,
                      "start": (m.start_time_us or 0) / 1e6, "end": (m.end_time_us or 0) / 1e6,
                      "backend_s": m.backend_compile_time_s} for m in get_compilation_metrics()],
        "stats": coordinator.stats() if coordinator is not None else None,
        # CPU seconds of this process and the compilers it ran (its compile workers' own
        # children are not counted).
        "cpu_s": sum(u.ru_utime + u.ru_stime for u in usage),
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        begin = min(r["start"] for r in everyone)
        result = {
            "model": args.model, "size": args.size, "world": world, "torch": torch.__version__,
            "step1_s": max(r["step_ends"][0] for r in everyone) - begin,
            "all_steps_s": max(r["step_ends"][-1] for r in everyone) - begin,
            "ref_losses": [float.hex(x) for x in ref_losses] if ref_losses is not None else None,
            "ranks": everyone,
        }
        with open(args.json, "w") as f:
            json.dump(result, f)
    exit_began = time.time()
    dist.barrier()
    dist.destroy_process_group()
    destroyed = time.time()
    # Leave without tearing the interpreter down: on torch 2.13 with gloo, freeing DDP's
    # reducer at teardown can deadlock (its process group joins a gloo thread that waits for
    # the GIL the teardown holds). Exit handlers (the coordinator's summary, Inductor's
    # compile workers' shutdown) still run, and are timed: into <json>.exit-rank<R>.json.
    # Inductor's compile workers first, timed on their own (its exit handler then has nothing to do).
    if "torch._inductor.async_compile" in sys.modules:
        sys.modules["torch._inductor.async_compile"].shutdown_compile_workers()
    workers_shut = time.time()
    atexit._run_exitfuncs()
    with open(f"{args.json}.exit-rank{rank}.json", "w") as f:
        json.dump({"exit_began": exit_began, "destroyed": destroyed, "workers_shutdown_s": workers_shut - destroyed,
                   "exit_handlers_s": time.time() - workers_shut, "exit_ended": time.time()}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
