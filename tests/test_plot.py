"""benchmarks/plot.py: ratios as printed, or against one-rank runs measured beside the run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import plot

LOG = """one rank compiling alone: 423.62s; step 1 with a warm local cache: 8.53s
N=2 (d) compile_once, job store            run 1:  451.47s (1.07x)
N=2 (d) compile_once, job store             451.47s (1.07x)  runs 451.5  FX 6  Triton 571  CPU 683s
"""


def results(path: Path, alone_runs: list[float], references_alone: float) -> str:
    rows = [{"n": 1, "row": "(a) every rank compiles", "runs": [{"all_done_s": s} for s in alone_runs]}] if alone_runs else []
    path.write_text(json.dumps({"references": {"alone_s": references_alone}, "rows": rows}))
    return str(path)


def test_ratio_as_printed_without_references():
    assert plot.parse(LOG) == {2: {"(d) compile_once, job store": 1.07}}


def test_ratio_against_the_mean_of_one_rank_runs_beside_it(tmp_path):
    before = results(tmp_path / "a1.json", [406.68], references_alone=423.62)
    after = results(tmp_path / "a2.json", [428.70], references_alone=423.62)
    alone = plot.one_rank_s([before, after])
    assert alone == pytest.approx(417.69)  # the files' own (a) N=1 runs, not their reused references
    assert plot.parse(LOG, alone)[2]["(d) compile_once, job store"] == pytest.approx(451.47 / 417.69)


def test_a_references_only_file_gives_its_references(tmp_path):
    refs = results(tmp_path / "refs.json", [], references_alone=364.22)
    assert plot.one_rank_s([refs]) == pytest.approx(364.22)
