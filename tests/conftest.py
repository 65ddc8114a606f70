"""Fixtures: real Redis servers, real TCPStores, and jobs of real rank processes."""

from __future__ import annotations

import contextlib
import getpass
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

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
    where this process may not mount one (it needs root, or CAP_SYS_ADMIN)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
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


@pytest.fixture
def tcp_store():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    yield store


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
