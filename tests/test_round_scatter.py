"""The replay's round-by-round scatter: what no replay of a round can know about it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stages.bench.metrics import RequestTable
from stages.bench.replay.round_scatter import round_medians, round_scatter, simulated_round_tpot


def test_round_medians_skip_failures_and_leave_empty_rounds_nan() -> None:
    medians = round_medians([np.array([0.1, np.nan, 0.3, 0.2]), np.array([np.nan])])
    assert medians[0] == pytest.approx(0.2) and math.isnan(medians[1])


def test_simulated_rounds_are_cut_by_their_sizes_and_drop_one_token_answers() -> None:
    table = RequestTable(
        success=np.array([True, True, False, True, True]),
        prompt_tokens=np.full(5, 10),
        output_tokens=np.array([11, 1, 11, 21, 11]),
        ttft_s=np.array([0.5, 0.5, np.nan, 0.5, 0.5]),
        latency_s=np.array([1.5, 0.5, np.nan, 2.5, 2.5]),
    )
    first, second = simulated_round_tpot(table, (2, 3))
    assert first[0] == pytest.approx(0.1) and math.isnan(first[1])
    assert math.isnan(second[0]) and second[1:] == pytest.approx([0.1, 0.2])


def test_a_policy_wide_offset_is_no_scatter_and_round_noise_is_measured() -> None:
    live = {p: [np.full(20, 0.2) for _ in range(6)] for p in ("a", "b")}
    # a: the replay 10% high in every round (the model's error): no scatter at all.
    offset = {"a": [r * 1.1 for r in live["a"]], "b": [r * 0.9 for r in live["b"]]}
    flat = round_scatter(live, offset)
    assert flat is not None and flat.sd == pytest.approx(0.0, abs=1e-12)
    # Rounds +-5% about each policy's own level, alternating: SD sqrt(6 * 0.05^2 / 5) each.
    swing = np.log([1.05, 0.95] * 3)
    swing -= swing.mean()
    noisy = {p: [r * 1.2 * math.exp(d) for r, d in zip(live[p], swing, strict=True)]
             for p in live}
    scatter = round_scatter(live, noisy)
    assert scatter is not None
    assert (scatter.rounds, scatter.policies, scatter.rounds_per_policy) == (12, 2, 6)
    assert scatter.sd == pytest.approx(math.sqrt(2 * (swing**2).sum() / 10))
    assert scatter.per_policy == pytest.approx(scatter.sd / math.sqrt(6))
    assert "over a policy's 6 rounds" in scatter.describe()


def test_no_scatter_without_two_rounds_on_both_sides() -> None:
    one = {"a": [np.full(3, 0.2)]}
    assert round_scatter(one, one) is None
    assert round_scatter({"a": [np.full(3, 0.2)] * 2}, {"b": [np.full(3, 0.2)] * 2}) is None
    # A round without a TPOT on one side is left out, not counted as a ratio.
    assert round_scatter({"a": [np.full(3, 0.2), np.full(3, np.nan)]},
                         {"a": [np.full(3, 0.2)] * 2}) is None
