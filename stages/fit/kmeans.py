"""Spherical k-means on unit vectors, balanced (sizes differ by at most one) or plain.

Init: scikit-learn's greedy k-means++ (on unit rows its squared Euclidean distance is 2 (1 -
cos)) on a seeded uniform sample of at most ``init_sample`` points. Sampling keeps the init cost
independent of N: k-means++ needs one pass over the data per centroid, which at 1M x 6144 would
cost more than the whole fit. Then Lloyd iterations: similarities to the centroids, an
assignment (exact and balanced, ``balanced_assignment``, warm-started with the previous
iteration's prices; or the argmax), and centroids = re-normalised cluster sums.

Data are read in row blocks, so ``x`` may be float32 or float16 (half the memory, converted a
block at a time) and may be a memory map. Only [N, K] similarities and [K, D] sums are held.
Results depend only on the inputs and the seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from stages.fit.balanced_assignment import balanced_assignment

# Rows per block when streaming x (float32 block of 8192 x 6144 = 200 MB at most).
_BLOCK = 8192
# Moved rows per block in an incremental sums update (float64 block of 2048 x 6144 = 100 MB).
_DELTA_BLOCK = 2048


@dataclass(frozen=True)
class KMeansResult:
    centroids: np.ndarray  # float32 [k, D], unit rows
    labels: np.ndarray  # int64 [N]
    objective: float  # sum over points of cosine similarity to the assigned centroid
    iterations: int
    assignment_gap: float = 0.0  # certified optimality gap of the last balanced assignment


def balanced_spherical_kmeans(
    x: np.ndarray,
    k: int,
    seed: int,
    balanced: bool = True,
    max_iter: int = 50,
    *,
    tol: float = 1e-6,
    init_sample: int = 20_000,
    progress: Callable[[str], None] | None = None,
) -> KMeansResult:
    """Cluster unit rows of ``x [N, D]`` into ``k`` clusters maximising total cosine similarity.

    Stops when labels no longer change, when an iteration improves the objective by less than
    ``tol`` (relative), or after ``max_iter`` iterations.
    """
    if x.ndim != 2:
        raise ValueError(f"x must be [N, D], got shape {x.shape}")
    if x.dtype not in (np.float32, np.float16):
        x = np.asarray(x, dtype=np.float32)  # float64 callers: one copy, then the fast path
    n = x.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and the number of points ({n}), got {k}")
    if max_iter < 1:
        raise ValueError("max_iter must be >= 1")
    rng = np.random.default_rng(seed)
    centroids = _kmeanspp(x, k, rng, init_sample)
    labels: np.ndarray | None = None
    sums = np.zeros((k, x.shape[1]))
    prices: np.ndarray | None = None
    objective = -np.inf
    gap = 0.0
    iterations = 0
    while iterations < max_iter:
        iterations += 1
        sims = similarities(x, centroids)
        if balanced:
            res = balanced_assignment(sims, prices=prices)
            new_labels, prices, gap = res.labels, res.prices, res.gap_bound
        else:
            new_labels = sims.argmax(axis=1)
        if labels is not None and np.array_equal(new_labels, labels):
            break
        sums = _updated_sums(x, sums, labels, new_labels, k)
        labels = new_labels
        if not balanced:
            sums = _refill_empty(x, sims, labels, sums)
        centroids, new_objective = _normalise(sums, centroids)
        if progress is not None:
            progress(f"iteration {iterations}: mean cosine {new_objective / n:.6f}")
        improved = new_objective - objective
        objective = new_objective
        if improved <= tol * abs(objective):
            break
    if labels is None:  # max_iter >= 1 makes one assignment at least
        raise RuntimeError("k-means made no assignment")
    return KMeansResult(
        centroids=centroids,
        labels=labels.astype(np.int64),
        objective=float(objective),
        iterations=iterations,
        assignment_gap=float(gap),
    )


def similarities(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """float32 [N, K] dot products of the rows of x with the centroids, block by block."""
    ct = np.ascontiguousarray(centroids.T, dtype=np.float32)
    out = np.empty((x.shape[0], ct.shape[1]), np.float32)
    for a in range(0, x.shape[0], _BLOCK):
        np.matmul(_block(x, a), ct, out=out[a : a + _BLOCK])
    return out


def cluster_sums(x: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """float64 [K, D] sum of the rows of each cluster, block by block.

    A sparse one-hot [K, block] times the block: one add per element of x, about 3x faster
    here than a dense one-hot GEMM (whose K-row shape BLAS handles poorly) and no row copies.
    """
    sums = np.zeros((k, x.shape[1]), np.float64)
    for a in range(0, x.shape[0], _BLOCK):
        block = _block(x, a)
        m = len(block)
        onehot = sp.csr_matrix(
            (np.ones(m, np.float32), (labels[a : a + m], np.arange(m))), shape=(k, m)
        )
        sums += onehot @ block
    return sums


def _updated_sums(
    x: np.ndarray, sums: np.ndarray, old: np.ndarray | None, new: np.ndarray, k: int
) -> np.ndarray:
    """Cluster sums for ``new`` labels: a full pass, or when few labels changed (the usual
    late iterations), the previous sums plus the moved rows only."""
    if old is None:
        return cluster_sums(x, new, k)
    changed = np.flatnonzero(old != new)
    if len(changed) > len(new) // 4:
        return cluster_sums(x, new, k)
    sums = sums.copy()
    for a in range(0, len(changed), _DELTA_BLOCK):
        idx = changed[a : a + _DELTA_BLOCK]
        rows = np.asarray(x[idx], dtype=np.float64)
        m = len(idx)
        cols = np.arange(m)
        move = sp.csr_matrix(
            (np.r_[np.ones(m), -np.ones(m)], (np.r_[new[idx], old[idx]], np.r_[cols, cols])),
            shape=(k, m),
        )
        sums += move @ rows
    return sums


def _block(x: np.ndarray, start: int) -> np.ndarray:
    return np.asarray(x[start : start + _BLOCK], dtype=np.float32)


def _normalise(sums: np.ndarray, previous: np.ndarray) -> tuple[np.ndarray, float]:
    """Unit centroids from cluster sums, and the objective sum_k |sum_k|.

    For c_k = s_k / |s_k|, the points of cluster k have total cosine s_k . c_k = |s_k|, so the
    objective of (labels, new centroids) comes for free. A zero sum (opposite points cancel)
    keeps the previous centroid rather than inventing a direction.
    """
    norms = np.linalg.norm(sums, axis=1)
    centroids = previous.astype(np.float64).copy()
    ok = norms > 0
    centroids[ok] = sums[ok] / norms[ok, None]
    return centroids.astype(np.float32), float(norms.sum())


def _refill_empty(
    x: np.ndarray, sims: np.ndarray, labels: np.ndarray, sums: np.ndarray
) -> np.ndarray:
    """Plain k-means only: seed each empty cluster with a worst-fitting point of a cluster
    that can spare one (deterministic: lowest similarity to its own centroid first)."""
    counts = np.bincount(labels, minlength=len(sums))
    empty = np.flatnonzero(counts == 0)
    if not len(empty):
        return sums
    own = sims[np.arange(len(labels)), labels]
    for j, i in zip(empty, _worst_points(own, labels, counts, len(empty)), strict=True):
        row = _block(x, int(i))[0].astype(np.float64)
        sums[labels[i]] -= row
        counts[labels[i]] -= 1
        labels[i] = j
        sums[j] = row
    return sums


def _worst_points(own: np.ndarray, labels: np.ndarray, counts: np.ndarray, m: int) -> list[int]:
    picked: list[int] = []
    left = counts.copy()
    for i in np.argsort(own, kind="stable"):
        if left[labels[i]] > 1:
            picked.append(int(i))
            left[labels[i]] -= 1
            if len(picked) == m:
                break
    return picked


def _kmeanspp(x: np.ndarray, k: int, rng: np.random.Generator, init_sample: int) -> np.ndarray:
    """Greedy k-means++ (scikit-learn's) on a seeded sample of the unit rows.

    On unit vectors the squared Euclidean distance scikit-learn uses is 2 (1 - cos), so its
    seeding is the spherical one.
    """
    from sklearn.cluster import kmeans_plusplus

    n = x.shape[0]
    pick = np.sort(rng.choice(n, size=init_sample, replace=False)) if n > init_sample else None
    sample = np.asarray(x if pick is None else x[pick], dtype=np.float32)
    _, chosen = kmeans_plusplus(sample, k, random_state=int(rng.integers(2**31 - 1)))
    taken = set()
    for i, row in enumerate(chosen):
        if row in taken:
            # Every point coincides with a centre already (k-means++ then draws a chosen row
            # again): take a distinct row at random instead.
            row = rng.choice(np.setdiff1d(np.arange(len(sample)), list(taken)))
            chosen[i] = row
        taken.add(int(row))
    centroids = sample[chosen].astype(np.float64)
    norms = np.linalg.norm(centroids, axis=1, keepdims=True)
    return (centroids / np.where(norms > 0, norms, 1.0)).astype(np.float32)
