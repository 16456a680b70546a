"""The simulated request stream: what every policy faces, identical across policies.

Arrivals are Poisson over the run; each request is a dataset row drawn with replacement (its
prompt length, prefill signature and decode profile); prefill is policy independent (P
workers, FIFO, one request at a time), so prefill completion times are computed once here.
How much a row's prefill says about its decode is the dataset's business: the simulator blends
it first for the locality dial (``locality_blend``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from stages.bench.arrivals import poisson_arrivals_until
from stages.errors import EldrError
from stages.routing.cost_model import CostModel
from stages.signature.dataset import SignatureArrays

PREFILL_ROUTING = ("round_robin", "least_loaded")
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
    prefill_end_s: np.ndarray  # float64 [N]: prefill done, first token out
    feature_rows: np.ndarray  # int64 [N] -> row of ``features``
    features: np.ndarray | None  # float32 [U, D] unit vectors, None without an artifact

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


def prefill_schedule(
    arrival_s: np.ndarray, prompt_tokens: np.ndarray, cost: CostModel, workers: int, routing: str
) -> np.ndarray:
    """Prefill completion time of each request (FIFO per prefill worker)."""
    if routing not in PREFILL_ROUTING:
        raise EldrError(f"prefill routing must be one of {PREFILL_ROUTING}, got {routing!r}")
    service = cost.prefill_time(prompt_tokens)
    free_at = [0.0] * workers
    end = np.empty_like(arrival_s)
    for i, (t, s) in enumerate(zip(arrival_s.tolist(), service.tolist(), strict=True)):
        if routing == "round_robin":
            w = i % workers
        else:
            # Least loaded = the worker that frees up first (its queue drains soonest).
            w = min(range(workers), key=free_at.__getitem__)
        done = max(t, free_at[w]) + s
        free_at[w] = done
        end[i] = done
    return end


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
    cost: CostModel,
    *,
    request_rate: float,
    duration_s: float,
    num_prefill: int,
    prefill_routing: str,
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
    prompt = np.maximum(arrays.prompt_tokens[rows].astype(np.int64), 1)
    features, feature_rows = (None, np.zeros(rows.size, dtype=np.int64))
    if artifact is not None:
        features, feature_rows = route_features(arrays, rows, artifact)
    return Workload(
        arrival_s=arrival,
        rows=rows,
        prompt_tokens=prompt,
        output_tokens=output_lengths(arrays, rows, output_tokens, max_output_tokens),
        prefill_end_s=prefill_schedule(arrival, prompt, cost, num_prefill, prefill_routing),
        feature_rows=feature_rows,
        features=features,
    )
