"""Store load at scale: N simulated node leaders running the real claim/wait/publish protocol.

    python benchmarks/store_scale.py --nodes 1000 --store c10d
    python benchmarks/store_scale.py --nodes 1000 --store redis --waits polling
    python benchmarks/store_scale.py --sweep          # N = 8, 64, 256, 1000; both stores; both waits

Starts a real server (a TCPStore in a process of its own, or redis-server) on loopback and
``--procs`` worker processes that each run N/procs node leaders as threads, one store
client each (as one leader per node is what node-level fetch leaves). Every leader looks up
``--graphs`` graphs in turn through :class:`coordinator.singleflight.Singleflight`: the
first to ask claims the graph, "compiles" it (sleeps ``--compile-s``) and publishes a
``--value-bytes`` value; the others wait. A victim process claims graph 1 before the
leaders start and is SIGKILLed ``--kill-after-s`` later: a waiter takes over when its
lease lapses. ``--waits polling`` runs the waits as they were before signalled waits (three
reads a poll, 10 to 200 ms apart), for the before/after comparison.

``--waits bare`` measures the floor under both: each leader blocks on the store's own
primitive for one key (a raw TCPStore ``wait``, a Redis subscription), the script writes it,
and ``p50_ms``/``p99_ms`` are write to wake-up, with no protocol around it. On a machine
that also runs every simulated leader, this is what the leaders' own CPU allows.

One JSON line per run: ``nodes``, ``store``, ``waits``, ``p50_ms``/``p99_ms``/``max_ms``
(publish to each waiter's return), ``ops_per_waiter_s`` (store calls a waiting leader made
per second of waiting, over graph 1's waits: a lease and more, the idle load),
``ops_per_s`` (all calls), ``server_cpu`` (server CPU-s per second of the run),
``takeover_s`` (victim killed to a leader's claim), ``timeouts`` (waits that hit their
deadline), ``wrong_takeovers`` (a graph claimed by more than one leader),
``store_mem_mb`` (server memory growth, after the job), ``duration_s``. ``--sweep`` (all three
waits) also writes ``benchmarks/results/store-scale.json``, ``benchmarks/store_scale.png`` and the
table into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- servers -----------------------------------------------------------------------------


class Server:
    def __init__(self, kind: str, workdir: str) -> None:
        self.kind = kind
        port = free_port()
        if kind == "c10d":
            code = ("import sys, time, datetime, torch.distributed as dist;"
                    f"s = dist.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False,"
                    " timeout=datetime.timedelta(seconds=300)); print('up', flush=True); sys.stdin.read()")
            self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, preexec_fn=raise_fd_limit)
            assert self.proc.stdout.readline().strip() == "up"
            self.url = f"tcp://127.0.0.1:{port}"
        else:
            binary = shutil.which("redis-server") or shutil.which("valkey-server")
            if binary is None:
                raise SystemExit("redis-server is not installed")
            self.proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                          "--appendonly", "no", "--maxclients", "20000", "--dir", workdir],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         preexec_fn=raise_fd_limit)
            self.url = f"redis://127.0.0.1:{port}/0"
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory_bytes(self) -> int:
        if self.kind == "redis":
            import redis

            return int(redis.Redis.from_url(self.url).info("memory")["used_memory"])
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def open_client(url: str):
    from coordinator.stores import open_store

    if url.startswith("tcp://"):
        import torch.distributed as dist

        host, port = url[len("tcp://"):].rsplit(":", 1)
        return open_store(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120)))
    return open_store(url)


# -- the simulated node leaders ----------------------------------------------------------


class Counting:
    """Counts store calls (through ``TimedStore``'s hook)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, seconds: float) -> None:
        self.calls += 1


def flight_for(url: str, node: int, spec: dict, counter: Counting):
    from coordinator.singleflight import Owner, Singleflight
    from coordinator.stores.base import TimedStore

    return Singleflight(TimedStore(open_client(url), counter), owner=Owner(node, socket.gethostname(), os.getpid()),
                        lease=timedelta(seconds=spec["lease"]), wait_timeout=timedelta(seconds=spec["deadline"]),
                        progress_interval=timedelta(seconds=3600), signalled_waits=spec["waits"] == "signalled")


def leader(node: int, spec: dict, flight, counter: Counting, start: threading.Event, records: list) -> None:
    payload = os.urandom(spec["value_bytes"])
    start.wait()
    for graph in range(spec["graphs"]):
        calls, began = counter.calls, time.time()
        result = flight.lookup(f"g{graph}", blocking=True)
        record = {"node": node, "graph": graph, "outcome": result.outcome, "returned": time.time(),
                  "waited_s": result.waited_s, "calls": counter.calls - calls, "lookup_s": time.time() - began}
        if result.outcome == "claimed":
            record["claimed_at"] = record["returned"]
            time.sleep(spec["compile_s"])
            record["published_at"] = time.time()
            flight.publish(f"g{graph}", payload)
        records.append(record)
    flight.close()


def worker(spec: dict) -> None:
    """One process: its share of the leaders, as threads; records to spec['out']."""
    nodes = range(spec["first"], spec["first"] + spec["count"])
    counters = {node: Counting() for node in nodes}
    flights = {node: flight_for(spec["url"], node, spec, counters[node]) for node in nodes}
    start = threading.Event()
    records: list = []
    threads = [threading.Thread(target=leader, args=(n, spec, flights[n], counters[n], start, records), daemon=True)
               for n in nodes]
    for t in threads:
        t.start()
    print("ready", flush=True)
    while not os.path.exists(spec["go"]):
        time.sleep(0.005)
    start.set()
    for t in threads:
        t.join()
    Path(spec["out"]).write_text(json.dumps(records))


def shares(nodes: int, procs: int) -> list[int]:
    """How many of ``nodes`` leaders each worker process runs."""
    n = max(1, min(procs, nodes))
    return [nodes // n + (1 if i < nodes % n else 0) for i in range(n)]


def bare_waiter(spec: dict) -> None:
    """One process of ``--waits bare``: each thread blocks on the store's own primitive."""
    woke: list = []
    clients = []
    for _ in range(spec["count"]):
        if spec["url"].startswith("tcp://"):
            import torch.distributed as dist

            host, port = spec["url"][len("tcp://"):].rsplit(":", 1)
            client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120))
            clients.append(lambda c=client: c.wait(["bare/go"], timedelta(seconds=120)))
        else:
            import redis

            pubsub = redis.Redis.from_url(spec["url"]).pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe("bare/go")

            def wait(p=pubsub):
                while p.get_message(timeout=120) is None:
                    pass

            clients.append(wait)
    def wait_and_record(wait) -> None:
        try:
            wait()
            woke.append(time.time())
        except Exception:  # noqa: BLE001 - counted as a missed wake-up
            woke.append(None)

    threads = [threading.Thread(target=wait_and_record, args=(w,), daemon=True) for w in clients]
    for t in threads:
        t.start()
    print("ready", flush=True)
    for t in threads:
        t.join()
    Path(spec["out"]).write_text(json.dumps(woke))


