"""The ``coordinator`` command: help a person can read, messages that name the store, a quiet broken pipe."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys

import pytest

import coordinator
from coordinator.bundles.format import build_bundle
from coordinator.cli import build_parser, main
from coordinator.protocol.stores import shown_url

pytestmark = pytest.mark.protocol


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and subcommand of ``parser``, as argv prefixes."""
    found = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += commands(sub, (*path, name))
    return found


def help_of(argv: tuple[str, ...], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_every_command_has_plain_help_with_an_example(capsys):
    every = commands(build_parser())
    assert {("bundle", "ls"), ("slurm", "prolog"), ("slurm", "epilog"), ("report",)} <= set(every)
    for argv in every:
        text = help_of(argv, capsys)
        assert "``" not in text and ":func:" not in text and ":mod:" not in text, (argv, text)
        assert "example:\n  " in text or "examples:\n  " in text, (argv, text)
        usage, _, rest = text.partition("\n\n")
        assert usage.startswith("usage: coordinator") and rest.split("\n")[0].strip(), (argv, text)  # what it does


def test_slurm_help_says_what_prolog_and_epilog_do(capsys):
    text = " ".join(help_of(("slurm",), capsys).split())
    assert "prolog before a job's tasks start on a node: fetch, verify and install the bundle" in text, text
    assert "epilog when the job ends on a node: publish the bundles it left in the node's outbox" in text, text


def test_top_level_help_lists_the_commands_and_how_stores_are_named(capsys):
    text = help_of((), capsys)
    for command in ("bundle", "report", "slurm"):
        assert f"\n    {command} " in text, text
    assert "redis://[:password@]host:port/db" in text and "coordinator-run --help" in text


def test_bundle_messages_name_the_store_by_its_url_with_no_password(tmp_path, capsys, caplog, monkeypatch):
    assert shown_url("redis://:s3cret@cache:6379/0") == "redis://:***@cache:6379/0"
    assert shown_url("rediss://user:s3cret@cache:6380/1") == "rediss://user:***@cache:6380/1"
    assert shown_url("file:///shared/bundles") == "file:///shared/bundles"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    url = f"file://{tmp_path / 'store'}"
    blob = build_bundle({"megacache": b"x" * 100}, compile_time_s=1.0)
    with caplog.at_level(logging.INFO, logger="coordinator"):
        coordinator.save_bundle(url, name="nightly", blob=blob)
        coordinator.save_bundle("outbox", name="nightly", blob=blob)
    assert f"saved a 0.0 MB bundle as 'nightly' in {url}" in caplog.text
    assert f"as 'nightly' in outbox (file://{tmp_path / 'inductor' / 'coordinator-outbox'})" in caplog.text
    path = tmp_path / "b.bundle"
    path.write_bytes(blob)
    assert main(["bundle", "save", url, str(path), "--name", "nightly"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f" in {url}")
    assert main(["bundle", "inspect", url, "--name", "absent"]) == 1
    error = capsys.readouterr().err
    assert "no bundle 'absent' for environment" in error and error.rstrip().endswith(f" in {url}"), error


def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path):
    """``coordinator bundle ls URL | head``: the reader is gone before the command writes."""
    store = tmp_path / "store"
    blob = build_bundle({"megacache": b"x"}, compile_time_s=1.0)
    for i in range(2000):  # more than a pipe's buffer of lines
        path = store / "bundles" / "env" / "secret" / "ns" / f"bundle-{i:05d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "bundle", "ls", f"file://{store}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, stderr
    assert stderr == ""
