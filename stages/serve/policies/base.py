"""The one interface every decode-routing policy implements (proxy and simulator alike).

A policy sees the in-flight decode requests per worker, which workers are eligible (healthy),
and the request's transformed signature (a unit vector, or ``None`` when the prefill did not
deliver one). It returns a worker index. Hooks default to no-ops so simple policies stay small.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np


@dataclass(frozen=True)
class RoutingRequest:
    """What a policy may look at for one decision."""

    loads: np.ndarray  # int64 [W]: in-flight decode requests per decode worker
    eligible: np.ndarray  # bool [W]: healthy workers; at least one is True
    features: np.ndarray | None = None  # float32 [D] unit vector, or None if unknown
    extra: dict[str, object] = field(default_factory=dict)


class DecodePolicy(ABC):
    name: ClassVar[str] = "base"
    uses_signature: ClassVar[bool] = False

    def __init__(self, num_workers: int, seed: int = 0) -> None:
        self.num_workers = num_workers
        self.rng = np.random.default_rng(seed)

    @abstractmethod
    def choose(self, request: RoutingRequest) -> int:
        """Index of the decode worker for this request (must be eligible)."""

    def on_dispatch(self, worker: int, request: RoutingRequest) -> None:  # noqa: B027
        """Called once the request was sent to ``worker``."""

    def on_complete(self, worker: int) -> None:  # noqa: B027
        """Called when a request on ``worker`` finished (success or failure)."""


PolicyFactory = Callable[..., DecodePolicy]
