"""Exact balanced assignment of N points to K clusters, for N in the millions and K small.

Problem: given scores ``s[i, k]`` (cosine similarity of point i to centroid k), choose labels
maximising ``sum_i s[i, label_i]`` with cluster sizes that differ by at most one: for
``N = q*K + r``, exactly ``r`` clusters (the solver picks which) get ``q + 1`` points and the
others ``q``. Optionally the sizes are fixed per cluster instead. It is a transportation
problem (a min-cost flow), solved exactly, never with an N x N or N x K*cap cost matrix.

Method:

1. Prices. ``dual_prices`` minimises the entropy-smoothed LP dual (K variables, Newton), giving
   cluster prices ``p`` close to the optimal duals. Skipped when warm-start prices (the previous
   k-means iteration's) already misplace few points.
2. Start. Every point takes its best net cluster, ``argmax_k s[i,k] - p_k``. Such an
   assignment is optimal for the sizes it happens to have (no exchange can gain), and with good
   prices those sizes are within a few dozen points of the targets.
3. Repair: successive shortest paths (SSP) on the K-node residual graph. Moving one point from
   cluster a to b costs ``min_{i in a} (s_ia - s_ib)``; with reduced costs ``cost - p_a + p_b``
   (all >= 0 because every point sits at its argmax), Dijkstra finds the cheapest chain of moves
   from an over-full to an under-full cluster, the chain is applied, and the potentials are
   updated so reduced costs stay >= 0. This is the textbook exact min-cost-flow algorithm; each
   step fixes one unit of imbalance, so the work is O(N K) to start plus O(K^2) (and now and
   then O(N/K) to refill a candidate buffer) per misplaced point: a few dozen to a few hundred
   after the presolve, measured at 1M x 16. Each pair (a, b) starts with its argmin and gets a
   sorted buffer of its cheapest candidates once it has moved a point.

Floor/ceil sizes: all clusters get ``q + 1`` slots and ``K - r`` dummy units worth 0 fill the
spare ones, at most one per cluster (a unit-capacity arc from a dummy node to each cluster). A
cluster holding a dummy ends with ``q`` points. Dummies start in the cheapest clusters and move
along shortest paths like points, so the solver also picks which clusters get the extra point.

Why it is exact, and the certificate: SSP with non-negative reduced costs ends at a min-cost
flow (optimal integral assignment). Independently of that argument, the result carries
``gap_bound = D(p) - value``, where by LP weak duality

    D(p) = sum_i max_k (s[i,k] - p_k) + q * sum_k p_k + (sum of the r largest p_k)

(``+ sum_k c_k p_k`` for fixed sizes ``c``) bounds the optimum from above for any prices. At
termination every point is at its argmax and the dummy clusters are the cheapest, so the gap is
zero up to floating-point rounding. The tests check it against
``scipy.optimize.linear_sum_assignment`` on expanded instances.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from stages.fit.dual_prices import smoothed_dual_prices

# Candidates kept per (from, to) cluster pair, cheapest first; a pair is re-scanned only after
# this many of its candidates have moved away.
_BUFFER = 64
# Rows per block when scanning the N x K scores.
_CHUNK = 65_536


@dataclass(frozen=True)
class AssignmentResult:
    labels: np.ndarray  # int64 [N]: cluster of each point
    sizes: np.ndarray  # int64 [K]
    prices: np.ndarray  # float64 [K]: dual prices (a warm start for a similar problem)
    value: float  # sum_i scores[i, labels[i]]
    gap_bound: float  # certified: optimum - value <= gap_bound (0 up to rounding)
    moves: int  # shortest-path augmentations needed after the price presolve


def balanced_sizes(n: int, k: int) -> tuple[int, int]:
    """``(q, r)`` with ``n = q*k + r``: r clusters get q + 1 points, the rest q."""
    return n // k, n % k


def balanced_assignment(
    scores: np.ndarray,
    *,
    capacities: np.ndarray | None = None,
    prices: np.ndarray | None = None,
    presolve: bool | None = None,
) -> AssignmentResult:
    """Assign each row of ``scores [N, K]`` to a column, maximising the total score.

    Sizes differ by at most one (the solver picks which clusters get the extra point) unless
    ``capacities`` (positive ints [K] summing to N) fixes them. ``prices`` warm-starts the
    duals (e.g. from the previous k-means iteration). ``presolve`` runs the smoothed dual
    first; by default it runs unless the given prices already leave few points misplaced.
    Exact either way; it only changes the time.
    """
    scores = np.asarray(scores)
    if scores.ndim != 2 or scores.shape[1] < 1:
        raise ValueError(f"scores must be [N, K] with K >= 1, got shape {scores.shape}")
    n, k = scores.shape
    if not np.isfinite(scores).all():
        raise ValueError("scores must be finite")
    q, r = balanced_sizes(n, k)
    balanced = capacities is None
    if balanced:
        if n < k:
            raise ValueError(f"cannot split {n} points into {k} non-empty balanced clusters")
        caps = np.full(k, q + (1 if r else 0), np.int64)
        num_dummies = k - r if r else 0
    else:
        caps = np.asarray(capacities, dtype=np.int64)
        if caps.shape != (k,) or (caps < 1).any() or int(caps.sum()) != n:
            raise ValueError(f"capacities must be {k} positive ints summing to {n}")
        num_dummies = 0
    price = np.zeros(k) if prices is None else np.array(prices, dtype=np.float64)
    if price.shape != (k,) or not np.isfinite(price).all():
        raise ValueError(f"prices must be {k} finite numbers, got shape {price.shape}")
    if presolve is None:
        presolve = prices is None or _misplaced(scores, price, caps) > _presolve_threshold(n)
    if presolve and k > 1:
        target = np.full(k, n / k) if balanced else caps.astype(np.float64)
        price, _ = smoothed_dual_prices(scores, target, price)
    repair = _Repair(scores, caps, price, num_dummies)
    moves = repair.run()
    return _result(scores, repair.labels, repair.price[:k], caps, q, r, moves, balanced)


class _Repair:
    """Successive shortest paths on the residual graph of K clusters (+ the dummy node K)."""

    def __init__(
        self, scores: np.ndarray, caps: np.ndarray, price: np.ndarray, num_dummies: int
    ) -> None:
        self.s = scores
        self.n, self.k = scores.shape
        self.caps = caps
        self.labels = _argmax_rows(scores, price)
        self.sizes = np.bincount(self.labels, minlength=self.k).astype(np.int64)
        # Dummies go to the cheapest clusters; the dummy node's price sits between the dummy
        # and the dummy-free clusters, so every dummy arc starts with reduced cost >= 0.
        self.dummy = np.zeros(self.k, bool)
        self.dummy[np.argsort(price, kind="stable")[:num_dummies]] = True
        node_price = price.max() if not num_dummies else price[self.dummy].max()
        self.price = np.append(price, node_price)  # [K + 1]
        self.has_dummies = num_dummies > 0
        self.incoming: list[list[int]] = [[] for _ in range(self.k)]
        self._build_buffers()
        self.row_min = np.full((self.k, self.k), np.inf)
        self.row_arg = np.full((self.k, self.k), -1, np.int64)
        for a in range(self.k):
            self._refresh_row(a)

    def run(self) -> int:
        moves = 0
        while True:
            items = self.sizes + self.dummy
            excess = items > self.caps
            if not excess.any():
                return moves
            self._augment(excess, items < self.caps)
            moves += 1

    # -- shortest path -------------------------------------------------------------------

    def _augment(self, excess: np.ndarray, deficit: np.ndarray) -> None:
        k = self.k
        weights = self._reduced_costs()
        dist = np.full(k + 1, np.inf)
        dist[:k][excess] = 0.0
        prev = np.full(k + 1, -1, np.int64)
        done = np.zeros(k + 1, bool)
        target = -1
        while True:
            u = int(np.argmin(np.where(done, np.inf, dist)))
            if not np.isfinite(dist[u]):
                raise RuntimeError("no augmenting path: the capacities cannot be met")
            done[u] = True
            if u < k and deficit[u]:
                target = u
                break
            cand = dist[u] + weights[u]
            better = ~done & (cand < dist)
            dist[better] = cand[better]
            prev[better] = u
        # Johnson's update keeps every reduced cost >= 0 (potential = -price here).
        self.price -= np.minimum(dist, dist[target])
        path = [target]
        while prev[path[-1]] >= 0:
            path.append(int(prev[path[-1]]))
        path.reverse()
        arcs = list(itertools.pairwise(path))
        moved = [(int(self.row_arg[a, b]), a, b) for a, b in arcs if a < k and b < k]
        for a, b in arcs:
            if b == k:
                self.dummy[a] = False
            elif a == k:
                self.dummy[b] = True
        touched = set()
        for i, a, b in moved:
            self.labels[i] = b
            self.sizes[a] -= 1
            self.sizes[b] += 1
            self.incoming[b].append(i)
            touched.update((a, b))
        for a in touched:
            self._refresh_row(a)

    def _reduced_costs(self) -> np.ndarray:
        """[K+1, K+1]: reduced cost of moving one unit along each residual arc (inf if none)."""
        k, p = self.k, self.price
        w = np.full((k + 1, k + 1), np.inf)
        w[:k, :k] = self.row_min - p[:k, None] + p[None, :k]
        if self.has_dummies:
            w[:k, k] = np.where(self.dummy, p[k] - p[:k], np.inf)  # take a cluster's dummy out
            w[k, :k] = np.where(self.dummy, np.inf, p[:k] - p[k])  # put a dummy in
        np.fill_diagonal(w, np.inf)
        # Rounding can leave -1e-16 where 0 is meant; Dijkstra needs non-negative weights.
        return np.maximum(w, 0.0)

    # -- cheapest move per cluster pair ---------------------------------------------------

    def _build_buffers(self) -> None:
        """Per (a, b): start with the single cheapest member of a (an argmin is ~100x cheaper
        than a partial sort, and most pairs never move a point); a pair that runs out gets
        the _BUFFER cheapest of a's current members."""
        k = self.k
        self.buf_ids = [[np.empty(0, np.int64)] * k for _ in range(k)]
        self.buf_pos = np.zeros((k, k), np.int64)
        order = np.argsort(self.labels, kind="stable")
        bounds = np.searchsorted(self.labels[order], np.arange(k + 1))
        self.members = [order[bounds[a] : bounds[a + 1]] for a in range(k)]
        for a in range(k):
            members = self.members[a]
            if not len(members):
                continue
            cost = self.s[members, a, None].astype(np.float64) - self.s[members]
            best = members[cost.argmin(axis=0)]
            for b in range(k):
                if b != a:
                    self.buf_ids[a][b] = best[b : b + 1]

    def _current_members(self, a: int) -> np.ndarray:
        members = np.concatenate([self.members[a], np.array(self.incoming[a], np.int64)])
        return members[self.labels[members] == a]

    def _cheapest(self, members: np.ndarray, a: int, b: int) -> np.ndarray:
        if not len(members):
            return members
        cost = self.s[members, a].astype(np.float64) - self.s[members, b]
        m = min(_BUFFER, len(members))
        pick = np.argpartition(cost, m - 1)[:m] if m < len(members) else np.arange(m)
        return members[pick[np.argsort(cost[pick], kind="stable")]]

    def _refresh_row(self, a: int) -> None:
        """Recompute the cheapest move out of cluster a to every other cluster."""
        s, labels = self.s, self.labels
        for b in range(self.k):
            if b == a:
                continue
            ids, pos = self.buf_ids[a][b], int(self.buf_pos[a, b])
            while pos < len(ids) and labels[ids[pos]] != a:
                pos += 1
            if pos == len(ids) and self.sizes[a] > 0:
                ids, pos = self._cheapest(self._current_members(a), a, b), 0
                self.buf_ids[a][b] = ids
            self.buf_pos[a, b] = pos
            if pos < len(ids):
                i = int(ids[pos])
                self.row_min[a, b] = float(s[i, a]) - float(s[i, b])
                self.row_arg[a, b] = i
            else:
                self.row_min[a, b], self.row_arg[a, b] = np.inf, -1
        # Points that arrived after the buffers were built compete too.
        arrived = np.array(self.incoming[a], np.int64)
        arrived = arrived[labels[arrived] == a]
        self.incoming[a] = arrived.tolist()
        if len(arrived):
            cost = s[arrived, a, None].astype(np.float64) - s[arrived]
            cost[:, a] = np.inf
            best = cost.argmin(axis=0)
            value = cost[best, np.arange(self.k)]
            better = value < self.row_min[a]
            self.row_min[a, better] = value[better]
            self.row_arg[a, better] = arrived[best[better]]