def run_bare(nodes: int, store: str, args) -> dict:
    raise_fd_limit()
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(store, tmp)
        try:
            per = shares(nodes, args.procs)
            outs = [f"{tmp}/woke-{i}.json" for i in range(len(per))]
            procs = [spawn({"role": "bare", "url": server.url, "count": count, "out": out})
                     for count, out in zip(per, outs, strict=True)]
            time.sleep(2)  # every thread blocked
            if store == "c10d":
                import torch.distributed as dist

                host, port = server.url[len("tcp://"):].rsplit(":", 1)
                client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
                written = time.time()
                client.set("bare/go", b"1")
            else:
                import redis

                client = redis.Redis.from_url(server.url)
                written = time.time()
                client.publish("bare/go", b"1")
            for proc in procs:
                if proc.wait(120) != 0:
                    raise SystemExit(f"a bare waiter failed ({proc.returncode})")
        finally:
            server.stop()
        woke = [t for out in outs for t in json.loads(Path(out).read_text())]
        latencies = sorted((t - written) * 1000 for t in woke if t is not None)
    pct = {q: round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 1) for q in (0.5, 0.99)}
    return {"nodes": nodes, "store": store, "waits": "bare", "p50_ms": pct[0.5], "p99_ms": pct[0.99],
            "max_ms": round(latencies[-1], 1), "ops_per_waiter_s": None, "ops_per_s": None, "server_cpu": None,
            "takeover_s": None, "timeouts": sum(t is None for t in woke),
            "wrong_takeovers": None, "store_mem_mb": None, "duration_s": None,
            "graphs": 1, "compile_s": 0, "lease_s": None}


def victim(spec: dict) -> None:
    """Claims graph 1 and holds it (heartbeating) until it is killed."""
    flight = flight_for(spec["url"], -1, spec, Counting())
    assert flight.lookup("g1", blocking=True).outcome == "claimed"
    print("ready", flush=True)
    time.sleep(3600)


