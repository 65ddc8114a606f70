"""DDP's split graphs served from AOTAutograd's cache.

AOTAutograd's cache bypasses the graphs DDPOptimizer splits out of a DDP model, so a
restart (and a rank that finds another rank's FX entries) runs AOTAutograd for each of
them again. With ``cache_ddp_graphs`` on, they are saved to it and served from it
(``_compat.cached_split_graphs``), on the torch versions that was checked on; elsewhere
the feature stays off, with one INFO line. What happened to each split graph is counted
in the session's stats (``Stats.record_split_graph``).
"""

from __future__ import annotations

from collections.abc import Iterable

from coordinator import _compat
from coordinator.features.base import Feature, supported


class SplitGraphs(Feature):
    """Saves and serves DDPOptimizer's split graphs through AOTAutograd's cache."""

    name = "split_graphs"

    def enabled(self, routed: frozenset[str]) -> bool:
        return supported(self.context.config.cache_ddp_graphs, _compat.split_graphs_unsupported,
                         "DDP's split graphs are not served from AOTAutograd's cache")

    def hooks(self, routed: frozenset[str]) -> Iterable:
        stats = self.context.stats
        return (_compat.cached_split_graphs(lambda event, _detail: stats.record_split_graph(event)),)
