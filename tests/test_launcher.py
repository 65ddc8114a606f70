"""coordinator-run: a torchrun drop-in that switches compile_once on with no code change."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import machine_env
from torch.distributed.run import get_args_parser

from coordinator.jobs.launcher import (
    OPTIONS,
    asks_for_help,
    job_secret,
    one_gpu_per_worker,
    split_args,
    with_virtual_local_rank,
    worker_environment,
    workers_per_node,
)

PLAIN = str(Path(__file__).with_name("plain_script.py"))
SIGNED = str(Path(__file__).with_name("signed_store_job.py"))


def every_torchrun_flag() -> list[str]:
    """One use of every optional flag torchrun's parser knows, with a value it accepts."""
    argv = []
    for action in get_args_parser()._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        if "--print-completion" in action.option_strings:  # torchrun prints it and exits: no job
            continue
        flag = action.option_strings[-1]  # the underscore spelling where there are two
        if action.nargs == 0:
            argv.append(flag)
        elif action.choices:
            argv += [flag, str(list(action.choices)[0])]
        else:
            argv += [flag, "1"]
    return argv


def test_every_torchrun_flag_passes_through():
    flags = every_torchrun_flag()
    assert len(flags) > 40
    ours = ["--coordinator-store", "redis://h:1/0", "--coordinator-restore=file:///b"]
    script = ["train.py", "--lr", "3", "--coordinator-store", "belongs-to-the-script"]
    settings, rest = split_args(ours[:2] + flags + ours[2:] + script)
    assert settings == {"COORDINATOR_STORE": "redis://h:1/0", "COORDINATOR_RESTORE_BUNDLE": "file:///b"}
    assert rest == flags + script
    parser = get_args_parser()
    assert vars(parser.parse_args(rest)) == vars(parser.parse_args(flags + script))
    assert parser.parse_args(rest).training_script_args == script[1:]


def test_an_option_that_prints_and_exits_is_passed_through_not_acted_on(capsys):
    settings, rest = split_args(["--print-completion", "bash", "train.py", "--coordinator-store", "x"])
    assert settings == {} and rest == ["--print-completion", "bash", "train.py", "--coordinator-store", "x"]
    assert capsys.readouterr().out == ""


