"""Discrete-event model of a PD-disaggregated MoE cluster, driven by the proxy's own policies.

Per request, as the load generator and the proxy run it: arrival (Poisson, or a live run's
schedule: ``stages.bench.replay.saved_run``) -> sent once fewer than ``max_concurrency``
requests are in flight (the load generator's cap; FIFO; None: open loop) -> prefill on the
least-loaded prefill worker (FIFO, one prompt at a time) -> at prefill end the decode policy
(``make_policy``, the very classes the proxy runs, built afresh for every segment as the
proxy's policy switch does, on the segment's seed: a live round's, or the simulation's) picks
a decode worker from the in-flight counts and the request's prefill signature (read by the
proxy's own ``routing_inputs``) -> the decode worker pulls the KV cache -> the request joins
the running batch while it has room (continuous batching, ``max_batch``) -> one token per step
until its output is complete.

The KV pull is vLLM's: a worker mid-step starts it at its next step boundary and sees it done
at the end of the first step that finishes after it, so the request joins one step later; an
idle worker starts it at once and begins a step when it is done. Token timing follows the
proxy: it returns nothing of the prefill leg but its KV hand-off (the prefill's one token is
discarded), and the decode worker generates every output token, the first in the step the
request joins (TTFT). ``first_token_from_prefill=True`` models a proxy that streams the
prefill's token instead (the decode worker then generates one token fewer).

A step's time comes from the cost model with the batch size and the distinct experts the batch
activates that step (``expert_union``, from the requests' decode profiles), as work of a
worker with its cores to itself (``CostModel.on_own_core``: a model measured on workers sharing
a core says so): decode workers bound to one core (``decode_cores``) share it as the kernel
does (``shared_cores``; vLLM's PD workers each keep their share even when idle). The expert
and step-time figures are over decode-only steps (no request joining), as the workers'
counters count them. With ``locality_blend`` s > 0 each simulated request's decode profile is
first blended with another simulated request's (s = 1: no locality; ``locality_blend``).

With ``proxies`` N > 1, N proxies route the requests (one each, by arrival order), each with
its own policy instance and in-flight counts: its own dispatches and completions at once, the
others' ``publish_delay_s`` later, as the decode workers publish them (``proxy_views``). The
prefill leg stays routed on exact state (its least-loaded choice is the load generator's
model, not a proxy's).

A run is a sequence of segments per policy, each from an idle cluster (a live run's rounds);
``simulate`` runs one Poisson segment, the same for every policy.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from stages.bench.metrics import RequestTable, summarize
from stages.bench.results import ComparisonResult, PolicyResult
from stages.bench.sim.expert_union import DecodeProfiles, ExpertUnion
from stages.bench.sim.locality_blend import blend_requests, check_strength
from stages.bench.sim.proxy_views import COMPLETED, DISPATCHED, ProxyViews, proxy_seeds
from stages.bench.sim.shared_cores import SHARING_MODES, SharedCores, StepEnd
from stages.bench.sim.sim_workload import RoutingArtifact, Workload, build_workload
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
PREFILL_ROUTING = ("round_robin", "least_loaded")
_STEP_END, _PREFILL_END, _AT_DECODE, _KV_LOADED, _PUBLISHED = 0, 1, 2, 3, 4
_NOISE_BLOCK = 1 << 16


@dataclass(frozen=True)
class SimConfig:
    cost: CostModel
    num_prefill: int = 8
    num_decode: int = 16
    request_rate: float = 60.0
    duration_s: float = 120.0  # arrivals happen in [0, duration_s)
    warmup_s: float = 0.0  # requests arriving earlier (in each segment) are not measured
    policies: tuple[str, ...] = DEFAULT_POLICIES
    max_batch: int = 128  # decode sequences per worker (vLLM --max-num-seqs)
    output_tokens: int | None = None  # fixed output length; None: the dataset's
    max_output_tokens: int = 512
    kv_transfer_s: float = 0.002  # the decode worker's KV pull, once started
    prefill_routing: str = "least_loaded"
    # The proxy discards the prefill's token; True: a proxy that streams it.
    first_token_from_prefill: bool = False
    # Requests in flight at most, as the load generator's --max-concurrency; None: open loop.
    max_concurrency: int | None = None
    # Core group of each decode worker: equal groups share one core; None: a core each.
    decode_cores: tuple[int, ...] | None = None
    # How workers on one core share it: "bound" (each keeps its share, idle or not, as vLLM's
    # PD workers do) or "busy" (idle ones sleep: processor sharing among the busy).
    core_sharing: str = "bound"
    # Options per policy name, as `eldr serve --policy-config` takes them.
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    # Whether policies are told the cost model (the proxy is not: eldr-union then runs on its
    # --policy-config cost, else a preset).
    policies_know_cost: bool = True
    step_noise: bool = True  # per-step spread of the distinct-expert count
    # The locality dial: 0 = the dataset's own decode, 1 = another request's (no locality).
    locality_blend: float = 0.0
    seed: int = 0
    # Routing proxies in front of the decode workers, each routing on its own view: its own
    # assignments at once, the others' once the workers publish them, publish_delay_s later.
    proxies: int = 1
    publish_delay_s: float = 0.0

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
        if self.prefill_routing not in PREFILL_ROUTING:
            raise EldrError(
                f"prefill routing must be one of {PREFILL_ROUTING}, got {self.prefill_routing!r}"
            )
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise EldrError(f"max concurrency must be >= 1, got {self.max_concurrency}")
        if self.decode_cores is not None and len(self.decode_cores) != self.num_decode:
            raise EldrError(
                f"{len(self.decode_cores)} decode core groups for {self.num_decode} decode"
                " workers"
            )
        if self.core_sharing not in SHARING_MODES:
            raise EldrError(
                f"core sharing must be one of {SHARING_MODES}, got {self.core_sharing!r}"
            )
        check_strength(self.locality_blend)
        if self.proxies < 1:
            raise EldrError(f"need at least one proxy, got {self.proxies}")
        if not (math.isfinite(self.publish_delay_s) and self.publish_delay_s >= 0):
            raise EldrError(f"publish delay must be finite and >= 0 s, got {self.publish_delay_s}")


@dataclass
class _Decoder:
    """One decode worker's mutable state during a segment."""

    union: ExpertUnion
    pending: list[int] = field(default_factory=list)  # arrived mid-step: pull not started
    loading: list[tuple[float, int]] = field(default_factory=list)  # (pull done at, request)
    queue: deque[int] = field(default_factory=deque)  # KV here, waiting for a batch slot
    finish: list[tuple[int, int]] = field(default_factory=list)  # heap of (last step, req)
    steps_done: int = 0
    batch: int = 0
    measured_in_batch: int = 0
    busy: bool = False  # a step in progress
    polling: float = float("inf")  # idle, waiting for a pull due at this time


