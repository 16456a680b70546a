"""Power of two choices: sample two distinct eligible workers, keep the less loaded."""

from __future__ import annotations

from typing import ClassVar

from stages.routing.policies.base import DecodePolicy, RoutingRequest
from stages.routing.policies.select import eligible_indices


class PowerOfTwoPolicy(DecodePolicy):
    name: ClassVar[str] = "p2c"

    def choose(self, request: RoutingRequest) -> int:
        idx = eligible_indices(request.eligible)
        if idx.size == 1:
            return int(idx[0])
        a, b = idx[self.rng.choice(idx.size, size=2, replace=False)]
        # On a tie keep the first draw: the draw order is already random.
        return int(b) if request.loads[b] < request.loads[a] else int(a)