def test_unknown_coordinator_option_is_an_error():
    with pytest.raises(SystemExit, match="unknown option --coordinator-stor"):
        split_args(["--coordinator-stor", "x", "train.py"])


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["--standalone", "--nproc-per-node", "2", "--help"]])
def test_help_shows_our_options_and_variables_once_then_torchruns_help_once(tmp_path, args):
    from coordinator.settings import _ENV

    result = run(["coordinator.jobs.launcher"], args, tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    ours, _, theirs = result.stdout.partition("torchrun's help:")
    lines = ours.splitlines()
    for flag, variable in OPTIONS.items():
        assert ours.count(flag + " ") == 1, flag
        at = next(i for i, line in enumerate(lines) if flag + " " in line)
        assert lines[at].split()[-1] == variable and lines[at + 1].strip(), lines[at:at + 2]  # variable, meaning
    for variable in set(_ENV.values()) | set(OPTIONS.values()):
        assert ours.count(variable + "\n") == 1, variable  # each named once, its meaning on the next line
    assert theirs.count("Torch Distributed Elastic Training Launcher") == 1
    assert ours.count("usage: ") == 1 and theirs.count("usage: ") == 1  # ours, then torchrun's, once each
    # After the training script, --help is the script's.
    assert not asks_for_help(["--standalone", "train.py", "--help"]) and asks_for_help(["-h", "train.py"])


def test_worker_environment(tmp_path):
    env = worker_environment({"COORDINATOR_STORE": "file:///s"}, {"PYTHONPATH": "/mine"})
    assert env["COORDINATOR_ENABLE"] == "1" and env["COORDINATOR_STORE"] == "file:///s"
    assert env["PYTHONPATH"].endswith(os.pathsep + "/mine") and env["PYTHONPATH"].split(os.pathsep)[0].endswith("_site")
    # Nothing else: Inductor's and Triton's dirs stay the user's (a node's workers share Inductor's default).
    assert set(env) == {"COORDINATOR_ENABLE", "COORDINATOR_STORE", "PYTHONPATH"}
    assert set(worker_environment({}, {})) == {"COORDINATOR_ENABLE", "PYTHONPATH"}
    # The virtual local rank is torchrun's own flag, as a user would give it (no variable the script sees).
    args = ["--standalone", "--nproc-per-node", "2", "train.py", "--lr", "1"]
    assert with_virtual_local_rank(args, {}) == ["--virtual-local-rank", *args]
    mine = ["--virtual-local-rank", "--standalone", "train.py"]
    assert with_virtual_local_rank(mine, {}) == mine
    assert with_virtual_local_rank(args, {"PET_VIRTUAL_LOCAL_RANK": "0"}) == args  # the user's choice stands
    after_script = ["--standalone", "train.py", "--virtual-local-rank"]  # the script's own argument
    assert with_virtual_local_rank(after_script, {}) == ["--virtual-local-rank", *after_script]


def test_virtual_local_rank_only_when_every_worker_has_a_gpu():
    """torchrun's virtual local rank gives worker i only GPU i: with more workers than GPUs
    (ranks sharing one GPU over gloo) some workers would see none."""
    assert workers_per_node(["--standalone", "--nproc-per-node", "4", "train.py"]) == "4"
    assert workers_per_node(["--nproc_per_node=gpu", "train.py"]) == "gpu"
    assert workers_per_node(["train.py"]) == "1"
    assert one_gpu_per_worker("2", gpus=2) and one_gpu_per_worker("gpu", gpus=8) and one_gpu_per_worker("1", gpus=1)
    assert not one_gpu_per_worker("4", gpus=1) and not one_gpu_per_worker("2", gpus=0)
    assert not one_gpu_per_worker("cpu", gpus=2)


def run(launcher: list[str], args: list[str], tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **machine_env(tmp_path), TORCHINDUCTOR_COMPILE_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", *launcher, *args], env=full_env, capture_output=True, text=True,
                          timeout=240)


def test_ranks_on_different_device_indices_are_told_the_exact_launch_flag(monkeypatch, caplog, tcp_store):
    """A plain ``torchrun --nproc-per-node N`` on N GPUs puts rank 1 on cuda:1: it shares nothing
    with rank 0, and the warning names the flags that fix it."""
    import torch

    from coordinator.protocol.devices import DeviceIndices
    from coordinator.protocol.stores.c10d import C10dStore

    store = C10dStore(tcp_store)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    DeviceIndices(store, "p", "job", rank=0).publish()  # rank 0 compiles for cuda:0
    assert "compile_once" not in caplog.text
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    rank1 = DeviceIndices(store, "p", "job", rank=1)
    rank1.publish()
    assert store.get(rank1.key(1)) == b"1"
    assert ("this rank compiles for cuda:1 and rank 0 for cuda:0. Inductor's keys carry the device index, "
            "so only ranks on the same index share compiles. Give every worker its GPU as cuda:0: launch with "
            "`torchrun --virtual-local-rank` (and your other torchrun flags), or with `coordinator-run`, which sets "
            "it.") in caplog.text


@pytest.mark.protocol
def test_exit_code_matches_torchrun(tmp_path):
    args = ["--standalone", "--nproc-per-node", "2", PLAIN, str(tmp_path), "--fail", "3"]
    ours = run(["coordinator.jobs.launcher"], args, tmp_path)
    theirs = run(["torch.distributed.run"], args, tmp_path)
    assert ours.returncode == theirs.returncode != 0
    assert "exitcode  : 3" in ours.stderr


def test_script_without_coordinator_compiles_each_graph_once(tmp_path):
    out = tmp_path / "reports"
    out.mkdir()
    store = f"file://{tmp_path / 'store'}"
    result = run(["coordinator.jobs.launcher"], ["--coordinator-store", store, "--standalone", "--nproc-per-node", "3",
                                            PLAIN, str(out)], tmp_path,
                 env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "node-cache")})
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    assert all(r["backend"] == "CoordinatorFxGraphBackend" for r in reports)
    assert [r["local_rank"] for r in reports] == ["0", "1", "2"]  # no GPUs: no virtual local rank
    misses = sum(r["inductor"].get("fxgraph_cache_miss", 0) for r in reports)
    assert misses == 2, [r["inductor"] for r in reports]
    # The script configures no logging: each worker still shows its summary line, once.
    for rank in range(3):
        assert result.stderr.count(f"[rank{rank}]:coordinator: compile_once rank {rank}: ") == 1, result.stderr[-3000:]


