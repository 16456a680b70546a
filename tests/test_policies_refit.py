"""Online refit: rolling window, schedule, and cluster-to-worker alignment."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from stages.routing.context import RoutingContext
from stages.routing.policies import EldrPolicy, RoutingRequest, make_policy
from stages.serve.proxy.router.online_refit import OnlineRefitter, align_to_current


def unit_rows(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def clustered(centers: np.ndarray, per: int, rng: np.random.Generator) -> np.ndarray:
    noise = rng.normal(scale=0.05, size=(centers.shape[0] * per, centers.shape[1]))
    return unit_rows(np.repeat(centers, per, axis=0) + noise)


def test_align_recovers_a_shuffled_fit() -> None:
    rng = np.random.default_rng(0)
    current = unit_rows(rng.random((6, 12)))
    order = rng.permutation(6)
    drifted = unit_rows(current[order] + rng.normal(scale=0.01, size=current.shape))
    replaces = align_to_current(drifted, current)
    assert np.array_equal(replaces, order)  # new centroid j takes over from old order[j]


def test_window_is_time_based() -> None:
    r = OnlineRefitter(2, window_s=5.0, interval_s=1.0, min_samples=3)
    for t in (0.0, 1.0, 2.0, 6.5):
        r.observe(np.ones(3, np.float32), t)
    assert r.window_size(6.5) == 2  # t=0 and t=1 fell out of [1.5, 6.5]
    assert not r.due(6.5)
    r.observe(np.ones(3, np.float32), 6.6)
    assert r.due(6.6)
    r.mark_done(6.6)
    assert not r.due(7.0)  # interval not elapsed
    r.observe(np.ones(3, np.float32), 7.7)
    assert r.due(7.7)


def _fake_fit(order: np.ndarray, centers: np.ndarray):
    def fit(samples: np.ndarray, k: int, seed: int) -> np.ndarray:
        assert k == centers.shape[0] and samples.ndim == 2
        return centers[order]  # a fit that numbers clusters differently

    return fit


def refit(r: OnlineRefitter, policy: EldrPolicy, now: float) -> int:
    """One refit as the proxy's router applies it: new centroids take their match's worker."""
    result = r.fit(r.snapshot(now), policy.centroids)
    policy.set_centroids(result.centroids, policy.worker_of_centroid[result.replaces])
    r.mark_done(now)
    return result.num_samples


def test_refit_keeps_clusters_on_their_workers() -> None:
    rng = np.random.default_rng(1)
    centers = unit_rows(rng.random((4, 8)) ** 4)
    policy = make_policy("eldr", RoutingContext(4, centroids=centers), {"tau": 0.0})
    order = np.array([3, 1, 0, 2])
    r = OnlineRefitter(4, window_s=5.0, interval_s=1.0, fit_fn=_fake_fit(order, centers))
    for i, x in enumerate(clustered(centers, 5, rng)):
        r.observe(x, 0.01 * i)
    assert r.due(1.0) and refit(r, policy, 1.0) == 20
    # Each old cluster's points still go to the same worker despite the renumbering.
    for k in range(4):
        f = centers[k]
        assert policy.choose(RoutingRequest(np.zeros(4, np.int64), np.ones(4, bool), f)) == k
    assert np.array_equal(policy.worker_of_centroid, order)  # new j = old order[j]
    assert not r.due(1.5)  # not due yet


def test_refit_of_more_clusters_than_workers_keeps_each_workers_share() -> None:
    rng = np.random.default_rng(3)
    centers = unit_rows(rng.random((6, 8)) ** 4)
    policy = make_policy("eldr", RoutingContext(2, centroids=centers), {"tau": 0.0})
    before = policy.worker_of_centroid.copy()
    order = np.array([5, 2, 4, 0, 1, 3])
    r = OnlineRefitter(6, window_s=5.0, interval_s=1.0, fit_fn=_fake_fit(order, centers))
    for i, x in enumerate(clustered(centers, 5, rng)):
        r.observe(x, 0.01 * i)
    refit(r, policy, 1.0)
    assert np.array_equal(policy.worker_of_centroid, before[order])
    for k in range(6):
        request = RoutingRequest(np.zeros(2, np.int64), np.ones(2, bool), centers[k])
        assert policy.choose(request) == before[k]


def test_clear_drops_old_feature_space() -> None:
    r = OnlineRefitter(2, min_samples=1)
    r.observe(np.ones(3, np.float32), 0.0)
    r.clear()
    assert r.window_size(0.0) == 0


@pytest.mark.skipif(
    importlib.util.find_spec("stages.fit.kmeans") is None, reason="fit stage not present yet"
)
def test_real_balanced_fit_tracks_drift() -> None:
    rng = np.random.default_rng(2)
    centers = unit_rows(rng.random((4, 16)) ** 6)
    policy = make_policy("eldr", RoutingContext(4, centroids=centers), {"tau": 0.0})
    r = OnlineRefitter(4, window_s=5.0, interval_s=1.0, seed=0)
    for i, x in enumerate(clustered(centers, 30, rng)):
        r.observe(x, 0.001 * i)
    assert r.due(1.0) and refit(r, policy, 1.0) == 120
    loads, elig = np.zeros(4, np.int64), np.ones(4, bool)
    assert [policy.choose(RoutingRequest(loads, elig, centers[k])) for k in range(4)] == [
        0,
        1,
        2,
        3,
    ]
