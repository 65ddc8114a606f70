"""Compile features, and the one list of them a session builds.

Each feature is a :class:`~coordinator.features.base.Feature` in a module of its own
(``base`` says what a feature is given and may contribute). Adding one is a new module
and one line in :data:`FEATURES`; the order is the order in which a session asks them
at each point of a lookup and installs their hooks. Each belongs to a part of the session
(``Feature.part``), which starts at the first sign that it is needed (``coordinator.starts``).
"""

from __future__ import annotations

from coordinator.features.base import Context, Feature, Part
from coordinator.features.compile_choices import CompileChoicesOnce
from coordinator.features.compile_workers import CompileWorkers
from coordinator.features.early_backward import EarlyBackwards
from coordinator.features.inductor_setup import InductorSetUp
from coordinator.features.local_hits import LocalHits
from coordinator.features.persistent import PersistentLayer
from coordinator.features.precompiled import PrecompiledFunctions
from coordinator.features.prefetch import Prefetch
from coordinator.features.rank_dependence import RankDependence
from coordinator.features.split_graphs import SplitGraphs
from coordinator.features.split_shares import SplitShares
from coordinator.features.triton_kernels import TritonKernels
from coordinator.features.tuning_steps import TuningSteps

#: Every compile feature, in the order a session asks them (what was fetched ahead first,
#: then the persistent layer: it answers a miss before any feature acts on one).
FEATURES: list[type[Feature]] = [
    Prefetch,
    PersistentLayer,
    RankDependence,
    TuningSteps,
    SplitGraphs,
    SplitShares,
    EarlyBackwards,
    LocalHits,
    PrecompiledFunctions,
    CompileChoicesOnce,
    CompileWorkers,
    InductorSetUp,
    TritonKernels,
]

__all__ = ["FEATURES", "Context", "Feature", "Part"]
