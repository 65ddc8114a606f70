"""Settings: argument > environment variable > default, and clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest

from coordinator import Config, ConfigError
from coordinator.settings import DEFAULT_CACHES


def test_defaults(monkeypatch):
    for name in ["COORDINATOR_STORE", "COORDINATOR_SECRET", "COORDINATOR_LEASE_S", "COORDINATOR_CACHES"]:
        monkeypatch.delenv(name, raising=False)
    config = Config.resolve()
    assert config.store is None and config.secret is None
    assert config.lease == timedelta(seconds=20)
    assert config.caches == DEFAULT_CACHES and "bundled_autotune" not in DEFAULT_CACHES


def test_precedence(monkeypatch):
    monkeypatch.setenv("COORDINATOR_LEASE_S", "7.5")
    monkeypatch.setenv("COORDINATOR_SECRET", "from-env-secret-0123")
    monkeypatch.setenv("COORDINATOR_CACHES", "fx_graph, aot_autograd")
    monkeypatch.setenv("COORDINATOR_SHIP_CPU_KERNELS", "off")
    config = Config.resolve()
    assert config.lease == timedelta(seconds=7.5)
    assert config.secret == b"from-env-secret-0123"
    assert config.caches == ("fx_graph", "aot_autograd")
    assert config.ship_cpu_kernels is False
    config = Config.resolve(lease=timedelta(seconds=3), secret="arg-secret-0123456")
    assert config.lease == timedelta(seconds=3) and config.secret == b"arg-secret-0123456"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lease": timedelta(0)}, "lease=0s: must be a positive number of seconds"),
        ({"lease": -3}, "lease=-3: must be a positive number of seconds"),
        ({"caches": ("fx_graph", "bogus")},
         "caches=('fx_graph', 'bogus'): unknown cache kinds ['bogus']; allowed: fx_graph"),
        ({"store": "localhost:6379"}, "store='localhost:6379': store 'localhost:6379' is not a URL"),
        ({"namespace": "a/b"}, "namespace='a/b': may only hold letters, digits"),
        ({"chunk_bytes": 10}, "chunk_bytes=10: must be a whole number of bytes, at least 1024"),
    ],
)
def test_invalid_settings(kwargs, message):
    with pytest.raises(ConfigError) as refused:
        Config(**kwargs)
    assert str(refused.value).startswith(message), str(refused.value)
    with pytest.raises(ConfigError) as refused:
        Config.resolve(environ={}, **kwargs)
    assert str(refused.value).startswith(message), str(refused.value)


@pytest.mark.parametrize(
    "variable, raw, message",
    [
        ("COORDINATOR_LEASE_S", "-3", "COORDINATOR_LEASE_S=-3: must be a positive number of seconds"),
        ("COORDINATOR_WAIT_TIMEOUT_S", "0", "COORDINATOR_WAIT_TIMEOUT_S=0: must be a positive number of seconds"),
        ("COORDINATOR_CACHES", "fx_graph,bogus", "COORDINATOR_CACHES=fx_graph,bogus: unknown cache kinds ['bogus']"),
        ("COORDINATOR_CHUNK_BYTES", "10", "COORDINATOR_CHUNK_BYTES=10: must be a whole number of bytes, at least"),
        ("COORDINATOR_NAMESPACE", "a b", "COORDINATOR_NAMESPACE='a b': may only hold letters, digits"),
        ("COORDINATOR_STORE", "bogus://x", "COORDINATOR_STORE=bogus://x: unknown store URL scheme 'bogus'"),
        ("COORDINATOR_PRECOMPILE", "maybe", "COORDINATOR_PRECOMPILE=maybe: expected one of 1/0, true/false"),
    ],
)
def test_an_invalid_variable_is_named_with_the_value_given(variable, raw, message):
    """The variable and its value as written, and what is allowed; never a timedelta's repr."""
    with pytest.raises(ConfigError) as refused:
        Config.resolve(environ={variable: raw})
    assert str(refused.value).startswith(message), str(refused.value)
    assert "datetime" not in str(refused.value)


