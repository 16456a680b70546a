"""Expected distinct experts of one decode step, averaged over every batch of B of m requests.

A step of batch ``b`` misses expert (l, e) with probability ``prod_{r in b} q_r`` (``q = 1 -
pi``, ``stages.signature.inclusion``). Over all C(m, B) batches, the mean of that product is
``mu_B = e_B(q) / C(m, B)`` (``e_B``: elementary symmetric polynomial), built one member at a
time with the recurrence

    mu_k(j) = ((j - k) / j) mu_k(j - 1) + (k / j) q_j mu_{k-1}(j - 1)

whose terms are a convex combination of values in [0, 1], so it is stable in float64. That is
the exact mean over every batch: no batches to sample, no sampling noise.

Each request's projection (the mean over the batches that contain it) needs the same mean over
the other m - 1 requests, ``mu_{B-1}^{(-r)}``, from

    mu_k^{(-r)} = (m mu_k - k q_r mu_{k-1}^{(-r)}) / (m - k)

(each step removes r's share, k/m of the whole, so nothing cancels catastrophically).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np

# Members whose leave-one-out means are computed at a time ([block, L*E] float64).
_ROWS_PER_BLOCK = 1 << 22


@dataclass(frozen=True)
class BatchUnion:
    mean: float  # expected distinct experts per layer of one step, over every batch
    projection: np.ndarray  # [m]: the same over the batches that contain member r
    num_batches: float  # C(m, B): how many batches the mean is over (float: it can be huge)


def batch_union(
    log_complement: np.ndarray, batch_sizes: tuple[int, ...], num_layers: int
) -> dict[int, BatchUnion]:
    """For each size in ``batch_sizes``, over every batch of that many distinct rows of
    ``log_complement`` (``[m, L*E]`` ``log(1 - pi)``; sizes from 1 to m). One pass builds every
    size up to the largest."""
    q = np.exp(log_complement)
    m, largest = len(q), max(batch_sizes)
    if min(batch_sizes) < 1 or largest > m:
        raise ValueError(f"batches of {list(batch_sizes)} need between 1 and {m} requests")
    mu = np.zeros((largest + 1, q.shape[1]))
    mu[0] = 1.0
    for j in range(1, m + 1):
        k = np.arange(1, min(j, largest) + 1)
        w = k[:, None]
        mu[k] = ((j - w) / j) * mu[k] + (w / j) * q[j - 1] * mu[k - 1]
    projections = {b: np.empty(m) for b in batch_sizes}
    block = max(1, _ROWS_PER_BLOCK // q.shape[1])
    for a in range(0, m, block):
        qr = q[a : a + block]
        others = np.ones_like(qr)  # mu_0 over the other members
        if 1 in projections:
            projections[1][a : a + block] = (1.0 - qr).sum(axis=1) / num_layers
        for k in range(1, largest):
            others = (m * mu[k] - k * qr * others) / (m - k)  # mu_k over the other members
            if k + 1 in projections:  # a batch of k + 1: r and k others
                projections[k + 1][a : a + block] = (1.0 - qr * others).sum(axis=1) / num_layers
    return {
        b: BatchUnion(
            mean=float((1.0 - mu[b]).sum() / num_layers),
            projection=projections[b],
            num_batches=float(comb(m, b)),
        )
        for b in batch_sizes
    }
