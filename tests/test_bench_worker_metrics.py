"""Reading eldr's decode counters from Prometheus text, as exporters decorate them."""

from __future__ import annotations

import math

import pytest

from stages.bench.live.worker_metrics import (
    DecodeCounters,
    ExpertStats,
    counter_delta,
    decode_counters,
    expert_stats,
    find_counter,
    parse_prometheus_text,
    total_expert_stats,
)
from stages.errors import EldrError

VLLM_STYLE = """\
# HELP vllm:eldr_decode_steps_total Decode steps.
# TYPE vllm:eldr_decode_steps_total counter
vllm:eldr_decode_steps_total{engine="0",model_name="m"} 100.0
vllm:eldr_decode_steps_total{engine="1",model_name="m"} 50.0
vllm:eldr_decode_steps_created{engine="0",model_name="m"} 1.7e9
vllm:eldr_decode_active_experts_total{engine="0",model_name="m"} 4000.0
vllm:eldr_decode_active_experts_total{engine="1",model_name="m"} 2000.0
vllm:eldr_decode_step_seconds_total{engine="0",model_name="m {odd} \\"quoted\\""} 1.5
vllm:eldr_decode_step_seconds_total{engine="1",model_name="m"} 0.75
vllm:num_requests_running{model_name="m"} 3.0
"""


def test_sums_label_sets_and_ignores_created_and_comments() -> None:
    samples = parse_prometheus_text(VLLM_STYLE)
    assert samples["vllm:eldr_decode_steps_total"] == 150.0
    counters = decode_counters(samples)
    assert counters == DecodeCounters(150.0, 6000.0, 2.25)


def test_plain_names_and_histogram_sum_fallback() -> None:
    text = (
        "eldr_decode_steps 10\n"
        "eldr_decode_active_experts_total 320 1712000000000\n"
        'eldr_decode_step_seconds_bucket{le="+Inf"} 10\n'
        "eldr_decode_step_seconds_count 10\n"
        "eldr_decode_step_seconds_sum 0.2\n"
    )
    assert decode_counters(parse_prometheus_text(text)) == DecodeCounters(10.0, 320.0, 0.2)


def test_steps_is_not_confused_with_step_seconds() -> None:
    samples = {"eldr_decode_step_seconds_total": 3.0}
    assert find_counter(samples, "eldr_decode_steps") is None


def test_absent_counters_and_ambiguity() -> None:
    assert decode_counters(parse_prometheus_text("vllm:num_requests_running 1\n")) is None
    both = {"vllm:eldr_decode_steps_total": 1.0, "eldr_decode_steps_total": 1.0}
    with pytest.raises(EldrError, match="ambiguous"):
        find_counter(both, "eldr_decode_steps")
    seconds_missing = decode_counters({"eldr_decode_steps": 1.0, "eldr_decode_active_experts": 2})
    assert seconds_missing is not None and math.isnan(seconds_missing.step_seconds)


def test_malformed_text_is_an_error() -> None:
    with pytest.raises(EldrError, match="line 2"):
        parse_prometheus_text('ok 1\nbroken{a="1" 2\n')


def test_deltas_handle_restarts_and_per_layer_mean() -> None:
    a = DecodeCounters(100.0, 4000.0, 2.0)
    b = DecodeCounters(300.0, 10000.0, 5.0)
    assert counter_delta(a, b) == DecodeCounters(200.0, 6000.0, 3.0)
    # Counter went down: the worker restarted; what it counted since is the increase.
    assert counter_delta(b, a) == a
    stats = expert_stats({"w0": a, "w1": a}, {"w0": b, "w1": b}, num_layers=10)
    assert stats is not None
    assert stats.steps == 400.0
    assert stats.active_experts_per_step == pytest.approx(30.0)
    assert stats.distinct_experts_per_layer == pytest.approx(3.0)
    assert stats.mean_step_ms == pytest.approx(15.0)
    # A worker without counters makes the cluster figure unknown, not partial.
    assert expert_stats({"w0": a, "w1": None}, {"w0": b, "w1": None}, 10) is None


def test_a_benchs_parts_sum_to_its_expert_stats_only_when_every_part_has_them() -> None:
    a = ExpertStats(10.0, 300.0, 0.5, num_layers=10)
    b = ExpertStats(30.0, 500.0, 1.5, num_layers=10)
    assert total_expert_stats([a, b]) == ExpertStats(40.0, 800.0, 2.0, num_layers=10)
    assert total_expert_stats([a]) == a
    assert total_expert_stats([a, None]) is None  # a partial sum would understate them
    assert total_expert_stats([]) is None