@dataclass
class _StepLog:
    """Per decode step, across workers (appended in start order)."""

    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    measured: list[int] = field(default_factory=list)  # measured requests in the batch
    measured_new: list[int] = field(default_factory=list)  # ... of which in their 1st step
    joined: list[int] = field(default_factory=list)  # requests in their 1st step
    distinct: list[float] = field(default_factory=list)  # summed over layers


@dataclass(frozen=True)
class _Outcome:
    """One segment's measured requests and decode steps."""

    table: RequestTable
    window_s: float
    steps: _StepLog
    warmup_s: float
    max_in_flight: int  # requests sent and not yet done, at most (the live run's peak)
    # Per measured request, the most minus the fewest requests on a decode worker just after
    # its dispatch: how evenly the proxies' (possibly stale) views spread the load.
    load_spread: np.ndarray


class _Segment:
    """One policy over one workload, from an idle cluster."""

    def __init__(
        self,
        config: SimConfig,
        arrays: SignatureArrays,
        workload: Workload,
        profiles: DecodeProfiles,
        policies: Sequence[DecodePolicy],
        top_k: int,
        noise_rng: np.random.Generator,
    ) -> None:
        """``policies``: one per proxy (``config.proxies``)."""
        if len(policies) != config.proxies:
            raise ValueError(f"{len(policies)} policies for {config.proxies} proxies")
        self.cfg = config
        self.wl = workload
        self.profiles = profiles
        self.policy = policies[0]
        # None with one proxy: it routes on the true loads, as before there were several.
        self.views = None if len(policies) == 1 else ProxyViews(policies, config.num_decode)
        self.prefill_counts = arrays.prefill_counts
        num_layers, num_experts = arrays.decode_counts.shape[1:]
        size = num_layers * num_experts
        self.decoders = [
            _Decoder(ExpertUnion(size, num_layers * top_k)) for _ in range(config.num_decode)
        ]
        self.cores = SharedCores(
            config.decode_cores or tuple(range(config.num_decode)), config.core_sharing
        )
        self.loads = np.zeros(config.num_decode, dtype=np.int64)
        self.eligible = np.ones(config.num_decode, dtype=bool)
        n = len(workload)
        self.worker = np.full(n, -1, dtype=np.int64)
        self.sent_at = np.full(n, np.nan)
        self.prefill_end = np.full(n, np.nan)
        self.first_step_end = np.full(n, np.nan)
        self.done_at = np.full(n, np.nan)
        self.load_spread = np.zeros(n, dtype=np.int64)
        self.measured = workload.arrival_s >= config.warmup_s
        # Tokens the decode worker generates per request.
        self.decode_tokens = workload.output_tokens - (1 if config.first_token_from_prefill else 0)
        self.log_miss: dict[int, np.ndarray] = {}  # per active request, for its removal
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.steps = _StepLog()
        self.step_start = [0.0] * config.num_decode
        self.joined_now: list[list[int]] = [[] for _ in range(config.num_decode)]
        self.noise_rng = noise_rng
        self.noise = np.zeros(0)
        self.noise_pos = 0
        self.prefill_free = [0.0] * config.num_prefill
        self.prefill_next = 0
        self.prefill_service = config.cost.prefill_time(workload.prompt_tokens)
        self.in_flight = 0
        self.waiting: deque[int] = deque()
        self.work = config.cost.on_own_core()
        self.step_fixed = self.work.base_s + self.work.num_layers * self.work.moe_fixed_s

    # -- events ------------------------------------------------------------------------
    def _push(self, t: float, kind: int, who: int, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, who, version))

    def _push_ends(self, ends: list[StepEnd]) -> None:
        for e in ends:
            self._push(e.at, _STEP_END, e.worker, e.version)

    def _z(self) -> float:
        if not self.cfg.step_noise:
            return 0.0
        if self.noise_pos == self.noise.size:
            self.noise = self.noise_rng.standard_normal(_NOISE_BLOCK)
            self.noise_pos = 0
        self.noise_pos += 1
        return float(self.noise[self.noise_pos - 1])

    # -- client and prefill --------------------------------------------------------------
    def arrive(self, r: int, t: float) -> None:
        cap = self.cfg.max_concurrency
        if cap is not None and self.in_flight >= cap:
            self.waiting.append(r)
        else:
            self.send(r, t)

    def send(self, r: int, t: float) -> None:
        self.in_flight += 1
        self.sent_at[r] = t
        free = self.prefill_free
        if self.cfg.prefill_routing == "round_robin":
            w = self.prefill_next % len(free)
            self.prefill_next += 1
        else:
            # Least loaded = the worker that frees up first (its queue drains soonest).
            w = min(range(len(free)), key=free.__getitem__)
        end = max(t, free[w]) + float(self.prefill_service[r])
        free[w] = end
        self._push(end, _PREFILL_END, r)

    def complete(self, r: int, t: float) -> None:
        self.done_at[r] = t
        self.in_flight -= 1
        if self.waiting:
            self.send(self.waiting.popleft(), t)

    # -- decode --------------------------------------------------------------------------
    def route(self, r: int, t: float) -> None:
        self.prefill_end[r] = t
        features, row = self.wl.features, self.wl.feature_rows[r]
        # The proxy's rule; the transform ran once per sampled row (``sim_workload``).
        inputs = routing_inputs(
            self.prefill_counts[self.wl.rows[r]],
            None if features is None else lambda counts: features[row],
        )
        views = self.views
        proxy = 0 if views is None else views.proxy_of(r)
        loads = self.loads if views is None else views.loads[proxy]
        policy = self.policy if views is None else views.policies[proxy]
        request = RoutingRequest(loads.copy(), self.eligible, inputs.features, inputs.counts)
        w = policy.choose(request)
        if not (0 <= w < self.cfg.num_decode):
            raise EldrError(f"policy {policy.name} chose worker {w} of {self.cfg.num_decode}")
        if views is None:
            policy.on_dispatch(w, request, r)
        self.loads[w] += 1
        self.load_spread[r] = self.loads.max() - self.loads.min()
        self.worker[r] = w
        if views is not None:
            views.dispatch(proxy, w, r, request)
            self._publish(t, DISPATCHED, r)
        self.at_decode(r, t)

    def _publish(self, t: float, what: int, r: int) -> None:
        """Tell the other proxies of request ``r``'s dispatch or completion at ``t``."""
        assert self.views is not None
        delay = self.cfg.publish_delay_s
        if delay == 0:
            # At once: through the heap, other events of this instant could come first.
            self.views.publish(what, int(self.worker[r]), r)
        else:
            self._push(t + delay, _PUBLISHED, r, what)

    def at_decode(self, r: int, t: float) -> None:
        w = int(self.worker[r])
        dec = self.decoders[w]
        if dec.busy:
            dec.pending.append(r)  # the scheduler sees it at the next step boundary
            return
        done = t + self.cfg.kv_transfer_s
        dec.loading.append((done, r))
        if done < dec.polling:
            dec.polling = done
            self._push(done, _KV_LOADED, w)

    def kv_loaded(self, w: int, t: float) -> None:
        dec = self.decoders[w]
        if dec.busy or t != dec.polling:
            return  # superseded: a step started meanwhile, or an earlier pull woke it
        dec.polling = float("inf")
        self._collect_loaded(dec, t)
        self.start_step(w, t)

    def _collect_loaded(self, dec: _Decoder, t: float) -> None:
        still = []
        for done, r in dec.loading:
            if done <= t:
                dec.queue.append(r)
            else:
                still.append((done, r))
        dec.loading = still

    def start_step(self, w: int, t: float) -> None:
        dec = self.decoders[w]
        for r in dec.pending:
            dec.loading.append((t + self.cfg.kv_transfer_s, r))
        dec.pending.clear()
        new_measured = 0
        joined = self.joined_now[w]
        joined.clear()
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
            if dec.loading:  # an idle engine polls its pulls and steps once one is done
                due = min(done for done, _ in dec.loading)
                dec.polling = due
                self._push(due, _KV_LOADED, w)
            return
        distinct = dec.union.draw(self._z())
        c = self.work
        work = self.step_fixed + c.per_token_s * dec.batch + c.per_expert_s * distinct
        log = self.steps
        log.start.append(t)
        log.end.append(np.nan)
        log.batch.append(dec.batch)
        log.measured.append(dec.measured_in_batch)
        log.measured_new.append(new_measured)
        log.joined.append(len(joined))
        log.distinct.append(distinct)
        self.step_start[w] = len(log.start) - 1
        dec.busy = True
        dec.polling = float("inf")
        self._push_ends(self.cores.begin(w, t, work))

    def step_end(self, w: int, t: float, version: int) -> None:
        if not self.cores.current(StepEnd(w, t, version)):
            return  # rescheduled: a neighbour on its core started or stopped meanwhile
        self._push_ends(self.cores.end(w, t))
        dec = self.decoders[w]
        self.steps.end[self.step_start[w]] = t
        for r in self.joined_now[w]:
            self.first_step_end[r] = t
        dec.steps_done += 1
        while dec.finish and dec.finish[0][0] == dec.steps_done:
            _, r = heapq.heappop(dec.finish)
            dec.union.remove(self.log_miss.pop(r))
            dec.batch -= 1
            if self.measured[r]:
                dec.measured_in_batch -= 1
            self.loads[w] -= 1
            if self.views is None:
                self.policy.on_complete(w, r)
            else:
                self.views.complete(self.views.proxy_of(r), w, r)
                self._publish(t, COMPLETED, r)
            self.complete(r, t)
        dec.busy = False
        self._collect_loaded(dec, t)  # pulls the step's end reports done join now
        self.start_step(w, t)

    def run(self) -> _Outcome:
        arrivals = self.wl.arrival_s.tolist()
        i, n = 0, len(arrivals)
        events = self.events
        while i < n or events:
            if i < n and (not events or arrivals[i] <= events[0][0]):
                self.arrive(i, arrivals[i])
                i += 1
                continue
            t, _, kind, who, version = heapq.heappop(events)
            if kind == _STEP_END:
                self.step_end(who, t, version)
            elif kind == _PREFILL_END:
                self.route(who, t)
            elif kind == _KV_LOADED:
                self.kv_loaded(who, t)
            else:
                assert self.views is not None  # published only with several proxies
                # A publication carries what happened (dispatched or completed) as its version.
                self.views.publish(version, int(self.worker[who]), who)
        if np.isnan(self.done_at).any():
            raise AssertionError("simulation ended with unfinished requests")
        return self.outcome()

    def outcome(self) -> _Outcome:
        cfg, wl, m = self.cfg, self.wl, self.measured
        log = self.steps
        duration = np.asarray(log.end) - np.asarray(log.start)
        measured_steps = np.asarray(log.measured) - np.asarray(log.measured_new)
        itl = np.repeat(duration, measured_steps)
        if cfg.first_token_from_prefill:
            first = self.prefill_end
            itl = np.concatenate([itl, (self.first_step_end - self.prefill_end)[m]])
        else:
            first = self.first_step_end
        table = RequestTable(
            success=np.ones(int(m.sum()), dtype=bool),
            prompt_tokens=wl.prompt_tokens[m],
            output_tokens=wl.output_tokens[m],
            ttft_s=(first - self.sent_at)[m],
            latency_s=(self.done_at - self.sent_at)[m],
            itl_s=itl,
        )
        window = float(self.done_at[m].max()) - cfg.warmup_s
        # Ends before sends at equal times: a slot freed is taken by the next request then.
        events = sorted([(t, 1) for t in self.sent_at] + [(t, -1) for t in self.done_at])
        peak = int(np.max(np.cumsum([step for _, step in events])))
        return _Outcome(table, window, log, cfg.warmup_s, peak, self.load_spread[m])


