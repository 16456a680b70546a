"""Discrete-event model of a PD-disaggregated MoE cluster, driven by the proxy's own policies.

Per request: Poisson arrival -> prefill (``sim_workload``) -> at prefill end the decode policy
(``make_policy``, the very classes the proxy runs) picks a decode worker from the in-flight
counts and the request's prefill signature (raw and transformed, read by the proxy's own
``routing_inputs``) -> after the KV transfer it queues on that worker -> joins the running
batch at the next step boundary while the batch has room (continuous batching, ``max_batch``)
-> one token per step until its output is complete.
With ``locality_blend`` s > 0 the dataset's decode profiles are first blended with other
requests' (``locality_blend``: s = 1 is the no-locality control).

A step's time comes from the cost model with the batch size and the distinct experts the batch
activates that step (``expert_union``, from the requests' decode profiles). Token timing
follows ELDR's proxy: the prefill's first token is streamed at prefill end (TTFT), the decode
worker produces the rest; with ``first_token_from_prefill=False`` (plain vLLM PD) the first
decode step produces the first token instead.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from stages.bench.expert_union import DecodeProfiles, ExpertUnion
from stages.bench.locality_blend import blend_decode, check_strength
from stages.bench.metrics import RequestTable, summarize
from stages.bench.results import ComparisonResult, PolicyResult
from stages.bench.sim_workload import RoutingArtifact, Workload, build_workload
from stages.errors import EldrError
from stages.routing.context import RoutingContext
from stages.routing.cost_model import CostModel
from stages.routing.inputs import routing_inputs
from stages.routing.policies import (
    POLICIES,
    DecodePolicy,
    RoutingRequest,
    make_policy,
)
from stages.routing.policy_config import PolicyConfig
from stages.signature.dataset import SignatureArrays

DEFAULT_POLICIES = tuple(POLICIES)
_STEP_END, _KV_READY = 0, 1
_NOISE_BLOCK = 1 << 16


@dataclass(frozen=True)
class SimConfig:
    cost: CostModel
    num_prefill: int = 8
    num_decode: int = 16
    request_rate: float = 60.0
    duration_s: float = 120.0  # arrivals happen in [0, duration_s)
    warmup_s: float = 0.0  # requests arriving earlier run but are not measured
    policies: tuple[str, ...] = DEFAULT_POLICIES
    max_batch: int = 128  # decode sequences per worker (vLLM --max-num-seqs)
    output_tokens: int | None = None  # fixed output length; None: the dataset's
    max_output_tokens: int = 512
    kv_transfer_s: float = 0.002
    prefill_routing: str = "least_loaded"
    first_token_from_prefill: bool = True
    # Options per policy name, as `eldr serve --policy-config` takes them.
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    step_noise: bool = True  # per-step spread of the distinct-expert count
    # The locality dial: 0 = the dataset's own decode, 1 = another request's (no locality).
    locality_blend: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise EldrError("need at least one prefill and one decode worker")
        if self.max_batch < 1:
            raise EldrError(f"max batch must be >= 1, got {self.max_batch}")
        if not self.policies:
            raise EldrError("give at least one policy")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown:
            raise EldrError(f"unknown policy {unknown[0]!r}; choose from {sorted(POLICIES)}")
        if not 0 <= self.warmup_s < self.duration_s:
            raise EldrError(f"warm-up must be in [0, duration), got {self.warmup_s}")
        if self.kv_transfer_s < 0:
            raise EldrError("KV transfer time must be >= 0")
        check_strength(self.locality_blend)


@dataclass
class _Decoder:
    """One decode worker's mutable state during a run."""

    union: ExpertUnion
    queue: deque[int] = field(default_factory=deque)
    finish: list[tuple[int, int]] = field(default_factory=list)  # heap of (last step, req)
    steps_done: int = 0
    batch: int = 0
    measured_in_batch: int = 0
    busy: bool = False


@dataclass
class _StepLog:
    """Per decode step, across workers (appended in start order)."""

    start: list[float] = field(default_factory=list)
    duration: list[float] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    measured: list[int] = field(default_factory=list)  # measured requests in the batch
    measured_new: list[int] = field(default_factory=list)  # ... of which in their 1st step
    distinct: list[float] = field(default_factory=list)  # summed over layers


