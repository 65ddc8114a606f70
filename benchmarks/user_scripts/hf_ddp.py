"""The model suite's DDP models as a user would write the training script: a HuggingFace model
(random init from a config, no download) wrapped in torch.compile and DDP, AdamW, three steps,
the third at another sequence length (Dynamo recompiles). It never imports coordinator.

    torchrun --standalone --nproc-per-node 2 hf_ddp.py --model gpt2
    torchrun --standalone --nproc-per-node 3 hf_ddp.py --cpu --no-ddp

Models (142M-class, bf16, the sizes of ``model_suite_job.py``'s ``restart``): ``llama``, ``phi3``
(fused q/k/v and gate/up projections), ``gpt2`` (a fused q/k/v ``Conv1D``, tied head).
``--cpu``: on the CPU over gloo, fp32, the sizes of ``model_suite_job.py``'s ``split`` (hidden
512, 4 layers, batch 4, sequences 32, 32, 48). ``--no-ddp``: the compiled model without DDP,
each rank all-reducing its gradients itself after the backward (no frame is split).
Step marks on stderr (``HFSTEP start|end rank=R step=S ... t=SECONDS``), one ``HFJOB {json}``
line per rank on stdout (step times, losses, FX cache counters).
"""
import argparse
import json
import os
import sys
import time

T_START = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM  # noqa: E402

T_IMPORTED = time.time()
HIDDEN, INTERMEDIATE, LAYERS, HEADS, VOCAB, BATCH = 1024, 2816, 6, 16, 32000, 8
SEQS = [512, 512, 384]


def build(name):
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                            num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                            num_key_value_heads=HEADS, max_position_embeddings=1024))
    if name == "phi3":
        return Phi3ForCausalLM(Phi3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                          num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                          num_key_value_heads=HEADS, max_position_embeddings=1024,
                                          pad_token_id=0, bos_token_id=1, eos_token_id=2))
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                          n_inner=INTERMEDIATE, n_positions=1024))
    raise SystemExit(f"unknown model {name!r}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama", choices=("llama", "phi3", "gpt2"))
    parser.add_argument("--cpu", action="store_true", help="on the CPU over gloo, fp32, a small size")
    parser.add_argument("--no-ddp", action="store_true", help="no DDP: each rank all-reduces its gradients")
    args = parser.parse_args()
    global HIDDEN, INTERMEDIATE, LAYERS, HEADS, VOCAB, BATCH, SEQS
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.cpu:
        HIDDEN, INTERMEDIATE, LAYERS, HEADS, VOCAB, BATCH, SEQS = 512, 1024, 4, 8, 512, 4, [32, 32, 48]
        dev, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local)
        dev, dtype = torch.device("cuda", local), torch.bfloat16
        torch.set_float32_matmul_precision("high")
        dist.init_process_group("nccl")
    sync = (lambda: None) if args.cpu else torch.cuda.synchronize
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build(args.model).to(device=dev, dtype=dtype)
    model.train()
    if args.no_ddp:
        ddp = torch.compile(model)
    else:
        ddp = DDP(torch.compile(model), device_ids=None if args.cpu else [local])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    dist.barrier(device_ids=None if args.cpu else [local])
    sync()
    t0 = last = time.time()
    losses, step_s = [], []
    for step, seq in enumerate(SEQS):
        print(f"HFSTEP start rank={rank} step={step + 1} seq={seq} t={time.time():.3f}", file=sys.stderr, flush=True)
        ids = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(1000 + step)).to(dev)
        loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        if args.no_ddp:
            for param in model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad)
                    param.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        sync()
        now = time.time()
        step_s.append(round(now - last, 3))
        print(f"HFSTEP end rank={rank} step={step + 1} t={now:.3f}", file=sys.stderr, flush=True)
        last = now
    inductor = counters["inductor"]
    from torch._dynamo.utils import calculate_time_spent

    print("HFJOB " + json.dumps({
        "rank": rank, "model": args.model, "step_s": step_s, "losses": losses,
        "import_s": round(T_IMPORTED - T_START, 3), "setup_s": round(t0 - T_IMPORTED, 3),
        "total_s": round(time.time() - T_START, 3), "t_start_abs": T_START,
        "time_spent": {k: round(v, 2) for k, v in calculate_time_spent().items()},
        "fx_miss": inductor.get("fxgraph_cache_miss", 0), "fx_hit": inductor.get("fxgraph_cache_hit", 0),
    }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
