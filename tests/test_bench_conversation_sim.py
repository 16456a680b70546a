"""The conversation simulator: its LRU prefix caches, conversation arrivals, and that routing
by what a worker holds hits its cache more than routing blind."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

from stages.bench.sim.conversation_sim import (
    ConversationSimConfig,
    simulate_conversations,
    simulate_outcomes,
)
from stages.bench.sim.conversation_workload import SimConversationSpec, build_turns
from stages.bench.sim.prefix_cache import PrefixCache
from stages.bench.workloads.blocks import block_hashes
from stages.errors import EldrError
from stages.routing import policies as routing_policies
from stages.routing.cost_model import gpu_like
from stages.routing.policies import DecodePolicy, PrefillRequest, RoutingRequest
from tests.sim_arrays import EXPERTS, LAYERS, TOP_K
from tests.sim_arrays import arrays as arrays  # a fixture, used by name


def small_config(policies: tuple[str, ...], **workload: object) -> ConversationSimConfig:
    spec = dict(conversations=60, turns=3, conversation_rate=10.0, think_time_s=0.5,
                system_prompts=2, system_tokens=64, message_tokens=48, output_tokens=32,
                max_model_len=4096)
    spec.update(workload)
    return ConversationSimConfig(cost=gpu_like(LAYERS, EXPERTS),
                                 workload=SimConversationSpec(**spec),  # type: ignore[arg-type]
                                 num_prefill=2, num_decode=4, policies=policies,
                                 block_size=16, prefill_cache_blocks=4096,
                                 decode_cache_blocks=4096)


def test_the_cache_serves_a_prompts_leading_cached_blocks_and_evicts_the_least_recent() -> None:
    a = block_hashes(list(range(64)), 16)  # 4 blocks
    b = block_hashes(list(range(100, 132)), 16)  # 2 blocks
    cache = PrefixCache(capacity_blocks=5)
    cache.insert(a)
    assert cache.cached_blocks(a, 64, 16) == 3  # the last token is always computed
    assert cache.cached_blocks(a, 65, 16) == 4
    # A block is usable only after its whole prefix.
    assert cache.cached_blocks(block_hashes([*range(16), *range(500, 548)], 16), 64, 16) == 1
    cache.insert(a[:1])  # a[0] used again: now the most recent
    cache.insert(b)  # 6 blocks > 5: the least recent (a[1]) goes
    assert len(cache) == 5 and cache.evicted == 1
    assert a[1] not in cache and a[0] in cache and all(h in cache for h in b)
    assert cache.cached_blocks(a, 65, 16) == 1  # a[2], a[3] are stranded past the gap
    with pytest.raises(ValueError):
        PrefixCache(0)


def test_turns_hold_their_history_below_the_models_length() -> None:
    spec = SimConversationSpec(conversations=5, turns=4, system_tokens=32, message_tokens=40,
                               output_tokens=30, max_model_len=240, seed=1)
    turns = build_turns(spec, num_rows=10)
    assert len(turns) == 20
    for r in range(len(turns)):
        assert turns.prompts[r].size + 30 <= 240
        if turns.turn[r] == 2:  # turn 1 and its answer lead turn 2
            previous = np.concatenate([turns.prompts[r - 1], turns.answers[r - 1]])
            assert np.array_equal(turns.prompts[r][: previous.size], previous)
    assert len(set(turns.row[turns.conversation == 0].tolist())) == 1


def test_a_next_turn_arrives_the_think_time_after_the_last_answer(arrays) -> None:  # type: ignore[no-untyped-def]
    config = small_config(("jsq",), think_time_s=0.75)
    turns, outcomes, _ = simulate_outcomes(config, arrays, TOP_K)
    o = outcomes["jsq"]
    later = np.flatnonzero(turns.turn >= 2)
    np.testing.assert_allclose(o.arrival[later], o.done[later - 1] + 0.75)
    first = np.flatnonzero(turns.turn == 1)
    np.testing.assert_allclose(o.arrival[first], turns.start_s)
    assert (o.first_token > o.arrival).all() and (o.done >= o.first_token).all()


class _HoldsMost(DecodePolicy):
    """A stand-in for a KV-aware policy: both legs to the worker holding the most of the
    prompt (ties: the least loaded)."""

    name: ClassVar[str] = "holds-most"
    reads_kv: ClassVar[bool] = True

    def choose(self, request: RoutingRequest) -> int:
        assert request.cached_tokens is not None and request.prompt_tokens > 0
        return _most(request.cached_tokens, request.loads)

    def choose_prefill(self, request: PrefillRequest) -> int:
        return _most(request.cached_tokens, request.loads)


def _most(cached: np.ndarray, loads: np.ndarray) -> int:
    return int(np.lexsort((loads, -cached))[0])


def test_routing_by_what_workers_hold_hits_more_than_random(
    arrays, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.setitem(routing_policies.POLICIES, _HoldsMost.name, _HoldsMost)
    config = small_config(("holds-most", "random"))
    metrics = simulate_conversations(config, arrays, TOP_K)
    aware, blind = metrics["holds-most"], metrics["random"]
    assert aware["decode_hit_share"] > blind["decode_hit_share"] + 0.1
    assert aware["decode_kv_pulled_tokens"] < blind["decode_kv_pulled_tokens"]
    assert aware["prefill_hit_share"] >= blind["prefill_hit_share"]
    # Nobody beats the workload's ideal (every turn on the worker holding its history).
    for m in metrics.values():
        assert m["prefill_hit_share"] <= m["ideal_prefill_hit_share"] + 1e-9
        assert m["completed"] == 180 and m["median_ttft_later_ms"] > 0


def test_the_simulator_writes_every_conversation_column(arrays) -> None:  # type: ignore[no-untyped-def]
    from stages.bench.metric_registry import CONVERSATION_METRICS

    metrics = simulate_conversations(small_config(("jsq",)), arrays, TOP_K)["jsq"]
    assert [m.key for m in CONVERSATION_METRICS if m.key not in metrics] == []
    per_worker = metrics["prefill_hit_share_by_worker"]
    assert len(per_worker) == 2  # one per prefill worker; NaN for one that served nothing
    assert all(0 <= v <= 1 for v in per_worker if not np.isnan(v))


def test_eldr_kv_runs_in_the_simulator(arrays) -> None:  # type: ignore[no-untyped-def]
    metrics = simulate_conversations(small_config(("eldr-kv", "rr")), arrays, TOP_K)
    assert metrics["eldr-kv"]["decode_kv_pulled_tokens"] <= metrics["rr"]["decode_kv_pulled_tokens"]
    with pytest.raises(EldrError, match="unknown policy"):
        small_config(("nope",))


def test_each_turn_records_how_busy_its_prompts_holder_was_at_its_arrival(arrays) -> None:
    """With one decode worker it holds everything: its load at a turn's arrival is at least the
    turns already decoding then (first token out, not done) and at most those arrived and not
    done."""
    from dataclasses import replace

    config = replace(small_config(("jsq",)), num_decode=1)
    _, outcomes, _ = simulate_outcomes(config, arrays, TOP_K)
    o = outcomes["jsq"]
    at = o.arrival[:, None]
    decoding = ((o.first_token[None, :] <= at) & (at < o.done[None, :])).sum(axis=1)
    arrived = ((o.arrival[None, :] < at) & (at < o.done[None, :])).sum(axis=1)
    assert (o.holder_load >= decoding).all() and (o.holder_load <= arrived).all()
    assert o.holder_load[np.argmin(o.arrival)] == 0 and o.holder_load.max() >= 2


def test_later_turns_ttft_splits_into_prefill_pull_and_first_step(arrays) -> None:  # type: ignore[no-untyped-def]
    config = small_config(("jsq",))
    turns, outcomes, _ = simulate_outcomes(config, arrays, TOP_K)
    o = outcomes["jsq"]
    # In order: arrival, prefill's end, KV on the decode worker, first token.
    assert (o.prefill_done > o.arrival).all() and (o.kv_ready > o.prefill_done).all()
    assert (o.first_token > o.kv_ready).all()
    metrics = simulate_conversations(config, arrays, TOP_K)["jsq"]
    parts = [metrics[k] for k in ("sim_ttft_prefill_ms", "sim_ttft_pull_ms",
                                  "sim_ttft_first_step_ms")]
    assert all(p > 0 for p in parts)
    assert sum(parts) == pytest.approx(metrics["sim_ttft_later_pd_ms"])
    later = turns.turn >= 2
    assert metrics["sim_ttft_later_pd_ms"] == pytest.approx(
        1e3 * float(np.mean((o.first_token - o.arrival)[later])))


def test_the_conversation_table_prints_the_simulated_ttft_split() -> None:
    from stages.bench.report import format_conversations

    parts = {"sim_ttft_later_pd_ms": 70.0, "sim_ttft_prefill_ms": 55.0,
             "sim_ttft_pull_ms": 5.0, "sim_ttft_first_step_ms": 10.0}
    text = format_conversations({"eldr-kv": parts, "live": {}})
    lines = text[text.index("where later turns' TTFT goes"):].splitlines()
    assert lines[3].split() == ["eldr-kv", "70.00", "55.00", "5.00", "10.00"]
    assert len(lines) == 4  # the router without the split has no row
