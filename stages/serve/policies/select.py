"""Selection helpers shared by the policies: every choice is restricted to eligible workers."""

from __future__ import annotations

import numpy as np

from stages.errors import EldrError


def eligible_indices(eligible: np.ndarray) -> np.ndarray:
    idx = np.flatnonzero(eligible)
    if idx.size == 0:
        # The proxy never asks without a healthy worker; reaching here is a caller bug.
        raise EldrError("no eligible decode worker to choose from")
    return idx


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
