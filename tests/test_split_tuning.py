"""GEMM selections tuned in shares by the ranks that reach them (``coordinator.features.split_tuning``).

Real jobs: one process per rank (``tests/split_tuning_worker.py``), gloo and the job's
TCPStore, as torchrun starts them. No GPU runs here: each rank is given a GPU identity of
its own (or one for all), and choices are not really timed: a choice's timing is a hash
of its ``hash_key()``, and each rank records the choices it timed.

The first test goes through Inductor's real selection path (``AlgorithmSelectorCache`` on
the CPU's ``CPP,ATEN`` GEMM choices of a frozen ``Linear``; its benchmark of a choice
faked). The protocol tests hand the session's feature a thin made-up selection instead,
as ``_compat.split_selections`` hands it Inductor's: they test the coordinator's own split,
claims, takeover and merge, with more choices and without compiling.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import run_job

from coordinator import Config
from coordinator.features.split_tuning import split

WORKER = Path(__file__).with_name("split_tuning_worker.py")


def run(tmp_path: Path, world: int, options: dict, rank_options: dict[int, dict] | None = None,
        timeout: float = 120) -> list[tuple[int, str, dict | None]]:
    """Start ``world`` ranks on one node; each rank's (exit code, log, report)."""
    markers = tmp_path / "markers"
    markers.mkdir()
    results = run_job(tmp_path, world, dict(options, markers=str(markers)), rank_options=rank_options,
                      timeout=timeout, worker=WORKER)
    return [(r.returncode, r.log, r.report) for r in results]


def succeeded(results) -> list[dict]:
    for rank, (code, log, report) in enumerate(results):
        assert code == 0 and report is not None, f"rank {rank} failed ({code}):\n{log[-4000:]}"
    return [report for _, _, report in results]


def counts(report: dict) -> dict:
    return report["stats"]["split_tuning"]


def test_ranks_time_a_share_each_of_inductors_selection_and_pick_the_same_winner(tmp_path):
    reports = succeeded(run(tmp_path, 2, {"mode": "inductor"},
                            rank_options={0: {"wait_for": [1]}, 1: {"wait_for": [0]}}))
    selections = [report["winners"] for report in reports]
    assert all(len(found) == 1 for found in selections), selections
    (first,), (second,) = selections
    assert first["choices"] == second["choices"] and len(first["choices"]) >= 2, selections  # one selection
    # Each rank timed its own share only: disjoint, and together every choice once.
    timed = [sorted(report["timed"]) for report in reports]
    assert all(timed) and sorted(timed[0] + timed[1]) == first["choices"], timed
    # Both picked the fastest over all shares: an ATen choice (faster in the made-up timings),
    # which only one of them timed.
    assert first["winner"] == second["winner"] and first["winner"] in first["externs"], selections
    assert [counts(r)["shares_timed"] for r in reports] == [1, 1]
    assert [counts(r)["shares_received"] for r in reports] == [1, 1]


@pytest.mark.protocol
def test_the_split_is_deterministic_disjoint_and_covers_every_choice():
    hashes = [f"{(i * 7919) % 101:04x}" for i in range(37)]
    for shares in (1, 2, 3, 4, 8, 40):
        order, members = split(hashes, shares)
        assert (order, members) == split(list(hashes), shares)
        assert sorted(i for share in members for i in share) == list(range(len(hashes)))
        assert [hashes[i] for i in order] == sorted(hashes)
        assert max(map(len, members)) - min(map(len, members)) <= 1
    # Another rank's list in another order gives each choice the same share.
    _, members = split(hashes, 4)
    _, reversed_members = split(hashes[::-1], 4)
    by_hash = [{hashes[i] for i in share} for share in members]
    assert by_hash == [{hashes[::-1][i] for i in share} for share in reversed_members]


