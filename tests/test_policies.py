"""Each decode policy's rule, eligibility, and the registry."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from stages.errors import EldrError
from stages.routing.context import RoutingContext
from stages.routing.policies import (
    POLICIES,
    EldrBoundedParams,
    EldrBoundedPolicy,
    EldrPolicy,
    RoutingRequest,
    make_policy,
    needs_centroids,
)
from stages.routing.policies.jsq import JsqPolicy
from stages.routing.policies.p2c import PowerOfTwoPolicy
from stages.routing.policies.random_policy import RandomPolicy
from stages.routing.policies.round_robin import RoundRobinPolicy


def req(loads, eligible=None, features=None) -> RoutingRequest:
    loads = np.asarray(loads, dtype=np.int64)
    elig = np.ones(loads.size, bool) if eligible is None else np.asarray(eligible, bool)
    return RoutingRequest(loads=loads, eligible=elig, features=features)


def unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float32)
    return v / np.linalg.norm(v)


# Four orthogonal centroids: similarity to centroid k is just feature component k.
EYE4 = np.eye(4, dtype=np.float32)
EYE2 = np.eye(2, dtype=np.float32)


# --- registry ---


def test_registry_names_every_policy() -> None:
    assert set(POLICIES) == {"eldr", "eldr-bl", "eldr-union", "eldr-kv", "kv", "rr", "jsq",
                             "random", "p2c"}
    assert isinstance(make_policy("rr", RoutingContext(3)), RoundRobinPolicy)
    assert isinstance(make_policy("jsq", RoutingContext(3)), JsqPolicy)
    assert isinstance(make_policy("random", RoutingContext(3)), RandomPolicy)
    assert isinstance(make_policy("p2c", RoutingContext(3)), PowerOfTwoPolicy)
    assert isinstance(make_policy("eldr", RoutingContext(4, centroids=EYE4)), EldrPolicy)
    assert isinstance(make_policy("eldr-bl", RoutingContext(4, centroids=EYE4)), EldrBoundedPolicy)
    assert [name for name in POLICIES if needs_centroids(name)] == ["eldr", "eldr-bl"]


def test_registry_errors() -> None:
    with pytest.raises(EldrError, match="unknown policy"):
        make_policy("nope", RoutingContext(3))
    with pytest.raises(EldrError, match="needs centroids"):
        make_policy("eldr", RoutingContext(4))
    with pytest.raises(EldrError, match="4 centroids for 5 decode workers"):
        make_policy("eldr", RoutingContext(5, centroids=EYE4))
    with pytest.raises(EldrError, match="tau"):
        make_policy("eldr", RoutingContext(4, centroids=EYE4), {"tau": -0.1})
    with pytest.raises(EldrError):
        make_policy("rr", RoutingContext(0))


# --- baselines ---


def test_round_robin_cycles_and_skips_ineligible() -> None:
    p = make_policy("rr", RoutingContext(4))
    assert [p.choose(req([0, 0, 0, 0])) for _ in range(5)] == [0, 1, 2, 3, 0]
    mask = [True, False, True, True]
    assert [p.choose(req([0] * 4, mask)) for _ in range(4)] == [2, 3, 0, 2]


def test_jsq_picks_least_loaded_with_random_ties() -> None:
    p = make_policy("jsq", RoutingContext(4, seed=1))
    assert p.choose(req([3, 1, 2, 5])) == 1
    picks = Counter(p.choose(req([1, 0, 0, 0], [True, True, False, True])) for _ in range(200))
    assert set(picks) == {1, 3}  # both tied workers, never the ineligible one
    assert min(picks.values()) > 50


def test_random_only_eligible_and_covers_them() -> None:
    p = make_policy("random", RoutingContext(5, seed=2))
    picks = Counter(p.choose(req([0] * 5, [True, False, True, True, False])) for _ in range(300))
    assert set(picks) == {0, 2, 3}


def test_p2c_keeps_the_less_loaded_of_two() -> None:
    p = make_policy("p2c", RoutingContext(2, seed=3))
    assert all(p.choose(req([5, 1])) == 1 for _ in range(50))
    p3 = make_policy("p2c", RoutingContext(3, seed=3))
    # The most loaded of three can never win a pairwise comparison.
    assert all(p3.choose(req([1, 9, 0])) != 1 for _ in range(100))
    assert all(p3.choose(req([0, 0, 0], [False, True, False])) == 1 for _ in range(10))
    picks = Counter(p3.choose(req([0, 0, 0], [True, False, True])) for _ in range(200))
    assert set(picks) == {0, 2}


def test_seeded_policies_are_reproducible() -> None:
    for name in ("jsq", "random", "p2c"):
        context = RoutingContext(6, seed=7)
        a, b = make_policy(name, context), make_policy(name, context)
        r = req([0, 0, 1, 0, 0, 1])
        assert [a.choose(r) for _ in range(30)] == [b.choose(r) for _ in range(30)]


# --- ELDR band ---


def test_eldr_tau0_is_nearest_centroid_whatever_the_load() -> None:
    p = make_policy("eldr", RoutingContext(4, centroids=EYE4), {"tau": 0.0})
    f = unit([0.1, 0.2, 0.9, 0.3])
    assert p.choose(req([0, 0, 50, 0], features=f)) == 2


def test_eldr_band_picks_least_loaded_candidate() -> None:
    p = make_policy("eldr", RoutingContext(4, centroids=EYE4), {"tau": 0.1})
    f = unit([0.70, 0.66, 0.1, 0.0])  # s0 and s1 within 0.1 of each other; s2, s3 far
    assert p.choose(req([4, 2, 0, 0], features=f)) == 1
    assert p.choose(req([1, 2, 0, 0], features=f)) == 0


def test_eldr_ties_go_to_lowest_index() -> None:
    p = make_policy("eldr", RoutingContext(4, centroids=EYE4), {"tau": 0.1})
    f = unit([0.0, 0.70, 0.0, 0.68])
    assert p.choose(req([0, 1, 0, 1], features=f)) == 1


def test_eldr_single_candidate_admits_second_best() -> None:
    p = make_policy("eldr", RoutingContext(4, centroids=EYE4), {"tau": 0.05})
    f = unit([0.2, 0.9, 0.0, 0.5])  # band {1} alone; runner-up is 3, not 0
    assert p.choose(req([0, 3, 0, 1], features=f)) == 3
    assert p.choose(req([0, 3, 0, 3], features=f)) == 1  # tie -> lowest index
    # tau = 0 never widens the band.
    p0 = make_policy("eldr", RoutingContext(4, centroids=EYE4), {"tau": 0.0})
    assert p0.choose(req([0, 3, 0, 1], features=f)) == 1


def test_eldr_tau1_is_join_shortest_queue() -> None:
    p = make_policy("eldr", RoutingContext(4, centroids=EYE4), {"tau": 1.0})
    rng = np.random.default_rng(0)
    for _ in range(50):
        f = unit(rng.random(4) + 1e-3)  # non-negative, like count x IDF features
        loads = rng.integers(0, 5, size=4)
        assert p.choose(req(loads, features=f)) == int(np.argmin(loads))


def test_eldr_skips_ineligible_workers() -> None:
    # Cluster 2 resembles cluster 3, so while worker 2 is down worker 3 serves it.
    near = np.stack([EYE4[0], EYE4[1], unit([0, 0, 1, 0.6]), EYE4[3]])
    p = make_policy("eldr", RoutingContext(4, centroids=near), {"tau": 0.0})
    f = unit([0.3, 0.2, 0.9, 0.1])
    assert p.choose(req([0, 0, 0, 0], [True, True, False, True], features=f)) == 3
    assert p.choose(req([0, 0, 0, 0], features=f)) == 2  # back up: its cluster again
    p1 = make_policy("eldr", RoutingContext(4, centroids=EYE4), {"tau": 0.1})
    only = [False, False, True, False]
    assert p1.choose(req([9, 0, 9, 0], only, features=unit([1, 0, 0, 0]))) == 2


def test_eldr_without_features_falls_back_to_jsq() -> None:
    p = make_policy("eldr", RoutingContext(4, centroids=EYE4, seed=4), {"tau": 0.0})
    assert p.choose(req([3, 2, 0, 1])) == 2
    picks = {p.choose(req([1, 0, 0, 1])) for _ in range(100)}
    assert picks == {1, 2}


def test_eldr_worker_of_centroid_permutation() -> None:
    perm = np.array([2, 0, 3, 1])  # centroid k serves worker perm[k]
    context = RoutingContext(4, centroids=EYE4, worker_of_centroid=perm)
    p = make_policy("eldr", context, {"tau": 0.0})
    for k in range(4):
        assert p.choose(req([0] * 4, features=EYE4[k])) == perm[k]
    p.set_centroids(EYE4)  # back to the identity
    assert p.choose(req([0] * 4, features=EYE4[2])) == 2


def test_eldr_rejects_bad_shapes() -> None:
    p = make_policy("eldr", RoutingContext(4, centroids=EYE4))
    with pytest.raises(EldrError, match="every worker at least one"):
        p.set_centroids(EYE4, np.array([0, 0, 1, 2]))
    with pytest.raises(EldrError, match="3 centroids for 4 decode workers"):
        p.set_centroids(EYE4[:3])
    with pytest.raises(EldrError, match="shape"):
        p.choose(req([0] * 4, features=np.ones(3, np.float32)))


# --- ELDR with bounded loads ---


def test_paper_rule_is_jsq_with_two_workers() -> None:
    """The runner-up rule always fills a two-worker band, so load alone decides."""
    p = make_policy("eldr", RoutingContext(2, centroids=np.eye(2, dtype=np.float32)))
    assert p.choose(req([1, 0], features=unit([1, 0]))) == 1


def test_bounded_prefers_the_best_match_within_the_load_cap() -> None:
    p = make_policy("eldr-bl", RoutingContext(2, centroids=np.eye(2, dtype=np.float32)))
    # Loads 2 and 1 plus this request: cap ceil(1.25 * 4 / 2) = 3, worker 0 may reach 3.
    assert p.choose(req([2, 1], features=unit([1, 0]))) == 0
    # Loads 4 and 1: cap ceil(1.25 * 6 / 2) = 4; worker 0 would exceed it, so it spills.
    assert p.choose(req([4, 1], features=unit([1, 0]))) == 1


def test_bounded_tries_band_members_by_similarity() -> None:
    p = make_policy("eldr-bl", RoutingContext(4, centroids=EYE4), {"tau": 0.5})
    features = unit([1.0, 0.9, 0.8, 0.0])  # band: workers 0, 1, 2 (worker 3 is far)
    # Cap ceil(1.25 * 13 / 4) = 5: worker 0 (5 in flight) is over it, worker 1 is next best.
    assert p.choose(req([5, 4, 0, 3], features=features)) == 1
    # Everyone in the band over the cap (epsilon 0: cap ceil(27 / 4) = 7): the paper's
    # least-loaded pick inside the band, never the idle worker outside it.
    strict = EldrBoundedPolicy(
        RoutingContext(4, centroids=EYE4), EldrBoundedParams(tau=0.5, epsilon=0.0)
    )
    assert strict.choose(req([9, 9, 8, 0], features=features)) == 2
    assert strict.choose(req([8, 9, 9, 0], features=features)) == 0


def test_bounded_never_picks_an_ineligible_worker() -> None:
    p = make_policy("eldr-bl", RoutingContext(4, centroids=EYE4), {"tau": 0.0})
    picks = {
        p.choose(req([0, 0, 0, 0], [False, True, True, True], features=unit([1, 0.1, 0, 0])))
        for _ in range(10)
    }
    assert picks == {1}


def test_bounded_rejects_bad_epsilon() -> None:
    with pytest.raises(EldrError, match="epsilon"):
        EldrBoundedParams(epsilon=-1)


def test_bounded_cap_never_exceeds_the_workers_batch_size() -> None:
    p = make_policy("eldr-bl", RoutingContext(2, centroids=EYE2, worker_slots=8))
    # Without slots the cap would be ceil(1.25 * 16 / 2) = 10; a full worker (8) must spill.
    assert p.choose(req([8, 7], features=unit([1, 0]))) == 1
    assert p.choose(req([7, 7], features=unit([1, 0]))) == 0
    with pytest.raises(EldrError, match="slots"):
        RoutingContext(2, centroids=EYE2, worker_slots=0)


# --- what a policy routes on (the proxy's and the simulator's one rule) ---


def test_routing_inputs_missing_unknown_and_usable() -> None:
    from stages.routing.inputs import routing_inputs

    counts = np.array([[2, 0], [0, 2]], np.int32)
    def keep_first(c: np.ndarray) -> np.ndarray:  # a transform that keeps layer 0 only
        return c[0].astype(np.float32)

    assert routing_inputs(None, keep_first).counts is None
    # All zero is a recording failure: missing, whatever the transform.
    assert routing_inputs(np.zeros((2, 2), np.int32), keep_first).counts is None
    both = routing_inputs(counts, keep_first)
    assert both.counts is counts and both.features is not None
    assert both.features.dtype == np.float32
    # No count in a kept layer: features unknown, counts still usable.
    blind = routing_inputs(np.array([[0, 0], [0, 2]], np.int32), keep_first)
    assert blind.features is None and blind.counts is not None
    no_artifact = routing_inputs(counts, None)
    assert no_artifact.features is None and no_artifact.counts is counts
