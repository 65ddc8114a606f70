"""SLURM prolog/epilog against a real single-node SLURM (munged + slurmctld + slurmd started here).

Job 1 starts cold: the prolog finds no bundle, the 2 tasks compile each graph once
between them (compile_once over their TCPStore) and rank 0 leaves the job's bundle in
the node's outbox; the epilog publishes it to the store and removes the node dir.
Job 2 starts on an empty node dir: the prolog restores the bundle before the tasks
start, and the tasks, plain scripts that never import coordinator, compile nothing.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import machine_env

from coordinator.jobs.slurm import job_settings, parse_comment, read_settings_file
from coordinator.protocol.fingerprint import fingerprint, secret_fingerprint

pytestmark = pytest.mark.protocol

ROOT = Path(__file__).resolve().parent.parent
PLAIN = str(Path(__file__).with_name("plain_script.py"))
SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sinfo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


class SlurmCluster:
    """munged, slurmctld and slurmd for one node, all state under ``root``."""

    def __init__(self, root: Path, prolog: Path, epilog: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        host = socket.gethostname()
        for sub in ("munge", "state", "spool", "log"):
            (root / sub).mkdir(parents=True)
        key = root / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge_socket = root / "munge" / "sock"
        subprocess.run(["munged", f"--socket={self.munge_socket}", f"--key-file={key}",
                        f"--pid-file={root}/munge/pid", f"--log-file={root}/munge/log",
                        f"--seed-file={root}/munge/seed", "--force"], check=True)
        self.conf.write_text(f"""\
ClusterName=coordtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/ctld.pid
SlurmdPidFile={root}/d.pid
SlurmctldLogFile={root}/log/ctld.log
SlurmdLogFile={root}/log/d.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
Prolog={prolog}
Epilog={epilog}
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        subprocess.run(["slurmctld", "-i"], env=self.env, check=True)
        subprocess.run(["slurmd"], env=self.env, check=True)
        wait_for(lambda: "idle" in self.sinfo(), "the node to be idle")

    def sinfo(self) -> str:
        done = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
        return done.stdout

    def stop(self) -> None:
        for pidfile in ("d.pid", "ctld.pid", "munge/pid"):
            try:
                os.kill(int((self.root / pidfile).read_text()), 15)
            except (OSError, ValueError):
                pass


@pytest.fixture
def slurm(tmp_path):
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        pytest.skip(f"SLURM not installed ({', '.join(missing)} missing; tests/run.sh installs slurm-wlm)")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for name in ("prolog.sh", "epilog.sh"):
        shutil.copy(ROOT / "launch" / "slurm" / name, hooks / name)
    cluster = SlurmCluster(tmp_path / "slurm", hooks / "prolog.sh", hooks / "epilog.sh")
    cluster.hooks = hooks
    try:
        yield cluster
    finally:
        cluster.stop()


