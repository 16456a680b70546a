"""eldr-union's per-decision arithmetic, compiled (numba): one pass each instead of a dozen
numpy calls.

A decision on 16 workers touches ~32 K floats (16 workers x 16 sampled layers x 128 experts);
numpy needs a temporary and ~1 us of call overhead per step for that, which made the decision's
p50 ~50 us and its p99 twice that (``examples/bench_routing.py``). Each kernel here is one loop
over the arrays, so the decision costs what its memory traffic costs. The math is
``stages.signature.inclusion`` and ``expert_load``'s, in float32 (``eldr_union`` says why).

Compiled for the argument types they first see and cached on disk (numba's cache, next to
this file or in ``NUMBA_CACHE_DIR``); ``warm`` compiles (or loads) the proxy's types when the
policy is built, so no request pays for it.
"""

from __future__ import annotations

import numba
import numpy as np

# PI_MAX in float32 would round to 1 (log 0); the largest float32 below 1 keeps logs finite.
PI_MAX32 = np.float32(1.0 - 2.0**-24)
# The smallest miss chance kept: normal in float32 (whose subnormals start below 1.2e-38), where
# x86 arithmetic on subnormals runs ~10x slower (``expert_load``).
MISS_FLOOR = np.float32(1e-30)

# Scores within this relative margin of the best tie (a random pick among them): empty workers
# are exact ties, and float noise must not send them all to the lowest index.
TIE = 1e-9

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)


# Reassociation lets the compiler vectorize the sum (measured: 16 x 2,048 in ~5 us instead of
# ~23 us); only this loop gets it, as it has no inf or NaN to keep exact.
@numba.njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _dot(row: np.ndarray, pi: np.ndarray) -> float:
    total = 0.0
    for j in range(pi.size):
        total += row[j] * pi[j]
    return total


@_jit
def sampled_inclusion(counts: np.ndarray, rows: np.ndarray, top_k: int) -> np.ndarray:
    """Per-step inclusion probabilities of the ``rows`` layers of ``[L, E]`` counts, flattened
    ``[len(rows) * E]``: ``count * k / (layer total)``, at most ``PI_MAX32``; a layer without
    counts gets a uniform ``k / E`` (``inclusion_probabilities``' rule)."""
    num_experts = counts.shape[1]
    pi = np.empty(rows.size * num_experts, dtype=np.float32)
    for r in range(rows.size):
        row = rows[r]
        total = 0
        for e in range(num_experts):
            total += counts[row, e]
        base = r * num_experts
        if total == 0:
            uniform = np.float32(top_k / num_experts)
            for e in range(num_experts):
                pi[base + e] = uniform
            continue
        scale = np.float32(top_k / total)
        for e in range(num_experts):
            pi[base + e] = min(np.float32(counts[row, e]) * scale, PI_MAX32)
    return pi


@_jit
def worker_latency(
    miss: np.ndarray,
    pi: np.ndarray,
    loads: np.ndarray,
    eligible: np.ndarray,
    slots: int,
    load_slack: float,
    distinct: np.ndarray,
    step: np.ndarray,
    added: np.ndarray,
    latency: np.ndarray,
) -> int:
    """eldr-union's scores for a request with ``pi``: per worker, the seconds per token it adds
    over all requests in flight (``eldr_union``'s formula; ``step`` = fixed, per-sequence and
    per-expert seconds), ``inf`` where it may not go. A worker may go if it is ``eligible``,
    has a free batch slot (``slots`` > 0 of them; 0: no limit) and holds at most
    ``max(1, int(load_slack x mean))`` more requests than the least loaded of those.
    ``added`` gets the expected distinct experts it adds where scored. Returns how many workers
    tie the best (0: none may go) and the first of them (the pick when it is the only one)."""
    num_workers = loads.size
    open_count = 0
    open_total = 0
    least = np.iinfo(np.int64).max
    for w in range(num_workers):
        if eligible[w] and (slots <= 0 or loads[w] < slots):
            open_count += 1
            open_total += loads[w]
            least = min(least, loads[w])
    if open_count == 0:
        return 0, -1
    bound = least + max(1, int(load_slack * (open_total / open_count)))
    fixed, per_seq, per_expert = step[0], step[1], step[2]
    best = np.inf
    for w in range(num_workers):
        if not (eligible[w] and (slots <= 0 or loads[w] < slots) and loads[w] <= bound):
            latency[w] = np.inf
            continue
        total = _dot(miss[w], pi)
        added[w] = total
        n = float(loads[w])
        now = fixed + per_seq * n + per_expert * distinct[w]
        latency[w] = now + (n + 1.0) * (per_seq + per_expert * total)
        best = min(best, latency[w])
    ties = 0
    first = -1
    for w in range(num_workers):
        if latency[w] <= best * (1.0 + TIE):
            if ties == 0:
                first = w
            ties += 1
    return ties, first


@_jit
def join(miss: np.ndarray, pi: np.ndarray) -> None:
    """A request with ``pi`` joined the worker whose miss chances are ``miss``: each expert is
    now missed by it too (``miss *= 1 - pi``), floored at ``MISS_FLOOR``."""
    for j in range(pi.size):
        miss[j] = max(miss[j] * (np.float32(1.0) - pi[j]), MISS_FLOOR)


def warm() -> None:
    """Compile (or load from the cache) every kernel for the proxy's argument types: int16
    counts as the wire decodes them."""
    counts = np.ones((2, 4), dtype=np.int16)
    pi = sampled_inclusion(counts, np.arange(2, dtype=np.int64), 1)
    miss = np.ones((2, pi.size), dtype=np.float32)
    loads = np.zeros(2, dtype=np.int64)
    worker_latency(miss, pi, loads, loads == 0, 0, 0.25, np.zeros(2), np.ones(3), np.empty(2),
                   np.empty(2))
    join(miss[0], pi)
