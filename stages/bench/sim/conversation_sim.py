"""Traffic with history on a simulated PD cluster: each worker's prefix cache, the KV a decode
worker pulls, and conversations whose next turn waits for the last answer.

Per turn: it arrives (a conversation's first turn at its Poisson start, turn k+1 the think
time after turn k's last token) -> a prefill worker is chosen: by the policy's
``choose_prefill`` (a KV-aware policy's: each worker's queue and the prompt tokens its cache
lacks), or where it has none or answers None, by the proxy's own prefix-hash ring
(``PrefillRouter``, on the prompt's first 1,024 bytes: here its first 256 token ids as int32)
-> the prefill runs FIFO, ``prefill_base_s + per token x
uncached tokens`` (its cache's hit counted when it is queued), and its prompt's blocks enter
that worker's cache -> the decode policy chooses a decode worker from the loads, the
signature, the prompt's length and the tokens each decode worker holds as a cached prefix ->
the decode worker pulls the tokens it lacks (``kv_transfer_base_s + kv_transfer_per_token_s x
pulled``) -> it joins the batch at the next step (continuous batching, ``max_batch``), a step
costs the cost model's time for its batch and the distinct experts the batch activates
(``ExpertUnion``, as ``simulator``) -> at its last token the prompt's and answer's blocks enter
the decode worker's cache, and the conversation's next turn is scheduled.

Caches are LRUs of block hashes (``prefix_cache``); every policy starts from empty caches on
the same conversations. TTFT is arrival to the end of the first decode step (the proxy
discards the prefill's token); TPOT = (last - first token) / (output - 1).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from stages.bench.metrics import RequestTable, summarize
from stages.bench.sim.conversation_workload import SimConversationSpec, SimTurns, build_turns
from stages.bench.sim.expert_union import DecodeProfiles, ExpertUnion
from stages.bench.sim.prefix_cache import PrefixCache
from stages.bench.turn_metrics import share, ttft_by_turn
from stages.bench.workloads.blocks import block_hashes
from stages.bench.workloads.ideal_hits import SentTurn, ideal_hits
from stages.errors import EldrError
from stages.routing.context import RoutingContext
from stages.routing.cost_model import CostModel
from stages.routing.inputs import routing_inputs
from stages.routing.policies import (
    POLICIES,
    DecodePolicy,
    PrefillRequest,
    RoutingRequest,
    make_policy,
)
from stages.routing.policy_config import PolicyConfig
from stages.signature.dataset import SignatureArrays

_ARRIVE, _PREFILL_END, _KV_DONE, _STEP_END = 0, 1, 2, 3
PREFIX_HASH_TOKENS = 256  # the proxy hashes 1,024 bytes; 4 bytes a token id here


@dataclass(frozen=True)
class ConversationSimConfig:
    cost: CostModel
    workload: SimConversationSpec = field(default_factory=SimConversationSpec)
    num_prefill: int = 8
    num_decode: int = 16
    policies: tuple[str, ...] = ("eldr-kv", "eldr-union", "rr", "jsq", "random", "p2c")
    block_size: int = 16  # vLLM's GPU default
    prefill_cache_blocks: int = 8192  # per worker
    decode_cache_blocks: int = 8192
    max_batch: int = 128
    kv_transfer_base_s: float = 0.002  # a pull's fixed cost (NIXL handshake, notification)
    # Decode chosen at arrival: the share of the uncached tail's routing the token predictor
    # gets right (``_ArrivalCounts``); 0: it knows only the mean token's routing.
    arrival_tail_quality: float = 0.0
    seed: int = 0
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise EldrError("need at least one prefill and one decode worker")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown:
            raise EldrError(f"unknown policy {unknown[0]!r}; choose from {sorted(POLICIES)}")
        if not self.policies:
            raise EldrError("give at least one policy")
        for name in ("block_size", "prefill_cache_blocks", "decode_cache_blocks", "max_batch"):
            if getattr(self, name) < 1:
                raise EldrError(f"{name.replace('_', ' ')} must be >= 1, got"
                                f" {getattr(self, name)}")
        if self.kv_transfer_base_s < 0:
            raise EldrError("KV transfer time must be >= 0")
        if not 0.0 <= self.arrival_tail_quality <= 1.0:
            raise EldrError(f"arrival tail quality must be in [0, 1], got"
                            f" {self.arrival_tail_quality}")


@dataclass
class _Decoder:
    cache: PrefixCache
    union: ExpertUnion
    queue: deque[int] = field(default_factory=deque)  # KV here, waiting for a step
    finish: list[tuple[int, int]] = field(default_factory=list)  # (last step, turn)
    joined: list[int] = field(default_factory=list)  # in the step now running
    steps_done: int = 0
    batch: int = 0
    busy: bool = False
    stall_s: float = 0.0  # local prefill its next step also computes
    distinct_sum: float = 0.0  # distinct experts summed over its steps so far


@dataclass(frozen=True)
class ConversationOutcome:
    """One policy's run: per turn times and cache figures, and its decode steps."""

    arrival: np.ndarray
    first_token: np.ndarray
    done: np.ndarray
    prefill_cached: np.ndarray  # prompt tokens the chosen prefill worker held
    prefill_worker: np.ndarray  # int64: the prefill worker of each turn
    decode_pulled: np.ndarray  # prompt tokens the chosen decode worker pulled
    step_distinct: np.ndarray  # distinct experts (summed over layers) per decode step
    # Per turn: the mean over its decode steps of the distinct experts (summed over layers)
    # of the batch it ran in: what its decode worker's choice gave the turns it ran with.
    turn_distinct: np.ndarray
    # Per turn, at its arrival: the requests in flight on the decode worker holding the most
    # of its prompt (0: that worker is idle, so prefilling there stalls no one).
    holder_load: np.ndarray
    # Per turn: when its prefill worker finished (NaN: prefilled on its decode worker) and
    # when its decode worker had its KV (pulled, or prefilled there): TTFT's parts.
    prefill_done: np.ndarray
    kv_ready: np.ndarray


