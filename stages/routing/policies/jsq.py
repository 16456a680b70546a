"""Join-shortest-queue: fewest in-flight decode requests, random tie-break."""

from __future__ import annotations

from typing import ClassVar

from stages.routing.policies.base import DecodePolicy, RoutingRequest
from stages.routing.policies.select import least_loaded_random


class JsqPolicy(DecodePolicy):
    name: ClassVar[str] = "jsq"

    def choose(self, request: RoutingRequest) -> int:
        return least_loaded_random(request.loads, request.eligible, self.rng)
