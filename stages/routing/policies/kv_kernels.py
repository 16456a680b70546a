"""eldr-kv's decode objective, compiled (numba): two passes over the workers instead of ~30
numpy calls.

Each term is defined, readably and with its own tests, in a scorer folder
(``stages.routing.scorers``): ``residual_load`` (the requests a new one shares its steps with),
``step_wait`` (the running step it waits out), ``kv_pull`` (the prompt tokens it pulls); the
per-token term is eldr-union's step-time increase with those requests in place of the ones
running now (``eldr_kv``). On 16 workers every numpy call costs ~1 us of overhead for a few
floats of work, so the composition took ~30 us a decision where eldr-union's whole objective is
one kernel (``union_kernels``). The kernels here restate those formulas operation for operation,
in float64 and in numpy's order, so they return the same bits: ``tests/test_kv_kernels.py``
checks them against the composed scorers, and the choices and random draws against that
composition.

Compiled and cached as ``union_kernels``' are; ``warm`` compiles (or loads) the proxy's types.
"""

from __future__ import annotations

import numba
import numpy as np

from stages.routing.policies.union_kernels import TIE

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)

# The prompt's cached tokens when nothing is known of them (a KV pull of 0 everywhere).
NO_CACHED = np.zeros(0, dtype=np.int64)


@_jit
def residual_load(worker: np.ndarray, joined: np.ndarray, tokens: np.ndarray, decisions: int,
                  new_tokens: int, beside: np.ndarray) -> None:
    """``scorers.residual_load.shared_load`` into ``beside`` [W], over the rows of requests in
    flight (``worker`` >= 0; -1: a free row): joined at decision ``joined``, ``tokens`` to
    decode (0: unknown). Output tokens are whole numbers, so their sum (and mean) is exact in
    any order, as numpy's pairwise sum is."""
    beside[:] = 0.0
    live = 0
    known = 0
    known_sum = 0.0
    for r in range(worker.size):
        if worker[r] >= 0:
            live += 1
            if tokens[r] > 0:
                known += 1
                known_sum += tokens[r]
    if known == 0:
        for r in range(worker.size):
            if worker[r] >= 0:
                beside[worker[r]] += 1.0
        return
    life_per_token = live / (known_sum / known)  # decisions a token lasts
    span = new_tokens * life_per_token
    for r in range(worker.size):
        if worker[r] < 0:
            continue
        share = 1.0
        if tokens[r] > 0:
            left = max(tokens[r] * life_per_token - (decisions - joined[r]), 0.0)
            share = min(left, span) / span
        beside[worker[r]] += share


@_jit
def cheapest_ties(seconds: np.ndarray, eligible: np.ndarray) -> tuple[int, int]:
    """How many eligible workers cost within ``TIE`` of the least (every one when all are
    inf), and the first of them: ``eldr_kv._cheapest``'s rule without its random draw."""
    low = np.inf
    for w in range(seconds.size):
        if eligible[w]:
            low = min(low, seconds[w])
    low = low * (1.0 + TIE)
    ties = 0
    first = -1
    for w in range(seconds.size):
        if eligible[w] and seconds[w] <= low:
            if ties == 0:
                first = w
            ties += 1
    return ties, first


@_jit
def decode_seconds(beside: np.ndarray, latency: np.ndarray, added: np.ndarray,
                   distinct: np.ndarray, step: np.ndarray, loads: np.ndarray,
                   eligible: np.ndarray, tokens: int, prompt_tokens: int, cached: np.ndarray,
                   pull_per_token_s: float, total: np.ndarray) -> tuple[int, int]:
    """Seconds a request with a signature adds over its decode on each worker, into ``total``
    [W], and ``cheapest_ties`` of them: ``tokens`` x eldr-union's per-token increase with the
    ``beside`` requests (inf where eldr-union's filters left ``latency`` inf), plus the wait for
    the running step (``scorers.step_wait``), plus the KV pull of the ``prompt_tokens`` less
    the ``cached`` ones (``scorers.kv_pull``; none when ``cached`` is ``NO_CACHED`` or the
    prompt's length is unknown). ``added`` and ``distinct``: eldr-union's distinct experts the
    request adds and the worker reads; ``step``: fixed, per-sequence, per-expert seconds."""
    fixed, per_seq, per_expert = step[0], step[1], step[2]
    pulls = cached.size > 0 and prompt_tokens > 0
    for w in range(loads.size):
        seconds = np.inf
        if not np.isinf(latency[w]):
            seconds = (fixed + per_seq * beside[w] + per_expert * distinct[w]
                       + (beside[w] + 1.0) * (per_seq + per_expert * added[w]))
        seconds = seconds * tokens
        if loads[w] > 0:
            seconds = seconds + 0.5 * (fixed + per_seq * loads[w] + per_expert * distinct[w])
        else:
            seconds = seconds + 0.0
        if pulls:
            seconds = seconds + max(prompt_tokens - cached[w], 0) * pull_per_token_s
        else:
            seconds = seconds + 0.0
        total[w] = seconds
    return cheapest_ties(total, eligible)


def warm() -> None:
    """Compile (or load from the cache) every kernel for the proxy's argument types."""
    rows = np.full(2, -1, dtype=np.int64)
    beside = np.empty(2)
    residual_load(rows, np.zeros(2), np.zeros(2), 0, 1, beside)
    loads = np.zeros(2, dtype=np.int64)
    eligible = loads == 0
    zeros = np.zeros(2)
    decode_seconds(beside, zeros, zeros, zeros, np.ones(3), loads, eligible, 1, 0, NO_CACHED,
                   0.0, np.empty(2))