def _policy_result(name: str, outcomes: Sequence[_Outcome], num_layers: int) -> PolicyResult:
    """One policy's figures over its segments, as the load generator pools its rounds."""
    tables = [o.table for o in outcomes]
    table = RequestTable(
        success=np.concatenate([t.success for t in tables]),
        prompt_tokens=np.concatenate([t.prompt_tokens for t in tables]),
        output_tokens=np.concatenate([t.output_tokens for t in tables]),
        ttft_s=np.concatenate([t.ttft_s for t in tables]),
        latency_s=np.concatenate([t.latency_s for t in tables]),
        itl_s=np.concatenate([t.itl_s for t in tables]),
    )
    metrics = summarize(table, sum(o.window_s for o in outcomes))
    metrics["max_concurrent_requests"] = max(o.max_in_flight for o in outcomes)

    def pooled(attr: str, decode_only: bool) -> np.ndarray:
        parts = []
        for o in outcomes:
            values = np.asarray(getattr(o.steps, attr), dtype=np.float64)
            keep = np.asarray(o.steps.start) >= o.warmup_s
            if decode_only:
                keep &= np.asarray(o.steps.joined) == 0
            parts.append(values[keep])
        return np.concatenate(parts)

    # As the workers' counters: decode steps that started after the warm-up, and of those
    # the decode-only ones (no request joining) for experts and step time.
    batch = pooled("batch", False)
    distinct = pooled("distinct", True)
    seconds = pooled("end", True) - pooled("start", True)
    steps = int(distinct.size)
    nan = float("nan")
    metrics |= {
        "decode_steps": steps,
        "active_experts_per_step": float(distinct.mean()) if steps else nan,
        "distinct_experts_per_layer": float(distinct.mean()) / num_layers if steps else nan,
        "mean_decode_step_ms": 1000.0 * float(seconds.mean()) if steps else nan,
        "mean_decode_batch": float(batch.mean()) if batch.size else nan,
        "mean_decode_load_spread": float(np.mean(np.concatenate(
            [o.load_spread for o in outcomes]))),
    }
    return PolicyResult(name, metrics, table, round_sizes=tuple(len(t) for t in tables))


