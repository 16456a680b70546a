"""What routing by centroid should buy per decode step, estimated on held-out requests.

Held-out requests go to their nearest centroid, as ELDR routes them. For each decode batch
size B, batches of B requests of one cluster (what an ELDR decode worker runs) are compared
with batches of B requests drawn from the same requests regardless of cluster (what a load
balancer gives), by the expected distinct experts per layer of one decode step, from the
requests' decode profiles (``stages.signature.inclusion``): decode step time follows that
count, a whole decode's union of experts does not (it saturates as answers grow). A step-time
model turns both counts into step times, hence the TPOT change at that batch size.

The interval comes from a Poisson bootstrap over held-out requests. The batches are drawn from
a few hundred requests, so which requests were held out matters far more than which batches
were drawn; a bootstrap over batches would give a narrow interval around noise. Re-drawing the
batches for every resample would cost resamples x batches x B x L x E, so each resample
reweights the batches already drawn instead, to first order: a request's resampling weight
moves the estimate by its influence, the mean over the batches that contain it minus the
overall mean (the Hoeffding projection of the batch statistic), scaled by (m-1)/(m-B), which
makes it exact for a statistic additive over members (drawn from only m members, a batch of B
shares the others; the scaling undoes that shrinkage). Both arms use the same weights, so the
interval of their difference is paired.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import scipy.sparse as sp

# A batch size is estimated from the clusters with at least this many times B held-out
# requests: fewer and a cluster's batches are nearly one set of requests.
MEMBERS_PER_SLOT = 2
# ... and only when those clusters hold at least this share of the held-out requests, so the
# estimate speaks for most of the traffic, not for a few large clusters.
MIN_COVERAGE = 0.5
# A TPOT gain below this is not worth ELDR's tail risk: with no locality, centroid routing
# costs up to 11-15% of p99 TPOT against the best load balancer (issue 10's control).
MIN_TPOT_GAIN = 0.01
# Batch values are computed this many batches at a time ([block, L*E] float64 temporaries).
_BATCH_BLOCK = 256
# Random keys drawn at a time when picking batch members ([block, m] float64).
_KEYS_PER_BLOCK = 1 << 20
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
    num_batches: int = 1000  # per batch size and per arm (same-cluster, random)
    num_resamples: int = 2000
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be positive, got {self.batch_sizes}")
        if self.num_batches < 1 or self.num_resamples < 1:
            raise ValueError("num_batches and num_resamples must be positive")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence}")


@dataclass(frozen=True)
class _Arm:
    """One arm at one batch size: its estimate and each request's influence on it."""

    mean: float  # expected distinct experts per layer per step
    batches: int
    influence: np.ndarray  # [n] per held-out request (zero outside the arm's requests)


