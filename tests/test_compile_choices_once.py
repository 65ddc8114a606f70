"""Each GEMM template choice compiled once: under ``compile_once`` a selection's
precompiles go to threads of the process, never to Inductor's compile workers
(``_compat.precompile_choices_in_process``); everything else keeps the workers.

Inductor's own ``make_precompile_fn`` returns before it precompiles anything on the
Python of this machine (3.11 <= 3.11.8, cpython#106905) and sends only Triton GPU
templates to the workers, so a stand-in in its place records what Inductor's check
(``AsyncCompile.use_process_pool()``) answers inside a selection. The GPU side is
measured by the recompile probe (``benchmarks/RESULTS.md`` at ddb6d09).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import concurrent.futures, json
    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.select_algorithm import AlgorithmSelectorCache
    import coordinator

    ready = concurrent.futures.Future()
    ready.set_result(None)
    AsyncCompile._ready_future = ready  # the workers are up: Inductor would use them
    inductor_config.compile_threads = 4
    seen = {}

    def stand_in(self, choices, name, inputs_key, precompilation_timeout_seconds=3600):
        seen["selecting thread"] = AsyncCompile.use_process_pool()
        with concurrent.futures.ThreadPoolExecutor(1) as other:
            seen["another thread"] = other.submit(AsyncCompile.use_process_pool).result()
        return lambda: {}

    AlgorithmSelectorCache.make_precompile_fn = stand_in
    seen["before"] = AsyncCompile.use_process_pool()
    with coordinator.compile_once():
        torch.compile(lambda x: x)  # the sign of a compile: the session's hooks are in from here
        AlgorithmSelectorCache.make_precompile_fn(object(), [], "mm", "key")
        seen["outside a selection"] = AsyncCompile.use_process_pool()
    seen["after"] = AsyncCompile.use_process_pool()
    seen["restored"] = AlgorithmSelectorCache.make_precompile_fn is stand_in
    print(json.dumps(seen))
""")


@pytest.mark.parametrize("once", ["1", "0"])
def test_a_selection_precompiles_in_threads_and_nothing_else_changes(tmp_path, once):
    script = tmp_path / "choices.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, COORDINATOR_COMPILE_CHOICES_ONCE=once, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {
        "before": True,
        "selecting thread": once == "0",  # in threads of this process when on
        "another thread": True,  # a kernel compiled meanwhile still goes to the workers
        "outside a selection": True,
        "after": True,
        "restored": True,
    }
