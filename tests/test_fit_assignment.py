"""Balanced assignment: optimal (against scipy's Hungarian on expanded instances), balanced,
and honest about its certificate."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from stages.fit.balanced_assignment import balanced_assignment, balanced_sizes


def hungarian_balanced(scores: np.ndarray) -> float:
    """Optimum of the floor/ceil problem by expansion: q core slots and one extra slot per
    cluster, and K - r dummy rows that may only fill extra slots (so each cluster keeps >= q)."""
    n, k = scores.shape
    q, r = balanced_sizes(n, k)
    forbid = 1e9
    cost = np.zeros((n + (k - r if r else 0), k * (q + 1)))
    for j in range(k):
        cols = slice(j * (q + 1), (j + 1) * (q + 1))
        cost[:n, cols] = -scores[:, [j]]
        cost[n:, cols] = forbid
        cost[n:, (j + 1) * (q + 1) - 1] = 0.0
    if not r:  # sizes are exactly q: drop the extra slots
        keep = [c for c in range(k * (q + 1)) if c % (q + 1) != q]
        cost = cost[:, keep]
    rows, cols = linear_sum_assignment(cost)
    real = rows < n
    return float(-cost[rows[real], cols[real]].sum())


def hungarian_fixed(scores: np.ndarray, caps: np.ndarray) -> float:
    cols = np.repeat(np.arange(scores.shape[1]), caps)
    rows, picked = linear_sum_assignment(-scores[:, cols])
    return float(scores[rows, cols[picked]].sum())


def assert_balanced(sizes: np.ndarray, n: int, k: int) -> None:
    q, r = balanced_sizes(n, k)
    assert sizes.sum() == n
    assert sorted(sizes.tolist()) == [q] * (k - r) + [q + 1] * r


@pytest.mark.parametrize("seed", range(40))
def test_matches_hungarian_on_small_instances(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 7))
    n = int(rng.integers(k, 45))
    scores = rng.standard_normal((n, k))
    res = balanced_assignment(scores, presolve=bool(seed % 2))
    opt = hungarian_balanced(scores)
    assert_balanced(res.sizes, n, k)
    assert res.value == pytest.approx(opt, abs=1e-9)
    assert res.gap_bound <= 1e-9  # exact: the dual certificate closes
    assert res.value == pytest.approx(scores[np.arange(n), res.labels].sum())


@pytest.mark.parametrize("seed", range(20))
def test_integer_scores_are_solved_exactly(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    k = int(rng.integers(2, 6))
    n = int(rng.integers(k, 40))
    scores = rng.integers(-4, 5, size=(n, k)).astype(np.float64)  # many ties
    res = balanced_assignment(scores, presolve=bool(seed % 2))
    assert_balanced(res.sizes, n, k)
    assert res.value == hungarian_balanced(scores)


@pytest.mark.parametrize("seed", range(10))
def test_fixed_capacities_match_hungarian(seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    k = int(rng.integers(2, 6))
    caps = rng.integers(1, 8, size=k)
    scores = rng.standard_normal((int(caps.sum()), k))
    res = balanced_assignment(scores, capacities=caps)
    assert res.sizes.tolist() == caps.tolist()
    assert res.value == pytest.approx(hungarian_fixed(scores, caps), abs=1e-7)


@pytest.mark.parametrize("presolve", [True, False])
def test_skewed_large_instance_is_balanced_and_certified(presolve: bool) -> None:
    # A third of the points prefer cluster 0: the argmax is far from balanced.
    rng = np.random.default_rng(0)
    n, k = 20_011, 16
    scores = rng.random((n, k)).astype(np.float32)
    scores[: n // 3, 0] += 1.0
    res = balanced_assignment(scores, presolve=presolve)
    assert_balanced(res.sizes, n, k)
    assert res.gap_bound <= 1e-9 * n
    # Warm-started from its own (optimal) prices, only boundary ties need repairing.
    warm = balanced_assignment(scores, prices=res.prices)
    assert warm.moves <= 2 * k and warm.value == pytest.approx(res.value, abs=1e-6)


def test_single_cluster_and_bad_input() -> None:
    res = balanced_assignment(np.ones((5, 1)))
    assert res.labels.tolist() == [0] * 5 and res.gap_bound == 0.0
    with pytest.raises(ValueError, match="non-empty"):
        balanced_assignment(np.ones((2, 3)))
    with pytest.raises(ValueError, match="finite"):
        balanced_assignment(np.array([[0.0, np.nan]]))
    with pytest.raises(ValueError, match="capacities"):
        balanced_assignment(np.ones((4, 2)), capacities=np.array([3, 3]))


@pytest.mark.parametrize("seed", range(3))
def test_matches_an_independent_min_cost_flow(seed: int) -> None:
    """Cross-check on larger instances with networkx's network simplex: points -> clusters ->
    sink, each cluster taking q units, r of them one more (through a shared overflow node)."""
    import networkx as nx

    rng = np.random.default_rng(100 + seed)
    n, k = 1500 + 37 * seed, 8
    scores = rng.standard_normal((n, k))
    q, r = balanced_sizes(n, k)
    scale = 10**6  # network simplex wants integer costs
    graph = nx.DiGraph()
    graph.add_node("src", demand=-n)
    graph.add_node("sink", demand=n)
    for i in range(n):
        graph.add_edge("src", ("p", i), capacity=1, weight=0)
        for j in range(k):
            graph.add_edge(("p", i), ("c", j), capacity=1, weight=-round(scores[i, j] * scale))
    for j in range(k):
        graph.add_edge(("c", j), "sink", capacity=q, weight=0)
        graph.add_edge(("c", j), "over", capacity=1, weight=0)
    graph.add_edge("over", "sink", capacity=r, weight=0)
    flow = nx.network_simplex(graph)[1]
    flow_total = sum(
        scores[i, j] for i in range(n) for j in range(k) if flow[("p", i)][("c", j)]
    )
    result = balanced_assignment(scores)
    assert_balanced(np.bincount(result.labels, minlength=k), n, k)
    ours = float(scores[np.arange(n), result.labels].sum())
    assert ours == pytest.approx(flow_total, abs=n / scale * 2)