class _Run:
    """One policy over the workload."""

    def __init__(
        self,
        config: SimConfig,
        arrays: SignatureArrays,
        workload: Workload,
        profiles: DecodeProfiles,
        policy: DecodePolicy,
        top_k: int,
    ) -> None:
        self.cfg = config
        self.wl = workload
        self.profiles = profiles
        self.policy = policy
        self.prefill_counts = arrays.prefill_counts
        num_layers, num_experts = arrays.decode_counts.shape[1:]
        self.num_layers = num_layers
        size = num_layers * num_experts
        self.decoders = [
            _Decoder(ExpertUnion(size, num_layers * top_k)) for _ in range(config.num_decode)
        ]
        self.loads = np.zeros(config.num_decode, dtype=np.int64)
        self.eligible = np.ones(config.num_decode, dtype=bool)
        n = len(workload)
        self.worker = np.full(n, -1, dtype=np.int64)
        self.first_step_end = np.full(n, np.nan)
        self.done_at = np.full(n, np.nan)
        self.measured = workload.arrival_s >= config.warmup_s
        # Tokens the decode worker generates per request.
        self.decode_tokens = workload.output_tokens - (1 if config.first_token_from_prefill else 0)
        self.log_miss: dict[int, np.ndarray] = {}  # per active request, for its removal
        self.events: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.steps = _StepLog()
        self.noise_rng = np.random.default_rng([config.seed, 2])
        self.noise = np.zeros(0)
        self.noise_pos = 0
        c = config.cost
        self.step_fixed = c.base_s + c.num_layers * c.moe_fixed_s

    # -- events ------------------------------------------------------------------------
    def _push(self, t: float, kind: int, who: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, who))

    def _z(self) -> float:
        if not self.cfg.step_noise:
            return 0.0
        if self.noise_pos == self.noise.size:
            self.noise = self.noise_rng.standard_normal(_NOISE_BLOCK)
            self.noise_pos = 0
        self.noise_pos += 1
        return float(self.noise[self.noise_pos - 1])

    def route(self, r: int, t: float) -> None:
        features, row = self.wl.features, self.wl.feature_rows[r]
        # The proxy's rule; the transform ran once per sampled row (``sim_workload``).
        inputs = routing_inputs(
            self.prefill_counts[self.wl.rows[r]],
            None if features is None else lambda counts: features[row],
        )
        request = RoutingRequest(self.loads.copy(), self.eligible, inputs.features, inputs.counts)
        w = self.policy.choose(request)
        if not (0 <= w < self.cfg.num_decode):
            raise EldrError(f"policy {self.policy.name} chose worker {w} of {self.cfg.num_decode}")
        self.policy.on_dispatch(w, request, r)
        self.loads[w] += 1
        self.worker[r] = w
        self._push(t + self.cfg.kv_transfer_s, _KV_READY, r)

    def kv_ready(self, r: int, t: float) -> None:
        w = int(self.worker[r])
        dec = self.decoders[w]
        dec.queue.append(r)
        if not dec.busy:
            self.start_step(w, t)

    def start_step(self, w: int, t: float) -> None:
        dec = self.decoders[w]
        new_measured = 0
        joined = []
        while dec.queue and dec.batch < self.cfg.max_batch:
            r = dec.queue.popleft()
            lm = self.profiles.log_complement(int(self.wl.rows[r]))
            self.log_miss[r] = lm
            dec.union.add(lm)
            dec.batch += 1
            heapq.heappush(dec.finish, (dec.steps_done + int(self.decode_tokens[r]), r))
            if self.measured[r]:
                dec.measured_in_batch += 1
                new_measured += 1
            joined.append(r)
        if dec.batch == 0:
            dec.busy = False
            return
        distinct = dec.union.draw(self._z())
        c = self.cfg.cost
        duration = self.step_fixed + c.per_token_s * dec.batch + c.per_expert_s * distinct
        end = t + duration
        for r in joined:
            self.first_step_end[r] = end
        log = self.steps
        log.start.append(t)
        log.duration.append(duration)
        log.batch.append(dec.batch)
        log.measured.append(dec.measured_in_batch)
        log.measured_new.append(new_measured)
        log.distinct.append(distinct)
        dec.busy = True
        self._push(end, _STEP_END, w)

    def step_end(self, w: int, t: float) -> None:
        dec = self.decoders[w]
        dec.steps_done += 1
        while dec.finish and dec.finish[0][0] == dec.steps_done:
            _, r = heapq.heappop(dec.finish)
            self.done_at[r] = t
            dec.union.remove(self.log_miss.pop(r))
            dec.batch -= 1
            if self.measured[r]:
                dec.measured_in_batch -= 1
            self.loads[w] -= 1
            self.policy.on_complete(w, r)
        dec.busy = False
        self.start_step(w, t)

    def run(self) -> None:
        prefill_end = self.wl.prefill_end_s
        order = np.argsort(prefill_end, kind="stable").tolist()
        times = prefill_end[order].tolist()
        i, n = 0, len(order)
        events = self.events
        while i < n or events:
            if i < n and (not events or times[i] <= events[0][0]):
                self.route(order[i], times[i])
                i += 1
                continue
            t, _, kind, who = heapq.heappop(events)
            if kind == _STEP_END:
                self.step_end(who, t)
            else:
                self.kv_ready(who, t)
        if np.isnan(self.done_at).any():
            raise AssertionError("simulation ended with unfinished requests")

    # -- results -----------------------------------------------------------------------
    def result(self) -> PolicyResult:
        cfg, wl, m = self.cfg, self.wl, self.measured
        log = self.steps
        duration = np.asarray(log.duration)
        measured_steps = np.asarray(log.measured) - np.asarray(log.measured_new)
        itl = np.repeat(duration, measured_steps)
        if cfg.first_token_from_prefill:
            ttft = wl.prefill_end_s - wl.arrival_s
            first_gap = (self.first_step_end - wl.prefill_end_s)[m]
            itl = np.concatenate([itl, first_gap])
        else:
            ttft = self.first_step_end - wl.arrival_s
        table = RequestTable(
            success=np.ones(int(m.sum()), dtype=bool),
            prompt_tokens=wl.prompt_tokens[m],
            output_tokens=wl.output_tokens[m],
            ttft_s=ttft[m],
            latency_s=(self.done_at - wl.arrival_s)[m],
            itl_s=itl,
        )
        window = float(self.done_at[m].max()) - cfg.warmup_s
        metrics = summarize(table, window)
        # Decode steps that started after the warm-up, as the counters of a real run would be
        # read from the end of the warm-up.
        in_window = np.asarray(log.start) >= cfg.warmup_s
        steps = int(in_window.sum())
        distinct = np.asarray(log.distinct)[in_window]
        batch = np.asarray(log.batch)[in_window]
        nan = float("nan")
        metrics |= {
            "decode_steps": steps,
            "active_experts_per_step": float(distinct.mean()) if steps else nan,
            "distinct_experts_per_layer": float(distinct.mean()) / self.num_layers
            if steps
            else nan,
            "mean_decode_step_ms": 1000.0 * float(duration[in_window].mean()) if steps else nan,
            "mean_decode_batch": float(batch.mean()) if steps else nan,
        }
        return PolicyResult(self.policy.name, metrics, table)