@pytest.mark.protocol
def test_processes_a_worker_starts_do_not_enter_compile_once(tmp_path):
    """Inductor starts Python processes (compile workers, a CPU-feature probe each): they
    must not import torch and the coordinator at their start, as the worker itself does."""
    out = tmp_path / "reports"
    out.mkdir()
    result = run(["coordinator.jobs.launcher"], ["--coordinator-log-level", "WARNING", "--standalone",
                                            "--nproc-per-node", "1", PLAIN, str(out)], tmp_path,
                 env={"PYTHONPATH": "/users/own/path"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "rank0.json").read_text())
    assert report["backend"] == "CoordinatorFxGraphBackend"  # the worker itself runs under compile_once
    assert report["child"] == {"modules": [], "enable": None, "pythonpath": "/users/own/path"}
    assert "compile_once rank 0" not in result.stderr  # --coordinator-log-level WARNING hides the INFO summary


def test_bad_log_level_fails_before_any_worker_starts(tmp_path):
    out = tmp_path / "reports"
    out.mkdir()
    result = run(["coordinator.jobs.launcher"], ["--coordinator-log-level", "LOUD", "--standalone", "--nproc-per-node",
                                            "1", PLAIN, str(out)], tmp_path)
    assert result.returncode != 0
    assert "--coordinator-log-level LOUD: expected one of DEBUG, INFO, WARNING, ERROR" in result.stderr
    assert not list(out.iterdir())


@pytest.mark.parametrize("args, env, message", [
    (["--coordinator-store", "bogus://x"], {}, "--coordinator-store bogus://x: unknown store URL scheme 'bogus'"),
    (["--coordinator-store", "redis://127.0.0.1:abc/0"], {},
     "--coordinator-store redis://127.0.0.1:abc/0: redis store URL 'redis://127.0.0.1:abc/0': the port is not a "
     "whole number from 1 to 65535"),
    ([], {"COORDINATOR_STORE": "redis://cache:6379/db0"}, "COORDINATOR_STORE=redis://cache:6379/db0: redis store URL"),
    ([], {"COORDINATOR_STORE": "file://host/dir"}, "COORDINATOR_STORE=file://host/dir: file store URL"),
    ([], {"COORDINATOR_LEASE_S": "soon"}, "COORDINATOR_LEASE_S=soon: not a number of seconds"),
    ([], {"COORDINATOR_LEASE_S": "-3"}, "COORDINATOR_LEASE_S=-3: must be a positive number of seconds"),
    (["--coordinator-save-bundle", "ftp://bucket"], {}, "--coordinator-save-bundle ftp://bucket: unknown store URL"),
    (["--coordinator-store", "s3://bucket/p"], {}, "--coordinator-store s3://bucket/p: an object store keeps bundles"),
    ([], {"COORDINATOR_BUNDLE_NAME": "my model"}, "COORDINATOR_BUNDLE_NAME='my model': bundle name"),
])
def test_invalid_settings_fail_before_any_worker_starts(tmp_path, args, env, message):
    out = tmp_path / "reports"
    out.mkdir()
    result = run(["coordinator.jobs.launcher"], [*args, "--standalone", "--nproc-per-node", "1", PLAIN, str(out)],
                 tmp_path, env=env)
    assert result.returncode == 1
    assert f"coordinator-run: {message}" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not list(out.iterdir())


