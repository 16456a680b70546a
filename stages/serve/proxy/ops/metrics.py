"""Prometheus metrics of one proxy, in a registry of its own (never the global one), so two
proxies in one process (tests, benches) do not collide."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stages.serve.proxy.ops.rejoin import RestartCounts, SelfChecks, no_restarts
from stages.serve.proxy.view.published_batches import BatchGapCounts, PublishedBatches
from stages.serve.proxy.view.workers import WorkerPool

if TYPE_CHECKING:
    from stages.serve.proxy.view.kv_routing import KVRouting

class _Restarts(Collector):
    """``eldr_worker_restarts_total``: read from the supervisor at scrape time, as the gauges
    read the pools, so there is no second count to keep in step."""

    def __init__(self, pools: tuple[WorkerPool, ...], restarts: RestartCounts) -> None:
        self._pools = pools
        self._restarts = restarts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "eldr_worker_restarts", "Restarts of a worker eldr started, after its process ended.",
            labels=["worker"],
        )
        for pool in self._pools:
            for i, url in enumerate(pool.urls):
                family.add_metric([pool.name(i)], self._restarts(url))
        yield family


class _SelfCheckCounts(Collector):
    """``eldr_worker_self_check_passes_total`` and ``..._failures_total``: read from the
    workers' check records at scrape time, like the restarts."""

    def __init__(self, pools: tuple[WorkerPool, ...], checks: SelfChecks) -> None:
        self._pools = pools
        self._checks = checks

    def collect(self) -> Iterator[CounterMetricFamily]:
        passes = CounterMetricFamily(
            "eldr_worker_self_check_passes",
            "Self-checks a worker passed (eldr serve's start-up check and each rejoin).",
            labels=["role", "worker"],
        )
        failures = CounterMetricFamily(
            "eldr_worker_self_check_failures",
            "Self-checks that kept a worker out of rotation (no or a wrong signature, a bad"
            " answer, no answer in time).",
            labels=["role", "worker"],
        )
        for pool in self._pools:
            for i in range(len(pool)):
                record = self._checks.record(pool.role, i)
                passes.add_metric([pool.role, pool.name(i)], record.passed)
                failures.add_metric([pool.role, pool.name(i)], record.failed)
        yield passes
        yield failures


class _Ejections(Collector):
    """``eldr_worker_ejections_total``: read from the pools at scrape time."""

    def __init__(self, pools: tuple[WorkerPool, ...]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "eldr_worker_ejections", "Times a worker left rotation for failing requests in a"
            " row while answering its health probes (outlier ejection).",
            labels=["role", "worker"],
        )
        for pool in self._pools:
            for i in range(len(pool)):
                family.add_metric([pool.role, pool.name(i)], pool.ejections(i))
        yield family


class _KVViews(Collector):
    """What each worker's KV events told this proxy, read from its views at scrape time."""

    def __init__(self, kv: KVRouting) -> None:
        self._kv = kv

    def collect(self) -> Iterator[Metric]:
        trusted = GaugeMetricFamily(
            "eldr_kv_index_trusted", "1 while this proxy routes on what the worker's KV events"
            " say it holds; 0 while they are silent or undecodable (routed on load alone).",
            labels=["role", "worker"])
        blocks = GaugeMetricFamily("eldr_kv_blocks", "KV blocks the worker holds, as its"
                                   " events tell.", labels=["role", "worker"])
        counts = {
            "events": CounterMetricFamily("eldr_kv_event_batches", "KV event batches applied.",
                                          labels=["role", "worker"]),
            "gaps": CounterMetricFamily("eldr_kv_event_gaps", "Jumps in a worker's KV event"
                                        " sequence.", labels=["role", "worker"]),
            "lost": CounterMetricFamily("eldr_kv_event_lost", "Sequence jumps the replay could"
                                        " not fill (the worker's index was cleared).",
                                        labels=["role", "worker"]),
            "undecodable": CounterMetricFamily("eldr_kv_event_undecodable", "KV event messages"
                                               " that could not be decoded.",
                                               labels=["role", "worker"]),
            "overflows": CounterMetricFamily("eldr_kv_index_overflows", "Times the worker's"
                                             " index passed its bound of blocks and started"
                                             " over (its events miss removals).",
                                             labels=["role", "worker"]),
        }
        for role, view in (("prefill", self._kv.prefill), ("decode", self._kv.decode)):
            for w, row in enumerate(view.state()):
                name = [role, f"{role}-{w}"]
                trusted.add_metric(name, float(row["trusted"]))
                blocks.add_metric(name, row["blocks"])
                for key, family in counts.items():
                    family.add_metric(name, row[key])
        yield trusted
        yield blocks
        yield from counts.values()


# Routing decisions take microseconds; the default buckets start at 5 ms.
DECISION_BUCKETS = (
    5e-6,
    1e-5,
    2e-5,
    5e-5,
    1e-4,
    2e-4,
    5e-4,
    1e-3,
    2e-3,
    5e-3,
    1e-2,
    5e-2,
)


