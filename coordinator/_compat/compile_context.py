"""What this thread compiles, in words: what a claim says its claimant compiles.

A rank that claims a graph writes a short description of it into the claim's record
(``coordinator.protocol.claims``), and a rank that waits on the claim names it in its
waiting lines: the graph (AOTAutograd's graph number and whether it is a forward or a
backward), the frame's function, the split frame's part (DDPOptimizer's submodule), and
Dynamo's compile id (``frame/compile``, as tlparse and torch's logs name it). It is made
from what Dynamo and AOTAutograd already hold for the compile on this thread, with no
store call.

Private names: ``torch._guards.CompileContext.current_compile_id``;
``TracingContext.try_get`` and its ``traced_code`` (the frame's code first:
``OutputGraph.__init__`` appends it, and each inlined function's when its inlining ends,
so a frame that is Dynamo's own wrapper, ``external_utils.wrap_inline``'s ``inner`` around
a compiled module, is named by the last one: the module's ``forward``; a lazily compiled
backward runs in its forward's tracing context); ``torch._functorch._aot_autograd.logging_utils.graph_being_compiled``
(``["<aot id>_<forward|backward|inference>"]`` while AOTAutograd compiles a graph, a
module global that ``track_graph_compiling`` sets and clears); the split frame's part from
``split_frames.chain_position``. Read from 2.13.0's source; ran on 2.13.0 (CPU tests).
Every read is guarded: on a torch without one of them the description only says less.
"""

from __future__ import annotations

import os

from coordinator._compat.split_frames import chain_position


def compiling_now(part: tuple[int, int] | None = None) -> str:
    """What this thread compiles, e.g. ``"backward graph 1 of 'MLP.forward' (compile 0/0)"``
    or ``"forward graph 4 of part 2 of 3 of split frame 'GPT.forward' (compile 0/0)"``; "" outside
    any compile. ``part`` (index, count) names a split frame's part where the chain is not
    compiling one on this thread (a share compiled out of the chain)."""
    try:
        from torch._functorch._aot_autograd import logging_utils
        from torch._guards import CompileContext, TracingContext

        compile_id = CompileContext.current_compile_id()
        context = TracingContext.try_get()
        codes = getattr(context, "traced_code", None) if context is not None else None
        graphs = list(getattr(logging_utils, "graph_being_compiled", None) or ())
    except (ImportError, AttributeError):
        return ""
    frame = f"'{_function(codes)}'" if codes else ""
    if part is None:
        position = chain_position()
        if position is not None:
            part = (position[1], len(position[0]))
    pieces = []
    if graphs:
        number, _, which = str(graphs[-1]).partition("_")
        pieces.append(f"{which} graph {number}" if which and number.isdigit() else str(graphs[-1]))
    if part is not None:
        pieces.append(f"part {part[0] + 1} of {part[1]} of split frame {frame}".rstrip())
    elif frame:
        pieces.append(frame)
    text = " of ".join(pieces)
    if compile_id is not None:
        text = f"{text} (compile {compile_id})" if text else f"compile {compile_id}"
    return text


def _function(codes: list) -> str:
    """The qualified name of the function a frame compiles: its own code's, or where the
    frame is one of Dynamo's wrappers, the outermost function it inlined."""
    import torch._dynamo

    code = codes[0]
    if len(codes) > 1 and code.co_filename.startswith(os.path.dirname(torch._dynamo.__file__) + os.sep):
        code = codes[-1]
    return getattr(code, "co_qualname", code.co_name)
