"""Fixtures: real Redis servers, real TCPStores, object stores' servers (moto, gcp-storage-emulator,
Azurite) and one that never answers, and jobs of real rank processes."""

from __future__ import annotations

import contextlib
import getpass
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from coordinator.protocol.stores.base import TimedStore
from coordinator.testing import free_port, redis_server_binary

WORKER = Path(__file__).with_name("worker.py")

#: Inductor's precompiled C++ header (torch's headers, about 6 s of g++ on a CPU) is kept per
#: machine, content-hashed, in ``<TMPDIR>/torchinductor_<user>/precompiled_headers``. Each rank
#: here has a temp dir of its own, as on separate nodes, and would build it again (even a rank
#: that only loads kernels); they share this one, as the ranks of one machine do.
SHARED_PRECOMPILED_HEADERS = Path(tempfile.gettempdir()) / f"coordinator-tests-precompiled-headers-{os.getuid()}"

#: Inductor's CPU-feature probes (per cache dir: a g++ build and a Python subprocess that
#: loads it, per vector ISA, about 8 s of each cold process here) are skipped: every process
#: picks the ISA from the CPU's flags, the one the probes pick on the machines the suite runs
#: on. Tests that check that a rank runs no compiler at all set it back (``WITH_PROBES``).
SKIP_ISA_PROBES = {"TORCHINDUCTOR_VEC_ISA_OK": "1"}
WITH_PROBES = {"TORCHINDUCTOR_VEC_ISA_OK": ""}


def machine_env(tmpdir: Path) -> dict[str, str]:
    """The environment of a test process with ``TMPDIR=tmpdir``: its precompiled-header dir
    points at the one all the tests' processes share, the ISA probes are skipped, and a
    process killed by a fatal signal prints every thread's Python stack (``faulthandler``)
    into the output a failing test shows."""
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    link = tmpdir / f"torchinductor_{user}" / "precompiled_headers"
    SHARED_PRECOMPILED_HEADERS.mkdir(exist_ok=True)
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(SHARED_PRECOMPILED_HEADERS, target_is_directory=True)
    return {"TMPDIR": str(tmpdir), "PYTHONFAULTHANDLER": "1", **SKIP_ISA_PROBES}


class RedisServer:
    """A redis-server (or valkey-server) process of our own on a free port; ``options`` are
    more of its command-line options (``"--maxmemory", "2mb"``). :meth:`start` starts it
    again on the same port after :meth:`kill` (its keys are gone: it saves nothing)."""

    def __init__(self, workdir: Path, *options: str) -> None:
        self.workdir, self.options = workdir, options
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed; the README's test command installs it")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def small_file_system(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``"8m"``) mounted at ``path`` for the duration; skips the test
    where this process may not mount one (it needs root, or CAP_SYS_ADMIN). CI runs as root;
    tests/run.sh prints every skip's reason (``-rs``)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        said = mounted.stderr.strip() or f"mount exited {mounted.returncode}"
        pytest.skip(f"a full file system needs root (or CAP_SYS_ADMIN) to mount a {size} tmpfs; "
                    f"uid {os.getuid()} could not: {said}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.kill()


class S3Server:
    """moto's standalone S3 server (``python -m moto.server``) on a free port, reached as a job
    reaches S3: fsspec/s3fs over HTTP, the endpoint from ``AWS_ENDPOINT_URL_S3``. With
    ``auth``, it checks credentials (moto's IAM, which knows none: every request is refused)."""

    def __init__(self, workdir: Path, *, auth: bool = False) -> None:
        missing = [name for name in ("moto.server", "flask", "s3fs") if importlib.util.find_spec(name) is None]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not installed: the S3 tests need moto's server and s3fs "
                               "(the test extra; the README's test command installs them)")
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env.pop("INITIAL_NO_AUTH_ACTION_COUNT", None)
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"  # moto checks every request's credentials
        self.log = open(workdir / f"moto-{self.port}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start (see {self.log.name})") from None
                time.sleep(0.1)
        #: What a process needs to reach it: the endpoint, and credentials moto accepts.
        self.env = {
            "AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(workdir / "no-aws-config"), "AWS_SHARED_CREDENTIALS_FILE": str(workdir / "none"),
        }

    def filesystem(self):
        """An s3fs client of this server, for the tests' own checks."""
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint, key="testing", secret="testing",
                                 skip_instance_cache=True, use_listings_cache=False)

    def bucket(self, name: str = "coordinator-tests") -> str:
        """Create bucket ``name``; returns its URL."""
        self.filesystem().call_s3("create_bucket", Bucket=name)
        return f"s3://{name}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def s3_server(tmp_path, monkeypatch):
    """moto's S3 server, with its endpoint and credentials in this process's environment (and
    so in the processes a test starts)."""
    server = S3Server(tmp_path)
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield server
    server.kill()


