"""Poisson schedules: seeded, at the asked rate, inf = all at once."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from stages.bench.live.arrivals import poisson_arrivals, poisson_arrivals_until
from stages.errors import EldrError


def test_same_seed_same_schedule_other_seed_other() -> None:
    a = poisson_arrivals(500, 10.0, seed=3)
    assert np.array_equal(a, poisson_arrivals(500, 10.0, seed=3))
    assert not np.array_equal(a, poisson_arrivals(500, 10.0, seed=4))


def test_gaps_are_exponential_at_the_rate() -> None:
    rate = 25.0
    t = poisson_arrivals(20_000, rate, seed=0)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # Kolmogorov-Smirnov against Exp(rate): a wrong distribution (e.g. uniform gaps) fails.
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.001


def test_infinite_rate_sends_everything_at_once() -> None:
    assert np.array_equal(poisson_arrivals(7, math.inf, seed=0), np.zeros(7))


def test_duration_bounded_count_matches_rate() -> None:
    t = poisson_arrivals_until(100.0, 120.0, seed=1)
    assert t.max() < 120.0 and t[0] == 0.0
    # Poisson count: mean 12000, sd ~110.
    assert abs(t.size - 12_000) < 5 * math.sqrt(12_000)
    assert np.array_equal(t, poisson_arrivals_until(100.0, 120.0, seed=1))


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_bad_rate_is_a_user_error(rate: float) -> None:
    with pytest.raises(EldrError):
        poisson_arrivals(3, rate, seed=0)
