"""Batch-aware ELDR ("eldr-union"): send a request where it adds the least decode latency.

A decode step of a memory-bound MoE worker costs ``fixed + a * batch + b * distinct``
(``stages.routing.cost_model``): every distinct expert the batch activates is streamed once. So
what a request costs depends on what the worker is running now, not on a static cluster. Each
in-flight request's prefill counts predict its per-step expert inclusion probabilities;
per worker their union gives the expected distinct experts of a step (``expert_load``). For a
new request and each worker, the added distinct experts ``dD`` and the step-time change
``a + b * dD`` follow; the request pays the new step time per token, the worker's ``n`` other
requests pay the change each, and the worker with the least of the two summed wins:

    added_w = step_w + (n_w + 1) * (a + b * dD_w)

This is the change in the sum of TPOTs over the requests in flight, so it spreads requests
when the experts they would share are few and packs them when many are. It needs no
artifact. The unions are kept for an evenly spaced subset of the MoE layers
(``sample_layers``), scaled to all of them: a request's tokens route most layers alike, and
the decision's cost is linear in the layers kept.

Two bounds keep it from doing harm where the prediction is wrong (a model whose prefill
routing says little about decode routing): a worker may hold at most ``max(1, slack * mean)``
more in-flight requests than the least-loaded one (a bounded-load rule: the error of a wrong
prediction is at most that much imbalance), and a worker with all its batch slots (vLLM
``--max-num-seqs``) taken is skipped while another has room, as the request would queue
there. Without a usable signature (none, all zero, another model's shape, or no top-k known)
the request goes to the least-loaded worker with random ties, and counts only as load.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from stages.errors import EldrError
from stages.routing.context import RoutingContext
from stages.routing.cost_model import (
    COST_PRESETS,
    CostModel,
    cost_model_for,
    cpu_like,
    gpu_like,
)
from stages.routing.params import ParamError, check_range, option
from stages.routing.policies.base import DecodePolicy, RoutingRequest
from stages.routing.policies.select import least_loaded_random

if TYPE_CHECKING:
    from stages.routing.policies.expert_load import WorkerExpertLoad

log = logging.getLogger(__name__)

# Measured on the bundled capture (issue 10's settings): 0.25 keeps p99 TPOT within 1% of the
# best load balancer when prefill predicts nothing, and the locality gain at 60-100 req/s.
DEFAULT_LOAD_SLACK = 0.25
# A request's experts per layer follow its tokens, which most layers route alike, so a stride
# of layers estimates the whole union; a decision costs O(workers x sampled layers x E). At 8 of
# Qwen3-30B's 48 layers a 16-worker decision takes p50 ~17 us / p99 ~40 us (16 layers: ~20 /
# 41-50 us; examples/bench_routing.py), and on synthetic 48-layer data 4, 8, 16 or all layers
# gave the same TPOT within 0.5% (domain, weak and no locality, 60 and 100 req/s;
# examples/bench_sample_layers.py). Synthetic layers share one domain structure; a model whose
# layers disagree more may want more of them.
DEFAULT_SAMPLE_LAYERS = 8


@dataclass(frozen=True)
class UnionParams:
    load_slack: float = option(DEFAULT_LOAD_SLACK, "a worker may hold max(1, load_slack x"
                               " mean load) more requests than the least loaded")
    cost: str = option("", "the decode step-time model it weighs experts against batch"
                       " slots with: gpu, cpu, or a JSON file of `eldr bench --engine-cost`;"
                       " empty: the simulated engine's, else the gpu preset")
    sample_layers: int = option(DEFAULT_SAMPLE_LAYERS, "MoE layers (evenly spaced) whose"
                                " expert unions stand for all of them; 0: every layer")

    def __post_init__(self) -> None:
        check_range("load_slack", self.load_slack, 0.0)
        if self.sample_layers < 0:
            raise ParamError("sample_layers", f"sample_layers must be >= 0 (0: every layer),"
                             f" got {self.sample_layers}")
        if self.cost not in ("", *COST_PRESETS):
            # Read now, so a wrong path fails where it was given (start-up, the admin call),
            # not at the first request; the model's shape is checked once it is known.
            try:
                CostModel.load(Path(self.cost))
            except EldrError as exc:
                raise ParamError("cost", f"cost: {exc}") from None

    def step_cost(self, fallback: CostModel | None, num_layers: int, num_experts: int) -> (
        CostModel
    ):
        """The model to weigh with, for signatures of this shape: the chosen one, else
        ``fallback`` (the simulated engine's), else the preset; one fitted on a model with
        other layers says nothing of this one, so the preset stands in (with a warning)."""
        cost = cost_model_for(self.cost, num_layers, num_experts) if self.cost else fallback
        if cost is not None and cost.num_layers != num_layers:
            log.warning("eldr-union: cost model %r is for %d MoE layers, the signatures have"
                        " %d; using the preset", self.cost, cost.num_layers, num_layers)
            cost = None
        return cost or default_cost(num_layers, num_experts)


def default_cost(num_layers: int, num_experts: int) -> CostModel:
    """The preset for a model of this shape (the GPU one needs at least 8 experts)."""
    return gpu_like(num_layers, num_experts) if num_experts >= 8 else cpu_like(num_layers)


def sampled_layers(num_layers: int, wanted: int) -> np.ndarray:
    """Indices of ``wanted`` evenly spaced layers of ``num_layers`` (0: all of them)."""
    if wanted == 0 or wanted >= num_layers:
        return np.arange(num_layers, dtype=np.int64)
    return np.unique(np.linspace(0, num_layers - 1, wanted).round().astype(np.int64))


class EldrUnionPolicy(DecodePolicy):
    name: ClassVar[str] = "eldr-union"
    uses_counts: ClassVar[bool] = True
    Params: ClassVar[type[UnionParams]] = UnionParams
    params: UnionParams

    def __init__(self, context: RoutingContext, params: UnionParams | None = None) -> None:
        super().__init__(context, params)
        # Imported (and compiled or loaded from numba's cache) with the first policy built,
        # not with the registry: every eldr command would pay numba's import otherwise.
        from stages.routing.policies import union_kernels

        union_kernels.warm()
        self._kernels = union_kernels
        self.top_k = context.top_k
        self.cost = context.cost
        self.worker_slots = context.worker_slots
        # Created at the first usable signature: the shape is the model's, which the proxy
        # may only learn from the first prefill.
        self._load: WorkerExpertLoad | None = None
        self._shape: tuple[int, int] | None = None
        self._rows: np.ndarray | None = None  # the sampled layers
        # Seconds per step: fixed, per sequence in the batch, per distinct expert of a
        # sampled layer (it stands for num_layers / kept layers').
        self._step: np.ndarray | None = None
        self._members: dict[Hashable, tuple[int, np.ndarray]] = {}
        # The last request's prediction, and the distinct experts it adds per scored worker
        # (``_added``, valid while ``_scored`` is that request), so its dispatch does not
        # compute them again.
        self._last: tuple[RoutingRequest, np.ndarray | None] | None = None
        self._scored: RoutingRequest | None = None
        self._added = np.zeros(self.num_workers)
        self._latency = np.zeros(self.num_workers)

    # --- decision ---

    def choose(self, request: RoutingRequest) -> int:
        loads, eligible = request.loads, request.eligible
        slots = self.worker_slots
        pi = self._predict(request)
        if pi is None:
            candidates = eligible if slots is None else eligible & (loads < slots)
            # Every healthy worker full: the request queues, and the shortest queue drains first.
            return least_loaded_random(loads, candidates if candidates.any() else eligible,
                                       self.rng)
        ties, first = self._score(request, pi, self.params.load_slack)
        if ties == 0:
            return least_loaded_random(loads, eligible, self.rng)  # every healthy worker full
        if ties == 1:
            return first
        latency = self._latency
        best = np.flatnonzero(latency <= latency.min() * (1.0 + self._kernels.TIE))
        return int(best[self.rng.integers(best.size)])

    def _score(self, request: RoutingRequest, pi: np.ndarray, load_slack: float) -> (
        tuple[int, int]
    ):
        """Fill ``_latency`` (and ``_added``) for ``request``; how many workers tie the best,
        and the first of them."""
        assert self._load is not None and self._step is not None  # set with the first pi
        self._scored = request
        return self._kernels.worker_latency(
            self._load.miss, pi, request.loads, request.eligible, self.worker_slots or 0,
            load_slack,
            self._load.distinct, self._step, self._added, self._latency,
        )

    def _predict(self, request: RoutingRequest) -> np.ndarray | None:
        """Flattened ``pi`` of the request, or ``None`` when it has no usable signature."""
        last = self._last
        if last is not None and last[0] is request:
            return last[1]
        pi = None
        self._scored = None
        counts = request.counts  # usable or None (``routing_inputs``)
        if counts is not None and self.top_k is not None and self._fits(counts.shape):
            assert self._rows is not None  # set with the shape
            pi = self._kernels.sampled_inclusion(
                np.ascontiguousarray(counts), self._rows, self.top_k
            )
        self._last = (request, pi)
        return pi

    def _fits(self, shape: tuple[int, ...]) -> bool:
        if self._shape is None:
            if len(shape) != 2:
                return False
            num_layers, num_experts = int(shape[0]), int(shape[1])
            cost = self.params.step_cost(self.cost, num_layers, num_experts)
            self._rows = sampled_layers(num_layers, self.params.sample_layers)
            kept = self._rows.size
            self._step = np.array([
                cost.base_s + cost.num_layers * cost.moe_fixed_s,
                cost.per_token_s,
                cost.per_expert_s * num_layers / kept,
            ])
            from stages.routing.policies.expert_load import WorkerExpertLoad

            self._load = WorkerExpertLoad(self.num_workers, kept * num_experts)
            self._shape = (num_layers, num_experts)
        # Another shape is another model's signature: it predicts nothing here.
        return tuple(shape) == self._shape

    # --- the batches the workers run ---

    def on_dispatch(self, worker: int, request: RoutingRequest, key: Hashable) -> None:
        if key in self._members:
            raise EldrError(f"request key {key!r} dispatched twice without completing")
        scored = self._scored is request and math.isfinite(self._latency[worker])
        pi = self._predict(request)
        self._last = self._scored = None
        if pi is None:
            return  # counted by the proxy's loads only
        assert self._load is not None
        self._load.add(worker, pi, float(self._added[worker]) if scored else None)
        self._members[key] = (worker, pi)

    def on_signature(self, worker: int, request: RoutingRequest, key: Hashable) -> None:
        """The arrival estimate's uncached tail (a mean-like guess) blurs the worker's expert
        union for every later decision while the request runs; the prefill's exact signature
        replaces it (simulated 8P16D at 10 conversations/s: arrival kept ~75% of the
        after-prefill expert gain without this, ~88% with it; docs/results.md)."""
        pi = self._predict(request)
        self._last = self._scored = None
        if pi is None:
            return  # nothing better than the estimate
        assert self._load is not None
        entry = self._members.get(key)
        if entry is not None:
            home, estimate = entry
            if home != worker:
                raise EldrError(f"request {key!r} signed on worker {worker}, sent to {home}")
            self._load.remove(home, estimate)
        self._load.add(worker, pi)
        self._members[key] = (worker, pi)

    def on_complete(self, worker: int, key: Hashable) -> None:
        entry = self._members.pop(key, None)
        if entry is None:
            return  # no signature, or dispatched before this policy was installed
        home, pi = entry
        if home != worker:
            raise EldrError(f"request {key!r} completed on worker {worker}, sent to {home}")
        assert self._load is not None
        self._load.remove(home, pi)
