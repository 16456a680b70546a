"""What the proxy needs from a fitted artifact, and how it loads one.

The fit stage owns the artifact format; the proxy codes against this narrow shape so it runs
(and is tested) without importing the fit stage until an artifact is actually loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from stages.signature.token_predictor import TokenPredictor


class TransformLike(Protocol):
    def apply(self, counts: np.ndarray) -> np.ndarray:
        """``[L, E]`` counts -> float32 ``[D]`` unit vector."""
        ...


class IdentityLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...


class ArtifactLike(Protocol):
    @property
    def version(self) -> str: ...
    @property
    def centroids(self) -> np.ndarray: ...
    @property
    def transform(self) -> TransformLike: ...
    @property
    def identity(self) -> IdentityLike: ...
    @property
    def token_predictor(self) -> TokenPredictor | None:
        """A prompt's signature at arrival from its tokens; None: the fit made none."""
        ...


ArtifactLoader = Callable[[Path, str], ArtifactLike]


def load_from_store(root: Path, version: str) -> ArtifactLike:
    from stages.fit.artifact import ArtifactStore

    return ArtifactStore(root).load(version=version)
