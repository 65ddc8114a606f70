"""No password of a store URL in any output: errors, log lines, command output, traces, reports.

A store URL may carry a password (``redis://:PASSWORD@host:port/db``, redis-py's
``?password=``, an Azure SAS token's ``sig=``). Every message names a store as
``coordinator.protocol.stores.shown_url`` shows it, with ``***`` in the password's place.
Each test gives a distinctive password to one way in (the settings, ``coordinator-run``,
``compile_once``, the ``coordinator`` command, the SLURM hooks), reads everything that way
out writes (stdout, stderr, log records, exception text, trace and report files), checks
that it says what it should (so that silence cannot pass) and that the password is nowhere
in it. A store that must answer is a real redis-server with ``requirepass``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RedisServer, machine_env, require_success, run_job

import coordinator
from coordinator import Config, ConfigError
from coordinator.bundles.format import build_bundle
from coordinator.cli import main
from coordinator.protocol.stores import shown_url
from coordinator.settings import JobSettings
from coordinator.testing import free_port

pytestmark = pytest.mark.protocol

PASSWORD = "pw-Secr3t-71"
ROOT = Path(__file__).resolve().parent.parent
PLAIN = str(Path(__file__).with_name("plain_script.py"))
#: A URL whose port is not a number: refused by the settings, before any connection.
BAD = f"redis://:{PASSWORD}@127.0.0.1:port/0"
BAD_SHOWN = "redis://:***@127.0.0.1:port/0"


def url(port: int, db: int = 0, password: str = PASSWORD) -> str:
    return f"redis://:{password}@127.0.0.1:{port}/{db}"


def shown(port: int, db: int = 0) -> str:
    return f"redis://:***@127.0.0.1:{port}/{db}"


def no_password(text: str) -> None:
    assert PASSWORD not in text, text


def files_text(folder: Path) -> str:
    """Every file below ``folder``, as text."""
    return "".join(path.read_text(errors="replace") for path in sorted(folder.rglob("*")) if path.is_file())


@pytest.fixture
def locked_redis(tmp_path):
    """A redis-server that answers only to ``PASSWORD``."""
    server = RedisServer(tmp_path / "redis", "--requirepass", PASSWORD)
    yield server
    server.kill()


@pytest.mark.parametrize("given, expected", [
    (f"redis://:{PASSWORD}@cache:6379/0", "redis://:***@cache:6379/0"),
    (f"rediss://user:{PASSWORD}@cache:6380/1", "rediss://user:***@cache:6380/1"),
    (f"redis://{PASSWORD}@cache:6379/0", "redis://***@cache:6379/0"),  # a user alone may be a token
    (f"redis://:{PASSWORD}@cache:port/0", "redis://:***@cache:port/0"),  # .port raises
    (f"redis://:{PASSWORD}@[::1", "redis://:***@[::1"),  # urlparse raises
    (f"redis://:ab/{PASSWORD}@cache:6379/0", "redis://:***@cache:6379/0"),  # "/" ends urlparse's host part
    (f"redis://:ab?{PASSWORD}@cache/0", "redis://:***@cache/0"),
    (f"rediss://cache:6380/0?db=1&password={PASSWORD}", "rediss://cache:6380/0?db=1&password=***"),
    (f"az://container/prefix?sv=2022-11-02&sig={PASSWORD}&se=2030", "az://container/prefix?sv=2022-11-02&sig=***&se=2030"),
    (f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={PASSWORD};EndpointSuffix=core.windows.net",
     "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=***;EndpointSuffix=core.windows.net"),
    ("redis://cache:6379/0", "redis://cache:6379/0"),
    ("redis://[::1]:6379/0?db=3", "redis://[::1]:6379/0?db=3"),
    ("file:///shared/bundles", "file:///shared/bundles"),
    ("s3://bucket/pre@fix", "s3://bucket/pre@fix"),
    ("outbox", "outbox"),
])
def test_shown_url_masks_every_place_a_password_can_be_written(given, expected):
    assert shown_url(given) == expected


@pytest.mark.parametrize("make, expected", [
    (lambda: Config(store=BAD), f"store='{BAD_SHOWN}': redis store URL '{BAD_SHOWN}': the port"),
    (lambda: Config(persist=BAD), f"persist='{BAD_SHOWN}': redis store URL '{BAD_SHOWN}': the port"),
    (lambda: Config.resolve(environ={"COORDINATOR_STORE": BAD}),
     f"COORDINATOR_STORE='{BAD_SHOWN}': redis store URL '{BAD_SHOWN}': the port"),
    (lambda: Config.resolve(environ={"COORDINATOR_PERSIST": BAD}),
     f"COORDINATOR_PERSIST='{BAD_SHOWN}': redis store URL '{BAD_SHOWN}': the port"),
    (lambda: Config.resolve(environ={"COORDINATOR_STORE": BAD}, sources={"COORDINATOR_STORE": "--coordinator-store"}),
     f"--coordinator-store '{BAD_SHOWN}': redis store URL"),
    (lambda: JobSettings.resolve({"COORDINATOR_RESTORE_BUNDLE": BAD}).check_bundles(),
     f"COORDINATOR_RESTORE_BUNDLE='{BAD_SHOWN}': redis store URL '{BAD_SHOWN}': the port"),
    (lambda: Config(persist=f"rediss://cache:6380/x?password={PASSWORD}"),
     "persist='rediss://cache:6380/x?password=***': redis store URL 'rediss://cache:6380/x?password=***': "
     "the database"),
    (lambda: Config(persist=f"az://user:{PASSWORD}@container/prefix"),
     "persist='az://user:***@container/prefix': object store URL 'az://user:***@container/prefix' holds credentials"),
    (lambda: Config(store=f"cache:{PASSWORD}@host"), "store='cache:***@host': store 'cache:***@host' is not a URL"),
])
def test_a_settings_error_names_the_url_without_its_password(make, expected):
    with pytest.raises(ConfigError) as refused:
        make()
    assert str(refused.value).startswith(expected), str(refused.value)
    no_password(str(refused.value))


def test_compile_once_with_other_settings_names_both_stores_without_their_passwords():
    with coordinator.compile_once(url(free_port())):  # nothing is compiled: the store is never opened
        with pytest.raises(ConfigError) as refused:
            with coordinator.compile_once(url(free_port(), password="other-" + PASSWORD)):
                pass
    message = str(refused.value)
    assert "store (COORDINATOR_STORE): active 'redis://:***@127.0.0.1:" in message, message
    no_password(message)


def test_bundle_commands_name_the_store_without_its_password(tmp_path, locked_redis, capfd, caplog, monkeypatch):
    """Every ``coordinator bundle`` action on a store that answers, one that is down, one that
    refuses the password and a URL that cannot name a store."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    caplog.set_level(logging.DEBUG)
    port = locked_redis.port
    store, local, down = url(port), f"file://{tmp_path / 'local'}", url(free_port())
    file = tmp_path / "b.bundle"
    file.write_bytes(build_bundle({"megacache": b"x" * 100}, compile_time_s=1.0))
    query = f"redis://127.0.0.1:{port}/0?password={PASSWORD}"
    cases = [
        (["bundle", "ls", store], 0, f"no bundles in {shown(port)}"),
        (["bundle", "save", store, str(file), "--name", "nightly"], 0, f"as 'nightly' in {shown(port)}"),
        (["bundle", "load", store, "--name", "nightly", "--out", str(tmp_path / "out.bundle")], 0,
         f"verified bytes from {shown(port)} to"),
        (["bundle", "load", store, "--name", "absent"], 1, "no bundle 'absent' for environment"),
        (["bundle", "inspect", store, "--name", "absent"], 1, f" in {shown(port)}\n"),
        (["bundle", "rm", store, "nightly"], 0, f"from {shown(port)}"),
        (["bundle", "rm", store, "--older-than", "1"], 0, f"s in {shown(port)}"),
        (["bundle", "save", local, str(file), "--name", "copied"], 0, "as 'copied' in file://"),
        (["bundle", "copy", local, store], 0, f"to {shown(port)}"),
        (["bundle", "ls", query], 0, "bundles/"),
        (["bundle", "ls", down], 1, "redis SCAN failed on redis 127.0.0.1:"),
        (["bundle", "ls", url(port, password=PASSWORD + "-old")], 1, "redis SCAN failed on redis 127.0.0.1:"),
        (["bundle", "ls", BAD], 1, f"redis store URL '{BAD_SHOWN}': the port"),
        (["bundle", "copy", BAD, local], 1, f"redis store URL '{BAD_SHOWN}': the port"),
    ]
    for argv, status, expected in cases:
        caplog.clear()
        done = main(argv)
        out, err = capfd.readouterr()
        everything = out + err + caplog.text
        assert done == status and expected in everything, (argv, done, everything)
        no_password(everything)


