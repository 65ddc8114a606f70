"""Whole-job bundles: broadcast, persist and restore, verify before writing anything."""

from __future__ import annotations

import hashlib
import json
import os
import re

import msgpack
import pytest
import torch
from conftest import WITH_PROBES, require_success

import coordinator
from coordinator import EnvironmentMismatch, IntegrityError
from coordinator.bundles.format import build_bundle, read_bundle
from coordinator.bundles.keys import bundle_key
from coordinator.bundles.transfer import fetch_bundle

UNIQUE_GRAPHS = 2
# A restored rank runs no compiler at all: no precompiled header, no ISA probe (the bundle
# carries the probes' builds).
NO_PCH = {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0", **WITH_PROBES}


def assert_loaded_everything(r):
    assert r.fx_misses == 0 and r.fx_hits == UNIQUE_GRAPHS, r.report["inductor"]
    assert r.report["cpp_builds"] == {"kernel": 0, "header": 0, "isa_probe": 0}, r.report["cpp_builds"]
    torch.testing.assert_close(r.report["losses"], r.report["ref_losses"], rtol=1e-4, atol=1e-5)


@pytest.mark.protocol
def test_broadcast_from_rank0_then_others_compile_nothing(job):
    results = job(4, {"bundle": "broadcast", "coordinator": False}, env=NO_PCH)
    require_success(results)
    assert results[0].fx_misses == UNIQUE_GRAPHS
    size = results[0].report["bundle"]["bytes"]
    for r in results[1:]:
        assert r.report["bundle"]["bytes"] == size and r.report["bundle"]["files_written"] > 0
        assert r.report["bundle"]["compile_time_s"] > 1.0  # what rank 0's compile cost
        assert r.report["bundle"]["timeout_extension_s"] == 0  # gloo: no NCCL timeouts
        assert_loaded_everything(r)


# Over Redis, what differs from a directory is the transport: run on one torch only.
@pytest.mark.parametrize("backend", [pytest.param("redis", marks=pytest.mark.protocol), "file"])
def test_save_then_new_job_loads(job, backend, redis_server, tmp_path):
    url = redis_server.url if backend == "redis" else f"file://{tmp_path / 'bundles'}"
    first = job(1, {"bundle": f"save:{url}", "coordinator": False}, env=NO_PCH)
    require_success(first)
    assert first[0].report["bundle"]["bytes"] > 0
    second = job(2, {"bundle": f"load:{url}", "coordinator": False}, env=NO_PCH)
    require_success(second)
    for r in second:
        assert r.report["bundle"]["fetched"] is True
        assert_loaded_everything(r)


@pytest.mark.protocol
def test_four_local_ranks_restore_with_one_fetch(job, tmp_path):
    url = f"file://{tmp_path / 'bundles'}"
    require_success(job(1, {"bundle": f"save:{url}", "coordinator": False}, env=NO_PCH))
    node_cache = tmp_path / "node-local-inductor"
    results = job(4, {"bundle": f"load:{url}", "coordinator": False, "no_pg": True},
                  env={**NO_PCH, "TORCHINDUCTOR_CACHE_DIR": str(node_cache)})
    require_success(results)
    assert sum(r.report["bundle"]["fetched"] for r in results) == 1
    for r in results:
        assert_loaded_everything(r)


@pytest.mark.one_torch  # a bundle's install runs on every torch in test_save_then_new_job_loads; the recorded
# compile time in test_compile_once's test_saved_is_the_compile_time_of_the_graphs_a_rank_loaded
def test_a_restored_bundle_counts_what_it_saved_up_to_its_recorded_compile_time(job, tmp_path):
    """A job restores a bundle into empty Inductor dirs, then runs under compile_once: every
    graph is in the local cache, put there by the bundle, and each rank's ``saved`` is the
    compile time recorded with those graphs: more than 0, no more than the bundle's job spent
    compiling."""
    url = f"file://{tmp_path / 'bundles'}"
    require_success(job(1, {"bundle": f"save:{url}", "coordinator": False}, env=NO_PCH))
    results = job(2, {"bundle": f"load:{url}", "store": f"file://{tmp_path / 'store'}"}, env=NO_PCH)
    require_success(results)
    for r in results:
        assert_loaded_everything(r)
        stats, bundle = r.report["stats"], r.report["bundle"]
        assert bundle["fetched"] is True and bundle["graphs"] == UNIQUE_GRAPHS, bundle
        assert stats["graphs_found_in_local_cache"] == UNIQUE_GRAPHS and stats["graphs_received"] == 0, stats
        assert 0 < stats["compile_time_saved_s"] <= bundle["compile_time_s"], (stats, bundle)
        assert f"saved {stats['compile_time_saved_s']:.1f}s" in r.log


def synthetic(secret=None, env=None, size=1000):
    artifacts = {"megacache": os.urandom(size), "kernel/ab/cabc.so": b"\x7fELF fake kernel"}
    return build_bundle(artifacts, compile_time_s=12.5, secret=secret, env=env), artifacts


def test_round_trip_and_inspect():
    blob, artifacts = synthetic(secret=b"k")
    bundle = read_bundle(blob, secret=b"k")
    assert bundle.artifacts == artifacts and bundle.compile_time_s == 12.5
    described = bundle.describe()
    assert described["kernels"] == ["ab/cabc.so"] and described["fingerprint"] == coordinator.fingerprint()
    assert described["bytes_by_kind"] == {"megacache": 1000, "kernel": len(artifacts["kernel/ab/cabc.so"])}
    assert described["signature"] == "HMAC-SHA256, verified"


def _forge(blob):
    # As anyone can without the secret: change an artifact, and the envelope's checksum to match.
    magic, body, _, mac = msgpack.unpackb(blob)
    fields = msgpack.unpackb(body)
    fields["files"]["megacache"] = b"evil" + fields["files"]["megacache"][4:]
    body = msgpack.packb(fields, use_bin_type=True)
    return msgpack.packb([magic, body, hashlib.sha256(body).digest(), mac], use_bin_type=True)


@pytest.mark.parametrize(
    "make, secret, error, reason",
    [
        (lambda: synthetic()[0][:-50], None, IntegrityError, "not a coordinator bundle"),
        (lambda: _forge(synthetic()[0]), None, IntegrityError, "checksum mismatch in bundle artifact 'megacache'"),
        (lambda: synthetic(secret=b"right-secret-0123")[0], b"wrong-secret-0123", IntegrityError, "signature mismatch"),
        (lambda: synthetic()[0], b"right-secret-0123", IntegrityError, "unsigned"),
        (lambda: synthetic(env=dict(coordinator.environment(), torch="2.11.0", gpu="NVIDIA H200 sm_90"))[0], None,
         EnvironmentMismatch, "gpu: NVIDIA H200 sm_90 != none; torch: 2.11.0 != "),
    ],
    ids=["truncated", "corrupt", "wrong-secret", "unsigned", "wrong-environment"],
)
def test_bad_bundles_are_refused_before_anything_is_written(tmp_path, monkeypatch, make, secret, error, reason):
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    store_dir = tmp_path / "store"
    url = f"file://{store_dir}"
    # Under the reader's key (bundle keys carry the secret's fingerprint), as anyone who can
    # write to the store can place it.
    coordinator.open_store(url).set(bundle_key(secret=secret), make())
    with pytest.raises(error, match=reason):
        coordinator.load_bundle(url, secret=secret)
    written = [p for p in cache.rglob("*") if p.is_file() and not p.name.startswith(".coordinator-bundle")]
    assert written == []


@pytest.mark.protocol
def test_bundle_over_512mb_survives_redis(redis_server):
    # Redis refuses single values over 512 MB; the store chunks them (64 MiB each).
    blob, artifacts = synthetic(size=600 * 1024 * 1024)
    del artifacts
    coordinator.save_bundle(redis_server.url, name="big", blob=blob)
    fetched = fetch_bundle(redis_server.url, name="big")
    assert len(fetched.megacache) == 600 * 1024 * 1024


def test_cli_save_inspect_ls_load_rm(tmp_path, capsys, monkeypatch):
    from coordinator.cli import main

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    blob, _ = synthetic()
    path = tmp_path / "b.bundle"
    path.write_bytes(blob)
    url = f"file://{tmp_path / 'store'}"
    assert main(["bundle", "save", url, str(path), "--name", "nightly"]) == 0
    assert main(["bundle", "inspect", url, "--name", "nightly"]) == 0
    out = capsys.readouterr().out
    assert '"kernels": [\n    "ab/cabc.so"' in out and '"matches_this_environment": true' in out
    assert main(["bundle", "ls", url]) == 0
    assert bundle_key("nightly") in capsys.readouterr().out
    assert main(["bundle", "load", url, "--name", "nightly", "--out", str(tmp_path / "copy")]) == 0
    assert (tmp_path / "copy").read_bytes() == blob
    assert main(["bundle", "rm", url, "nightly"]) == 0
    assert main(["bundle", "inspect", url, "--name", "nightly"]) == 1
    assert "no bundle 'nightly'" in capsys.readouterr().err
    assert main(["bundle", "ls", url]) == 0
    assert capsys.readouterr().out == f"no bundles in {url}\n"
    bad = tmp_path / "bad.bundle"
    bad.write_bytes(blob[:-10])
    assert main(["bundle", "save", url, str(bad)]) == 1
    # "outbox": this node's outbox in the Inductor cache dir.
    assert main(["bundle", "save", "outbox", str(path), "--name", "nightly"]) == 0
    assert (tmp_path / "inductor" / "coordinator-outbox" / bundle_key("nightly")).is_file()


def test_cli_bundle_save_help_says_what_its_arguments_are(capsys):
    from coordinator.cli import main

    with pytest.raises(SystemExit) as done:
        main(["bundle", "save", "--help"])
    assert done.value.code == 0
    usage = " ".join(capsys.readouterr().out.split())
    for meaning in ("url the store to publish to: redis://host:port/db", "or outbox (this node's outbox)",
                    "file the bundle file", "--name NAME bundle name", "--ttl TTL seconds until Redis expires it",
                    "--max-bytes MAX_BYTES refuse a bundle larger than this"):
        assert meaning in usage, usage


@pytest.mark.protocol
def test_redis_ttl_and_size_policy(redis_server):
    import redis

    from coordinator import ConfigError

    blob, _ = synthetic(size=5000)
    with pytest.raises(ConfigError, match="max_bytes=1000: the bundle is .* bytes, over this limit"):
        coordinator.save_bundle(redis_server.url, name="capped", blob=blob, max_bytes=1000)
    from datetime import timedelta

    coordinator.save_bundle(redis_server.url, name="expiring", blob=blob, ttl=timedelta(seconds=60))
    raw = redis.Redis.from_url(redis_server.url)
    ttl_ms = raw.pttl("coordinator/" + bundle_key("expiring"))
    assert 0 < ttl_ms <= 60_000
    assert raw.exists("coordinator/" + bundle_key("capped")) == 0


def test_save_bundle_inside_a_session_uses_its_secret_and_namespace(tmp_path, monkeypatch):
    monkeypatch.delenv("COORDINATOR_SECRET", raising=False)
    monkeypatch.delenv("COORDINATOR_NAMESPACE", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    url = f"file://{tmp_path / 'bundles'}"
    with coordinator.compile_once(f"file://{tmp_path / 'store'}", secret="session-secret-0123", namespace="team"):
        coordinator.save_bundle(url)
    blob = coordinator.open_store(url).get(bundle_key(namespace="team"))
    assert blob is not None and coordinator.open_store(url).get(bundle_key(namespace="")) is None
    assert read_bundle(blob, secret=b"session-secret-0123").describe()["signature"] == "HMAC-SHA256, verified"
    with pytest.raises(IntegrityError, match="signature mismatch"):
        read_bundle(blob, secret=b"another-secret-0123")


def test_cli_exits_non_zero_on_a_bundle_it_cannot_read_or_publish(tmp_path, capsys):
    """Random bytes under a bundle's key are no bundle: `ls` does not list them and `copy`
    does not publish them, each saying so and exiting 1 (after the good ones); a time to
    live that is not positive is refused before anything is read."""
    from coordinator.cli import main

    src, dst = f"file://{tmp_path / 'src'}", f"file://{tmp_path / 'dst'}"
    garbage = bundle_key("garbage")
    coordinator.open_store(src).set(garbage, os.urandom(4096))
    assert main(["bundle", "ls", src]) == 1
    out, err = capsys.readouterr()
    assert out == f"no bundles in {src}\n" and f"{garbage} is not a bundle: not a coordinator" in err
    assert main(["bundle", "copy", src, dst]) == 1
    out, err = capsys.readouterr()
    assert out == "" and f"not published {garbage}: not a coordinator" in err
    assert coordinator.open_store(dst).list_keys("bundles/") == []
    blob, _ = synthetic()
    coordinator.save_bundle(src, name="good", blob=blob)
    assert main(["bundle", "ls", src]) == 1
    out, err = capsys.readouterr()
    assert re.fullmatch(rf"{re.escape(bundle_key('good'))}\t{len(blob)}\t\d+s\n", out) and garbage in err
    assert main(["bundle", "copy", src, dst, "--keep"]) == 1
    assert capsys.readouterr().out == f"published {bundle_key('good')} to {dst}\n"
    assert coordinator.open_store(dst).list_keys("bundles/") == [bundle_key("good")]
    path = tmp_path / "b.bundle"
    path.write_bytes(blob)
    for ttl in ("-5", "0"):
        assert main(["bundle", "save", dst, str(path), "--ttl", ttl]) == 1
        assert f"--ttl {ttl}: a time to live must be a positive number of seconds" in capsys.readouterr().err
    from datetime import timedelta

    with pytest.raises(coordinator.ConfigError, match=r"ttl=-5s: a time to live must be a positive"):
        coordinator.save_bundle(dst, name="x", blob=blob, ttl=timedelta(seconds=-5))


@pytest.mark.protocol
def test_a_bundle_larger_than_redis_can_hold_is_refused(tmp_path, capsys):
    from conftest import RedisServer

    from coordinator.cli import main

    server = RedisServer(tmp_path / "redis", "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    try:
        blob, _ = synthetic(size=3_000_000)
        path = tmp_path / "b.bundle"
        path.write_bytes(blob)
        assert main(["bundle", "save", server.url, str(path)]) == 1
        err = capsys.readouterr().err
        assert f"the bundle is {len(blob)} bytes; redis 127.0.0.1:{server.port}/0 holds at most" in err, err
    finally:
        server.kill()


SECRET = b"the-team's-secret-0123"


def test_a_forged_bundle_is_refused_with_the_secret_and_never_called_verified_without_it(tmp_path, capsys,
                                                                                       monkeypatch):
    """A bundle forged by anyone who can write to the store (every checksum valid, the MAC
    zeroed or left out) is refused wherever the secret is known; without it, ``inspect``
    says what it checked and never "verified"."""
    from coordinator.cli import main

    _, body, digest, mac = msgpack.unpackb(synthetic(secret=SECRET)[0])
    zeroed = msgpack.packb([coordinator.protocol.integrity.MAGIC, body, digest, bytes(len(mac))], use_bin_type=True)
    unsigned = synthetic()[0]
    for forged, reason in ((zeroed, "signature mismatch"), (unsigned, "unsigned but a secret is configured")):
        with pytest.raises(IntegrityError, match=reason):
            read_bundle(forged, secret=SECRET)
    monkeypatch.delenv("COORDINATOR_SECRET", raising=False)
    signatures = {}
    for name, blob in (("zeroed", zeroed), ("unsigned", unsigned), ("signed", synthetic(secret=SECRET)[0])):
        (tmp_path / name).write_bytes(blob)
        assert main(["bundle", "inspect", str(tmp_path / name)]) == 0
        signatures[name] = json.loads(capsys.readouterr().out)["signature"]
    assert signatures["unsigned"] == "unsigned (checksums only)"
    assert signatures["zeroed"] == signatures["signed"] and "not verified" in signatures["signed"], signatures
    assert "COORDINATOR_SECRET" in signatures["signed"]
    monkeypatch.setenv("COORDINATOR_SECRET", SECRET.decode())
    assert main(["bundle", "inspect", str(tmp_path / "signed")]) == 0
    assert json.loads(capsys.readouterr().out)["signature"] == "HMAC-SHA256, verified"
    assert main(["bundle", "inspect", str(tmp_path / "zeroed")]) == 1
    assert "signature mismatch" in capsys.readouterr().err


@pytest.mark.parametrize("reader", [None, b"another-secret-0123"], ids=["no-secret", "wrong-secret"])
def test_a_bundle_under_another_secret_is_named_so_not_missing(tmp_path, capsys, monkeypatch, reader):
    """A reader with no secret, or another one, is told the bundle is there under another
    secret, by ``inspect``, ``load`` and ``coordinator-run --coordinator-restore``."""
    from coordinator.cli import main
    from coordinator.jobs.launcher import restore

    url = f"file://{tmp_path / 'bundles'}"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv("COORDINATOR_NAMESPACE", raising=False)
    # As in a process that ran no compile_once: the settings come from the environment.
    monkeypatch.setattr("coordinator.bundles.keys._session_lookup", lambda: None)
    coordinator.open_store(url).set(bundle_key("mlp", secret=SECRET), synthetic(secret=SECRET)[0])
    if reader is None:
        monkeypatch.delenv("COORDINATOR_SECRET", raising=False)
    else:
        monkeypatch.setenv("COORDINATOR_SECRET", reader.decode())
    with pytest.raises(IntegrityError, match="there under another secret"):
        fetch_bundle(url, name="mlp")
    assert main(["bundle", "inspect", url, "--name", "mlp"]) == 1
    err = capsys.readouterr().err
    assert "bundle 'mlp'" in err and "under another secret" in err and "COORDINATOR_SECRET" in err, err
    logged = []
    monkeypatch.setattr("coordinator.jobs.launcher.log.warning", lambda *args: logged.append(args[0] % args[1:]))
    restore(url, "mlp")
    assert any("under another secret" in line for line in logged) and not any("no bundle" in line for line in logged)
    with pytest.raises(FileNotFoundError, match="no bundle 'other'"):
        fetch_bundle(url, name="other")


@pytest.mark.parametrize("value", ["", "short"])
def test_an_empty_or_short_secret_is_refused_with_the_rule(monkeypatch, value):
    monkeypatch.setenv("COORDINATOR_SECRET", value)
    with pytest.raises(coordinator.ConfigError, match=f"COORDINATOR_SECRET: a secret of {len(value)} bytes is refused: "
                                                      "it must be at least 16 bytes") as raised:
        coordinator.Config.resolve()
    assert value == "" or value not in str(raised.value)  # the secret's value is never shown
