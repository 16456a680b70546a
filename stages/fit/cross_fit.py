"""Out-of-fold cluster labels: every request labelled by centroids fit without it.

The gain estimate (``stages.fit.gain``) needs requests the centroids never saw, and a batch of
B needs clusters of 2B of them. A held-out split leaves a fifth of the requests for that, so
the batch sizes that matter went unestimated for want of rows, not for want of locality.
Cross-fitting uses them all: the requests are split (seeded) into K folds; for each fold, the
transform and the centroids are fit on the other K - 1 folds exactly as ``eldr fit`` fits the
artifact, and the fold's requests go to their nearest centroid.

Each fold's centroids are a clustering of their own, with their own cluster ids, so a fold's
labels are renamed into the reference clustering's ids (the artifact's) before requests of
different folds share a cluster. The renaming is the one-to-one matching of the fold's
clusters to the reference's that maximises their total cosine similarity
(``scipy.optimize.linear_sum_assignment``), measured in the reference's signature space: a
fold fits its own transform (IDF and layer mask, so its own dimensions), so a fold cluster
stands there for the normalised mean of its training members' reference signatures.

The matching assumes the clusters are stable: the K fits and the reference find the same
partition up to its names, as balanced k-means on enough requests does. Where they do not,
two clusters that differ share a name, same-cluster batches mix them, and the estimate shrinks
towards no gain: an unstable clustering reads as less locality, never as more. ``agreement``
measures how far the assumption holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linear_sum_assignment

from stages.errors import EldrError
from stages.fit.gain import nearest_centroid
from stages.fit.kmeans import KMeansResult, cluster_sums
from stages.signature.transform import SignatureTransform

# Seeds the fold split apart from the train/held-out split, which uses the bare seed.
_FOLD_STREAM = 0xF01D


@dataclass(frozen=True, eq=False)
class Clustering:
    """A fitted signature transform and the k-means fit on its rows."""

    transform: SignatureTransform
    kmeans: KMeansResult
    rho_trace: list[float]

    @property
    def centroids(self) -> np.ndarray:
        return self.kmeans.centroids

    def nearest(self, prefill: np.ndarray) -> np.ndarray:
        """Cluster id of each ``[n, L, E]`` prefill signature (the nearest centroid)."""
        return nearest_centroid(self.transform.apply(prefill), self.centroids)


@dataclass(frozen=True)
class CrossFit:
    labels: np.ndarray  # [n] each request's out-of-fold cluster, in the reference's ids
    folds: int
    # Share of requests whose out-of-fold cluster is the reference's nearest centroid: near 1
    # when the folds and the reference found the same clusters.
    agreement: float

    # Per named query (``Queries``), each request labelled by the same out-of-fold clustering
    # from another signature of it (e.g. its signature at arrival, before prefill).
    query_labels: dict[str, np.ndarray] = field(default_factory=dict)


# The clustering fit on the given rows of the dataset, as ``eldr fit`` fits the artifact.
FitRows = Callable[[np.ndarray], Clustering]
# (train rows, test rows) -> named ``[len(test), L, E]`` signatures of the test rows, made
# from the train rows alone (a predictor fit on them).
Queries = Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]


def fold_of(n: int, folds: int, seed: int) -> np.ndarray:
    """``[n]`` fold of each request: seeded, sizes differing by at most one."""
    if not 2 <= folds <= n:
        raise EldrError(f"cross-fitting {n} requests needs between 2 and {n} folds, got {folds}")
    order = np.random.default_rng([seed, _FOLD_STREAM]).permutation(n)
    fold = np.empty(n, np.int64)
    fold[order] = np.arange(n) % folds
    return fold


def matched_ids(
    fold_labels: np.ndarray, reference_x: np.ndarray, reference_centroids: np.ndarray
) -> np.ndarray:
    """``[k]``: the reference cluster each of a fold's k clusters is renamed to.

    ``fold_labels``: the fold clustering's labels of its training rows; ``reference_x``: those
    rows' signatures in the reference's transform.
    """
    k = len(reference_centroids)
    sums = cluster_sums(reference_x, fold_labels, k)
    norms = np.linalg.norm(sums, axis=1, keepdims=True)
    # An empty fold cluster has no direction; it matches whatever is left.
    means = np.divide(sums, norms, out=np.zeros_like(sums), where=norms > 0)
    fold_ids, reference_ids = linear_sum_assignment(
        means @ np.asarray(reference_centroids, np.float64).T, maximize=True
    )
    renamed = np.empty(k, np.int64)
    renamed[fold_ids] = reference_ids
    return renamed


def cross_fit_labels(
    prefill: np.ndarray,
    reference: Clustering,
    folds: int,
    seed: int,
    fit: FitRows,
    progress: Callable[[str], None] | None = None,
    queries: Queries | None = None,
) -> CrossFit:
    """Every request of ``prefill`` (``[n, L, E]``) labelled by a clustering fit (``fit``) on
    the other folds, in ``reference``'s cluster ids; with ``queries``, also by each of the
    signatures they make of it (same folds, same clusterings)."""
    say = progress or (lambda _msg: None)
    n = len(prefill)
    fold = fold_of(n, folds, seed)
    reference_x = reference.transform.apply(prefill)
    labels = np.empty(n, np.int64)
    query_labels: dict[str, np.ndarray] = {}
    for f in range(folds):
        train, test = np.flatnonzero(fold != f), np.flatnonzero(fold == f)
        say(f"cross-fit fold {f + 1} of {folds}: fitting on {len(train)} requests, labelling"
            f" {len(test)}")
        try:
            clustering = fit(train)
        except EldrError as exc:
            raise EldrError(f"cross-fit fold {f + 1} of {folds}: {exc}") from exc
        if len(clustering.centroids) != len(reference.centroids):
            raise ValueError(
                f"fold {f + 1} has {len(clustering.centroids)} clusters, the reference"
                f" {len(reference.centroids)}"
            )
        renamed = matched_ids(
            clustering.kmeans.labels, reference_x[train], reference.centroids
        )
        labels[test] = renamed[clustering.nearest(prefill[test])]
        for name, signatures in (queries(train, test) if queries else {}).items():
            named = query_labels.setdefault(name, np.empty(n, np.int64))
            named[test] = renamed[clustering.nearest(signatures)]
    agreement = float(np.mean(labels == nearest_centroid(reference_x, reference.centroids)))
    return CrossFit(labels=labels, folds=folds, agreement=agreement, query_labels=query_labels)
