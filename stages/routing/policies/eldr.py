"""ELDR: route to the least-loaded worker inside the locality band of the request's signature.

Rule (paper / artifact): ``s = centroids @ features``; candidates are the eligible workers with
``s_k >= max(s) - tau``; when ``tau > 0`` leaves a single candidate the second best joins, so
a hot cluster can spill over; the candidate with the fewest in-flight requests wins, ties to
the lowest index. Without features (prefill sent no signature) it degrades to JSQ.

Centroid ``k`` is served by worker ``worker_of_centroid[k]``; with more centroids than workers a
worker's similarity is its best centroid's (``cluster_map``: K clusters on D <= K workers, moved
off unhealthy workers without a refit). Online refit replaces centroids and that map together
(``set_centroids``) so clusters stay on the workers already warm with their experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from stages.errors import EldrError
from stages.fit.artifact import check_cluster_count
from stages.routing.context import RoutingContext
from stages.routing.params import check_range, option
from stages.routing.policies.base import DecodePolicy, RoutingRequest
from stages.routing.policies.cluster_map import remap_for_healthy, spread_clusters
from stages.routing.policies.select import least_loaded_random


@dataclass(frozen=True)
class EldrParams:
    # Signatures are non-negative, so cosines lie in [0, 1]: tau = 1 admits every worker.
    tau: float = option(0.1, "locality band width: 0 keeps the nearest centroid only, 1 is"
                        " join-shortest-queue")

    def __post_init__(self) -> None:
        check_range("tau", self.tau, 0.0, 1.0)


class EldrPolicy(DecodePolicy):
    name: ClassVar[str] = "eldr"
    uses_signature: ClassVar[bool] = True
    needs_centroids: ClassVar[bool] = True
    Params: ClassVar[type[EldrParams]] = EldrParams
    params: EldrParams

    def __init__(self, context: RoutingContext, params: EldrParams | None = None) -> None:
        super().__init__(context, params)
        if context.centroids is None:
            raise EldrError(
                f"policy {self.name!r} needs centroids: load an artifact (eldr fit) first"
            )
        self.set_centroids(context.centroids, context.worker_of_centroid)

    def set_centroids(
        self, centroids: np.ndarray, worker_of_centroid: np.ndarray | None = None
    ) -> None:
        """Install centroids ``[K, D]`` (K >= workers) and the worker each one is served by
        (default: :func:`spread_clusters`; identity when K equals the worker count)."""
        c = np.ascontiguousarray(centroids, dtype=np.float32)
        if c.ndim != 2:
            raise EldrError(f"centroids must be a [K, D] matrix, got shape {c.shape}")
        check_cluster_count(c.shape[0], self.num_workers)
        mapping = (
            spread_clusters(c, self.num_workers)
            if worker_of_centroid is None
            else np.asarray(worker_of_centroid, dtype=np.int64)
        )
        if (
            mapping.shape != (c.shape[0],)
            or mapping.min() < 0
            or mapping.max() >= self.num_workers
            or np.unique(mapping).size != self.num_workers
        ):
            raise EldrError(
                f"worker_of_centroid must give each of the {c.shape[0]} centroids one of the"
                f" {self.num_workers} workers, every worker at least one"
            )
        # One assignment: a reader never sees centroids from one fit and a map from another.
        # Maps for other healthy sets are derived on demand and cached per set.
        self._state = (c, mapping, {})

    @property
    def centroids(self) -> np.ndarray:
        return self._state[0]

    @property
    def worker_of_centroid(self) -> np.ndarray:
        return self._state[1]

    def _map_for(self, eligible: np.ndarray) -> np.ndarray:
        centroids, mapping, cache = self._state
        key = eligible.tobytes()
        found = cache.get(key)
        if found is None:
            # At most one entry per distinct healthy set seen: bounded by how often workers
            # fail, and dropped with the centroids.
            found = cache[key] = remap_for_healthy(centroids, mapping, eligible)
        return found

    def similarities(self, features: np.ndarray, eligible: np.ndarray) -> np.ndarray:
        """Per worker, the best cosine of ``features`` to a centroid it serves while
        ``eligible`` workers are the healthy ones (-inf for a worker serving none)."""
        centroids = self._state[0]
        if features.shape != (centroids.shape[1],):
            raise EldrError(
                f"feature vector has shape {features.shape}, centroids expect"
                f" ({centroids.shape[1]},)"
            )
        by_centroid = centroids @ features
        mapping = self._map_for(eligible)
        if by_centroid.size == self.num_workers and mapping is self._state[1]:
            by_worker = np.empty_like(by_centroid)
            by_worker[mapping] = by_centroid  # one-to-one: a permutation
            return by_worker
        by_worker = np.full(self.num_workers, -np.inf, dtype=by_centroid.dtype)
        np.maximum.at(by_worker, mapping, by_centroid)
        return by_worker

    def choose(self, request: RoutingRequest) -> int:
        if request.features is None:
            return least_loaded_random(request.loads, request.eligible, self.rng)
        eligible = request.eligible
        s = self.similarities(request.features, eligible)
        if not eligible.all():
            s = np.where(eligible, s, -np.inf)  # an ineligible worker can never enter the band
        best = float(s.max())
        if not math.isfinite(best):
            # Only non-finite features (a corrupt signature) get here; do no harm.
            return least_loaded_random(request.loads, eligible, self.rng)
        tau = self.params.tau
        band = s >= best - tau
        if tau > 0 and np.count_nonzero(band) == 1:
            # The best alone would pin a hot cluster to one worker; admit the runner-up.
            rest = np.where(band, -np.inf, s)
            second = int(rest.argmax())
            if rest[second] > -np.inf:
                band[second] = True
        return self.pick_in_band(np.flatnonzero(band), s, request)

    def pick_in_band(self, band: np.ndarray, s: np.ndarray, request: RoutingRequest) -> int:
        """The paper's pick: fewest in flight; argmin keeps the lowest index on ties."""
        return int(band[request.loads[band].argmin()])
