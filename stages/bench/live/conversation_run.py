"""The conversation bench on live workers: every router (or eldr policy) in every round on
its own fresh conversations, turn k+1 sent only after turn k's answer arrived plus the think
time, several conversations in flight at once.

Round r runs every target once, in an order rotated by r (as ``loadgen``'s rounds: drift lands
on all alike). Before and after each run the workers' own counters are read: each prefill
worker's prefix-cache queries and hits, each decode worker's prompt tokens pulled over the KV
connector, every worker's latency histograms (``engine_latency``: where TTFT goes), and the
decode workers' expert counters when they export them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np

from stages.bench.live import engine_latency
from stages.bench.live.admin import ProxyAdmin
from stages.bench.live.cache_counters import CacheCounters, cache_counters, deltas
from stages.bench.live.client import CompletionSettings, stream_chat
from stages.bench.live.engine_latency import EngineLatency
from stages.bench.live.targets import Target
from stages.bench.live.worker_metrics import (
    ExpertStats,
    expert_stats,
    scrape_decode_counters,
    scrape_metrics_pages,
)
from stages.bench.metrics import RequestRecord
from stages.bench.workloads.chat_tokens import ChatTokenizer
from stages.bench.workloads.conversations import Conversation, History
from stages.bench.workloads.ideal_hits import SentTurn
from stages.errors import EldrError
from stages.routing.policy_config import PolicyConfig

log = logging.getLogger(__name__)

# (run index, salt) -> that run's conversations, all new to every worker's cache.
ConversationSource = Callable[[int, str], list[Conversation]]


@dataclass(frozen=True)
class ConversationBenchConfig:
    targets: tuple[Target, ...]
    source: ConversationSource
    tokenizer: ChatTokenizer
    turns: int
    max_concurrency: int = 3  # conversations in flight
    think_time_s: float = 1.0
    max_tokens: int = 64
    rounds: int = 1
    seed: int = 0
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    model: str | None = None
    request_timeout_s: float = 600.0
    scrape_settle_s: float = 1.0  # let workers publish their last steps before reading
    num_layers: int | None = None
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)

    def __post_init__(self) -> None:
        if not self.targets:
            raise EldrError("nothing to bench")
        for name in ("turns", "max_concurrency", "rounds", "max_tokens"):
            if getattr(self, name) < 1:
                raise EldrError(f"{name.replace('_', ' ')} must be >= 1,"
                                f" got {getattr(self, name)}")


@dataclass(frozen=True)
class TurnRecord:
    record: RequestRecord
    conversation: int
    turn: int  # 1-based
    sent: SentTurn


@dataclass(frozen=True)
class RunOutcome:
    """One target in one round."""

    target: str
    round: int
    turns: tuple[TurnRecord, ...]
    duration_s: float
    prefill: dict[str, CacheCounters]  # counter deltas per prefill worker
    decode: dict[str, CacheCounters]
    experts: ExpertStats | None
    dropped_pairs: int  # history pairs dropped to stay below the model's length
    prefill_latency: dict[str, EngineLatency] = field(default_factory=dict)  # deltas per worker
    decode_latency: dict[str, EngineLatency] = field(default_factory=dict)


@dataclass(frozen=True)
class _Counters:
    """One scrape of every worker's pages."""

    prefill: dict[str, CacheCounters]
    decode: dict[str, CacheCounters]
    prefill_latency: dict[str, EngineLatency]
    decode_latency: dict[str, EngineLatency]


def run_salt(seed: int, round_: int, target: str) -> str:
    return f"s{seed}r{round_}{target}"


