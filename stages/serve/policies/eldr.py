"""ELDR: route to the least-loaded worker inside the locality band of the request's signature.

Rule (paper / artifact): ``s = centroids @ features``; candidates are the eligible workers with
``s_k >= max(s) - tau``; when ``tau > 0`` leaves a single candidate the second best joins, so
a hot cluster can spill over; the candidate with the fewest in-flight requests wins, ties to
the lowest index. Without features (prefill sent no signature) it degrades to JSQ.

Centroid ``k`` serves worker ``worker_of_centroid[k]``. Online refit replaces centroids and
that permutation together (``set_centroids``) so clusters stay on the workers already warm
with their experts.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from stages.errors import EldrError
from stages.serve.policies.base import DecodePolicy, RoutingRequest
from stages.serve.policies.select import least_loaded_random

DEFAULT_TAU = 0.1


class EldrPolicy(DecodePolicy):
    name: ClassVar[str] = "eldr"
    uses_signature: ClassVar[bool] = True

    def __init__(
        self,
        num_workers: int,
        seed: int = 0,
        *,
        centroids: np.ndarray,
        tau: float = DEFAULT_TAU,
        worker_of_centroid: np.ndarray | None = None,
    ) -> None:
        super().__init__(num_workers, seed)
        if not np.isfinite(tau) or tau < 0:
            raise EldrError(f"tau must be a finite number >= 0, got {tau}")
        self.tau = float(tau)
        self.set_centroids(centroids, worker_of_centroid)

    def set_centroids(
        self, centroids: np.ndarray, worker_of_centroid: np.ndarray | None = None
    ) -> None:
        """Install centroids ``[K, D]`` and their worker permutation (identity by default)."""
        c = np.ascontiguousarray(centroids, dtype=np.float32)
        if c.ndim != 2 or c.shape[0] != self.num_workers:
            raise EldrError(
                f"ELDR needs one centroid per decode worker: got centroids of shape {c.shape}"
                f" for {self.num_workers} workers"
            )
        perm = (
            np.arange(self.num_workers)
            if worker_of_centroid is None
            else np.asarray(worker_of_centroid, dtype=np.int64)
        )
        if perm.shape != (self.num_workers,) or not np.array_equal(
            np.sort(perm), np.arange(self.num_workers)
        ):
            raise EldrError(
                f"worker_of_centroid must be a permutation of 0..{self.num_workers - 1}"
            )
        by_worker = np.empty_like(c)
        by_worker[perm] = c
        # One tuple assignment: a reader never sees centroids from one fit and a permutation
        # from another.
        self._state = (c, perm, by_worker)

    @property
    def centroids(self) -> np.ndarray:
        return self._state[0]

    @property
    def worker_of_centroid(self) -> np.ndarray:
        return self._state[1]

    @property
    def centroids_by_worker(self) -> np.ndarray:
        """Row ``w`` is the centroid worker ``w`` serves."""
        return self._state[2]

    def cluster_of_worker(self) -> np.ndarray:
        """Inverse permutation: which centroid each worker serves."""
        perm = self._state[1]
        inv = np.empty_like(perm)
        inv[perm] = np.arange(perm.size)
        return inv

    def similarities(self, features: np.ndarray) -> np.ndarray:
        """Cosine similarity of ``features`` to each worker's centroid, indexed by worker."""
        by_worker = self._state[2]
        if features.shape != (by_worker.shape[1],):
            raise EldrError(
                f"feature vector has shape {features.shape}, centroids expect"
                f" ({by_worker.shape[1]},)"
            )
        return by_worker @ features

    def choose(self, request: RoutingRequest) -> int:
        if request.features is None:
            return least_loaded_random(request.loads, request.eligible, self.rng)
        eligible = request.eligible
        s = self.similarities(request.features)
        if not eligible.all():
            s = np.where(eligible, s, -np.inf)  # an ineligible worker can never enter the band
        best = float(s.max())
        if not math.isfinite(best):
            # Only non-finite features (a corrupt signature) get here; do no harm.
            return least_loaded_random(request.loads, eligible, self.rng)
        band = s >= best - self.tau
        if self.tau > 0 and np.count_nonzero(band) == 1:
            # The best alone would pin a hot cluster to one worker; admit the runner-up.
            rest = np.where(band, -np.inf, s)
            second = int(rest.argmax())
            if rest[second] > -np.inf:
                band[second] = True
        return self.pick_in_band(np.flatnonzero(band), s, request)

    def pick_in_band(self, band: np.ndarray, s: np.ndarray, request: RoutingRequest) -> int:
        """The paper's pick: fewest in flight; argmin keeps the lowest index on ties."""
        return int(band[request.loads[band].argmin()])