# -- one run -------------------------------------------------------------------------------


def run(nodes: int, store: str, waits: str, args) -> dict:
    raise_fd_limit()
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(store, tmp)
        try:
            base = {"url": server.url, "lease": args.lease, "deadline": args.deadline, "waits": waits,
                    "graphs": args.graphs, "compile_s": args.compile_s, "value_bytes": args.value_bytes,
                    "go": f"{tmp}/go"}
            memory_before = server.memory_bytes()
            victim_proc = spawn({**base, "role": "victim"})
            procs, outs = [], []
            per = shares(nodes, args.procs)
            first = 0
            for i, count in enumerate(per):
                outs.append(f"{tmp}/records-{i}.json")
                procs.append(spawn({**base, "role": "worker", "first": first, "count": count, "out": outs[-1]}))
                first += count
            cpu_before, started = server.cpu_s(), time.time()
            Path(base["go"]).touch()
            time.sleep(args.kill_after_s)
            killed_at = time.time()
            victim_proc.kill()
            victim_proc.wait()
            for proc in procs:
                if proc.wait(args.deadline + 120) != 0:
                    raise SystemExit(f"a worker failed ({proc.returncode})")
            duration = time.time() - started
            cpu = server.cpu_s() - cpu_before
            memory = server.memory_bytes() - memory_before
        finally:
            server.stop()
        records = [r for out in outs for r in json.loads(Path(out).read_text())]
    if args.records:
        Path(args.records).write_text(json.dumps({"killed_at": killed_at, "records": records}))
    return summarize(records, nodes, store, waits, duration, cpu, memory, killed_at, args)


def spawn(spec: dict) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--role", json.dumps(spec)], stdout=subprocess.PIPE, text=True,
                            preexec_fn=raise_fd_limit)
    line = proc.stdout.readline().strip()
    if line != "ready":
        raise SystemExit(f"{spec['role']} did not start: {line!r}")
    return proc


def summarize(records, nodes, store, waits, duration, cpu, memory, killed_at, args) -> dict:
    published = {r["graph"]: r["published_at"] for r in records if "published_at" in r}
    claimants = {}
    for r in records:
        if r["outcome"] == "claimed":
            claimants.setdefault(r["graph"], []).append(r)
    latencies = sorted((r["returned"] - published[r["graph"]]) * 1000 for r in records
                       if r["outcome"] == "waited" and r["graph"] in published)
    # Idle load: graph 1's waits, which last a lease and more (its first claimant dies).
    waiting = [r for r in records if r["outcome"] == "waited" and r["graph"] == 1]
    wait_s = sum(r["lookup_s"] for r in waiting)
    takeover = [r["claimed_at"] - killed_at for r in claimants.get(1, [])]

    def pct(q: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 1) if latencies else None

    return {
        "nodes": nodes, "store": store, "waits": waits,
        "p50_ms": pct(0.50), "p99_ms": pct(0.99), "max_ms": round(latencies[-1], 1) if latencies else None,
        "ops_per_waiter_s": round(sum(r["calls"] for r in waiting) / wait_s, 2) if wait_s else None,
        "ops_per_s": round(sum(r["calls"] for r in records) / duration, 1),
        "server_cpu": round(cpu / duration, 3),
        "takeover_s": round(takeover[0], 2) if len(takeover) == 1 else None,
        "timeouts": sum(r["outcome"] == "deadline" for r in records),
        "wrong_takeovers": sum(len(c) - 1 for c in claimants.values()),
        "store_mem_mb": round(memory / 1e6, 2),
        "duration_s": round(duration, 1),
        "graphs": args.graphs, "compile_s": args.compile_s, "lease_s": args.lease,
    }


# -- the sweep -----------------------------------------------------------------------------


def sweep(args) -> None:
    """Run the sweep's rows (or those ``--sweep-stores``/``--sweep-waits`` pick) and merge them
    into ``results/store-scale.json``: a row measured again replaces the old one."""
    path = ROOT / "benchmarks" / "results" / "store-scale.json"
    saved = json.loads(path.read_text()) if path.exists() else {"commands": [], "rows": []}
    rows = saved["rows"]
    commands = [*saved.get("commands", [saved["command"]] if "command" in saved else []), command()]
    for nodes in args.sweep_nodes:
        for store in args.sweep_stores:
            for waits in args.sweep_waits:
                row = run_bare(nodes, store, args) if waits == "bare" else run(nodes, store, waits, args)
                print(json.dumps(row), flush=True)
                same = (row["nodes"], row["store"], row["waits"])
                rows = [r for r in rows if (r["nodes"], r["store"], r["waits"]) != same] + [row]
                order = {"bare": 0, "polling": 1, "signalled": 2}
                rows.sort(key=lambda r: (r["nodes"], r["store"], order[r["waits"]]))
                path.write_text(json.dumps({"commands": commands, "machine": machine(), "rows": rows}, indent=1))
    plot(rows, ROOT / "benchmarks" / "store_scale.png")
    section = markdown(rows, commands)
    print(section)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from cold_start import write_section

    write_section(ROOT / "benchmarks" / "RESULTS.md", "store-scale", section)