class _Run:
    def __init__(self, config: ConversationBenchConfig, client: httpx.AsyncClient) -> None:
        self.cfg = config
        self.client = client
        self.settings = CompletionSettings(max_tokens=config.max_tokens, model=config.model,
                                           timeout_s=config.request_timeout_s)

    async def _counters(self) -> _Counters:
        cfg = self.cfg
        prefill = await scrape_metrics_pages(self.client, cfg.prefill_urls)
        decode = await scrape_metrics_pages(self.client, cfg.decode_urls)
        return _Counters(
            {u: cache_counters(t) for u, t in prefill.items()},
            {u: cache_counters(t) for u, t in decode.items()},
            {u: engine_latency.engine_latency(t) for u, t in prefill.items()},
            {u: engine_latency.engine_latency(t) for u, t in decode.items()})

    async def conversation(self, target: Target, index: int, conversation: Conversation,
                           origin: float, tag: str) -> tuple[list[TurnRecord], int]:
        cfg = self.cfg
        history = History(conversation, cfg.tokenizer, cfg.max_tokens)
        out: list[TurnRecord] = []
        for turn in range(min(cfg.turns, len(conversation.user_messages))):
            messages, prompt_ids = history.messages_for(turn)
            record = await stream_chat(
                self.client, target.url, messages, self.settings,
                request_id=f"bench-{tag}-c{index}-t{turn + 1}", origin=origin,
                prompt_id=f"{conversation.id}-t{turn + 1}", domain=conversation.domain)
            answer_ids = tuple(cfg.tokenizer.encode(record.generated_text))
            out.append(TurnRecord(record, index, turn + 1,
                                  SentTurn(tuple(prompt_ids), answer_ids)))
            if not record.success:
                break  # a history without its answer is not the conversation any more
            history.answered(turn, record.generated_text)
            if turn + 1 < cfg.turns:
                await asyncio.sleep(cfg.think_time_s)
        return out, history.dropped_pairs

    async def run(self, target: Target, round_: int, run_index: int) -> RunOutcome:
        cfg = self.cfg
        salt = run_salt(cfg.seed, round_, target.name)
        conversations = cfg.source(run_index, salt)
        if target.policy is not None:
            options = (dict(target.options) if target.options is not None
                       else cfg.policy_config.overrides(target.policy))
            await ProxyAdmin(self.client, target.url).set_policy(
                target.policy, options, cfg.seed + round_)
        before = await self._counters()
        experts0 = (await scrape_decode_counters(self.client, cfg.decode_urls)
                    if cfg.decode_urls else None)
        semaphore = asyncio.Semaphore(cfg.max_concurrency)
        origin = time.perf_counter()

        async def one(i: int, c: Conversation) -> tuple[list[TurnRecord], int]:
            async with semaphore:
                return await self.conversation(target, i, c, origin, salt)

        done = await asyncio.gather(*(one(i, c) for i, c in enumerate(conversations)))
        duration = time.perf_counter() - origin
        await asyncio.sleep(cfg.scrape_settle_s)
        after = await self._counters()
        experts = None
        if experts0 is not None:
            experts1 = await scrape_decode_counters(self.client, cfg.decode_urls)
            experts = expert_stats(experts0, experts1, cfg.num_layers)
        turns = tuple(sorted((t for records, _ in done for t in records),
                             key=lambda t: t.record.start_s))
        return RunOutcome(
            target.name, round_, turns, duration, deltas(before.prefill, after.prefill),
            deltas(before.decode, after.decode), experts, sum(d for _, d in done),
            engine_latency.deltas(before.prefill_latency, after.prefill_latency),
            engine_latency.deltas(before.decode_latency, after.decode_latency))


def plan(targets: Sequence[Target], rounds: int) -> list[tuple[int, Target]]:
    """(round, target) in run order: round r starts with target r mod T."""
    return [(r, targets[(r + i) % len(targets)]) for r in range(rounds)
            for i in range(len(targets))]


async def run_conversations(config: ConversationBenchConfig,
                            progress: Callable[[str], None] | None = None) -> list[RunOutcome]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    outcomes = []
    async with httpx.AsyncClient(limits=limits, timeout=config.request_timeout_s) as client:
        runner = _Run(config, client)
        for run_index, (round_, target) in enumerate(plan(config.targets, config.rounds)):
            outcome = await runner.run(target, round_, run_index)
            if progress is not None:
                failed = sum(not t.record.success for t in outcome.turns)
                progress(f"round {round_} {target.name}: {len(outcome.turns)} turns,"
                         f" {failed} failed, {outcome.duration_s:.1f} s")
            outcomes.append(outcome)
    return outcomes


def seeded_draw(items: Sequence[Conversation], count: int, seed: int) -> ConversationSource:
    """A source of ``count`` conversations a run from a fixed set (a ShareGPT file): each run
    draws the next ones of a seeded order (fresh while the set lasts, then a new pass), and
    the salt heads their system prompt, so even a repeat finds no cached block."""
    from stages.bench.workloads.conversations import salted

    order = np.random.default_rng(seed).permutation(len(items))

    def source(run_index: int, salt: str) -> list[Conversation]:
        picks = [items[int(order[(run_index * count + i) % len(items)])] for i in range(count)]
        return salted(picks, salt)

    return source
