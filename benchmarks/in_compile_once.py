"""Run a training script inside ``with coordinator.compile_once():``, under plain ``torchrun``.

    torchrun --standalone --nproc-per-node 2 benchmarks/in_compile_once.py SCRIPT [ARGS...]

The context-manager way in, for a script that was not written for it: the session is
entered before the script's first line, and opens the job's store at its first compile,
after the script's own ``init_process_group``. Nothing else changes: plain ``torchrun``
gives local rank ``i`` its ``cuda:i``.
"""

import os
import runpy
import sys

import coordinator

if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # the script's own imports, as if run itself
    with coordinator.compile_once():
        runpy.run_path(script, run_name="__main__")