def run_hook(hook: str, node: Path, **settings: str) -> subprocess.Popen:
    """``coordinator slurm <hook>`` as slurmd's hook script runs it, for a job of this user."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
           "SLURM_JOB_ID": "71", "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_GID": str(os.getgid()),
           "SLURM_JOB_COMMENT": "coordinator.bundle=x", "COORDINATOR_NODE_CACHE_DIR": str(node),
           "COORDINATOR_SLURM_TIMEOUT": "120", **machine_env(node.parent), **settings}
    return subprocess.Popen([sys.executable, "-m", "coordinator.cli", "slurm", hook], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_slurm_hooks_name_the_store_without_its_password(tmp_path, locked_redis):
    """The Prolog with a store that is down, the Epilog with a URL that cannot name a store and
    with one that takes the job's bundle."""
    down = free_port()
    nodes = {name: tmp_path / name / "node" for name in ("prolog", "refused", "pushed")}
    for node in nodes.values():
        node.parent.mkdir()
    coordinator.save_bundle(f"file://{nodes['pushed']}/coordinator-outbox", name="x", config=Config(),
                            blob=build_bundle({"megacache": b"x" * 100}, compile_time_s=1.0))
    (nodes["refused"] / "coordinator-outbox").mkdir(parents=True)
    hooks = [
        (run_hook("prolog", nodes["prolog"], COORDINATOR_RESTORE_BUNDLE=url(down)),
         f"could not restore bundle 'x' from {shown(down)}: "),
        (run_hook("epilog", nodes["refused"], COORDINATOR_PUSH_BUNDLE=BAD),
         f"could not push bundles to {BAD_SHOWN}: ConfigError: redis store URL '{BAD_SHOWN}'"),
        (run_hook("epilog", nodes["pushed"], COORDINATOR_PUSH_BUNDLE=url(locked_redis.port)),
         f"pushed 1 bundle(s) to {shown(locked_redis.port)}: "),
    ]
    for proc, expected in hooks:
        output, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0 and expected in output, output
        no_password(output)


