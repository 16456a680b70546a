"""Uniformly random eligible worker."""

from __future__ import annotations

from typing import ClassVar

from stages.routing.policies.base import DecodePolicy, RoutingRequest
from stages.routing.policies.select import eligible_indices


class RandomPolicy(DecodePolicy):
    name: ClassVar[str] = "random"

    def choose(self, request: RoutingRequest) -> int:
        idx = eligible_indices(request.eligible)
        return int(idx[self.rng.integers(idx.size)])
