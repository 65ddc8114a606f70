"""Settings: argument > environment variable > default, and clear errors."""

from __future__ import annotations

from datetime import timedelta

import pytest

from coordinator import Config, ConfigError
from coordinator.config import DEFAULT_CACHES


def test_defaults(monkeypatch):
    for name in ["COORDINATOR_STORE", "COORDINATOR_SECRET", "COORDINATOR_LEASE_S", "COORDINATOR_CACHES"]:
        monkeypatch.delenv(name, raising=False)
    config = Config.resolve()
    assert config.store is None and config.secret is None
    assert config.lease == timedelta(seconds=20)
    assert config.caches == DEFAULT_CACHES and "bundled_autotune" not in DEFAULT_CACHES


def test_precedence(monkeypatch):
    monkeypatch.setenv("COORDINATOR_LEASE_S", "7.5")
    monkeypatch.setenv("COORDINATOR_SECRET", "from-env")
    monkeypatch.setenv("COORDINATOR_CACHES", "fx_graph, aot_autograd")
    monkeypatch.setenv("COORDINATOR_SHIP_CPU_KERNELS", "off")
    config = Config.resolve()
    assert config.lease == timedelta(seconds=7.5)
    assert config.secret == b"from-env"
    assert config.caches == ("fx_graph", "aot_autograd")
    assert config.ship_cpu_kernels is False
    config = Config.resolve(lease=timedelta(seconds=3), secret="arg")
    assert config.lease == timedelta(seconds=3) and config.secret == b"arg"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lease": timedelta(0)}, "lease must be a positive timedelta"),
        ({"caches": ("fx_graph", "bogus")}, "unknown cache kinds \\['bogus'\\]; allowed: fx_graph"),
        ({"store": "localhost:6379"}, "is not a URL"),
        ({"namespace": "a/b"}, "namespace"),
        ({"chunk_bytes": 10}, "chunk_bytes"),
    ],
)
def test_invalid_settings(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Config(**kwargs)


def test_invalid_env(monkeypatch):
    monkeypatch.setenv("COORDINATOR_LEASE_S", "soon")
    with pytest.raises(ConfigError, match="COORDINATOR_LEASE_S='soon' is not a number"):
        Config.resolve()
    with pytest.raises(ConfigError, match="unknown settings"):
        Config.resolve(leese=1)
