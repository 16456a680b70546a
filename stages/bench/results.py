"""What one benchmark (real or simulated) produced, and how it is saved.

Each policy's file keeps ``vllm bench serve``'s JSON shape (its keys, and for a live run its
per-request lists, one entry per request), with eldr's additions (policy, expert counters)
alongside, so the tooling that reads vLLM's files reads eldr's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import orjson

from stages.bench.metrics import RequestRecord, RequestTable
from stages.provenance import provenance


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    metrics: dict[str, float]  # metrics.summarize() keys, plus ExpertStats.as_dict()'s when known
    table: RequestTable
    records: tuple[RequestRecord, ...] = ()  # per request, load generator only
    # The table's rows per segment (round), in order; simulator only (a replay compares them).
    round_sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class ComparisonResult:
    """Every policy at one request rate, in the order given on the command line."""

    request_rate: float
    results: dict[str, PolicyResult]
    info: dict[str, object] = field(default_factory=dict)

    @property
    def policies(self) -> tuple[str, ...]:
        return tuple(self.results)

    def metrics(self) -> dict[str, dict[str, float]]:
        return {name: r.metrics for name, r in self.results.items()}


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def policy_json(
    result: PolicyResult, request_rate: float, info: dict[str, object]
) -> dict[str, object]:
    """One policy's file: ``vllm bench serve --save-result --save-detailed``'s keys (a live
    run's per-request lists hold one entry per request, failures included, as vLLM's do), and
    eldr's additions (policy, expert counters, proxy state, versions and command) beside
    them."""
    out: dict[str, object] = {
        "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai",
        "backend": "eldr",
        "label": result.policy,
        "policy": result.policy,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "burstiness": 1.0,  # Poisson arrivals
        # eldr's and vLLM's versions and the command line, which `eldr report` shows.
        **provenance(),
        **info,
        **result.metrics,
    }
    if result.records:
        records = result.records
        out |= {
            "request_goodput": None,
            "rtfx": 0.0,
            "input_lens": [r.prompt_tokens for r in records],
            "output_lens": [r.output_tokens for r in records],
            "ttfts": [r.ttft_s if r.success else 0.0 for r in records],
            "itls": [list(r.itl_s) for r in records],
            "latencies": [r.latency_s if r.success else 0.0 for r in records],
            "start_times": [r.start_s for r in records],  # from the start of its round
            "queue_times": [r.queue_s for r in records],
            "generated_texts": [r.generated_text for r in records],
            # Which prompt each request sent: a replay (``eldr bench --simulate``) looks its
            # signature up by id.
            "prompt_ids": [r.prompt_id for r in records],
            "errors": [r.error for r in records],
        }
    return out


def save_comparison(comparison: ComparisonResult, result_dir: Path) -> list[Path]:
    """``<policy>-<rate>qps.json`` per policy; NaN statistics are written as null."""
    result_dir = Path(result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    label = rate_label(comparison.request_rate)
    paths = []
    for name, result in comparison.results.items():
        path = result_dir / f"{name}-{label}qps.json"
        doc = policy_json(result, comparison.request_rate, comparison.info)
        path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        paths.append(path)
    return paths


def live_shape(info: dict[str, object]) -> str:
    """``1P2D`` from a live comparison's proxy state (each policy's snapshot lists the
    workers); the side the proxy did not report is left out."""
    states = info.get("proxy_state")
    state = next(iter(states.values()), None) if isinstance(states, dict) and states else None
    shape = ""
    for key, letter in (("prefill_workers", "P"), ("decode_workers", "D")):
        workers = state.get(key) if isinstance(state, dict) else None
        if key == "decode_workers" and not workers:
            workers = info.get("decode_urls")
        if isinstance(workers, list) and workers:
            shape += f"{len(workers)}{letter}"
    return shape
