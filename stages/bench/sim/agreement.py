"""Prefill-to-decode agreement, as the locality dial reads it: `eldr fit`'s held-out gain.

The measure is the fit's expected per-step gain (``stages.fit.gain``) at one decode batch size
B, as a reduction: held-out requests go to their nearest centroid, and a batch of B requests of
one cluster activates ``reduction`` fewer distinct experts per layer in a decode step than a
random batch of B of the same requests (``1 - same / random``; each arm the exact mean over
every batch, so the point has no sampling noise; the interval is the fit's bootstrap). It is
0 when the prefill signature says nothing about decode and grows with what it says. It reads
the decode profiles exactly as the simulator does, and it moves with the dial as TPOT does
(steepest near s = 0); a rank measure of prefill-to-decode similarity stays flat there.

Held-out rows: those the artifact's fit held out when it was fit on this very dataset (its
``dataset_hash``), else every row (the fit never saw them). `eldr fit`'s own dial
(``fit_dial``) labels every row out of fold instead, as the fit's cross-fitted gain does
(``labelled_agreement``): a held-out fifth is too few requests per cluster at k = 16-20.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from stages.bench.sim.sim_workload import RoutingArtifact
from stages.fit.gain import GainConfig, gain_from_labels, nearest_centroid
from stages.fit.pipeline import split_requests
from stages.signature.dataset import SignatureArrays
from stages.signature.inclusion import inclusion_log_complement


@dataclass(frozen=True)
class Agreement:
    reduction: float  # 1 - same-cluster / random distinct experts per layer per step
    interval: tuple[float, float]  # of the reduction, the fit's confidence level


def held_out_rows(
    params: dict[str, Any], artifact_dataset: str, dataset: str, num_rows: int
) -> np.ndarray:
    """The rows an artifact (its ``params`` and ``dataset_hash``) did not see of a dataset
    (its ``content_hash``) of ``num_rows`` rows."""
    if artifact_dataset == dataset and params.get("num_requests") == num_rows:
        _, held = split_requests(num_rows, float(params["holdout_fraction"]), int(params["seed"]))
        return held
    return np.arange(num_rows)


def first_estimated(gain: dict[str, Any]) -> tuple[int, float] | None:
    """(batch size, reduction) of the smallest batch size a stored fit gain estimated."""
    rows = [r for r in gain.get("batches", []) if "change" in r]
    if not rows:
        return None
    row = min(rows, key=lambda r: int(r["batch_size"]))
    return int(row["batch_size"]), -float(row["change"])


def held_out_agreement(
    arrays: SignatureArrays,
    rows: np.ndarray,
    artifact: RoutingArtifact,
    top_k: int,
    batch: int,
    seed: int,
) -> Agreement | None:
    """The fit's gain at ``batch`` on ``rows`` of ``arrays``, each routed to the artifact's
    nearest centroid; None where the fit would not estimate it (too few held-out requests per
    cluster)."""
    labels = nearest_centroid(
        np.asarray(artifact.transform.apply(arrays.prefill_counts[rows])),
        np.asarray(artifact.centroids),
    )
    return labelled_agreement(arrays, rows, labels, len(artifact.centroids), top_k, batch, seed)


def labelled_agreement(
    arrays: SignatureArrays,
    rows: np.ndarray,
    labels: np.ndarray,
    num_clusters: int,
    top_k: int,
    batch: int,
    seed: int,
) -> Agreement | None:
    """The fit's gain at ``batch`` on ``rows`` of ``arrays`` labelled ``labels`` (each by
    centroids not fit on it: the artifact's for held-out rows, a cross-fit's for every row);
    None where the fit would not estimate it (too few requests per cluster)."""
    prefill, decode = arrays.prefill_counts[rows], arrays.decode_counts[rows]
    profiles = np.stack([
        inclusion_log_complement(d, top_k, fallback=p) for d, p in zip(decode, prefill, strict=True)
    ])
    gain = gain_from_labels(
        labels,
        num_clusters,
        profiles,
        arrays.decode_counts.shape[1],
        GainConfig(batch_sizes=(batch,)),
        np.random.default_rng([seed, 5]),
    )
    [row] = gain["batches"]
    if "change" not in row:
        return None
    lo, hi = row["change_ci"]
    return Agreement(-float(row["change"]), (-float(hi), -float(lo)))
