"""Tampered, truncated, wrongly signed and replayed values are refused, never loaded; and
the bytes of values that do arrive are counted once per fetch from the store."""

from __future__ import annotations

import logging
import pickle

import msgpack
import pytest
from conftest import require_success

from coordinator import Config, IntegrityError
from coordinator.protocol.fingerprint import (
    describe_difference,
    environment,
    fingerprint,
    key_prefix,
    secret_fingerprint,
)
from coordinator.protocol.integrity import open_sealed, seal
from coordinator.session import Session


def test_round_trip_with_and_without_secret():
    blob = seal("k", b"payload", meta={"time_taken_ms": 5}, files={"ab/x.so": b"\x7fELF"})
    sealed = open_sealed("k", blob)
    assert (sealed.payload, sealed.meta, sealed.files, sealed.signed) == (
        b"payload", {"time_taken_ms": 5}, {"ab/x.so": b"\x7fELF"}, False)
    signed = seal("k", b"payload", secret=b"s")
    assert open_sealed("k", signed, secret=b"s").signed
    # A reader without the secret still checks the checksum.
    assert open_sealed("k", signed).payload == b"payload"


@pytest.mark.parametrize(
    "mangle, reason",
    [
        (lambda b: b[:-7], "not a coordinator envelope"),
        (lambda b: b[: len(b) // 2], "not a coordinator envelope"),
        (lambda b: b"garbage", "not a coordinator envelope"),
        (lambda b: b.replace(b"payload", b"pAyload"), "checksum mismatch"),
    ],
    ids=["truncated-tail", "truncated-half", "garbage", "tampered"],
)
def test_corrupt_values_are_refused(mangle, reason):
    blob = seal("k", b"payload")
    with pytest.raises(IntegrityError, match=reason):
        open_sealed("k", mangle(blob))


def test_signature_checks():
    with pytest.raises(IntegrityError, match="signature mismatch"):
        open_sealed("k", seal("k", b"p", secret=b"right"), secret=b"wrong")
    with pytest.raises(IntegrityError, match="unsigned"):
        open_sealed("k", seal("k", b"p"), secret=b"right")
    # Forging: tamper and recompute the checksum, but not the HMAC.
    _, body, _, mac = msgpack.unpackb(seal("k", b"p", secret=b"right"))
    fields = msgpack.unpackb(body)
    fields["payload"] = b"evil"
    body = msgpack.packb(fields, use_bin_type=True)
    import hashlib

    forged = msgpack.packb([b"coordinator/1", body, hashlib.sha256(body).digest(), mac], use_bin_type=True)
    with pytest.raises(IntegrityError, match="signature mismatch"):
        open_sealed("k", forged, secret=b"right")


def test_value_is_bound_to_its_key():
    with pytest.raises(IntegrityError, match="sealed for key"):
        open_sealed("other", seal("k", b"p", secret=b"s"), secret=b"s")


class Exploding:
    """Unpickling this would run code: the test fails if it ever is."""

    def __reduce__(self):
        return (pytest.fail, ("a rejected value was unpickled",))


def _session(url: str, secret: str | None = None) -> Session:
    # Published inline: these tests read and tamper with the store's copy right after a put.
    return Session(Config(store=url, secret=secret, publish_queue_mb=0))


@pytest.mark.parametrize("attack", ["tampered", "truncated", "wrong-secret", "unsigned", "tampered-node-copy"])
def test_session_treats_bad_values_as_misses(tmp_path, caplog, monkeypatch, attack):
    url = f"file://{tmp_path / 'store'}"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "writer-node"))
    writer = _session(url, secret=None if attack == "unsigned" else "team-secret-0123456")
    payload = pickle.dumps(Exploding())
    writer.put("fx_graph", "pt2:fx-graph-v1::key:c1", payload)
    store = writer.flight().store
    key = writer.store_key("fx_graph", "pt2:fx-graph-v1::key:c1")
    blob = store.get(f"v/{key}")
    flipped = blob[:-1] + bytes([blob[-1] ^ 1])
    if attack == "tampered":
        store.set(f"v/{key}", flipped)
    elif attack == "truncated":
        store.set(f"v/{key}", blob[:-100])
    if attack == "tampered-node-copy":
        writer._node.write(key, flipped)  # the reader shares the writer's node
    else:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "reader-node"))
    reader = _session(url, secret="other-secret-012345" if attack == "wrong-secret" else "team-secret-0123456")
    if attack in ("wrong-secret", "unsigned"):
        # Keys are namespaced by the secret: the value is placed under the reader's key, as
        # anyone who can write to the store can.
        reader.flight()
        store.set(f"v/{reader.store_key('fx_graph', 'pt2:fx-graph-v1::key:c1')}", blob)
    with caplog.at_level(logging.WARNING, logger="coordinator"):
        got = reader.get("fx_graph", "pt2:fx-graph-v1::key:c1")
    # Refused and never unpickled; the store's own copy is intact when only the node's was tampered.
    assert got == (payload if attack == "tampered-node-copy" else None)
    assert "rejected fx_graph entry" in caplog.text
    assert reader.stats.as_dict()["rejected"] == 1
    writer.close()
    reader.close()