def start_server(command: list[str], port: int, log: Path, what: str) -> subprocess.Popen:
    """Start a server's ``command`` (its output to ``log``) and wait until it accepts
    connections on ``port``."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{what} did not start (see {log})") from None
            time.sleep(0.1)


class GCSServer:
    """gcp-storage-emulator (a GCS server in Python, of the test extra) on a free port, in
    memory, reached as a job reaches GCS: gcsfs over HTTP, the endpoint from
    ``STORAGE_EMULATOR_HOST``, with no credentials (anonymous)."""

    def __init__(self, workdir: Path) -> None:
        missing = [name for name in ("gcp_storage_emulator", "gcsfs") if importlib.util.find_spec(name) is None]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not installed: the GCS tests need gcp-storage-emulator and "
                               "gcsfs (the test extra; the README's test command installs them)")
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = start_server([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                                  "--port", str(self.port), "--in-memory"],
                                 self.port, workdir / f"gcs-{self.port}.log", "gcp-storage-emulator")
        #: What a process needs to reach it (no metadata server is asked for credentials).
        self.env = {"STORAGE_EMULATOR_HOST": self.endpoint, "NO_GCE_CHECK": "true"}

    def bucket(self, name: str = "coordinator-tests") -> str:
        """Create bucket ``name``; returns its URL."""
        from gcsfs.core import GCSFileSystem

        GCSFileSystem(endpoint_url=self.endpoint, token="anon", skip_instance_cache=True).mkdir(name)
        return f"gs://{name}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


#: Azurite's development account (its documented, well-known name and key).
AZURITE_ACCOUNT = ("devstoreaccount1",
                   "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==")


def azure_connection_string(endpoint: str) -> str:
    """A connection string to Azurite's development account at ``endpoint`` (``http://host:port``)."""
    name, key = AZURITE_ACCOUNT
    return (f"DefaultEndpointsProtocol=http;AccountName={name};AccountKey={key};"
            f"BlobEndpoint={endpoint}/{name};")


class AzureServer:
    """Azurite's Blob service (npm's azurite, a Node.js server) on a free port, in memory,
    reached as a job reaches Azure Blob Storage: adlfs over HTTP, the account from
    ``AZURE_STORAGE_CONNECTION_STRING``."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("azurite-blob")
        if binary is None or importlib.util.find_spec("adlfs") is None:
            raise RuntimeError("the Azure tests need Azurite (npm install -g azurite) and adlfs (the test extra); "
                               "the README's test command installs them")
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # --skipApiVersionCheck: the Python client may speak a newer API version than Azurite knows.
        self.proc = start_server([binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
                                  "--inMemoryPersistence", "--skipApiVersionCheck", "--disableTelemetry", "--silent"],
                                 self.port, workdir / f"azurite-{self.port}.log", "Azurite")
        #: What a process needs to reach it.
        self.env = {"AZURE_STORAGE_CONNECTION_STRING": azure_connection_string(self.endpoint)}

    def bucket(self, name: str = "coordinator-tests") -> str:
        """Create container ``name``; returns its URL."""
        from azure.storage.blob import BlobServiceClient

        BlobServiceClient.from_connection_string(self.env["AZURE_STORAGE_CONNECTION_STRING"]).create_container(name)
        return f"az://{name}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def gcs_server(tmp_path, monkeypatch):
    """gcp-storage-emulator, with its endpoint in this process's environment."""
    server = GCSServer(tmp_path)
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    yield server
    server.kill()


@pytest.fixture
def azure_server(tmp_path, monkeypatch):
    """Azurite's Blob service, with its connection string in this process's environment."""
    server = AzureServer(tmp_path)
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    for name in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    yield server
    server.kill()


