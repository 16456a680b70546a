"""Measure decode step time against distinct experts on running decode workers, and fit the
simulator's cost model to it.

For each worker, batch size B and domain mix m, B streaming requests are sent at once, their
prompts drawn from m domains (m = 1: same-domain batch, few distinct experts; all domains:
mixed batch, many). The worker's eldr counters before/after give the steps, distinct experts
and step seconds of exactly that batch; its mean decode batch is the decode tokens it produced
per step (robust to the ramp-up and drain steps). A plain vLLM server with eldr's plugin works:
a normal completion runs prefill and decode there. Prefill cost comes from single requests of
several prompt lengths (``max_tokens=1``, time to first token), measured first so no prompt is
in the prefix cache yet, on the prefill workers when given (a PD deployment's prefill runs
there, on its own cores), else on the measured workers. With prefill workers given, the KV
hand-off is timed too: each probe prompt (made new by a nonce, so no worker holds it) is
prefilled for a remote decode, then one token is decoded on each measured worker from that
hand-off; the slope of that time against the prompt's tokens is what pulling a token's KV costs
(``CostModel.kv_transfer_per_token_s``), the rest one step and the request around it.

Caveat the counters decide: if the plugin counts steps that also run a prefill chunk, the
first step of each batch carries prefill time; long ``max_tokens`` dilutes it.

The counters time a step's forward; a client sees the whole step, which adds the scheduler's
and the output's work around it. The batch's median gap between streamed tokens less its
counted step time, median over the batches, is that overhead: the fitted model carries it in
``base_s``, so a simulated step is the step a client sees (its ITL).

Every worker is measured at once, each on a batch of its own, as they run under load: workers
bound to one core share it as they do live (each holding ``1/n`` of it, ``n`` bound there; idle
vLLM PD workers would hold theirs too, busy-polling for KV transfers). The fitted model records
``n`` (``CostModel.core_sharing``, from ``core_sharing`` here), so a simulation counts the
sharing once, as its own cluster binds workers.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np

from stages.bench.live.client import CompletionSettings, stream_completion
from stages.bench.live.worker_metrics import (
    DecodeCounters,
    counter_delta,
    scrape_decode_counters,
)
from stages.bench.metrics import RequestRecord
from stages.errors import EldrError
from stages.prompts import Prompt, load_prompts
from stages.routing.cost_model import (
    CostModel,
    CostSample,
    fit_cost_model,
    fit_prefill,
    fit_quality,
)
from stages.serve.proxy.front.request import PREFILL_KV_TRANSFER_PARAMS
from stages.signature import wire


@dataclass(frozen=True)
class EngineCostConfig:
    worker_urls: tuple[str, ...]
    prompts_path: Path
    num_layers: int
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    domain_mixes: tuple[int, ...] = (1, 2, 0)  # domains per batch; 0 = every domain
    max_tokens: int = 64
    repeats: int = 2
    prefill_probes: int = 8  # 0: keep the default prefill cost
    # Where prefill is probed: a PD deployment's prefill workers; (): the measured workers.
    prefill_urls: tuple[str, ...] = ()
    model: str | None = None
    settle_s: float = 1.0
    timeout_s: float = 600.0
    seed: int = 0
    # Decode workers bound to each measured worker's cores (it included); () = 1 each.
    core_sharing: tuple[int, ...] = ()
    # One unmeasured request per prefill worker and one unmeasured batch (the largest size,
    # every domain) per decode worker first: a worker's first requests ran 10-60% slower than
    # the same ones later (the demo's first probe point: 113 ms a step against 67 ms in another
    # run), which a fit of a dozen points takes for a slope.
    warmup: bool = True
    # Prompts an earlier pass sent (``engine_cost_passes``): left out, so this pass finds none
    # of its prompts in the workers' prefix cache.
    exclude_prompts: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not self.worker_urls:
            raise EldrError("give at least one decode worker URL to measure")
        if self.core_sharing and (
            len(self.core_sharing) != len(self.worker_urls) or min(self.core_sharing) < 1
        ):
            raise EldrError("core sharing needs one count >= 1 per measured worker")
        if self.num_layers < 1:
            raise EldrError(f"num_layers must be >= 1, got {self.num_layers}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise EldrError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.max_tokens < 2:
            raise EldrError("max_tokens must be >= 2 to observe decode steps")
        if self.repeats < 1 or any(m < 0 for m in self.domain_mixes) or not self.domain_mixes:
            raise EldrError("repeats must be >= 1 and domain mixes >= 0 (0 = all domains)")


@dataclass(frozen=True)
class Measurement:
    worker_url: str
    batch_size: int  # requests sent together
    domains: int  # distinct domains among them
    sample: CostSample
    step_time_source: str  # "counter" (eldr_decode_step_seconds) or "tpot" (client side)
    # The batch's median gap between streamed tokens: its whole step, as a client sees it.
    client_step_s: float = float("nan")


@dataclass(frozen=True)
class EngineCostResult:
    measurements: tuple[Measurement, ...]
    model: CostModel
    quality: dict[str, float]  # of the fit to the counted steps, before the overhead
    prefill_points: tuple[tuple[int, float], ...] = field(default=())  # (tokens, seconds)
    # (prompt tokens, seconds to decode one token from a prefill's KV hand-off)
    transfer_points: tuple[tuple[int, float], ...] = field(default=())
    step_overhead_s: float = 0.0  # in model.base_s: the client's step less the counted one
    prompt_ids: tuple[str, ...] = ()  # every prompt sent, warm-up included

    @property
    def samples(self) -> tuple[CostSample, ...]:
        return tuple(m.sample for m in self.measurements)


def batch_prompts(
    by_domain: dict[str, list[Prompt]], size: int, domains: int, rng: np.random.Generator
) -> list[Prompt]:
    """``size`` prompts spread round-robin over ``domains`` randomly chosen domains."""
    names = sorted(by_domain)
    k = len(names) if domains == 0 else min(domains, len(names))
    chosen = [names[i] for i in rng.choice(len(names), size=k, replace=False)]
    pools = {d: list(rng.permutation(len(by_domain[d]))) for d in chosen}
    out = []
    for i in range(size):
        d = chosen[i % k]
        if not pools[d]:
            pools[d] = list(rng.permutation(len(by_domain[d])))
        out.append(by_domain[d][int(pools[d].pop())])
    return out


class _Measurer:
    def __init__(self, config: EngineCostConfig, client: httpx.AsyncClient) -> None:
        self.config = config
        self.client = client
        self.settings = CompletionSettings(
            max_tokens=config.max_tokens, model=config.model, timeout_s=config.timeout_s
        )
        self.counter = 0
        self.sent: list[str] = []

    async def _send(
        self, url: str, prompts: Sequence[Prompt], settings: CompletionSettings
    ) -> list[RequestRecord]:
        origin = time.perf_counter()
        self.counter += 1
        self.sent += [p.id for p in prompts]
        calls = [
            stream_completion(
                self.client,
                url,
                p.prompt,
                settings,
                f"eldr-cost-{self.counter}-{i}",
                origin,
                prompt_id=p.id,
                domain=p.domain,
            )
            for i, p in enumerate(prompts)
        ]
        records = await asyncio.gather(*calls)
        failed = [r for r in records if not r.success]
        if failed:
            raise EldrError(f"{len(failed)} request(s) to {url} failed: {failed[0].error}")
        return list(records)

    async def _counters(self, url: str) -> DecodeCounters:
        counters = (await scrape_decode_counters(self.client, [url]))[url]
        if counters is None:
            raise EldrError(
                f"{url}/metrics has no eldr_decode_steps/eldr_decode_active_experts counters;"
                " start the worker with eldr's vLLM plugin"
            )
        return counters

    async def batch(self, url: str, prompts: Sequence[Prompt], domains: int) -> Measurement:
        before = await self._counters(url)
        records = await self._send(url, prompts, self.settings)
        await asyncio.sleep(self.config.settle_s)
        delta = counter_delta(before, await self._counters(url))
        if delta.steps <= 0:
            raise EldrError(f"{url} counted no decode steps for a batch of {len(prompts)}")
        decode_tokens = sum(max(r.output_tokens - 1, 0) for r in records)
        # The median gap, not TPOT: when the batch's prefill takes two steps, the first
        # requests' TPOT carries the second (a long one) while their median gap does not.
        gaps = [g for r in records for g in r.itl_s]
        tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in records]
        client_step = float(np.median(gaps if gaps else tpots))
        if math.isfinite(delta.step_seconds):
            step_s, source = delta.step_seconds / delta.steps, "counter"
        else:
            step_s, source = float(np.median(tpots)), "tpot"
        sample = CostSample(
            batch=decode_tokens / delta.steps,
            distinct=delta.active_experts / delta.steps / self.config.num_layers,
            step_s=step_s,
            steps=delta.steps,
        )
        return Measurement(url, len(prompts), domains, sample, source, client_step)

    async def prefill(self, url: str, prompts: Sequence[Prompt]) -> list[tuple[int, float]]:
        settings = replace(self.settings, max_tokens=1)
        points = []
        for p in prompts:  # one at a time: TTFT without queueing
            (record,) = await self._send(url, [p], settings)
            points.append((record.prompt_tokens, record.ttft_s))
        return points


    async def transfer(self, prefill_url: str, decode_url: str,
                       prompts: Sequence[Prompt]) -> list[tuple[int, float]]:
        points = []
        for p in prompts:  # one at a time: the pull alone, no queue
            body = {"prompt": f"[{uuid.uuid4().hex}] {p.prompt}", "max_tokens": 1,
                    "temperature": 0, **({"model": self.config.model} if self.config.model
                                         else {})}
            response = await self.client.post(f"{prefill_url}/v1/completions", json={
                **body, "kv_transfer_params": dict(PREFILL_KV_TRANSFER_PARAMS)})
            response.raise_for_status()
            answer = response.json()
            kv = {k: v for k, v in (answer.get("kv_transfer_params") or {}).items()
                  if k not in (wire.SIGNATURE_KEY, wire.SHAPE_KEY)}
            if not kv:
                raise EldrError(f"{prefill_url} handed off no KV: is it a PD prefill worker"
                                " (NixlConnector)?")
            t0 = time.perf_counter()
            decoded = await self.client.post(f"{decode_url}/v1/completions",
                                             json={**body, "kv_transfer_params": kv})
            decoded.raise_for_status()
            points.append((int(answer["usage"]["prompt_tokens"]), time.perf_counter() - t0))
        return points


def _prefill_prompts(prompts: list[Prompt], n: int) -> list[Prompt]:
    """``n`` prompts spanning the length range (quantiles of character length)."""
    by_len = sorted(prompts, key=lambda p: len(p.prompt))
    idx = np.unique(np.linspace(0, len(by_len) - 1, n).round().astype(int))
    return [by_len[i] for i in idx]


async def _warm_up(
    measurer: _Measurer,
    config: EngineCostConfig,
    prompts: list[Prompt],
    by_domain: dict[str, list[Prompt]],
    rng: np.random.Generator,
) -> None:
    """Run, and drop, a first request on every prefill worker and a first full batch on every
    decode worker. The prefill one is a prompt the prefill probe does not time, so the probe
    still finds no prompt of its own in the prefix cache."""
    probed = {p.id for p in _prefill_prompts(prompts, config.prefill_probes)}
    spare = [p for p in prompts if p.id not in probed][:1]
    if config.prefill_probes > 0 and spare:
        for url in config.prefill_urls or config.worker_urls:
            await measurer.prefill(url, spare)
    size = max(config.batch_sizes)
    await asyncio.gather(*(
        measurer.batch(url, batch_prompts(by_domain, size, 0, rng), 0)
        for url in config.worker_urls
    ))


async def measure_engine_cost_async(config: EngineCostConfig) -> EngineCostResult:
    prompts = [p for p in load_prompts(config.prompts_path) if p.id not in config.exclude_prompts]
    if not prompts:
        raise EldrError(f"every prompt in {config.prompts_path} was sent by an earlier pass;"
                        " give more prompts")
    by_domain: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_domain.setdefault(p.domain, []).append(p)
    rng = np.random.default_rng(config.seed)
    measurements: list[Measurement] = []
    prefill_points: list[tuple[int, float]] = []
    transfer_points: list[tuple[int, float]] = []
    async with httpx.AsyncClient(timeout=config.timeout_s) as client:
        measurer = _Measurer(config, client)
        if config.warmup:
            await _warm_up(measurer, config, prompts, by_domain, rng)
        if config.prefill_probes > 0:
            probe = _prefill_prompts(prompts, config.prefill_probes)
            for url in config.prefill_urls or config.worker_urls:
                prefill_points += await measurer.prefill(url, probe)
            if config.prefill_urls:
                for url in config.worker_urls:
                    transfer_points += await measurer.transfer(config.prefill_urls[0], url,
                                                               probe)
        for _ in range(config.repeats):
            for size in config.batch_sizes:
                for mix in config.domain_mixes:
                    batches = [batch_prompts(by_domain, size, mix, rng) for _ in config.worker_urls]
                    measurements += await asyncio.gather(*(
                        measurer.batch(url, batch, len({p.domain for p in batch}))
                        for url, batch in zip(config.worker_urls, batches, strict=True)
                    ))
    sharing = dict(zip(config.worker_urls, config.core_sharing or (1,) * len(config.worker_urls),
                       strict=True))
    result = fit_measurements(measurements, prefill_points, config.num_layers, sharing,
                              transfer_points)
    return replace(result, prompt_ids=tuple(dict.fromkeys(measurer.sent)))


def shared_core_scale(core_sharing: dict[str, int]) -> dict[str, float]:
    """Per worker, the factor that brings its step times to the most shared worker's speed:
    one model at one share (each worker holds 1/n of its core)."""
    most = max(core_sharing.values())
    return {url: most / n for url, n in core_sharing.items()}


def fit_measurements(
    measurements: Sequence[Measurement],
    prefill_points: Sequence[tuple[int, float]],
    num_layers: int,
    core_sharing: dict[str, int],
    transfer_points: Sequence[tuple[int, float]] = (),
) -> EngineCostResult:
    """One cost model over measured batches (of one pass or several), with the client's
    overhead in its base, prefill fitted from the timed prompts and the KV pull from the timed
    hand-offs (the defaults without)."""
    prefill_kwargs: dict[str, float] = {}
    if len({t for t, _ in prefill_points}) >= 2:
        tokens, seconds = zip(*prefill_points, strict=True)
        base, per_token = fit_prefill(tokens, seconds)
        prefill_kwargs = {"prefill_base_s": base, "prefill_per_token_s": per_token}
    transfer: dict[str, float] = {}
    if len({t for t, _ in transfer_points}) >= 2:
        tokens, seconds = zip(*transfer_points, strict=True)
        transfer = {"kv_transfer_per_token_s": fit_prefill(tokens, seconds)[1]}
    scale = shared_core_scale(core_sharing)
    most = max(core_sharing.values())
    samples = [
        replace(m.sample, step_s=m.sample.step_s * scale[m.worker_url]) for m in measurements
    ]
    forward = fit_cost_model(samples, num_layers, core_sharing=most, **prefill_kwargs)
    gaps = [
        (m.client_step_s - m.sample.step_s) * scale[m.worker_url]
        for m in measurements
        if m.step_time_source == "counter" and math.isfinite(m.client_step_s)
    ]
    overhead = max(float(np.median(gaps)), 0.0) if gaps else 0.0
    return EngineCostResult(
        tuple(measurements),
        replace(forward, base_s=forward.base_s + overhead, **transfer),
        fit_quality(forward, samples),
        tuple(prefill_points),
        tuple(transfer_points),
        overhead,
    )


def measure_engine_cost(config: EngineCostConfig) -> EngineCostResult:
    """Measure every worker (all at once, a batch each) and fit one cost model to all
    samples."""
    return asyncio.run(measure_engine_cost_async(config))


def format_engine_cost(result: EngineCostResult) -> str:
    lines = [
        "decode step time against distinct experts, measured on the live decode workers",
        f"{'worker':<28} {'batch sent':>10} {'domains':>7} {'mean batch':>10} {'experts/L':>9}"
        f" {'step ms':>8} {'fit ms':>8} {'client ms':>9} {'steps':>6}",
    ]
    overhead = result.step_overhead_s
    for m in result.measurements:
        s = m.sample
        predicted = (float(result.model.step_time(s.batch, s.distinct)) - overhead) * 1000
        lines.append(
            f"{m.worker_url:<28} {m.batch_size:>10} {m.domains:>7} {s.batch:>10.2f}"
            f" {s.distinct:>9.2f} {s.step_s * 1000:>8.2f} {predicted:>8.2f}"
            f" {m.client_step_s * 1000:>9.2f} {s.steps:>6.0f}"
            + ("" if m.step_time_source == "counter" else "  (client TPOT)")
        )
    c = result.model
    lines.append(
        f"fit: step = {(c.base_s - overhead) * 1e3:.3f} ms + {c.per_token_s * 1e3:.4f} ms x"
        f" batch + {c.num_layers} x {c.per_expert_s * 1e3:.4f} ms x experts/L"
        f"   (R^2 {result.quality['r2']:.3f}, RMSE {result.quality['rmse_ms']:.3f} ms)"
    )
    lines.append(
        f"plus {overhead * 1e3:.2f} ms a step outside the counted one (client ms less step ms,"
        " median): the model's base is the whole step a client sees,"
        f" {c.base_s * 1e3:.3f} ms"
    )
    if c.core_sharing > 1:
        lines.append(
            f"measured at 1/{c.core_sharing} of a core (each worker shared its core with"
            f" {c.core_sharing - 1} idle one(s), which keep their share)"
        )
    lines.append(
        f"prefill: {c.prefill_base_s * 1e3:.2f} ms + {c.prefill_per_token_s * 1e3:.4f} ms x tokens"
        + ("" if result.prefill_points else " (default, not measured)")
    )
    return "\n".join(lines)