class _Run:
    def __init__(self, config: ConversationSimConfig, turns: SimTurns, hashes: list[list[int]],
                 answer_hashes: list[list[int]], arrays: SignatureArrays,
                 profiles: DecodeProfiles, policy: DecodePolicy, top_k: int,
                 transform: Callable[[np.ndarray], np.ndarray] | None) -> None:
        from stages.routing.prefill_router import PrefillRouter

        self.cfg, self.turns, self.policy = config, turns, policy
        # A policy that routes prefill too (KV-aware) has its own choice; the others (no
        # ``choose_prefill``, or one that answers None) get the proxy's prefix-hash ring.
        self.choose_prefill: Callable[[PrefillRequest], int | None] | None = getattr(
            policy, "choose_prefill", None)
        self.hashes, self.answer_hashes = hashes, answer_hashes
        self.arrays, self.profiles, self.transform = arrays, profiles, transform
        self.ring = PrefillRouter([f"prefill-{i}" for i in range(config.num_prefill)])
        num_layers, num_experts = arrays.decode_counts.shape[1:]
        self.prefill_caches = [PrefixCache(config.prefill_cache_blocks)
                               for _ in range(config.num_prefill)]
        self.decoders = [_Decoder(PrefixCache(config.decode_cache_blocks),
                                  ExpertUnion(num_layers * num_experts, num_layers * top_k))
                         for _ in range(config.num_decode)]
        self.prefill_free = np.zeros(config.num_prefill)
        self.prefill_loads = np.zeros(config.num_prefill, dtype=np.int64)
        self.prefill_queued = np.zeros(config.num_prefill, dtype=np.int64)
        self.prefill_of = np.full(len(turns), -1, dtype=np.int64)
        self.decode_loads = np.zeros(config.num_decode, dtype=np.int64)
        self.prefill_eligible = np.ones(config.num_prefill, dtype=bool)
        self.decode_eligible = np.ones(config.num_decode, dtype=bool)
        n = len(turns)
        self.arrival = np.full(n, np.nan)
        self.first = np.full(n, np.nan)
        self.done = np.full(n, np.nan)
        self.prefill_done = np.full(n, np.nan)
        self.kv_ready = np.full(n, np.nan)
        self.cached = np.zeros(n, dtype=np.int64)
        self.pulled = np.zeros(n, dtype=np.int64)
        self.worker = np.full(n, -1, dtype=np.int64)
        self.log_miss: dict[int, np.ndarray] = {}
        self.turn_distinct = np.full(n, np.nan)
        self.holder_load = np.zeros(n, dtype=np.int64)
        self.arrival_counts = (_ArrivalCounts(arrays, turns, config.arrival_tail_quality)
                               if policy.decodes_at_arrival else None)
        self.distinct: list[float] = []
        self.events: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.noise = np.random.default_rng([config.seed, 2])
        c = config.cost.on_own_core()
        self.work = c
        self.step_fixed = c.base_s + c.num_layers * c.moe_fixed_s

    def _push(self, t: float, kind: int, who: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, who))

    def _cached_tokens(self, caches: Sequence[PrefixCache], r: int) -> np.ndarray:
        size, bs = len(self.turns.prompts[r]), self.cfg.block_size
        return np.array([c.cached_blocks(self.hashes[r], size, bs) * bs for c in caches],
                        dtype=np.int64)

    # -- prefill ---------------------------------------------------------------------
    def arrive(self, r: int, t: float) -> None:
        self.arrival[r] = t
        prompt = self.turns.prompts[r]
        held = self._cached_tokens([d.cache for d in self.decoders], r)
        self.holder_load[r] = self.decode_loads[int(np.argmax(held))]
        cached = self._cached_tokens(self.prefill_caches, r)
        prefill = PrefillRequest(self.prefill_loads.copy(), self.prefill_eligible,
                                 int(prompt.size), cached, self.prefill_queued.copy())
        at_arrival = self.arrival_request(r) if self.arrival_counts is not None else None
        if self.local(r, t, prefill, at_arrival):
            return
        if at_arrival is not None:
            self.dispatch_decode(r, at_arrival)
        chosen = None
        if self.choose_prefill is not None:
            chosen = self.choose_prefill(prefill)
        if chosen is None:
            key = prompt[:PREFIX_HASH_TOKENS].astype(np.int32).tobytes()
            chosen = self.ring.choose(key, self.prefill_loads, self.prefill_eligible)
        w = int(chosen)
        if not 0 <= w < self.cfg.num_prefill:
            raise EldrError(f"policy {self.policy.name} chose prefill worker {w}")
        uncached = int(prompt.size - cached[w])
        self.cached[r] = cached[w]
        self.prefill_of[r] = w
        self.prefill_loads[w] += 1
        self.prefill_queued[w] += uncached
        end = max(t, float(self.prefill_free[w])) + float(self.cfg.cost.prefill_time(uncached))
        self.prefill_free[w] = end
        self._push(end, _PREFILL_END, r)

    def arrival_request(self, r: int) -> RoutingRequest:
        """The decode request at arrival: loads, the KV each decode worker holds and the
        signature at arrival (``_ArrivalCounts``)."""
        # The expert events of every worker, prefill and decode, feed one index.
        caches = [*self.prefill_caches, *(d.cache for d in self.decoders)]
        known = int(self._cached_tokens(caches, r).max())
        counts = self.arrival_counts(r, known)  # type: ignore[misc]
        inputs = routing_inputs(counts, self.transform)
        return RoutingRequest(self.decode_loads.copy(), self.decode_eligible, inputs.features,
                              inputs.counts, prompt_tokens=int(self.turns.prompts[r].size),
                              cached_tokens=self._cached_tokens([d.cache for d in self.decoders],
                                                                r),
                              output_tokens=int(self.turns.answers[r].size))

    def local(self, r: int, t: float, prefill: PrefillRequest,
              at_arrival: RoutingRequest | None) -> bool:
        """Conditional disaggregation: the policy's decode worker prefills the turn itself
        (``choose_local``): its next step also computes the tokens it lacks, which holds up
        the batch beside it for that long; no prefill worker, no pull. ``at_arrival``: the
        decode request with its signature at arrival, when the policy chooses decode then."""
        if not self.policy.prefills_locally:
            return False
        prompt_tokens = int(self.turns.prompts[r].size)
        request = at_arrival
        if request is None:
            request = RoutingRequest(
                self.decode_loads.copy(), self.decode_eligible, prompt_tokens=prompt_tokens,
                cached_tokens=self._cached_tokens([d.cache for d in self.decoders], r),
                output_tokens=int(self.turns.answers[r].size))
        w = self.policy.choose_local(request, prefill)
        if w is None:
            return False
        self.policy.on_dispatch(int(w), request, r)
        self.decode_loads[w] += 1
        self.worker[r] = w
        dec = self.decoders[w]
        cached = request.cached_tokens
        assert cached is not None
        dec.stall_s += self.cfg.cost.prefill_per_token_s * (prompt_tokens - int(cached[w]))
        self.kv_ready[r] = t
        dec.queue.append(r)
        if not dec.busy:
            self.start_step(w, t)
        return True

    def prefill_end(self, r: int, t: float) -> None:
        self.prefill_done[r] = t
        w = int(self.prefill_of[r])
        self.prefill_loads[w] -= 1
        self.prefill_queued[w] -= int(self.turns.prompts[r].size - self.cached[r])
        self.prefill_caches[w].insert(self.hashes[r])
        if self.worker[r] >= 0:  # chosen at arrival: the prefill's signature replaces its guess
            inputs = routing_inputs(self.arrays.prefill_counts[int(self.turns.row[r])],
                                    self.transform)
            self.policy.on_signature(int(self.worker[r]), RoutingRequest(
                self.decode_loads.copy(), self.decode_eligible, inputs.features, inputs.counts), r)
            self.pull(r, t)
        else:
            self.route_decode(r, t)

    # -- decode ----------------------------------------------------------------------
    def route_decode(self, r: int, t: float) -> None:
        row = int(self.turns.row[r])
        inputs = routing_inputs(self.arrays.prefill_counts[row], self.transform)
        prompt_tokens = int(self.turns.prompts[r].size)
        cached = self._cached_tokens([d.cache for d in self.decoders], r)
        request = RoutingRequest(self.decode_loads.copy(), self.decode_eligible, inputs.features,
                                 inputs.counts, prompt_tokens=prompt_tokens,
                                 cached_tokens=cached,
                                 output_tokens=int(self.turns.answers[r].size))
        self.dispatch_decode(r, request)
        self.pull(r, t)

    def dispatch_decode(self, r: int, request: RoutingRequest) -> None:
        w = int(self.policy.choose(request))
        if not 0 <= w < self.cfg.num_decode:
            raise EldrError(f"policy {self.policy.name} chose decode worker {w}")
        self.policy.on_dispatch(w, request, r)
        self.decode_loads[w] += 1
        self.worker[r] = w

    def pull(self, r: int, t: float) -> None:
        """The decode worker pulls the prompt tokens it lacks now (its cache may have moved
        since it was chosen at arrival)."""
        w = int(self.worker[r])
        pulled = int(self.turns.prompts[r].size) - int(self._cached_tokens(
            [self.decoders[w].cache], r)[0])
        self.pulled[r] = pulled
        pull_s = self.cfg.kv_transfer_base_s + self.cfg.cost.kv_transfer_per_token_s * pulled
        self._push(t + pull_s, _KV_DONE, r)

    def kv_done(self, r: int, t: float) -> None:
        self.kv_ready[r] = t
        w = int(self.worker[r])
        dec = self.decoders[w]
        dec.queue.append(r)
        if not dec.busy:
            self.start_step(w, t)

    def start_step(self, w: int, t: float) -> None:
        dec = self.decoders[w]
        dec.joined.clear()
        while dec.queue and dec.batch < self.cfg.max_batch:
            r = dec.queue.popleft()
            lm = self.profiles.log_complement(int(self.turns.row[r]))
            self.turn_distinct[r] = -dec.distinct_sum  # its steps' sum, completed at its end
            self.log_miss[r] = lm
            dec.union.add(lm)
            dec.batch += 1
            heapq.heappush(dec.finish, (dec.steps_done + int(self.turns.answers[r].size), r))
            dec.joined.append(r)
        if dec.batch == 0:
            dec.busy = False
            return
        distinct = dec.union.draw(float(self.noise.standard_normal()))
        self.distinct.append(distinct)
        dec.distinct_sum += distinct
        c = self.work
        dec.busy = True
        stall, dec.stall_s = dec.stall_s, 0.0
        self._push(t + stall + self.step_fixed + c.per_token_s * dec.batch
                   + c.per_expert_s * distinct, _STEP_END, w)

    def step_end(self, w: int, t: float) -> None:
        dec = self.decoders[w]
        for r in dec.joined:
            self.first[r] = t
        dec.steps_done += 1
        while dec.finish and dec.finish[0][0] == dec.steps_done:
            _, r = heapq.heappop(dec.finish)
            dec.union.remove(self.log_miss.pop(r))
            dec.batch -= 1
            self.decode_loads[w] -= 1
            self.policy.on_complete(w, r)
            self.done[r] = t
            self.turn_distinct[r] = (self.turn_distinct[r] + dec.distinct_sum) / max(
                int(self.turns.answers[r].size), 1)
            dec.cache.insert(self.answer_hashes[r])
            nxt = r + 1
            if nxt < len(self.turns) and self.turns.conversation[nxt] == self.turns.conversation[r]:
                self._push(t + self.cfg.workload.think_time_s, _ARRIVE, nxt)
        dec.busy = False
        self.start_step(w, t)

    def run(self) -> ConversationOutcome:
        turns = self.turns
        firsts = np.flatnonzero(turns.turn == 1)
        for c, r in enumerate(firsts):
            self._push(float(turns.start_s[c]), _ARRIVE, int(r))
        handlers = {_ARRIVE: self.arrive, _PREFILL_END: self.prefill_end,
                    _KV_DONE: self.kv_done, _STEP_END: self.step_end}
        while self.events:
            t, _, kind, who = heapq.heappop(self.events)
            handlers[kind](who, t)
        if np.isnan(self.done).any():
            raise AssertionError("simulation ended with unfinished turns")
        return ConversationOutcome(self.arrival, self.first, self.done, self.cached,
                                   self.prefill_of, self.pulled, np.asarray(self.distinct),
                                   self.turn_distinct, self.holder_load, self.prefill_done,
                                   self.kv_ready)


