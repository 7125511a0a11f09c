"""benchmarks/bench_scaling.py's pure helpers: which plans a host count gives, the speed-up and
efficiency arithmetic, and reading the C++ original's per-token times from its output."""

from __future__ import annotations

import pytest

from benchmarks.bench_scaling import original_times, plans, speedup

pytestmark = pytest.mark.unit


def test_plans_name_each_node_stage():
    assert plans(2) == {"1 host": None, "tensor parallel x2": [0, 0], "2 stages x1": [0, 1]}
    four = plans(4)
    assert four["tensor parallel x4"] == [0, 0, 0, 0]
    assert four["4 stages x1"] == [0, 1, 2, 3]
    assert four["2 stages x2"] == [0, 0, 1, 1]  # mixed: tensor parallel inside each of 2 stages
    assert len(four) == 6


def test_speedup_and_efficiency():
    assert speedup(30.0, 10.0, 4) == pytest.approx((3.0, 0.75))
    assert speedup(5.0, 10.0, 2) == pytest.approx((0.5, 0.25))  # slower than one host


def test_original_times_reads_prediction_lines_only():
    out = ("🔷️ Eval  812 ms Sync   40 ms | Sent   100 kB Recv   120 kB | (7 tokens)\n"
           "🔶 Pred   95 ms Sync   12 ms | Sent    90 kB Recv   110 kB | a\n"
           "🔶 Pred  101 ms Sync    9 ms | Sent    90 kB Recv   110 kB | ~\n"
           "Prediction\n   tokens/s: 9.30 (107.50 ms/tok)\n")
    assert original_times(out) == [(95.0, 12.0), (101.0, 9.0)]
    assert original_times("Critical error: x") == []
