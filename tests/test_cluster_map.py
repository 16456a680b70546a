"""K centroids on D <= K decode workers: balanced, similarity-aware, elastic without a refit."""

from __future__ import annotations

import numpy as np
import pytest

from stages.errors import EldrError
from stages.routing.context import RoutingContext
from stages.routing.policies import RoutingRequest, make_policy
from stages.routing.policies.cluster_map import remap_for_healthy, spread_clusters


def families(num_families: int, per_family: int, dim: int = 32, seed: int = 0) -> np.ndarray:
    """Centroids in tight families: members of a family share most of their direction."""
    rng = np.random.default_rng(seed)
    axes = np.eye(dim, dtype=np.float32)[rng.permutation(dim)[:num_families]]
    rows = np.repeat(axes, per_family, axis=0) + rng.normal(
        scale=0.15, size=(num_families * per_family, dim)
    )
    rows = rows[rng.permutation(rows.shape[0])]  # the fit numbers clusters arbitrarily
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def family_of(centroids: np.ndarray) -> np.ndarray:
    return np.argmax(np.abs(centroids), axis=1)  # the dominant axis names the family


def test_twenty_clusters_on_two_workers_are_balanced_and_grouped_by_similarity() -> None:
    centroids = families(2, 10)
    mapping = spread_clusters(centroids, 2)
    assert sorted(np.bincount(mapping)) == [10, 10]
    fam = family_of(centroids)
    for worker in (0, 1):
        assert len(set(fam[mapping == worker])) == 1  # one family per worker


def test_equal_counts_keep_the_papers_one_to_one_map() -> None:
    centroids = families(4, 1)
    assert list(spread_clusters(centroids, 4)) == [0, 1, 2, 3]
    with pytest.raises(EldrError, match="4 centroids for 5 decode workers"):
        spread_clusters(centroids, 5)


def test_uneven_shares_differ_by_at_most_one() -> None:
    centroids = families(3, 7, seed=1)
    counts = np.bincount(spread_clusters(centroids, 4), minlength=4)
    assert counts.sum() == 21 and counts.max() - counts.min() <= 1


def test_a_dead_workers_clusters_move_to_the_most_similar_survivors_and_come_back() -> None:
    centroids = families(3, 4, seed=2)
    mapping = spread_clusters(centroids, 3)
    healthy = np.array([True, False, True])
    moved = remap_for_healthy(centroids, mapping, healthy)
    assert not (moved == 1).any()  # nothing left on the dead worker
    assert np.array_equal(moved[mapping != 1], mapping[mapping != 1])  # survivors keep theirs
    assert np.bincount(moved, minlength=3).max() <= 6  # ceil(12 / 2)
    # Healthy again: the map is a function of the healthy set, so worker 1 gets its own back.
    assert np.array_equal(remap_for_healthy(centroids, mapping, np.ones(3, bool)), mapping)


def test_requests_of_a_dead_workers_cluster_reach_a_survivor_and_return_after() -> None:
    centroids = families(2, 10, seed=3)
    policy = make_policy("eldr", RoutingContext(2, centroids=centroids), {"tau": 0.0})
    loads = np.zeros(2, np.int64)
    home = [policy.choose(RoutingRequest(loads, np.ones(2, bool), c)) for c in centroids]
    assert list(home) == list(policy.worker_of_centroid)
    only_one = np.array([True, False])
    assert {policy.choose(RoutingRequest(loads, only_one, c)) for c in centroids} == {0}
    back = [policy.choose(RoutingRequest(loads, np.ones(2, bool), c)) for c in centroids]
    assert back == home