@pytest.mark.protocol
def test_save_bundle_at_exit_then_restore_once_per_node(tmp_path):
    """Job 1 saves its bundle at exit; job 2, on an empty node cache dir, restores it and compiles nothing."""
    bundles = f"file://{tmp_path / 'bundles'}"
    for job, flag in (("cold", "--coordinator-save-bundle"), ("warm", "--coordinator-restore")):
        out = tmp_path / job
        out.mkdir()
        result = run(["coordinator.jobs.launcher"], [flag, bundles, "--coordinator-bundle-name", "mlp", "--standalone",
                                                "--nproc-per-node", "2", PLAIN, str(out)], tmp_path,
                     env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"node-cache-{job}")})
        assert result.returncode == 0, result.stderr[-3000:]
        reports = [json.loads((out / f"rank{r}.json").read_text())["inductor"] for r in range(2)]
        misses = sum(r.get("fxgraph_cache_miss", 0) for r in reports)
        if job == "cold":
            assert misses == 2 and list((tmp_path / "bundles").rglob("mlp")), reports
        else:
            assert misses == 0 and all(r["fxgraph_cache_hit"] == 2 for r in reports), reports
            assert "coordinator-run: bundle 'mlp'" in result.stderr and " graphs (" in result.stderr


@pytest.mark.protocol
def test_restore_from_an_unreachable_store_does_not_fail(tmp_path, caplog, monkeypatch):
    from coordinator.jobs.launcher import restore

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once we leave: nothing listens
    restore(f"redis://127.0.0.1:{port}/0", "mlp")
    assert f"could not restore bundle 'mlp' from redis://127.0.0.1:{port}/0" in caplog.text


def test_a_one_node_job_signs_its_own_store_with_no_secret_set_and_refuses_a_forged_value(tmp_path):
    """With no ``COORDINATOR_SECRET``, ``coordinator-run`` on one node makes the job a secret:
    every value in the job's own TCPStore carries its signature, a value forged there (a
    valid checksum, no signature) is refused, and nothing that outlives the job uses it."""
    out = tmp_path / "reports"
    out.mkdir()
    env = {name: value for name, value in os.environ.items() if not name.startswith("COORDINATOR_")}
    result = subprocess.run(
        [sys.executable, "-m", "coordinator.jobs.launcher", "--standalone", "--nproc-per-node", "2", SIGNED, str(out)],
        env=dict(env, **machine_env(tmp_path), TORCHINDUCTOR_COMPILE_THREADS="1"), capture_output=True, text=True,
        timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert all(r["job_secret_set"] and r["store_signed"] and not r["secret_set"] for r in reports), reports
    assert not any(r["job_secret_in_environment"] for r in reports)  # taken out as the worker started
    published = [check for r in reports for check in r["published"]]
    assert len(published) >= 2, reports  # each rank compiled a graph of its own and published it
    assert all(check["signed"] for check in published), published
    assert all("signature mismatch" in check["other_secret"] for check in published), published
    assert not reports[1]["forged_loaded"]
    assert "unsigned but a secret is configured" in result.stderr, result.stderr[-3000:]
    assert "checksummed but not authenticated" not in result.stderr


def test_the_job_secret_is_made_for_one_node_only_and_never_over_the_users():
    """A job of several nodes has no safe way to hand its workers one secret: none is made."""
    one = job_secret(["--standalone", "--nproc-per-node", "2", "train.py"], {})
    assert len(one["COORDINATOR_JOB_SECRET"]) == 64
    assert job_secret(["--nnodes", "1:1", "train.py"], {})
    assert job_secret(["--nnodes", "2", "--rdzv-endpoint", "h:1", "train.py"], {}) == {}
    assert job_secret(["--nnodes=1:4", "train.py"], {}) == {}
    assert job_secret(["train.py"], {"COORDINATOR_SECRET": "a user's own secret"}) == {}
    assert job_secret(["train.py"], {"COORDINATOR_JOB_SECRET": "x" * 32}) == {}
