"""One rank of a split-tuning test job (``tests/test_split_tuning.py``), started as torchrun
would start it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT): gloo, the
job's TCPStore, ``compile_once(split_tuning=True)``.

The CPU has no GPU, so the rank's GPU identity is set here (``gpu``: the index of the
made-up GPU it uses, its rank by default; ranks given the same index share a device), and
no choice is really timed: a choice's timing is a hash of its ``hash_key()``, the same in
every process, and the choices a rank times are recorded (``timed``). Two modes:

* ``inductor``: a frozen ``Linear`` compiled in max-autotune with ``CPP,ATEN`` GEMM backends:
  Inductor's own selection path (``AlgorithmSelectorCache``: its precompile, its local
  timing cache, its ``benchmark_choice``, here faked); each rank compiles another epilogue,
  so another FX graph with the same GEMM selection. The winner Inductor returns is recorded.
* ``protocol``: a thin selection of ``choices`` made-up choices handed straight to the
  session's split-tuning feature (``SplitTuning.tune``), as ``_compat.split_selections``
  hands Inductor's; the winner is the first minimum of what it returns.

``barrier_last`` (default on): a gloo barrier at the end, which keeps the store's host
(rank 0) up until every rank is done. ``die_in_share``: the rank exits (``os._exit``) while
it times its first share, holding its claim. ``decide_after``: the rank decides whether it
takes part only once the ranks named there have started timing. ``barrier_first``: the
rank enters a gloo barrier before anything else (it reaches the selection only once the
others join it). ``wait_for``: the timing of the first choice waits until every rank named
there has started timing (each then holds its own share).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import coordinator
from coordinator import _compat
from coordinator.features.split_tuning import SplitTuning


def fake_ms(hash_key: str, extern: bool) -> float:
    """A choice's made-up timing: from its hash; ATen's choices (extern) are faster."""
    fraction = int(hashlib.sha256(hash_key.encode()).hexdigest()[:8], 16) / 2**32
    return 1.0 + fraction + (0.0 if extern else 1.0)


def main() -> None:
    options = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    markers = Path(options["markers"])
    out = Path(options["out"])
    report: dict = {"rank": rank, "timed": [], "winners": []}
    identity = f"fake-gpu-{options.get('gpu', rank)}"
    _compat.gpu_identity = lambda: (identity, "")

    def started_timing() -> None:
        if report["timed"]:
            return
        (markers / f"timing-{rank}").touch()
        if options.get("die_in_share"):
            os._exit(17)
        deadline = time.monotonic() + 60
        for other in options.get("wait_for", []):
            while not (markers / f"timing-{other}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if options.get("barrier_first"):
        began = time.monotonic()
        dist.barrier()
        report["barrier_s"] = time.monotonic() - began
    settings = {"split_tuning": options.get("split_tuning", True), "lease": options.get("lease", 20)}
    began = time.monotonic()
    with coordinator.compile_once(**settings) as session:
        if options["mode"] == "inductor":
            run_inductor(rank, report, started_timing)
        else:
            run_protocol(session, options, report, started_timing)
        report["stats"] = coordinator.stats()
    report["seconds"] = time.monotonic() - began
    if options.get("barrier_last", True):
        dist.barrier()
    dist.destroy_process_group()
    out.write_text(json.dumps(report))


def run_inductor(rank: int, report: dict, started_timing) -> None:
    import torch._inductor.config as inductor_config
    from torch._inductor.select_algorithm import AlgorithmSelectorCache, ExternKernelCaller

    def benchmark_choice(cls, choice, autotune_args):
        started_timing()
        report["timed"].append(choice.hash_key())
        return fake_ms(choice.hash_key(), isinstance(choice, ExternKernelCaller))

    select = AlgorithmSelectorCache.__call__

    def call(self, name, choices, *args, **kwargs):
        node, choice = select(self, name, choices, *args, **kwargs)
        if len(choices) > 1:
            report["winners"].append({"name": name, "winner": choice.hash_key(),
                                      "choices": sorted(c.hash_key() for c in choices),
                                      "externs": sorted(c.hash_key() for c in choices
                                                        if isinstance(c, ExternKernelCaller))})
        return node, choice

    AlgorithmSelectorCache.benchmark_choice = classmethod(benchmark_choice)
    AlgorithmSelectorCache.__call__ = call
    inductor_config.max_autotune = True
    inductor_config.max_autotune_gemm_backends = "CPP,ATEN"
    inductor_config.freezing = True
    torch.manual_seed(0)
    epilogue = torch.nn.ReLU() if rank % 2 == 0 else torch.nn.Sigmoid()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), epilogue).eval()
    with torch.no_grad():
        torch.compile(model)(torch.randn(32, 64))


def run_protocol(session, options: dict, report: dict, started_timing) -> None:
    feature = session.feature(SplitTuning)
    deadline = time.monotonic() + 60
    for other in options.get("decide_after", []):
        while not (Path(options["markers"]) / f"timing-{other}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    report["wants"] = feature.wants()
    hashes = [hashlib.sha256(f"choice {i}".encode()).hexdigest()[:20] for i in range(options["choices"])]
    names = [f"choice {i}" for i in range(options["choices"])]

    def benchmark(indices):
        started_timing()
        time.sleep(options.get("ms_per_choice", 0) / 1000)
        report["timed"].extend(hashes[i] for i in indices)
        return {i: fake_ms(hashes[i], False) for i in indices}

    selection = _compat.Selection("a made-up selection", names, hashes, benchmark)
    if report["wants"]:
        timings = feature.tune(selection)
    else:  # tuned as Inductor tunes it: every choice here
        timings = benchmark(list(range(len(hashes))))
    winner = min(timings, key=timings.__getitem__)
    report["winners"].append({"winner": hashes[winner], "choices": sorted(hashes)})


if __name__ == "__main__":
    main()
