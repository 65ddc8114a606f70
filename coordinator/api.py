"""The public entry points: ``compile_once``, ``stats`` and ``enable_from_env``.

``compile_once`` is a context manager around the part of a training script that
compiles (usually the whole training loop)::

    dist.init_process_group("nccl")
    with coordinator.compile_once():          # the job's own TCPStore, no server
        model = torch.compile(model)
        train(model)

Entering it costs nothing more than its settings' check: the session starts at the first
sign of a compile (``coordinator.starts``), and a script that compiles nothing inside it
pays nothing and logs no summary.

A launcher can switch the same thing on with no code change: with the ``enable``
setting on in the environment (``coordinator.settings.JobSettings``), :func:`enable_from_env`
(called from ``coordinator/_site/sitecustomize.py``) enters ``compile_once`` for the life
of the process and logs the summary at exit; with ``save_bundle`` set to a URL rank 0 also
saves the job's bundle there at exit (``outbox``: into the node's outbox, for the SLURM
Epilog).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from coordinator.bundles.keys import use_session_lookup
from coordinator.errors import ConfigError
from coordinator.observe.logs import show_coordinator_logs, show_logs_unless_configured
from coordinator.session import Session
from coordinator.settings import Config, JobSettings, config_differences, shown_url, take_enable_switch
from coordinator.starts import SessionStarts

log = logging.getLogger(__name__)

#: The session of the ``compile_once`` active in this process, and the last one to end.
_active: Session | None = None
_last: Session | None = None


def active_session() -> Session | None:
    """The session of the ``compile_once`` active in this process, if any."""
    return _active


@contextlib.contextmanager
def compile_once(store: Any = None, *, config: Config | None = None, **settings: Any) -> Iterator[Session]:
    """Compile each graph once across all ranks while the context is active.

    Args:
        store: ``None`` for the job's torch.distributed store, a ``redis://``,
            ``rediss://`` or ``file://`` URL, or a store object.
        config: a :class:`coordinator.Config` to start from instead of the environment.
        **settings: any field of :class:`coordinator.Config`, which lists each with its
            environment variable, default and meaning.

    Every setting left ``None`` comes from ``config`` if given, else its environment
    variable, else the default.

    Each rank logs one summary line when the session ends, and a line while it waits
    for another rank; with no logging set up in the script they go to stderr, after the
    rank (``[rank0]:coordinator: ...``), at ``COORDINATOR_LOG_LEVEL`` (default ``INFO``);
    where the script configured logging, its configuration governs
    (``coordinator.observe.logs``).

    Entered where a ``compile_once`` is already active in this process (a script run
    under ``coordinator-run``, which entered it for the whole process), it joins that
    session when its settings resolve to the same ones: it yields the active session,
    and leaving it leaves the session open for the outer ``compile_once`` to close.

    Raises:
        ConfigError: a setting is unknown or invalid, or a ``compile_once`` with
            other settings is already active in this process (each differing setting
            is named, with both values).
    """
    if config is None:
        config = Config.resolve(store=store, **settings)
    else:
        config = config.replace(store=store, **settings)
    show_logs_unless_configured(_rank_for_logs)
    global _active, _last
    active = _active
    if active is not None:
        differences = config_differences(active.config, config)
        if differences:
            raise ConfigError("compile_once is already active in this process with other settings: "
                              + "; ".join(differences))
        log.debug("compile_once: joining the session already active in this process")
        yield active  # the outer compile_once closes it
        return
    session = Session(config, parts=())
    _active = session
    try:
        with SessionStarts(session):
            yield session
    finally:
        session.close()
        _active, _last = None, session
        if session.started:
            log.info("%s", session.stats.summary())
            log.debug("%s", session.stats.details())
        else:
            log.debug("compile_once: nothing compiled or looked up in this process; the session never started")


def _rank_for_logs() -> int | None:
    """The rank the coordinator's log lines name where ``RANK`` is unset: the session's."""
    session = current_session()
    return None if session is None else session.stats.rank


def current_session() -> Session | None:
    """The active ``compile_once`` session, or the last one to exit, if any."""
    return _active or _last


# Bundle functions called without a session's settings use the active compile_once's.
use_session_lookup(current_session)


def stats() -> dict:
    """This rank's counters from the active ``compile_once``, or the last one to exit."""
    session = current_session()
    if session is None:
        return {}
    return session.stats.as_dict()


def enable_from_env() -> bool:
    """Enter ``compile_once`` for the rest of the process if the ``enable`` setting is on.

    The switch is taken out of the environment, so that the processes this one starts
    (Inductor's compile workers and CPU-feature probes, data-loader workers) do not
    enter ``compile_once`` too: they share no graphs, and importing the coordinator
    would add seconds to each one's start. The ``coordinator`` logger's lines are shown
    at the ``log_level`` setting (default ``INFO``; see ``coordinator.observe.logs``).

    Returns:
        True if it was switched on.

    Raises:
        ConfigError: a setting is invalid.
    """
    if not take_enable_switch():
        return False
    enter_for_process()
    return True


def enter_for_process() -> None:
    """Enter ``compile_once`` until the process exits (``enable_from_env``, once the switch
    is taken: ``coordinator/_site/sitecustomize.py`` takes it as the process starts).

    Raises:
        ConfigError: a setting is invalid.
    """
    job = JobSettings.resolve(names=("log_level", "save_bundle", "bundle_name"))
    show_coordinator_logs(job.log_level, rank=_rank_for_logs)
    context = compile_once()
    session = context.__enter__()
    atexit.register(context.__exit__, None, None, None)
    if job.save_bundle and os.environ.get("RANK", "0") == "0":
        # Registered after the exit above, so it runs first (atexit is last-in, first-out).
        atexit.register(_save_bundle_at_exit, job.save_bundle, job.bundle_name, session)
        session.when_started(lambda: threading.Thread(target=_connect, args=(job.save_bundle,),
                                                      name="coordinator-connect", daemon=True).start())


def _connect(url: str) -> None:
    """Open the bundle store's connection while the job runs (``Store.connect``): the save at
    exit runs where the interpreter starts no more threads."""
    from coordinator.bundles.keys import bundle_url
    from coordinator.protocol.stores import open_store

    try:
        open_store(bundle_url(url)).connect()
    except Exception as exc:  # the save at exit says what is wrong
        log.debug("compile_once: could not open %s yet: %s", shown_url(url), exc)


def _save_bundle_at_exit(url: str, name: str, session: Session) -> None:
    from coordinator.bundles import save_bundle

    if not session.started:
        log.debug("compile_once: nothing compiled; no bundle saved to %s", shown_url(url))
        return
    try:
        save_bundle(url, name=name, config=session.config, kernels=session.kernels)
    except Exception as exc:  # the job is done; never turn that into a failure
        log.warning("compile_once: could not save the job's bundle to %s: %s", shown_url(url), exc)
