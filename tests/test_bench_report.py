"""The comparison table's ratios are against the best baseline per statistic."""

from __future__ import annotations

import math

import pytest

from stages.bench.report import best_baseline, format_comparison, ratios_to_best

METRICS = {
    "eldr": {
        "median_tpot_ms": 20.0,
        "p99_tpot_ms": 33.0,
        "distinct_experts_per_layer": 70.0,
        "failed": 0,
    },
    "rr": {"median_tpot_ms": 25.0, "p99_tpot_ms": 30.0, "failed": 0},
    "jsq": {"median_tpot_ms": 24.0, "p99_tpot_ms": 31.0, "failed": 2},
    # Not a baseline: never the reference even when it is best.
    "oracle": {"median_tpot_ms": 10.0, "p99_tpot_ms": 10.0, "failed": 0},
}


def test_best_baseline_is_chosen_per_statistic() -> None:
    assert best_baseline(METRICS, "median_tpot_ms") == ("jsq", 24.0)
    assert best_baseline(METRICS, "p99_tpot_ms") == ("rr", 30.0)
    ratios = ratios_to_best(METRICS)
    assert ratios["eldr"]["median_tpot_ms"] == pytest.approx(20 / 24)
    assert ratios["eldr"]["p99_tpot_ms"] == pytest.approx(33 / 30)
    assert ratios["jsq"]["median_tpot_ms"] == pytest.approx(1.0)


def test_table_lists_every_policy_and_the_reference() -> None:
    text = format_comparison(METRICS, title="rate 60")
    lines = text.splitlines()
    assert lines[0] == "rate 60"
    assert [line.split()[0] for line in lines[3:7]] == ["eldr", "rr", "jsq", "oracle"]
    eldr_row = lines[3].split()
    assert eldr_row[-2:] == ["0.83", "1.10"]
    assert "best baseline: TPOT p50 jsq 24.00 ms, TPOT p99 rr 30.00 ms" in text
    assert "70.00" in lines[3] and "-" in lines[4].split()  # unknown experts shown as '-'


def test_without_baselines_ratios_are_unknown() -> None:
    only = {"eldr": METRICS["eldr"]}
    assert math.isnan(ratios_to_best(only)["eldr"]["median_tpot_ms"])
    assert "no baseline policy" in format_comparison(only)
