"""Synthetic clustered signatures and a stand-in artifact, for the simulator's examples and
tests when no captured dataset or fitted artifact is at hand.

Data: each domain prefers a random subset of experts in every layer; a request mixes its
domain's preference with its own noise, and its prefill and decode counts are drawn from that
same per-request distribution (prefill predicts decode, as the paper measured). The artifact:
what ``eldr fit`` computes (the fitted signature transform, then balanced spherical k-means),
by the fit stage's own functions on a calibration sample, but not saved to a store. The real
inputs come from ``eldr capture``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stages.fit.kmeans import balanced_spherical_kmeans
from stages.signature.dataset import SignatureArrays
from stages.signature.transform import SignatureTransform, fit_transform


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
class StandInArtifact:
    """What the simulator reads of an ``eldr fit`` artifact, without the store around it."""

    centroids: np.ndarray  # float32 [K, D]
    transform: SignatureTransform


def stand_in_artifact(
    arrays: SignatureArrays,
    k: int,
    seed: int = 0,
    calibration: int = 1000,
    iters: int = 20,
    num_pairs: int = 5000,
) -> StandInArtifact:
    """The fit stage's transform and balanced k-means on a seeded calibration sample.

    ``num_pairs`` is below ``eldr fit``'s default: the layer search is most of the cost (about
    1.5 s instead of 10 s at 48 x 128), and on synthetic data it picks nearly the same mask.
    """
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.choice(len(arrays), size=min(calibration, len(arrays)), replace=False))
    prefill = arrays.prefill_counts[pick]
    transform, _ = fit_transform(
        prefill, arrays.decode_counts[pick], seed=seed, num_pairs=num_pairs
    )
    km = balanced_spherical_kmeans(transform.apply(prefill), k, seed, max_iter=iters)
    return StandInArtifact(km.centroids, transform)
