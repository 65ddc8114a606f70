"""Watch Inductor's compile workers while jobs run: what Redis their environment names, and
whether anything knocks on a Redis port where no server should be reached.

    python benchmarks/tools/watch_workers.py --out workers.json [--listen 6379] &
    ...run jobs...; kill %1     # the JSON is written when it is stopped

Every 0.5 s it lists the processes whose command line runs Inductor's compile workers
(``torch/_inductor/compile_worker``) and reads each new one's ``/proc/PID/environ`` (the
environment it started with): ``TORCHINDUCTOR_REDIS_URL`` / ``_HOST`` / ``_PORT``. With
``--listen PORT`` it also accepts connections on 127.0.0.1:PORT, closes each at once and
counts them, with the command line of the process that opened it where it can be found.
Writes ``{"workers": [{pid, first_seen, redis}], "connections": [{t, peer, cmdline}]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import threading
import time

REDIS_VARIABLES = ("TORCHINDUCTOR_REDIS_URL", "TORCHINDUCTOR_REDIS_HOST", "TORCHINDUCTOR_REDIS_PORT")


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def compile_workers() -> dict[int, dict[str, str]]:
    """pid -> its Redis variables, for every process running Inductor's compile workers."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        cmdline = _read(f"/proc/{entry}/cmdline").replace(b"\0", b" ")
        if b"compile_worker" not in cmdline:
            continue
        environ = dict(item.split("=", 1) for item in _read(f"/proc/{entry}/environ").decode(errors="replace")
                       .split("\0") if "=" in item)
        found[int(entry)] = {name: environ[name] for name in REDIS_VARIABLES if name in environ}
    return found


def owner_of(peer_port: int) -> str:
    """The command line of the process whose TCP socket has local port ``peer_port``."""
    inode = None
    for line in _read("/proc/net/tcp").decode().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == peer_port:
            inode = fields[9]
            break
    if inode is None:
        return ""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
    return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--listen", type=int, default=None, metavar="PORT")
    args = p.parse_args()
    workers: dict[int, dict] = {}
    connections: list[dict] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if args.listen is not None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", args.listen))
        server.listen(64)
        server.settimeout(0.2)

        def accept() -> None:
            while not stop.is_set():
                try:
                    client, peer = server.accept()
                except TimeoutError:
                    continue
                connections.append({"t": time.time(), "peer": peer[1], "cmdline": owner_of(peer[1])})
                client.close()

        threading.Thread(target=accept, daemon=True).start()
    while not stop.is_set():
        for pid, redis in compile_workers().items():
            workers.setdefault(pid, {"pid": pid, "first_seen": time.time(), "redis": redis})
        stop.wait(0.5)
    with open(args.out, "w") as f:
        json.dump({"workers": list(workers.values()), "connections": connections}, f, indent=1)


if __name__ == "__main__":
    main()