def _presolve_threshold(n: int) -> int:
    # A repair step costs about as much as 1/2000 of a presolve (both measured at 100k and
    # 1M x 16): below this many misplaced points, repairing directly is cheaper.
    return 256 + n // 2000


def _misplaced(scores: np.ndarray, price: np.ndarray, caps: np.ndarray) -> int:
    """Points over capacity if every point took its best net cluster at these prices."""
    sizes = np.bincount(_argmax_rows(scores, price), minlength=len(caps))
    return int(np.maximum(sizes - caps, 0).sum())


def _argmax_rows(scores: np.ndarray, price: np.ndarray) -> np.ndarray:
    labels = np.empty(len(scores), np.int64)
    for a in range(0, len(scores), _CHUNK):
        labels[a : a + _CHUNK] = (scores[a : a + _CHUNK] - price).argmax(axis=1)
    return labels


def _slack(scores: np.ndarray, labels: np.ndarray, price: np.ndarray) -> np.ndarray:
    """Per point: best net value minus the net value of its label (>= 0), in row chunks."""
    out = np.empty(len(scores), np.float64)
    for a in range(0, len(scores), _CHUNK):
        net = scores[a : a + _CHUNK] - price
        own = np.take_along_axis(net, labels[a : a + _CHUNK, None], axis=1)[:, 0]
        out[a : a + _CHUNK] = net.max(axis=1) - own
    return out


def _result(
    scores: np.ndarray,
    labels: np.ndarray,
    price: np.ndarray,
    caps: np.ndarray,
    q: int,
    r: int,
    moves: int,
    balanced: bool,
) -> AssignmentResult:
    k = scores.shape[1]
    price = price - price.max()
    value = float(np.take_along_axis(scores, labels[:, None], axis=1).sum(dtype=np.float64))
    # sum_i max_k (s_ik - p_k) = sum_i (s_i,label - p_label) + slack_i
    net_best = value - float(price[labels].sum()) + float(_slack(scores, labels, price).sum())
    if balanced:
        top_r = float(np.sort(price)[k - r :].sum()) if r else 0.0
        dual = net_best + q * float(price.sum()) + top_r
    else:
        dual = net_best + float(caps @ price)
    return AssignmentResult(
        labels=labels,
        sizes=np.bincount(labels, minlength=k).astype(np.int64),
        prices=price,
        value=value,
        gap_bound=max(0.0, dual - value),
        moves=moves,
    )