class _ArrivalCounts:
    """A turn's signature at arrival as the simulator models it.

    The simulator gives a conversation one signature row for all its turns and its token ids
    carry no routing, so: the cached prefix's exact counts (``stages.routing.arrival_signature``
    sums the blocks' expert events) are modelled as the cached share of the turn's prefill
    counts (a conversation routes alike along its prompt), and the uncached tail as a token
    predictor that gets ``quality`` of it right: that share of the tail's true counts, the
    rest the dataset's mean routing per token. ``quality`` 0 is a predictor with no
    token-specific offsets, the worst case; ``eldr fit`` prints how much of the gain a
    predictor fit on real prompts keeps.
    """

    def __init__(self, arrays: SignatureArrays, turns: SimTurns, quality: float) -> None:
        prefill = np.asarray(arrays.prefill_counts, dtype=np.float64)
        total = prefill.sum(axis=0)
        self.mean_share = total / max(float(total.sum()), 1.0)  # [L, E], sums to 1
        self.prefill, self.turns, self.quality = prefill, turns, quality

    def __call__(self, r: int, cached_tokens: int) -> np.ndarray:
        counts = self.prefill[int(self.turns.row[r])]
        cached = cached_tokens / max(int(self.turns.prompts[r].size), 1)
        guess = (1.0 - self.quality) * float(counts.sum()) * self.mean_share
        tail = (1.0 - cached) * (self.quality * counts + guess)
        return np.rint(cached * counts + tail).astype(np.int32)


