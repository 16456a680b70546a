"""Decode workers' expert counters, read from their Prometheus ``/metrics``.

eldr's vLLM plugin exports three counters per decode worker:

- ``eldr_decode_steps_total``: decode steps run;
- ``eldr_decode_active_experts_total``: over those steps, distinct experts summed over layers;
- ``eldr_decode_step_seconds_total``: wall time spent in those steps.

So between two scrapes, mean distinct experts per layer per step = d(active) / d(steps) / L.
Names are matched loosely because exporters decorate them: vLLM-style prefixes
(``vllm:eldr_decode_steps_total``), a missing ``_total``, or step seconds exported as a
histogram/summary (``..._seconds_sum``). Label sets (engine index, model name) are summed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import httpx

from stages.bench.live.prometheus_text import increase, samples
from stages.errors import EldrError

STEPS = "eldr_decode_steps"
ACTIVE_EXPERTS = "eldr_decode_active_experts"
STEP_SECONDS = "eldr_decode_step_seconds"


@dataclass(frozen=True)
class DecodeCounters:
    """Cumulative counter values of one worker (or a delta, or a sum over workers)."""

    steps: float
    active_experts: float
    step_seconds: float = float("nan")  # NaN when the worker does not export it

    def __add__(self, other: DecodeCounters) -> DecodeCounters:
        return DecodeCounters(
            self.steps + other.steps,
            self.active_experts + other.active_experts,
            self.step_seconds + other.step_seconds,
        )


@dataclass(frozen=True)
class ExpertStats:
    """Expert activity of the decode workers over one measured window."""

    steps: float
    active_experts: float
    step_seconds: float
    num_layers: int | None = None

    def __add__(self, other: ExpertStats) -> ExpertStats:
        return ExpertStats(
            self.steps + other.steps,
            self.active_experts + other.active_experts,
            self.step_seconds + other.step_seconds,
            self.num_layers,
        )

    @property
    def active_experts_per_step(self) -> float:
        """Distinct experts per decode step, summed over MoE layers."""
        return self.active_experts / self.steps if self.steps > 0 else float("nan")

    @property
    def distinct_experts_per_layer(self) -> float:
        """Mean distinct experts per layer per decode step (needs ``num_layers``)."""
        if not self.num_layers:
            return float("nan")
        return self.active_experts_per_step / self.num_layers

    @property
    def mean_step_ms(self) -> float:
        return 1000.0 * self.step_seconds / self.steps if self.steps > 0 else float("nan")

    def as_dict(self) -> dict[str, float]:
        return {
            "decode_steps": self.steps,
            "active_experts_per_step": self.active_experts_per_step,
            "distinct_experts_per_layer": self.distinct_experts_per_layer,
            "mean_decode_step_ms": self.mean_step_ms,
        }


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Sample name -> value summed over its label sets (comments and ``# TYPE`` skipped)."""
    totals: dict[str, float] = {}
    for name, _, value in samples(text):
        totals[name] = totals.get(name, 0.0) + value
    return totals


def _normalise(name: str) -> str:
    return name.replace(":", "_")


def find_counter(samples: Mapping[str, float], stem: str) -> float | None:
    """Value of the counter ``stem`` under any decoration, or None when absent.

    Accepted: ``<prefix>stem``, ``<prefix>stem_total`` and, as a fallback, ``<prefix>stem_sum``
    (a histogram's running sum). Two differently decorated copies would double count, so that
    is an error rather than a sum.
    """

    def matches(suffixes: tuple[str, ...]) -> dict[str, float]:
        found = {}
        for name, value in samples.items():
            norm = _normalise(name)
            for suffix in suffixes:
                if not norm.endswith(suffix):
                    continue
                core = norm[: len(norm) - len(suffix)]
                if core == stem or core.endswith("_" + stem):
                    found[name] = value
        return found

    found = matches(("_total", "")) or matches(("_sum",))
    if not found:
        return None
    if len(found) > 1:
        raise EldrError(f"ambiguous counter {stem!r}: several series match ({sorted(found)})")
    return next(iter(found.values()))


def decode_counters(samples: Mapping[str, float]) -> DecodeCounters | None:
    """eldr's decode counters from parsed samples; None when the worker exports none."""
    steps = find_counter(samples, STEPS)
    active = find_counter(samples, ACTIVE_EXPERTS)
    if steps is None or active is None:
        return None
    seconds = find_counter(samples, STEP_SECONDS)
    return DecodeCounters(steps, active, float("nan") if seconds is None else seconds)


def counter_delta(before: DecodeCounters, after: DecodeCounters) -> DecodeCounters:
    """``after - before``, counter by counter (``increase``: a restart in between counts what
    was counted since)."""

    return DecodeCounters(
        increase(before.steps, after.steps),
        increase(before.active_experts, after.active_experts),
        increase(before.step_seconds, after.step_seconds),
    )


Scrape = Mapping[str, DecodeCounters | None]


def expert_stats(before: Scrape, after: Scrape, num_layers: int | None) -> ExpertStats | None:
    """Sum over workers of the counter deltas; None unless every worker exports the counters
    in both scrapes (a partial sum would understate the cluster's activity)."""
    total = DecodeCounters(0.0, 0.0, 0.0)
    for url, b in before.items():
        a = after.get(url)
        if a is None or b is None:
            return None
        total = total + counter_delta(b, a)
    if not before:
        return None
    return ExpertStats(total.steps, total.active_experts, total.step_seconds, num_layers)


def total_expert_stats(parts: Sequence[ExpertStats | None]) -> ExpertStats | None:
    """The sum over a bench's parts (segments, runs); None unless every part has its stats (a
    partial sum would understate the cluster's activity)."""
    known = [p for p in parts if p is not None]
    if not known or len(known) < len(parts):
        return None
    total = known[0]
    for part in known[1:]:
        total = total + part
    return total


def metrics_url(worker_url: str) -> str:
    return worker_url.rstrip("/") + "/metrics"


async def scrape_metrics_pages(client: httpx.AsyncClient, worker_urls: Iterable[str],
                               timeout_s: float = 10.0) -> dict[str, str]:
    """Every worker's ``/metrics`` page, once. An unreachable worker is an error: a benchmark
    that silently lost a worker's counters would report a wrong cluster figure."""
    out: dict[str, str] = {}
    for url in worker_urls:
        try:
            response = await client.get(metrics_url(url), timeout=timeout_s)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise EldrError(f"cannot read {metrics_url(url)}: {exc}") from exc
        out[url] = response.text
    return out


async def scrape_decode_counters(
    client: httpx.AsyncClient, worker_urls: Iterable[str], timeout_s: float = 10.0
) -> dict[str, DecodeCounters | None]:
    """One scrape of every worker's decode counters (``scrape_metrics_pages``)."""
    pages = await scrape_metrics_pages(client, worker_urls, timeout_s)
    return {url: decode_counters(parse_prometheus_text(text)) for url, text in pages.items()}
