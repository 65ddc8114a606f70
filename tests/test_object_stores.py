"""Object stores: bundles and the persistent layer in S3, against moto's S3 server over HTTP,
reached through the client path a job uses (fsspec and s3fs, the endpoint from
``AWS_ENDPOINT_URL_S3``). Jobs are real rank processes under ``coordinator-run``.

CI runs the S3 store's tests and a restart from the persistent layer on both torch versions
(the persistent layer is a compile feature that sits on the torch hooks). The layer's faults
(a failing layer, a corrupt value) and a cut bundle upload pass through the same hooks as that
restart and the live store's fault tests, and the store's own tests on GCS and Azure (against
gcp-storage-emulator and Azurite, reached through gcsfs and adlfs) and of every provider's
bounds through none: those are marked ``protocol``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import msgpack
import pytest
import torch
from conftest import Link, S3Server, machine_env

import coordinator
from coordinator import ConfigError, StoreError
from coordinator.bundles.format import build_bundle, read_bundle
from coordinator.bundles.keys import bundle_key
from coordinator.features.persistent import OPEN_TIMEOUT
from coordinator.jobs import launcher
from coordinator.protocol.fingerprint import key_prefix
from coordinator.protocol.integrity import open_sealed
from coordinator.protocol.stores import open_store
from coordinator.protocol.stores.objects import ObjectStore
from coordinator.settings import Config, JobSettings
from coordinator.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train.py"
MIB = 1024 * 1024


@pytest.fixture(autouse=True)
def fresh_clients(monkeypatch):
    """Each test's own object store clients: a process keeps one per URL, and tests change
    the endpoint a URL reaches."""
    from coordinator.protocol import stores

    monkeypatch.setattr(stores, "_object_stores", {})


def synthetic_bundle(size: int = 1000, fill: bytes | None = None) -> bytes:
    """A valid bundle whose Mega-Cache is ``size`` bytes of ``fill`` (random if None)."""
    megacache = (fill * size)[:size] if fill else os.urandom(size)
    return build_bundle({"megacache": megacache, "kernel/ab/cabc.so": b"\x7fELF fake kernel"}, compile_time_s=1.0)


# -- the store ---------------------------------------------------------------------------------


def test_values_in_s3_round_trip_in_parts_and_list_with_sizes_and_ages(s3_server, caplog):
    url = s3_server.bucket() + "/team/values"
    store = ObjectStore(url, part_bytes=5 * MIB, progress_interval=timedelta(0))
    assert store.name == url and not store.live
    store.set("a/small", b"hello")
    big = os.urandom(12 * MIB + 7)  # three parts
    with caplog.at_level(logging.INFO, logger="coordinator.protocol.stores.objects"):
        store.set("bundles/x/big", big)
        assert store.get("bundles/x/big") == big
    progress = [r.getMessage() for r in caplog.records]
    assert any(f"uploading bundles/x/big to {url}: 5.2 of 12.6 MB (41%)" in line for line in progress), progress
    assert any(f"downloading bundles/x/big from {url}: 12.6 MB in" in line for line in progress), progress
    assert store.get("a/small") == b"hello" and store.get("a/absent") is None
    entries = store.list_entries("")
    assert [(e.key, e.size) for e in entries] == [("a/small", 5), ("bundles/x/big", len(big))]
    assert all(abs(e.modified - time.time()) < 300 for e in entries)
    assert store.list_keys("bundles/") == ["bundles/x/big"]
    # Under the URL's prefix, one object per key.
    assert sorted(s3_server.filesystem().find("coordinator-tests/")) == [
        "coordinator-tests/team/values/a/small", "coordinator-tests/team/values/bundles/x/big"]
    store.delete("a/small")
    store.delete("a/small")  # absent: not an error
    assert store.list_keys("") == ["bundles/x/big"]
    with pytest.raises(ConfigError, match="object store: it keeps bundles and the persistent layer, not a job's live"):
        store.add_if_absent("c/claim", b"me")


def test_an_upload_cut_midway_leaves_the_previous_value_whole(s3_server, monkeypatch):
    url = s3_server.bucket() + "/values"
    before = os.urandom(12 * MIB)
    ObjectStore(url, part_bytes=5 * MIB).set("bundles/b", before)
    link = Link(s3_server.port, cut_after=8 * MIB)  # inside the second of three parts
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", link.endpoint)
    through_link = ObjectStore(url, part_bytes=5 * MIB)
    started = time.monotonic()
    with pytest.raises(StoreError, match=f"{url}: writing bundles/b failed"):
        through_link.set("bundles/b", os.urandom(12 * MIB))
    assert time.monotonic() - started < 60
    assert link.cut.is_set() and any(r.startswith("PUT /coordinator-tests/values/bundles/b?") for r in link.requests)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    assert ObjectStore(url).get("bundles/b") == before


def test_two_jobs_saving_one_name_at_once_leave_one_whole_bundle(s3_server, tmp_path, monkeypatch):
    url = s3_server.bucket() + "/bundles"
    # Each job's upload takes over a second through a slow link, so that the two overlap.
    link = Link(s3_server.port, rate=12 * MIB)
    blobs = [synthetic_bundle(14 * MIB, fill=bytes([i + 1])) for i in range(2)]
    start = tmp_path / "go"
    saver = ("import sys, time, os, json, coordinator\n"
             "blob = open(sys.argv[1], 'rb').read()\n"
             "open(sys.argv[1] + '.ready', 'w').close()\n"
             "while not os.path.exists(sys.argv[2]): time.sleep(0.01)\n"
             "began = time.time(); coordinator.save_bundle(sys.argv[3], name='shared', blob=blob)\n"
             "print(json.dumps([began, time.time()]))\n")
    procs = []
    for i, blob in enumerate(blobs):
        (tmp_path / f"b{i}").write_bytes(blob)
        procs.append(subprocess.Popen([sys.executable, "-c", saver, str(tmp_path / f"b{i}"), str(start), url],
                                      env=dict(os.environ, AWS_ENDPOINT_URL_S3=link.endpoint),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"b{i}.ready").exists() for i in range(2)):  # both imported coordinator
        assert time.monotonic() < deadline and all(proc.poll() is None for proc in procs)
        time.sleep(0.05)
    start.touch()
    spans = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        spans.append(json.loads(out.strip().splitlines()[-1]))
    assert max(s[0] for s in spans) < min(s[1] for s in spans), spans  # the uploads overlapped
    saved = open_store(url).get(bundle_key("shared"))
    assert saved in blobs  # one whole bundle, not a mixture
    assert read_bundle(saved).describe()["bytes_by_kind"]["megacache"] == 14 * MIB


def test_bundle_commands_on_s3_list_sizes_and_ages_and_remove(s3_server, tmp_path, capsys, monkeypatch):
    from coordinator.cli import main

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    url = s3_server.bucket() + "/team"
    blob = synthetic_bundle()
    (tmp_path / "b.bundle").write_bytes(blob)
    assert main(["bundle", "ls", url]) == 0
    assert capsys.readouterr().out == f"no bundles in {url}\n"
    for name in ("nightly", "weekly"):
        assert main(["bundle", "save", url, str(tmp_path / "b.bundle"), "--name", name]) == 0
    capsys.readouterr()
    assert main(["bundle", "ls", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[:2] for line in lines] == [[bundle_key("nightly"), str(len(blob))],
                                                         [bundle_key("weekly"), str(len(blob))]]
    assert all(line.split("\t")[2].endswith("s") for line in lines), lines  # seconds old
    assert main(["bundle", "inspect", url, "--name", "nightly"]) == 0
    assert '"matches_this_environment": true' in capsys.readouterr().out
    assert main(["bundle", "load", url, "--name", "nightly", "--out", str(tmp_path / "copy")]) == 0
    assert (tmp_path / "copy").read_bytes() == blob
    capsys.readouterr()
    assert main(["bundle", "rm", url, "nightly"]) == 0
    assert main(["bundle", "rm", url, "--older-than", "3600"]) == 0  # weekly is seconds old: kept
    assert capsys.readouterr().out == (f"removed {bundle_key('nightly')} from {url}\n"
                                       f"no bundles older than 3600s in {url}\n")
    time.sleep(1.1)
    assert main(["bundle", "rm", url, "--older-than", "1"]) == 0
    assert capsys.readouterr().out == f"removed {bundle_key('weekly')} from {url}\n"
    assert main(["bundle", "inspect", url, "--name", "weekly"]) == 1
    assert f"no bundle 'weekly' for environment {coordinator.fingerprint()} in {url}" in capsys.readouterr().err


# -- GCS and Azure; every provider's bounds -----------------------------------------------------


@pytest.fixture(params=["gs", "az"])
def emulated(request):
    """GCS's and Azure's servers as the tests start them (S3's has the tests above)."""
    return request.getfixturevalue({"gs": "gcs_server", "az": "azure_server"}[request.param])


@pytest.mark.protocol
def test_values_round_trip_through_gcs_and_azure(emulated):
    url = emulated.bucket() + "/team/values"
    store = open_store(url)
    assert isinstance(store, ObjectStore) and store.name == url and not store.live
    store.set("a/small", b"hello")
    assert store.get("a/small") == b"hello" and store.get("a/absent") is None
    big = os.urandom(12 * MIB + 7)  # three parts: a resumable upload (GCS), a list of blocks (Azure)
    in_parts = ObjectStore(url, part_bytes=5 * MIB)
    in_parts.set("bundles/x/big", big)
    assert in_parts.get("bundles/x/big") == big
    entries = store.list_entries("")
    assert [(e.key, e.size) for e in entries] == [("a/small", 5), ("bundles/x/big", len(big))]
    assert all(abs(e.modified - time.time()) < 300 for e in entries)
    assert store.list_keys("bundles/") == ["bundles/x/big"]
    store.delete("a/small")
    store.delete("a/small")  # absent: not an error
    assert store.list_keys("") == ["bundles/x/big"]
    missing = url.split("://")[0] + "://no-such-bucket/values"
    with pytest.raises(StoreError, match="'no-such-bucket' does not exist; create it"):
        open_store(missing).get("a/small")


#: Calls that make two requests before they fail: adlfs first asks whether a folder it lists is
#: an object (taking any failure for a no), then lists it.
TWO_REQUESTS = {("az", "list")}


@pytest.mark.protocol
@pytest.mark.parametrize("scheme", ["s3", "gs", "az"])
def test_every_call_to_a_server_that_never_answers_fails_within_its_bound(scheme, silent_server, monkeypatch):
    from conftest import azure_connection_string

    from coordinator.protocol.stores.bounds import OBJECT_STORES

    env = {
        "s3": {"AWS_ENDPOINT_URL_S3": silent_server.endpoint, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
               "AWS_SHARED_CREDENTIALS_FILE": os.devnull},
        "gs": {"STORAGE_EMULATOR_HOST": silent_server.endpoint, "NO_GCE_CHECK": "true"},
        "az": {"AZURE_STORAGE_CONNECTION_STRING": azure_connection_string(silent_server.endpoint)},
    }[scheme]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # The provider's own pause between tries; timeouts and tries short enough to wait out.
    second = timedelta(seconds=1)
    bounds = dataclasses.replace(OBJECT_STORES[scheme], connect=second, answer=second, tries=2)
    store = ObjectStore(f"{scheme}://bucket/values", bounds=bounds)
    calls = {"write": lambda: store.set("k", b"value"), "read": lambda: store.get("k"),
             "list": lambda: store.list_entries(""), "delete": lambda: store.delete("k")}

    def timed(call: Callable[[], object]) -> tuple[float, str]:
        started = time.monotonic()
        with pytest.raises(StoreError) as failed:
            call()
        return time.monotonic() - started, str(failed.value)

    with ThreadPoolExecutor(len(calls)) as pool:  # at once: the test waits out one bound, not four
        took = dict(zip(calls, pool.map(timed, calls.values()), strict=True))
    for what, (seconds, error) in took.items():
        requests = 2 if (scheme, what) in TWO_REQUESTS else 1
        bound = requests * bounds.longest_request().total_seconds()
        assert error.startswith(f"{scheme}://bucket/values: "), error
        # 2 s for a loaded machine: the client's threads, its event loop, the test's own.
        assert seconds < bound + 2, (what, seconds, bound, error)
    assert silent_server.connections >= bounds.tries  # tried again, and still within the bound


# -- settings ----------------------------------------------------------------------------------


def test_object_store_urls_are_checked_when_settings_are_read(monkeypatch):
    with pytest.raises(ConfigError, match=r"store='s3://b/x': an object store keeps bundles and the persistent "
                                          r"layer, not a job's live claims: give it as persist"):
        Config.resolve(store="s3://b/x")
    assert Config.resolve(persist="s3://b/x").persist == "s3://b/x"
    with pytest.raises(ConfigError, match=r"persist='s3:///x': object store URL 's3:///x' names no bucket"):
        Config.resolve(persist="s3:///x")
    with pytest.raises(ConfigError, match="holds credentials or an account; credentials come from the provider's"):
        Config.resolve(persist="s3://AKIA:secret@b/x")
    with pytest.raises(ConfigError, match=r"COORDINATOR_PERSIST=ftp://b/x: unknown store URL scheme 'ftp'"):
        Config.resolve({"COORDINATOR_PERSIST": "ftp://b/x"})
    # A missing extra: a ConfigError that names the URL and the install command.
    providers = (("s3fs", "s3://b/x", "s3"), ("gcsfs", "gs://b/x", "gcs"), ("adlfs", "az://c/x", "azure"))
    for module, url, extra in providers:
        monkeypatch.setitem(sys.modules, module, None)
        hint = (f"'{url}' needs {module}, which is not installed: pip install {module} (or, from a checkout of "
                f"torch-compile-coordinator, pip install \".[{extra}]\")")
        with pytest.raises(ConfigError, match=re.escape(f"COORDINATOR_PERSIST={url}: " + hint)):
            Config.resolve({"COORDINATOR_PERSIST": url})
        with pytest.raises(ConfigError, match=re.escape(hint)):
            JobSettings.resolve({"COORDINATOR_RESTORE_BUNDLE": url}).check_bundles()
    # coordinator-run's option, named as given, before any worker starts.
    settings, rest = launcher.split_args(["--coordinator-persist", "gs://b/x", "--standalone", "train.py", "--x"])
    assert settings == {"COORDINATOR_PERSIST": "gs://b/x"} and rest == ["--standalone", "train.py", "--x"]
    with pytest.raises(ConfigError, match=r"--coordinator-persist gs://b/x: 'gs://b/x' needs gcsfs"):
        launcher.check_settings(settings, settings)


# -- failures of the persistent layer ------------------------------------------------------------


@pytest.mark.protocol
@pytest.mark.parametrize("failure", ["missing bucket", "refused credentials", "server down"])
def test_a_failing_persistent_layer_is_logged_once_and_the_rank_compiles(failure, request, tmp_path, monkeypatch,
                                                                           caplog, capsys):
    from coordinator.cli import main

    if failure == "refused credentials":
        server = S3Server(tmp_path, auth=True)
        request.addfinalizer(server.kill)
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        url, expected = "s3://any-bucket/persist", "was refused"
    elif failure == "missing bucket":
        request.getfixturevalue("s3_server")
        url, expected = "s3://no-such-bucket/persist", "the bucket 'no-such-bucket' does not exist; create it"
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")  # nothing listens
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.setenv(name, "testing")
        url, expected = "s3://any-bucket/persist", "Could not connect to the endpoint URL"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()

    def fn(x):
        return torch.nn.functional.gelu(x * 3.0 + 1.0)

    started = time.time()
    with caplog.at_level(logging.WARNING, logger="coordinator"):
        with coordinator.compile_once(f"file://{tmp_path / 'live'}", persist=url):
            x = torch.randn(8, 8)
            torch.testing.assert_close(torch.compile(fn)(x), fn(x))
            stats = coordinator.stats()
    records = [r for r in caplog.records if "persistent layer" in r.getMessage()]
    warnings = [r.getMessage() for r in records]
    assert len(warnings) == 1 and f"persistent layer {url} failed, going on without it" in warnings[0], warnings
    assert expected in warnings[0], warnings
    # Each failure here is an answer (a refusal, a missing bucket, a connection refused at each of
    # the provider's tries): the layer fails before a lookup has waited out OPEN_TIMEOUT, the
    # longest it waits for the layer to open. The compile's own seconds do not count.
    assert records[0].created - started < OPEN_TIMEOUT.total_seconds(), records[0].created - started
    assert stats["persistent"]["failed"] and stats["graphs_compiled"] >= 1
    # The bundle commands say the same, and exit 1.
    capsys.readouterr()  # what the compile printed (torch's own warnings on some builds)
    assert main(["bundle", "ls", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"coordinator: {url}: ") and expected in err, err


# -- jobs --------------------------------------------------------------------------------------


def example_job(tmp_path: Path, name: str, options: list[str], *, nproc: int = 3, env: dict | None = None,
                ) -> tuple[dict, str]:
    """``examples/train.py`` under ``coordinator-run``, ``nproc`` ranks on one node that share an
    empty Inductor cache dir; returns rank 0's report of every rank, and the job's log."""
    work = tmp_path / name
    (work / "tmp").mkdir(parents=True)
    out = work / "ranks.json"
    job_env = dict(os.environ, **machine_env(work / "tmp"), TORCHINDUCTOR_CACHE_DIR=str(work / "inductor"),
                   TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.jobs.launcher", *options, "--standalone", "--nproc-per-node", str(nproc),
         str(EXAMPLE), "--steps", "1", "--layers", "1", "--dim", "32", "--seq", "16", "--shared-local-cache",
         "--json", str(out)],
        env=job_env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0 and out.exists(), done.stderr[-4000:]
    return json.loads(out.read_text()), done.stderr


def compiled(report: dict) -> int:
    return sum(r["fx_misses"] for r in report["ranks"])


def persisted(report: dict, counter: str) -> int:
    return sum(r["stats"]["persistent"][counter] for r in report["ranks"])


def prefetched(report: dict, counter: str) -> int:
    return sum(r["stats"]["prefetch"][counter] for r in report["ranks"])


@pytest.mark.timeout(900)
def test_a_job_on_empty_dirs_compiles_nothing_from_the_persistent_layer_or_a_bundle(s3_server, tmp_path):
    bucket = s3_server.bucket()
    persist, bundles = f"{bucket}/persist", f"{bucket}/bundles"
    # Cold: the job's own TCPStore is the live store; what it compiles goes to S3 behind it.
    cold, log = example_job(tmp_path, "cold", ["--coordinator-persist", persist, "--coordinator-save-bundle", bundles])
    graphs = compiled(cold)
    assert graphs >= 2 and persisted(cold, "hits") == 0 and persisted(cold, "misses") >= graphs, log[-3000:]
    held = open_store(persist).list_keys(key_prefix(None, "") + "/")
    assert sum("/fx_graph/" in key for key in held) == graphs and any("/aot_autograd/" in key for key in held), held
    # Each value written once, by one rank, behind the compile (the ranks' lines at exit).
    written = [int(n) for n in re.findall(rf"wrote (\d+) values \(.* MB\) to the persistent layer {persist}", log)]
    assert sum(written) == len(held), log[-3000:]
    assert open_store(bundles).get(bundle_key()) is not None

    # From the persistent layer alone: empty Inductor dir, the job's TCPStore, no bundle.
    warm, log = example_job(tmp_path, "from-persist", ["--coordinator-persist", persist])
    assert compiled(warm) == 0, log[-3000:]
    assert f"FX graphs compiled across ranks: {graphs}" not in log
    # Each entry from the layer: most fetched ahead (each rank's index is in the layer), the
    # rest at its lookup.
    assert prefetched(warm, "used") > 0 and prefetched(warm, "refused") == 0
    assert persisted(warm, "hits") + prefetched(warm, "used") >= graphs and persisted(warm, "rejected") == 0
    assert "to the persistent layer" not in log, log[-6000:]  # it held everything already: nothing written

    # From the bundle alone: restored into the node's empty dir before the workers start.
    restored, log = example_job(tmp_path, "from-bundle", ["--coordinator-restore", bundles])
    assert compiled(restored) == 0, log[-3000:]
    assert f"bundle 'default' from {bundles}: installed " in log
    assert all(r["stats"]["persistent"] is None for r in restored["ranks"])


@pytest.mark.protocol
def test_a_corrupt_value_in_the_persistent_layer_is_refused_compiled_and_replaced(s3_server, job):
    persist = s3_server.bucket() + "/persist"
    env = {"COORDINATOR_PERSIST": persist}
    cold = job(1, {}, env=env)
    assert cold[0].returncode == 0, cold[0].log[-3000:]
    store = open_store(persist)
    fx_keys = [key for key in store.list_keys(key_prefix(None, "") + "/") if "/fx_graph/" in key]
    assert len(fx_keys) == 2, fx_keys
    corrupt = fx_keys[0]
    magic, body, digest, mac = msgpack.unpackb(store.get(corrupt))
    store.set(corrupt, msgpack.packb([magic, body[:-9] + b"corrupted", digest, mac]))

    warm = job(1, {}, env=env)
    r = warm[0]
    assert r.returncode == 0, r.log[-3000:]
    assert f"rejected fx_graph entry {corrupt} from the store: checksum mismatch" in r.log
    stats = r.report["stats"]
    assert (stats["graphs_compiled"], stats["graphs_received"], stats["rejected"]) == (1, 1, 1), stats
    assert stats["persistent"]["rejected"] == 1
    torch.testing.assert_close(r.report["losses"], r.report["ref_losses"], rtol=1e-4, atol=1e-5)
    # The rank's own compile replaced the corrupt value.
    open_sealed(corrupt, store.get(corrupt))
    assert stats["persistent"]["written"] == 1


@pytest.mark.protocol
@pytest.mark.parametrize("how", ["link cut", "server killed"])
def test_a_bundle_upload_cut_midway_keeps_the_previous_bundle_and_the_job_finishes(how, s3_server, tmp_path):
    """The job's save at exit loses its server 16 kB into the bundle's upload: the link to it
    is cut (the server keeps its objects: the previous bundle is checked), or the server
    process is killed (its objects are gone with it)."""
    bundles = s3_server.bucket() + "/bundles"
    previous = synthetic_bundle()
    open_store(bundles).set(bundle_key(), previous)
    link = Link(s3_server.port, cut_after=16 * 1024, at_cut=s3_server.kill if how == "server killed" else None)
    _, log = example_job(tmp_path, "cut", ["--coordinator-save-bundle", bundles], nproc=1,
                         env={"AWS_ENDPOINT_URL_S3": link.endpoint})
    assert link.cut.is_set() and link.requests[-1].startswith(f"PUT /coordinator-tests/bundles/{bundle_key()}"), (
        link.requests)  # the upload under way when it was cut was the bundle's
    assert f"could not save the job's bundle to {bundles}: {bundles}: writing {bundle_key()} failed" in log, log[-3000:]
    if how == "link cut":
        assert open_store(bundles).get(bundle_key()) == previous


def test_slurm_hooks_push_to_and_restore_from_s3_with_the_job_users_credentials(s3_server, tmp_path):
    """The hooks as slurmd runs them (no AWS variables of their own): the site file names the
    endpoint and a credentials file, which reach the step run as the job's user."""
    import shutil

    from coordinator.bundles.keys import OUTBOX

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for name in ("prolog.sh", "epilog.sh"):
        shutil.copy(ROOT / "launch" / "slurm" / name, hooks / name)
    credentials = tmp_path / "credentials"
    credentials.write_text("[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    url, log_file = s3_server.bucket() + "/slurm", tmp_path / "hooks.log"
    site = {"COORDINATOR_PYTHON": sys.executable, "COORDINATOR_RESTORE_BUNDLE": url, "COORDINATOR_PUSH_BUNDLE": url,
            "COORDINATOR_SLURM_LOG": log_file,
            "COORDINATOR_NODE_CACHE_DIR": f"{tmp_path}/node/{{job}}", "AWS_ENDPOINT_URL_S3": s3_server.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_SHARED_CREDENTIALS_FILE": credentials,
            "AWS_CONFIG_FILE": tmp_path / "no-config", "AWS_EC2_METADATA_DISABLED": "true"}
    (hooks / "coordinator.env").write_text("".join(f"{k}={v}\n" for k, v in site.items()))
    outbox = tmp_path / "node" / "1" / OUTBOX
    tuned = b'{"XBLOCK": 64, "num_warps": 4}'
    blob = build_bundle({"megacache": b"", "autotune/ab/kernel.best_config": tuned}, compile_time_s=1.0)
    coordinator.open_store(f"file://{outbox}").set(bundle_key("mlp"), blob)

    def hook(name: str, job: str) -> str:
        env = {"SLURM_JOB_ID": job, "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_GID": str(os.getgid()),
               "SLURM_SCRIPT_CONTEXT": f"{name}_slurmd", "SLURM_JOB_COMMENT": "coordinator.bundle=mlp",
               "PYTHONPATH": str(ROOT)}
        done = subprocess.run(["/bin/sh", str(hooks / f"{name}.sh")], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0
        return log_file.read_text()

    assert f"pushed 1 bundle(s) to {url}" in hook("epilog", "1")
    assert open_store(url).get(bundle_key("mlp")) is not None
    log = hook("prolog", "2")
    assert f"restored bundle 'mlp' into {tmp_path}/node/2: " in log, log
    assert (tmp_path / "node" / "2" / "ab" / "kernel.best_config").read_bytes() == tuned
