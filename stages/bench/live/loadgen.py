"""The load generator: every policy, the same prompts and arrival times, interleaved.

The sampled prompts (and their Poisson arrival offsets) are cut into ``rounds`` consecutive
slices. In round r every policy replays slice r from an idle cluster, in an order rotated by r,
after switching the proxy with ``POST /admin/policy`` (no restart); a ``router`` (any
OpenAI endpoint: vllm-router, another proxy) takes its turn as it is, with no admin call, so
one run benches eldr's policies and other routers on the same workers. Drift of the machine
(thermal state, a neighbour's load, cache warmth) thus lands on all policies alike, and no
policy always goes first. Expert activity is the delta of the decode workers' counters over
each policy's own windows.

``warmup_s`` excludes, in every slice, requests that arrive in its first seconds (and the
expert counts of that time), since each slice starts from an empty cluster.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from stages.bench.live.admin import ProxyAdmin, decode_worker_urls
from stages.bench.live.arrivals import poisson_arrivals
from stages.bench.live.client import CompletionSettings, stream_completion
from stages.bench.live.targets import Target
from stages.bench.live.worker_metrics import (
    ExpertStats,
    Scrape,
    expert_stats,
    scrape_decode_counters,
    total_expert_stats,
)
from stages.bench.metrics import (
    RequestRecord,
    RequestTable,
    max_concurrent_requests,
    max_output_tokens_per_s,
    summarize,
)
from stages.bench.results import ComparisonResult, PolicyResult, rate_label, save_comparison
from stages.errors import EldrError
from stages.prompts import Prompt, load_prompts, sample_prompts
from stages.routing.policy_config import PolicyConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    url: str  # the proxy
    policies: tuple[str, ...]
    prompts_path: Path
    num_prompts: int
    request_rate: float  # req/s; inf = all at once
    max_concurrency: int | None = None
    seed: int = 0
    result_dir: Path | None = None  # None: do not save
    max_tokens: int = 512
    model: str | None = None
    rounds: int = 3
    warmup_s: float = 0.0
    decode_urls: tuple[str, ...] | None = None  # None: from the proxy's /admin/state
    num_layers: int | None = None  # MoE layers, to report distinct experts per layer
    request_timeout_s: float = 600.0
    scrape_settle_s: float = 1.0  # let workers publish their last steps before reading
    show_progress: bool = True
    # Options sent with each switch to a policy it names (the proxy keeps them afterwards).
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    # Other OpenAI endpoints benched beside the policies, each as it is (``--router``).
    routers: tuple[Target, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every row of the comparison: the proxy's policies, then the routers."""
        return self.policies + tuple(r.name for r in self.routers)

    def url_of(self, name: str) -> str:
        return next((r.url for r in self.routers if r.name == name), self.url)

    def __post_init__(self) -> None:
        if not self.names:
            raise EldrError("give at least one policy or --router")
        if len(set(self.names)) != len(self.names):
            raise EldrError(f"policy or router listed twice: {', '.join(self.names)}")
        if self.num_prompts < 1:
            raise EldrError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.rounds < 1:
            raise EldrError(f"rounds must be >= 1, got {self.rounds}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise EldrError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_tokens < 1:
            raise EldrError(f"max tokens must be >= 1, got {self.max_tokens}")
        if self.warmup_s < 0:
            raise EldrError(f"warm-up must be >= 0 s, got {self.warmup_s}")


@dataclass(frozen=True)
class Segment:
    """One policy replaying one slice ``[start, stop)`` of the prompts."""

    round: int
    policy: str
    start: int
    stop: int
    # The policy's seed (random ties and draws) in this round: a round each, so the rounds of
    # a random policy are independent draws, not one choice sequence three times.
    policy_seed: int = 0


def interleaved_plan(
    num_prompts: int, policies: Sequence[str], rounds: int, seed: int = 0
) -> list[Segment]:
    """Round r runs every policy on slice r, starting with policy r mod P, with policy seed
    ``seed + r``."""
    rounds = max(1, min(rounds, num_prompts))
    bounds = np.linspace(0, num_prompts, rounds + 1).round().astype(int)
    plan = []
    for r in range(rounds):
        order = [policies[(r + i) % len(policies)] for i in range(len(policies))]
        plan += [Segment(r, p, int(bounds[r]), int(bounds[r + 1]), seed + r) for p in order]
    return plan


@dataclass(frozen=True)
class _SegmentOutcome:
    records: list[RequestRecord]  # measured requests only (after warm-up)
    duration_s: float
    experts: ExpertStats | None
    # vLLM's peak figures, per round: rounds run one after another, never side by side.
    peak_output_tokens_per_s: float = 0.0
    peak_concurrent_requests: int = 0


class _Runner:
    """State of one comparison run: the HTTP client, the prompts, the progress bar."""

    def __init__(
        self,
        config: BenchConfig,
        client: httpx.AsyncClient,
        prompts: list[Prompt],
        offsets: np.ndarray,
        worker_urls: tuple[str, ...],
        progress: tqdm,
    ) -> None:
        self.config = config
        self.client = client
        self.prompts = prompts
        self.offsets = offsets
        self.worker_urls = worker_urls
        self.progress = progress
        self.settings = CompletionSettings(
            max_tokens=config.max_tokens, model=config.model, timeout_s=config.request_timeout_s
        )

    async def _scrape(self) -> Scrape | None:
        if not self.worker_urls:
            return None
        return await scrape_decode_counters(self.client, self.worker_urls)

    async def run_segment(self, seg: Segment) -> _SegmentOutcome:
        cfg = self.config
        offsets = self.offsets[seg.start : seg.stop] - self.offsets[seg.start]
        measured = offsets >= cfg.warmup_s
        if not measured.any():
            raise EldrError(
                f"warm-up of {cfg.warmup_s} s covers every request of round {seg.round};"
                " use fewer rounds, more prompts or a shorter warm-up"
            )
        semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        tag = f"{rate_label(cfg.request_rate)}-{seg.round}-{seg.policy}"
        before: Scrape | None = None
        before_task: asyncio.Task[Scrape | None] | None = None
        if cfg.warmup_s == 0:
            before = await self._scrape()
        origin = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            await asyncio.sleep(max(0.0, origin + offsets[i] - time.perf_counter()))
            prompt = self.prompts[seg.start + i]
            call = stream_completion(
                self.client,
                cfg.url_of(seg.policy),
                prompt.prompt,
                self.settings,
                request_id=f"bench-{tag}-{seg.start + i}",
                origin=origin,
                prompt_id=prompt.id,
                domain=prompt.domain,
            )
            if semaphore is None:
                record = await call
            else:
                async with semaphore:
                    record = await call
            self.progress.update(1)
            return replace(record, queue_s=max(0.0, record.start_s - offsets[i]))

        async def scrape_after_warmup() -> Scrape | None:
            await asyncio.sleep(max(0.0, origin + cfg.warmup_s - time.perf_counter()))
            return await self._scrape()

        if cfg.warmup_s > 0:
            before_task = asyncio.create_task(scrape_after_warmup())
        records = await asyncio.gather(*(one(i) for i in range(len(offsets))))
        end = time.perf_counter()
        if before_task is not None:
            before = await before_task
        await asyncio.sleep(cfg.scrape_settle_s)
        after = await self._scrape()
        experts = None
        if before is not None and after is not None:
            experts = expert_stats(before, after, cfg.num_layers)
        kept = [r for r, keep in zip(records, measured, strict=True) if keep]
        return _SegmentOutcome(
            kept, end - origin - cfg.warmup_s, experts,
            max_output_tokens_per_s(kept), max_concurrent_requests(kept),
        )


def _policy_result(name: str, outcomes: list[_SegmentOutcome]) -> PolicyResult:
    records = [r for o in outcomes for r in o.records]
    table = RequestTable.from_records(records)
    metrics = summarize(table, sum(o.duration_s for o in outcomes))
    metrics["max_output_tokens_per_s"] = max(o.peak_output_tokens_per_s for o in outcomes)
    metrics["max_concurrent_requests"] = max(o.peak_concurrent_requests for o in outcomes)
    experts = total_expert_stats([o.experts for o in outcomes])
    if experts is not None:
        metrics |= experts.as_dict()
    return PolicyResult(name, metrics, table, tuple(records))


async def compare_policies(config: BenchConfig) -> ComparisonResult:
    """The comparison at ``config.request_rate`` (async; see ``run_policy_comparison``)."""
    prompts = sample_prompts(load_prompts(config.prompts_path), config.num_prompts, config.seed)
    offsets = poisson_arrivals(len(prompts), config.request_rate, config.seed)
    names = config.names
    plan = interleaved_plan(len(prompts), names, config.rounds, config.seed)
    # vLLM's benchmark client has no connection cap; a pool limit would queue requests
    # client-side and charge the wait to TTFT.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=config.request_timeout_s) as client:
        # The eldr proxy's admin API only when one of its policies is benched: a run of
        # routers alone may have no eldr proxy at all.
        admin = ProxyAdmin(client, config.url) if config.policies else None
        state = await admin.state() if admin is not None else {}
        worker_urls = (
            config.decode_urls if config.decode_urls is not None else (decode_worker_urls(state))
        )
        if not worker_urls:
            log.warning("no decode worker URLs (proxy state or --decode-urls): no expert counts")
        initial_policy, initial_seed = state.get("policy"), state.get("policy_seed")
        models = admin or ProxyAdmin(client, config.url_of(names[0]))
        model_id = config.model or await models.served_model()
        outcomes: dict[str, list[_SegmentOutcome]] = {p: [] for p in names}
        policy_states: dict[str, dict] = {}
        with tqdm(
            total=len(prompts) * len(names),
            desc=f"bench {rate_label(config.request_rate)} req/s",
            unit="req",
            disable=not config.show_progress,
        ) as progress:
            runner = _Runner(config, client, prompts, offsets, worker_urls, progress)
            for seg in plan:
                progress.set_postfix(round=seg.round, policy=seg.policy)
                if admin is not None and seg.policy in config.policies:
                    policy_states[seg.policy] = await admin.set_policy(
                        seg.policy, config.policy_config.overrides(seg.policy), seg.policy_seed
                    )
                outcomes[seg.policy].append(await runner.run_segment(seg))
        switched = [s for s in plan if s.policy in config.policies]
        last = switched[-1] if switched else None
        if admin is not None and last is not None and isinstance(initial_policy, str) and (
            initial_policy != last.policy or initial_seed != last.policy_seed
        ):
            # Leave the proxy as we found it.
            seed = initial_seed if isinstance(initial_seed, int) else None
            await admin.set_policy(initial_policy, seed=seed)

    results = {p: _policy_result(p, outcomes[p]) for p in names}
    info: dict[str, object] = {
        "url": config.url,
        "model_id": model_id,
        "tokenizer_id": model_id,
        "num_prompts": len(prompts),
        "prompts_path": str(config.prompts_path),
        "max_concurrency": config.max_concurrency,
        "max_tokens": config.max_tokens,
        "seed": config.seed,
        "rounds": len(plan) // len(names),
        "warmup_s": config.warmup_s,
        "decode_urls": list(worker_urls),
        "num_layers": config.num_layers,
        "policy_order": [s.policy for s in plan],
        "policy_seeds": [s.policy_seed for s in plan],
        "proxy_state": {p: policy_states[p] for p in config.policies},
        "routers": {r.name: r.url for r in config.routers},
    }
    comparison = ComparisonResult(config.request_rate, results, info)
    if config.result_dir is not None:
        save_comparison(comparison, config.result_dir)
    return comparison


def run_policy_comparison(config: BenchConfig) -> ComparisonResult:
    """Run the interleaved comparison against the proxy at one request rate."""
    return asyncio.run(compare_policies(config))


def run_rate_sweep(config: BenchConfig, rates: Sequence[float]) -> list[ComparisonResult]:
    """One comparison per request rate (the rest of ``config`` unchanged)."""
    if not rates:
        raise EldrError("give at least one request rate")
    if any(math.isnan(r) or r <= 0 for r in rates):
        raise EldrError(f"request rates must be > 0 or inf, got {list(rates)}")
    return [run_policy_comparison(replace(config, request_rate=rate)) for rate in rates]