def test_coordinator_run_refuses_a_bad_url_without_its_password(tmp_path):
    for args, env, expected in [
        (["--coordinator-persist", BAD], {}, f"coordinator-run: --coordinator-persist '{BAD_SHOWN}': redis store URL"),
        (["--coordinator-restore", BAD], {}, f"coordinator-run: --coordinator-restore '{BAD_SHOWN}': redis store URL"),
        ([], {"COORDINATOR_STORE": BAD}, f"coordinator-run: COORDINATOR_STORE='{BAD_SHOWN}': redis store URL"),
    ]:
        done = subprocess.run([sys.executable, "-m", "coordinator.jobs.launcher", *args, "--standalone",
                               "--nproc-per-node", "1", PLAIN, str(tmp_path / "out")],
                              env=dict(os.environ, **machine_env(tmp_path), **env), capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 1 and expected in done.stderr, done.stderr
        no_password(done.stdout + done.stderr)


def test_a_job_names_its_stores_without_their_passwords(tmp_path, locked_redis, capfd):
    """``coordinator-run`` with a live store and a persistent layer that answer, and a bundle to
    restore and to save in a store that is down: what it restored, what the layer holds and
    wrote at exit, the save that failed; then ``coordinator report`` of its trace."""
    port, down = locked_redis.port, free_port()
    out, trace = tmp_path / "out", tmp_path / "trace"
    out.mkdir()
    env = dict(os.environ, **machine_env(tmp_path), TORCHINDUCTOR_COMPILE_THREADS="1",
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.jobs.launcher", "--coordinator-store", url(port),
         "--coordinator-persist", url(port, 1), "--coordinator-restore", url(down), "--coordinator-save-bundle",
         url(down), "--coordinator-trace", str(trace), "--coordinator-log-level", "DEBUG",
         "--standalone", "--nproc-per-node", "1", PLAIN, str(out)],
        env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for expected in (f"could not restore bundle 'default' from {shown(down)}: ",
                     f"persistent layer redis 127.0.0.1:{port}/1 holds 0 values",
                     f"to the persistent layer {shown(port, 1)}; ",
                     f"could not save the job's bundle to {shown(down)}: "):
        assert expected in output, (expected, output[-4000:])
    no_password(output)
    assert main(["report", str(trace), "--no-picture"]) == 0
    report, _ = capfd.readouterr()
    assert "rank" in report and (trace / "job.trace.json").exists(), report
    no_password(report + files_text(trace) + files_text(out))


def test_compile_once_with_stores_that_are_down_names_them_without_their_passwords(tmp_path):
    """A rank whose live store (an argument) and persistent layer (a variable) are down: it
    compiles alone and says so, in its log and its trace."""
    down = free_port()
    trace = tmp_path / "trace"
    results = run_job(tmp_path, 1, {"store": url(down), "steps": 1},
                      env={"COORDINATOR_PERSIST": url(down, 1), "COORDINATOR_TRACE": str(trace)})
    require_success(results)
    log = results[0].log
    for expected in (f"coordinator store redis 127.0.0.1:{down}/0 failed",
                     f"persistent layer {shown(down, 1)} failed, going on without it"):
        assert expected in log, (expected, log[-4000:])
    traced = files_text(trace)
    assert "store lost" in traced and "persistent layer lost" in traced, traced[-2000:]
    no_password(log + traced + (tmp_path / "job" / "rank0" / "report.json").read_text())
