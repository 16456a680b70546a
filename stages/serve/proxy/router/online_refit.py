"""Online refit: re-cluster recent signatures and keep each cluster on the worker it had.

Traffic drifts away from the calibration set; the artifact's option refits balanced centroids
every 1-2.5 s on the last ~5 s of signatures, as many as the artifact has. A fresh k-means
numbers its clusters arbitrarily, so new centroids are matched to the current ones (Hungarian,
max total cosine) and each takes over the worker of the one it matched: a cluster that barely
moved keeps its worker and that worker's warm experts.

Clock-agnostic (callers pass ``now``) and free of asyncio, so the simulator drives it with
virtual time and the proxy runs ``fit`` in a thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from stages.errors import EldrError

FitFn = Callable[[np.ndarray, int, int], np.ndarray]
"""(samples [N, D], k, seed) -> centroids [k, D] unit rows."""


def balanced_fit(samples: np.ndarray, k: int, seed: int) -> np.ndarray:
    # Imported on use: the fit stage is optional for proxies that never refit.
    from stages.fit.kmeans import balanced_spherical_kmeans

    return np.asarray(balanced_spherical_kmeans(samples, k, seed=seed, balanced=True).centroids)


def align_to_current(new_centroids: np.ndarray, current: np.ndarray) -> np.ndarray:
    """For each new centroid, the index of the current one it replaces (max total cosine)."""
    if new_centroids.shape != current.shape:
        raise EldrError(
            f"refit centroids {new_centroids.shape} do not match current {current.shape}"
        )
    sim = new_centroids @ current.T
    rows, cols = linear_sum_assignment(sim, maximize=True)
    perm = np.empty(new_centroids.shape[0], dtype=np.int64)
    perm[rows] = cols
    return perm


@dataclass(frozen=True)
class RefitResult:
    centroids: np.ndarray  # float32 [K, D], unit rows, in fit order
    replaces: np.ndarray  # int64 [K]: the current centroid each new one takes over from
    num_samples: int


class OnlineRefitter:
    """Rolling window of feature vectors plus the schedule and math of a refit."""

    def __init__(
        self,
        num_clusters: int,
        *,
        window_s: float = 5.0,
        interval_s: float = 2.0,
        min_samples: int | None = None,
        max_samples: int = 1000,
        seed: int = 0,
        fit_fn: FitFn = balanced_fit,
    ) -> None:
        if window_s <= 0 or interval_s <= 0:
            raise EldrError("refit window and interval must be > 0 seconds")
        self.num_clusters = num_clusters
        self.window_s = window_s
        self.interval_s = interval_s
        # Far fewer samples than clusters makes centroids noise, so wait for a few per cluster.
        self.min_samples = max(min_samples if min_samples is not None else 4 * num_clusters, 1)
        self.seed = seed
        self.fit_fn = fit_fn
        # maxlen bounds memory and fit time when traffic outpaces the window.
        self._window: deque[tuple[float, np.ndarray]] = deque(maxlen=max_samples)
        self._last_refit: float | None = None
        self.refits = 0

    def clear(self) -> None:
        self._window.clear()
        self._last_refit = None

    def observe(self, features: np.ndarray, now: float) -> None:
        self._window.append((now, features))

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        while self._window and self._window[0][0] < horizon:
            self._window.popleft()

    def window_size(self, now: float) -> int:
        self._prune(now)
        return len(self._window)

    def due(self, now: float) -> bool:
        if self._last_refit is not None and now - self._last_refit < self.interval_s:
            return False
        return self.window_size(now) >= self.min_samples

    def snapshot(self, now: float) -> np.ndarray:
        """Stacked window ``[N, D]`` (a copy, safe to hand to another thread)."""
        self._prune(now)
        return np.stack([f for _, f in self._window]).astype(np.float32, copy=False)

    def fit(self, samples: np.ndarray, current: np.ndarray) -> RefitResult:
        """Balanced fit plus alignment. Touches no state, so it may run off the event loop."""
        centroids = np.asarray(
            self.fit_fn(samples, self.num_clusters, self.seed + self.refits), dtype=np.float32
        )
        return RefitResult(centroids, align_to_current(centroids, current), int(samples.shape[0]))

    def defer(self, now: float) -> None:
        self._last_refit = now

    def mark_done(self, now: float) -> None:
        self._last_refit = now
        self.refits += 1
