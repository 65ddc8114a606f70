"""One process of a split-autotuning test: a selecting rank or a waiting rank, on a real store.

Usage: ``python split_tuning_proc.py '<json spec>'``. Work items are :class:`FakeRequest`
benchmarks: they sleep for a "compile" and a "run" and return a fixed time, and append
``<pid> <index>`` to a shared log so that a test can count who ran what.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import timedelta


class FakeRequest:
    """A benchmark request that travels to other ranks, as Inductor's do."""

    def __init__(self, index: int, ms: float, *, compile_s: float = 0.0, run_s: float = 0.0,
                 log: str | None = None, hang_in: int | None = None, fail_in: int | None = None) -> None:
        self.index, self.ms, self.compile_s, self.run_s, self.log = index, ms, compile_s, run_s, log
        self.hang_in, self.fail_in = hang_in, fail_in

    def prepare(self) -> None:  # the compile: outside the device lock
        record(self.log, self.index)
        if self.hang_in == os.getpid():
            time.sleep(600)
        time.sleep(self.compile_s)

    def run(self) -> float:
        if self.fail_in == os.getpid():
            raise RuntimeError("fake benchmark failure")
        time.sleep(self.run_s)
        return self.ms


def record(log: str | None, index: int) -> None:
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {index}\n")


def open_test_store(spec: str):
    from coordinator.stores import open_store

    if spec.startswith("tcp://"):
        import torch.distributed as dist

        host, port = spec[len("tcp://"):].rsplit(":", 1)
        return open_store(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10)))
    return open_store(spec)


def main() -> None:
    spec = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, format=f"[{spec['role']} {os.getpid()}] %(name)s: %(message)s")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from split_tuning_proc import FakeRequest  # noqa: PLC0415 - pickled by module name, not __main__

    from coordinator.split_tuning import SplitTuning, WorkItem

    store = open_test_store(spec["store"])
    reference = spec.get("reference")
    tuning = SplitTuning(
        store,
        prefix="test",
        rank=spec["rank"],
        secret=spec.get("secret", "").encode() or None,
        reference_ms=lambda: reference,
        backup_after=timedelta(seconds=spec.get("backup_after", 20)),
    )
    log_path = spec["log"]
    out: dict = {"pid": os.getpid()}
    if spec["role"] == "select":
        items = []
        for index, (ms, compile_s, run_s) in enumerate(spec["items"]):
            def run_here(index=index, ms=ms, compile_s=compile_s, run_s=run_s):
                record(log_path, index)
                if spec.get("die_after") is not None and spec["die_after"] <= sum(1 for _ in open(log_path)):
                    os._exit(9)  # a selecting rank that dies part-way
                time.sleep(compile_s + run_s)
                return ms
            request = FakeRequest(index, ms, compile_s=compile_s, run_s=run_s, log=log_path,
                                  hang_in=spec.get("hang_in"), fail_in=spec.get("fail_in"))
            items.append(WorkItem(f"choice{index}", run_here, request if spec.get("travel", True) else None))
        if spec.get("start_after_file"):
            while not os.path.exists(spec["start_after_file"]):
                time.sleep(0.01)
        started = time.monotonic()
        out["timings"] = tuning.select(spec["selection"], items)
        out["select_s"] = time.monotonic() - started
    else:
        print(f"helping {os.getpid()}", flush=True)
        deadline = time.monotonic() + spec.get("help_for", 30)
        while time.monotonic() < deadline and not os.path.exists(spec["stop_file"]):
            if not tuning.help_once():
                time.sleep(0.01)
    import dataclasses

    out["counts"] = dataclasses.asdict(tuning.counts)
    with open(spec["out"], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
