"""Where a bundle lives: its store key, the settings that make it, the node's outbox.

A bundle of name ``name`` is one value under ``bundles/<environment>/<secret>/<namespace>/<name>``
in any store (:func:`bundle_key`): the environment's fingerprint, the secret's and the
namespace (``coordinator.protocol.fingerprint.key_prefix``), so that a job only finds
bundles it can install and verify.

The secret and namespace come from the arguments, else the ``config`` the caller
passes (a session's), else the session :func:`use_session_lookup` finds (``coordinator.api``
sets it to ``current_session``: the active ``compile_once``, or the last to exit), else
the settings' environment variables.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

from coordinator import _compat
from coordinator.bundles.format import KernelRecord
from coordinator.protocol.fingerprint import key_prefix
from coordinator.settings import Config, check_bundle_name

#: ``outbox`` as a bundle URL: this node's outbox, ``<Inductor cache dir>/coordinator-outbox``,
#: a ``file://`` store that the SLURM Epilog publishes from (``coordinator.jobs.slurm``).
OUTBOX = "coordinator-outbox"


class BundleSession(Protocol):
    """What the bundle functions read of a ``compile_once`` session."""

    config: Config
    kernels: KernelRecord


_session_lookup: Callable[[], BundleSession | None] = lambda: None  # noqa: E731


def use_session_lookup(lookup: Callable[[], BundleSession | None]) -> None:
    """Where a bundle function called with no ``config`` and no ``kernels`` finds the
    session whose settings and kernels it uses (``coordinator.api`` passes ``current_session``)."""
    global _session_lookup
    _session_lookup = lookup


def session_parts(config: Config | None, kernels: KernelRecord | None) -> tuple[Config | None, KernelRecord | None]:
    """``config`` and ``kernels``, or where neither is given those of the session found by
    :func:`use_session_lookup`'s lookup, if any."""
    if config is None and kernels is None:
        session = _session_lookup()
        if session is not None:
            return session.config, session.kernels
    return config, kernels


def bundle_settings(secret: str | bytes | None = None, namespace: str | None = None, *,
                    config: Config | None = None) -> tuple[bytes | None, str]:
    """The secret and namespace a bundle is signed and keyed with: the arguments, else
    ``config``'s, else those of the session found (see the module), else the settings'
    environment variables, else none.

    Raises:
        ConfigError: a setting is invalid.
    """
    config = session_parts(config, None)[0] or Config.resolve()
    config = config.replace(secret=secret, namespace=namespace)
    return config.secret, config.namespace


def bundle_url(url: str) -> str:
    """``url``, or for ``outbox`` the ``file://`` URL of this node's outbox in Inductor's
    cache dir (``TORCHINDUCTOR_CACHE_DIR``, else Inductor's default), found when called."""
    if url == "outbox":
        return "file://" + os.path.join(_compat.inductor_cache_dir(), OUTBOX)
    return url


def bundle_key(name: str = "default", namespace: str | None = None, secret: str | bytes | None = None, *,
               config: Config | None = None) -> str:
    """The store key of bundle ``name`` for this environment, secret and namespace (see
    :func:`bundle_settings`): ``bundles/<environment>/<secret>/<namespace>/<name>``, as
    ``coordinator.protocol.fingerprint.key_prefix`` names them.

    Raises:
        ConfigError: ``name`` cannot name a bundle.
    """
    check_bundle_name(name)
    secret, namespace = bundle_settings(secret, namespace, config=config)
    return f"bundles/{key_prefix(secret, namespace)}/{name}"
