"""Which decode worker serves which centroid: K clusters on D <= K workers, elastic.

An artifact fitted with more clusters than there are decode workers (the design card's
``eldr fit --k 20`` in front of 2 workers) is spread so each worker gets a balanced share
(``floor`` or ``ceil`` of K/D) of clusters that resemble each other: balanced spherical k-means
of the centroids themselves, so one worker's batch keeps drawing on related experts. With
K == D every worker gets the centroid of its own index, the paper's one-to-one map.

When workers are unhealthy, the clusters they served move to the healthy ones, each to the
healthy worker whose own clusters it resembles most, without exceeding ``ceil(K / healthy)``
per worker; the rest stay where they are. The map is a function of the healthy set alone, so a
worker that comes back gets exactly its clusters back, and no refit is needed either way.
"""

from __future__ import annotations

import math

import numpy as np

from stages.fit.artifact import check_cluster_count


def spread_clusters(centroids: np.ndarray, num_workers: int, seed: int = 0) -> np.ndarray:
    """``worker_of_centroid`` ``[K]`` with every worker serving a balanced, similar group."""
    k = int(centroids.shape[0])
    check_cluster_count(k, num_workers)
    if k == num_workers:
        return np.arange(k, dtype=np.int64)
    if num_workers == 1:
        return np.zeros(k, dtype=np.int64)
    from stages.fit.kmeans import balanced_spherical_kmeans

    groups = balanced_spherical_kmeans(
        np.asarray(centroids, dtype=np.float32), num_workers, seed=seed, balanced=True
    )
    return np.asarray(groups.labels, dtype=np.int64)


def remap_for_healthy(
    centroids: np.ndarray, worker_of_centroid: np.ndarray, healthy: np.ndarray
) -> np.ndarray:
    """The map with every cluster of an unhealthy worker moved to a healthy one."""
    alive = np.flatnonzero(healthy)
    if alive.size == 0 or healthy[worker_of_centroid].all():
        return worker_of_centroid
    mapping = worker_of_centroid.copy()
    capacity = math.ceil(len(mapping) / alive.size)
    held = np.bincount(mapping, minlength=healthy.size)
    # Each healthy worker is represented by the mean direction of the clusters it keeps.
    anchor = np.stack([centroids[mapping == w].sum(axis=0) for w in alive])
    anchor /= np.maximum(np.linalg.norm(anchor, axis=1, keepdims=True), 1e-12)
    orphans = np.flatnonzero(~healthy[mapping])
    sims = centroids[orphans] @ anchor.T  # [orphans, alive]
    # Most confident moves first, so a cluster that clearly belongs somewhere gets there.
    for row in np.argsort(-sims.max(axis=1), kind="stable"):
        for col in np.argsort(-sims[row], kind="stable"):
            worker = alive[col]
            if held[worker] < capacity:
                mapping[orphans[row]] = worker
                held[worker] += 1
                break
    return mapping