class Listener:
    """A TCP listener on a free port of 127.0.0.1 whose thread hands each connection it
    accepts to :meth:`accepted`, until :meth:`stop_listening`."""

    def __init__(self, backlog: int | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=backlog)
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:  # until the listener closes
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.accepted(client)

    def accepted(self, client: socket.socket) -> None:
        raise NotImplementedError

    def stop_listening(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (Linux)
        except OSError:
            pass
        self.listener.close()


class SilentServer(Listener):
    """A server that accepts connections and never answers: a provider that hangs, or a
    machine whose kernel still accepts while its server does nothing. ``connections`` counts
    the connections it accepted (a client's tries)."""

    def __init__(self) -> None:
        self._held: list[socket.socket] = []
        super().__init__(backlog=128)

    @property
    def connections(self) -> int:
        return len(self._held)

    def accepted(self, client: socket.socket) -> None:
        self._held.append(client)

    def close(self) -> None:
        self.stop_listening()
        for sock in self._held:
            sock.close()


@pytest.fixture
def silent_server():
    server = SilentServer()
    yield server
    server.close()


class Link(Listener):
    """A TCP relay to a server, standing for the network path to it: it records the request
    line of each connection and can be cut (every connection closed, new ones refused), after
    ``cut_after`` bytes sent to the server, or instead of sending the first data that
    ``cut_when`` accepts; ``rate`` bounds the bytes per second each connection sends."""

    def __init__(self, server_port: int, *, cut_after: int | None = None, rate: float | None = None,
                 at_cut: Callable[[], None] | None = None,
                 cut_when: Callable[[bytes], bool] | None = None) -> None:
        self.server_port, self.cut_after, self.rate = server_port, cut_after, rate
        self.cut_when = cut_when
        #: What happens at the cut: the link is cut (default), or this is called.
        self.at_cut = at_cut or self.close
        self.sent = 0
        self.requests: list[str] = []
        self.cut = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        super().__init__()

    def accepted(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(("127.0.0.1", self.server_port))
        except OSError:  # the server is gone: so is this connection
            client.close()
            return
        with self._lock:
            self._sockets += [client, server]
        threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, to_server: bool) -> None:
        first = to_server
        try:
            while True:
                data = source.recv(64 * 1024)
                if not data:
                    break
                if first:
                    self.requests.append(data.split(b"\r\n", 1)[0].decode(errors="replace"))
                    first = False
                if to_server and self.rate:
                    time.sleep(len(data) / self.rate)
                if to_server and self.cut_when is not None and self._cut_here(data):
                    return
                sink.sendall(data)
                if to_server:
                    with self._lock:
                        self.sent += len(data)
                        cut = self.cut_after is not None and self.sent >= self.cut_after and not self.cut.is_set()
                    if cut:
                        self.cut.set()
                        self.at_cut()
                        return
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _cut_here(self, data: bytes) -> bool:
        """Whether ``data`` is where the link is cut (then it is not sent)."""
        with self._lock:
            cut = not self.cut.is_set() and self.cut_when(data)
            if cut:
                self.cut.set()
        if cut:
            self.at_cut()
        return cut

    def close(self) -> None:
        """Cut the link: close every connection and refuse new ones."""
        self.cut.set()
        self.stop_listening()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


@pytest.fixture
def tcp_store():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    yield store


class WaitSeen(TimedStore):
    """A store that sets ``waiting`` when a wait on a claim made through it waits for the
    claimant's next signal (a ``w/`` key): the wait has read the store, and a publish or an
    abandon from then on ends it. Tests wait for it instead of sleeping a fixed time."""

    def __init__(self, inner, record=lambda seconds: None) -> None:
        super().__init__(inner, record)
        self.waiting = threading.Event()

    def get(self, key: str) -> bytes | None:
        if key.startswith("w/"):  # a polling wait
            self.waiting.set()
        return super().get(key)

    @contextlib.contextmanager
    def watch(self, prefix: str):
        with super().watch(prefix) as watch:
            wait = watch.wait

            def waiting(key: str, timeout_s: float) -> bytes | None:
                self.waiting.set()
                return wait(key, timeout_s)

            watch.wait = waiting
            yield watch


@dataclass
class RankResult:
    rank: int
    returncode: int
    log: str
    report: dict | None

    @property
    def fx_misses(self) -> int:
        return self.report["inductor"].get("fxgraph_cache_miss", 0)

    @property
    def fx_hits(self) -> int:
        return self.report["inductor"].get("fxgraph_cache_hit", 0)


def run_job(workdir: Path, world_size: int, options: dict, *, env: dict | None = None, name: str = "job",
            timeout: float = 240, rank_options: dict[int, dict] | None = None,
            cache_dirs: dict[int, Path] | None = None, worker: Path | None = None) -> list[RankResult]:
    """Start ``world_size`` worker processes (``worker``: tests/worker.py unless given) as
    torchrun would and collect their reports.

    Each rank gets its own empty Inductor cache dir (or the one ``cache_dirs`` names)
    and temp dir, like ranks on separate nodes. ``rank_options`` adds options per rank.
    """
    port = free_port()
    jobdir = workdir / name
    jobdir.mkdir(parents=True)
    procs = []
    for rank in range(world_size):
        rankdir = jobdir / f"rank{rank}"
        (rankdir / "tmp").mkdir(parents=True)
        this_rank_options = dict(options, **(rank_options or {}).get(rank, {}),
                                 out=str(rankdir / "report.json"), marker=str(workdir / "first-compiler"))
        cache_dir = (cache_dirs or {}).get(rank, rankdir / "inductor")
        rank_env = dict(
            os.environ,
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            TORCHINDUCTOR_CACHE_DIR=str(cache_dir), **machine_env(rankdir / "tmp"),
            TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONUNBUFFERED="1",
        )
        rank_env.update(env or {})
        log = open(rankdir / "log", "w")
        procs.append((rank, rankdir, log, subprocess.Popen(
            [sys.executable, str(worker or WORKER), json.dumps(this_rank_options)], env=rank_env, stdout=log,
            stderr=subprocess.STDOUT,
        )))
    results = []
    deadline = time.monotonic() + timeout
    for rank, rankdir, log, proc in procs:
        try:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        report_path = rankdir / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        results.append(RankResult(rank, proc.returncode, (rankdir / "log").read_text(), report))
    return results


def require_success(results: list[RankResult]) -> None:
    for r in results:
        assert r.returncode == 0 and r.report is not None, f"rank {r.rank} failed ({r.returncode}):\n{r.log[-4000:]}"


@pytest.fixture
def job(tmp_path):
    counter = iter(range(100))

    def start(world_size: int, options: dict, **kwargs) -> list[RankResult]:
        kwargs.setdefault("name", f"job{next(counter)}")
        return run_job(tmp_path, world_size, options, **kwargs)

    return start