class ProxyMetrics:
    def __init__(
        self,
        decode: WorkerPool,
        prefill: WorkerPool,
        restarts: RestartCounts = no_restarts,
        checks: SelfChecks | None = None,
        kv: KVRouting | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if kv is not None:
            r.register(_KVViews(kv))
        # Prompt tokens routed, and of them the ones the chosen worker held (as this proxy's
        # KV view said): the share of prefix-cache hits routing aimed for, per leg.
        self.kv_prompt_tokens = Counter(
            "eldr_kv_prompt_tokens_total", "Prompt tokens of the requests routed by KV.",
            ["leg"], registry=r)
        self.kv_cached_tokens = Counter(
            "eldr_kv_cached_tokens_total", "Of them, the tokens the chosen worker held.",
            ["leg"], registry=r)
        # Each leg's children made once: looking a labelled child up costs 2 us a call, and
        # every request routed by KV counts on both legs.
        self._kv_legs = {leg: (self.kv_prompt_tokens.labels(leg),
                               self.kv_cached_tokens.labels(leg)) for leg in ("prefill", "decode")}
        self.local_prefills = Counter(
            "eldr_router_local_prefills_total", "Requests a decode worker prefilled itself (it"
            " held nearly all of the prompt): no prefill worker, no KV hand-off.", registry=r)
        r.register(_Restarts((prefill, decode), restarts))
        r.register(_Ejections((prefill, decode)))
        if checks is not None:
            r.register(_SelfCheckCounts((prefill, decode), checks))
        self.decisions = Counter(
            "eldr_router_decisions_total",
            "Decode routing decisions.",
            ["policy", "worker"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "eldr_router_decision_seconds",
            "Time to route one request to a decode worker (signature decode, transform, choose).",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.missing_signature = Counter(
            "eldr_router_missing_signature_total",
            "Requests routed by the JSQ fallback because the prefill sent no valid signature.",
            registry=r,
        )
        self.retries = Counter(
            "eldr_router_retries_total",
            "Requests re-sent to another worker after a failure that reached no client byte.",
            ["stage"],
            registry=r,
        )
        self.request_errors = Counter(
            "eldr_router_request_errors_total",
            "Requests that ended in an error, by kind.",
            ["kind"],
            registry=r,
        )
        self.connection_pool_exhausted = Counter(
            "eldr_router_connection_pool_exhausted_total",
            "Requests refused (503) because every upstream connection of the proxy was in use"
            " (max_connections): the proxy's own limit, no worker's failure.",
            registry=r,
        )
        self.refits = Counter(
            "eldr_router_refits_total", "Online centroid refits applied.", registry=r
        )
        inflight = Gauge(
            "eldr_router_inflight",
            "In-flight decode requests per decode worker.",
            ["worker"],
            registry=r,
        )
        prefill_inflight = Gauge(
            "eldr_router_prefill_inflight",
            "In-flight prefill requests per prefill worker.",
            ["worker"],
            registry=r,
        )
        healthy = Gauge(
            "eldr_router_worker_healthy",
            "1 when the worker is eligible for traffic.",
            ["role", "worker"],
            registry=r,
        )
        ejected = Gauge(
            "eldr_router_worker_ejected",
            "1 while the worker waits out an outlier ejection.",
            ["role", "worker"],
            registry=r,
        )
        # Labels carry short worker names (decode-0); the URL behind each is an info metric.
        workers = Info("eldr_router_worker", "The URL behind each worker name.", ["worker"],
                       registry=r)
        # Read the pools at scrape time: one source of truth, nothing to keep in sync.
        for pool, gauge in ((decode, inflight), (prefill, prefill_inflight)):
            for i, url in enumerate(pool.urls):
                name = pool.name(i)
                workers.labels(name).info({"url": url, "role": pool.role})
                gauge.labels(name).set_function(lambda p=pool, i=i: p.in_flight(i))
                healthy.labels(pool.role, name).set_function(
                    lambda p=pool, i=i: float(p.healthy(i))
                )
                ejected.labels(pool.role, name).set_function(
                    lambda p=pool, i=i: float(p.ejected(i))
                )
        if decode.published is not None:
            self._published_gauges(decode, decode.published, r)

    def routed_by_kv(self, leg: str, prompt_tokens: int, cached_tokens: int) -> None:
        """A request routed by KV on ``leg`` ("prefill", "decode"): its prompt tokens, and of
        them the ones the chosen worker held."""
        prompt, cached = self._kv_legs[leg]
        prompt.inc(prompt_tokens)
        cached.inc(cached_tokens)

    @staticmethod
    def _published_gauges(decode: WorkerPool, published: PublishedBatches,
                          r: CollectorRegistry) -> None:
        others = Gauge(
            "eldr_router_decode_others_inflight",
            "Requests on a decode worker that other proxies (or clients) sent, as it published.",
            ["worker"], registry=r,
        )
        age = Gauge(
            "eldr_router_decode_published_age_seconds",
            "Seconds since a decode worker last published its batch (-1: never).",
            ["worker"], registry=r,
        )
        for i in range(len(decode)):
            name = decode.name(i)
            others.labels(name).set_function(lambda i=i: float(published.others[i]))
            age.labels(name).set_function(
                lambda i=i: -1.0 if (a := published.age_s(i)) is None else a
            )
        r.register(BatchGapCounts(published, [decode.name(i) for i in range(len(decode))]))

    def render(self) -> bytes:
        return generate_latest(self.registry)
