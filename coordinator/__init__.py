"""coordinator: compile once per cluster for distributed ``torch.compile``.

The first rank to need a graph compiles it; every other rank waits on the job's
store and loads the result instead of compiling. See ``compile_once``.
"""

from coordinator.api import compile_once, enable_from_env, stats
from coordinator.bundles import broadcast_bundle, load_bundle, save_bundle
from coordinator.errors import (
    ConfigError,
    CoordinatorError,
    EnvironmentMismatch,
    IntegrityError,
    StoreError,
    WaitTimeout,
)
from coordinator.protocol.fingerprint import environment, fingerprint
from coordinator.protocol.stores import Store, open_store
from coordinator.settings import CACHE_KINDS, Config

__all__ = [
    "CACHE_KINDS", "Config", "ConfigError", "CoordinatorError", "EnvironmentMismatch", "IntegrityError", "Store",
    "StoreError", "WaitTimeout", "broadcast_bundle", "compile_once", "enable_from_env", "environment",
    "load_bundle", "save_bundle", "fingerprint", "open_store", "stats",
]
__version__ = "0.1.0"
