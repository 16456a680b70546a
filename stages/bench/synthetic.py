"""Synthetic clustered signatures and a stand-in artifact, for the simulator's examples and
tests when no captured dataset or fitted artifact is at hand.

Data: each domain prefers a random subset of experts in every layer; a request mixes its
domain's preference with its own noise, and its prefill and decode counts are drawn from that
same per-request distribution (prefill predicts decode, as the paper measured). The artifact:
the paper's transform without layer selection (counts x IDF, flattened, L2-normalised) and
balanced spherical k-means (balanced by an exact assignment onto ``ceil(N/K)`` slots per
cluster, as the ELDR artifact does). The real ones come from ``eldr capture`` and ``eldr fit``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from stages.signature.dataset import SignatureArrays


@dataclass(frozen=True)
class SyntheticSpec:
    num_requests: int = 2000
    num_layers: int = 48
    num_experts: int = 128
    top_k: int = 8
    num_domains: int = 8
    domain_experts: int = 48  # experts a domain favours per layer
    domain_weight: float = 0.7  # share of a request's picks that follow its domain
    prompt_median: int = 300  # tokens (log-normal lengths)
    min_output: int = 128
    max_output: int = 512
    seed: int = 0


def _unit_rows(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(norm > 0, norm, 1.0)


def synthetic_signatures(spec: SyntheticSpec) -> SignatureArrays:
    rng = np.random.default_rng(spec.seed)
    n, num_layers, num_experts = spec.num_requests, spec.num_layers, spec.num_experts
    # Domain preference: uniform weight on a random subset of experts per layer.
    pref = np.zeros((spec.num_domains, num_layers, num_experts))
    for d in range(spec.num_domains):
        for layer in range(num_layers):
            pref[d, layer, rng.choice(num_experts, spec.domain_experts, replace=False)] = 1.0
    pref /= pref.sum(axis=-1, keepdims=True)
    domain = rng.integers(0, spec.num_domains, size=n)
    own = rng.dirichlet(np.full(num_experts, 0.3), size=(n, num_layers))
    probs = spec.domain_weight * pref[domain] + (1 - spec.domain_weight) * own
    lengths = rng.lognormal(np.log(spec.prompt_median), 0.6, size=n)
    prompt_tokens = np.clip(lengths, 8, 2048).astype(np.int64)
    output_tokens = rng.integers(spec.min_output, spec.max_output + 1, size=n)

    def counts(tokens: np.ndarray) -> np.ndarray:
        draws = rng.multinomial((tokens * spec.top_k)[:, None], probs)
        # A token picks an expert at most once.
        return np.minimum(draws, tokens[:, None, None]).astype(np.int32)

    return SignatureArrays(
        ids=np.array([f"syn-{i}" for i in range(n)], dtype=object),
        domains=np.array([f"domain-{d}" for d in domain], dtype=object),
        prompt_sha256=np.array([""] * n, dtype=object),
        prompt_tokens=prompt_tokens.astype(np.int32),
        output_tokens=output_tokens.astype(np.int32),
        prefill_counts=counts(prompt_tokens),
        decode_counts=counts(output_tokens),
    )


@dataclass(frozen=True)
class IdfFlatTransform:
    idf: np.ndarray  # float32 [L, E]

    def apply(self, counts: np.ndarray) -> np.ndarray:
        """``[..., L, E]`` counts -> ``[..., L*E]`` unit vectors."""
        x = np.asarray(counts, dtype=np.float32) * self.idf
        return _unit_rows(x.reshape(*x.shape[:-2], -1)).astype(np.float32)


@dataclass(frozen=True)
class StandInArtifact:
    centroids: np.ndarray  # float32 [K, D]
    transform: IdfFlatTransform


def _balanced_labels(sim: np.ndarray, k: int) -> np.ndarray:
    cap = -(-sim.shape[0] // k)
    rows, slots = linear_sum_assignment(np.repeat(sim, cap, axis=1), maximize=True)
    labels = np.empty(sim.shape[0], dtype=np.int64)
    labels[rows] = slots // cap
    return labels


def stand_in_artifact(
    arrays: SignatureArrays, k: int, seed: int = 0, calibration: int = 1000, iters: int = 20
) -> StandInArtifact:
    rng = np.random.default_rng(seed)
    counts = arrays.prefill_counts
    df = (counts > 0).sum(axis=0)
    transform = IdfFlatTransform(np.log((len(arrays) + 1) / (df + 1)).astype(np.float32))
    pick = rng.choice(len(arrays), size=min(calibration, len(arrays)), replace=False)
    x = transform.apply(counts[pick])
    # k-means++ on the sphere (distance = 1 - cosine).
    centers = [x[rng.integers(len(x))]]
    for _ in range(1, k):
        dist = np.clip(1.0 - np.max(x @ np.stack(centers).T, axis=1), 0.0, None)
        p = dist / dist.sum() if dist.sum() > 0 else None
        centers.append(x[rng.choice(len(x), p=p)])
    c = np.stack(centers)
    for _ in range(iters):
        labels = _balanced_labels(x @ c.T, k)
        new = _unit_rows(np.stack([x[labels == j].sum(axis=0) for j in range(k)]))
        if np.allclose(new, c):
            break
        c = new
    return StandInArtifact(c.astype(np.float32), transform)
