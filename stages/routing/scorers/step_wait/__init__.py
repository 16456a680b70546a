"""Seconds a request waits on each decode worker for the step it finds running.

A decode worker with requests in flight runs steps back to back (continuous batching), and a
request whose KV is ready joins at the next step's start, so it first waits out the step then
running: from an arrival at a random moment, half a step on average. An idle worker starts its
step at once. The wait is the request's own, once (it delays its first token and every later
one alike), so it counts once beside the per-token terms.
"""

from __future__ import annotations

import numpy as np


def step_wait_s(loads: np.ndarray, step_s: np.ndarray | float) -> np.ndarray:
    """[W] seconds: half of ``step_s`` (each worker's running step) where ``loads`` (requests
    in flight) is above 0, 0 where the worker is idle."""
    return np.where(loads > 0, 0.5 * np.asarray(step_s, dtype=np.float64), 0.0)
