"""A job whose values in its own store are signed with no secret set (for coordinator-run tests).

    signed_store_job.py OUT_DIR

Every worker compiles a tiny MLP and records what it publishes; once all are published,
each checks every value it published as read back from the job's TCPStore (signed, and
not with any secret but the job's), and rank 0 forges a value (a valid checksum, no
signature) that rank 1 then looks up. Writes ``OUT_DIR/rank<R>.json``.
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from coordinator.api import current_session
from coordinator.errors import IntegrityError
from coordinator.protocol.integrity import open_sealed, seal


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    session = current_session()
    flight = session.flight()
    published: list[str] = []
    publish_behind = flight.publish_behind

    def recording(key, *args, **kwargs):
        published.append(key)
        return publish_behind(key, *args, **kwargs)

    flight.publish_behind = recording
    torch.manual_seed(rank)
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 32 + 8 * rank), torch.nn.GELU(),
                                              torch.nn.Linear(32 + 8 * rank, 4)))
    model(torch.randn(8, 16)).pow(2).mean().backward()
    flight.drain(timedelta(seconds=60))
    checks = []
    for key in published:
        blob = flight.store.get(f"v/{key}")  # where a value lives in the store
        sealed = open_sealed(key, blob)  # checksums only: whether it carries a signature
        try:
            open_sealed(key, blob, secret=b"not the job's secret")
            other_secret = "accepted"
        except IntegrityError as exc:
            other_secret = str(exc)
        checks.append({"key": key, "signed": sealed.signed, "other_secret": other_secret})
    forged_key = session.store_key("fx_graph", "forged")
    if rank == 0:
        flight.store.set(f"v/{forged_key}", seal(forged_key, b"not a graph"))
    dist.barrier()
    forged = session.get("fx_graph", "forged") if rank == 1 else None
    report = {"published": checks, "forged_loaded": forged is not None,
              "secret_set": session.config.secret is not None,
              "job_secret_set": session.config.job_secret is not None,
              "job_secret_in_environment": "COORDINATOR_JOB_SECRET" in os.environ,
              "store_signed": session.config.store_secret is not None}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()  # after the forged lookup: rank 0's store outlives it


if __name__ == "__main__":
    main()
