"""The simulated request stream: what every policy faces, identical across policies.

Arrivals are Poisson over the run; each request is a dataset row drawn with replacement (its
prompt length, prefill signature and decode profile). A replay of a live run
(``stages.bench.replay.saved_run``) gives its own arrivals, rows and lengths instead. When a
request is sent, and so when its prefill runs, is the simulator's business: under a concurrency
cap it depends on how fast the policy's decode frees slots. How much a row's prefill says about
its decode is the dataset's business too: the simulator blends it first for the locality dial
(``locality_blend``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from stages.bench.live.arrivals import poisson_arrivals_until
from stages.errors import EldrError
from stages.signature.dataset import SignatureArrays

_FEATURE_CHUNK = 1024  # rows per transform call: bounds the float copy of [rows, L, E]


class FeatureTransform(Protocol):
    def apply(self, counts: np.ndarray) -> np.ndarray: ...


class RoutingArtifact(Protocol):
    """What the simulator needs of a fitted artifact (``stages.fit.artifact.Artifact``)."""

    @property
    def centroids(self) -> np.ndarray: ...

    @property
    def transform(self) -> FeatureTransform: ...


@dataclass(frozen=True)
class Workload:
    arrival_s: np.ndarray  # float64 [N], sorted
    rows: np.ndarray  # int64 [N], dataset row of each request
    prompt_tokens: np.ndarray  # int64 [N]
    output_tokens: np.ndarray  # int64 [N], >= 2
    feature_rows: np.ndarray  # int64 [N] -> row of ``features``
    features: np.ndarray | None  # float32 [U, D] unit vectors, None without an artifact
    # The seed its policy is built with (a live round's); None: the simulation's.
    policy_seed: int | None = None

    def __len__(self) -> int:
        return int(self.arrival_s.size)


def output_lengths(
    arrays: SignatureArrays, rows: np.ndarray, fixed: int | None, max_tokens: int
) -> np.ndarray:
    """Fixed (as ``ignore_eos`` + ``max_tokens``) or the dataset's, capped at ``max_tokens``;
    at least 2 so every request decodes at least one step after its first token."""
    if fixed is not None:
        return np.full(rows.size, max(fixed, 2), dtype=np.int64)
    return np.clip(arrays.output_tokens[rows].astype(np.int64), 2, max_tokens)


def route_features(
    arrays: SignatureArrays, rows: np.ndarray, artifact: RoutingArtifact
) -> tuple[np.ndarray, np.ndarray]:
    """Transform the prefill signature of every distinct sampled row, once."""
    unique, inverse = np.unique(rows, return_inverse=True)
    parts = [
        np.asarray(artifact.transform.apply(arrays.prefill_counts[unique[i : i + _FEATURE_CHUNK]]))
        for i in range(0, unique.size, _FEATURE_CHUNK)
    ]
    return np.concatenate(parts).astype(np.float32), inverse.astype(np.int64)


def build_workload(
    arrays: SignatureArrays,
    *,
    request_rate: float,
    duration_s: float,
    output_tokens: int | None,
    max_output_tokens: int,
    seed: int,
    artifact: RoutingArtifact | None,
) -> Workload:
    if len(arrays) == 0:
        raise EldrError("the signature dataset is empty")
    arrival = poisson_arrivals_until(request_rate, duration_s, seed)
    rng = np.random.default_rng([seed, 1])  # a stream apart from the arrivals'
    rows = rng.integers(0, len(arrays), size=arrival.size)
    return workload_of(
        arrays,
        arrival,
        rows,
        arrays.prompt_tokens[rows],
        output_lengths(arrays, rows, output_tokens, max_output_tokens),
        artifact,
    )


def workload_of(
    arrays: SignatureArrays,
    arrival_s: np.ndarray,
    rows: np.ndarray,
    prompt_tokens: np.ndarray,
    output_tokens: np.ndarray,
    artifact: RoutingArtifact | None,
) -> Workload:
    """The workload of these requests (sorted by arrival), their routing features computed."""
    arrival_s = np.asarray(arrival_s, dtype=np.float64)
    if np.any(np.diff(arrival_s) < 0):
        raise EldrError("request arrivals must be sorted")
    rows = np.asarray(rows, dtype=np.int64)
    features, feature_rows = (None, np.zeros(rows.size, dtype=np.int64))
    if artifact is not None:
        features, feature_rows = route_features(arrays, rows, artifact)
    return Workload(
        arrival_s=arrival_s,
        rows=rows,
        prompt_tokens=np.maximum(np.asarray(prompt_tokens, dtype=np.int64), 1),
        output_tokens=np.maximum(np.asarray(output_tokens, dtype=np.int64), 2),
        feature_rows=feature_rows,
        features=features,
    )