def _metrics(outcome: ConversationOutcome, turns: SimTurns, ideal_share: float,
             num_layers: int, num_prefill: int) -> dict[str, object]:
    n = len(turns)
    prompt = np.array([p.size for p in turns.prompts], dtype=np.int64)
    output = np.array([a.size for a in turns.answers], dtype=np.int64)
    table = RequestTable(np.ones(n, dtype=bool), prompt, output,
                         outcome.first_token - outcome.arrival, outcome.done - outcome.arrival)
    duration = float(np.nanmax(outcome.done) - np.nanmin(outcome.arrival))
    metrics: dict[str, object] = dict(summarize(table, duration))
    metrics |= ttft_by_turn(table.ttft_s, turns.turn, table.success)
    # One run: no rounds to spread over.
    metrics["ttft_later_round_spread_ms"] = metrics["tpot_round_spread_ms"] = float("nan")
    total_prompt = float(prompt.sum())
    # What the prefill workers' counters see: the turns they prefilled (not the ones a decode
    # worker prefilled itself, ``choose_local``).
    remote = outcome.prefill_worker >= 0
    metrics["prefill_hit_share"] = share(float(outcome.prefill_cached[remote].sum()),
                                         float(prompt[remote].sum()))
    # Prompt tokens that reached no prefill worker (as the live bench counts them).
    metrics["local_prefill_share"] = share(float(prompt[~remote].sum()), total_prompt)
    cached = np.bincount(outcome.prefill_worker[remote], outcome.prefill_cached[remote],
                         num_prefill)
    queried = np.bincount(outcome.prefill_worker[remote], prompt[remote], num_prefill)
    metrics["prefill_hit_share_by_worker"] = [share(float(c), float(q))
                                              for c, q in zip(cached, queried, strict=True)]
    metrics["decode_kv_pulled_tokens"] = float(outcome.decode_pulled.sum())
    metrics["decode_hit_share"] = 1.0 - share(float(outcome.decode_pulled.sum()), total_prompt)
    metrics["ideal_prefill_hit_share"] = ideal_share
    metrics["prefill_hit_of_ideal"] = (float(metrics["prefill_hit_share"]) / ideal_share  # type: ignore[arg-type]
                                       if ideal_share > 0 else float("nan"))
    metrics |= ttft_parts(outcome, turns)
    steps = outcome.step_distinct
    metrics["distinct_experts_per_layer"] = (float(steps.mean()) / num_layers if steps.size
                                             else float("nan"))
    return metrics


