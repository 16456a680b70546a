"""The benchmark's statistics follow vllm bench serve's definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stages.bench.metrics import RequestRecord, RequestTable, summarize


def _records() -> list[RequestRecord]:
    return [
        # 5 tokens: first at 0.1 s, then 4 gaps summing to 0.4 s -> TPOT 0.1 s.
        RequestRecord(
            "a",
            True,
            prompt_tokens=10,
            output_tokens=5,
            ttft_s=0.1,
            latency_s=0.5,
            itl_s=(0.05, 0.15, 0.1, 0.1),
        ),
        # 3 tokens, TPOT (0.9 - 0.3) / 2 = 0.3 s.
        RequestRecord(
            "b",
            True,
            prompt_tokens=20,
            output_tokens=3,
            ttft_s=0.3,
            latency_s=0.9,
            itl_s=(0.2, 0.4),
        ),
        # One token: has a TTFT and E2EL but no TPOT.
        RequestRecord("c", True, prompt_tokens=5, output_tokens=1, ttft_s=0.2, latency_s=0.2),
        RequestRecord("d", False, error="HTTP 500"),
    ]


def test_definitions_on_hand_made_records() -> None:
    m = summarize(RequestTable.from_records(_records()), duration_s=2.0)
    assert m["completed"] == 3
    assert m["failed"] == 1
    assert m["total_input_tokens"] == 35
    assert m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(22.0)
    # TPOT only for requests with more than one token: 100 ms and 300 ms.
    assert m["mean_tpot_ms"] == pytest.approx(200.0)
    assert m["median_tpot_ms"] == pytest.approx(200.0)
    # ITL pools every gap of every successful request.
    assert m["mean_itl_ms"] == pytest.approx(1000 * np.mean([0.05, 0.15, 0.1, 0.1, 0.2, 0.4]))
    assert m["median_itl_ms"] == pytest.approx(125.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_e2el_ms"] == pytest.approx(500.0)
    assert m["p99_e2el_ms"] == pytest.approx(np.percentile([500, 900, 200], 99))
    assert m["std_ttft_ms"] == pytest.approx(1000 * np.std([0.1, 0.3, 0.2]))
    for stat in ("mean", "median", "std", "p95", "p99"):
        for name in ("ttft", "tpot", "itl", "e2el"):
            assert f"{stat}_{name}_ms" in m


def test_tpot_is_mean_gap_after_first_token() -> None:
    rec = RequestRecord(
        "x", True, output_tokens=4, ttft_s=1.0, latency_s=1.6, itl_s=(0.1, 0.2, 0.3)
    )
    table = RequestTable.from_records([rec])
    assert table.tpot_s() == pytest.approx([np.mean(rec.itl_s)])


def test_no_successes_gives_nan_not_zero() -> None:
    m = summarize(RequestTable.from_records([RequestRecord("d", False, error="x")]), 1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert math.isnan(m["median_tpot_ms"]) and math.isnan(m["p99_ttft_ms"])
    assert m["request_throughput"] == 0.0


def test_every_reported_metric_is_a_key_a_bench_produces() -> None:
    """The registry names keys that exist: client timings from ``summarize``, expert figures
    from the decode workers' counters (or the simulator), so no table column or replay check
    reads a key nothing writes."""
    from stages.bench.live.worker_metrics import ExpertStats
    from stages.bench.metric_registry import METRICS

    record = RequestRecord("a", True, prompt_tokens=4, output_tokens=3, ttft_s=0.1,
                           latency_s=0.3, itl_s=(0.1, 0.1))
    expert_keys = ExpertStats(steps=1, active_experts=1, step_seconds=1, num_layers=1).as_dict()
    produced = set(summarize(RequestTable.from_records([record]), 1.0)) | set(expert_keys)
    assert [m.key for m in METRICS if m.key not in produced] == []
    assert len({m.key for m in METRICS}) == len(METRICS)