def command() -> str:
    return "python benchmarks/store_scale.py " + " ".join(sys.argv[1:])


def machine() -> str:
    return f"{os.cpu_count()} CPU cores, Python {sys.version.split()[0]}, loopback"


def markdown(rows: list[dict], commands: list[str]) -> str:
    spec = next(r for r in rows if r["waits"] != "bare")
    lines = [
        f"#### Run `store-scale` ({time.strftime('%Y-%m-%d')})", "",
        "Commands (later ones measured their rows again): " + ", ".join(f"`{c}`" for c in commands),
        "",
        f"Machine: {machine()}. Graphs {spec['graphs']}, compile {spec['compile_s']} s each, "
        f"lease {spec['lease_s']} s; graph 1's first claimant is killed. Waits \"bare\": the store's own "
        "primitive, one write to every waiter, no protocol (the floor on this machine).", "",
        "| nodes | store | waits | publish → waiter p50 (ms) | p99 (ms) | max (ms) | store calls per waiter per s "
        "| store calls per s | server CPU (s/s) | takeover (s) | timeouts | wrong takeovers "
        "| store memory after (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = ("nodes", "store", "waits", "p50_ms", "p99_ms", "max_ms", "ops_per_waiter_s", "ops_per_s", "server_cpu",
            "takeover_s", "timeouts", "wrong_takeovers", "store_mem_mb")
    for r in rows:
        lines.append("| " + " | ".join("–" if r[k] is None else str(r[k]) for k in keys) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("p99_ms", "publish → waiter p99 (ms)"), ("ops_per_waiter_s", "store calls per waiter per s"),
               ("server_cpu", "server CPU (s per s)"), ("takeover_s", "takeover after a killed leader (s)"),
               ("store_mem_mb", "store memory after (MB)"), ("ops_per_s", "store calls per s")]
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    colors = {"c10d": "tab:blue", "redis": "tab:red"}
    for ax, (key, title) in zip(axes.flat, metrics, strict=True):
        for store in ("c10d", "redis"):
            for waits, style in (("bare", ":"), ("polling", "--"), ("signalled", "-")):
                points = [(r["nodes"], r[key]) for r in rows if r["store"] == store and r["waits"] == waits
                          and r[key] is not None]
                if points:
                    ax.plot(*zip(*points, strict=True), style, marker="o", color=colors[store],
                            label=f"{store}, {waits}")
        ax.set_xscale("log")
        ax.set_xlabel("node leaders")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--store", choices=("c10d", "redis"), default="c10d")
    p.add_argument("--waits", choices=("signalled", "polling", "bare"), default="signalled")
    p.add_argument("--graphs", type=int, default=3)
    p.add_argument("--compile-s", type=float, default=2.0)
    p.add_argument("--lease", type=float, default=20.0, help="the library's default")
    p.add_argument("--deadline", type=float, default=120.0)
    p.add_argument("--kill-after-s", type=float, default=3.0, help="when the victim holding graph 1 is killed")
    p.add_argument("--value-bytes", type=int, default=4096)
    p.add_argument("--procs", type=int, default=8, help="worker processes the leaders are spread over")
    p.add_argument("--records", default=None, help="write every lookup's record to this JSON file")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-nodes", type=int, nargs="+", default=[8, 64, 256, 1000])
    p.add_argument("--sweep-stores", nargs="+", choices=("c10d", "redis"), default=["c10d", "redis"])
    p.add_argument("--sweep-waits", nargs="+", choices=("bare", "polling", "signalled"),
                   default=["bare", "polling", "signalled"])
    args = p.parse_args()
    if args.role:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        spec = json.loads(args.role)
        {"worker": worker, "victim": victim, "bare": bare_waiter}[spec["role"]](spec)
        return
    if args.sweep:
        sweep(args)
    else:
        row = run_bare(args.nodes, args.store, args) if args.waits == "bare" else \
            run(args.nodes, args.store, args.waits, args)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