def _check_inputs(config: SimConfig, arrays: SignatureArrays, artifact: object | None) -> None:
    num_layers = arrays.decode_counts.shape[1]
    if config.cost.num_layers != num_layers:
        raise EldrError(
            f"cost model is for {config.cost.num_layers} MoE layers, the dataset has"
            f" {num_layers}; fit or choose a cost model for this model"
        )
    needs = [p for p in config.policies if POLICIES[p].uses_signature]
    if needs and artifact is None:
        raise EldrError(f"policy {needs[0]!r} needs a fitted artifact (eldr fit) to simulate")


def simulate(
    config: SimConfig,
    arrays: SignatureArrays,
    artifact: RoutingArtifact | None,
    *,
    top_k: int,
) -> dict[str, PolicyResult]:
    """Every policy in ``config.policies`` on the same simulated request stream.

    ``top_k`` is the model's experts per token (``SignatureDataset.identity.top_k``).
    """
    _check_inputs(config, arrays, artifact)
    if top_k < 1:
        raise EldrError(f"top_k must be >= 1, got {top_k}")
    arrays = blend_decode(arrays, config.locality_blend, config.seed, top_k)
    workload = build_workload(
        arrays,
        config.cost,
        request_rate=config.request_rate,
        duration_s=config.duration_s,
        num_prefill=config.num_prefill,
        prefill_routing=config.prefill_routing,
        output_tokens=config.output_tokens,
        max_output_tokens=config.max_output_tokens,
        seed=config.seed,
        artifact=artifact,
    )
    if not (workload.arrival_s >= config.warmup_s).any():
        raise EldrError("no request arrives after the warm-up; raise the rate or the duration")
    centroids = None if artifact is None else np.asarray(artifact.centroids, dtype=np.float32)
    profiles = DecodeProfiles(arrays.decode_counts, arrays.prefill_counts, top_k)
    results: dict[str, PolicyResult] = {}
    for name in config.policies:
        context = RoutingContext(
            config.num_decode,
            seed=config.seed,
            centroids=centroids if POLICIES[name].uses_signature else None,
            worker_slots=config.max_batch,
            top_k=top_k,
            cost=config.cost,
        )
        policy = make_policy(name, context, config.policy_config.overrides(name))
        run = _Run(config, arrays, workload, profiles, policy, top_k)
        run.run()
        results[name] = run.result()
    return results


def simulate_sweep(
    config: SimConfig,
    arrays: SignatureArrays,
    artifact: RoutingArtifact | None,
    rates: Sequence[float],
    *,
    top_k: int,
) -> list[ComparisonResult]:
    """``simulate`` at each request rate (the rest of ``config`` unchanged)."""
    if not rates:
        raise EldrError("give at least one request rate")
    return [
        ComparisonResult(
            rate, simulate(replace(config, request_rate=rate), arrays, artifact, top_k=top_k)
        )
        for rate in rates
    ]
