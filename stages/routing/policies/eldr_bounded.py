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

import math
from typing import ClassVar

import numpy as np

from stages.errors import EldrError
from stages.routing.policies.base import RoutingRequest
from stages.routing.policies.eldr import DEFAULT_TAU, EldrPolicy
from stages.routing.policies.select import BOUNDED_LOAD_FACTOR, bounded_load_capacity

DEFAULT_EPSILON = BOUNDED_LOAD_FACTOR - 1.0


class EldrBoundedPolicy(EldrPolicy):
    name: ClassVar[str] = "eldr-bl"

    def __init__(
        self,
        num_workers: int,
        seed: int = 0,
        *,
        centroids: np.ndarray,
        tau: float = DEFAULT_TAU,
        worker_of_centroid: np.ndarray | None = None,
        epsilon: float = DEFAULT_EPSILON,
        worker_slots: int | None = None,
    ) -> None:
        super().__init__(
            num_workers, seed, centroids=centroids, tau=tau, worker_of_centroid=worker_of_centroid
        )
        if not math.isfinite(epsilon) or epsilon < 0:
            raise EldrError(f"epsilon must be a finite number >= 0, got {epsilon}")
        self.epsilon = float(epsilon)
        if worker_slots is not None and worker_slots < 1:
            raise EldrError(f"worker slots must be >= 1, got {worker_slots}")
        self.worker_slots = worker_slots

    def load_cap(self, request: RoutingRequest) -> int:
        """Most in-flight requests a worker may hold after taking this one."""
        cap = bounded_load_capacity(request.loads, request.eligible, 1.0 + self.epsilon)
        return cap if self.worker_slots is None else min(cap, self.worker_slots)

    def pick_in_band(self, band: np.ndarray, s: np.ndarray, request: RoutingRequest) -> int:
        cap = self.load_cap(request)
        # Stable sort: equal similarity keeps the lowest index first.
        for worker in band[np.argsort(-s[band], kind="stable")]:
            if request.loads[worker] < cap:
                return int(worker)
        return super().pick_in_band(band, s, request)