@pytest.mark.parametrize("url, message", [
    ("bogus://x", "unknown store URL scheme 'bogus' in 'bogus://x'; use redis://host:port/db, rediss://..., "
                  "file:///path"),
    ("file://host/dir", "names a host"),
    ("file:relative/dir", "not a URL"),
    ("redis://127.0.0.1:abc/0", "the port is not a whole number from 1 to 65535"),
    ("redis://127.0.0.1:70000/0", "the port is not a whole number from 1 to 65535"),
    ("redis://127.0.0.1:0/0", "the port is not a whole number from 1 to 65535"),
    ("redis://127.0.0.1:6379/zero", "the database 'zero' is not a whole number"),
    ("rediss://cache:6380/0?db=x", "the database 'x' is not a whole number"),
    ("redis:///0", "names no host"),
    ("redis://:s3cret@cache:port/0", r"'redis://:\*\*\*@cache:port/0': the port"),
    ("rediss://user:s3cret@cache:6380/x", r"'rediss://user:\*\*\*@cache:6380/x': the database"),
    ("redis://cache:6379/x?password=s3cret", r"'redis://cache:6379/x\?password=\*\*\*': the database"),
    ("az://user:s3cret@container/prefix", r"'az://user:\*\*\*@container/prefix' holds credentials"),
])
def test_a_bad_store_url_fails_when_compile_once_starts(monkeypatch, url, message):
    """Named as the argument or the variable gave it, and nowhere in the message with its password."""
    import coordinator

    with pytest.raises(ConfigError, match=message) as refused:
        with coordinator.compile_once(url):
            pass
    assert "s3cret" not in str(refused.value), refused.value
    monkeypatch.setenv("COORDINATOR_STORE", url)
    with pytest.raises(ConfigError, match=message) as refused:
        with coordinator.compile_once():
            pass
    assert "s3cret" not in str(refused.value), refused.value
    monkeypatch.delenv("COORDINATOR_STORE")
    with coordinator.compile_once():  # nothing was left active
        pass


@pytest.mark.parametrize("url", ["redis://cache:6379/0", "redis://cache/2", "rediss://:pw@cache:6380",
                                 "redis://[::1]:6379/0?db=3", "file:///shared/cache", "file://localhost/shared"])
def test_a_good_store_url_is_accepted(url):
    assert Config(store=url).store == url


def test_a_store_object_of_the_wrong_type_is_refused():
    with pytest.raises(ConfigError, match="cannot use dict as a store"):
        Config(store={"host": "localhost"})


def test_collective_switches_are_off_inside_compile_once_and_restored_after(tmp_path):
    script = tmp_path / "switch.py"
    script.write_text(textwrap.dedent("""
        import logging
        import torch._inductor.config as inductor_config
        import coordinator
        logging.basicConfig(level=logging.WARNING)
        import torch
        before = inductor_config.distributed_max_autotune_gemm
        with coordinator.compile_once():
            entered = inductor_config.distributed_max_autotune_gemm
            torch.compile(lambda x: x)
            inside = inductor_config.distributed_max_autotune_gemm
        print("switch", before, entered, inside, inductor_config.distributed_max_autotune_gemm)
    """))
    env = dict(os.environ, TORCHINDUCTOR_DISTRIBUTED_MAX_AUTOTUNE_GEMM="1")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "switch True True False True" in done.stdout  # off from the first compile on
    assert done.stderr.count("turned off torch._inductor.config.distributed_max_autotune_gemm") == 1


def test_invalid_env(monkeypatch):
    monkeypatch.setenv("COORDINATOR_LEASE_S", "soon")
    with pytest.raises(ConfigError, match="COORDINATOR_LEASE_S=soon: not a number of seconds"):
        Config.resolve()
    with pytest.raises(ConfigError, match="unknown settings"):
        Config.resolve(leese=1)
    with pytest.raises(ConfigError, match="COORDINATOR_CHUNK_BYTES=1MB: not a whole number"):
        Config.resolve(environ={"COORDINATOR_CHUNK_BYTES": "1MB"})


