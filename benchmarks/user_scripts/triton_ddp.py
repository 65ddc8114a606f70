"""A user's training script whose model runs Triton kernels written outside Inductor, trained
eagerly with DDP, 3 steps, step 3 at another sequence length. It never imports coordinator.

    torchrun --nproc-per-node 2 triton_ddp.py --model fla-gdn # flash-linear-attention's GatedDeltaNet
    torchrun --nproc-per-node 2 triton_ddp.py --model fla     # its DeltaNet
    torchrun --nproc-per-node 2 triton_ddp.py --model liger   # an HF Llama patched by liger-kernel

* ``fla-gdn``: flash-linear-attention's ``GatedDeltaNetForCausalLM`` (the layer Qwen3-Next uses)
  from a small config (d=512, 4 layers, 4 heads; fla-core / flash-linear-attention 0.6.0), whose
  kernels are mostly ``@triton.autotune``d with many configs; where its model classes do not
  import (an older transformers), the same layers stacked here (``fla.layers.GatedDeltaNet``,
  ``fla.modules.RMSNorm``/``GatedMLP``). Its backward refuses to run on Hopper GPUs with
  Triton 3.4 to 3.7.0 (flash-linear-attention #640: the gated ``chunk_bwd_dqkwg``).
* ``fla``: the same with flash-linear-attention's ``DeltaNetForCausalLM`` (the delta rule without
  its gate, most of the same kernels), which trains there.
* ``liger``: ``LlamaForCausalLM`` (d=1024, 6 layers) after ``liger_kernel.transformers.
  apply_liger_kernel_to_llama()`` (RMSNorm, SwiGLU, RoPE, fused linear cross entropy: JIT-compiled
  Triton kernels).

One ``HFJOB {json}`` line per rank on stdout: step times, import and set-up seconds, losses,
and Triton's own counts of this rank: kernels it compiled (``knobs.compilation.listener``
with ``cache_hit`` False) and autotune configs it benchmarked (``Autotuner._bench`` calls).
``HFSTEP`` lines on stderr mark each step's start and end.
"""
import argparse
import json
import os
import sys
import time

T_START = time.time()
RANK = int(os.environ.get("RANK", "0"))

import logging  # noqa: E402

if os.environ.get("HF_LOG") in ("1", "DEBUG"):
    logging.basicConfig(format=f"[%(asctime)s r{RANK}] %(name)s %(levelname)s: %(message)s")
    logging.getLogger("coordinator").setLevel(logging.DEBUG if os.environ["HF_LOG"] == "DEBUG" else logging.INFO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import triton  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from triton import knobs  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

T_IMPORTED = time.time()
COUNTS = {"triton_compiles": 0, "triton_loads": 0, "configs_benchmarked": 0}


def _listen(*, src, metadata, metadata_group, times, cache_hit):
    COUNTS["triton_loads" if cache_hit else "triton_compiles"] += 1


def _count_benchmarks():
    bench = Autotuner._bench

    def counted(self, *args, **kwargs):
        COUNTS["configs_benchmarked"] += 1
        return bench(self, *args, **kwargs)

    Autotuner._bench = counted


def fla_delta_net(vocab):
    from fla.models import DeltaNetConfig, DeltaNetForCausalLM

    cfg = DeltaNetConfig(hidden_size=512, num_hidden_layers=4, num_heads=4, vocab_size=vocab, fuse_cross_entropy=True)
    return DeltaNetForCausalLM(cfg), "fla.models.DeltaNetForCausalLM"


def fla_gated_delta_net(vocab):
    try:
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

        cfg = GatedDeltaNetConfig(hidden_size=512, num_hidden_layers=4, num_heads=4, head_dim=128, vocab_size=vocab,
                                  expand_v=1, fuse_cross_entropy=True)
        return GatedDeltaNetForCausalLM(cfg), "fla.models.GatedDeltaNetForCausalLM"
    except ImportError as exc:
        print(f"fla models do not import ({exc}); stacking fla.layers.GatedDeltaNet", file=sys.stderr)
    from fla.layers import GatedDeltaNet
    from fla.modules import GatedMLP, RMSNorm

    class Block(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.norm1, self.norm2 = RMSNorm(512), RMSNorm(512)
            self.attn = GatedDeltaNet(hidden_size=512, num_heads=4, head_dim=128, expand_v=1, layer_idx=i)
            self.mlp = GatedMLP(hidden_size=512)

        def forward(self, x):
            x = x + self.attn(self.norm1(x))[0]
            return x + self.mlp(self.norm2(x))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, 512)
            self.blocks = torch.nn.ModuleList(Block(i) for i in range(4))
            self.norm, self.head = RMSNorm(512), torch.nn.Linear(512, vocab, bias=False)

        def forward(self, input_ids, labels):
            x = self.embed(input_ids)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.norm(x)).float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            return type("Out", (), {"loss": loss})()

    return Model(), "fla.layers.GatedDeltaNet stack"


def liger_model(vocab):
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers import LlamaConfig, LlamaForCausalLM

    apply_liger_kernel_to_llama()
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
                      num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)
    return LlamaForCausalLM(cfg), "LlamaForCausalLM + apply_liger_kernel_to_llama"


MODELS = {"fla": fla_delta_net, "fla-gdn": fla_gated_delta_net, "liger": liger_model}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=tuple(MODELS), default="fla")
    args = parser.parse_args()
    knobs.compilation.listener = _listen
    _count_benchmarks()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    vocab = 32000
    model, what = MODELS[args.model](vocab)
    model = model.to(device=dev, dtype=torch.bfloat16)
    model.train()
    ddp = DDP(model, device_ids=[local])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    dist.barrier(device_ids=[local])
    torch.cuda.synchronize()
    t0 = time.time()
    losses, step_s, after = [], [], []
    last = t0
    for step, seq in enumerate([2048, 2048, 1024]):
        print(f"HFSTEP start rank={rank} step={step + 1} seq={seq} t={time.time():.3f}", file=sys.stderr, flush=True)
        g = torch.Generator().manual_seed(1000 + step)  # same batch on every rank
        ids = torch.randint(0, vocab, (4, seq), generator=g).to(dev)
        loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        torch.cuda.synchronize()
        now = time.time()
        step_s.append(round(now - last, 3))
        print(f"HFSTEP end rank={rank} step={step + 1} t={now:.3f}", file=sys.stderr, flush=True)
        after.append(dict(COUNTS))
        last = now
    rec = {
        "rank": rank, "world": world, "model": what, "step1_s": step_s[0], "step_s": step_s,
        "total_s": round(time.time() - T_START, 3), "import_s": round(T_IMPORTED - T_START, 3),
        "setup_s": round(t0 - T_IMPORTED, 3), "t_start_abs": T_START, "losses": losses, **COUNTS,
        "after_step1": after[0],
        "coordinator_in_sys_modules": "coordinator" in sys.modules, "triton": triton.__version__,
        "device": torch.cuda.get_device_name(dev),
    }
    if "coordinator" in sys.modules:
        import coordinator

        stats = coordinator.stats()
        rec["coordinator"] = {k: stats.get(k) for k in ("triton_kernels_compiled", "triton_kernels_received",
                                                        "triton_tunings_run", "triton_tunings_received", "triton",
                                                        "waits", "waited_s", "rejected", "store")} if stats else None
    print("HFJOB " + json.dumps(rec), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