@pytest.mark.protocol
def test_ranks_with_a_gpu_each_split_a_selection_and_a_rank_sharing_a_gpu_tunes_as_today(tmp_path):
    # Three local ranks: three shares. Ranks 0 and 1 have a GPU each; rank 2 uses rank 0's
    # GPU and decides after rank 0 marked it: it tunes as Inductor does, every choice itself.
    options = {"mode": "protocol", "choices": 10, "ms_per_choice": 50}
    reports = succeeded(run(tmp_path, 3, options, rank_options={
        0: {"wait_for": [1]}, 1: {"wait_for": [0]}, 2: {"gpu": 0, "decide_after": [0]}}))
    assert [report["wants"] for report in reports] == [True, True, False]
    choices = reports[0]["winners"][0]["choices"]
    assert len({report["winners"][0]["winner"] for report in reports}) == 1
    assert reports[0]["winners"][0]["winner"] == min(choices, key=_fake_ms)
    # The two ranks that split it timed each choice once between them: their own shares,
    # and the third share (no rank's own here) by whichever was free first.
    _, members = split(choices, 3)
    shares = [{choices[i] for i in share} for share in members]
    timed = [set(report["timed"]) for report in reports[:2]]
    assert sorted(reports[0]["timed"] + reports[1]["timed"]) == choices
    assert shares[0] <= timed[0] and shares[1] <= timed[1]
    assert sorted(counts(r)["shares_timed"] for r in reports[:2]) == [1, 2]
    assert sorted(counts(r)["shares_received"] for r in reports[:2]) == [1, 2]
    assert sorted(reports[2]["timed"]) == choices and counts(reports[2])["selections"] == 0


@pytest.mark.protocol
def test_a_rank_killed_in_its_share_is_taken_over_and_the_job_finishes(tmp_path):
    options = {"mode": "protocol", "choices": 6, "lease": 2}
    results = run(tmp_path, 2, options,
                  rank_options={1: {"die_in_share": True}, 0: {"wait_for": [1], "barrier_last": False}})
    code, log, _ = results[1]
    assert code == 17, log[-3000:]
    code, log, report = results[0]
    assert code == 0 and report is not None, log[-4000:]
    assert counts(report)["shares_timed"] == 2 and counts(report)["taken_over"] == 1, counts(report)
    assert sorted(report["timed"]) == report["winners"][0]["choices"]  # rank 0 timed all, its share and rank 1's
    assert report["winners"][0]["winner"] == min(report["winners"][0]["choices"], key=_fake_ms)


def _fake_ms(hash_key: str) -> float:
    sys.path.insert(0, str(WORKER.parent))
    from split_tuning_worker import fake_ms

    return fake_ms(hash_key, False)


@pytest.mark.protocol
def test_a_share_never_waits_for_a_rank_in_a_collective(tmp_path):
    # Rank 0 is in a barrier that rank 1 joins only after its selection: rank 1 finds rank
    # 0's share unclaimed, times it itself, and the barrier completes.
    options = {"mode": "protocol", "choices": 6, "lease": 30}
    reports = succeeded(run(tmp_path, 2, options, rank_options={0: {"barrier_first": True, "barrier_last": False}},
                            timeout=90))
    tuned = reports[1]
    assert counts(tuned)["shares_timed"] == 2 and counts(tuned)["shares_received"] == 0, counts(tuned)
    assert sorted(tuned["timed"]) == tuned["winners"][0]["choices"]
    assert reports[0]["barrier_s"] < 30  # far below a lease: no share was waited for
    # Rank 0 reached the selection after the barrier and found both shares timed.
    assert counts(reports[0])["shares_received"] == 2 and reports[0]["timed"] == []
    assert reports[0]["winners"] == tuned["winners"]


def test_the_setting_is_off_by_default():
    assert Config.resolve(environ={}).split_tuning is False
    assert Config.resolve(environ={"COORDINATOR_SPLIT_TUNING": "1"}).split_tuning is True
    assert Config.resolve(environ={"COORDINATOR_SPLIT_TUNING": "1"}, split_tuning=False).split_tuning is False