def _readme_settings(document: str = "README.md") -> dict[str, str]:
    """Setting -> environment variable, from a document's table of a session's settings
    (README.md's "Configuration", docs/settings.md's first table)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / document).read_text()
    text = text.split("## A job's settings")[0]
    return dict(re.findall(r"^\| `([a-z_]+)` \| `(COORDINATOR_[A-Z_]+)` \|", text, flags=re.M))


def test_the_readme_and_the_settings_page_list_every_setting():
    from coordinator.settings import _ENV

    assert _readme_settings("README.md") == _ENV == _readme_settings("docs/settings.md")


def test_compile_once_accepts_every_setting_the_readme_lists(tmp_path, monkeypatch):
    import dataclasses

    import coordinator
    from coordinator.settings import _ENV

    listed = _readme_settings()
    assert listed == _ENV  # the README lists every setting, under its variable
    for env_name in listed.values():
        monkeypatch.delenv(env_name, raising=False)
    defaults = Config()
    other = {"store": f"file://{tmp_path}", "persist": f"file://{tmp_path / 'persist'}", "secret": b"s" * 16,
             "job_secret": b"j" * 16, "namespace": "team", "caches": ("fx_graph",), "chunk_bytes": 4096,
             "publish_queue_mb": 16,
             "prefetch_mb": 8, "trace_dir": tmp_path / "trace"}
    for field in dataclasses.fields(Config):
        default = getattr(defaults, field.name)
        if field.name not in other:
            other[field.name] = (not default if isinstance(default, bool) else default + timedelta(seconds=1))
    assert set(other) == set(listed)
    with coordinator.compile_once(**other) as session:
        for name, value in other.items():
            assert getattr(session.config, name) == value, name
    base = Config(lease=timedelta(seconds=3))
    with coordinator.compile_once(config=base, namespace="ns") as session:
        assert session.config.lease == timedelta(seconds=3) and session.config.namespace == "ns"
    with pytest.raises(ConfigError, match="unknown settings \\['leese'\\]"):
        with coordinator.compile_once(leese=3):
            pass


def test_every_cache_kind_is_complete():
    """One record per cache kind, checked against the running torch: its Inductor class and
    switches exist, its wait rule is known, and the settings list exactly these kinds."""
    import dataclasses
    import importlib

    import torch._inductor.remote_cache as remote_cache

    from coordinator import _compat
    from coordinator.settings import CACHE_KINDS

    assert CACHE_KINDS == tuple(_compat.CACHE_KINDS) and set(DEFAULT_CACHES) <= set(CACHE_KINDS)
    for name, kind in _compat.CACHE_KINDS.items():
        assert kind.name == name
        assert all(getattr(kind, field.name) is not None for field in dataclasses.fields(kind)), kind
        assert isinstance(getattr(remote_cache, kind.inductor_class), type), kind.inductor_class
        assert kind.switches, name
        for module, attribute in kind.switches:
            assert hasattr(importlib.import_module(module), attribute), (module, attribute)
        assert kind.waits in ("always", "tuning_step", "never"), kind.waits
        assert (name in DEFAULT_CACHES) == kind.default
    # Only FX graphs are waited for wherever they are looked up (docs/design.md, "Waits never form a cycle").
    assert [name for name, kind in _compat.CACHE_KINDS.items() if kind.waits == "always"] == ["fx_graph"]


def test_a_misspelled_variable_is_named_once_with_the_setting_it_is_closest_to(monkeypatch, caplog):
    from coordinator import settings

    monkeypatch.setattr(settings, "_told_unknown", set())
    monkeypatch.setenv("COORDINATOR_STOR", "redis://cache:6379/0")
    monkeypatch.setenv("COORDINATOR_COLOUR", "blue")
    Config.resolve()
    Config.resolve()
    assert caplog.text.count("COORDINATOR_STOR is not a setting and is ignored; did you mean COORDINATOR_STORE?") == 1
    assert caplog.text.count("COORDINATOR_COLOUR is not a setting and is ignored (coordinator-run --help") == 1
    assert "COORDINATOR_ENABLE" not in settings.unknown_variables({"COORDINATOR_ENABLE": "1"})


@pytest.mark.parametrize("name, value, message", [
    ("COORDINATOR_PERSIST", "s3:/bucket", "COORDINATOR_PERSIST=s3:/bucket: store 's3:/bucket' is not a URL; use "
                                          "s3://bucket/prefix, gs://bucket/prefix, az://container/prefix"),
    ("COORDINATOR_PERSIST", "ftp://host/x", "unknown store URL scheme 'ftp' in 'ftp://host/x'; use s3://bucket"),
    ("COORDINATOR_STORE", "ftp://host/x", "unknown store URL scheme 'ftp' in 'ftp://host/x'; use redis://host:port/db, "
                                          "rediss://..., file:///path, or leave it unset"),
    ("COORDINATOR_STORE", "gs://bucket/p", "an object store keeps bundles and the persistent layer"),
])
def test_a_bad_url_is_told_the_forms_its_own_setting_takes(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as raised:
        Config.resolve()
    assert message in str(raised.value)
