"""The coordinator's events in torch's structured trace (``TORCH_TRACE``), for tlparse.

tlparse reads two kinds of records from a rank's trace log: ``chromium_event`` records
(merged into its Perfetto timeline, ``chromium_events.json``) and ``artifact`` records
(listed on the rank's page under the compile id they were logged in, or under ``-_-_-_-``
outside a compile). Each coordinator event becomes one of each. Private names:
``torch._logging.trace_structured`` (``chromium_event`` and ``artifact`` records) and its
``trace_log`` (``_logging._internal.trace_log``, whose handlers say whether ``TORCH_TRACE``
is on), ``torch._guards.CompileContext.current_compile_id``. Ran on 2.13.0 and 2.14.1 (CPU
tests, with tlparse 0.4.3); ``current_compile_id`` and ``trace_log`` also on 2.11.0 on an
H200 (a traced job without ``TORCH_TRACE``).
"""

from __future__ import annotations

import json
from typing import Any


def structured_trace_on() -> bool:
    """Whether torch's structured trace is being written (``TORCH_TRACE``, or tlparse's own
    switch): its handler is installed when torch configures its logging."""
    from torch._logging._internal import trace_log

    return bool(trace_log.handlers)


def current_compile_id() -> str | None:
    """Dynamo's id of the compile this thread is in (``"0/1"``: frame 0, its second
    compile), as tlparse names it; ``None`` outside a compile."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return None if compile_id is None else str(compile_id)


def emit_structured(event: dict[str, Any]) -> None:
    """Write ``event`` (a Chrome trace event) as a chromium event and as an artifact named
    ``coordinator_<name>``. On the timeline it sits on its own row (``tid`` 1) of the
    process that holds Dynamo's and Inductor's events (``pid`` 0, as torch writes them)."""
    from torch._logging import trace_structured

    timeline_event = dict(event, pid=0, tid=1)
    trace_structured("chromium_event", payload_fn=lambda: timeline_event, expect_trace_id=False)
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"coordinator_{event['name'].replace(' ', '_')}", "encoding": "json"},
        payload_fn=lambda: json.dumps(event),
        expect_trace_id=False,
    )