def _check_inputs(config: SimConfig, arrays: SignatureArrays, artifact: object | None) -> None:
    num_layers = arrays.decode_counts.shape[1]
    if config.cost.num_layers != num_layers:
        raise EldrError(
            f"cost model is for {config.cost.num_layers} MoE layers, the dataset has"
            f" {num_layers}; fit or choose a cost model for this model"
        )
    needs = [p for p in config.policies if POLICIES[p].needs_centroids]
    if needs and artifact is None:
        raise EldrError(f"policy {needs[0]!r} needs a fitted artifact (eldr fit) to simulate")


def _proxy_policies(name: str, context: RoutingContext, config: SimConfig) -> (
    list[DecodePolicy]
):
    """Policy ``name`` for each proxy, as the proxy's policy switch builds it, each on its own
    seed (the first on the segment's)."""
    options = config.policy_config.overrides(name)
    seeds = proxy_seeds(context.seed, config.proxies)
    contexts = [context] + [replace(context, seed=s) for s in seeds[1:]]
    return [make_policy(name, c, options) for c in contexts]


def simulate_segments(
    config: SimConfig,
    arrays: SignatureArrays,
    artifact: RoutingArtifact | None,
    segments: Mapping[str, Sequence[Workload]],
    *,
    top_k: int,
) -> dict[str, PolicyResult]:
    """Each policy over its own segments, each from an idle cluster with a freshly built
    policy (as the proxy's policy switch builds one); ``segments`` is keyed by the policies of
    ``config.policies``, whose ``arrays`` rows the workloads index (already blended for the
    locality dial, if any)."""
    _check_inputs(config, arrays, artifact)
    if top_k < 1:
        raise EldrError(f"top_k must be >= 1, got {top_k}")
    missing = [p for p in config.policies if not segments.get(p)]
    if missing:
        raise EldrError(f"no requests to simulate for policy {missing[0]!r}")
    centroids = None if artifact is None else np.asarray(artifact.centroids, dtype=np.float32)
    profiles = DecodeProfiles(arrays.decode_counts, arrays.prefill_counts, top_k)
    num_layers = arrays.decode_counts.shape[1]
    results: dict[str, PolicyResult] = {}
    for name in config.policies:
        context = RoutingContext(
            config.num_decode,
            seed=config.seed,
            centroids=centroids if POLICIES[name].needs_centroids else None,
            worker_slots=config.max_batch,
            top_k=top_k,
            cost=config.cost if config.policies_know_cost else None,
        )
        noise = np.random.default_rng([config.seed, 2])
        outcomes = []
        for workload in segments[name]:
            if not (workload.arrival_s >= config.warmup_s).any():
                raise EldrError(
                    "no request arrives after the warm-up; raise the rate or the duration"
                )
            seeded = context if workload.policy_seed is None else replace(
                context, seed=workload.policy_seed
            )
            policies = _proxy_policies(name, seeded, config)
            run = _Segment(config, arrays, workload, profiles, policies, top_k, noise)
            outcomes.append(run.run())
        results[name] = _policy_result(name, outcomes, num_layers)
    return results


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
    workload = build_workload(
        arrays,
        request_rate=config.request_rate,
        duration_s=config.duration_s,
        output_tokens=config.output_tokens,
        max_output_tokens=config.max_output_tokens,
        seed=config.seed,
        artifact=artifact,
    )
    arrays, workload = blend_requests(arrays, workload, config.locality_blend, config.seed,
                                      top_k, config.output_tokens, config.max_output_tokens)
    if not (workload.arrival_s >= config.warmup_s).any():
        raise EldrError("no request arrives after the warm-up; raise the rate or the duration")
    segments = {name: [workload] for name in config.policies}
    return simulate_segments(config, arrays, artifact, segments, top_k=top_k)


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
