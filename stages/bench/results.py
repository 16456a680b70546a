"""What one benchmark (real or simulated) produced, and how it is saved.

Each policy's file keeps ``vllm bench serve``'s JSON shape (its metric keys, plus the
per-request ``input_lens``/``output_lens``/``ttfts``/``itls``/``errors`` lists when the run had
real requests), with eldr's additions (policy, expert counters) alongside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import orjson

from stages.bench.metrics import RequestRecord, RequestTable

# Keys eldr adds to a policy's metrics dict (from the decode workers or the simulator).
EXPERT_KEYS = (
    "decode_steps",
    "active_experts_per_step",
    "distinct_experts_per_layer",
    "mean_decode_step_ms",
)


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    metrics: dict[str, float]  # metrics.summarize() keys, plus EXPERT_KEYS when known
    table: RequestTable
    records: tuple[RequestRecord, ...] = ()  # per request, load generator only


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
    out: dict[str, object] = {
        "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "backend": "eldr",
        "policy": result.policy,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        **info,
        **result.metrics,
    }
    if result.records:
        ok = [r for r in result.records if r.success]
        out |= {
            "input_lens": [r.prompt_tokens for r in ok],
            "output_lens": [r.output_tokens for r in ok],
            "ttfts": [r.ttft_s for r in ok],
            "itls": [list(r.itl_s) for r in ok],
            "errors": [r.error for r in result.records if not r.success],
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
