"""ELDR with bounded loads ("eldr-bl"): the best-matching band member unless it is overloaded.

The paper's rule picks the least-loaded worker in the band, and its runner-up rule always puts
at least two workers in the band. With few decode workers that makes it join-shortest-queue:
at K=2 the band is always both workers, so locality never decides. This variant lets
similarity decide and load only bound it, as consistent hashing with bounded loads does (and as
eldr's prefill ring does): band members are tried from most to least similar, and the first
whose in-flight count stays within ``(1 + epsilon)`` of the mean (rounded up, counting the new
request) takes it. When the workers' batch size (vLLM ``--max-num-seqs``) is known, the cap
never exceeds it: a request past it would wait in that worker's queue while another has a free
slot. If every band member is over the cap, the paper's pick applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from stages.routing.context import RoutingContext
from stages.routing.params import check_range, option
from stages.routing.policies.base import RoutingRequest
from stages.routing.policies.eldr import EldrParams, EldrPolicy
from stages.routing.policies.select import BOUNDED_LOAD_FACTOR, bounded_load_capacity


@dataclass(frozen=True)
class EldrBoundedParams(EldrParams):
    epsilon: float = option(BOUNDED_LOAD_FACTOR - 1.0, "a worker takes a request while its"
                            " in-flight count stays within (1 + epsilon) x the mean")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("epsilon", self.epsilon, 0.0)


class EldrBoundedPolicy(EldrPolicy):
    name: ClassVar[str] = "eldr-bl"
    Params: ClassVar[type[EldrBoundedParams]] = EldrBoundedParams
    params: EldrBoundedParams

    def __init__(self, context: RoutingContext, params: EldrBoundedParams | None = None) -> None:
        super().__init__(context, params)
        self.worker_slots = context.worker_slots

    def load_cap(self, request: RoutingRequest) -> int:
        """Most in-flight requests a worker may hold after taking this one."""
        cap = bounded_load_capacity(request.loads, request.eligible, 1.0 + self.params.epsilon)
        return cap if self.worker_slots is None else min(cap, self.worker_slots)

    def pick_in_band(self, band: np.ndarray, s: np.ndarray, request: RoutingRequest) -> int:
        cap = self.load_cap(request)
        # Stable sort: equal similarity keeps the lowest index first.
        for worker in band[np.argsort(-s[band], kind="stable")]:
            if request.loads[worker] < cap:
                return int(worker)
        return super().pick_in_band(band, s, request)
