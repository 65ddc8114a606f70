"""One process of a run of concurrent writers and readers of kernel groups in one Triton
cache dir (``tests/test_triton_kernels.py``; ``TRITON_CACHE_DIR`` is the shared dir).

    python triton_install_job.py install|triton|read WRITER ROUNDS START_FILE

``install``: for each round's kernel key, installs a group of its own bytes (each file says
which writer and round it is) as the session installs a received kernel
(``_compat.install_group``), and checks what it returned. ``triton``: writes the same keys
as Triton does when it compiles one itself (``FileCacheManager.put`` of each file, then
``put_group``). ``read``: asks every key's group as Triton does (``get_group``) until every
round's key has one, and reads each group it gets. All start once ``START_FILE`` exists.
Prints one JSON line: the groups returned or read, and each one whose files name more than
one writer or round (``mixed``), or that were not all there (``partial``).
"""

from __future__ import annotations

import json
import os
import sys
import time

from triton.runtime.cache import FileCacheManager

from coordinator import _compat

FILES = ("kernel.cubin", "kernel.json", "kernel.ptx")


def contents(writer: str, round_: int) -> dict[str, bytes]:
    tag = f"{writer}/{round_}".encode()
    return {name: tag + b"\n" + os.urandom(2048 * (i + 1)) for i, name in enumerate(FILES)}


def tags(group: dict[str, str]) -> set[bytes] | None:
    """The writer/round each file of ``group`` names, or ``None`` if a file is not there."""
    found = set()
    for path in group.values():
        try:
            with open(path, "rb") as f:
                found.add(f.readline().strip())
        except OSError:
            return None
    return found


def main() -> None:
    role, writer, rounds, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    while not os.path.exists(start):
        time.sleep(0.001)
    report = {"role": role, "writer": writer, "groups": 0, "mixed": [], "partial": [], "refused": 0}
    if role == "read":
        seen: set[int] = set()
        deadline = time.monotonic() + 120
        while len(seen) < rounds and time.monotonic() < deadline:
            for round_ in range(rounds):
                group = FileCacheManager(f"KEY{round_:04d}").get_group("kernel.json")
                if group is None:
                    continue
                found = tags(group)
                if found is None:
                    report["partial"].append(round_)
                elif len(found) != 1:
                    report["mixed"].append([round_, sorted(t.decode() for t in found)])
                report["groups"] += 1
                seen.add(round_)
        report["rounds_seen"] = len(seen)
    for round_ in range(rounds if role != "read" else 0):
        manager = FileCacheManager(f"KEY{round_:04d}")
        files = contents(writer, round_)
        if role == "install":
            group = _compat.install_group(manager, "kernel.json", files)
            if group is None:
                report["refused"] += 1
                continue
            if tags(group) != {f"{writer}/{round_}".encode()}:
                report["mixed"].append([round_, sorted(t.decode() for t in (tags(group) or ()))])
        else:
            group = {name: manager.put(data, name) for name, data in files.items()}
            manager.put_group("kernel.json", group)
        report["groups"] += 1
    print(json.dumps(report))


if __name__ == "__main__":
    main()
