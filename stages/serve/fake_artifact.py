"""A stand-in artifact (the real transform, hand-made centroids) for tests and benches,
shaped like the fit stage's ``Artifact`` as far as the proxy reads it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stages.signature.transform import SignatureTransform


@dataclass(frozen=True)
class FakeIdentity:
    name: str = "fake-moe"
    num_layers: int = 4
    num_experts: int = 16
    top_k: int = 2


@dataclass(frozen=True)
class FakeArtifact:
    version: str
    centroids: np.ndarray
    transform: SignatureTransform
    identity: FakeIdentity


def plain_transform(num_layers: int, num_experts: int) -> SignatureTransform:
    """IDF of one everywhere and every layer kept: cosine on raw counts."""
    return SignatureTransform(
        np.ones((num_layers, num_experts), np.float32), np.ones(num_layers, dtype=bool)
    )


def domain_artifact(
    k: int, identity: FakeIdentity | None = None, version: str = "v1"
) -> FakeArtifact:
    """Centroid ``j`` = the transformed signature of ``fake_worker.domain_signature`` domain j."""
    ident = identity or FakeIdentity()
    transform = plain_transform(ident.num_layers, ident.num_experts)
    rows = []
    for j in range(k):
        counts = np.ones((ident.num_layers, ident.num_experts), np.int32)
        counts[:, j % ident.num_experts] += 50
        rows.append(transform.apply(counts))
    return FakeArtifact(version, np.stack(rows), transform, ident)
