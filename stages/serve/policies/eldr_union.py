"""Batch-aware ELDR ("eldr-union"): send a request where it adds the least decode latency.

A decode step of a memory-bound MoE worker costs ``fixed + a * batch + b * distinct``
(``stages.bench.cost_model``): every distinct expert the batch activates is streamed once. So
what a request costs depends on what the worker is running now, not on a static cluster. Each
in-flight request's prefill counts predict its per-step expert inclusion probabilities;
per worker their union gives the expected distinct experts of a step (``expert_load``). For a
new request and each worker, the added distinct experts ``dD`` and the step-time change
``a + b * dD`` follow; the request pays the new step time per token, the worker's ``n`` other
requests pay the change each, and the worker with the least of the two summed wins:

    added_w = step_w + (n_w + 1) * (a + b * dD_w)

This is the change in the sum of TPOTs over all requests in flight, so it spreads requests
when the experts they would share are few and packs them when many are. It needs no
artifact. A worker with all its batch slots (vLLM ``--max-num-seqs``) taken is skipped while
another has room, as the request would queue there. Without a usable signature (none, all
zero, another model's shape, or no top-k known) the request goes to the least-loaded worker
with random ties, and counts only as load.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from stages.bench.cost_model import CostModel, cpu_like, gpu_like
from stages.errors import EldrError
from stages.serve.policies.base import DecodePolicy, RoutingRequest, signature_counts
from stages.serve.policies.expert_load import WorkerExpertLoad
from stages.serve.policies.select import least_loaded_random
from stages.signature.inclusion import inclusion_probabilities

# Workers whose added latency is within this relative margin of the best tie (random pick):
# empty workers are exact ties, and float noise must not send them all to the lowest index.
_TIE = 1e-9


@dataclass(frozen=True)
class UnionParams:
    top_k: int | None = None  # the model's experts per token; None: signatures are unusable
    cost: CostModel | None = None  # None: GPU-like preset for the signatures' shape
    worker_slots: int | None = None  # each worker's batch size (vLLM --max-num-seqs)
    shrink: float = 0.0  # weight of the mean recent profile mixed into each prediction
    others_weight: float = 1.0  # weight of the delay added to the worker's other requests
    prior_rate: float = 0.01  # EMA rate of the mean recent profile
    load_slack: int | None = None  # candidates hold at most this many more than the least

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k < 1:
            raise EldrError(f"top_k must be >= 1, got {self.top_k}")
        if self.worker_slots is not None and self.worker_slots < 1:
            raise EldrError(f"worker slots must be >= 1, got {self.worker_slots}")


def default_cost(num_layers: int, num_experts: int) -> CostModel:
    """The preset for a model of this shape (the GPU one needs at least 8 experts)."""
    return gpu_like(num_layers, num_experts) if num_experts >= 8 else cpu_like(num_layers)


@dataclass(frozen=True)
class _StepCost:
    fixed: float  # seconds per step whatever the batch
    per_seq: float  # seconds per sequence in the batch
    per_expert: float  # seconds per distinct expert (summed over layers)


class EldrUnionPolicy(DecodePolicy):
    name: ClassVar[str] = "eldr-union"
    uses_counts: ClassVar[bool] = True

    def __init__(self, num_workers: int, seed: int = 0, *, params: UnionParams | None = None):
        super().__init__(num_workers, seed)
        self.params = params or UnionParams()
        # Created at the first usable signature: the shape is the model's, which the proxy
        # may only learn from the first prefill.
        self._load: WorkerExpertLoad | None = None
        self._shape: tuple[int, int] | None = None
        self._step: _StepCost | None = None
        self._members: dict[Hashable, tuple[int, np.ndarray]] = {}
        self._prior: np.ndarray | None = None
        # The last request's prediction, so its dispatch does not compute it again.
        self._last: tuple[RoutingRequest, np.ndarray | None] | None = None

    # --- decision ---

    def choose(self, request: RoutingRequest) -> int:
        loads, eligible = request.loads, request.eligible
        slots = self.params.worker_slots
        candidates = eligible if slots is None else eligible & (loads < slots)
        if not candidates.any():
            # Every healthy worker is full: the request queues, and the shortest queue drains
            # first.
            return least_loaded_random(loads, eligible, self.rng)
        pi = self._predict(request)
        if pi is None:
            return least_loaded_random(loads, candidates, self.rng)
        if self.params.load_slack is not None:
            candidates = candidates & (loads <= loads[candidates].min() + self.params.load_slack)
        added = np.where(candidates, self.added_latency(pi, loads), np.inf)
        best = np.flatnonzero(added <= added.min() * (1.0 + _TIE))
        return int(best[0] if best.size == 1 else best[self.rng.integers(best.size)])

    def added_latency(self, pi: np.ndarray, loads: np.ndarray) -> np.ndarray:
        """Per worker, seconds per token added over all requests if this one joins it."""
        assert self._load is not None and self._step is not None  # set with the first pi
        step = self._step
        extra = step.per_seq + step.per_expert * self._load.added_distinct(pi)
        n = loads.astype(np.float64)
        now = step.fixed + step.per_seq * n + step.per_expert * self._load.distinct
        return now + (self.params.others_weight * n + 1.0) * extra

    def _predict(self, request: RoutingRequest) -> np.ndarray | None:
        """Flattened ``pi`` of the request, or ``None`` when it has no usable signature."""
        last = self._last
        if last is not None and last[0] is request:
            return last[1]
        pi = None
        counts = signature_counts(request.counts)
        if counts is not None and self.params.top_k is not None and self._fits(counts.shape):
            pi = inclusion_probabilities(counts, self.params.top_k).ravel()
            if self._prior is None:
                self._prior = pi.copy()
            else:
                self._prior += self.params.prior_rate * (pi - self._prior)
            if self.params.shrink:
                pi = (1 - self.params.shrink) * pi + self.params.shrink * self._prior
        self._last = (request, pi)
        return pi

    def _fits(self, shape: tuple[int, ...]) -> bool:
        if self._shape is None:
            if len(shape) != 2:
                return False
            num_layers, num_experts = int(shape[0]), int(shape[1])
            cost = self.params.cost or default_cost(num_layers, num_experts)
            self._step = _StepCost(
                fixed=cost.base_s + cost.num_layers * cost.moe_fixed_s,
                per_seq=cost.per_token_s,
                per_expert=cost.per_expert_s,
            )
            self._load = WorkerExpertLoad(self.num_workers, num_layers * num_experts)
            self._shape = (num_layers, num_experts)
        # Another shape is another model's signature: it predicts nothing here.
        return tuple(shape) == self._shape

    # --- the batches the workers run ---

    def on_dispatch(self, worker: int, request: RoutingRequest, key: Hashable) -> None:
        if key in self._members:
            raise EldrError(f"request key {key!r} dispatched twice without completing")
        pi = self._predict(request)
        self._last = None
        if pi is None:
            return  # counted by the proxy's loads only
        assert self._load is not None
        log_complement = np.log1p(-pi)
        self._load.add(worker, log_complement)
        self._members[key] = (worker, log_complement)

    def on_complete(self, worker: int, key: Hashable) -> None:
        entry = self._members.pop(key, None)
        if entry is None:
            return  # no signature, or dispatched before this policy was installed
        home, log_complement = entry
        if home != worker:
            raise EldrError(f"request {key!r} completed on worker {worker}, sent to {home}")
        assert self._load is not None
        self._load.remove(home, log_complement)
