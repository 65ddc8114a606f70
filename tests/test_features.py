"""The seam of a compile feature: a toy feature listed in the registry is built by each
session, installs its hooks while caches are routed, hears the lookups and saves of a
real compile, and shows its counts in ``coordinator.stats()``."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import coordinator
from coordinator import features
from coordinator.features.base import Feature


@dataclasses.dataclass
class ToyCounts:
    misses: int = 0
    saves: int = 0
    hits: int = 0

    def summary(self) -> str:
        return f"the toy saw {self.misses} misses"


class Toy(Feature):
    """Counts FX-graph misses, saves and verified hits; records its hook's life."""

    name = "toy"
    switched_on = True
    life: list[str] = []

    def __init__(self, context) -> None:
        super().__init__(context)
        self.counts = ToyCounts()

    def enabled(self, routed: frozenset[str]) -> bool:
        return self.switched_on and "fx_graph" in routed

    def hooks(self, routed: frozenset[str]):
        @contextlib.contextmanager
        def hook():
            Toy.life.append("installed")
            yield
            Toy.life.append("removed")

        return (hook(),)

    def missed(self, kind: str, key: str, inductor_key: str) -> None:
        if kind == "fx_graph":
            self.counts.misses += 1

    def publishes(self, flight, kind: str, key: str, data: bytes) -> bool:
        if kind == "fx_graph":
            self.counts.saves += 1
        return False  # the session publishes it as usual

    def accepts(self, kind: str, key: str, meta: dict) -> bool:
        if kind == "fx_graph":
            self.counts.hits += 1
        return True


def _compile_and_run(seed: float) -> torch.Tensor:
    torch._dynamo.reset()

    @torch.compile(backend="inductor")
    def toy_function(x):
        return (x * seed).sin() + x.cos()

    return toy_function(torch.ones(8))


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(features, "FEATURES", [*features.FEATURES, Toy])
    monkeypatch.setattr(Toy, "life", [])
    return Toy


def test_a_registered_feature_gets_its_hooks_and_counts(toy, tmp_path, monkeypatch):
    store = f"file://{tmp_path / 'store'}"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "first"))
    with coordinator.compile_once(store, caches="fx_graph") as session:
        assert toy.life == []  # its part starts at the first sign of a compile
        expected = _compile_and_run(3.0)
        assert toy.life == ["installed"]
        mine = session.stats.as_dict()["toy"]
    assert toy.life == ["installed", "removed"]
    assert mine == {"misses": 1, "saves": 1, "hits": 0}
    assert "the toy saw 1 misses" in session.stats.details()

    # Another node (an empty Inductor dir) receives the graph: the toy sees the hit.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "second"))
    with coordinator.compile_once(store, caches="fx_graph"):
        torch.testing.assert_close(_compile_and_run(3.0), expected)
    after = coordinator.stats()
    assert after["toy"] == {"misses": 0, "saves": 0, "hits": 1}
    assert after["graphs_received"] == 1


def test_a_feature_that_is_off_installs_nothing_and_counts_none(toy, tmp_path, monkeypatch):
    monkeypatch.setattr(Toy, "switched_on", False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    with coordinator.compile_once(f"file://{tmp_path / 'store'}", caches="fx_graph"):
        _compile_and_run(5.0)
    assert toy.life == []
    assert coordinator.stats()["toy"] is None
    assert coordinator.stats()["graphs_compiled"] == 1
