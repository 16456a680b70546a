"""Decode chosen at arrival: eldr-kv's option, and the simulator choosing decode before prefill
on the signature at arrival."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

from stages.bench.sim.conversation_sim import (
    ConversationSimConfig,
    _ArrivalCounts,
    simulate_outcomes,
)
from stages.bench.sim.conversation_workload import SimConversationSpec, build_turns
from stages.errors import EldrError
from stages.routing import policies as routing_policies
from stages.routing.context import RoutingContext
from stages.routing.cost_model import gpu_like
from stages.routing.policies import DecodePolicy, RoutingRequest, make_policy
from stages.routing.policy_config import PolicyConfig
from tests.sim_arrays import EXPERTS, LAYERS, TOP_K
from tests.sim_arrays import arrays as arrays  # a fixture, used by name


def _config(policies: tuple[str, ...], policy_config: PolicyConfig | None = None
            ) -> ConversationSimConfig:
    spec = SimConversationSpec(conversations=40, turns=3, conversation_rate=10.0,
                               think_time_s=0.5, system_prompts=2, system_tokens=64,
                               message_tokens=48, output_tokens=32, max_model_len=4096)
    return ConversationSimConfig(cost=gpu_like(LAYERS, EXPERTS), workload=spec, num_prefill=2,
                                 num_decode=4, policies=policies,
                                 policy_config=policy_config or PolicyConfig())


def test_eldr_kv_decodes_after_prefill_unless_told_arrival() -> None:
    context = RoutingContext(4)
    assert not make_policy("eldr-kv", context, {}).decodes_at_arrival
    assert make_policy("eldr-kv", context, {"decode_choice": "arrival"}).decodes_at_arrival
    with pytest.raises(EldrError, match="decode_choice must be one of after-prefill, arrival"):
        PolicyConfig.from_mapping({"eldr-kv": {"decode_choice": "at-once"}})


class _AtArrival(DecodePolicy):
    """Records, per decision, whether the turn's prefill had ended (it must not have)."""

    name: ClassVar[str] = "at-arrival"
    uses_counts: ClassVar[bool] = True
    seen: ClassVar[list[tuple[int, np.ndarray | None]]] = []

    @property
    def decodes_at_arrival(self) -> bool:
        return True

    def choose(self, request: RoutingRequest) -> int:
        cached = request.cached_tokens
        assert cached is not None
        self.seen.append((int(cached.max()), request.counts))
        return int(np.argmin(request.loads))


def test_the_simulator_chooses_decode_at_arrival_on_the_signature_then(
    arrays, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.setitem(routing_policies.POLICIES, _AtArrival.name, _AtArrival)
    monkeypatch.setattr(_AtArrival, "seen", [])
    turns, out, _ = simulate_outcomes(_config((_AtArrival.name,)), arrays, TOP_K)
    outcome = out[_AtArrival.name]
    assert len(_AtArrival.seen) == len(turns)
    assert np.isfinite(outcome.turn_distinct).all() and (outcome.turn_distinct > 0).all()
    # Every turn got a signature at arrival; a turn whose history a decode worker held was
    # priced on it (before prefill, the decode workers hold only finished turns' blocks).
    assert all(counts is not None for _, counts in _AtArrival.seen)
    assert max(held for held, _ in _AtArrival.seen) > 0
    # The first turn, nothing cached anywhere yet, had the mean routing's signature, not its
    # prefill counts: the choice came before its prefill.
    mean = arrays.prefill_counts.sum(axis=0) / arrays.prefill_counts.sum()
    first = _AtArrival.seen[0][1]
    assert first is not None
    np.testing.assert_allclose(first / first.sum(), mean, atol=0.01)


def test_the_signature_at_arrival_is_the_cached_share_exact_and_the_rest_the_mean(
    arrays  # type: ignore[no-untyped-def]
) -> None:
    turns = build_turns(SimConversationSpec(conversations=3, turns=2, system_tokens=64,
                                            message_tokens=32, output_tokens=16), len(arrays))
    counts = _ArrivalCounts(arrays, turns, 0.0)
    row = arrays.prefill_counts[int(turns.row[1])]
    np.testing.assert_array_equal(counts(1, int(turns.prompts[1].size)), row)
    nothing = counts(1, 0)
    mean = arrays.prefill_counts.sum(axis=0) / arrays.prefill_counts.sum()
    np.testing.assert_allclose(nothing, row.sum() * mean, atol=0.5)
    half = counts(1, int(turns.prompts[1].size) // 2)
    assert np.abs(half - row).sum() < np.abs(nothing - row).sum()
    # A perfect predictor's tail is the truth; half of one lies between.
    np.testing.assert_array_equal(_ArrivalCounts(arrays, turns, 1.0)(1, 0), row)
    halfway = _ArrivalCounts(arrays, turns, 0.5)(1, 0)
    np.testing.assert_allclose(halfway, 0.5 * row + 0.5 * row.sum() * mean, atol=0.5)


def test_eldr_kv_at_arrival_runs_with_and_without_local_prefill(arrays) -> None:  # type: ignore[no-untyped-def]
    for options in ({"decode_choice": "arrival"},
                    {"decode_choice": "arrival", "local_prefill_below": 4096}):
        config = _config(("eldr-kv",), PolicyConfig.from_mapping({"eldr-kv": options}))
        turns, out, _ = simulate_outcomes(config, arrays, TOP_K)
        outcome = out["eldr-kv"]
        assert np.isfinite(outcome.done).all()
        local = outcome.prefill_worker < 0
        # A local prefill pulls nothing; one chosen at arrival pulls what it lacks at prefill end.
        assert (outcome.decode_pulled[local] == 0).all()
        if "local_prefill_below" in options:
            assert local[turns.turn >= 2].any()
