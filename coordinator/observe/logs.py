"""What a rank shows of the coordinator when nobody set up logging.

A library leaves logging to its user: a script that configured logging (handlers on the
root logger, or on the ``coordinator`` logger) gets the coordinator's records through its
own configuration, and nothing else is printed. Most training scripts configure none, and
then Python shows warnings only, so the lines a user needs (each rank's summary at exit,
whom a rank waits for) would be lost. So in that case, and only then, the ``coordinator``
logger gets a handler of its own that writes to stderr, each line after the rank as torch's
own distributed lines start (``[rank0]:coordinator: compile_once rank 0: compiled ...``;
warnings and errors name their level), at the ``log_level`` setting
(``COORDINATOR_LOG_LEVEL``, default ``INFO``):

* :func:`show_logs_unless_configured`, called by every ``compile_once``: the handler is
  added unless logging is configured, and the level is set unless the user set one (an
  explicit ``COORDINATOR_LOG_LEVEL`` always sets it);
* :func:`show_coordinator_logs`, called where the user asked for the coordinator's lines
  with a level (``coordinator-run``'s workers and the launcher itself): the level is set
  and the handler added.

The handler writes a record only while the root logger and the ``coordinator`` logger
have no other handlers: a script that configures logging later gets every record once,
through its own handlers. Only the ``coordinator`` logger is touched, never the root
logger. The rank a line names is read from ``RANK`` (torchrun's), else from the caller's
``rank`` function; it is never asked of ``torch.distributed``, whose rank reads inside a
compile would mark the graph rank-dependent (``coordinator.features.rank_dependence``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from coordinator.settings import JobSettings, variable

LOGGER = "coordinator"


class _Formatter(logging.Formatter):
    """``[rank<R>]:coordinator: <message>`` (or ``<prefix><message>`` where a prefix is
    given: the launcher's own lines name themselves); ``WARNING: `` and ``ERROR: `` before
    the message of those."""

    def __init__(self, prefix: str | None, rank: Callable[[], int | None] | None) -> None:
        super().__init__()
        self._prefix = prefix
        self._rank = rank

    def _line_prefix(self) -> str:
        if self._prefix is not None:
            return self._prefix
        rank: int | str | None = os.environ.get("RANK")
        if not rank and self._rank is not None:
            rank = self._rank()
        return (f"[rank{rank}]:" if rank not in (None, "") else "") + f"{LOGGER}: "

    def format(self, record: logging.LogRecord) -> str:
        level = f"{record.levelname}: " if record.levelno >= logging.WARNING else ""
        return f"{self._line_prefix()}{level}{super().format(record)}"


class _UnlessConfigured(logging.StreamHandler):
    """Writes a record to stderr unless logging is configured: the root logger, or the
    ``coordinator`` logger besides this handler, has handlers (which then get it)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not configured(self):
            super().emit(record)


def configured(ours: logging.Handler | None = None) -> bool:
    """Whether the user configured logging: the root logger has handlers, or the
    ``coordinator`` logger has handlers other than ``ours``."""
    if logging.getLogger().handlers:
        return True
    return any(handler is not ours and not isinstance(handler, _UnlessConfigured)
               for handler in logging.getLogger(LOGGER).handlers)


def _installed() -> bool:
    return any(isinstance(handler, _UnlessConfigured) for handler in logging.getLogger(LOGGER).handlers)


def _install(prefix: str | None, rank: Callable[[], int | None] | None) -> None:
    if _installed():
        return
    handler = _UnlessConfigured(sys.stderr)
    handler.setFormatter(_Formatter(prefix, rank))
    logging.getLogger(LOGGER).addHandler(handler)


def show_coordinator_logs(level: int, prefix: str | None = None, rank: Callable[[], int | None] | None = None) -> None:
    """Show the ``coordinator`` logger's records at ``level`` and above in this process, on
    stderr while logging is unconfigured, each line after ``prefix`` (default: the rank and
    the logger, ``[rank<R>]:coordinator: ``, the rank from ``RANK`` or else ``rank()``)."""
    logging.getLogger(LOGGER).setLevel(level)
    _install(prefix, rank)


def show_logs_unless_configured(rank: Callable[[], int | None] | None = None) -> None:
    """What ``compile_once`` does: show the ``coordinator`` logger's records on stderr
    unless the user configured logging, at ``COORDINATOR_LOG_LEVEL`` (default ``INFO``,
    unless the user set the logger's level).

    Raises:
        ConfigError: ``COORDINATOR_LOG_LEVEL`` is not a level.
    """
    logger = logging.getLogger(LOGGER)
    explicit = bool(os.environ.get(variable("log_level"), "").strip())
    if explicit:
        logger.setLevel(JobSettings.resolve(names=("log_level",)).log_level)
    if _installed() or configured():
        return  # shown already, or the user's configuration governs
    if logger.level == logging.NOTSET:
        logger.setLevel(JobSettings().log_level)
    _install(None, rank)