def site_settings(hooks: Path, **settings: str) -> None:
    env = {"COORDINATOR_PYTHON": sys.executable, **settings}
    (hooks / "coordinator.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))


def epilogs_done(log_file: Path) -> int:
    """Epilogs that have finished: the root hook logs its exit line after the job user's run has ended.

    The node dir alone is no signal: the job user's run removes it before the root hook logs what it printed.
    """
    return log_file.read_text().count("coordinator slurm epilog: job ") if log_file.exists() else 0


def srun_tasks(cluster: SlurmCluster, out: Path, cache_template: str, comment: str, extra_env: dict) -> None:
    """A 2-task job: each task runs plain_script.py as one rank of a gloo job."""
    port = free_port()
    task = (f"export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID "
            f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} "
            f"TORCHINDUCTOR_CACHE_DIR={cache_template.replace('{job}', '$SLURM_JOB_ID')}; "
            f'export COORDINATOR_SAVE_BUNDLE="file://$TORCHINDUCTOR_CACHE_DIR/coordinator-outbox"; '
            f"exec {sys.executable} {PLAIN} {out}")
    env = {**cluster.env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra_env}
    done = subprocess.run(["srun", "-n", "2", f"--comment={comment}", "bash", "-c", task],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr


def test_prolog_restores_before_tasks_start_and_epilog_publishes(slurm, tmp_path):
    store = tmp_path / "store"
    log_file = tmp_path / "hooks.log"
    node = tmp_path / "node"
    node.mkdir()
    cache_template = f"{node}/{{user}}-{{job}}"
    site_settings(slurm.hooks, COORDINATOR_RESTORE_BUNDLE=f"file://{store}", COORDINATOR_PUSH_BUNDLE=f"file://{store}",
                  COORDINATOR_NODE_CACHE_DIR=cache_template, COORDINATOR_SLURM_CLEAN=1,
                  COORDINATOR_SLURM_LOG=log_file)
    cold, warm = tmp_path / "cold", tmp_path / "warm"
    cold.mkdir()
    warm.mkdir()

    # Job 1, cold: compile_once in the tasks (no code change: the sitecustomize), bundle left in the outbox.
    site = str(ROOT / "coordinator" / "_site")
    srun_tasks(slurm, cold, cache_template.replace("{user}", "root"), "coordinator.bundle=mlp",
               {"COORDINATOR_ENABLE": "1", "PYTHONPATH": f"{site}:{ROOT}", "COORDINATOR_BUNDLE_NAME": "mlp"})
    wait_for(lambda: epilogs_done(log_file) == 1, "the first job's epilog to finish")
    assert not any(node.iterdir())
    ranks = [json.loads((cold / f"rank{r}.json").read_text())["inductor"] for r in (0, 1)]
    assert sum(r.get("fxgraph_cache_miss", 0) for r in ranks) == 2  # forward + backward, once
    hook_log = log_file.read_text()
    assert "no bundle to restore yet" in hook_log
    assert "pushed 1 bundle(s)" in hook_log, hook_log
    published = list(store.rglob("mlp"))
    assert len(published) == 1 and "bundles" in str(published[0])

    # Job 2, warm: the prolog restores before the tasks start; plain tasks compile nothing.
    srun_tasks(slurm, warm, cache_template.replace("{user}", "root"), "coordinator.bundle=mlp", {})
    wait_for(lambda: epilogs_done(log_file) == 2, "the second job's epilog to finish")
    assert not any(node.iterdir())
    ranks = [json.loads((warm / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["imported_by_script"] is False and r["backend"] is None
        assert r["inductor"].get("fxgraph_cache_miss", 0) == 0, r
        assert r["inductor"]["fxgraph_cache_hit"] == 2, r
    hook_log = log_file.read_text()
    assert "restored bundle 'mlp'" in hook_log, hook_log
    assert hook_log.count("removed ") == 2


def test_prolog_with_an_unreachable_store_exits_0_and_logs(tmp_path):
    """Invoked as slurmd invokes it (its environment, no PATH): the job must not fail."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    shutil.copy(ROOT / "launch" / "slurm" / "prolog.sh", hooks / "prolog.sh")
    log_file = tmp_path / "hooks.log"
    port = free_port()  # nothing listens here
    site_settings(hooks, COORDINATOR_RESTORE_BUNDLE=f"redis://127.0.0.1:{port}/0", COORDINATOR_SLURM_LOG=log_file,
                  COORDINATOR_NODE_CACHE_DIR=f"{tmp_path}/node/{{user}}", COORDINATOR_SLURM_TIMEOUT=60)
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_GID": str(os.getgid()),
           "SLURM_JOB_USER": "root", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd",
           "SLURM_JOB_COMMENT": "coordinator.bundle=x",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["/bin/sh", str(hooks / "prolog.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    text = log_file.read_text()
    assert "could not restore bundle 'x'" in text and f"127.0.0.1:{port}" in text, text
    assert (tmp_path / "node" / "root").is_dir()


def test_the_documented_settings_restore_what_the_last_job_saved(tmp_path):
    """launch/slurm/README.md's "Jobs" and "Check it works", with no SLURM installed: the hooks
    run as slurmd runs them (its environment, no PATH) around two coordinator-run jobs that set
    only what the guide says, on Inductor's default cache dir (each job's TMPDIR stands for its
    node's /tmp), with a secret."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for name in ("prolog.sh", "epilog.sh"):
        shutil.copy(ROOT / "launch" / "slurm" / name, hooks / name)
    store, log_file = tmp_path / "store", tmp_path / "hooks.log"
    site_settings(hooks, COORDINATOR_RESTORE_BUNDLE=f"file://{store}", COORDINATOR_PUSH_BUNDLE=f"file://{store}",
                  COORDINATOR_SECRET="site-secret-01234567", COORDINATOR_SLURM_LOG=log_file)

    def hook(name: str, job: str, node: Path) -> str:
        env = {"SLURM_JOB_ID": job, "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_GID": str(os.getgid()),
               "SLURM_SCRIPT_CONTEXT": f"{name}_slurmd", "SLURM_JOB_COMMENT": "coordinator.bundle=mlp",
               "PYTHONPATH": str(ROOT), "TMPDIR": str(node)}
        done = subprocess.run(["/bin/sh", str(hooks / f"{name}.sh")], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0
        return log_file.read_text()

    def tasks(launcher: str, node: Path, out: Path, nproc: int, **settings: str) -> list[dict]:
        out.mkdir()
        env = dict(os.environ, **machine_env(node), TORCHINDUCTOR_COMPILE_THREADS="1", **settings)
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the default set-up: Inductor's own default dir
        done = subprocess.run([sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", str(nproc),
                               PLAIN, str(out)], env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads((out / f"rank{rank}.json").read_text())["inductor"] for rank in range(nproc)]

    def coordinator_cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True, text=True,
                              env=dict(os.environ, COORDINATOR_SECRET="site-secret-01234567"), timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert coordinator_cli("bundle", "ls", f"file://{store}") == f"no bundles in file://{store}\n"
    first, second = tmp_path / "node1", tmp_path / "node2"
    first.mkdir()
    second.mkdir()  # each node's /tmp exists before its Prolog runs
    assert "no bundle to restore yet" in hook("prolog", "1", first)
    cold = tasks("coordinator.jobs.launcher", first, tmp_path / "cold", 2, COORDINATOR_BUNDLE_NAME="mlp",
                 COORDINATOR_SAVE_BUNDLE="outbox", COORDINATOR_SECRET="site-secret-01234567")
    assert sum(r.get("fxgraph_cache_miss", 0) for r in cold) == 2
    assert (first / f"torchinductor_{getpass.getuser()}" / "coordinator-outbox").is_dir()
    assert f"pushed 1 bundle(s) to file://{store}" in hook("epilog", "1", first)

    # Check it works: the store lists the bundle, which verifies with the job's secret.
    listed = coordinator_cli("bundle", "ls", f"file://{store}")
    assert listed.startswith(f"bundles/{fingerprint()}/{secret_fingerprint(b'site-secret-01234567')}/_/mlp\t"), listed
    assert json.loads(coordinator_cli("bundle", "inspect", f"file://{store}", "--name", "mlp"))["signature"] == (
        "HMAC-SHA256, verified")
    node_dir = second / f"torchinductor_{getpass.getuser()}"  # Inductor's default dir on that node
    assert f"restored bundle 'mlp' into {node_dir}: " in hook("prolog", "2", second)
    warm = tasks("torch.distributed.run", second, tmp_path / "warm", 2)  # the job again, not even under compile_once
    assert all(r.get("fxgraph_cache_miss", 0) == 0 and r["fxgraph_cache_hit"] == 2 for r in warm), warm


def test_job_settings_precedence_and_safety(tmp_path):
    job_file = tmp_path / "job.env"
    job_file.write_text("export COORDINATOR_BUNDLE_NAME='from-file'\nCOORDINATOR_SECRET=s3-secret-0123456\n"
                        "PATH=/evil\n# note\n")
    job_file.chmod(0o600)
    env = {
        "SLURM_JOB_ID": "42", "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_GID": str(os.getgid()),
        "COORDINATOR_RESTORE_BUNDLE": "redis://site:1/0", "COORDINATOR_BUNDLE_NAME": "site",
        "COORDINATOR_NODE_CACHE_DIR": "/scratch/{user}/{job}",
        "SLURM_JOB_COMMENT": f"nightly coordinator.config={job_file},coordinator.namespace=team-a",
    }
    settings = job_settings(env)
    assert settings.restore_url == "redis://site:1/0"  # site value, not overridden
    assert settings.bundle_name == "from-file" and settings.secret == "s3-secret-0123456"  # job file over site
    assert settings.namespace == "team-a"  # comment over both
    assert settings.cache_dir == f"/scratch/{settings.user}/42"
    assert "PATH" not in read_settings_file(str(job_file))

    env["SLURM_JOB_COMMENT"] = "coordinator.bundle=c coordinator.secret=leak"  # a secret in a comment is refused
    assert parse_comment(env["SLURM_JOB_COMMENT"]) == {"COORDINATOR_BUNDLE_NAME": "c"}
    job_file.chmod(0o666)  # writable by others: ignored
    assert read_settings_file(str(job_file), owner_uid=os.getuid()) == {}
    assert job_settings(dict(env, SLURM_JOB_UID="65534")).uid == 65534
