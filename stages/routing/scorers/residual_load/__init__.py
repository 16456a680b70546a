"""How many of each decode worker's requests a new request will share its steps with.

A worker's in-flight count says who runs beside a request at its first step, not over its
life: a worker whose requests are near their last token soon runs it almost alone. The proxy
has no clock for the requests' progress, but it counts its decisions, and by Little's law a
request stays in flight for about as many decisions as there are requests in flight (``N``),
scaled by its output tokens against the mean of those in flight. A request that joined ``age``
decisions ago with ``tokens`` to decode has ``N x tokens / mean - age`` decisions left; a new
request that lasts ``L`` decisions shares ``min(left, L) / L`` of its steps with it. A request
whose length is unknown (``tokens`` 0: no ``max_tokens``) counts as staying throughout.
"""

from __future__ import annotations

import numpy as np


def shared_load(worker: np.ndarray, age: np.ndarray, tokens: np.ndarray, new_tokens: int,
                num_workers: int) -> np.ndarray:
    """[W] expected requests beside the new one over its life, per worker (fractional).

    ``worker``, ``age`` (decisions since it joined) and ``tokens`` (0: unknown): one entry per
    request in flight. ``new_tokens``: the new request's output tokens (> 0)."""
    known = tokens > 0
    if not known.any():
        return np.bincount(worker, minlength=num_workers).astype(np.float64)
    life_per_token = worker.size / float(tokens[known].mean())  # decisions a token lasts
    left = np.maximum(tokens * life_per_token - age, 0.0)
    span = new_tokens * life_per_token
    share = np.where(known, np.minimum(left, span) / span, 1.0)
    return np.bincount(worker, share, minlength=num_workers)
