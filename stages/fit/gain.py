"""What routing by centroid should buy per decode step, estimated on requests the centroids
were not fit on.

Each request carries the cluster of its nearest centroid, as ELDR routes it (tau = 0, no load):
``estimate_gain`` labels held-out requests by one set of centroids; ``gain_from_labels`` takes
labels made elsewhere (``eldr fit`` labels every request by centroids fit without it,
``stages.fit.cross_fit``). For each decode batch size B, batches of B requests of one cluster
(what an ELDR decode worker runs) are compared with batches of B of the same requests
regardless of cluster (what a load balancer gives), by the expected distinct experts per layer
of one decode step, from the requests' decode profiles (``stages.signature.inclusion``): decode
step time follows that count, a whole decode's union of experts does not (it saturates as
answers grow). Each arm is the exact mean over every possible batch
(``stages.fit.batch_union``), so the estimate carries no batch-sampling noise. A step-time
model turns both counts into step times, hence the TPOT change at that batch size. Load
balancing moves some requests off their nearest centroid, so ``eldr`` and ``eldr-bl`` get
somewhat less than this.

The interval comes from a Poisson bootstrap over the requests, their labels held fixed: with a
few hundred of them, which requests were drawn is the whole uncertainty the interval speaks
for (where the centroids fell is not resampled). Re-computing both arms for every resample
would cost resamples x m x B x L x E, so each resample moves an arm's mean by its requests'
weights times their influence, to first order: B/m times (the mean over the batches that
contain the request minus the arm's mean), the Hoeffding projection of the batch statistic,
scaled by (m-1)/(m-B), which makes it exact for a statistic additive over members (from only
m members, the batches that hold a request share the others; the scaling undoes that
shrinkage). Both arms see the same weights, so the interval of their difference is paired.

The result's ``num_holdout`` and ``holdout_cluster_sizes`` count the requests estimated on:
the held-out split for ``estimate_gain``, every request for a cross-fit (each is held out of
the fit that labelled it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from stages.errors import EldrError
from stages.fit.batch_union import batch_union

# A batch size is estimated from the clusters with at least this many times B labelled
# requests: fewer and a cluster's batches are nearly one set of requests.
MEMBERS_PER_SLOT = 2
# ... and only when those clusters hold at least this share of the requests, so the
# estimate speaks for most of the traffic, not for a few large clusters.
MIN_COVERAGE = 0.5
# A TPOT gain below this is not worth ELDR's tail risk: with no locality, centroid routing
# costs up to 11-15% of p99 TPOT against the best load balancer (issue 10's control).
MIN_TPOT_GAIN = 0.01
# Bootstrap resamples drawn at a time ([block, n] weights).
_RESAMPLE_BLOCK = 256


class StepTimeModel(Protocol):
    """Decode step seconds from batch size and mean distinct experts per MoE layer (the
    simulator's ``CostModel`` is one)."""

    name: str

    def step_time(self, batch: float, distinct: np.ndarray) -> Any: ...


@dataclass(frozen=True)
class GainConfig:
    batch_sizes: tuple[int, ...] = (4, 8, 16, 32)
    min_batches: int = 1000  # distinct batches each arm must average over
    num_resamples: int = 2000
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise EldrError(f"batch sizes must be positive, got {self.batch_sizes}")
        if self.min_batches < 1 or self.num_resamples < 1:
            raise EldrError("min_batches and num_resamples must be positive")
        if not 0.0 < self.confidence < 1.0:
            raise EldrError(f"confidence must be in (0, 1), got {self.confidence}")


@dataclass(frozen=True)
class _Arm:
    """One arm (a cluster, or the random pool) at one batch size."""

    mean: float  # expected distinct experts per layer per step, over every batch
    batches: float  # how many distinct batches that is
    influence: np.ndarray  # [n] per request (zero outside the arm's requests)


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """``"8,16,32"`` -> ``(8, 16, 32)``: positive integers, comma separated, sorted, once each."""
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise EldrError("give at least one decode batch size, e.g. 8,16,32")
    sizes = []
    for part in parts:
        try:
            size = int(part)
        except ValueError as exc:
            raise EldrError(
                f"{part!r} is not a decode batch size: give positive integers, comma separated,"
                " e.g. 8,16,32"
            ) from exc
        if size < 1:
            raise EldrError(f"decode batch sizes must be positive, got {size}")
        sizes.append(size)
    return tuple(sorted(set(sizes)))


def nearest_centroid(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """ELDR's tau = 0 rule, without load: each unit row of ``x`` to its most similar centroid."""
    if not len(x):
        return np.zeros(0, np.int64)
    return np.asarray((x @ centroids.T).argmax(axis=1), dtype=np.int64)


def estimate_gain(
    x: np.ndarray,
    centroids: np.ndarray,
    log_complement: np.ndarray,
    num_layers: int,
    config: GainConfig,
    rng: np.random.Generator,
    cost: StepTimeModel | None = None,
) -> dict[str, Any]:
    """Same-cluster against random decode batches of held-out requests, per batch size.

    ``x``: ``[n, D]`` transformed held-out signatures, routed to their nearest centroid;
    ``log_complement``: ``[n, L*E]`` their decode profiles' ``log(1 - pi)``. As
    ``gain_from_labels``.
    """
    return gain_from_labels(
        nearest_centroid(x, centroids), len(centroids), log_complement, num_layers, config,
        rng, cost,
    )


def gain_from_labels(
    labels: np.ndarray,
    num_clusters: int,
    log_complement: np.ndarray,
    num_layers: int,
    config: GainConfig,
    rng: np.random.Generator,
    cost: StepTimeModel | None = None,
) -> dict[str, Any]:
    """Same-cluster against random decode batches of requests labelled ``labels`` (``[n]``,
    cluster ids below ``num_clusters``, each from centroids not fit on that request), per
    batch size.

    ``log_complement``: ``[n, L*E]`` the requests' decode profiles' ``log(1 - pi)``. Returns a
    JSON-ready dict: one entry per batch size (estimates and intervals, or why it was skipped)
    and an overall ``verdict``. The interval holds the labels fixed: it is the uncertainty of
    which requests were drawn, not of where the centroids fell.
    """
    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    if len(log_complement) != n:
        raise ValueError(f"{n} labels but {len(log_complement)} decode profiles")
    if n and not 0 <= labels.min() <= labels.max() < num_clusters:
        raise ValueError(f"labels must be cluster ids in [0, {num_clusters})")
    sizes = np.bincount(labels, minlength=num_clusters)
    batch_sizes = sorted(set(config.batch_sizes))
    eligible = {b: np.flatnonzero(sizes >= MEMBERS_PER_SLOT * b) for b in batch_sizes}
    estimable = [b for b in batch_sizes if sizes[eligible[b]].sum() >= max(1, MIN_COVERAGE * n)]
    clusters = _cluster_arms(labels, eligible, estimable, log_complement, num_layers)
    pools = _pool_arms(labels, eligible, estimable, log_complement, num_layers)
    alpha = (1.0 - config.confidence) / 2
    rows = []
    for batch in batch_sizes:
        covered = int(sizes[eligible[batch]].sum())
        skip = None
        if batch not in estimable:
            skip = (
                f"clusters with at least {MEMBERS_PER_SLOT * batch} requests hold"
                f" {covered} of {n} (need at least {MIN_COVERAGE:.0%})"
            )
        elif min(pools[batch].batches, sum(a.batches for a in clusters[batch])) < (
            config.min_batches
        ):
            skip = f"fewer than {config.min_batches} distinct batches of {batch}"
        if skip is not None:
            rows.append({"batch_size": batch, "skipped": skip})
            continue
        rows.append(_compare(
            batch, labels, eligible[batch], clusters[batch], pools[batch], config, rng, alpha,
            cost,
        ))
    return {
        "num_holdout": n,
        "holdout_cluster_sizes": sizes.tolist(),
        "confidence": config.confidence,
        "num_resamples": config.num_resamples,
        "cost_model": cost.name if cost is not None else None,
        "batches": rows,
        "verdict": overall_verdict(rows),
    }


def _cluster_arms(
    labels: np.ndarray,
    eligible: dict[int, np.ndarray],
    estimable: list[int],
    log_complement: np.ndarray,
    num_layers: int,
) -> dict[int, list[_Arm]]:
    """Each cluster's arms at the batch sizes it takes part in (one pass per cluster)."""
    arms: dict[int, list[_Arm]] = {b: [] for b in estimable}
    for c in sorted({int(c) for b in estimable for c in eligible[b]}):
        sizes = tuple(b for b in estimable if c in eligible[b])
        members = np.flatnonzero(labels == c)
        for b, arm in _arms(members, sizes, log_complement, num_layers).items():
            arms[b].append(arm)
    return arms


def _pool_arms(
    labels: np.ndarray,
    eligible: dict[int, np.ndarray],
    estimable: list[int],
    log_complement: np.ndarray,
    num_layers: int,
) -> dict[int, _Arm]:
    """The random arm at each batch size: all requests of the eligible clusters (batch sizes
    with the same eligible clusters share one pass)."""
    by_pool: dict[tuple[int, ...], list[int]] = {}
    for b in estimable:
        by_pool.setdefault(tuple(eligible[b].tolist()), []).append(b)
    arms: dict[int, _Arm] = {}
    for clusters, sizes in by_pool.items():
        members = np.flatnonzero(np.isin(labels, clusters))
        arms |= _arms(members, tuple(sizes), log_complement, num_layers)
    return arms


def _arms(
    members: np.ndarray, sizes: tuple[int, ...], log_complement: np.ndarray, num_layers: int
) -> dict[int, _Arm]:
    m = len(members)
    out = {}
    for b, union in batch_union(log_complement[members], sizes, num_layers).items():
        influence = np.zeros(len(log_complement))
        influence[members] = (b / m) * (m - 1) / (m - b) * (union.projection - union.mean)
        out[b] = _Arm(mean=union.mean, batches=union.num_batches, influence=influence)
    return out


def _compare(
    batch: int,
    labels: np.ndarray,
    eligible: np.ndarray,
    clusters: list[_Arm],
    random: _Arm,
    config: GainConfig,
    rng: np.random.Generator,
    alpha: float,
    cost: StepTimeModel | None,
) -> dict[str, Any]:
    """Same-cluster (clusters weighted by their labelled traffic, the share of steps their
    decode workers run) against random, with resampled intervals."""
    members = [labels == c for c in eligible]
    share = np.array([m.sum() for m in members], dtype=np.float64)
    same_mean = float(share @ [a.mean for a in clusters] / share.sum())
    # Resampled estimates: the cluster shares follow the resampled cluster sizes; both arms
    # see the same request weights.
    resamples = config.num_resamples
    same_star = np.empty(resamples)
    random_star = np.empty(resamples)
    for a in range(0, resamples, _RESAMPLE_BLOCK):
        size = min(_RESAMPLE_BLOCK, resamples - a)
        w = rng.poisson(1.0, size=(size, len(labels))).astype(np.float64)
        mass = np.stack([w[:, m].sum(axis=1) for m in members], axis=1)  # [r, C]
        means = np.stack([arm.mean + (w - 1.0) @ arm.influence for arm in clusters], axis=1)
        same_star[a : a + size] = (mass * means).sum(axis=1) / mass.sum(axis=1)
        random_star[a : a + size] = random.mean + (w - 1.0) @ random.influence
    row: dict[str, Any] = {
        "batch_size": batch,
        "clusters": len(eligible),
        "requests": int(share.sum()),
        "same_cluster_batches": sum(arm.batches for arm in clusters),
        "random_batches": random.batches,
        "same_cluster_distinct_experts_per_layer": same_mean,
        "random_distinct_experts_per_layer": random.mean,
        "change": same_mean / random.mean - 1.0,
        "change_ci": _interval(same_star / random_star - 1.0, alpha),
    }
    tpot = None
    if cost is not None:
        point = _step_ratio(cost, batch, np.array([same_mean]), np.array([random.mean]))
        tpot = float(point[0]) - 1.0
        tpot_star = _step_ratio(cost, batch, same_star, random_star) - 1.0
        row |= {"tpot_change": tpot, "tpot_change_ci": _interval(tpot_star, alpha)}
    row["verdict"] = batch_verdict(row["change_ci"], tpot)
    return row


def _step_ratio(
    cost: StepTimeModel, batch: int, same: np.ndarray, random: np.ndarray
) -> np.ndarray:
    return np.asarray(cost.step_time(batch, same)) / np.asarray(cost.step_time(batch, random))


def _interval(values: np.ndarray, alpha: float) -> list[float]:
    lo, hi = np.quantile(values, [alpha, 1.0 - alpha])
    return [float(lo), float(hi)]


def batch_verdict(change_ci: list[float], tpot_change: float | None) -> str:
    """``gain`` / ``negligible`` (real but under MIN_TPOT_GAIN) / ``none`` (interval holds
    zero) / ``worse`` (more experts)."""
    lo, hi = change_ci
    if lo <= 0.0 <= hi:
        return "none"
    if lo > 0.0:
        return "worse"
    if tpot_change is not None and tpot_change > -MIN_TPOT_GAIN:
        return "negligible"
    return "gain"


def overall_verdict(rows: list[dict[str, Any]]) -> str:
    """One word for the fit: ``unknown`` when no batch size could be estimated."""
    verdicts = {row["verdict"] for row in rows if "verdict" in row}
    if not verdicts:
        return "unknown"
    if "worse" in verdicts:
        return "mixed" if "gain" in verdicts else "worse"
    for word in ("gain", "negligible"):
        if word in verdicts:
            return word
    return "none"
