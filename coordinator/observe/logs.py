"""What a rank shows of the coordinator when it runs under ``coordinator-run``.

A library never configures logging for its user, and ``compile_once`` called from a
training script logs through ``logging.getLogger("coordinator...")`` only. Under
``coordinator-run`` the script may never have configured logging at all, and the user
asked for the coordinator: then a worker shows the ``coordinator`` logger's lines (the
per-rank summary at exit, who a rank waits for) at the job's ``log_level`` setting
(``coordinator.settings.JobSettings``; default ``INFO``; the launcher's
``--coordinator-log-level``). Only the ``coordinator`` logger is touched, never the root
logger. Its handler writes to stderr only while the root
logger has no handlers: once the script configures logging, records reach the script's
handlers instead, and nothing is printed twice.
"""

from __future__ import annotations

import logging
import os
import sys


class _UnlessConfigured(logging.StreamHandler):
    """Writes a record to stderr unless the root logger has handlers (which then get it)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def show_coordinator_logs(level: int, prefix: str | None = None) -> None:
    """Show the ``coordinator`` logger's records at ``level`` and above in this process,
    each line after ``prefix`` (default: ``[rank<RANK>] ``)."""
    logger = logging.getLogger("coordinator")
    logger.setLevel(level)
    if any(isinstance(handler, _UnlessConfigured) for handler in logger.handlers):
        return
    handler = _UnlessConfigured(sys.stderr)
    if prefix is None:
        prefix = f"[rank{os.environ.get('RANK', '0')}] "
    handler.setFormatter(logging.Formatter(prefix + "%(name)s: %(message)s"))
    logger.addHandler(handler)
