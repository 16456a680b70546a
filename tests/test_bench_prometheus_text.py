"""The one reader of workers' /metrics pages that the bench's cache and expert counters share."""

from __future__ import annotations

import math

import pytest

from stages.bench.live.cache_counters import cache_counters
from stages.bench.live.prometheus_text import Sample, increase, samples
from stages.bench.live.worker_metrics import parse_prometheus_text
from stages.errors import EldrError

PAGE = """\
# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.
vllm:prompt_tokens_by_source_total{engine="0",source="local_compute",model_name="m {odd}"} 5.0
vllm:prompt_tokens_by_source_total{engine="1",source="external_kv_transfer"} 7.0 1712000000000

up 1
"""


def test_each_sample_comes_with_its_labels_whatever_their_values_hold() -> None:
    assert list(samples(PAGE)) == [
        Sample("vllm:prompt_tokens_by_source_total",
               {"engine": "0", "source": "local_compute", "model_name": "m {odd}"}, 5.0),
        Sample("vllm:prompt_tokens_by_source_total",
               {"engine": "1", "source": "external_kv_transfer"}, 7.0),
        Sample("up", {}, 1.0),
    ]
    # Both counter readers read the page through it.
    assert parse_prometheus_text(PAGE)["vllm:prompt_tokens_by_source_total"] == 12.0
    counters = cache_counters(PAGE)
    assert (counters.computed_tokens, counters.external_tokens) == (5.0, 7.0)


@pytest.mark.parametrize("line", ['x{a="1" 2', 'x{a=1} 2', "x", 'x{a="1"}'])
def test_a_line_that_is_not_prometheus_text_is_named(line: str) -> None:
    with pytest.raises(EldrError, match="line 2 of a /metrics page is not Prometheus text"):
        list(samples(f"ok 1\n{line}\n"))


def test_a_counter_that_went_down_counts_from_its_restart() -> None:
    assert increase(10.0, 25.0) == 15.0
    assert increase(25.0, 10.0) == 10.0  # restarted in between
    assert math.isnan(increase(float("nan"), 3.0)) and math.isnan(increase(3.0, float("nan")))