def test_a_repeated_graph_is_received_once_and_reread_from_the_node(tmp_path, monkeypatch):
    """A graph asked for again (by another rank of this node, or by this rank where keeping
    it in Inductor's local cache failed) comes from this node's copy, verified again: the
    store sends it once, and the bytes received count the store's bytes only."""
    url = f"file://{tmp_path / 'store'}"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "writer-node"))
    writer = _session(url)
    writer.put("fx_graph", "pt2:fx-graph-v1::layer", b"compiled layer" * 1000)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "reader-node"))
    reader = _session(url)
    for _ in range(3):
        assert reader.get("fx_graph", "pt2:fx-graph-v1::layer") == b"compiled layer" * 1000
    stats = reader.stats.as_dict()
    sent = len(writer.flight().store.get(f"v/{writer.store_key('fx_graph', 'pt2:fx-graph-v1::layer')}"))
    assert (stats["graphs_received"], stats["store_fetches"]) == (3, 1)
    assert (stats["bytes_received"], stats["bytes_from_node"]) == (sent, 2 * sent)
    writer.close()
    reader.close()


def test_fingerprint_namespaces_environments():
    ours = environment()
    theirs = dict(ours, torch="2.11.0", gpu="NVIDIA H200 sm_90")
    assert fingerprint(theirs) != fingerprint(ours)
    assert "torch: 2.11.0 != " in describe_difference(ours, theirs)
    assert "gpu: NVIDIA H200 sm_90 != none" in describe_difference(ours, theirs)
    assert len(fingerprint()) == 16


def test_the_secret_namespaces_keys_by_its_fingerprint_never_by_itself():
    assert secret_fingerprint(None) == secret_fingerprint(b"") == "none"
    ours = secret_fingerprint(b"team-secret-0123456")
    assert len(ours) == 12 and int(ours, 16) >= 0 and ours != secret_fingerprint(b"team-secreT")
    assert key_prefix(b"team-secret-0123456", "") == f"{fingerprint()}/{ours}/_"
    assert key_prefix(None, "ns") == f"{fingerprint()}/none/ns"


@pytest.mark.protocol
def test_jobs_with_different_secrets_keep_apart_and_a_corrupt_value_is_compiled_once(job, tmp_path):
    """Two jobs with different secrets on one store: each compiles its own graphs once and
    refuses nothing; a rerun of the first finds its own. Then one of the first job's values
    are corrupted (the forward and the backward graph): of 3 ranks, exactly one compiles each
    again, the others receive it."""
    store = tmp_path / "store"
    options = {"store": f"file://{store}"}
    team_a = {"COORDINATOR_SECRET": "team-a-secret-012345"}
    first = job(2, options, env=team_a)
    other = job(2, options, env={"COORDINATOR_SECRET": "team-b-secret-012345"})
    again = job(1, options, env=team_a)
    for results in (first, other, again):
        require_success(results)
        assert all(r.report["stats"]["rejected"] == 0 for r in results), [r.report["stats"] for r in results]
    assert sum(r.fx_misses for r in first) == sum(r.fx_misses for r in other) == 2  # each graph once per job
    assert (again[0].fx_misses, again[0].fx_hits) == (0, 2)
    namespaces = {p.name for p in (store / "v" / fingerprint()).iterdir()}
    assert namespaces == {secret_fingerprint(b"team-a-secret-012345"), secret_fingerprint(b"team-b-secret-012345")}
    assert not list(store.rglob("*team-*"))  # no secret in a key

    team_a_graphs = store / "v" / fingerprint() / secret_fingerprint(b"team-a-secret-012345") / "_" / "fx_graph"
    graphs = sorted(team_a_graphs.iterdir())
    assert len(graphs) == 2
    corrupt = {}
    for path in graphs:
        blob = path.read_bytes()
        corrupt[path] = blob[:-1] + bytes([blob[-1] ^ 1])
        path.write_bytes(corrupt[path])
    corrupted = job(3, options, env=team_a)
    require_success(corrupted)
    stats = [r.report["stats"] for r in corrupted]
    # Inductor also counts as a miss the graph AOTAutograd's entry failed to load, which it
    # then compiles afresh: the coordinator's counts say who compiled.
    assert sum(s["graphs_compiled"] for s in stats) == 2, stats  # each graph compiled again once
    assert all(s["graphs_compiled"] + s["graphs_received"] == 2 for s in stats), stats  # the others received it
    assert sum(r.report["cpp_builds"]["kernel"] > 0 for r in corrupted) == 1  # on one rank only
    assert sum(s["rejected"] for s in stats) >= 2
    assert all(path.read_bytes() != bad for path, bad in corrupt.items())  # replaced by the new compiles