def step_experts_per_layer(
    log_complement: np.ndarray, batches: np.ndarray, num_layers: int
) -> np.ndarray:
    """Expected distinct experts per layer in one decode step of each batch.

    ``log_complement``: ``[m, L*E]`` per-request ``log(1 - pi)``; ``batches``: ``[count, B]``
    row indices. Expert (l, e) is active in a step with probability ``1 - prod_r (1 - pi_r)``.
    """
    count, batch = batches.shape
    pick = sp.csr_matrix(
        (np.ones(batches.size), batches.ravel(), np.arange(0, batches.size + 1, batch)),
        shape=(count, len(log_complement)),
    )
    return -np.expm1(pick @ log_complement).sum(axis=1) / num_layers


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

    ``x``: ``[n, D]`` transformed held-out signatures; ``log_complement``: ``[n, L*E]`` their
    decode profiles' ``log(1 - pi)``. Returns a JSON-ready dict: one entry per batch size
    (estimates and intervals, or why it was skipped) and an overall ``verdict``.
    """
    n = len(x)
    labels = (x @ centroids.T).argmax(axis=1) if n else np.zeros(0, np.int64)
    sizes = np.bincount(labels, minlength=len(centroids))
    weights = _poisson_weights(rng, config.num_resamples, n)
    alpha = (1.0 - config.confidence) / 2
    rows = []
    for batch in sorted(set(config.batch_sizes)):
        eligible = np.flatnonzero(sizes >= MEMBERS_PER_SLOT * batch)
        covered = int(sizes[eligible].sum())
        if covered < MIN_COVERAGE * n or covered == 0:
            rows.append({
                "batch_size": batch,
                "skipped": (
                    f"clusters with at least {MEMBERS_PER_SLOT * batch} held-out requests hold"
                    f" {covered} of {n}"
                ),
            })
            continue
        rows.append(_estimate_at(
            batch, labels, eligible, sizes, log_complement, num_layers, config, rng, weights,
            alpha, cost,
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


def _estimate_at(
    batch: int,
    labels: np.ndarray,
    eligible: np.ndarray,
    sizes: np.ndarray,
    log_complement: np.ndarray,
    num_layers: int,
    config: GainConfig,
    rng: np.random.Generator,
    weights: np.ndarray,
    alpha: float,
    cost: StepTimeModel | None,
) -> dict[str, Any]:
    pool = np.flatnonzero(np.isin(labels, eligible))
    share = sizes[eligible] / sizes[eligible].sum()
    # Stratified: each cluster gets batches in proportion to its held-out traffic (at least
    # one), the same share its decode worker's steps have.
    clusters = [
        _arm(np.flatnonzero(labels == c), batch, max(1, round(config.num_batches * s)),
             log_complement, num_layers, rng)
        for c, s in zip(eligible, share, strict=True)
    ]
    random = _arm(pool, batch, config.num_batches, log_complement, num_layers, rng)
    same_mean = float(share @ [a.mean for a in clusters])

    # Resampled estimates: the same arm's cluster shares follow the resampled cluster sizes.
    same_star = np.empty(len(weights))
    random_star = np.empty(len(weights))
    for a in range(0, len(weights), _RESAMPLE_BLOCK):
        w = weights[a : a + _RESAMPLE_BLOCK]
        mass = np.stack([w[:, labels == c].sum(axis=1) for c in eligible], axis=1)  # [r, C]
        means = np.stack([arm.mean + (w - 1.0) @ arm.influence for arm in clusters], axis=1)
        same_star[a : a + len(w)] = (mass * means).sum(axis=1) / mass.sum(axis=1)
        random_star[a : a + len(w)] = random.mean + (w - 1.0) @ random.influence
    change_star = same_star / random_star - 1.0
    change = same_mean / random.mean - 1.0
    row: dict[str, Any] = {
        "batch_size": batch,
        "clusters": len(eligible),
        "requests": len(pool),
        "same_cluster_batches": sum(arm.batches for arm in clusters),
        "random_batches": random.batches,
        "same_cluster_distinct_experts_per_layer": same_mean,
        "random_distinct_experts_per_layer": random.mean,
        "change": change,
        "change_ci": _interval(change_star, alpha),
    }
    tpot = None
    if cost is not None:
        tpot_star = _step_ratio(cost, batch, same_star, random_star) - 1.0
        tpot = float(_step_ratio(cost, batch, np.array([same_mean]), np.array([random.mean]))[0])
        tpot -= 1.0
        row |= {"tpot_change": tpot, "tpot_change_ci": _interval(tpot_star, alpha)}
    row["verdict"] = batch_verdict(row["change_ci"], tpot)
    return row


def _arm(
    members: np.ndarray,
    batch: int,
    count: int,
    log_complement: np.ndarray,
    num_layers: int,
    rng: np.random.Generator,
) -> _Arm:
    """``count`` batches of ``batch`` distinct requests drawn uniformly from ``members``."""
    m = len(members)
    rows = log_complement[members]
    values = np.empty(count)
    sums = np.zeros(m)
    hits = np.zeros(m)
    block = max(1, min(_BATCH_BLOCK, _KEYS_PER_BLOCK // m))
    for a in range(0, count, block):
        size = min(block, count - a)
        # Distinct members per batch: the smallest of per-batch random keys.
        drawn = np.argpartition(rng.random((size, m)), batch - 1, axis=1)[:, :batch]
        values[a : a + size] = step_experts_per_layer(rows, drawn, num_layers)
        part = drawn.ravel()
        sums += np.bincount(part, weights=np.repeat(values[a : a + size], batch), minlength=m)
        hits += np.bincount(part, minlength=m)
    mean = float(values.mean())
    # Centred on the arm's own mean, so the influences sum to zero (no drift from which
    # requests happened to be drawn more often).
    local_influence = (sums - hits * mean) / count * ((m - 1) / (m - batch))
    influence = np.zeros(len(log_complement))
    influence[members] = local_influence
    return _Arm(mean=mean, batches=count, influence=influence)


def _poisson_weights(rng: np.random.Generator, resamples: int, n: int) -> np.ndarray:
    return rng.poisson(1.0, size=(resamples, n)).astype(np.float64)


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
