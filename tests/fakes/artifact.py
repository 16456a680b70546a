"""A stand-in artifact for tests and benches: the real transform and model identity, with
hand-made centroids, shaped like the fit stage's ``Artifact`` as far as the proxy reads it.

Not the fit stage's ``Artifact`` itself: the proxy must run (and be tested) without the fit
stage, and that type also carries a dataset hash, params and metrics that nothing here has.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stages.signature.dataset import ModelIdentity
from stages.signature.token_predictor import TokenPredictor
from stages.signature.transform import SignatureTransform
from tests.fakes.worker import SIGNATURE_SHAPE, domain_prompt, domain_signature

# The model whose signatures the fake worker sends by default.
FAKE_MODEL = ModelIdentity("fake-moe", *SIGNATURE_SHAPE, top_k=2)


@dataclass(frozen=True)
class FakeArtifact:
    version: str
    centroids: np.ndarray
    transform: SignatureTransform
    identity: ModelIdentity
    token_predictor: TokenPredictor | None = None


def plain_transform(num_layers: int, num_experts: int) -> SignatureTransform:
    """IDF of one everywhere and every layer kept: cosine on raw counts."""
    return SignatureTransform(
        np.ones((num_layers, num_experts), np.float32), np.ones(num_layers, dtype=bool)
    )


def domain_artifact(
    k: int, identity: ModelIdentity = FAKE_MODEL, version: str = "v1"
) -> FakeArtifact:
    """Centroid ``j`` = the transformed signature the fake worker sends for domain ``j``."""
    transform = plain_transform(identity.num_layers, identity.num_experts)
    counts = np.stack([domain_signature(domain_prompt(j), identity.shape) for j in range(k)])
    return FakeArtifact(version, transform.apply(counts), transform, identity)
