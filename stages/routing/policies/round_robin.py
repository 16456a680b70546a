"""Round-robin over eligible workers: the baseline that ignores load and signatures."""

from __future__ import annotations

from typing import ClassVar

from stages.routing.context import RoutingContext
from stages.routing.params import NoParams
from stages.routing.policies.base import DecodePolicy, RoutingRequest
from stages.routing.policies.select import eligible_indices


class RoundRobinPolicy(DecodePolicy):
    name: ClassVar[str] = "rr"

    def __init__(self, context: RoutingContext, params: NoParams | None = None) -> None:
        super().__init__(context, params)
        self._next = 0

    def choose(self, request: RoutingRequest) -> int:
        idx = eligible_indices(request.eligible)
        # First eligible worker at or after the cursor, wrapping: an unhealthy worker's turn
        # passes to the next one instead of stalling the rotation.
        after = idx[idx >= self._next]
        worker = int(after[0]) if after.size else int(idx[0])
        self._next = (worker + 1) % self.num_workers
        return worker
