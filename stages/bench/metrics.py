"""Per-request measurements -> the result dict of ``vllm bench serve``.

Definitions (as vLLM's benchmark): TTFT = first streamed chunk - request sent; E2EL = last
streamed chunk - request sent; TPOT = (E2EL - TTFT) / (output_tokens - 1), only for requests
with more than one output token; ITL = every gap between consecutive chunks, pooled over
requests. Only successful requests enter the latency statistics. Throughputs divide by the
benchmark ``duration``. A statistic over no values is NaN (JSON null), not vLLM's 0, so an
empty column cannot pass for a perfect one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50.0, 95.0, 99.0)


@dataclass(frozen=True)
class RequestRecord:
    """One streamed request as the client saw it (times in seconds)."""

    request_id: str
    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = float("nan")
    latency_s: float = float("nan")
    itl_s: tuple[float, ...] = ()
    start_s: float = 0.0  # send time relative to the start of its run
    error: str = ""
    prompt_id: str = ""
    domain: str = ""
    queue_s: float = 0.0  # from its scheduled arrival to its send (a concurrency cap's wait)
    generated_text: str = ""


@dataclass(frozen=True)
class RequestTable:
    """Columns of a run's requests; the simulator builds it directly, without records.

    ``itl_s`` pools the inter-token gaps of the successful requests (it is not per request:
    the simulator has millions of them).
    """

    success: np.ndarray  # bool [N]
    prompt_tokens: np.ndarray  # int64 [N]
    output_tokens: np.ndarray  # int64 [N]
    ttft_s: np.ndarray  # float64 [N], NaN for failures
    latency_s: np.ndarray  # float64 [N], NaN for failures
    itl_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # float64 [M]

    @classmethod
    def from_records(cls, records: Sequence[RequestRecord]) -> RequestTable:
        ok = [r for r in records if r.success]
        itl = np.fromiter((g for r in ok for g in r.itl_s), dtype=np.float64)
        return cls(
            success=np.array([r.success for r in records], dtype=bool),
            prompt_tokens=np.array([r.prompt_tokens for r in records], dtype=np.int64),
            output_tokens=np.array([r.output_tokens for r in records], dtype=np.int64),
            ttft_s=np.array([r.ttft_s for r in records], dtype=np.float64),
            latency_s=np.array([r.latency_s for r in records], dtype=np.float64),
            itl_s=itl,
        )

    def __len__(self) -> int:
        return int(self.success.size)

    def tpot_s(self) -> np.ndarray:
        """TPOT of every successful request with at least two output tokens."""
        tpot = request_tpot_s(self.success, self.output_tokens, self.ttft_s, self.latency_s)
        return tpot[self.success & (self.output_tokens > 1)]


def request_tpot_s(
    success: np.ndarray, output_tokens: np.ndarray, ttft_s: np.ndarray, latency_s: np.ndarray
) -> np.ndarray:
    """Per request, in order: TPOT, or NaN for a failure or an answer of one token."""
    keep = success & (output_tokens > 1)
    tpot = np.full(success.size, np.nan)
    tpot[keep] = (latency_s[keep] - ttft_s[keep]) / (output_tokens[keep] - 1)
    return tpot


def _percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def _stats(prefix: str, values_s: np.ndarray, percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        nan = float("nan")
        out = {f"mean_{prefix}_ms": nan, f"median_{prefix}_ms": nan, f"std_{prefix}_ms": nan}
        out.update({f"{_percentile_key(p)}_{prefix}_ms": nan for p in percentiles})
        return out
    qs = np.percentile(ms, [50.0, *percentiles])
    out = {
        f"mean_{prefix}_ms": float(ms.mean()),
        f"median_{prefix}_ms": float(qs[0]),
        f"std_{prefix}_ms": float(ms.std()),
    }
    for p, q in zip(percentiles, qs[1:], strict=True):
        out[f"{_percentile_key(p)}_{prefix}_ms"] = float(q)
    return out


def summarize(
    table: RequestTable, duration_s: float, percentiles: Sequence[float] = PERCENTILES
) -> dict[str, float]:
    """The ``vllm bench serve`` result keys for one run of ``duration_s`` seconds."""
    ok = table.success
    completed = int(ok.sum())
    total_in = int(table.prompt_tokens[ok].sum())
    total_out = int(table.output_tokens[ok].sum())

    def rate(amount: int) -> float:
        return amount / duration_s if duration_s > 0 else float("nan")

    result: dict[str, float] = {
        "duration": float(duration_s),
        "completed": completed,
        "failed": len(table) - completed,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": rate(completed),
        "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
    }
    result |= _stats("ttft", table.ttft_s[ok], percentiles)
    result |= _stats("tpot", table.tpot_s(), percentiles)
    result |= _stats("itl", table.itl_s, percentiles)
    result |= _stats("e2el", table.latency_s[ok], percentiles)
    return result


def max_output_tokens_per_s(records: Sequence[RequestRecord]) -> float:
    """Most output tokens that arrived within one second of the run (vLLM's peak figure)."""
    times = [
        t
        for r in records
        if r.success
        for t in np.cumsum([r.start_s + r.ttft_s, *r.itl_s])
    ]
    if not times:
        return 0.0
    return float(np.bincount(np.floor(np.asarray(times) - min(times)).astype(int)).max())


def max_concurrent_requests(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once, from send to last token (or failure)."""
    events = sorted(
        (t, step)
        for r in records
        for t, step in ((r.start_s, 1), (r.start_s + (r.latency_s if r.success else 0.0), -1))
    )
    return int(max(itertools.accumulate(step for _, step in events), default=0))