def ttft_parts(outcome: ConversationOutcome, turns: SimTurns) -> dict[str, float]:
    """Later turns' mean TTFT on the PD path, and its parts: arrival to the prefill's end
    (queue and compute), the decode worker's KV pull, and from then to the first token (the
    running step it waits out and its own first step). Means, so the parts add up."""
    pd = (turns.turn >= 2) & (outcome.prefill_worker >= 0)
    if not pd.any():
        return {}
    arrival, prefill, ready = outcome.arrival[pd], outcome.prefill_done[pd], outcome.kv_ready[pd]
    first = outcome.first_token[pd]
    return {"sim_ttft_later_pd_ms": 1e3 * float(np.mean(first - arrival)),
            "sim_ttft_prefill_ms": 1e3 * float(np.mean(prefill - arrival)),
            "sim_ttft_pull_ms": 1e3 * float(np.mean(ready - prefill)),
            "sim_ttft_first_step_ms": 1e3 * float(np.mean(first - ready))}


def simulate_outcomes(config: ConversationSimConfig, arrays: SignatureArrays, top_k: int,
                      artifact: object | None = None
                      ) -> tuple[SimTurns, dict[str, ConversationOutcome], float]:
    """Every policy on the same conversations, each from empty caches and an idle cluster:
    the turns, each policy's outcome, and the workload's ideal prefill hit share."""
    needs = [p for p in config.policies if POLICIES[p].needs_centroids]
    if needs and artifact is None:
        raise EldrError(f"policy {needs[0]!r} needs a fitted artifact to simulate")
    num_layers = arrays.decode_counts.shape[1]
    if config.cost.num_layers != num_layers:
        raise EldrError(f"cost model is for {config.cost.num_layers} MoE layers, the dataset"
                        f" has {num_layers}")
    turns = build_turns(config.workload, len(arrays))
    bs = config.block_size
    hashes = [block_hashes(p.tolist(), bs) for p in turns.prompts]
    answer_hashes = [block_hashes(np.concatenate([p, a]).tolist(), bs)
                     for p, a in zip(turns.prompts, turns.answers, strict=True)]
    # Send order differs between policies only by timing; the ideal is the workload's, taken
    # in conversation-start order (a turn's history always precedes it either way).
    order = np.lexsort((turns.turn, turns.start_s[turns.conversation]))
    ideal = ideal_hits([SentTurn(tuple(turns.prompts[i].tolist()),
                                 tuple(turns.answers[i].tolist())) for i in order], bs)
    profiles = DecodeProfiles(arrays.decode_counts, arrays.prefill_counts, top_k)
    centroids = getattr(artifact, "centroids", None)
    transform = getattr(artifact, "transform", None)
    out = {}
    for name in config.policies:
        cls = POLICIES[name]
        context = RoutingContext(
            config.num_decode, seed=config.seed,
            centroids=np.asarray(centroids, dtype=np.float32) if cls.needs_centroids else None,
            worker_slots=config.max_batch, top_k=top_k, cost=config.cost)
        policy = make_policy(name, context, config.policy_config.overrides(name))
        apply = transform.apply if (transform is not None and cls.uses_signature) else None
        run = _Run(config, turns, hashes, answer_hashes, arrays, profiles, policy, top_k, apply)
        out[name] = run.run()
    return turns, out, ideal.prefill_share


def simulate_conversations(config: ConversationSimConfig, arrays: SignatureArrays, top_k: int,
                           artifact: object | None = None) -> dict[str, dict[str, object]]:
    """Each policy's figures (``CONVERSATION_METRICS`` and ``summarize``'s keys)."""
    turns, outcomes, ideal = simulate_outcomes(config, arrays, top_k, artifact)
    num_layers = arrays.decode_counts.shape[1]
    return {name: _metrics(o, turns, ideal, num_layers, config.num_prefill)
            for name, o in outcomes.items()}
