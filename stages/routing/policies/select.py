"""Selection helpers shared by the policies: every choice is restricted to eligible workers."""

from __future__ import annotations

import math

import numpy as np

from stages.errors import EldrError


def eligible_indices(eligible: np.ndarray) -> np.ndarray:
    idx = np.flatnonzero(eligible)
    if idx.size == 0:
        # The proxy never asks without a healthy worker; reaching here is a caller bug.
        raise EldrError("no eligible decode worker to choose from")
    return idx


# "Consistent Hashing with Bounded Loads" (Mirrokni et al.): a worker holds at most c times the
# mean load. The prefill ring and eldr-bl both use c = 1.25.
BOUNDED_LOAD_FACTOR = 1.25


def bounded_load_capacity(loads: np.ndarray, eligible: np.ndarray, load_factor: float) -> int:
    """``ceil(c * (total + 1) / n)`` over eligible workers: a worker may take one more request
    while its in-flight count is below this. Counting the new request keeps the bound above
    zero when every queue is empty."""
    idx = eligible_indices(eligible)
    return math.ceil(load_factor * (int(loads[idx].sum()) + 1) / idx.size)


def least_loaded_lowest(loads: np.ndarray, mask: np.ndarray) -> int:
    """Fewest in-flight among ``mask``; ties go to the lowest index (deterministic)."""
    idx = eligible_indices(mask)
    return int(idx[np.argmin(loads[idx])])


def least_loaded_random(loads: np.ndarray, mask: np.ndarray, rng: np.random.Generator) -> int:
    """Fewest in-flight among ``mask``; ties broken uniformly at random.

    Random ties matter at low load: with all queues empty a lowest-index rule would send every
    request to worker 0.
    """
    idx = eligible_indices(mask)
    sub = loads[idx]
    best = idx[sub == sub.min()]
    if best.size == 1:
        return int(best[0])
    return int(best[rng.integers(best.size)])
