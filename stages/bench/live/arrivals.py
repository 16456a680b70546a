"""Request arrival schedules: Poisson processes, as ``vllm bench serve --request-rate``."""

from __future__ import annotations

import math

import numpy as np

from stages.errors import EldrError


def _check_rate(rate: float) -> None:
    if math.isnan(rate) or rate <= 0:
        raise EldrError(f"request rate must be > 0 (or inf), got {rate}")


def poisson_arrivals(num: int, rate: float, seed: int) -> np.ndarray:
    """Offsets in seconds of ``num`` arrivals; the first at 0, gaps exponential with mean 1/rate.

    ``rate = inf`` sends everything at once (all offsets 0). Same seed, same schedule: that is
    what lets every policy face identical arrivals.
    """
    _check_rate(rate)
    if num < 0:
        raise EldrError(f"number of arrivals must be >= 0, got {num}")
    if num == 0:
        return np.zeros(0, dtype=np.float64)
    if math.isinf(rate):
        return np.zeros(num, dtype=np.float64)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def poisson_arrivals_until(rate: float, duration_s: float, seed: int) -> np.ndarray:
    """All arrivals of a Poisson process of ``rate`` in ``[0, duration_s)`` (first at 0).

    The count is itself random, as in a real Poisson stream; ``rate`` must be finite here.
    """
    _check_rate(rate)
    if math.isinf(rate):
        raise EldrError("a duration-bounded schedule needs a finite request rate")
    if duration_s <= 0:
        raise EldrError(f"duration must be > 0 s, got {duration_s}")
    rng = np.random.default_rng(seed)
    # Draw a comfortable surplus in one go, then cut; top up in the (rare) short case.
    expected = rate * duration_s
    chunk = int(expected + 6 * math.sqrt(expected) + 16)
    gaps = rng.exponential(1.0 / rate, size=chunk)
    times = np.concatenate([[0.0], np.cumsum(gaps)])
    while times[-1] < duration_s:
        more = times[-1] + np.cumsum(rng.exponential(1.0 / rate, size=chunk))
        times = np.concatenate([times, more])
    return times[times < duration_s]
