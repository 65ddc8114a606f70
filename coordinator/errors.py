"""The coordinator's exceptions.

Everything the library raises on purpose derives from :class:`CoordinatorError`, so a
training script can catch one type. Most of these never reach the user during
compilation: a store failure or a rejected value turns into a local compile (see
``singleflight``); they surface from the explicit APIs (opening a store, reading a
value by hand) and in tests.
"""


class CoordinatorError(RuntimeError):
    """Base class of every error raised by the coordinator."""


class ConfigError(CoordinatorError, ValueError):
    """A setting (argument or environment variable) has an invalid value."""


class StoreError(CoordinatorError):
    """The key-value store failed (connection lost, server gone, I/O error)."""


class StoreFull(StoreError):
    """The store refused a write for lack of room (Redis at ``maxmemory`` under
    ``noeviction``, a full disk under a directory store); it can still be read."""


class IntegrityError(CoordinatorError):
    """A stored value failed its checksum, signature, key binding or format check."""


class WaitTimeout(CoordinatorError):
    """Waiting for another rank to publish a key passed the configured deadline."""


class EnvironmentMismatch(IntegrityError):
    """A bundle was built in another environment (torch, Triton, CUDA, GPU, Python...)."""
