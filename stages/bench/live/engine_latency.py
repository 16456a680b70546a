"""Where a request's time to first token goes, read from each worker's own vLLM histograms.

A client's TTFT through a PD router is the prefill worker's whole request (``max_tokens`` 1),
then the decode worker's time to its first token (the KV pull included), plus what neither
engine sees: the router's own work, its HTTP legs, and waiting for the engines' front ends.
vLLM 0.32 (``vllm/v1/metrics/loggers.py``) exports per engine, as histograms with ``_sum`` and
``_count``:

- ``vllm:e2e_request_latency_seconds``: a request's arrival at the front end to its end;
- ``vllm:time_to_first_token_seconds``: arrival to the first output token;
- ``vllm:request_queue_time_seconds``: time waiting to be scheduled (on a PD decode worker,
  the KV pull's wait included).

Means over a run (sum / count) are all that is kept: enough to say which part of a router's
mean TTFT grew, not its percentiles. Label sets are summed; a worker without the histogram
reads as NaN, never 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from stages.bench.live.prometheus_text import increases, samples, summed

E2E = "vllm:e2e_request_latency_seconds"
TTFT = "vllm:time_to_first_token_seconds"
QUEUE = "vllm:request_queue_time_seconds"
_STEMS = {E2E: "e2e", TTFT: "ttft", QUEUE: "queue"}

_NAN = float("nan")


@dataclass(frozen=True)
class EngineLatency:
    """Cumulative histogram sums (seconds) and counts of one worker, or a delta, or a total."""

    e2e_s: float = _NAN
    e2e_n: float = _NAN
    ttft_s: float = _NAN
    ttft_n: float = _NAN
    queue_s: float = _NAN
    queue_n: float = _NAN

    def minus(self, before: EngineLatency) -> EngineLatency:
        """``self - before`` (``increase``: a restart in between counts what came since)."""
        return increases(before, self)

    def mean_ms(self, stage: str) -> float:
        """The mean of ``stage`` (``e2e``, ``ttft`` or ``queue``) in ms; NaN without requests."""
        total, count = getattr(self, f"{stage}_s"), getattr(self, f"{stage}_n")
        return 1e3 * total / count if count > 0 else _NAN


def engine_latency(text: str) -> EngineLatency:
    """A worker's histogram sums and counts from its ``/metrics`` page."""
    sums: dict[str, float] = {}
    for name, _labels, value in samples(text):
        for suffix, kind in (("_sum", "s"), ("_count", "n")):
            stage = _STEMS.get(name.removesuffix(suffix)) if name.endswith(suffix) else None
            if stage is not None:
                key = f"{stage}_{kind}"
                sums[key] = sums.get(key, 0.0) + value
    return EngineLatency(**sums)


def deltas(before: Mapping[str, EngineLatency], after: Mapping[str, EngineLatency]
           ) -> dict[str, EngineLatency]:
    return {url: after[url].minus(b) for url, b in before.items()}


def total(latencies: Iterable[EngineLatency]) -> EngineLatency:
    """Summed over workers (the pool's mean is its total over its count)."""
    return summed(latencies, EngineLatency())


def ttft_parts_ms(client_mean_ttft_ms: float, prefill: EngineLatency, decode: EngineLatency
                  ) -> dict[str, float]:
    """A router's mean TTFT split into the prefill engines' whole request, the decode engines'
    time to first token (of it, their queue), and the rest (router, HTTP, front ends).

    Means over every request each pool served: where a decode worker prefilled some turns
    itself, those reached no prefill worker, and "outside" is then only approximate."""
    p = prefill.mean_ms("e2e")
    d = decode.mean_ms("ttft")
    outside = client_mean_ttft_ms - (0.0 if math.isnan(p) else p) - d
    return {"mean_ttft_ms": client_mean_ttft_ms, "prefill_engine_ms": p,
            "decode_engine_ttft_ms": d, "decode_engine_queue_ms": decode.mean_ms("queue"),
            "ttft_outside_engines_ms": outside}
